"""Raw MQTT publishing with aiomqtt: QoS 1 (or `?qos=2`), each publish awaits its ack.

MQTT topics need no setup and a broker confirms a QoS 1 message whether or not anyone
subscribes, so `prepare` and `cleanup` have nothing to do. Windows of `WINDOW`
concurrent publishes keep the broker's Receive Maximum (paho's in-flight window) full.
With `attributes`, each message carries them as User Properties under their plain
names, as the relay's publisher sends them (the MQTT 5 binding).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from relaybox.publishers.options import BrokerUrl

#: Publishes awaited together; paho sends them as its in-flight window frees up.
WINDOW = 500


async def prepare(url: str, topic: str) -> None:
    return None


async def cleanup(url: str, topic: str) -> None:
    return None


async def publish_raw(
    url: str, topic: str, count: int, payload: bytes, attributes: Mapping[str, str] | None = None
) -> None:
    parsed = BrokerUrl(url)
    qos = parsed.number("qos", 1)
    properties = None
    if attributes is not None:
        properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        properties.UserProperty = list(attributes.items())
    client = aiomqtt.Client(
        parsed.host,
        parsed.port(1883),
        username=parsed.parts.username,
        password=parsed.parts.password,
        identifier=f"relaybox-bench-{uuid.uuid4().hex[:12]}",
        protocol=aiomqtt.ProtocolVersion.V5,
        timeout=30,
    )
    client.pending_calls_threshold = WINDOW  # its warning walks every pending call
    async with client:
        for start in range(0, count, WINDOW):
            size = min(WINDOW, count - start)
            await asyncio.gather(
                *(client.publish(topic, payload, qos, properties=properties) for _ in range(size))
            )
