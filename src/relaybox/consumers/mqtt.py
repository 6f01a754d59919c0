"""MQTT 5 consumer (aiomqtt): a persistent session, acknowledged only after the commit.

    consumer = MqttConsumer("mqtt://127.0.0.1:1883", Consumer(handle, ...),
                            topics=["orders/#"], client_id="billing-1")
    async with consumer:
        ...

The client connects with a fixed `client_id`, never with Clean Start, and a Session
Expiry Interval of `session_expiry` seconds, so the broker keeps its subscriptions and its
unacknowledged messages while it is away: a persistent session. Each instance needs its
own client id (the broker disconnects the older of two connections with one id); to
share a topic's messages between instances, subscribe to a shared subscription,
`$share/<group>/<topic>`. Messages are received at QoS 1 (`qos=2` for exactly-once
flows); the broker delivers a message at the lower of its publisher's and the
subscription's QoS, and at most `prefetch` unacknowledged at a time (the connection's
Receive Maximum).

Acknowledgement after the commit: aiomqtt has no manual acknowledgement (paho sends the
PUBACK as soon as its `on_message` callback returns, i.e. when aiomqtt queues the
message). paho 2 has one, `manual_ack_set(True)` and `ack(mid, qos)`, and this module
switches it on in the paho client that aiomqtt drives. A QoS 1 message is then PUBACKed
only after `Consumer.process` returned.
For QoS 2, paho sends the PUBREC on arrival even with manual acks, and after a PUBREC
the broker never sends that PUBLISH again, so a crash before the commit would lose it;
here paho is handed a QoS 2 PUBLISH as a QoS 1 one (no PUBREC), the PUBREC is sent after
the commit, and the broker's PUBREL is answered with a PUBCOMP (paho's `ack(mid, 2)`) at
once. Acknowledgements go out in the order the messages came, as MQTT requires, because
messages are processed one by one.

Client internals, used where neither library has a public API for what this needs:
aiomqtt's `Client._client`, the paho client itself, which aiomqtt offers no other way
to (`relaybox.publishers.mqtt.MqttLink` takes it, and follows the connection through
paho's public callbacks); and, for QoS 2 only, paho's `Client._packet_handle`, wrapped on
this consumer's own clients to see each incoming packet first (`Client._in_packet` is
rewritten there: a QoS 2 PUBLISH's QoS bits read 1, so paho delivers it without
answering), and `Client._send_pubrec(mid)`, which sends the PUBREC after the commit
(paho's public `ack` sends only a PUBACK or a PUBCOMP). The `mqtt` extra pins the
releases this was checked against, and
`tests/brokers/test_mqtt.py::test_the_aiomqtt_and_paho_internals_relaybox_uses` fails
when these internals change.

Verdicts (MQTT has no negative acknowledgement):
    ACK     PUBACK (QoS 1) or PUBREC (QoS 2), after the commit.
    RETRY   the handler runs again, here, after a backoff (`retry_delay`, doubled per
            failure up to `max_retry_delay`), the message still unacknowledged, and the
            messages behind it wait: per-topic order is kept. A broker only resends an
            unacknowledged message when the session reconnects, so the alternative,
            dropping the connection, would cost a reconnect per failure and resend the
            whole in-flight window; retrying here costs nothing and loses nothing, since
            a crash or a lost connection during the retries still leaves the message
            unacknowledged in the session (the retries then stop and it is redelivered
            after the reconnect).
    REJECT  acknowledged like ACK (and logged): the only way to drop it for good.
The retries end when the message's `max_attempts` ran out: it is parked in the inbox's
database and acknowledged (`relaybox.inbox.consumer`). MQTT counts no deliveries, so the
attempts are counted in the database after each failure; an attempt that died with its
process is not counted.

Redelivery: on every reconnect of the session (this process restarted, the connection
dropped, the broker restarted with persistence) the broker sends again, with DUP set,
each message it sent and got no acknowledgement for, then whatever it queued meanwhile;
the inbox acknowledges a copy whose transaction had committed as a duplicate. A QoS 1
message is not resent within one connection, however long its acknowledgement takes.
`Incoming.delivery_count` is None: MQTT does not count deliveries. What a broker keeps
for a session is bounded by its configuration (Mosquitto: `max_queued_messages`, 1000
by default, beyond which it drops QoS 1 and 2 messages for that session, and
`persistence` to keep sessions over a restart): size it for the longest outage.

Reconnects: after a lost connection the consumer connects again after `reconnect_wait`
seconds (doubled per further failed attempt), resumes the session and subscribes again;
messages received on the lost connection and not yet processed are dropped here, the
broker resends them. Only the first connection must succeed: `start()` fails if the
broker cannot be reached.
"""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from relaybox.consumers.base import (
    DEFAULTS,
    Backoff,
    BrokerConsumer,
    Verdict,
    check_positive,
    redelivery_policy,
)
from relaybox.core import envelope
from relaybox.core.incoming import Incoming
from relaybox.errors import BrokerError, BrokerUnavailableError, ConfigurationError, EnvelopeError
from relaybox.inbox.processor import Processor
from relaybox.publishers.options import BrokerUrl

