"""PostgreSQL: every hot statement of the relay finds its rows by index whatever the
planner last knew of the tables.

A plan is cached per connection and reused; the dangerous ones are those made while the
outbox was empty or never analyzed (a fresh deploy, a truncate), or while the partitions
table was last analyzed with no relay holding any (then a settle repeated its lookup once
per held partition). Each statement runs, on a relay's own session settings, in four
states of knowledge:

- `cached_while_empty`: prepared and run past the plan cache's custom plans while the
  table was empty and never analyzed, then the backlog arrives;
- `never_analyzed`: first run on a backlog never analyzed;
- `generic`: the generic plan (`plan_cache_mode = force_generic_plan`);
- `analyzed`: after ANALYZE.

What is held is the work, not the time: the rows a statement reads of the outbox table
(the transaction's own table statistics, which count what the functions it calls read
too) stay a few batches' worth, where a whole-table scan reads them all and a lookup
repeated per held partition reads the batch once per partition.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from relaybox import sql
from relaybox.core.inspection import HELD_UNTIL
from relaybox.migrations import migrate
from relaybox.storage.postgres import SESSION_SETTINGS
from relaybox.storage.urls import DatabaseUrl
from tests.databases import PG_URL, drop, unique_table

ROWS = 100_000
BATCH = 500
PARTITIONS = 64
WORKER = "w1"
STATES = ("cached_while_empty", "never_analyzed", "generic", "analyzed")


def _seq_list(seqs: list[int]) -> str:
    return "{" + ",".join(map(str, seqs)) + "}"


#: The held rows' due time, as the storage binds it.
HELD = HELD_UNTIL.isoformat()


#: name -> arguments, from the oldest BATCH seqs.
STATEMENTS: dict[str, Callable[[list[int]], list[Any]]] = {
    "read": lambda seqs: [
        BATCH,
        list(range(PARTITIONS)),
        PARTITIONS,
        ["default"],
        "{}",
        "[]",
        2 * BATCH,
        8 << 20,
        True,
    ],
    "delete_owned": lambda seqs: [_seq_list(seqs), WORKER, PARTITIONS],
    "publish_owned": lambda seqs: [_seq_list(seqs), WORKER, PARTITIONS],
    "fail_owned": lambda seqs: [
        json.dumps([[s, "e", 1.0] for s in seqs]),
        WORKER,
        PARTITIONS,
        HELD,
    ],
    "abandon_owned": lambda seqs: [
        json.dumps([[s, "e"] for s in seqs]),
        WORKER,
        PARTITIONS,
        False,
        HELD,
    ],
    "abandon_owned_holding": lambda seqs: [
        json.dumps([[s, "e"] for s in seqs]),
        WORKER,
        PARTITIONS,
        True,
        HELD,
    ],
    "claim": lambda seqs: [
        WORKER,
        BATCH,
        None,
        PARTITIONS,
        ["default"],
        str(uuid.uuid4()),
        30.0,
        1,
        8 << 20,
        True,
    ],
    "mark_published": lambda seqs: [_seq_list(seqs), str(uuid.uuid4())],
    "delete_published": lambda seqs: [_seq_list(seqs), str(uuid.uuid4())],
    "mark_failed": lambda seqs: [
        json.dumps([[s, "e", 1.0] for s in seqs]),
        str(uuid.uuid4()),
        HELD,
    ],
    "abandon": lambda seqs: [json.dumps([[s, "e"] for s in seqs]), str(uuid.uuid4()), False, HELD],
    "abandon_holding": lambda seqs: [
        json.dumps([[s, "e"] for s in seqs]),
        str(uuid.uuid4()),
        True,
        HELD,
    ],
    "release": lambda seqs: [_seq_list(seqs), str(uuid.uuid4())],
    "renew": lambda seqs: [_seq_list(seqs), str(uuid.uuid4()), 30.0],
}
#: Statements run a second time, with the hold-the-key policy on: their query's name.
QUERIES = {"abandon_owned_holding": "abandon_owned", "abandon_holding": "abandon"}
#: The parameter types the driver would send, for PREPARE.
TYPES = {
    "read": "integer, integer[], integer, text[], text, text, integer, bigint, boolean",
    "claim": "text, integer, integer[], integer, text[], uuid, float8, integer, bigint, boolean",
}


def _connect(**settings: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(PG_URL, autocommit=True)
    for name, value in {**SESSION_SETTINGS, **settings}.items():
        conn.execute(pgsql.SQL("SELECT set_config({}, {}, false)").format(name, value))
    return conn


def _prepare(conn: psycopg.Connection[Any], table: str, name: str) -> None:
    query = sql.queries("postgresql", table)[QUERIES.get(name, name)]
    types = f"({TYPES[name]})" if name in TYPES else ""
    conn.execute(f"PREPARE {name} {types} AS {query}")


def _execute(name: str, args: list[Any]) -> pgsql.Composed:
    return pgsql.SQL("EXECUTE {} ({})").format(
        pgsql.Identifier(name), pgsql.SQL(", ").join(pgsql.Literal(a) for a in args)
    )


def _run(
    conn: psycopg.Connection[Any], table: str, name: str, args: list[Any], *, explain: bool
) -> Any:
    """Run a prepared statement in a transaction that is rolled back; with `explain`,
    return its plan with what it did."""
    with conn.transaction(force_rollback=True):
        if not explain:
            conn.execute(_execute(name, args))
            return None
        before = _rows_read(conn, table)
        ((plan,),) = conn.execute(
            pgsql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) {}").format(_execute(name, args))
        ).fetchall()
        read = _rows_read(conn, table) - before
        return {"plan": plan[0]["Plan"], "rows_read": read}


def _rows_read(conn: psycopg.Connection[Any], table: str) -> int:
    """What this backend read of the outbox table by any scan of any statement, also
    those of the functions a statement called, and not yet reported (so compared
    before and after, in one transaction)."""
    ((read,),) = conn.execute(
        "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
        " WHERE relid = %s::regclass",
        (table,),
    ).fetchall()
    return int(read)


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _fill(table: str) -> None:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {table} (id, target, topic, key, partition, type, content_type,"
            " payload, occurred_at)"
            " SELECT gen_random_uuid(), 'default', 't', 'k' || (g %% 1000),"
            " hashtext('k' || (g %% 1000)) & 2147483647, 'x', 'application/json',"
            " convert_to(repeat('x', 100), 'UTF8'), now()"
            " FROM generate_series(1, %s) AS g",
            (ROWS,),
        )


@pytest.fixture(scope="module")
def plans() -> Iterator[dict[tuple[str, str], tuple[dict[str, Any], int]]]:
    """(state, statement) -> (plan and rows read, the rows in the outbox table)."""
    import asyncio

    table = unique_table("plan")
    asyncio.run(migrate(PG_URL, table=table))
    found: dict[tuple[str, str], tuple[dict[str, Any], int]] = {}
    try:
        with psycopg.connect(PG_URL, autocommit=True) as admin:
            # The partitions are analyzed while nobody holds them, then all are taken.
            admin.execute(
                f"INSERT INTO {table}_partitions (target, partition)"
                " SELECT 'default', p FROM generate_series(0, %s) AS p",
                (PARTITIONS - 1,),
            )
            admin.execute(f"ANALYZE {table}_partitions")
            admin.execute(
                f"UPDATE {table}_partitions SET owner = %s,"
                " lease_until = now() + interval '1 hour'",
                (WORKER,),
            )
        cached = _connect()
        for name, args in STATEMENTS.items():
            _prepare(cached, table, name)
            for _ in range(8):  # past the plan cache's first five custom plans
                _run(cached, table, name, args([1, 2, 3]), explain=False)
        _fill(table)
        with psycopg.connect(PG_URL, autocommit=True) as admin:
            seqs = [s for (s,) in admin.execute(
                f"SELECT seq FROM {table} ORDER BY seq LIMIT %s", (BATCH,))]  # fmt: skip
            (rows,) = admin.execute(f"SELECT count(*) FROM {table}").fetchone()  # type: ignore[misc]
        fresh = _connect()
        generic = _connect(plan_cache_mode="force_generic_plan")
        for name, args in STATEMENTS.items():
            found["cached_while_empty", name] = (
                _run(cached, table, name, args(seqs), explain=True),
                rows,
            )
            _prepare(fresh, table, name)
            found["never_analyzed", name] = (
                _run(fresh, table, name, args(seqs), explain=True),
                rows,
            )
            _prepare(generic, table, name)
            found["generic", name] = (_run(generic, table, name, args(seqs), explain=True), rows)
        with psycopg.connect(PG_URL, autocommit=True) as admin:
            admin.execute(f"ANALYZE {table}")
        analyzed = _connect()
        for name, args in STATEMENTS.items():
            _prepare(analyzed, table, name)
            found["analyzed", name] = (_run(analyzed, table, name, args(seqs), explain=True), rows)
        for conn in (cached, fresh, generic, analyzed):
            conn.close()
        yield found
    finally:
        drop(PG_URL, table)


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("name", list(STATEMENTS))
def test_a_hot_statement_touches_a_small_part_of_the_table(
    plans: dict[tuple[str, str], tuple[dict[str, Any], int]], name: str, state: str
) -> None:
    found, rows = plans[state, name]
    plan = found["plan"]
    assert rows == ROWS
    # A batch, its window and the earlier rows of its keys: a few batches' worth, where
    # a whole-table walk reads every row and a lookup repeated per held partition reads
    # the batch PARTITIONS times.
    assert found["rows_read"] <= 10 * BATCH, json.dumps(plan, indent=1)
    for node in _nodes(plan):
        assert node["Node Type"] != "Seq Scan" or node.get("Relation Name", "").endswith(
            ("_partitions", "_members")
        ), json.dumps(plan, indent=1)


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize(
    "name",
    ["delete_owned", "publish_owned", "fail_owned", "abandon_owned", "abandon_owned_holding"],
)
def test_the_settle_reads_the_held_partitions_once(
    plans: dict[tuple[str, str], tuple[dict[str, Any], int]], name: str, state: str
) -> None:
    """The fence is probed, not joined: the partitions table is read once, whatever
    the planner knew of it, so no lookup is repeated per held partition. (An abandon
    holds some rows and moves others, each with its own fence: the one that finds no
    row may not read the partitions at all.)"""
    plan = plans[state, name][0]["plan"]
    scans = [n for n in _nodes(plan) if n.get("Relation Name", "").endswith("_partitions")]
    loops = sorted(n["Actual Loops"] for n in scans)
    assert loops[-1:] == [1], json.dumps(plan, indent=1)
    assert all(n <= 1 for n in loops), json.dumps(plan, indent=1)
    assert any(n.get("Filter", "").find("hashed SubPlan") >= 0 for n in _nodes(plan))


def test_the_counts_read_the_whole_table_with_a_hash_not_a_sort() -> None:
    """The counts read every live row, which no index serves. With sequential scans off
    every plan costs alike and the planner took a sort; the counts' own transaction
    turns them back on (`stats_scope`, which `PostgresStorage.stats` runs first)."""
    table = unique_table("counts")
    import asyncio

    asyncio.run(migrate(PG_URL, table=table))
    try:
        _fill(table)
        queries = sql.queries("postgresql", table)
        with _connect() as conn:
            counts = queries["count_by_status"].replace("$1::timestamptz", f"'{HELD}'")
            explain = f"EXPLAIN (FORMAT JSON) {counts}"
            with conn.transaction(force_rollback=True):
                conn.execute(queries["stats_scope"])
                ((scoped,),) = conn.execute(explain).fetchall()
        kinds = [node.get("Strategy") for node in _nodes(scoped[0]["Plan"])]
        assert "Hashed" in kinds, json.dumps(scoped, indent=1)
    finally:
        drop(PG_URL, table)


async def test_the_storage_reads_the_counts_in_their_scope() -> None:
    from tests.integration.test_postgres_heartbeat import _CountedStorage

    table = unique_table("counts")
    await migrate(PG_URL, table=table)
    storage = _CountedStorage(DatabaseUrl.parse(PG_URL), table=table)
    try:
        await storage.stats()
        assert storage.names() == [
            "BEGIN", "stats_scope", "count_by_status", "count_held", "oldest_pending_age",
            "active_leases", "live_by_target", "COMMIT",
        ]  # fmt: skip
    finally:
        await storage.close()
        drop(PG_URL, table)
