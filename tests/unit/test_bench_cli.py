from __future__ import annotations

import contextlib
import importlib.util
import json
import sqlite3
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

import relaybox.relay.engine
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


PG_BENCH_URL = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"


def _pg_tables(stem: str) -> list[str]:
    import psycopg

    with psycopg.connect(PG_BENCH_URL.replace("postgresql", "postgres"), autocommit=True) as conn:
        found = conn.execute(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE %s", [stem + "%"]
        )
        return [name for (name,) in found]


def _pg_functions(stem: str) -> list[str]:
    """Functions the migrations made for tables named from `stem` (their prefix)."""
    import psycopg

    with psycopg.connect(PG_BENCH_URL.replace("postgresql", "postgres"), autocommit=True) as conn:
        found = conn.execute("SELECT proname FROM pg_proc WHERE proname LIKE %s", [stem + "%"])
        return [name for (name,) in found]


def test_bench_runs_relay_processes_cold_and_warm_watching_their_stream() -> None:
    table = f"bench_cross_{uuid.uuid4().hex[:8]}"
    args = ["bench", "--db", PG_BENCH_URL, "--broker", REDIS_URL, "--messages", "300",
            "--paced-seconds", "1", "--idle-seconds", "0", "--rate", "50", "--table", table,
            "--cross-process", "--cold", "--relays", "2", "--skip-raw"]  # fmt: skip

    result = CliRunner().invoke(main, args)

    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    fresh, truncated = report["cold"]["fresh_table"], report["cold"]["truncated_table"]
    for cold in (fresh, truncated):
        assert cold["fill"]["vacuum_analyze"] is False
        assert cold["drain"]["messages"] == 300
        assert cold["drain"]["relays"] == 2
        assert cold["drain"]["relay_exit_codes"] == [0, 0]  # stopped by PID, gracefully
    assert fresh["drain"]["table_at_start"]["analyzed"] is False
    warm = report["drain"]
    assert warm["table_at_start"]["analyzed"] is True
    assert warm["msg_per_s"] > 0
    assert warm["all_settled_seconds"] >= warm["seconds"] >= warm["first_confirm_seconds"]
    assert report["drains"]["warm_msg_per_s"] == warm["msg_per_s"]
    assert report["drains"]["cold_fresh_table_msg_per_s"] == fresh["drain"]["msg_per_s"]
    assert report["fill"]["writer"] == "a process of its own"
    # The relays start from byte-compiled modules, as an installed relaybox does.
    assert report["byte_compiled"] is True
    source = Path(relaybox.relay.engine.__file__)
    compiled = Path(importlib.util.cache_from_source(str(source)))
    assert compiled.stat().st_mtime >= source.stat().st_mtime
    paced = report["paced"]
    assert paced["messages"] == 50
    assert 0 < paced["commit_to_confirm"]["p50_ms"] <= paced["commit_to_confirm"]["max_ms"]
    assert _pg_tables(table) == []


def test_bench_times_relay_processes_publishing_nowhere_to_the_last_settle() -> None:
    """With a noop broker there is no stream to watch: the drain ends when the table
    holds no live row, and there is no paced phase to time."""
    table = f"bench_noop_{uuid.uuid4().hex[:8]}"
    # Batches of 100: the drain settles fifty times, so the relay works after its first.
    args = ["bench", "--db", PG_BENCH_URL, "--messages", "5000", "--batch-size", "100",
            "--paced-seconds", "0", "--idle-seconds", "0", "--table", table,
            "--cross-process", "--cold", "--skip-raw"]  # fmt: skip

    result = CliRunner().invoke(main, args)

    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for drain in (report["cold"]["fresh_table"]["drain"], report["drain"]):
        assert drain["messages"] == 5000
        assert drain["seconds"] == drain["all_settled_seconds"] > 0
        assert drain["first_confirm_seconds"] is None
        assert drain["relay_exit_codes"] == [0]
        assert drain["relay_event_loops"] == ["uvloop"]  # as `relaybox relay` runs by default
        # The relays' CPU from their first settle on: their start (imports) left out.
        assert 0 < drain["first_settle_seconds"] < drain["all_settled_seconds"]
        assert 0 < drain["relay_cpu_us_per_message_after_first_settle"] < 1e6
        # From the relay running: its start left out, its first (cold) read kept in.
        assert 0 < drain["relay_start_seconds"] < drain["first_settle_seconds"]
        assert drain["msg_per_s"] < drain["msg_per_s_from_running"]
        assert drain["msg_per_s_from_running"] < drain["msg_per_s_after_first_settle"]
    assert report["paced"] is None
    assert _pg_tables(table) == []
    assert _pg_functions(table) == []  # the heartbeat, claim and read functions too


def test_cold_bench_drains_a_never_analyzed_table_in_process() -> None:
    table = f"bench_cold_{uuid.uuid4().hex[:8]}"
    args = ["bench", "--db", PG_BENCH_URL, "--messages", "200", "--paced-seconds", "0.5",
            "--idle-seconds", "0", "--rate", "20", "--table", table, "--cold",
            "--skip-raw"]  # fmt: skip

    result = CliRunner().invoke(main, args)

    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["cold"]["fresh_table"]["drain"]["table_at_start"]["analyzed"] is False
    assert report["cold"]["truncated_table"]["drain"]["messages"] == 200
    assert report["drain"]["table_at_start"]["analyzed"] is True
    assert _pg_tables(table) == []


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--cross-process"], "--broker redis://"),
        (["--cross-process", "--paced-seconds", "1"], "--paced-seconds 0"),
        (["--relays", "2"], "--cross-process"),
        (["--cold"], "postgresql://"),
    ],
)
def test_bench_refuses_what_it_cannot_measure(tmp_path: Path, extra: list[str], says: str) -> None:
    args = ["bench", "--db", f"sqlite:///{tmp_path / 'bench.db'}", "--messages", "10", *extra]

    result = CliRunner().invoke(main, args)

    assert result.exit_code != 0
    assert says in result.output
    assert not (tmp_path / "bench.db").exists() or not _sqlite_tables(tmp_path / "bench.db")


def _sqlite_tables(path: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(path)) as connection:
        return [name for (name,) in connection.execute("SELECT name FROM sqlite_master")]
