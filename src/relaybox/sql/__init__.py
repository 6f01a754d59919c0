"""SQL text per dialect, kept in .sql files: the schema, its versioned migrations and the
named queries.

Only the table name is ever put into SQL text, after `validate_table_name` has checked
it; every value travels as a bound parameter.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.resources.abc
import re
from typing import Literal

from relaybox.core.identifiers import index_prefix, validate_table_name
from relaybox.errors import InvalidTableNameError

Dialect = Literal["postgresql", "mysql", "sqlite"]
DIALECTS: tuple[Dialect, ...] = ("postgresql", "mysql", "sqlite")
#: Which tables: the outbox's (sql/<dialect>/) or the inbox's (sql/<dialect>/inbox/).
Kind = Literal["outbox", "inbox"]
KINDS: tuple[Kind, ...] = ("outbox", "inbox")

_QUERY_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_MIGRATION_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")


def _folder(dialect: Dialect, kind: Kind) -> importlib.resources.abc.Traversable:
    root = importlib.resources.files(__package__).joinpath(dialect)
    return root if kind == "outbox" else root.joinpath(kind)


def _read(dialect: Dialect, name: str, kind: Kind = "outbox") -> str:
    return _folder(dialect, kind).joinpath(name).read_text(encoding="utf-8")


def render(sql: str, table: str, dialect: Dialect) -> str:
    """Put the (validated) table name and its derived prefix into SQL text."""
    table = validate_table_name(table)
    if "." in table and dialect == "sqlite":
        raise InvalidTableNameError(f"table {table!r}: SQLite tables take a plain name")
    return sql.replace("{table}", table).replace("{prefix}", index_prefix(table))


@functools.cache
def _raw_queries(dialect: Dialect, kind: Kind) -> dict[str, str]:
    text = _read(dialect, "queries.sql", kind)
    names = _QUERY_HEADER.findall(text)
    bodies = _QUERY_HEADER.split(text)[2::2]
    # Comments go: a placeholder mentioned in a comment would count as a parameter.
    return {name: _uncommented(body).rstrip(";") for name, body in zip(names, bodies, strict=True)}


def _uncommented(body: str) -> str:
    lines = (line for line in body.splitlines() if not line.lstrip().startswith("--"))
    return "\n".join(lines).strip()


@functools.cache
def queries(dialect: Dialect, table: str, kind: Kind = "outbox") -> dict[str, str]:
    """The named queries of `dialect`, rendered for `table`."""
    raw = _raw_queries(dialect, kind)
    return {name: render(sql, table, dialect) for name, sql in raw.items()}


def schema(dialect: Dialect, table: str, kind: Kind = "outbox") -> str:
    """The full, current DDL for `dialect` (its schema.sql), rendered for `table`: what
    the migrations build, as tests/migration holds them to."""
    return render(_read(dialect, "schema.sql", kind), table, dialect)


_FUNCTION = re.compile(r"^CREATE (?:OR REPLACE )?FUNCTION ([\w.]+)\(", re.MULTILINE)


def functions(dialect: Dialect, table: str, kind: Kind = "outbox") -> list[str]:
    """The functions the schema of `dialect` creates for `table` (PostgreSQL's; none
    elsewhere): what dropping a table's objects must drop besides its tables."""
    return _FUNCTION.findall(schema(dialect, table, kind))


_CREATED = re.compile(r"^\s*CREATE (TABLE|TYPE) (?:IF NOT EXISTS )?([\w.]+)", re.MULTILINE)


def drops(dialect: Dialect, table: str, kind: Kind = "outbox") -> list[str]:
    """Statements that drop what the migrations of `table` created, and its record of
    them: the tables (the latest first), then PostgreSQL's functions and types."""
    created = [
        found for _version, _name, script in migrations(dialect, table, kind)
        for found in _CREATED.findall(script)
    ]  # fmt: skip
    tables = [name for what, name in created if what == "TABLE"]
    found = [f"DROP TABLE IF EXISTS {name}" for name in reversed(tables)]
    found.append(f"DROP TABLE IF EXISTS {validate_table_name(table)}_migrations")
    found += [f"DROP FUNCTION IF EXISTS {name}" for name in functions(dialect, table, kind)]
    found += [f"DROP TYPE IF EXISTS {name}" for what, name in created if what == "TYPE"]
    return found


def migrations(dialect: Dialect, table: str, kind: Kind = "outbox") -> list[tuple[int, str, str]]:
    """(version, name, rendered SQL) for every migration of `dialect`, in order."""
    folder = _folder(dialect, kind).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = _MIGRATION_FILE.match(entry.name)
        if match:
            found.append(
                (int(match[1]), match[2], render(entry.read_text("utf-8"), table, dialect))
            )
    return sorted(found)


#: `<table>_migrations`: one row per applied migration, for `relaybox migrate` and
#: for the Django app's migrations alike, so that either can take over from the other.
_TRACKING: dict[Dialect, str] = {
    "postgresql": "CREATE TABLE IF NOT EXISTS {table}_migrations (version integer PRIMARY KEY, "
    "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
    "mysql": "CREATE TABLE IF NOT EXISTS {table}_migrations (version INT PRIMARY KEY, "
    "name VARCHAR(255) NOT NULL, applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6))",
    "sqlite": "CREATE TABLE IF NOT EXISTS {table}_migrations (version INTEGER PRIMARY KEY, "
    "name TEXT NOT NULL, applied_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
}
#: Records one applied migration; the caller appends its driver's two placeholders.
RECORD_MIGRATION = "INSERT INTO {table}_migrations (version, name) VALUES "
MIGRATED_VERSIONS = "SELECT version FROM {table}_migrations"


def tracking(dialect: Dialect, table: str) -> str:
    """The DDL of `table`'s migration tracking table (created if missing)."""
    return render(_TRACKING[dialect], table, dialect)


def migration_lock(table: str) -> str:
    """The name of the lock that serialises migrations of `table` (a PostgreSQL advisory
    lock on its hash, a MySQL named lock)."""
    return f"relaybox_migrate:{table}"


def statements(script: str) -> list[str]:
    """Split a DDL script on `;` at line ends, keeping `$$`-quoted bodies whole."""
    found, current, quoted = [], [], False
    for line in script.splitlines():
        if not quoted and line.lstrip().startswith("--"):
            continue
        current.append(line)
        quoted ^= line.count("$$") % 2 == 1
        if not quoted and line.rstrip().endswith(";"):
            found.append("\n".join(current).strip().removesuffix(";").strip())
            current = []
    found.append("\n".join(current).strip())
    return [statement for statement in found if statement]
