"""Parking on every database: bounded attempts, counted across consumers and crashes,
invalid payloads and unknown types parked at once, replays applied once, discards
audited. A message is parked in the transaction that records it in the inbox, so the
broker's copies are duplicates from then on and nothing is applied twice."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from relaybox.core.incoming import Incoming
from relaybox.errors import ConfigurationError, InboxError, TransactionLostError
from relaybox.inbox import Consumer, Inbox, Processed
from relaybox.inbox import parked as store
from tests.inbox.support import DIALECTS, InboxWorld, incoming, wait_until


@pytest.fixture(params=DIALECTS)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld(request.param, tmp_path) as opened:
        yield opened


def failing(ids: set[str], runs: list[str] | None = None) -> Any:
    """A hook that fails for each message whose id is in `ids` (while it is there)."""

    async def fail(message: Incoming) -> None:
        if runs is not None:
            runs.append(message.id)
        if message.id in ids:
            raise RuntimeError(f"{message.id} cannot be applied")

    return fail


@dataclasses.dataclass
class OrderPlaced:
    order: str
    total: int


def typed_consumer(world: InboxWorld, seen: list[Any], **options: Any) -> Consumer:
    consumer = Consumer(inbox=Inbox(consumer="test", table=world.table),
                        transaction=world.transaction, purge_interval=None,
                        **options)  # fmt: skip

    @consumer.handler("OrderPlaced", payload=OrderPlaced)
    async def placed(order: OrderPlaced, message: Incoming, conn: Any) -> None:
        seen.append(order)
        await world.write_effect(conn, message, "test")

    return consumer


def typed(message_id: str, payload: bytes, type_name: str = "OrderPlaced") -> Incoming:
    attributes = {"id": message_id, "source": "shop", "type": type_name}
    return Incoming.from_envelope(attributes, payload, content_type="application/json")


async def test_a_failing_message_is_parked_after_its_attempts_and_copies_are_duplicates(
    world: InboxWorld,
) -> None:
    runs: list[str] = []
    consumer = world.consumer(before_effect=failing({"bad"}, runs))
    message = incoming("bad", payload=b'{"n": 1}', key="k1")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cannot be applied"):
            await consumer.process(message, max_attempts=3)
    assert await consumer.process(message, max_attempts=3) is Processed.PARKED
    assert await consumer.process(message, max_attempts=3) is Processed.DUPLICATE
    assert runs == ["bad"] * 3
    assert world.effects() == {}
    ((message_id, reason, attempts, error, payload, status),) = world.parked()
    assert (message_id, reason, attempts, status) == ("bad", "failed", 3, "parked")
    assert error == "RuntimeError: bad cannot be applied"
    assert payload == b'{"n": 1}'
    async with world.transaction() as conn:
        (row,) = await store.list_parked(conn, table=world.table)
    assert row.message == message  # the whole envelope, as it was received
    assert (row.consumer, row.attempts, row.parked_at.tzinfo) == ("test", 3, row.parked_at.tzinfo)
    assert row.parked_at.utcoffset() is not None


async def test_attempts_are_counted_across_consumers(world: InboxWorld) -> None:
    """Each attempt may come to another process: the count lives in the database."""
    message = incoming("bad")
    for _ in range(2):
        with pytest.raises(RuntimeError):
            await world.consumer(before_effect=failing({"bad"})).process(message, max_attempts=3)
    third = world.consumer(before_effect=failing({"bad"}))
    assert await third.process(message, max_attempts=3) is Processed.PARKED
    assert [row[2] for row in world.parked()] == [3]


async def test_a_message_that_kills_its_consumer_is_parked_in_the_end(world: InboxWorld) -> None:
    """An attempt cut off with its process cannot be counted after it: a redelivery is
    counted before its handler runs, and one past the attempts is parked unrun."""
    started: list[int | None] = []

    async def hang(message: Incoming) -> None:
        started.append(message.delivery_count)
        await asyncio.Event().wait()

    consumer = world.consumer(before_effect=hang)
    for delivery in (1, 2, 3):
        message = dataclasses.replace(incoming("deadly"), delivery_count=delivery)
        crashing = asyncio.create_task(consumer.process(message, max_attempts=2))
        await wait_until(lambda n=delivery: len(started) == n)  # type: ignore[misc]
        crashing.cancel()  # the process dies mid-handler
        with pytest.raises(asyncio.CancelledError):
            await crashing
    fourth = dataclasses.replace(incoming("deadly"), delivery_count=4)
    assert await consumer.process(fourth, max_attempts=2) is Processed.PARKED
    assert started == [1, 2, 3]  # the fourth delivery did not run the handler
    ((message_id, reason, attempts, error, _, _),) = world.parked()
    assert (message_id, reason, attempts) == ("deadly", "failed", 2)
    assert "without an outcome" in error


async def test_a_classic_redelivery_without_a_count_is_counted_before_running(
    world: InboxWorld,
) -> None:
    consumer = world.consumer(before_effect=failing({"bad"}))
    with pytest.raises(RuntimeError):
        await consumer.process(incoming("bad"), max_attempts=2)
    # A redelivery: counted before its handler runs, and not once more when it fails.
    assert await consumer.process(incoming("bad"), max_attempts=2, redelivered=True) is (
        Processed.PARKED
    )
    assert [row[2] for row in world.parked()] == [2]


async def test_an_invalid_payload_is_parked_at_once_without_running(world: InboxWorld) -> None:
    seen: list[Any] = []
    consumer = typed_consumer(world, seen)
    assert await consumer.process(typed("good", b'{"order": "o-1", "total": 30}')) is (
        Processed.APPLIED
    )
    assert seen == [OrderPlaced("o-1", 30)]
    assert await consumer.process(typed("wrong", b'{"order": "o-2", "total": "30"}')) is (
        Processed.PARKED
    )
    assert await consumer.process(typed("garbled", b"{not json")) is Processed.PARKED
    assert seen == [OrderPlaced("o-1", 30)]
    parked = {row[0]: row for row in world.parked()}
    assert {row[1] for row in parked.values()} == {"invalid"}
    assert {row[2] for row in parked.values()} == {0}  # no handler ran
    assert "payload.total must be int, not str" in parked["wrong"][3]
    assert "not JSON" in parked["garbled"][3]
    assert world.effects() == {"good": 1}


@pytest.mark.parametrize(
    ("policy", "outcome"), [("park", Processed.PARKED), ("skip", Processed.SKIPPED)]
)
async def test_a_type_without_a_handler_follows_the_policy(
    world: InboxWorld, policy: Any, outcome: Processed
) -> None:
    consumer = typed_consumer(world, [], unknown_types=policy)
    assert await consumer.process(typed("other", b"{}", "OrderShipped")) is outcome
    assert [row[1] for row in world.parked()] == (["unknown_type"] if policy == "park" else [])
    assert world.inbox_ids() == ({"other"} if policy == "park" else set())


async def test_a_type_without_a_handler_under_fail_is_left_to_the_broker(
    world: InboxWorld,
) -> None:
    consumer = typed_consumer(world, [], unknown_types="fail")
    for _ in range(3):  # never counted as attempts: it waits for a consumer with a handler
        with pytest.raises(InboxError, match="no handler for type 'OrderShipped'"):
            await consumer.process(typed("other", b"{}", "OrderShipped"), max_attempts=1)
    assert (world.parked(), world.inbox_ids()) == ([], set())


async def test_a_replay_applies_a_parked_message_once(world: InboxWorld) -> None:
    broken = {"bad"}
    consumer = world.consumer(before_effect=failing(broken))
    assert await consumer.process(incoming("bad"), max_attempts=1) is Processed.PARKED
    async with world.transaction() as conn:
        (row,) = await store.list_parked(conn, table=world.table)
    assert await consumer.replay_parked() == 0  # parked, not asked for
    broken.clear()  # the handler is fixed
    async with world.transaction() as conn:
        assert await store.request_replay(conn, [row.id], table=world.table, by="ops") == 1
    rival = world.consumer()
    applied = await asyncio.gather(consumer.replay_parked(), rival.replay_parked())
    assert sorted(applied) == [0, 1]
    assert world.effects() == {"bad": 1}
    assert await consumer.process(incoming("bad")) is Processed.DUPLICATE
    async with world.transaction() as conn:
        (done,) = await store.list_parked(conn, table=world.table, status="replayed")
        with pytest.raises(InboxError, match="is replayed, not parked"):
            await store.request_replay(conn, [row.id], table=world.table)
    assert (done.id, done.changed_by) == (row.id, "ops")


async def test_a_replay_that_fails_is_parked_again(world: InboxWorld) -> None:
    consumer = world.consumer(before_effect=failing({"bad"}))
    assert await consumer.process(incoming("bad"), max_attempts=1) is Processed.PARKED
    (parked_id,) = [row.id for row in await _listed(world)]
    assert await consumer.replay_parked([parked_id]) == 0
    (row,) = await _listed(world)
    assert (row.status, row.attempts, row.error) == (
        "parked", 2, "RuntimeError: bad cannot be applied",
    )  # fmt: skip
    assert world.effects() == {}


async def test_a_discard_keeps_who_and_why_and_unknown_ids_are_refused(
    world: InboxWorld,
) -> None:
    consumer = world.consumer(before_effect=failing({"bad"}))
    await consumer.process(incoming("bad"), max_attempts=1)
    (row,) = await _listed(world)
    with pytest.raises(InboxError, match="no parked message has id 999999"):
        async with world.transaction() as conn:
            await store.discard(conn, [row.id, 999999], reason="bad data", table=world.table)
    assert [r.status for r in await _listed(world)] == ["parked"]  # all or nothing
    async with world.transaction() as conn:
        await store.discard(conn, [row.id], reason="bad data", table=world.table, by="ana")
    (gone,) = await _listed(world, "discarded")
    assert (gone.changed_by, gone.note) == ("ana", "bad data")
    assert await consumer.replay_parked() == 0


async def _listed(world: InboxWorld, status: store.Status = "parked") -> list[store.ParkedMessage]:
    async with world.transaction() as conn:
        return await store.list_parked(conn, table=world.table, status=status)


async def test_sync_handlers_park_and_replay_through_a_sync_connection(tmp_path: Path) -> None:
    import contextlib
    import sqlite3

    async with InboxWorld("sqlite", tmp_path) as world:

        @contextlib.contextmanager
        def transaction() -> Any:
            with contextlib.closing(sqlite3.connect(world.path, timeout=30)) as conn, conn:
                yield conn

        broken = {"bad"}
        consumer = Consumer(inbox=Inbox(table=world.table), transaction=transaction,
                            purge_interval=None)  # fmt: skip

        @consumer.handler("test.event")
        def handle(message: Incoming, conn: sqlite3.Connection) -> None:
            if message.id in broken:
                raise RuntimeError("not yet")
            conn.execute(f"INSERT INTO {world.effects_table} VALUES (?, 'test', '')",
                         (message.id,))  # fmt: skip

        assert await consumer.process(incoming("bad"), max_attempts=1) is Processed.PARKED
        broken.clear()
        (row,) = await _listed(world)
        assert await consumer.replay_parked([row.id]) == 1
        assert world.effects() == {"bad": 1}


def test_handlers_of_one_consumer_are_all_async_or_all_sync() -> None:
    consumer = Consumer(inbox=Inbox(), transaction=lambda: None)  # type: ignore[arg-type,return-value]

    @consumer.handler("a")
    async def first(message: Incoming, conn: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="all async def or all def"):
        consumer.handler("b")(lambda message, conn: None)
    with pytest.raises(ConfigurationError, match="has a handler already"):
        consumer.handler("a")
    with pytest.raises(ConfigurationError, match="dataclass or a pydantic model"):
        consumer.handler("c", payload=dict)
    with pytest.raises(ConfigurationError, match="unknown_types='drop'"):
        Consumer(inbox=Inbox(), transaction=lambda: None, unknown_types="drop")  # type: ignore[arg-type,return-value]


async def test_a_handler_that_swallows_a_failed_statement_is_not_acknowledged_where_that_aborts(
    world: InboxWorld,
) -> None:
    """A handler that catches a database error returns as if done. On PostgreSQL the
    error aborted its transaction, whose commit then keeps nothing, not even the inbox
    record: the message counts a failed attempt instead of being acknowledged without
    its effects. MariaDB and SQLite undo the failed statement alone: applied once."""

    async def handler(message: Incoming, conn: Any) -> None:
        await world.write_effect(conn, message, "test")
        try:
            if world.dialect == "mysql":
                async with conn.cursor() as cursor:
                    await cursor.execute("SELECT * FROM relaybox_no_such_table")
            else:
                await conn.execute("SELECT * FROM relaybox_no_such_table")
        except Exception:  # noqa: BLE001 - what such a handler does
            pass

    consumer = Consumer(handler, inbox=Inbox(consumer="test", table=world.table),
                        transaction=world.transaction, purge_interval=None)  # fmt: skip
    message = incoming("swallowed", payload=b'{"n": 1}', key="k1")
    if world.dialect != "postgresql":
        assert await consumer.process(message, max_attempts=2) is Processed.APPLIED
        assert world.effects() == {"swallowed": 1}
        return
    with pytest.raises(TransactionLostError, match="transaction had failed"):
        await consumer.process(message, max_attempts=2)
    assert await consumer.process(message, max_attempts=2) is Processed.PARKED
    assert world.effects() == {}
    ((message_id, reason, attempts, error, _, _),) = world.parked()
    assert (message_id, reason, attempts) == ("swallowed", "failed", 2)
    assert error.startswith("TransactionLostError: the handler of 'swallowed' returned")
