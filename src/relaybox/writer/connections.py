"""Recognising the caller's connection or session, and executing through it.

Drivers are recognised by the classes in the connection's type hierarchy (module and
name), so nothing is imported that the caller does not already use, and subclasses
(a project's own Session class, say) are recognised too. The writer only executes
statements: it never begins, commits, rolls back or closes anything.

Recognising a connection costs more than the writer's own Python work on the common
path, and the writer runs in every business transaction, so it happens once per type,
and the `Channel` it yields is kept per connection object (held weakly: the cache never
keeps a connection alive). A SQLAlchemy session is the exception: it hands out a new
Connection per transaction (an AsyncSession a new, short-lived proxy per call), so a
session is resolved on every call and its channel is not kept.

Each channel also says whether a statement run now would commit on its own (the
connection is in autocommit mode with no transaction open), which the writer and the
inbox refuse unless told otherwise: every kind answers from the driver's in-process
state, without a round trip.

A psycopg connection's channel also keeps one cursor, made on a weak proxy of the
connection: `Connection.execute` makes a new cursor per call (its adapters map and
transformer, whose per-type dumper cache then starts empty every time), a measured
cost to the writer's transaction (docs/benchmarks.md, "Writer overhead").
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from relaybox.errors import NoTransactionError, UnsupportedConnectionError
from relaybox.sql.params import ParamStyle

#: Run one statement; return its row count (what the inbox's checks read).
SyncExecute = Callable[[str, Sequence[Any]], int]
AsyncExecute = Callable[[str, Sequence[Any]], Awaitable[int]]
#: How a kind of connection runs one statement, given the connection.
_Run = Callable[[Any, str, Sequence[Any]], Any]
#: Whether a statement run now on the connection would commit on its own.
_Alone = Callable[[Any], bool]

_SQLALCHEMY_DIALECTS = {"postgresql": "postgresql", "mysql": "mysql", "mariadb": "mysql",
                        "sqlite": "sqlite"}  # fmt: skip
_DJANGO_VENDORS = {"postgresql": "postgresql", "mysql": "mysql", "sqlite": "sqlite"}


@dataclasses.dataclass(frozen=True, slots=True)
class Channel:
    """Where the writer's statements go: a dialect, a parameter style, an executor."""

    dialect: str
    style: ParamStyle
    execute: Any  # SyncExecute or AsyncExecute, by the side it was made for
    #: True when a statement run now would commit on its own: autocommit mode, and no
    #: transaction open.
    alone: Callable[[], bool]
    #: The driver takes a str for any parameter the SQL casts (psycopg sends it untyped
    #: for the server to parse), and pays a Python-level adapter lookup per distinct
    #: type in every execute (a measured cost): ids and integers go as text.
    text_values: bool = False


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


# -- the per-connection cache ---------------------------------------------------------

#: id(connection) -> (weak reference to it, its channel, and for psycopg what the
#: channel was made under, `_psycopg_state`; None where nothing can change).
_channels: dict[int, tuple[weakref.ref[Any], Channel, object]] = {}


def _known(connection: Any, known: tuple[weakref.ref[Any], Channel, object]) -> Channel | None:
    """The channel `known` under this connection's id, if made for it and still right."""
    ref, channel, state = known
    if ref() is not connection:  # a dead connection's id, taken by a new object
        return None
    if state is not None and state != _psycopg_state(connection):
        return None
    return channel


def _psycopg_state(connection: Any) -> tuple[object, bytes | None]:
    """What a psycopg channel depends on and a caller may change: the cursor factory
    decides the style, and the kept cursor encodes text in the client encoding that
    was set when it was made."""
    return connection.cursor_factory, connection.pgconn.parameter_status(b"client_encoding")


def _channel(
    connection: Any,
    dialect: str,
    style: ParamStyle,
    run: _Run,
    alone: _Alone,
    *,
    keep: bool = True,
    text_values: bool = False,
) -> Channel:
    """A channel running statements through `connection`, kept for the next call where
    the connection takes a weak reference (sqlite3's and asyncpg pool proxies do not:
    theirs are made anew per call, which is cheap once the type is recognised)."""
    key = id(connection)
    ref = weak_ref(connection, lambda dead: _forget(key, dead)) if keep else None
    if ref is None:
        bound = functools.partial
        return Channel(dialect, style, bound(run, connection), bound(alone, connection),
                       text_values)  # fmt: skip
    # The executor reaches the connection through a weak proxy: a strong reference
    # from the cache would keep every connection alive. (A proxy, not the reference:
    # partial(run, proxy) adds no Python frame to each execute.)
    proxy = weakref.proxy(connection)
    execute, check = functools.partial(run, proxy), functools.partial(alone, proxy)
    return _kept(key, ref, Channel(dialect, style, execute, check, text_values))


