"""The event loop a relay process runs on: uvloop where it is installed.

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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
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
