"""MySQL/MariaDB storage for the relay, over aiomysql (default) or asyncmy.

Both drivers are PyMySQL-shaped and run the same `%s` SQL from sql/mysql/queries.sql.
MySQL and MariaDB have no `UPDATE ... RETURNING`, so a claim is one short transaction:
lock due candidates with `FOR UPDATE SKIP LOCKED`, drop those whose key is held back,
lease the rest and read them back. The session runs READ COMMITTED, so the claim's
locking reads take no gap locks that would stall writers, and UTC. The owned read of a
relay that holds its partitions runs the same steps without locks and without the
lease: it writes nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar

from relaybox import sql
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.lifecycle import Status
from relaybox.core.partitions import DEFAULT_PARTITIONS, Rebalance, rebalance, require_partitions
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
from relaybox.errors import StorageError, StorageIntegrityError, StorageOperationalError
from relaybox.sql.inserts import inserts
from relaybox.storage.rows import by_seq, check_listing, decode_abandoned, lease_token
from relaybox.storage.urls import DatabaseUrl

T = TypeVar("T")
Candidate = tuple[int, str, "str | None"]

#: CLIENT_FOUND_ROWS: an UPDATE reports the rows it matched, as PostgreSQL does.
_FOUND_ROWS = 2
_MAX_SEQ = 2**63 - 1
_SESSION = (
    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
    "SET time_zone = '+00:00'",
)
# Server errors worth a retry: lock wait timeout, deadlock, too many connections,
# shutdown, network, interrupted or timed-out statement, killed connection, read-only
# (failover), Galera not ready. Client-side errors (2000-2999) are all connection trouble.
_TRANSIENT = frozenset({1205, 1213, 1040, 1053, 1152, 1158, 1159, 1160, 1161, 1180, 1290,
                        1317, 1792, 1836, 1927, 1969, 3024, 4031, 1047, 1020})  # fmt: skip
# Duplicate key, foreign key, NOT NULL, no default, CHECK (MariaDB 4025, MySQL 3819).
_INTEGRITY = frozenset({1062, 1586, 1451, 1452, 1216, 1217, 1048, 1364, 4025, 3819})
_MODULES = ("pymysql", "aiomysql", "asyncmy")


def translate(exc: BaseException) -> StorageError:
    """Map aiomysql/PyMySQL/asyncmy errors onto relaybox's storage branch."""
    if isinstance(exc, StorageError):
        return exc
    name = type(exc).__name__
    ours = type(exc).__module__.startswith(_MODULES)
    errno = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    text = f"MySQL: {exc}"
    if ours and (name == "IntegrityError" or errno in _INTEGRITY):
        return StorageIntegrityError(text)
    if isinstance(exc, OSError | EOFError | asyncio.TimeoutError):
        return StorageOperationalError(text)
    if ours and (name == "InterfaceError" or errno in _TRANSIENT or _client_side(errno)):
        return StorageOperationalError(text)
    return StorageError(text)


def _client_side(errno: int | None) -> bool:
    return errno is not None and (errno == 0 or 2000 <= errno < 3000)


