"""MariaDB: every hot statement of the relay finds its rows by index whatever the
optimizer last knew of the tables.

MariaDB plans each statement afresh (relaybox's drivers send text, no prepared plan is
kept), from what InnoDB's and its own engine-independent statistics say of the tables;
those can be far from the truth: an outbox analyzed while it was empty and filled since
(it then believes a walk of the table costs nothing), or a partitions table last
analyzed while no relay held any (it then puts the partitions outside the settle's
lookup). Each hot call of the relay runs through the storage itself, on a connection of
its own (its session settings included), for the relay's default batch and for one past
the length at which MariaDB turns a list of values into a joined table, on a backlog of
ROWS rows behind RETAINED finished ones, in four states of knowledge:

- `never_analyzed`: a fresh table, the backlog written, statistics never recounted;
- `truncated`: emptied by TRUNCATE, analyzed while empty (as a periodic ANALYZE finds a
  drained outbox), and filled again; the partitions table likewise;
- `stale_partitions`: the partitions table analyzed while nobody held a partition, then
  every one taken (the outbox table analyzed);
- `analyzed`: after ANALYZE TABLE of both.

InnoDB's background recount is turned off for the test's tables, so that a state holds
while it is measured.

What is held is the work, not the time: the rows a call reads of any table (the
session's `Handler_read%` counters, before and after, in a transaction rolled back) stay
a few batches' worth, where a whole-table walk reads every row and a lookup repeated
per held partition reads the batch once per partition. The plans (ANALYZE FORMAT=JSON
of each statement the call ran) come with a failure, and none walks the outbox table
whole.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from typing import Any

import asyncmy.errors
import pymysql
import pytest

from relaybox.errors import StorageOperationalError
from relaybox.migrations import migrate
from relaybox.storage.mysql import MySQLStorage
from relaybox.storage.sql import Connection
from relaybox.storage.urls import DatabaseUrl
from tests.databases import MYSQL_URL, drop, unique_table
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

pytestmark = pytest.mark.mysql

STATES = ("never_analyzed", "analyzed", "truncated", "stale_partitions")
DRIVERS = ("aiomysql", "asyncmy")

#: Seconds a statement may run: a bad plan is stopped, not waited for.
COMMAND_TIMEOUT = 5
_SERVER_ERRORS = (pymysql.err.OperationalError, asyncmy.errors.OperationalError)

#: (state, driver, batch, call) -> the rows it read (None: out of time), its error, the
#: plans of the statements it ran.
Found = dict[tuple[str, str, int, str], dict[str, Any]]


class _Recorded(MySQLStorage):
    recorder: Recorder

    async def _open(self) -> Connection:
        self.recorder = Recorder(await super()._open())
        return self.recorder


async def _handler_reads(connection: Connection) -> int:
    """Rows this session has read through any table handler: by index, by range, by
    a walk of a table or of a temporary table."""
    rows = await connection.fetch("SHOW SESSION STATUS LIKE 'Handler_read%'", [])
    return sum(int(value) for _, value in rows)


async def _measure(storage: _Recorded, name: str, seqs: list[int]) -> dict[str, Any]:
    """Run a call in a transaction rolled back: the rows it read, and the plan of each
    statement it ran (each run again under ANALYZE, rolled back too). A call that
    runs out of time reads no count: its plans are the optimizer's alone (EXPLAIN)."""
    await storage._run(lambda session: asyncio.sleep(0))  # connected
    recorder = storage.recorder
    recorder.ran.clear()
    before = await _handler_reads(recorder.inner)
    read: int | None = None
    error = None
    try:
        await CALLS[name](storage, seqs)
        read = await _handler_reads(recorder.inner) - before
    except StorageOperationalError as exc:  # out of time: the storage dropped the connection
        error = str(exc)
    finally:
        await recorder.rollback()
    await storage._run(lambda session: asyncio.sleep(0))
    inner = storage.recorder.inner
    plans: list[Any] = []
    for query, args in recorder.ran:
        await inner.begin()
        try:
            explain = "EXPLAIN" if error else "ANALYZE"
            plans.append(
                json.loads((await inner.fetch(f"{explain} FORMAT=JSON {query}", args))[0][0])
            )
        except _SERVER_ERRORS as exc:  # out of time: shown with the plans
            plans.append(str(exc))
        finally:
            await inner.rollback()
    return {"rows_read": read, "error": error, "plans": plans}


