"""PostgreSQL storage for the relay, over asyncpg (default) or psycopg 3.

Both drivers run the same `$n` SQL from sql/postgresql/queries.sql (psycopg through its
raw cursor). asyncpg is the default because it drained faster in the measurement
recorded in docs/benchmarks.md; psycopg is there for services that only ship psycopg.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from relaybox import sql
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.lifecycle import Status
from relaybox.core.partitions import (
    DEFAULT_PARTITIONS,
    Rebalance,
    claim_lock_key,
    rebalance,
    require_partitions,
)
from relaybox.core.records import (
    AbandonedMessage,
    Assignment,
    Claim,
    Failure,
    InsertRow,
    OutboxStats,
    Settled,
    StoredMessage,
)
from relaybox.errors import (
    SchemaError,
    StorageError,
    StorageIntegrityError,
    StorageOperationalError,
)
from relaybox.sql.inserts import inserts
from relaybox.storage.rows import (
    by_seq,
    check_listing,
    decode,
    decode_abandoned,
    decode_exact,
    lease_token,
    readable,
)
from relaybox.storage.urls import DatabaseUrl

T = TypeVar("T")


#: For the relay's own connections. The claim's estimated cost (its per-row order
#: checks) crosses jit_above_cost, and compiling it cost more than running it.
#: (Forcing generic plans was tried and dropped: a plan made while the table was empty
#: turned the order check into a sequential scan per row, seconds per claim.)
#: The claim's order guarantee needs each statement to see what committed before it.
SESSION_SETTINGS = {
    "jit": "off",
    "default_transaction_isolation": "read committed",
    "application_name": "relaybox",
}


class _Driver(Protocol):
    async def fetch(self, query: str, args: Sequence[Any]) -> list[Sequence[Any]]: ...
    async def execute(self, query: str, args: Sequence[Any]) -> int: ...
    async def close(self) -> None: ...


class _AsyncpgDriver:
    def __init__(self, connection: Any) -> None:
        self._connection = connection

    @classmethod
    async def connect(cls, dsn: str) -> _AsyncpgDriver:
        import asyncpg

        return cls(await asyncpg.connect(dsn, server_settings=SESSION_SETTINGS))

    async def fetch(self, query: str, args: Sequence[Any]) -> list[Sequence[Any]]:
        return list(await self._connection.fetch(query, *args))

    async def execute(self, query: str, args: Sequence[Any]) -> int:
        status: str = await self._connection.execute(query, *args)
        return int(status.rsplit(" ", 1)[-1]) if status[-1].isdigit() else 0

    async def close(self) -> None:
        await self._connection.close()


class _PsycopgDriver:
    def __init__(self, connection: Any) -> None:
        self._connection = connection

    @classmethod
    async def connect(cls, dsn: str) -> _PsycopgDriver:
        import psycopg

        options = " ".join(  # libpq's options: a space inside a value is escaped
            f"-c {name}={value.replace(' ', chr(92) + ' ')}"
            for name, value in SESSION_SETTINGS.items()
        )
        connection = await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, cursor_factory=psycopg.AsyncRawCursor, options=options
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

    async def close(self) -> None:
        await self._connection.close()


_INTEGRITY_ERRORS = frozenset({
    "IntegrityError", "IntegrityConstraintViolationError", "UniqueViolationError",
    "ForeignKeyViolationError", "NotNullViolationError", "CheckViolationError",
})  # fmt: skip


def translate(exc: BaseException) -> StorageError:
    """Map asyncpg/psycopg errors onto relaybox's storage branch."""
    name = type(exc).__name__
    module = type(exc).__module__
    text = f"PostgreSQL: {exc}"
    if name in _INTEGRITY_ERRORS:
        return StorageIntegrityError(text)
    if isinstance(exc, OSError | asyncio.TimeoutError | ConnectionError):
        return StorageOperationalError(text)
    if module.startswith("psycopg") and name in ("OperationalError", "InterfaceError"):
        return StorageOperationalError(text)
    if module.startswith("asyncpg") and (
        "Connection" in name or name in ("InterfaceError", "DeadlockDetectedError",
                                         "SerializationError", "CannotConnectNowError",
                                         "AdminShutdownError", "QueryCanceledError")
    ):  # fmt: skip
        return StorageOperationalError(text)
    return StorageError(text)


