"""aiokafka alone: acks=all sends in windows of `WINDOW` outstanding confirms.

`prepare` creates the topic (`PARTITIONS` partitions; an existing one is kept),
`cleanup` deletes it; `publish_raw` gives each message its own key, as the relay's
distinct keys do, and raises if the broker refuses any.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from relaybox.publishers.kafka import PREFIX, bootstrap_servers
from relaybox.publishers.options import BrokerUrl

#: Sends in flight at once, waiting for their acks=all confirm.
WINDOW = 1000
PARTITIONS = 3


@asynccontextmanager
async def _admin(url: str) -> AsyncIterator[AIOKafkaAdminClient]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers(BrokerUrl(url)))
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


async def prepare(url: str, topic: str) -> None:
    async with _admin(url) as admin:
        with suppress(TopicAlreadyExistsError):
            await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])


async def publish_raw(
    url: str, topic: str, count: int, payload: bytes, attributes: Mapping[str, str] | None = None
) -> None:
    headers = [(PREFIX + k, v.encode()) for k, v in (attributes or {}).items()]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers(BrokerUrl(url)), acks="all")
    await producer.start()
    try:
        for start in range(0, count, WINDOW):
            window = [
                await producer.send(topic, payload, key=b"k%d" % n, headers=headers)
                for n in range(start, min(start + WINDOW, count))
            ]
            await asyncio.gather(*window)  # raises the error of a refused message
    finally:
        await producer.stop()


async def cleanup(url: str, topic: str) -> None:
    async with _admin(url) as admin:
        await admin.delete_topics([topic])
