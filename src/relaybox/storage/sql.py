"""One SQL storage for PostgreSQL, MySQL/MariaDB and SQLite.

What the three databases do alike lives here, over `Connection`, the handful of calls
relaybox makes of a driver's connection: one connection the storage owns, opened when
first needed and opened again after it failed, used by one statement or one transaction
at a time; and on top of it the owned settle, the row-lease marks, heartbeats, purges,
counts, abandoned rows, replay and the writes of tools. Each query is named in the
dialect's queries.sql and takes the same parameters in the same order on every dialect.

A dialect (postgres.py, mysql.py, sqlite.py) supplies its driver, how its errors map
onto relaybox's, how it binds a list of seqs, and what it does its own way: the claim
(`RowLeaseStorage.claim`) and the owned read (`PartitionStorage.read`), the steps of a
heartbeat where its SQL cannot return rows from an UPDATE, and PostgreSQL's heartbeat,
one call of a function of its schema.

No call waits on the database unbounded: connecting is bounded by the URL's
`connect_timeout`, each statement by its `command_timeout` (plus a second, so that a
live server's own statement timeout answers first). A call that runs out of time drops
its connection, whose state is then unknown, without waiting on the server, logs a
warning and raises `StorageOperationalError`, which callers retry like a lost
connection.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import datetime
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Any, ClassVar, Protocol, Self, TypeVar

from relaybox import sql
from relaybox.core.activity import (
    ACTIVITY_RETENTION,
    STATUS_LIVE_SECONDS,
    ActivityPoint,
    Lag,
    RelayStatus,
    TargetActivity,
    minute_of,
    minute_start,
)
from relaybox.core.circuit import CircuitState
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.inspection import (
    HELD_UNTIL,
    MAX_DELAY,
    MAX_SEQ,
    AuditAction,
    AuditRecord,
    BackfillJob,
    Change,
    MessageDetail,
    MessageFilter,
    MessageState,
    MessageSummary,
    RelayMember,
    TargetStuck,
)
from relaybox.core.lifecycle import Status
from relaybox.core.message import DEFAULT_TARGET
from relaybox.core.partitions import (
    DEFAULT_PARTITIONS,
    Rebalance,
    rebalance,
    require_partitions,
)
from relaybox.core.records import (
    AbandonedMessage,
    Assignment,
    Failure,
    InsertRow,
    OutboxStats,
    Settled,
)
from relaybox.core.urls import without_secrets
from relaybox.errors import ConfigurationError, SchemaError, StorageError, StorageOperationalError
from relaybox.sql.inserts import inserts
from relaybox.sql.params import moment, native_style
from relaybox.storage.rows import (
    as_utc,
    check_listing,
    decode_abandoned,
    decode_audit,
    decode_backfill,
    decode_detail,
    decode_summary,
    lease_token,
    relay_members,
    stuck_targets,
)
from relaybox.storage.urls import GRACE, DatabaseUrl

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a polite close may take before the connection is dropped instead.
CLOSE_TIMEOUT = 1.0


class Connection(Protocol):
    """A driver's connection, as the storage uses it (in autocommit between transactions)."""

    async def fetch(self, query: str, args: Sequence[Any]) -> list[Sequence[Any]]: ...
    async def execute(self, query: str, args: Sequence[Any]) -> int:
        """Run a statement; the number of rows it changed (or matched, on MySQL)."""

    async def begin(self) -> None: ...
    async def commit(self) -> None: ...
    async def rollback(self) -> None: ...
    async def close(self) -> None:
        """Say goodbye and close."""

    async def discard(self) -> None:
        """Drop a connection whose state is unknown, without waiting on the server."""


