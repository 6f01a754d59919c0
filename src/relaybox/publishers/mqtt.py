"""MQTT 5 publisher (aiomqtt): QoS 1 or 2, each message confirmed by its PUBACK/PUBCOMP.

    mqtt://[user:password@]host[:port][?options]      port 1883 by default
    mqtts://[user:password@]host[:port][?options]     TLS, system CAs, port 8883

Options:
    qos=1         1 (PUBACK) or 2 (PUBCOMP); QoS 0 has no confirm, so it is not offered.
    prefix=       prepended to every message's topic, e.g. `prefix=shop/` -> `shop/orders`.
    timeout=5     seconds to connect, and to wait for each message's confirm.
    inflight=100  messages awaiting their confirm at once; never more than the broker's
                  Receive Maximum (its CONNACK says how many; mosquitto: 20).
    source=       the CloudEvents `source` (default `relaybox`).

The envelope follows the CloudEvents MQTT 5 binding in binary mode: the attributes are
User Properties under their plain names (`id`, `type`, `source`, ...), the content type
is the Content Type property, the payload is the PUBLISH payload, and the message's own
headers follow as further User Properties. Messages are never retained.

A PUBACK (PUBCOMP for QoS 2) reason code of 0x80 or above fails the message: quota
exceeded (0x97), server busy (0x89), packet identifier in use (0x91) and unspecified
error (0x80) are transient; not authorized (0x87), topic name invalid (0x90), packet too
large (0x95, which mosquitto sends for a payload over its `message_size_limit`), payload
format invalid (0x99), implementation specific error (0x83) and any other are permanent.
With QoS 2 the PUBREC's code counts (paho would complete the flow regardless). So is
what the client will not send: an empty topic or one with a `+`/`#` wildcard, a header
over 65535 bytes, a header of the message's own under an attribute's name (a stored
row not written by `Message`: see `relaybox.core.envelope`), or a packet over the
broker's Maximum Packet Size (which a broker answers by disconnecting, failing
everything in flight with it).
A lost connection or a refused reconnect is transient; the next publish() reconnects
(aiomqtt clients do not reconnect by themselves). No confirm in time is transient
without an attempt counted: the broker may have taken the message.

Client internals: aiomqtt keeps the paho client it drives private (`Client._client`),
and what relaybox needs beyond a plain publish or subscribe is only on that paho
client: the reason code of each PUBACK and PUBCOMP and the broker's CONNACK limits
(paho's callbacks carry them, aiomqtt's `publish` drops them, so a refusal would look
like a confirm), when the connection ended, and, for the consumer, manual
acknowledgements. `MqttLink` takes the paho client from there, once, and uses paho's
public API on it, except where paho has none:

    `Client._packet_handle` (wrapped on relaybox's own clients, never on paho's class)
    and `Client._in_packet`: each incoming packet is seen before paho decodes it. paho
    ignores a PUBREC's reason code (it completes the QoS 2 flow as if the broker had
    accepted the message), and it cannot decode reason code 0x95 (packet too large),
    which mosquitto sends in a PUBACK or PUBREC for a payload over its
    `message_size_limit` although MQTT 5 allows 0x95 only in CONNACK and DISCONNECT:
    paho takes the packet for malformed and drops the connection, failing every
    message in flight with it. The hook notes every refusal's code, and where paho
    could not decode the code it hands paho a failure code it can, so that one refused
    message fails alone. The consumer uses the same hook, and `Client._send_pubrec`
    (`relaybox.consumers.mqtt` says why).

The `mqtt` extra pins aiomqtt and paho-mqtt to the releases these were checked against,
and `tests/brokers/test_mqtt.py::test_the_aiomqtt_and_paho_internals_relaybox_uses`
fails when any of them changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import uuid
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from relaybox.core import envelope
from relaybox.core.publishing import (
    ACKED,
    PublisherFeatures,
    PublishResult,
    permanent,
    timed_out,
    transient,
    unavailable,
)
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError, ConfigurationError, InvalidHeadersError
from relaybox.publishers.options import BrokerUrl

#: Failure reason codes worth retrying; every other code of 0x80 or above is permanent.
TRANSIENT_REASONS = frozenset({0x80, 0x89, 0x91, 0x97})
#: What the MQTT 5 spec says a client may assume when CONNACK names no Receive Maximum.
_SPEC_RECEIVE_MAXIMUM = 65535
#: The protocol's own limit (a 4-byte remaining length), when CONNACK names none.
_SPEC_MAXIMUM_PACKET_SIZE = 268435460
#: The acknowledgements of a publish, by packet type, and for each a failure code
#: paho can decode in it: what paho is handed instead of a code it cannot decode.
_ACK_STAND_INS = {PacketTypes.PUBACK: 0x80, PacketTypes.PUBREC: 0x80, PacketTypes.PUBCOMP: 0x92}

#: paho's incoming packet (`Client._in_packet`: "command", the fixed header's first
#: byte, and "packet", the rest after the remaining length), and paho's own handling of
#: it, which a hook calls (or not) and whose result it returns.
PacketHook = Callable[[MutableMapping[str, Any], Callable[[], MQTTErrorCode]], MQTTErrorCode]


def from_url(url: BrokerUrl) -> MqttPublisher:
    qos = url.number("qos", 1)
    if qos not in (1, 2):
        raise ConfigurationError(f"mqtt:// option qos={qos} must be 1 or 2")
    return MqttPublisher(
        url.host,
        url.port(8883 if url.scheme == "mqtts" else 1883),
        username=url.username,
        password=url.password,
        tls=url.scheme == "mqtts",
        qos=qos,
        prefix=url.text("prefix", ""),
        timeout=url.number("timeout", 5.0, minimum=0.1),
        inflight=url.number("inflight", 100, minimum=1),
        source=url.source,
        display=url.masked(),
    )


def packet_mid(packet: MutableMapping[str, Any]) -> int:
    """The packet identifier of a PUBLISH (QoS > 0) acknowledgement or PUBREL."""
    body: bytearray = packet["packet"]
    return int.from_bytes(body[:2], "big")


def decodable(packet_type: int, code: int) -> bool:
    """Whether paho can decode reason code `code` in a packet of `packet_type`."""
    try:
        ReasonCode(packet_type, identifier=code)
    except (KeyError, ValueError):
        return False
    return True


class MqttLink:
    """One aiomqtt client, and the paho client under it, used through paho's public API.

    `alive` follows paho's connect and disconnect callbacks: True from the CONNACK that
    accepted the connection until paho reports it ended, for whatever reason. Not
    paho's `is_connected()`: after a DISCONNECT packet from the broker paho closes the
    socket but leaves its state connected.
    `on_packet` sees each incoming packet first (see the module docstring).
    """

    def __init__(self, client: aiomqtt.Client, on_packet: PacketHook | None = None) -> None:
        self.client = client
        #: aiomqtt has no public way to this (the module docstring says why it is needed).
        self.paho: paho.Client = client._client
        self.alive = False
        self.receive_maximum = _SPEC_RECEIVE_MAXIMUM
        self.maximum_packet_size = _SPEC_MAXIMUM_PACKET_SIZE
        #: Called (without arguments) when paho reports the connection ended.
        self.on_lost: Callable[[], None] | None = None
        self._opened = False
        self.paho.on_connect = self._connecting(self.paho.on_connect)
        self.paho.on_disconnect = self._disconnecting(self.paho.on_disconnect)
        if on_packet is not None:
            self._watch(on_packet)

    def _watch(self, on_packet: PacketHook) -> None:
        handle = self.paho._packet_handle
        incoming = self.paho

        def watching() -> MQTTErrorCode:
            packet: MutableMapping[str, Any] = incoming._in_packet  # type: ignore[assignment]
            return on_packet(packet, handle)

        self.paho._packet_handle = watching  # type: ignore[method-assign]

    async def open(self) -> None:
        try:
            await self.client.__aenter__()
        except BaseException:
            self.paho.disconnect()  # aiomqtt leaves the socket open when no CONNACK came
            raise
        self._opened = True

    async def close(self, timeout: float) -> None:
        """Disconnect, or after a lost connection let go of it; never raises."""
        if not self._opened:
            return
        self._opened = False
        with contextlib.suppress(aiomqtt.MqttError, TimeoutError, OSError):
            async with asyncio.timeout(timeout):
                if not self.alive:
                    await self._spent()
                await self.client.__aexit__(None, None, None)

    async def _spent(self) -> None:
        """Read a lost connection's messages to the end: aiomqtt's iterator then raises
        the error that ended the connection, which marks it seen (asyncio would log it
        as never retrieved once the client is dropped). What was left is dropped
        unacknowledged: the broker sends it again."""
        messages = self.client.messages
        with contextlib.suppress(aiomqtt.MqttError):
            while True:
                await anext(messages)

    def _connecting(self, aiomqtt_on_connect: Any) -> Callable[..., None]:
        def connecting(
            client: paho.Client,
            userdata: Any,
            flags: paho.ConnectFlags,
            reason_code: ReasonCode,
            properties: Properties | None = None,
        ) -> None:
            receive_maximum = getattr(properties, "ReceiveMaximum", None)
            if isinstance(receive_maximum, int):
                self.receive_maximum = receive_maximum
            packet_size = getattr(properties, "MaximumPacketSize", None)
            if isinstance(packet_size, int):
                self.maximum_packet_size = packet_size
            self.alive = not reason_code.is_failure
            aiomqtt_on_connect(client, userdata, flags, reason_code, properties)

        return connecting

    def _disconnecting(self, aiomqtt_on_disconnect: Any) -> Callable[..., None]:
        def disconnecting(
            client: paho.Client,
            userdata: Any,
            flags: paho.DisconnectFlags,
            reason_code: ReasonCode,
            properties: Properties | None = None,
        ) -> None:
            self.alive = False
            if self.on_lost is not None:
                self.on_lost()
            aiomqtt_on_disconnect(client, userdata, flags, reason_code, properties)

        return disconnecting


class _Connection(MqttLink):
    """One MQTT 5 connection whose publishes report the broker's reason code: each
    confirm resolves a future by packet id, with the code (None: the connection ended)."""

    def __init__(self, **connect_args: Any) -> None:
        # paho's own in-flight window would queue silently; the publisher bounds it.
        client = aiomqtt.Client(
            protocol=aiomqtt.ProtocolVersion.V5, max_inflight_messages=0, **connect_args
        )
        super().__init__(client, on_packet=self._noting_refusals)
        self.paho.connect_timeout = client.timeout
        self._acks: dict[int, asyncio.Future[int | None]] = {}
        #: Packet ids whose PUBACK, PUBREC or PUBCOMP refused the message, with the code.
        self._refused: dict[int, int] = {}
        self.on_lost = self._fail_pending
        # Instead of aiomqtt's callback, which only serves its own `publish`, unused here.
        self.paho.on_publish = self._confirming

    def _noting_refusals(
        self, packet: MutableMapping[str, Any], handle: Callable[[], MQTTErrorCode]
    ) -> MQTTErrorCode:
        packet_type = packet["command"] >> 4
        body: bytearray = packet["packet"]
        stand_in = _ACK_STAND_INS.get(packet_type)
        if stand_in is not None and len(body) > 2 and body[2] >= 0x80:
            self._refused[packet_mid(packet)] = body[2]
            if not decodable(packet_type, body[2]):
                body[2] = stand_in
        return handle()

    def _confirming(
        self,
        client: paho.Client,
        userdata: Any,
        mid: int,
        reason_code: ReasonCode,
        properties: Properties,
    ) -> None:
        code = self._refused.pop(mid, reason_code.value)
        ack = self._acks.pop(mid, None)
        if ack is not None and not ack.done():
            ack.set_result(code)

    def _fail_pending(self) -> None:
        self._refused.clear()
        acks, self._acks = self._acks, {}
        for ack in acks.values():
            if not ack.done():
                ack.set_result(None)

    async def publish_confirmed(
        self, topic: str, payload: bytes, qos: int, properties: PublishProperties, timeout: float
    ) -> int:
        """Publish and return the reason code of the broker's confirm."""
        self._check_size(topic, payload, properties)
        info = self.paho.publish(topic, payload, qos, False, properties)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, "could not publish")
        self._refused.pop(info.mid, None)  # of an earlier message with this packet id
        ack: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._acks[info.mid] = ack
        try:
            async with asyncio.timeout(timeout):
                code = await ack
        finally:
            self._acks.pop(info.mid, None)
        if code is None:
            raise aiomqtt.MqttError("connection lost before the broker confirmed")
        return code

    def _check_size(self, topic: str, payload: bytes, properties: PublishProperties) -> None:
        """A packet over the broker's Maximum Packet Size would cost the connection
        (the broker must disconnect), failing every message in flight with it."""
        # fixed header (1 + up to 4), topic (2 + n), packet id (2), properties, payload
        size = 7 + len(topic.encode()) + 2 + len(properties.pack()) + len(payload)
        if size > self.maximum_packet_size:
            raise ValueError(
                f"a packet of {size} bytes exceeds the broker's maximum packet size"
                f" of {self.maximum_packet_size}"
            )


