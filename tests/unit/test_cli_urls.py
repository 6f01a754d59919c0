"""Where the commands take database and broker URLs from: options, environment, files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from relaybox.cli.main import main


class Stop(Exception):
    pass


@pytest.fixture
def relay_args(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """What `relaybox relay` hands the Relay it builds (which then stops the command)."""
    from relaybox.cli import relay as command

    seen: list[tuple[Any, ...]] = []

    def capture(databases: Any, brokers: Any, **_kwargs: object) -> None:
        seen.append((databases, brokers))
        raise Stop

    monkeypatch.setattr(command, "Relay", capture)
    return seen


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_relay_combines_options_and_files(tmp_path: Path, relay_args: list[Any]) -> None:
    db = _file(tmp_path, "db", "postgresql://relay:pw@db/shop\n")
    hook = _file(tmp_path, "hook", "  https://hooks.example/in?secret=s\n\n")
    args = ["relay", "--db", "memory://", "--db-file", db, "--broker", "a=noop://",
            "--broker-file", f"b={hook}"]  # fmt: skip
    result = CliRunner().invoke(main, args, env={"RELAYBOX_DB": "", "RELAYBOX_BROKER": ""})
    assert isinstance(result.exception, Stop), result.output
    assert relay_args == [
        (
            ["memory://", "postgresql://relay:pw@db/shop"],
            {"a": "noop://", "b": "https://hooks.example/in?secret=s"},
        )
    ]


def test_the_environment_counts_only_without_options(tmp_path: Path, relay_args: list[Any]) -> None:
    env = {"RELAYBOX_DB": "memory:// memory://", "RELAYBOX_BROKER": "a=noop:// b=memory://"}
    from_env = CliRunner().invoke(main, ["relay"], env=env)
    db = _file(tmp_path, "db", "memory://")
    hook = _file(tmp_path, "hook", "noop://")
    from_files = CliRunner().invoke(
        main, ["relay", "--db-file", db, "--broker-file", f"c={hook}"], env=env
    )
    assert isinstance(from_env.exception, Stop), from_env.output
    assert isinstance(from_files.exception, Stop), from_files.output
    assert relay_args == [
        (["memory://", "memory://"], {"a": "noop://", "b": "memory://"}),
        (["memory://"], {"c": "noop://"}),
    ]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "give a database"),
        (["--db", "memory://"], "give a broker"),
        (["--db", "memory://", "--broker", "a=noop://", "--broker-file", "a={file}"],
         "names target 'a' twice"),
        (["--db-file", "{missing}", "--broker", "a=noop://"], "cannot read a URL"),
        (["--db-file", "{two}", "--broker", "a=noop://"], "must hold one URL"),
        (["--db", "memory://", "--broker-file", "{file}"], "NAME=PATH"),
    ],
)  # fmt: skip
def test_the_relay_says_what_is_missing_or_wrong(
    tmp_path: Path, relay_args: list[Any], args: list[str], said: str
) -> None:
    paths = {
        "file": _file(tmp_path, "url", "noop://"),
        "two": _file(tmp_path, "two", "postgresql://u:Sekr3t@a/x\npostgresql://u:Sekr3t@b/x"),
        "missing": str(tmp_path / "missing"),
    }
    result = CliRunner().invoke(
        main, ["relay", *(a.format(**paths) for a in args)],
        env={"RELAYBOX_DB": "", "RELAYBOX_BROKER": ""},
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert said in result.output
    assert "Sekr3t" not in result.output  # a file's content is never echoed
    assert relay_args == []


def test_a_single_database_command_takes_a_file_over_the_environment(tmp_path: Path) -> None:
    db = tmp_path / "shop.db"
    url = _file(tmp_path, "db", f"sqlite:///{db}\n")
    env = {"RELAYBOX_DB": "oracle://nowhere"}
    migrated = CliRunner().invoke(main, ["migrate", "--db-file", url], env=env)
    both = CliRunner().invoke(main, ["status", "--db", "memory://", "--db-file", url])
    assert migrated.exit_code == 0, migrated.output
    assert db.exists()
    assert both.exit_code == 2
    assert "give one database" in both.output
