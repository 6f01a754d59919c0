"""The Django migration operation that builds relaybox's tables with relaybox's own DDL.

`ApplySchema(kind, version)` runs, on the migrating connection, the migrations of
`relaybox.sql` for the connection's vendor up to `version` that are not yet recorded in
`<table>_migrations`, records each there, and takes the lock `relaybox migrate` takes.
So `manage.py migrate` and `relaybox migrate` build the same tables and the same
tracking rows, and either can apply what the other has not. The table names are the
settings' (`OUTBOX_TABLE`, `INBOX_TABLE`), read when the migration runs.

A later relaybox that adds a migration ships a Django migration with a higher
`version`. Reversing is refused: relaybox has no down migrations, and dropping an
outbox would drop the messages not yet delivered.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from django.db import router
from django.db.migrations.operations.base import Operation

from relaybox import sql
from relaybox.errors import ConfigurationError, MigrationError, SchemaError
from relaybox.integrations.django.conf import settings

_DIALECTS: dict[str, sql.Dialect] = {
    "postgresql": "postgresql",
    "mysql": "mysql",
    "sqlite": "sqlite",
}


class ApplySchema(Operation):  # type: ignore[misc]
    """Bring relaybox's `kind` ("outbox" or "inbox") tables to schema `version`."""

    reduces_to_sql = False
    reversible = False

    def __init__(self, kind: sql.Kind, version: int) -> None:
        if kind not in sql.KINDS:
            raise ConfigurationError(f"kind={kind!r}: the 'outbox' or the 'inbox'")
        self.kind: sql.Kind = kind
        self.version = version

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return type(self).__qualname__, [], {"kind": self.kind, "version": self.version}

    def state_forwards(self, app_label: str, state: Any) -> None:
        """No model state: the tables are relaybox's, not the ORM's."""

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        connection = schema_editor.connection
        if router.allow_migrate(connection.alias, app_label):
            conf = settings()
            table = conf.outbox_table if self.kind == "outbox" else conf.inbox_table
            apply(connection, self.kind, table, self.version)

    def describe(self) -> str:
        return f"relaybox's {self.kind} tables at schema version {self.version}"

    def __str__(self) -> str:
        """What Django's refusal to migrate backwards names: why it is refused."""
        return (
            f"{self.describe()} (relaybox has no down migrations, and dropping the tables "
            "would drop the messages they hold: drop them by hand if that is what you want)"
        )


def dialect_of(connection: Any) -> sql.Dialect:
    """relaybox's dialect for a Django connection's vendor."""
    dialect = _DIALECTS.get(connection.vendor)
    if dialect is None:
        raise ConfigurationError(
            f"relaybox has no schema for Django's {connection.vendor} backend; it runs on "
            "PostgreSQL, MySQL/MariaDB and SQLite"
        )
    return dialect


def apply(connection: Any, kind: sql.Kind, table: str, version: int) -> list[int]:
    """Apply, through Django's `connection`, the migrations of `kind` for `table` up to
    `version` that `<table>_migrations` lacks; return the versions applied."""
    dialect = dialect_of(connection)
    known = sql.migrations(dialect, table, kind)
    applied: list[int] = []
    with _locked(connection, dialect, table), connection.cursor() as cursor:
        _quietly(cursor, sql.tracking(dialect, table))
        cursor.execute(sql.MIGRATED_VERSIONS.format(table=table))
        done = {int(row[0]) for row in cursor.fetchall()}
        if done and max(done) > known[-1][0]:
            raise SchemaError(
                f"table {table} is at schema version {max(done)}, newer than this relaybox "
                f"knows ({known[-1][0]}); upgrade relaybox"
            )
        for number, name, script in known:
            if number > version or number in done:
                continue
            try:
                for statement in sql.statements(script):
                    _quietly(cursor, statement)
                record = sql.RECORD_MIGRATION.format(table=table) + "(%s, %s)"
                cursor.execute(record, (number, name))
            except Exception as exc:
                raise MigrationError(
                    f"migration {number:04d}_{name} on {table} failed: {exc}"
                ) from exc
            applied.append(number)
    return applied


def _quietly(cursor: Any, statement: str) -> None:
    # "Table already exists" notes from IF NOT EXISTS are expected on a re-run.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cursor.execute(statement)


@contextlib.contextmanager
def _locked(connection: Any, dialect: sql.Dialect, table: str) -> Iterator[None]:
    """Hold the lock `relaybox migrate` holds on `table` (PostgreSQL's advisory lock,
    MySQL's named lock; SQLite's transaction locks the file)."""
    name = sql.migration_lock(table)
    if dialect == "postgresql":
        with connection.cursor() as cursor:
            if connection.in_atomic_block:  # Django migrates PostgreSQL in a transaction
                cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (name,))
                yield
                return
            cursor.execute("SELECT pg_advisory_lock(hashtext(%s))", (name,))
            try:
                yield
            finally:
                cursor.execute("SELECT pg_advisory_unlock(hashtext(%s))", (name,))
    elif dialect == "mysql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT GET_LOCK(%s, 60)", (name,))
            (granted,) = cursor.fetchone()
            if granted != 1:
                raise MigrationError(f"another migration of {table} holds its lock; try again")
            try:
                yield
            finally:
                cursor.execute("SELECT RELEASE_LOCK(%s)", (name,))
    else:
        yield
