"""Decoding claimed rows into `StoredMessage`, shared by the SQL backends."""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from relaybox.core.inspection import (
    AuditAction,
    AuditRecord,
    BackfillJob,
    MessageDetail,
    MessageFilter,
    MessageState,
    MessageSummary,
    RelayMember,
    TargetStuck,
)
from relaybox.core.records import AbandonedMessage, StoredMessage

#: The column order every backend's claim returns (PostgreSQL's read adds `blocked`).
CLAIM_COLUMNS = (
    "seq", "id", "target", "external", "topic", "key", "partition", "type", "content_type",
    "payload", "headers", "correlation_id", "causation_id", "tenant_id", "aggregate_id",
    "occurred_at", "attempts",
)  # fmt: skip
_COLUMNS = len(CLAIM_COLUMNS)


_NO_HEADERS: Mapping[str, str] = MappingProxyType({})
_UTC = datetime.UTC


def as_utc(value: Any) -> datetime.datetime:
    """Datetimes come back naive (MySQL, SQLite text) or aware (PostgreSQL)."""
    if type(value) is datetime.datetime and value.tzinfo is _UTC:  # asyncpg: as is
        return value
    if isinstance(value, str):
        value = datetime.datetime.fromisoformat(value)
    if value.tzinfo is None:
        return value.replace(tzinfo=datetime.UTC)  # type: ignore[no-any-return]
    return value.astimezone(datetime.UTC)  # type: ignore[no-any-return]


def headers_of(value: Any) -> Mapping[str, str]:
    if value == "{}" or not value:  # most messages: no JSON parse, one shared mapping
        return _NO_HEADERS
    return json.loads(value) if isinstance(value, str | bytes) else dict(value)


def decode(row: Sequence[Any], partitions: int) -> StoredMessage:
    """One claimed row, its stored partition hash taken modulo `partitions`; the
    relay's hottest path, so positional and without needless conversions."""
    (seq, id_, target, external, topic, key, partition, type_, content_type, payload,
     headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
     attempts) = row[:_COLUMNS]  # fmt: skip
    return StoredMessage(
        seq if type(seq) is int else int(seq),
        id_ if isinstance(id_, uuid.UUID) else uuid.UUID(str(id_)),
        target,
        bool(external),
        topic,
        key,
        (partition if type(partition) is int else int(partition)) % partitions,
        type_,
        content_type,
        payload if type(payload) is bytes else bytes(payload),
        headers_of(headers),
        correlation_id,
        causation_id,
        tenant_id,
        aggregate_id,
        as_utc(occurred_at),
        attempts if type(attempts) is int else int(attempts),
    )


def decode_exact(row: Sequence[Any], partitions: int = 0) -> StoredMessage:
    """`decode` for a driver that returns every column as the exact type (asyncpg) and
    a query that already took the partition modulo the count: the row's own values,
    only the headers text made a mapping, in a tuple made in C."""
    headers = row[10]
    return _new_message(
        StoredMessage,
        (*row[:10], _NO_HEADERS if headers == "{}" else headers_of(headers), *row[11:_COLUMNS]),
    )


_new_message = tuple.__new__


def by_seq(rows: Sequence[Sequence[Any]], partitions: int) -> list[StoredMessage]:
    return sorted((decode(row, partitions) for row in rows), key=lambda m: m.seq)


def byte_budget(max_bytes: int | None) -> int:
    """A read's byte budget as the SQL reads take it: a 64-bit integer, the largest
    for none."""
    return 2**63 - 1 if max_bytes is None else int(max_bytes)


def within_bytes(sizes: Iterable[int], max_bytes: int | None, at_least_one: bool = True) -> int:
    """How many leading rows of a read (their payload `sizes`, in seq order) it takes
    under `max_bytes` (None: all): those whose running total stays within it; with
    `at_least_one`, a first payload larger on its own (after none but empty ones) comes
    alone. The SQL reads cut by the same rule: a row goes if its running total is
    within the bound, or is its own size."""
    taken = total = 0
    for size in sizes:
        total += size
        if max_bytes is not None and total > max_bytes and not (at_least_one and total == size):
            break
        taken += 1
    return taken


def lease_token(token: str) -> str:
    """A claim's token in canonical form; a malformed one raises ValueError everywhere."""
    return str(uuid.UUID(token))


Decoder = Callable[[Sequence[Any], int], StoredMessage]


def readable(
    rows: Sequence[Sequence[Any]], partitions: int, decoder: Decoder = decode
) -> list[StoredMessage]:
    """A read's rows, in seq order, with a `blocked` flag after the claim columns: the
    blocked ones (claimed by a row-lease relay) and every later row of their (target,
    key) are left out. Rows never blocked are the rule: decoded as they come."""
    if not any(row[_COLUMNS] for row in rows):
        return [decoder(row, partitions) for row in rows]
    taken: list[StoredMessage] = []
    stopped: set[tuple[str, str]] = set()
    for row in rows:
        message = decoder(row, partitions)
        chain = None if message.key is None else (message.target, message.key)
        if row[_COLUMNS] or (chain is not None and chain in stopped):
            if chain is not None:
                stopped.add(chain)
            continue
        taken.append(message)
    return taken


