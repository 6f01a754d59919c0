"""A message's own headers can never pose as the envelope, a binding or a broker.

`Message` refuses such headers when it is made; a stored row that holds one anyway (an
older relaybox, a row written by hand) is refused by every publisher's encoding, so it
fails for good instead of reaching a broker; and the decoders refuse a delivery whose
attributes come twice, where a header could have posed as one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiomqtt
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from relaybox import InvalidHeadersError, Message
from relaybox.consumers import amqp as amqp_consumer
from relaybox.consumers import http as http_consumer
from relaybox.consumers import kafka as kafka_consumer
from relaybox.consumers import mqtt as mqtt_consumer
from relaybox.consumers import nats as nats_consumer
from relaybox.consumers import redis as redis_consumer
from relaybox.core import envelope
from relaybox.core.publishing import Outcome
from relaybox.core.records import StoredMessage
from relaybox.errors import EnvelopeError, MessageError
from relaybox.publishers import amqp, file, kafka, mqtt, nats, redis
from relaybox.publishers.memory import MemoryPublisher
from tests.brokers.harness import stored

#: Names of the envelope, of a binding or read by a broker or HTTP, in various cases.
RESERVED = [
    # the NATS binding and JetStream
    "Nats-Msg-Id", "nats-msg-id", "NATS-EXPECTED-STREAM", "Nats-Rollup", "Nats-TTL",
    "Status", "description",
    # CloudEvents prefixes: HTTP and NATS, Kafka, AMQP
    "ce-id", "CE-Type", "ce-source", "ce_id", "Ce_Sequence", "cloudEvents_id", "cloudevents",
    # plain attribute names (Redis fields, MQTT user properties) and the payload's fields
    "id", "ID", "type", "source", "time", "subject", "partitionkey", "sequence", "partition",
    "specversion", "correlationid", "causationid", "tenantid", "aggregateid", "attempts",
    "dataschema", "datacontenttype", "data", "data_base64",
    # RabbitMQ
    "x-delivery-count", "X-Death", "x-delay", "x-deduplication-header", "CC", "bcc",
    # content types, HTTP's own, relaybox's webhook headers
    "content-type", "Content-Length", "Content-Encoding", "Transfer-Encoding", "Host",
    "Connection", "Authorization", "Proxy-Authorization", "te", "Upgrade", "User-Agent",
    "Relaybox-Signature", "relaybox-topic",
    # the trace context in another case: the trace context on HTTP only
    "TRACEPARENT", "TraceState",
]  # fmt: skip
MALFORMED = [
    " Nats-Msg-Id", " ce-id", "ce-id ", "\tid", "a b", "a:b", "cloudEvents:id", "", "é",
    "new\r\nline", "nul\x00", "x" * 256,
]  # fmt: skip
UNSENDABLE_VALUES = [
    "a\r\nNats-Msg-Id: forged", "cr\r", "lf\n", "nul\x00", "del\x7f", "\x1b[31m", " lead",
    "trail ", "\ttab", "nbsp\xa0", "\ud800", "x" * (envelope.MAX_HEADER_VALUE + 1),
]  # fmt: skip
SENDABLE_VALUES = [
    "", "shop", "naïve café 📦", "a\tb", "a  b", "x" * envelope.MAX_HEADER_VALUE,
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
]  # fmt: skip


@pytest.mark.parametrize("name", RESERVED + MALFORMED)
def test_a_message_refuses_a_name_it_may_not_have(name: str) -> None:
    with pytest.raises(InvalidHeadersError, match="header name"):
        Message(topic="orders", headers={name: "forged"})


@pytest.mark.parametrize("name", [1, None, b"app"])
def test_a_message_refuses_a_name_that_is_no_str(name: Any) -> None:
    with pytest.raises(InvalidHeadersError):
        Message(topic="orders", headers={name: "1"})


def test_a_message_refuses_a_name_twice_in_any_case() -> None:
    with pytest.raises(InvalidHeadersError, match="named twice"):
        Message(topic="orders", headers={"Tenant-Region": "eu", "tenant-region": "us"})


@pytest.mark.parametrize("value", [*UNSENDABLE_VALUES, 1, None])
def test_a_message_refuses_a_value_no_broker_carries_as_it_is(value: Any) -> None:
    with pytest.raises(InvalidHeadersError):
        Message(topic="orders", headers={"app": value})


@pytest.mark.parametrize("value", SENDABLE_VALUES)
def test_a_message_keeps_a_sendable_value(value: str) -> None:
    assert Message(topic="orders", headers={"app": value}).headers == {"app": value}


def test_ordinary_names_and_the_trace_context_pass() -> None:
    headers = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=1", "App": "shop", "request-id": "r1", "idempotency-key": "k",
        "ids": "1", "xray": "1", "content": "1", "cce": "1", "!#$%&'*+-.^_`|~": "1",
    }  # fmt: skip
    assert Message(topic="orders", headers=headers).headers == headers


def test_the_names_checked_once_stay_few(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names are remembered once found free, up to a bound: no stream of new names
    grows the memory for ever."""
    monkeypatch.setattr(envelope, "_KNOWN_NAMES", {})
    for n in range(envelope._MAX_KNOWN_NAMES + 10):
        envelope.checked_headers({f"name-{n}": "v"})
    assert len(envelope._KNOWN_NAMES) == envelope._MAX_KNOWN_NAMES
    with pytest.raises(InvalidHeadersError):  # a known name is still checked for its value
        envelope.checked_headers({"name-1": "a\r\nb"})