def _admin() -> pymysql.connections.Connection[Any]:
    return pymysql.connect(
        host="127.0.0.1", port=3306, user="root", password="", database="test", autocommit=True
    )


def _fill(table: str) -> None:
    """RETAINED published rows, then ROWS rows of KEYS keys in turn, all due; the oldest
    LEASED of those leased under TOKEN."""
    digits = " UNION ALL ".join(f"SELECT {n} AS n" for n in range(10))
    with _admin() as conn, conn.cursor() as cursor:
        for rows in (RETAINED, ROWS):
            cursor.execute(
                f"INSERT INTO {table} (id, target, topic, `key`, `partition`, type, content_type,"
                " payload, occurred_at)"
                " SELECT UUID(), 'default', 't', CONCAT('k', g MOD %s),"
                " CRC32(CONCAT('k', g MOD %s)) & 2147483647, 'x', 'application/json',"
                " REPEAT('x', 100), UTC_TIMESTAMP(6)"
                " FROM (SELECT a.n * 10000 + b.n * 1000 + c.n * 100 + d.n * 10 + e.n + 1 AS g"
                f" FROM ({digits}) a, ({digits}) b, ({digits}) c, ({digits}) d, ({digits}) e) AS x"
                " WHERE g <= %s ORDER BY g",
                (KEYS, KEYS, rows),
            )
            if rows == RETAINED:
                cursor.execute(
                    f"UPDATE {table} SET status = 'published', published_at = UTC_TIMESTAMP(6)"
                )
        cursor.execute(
            f"UPDATE {table} SET status = 'processing', locked_by = 'w2', lock_token = %s,"
            " locked_until = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE status = 'pending'"
            " ORDER BY seq LIMIT %s",
            (TOKEN, LEASED),
        )


def _partitions(table: str, *, analyze: str = "") -> None:
    """Every partition held by WORKER; the table analyzed first while it was `empty` or
    while its rows were `unowned`, if asked."""
    with _admin() as conn, conn.cursor() as cursor:
        cursor.execute(f"DELETE FROM {table}_partitions")
        if analyze == "empty":
            _run_all(cursor, [_analyze(f"{table}_partitions")])
        cursor.execute(
            f"INSERT INTO {table}_partitions (target, `partition`)"
            f" SELECT 'default', p FROM JSON_TABLE(%s, '$[*]' COLUMNS (p INT PATH '$')) AS j",
            (json.dumps(list(range(PARTITIONS))),),
        )
        if analyze == "unowned":
            _run_all(cursor, [_analyze(f"{table}_partitions")])
        cursor.execute(
            f"UPDATE {table}_partitions"
            " SET owner = %s, lease_until = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR",
            (WORKER,),
        )


def _admin_run(*statements: str) -> None:
    with _admin() as conn, conn.cursor() as cursor:
        _run_all(cursor, statements)


def _run_all(cursor: Any, statements: Sequence[str]) -> None:
    for statement in statements:
        cursor.execute(statement)
        cursor.fetchall()


def _analyze(table: str) -> str:
    """InnoDB's statistics and MariaDB's own (engine-independent: histograms included)."""
    return f"ANALYZE TABLE {table} PERSISTENT FOR ALL"


def _seqs(table: str) -> list[int]:
    with _admin() as conn, conn.cursor() as cursor:
        cursor.execute(
            f"SELECT seq FROM {table} WHERE status <> 'published' ORDER BY seq LIMIT %s",
            (max(BATCHES),),
        )
        return [int(s) for (s,) in cursor.fetchall()]


