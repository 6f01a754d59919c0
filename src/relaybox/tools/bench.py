"""`relaybox bench`: the relay's drain rate, commit-to-publish latency, idle load and WAL.

On a fresh table it creates (and drops at the end, also on failure):

1. fill: N messages, keys round-robin, written in chunks of 1000 (VACUUM ANALYZE after,
   on PostgreSQL, so every drain starts from the same state);
2. drain: a relay starts and publishes them; timed until the publisher confirmed all N,
   then stopped, so that its commits can be counted exactly;
3. idle: a second relay with nothing to do: database transactions per second;
4. paced: a writer in this process commits one message per transaction at a fixed
   rate, announcing each commit to the relay (`Relay.attach`); latency is from the
   writer's commit returning to the publisher's confirm returning;
5. raw (PostgreSQL): the fastest plain claim-and-delete loop on the same table, the
   ceiling the relay is compared with.

With --cold (PostgreSQL), two drains come first, each by a fresh relay on a backlog
that was never vacuumed or analyzed: one on the freshly migrated table, one after
TRUNCATE. That is how a new deployment or a table emptied by hand starts, and the
planner then knows nothing of the table; the warm drain's VACUUM ANALYZE hides it.
`drains` puts every drain rate of the run beside the raw limit.

With --cross-process (bench_cross.py), the writers and the relays (`relaybox relay`,
--relays of them) run in processes of their own, as users run them, and the bench
watches the Redis stream the relays publish to. relaybox's modules are byte-compiled
first (`byte_compiled` in the report), as an installed package's are, so a process
started from a checkout does not compile them at every start.

Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import sqlite3
import sys
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import click

from relaybox import sql
from relaybox.core.identifiers import validate_table_name
from relaybox.core.message import DEFAULT_TARGET, Message
from relaybox.core.payload import encode_payload
from relaybox.core.records import Routing
from relaybox.core.urls import mask_url, without_secrets
from relaybox.errors import RelayboxError
from relaybox.migrations import migrate
from relaybox.ports import Publisher
from relaybox.publishers import open_publisher
from relaybox.publishers.recording import ConfirmRecorder
from relaybox.relay.engine import Relay
from relaybox.relay.settings import RelaySettings
from relaybox.storage import open_storage
from relaybox.storage.urls import DatabaseUrl
from relaybox.tools import bench_raw
from relaybox.writer.outbox import Outbox

DEFAULT_DB = "postgresql://postgres@127.0.0.1:5432/test"
FILL_CHUNK = 1000
POLL_SECONDS = 0.005
#: A PostgreSQL backend publishes its statistics at most once a second (15 has no
#: pg_stat_force_next_flush) and when it exits; counters are read this long after.
STATS_FLUSH_SECONDS = 1.1
IDLE_SETTLE_SECONDS = 2.0
#: An idle PostgreSQL backend publishes its pending statistics only after 10 s, so the
#: set-up transactions of a relay connection that then stays idle (the one that
#: settles) land up to 10 s late: the idle window starts after that.
PG_IDLE_FLUSH_SECONDS = 10.5
#: Paced phase: connections the writer spreads its commits over (SQLite: one, since it
#: has a single write lock), so a commit that waits for the disk delays no other send.
PACED_WRITERS = 4
#: Give up when the relay confirms nothing new for this long.
STALL_SECONDS = 60.0
SIDE_TABLES = (
    "migrations", "key_locks", "partitions", "members", "done", "audit", "backfills",
    "activity", "relay_status",
)  # fmt: skip
RAW_COLUMNS = (
    "seq, id, target, external, topic, key, partition, type, content_type, payload, "
    "headers::text, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at, "
    "attempts"
)
#: PostgreSQL's outbox table holds live rows only (finished ones move to its `_done`
#: table), so the raw loop takes the oldest rows without filtering on status.
RAW_CLAIM = (
    "DELETE FROM {table} WHERE seq IN (SELECT seq FROM {table} ORDER BY seq LIMIT $1 "
    "FOR UPDATE SKIP LOCKED) RETURNING " + RAW_COLUMNS
)
IDLE_NOTE = (
    "xact_commit + xact_rollback of the measured database ({readings}). The relay runs "
    "autocommit statements, so a claim or a settle is one transaction; a partition "
    "heartbeat is one transaction of several statements. Other sessions on the same "
    "database count too: compare relay_counted_per_s (claims and heartbeats the relay "
    "counted itself)."
)
DRAIN_NOTE = (
    "WAL: server-wide LSN difference from relay start to its last settle (other "
    "databases' writes included); wal_this_database: only records of this database and "
    "their transactions (pg_walinspect), null if it is not installed there. Commits: "
    "xact_commit of this database over the same span, read after the relay stopped (a "
    "backend publishes its statistics when it exits), less the stopping relay's own; "
    "they include the relay's connection set-up (a few per connection)."
)


@dataclasses.dataclass(frozen=True, slots=True)
class BenchOptions:
    db: str
    broker: str
    messages: int
    batch_size: int
    max_in_flight: int | None
    rate: float
    paced_seconds: float
    idle_seconds: float
    keys: int
    payload_bytes: int
    skip_raw: bool
    table: str
    topic: str = "bench"
    #: Lease each row (`relaybox relay --no-partition-leases`) instead of partitions.
    row_leases: bool = False
    #: Writers and relays in processes of their own (bench_cross.py).
    cross_process: bool = False
    #: Drain a fresh and a truncated table first, neither vacuumed nor analyzed.
    cold: bool = False
    #: Relay processes that drain together (cross-process only).
    relays: int = 1


# -- the database side ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Reading:
    """PostgreSQL counters at one moment, and how many statements the bench had run."""

    lsn: int
    commits: int
    rollbacks: int
    own_statements: int


class Writer(Protocol):
    async def write(self, outbox: Outbox, message: Message) -> None:
        """Add `message` in a transaction of its own and commit it."""

    async def close(self) -> None: ...


class Admin(Protocol):
    """The bench's side of a database: version, maintenance, writers, clean-up."""

    async def version(self) -> str: ...
    async def exists(self, table: str) -> bool: ...
    async def vacuum(self, table: str) -> None: ...
    async def writer(self) -> Writer: ...
    async def drop(self, table: str) -> None: ...
    async def close(self) -> None: ...


