"""The relay's operational endpoints: `relaybox relay --http HOST:PORT`.

    GET /metrics      Prometheus text (needs `relaybox[metrics]`)
    GET /api/outbox   the same signals as JSON (observability/snapshot.py)
    GET /healthz      200 while the relay's event loop answers, connected or not
    GET /readyz       200 when every broker and database is connected, every database
                      holds its partitions (or claims rows) and no circuit is open; 503
                      with the reasons otherwise (what is down, and when it is retried)

Hand-written on asyncio streams rather than a web framework: four fixed GET routes
without request bodies, answered from the relay's own event loop, so a response reads
the relay's state between two steps of its work, without locks or a thread. A framework
would add a dependency to every relay for that. Each connection serves one request.

The port shares the relay's process, and so its file descriptors, with the database and
broker connections: whoever can reach it must not be able to starve them. At most
MAX_CONNECTIONS are served at once. When another arrives, the oldest connection still
sending its request gives way to it (a client that sends its request as it connects is
served even beside many that trickle theirs); when every one is being answered, the
newcomer is closed at once. A request must arrive whole within REQUEST_TIMEOUT and take
at most MAX_REQUEST_BYTES. Clients that go away, time out or send nonsense are not
logged; connections turned away, and endpoints that fail, are logged at most once per
LOG_INTERVAL, with how many more there were.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from relaybox.errors import ConfigurationError, MissingDependencyError
from relaybox.observability.snapshot import snapshot

if TYPE_CHECKING:
    from relaybox.relay.engine import Relay

logger = logging.getLogger(__name__)

#: Connections served at once (see the module's docstring).
MAX_CONNECTIONS = 64
#: A client has this long to send its request line and headers.
REQUEST_TIMEOUT = 5.0
#: The request line and headers together, at most.
MAX_REQUEST_BYTES = 8192
_MAX_HEADERS = 100
#: Seconds between two log lines of one kind about clients or failed endpoints.
LOG_INTERVAL = 60.0
#: After an accept fails (no descriptor or memory left), accepting waits this long.
ACCEPT_PAUSE = 0.5
#: Connections the kernel queues until they are accepted.
_BACKLOG = 128
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 501: "Not Implemented",
            503: "Service Unavailable", 400: "Bad Request"}  # fmt: skip

Response = tuple[int, str, bytes]


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT`, `:PORT` (all interfaces) or `PORT` (127.0.0.1)."""
    host, sep, port = address.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", address
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise ConfigurationError(f"--http {address!r}: give HOST:PORT, like 127.0.0.1:9464")
    return host.strip("[]") or "0.0.0.0", number  # ":PORT" asks for every interface


