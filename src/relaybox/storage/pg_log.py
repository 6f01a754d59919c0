"""Log mode on PostgreSQL: the table's replication slot, streamed, and the table itself.

`LogStream` streams the table's logical replication slot with the built-in `pgoutput`
plugin (`messages 'true'`, PostgreSQL 14 and later) over a publication that names no
table: the server sends the transactional messages the writers emitted
(`relaybox.writer.log_outbox`) and, since no table is published, no row change of any
table. Each committed transaction arrives whole, in commit order, with the position
just past its commit record; the relay confirms a position (`confirm`) only once every
message before it is settled, and the server then never sends those again. A new
stream starts from the last confirmed position, so what was not confirmed is sent
again (at least once).

The driver: asyncpg does not speak the streaming replication protocol (CopyBoth), and
psycopg 3 has no replication API, but its libpq binding (`psycopg.pq`) does: libpq
runs the CopyBoth exchange, authentication and TLS, and the socket is watched by the
event loop, so no thread is involved. Measured against psycopg2's
LogicalReplicationConnection in a thread feeding the loop (docs/benchmarks.md,
"Log mode"): a backlog of 20,000 transactions streamed at 50,000-80,000 a second
against about 20,000, with a lower median commit-to-receipt latency. `pgoutput` was
measured against `test_decoding` too: as fast with no other writes, and faster (and
cheaper for the relay) once the same transactions also write business rows, which
`test_decoding` sends as text and `pgoutput` leaves out.

One stream per slot: the server refuses a second START_REPLICATION on an active slot
(`SlotBusyError`), so a second relay of the table stands by until the first lets go.

`LogTable` is the outbox table as the log relay uses it: the normal insert for the
messages it could not publish, and which keys have rows there (those keys' later
messages must follow them into the table).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import struct
import time
from collections.abc import Sequence
from typing import Any

from relaybox.core.extras import needs_extras
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.log_records import log_prefix, log_slot, parse_lsn
from relaybox.core.urls import without_secrets
from relaybox.errors import (
    ConfigurationError,
    RelayboxError,
    SchemaError,
    StorageError,
    StorageOperationalError,
)
from relaybox.storage.postgres import PostgresStorage, translate
from relaybox.storage.urls import GRACE, DatabaseUrl

logger = logging.getLogger(__name__)

APPLICATION_NAME = "relaybox-log"
PLUGIN = "pgoutput"
#: Seconds between standby status updates when nothing else sends one: well within
#: the server's wal_sender_timeout (60 s by default).
STATUS_INTERVAL = 10.0

#: object_in_use: the slot is streamed by another process.
_IN_USE = "55006"
#: undefined_object: no such slot (or publication).
_UNDEFINED = "42704"
#: duplicate_object: created meanwhile by another process.
_DUPLICATE = "42710"

#: Microseconds between the Unix epoch and PostgreSQL's (2000-01-01).
_PG_EPOCH_US = 946_684_800_000_000
_XLOG_HEADER = struct.Struct(">QQQ")  # data start, WAL end, server clock
_KEEPALIVE = struct.Struct(">QQB")  # WAL end, server clock, reply requested
_STATUS = struct.Struct(">cQQQqB")  # 'r', written, flushed, applied, clock, reply
_LSN = struct.Struct(">Q")
_LENGTH = struct.Struct(">i")


class SlotBusyError(StorageOperationalError):
    """Another process streams the slot: this relay stands by."""


@dataclasses.dataclass(frozen=True, slots=True)
class Committed:
    """One committed transaction: the contents of its messages of the table's prefix,
    in order, and the position just past its commit record."""

    contents: tuple[bytes, ...]
    end_lsn: int


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    """The server has sent everything before `lsn`: confirmable once what came
    before it is settled."""

    lsn: int


Event = Committed | Progress


class LogStream:
    """One replication connection streaming a slot; `read` the events, `confirm`
    what is settled. Not safe to share between event loops."""

    def __init__(self, connection: Any, prefix: str, url: DatabaseUrl) -> None:
        self._connection = connection
        self._pg = connection.pgconn
        self._prefix = prefix.encode()
        self._url = url
        self._loop = asyncio.get_running_loop()
        self._fd: int = self._pg.socket
        self._readable = asyncio.Event()
        self._writing = False
        self._open: list[bytes] | None = None  # the messages of the transaction being read
        self._held = 0  # messages taken by the current read
        #: The position last confirmed to the server (0: none yet).
        self.confirmed = 0
        #: The highest position the server said it has sent.
        self.received = 0
        self._status_at = 0.0
        self._closed = False

    # -- opening ------------------------------------------------------------------------

    @classmethod
    async def open(cls, url: str | DatabaseUrl, table: str = DEFAULT_TABLE) -> LogStream:
        """Start streaming `table`'s slot from its confirmed position.

        Raises `SlotBusyError` if another process streams it, a `SchemaError` if it
        does not exist, a `StorageOperationalError` if the server cannot be reached."""
        parsed = DatabaseUrl.parse(url) if isinstance(url, str) else url
        slot = log_slot(table)
        connection = await _connect(parsed, replication=True)
        stream = cls(connection, log_prefix(table), parsed)
        try:
            await stream._start(slot)
        except BaseException as exc:
            stream._detach()
            with contextlib.suppress(Exception):
                await connection.close()
            if isinstance(exc, Exception) and not isinstance(exc, RelayboxError):
                raise _error(parsed, exc) from None
            raise
        return stream

    async def _start(self, slot: str) -> None:
        from psycopg import pq

        pg = self._pg
        pg.nonblocking = 1
        query = (
            f"START_REPLICATION SLOT {slot} LOGICAL 0/0 (proto_version '1', "
            f"publication_names '{slot}', messages 'true')"
        )
        pg.send_query(query.encode())
        self._loop.add_reader(self._fd, self._readable.set)
        self._flush()
        deadline = time.monotonic() + self._url.command_timeout + GRACE
        while True:
            pg.consume_input()
            if not pg.is_busy():
                break
            if time.monotonic() > deadline:
                raise StorageOperationalError(
                    f"PostgreSQL at {self._url.masked} did not answer START_REPLICATION "
                    f"within {self._url.command_timeout:g} s"
                )
            await self._wait_readable(GRACE)
        result = pg.get_result()
        if result is not None and result.status == pq.ExecStatus.COPY_BOTH:
            return
        message = "no result" if result is None else result.error_message.decode(errors="replace")
        state = None if result is None else result.error_field(pq.DiagnosticField.SQLSTATE)
        if state == _IN_USE.encode():
            raise SlotBusyError(f"PostgreSQL: the slot {slot} is streamed elsewhere: {message}")
        if state == _UNDEFINED.encode():
            raise SchemaError(
                f"PostgreSQL: {message.strip()}: create the log mode's slot with `relaybox "
                f"migrate --db {self._url.masked} --log`"
            )
        raise StorageError(f"PostgreSQL: streaming {slot} failed: {message.strip()}")

    # -- reading ------------------------------------------------------------------------

    async def read(self, wait: float, limit: int = 1000) -> list[Event]:
        """The events that arrived, waiting up to `wait` seconds for the first (an
        empty list then); no more once they hold `limit` messages, except that a
        transaction comes whole. Raises `StorageOperationalError` once the stream is
        lost."""
        events: list[Event] = []
        self._held = 0
        deadline = time.monotonic() + wait
        pg = self._pg
        while True:
            try:
                size, data = pg.get_copy_data(1)
            except Exception as exc:  # noqa: BLE001 - a broken connection
                raise _error(self._url, exc) from None
            if size > 0:
                self._take(data, events)
                if self._held >= limit and self._open is None:
                    return events
                continue
            if size < 0:
                raise StorageOperationalError(
                    f"PostgreSQL at {self._url.masked} ended the replication stream: "
                    f"{pg.get_error_message() or 'no reason given'}"
                )
            if events:
                return events
            left = deadline - time.monotonic()
            if left <= 0:
                return events
            await self._wait_readable(left)
            try:
                pg.consume_input()
            except Exception as exc:  # noqa: BLE001 - a broken connection
                raise _error(self._url, exc) from None

    def _take(self, data: memoryview, events: list[Event]) -> None:
        kind = data[0]
        if kind == 0x77:  # 'w': XLogData, a message of the plugin
            body = data[25:]
            tag = body[0]
            if tag == 0x4D:  # 'M': a logical decoding message
                if self._open is not None and body[1] & 1:
                    end = _cstring_end(body, 10)
                    if body[10:end] == self._prefix:
                        (length,) = _LENGTH.unpack_from(body, end + 1)
                        start = end + 5
                        self._open.append(bytes(body[start : start + length]))
                        self._held += 1
            elif tag == 0x42:  # 'B'
                self._open = []
            elif tag == 0x43:  # 'C': flags, commit LSN, end LSN, time
                (end_lsn,) = _LSN.unpack_from(body, 10)
                contents, self._open = self._open or [], None
                events.append(
                    Committed(tuple(contents), end_lsn) if contents else Progress(end_lsn)
                )
                self.received = max(self.received, end_lsn)
        elif kind == 0x6B:  # 'k': keepalive
            wal_end, _, reply = _KEEPALIVE.unpack_from(data, 1)
            if self._open is None and wal_end > self.received:
                self.received = wal_end
                events.append(Progress(wal_end))
            if reply:
                self.send_status()

    async def _wait_readable(self, seconds: float) -> None:
        self._readable.clear()
        with contextlib.suppress(TimeoutError):  # (asyncio.timeout makes no task, wait_for does)
            async with asyncio.timeout(seconds):
                await self._readable.wait()

    # -- confirming ---------------------------------------------------------------------

    def confirm(self, lsn: int) -> None:
        """Everything before `lsn` is settled: tell the server, which may then drop
        the WAL behind it and never sends those messages again."""
        if lsn > self.confirmed:
            self.confirmed = lsn
            self.send_status()

    def send_status(self) -> None:
        """A standby status update with the confirmed position (also a sign of life)."""
        if self._closed:
            return
        lsn = self.confirmed
        clock = time.time_ns() // 1000 - _PG_EPOCH_US
        try:
            if self._pg.put_copy_data(_STATUS.pack(b"r", lsn, lsn, lsn, clock, 0)) != 1:
                raise StorageOperationalError("the status update could not be queued")
        except Exception as exc:  # noqa: BLE001 - reported at the next read
            logger.warning("status update failed: %s", _error(self._url, exc),
                           extra={"action": "log_status"})  # fmt: skip
            return
        self._status_at = time.monotonic()
        self._flush()

    def status_due(self) -> bool:
        """Whether the last status update is `STATUS_INTERVAL` seconds old."""
        return time.monotonic() - self._status_at >= STATUS_INTERVAL

    def _flush(self) -> None:
        """Send what libpq holds; what the socket does not take yet goes when writable."""
        try:
            pending = self._pg.flush()
        except Exception:  # noqa: BLE001 - a broken connection shows at the next read
            pending = 0
        if pending and not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._flush_more)

    def _flush_more(self) -> None:
        try:
            pending = self._pg.flush()
        except Exception:  # noqa: BLE001 - a broken connection shows at the next read
            pending = 0
        if not pending:
            self._writing = False
            self._loop.remove_writer(self._fd)

    async def close(self) -> None:
        """Send the confirmed position once more and close the connection."""
        if self._closed:
            return
        if self.confirmed:
            self.send_status()
        self._closed = True
        self._detach()
        with contextlib.suppress(Exception):
            await self._connection.close()

    def _detach(self) -> None:
        """Stop watching the socket (before it closes: the loop would watch another
        file that takes its number)."""
        self._loop.remove_reader(self._fd)
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)


def _cstring_end(data: memoryview, start: int) -> int:
    end = start
    while data[end]:
        end += 1
    return end


async def _connect(url: DatabaseUrl, *, replication: bool) -> Any:
    with needs_extras("log mode (its replication stream)"):
        import psycopg

    options: dict[str, Any] = {}
    if "application_name=" not in url.url:
        options["application_name"] = APPLICATION_NAME
    if replication:
        options["replication"] = "database"
    dsn = psycopg.conninfo.make_conninfo(url.libpq_dsn(), **options)
    try:
        return await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, connect_timeout=math.ceil(url.connect_timeout + GRACE)
        )
    except Exception as exc:  # noqa: BLE001 - raised again as relaybox's
        raise _error(url, exc) from None


def _error(url: DatabaseUrl, exc: BaseException) -> StorageError:
    """The driver's error as relaybox's, without the URL's secrets."""
    return without_secrets(translate(exc), exc, url.secrets)


