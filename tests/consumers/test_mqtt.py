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
import logging
import shutil
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from relaybox.consumers import BrokerConsumer
from relaybox.consumers.mqtt import MqttConsumer, decode
from relaybox.core.incoming import Incoming
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError, ConfigurationError
from relaybox.inbox import Consumer
from tests.brokers.harness import free_port, stored, unique_topic
from tests.brokers.test_mqtt import PrivateMosquitto
from tests.consumers.conformance import (
    ConsumerConformance,
    check_carries_the_envelope,
    failing_once,
    idle_consumer,
    recorder,
)
from tests.consumers.harness import ConsumerHarness
from tests.inbox.support import InboxWorld, wait_until

SHARED_URL = "mqtt://127.0.0.1:1883"


def client_id() -> str:
    return f"rbtest-{uuid.uuid4().hex[:12]}"


class MqttHarness(ConsumerHarness):
    """A topic of one test on a Mosquitto, and the sessions its consumers made."""

    first_delivery_count = None  # MQTT does not count deliveries
    holds_messages = False  # only subscriptions (and their sessions) get messages
    competing = False  # every subscriber gets every message

    def __init__(self, url: str = SHARED_URL) -> None:
        self.url = url
        self.topic = unique_topic()
        #: The QoS the consumers subscribe with and the publisher sends at.
        self.qos = 1
        self.sessions: set[str] = set()

    def consumer(self, consumer: Consumer, **options: Any) -> MqttConsumer:
        options.setdefault("client_id", client_id())
        options.setdefault("qos", self.qos)
        options.setdefault("retry_delay", 0.1)
        options.setdefault("reconnect_wait", 0.2)
        options.setdefault("session_expiry", 300)
        self.sessions.add(options["client_id"])
        return MqttConsumer(self.url, consumer, topics=[self.topic], **options)

    def successor(self, crashed: BrokerConsumer, consumer: Consumer) -> BrokerConsumer:
        # The same session: Mosquitto resends what was not acknowledged.
        assert isinstance(crashed, MqttConsumer)
        return self.consumer(consumer, client_id=crashed.client_id)

    async def publish(
        self, *messages: StoredMessage, url: str | None = None, qos: int | None = None
    ) -> None:
        qos = self.qos if qos is None else qos
        await super().publish(*messages, url=f"{url or self.url}?qos={qos}")

    async def publish_undecodable(self) -> None:
        """A message that is no relaybox envelope: no user properties at all."""
        host, port = self.url.removeprefix("mqtt://").split(":")
        async with aiomqtt.Client(host, int(port), protocol=aiomqtt.ProtocolVersion.V5) as client:
            await client.publish(self.topic, b"no envelope", qos=1)

    carries_nul = False

    async def publish_envelope(self, attributes: Mapping[str, str], payload: bytes) -> None:
        host, port = self.url.removeprefix("mqtt://").split(":")
        properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        properties.UserProperty = list(attributes.items())
        async with aiomqtt.Client(host, int(port), protocol=aiomqtt.ProtocolVersion.V5) as client:
            await client.publish(self.topic, payload, qos=1, properties=properties)

    async def check_settled(self, *consumers: BrokerConsumer) -> None:
        for consumer in consumers:
            assert isinstance(consumer, MqttConsumer)
            assert await self.leftovers(consumer.client_id) == []

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
async def topic() -> AsyncIterator[MqttHarness]:
    async with MqttHarness() as opened:
        yield opened


