"""Peers that accept connections and then say nothing: a link that freezes mid-run,
and a server that never answers at all.

`FreezableProxy` forwards a local port to another in a thread of its own; `freeze()`
stops it moving bytes either way and answering new connections, closing nothing, which
is what a client sees of a hung server or a link whose packets vanish. `thaw()` lets
everything through again, including what was held back. `silent_port()` is a listening
socket that is never accepted from: the kernel completes each TCP handshake, and no
byte ever comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

from tests.brokers.harness import free_port


class FreezableProxy:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`target` until frozen."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._transports: set[asyncio.WriteTransport] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"freezable-{target}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")

    def url(self, url: str) -> str:
        """`url`, which names 127.0.0.1 and the target port, through this proxy."""
        target = f"127.0.0.1:{self.target}"
        if target not in url:
            raise ValueError(f"{url} does not name {target}")
        return url.replace(target, f"127.0.0.1:{self.port}", 1)

    def freeze(self) -> None:
        self._in_loop(self._flowing.clear)

    def thaw(self) -> None:
        self._in_loop(self._flowing.set)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", self.port)
        )
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for transport in list(self._transports):
                transport.abort()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    def _in_loop(self, action: Callable[[], object]) -> None:
        done = threading.Event()

        def run() -> None:
            action()
            done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(10)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ends = [writer]
        self._transports.add(writer.transport)
        try:
            await self._flowing.wait()  # frozen: accepted, and left unanswered
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
            ends.append(up_writer)
            self._transports.add(up_writer.transport)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):  # no upstream, or the proxy closes
            pass
        finally:
            for end in ends:
                end.transport.abort()
                self._transports.discard(end.transport)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                await self._flowing.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await self._flowing.wait()  # what was read while freezing waits here
                writer.write(data)
                await writer.drain()
        writer.transport.abort()  # one side ended: end the other


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port that takes TCP connections and never answers on them."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield int(listener.getsockname()[1])
