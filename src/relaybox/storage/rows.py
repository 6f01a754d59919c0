"""Decoding claimed rows into `StoredMessage`, shared by the SQL backends."""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Sequence
from typing import Any

from relaybox.core.records import StoredMessage

#: The column order every backend's claim returns.
CLAIM_COLUMNS = (
    "seq", "id", "target", "external", "topic", "key", "partition", "type", "content_type",
    "payload", "headers", "correlation_id", "causation_id", "tenant_id", "aggregate_id",
    "occurred_at", "created_at", "attempts",
)  # fmt: skip


def as_utc(value: Any) -> datetime.datetime:
    """Datetimes come back naive (MySQL, SQLite text) or aware (PostgreSQL)."""
    if isinstance(value, str):
        value = datetime.datetime.fromisoformat(value)
    if value.tzinfo is None:
        return value.replace(tzinfo=datetime.UTC)  # type: ignore[no-any-return]
    return value.astimezone(datetime.UTC)  # type: ignore[no-any-return]


def decode(row: Sequence[Any]) -> StoredMessage:
    (seq, id_, target, external, topic, key, partition, type_, content_type, payload,
     headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
     created_at, attempts) = row  # fmt: skip
    return StoredMessage(
        seq=int(seq),
        id=id_ if isinstance(id_, uuid.UUID) else uuid.UUID(str(id_)),
        target=target,
        external=bool(external),
        topic=topic,
        key=key,
        partition=int(partition),
        type=type_,
        content_type=content_type,
        payload=bytes(payload),
        headers=json.loads(headers) if isinstance(headers, str | bytes) else dict(headers),
        correlation_id=correlation_id,
        causation_id=causation_id,
        tenant_id=tenant_id,
        aggregate_id=aggregate_id,
        occurred_at=as_utc(occurred_at),
        created_at=as_utc(created_at),
        attempts=int(attempts),
    )


def by_seq(rows: Sequence[Sequence[Any]]) -> list[StoredMessage]:
    return sorted((decode(row) for row in rows), key=lambda m: m.seq)


def lease_token(token: str) -> str:
    """A claim's token in canonical form; a malformed one raises ValueError everywhere."""
    return str(uuid.UUID(token))
