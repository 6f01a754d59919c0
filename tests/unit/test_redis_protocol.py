"""The Redis publisher's hand-built XADD commands, and how it reads their replies.

The commands must be byte for byte what redis-py sends for the same `xadd(...)` call:
that is read here from redis-py itself (a pipeline queues the arguments `xadd` makes,
and a connection packs them without connecting), so a redis-py release that changes
either fails these tests instead of the wire.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.connection import Connection

from relaybox.core import envelope
from relaybox.core.publishing import Outcome
from relaybox.publishers import redis as redis_publisher
from relaybox.publishers import redis_protocol
from tests.brokers.harness import stored
from tests.unit.test_envelope import variants


def redis_py_command(key: str, fields: dict[Any, Any], maxlen: int | None, approx: bool) -> bytes:
    pipeline = aioredis.Redis().pipeline(transaction=False)
    pipeline.xadd(key, fields, maxlen=maxlen, approximate=approx)
    ((args, _options),) = pipeline.command_stack
    return b"".join(Connection().pack_commands([args]))


def ours(key: str, fields: dict[str, Any], maxlen: int | None, approx: bool) -> bytes:
    payload = fields.pop("data")
    trim = redis_protocol.trim_options(maxlen, approx)
    known = redis_protocol.field_heads(["datacontenttype", "id"])
    return b"".join(redis_protocol.xadd(key, trim, "data", payload, fields, known))


FIELDS = [
    pytest.param({"data": b"{}", "id": "1"}, id="small"),
    pytest.param({"data": b"", "datacontenttype": "", "id": ""}, id="empty"),
    pytest.param({"data": b"\x00\xff\r\n", "h_x": "naïve café", "h_é": "📦"}, id="non-ascii"),
    pytest.param({"data": b"x" * 100_000, "h_big": "y" * 70_000}, id="large"),
    pytest.param({"data": b"x", "h_crlf": "a\r\nb", "h_space": " a "}, id="as-is"),
]


@pytest.mark.parametrize("fields", FIELDS)
@pytest.mark.parametrize(("maxlen", "approx"), [(None, True), (1000, True), (10, False)])
def test_commands_are_the_bytes_redis_py_sends(
    fields: dict[str, Any], maxlen: int | None, approx: bool
) -> None:
    expected = redis_py_command("outbox:orders.é", dict(fields), maxlen, approx)
    assert ours("outbox:orders.é", dict(fields), maxlen, approx) == expected


@pytest.mark.parametrize(
    "message",
    [
        stored("orders", key="k1"),
        stored("orders", key=None, headers={"traceparent": "00-ab-cd-01", "app": "é"}),
        stored("orders", payload=b"", correlation_id="c", tenant_id="t", external=True),
    ],
)
def test_a_relaybox_entry_is_what_redis_py_would_send(message: Any) -> None:
    fields = redis_publisher.fields(message, "relaybox")
    expected = redis_py_command("p:orders", fields, 5, True)
    trim = redis_protocol.trim_options(5, True)
    got = redis_protocol.xadd(
        "p:orders", trim, redis_publisher.DATA_FIELD, message.payload,
        redis_publisher.text_fields(message, "relaybox"), redis_publisher._FIELD_HEADS,
    )  # fmt: skip
    assert b"".join(got) == expected


ODD = (
    {}, {"key": ""}, {"key": "clé"}, {"type": " padded\r\n"}, {"content_type": "ünï"},
    {"seq": 10**15, "attempts": 12, "partition": 0}, {"payload": b""},
)  # fmt: skip


@pytest.mark.parametrize("source", ["relaybox", "shöp"])
@pytest.mark.parametrize(("maxlen", "approx"), [(None, True), (1000, True), (10, False)])
def test_the_commonest_entry_is_formatted_as_any_other(
    source: str, maxlen: int | None, approx: bool
) -> None:
    """The template for messages of the commonest shape sends the bytes of `xadd`."""
    trim = redis_protocol.trim_options(maxlen, approx)
    templated = 0
    messages = [*variants(), *(stored("orders", **fields) for fields in ODD)]
    for message in messages:
        values = envelope.common_values(message)
        if values is None:
            continue
        expected = b"".join(redis_protocol.xadd(
            "p:orders", trim, redis_publisher.DATA_FIELD, message.payload,
            redis_publisher.text_fields(message, source), redis_publisher._FIELD_HEADS,
        ))  # fmt: skip
        got = redis_publisher.common_entry("p:orders", trim, message, values, source)
        if got is not None:
            assert b"".join(got) == expected
            templated += 1
    assert templated >= (len(ODD) - 2 if source.isascii() else 0)


def test_text_utf8_cannot_carry_is_refused_as_redis_py_refuses_it() -> None:
    with pytest.raises(UnicodeEncodeError):
        redis_py_command("k", {"data": b"", "h_x": "\ud800"}, None, True)
    with pytest.raises(UnicodeEncodeError):
        ours("k", {"data": b"", "h_x": "\ud800"}, None, True)


class FakeConnection:
    """Replies from a list: bytes are entry ids, exceptions are raised as they come."""

    def __init__(self, replies: list[bytes | Exception]) -> None:
        self.replies = replies
        self.sent: list[bytes] = []

    async def send_packed_command(self, command: bytes) -> None:
        self.sent.append(command)

    async def read_response(self, timeout: float | None = None) -> bytes:
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


class FakePool:
    def __init__(self, connection: FakeConnection) -> None:
        self.connection = connection
        self.released: list[FakeConnection] = []

    async def get_connection(self) -> FakeConnection:
        return self.connection

    async def release(self, connection: FakeConnection) -> None:
        self.released.append(connection)


class FakeClient:
    def __init__(self, connection: FakeConnection) -> None:
        self.connection_pool = FakePool(connection)


async def test_each_reply_settles_its_own_message_until_the_connection_breaks() -> None:
    connection = FakeConnection([
        b"1-0", b"1-1", redis_errors.ResponseError("WRONGTYPE Operation against a key"),
        b"1-2", redis_errors.ConnectionError("Connection reset by peer"),
    ])  # fmt: skip
    publisher = redis_publisher.RedisPublisher("redis://127.0.0.1:1/0")
    client = FakeClient(connection)
    publisher._client = client  # type: ignore[assignment]
    batch = [stored("orders", key=f"k{n}") for n in range(7)]
    batch[5] = stored("orders", key="\udc80")  # never sent
    results = await publisher.publish(batch)
    assert [r.outcome for r in results] == [
        Outcome.ACKED, Outcome.ACKED, Outcome.PERMANENT, Outcome.ACKED,
        Outcome.TRANSIENT, Outcome.PERMANENT, Outcome.TRANSIENT,
    ]  # fmt: skip
    assert "WRONGTYPE" in (results[2].error or "")
    assert "UTF-8" in (results[5].error or "")
    assert [r.unavailable for r in results[4::2]] == [True, True]  # the connection's fault
    assert not results[2].unavailable
    assert len(connection.sent) == 1  # one write for the whole call
    assert connection.sent[0].count(b"XADD") == 6
    assert client.connection_pool.released == [connection]


async def test_a_publish_sends_the_commonest_entry_as_redis_py_would() -> None:
    common = stored("orders", key="k1")
    other = stored("orders", key=None)
    assert envelope.common_values(common) is not None
    assert envelope.common_values(other) is None
    connection = FakeConnection([b"1-1", b"1-2"])
    publisher = redis_publisher.RedisPublisher("redis://x", prefix="p:", maxlen=5)
    publisher._client = FakeClient(connection)  # type: ignore[assignment]
    results = await publisher.publish([common, other])
    assert [r.outcome for r in results] == [Outcome.ACKED, Outcome.ACKED]
    expected = [
        redis_py_command("p:orders", redis_publisher.fields(message, "relaybox"), 5, True)
        for message in (common, other)
    ]
    assert connection.sent == [b"".join(expected)]