# -- the slot and its publication --------------------------------------------------------


async def create_slot(url: str, table: str = DEFAULT_TABLE) -> bool:
    """Create `table`'s publication (of no table) and logical slot if missing; True if
    the slot was created now. Messages emitted before the slot exists are lost, so
    this runs before the first writer (`relaybox migrate --log`); the relay runs it
    too when it starts. Raises a `ConfigurationError` unless wal_level is logical."""
    parsed = DatabaseUrl.parse(url)
    slot = log_slot(table)
    connection = await _connect(parsed, replication=False)
    try:
        level = await _one(connection, "SHOW wal_level")
        if level != "logical":
            raise ConfigurationError(
                f"log mode needs wal_level = logical at {parsed.masked} (it is {level}); "
                "set it and restart PostgreSQL"
            )
        if not await _one(connection, "SELECT count(*) FROM pg_publication WHERE pubname = %s",
                          slot):  # fmt: skip
            await _tolerate_duplicate(connection, f"CREATE PUBLICATION {slot}")
        if await _one(connection, "SELECT count(*) FROM pg_replication_slots "
                      "WHERE slot_name = %s", slot):  # fmt: skip
            return False
        return await _tolerate_duplicate(
            connection, "SELECT pg_create_logical_replication_slot(%s, %s)", slot, PLUGIN
        )
    except RelayboxError:
        raise
    except Exception as exc:  # noqa: BLE001 - raised again as relaybox's
        raise _error(parsed, exc) from None
    finally:
        await connection.close()


