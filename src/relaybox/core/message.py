"""The message a service writes, validated and encoded when it is created."""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import math
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, cast

from relaybox.core import tracing
from relaybox.core.envelope import checked_headers, value_problem
from relaybox.core.ids import uuid7
from relaybox.core.payload import DEFAULT_MAX_PAYLOAD_BYTES, check_size, encode_payload
from relaybox.errors import EmptyTopicError, MessageError

DEFAULT_TARGET = "default"
_TARGET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_MAX_TOPIC = 255
_MAX_KEY = 255
#: What an AMQP short string holds (the type, content type and correlation id travel so).
_MAX_SHORT_BYTES = 255
_UTC = datetime.UTC


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """A broker a message goes to; an external one gets the stripped envelope."""

    name: str
    external: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _TARGET_NAME.fullmatch(self.name):
            raise MessageError(
                f"invalid target name {self.name!r}: use 1-64 letters, digits, '_', '.', '-'"
            )


TargetLike = str | Target


def _as_target(value: TargetLike) -> Target:
    return value if isinstance(value, Target) else Target(value)


class Message:
    """One message: written once, delivered to each of its targets.

    `payload` may be JSON-able data (encoded as JSON), `bytes` or `str`; it is encoded
    here, so a payload that cannot be sent fails at creation, not in the relay.
    `type` defaults to the topic; `targets` to the outbox's default target.
    """

    __slots__ = (
        "aggregate_id",
        "body",
        "causation_id",
        "content_type",
        "correlation_id",
        "delay_seconds",
        "headers",
        "id",
        "key",
        "occurred_at",
        "payload",
        "targets",
        "tenant_id",
        "topic",
        "type",
    )

    def __init__(
        self,
        *,
        topic: str,
        payload: Any = None,
        key: str | None = None,
        type: str | None = None,  # noqa: A002 - the CloudEvents name
        content_type: str | None = None,
        headers: Mapping[str, str] | None = None,
        correlation_id: str | uuid.UUID | None = None,
        causation_id: str | uuid.UUID | None = None,
        tenant_id: str | None = None,
        aggregate_id: str | uuid.UUID | None = None,
        targets: Iterable[TargetLike] | TargetLike | None = None,
        delay: datetime.timedelta | float | None = None,
        id: uuid.UUID | None = None,  # noqa: A002 - the message id
        occurred_at: datetime.datetime | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        if not isinstance(topic, str) or not topic.strip():
            raise EmptyTopicError("a message needs a non-empty topic")
        # _check_text, called only when the quick test of short ASCII text fails: three
        # calls fewer in every business transaction, where each call counts.
        if len(topic) > _MAX_TOPIC or not topic.isascii() or "\x00" in topic:
            _check_text("topic", topic, _MAX_TOPIC)
        # The key and the type travel as header values: printable ASCII without spaces
        # passes at once; `_check_value` says what is wrong with the rest (a space at
        # either end, a control character...), or lets it pass.
        if key is not None and (
            builtins.type(key) is not str or len(key) > _MAX_KEY
            or not key.isascii() or not key.isprintable() or " " in key
        ):  # fmt: skip
            _check_value("key", key, _MAX_KEY)
        if type is not None and (
            builtins.type(type) is not str or len(type) > _MAX_TOPIC
            or not type.isascii() or not type.isprintable() or " " in type
        ):  # fmt: skip
            _check_value("type", type, _MAX_TOPIC, _MAX_SHORT_BYTES)
        if content_type is not None:
            _check_value("content_type", content_type, _MAX_TOPIC, _MAX_SHORT_BYTES)
        if id is not None and not isinstance(id, uuid.UUID):
            raise MessageError(f"id must be a uuid.UUID, got {builtins.type(id).__name__}")
        # The common case (no headers, ids, targets or delay) makes no call it can do
        # without: this runs inside the caller's transaction, once per message.
        self.body, self.content_type = encode_payload(payload, content_type)
        if len(self.body) > max_payload_bytes:
            check_size(self.body, max_payload_bytes)
        self.id: uuid.UUID = id if id is not None else uuid7()
        self.topic = topic
        self.payload = payload
        self.key = key
        self.type: str = type or topic
        self.headers = {} if headers is None else checked_headers(headers)
        if "traceparent" not in self.headers:
            traceparent = tracing.current_traceparent()
            if traceparent is not None:
                self.headers["traceparent"] = traceparent
        self.correlation_id = (
            None
            if correlation_id is None
            else _short_str("correlation_id", correlation_id, _MAX_SHORT_BYTES)
        )
        self.causation_id = (
            None if causation_id is None else _short_str("causation_id", causation_id)
        )
        self.tenant_id = None if tenant_id is None else _short_str("tenant_id", tenant_id)
        self.aggregate_id = (
            None if aggregate_id is None else _short_str("aggregate_id", aggregate_id)
        )
        self.targets: tuple[Target, ...] | None = (
            None if targets is None else _checked_targets(targets)
        )
        self.delay_seconds = 0.0 if delay is None else _delay_seconds(delay)
        self.occurred_at = (
            datetime.datetime.now(_UTC) if occurred_at is None else _aware(occurred_at)
        )

    def __repr__(self) -> str:
        return (
            f"Message(id={self.id}, topic={self.topic!r}, key={self.key!r}, "
            f"type={self.type!r}, content_type={self.content_type!r}, {len(self.body)} bytes)"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Message) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)


