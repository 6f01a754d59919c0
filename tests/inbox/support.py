"""An inbox plus an effects table on a real database, for the inbox and consumer tests.

`InboxWorld(dialect, tmp_path)` migrates a uniquely named inbox and creates an effects
table beside it. `world.consumer(...)` is a `Consumer` whose handler inserts one effect
row per applied message (through asyncpg, aiomysql or aiosqlite, in the transaction
that also records the message in the inbox); `world.effects()` reads them back, so a
test asserts "exactly once" as "each id appears once in effects".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from relaybox.core.incoming import Incoming
from relaybox.inbox import Consumer, Inbox, Mode
from relaybox.migrations import migrate
from tests.databases import MYSQL_URL, PG_URL, drop, execute, fetch_all, sqlite_url, unique_table

DIALECTS = ("postgresql", "mysql", "sqlite")

#: Called inside the handler's transaction, before the effect is written (to be slow,
#: to fail, to wait for a rival): gets the message.
Hook = Callable[[Incoming], Awaitable[None]]


class InboxWorld:
    def __init__(self, dialect: str, tmp_path: Path) -> None:
        self.dialect = dialect
        self.table = unique_table("inb")
        self.effects_table = self.table + "_fx"
        self.path = tmp_path / "inbox.db"
        self.url = {"postgresql": PG_URL, "mysql": MYSQL_URL}.get(dialect, sqlite_url(self.path))
        self._pool: Any = None

    async def __aenter__(self) -> InboxWorld:
        await migrate(self.url, table=self.table, kind="inbox")
        self.run(
            f"CREATE TABLE {self.effects_table} (message_id VARCHAR(255) NOT NULL, "
            "consumer VARCHAR(255) NOT NULL, body TEXT)"
        )
        if self.dialect == "postgresql":
            import asyncpg

            self._pool = await asyncpg.create_pool(PG_URL, min_size=0, max_size=8)
        elif self.dialect == "mysql":
            import aiomysql

            self._pool = await aiomysql.create_pool(
                host="127.0.0.1", port=3306, user="root", password="", db="test",
                minsize=0, maxsize=8, autocommit=False,
            )  # fmt: skip
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.dialect == "postgresql":
            await self._pool.close()
        elif self.dialect == "mysql":
            self._pool.close()
            await self._pool.wait_closed()
        drop(self.url, self.table)
        if self.dialect != "sqlite":
            self.run(f"DROP TABLE IF EXISTS {self.effects_table}")

    # -- transactions (what an application passes to Consumer) ----------------------

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        """One transaction on a pooled connection: commit on a clean exit."""
        if self.dialect == "postgresql":
            async with self._pool.acquire() as conn, conn.transaction():
                yield conn
        elif self.dialect == "mysql":
            async with self._pool.acquire() as conn:
                await conn.begin()
                try:
                    yield conn
                except BaseException:
                    await conn.rollback()
                    raise
                await conn.commit()
        else:
            import aiosqlite

            async with aiosqlite.connect(self.path, timeout=30) as conn:
                await conn.execute("BEGIN IMMEDIATE")  # take the write lock up front
                try:
                    yield conn
                except BaseException:
                    await conn.rollback()
                    raise
                await conn.commit()

    async def write_effect(self, conn: Any, message: Incoming, consumer: str) -> None:
        body = message.payload.decode("utf-8", "replace")
        params = (message.id, consumer, body)
        if self.dialect == "postgresql":
            await conn.execute(f"INSERT INTO {self.effects_table} VALUES ($1, $2, $3)", *params)
        elif self.dialect == "mysql":
            async with conn.cursor() as cursor:
                await cursor.execute(
                    f"INSERT INTO {self.effects_table} VALUES (%s, %s, %s)", params
                )
        else:
            await conn.execute(f"INSERT INTO {self.effects_table} VALUES (?, ?, ?)", params)

    def consumer(
        self,
        *,
        name: str = "test",
        mode: Mode = "id",
        before_effect: Hook | None = None,
        purge_interval: float | None = None,
        **inbox_options: Any,
    ) -> Consumer:
        """A Consumer whose handler writes one effect row per applied message."""
        inbox = Inbox(consumer=name, table=self.table, mode=mode, **inbox_options)

        async def handler(message: Incoming, conn: Any) -> None:
            if before_effect is not None:
                await before_effect(message)
            await self.write_effect(conn, message, name)

        return Consumer(
            handler, inbox=inbox, transaction=self.transaction, purge_interval=purge_interval
        )

    # -- reading back ---------------------------------------------------------------

    def run(self, statement: str) -> None:
        execute(self.url, statement)

    def effects(self, consumer: str = "test") -> Counter[str]:
        """How many effect rows each message id has."""
        rows = fetch_all(
            self.url,
            f"SELECT message_id FROM {self.effects_table} WHERE consumer = '{consumer}'",
        )
        return Counter(str(row[0]) for row in rows)

    def parked(self, consumer: str = "test") -> list[tuple[Any, ...]]:
        """(message id, reason, attempts, error, payload, status) of each parked row."""
        rows = fetch_all(
            self.url,
            f"SELECT message_id, reason, attempts, error, payload, status FROM "
            f"{self.table}_parked WHERE consumer = '{consumer}' ORDER BY id",
        )
        return [(str(m), r, int(a), e, bytes(p), s) for m, r, a, e, p, s in rows]

    def inbox_ids(self, consumer: str = "test") -> set[str]:
        rows = fetch_all(
            self.url, f"SELECT message_id FROM {self.table} WHERE consumer = '{consumer}'"
        )
        return {str(row[0]) for row in rows}


def incoming(
    message_id: str,
    *,
    payload: bytes = b"{}",
    source: str = "test-source",
    partition: int | None = None,
    sequence: int | None = None,
    key: str | None = None,
) -> Incoming:
    """A received message, as a broker consumer would decode it."""
    attributes = {"id": message_id, "source": source, "type": "test.event"}
    if key is not None:
        attributes["subject"] = attributes["partitionkey"] = key
    if partition is not None:
        attributes["partition"] = str(partition)
    if sequence is not None:
        attributes["sequence"] = str(sequence)
    return Incoming.from_envelope(attributes, payload, content_type="application/json")


async def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)
