"""PostgreSQL's layout: live rows in the outbox table, finished rows kept a while in
<table>_done, and the indexes the writer's and the relay's speed rest on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from relaybox import Message, Outbox, sql
from relaybox.core.lifecycle import Status
from relaybox.core.records import Failure
from relaybox.migrations import migrate
from relaybox.storage import open_storage
from tests.databases import PG_URL, drop, unique_table


@pytest.fixture
def table() -> Iterator[str]:
    name = unique_table("lay")
    yield name
    drop(PG_URL, name)


def _write(table: str, keys: list[str]) -> list[int]:
    with psycopg.connect(PG_URL) as conn:
        Outbox(table=table).add(conn, [Message(topic="t", key=k, payload={"k": k}) for k in keys])
    return [seq for (seq,) in _fetch(f"SELECT seq FROM {table} ORDER BY seq")]


def _fetch(query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def _statuses(table: str, side: str = "") -> dict[int, str]:
    return dict(_fetch(f"SELECT seq, status::text FROM {table}{side}"))  # type: ignore[arg-type]


async def test_finished_rows_move_apart_and_operators_reach_them(table: str) -> None:
    await migrate(PG_URL, table=table)
    live, published, abandoned = _write(table, ["a", "b", "c"])
    storage = await open_storage(PG_URL, table=table)
    try:
        await storage.heartbeat("w1", partitions=4, lease_seconds=30)
        settled = await storage.settle(
            "w1", partition_count=4, published=[published],
            abandoned=[Failure(abandoned, "rejected")], delete=False,
        )  # fmt: skip
        assert (settled.published, settled.abandoned) == (1, 1)
        assert _statuses(table) == {live: "pending"}
        assert _statuses(table, "_done") == {published: "published", abandoned: "abandoned"}
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
    """The layout the writer's throughput rests on: the outbox table has the primary key
    and three partial indexes, none about finishing, on keys that compare byte by byte."""
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
    """A table no ANALYZE has seen yet has no statistics, and a generic plan is made once
    for every call: the relay's read must walk the primary key even then, never scan the
    whole table and sort it."""
    asyncio.run(migrate(PG_URL, table=table))
    _write(table, [f"k{n % 200}" for n in range(5000)])
    query = sql.queries("postgresql", table)["read"]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(
            "PREPARE probe(integer, integer[], integer, text[], text, text, integer, bigint, "
            f"boolean) AS {query}"
        )
        plan = "\n".join(
            line
            for (line,) in conn.execute(
                "EXPLAIN EXECUTE probe(500, NULL, 64, NULL, '{}', '[]', 1000, 8388608, true)"
            ).fetchall()
        )
    assert f"Index Scan using {table}_pkey on {table} o" in plan, plan
    assert f"Seq Scan on {table} o" not in plan, plan


async def test_a_relay_refuses_a_table_never_migrated(table: str) -> None:
    from relaybox import SchemaError

    with pytest.raises(SchemaError, match="relaybox migrate"):
        await open_storage(PG_URL, table=table)


async def test_a_storage_connects_while_its_table_is_locked(table: str) -> None:
    """Checking the schema at connect reads the catalog: a relay starts (and serves its
    health checks) even while a long lock is held on the outbox table."""
    await migrate(PG_URL, table=table)
    with psycopg.connect(PG_URL) as conn:
        conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        storage = await asyncio.wait_for(open_storage(PG_URL, table=table), 10)
        await storage.close()