def _short_str(name: str, value: object, max_bytes: int | None = None) -> str:
    text = str(value)
    _check_value(name, text, _MAX_KEY, max_bytes)
    return text


def _check_value(name: str, value: object, limit: int, max_bytes: int | None = None) -> None:
    """An attribute the message sets (key, type, ids): text as `_check_text` says, which
    every broker also carries as it is (`envelope.value_problem`; NATS would strip or
    change it), of `max_bytes` in UTF-8 at most where given."""
    _check_text(name, value, limit)
    text = cast(str, value)
    problem = value_problem(text)
    if problem is not None:
        raise MessageError(f"{name} {text[:40]!r} {problem}")
    if max_bytes is not None and len(text) > max_bytes // 4 and len(text.encode()) > max_bytes:
        raise MessageError(
            f"{name} {text[:40]!r}... is longer than {max_bytes} bytes in UTF-8, as "
            "RabbitMQ takes it"
        )


def _check_text(name: str, value: object, limit: int) -> None:
    """Text that every database stores as it was given: a str, short, no NUL, valid UTF-8."""
    if not isinstance(value, str):
        raise MessageError(f"{name} must be a str, got {builtins.type(value).__name__}")
    if len(value) > limit:
        raise MessageError(f"{name} is longer than {limit} characters")
    if "\x00" in value:
        raise MessageError(f"{name} contains a NUL character, which databases cannot store")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise MessageError(f"{name} is not valid Unicode text: {exc}") from exc


def _checked_targets(targets: Any) -> tuple[Target, ...]:
    if isinstance(targets, str | Target):
        targets = (targets,)
    try:
        resolved = tuple(_as_target(t) for t in targets)
    except TypeError as exc:
        raise MessageError("targets must be a target name, a Target, or several") from exc
    if not resolved:
        raise MessageError("a message needs at least one target")
    if len({t.name for t in resolved}) != len(resolved):
        raise MessageError("a message names the same target twice")
    return resolved


def _delay_seconds(delay: datetime.timedelta | float) -> float:
    if isinstance(delay, datetime.timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise MessageError("delay must be seconds (int or float) or a datetime.timedelta")
    if not math.isfinite(seconds) or seconds < 0:
        raise MessageError("delay must be a finite, non-negative number of seconds")
    return seconds


def _aware(moment: datetime.datetime) -> datetime.datetime:
    if not isinstance(moment, datetime.datetime):
        raise MessageError("occurred_at must be a datetime")
    if moment.tzinfo is None:
        raise MessageError("occurred_at must be timezone-aware (use datetime.UTC)")
    try:
        moment = moment.astimezone(datetime.UTC)
    except OverflowError:  # within a day of the calendar's ends, in another zone
        raise MessageError("occurred_at lies outside Python's calendar in UTC") from None
    if moment in _CALENDAR_ENDS:
        # asyncpg writes these two as PostgreSQL's infinities and reads them back without
        # a time zone: the time would not come back as it was given.
        raise MessageError(
            "occurred_at must lie strictly between the first and the last microsecond "
            "of Python's calendar"
        )
    return moment


#: The first and last moments a datetime holds, in UTC (see `_aware`).
_CALENDAR_ENDS = frozenset(
    (datetime.datetime.min.replace(tzinfo=datetime.UTC),
     datetime.datetime.max.replace(tzinfo=datetime.UTC))
)  # fmt: skip
