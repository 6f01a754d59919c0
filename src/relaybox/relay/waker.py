"""When the claim loop looks for work next: at once, on a wakeup, or after a backoff.

Wakeups come from an in-process commit hook, from LISTEN/NOTIFY, or from
nothing at all; the poll is adaptive so an idle relay costs about one query per
`idle_interval`, and a busy one never waits.

A relay in another process than its writers learns of a commit by a NOTIFY at best,
and writers send one only now and then (at most once per notify interval each: a NOTIFY
serializes the commits that carry one), so most commits come unannounced. A hint (a
NOTIFY, or a read that found rows) therefore opens a *fast window*: for `fast_window`
seconds the relay keeps reading even when it finds nothing, each empty read waiting a
quarter of the time since rows were last found or a NOTIFY came (FAST_SHARE), never
less than `fast_interval`, and each read that finds rows extending the window. So a message is
found within about a quarter of the time since the last one was: a stream of 500 a
second within a millisecond or so, however its gaps fall, a trickle later, and a
burst's end costs about twenty empty reads (a millisecond apart at first, then each a
quarter later than the time gone since the last rows: 0.2 s in about 20), not one per
millisecond. The wait follows the time since the last rows, not the count of empty
reads: counting reads, two empty ones in a row in a steady stream (a gap of 3 ms where
most are 2) made the next wait half as long again, and that tail was the stream's p99. A
writer that is still writing is inside the window its own last NOTIFY opened, since the
window outlasts the interval. Within the window the relay reads at most once per
`fast_interval` unless a read came back full, so a busy table is read in batches of
what arrived meanwhile, not row by row. Outside a window the backoff is the adaptive
one, so an idle relay's load stays one query per `idle_interval`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

#: Within the fast window, an empty read waits this share of the time since rows were
#: last found (or a hint came), at least the fast interval.
FAST_SHARE = 0.25


class Waker:
    def __init__(
        self,
        min_interval: float,
        idle_interval: float,
        *,
        fast_interval: float = 0.001,
        fast_window: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._min = min_interval
        self._idle = idle_interval
        self._fast = fast_interval
        self._window = fast_window
        self._clock = clock
        self._delay = 0.0
        #: clock() until which an empty read waits only `fast_interval`.
        self._fast_until = 0.0
        #: clock() of the last hint or read that found rows (see `found_nothing`).
        self._found_at = 0.0
        #: Whether `_delay` is a wait of the fast window.
        self._window_delay = False
        self._event = asyncio.Event()
        self.wakeups = 0

    @property
    def delay(self) -> float:
        """What the next `wait` waits at most (0: it does not wait)."""
        return self._delay

    @property
    def fast(self) -> bool:
        """Whether the fast window is open."""
        return self._clock() < self._fast_until

    def wake(self) -> None:
        """Look again now (a commit happened, or capacity came back)."""
        self.wakeups += 1
        self._delay = 0.0
        self._event.set()

    def hint(self) -> None:
        """Look now, and keep looking fast for a while: rows may be committed by writers
        that announce only some of their commits (a NOTIFY)."""
        self._open_window()
        self.wake()

    def found_work(self, *, more: bool = True) -> None:
        """The last look found rows; `more` when it was cut short (a full batch), so
        more are likely waiting. Within the fast window a look that took everything
        there was waits `fast_interval` before the next, which then finds what arrived
        meanwhile in one batch instead of one row each."""
        self._open_window()
        self._delay = 0.0 if more or not self.fast else self._fast
        self._window_delay = self.fast

    def found_nothing(self, *, looked: bool = True) -> None:
        """The last look found no rows; `looked` is false when it could not read at all
        (a failed read, nothing claimable), which never earns the fast interval. In the
        window the next look comes a quarter of the time since rows were last found
        after this one, at least `fast_interval` (see the module's docstring)."""
        if looked and self.fast:
            since = self._clock() - self._found_at
            self._delay = min(max(since * FAST_SHARE, self._fast), self._idle)
            self._window_delay = True
            return
        # Past the window, the adaptive poll starts over from its shortest wait, as
        # after any found rows: the window's last waits were its own.
        last = 0.0 if self._window_delay else self._delay
        self._window_delay = False
        self._delay = min(max(last * 2, self._min), self._idle)

    def wait_at_most(self, seconds: float) -> None:
        """Cap the next wait (for instance until an open circuit may be probed)."""
        self._delay = min(self._delay, seconds)

    async def wait(self) -> None:
        """Until woken, or `delay` seconds at most. A timer that sets the event, not
        `wait_for`, which wraps every wait in a task of its own: in the fast window this
        runs a thousand times a second."""
        if self._delay > 0 and not self._event.is_set():
            timer = asyncio.get_running_loop().call_later(self._delay, self._event.set)
            try:
                await self._event.wait()
            finally:
                timer.cancel()
        self._event.clear()

    def _open_window(self) -> None:
        self._found_at = self._clock()
        if self._window > 0:
            self._fast_until = max(self._fast_until, self._clock() + self._window)
