"""Reading rows through the caller's connection or session, and running the inbox's
statements in one transaction whatever the side, sync or async.

The writer's channels (`relaybox.writer.connections`) run statements and give their row
count; the parked messages also need rows back. Every connection the inbox takes reads
rows in one of a few ways: asyncpg's `fetch`, SQLAlchemy's `exec_driver_sql`, or a
DB-API cursor (sqlite3, psycopg, psycopg2, PyMySQL, Django; aiosqlite, aiomysql,
asyncmy and psycopg's async cursors alike). Nothing here commits, rolls back or closes.

`Work` is one transaction's connection as the consumer's work uses it. Its
methods are coroutines on both sides: on the sync side they call the sync driver and
never suspend, so `run_sync` drives the same work to its end in the worker thread. One
implementation of parking, counting and replaying then serves both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from relaybox.core.incoming import Incoming
from relaybox.errors import TransactionLostError
from relaybox.inbox.inbox import Inbox, statement
from relaybox.writer.connections import Channel, async_channel, sync_channel

T = TypeVar("T")
Row = Sequence[Any]


def _roots(connection: Any) -> set[str]:
    return {kind.__module__.split(".", 1)[0] for kind in type(connection).__mro__}


def _is_session(connection: Any) -> bool:
    names = {kind.__name__ for kind in type(connection).__mro__}
    return bool(names & {"Session", "scoped_session", "AsyncSession", "async_scoped_session"})


def fetch_sync(connection: Any, query: str, params: Sequence[Any]) -> list[Row]:
    """The rows of `query`, run through a sync connection or session."""
    if "sqlalchemy" in _roots(connection):
        if _is_session(connection):
            connection = connection.connection()
        return [tuple(row) for row in connection.exec_driver_sql(query, tuple(params))]
    cursor = connection.cursor()
    try:
        cursor.execute(query, params)
        return [tuple(row) for row in cursor.fetchall()]
    finally:
        cursor.close()


async def fetch_async(connection: Any, query: str, params: Sequence[Any]) -> list[Row]:
    """The rows of `query`, run through an async connection or session."""
    roots = _roots(connection)
    if "asyncpg" in roots:
        return [tuple(row) for row in await connection.fetch(query, *params)]
    if "sqlalchemy" in roots:
        if _is_session(connection):
            connection = await connection.connection()
        result = await connection.exec_driver_sql(query, tuple(params))
        return [tuple(row) for row in result.fetchall()]
    if "aiosqlite" in roots:
        async with connection.execute(query, params) as cursor:
            return [tuple(row) for row in await cursor.fetchall()]
    async with connection.cursor() as cursor:
        await cursor.execute(query, params)
        return [tuple(row) for row in await cursor.fetchall()]


class Work:
    """One open transaction of the consumer's, for the inbox's named statements."""

    def __init__(self, connection: Any, channel: Channel, inbox: Inbox, *, sync: bool) -> None:
        self.connection = connection
        self.channel = channel
        self.inbox = inbox
        self.sync = sync

    @classmethod
    async def opened(cls, connection: Any, inbox: Inbox) -> Work:
        return cls(connection, await async_channel(connection, "Consumer"), inbox, sync=False)

    @classmethod
    def opened_sync(cls, connection: Any, inbox: Inbox) -> Work:
        return cls(connection, sync_channel(connection, "Consumer"), inbox, sync=True)

    @property
    def dialect(self) -> str:
        return self.channel.dialect

    def _statement(self, name: str, params: Sequence[Any]) -> tuple[str, Sequence[Any]]:
        return statement(self.channel.dialect, self.inbox.table, self.channel.style, name, params)

    async def execute(self, name: str, *params: Any) -> int:
        """Run the named statement; its row count."""
        query, ordered = self._statement(name, params)
        if self.sync:
            count: int = self.channel.execute(query, ordered)
            return count
        return int(await self.channel.execute(query, ordered))

    async def fetch(self, name: str, *params: Any) -> list[Row]:
        query, ordered = self._statement(name, params)
        if self.sync:
            return fetch_sync(self.connection, query, ordered)
        return await fetch_async(self.connection, query, ordered)

    async def record(self, message: Incoming) -> bool:
        """The inbox's check and record (`Inbox.record`)."""
        if self.sync:
            return self.inbox.record(self.connection, message)
        return await self.inbox.record_async(self.connection, message)

    async def record_id(self, message: Incoming) -> bool:
        """Record `message` by its id alone, whatever the inbox's mode (a message the
        watermark cannot place, parked): True for the first copy."""
        count = await self.execute("claim_id", self.inbox.consumer, message.id)
        return count == 1

    async def still_recorded(self, message: Incoming) -> None:
        """Raise `TransactionLostError` unless this transaction still holds the record
        `record` made for `message`: on PostgreSQL an error that the handler caught
        aborts the transaction, and its commit then rolls back, effects and record
        alike, which would acknowledge a message whose effects never happened."""
        name, params = self.inbox.proof(message)
        try:
            rows = await self.fetch(name, *params)
        except Exception as error:
            raise TransactionLostError(
                f"the handler of {message.id!r} returned, but its transaction had failed "
                f"({type(error).__name__}: {error}): an error it caught aborted it, so "
                "nothing it did is kept; let such errors out of the handler"
            ) from error
        if not rows:
            raise TransactionLostError(
                f"the handler of {message.id!r} returned, but its transaction no longer "
                "holds the message's record (rolled back by the database meanwhile): "
                "nothing it did is kept"
            )

    async def purge(self) -> int:
        """The inbox's purge of expired ids (`Inbox.purge`)."""
        if self.sync:
            return self.inbox.purge(self.connection)
        return await self.inbox.purge_async(self.connection)

    async def call(self, function: Callable[..., Any], *args: Any) -> None:
        """Call a handler: awaited on the async side, called on the sync side."""
        if self.sync:
            function(*args)
        else:
            await function(*args)


def run_sync(work: Coroutine[Any, Any, T]) -> T:
    """Run to its end a coroutine that never suspends (its I/O is a sync driver's)."""
    try:
        work.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    work.close()
    raise RuntimeError("work on a sync connection awaited something asynchronous")
