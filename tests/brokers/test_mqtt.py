"""The MQTT publisher against Mosquitto: the shared service, and private ones to restart.

The harness subscribes with QoS 1 and records each message in aiomqtt's incoming queue
hook, before paho sends its PUBACK, so nothing the broker handed over can be lost. On a
throwaway broker (persistence on) the subscriber keeps a persistent session and
reconnects after a restart, so what was queued for it while it was away still comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from relaybox.consumers.mqtt import decode
from relaybox.core.publishing import Outcome, PublisherFeatures
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError, ConfigurationError, EnvelopeError
from relaybox.publishers import mqtt, open_publisher
from relaybox.tools.bench_raw import mqtt as bench_raw
from tests.brokers.conformance import PublisherConformance, outcomes, started
from tests.brokers.harness import (
    Received,
    RestartableHarness,
    end_process,
    free_port,
    stored,
    unique_topic,
    wait_port,
)

SHARED_URL = "mqtt://127.0.0.1:1883"


def _received(message: aiomqtt.Message) -> Received:
    try:
        incoming = decode(message)  # the consumer's decoding: the publisher's inverse
    except EnvelopeError:  # bench_raw's bare payloads carry no envelope
        assert isinstance(message.payload, bytes)
        return Received(payload=message.payload, attributes={}, headers={})
    return Received.of(incoming)


class MqttHarness(RestartableHarness):
    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(self, url: str, *, persistent_session: bool = False) -> None:
        self.url = url
        self.persistent = persistent_session
        self._port = int(url.rsplit(":", 1)[1])
        self._persistent_session = persistent_session
        self._client_id = f"rbtest-sub-{uuid.uuid4().hex[:12]}"
        self._records: dict[str, list[Received]] = {}
        self._client: aiomqtt.Client | None = None
        self._online = asyncio.Event()
        self._subscriber: asyncio.Task[None] | None = None

    async def prepare(self, topic: str) -> None:
        self._records.setdefault(topic, [])
        if self._subscriber is None:
            self._subscriber = asyncio.create_task(self._subscribe_forever())
        await asyncio.wait_for(self._online.wait(), 30)
        assert self._client is not None
        await self._client.subscribe(topic, qos=1)

    async def received(self, topic: str) -> list[Received]:
        return list(self._records.get(topic, []))

    def rejected(self, topic: str) -> StoredMessage:
        return stored(f"{topic}/#", key="poison")

    async def close(self) -> None:
        if self._subscriber is not None:
            self._subscriber.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._subscriber
            self._subscriber = None

    async def _subscribe_forever(self) -> None:
        """Stay subscribed, reconnecting (to the same session) whenever the broker goes."""
        while True:
            client = self._new_client()
            try:
                async with client:
                    for topic in self._records:
                        await client.subscribe(topic, qos=1)
                    self._client = client
                    self._online.set()
                    async for _ in client.messages:  # the queue hook records them
                        pass
            except aiomqtt.MqttError:
                pass
            finally:
                self._online.clear()
                self._client = None
            await asyncio.sleep(0.1)

    def _new_client(self) -> aiomqtt.Client:
        properties = Properties(PacketTypes.CONNECT)
        # Session Expiry 0 ends the session with the connection: no state stays behind.
        properties.SessionExpiryInterval = 3600 if self._persistent_session else 0
        records = self._records

        class Recorder(asyncio.Queue[aiomqtt.Message]):
            def put_nowait(self, item: aiomqtt.Message) -> None:
                records.setdefault(str(item.topic), []).append(_received(item))

        return aiomqtt.Client(
            "127.0.0.1",
            self._port,
            identifier=self._client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            # Never a clean start, not even the first time (the id is new anyway):
            # mosquitto 2.0.11 drops a session begun with clean start when it restarts.
            clean_start=not self._persistent_session,
            properties=properties,
            queue_type=Recorder,
            timeout=5,
        )

    @contextlib.asynccontextmanager
    async def throwaway(self) -> AsyncIterator[RestartableHarness]:
        broker = PrivateMosquitto()
        try:
            await broker.start()
            harness = ThrowawayMqttHarness(broker)
            try:
                yield harness
            finally:
                await harness.close()
        finally:
            await broker.stop()
            shutil.rmtree(broker.directory, ignore_errors=True)

    async def stop(self) -> None:
        raise NotImplementedError("the shared broker is never stopped")

    async def start(self) -> None:
        raise NotImplementedError("the shared broker is never stopped")


class PrivateMosquitto:
    """A mosquitto child process on a free port, persisting to a temp directory."""

    def __init__(self) -> None:
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="rbtest-mosquitto-"))
        self.config = self.directory / "mosquitto.conf"
        self.config.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "persistence true\n"
            f"persistence_location {self.directory}/\n"
            # Run as root, mosquitto would switch to a user who cannot write here.
            f"user {getpass.getuser()}\n"
        )
        self._process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        log = (self.directory / "mosquitto.log").open("ab")
        self._process = subprocess.Popen(
            ["mosquitto", "-c", str(self.config)], stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        await wait_port(self.port)

    async def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        await asyncio.to_thread(end_process, process)  # mosquitto saves its database


class ThrowawayMqttHarness(MqttHarness):
    def __init__(self, broker: PrivateMosquitto) -> None:
        super().__init__(f"mqtt://127.0.0.1:{broker.port}", persistent_session=True)
        self._broker = broker

    async def stop(self) -> None:
        await self._broker.stop()

    async def start(self) -> None:
        await self._broker.start()


class TestMqttPublisher(PublisherConformance):
    def open_harness(self) -> contextlib.AbstractAsyncContextManager[MqttHarness]:
        return MqttHarness(SHARED_URL)


# Broker-specific behaviour.


async def test_start_fails_clearly_when_nothing_listens() -> None:
    publisher = open_publisher(f"mqtt://127.0.0.1:{free_port()}?timeout=2")
    with pytest.raises(BrokerUnavailableError, match="cannot connect to the MQTT broker"):
        await publisher.start()
    await publisher.close()


@pytest.mark.parametrize(
    ("options", "error"),
    [("qos=0", "qos=0 must be 1 or 2"), ("qos=x", "must be a number"), ("inflight=0", "at least")],
)
def test_rejects_bad_options(options: str, error: str) -> None:
    with pytest.raises(ConfigurationError, match=error):
        open_publisher(f"{SHARED_URL}?{options}")


def test_reads_its_options() -> None:
    publisher = open_publisher("mqtts://u:p@broker.example?qos=2&prefix=shop/&timeout=3&inflight=7")
    assert isinstance(publisher, mqtt.MqttPublisher)
    assert publisher._qos == 2
    assert publisher._prefix == "shop/"
    assert publisher._timeout == 3.0
    assert publisher._connect_args["port"] == 8883
    assert publisher._connect_args["tls_context"] is not None
    assert publisher._connect_args["username"] == "u"
    assert "p@" not in publisher._display


def test_percent_encoded_credentials_reach_the_broker_decoded() -> None:
    publisher = open_publisher("mqtt://app%40shop:p%2Fw%3Ad@broker.example")
    assert isinstance(publisher, mqtt.MqttPublisher)
    assert publisher._connect_args["username"] == "app@shop"
    assert publisher._connect_args["password"] == "p/w:d"


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (0x00, Outcome.ACKED),
        (0x10, Outcome.ACKED),  # no matching subscribers
        (0x97, Outcome.TRANSIENT),
        (0x80, Outcome.TRANSIENT),
        (0x83, Outcome.PERMANENT),
        (0x87, Outcome.PERMANENT),
        (0x90, Outcome.PERMANENT),
        (0x99, Outcome.PERMANENT),
        (0x95, Outcome.PERMANENT),  # mosquitto: over message_size_limit
    ],
)
def test_classifies_reason_codes(code: int, outcome: Outcome) -> None:
    assert mqtt._result(code).outcome is outcome


@pytest.mark.parametrize(
    "pairs",
    [
        [("id", "1"), ("tenantid", "café"), ("app", "")],
        [(f"header-{n}", "v" * 100) for n in range(200)],  # a three-byte length
    ],
)
def test_packs_properties_as_paho_does(pairs: list[tuple[str, str]]) -> None:
    expected = Properties(PacketTypes.PUBLISH)
    expected.ContentType = "application/json"
    expected.UserProperty = pairs
    assert mqtt.PublishProperties("application/json", pairs).pack() == expected.pack()


async def test_an_oversized_header_fails_alone_and_permanently() -> None:
    async with MqttHarness(SHARED_URL) as harness:
        topic = unique_topic()
        await harness.prepare(topic)
        batch = [stored(topic, headers={"big": "é" * 40000}), stored(topic)]
        async with started(harness.publisher()) as publisher:
            results = await publisher.publish(batch)
        assert outcomes(results) == [Outcome.PERMANENT, Outcome.ACKED]
        assert "65535" in (results[0].error or "")


async def test_prefix_qos2_and_client_side_refusals() -> None:
    async with MqttHarness(SHARED_URL) as harness:
        topic = unique_topic()
        await harness.prepare(f"shop/{topic}")
        good = stored(topic)
        batch = [good, stored(f"{topic}/+"), stored(f"{topic}/#")]
        async with started(harness.publisher(qos="2", prefix="shop/")) as publisher:
            results = await publisher.publish(batch)
        assert outcomes(results) == [Outcome.ACKED, Outcome.PERMANENT, Outcome.PERMANENT]
        async with started(harness.publisher()) as publisher:
            assert outcomes(await publisher.publish([stored("")])) == [Outcome.PERMANENT]
        (got,) = await harness.wait_for(f"shop/{topic}", 1)
        assert got.id == str(good.id)


@pytest.mark.parametrize("qos", ["1", "2"])
async def test_what_a_strict_broker_refuses_fails_alone_and_permanently(qos: str) -> None:
    """Denied by the ACL: PUBACK 0x87. Over `message_size_limit`: PUBACK 0x95. Over
    `max_packet_size`: never sent (the broker would drop the connection)."""
    broker = PrivateMosquitto()
    acl = broker.directory / "acl"
    acl.write_text("topic readwrite allowed/#\n")
    limits = f"acl_file {acl}\nmessage_size_limit 1000\nmax_packet_size 5000\n"
    broker.config.write_text(broker.config.read_text() + limits)
    batch = [
        stored("allowed/x"),
        stored("denied/x"),
        stored("allowed/x", payload=b"x" * 2000),
        stored("allowed/x", payload=b"x" * 6000),
        stored("allowed/x"),
    ]
    try:
        await broker.start()
        publisher = open_publisher(f"mqtt://127.0.0.1:{broker.port}?qos={qos}")
        async with started(publisher):
            results = await publisher.publish(batch)
            again = await publisher.publish([stored("allowed/x")])
        P = Outcome.PERMANENT
        assert outcomes(results) == [Outcome.ACKED, P, P, P, Outcome.ACKED]
        assert "0x87" in (results[1].error or "")
        assert "Packet too large (0x95)" in (results[2].error or "")
        assert "maximum packet size of 5000" in (results[3].error or "")
        assert outcomes(again) == [Outcome.ACKED]
        # Handled on the publisher's own client: paho's table still refuses 0x95 there.
        assert not mqtt.decodable(PacketTypes.PUBACK, 0x95)
    finally:
        await broker.stop()
        shutil.rmtree(broker.directory, ignore_errors=True)


async def test_the_aiomqtt_and_paho_internals_relaybox_uses() -> None:
    """`relaybox.publishers.mqtt.MqttLink` takes the paho client that aiomqtt drives from
    `aiomqtt.Client._client`, and sees each incoming packet before paho decodes it by
    wrapping that client's `_packet_handle`, reading and rewriting `_in_packet` there;
    the consumer sends a QoS 2 PUBREC with `_send_pubrec(mid)`. This fails if an aiomqtt
    or paho release renames any of them, changes what they take or hold, or no longer
    handles received packets through them: then the MQTT modules must follow, and the
    `mqtt` extra's pins move with them."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import MQTTErrorCode

    quiet, qos2 = unique_topic(), unique_topic()
    seen: list[tuple[int, bytes]] = []
    confirmed: list[int] = []
    async with aiomqtt.Client("127.0.0.1", 1883, protocol=aiomqtt.ProtocolVersion.V5) as client:
        inner = client._client
        assert isinstance(inner, paho.Client)
        assert inner.is_connected()
        handle = inner._packet_handle

        def watching() -> MQTTErrorCode:
            packet = inner._in_packet
            command, body = packet["command"], packet["packet"]
            seen.append((command, bytes(body)))
            if command >> 4 == PacketTypes.PUBACK:
                body[2] = 0x97  # what paho decodes is the rewritten packet
            if command >> 4 == PacketTypes.PUBLISH and command & 0x06 == 0x04:
                packet["command"] = (command & ~0x06) | 0x02  # QoS 2 handled as QoS 1
            handled = handle()
            if command >> 4 == PacketTypes.PUBREL:
                return inner.ack(int.from_bytes(body[:2], "big"), 2)  # the PUBCOMP
            return handled

        inner._packet_handle = watching  # type: ignore[method-assign]
        on_publish = inner.on_publish
        assert on_publish is not None

        def confirming(*arguments: Any) -> None:
            confirmed.append(arguments[3].value)  # (client, userdata, mid, reason_code, ...)
            on_publish(*arguments)

        inner.on_publish = confirming
        # Nobody subscribes: Mosquitto's PUBACK says 0x10 (no matching subscribers).
        await client.publish(quiet, b"x", qos=1)
        assert [command >> 4 for command, _ in seen] == [PacketTypes.PUBACK]
        assert seen[0][1][2] == 0x10
        assert confirmed == [0x97]

        inner.manual_ack_set(True)
        await client.subscribe(qos2, qos=2)
        async with aiomqtt.Client("127.0.0.1", 1883, protocol=aiomqtt.ProtocolVersion.V5) as other:
            # Completes only with the PUBCOMP, which needs the PUBREC sent below.
            sending = asyncio.create_task(other.publish(qos2, b"y", qos=2, timeout=30))
            message = await asyncio.wait_for(anext(client.messages), 30)
            assert (message.payload, message.qos) == (b"y", 1)  # not PUBRECed by paho
            assert inner._send_pubrec(message.mid) == MQTTErrorCode.MQTT_ERR_SUCCESS
            await asyncio.wait_for(sending, 30)
            # The broker's PUBREL answers the PUBREC; the sender's flow may end first.
            for _ in range(3000):
                if seen[-1][0] >> 4 == PacketTypes.PUBREL:
                    break
                await asyncio.sleep(0.01)
    mid = message.mid.to_bytes(2, "big")
    types = [(command >> 4, command & 0x06) for command, _ in seen[1:]]
    assert types == [(PacketTypes.SUBACK, 0), (PacketTypes.PUBLISH, 0x04),
                     (PacketTypes.PUBREL, 0x02)]  # fmt: skip
    assert seen[-1][1][:2] == mid


