"""`MqttConsumer` against the shared Mosquitto, with a PostgreSQL inbox.

Each test uses topics and client ids of its own and publishes with relaybox's own MQTT
publisher, so `decode` is checked as the inverse of what the publisher writes. Sessions
outlive their connections (that is the point), so every test ends the sessions it made:
`leftovers` resumes a session one last time, collects whatever the broker still resends
(what was never acknowledged), and lets the session end with that connection. A restart
case runs on a private Mosquitto.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from relaybox.consumers import Verdict
from relaybox.consumers.mqtt import MqttConsumer, _Session, decode
from relaybox.core.incoming import Incoming
from relaybox.core.publishing import Outcome
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError, ConfigurationError
from relaybox.inbox import Consumer, Inbox
from relaybox.publishers import open_publisher
from tests.brokers.conformance import outcomes, started
from tests.brokers.harness import free_port, stored, unique_topic
from tests.brokers.test_mqtt import PrivateMosquitto
from tests.inbox.support import InboxWorld, wait_until

SHARED_URL = "mqtt://127.0.0.1:1883"


def client_id() -> str:
    return f"rbtest-{uuid.uuid4().hex[:12]}"


class Topic:
    """A topic of one test on a Mosquitto, and the sessions its consumers made."""

    def __init__(self, url: str = SHARED_URL) -> None:
        self.url = url
        self.name = unique_topic()
        self.sessions: set[str] = set()

    def consumer(self, consumer: Consumer, **options: Any) -> MqttConsumer:
        options.setdefault("client_id", client_id())
        options.setdefault("retry_delay", 0.1)
        options.setdefault("reconnect_wait", 0.2)
        options.setdefault("session_expiry", 300)
        self.sessions.add(options["client_id"])
        return MqttConsumer(self.url, consumer, topics=[self.name], **options)

    async def publish(self, *messages: StoredMessage, qos: int = 1) -> None:
        async with started(open_publisher(f"{self.url}?qos={qos}")) as publisher:
            results = await publisher.publish(messages)
        assert outcomes(results) == [Outcome.ACKED] * len(messages)

    async def publish_raw(self, payload: bytes) -> None:
        """A message that is no relaybox envelope: no user properties at all."""
        host, port = self.url.removeprefix("mqtt://").split(":")
        async with aiomqtt.Client(host, int(port), protocol=aiomqtt.ProtocolVersion.V5) as client:
            await client.publish(self.name, payload, qos=1)

    async def leftovers(self, identifier: str) -> list[aiomqtt.Message]:
        """Resume the session `identifier` with expiry 0 (it ends with this connection)
        and return what the broker resends in a second: the unacknowledged messages."""
        self.sessions.discard(identifier)
        host, port = self.url.removeprefix("mqtt://").split(":")
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = 0
        found: list[aiomqtt.Message] = []

        class Recorder(asyncio.Queue[aiomqtt.Message]):
            def put_nowait(self, item: aiomqtt.Message) -> None:
                found.append(item)

        probe = aiomqtt.Client(host, int(port), identifier=identifier, clean_start=False,
                               protocol=aiomqtt.ProtocolVersion.V5, properties=properties,
                               queue_type=Recorder)  # fmt: skip
        async with probe:
            await asyncio.sleep(1.0)
        return found

    async def close(self) -> None:
        for identifier in list(self.sessions):
            await self.leftovers(identifier)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld("postgresql", tmp_path) as opened:
        yield opened


@pytest.fixture
async def topic() -> AsyncIterator[Topic]:
    opened = Topic()
    try:
        yield opened
    finally:
        await opened.close()


def recorder(seen: list[Incoming]) -> Callable[[Incoming], Any]:
    async def record(message: Incoming) -> None:
        seen.append(message)

    return record


async def test_applies_each_message_once_in_per_key_order(world: InboxWorld, topic: Topic) -> None:
    seen: list[Incoming] = []
    messages = [stored(topic.name, key=f"k{n % 3}", payload=b'{"n": %d}' % n)
                for n in range(12)]  # fmt: skip
    async with topic.consumer(world.consumer(before_effect=recorder(seen))) as consumer:
        await topic.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 12)
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (12, 0)
    for key in ("k0", "k1", "k2"):
        assert [m.id for m in seen if m.key == key] == [str(m.id) for m in messages if m.key == key]
    first = seen[0]
    assert (first.topic, first.payload) == (topic.name, messages[0].payload)
    assert (first.content_type, first.sequence) == ("application/json", messages[0].seq)
    assert first.delivery_count is None  # MQTT does not count deliveries
    assert await topic.leftovers(consumer.client_id) == []


async def test_decode_is_the_inverse_of_the_publisher(world: InboxWorld, topic: Topic) -> None:
    message = stored(topic.name, headers={"x-app": "shop", "traceparent": "00-ab-cd-01"},
                     correlation_id="corr", tenant_id="t1", aggregate_id="order-1")  # fmt: skip
    seen: list[Incoming] = []
    async with topic.consumer(world.consumer(before_effect=recorder(seen))) as consumer:
        await topic.publish(message)
        await wait_until(lambda: consumer.consumer.applied == 1)
    (got,) = seen
    assert (got.id, got.payload, got.topic) == (str(message.id), message.payload, topic.name)
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


async def test_a_second_copy_is_a_duplicate_and_acknowledged(
    world: InboxWorld, topic: Topic
) -> None:
    message = stored(topic.name)
    async with topic.consumer(world.consumer()) as consumer:
        await topic.publish(message)
        await topic.publish(message)
        await wait_until(lambda: consumer.consumer.duplicates == 1)
    assert world.effects() == {str(message.id): 1}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (1, 1)
    assert await topic.leftovers(consumer.client_id) == []  # both copies acknowledged


async def test_a_failed_handler_is_retried_and_applied_once_in_order(
    world: InboxWorld, topic: Topic
) -> None:
    messages = [stored(topic.name, key="k") for _ in range(5)]
    failing = str(messages[2].id)
    seen: list[str] = []

    async def fail_once(message: Incoming) -> None:
        seen.append(message.id)
        if message.id == failing and seen.count(failing) == 1:
            raise RuntimeError("the handler fails the first time")

    async with topic.consumer(world.consumer(before_effect=fail_once)) as consumer:
        await topic.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 5)
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert (consumer.consumer.applied, consumer.consumer.duplicates) == (5, 0)
    assert consumer.retried == 1
    ids = [str(m.id) for m in messages]
    assert seen == [*ids[:3], *ids[2:]]  # retried in place: the key's order holds
    assert await topic.leftovers(consumer.client_id) == []


async def test_qos2_is_received_and_completed_after_the_commit(
    world: InboxWorld, topic: Topic, caplog: pytest.LogCaptureFixture
) -> None:
    """PUBREC after the commit, then PUBREL answered by PUBCOMP: the flow completes, so
    the broker has nothing to resend (not even a PUBREL) to the session afterwards."""
    caplog.set_level(logging.DEBUG, logger="mqtt")  # paho's packet log, through aiomqtt
    messages = [stored(topic.name, key=f"k{n}") for n in range(3)]
    async with topic.consumer(world.consumer(), qos=2) as consumer:
        await topic.publish(*messages, qos=2)
        await wait_until(lambda: consumer.consumer.applied == 3)
        await wait_until(lambda: caplog.text.count("Sending PUBCOMP") == 3)
    assert caplog.text.count("Sending PUBREC") == 3
    assert world.effects() == {str(m.id): 1 for m in messages}
    caplog.clear()
    assert await topic.leftovers(consumer.client_id) == []
    assert "Received PUBREL" not in caplog.text


class DiesBeforeAcking(MqttConsumer):
    """Commits, then hangs instead of acknowledging, until it is stopped: a crash."""

    committed: asyncio.Event

    async def settle(self, session: _Session, message: aiomqtt.Message, verdict: Verdict) -> None:
        assert verdict is Verdict.ACK
        self.committed.set()
        await asyncio.Event().wait()


@pytest.mark.parametrize("qos", [1, 2])
async def test_a_crash_after_commit_is_redelivered_and_skipped(
    world: InboxWorld, topic: Topic, qos: int
) -> None:
    message = stored(topic.name)
    identifier = client_id()
    topic.sessions.add(identifier)
    crashing = DiesBeforeAcking(topic.url, world.consumer(), topics=topic.name, qos=qos,
                                client_id=identifier, session_expiry=300)  # fmt: skip
    crashing.committed = asyncio.Event()
    async with crashing:
        await topic.publish(message, qos=qos)
        await asyncio.wait_for(crashing.committed.wait(), 20)
    assert world.effects() == {str(message.id): 1}

    seen: list[Incoming] = []
    fresh = topic.consumer(world.consumer(before_effect=recorder(seen)), client_id=identifier,
                           qos=qos)  # fmt: skip
    async with fresh:  # the same session: Mosquitto resends what was not acknowledged
        await wait_until(lambda: fresh.consumer.duplicates == 1)
    assert world.effects() == {str(message.id): 1}
    assert (crashing.consumer.applied, crashing.consumer.duplicates) == (1, 0)
    assert (fresh.consumer.applied, fresh.consumer.duplicates) == (0, 1)
    assert seen == []  # the handler did not run again
    assert await topic.leftovers(identifier) == []


class Arrivals(MqttConsumer):
    """Counts deliveries as they arrive, before the inbox sees them."""

    arrived: list[MqttConsumer]

    async def handle(self, decode: Callable[[], Incoming]) -> Verdict:
        self.arrived.append(self)
        return await super().handle(decode)


async def test_two_consumers_racing_on_one_message_apply_it_once(
    world: InboxWorld, topic: Topic
) -> None:
    arrived: list[MqttConsumer] = []

    async def hold_the_first_copy(message: Incoming) -> None:
        # Keep this transaction open until the rival copy has arrived too, and then a
        # little longer, so the rival's inbox check waits on this uncommitted record.
        await wait_until(lambda: len(arrived) == 2, timeout=10)
        await asyncio.sleep(0.3)

    def racer() -> Arrivals:
        identifier = client_id()
        topic.sessions.add(identifier)
        instance = Arrivals(topic.url, world.consumer(before_effect=hold_the_first_copy),
                            topics=topic.name, client_id=identifier)  # fmt: skip
        instance.arrived = arrived
        return instance

    message = stored(topic.name)
    async with racer() as one, racer() as two:  # two subscribers: each gets a copy
        await topic.publish(message)
        await wait_until(lambda: one.consumer.duplicates + two.consumer.duplicates == 1)
    assert world.effects() == {str(message.id): 1}
    assert sorted(arrived, key=id) == sorted([one, two], key=id)  # one copy each
    counts = sorted([(c.consumer.applied, c.consumer.duplicates) for c in (one, two)])
    assert counts == [(0, 1), (1, 0)]
    assert await topic.leftovers(one.client_id) == []
    assert await topic.leftovers(two.client_id) == []


async def test_an_undecodable_message_is_dropped_and_does_not_block(
    world: InboxWorld, topic: Topic
) -> None:
    messages = [stored(topic.name, key=f"k{n}") for n in range(3)]
    async with topic.consumer(world.consumer()) as consumer:
        await topic.publish_raw(b"no envelope")
        await topic.publish(*messages)
        await wait_until(lambda: consumer.consumer.applied == 3)
    assert consumer.rejected == 1
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert await topic.leftovers(consumer.client_id) == []  # acknowledged, never resent


async def test_keeps_its_session_across_a_broker_restart(world: InboxWorld) -> None:
    broker = PrivateMosquitto()
    try:
        await broker.start()
        topic = Topic(f"mqtt://127.0.0.1:{broker.port}")
        before = [stored(topic.name, key="a") for _ in range(2)]
        during = [stored(topic.name, key="b") for _ in range(2)]
        async with topic.consumer(world.consumer()) as consumer:
            await topic.publish(*before)
            await wait_until(lambda: consumer.consumer.applied == 2)
            await broker.stop()
            await broker.start()
            await topic.publish(*during)  # queued in the session, or delivered at once
            await wait_until(lambda: consumer.consumer.applied == 4, timeout=30)
        assert world.effects() == {str(m.id): 1 for m in before + during}
        await topic.close()
    finally:
        await broker.stop()
        shutil.rmtree(broker.directory, ignore_errors=True)


async def test_start_fails_clearly(world: InboxWorld) -> None:
    nowhere = MqttConsumer(f"mqtt://u:secret@127.0.0.1:{free_port()}", world.consumer(),
                           topics="t", client_id=client_id(), timeout=2)  # fmt: skip
    with pytest.raises(BrokerUnavailableError, match="cannot connect") as refused:
        await nowhere.start()
    assert "secret" not in str(refused.value)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"qos": 0}, "qos=0"),
        ({"client_id": ""}, "client_id"),
        ({"topics": []}, "topic filter"),
        ({"session_expiry": 0}, "session_expiry"),
    ],
)
def test_rejects_bad_options(options: dict[str, Any], error: str) -> None:
    idle = Consumer(lambda message, conn: None, inbox=Inbox(), transaction=contextlib.nullcontext)
    arguments: dict[str, Any] = {"topics": "t", "client_id": "c", **options}
    with pytest.raises(ConfigurationError, match=error):
        MqttConsumer(SHARED_URL, idle, **arguments)
    with pytest.raises(ConfigurationError, match="unknown mqtt:// options"):
        MqttConsumer(f"{SHARED_URL}?qos=1", idle, topics="t", client_id="c")


def test_decode_rejects_a_message_without_an_id() -> None:
    from relaybox.errors import EnvelopeError

    properties = Properties(PacketTypes.PUBLISH)
    properties.UserProperty = [("type", "t"), ("x-app", "shop")]
    message = aiomqtt.Message("orders", b"{}", 1, False, 1, properties)
    with pytest.raises(EnvelopeError, match="no CloudEvents id"):
        decode(message)
