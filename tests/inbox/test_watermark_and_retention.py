"""Watermark mode with out-of-order redelivery inside a partition (docs/inbox.md, "What
watermark mode accepts"), and id mode's retention purge, on each database."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from relaybox.core.incoming import Incoming
from relaybox.inbox import Consumer, Inbox, Processed
from tests.inbox.support import DIALECTS, InboxWorld, incoming


@pytest.fixture(params=DIALECTS)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld(request.param, tmp_path) as opened:
        yield opened


async def test_watermark_accepts_only_what_is_above_the_mark(world: InboxWorld) -> None:
    consumer = world.consumer(name="wm", mode="watermark")
    # Partition 3 of source A is delivered 1, 2, 4, then 3 late, then copies and 5.
    deliveries = [
        ("A", 3, 1), ("A", 3, 2), ("A", 3, 4),
        ("A", 3, 3),  # out of order: below the mark (4), so taken for a duplicate
        ("A", 3, 2),  # a redelivered copy: a duplicate
        ("A", 3, 4),  # a redelivered copy of the mark itself: a duplicate
        ("A", 3, 5),  # above the mark: applied
        ("A", 9, 1),  # another partition has its own mark
        ("B", 3, 1),  # another source has its own marks
    ]  # fmt: skip
    outcomes = []
    for source, partition, sequence in deliveries:
        message = incoming(f"{source}-{partition}-{sequence}", source=source,
                           partition=partition, sequence=sequence)  # fmt: skip
        outcomes.append((await consumer.process(message)).value[0])
    assert "".join(outcomes) == "aaaddda" + "aa"
    assert set(world.effects("wm")) == {"A-3-1", "A-3-2", "A-3-4", "A-3-5", "A-9-1", "B-3-1"}
    # Gaps are fine: sequences are increasing, not contiguous (the outbox's seq).
    assert await consumer.process(incoming("A-3-90", source="A", partition=3, sequence=90)) \
        is Processed.APPLIED  # fmt: skip


async def test_key_scoped_watermark_follows_each_key(world: InboxWorld) -> None:
    """scope="key": one mark per key, which is the order relaybox's relay keeps; keys of
    one partition may interleave in any way. Keyless messages are checked by id."""
    consumer = world.consumer(name="wk", mode="watermark", scope="key")
    deliveries = [
        ("a", 10), ("b", 11), ("b", 14),
        ("a", 12),  # below b's mark, but above a's own: applied
        ("a", 12),  # a copy: a duplicate
        ("b", 13),  # below b's mark: taken for a duplicate (b must arrive in order)
        (None, 15), (None, 15),  # keyless: by id, the copy skipped
    ]  # fmt: skip
    outcomes = []
    for key, sequence in deliveries:
        message = incoming(f"{key}-{sequence}", key=key, partition=0, sequence=sequence)
        outcomes.append((await consumer.process(message)).value[0])
    assert "".join(outcomes) == "aaaaddad"
    assert world_rows(world, f"SELECT count(*) FROM {world.table}_watermarks") == 2
    assert world.inbox_ids("wk") == {"None-15"}  # only the keyless message left an id


async def test_watermark_consumer_retries_a_failing_handler_in_place(world: InboxWorld) -> None:
    """Handing a failed message back to the broker would let the next one of its lane
    overtake it and move the mark past it; a watermark consumer retries in place."""
    failures = 0

    async def fail_twice(message: Incoming) -> None:
        nonlocal failures
        if message.id == "s1" and failures < 2:
            failures += 1
            raise RuntimeError("database hiccup")

    consumer = world.consumer(name="wr", mode="watermark", before_effect=fail_twice)
    consumer.retry_delay = 0.01
    assert await consumer.process(incoming("s1", partition=0, sequence=1)) is Processed.APPLIED
    assert await consumer.process(incoming("s2", partition=0, sequence=2)) is Processed.APPLIED
    assert consumer.failures == 2
    assert world.effects("wr") == {"s1": 1, "s2": 1}
    by_id = world.consumer(name="ir", before_effect=fail_twice)
    failures = 0
    with pytest.raises(RuntimeError):  # an id inbox leaves the retry to the broker
        await by_id.process(incoming("s1"))
    assert world.effects("ir") == {}


async def test_watermark_keeps_one_row_per_partition(world: InboxWorld) -> None:
    consumer = world.consumer(name="wm", mode="watermark")
    for sequence in range(1, 51):
        await consumer.process(incoming(f"s{sequence}", partition=sequence % 4, sequence=sequence))
    rows = world_rows(world, f"SELECT count(*) FROM {world.table}_watermarks")
    assert rows == 4  # one mark per partition, whatever the number of messages
    assert world_rows(world, f"SELECT count(*) FROM {world.table}") == 0  # no ids kept
    assert await consumer.purge() == 0  # and nothing to purge


async def test_purge_deletes_expired_ids_in_batches(world: InboxWorld) -> None:
    consumer = world.consumer(name="ret", retention=3600, purge_batch=7)
    for n in range(20):
        await consumer.process(incoming(f"old-{n}"))
    await consumer.process(incoming("fresh"))
    others = world.consumer(name="other", retention=3600)
    await others.process(incoming("old-0"))
    age(world, "ret", hours=2, exclude="fresh")
    age(world, "other", hours=2)
    assert await consumer.purge() == 20  # three batches: 7, 7, 6
    assert world.inbox_ids("ret") == {"fresh"}
    assert world.inbox_ids("other") == {"old-0"}  # another consumer's ids are its own
    # A copy that comes back after the window is applied again: the documented limit.
    assert await consumer.process(incoming("old-3")) is Processed.APPLIED
    assert await consumer.process(incoming("fresh")) is Processed.DUPLICATE


async def test_purge_runs_on_its_own_between_messages(world: InboxWorld) -> None:
    consumer = world.consumer(name="auto", retention=3600, purge_interval=0.0)  # every time
    await consumer.process(incoming("a"))
    age(world, "auto", hours=2)
    await consumer.process(incoming("b"))  # this call's purge removes "a" (and not "b")
    assert world.inbox_ids("auto") == {"b"}


def test_sync_handler_runs_in_a_thread_with_a_sync_transaction(tmp_path: Path) -> None:
    """A `def` handler with a sqlite3 transaction: each message in a worker thread."""
    import asyncio

    from relaybox.migrations import migrate

    path = tmp_path / "sync.db"
    asyncio.run(migrate(f"sqlite:///{path}", kind="inbox"))
    with contextlib.closing(sqlite3.connect(path)) as setup, setup:
        setup.execute("CREATE TABLE effects (id TEXT)")

    @contextlib.contextmanager
    def transaction() -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(path, timeout=30)
        try:
            with conn:  # commits on a clean exit, rolls back on an exception
                yield conn
        finally:
            conn.close()

    def handler(message: Incoming, conn: Any) -> None:
        conn.execute("INSERT INTO effects VALUES (?)", (message.id,))

    consumer = Consumer(handler, inbox=Inbox(), transaction=transaction)

    async def run() -> list[Processed]:
        return [await consumer.process(incoming(i)) for i in ("x", "y", "x")]

    assert asyncio.run(run()) == [Processed.APPLIED, Processed.APPLIED, Processed.DUPLICATE]
    with contextlib.closing(sqlite3.connect(path)) as check:
        assert check.execute("SELECT id FROM effects ORDER BY id").fetchall() == [("x",), ("y",)]


def world_rows(world: InboxWorld, query: str) -> int:
    from tests.databases import fetch_all

    return int(fetch_all(world.url, query)[0][0])


def age(world: InboxWorld, consumer: str, *, hours: int, exclude: str = "") -> None:
    """Make `consumer`'s recorded ids look `hours` old."""
    if world.dialect == "postgresql":
        moment = f"now() - interval '{hours} hours'"
    elif world.dialect == "mysql":
        moment = f"CURRENT_TIMESTAMP(6) - INTERVAL {hours} HOUR"
    else:
        moment = f"strftime('%Y-%m-%d %H:%M:%f', 'now', '-{hours} hours')"
    world.run(
        f"UPDATE {world.table} SET processed_at = {moment} "
        f"WHERE consumer = '{consumer}' AND message_id <> '{exclude}'"
    )


