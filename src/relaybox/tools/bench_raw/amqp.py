"""aio-pika alone: persistent, mandatory publishes on a confirm channel, a window in flight.

`prepare` declares a durable queue named after the topic (the default exchange routes
the topic to it), `cleanup` deletes it; `publish_raw` keeps up to `WINDOW` publishes
waiting for their confirm and raises if any is nacked or returned. Relaybox's URL
options (`?exchange=`, `?timeout=`...) are ignored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import aio_pika
from aio_pika.abc import AbstractChannel, FieldValue

from relaybox.publishers.amqp import PREFIX
from relaybox.publishers.options import BrokerUrl

#: Publishes in flight at once, waiting for their publisher confirm.
WINDOW = 500


@asynccontextmanager
async def _channel(url: str) -> AsyncIterator[AbstractChannel]:
    connection = await aio_pika.connect(BrokerUrl(url).base)
    try:
        yield await connection.channel(publisher_confirms=True, on_return_raises=True)
    finally:
        await connection.close()


async def prepare(url: str, topic: str) -> None:
    async with _channel(url) as channel:
        await channel.declare_queue(topic, durable=True)


async def publish_raw(
    url: str, topic: str, count: int, payload: bytes, attributes: Mapping[str, str] | None = None
) -> None:
    async with _channel(url) as channel:
        slots = asyncio.Semaphore(WINDOW)
        headers: dict[str, FieldValue] = {PREFIX + k: v for k, v in (attributes or {}).items()}

        async def one() -> None:
            async with slots:
                message = aio_pika.Message(
                    payload, headers=headers, delivery_mode=aio_pika.DeliveryMode.PERSISTENT
                )
                await channel.default_exchange.publish(message, topic, mandatory=True)

        await asyncio.gather(*(one() for _ in range(count)))


async def cleanup(url: str, topic: str) -> None:
    async with _channel(url) as channel:
        await channel.queue_delete(topic)
