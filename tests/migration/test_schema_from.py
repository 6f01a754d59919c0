"""`relaybox schema --from VERSION`: the SQL a team that runs its own scripts applies to
a table at VERSION, which leaves it as `relaybox migrate` would, record included."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from relaybox import sql
from relaybox.cli.main import main
from relaybox.migrations import migrate
from tests.databases import PG_URL, drop, sqlite_url, unique_table
from tests.migration.test_migrations import _catalog


def _schema_from(dialect: str, table: str, after: int) -> str:
    args = ["schema", "--dialect", dialect, "--table", table, "--from", str(after)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.output


def _run_script(dialect: str, db: Path, script: str) -> None:
    """Run `script` as a team would: psql -f, sqlite3 < file."""
    if dialect == "postgresql":
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(script.encode())
    else:
        with contextlib.closing(sqlite3.connect(db)) as lite:
            lite.executescript(script)


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
async def test_the_sql_after_a_version_brings_a_table_to_the_latest_schema(
    dialect: sql.Dialect, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    url = PG_URL if dialect == "postgresql" else sqlite_url(db)
    table, reference = unique_table("sfr"), unique_table("sfm")
    latest = sql.migrations(dialect, table)[-1][0]
    try:
        _run_script(dialect, db, _schema_from(dialect, table, 0).split("-- migration 0002")[0])
        middle = _schema_from(dialect, table, 1)
        assert "-- migration 0001" not in middle
        assert "-- migration 0002" in middle
        _run_script(dialect, db, middle)
        assert (await migrate(url, table=table)).applied == ()
        await migrate(url, table=reference)
        assert _catalog(dialect, table, db, "outbox") == _catalog(dialect, reference, db, "outbox")
        assert "-- migration" not in _schema_from(dialect, table, latest)
    finally:
        drop(url, table)
        drop(url, reference)


def test_a_version_beyond_the_latest_is_refused() -> None:
    latest = sql.migrations("sqlite", "t")[-1][0]
    result = CliRunner().invoke(main, ["schema", "--dialect", "sqlite", "--from", str(latest + 1)])
    assert result.exit_code != 0
    assert f"knows outbox versions up to {latest}" in result.output
