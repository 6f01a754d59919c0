from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import os
import uuid

import pytest

from relaybox import (
    EmptyTopicError,
    InvalidHeadersError,
    Message,
    MessageError,
    PayloadNotSerializableError,
    PayloadTooLargeError,
    RelayboxError,
    Target,
)
from relaybox.core.ids import uuid7, uuid7_time_ms


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Line:
    sku: str
    qty: int


def test_defaults() -> None:
    message = Message(topic="orders", payload={"a": 1})
    assert message.id.version == 7
    assert message.type == "orders"
    assert message.content_type == "application/json"
    assert message.body == b'{"a":1}'
    assert message.targets is None  # the outbox's default targets apply
    assert message.occurred_at.tzinfo is datetime.UTC
    assert message.delay_seconds == 0.0


def test_payload_kinds() -> None:
    assert Message(topic="t", payload=b"\x01").content_type == "application/octet-stream"
    assert Message(topic="t", payload="é").body == "é".encode()
    assert (
        Message(topic="t", payload="<a/>", content_type="application/xml").content_type
        == "application/xml"
    )
    rich = Message(topic="t", payload={"when": datetime.date(2026, 1, 2), "id": uuid.UUID(int=1),
                                       "amount": decimal.Decimal("1.10"), "colour": Colour.RED,
                                       "line": Line("s", 2)})  # fmt: skip
    assert b'"amount":"1.10"' in rich.body
    assert b'"line":{"sku":"s","qty":2}' in rich.body


@pytest.mark.parametrize("topic", ["", "   ", None])
def test_empty_topic(topic: object) -> None:
    with pytest.raises(EmptyTopicError):
        Message(topic=topic)  # type: ignore[arg-type]


@pytest.mark.parametrize("payload", [object(), {"x": float("nan")}, {1j: 2}])
def test_unserialisable_payload(payload: object) -> None:
    with pytest.raises(PayloadNotSerializableError, match="cannot be serialised"):
        Message(topic="t", payload=payload)


def test_payload_size_limit_default_and_custom() -> None:
    Message(topic="t", payload=b"x" * (1024 * 1024))
    with pytest.raises(PayloadTooLargeError, match="over the limit"):
        Message(topic="t", payload=b"x" * (1024 * 1024 + 1))
    with pytest.raises(PayloadTooLargeError):
        Message(topic="t", payload="abc", max_payload_bytes=2)


@pytest.mark.parametrize("headers", [{"a": 1}, {"": "x"}, ["a"]])
def test_bad_headers(headers: object) -> None:
    with pytest.raises(InvalidHeadersError):
        Message(topic="t", headers=headers)  # type: ignore[arg-type]


def test_targets() -> None:
    message = Message(topic="t", targets=["a", Target("b", external=True)])
    assert message.targets == (Target("a"), Target("b", external=True))
    assert Message(topic="t", targets="a").targets == (Target("a"),)
    with pytest.raises(MessageError, match="same target twice"):
        Message(topic="t", targets=["a", "a"])
    with pytest.raises(MessageError, match="at least one"):
        Message(topic="t", targets=[])
    with pytest.raises(MessageError, match="invalid target name"):
        Message(topic="t", targets=["no spaces"])


def test_other_fields() -> None:
    with pytest.raises(MessageError, match="timezone-aware"):
        Message(topic="t", occurred_at=datetime.datetime(2026, 1, 1))
    # The calendar's two ends would be stored as PostgreSQL's infinities by asyncpg and
    # read back without a zone; a moment beside an end in another zone is none in UTC.
    utc, east = datetime.UTC, datetime.timezone(datetime.timedelta(hours=5, minutes=30))
    for end in (datetime.datetime.max, datetime.datetime.min):
        with pytest.raises(MessageError, match="strictly between"):
            Message(topic="t", occurred_at=end.replace(tzinfo=utc))
    with pytest.raises(MessageError, match="outside Python's calendar"):
        Message(topic="t", occurred_at=datetime.datetime.min.replace(tzinfo=east))
    last = datetime.datetime.max.replace(microsecond=999998, tzinfo=utc)
    assert Message(topic="t", occurred_at=last).occurred_at == last
    with pytest.raises(MessageError, match="negative"):
        Message(topic="t", delay=-1)
    assert Message(topic="t", delay=datetime.timedelta(seconds=90)).delay_seconds == 90
    assert Message(topic="t", correlation_id=uuid.UUID(int=5)).correlation_id == str(
        uuid.UUID(int=5)
    )
    with pytest.raises(MessageError, match="key"):
        Message(topic="t", key="k" * 256)


