"""Versioned schema migrations: `relaybox migrate --db URL [--table NAME]`.

Each dialect's migrations are plain SQL files (sql/<dialect>/migrations/NNNN_name.sql).
Applied versions are recorded in `<table>_migrations`; running again applies only what
is missing, so the command is idempotent. Concurrent runs are serialised by a lock
(PostgreSQL advisory lock, MySQL GET_LOCK, SQLite's write lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sqlite3
import warnings
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from relaybox import sql
from relaybox.core.extras import installed, missing
from relaybox.core.identifiers import DEFAULT_INBOX, DEFAULT_TABLE, validate_table_name
from relaybox.core.urls import without_secrets
from relaybox.errors import ConfigurationError, MigrationError, RelayboxError, SchemaError
from relaybox.storage.urls import DatabaseUrl

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True, slots=True)
class MigrationReport:
    table: str
    applied: tuple[int, ...]
    version: int


class _Ddl(Protocol):
    async def execute(self, statement: str) -> None: ...
    async def record(self, table: str, version: int, name: str) -> None: ...
    async def versions(self, table: str) -> set[int]: ...


class _Asyncpg:
    def __init__(self, connection: Any) -> None:
        self.connection = connection

    async def execute(self, statement: str) -> None:
        await self.connection.execute(statement)

    async def record(self, table: str, version: int, name: str) -> None:
        await self.connection.execute(
            sql.RECORD_MIGRATION.format(table=table) + "($1, $2)", version, name
        )

    async def versions(self, table: str) -> set[int]:
        rows = await self.connection.fetch(sql.MIGRATED_VERSIONS.format(table=table))
        return {int(row[0]) for row in rows}


class _DbApi:
    """psycopg's async connection, aiomysql's and asyncmy's: `%s` placeholders and
    async cursors."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    async def execute(self, statement: str) -> None:
        # "Table already exists" notes from IF NOT EXISTS are expected on a re-run.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            async with self.connection.cursor() as cursor:
                await cursor.execute(statement)

    async def record(self, table: str, version: int, name: str) -> None:
        async with self.connection.cursor() as cursor:
            await cursor.execute(
                sql.RECORD_MIGRATION.format(table=table) + "(%s, %s)", (version, name)
            )

    async def versions(self, table: str) -> set[int]:
        async with self.connection.cursor() as cursor:
            await cursor.execute(sql.MIGRATED_VERSIONS.format(table=table))
            return {int(row[0]) for row in await cursor.fetchall()}


class _SQLite:
    """The standard library's sqlite3, so that migrating a SQLite file needs no extra.
    Calls run on a thread of the connection's own (as aiosqlite does): on a shared pool,
    concurrent runs waiting for the write lock could take every thread and leave none
    for the run that holds it."""

    def __init__(self, connection: sqlite3.Connection, thread: ThreadPoolExecutor) -> None:
        self.connection = connection
        self._thread = thread

    async def _call(self, function: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, function)

    async def execute(self, statement: str) -> None:
        await self._call(lambda: self.connection.execute(statement))

    async def record(self, table: str, version: int, name: str) -> None:
        query = sql.RECORD_MIGRATION.format(table=table) + "(?, ?)"
        await self._call(lambda: self.connection.execute(query, (version, name)))

    async def versions(self, table: str) -> set[int]:
        query = sql.MIGRATED_VERSIONS.format(table=table)
        rows = await self._call(lambda: self.connection.execute(query).fetchall())
        return {int(row[0]) for row in rows}


def _pick(url: DatabaseUrl, purpose: str) -> str:
    """The client library the URL names, or else the first installed of its dialect's."""
    for client in url.clients:
        if installed(client):
            return client
    raise missing(url.clients[0], purpose)


@contextlib.asynccontextmanager
async def _locked(url: DatabaseUrl, table: str) -> AsyncIterator[_Ddl]:
    """A DDL connection holding the migration lock for `table`, through whichever client
    library the URL names or, for a plain URL, is installed."""
    lock_name = sql.migration_lock(table)
    purpose = f"migrating {url.masked}"
    if url.dialect == "postgresql":
        async with _postgres(url, _pick(url, purpose)) as ddl:
            await _postgres_lock(ddl, lock_name)
            yield ddl  # closing the session releases the advisory lock
    elif url.dialect == "mysql":
        async with _mysql(url, _pick(url, purpose)) as ddl:
            async with ddl.connection.cursor() as cursor:
                await cursor.execute("SELECT GET_LOCK(%s, 60)", (lock_name,))
                (granted,) = await cursor.fetchone()
            if granted != 1:
                raise MigrationError(f"another migration of {table} holds its lock; try again")
            yield ddl
    elif url.dialect == "sqlite":
        async with _sqlite(url) as lite:
            yield lite
    else:
        raise MigrationError(f"{url.dialect} storage has no schema to migrate")


@contextlib.asynccontextmanager
async def _postgres(url: DatabaseUrl, driver: str) -> AsyncIterator[_Asyncpg | _DbApi]:
    if driver == "asyncpg":
        import asyncpg

        pg = await asyncpg.connect(url.libpq_dsn())
        try:
            yield _Asyncpg(pg)
        finally:
            await pg.close()
    else:
        import psycopg

        async with await psycopg.AsyncConnection.connect(url.libpq_dsn(), autocommit=True) as pq:
            yield _DbApi(pq)