class PostgresStorage:
    """The outbox table on PostgreSQL, through one connection the storage owns."""

    dialect = "postgresql"

    def __init__(self, url: DatabaseUrl, *, table: str = DEFAULT_TABLE) -> None:
        self.table = table
        self._url = url
        self._queries = sql.queries("postgresql", table)
        self._lock_key = claim_lock_key(table)
        self._driver: _Driver | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(
        cls, url: DatabaseUrl | str, *, table: str = DEFAULT_TABLE
    ) -> PostgresStorage:
        storage = cls(DatabaseUrl.parse(url) if isinstance(url, str) else url, table=table)
        async with storage._lock:
            await storage._connected()
        ((ready,),) = await storage._run("schema_ready", [], rows=True)
        if not ready:
            await storage.close()
            raise SchemaError(
                f"table {table} has no {table}_done: its schema is older than this relaybox "
                f"(migration 0007); run `relaybox migrate --db {storage._url.masked} "
                f"--table {table}` before starting relays of this version"
            )
        return storage

    async def _connected(self) -> _Driver:
        if self._driver is None:
            driver_class = _PsycopgDriver if self._url.driver == "psycopg" else _AsyncpgDriver
            try:
                self._driver = await driver_class.connect(self._url.libpq_dsn())
            except Exception as exc:
                raise translate(exc) from exc
        return self._driver

    async def _run(self, name: str, args: Sequence[Any], *, rows: bool) -> Any:
        return await self._run_sql(self._queries[name], args, rows=rows)

    async def _run_sql(self, query: str, args: Sequence[Any], *, rows: bool) -> Any:
        async with self._lock:
            driver = await self._connected()
            try:
                if rows:
                    return await driver.fetch(query, args)
                return await driver.execute(query, args)
            except Exception as exc:
                error = translate(exc)
                if isinstance(error, StorageOperationalError):
                    await self._drop()
                raise error from exc

    async def _atomic(self, work: Callable[[_Driver], Awaitable[T]]) -> T:
        """Run `work` in one transaction on the connection, alone."""
        async with self._lock:
            driver = await self._connected()
            try:
                await driver.execute("BEGIN", ())
                result = await work(driver)
                await driver.execute("COMMIT", ())
            except Exception as exc:
                error = translate(exc)
                if isinstance(error, StorageOperationalError) or not await _rolled_back(driver):
                    await self._drop()
                raise error from exc
            except BaseException:  # cancelled inside the transaction: never reuse it
                await self._drop()
                raise
            return result

    async def _drop(self) -> None:
        driver, self._driver = self._driver, None
        if driver is not None:
            with contextlib.suppress(Exception):  # the connection is already broken
                await driver.close()

    async def write(self, rows: Sequence[InsertRow]) -> None:
        # PostgreSQL's inserts are always one statement, so no transaction is needed.
        for statement in inserts("postgresql", self.table, "numeric_dollar", rows):
            await self._run_sql(statement.query, statement.params, rows=False)

    async def claim(
        self,
        worker: str,
        *,
        limit: int,
        lease_seconds: float,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
    ) -> Claim:
        token = uuid.uuid4()
        args = [worker, limit, _list(partitions), require_partitions(partition_count),
                _list(targets), token, float(lease_seconds), self._lock_key]  # fmt: skip
        found = await self._run("claim", args, rows=True)
        claimed = [row[1:] for row in found if not row[0]]
        if len(claimed) < len(found) and len(claimed) < limit:
            # Leases ran out: those rows are pending again; a second call takes them and
            # what waited behind them, in order.
            args[1] = limit - len(claimed)
            claimed.extend(
                row[1:] for row in await self._run("claim", args, rows=True) if not row[0]
            )
        return Claim(str(token), worker, by_seq(claimed, partition_count))

    async def read(
        self,
        *,
        limit: int,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
        in_flight: Sequence[StoredMessage] = (),
    ) -> list[StoredMessage]:
        keys = json.dumps([(m.target, m.key) for m in in_flight if m.key is not None])
        window = 2 * limit + len(in_flight)  # live rows the read looks at, as in 0005
        args = [limit, _list(partitions), require_partitions(partition_count), _list(targets),
                _array_text(m.seq for m in in_flight), keys, window]  # fmt: skip
        decoder = decode if self._url.driver == "psycopg" else decode_exact
        found = await self._run("read", args, rows=True)
        return readable(found, partition_count, decoder)

    async def settle_owned(
        self,
        worker: str,
        *,
        partition_count: int = DEFAULT_PARTITIONS,
        failed: Sequence[Failure] = (),
        abandoned: Sequence[Failure] = (),
        published: Sequence[int] = (),
        delete: bool = True,
    ) -> Settled:
        if delete and not failed and not abandoned:
            args = [worker, require_partitions(partition_count), _array_text(published)]
            return Settled(published=int(await self._run("delete_owned", args, rows=False)))
        args = [worker, require_partitions(partition_count),
                [f.seq for f in failed], [f.error for f in failed],
                [float(f.retry_in) for f in failed], [f.seq for f in abandoned],
                [f.error for f in abandoned], _array_text(published), delete]  # fmt: skip
        ((failed_n, abandoned_n, published_n),) = await self._run("settle_owned", args, rows=True)
        return Settled(int(failed_n), int(abandoned_n), int(published_n))

    async def mark_published(self, token: str, seqs: Sequence[int], *, delete: bool = False) -> int:
        name = "delete_published" if delete else "mark_published"
        return int(await self._run(name, [list(seqs), lease_token(token)], rows=False))

    async def mark_failed(self, token: str, failures: Sequence[Failure]) -> int:
        args = [[f.seq for f in failures], [f.error for f in failures],
                [float(f.retry_in) for f in failures], lease_token(token)]  # fmt: skip
        return int(await self._run("mark_failed", args, rows=False))

    async def abandon(self, token: str, failures: Sequence[Failure]) -> int:
        args = [[f.seq for f in failures], [f.error for f in failures], lease_token(token)]
        return int(await self._run("abandon", args, rows=False))

    async def release(self, token: str, seqs: Sequence[int]) -> int:
        return int(await self._run("release", [list(seqs), lease_token(token)], rows=False))

    async def renew(self, token: str, seqs: Sequence[int], lease_seconds: float) -> int:
        args = [list(seqs), lease_token(token), float(lease_seconds)]
        return int(await self._run("renew", args, rows=False))

    async def recover_expired(self) -> int:
        return int(await self._run("recover_expired", [], rows=False))

    async def purge(
        self, *, published_older_than: float, abandoned_older_than: float, batch_size: int = 500
    ) -> int:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        total = 0
        for name, age in (("purge_published", published_older_than),
                          ("purge_abandoned", abandoned_older_than)):  # fmt: skip
            while True:
                deleted = int(await self._run(name, [float(age), batch_size], rows=False))
                total += deleted
                if deleted < batch_size:
                    break
        return total

    async def replay(self, seqs: Sequence[int]) -> int:
        return int(await self._run("replay", [list(seqs)], rows=False))

    async def abandoned(
        self, *, limit: int, before: int | None = None, target: str | None = None
    ) -> list[AbandonedMessage]:
        args = [before, target, check_listing(limit)]
        return [decode_abandoned(row) for row in await self._run("abandoned", args, rows=True)]

    async def stats(self) -> OutboxStats:
        counts = {
            Status(status): int(n)
            for status, n in await self._run("count_by_status", [], rows=True)
        }
        ((age,),) = await self._run("oldest_pending_age", [], rows=True)
        ((leases,),) = await self._run("active_leases", [], rows=True)
        return OutboxStats(counts=counts, oldest_pending_age=age, active_leases=int(leases))

    async def heartbeat(
        self, worker: str, *, partitions: int, lease_seconds: float, busy: Collection[int] = ()
    ) -> Assignment:
        count, lease = require_partitions(partitions), float(lease_seconds)

        async def beat(driver: _Driver) -> Assignment:
            await driver.execute(self._queries["members_expire"], ())
            await driver.execute(self._queries["member_join"], (worker, lease))
            await driver.execute(self._queries["partitions_create"], (count,))
            ((live,),) = await driver.fetch(self._queries["members_live"], ())
            held = await driver.fetch(self._queries["partitions_renew"], (worker, lease))
            plan = rebalance((p for (p,) in held), count, int(live), busy)
            taken = await self._settle(driver, worker, lease, count, plan)
            return Assignment(
                frozenset([*plan.keep, *plan.draining, *taken]), int(live),
                frozenset(plan.draining),
            )  # fmt: skip

        return await self._atomic(beat)

    async def _settle(
        self, driver: _Driver, worker: str, lease: float, count: int, plan: Rebalance
    ) -> list[int]:
        """Give back what `plan` releases, take what it wants; the partitions taken."""
        if plan.release:
            await driver.execute(self._queries["partitions_release"], (worker, list(plan.release)))
        if not plan.wanted:
            return []
        args = (worker, lease, count, plan.wanted)
        return [p for (p,) in await driver.fetch(self._queries["partitions_take"], args)]

    async def leave(self, worker: str) -> None:
        async def part(driver: _Driver) -> None:
            await driver.execute(self._queries["partitions_leave"], (worker,))
            await driver.execute(self._queries["member_leave"], (worker,))

        await self._atomic(part)

    async def close(self) -> None:
        async with self._lock:
            await self._drop()


async def _rolled_back(driver: _Driver) -> bool:
    """False if the connection cannot be trusted any more."""
    try:
        await driver.execute("ROLLBACK", ())
    except Exception:  # noqa: BLE001 - the caller raises the original error
        return False
    return True


def _array_text(numbers: Iterable[int]) -> str:
    """Integers as PostgreSQL array text, `{1,2,3}` (see the read query's comment)."""
    return "{" + ",".join(map(str, numbers)) + "}"


def _list(values: Sequence[Any] | None) -> list[Any] | None:
    return None if values is None else list(values)