def test_every_message_error_is_a_relaybox_error() -> None:
    assert issubclass(PayloadTooLargeError, MessageError)
    assert issubclass(MessageError, RelayboxError)
    assert str(RelayboxError()) == "relaybox failed."


def test_uuid7_is_monotonic_and_time_ordered() -> None:
    ids = [uuid7() for _ in range(20_000)]
    assert ids == sorted(ids, key=lambda u: u.int)
    assert len(set(ids)) == len(ids)
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in ids[:100])
    now_ms = int(datetime.datetime.now(datetime.UTC).timestamp() * 1000)
    assert abs(uuid7_time_ms(ids[-1]) - now_ms) < 5_000


def test_uuid7_from_threads_is_unique_and_increasing_per_thread() -> None:
    import threading

    made: list[list[uuid.UUID]] = [[] for _ in range(4)]

    def draw(into: list[uuid.UUID]) -> None:
        into.extend(uuid7() for _ in range(5_000))

    threads = [threading.Thread(target=draw, args=(ids,)) for ids in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({u for ids in made for u in ids}) == 20_000
    assert all(ids == sorted(ids, key=lambda u: u.int) for ids in made)


def test_circular_payload_is_reported_not_crashed() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(PayloadNotSerializableError):
        Message(topic="t", payload=loop)


def test_uuid7_values_behave_like_any_uuid() -> None:
    import pickle

    value = uuid7()
    assert uuid.UUID(str(value)) == value
    assert hash(uuid.UUID(str(value))) == hash(value)
    assert pickle.loads(pickle.dumps(value)) == value


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"key": "a\x00b"}, "NUL"),
        ({"topic": "t\x00"}, "NUL"),
        ({"key": "\ud800"}, "not valid Unicode"),
        ({"correlation_id": "c\x00"}, "NUL"),
        ({"type": 5}, "type must be a str"),
        ({"content_type": 5}, "content_type must be a str"),
        ({"id": "not-a-uuid"}, "uuid.UUID"),
        ({"delay": float("nan")}, "finite"),
        ({"delay": float("inf")}, "finite"),
        ({"delay": "soon"}, "seconds"),
        ({"tenant_id": "t" * 256}, "longer than"),
    ],
)
def test_text_and_values_that_databases_would_reject_fail_at_creation(
    fields: dict[str, object], match: str
) -> None:
    base: dict[str, object] = {"topic": "orders"}
    with pytest.raises(MessageError, match=match):
        Message(**{**base, **fields})  # type: ignore[arg-type]


def test_bad_header_text_and_bad_str_payloads() -> None:
    with pytest.raises(InvalidHeadersError, match="NUL"):
        Message(topic="t", headers={"h": "a\x00"})
    with pytest.raises(PayloadNotSerializableError, match="Unicode"):
        Message(topic="t", payload="\udc80")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_does_not_reuse_its_parents_random_bits() -> None:
    uuid7()  # the parent has drawn its pool
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.write(write, uuid7().bytes)
        os._exit(0)
    os.waitpid(child, 0)
    theirs = uuid.UUID(bytes=os.read(read, 16))
    os.close(read)
    os.close(write)
    ours = uuid7()
    random_bits = (1 << 62) - 1
    assert theirs.int & random_bits != ours.int & random_bits
