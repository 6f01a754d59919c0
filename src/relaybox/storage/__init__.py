"""Storage backends behind the storage ports of `relaybox.ports`, chosen by database URL."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from relaybox.core.extras import installed, missing
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.errors import ConfigurationError, SchemaError
from relaybox.storage.urls import DatabaseUrl

if TYPE_CHECKING:
    from relaybox.storage.memory import MemoryStorage
    from relaybox.storage.sql import SqlStorage


async def open_storage(
    url: str, *, table: str = DEFAULT_TABLE, generic_plans: bool = False
) -> SqlStorage | MemoryStorage:
    """Connect to the outbox at `url`: postgresql://, mysql://, sqlite:///path, memory://.

    The storage serves every port (a relay's, an operator's, a tool's); raises a
    `SchemaError` that says to migrate if the table (or the SQLite file) is missing.
    `generic_plans`: see `SqlStorage.connect` (a relay's claim and settle connections)."""
    parsed = DatabaseUrl.parse(url)
    if parsed.clients and not installed(parsed.clients[0]):  # the storage's: the preferred
        raise missing(parsed.clients[0], f"the database URL {parsed.masked}")
    if parsed.dialect == "postgresql":
        from relaybox.storage.postgres import PostgresStorage

        return await PostgresStorage.connect(parsed, table=table, generic_plans=generic_plans)
    if parsed.dialect == "mysql":
        from relaybox.storage.mysql import MySQLStorage

        return await MySQLStorage.connect(parsed, table=table, generic_plans=generic_plans)
    if parsed.dialect == "sqlite":
        from relaybox.storage.sqlite import SQLiteStorage

        _require_file(parsed)

        return await SQLiteStorage.connect(parsed, table=table, generic_plans=generic_plans)
    if parsed.dialect == "memory":
        from relaybox.storage.memory import MemoryStorage

        return MemoryStorage(table=table)
    raise ConfigurationError(f"no storage for {parsed.masked}")  # pragma: no cover


def _require_file(url: DatabaseUrl) -> None:
    """A SQLite file that is not there is a mistyped path or a database never migrated;
    opening it would create an empty one."""
    if url.database != ":memory:" and not os.path.isfile(url.database):
        raise SchemaError(
            f"no SQLite database at {url.database}: check the path, or create it with "
            f"`relaybox migrate --db {url.masked}`"
        )
