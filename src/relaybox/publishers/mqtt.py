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
over 65535 bytes, or a packet over the broker's Maximum Packet Size (which a broker
answers by disconnecting, failing everything in flight with it).
A lost connection, a refused reconnect or a timeout is transient; the next publish()
reconnects (aiomqtt clients do not reconnect by themselves).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import uuid
from collections.abc import Callable, Iterable, Sequence
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
    transient,
    unavailable,
)
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError, ConfigurationError
from relaybox.publishers.options import BrokerUrl

#: Failure reason codes worth retrying; every other code of 0x80 or above is permanent.
TRANSIENT_REASONS = frozenset({0x80, 0x89, 0x91, 0x97})
#: What the MQTT 5 spec says a client may assume when CONNACK names no Receive Maximum.
_SPEC_RECEIVE_MAXIMUM = 65535
#: The protocol's own limit (a 4-byte remaining length), when CONNACK names none.
_SPEC_MAXIMUM_PACKET_SIZE = 268435460


def _accept_packet_too_large_in_acks() -> None:
    """mosquitto answers a payload over its `message_size_limit` with PUBACK/PUBREC 0x95,
    a code MQTT 5 allows only in CONNACK and DISCONNECT. paho checks codes against the
    spec's table, cannot decode that PUBACK, and drops the connection, failing every
    message in flight with it; so its table learns the code (idempotent, only widens)."""
    allowed: list[int] = ReasonCode.names[0x95]["Packet too large"]
    for packet_type in (PacketTypes.PUBACK, PacketTypes.PUBREC, PacketTypes.PUBCOMP):
        if packet_type not in allowed:
            allowed.append(packet_type)


_accept_packet_too_large_in_acks()


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


class _Connection(aiomqtt.Client):
    """One MQTT 5 connection whose publishes report the broker's reason code.

    aiomqtt's own `publish` waits for the PUBACK but drops its reason code, so a
    refusal would look like a confirm; here each confirm resolves a future by packet id.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # paho's own in-flight window would queue silently; the publisher bounds it.
        super().__init__(
            *args, protocol=aiomqtt.ProtocolVersion.V5, max_inflight_messages=0, **kwargs
        )
        self._acks: dict[int, asyncio.Future[ReasonCode]] = {}
        self.receive_maximum = _SPEC_RECEIVE_MAXIMUM
        self.maximum_packet_size = _SPEC_MAXIMUM_PACKET_SIZE
        self._client.connect_timeout = self.timeout
        #: QoS 2 packet ids whose PUBREC refused the message, with the reason code.
        self._refused: dict[int, int] = {}
        self._client._handle_pubrec = self._noting_refusals(self._client._handle_pubrec)  # type: ignore[method-assign]

    def _noting_refusals(
        self, handle_pubrec: Callable[[], MQTTErrorCode]
    ) -> Callable[[], MQTTErrorCode]:
        """paho ignores a PUBREC's reason code and completes the flow (PUBREL, PUBCOMP
        0x00) even when the broker refused the message; note the refusal first."""

        def noting() -> MQTTErrorCode:
            packet = self._client._in_packet["packet"]
            if len(packet) > 2 and packet[2] >= 0x80:
                self._refused[int.from_bytes(packet[:2], "big")] = packet[2]
            return handle_pubrec()

        return noting

    async def open(self) -> None:
        try:
            await self.__aenter__()
        except BaseException:
            # aiomqtt leaves the socket open when the CONNACK never came.
            self._client.disconnect()
            raise

    async def close(self) -> None:
        if self._disconnected.done() and not self._disconnected.cancelled():
            self._disconnected.exception()  # seen: asyncio would log it as never retrieved
        await self.__aexit__(None, None, None)

    @property
    def alive(self) -> bool:
        return not self._disconnected.done()

    async def publish_confirmed(
        self, topic: str, payload: bytes, qos: int, properties: PublishProperties, timeout: float
    ) -> ReasonCode:
        self._check_size(topic, payload, properties)
        info = self._client.publish(topic, payload, qos, False, properties)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, "could not publish")
        ack: asyncio.Future[ReasonCode] = self._loop.create_future()
        self._acks[info.mid] = ack
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wait((ack, self._disconnected), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._acks.pop(info.mid, None)
        if not ack.done():
            raise aiomqtt.MqttError("connection lost before the broker confirmed")
        return ack.result()

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

    def _on_connect(
        self,
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
        super()._on_connect(client, userdata, flags, reason_code, properties)

    def _on_publish(
        self,
        client: paho.Client,
        userdata: Any,
        mid: int,
        reason_code: ReasonCode,
        properties: Properties,
    ) -> None:
        refused = self._refused.pop(mid, None)
        if refused is not None:
            reason_code = ReasonCode(PacketTypes.PUBREC, identifier=refused)
        ack = self._acks.pop(mid, None)
        if ack is not None and not ack.done():
            ack.set_result(reason_code)


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
                reason = await connection.publish_confirmed(
                    topic, message.payload, self._qos, properties, self._timeout
                )
            except ValueError as error:  # wildcards, overlong topic or header, huge payload
                return permanent(f"MQTT cannot send this message on {topic!r}: {error}")
            except TimeoutError:
                return transient(_TIMED_OUT)
            except aiomqtt.MqttError as error:
                return unavailable(f"MQTT connection: {_describe(error)}")
        return _result(reason)

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
            with contextlib.suppress(aiomqtt.MqttError, TimeoutError, OSError):
                async with asyncio.timeout(self._timeout):
                    await connection.close()


_TIMED_OUT = "timed out waiting for the MQTT broker's confirm"


def _result(reason: ReasonCode) -> PublishResult:
    if reason.value < 0x80:  # 0x10 "no matching subscribers" is a confirm too
        return ACKED
    try:
        name = str(reason)
    except (KeyError, ValueError):  # paho names only the codes the spec allows per packet
        name = "reason code"
    error = f"MQTT broker refused the message: {name} (0x{reason.value:02X})"
    return transient(error) if reason.value in TRANSIENT_REASONS else permanent(error)


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__
