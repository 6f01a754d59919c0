"""Entity and dedup stores on PostgreSQL, MariaDB/MySQL and SQLite: a document per row.

`create_tables(url, table)` creates, if missing, two tables (`relaybox_entities` by
default):

- `<table>` (id, version, state JSON, outbox JSON, updated_at): one row per entity. A
  save of a known entity is ``UPDATE ... SET version, state, outbox WHERE id = ? AND
  version = ?``, whose row count says whether the version still matched; the first
  save of a new one is an INSERT that the primary key lets only one writer make.
- `<table>_dedup` (message_id, added_at): one row per message done, deleted by
  `SqlDedupStore.purge` once older than the retention; run it from a scheduled job.

Each call opens a connection, runs one statement in its own transaction and commits
before it returns (through the client the URL names, or the first installed one of its
dialect, as the relay's storage picks it), so what one call wrote every later call
reads, from any process: point the URL at the primary, never a read replica. Ids are
compared byte for byte (MariaDB's columns use a binary collation).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from typing import Any

from relaybox.core.entities import DEFAULT_DEDUP_RETENTION, Entity, check_id, retention_seconds
from relaybox.core.identifiers import index_prefix, validate_table_name
from relaybox.core.urls import without_secrets
from relaybox.errors import ConfigurationError, InvalidTableNameError, StorageOperationalError
from relaybox.storage.connect import transaction
from relaybox.storage.urls import DatabaseUrl

DEFAULT_TABLE = "relaybox_entities"
#: Dedup rows deleted per statement by `purge`.
PURGE_BATCH = 1000

_DDL = {
    "postgresql": (
        "CREATE TABLE IF NOT EXISTS {t} (id VARCHAR(255) PRIMARY KEY, version BIGINT NOT "
        "NULL, state JSON NOT NULL, outbox JSON NOT NULL, updated_at TIMESTAMPTZ NOT NULL "
        "DEFAULT now())",
        "CREATE TABLE IF NOT EXISTS {t}_dedup (message_id VARCHAR(255) PRIMARY KEY, "
        "added_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        "CREATE INDEX IF NOT EXISTS {p}_dedup_added ON {t}_dedup (added_at)",
    ),
    "mysql": (
        "CREATE TABLE IF NOT EXISTS {t} (id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE "
        "utf8mb4_bin PRIMARY KEY, version BIGINT NOT NULL, state JSON NOT NULL, outbox "
        "JSON NOT NULL, updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) "
        "DEFAULT CHARSET = utf8mb4",
        "CREATE TABLE IF NOT EXISTS {t}_dedup (message_id VARCHAR(255) CHARACTER SET utf8mb4 "
        "COLLATE utf8mb4_bin PRIMARY KEY, added_at DATETIME(6) NOT NULL DEFAULT "
        "CURRENT_TIMESTAMP(6), INDEX {p}_dedup_added (added_at)) DEFAULT CHARSET = utf8mb4",
    ),
    "sqlite": (
        "CREATE TABLE IF NOT EXISTS {t} (id TEXT PRIMARY KEY, version INTEGER NOT NULL, "
        "state TEXT NOT NULL, outbox TEXT NOT NULL, updated_at REAL NOT NULL DEFAULT "
        "(julianday('now')))",
        "CREATE TABLE IF NOT EXISTS {t}_dedup (message_id TEXT PRIMARY KEY, added_at REAL "
        "NOT NULL DEFAULT (julianday('now')))",
        "CREATE INDEX IF NOT EXISTS {p}_dedup_added ON {t}_dedup (added_at)",
    ),
}

#: Statements by dialect, with `?` for each parameter (turned into the driver's style).
_QUERIES = {
    "postgresql": {
        "load": "SELECT version, state::text, outbox::text FROM {t} WHERE id = ?",
        "update": "UPDATE {t} SET version = ?, state = ?::json, outbox = ?::json, "
        "updated_at = now() WHERE id = ? AND version = ?",
        "insert": "INSERT INTO {t} (id, version, state, outbox) VALUES (?, ?, ?::json, "
        "?::json) ON CONFLICT (id) DO NOTHING",
        "processed": "SELECT 1 FROM {t}_dedup WHERE message_id = ?",
        "add": "INSERT INTO {t}_dedup (message_id) VALUES (?) ON CONFLICT DO NOTHING",
        "purge": "DELETE FROM {t}_dedup WHERE message_id IN (SELECT message_id FROM "
        "{t}_dedup WHERE added_at < now() - make_interval(secs => ?) LIMIT ?)",
    },
    "mysql": {
        "load": "SELECT version, state, outbox FROM {t} WHERE id = ?",
        "update": "UPDATE {t} SET version = ?, state = ?, outbox = ?, "
        "updated_at = CURRENT_TIMESTAMP(6) WHERE id = ? AND version = ?",
        # The row count of an upsert that changes nothing depends on CLIENT_FOUND_ROWS:
        # a new entity is a plain INSERT, and a duplicate key its lost race.
        "insert": "INSERT INTO {t} (id, version, state, outbox) VALUES (?, ?, ?, ?)",
        "processed": "SELECT 1 FROM {t}_dedup WHERE message_id = ?",
        "add": "INSERT INTO {t}_dedup (message_id) VALUES (?) "
        "ON DUPLICATE KEY UPDATE message_id = message_id",
        "purge": "DELETE FROM {t}_dedup WHERE added_at < CURRENT_TIMESTAMP(6) - "
        "INTERVAL ? MICROSECOND LIMIT ?",
    },
    "sqlite": {
        "load": "SELECT version, state, outbox FROM {t} WHERE id = ?",
        "update": "UPDATE {t} SET version = ?, state = ?, outbox = ?, "
        "updated_at = julianday('now') WHERE id = ? AND version = ?",
        "insert": "INSERT INTO {t} (id, version, state, outbox) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (id) DO NOTHING",
        "processed": "SELECT 1 FROM {t}_dedup WHERE message_id = ?",
        "add": "INSERT INTO {t}_dedup (message_id) VALUES (?) ON CONFLICT DO NOTHING",
        "purge": "DELETE FROM {t}_dedup WHERE rowid IN (SELECT rowid FROM {t}_dedup "
        "WHERE added_at < julianday('now') - ? LIMIT ?)",
    },
}
#: MySQL's error number for a duplicate key.
_DUPLICATE_KEY = 1062
_COUNT = re.compile(r"(\d+)$")


def _table(url: DatabaseUrl, table: str) -> str:
    if url.dialect not in _DDL:
        raise ConfigurationError(f"{url.masked}: entities are kept on PostgreSQL, MySQL or SQLite")
    table = validate_table_name(table)
    if "." in table and url.dialect == "sqlite":
        raise InvalidTableNameError(f"table {table!r}: SQLite tables take a plain name")
    return table


async def create_tables(url: str, table: str = DEFAULT_TABLE) -> None:
    """Create the entity table and its dedup table on `url`, if missing (idempotent)."""
    parsed = DatabaseUrl.parse(url)
    name = _table(parsed, table)
    for ddl in _DDL[parsed.dialect]:
        await _SqlStore(url, name).run(ddl.format(t=name, p=index_prefix(name)), ())


class _SqlStore:
    def __init__(self, url: str, table: str) -> None:
        self.url = DatabaseUrl.parse(url)
        self.table = _table(self.url, table)
        self.queries = {
            name: query.format(t=self.table) for name, query in _QUERIES[self.url.dialect].items()
        }

    async def run(self, query: str, params: Sequence[Any], *, rows: bool = False) -> Any:
        """Run one statement in a transaction of its own: its rows, or its row count.
        A driver's error becomes a `StorageOperationalError` that says no secret."""
        try:
            async with transaction(self.url) as connection:
                return await _execute(connection, query, params, rows=rows)
        except Exception as error:
            if _duplicate_key(error):
                raise
            failure = StorageOperationalError(
                f"{self.url.masked} ({self.table}): {type(error).__name__}: {error}"
            )
            raise without_secrets(failure, error, self.url.secrets) from None

    async def close(self) -> None:
        """Nothing stays open between calls."""


