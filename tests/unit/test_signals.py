from __future__ import annotations

import pytest

from relaybox import Relay
from relaybox.core.signals import Histogram, TargetCounters
from relaybox.observability.snapshot import snapshot
from relaybox.publishers.memory import MemoryPublisher
from relaybox.storage.memory import MemoryStorage


def test_a_histogram_counts_each_value_at_or_below_its_bound() -> None:
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        histogram.observe(value)
    assert histogram.cumulative() == [(0.1, 2), (1.0, 4), (float("inf"), 5)]
    assert histogram.count == 5
    assert histogram.sum == pytest.approx(8.65)
    merged = histogram.merged(histogram)
    assert merged.cumulative()[-1] == (float("inf"), 10)
    with pytest.raises(ValueError, match="bounds"):
        histogram.merged(Histogram((0.5,)))


def test_the_retry_rate_is_the_share_of_attempts_tried_again() -> None:
    assert TargetCounters().retry_rate is None
    counters = TargetCounters(acked=7, retried=2, abandoned=1, unavailable=50)
    assert counters.retry_rate == pytest.approx(0.2)  # unreachable brokers cost no attempt
    total = counters.merged(TargetCounters(acked=1))
    assert (total.acked, total.retried, total.unavailable) == (8, 2, 50)


async def test_a_relay_that_is_not_running_is_not_ready() -> None:
    relay = Relay(MemoryStorage(), {"default": MemoryPublisher()})
    assert relay.readiness() == ["the relay is not running"]
    status = await snapshot(relay)
    assert status["ready"] is False
    assert status["signals"]["pending"] is None  # no table read yet