async def test_a_throwaway_broker_keeps_queued_messages_over_a_restart() -> None:
    """What `persistent = True` promises: acked while the subscriber was away, then a
    restart, and the subscriber's session still gets every message."""
    async with MqttHarness(SHARED_URL).throwaway() as broker:
        topic = unique_topic()
        await broker.prepare(topic)
        await broker.close()  # the subscriber leaves; its session stays
        batch = [stored(topic, key=f"k{n}") for n in range(10)]
        async with started(broker.publisher()) as publisher:
            assert outcomes(await publisher.publish(batch)) == [Outcome.ACKED] * 10
        await broker.stop()
        await broker.start()
        await broker.prepare(topic)
        received = await broker.wait_for(topic, 10)
    assert [r.id for r in received] == [str(m.id) for m in batch]


async def test_bench_raw_publishes_confirmed_messages() -> None:
    topic = unique_topic()
    async with MqttHarness(SHARED_URL) as harness:
        await harness.prepare(topic)
        await bench_raw.prepare(SHARED_URL, topic)
        try:
            await bench_raw.publish_raw(SHARED_URL + "?qos=1", topic, 200, b"x" * 200)
        finally:
            await bench_raw.cleanup(SHARED_URL, topic)
        received = await harness.wait_for(topic, 200)
    assert len(received) == 200
    assert {r.payload for r in received} == {b"x" * 200}


async def test_bench_raw_carries_the_envelope_as_user_properties() -> None:
    from relaybox.tools.bench_raw import broker_limit, sample_attributes

    topic = unique_topic()
    async with MqttHarness(SHARED_URL) as harness:
        await harness.prepare(topic)
        await bench_raw.publish_raw(SHARED_URL, topic, 20, b"{}", sample_attributes(topic, b"{}"))
        received = await harness.wait_for(topic, 20)
    assert {r.attributes["type"] for r in received} == {topic}
    limit = await broker_limit(SHARED_URL, 50, 10)
    assert limit is not None
    assert limit["bare_msg_per_s"] > 0
    assert limit["with_envelope_msg_per_s"] > 0
