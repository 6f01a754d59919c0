"""In-memory storage: the outbox table as Python objects, for tests and demos.

It follows the SQL storage rule for rule (the conformance suite runs against all of
them): the same claim order and per-(target, key) blocking, fenced marks, the same
transitions and counters. Every operation runs under one `threading.Lock` with no
await inside, so it is atomic for coroutines and for threads (an in-memory writer may
insert from another thread). Times are floats from `clock`, injectable for tests.

Like the SQLite backend, "expired" and "older than" include the boundary instant
(`<=`): back-to-back operations can read the same clock value, where PostgreSQL's
now() would already have moved on between transactions.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from relaybox.core.activity import (
    ACTIVITY_RETENTION,
    NO_LAG,
    STATUS_LIVE_SECONDS,
    ActivityPoint,
    Lag,
    RelayStatus,
    TargetActivity,
    minute_of,
    minute_start,
)
from relaybox.core.identifiers import DEFAULT_TABLE, validate_table_name
from relaybox.core.inspection import (
    HELD_UNTIL,
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
from relaybox.core.lifecycle import LIVE_STATES, Status
from relaybox.core.message import DEFAULT_TARGET
from relaybox.core.partitions import DEFAULT_PARTITIONS, rebalance, require_partitions
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
from relaybox.errors import StorageIntegrityError
from relaybox.storage.rows import as_utc, check_listing, within_bytes

Clock = Callable[[], float]
#: The held rows' due time, in the clock's epoch seconds.
_HELD = HELD_UNTIL.timestamp()
#: Positions in `InsertRow` of the columns the SQL tables declare NOT NULL.
_REQUIRED = {0: "id", 1: "target", 3: "topic", 5: "partition", 6: "type", 7: "content_type",
             8: "payload", 9: "headers", 14: "occurred_at"}  # fmt: skip


@dataclasses.dataclass(slots=True)
class _Row:
    """One outbox row; the mutable columns mirror the SQL table's."""

    seq: int
    id: uuid.UUID
    target: str
    external: bool
    topic: str
    key: str | None
    partition: int
    type: str
    content_type: str
    payload: bytes
    headers: str
    correlation_id: str | None
    causation_id: str | None
    tenant_id: str | None
    aggregate_id: str | None
    occurred_at: datetime.datetime
    available_at: float
    status: Status = Status.PENDING
    attempts: int = 0
    locked_by: str | None = None
    locked_until: float | None = None
    lock_token: str | None = None
    published_at: float | None = None
    abandoned_at: float | None = None
    last_error: str | None = None
    created_at: float = 0.0

    def due(self, now: float) -> bool:
        if self.status is Status.PROCESSING:
            return self.locked_until is not None and self.locked_until <= now
        return self.status in LIVE_STATES and self.available_at <= now

    def unlock(self, status: Status) -> None:
        self.status = status
        self.locked_by = self.locked_until = self.lock_token = None

    @property
    def held(self) -> bool:
        """Live, not leased, and due at the held time: kept from the relay."""
        return self.status in (Status.PENDING, Status.FAILED) and self.available_at >= _HELD

    def give_up(self, error: str, now: float, *, hold_keys: bool) -> None:
        """Abandon the row after a failed attempt, or, with `hold_keys` and a key,
        hold it (failed, due at the held time) so its key's later rows wait."""
        self.attempts += 1
        self.last_error = error
        if hold_keys and self.key is not None:
            self.unlock(Status.FAILED)
            self.available_at = _HELD
        else:
            self.unlock(Status.ABANDONED)
            self.abandoned_at = now

    def message(self, partitions: int) -> StoredMessage:
        return StoredMessage(
            seq=self.seq, id=self.id, target=self.target, external=self.external,
            topic=self.topic, key=self.key, partition=self.partition % partitions,
            type=self.type,
            content_type=self.content_type, payload=self.payload,
            headers=json.loads(self.headers), correlation_id=self.correlation_id,
            causation_id=self.causation_id, tenant_id=self.tenant_id,
            aggregate_id=self.aggregate_id, occurred_at=self.occurred_at,
            attempts=self.attempts,
        )  # fmt: skip


