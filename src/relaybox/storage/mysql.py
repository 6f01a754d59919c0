"""MySQL/MariaDB storage for the relay, over aiomysql (default) or asyncmy.

Both drivers are PyMySQL-shaped and take positional `%s` parameters only, so the
numbered `$n` of the shared queries become `%s` here, a list of seqs one placeholder
per value (`bind_numbered`). MySQL and MariaDB have no `UPDATE ... RETURNING`, so a
row-lease claim is one short transaction: lock due candidates with `FOR UPDATE SKIP
LOCKED`, drop those whose key is held back, lease the rest and read them back; and a
heartbeat renews, then reads, its partitions. The owned read of a relay that holds its
partitions runs the claim's steps without locks and without the lease: it writes
nothing. The session runs READ COMMITTED, so locking reads take no gap locks that
would stall writers, and UTC; on MariaDB it keeps a long list of seqs a list, which
the primary key looks up, and plans without MariaDB's column statistics
(`_server_settings`).

The URL's `connect_timeout` is the driver's own (which bounds opening the socket; the
storage bounds the whole handshake), its `command_timeout` the server's
`max_statement_time` on MariaDB and `max_execution_time` on MySQL (which stops only
SELECTs).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import itertools
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from relaybox.core.partitions import DEFAULT_PARTITIONS, require_partitions
from relaybox.core.records import Claim, StoredMessage
from relaybox.errors import (
    SchemaError,
    StorageError,
    StorageIntegrityError,
    StorageOperationalError,
)
from relaybox.storage.rows import by_seq, within_bytes
from relaybox.storage.sql import Connection, Seqs, Session, SqlStorage
from relaybox.storage.urls import GRACE, DatabaseUrl

#: A row a claim may take: seq, target, key and payload size.
Candidate = tuple[int, str, "str | None", int]

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
_NO_SUCH_TABLE = 1146
_MODULES = ("pymysql", "aiomysql", "asyncmy")


def translate(exc: BaseException) -> StorageError:
    """Map aiomysql/PyMySQL/asyncmy errors onto relaybox's storage branch."""
    if isinstance(exc, StorageError):
        return exc
    name = type(exc).__name__
    ours = type(exc).__module__.startswith(_MODULES)
    errno = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    text = f"MySQL: {exc}"
    if ours and errno == _NO_SUCH_TABLE:
        return SchemaError(text)
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
            "client_flag": _FOUND_ROWS, "connect_timeout": url.connect_timeout + GRACE,
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
            for statement in (*_SESSION, *_server_settings(connection, url)):
                await driver.execute(statement, ())
        except BaseException:
            await driver.discard()
            raise
        return driver

    async def fetch(self, query: str, args: Sequence[Any]) -> list[Sequence[Any]]:
        async with self._connection.cursor() as cursor:
            await cursor.execute(query, args or None)
            return list(await cursor.fetchall())

    async def execute(self, query: str, args: Sequence[Any]) -> int:
        async with self._connection.cursor() as cursor:
            await cursor.execute(query, args or None)
            return int(cursor.rowcount)

    async def begin(self) -> None:
        await self._connection.begin()

    async def commit(self) -> None:
        await self._connection.commit()

    async def rollback(self) -> None:
        await self._connection.rollback()

    async def close(self) -> None:
        await self._connection.ensure_closed()

    async def discard(self) -> None:
        """Drop the socket without a goodbye: the protocol state is unknown."""
        self._connection.close()


