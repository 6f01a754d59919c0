from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path

from click.testing import CliRunner

from relaybox.cli.main import main


def test_bench_drains_and_times_a_small_sqlite_outbox(tmp_path: Path) -> None:
    db = tmp_path / "bench.db"
    args = ["bench", "--db", f"sqlite:///{db}", "--messages", "300", "--paced-seconds", "1",
            "--idle-seconds", "1", "--rate", "50", "--table", "bench_cli"]  # fmt: skip

    result = CliRunner().invoke(main, args)

    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["database"]["dialect"] == "sqlite"
    assert report["broker"] == "noop://"
    assert report["fill"]["messages"] == 300
    assert report["drain"]["messages"] == 300
    assert report["drain"]["msg_per_s"] > 0
    assert report["idle"]["queries_per_s"] is None  # no server counters on SQLite
    paced = report["paced"]
    assert paced["messages"] == 50
    assert 0 < paced["commit_to_confirm"]["p50_ms"] <= paced["commit_to_confirm"]["p99_ms"]
    assert paced["commit_to_confirm"]["p99_ms"] <= paced["commit_to_confirm"]["max_ms"]
    assert report["raw"] is None
    assert report["relay_vs_raw"] is None
    with contextlib.closing(sqlite3.connect(db)) as connection:
        tables = connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        assert [name for (name,) in tables if "bench_cli" in name] == []  # all dropped
