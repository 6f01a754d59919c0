"""The wire envelope: CloudEvents attributes in binary content mode.

The payload travels as the broker message's body, untouched; the attributes travel as
headers, named by each broker's CloudEvents binding (`ce_` on Kafka, `cloudEvents:` on
AMQP, `ce-` on HTTP and NATS, plain names in Redis stream fields and MQTT 5 user
properties). A message's own headers travel beside them under their own names.

An *external* target gets the stripped envelope: the attributes an outside
consumer needs (id for deduplication, type, source, time, subject, correlation,
causation, tenant, trace context) but none of relaybox's internal bookkeeping (sequence,
partition, aggregate id, attempts).

A message's own headers share each broker's header space with the attributes (on Redis
and MQTT under the very same plain names), with the binding's fields and with what
brokers and their clients read themselves. `checked_headers` keeps them apart: a header
name is an RFC 9110 token that no attribute, binding, broker or HTTP transport owns
(compared in any case), named once; a value is text that every broker carries as it is.
`Message` refuses other headers when it is made, and the publishers refuse to send a
stored message whose headers break the rule (`attributes` raises for it), so no
header can replace, duplicate or pose as anything of the envelope on any broker.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from relaybox.errors import InvalidHeadersError

if TYPE_CHECKING:
    from relaybox.core.records import StoredMessage

SPEC_VERSION = "1.0"
#: The CloudEvents `source` when a broker URL does not set one (`?source=`).
DEFAULT_SOURCE = "relaybox"

#: Every attribute `attributes` may return, in its order.
ATTRIBUTE_NAMES = (
    "specversion", "id", "source", "type", "time", "subject", "partitionkey",
    "correlationid", "causationid", "tenantid", "aggregateid", "traceparent",
    "sequence", "partition", "attempts",
)  # fmt: skip
#: Attributes only relaybox's own consumers use; external targets never see them.
INTERNAL_ATTRIBUTES = frozenset({"sequence", "partition", "aggregateid", "attempts"})
#: The attributes of the CloudEvents MQTT binding: every User Property of these names is
#: an attribute, every other one a header (`traceparent` is both).
MQTT_ATTRIBUTE_NAMES = frozenset({*ATTRIBUTE_NAMES, "dataschema", "datacontenttype"})

#: The longest header name and the longest header value, in characters.
MAX_HEADER_NAME = 255
MAX_HEADER_VALUE = 64 * 1024
#: The trace context travels as headers (and `traceparent` as an attribute too).
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
#: HTTP's own request headers, in lower case, besides `content-*` and `proxy-*`: the
#: connection, the framing, the credentials and the client's own, which a webhook sends
#: and reads for its transport, never for a message.
HTTP_TRANSPORT_HEADERS = frozenset({
    "accept", "accept-encoding", "authorization", "connection", "cookie", "expect", "host",
    "http2-settings", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade",
    "user-agent",
})  # fmt: skip
#: Header names a message may not use, in lower case (names compare in any case).
RESERVED_HEADER_NAMES = frozenset({
    # CloudEvents attributes under their plain names (Redis entries, MQTT User
    # Properties), and the fields beside them (the payload, its content type).
    *(MQTT_ATTRIBUTE_NAMES - TRACE_HEADERS), "data", "data_base64",
    # What nats-py takes for a status line: a JetStream fetch drops such a message.
    "status", "description",
    # RabbitMQ copies a message to the queues its CC and BCC headers name.
    "cc", "bcc",
    *HTTP_TRANSPORT_HEADERS,
})  # fmt: skip
#: Header name prefixes a message may not use, in lower case.
RESERVED_HEADER_PREFIXES = (
    "ce-", "ce_",  # CloudEvents attributes on HTTP and NATS, on Kafka
    "cloudevents",  # ... on AMQP: `cloudEvents:` (and `cloudEvents_` for JMS)
    "nats-",  # what JetStream acts on: Nats-Msg-Id, Nats-Expected-*, Nats-Rollup, ...
    "x-",  # what RabbitMQ acts on: x-delivery-count, x-death, x-delay, ...
    "relaybox-",  # the webhook's signature and topic
    "content-",  # the content type of every binding; the body's framing on HTTP
    "proxy-",  # HTTP's, for the proxy
)  # fmt: skip

#: An RFC 9110 token: no whitespace, control character, ':' or other separator.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: What would end a header line early or is no text at all (a tab is fine).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


#: The attributes of the commonest message, in `attributes`' order: one with a key, no
#: correlation, causation, tenant or aggregate id, no headers of its own, to an
#: internal target (see `common_values`).
COMMON_ATTRIBUTES = (
    "specversion", "id", "source", "type", "time", "subject", "partitionkey",
    "sequence", "partition", "attempts",
)  # fmt: skip


def common_values(message: StoredMessage) -> tuple[str, str, str, str, str] | None:
    """For a message of the commonest shape (its attributes are COMMON_ATTRIBUTES), the
    values of those that are made here: id, time, sequence, partition and attempts
    (the others are the source, the type and the key as they are); None for any other
    message. A publisher formats such a message in one template, which measured faster
    than walking `attributes` for a Redis entry and a NATS header block."""
    if (
        message.key is None
        or message.headers
        or message.external
        or message.correlation_id is not None
        or message.causation_id is not None
        or message.tenant_id is not None
        or message.aggregate_id is not None
    ):
        return None
    return (
        str(message.id), _time(message), str(message.seq), str(message.partition),
        str(message.attempts),
    )  # fmt: skip


def _time(message: StoredMessage) -> str:
    return message.occurred_at.isoformat().replace("+00:00", "Z")


def attributes(message: StoredMessage, source: str = DEFAULT_SOURCE) -> dict[str, str]:
    """The message's CloudEvents attributes, as strings, without `datacontenttype`
    (each binding carries that in its own content-type field).

    Built with one dict display and direct stores, not from a generator: the relay calls
    this for every message it publishes, and a generator measured slower.
    """
    found = {
        "specversion": SPEC_VERSION,
        "id": str(message.id),
        "source": source,
        "type": message.type,
        "time": _time(message),
    }
    key = message.key
    if key is not None:
        found["subject"] = key
        found["partitionkey"] = key
    if message.correlation_id is not None:
        found["correlationid"] = message.correlation_id
    if message.causation_id is not None:
        found["causationid"] = message.causation_id
    if message.tenant_id is not None:
        found["tenantid"] = message.tenant_id
    internal = not message.external
    if internal and message.aggregate_id is not None:
        found["aggregateid"] = message.aggregate_id
    own = message.headers
    if own:
        check_stored_headers(message)
        traceparent = own.get("traceparent")
        if traceparent is not None:
            found["traceparent"] = traceparent
    if internal:  # INTERNAL_ATTRIBUTES, which external targets never see
        found["sequence"] = str(message.seq)
        found["partition"] = str(message.partition)
        found["attempts"] = str(message.attempts)
    return found


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
    JSON (by its content type, and in fact) that encodes back to UTF-8 JSON text,
    else `data_base64` (the bytes as they are)."""
    event: dict[str, object] = dict(attributes(message, source))
    event["datacontenttype"] = message.content_type
    try:
        if not is_json(message.content_type):
            raise ValueError(message.content_type)
        event["data"] = _json_data(message.payload)
    except ValueError:  # not JSON, or not what its content type claims: the bytes as they are
        event["data_base64"] = base64.b64encode(message.payload).decode("ascii")
    return event


