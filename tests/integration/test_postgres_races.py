"""PostgreSQL: what commits while a read or a claim runs.

- The owned read's second half ({table}_read_past) sees the snapshot of the read that
  calls it. A volatile PL/pgSQL function takes a new snapshot for each query in it, so
  a row committed while the read runs, with a seq below the window's end (a writer that
  drew its seq before others and committed after them), would shorten the window that
  the function finds and make it return rows that the read's first half had taken.
- An operator's hold takes turns with the claims of relays that lease rows. A claim
  chooses a key's rows with one snapshot and leases them with a later one, which skips
  a row no longer due: a hold committed in between would leave the key's first row
  behind while the rows after it went out.
- A claim that calls the claim function twice (leases ran out meanwhile) keeps what
  the first call leased when the second fails: those leases are committed.
- Two tables whose names differ only by a schema's dot (`s.outbox`, `s_outbox`) keep
  their functions apart: each claims, reads and beats its own rows.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest

from relaybox import sql
from relaybox.core.inspection import HELD_UNTIL, Change
from relaybox.core.partitions import claim_lock_key
from relaybox.core.records import Routing
from relaybox.errors import StorageOperationalError
from relaybox.migrations import migrate
from relaybox.storage import open_storage
from relaybox.storage.sql import SqlStorage
from tests.databases import PG_URL, drop, unique_table
from tests.relay_support import OutboxDB, messages, outbox_db

#: The window's size: the rows the read's first half looks at.
WINDOW = 3


@pytest.fixture
def table() -> Iterator[str]:
    import asyncio

    name = unique_table("snapshot")
    asyncio.run(migrate(PG_URL, table=name))
    try:
        yield name
    finally:
        drop(PG_URL, name)


def _insert(conn: psycopg.Connection[object], table: str, key: str) -> None:
    conn.execute(
        f"INSERT INTO {table} (id, target, topic, key, partition, type, content_type,"
        " payload, occurred_at)"
        " VALUES (%s, 'default', 't', %s, 1, 'x', 'application/json', '\\x7b7d', now())",
        (uuid.uuid4(), key),
    )


def test_rows_committed_during_a_read_do_not_move_its_window(table: str) -> None:
    late = psycopg.connect(PG_URL)  # a transaction: it draws seq 1 and commits last
    try:
        _insert(late, table, "late")
        with psycopg.connect(PG_URL, autocommit=True) as writer:
            for key in ("a", "a", "c", "b"):  # seqs 2, 3, 4, 5
                _insert(writer, table, key)
        # Without the late row the window is seqs 2-4 (full, c's head inside it), so
        # only b's head lies past it; with it, the window is 1-3 and c's head past it.
        timer = threading.Timer(0.5, late.commit)
        with psycopg.connect(PG_URL, autocommit=True) as reader:
            timer.start()
            started = time.monotonic()
            rows = reader.execute(
                f"SELECT r.key FROM (SELECT pg_sleep(1.0), 10 AS room) AS s,"
                f" LATERAL {table}_read_past(s.room, NULL, 64, NULL,"
                f" '{{}}', {WINDOW}, 9223372036854775807, true) AS r"
            ).fetchall()
            timer.join()
        assert time.monotonic() - started >= 1.0  # the commit came during the read
        assert [key for (key,) in rows] == ["b"]
    finally:
        late.close()


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path):
        yield each


async def _key_rows(db: OutboxDB) -> list[int]:
    await db.write(messages(["k"], per_key=3))
    return [m.seq for m in await db.storage.read(limit=10)]


async def test_a_hold_waits_for_a_claim_in_progress(db: OutboxDB) -> None:
    first, *_ = await _key_rows(db)
    storage = db.storage
    assert isinstance(storage, SqlStorage)
    with psycopg.connect(PG_URL) as claim:  # a claim in progress holds its lock
        claim.execute("SELECT pg_advisory_xact_lock(%s, -1)", (claim_lock_key(db.table),))
        hold = asyncio.create_task(storage.hold([first], Change("ops")))
        await asyncio.sleep(0.3)
        assert not hold.done()
        claim.commit()
        assert await asyncio.wait_for(hold, 5) == 1


async def test_a_claim_beside_a_hold_in_progress_takes_nothing_of_its_key(
    db: OutboxDB,
) -> None:
    first, *_ = await _key_rows(db)
    storage = db.storage
    assert isinstance(storage, SqlStorage)
    queries = sql.queries("postgresql", db.table)
    hold = await asyncpg.connect(PG_URL)  # storage.hold's statements, not yet committed
    try:
        async with hold.transaction():
            await hold.execute(queries["claim_gate"], claim_lock_key(db.table))
            changed = await hold.fetchval(
                queries["hold"], f"{{{first}}}", "ops", "hold", None, HELD_UNTIL, HELD_UNTIL
            )
            assert changed == 1
            claim = asyncio.create_task(storage.claim("w", limit=10, lease_seconds=30.0))
            await asyncio.sleep(0.3)
            assert not claim.done()  # it waits for the hold to commit
        taken = await asyncio.wait_for(claim, 5)
    finally:
        await hold.close()
    assert taken.messages == []  # the key waits behind its held first row


async def test_a_claim_keeps_its_first_call_when_the_second_fails(
    db: OutboxDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    await db.write(messages(["a"], per_key=2))
    await db.write(messages(["b"], per_key=2))
    storage = db.storage
    assert isinstance(storage, SqlStorage)
    first = await storage.claim("w1", limit=2, lease_seconds=0.05)
    assert [m.key for m in first.messages] == ["a", "a"]
    await asyncio.sleep(0.2)  # their leases run out
    fetch = storage._fetch
    calls: list[str] = []

    async def failing_second(name: str, *args: Any) -> list[Sequence[Any]]:
        calls.append(name)
        if calls.count("claim") == 2:
            raise StorageOperationalError("connection lost")
        return await fetch(name, *args)

    monkeypatch.setattr(storage, "_fetch", failing_second)
    taken = await storage.claim("w2", limit=10, lease_seconds=30.0)
    assert calls.count("claim") == 2
    assert [m.key for m in taken.messages] == ["b", "b"]  # the first call's leases
    monkeypatch.undo()
    again = await storage.claim("w2", limit=10, lease_seconds=30.0)
    assert [m.key for m in again.messages] == ["a", "a"]  # the expired ones, in order


async def test_a_schema_table_and_its_underscored_namesake_keep_their_functions_apart() -> None:
    schema = unique_table("sch")
    dotted, plain = f"{schema}.outbox", f"{schema}_outbox"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        for table in (dotted, plain):
            await migrate(PG_URL, table=table)
        written = {}
        for table in (dotted, plain):
            storage = await open_storage(PG_URL, table=table)
            try:
                (message,) = messages([table], per_key=1)
                await storage.write(Routing.of(["default"], None).rows([message]))
                written[table] = message.id
            finally:
                await storage.close()
        for table in (dotted, plain):
            storage = await open_storage(PG_URL, table=table)
            try:
                read = await storage.read(limit=10)
                claim = await storage.claim("w", limit=10, lease_seconds=30.0)
                beat = await storage.heartbeat("w", partitions=8, lease_seconds=30.0)
            finally:
                await storage.close()
            assert [m.id for m in read] == [m.id for m in claim.messages] == [written[table]]
            assert len(beat.partitions) == 8
    finally:
        drop(PG_URL, plain)
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