def _side_tables(table: str) -> list[str]:
    return [table, *(f"{table}_{suffix}" for suffix in SIDE_TABLES)]


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) + int(low, 16)


class PostgresAdmin:
    """The bench's PostgreSQL side, over asyncpg.

    The counters are read from another database of the server (`postgres`) where it
    can connect there, so the readings never count themselves (otherwise they are read
    in the measured database and subtracted, which is approximate). Everything the bench
    does in the measured database runs on short-lived connections: a backend publishes
    its statistics at most once a second, and an idle one only every 10 s, but always
    when it exits, so a closed connection's transactions are never counted late.
    """

    _READING = (
        "SELECT pg_current_wal_lsn()::text, xact_commit, xact_rollback "
        "FROM pg_stat_database WHERE datname = $1"
    )
    _LSN = "SELECT pg_current_wal_lsn()::text"
    #: WAL records touching this database's relations, plus the other records (commits)
    #: of the transactions that wrote them: (all bytes, bytes of full-page images).
    _WAL_HERE = """
        WITH r AS (
            SELECT xid::text AS xid, record_length, fpi_length, block_ref
            FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)
        ), here AS (
            SELECT DISTINCT xid FROM r WHERE block_ref LIKE $3 AND xid <> '0'
        )
        SELECT coalesce(sum(record_length), 0), coalesce(sum(fpi_length), 0) FROM r
        WHERE block_ref LIKE $3 OR xid IN (SELECT xid FROM here)"""

    def __init__(self, url: DatabaseUrl, stats: Any, *, elsewhere: bool) -> None:
        self.url = url
        self._stats = stats
        #: True when the counters are read from another database than the measured one.
        self.elsewhere = elsewhere
        self.statements = 0

    @classmethod
    async def connect(cls, url: DatabaseUrl) -> PostgresAdmin:
        import asyncpg

        try:
            stats = await asyncpg.connect(url.libpq_dsn(), database="postgres")
            elsewhere = url.database != "postgres"
        except Exception:  # noqa: BLE001 - no access there: read (and subtract) here
            stats, elsewhere = await asyncpg.connect(url.libpq_dsn()), False
        admin = cls(url, stats, elsewhere=elsewhere)
        if elsewhere and not await stats.fetchval(
            "SELECT count(*) FROM pg_database WHERE datname = $1", url.database
        ):
            await stats.close()
            raise RelayboxError(
                f"database {url.database!r} does not exist; create it first "
                f"(createdb {url.database}), or point --db at one that does"
            )
        await admin.reading()  # asyncpg prepares on first use: one transaction more
        await admin.wal_lsn()
        return admin

    async def session(self) -> Any:
        """A new asyncpg connection to the measured database."""
        import asyncpg

        return await asyncpg.connect(self.url.libpq_dsn())

    async def _in_database(self, query: str, *args: Any) -> Any:
        """Run `query` in the measured database on a connection of its own."""
        connection = await self.session()
        try:
            return await connection.fetchrow(query, *args)
        finally:
            await connection.close()

    async def version(self) -> str:
        self.statements += 1
        return str(await self._stats.fetchval("SHOW server_version"))

    async def reading(self) -> Reading:
        """The counters now; `own_statements` is what to subtract for the readings."""
        own = 0 if self.elsewhere else self.statements
        self.statements += 1
        lsn, commits, rollbacks = await self._stats.fetchrow(self._READING, self.url.database)
        return Reading(_lsn(lsn), int(commits), int(rollbacks), own)

    async def wal_lsn(self) -> int:
        self.statements += 1
        return _lsn(await self._stats.fetchval(self._LSN))

    async def wal_here(self, start: int, end: int) -> dict[str, Any] | None:
        """WAL of the measured database alone between two LSNs, if pg_walinspect is
        installed in it (the LSN difference counts every database of the server)."""
        installed = "SELECT count(*) FROM pg_extension WHERE extname = 'pg_walinspect'"
        if not (await self._in_database(installed))[0]:
            return None
        oid = "SELECT oid FROM pg_database WHERE datname = current_database()"
        pattern = f"%rel %/{(await self._in_database(oid))[0]}/%"
        total, images = await self._in_database(self._WAL_HERE, start, end, pattern)
        return {"bytes": int(total), "full_page_image_bytes": int(images)}

    async def exists(self, table: str) -> bool:
        return bool((await self._in_database("SELECT to_regclass($1) IS NOT NULL", table))[0])

    async def vacuum(self, table: str) -> None:
        await self._in_database(f"VACUUM ANALYZE {table}")

    async def truncate(self, table: str) -> None:
        await self._in_database(f"TRUNCATE {table}, {table}_done")

    async def table_state(self, table: str) -> dict[str, Any]:
        """Whether the table was ever vacuumed or analyzed (autovacuum included), and
        what the planner believes of its size."""
        row = await self._in_database(self._TABLE_STATE, table)
        return {"analyzed": bool(row[0]), "vacuumed": bool(row[1]),
                "planner_reltuples": float(row[2]),
                "rows_changed_since_analyze": int(row[3])}  # fmt: skip

    _TABLE_STATE = """
        SELECT coalesce(last_analyze, last_autoanalyze) IS NOT NULL,
               coalesce(last_vacuum, last_autovacuum) IS NOT NULL,
               c.reltuples, s.n_mod_since_analyze
        FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
        WHERE s.relid = $1::regclass"""

    async def writer(self) -> Writer:
        return AsyncpgWriter(await self.session())

    async def drop(self, table: str) -> None:
        await self._in_database(f"DROP TABLE IF EXISTS {', '.join(_side_tables(table))}")
        for function in sql.functions("postgresql", table):
            await self._in_database(f"DROP FUNCTION IF EXISTS {function}")
        await self._in_database(f"DROP TYPE IF EXISTS {table}_status")

    async def close(self) -> None:
        await self._stats.close()


