"""The brokers a chaos world publishes to: NATS JetStream, Redis Streams and RabbitMQ,
each a private server on a free port that a test may stop and start again.

A `ChaosBroker` gives the world what differs between them: the URL a relay gets
(through a proxy port), the inbox consumers (relaybox's own consumer for that broker),
a message the broker refuses for good (the poison message), and `delivered()`: what
the broker actually stored, in its order, read back at the end for the checker.

- NATS: a file-backed stream, read back with an ordered consumer; the server's
  timestamps say when each message was published.
- Redis: a stream whose entries stay after the consumer group acknowledged them,
  read back with XRANGE; an entry id is the server's millisecond clock.
- RabbitMQ: queues consume destructively, so the exchange routes each message to two
  durable queues: one for the inbox consumers, one that nobody reads until the end.
  RabbitMQ stamps no arrival time, so there are no recovery times for it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from typing import ClassVar, cast

import aio_pika
import nats
import redis.asyncio as aioredis
from nats.aio.client import Client as NatsClient
from nats.js.api import StorageType, StreamConfig

from relaybox import Consumer, Message
from relaybox.consumers.amqp import AmqpConsumer
from relaybox.consumers.amqp import decode as amqp_decode
from relaybox.consumers.base import BrokerConsumer
from relaybox.consumers.nats import NatsConsumer
from relaybox.consumers.redis import RedisConsumer
from relaybox.consumers.redis import decode as redis_decode
from relaybox.tools.embedded_nats import EmbeddedNats
from tests.brokers.test_amqp import RabbitNode
from tests.chaos.cluster import ThrowawayRedis

TOPIC = "chaos.orders"
#: A topic no broker accepts a message on (see each broker's `poison`).
POISON_TOPIC = "chaos.poison"
#: NATS refuses messages over this size for good.
MAX_MSG_SIZE = 64 * 1024

#: (id, key, when the broker stored it, if it says) of one stored message.
Stored = tuple[str, str | None, float | None]


class ChaosBroker(abc.ABC):
    name: ClassVar[str]
    #: Words one of which the relay's error for a poison message holds.
    refusal: ClassVar[tuple[str, ...]]
    #: The broker's port, which the proxies forward to.
    port: int

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the server and make the topic routable and stored."""

    @abc.abstractmethod
    async def halt(self) -> None:
        """Stop the server by its PID, keeping its port and data."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Start it again after `halt()`; return once it serves."""

    @abc.abstractmethod
    async def destroy(self) -> None:
        """Stop everything this broker started and delete its data."""

    @abc.abstractmethod
    def relay_url(self, proxy_port: int) -> str: ...

    @abc.abstractmethod
    def consumer(self, consumer: Consumer) -> BrokerConsumer:
        """One of the competing inbox consumers."""

    @abc.abstractmethod
    async def delivered(self) -> list[Stored]:
        """Every message the broker stored on the topic, in its order."""

    def poison(self, n: int) -> Message:
        """A message this broker refuses for good, on a key of its own."""
        return Message(topic=POISON_TOPIC, key="poison", payload={"n": n})


