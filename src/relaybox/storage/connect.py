"""One connection in one transaction to a database named by URL, through the client
the URL names or the first installed one of its dialect: how the command line and the
console reach an inbox's tables, which live in the consumer's database, not in a
storage of relaybox's own, and how the entity and dedup stores reach theirs.

The URL's timeouts bound it as they bound a storage: opening the connection within
`connect_timeout` (a host that takes the connection and never answers gets a
`StorageOperationalError`, not a wait without end), and each statement on PostgreSQL
within `command_timeout`, which the server enforces (`statement_timeout`) and asyncpg
also bounds on its side.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from relaybox.core.extras import installed, missing
from relaybox.errors import StorageOperationalError
from relaybox.storage.urls import GRACE, DatabaseUrl

T = TypeVar("T")


async def _opened(url: DatabaseUrl, connecting: Awaitable[T]) -> T:
    """`connecting`, within the URL's connect_timeout."""
    seconds = url.connect_timeout
    try:
        async with asyncio.timeout(seconds):
            return await connecting
    except TimeoutError:
        raise StorageOperationalError(
            f"{url.masked} did not answer a new connection within {seconds:g} s"
        ) from None


@contextlib.asynccontextmanager
async def transaction(url: DatabaseUrl) -> AsyncIterator[Any]:
    """A connection in a transaction, through the client the URL names or the first
    installed one of its dialect; committed on a clean exit."""
    client = next((c for c in url.clients if installed(c)), None)
    if client is None:
        raise missing(url.clients[0] if url.clients else url.dialect, f"reading {url.masked}")
    statement_ms = str(url.command_timeout_ms)
    if client == "asyncpg":
        import asyncpg

        pg = await _opened(url, asyncpg.connect(
            url.libpq_dsn(), timeout=url.connect_timeout + GRACE,
            command_timeout=url.command_timeout + GRACE,
            server_settings={"statement_timeout": statement_ms},
        ))  # fmt: skip
        try:
            async with pg.transaction():
                yield pg
        finally:
            await pg.close()
    elif client == "psycopg":
        import psycopg

        pq = await _opened(url, psycopg.AsyncConnection.connect(
            url.libpq_dsn(), options=f"-c statement_timeout={statement_ms}",
            connect_timeout=math.ceil(url.connect_timeout + GRACE),  # libpq: whole seconds
        ))  # fmt: skip
        async with pq:
            yield pq  # psycopg commits on a clean exit, rolls back otherwise
    elif client == "aiosqlite":
        import aiosqlite

        async with aiosqlite.connect(url.database, timeout=30) as lite:
            await lite.execute("BEGIN IMMEDIATE")
            yield lite
            await lite.commit()  # an exception leaves it uncommitted: closing rolls back
    else:
        async with _mysql(url, client) as my:
            yield my


@contextlib.asynccontextmanager
async def _mysql(url: DatabaseUrl, client: str) -> AsyncIterator[Any]:
    options: dict[str, Any] = {
        "host": url.host or "127.0.0.1", "port": url.port or 3306, "user": url.user or "root",
        "password": url.password or "", "autocommit": False,
        "connect_timeout": url.connect_timeout + GRACE,
    }  # fmt: skip
    if client == "asyncmy":
        import asyncmy

        my = await _opened(url, asyncmy.connect(database=url.database or None, **options))
    else:
        import aiomysql

        my = await _opened(url, aiomysql.connect(db=url.database or None, **options))
    try:
        yield my
        await my.commit()
    finally:
        my.close()
