"""PostgreSQL storage for the relay, over asyncpg (default) or psycopg 3.

Both drivers run the same `$n` SQL from sql/postgresql/queries.sql (psycopg through its
raw cursor). asyncpg is the default, as it measured faster (docs/benchmarks.md); psycopg
is there for services that ship only psycopg. Lists of seqs travel as one array text
parameter: asyncpg checks every element of an array parameter on the client, where one
string costs nothing.

The URL's `connect_timeout` goes to the driver's own connect timeout, its
`command_timeout` to the server as `statement_timeout` and
`idle_in_transaction_session_timeout` (so that the server also ends a transaction whose
client went silent, and frees the locks it held).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import uuid
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.message import DEFAULT_TARGET
from relaybox.core.partitions import (
    DEFAULT_PARTITIONS,
    claim_lock_key,
    rebalance,
    require_partitions,
)
from relaybox.core.records import Assignment, Claim, RowsInFlight, StoredMessage, seq_text
from relaybox.errors import (
    SchemaError,
    StorageError,
    StorageIntegrityError,
    StorageOperationalError,
)
from relaybox.storage.rows import (
    CLAIM_COLUMNS,
    by_seq,
    byte_budget,
    decode,
    decode_exact,
    readable,
)
from relaybox.storage.sql import Connection, Seqs, SqlStorage, assignment
from relaybox.storage.urls import GRACE, DatabaseUrl

#: For the relay's own connections. The claim's estimated cost (its per-row order
#: checks) crosses jit_above_cost, and compiling it cost more than running it.
#: The claim's order guarantee needs each statement to see what committed before it.
#: No sequential scans: every statement relaybox runs on these connections finds its
#: rows by an index (by seq, or by key), and must keep doing so whatever the planner
#: last knew of the table. A plan is cached per connection and reused, and one made
#: while the outbox was empty or never analyzed (a fresh deploy, a truncate) prices a
#: whole-table scan as nothing: kept as the backlog grows, it read the whole backlog
#: on every read and settle. With sequential scans off, the index plan is the one
#: chosen at every size (tests/integration/test_postgres_plans.py holds the plans).
SESSION_SETTINGS = {
    "jit": "off",
    "default_transaction_isolation": "read committed",
    "application_name": "relaybox",
    "enable_seqscan": "off",
}

#: Where a claimed row has its payload, once its `expired` flag is cut off.
_PAYLOAD = CLAIM_COLUMNS.index("payload")


#: For the relay's claiming and settling connections (`generic_plans`): every
#: statement they run has a plan that is right whatever its parameters (the plans test
#: holds each one's generic plan), yet the plan cache kept planning the read anew at
#: every call, its generic plan's estimate being the dearer: a millisecond of planning
#: in every read of a drain, about a fifth of the statement.
GENERIC_PLANS = {"plan_cache_mode": "force_generic_plan"}


def session_settings(url: DatabaseUrl, *, generic_plans: bool = False) -> dict[str, str]:
    """SESSION_SETTINGS and the URL's statement bound, in milliseconds; with
    `generic_plans`, GENERIC_PLANS too."""
    bound = str(url.command_timeout_ms)
    return {
        **SESSION_SETTINGS,
        **(GENERIC_PLANS if generic_plans else {}),
        "statement_timeout": bound,
        "idle_in_transaction_session_timeout": bound,
    }


class _Asyncpg:
    def __init__(self, connection: Any) -> None:
        self._connection = connection

    @classmethod
    async def connect(cls, url: DatabaseUrl, *, generic_plans: bool = False) -> _Asyncpg:
        import asyncpg

        connection = await asyncpg.connect(
            url.libpq_dsn(),
            timeout=url.connect_timeout + GRACE,
            server_settings=session_settings(url, generic_plans=generic_plans),
        )
        return cls(connection)

    async def fetch(self, query: str, args: Sequence[Any]) -> list[Sequence[Any]]:
        return list(await self._connection.fetch(query, *args))

    async def execute(self, query: str, args: Sequence[Any]) -> int:
        status: str = await self._connection.execute(query, *args)
        return int(status.rsplit(" ", 1)[-1]) if status[-1].isdigit() else 0

    async def begin(self) -> None:
        await self._connection.execute("BEGIN")

    async def commit(self) -> None:
        await self._connection.execute("COMMIT")

    async def rollback(self) -> None:
        await self._connection.execute("ROLLBACK")

    async def close(self) -> None:
        await self._connection.close()

    async def discard(self) -> None:
        self._connection.terminate()


class _Psycopg:
    def __init__(self, connection: Any) -> None:
        self._connection = connection

    @classmethod
    async def connect(cls, url: DatabaseUrl, *, generic_plans: bool = False) -> _Psycopg:
        import psycopg

        settings = session_settings(url, generic_plans=generic_plans)
        options = " ".join(  # libpq's options: a space inside a value is escaped
            f"-c {name}={value.replace(' ', chr(92) + ' ')}" for name, value in settings.items()
        )
        connection = await psycopg.AsyncConnection.connect(
            url.libpq_dsn(),
            autocommit=True,
            cursor_factory=psycopg.AsyncRawCursor,
            options=options,
            connect_timeout=math.ceil(url.connect_timeout + GRACE),  # libpq: whole seconds
        )
        return cls(connection)

    async def fetch(self, query: str, args: Sequence[Any]) -> list[Sequence[Any]]:
        async with self._connection.cursor() as cursor:
            await cursor.execute(query, args)
            return list(await cursor.fetchall())

    async def execute(self, query: str, args: Sequence[Any]) -> int:
        async with self._connection.cursor() as cursor:
            await cursor.execute(query, args)
            return int(cursor.rowcount)

    async def begin(self) -> None:
        await self.execute("BEGIN", ())

    async def commit(self) -> None:
        await self.execute("COMMIT", ())

    async def rollback(self) -> None:
        await self.execute("ROLLBACK", ())

    async def close(self) -> None:
        await self._connection.close()

    async def discard(self) -> None:
        with contextlib.suppress(Exception):  # the connection is broken already
            await self._connection.close()


_INTEGRITY_ERRORS = frozenset({
    "IntegrityError", "IntegrityConstraintViolationError", "UniqueViolationError",
    "ForeignKeyViolationError", "NotNullViolationError", "CheckViolationError",
})  # fmt: skip
#: InternalClientError: asyncpg found its protocol mid-way through another operation
#: ("cannot switch to state ..."), as a connection cut or cancelled mid-statement can
#: leave it; only a new connection gets past it, so it is operational: dropped.
_ASYNCPG_TRANSIENT = frozenset({
    "InterfaceError", "InternalClientError", "DeadlockDetectedError", "SerializationError",
    "CannotConnectNowError", "AdminShutdownError", "QueryCanceledError",
})  # fmt: skip
#: undefined_table, undefined_function: the schema is missing or older than the code.
_SCHEMA_STATES = frozenset({"42P01", "42883"})


def translate(exc: BaseException) -> StorageError:
    """Map asyncpg/psycopg errors onto relaybox's storage branch."""
    if isinstance(exc, StorageError):
        return exc
    return _error_class(exc)(f"PostgreSQL: {exc}")


