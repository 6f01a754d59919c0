"""The relay's activity per target, counted as deliveries go and written to the table
now and then for the operator's console (`ActivityStorage`).

Deliveries add to a `Tally` per target (per publish call, not per message). The
processor's housekeeping takes the counts every `RelaySettings.activity_interval`
seconds and on stop, and writes them on its housekeeping connection: never on the way
of a claim or a settle. A write that fails gives the counts back to the next one and
is logged, at most once per `ActivityLog.every` seconds; it never stops the relay.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from relaybox.core.activity import NO_LAG, Lag, TargetActivity
from relaybox.core.circuit import CircuitState

logger = logging.getLogger(__name__)

#: Characters of a last error kept: enough to read, never a whole response body.
ERROR_LIMIT = 1000


@dataclasses.dataclass(slots=True)
class Tally:
    """One target's counts since they were last taken, and its last error."""

    published: int = 0
    failed: int = 0
    abandoned: int = 0
    lag: Lag = NO_LAG
    #: The last error a publish to the target met, secrets masked.
    last_error: str | None = None

    def failure(self, error: str) -> None:
        self.last_error = error[:ERROR_LIMIT]

    def take(self, target: str, circuit: CircuitState) -> TargetActivity:
        """The counts so far, with the circuit state; the counts start again at zero
        (the last error stays)."""
        taken = TargetActivity(target, circuit, self.last_error, self.published, self.failed,
                               self.abandoned, self.lag)  # fmt: skip
        self.published = self.failed = self.abandoned = 0
        self.lag = NO_LAG
        return taken

    def give_back(self, taken: TargetActivity) -> None:
        """Counts taken for a write that failed: the next write adds them."""
        self.published += taken.published
        self.failed += taken.failed
        self.abandoned += taken.abandoned
        self.lag = self.lag.merged(taken.lag)


class ActivityLog:
    """Logs failed writes and purges of the activity: the first, then at most one per
    `every` seconds (saying how many failed since the last write that worked), and once
    when writes succeed again."""

    def __init__(self, every: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self._clock = clock
        self._failures = 0
        self._logged_at: float | None = None

    def failed(self, doing: str, error: BaseException) -> None:
        """`doing` ("writing", "purging") the relay's activity raised `error`."""
        self._failures += 1
        now = self._clock()
        if self._logged_at is not None and now - self._logged_at < self.every:
            return
        self._logged_at = now
        logger.warning(
            "%s the relay's activity failed (%d failure(s) since writing it last worked): "
            "%s; the relay goes on, and the next write adds the counts not written",
            doing, self._failures, error, extra={"action": "activity_error"},
        )  # fmt: skip

    def succeeded(self) -> None:
        """A write went through. The time of the last warning stays: a write that
        touches only some of the tables can succeed between failures, and the warnings
        keep to one per `every` seconds all the same."""
        if self._failures:
            logger.info("writing the relay's activity works again",
                        extra={"action": "activity_recovered"})  # fmt: skip
        self._failures = 0
