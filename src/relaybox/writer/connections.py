"""Recognising the caller's connection or session, and executing through it.

Drivers are recognised by the module their connection class lives in, so nothing is
imported that the caller does not already use. The writer only executes statements:
it never begins, commits, rolls back or closes anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from relaybox.errors import UnsupportedConnectionError
from relaybox.sql.params import ParamStyle

SyncExecute = Callable[[str, Sequence[Any]], None]
AsyncExecute = Callable[[str, Sequence[Any]], Awaitable[None]]

_SQLALCHEMY_DIALECTS = {"postgresql": "postgresql", "mysql": "mysql", "mariadb": "mysql",
                        "sqlite": "sqlite"}  # fmt: skip
_DJANGO_VENDORS = {"postgresql": "postgresql", "mysql": "mysql", "sqlite": "sqlite"}


@dataclasses.dataclass(frozen=True, slots=True)
class Channel:
    """Where the writer's statements go: a dialect, a parameter style, an executor."""

    dialect: str
    style: ParamStyle
    execute: Any  # SyncExecute or AsyncExecute, by the side it was made for


def _root(connection: object) -> str:
    return type(connection).__module__.split(".", 1)[0]


def _unsupported(connection: object, side: str) -> UnsupportedConnectionError:
    kind = f"{type(connection).__module__}.{type(connection).__qualname__}"
    return UnsupportedConnectionError(
        f"relaybox cannot write through {kind} with {side}; pass a psycopg, asyncpg, "
        "sqlite3, aiosqlite, PyMySQL, aiomysql or asyncmy connection, a SQLAlchemy "
        "Connection/Session/AsyncSession, or Django's connection"
    )


# -- sync ---------------------------------------------------------------------------


def _dbapi(connection: Any) -> SyncExecute:
    def execute(query: str, params: Sequence[Any]) -> None:
        cursor = connection.cursor()
        try:
            cursor.execute(query, params)
        finally:
            cursor.close()

    return execute


def _sqlalchemy_sync(connection: Any) -> Channel:
    dialect = _SQLALCHEMY_DIALECTS.get(connection.dialect.name)
    if dialect is None:
        raise _unsupported(connection, "Outbox.add")

    def execute(query: str, params: Sequence[Any]) -> None:
        connection.exec_driver_sql(query, tuple(params))

    return Channel(dialect, connection.dialect.paramstyle, execute)


def _django(connection: Any) -> Channel:
    dialect = _DJANGO_VENDORS.get(connection.vendor)
    if dialect is None:
        raise _unsupported(connection, "Outbox.add")

    def execute(query: str, params: Sequence[Any]) -> None:
        with connection.cursor() as cursor:
            cursor.execute(query, params)

    return Channel(dialect, "format", execute)  # Django's cursors all take %s


_sync_channels: weakref.WeakKeyDictionary[Any, Channel] = weakref.WeakKeyDictionary()


def sync_channel(connection: Any) -> Channel:
    """The channel for `connection`, remembered while the connection lives."""
    try:
        return _sync_channels[connection]
    except (KeyError, TypeError):  # TypeError: not weak-referenceable
        pass
    channel = _make_sync_channel(connection)
    # A Session hands out a new Connection per transaction: resolve it every time.
    if type(connection).__name__ not in ("Session", "scoped_session"):
        with contextlib.suppress(TypeError):
            _sync_channels[connection] = channel
    return channel


def _make_sync_channel(connection: Any) -> Channel:
    root = _root(connection)
    if root == "sqlite3":
        return Channel("sqlite", "qmark", _dbapi(connection))
    if root in ("psycopg", "psycopg2") and not _is_async(connection):
        return Channel("postgresql", "format", _dbapi(connection))
    if root == "pymysql":
        return Channel("mysql", "format", _dbapi(connection))
    if root == "sqlalchemy":
        if hasattr(connection, "exec_driver_sql") and not _is_async(connection):
            return _sqlalchemy_sync(connection)
        if (
            hasattr(connection, "connection")
            and callable(connection.connection)
            and (type(connection).__name__ in ("Session", "scoped_session"))
        ):
            return _sqlalchemy_sync(connection.connection())
    if root == "django":
        return _django(connection)
    raise _unsupported(connection, "Outbox.add (use add_async for async connections)")


# -- async --------------------------------------------------------------------------


def _is_async(connection: Any) -> bool:
    return type(connection).__name__.startswith("Async")


def _psycopg_async(connection: Any) -> AsyncExecute:
    async def execute(query: str, params: Sequence[Any]) -> None:
        async with connection.cursor() as cursor:
            await cursor.execute(query, params)

    return execute


def _asyncpg(connection: Any) -> AsyncExecute:
    async def execute(query: str, params: Sequence[Any]) -> None:
        await connection.execute(query, *params)

    return execute


def _aiosqlite(connection: Any) -> AsyncExecute:
    async def execute(query: str, params: Sequence[Any]) -> None:
        cursor = await connection.execute(query, params)
        await cursor.close()

    return execute


async def _sqlalchemy_async(connection: Any) -> Channel:
    if type(connection).__name__ in ("AsyncSession", "async_scoped_session"):
        connection = await connection.connection()
    dialect = _SQLALCHEMY_DIALECTS.get(connection.dialect.name)
    if dialect is None or not hasattr(connection, "exec_driver_sql"):
        raise _unsupported(connection, "Outbox.add_async")

    async def execute(query: str, params: Sequence[Any]) -> None:
        await connection.exec_driver_sql(query, tuple(params))

    return Channel(dialect, connection.dialect.paramstyle, execute)


async def async_channel(connection: Any) -> Channel:
    root = _root(connection)
    if root == "psycopg" and _is_async(connection):
        return Channel("postgresql", "format", _psycopg_async(connection))
    if root == "asyncpg":
        return Channel("postgresql", "numeric_dollar", _asyncpg(connection))
    if root == "aiosqlite":
        return Channel("sqlite", "qmark", _aiosqlite(connection))
    if root in ("aiomysql", "asyncmy"):
        return Channel("mysql", "format", _psycopg_async(connection))  # same cursor shape
    if root == "sqlalchemy" and _is_async(connection):
        return await _sqlalchemy_async(connection)
    raise _unsupported(connection, "Outbox.add_async (use add for sync connections)")