async def drop_slot(url: str, table: str = DEFAULT_TABLE) -> None:
    """Drop `table`'s slot and publication (waiting for no stream): the server keeps
    WAL for a slot until it is confirmed, so an unused slot must not be left behind."""
    parsed = DatabaseUrl.parse(url)
    slot = log_slot(table)
    connection = await _connect(parsed, replication=False)
    try:
        await connection.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot,),
        )
        await connection.execute(f"DROP PUBLICATION IF EXISTS {slot}")
    finally:
        await connection.close()


async def confirmed_position(url: str, table: str = DEFAULT_TABLE) -> int | None:
    """The slot's confirmed position as the server holds it (None: no slot)."""
    connection = await _connect(DatabaseUrl.parse(url), replication=False)
    try:
        value = await _one(
            connection,
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            log_slot(table),
        )
    finally:
        await connection.close()
    return None if value is None else parse_lsn(str(value))


async def _one(connection: Any, query: str, *params: Any) -> Any:
    cursor = await connection.execute(query, params or None)
    row = await cursor.fetchone()
    return None if row is None else row[0]


async def _tolerate_duplicate(connection: Any, query: str, *params: Any) -> bool:
    """Run a CREATE; False if another process created the same thing meanwhile."""
    try:
        await connection.execute(query, params or None)
    except Exception as exc:
        if getattr(exc, "sqlstate", None) == _DUPLICATE:
            return False
        raise
    return True