class AsyncpgWriter:
    def __init__(self, connection: Any) -> None:
        self._connection = connection

    async def write(self, outbox: Outbox, message: Message) -> None:
        async with self._connection.transaction():
            await outbox.add_async(self._connection, message)

    async def close(self) -> None:
        await self._connection.close()


class SQLiteAdmin:
    def __init__(self, url: DatabaseUrl) -> None:
        self.url = url

    async def version(self) -> str:
        return sqlite3.sqlite_version

    async def exists(self, table: str) -> bool:
        import aiosqlite

        query = "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?"
        async with aiosqlite.connect(self.url.database) as connection:
            rows = await connection.execute_fetchall(query, (table,))
        return bool(next(iter(rows))[0])

    async def vacuum(self, table: str) -> None:
        return None

    async def writer(self) -> Writer:
        import aiosqlite

        connection = await aiosqlite.connect(self.url.database, isolation_level=None)
        await connection.execute("PRAGMA busy_timeout = 5000")
        return AiosqliteWriter(connection)

    async def drop(self, table: str) -> None:
        import aiosqlite

        async with aiosqlite.connect(self.url.database, isolation_level=None) as connection:
            for name in _side_tables(table):
                await connection.execute(f"DROP TABLE IF EXISTS {name}")

    async def close(self) -> None:
        return None


class AiosqliteWriter:
    def __init__(self, connection: Any) -> None:
        self._connection = connection

    async def write(self, outbox: Outbox, message: Message) -> None:
        await self._connection.execute("BEGIN IMMEDIATE")
        try:
            await outbox.add_async(self._connection, message)
        except BaseException:
            await self._connection.execute("ROLLBACK")
            raise
        await self._connection.execute("COMMIT")

    async def close(self) -> None:
        await self._connection.close()


async def _aiomysql(url: DatabaseUrl, *, autocommit: bool) -> Any:
    import aiomysql

    return await aiomysql.connect(
        host=url.host or "127.0.0.1", port=url.port or 3306, user=url.user or "root",
        password=url.password or "", db=url.database, autocommit=autocommit,
    )  # fmt: skip


class MySQLAdmin:
    def __init__(self, url: DatabaseUrl, connection: Any) -> None:
        self.url = url
        self._connection = connection

    @classmethod
    async def connect(cls, url: DatabaseUrl) -> MySQLAdmin:
        return cls(url, await _aiomysql(url, autocommit=True))

    async def _run(self, query: str, args: Sequence[Any] = ()) -> Any:
        with warnings.catch_warnings():  # DROP ... IF EXISTS notes about missing tables
            warnings.simplefilter("ignore")
            async with self._connection.cursor() as cursor:
                await cursor.execute(query, tuple(args) or None)
                return await cursor.fetchone()

    async def exists(self, table: str) -> bool:
        query = (
            "SELECT count(*) FROM information_schema.tables "
            "WHERE table_schema = DATABASE() AND table_name = %s"
        )
        return bool((await self._run(query, [table]))[0])

    async def version(self) -> str:
        return str((await self._run("SELECT VERSION()"))[0])

    async def vacuum(self, table: str) -> None:
        return None

    async def writer(self) -> Writer:
        return AiomysqlWriter(await _aiomysql(self.url, autocommit=False))

    async def drop(self, table: str) -> None:
        await self._run(f"DROP TABLE IF EXISTS {', '.join(_side_tables(table))}")

    async def close(self) -> None:
        self._connection.close()


class AiomysqlWriter:
    def __init__(self, connection: Any) -> None:
        self._connection = connection

    async def write(self, outbox: Outbox, message: Message) -> None:
        await self._connection.begin()
        try:
            await outbox.add_async(self._connection, message)
        except BaseException:
            await self._connection.rollback()
            raise
        await self._connection.commit()

    async def close(self) -> None:
        self._connection.close()


async def connect_admin(url: DatabaseUrl) -> Admin:
    if url.dialect == "sqlite":
        return SQLiteAdmin(url)
    if url.dialect not in ("postgresql", "mysql"):
        raise RelayboxError(f"relaybox bench needs PostgreSQL, MySQL or SQLite, not {url.masked}")
    try:
        if url.dialect == "postgresql":
            return await PostgresAdmin.connect(url)
        return await MySQLAdmin.connect(url)
    except Exception as exc:  # noqa: BLE001 - refused, auth, unknown database: say which and why
        error = RelayboxError(f"cannot connect to {url.masked}: {exc}")
        error = without_secrets(error, exc, url.secrets)  # a driver may quote the password
        raise error from error.__cause__