async def test_a_message_the_watermark_cannot_place_is_parked_once(world: InboxWorld) -> None:
    """A keyed message without a sequence (or, by partition, without a partition) would
    fail the same way at every delivery: it is parked as invalid at once, recorded by
    its id, and its copies are duplicates."""
    for scope, message in (
        ("key", incoming("no-seq", key="k1", partition=1)),
        ("partition", incoming("no-partition", key="k1", sequence=5)),
    ):
        consumer = world.consumer(name=scope, mode="watermark", scope=scope)
        assert await consumer.process(message) is Processed.PARKED
        assert await consumer.process(message) is Processed.DUPLICATE
        ((message_id, reason, attempts, error, _, status),) = world.parked(scope)
        assert (message_id, reason, attempts, status) == (message.id, "invalid", 0, "parked")
        assert "watermark inbox" in error
        assert world.effects(scope) == {}


async def test_a_failure_whose_attempt_cannot_be_counted_is_retried_in_place(
    world: InboxWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler fails while the database is away, so its attempt cannot be counted
    either: handed back to the broker, the message could be overtaken by the next of
    its lane, which would move the mark past it. The watermark consumer tries it again
    in place until it is applied."""
    failures = [RuntimeError("the database is away")]

    async def away(message: Incoming) -> None:
        if failures:
            raise failures.pop()

    consumer = world.consumer(mode="watermark", before_effect=away)
    consumer.retry_delay = 0.01
    count = consumer._count
    refused: list[bool] = []

    async def cannot_count(message: Incoming, error: BaseException | None) -> int:
        if error is not None and not refused:
            refused.append(True)
            raise error
        return await count(message, error)

    monkeypatch.setattr(consumer, "_count", cannot_count)
    message = incoming("m5", key="k1", partition=1, sequence=5)
    assert await consumer.process(message) is Processed.APPLIED
    assert refused == [True]
    assert world.effects() == {"m5": 1}
