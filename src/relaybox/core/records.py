"""Rows as the storage layer sees them: what the writer inserts and what a claim returns."""

from __future__ import annotations

import dataclasses
import datetime
import json
import operator
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from relaybox.core.lifecycle import Status
from relaybox.core.message import DEFAULT_TARGET, Message, Target
from relaybox.core.partitions import partition_for
from relaybox.errors import ConfigurationError, MessageError, UnknownTargetError

#: The columns the writer fills, in the order of `InsertRow`.
INSERT_COLUMNS: tuple[str, ...] = (
    "id", "target", "external", "topic", "key", "partition", "type", "content_type",
    "payload", "headers", "correlation_id", "causation_id", "tenant_id", "aggregate_id",
    "occurred_at", "delay_seconds",
)  # fmt: skip

InsertRow = tuple[
    uuid.UUID, str, bool, str, "str | None", int, str, str, bytes, str,
    "str | None", "str | None", "str | None", "str | None", datetime.datetime, float,
]  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Routing:
    """Which targets exist and which is the default."""

    targets: Mapping[str, Target] = dataclasses.field(
        default_factory=lambda: {DEFAULT_TARGET: Target(DEFAULT_TARGET)}
    )
    default_targets: tuple[str, ...] = (DEFAULT_TARGET,)
    _defaults: tuple[Target, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        defaults = tuple(self.targets[name] for name in self.default_targets)
        object.__setattr__(self, "_defaults", defaults)

    @classmethod
    def of(
        cls,
        targets: Iterable[str | Target] | None,
        default_targets: Iterable[str] | None,
    ) -> Routing:
        known = [t if isinstance(t, Target) else Target(t) for t in (targets or [DEFAULT_TARGET])]
        by_name = {t.name: t for t in known}
        defaults = tuple(default_targets) if default_targets is not None else (known[0].name,)
        if len(by_name) != len(known) or len(set(defaults)) != len(defaults):
            raise ConfigurationError("a target is named twice")
        if not defaults:  # messages without targets would be written nowhere
            raise ConfigurationError("default_targets must name at least one target")
        for name in defaults:
            if name not in by_name:
                raise UnknownTargetError(f"default target {name!r} is not a known target")
        return cls(by_name, defaults)

    def resolve(self, message: Message) -> tuple[Target, ...]:
        if message.targets is None:
            return self._defaults
        resolved = []
        for target in message.targets:
            known = self.targets.get(target.name)
            if known is None:
                raise UnknownTargetError(
                    f"message {message.id} names target {target.name!r}; known targets: "
                    f"{', '.join(sorted(self.targets))}"
                )
            resolved.append(Target(known.name, known.external or target.external))
        return tuple(resolved)

    def rows(self, messages: Iterable[Message]) -> list[InsertRow]:
        """One row per (message, target); raises before returning if any message is bad."""
        rows: list[InsertRow] = []
        for message in messages:
            if not isinstance(message, Message):
                raise MessageError(f"expected relaybox.Message, got {type(message).__name__}")
            partition = partition_for(message.key, message.id)
            headers = (
                json.dumps(message.headers, separators=(",", ":")) if message.headers else "{}"
            )
            targets = self._defaults if message.targets is None else self.resolve(message)
            for target in targets:
                rows.append((
                    message.id, target.name, target.external, message.topic, message.key,
                    partition, message.type, message.content_type or "", message.body,
                    headers, message.correlation_id, message.causation_id, message.tenant_id,
                    message.aggregate_id, message.occurred_at, message.delay_seconds,
                ))  # fmt: skip
        return rows


class StoredMessage(NamedTuple):
    """A row read back from the outbox, as a claim or a read hands it to the relay.

    A named tuple, not a dataclass: the relay makes one per message on its hottest path,
    and a tuple of the row's columns is made in C (`storage.rows.decode_exact`) where a
    dataclass's __init__ runs a Python assignment per field, a measured share of the
    relay's own work per message (docs/benchmarks.md). Fields are in the order of
    `storage.rows.CLAIM_COLUMNS`.
    """

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
    headers: Mapping[str, str]
    correlation_id: str | None
    causation_id: str | None
    tenant_id: str | None
    aggregate_id: str | None
    occurred_at: datetime.datetime
    attempts: int


class RowsInFlight(list[StoredMessage]):
    """The rows of the batches a relay has in flight, which its next read leaves out,
    with their seqs as decimal text joined by commas (`seq_text`).

    A batch stays in flight across two or three reads, and each read sends the seqs of
    every row in flight: made into text at every read, they cost the relay a measured
    share of its own work in a drain (docs/benchmarks.md). Each batch's text is made
    once, and a read joins the batches' texts.
    """

    __slots__ = ("seq_text",)

    def __init__(self, batches: Iterable[tuple[Sequence[StoredMessage], str]] = ()) -> None:
        super().__init__()
        texts = []
        for messages, text in batches:
            self.extend(messages)
            if text:
                texts.append(text)
        self.seq_text = ",".join(texts)


def seq_text(messages: Iterable[StoredMessage]) -> str:
    """The messages' seqs as decimal text joined by commas, as `RowsInFlight` holds them."""
    return ",".join(map(str, map(_SEQ, messages)))


_SEQ = operator.attrgetter("seq")


@dataclasses.dataclass(frozen=True, slots=True)
class AbandonedMessage:
    """An abandoned row, as an operator looks it over before a replay."""

    seq: int
    id: uuid.UUID
    target: str
    topic: str
    key: str | None
    type: str
    attempts: int
    last_error: str | None
    abandoned_at: datetime.datetime
    occurred_at: datetime.datetime


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """Rows leased to one worker; marks must present `token`, or they change nothing."""

    token: str
    worker: str
    messages: Sequence[StoredMessage]


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """A failed publish: the error to record and when the row may be tried again."""

    seq: int
    error: str
    retry_in: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class OutboxStats:
    """The operational signals (counts by status), the oldest pending age and leases."""

    counts: Mapping[Status, int]
    oldest_pending_age: float | None
    active_leases: int
    #: Rows still to deliver (pending, processing or failed), per target.
    live_by_target: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Live rows held (see relaybox.core.inspection.HELD_UNTIL): by an operator, or by
    #: the hold-the-key policy when the relay gave up on them. `counts` leaves them
    #: out: a held row neither waits for a retry nor is due.
    held: int = 0
    #: The (target, key) pairs whose later rows wait behind a held row.
    held_keys: int = 0

    @property
    def pending(self) -> int:
        return self.counts.get(Status.PENDING, 0)

    @property
    def failed(self) -> int:
        return self.counts.get(Status.FAILED, 0)

    @property
    def abandoned(self) -> int:
        return self.counts.get(Status.ABANDONED, 0)

    def by_status(self) -> dict[str, int]:
        """Every status, zeros included, in lifecycle order (a report whose keys never
        come and go with the table's contents)."""
        return {status.value: self.counts.get(status, 0) for status in Status}


@dataclasses.dataclass(frozen=True, slots=True)
class Assignment:
    """The partitions of one target that a relay process holds after a heartbeat, and
    how many live relays serve that target.

    `draining` (a subset of `partitions`) are held only until the rows in flight there
    are settled: read nothing more from them (see `Rebalance`). `served` are the targets
    that some live relay of the table serves (rows of any other target wait for one)."""

    partitions: frozenset[int]
    members: int
    draining: frozenset[int] = frozenset()
    served: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True, slots=True)
class Settled:
    """How many rows one settle of a partition holder changed, by outcome."""

    failed: int = 0
    abandoned: int = 0
    published: int = 0