if TYPE_CHECKING:
    import aiomqtt
    import paho.mqtt.client as paho
    from paho.mqtt.enums import MQTTErrorCode

logger = logging.getLogger(__name__)

#: The CloudEvents attributes, which the MQTT 5 binding writes as User Properties under
#: their plain names (`relaybox.publishers.mqtt`); every other user property is one of
#: the message's own headers (no header may take these names: `relaybox.core.envelope`).
ATTRIBUTE_NAMES = envelope.MQTT_ATTRIBUTE_NAMES
#: Attributes that also came from the message's own headers (`envelope.headers`).
_ALSO_HEADERS = frozenset({"traceparent"})
#: The largest Session Expiry Interval; it means "never expires".
MAX_SESSION_EXPIRY = 0xFFFFFFFF
#: The largest Receive Maximum a client can ask for.
MAX_RECEIVE_MAXIMUM = 0xFFFF


def decode(message: aiomqtt.Message) -> Incoming:
    """The relaybox envelope of an MQTT 5 message: the inverse of
    `relaybox.publishers.mqtt` (attributes and headers as User Properties, the content
    type as the Content Type property). A user property may come more than once: an
    attribute that does, which relaybox's publisher never sends, is refused
    (`EnvelopeError`) rather than read either way."""
    properties = message.properties
    attributes: dict[str, str] = {}
    headers: dict[str, str] = {}
    for name, value in getattr(properties, "UserProperty", None) or ():
        if name in ATTRIBUTE_NAMES:
            if name in attributes:
                raise EnvelopeError(f"MQTT user property {name!r} comes twice in one message")
            attributes[name] = value
        if name not in ATTRIBUTE_NAMES or name in _ALSO_HEADERS:
            headers.setdefault(name, value)
    return Incoming.from_envelope(
        attributes,
        bytes(message.payload),  # paho's bytes (a bytearray for some transports)
        headers=headers,
        content_type=getattr(properties, "ContentType", None),
        topic=str(message.topic),
    )


