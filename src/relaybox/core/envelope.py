"""The wire envelope: CloudEvents attributes in binary content mode (DESIGN.md).

The payload travels as the broker message's body, untouched; the attributes travel as
headers, named by each broker's CloudEvents binding (`ce_` on Kafka, `cloudEvents:` on
AMQP, `ce-` on HTTP and NATS, plain names in Redis stream fields and MQTT 5 user
properties). A message's own headers travel beside them under their own names.

An *external* target (seed 000) gets the stripped envelope: the attributes an outside
consumer needs (id for deduplication, type, source, time, subject, correlation,
causation, tenant, trace context) but none of relaybox's internal bookkeeping (sequence,
partition, aggregate id, attempts).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Mapping

from relaybox.core.records import StoredMessage

SPEC_VERSION = "1.0"
#: The CloudEvents `source` when a broker URL does not set one (`?source=`).
DEFAULT_SOURCE = "relaybox"

#: Attributes only relaybox's own consumers use; external targets never see them.
INTERNAL_ATTRIBUTES = frozenset({"sequence", "partition", "aggregateid", "attempts"})


def attributes(message: StoredMessage, source: str = DEFAULT_SOURCE) -> dict[str, str]:
    """The message's CloudEvents attributes, as strings, without `datacontenttype`
    (each binding carries that in its own content-type field)."""
    found = dict(_attributes(message, source))
    if message.external:
        for name in INTERNAL_ATTRIBUTES:
            found.pop(name, None)
    return found


def _attributes(message: StoredMessage, source: str) -> Iterator[tuple[str, str]]:
    yield "specversion", SPEC_VERSION
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


def headers(message: StoredMessage, prefix: str, source: str = DEFAULT_SOURCE) -> dict[str, str]:
    """Attributes named `prefix + name`, then the message's own headers as they are.

    A message header never overrides an attribute: an application header called
    `ce-id` must not make two messages look like one to a deduplicating consumer.
    """
    found = {prefix + name: value for name, value in attributes(message, source).items()}
    for name, value in message.headers.items():  # `traceparent` too, for tracing tools
        found.setdefault(name, value)
    return found


def structured(message: StoredMessage, source: str = DEFAULT_SOURCE) -> dict[str, object]:
    """The message as a CloudEvent in structured JSON mode: `data` when the payload is
    JSON (by its content type, and in fact), else `data_base64`."""
    event: dict[str, object] = dict(attributes(message, source))
    event["datacontenttype"] = message.content_type
    try:
        if not is_json(message.content_type):
            raise ValueError(message.content_type)
        event["data"] = json.loads(message.payload)
    except ValueError:  # not JSON, or not what its content type claims: the bytes as they are
        event["data_base64"] = base64.b64encode(message.payload).decode("ascii")
    return event


def is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def split(received: Mapping[str, str], prefix: str) -> tuple[dict[str, str], dict[str, str]]:
    """Received headers back into (attributes, the message's own headers): the inverse
    of `headers`."""
    attributes, others = {}, {}
    for name, value in received.items():
        if name.startswith(prefix):
            attributes[name[len(prefix) :]] = value
        else:
            others[name] = value
    return attributes, others
