"""Decoding a received envelope, chaining a follow-up, and the inbox's settings."""

from __future__ import annotations

import datetime
import json
import sqlite3

import pytest

from relaybox import ConfigurationError, EnvelopeError, Inbox, InboxError, Incoming
from relaybox.core import envelope
from relaybox.core.ids import uuid7
from relaybox.core.incoming import parse_json
from relaybox.core.records import StoredMessage


def stored(**fields: object) -> StoredMessage:
    now = datetime.datetime(2026, 11, 22, 12, 0, tzinfo=datetime.UTC)
    values: dict[str, object] = {
        "seq": 41, "id": uuid7(), "target": "default", "external": False, "topic": "orders",
        "key": "order-7", "partition": 5, "type": "order.paid",
        "content_type": "application/json", "payload": b'{"total": 3}',
        "headers": {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "app": "1"},
        "correlation_id": "conv-1", "causation_id": "cause-1", "tenant_id": "acme",
        "aggregate_id": "agg-7", "occurred_at": now, "attempts": 2,
    }  # fmt: skip
    values.update(fields)
    return StoredMessage(**values)  # type: ignore[arg-type]


def test_decoding_is_the_inverse_of_the_envelope() -> None:
    message = stored()
    wire = envelope.headers(message, "ce-", source="billing")
    attributes, others = envelope.split(wire, "ce-")
    received = Incoming.from_envelope(
        attributes, message.payload, headers=others, content_type="application/json",
        topic="orders", delivery_count=2,
    )  # fmt: skip
    assert received.id == str(message.id)
    assert (received.source, received.type, received.key) == ("billing", "order.paid", "order-7")
    assert (received.partition, received.sequence) == (5, 41)
    assert (received.correlation_id, received.causation_id) == ("conv-1", "cause-1")
    assert (received.tenant_id, received.aggregate_id) == ("acme", "agg-7")
    assert received.time == message.occurred_at
    assert received.traceparent == message.headers["traceparent"]
    assert received.headers == {"traceparent": message.headers["traceparent"], "app": "1"}
    assert received.json() == {"total": 3}
    assert received.is_json
    assert received.delivery_count == 2


def test_external_envelope_has_no_partition_or_sequence() -> None:
    attributes = envelope.attributes(stored(external=True))
    received = Incoming.from_envelope(attributes, b"x")
    assert (received.partition, received.sequence, received.aggregate_id) == (None, None, None)


@pytest.mark.parametrize(
    "attributes",
    [
        pytest.param({"source": "s"}, id="no-id"),
        pytest.param({"id": ""}, id="empty-id"),
        pytest.param({"id": "x" * 256}, id="id-too-long"),
        pytest.param({"id": "a", "sequence": "seven"}, id="sequence-not-a-number"),
        pytest.param({"id": "a", "partition": "-1"}, id="negative-partition"),
    ],
)
def test_unreadable_envelopes_raise(attributes: dict[str, str]) -> None:
    with pytest.raises(EnvelopeError):
        Incoming.from_envelope(attributes, b"")


def test_not_json_payload_raises_an_envelope_error() -> None:
    with pytest.raises(EnvelopeError):
        Incoming.from_envelope({"id": "a"}, b"\xff not json").json()


def test_follow_up_carries_causation_correlation_tenant_and_trace() -> None:
    started = Incoming.from_envelope({"id": "m-1", "tenantid": "acme",
                                      "traceparent": "00-" + "c" * 32 + "-" + "d" * 16 + "-01"},
                                     b"{}")  # fmt: skip
    first = started.follow_up(topic="invoices", payload={"n": 1})
    assert (first.causation_id, first.correlation_id, first.tenant_id) == ("m-1", "m-1", "acme")
    assert first.headers["traceparent"] == started.traceparent
    later = Incoming.from_envelope({"id": str(first.id), "correlationid": "m-1"}, b"{}")
    second = later.follow_up(topic="emails", correlation_id="override")
    assert second.causation_id == str(first.id)
    assert second.correlation_id == "override"


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"consumer": ""}, id="empty-consumer"),
        pytest.param({"mode": "sometimes"}, id="unknown-mode"),
        pytest.param({"retention": 0}, id="no-retention"),
        pytest.param({"purge_batch": 0}, id="no-purge-batch"),
        pytest.param({"table": "Bad Name"}, id="bad-table"),
    ],
)
def test_inbox_rejects_bad_settings(options: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Inbox(**options)  # type: ignore[arg-type]


def test_inbox_retention_takes_seconds_or_a_timedelta() -> None:
    assert Inbox(retention=datetime.timedelta(days=2)).retention_seconds == 172800
    assert Inbox(retention=90).retention_seconds == 90


VALID = {"id": "m-1", "source": "shop", "type": "order.paid", "partition": "3", "sequence": "7"}


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"sequence": str(2**63)}, id="sequence-past-int64"),
        pytest.param({"sequence": "9" * 5000}, id="sequence-of-5000-digits"),
        pytest.param({"sequence": "-1"}, id="negative-sequence"),
        pytest.param({"sequence": " 7"}, id="sequence-with-a-space"),
        pytest.param({"sequence": "+7"}, id="sequence-with-a-sign"),
        pytest.param({"sequence": "1_000"}, id="sequence-with-an-underscore"),
        pytest.param({"sequence": "\u0667"}, id="sequence-in-arabic-digits"),
        pytest.param({"partition": str(2**31)}, id="partition-past-int32"),
        pytest.param({"id": "m\x00-1"}, id="id-with-nul"),
        pytest.param({"id": "m-\ud800"}, id="id-with-a-lone-surrogate"),
        pytest.param({"source": "sh\x00op"}, id="source-with-nul"),
        pytest.param({"source": "\udcff"}, id="source-with-a-lone-surrogate"),
        pytest.param({"source": "s" * 256}, id="source-too-long"),
        pytest.param({"subject": "k" * 256}, id="key-too-long"),
        pytest.param({"partitionkey": "k\x00"}, id="key-with-nul"),
        pytest.param({"type": "t" * 256}, id="type-too-long"),
        pytest.param({"datacontenttype": "a" * 256}, id="content-type-too-long"),
        pytest.param({"correlationid": "c\x00"}, id="correlation-with-nul"),
        pytest.param({"tenantid": "t" * 256}, id="tenant-too-long"),
        pytest.param({"traceparent": "\ud800"}, id="traceparent-with-a-lone-surrogate"),
        pytest.param({"extension": "\x00"}, id="another-attribute-with-nul"),
        pytest.param({"x" * 70000: "1"}, id="an-attribute-name-too-long"),
        pytest.param({"big": "b" * 70000}, id="an-attribute-value-too-long"),
        pytest.param({f"a{n}": "v" * 60000 for n in range(20)}, id="attributes-too-large"),
    ],
)
def test_an_envelope_no_inbox_stores_as_it_is_is_refused(changes: dict[str, str]) -> None:
    with pytest.raises(EnvelopeError):
        Incoming.from_envelope({**VALID, **changes}, b"{}")