def _server_settings(connection: Any, url: DatabaseUrl) -> tuple[str, ...]:
    """The session settings of this server: the one that stops a statement after the
    URL's `command_timeout`, and on MariaDB two that keep its plans to what relaybox's queries say.

    MariaDB turns a list of 1000 values or more (`seq IN (...)`, a batch of 1000 seqs)
    into a table of values joined to the statement's tables, and then planned a walk
    of the whole outbox table, probing that table once per row, for every read and
    settle of such a batch; as a list, the seqs are looked up in the primary key.
    And its own column statistics (`ANALYZE TABLE ... PERSISTENT FOR ...`), once
    collected, are read for every statement: taken while the outbox was empty, they
    priced a walk of the whole table as nothing; taken on a backlog, they cost a read's
    per-key check seconds of planning, its list of keys priced key by key against the
    histograms (4 s for a read of 2000 rows, 150 ms for one of 500). relaybox's
    statements name the indexes they walk and need no column statistics."""
    if "mariadb" in str(connection.get_server_info()).lower():
        return (
            f"SET SESSION max_statement_time = {url.command_timeout:.3f}",
            "SET SESSION in_predicate_conversion_threshold = 0",
            "SET SESSION use_stat_tables = 'NEVER'",
        )
    return (f"SET SESSION max_execution_time = {url.command_timeout_ms}",)


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


_NUMBERED = re.compile(r"\$(\d+)")


@functools.cache
def _numbered(query: str) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """A query's text around its `$n` placeholders (with `%` doubled, as the drivers
    %-format it) and the argument each takes; None for a query in positional `%s`."""
    pieces = _NUMBERED.split(query)
    if len(pieces) == 1:
        return None
    texts = tuple(text.replace("%", "%%") for text in pieces[0::2])
    return texts, tuple(int(n) - 1 for n in pieces[1::2])


def bind_numbered(query: str, args: Sequence[Any]) -> tuple[str, list[Any]]:
    """`query` with `$n` placeholders as `%s` and its parameters in that order: a
    repeated number repeats its value, a list of seqs becomes one `%s` per value (an
    empty one NULL, which matches nothing)."""
    plan = _numbered(query)
    if plan is None:
        return query, list(args)
    texts, indexes = plan
    parts, params = [texts[0]], list[Any]()
    for index, text in zip(indexes, texts[1:], strict=True):
        value = args[index]
        if type(value) is Seqs:
            parts.append(", ".join(["%s"] * len(value)) or "NULL")
            params.extend(value)
        else:
            parts.append("%s")
            params.append(value)
        parts.append(text)
    return "".join(parts), params


