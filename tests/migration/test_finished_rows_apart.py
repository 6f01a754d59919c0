"""PostgreSQL's migration 0007: finished rows move to {table}_done, on upgrade and when a
relay of an earlier version finishes a row in place; stats, replay and purge see them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from relaybox import Message, Outbox, sql
from relaybox.core.records import Status
from relaybox.migrations import migrate
from relaybox.storage import open_storage
from tests.databases import PG_URL, drop, unique_table

#: How relays before 0007 finished rows: in place (0006's queries.sql).
_PUBLISHED_IN_PLACE = (
    "UPDATE {table} SET status = 'published', published_at = now()"
    " WHERE seq = ANY(%s) AND published_at IS NULL AND abandoned_at IS NULL"
)
_ABANDONED_IN_PLACE = (
    "UPDATE {table} SET status = 'abandoned', attempts = attempts + 1, last_error = %s,"
    " abandoned_at = now() WHERE seq = ANY(%s) AND published_at IS NULL AND abandoned_at IS NULL"
)


@pytest.fixture
def table() -> Iterator[str]:
    name = unique_table("fin")
    yield name
    drop(PG_URL, name)


async def _migrate_before_0007(table: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The schema as relays before 0007 knew it."""
    every = sql.migrations
    with monkeypatch.context() as patched:
        patched.setattr(sql, "migrations", lambda *args: [s for s in every(*args) if s[0] < 7])
        await migrate(PG_URL, table=table)


def _write(table: str, keys: list[str]) -> list[int]:
    with psycopg.connect(PG_URL) as conn:
        Outbox(table=table).add(conn, [Message(topic="t", key=k, payload={"k": k}) for k in keys])
    return [seq for (seq,) in _fetch(f"SELECT seq FROM {table} ORDER BY seq")]


