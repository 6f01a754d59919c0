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
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from relaybox.errors import ConfigurationError, MissingDependencyError
from relaybox.observability.snapshot import snapshot

if TYPE_CHECKING:
    from relaybox.relay.engine import Relay

logger = logging.getLogger(__name__)

#: A client has this long to send its request line and headers.
REQUEST_TIMEOUT = 5.0
_MAX_LINE = 8192
_MAX_HEADERS = 100
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
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._routes: dict[str, Callable[[], Awaitable[Response]]] = {
            "/metrics": self._metrics,
            "/api/outbox": self._outbox,
            "/healthz": self._health,
            "/readyz": self._ready,
        }

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, self._host, self._port)
        except OSError as error:  # the port is taken, the address is not ours ...
            raise ConfigurationError(
                f"cannot serve the status endpoints on {self._host}:{self._port}: {error}"
            ) from error
        logger.info("status endpoints on %s", self.url, extra={"action": "http_start"})

    @property
    def port(self) -> int:
        """The bound port (the one the OS picked, for port 0)."""
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host  # IPv6
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        """Stop listening and end the requests being served (before the relay stops,
        so that no request reads from a relay that is going away)."""
        if self._server is None:
            return
        self._server.close()
        for handler in self._handlers:
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            await self._exchange(reader, writer)
        except (OSError, TimeoutError):  # the client went away, or reads nothing back
            writer.transport.abort()
        finally:
            self._handlers.discard(task)
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                method, path = await _read_request(reader)
        except asyncio.IncompleteReadError:  # closed before a whole request: no answer
            return
        except (TimeoutError, ValueError, asyncio.LimitOverrunError):
            method, path = "", ""
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
        route = self._routes.get(path.split("?", 1)[0])
        if route is None:
            known = ", ".join(self._routes)
            return 404, "text/plain; charset=utf-8", f"not found; try {known}\n".encode()
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"only GET and HEAD\n"
        try:
            return await route()
        except Exception:  # a broken report must not take the relay down with it
            logger.exception("status endpoint %s failed", path, extra={"action": "http_error"})
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
    line = await reader.readuntil(b"\n")
    if len(line) > _MAX_LINE:
        raise ValueError("request line too long")
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError("not an HTTP request line")
    for _ in range(_MAX_HEADERS):  # headers are read and ignored
        if (await reader.readuntil(b"\n")).strip() == b"":
            return parts[0], parts[1]
    raise ValueError("too many headers")


def _json(value: object) -> bytes:
    return json.dumps(value, indent=2, sort_keys=False).encode() + b"\n"
