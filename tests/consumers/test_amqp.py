"""`AmqpConsumer` against the shared RabbitMQ, with a PostgreSQL inbox.

Each test uses queues (and exchanges) of its own, deleted afterwards, and publishes with
relaybox's own RabbitMQ publisher, so `decode` is checked as the inverse of what the
publisher writes. A queue is named after the topic: the default exchange routes what
is published on a topic to the queue of that name. "Nothing left unacknowledged" is
checked once the consumers stopped: RabbitMQ then requeues whatever was delivered and
never settled, so an empty queue means every delivery was acknowledged (or rejected).
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from relaybox.consumers import BrokerConsumer
from relaybox.consumers.amqp import AmqpConsumer, decode
from relaybox.core.incoming import Incoming
from relaybox.errors import BrokerError, BrokerUnavailableError, ConfigurationError
from relaybox.inbox import Consumer
from relaybox.publishers import amqp
from tests.brokers.harness import free_port, stored, unique_topic
from tests.consumers.conformance import (
    ConsumerConformance,
    check_carries_the_envelope,
    recorder,
)
from tests.consumers.harness import ConsumerHarness
from tests.inbox.support import InboxWorld, wait_until

SHARED_URL = "amqp://guest:guest@127.0.0.1:5672/"


class AmqpHarness(ConsumerHarness):
    """Queues and exchanges of one test on the shared RabbitMQ: publish, count, delete."""

    def __init__(self) -> None:
        self.url = SHARED_URL
        self.topic = unique_topic()
        #: The `x-` arguments the queue is declared with, by the test and the consumer.
        self.queue_arguments: dict[str, Any] = {}
        self._queues: list[str] = []
        self._exchanges: list[str] = []
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None

    async def __aenter__(self) -> AmqpHarness:
        self._connection = await aio_pika.connect(SHARED_URL, timeout=5)
        self._channel = await self._connection.channel()
        return self

    async def close(self) -> None:
        channel = await self.channel()
        for name in self._queues:
            await channel.queue_delete(name)
        for name in self._exchanges:
            await channel.exchange_delete(name)
        assert self._connection is not None
        await self._connection.close()

    async def channel(self) -> AbstractChannel:
        """The test's channel (opened again if a passive declare closed it)."""
        assert self._connection is not None
        if self._channel is None or self._channel.is_closed:
            self._channel = await self._connection.channel()
        return self._channel

    async def declare(self, name: str | None = None, **arguments: Any) -> str:
        """Declare a durable queue, as `AmqpConsumer` does, before anything is published."""
        name = name or self.topic
        await (await self.channel()).declare_queue(name, durable=True, arguments=arguments)
        self._queues.append(name)
        return name

    async def prepare(self) -> None:
        await self.declare(**self.queue_arguments)

    async def exchange(self) -> str:
        name = unique_topic()
        await (await self.channel()).declare_exchange(name, aio_pika.ExchangeType.DIRECT)
        self._exchanges.append(name)
        return name

    def consumer(self, consumer: Consumer, **options: Any) -> AmqpConsumer:
        options.setdefault("queue", self.topic)
        options.setdefault("retry_delay", 0.1)
        options.setdefault("queue_arguments", self.queue_arguments)
        return AmqpConsumer(SHARED_URL, consumer, **options)

    def racer(self, consumer: Consumer) -> BrokerConsumer:
        # prefetch=1: while one holds its copy unacknowledged, the other copy goes to
        # the other consumer of the queue.
        return self.consumer(consumer, prefetch=1)

    async def rejecting(self, consumer: Consumer) -> BrokerConsumer:
        dead_letters = await self.declare(f"{self.topic}.dead")
        self.queue_arguments = {
            "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead_letters,
        }  # fmt: skip
        return self.consumer(consumer)

    async def publish_undecodable(self) -> None:
        """A message that is no relaybox envelope: no CloudEvents id."""
        message = aio_pika.Message(b"no envelope", headers={"app": "shop"})
        await (await self.channel()).default_exchange.publish(message, self.topic)

    async def publish_envelope(self, attributes: Mapping[str, str], payload: bytes) -> None:
        headers: dict[str, Any] = {f"cloudEvents:{k}": v for k, v in attributes.items()}
        message = aio_pika.Message(payload, headers=headers)
        await (await self.channel()).default_exchange.publish(message, self.topic)

    async def count(self, name: str | None = None) -> int:
        """Messages ready in the queue (not those delivered and unacknowledged)."""
        queue = await (await self.channel()).declare_queue(name or self.topic, passive=True)
        return int(queue.declaration_result.message_count or 0)

    held = count

    async def check_settled(self, *consumers: BrokerConsumer) -> None:
        assert await self.count() == 0

    async def check_unsettled(self) -> None:
        assert await self.count() == 1  # requeued when the connection closed

    async def check_rejected(self) -> None:
        dead_letters = f"{self.topic}.dead"
        for _ in range(100):  # rejected without requeue: dead-lettered
            if await self.count(dead_letters) == 1:
                break
            await asyncio.sleep(0.05)
        assert await self.count(dead_letters) == 1

    async def get(self) -> AbstractIncomingMessage:
        queue = await (await self.channel()).get_queue(self.topic, ensure=False)
        for _ in range(100):
            message = await queue.get(no_ack=True, fail=False)
            if message is not None:
                return message
            await asyncio.sleep(0.05)
        raise AssertionError("nothing arrived in the queue")


