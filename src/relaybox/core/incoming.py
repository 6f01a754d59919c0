"""A message as a consumer receives it: the relaybox envelope decoded from a broker.

Every broker consumer (`relaybox.consumers.*`) turns what its broker delivered into an
`Incoming`: the CloudEvents attributes of the wire envelope as typed fields, the
message's own headers apart from them, and the payload as the bytes that were sent.
The inbox reads `id` (or `source`, `partition` and `sequence`) from it; handlers read
the rest, and `follow_up` writes the next message of a chain with its
causation and correlation carried over.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping
from typing import Any

from relaybox.core.envelope import DEFAULT_SOURCE, is_json
from relaybox.core.message import Message
from relaybox.errors import EnvelopeError

#: The longest message id and source the inbox stores (its key columns' width).
MAX_ID_LENGTH = 255


@dataclasses.dataclass(frozen=True, slots=True)
class Incoming:
    """One received message: its envelope attributes, its own headers, its payload."""

    id: str
    payload: bytes
    source: str = DEFAULT_SOURCE
    type: str = ""
    content_type: str | None = None
    #: Where the broker delivered it from: subject, queue, topic, stream or URL path.
    topic: str = ""
    time: datetime.datetime | None = None
    #: The message key (CloudEvents `subject` / `partitionkey`).
    key: str | None = None
    #: relaybox's partition and sequence: absent on an external target's stripped envelope.
    partition: int | None = None
    sequence: int | None = None
    correlation_id: str | None = None
    causation_id: str | None = None
    tenant_id: str | None = None
    aggregate_id: str | None = None
    traceparent: str | None = None
    #: Every CloudEvents attribute as received, by its name without the binding's prefix.
    attributes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: The message's own headers (not CloudEvents attributes).
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: How many times the broker says it delivered this copy, where it says (1 = first).
    delivery_count: int | None = None

    @classmethod
    def from_envelope(
        cls,
        attributes: Mapping[str, str],
        payload: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        content_type: str | None = None,
        topic: str = "",
        delivery_count: int | None = None,
    ) -> Incoming:
        """Decode CloudEvents attributes (names without the binding's prefix).

        Raises `EnvelopeError` when the message carries no usable id, or a relaybox
        attribute that cannot be read: such a message can never be deduplicated, so a
        consumer must not apply it (the broker consumers reject it for good).
        """
        message_id = attributes.get("id")
        if not message_id:
            raise EnvelopeError(
                f"message on {topic or 'this topic'} has no CloudEvents id attribute: "
                "it was not published by relaybox or a CloudEvents producer"
            )
        if len(message_id) > MAX_ID_LENGTH:
            raise EnvelopeError(f"message id is longer than {MAX_ID_LENGTH} characters")
        source = attributes.get("source") or DEFAULT_SOURCE
        if len(source) > MAX_ID_LENGTH:
            raise EnvelopeError(f"message source is longer than {MAX_ID_LENGTH} characters")
        return cls(
            id=message_id,
            payload=payload,
            source=source,
            type=attributes.get("type", ""),
            content_type=content_type or attributes.get("datacontenttype"),
            topic=topic,
            time=_time(attributes.get("time")),
            key=attributes.get("partitionkey") or attributes.get("subject"),
            partition=_integer(attributes, "partition"),
            sequence=_integer(attributes, "sequence"),
            correlation_id=attributes.get("correlationid"),
            causation_id=attributes.get("causationid"),
            tenant_id=attributes.get("tenantid"),
            aggregate_id=attributes.get("aggregateid"),
            traceparent=attributes.get("traceparent") or (headers or {}).get("traceparent"),
            attributes=dict(attributes),
            headers=dict(headers or {}),
            delivery_count=delivery_count,
        )

    def json(self) -> Any:
        """The payload decoded as JSON (raises `EnvelopeError` if it is not JSON)."""
        try:
            return json.loads(self.payload)
        except ValueError as exc:
            raise EnvelopeError(f"message {self.id} payload is not JSON: {exc}") from exc

    @property
    def is_json(self) -> bool:
        return self.content_type is not None and is_json(self.content_type)

    def text(self) -> str:
        return self.payload.decode("utf-8")

    def follow_up(self, *, topic: str, **fields: Any) -> Message:
        """A new outbox `Message` caused by this one (consume, then publish).

        Its `causation_id` is this message's id; its `correlation_id` is this message's
        correlation id, or this message's id when it started the conversation; its
        tenant carries over. Any of them may be overridden in `fields`, which takes
        everything `Message` takes.
        """
        fields.setdefault("causation_id", self.id)
        fields.setdefault("correlation_id", self.correlation_id or self.id)
        if self.tenant_id is not None:
            fields.setdefault("tenant_id", self.tenant_id)
        if self.traceparent is not None:
            headers = dict(fields.get("headers") or {})
            headers.setdefault("traceparent", self.traceparent)
            fields["headers"] = headers
        return Message(topic=topic, **fields)


def _integer(attributes: Mapping[str, str], name: str) -> int | None:
    value = attributes.get(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise EnvelopeError(f"attribute {name}={value!r} is not an integer") from None
    if number < 0:
        raise EnvelopeError(f"attribute {name}={value!r} is negative")
    return number


def _time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value)
    except ValueError:
        return None  # an unreadable time is informational only: keep the message
