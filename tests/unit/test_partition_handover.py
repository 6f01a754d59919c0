"""A relay gives back the partitions it must give back as soon as their rows in flight
are settled, not at its next heartbeat: the heartbeat comes at once. The heartbeat
pauses are made long here, so only that can explain a second heartbeat. And a heartbeat
that comes while a publish's lease guard has fired, its delivery still unwinding, leaves
that guard as it is."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import uuid
from collections.abc import Sequence

import pytest

from relaybox import Relay
from relaybox.core.publishing import ACKED, PublishResult
from relaybox.core.records import Claim, Routing, Settled, StoredMessage
from relaybox.errors import StorageOperationalError
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import partition_leases
from relaybox.relay import processor as processor_module
from relaybox.storage.memory import MemoryStorage
from tests.relay_support import eventually, fast_settings, messages


def row(partition: int) -> StoredMessage:
    now = datetime.datetime.now(datetime.UTC)
    return StoredMessage(
        partition, uuid.uuid4(), "default", False, "t", f"k{partition}", partition, "T",
        "text/plain", b"", {}, None, None, None, None, now, 0,
    )  # fmt: skip


async def test_a_heartbeat_comes_at_once_when_what_is_given_back_has_nothing_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for pace in ("JOINING_HEARTBEAT_SECONDS", "SHARING_HEARTBEAT_SECONDS"):
        monkeypatch.setattr(partition_leases, pace, 60.0)
    relay = Relay(
        MemoryStorage(), {"default": MemoryPublisher()}, settings=fast_settings(lease_seconds=60)
    )
    async with relay:
        (processor,) = relay.processors
        await eventually(lambda: processor.metrics.heartbeats == 1)
        first, second = Claim("", processor.worker, [row(1)]), Claim("", processor.worker, [row(2)])
        processor._launched(first)
        processor._launched(second)
        processor._draining = {"default": frozenset({1})}  # as a heartbeat leaves it
        processor._finished(second)  # partition 1 still has a row in flight
        assert not processor._heartbeat_now.is_set()
        processor._finished(first)
        assert processor._heartbeat_now.is_set()
        await eventually(lambda: processor.metrics.heartbeats == 2, timeout=10)
        assert processor._draining == {}


async def test_a_heartbeat_beside_a_guard_that_fired_leaves_it_alone() -> None:
    relay = Relay(MemoryStorage(), {"default": MemoryPublisher()}, settings=fast_settings())
    async with relay:
        (processor,) = relay.processors
        assert isinstance(processor, partition_leases.PartitionLeaseProcessor)
        await eventually(lambda: processor.metrics.heartbeats >= 1)

        async def delivery() -> None:
            async with asyncio.timeout(0.01) as guard:
                processor._guards.add(guard)
                try:
                    await asyncio.sleep(1)
                except asyncio.CancelledError:  # fired; the delivery is unwinding
                    assert guard.expired()
                    processor._hold()  # what a heartbeat that ends now does
                    raise
                finally:
                    processor._guards.discard(guard)

        with pytest.raises(TimeoutError):
            await delivery()
        heartbeats = processor.metrics.heartbeats
        await eventually(lambda: processor.metrics.heartbeats > heartbeats)


async def test_the_heartbeats_go_on_after_an_unexpected_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    beat = partition_leases.PartitionLeaseProcessor._heartbeat
    calls = 0

    async def flaky(
        self: partition_leases.PartitionLeaseProcessor, target: str, begun: float
    ) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("a bug")
        await beat(self, target, begun)

    monkeypatch.setattr(partition_leases.PartitionLeaseProcessor, "_heartbeat", flaky)
    relay = Relay(MemoryStorage(), {"default": MemoryPublisher()}, settings=fast_settings())
    async with relay:
        (processor,) = relay.processors
        await eventually(lambda: processor.metrics.heartbeats >= 3)
    assert calls >= 4
    assert "heartbeat failed" in caplog.text


async def test_after_a_failed_heartbeat_only_partitions_with_rows_in_flight_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A heartbeat that fails may have given partitions back before its answer was
    lost, and another relay may take them at once: until one succeeds, the relay reads
    only the partitions it has rows in flight in, which no heartbeat gives back."""
    storage = MemoryStorage()
    relay = Relay(storage, {"default": MemoryPublisher()}, settings=fast_settings())
    async with relay:
        (processor,) = relay.processors
        await eventually(lambda: len((processor.partitions or {}).get("default", ())) == 8)
        batch = Claim("", processor.worker, [row(3)])
        processor._launched(batch)  # rows in flight in partition 3
        beat = storage.heartbeat
        failed: list[bool] = []

        async def lost(*args: object, **kwargs: object) -> object:
            failed.append(True)
            raise StorageOperationalError("the answer was lost")

        monkeypatch.setattr(storage, "heartbeat", lost)
        await eventually(lambda: bool(failed))
        assert (processor.partitions or {}).get("default") == frozenset({3})
        monkeypatch.setattr(storage, "heartbeat", beat)
        processor._finished(batch)
        await eventually(lambda: len((processor.partitions or {}).get("default", ())) == 8)


