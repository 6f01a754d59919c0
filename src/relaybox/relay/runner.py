"""Run a relay in a background thread, for sync applications (Flask, Django).

runner = RelayThread(lambda: Relay(DB_URL, {"default": "nats://..."}))
runner.start()                 # returns once the relay is running (or raises)
runner.attach(outbox)
...
runner.stop()                  # graceful: in-flight batches finish or are released

The thread is a daemon, so it never keeps a process alive; to give its partitions back
when the process ends anyway, a started RelayThread stops its relay at interpreter exit
(atexit) and, started in the main thread of a process that left SIGTERM to its default,
on SIGTERM, before the signal takes its default course. A RelayThread belongs to the
process that started it: after a fork, the child has no relay thread, so it refuses
to be used there (start one in each worker after the fork).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

from relaybox.errors import RelayboxError
from relaybox.relay import loops
from relaybox.relay.engine import Relay, _Subscribable
from relaybox.relay.processor import STOP_GRACE


class RelayThread:
    def __init__(
        self, factory: Callable[[], Relay], *, name: str = "relaybox-relay", loop: str = "auto"
    ) -> None:
        """`loop`: the thread's event loop (`relaybox.relay.loops.LOOPS`): by default
        uvloop where it is installed."""
        self._factory = factory
        self._name = name
        self._loop_factory = loops.loop_factory(loop)  # an unknown name fails here
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: concurrent.futures.Future[Relay] = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        #: The process that started the thread (None: not started).
        self._pid: int | None = None
        self.relay: Relay | None = None

    def __enter__(self) -> RelayThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> Relay:
        self._check_process()
        if self._thread is not None:
            raise RelayboxError("this RelayThread was already started")
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()
        self.relay = self._started.result(timeout)
        atexit.register(self._at_exit)
        self._stop_on_sigterm()
        return self.relay

    def attach(self, outbox: _Subscribable) -> None:
        self._check_process()
        if self.relay is None:
            raise RelayboxError("start the RelayThread before attaching an Outbox")
        self.relay.attach(outbox)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the relay and wait `timeout` seconds at most for it (None: until it
        stopped). In a forked child there is nothing to stop."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is None or stop is None or thread is None or self._forked:
            return
        atexit.unregister(self._at_exit)
        self._restore_sigterm()
        if not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)

    @property
    def _forked(self) -> bool:
        return self._pid is not None and self._pid != os.getpid()

    def _check_process(self) -> None:
        if self._forked:
            raise RelayboxError(
                f"this RelayThread was started in process {self._pid}, and process "
                f"{os.getpid()} is a fork of it, where the relay does not run: start a "
                "RelayThread in each process after the fork (gunicorn: in post_fork)"
            )

    def _at_exit(self) -> None:
        self._stop_in_time()

    def _stop_in_time(self) -> None:
        """Stop within the relay's shutdown timeout, the graces of the stop's later
        steps (cancelling what is left, writing the activity, giving the partitions
        back) and a little more for closing its connections: the process is ending,
        and must not hang on a broker."""
        relay = self.relay
        if relay is None:
            self.stop(None)
            return
        self.stop(relay.settings.shutdown_timeout + 3 * STOP_GRACE + 2.0)

    def _stop_on_sigterm(self) -> None:
        """In the main thread, if SIGTERM has its default action (which ends the
        process at once, skipping atexit), stop the relay first, then let it end."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the application handles SIGTERM; atexit covers its exit
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _restore_sigterm(self) -> None:
        """Put SIGTERM's default action back, if the handler is still ours."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _on_sigterm(self, signum: int, _frame: FrameType | None) -> None:
        if not self._forked:
            self._stop_in_time()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # the default action now: the process ends

    def _main(self) -> None:
        with asyncio.Runner(loop_factory=self._loop_factory) as runner:
            runner.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            relay = self._factory()
            await relay.start()
        except BaseException as error:  # noqa: BLE001 - handed to the starting thread
            self._started.set_exception(error)
            return
        self._started.set_result(relay)
        await self._stop.wait()
        await relay.stop()