def _json_data(payload: bytes) -> object:
    """The JSON payload decoded, if it encodes back: `ValueError` for one that is not
    JSON, nests deeper than MAX_JSON_DEPTH (decoding or encoding it again would exhaust
    the stack) or holds half a surrogate pair (no UTF-8 can carry it)."""
    text = payload.decode(json.detect_encoding(payload))
    if nests_deeper_than(text, MAX_JSON_DEPTH):
        raise ValueError("nested too deeply")
    data = json.loads(text)
    if _SURROGATE_ESCAPE.search(text):  # a pair (an emoji) or half of one: which?
        json.dumps(data, ensure_ascii=False).encode()  # UnicodeEncodeError is a ValueError
    return data


#: The deepest nesting of JSON arrays and objects relaybox decodes, or encodes again.
MAX_JSON_DEPTH = 200
#: A JSON escape of a UTF-16 surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


#: A JSON string (unrolled: no backtracking), whose brackets are no nesting.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEPS = {"[": 1, "{": 1, "]": -1, "}": -1}


def nests_deeper_than(text: str, limit: int) -> bool:
    """Whether JSON `text` nests arrays and objects deeper than `limit`: counted only
    when it has that many opening brackets at all, outside its strings."""
    if text.count("[") + text.count("{") <= limit:
        return False
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(map(_STEPS.__getitem__, brackets)), default=0) > limit


def checked_headers(headers: object) -> dict[str, str]:
    """`headers` as a new dict, if each name is free and each value fit to send (see the
    module docstring); else `InvalidHeadersError`, saying which header and why.

    This runs in the writer's transaction for every message with headers: a name seen
    before is looked up (`_KNOWN_NAMES`), a value of printable ASCII passes in a few
    calls made in C, and only the rest is looked at closely.
    """
    if type(headers) is not dict and not isinstance(headers, Mapping):
        raise InvalidHeadersError("headers must be a mapping of str names to str values")
    checked = dict(headers)  # what is checked is what is kept, whatever `headers` does
    known, seen = _KNOWN_NAMES, set()
    for name, value in checked.items():
        lower = known.get(name) if type(name) is str else None
        if lower is None:
            lower = _new_name(name)
        if lower in seen:
            raise InvalidHeadersError(
                f"header {name!r} is named twice (header names compare in any case)"
            )
        seen.add(lower)
        if not (
            type(value) is str
            and value.isascii()
            and value.isprintable()  # with isascii: no tab, CR, LF, NUL or DEL
            and len(value) <= MAX_HEADER_VALUE
            and not value.startswith(" ")
            and not value.endswith(" ")
        ):
            _check_value(name, value)
    return checked


