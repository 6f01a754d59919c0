"""Whatever headers an application gives a message, `Message` refuses them
(`InvalidHeadersError`) or every broker carries them to relaybox's consumer as they
are, with every attribute of the envelope as it was sent: no header can change the id,
type, source, key, sequence, partition... a consumer decodes, on any broker.

Each case goes through what the publisher puts on the wire and what the consumer
reads off it, without the network: NATS' header block read by nats-py's parser, Redis
fields as bytes, AMQP headers through pamqp's table encoding, Kafka record headers,
MQTT properties packed and read by paho, a webhook's request headers and bodies.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import aiomqtt
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pamqp import decode as amqp_decode
from pamqp import encode as amqp_encode

from relaybox import Message, MessageError
from relaybox.consumers import amqp as amqp_consumer
from relaybox.consumers import http as http_consumer
from relaybox.consumers import kafka as kafka_consumer
from relaybox.consumers import mqtt as mqtt_consumer
from relaybox.consumers import nats as nats_consumer
from relaybox.consumers import redis as redis_consumer
from relaybox.core import envelope
from relaybox.core.incoming import Incoming
from relaybox.core.records import StoredMessage
from relaybox.publishers import amqp, http, kafka, mqtt, nats, redis
from relaybox.publishers.nats_protocol import HEADER_LINE
from tests.properties.strategies import ANY_TEXT, NASTY, AmqpDelivery, KafkaRecord

SOURCE = "shop"
RESERVED = [
    *sorted(envelope.RESERVED_HEADER_NAMES), "Nats-Msg-Id", "ce-id", "ce_id", "cloudEvents:id",
    "cloudEvents_id", "x-delivery-count", "content-type", "Relaybox-Topic", "traceparent",
    "tracestate",
]  # fmt: skip
TOKEN = st.from_regex(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,12}", fullmatch=True)


def variants(name: str) -> st.SearchStrategy[str]:
    """`name` as it is, in another case, or padded: what once slipped past a check."""
    return st.sampled_from([name, name.upper(), name.title(), f" {name}", f"{name} ", f"\t{name}"])


NAMES = st.one_of(st.sampled_from(RESERVED).flatmap(variants), TOKEN, ANY_TEXT)
VALUES = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20),
    ANY_TEXT,
    st.sampled_from(NASTY),
)


def stored_as_the_relay_claims_it(message: Message, external: bool) -> StoredMessage:
    return StoredMessage(
        seq=2**62, id=message.id, target="default", external=external, topic=message.topic,
        key=message.key, partition=2**31 - 1, type=message.type,
        content_type=message.content_type or "application/octet-stream",
        payload=message.body, headers=message.headers,
        correlation_id=message.correlation_id, causation_id=message.causation_id,
        tenant_id=message.tenant_id, aggregate_id=message.aggregate_id,
        occurred_at=message.occurred_at, attempts=3,
    )  # fmt: skip


# -- each broker, there and back ------------------------------------------------------


def through_nats(row: StoredMessage) -> Incoming:
    block = nats.header_block(row, SOURCE)
    assert block.startswith(HEADER_LINE.encode())
    headers = Client._parse_header_lines(block[len(HEADER_LINE) :])
    return nats_consumer.decode(Msg(_client=None, subject=row.topic, data=row.payload,  # type: ignore[arg-type]
                                    headers=headers))  # fmt: skip


def through_redis(row: StoredMessage) -> Incoming:
    fields = {
        name.encode(): value if isinstance(value, bytes) else str(value).encode()
        for name, value in redis.fields(row, SOURCE).items()
        if isinstance(name, str)
    }
    return redis_consumer.decode(fields, stream=row.topic)


def through_amqp(row: StoredMessage) -> Incoming:
    sent = amqp.amqp_message(row, SOURCE)
    _, headers = amqp_decode.field_table(amqp_encode.field_table(dict(sent.headers)))
    return amqp_consumer.decode(
        AmqpDelivery(headers, sent.body, sent.content_type, row.topic, False)  # type: ignore[arg-type]
    )


def through_kafka(row: StoredMessage) -> Incoming:
    key = None if row.key is None else row.key.encode()
    headers: list[tuple[str, bytes | None]] = list(kafka.wire_headers(row, SOURCE))
    return kafka_consumer.decode(KafkaRecord(row.topic, key, row.payload, headers))


def through_mqtt(row: StoredMessage) -> Incoming:
    packed = mqtt.MqttPublisher(source=SOURCE)._properties(row).pack()
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    properties.unpack(packed)  # type: ignore[no-untyped-call]
    return mqtt_consumer.decode(aiomqtt.Message(row.topic, row.payload, 1, False, 1, properties))


def through_a_webhook(row: StoredMessage) -> Incoming:
    headers = [
        (b"Content-Type", row.content_type.encode()),
        *http._binary_headers(row, SOURCE),
        (http.TOPIC_HEADER.encode(), urllib.parse.quote(row.topic).encode()),
    ]
    (got,) = http_consumer.decode_request(headers, row.payload)
    return got


def through_a_webhook_batch(row: StoredMessage) -> Incoming:
    body = json.dumps([envelope.structured(row, SOURCE)]).encode()
    headers = [(b"Content-Type", http.BATCH_CONTENT_TYPE.encode())]
    (got,) = http_consumer.decode_request(headers, body, path=row.topic)
    return got


ROUND_TRIPS: dict[str, Callable[[StoredMessage], Incoming]] = {
    "nats": through_nats, "redis": through_redis, "amqp": through_amqp,
    "kafka": through_kafka, "mqtt": through_mqtt, "webhook": through_a_webhook,
    "webhook batch": through_a_webhook_batch,
}  # fmt: skip


def check_the_envelope(got: Incoming, row: StoredMessage, broker: str) -> None:
    internal = not row.external
    assert (got.id, got.source, got.type) == (str(row.id), SOURCE, row.type), broker
    assert (got.key, got.topic, got.payload) == (row.key, row.topic, row.payload), broker
    assert got.sequence == (row.seq if internal else None), broker
    assert got.partition == (row.partition if internal else None), broker
    assert (got.correlation_id, got.causation_id, got.tenant_id) == (
        row.correlation_id, row.causation_id, row.tenant_id,
    ), broker  # fmt: skip
    assert got.aggregate_id == (row.aggregate_id if internal else None), broker
    assert got.time == row.occurred_at, broker
    assert got.content_type == row.content_type, broker
    assert got.traceparent == row.headers.get("traceparent"), broker
    sent = {} if broker == "webhook batch" else row.headers  # a batch carries no headers
    if broker.startswith("webhook"):  # HTTP names are case-insensitive: read in lower case
        sent = {name.lower(): value for name, value in sent.items()}
    assert dict(got.headers) == dict(sent), broker


OPTIONAL_TEXT = st.one_of(st.none(), st.text(st.characters(codec="utf-8"), min_size=1,
                                              max_size=12))  # fmt: skip


@given(
    headers=st.one_of(
        st.dictionaries(NAMES, VALUES, max_size=6),
        st.lists(st.tuples(NAMES, st.one_of(VALUES, st.integers(), st.none()))).map(dict),
    ),
    key=OPTIONAL_TEXT,
    correlation=OPTIONAL_TEXT,
    tenant=OPTIONAL_TEXT,
    external=st.booleans(),
)
def test_headers_are_refused_or_carried_without_changing_the_envelope(
    headers: Mapping[Any, Any],
    key: str | None,
    correlation: str | None,
    tenant: str | None,
    external: bool,
) -> None:
    try:
        message = Message(
            topic="orders", key=key, type="order.paid", payload={"n": 1}, headers=headers,
            correlation_id=correlation, tenant_id=tenant, aggregate_id="agg-1",
        )  # fmt: skip
    except MessageError:  # InvalidHeadersError, or a key or id Message refuses
        return
    row = stored_as_the_relay_claims_it(message, external)
    for broker, round_trip in ROUND_TRIPS.items():
        check_the_envelope(round_trip(row), row, broker)
