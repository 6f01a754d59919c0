"""PostgreSQL: the console's search reads about a page of rows, whatever the size of the
tables and whatever the planner last knew of them.

A search walks, in each of the live and the finished table, one index in seq order and
stops at its limit: the primary key, or with a target and a key the (target, key, seq)
index. Each search runs on a relay's session settings in three states of knowledge
(`never_analyzed`, `generic` for the generic plan, `analyzed`), and what it read of
both tables (their transaction statistics) stays a few pages' worth, with no
sequential scan."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from relaybox import sql
from relaybox.core.inspection import HELD_UNTIL, MAX_SEQ
from relaybox.migrations import migrate
from relaybox.storage.postgres import SESSION_SETTINGS
from tests.databases import PG_URL, drop, unique_table

LIVE = 60_000
DONE = 20_000
KEYS = 100
LIMIT = 50
STATES = ("never_analyzed", "generic", "analyzed")
#: The search queries' parameter types, as their casts give them.
TYPES = (
    "boolean, boolean, text, text, text, text, text, uuid, text, text, text, text, bigint,"
    " bigint, timestamptz, timestamptz, integer, timestamptz"
)


def _args(
    *, target: str | None = None, key: str | None = None, low: int = 1, high: int = MAX_SEQ
) -> list[Any]:
    """A search's parameters: live and finished rows, any state, these bounds."""
    return [True, True, None, target, None, key, None, None, None, None, None, None,
            low, high, None, None, LIMIT, HELD_UNTIL]  # fmt: skip


#: case -> (query, its parameters, the rows it must find); the finished table holds the
#: oldest seqs, the live one the rest.
CASES: dict[str, tuple[str, list[Any], int]] = {
    "newest_page": ("search_desc", _args(), LIMIT),
    "oldest_page": ("search_asc", _args(), LIMIT),
    "page_after_a_cursor": ("search_desc", _args(high=DONE + LIVE // 2), LIMIT),
    "key_newest": ("search_key_desc", _args(target="default", key="k7"), LIMIT),
    "key_oldest": ("search_key_asc", _args(target="default", key="k7"), LIMIT),
    "key_past_a_cursor": (
        "search_key_asc",
        _args(target="default", key="k7", low=DONE // 2),
        LIMIT,
    ),
}


def _connect(**settings: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(PG_URL, autocommit=True)
    for name, value in {**SESSION_SETTINGS, **settings}.items():
        conn.execute(pgsql.SQL("SELECT set_config({}, {}, false)").format(name, value))
    return conn


def _fill(table: str) -> None:
    """DONE published rows (the oldest seqs), then LIVE pending ones, KEYS keys written
    in turn."""
    values = (
        f"g, gen_random_uuid(), 'default', 't', 'k' || (g % {KEYS}),"
        f" hashtext('k' || (g % {KEYS})) & 2147483647, 'x', 'application/json',"
        " convert_to(repeat('x', 100), 'UTF8'), now()"
    )
    columns = "seq, id, target, topic, key, partition, type, content_type, payload, occurred_at"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {table}_done ({columns}, status, published_at)"
            f" SELECT {values}, 'published', now() FROM generate_series(1, {DONE}) AS g"
        )
        conn.execute(
            f"INSERT INTO {table} ({columns}) OVERRIDING SYSTEM VALUE"
            f" SELECT {values} FROM generate_series({DONE + 1}, {DONE + LIVE}) AS g"
        )


def _read(conn: psycopg.Connection[Any], table: str) -> int:
    """What this backend read of both tables by any scan, not yet reported."""
    ((read,),) = conn.execute(
        "SELECT coalesce(sum(seq_tup_read + coalesce(idx_tup_fetch, 0)), 0)"
        " FROM pg_stat_xact_user_tables WHERE relid IN (%s::regclass, %s::regclass)",
        (table, table + "_done"),
    ).fetchall()
    return int(read)


def _explain(conn: psycopg.Connection[Any], table: str, name: str, args: list[Any]) -> Any:
    """Run a prepared search in a transaction rolled back: its plan, the rows it found
    and what it read."""
    execute = pgsql.SQL("EXECUTE {} ({})").format(
        pgsql.Identifier(name), pgsql.SQL(", ").join(pgsql.Literal(a) for a in args)
    )
    with conn.transaction(force_rollback=True):
        before = _read(conn, table)
        ((plan,),) = conn.execute(
            pgsql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) {}").format(execute)
        ).fetchall()
        return plan[0]["Plan"], _read(conn, table) - before


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


@pytest.fixture(scope="module")
def plans() -> Iterator[dict[tuple[str, str], tuple[dict[str, Any], int]]]:
    """(state, case) -> (plan, rows read)."""
    table = unique_table("search")
    asyncio.run(migrate(PG_URL, table=table))
    queries = sql.queries("postgresql", table)
    found: dict[tuple[str, str], tuple[dict[str, Any], int]] = {}
    try:
        _fill(table)
        conns = {"never_analyzed": _connect(),
                 "generic": _connect(plan_cache_mode="force_generic_plan")}  # fmt: skip
        with psycopg.connect(PG_URL, autocommit=True) as admin:
            for conn in conns.values():
                for name in ("search", "search_key"):
                    for order, suffix in (("ASC", "_asc"), ("DESC", "_desc")):
                        query = queries[name].replace("{order}", order)
                        conn.execute(f"PREPARE {name}{suffix} ({TYPES}) AS {query}")
            for state, conn in conns.items():
                for case, (name, args, _) in CASES.items():
                    found[state, case] = _explain(conn, table, name, args)
            admin.execute(f"ANALYZE {table}")
            admin.execute(f"ANALYZE {table}_done")
        analyzed = _connect()
        for name in ("search", "search_key"):
            for order, suffix in (("ASC", "_asc"), ("DESC", "_desc")):
                query = queries[name].replace("{order}", order)
                analyzed.execute(f"PREPARE {name}{suffix} ({TYPES}) AS {query}")
        for case, (name, args, _) in CASES.items():
            found["analyzed", case] = _explain(analyzed, table, name, args)
        for conn in (*conns.values(), analyzed):
            conn.close()
        yield found
    finally:
        drop(PG_URL, table)


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("case", list(CASES))
def test_a_search_walks_an_index_for_about_a_page(
    plans: dict[tuple[str, str], tuple[dict[str, Any], int]], case: str, state: str
) -> None:
    plan, read = plans[state, case]
    assert plan["Actual Rows"] == CASES[case][2], json.dumps(plan, indent=1)
    # Each side reads at most its page: never the tables' 80 000 rows, nor a key's 800.
    assert read <= 2 * LIMIT, json.dumps(plan, indent=1)
    for node in _nodes(plan):
        assert node["Node Type"] != "Seq Scan", json.dumps(plan, indent=1)
