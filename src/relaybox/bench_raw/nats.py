"""nats-py alone: JetStream `publish_async` with a window of outstanding acks.

`prepare` makes a stream capturing the topic (named after it, '.' -> '_'), `cleanup`
deletes it; `publish_raw` keeps up to `WINDOW` publishes waiting for their ack and
raises if any is refused.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats
from nats.js import JetStreamContext

from relaybox.publishers.options import BrokerUrl

#: Publishes in flight at once, waiting for their JetStream ack.
WINDOW = 500


def stream_name(topic: str) -> str:
    """Stream names may not hold '.', '*', '>' or whitespace."""
    return re.sub(r"[.*>\s/\\]", "_", topic)


@asynccontextmanager
async def _jetstream(url: str) -> AsyncIterator[JetStreamContext]:
    client = await nats.connect(BrokerUrl(url).base, allow_reconnect=False)
    try:
        yield client.jetstream(publish_async_max_pending=WINDOW)
    finally:
        await client.close()


async def prepare(url: str, topic: str) -> None:
    async with _jetstream(url) as js:
        await js.add_stream(name=stream_name(topic), subjects=[topic])


async def publish_raw(url: str, topic: str, count: int, payload: bytes) -> None:
    async with _jetstream(url) as js:
        # publish_async waits for a free slot once WINDOW acks are outstanding.
        futures = [await js.publish_async(topic, payload) for _ in range(count)]
        for future in futures:
            await future  # raises the JetStream error of a refused message


async def cleanup(url: str, topic: str) -> None:
    async with _jetstream(url) as js:
        await js.delete_stream(stream_name(topic))
