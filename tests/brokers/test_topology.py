"""`relaybox setup`: each broker's topology, from its target URL, against the real broker,
set up twice (the second time finds everything there) and removed afterwards."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import nats
import pytest
import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient
from click.testing import CliRunner

from relaybox.cli.main import main
from relaybox.core.publishing import Declared, Outcome, Presence
from relaybox.errors import BrokerError, BrokerUnavailableError, ConfigurationError
from relaybox.publishers import open_publisher, setup_topology
from tests.brokers.harness import free_port, stored
from tests.brokers.test_kafka import TansuProcess, _wait_port_sync
from tests.databases import sqlite_url

AMQP = "amqp://guest:guest@127.0.0.1:5672/"
NATS = "nats://127.0.0.1:4222"
REDIS = "redis://127.0.0.1:6379/0"

CREATED, EXISTED, ENSURED = Presence.CREATED, Presence.EXISTED, Presence.ENSURED


def unique(stem: str) -> str:
    return f"rbtest-{stem}-{uuid.uuid4().hex[:10]}"


def presences(declared: list[Declared]) -> list[tuple[str, Presence]]:
    return [(d.kind, d.presence) for d in declared]


async def _publish(url: str, topic: str) -> Outcome:
    publisher = open_publisher(url)
    await publisher.start()
    try:
        (result,) = await publisher.publish([stored(topic)])
    finally:
        await publisher.close()
    return result.outcome


@pytest.fixture
async def rabbit_names() -> AsyncIterator[tuple[str, str]]:
    exchange, queue = unique("exchange"), unique("queue")
    yield exchange, queue
    connection = await aio_pika.connect(AMQP)
    async with connection, connection.channel() as channel:
        await channel.queue_delete(queue)
        await channel.exchange_delete(exchange)


async def test_rabbitmq_exchange_queue_and_binding(rabbit_names: tuple[str, str]) -> None:
    exchange, queue = rabbit_names
    url = f"{AMQP}?exchange={exchange}&exchange_type=topic&queue={queue}&binding_key=orders.*"
    # Before: the exchange is missing, so the publisher cannot start.
    with pytest.raises(BrokerError, match="does not exist"):
        await _publish(url, "orders.created")
    first, second = await setup_topology(url), await setup_topology(url)
    kinds = ["exchange", "queue", "binding"]
    assert presences(first) == list(zip(kinds, [CREATED, CREATED, ENSURED], strict=True))
    assert presences(second) == list(zip(kinds, [EXISTED, EXISTED, ENSURED], strict=True))
    # The binding routes the topic to the queue; another topic is unroutable.
    assert await _publish(url, "orders.created") is Outcome.ACKED
    assert await _publish(url, "invoices.created") is Outcome.PERMANENT
    connection = await aio_pika.connect(AMQP)
    async with connection, connection.channel() as channel:
        declared = await channel.declare_queue(queue, passive=True)
        assert declared.declaration_result.message_count == 1


async def test_rabbitmq_queue_for_the_default_exchange(rabbit_names: tuple[str, str]) -> None:
    queue = rabbit_names[1]
    url = f"{AMQP}?queue={queue}"
    assert presences(await setup_topology(url)) == [("queue", CREATED)]
    assert presences(await setup_topology(url)) == [("queue", EXISTED)]
    assert await _publish(url, queue) is Outcome.ACKED  # routed by the queue's name


async def test_a_celery_target_declares_celerys_exchange_and_queue(
    rabbit_names: tuple[str, str],
) -> None:
    _, queue = rabbit_names
    url = f"celery+{AMQP}?queue={queue}&exchange={rabbit_names[0]}&declare=false"
    assert presences(await setup_topology(url)) == [
        ("exchange", CREATED), ("queue", CREATED), ("binding", ENSURED),
    ]  # fmt: skip
    assert [d.presence for d in await setup_topology(url)] == [EXISTED, EXISTED, ENSURED]
    assert await setup_topology(f"celery+{REDIS}?queue={queue}") == []


async def test_nats_jetstream_stream() -> None:
    stream, subject = unique("stream"), f"rbtest.{uuid.uuid4().hex[:10]}"
    url = f"{NATS}?stream={stream}&subjects={subject}.>,{subject}"
    try:
        assert presences(await setup_topology(url)) == [("stream", CREATED)]
        assert presences(await setup_topology(url)) == [("stream", EXISTED)]
        assert await _publish(url, f"{subject}.created") is Outcome.ACKED
        assert await _publish(url, subject) is Outcome.ACKED
    finally:
        client = await nats.connect(NATS)
        try:
            await client.jetstream().delete_stream(stream)
        finally:
            await client.close()


@pytest.fixture
def tansu() -> Iterator[TansuProcess]:
    directory = Path(tempfile.mkdtemp(prefix="rbtansu-"))
    broker = TansuProcess(directory)
    try:
        broker.spawn()
        _wait_port_sync(broker.port)
        yield broker
    finally:
        broker.kill()
        shutil.rmtree(directory, ignore_errors=True)


async def test_kafka_topics(tansu: TansuProcess) -> None:
    bootstrap = f"127.0.0.1:{tansu.port}"
    topics = [unique("topic"), unique("topic")]
    url = f"kafka://{bootstrap}?topics={','.join(topics)}&partitions=3&replication=1"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        assert presences(await setup_topology(url)) == [("topic", CREATED)] * 2
        assert presences(await setup_topology(url)) == [("topic", EXISTED)] * 2
        described = await admin.describe_topics(topics)
        assert sorted(len(topic["partitions"]) for topic in described) == [3, 3]
    finally:
        await admin.delete_topics(topics)
        await admin.close()


async def test_redis_consumer_groups() -> None:
    prefix, group = f"{unique('prefix')}:", unique("group")
    url = f"{REDIS}?prefix={prefix}&group={group}&streams=orders,invoices"
    client = aioredis.Redis.from_url(REDIS, decode_responses=True)
    try:
        assert presences(await setup_topology(url)) == [("consumer group", CREATED)] * 2
        assert presences(await setup_topology(url)) == [("consumer group", EXISTED)] * 2
        for topic in ("orders", "invoices"):
            (info,) = await client.xinfo_groups(prefix + topic)
            assert (info["name"], info["last-delivered-id"]) == (group, "0-0")
    finally:
        await client.delete(f"{prefix}orders", f"{prefix}invoices")
        await client.aclose()


def test_the_setup_command_and_the_relays_option(tmp_path: Path) -> None:
    prefix, group = f"{unique('prefix')}:", unique("group")
    target = f"events={REDIS}?prefix={prefix}&group={group}&streams=orders"
    runner = CliRunner()
    try:
        first = runner.invoke(main, ["setup", "--broker", target, "--broker", "log=noop://"])
        assert first.exit_code == 0, first.output
        assert f"events: consumer group {group} on {prefix}orders: created" in first.output
        assert "log: nothing to set up" in first.output
        database = sqlite_url(tmp_path / "outbox.db")
        assert runner.invoke(main, ["migrate", "--db", database]).exit_code == 0
        relay = runner.invoke(main, [
            "relay", "--db", database, "--broker", target, "--setup-topology",
            "--max-seconds", "0.2", "--log-level", "INFO",
        ])  # fmt: skip
        assert relay.exit_code == 0, relay.output
        assert f"setup events: consumer group {group} on {prefix}orders: existed" in relay.output
    finally:
        import redis

        redis.Redis.from_url(REDIS).delete(f"{prefix}orders")


@pytest.mark.parametrize(
    "url",
    [
        f"{AMQP}?exchange=x&exchange_type=bogus",
        f"{NATS}?stream=s",
        f"{NATS}?subjects=a",
        f"{REDIS}?group=g",
        f"{REDIS}?group=g&streams=a&group_start=5",
        "kafka://127.0.0.1:9092?topics=bad/topic",
    ],
)
def test_bad_topology_options_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        open_publisher(url)


async def test_a_refusal_is_reported() -> None:
    """RabbitMQ keeps `amq.` names for itself: it refuses to declare one."""
    with pytest.raises(BrokerError, match="refused"):
        await setup_topology(f"{AMQP}?exchange=amq.{unique('refused')}")


@pytest.mark.parametrize(
    "url",
    [
        "redis://:secret@127.0.0.1:{port}/0?group=g&streams=a",
        "amqp://guest:secret@127.0.0.1:{port}/?exchange=x",
        "nats://user:secret@127.0.0.1:{port}?stream=s&subjects=a&connect_timeout=1",
        "kafka://127.0.0.1:{port}?topics=a&timeout=1",
    ],
)
async def test_an_unreachable_broker_is_reported_without_its_secret(url: str) -> None:
    with pytest.raises(BrokerUnavailableError) as raised:
        await setup_topology(url.format(port=free_port()))
    assert "secret" not in str(raised.value)
