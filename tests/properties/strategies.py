"""What a hostile producer could put on each broker, and what a received message may be.

The strategies lean on the values that broke decoders before (numbers past 64 bits,
NUL, lone surrogates, over-long text, deep JSON) and on the names of the envelope,
mixed with anything at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import decimal
import json
from collections.abc import Mapping
from typing import Any

from hypothesis import strategies as st

from relaybox.core import envelope
from relaybox.core.incoming import Incoming
from relaybox.errors import EnvelopeError

#: Any character at all, lone surrogates and controls included.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=30)
NASTY = [
    "", " ", "\x00", "a\x00b", "\ud800", "x\udfff", "\r\n", "é", "\ufffd", "📦",
    "x" * 255, "x" * 256, "é" * 300, "x" * 1025, "a" * 70_000,
]  # fmt: skip
NUMBERS = [
    "0", "1", "-1", " 1", "1 ", "+1", "1_000", "\u0661\u0662", "0x10", "1e3", "1.5",
    str(2**31 - 1), str(2**31), str(2**63 - 1), str(2**63), str(2**64), "9" * 4301,
    "0" * 30 + "7",
]  # fmt: skip
TEXT = st.one_of(ANY_TEXT, st.sampled_from(NASTY), st.sampled_from(NUMBERS))
ATTRIBUTE_NAMES = sorted(envelope.MQTT_ATTRIBUTE_NAMES)
NAMES = st.one_of(st.sampled_from(ATTRIBUTE_NAMES), ANY_TEXT)


def deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.one_of(st.sampled_from(ATTRIBUTE_NAMES), ANY_TEXT), children, max_size=6
        )
    ),
    max_leaves=20,
)
SHALLOW_PAYLOADS = st.one_of(
    st.binary(max_size=64), JSON_VALUES.map(lambda v: json.dumps(v).encode())
)
PAYLOADS = st.one_of(
    SHALLOW_PAYLOADS, st.sampled_from([50, 199, 200, 201, 1000, 10_000, 100_000]).map(deep_json)
)


@st.composite
def attribute_sets(draw: st.DrawFn) -> dict[str, str]:
    """CloudEvents attributes as a producer might send them: mostly with an id,
    relaybox's own attributes now and then, any value."""
    found: dict[str, str] = {}
    if draw(st.integers(0, 9)):
        found["id"] = draw(st.one_of(st.uuids().map(str), TEXT))
    for name in draw(st.lists(st.sampled_from(ATTRIBUTE_NAMES), max_size=8, unique=True)):
        found[name] = draw(TEXT)
    found.update(draw(st.dictionaries(ANY_TEXT, TEXT, max_size=3)))
    return found


def wire(text: str) -> bytes:
    """`text` as bytes on a wire, a lone surrogate as the invalid UTF-8 it would be."""
    return text.encode("utf-8", "surrogatepass")


@dataclasses.dataclass
class AmqpDelivery:
    """What `relaybox.consumers.amqp.decode` reads of an aio-pika delivery."""

    headers: Mapping[str, Any] | None
    body: bytes
    content_type: str | None
    routing_key: str | None
    redelivered: bool | None


AMQP_VALUES = st.recursive(
    st.one_of(
        TEXT, st.binary(max_size=20), st.integers(-(2**70), 2**70), st.booleans(), st.none(),
        st.floats(), st.decimals(allow_nan=True), st.datetimes(),
        st.datetimes(timezones=st.timezones()), st.sampled_from([decimal.Decimal("1e-400")]),
    ),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(ANY_TEXT, children,
                                                                       max_size=3),
    max_leaves=8,
)  # fmt: skip


@dataclasses.dataclass
class KafkaRecord:
    """What `relaybox.consumers.kafka.decode` reads of a record."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    partition: int = 0
    offset: int = 0


def assert_storable(message: Incoming) -> None:
    """What an `Incoming` promises, checked here on its own terms (not by calling its
    checks): every text valid Unicode without NUL and within its inbox column, the
    numbers within theirs, and its payload read as JSON or text without anything but
    `EnvelopeError` going wrong."""

    def text(value: object, limit: int) -> None:
        assert type(value) is str, value
        assert len(value) <= limit
        assert "\x00" not in value
        value.encode("utf-8")  # no lone surrogate

    assert message.id
    text(message.id, 255)
    text(message.source, 255)
    text(message.type, 255)
    text(message.topic, 1024)
    for optional in (
        message.content_type, message.key, message.correlation_id, message.causation_id,
        message.tenant_id, message.aggregate_id, message.traceparent,
    ):  # fmt: skip
        if optional is not None:
            text(optional, 255)
    assert message.partition is None or 0 <= message.partition < 2**31
    assert message.sequence is None or 0 <= message.sequence < 2**63
    for field in (message.partition, message.sequence, message.delivery_count):
        assert field is None or type(field) is int
    assert message.time is None or isinstance(message.time, datetime.datetime)
    size = 0
    for mapping in (message.attributes, message.headers):
        for name, value in mapping.items():
            text(name, 65536)
            text(value, 65536)
            size += len(name) + len(value)
    assert size <= 1024 * 1024
    assert type(message.payload) is bytes
    for read in (message.json, message.text):
        with contextlib.suppress(EnvelopeError):
            read()
