"""Retry schedule and circuit breaker, with no I/O."""

from __future__ import annotations

import random

import pytest

from relaybox.core.circuit import CircuitBreaker, CircuitPolicy, CircuitState
from relaybox.core.retry import RetryPolicy
from relaybox.errors import ConfigurationError


def test_the_default_retry_waits_a_minute_then_doubles() -> None:
    policy = RetryPolicy()
    assert [policy.nominal_delay(n) for n in (1, 2, 3)] == [60.0, 120.0, 240.0]
    assert policy.jitter == 0.25


def test_delays_double_up_to_the_cap() -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=5.0, jitter=0.0)
    assert [policy.delay(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert policy.nominal_delay(10_000) == 5.0  # no overflow


def test_jitter_stays_within_a_quarter_and_spreads() -> None:
    policy = RetryPolicy(base_delay=60.0)
    rng = random.Random(7)
    delays = [policy.delay(1, rng) for _ in range(2000)]
    assert min(delays) >= 45.0
    assert max(delays) <= 75.0
    assert max(delays) - min(delays) > 25.0  # it really spreads


def test_max_attempts() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert not policy.exhausted(2)
    assert policy.exhausted(3)


@pytest.mark.parametrize(
    "kwargs",
    [{"base_delay": -1.0}, {"max_delay": 1.0, "base_delay": 2.0}, {"multiplier": 0.5},
     {"jitter": 1.0}, {"max_attempts": 0}],
)  # fmt: skip
def test_bad_retry_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_circuit_opens_after_threshold_then_probes_once() -> None:
    clock = Clock()
    circuit = CircuitBreaker(CircuitPolicy(failure_threshold=3, open_seconds=2.0), clock)
    for _ in range(2):
        circuit.record_failure()
    assert circuit.state is CircuitState.CLOSED
    circuit.record_failure()
    assert circuit.state is CircuitState.OPEN
    assert circuit.seconds_until_probe() == 2.0
    assert not circuit.allow_probe()
    clock.now = 2.0
    assert circuit.state is CircuitState.HALF_OPEN
    assert circuit.allow_probe()
    assert not circuit.allow_probe()  # only one probe at a time
    circuit.record_success()
    assert circuit.state is CircuitState.CLOSED


def test_failed_probe_doubles_the_pause_up_to_the_max() -> None:
    clock = Clock()
    circuit = CircuitBreaker(
        CircuitPolicy(failure_threshold=1, open_seconds=1.0, max_open_seconds=3.0), clock
    )
    circuit.record_failure()
    pauses = []
    for _ in range(3):
        clock.now += circuit.seconds_until_probe()
        assert circuit.allow_probe()
        circuit.record_failure()
        pauses.append(circuit.seconds_until_probe())
    assert pauses == [2.0, 3.0, 3.0]


def test_success_resets_the_failure_count() -> None:
    circuit = CircuitBreaker(CircuitPolicy(failure_threshold=2), Clock())
    circuit.record_failure()
    circuit.record_success()
    circuit.record_failure()
    assert circuit.state is CircuitState.CLOSED
