"""The console's searches on an outbox of a million live rows: the plan of every
statement each search runs, the rows it read and its time (PostgreSQL: before and after
the tables were analyzed; MariaDB and SQLite with `--dialect`).

The operations module runs each search (relaybox.operations.messages.Operations, as
the console, the JSON API and `relaybox messages` call it); every statement it sends is
recorded, then explained with ANALYZE on a session with the relay's settings, in a
transaction rolled back, with the rows both tables' scans read counted from the
transaction's own statistics.

MariaDB: the rows read are the session's `Handler_read%` counters around each call, and
the plans MariaDB's EXPLAIN of every statement. SQLite: every statement run again on a
connection of its own counts the virtual machine's steps (a step is about one
instruction; a row read is a few), and its plan is EXPLAIN QUERY PLAN's.

    .venv/bin/python benchmarks/search_plans.py [--dialect postgresql|mysql|sqlite]
        [--live 1000000] [--done 200000] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
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
from relaybox.tools.bench import SIDE_TABLES

URLS = {
    "postgresql": "postgresql://postgres@127.0.0.1:5432/relaybox_bench",
    "mysql": "mysql://root@127.0.0.1:3306/test",
}
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
        "overview: stuck per target": lambda ops: ops.stuck(),
        "stuck messages, newest 1,000": lambda ops: ops.search(
            MessageFilter(
                states=frozenset({MessageState.RETRYING, MessageState.HELD, MessageState.ABANDONED})
            ),
            limit=1000,
        ),
        "overview: counts": lambda ops: ops.stats(),
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
                conn.execute(query)
                continue
            found.append(_explain_one(conn, table, query, params))
    return found


def _explain_one(
    conn: psycopg.Connection[Any], table: str, query: str, params: list[Any]
) -> dict[str, Any]:
    conn.execute("DEALLOCATE ALL")
    conn.execute(pgsql.SQL("PREPARE q AS {}").format(pgsql.SQL(query)))
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


# -- MariaDB and SQLite: one table, finished rows beside the live ones ------------------

#: The columns both fill, with `key` and `partition` quoted as each dialect quotes them.
_ROW = (
    "seq, id, target, topic, {key}, {partition}, type, content_type, payload,"
    " correlation_id, occurred_at, status, available_at, published_at, abandoned_at"
)
_SQLITE_ROW = _ROW.format(key='"key"', partition='"partition"')
_MYSQL_ROW = _ROW.format(key="`key`", partition="`partition`")


def fill_mysql(url: str, table: str, live: int, done: int) -> None:
    import pymysql

    conn = pymysql.connect(host="127.0.0.1", port=3306, user="root", database="test",
                           autocommit=True)  # fmt: skip
    total = live + done
    with conn.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({_MYSQL_ROW})"
            f" SELECT seq, UUID(), IF(seq % 2 = 0, 'default', 'partner'), 'orders',"
            f" CONCAT('order-', seq % {KEYS}), CRC32(CONCAT('order-', seq % {KEYS})) & 2147483647,"
            " 'OrderPlaced', 'application/json', CONCAT('{{\"n\": ', seq, '}}'),"
            " IF(seq = 777777, 'req-needle', NULL), UTC_TIMESTAMP(6),"
            f" CASE WHEN seq > {done} THEN 'pending' WHEN seq % 100 = 0 THEN 'abandoned'"
            " ELSE 'published' END,"
            f" CASE WHEN seq > {done} AND seq % 1000 = 0 THEN '9999-12-31 00:00:00'"
            f" WHEN seq > {done} AND seq % 1000 = 500 THEN UTC_TIMESTAMP(6) + INTERVAL 1 DAY"
            " ELSE UTC_TIMESTAMP(6) END,"
            f" IF(seq <= {done} AND seq % 100 <> 0, UTC_TIMESTAMP(6), NULL),"
            f" IF(seq <= {done} AND seq % 100 = 0, UTC_TIMESTAMP(6), NULL)"
            f" FROM seq_1_to_{total}"
        )
    conn.close()


def fill_sqlite(path: str, table: str, live: int, done: int) -> None:
    import sqlite3

    now = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        f"WITH RECURSIVE g(seq) AS (SELECT 1 UNION ALL SELECT seq + 1 FROM g"
        f" WHERE seq < {live + done})"
        f" INSERT INTO {table} ({_SQLITE_ROW})"
        f" SELECT seq, lower(hex(randomblob(16))), CASE WHEN seq % 2 = 0 THEN 'default'"
        f" ELSE 'partner' END, 'orders', 'order-' || (seq % {KEYS}), seq % {KEYS},"
        " 'OrderPlaced', 'application/json', CAST('{\"n\": ' || seq || '}' AS BLOB),"
        f" CASE WHEN seq = 777777 THEN 'req-needle' END, {now},"
        f" CASE WHEN seq > {done} THEN 'pending' WHEN seq % 100 = 0 THEN 'abandoned'"
        " ELSE 'published' END,"
        f" CASE WHEN seq > {done} AND seq % 1000 = 0 THEN '9999-12-31 00:00:00.000'"
        f" WHEN seq > {done} AND seq % 1000 = 500 THEN strftime('%Y-%m-%d %H:%M:%f',"
        f" 'now', '+1 day') ELSE {now} END,"
        f" CASE WHEN seq <= {done} AND seq % 100 <> 0 THEN {now} END,"
        f" CASE WHEN seq <= {done} AND seq % 100 = 0 THEN {now} END FROM g"
    )
    conn.close()


async def _mysql_reads(ops: Operations) -> int:
    storage: Any = ops.storage

    async def read(session: Any) -> int:
        rows = await session.connection.fetch("SHOW SESSION STATUS LIKE 'Handler_read%'", [])
        return sum(int(value) for _, value in rows)

    return int(await storage._run(read))


def _mysql_plans(sent: list[tuple[str, list[Any]]]) -> list[str]:
    import pymysql

    conn = pymysql.connect(host="127.0.0.1", port=3306, user="root", database="test")
    found = []
    with conn.cursor() as cursor:
        for query, params in sent:
            if not query.lstrip().upper().startswith("SELECT"):
                continue
            cursor.execute("EXPLAIN " + query, params)
            for row in cursor.fetchall():
                # id, select_type, table, type, possible_keys, key, key_len, ref, rows, Extra
                found.append(f"{row[2]}: {row[3]} {row[5] or ''} {row[9] or ''}".strip())
    conn.close()
    return sorted(set(found))


def _sqlite_steps(path: str, sent: list[tuple[str, list[Any]]]) -> tuple[int, list[str]]:
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1000
        return 0

    plans: set[str] = set()
    try:
        for query, params in sent:
            plans.update(str(r[3]) for r in conn.execute(f"EXPLAIN QUERY PLAN {query}", params))
            conn.set_progress_handler(count, 1000)
            conn.execute(query, params).fetchall()
            conn.set_progress_handler(None, 1000)
    finally:
        conn.close()
    return steps, sorted(plans)


async def measure_other(
    dialect: str, url: str, table: str, live: int, done: int, path: str | None
) -> dict[str, Any]:
    found: dict[str, Any] = {}
    async with Operations.opened(url, table) as ops:
        sent = recording(ops)
        for name, search in searches(live, done).items():
            times = []
            read = None
            for run in range(RUNS):
                sent.clear()
                before = await _mysql_reads(ops) if dialect == "mysql" and run == 0 else 0
                started = time.perf_counter()
                await search(ops)
                times.append(time.perf_counter() - started)
                if dialect == "mysql" and run == 0:
                    read = await _mysql_reads(ops) - before
            if dialect == "mysql":
                plans = _mysql_plans(sent)
                entry = {"rows_read": read, "plans": plans}
            else:
                assert path is not None
                steps, plans = _sqlite_steps(path, sent)
                entry = {"vm_steps": steps, "plans": plans}
            found[name] = {"median_ms": round(statistics.median(times) * 1000, 2),
                           "statements": len(sent), **entry}  # fmt: skip
            shown = entry.get("rows_read", entry.get("vm_steps"))
            print(f"{dialect:>10} {name:<30} {found[name]['median_ms']:>9} ms {shown:>10}  "
                  f"{plans}", flush=True)  # fmt: skip
    return found


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialect", choices=["postgresql", "mysql", "sqlite"],
                        default="postgresql")  # fmt: skip
    parser.add_argument("--url", default=None)
    parser.add_argument("--live", type=int, default=1_000_000)
    parser.add_argument("--done", type=int, default=200_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    table = f"{TABLE}_{int(time.time())}"
    report: dict[str, Any] = {
        "benchmark": "search_plans", "command": " ".join(sys.argv), "dialect": args.dialect,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(), "live_rows": args.live, "done_rows": args.done,
    }  # fmt: skip
    if args.dialect == "postgresql":
        await _postgresql(args.url or URLS["postgresql"], table, args, report)
    else:
        await _one_table(args.dialect, table, args, report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


async def _one_table(dialect: str, table: str, args: Any, report: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "outbox.db") if dialect == "sqlite" else None
        url = args.url or (f"sqlite:///{path}" if path else URLS["mysql"])
        await migrate(url, table=table)
        try:
            started = time.perf_counter()
            if path is not None:
                fill_sqlite(path, table, args.live, args.done)
            else:
                fill_mysql(url, table, args.live, args.done)
            report["fill_seconds"] = round(time.perf_counter() - started, 1)
            report["searches"] = await measure_other(
                dialect, url, table, args.live, args.done, path
            )
        finally:
            if path is None:
                import pymysql

                conn = pymysql.connect(host="127.0.0.1", port=3306, user="root",
                                       database="test", autocommit=True)  # fmt: skip
                with conn.cursor() as cursor:
                    for name in (*(f"{table}_{side}" for side in SIDE_TABLES), table):
                        cursor.execute(f"DROP TABLE IF EXISTS {name}")
                conn.close()


async def _postgresql(url: str, table: str, args: Any, report: dict[str, Any]) -> None:
    await migrate(url, table=table)
    try:
        started = time.perf_counter()
        fill(url, table, args.live, args.done)
        report["fill_seconds"] = round(time.perf_counter() - started, 1)
        report["never_analyzed"] = await measure(url, table, args.live, args.done, "never analyzed")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"ANALYZE {table}")
            conn.execute(f"ANALYZE {table}_done")
        report["analyzed"] = await measure(url, table, args.live, args.done, "analyzed")
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            for name in (*(f"{table}_{side}" for side in SIDE_TABLES), table):
                conn.execute(f"DROP TABLE IF EXISTS {name}")
            conn.execute(f"DROP TYPE IF EXISTS {table}_status")
            for function in sql.functions("postgresql", table):
                conn.execute(f"DROP FUNCTION IF EXISTS {function}")


if __name__ == "__main__":
    asyncio.run(main())
