"""The claim loop's waits: the adaptive poll, and the fast window a hint or found rows
open (a clock the test moves, so no wait depends on the machine's speed)."""

from __future__ import annotations

import pytest

from relaybox import ConfigurationError
from relaybox.relay import RelaySettings
from relaybox.relay.waker import Waker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def waker(clock: Clock, window: float = 0.2) -> Waker:
    return Waker(0.01, 1.0, fast_interval=0.001, fast_window=window, clock=clock)


def empty_reads(found: Waker, count: int) -> list[float]:
    """The waits after `count` reads in a row that found nothing."""
    waits = []
    for _ in range(count):
        found.found_nothing()
        waits.append(found.delay)
    return waits


def test_without_hints_the_poll_backs_off_to_the_idle_interval() -> None:
    found = waker(Clock())
    assert empty_reads(found, 9) == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0]
    assert not found.fast


def paced_empty_reads(found: Waker, clock: Clock, count: int) -> list[float]:
    """The waits after `count` empty reads in a row, the clock moving by each wait."""
    waits = []
    for _ in range(count):
        found.found_nothing()
        waits.append(found.delay)
        clock.now += found.delay
    return waits


def test_a_hint_opens_the_window_and_the_poll_backs_off_after_it() -> None:
    clock = Clock()
    found = waker(clock)
    empty_reads(found, 9)  # idle: a read a second
    found.hint()
    assert found.delay == 0
    assert found.fast
    # An empty read in the window waits a quarter of the time since the hint, at
    # least the fast interval: 1 ms while that is under 4 ms, then a quarter later
    # each time.
    assert paced_empty_reads(found, clock, 7) == pytest.approx(
        [0.001, 0.001, 0.001, 0.001, 0.001, 0.00125, 0.0015625]
    )
    clock.now = 1000.0 + 0.19
    assert empty_reads(found, 1) == pytest.approx([0.19 / 4])
    clock.now += 0.02  # the window is over: the adaptive poll, from its shortest wait
    assert not found.fast
    assert empty_reads(found, 4) == pytest.approx([0.01, 0.02, 0.04, 0.08])


def test_a_steady_stream_keeps_the_fast_interval_through_its_gaps() -> None:
    """Messages every 2 ms, with now and then a gap of 3 ms: the reads between them
    stay a millisecond apart, as the last rows are always recent. (Counting empty reads
    instead made the third read after a 3 ms gap wait 1.56 ms, which was the
    stream's tail.)"""
    clock = Clock()
    found = waker(clock)
    for gap in [2, 2, 3, 2, 3, 3, 2] * 3:
        found.found_work(more=False)
        assert found.delay == 0.001
        clock.now += 0.001
        for _ in range(gap - 1):
            found.found_nothing()
            assert found.delay == 0.001
            clock.now += 0.001


def test_found_rows_extend_the_window() -> None:
    clock = Clock()
    found = waker(clock)
    found.hint()
    for _ in range(5):  # rows keep turning up, each within the window the last opened
        clock.now += 0.15
        found.found_work(more=False)
        assert found.fast
        assert empty_reads(found, 1) == pytest.approx([0.001])
        clock.now += 0.008
        assert empty_reads(found, 1) == pytest.approx([0.002])
    clock.now += 0.21
    assert empty_reads(found, 1) == pytest.approx([0.01])


def test_found_rows_open_the_window_without_a_hint() -> None:
    """What a relay gets where there is no NOTIFY (MariaDB, SQLite)."""
    clock = Clock()
    found = waker(clock)
    empty_reads(found, 9)
    found.found_work(more=False)
    assert found.fast
    assert paced_empty_reads(found, clock, 7) == pytest.approx(
        [0.001, 0.001, 0.001, 0.001, 0.001, 0.00125, 0.0015625]
    )


def test_within_the_window_only_a_full_batch_reads_again_at_once() -> None:
    clock = Clock()
    found = waker(clock)
    found.found_work(more=True)
    assert found.delay == 0
    found.found_work(more=False)
    assert found.delay == 0.001
    no_window = waker(clock, window=0)
    no_window.found_work(more=False)
    assert no_window.delay == 0


def test_a_burst_end_costs_a_few_empty_reads_not_one_per_interval() -> None:
    """After the last message the empty reads space out: the window's 0.2 s take about
    twenty, where a read every millisecond would take two hundred."""
    clock = Clock()
    found = waker(clock)
    found.found_work(more=False)
    reads = 0
    while found.fast:
        found.found_nothing()
        clock.now += found.delay
        reads += 1
    assert 15 <= reads <= 25


def test_a_failed_read_never_polls_fast() -> None:
    clock = Clock()
    found = waker(clock)
    found.hint()
    waits = []
    for _ in range(3):
        found.found_nothing(looked=False)
        waits.append(found.delay)
    assert waits == [0.01, 0.02, 0.04]


def test_a_failed_read_in_the_window_backs_off_from_the_shortest_wait() -> None:
    """A read that fails inside the window, after empty reads there, waits as the
    adaptive poll does from its start, not from the window's longer waits."""
    clock = Clock()
    found = waker(clock)
    found.hint()
    paced_empty_reads(found, clock, 18)
    assert found.fast
    assert found.delay > 0.01  # the window's waits have grown past the poll's shortest
    waits = []
    for _ in range(2):
        found.found_nothing(looked=False)
        waits.append(found.delay)
    assert waits == [0.01, 0.02]


def test_a_plain_wake_opens_no_window() -> None:
    found = waker(Clock())
    found.wake()
    assert found.delay == 0
    assert not found.fast
    assert empty_reads(found, 2) == [0.01, 0.02]


def test_no_window_is_the_adaptive_poll_alone() -> None:
    found = waker(Clock(), window=0)
    found.hint()
    assert not found.fast
    assert empty_reads(found, 3) == [0.01, 0.02, 0.04]


@pytest.mark.parametrize(
    "fields",
    [
        {"fast_poll_interval": 0},
        {"fast_poll_interval": 2.0},  # longer than idle_interval
        {"fast_poll_window": -1},
    ],
)
def test_fast_poll_settings_are_checked(fields: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError, match="fast_poll"):
        RelaySettings(**fields)
