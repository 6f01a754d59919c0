"""`envelope.attributes` and `envelope.headers` against the generator they replaced.

Every broker's wire output is built from these two, so the faster build must give the
same names, values and order for every combination of optional fields.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Iterator

import pytest

from relaybox.core import envelope
from relaybox.core.ids import uuid7
from relaybox.core.records import StoredMessage

TRACEPARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


def reference_attributes(message: StoredMessage, source: str) -> dict[str, str]:
    """The envelope as relaybox built it up to the faster version, kept as the spec."""

    def pairs() -> Iterator[tuple[str, str]]:
        yield "specversion", envelope.SPEC_VERSION
        yield "id", str(message.id)
        yield "source", source
        yield "type", message.type
        yield "time", message.occurred_at.isoformat().replace("+00:00", "Z")
        if message.key is not None:
            yield "subject", message.key
            yield "partitionkey", message.key
        if message.correlation_id is not None:
            yield "correlationid", message.correlation_id
        if message.causation_id is not None:
            yield "causationid", message.causation_id
        if message.tenant_id is not None:
            yield "tenantid", message.tenant_id
        if message.aggregate_id is not None:
            yield "aggregateid", message.aggregate_id
        traceparent = message.headers.get("traceparent")
        if traceparent is not None:
            yield "traceparent", traceparent
        yield "sequence", str(message.seq)
        yield "partition", str(message.partition)
        yield "attempts", str(message.attempts)

    found = dict(pairs())
    if message.external:
        for name in envelope.INTERNAL_ATTRIBUTES:
            found.pop(name, None)
    return found


def reference_headers(message: StoredMessage, prefix: str, source: str) -> dict[str, str]:
    found = {prefix + name: value for name, value in reference_attributes(message, source).items()}
    for name, value in message.headers.items():
        found.setdefault(name, value)
    return found


BASE = StoredMessage(
    seq=41, id=uuid7(), target="default", external=False, topic="orders", key="order-7",
    partition=5, type="order.paid", content_type="application/json", payload=b"{}",
    headers={}, correlation_id="conv-1", causation_id="cause-1", tenant_id="acme",
    aggregate_id="agg-7", occurred_at=datetime.datetime(2026, 11, 22, 12, 0, tzinfo=datetime.UTC),
    attempts=2,
)  # fmt: skip

OPTIONAL = ("key", "correlation_id", "causation_id", "tenant_id", "aggregate_id")
HEADERS = (
    {},
    {"traceparent": TRACEPARENT},
    {"app": "shop", "traceparent": TRACEPARENT, "tracestate": "vendor=1"},
)
TIMES = (
    BASE.occurred_at,
    datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC),
    datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
)


def variants() -> Iterator[StoredMessage]:
    for missing in itertools.product((False, True), repeat=len(OPTIONAL)):
        nones = {name: None for name, gone in zip(OPTIONAL, missing, strict=True) if gone}
        for external, headers, occurred_at in itertools.product((False, True), HEADERS, TIMES):
            yield BASE._replace(
                external=external, headers=headers, occurred_at=occurred_at, **nones
            )


@pytest.mark.parametrize("source", ["relaybox", "shop"])
def test_attributes_and_headers_are_what_they_were(source: str) -> None:
    checked = 0
    for message in variants():
        attributes = envelope.attributes(message, source)
        assert list(attributes.items()) == list(reference_attributes(message, source).items())
        for prefix in ("ce-", "ce_", "cloudEvents:", ""):
            got = envelope.headers(message, prefix, source)
            assert list(got.items()) == list(reference_headers(message, prefix, source).items())
        checked += 1
    assert checked == 2**5 * 2 * 3 * 3


def test_attribute_names_lists_every_attribute_in_order() -> None:
    everything = BASE._replace(headers={"traceparent": TRACEPARENT})
    assert tuple(envelope.attributes(everything)) == envelope.ATTRIBUTE_NAMES


@pytest.mark.parametrize("source", ["relaybox", "shop"])
def test_common_values_are_those_of_the_commonest_shape(source: str) -> None:
    """Publishers format a message `common_values` accepts from a template of
    COMMON_ATTRIBUTES: its attributes must be exactly those, with these values."""
    common = 0
    for message in variants():
        values = envelope.common_values(message)
        shape = (
            message.key is not None and not message.headers and not message.external
            and all(getattr(message, name) is None for name in OPTIONAL[1:])
        )  # fmt: skip
        assert (values is not None) == shape
        if values is None:
            continue
        attributes = envelope.attributes(message, source)
        assert tuple(attributes) == envelope.COMMON_ATTRIBUTES
        made = ("id", "time", "sequence", "partition", "attempts")
        assert values == tuple(attributes[name] for name in made)
        assert (attributes["source"], attributes["type"]) == (source, message.type)
        assert attributes["subject"] == attributes["partitionkey"] == message.key
        common += 1
    assert common == len(TIMES)
