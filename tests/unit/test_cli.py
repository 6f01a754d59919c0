from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from relaybox import sql
from relaybox.cli import main


def test_schema_prints_ddl_for_each_dialect() -> None:
    runner = CliRunner()
    for dialect in ("postgresql", "mysql", "sqlite"):
        result = runner.invoke(main, ["schema", "--dialect", dialect, "--table", "shop_outbox"])
        assert result.exit_code == 0, result.output
        assert "CREATE TABLE IF NOT EXISTS shop_outbox" in result.output


def test_schema_rejects_a_bad_table_name() -> None:
    result = CliRunner().invoke(main, ["schema", "--dialect", "sqlite", "--table", "x; drop"])
    assert result.exit_code != 0
    assert "invalid table name" in result.output


def test_migrate_is_idempotent_from_the_command_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    first = CliRunner().invoke(main, ["migrate", "--db", url])
    second = CliRunner().invoke(main, ["migrate", "--db", url])
    assert first.exit_code == 0
    assert "applied 0001" in first.output
    assert second.exit_code == 0
    latest = sql.migrations("sqlite", "relaybox_outbox")[-1][0]
    assert f"up to date at version {latest}" in second.output


def test_migrate_reports_bad_urls() -> None:
    result = CliRunner().invoke(main, ["migrate", "--db", "oracle://nowhere"])
    assert result.exit_code != 0
    assert "unsupported database URL scheme" in result.output


def test_demo_runs_and_checks_itself() -> None:
    result = CliRunner().invoke(main, ["demo", "--orders", "60"])
    assert result.exit_code == 0, result.output
    assert "demo OK" in result.output
    assert "lost                 0" in result.output
