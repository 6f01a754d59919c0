"""Celery tasks on Redis: each pushed onto its queue's list as kombu's Redis transport
pushes it (`relaybox.publishers.celery` says why relaybox builds it)."""

from __future__ import annotations

import base64
import contextlib
import json
import uuid
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from relaybox.core.publishing import ACKED, Declared, PublisherFeatures, PublishResult, permanent
from relaybox.core.records import StoredMessage
from relaybox.errors import ConfigurationError, MessageError
from relaybox.publishers import redis as redis_publisher
from relaybox.publishers.celery import CONTENT_TYPE, ENCODING, task_message


class CeleryRedisPublisher:
    """Tasks pushed onto a Celery queue on Redis, as kombu's Redis transport does."""

    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(self, url: str, *, queue: str, timeout: float, origin: str) -> None:
        self._url = url
        self._queue = queue
        self._timeout = timeout
        self._origin = origin
        self._client: aioredis.Redis | None = None

    async def setup_topology(self) -> list[Declared]:
        """Nothing: a Celery queue on Redis is a list, made by the first push."""
        return []

    async def start(self) -> None:
        self._client = await redis_publisher.connect(self._url, self._timeout)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(redis_errors.RedisError, OSError):
                await client.aclose()

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if self._client is None:
            raise ConfigurationError("CeleryRedisPublisher.publish called before start()")
        refused: dict[int, PublishResult] = {}
        documents: list[bytes] = []
        for index, message in enumerate(messages):
            try:
                documents.append(self._document(message))
            except MessageError as error:
                refused[index] = permanent(str(error))
        replies = iter(await self._push(self._client, documents) if documents else [])
        return [refused.get(index) or next(replies) for index in range(len(messages))]

    def _document(self, message: StoredMessage) -> bytes:
        """kombu's Redis transport message: the task's body base64-encoded, its headers
        and properties beside it."""
        headers, body = task_message(message, self._origin)
        document = {
            "body": base64.b64encode(body).decode(),
            "content-encoding": ENCODING,
            "content-type": CONTENT_TYPE,
            "headers": headers,
            "properties": {
                "correlation_id": str(message.id),
                "reply_to": "",
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": self._queue},
                "priority": 0,
                "body_encoding": "base64",
                # kombu's handle of this one delivery (its unacked map's key), new per send.
                "delivery_tag": str(uuid.uuid4()),
            },
        }
        return json.dumps(document, separators=(",", ":")).encode()

    async def _push(self, client: aioredis.Redis, documents: list[bytes]) -> list[PublishResult]:
        try:
            async with client.pipeline(transaction=False) as pipe:
                for document in documents:
                    pipe.lpush(self._queue, document)
                replies = await pipe.execute(raise_on_error=False)
        except (redis_errors.RedisError, OSError) as error:  # timeouts are OSErrors too
            return [redis_publisher.classify(error)] * len(documents)
        return [
            redis_publisher.classify(reply) if isinstance(reply, Exception) else ACKED
            for reply in replies
        ]
