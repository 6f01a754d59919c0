"""Decoding a received envelope, chaining a follow-up, and the inbox's settings."""

from __future__ import annotations

import datetime

import pytest

from relaybox import ConfigurationError, EnvelopeError, Inbox, Incoming
from relaybox.core import envelope
from relaybox.core.ids import uuid7
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
