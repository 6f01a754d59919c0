"""Recognising the caller's connection or session, and executing through it.

Drivers are recognised by the classes in the connection's type hierarchy (module and
name), so nothing is imported that the caller does not already use, and subclasses
(a project's own Session class, say) are recognised too. The writer only executes
statements: it never begins, commits, rolls back or closes anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from relaybox.errors import UnsupportedConnectionError
from relaybox.sql.params import ParamStyle

#: Run one statement; return its row count (what the inbox's checks read).
SyncExecute = Callable[[str, Sequence[Any]], int]
AsyncExecute = Callable[[str, Sequence[Any]], Awaitable[int]]

_SQLALCHEMY_DIALECTS = {"postgresql": "postgresql", "mysql": "mysql", "mariadb": "mysql",
                        "sqlite": "sqlite"}  # fmt: skip
_DJANGO_VENDORS = {"postgresql": "postgresql", "mysql": "mysql", "sqlite": "sqlite"}


@dataclasses.dataclass(frozen=True, slots=True)
class Channel:
    """Where the writer's statements go: a dialect, a parameter style, an executor."""

    dialect: str
    style: ParamStyle
    execute: Any  # SyncExecute or AsyncExecute, by the side it was made for


_lineages: dict[type, frozenset[tuple[str, str]]] = {}


def _lineage(kind: type) -> frozenset[tuple[str, str]]:
    """(top-level module, class name) of every class `kind` derives from, cached per type."""
    found = _lineages.get(kind)
    if found is None:
        found = frozenset((c.__module__.split(".", 1)[0], c.__name__) for c in kind.__mro__)
        _lineages[kind] = found
    return found


def _is(connection: Any, root: str, *names: str) -> bool:
    lineage = _lineage(type(connection))
    return any((root, name) in lineage for name in names)


def _from(connection: Any, root: str) -> bool:
    return any(module == root for module, _ in _lineage(type(connection)))


def _unsupported(connection: object, side: str) -> UnsupportedConnectionError:
    kind = f"{type(connection).__module__}.{type(connection).__qualname__}"
    return UnsupportedConnectionError(
        f"relaybox cannot write through {kind} with {side}; pass a psycopg, asyncpg, "
        "sqlite3, aiosqlite, PyMySQL, aiomysql or asyncmy connection, a SQLAlchemy "
        "Connection/Session/AsyncSession, or Django's connection"
    )


def _psycopg_style(connection: Any) -> ParamStyle:
    """psycopg's raw cursors take `$n`; its default cursors take `%s`."""
    factory = getattr(connection, "cursor_factory", None)
    raw = factory is not None and any(c.__name__ == "RawCursorMixin" for c in factory.__mro__)
    return "numeric_dollar" if raw else "format"


# -- sync ---------------------------------------------------------------------------


def _dbapi(connection: Any) -> SyncExecute:
    def execute(query: str, params: Sequence[Any]) -> int:
        cursor = connection.cursor()
        try:
            cursor.execute(query, params)
            return int(cursor.rowcount)
        finally:
            cursor.close()

    return execute


def _sqlalchemy_sync(connection: Any) -> Channel:
    dialect = _SQLALCHEMY_DIALECTS.get(connection.dialect.name)
    if dialect is None:
        raise _unsupported(connection, "Outbox.add")

    def execute(query: str, params: Sequence[Any]) -> int:
        return int(connection.exec_driver_sql(query, tuple(params)).rowcount)

    return Channel(dialect, connection.dialect.paramstyle, execute)


def _django(connection: Any) -> Channel:
    dialect = _DJANGO_VENDORS.get(connection.vendor)
    if dialect is None:
        raise _unsupported(connection, "Outbox.add")

    def execute(query: str, params: Sequence[Any]) -> int:
        with connection.cursor() as cursor:
            cursor.execute(query, params)
            return int(cursor.rowcount)

    return Channel(dialect, "format", execute)  # Django's cursors all take %s


_SYNC_KINDS: tuple[tuple[str, tuple[str, ...], Callable[[Any], Channel]], ...] = (
    ("sqlite3", ("Connection",), lambda c: Channel("sqlite", "qmark", _dbapi(c))),
    ("psycopg", ("Connection",), lambda c: Channel("postgresql", _psycopg_style(c), _dbapi(c))),
    ("psycopg2", ("connection",), lambda c: Channel("postgresql", "format", _dbapi(c))),
    ("pymysql", ("Connection",), lambda c: Channel("mysql", "format", _dbapi(c))),
    ("sqlalchemy", ("Connection",), _sqlalchemy_sync),
    # A session hands out a new Connection per transaction: resolve it on every call.
    ("sqlalchemy", ("Session", "scoped_session"), lambda c: _sqlalchemy_sync(c.connection())),
)


def sync_channel(connection: Any, api: str = "Outbox.add") -> Channel:
    for root, names, make in _SYNC_KINDS:
        if _is(connection, root, *names):
            return make(connection)
    if _from(connection, "django") and hasattr(connection, "vendor"):
        return _django(connection)
    raise _unsupported(connection, f"{api} (use {api}_async for async connections)")


# -- async --------------------------------------------------------------------------


def _cursor_async(connection: Any) -> AsyncExecute:
    async def execute(query: str, params: Sequence[Any]) -> int:
        async with connection.cursor() as cursor:
            await cursor.execute(query, params)
            return int(cursor.rowcount)

    return execute


def _asyncpg(connection: Any) -> AsyncExecute:
    async def execute(query: str, params: Sequence[Any]) -> int:
        status: str = await connection.execute(query, *params)  # "INSERT 0 1", "DELETE 3"
        count = status.rpartition(" ")[2]
        return int(count) if count.isdigit() else 0

    return execute


def _aiosqlite(connection: Any) -> AsyncExecute:
    async def execute(query: str, params: Sequence[Any]) -> int:
        cursor = await connection.execute(query, params)
        count = int(cursor.rowcount)
        await cursor.close()
        return count

    return execute


async def _sqlalchemy_async(connection: Any) -> Channel:
    if _is(connection, "sqlalchemy", "AsyncSession", "async_scoped_session"):
        connection = await connection.connection()
    dialect = _SQLALCHEMY_DIALECTS.get(connection.dialect.name)
    if dialect is None:
        raise _unsupported(connection, "Outbox.add_async")

    async def execute(query: str, params: Sequence[Any]) -> int:
        return int((await connection.exec_driver_sql(query, tuple(params))).rowcount)

    return Channel(dialect, connection.dialect.paramstyle, execute)


async def async_channel(connection: Any, api: str = "Outbox.add") -> Channel:
    if _is(connection, "psycopg", "AsyncConnection"):
        return Channel("postgresql", _psycopg_style(connection), _cursor_async(connection))
    if _is(connection, "asyncpg", "Connection", "PoolConnectionProxy"):
        return Channel("postgresql", "numeric_dollar", _asyncpg(connection))
    if _is(connection, "aiosqlite", "Connection"):
        return Channel("sqlite", "qmark", _aiosqlite(connection))
    if _is(connection, "aiomysql", "Connection") or _is(connection, "asyncmy", "Connection"):
        return Channel("mysql", "format", _cursor_async(connection))
    if _is(connection, "sqlalchemy", "AsyncConnection", "AsyncSession", "async_scoped_session"):
        return await _sqlalchemy_async(connection)
    raise _unsupported(connection, f"{api}_async (use {api} for sync connections)")
