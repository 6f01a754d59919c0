"""A consumer's activity per minute on every database, for the operator's console:
applied, duplicates and parked counted, the lag from a message's time to its commit,
written now and then and read back from another connection; a write that fails keeps
its counts for the next one and is logged once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from relaybox import sql
from relaybox.consumers.base import BrokerConsumer
from relaybox.core.activity import InboxActivityPoint
from relaybox.core.incoming import Incoming
from relaybox.inbox.activity import read_activity
from relaybox.operations import watch
from tests.inbox.support import DIALECTS, InboxWorld, incoming


@pytest.fixture(params=DIALECTS)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld(request.param, tmp_path) as opened:
        yield opened


def hour_ago() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)


def created(message_id: str, seconds_ago: float) -> Incoming:
    at = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds_ago)
    return dataclasses.replace(incoming(message_id), time=at)


async def refuse(message: Incoming) -> None:
    if message.id.startswith("poison"):
        raise RuntimeError("cannot apply it")


async def points(world: InboxWorld, consumer: str | None = None) -> list[InboxActivityPoint]:
    async with world.transaction() as connection:
        return await read_activity(connection, since=hour_ago(), table=world.table,
                                   consumer=consumer)  # fmt: skip


def totals(found: list[InboxActivityPoint]) -> tuple[int, int, int, int]:
    """Applied, duplicates, parked and lag observations over every minute."""
    return (sum(p.applied for p in found), sum(p.duplicate for p in found),
            sum(p.parked for p in found), sum(p.lag.count for p in found))  # fmt: skip


async def test_applied_duplicates_and_parked_are_counted_with_the_lag(
    world: InboxWorld,
) -> None:
    consumer = world.consumer(before_effect=refuse)
    for message_id in ("m1", "m2"):
        await consumer.process(created(message_id, 30))
    await consumer.process(incoming("m3"))  # no time: applied, no lag
    await consumer.process(created("m1", 30))  # a copy
    await consumer.process(incoming("poison-1"), max_attempts=1)
    assert await points(world) == []  # nothing written yet
    assert await consumer.record_activity()
    found = await points(world)
    assert totals(found) == (3, 1, 1, 2)
    assert {p.consumer for p in found} == {"test"}
    largest = max(p.lag.largest for p in found)
    assert 29 <= largest < 120
    assert all(p.minute.second == 0 and p.minute.tzinfo is not None for p in found)
    other = world.consumer(name="other")
    await other.process(incoming("o1"))
    await consumer.process(incoming("m4"))
    assert await other.record_activity()
    assert await consumer.record_activity()
    assert totals(await points(world, "test")) == (4, 1, 1, 2)
    assert totals(await points(world, "other")) == (1, 0, 0, 0)


async def test_maintain_writes_the_activity_every_interval(world: InboxWorld) -> None:
    consumer = world.consumer()
    consumer.activity_interval = 0.05
    consumer.replay_interval = None
    running = asyncio.create_task(consumer.maintain())
    try:
        await consumer.process(incoming("m1"))
        for _ in range(200):
            if await points(world):
                break
            await asyncio.sleep(0.05)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert totals(await points(world)) == (1, 0, 0, 0)


async def test_a_failed_write_keeps_its_counts_for_the_next_and_is_logged_once(
    world: InboxWorld, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = world.consumer()
    world.run(f"DROP TABLE {world.table}_activity")
    await consumer.process(incoming("m1"))
    with caplog.at_level(logging.WARNING, logger="relaybox.inbox.consumer"):
        assert not await consumer.record_activity()
        await consumer.process(incoming("m2"))
        assert not await consumer.record_activity()
    failures = [r for r in caplog.records if "activity failed" in r.getMessage()]
    assert len(failures) == 1
    (activity_migration,) = (
        script
        for version, _, script in sql.migrations(world.dialect, world.table, "inbox")  # type: ignore[arg-type]
        if version == 2
    )
    for statement in sql.statements(activity_migration):
        world.run(statement)
    assert await consumer.record_activity()
    assert totals(await points(world)) == (2, 0, 0, 0)


async def test_the_console_gets_a_point_for_every_minute_per_consumer(
    world: InboxWorld,
) -> None:
    consumer = world.consumer()
    await consumer.process(created("m1", 2))
    await consumer.process(created("m1", 2))
    assert await consumer.record_activity()
    since = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    async with world.transaction() as connection:
        (series,) = await watch.inbox_activity(connection, since, table=world.table)
        assert await watch.inbox_activity(connection, since, table=world.table,
                                          consumer="other") == []  # fmt: skip
    assert series.consumer == "test"
    assert len(series.points) in (6, 7)  # 7 if the window's end crossed a minute
    (shown,) = watch.consumer_series_json([series]).values()
    assert sum(p["applied"] for p in shown) == 1
    assert sum(p["duplicate"] for p in shown) == 1
    (active,) = [p for p in shown if p["applied"]]
    assert active["lag_avg_seconds"] == active["lag_max_seconds"]
    assert 1.5 <= active["lag_max_seconds"] < 60


class OneDelivery(BrokerConsumer):
    """A broker that delivers one message, then nothing more until stopped."""

    async def consume(self) -> None:
        await self.handle(lambda: incoming("m1"))
        self.ready()
        await asyncio.Event().wait()


async def test_a_broker_consumer_writes_the_activity_when_it_stops(world: InboxWorld) -> None:
    consumer = world.consumer()
    consumer.activity_interval = 3600.0  # only the write on stop falls within the test
    async with OneDelivery(consumer):
        assert await points(world) == []
    assert totals(await points(world)) == (1, 0, 0, 0)
