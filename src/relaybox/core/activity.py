"""What relays and consumers write of their activity for the operator's console, which
reads it from a process of its own: counts per minute, lags, and each relay's circuit
state per target.

Minutes are whole minutes since the Unix epoch, UTC, taken from the database's clock
when a count is written; a point's `minute` is the start of its minute. Lags are seconds:
a relay's from a message's creation to the broker's confirmation (one observation per
publish call, of its oldest message), a consumer's from a message's time to the commit
of its effects.
"""

from __future__ import annotations

import dataclasses
import datetime

from relaybox.core.circuit import CircuitState

#: Seconds the activity and status rows are kept before housekeeping deletes them.
ACTIVITY_RETENTION = 2 * 3600.0
#: Seconds since its last write within which a relay's status row counts as live.
STATUS_LIVE_SECONDS = 60.0


def minute_of(moment: datetime.datetime) -> int:
    """The minute (since the Unix epoch) that holds `moment` (an aware datetime)."""
    if moment.tzinfo is None:
        raise ValueError("give an aware datetime (UTC or any zone)")
    return int(moment.timestamp() // 60)


def minute_start(minute: int) -> datetime.datetime:
    """The start of `minute`, in UTC."""
    return datetime.datetime.fromtimestamp(int(minute) * 60, datetime.UTC)


@dataclasses.dataclass(frozen=True, slots=True)
class Lag:
    """Lag observations: their sum, largest and count (seconds)."""

    total: float = 0.0
    largest: float = 0.0
    count: int = 0

    @property
    def average(self) -> float | None:
        return self.total / self.count if self.count else None

    def observed(self, seconds: float) -> Lag:
        """These observations and one more."""
        seconds = max(0.0, seconds)
        return Lag(self.total + seconds, max(self.largest, seconds), self.count + 1)

    def merged(self, other: Lag) -> Lag:
        return Lag(
            self.total + other.total, max(self.largest, other.largest), self.count + other.count
        )


#: No observation yet.
NO_LAG = Lag()


@dataclasses.dataclass(frozen=True, slots=True)
class TargetActivity:
    """What one relay records of one target in one write: the counts since its last
    write, and the target's circuit state and last error now."""

    target: str
    circuit: CircuitState
    #: The last error a publish to the target met, secrets masked (None: none yet).
    last_error: str | None = None
    #: Messages the broker confirmed.
    published: int = 0
    #: Transient failures that count an attempt (the message is retried later).
    failed: int = 0
    #: Messages given up on: a permanent failure, or the last attempt.
    abandoned: int = 0
    lag: Lag = NO_LAG

    @property
    def counted(self) -> bool:
        """Whether there is anything to add to the activity table."""
        return bool(self.published or self.failed or self.abandoned or self.lag.count)


@dataclasses.dataclass(frozen=True, slots=True)
class ActivityPoint:
    """One target's minute of relay activity, summed over the relays that served it."""

    target: str
    #: The start of the minute, UTC.
    minute: datetime.datetime
    published: int
    failed: int
    abandoned: int
    lag: Lag


@dataclasses.dataclass(frozen=True, slots=True)
class RelayStatus:
    """A relay's last word on one target: its circuit state and last error."""

    worker: str
    target: str
    circuit: CircuitState
    last_error: str | None
    #: When the relay wrote it (the database's clock).
    updated_at: datetime.datetime


@dataclasses.dataclass(frozen=True, slots=True)
class InboxActivityPoint:
    """One consumer's minute of inbox activity, summed over its processes."""

    consumer: str
    #: The start of the minute, UTC.
    minute: datetime.datetime
    applied: int
    duplicate: int
    parked: int
    #: From a message's time to the commit of its effects, per applied message that
    #: carried a time.
    lag: Lag
