"""An entity as a consumer without a relational transaction keeps it: business state, a
version for optimistic concurrency, and an outbox of the messages each incoming message
produced, with their ids fixed, until they are sent.

State and outbox are written together, in one single-record write, so an entity is
never seen with the effects of a message but without the messages those effects owe
(`relaybox.inbox.entities` runs the algorithm). Everything here is plain data and its
JSON form, which the stores (`relaybox.storage.entities`) keep as it is.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import json
import math
import uuid
from collections.abc import Mapping
from typing import Any

from relaybox.core.message import DEFAULT_TARGET, Message
from relaybox.core.partitions import DEFAULT_PARTITIONS, partition_for
from relaybox.core.records import StoredMessage
from relaybox.errors import ConfigurationError, InboxError, MessageError

#: How long a dedup store keeps a message id by default: as the relational inbox does.
DEFAULT_DEDUP_RETENTION = datetime.timedelta(days=7)
#: The longest entity id or message id the stores keep (the SQL tables' key columns).
MAX_ID_LENGTH = 255


@dataclasses.dataclass(frozen=True, slots=True)
class Outgoing:
    """A message a handler produced, as its entity keeps it until every target confirmed
    it: its id is fixed when it is created, so a second dispatch after a crash carries
    the same id, and brokers that deduplicate and relaybox inboxes drop the copy."""

    id: uuid.UUID
    topic: str
    type: str
    content_type: str
    payload: bytes
    key: str | None = None
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    correlation_id: str | None = None
    causation_id: str | None = None
    tenant_id: str | None = None
    aggregate_id: str | None = None
    occurred_at: datetime.datetime = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    #: (target name, external) pairs; empty: the default target.
    targets: tuple[tuple[str, bool], ...] = ()

    @classmethod
    def of(cls, message: Message) -> Outgoing:
        """`message` as it will be sent; a delay cannot be honoured without a relay."""
        if message.delay_seconds:
            raise MessageError(
                f"message {message.id} asks for a delay: an entity's messages are sent "
                "at once, without a relay to hold them back"
            )
        targets = tuple((t.name, t.external) for t in message.targets or ())
        return cls(
            id=message.id, topic=message.topic, type=message.type,
            content_type=message.content_type, payload=message.body, key=message.key,
            headers=dict(message.headers), correlation_id=message.correlation_id,
            causation_id=message.causation_id, tenant_id=message.tenant_id,
            aggregate_id=message.aggregate_id, occurred_at=message.occurred_at,
            targets=targets,
        )  # fmt: skip

    def destinations(self) -> tuple[tuple[str, bool], ...]:
        return self.targets or ((DEFAULT_TARGET, False),)

    def stored(self, target: str, external: bool) -> StoredMessage:
        """The message as a publisher takes it. It has no outbox row: no sequence (a
        consumer of it deduplicates by id, not by watermark) and no attempt yet."""
        return StoredMessage(
            seq=0, id=self.id, target=target, external=external, topic=self.topic,
            key=self.key, partition=partition_for(self.key, self.id) % DEFAULT_PARTITIONS,
            type=self.type, content_type=self.content_type, payload=self.payload,
            headers=self.headers, correlation_id=self.correlation_id,
            causation_id=self.causation_id, tenant_id=self.tenant_id,
            aggregate_id=self.aggregate_id, occurred_at=self.occurred_at, attempts=0,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "id": str(self.id), "topic": self.topic, "type": self.type,
            "content_type": self.content_type,
            "payload": base64.b64encode(self.payload).decode("ascii"), "key": self.key,
            "headers": dict(self.headers), "correlation_id": self.correlation_id,
            "causation_id": self.causation_id, "tenant_id": self.tenant_id,
            "aggregate_id": self.aggregate_id, "occurred_at": self.occurred_at.isoformat(),
            "targets": [[name, external] for name, external in self.targets],
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Any) -> Outgoing:
        try:
            return cls(
                id=uuid.UUID(data["id"]), topic=str(data["topic"]), type=str(data["type"]),
                content_type=str(data["content_type"]),
                payload=base64.b64decode(data["payload"], validate=True), key=data["key"],
                headers={str(k): str(v) for k, v in data["headers"].items()},
                correlation_id=data["correlation_id"], causation_id=data["causation_id"],
                tenant_id=data["tenant_id"], aggregate_id=data["aggregate_id"],
                occurred_at=datetime.datetime.fromisoformat(data["occurred_at"]),
                targets=tuple((str(name), bool(external)) for name, external in data["targets"]),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError, binascii.Error) as error:
            raise InboxError(f"a stored outgoing message is malformed: {error!r}") from None


Outbox = Mapping[str, tuple[Outgoing, ...]]


@dataclasses.dataclass(frozen=True, slots=True)
class Entity:
    """One aggregate: its business state (JSON-able), its version (0: never saved; each
    save adds one) and its outbox, incoming message id -> the messages it produced."""

    id: str
    state: Any = None
    version: int = 0
    outbox: Outbox = dataclasses.field(default_factory=dict)

    def applied(self, message_id: str, state: Any, outgoing: tuple[Outgoing, ...]) -> Entity:
        """The next version: the handler's state, and what it owes under `message_id`."""
        return Entity(self.id, state, self.version + 1, {**self.outbox, message_id: outgoing})

    def sent(self, message_id: str) -> Entity:
        """The next version without `message_id`'s outbox entry."""
        outbox = {mid: out for mid, out in self.outbox.items() if mid != message_id}
        return Entity(self.id, self.state, self.version + 1, outbox)

    def encoded_state(self) -> str:
        return encode_state(self.state)

    def encoded_outbox(self) -> str:
        return json.dumps(
            {mid: [o.to_json() for o in out] for mid, out in self.outbox.items()},
            separators=(",", ":"),
        )

    def document(self) -> str:
        """The whole entity as one JSON document (version first), as Redis keeps it."""
        return (
            f'{{"version":{self.version},"state":{self.encoded_state()},'
            f'"outbox":{self.encoded_outbox()}}}'
        )

    @classmethod
    def from_document(cls, entity_id: str, text: str | bytes) -> Entity:
        try:
            data = json.loads(text)
            return cls.from_columns(
                entity_id, data["version"], data["state"], data["outbox"], decoded=True
            )
        except (ValueError, KeyError, TypeError) as error:
            raise InboxError(f"entity {entity_id!r} is stored malformed: {error!r}") from None

    @classmethod
    def from_columns(
        cls, entity_id: str, version: Any, state: Any, outbox: Any, *, decoded: bool = False
    ) -> Entity:
        """An entity from its stored parts: the JSON texts of its state and outbox, or
        (`decoded`) the values they decode to."""
        try:
            if not decoded:
                state, outbox = json.loads(state), json.loads(outbox)
            entries = {
                str(mid): tuple(Outgoing.from_json(o) for o in out) for mid, out in outbox.items()
            }
            return cls(entity_id, state, int(version), entries)
        except (ValueError, TypeError, AttributeError) as error:
            raise InboxError(f"entity {entity_id!r} is stored malformed: {error!r}") from None


def encode_state(state: Any) -> str:
    """The state as JSON text; a state that JSON cannot hold is the handler's error."""
    try:
        return json.dumps(state, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise MessageError(f"an entity's state must be JSON-able: {error}") from None


def check_id(what: str, value: object) -> str:
    """An entity or message id the stores can key: text of 1 to `MAX_ID_LENGTH`
    characters."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        shown = value[:40] if isinstance(value, str) else type(value).__name__
        raise InboxError(f"{what} {shown!r} is not 1-{MAX_ID_LENGTH} characters of text")
    return value


def retention_seconds(retention: datetime.timedelta | float) -> float:
    """A dedup store's retention in seconds: finite and above zero."""
    seconds = retention.total_seconds() if isinstance(retention, datetime.timedelta) else retention
    if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"retention={retention!r}: must be a finite time above zero")
    return float(seconds)
