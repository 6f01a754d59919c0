"""SQLite: every hot statement of the relay finds its rows by index whatever the planner
last knew of the tables.

SQLite's planner knows a table by what ANALYZE last wrote in sqlite_stat1, read when a
connection opens; without it, it assumes a large table. Each hot call of the relay runs
through the storage itself, for the relay's default batch and a larger one, on a backlog
of ROWS rows behind RETAINED finished ones (which stay in the outbox table), in four
states of knowledge:

- `never_analyzed`: a fresh file, the backlog written, never analyzed;
- `truncated`: analyzed while the outbox held a handful of rows (a drained outbox),
  emptied (DELETE without WHERE, SQLite's truncate) and filled again; the partitions
  table likewise;
- `stale_partitions`: the partitions table analyzed while nobody held a partition, then
  every one taken (the outbox table analyzed);
- `analyzed`: after ANALYZE.

What is held is the work, not the time, on the same SQLite library the storage's driver
runs (aiosqlite runs the standard library's sqlite3): each statement a call ran is run
again, on a connection of its own, in a transaction rolled back. Its plan (EXPLAIN QUERY
PLAN) walks the outbox table nowhere, but for the read's and the claim's window, which
walks the live index in seq order up to its limit; and its virtual machine steps
(counted by a progress handler) stay those of walking a few rows of the table per row
of the batch, where a lookup repeated per held partition, or a walk of the failures per
row, needs many times more.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from relaybox.errors import StorageOperationalError
from relaybox.migrations import migrate
from relaybox.storage.sql import Connection
from relaybox.storage.sqlite import SQLiteStorage
from tests.databases import sqlite_url
from tests.integration.plan_support import (
    BATCHES,
    CALLS,
    KEYS,
    LEASED,
    PARTITIONS,
    RETAINED,
    ROWS,
    TOKEN,
    WORKER,
    Recorder,
)

#: Rows in the outbox when it is analyzed in the `truncated` state: so few that a walk of
#: the table looks cheaper to the planner than a lookup per row of a batch.
SMALL = 5
TABLE = "plan_outbox"
_LIVE = f"{TABLE}_live_ix"
_OUTBOX_WALK = re.compile(rf"SCAN ({TABLE}|o|h|e)\b")
STATES = ("never_analyzed", "analyzed", "truncated", "stale_partitions")
#: Steps between two calls of the progress handler.
STEP = 100
#: (state, batch, call) -> each statement it ran: its plan and its steps.
Found = dict[tuple[str, int, str], list[dict[str, Any]]]


class _Recorded(SQLiteStorage):
    recorder: Recorder

    async def _open(self) -> Connection:
        self.recorder = Recorder(await super()._open())
        return self.recorder


def _connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def _plan(lite: sqlite3.Connection, query: str, args: Sequence[Any]) -> list[str]:
    return [str(row[3]) for row in lite.execute(f"EXPLAIN QUERY PLAN {query}", args)]


def _steps(lite: sqlite3.Connection, query: str, args: Sequence[Any], cap: int) -> int:
    """The virtual machine steps of a statement, run to its end (or stopped past `cap`
    steps) and rolled back."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += STEP
        return int(steps > cap)

    lite.execute("BEGIN IMMEDIATE")
    lite.set_progress_handler(count, STEP)
    try:
        lite.execute(query, args).fetchall()
    except sqlite3.OperationalError:  # stopped
        assert steps > cap
    finally:
        lite.set_progress_handler(None, STEP)
        if lite.in_transaction:  # a statement stopped rolls its transaction back
            lite.execute("ROLLBACK")
    return steps


async def _measure(
    storage: _Recorded, path: Path, name: str, seqs: list[int], walk: int
) -> list[Any]:
    """Run a call in a transaction rolled back (or stopped, out of time); then each
    statement it ran again, on a connection of its own, for its plan and its steps (up
    to a few walks of the table)."""
    await storage._run(lambda session: asyncio.sleep(0))  # connected
    recorder = storage.recorder
    recorder.ran.clear()
    with contextlib.suppress(StorageOperationalError):
        try:
            await CALLS[name](storage, seqs)
        finally:
            await recorder.rollback()
    with contextlib.closing(_connect(path)) as lite:
        return [
            {"plan": _plan(lite, query, args), "steps": _steps(lite, query, args, 3 * walk)}
            for query, args in recorder.ran
        ]


def _fill(lite: sqlite3.Connection, table: str, rows: int, retained: int = RETAINED) -> None:
    """`retained` published rows, then `rows` rows of KEYS keys in turn, all due; the
    oldest LEASED of those leased under TOKEN."""
    _insert(lite, table, retained)
    lite.execute(
        f"UPDATE {table} SET status = 'published',"
        " published_at = strftime('%Y-%m-%d %H:%M:%f', 'now')"
    )
    _insert(lite, table, rows)
    lite.execute(
        f"UPDATE {table} SET status = 'processing', locked_by = 'w2', lock_token = ?,"
        " locked_until = strftime('%Y-%m-%d %H:%M:%f', 'now', '+1 hour')"
        f" WHERE seq IN (SELECT seq FROM {table} WHERE status = 'pending' ORDER BY seq LIMIT ?)",
        (TOKEN, LEASED),
    )


