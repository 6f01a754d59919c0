"""`AmqpConsumer` against the shared RabbitMQ, with a PostgreSQL inbox.

Each test uses queues (and exchanges) of its own, deleted afterwards, and publishes with
relaybox's own RabbitMQ publisher, so `decode` is checked as the inverse of what the
publisher writes. "Nothing left unacknowledged" is checked once the consumers stopped:
RabbitMQ then requeues whatever was delivered and never settled, so an empty queue
means every delivery was acknowledged (or rejected).
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from relaybox.consumers import Verdict
from relaybox.consumers.amqp import AmqpConsumer, decode
from relaybox.core.incoming import Incoming
from relaybox.core.publishing import Outcome
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerError, BrokerUnavailableError, ConfigurationError
from relaybox.inbox import Consumer
from relaybox.publishers import amqp, open_publisher
from tests.brokers.conformance import outcomes, started
from tests.brokers.harness import free_port, stored, unique_topic
from tests.inbox.support import InboxWorld, wait_until

SHARED_URL = "amqp://guest:guest@127.0.0.1:5672/"


class Queues:
    """Queues and exchanges of one test on the shared RabbitMQ: publish, count, delete."""

    def __init__(self) -> None:
        self.name = unique_topic()
        self._queues: list[str] = []
        self._exchanges: list[str] = []
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None

    async def __aenter__(self) -> Queues:
        self._connection = await aio_pika.connect(SHARED_URL, timeout=5)
        self._channel = await self._connection.channel()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
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
        name = name or self.name
        await (await self.channel()).declare_queue(name, durable=True, arguments=arguments)
        self._queues.append(name)
        return name

    async def exchange(self) -> str:
        name = unique_topic()
        await (await self.channel()).declare_exchange(name, aio_pika.ExchangeType.DIRECT)
        self._exchanges.append(name)
        return name

    def consumer(self, consumer: Consumer, **options: Any) -> AmqpConsumer:
        options.setdefault("queue", self.name)
        options.setdefault("retry_delay", 0.1)
        return AmqpConsumer(SHARED_URL, consumer, **options)

    async def publish(self, *messages: StoredMessage, url: str = SHARED_URL) -> None:
        async with started(open_publisher(url)) as publisher:
            results = await publisher.publish(messages)
        assert outcomes(results) == [Outcome.ACKED] * len(messages)

    async def publish_raw(self, body: bytes, headers: dict[str, Any]) -> None:
        """A message that is no relaybox envelope: no CloudEvents id."""
        message = aio_pika.Message(body, headers=headers)
        await (await self.channel()).default_exchange.publish(message, self.name)

    async def count(self, name: str | None = None) -> int:
        """Messages ready in the queue (not those delivered and unacknowledged)."""
        queue = await (await self.channel()).declare_queue(name or self.name, passive=True)
        return int(queue.declaration_result.message_count or 0)

    async def get(self) -> AbstractIncomingMessage:
        queue = await (await self.channel()).get_queue(self.name, ensure=False)
        for _ in range(100):
            message = await queue.get(no_ack=True, fail=False)
            if message is not None:
                return message
            await asyncio.sleep(0.05)
        raise AssertionError("nothing arrived in the queue")


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld("postgresql", tmp_path) as opened:
        yield opened


@pytest.fixture
async def queues() -> AsyncIterator[Queues]:
    async with Queues() as opened:
        yield opened


def recorder(seen: list[Incoming]) -> Callable[[Incoming], Any]:
    async def record(message: Incoming) -> None:
        seen.append(message)

    return record


async def test_applies_each_message_once_in_per_key_order(
    world: InboxWorld, queues: Queues
) -> None:
    seen: list[Incoming] = []
    messages = [stored(queues.name, key=f"k{n % 3}", payload=b'{"n": %d}' % n)
                for n in range(12)]  # fmt: skip
    await queues.declare()
    async with queues.consumer(world.consumer(before_effect=recorder(seen))) as consumer:
        await queues.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 12)
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (12, 0)
    for key in ("k0", "k1", "k2"):
        assert [m.id for m in seen if m.key == key] == [str(m.id) for m in messages if m.key == key]
    first = seen[0]
    assert (first.topic, first.payload) == (queues.name, messages[0].payload)
    assert (first.content_type, first.sequence) == ("application/json", messages[0].seq)
    assert first.delivery_count == 1  # not redelivered
    assert await queues.count() == 0


async def test_decode_is_the_inverse_of_the_publisher(queues: Queues) -> None:
    message = stored(queues.name, headers={"x-app": "shop", "traceparent": "00-ab-cd-01"},
                     correlation_id="corr", tenant_id="t1", aggregate_id="order-1")  # fmt: skip
    await queues.declare()
    await queues.publish(message)
    got = decode(await queues.get())
    assert (got.id, got.payload, got.topic) == (str(message.id), message.payload, queues.name)
    assert got.headers == {"x-app": "shop", "traceparent": "00-ab-cd-01"}
    assert set(got.attributes) == {
        "specversion", "id", "source", "type", "time", "subject", "partitionkey",
        "correlationid", "tenantid", "aggregateid", "traceparent", "sequence",
        "partition", "attempts",
    }  # fmt: skip
    assert (got.correlation_id, got.tenant_id, got.key, got.type) == (
        "corr", "t1", "k", "order.created",
    )  # fmt: skip
    assert (got.partition, got.sequence, got.traceparent) == (3, message.seq, "00-ab-cd-01")
    assert got.time == message.occurred_at
    assert amqp.PREFIX == "cloudEvents:"


async def test_a_second_copy_is_a_duplicate_and_acknowledged(
    world: InboxWorld, queues: Queues
) -> None:
    message = stored(queues.name)
    await queues.declare()
    await queues.publish(message)
    await queues.publish(message)
    assert await queues.count() == 2
    async with queues.consumer(world.consumer()) as consumer:
        await wait_until(lambda: consumer.consumer.duplicates == 1)
    assert world.effects() == {str(message.id): 1}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (1, 1)
    assert await queues.count() == 0  # both copies acknowledged


@pytest.mark.parametrize(
    ("queue_type", "counts"),
    [("classic", [1, None]), ("quorum", [1, 2])],  # only quorum queues count deliveries
)
async def test_a_failed_handler_is_redelivered_and_applied_once(
    world: InboxWorld, queues: Queues, queue_type: str, counts: list[int | None]
) -> None:
    messages = [stored(queues.name, key=f"k{n}") for n in range(5)]
    failing = str(messages[2].id)
    deliveries: list[int | None] = []

    async def fail_once(message: Incoming) -> None:
        if message.id == failing:
            deliveries.append(message.delivery_count)
            if len(deliveries) == 1:
                raise RuntimeError("the handler fails the first time")

    arguments = {"x-queue-type": queue_type}
    await queues.declare(**arguments)
    handler = world.consumer(before_effect=fail_once)
    async with queues.consumer(handler, queue_arguments=arguments) as consumer:
        await queues.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 5)
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (5, 0)
    assert consumer.retried == 1
    assert deliveries == counts
    assert await queues.count() == 0


class DiesBeforeAcking(AmqpConsumer):
    """Commits, then hangs instead of acknowledging, until it is stopped: a crash."""

    committed: asyncio.Event

    async def settle(self, delivery: AbstractIncomingMessage, verdict: Verdict) -> None:
        assert verdict is Verdict.ACK
        self.committed.set()
        await asyncio.Event().wait()


async def test_a_crash_after_commit_is_redelivered_and_skipped(
    world: InboxWorld, queues: Queues
) -> None:
    message = stored(queues.name)
    await queues.declare()
    crashing = DiesBeforeAcking(SHARED_URL, world.consumer(), queue=queues.name)
    crashing.committed = asyncio.Event()
    async with crashing:
        await queues.publish(message)
        await asyncio.wait_for(crashing.committed.wait(), 20)
    assert world.effects() == {str(message.id): 1}
    assert await queues.count() == 1  # requeued when the connection closed

    seen: list[Incoming] = []
    async with queues.consumer(world.consumer(before_effect=recorder(seen))) as fresh:
        await wait_until(lambda: fresh.consumer.duplicates == 1)
    assert world.effects() == {str(message.id): 1}
    assert (crashing.consumer.applied, crashing.consumer.duplicates) == (1, 0)
    assert (fresh.consumer.applied, fresh.consumer.duplicates) == (0, 1)
    assert seen == []  # the handler did not run again
    assert await queues.count() == 0


class Arrivals(AmqpConsumer):
    """Counts deliveries as they arrive, before the inbox sees them."""

    arrived: list[AmqpConsumer]

    async def handle(self, decode: Callable[[], Incoming]) -> Verdict:
        self.arrived.append(self)
        return await super().handle(decode)


async def test_two_consumers_racing_on_one_message_apply_it_once(
    world: InboxWorld, queues: Queues
) -> None:
    arrived: list[AmqpConsumer] = []

    async def hold_the_first_copy(message: Incoming) -> None:
        # Keep this transaction open until the rival copy has arrived too, and then a
        # little longer, so the rival's inbox check waits on this uncommitted record.
        await wait_until(lambda: len(arrived) == 2, timeout=10)
        await asyncio.sleep(0.3)

    def racer() -> Arrivals:
        # prefetch=1: while one holds its copy unacknowledged, the other copy goes to
        # the other consumer of the queue.
        instance = Arrivals(SHARED_URL, world.consumer(before_effect=hold_the_first_copy),
                            queue=queues.name, prefetch=1)  # fmt: skip
        instance.arrived = arrived
        return instance

    message = stored(queues.name)
    await queues.declare()
    async with racer() as one, racer() as two:
        await queues.publish(message)
        await queues.publish(message)
        await wait_until(lambda: one.consumer.duplicates + two.consumer.duplicates == 1)
    assert world.effects() == {str(message.id): 1}
    assert sorted(arrived, key=id) == sorted([one, two], key=id)  # one copy each
    counts = sorted([(c.consumer.applied, c.consumer.duplicates) for c in (one, two)])
    assert counts == [(0, 1), (1, 0)]
    assert await queues.count() == 0


async def test_an_undecodable_message_is_dead_lettered_and_does_not_block(
    world: InboxWorld, queues: Queues
) -> None:
    messages = [stored(queues.name, key=f"k{n}") for n in range(3)]
    dead_letters = await queues.declare(f"{queues.name}.dead")
    arguments = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead_letters}
    await queues.declare(**arguments)
    async with queues.consumer(world.consumer(), queue_arguments=arguments) as consumer:
        await queues.publish_raw(b"no envelope", {"x-app": "shop"})
        await queues.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 3)
    assert consumer.rejected == 1
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert await queues.count() == 0
    for _ in range(100):  # rejected without requeue: dead-lettered
        if await queues.count(dead_letters) == 1:
            break
        await asyncio.sleep(0.05)
    assert await queues.count(dead_letters) == 1


async def test_binds_the_queue_to_the_publishers_exchange(
    world: InboxWorld, queues: Queues
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
    world: InboxWorld, queues: Queues
) -> None:
    before = [stored(queues.name, key="a") for _ in range(2)]
    after = [stored(queues.name, key="b") for _ in range(2)]
    name = f"rbtest-consumer-{queues.name}"
    await queues.declare()
    async with queues.consumer(world.consumer(), name=name, reconnect_wait=0.2) as consumer:
        await queues.publish(*before)
        await wait_until(lambda: consumer.consumer.applied == 2)
        await asyncio.to_thread(close_connection, name)
        await queues.publish(*after)
        await wait_until(lambda: consumer.consumer.applied == 4, timeout=30)
    assert world.effects() == {str(m.id): 1 for m in before + after}
    assert await queues.count() == 0


async def test_start_fails_clearly(world: InboxWorld, queues: Queues) -> None:
    nowhere = AmqpConsumer(f"amqp://guest:secret@127.0.0.1:{free_port()}/", world.consumer(),
                           queue=queues.name, timeout=2)  # fmt: skip
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
