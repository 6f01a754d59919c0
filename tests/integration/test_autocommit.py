"""A connection in autocommit mode with no transaction open: the writer and the inbox
refuse it (their write would commit on its own, apart from the caller's), write when
told `allow_autocommit=True`, and join a transaction opened on that same connection.
Every connection kind the writer takes, on the real databases."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest

from relaybox import Inbox, Message, NoTransactionError, Outbox
from relaybox.migrations import migrate
from tests.databases import drop, fetch_all, sqlite_url, unique_table
from tests.integration.drivers import MYSQL_KW, PG_DSN, SA_ASYNC_URLS, SA_URLS


@contextlib.contextmanager
def _closing(*closers: Callable[[], Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for close in closers:
            close()


class Tables:
    """An outbox and an inbox table on each database, and how many rows each holds."""

    def __init__(self, db: Path) -> None:
        self.outbox_table, self.inbox_table = unique_table("ac"), unique_table("aci")
        self.outbox = Outbox(table=self.outbox_table)
        self.inbox = Inbox(table=self.inbox_table)
        self.sqlite = db
        self.urls = {"postgresql": PG_DSN, "mysql": "mysql://root@127.0.0.1:3306/test",
                     "sqlite": sqlite_url(db)}  # fmt: skip

    async def create(self) -> None:
        for url in self.urls.values():
            await migrate(url, table=self.outbox_table)
            await migrate(url, table=self.inbox_table, kind="inbox")

    def drop(self) -> None:
        for url in self.urls.values():
            drop(url, self.outbox_table)
            drop(url, self.inbox_table)

    def rows(self, dialect: str) -> tuple[int, int]:
        url = self.urls[dialect]
        ((outbox,),) = fetch_all(url, f"SELECT count(*) FROM {self.outbox_table}")
        ((inbox,),) = fetch_all(url, f"SELECT count(*) FROM {self.inbox_table}")
        return int(outbox), int(inbox)


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tables]:
    made = Tables(tmp_path_factory.mktemp("autocommit") / "app.db")
    asyncio.run(made.create())
    try:
        yield made
    finally:
        made.drop()


# -- sync connections in autocommit mode, each with a way to open a transaction --------
# An opener returns (connection, open a transaction that is rolled back at its end,
# close).

SyncOpened = tuple[Any, Callable[[], contextlib.AbstractContextManager[Any]], Callable[[], Any]]


def _psycopg(_: Path) -> SyncOpened:
    conn = psycopg.connect(PG_DSN, autocommit=True)
    return conn, lambda: conn.transaction(force_rollback=True), conn.close


def _sqlite3(db: Path) -> SyncOpened:
    conn = sqlite3.connect(db, isolation_level=None)
    return conn, lambda: _statements(conn.execute), conn.close


def _pymysql(_: Path) -> SyncOpened:
    kw = dict(MYSQL_KW, database=MYSQL_KW["db"])
    del kw["db"]
    conn = pymysql.connect(**kw, autocommit=True)

    @contextlib.contextmanager
    def begun() -> Iterator[None]:
        conn.begin()
        try:
            yield
        finally:
            conn.rollback()

    return conn, begun, conn.close


@contextlib.contextmanager
def _statements(run: Callable[[str], Any]) -> Iterator[None]:
    run("BEGIN")
    try:
        yield
    finally:
        run("ROLLBACK")


def _sqlalchemy(dialect: str, session: bool) -> Callable[[Path], SyncOpened]:
    def open_case(db: Path) -> SyncOpened:
        import sqlalchemy
        from sqlalchemy.orm import Session

        url = SA_URLS.get(dialect, f"sqlite:///{db}")
        engine = sqlalchemy.create_engine(
            url, isolation_level="AUTOCOMMIT", poolclass=sqlalchemy.pool.NullPool
        )
        if session:
            handle = Session(engine)
            run: Callable[[str], Any] = lambda s: handle.execute(sqlalchemy.text(s))  # noqa: E731
        else:
            handle = engine.connect()
            run = handle.exec_driver_sql
        return handle, lambda: _statements(run), lambda: (handle.close(), engine.dispose())

    return open_case


def _django(alias: str) -> Callable[[Path], SyncOpened]:
    def open_case(db: Path) -> SyncOpened:
        from tests.integration.django_setup import configure

        configure(db)
        from django.db import connections, transaction

        @contextlib.contextmanager
        def atomic() -> Iterator[None]:
            with transaction.atomic(using=alias):
                yield
                transaction.set_rollback(True, using=alias)

        return connections[alias], atomic, connections[alias].close

    return open_case


SYNC: dict[str, tuple[str, Callable[[Path], SyncOpened]]] = {
    "psycopg": ("postgresql", _psycopg),
    "sqlite3": ("sqlite", _sqlite3),
    "pymysql": ("mysql", _pymysql),
    "sqlalchemy-connection-postgresql": ("postgresql", _sqlalchemy("postgresql", False)),
    "sqlalchemy-connection-mysql": ("mysql", _sqlalchemy("mysql", False)),
    "sqlalchemy-connection-sqlite": ("sqlite", _sqlalchemy("sqlite", False)),
    "sqlalchemy-session-postgresql": ("postgresql", _sqlalchemy("postgresql", True)),
    "django-postgresql": ("postgresql", _django("pg")),
    "django-mysql": ("mysql", _django("mysql")),
    "django-sqlite": ("sqlite", _django("default")),
}


@pytest.mark.parametrize("kind", sorted(SYNC))
def test_sync_writes_outside_a_transaction_are_refused_unless_allowed(
    kind: str, tables: Tables
) -> None:
    dialect, opener = SYNC[kind]
    conn, transaction, close = opener(tables.sqlite)
    with _closing(close):
        before = tables.rows(dialect)
        with pytest.raises(NoTransactionError, match="autocommit mode") as refused:
            tables.outbox.add(conn, Message(topic="orders"))
        assert "allow_autocommit=True" in str(refused.value)
        with pytest.raises(NoTransactionError, match=r"Inbox\.record"):
            tables.inbox.record(conn, unique_table("id"))
        assert tables.rows(dialect) == before  # nothing written

        with transaction():  # joined, and rolled back with it
            tables.outbox.add(conn, Message(topic="orders"))
            assert tables.inbox.record(conn, unique_table("id"))
        assert tables.rows(dialect) == before

        tables.outbox.add(conn, Message(topic="orders"), allow_autocommit=True)
        assert tables.inbox.record(conn, unique_table("id"), allow_autocommit=True)
        assert tables.rows(dialect) == (before[0] + 1, before[1] + 1)  # committed alone


# -- async ---------------------------------------------------------------------------

AsyncOpened = tuple[
    Any, Callable[[], contextlib.AbstractAsyncContextManager[Any]], Callable[[], Any]
]


async def _psycopg_async(_: Path) -> AsyncOpened:
    conn = await psycopg.AsyncConnection.connect(PG_DSN, autocommit=True)
    return conn, lambda: conn.transaction(force_rollback=True), conn.close


@contextlib.asynccontextmanager
async def _asyncpg_transaction(conn: Any) -> AsyncIterator[None]:
    transaction = conn.transaction()
    await transaction.start()
    try:
        yield
    finally:
        await transaction.rollback()


async def _asyncpg(_: Path) -> AsyncOpened:
    import asyncpg

    conn = await asyncpg.connect(PG_DSN)
    return conn, lambda: _asyncpg_transaction(conn), conn.close


async def _asyncpg_pool(_: Path) -> AsyncOpened:
    import asyncpg

    pool = await asyncpg.create_pool(PG_DSN, min_size=1, max_size=1)
    conn = await pool.acquire()

    async def close() -> None:
        await pool.release(conn)
        await pool.close()

    return conn, lambda: _asyncpg_transaction(conn), close


@contextlib.asynccontextmanager
async def _async_statements(run: Callable[[str], Any]) -> AsyncIterator[None]:
    await run("BEGIN")
    try:
        yield
    finally:
        await run("ROLLBACK")


async def _aiosqlite(db: Path) -> AsyncOpened:
    import aiosqlite

    conn = await aiosqlite.connect(db, isolation_level=None)
    return conn, lambda: _async_statements(conn.execute), conn.close


def _async_mysql(module: str) -> Callable[[Path], Any]:
    async def open_case(_: Path) -> AsyncOpened:
        if module == "aiomysql":
            import aiomysql

            conn = await aiomysql.connect(**MYSQL_KW, autocommit=True)
            close: Callable[[], Any] = conn.ensure_closed
        else:
            import asyncmy

            kw = dict(MYSQL_KW, database=MYSQL_KW["db"])
            del kw["db"]
            conn = await asyncmy.connect(**kw, autocommit=True)
            close = conn.ensure_closed

        @contextlib.asynccontextmanager
        async def begun() -> AsyncIterator[None]:
            await conn.begin()
            try:
                yield
            finally:
                await conn.rollback()

        return conn, begun, close

    return open_case


def _sqlalchemy_async(dialect: str, session: bool) -> Callable[[Path], Any]:
    async def open_case(db: Path) -> AsyncOpened:
        import sqlalchemy
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

        url = SA_ASYNC_URLS.get(dialect, f"sqlite+aiosqlite:///{db}")
        engine = create_async_engine(
            url, isolation_level="AUTOCOMMIT", poolclass=sqlalchemy.pool.NullPool
        )
        if session:
            handle: Any = AsyncSession(engine)
            run: Callable[[str], Any] = lambda s: handle.execute(sqlalchemy.text(s))  # noqa: E731
        else:
            handle = await engine.connect()
            run = handle.exec_driver_sql

        async def close() -> None:
            await handle.close()
            await engine.dispose()

        return handle, lambda: _async_statements(run), close

    return open_case


ASYNC: dict[str, tuple[str, Callable[[Path], Any]]] = {
    "psycopg-async": ("postgresql", _psycopg_async),
    "asyncpg": ("postgresql", _asyncpg),
    "asyncpg-pool": ("postgresql", _asyncpg_pool),
    "aiosqlite": ("sqlite", _aiosqlite),
    "aiomysql": ("mysql", _async_mysql("aiomysql")),
    "asyncmy": ("mysql", _async_mysql("asyncmy")),
    "sqlalchemy-asyncconnection-postgresql": ("postgresql", _sqlalchemy_async("postgresql", False)),
    "sqlalchemy-asyncconnection-mysql": ("mysql", _sqlalchemy_async("mysql", False)),
    "sqlalchemy-asyncconnection-sqlite": ("sqlite", _sqlalchemy_async("sqlite", False)),
    "sqlalchemy-asyncsession-postgresql": ("postgresql", _sqlalchemy_async("postgresql", True)),
}


@pytest.mark.parametrize("kind", sorted(ASYNC))
async def test_async_writes_outside_a_transaction_are_refused_unless_allowed(
    kind: str, tables: Tables
) -> None:
    dialect, opener = ASYNC[kind]
    conn, transaction, close = await opener(tables.sqlite)
    try:
        before = tables.rows(dialect)
        with pytest.raises(NoTransactionError, match="autocommit mode"):
            await tables.outbox.add_async(conn, Message(topic="orders"))
        with pytest.raises(NoTransactionError, match=r"Inbox\.record_async"):
            await tables.inbox.record_async(conn, unique_table("id"))
        assert tables.rows(dialect) == before

        async with transaction():
            await tables.outbox.add_async(conn, Message(topic="orders"))
            assert await tables.inbox.record_async(conn, unique_table("id"))
        assert tables.rows(dialect) == before

        await tables.outbox.add_async(conn, Message(topic="orders"), allow_autocommit=True)
        assert await tables.inbox.record_async(conn, unique_table("id"), allow_autocommit=True)
        assert tables.rows(dialect) == (before[0] + 1, before[1] + 1)
    finally:
        await close()


def test_a_connection_that_begins_at_its_first_statement_is_in_a_transaction(
    tables: Tables,
) -> None:
    """psycopg's and sqlite3's defaults: the add opens the transaction, and is part of it."""
    before = tables.rows("postgresql"), tables.rows("sqlite")
    with psycopg.connect(PG_DSN) as conn:
        tables.outbox.add(conn, Message(topic="orders"))
        conn.rollback()
    with contextlib.closing(sqlite3.connect(tables.sqlite)) as lite:
        tables.outbox.add(lite, Message(topic="orders"))
        assert lite.in_transaction
        lite.rollback()
    assert (tables.rows("postgresql"), tables.rows("sqlite")) == before