def _kept(key: int, ref: weakref.ref[Any], channel: Channel, state: object = None) -> Channel:
    _channels[key] = (ref, channel, state)
    return channel


def weak_ref(
    connection: Any, callback: Callable[[weakref.ref[Any]], None]
) -> weakref.ref[Any] | None:
    """A weak reference to `connection` calling `callback` when it dies; None for a type
    that takes no weak references."""
    try:
        return weakref.ref(connection, callback)
    except TypeError:  # no weak references to this type
        return None


def _forget(key: int, dead: weakref.ref[Any]) -> None:
    known = _channels.get(key)
    if known is not None and known[0] is dead:
        _channels.pop(key, None)


def _psycopg_style(factory: type) -> ParamStyle:
    """psycopg's raw cursors take `$n`; its default cursors take `%s`."""
    raw = any(c.__name__ == "RawCursorMixin" for c in factory.__mro__)
    return "numeric_dollar" if raw else "format"


# -- would a statement commit on its own? ---------------------------------------------
# Each kind reads what its driver already holds. A connection that is not in autocommit
# mode begins a transaction at the first statement (psycopg, psycopg2, a MySQL session
# with autocommit off, sqlite3 before a write in its default mode): the statement is
# then part of that transaction, so only autocommit mode with none open is alone.

_PQ_IDLE = 0  # libpq's PQTRANS_IDLE: connected, no transaction open
_MYSQL_IN_TRANS, _MYSQL_AUTOCOMMIT = 1, 2  # the server's status flags in every OK packet
_SQLITE_LEGACY = -1  # sqlite3.LEGACY_TRANSACTION_CONTROL, Python 3.12's default mode


def _psycopg_alone(connection: Any) -> bool:
    return bool(connection.autocommit) and connection.pgconn.transaction_status == _PQ_IDLE


def _psycopg2_alone(connection: Any) -> bool:
    return bool(connection.autocommit) and connection.get_transaction_status() == _PQ_IDLE


def _asyncpg_alone(connection: Any) -> bool:
    return not connection.is_in_transaction()


def _mysql_alone(connection: Any) -> bool:
    status = connection.server_status or 0  # None once PyMySQL has closed it
    return status & (_MYSQL_IN_TRANS | _MYSQL_AUTOCOMMIT) == _MYSQL_AUTOCOMMIT


def _sqlite_alone(connection: Any) -> bool:
    """sqlite3 (and aiosqlite, which passes these through): in its default mode the
    driver begins before a write unless isolation_level is None; Python 3.12's
    autocommit=True never begins, autocommit=False always has one open."""
    if connection.in_transaction:
        return False
    mode = getattr(connection, "autocommit", _SQLITE_LEGACY)
    return mode is True or (mode == _SQLITE_LEGACY and connection.isolation_level is None)


def _sqlalchemy_alone(connection: Any) -> bool:
    """A SQLAlchemy Connection (or AsyncConnection's sync side): its engine's
    AUTOCOMMIT isolation level puts the driver's own connection in autocommit mode, so
    that connection answers. asyncpg has no such mode: SQLAlchemy begins its transaction
    at the first statement unless its adapter's autocommit is on."""
    pooled = connection.connection
    driver = pooled.driver_connection
    if _is(driver, "asyncpg", "Connection"):
        return bool(pooled.dbapi_connection.autocommit) and not driver.is_in_transaction()
    return _alone_of(driver)


def _django_alone(connection: Any) -> bool:
    return bool(connection.get_autocommit()) and not connection.in_atomic_block


#: The check for a driver's own connection under SQLAlchemy, by (module, class name).
_DRIVER_ALONE: tuple[tuple[str, tuple[str, ...], _Alone], ...] = (
    ("psycopg", ("BaseConnection",), _psycopg_alone),
    ("psycopg2", ("connection",), _psycopg2_alone),
    ("sqlite3", ("Connection",), _sqlite_alone),
    ("aiosqlite", ("Connection",), _sqlite_alone),
    ("pymysql", ("Connection",), _mysql_alone),
    ("aiomysql", ("Connection",), _mysql_alone),
    ("asyncmy", ("Connection",), _mysql_alone),
)
_driver_alone: dict[type, _Alone] = {}