# -- measuring helpers ----------------------------------------------------------------


def _rate(count: float, seconds: float) -> float | None:
    return round(count / seconds, 1) if seconds > 0 else None


def _per(value: float, count: int, digits: int = 4) -> float | None:
    return round(value / count, digits) if count else None


def percentiles(samples: Sequence[float]) -> dict[str, float | None]:
    """Nearest-rank percentiles of `samples` (seconds), in milliseconds."""
    ordered = sorted(samples)

    def rank(p: float) -> float | None:
        if not ordered:
            return None
        return round(ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)] * 1000, 3)

    return {"p50_ms": rank(50), "p95_ms": rank(95), "p99_ms": rank(99), "max_ms": rank(100),
            "min_ms": round(ordered[0] * 1000, 3) if ordered else None}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class CpuMark:
    """Machine-wide jiffies from /proc/stat (if there is one) and this process's CPU time."""

    total: int
    idle: int
    steal: int
    process: float
    wall: float

    @classmethod
    def now(cls) -> CpuMark:
        try:
            with open("/proc/stat", encoding="ascii") as stat:
                fields = [int(v) for v in stat.readline().split()[1:9]]
        except (OSError, ValueError):
            fields = []
        fields += [0] * (8 - len(fields))
        return cls(sum(fields), fields[3] + fields[4], fields[7],
                   time.process_time(), time.perf_counter())  # fmt: skip

    def usage(self) -> dict[str, float | None]:
        """Since this mark: the machine's busy and steal shares (every process counts,
        so other work on the machine shows here) and this process's share of one CPU."""
        end = CpuMark.now()
        total, wall = end.total - self.total, end.wall - self.wall
        busy = total - (end.idle - self.idle) - (end.steal - self.steal)
        return {
            "machine_busy_percent": _share(busy, total),
            "machine_steal_percent": _share(end.steal - self.steal, total),
            "bench_process_percent": _share(end.process - self.process, wall),
        }


def _share(part: float, whole: float) -> float | None:
    return round(100 * part / whole, 1) if whole > 0 else None


async def _until(count: Callable[[], int], target: int, what: str) -> None:
    """Poll `count()` every few ms until it reaches `target`; fail if it stalls."""
    last, changed = count(), time.monotonic()
    while (now := count()) < target:
        if now != last:
            last, changed = now, time.monotonic()
        elif time.monotonic() - changed > STALL_SECONDS:
            raise RelayboxError(f"{what}: stuck at {now} of {target} for {STALL_SECONDS:.0f} s")
        await asyncio.sleep(POLL_SECONDS)


@dataclasses.dataclass(frozen=True, slots=True)
class Activity:
    """What the relay counted itself, summed over its processors."""

    claims: int
    heartbeats: int
    settled: int

    @classmethod
    def of(cls, relay: Relay) -> Activity:
        metrics = relay.metrics().values()
        return cls(sum(m.claims for m in metrics), sum(m.heartbeats for m in metrics),
                   sum(m.published + m.failed + m.abandoned for m in metrics))  # fmt: skip

    def transactions_since(self, earlier: Activity) -> int:
        return self.claims - earlier.claims + self.heartbeats - earlier.heartbeats


def progress(text: str) -> None:
    click.echo(f"[bench] {text}", err=True)


# -- the phases -----------------------------------------------------------------------


class Workload:
    """The messages the bench writes: keys round-robin, JSON payloads of a fixed size."""

    def __init__(self, options: BenchOptions) -> None:
        self.keys = options.keys
        self.topic = options.topic
        template, _ = encode_payload({"n": "0" * 9, "pad": ""}, None)
        self.pad = "x" * max(0, options.payload_bytes - len(template))
        self.routing = Routing.of(None, None)

    def message(self, n: int) -> Message:
        return Message(topic=self.topic, key=f"k{n % self.keys}",
                       payload={"n": f"{n:09d}", "pad": self.pad})  # fmt: skip


async def fill(
    options: BenchOptions, admin: Admin, workload: Workload, *, analyze: bool = True
) -> dict[str, Any]:
    """Write the backlog from this process; VACUUM ANALYZE it after if `analyze`."""
    result = await write_backlog(options, workload)
    if analyze:
        await admin.vacuum(options.table)
    return result


async def write_backlog(options: BenchOptions, workload: Workload) -> dict[str, Any]:
    storage = await open_storage(options.db, table=options.table)
    started = time.perf_counter()
    try:
        for first in range(0, options.messages, FILL_CHUNK):
            last = min(options.messages, first + FILL_CHUNK)
            batch = [workload.message(n) for n in range(first, last)]
            await storage.write(workload.routing.rows(batch))
    finally:
        await storage.close()
    seconds = time.perf_counter() - started
    return {"messages": options.messages, "seconds": round(seconds, 3),
            "msg_per_s": _rate(options.messages, seconds)}  # fmt: skip