#: Header names found free, and their lower case: the few names an application uses,
#: checked once each (up to a bound, so that no stream of new names grows it for ever).
_KNOWN_NAMES: dict[str, str] = {}
_MAX_KNOWN_NAMES = 4096


def _new_name(name: object) -> str:
    """The lower case of `name`, a header name not seen before, if it is free."""
    if not isinstance(name, str) or len(name) > MAX_HEADER_NAME or not _TOKEN.fullmatch(name):
        raise InvalidHeadersError(_bad_name(name))
    lower = name.lower()
    if lower in RESERVED_HEADER_NAMES or lower.startswith(RESERVED_HEADER_PREFIXES):
        raise InvalidHeadersError(_reserved(name))
    if lower in TRACE_HEADERS and name != lower:  # HTTP would read it as the trace context
        raise InvalidHeadersError(
            f"header name {name!r}: write the trace context's headers in lower case, "
            f"{lower!r}, as every broker reads them"
        )
    if type(name) is str and len(_KNOWN_NAMES) < _MAX_KNOWN_NAMES:
        _KNOWN_NAMES[name] = lower
    return lower


def _bad_name(name: object) -> str:
    if not isinstance(name, str):
        return f"header name {name!r} must be a str, not {type(name).__name__}"
    if len(name) > MAX_HEADER_NAME:
        return f"header name {name[:40]!r}... is longer than {MAX_HEADER_NAME} characters"
    return (
        f"header name {name!r} is not an RFC 9110 token: use letters, digits and "
        "!#$%&'*+-.^_`|~, without spaces, control characters or ':'"
    )


def _reserved(name: str) -> str:
    lower = name.lower()
    owner = next(
        (why for prefixes, why in _OWNERS if lower in prefixes or lower.startswith(prefixes)),
        "is HTTP's own, which a webhook sends and reads for its connection",
    )
    return f"header name {name!r} {owner}: choose another name"


#: Who owns a reserved header name, by names and prefixes (for the error message).
_OWNERS = (
    ((*MQTT_ATTRIBUTE_NAMES, "data", "data_base64"),
     "is a CloudEvents attribute or field, which Redis and MQTT carry under its plain name"),
    (("ce-", "ce_", "cloudevents"),
     "carries CloudEvents attributes in the HTTP, NATS, Kafka or AMQP binding"),
    (("nats-",), "is read by NATS JetStream (Nats-Msg-Id drops messages as copies)"),
    (("status", "description"), "is read by the NATS client as a status line"),
    (("x-",), "is read by RabbitMQ (x-delivery-count, x-death, x-delay, ...)"),
    (("cc", "bcc"), "makes RabbitMQ copy the message to other queues"),
    (("content-",), "is the binding's content type, or describes an HTTP body"),
    (("relaybox-",), "is one of relaybox's webhook headers"),
)  # fmt: skip


def _check_value(name: str, value: object) -> None:
    """Raise `InvalidHeadersError` unless `value` is text every broker sends as it is."""
    if not isinstance(value, str):
        raise InvalidHeadersError(
            f"header {name!r} must have a str value, not {type(value).__name__}"
        )
    if len(value) > MAX_HEADER_VALUE:
        raise InvalidHeadersError(f"header {name!r} is longer than {MAX_HEADER_VALUE} characters")
    problem = value_problem(value)
    if problem is not None:
        raise InvalidHeadersError(f"header {name!r} {problem}")


def value_problem(value: str) -> str | None:
    """Why `value` would not reach a consumer as it is on every broker, if it would not:
    the rule for header values and for attributes a message sets (key, type, ids)."""
    if _CONTROL.search(value):
        return (
            "contains a control character (CR, LF, NUL...), which could end its header line early"
        )
    if value != value.strip():
        return "begins or ends with whitespace, which HTTP and NATS strip"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"is not valid Unicode text: {error}"
    return None


def check_stored_headers(message: StoredMessage) -> None:
    """Raise `InvalidHeadersError` unless a stored message's headers pass the check
    `Message` makes when it is created: a row written otherwise (by an older relaybox,
    by hand) is refused here, and `attributes` calls this, so no publisher sends it."""
    try:
        checked_headers(message.headers)
    except InvalidHeadersError as error:
        raise InvalidHeadersError(f"message {message.id} is never sent: {error}") from None


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
