"""SQLite storage for the relay, over aiosqlite.

One connection, owned by the storage, in autocommit mode (`isolation_level=None`):
each mark is one statement, and the claim runs in `BEGIN IMMEDIATE`, which takes the
database's write lock before reading, so relay processes sharing one file claim one
after another and never hand out the same row twice. WAL lets writers and readers
overlap; `busy_timeout` makes a waiting process queue for the lock instead of failing.

Lists (seqs, partitions, targets, failures) are bound as one JSON array and read with
`json_each`, so every query has a fixed shape; only the bulk insert repeats its row
placeholder, and never a value, into SQL text. Needs SQLite 3.35 (RETURNING).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar

import aiosqlite

from relaybox import sql
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.lifecycle import Status
from relaybox.core.partitions import DEFAULT_PARTITIONS, Rebalance, rebalance, require_partitions
from relaybox.core.records import (
    AbandonedMessage,
    Assignment,
    Claim,
    Failure,
    InsertRow,
    OutboxStats,
    Settled,
    StoredMessage,
)
from relaybox.errors import (
    SchemaError,
    StorageError,
    StorageIntegrityError,
    StorageOperationalError,
)
from relaybox.sql.inserts import inserts
from relaybox.storage.rows import by_seq, check_listing, decode, decode_abandoned, lease_token
from relaybox.storage.urls import DatabaseUrl

BUSY_TIMEOUT_MS = 5000
T = TypeVar("T")


def translate(exc: BaseException) -> StorageError:
    """Map sqlite3 errors onto relaybox's storage branch."""
    text = f"SQLite: {exc}"
    if isinstance(exc, sqlite3.IntegrityError):
        return StorageIntegrityError(text)
    if isinstance(exc, sqlite3.OperationalError):
        if "no such table" in str(exc):
            return SchemaError(text)
        if getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_ERROR:
            return StorageError(text)  # SQL the database cannot run: retrying will not help
        return StorageOperationalError(text)  # locked, busy, I/O, cannot open
    if isinstance(exc, OSError):
        return StorageOperationalError(text)
    return StorageError(text)


def _json(values: Sequence[Any] | None) -> str | None:
    return None if values is None else json.dumps(list(values))


