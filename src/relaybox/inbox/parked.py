"""Parked messages: those a consumer gave up on, kept whole in its own database.

A message is parked when its handler failed on every one of its attempts
(reason "failed"), when its payload does not fit the handler's payload class or is not
JSON ("invalid": no retry can change that), or when no handler takes its type and the
consumer's `unknown_types` policy says "park" ("unknown_type"). The row keeps the whole
envelope (attributes, headers, payload bytes) with the error, the attempt count and the
time, in `<inbox>_parked`; the inbox records the message in the same transaction, so
the broker's copies are duplicates from then on and the message is never applied, until:

- an operator asks for a replay (`relaybox parked replay ID...`, `request_replay`): the
  row's status becomes "replay", and a running `Consumer` of that name applies it through
  its handler, once (the status moves to "replayed" in the transaction of the effects);
  if the handler fails again, the row is parked again with the new error;
- or discards it (`relaybox parked discard ID... --reason`): "discarded", with who and
  why kept in the row.

Rows are never deleted: "replayed" and "discarded" rows are the audit trail.
"""

from __future__ import annotations

import dataclasses
import datetime
import getpass
import json
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from relaybox.core.identifiers import DEFAULT_INBOX
from relaybox.core.incoming import Incoming
from relaybox.errors import ConfigurationError, InboxError
from relaybox.inbox.inbox import Inbox
from relaybox.inbox.rows import Row, Work

Reason = Literal["failed", "invalid", "unknown_type"]
Status = Literal["parked", "replay", "replayed", "discarded"]
STATUSES: tuple[Status, ...] = ("parked", "replay", "replayed", "discarded")
#: The longest error text kept (a traceback's last line is what matters).
MAX_ERROR_LENGTH = 4000


@dataclasses.dataclass(frozen=True, slots=True)
class ParkedMessage:
    """One row of the parked table: the message as received, and what became of it."""

    id: int
    consumer: str
    message: Incoming
    reason: str
    error: str
    attempts: int
    parked_at: datetime.datetime
    status: str
    changed_at: datetime.datetime | None = None
    changed_by: str | None = None
    note: str | None = None


def park_params(
    consumer: str, message: Incoming, reason: Reason, error: str, attempts: int
) -> tuple[Any, ...]:
    """The `park` statement's parameters."""
    return (
        consumer, message.id, message.source, message.type, message.topic, message.key,
        message.content_type, json.dumps(dict(message.attributes)),
        json.dumps(dict(message.headers)), bytes(message.payload), reason,
        error[:MAX_ERROR_LENGTH], attempts,
    )  # fmt: skip


def from_row(row: Row) -> ParkedMessage:
    """A `ParkedMessage` from the columns the parked queries select, in their order."""
    (id_, consumer, _message_id, _source, _type, topic, _key, content_type, attributes,
     headers, payload, reason, error, attempts, parked_at, status, changed_at, changed_by,
     note) = row  # fmt: skip
    message = Incoming.from_envelope(
        json.loads(attributes),
        bytes(payload),
        headers=json.loads(headers),
        content_type=content_type,
        topic=topic,
    )
    return ParkedMessage(
        id=int(id_), consumer=consumer, message=message, reason=reason, error=error,
        attempts=int(attempts), parked_at=_utc(parked_at), status=status,
        changed_at=None if changed_at is None else _utc(changed_at), changed_by=changed_by,
        note=note,
    )  # fmt: skip


def _utc(value: datetime.datetime | str) -> datetime.datetime:
    """PostgreSQL gives aware times; MySQL naive ones and SQLite text, both in UTC."""
    moment = datetime.datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)


def operator() -> str:
    """Who is asking, for the audit: the operating system's user name."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no user name in this environment
        return "unknown"


# -- operator requests, through any connection the inbox takes -------------------------


async def listing(
    work: Work,
    *,
    status: Status = "parked",
    consumer: str | None = None,
    type: str | None = None,  # noqa: A002 - the attribute's name
    limit: int = 20,
    before: int | None = None,
) -> list[ParkedMessage]:
    """The parked table's rows of `status` (of `consumer`, of `type`), newest first."""
    if status not in STATUSES:
        raise ConfigurationError(f"status={status!r}: use one of {', '.join(STATUSES)}")
    if limit < 1:
        raise ConfigurationError("limit must be at least 1")
    rows = await work.fetch("listing", status, consumer, type, before, limit)
    return [from_row(row) for row in rows]


async def resolve(
    work: Work, ids: Iterable[int], *, status: Status, by: str | None, note: str | None
) -> int:
    """Move the parked messages `ids` to `status` ("replay" or "discarded"), all of them
    or, if one is unknown or not parked, none (raises `InboxError`: roll back)."""
    wanted = sorted({int(found) for found in ids})
    if not wanted:
        raise ConfigurationError("name at least one parked message id")
    by = by or operator()
    for parked_id in wanted:
        if await work.execute("resolve", status, by, note, parked_id) != 1:
            rows = await work.fetch("parked", parked_id)
            if not rows:
                raise InboxError(f"no parked message has id {parked_id}")
            raise InboxError(
                f"message {parked_id} is {from_row(rows[0]).status}, not parked: "
                "only a parked message can be replayed or discarded"
            )
    return len(wanted)


async def list_parked(
    connection: Any,
    *,
    table: str = DEFAULT_INBOX,
    status: Status = "parked",
    consumer: str | None = None,
    type: str | None = None,  # noqa: A002 - the attribute's name
    limit: int = 20,
) -> list[ParkedMessage]:
    """The newest `limit` parked messages, through an async connection or session."""
    work = await Work.opened(connection, Inbox(table=table))
    return await listing(work, status=status, consumer=consumer, type=type, limit=limit)


async def parked_counts(connection: Any, *, table: str = DEFAULT_INBOX) -> dict[str, int]:
    """Per consumer, how many of its messages are parked now (replayed and discarded
    ones not counted), through an async connection or session."""
    work = await Work.opened(connection, Inbox(table=table))
    return {str(consumer): int(count) for consumer, count in await work.fetch("parked_counts")}


async def request_replay(
    connection: Any, ids: Sequence[int], *, table: str = DEFAULT_INBOX, by: str | None = None
) -> int:
    """Ask for the parked messages `ids` to be applied again, in the connection's
    transaction (commit it): a running `Consumer` of each one's name then applies it."""
    work = await Work.opened(connection, Inbox(table=table))
    return await resolve(work, ids, status="replay", by=by, note=None)


async def discard(
    connection: Any,
    ids: Sequence[int],
    *,
    reason: str,
    table: str = DEFAULT_INBOX,
    by: str | None = None,
) -> int:
    """Give up on the parked messages `ids` for good, keeping who and why, in the
    connection's transaction (commit it)."""
    if not reason or not reason.strip():
        raise ConfigurationError("say why the messages are discarded (reason)")
    work = await Work.opened(connection, Inbox(table=table))
    return await resolve(work, ids, status="discarded", by=by, note=reason)
