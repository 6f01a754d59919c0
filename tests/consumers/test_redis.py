"""`RedisConsumer` against the shared Redis, with a PostgreSQL inbox.

Each test uses a stream key of its own (deleted afterwards, with its groups) and
publishes with relaybox's own Redis publisher, so `decode` is checked as the inverse of
what the publisher writes. Redis keeps every copy that is added, so a second copy of
a message id is simply published twice. A restart case runs on a private redis-server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from relaybox.consumers import Verdict
from relaybox.consumers.redis import RedisConsumer, decode
from relaybox.core.incoming import Incoming
from relaybox.core.publishing import Outcome
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError, ConfigurationError, EnvelopeError
from relaybox.inbox import Consumer
from relaybox.publishers import open_publisher
from tests.brokers.conformance import outcomes, started
from tests.brokers.harness import free_port, stored, unique_topic
from tests.brokers.test_redis import PrivateRedisHarness, _private_redis
from tests.inbox.support import InboxWorld, wait_until

SHARED_URL = "redis://127.0.0.1:6379/0"


class Stream:
    """A stream key of its own on a Redis server: publish to it, inspect its group."""

    def __init__(self, url: str = SHARED_URL) -> None:
        self.url = url
        self.topic = unique_topic()
        self.client = aioredis.Redis.from_url(url)
        #: Keys to delete afterwards: the stream, and any dead-letter stream.
        self.keys = {self.topic}

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.client.delete(*self.keys)
        await self.client.aclose()

    def consumer(self, consumer: Consumer, **options: Any) -> RedisConsumer:
        options.setdefault("group", "billing")
        options.setdefault("block", 0.2)
        return RedisConsumer(self.url, consumer, stream=self.topic, **options)

    async def publish(self, *messages: StoredMessage) -> None:
        async with started(open_publisher(self.url)) as publisher:
            results = await publisher.publish(messages)
        assert outcomes(results) == [Outcome.ACKED] * len(messages)

    async def entries(self, key: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        return cast(list[tuple[bytes, dict[bytes, bytes]]], await self.client.xrange(key))

    async def settled(self, group: str = "billing") -> bool:
        """Every entry was read by `group` and none is pending."""
        (info,) = [g for g in await self.client.xinfo_groups(self.topic)
                   if g["name"] == group.encode()]  # fmt: skip
        last = (await self.client.xinfo_stream(self.topic))["last-generated-id"]
        return bool(info["pending"] == 0 and info["last-delivered-id"] == last)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld("postgresql", tmp_path) as opened:
        yield opened


@pytest.fixture
async def stream() -> AsyncIterator[Stream]:
    async with Stream() as opened:
        yield opened


async def eventually_settled(stream: Stream, group: str = "billing") -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while not await stream.settled(group):
        assert asyncio.get_running_loop().time() < deadline, "entries left pending"
        await asyncio.sleep(0.1)


def recorder(seen: list[Incoming]) -> Callable[[Incoming], Any]:
    async def record(message: Incoming) -> None:
        seen.append(message)

    return record


async def test_applies_each_message_once_in_per_key_order(
    world: InboxWorld, stream: Stream
) -> None:
    seen: list[Incoming] = []
    messages = [stored(stream.topic, key=f"k{n % 3}", payload=b'{"n": %d}' % n)
                for n in range(12)]  # fmt: skip
    async with stream.consumer(world.consumer(before_effect=recorder(seen))) as consumer:
        await stream.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 12)
        await eventually_settled(stream)
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (12, 0)
    for key in ("k0", "k1", "k2"):
        expected = [str(m.id) for m in messages if m.key == key]
        assert [m.id for m in seen if m.key == key] == expected
    first = seen[0]
    assert first.topic == stream.topic
    assert first.payload == messages[0].payload
    assert first.content_type == "application/json"
    assert first.sequence == messages[0].seq
    assert first.delivery_count == 1


async def test_decode_is_the_inverse_of_the_publisher(stream: Stream) -> None:
    message = stored(stream.topic, headers={"x-app": "shop", "traceparent": "00-ab-cd-01",
                                            "id": "forged"},
                     correlation_id="corr", tenant_id="t1")  # fmt: skip
    await stream.publish(message)
    ((_, fields),) = await stream.entries(stream.topic)
    got = decode(fields, stream=stream.topic)
    assert got.id == str(message.id)
    assert got.payload == message.payload
    assert got.headers == {"x-app": "shop", "traceparent": "00-ab-cd-01", "id": "forged"}
    assert (got.correlation_id, got.tenant_id, got.key) == ("corr", "t1", "k")
    assert (got.partition, got.traceparent) == (3, "00-ab-cd-01")
    assert "datacontenttype" not in got.attributes
    with pytest.raises(EnvelopeError):
        decode({b"data": b"x", b"id": b"\xff"})


async def test_a_second_copy_is_a_duplicate_and_acknowledged(
    world: InboxWorld, stream: Stream
) -> None:
    message = stored(stream.topic)
    await stream.publish(message)
    await stream.publish(message)
    assert await stream.client.xlen(stream.topic) == 2
    async with stream.consumer(world.consumer()) as consumer:
        await wait_until(lambda: consumer.consumer.duplicates == 1)
        await eventually_settled(stream)
    assert world.effects() == {str(message.id): 1}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (1, 1)


async def test_a_failed_handler_is_claimed_again_and_applied_once(
    world: InboxWorld, stream: Stream
) -> None:
    messages = [stored(stream.topic, key=f"k{n}") for n in range(5)]
    failing = str(messages[2].id)
    deliveries: list[int | None] = []

    async def fail_once(message: Incoming) -> None:
        if message.id == failing:
            deliveries.append(message.delivery_count)
            if len(deliveries) == 1:
                raise RuntimeError("the handler fails the first time")

    handler = world.consumer(before_effect=fail_once)
    async with stream.consumer(handler, claim_idle=0.5) as consumer:
        await stream.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 5)
        await eventually_settled(stream)
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (5, 0)
    assert consumer.retried == 1
    assert deliveries == [1, 2]


class DiesBeforeAcking(RedisConsumer):
    """Commits, then hangs instead of acknowledging, until it is stopped: a crash."""

    committed: asyncio.Event

    async def settle(self, client: Any, entry_id: bytes, fields: Any, verdict: Verdict) -> None:
        assert verdict is Verdict.ACK
        self.committed.set()
        await asyncio.Event().wait()


async def test_a_crash_after_commit_is_claimed_and_skipped(
    world: InboxWorld, stream: Stream
) -> None:
    message = stored(stream.topic)
    crashing = DiesBeforeAcking(stream.url, world.consumer(), stream=stream.topic,
                                group="billing", name="doomed", block=0.2)  # fmt: skip
    crashing.committed = asyncio.Event()
    async with crashing:
        await stream.publish(message)
        await asyncio.wait_for(crashing.committed.wait(), 20)
    assert world.effects() == {str(message.id): 1}
    assert not await stream.settled()  # read, never acknowledged

    seen: list[Incoming] = []
    fresh = stream.consumer(world.consumer(before_effect=recorder(seen)), claim_idle=0.5)
    async with fresh:
        await wait_until(lambda: fresh.consumer.duplicates == 1)
        await eventually_settled(stream)
    assert world.effects() == {str(message.id): 1}
    assert (crashing.consumer.applied, crashing.consumer.duplicates) == (1, 0)
    assert (fresh.consumer.applied, fresh.consumer.duplicates) == (0, 1)
    assert seen == []  # the handler did not run again


class Arrivals(RedisConsumer):
    """Counts deliveries as they arrive, before the inbox sees them."""

    arrived: list[RedisConsumer]

    async def handle(self, decode: Callable[[], Incoming]) -> Verdict:
        self.arrived.append(self)
        return await super().handle(decode)


async def test_two_consumers_racing_on_one_message_apply_it_once(
    world: InboxWorld, stream: Stream
) -> None:
    arrived: list[RedisConsumer] = []

    async def hold_the_first_copy(message: Incoming) -> None:
        # Keep this transaction open until the rival copy has arrived too, and then a
        # little longer, so the rival's inbox check waits on this uncommitted record.
        await wait_until(lambda: len(arrived) == 2, timeout=10)
        await asyncio.sleep(0.3)

    def racer() -> Arrivals:
        instance = Arrivals(stream.url, world.consumer(before_effect=hold_the_first_copy),
                            stream=stream.topic, group="billing", count=1, block=0.2)  # fmt: skip
        instance.arrived = arrived
        return instance

    message = stored(stream.topic)
    async with racer() as one, racer() as two:
        await stream.publish(message)
        await stream.publish(message)
        await wait_until(lambda: one.consumer.duplicates + two.consumer.duplicates == 1)
        await eventually_settled(stream)
    assert world.effects() == {str(message.id): 1}
    assert sorted(arrived, key=id) == sorted([one, two], key=id)  # one copy each
    counts = sorted([(c.consumer.applied, c.consumer.duplicates) for c in (one, two)])
    assert counts == [(0, 1), (1, 0)]


async def test_an_undecodable_entry_is_dead_lettered_and_does_not_block(
    world: InboxWorld, stream: Stream
) -> None:
    dead = f"{stream.topic}.dead"
    stream.keys.add(dead)
    messages = [stored(stream.topic, key=f"k{n}") for n in range(3)]
    options = {"dead_letter": dead, "claim_idle": 0.5}
    async with stream.consumer(world.consumer(), **options) as consumer:
        await stream.client.xadd(stream.topic, {"data": b"no envelope", "h_x-app": "shop"})
        await stream.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 3)
        await eventually_settled(stream)
        await asyncio.sleep(1.0)  # past claim_idle: a rejected entry is not claimed again
    assert consumer.rejected == 1
    assert world.effects() == {str(m.id): 1 for m in messages}
    ((_, copy),) = await stream.entries(dead)
    assert copy[b"data"] == b"no envelope"
    assert copy[b"h_x-app"] == b"shop"
    assert copy[b"dl_stream"] == stream.topic.encode()
    assert copy[b"dl_group"] == b"billing"


async def test_an_undecodable_entry_without_dead_letter_is_acknowledged(
    world: InboxWorld, stream: Stream
) -> None:
    message = stored(stream.topic)
    async with stream.consumer(world.consumer()) as consumer:
        await stream.client.xadd(stream.topic, {"data": b"no envelope"})
        await stream.publish(message)
        await wait_until(lambda: consumer.consumer.applied == 1)
        await eventually_settled(stream)
    assert consumer.rejected == 1
    assert world.effects() == {str(message.id): 1}


async def test_a_group_starting_at_dollar_skips_earlier_entries(
    world: InboxWorld, stream: Stream
) -> None:
    earlier, later = stored(stream.topic), stored(stream.topic)
    await stream.publish(earlier)
    async with stream.consumer(world.consumer(), start="$") as consumer:
        await stream.publish(later)
        await wait_until(lambda: consumer.consumer.applied == 1)
        await eventually_settled(stream)
    assert world.effects() == {str(later.id): 1}


async def test_a_key_holding_no_stream_fails_start(world: InboxWorld, stream: Stream) -> None:
    await stream.client.set(stream.topic, "not a stream")
    with pytest.raises(ConfigurationError, match="holds no stream"):
        await stream.consumer(world.consumer()).start()


async def test_keeps_consuming_across_a_server_restart(world: InboxWorld) -> None:
    async with _private_redis() as server:
        assert isinstance(server, PrivateRedisHarness)
        async with Stream(server.base) as stream:
            before = [stored(stream.topic, key="a") for _ in range(2)]
            after = [stored(stream.topic, key="b") for _ in range(2)]
            options = {"reconnect_wait": 0.1, "timeout": 2.0}
            async with stream.consumer(world.consumer(), **options) as consumer:
                await stream.publish(*before)
                await wait_until(lambda: consumer.consumer.applied == 2)
                await server.stop()
                await server.start()
                await stream.publish(*after)
                await wait_until(lambda: consumer.consumer.applied == 4, timeout=30)
                await eventually_settled(stream)
    assert world.effects() == {str(m.id): 1 for m in before + after}


async def test_start_fails_clearly_when_nothing_listens(world: InboxWorld) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    consumer = RedisConsumer(url, world.consumer(), stream="any", timeout=1.0)
    with pytest.raises(BrokerUnavailableError, match="cannot reach Redis"):
        await consumer.start()
