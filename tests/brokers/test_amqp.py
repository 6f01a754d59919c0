"""The RabbitMQ publisher against the shared RabbitMQ and private throwaway nodes.

The shared service is amqp://guest:guest@127.0.0.1:5672/; every test uses its own
queues (named after `unique_topic()`) and deletes them. A throwaway is a second
RabbitMQ node, started from the installed `rabbitmq-server` with its own node name,
ports, HOME (so its Erlang cookie) and data directory; it registers with the shared
epmd but is otherwise independent, and is stopped by the PID of its Erlang VM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.exceptions import AMQPError

from relaybox.consumers.amqp import decode
from relaybox.core.publishing import Outcome, PublisherFeatures
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerError, BrokerUnavailableError, ConfigurationError
from relaybox.publishers import amqp, open_publisher
from relaybox.publishers.options import BrokerUrl
from relaybox.tools.bench_raw import amqp as bench_raw
from tests.brokers.conformance import PublisherConformance, first_copies, outcomes, started
from tests.brokers.harness import (
    Received,
    RestartableHarness,
    end_process,
    free_port,
    stored,
    unique_topic,
)

SHARED_URL = "amqp://guest:guest@127.0.0.1:5672/"
SERVER_SCRIPT = "/usr/lib/rabbitmq/bin/rabbitmq-server"
#: A node boots in ~10-20 s on an idle machine; give a loaded one room.
BOOT_SECONDS = 120.0


class RabbitNode:
    """A private RabbitMQ node in a temp directory, on free ports."""

    def __init__(self, config: str = "") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rbtest-amqp-"))
        self.port = free_port()
        self.dist_port = free_port()
        self.name = f"rbtest{uuid.uuid4().hex[:12]}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"
        self.process: subprocess.Popen[bytes] | None = None
        (self.dir / "home").mkdir()
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq-env.conf").write_text("")  # not /etc/rabbitmq's
        (self.dir / "rabbitmq.conf").write_text(config)

    def environment(self) -> dict[str, str]:
        d = self.dir
        return {
            **os.environ,
            "HOME": str(d / "home"),  # its own Erlang cookie, not the shared node's
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_LOGS": str(d / "log" / "node.log"),
            "RABBITMQ_PID_FILE": str(d / "node.pid"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": str(d / "plugins-expand"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            # The script then execs the Erlang VM instead of forking it: our child's PID
            # is beam.smp itself, and SIGTERM to it is a clean shutdown.
            "RUNNING_UNDER_SYSTEMD": "true",
        }

    async def start(self) -> None:
        with (self.dir / "console.log").open("ab") as console:
            self.process = subprocess.Popen(
                [SERVER_SCRIPT],
                env=self.environment(),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        await self._wait_until_ready()

    async def _wait_until_ready(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BOOT_SECONDS
        while loop.time() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise NodeExitedError(f"RabbitMQ node exited; its log ends:\n{self.log_tail()}")
            with contextlib.suppress(*_DOWN):
                connection = await aio_pika.connect(self.url, timeout=2)
                await connection.close()
                return
            await asyncio.sleep(0.25)
        raise AssertionError(f"RabbitMQ node not ready after {BOOT_SECONDS}s")

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        await asyncio.to_thread(end_process, process, 10.0)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the node's console and log, for a failure's message (the
        directory is removed once the node is)."""
        tails = []
        for path in (self.dir / "console.log", self.dir / "log" / "node.log"):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").splitlines()[-lines:]
                tails.append(f"{path.name}:\n" + "\n".join(text))
        return "\n".join(tails) or "(no log written)"


class NodeExitedError(AssertionError):
    """The node's Erlang VM exited before it took connections."""


_DOWN = (AMQPError, ConnectionError, OSError, TimeoutError)


@contextlib.asynccontextmanager
async def private_node(config: str = "") -> AsyncIterator[RabbitNode]:
    node = await booted(config)
    try:
        yield node
    finally:
        await node.stop()
        node.remove()


async def booted(config: str, attempts: int = 3) -> RabbitNode:
    """A started node. Its ports were free when chosen, but another test's process may
    take one before the node binds it, and the node then exits while booting: it is
    started again on other ports, `attempts` times at most."""
    for attempt in range(1, attempts + 1):
        node = RabbitNode(config)
        try:
            await node.start()
        except NodeExitedError:
            await node.stop()
            node.remove()
            if attempt == attempts:
                raise
        except BaseException:
            await node.stop()
            node.remove()
            raise
        else:
            return node
    raise AssertionError("unreachable")


