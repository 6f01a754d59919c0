"""nats-py alone: JetStream `publish_async` with a window of outstanding acks.

`prepare` makes a stream capturing the topic (named after it, '.' -> '_'), `cleanup`
deletes it; `publish_raw` keeps up to `WINDOW` publishes waiting for their ack and
raises if any is refused.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import nats
from nats.js import JetStreamContext

from relaybox.publishers.nats import PREFIX
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


async def publish_raw(
    url: str, topic: str, count: int, payload: bytes, attributes: Mapping[str, str] | None = None
) -> None:
    async with _jetstream(url) as js:
        # publish_async waits for a free slot once WINDOW acks are outstanding.
        headers = None if attributes is None else {PREFIX + k: v for k, v in attributes.items()}
        futures = [
            await js.publish_async(topic, payload, headers=_with_id(headers, n))
            for n in range(count)
        ]
        for future in futures:
            await future  # raises the JetStream error of a refused message


def _with_id(headers: dict[str, str] | None, n: int) -> dict[str, str] | None:
    """The relay's publisher sends a unique Nats-Msg-Id too: the stream checks each."""
    return None if headers is None else {**headers, "Nats-Msg-Id": str(n)}


async def cleanup(url: str, topic: str) -> None:
    async with _jetstream(url) as js:
        await js.delete_stream(stream_name(topic))