async def _measure_all(table: str, found: Found, state: str) -> None:
    seqs = _seqs(table)
    for driver in DRIVERS:
        url = DatabaseUrl.parse(
            MYSQL_URL.replace("mysql://", f"mysql+{driver}://")
            + f"?command_timeout={COMMAND_TIMEOUT}"
        )
        storage = await _Recorded.connect(url, table=table)
        try:
            for batch in BATCHES:
                for name in CALLS:
                    found[state, driver, batch, name] = await _measure(storage, name, seqs[:batch])
        finally:
            await storage.close()


async def _collect(table: str) -> Found:
    found: Found = {}
    await migrate(MYSQL_URL, table=table)
    # Statistics change only when the test says: InnoDB's recount in the background
    # would otherwise end a state in the middle of its measurements.
    _admin_run(
        f"ALTER TABLE {table} STATS_AUTO_RECALC = 0",
        f"ALTER TABLE {table}_partitions STATS_AUTO_RECALC = 0",
    )
    _partitions(table)
    _fill(table)
    await _measure_all(table, found, "never_analyzed")
    _admin_run(_analyze(table), _analyze(f"{table}_partitions"))
    await _measure_all(table, found, "analyzed")
    # Emptied, and analyzed while empty (as a periodic ANALYZE finds a drained outbox, or
    # a fresh deploy's), then filled again.
    _admin_run(f"TRUNCATE TABLE {table}", _analyze(table))
    _partitions(table, analyze="empty")
    _fill(table)
    await _measure_all(table, found, "truncated")
    _admin_run(_analyze(table))
    _partitions(table, analyze="unowned")
    await _measure_all(table, found, "stale_partitions")
    return found


@pytest.fixture(scope="module")
def plans() -> Iterator[Found]:
    table = unique_table("plan")
    try:
        yield asyncio.run(_collect(table))
    finally:
        drop(MYSQL_URL, table)


def _tables(plan: Any) -> Iterator[dict[str, Any]]:
    """Every table access of an ANALYZE FORMAT=JSON plan."""
    if isinstance(plan, dict):
        if "table_name" in plan and "access_type" in plan:
            yield plan
        for value in plan.values():
            yield from _tables(value)
    elif isinstance(plan, list):
        for value in plan:
            yield from _tables(value)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("name", list(CALLS))
def test_a_hot_statement_touches_a_small_part_of_the_table(
    plans: Found, name: str, state: str, batch: int, driver: str
) -> None:
    found = plans[state, driver, batch, name]
    shown = json.dumps(found["plans"], indent=1)
    # A batch, its window and the earlier rows of its keys: a few batches' worth, where
    # a whole-table walk reads every row and a lookup repeated per held partition reads
    # the batch PARTITIONS times.
    assert found["error"] is None, shown
    assert all(isinstance(plan, dict) for plan in found["plans"]), shown
    assert found["rows_read"] <= 10 * batch, shown
    # Whole walks only of what is small by nature: the JSON array of failures, the
    # partitions table.
    for table in _tables(found["plans"]):
        if table["access_type"] in ("ALL", "index"):
            assert "table_function" in table or table["table_name"].endswith("_partitions"), shown


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_relay_session_plans_by_its_queries_alone(driver: str) -> None:
    """On MariaDB, a list of seqs stays a list, and the column statistics an ANALYZE ...
    PERSISTENT collected are not read (they priced a walk of the table as nothing, and
    cost seconds of planning): what the storage's connection runs with."""
    table = unique_table("plan")
    await migrate(MYSQL_URL, table=table)
    try:
        url = DatabaseUrl.parse(MYSQL_URL.replace("mysql://", f"mysql+{driver}://"))
        storage = await _Recorded.connect(url, table=table)
        try:
            await storage._run(lambda session: asyncio.sleep(0))
            inner = storage.recorder.inner
            ((server,),) = await inner.fetch("SELECT VERSION()", [])
            if "mariadb" not in str(server).lower():
                pytest.skip("MariaDB's settings")
            ((threshold, statistics),) = await inner.fetch(
                "SELECT @@in_predicate_conversion_threshold, @@use_stat_tables", []
            )
        finally:
            await storage.close()
    finally:
        drop(MYSQL_URL, table)
    assert (int(threshold), statistics) == (0, "NEVER")