class MqttConsumer(BrokerConsumer):
    """Runs `consumer` on the messages of MQTT topic filters, in a persistent session."""

    def __init__(
        self,
        url: str,
        consumer: Processor,
        *,
        topics: Sequence[str] | str,
        client_id: str,
        qos: int = 1,
        session_expiry: int = 7 * 24 * 3600,
        keepalive: int = 60,
        prefetch: int = DEFAULTS.prefetch,
        timeout: float = DEFAULTS.timeout,
        retry_delay: float = DEFAULTS.retry_delay,
        max_retry_delay: float = DEFAULTS.max_retry_delay,
        reconnect_wait: float = DEFAULTS.reconnect_wait,
        max_attempts: int = DEFAULTS.max_attempts,
    ) -> None:
        """
        url              the broker, `mqtt://[user:password@]host[:port]` (1883) or
                         `mqtts://` (TLS with the system CAs, 8883).
        topics           topic filters to subscribe to (wildcards and `$share/` allowed).
        client_id        this instance's fixed client id: the key of its session.
        qos              1 or 2, the subscriptions' maximum QoS.
        session_expiry   seconds the broker keeps the session after a disconnect.
        keepalive        seconds between PINGREQs when idle.
        prefetch         messages the broker sends unacknowledged at a time (the
                         Receive Maximum of the connection; 1 to 65535).
        timeout          seconds to connect and subscribe.
        retry_delay      seconds before a RETRY runs the handler again, doubled per
                         failure of that message...
        max_retry_delay  ... up to this.
        reconnect_wait   seconds before reconnecting after a lost connection, doubled
                         per further failed attempt.
        max_attempts     attempts at a message before it is parked (and acknowledged).
        """
        super().__init__(consumer, max_attempts=max_attempts)
        parsed = BrokerUrl(url)
        parsed.done()
        if parsed.scheme not in ("mqtt", "mqtts"):
            raise ConfigurationError(
                f"MqttConsumer needs an mqtt:// or mqtts:// URL, not {parsed.masked()!r}"
            )
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        if not self.topics or not all(self.topics):
            raise ConfigurationError("MqttConsumer needs at least one non-empty topic filter")
        if not client_id:
            raise ConfigurationError("MqttConsumer needs a fixed client_id for its session")
        if qos not in (1, 2):
            raise ConfigurationError(f"qos={qos!r}: use 1 or 2 (QoS 0 cannot be acknowledged)")
        if not 0 < session_expiry <= MAX_SESSION_EXPIRY:
            raise ConfigurationError(
                f"session_expiry={session_expiry!r}: 1 to {MAX_SESSION_EXPIRY} seconds "
                "(0 would end the session, and its unacknowledged messages, on disconnect)"
            )
        if not 0 < prefetch <= MAX_RECEIVE_MAXIMUM:
            raise ConfigurationError(f"prefetch={prefetch!r}: 1 to {MAX_RECEIVE_MAXIMUM}")
        check_positive(keepalive=keepalive, timeout=timeout)
        self.host = parsed.host
        self.port = parsed.port(8883 if parsed.scheme == "mqtts" else 1883)
        self.tls = parsed.scheme == "mqtts"
        self._username = parsed.username
        self._password = parsed.password
        self._masked = parsed.masked()
        self.client_id = client_id
        self.qos = qos
        self.session_expiry = session_expiry
        self.keepalive = keepalive
        self.prefetch = prefetch
        self.timeout = timeout
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        self._delays = redelivery_policy(retry_delay, max_retry_delay)
        self.reconnect_wait = reconnect_wait
        self._reconnects = Backoff.reconnects(reconnect_wait)

    # -- the loop ---------------------------------------------------------------------

    async def consume(self) -> None:
        import aiomqtt

        connected = False
        while True:
            session = self._session()
            try:
                await session.open()
                connected = True
                await self._subscribe(session.client)
                self._reconnects.succeeded()
                self.ready()
                await self._consume(session)
            except aiomqtt.MqttError as error:
                if not connected:
                    raise BrokerUnavailableError(
                        f"cannot connect to the MQTT broker {self._masked}: {error}"
                    ) from error
                logger.warning(
                    "MQTT consumer %s lost its connection to %s: %s; reconnecting",
                    self.client_id, self._masked, error,
                    extra={"action": "consumer_reconnect", "broker": "mqtt"},
                )  # fmt: skip
            finally:
                await session.close(self.timeout)
            await self._reconnects.wait()

    async def _consume(self, session: _Session) -> None:
        import aiomqtt

        messages = session.client.messages
        while True:
            message = await anext(messages)  # raises MqttError once disconnected
            if not session.alive:  # left over from the lost connection: resent later
                raise aiomqtt.MqttError("disconnected")
            verdict = await self._process(session, message)
            await self.settle(session, message, verdict)

    async def _process(self, session: _Session, message: aiomqtt.Message) -> Verdict:
        """Handle until ACK or REJECT; RETRY runs it again here, after a backoff."""
        import aiomqtt

        retries = Backoff(self._delays)
        while (verdict := await self.handle(functools.partial(decode, message))) is Verdict.RETRY:
            await retries.wait()
            if not session.alive:
                raise aiomqtt.MqttError("disconnected while retrying a message")
        return verdict

    async def settle(self, session: _Session, message: aiomqtt.Message, verdict: Verdict) -> None:
        """Acknowledge (ACK and REJECT alike); if that cannot be sent, the broker sends
        the message again when the session reconnects."""
        if not session.acknowledge(message):
            logger.warning(
                "could not %s MQTT message %s on %s: disconnected; the broker resends it",
                verdict.value, message.mid, message.topic,
                extra={"action": "settle_failed", "broker": "mqtt"},
            )  # fmt: skip

    # -- connecting and subscribing ---------------------------------------------------

    def _session(self) -> _Session:
        import aiomqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        properties.SessionExpiryInterval = self.session_expiry
        properties.ReceiveMaximum = self.prefetch
        client = aiomqtt.Client(
            self.host,
            self.port,
            username=self._username,
            password=self._password,
            identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            # Never a clean start, not even the first time: this process may be the one
            # restarted after a crash, and its session holds what it did not acknowledge.
            clean_start=False,
            properties=properties,
            keepalive=self.keepalive,
            timeout=self.timeout,
            tls_context=ssl.create_default_context() if self.tls else None,
        )
        return _Session(client)

    async def _subscribe(self, client: aiomqtt.Client) -> None:
        """Subscribe to every filter (again, after a reconnect: harmless in a resumed
        session); refused or downgraded to QoS 0 is an error no reconnect repairs."""
        from paho.mqtt.subscribeoptions import SubscribeOptions

        wanted = [(topic, SubscribeOptions(qos=self.qos)) for topic in self.topics]
        granted = await client.subscribe(wanted, timeout=self.timeout)
        for topic, code in zip(self.topics, granted, strict=True):
            value = code if isinstance(code, int) else int(getattr(code, "value", 0x80))
            if value >= 0x80 or value == 0:
                raise BrokerError(
                    f"the MQTT broker {self._masked} refused the subscription to {topic!r} "
                    f"at QoS {self.qos} (reason code 0x{value:02X})"
                )
            if value < self.qos:
                logger.warning(
                    "MQTT broker granted QoS %d, not %d, for %s", value, self.qos, topic,
                    extra={"action": "qos_downgraded", "broker": "mqtt"},
                )  # fmt: skip