_BLANK_PUBLISH_PROPERTIES = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]


class PublishProperties(Properties):
    """PUBLISH properties that pack themselves: a content type, then user properties.

    paho's generic `Properties.pack` costs more than the rest of a publish together
    (~15 attribute lookups and string replacements per property); this packs the same
    bytes once, in the constructor, so a bad value fails before anything is sent.
    """

    def __init__(self, content_type: str, user_properties: Iterable[tuple[str, str]]) -> None:
        # Properties.__init__ rebuilds its name tables each time; share a blank one's.
        self.__dict__.update(_BLANK_PUBLISH_PROPERTIES.__dict__)
        parts = [b"\x03" + _utf8(content_type)]
        parts += [b"\x26" + _utf8(name) + _utf8(value) for name, value in user_properties]
        body = b"".join(parts)
        # paho's __setattr__ only admits property names
        object.__setattr__(self, "_packed", _variable_byte_integer(len(body)) + body)

    def pack(self) -> bytes:
        packed: bytes = self.__dict__["_packed"]
        return packed


def _utf8(text: str) -> bytes:
    data = text.encode()
    if len(data) > 0xFFFF:
        raise ValueError(f"an MQTT string is at most 65535 bytes, not {len(data)}")
    return len(data).to_bytes(2, "big") + data


