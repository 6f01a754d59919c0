"""The console's searches on a PostgreSQL outbox of a million live rows: the plan of
every statement each search runs, the rows it read and its time, before and after the
table was analyzed.

The operations module runs each search (relaybox.operations.messages.Operations, as
the console, the JSON API and `relaybox messages` call it); every statement it sends is
recorded, then explained with ANALYZE on a session with the relay's settings, in a
transaction rolled back, with the rows both tables' scans read counted from the
transaction's own statistics.

    .venv/bin/python benchmarks/search_plans.py [--live 1000000] [--done 200000] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from _common import machine
from psycopg import sql as pgsql

from relaybox import sql
from relaybox.core.inspection import MessageFilter, MessageState
from relaybox.migrations import migrate
from relaybox.operations.messages import Operations
from relaybox.storage.postgres import SESSION_SETTINGS

URL = "postgresql://postgres@127.0.0.1:5432/relaybox_bench"
TABLE = "search_plans"
KEYS = 10_000
RUNS = 5


def fill(url: str, table: str, live: int, done: int) -> None:
    """`done` finished rows (the oldest seqs: published, every 100th abandoned), then
    `live` pending rows; KEYS keys over two targets, written in turn; every 1000th live
    row held, every 1000th (offset) delayed; one correlation id on one row."""
    values = (
        "g, gen_random_uuid(), CASE WHEN g % 2 = 0 THEN 'default' ELSE 'partner' END, 'orders',"
        f" 'order-' || (g % {KEYS}), hashtext('order-' || (g % {KEYS})) & 2147483647,"
        " 'OrderPlaced', 'application/json', convert_to('{\"n\": ' || g || '}', 'UTF8'),"
        " CASE WHEN g = 777777 THEN 'req-needle' END, now()"
    )
    columns = (
        "seq, id, target, topic, key, partition, type, content_type, payload, correlation_id,"
        " occurred_at"
    )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {table}_done ({columns}, status, published_at, abandoned_at)"
            f" SELECT {values},"
            " (CASE WHEN g % 100 = 0 THEN 'abandoned' ELSE 'published' END)::"
            f"{table}_status, CASE WHEN g % 100 <> 0 THEN now() END,"
            " CASE WHEN g % 100 = 0 THEN now() END"
            f" FROM generate_series(1, {done}) AS g"
        )
        conn.execute(
            f"INSERT INTO {table} ({columns}, status, available_at) OVERRIDING SYSTEM VALUE"
            f" SELECT {values}, 'pending', CASE WHEN g % 1000 = 0 THEN '9999-12-31+00'"
            " WHEN g % 1000 = 500 THEN now() + interval '1 day' ELSE now() END"
            f" FROM generate_series({done + 1}, {done + live}) AS g"
        )


def searches(live: int, done: int) -> dict[str, Callable[[Operations], Awaitable[Any]]]:
    middle = done + live // 2
    key = "order-4242"
    return {
        "newest page": lambda ops: ops.search(limit=50),
        "oldest page": lambda ops: ops.search(limit=50, newest_first=False),
        "page after a cursor (middle)": lambda ops: ops.search(limit=50, after=middle),
        "key and target": lambda ops: ops.search(MessageFilter(target="default", key=key)),
        "key, any target": lambda ops: ops.search(MessageFilter(key=key)),
        "key, abandoned": lambda ops: ops.search(
            MessageFilter(key="order-4200", states=frozenset({MessageState.ABANDONED}))
        ),
        "state held": lambda ops: ops.search(MessageFilter(states=frozenset({MessageState.HELD}))),
        "state abandoned": lambda ops: ops.search(
            MessageFilter(states=frozenset({MessageState.ABANDONED}))
        ),
        "message page (show)": lambda ops: ops.show(middle),
        "correlation id (no index)": lambda ops: ops.search(
            MessageFilter(correlation_id="req-needle")
        ),
    }


def recording(ops: Operations) -> list[tuple[str, list[Any]]]:
    """Every (query, parameters) the storage sends from now on."""
    sent: list[tuple[str, list[Any]]] = []
    storage: Any = ops.storage
    bind = storage._bind

    def recorded(name: str, args: Any) -> tuple[str, Any]:
        query, params = bind(name, args)
        sent.append((query, list(params)))
        return query, params

    storage._bind = recorded
    return sent


def session(url: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(url, autocommit=True, prepare_threshold=None)
    for name, value in SESSION_SETTINGS.items():
        conn.execute(pgsql.SQL("SELECT set_config({}, {}, false)").format(name, value))
    return conn


def _read(conn: psycopg.Connection[Any], table: str) -> int:
    ((read,),) = conn.execute(
        "SELECT coalesce(sum(seq_tup_read + coalesce(idx_tup_fetch, 0)), 0)"
        " FROM pg_stat_xact_user_tables WHERE relid IN (%s::regclass, %s::regclass)",
        (table, table + "_done"),
    ).fetchall()
    return int(read)


#: Plan nodes that scan no table or index of their own.
_NOT_READS = ("Subquery Scan", "WorkTable Scan")


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def explain(
    conn: psycopg.Connection[Any], table: str, sent: list[tuple[str, list[Any]]]
) -> list[dict[str, Any]]:
    """Each statement of one search explained with ANALYZE, in one transaction rolled
    back, in the order sent (a `SET LOCAL` the storage sent first is run as it is)."""
    found = []
    with conn.transaction(force_rollback=True):
        for query, params in sent:
            if query.lstrip().upper().startswith("SET LOCAL"):
                conn.execute(query)  # type: ignore[arg-type]
                continue
            found.append(_explain_one(conn, table, query, params))
    return found


def _explain_one(
    conn: psycopg.Connection[Any], table: str, query: str, params: list[Any]
) -> dict[str, Any]:
    conn.execute("DEALLOCATE ALL")
    conn.execute(pgsql.SQL("PREPARE q AS {}").format(pgsql.SQL(query)))  # type: ignore[arg-type]
    execute = (
        pgsql.SQL("EXECUTE q ({})").format(pgsql.SQL(", ").join(pgsql.Literal(p) for p in params))
        if params
        else pgsql.SQL("EXECUTE q")
    )
    before = _read(conn, table)
    ((found,),) = conn.execute(
        pgsql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) {}").format(execute)
    ).fetchall()
    read = _read(conn, table) - before
    plan = found[0]["Plan"]
    scans = sorted({
        f"{n['Node Type']} on {n.get('Index Name') or n.get('Relation Name')}"
        for n in _nodes(plan) if "Scan" in n["Node Type"] and "Function" not in n["Node Type"]
        and "CTE" not in n["Node Type"] and n["Node Type"] not in _NOT_READS
    })  # fmt: skip
    return {"rows_read": read, "rows": plan["Actual Rows"], "scans": scans,
            "seq_scan": any(n["Node Type"] == "Seq Scan" for n in _nodes(plan)),
            "execution_ms": round(found[0]["Execution Time"], 3)}  # fmt: skip


async def measure(url: str, table: str, live: int, done: int, state: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    async with Operations.opened(url, table) as ops:
        sent = recording(ops)
        with session(url) as conn:
            for name, search in searches(live, done).items():
                times = []
                for _ in range(RUNS):
                    sent.clear()
                    started = time.perf_counter()
                    await search(ops)
                    times.append(time.perf_counter() - started)
                statements = explain(conn, table, sent)
                found[name] = {
                    "median_ms": round(statistics.median(times) * 1000, 2),
                    "statements": len(statements),
                    "rows_read": sum(s["rows_read"] for s in statements),
                    "seq_scan": any(s["seq_scan"] for s in statements),
                    "scans": sorted({scan for s in statements for scan in s["scans"]}),
                    "plans": statements,
                }
                print(f"{state:>15} {name:<30} {found[name]['median_ms']:>9} ms "
                      f"{found[name]['rows_read']:>8} rows read  {found[name]['scans']}",
                      flush=True)  # fmt: skip
    return found


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=URL)
    parser.add_argument("--live", type=int, default=1_000_000)
    parser.add_argument("--done", type=int, default=200_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    table = f"{TABLE}_{int(time.time())}"
    await migrate(args.url, table=table)
    report: dict[str, Any] = {
        "benchmark": "search_plans", "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(), "live_rows": args.live, "done_rows": args.done,
    }  # fmt: skip
    try:
        started = time.perf_counter()
        fill(args.url, table, args.live, args.done)
        report["fill_seconds"] = round(time.perf_counter() - started, 1)
        report["never_analyzed"] = await measure(
            args.url, table, args.live, args.done, "never analyzed"
        )
        with psycopg.connect(args.url, autocommit=True) as conn:
            conn.execute(f"ANALYZE {table}")
            conn.execute(f"ANALYZE {table}_done")
        report["analyzed"] = await measure(args.url, table, args.live, args.done, "analyzed")
    finally:
        with psycopg.connect(args.url, autocommit=True) as conn:
            for suffix in (
                "_migrations",
                "_partitions",
                "_members",
                "_done",
                "_audit",
                "_backfills",
                "",
            ):
                conn.execute(f"DROP TABLE IF EXISTS {table}{suffix}")
            conn.execute(f"DROP TYPE IF EXISTS {table}_status")
            for function in sql.functions("postgresql", table):
                conn.execute(f"DROP FUNCTION IF EXISTS {function}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
