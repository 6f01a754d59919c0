"""Shared bits for the benchmarks: machine description, PostgreSQL URL, table setup."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

PG_URL = os.environ.get("RELAYBOX_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")


def machine() -> dict[str, object]:
    try:
        server = subprocess.run(
            ["psql", "-h", "127.0.0.1", "-U", "postgres", "-Atc", "SHOW server_version", "test"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout.strip()
    except OSError:
        server = "?"
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "postgresql": server,
    }


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process so far (Linux /proc), 0 if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def padding_to_match(conn: Any, outbox: str, plain: str) -> bytes:
    """Bytes that pad the plain table's row to the outbox table's, each holding one row
    (in the caller's transaction): "same-sized" is measured, not guessed."""
    sizes = conn.execute(
        f"SELECT (SELECT pg_column_size(t.*) FROM {outbox} t),"
        f" (SELECT pg_column_size(t.*) FROM {plain} t)"
    ).fetchone()
    assert sizes is not None
    return b"p" * max(0, int(sizes[0]) - int(sizes[1]))