class StatusServer:
    """Serves one relay's endpoints until closed."""

    def __init__(self, relay: Relay, host: str = "127.0.0.1", port: int = 9464) -> None:
        self._relay = relay
        self._host, self._port = host, port
        self._listeners: list[socket.socket] = []
        self._acceptors: list[asyncio.Task[None]] = []
        #: Every connection being served, by its task, oldest first.
        self._handlers: dict[asyncio.Task[None], _Client] = {}
        #: Those, and the ones that gave way and are winding up.
        self._tasks: set[asyncio.Task[None]] = set()
        self._turned_away = _Throttled("status endpoints: %s", logging.WARNING)
        self._failed = _Throttled("status endpoint %s failed", logging.ERROR)
        self._routes: dict[str, Callable[[], Awaitable[Response]]] = {
            "/metrics": self._metrics,
            "/api/outbox": self._outbox,
            "/healthz": self._health,
            "/readyz": self._ready,
        }

    async def start(self) -> None:
        try:
            self._listeners = await _listen(self._host, self._port)
        except OSError as error:  # the port is taken, the address is not ours ...
            raise ConfigurationError(
                f"cannot serve the status endpoints on {self._host}:{self._port}: {error}"
            ) from error
        self._acceptors = [asyncio.create_task(self._accept(each)) for each in self._listeners]
        logger.info("status endpoints on %s", self.url, extra={"action": "http_start"})

    @property
    def port(self) -> int:
        """The bound port (the one the OS picked, for port 0)."""
        if not self._listeners:
            return self._port
        return int(self._listeners[0].getsockname()[1])

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host  # IPv6
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        """Stop listening and end the requests being served (before the relay stops,
        so that no request reads from a relay that is going away)."""
        running = [*self._acceptors, *self._tasks]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for listener in self._listeners:
            listener.close()
        self._acceptors, self._listeners = [], []

    async def _accept(self, listener: socket.socket) -> None:
        """Take connections one at a time, each within the connection bound (asyncio's
        own server accepts a burst before any is looked at, and logs a traceback for
        every accept the process has no descriptor for)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _ = await loop.sock_accept(listener)
            except OSError as error:  # out of descriptors or memory: not in a tight loop
                self._turned_away.note(f"cannot accept a connection ({error}); pausing")
                await asyncio.sleep(ACCEPT_PAUSE)
                continue
            if not self._admit():
                connection.close()
                continue
            try:
                reader, writer = await asyncio.open_connection(
                    sock=connection, limit=MAX_REQUEST_BYTES
                )
            except OSError:  # gone already
                connection.close()
                continue
            client = _Client(writer)
            task = asyncio.create_task(self._serve(reader, client))
            self._handlers[task] = client
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            # Let the connections given way to close before the next is taken.
            await asyncio.sleep(0)

    async def _serve(self, reader: asyncio.StreamReader, client: _Client) -> None:
        try:
            await self._exchange(reader, client)
        except (OSError, TimeoutError):  # the client went away, or reads nothing back
            client.writer.transport.abort()
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._handlers.pop(task, None)
            client.writer.close()

    def _admit(self) -> bool:
        """Make room for one more connection if there is none: the oldest one still
        sending its request gives way. False if every one is being answered."""
        if len(self._handlers) < MAX_CONNECTIONS:
            return True
        for task, client in self._handlers.items():
            if not client.answering:
                del self._handlers[task]
                client.writer.transport.abort()  # closes its socket
                task.cancel()
                self._turned_away.note(
                    f"{MAX_CONNECTIONS} connections open; dropped the oldest that had "
                    "not sent its request yet, to serve a newer one"
                )
                return True
        self._turned_away.note(f"{MAX_CONNECTIONS} requests being answered; closed a newer one")
        return False

    async def _exchange(self, reader: asyncio.StreamReader, client: _Client) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                method, path = await _read_request(reader)
        except asyncio.IncompleteReadError:  # closed before a whole request: no answer
            return
        except (TimeoutError, ValueError, asyncio.LimitOverrunError):
            method, path = "", ""
        client.answering = True
        writer = client.writer
        status, content_type, body = await self._respond(method, path)
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode("ascii") + (b"" if method == "HEAD" else body))
        async with asyncio.timeout(REQUEST_TIMEOUT):  # a client that never reads
            await writer.drain()

    async def _respond(self, method: str, path: str) -> Response:
        if not method:
            return 400, "text/plain; charset=utf-8", b"bad request\n"
        name = path.split("?", 1)[0]
        route = self._routes.get(name)
        if route is None:
            known = ", ".join(self._routes)
            return 404, "text/plain; charset=utf-8", f"not found; try {known}\n".encode()
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"only GET and HEAD\n"
        try:
            return await route()
        except Exception:  # noqa: BLE001 - a broken report must not take the relay down
            self._failed.note(name, exc_info=True)  # with its traceback, now and then
            return 503, "text/plain; charset=utf-8", b"the relay could not report its state\n"

    async def _metrics(self) -> Response:
        try:
            from relaybox.observability.prometheus import CONTENT_TYPE, render
        except MissingDependencyError as error:
            return 501, "text/plain; charset=utf-8", f"{error}\n".encode()
        await self._relay.refresh_stats()
        return 200, CONTENT_TYPE, render(self._relay)

    async def _outbox(self) -> Response:
        status = await snapshot(self._relay)
        return 200, "application/json", _json(status)

    async def _health(self) -> Response:
        return 200, "text/plain; charset=utf-8", b"ok\n"

    async def _ready(self) -> Response:
        problems = self._relay.readiness()
        body = _json({"ready": not problems, "problems": problems})
        return (503 if problems else 200), "application/json", body


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The method and path of a request; its headers are read and ignored. A line longer
    than the reader's limit raises LimitOverrunError; a request too long, ValueError."""
    line = await reader.readuntil(b"\n")
    size = len(line)
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError("not an HTTP request line")
    for _ in range(_MAX_HEADERS):
        header = await reader.readuntil(b"\n")
        size += len(header)
        if size > MAX_REQUEST_BYTES:
            break
        if header.strip() == b"":
            return parts[0], parts[1]
    raise ValueError("request too long")


async def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on `host` (each address it names) and `port`, as asyncio's
    own server binds them."""
    loop = asyncio.get_running_loop()
    found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[socket.socket] = []
    try:
        for family, kind, protocol, _, address in dict.fromkeys(found):
            listener = socket.socket(family, kind, protocol)
            listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind(address)
            listener.listen(_BACKLOG)
            listener.setblocking(False)
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    return listeners


class _Client:
    """A connection being served: its writer, and whether its request has arrived."""

    __slots__ = ("answering", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.answering = False


class _Throttled:
    """A log line of one kind, written at most once per LOG_INTERVAL; the next one
    says how many were left out meanwhile."""

    def __init__(self, template: str, level: int) -> None:
        self._template, self._level = template, level
        self._next = 0.0
        self._left_out = 0

    def note(self, what: str, *, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now < self._next:
            self._left_out += 1
            return
        extra: dict[str, Any] = {"action": "http_error", "left_out": self._left_out}
        more = (
            f" ({self._left_out} more like it since the last such line)" if self._left_out else ""
        )
        logger.log(self._level, self._template + "%s", what, more, exc_info=exc_info, extra=extra)
        self._next, self._left_out = now + LOG_INTERVAL, 0


def _json(value: object) -> bytes:
    return json.dumps(value, indent=2, sort_keys=False).encode() + b"\n"
