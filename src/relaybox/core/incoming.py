"""A message as a consumer receives it: the relaybox envelope decoded from a broker.

Every broker consumer (`relaybox.consumers.*`) turns what its broker delivered into an
`Incoming`: the CloudEvents attributes of the wire envelope as typed fields, the
message's own headers apart from them, and the payload as the bytes that were sent.
The inbox reads `id` (or `source`, `partition` and `sequence`) from it; handlers read
the rest, and `follow_up` writes the next message of a chain with its
causation and correlation carried over.

What comes off the wire is checked here, in one place, whoever decoded it: an
`Incoming` cannot be made (`EnvelopeError`) with a field the inbox could not store as
it is or a handler could not read. Every text is valid Unicode without NUL and fits
its column (`MAX_*_LENGTH`); the id, source and key hold no U+FFFD (bytes that were
not UTF-8, which several broker clients replace, so two ids would read as one); the
sequence and the partition are whole numbers written in ASCII digits that fit their
columns; the payload decodes as JSON only within `MAX_JSON_DEPTH` levels of nesting
(`parse_json`). A message that breaks any of these
can never be applied, so the broker consumers reject it for good, and a database
never sees it: no error to retry for ever, no value clamped or cut into another one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Mapping
from typing import Any

from relaybox.core import envelope, tracing
from relaybox.core.envelope import DEFAULT_SOURCE, MAX_JSON_DEPTH, is_json, nests_deeper_than
from relaybox.core.message import Message
from relaybox.errors import EnvelopeError, InvalidHeadersError

#: The longest message id and source the inbox stores (its key columns' width).
MAX_ID_LENGTH = 255
#: The longest type, key, content type, correlation, causation, tenant and aggregate
#: id and trace parent: the inbox's columns (and what a `Message` may have).
MAX_TEXT_LENGTH = 255
#: The longest topic (the parked messages' column).
MAX_TOPIC_LENGTH = 1024
#: The longest name or value of any other attribute, and of a header.
MAX_VALUE_LENGTH = 64 * 1024
#: The most characters all attributes and headers may hold together: what a parked
#: message's columns keep of them (as JSON, which may take six bytes for a character).
MAX_ENVELOPE_LENGTH = 1024 * 1024
#: The largest sequence: a signed 64-bit column's.
MAX_SEQUENCE = 2**63 - 1
#: The largest partition: the outbox's 32-bit column's.
MAX_PARTITION = 2**31 - 1


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

    def __post_init__(self) -> None:
        """Refuse (`EnvelopeError`) what no inbox can store as it is: see the module."""
        if not self.id:
            raise EnvelopeError("a received message needs a non-empty id")
        check_text("the message id", self.id, MAX_ID_LENGTH)
        check_text("the source", self.source, MAX_ID_LENGTH)
        for what, value in (("id", self.id), ("source", self.source), ("key", self.key)):
            if value is not None and _REPLACED in value:
                raise EnvelopeError(
                    f"the message {what} {_excerpt(value)} holds U+FFFD, what a decoder makes "
                    "of bytes that are not UTF-8: two such ids or keys could read as one"
                )
        check_text("the type", self.type, MAX_TEXT_LENGTH)
        check_text("the topic", self.topic, MAX_TOPIC_LENGTH)
        for name in _OPTIONAL_TEXTS:
            value = getattr(self, name)
            if value is not None:
                check_text(f"the {name}", value, MAX_TEXT_LENGTH)
        _whole("partition", self.partition, MAX_PARTITION)
        _whole("sequence", self.sequence, MAX_SEQUENCE)
        _whole("delivery count", self.delivery_count, MAX_SEQUENCE)
        if not isinstance(self.payload, bytes):
            raise EnvelopeError(f"the payload must be bytes, not {type(self.payload).__name__}")
        if self.time is not None and not isinstance(self.time, datetime.datetime):
            raise EnvelopeError("the time must be a datetime")
        size = _texts("attribute", self.attributes) + _texts("header", self.headers)
        if size > MAX_ENVELOPE_LENGTH:
            raise EnvelopeError(
                f"the attributes and headers of message {_excerpt(self.id)} hold {size} "
                f"characters, more than {MAX_ENVELOPE_LENGTH}"
            )

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
        key: str | None = None,
    ) -> Incoming:
        """Decode CloudEvents attributes (names without the binding's prefix).

        Raises `EnvelopeError` when the message carries no usable id, or an attribute
        that cannot be read or stored (see the module docstring): such a message can
        never be deduplicated, so a consumer must not apply it (the broker consumers
        reject it for good). `key` is the message key when the attributes name none (a
        broker's own record key).
        """
        message_id = attributes.get("id")
        if not message_id:
            raise EnvelopeError(
                f"message on {_excerpt(topic or 'this topic')} has no CloudEvents id "
                "attribute: it was not published by relaybox or a CloudEvents producer"
            )
        return cls(
            id=message_id,
            payload=payload,
            source=attributes.get("source") or DEFAULT_SOURCE,
            type=attributes.get("type", ""),
            content_type=content_type or attributes.get("datacontenttype"),
            topic=topic,
            time=_time(attributes.get("time")),
            key=_first(attributes.get("partitionkey"), attributes.get("subject"), key),
            partition=_integer(attributes, "partition", MAX_PARTITION),
            sequence=_integer(attributes, "sequence", MAX_SEQUENCE),
            correlation_id=attributes.get("correlationid"),
            causation_id=attributes.get("causationid"),
            tenant_id=attributes.get("tenantid"),
            aggregate_id=attributes.get("aggregateid"),
            traceparent=_first(attributes.get("traceparent"), (headers or {}).get("traceparent")),
            attributes=dict(attributes),
            headers=dict(headers or {}),
            delivery_count=delivery_count,
        )

    def json(self) -> Any:
        """The payload decoded as JSON (`parse_json`: raises `EnvelopeError` if it is not
        JSON, or nests deeper than `MAX_JSON_DEPTH`)."""
        return parse_json(self.payload, f"message {self.id} payload")

    @property
    def is_json(self) -> bool:
        return self.content_type is not None and is_json(self.content_type)

    def text(self) -> str:
        """The payload decoded as UTF-8 (raises `EnvelopeError` if it is not)."""
        try:
            return self.payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EnvelopeError(f"message {self.id} payload is not UTF-8 text: {exc}") from None

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
        # The trace goes on from the span current here (the consumer's process span, when
        # it is traced), as it does for any new message; else from this message's own.
        traceparent = self.traceparent
        if traceparent is not None and _carried_on(traceparent):
            headers = dict(fields.get("headers") or {})
            headers.setdefault("traceparent", traceparent)
            fields["headers"] = headers
        return Message(topic=topic, **fields)


#: The optional text fields, each within MAX_TEXT_LENGTH.
_OPTIONAL_TEXTS = (
    "content_type", "key", "correlation_id", "causation_id", "tenant_id", "aggregate_id",
    "traceparent",
)  # fmt: skip
#: What no text stored or handed on may hold: NUL, or half of a surrogate pair (which
#: cannot be encoded: the text was no valid UTF-8).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
#: The replacement character, which broker clients put for bytes that are not UTF-8.
_REPLACED = "\ufffd"
#: A whole number as relaybox writes one: ASCII digits, 19 at most.
_DIGITS = re.compile(r"[0-9]{1,19}")


def _excerpt(value: object) -> str:
    """`value` for an error message: a hostile one may be long."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}... ({len(text)} characters)"


def check_text(what: str, value: object, limit: int) -> None:
    """Raise `EnvelopeError` unless `value` is text of `limit` characters at most that
    every database stores as it is."""
    if not isinstance(value, str):
        raise EnvelopeError(f"{what} must be text, not {type(value).__name__}")
    if len(value) > limit:
        raise EnvelopeError(f"{what} {_excerpt(value)} is longer than {limit} characters")
    if ("\x00" in value) if value.isascii() else _UNSTORABLE.search(value):
        raise EnvelopeError(
            f"{what} {_excerpt(value)} holds a NUL or a lone surrogate (it was no valid "
            "UTF-8 text): no database stores it as it is"
        )


def _texts(what: str, values: object) -> int:
    """Check each name and value of `values`; their total length."""
    if not isinstance(values, Mapping):
        raise EnvelopeError(f"the {what}s must be a mapping of names to texts")
    total = 0
    for name, value in values.items():
        check_text(f"{what} name", name, MAX_VALUE_LENGTH)
        check_text(f"{what} {_excerpt(name)}", value, MAX_VALUE_LENGTH)
        total += len(name) + len(value)
    return total


def _whole(what: str, value: object, limit: int) -> None:
    if value is not None and (
        not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit
    ):
        raise EnvelopeError(f"the {what} {_excerpt(value)} is not a whole number from 0 to {limit}")


def _integer(attributes: Mapping[str, str], name: str, limit: int) -> int | None:
    value = attributes.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or _DIGITS.fullmatch(value) is None or int(value) > limit:
        raise EnvelopeError(
            f"attribute {name}={_excerpt(value)} is not a whole number from 0 to {limit}"
        )
    return int(value)


def _first(*values: str | None) -> str | None:
    """The first that is there, an empty one too: a key "" is a key."""
    return next((value for value in values if value is not None), None)


def _time(value: str | None) -> datetime.datetime | None:
    if not value or not isinstance(value, str) or len(value) > MAX_TEXT_LENGTH:
        return None
    try:
        return datetime.datetime.fromisoformat(value)
    except ValueError:
        return None  # an unreadable time is informational only: keep the message


def _carried_on(traceparent: str) -> bool:
    """Whether a follow-up takes `traceparent`: no span is current to take it from,
    and it may be sent."""
    return tracing.current_traceparent() is None and _sendable_trace(traceparent)


def _sendable_trace(traceparent: str) -> bool:
    """Whether `traceparent` may travel as a header of a new message (one received in
    another shape is not carried on: tracing is never a reason to fail)."""
    try:
        envelope.checked_headers({"traceparent": traceparent})
    except InvalidHeadersError:
        return False
    return True


def parse_json(data: bytes | str, what: str = "the payload") -> Any:
    """`data` decoded as JSON; `EnvelopeError` if it is not JSON, or nests arrays and
    objects deeper than `MAX_JSON_DEPTH` (which would exhaust the stack of the decoder,
    or of whatever walks the result). Bytes are read as `json.loads` reads them."""
    try:
        text = (
            data
            if isinstance(data, str)
            else data.decode(json.detect_encoding(data), "surrogatepass")
        )
    except UnicodeDecodeError as exc:
        raise EnvelopeError(f"{what} is not JSON: {exc}") from None
    if nests_deeper_than(text, MAX_JSON_DEPTH):
        raise EnvelopeError(f"{what} nests JSON arrays and objects deeper than {MAX_JSON_DEPTH}")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise EnvelopeError(f"{what} is not JSON: {exc}") from None
    except RecursionError:  # called with the stack nearly full already
        raise EnvelopeError(f"{what} nests JSON too deeply for this stack") from None