class _Session:
    """One aiomqtt connection whose deliveries are acknowledged by `acknowledge` only."""

    def __init__(self, client: aiomqtt.Client) -> None:
        from paho.mqtt.packettypes import PacketTypes

        from relaybox.publishers.mqtt import MqttLink

        self.client = client
        self._link = MqttLink(client, on_packet=self._deferring_qos2)
        self._paho = self._link.paho
        self._paho.manual_ack_set(True)
        self._publish_type, self._pubrel_type = PacketTypes.PUBLISH, PacketTypes.PUBREL
        self._qos2_arriving = False
        self._paho.on_message = self._marking_qos2(self._paho.on_message)

    @property
    def alive(self) -> bool:
        return self._link.alive

    async def open(self) -> None:
        await self._link.open()

    async def close(self, timeout: float) -> None:
        """Disconnect (the session stays on the broker, for `session_expiry`)."""
        await self._link.close(timeout)

    def acknowledge(self, message: aiomqtt.Message) -> bool:
        """PUBACK a QoS 1 message, PUBREC a QoS 2 one; False if it could not be sent."""
        from paho.mqtt.enums import MQTTErrorCode

        if not self.alive:
            return False
        if message.qos == 1:
            sent = self._paho.ack(message.mid, 1)
        elif message.qos == 2:
            sent = self._paho._send_pubrec(message.mid)
        else:
            return True  # QoS 0: nothing to acknowledge
        return sent == MQTTErrorCode.MQTT_ERR_SUCCESS

    def _deferring_qos2(
        self, packet: MutableMapping[str, Any], handle: Callable[[], MQTTErrorCode]
    ) -> MQTTErrorCode:
        """paho answers a QoS 2 PUBLISH with PUBREC on arrival, manual acks or not, and
        delivers it only at PUBREL; as QoS 1 with manual acks it delivers at once and
        sends nothing. So a QoS 2 PUBLISH goes through paho's QoS 1 path, marked. With
        manual acks paho answers no PUBREL for a message it did not keep (ours): the
        flow is completed here, the message is committed and acknowledged by then."""
        from paho.mqtt.enums import MQTTErrorCode

        from relaybox.publishers.mqtt import packet_mid

        command: int = packet["command"]
        packet_type = command >> 4
        if packet_type == self._publish_type and command & 0x06 == 0x04:  # QoS bits: 2
            packet["command"] = (command & ~0x06) | 0x02
            self._qos2_arriving = True
            try:
                return handle()
            finally:
                self._qos2_arriving = False
        if packet_type == self._pubrel_type:
            mid = packet_mid(packet)
            handled = handle()
            if handled != MQTTErrorCode.MQTT_ERR_SUCCESS:
                return handled
            return self._paho.ack(mid, 2)  # the PUBCOMP
        return handle()

    def _marking_qos2(self, deliver: Any) -> Callable[[paho.Client, Any, paho.MQTTMessage], None]:
        def marking(client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
            if self._qos2_arriving:
                message.qos = 2
            deliver(client, userdata, message)

        return marking