def _alone_of(driver: Any) -> bool:
    check = _driver_alone.get(type(driver))
    if check is None:
        found = (c for root, names, c in _DRIVER_ALONE if _is(driver, root, *names))
        # A driver whose state relaybox does not know how to read (mysqlclient, say)
        # passes: it is never refused by mistake, only not checked.
        check = _driver_alone[type(driver)] = next(found, lambda _: False)
    return check(driver)


_BEGIN_HINTS = {
    "psycopg": "open one with `with conn.transaction():`, or connect without autocommit=True",
    "psycopg2": "set conn.autocommit = False, or run BEGIN first",
    "asyncpg": "open one with `async with conn.transaction():`",
    "sqlite3": "run BEGIN first, or leave isolation_level at its default",
    "aiosqlite": "run BEGIN first, or leave isolation_level at its default",
    "pymysql": "call conn.begin() first, or connect with autocommit=False",
    "aiomysql": "call `await conn.begin()` first, or connect with autocommit=False",
    "asyncmy": "call `await conn.begin()` first, or connect with autocommit=False",
    "sqlalchemy": "use a connection or session whose engine is not isolation_level='AUTOCOMMIT'",
    "django": "wrap the work in `transaction.atomic()`",
}


def no_transaction(connection: object, api: str) -> NoTransactionError:
    """The error for a statement that would commit on its own, apart from the caller's."""
    kind = type(connection)
    hint = _BEGIN_HINTS.get(kind.__module__.split(".", 1)[0], "open a transaction first")
    return NoTransactionError(
        f"{api} needs the caller's transaction, and this {kind.__qualname__} is in "
        f"autocommit mode with none open: what it writes would commit on its own, apart "
        f"from the rest of your work. {hint[0].upper()}{hint[1:]}; or pass "
        f"allow_autocommit=True to {api} if committing on its own is what you mean."
    )


# -- sync ---------------------------------------------------------------------------


def _run_dbapi(connection: Any, query: str, params: Sequence[Any]) -> int:
    cursor = connection.cursor()
    try:
        cursor.execute(query, params)
        return int(cursor.rowcount)
    finally:
        cursor.close()


def _run_psycopg(cursor: Any, lock: Any, query: str, params: Sequence[Any]) -> int:
    # psycopg's cursors are not thread-safe, and threads may share a connection: the
    # lock keeps one statement and its row count together.
    with lock:
        cursor.execute(_encoded.get(query) or _as_bytes(query), params)
        return _row_count(cursor)


def in_pipeline(connection: Any) -> bool:
    """A psycopg connection in pipeline mode, where each statement's result, and so its
    row count, arrives only at the pipeline's next sync."""
    return bool(getattr(getattr(connection, "pgconn", None), "pipeline_status", 0))


def _row_count(cursor: Any) -> int:
    """The statement's row count, or -1 in pipeline mode: its result arrives only at the
    pipeline's next sync, and the count the cursor holds meanwhile is an earlier one's."""
    if in_pipeline(cursor.connection):
        return -1
    count: int = cursor.rowcount
    return count


#: psycopg encodes a str query and hashes the bytes on every execute to find its parsed
#: form; bytes kept per text (the writer's and inbox's texts are a handful of cached
#: strs, whose hash is computed once) skip both.
_encoded: dict[str, bytes] = {}


def _as_bytes(query: str) -> bytes:
    found = query.encode("utf-8")
    if len(_encoded) < 1024:  # a bound, should a caller ever pass made-up texts
        _encoded[query] = found
    return found


def _run_sqlalchemy(connection: Any, query: str, params: Sequence[Any]) -> int:
    return int(connection.exec_driver_sql(query, tuple(params)).rowcount)


def _run_django(connection: Any, query: str, params: Sequence[Any]) -> int:
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return int(cursor.rowcount)


def _psycopg_sync(connection: Any) -> Channel:
    factory = connection.cursor_factory
    cursor = _kept_cursor(connection, factory)
    execute = functools.partial(_run_psycopg, cursor, threading.Lock())
    return _psycopg_channel(connection, execute, factory)