class _Bounded:
    """A connection whose every call must answer within `seconds`; one that does not
    raises what `stalled` makes of it (its name for the statement, the seconds).

    A call that runs out of time, or is cancelled, drops the connection before the
    driver hears of it: a driver cancelled mid-statement asks the server to cancel it
    and waits for the answer, which a silent server never gives."""

    __slots__ = ("_connection", "_seconds", "_stalled")

    def __init__(
        self,
        connection: Connection,
        seconds: float,
        stalled: Callable[[str, float], StorageOperationalError],
    ) -> None:
        self._connection = connection
        self._seconds = seconds
        self._stalled = stalled

    async def _within(self, call: Awaitable[T], what: str) -> T:
        running = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({running}, timeout=self._seconds)
        finally:
            if not running.done():  # out of time, or our caller was cancelled
                await self._connection.discard()
                running.cancel()
                running.add_done_callback(_retrieved)
                # Let the driver unwind (unregister the socket it waited on) before
                # another connection may reuse the descriptor.
                await asyncio.wait({running}, timeout=GRACE)
        if not done:
            raise self._stalled(what, self._seconds)
        return running.result()

    async def fetch(self, query: str, args: Sequence[Any]) -> list[Sequence[Any]]:
        return await self._within(self._connection.fetch(query, args), query)

    async def execute(self, query: str, args: Sequence[Any]) -> int:
        return await self._within(self._connection.execute(query, args), query)

    async def begin(self) -> None:
        await self._within(self._connection.begin(), "BEGIN")

    async def commit(self) -> None:
        await self._within(self._connection.commit(), "COMMIT")

    async def rollback(self) -> None:
        await self._within(self._connection.rollback(), "ROLLBACK")

    async def close(self) -> None:
        await self._connection.close()

    async def discard(self) -> None:
        await self._connection.discard()


class Seqs(tuple[int, ...]):
    """A list of seqs (or partitions) bound as one parameter, sorted, so that statements
    that lock rows by it lock them in one order. Each dialect binds it its own way."""

    __slots__ = ()

    def __new__(cls, values: Iterable[int]) -> Self:
        return super().__new__(cls, sorted(map(int, values)))


class Session:
    """A connection in use by one piece of work, running named queries."""

    __slots__ = ("_bind", "connection")

    def __init__(self, connection: Connection, bind: Callable[[str, Sequence[Any]], Any]) -> None:
        self.connection = connection
        self._bind = bind

    async def fetch(self, name: str, *args: Any) -> list[Sequence[Any]]:
        query, params = self._bind(name, args)
        return await self.connection.fetch(query, params)

    async def execute(self, name: str, *args: Any) -> int:
        query, params = self._bind(name, args)
        return await self.connection.execute(query, params)

    async def one(self, name: str, *args: Any) -> Any:
        """The single value of a one-row, one-column query."""
        ((value,),) = await self.fetch(name, *args)
        return value


