from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from relaybox import sql
from relaybox.cli.main import main


def test_schema_prints_ddl_for_each_dialect() -> None:
    runner = CliRunner()
    for dialect in ("postgresql", "mysql", "sqlite"):
        result = runner.invoke(main, ["schema", "--dialect", dialect, "--table", "shop_outbox"])
        assert result.exit_code == 0, result.output
        assert "CREATE TABLE IF NOT EXISTS shop_outbox" in result.output


def test_python_dash_m_relaybox_is_the_command(tmp_path: Path) -> None:
    """`python -m relaybox` runs the same command, where its script is not on PATH."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "relaybox", "migrate", "--db", url],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m.db").exists()
    usage = subprocess.run(
        [sys.executable, "-m", "relaybox", "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert usage.returncode == 0
    assert usage.stdout.startswith("Usage: relaybox ")


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


def test_inbox_tables_migrate_and_print_from_the_command_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    first = CliRunner().invoke(main, ["migrate", "--db", url, "--inbox"])
    again = CliRunner().invoke(main, ["migrate", "--db", url, "--inbox"])
    outbox = CliRunner().invoke(main, ["migrate", "--db", url])
    assert first.exit_code == 0, first.output
    assert "relaybox_inbox on" in first.output
    assert "applied 0001" in first.output
    latest = sql.migrations("sqlite", "relaybox_inbox", "inbox")[-1][0]
    assert f"up to date at version {latest}" in again.output
    assert "relaybox_outbox on" in outbox.output  # a separate set of tables and versions
    printed = CliRunner().invoke(main, ["schema", "--dialect", "mysql", "--inbox"])
    assert "CREATE TABLE IF NOT EXISTS relaybox_inbox_watermarks" in printed.output


def test_migrate_reports_bad_urls() -> None:
    result = CliRunner().invoke(main, ["migrate", "--db", "oracle://nowhere"])
    assert result.exit_code != 0
    assert "unsupported database URL scheme" in result.output


def test_demo_runs_on_embedded_nats_and_stops_it() -> None:
    before = _nats_servers()
    result = CliRunner().invoke(main, ["demo", "--orders", "60", "--rate", "500"])
    assert result.exit_code == 0, result.output
    assert "demo OK" in result.output
    summary = json.loads(result.output[result.output.index("{") : result.output.rindex("}") + 1])
    assert summary["lost"] == summary["ghosts"] == 0
    assert summary["received"] == summary["events committed"] > 0
    assert summary["read back from"] == "the broker, by a consumer"
    assert _nats_servers() == before  # the embedded server is gone


def test_demo_can_use_another_broker(tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    result = CliRunner().invoke(main, ["demo", "--orders", "30", "--broker", f"file://{out}"])
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    summary = json.loads(result.output[result.output.index("{") : result.output.rindex("}") + 1])
    assert len(lines) == summary["events committed"] == summary["received"]


def _nats_servers() -> set[int]:
    """The nats-server processes this test process started (other tests, running at
    the same time in other processes, start their own)."""
    found = set()
    for status in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            name, _, rest = status.read_text().rpartition(")")  # "pid (comm) state ppid ..."
            if name.endswith("(nats-server") and int(rest.split()[1]) == os.getpid():
                found.add(int(status.parent.name))
    return found


def test_relay_options_default_to_the_settings_objects_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`relaybox relay` with no tuning option runs with RelaySettings() as it is: the
    command repeats no default of its own."""
    from relaybox.cli import relay as command
    from relaybox.relay import RelaySettings

    built: list[RelaySettings] = []

    class Stop(Exception):
        pass

    def capture(*_args: object, settings: RelaySettings, **_kwargs: object) -> None:
        built.append(settings)
        raise Stop

    monkeypatch.setattr(command, "Relay", capture)
    result = CliRunner().invoke(main, ["relay", "--db", "memory://", "--broker", "d=noop://"])
    assert isinstance(result.exception, Stop), result.output
    assert built == [RelaySettings()]


def test_relay_fast_poll_options_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from relaybox.cli import relay as command
    from relaybox.relay import RelaySettings

    built: list[RelaySettings] = []

    class Stop(Exception):
        pass

    def capture(*_args: object, settings: RelaySettings, **_kwargs: object) -> None:
        built.append(settings)
        raise Stop

    monkeypatch.setattr(command, "Relay", capture)
    args = ["relay", "--db", "memory://", "--broker", "d=noop://",
            "--fast-poll-window", "0.5", "--fast-poll-interval", "0.002"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert isinstance(result.exception, Stop), result.output
    assert (built[0].fast_poll_window, built[0].fast_poll_interval) == (0.5, 0.002)
    result = CliRunner().invoke(main, [*args[:5], "--fast-poll-window", "0"])
    assert built[1].fast_poll_window == 0


def test_importing_relaybox_or_running_a_relay_loads_no_tool() -> None:
    """The bench, its raw broker loops, the demo and the embedded NATS server are tools:
    neither `import relaybox` nor `relaybox relay --help` imports them."""
    probe = (
        "import sys, relaybox; from click.testing import CliRunner;"
        "from relaybox.cli.main import main;"
        "assert CliRunner().invoke(main, ['relay', '--help']).exit_code == 0;"
        "print(sorted(m for m in sys.modules if m.startswith('relaybox.tools')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]"


def test_printable_escapes_what_a_terminal_would_act_on() -> None:
    from relaybox.cli.output import printable

    assert printable("\x1b]0;pwn\x07\x1b[2J") == "\\x1b]0;pwn\\x07\\x1b[2J"
    assert printable("a\nb\r\tc\x00\x7f\x9b\x85") == "a\\nb\\r\\tc\\x00\\x7f\\x9b\\x85"
    bidi = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
    assert printable(bidi) == "".join(f"\\u{ord(c):04x}" for c in bidi)
    assert printable("\u2028\u2029\U000e0001") == "\\u2028\\u2029\\U000e0001"
    assert printable("Zürich 東京 🚚 \\x1b") == "Zürich 東京 🚚 \\x1b"  # shown as they are
    assert printable(None) == "None"


def test_every_command_prints_through_the_escaping_output() -> None:
    """What a command prints goes through relaybox.cli.output, which escapes stored
    content: no module of the command line writes to the terminal any other way."""
    import ast

    import relaybox.cli

    forbidden = {"echo", "secho", "print", "ClickException", "stdout", "stderr"}
    found = []
    for path in Path(relaybox.cli.__file__).parent.glob("*.py"):
        if path.name == "output.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if name in forbidden:
                found.append(f"{path.name}:{node.lineno} {name}")  # type: ignore[attr-defined]
    assert found == []
