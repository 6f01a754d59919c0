"""SQLite storage for the relay, over aiosqlite.

The connection runs in autocommit mode (`isolation_level=None`); a transaction starts
with `BEGIN IMMEDIATE`, which takes the database's write lock before reading, so relay
processes sharing one file claim one after another and never hand out the same row
twice. WAL lets writers and readers overlap; `busy_timeout` makes a waiting process
queue for the lock instead of failing.

Lists (seqs, partitions, targets, failures) are bound as one JSON array and read with
`json_each`, so every query has one fixed shape; only the bulk insert repeats its row
placeholder, and never a value, into SQL text. Needs SQLite 3.35 (RETURNING).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sqlite3
import uuid
from collections.abc import Sequence
from typing import Any

import aiosqlite

from relaybox.core.partitions import DEFAULT_PARTITIONS, require_partitions
from relaybox.core.records import Claim, StoredMessage
from relaybox.errors import (
    SchemaError,
    StorageError,
    StorageIntegrityError,
    StorageOperationalError,
)
from relaybox.storage.rows import by_seq, byte_budget, decode
from relaybox.storage.sql import Connection, Seqs, Session, SqlStorage

BUSY_TIMEOUT_MS = 5000


def translate(exc: BaseException) -> StorageError:
    """Map sqlite3 errors onto relaybox's storage branch."""
    if isinstance(exc, StorageError):
        return exc
    return _error_class(exc)(f"SQLite: {exc}")


def _error_class(exc: BaseException) -> type[StorageError]:
    if isinstance(exc, sqlite3.IntegrityError):
        return StorageIntegrityError
    if isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc):
        return SchemaError
    if isinstance(exc, sqlite3.OperationalError):
        if getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_ERROR:
            return StorageError  # SQL the database cannot run: retrying will not help
        return StorageOperationalError  # locked, busy, I/O, cannot open
    if isinstance(exc, OSError):
        return StorageOperationalError
    return StorageError


class _Aiosqlite:
    def __init__(self, connection: aiosqlite.Connection) -> None:
        self._connection = connection

    @classmethod
    async def connect(cls, path: str) -> _Aiosqlite:
        connection = await aiosqlite.connect(path, isolation_level=None, uri=True)
        try:
            await connection.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            await connection.execute("PRAGMA journal_mode = WAL")
            await connection.execute("PRAGMA synchronous = NORMAL")
        except BaseException:
            await connection.close()
            raise
        return cls(connection)

    async def fetch(self, query: str, args: Sequence[Any]) -> list[Sequence[Any]]:
        return list(await self._connection.execute_fetchall(query, args))

    async def execute(self, query: str, args: Sequence[Any]) -> int:
        async with self._connection.execute(query, args) as cursor:
            return cursor.rowcount

    async def begin(self) -> None:
        await self._connection.execute("BEGIN IMMEDIATE")

    async def commit(self) -> None:
        await self._connection.execute("COMMIT")

    async def rollback(self) -> None:
        await self._connection.execute("ROLLBACK")

    async def close(self) -> None:
        await self._connection.close()

    async def discard(self) -> None:
        # Interrupt a statement still running on aiosqlite's thread, which the close
        # queues behind; closing rolls back a transaction left open.
        with contextlib.suppress(sqlite3.Error, ValueError):
            await self._connection.interrupt()
            await self._connection.close()


class SQLiteStorage(SqlStorage):
    """The outbox table in an SQLite file."""

    dialect = "sqlite"
    label = "SQLite"

    async def _open(self) -> Connection:
        return await _Aiosqlite.connect(self._url.sqlite_uri)

    translate = staticmethod(translate)

    def _seqs(self, seqs: Seqs) -> str:
        return json.dumps(seqs)

    def _value(self, value: datetime.datetime | uuid.UUID) -> Any:
        """Times as the table's UTC text, to the millisecond as SQLite's clock writes
        them (so a time read back from a row compares equal to it), uuids as text."""
        if isinstance(value, uuid.UUID):
            return str(value)
        utc = value.astimezone(datetime.UTC)
        return f"{utc:%Y-%m-%d %H:%M:%S}.{utc.microsecond // 1000:03d}"

    async def claim(
        self,
        worker: str,
        *,
        limit: int,
        lease_seconds: float,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
        max_bytes: int | None = None,
    ) -> Claim:
        if limit < 0:
            raise ValueError("limit must not be negative")
        count = require_partitions(partition_count)
        token = str(uuid.uuid4())

        async def lease(session: Session) -> list[Sequence[Any]]:
            return await session.fetch(
                "claim", _json(partitions), count, _json(targets), limit, worker, token,
                float(lease_seconds), byte_budget(max_bytes), True,
            )  # fmt: skip

        found = await self._run(lease, atomic=True)
        return Claim(token=token, worker=worker, messages=by_seq(found, count))

    async def read(
        self,
        *,
        limit: int,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
        in_flight: Sequence[StoredMessage] = (),
        after_in_flight: bool = False,
        max_bytes: int | None = None,
        at_least_one: bool = True,
    ) -> list[StoredMessage]:
        if limit < 0:
            raise ValueError("limit must not be negative")
        count = require_partitions(partition_count)
        busy = Seqs(m.seq for m in in_flight)
        found = await self._fetch(
            "read", busy, _json(partitions), count, _json(targets), limit, byte_budget(max_bytes),
            at_least_one,
        )  # fmt: skip
        return [decode(row, count) for row in found]


def _json(values: Sequence[Any] | None) -> str | None:
    return None if values is None else json.dumps(list(values))
