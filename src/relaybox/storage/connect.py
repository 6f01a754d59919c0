"""One connection in one transaction to a database named by URL, through the client
the URL names or the first installed one of its dialect: how the command line and the
console reach an inbox's tables, which live in the consumer's database, not in a
storage of relaybox's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from relaybox.core.extras import installed, missing
from relaybox.storage.urls import DatabaseUrl


@contextlib.asynccontextmanager
async def transaction(url: DatabaseUrl) -> AsyncIterator[Any]:
    """A connection in a transaction, through the client the URL names or the first
    installed one of its dialect; committed on a clean exit."""
    client = next((c for c in url.clients if installed(c)), None)
    if client is None:
        raise missing(url.clients[0] if url.clients else url.dialect, f"reading {url.masked}")
    if client == "asyncpg":
        import asyncpg

        pg = await asyncpg.connect(url.libpq_dsn())
        try:
            async with pg.transaction():
                yield pg
        finally:
            await pg.close()
    elif client == "psycopg":
        import psycopg

        async with await psycopg.AsyncConnection.connect(url.libpq_dsn()) as pq:
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
    }  # fmt: skip
    if client == "asyncmy":
        import asyncmy

        my = await asyncmy.connect(database=url.database or None, **options)
    else:
        import aiomysql

        my = await aiomysql.connect(db=url.database or None, **options)
    try:
        yield my
        await my.commit()
    finally:
        my.close()