def _kept_cursor(connection: Any, factory: Any) -> Any:
    """A cursor of `factory` that reaches `connection` through a weak proxy, so the
    channel that keeps it never keeps the connection alive. A client-side cursor holds
    no server resource, so it needs no closing. (It adapts with the connection's
    adapters as they were when it was made, which for the str, bytes, int and datetime
    values the writer sends are psycopg's own.)"""
    return factory(weakref.proxy(connection))


def _psycopg_channel(connection: Any, execute: Any, factory: type) -> Channel:
    """A psycopg channel, kept for `connection` (which always takes weak references)
    while `_psycopg_state` stays the same."""
    key = id(connection)
    ref = weakref.ref(connection, lambda dead: _forget(key, dead))
    alone = functools.partial(_psycopg_alone, weakref.proxy(connection))
    channel = Channel("postgresql", _psycopg_style(factory), execute, alone, text_values=True)
    return _kept(key, ref, channel, _psycopg_state(connection))


def _sqlalchemy_sync(connection: Any, *, keep: bool = True) -> Channel:
    dialect = _SQLALCHEMY_DIALECTS.get(connection.dialect.name)
    if dialect is None:
        raise _unsupported(connection, "Outbox.add")
    style, text = connection.dialect.paramstyle, connection.dialect.driver == "psycopg"
    return _channel(
        connection, dialect, style, _run_sqlalchemy, _sqlalchemy_alone,
        keep=keep, text_values=text,
    )  # fmt: skip


def _sqlalchemy_session(session: Any) -> Channel:
    return _sqlalchemy_sync(session.connection(), keep=False)


def _django(connection: Any) -> Channel:
    dialect = _DJANGO_VENDORS.get(getattr(connection, "vendor", ""))
    if dialect is None:
        raise _unsupported(connection, "Outbox.add")
    # Django's cursors take %s; on PostgreSQL they are psycopg's (or psycopg2's).
    text = dialect == "postgresql"
    return _channel(connection, dialect, "format", _run_django, _django_alone, text_values=text)


_SYNC_KINDS: tuple[tuple[str, tuple[str, ...], Callable[[Any], Channel]], ...] = (
    ("sqlite3", ("Connection",),
     lambda c: _channel(c, "sqlite", "qmark", _run_dbapi, _sqlite_alone)),
    ("psycopg", ("Connection",), _psycopg_sync),
    ("psycopg2", ("connection",),
     lambda c: _channel(c, "postgresql", "format", _run_dbapi, _psycopg2_alone)),
    ("pymysql", ("Connection",),
     lambda c: _channel(c, "mysql", "format", _run_dbapi, _mysql_alone)),
    ("sqlalchemy", ("Connection",), _sqlalchemy_sync),
    ("sqlalchemy", ("Session", "scoped_session"), _sqlalchemy_session),
)  # fmt: skip
_sync_makers: dict[type, Callable[[Any], Channel]] = {}


def sync_channel(connection: Any, api: str = "Outbox.add") -> Channel:
    known = _channels.get(id(connection))  # _known's first test, inline: the usual hit
    if known is not None and (channel := _known(connection, known)) is not None:
        return channel
    make = _sync_makers.get(type(connection))
    if make is None:
        make = _sync_maker(connection, api)
        _sync_makers[type(connection)] = make
    return make(connection)


def _sync_maker(connection: Any, api: str) -> Callable[[Any], Channel]:
    for root, names, make in _SYNC_KINDS:
        if _is(connection, root, *names):
            return make
    if _from(connection, "django") and hasattr(connection, "vendor"):
        return _django
    raise _unsupported(connection, f"{api} (use {api}_async for async connections)")


# -- async --------------------------------------------------------------------------


async def _run_cursor_async(connection: Any, query: str, params: Sequence[Any]) -> int:
    async with connection.cursor() as cursor:
        await cursor.execute(query, params)
        return int(cursor.rowcount)


async def _run_psycopg_async(cursor: Any, query: str, params: Sequence[Any]) -> int:
    # The row count is read before this task yields again, so another task's statement
    # on the same cursor (the connection's lock queues it) cannot come in between.
    await cursor.execute(_encoded.get(query) or _as_bytes(query), params)
    return _row_count(cursor)


async def _run_asyncpg(connection: Any, query: str, params: Sequence[Any]) -> int:
    status: str = await connection.execute(query, *params)  # "INSERT 0 1", "DELETE 3"
    count = status.rpartition(" ")[2]
    return int(count) if count.isdigit() else 0


