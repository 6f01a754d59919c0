"""Every connection kind the writer supports, behind one small test-facing shape.

Each case opens a connection of its kind on a fresh transaction; `handle` is what the
application would pass to `Outbox.add`/`add_async`.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pymysql

from tests.databases import MYSQL_URL, PG_URL

PG_DSN = PG_URL
MYSQL_KW: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 3306,
    "user": "root",
    "password": "",
    "db": "test",
}
SA_URLS = {
    "postgresql": PG_URL.replace("postgresql://", "postgresql+psycopg://"),
    "mysql": MYSQL_URL.replace("mysql://", "mysql+pymysql://"),
}
SA_ASYNC_URLS = {
    "postgresql": PG_URL.replace("postgresql://", "postgresql+asyncpg://"),
    "mysql": MYSQL_URL.replace("mysql://", "mysql+aiomysql://"),
}


@dataclasses.dataclass
class Case:
    """`handle` goes to the writer; the rest drive its transaction (sync or async)."""

    handle: Any
    run: Callable[[str], Any]
    commit: Callable[[], Any]
    rollback: Callable[[], Any]
    close: Callable[[], Any]


SyncCase = AsyncCase = Case


# -- sync ----------------------------------------------------------------------------


def _dbapi_case(conn: Any) -> SyncCase:
    def run(statement: str) -> None:
        cursor = conn.cursor()
        cursor.execute(statement)
        cursor.close()

    return SyncCase(conn, run, conn.commit, conn.rollback, conn.close)


def psycopg_sync(_: Path) -> SyncCase:
    return _dbapi_case(psycopg.connect(PG_DSN))


def sqlite3_sync(db: Path) -> SyncCase:
    return _dbapi_case(sqlite3.connect(db))


def pymysql_sync(_: Path) -> SyncCase:
    kw = dict(MYSQL_KW)
    kw["database"] = kw.pop("db")
    return _dbapi_case(pymysql.connect(**kw))


def _sa_url(dialect: str, db: Path) -> str:
    return SA_URLS.get(dialect, f"sqlite:///{db}")


def sqlalchemy_connection(dialect: str) -> Callable[[Path], SyncCase]:
    def open_case(db: Path) -> SyncCase:
        import sqlalchemy

        engine = sqlalchemy.create_engine(_sa_url(dialect, db), poolclass=sqlalchemy.pool.NullPool)
        conn = engine.connect()

        def close() -> None:
            conn.close()
            engine.dispose()

        return SyncCase(conn, conn.exec_driver_sql, conn.commit, conn.rollback, close)

    return open_case


def sqlalchemy_session(dialect: str) -> Callable[[Path], SyncCase]:
    def open_case(db: Path) -> SyncCase:
        import sqlalchemy
        from sqlalchemy.orm import Session

        engine = sqlalchemy.create_engine(_sa_url(dialect, db), poolclass=sqlalchemy.pool.NullPool)
        session = Session(engine)

        def close() -> None:
            session.close()
            engine.dispose()

        return SyncCase(
            session,
            lambda s: session.execute(sqlalchemy.text(s)),
            session.commit,
            session.rollback,
            close,
        )

    return open_case


def django_connection(alias: str) -> Callable[[Path], SyncCase]:
    def open_case(db: Path) -> SyncCase:
        from tests.integration.django_setup import configure

        configure(db)
        from django.db import connections, transaction

        conn = connections[alias]
        transaction.set_autocommit(False, using=alias)

        def run(statement: str) -> None:
            with conn.cursor() as cursor:
                cursor.execute(statement)

        def close() -> None:
            transaction.rollback(using=alias)
            transaction.set_autocommit(True, using=alias)
            conn.close()

        return SyncCase(
            conn,
            run,
            lambda: transaction.commit(using=alias),
            lambda: transaction.rollback(using=alias),
            close,
        )

    return open_case


# -- async ---------------------------------------------------------------------------


async def psycopg_async(_: Path) -> AsyncCase:
    conn = await psycopg.AsyncConnection.connect(PG_DSN)
    return AsyncCase(conn, conn.execute, conn.commit, conn.rollback, conn.close)


async def asyncpg_async(_: Path) -> AsyncCase:
    import asyncpg

    conn = await asyncpg.connect(PG_DSN)
    state: dict[str, Any] = {}

    async def begin() -> None:
        state["tx"] = conn.transaction()
        await state["tx"].start()

    async def commit() -> None:
        await state["tx"].commit()
        await begin()

    async def rollback() -> None:
        await state["tx"].rollback()
        await begin()

    async def close() -> None:
        await state["tx"].rollback()
        await conn.close()

    await begin()
    return AsyncCase(conn, conn.execute, commit, rollback, close)


async def aiosqlite_async(db: Path) -> AsyncCase:
    import aiosqlite

    conn = await aiosqlite.connect(db)
    return AsyncCase(conn, conn.execute, conn.commit, conn.rollback, conn.close)


def _mysql_async_case(conn: Any, close: Callable[[], Any]) -> AsyncCase:
    async def run(statement: str) -> None:
        async with conn.cursor() as cursor:
            await cursor.execute(statement)

    return AsyncCase(conn, run, conn.commit, conn.rollback, close)


async def aiomysql_async(_: Path) -> AsyncCase:
    import aiomysql

    conn = await aiomysql.connect(**MYSQL_KW, autocommit=False)

    async def close() -> None:
        conn.close()

    return _mysql_async_case(conn, close)


async def asyncmy_async(_: Path) -> AsyncCase:
    import asyncmy

    kw = dict(MYSQL_KW)
    kw["database"] = kw.pop("db")
    conn = await asyncmy.connect(**kw, autocommit=False)

    async def close() -> None:
        await conn.ensure_closed()

    return _mysql_async_case(conn, close)


def sqlalchemy_async_session(dialect: str) -> Callable[[Path], Any]:
    async def open_case(db: Path) -> AsyncCase:
        import sqlalchemy
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

        url = SA_ASYNC_URLS.get(dialect, f"sqlite+aiosqlite:///{db}")
        engine = create_async_engine(url, poolclass=sqlalchemy.pool.NullPool)
        session = AsyncSession(engine)

        async def close() -> None:
            await session.close()
            await engine.dispose()

        return AsyncCase(
            session,
            lambda s: session.execute(sqlalchemy.text(s)),
            session.commit,
            session.rollback,
            close,
        )

    return open_case


def sqlalchemy_async_connection(dialect: str) -> Callable[[Path], Any]:
    async def open_case(db: Path) -> AsyncCase:
        import sqlalchemy
        from sqlalchemy.ext.asyncio import create_async_engine

        url = SA_ASYNC_URLS.get(dialect, f"sqlite+aiosqlite:///{db}")
        engine = create_async_engine(url, poolclass=sqlalchemy.pool.NullPool)
        conn = await engine.connect()

        async def close() -> None:
            await conn.close()
            await engine.dispose()

        return AsyncCase(conn, conn.exec_driver_sql, conn.commit, conn.rollback, close)

    return open_case


SYNC_CASES: dict[str, tuple[str, Callable[[Path], SyncCase]]] = {
    "psycopg": ("postgresql", psycopg_sync),
    "sqlite3": ("sqlite", sqlite3_sync),
    "pymysql": ("mysql", pymysql_sync),
    "sqlalchemy-connection-postgresql": ("postgresql", sqlalchemy_connection("postgresql")),
    "sqlalchemy-connection-mysql": ("mysql", sqlalchemy_connection("mysql")),
    "sqlalchemy-connection-sqlite": ("sqlite", sqlalchemy_connection("sqlite")),
    "sqlalchemy-session-postgresql": ("postgresql", sqlalchemy_session("postgresql")),
    "sqlalchemy-session-mysql": ("mysql", sqlalchemy_session("mysql")),
    "sqlalchemy-session-sqlite": ("sqlite", sqlalchemy_session("sqlite")),
    "django-postgresql": ("postgresql", django_connection("pg")),
    "django-mysql": ("mysql", django_connection("mysql")),
    "django-sqlite": ("sqlite", django_connection("default")),
}
ASYNC_CASES: dict[str, tuple[str, Callable[[Path], Any]]] = {
    "psycopg-async": ("postgresql", psycopg_async),
    "asyncpg": ("postgresql", asyncpg_async),
    "aiosqlite": ("sqlite", aiosqlite_async),
    "aiomysql": ("mysql", aiomysql_async),
    "asyncmy": ("mysql", asyncmy_async),
    "sqlalchemy-asyncsession-postgresql": ("postgresql", sqlalchemy_async_session("postgresql")),
    "sqlalchemy-asyncsession-mysql": ("mysql", sqlalchemy_async_session("mysql")),
    "sqlalchemy-asyncsession-sqlite": ("sqlite", sqlalchemy_async_session("sqlite")),
    "sqlalchemy-asyncconnection-postgresql": (
        "postgresql",
        sqlalchemy_async_connection("postgresql"),
    ),
}