def _error_class(exc: BaseException) -> type[StorageError]:
    name, module = type(exc).__name__, type(exc).__module__
    if getattr(exc, "sqlstate", None) in _SCHEMA_STATES:
        return SchemaError
    if name in _INTEGRITY_ERRORS:
        return StorageIntegrityError
    if isinstance(exc, OSError | asyncio.TimeoutError | ConnectionError):
        return StorageOperationalError
    if module.startswith("psycopg") and name in ("OperationalError", "InterfaceError"):
        return StorageOperationalError
    if module.startswith("asyncpg") and ("Connection" in name or name in _ASYNCPG_TRANSIENT):
        return StorageOperationalError
    return StorageError


class PostgresStorage(SqlStorage):
    """The outbox table on PostgreSQL."""

    #: The counts read every live row, which no index serves: with sequential scans off
    #: (SESSION_SETTINGS) every plan costs alike and the planner took a sort over a
    #: hash aggregate, four times slower at 100k rows. They get them back, in their
    #: own transaction only.
    _STATS_SCOPE = "stats_scope"
    #: The abandon steps move some rows and hold others in one statement.
    _COUNTED = frozenset({"abandon_owned", "abandon"})
    _ONE_STATEMENT_CHANGES = True
    _KEY_TARGETS = True
    reads_behind_in_flight = True
    _SEARCH_SCOPE = "search_scope"
    dialect = "postgresql"
    label = "PostgreSQL"

    def __init__(self, url: DatabaseUrl, *, table: str = DEFAULT_TABLE) -> None:
        super().__init__(url, table=table)
        self._lock_key = claim_lock_key(table)
        self._decode = decode if url.driver == "psycopg" else decode_exact

    async def _open(self) -> Connection:
        driver = _Psycopg if self._url.driver == "psycopg" else _Asyncpg
        return await driver.connect(self._url, generic_plans=self._generic_plans)

    translate = staticmethod(translate)

    def _seqs(self, seqs: Seqs) -> str:
        return _array_text(seqs)

    def _gate(self, change: str) -> tuple[Any, ...]:
        # A change that makes rows wait takes turns with row-leasing claims (queries.sql,
        # claim_gate); the owned reads of relays holding partitions take no lock.
        return ("claim_gate", self._lock_key) if change in ("hold", "reschedule") else ()

    async def heartbeat(
        self,
        worker: str,
        *,
        partitions: int,
        lease_seconds: float,
        busy: Collection[int] = (),
        target: str = DEFAULT_TARGET,
    ) -> Assignment:
        """Renew, take and give back `target`'s partitions in one round trip unless
        some go back (then two).

        The first step, {table}_heartbeat, commits on its own: it expires dead members,
        joins, creates missing partitions, renews those held and takes free or expired
        ones up to the relay's fair share, so it only extends what the relay holds. A
        fresh relay holds its share after it. Should the second step fail, the relay
        keeps what it held without counting the heartbeat as a renewal, as after any
        failed heartbeat; partitions the first step took are then the relay's in the
        table but not read until a heartbeat succeeds and renews them (or, should none,
        until their lease runs out and another relay takes them). The second step gives
        back partitions over the share: partitions the relay no longer reads, fenced by
        the owner, so it may run apart from the first; the count of live relays the
        share rests on may be a moment old, as it may within one transaction, and the
        next heartbeat corrects a share that is off. It locks no member row, so the
        order of member-row locks that keeps heartbeats from deadlocking is the
        function's alone."""
        count, lease = require_partitions(partitions), float(lease_seconds)
        ((live, served, held),) = await self._fetch("heartbeat", worker, lease, target, count)
        plan = rebalance(_parsed_numbers(held), count, int(live), busy)
        # What the function could take it took (plan.wanted is left alone): a share
        # still short waits for the next heartbeat, as after a take that found none free.
        if plan.release:
            release = Seqs(plan.release)
            await self._run(
                lambda session: session.execute("partitions_release", worker, release, target)
            )
        return assignment(plan, (), int(live), frozenset(str(t) for t in served))

    async def claim(
        self,
        worker: str,
        *,
        limit: int,
        lease_seconds: float,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
        max_bytes: int | None = None,
    ) -> Claim:
        token = uuid.uuid4()
        budget = byte_budget(max_bytes)
        args = [worker, limit, _numbers(partitions), require_partitions(partition_count),
                _list(targets), token, float(lease_seconds), self._lock_key, budget,
                True]  # fmt: skip
        found = await self._fetch("claim", *args)
        claimed = [row[1:] for row in found if not row[0]]
        held = sum(len(row[_PAYLOAD]) for row in claimed)
        if len(claimed) < len(found) and len(claimed) < limit and held < budget:
            # Leases ran out: those rows are pending again; a second call takes them and
            # what waited behind them, in order, within what is left of the budget.
            args[1], args[8], args[9] = limit - len(claimed), budget - held, not claimed
            try:
                more = await self._fetch("claim", *args)
            except StorageOperationalError:
                # The first call committed its leases: those rows are a claim in order
                # by themselves, published now rather than left until their leases run
                # out. The rest waits for the next claim.
                more = []
            claimed.extend(row[1:] for row in more if not row[0])
        return Claim(str(token), worker, by_seq(claimed, partition_count))

    async def read(
        self,
        *,
        limit: int,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
        in_flight: Sequence[StoredMessage] = (),
        after_in_flight: bool = False,
        max_bytes: int | None = None,
        at_least_one: bool = True,
    ) -> list[StoredMessage]:
        # Behind rows in flight: those rows alone are left out, by seq; the window holds
        # every live row of a key up to the ones it returns, so what follows a key's
        # rows in flight there is the key's next in order. read_past still leaves out
        # a key whose head is in flight (its seq is in the list).
        keys = (
            "[]"
            if after_in_flight
            else json.dumps([f"{m.target}\x1f{m.key}" for m in in_flight if m.key is not None])
        )
        window = 2 * limit + len(in_flight)  # live rows the read looks at
        found = await self._fetch(
            "read", limit, _numbers(partitions), require_partitions(partition_count),
            _list(targets), _in_flight_text(in_flight), keys, window,
            byte_budget(max_bytes), at_least_one,
        )  # fmt: skip
        return readable(found, partition_count, self._decode)

    async def plan_read(self, partition_count: int = DEFAULT_PARTITIONS) -> None:
        # No row at all: both windows are empty, so neither the table nor its index is
        # walked (read_past returns at once), but the read is parsed and planned.
        await self._fetch(
            "read", 0, "{}", require_partitions(partition_count), None, "{}", "[]", 0,
            byte_budget(None), False,
        )  # fmt: skip

    async def plan_settle(
        self, partition_count: int = DEFAULT_PARTITIONS, *, delete: bool = True
    ) -> None:
        # No seq, and a worker that owns no partition: nothing is changed.
        name = "delete_owned" if delete else "publish_owned"
        await self._execute(name, Seqs(()), "", require_partitions(partition_count))


def _array_text(numbers: Iterable[int]) -> str:
    """Integers as PostgreSQL array text, `{1,2,3}`."""
    return "{" + ",".join(map(str, numbers)) + "}"


def _in_flight_text(in_flight: Sequence[StoredMessage]) -> str:
    """The seqs of the rows in flight as array text; a relay's own made batch by batch."""
    text = in_flight.seq_text if isinstance(in_flight, RowsInFlight) else seq_text(in_flight)
    return "{" + text + "}"


def _numbers(values: Iterable[int] | None) -> str | None:
    """Integers as array text, or None (the queries' "any partition")."""
    return None if values is None else _array_text(values)


def _parsed_numbers(text: str | None) -> list[int]:
    """Array text of integers (`{1,2,3}`, `{}`, or NULL) as a list."""
    inner = (text or "{}")[1:-1]
    return [int(number) for number in inner.split(",")] if inner else []


def _list(values: Sequence[Any] | None) -> list[Any] | None:
    return None if values is None else list(values)