async def drain(options: BenchOptions, admin: Admin) -> dict[str, Any]:
    """Start a relay on the filled table, time it to the last confirm, then stop it, so
    its commits can be counted exactly (a stopped backend has flushed its statistics)."""
    recorder = ConfirmRecorder(open_publisher(options.broker))
    relay = new_relay(options, recorder)
    pg = admin if isinstance(admin, PostgresAdmin) else None
    if pg is not None:
        await asyncio.sleep(STATS_FLUSH_SECONDS)  # let earlier sessions' counts land first
    before = await pg.reading() if pg is not None else None
    cpu, started = CpuMark.now(), time.perf_counter()
    try:
        await relay.start()
        startup = time.perf_counter() - started
        await _until(lambda: recorder.confirmed, options.messages, "drain")
        seconds, usage = time.perf_counter() - started, cpu.usage()
        await _until(lambda: Activity.of(relay).settled, options.messages, "drain settle")
        settled, done = time.perf_counter() - started, Activity.of(relay)
        lsn = await pg.wal_lsn() if pg is not None else 0
    finally:
        await relay.stop()
    result: dict[str, Any] = {
        "messages": options.messages, "seconds": round(seconds, 3),
        "msg_per_s": _rate(options.messages, seconds),
        "relay_start_seconds": round(startup, 3), "all_settled_seconds": round(settled, 3),
        "claims": done.claims, "cpu": usage,
    }  # fmt: skip
    if pg is not None and before is not None:
        after_stop = Activity.of(relay).transactions_since(done) + _LEAVE_TRANSACTIONS
        result.update(await _drain_costs(pg, before, lsn, after_stop, options.messages))
    return result


#: A stopping relay gives back its partitions in one transaction.
_LEAVE_TRANSACTIONS = 1


async def _drain_costs(
    pg: PostgresAdmin, before: Reading, lsn: int, after_drain: int, messages: int
) -> dict[str, Any]:
    """WAL from before the relay started to its last settle; commits likewise, less the
    bench's own readings and the `after_drain` transactions of the stopping relay."""
    await asyncio.sleep(STATS_FLUSH_SECONDS)
    after = await pg.reading()
    own = after.own_statements - before.own_statements
    commits = after.commits - before.commits - own - after_drain
    return {
        **await wal_report(pg, before.lsn, lsn, messages),
        "commits": commits, "commits_per_message": _per(commits, messages, 5),
        "rollbacks": after.rollbacks - before.rollbacks, "note": DRAIN_NOTE,
    }  # fmt: skip


async def wal_report(pg: PostgresAdmin, start: int, end: int, messages: int) -> dict[str, Any]:
    """WAL between two LSNs: the whole server's, and this database's if it can tell."""
    here = await pg.wal_here(start, end)
    if here is not None:
        here["bytes_per_message"] = _per(here["bytes"], messages, 1)
    return {"wal_bytes": end - start, "wal_bytes_per_message": _per(end - start, messages, 1),
            "wal_this_database": here}  # fmt: skip


def _idle_note(pg: PostgresAdmin | None) -> str:
    if pg is None:
        return "no server counters on this database"
    if pg.elsewhere:
        return IDLE_NOTE.format(readings="read from the postgres database, so not counted")
    return IDLE_NOTE.format(readings="the bench's own readings subtracted")


async def idle(
    options: BenchOptions, admin: Admin, relay: Relay, relay_started: float
) -> dict[str, Any]:
    pg = admin if isinstance(admin, PostgresAdmin) else None
    settle = IDLE_SETTLE_SECONDS if pg is None else PG_IDLE_FLUSH_SECONDS
    await asyncio.sleep(max(IDLE_SETTLE_SECONDS, relay_started + settle - time.perf_counter()))
    before = await pg.reading() if pg is not None else None
    activity, started = Activity.of(relay), time.perf_counter()
    await asyncio.sleep(options.idle_seconds)
    after = await pg.reading() if pg is not None else None
    seconds = time.perf_counter() - started
    counted = Activity.of(relay)
    claims, heartbeats = counted.claims - activity.claims, counted.heartbeats - activity.heartbeats
    database: dict[str, Any] = {"transactions": None, "rollbacks": None}
    if before is not None and after is not None:
        own = after.own_statements - before.own_statements
        database["transactions"] = (
            after.commits + after.rollbacks - before.commits - before.rollbacks - own
        )
        database["rollbacks"] = after.rollbacks - before.rollbacks
    total = database["transactions"]
    return {
        "seconds": round(seconds, 3),
        "queries_per_s": _rate(total, seconds) if total is not None else None, **database,
        "relay_claims": claims, "relay_heartbeats": heartbeats,
        "relay_counted_per_s": _rate(claims + heartbeats, seconds),
        "note": _idle_note(pg),
    }  # fmt: skip