def decode_abandoned(row: Sequence[Any]) -> AbandonedMessage:
    """A row of the `abandoned` queries (seq, id, target, topic, key, type, attempts,
    last_error, abandoned_at, occurred_at)."""
    seq, id_, target, topic, key, type_, attempts, error, abandoned_at, occurred_at = row
    return AbandonedMessage(
        seq=int(seq), id=id_ if type(id_) is uuid.UUID else uuid.UUID(str(id_)),
        target=target, topic=topic, key=key, type=type_, attempts=int(attempts),
        last_error=error, abandoned_at=as_utc(abandoned_at), occurred_at=as_utc(occurred_at),
    )  # fmt: skip


def check_listing(limit: int) -> int:
    if limit < 0:
        raise ValueError("limit must not be negative")
    return int(limit)


def _optional_time(value: Any) -> datetime.datetime | None:
    return None if value is None else as_utc(value)


def _uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def decode_summary(row: Sequence[Any]) -> MessageSummary:
    """A row of a search (SUMMARY_COLUMNS: seq, id, state, target, topic, key, type,
    attempts, created_at, available_at, occurred_at, published_at, abandoned_at,
    last_error, correlation_id)."""
    (seq, id_, state, target, topic, key, type_, attempts, created_at, available_at,
     occurred_at, published_at, abandoned_at, last_error, correlation_id) = row[:15]  # fmt: skip
    return MessageSummary(
        seq=int(seq),
        id=_uuid(id_),
        state=MessageState(state),
        target=target,
        topic=topic,
        key=key,
        type=type_,
        attempts=int(attempts),
        created_at=as_utc(created_at),
        available_at=_optional_time(available_at),
        occurred_at=as_utc(occurred_at),
        published_at=_optional_time(published_at),
        abandoned_at=_optional_time(abandoned_at),
        last_error=last_error,
        correlation_id=correlation_id,
    )


def decode_detail(row: Sequence[Any]) -> MessageDetail:
    """A row of the `message` query: the summary's columns, then external, partition,
    content_type, payload, headers, causation_id, tenant_id, aggregate_id, locked_by,
    locked_until."""
    (external, partition, content_type, payload, headers, causation_id, tenant_id,
     aggregate_id, locked_by, locked_until) = row[15:25]  # fmt: skip
    return MessageDetail(
        summary=decode_summary(row),
        external=bool(external),
        partition=int(partition),
        content_type=content_type,
        payload=bytes(payload),
        headers={str(k): str(v) for k, v in headers_of(headers).items()},
        causation_id=causation_id,
        tenant_id=tenant_id,
        aggregate_id=aggregate_id,
        locked_by=locked_by,
        locked_until=_optional_time(locked_until),
    )


def decode_audit(row: Sequence[Any]) -> AuditRecord:
    """A row of the `audit` query (id, at, actor, action, reason, seq, message_id,
    target, key)."""
    id_, at, actor, action, reason, seq, message_id, target, key = row
    return AuditRecord(
        id=int(id_),
        at=as_utc(at),
        actor=actor,
        action=AuditAction(action),
        reason=reason,
        seq=int(seq),
        message_id=_uuid(message_id),
        target=target,
        key=key,
    )


def relay_members(
    members: Sequence[Sequence[Any]], owned: Sequence[Sequence[Any]]
) -> list[RelayMember]:
    """The rows of `relay_members` (worker, target, joined_at, lease_until) with the
    partitions `relay_partitions` (target, owner, partition) gives each."""
    held: dict[tuple[str, str], list[int]] = {}
    for target, owner, partition in owned:
        held.setdefault((str(target), str(owner)), []).append(int(partition))
    return [
        RelayMember(
            worker=str(worker), target=str(target), joined_at=as_utc(joined_at),
            lease_until=as_utc(lease_until),
            partitions=tuple(sorted(held.get((str(target), str(worker)), ()))),
        )
        for worker, target, joined_at, lease_until in members
    ]  # fmt: skip


def decode_backfill(row: Sequence[Any]) -> BackfillJob:
    """A row of `backfill_job` (name, source, target, external, cursor_seq, copied,
    actor, reason, created_at, finished_at)."""
    name, source, target, external, cursor, copied, actor, reason, created, finished = row
    return BackfillJob(
        name=str(name), source=MessageFilter.from_json(str(source)), target=str(target),
        external=bool(external), cursor=int(cursor), copied=int(copied), actor=str(actor),
        reason=reason, created_at=as_utc(created),
        finished_at=None if finished is None else as_utc(finished),
    )  # fmt: skip


def stuck_targets(
    live: Sequence[Sequence[Any]], abandoned: Sequence[Sequence[Any]]
) -> list[TargetStuck]:
    """The rows of `stuck_live` (target, retrying, held, oldest written) and of
    `stuck_abandoned` (target, abandoned, oldest written), one per target."""
    found: dict[str, list[Any]] = {}
    for target, retrying, held, oldest in live:
        found[str(target)] = [int(retrying or 0), int(held or 0), 0, as_utc(oldest)]
    for target, count, oldest in abandoned:
        entry = found.setdefault(str(target), [0, 0, 0, None])
        entry[2] = int(count)
        written = as_utc(oldest)
        entry[3] = written if entry[3] is None else min(entry[3], written)
    return [TargetStuck(target, *entry) for target, entry in sorted(found.items())]
