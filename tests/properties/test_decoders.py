"""Every decoder, fed anything its broker could deliver, either returns messages that
an inbox stores as they are or raises `EnvelopeError`: nothing else, ever.

A decoder that raised anything else would leave its consumer to retry the delivery for
ever (or stop); one that returned an unstorable message would do the same in the
inbox's database, or worse, have it cut or clamped into another message's id or
sequence.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import aiomqtt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from relaybox.consumers import amqp, http, kafka, mqtt, nats, redis
from relaybox.core.incoming import Incoming
from relaybox.errors import EnvelopeError
from relaybox.publishers.http import BATCH_CONTENT_TYPE as BATCH
from tests.properties.strategies import (
    AMQP_VALUES,
    ANY_TEXT,
    NAMES,
    PAYLOADS,
    TEXT,
    AmqpDelivery,
    KafkaRecord,
    assert_storable,
    attribute_sets,
    deep_json,
    wire,
)


def decoded(decode: Any, *args: Any, **kwargs: Any) -> None:
    """Decode; what comes out must be storable, and the only error an EnvelopeError."""
    try:
        result = decode(*args, **kwargs)
    except EnvelopeError:
        return
    for message in result if isinstance(result, list) else [result]:
        assert isinstance(message, Incoming)
        assert_storable(message)


# -- NATS ----------------------------------------------------------------------------


REPLIES = st.one_of(
    st.just(""), st.just("$JS.ACK.S.c.1.7.7.1700000000000000000.0"),
    ANY_TEXT.map(lambda t: "$JS.ACK." + t), ANY_TEXT,
)  # fmt: skip


@st.composite
def nats_messages(draw: st.DrawFn) -> Msg:
    headers = {f"ce-{name}": value for name, value in draw(attribute_sets()).items()}
    headers.update(draw(st.dictionaries(st.one_of(NAMES, st.sampled_from(
        ["Nats-Msg-Id", "content-type", " ce-id", "ce-id "])), TEXT, max_size=4)))  # fmt: skip
    if draw(st.booleans()):  # as nats-py reads a header block off the wire
        lines = b"".join(wire(f"{name}: {value}\r\n") for name, value in headers.items())
        headers = Client._parse_header_lines(lines + draw(st.binary(max_size=20)))
    return Msg(
        _client=None,  # type: ignore[arg-type]
        subject=draw(ANY_TEXT),
        reply=draw(REPLIES),
        data=draw(PAYLOADS),
        headers=headers or None,
    )


@given(nats_messages())
def test_nats(message: Msg) -> None:
    decoded(nats.decode, message)


# -- Redis ---------------------------------------------------------------------------


REDIS_NAMES = st.one_of(
    NAMES, st.sampled_from(["data", "datacontenttype", "h_app", "h_", "h_id"]),
    NAMES.map(lambda n: "h_" + n),
)  # fmt: skip


@given(
    st.dictionaries(
        st.one_of(REDIS_NAMES.map(wire), st.binary(max_size=10)),
        st.one_of(TEXT.map(wire), PAYLOADS),
        max_size=20,
    ),
    st.one_of(st.none(), st.integers(-5, 2**64)),
)
def test_redis(fields: dict[bytes, bytes], count: int | None) -> None:
    decoded(redis.decode, fields, stream="orders", delivery_count=count)


# -- RabbitMQ ------------------------------------------------------------------------


@st.composite
def amqp_deliveries(draw: st.DrawFn) -> AmqpDelivery:
    headers: dict[str, Any] = {
        f"cloudEvents:{name}": value for name, value in draw(attribute_sets()).items()
    }
    names = st.one_of(NAMES, st.sampled_from(["x-delivery-count", "cloudEvents:id", "x-death"]))
    headers.update(draw(st.dictionaries(names, AMQP_VALUES, max_size=5)))
    return AmqpDelivery(
        headers=draw(st.one_of(st.none(), st.just(headers))),
        body=draw(PAYLOADS),
        content_type=draw(st.one_of(st.none(), TEXT)),
        routing_key=draw(st.one_of(st.none(), TEXT)),
        redelivered=draw(st.one_of(st.none(), st.booleans())),
    )


@given(amqp_deliveries())
def test_amqp(delivery: AmqpDelivery) -> None:
    decoded(amqp.decode, delivery)


# -- Kafka ---------------------------------------------------------------------------


@st.composite
def kafka_records(draw: st.DrawFn) -> KafkaRecord:
    headers: list[tuple[str, bytes | None]] = [
        (f"ce_{name}", wire(value)) for name, value in draw(attribute_sets()).items()
    ]
    names = st.one_of(NAMES, st.sampled_from(["ce_id", "content-type", "ce_sequence"]))
    values = st.one_of(st.none(), st.binary(max_size=20), TEXT.map(wire))
    headers += draw(st.lists(st.tuples(names, values), max_size=5))
    return KafkaRecord(
        topic=draw(TEXT),
        key=draw(st.one_of(st.none(), st.binary(max_size=300), TEXT.map(wire))),
        value=draw(st.one_of(st.none(), PAYLOADS)),
        headers=draw(st.permutations(headers)),
    )


@given(kafka_records())
def test_kafka(record: KafkaRecord) -> None:
    decoded(kafka.decode, record)


# -- MQTT ----------------------------------------------------------------------------


@st.composite
def mqtt_messages(draw: st.DrawFn) -> aiomqtt.Message:
    pairs = list(draw(attribute_sets()).items())
    pairs += draw(st.lists(st.tuples(NAMES, TEXT), max_size=5))
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if pairs:
        properties.UserProperty = draw(st.permutations(pairs))
    content_type = draw(st.one_of(st.none(), TEXT))
    if content_type is not None:
        properties.ContentType = content_type
    topic = draw(st.text("abc/xyz-_.", min_size=1, max_size=1100))
    return aiomqtt.Message(topic, draw(PAYLOADS), 1, False, 1, properties)


@given(mqtt_messages())
def test_mqtt(message: aiomqtt.Message) -> None:
    decoded(mqtt.decode, message)


# -- webhooks ------------------------------------------------------------------------


CONTENT_TYPES = st.one_of(
    st.sampled_from([
        "application/json", "application/cloudevents+json",
        "application/cloudevents-batch+json", "text/plain; charset=utf-8",
        "Application/CloudEvents+JSON; charset=utf-8",
    ]),
    TEXT,
)  # fmt: skip
EVENT_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(ANY_TEXT, children,
                                                                       max_size=3),
    max_leaves=10,
)  # fmt: skip


#: What `data` may hold here: text that UTF-8 carries (see
#: `test_webhook_data_that_utf8_cannot_carry`).
EVENT_DATA = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats()
    | st.text(st.characters() | st.characters(categories=["Cs"])),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children,
                                                                       max_size=3),
    max_leaves=10,
)  # fmt: skip


@st.composite
def events(draw: st.DrawFn) -> dict[str, Any]:
    event: dict[str, Any] = dict(draw(attribute_sets()))
    event.update(draw(st.dictionaries(
        st.sampled_from(["data_base64", "datacontenttype", "sequence", "id"]),
        EVENT_VALUES, max_size=3,
    )))  # fmt: skip
    if draw(st.booleans()):
        event["data"] = draw(EVENT_DATA)
    return event


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A request body: an event, a batch, or anything, JSON nested too deep included."""
    shape = draw(st.sampled_from(["event", "batch", "raw"]))
    if shape == "event":
        return json.dumps(draw(events())).encode()
    if shape == "batch":
        return json.dumps(draw(st.lists(events(), max_size=4))).encode()
    return draw(PAYLOADS)


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[tuple[Any, Any]], bytes]:
    pairs: list[tuple[Any, Any]] = [
        (f"ce-{name}", value) for name, value in draw(attribute_sets()).items()
    ]
    pairs.append(("content-type", draw(CONTENT_TYPES)))
    names = st.one_of(NAMES, st.sampled_from(["Relaybox-Topic", " ce-id", "CE-ID", "Host"]))
    pairs += draw(st.lists(st.tuples(names, TEXT), max_size=4))
    pairs = [
        (wire(n), wire(v)) if draw(st.booleans()) else (n, v)
        for n, v in draw(st.permutations(pairs))
    ]
    return pairs, draw(bodies())


@given(requests(), ANY_TEXT)
def test_webhook(request: tuple[Iterable[tuple[Any, Any]], bytes], path: str) -> None:
    headers, body = request
    decoded(http.decode_request, headers, body, path=path)


@pytest.mark.parametrize("media", ["application/cloudevents+json", BATCH])
def test_webhook_json_nested_too_deep(media: str) -> None:
    decoded(http.decode_request, [("content-type", media)], deep_json(100_000))


@pytest.mark.parametrize("data", ['"\\ud800"', '["\\udfff"]'])
def test_webhook_data_that_utf8_cannot_carry(data: str) -> None:
    body = f'{{"id": "m-1", "data": {data}}}'.encode()
    decoded(http.decode_request, [("content-type", "application/cloudevents+json")], body)
