"""When a failed message is tried again, and when relaybox gives up on it.

Attempt 1 is immediate; after the n-th failure the next attempt waits
``base_delay * multiplier ** (n - 1)``, capped at ``max_delay``, randomised by
``±jitter`` so that many messages failing together do not all come back at once.
After ``max_attempts`` failures the message is abandoned with its last error.
"""

from __future__ import annotations

import dataclasses
import random

from relaybox.errors import ConfigurationError


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    base_delay: float = 60.0
    multiplier: float = 2.0
    max_delay: float = 3600.0
    jitter: float = 0.25
    max_attempts: int = 10

    def __post_init__(self) -> None:
        if not self.base_delay >= 0 or not self.max_delay >= self.base_delay:
            raise ConfigurationError("retry delays must satisfy 0 <= base_delay <= max_delay")
        if not self.multiplier >= 1:
            raise ConfigurationError("retry multiplier must be at least 1")
        if not 0 <= self.jitter < 1:
            raise ConfigurationError("retry jitter must be in [0, 1)")
        if self.max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")

    def exhausted(self, failures: int) -> bool:
        """Whether a message that has now failed `failures` times is given up on."""
        return failures >= self.max_attempts

    def nominal_delay(self, failures: int) -> float:
        """The delay before the next attempt after `failures` failures, without jitter."""
        exponent = max(failures - 1, 0)
        try:
            delay = self.base_delay * self.multiplier**exponent
        except OverflowError:
            return self.max_delay
        return min(delay, self.max_delay)

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """The jittered delay: uniformly within ±jitter of the nominal delay."""
        nominal = self.nominal_delay(failures)
        spread = (rng or random).uniform(-self.jitter, self.jitter)
        return max(nominal * (1 + spread), 0.0)