class SQLiteStorage:
    """The outbox table in an SQLite file, through one connection the storage owns."""

    dialect = "sqlite"

    def __init__(self, url: DatabaseUrl, *, table: str = DEFAULT_TABLE) -> None:
        self.table = table
        self._url = url
        self._queries = sql.queries("sqlite", table)
        self._connection: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, url: DatabaseUrl | str, *, table: str = DEFAULT_TABLE) -> SQLiteStorage:
        storage = cls(DatabaseUrl.parse(url) if isinstance(url, str) else url, table=table)
        async with storage._lock:
            await storage._connected()
        return storage

    async def _connected(self) -> aiosqlite.Connection:
        if self._connection is None:
            try:
                self._connection = await self._open()
            except (sqlite3.Error, OSError) as exc:
                raise translate(exc) from exc
        return self._connection

    async def _open(self) -> aiosqlite.Connection:
        connection = await aiosqlite.connect(self._url.database, isolation_level=None)
        try:
            await connection.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            await connection.execute("PRAGMA journal_mode = WAL")
            await connection.execute("PRAGMA synchronous = NORMAL")
        except BaseException:
            await connection.close()
            raise
        return connection

    async def create_schema(self) -> None:
        """Create the table and indexes if missing (tests, tools, `:memory:` databases)."""
        statements = sql.statements(sql.schema("sqlite", self.table))
        await self._transaction([(s, ()) for s in statements])

    async def _execute(self, name: str, args: Sequence[Any]) -> int:
        async with self._lock:
            connection = await self._connected()
            try:
                async with connection.execute(self._queries[name], args) as cursor:
                    return cursor.rowcount
            except sqlite3.Error as exc:
                raise translate(exc) from exc

    async def _fetch(self, name: str, args: Sequence[Any] = ()) -> list[Sequence[Any]]:
        async with self._lock:
            connection = await self._connected()
            try:
                return list(await connection.execute_fetchall(self._queries[name], args))
            except sqlite3.Error as exc:
                raise translate(exc) from exc

    async def _transaction(self, steps: Sequence[tuple[str, Sequence[Any]]]) -> list[Sequence[Any]]:
        """Run `steps` in one BEGIN IMMEDIATE transaction, alone; rows of the last step."""

        async def run(connection: aiosqlite.Connection) -> list[Sequence[Any]]:
            found: list[Sequence[Any]] = []
            for query, args in steps:
                found = list(await connection.execute_fetchall(query, args))
            return found

        return await self._atomic(run)

    async def _atomic(self, work: Callable[[aiosqlite.Connection], Awaitable[T]]) -> T:
        """Run `work` in one BEGIN IMMEDIATE transaction on the connection, alone."""
        async with self._lock:
            return await _immediately(await self._connected(), work)

    async def write(self, rows: Sequence[InsertRow]) -> None:
        steps = [(st.query, st.params) for st in inserts("sqlite", self.table, "qmark", rows)]
        if steps:
            await self._transaction(steps)

    async def claim(
        self,
        worker: str,
        *,
        limit: int,
        lease_seconds: float,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
    ) -> Claim:
        if limit < 0:
            raise ValueError("limit must not be negative")
        count = require_partitions(partition_count)
        token = str(uuid.uuid4())
        parts, names = _json(partitions), _json(targets)
        args = [parts, count, parts, names, names, limit, worker, token, float(lease_seconds)]
        found = await self._transaction([(self._queries["claim"], args)])
        return Claim(token=token, worker=worker, messages=by_seq(found, count))

    async def read(
        self,
        *,
        limit: int,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
        in_flight: Sequence[StoredMessage] = (),
    ) -> list[StoredMessage]:
        if limit < 0:
            raise ValueError("limit must not be negative")
        count = require_partitions(partition_count)
        parts, names = _json(partitions), _json(targets)
        busy = _json(sorted(m.seq for m in in_flight))
        args = [busy, parts, count, parts, names, names, busy, limit]
        return [decode(row, count) for row in await self._fetch("read", args)]

    async def settle_owned(
        self,
        worker: str,
        *,
        partition_count: int = DEFAULT_PARTITIONS,
        failed: Sequence[Failure] = (),
        abandoned: Sequence[Failure] = (),
        published: Sequence[int] = (),
        delete: bool = True,
    ) -> Settled:
        count = require_partitions(partition_count)
        fence = (count, worker)
        steps = [
            ("fail_owned", json.dumps([[f.seq, f.error, float(f.retry_in)] for f in failed])),
            ("abandon_owned", json.dumps([[f.seq, f.error] for f in abandoned])),
            ("delete_owned" if delete else "publish_owned", _json(published)),
        ]

        async def run(connection: aiosqlite.Connection) -> Settled:
            counts = []
            for name, rows in steps:
                async with connection.execute(self._queries[name], (rows, *fence)) as cursor:
                    counts.append(cursor.rowcount)
            return Settled(*counts)

        return await self._atomic(run)

    async def mark_published(self, token: str, seqs: Sequence[int], *, delete: bool = False) -> int:
        name = "delete_published" if delete else "mark_published"
        return await self._execute(name, [_json(seqs), lease_token(token)])

    async def mark_failed(self, token: str, failures: Sequence[Failure]) -> int:
        rows = [[f.seq, f.error, float(f.retry_in)] for f in failures]
        return await self._execute("mark_failed", [json.dumps(rows), lease_token(token)])

    async def abandon(self, token: str, failures: Sequence[Failure]) -> int:
        rows = [[f.seq, f.error] for f in failures]
        return await self._execute("abandon", [json.dumps(rows), lease_token(token)])

    async def release(self, token: str, seqs: Sequence[int]) -> int:
        return await self._execute("release", [_json(seqs), lease_token(token)])

    async def renew(self, token: str, seqs: Sequence[int], lease_seconds: float) -> int:
        return await self._execute("renew", [float(lease_seconds), _json(seqs), lease_token(token)])

    async def recover_expired(self) -> int:
        return await self._execute("recover_expired", [])

    async def purge(
        self, *, published_older_than: float, abandoned_older_than: float, batch_size: int = 500
    ) -> int:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        total = 0
        for name, age in (("purge_published", published_older_than),
                          ("purge_abandoned", abandoned_older_than)):  # fmt: skip
            while True:
                deleted = await self._execute(name, [float(age), batch_size])
                total += deleted
                if deleted < batch_size:
                    break
        return total

    async def replay(self, seqs: Sequence[int]) -> int:
        return await self._execute("replay", [_json(seqs)])

    async def abandoned(
        self, *, limit: int, before: int | None = None, target: str | None = None
    ) -> list[AbandonedMessage]:
        args = [before, before, target, target, check_listing(limit)]
        return [decode_abandoned(row) for row in await self._fetch("abandoned", args)]

    async def stats(self) -> OutboxStats:
        counts = {Status(status): int(n) for status, n in await self._fetch("count_by_status")}
        ((age,),) = await self._fetch("oldest_pending_age")
        ((leases,),) = await self._fetch("active_leases")
        age = None if age is None else max(0.0, float(age))
        return OutboxStats(counts=counts, oldest_pending_age=age, active_leases=int(leases))

    async def heartbeat(
        self, worker: str, *, partitions: int, lease_seconds: float, busy: Collection[int] = ()
    ) -> Assignment:
        count, lease = require_partitions(partitions), float(lease_seconds)

        async def beat(connection: aiosqlite.Connection) -> Assignment:
            await connection.execute(self._queries["members_expire"])
            await connection.execute(self._queries["member_join"], (worker, lease))
            await connection.execute(self._queries["partitions_create"], (count,))
            ((live,),) = await connection.execute_fetchall(self._queries["members_live"])
            held = await connection.execute_fetchall(
                self._queries["partitions_renew"], (lease, worker)
            )
            plan = rebalance((p for (p,) in held), count, int(live), busy)
            taken = await self._settle(connection, worker, lease, count, plan)
            return Assignment(
                frozenset([*plan.keep, *plan.draining, *taken]), int(live),
                frozenset(plan.draining),
            )  # fmt: skip

        return await self._atomic(beat)

    async def _settle(
        self,
        connection: aiosqlite.Connection,
        worker: str,
        lease: float,
        count: int,
        plan: Rebalance,
    ) -> list[int]:
        """Give back what `plan` releases, take what it wants; the partitions taken."""
        if plan.release:
            release = self._queries["partitions_release"]
            await connection.execute(release, (worker, _json(plan.release)))
        if not plan.wanted:
            return []
        take = self._queries["partitions_take"]
        taken = await connection.execute_fetchall(take, (worker, lease, count, plan.wanted))
        return [p for (p,) in taken]

    async def leave(self, worker: str) -> None:
        async def part(connection: aiosqlite.Connection) -> None:
            await connection.execute(self._queries["partitions_leave"], (worker,))
            await connection.execute(self._queries["member_leave"], (worker,))

        await self._atomic(part)

    async def close(self) -> None:
        async with self._lock:
            connection, self._connection = self._connection, None
            if connection is not None:
                await connection.close()


async def _immediately(
    connection: aiosqlite.Connection, work: Callable[[aiosqlite.Connection], Awaitable[T]]
) -> T:
    """Run `work` in one BEGIN IMMEDIATE transaction, translating sqlite3 errors."""
    try:
        await connection.execute("BEGIN IMMEDIATE")
        result = await work(connection)
        await connection.execute("COMMIT")
    except BaseException as exc:
        await _rollback(connection)
        if isinstance(exc, sqlite3.Error):
            raise translate(exc) from exc
        raise
    return result


async def _rollback(connection: aiosqlite.Connection) -> None:
    """Roll back if a transaction is open; queued after a statement still running."""
    # Fails harmlessly when no transaction was active or the connection is gone.
    with contextlib.suppress(sqlite3.Error, ValueError):
        await connection.execute("ROLLBACK")
