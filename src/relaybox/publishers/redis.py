"""Redis Streams publisher (redis-py asyncio): one XADD per message, its entry id the confirm.

    redis://[:PASSWORD@]HOST:PORT/DB?prefix=outbox:&maxlen=100000&timeout=5
    rediss://...   (TLS)

Options:
    source       CloudEvents `source` attribute (default "relaybox").
    prefix       prepended to the topic to make the stream key (default "").
    maxlen       trim each stream to about this many entries (default: no trimming).
    approximate  true|false: trim with `~`, cheap, or exactly (default true).
    timeout      seconds for connecting and for a whole publish() call (default 5).

Redis has no CloudEvents binding; an entry's fields are
    data               the payload, as bytes
    datacontenttype    the content type
    <attribute>        each CloudEvents attribute under its own name (id, type, source, ...)
    h_<name>           each of the message's own headers, prefixed so that none can
                       shadow an attribute or `data`.

One pipeline per call (no MULTI) carries every XADD; each reply is checked on its own.
A key holding another type (WRONGTYPE), a refused permission or a bad argument fails
permanently; connection loss, timeouts, OOM, loading and read-only replicas are transient.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.typing import EncodableT, FieldT

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
from relaybox.core.urls import mask_password
from relaybox.errors import BrokerUnavailableError, ConfigurationError
from relaybox.publishers.options import BrokerUrl

DATA_FIELD = "data"
CONTENT_TYPE_FIELD = "datacontenttype"
HEADER_PREFIX = "h_"

#: Replies worth retrying: the server is out of memory, loading, a replica, or failing over.
_TRANSIENT_REPLIES = (
    redis_errors.OutOfMemoryError,
    redis_errors.ReadOnlyError,
    redis_errors.TryAgainError,
    redis_errors.ClusterDownError,
)

#: The server says who we are may not do this: no retry will change that.
_REFUSED = (
    redis_errors.NoPermissionError,
    redis_errors.AuthenticationError,
    redis_errors.AuthorizationError,
)


def from_url(url: BrokerUrl) -> RedisPublisher:
    return RedisPublisher(
        url.base,
        source=url.source,
        prefix=url.text("prefix", ""),
        maxlen=url.number("maxlen", 0, minimum=1) or None,
        approximate=url.flag("approximate", True),
        timeout=url.number("timeout", 5.0, minimum=0.1),
    )


def fields(message: StoredMessage, source: str) -> dict[FieldT, EncodableT]:
    entry: dict[FieldT, EncodableT] = {DATA_FIELD: message.payload}
    entry[CONTENT_TYPE_FIELD] = message.content_type
    entry.update(envelope.attributes(message, source))
    entry.update({HEADER_PREFIX + name: value for name, value in message.headers.items()})
    return entry


def classify(error: BaseException) -> PublishResult:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, _REFUSED):
        return permanent(text)
    if isinstance(error, redis_errors.ResponseError) and not isinstance(error, _TRANSIENT_REPLIES):
        return permanent(text)  # WRONGTYPE, a bad MAXLEN, an unknown command
    if isinstance(error, redis_errors.ConnectionError | ConnectionError):
        return unavailable(text)  # refused, reset, closed: the server is not there
    return transient(text)  # timeout, BUSY LOADING, OOM, READONLY


class RedisPublisher:
    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(
        self,
        url: str,
        *,
        source: str = envelope.DEFAULT_SOURCE,
        prefix: str = "",
        maxlen: int | None = None,
        approximate: bool = True,
        timeout: float = 5.0,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self._source = source
        self._maxlen = maxlen
        self._approximate = approximate
        self._timeout = timeout
        self._client: aioredis.Redis | None = None

    async def start(self) -> None:
        client = aioredis.Redis.from_url(
            self.url,
            socket_connect_timeout=self._timeout,
            socket_timeout=self._timeout,
            # A pooled connection the server dropped (restart) is noticed before use.
            health_check_interval=1,
        )
        try:
            async with asyncio.timeout(self._timeout):
                await client.ping()
        except (redis_errors.RedisError, OSError, TimeoutError) as error:
            await client.aclose()
            raise BrokerUnavailableError(
                f"cannot reach Redis at {mask_password(self.url)}: {error}"
            ) from error
        self._client = client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if self._client is None:
            raise ConfigurationError("RedisPublisher.publish called before start()")
        async with self._client.pipeline(transaction=False) as pipeline:
            for message in messages:
                pipeline.xadd(
                    self.prefix + message.topic, fields(message, self._source),
                    maxlen=self._maxlen, approximate=self._approximate,
                )  # fmt: skip
            try:
                async with asyncio.timeout(self._timeout):
                    replies = await pipeline.execute(raise_on_error=False)
            except TimeoutError:
                return [transient(f"no reply from Redis within {self._timeout}s")] * len(messages)
            except (redis_errors.RedisError, OSError) as error:
                return [classify(error)] * len(messages)
        return [classify(r) if isinstance(r, Exception) else ACKED for r in replies]