class ChaosNats(ChaosBroker):
    name = "NATS"
    refusal = ("size", "maximum")
    stream = "CHAOS"

    def __init__(self) -> None:
        self.server = EmbeddedNats()
        self.port = 0
        self._client: NatsClient | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start)
        self.port = self.server.port
        self._client = await nats.connect(
            self.server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2
        )
        stream = StreamConfig(
            name=self.stream, subjects=[TOPIC], storage=StorageType.FILE,
            max_msg_size=MAX_MSG_SIZE, duplicate_window=120.0,
        )  # fmt: skip
        await self._client.jetstream().add_stream(stream)

    async def halt(self) -> None:
        await asyncio.to_thread(self.server.halt)

    async def resume(self) -> None:
        await asyncio.to_thread(self.server.start)

    async def destroy(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(15):
                    await self._client.close()
        await asyncio.to_thread(self.server.stop)

    def relay_url(self, proxy_port: int) -> str:
        return f"nats://127.0.0.1:{proxy_port}"

    def consumer(self, consumer: Consumer) -> BrokerConsumer:
        return NatsConsumer(
            self.server.url, consumer, stream=self.stream, durable="chaos", prefetch=50,
            ack_wait=10.0, retry_delay=0.2, max_retry_delay=2.0, reconnect_wait=0.2,
        )  # fmt: skip

    def poison(self, n: int) -> Message:
        big = {"n": n, "pad": "x" * (MAX_MSG_SIZE + 1024)}  # on the stream's own topic
        return Message(topic=TOPIC, key="poison", payload=big)

    async def delivered(self) -> list[Stored]:
        assert self._client is not None
        js = self._client.jetstream()
        total = (await js.stream_info(self.stream)).state.messages
        sub = await js.subscribe(TOPIC, ordered_consumer=True)
        found: list[Stored] = []
        try:
            while len(found) < total:
                msg = await sub.next_msg(timeout=10)
                headers = msg.headers or {}
                stamp = msg.metadata.timestamp.timestamp()
                found.append((headers["ce-id"], headers.get("ce-partitionkey"), stamp))
        finally:
            await sub.unsubscribe()
        return found


class ChaosRedis(ChaosBroker):
    name = "Redis"
    refusal = ("WRONGTYPE",)

    def __init__(self) -> None:
        self.server = ThrowawayRedis()
        self.port = self.server.port

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start)
        async with aioredis.Redis.from_url(self.server.url) as client:
            await client.set(POISON_TOPIC, "not a stream")  # XADD to it: WRONGTYPE

    async def halt(self) -> None:
        await asyncio.to_thread(self.server.halt)

    async def resume(self) -> None:
        await asyncio.to_thread(self.server.start)

    async def destroy(self) -> None:
        await asyncio.to_thread(self.server.destroy)

    def relay_url(self, proxy_port: int) -> str:
        return f"redis://127.0.0.1:{proxy_port}/0?timeout=3"

    def consumer(self, consumer: Consumer) -> BrokerConsumer:
        return RedisConsumer(
            self.server.url, consumer, stream=TOPIC, group="chaos", prefetch=50,
            claim_idle=10.0, reconnect_wait=0.2,
        )  # fmt: skip

    async def delivered(self) -> list[Stored]:
        found: list[Stored] = []
        async with aioredis.Redis.from_url(self.server.url) as client:
            low = "-"
            while page := cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                await client.xrange(TOPIC, min=low, count=5000),
            ):
                for entry_id, fields in page:
                    incoming = redis_decode(fields)
                    stamp = int(entry_id.split(b"-")[0]) / 1000  # the server's clock, in ms
                    found.append((incoming.id, incoming.key, stamp))
                low = "(" + page[-1][0].decode()
        return found


class ChaosRabbit(ChaosBroker):
    name = "RabbitMQ"
    refusal = ("unroutable",)
    exchange = "chaos"
    #: The inbox consumers' queue, and the one read back at the end.
    inbox_queue = "chaos.inbox"
    audit_queue = "chaos.audit"

    def __init__(self) -> None:
        self.node = RabbitNode()
        self.port = self.node.port

    async def start(self) -> None:
        await self.node.start()
        connection = await aio_pika.connect(self.node.url, timeout=10)
        async with connection, connection.channel() as channel:
            exchange = await channel.declare_exchange(
                self.exchange, aio_pika.ExchangeType.DIRECT, durable=True
            )
            for name in (self.inbox_queue, self.audit_queue):
                queue = await channel.declare_queue(name, durable=True)
                await queue.bind(exchange, TOPIC)

    async def halt(self) -> None:
        await self.node.stop()

    async def resume(self) -> None:
        await self.node.start()

    async def destroy(self) -> None:
        await self.node.stop()
        await asyncio.to_thread(self.node.remove)

    def relay_url(self, proxy_port: int) -> str:
        return f"amqp://guest:guest@127.0.0.1:{proxy_port}/?exchange={self.exchange}&timeout=3"

    def consumer(self, consumer: Consumer) -> BrokerConsumer:
        return AmqpConsumer(
            self.node.url, consumer, queue=self.inbox_queue, exchange=self.exchange,
            routing_keys=[TOPIC], prefetch=50, retry_delay=0.2, max_retry_delay=2.0,
            reconnect_wait=0.5,
        )  # fmt: skip

    async def delivered(self) -> list[Stored]:
        found: list[Stored] = []
        connection = await aio_pika.connect(self.node.url, timeout=10)
        async with connection, connection.channel() as channel:
            await channel.set_qos(prefetch_count=1000)
            queue = await channel.declare_queue(self.audit_queue, durable=True)
            total = queue.declaration_result.message_count or 0
            if total:
                async with queue.iterator(no_ack=True, timeout=10) as messages:
                    async for message in messages:
                        incoming = amqp_decode(message)
                        found.append((incoming.id, incoming.key, None))
                        if len(found) == total:
                            break
        return found


BROKERS: dict[str, type[ChaosBroker]] = {
    "nats": ChaosNats,
    "redis": ChaosRedis,
    "rabbitmq": ChaosRabbit,
}
