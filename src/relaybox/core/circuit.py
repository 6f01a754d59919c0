"""A circuit breaker per target: a destination that keeps failing pauses, then probes.

While a target's circuit is open the relay claims nothing for it, so its messages wait
as pending and burn no attempts; other targets keep flowing.
After `open_seconds` one probe is let through (half-open): success closes the circuit,
failure opens it again for twice as long, up to `max_open_seconds`.

A circuit can also be held open, whatever the clock says, while its target cannot be
used at all: the relay holds it until the target's publisher has connected.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable

from relaybox.core.retry import RetryPolicy
from relaybox.errors import ConfigurationError


class CircuitState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclasses.dataclass(frozen=True, slots=True)
class CircuitPolicy:
    #: Consecutive publishes of a target that failed transiently before it opens.
    failure_threshold: int = 5
    open_seconds: float = 5.0
    max_open_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ConfigurationError("failure_threshold must be at least 1")
        if not 0 < self.open_seconds <= self.max_open_seconds:
            raise ConfigurationError("circuit times must satisfy 0 < open <= max_open")

    @property
    def pauses(self) -> RetryPolicy:
        """How long the circuit stays open after 0, 1, 2 ... failed probes: doubling
        from `open_seconds` up to `max_open_seconds`, without jitter."""
        return RetryPolicy(base_delay=self.open_seconds, max_delay=self.max_open_seconds,
                           jitter=0.0)  # fmt: skip


class CircuitBreaker:
    """Not thread-safe: one per target inside one event loop."""

    def __init__(
        self,
        policy: CircuitPolicy,
        clock: Callable[[], float] = time.monotonic,
        *,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._policy = policy
        self._clock = clock
        #: Called when a success closes the circuit after it had opened.
        self._on_close = on_close
        self._held = False
        self._failures = 0
        self._opened_at = 0.0
        self._pauses = policy.pauses
        self._failed_probes = 0
        self._state = CircuitState.CLOSED
        self._probing = False

    @property
    def _open_for(self) -> float:
        return self._pauses.nominal_delay(self._failed_probes + 1)

    @property
    def state(self) -> CircuitState:
        if self._held:
            return CircuitState.OPEN
        if self._state is CircuitState.OPEN and self._clock() >= self._opened_at + self._open_for:
            self._state = CircuitState.HALF_OPEN
        return self._state

    def seconds_until_probe(self) -> float:
        """0 when a probe may go now; infinite while held (`release()` says when)."""
        if self.state is not CircuitState.OPEN:
            return 0.0
        if self._held:
            return math.inf
        return self._opened_at + self._open_for - self._clock()

    @property
    def probing(self) -> bool:
        return self._probing

    def probe_abandoned(self) -> None:
        """The probe was cancelled before a result: let another one go."""
        self._probing = False

    def allow_probe(self) -> bool:
        """In half-open state, True for exactly one caller until its result is recorded."""
        if self.state is not CircuitState.HALF_OPEN or self._probing:
            return False
        self._probing = True
        return True

    @property
    def held(self) -> bool:
        return self._held

    def hold(self) -> None:
        """Keep the circuit open until `release()`: the target cannot be used yet."""
        self._held = True

    def release(self) -> None:
        """End a `hold()`; the circuit is as it was before."""
        self._held = False

    def record_success(self) -> None:
        self._probing = False
        self._failures = 0
        self._failed_probes = 0
        if self._state is not CircuitState.CLOSED:
            self._state = CircuitState.CLOSED
            if self._on_close is not None:
                self._on_close()

    def record_failure(self) -> None:
        """A transient failure; opens the circuit at the threshold or on a failed probe."""
        self._probing = False
        self._failures += 1
        state = self.state
        if state is CircuitState.OPEN:  # a send that started before it opened
            return
        if state is CircuitState.HALF_OPEN:
            self._failed_probes += 1
            self._open()
        elif self._failures >= self._policy.failure_threshold:
            self._open()

    def _open(self) -> None:
        self._state = CircuitState.OPEN
        self._opened_at = self._clock()
