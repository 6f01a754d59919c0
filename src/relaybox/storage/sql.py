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
import datetime
import json
import logging
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
from relaybox.core.inspection import RelayMember
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
from relaybox.errors import SchemaError, StorageError, StorageOperationalError
from relaybox.sql.inserts import inserts
from relaybox.sql.params import native_style
from relaybox.storage.rows import (
    as_utc,
    check_listing,
    decode_abandoned,
    lease_token,
    relay_members,
)
from relaybox.storage.urls import DatabaseUrl

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between the two bounds of one call. A statement's is the server's first (it
#: keeps the connection), relaybox's after; a connect's relaybox's first (it says what
#: stalled), the driver's own after.
GRACE = 1.0
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
        return super().__new__(cls, sorted(int(v) for v in values))


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

    def __init__(self, url: DatabaseUrl, *, table: str = DEFAULT_TABLE) -> None:
        self.table = table
        self._url = url
        self._queries = sql.queries(self.dialect, table)
        self._query_names = {query: name for name, query in self._queries.items()}
        self._connection: Connection | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, url: DatabaseUrl | str, *, table: str = DEFAULT_TABLE) -> Self:
        """Open the storage and check that the table's schema is there."""
        storage = cls(DatabaseUrl.parse(url) if isinstance(url, str) else url, table=table)
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
        return await self._run(lambda session: session.execute(name, *args))

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
    ) -> Settled:
        fence = (worker, require_partitions(partition_count))
        steps = [  # (what it counts, the query, its rows)
            ("failed", "fail_owned", failed and _failures(failed, retry=True)),
            ("abandoned", "abandon_owned", abandoned and _failures(abandoned, retry=False)),
            ("published", "delete_owned" if delete else "publish_owned",
             published and Seqs(published)),
        ]  # fmt: skip
        todo = [(field, name, rows) for field, name, rows in steps if rows]

        async def run(session: Session) -> Settled:
            counts = {f: await session.execute(name, rows, *fence) for f, name, rows in todo}
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
            "mark_failed", _failures(failures, retry=True), lease_token(token)
        )

    async def abandon(self, token: str, failures: Sequence[Failure]) -> int:
        if not failures:
            return 0
        return await self._execute("abandon", _failures(failures, retry=False), lease_token(token))

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
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        total = 0
        for name, age in (("purge_published", published_older_than),
                          ("purge_abandoned", abandoned_older_than)):  # fmt: skip
            while True:
                deleted = await self._execute(name, float(age), batch_size)
                total += deleted
                if deleted < batch_size:
                    break
        return total

    async def replay(self, seqs: Sequence[int]) -> int:
        return await self._execute("replay", Seqs(seqs)) if seqs else 0

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
            counts = await session.fetch("count_by_status")
            age = await session.one("oldest_pending_age")
            leases = await session.one("active_leases")
            targets = await session.fetch("live_by_target")
            return OutboxStats(
                counts={Status(status): int(n) for status, n in counts},
                oldest_pending_age=None if age is None else max(0.0, float(age)),
                active_leases=int(leases),
                live_by_target={str(target): int(n) for target, n in targets},
            )

        return await self._run(read, atomic=scope is not None)

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
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        total = 0
        for name in ("activity_purge", "relay_status_purge"):
            while True:
                deleted = await self._execute(name, float(older_than), batch_size)
                total += deleted
                if deleted < batch_size:
                    break
        return total


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