class _Driver:
    """The handful of calls relaybox makes; aiomysql and asyncmy share their shape."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    @classmethod
    async def connect(cls, url: DatabaseUrl) -> _Driver:
        options: dict[str, Any] = {
            "host": url.host or "localhost", "port": url.port or 3306, "user": url.user,
            "password": url.password or "", "autocommit": True, "charset": "utf8mb4",
            "client_flag": _FOUND_ROWS,
            "connect_timeout": float(url.query.get("connect_timeout", 10)),
        }  # fmt: skip
        if "unix_socket" in url.query:
            options["unix_socket"] = url.query["unix_socket"]
        if url.driver == "asyncmy":
            import asyncmy

            connection = await asyncmy.connect(database=url.database or None, **options)
        else:
            import aiomysql

            connection = await aiomysql.connect(db=url.database or None, **options)
            _escape_bytes_as_hex(connection)
        driver = cls(connection)
        try:
            for statement in _SESSION:
                await driver.execute(statement, None)
        except BaseException:
            driver.abort()
            raise
        return driver

    async def fetch(self, query: str, args: Sequence[Any] | None) -> list[Sequence[Any]]:
        async with self._connection.cursor() as cursor:
            await cursor.execute(query, args)
            return list(await cursor.fetchall())

    async def execute(self, query: str, args: Sequence[Any] | None) -> int:
        async with self._connection.cursor() as cursor:
            await cursor.execute(query, args)
            return int(cursor.rowcount)

    async def begin(self) -> None:
        await self._connection.begin()

    async def commit(self) -> None:
        await self._connection.commit()

    async def rollback(self) -> None:
        await self._connection.rollback()

    async def close(self) -> None:
        await self._connection.ensure_closed()

    def abort(self) -> None:
        """Drop the socket without a goodbye: the protocol state is unknown."""
        self._connection.close()


def _escape_bytes_as_hex(connection: Any) -> None:
    """Work around aio-libs/aiomysql#1080 on this one connection.

    aiomysql 0.3 escapes bytes with PyMySQL's `escape_bytes_prefixed`, which PyMySQL 1.2.3
    turned into a string, so every bytes parameter raises TypeError. Escape bytes the way
    PyMySQL 1.2 itself does (`_binary X'..'`) and leave everything else to aiomysql.
    """
    escape = connection.escape

    def escape_with_bytes(value: Any) -> Any:
        if isinstance(value, bytes | bytearray):
            return f"_binary X'{bytes(value).hex()}'"
        return escape(value)

    connection.escape = escape_with_bytes


class MySQLStorage:
    """The outbox table on MySQL 8 or MariaDB 10.6+, through one connection it owns."""

    dialect = "mysql"

    def __init__(self, url: DatabaseUrl, *, table: str = DEFAULT_TABLE) -> None:
        self.table = table
        self._url = url
        self._queries = {
            name: _uncommented(text) for name, text in sql.queries("mysql", table).items()
        }
        self._driver: _Driver | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, url: DatabaseUrl | str, *, table: str = DEFAULT_TABLE) -> MySQLStorage:
        storage = cls(DatabaseUrl.parse(url) if isinstance(url, str) else url, table=table)
        async with storage._lock:
            await storage._connected()
        return storage

    async def _connected(self) -> _Driver:
        if self._driver is None:
            try:
                self._driver = await _Driver.connect(self._url)
            except Exception as exc:
                raise translate(exc) from exc
        return self._driver

    async def _run(
        self, work: Callable[[_Driver], Awaitable[T]], *, transaction: bool = False
    ) -> T:
        """Run `work` on the connection, alone; in a transaction if asked."""
        async with self._lock:
            driver = await self._connected()
            try:
                if not transaction:
                    return await work(driver)
                await driver.begin()
                result = await work(driver)
                await driver.commit()
                return result
            except Exception as exc:
                error = translate(exc)
                broken = isinstance(error, StorageOperationalError)
                if broken or (transaction and not await _rolled_back(driver)):
                    self._abort()
                raise error from exc
            except BaseException:  # cancelled mid-statement: the connection is unusable
                self._abort()
                raise

    def _abort(self) -> None:
        """Forget a connection that cannot be trusted; the next call reconnects."""
        driver, self._driver = self._driver, None
        if driver is not None:
            driver.abort()

    def _query(
        self, name: str, *, seqs: int = 0, pairs: int = 0, filters: str = "", partitions: int = 0
    ) -> str:
        """A named query with its list markers expanded into placeholders."""
        return (
            self._queries[name]
            .replace("{seqs}", _marks(seqs))
            .replace("{partitions}", _marks(partitions))
            .replace("{pairs}", ", ".join(["(%s, %s)"] * pairs))
            .replace("{filters}", filters)
        )

    async def _execute(self, query: str, args: Sequence[Any] | None) -> int:
        return await self._run(lambda driver: driver.execute(query, args))

    async def _update(self, name: str, seqs: Sequence[int], *args: Any) -> int:
        """Run a query on the rows `seqs`: `args` are the values after the seq list."""
        if not seqs:
            return 0
        query = self._query(name, seqs=len(seqs))
        return await self._execute(query, [*sorted(int(s) for s in seqs), *args])

    async def write(self, rows: Sequence[InsertRow]) -> None:
        statements = inserts("mysql", self.table, "format", rows)  # key locks, then chunks

        async def insert(driver: _Driver) -> None:
            for statement in statements:
                await driver.execute(statement.query, list(statement.params))

        if rows:
            await self._run(insert, transaction=True)

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
        token = str(uuid.uuid4())
        count = require_partitions(partition_count)
        if (
            limit < 1
            or (partitions is not None and not partitions)
            or (targets is not None and not targets)
        ):
            return Claim(token=token, worker=worker, messages=[])
        filters, values = _filters(partitions, targets, count)

        async def lease(driver: _Driver) -> list[Sequence[Any]]:
            candidates = await self._candidates(driver, limit, filters, values, lock=True)
            ready = await self._unblocked(driver, candidates)
            if not ready:
                return []
            args = [worker, token, float(lease_seconds), *ready]
            await driver.execute(self._query("claim_lease", seqs=len(ready)), args)
            return await driver.fetch(self._query("claim_rows", seqs=len(ready)), ready)

        found = await self._run(lease, transaction=True)
        return Claim(token=token, worker=worker, messages=by_seq(found, count))

    async def read(
        self,
        *,
        limit: int,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
        in_flight: Sequence[StoredMessage] = (),
    ) -> list[StoredMessage]:
        count = require_partitions(partition_count)
        if (
            limit < 1
            or (partitions is not None and not partitions)
            or (targets is not None and not targets)
        ):
            return []
        busy = sorted(m.seq for m in in_flight)
        keys = sorted({(m.target, m.key) for m in in_flight if m.key is not None})
        filters, values = _filters(partitions, targets, count, busy, keys)

        async def read(driver: _Driver) -> list[Sequence[Any]]:
            candidates = await self._candidates(driver, limit, filters, values, lock=False)
            ready = await self._unblocked(driver, candidates)
            if not ready:
                return []
            return await driver.fetch(self._query("claim_rows", seqs=len(ready)), ready)

        return by_seq(await self._run(read), count)

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
        fence = [require_partitions(partition_count), worker]
        failures = [[f.seq, _text(f.error), float(f.retry_in)] for f in _ordered(failed)]
        given_up = [[f.seq, _text(f.error)] for f in _ordered(abandoned)]
        done = sorted(int(s) for s in published)

        async def settle(driver: _Driver) -> Settled:
            counts = [0, 0, 0]
            for index, (name, rows) in enumerate((("fail_owned", failures),
                                                  ("abandon_owned", given_up))):  # fmt: skip
                if rows:
                    args = [json.dumps(rows, ensure_ascii=False), *fence]
                    counts[index] = await driver.execute(self._queries[name], args)
            if done:
                query = self._query("delete_owned" if delete else "publish_owned", seqs=len(done))
                counts[2] = await driver.execute(query, [*done, *fence])
            return Settled(*counts)

        return await self._run(settle, transaction=True)

    async def _candidates(
        self, driver: _Driver, limit: int, filters: str, values: list[Any], *, lock: bool
    ) -> list[Candidate]:
        """The first `limit` due rows in seq order, one live-index range per status;
        locked (FOR UPDATE SKIP LOCKED) when `lock`."""
        found: list[Candidate] = []
        bound = _MAX_SEQ
        marker = "FOR UPDATE SKIP LOCKED" if lock else ""
        due = self._query("claim_due", filters=filters).replace("{lock}", marker)
        expired = self._query("claim_expired", filters=filters).replace("{lock}", marker)
        for query, head in ((due, ["pending"]), (due, ["failed"]), (expired, [])):
            rows = await driver.fetch(query, [*head, bound, *values, limit])
            found = sorted([*found, *((int(s), t, k) for s, t, k in rows)])[:limit]
            if len(found) == limit:
                bound = found[-1][0]
        return found

    async def _unblocked(self, driver: _Driver, candidates: list[Candidate]) -> list[int]:
        """The candidates no earlier live row of their (target, key) holds back."""
        seqs = [seq for seq, _, _ in candidates]
        pairs = sorted({(target, key) for _, target, key in candidates if key is not None})
        if not pairs:
            return seqs
        query = self._query("claim_blockers", seqs=len(seqs), pairs=len(pairs))
        args = [*itertools.chain.from_iterable(pairs), seqs[-1], *seqs]
        blockers: dict[tuple[str, str], int] = {}
        for target, key, seq in await driver.fetch(query, args):
            same = _same_key(target, key)
            blockers[same] = min(int(seq), blockers.get(same, _MAX_SEQ))
        return [
            seq for seq, target, key in candidates
            if key is None or seq < blockers.get(_same_key(target, key), _MAX_SEQ)
        ]  # fmt: skip

    async def mark_published(self, token: str, seqs: Sequence[int], *, delete: bool = False) -> int:
        name = "delete_published" if delete else "mark_published"
        return await self._update(name, seqs, lease_token(token))

    async def mark_failed(self, token: str, failures: Sequence[Failure]) -> int:
        rows = [[f.seq, _text(f.error), float(f.retry_in)] for f in _ordered(failures)]
        return await self._by_json("mark_failed", rows, token)

    async def abandon(self, token: str, failures: Sequence[Failure]) -> int:
        return await self._by_json(
            "abandon", [[f.seq, _text(f.error)] for f in _ordered(failures)], token
        )

    async def _by_json(self, name: str, rows: list[list[Any]], token: str) -> int:
        if not rows:
            return 0
        return await self._execute(
            self._queries[name], [json.dumps(rows, ensure_ascii=False), lease_token(token)]
        )

    async def release(self, token: str, seqs: Sequence[int]) -> int:
        return await self._update("release", seqs, lease_token(token))

    async def renew(self, token: str, seqs: Sequence[int], lease_seconds: float) -> int:
        if not seqs:
            return 0
        query = self._query("renew", seqs=len(seqs))
        return await self._execute(
            query, [float(lease_seconds), *sorted(int(s) for s in seqs), lease_token(token)]
        )

    async def recover_expired(self) -> int:
        return await self._execute(self._queries["recover_expired"], None)

    async def purge(
        self, *, published_older_than: float, abandoned_older_than: float, batch_size: int = 500
    ) -> int:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        total = 0
        for name, age in (("purge_published", published_older_than),
                          ("purge_abandoned", abandoned_older_than)):  # fmt: skip
            while True:
                deleted = await self._execute(self._queries[name], [float(age), int(batch_size)])
                total += deleted
                if deleted < batch_size:
                    break
        return total

    async def replay(self, seqs: Sequence[int]) -> int:
        return await self._update("replay", seqs)

    async def abandoned(
        self, *, limit: int, before: int | None = None, target: str | None = None
    ) -> list[AbandonedMessage]:
        args = [before, before, target, target, check_listing(limit)]
        query = self._queries["abandoned"]

        async def read(driver: _Driver) -> list[AbandonedMessage]:
            return [decode_abandoned(row) for row in await driver.fetch(query, args)]

        return await self._run(read)

    async def stats(self) -> OutboxStats:
        async def read(driver: _Driver) -> OutboxStats:
            counts = await driver.fetch(self._queries["count_by_status"], None)
            ((age,),) = await driver.fetch(self._queries["oldest_pending_age"], None)
            ((leases,),) = await driver.fetch(self._queries["active_leases"], None)
            return OutboxStats(
                counts={Status(status): int(n) for status, n in counts},
                oldest_pending_age=None if age is None else float(age),
                active_leases=int(leases),
            )

        return await self._run(read)

    async def heartbeat(
        self, worker: str, *, partitions: int, lease_seconds: float, busy: Collection[int] = ()
    ) -> Assignment:
        count, lease = require_partitions(partitions), float(lease_seconds)

        async def beat(driver: _Driver) -> Assignment:
            await driver.execute(self._queries["members_expire"], None)
            await driver.execute(self._queries["member_join"], [worker, lease, lease])
            await self._create_partitions(driver, count)
            ((live,),) = await driver.fetch(self._queries["members_live"], None)
            await driver.execute(self._queries["partitions_renew"], [lease, worker])
            held = await driver.fetch(self._queries["partitions_held"], [worker])
            plan = rebalance((int(p) for (p,) in held), count, int(live), busy)
            taken = await self._settle(driver, worker, lease, count, plan)
            return Assignment(
                frozenset([*plan.keep, *plan.draining, *taken]), int(live),
                frozenset(plan.draining),
            )  # fmt: skip

        return await self._run(beat, transaction=True)

    async def _create_partitions(self, driver: _Driver, count: int) -> None:
        ((found,),) = await driver.fetch(self._queries["partitions_count"], [count])
        if int(found) < count:
            await driver.execute(
                self._queries["partitions_create"], [json.dumps(list(range(count)))]
            )

    async def _settle(
        self, driver: _Driver, worker: str, lease: float, count: int, plan: Rebalance
    ) -> list[int]:
        """Give back what `plan` releases, take what it wants; the partitions taken."""
        if plan.release:
            query = self._query("partitions_release", partitions=len(plan.release))
            await driver.execute(query, [worker, *plan.release])
        if not plan.wanted:
            return []
        free = await driver.fetch(self._queries["partitions_free"], [count, plan.wanted])
        taken = [int(p) for (p,) in free]
        if taken:
            query = self._query("partitions_take", partitions=len(taken))
            await driver.execute(query, [worker, lease, *taken])
        return taken

    async def leave(self, worker: str) -> None:
        async def part(driver: _Driver) -> None:
            await driver.execute(self._queries["partitions_leave"], [worker])
            await driver.execute(self._queries["member_leave"], [worker])

        await self._run(part, transaction=True)

    async def close(self) -> None:
        async with self._lock:
            driver, self._driver = self._driver, None
            if driver is not None:
                try:
                    await driver.close()
                except Exception:  # noqa: BLE001 - closing a broken connection
                    driver.abort()


async def _rolled_back(driver: _Driver) -> bool:
    """False if the connection cannot be trusted any more."""
    try:
        await driver.rollback()
    except Exception:  # noqa: BLE001 - the caller raises the original error
        return False
    return True


def _uncommented(query: str) -> str:
    """Drop whole-line comments: drivers %-format the text, comments included."""
    return "\n".join(line for line in query.splitlines() if not line.lstrip().startswith("--"))


def _marks(count: int) -> str:
    return ", ".join(["%s"] * count)


def _filters(
    partitions: Sequence[int] | None,
    targets: Sequence[str] | None,
    count: int,
    busy: Sequence[int] = (),
    busy_keys: Sequence[Sequence[Any]] = (),
) -> tuple[str, list[Any]]:
    """The claim's row filters: partitions (stored hash modulo `count`), targets, and
    for an owned read what is in flight (its rows, and its keys' other rows)."""
    text: list[str] = []
    values: list[Any] = []
    if partitions is not None:
        text.append(f"AND MOD(`partition`, %s) IN ({_marks(len(partitions))})")
        values.extend([count, *(int(p) for p in partitions)])
    if targets is not None:
        text.append(f"AND target IN ({_marks(len(targets))})")
        values.extend(str(t) for t in targets)
    if busy_keys:
        pairs = ", ".join(["(%s, %s)"] * len(busy_keys))
        text.append(f"AND (live_key IS NULL OR (target, live_key) NOT IN ({pairs}))")
        values.extend(itertools.chain.from_iterable(busy_keys))
    if busy:
        text.append(f"AND seq NOT IN ({_marks(len(busy))})")
        values.extend(busy)
    return " ".join(text), values


def _same_key(target: str, key: str) -> tuple[str, str]:
    """Keys as the table compares them: utf8mb4_bin pads, so trailing spaces do not count."""
    return target.rstrip(" "), key.rstrip(" ")


def _ordered(failures: Sequence[Failure]) -> list[Failure]:
    """Rows in seq order, so two sessions lock them in the same order."""
    return sorted(failures, key=lambda f: f.seq)


def _text(value: str) -> str:
    """An error as valid UTF-8: a lone surrogate must not make the mark itself fail."""
    return str(value).encode("utf-8", "replace").decode("utf-8")
