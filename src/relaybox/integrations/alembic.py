"""relaybox's tables in your own Alembic migrations.

    from relaybox.integrations.alembic import create_outbox, drop_outbox

    def upgrade() -> None:
        create_outbox(op, table="outbox", version=3)

    def downgrade() -> None:
        drop_outbox(op, table="outbox")

and, in a later revision written when a newer relaybox brings more migrations:

    def upgrade() -> None:
        upgrade_outbox(op, table="outbox", version=4)

Each operation runs relaybox's own migrations (relaybox.sql, the SQL that `relaybox
migrate` runs) for the dialect of the migration's connection, inside Alembic's
transaction where the database has transactional DDL, and records the versions in
`<table>_migrations` as `relaybox migrate` does, so either way of migrating sees what
the other applied.

`version` pins the schema version a revision builds, so that the revision does the same
thing under a later relaybox; without it, it builds the latest this relaybox knows.
Online, only the migrations missing from `<table>_migrations` run. Offline (`alembic
upgrade --sql`) nothing can be read: `create_*` writes every migration up to `version`,
and `upgrade_*` needs `after=` (the version the database is at) to know where to start.

relaybox's migrations only add; there is no step down between two versions. The
downgrade of a revision that created the tables is `drop_outbox`/`drop_inbox`; that of
one that upgraded them has nothing to undo: a release's migrations leave the schema
usable by the release before it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from relaybox import sql
from relaybox.core.identifiers import DEFAULT_INBOX, DEFAULT_TABLE
from relaybox.errors import ConfigurationError, SchemaError

#: SQLAlchemy's dialect names for the databases relaybox has SQL for.
_DIALECTS: dict[str, sql.Dialect] = {
    "postgresql": "postgresql",
    "mysql": "mysql",
    "mariadb": "mysql",
    "sqlite": "sqlite",
}


def create_outbox(op: Any, *, table: str = DEFAULT_TABLE, version: int | None = None) -> None:
    """Create the outbox tables of `table`, at schema `version` (default: the latest)."""
    _migrate(op, table, "outbox", version, after=None, create=True)


def upgrade_outbox(
    op: Any, *, table: str = DEFAULT_TABLE, version: int | None = None, after: int | None = None
) -> None:
    """Apply the outbox migrations of `table` that it has not had, up to `version`."""
    _migrate(op, table, "outbox", version, after=after, create=False)


def drop_outbox(op: Any, *, table: str = DEFAULT_TABLE) -> None:
    """Drop the outbox tables of `table` and their record of migrations."""
    _drop(op, table, "outbox")


def create_inbox(op: Any, *, table: str = DEFAULT_INBOX, version: int | None = None) -> None:
    """Create the inbox tables of `table`, at schema `version` (default: the latest)."""
    _migrate(op, table, "inbox", version, after=None, create=True)


def upgrade_inbox(
    op: Any, *, table: str = DEFAULT_INBOX, version: int | None = None, after: int | None = None
) -> None:
    """Apply the inbox migrations of `table` that it has not had, up to `version`."""
    _migrate(op, table, "inbox", version, after=after, create=False)


def drop_inbox(op: Any, *, table: str = DEFAULT_INBOX) -> None:
    """Drop the inbox tables of `table` and their record of migrations."""
    _drop(op, table, "inbox")


def _dialect(op: Any) -> sql.Dialect:
    name = op.get_context().dialect.name
    dialect = _DIALECTS.get(name)
    if dialect is None:
        raise ConfigurationError(
            f"relaybox has no tables for {name}: PostgreSQL, MySQL/MariaDB or SQLite"
        )
    return dialect


def _migrate(
    op: Any, table: str, kind: sql.Kind, version: int | None, *, after: int | None, create: bool
) -> None:
    dialect = _dialect(op)
    steps = sql.migrations(dialect, table, kind)
    latest = steps[-1][0]
    target = latest if version is None else version
    if not 1 <= target <= latest:
        raise ConfigurationError(
            f"version={version!r}: this relaybox has {kind} schema versions 1 to {latest}"
        )
    offline = bool(op.get_context().as_sql)
    op.execute(_verbatim(sql.tracking(dialect, table)))
    if create and offline:
        done: set[int] = set()
    elif after is not None:
        done = set(range(1, after + 1))
    elif offline:
        raise ConfigurationError(
            f"upgrading {table} offline (--sql) cannot read which versions it has: "
            "pass after=VERSION, the version the database is at"
        )
    else:
        done = _applied(op, table, latest)
    for number, name, script in steps:
        if number in done or number > target:
            continue
        for statement in sql.statements(script):
            op.execute(_verbatim(statement))
        op.execute(
            text(f"INSERT INTO {table}_migrations (version, name) VALUES (:version, :name)")
            .bindparams(version=number, name=name)
        )  # fmt: skip


def _applied(op: Any, table: str, latest: int) -> set[int]:
    """The versions `<table>_migrations` records, refusing a schema newer than relaybox."""
    rows = op.get_bind().execute(text(f"SELECT version FROM {table}_migrations"))
    done = {int(row[0]) for row in rows}
    if done and max(done) > latest:
        raise SchemaError(
            f"table {table} is at schema version {max(done)}, newer than this relaybox "
            f"knows ({latest}); upgrade relaybox"
        )
    return done


def _drop(op: Any, table: str, kind: sql.Kind) -> None:
    for statement in sql.drops(_dialect(op), table, kind):
        op.execute(_verbatim(statement))


def _verbatim(statement: str) -> Any:
    """`statement` as SQLAlchemy text that binds nothing: a colon in it (a PostgreSQL
    cast, `:=`) stays a colon."""
    return text(statement.replace(":", "\\:"))
