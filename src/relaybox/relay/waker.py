"""When the claim loop looks for work next: at once, on a wakeup, or after a backoff.

Wakeups come from an in-process commit hook, from LISTEN/NOTIFY, or from
nothing at all; the poll is adaptive so an idle relay costs about one query per
`idle_interval`, and a busy one never waits.
"""

from __future__ import annotations

import asyncio
import contextlib


class Waker:
    def __init__(self, min_interval: float, idle_interval: float) -> None:
        self._min = min_interval
        self._idle = idle_interval
        self._delay = 0.0
        self._event = asyncio.Event()
        self.wakeups = 0

    def wake(self) -> None:
        """Look again now (a commit happened, or capacity came back)."""
        self.wakeups += 1
        self._delay = 0.0
        self._event.set()

    def found_work(self) -> None:
        self._delay = 0.0

    def found_nothing(self) -> None:
        self._delay = min(max(self._delay * 2, self._min), self._idle)

    def wait_at_most(self, seconds: float) -> None:
        """Cap the next wait (for instance until an open circuit may be probed)."""
        self._delay = min(self._delay, seconds)

    async def wait(self) -> None:
        if self._delay > 0 and not self._event.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), self._delay)
        self._event.clear()