def _abandoned(row: _Row) -> AbandonedMessage:
    return AbandonedMessage(
        seq=row.seq, id=row.id, target=row.target, topic=row.topic, key=row.key,
        type=row.type, attempts=row.attempts, last_error=row.last_error,
        abandoned_at=datetime.datetime.fromtimestamp(row.abandoned_at or 0.0, datetime.UTC),
        occurred_at=row.occurred_at,
    )  # fmt: skip


def _check(row: InsertRow) -> None:
    """What the SQL backends' NOT NULL and JSON constraints reject."""
    for position, name in _REQUIRED.items():
        if row[position] is None:
            raise StorageIntegrityError(f"memory: column {name!r} must not be NULL")
    try:
        json.loads(row[9])
    except ValueError as exc:
        raise StorageIntegrityError(f"memory: headers are not valid JSON: {exc}") from exc


def _token(token: str) -> str:
    """The canonical text of a lease token; a malformed one raises ValueError."""
    return str(uuid.UUID(token))


class MemoryStorage:
    """The outbox table in process memory; `clock` gives epoch seconds (default time.time)."""

    dialect = "memory"
    reads_behind_in_flight = True

    def __init__(self, table: str = DEFAULT_TABLE, *, clock: Clock = time.time) -> None:
        self.table = validate_table_name(table)
        self._clock = clock
        self._seqs = itertools.count(1)
        self._rows: dict[int, _Row] = {}  # insertion order is seq order
        self._members: dict[tuple[str, str], float] = {}  # (worker, target) -> lease_until
        self._joined: dict[tuple[str, str], float] = {}  # (worker, target) -> joined at
        #: (target, partition) -> (owner, lease_until)
        self._owners: dict[tuple[str, int], tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._audit: list[AuditRecord] = []
        self._backfills: dict[str, BackfillJob] = {}
        self._audit_ids = itertools.count(1)
        #: (target, minute, worker) -> counts, as the activity table holds them.
        self._activity: dict[tuple[str, int, str], _Activity] = {}
        #: (worker, target) -> the status row, its updated_at in epoch seconds.
        self._statuses: dict[tuple[str, str], tuple[TargetActivity, float]] = {}

    def insert(self, rows: Sequence[InsertRow]) -> list[int]:
        """Insert rows at once (all or none) and return their seqs; usable from sync code."""
        for row in rows:
            _check(row)
        with self._lock:
            now = self._clock()
            created = [self._new_row(row, now) for row in rows]
            self._rows.update((r.seq, r) for r in created)
        return [r.seq for r in created]

    def _new_row(self, row: InsertRow, now: float) -> _Row:
        (id_, target, external, topic, key, partition, type_, content_type, payload,
         headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
         delay) = row  # fmt: skip
        return _Row(
            next(self._seqs), id_, target, bool(external), topic, key, int(partition), type_,
            content_type, bytes(payload), headers, correlation_id, causation_id, tenant_id,
            aggregate_id, as_utc(occurred_at), now + float(delay or 0.0), created_at=now,
        )  # fmt: skip

    async def write(self, rows: Sequence[InsertRow]) -> None:
        self.insert(rows)

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
        if limit < 0:
            raise ValueError("limit must not be negative")
        count = require_partitions(partition_count)
        token = str(uuid.uuid4())
        parts = None if partitions is None else frozenset(partitions)
        names = None if targets is None else frozenset(targets)
        with self._lock:
            now = self._clock()
            chosen = self._claimable(now, limit, parts, count, names)
            chosen = chosen[: within_bytes((len(row.payload) for row in chosen), max_bytes)]
            for row in chosen:
                row.status, row.locked_by, row.lock_token = Status.PROCESSING, worker, token
                row.locked_until = now + float(lease_seconds)
            messages = [row.message(count) for row in chosen]
        return Claim(token=token, worker=worker, messages=messages)

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
        """As the SQL reads choose: walk live rows of the partitions in seq order; a row
        in flight, waiting, or claimed by a row-lease relay holds back its key."""
        if limit < 0:
            raise ValueError("limit must not be negative")
        count = require_partitions(partition_count)
        parts = None if partitions is None else frozenset(partitions)
        names = None if targets is None else frozenset(targets)
        busy = frozenset(m.seq for m in in_flight)
        taken: list[StoredMessage] = []
        with self._lock:
            now = self._clock()
            stopped = (
                set()
                if after_in_flight
                else {
                    (r.target, r.key)
                    for r in (self._rows.get(seq) for seq in busy)
                    if r is not None and r.key is not None
                }
            )
            for row in self._rows.values():
                if len(taken) >= limit:
                    break
                if row.status not in LIVE_STATES or (names is not None and row.target not in names):
                    continue
                chain = None if row.key is None else (row.target, row.key)
                leased = row.status is Status.PROCESSING and not row.due(now)
                waiting = row.status is not Status.PROCESSING and not row.due(now)
                if chain is not None and (chain in stopped or leased or waiting):
                    stopped.add(chain)  # across partitions too: a key never spans two
                    continue
                in_scope = parts is None or row.partition % count in parts
                if not in_scope or leased or waiting or row.seq in busy:
                    continue
                taken.append(row.message(count))
        return taken[: within_bytes((len(m.payload) for m in taken), max_bytes, at_least_one)]

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
        count = require_partitions(partition_count)
        with self._lock:
            now = self._clock()
            held = {p for p, (owner, _) in self._owners.items() if owner == worker}

            def owned(seq: int) -> _Row | None:
                row = self._rows.get(seq)
                if row is None or row.status not in LIVE_STATES:
                    return None
                return row if (row.target, row.partition % count) in held else None

            failures = 0
            for failure in failed:
                if (row := owned(failure.seq)) is not None and not row.held:
                    row.unlock(Status.FAILED)
                    row.attempts += 1
                    row.last_error = failure.error
                    # Never sooner than an operator's delay made since the read.
                    row.available_at = max(row.available_at, now + float(failure.retry_in))
                    failures += 1
            given_up = 0
            for failure in abandoned:
                if (row := owned(failure.seq)) is not None and not row.held:
                    row.give_up(failure.error, now, hold_keys=hold_keys)
                    given_up += 1
            done = 0
            for seq in dict.fromkeys(published):
                if (row := owned(seq)) is not None:
                    if delete:
                        del self._rows[seq]
                    else:
                        row.unlock(Status.PUBLISHED)
                        row.published_at = now
                    done += 1
        return Settled(failures, given_up, done)

    def _claimable(
        self,
        now: float,
        limit: int,
        parts: frozenset[int] | None,
        count: int,
        names: frozenset[str] | None,
    ) -> list[_Row]:
        """The first `limit` due rows in seq order, as the SQL claims choose them.

        Rows behind a live head of their (target, key) that is not due or is leased are
        passed over without counting against `limit`; a due candidate behind a live row
        left out for another reason (the filters) is counted but not handed out.
        """
        held: set[tuple[str, str]] = set()
        blocked: set[tuple[str, str]] = set()
        chosen: list[_Row] = []
        candidates = 0
        for row in self._rows.values():
            if candidates >= limit:
                break
            if row.status not in LIVE_STATES:
                continue
            key = None if row.key is None else (row.target, row.key)
            if key is not None and key in held:
                continue
            wanted = (parts is None or row.partition % count in parts) and (
                names is None or row.target in names
            )
            if not row.due(now):
                if key is not None:
                    held.add(key)
            elif wanted:
                candidates += 1
                if key is None or key not in blocked:
                    chosen.append(row)
            elif key is not None:
                blocked.add(key)
        return chosen

    def _leased(self, token: str, seqs: Iterable[int]) -> list[_Row]:
        """Rows among `seqs` still leased under `token` (each once); call under the lock."""
        token = _token(token)
        found = (self._rows.get(seq) for seq in dict.fromkeys(seqs))
        return [r for r in found if r and r.lock_token == token and r.status is Status.PROCESSING]

    def _failing(self, token: str, seq: int) -> list[_Row]:
        """The row `seq` if a failure may be recorded on it: leased under `token`, and
        not held (as the SQL marks check its due time); call under the lock."""
        return [row for row in self._leased(token, [seq]) if row.available_at < _HELD]

    async def mark_published(self, token: str, seqs: Sequence[int], *, delete: bool = False) -> int:
        with self._lock:
            now, held = self._clock(), self._leased(token, seqs)
            for row in held:
                if delete:
                    del self._rows[row.seq]
                else:
                    row.unlock(Status.PUBLISHED)
                    row.published_at = now
        return len(held)

    async def mark_failed(self, token: str, failures: Sequence[Failure]) -> int:
        with self._lock:
            now, count = self._clock(), 0
            for failure in failures:
                for row in self._failing(token, failure.seq):
                    row.unlock(Status.FAILED)
                    row.attempts += 1
                    row.last_error = failure.error
                    row.available_at = now + float(failure.retry_in)
                    count += 1
        return count

    async def abandon(
        self, token: str, failures: Sequence[Failure], *, hold_keys: bool = False
    ) -> int:
        with self._lock:
            now, count = self._clock(), 0
            for failure in failures:
                for row in self._failing(token, failure.seq):
                    row.give_up(failure.error, now, hold_keys=hold_keys)
                    count += 1
        return count

    async def release(self, token: str, seqs: Sequence[int]) -> int:
        with self._lock:
            held = self._leased(token, seqs)
            for row in held:
                row.unlock(Status.PENDING)
        return len(held)

    async def renew(self, token: str, seqs: Sequence[int], lease_seconds: float) -> int:
        with self._lock:
            now, held = self._clock(), self._leased(token, seqs)
            for row in held:
                row.locked_until = now + float(lease_seconds)
        return len(held)

    async def purge(
        self, *, published_older_than: float, abandoned_older_than: float, batch_size: int = 500
    ) -> int:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        with self._lock:
            now = self._clock()
            published = now - float(published_older_than)
            abandoned = now - float(abandoned_older_than)
            old = [
                seq for seq, r in self._rows.items() if _finished_before(r, published, abandoned)
            ]
            for seq in old:
                del self._rows[seq]
        return len(old)

    async def replay(self, seqs: Sequence[int], change: Change | None = None) -> int:
        with self._lock:
            now = self._clock()
            rows = self._in_state(seqs, now, {MessageState.ABANDONED, MessageState.HELD})
            for row in rows:
                row.status, row.attempts, row.available_at = Status.PENDING, 0, now
                row.abandoned_at = None
            if change is not None:
                self._audit_rows(rows, AuditAction.REPLAY, change, now)
        return len(rows)

    # -- the operator's console ---------------------------------------------------------

    def _state(self, row: _Row, now: float) -> MessageState:  # noqa: PLR0911
        """As the SQL backends derive it from the row's columns."""
        if row.status is Status.ABANDONED:
            return MessageState.ABANDONED
        if row.status is Status.PUBLISHED:
            return MessageState.PUBLISHED
        if row.available_at >= _HELD:
            return MessageState.HELD
        if row.status is Status.PROCESSING and not row.due(now):
            return MessageState.IN_FLIGHT
        if row.attempts > 0 or row.status is Status.FAILED:
            return MessageState.RETRYING
        if row.available_at > now:
            return MessageState.DELAYED
        return MessageState.PENDING

    def _in_state(
        self, seqs: Iterable[int], now: float, states: Collection[MessageState]
    ) -> list[_Row]:
        """Rows among `seqs` (each once) in one of `states`; call under the lock."""
        found = (self._rows.get(seq) for seq in sorted(set(seqs)))
        return [r for r in found if r is not None and self._state(r, now) in states]

    def _audit_rows(
        self, rows: Iterable[_Row], action: AuditAction, change: Change, now: float
    ) -> None:
        at = _utc(now)
        for row in rows:
            record = AuditRecord(
                next(self._audit_ids), at, change.actor, action, change.reason, row.seq,
                row.id, row.target, row.key,
            )  # fmt: skip
            self._audit.append(record)

    def _summary(self, row: _Row, now: float) -> MessageSummary:
        state = self._state(row, now)
        return MessageSummary(
            seq=row.seq, id=row.id, state=state, target=row.target, topic=row.topic,
            key=row.key, type=row.type, attempts=row.attempts,
            created_at=_utc(row.created_at),
            available_at=_utc(row.available_at) if state.live else None,
            occurred_at=row.occurred_at,
            published_at=None if row.published_at is None else _utc(row.published_at),
            abandoned_at=None if row.abandoned_at is None else _utc(row.abandoned_at),
            last_error=row.last_error, correlation_id=row.correlation_id,
        )  # fmt: skip

    async def search(
        self,
        where: MessageFilter,
        *,
        limit: int,
        after: int | None = None,
        newest_first: bool = True,
    ) -> list[MessageSummary]:
        check_listing(limit)
        with self._lock:
            now = self._clock()
            rows = reversed(self._rows.values()) if newest_first else iter(self._rows.values())
            found: list[MessageSummary] = []
            for row in rows:
                if len(found) >= limit:
                    break
                if after is not None and (row.seq >= after if newest_first else row.seq <= after):
                    continue
                if _matches(row, where) and (
                    not where.states or self._state(row, now) in where.states
                ):
                    found.append(self._summary(row, now))
        return found

    async def message(self, seq: int) -> MessageDetail | None:
        found = await self.messages([seq])
        return found[0] if found else None

    async def messages(self, seqs: Sequence[int]) -> list[MessageDetail]:
        with self._lock:
            now = self._clock()
            rows = (self._rows.get(seq) for seq in sorted(set(seqs)))
            return [self._detail(row, now) for row in rows if row is not None]

    def _detail(self, row: _Row, now: float) -> MessageDetail:
        return MessageDetail(
            summary=self._summary(row, now), external=row.external,
            partition=row.partition, content_type=row.content_type, payload=row.payload,
            headers=json.loads(row.headers), causation_id=row.causation_id,
            tenant_id=row.tenant_id, aggregate_id=row.aggregate_id,
            locked_by=row.locked_by,
            locked_until=None if row.locked_until is None else _utc(row.locked_until),
        )  # fmt: skip

    async def discard(self, seqs: Sequence[int], change: Change) -> int:
        with self._lock:
            now = self._clock()
            rows = self._in_state(seqs, now, set(MessageState) - {MessageState.IN_FLIGHT})
            self._audit_rows(rows, AuditAction.DISCARD, change, now)
            for row in rows:
                del self._rows[row.seq]
        return len(rows)

    async def reschedule(self, seqs: Sequence[int], *, delay: float, change: Change) -> int:
        with self._lock:
            now = self._clock()
            rows = self._in_state(seqs, now, _WAITING)
            for row in rows:
                row.available_at = now + float(delay)
                if row.status is Status.PROCESSING:  # a lease that ran out: pending again
                    row.unlock(Status.PENDING if row.attempts == 0 else Status.FAILED)
            action = AuditAction.DELAY if delay > 0 else AuditAction.EXPEDITE
            self._audit_rows(rows, action, change, now)
        return len(rows)

    async def hold(self, seqs: Sequence[int], change: Change) -> int:
        with self._lock:
            now = self._clock()
            rows = self._in_state(seqs, now, _WAITING)
            for row in rows:
                row.unlock(Status.FAILED)
                row.available_at = _HELD
            self._audit_rows(rows, AuditAction.HOLD, change, now)
        return len(rows)

    async def release_held(self, seqs: Sequence[int], change: Change) -> int:
        with self._lock:
            now = self._clock()
            rows = self._in_state(seqs, now, {MessageState.HELD})
            for row in rows:
                row.status, row.attempts, row.available_at = Status.PENDING, 0, now
            self._audit_rows(rows, AuditAction.RELEASE, change, now)
        return len(rows)

    async def audit(self, *, limit: int, before: int | None = None) -> list[AuditRecord]:
        check_listing(limit)
        with self._lock:
            found = [r for r in reversed(self._audit) if before is None or r.id < before]
        return found[:limit]

    async def stuck_by_target(self) -> list[TargetStuck]:
        stuck = {MessageState.RETRYING: 0, MessageState.HELD: 1, MessageState.ABANDONED: 2}
        found: dict[str, list[Any]] = {}
        with self._lock:
            now = self._clock()
            for row in self._rows.values():
                place = stuck.get(self._state(row, now))
                if place is None:
                    continue
                entry = found.setdefault(row.target, [0, 0, 0, row.created_at])
                entry[place] += 1
                entry[3] = min(entry[3], row.created_at)
        return [
            TargetStuck(target, retrying, held, abandoned, _utc(oldest))
            for target, (retrying, held, abandoned, oldest) in sorted(found.items())
        ]

    async def backfill_job(self, name: str) -> BackfillJob | None:
        with self._lock:
            return self._backfills.get(name)

    async def backfill_begin(
        self, name: str, *, source: MessageFilter, target: str, external: bool, change: Change
    ) -> BackfillJob:
        with self._lock:
            if name not in self._backfills:
                self._backfills[name] = BackfillJob(
                    name, source, target, external, 0, 0, change.actor, change.reason,
                    _utc(self._clock()), None,
                )  # fmt: skip
            return self._backfills[name]

    async def backfill_copy(
        self, name: str, rows: Sequence[InsertRow], *, cursor: int, finished: bool
    ) -> bool:
        for row in rows:
            _check(row)
        with self._lock:
            job = self._backfills.get(name)
            if job is None or job.finished_at is not None:
                return False
            if job.cursor >= cursor and (rows or not finished):
                return False
            now = self._clock()
            created = [self._new_row(row, now) for row in rows]
            self._rows.update((r.seq, r) for r in created)
            self._backfills[name] = dataclasses.replace(
                job, cursor=max(job.cursor, cursor), copied=job.copied + len(rows),
                finished_at=_utc(now) if finished else None,
            )  # fmt: skip
        return True

    async def abandoned(
        self, *, limit: int, before: int | None = None, target: str | None = None
    ) -> list[AbandonedMessage]:
        check_listing(limit)
        with self._lock:
            rows = [
                r for r in self._rows.values()
                if r.status is Status.ABANDONED and (before is None or r.seq < before)
                and (target is None or r.target == target)
            ]  # fmt: skip
            rows.sort(key=lambda r: r.seq, reverse=True)
            return [_abandoned(r) for r in rows[:limit]]

    async def stats(self) -> OutboxStats:
        with self._lock:
            now, rows = self._clock(), self._rows.values()
            counts = collections.Counter(r.status for r in rows if not r.held)
            held = [r for r in rows if r.held]
            waiting = [r.available_at for r in rows
                       if r.status in (Status.PENDING, Status.FAILED) and r.due(now)]  # fmt: skip
            leases = sum(1 for r in rows if r.status is Status.PROCESSING and not r.due(now))
            targets = collections.Counter(r.target for r in rows if r.status in LIVE_STATES)
        oldest = now - min(waiting) if waiting else None
        return OutboxStats(
            counts=dict(counts), oldest_pending_age=oldest, active_leases=leases,
            live_by_target=dict(targets), held=len(held),
            held_keys=len({(r.target, r.key) for r in held if r.key is not None}),
        )  # fmt: skip

    async def relays(self) -> list[RelayMember]:
        with self._lock:
            now = self._clock()
            members = sorted(
                (t, w, until) for (w, t), until in self._members.items() if until > now
            )
            found = []
            for target, worker, until in members:
                held = sorted(p for (t, p), (owner, lease) in self._owners.items()
                              if t == target and owner == worker and lease > now)  # fmt: skip
                joined = _utc(self._joined.get((worker, target), now))
                found.append(RelayMember(worker, target, joined, _utc(until), tuple(held)))
        return found

    async def record_activity(self, worker: str, activity: Sequence[TargetActivity]) -> None:
        with self._lock:
            now = self._clock()
            minute = int(now // 60)
            for each in activity:
                if each.counted:
                    key = (each.target, minute, worker)
                    self._activity[key] = self._activity.get(key, _Activity()).added(each)
                self._statuses[worker, each.target] = (each, now)

    async def activity(self, *, since: datetime.datetime) -> list[ActivityPoint]:
        first = minute_of(since)
        sums: dict[tuple[str, int], _Activity] = {}
        with self._lock:
            for (target, minute, _), counts in self._activity.items():
                if minute >= first:
                    sums[target, minute] = sums.get((target, minute), _Activity()).merged(counts)
        return [
            ActivityPoint(target, minute_start(minute), c.published, c.failed, c.abandoned, c.lag)
            for (target, minute), c in sorted(sums.items())
        ]

    async def relay_statuses(self, *, within: float = STATUS_LIVE_SECONDS) -> list[RelayStatus]:
        with self._lock:
            since = self._clock() - float(within)
            found = [
                RelayStatus(worker, target, each.circuit, each.last_error, _utc(at))
                for (worker, target), (each, at) in self._statuses.items()
                if at >= since
            ]
        return sorted(found, key=lambda status: (status.target, status.worker))

    async def purge_activity(
        self, *, older_than: float = ACTIVITY_RETENTION, batch_size: int = 500
    ) -> int:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        with self._lock:
            cutoff = self._clock() - float(older_than)
            old = [key for key in self._activity if key[1] < cutoff // 60]
            stale = [key for key, (_, at) in self._statuses.items() if at < cutoff]
            for key in old:
                del self._activity[key]
            for worker_target in stale:
                del self._statuses[worker_target]
        return len(old) + len(stale)

    async def heartbeat(
        self,
        worker: str,
        *,
        partitions: int,
        lease_seconds: float,
        busy: Collection[int] = (),
        target: str = DEFAULT_TARGET,
    ) -> Assignment:
        count = require_partitions(partitions)
        with self._lock:
            now = self._clock()
            until = now + float(lease_seconds)
            live = self._join(worker, target, now, until)
            served = frozenset(t for (_, t) in self._members)
            held = [p for (t, p), (owner, _) in self._owners.items()
                    if t == target and owner == worker]  # fmt: skip
            self._owners.update(((target, p), (worker, until)) for p in held)
            plan = rebalance(held, count, live, busy)
            for partition in plan.release:
                del self._owners[target, partition]
            taken = [p for p in range(count) if self._free(target, p, now)][: plan.wanted]
            self._owners.update(((target, p), (worker, until)) for p in taken)
        return Assignment(
            frozenset([*plan.keep, *plan.draining, *taken]), live, frozenset(plan.draining),
            served,
        )  # fmt: skip

    def _join(self, worker: str, target: str, now: float, until: float) -> int:
        """End dead memberships, renew `worker`'s of `target`; how many live ones serve
        `target`. Call under the lock."""
        self._members = {m: t for m, t in self._members.items() if t > now}
        self._joined = {m: t for m, t in self._joined.items() if m in self._members}
        self._joined.setdefault((worker, target), now)
        self._members[worker, target] = until
        return sum(1 for (_, t) in self._members if t == target)

    def _free(self, target: str, partition: int, now: float) -> bool:
        """No owner, or its lease has run out; call under the lock."""
        owner = self._owners.get((target, partition))
        return owner is None or owner[1] <= now

    async def leave(self, worker: str) -> None:
        with self._lock:
            self._members = {m: t for m, t in self._members.items() if m[0] != worker}
            self._owners = {p: o for p, o in self._owners.items() if o[0] != worker}

    async def close(self) -> None:
        """Nothing to release; the rows stay, as a database outlives its connections."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Activity:
    """One row of the activity table: counts and lags."""

    published: int = 0
    failed: int = 0
    abandoned: int = 0
    lag: Lag = NO_LAG

    def added(self, each: TargetActivity) -> _Activity:
        return _Activity(self.published + each.published, self.failed + each.failed,
                         self.abandoned + each.abandoned, self.lag.merged(each.lag))  # fmt: skip

    def merged(self, other: _Activity) -> _Activity:
        return _Activity(self.published + other.published, self.failed + other.failed,
                         self.abandoned + other.abandoned, self.lag.merged(other.lag))  # fmt: skip


#: The live states a delay, an expedite or a hold applies to.
_WAITING = frozenset({MessageState.PENDING, MessageState.DELAYED, MessageState.RETRYING})


def _utc(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC)


def _matches(row: _Row, where: MessageFilter) -> bool:
    """Every field `where` gives, except its states, matches `row`."""
    fields = (
        (where.target, row.target), (where.topic, row.topic), (where.key, row.key),
        (where.type, row.type), (where.id, row.id), (where.correlation_id, row.correlation_id),
        (where.causation_id, row.causation_id), (where.tenant_id, row.tenant_id),
        (where.aggregate_id, row.aggregate_id),
    )  # fmt: skip
    if any(wanted is not None and wanted != value for wanted, value in fields):
        return False
    if where.min_seq is not None and row.seq < where.min_seq:
        return False
    if where.max_seq is not None and row.seq > where.max_seq:
        return False
    written = _utc(row.created_at)  # compared as the summaries show it, to the microsecond
    if where.since is not None and written < where.since:
        return False
    return where.until is None or written <= where.until


def _finished_before(row: _Row, published: float, abandoned: float) -> bool:
    if row.status is Status.PUBLISHED:
        return row.published_at is not None and row.published_at <= published
    if row.status is Status.ABANDONED:
        return row.abandoned_at is not None and row.abandoned_at <= abandoned
    return False
