"""`NatsConsumer` against the shared NATS JetStream server, with a PostgreSQL inbox.

Each test makes a stream of its own (deleted afterwards, with its durables) and
publishes with relaybox's own NATS publisher, so `decode` is checked as the inverse of
what the publisher writes. The stream keeps duplicates for only 0.1 s, so a test can
put a second copy of a message id on it (`publish_copy`). A restart case runs on a
private `EmbeddedNats`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig

from relaybox.bench_raw.nats import stream_name
from relaybox.consumers import Verdict
from relaybox.consumers.nats import NatsConsumer, decode
from relaybox.core.incoming import Incoming
from relaybox.core.publishing import Outcome
from relaybox.core.records import StoredMessage
from relaybox.embedded_nats import EmbeddedNats
from relaybox.errors import BrokerUnavailableError, ConfigurationError
from relaybox.inbox import Consumer
from relaybox.publishers import open_publisher
from tests.brokers.conformance import outcomes, started
from tests.brokers.harness import free_port, stored, unique_topic
from tests.inbox.support import DIALECTS, InboxWorld, wait_until

SHARED_URL = "nats://127.0.0.1:4222"


class Stream:
    """A stream of its own on a NATS server: publish to it, inspect its durables."""

    def __init__(self, url: str = SHARED_URL) -> None:
        self.url = url
        self.topic = unique_topic()
        self.name = stream_name(self.topic)
        self.client: Client | None = None

    @property
    def js(self) -> JetStreamContext:
        assert self.client is not None
        return self.client.jetstream()

    async def __aenter__(self) -> Stream:
        self.client = await nats.connect(self.url, max_reconnect_attempts=-1,
                                         reconnect_time_wait=0.2)  # fmt: skip
        config = StreamConfig(
            name=self.name, subjects=[self.topic], duplicate_window=0.1,
            storage=StorageType.FILE,
        )  # fmt: skip
        await self.js.add_stream(config)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self.client is not None
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_stream(self.name)
        await self.client.close()

    def consumer(self, consumer: Consumer, **options: Any) -> NatsConsumer:
        options.setdefault("durable", "billing")
        options.setdefault("retry_delay", 0.1)
        return NatsConsumer(self.url, consumer, stream=self.name, **options)

    async def publish(self, *messages: StoredMessage) -> None:
        async with started(open_publisher(self.url)) as publisher:
            results = await publisher.publish(messages)
        assert outcomes(results) == [Outcome.ACKED] * len(messages)

    async def count(self) -> int:
        return int((await self.js.stream_info(self.name)).state.messages)

    async def publish_copy(self, message: StoredMessage) -> None:
        """Publish `message` again until the stream holds a second copy (its duplicate
        window drops a copy published within 0.1 s of the first)."""
        before = await self.count()
        for _ in range(100):
            await asyncio.sleep(0.15)
            await self.publish(message)
            if await self.count() > before:
                return
        raise AssertionError("the stream kept dropping the copy as a duplicate")

    async def settled(self, durable: str = "billing") -> bool:
        """Nothing waits to be delivered or acknowledged on `durable`."""
        info = await self.js.consumer_info(self.name, durable)
        return (info.num_pending, info.num_ack_pending) == (0, 0)


@pytest.fixture(params=DIALECTS)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InboxWorld]:
    """Every case on each database: the inbox's guarantees rest on each one's locking."""
    async with InboxWorld(request.param, tmp_path) as opened:
        yield opened


@pytest.fixture
async def stream() -> AsyncIterator[Stream]:
    async with Stream() as opened:
        yield opened


async def eventually_settled(stream: Stream, durable: str = "billing") -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while not await stream.settled(durable):
        assert asyncio.get_running_loop().time() < deadline, "messages left unacknowledged"
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
        assert [m.id for m in seen if m.key == key] == [str(m.id) for m in messages if m.key == key]
    first = seen[0]
    assert first.topic == stream.topic
    assert first.payload == messages[0].payload
    assert first.content_type == "application/json"
    assert first.sequence == messages[0].seq
    assert first.delivery_count == 1


async def test_decode_is_the_inverse_of_the_publisher(stream: Stream) -> None:
    message = stored(stream.topic, headers={"x-app": "shop", "traceparent": "00-ab-cd-01"},
                     correlation_id="corr", tenant_id="t1")  # fmt: skip
    await stream.publish(message)
    got = decode(await stream.js.get_msg(stream.name, 1))
    assert got.id == str(message.id)
    assert got.headers == {"x-app": "shop", "traceparent": "00-ab-cd-01"}
    assert (got.correlation_id, got.tenant_id, got.key) == ("corr", "t1", "k")
    assert (got.partition, got.traceparent) == (3, "00-ab-cd-01")
    assert got.delivery_count is None  # read from the stream, not delivered


async def test_a_second_copy_is_a_duplicate_and_acknowledged(
    world: InboxWorld, stream: Stream
) -> None:
    message = stored(stream.topic)
    await stream.publish(message)
    await stream.publish_copy(message)
    assert await stream.count() == 2
    async with stream.consumer(world.consumer()) as consumer:
        await wait_until(lambda: consumer.consumer.duplicates == 1)
        await eventually_settled(stream)
    assert world.effects() == {str(message.id): 1}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (1, 1)


async def test_a_failed_handler_is_redelivered_and_applied_once(
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

    async with stream.consumer(world.consumer(before_effect=fail_once)) as consumer:
        await stream.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 5)
        await eventually_settled(stream)
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (5, 0)
    assert consumer.retried == 1
    assert deliveries == [1, 2]


class DiesBeforeAcking(NatsConsumer):
    """Commits, then hangs instead of acknowledging, until it is stopped: a crash."""

    committed: asyncio.Event

    async def settle(self, message: Msg, verdict: Verdict) -> None:
        assert verdict is Verdict.ACK
        self.committed.set()
        await asyncio.Event().wait()


async def test_a_crash_after_commit_is_redelivered_and_skipped(
    world: InboxWorld, stream: Stream
) -> None:
    message = stored(stream.topic)
    crashing = DiesBeforeAcking(stream.url, world.consumer(), stream=stream.name,
                                durable="billing", ack_wait=1.0, batch=1)  # fmt: skip
    crashing.committed = asyncio.Event()
    async with crashing:
        await stream.publish(message)
        await asyncio.wait_for(crashing.committed.wait(), 20)
    assert world.effects() == {str(message.id): 1}
    assert not await stream.settled()  # delivered, never acknowledged

    seen: list[Incoming] = []
    fresh = stream.consumer(world.consumer(before_effect=recorder(seen)), ack_wait=1.0)
    async with fresh:
        await wait_until(lambda: fresh.consumer.duplicates == 1)
        await eventually_settled(stream)
    assert world.effects() == {str(message.id): 1}
    assert (crashing.consumer.applied, crashing.consumer.duplicates) == (1, 0)
    assert (fresh.consumer.applied, fresh.consumer.duplicates) == (0, 1)
    assert seen == []  # the handler did not run again


class Arrivals(NatsConsumer):
    """Counts deliveries as they arrive, before the inbox sees them."""

    arrived: list[NatsConsumer]

    async def handle(self, decode: Callable[[], Incoming]) -> Verdict:
        self.arrived.append(self)
        return await super().handle(decode)


async def test_two_consumers_racing_on_one_message_apply_it_once(
    world: InboxWorld, stream: Stream
) -> None:
    arrived: list[NatsConsumer] = []

    async def hold_the_first_copy(message: Incoming) -> None:
        # Keep this transaction open until the rival copy has arrived too, and then a
        # little longer, so the rival's inbox check waits on this uncommitted record.
        await wait_until(lambda: len(arrived) == 2, timeout=10)
        await asyncio.sleep(0.3)

    def racer() -> Arrivals:
        instance = Arrivals(stream.url, world.consumer(before_effect=hold_the_first_copy),
                            stream=stream.name, durable="billing", batch=1)  # fmt: skip
        instance.arrived = arrived
        return instance

    message = stored(stream.topic)
    async with racer() as one, racer() as two:
        await stream.publish(message)
        await stream.publish_copy(message)
        await wait_until(lambda: one.consumer.duplicates + two.consumer.duplicates == 1)
        await eventually_settled(stream)
    assert world.effects() == {str(message.id): 1}
    assert sorted(arrived, key=id) == sorted([one, two], key=id)  # one copy each
    counts = sorted([(c.consumer.applied, c.consumer.duplicates) for c in (one, two)])
    assert counts == [(0, 1), (1, 0)]


async def test_an_undecodable_message_is_terminated_and_does_not_block(
    world: InboxWorld, stream: Stream
) -> None:
    messages = [stored(stream.topic, key=f"k{n}") for n in range(3)]
    async with stream.consumer(world.consumer(), ack_wait=1.0) as consumer:
        await stream.js.publish(stream.topic, b"no envelope", headers={"x-app": "shop"})
        await stream.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 3)
        await eventually_settled(stream)
        await asyncio.sleep(1.5)  # past ack_wait: a rejected message is not redelivered
    assert consumer.rejected == 1
    assert world.effects() == {str(m.id): 1 for m in messages}
    info = await stream.js.consumer_info(stream.name, "billing")
    assert info.num_redelivered == 0


async def test_a_missing_stream_fails_start(world: InboxWorld) -> None:
    consumer = NatsConsumer(SHARED_URL, world.consumer(), stream="rbtest_no_such_stream")
    with pytest.raises(ConfigurationError, match="create it first"):
        await consumer.start()


async def test_keeps_consuming_across_a_server_restart(world: InboxWorld) -> None:
    async with EmbeddedNats() as server, Stream(server.url) as stream:
        before = [stored(stream.topic, key="a") for _ in range(2)]
        after = [stored(stream.topic, key="b") for _ in range(2)]
        async with stream.consumer(world.consumer(), reconnect_wait=0.1) as consumer:
            await stream.publish(*before)
            await wait_until(lambda: consumer.consumer.applied == 2)
            await asyncio.to_thread(server.halt)
            await asyncio.to_thread(server.start)
            await stream.publish(*after)
            await wait_until(lambda: consumer.consumer.applied == 4, timeout=30)
            await eventually_settled(stream)
    assert world.effects() == {str(m.id): 1 for m in before + after}


async def test_start_fails_clearly_when_nothing_listens(world: InboxWorld) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    consumer = NatsConsumer(url, world.consumer(), stream="any", connect_timeout=1.0)
    with pytest.raises(BrokerUnavailableError, match="cannot connect to NATS"):
        await consumer.start()
