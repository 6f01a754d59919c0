"""Waking a relay with PostgreSQL LISTEN/NOTIFY, on a connection of its own.

`listen` opens a dedicated connection (asyncpg for `postgresql://`, psycopg for
`postgresql+psycopg://`), LISTENs on the table's channel (`notify_channel`, which
also states the writer's side of the contract) and calls `on_notify()` for every
notification. If the connection drops, a background task reconnects with backoff
until `Listener.close()`, and calls `on_notify()` once it is back, since what was sent
meanwhile is lost. An idle connection is probed now and then, so a silently dead one
(a cut network, a failover) is noticed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

from relaybox.core.identifiers import notify_channel
from relaybox.core.retry import RetryPolicy
from relaybox.core.urls import without_secrets
from relaybox.errors import ConfigurationError, StorageError, StorageOperationalError
from relaybox.storage.postgres import translate
from relaybox.storage.urls import GRACE, DatabaseUrl

logger = logging.getLogger(__name__)

APPLICATION_NAME = "relaybox-listen"
#: Seconds a polite close may take before the connection is dropped instead.
CLOSE_TIMEOUT = 1.0


class _Session(Protocol):
    """One listening connection, as the two drivers offer it."""

    backend_pid: int

    async def wait(self, seconds: float) -> None:
        """Deliver notifications for up to `seconds`; raise once the connection is lost."""

    async def probe(self) -> None:
        """A round trip, to tell a live but idle connection from a silently dead one."""

    async def close(self) -> None:
        """Close politely."""

    async def abort(self) -> None:
        """Drop the connection at once, without waiting on the server."""


class _AsyncpgSession:
    def __init__(self, connection: Any) -> None:
        self._connection = connection
        self.backend_pid: int = connection.get_server_pid()
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        connection.add_termination_listener(self._ended)

    @classmethod
    async def open(
        cls, url: DatabaseUrl, channel: str, on_notify: Callable[[], None]
    ) -> _AsyncpgSession:
        import asyncpg

        dsn = url.libpq_dsn()
        connection = await asyncpg.connect(
            dsn, timeout=url.connect_timeout, server_settings=_settings(dsn)
        )
        try:
            await connection.add_listener(channel, lambda *_: on_notify())
        except BaseException:
            connection.terminate()
            raise
        return cls(connection)

    def _ended(self, _: object) -> None:
        if not self._lost.done():
            self._lost.set_result(None)

    async def wait(self, seconds: float) -> None:
        await asyncio.wait({self._lost}, timeout=seconds)
        if self._lost.done() or self._connection.is_closed():
            raise StorageOperationalError("the LISTEN connection was closed")

    async def probe(self) -> None:
        await self._connection.fetchval("SELECT 1")

    async def close(self) -> None:
        await self._connection.close(timeout=CLOSE_TIMEOUT)

    async def abort(self) -> None:
        self._connection.terminate()


class _PsycopgSession:
    def __init__(self, connection: Any, on_notify: Callable[[], None]) -> None:
        self._connection = connection
        self._on_notify = on_notify
        self.backend_pid: int = connection.info.backend_pid

    @classmethod
    async def open(
        cls, url: DatabaseUrl, channel: str, on_notify: Callable[[], None]
    ) -> _PsycopgSession:
        import psycopg

        dsn = psycopg.conninfo.make_conninfo(url.libpq_dsn(), **_settings(url.libpq_dsn()))
        connection = await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, connect_timeout=math.ceil(url.connect_timeout)
        )
        try:
            await connection.execute(f'LISTEN "{channel}"')  # channel: [a-z0-9_] only
        except BaseException:
            await connection.close()
            raise
        return cls(connection, on_notify)

    async def wait(self, seconds: float) -> None:
        async for _ in self._connection.notifies(timeout=seconds):
            self._on_notify()

    async def probe(self) -> None:
        # Notifications that arrive meanwhile wait in psycopg's backlog for `wait`.
        await self._connection.execute("SELECT 1")

    async def close(self) -> None:
        await self._connection.close()

    async def abort(self) -> None:
        await self._connection.close()  # psycopg's close never waits on the server


def _settings(dsn: str) -> dict[str, str]:
    """Name the connection in pg_stat_activity, unless the URL already names it."""
    return {} if "application_name=" in dsn else {"application_name": APPLICATION_NAME}


class Listener:
    """A running LISTEN; `close()` stops it and its reconnecting, and closes the connection."""

    def __init__(
        self,
        url: DatabaseUrl,
        channel: str,
        on_notify: Callable[[], None],
        *,
        probe_every: float,
        retry_delay: float,
        max_retry_delay: float,
    ) -> None:
        self.channel = channel
        self._url = url
        self._on_notify = on_notify
        self._probe_every = probe_every
        self._retry_delay, self._max_retry_delay = retry_delay, max_retry_delay
        self._session: _Session | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def backend_pid(self) -> int | None:
        """The server process of the current connection; None while reconnecting."""
        return None if self._session is None else self._session.backend_pid

    async def start(self) -> None:
        """Connect and LISTEN; raises a `StorageError` if the first attempt fails."""
        self._session = await self._open()
        self._task = asyncio.create_task(self._supervise(), name=f"relaybox {self.channel}")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._drop()

    def _wake(self) -> None:
        try:
            self._on_notify()
        except Exception:  # a broken callback must not end the listening
            logger.exception("on_notify failed", extra={"action": "listen"})

    async def _open(self) -> _Session:
        session_class = _PsycopgSession if self._url.driver == "psycopg" else _AsyncpgSession
        try:
            async with asyncio.timeout(self._url.connect_timeout + GRACE):
                return await session_class.open(self._url, self.channel, self._wake)
        except TimeoutError:
            raise StorageOperationalError(
                f"PostgreSQL at {self._url.masked} did not answer a new LISTEN connection "
                f"within {self._url.connect_timeout:g} s"
            ) from None
        except Exception as exc:  # noqa: BLE001 - raised again as relaybox's
            error = self._relaybox_error(exc)
            raise error from error.__cause__

    def _relaybox_error(self, exc: BaseException) -> StorageError:
        """The driver's error as relaybox's, without the URL's secrets."""
        return without_secrets(translate(exc), exc, self._url.secrets)

    async def _drop(self, *, politely: bool = True) -> None:
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):  # it may be broken already
                await (session.close() if politely else session.abort())

    async def _supervise(self) -> None:
        while True:
            await self._serve()
            await self._drop(politely=False)
            self._session = await self._reconnect()
            logger.info("listening again", extra={"action": "listen", "channel": self.channel})
            self._wake()  # notifications sent while we were away are gone

    async def _serve(self) -> None:
        """Listen until the connection fails, then say why."""
        assert self._session is not None
        try:
            while True:
                await self._session.wait(self._probe_every)
                await self._probe(self._session)
        except Exception as exc:  # noqa: BLE001 - whatever broke it, the cure is to reconnect
            error = self._relaybox_error(exc)
        logger.warning(
            "lost the LISTEN connection, reconnecting: %s",
            error,
            extra={"action": "listen", "channel": self.channel, "url": self._url.masked},
        )

    async def _probe(self, session: _Session) -> None:
        """A probe unanswered within `probe_every` means a dead connection: abort it.

        Not `wait_for`: cancelling a query makes the drivers send a cancel request
        and wait for the server, which a dead network never answers."""
        probe = asyncio.ensure_future(session.probe())
        try:
            await asyncio.wait({probe}, timeout=self._probe_every)
            if probe.done():
                probe.result()
                return
            await session.abort()
            raise StorageOperationalError(f"no answer to a probe in {self._probe_every} s")
        finally:
            if not probe.done():
                probe.cancel()
            probe.add_done_callback(_retrieved)  # its error, if any, is already told

    async def _reconnect(self) -> _Session:
        pauses = RetryPolicy(base_delay=self._retry_delay, max_delay=self._max_retry_delay)
        failures = 0
        while True:
            failures += 1
            await asyncio.sleep(pauses.delay(failures))
            try:
                return await self._open()
            except StorageError as exc:  # even a refused login: a failover may be under way
                logger.warning(
                    "reconnect failed, retrying: %s",
                    exc,
                    extra={"action": "listen", "channel": self.channel},
                )


def _retrieved(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


async def listen(
    url: str,
    table: str,
    on_notify: Callable[[], None],
    *,
    probe_every: float = 30.0,
    retry_delay: float = 0.1,
    max_retry_delay: float = 10.0,
) -> Listener:
    """LISTEN for `table`'s NOTIFYs on a connection of its own; call `on_notify()` on each.

    `on_notify` runs in the event loop and must not block: set an event, no more. It is
    also called after every reconnect. The first connection's failure raises a
    `StorageError`; later ones are retried in the background, `retry_delay` doubling
    up to `max_retry_delay` seconds. An idle connection is probed every `probe_every`
    seconds. See `relaybox.core.identifiers.notify_channel` for what a wake-up means.
    """
    parsed = DatabaseUrl.parse(url)
    if parsed.dialect != "postgresql":
        raise ConfigurationError(
            f"LISTEN/NOTIFY needs PostgreSQL, not {parsed.masked}; poll instead"
        )
    listener = Listener(
        parsed,
        notify_channel(table),
        on_notify,
        probe_every=probe_every,
        retry_delay=retry_delay,
        max_retry_delay=max_retry_delay,
    )
    await listener.start()
    return listener