#: Each publisher's encoding of one message: what it would put on the wire.
ENCODINGS: dict[str, Callable[[StoredMessage], object]] = {
    "nats block": lambda m: nats.header_block(m, "relaybox"),
    "nats headers": lambda m: nats.wire_headers(m, "relaybox"),
    "redis": lambda m: redis.text_fields(m, "relaybox"),
    "amqp": lambda m: amqp.amqp_message(m, "relaybox"),
    "kafka": lambda m: kafka.wire_headers(m, "relaybox"),
    "mqtt": lambda m: mqtt.MqttPublisher()._properties(m),
    "file": file.line,
    "http (binary)": envelope.attributes,
    "http (structured)": envelope.structured,
}


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("name", RESERVED + MALFORMED[:-1])
def test_no_publisher_encodes_a_stored_row_with_such_a_header(name: str, encoding: str) -> None:
    row = stored("orders", headers={"app": "shop", name: "forged"})
    with pytest.raises(InvalidHeadersError, match=f"message {row.id} is never sent"):
        ENCODINGS[encoding](row)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("headers", [{"app": value} for value in UNSENDABLE_VALUES[:5]])
def test_no_publisher_encodes_a_stored_row_with_such_a_value(
    headers: dict[str, str], encoding: str
) -> None:
    with pytest.raises(InvalidHeadersError):
        ENCODINGS[encoding](stored("orders", headers=headers))


def test_the_spoofed_message_id_no_longer_reaches_the_nats_frame() -> None:
    """A header " Nats-Msg-Id" used to be stripped into a second Nats-Msg-Id line, by
    which JetStream took three messages for copies of one."""
    spoofed = [stored("orders", headers={" Nats-Msg-Id": "same"}) for _ in range(3)]
    for message in spoofed:
        with pytest.raises(InvalidHeadersError):
            nats.header_block(message, "relaybox")


async def test_the_memory_publisher_refuses_it_as_the_brokers_do() -> None:
    publisher = MemoryPublisher()
    good, bad = stored("orders"), stored("orders", headers={"ce-id": "forged"})
    results = await publisher.publish([bad, good])
    assert [r.outcome for r in results] == [Outcome.PERMANENT, Outcome.ACKED]
    assert "never sent" in (results[0].error or "")
    assert publisher.published == [good]


def nats_delivery(block: bytes) -> Msg:
    """A NATS message with headers as nats-py reads them off the wire."""
    headers = Client._parse_header_lines(block)
    return Msg(_client=None, subject="orders", data=b"{}", headers=headers)  # type: ignore[arg-type]


def test_a_nats_header_cannot_replace_the_id_a_consumer_decodes() -> None:
    """A second ce-id line (a header " ce-id" that was stripped on the way) wins in
    nats-py's dict; the id JetStream deduplicated by says it is not the message's."""
    block = (
        b"ce-specversion: 1.0\r\nce-id: real\r\nce-source: relaybox\r\nce-type: t\r\n"
        b"ce-id: forged\r\ncontent-type: application/json\r\nNats-Msg-Id: real\r\n"
    )
    with pytest.raises(EnvelopeError, match="Nats-Msg-Id"):
        nats_consumer.decode(nats_delivery(block))
    honest = block.replace(b"ce-id: forged\r\n", b"")
    assert nats_consumer.decode(nats_delivery(honest)).id == "real"


