"""`RedisConsumer` against the shared Redis, with a PostgreSQL inbox.

Each test uses a stream key of its own (deleted afterwards, with its groups) and
publishes with relaybox's own Redis publisher, so `decode` is checked as the inverse of
what the publisher writes. Redis keeps every copy that is added, so a second copy of
a message id is simply published twice. A restart case runs on a private redis-server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from relaybox.consumers import BrokerConsumer
from relaybox.consumers.redis import RedisConsumer, decode
from relaybox.errors import BrokerUnavailableError, ConfigurationError, EnvelopeError
from relaybox.inbox import Consumer
from tests.brokers.harness import free_port, stored, unique_topic
from tests.brokers.test_redis import PrivateRedisHarness, _private_redis
from tests.consumers.conformance import ConsumerConformance
from tests.consumers.harness import ConsumerHarness
from tests.inbox.support import InboxWorld, wait_until
from tests.relay_support import eventually

SHARED_URL = "redis://127.0.0.1:6379/0"


class RedisHarness(ConsumerHarness):
    """A stream key of its own on a Redis server: publish to it, inspect its group."""

    redelivery_wait = 1.0  # past the rejecting consumer's claim_idle

    def __init__(self, url: str = SHARED_URL) -> None:
        self.url = url
        self.topic = unique_topic()
        self.client = aioredis.Redis.from_url(url)
        self.dead_letter = f"{self.topic}.dead"
        #: Keys to delete afterwards: the stream, and any dead-letter stream.
        self.keys = {self.topic}

    async def close(self) -> None:
        await self.client.delete(*self.keys)
        await self.client.aclose()

    def consumer(self, consumer: Consumer, **options: Any) -> RedisConsumer:
        options.setdefault("group", "billing")
        options.setdefault("fetch_timeout", 0.2)
        return RedisConsumer(self.url, consumer, stream=self.topic, **options)

    def retrying(self, consumer: Consumer) -> BrokerConsumer:
        return self.consumer(consumer, claim_idle=0.5)

    def crashing(self, consumer: Consumer) -> BrokerConsumer:
        return self.consumer(consumer, name="doomed")

    def successor(self, crashed: BrokerConsumer, consumer: Consumer) -> BrokerConsumer:
        return self.consumer(consumer, claim_idle=0.5)

    def racer(self, consumer: Consumer) -> BrokerConsumer:
        return self.consumer(consumer, prefetch=1)

    async def rejecting(self, consumer: Consumer) -> BrokerConsumer:
        self.keys.add(self.dead_letter)
        return self.consumer(consumer, dead_letter=self.dead_letter, claim_idle=0.5)

    async def publish_undecodable(self) -> None:
        await self.client.xadd(self.topic, {"data": b"no envelope", "h_x-app": "shop"})

    async def publish_envelope(self, attributes: Mapping[str, str], payload: bytes) -> None:
        await self.client.xadd(self.topic, {"data": payload, **attributes})

    async def held(self) -> int:
        return int(await self.client.xlen(self.topic))

    async def entries(self, key: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        return cast(list[tuple[bytes, dict[bytes, bytes]]], await self.client.xrange(key))

    async def settled(self, group: str = "billing") -> bool:
        """Every entry was read by `group` and none is pending."""
        (info,) = [g for g in await self.client.xinfo_groups(self.topic)
                   if g["name"] == group.encode()]  # fmt: skip
        last = (await self.client.xinfo_stream(self.topic))["last-generated-id"]
        return bool(info["pending"] == 0 and info["last-delivered-id"] == last)

    async def settling(self) -> None:
        await eventually(self.settled, timeout=20, interval=0.1)

    async def check_unsettled(self) -> None:
        assert not await self.settled()  # read, never acknowledged

    async def check_rejected(self) -> None:
        ((_, copy),) = await self.entries(self.dead_letter)
        assert copy[b"data"] == b"no envelope"
        assert copy[b"h_x-app"] == b"shop"
        assert copy[b"dl_stream"] == self.topic.encode()
        assert copy[b"dl_group"] == b"billing"


@pytest.fixture
async def stream() -> AsyncIterator[RedisHarness]:
    async with RedisHarness() as opened:
        yield opened


class TestRedisConsumer(ConsumerConformance):
    def open_harness(self) -> RedisHarness:
        return RedisHarness()


async def test_decode_is_the_inverse_of_the_publisher(stream: RedisHarness) -> None:
    message = stored(stream.topic, headers={"app": "shop", "traceparent": "00-ab-cd-01"},
                     correlation_id="corr", tenant_id="t1")  # fmt: skip
    await stream.publish(message)
    ((_, fields),) = await stream.entries(stream.topic)
    got = decode(fields, stream=stream.topic)
    assert got.id == str(message.id)
    assert got.payload == message.payload
    assert got.headers == {"app": "shop", "traceparent": "00-ab-cd-01"}
    assert (got.correlation_id, got.tenant_id, got.key) == ("corr", "t1", "k")
    assert (got.partition, got.traceparent) == (3, "00-ab-cd-01")
    assert "datacontenttype" not in got.attributes
    with pytest.raises(EnvelopeError):
        decode({b"data": b"x", b"id": b"\xff"})


async def test_an_undecodable_entry_without_dead_letter_is_acknowledged(
    world: InboxWorld, stream: RedisHarness
) -> None:
    message = stored(stream.topic)
    async with stream.consumer(world.consumer()) as consumer:
        await stream.client.xadd(stream.topic, {"data": b"no envelope"})
        await stream.publish(message)
        await wait_until(lambda: consumer.consumer.applied == 1)
        await stream.settling()
    assert consumer.rejected == 1
    assert world.effects() == {str(message.id): 1}


async def test_a_group_starting_at_dollar_skips_earlier_entries(
    world: InboxWorld, stream: RedisHarness
) -> None:
    earlier, later = stored(stream.topic), stored(stream.topic)
    await stream.publish(earlier)
    async with stream.consumer(world.consumer(), start="$") as consumer:
        await stream.publish(later)
        await wait_until(lambda: consumer.consumer.applied == 1)
        await stream.settling()
    assert world.effects() == {str(later.id): 1}


async def test_a_key_holding_no_stream_fails_start(world: InboxWorld, stream: RedisHarness) -> None:
    await stream.client.set(stream.topic, "not a stream")
    with pytest.raises(ConfigurationError, match="holds no stream"):
        await stream.consumer(world.consumer()).start()


async def test_keeps_consuming_across_a_server_restart(world: InboxWorld) -> None:
    async with _private_redis() as server:
        assert isinstance(server, PrivateRedisHarness)
        async with RedisHarness(server.base) as stream:
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
                await stream.settling()
    assert world.effects() == {str(m.id): 1 for m in before + after}


async def test_start_fails_clearly_when_nothing_listens(world: InboxWorld) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    consumer = RedisConsumer(url, world.consumer(), stream="any", timeout=1.0)
    with pytest.raises(BrokerUnavailableError, match="cannot reach Redis"):
        await consumer.start()