async def test_a_publisher_bug_mid_batch_keeps_what_was_confirmed_before_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second wave of a batch breaks in the relay (the publisher answered with
    something that is no result): the first wave's confirmed message is settled, not
    published again, and the rest comes again in order."""

    class Glitch(MemoryPublisher):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
            self.calls += 1
            if self.calls == 2:
                return [None] * len(messages)  # type: ignore[list-item]
            return await super().publish(messages)

    storage, publisher = MemoryStorage(), Glitch()
    await storage.write(Routing.of(["default"], None).rows(messages(["k"], per_key=3)))
    relay = Relay(storage, {"default": publisher}, settings=fast_settings())
    async with relay:
        await eventually(lambda: len(publisher.published) >= 3)
        await asyncio.sleep(0.2)
    assert [json.loads(m.payload)["n"] for m in publisher.published] == [0, 1, 2]
    assert "publishing a batch failed" in caplog.text


async def test_the_claim_loop_goes_on_after_an_unexpected_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    storage, publisher = MemoryStorage(), MemoryPublisher()
    read = storage.read
    calls = 0

    async def flaky(**kwargs: object) -> list[StoredMessage]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        return await read(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(storage, "read", flaky)
    await storage.write(Routing.of(["default"], None).rows(messages(["k"], per_key=2)))
    async with Relay(storage, {"default": publisher}, settings=fast_settings()):
        await eventually(lambda: len(publisher.published) == 2)
    assert calls >= 2
    assert "claim failed" in caplog.text


async def test_a_settle_stopped_between_its_tries_is_tried_once_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The database refuses a batch's settle, and the relay is stopped in the pause
    before the next try: one more try, the batch's task being cancelled, records what
    the broker confirmed, which is not published again."""
    storage, publisher = MemoryStorage(), MemoryPublisher()
    settle = storage.settle
    refused: list[bool] = []

    async def refusing(*args: object, **kwargs: object) -> Settled:
        task = asyncio.current_task()
        if task is None or not task.cancelling():  # only a try made once stopped passes
            refused.append(True)
            raise StorageOperationalError("the database is away")
        return await settle(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(storage, "settle", refusing)
    await storage.write(Routing.of(["default"], None).rows(messages(["k"], per_key=1)))
    async with Relay(storage, {"default": publisher}, settings=fast_settings(shutdown_timeout=0.2)):
        await eventually(lambda: len(publisher.published) == 1 and bool(refused))
    assert (await storage.stats()).counts == {}  # settled: nothing left to publish again


async def test_a_batch_that_outlives_its_cancel_publishes_nothing_once_partitions_are_given_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publish that ignores the stop's cancel and answers after the relay has given its
    partitions back: the batch's next wave does not go out (another relay may own those
    rows by now)."""
    monkeypatch.setattr(processor_module, "STOP_GRACE", 0.2)

    class Stubborn(MemoryPublisher):
        calls = 0
        sent: list[StoredMessage] = []

        async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
            self.calls += 1
            if self.calls == 1:  # deaf to every cancel, it answers after the stop
                until = asyncio.get_running_loop().time() + 1.0
                while (left := until - asyncio.get_running_loop().time()) > 0:
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.sleep(left)
            self.sent.extend(messages)
            return [ACKED] * len(messages)

    storage, publisher = MemoryStorage(), Stubborn()
    await storage.write(Routing.of(["default"], None).rows(messages(["k"], per_key=2)))
    relay = Relay(storage, {"default": publisher}, settings=fast_settings(shutdown_timeout=0.1))
    await relay.start()
    await eventually(lambda: publisher.calls == 1)
    await relay.stop()  # gives the partitions back before the publish answers
    assert publisher.sent == []
    await asyncio.sleep(1.5)  # the batch's task answers, and would send its next wave
    assert [json.loads(m.payload)["n"] for m in publisher.sent] == [0]