class RabbitHarness(RestartableHarness):
    """Queues named after each topic, read with basic.get and kept in memory."""

    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(self, url: str = SHARED_URL, node: RabbitNode | None = None) -> None:
        self.url = url
        self._node = node
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._received: dict[str, list[Received]] = {}

    async def channel(self) -> AbstractChannel:
        if self._channel is None or self._channel.is_closed:
            await self._disconnect()
            self._connection = await aio_pika.connect(self.url, timeout=5)
            self._channel = await self._connection.channel()
        return self._channel

    async def _disconnect(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(*_DOWN):
                await connection.close()

    async def prepare(self, topic: str) -> None:
        channel = await self.channel()
        await channel.declare_queue(topic, durable=True)  # the default exchange routes to it
        self._received.setdefault(topic, [])

    async def received(self, topic: str) -> list[Received]:
        found = self._received.setdefault(topic, [])
        try:
            queue = await (await self.channel()).get_queue(topic, ensure=False)
            while (message := await queue.get(no_ack=True, fail=False)) is not None:
                found.append(Received.of(decode(message)))  # the publisher's inverse
        except _DOWN:
            await self._disconnect()  # the broker restarts; the caller polls again
        return list(found)

    def rejected(self, topic: str) -> StoredMessage:
        return stored(f"{topic}.unbound", key="poison")  # no queue of that name

    @contextlib.asynccontextmanager
    async def throwaway(self) -> AsyncIterator[RestartableHarness]:
        async with private_node() as node:
            harness = RabbitHarness(node.url, node)
            try:
                yield harness
            finally:
                await harness._disconnect()

    async def stop(self) -> None:
        assert self._node is not None, "never stop the shared RabbitMQ"
        await self._disconnect()
        await self._node.stop()

    async def start(self) -> None:
        assert self._node is not None, "never start the shared RabbitMQ"
        await self._node.start()

    async def close(self) -> None:
        with contextlib.suppress(*_DOWN):
            channel = await self.channel()
            for topic in self._received:
                await channel.queue_delete(topic)
        await self._disconnect()


class TestAmqpPublisher(PublisherConformance):
    def open_harness(self) -> contextlib.AbstractAsyncContextManager[RabbitHarness]:
        return RabbitHarness()


# Broker-specific behaviour.


@pytest.fixture
async def shared() -> AsyncIterator[RabbitHarness]:
    async with RabbitHarness() as harness:
        yield harness


def test_reads_its_url_options() -> None:
    url = BrokerUrl(f"{SHARED_URL}?exchange=orders&timeout=2.5&source=shop")
    publisher = amqp.from_url(url)
    url.done()
    outgoing, routing_key = publisher._encode(stored("orders.created"))
    assert (publisher._exchange, publisher._timeout) == ("orders", 2.5)
    assert (outgoing.headers[f"{amqp.PREFIX}source"], routing_key) == ("shop", "orders.created")
    assert publisher._url == SHARED_URL
    with pytest.raises(ConfigurationError, match="timeout"):
        open_publisher(f"{SHARED_URL}?timeout=0")


def test_puts_the_envelope_in_amqp_properties() -> None:
    message = stored("t", correlation_id="corr-1", headers={"app": "shop"})
    wire = amqp.amqp_message(message, "shop")
    assert wire.message_id == str(message.id)
    assert wire.correlation_id == "corr-1"
    assert wire.type == message.type
    assert wire.content_type == "application/json"
    assert wire.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert wire.headers["cloudEvents:source"] == "shop"
    assert wire.headers["app"] == "shop"


async def test_refuses_to_start_with_a_wrong_password() -> None:
    publisher = open_publisher("amqp://guest:wrong@127.0.0.1:5672/")
    with pytest.raises(BrokerUnavailableError, match="ACCESS_REFUSED") as refused:
        await publisher.start()
    assert "wrong" not in str(refused.value)


async def test_refuses_to_start_when_nothing_listens() -> None:
    publisher = open_publisher(f"amqp://guest:guest@127.0.0.1:{free_port()}/?timeout=2")
    with pytest.raises(BrokerUnavailableError, match="cannot connect"):
        await publisher.start()


async def test_a_connect_that_ends_in_stop_async_iteration_is_unavailable_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aiormq's frame reader ends with StopAsyncIteration when the server's EOF was in
    before it read the first frame (seen under load, through a proxy in front of a
    stopped broker that accepts and closes at once): the publisher reports the broker
    unavailable, so the relay retries, at start and on publish."""

    async def hangs_up(*args: object, **kwargs: object) -> AbstractConnection:
        raise StopAsyncIteration

    monkeypatch.setattr(amqp.aio_pika, "connect", hangs_up)
    publisher = open_publisher("amqp://guest:guest@127.0.0.1:5672/?timeout=2")
    with pytest.raises(BrokerUnavailableError, match="closed the connection"):
        await publisher.start()
    results = await publisher.publish([stored(unique_topic())])
    await publisher.close()
    assert [r.outcome for r in results] == [Outcome.TRANSIENT]
    assert "closed the connection" in (results[0].error or "")


async def test_refuses_to_start_with_a_missing_exchange() -> None:
    publisher = open_publisher(f"{SHARED_URL}?exchange={unique_topic()}")
    with pytest.raises(BrokerError, match="does not exist"):
        await publisher.start()


async def test_routes_through_the_url_exchange(shared: RabbitHarness) -> None:
    topic, exchange_name = unique_topic(), unique_topic()
    await shared.prepare(topic)
    channel = await shared.channel()
    exchange = await channel.declare_exchange(exchange_name, aio_pika.ExchangeType.DIRECT)
    try:
        queue = await channel.get_queue(topic)
        await queue.bind(exchange, routing_key=topic)
        async with started(shared.publisher(exchange=exchange_name)) as publisher:
            results = await publisher.publish([stored(topic), stored(f"{topic}.elsewhere")])
        assert outcomes(results) == [Outcome.ACKED, Outcome.PERMANENT]
        assert exchange_name in (results[1].error or "")
        assert len(await shared.wait_for(topic, 1)) == 1
    finally:
        await exchange.delete()


async def test_a_message_amqp_cannot_encode_fails_alone(shared: RabbitHarness) -> None:
    """A short-string property over 255 bytes or text that is not UTF-8 (a row `Message`
    did not write) used to raise out of publish(), failing every message of the call."""
    topic = unique_topic()
    await shared.prepare(topic)
    unsendable = [
        stored(topic, type="é" * 200), stored(topic, correlation_id="é" * 200),
        stored(topic, content_type="é" * 200), stored(topic, key="\ud800"),
    ]  # fmt: skip
    good = stored(topic)
    async with started(shared.publisher()) as publisher:
        results = await publisher.publish([*unsendable, good])
    assert outcomes(results) == [Outcome.PERMANENT] * 4 + [Outcome.ACKED]
    assert [r.id for r in await shared.wait_for(topic, 1)] == [str(good.id)]


async def test_a_message_over_max_message_size_fails_alone() -> None:
    """RabbitMQ closes the channel over it; the others in flight must not be blamed.

    A good message may come back transient if the broker also drops the connection
    (aiormq can write to the closed channel), never permanent; sent again, it is acked.
    """
    async with private_node("max_message_size = 65536\n") as node:
        node_harness = RabbitHarness(node.url, node)
        try:
            topic = unique_topic()
            await node_harness.prepare(topic)
            good = [stored(topic, key=f"g{n}") for n in range(20)]
            huge = stored(topic, key="huge", payload=b"x" * 100_000)
            async with started(node_harness.publisher()) as publisher:
                results = await publisher.publish([*good[:10], huge, *good[10:]])
                assert results[10].outcome is Outcome.PERMANENT
                assert "max size" in (results[10].error or "")
                goods = [*results[:10], *results[11:]]
                assert Outcome.PERMANENT not in outcomes(goods)
                again = [m for m, r in zip(good, goods, strict=True) if not r.acked]
                assert outcomes(await publisher.publish(again)) == [Outcome.ACKED] * len(again)
            received = first_copies(await node_harness.wait_for(topic, 20))
            assert {r.id for r in received} == {str(m.id) for m in good}
        finally:
            await node_harness._disconnect()


async def test_raw_benchmark_loop_publishes_every_message(shared: RabbitHarness) -> None:
    topic = unique_topic()
    await bench_raw.prepare(SHARED_URL, topic)
    try:
        await bench_raw.publish_raw(f"{SHARED_URL}?timeout=5", topic, 200, b"x" * 200)
        channel = await shared.channel()
        queue = await channel.declare_queue(topic, passive=True)
        assert queue.declaration_result.message_count == 200
    finally:
        await bench_raw.cleanup(SHARED_URL, topic)
    channel = await shared.channel()
    with pytest.raises(AMQPError):
        await channel.declare_queue(topic, passive=True)