class MySQLStorage(SqlStorage):
    """The outbox table on MySQL 8 or MariaDB 10.6+."""

    dialect = "mysql"
    label = "MySQL"

    async def _open(self) -> Connection:
        return await _Driver.connect(self._url)

    translate = staticmethod(translate)

    def _seqs(self, seqs: Seqs) -> Seqs:
        return seqs  # spread by _bind

    def _value(self, value: datetime.datetime | uuid.UUID) -> Any:
        """Times as naive UTC (DATETIME(6) has no zone), uuids as text."""
        if isinstance(value, uuid.UUID):
            return str(value)
        return value.astimezone(datetime.UTC).replace(tzinfo=None)

    def _bind(self, name: str, args: Sequence[Any]) -> tuple[str, Sequence[Any]]:
        query, params = bind_numbered(self._queries[name], args)
        if not any(type(arg) is Seqs for arg in args):
            # Its text is the same at every call: a stall can name it. (A list of seqs
            # makes a text per length; those are named by their first word.)
            self._query_names.setdefault(query, name)
        return query, params

    def _query(self, name: str, *, seqs: int = 0, pairs: int = 0, filters: str = "") -> str:
        """A claim step with its list markers expanded into placeholders."""
        return (
            self._queries[name]
            .replace("{seqs}", _marks(seqs))
            .replace("{pairs}", ", ".join(["(%s, %s)"] * pairs))
            .replace("{filters}", filters)
        )

    # -- heartbeats: no UPDATE ... RETURNING ------------------------------------------

    async def _create_partitions(self, session: Session, count: int, target: str) -> None:
        if int(await session.one("partitions_count", count, target)) < count:
            await session.execute("partitions_create", json.dumps(list(range(count))), target)

    async def _renew_partitions(
        self, session: Session, worker: str, lease: float, target: str
    ) -> list[int]:
        await session.execute("partitions_renew", worker, lease, target)
        return [int(p) for (p,) in await session.fetch("partitions_held", worker, target)]

    async def _take_partitions(
        self, session: Session, worker: str, lease: float, count: int, wanted: int, target: str
    ) -> list[int]:
        found = await session.fetch("partitions_free", count, wanted, target)
        taken = [int(p) for (p,) in found]
        if taken:
            await session.execute("partitions_take", worker, lease, Seqs(taken), target)
        return taken

    # -- the claim and the owned read -------------------------------------------------

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
        token = str(uuid.uuid4())
        count = require_partitions(partition_count)
        if _nothing_asked(limit, partitions, targets):
            return Claim(token=token, worker=worker, messages=[])
        filters, values = _filters(partitions, targets, count)

        async def lease(session: Session) -> list[Sequence[Any]]:
            driver = session.connection
            candidates = await self._candidates(driver, limit, filters, values, lock=True)
            ready = _within(candidates, await self._unblocked(driver, candidates), max_bytes)
            if not ready:
                return []
            args = [worker, token, float(lease_seconds), *ready]
            await driver.execute(self._query("claim_lease", seqs=len(ready)), args)
            return await driver.fetch(self._query("claim_rows", seqs=len(ready)), ready)

        found = await self._run(lease, atomic=True)
        return Claim(token=token, worker=worker, messages=by_seq(found, count))

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
        count = require_partitions(partition_count)
        if _nothing_asked(limit, partitions, targets):
            return []
        busy = sorted(m.seq for m in in_flight)
        keys = sorted({(m.target, m.key) for m in in_flight if m.key is not None})
        filters, values = _filters(partitions, targets, count, busy, keys)

        async def read(session: Session) -> list[Sequence[Any]]:
            driver = session.connection
            candidates = await self._candidates(driver, limit, filters, values, lock=False)
            ready = await self._unblocked(driver, candidates)
            ready = _within(candidates, ready, max_bytes, at_least_one)
            if not ready:
                return []
            return await driver.fetch(self._query("claim_rows", seqs=len(ready)), ready)

        return by_seq(await self._run(read), count)

    async def _candidates(
        self, driver: Connection, limit: int, filters: str, values: list[Any], *, lock: bool
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
            found = sorted([*found, *((int(s), t, k, int(n)) for s, t, k, n in rows)])[:limit]
            if len(found) == limit:
                bound = found[-1][0]
        return found

    async def _unblocked(self, driver: Connection, candidates: list[Candidate]) -> list[int]:
        """The candidates no earlier live row of their (target, key) holds back."""
        seqs = [seq for seq, _, _, _ in candidates]
        pairs = sorted({(target, key) for _, target, key, _ in candidates if key is not None})
        if not pairs:
            return seqs
        query = self._query("claim_blockers", seqs=len(seqs), pairs=len(pairs))
        args = [*itertools.chain.from_iterable(pairs), seqs[-1], *seqs]
        blockers: dict[tuple[str, str], int] = {}
        for target, key, seq in await driver.fetch(query, args):
            same = _same_key(target, key)
            blockers[same] = min(int(seq), blockers.get(same, _MAX_SEQ))
        return [
            seq for seq, target, key, _ in candidates
            if key is None or seq < blockers.get(_same_key(target, key), _MAX_SEQ)
        ]  # fmt: skip


def _within(
    candidates: list[Candidate], ready: list[int], max_bytes: int | None, at_least_one: bool = True
) -> list[int]:
    """The `ready` seqs (in seq order) a claim takes under its byte budget, by the
    payload sizes the candidates came with: only those rows' payloads are fetched."""
    if max_bytes is None:
        return ready
    sizes = {seq: size for seq, _, _, size in candidates}
    return ready[: within_bytes((sizes[seq] for seq in ready), max_bytes, at_least_one)]


def _nothing_asked(
    limit: int, partitions: Sequence[int] | None, targets: Sequence[str] | None
) -> bool:
    return (
        limit < 1
        or (partitions is not None and not partitions)
        or (targets is not None and not targets)
    )


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
