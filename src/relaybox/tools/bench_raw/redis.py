"""redis-py alone: XADD in pipelines (no MULTI) of `WINDOW` commands, every reply checked.

The stream key is the topic (after the URL's `prefix` option, as the publisher does);
XADD creates it, so `prepare` only makes sure it starts empty and `cleanup` deletes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from relaybox.publishers.options import BrokerUrl
from relaybox.publishers.redis import DATA_FIELD

#: XADDs sent in one pipeline before its replies are read.
WINDOW = 1000


def _stream_key(url: str, topic: str) -> str:
    return BrokerUrl(url).text("prefix", "") + topic


@asynccontextmanager
async def _client(url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(BrokerUrl(url).base)
    try:
        yield client
    finally:
        await client.aclose()


async def prepare(url: str, topic: str) -> None:
    async with _client(url) as client:
        await client.delete(_stream_key(url, topic))


async def publish_raw(
    url: str, topic: str, count: int, payload: bytes, attributes: Mapping[str, str] | None = None
) -> None:
    key = _stream_key(url, topic)
    fields: dict[FieldT, EncodableT] = {DATA_FIELD: payload}
    fields.update(attributes or {})
    async with _client(url) as client:
        for start in range(0, count, WINDOW):
            async with client.pipeline(transaction=False) as pipeline:
                for _ in range(start, min(start + WINDOW, count)):
                    pipeline.xadd(key, fields)
                await pipeline.execute()  # raises the first refused XADD's error


async def cleanup(url: str, topic: str) -> None:
    async with _client(url) as client:
        await client.delete(_stream_key(url, topic))