async def _run_aiosqlite(connection: Any, query: str, params: Sequence[Any]) -> int:
    cursor = await connection.execute(query, params)
    count = int(cursor.rowcount)
    await cursor.close()
    return count


async def _run_sqlalchemy_async(connection: Any, query: str, params: Sequence[Any]) -> int:
    return int((await connection.exec_driver_sql(query, tuple(params))).rowcount)


def _psycopg_async(connection: Any) -> Channel:
    factory = connection.cursor_factory
    execute = functools.partial(_run_psycopg_async, _kept_cursor(connection, factory))
    return _psycopg_channel(connection, execute, factory)


def _sqlalchemy_async(connection: Any, *, keep: bool = True) -> Channel:
    dialect = _SQLALCHEMY_DIALECTS.get(connection.dialect.name)
    if dialect is None:
        raise _unsupported(connection, "Outbox.add_async")
    style, text = connection.dialect.paramstyle, connection.dialect.driver == "psycopg"
    run, alone = _run_sqlalchemy_async, _sqlalchemy_async_alone
    return _channel(connection, dialect, style, run, alone, keep=keep, text_values=text)


def _sqlalchemy_async_alone(connection: Any) -> bool:
    return _sqlalchemy_alone(connection.sync_connection)


_ASYNC_KINDS: tuple[tuple[str, tuple[str, ...], Callable[[Any], Channel]], ...] = (
    ("psycopg", ("AsyncConnection",), _psycopg_async),
    ("asyncpg", ("Connection", "PoolConnectionProxy"),
     lambda c: _channel(c, "postgresql", "numeric_dollar", _run_asyncpg, _asyncpg_alone)),
    ("aiosqlite", ("Connection",),
     lambda c: _channel(c, "sqlite", "qmark", _run_aiosqlite, _sqlite_alone)),
    ("aiomysql", ("Connection",),
     lambda c: _channel(c, "mysql", "format", _run_cursor_async, _mysql_alone)),
    ("asyncmy", ("Connection",),
     lambda c: _channel(c, "mysql", "format", _run_cursor_async, _mysql_alone)),
    ("sqlalchemy", ("AsyncConnection",), _sqlalchemy_async),
)  # fmt: skip
_async_makers: dict[type, Callable[[Any], Channel]] = {}
_ASYNC_SESSIONS = ("AsyncSession", "async_scoped_session")


async def async_channel(connection: Any, api: str = "Outbox.add") -> Channel:
    if _is(connection, "sqlalchemy", *_ASYNC_SESSIONS):
        return _sqlalchemy_async(await connection.connection(), keep=False)
    known = _channels.get(id(connection))
    if known is not None and (channel := _known(connection, known)) is not None:
        return channel
    make = _async_makers.get(type(connection))
    if make is None:
        make = _async_maker(connection, api)
        _async_makers[type(connection)] = make
    return make(connection)


def _async_maker(connection: Any, api: str) -> Callable[[Any], Channel]:
    for root, names, make in _ASYNC_KINDS:
        if _is(connection, root, *names):
            return make
    raise _unsupported(connection, f"{api}_async (use {api} for sync connections)")


#: How each database reports a table that does not exist: PostgreSQL's SQLSTATE (psycopg
#: and asyncpg give it as `sqlstate`, SQLAlchemy's asyncpg adapter as `pgcode`), MySQL's
#: error number (the first argument of PyMySQL's, aiomysql's and asyncmy's errors),
#: SQLite's message.
_UNDEFINED_TABLE_SQLSTATE = "42P01"
_MYSQL_NO_SUCH_TABLE = 1146
_SQLITE_NO_SUCH_TABLE = "no such table: "


def missing_table(error: BaseException) -> bool:
    """Whether `error`, or one it wraps (SQLAlchemy's `orig`, Django's cause), says that
    a table does not exist."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        state = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        args = current.args
        if (
            state == _UNDEFINED_TABLE_SQLSTATE
            or (args and args[0] == _MYSQL_NO_SUCH_TABLE)
            or (args and isinstance(args[0], str) and args[0].startswith(_SQLITE_NO_SUCH_TABLE))
        ):
            return True
        orig = getattr(current, "orig", None)
        pending += [orig if isinstance(orig, BaseException) else None, current.__cause__]
    return False