class SqlStorage(abc.ABC):
    """The outbox table in an SQL database, through one connection the storage owns."""

    dialect: ClassVar[sql.Dialect]
    #: The database's name in errors and logs.
    label: ClassVar[str]
    #: Statements that change rows and answer how many in one row of their own, as a
    #: statement whose count would cover only part of what it changed does.
    _COUNTED: ClassVar[frozenset[str]] = frozenset()
    #: See `PartitionStorage.reads_behind_in_flight`; the reads of MySQL and SQLite
    #: leave out every row of a key in flight.
    reads_behind_in_flight: ClassVar[bool] = False

    def __init__(self, url: DatabaseUrl, *, table: str = DEFAULT_TABLE) -> None:
        self.table = table
        self._url = url
        #: Whether the connection runs every statement on its generic plan (see
        #: `connect`); only PostgreSQL has a plan cache that asks.
        self._generic_plans = False
        self._queries = directed(sql.queries(self.dialect, table))
        self._query_names = {query: name for name, query in self._queries.items()}
        #: The held rows' due time, as this dialect's queries take a time.
        self._held = moment(self.dialect, HELD_UNTIL)
        self._connection: Connection | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(
        cls, url: DatabaseUrl | str, *, table: str = DEFAULT_TABLE, generic_plans: bool = False
    ) -> Self:
        """Open the storage and check that the table's schema is there. With
        `generic_plans`, the connection runs every statement on its generic plan, for a
        relay's connections that run only the statements whose generic plans are held
        by test (PostgreSQL; other databases have no such choice)."""
        storage = cls(DatabaseUrl.parse(url) if isinstance(url, str) else url, table=table)
        storage._generic_plans = generic_plans  # before its first connection opens
        try:
            missing = await storage._run(lambda session: session.fetch("probe"))
            if missing:  # a probe that reads the catalog names them; others fail
                names = ", ".join(str(name) for (name,) in missing)
                raise SchemaError(f"{cls.dialect}: no table {names}")
        except SchemaError as exc:
            await storage.close()
            raise SchemaError(
                f"the outbox table {table} (or a table beside it) does not exist at "
                f"{storage._url.masked} ({exc}): create the outbox tables with `relaybox "
                f"migrate --db {storage._url.masked} --table {table}`"
            ) from exc
        except BaseException:
            await storage.close()
            raise
        return storage

    # -- what each dialect supplies ---------------------------------------------------

    @abc.abstractmethod
    async def _open(self) -> Connection:
        """A new connection, ready for use."""

    @staticmethod
    @abc.abstractmethod
    def translate(exc: BaseException) -> StorageError:
        """The driver's error as relaybox's: operational (retry), integrity, schema..."""

    @abc.abstractmethod
    def _seqs(self, seqs: Seqs) -> Any:
        """A list of seqs as this dialect's queries take it in one parameter."""

    def _value(self, value: datetime.datetime | uuid.UUID) -> Any:
        """A time or a uuid as this dialect's queries take it (PostgreSQL: as is)."""
        return value

    #: A named query run first in a search's own transaction (PostgreSQL: the planner
    #: settings that keep it an index walk that stops at its page).
    _SEARCH_SCOPE: ClassVar[str | None] = None

    #: Whether a search of a key without a target first lists the key's targets (a
    #: loose scan of the key indexes) and walks each one's key index.
    _KEY_TARGETS: ClassVar[bool] = False

    #: Whether each operator's change is one statement that also writes its audit
    #: records (PostgreSQL); elsewhere it takes three steps in one transaction.
    _ONE_STATEMENT_CHANGES: ClassVar[bool] = False

    def _bind(self, name: str, args: Sequence[Any]) -> tuple[str, Sequence[Any]]:
        """A named query and its parameters as the driver takes them."""
        return self._queries[name], [self._seqs(a) if type(a) is Seqs else a for a in args]

    # -- the connection -----------------------------------------------------------------

    async def _run(self, work: Callable[[Session], Awaitable[T]], *, atomic: bool = False) -> T:
        """Run `work` on the connection, alone; in one transaction if `atomic`. A
        connection that failed, or whose state is unknown, is dropped: the next call
        opens another."""
        async with self._lock:
            if self._connection is None:
                self._connection = await self._connect()
            connection = _Bounded(
                self._connection, self._url.command_timeout + GRACE, self._stalled
            )
            try:
                if not atomic:
                    return await work(Session(connection, self._bind))
                await connection.begin()
                result = await work(Session(connection, self._bind))
                await connection.commit()
                return result
            except Exception as exc:  # noqa: BLE001 - raised again as relaybox's
                error = self._relaybox_error(exc)
                if isinstance(error, StorageOperationalError) or (
                    atomic and not await _rolled_back(connection)
                ):
                    await self._discard()
                raise error from error.__cause__
            except BaseException:  # cancelled mid-statement: never reuse the connection
                await self._discard()
                raise

    async def _connect(self) -> Connection:
        seconds = self._url.connect_timeout
        try:
            async with asyncio.timeout(seconds):
                return await self._open()
        except TimeoutError:  # ours, or the driver's own connect timeout
            raise self._stall(f"a new connection within {seconds:g} s") from None
        except Exception as exc:  # noqa: BLE001 - raised again as relaybox's
            error = self._relaybox_error(exc)
            raise error from error.__cause__

    def _relaybox_error(self, exc: BaseException) -> StorageError:
        """The driver's error as relaybox's, with no secret of the URL in its words or in
        the cause it is chained to (a driver may quote a password it could not use)."""
        return without_secrets(self.translate(exc), exc, self._url.secrets)

    def _stalled(self, query: str, seconds: float) -> StorageOperationalError:
        """The error for a statement that got no answer in time."""
        name = self._query_names.get(query)
        what = f"the query {name!r}" if name else f"a {query.split(None, 1)[0].upper()} statement"
        return self._stall(f"{what} within {seconds:g} s; its connection is dropped")

    def _stall(self, what: str) -> StorageOperationalError:
        error = StorageOperationalError(f"{self.label} at {self._url.masked} did not answer {what}")
        logger.warning("%s", error, extra={"action": "storage_stall", "url": self._url.masked})
        return error

    async def _discard(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.discard()

    async def _execute(self, name: str, *args: Any) -> int:
        return await self._run(lambda session: self._change(session, name, *args))

    async def _change(self, session: Session, name: str, *args: Any) -> int:
        """Run a statement that changes rows; how many it changed."""
        if name in self._COUNTED:
            return int(await session.one(name, *args))
        return await session.execute(name, *args)

    async def _fetch(self, name: str, *args: Any) -> list[Sequence[Any]]:
        return await self._run(lambda session: session.fetch(name, *args))

    async def close(self) -> None:
        """Close politely, or drop the connection if the database does not answer."""
        async with self._lock:
            connection, self._connection = self._connection, None
            if connection is not None:
                try:
                    async with asyncio.timeout(CLOSE_TIMEOUT):
                        await connection.close()
                except Exception:  # noqa: BLE001 - a broken or silent connection
                    await connection.discard()

    # -- writing (tools, tests, demos) ----------------------------------------------

    async def write(self, rows: Sequence[InsertRow]) -> None:
        """Insert `rows` in a transaction of the storage's own."""
        statements = inserts(self.dialect, self.table, native_style(self.dialect), rows)

        async def insert(session: Session) -> None:
            for statement in statements:
                await session.connection.execute(statement.query, statement.params)

        if statements:
            await self._run(insert, atomic=len(statements) > 1)

    # -- a relay that holds partitions ------------------------------------------------

    async def settle(
        self,
        worker: str,
        *,
        partition_count: int = DEFAULT_PARTITIONS,
        failed: Sequence[Failure] = (),
        abandoned: Sequence[Failure] = (),
        published: Sequence[int] = (),
        delete: bool = True,
        hold_keys: bool = False,
    ) -> Settled:
        fence = (worker, require_partitions(partition_count))
        steps = [  # (what it counts, the query, its rows, the parameters after the fence)
            ("failed", "fail_owned", failed and _failures(failed, retry=True), (self._held,)),
            ("abandoned", "abandon_owned", abandoned and _failures(abandoned, retry=False),
             (hold_keys, self._held)),
            ("published", "delete_owned" if delete else "publish_owned",
             published and Seqs(published), ()),
        ]  # fmt: skip
        todo = [step for step in steps if step[2]]

        async def run(session: Session) -> Settled:
            counts = {
                field: await self._change(session, name, rows, *fence, *more)
                for field, name, rows, more in todo
            }
            return Settled(**counts)

        if not todo:
            return Settled()
        # One statement is atomic on its own: the commonest settle, every row of a batch
        # published, takes one round trip.
        return await self._run(run, atomic=len(todo) > 1)

    async def heartbeat(
        self,
        worker: str,
        *,
        partitions: int,
        lease_seconds: float,
        busy: Collection[int] = (),
        target: str = DEFAULT_TARGET,
    ) -> Assignment:
        count, lease = require_partitions(partitions), float(lease_seconds)

        async def beat(session: Session) -> Assignment:
            await session.execute("members_expire")
            await session.execute("member_join", worker, lease, target)
            await self._create_partitions(session, count, target)
            live = int(await session.one("members_live", target))
            served = frozenset(str(t) for (t,) in await session.fetch("members_targets"))
            held = await self._renew_partitions(session, worker, lease, target)
            plan = rebalance(held, count, live, busy)
            taken = await self._shift(session, worker, lease, count, plan, target)
            return assignment(plan, taken, live, served)

        return await self._run(beat, atomic=True)

    async def _shift(
        self, session: Session, worker: str, lease: float, count: int, plan: Rebalance, target: str
    ) -> list[int]:
        """Give back the partitions of `target` that `plan` releases and take those it
        wants; the partitions taken."""
        if plan.release:
            await session.execute("partitions_release", worker, Seqs(plan.release), target)
        if not plan.wanted:
            return []
        return await self._take_partitions(session, worker, lease, count, plan.wanted, target)

    async def _create_partitions(self, session: Session, count: int, target: str) -> None:
        await session.execute("partitions_create", count, target)

    async def _renew_partitions(
        self, session: Session, worker: str, lease: float, target: str
    ) -> list[int]:
        """Extend the lease of every partition of `target` that `worker` holds; those
        partitions."""
        found = await session.fetch("partitions_renew", worker, lease, target)
        return [int(p) for (p,) in found]

    async def _take_partitions(
        self, session: Session, worker: str, lease: float, count: int, wanted: int, target: str
    ) -> list[int]:
        """Take up to `wanted` free or expired partitions of `target`, lowest first; those
        taken."""
        found = await session.fetch("partitions_take", worker, lease, count, wanted, target)
        return [int(p) for (p,) in found]

    async def leave(self, worker: str) -> None:
        async def part(session: Session) -> None:
            await session.execute("partitions_leave", worker)
            await session.execute("member_leave", worker)

        await self._run(part, atomic=True)

    # -- a relay that leases each row -------------------------------------------------

    async def mark_published(self, token: str, seqs: Sequence[int], *, delete: bool = False) -> int:
        if not seqs:
            return 0
        name = "delete_published" if delete else "mark_published"
        return await self._execute(name, Seqs(seqs), lease_token(token))

    async def mark_failed(self, token: str, failures: Sequence[Failure]) -> int:
        if not failures:
            return 0
        return await self._execute(
            "mark_failed", _failures(failures, retry=True), lease_token(token), self._held
        )

    async def abandon(
        self, token: str, failures: Sequence[Failure], *, hold_keys: bool = False
    ) -> int:
        if not failures:
            return 0
        return await self._execute(
            "abandon", _failures(failures, retry=False), lease_token(token), hold_keys,
            self._held,
        )  # fmt: skip

    async def release(self, token: str, seqs: Sequence[int]) -> int:
        if not seqs:
            return 0
        return await self._execute("release", Seqs(seqs), lease_token(token))

    async def renew(self, token: str, seqs: Sequence[int], lease_seconds: float) -> int:
        if not seqs:
            return 0
        return await self._execute("renew", Seqs(seqs), lease_token(token), float(lease_seconds))

    # -- what operators need ----------------------------------------------------------

    async def purge(
        self, *, published_older_than: float, abandoned_older_than: float, batch_size: int = 500
    ) -> int:
        return await self._purge_in_batches(
            (("purge_published", published_older_than),
             ("purge_abandoned", abandoned_older_than)), batch_size,
        )  # fmt: skip

    async def _purge_in_batches(self, purges: Sequence[tuple[str, float]], batch_size: int) -> int:
        """Run each (named delete, age in seconds) a batch at a time until a batch
        comes back short; how many rows they deleted in all."""
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        total = 0
        for name, age in purges:
            while True:
                deleted = await self._execute(name, float(age), batch_size)
                total += deleted
                if deleted < batch_size:
                    break
        return total

    async def replay(self, seqs: Sequence[int], change: Change | None = None) -> int:
        return await self._operator_change(
            "replay", AuditAction.REPLAY, seqs, change, check=self._held_check()
        )

    async def abandoned(
        self, *, limit: int, before: int | None = None, target: str | None = None
    ) -> list[AbandonedMessage]:
        rows = await self._fetch("abandoned", before, target, check_listing(limit))
        return [decode_abandoned(row) for row in rows]

    async def relays(self) -> list[RelayMember]:
        async def read(session: Session) -> list[RelayMember]:
            members = await session.fetch("relay_members")
            owned = await session.fetch("relay_partitions")
            return relay_members(members, owned)

        return await self._run(read, atomic=True)

    #: A named query run first in the counts' own transaction (PostgreSQL: the
    #: planner settings those whole-table reads need, see postgres.py).
    _STATS_SCOPE: ClassVar[str | None] = None

    async def stats(self) -> OutboxStats:
        scope = self._STATS_SCOPE

        async def read(session: Session) -> OutboxStats:
            if scope is not None:
                await session.execute(scope)
            counts = await session.fetch("count_by_status", self._held)
            ((held, held_keys),) = await session.fetch("count_held", self._held)
            age = await session.one("oldest_pending_age")
            leases = await session.one("active_leases")
            targets = await session.fetch("live_by_target")
            return OutboxStats(
                counts={Status(status): int(n) for status, n in counts},
                oldest_pending_age=None if age is None else max(0.0, float(age)),
                active_leases=int(leases),
                live_by_target={str(target): int(n) for target, n in targets},
                held=int(held),
                held_keys=int(held_keys),
            )

        return await self._run(read, atomic=scope is not None)

    # -- the operator's console --------------------------------------------------------

    async def search(
        self,
        where: MessageFilter,
        *,
        limit: int,
        after: int | None = None,
        newest_first: bool = True,
    ) -> list[MessageSummary]:
        bounds = seq_bounds(where, after, newest_first=newest_first)
        if bounds is None or check_listing(limit) == 0:
            return []
        if where.key is not None and where.target is None and self._KEY_TARGETS:
            # One key's rows in every target: each target's key index, merged.
            found: list[MessageSummary] = []
            for (target,) in await self._fetch("key_targets", where.key):
                found += await self.search(
                    dataclasses.replace(where, target=str(target)), limit=limit, after=after,
                    newest_first=newest_first,
                )  # fmt: skip
            found.sort(key=lambda m: m.seq, reverse=newest_first)
            return found[:limit]
        order = "_desc" if newest_first else "_asc"
        if where.states == _ABANDONED and f"search_abandoned{order}" in self._queries:
            rows = await self._fetch(
                f"search_abandoned{order}", where.target, where.topic, where.key, where.type,
                None if where.id is None else self._value(where.id), where.correlation_id,
                where.causation_id, where.tenant_id, where.aggregate_id, *bounds,
                self._time(where.since), self._time(where.until), limit,
            )  # fmt: skip
            return [decode_summary(row) for row in rows]
        keyed = where.target is not None and where.key is not None
        name = ("search_key" if keyed else "search") + order
        states = ",".join(sorted(where.states)) or None
        args = (
            name, where.wants_live, where.wants_finished, states, where.target, where.topic,
            where.key, where.type, None if where.id is None else self._value(where.id),
            where.correlation_id, where.causation_id, where.tenant_id, where.aggregate_id,
            *bounds, self._time(where.since), self._time(where.until), limit,
            self._value(HELD_UNTIL),
        )  # fmt: skip
        scope = self._SEARCH_SCOPE

        async def run(session: Session) -> list[Sequence[Any]]:
            if scope is not None:
                await session.execute(scope)
            return await session.fetch(*args)

        rows = await self._run(run, atomic=scope is not None)
        return [decode_summary(row) for row in rows]

    async def message(self, seq: int) -> MessageDetail | None:
        found = await self.messages([seq])
        return found[0] if found else None

    async def messages(self, seqs: Sequence[int]) -> list[MessageDetail]:
        wanted = Seqs(seq for seq in seqs if 1 <= seq <= MAX_SEQ)
        if not wanted:
            return []
        rows = await self._fetch("messages", wanted, self._value(HELD_UNTIL))
        return sorted((decode_detail(row) for row in rows), key=lambda m: m.summary.seq)

    async def discard(self, seqs: Sequence[int], change: Change) -> int:
        return await self._operator_change("discard", AuditAction.DISCARD, seqs, change)

    async def reschedule(self, seqs: Sequence[int], *, delay: float, change: Change) -> int:
        if not (math.isfinite(delay) and 0 <= delay <= MAX_DELAY):
            raise ConfigurationError(f"a delay is 0 to {MAX_DELAY:g} seconds, not {delay}")
        action = AuditAction.DELAY if delay > 0 else AuditAction.EXPEDITE
        return await self._operator_change(
            "reschedule", action, seqs, change, check=self._held_check(), values=[float(delay)]
        )

    async def release_held(self, seqs: Sequence[int], change: Change) -> int:
        return await self._operator_change(
            "release_held", AuditAction.RELEASE, seqs, change, check=self._held_check()
        )

    async def hold(self, seqs: Sequence[int], change: Change) -> int:
        held = self._held_check()
        return await self._operator_change(
            "hold", AuditAction.HOLD, seqs, change, check=held, values=held
        )

    async def audit(self, *, limit: int, before: int | None = None) -> list[AuditRecord]:
        rows = await self._fetch("audit", before, check_listing(limit))
        return [decode_audit(row) for row in rows]

    async def backfill_job(self, name: str) -> BackfillJob | None:
        rows = await self._fetch("backfill_job", name)
        return decode_backfill(rows[0]) if rows else None

    async def backfill_begin(
        self, name: str, *, source: MessageFilter, target: str, external: bool, change: Change
    ) -> BackfillJob:
        async def begin(session: Session) -> BackfillJob:
            await session.execute(
                "backfill_begin", name, source.to_json(), target, bool(external),
                change.actor, change.reason,
            )  # fmt: skip
            (row,) = await session.fetch("backfill_job", name)
            return decode_backfill(row)

        return await self._run(begin, atomic=True)

    async def backfill_copy(
        self, name: str, rows: Sequence[InsertRow], *, cursor: int, finished: bool
    ) -> bool:
        statements = (
            inserts(self.dialect, self.table, native_style(self.dialect), rows) if rows else []
        )

        async def copy(session: Session) -> bool:
            moved = await session.execute(
                "backfill_advance", name, int(cursor), len(rows), bool(finished)
            )
            if moved != 1:
                return False
            for statement in statements:
                await session.connection.execute(statement.query, statement.params)
            return True

        return await self._run(copy, atomic=True)

    async def stuck_by_target(self) -> list[TargetStuck]:
        scope = self._STATS_SCOPE

        async def read(session: Session) -> list[TargetStuck]:
            if scope is not None:  # a pass over every live row, as the counts make
                await session.execute(scope)
            live = await session.fetch("stuck_live", self._held)
            abandoned = await session.fetch("stuck_abandoned")
            return stuck_targets(live, abandoned)

        return await self._run(read, atomic=scope is not None)

    def _held_check(self) -> list[Any]:
        """The held rows' due time, as the only argument of a state's check."""
        return [self._held]

    def _time(self, value: datetime.datetime | None) -> Any:
        return None if value is None else self._value(value)

    async def _operator_change(
        self,
        name: str,
        action: AuditAction,
        seqs: Sequence[int],
        change: Change | None,
        *,
        check: Sequence[Any] = (),
        values: Sequence[Any] = (),
    ) -> int:
        """Run the operator's change `name` over the rows of `seqs` still in a state it
        applies to, with an audit record per row changed (none without `change`); how
        many rows it changed. `check` goes to the test of a row's state, `values` to
        the change itself."""
        if not seqs:
            return 0
        chosen = Seqs(seqs)
        record = (
            (None, action.value, None) if change is None
            else (change.actor, action.value, change.reason)
        )  # fmt: skip

        gate = self._gate(name)

        async def one_statement(session: Session) -> int:
            if gate:
                await session.execute(*gate)
            return int(await session.one(name, chosen, *record, *check, *values))

        async def steps(session: Session) -> int:
            found = await session.fetch(f"{name}_pick", chosen, *check)
            if not found:
                return 0
            picked = Seqs(int(seq) for (seq,) in found)
            if change is not None:
                await session.execute("audit_record", picked, *record)
            await session.execute(name, picked, *values)
            return len(picked)

        if self._ONE_STATEMENT_CHANGES:
            return await self._run(one_statement, atomic=bool(gate))
        return await self._run(steps, atomic=True)

    def _gate(self, change: str) -> tuple[Any, ...]:
        """A statement (name and arguments) that an operator's change `change` runs
        first, in its transaction, to take turns with claims; () for none."""
        return ()

    # -- the relays' activity, for the console -----------------------------------------

    async def record_activity(self, worker: str, activity: Sequence[TargetActivity]) -> None:
        async def record(session: Session) -> None:
            for each in activity:
                if each.counted:
                    await session.execute(
                        "activity_add", each.target, worker, each.published, each.failed,
                        each.abandoned, each.lag.total, each.lag.largest, each.lag.count,
                    )  # fmt: skip
                error = None if each.last_error is None else error_text(each.last_error)
                await session.execute(
                    "relay_status_set", worker, each.target, each.circuit.value, error
                )

        if activity:
            await self._run(record, atomic=True)

    async def activity(self, *, since: datetime.datetime) -> list[ActivityPoint]:
        rows = await self._fetch("activity_since", minute_of(since))
        return [
            ActivityPoint(
                str(target),
                minute_start(minute),
                int(published),
                int(failed),
                int(abandoned),
                Lag(float(total), float(largest), int(count)),
            )
            for target, minute, published, failed, abandoned, total, largest, count in rows
        ]

    async def relay_statuses(self, *, within: float = STATUS_LIVE_SECONDS) -> list[RelayStatus]:
        rows = await self._fetch("relay_statuses", float(within))
        return [
            RelayStatus(
                str(worker), str(target), CircuitState(circuit), last_error, as_utc(updated_at)
            )
            for worker, target, circuit, last_error, updated_at in rows
        ]

    async def purge_activity(
        self, *, older_than: float = ACTIVITY_RETENTION, batch_size: int = 500
    ) -> int:
        return await self._purge_in_batches(
            (("activity_purge", older_than), ("relay_status_purge", older_than)), batch_size
        )


#: A search of these states alone reads the abandoned rows' own index, where the
#: dialect has one over the table the live rows share (MariaDB, SQLite).
_ABANDONED = frozenset({MessageState.ABANDONED})


def assignment(
    plan: Rebalance, taken: Iterable[int], live: int, served: frozenset[str]
) -> Assignment:
    """What a heartbeat hands the relay: the partitions it keeps (draining ones among
    them) and those it took."""
    return Assignment(
        frozenset([*plan.keep, *plan.draining, *taken]), live, frozenset(plan.draining), served
    )


async def _rolled_back(connection: Connection) -> bool:
    """False if the connection cannot be trusted any more."""
    try:
        await connection.rollback()
    except Exception:  # noqa: BLE001 - the caller raises the original error
        return False
    return True


def seq_bounds(
    where: MessageFilter, after: int | None, *, newest_first: bool
) -> tuple[int, int] | None:
    """The lowest and highest seq a search page may hold: the filter's range, cut at the
    cursor `after` (below it newest first, above it otherwise); None when empty."""
    low, high = where.min_seq or 1, where.max_seq or MAX_SEQ
    if after is not None:
        if newest_first:
            high = min(high, after - 1)
        else:
            low = max(low, after + 1)
    return (low, high) if low <= high else None


def directed(queries: dict[str, str]) -> dict[str, str]:
    """The queries with every one whose order is left open (`{order}`) as two, named
    with `_asc` and `_desc`: the database walks its index one way or the other."""
    found = {}
    for name, query in queries.items():
        if "{order}" in query:
            found[f"{name}_asc"] = query.replace("{order}", "ASC")
            found[f"{name}_desc"] = query.replace("{order}", "DESC")
        else:
            found[name] = query
    return found


def _retrieved(call: asyncio.Future[Any]) -> None:
    """Mark the error of a call given up on as seen (its connection is gone already)."""
    if not call.cancelled():
        call.exception()


def _failures(failures: Sequence[Failure], *, retry: bool) -> str:
    """Failures as the JSON array the queries read: [[seq, error, retry_in], ...] (or
    without retry_in), in seq order, so that two sessions lock their rows in one order."""
    ordered = sorted(failures, key=lambda f: f.seq)
    if retry:
        return json.dumps([[f.seq, error_text(f.error), float(f.retry_in)] for f in ordered])
    return json.dumps([[f.seq, error_text(f.error)] for f in ordered])


def error_text(value: str) -> str:
    """An error as text every database stores: valid UTF-8 (a lone surrogate is replaced)
    and without NUL (which PostgreSQL's text and JSON refuse), so that an odd message
    from a broker can never make the mark that records it fail."""
    return str(value).encode("utf-8", "replace").decode("utf-8").replace("\x00", "\ufffd")
