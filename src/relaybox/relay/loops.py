"""How a relay process runs: on uvloop where it is installed, with the garbage
collector set for a long-lived process that makes many short-lived objects.

A relay's work is round trips: per batch a read, a publish and a settle, and between
batches the polls of its fast window. Much of its time goes to the event loop's own
socket and readiness bookkeeping, which uvloop (asyncio's API over libuv, from the
authors of asyncpg) does in C. On the two-core machine of docs/benchmarks.md, a relay
process draining 300k messages on uvloop took 0.89 of the CPU it took on asyncio's
loop (median of 10 alternated pairs; half the system time), and the median
commit-to-publish at 500 msg/s fell by about 7 %, with the same code.

relaybox depends on uvloop where it builds (CPython off Windows). `relaybox relay`,
the `relaybox_relay` management command and `RelayThread` run on it unless told
otherwise (`--loop asyncio`); a relay started inside an application's own event loop
(an ASGI lifespan, a Celery worker) runs on whatever loop the application chose.
The collector's settings (`collector_for_a_relay`) are for the relay's own processes
(`run_relay`), never for an application's that runs a `RelayThread`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from relaybox.errors import ConfigurationError

#: `auto`: uvloop if it can be imported, else asyncio's own loop.
LOOPS = ("auto", "uvloop", "asyncio")

_T = TypeVar("_T")


def loop_factory(loop: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the loop `loop` names (None: asyncio's default loop).

    `uvloop` when uvloop cannot be imported is a `ConfigurationError`; `auto` falls back
    to asyncio's loop then."""
    if loop not in LOOPS:
        raise ConfigurationError(f"unknown event loop {loop!r}: choose one of {', '.join(LOOPS)}")
    if loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise ConfigurationError(
                "the uvloop event loop was asked for, but uvloop is not installed "
                "(pip install uvloop; it does not run on Windows)"
            ) from None
        return None
    return uvloop.new_event_loop


def running_loop_name() -> str:
    """`uvloop` or `asyncio`: the loop this coroutine runs on."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.partition(".")[0] == "uvloop" else "asyncio"


def run(main: Coroutine[Any, Any, _T], *, loop: str = "auto") -> _T:
    """`asyncio.run(main)` on the loop `loop` names (see `LOOPS`)."""
    try:
        factory = loop_factory(loop)
    except BaseException:
        main.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def run_relay(main: Coroutine[Any, Any, _T], *, loop: str = "auto") -> _T:
    """`run(main)` for a process that is a relay: with `collector_for_a_relay` meanwhile."""
    with collector_for_a_relay():
        return run(main, loop=loop)


#: Allocations of tracked objects between two young collections, for a relay process.
RELAY_GC_THRESHOLD = 20_000


@contextlib.contextmanager
def collector_for_a_relay() -> Iterator[None]:
    """The garbage collector set for a relay process, then as it was.

    - Every object alive when the relay process starts running is frozen
      (`gc.freeze`): the modules, settings and the relay built from them live as long
      as the process, and full collections leave them out. Unfrozen, a relay process
      tracks some fifty thousand objects from its imports alone, and a full collection
      paused it for about 22 ms on the machine of docs/benchmarks.md, holding up every
      message that arrived meanwhile.
    - A young collection comes after `RELAY_GC_THRESHOLD` allocations, not Python's
      700: a batch in flight (500 rows, each a record, a message and their parts) is
      alive through every collection that comes while it is published, so each one
      scanned it again and moved it on to older generations, to be scanned there too.
      What the relay makes goes away by reference counting; the collector only finds
      cycles, and a few thousand allocations more before it looks cost nothing.

    Measured on that machine (a 300k-row drain to a no-op broker, alternated pairs of
    relay processes, medians, with the freeze taken once the relay had started): the
    freeze took the relay's CPU to 0.89 of what it was (8 pairs), the threshold on top
    of it to 0.90 of that (12 pairs), both together to 0.86 (10 pairs)."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(RELAY_GC_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
