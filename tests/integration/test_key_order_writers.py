"""Concurrent writers of one key: a key's sequence order must be its commit order.

Sequences are assigned at insert, not at commit. Without care, a writer that inserts
seq 1 for key k and commits late lets the relay publish seq 2 (committed early) first.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pymysql
import pytest

from relaybox import Message, Outbox, sql
from relaybox.migrations import migrate
from relaybox.storage import open_storage
from tests.databases import MYSQL_URL, PG_URL, drop, unique_table

URLS = {"postgresql": PG_URL, "mysql": MYSQL_URL}


def connect(dialect: str) -> Any:
    if dialect == "postgresql":
        return psycopg.connect(PG_URL)
    return pymysql.connect(host="127.0.0.1", user="root", password="", database="test")


@pytest.fixture(params=sorted(URLS))
def db(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    table = unique_table("ko")
    asyncio.run(migrate(URLS[request.param], table=table))
    yield request.param, table
    drop(URLS[request.param], table)


def claim_keys(dialect: str, table: str) -> list[tuple[str | None, str]]:
    async def claim() -> list[tuple[str | None, str]]:
        storage = await open_storage(URLS[dialect], table=table)
        try:
            found = await storage.claim("check", limit=100, lease_seconds=30)
            await storage.release(found.token, [m.seq for m in found.messages])
            return [(m.key, m.type) for m in found.messages]
        finally:
            await storage.close()

    return asyncio.run(claim())


@pytest.mark.parametrize("bulk", [False, True], ids=["single", "bulk"])
def test_a_second_writer_of_a_key_waits_for_the_first(db: tuple[str, str], bulk: bool) -> None:
    dialect, table = db
    outbox = Outbox(table=table)
    first, second = connect(dialect), connect(dialect)
    try:
        outbox.add(first, Message(topic="t", key="k", type="first"))
        done = threading.Event()

        def write_second() -> None:
            batch = [
                Message(topic="t", key="other", type="x"),
                Message(topic="t", key="k", type="second"),
            ]
            outbox.add(second, batch if bulk else batch[1])
            second.commit()
            done.set()

        thread = threading.Thread(target=write_second)
        thread.start()
        assert not done.wait(0.5), "the second writer of key k must wait for the first"
        assert ("k", "second") not in claim_keys(dialect, table)  # nothing of k may overtake
        first.commit()
        assert done.wait(30)  # a deadline for a busy machine; it takes milliseconds
        thread.join()
        keyed = [t for k, t in claim_keys(dialect, table) if k == "k"]
        assert keyed == ["first", "second"]
    finally:
        first.close()
        second.close()


def test_writers_of_different_keys_do_not_wait(db: tuple[str, str]) -> None:
    dialect, table = db
    outbox = Outbox(table=table)
    first, second = connect(dialect), connect(dialect)
    try:
        outbox.add(first, Message(topic="t", key="a"))
        outbox.add(second, [Message(topic="t", key="b"), Message(topic="t")])  # no wait
        second.commit()
        first.commit()
    finally:
        first.close()
        second.close()
    assert sorted(k or "" for k, _ in claim_keys(dialect, table)) == ["", "a", "b"]


ONE_ROW_INSERTS = [
    name
    for base in ("insert_one", "insert_one_now", "insert_one_basic")
    for name in (base, base + "_notify")
]


@pytest.mark.parametrize("name", ONE_ROW_INSERTS)
def test_the_key_lock_is_taken_before_the_seq_is_drawn(name: str) -> None:
    """What the waiting above cannot show: writer B may draw seq 1, writer A seq 2, and
    A still win the key lock, unless the lock comes first. A plan runs bottom-up: the
    node that calls the lock sits below the one that draws the seq (the subquery that
    holds the lock call is volatile, so PostgreSQL never pulls it up into that node)."""
    table = unique_table("kl")
    asyncio.run(migrate(PG_URL, table=table))
    try:
        query = sql.queries("postgresql", table)[name]
        with psycopg.connect(PG_URL) as conn:
            # The plan a writer's connection runs from its sixth add on; a custom plan
            # for these NULLs would fold the strict lock call away.
            conn.execute("SET plan_cache_mode = force_generic_plan")
            conn.execute(f"PREPARE probe AS {query}")
            params = conn.execute(
                "SELECT array_length(parameter_types, 1) FROM pg_prepared_statements"
                " WHERE name = 'probe'"
            ).fetchone()
            assert params is not None
            nulls = ", ".join(["NULL"] * params[0])
            (plan,) = conn.execute(f"EXPLAIN (VERBOSE, FORMAT JSON) EXECUTE probe({nulls})")
        (document,) = plan
        root = document[0]["Plan"]
        drawing = _path_to(root, "nextval(")
        locking = _path_to(root, "pg_advisory_xact_lock(")
        assert drawing is not None
        assert locking is not None
        below = locking[: len(drawing)] == drawing and len(locking) > len(drawing)
        assert below, f"{name}: the key lock must be called in a node below the seq's"
    finally:
        drop(PG_URL, table)


def _path_to(node: dict[str, Any], call: str, path: tuple[int, ...] = ()) -> tuple[int, ...] | None:
    """Child indexes from the root to the deepest node whose output or filter calls `call`."""
    for index, child in enumerate(node.get("Plans", [])):
        found = _path_to(child, call, (*path, index))
        if found is not None:
            return found
    text = " ".join(
        str(node.get(field, "")) for field in ("Output", "One-Time Filter", "Function Call")
    )
    return path if call in text else None
