"""What an operator sees of a message and asks of many: the states a row can be in,
the filter a search takes, the rows it returns, and the record each change leaves.

A message's state is read off its row, never stored apart from it:

- pending: live, due, never attempted;
- delayed: live, written with a delay or pushed back by an operator, not due yet;
- retrying: live, failed at least once, waiting for (or due for) its next attempt;
- in flight: live, leased to a relay that runs without partition leases (a relay that
  holds partitions reads rows without writing, so its rows show as pending);
- held: live, kept from the relay with its key's later rows behind it, by an operator
  or by the hold-the-key policy when it was abandoned;
- abandoned: finished, given up on (a permanent error or the last attempt);
- published: finished, confirmed by its broker, and kept because of a retention.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import uuid
from collections.abc import Mapping
from typing import Any

from relaybox.errors import ConfigurationError

#: The largest seq a table can hold (a signed 64-bit integer).
MAX_SEQ = 2**63 - 1
#: The most rows one search page returns.
MAX_PAGE = 1000
#: A held row stays live, but is due at this time: every read treats it as a row that
#: waits, so the later rows of its key wait behind it, on every database, through the
#: same rule that holds a key behind a backoff. An operator's release, replay or
#: discard ends the hold. (Every database's date range reaches it.)
HELD_UNTIL = datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC)
#: The longest delay an operator may give a message, in seconds (about 100 years): far
#: within every database's date range, and short of HELD_UNTIL.
MAX_DELAY = 100 * 365.25 * 86400.0


class MessageState(enum.StrEnum):
    PENDING = "pending"
    DELAYED = "delayed"
    RETRYING = "retrying"
    IN_FLIGHT = "in_flight"
    HELD = "held"
    ABANDONED = "abandoned"
    PUBLISHED = "published"

    @property
    def live(self) -> bool:
        """Still to deliver (or held): the row is in the relay's table of live rows."""
        return self not in (MessageState.ABANDONED, MessageState.PUBLISHED)


LIVE_STATES = frozenset(s for s in MessageState if s.live)
FINISHED_STATES = frozenset(s for s in MessageState if not s.live)


@dataclasses.dataclass(frozen=True, slots=True)
class MessageFilter:
    """Which messages a search, or an action over many, takes. Every field given must
    match (None or empty: any). Text fields match exactly; `since`/`until` bound the
    time the row was written (`created_at`), `min_seq`/`max_seq` its seq, both ends
    included."""

    states: frozenset[MessageState] = frozenset()
    target: str | None = None
    topic: str | None = None
    key: str | None = None
    type: str | None = None
    id: uuid.UUID | None = None
    correlation_id: str | None = None
    causation_id: str | None = None
    tenant_id: str | None = None
    aggregate_id: str | None = None
    min_seq: int | None = None
    max_seq: int | None = None
    since: datetime.datetime | None = None
    until: datetime.datetime | None = None

    def __post_init__(self) -> None:
        for name in ("min_seq", "max_seq"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= MAX_SEQ:
                raise ConfigurationError(f"{name} {value}: seqs run from 1 to {MAX_SEQ}")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                raise ConfigurationError(f"{name} must carry a time zone")
        if self.min_seq is not None and self.max_seq is not None and self.min_seq > self.max_seq:
            raise ConfigurationError(f"min_seq {self.min_seq} is above max_seq {self.max_seq}")

    @property
    def empty(self) -> bool:
        """True when the filter matches every message."""
        return self == MessageFilter()

    def to_json(self) -> str:
        """The filter as JSON text, as a backfill job keeps it."""
        found: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None or value == frozenset():
                continue
            if field.name == "states":
                value = sorted(state.value for state in value)
            elif isinstance(value, datetime.datetime):
                value = value.isoformat()
            elif isinstance(value, uuid.UUID):
                value = str(value)
            found[field.name] = value
        return json.dumps(found, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MessageFilter:
        try:
            found = json.loads(text)
            if not isinstance(found, dict):
                raise TypeError("not an object")
            if "states" in found:
                found["states"] = frozenset(MessageState(s) for s in found["states"])
            for name in ("since", "until"):
                if name in found:
                    found[name] = datetime.datetime.fromisoformat(found[name])
            if "id" in found:
                found["id"] = uuid.UUID(found["id"])
            return cls(**found)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"not a stored message filter: {exc}") from exc

    @property
    def wants_live(self) -> bool:
        return not self.states or bool(self.states & LIVE_STATES)

    @property
    def wants_finished(self) -> bool:
        return not self.states or bool(self.states & FINISHED_STATES)


@dataclasses.dataclass(frozen=True, slots=True)
class MessageSummary:
    """One message in a search's page: enough to pick it out, without its payload."""

    seq: int
    id: uuid.UUID
    state: MessageState
    target: str
    topic: str
    key: str | None
    type: str
    attempts: int
    created_at: datetime.datetime
    #: When the relay may next take it (live rows; None once finished).
    available_at: datetime.datetime | None
    occurred_at: datetime.datetime
    published_at: datetime.datetime | None
    abandoned_at: datetime.datetime | None
    last_error: str | None
    correlation_id: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class MessageDetail:
    """One message in full: its summary, its envelope and its payload as stored."""

    summary: MessageSummary
    external: bool
    partition: int
    content_type: str
    payload: bytes
    headers: Mapping[str, str]
    causation_id: str | None
    tenant_id: str | None
    aggregate_id: str | None
    locked_by: str | None
    locked_until: datetime.datetime | None


class AuditAction(enum.StrEnum):
    REPLAY = "replay"
    DISCARD = "discard"
    DELAY = "delay"
    EXPEDITE = "expedite"
    HOLD = "hold"
    RELEASE = "release"
    BACKFILL = "backfill"


@dataclasses.dataclass(frozen=True, slots=True)
class AuditRecord:
    """What an operator changed, one record per message touched: who, when, why."""

    id: int
    at: datetime.datetime
    actor: str
    action: AuditAction
    reason: str | None
    seq: int
    message_id: uuid.UUID
    target: str
    key: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    """Who asks for a change, and why: the audit record of every message it touches."""

    actor: str
    reason: str | None = None

    def __post_init__(self) -> None:
        if not self.actor.strip():
            raise ConfigurationError("name who makes the change (the actor)")
        if len(self.actor) > 200:
            raise ConfigurationError("an actor's name is at most 200 characters")
        if self.reason is not None and len(self.reason) > 2000:
            raise ConfigurationError("a reason is at most 2000 characters")


@dataclasses.dataclass(frozen=True, slots=True)
class RelayMember:
    """A live relay as its membership shows it: which target it serves, since when,
    until when its lease runs, and the partitions of that target it holds."""

    worker: str
    target: str
    joined_at: datetime.datetime
    lease_until: datetime.datetime
    partitions: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class BackfillJob:
    """A backfill: retained messages of `source` copied, in seq order, as new messages
    to `target`. `cursor` is the seq of the last source message copied (0: none yet);
    it moves in the transaction that writes the copies, so a backfill stopped at any
    point goes on from there and copies each message once."""

    name: str
    source: MessageFilter
    target: str
    external: bool
    cursor: int
    copied: int
    actor: str
    reason: str | None
    created_at: datetime.datetime
    finished_at: datetime.datetime | None


@dataclasses.dataclass(frozen=True, slots=True)
class TargetStuck:
    """One target's messages that wait on something gone wrong: retrying (failed at
    least once), held, abandoned (those still kept), and when the oldest of them was
    written."""

    target: str
    retrying: int
    held: int
    abandoned: int
    oldest_written: datetime.datetime | None
