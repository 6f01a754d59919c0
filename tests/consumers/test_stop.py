"""Stopping a broker consumer ends it even when its client swallows a cancellation: the
consuming task is cancelled again until it ends, and left behind after a bounded wait.
No broker is needed: the consumers here stand in for a client that misbehaves."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from relaybox.consumers import base
from relaybox.consumers.base import BrokerConsumer


class IdleProcessor:
    """What `BrokerConsumer.run` needs of its consumer, doing nothing."""

    activity_interval = None

    async def maintain(self) -> None:
        await asyncio.Event().wait()


class SwallowsCancels(BrokerConsumer):
    """A consumer whose client swallows the first `swallowed` cancellations (as a
    blocking read cancelled at the wrong moment can) and goes on waiting."""

    def __init__(self, swallowed: int) -> None:
        super().__init__(IdleProcessor())  # type: ignore[arg-type]
        self.swallowed = swallowed
        self.cancels = 0
        self.ended = False

    async def consume(self) -> None:
        self.ready()
        try:
            while True:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.cancels += 1
                    if self.cancels > self.swallowed:
                        raise
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
        finally:
            self.ended = True


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "STOP_GRACE", 0.05)


async def test_a_swallowed_cancellation_is_followed_by_another_until_the_task_ends() -> None:
    consumer = SwallowsCancels(swallowed=2)
    await consumer.start()
    await consumer.stop()
    assert consumer.ended
    assert consumer.cancels == 3


async def test_a_task_that_never_ends_is_left_behind_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    consumer = SwallowsCancels(swallowed=1_000)
    await consumer.start()
    task = consumer._task
    assert task is not None
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="relaybox.consumers.base"):
        await consumer.stop()
    assert time.monotonic() - started < 5  # three rounds of 0.05 s, not forever
    assert not consumer.ended
    assert consumer.cancels == base.STOP_ROUNDS
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "consumer_stop_abandoned"]
    assert "SwallowsCancels did not stop" in record.getMessage()
    consumer.swallowed = 0  # let the test end it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert consumer.ended


async def test_a_consumer_that_honours_the_cancellation_stops_at_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(base, "STOP_GRACE", 30.0)
    consumer = SwallowsCancels(swallowed=0)
    await consumer.start()
    started = time.monotonic()
    await consumer.stop()
    assert time.monotonic() - started < 5  # no grace waited out
    assert consumer.ended
    assert consumer.cancels == 1