@pytest.fixture
async def queues() -> AsyncIterator[AmqpHarness]:
    async with AmqpHarness() as opened:
        yield opened


class TestAmqpConsumer(ConsumerConformance):
    def open_harness(self) -> AmqpHarness:
        return AmqpHarness()

    @pytest.mark.parametrize(
        ("queue_type", "counts"),
        [("classic", (1, None)), ("quorum", (1, 2))],  # only quorum queues count deliveries
    )
    async def test_a_failed_handler_is_retried_and_applied_once(  # type: ignore[override]
        self,
        world: InboxWorld,
        harness: AmqpHarness,
        queue_type: str,
        counts: tuple[int | None, ...],
    ) -> None:
        harness.queue_arguments = {"x-queue-type": queue_type}
        harness.retry_delivery_counts = counts
        await super().test_a_failed_handler_is_retried_and_applied_once(world, harness)


async def test_decode_is_the_inverse_of_the_publisher(queues: AmqpHarness) -> None:
    message = stored(queues.topic, headers={"app": "shop", "traceparent": "00-ab-cd-01"},
                     correlation_id="corr", tenant_id="t1", aggregate_id="order-1")  # fmt: skip
    await queues.declare()
    await queues.publish(message)
    got = decode(await queues.get())
    check_carries_the_envelope(got, message, queues.topic)
    assert amqp.PREFIX == "cloudEvents:"


async def test_binds_the_queue_to_the_publishers_exchange(
    world: InboxWorld, queues: AmqpHarness
) -> None:
    exchange = await queues.exchange()
    topic = unique_topic()
    await queues.declare()  # deleted afterwards; the consumer binds it
    seen: list[Incoming] = []
    consumer = queues.consumer(world.consumer(before_effect=recorder(seen)),
                               exchange=exchange, routing_keys=[topic])  # fmt: skip
    async with consumer:
        message = stored(topic)
        await queues.publish(message, url=f"{SHARED_URL}?exchange={exchange}")
        await wait_until(lambda: consumer.consumer.applied == 1)
    assert world.effects() == {str(message.id): 1}
    assert seen[0].topic == topic  # the routing key, the publisher's topic


def close_connection(name: str) -> None:
    """Have RabbitMQ close the connection named `name` (as on a broker restart)."""
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "--no-table-headers", "pid",
         "client_properties"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    pids = [line.split("\t")[0] for line in listed.stdout.splitlines() if f'"{name}"' in line]
    assert len(pids) == 1, listed.stdout
    subprocess.run(["rabbitmqctl", "-q", "close_connection", pids[0], "test"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip


async def test_keeps_consuming_after_the_broker_closes_the_connection(
    world: InboxWorld, queues: AmqpHarness
) -> None:
    before = [stored(queues.topic, key="a") for _ in range(2)]
    after = [stored(queues.topic, key="b") for _ in range(2)]
    name = f"rbtest-consumer-{queues.topic}"
    await queues.declare()
    async with queues.consumer(world.consumer(), name=name, reconnect_wait=0.2) as consumer:
        await queues.publish(*before)
        await wait_until(lambda: consumer.consumer.applied == 2)
        await asyncio.to_thread(close_connection, name)
        await queues.publish(*after)
        await wait_until(lambda: consumer.consumer.applied == 4, timeout=30)
    assert world.effects() == {str(m.id): 1 for m in before + after}
    assert await queues.count() == 0


async def test_start_fails_clearly(world: InboxWorld, queues: AmqpHarness) -> None:
    nowhere = AmqpConsumer(f"amqp://guest:secret@127.0.0.1:{free_port()}/", world.consumer(),
                           queue=queues.topic, timeout=2)  # fmt: skip
    with pytest.raises(BrokerUnavailableError, match="cannot connect") as refused:
        await nowhere.start()
    assert "secret" not in str(refused.value)
    missing = queues.consumer(world.consumer(), declare=False)
    with pytest.raises(BrokerError, match="cannot consume queue"):
        await missing.start()
    with pytest.raises(ConfigurationError, match="prefetch"):
        queues.consumer(world.consumer(), prefetch=0)


def test_decode_rejects_a_message_without_an_id() -> None:
    from relaybox.errors import EnvelopeError

    class Raw:
        headers = {"cloudEvents:type": "t", "x-death": [{"count": 1}]}
        body = b"{}"
        content_type = None
        routing_key = "orders"
        redelivered = True

    with pytest.raises(EnvelopeError, match="no CloudEvents id"):
        decode(Raw())  # type: ignore[arg-type]
