"""The fast window on real databases: a NOTIFY from another connection, or rows found,
keep an in-process relay reading for the window; then it is back to its idle poll, and
an idle relay's reads stay bounded. Counts and states are asserted, never speed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest

from relaybox.core.identifiers import notify_channel
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import Relay, RelaySettings
from relaybox.relay.processor import Processor
from tests.relay_support import OutboxDB, eventually, fast_settings, messages, outbox_db

#: Outside the window this relay reads once a minute: a read the test sees within
#: seconds of the first was woken or came from the window, never from the idle poll.
IDLE_POLL = 60.0


@pytest.fixture
async def pg_db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path):
        yield each


@pytest.fixture
async def sqlite_db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("sqlite", tmp_path):
        yield each


def relay_of(db: OutboxDB, publisher: MemoryPublisher, **settings: float) -> Relay:
    fields = {"idle_interval": IDLE_POLL, "min_poll_interval": IDLE_POLL, **settings}
    return Relay(db.database, {"default": publisher}, table=db.table,
                 settings=fast_settings(**fields))  # fmt: skip


def reads(relay: Relay) -> int:
    return relay.processors[0].metrics.claims


async def idle(relay: Relay) -> Processor[object]:
    """The relay's processor once it holds every partition (taking them wakes it), its
    read after that found nothing and the window is shut."""
    await eventually(lambda: relay.processors and relay.processors[0].partitions_held == 8)
    processor = relay.processors[0]
    await eventually(lambda: reads(relay) >= 1 and not processor.polling_fast)
    await asyncio.sleep(0.1)  # the read the partitions woke, if it is still running
    return processor


def notify(db: OutboxDB) -> None:
    """What a writer's NOTIFY sends, from a connection of another client."""
    with psycopg.connect(db.url, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, '')", (notify_channel(db.table),))


async def test_a_notify_keeps_the_relay_reading_for_the_window_then_it_idles(
    pg_db: OutboxDB,
) -> None:
    async with relay_of(pg_db, MemoryPublisher(), fast_poll_window=1.0) as relay:
        processor = await idle(relay)
        before = reads(relay)
        await asyncio.sleep(0.3)
        assert reads(relay) == before  # idle: the next poll is a minute away
        notify(pg_db)
        # Woken, it reads, finds nothing, and reads again and again within the window,
        # where the adaptive poll alone would wait a minute after the first.
        await eventually(lambda: reads(relay) >= before + 5)
        await eventually(lambda: not processor.polling_fast)
        after = reads(relay)
        await asyncio.sleep(0.3)
        assert reads(relay) <= after + 1  # at most the read that was running


async def test_an_unannounced_commit_inside_the_window_is_found_by_it(pg_db: OutboxDB) -> None:
    """The writer's NOTIFY came with an earlier commit; this one carries none."""
    publisher = MemoryPublisher()
    async with relay_of(pg_db, publisher, fast_poll_window=IDLE_POLL) as relay:
        processor = await idle_then_hinted(relay, pg_db)
        await pg_db.write(messages(["k"], per_key=1))
        await eventually(lambda: len(publisher.published) == 1, timeout=IDLE_POLL / 3)
        assert processor.polling_fast


async def idle_then_hinted(relay: Relay, db: OutboxDB) -> Processor[object]:
    await eventually(lambda: relay.processors and reads(relay) >= 1)
    processor = relay.processors[0]
    notify(db)
    await eventually(lambda: processor.polling_fast)
    return processor


async def test_without_a_window_a_notify_earns_one_read(pg_db: OutboxDB) -> None:
    async with relay_of(pg_db, MemoryPublisher(), fast_poll_window=0) as relay:
        processor = await idle(relay)
        before = reads(relay)
        notify(pg_db)
        await eventually(lambda: reads(relay) >= before + 1)
        await asyncio.sleep(0.3)
        assert reads(relay) == before + 1
        assert not processor.polling_fast


async def test_found_rows_open_the_window_where_there_is_no_notify(sqlite_db: OutboxDB) -> None:
    publisher = MemoryPublisher()
    # Written before the relay starts, so that its first read finds it: written after,
    # it would wait for the idle poll, a minute away.
    await sqlite_db.write(messages(["k"], per_key=1))
    async with relay_of(sqlite_db, publisher, fast_poll_window=IDLE_POLL) as relay:
        await eventually(lambda: len(publisher.published) == 1, timeout=IDLE_POLL / 3)
        processor = relay.processors[0]
        assert processor.polling_fast
        found = reads(relay)
        # Nothing announces this one, and the idle poll is a minute away: the window finds it.
        await sqlite_db.write(messages(["k"], per_key=1))
        await eventually(lambda: len(publisher.published) == 2, timeout=IDLE_POLL / 3)
        assert reads(relay) > found


async def test_an_idle_relay_reads_about_once_per_idle_interval(pg_db: OutboxDB) -> None:
    """No NOTIFY, no rows: the window never opens, and reads and heartbeats stay at the
    idle poll's and the lease's pace (a slow machine only makes fewer)."""
    settings: RelaySettings = fast_settings(min_poll_interval=0.05, idle_interval=0.2)
    async with Relay(pg_db.url, {"default": MemoryPublisher()}, table=pg_db.table,
                     settings=settings) as relay:  # fmt: skip
        await eventually(lambda: relay.processors and reads(relay) >= 1)
        processor = relay.processors[0]
        metrics = processor.metrics
        before = (metrics.claims, metrics.heartbeats)
        await asyncio.sleep(2.0)
        assert not processor.polling_fast
        # 2 s at one read per 0.2 s at most, and a heartbeat per 0.5 s (lease 3 s / 6).
        assert metrics.claims - before[0] <= 2.0 / 0.2 + 2
        assert metrics.heartbeats - before[1] <= 2.0 / 0.5 + 2