class TestMqttConsumer(ConsumerConformance):
    def open_harness(self) -> MqttHarness:
        return MqttHarness()

    async def test_a_failed_handler_is_retried_and_applied_once(
        self, world: InboxWorld, harness: ConsumerHarness
    ) -> None:
        """MQTT retries in place: one key's later messages wait for the failed one."""
        assert isinstance(harness, MqttHarness)
        messages = [stored(harness.topic, key="k") for _ in range(5)]
        failing = str(messages[2].id)
        seen: list[str] = []
        handler = world.consumer(before_effect=failing_once(failing, seen))
        async with harness.consumer(handler) as consumer:
            await harness.publish(*messages)
            await wait_until(lambda: consumer.consumer.applied == 5)
        assert world.effects() == {str(m.id): 1 for m in messages}
        assert (consumer.consumer.applied, consumer.consumer.duplicates) == (5, 0)
        assert consumer.retried == 1
        ids = [str(m.id) for m in messages]
        assert seen == [*ids[:3], *ids[2:]]  # retried in place: the key's order holds
        await harness.check_settled(consumer)

    @pytest.mark.parametrize("qos", [1, 2])
    async def test_a_crash_after_commit_is_redelivered_and_skipped(  # type: ignore[override]
        self, world: InboxWorld, harness: MqttHarness, qos: int
    ) -> None:
        harness.qos = qos
        await super().test_a_crash_after_commit_is_redelivered_and_skipped(world, harness)


async def test_decode_is_the_inverse_of_the_publisher(
    world: InboxWorld, topic: MqttHarness
) -> None:
    message = stored(topic.topic, headers={"app": "shop", "traceparent": "00-ab-cd-01"},
                     correlation_id="corr", tenant_id="t1", aggregate_id="order-1")  # fmt: skip
    seen: list[Incoming] = []
    async with topic.consumer(world.consumer(before_effect=recorder(seen))) as consumer:
        await topic.publish(message)
        await wait_until(lambda: consumer.consumer.applied == 1)
    (got,) = seen
    check_carries_the_envelope(got, message, topic.topic)


async def test_qos2_is_received_and_completed_after_the_commit(
    world: InboxWorld, topic: MqttHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """PUBREC after the commit, then PUBREL answered by PUBCOMP: the flow completes, so
    the broker has nothing to resend (not even a PUBREL) to the session afterwards."""
    caplog.set_level(logging.DEBUG, logger="mqtt")  # paho's packet log, through aiomqtt
    messages = [stored(topic.topic, key=f"k{n}") for n in range(3)]
    async with topic.consumer(world.consumer(), qos=2) as consumer:
        await topic.publish(*messages, qos=2)
        await wait_until(lambda: consumer.consumer.applied == 3)
        await wait_until(lambda: caplog.text.count("Sending PUBCOMP") == 3)
    assert caplog.text.count("Sending PUBREC") == 3
    assert world.effects() == {str(m.id): 1 for m in messages}
    caplog.clear()
    assert await topic.leftovers(consumer.client_id) == []
    assert "Received PUBREL" not in caplog.text


async def test_keeps_its_session_across_a_broker_restart(world: InboxWorld) -> None:
    broker = PrivateMosquitto()
    try:
        await broker.start()
        topic = MqttHarness(f"mqtt://127.0.0.1:{broker.port}")
        before = [stored(topic.topic, key="a") for _ in range(2)]
        during = [stored(topic.topic, key="b") for _ in range(2)]
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
        ({"prefetch": 0}, "prefetch=0"),
        ({"prefetch": 65536}, "prefetch=65536"),
        ({"reconnect_wait": 0}, "reconnect_wait"),
    ],
)
def test_rejects_bad_options(options: dict[str, Any], error: str) -> None:
    idle = idle_consumer()
    arguments: dict[str, Any] = {"topics": "t", "client_id": "c", **options}
    with pytest.raises(ConfigurationError, match=error):
        MqttConsumer(SHARED_URL, idle, **arguments)
    with pytest.raises(ConfigurationError, match="unknown mqtt:// options"):
        MqttConsumer(f"{SHARED_URL}?qos=1", idle, topics="t", client_id="c")


def test_decode_rejects_a_message_without_an_id() -> None:
    from relaybox.errors import EnvelopeError

    properties = Properties(PacketTypes.PUBLISH)
    properties.UserProperty = [("type", "t"), ("app", "shop")]
    message = aiomqtt.Message("orders", b"{}", 1, False, 1, properties)
    with pytest.raises(EnvelopeError, match="no CloudEvents id"):
        decode(message)