def _insert(lite: sqlite3.Connection, table: str, rows: int) -> None:
    lite.execute(
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?)"
        f' INSERT INTO {table} (id, target, topic, "key", "partition", type, content_type,'
        " payload, occurred_at)"
        " SELECT lower(hex(randomblob(16))), 'default', 't', 'k' || (n % ?),"
        " ((n % ?) * 2654435761) % 2147483647, 'x', 'application/json', zeroblob(100),"
        " strftime('%Y-%m-%d %H:%M:%f', 'now')"
        " FROM g",
        (rows, KEYS, KEYS),
    )


def _partitions(lite: sqlite3.Connection, table: str, *, analyze: str = "") -> None:
    """Every partition held by WORKER; the table analyzed first, if asked, while it held
    two (`small`) or every one, held by nobody (`unowned`)."""
    if analyze:
        _create_partitions(lite, table, 2 if analyze == "small" else PARTITIONS)
        lite.execute(f"ANALYZE {table}_partitions")
    _create_partitions(lite, table, PARTITIONS)
    lite.execute(
        f"UPDATE {table}_partitions SET owner = ?,"
        " lease_until = strftime('%Y-%m-%d %H:%M:%f', 'now', '+1 hour')",
        (WORKER,),
    )


def _create_partitions(lite: sqlite3.Connection, table: str, count: int) -> None:
    lite.execute(f"DELETE FROM {table}_partitions")
    lite.execute(
        "WITH RECURSIVE g(p) AS (SELECT 0 UNION ALL SELECT p + 1 FROM g WHERE p + 1 < ?)"
        f" INSERT INTO {table}_partitions (target, \"partition\") SELECT 'default', p FROM g",
        (count,),
    )


def _walk(lite: sqlite3.Connection, table: str) -> int:
    """The steps of one walk of the whole outbox table, reading a column of each row."""
    query = f"SELECT count(*) FROM {table} NOT INDEXED WHERE attempts >= 0"
    return _steps(lite, query, (), cap=2**62)


async def _measure_all(path: Path, table: str, found: Found, state: str) -> None:
    with contextlib.closing(_connect(path)) as lite:
        query = f"SELECT seq FROM {table} WHERE status <> 'published' ORDER BY seq LIMIT ?"
        seqs = [s for (s,) in lite.execute(query, (max(BATCHES),))]
        walk = _walk(lite, table)
    storage = await _Recorded.connect(f"{sqlite_url(path)}?command_timeout=5", table=table)
    try:
        for batch in BATCHES:
            for name in CALLS:
                found[state, batch, name] = await _measure(storage, path, name, seqs[:batch], walk)
    finally:
        await storage.close()


async def _collect(path: Path, table: str) -> Found:
    found: Found = {}
    await migrate(sqlite_url(path), table=table)
    with contextlib.closing(_connect(path)) as lite:
        _partitions(lite, table)
        _fill(lite, table, ROWS)
    await _measure_all(path, table, found, "never_analyzed")
    with contextlib.closing(_connect(path)) as lite:
        lite.execute("ANALYZE")
    await _measure_all(path, table, found, "analyzed")
    with contextlib.closing(_connect(path)) as lite:
        lite.execute(f"DELETE FROM {table}")
        _fill(lite, table, SMALL, retained=0)
        lite.execute(f"ANALYZE {table}")
        lite.execute(f"DELETE FROM {table}")
        _partitions(lite, table, analyze="small")
        _fill(lite, table, ROWS)
    await _measure_all(path, table, found, "truncated")
    with contextlib.closing(_connect(path)) as lite:
        lite.execute(f"ANALYZE {table}")
        _partitions(lite, table, analyze="unowned")
    await _measure_all(path, table, found, "stale_partitions")
    return found


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> tuple[Found, int]:
    """What each call ran, and the steps of one walk of the whole outbox table."""
    path = tmp_path_factory.mktemp("plans") / "outbox.db"
    table = TABLE
    found = asyncio.run(_collect(path, table))
    with contextlib.closing(_connect(path)) as lite:
        walk = _walk(lite, table)
    return found, walk


def _walks(name: str, plan: list[str]) -> list[str]:
    """The plan's walks of the outbox table (by its name or an alias), but the read's and
    the claim's: theirs is the live index, in seq order, up to their limit."""
    window = name in ("read", "claim")
    return [
        line for line in plan
        if _OUTBOX_WALK.match(line) and not (window and line.endswith("USING INDEX " + _LIVE))
    ]  # fmt: skip


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("name", list(CALLS))
def test_a_hot_statement_touches_a_small_part_of_the_table(
    plans: tuple[Found, int], name: str, state: str, batch: int
) -> None:
    found, walk = plans
    ran = found[state, batch, name]
    shown = "\n".join(f"{s['steps']} steps\n  " + "\n  ".join(s["plan"]) for s in ran)
    assert ran, name
    for statement in ran:
        assert not _walks(name, statement["plan"]), shown
    # The work of a batch: as much as walking a hundred and fifty rows of the table per
    # row of the batch. A lookup repeated once per held partition, or a walk of the
    # failures once per row, does many times more.
    per_row = walk / (ROWS + RETAINED)
    assert sum(s["steps"] for s in ran) <= 150 * per_row * batch, shown