@pytest.mark.parametrize(
    "headers",
    [{"app": "\x00"}, {"app": "\ud800"}, {"\udc00": "1"}, {"app": 1}],
)
def test_headers_no_inbox_stores_as_they_are_are_refused(headers: dict[str, object]) -> None:
    with pytest.raises(EnvelopeError):
        Incoming.from_envelope(VALID, b"{}", headers=headers)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [{"topic": "t" * 1025}, {"content_type": "c" * 256}, {"delivery_count": -1},
     {"key": "k" * 256}],
)  # fmt: skip
def test_what_a_consumer_adds_is_checked_too(fields: dict[str, object]) -> None:
    with pytest.raises(EnvelopeError):
        Incoming.from_envelope(VALID, b"{}", **fields)  # type: ignore[arg-type]


def test_the_largest_values_the_inbox_stores_pass() -> None:
    message = Incoming.from_envelope(
        {**VALID, "id": "i" * 255, "source": "s" * 255, "subject": "é" * 255,
         "sequence": str(2**63 - 1), "partition": str(2**31 - 1)},
        b"{}", topic="t" * 1024,
    )  # fmt: skip
    assert (message.sequence, message.partition) == (2**63 - 1, 2**31 - 1)
    assert message.key == "é" * 255


@pytest.mark.parametrize("depth", [201, 10_000, 1_000_000])
def test_json_nested_too_deep_is_an_envelope_error(depth: int) -> None:
    message = Incoming.from_envelope(VALID, b"[" * depth + b"]" * depth)
    with pytest.raises(EnvelopeError, match="deeper than 200"):
        message.json()
    with pytest.raises(EnvelopeError, match="deeper than 200"):
        parse_json(b'{"a":' * depth + b"1" + b"}" * depth)


def test_json_as_deep_as_allowed_decodes_and_brackets_in_strings_do_not_count() -> None:
    assert parse_json("[" * 200 + "]" * 200) is not None
    text = '["' + "[{" * 5000 + '", "\\"[[[", {"k": "}}]]"}]'
    assert parse_json(text)[0] == "[{" * 5000
    assert parse_json(json.dumps([{"n": n} for n in range(5000)]).encode()) == [
        {"n": n} for n in range(5000)
    ]
    assert parse_json('"\\u00e9"'.encode("utf-16")) == "é"  # as json.loads reads bytes


def test_a_payload_that_is_not_utf8_text_is_an_envelope_error() -> None:
    with pytest.raises(EnvelopeError, match="UTF-8"):
        Incoming.from_envelope(VALID, b"\xff\xfe").text()


def test_a_follow_up_leaves_an_unusable_trace_context_behind() -> None:
    received = Incoming.from_envelope({**VALID, "traceparent": "00-a\r\nNats-Msg-Id: x"}, b"{}")
    assert "traceparent" not in received.follow_up(topic="next").headers


@pytest.mark.parametrize("message_id", ["", "a\x00b", "\ud800", "x" * 256])
def test_the_inbox_refuses_an_id_given_as_it_is_that_it_cannot_store(message_id: str) -> None:
    connection = sqlite3.connect(":memory:")
    try:
        with pytest.raises(InboxError, match="cannot be recorded"):
            Inbox().record(connection, message_id, allow_autocommit=True)
    finally:
        connection.close()
