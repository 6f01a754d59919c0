"""`NatsConsumer` against the shared NATS JetStream server, with the inbox on each database.

Each test makes a stream of its own (deleted afterwards, with its durables) and
publishes with relaybox's own NATS publisher, so `decode` is checked as the inverse of
what the publisher writes. The stream keeps duplicates for only 0.1 s, so a test can
put a second copy of a message id on it (`publish_copy`). A restart case runs on a
private `EmbeddedNats`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig

from relaybox.consumers import BrokerConsumer
from relaybox.consumers.nats import NatsConsumer, decode
from relaybox.core.incoming import Incoming
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError, ConfigurationError
from relaybox.inbox import Consumer
from relaybox.tools.bench_raw.nats import stream_name
from relaybox.tools.embedded_nats import EmbeddedNats
from tests.brokers.harness import free_port, stored, unique_topic
from tests.consumers.conformance import ConsumerConformance
from tests.consumers.harness import ConsumerHarness
from tests.inbox.support import DIALECTS, InboxWorld, wait_until
from tests.relay_support import eventually

SHARED_URL = "nats://127.0.0.1:4222"


class NatsHarness(ConsumerHarness):
    """A stream of its own on a NATS server: publish to it, inspect its durables."""

    redelivery_wait = 1.5  # past the rejecting consumer's ack_wait

    def __init__(self, url: str = SHARED_URL) -> None:
        self.url = url
        self.topic = unique_topic()
        self.name = stream_name(self.topic)
        self.client: Client | None = None

    @property
    def js(self) -> JetStreamContext:
        assert self.client is not None
        return self.client.jetstream()

    async def __aenter__(self) -> NatsHarness:
        self.client = await nats.connect(self.url, max_reconnect_attempts=-1,
                                         reconnect_time_wait=0.2)  # fmt: skip
        config = StreamConfig(
            name=self.name, subjects=[self.topic], duplicate_window=0.1,
            storage=StorageType.FILE,
        )  # fmt: skip
        await self.js.add_stream(config)
        return self

    async def close(self) -> None:
        assert self.client is not None
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_stream(self.name)
        await self.client.close()

    def consumer(self, consumer: Consumer, **options: Any) -> NatsConsumer:
        options.setdefault("durable", "billing")
        options.setdefault("retry_delay", 0.1)
        return NatsConsumer(self.url, consumer, stream=self.name, **options)

    def crashing(self, consumer: Consumer) -> BrokerConsumer:
        return self.consumer(consumer, ack_wait=1.0, prefetch=1)

    def successor(self, crashed: BrokerConsumer, consumer: Consumer) -> BrokerConsumer:
        return self.consumer(consumer, ack_wait=1.0)

    def racer(self, consumer: Consumer) -> BrokerConsumer:
        return self.consumer(consumer, prefetch=1)

    async def rejecting(self, consumer: Consumer) -> BrokerConsumer:
        return self.consumer(consumer, ack_wait=1.0)

    async def count(self) -> int:
        return int((await self.js.stream_info(self.name)).state.messages)

    held = count

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

    async def publish_undecodable(self) -> None:
        await self.js.publish(self.topic, b"no envelope", headers={"app": "shop"})

    async def publish_envelope(self, attributes: Mapping[str, str], payload: bytes) -> None:
        headers = {f"ce-{name}": value for name, value in attributes.items()}
        await self.js.publish(self.topic, payload, headers=headers)

    async def settled(self, durable: str = "billing") -> bool:
        """Nothing waits to be delivered or acknowledged on `durable`."""
        info = await self.js.consumer_info(self.name, durable)
        return (info.num_pending, info.num_ack_pending) == (0, 0)

    async def settling(self) -> None:
        await eventually(self.settled, timeout=20, interval=0.1)

    async def check_unsettled(self) -> None:
        assert not await self.settled()  # delivered, never acknowledged

    async def check_rejected(self) -> None:
        info = await self.js.consumer_info(self.name, "billing")
        assert info.num_redelivered == 0


@pytest.fixture(params=DIALECTS)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InboxWorld]:
    """Every case on each database: the inbox's guarantees rest on each one's locking."""
    async with InboxWorld(request.param, tmp_path) as opened:
        yield opened


@pytest.fixture
async def stream() -> AsyncIterator[NatsHarness]:
    async with NatsHarness() as opened:
        yield opened


class TestNatsConsumer(ConsumerConformance):
    def open_harness(self) -> NatsHarness:
        return NatsHarness()


async def test_decode_is_the_inverse_of_the_publisher(stream: NatsHarness) -> None:
    message = stored(stream.topic, headers={"app": "shop", "traceparent": "00-ab-cd-01"},
                     correlation_id="corr", tenant_id="t1")  # fmt: skip
    await stream.publish(message)
    got = decode(await stream.js.get_msg(stream.name, 1))
    assert got.id == str(message.id)
    assert got.headers == {"app": "shop", "traceparent": "00-ab-cd-01"}
    assert (got.correlation_id, got.tenant_id, got.key) == ("corr", "t1", "k")
    assert (got.partition, got.traceparent) == (3, "00-ab-cd-01")
    assert got.delivery_count is None  # read from the stream, not delivered


async def test_a_missing_stream_fails_start(world: InboxWorld) -> None:
    consumer = NatsConsumer(SHARED_URL, world.consumer(), stream="rbtest_no_such_stream")
    with pytest.raises(ConfigurationError, match="create it first"):
        await consumer.start()


async def test_keeps_consuming_across_a_server_restart(world: InboxWorld) -> None:
    async with EmbeddedNats() as server, NatsHarness(server.url) as stream:
        before = [stored(stream.topic, key="a") for _ in range(2)]
        after = [stored(stream.topic, key="b") for _ in range(2)]
        async with stream.consumer(world.consumer(), reconnect_wait=0.1) as consumer:
            await stream.publish(*before)
            await wait_until(lambda: consumer.consumer.applied == 2)
            await asyncio.to_thread(server.halt)
            await asyncio.to_thread(server.start)
            await stream.publish(*after)
            await wait_until(lambda: consumer.consumer.applied == 4, timeout=30)
            await stream.settling()
    assert world.effects() == {str(m.id): 1 for m in before + after}


async def test_start_fails_clearly_when_nothing_listens(world: InboxWorld) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    consumer = NatsConsumer(url, world.consumer(), stream="any", timeout=1.0)
    with pytest.raises(BrokerUnavailableError, match="cannot connect to NATS"):
        await consumer.start()


async def test_a_message_that_crashes_its_consumer_is_parked_in_the_end(
    world: InboxWorld, stream: NatsHarness
) -> None:
    """Each consumer dies inside the handler (stopped mid-transaction: nothing is
    counted after it). JetStream's delivery count marks each redelivery, which counts
    its attempt before the handler runs; past `max_attempts`, it is parked unrun."""
    message = stored(stream.topic)
    started: list[int | None] = []

    async def hang(received: Incoming) -> None:
        started.append(received.delivery_count)
        await asyncio.Event().wait()

    def crashing() -> NatsConsumer:
        return stream.consumer(world.consumer(before_effect=hang), ack_wait=1.0, max_attempts=2)

    await stream.publish(message)
    for crash in (1, 2, 3):
        async with crashing():
            await wait_until(lambda n=crash: len(started) == n)  # type: ignore[misc]
    async with crashing() as last:
        await wait_until(lambda: last.consumer.parked == 1)
        await stream.settling()  # parked, and acknowledged
    assert started == [1, 2, 3]
    ((message_id, reason, attempts, error, _, _),) = world.parked()
    assert (message_id, reason, attempts) == (str(message.id), "failed", 2)
    assert "without an outcome" in error
    assert world.effects() == {}