class SqlEntityStore(_SqlStore):
    """Entities as rows of `table` (see `create_tables`)."""

    def __init__(self, url: str, *, table: str = DEFAULT_TABLE) -> None:
        super().__init__(url, table)

    async def load(self, entity_id: str) -> Entity | None:
        found = await self.run(self.queries["load"], (check_id("entity id", entity_id),), rows=True)
        if not found:
            return None
        version, state, outbox = found[0]
        return Entity.from_columns(entity_id, version, state, outbox)

    async def save(self, entity: Entity, expected_version: int) -> bool:
        entity_id = check_id("entity id", entity.id)
        state, outbox = entity.encoded_state(), entity.encoded_outbox()
        if expected_version:
            params = (entity.version, state, outbox, entity_id, expected_version)
            return bool(await self.run(self.queries["update"], params) == 1)
        try:
            inserted = await self.run(
                self.queries["insert"], (entity_id, entity.version, state, outbox)
            )
        except Exception as error:
            if _duplicate_key(error):
                return False
            raise
        return bool(inserted == 1)


class SqlDedupStore(_SqlStore):
    """Processed message ids as rows of `<table>_dedup` (see `create_tables`), kept
    until `purge` deletes those older than `retention`."""

    def __init__(
        self,
        url: str,
        *,
        table: str = DEFAULT_TABLE,
        retention: datetime.timedelta | float = DEFAULT_DEDUP_RETENTION,
    ) -> None:
        super().__init__(url, table)
        self.retention = retention_seconds(retention)

    async def processed(self, message_id: str) -> bool:
        key = (check_id("message id", message_id),)
        return bool(await self.run(self.queries["processed"], key, rows=True))

    async def add(self, message_id: str) -> None:
        await self.run(self.queries["add"], (check_id("message id", message_id),))

    async def purge(self, batch: int = PURGE_BATCH) -> int:
        """Delete the ids added longer than the retention ago, `batch` per statement (a
        short transaction each); how many."""
        age: float | int = self.retention
        if self.url.dialect == "mysql":
            age = round(self.retention * 1_000_000)
        elif self.url.dialect == "sqlite":
            age = self.retention / 86400.0
        total = 0
        while True:
            deleted = int(await self.run(self.queries["purge"], (age, batch)))
            total += deleted
            if deleted < batch:
                return total