class PacedWriter:
    """Commits one message per transaction when its time comes (start + n / rate), on
    whichever of a few connections is free, so one slow commit does not hold back the
    next send; records when each commit returned and announces it to the relay."""

    def __init__(
        self, outbox: Outbox, writers: Sequence[Writer], rate: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:  # fmt: skip
        self.outbox = outbox
        self.rate = rate
        self.clock = clock
        self.committed: dict[uuid.UUID, float] = {}
        self.max_lag = 0.0
        self._free: asyncio.Queue[Writer] = asyncio.Queue()
        for writer in writers:
            self._free.put_nowait(writer)

    async def run(self, messages: Sequence[Message]) -> float:
        """Send them all; the seconds from the first deadline to the last commit."""
        started = time.perf_counter()
        sends: list[asyncio.Task[None]] = []
        try:
            for n, message in enumerate(messages):
                deadline = started + n / self.rate
                if (wait := deadline - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                sends.append(asyncio.create_task(self._send(message, deadline)))
            await asyncio.gather(*sends)
        finally:
            for send in sends:
                send.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
        return time.perf_counter() - started

    async def _send(self, message: Message, deadline: float) -> None:
        writer = await self._free.get()
        try:
            self.max_lag = max(self.max_lag, time.perf_counter() - deadline)
            await writer.write(self.outbox, message)
            self.committed[message.id] = self.clock()
            self.outbox.committed([message])
        finally:
            self._free.put_nowait(writer)


async def paced(
    options: BenchOptions, admin: Admin, relay: Relay, recorder: ConfirmRecorder,
    workload: Workload,
) -> dict[str, Any]:  # fmt: skip
    outbox = Outbox(table=options.table, notify=False)
    relay.attach(outbox)
    count = max(1, round(options.rate * options.paced_seconds))
    messages = [workload.message(options.messages + n) for n in range(count)]
    confirmed: dict[uuid.UUID, float] = {}
    recorder.on_confirmed = lambda acked, now: confirmed.update((m.id, now) for m in acked)
    connections = 1 if isinstance(admin, SQLiteAdmin) else PACED_WRITERS
    writers = [await admin.writer() for _ in range(connections)]
    cpu = CpuMark.now()
    try:
        sender = PacedWriter(outbox, writers, options.rate)
        seconds = await sender.run(messages)
    finally:
        for writer in writers:
            await writer.close()
    await _until(lambda: len(confirmed), count, "paced")
    recorder.on_confirmed = None
    latencies = [confirmed[m.id] - sender.committed[m.id] for m in messages]
    return {
        "messages": count, "writer_connections": connections, "target_rate": options.rate,
        "achieved_rate": _rate(count, seconds), "max_send_lag_ms": round(sender.max_lag * 1000, 3),
        "commit_to_confirm": percentiles(latencies), "cpu": cpu.usage(),
    }  # fmt: skip


async def raw_limit(options: BenchOptions, pg: PostgresAdmin, workload: Workload) -> dict[str, Any]:
    """The plain claim-and-delete loop, on 1 then on 2 connections, after a refill each."""
    await fill(options, pg, workload)
    start = await pg.wal_lsn()
    one = await _raw_drain(options, pg, connections=1)
    wal = await wal_report(pg, start, await pg.wal_lsn(), options.messages)
    await fill(options, pg, workload)
    two = await _raw_drain(options, pg, connections=2)
    return {
        "one_connection_msg_per_s": one, "two_connections_msg_per_s": two,
        "one_connection_wal": wal, "raw_limit_msg_per_s": max(one or 0.0, two or 0.0),
        "query": RAW_CLAIM.format(table="<table>"),
    }  # fmt: skip


async def _raw_drain(options: BenchOptions, pg: PostgresAdmin, connections: int) -> float | None:
    query = RAW_CLAIM.format(table=options.table)
    opened = [await pg.session() for _ in range(connections)]

    async def loop(connection: Any) -> int:
        drained = 0
        while rows := await connection.fetch(query, options.batch_size):
            drained += len(rows)
        return drained

    try:
        started = time.perf_counter()
        drained = sum(await asyncio.gather(*(loop(c) for c in opened)))
        seconds = time.perf_counter() - started
    finally:
        for connection in opened:
            await connection.close()
    if drained != options.messages:
        raise RelayboxError(f"raw loop drained {drained} of {options.messages} rows")
    return _rate(drained, seconds)


# -- putting it together --------------------------------------------------------------


def machine() -> dict[str, Any]:
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_at_start": [round(v, 2) for v in os.getloadavg()]}  # fmt: skip


async def run_bench(options: BenchOptions) -> dict[str, Any]:
    url = DatabaseUrl.parse(options.db)
    _check_setup(options, url)
    admin = await connect_admin(url)
    try:
        if await admin.exists(options.table):  # it would be filled, drained and dropped
            raise RelayboxError(
                f"table {options.table} already exists; relaybox bench creates and drops a "
                "table of its own: name a new one, or leave --table out"
            )
        report: dict[str, Any] = {
            "benchmark": "relaybox bench",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(map(mask_url, sys.argv)),
            "database": {"url": url.masked, "dialect": url.dialect, "table": options.table,
                         "version": await admin.version()},
            "broker": mask_url(options.broker),
            "machine": machine(),
            "settings": _settings(options, url),
        }  # fmt: skip
        raw_broker = bench_raw.module_for(options.broker)
        try:
            if raw_broker is not None:
                await raw_broker.prepare(options.broker, options.topic)
            await migrate(options.db, table=options.table)
            await _measure(options, admin, report)
        finally:
            await admin.drop(options.table)
            if raw_broker is not None:
                await raw_broker.cleanup(options.broker, options.topic)
    finally:
        await admin.close()
    return report


def _check_setup(options: BenchOptions, url: DatabaseUrl) -> None:
    """Refuse combinations that cannot be measured, before anything is created."""
    if options.cold and url.dialect != "postgresql":
        raise RelayboxError("--cold measures PostgreSQL's planner on a fresh table: use a "
                            "postgresql:// database")  # fmt: skip
    if options.relays > 1 and not options.cross_process:
        raise RelayboxError("--relays above 1 needs --cross-process (one process per relay)")
    if options.cross_process:
        from relaybox.tools import bench_cross

        bench_cross.require_watchable(options.broker, paced_seconds=options.paced_seconds)


def new_relay(options: BenchOptions, publisher: Publisher) -> Relay:
    return Relay(options.db, {DEFAULT_TARGET: publisher}, table=options.table,
                 settings=_relay_settings(options))  # fmt: skip


def _relay_settings(options: BenchOptions) -> RelaySettings:
    return RelaySettings(
        batch_size=options.batch_size,
        max_in_flight=options.max_in_flight,
        idle_interval=1.0,
        partition_leases=not options.row_leases,
    )


def _settings(options: BenchOptions, url: DatabaseUrl) -> dict[str, Any]:
    relay = _relay_settings(options)
    writer = {"postgresql": "asyncpg", "mysql": "aiomysql", "sqlite": "aiosqlite"}[url.dialect]
    settings = dataclasses.asdict(options)
    settings["db"], settings["broker"] = url.masked, mask_url(options.broker)
    settings["relay"] = {
        "batch_size": relay.batch_size,
        "max_in_flight": relay.in_flight_limit(
            url.dialect == "postgresql" and relay.partition_leases),
        "idle_interval": relay.idle_interval, "min_poll_interval": relay.min_poll_interval,
        "partitions": relay.partitions, "partition_leases": relay.partition_leases,
        "lease_seconds": relay.lease_seconds, "published_retention": relay.published_retention,
        "lifetime": "one relay for the drain, stopped after it (so its commits can be "
                    "counted exactly); a second one for idle and paced",
    }  # fmt: skip
    settings["paced_writer"] = (
        f"{writer}, one message per transaction, Outbox(notify=False); the relay is "
        "woken by Relay.attach (in-process commit announcements)"
    )
    if options.relays > 1 and relay.max_in_flight is None:
        settings["relay"]["in_flight_each"] = (
            "max_in_flight times the share of the partitions a relay holds, rounded "
            "down, at least 1"
        )
    if options.cross_process:
        settings["relay"]["lifetime"] = (
            f"`relaybox relay` processes ({options.relays} for each drain, started on the "
            "backlog and stopped by PID after it; a fresh one for idle and paced)"
        )
        settings["paced_writer"] = (
            f"{writer} in a process of its own, one message per transaction, "
            "Outbox(notify=True): the relay is woken by NOTIFY"
        )
    settings["fill"] = (
        ("a writer process" if options.cross_process else "this process")
        + ", storage.write in chunks of 1000; the warm drain's backlog is VACUUM ANALYZEd"
        + (", the cold ones' are not" if options.cold else "")
    )
    return settings


async def _measure(options: BenchOptions, admin: Admin, report: dict[str, Any]) -> None:
    workload = Workload(options)
    if options.cross_process:
        await _measure_cross(options, admin, report)
    else:
        await _measure_in_process(options, admin, workload, report)
    report["raw"] = None
    if isinstance(admin, PostgresAdmin) and not options.skip_raw:
        progress("raw claim-and-delete limit")
        report["raw"] = await raw_limit(options, admin, workload)
    raw = report["raw"]["raw_limit_msg_per_s"] if report["raw"] else None
    drained = report["drain"]["msg_per_s"]
    report["relay_vs_raw"] = round(drained / raw, 3) if raw and drained else None
    report["drains"] = _drains(report)
    if not options.skip_raw and bench_raw.module_for(options.broker) is not None:
        progress("raw publish rate of the broker's client library")
        report["broker_raw"] = await bench_raw.broker_limit(
            options.broker, options.messages, options.payload_bytes
        )
        for name in ("bare", "with_envelope"):
            limit = (report["broker_raw"] or {}).get(f"{name}_msg_per_s")
            ratio = round(drained / limit, 3) if limit and drained else None
            report[f"relay_vs_broker_raw_{name}"] = ratio


async def _measure_in_process(
    options: BenchOptions, admin: Admin, workload: Workload, report: dict[str, Any]
) -> None:
    if options.cold:

        async def cold_drain() -> dict[str, Any]:
            return await drain(options, admin)

        report["cold"] = await cold_drains(
            options, admin, lambda analyze: fill(options, admin, workload, analyze=analyze),
            cold_drain,
        )  # fmt: skip
    progress(f"filling {options.messages} messages into {options.table}")
    report["fill"] = await fill(options, admin, workload)
    progress("draining")
    report["drain"] = await _drain_state(admin, options, lambda: drain(options, admin))
    recorder = ConfirmRecorder(open_publisher(options.broker))
    relay = new_relay(options, recorder)
    started = time.perf_counter()
    await relay.start()
    try:
        progress(f"idle for {options.idle_seconds:g} s")
        report["idle"] = await idle(options, admin, relay, started)
        progress(f"paced: {options.rate:g} msg/s for {options.paced_seconds:g} s")
        report["paced"] = await paced(options, admin, relay, recorder, workload)
    finally:
        await relay.stop()


async def _measure_cross(options: BenchOptions, admin: Admin, report: dict[str, Any]) -> None:
    from relaybox.tools import bench_cross

    report["byte_compiled"] = bench_cross.byte_compile()
    watched = bench_cross.watchable(options.broker)
    watch = bench_cross.StreamWatch(options.broker, options.topic) if watched else None
    try:

        async def cross_fill(analyze: bool) -> dict[str, Any]:
            return await bench_cross.fill(options, admin, analyze=analyze)

        async def cross_drain() -> dict[str, Any]:
            return await bench_cross.drain(options, admin, watch, options.relays)

        if options.cold:
            report["cold"] = await cold_drains(options, admin, cross_fill, cross_drain)
        progress(f"filling {options.messages} messages into {options.table} (writer process)")
        report["fill"] = await cross_fill(True)
        progress(f"draining ({options.relays} relay process(es))")
        report["drain"] = await _drain_state(admin, options, cross_drain)
        report["idle"], report["paced"] = await bench_cross.idle_and_paced(options, admin, watch)
    finally:
        if watch is not None:
            await watch.reset()
            await watch.close()


Step = Callable[[], Awaitable[dict[str, Any]]]


async def cold_drains(
    options: BenchOptions, admin: Admin, fill_with: Callable[[bool], Awaitable[dict[str, Any]]],
    drain_with: Step,
) -> dict[str, Any]:  # fmt: skip
    """A fresh relay on the freshly migrated table, then on the table truncated and
    refilled; neither vacuumed nor analyzed (the warm drain that follows is both). The
    table is truncated again after, so the warm fill starts from an empty one."""
    assert isinstance(admin, PostgresAdmin)
    cold: dict[str, Any] = {}
    for name in ("fresh_table", "truncated_table"):
        if name == "truncated_table":
            await admin.truncate(options.table)
        progress(f"cold, {name.replace('_', ' ')}: filling {options.messages} messages")
        filled = await fill_with(False)
        progress(f"cold, {name.replace('_', ' ')}: draining")
        cold[name] = {"fill": filled, "drain": await _drain_state(admin, options, drain_with)}
    await admin.truncate(options.table)
    return cold


async def _drain_state(admin: Admin, options: BenchOptions, drain_with: Step) -> dict[str, Any]:
    """A drain, with what the planner knew of the table when it started (PostgreSQL)."""
    state = None
    if isinstance(admin, PostgresAdmin):
        state = await admin.table_state(options.table)
    return {**await drain_with(), "table_at_start": state}


def _drains(report: dict[str, Any]) -> dict[str, Any]:
    """Every drain rate of the run side by side with the raw limit."""
    cold = report.get("cold") or {}
    raw = report.get("raw") or {}

    def cold_rate(name: str) -> float | None:
        rate: float | None = (cold.get(name) or {}).get("drain", {}).get("msg_per_s")
        return rate

    return {
        "cold_fresh_table_msg_per_s": cold_rate("fresh_table"),
        "cold_truncated_table_msg_per_s": cold_rate("truncated_table"),
        "warm_msg_per_s": report["drain"]["msg_per_s"],
        "raw_limit_msg_per_s": raw.get("raw_limit_msg_per_s"),
        "raw_one_connection_msg_per_s": raw.get("one_connection_msg_per_s"),
    }  # fmt: skip


def _default_table() -> str:
    return f"relaybox_bench_{uuid.uuid4().hex[:8]}"


@click.command()
@click.option("--db", default=DEFAULT_DB, show_default=True, help="Database URL.")
@click.option("--broker", default="noop://", show_default=True, help="Broker URL to publish to.")
@click.option("--messages", default=100_000, show_default=True, type=click.IntRange(min=1))
@click.option("--batch-size", default=500, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    help="Batches in flight [default: the relay's, 3 on PostgreSQL, 2 elsewhere].",
)
@click.option("--rate", default=500.0, show_default=True, help="Paced phase: messages per second.",
              type=click.FloatRange(min=0, min_open=True))  # fmt: skip
@click.option("--paced-seconds", default=10.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--idle-seconds", default=10.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--keys", default=1000, show_default=True, type=click.IntRange(min=1),
              help="Distinct message keys, used round-robin.")  # fmt: skip
@click.option("--payload-bytes", default=100, show_default=True, type=click.IntRange(min=0))
@click.option("--skip-raw", is_flag=True,
              help="Skip the raw limits (claim-and-delete; the broker client alone).")  # fmt: skip
@click.option("--table", default=None, help="Table to create, then drop [default: a new one].")
@click.option(
    "--row-leases",
    is_flag=True,
    help="Relays lease each row (as with relaybox relay --no-partition-leases).",
)
@click.option(
    "--cross-process/--in-process",
    default=False,
    show_default=True,
    help="Run the writers and `relaybox relay` in processes of their own; the relays "
    "publish to --broker redis://..., whose stream the bench watches (or to noop:// "
    "with --paced-seconds 0: drains timed to the last settle).",
)
@click.option(
    "--cold/--warm",
    default=False,
    show_default=True,
    help="Also drain a fresh relay on a freshly migrated and on a truncated table, "
    "neither vacuumed nor analyzed (PostgreSQL), before the warm drain.",
)
@click.option(
    "--relays",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Relay processes draining together (with --cross-process).",
)
def bench(
    db: str, broker: str, messages: int, batch_size: int, max_in_flight: int | None,
    rate: float, paced_seconds: float, idle_seconds: float, keys: int, payload_bytes: int,
    skip_raw: bool, table: str | None, row_leases: bool, cross_process: bool, cold: bool,
    relays: int,
) -> None:  # fmt: skip
    """Measure the relay on a database: drain, idle load, latency, WAL; prints JSON."""
    try:
        options = BenchOptions(
            db=db, broker=broker, messages=messages, batch_size=batch_size,
            max_in_flight=max_in_flight, rate=rate, paced_seconds=paced_seconds,
            idle_seconds=idle_seconds, keys=keys, payload_bytes=payload_bytes,
            skip_raw=skip_raw, table=validate_table_name(table or _default_table()),
            topic=bench_raw.bench_topic(), row_leases=row_leases,
            cross_process=cross_process, cold=cold, relays=relays,
        )  # fmt: skip
        report = asyncio.run(run_bench(options))
    except RelayboxError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(report, indent=2))
