"""Run a relay in a background thread, for sync applications (Flask, Django).

runner = RelayThread(lambda: Relay(DB_URL, {"default": "nats://..."}))
runner.start()                 # returns once the relay is running (or raises)
runner.attach(outbox)
...
runner.stop()                  # graceful: in-flight batches finish or are released
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

from relaybox.errors import RelayboxError
from relaybox.relay.engine import Relay, _Subscribable


class RelayThread:
    def __init__(self, factory: Callable[[], Relay], *, name: str = "relaybox-relay") -> None:
        self._factory = factory
        self._name = name
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: concurrent.futures.Future[Relay] = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self.relay: Relay | None = None

    def __enter__(self) -> RelayThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> Relay:
        if self._thread is not None:
            raise RelayboxError("this RelayThread was already started")
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()
        self.relay = self._started.result(timeout)
        return self.relay

    def attach(self, outbox: _Subscribable) -> None:
        if self.relay is None:
            raise RelayboxError("start the RelayThread before attaching an Outbox")
        self.relay.attach(outbox)

    def stop(self, timeout: float | None = None) -> None:
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is None or stop is None or thread is None:
            return
        if not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)

    def _main(self) -> None:
        asyncio.run(self._serve())

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
