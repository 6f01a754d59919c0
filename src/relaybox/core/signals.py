"""Counters and histograms the relay keeps for its operational signals.

Plain numbers bumped on the event loop and read when someone asks (`/metrics`,
`/api/outbox`): nothing is exported, locked or allocated per message. Exporters
(`relaybox.observability.prometheus`) turn them into their own format when scraped.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from relaybox.core.records import OutboxStats

#: Seconds a publish call takes, to the broker's confirmation.
PUBLISH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Seconds from a message's creation to the broker's confirmation.
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
               300.0, 1800.0, 3600.0)  # fmt: skip

#: A processor's counters, as every exporter names them: (attribute of
#: ProcessorMetrics, metric name, help).
PROCESSOR_COUNTERS = (
    ("claims", "relaybox_relay_claims", "Claims (reads of a batch) made"),
    ("claimed", "relaybox_relay_claimed_messages", "Messages claimed for publishing"),
    ("leases_lost", "relaybox_relay_leases_lost", "Batches given up because a lease ran out"),
    ("heartbeats", "relaybox_relay_heartbeats", "Partition lease heartbeats that succeeded"),
    ("purged", "relaybox_relay_purged_messages", "Finished rows deleted past their retention"),
)
#: What the settles recorded in the table, by outcome.
SETTLED_OUTCOMES = ("published", "failed", "abandoned", "released")
#: What became of each message a target's publisher was given, by outcome.
TARGET_OUTCOMES = ("acked", "retried", "abandoned", "unavailable")


class Histogram:
    """Counts of observations at or below each bound, as Prometheus histograms keep."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), ending with +Inf."""
        total, result = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            result.append((bound, total))
        return result

    def merged(self, other: Histogram) -> Histogram:
        if other.bounds != self.bounds:
            raise ValueError("histograms with different bounds")
        merged = Histogram(self.bounds)
        merged.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        merged.sum = self.sum + other.sum
        return merged


@dataclasses.dataclass
class TargetCounters:
    """What happened to the messages sent to one target (one broker)."""

    #: Messages the broker confirmed.
    acked: int = 0
    #: Transient failures that count an attempt (retried after a backoff).
    retried: int = 0
    #: Failures that abandon the message: permanent, or the last attempt.
    abandoned: int = 0
    #: Messages handed back without an attempt: broker unreachable, or circuit open.
    unavailable: int = 0
    publish_seconds: Histogram = dataclasses.field(
        default_factory=lambda: Histogram(PUBLISH_BUCKETS)
    )
    #: From the creation of the oldest message of each publish call to its confirmation.
    lag_seconds: Histogram = dataclasses.field(default_factory=lambda: Histogram(LAG_BUCKETS))

    @property
    def retry_rate(self) -> float | None:
        """The retry rate: the share of attempts that must be tried again."""
        attempts = self.acked + self.retried + self.abandoned
        return self.retried / attempts if attempts else None

    def merged(self, other: TargetCounters) -> TargetCounters:
        return TargetCounters(
            acked=self.acked + other.acked,
            retried=self.retried + other.retried,
            abandoned=self.abandoned + other.abandoned,
            unavailable=self.unavailable + other.unavailable,
            publish_seconds=self.publish_seconds.merged(other.publish_seconds),
            lag_seconds=self.lag_seconds.merged(other.lag_seconds),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class StatsSample:
    """The last counts read from one outbox table, and how that reading went."""

    stats: OutboxStats | None
    #: time.monotonic() of the reading `stats` came from (None: no reading succeeded).
    taken_at: float | None
    #: Why the latest reading failed (None: it succeeded).
    error: str | None = None

    def age(self, now: float) -> float | None:
        return None if self.taken_at is None else now - self.taken_at