# -- the table, as the log relay uses it -------------------------------------------------

_ALL_LIVE_KEYS = "SELECT DISTINCT target, key FROM {table} WHERE key IS NOT NULL"
_LIVE_KEYS = """
SELECT k ->> 0, k ->> 1 FROM jsonb_array_elements($1::text::jsonb) AS k
WHERE EXISTS (SELECT 1 FROM {table} o
              WHERE o.key IS NOT NULL AND o.target = k ->> 0 AND o.key = k ->> 1)
"""


class LogTable(PostgresStorage):
    """The outbox table of a log-mode relay: `write` (the normal insert) takes the
    messages it could not publish; `live_keys` says which keys have rows there."""

    async def live_keys(
        self, pairs: Sequence[tuple[str, str]] | None = None
    ) -> set[tuple[str, str]]:
        """The (target, key) pairs among `pairs` (None: any) with a row in the table:
        a row there is pending, in flight or waiting for a retry."""
        if pairs is None:
            query, args = _ALL_LIVE_KEYS.format(table=self.table), []
        elif not pairs:
            return set()
        else:
            query, args = _LIVE_KEYS.format(table=self.table), [json.dumps(list(pairs))]

        async def fetch(session: Any) -> list[Sequence[Any]]:
            rows: list[Sequence[Any]] = await session.connection.fetch(query, args)
            return rows

        return {(str(target), str(key)) for target, key in await self._run(fetch)}