async def _execute(connection: Any, query: str, params: Sequence[Any], *, rows: bool) -> Any:
    """Run `query` (`?` placeholders) through an asyncpg, psycopg, aiosqlite, aiomysql
    or asyncmy connection: its rows, or its row count."""
    root = type(connection).__module__.partition(".")[0]
    if root == "asyncpg":
        numbered = iter(range(1, len(params) + 1))
        query = re.sub(r"\?", lambda _: f"${next(numbered)}", query)
        if rows:
            return [tuple(row) for row in await connection.fetch(query, *params)]
        status = await connection.execute(query, *params)
        match = _COUNT.search(status or "")
        return int(match.group(1)) if match else 0
    if root == "aiosqlite":
        async with connection.execute(query, tuple(params)) as cursor:
            return [tuple(row) for row in await cursor.fetchall()] if rows else cursor.rowcount
    async with connection.cursor() as cursor:  # psycopg, aiomysql, asyncmy: %s
        await cursor.execute(query.replace("?", "%s"), tuple(params))
        return [tuple(row) for row in await cursor.fetchall()] if rows else cursor.rowcount


def _duplicate_key(error: BaseException) -> bool:
    """Whether `error` is MariaDB/MySQL refusing a second row with one primary key."""
    args: tuple[Any, ...] = getattr(error, "args", ())
    return type(error).__name__ == "IntegrityError" and bool(args) and args[0] == _DUPLICATE_KEY