def _variable_byte_integer(value: int) -> bytes:
    out = bytearray()
    while True:
        value, digit = divmod(value, 128)
        out.append(digit | 0x80 if value else digit)
        if not value:
            return bytes(out)


class MqttPublisher:
    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        qos: int = 1,
        prefix: str = "",
        timeout: float = 5.0,
        inflight: int = 100,
        source: str = envelope.DEFAULT_SOURCE,
        display: str | None = None,
    ) -> None:
        self._connect_args: dict[str, Any] = {
            "hostname": host, "port": port, "username": username, "password": password,
            "tls_context": ssl.create_default_context() if tls else None, "timeout": timeout,
        }  # fmt: skip
        self._qos = qos
        self._prefix = prefix
        self._timeout = timeout
        self._inflight = inflight
        self._source = source
        self._display = display or f"mqtt://{host}:{port}"
        self._connection: _Connection | None = None
        self._window = asyncio.Semaphore(inflight)
        self._reconnecting = asyncio.Lock()

    async def start(self) -> None:
        try:
            await self._connected()
        except (aiomqtt.MqttError, TimeoutError, OSError) as error:
            raise BrokerUnavailableError(
                f"cannot connect to the MQTT broker {self._display}: {_describe(error)}"
            ) from error

    async def close(self) -> None:
        async with self._reconnecting:
            await self._disconnect()

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        try:
            connection = await self._connected()
        except (aiomqtt.MqttError, TimeoutError, OSError) as error:
            return [unavailable(f"MQTT broker unreachable: {_describe(error)}")] * len(messages)
        results = await asyncio.gather(*(self._publish_one(connection, m) for m in messages))
        if not connection.alive or any(r.error == _TIMED_OUT for r in results):
            # A half-open connection only shows as timeouts: start afresh next call.
            async with self._reconnecting:
                if self._connection is connection:
                    await self._disconnect()
        return results

    async def _publish_one(self, connection: _Connection, message: StoredMessage) -> PublishResult:
        topic = self._prefix + message.topic
        if not topic:
            return permanent("an MQTT topic cannot be empty")
        async with self._window:
            try:
                properties = self._properties(message)
                code = await connection.publish_confirmed(
                    topic, message.payload, self._qos, properties, self._timeout
                )
            except ValueError as error:  # wildcards, overlong topic or header, huge payload
                return permanent(f"MQTT cannot send this message on {topic!r}: {error}")
            except InvalidHeadersError as error:  # a stored row's header poses as an attribute
                return permanent(str(error))
            except TimeoutError:
                return timed_out(_TIMED_OUT)
            except aiomqtt.MqttError as error:
                return unavailable(f"MQTT connection: {_describe(error)}")
        return _result(code)

    def _properties(self, message: StoredMessage) -> PublishProperties:
        pairs = envelope.headers(message, "", self._source).items()
        return PublishProperties(message.content_type, pairs)

    async def _connected(self) -> _Connection:
        connection = self._connection
        if connection is not None and connection.alive:
            return connection
        async with self._reconnecting:  # one reconnect for all concurrent callers
            if self._connection is not None and self._connection.alive:
                return self._connection
            await self._disconnect()
            self._connection = await self._connect()
            return self._connection

    async def _connect(self) -> _Connection:
        connection = _Connection(identifier=f"relaybox-{uuid.uuid4().hex}", **self._connect_args)
        await connection.open()
        self._window = asyncio.Semaphore(min(self._inflight, connection.receive_maximum))
        return connection

    async def _disconnect(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close(self._timeout)


_TIMED_OUT = "timed out waiting for the MQTT broker's confirm"


def _result(code: int) -> PublishResult:
    if code < 0x80:  # 0x10 "no matching subscribers" is a confirm too
        return ACKED
    error = f"MQTT broker refused the message: {_reason_name(code)} (0x{code:02X})"
    return transient(error) if code in TRANSIENT_REASONS else permanent(error)


def _reason_name(code: int) -> str:
    """MQTT 5's name for a reason code, whichever packets the spec allows it in
    (mosquitto's PUBACK 0x95 is "Packet too large", a CONNACK and DISCONNECT code)."""
    table: Mapping[int, Mapping[str, list[int]]] = ReasonCode(PacketTypes.PUBACK).names
    return next(iter(table.get(code) or {"reason code": []}))


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__
