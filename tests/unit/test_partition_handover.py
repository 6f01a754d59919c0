"""A relay gives back the partitions it must give back as soon as their rows in flight
are settled, not at its next heartbeat: the heartbeat comes at once. The heartbeat
pauses are made long here, so only that can explain a second heartbeat."""

from __future__ import annotations

import datetime
import uuid

import pytest

from relaybox import Relay
from relaybox.core.records import Claim, StoredMessage
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import partition_leases
from relaybox.storage.memory import MemoryStorage
from tests.relay_support import eventually, fast_settings


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
