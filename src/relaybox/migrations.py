"""Versioned schema migrations: `relaybox migrate --db URL [--table NAME]`.

Each dialect's migrations are plain SQL files (sql/<dialect>/migrations/NNNN_name.sql).
Applied versions are recorded in `<table>_migrations`; running again applies only what
is missing, so the command is idempotent. Concurrent runs are serialised by a lock
(PostgreSQL advisory lock, MySQL GET_LOCK, SQLite's write lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from relaybox import sql
from relaybox.core.identifiers import DEFAULT_INBOX, DEFAULT_TABLE, validate_table_name
from relaybox.errors import ConfigurationError, MigrationError, RelayboxError, SchemaError
from relaybox.storage.urls import DatabaseUrl

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class MigrationReport:
    table: str
    applied: tuple[int, ...]
    version: int


class _Ddl(Protocol):
    async def execute(self, statement: str, args: Sequence[Any] = ()) -> None: ...
    async def versions(self, table: str) -> set[int]: ...


_TRACKING = {
    "postgresql": "CREATE TABLE IF NOT EXISTS {table}_migrations (version integer PRIMARY KEY, "
    "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
    "mysql": "CREATE TABLE IF NOT EXISTS {table}_migrations (version INT PRIMARY KEY, "
    "name VARCHAR(255) NOT NULL, applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6))",
    "sqlite": "CREATE TABLE IF NOT EXISTS {table}_migrations (version INTEGER PRIMARY KEY, "
    "name TEXT NOT NULL, applied_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
}
_RECORD = {
    "postgresql": "INSERT INTO {table}_migrations (version, name) VALUES ($1, $2)",
    "mysql": "INSERT INTO {table}_migrations (version, name) VALUES (%s, %s)",
    "sqlite": "INSERT INTO {table}_migrations (version, name) VALUES (?, ?)",
}


class _Postgres:
    def __init__(self, connection: Any) -> None:
        self.connection = connection

    async def execute(self, statement: str, args: Sequence[Any] = ()) -> None:
        await self.connection.execute(statement, *args)

    async def versions(self, table: str) -> set[int]:
        rows = await self.connection.fetch(f"SELECT version FROM {table}_migrations")
        return {int(row[0]) for row in rows}


class _MySQL:
    def __init__(self, connection: Any) -> None:
        self.connection = connection

    async def execute(self, statement: str, args: Sequence[Any] = ()) -> None:
        # "Table already exists" notes from IF NOT EXISTS are expected on a re-run.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            async with self.connection.cursor() as cursor:
                await cursor.execute(statement, tuple(args) or None)

    async def versions(self, table: str) -> set[int]:
        async with self.connection.cursor() as cursor:
            await cursor.execute(f"SELECT version FROM {table}_migrations")
            return {int(row[0]) for row in await cursor.fetchall()}


class _SQLite:
    def __init__(self, connection: Any) -> None:
        self.connection = connection

    async def execute(self, statement: str, args: Sequence[Any] = ()) -> None:
        await self.connection.execute(statement, tuple(args))

    async def versions(self, table: str) -> set[int]:
        async with self.connection.execute(f"SELECT version FROM {table}_migrations") as cursor:
            return {int(row[0]) for row in await cursor.fetchall()}


@contextlib.asynccontextmanager
async def _locked(url: DatabaseUrl, table: str) -> AsyncIterator[_Ddl]:
    """A DDL connection holding the migration lock for `table`."""
    lock_name = f"relaybox_migrate:{table}"
    if url.dialect == "postgresql":
        import asyncpg

        pg = await asyncpg.connect(url.libpq_dsn())
        try:
            await pg.execute("SELECT pg_advisory_lock(hashtext($1))", lock_name)
            yield _Postgres(pg)
        finally:
            await pg.close()  # closing the session releases the advisory lock
    elif url.dialect == "mysql":
        import aiomysql

        my = await aiomysql.connect(
            host=url.host or "127.0.0.1", port=url.port or 3306, user=url.user or "root",
            password=url.password or "", db=url.database, autocommit=True,
        )  # fmt: skip
        try:
            async with my.cursor() as cursor:
                await cursor.execute("SELECT GET_LOCK(%s, 60)", (lock_name,))
                (granted,) = await cursor.fetchone()
            if granted != 1:
                raise MigrationError(f"another migration of {table} holds its lock; try again")
            yield _MySQL(my)
        finally:
            my.close()
    elif url.dialect == "sqlite":
        import aiosqlite

        lite = await aiosqlite.connect(url.database, isolation_level=None)
        try:
            # One write transaction for the whole run: concurrent runs queue on it, and
            # the second one reads the versions the first recorded.
            await lite.execute("PRAGMA busy_timeout = 30000")
            await lite.execute("BEGIN IMMEDIATE")
            try:
                yield _SQLite(lite)
            except BaseException:
                await lite.execute("ROLLBACK")
                raise
            await lite.execute("COMMIT")
        finally:
            await lite.close()
    else:
        raise MigrationError(f"{url.dialect} storage has no schema to migrate")


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
    except (RelayboxError, ImportError):
        raise
    except Exception as exc:  # connection refused, auth, unknown database ...
        raise MigrationError(f"cannot migrate {table} at {url.masked}: {exc}") from exc
    return MigrationReport(table, tuple(applied), latest)


async def _migrate(
    ddl: _Ddl, dialect: sql.Dialect, table: str, steps: list[tuple[int, str, str]]
) -> list[int]:
    latest = steps[-1][0] if steps else 0
    applied: list[int] = []
    await ddl.execute(sql.render(_TRACKING[dialect], table, dialect))
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
        await ddl.execute(sql.render(_RECORD[dialect], table, dialect), [version, name])
        if transactional:
            await ddl.execute("COMMIT")
    except Exception as exc:
        if transactional:
            with contextlib.suppress(Exception):
                await ddl.execute("ROLLBACK")
        raise MigrationError(f"migration {version:04d}_{name} on {table} failed: {exc}") from exc