def test_a_kafka_attribute_twice_is_refused() -> None:
    record = KafkaRecord([("ce_id", b"real"), ("ce_type", b"t"), ("ce_id", b"forged")])
    with pytest.raises(EnvelopeError, match="twice"):
        kafka_consumer.decode(record)


def test_an_mqtt_attribute_twice_is_refused() -> None:
    message = mqtt_delivery([("id", "real"), ("type", "t"), ("id", "forged")])
    with pytest.raises(EnvelopeError, match="twice"):
        mqtt_consumer.decode(message)


@pytest.mark.parametrize(
    "field", ["key", "type", "content_type", "correlation_id", "causation_id", "tenant_id",
              "aggregate_id"],
)  # fmt: skip
@pytest.mark.parametrize("value", ["k ", " k", "k\r", "k\nk", "\tk", "k\x1b", "k\xa0", "k\x7f"])
def test_an_attribute_nats_would_change_is_refused(field: str, value: str) -> None:
    """NATS strips a header value and turns its line breaks into spaces: "k" and "k "
    would reach a consumer as one key (one lane of a watermark inbox, where a message of
    one is then skipped as a copy of the other's)."""
    with pytest.raises(MessageError, match=field):
        Message(topic="orders", **{field: value})


@pytest.mark.parametrize("field", ["type", "content_type", "correlation_id"])
def test_an_amqp_short_string_over_255_bytes_is_refused(field: str) -> None:
    with pytest.raises(MessageError, match="255 bytes"):
        Message(topic="orders", **{field: "é" * 128})
    assert Message(topic="orders", **{field: "é" * 127}) is not None


def test_attributes_every_broker_carries_pass() -> None:
    message = Message(
        topic="orders", key="k\tk", type="order paid", correlation_id="é" * 100,
        tenant_id="t" * 255,
    )  # fmt: skip
    assert (message.key, message.type) == ("k\tk", "order paid")


#: Half a surrogate pair as bytes: no UTF-8, whatever a client makes of it.
NOT_UTF8 = b"\xed\xa0\x80"


def test_an_id_that_is_not_utf8_is_refused_by_every_decoder() -> None:
    """Clients replace bytes that are not UTF-8 (nats-py, pamqp's fallback, HTTP): two
    such ids would read as one, and the second be skipped as the first one's copy."""
    block = b"ce-id: " + NOT_UTF8 + b"\r\nce-type: t\r\n"
    checks: list[Callable[[], object]] = [
        lambda: nats_consumer.decode(nats_delivery(block)),
        lambda: kafka_consumer.decode(KafkaRecord([("ce_id", NOT_UTF8)])),
        lambda: redis_consumer.decode({b"id": NOT_UTF8, b"data": b"{}"}),
        lambda: amqp_consumer.decode(AmqpDelivery({"cloudEvents:id": NOT_UTF8})),  # type: ignore[arg-type]
        lambda: http_consumer.decode_request([(b"ce-id", NOT_UTF8)], b"{}"),
        lambda: http_consumer.decode_request([(b"ce-id", b"%ED%A0%80")], b"{}"),
        lambda: mqtt_consumer.decode(mqtt_delivery([("id", "\ud800")])),
    ]
    for check in checks:
        with pytest.raises(EnvelopeError):
            check()


class KafkaRecord:
    topic, partition, offset, key, value = "orders", 0, 0, None, b"{}"

    def __init__(self, headers: list[tuple[str, bytes]]) -> None:
        self.headers = headers


class AmqpDelivery:
    body, content_type, routing_key, redelivered = b"{}", None, "orders", False

    def __init__(self, headers: dict[str, object]) -> None:
        self.headers = headers


def mqtt_delivery(pairs: list[tuple[str, str]]) -> aiomqtt.Message:
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    properties.UserProperty = pairs
    return aiomqtt.Message("orders", b"{}", 1, False, 1, properties)