async def _postgres_lock(ddl: _Asyncpg | _DbApi, lock_name: str) -> None:
    if isinstance(ddl, _Asyncpg):
        await ddl.connection.execute("SELECT pg_advisory_lock(hashtext($1))", lock_name)
    else:
        await ddl.connection.execute("SELECT pg_advisory_lock(hashtext(%s))", (lock_name,))


@contextlib.asynccontextmanager
async def _mysql(url: DatabaseUrl, driver: str) -> AsyncIterator[_DbApi]:
    options: dict[str, Any] = {
        "host": url.host or "127.0.0.1", "port": url.port or 3306, "user": url.user or "root",
        "password": url.password or "", "autocommit": True,
    }  # fmt: skip
    if "unix_socket" in url.query:
        options["unix_socket"] = url.query["unix_socket"]
    if driver == "asyncmy":
        import asyncmy

        my = await asyncmy.connect(database=url.database or None, **options)
        try:
            yield _DbApi(my)
        finally:
            await my.ensure_closed()
    else:
        import aiomysql

        my = await aiomysql.connect(db=url.database or None, **options)
        try:
            yield _DbApi(my)
        finally:
            my.close()


@contextlib.asynccontextmanager
async def _sqlite(url: DatabaseUrl) -> AsyncIterator[_SQLite]:
    with ThreadPoolExecutor(1, thread_name_prefix="relaybox-migrate") as thread:
        loop = asyncio.get_running_loop()
        lite = await loop.run_in_executor(
            thread, lambda: sqlite3.connect(url.database, isolation_level=None, timeout=30)
        )
        ddl = _SQLite(lite, thread)
        try:
            # One write transaction for the whole run: concurrent runs queue on it, and
            # the second one reads the versions the first recorded.
            await ddl.execute("BEGIN IMMEDIATE")
            try:
                yield ddl
            except BaseException:
                await ddl.execute("ROLLBACK")
                raise
            await ddl.execute("COMMIT")
        finally:
            await loop.run_in_executor(thread, lite.close)


async def migrate(
    db_url: str, *, table: str | None = None, kind: sql.Kind = "outbox"
) -> MigrationReport:
    """Create or upgrade the outbox (or, with kind="inbox", the inbox) tables at
    `db_url`; apply only missing migrations."""
    if kind not in sql.KINDS:
        raise ConfigurationError(f"kind={kind!r}: migrate the 'outbox' or the 'inbox'")
    table = validate_table_name(table or (DEFAULT_TABLE if kind == "outbox" else DEFAULT_INBOX))
    url = DatabaseUrl.parse(db_url)
    if url.dialect == "memory":
        return MigrationReport(table, (), 0)
    dialect: sql.Dialect = url.dialect  # type: ignore[assignment]
    steps = sql.migrations(dialect, table, kind)
    latest = steps[-1][0] if steps else 0
    try:
        async with _locked(url, table) as ddl:
            applied = await _migrate(ddl, dialect, table, steps)
    except Exception as exc:  # noqa: BLE001 - connection refused, auth, unknown database ...
        error = (
            exc if isinstance(exc, RelayboxError)
            else MigrationError(f"cannot migrate {table} at {url.masked}: {exc}")
        )  # fmt: skip
        error = without_secrets(error, exc, url.secrets)  # a driver may quote the password
        raise error from error.__cause__
    return MigrationReport(table, tuple(applied), latest)


async def _migrate(
    ddl: _Ddl, dialect: sql.Dialect, table: str, steps: list[tuple[int, str, str]]
) -> list[int]:
    latest = steps[-1][0] if steps else 0
    applied: list[int] = []
    await ddl.execute(sql.tracking(dialect, table))
    done = await ddl.versions(table)
    if done and max(done) > latest:
        raise SchemaError(
            f"table {table} is at schema version {max(done)}, newer than this relaybox "
            f"knows ({latest}); upgrade relaybox"
        )
    for version, name, script in steps:
        if version in done:
            continue
        await _apply(ddl, dialect, table, version, name, script)
        applied.append(version)
    return applied


async def _apply(
    ddl: _Ddl, dialect: sql.Dialect, table: str, version: int, name: str, script: str
) -> None:
    # PostgreSQL runs each migration in a transaction; SQLite runs the whole migrate in
    # one (see _locked); MySQL commits each DDL statement itself, so its migrations are
    # written with IF NOT EXISTS to be safely re-runnable.
    transactional = dialect == "postgresql"
    logger.info("applying migration", extra={"action": "migrate", "table": table,
                                             "version": version, "migration": name})  # fmt: skip
    try:
        if transactional:
            await ddl.execute("BEGIN")
        for statement in sql.statements(script):
            await ddl.execute(statement)
        await ddl.record(table, version, name)
        if transactional:
            await ddl.execute("COMMIT")
    except Exception as exc:
        if transactional:
            with contextlib.suppress(Exception):
                await ddl.execute("ROLLBACK")
        raise MigrationError(f"migration {version:04d}_{name} on {table} failed: {exc}") from exc