def _fetch(query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def _finish_two_in_place(table: str) -> tuple[int, int, int, int]:
    """Three rows, two finished as an earlier relay did: (live, published, abandoned,
    the row count the earlier relay's publish statement saw)."""
    live, published, abandoned = _write(table, ["a", "b", "c"])
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        counted = conn.execute(_PUBLISHED_IN_PLACE.format(table=table), ([published],)).rowcount
        conn.execute(_ABANDONED_IN_PLACE.format(table=table), ("rejected", [abandoned]))
    return live, published, abandoned, counted


def _statuses(table: str, side: str = "") -> dict[int, str]:
    return dict(_fetch(f"SELECT seq, status::text FROM {table}{side}"))  # type: ignore[arg-type]


async def test_upgrading_moves_the_rows_finished_so_far(
    table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _migrate_before_0007(table, monkeypatch)
    live, published, abandoned, _ = _finish_two_in_place(table)

    report = await migrate(PG_URL, table=table)

    assert report.applied == (7,)
    assert _statuses(table) == {live: "pending"}
    assert _statuses(table, "_done") == {published: "published", abandoned: "abandoned"}
    (error, attempts), = _fetch(f"SELECT last_error, attempts FROM {table}_done WHERE seq = %s",
                                (abandoned,))  # fmt: skip
    assert (error, attempts) == ("rejected", 1)


async def test_a_row_finished_in_place_by_an_earlier_relay_moves_apart(table: str) -> None:
    await migrate(PG_URL, table=table)
    live, published, abandoned, counted = _finish_two_in_place(table)
    assert counted == 1  # the earlier relay sees its statement succeed
    assert _statuses(table) == {live: "pending"}
    assert _statuses(table, "_done") == {published: "published", abandoned: "abandoned"}


async def test_stats_replay_and_purge_reach_the_finished_rows(table: str) -> None:
    await migrate(PG_URL, table=table)
    live, published, abandoned, _ = _finish_two_in_place(table)
    storage = await open_storage(PG_URL, table=table)
    try:
        stats = await storage.stats()
        assert stats.counts == {Status.PENDING: 1, Status.PUBLISHED: 1, Status.ABANDONED: 1}
        assert await storage.replay([abandoned, published, live]) == 1  # only the abandoned
        assert _statuses(table) == {live: "pending", abandoned: "pending"}
        assert await storage.purge(published_older_than=0, abandoned_older_than=0) == 1
        assert _statuses(table, "_done") == {}
        ((attempts,),) = _fetch(f"SELECT attempts FROM {table} WHERE seq = %s", (abandoned,))
        assert attempts == 0  # replayed with a fresh count of attempts
    finally:
        await storage.close()


def test_the_outbox_table_keeps_no_index_about_finishing(table: str) -> None:
    """The layout the writer's throughput rests on (docs/benchmarks.md): the outbox table
    has the primary key and three partial indexes, none about finishing."""
    asyncio.run(migrate(PG_URL, table=table))
    found = _fetch("SELECT indexdef FROM pg_indexes WHERE tablename = %s", (table,))
    definitions = sorted(d.replace(table, "T") for (d,) in found)
    assert len(definitions) == 4
    assert not any("published_at" in d or "abandoned_at" in d for d in definitions)
    collations = dict(_fetch(
        "SELECT a.attname, c.collname FROM pg_attribute a"
        " JOIN pg_collation c ON c.oid = a.attcollation"
        " WHERE a.attrelid = %s::regclass AND a.attname IN ('target', 'key')", (table,)
    ))  # fmt: skip
    assert collations == {"target": "C", "key": "C"}


def test_a_read_walks_the_primary_key_before_the_table_is_ever_analyzed(table: str) -> None:
    """Without statistics PostgreSQL takes `published_at IS NULL` for 1 row in 200: a
    read that still tested it on the outbox table (where it is always true) was planned
    as a scan of the whole table and a sort, 7x slower at 20,000 rows, until the first
    ANALYZE. The relay's generic plan must walk the primary key from the start."""
    asyncio.run(migrate(PG_URL, table=table))
    _write(table, [f"k{n % 200}" for n in range(5000)])
    query = sql.queries("postgresql", table)["read"]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(
            f"PREPARE probe(integer, integer[], integer, text[], text, text, integer) AS {query}"
        )
        plan = "\n".join(
            line
            for (line,) in conn.execute(
                "EXPLAIN EXECUTE probe(500, NULL, 64, NULL, '{}', '[]', 1000)"
            ).fetchall()
        )
    assert f"Index Scan using {table}_pkey on {table} o" in plan, plan
    assert f"Seq Scan on {table} o" not in plan, plan


async def test_a_relay_refuses_a_table_from_before_0007(
    table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This relaybox's reads take every row of the outbox table for a live one: on a
    table not yet migrated to 0007 they would publish its finished rows again."""
    from relaybox import SchemaError

    await _migrate_before_0007(table, monkeypatch)
    with pytest.raises(SchemaError, match="relaybox migrate"):
        await open_storage(PG_URL, table=table)
    await migrate(PG_URL, table=table)
    await (await open_storage(PG_URL, table=table)).close()


async def test_upgrading_a_table_in_its_own_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    """Indexes live in their table's schema, which need not be on the search path: 0007
    drops the old ones there, and the table keeps only the layout of 0007."""
    schema = unique_table("sch")
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    table = f"{schema}.outbox"
    try:
        await _migrate_before_0007(table, monkeypatch)
        await migrate(PG_URL, table=table)
        names = sorted(
            name
            for (name,) in _fetch(
                "SELECT indexname FROM pg_indexes WHERE schemaname = %s AND tablename = %s",
                (schema, "outbox"),
            )
        )
        prefix = f"{schema}_outbox"
        expected = [f"{prefix}_{n}" for n in ("keyed_ix", "unkeyed_ix", "waits_ix")]
        assert names == sorted([*expected, "outbox_pkey"])
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
            for function in ("claim", "read", "read_past", "finished"):  # made on the path
                conn.execute(f"DROP FUNCTION IF EXISTS {schema}_outbox_{function}")
