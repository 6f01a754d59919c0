"""Redis Streams consumer (redis-py asyncio): a consumer group, acknowledged with XACK.

    consumer = RedisConsumer("redis://127.0.0.1:6379/0", Consumer(handle, inbox=..., ...),
                             stream="orders", group="billing")
    async with consumer:
        ...

The group is created on first use (`XGROUP CREATE ... MKSTREAM`), reading from the
stream's first entry (`start="0"`) or only from entries added afterwards (`start="$"`);
an existing group is used as it is. Several `RedisConsumer`s with one group and
different `name`s share its entries (competing consumers). Each reads up to `prefetch`
new entries at a time (`XREADGROUP ... COUNT ... BLOCK`, waiting `fetch_timeout` for
them) and processes them one by one, in stream order.

Verdicts, settled only after `Consumer.process` returned (after the commit):
    ACK     XACK: the entry leaves the group's pending entries list.
    RETRY   nothing: the entry stays pending, owned by this consumer, and is claimed
            again (`XAUTOCLAIM`, by this or another consumer of the group) once it has
            been idle for `claim_idle` seconds; that wait is the retry's backoff. The
            consumer goes on with newer entries meanwhile, so a retried entry is
            applied after later entries of its key.
    An entry whose `max_attempts` ran out is parked in the inbox's database and
            acknowledged like ACK (`relaybox.inbox.consumer`).
    REJECT  XACK, after copying the entry to the `dead_letter` stream if one is named
            (with `dl_stream`, `dl_id`, `dl_group` and `dl_reason` fields added, in one
            MULTI with the XACK), and logged. It is never delivered again.

Redelivery: every `claim_idle / 2` seconds the consumer claims the group's entries
that have been pending longer than `claim_idle`: its own retries, and the entries of a
consumer that died between commit and XACK (or a lost XACK). So `claim_idle` must be
longer than processing a whole read of `prefetch` entries takes, or a live consumer's
entry is claimed while it still waits its turn (the inbox then applies it once, but
both consumers process it). XAUTOCLAIM needs Redis 6.2 or later.
`Incoming.delivery_count` is 1 for a new entry and the pending list's delivery counter
for a claimed one.

Entry fields are the inverse of `relaybox.publishers.redis.fields`: `data` the payload,
`datacontenttype`, each CloudEvents attribute under its own name, `h_<name>` each header.

A lost connection makes the consumer wait `reconnect_wait` (doubled per further failed
attempt) and go on (redis-py reconnects on the next command); a group that disappeared
(`NOGROUP`: the key was deleted, or the server lost its data) is created again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from relaybox.consumers.base import (
    DEFAULTS,
    Backoff,
    BrokerConsumer,
    Verdict,
    check_positive,
    close_within,
)
from relaybox.core import envelope
from relaybox.core.ids import instance_name
from relaybox.core.incoming import Incoming
from relaybox.core.urls import mask_url
from relaybox.errors import BrokerUnavailableError, ConfigurationError, EnvelopeError
from relaybox.inbox.processor import Processor
from relaybox.publishers.redis import CONTENT_TYPE_FIELD, DATA_FIELD, HEADER_PREFIX

if TYPE_CHECKING:
    import redis.asyncio as aioredis

logger = logging.getLogger(__name__)

#: Fields a dead-lettered entry gets beside its own: where it came from, and why.
DEAD_LETTER_FIELDS = ("dl_stream", "dl_id", "dl_group", "dl_reason")

Fields = Mapping[bytes, bytes] | Mapping[str, str] | Mapping[bytes | str, bytes | str]


def decode(fields: Fields, *, stream: str = "", delivery_count: int | None = None) -> Incoming:
    """The relaybox envelope of a stream entry's fields (as XREADGROUP returns them)."""
    named = {_text(name, "a field name"): value for name, value in fields.items()}
    data = named.pop(DATA_FIELD, b"")
    payload = data.encode() if isinstance(data, str) else bytes(data)
    content_type = named.pop(CONTENT_TYPE_FIELD, None)
    texts = {name: _text(value, f"field {name}") for name, value in named.items()}
    # Here the headers carry the prefix and the attributes go by their plain names.
    headers, attributes = envelope.split(texts, HEADER_PREFIX)
    return Incoming.from_envelope(
        attributes,
        payload,
        headers=headers,
        content_type=None if content_type is None else _text(content_type, "the content type"),
        topic=stream,
        delivery_count=delivery_count,
    )


def _text(raw: bytes | str, what: str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise EnvelopeError(f"{what} of a stream entry is not UTF-8") from None


class RedisConsumer(BrokerConsumer):
    """Runs `consumer` on the entries of a Redis stream, as one member of a group."""

    def __init__(
        self,
        url: str,
        consumer: Processor,
        *,
        stream: str,
        group: str = "relaybox",
        name: str | None = None,
        start: str = "0",
        prefetch: int = DEFAULTS.prefetch,
        fetch_timeout: float = DEFAULTS.fetch_timeout,
        claim_idle: float = 30.0,
        dead_letter: str | None = None,
        timeout: float = DEFAULTS.timeout,
        reconnect_wait: float = DEFAULTS.reconnect_wait,
        max_attempts: int = DEFAULTS.max_attempts,
    ) -> None:
        """
        url             `redis://[:password@]host:port/db` or `rediss://`.
        stream          the stream's key (the publisher's prefix + topic).
        group           the consumer group, shared by competing consumers.
        name            this consumer's name in the group (default: host-pid-random).
                        A fixed name lets a restarted process see its own pending
                        entries in XINFO; any consumer claims them after `claim_idle`.
        start           where a new group starts: "0" the first entry, "$" the next
                        one added (or any entry id).
        prefetch        entries read per XREADGROUP (and claimed per XAUTOCLAIM).
        fetch_timeout   seconds an XREADGROUP waits for new entries (its BLOCK).
        claim_idle      seconds an entry stays pending (a retry, a dead consumer's)
                        before it is claimed and processed again.
        dead_letter     a stream that receives a copy of each rejected entry.
        timeout         seconds for connecting and for each command.
        reconnect_wait  seconds to wait after a lost connection before trying again,
                        doubled per further failed attempt.
        max_attempts    attempts at an entry before it is parked (and acknowledged).
        """
        super().__init__(consumer, max_attempts=max_attempts)
        if not stream or not group:
            raise ConfigurationError("RedisConsumer needs a stream and a group")
        check_positive(prefetch=prefetch, fetch_timeout=fetch_timeout, claim_idle=claim_idle,
                       timeout=timeout)  # fmt: skip
        self.url = url
        self.stream = stream
        self.group = group
        self.name = name or instance_name()
        self.start_id = start
        self.prefetch = prefetch
        self.claim_idle = claim_idle
        #: Claims run this often; a read never blocks past the next one.
        self.claim_every = claim_idle / 2
        self.fetch_timeout = min(fetch_timeout, self.claim_every)
        self.dead_letter = dead_letter
        self.timeout = timeout
        self.reconnect_wait = reconnect_wait
        self._reconnects = Backoff.reconnects(reconnect_wait)
        self._masked = mask_url(url)

    # -- the loop ---------------------------------------------------------------------

    async def consume(self) -> None:
        from redis import exceptions as redis_errors

        client = self._client()
        try:
            await self._join(client)
            self.ready()
            lost_group = False
            while True:
                try:
                    if lost_group:
                        await self._create_group(client)
                    await self._consume(client)
                except (redis_errors.RedisError, OSError) as error:
                    logger.warning(
                        "Redis consumer %s of %s on %s interrupted: %r; trying again",
                        self.name, self.group, self.stream, error,
                        extra={"action": "consumer_reconnect", "broker": "redis"},
                    )  # fmt: skip
                    lost_group = lost_group or "NOGROUP" in str(error)
                    await self._reconnects.wait()
                else:
                    lost_group = False
        finally:
            await close_within(client.aclose(), 5.0)  # (a CI run once hung here)

    async def _consume(self, client: aioredis.Redis) -> None:
        next_claim = 0.0
        while True:
            if time.monotonic() >= next_claim:
                await self._claim(client)
                next_claim = time.monotonic() + self.claim_every
            reply: Any = await client.xreadgroup(
                self.group, self.name, {self.stream: ">"},
                count=self.prefetch, block=max(1, int(self.fetch_timeout * 1000)),
            )  # fmt: skip
            self._reconnects.succeeded()
            # RESP2 answers [[stream, entries]], RESP3 {stream: entries}; one stream here.
            for entries in (
                reply.values() if isinstance(reply, dict) else [e for _, e in reply or []]
            ):
                for entry_id, fields in entries:
                    await self._deliver(client, entry_id, fields, 1)

    async def _claim(self, client: aioredis.Redis) -> None:
        """Process the group's entries pending longer than `claim_idle`, oldest first."""
        cursor: bytes | str = "0-0"
        while True:
            reply: Any = await client.xautoclaim(
                self.stream, self.group, self.name, int(self.claim_idle * 1000),
                start_id=cursor, count=self.prefetch,
            )  # fmt: skip
            cursor, entries = reply[0], reply[1]
            for entry_id, fields in entries:
                if fields is None:  # Redis 6.2: deleted from the stream while pending
                    await client.xack(self.stream, self.group, entry_id)
                    continue
                await self._deliver(
                    client, entry_id, fields, await self._deliveries(client, entry_id)
                )
            if cursor in (b"0-0", "0-0"):
                return

    async def _deliveries(self, client: aioredis.Redis, entry_id: bytes) -> int | None:
        pending = await client.xpending_range(self.stream, self.group, entry_id, entry_id, 1)
        return int(pending[0]["times_delivered"]) if pending else None

    async def _deliver(
        self,
        client: aioredis.Redis,
        entry_id: bytes,
        fields: Mapping[bytes, bytes],
        count: int | None,
    ) -> None:
        read = functools.partial(decode, fields, stream=self.stream, delivery_count=count)
        verdict = await self.handle(read)
        await self.settle(client, entry_id, fields, verdict)

    async def settle(
        self,
        client: aioredis.Redis,
        entry_id: bytes,
        fields: Mapping[bytes, bytes],
        verdict: Verdict,
    ) -> None:
        """XACK, leave pending, or dead-letter and XACK; a failed XACK is left pending."""
        from redis import exceptions as redis_errors

        try:
            if verdict is Verdict.ACK:
                await client.xack(self.stream, self.group, entry_id)
            elif verdict is Verdict.REJECT:
                await self._reject(client, entry_id, fields)
        except (redis_errors.RedisError, OSError) as error:
            logger.warning(
                "could not %s entry %s of %s: %r; it stays pending and is claimed again",
                verdict.value, _text(entry_id, "id"), self.stream, error,
                extra={"action": "settle_failed", "broker": "redis"},
            )  # fmt: skip

    async def _reject(
        self, client: aioredis.Redis, entry_id: bytes, fields: Mapping[bytes, bytes]
    ) -> None:
        entry = _text(entry_id, "id")
        if self.dead_letter is None:
            await client.xack(self.stream, self.group, entry_id)
            logger.error("entry %s of %s rejected and acknowledged (no dead_letter stream)",
                         entry, self.stream, extra={"action": "entry_rejected"})  # fmt: skip
            return
        why = (self.stream, entry, self.group, "no readable relaybox envelope")
        copy: dict[Any, Any] = dict(fields)
        copy.update((name.encode(), value) for name, value in zip(DEAD_LETTER_FIELDS, why,
                                                                  strict=True))  # fmt: skip
        async with client.pipeline(transaction=True) as pipeline:
            pipeline.xadd(self.dead_letter, copy)
            pipeline.xack(self.stream, self.group, entry_id)
            await pipeline.execute()
        logger.error("entry %s of %s rejected and moved to %s", entry, self.stream,
                     self.dead_letter, extra={"action": "entry_dead_lettered"})  # fmt: skip

    # -- connecting and joining ---------------------------------------------------------

    def _client(self) -> aioredis.Redis:
        import redis.asyncio as aioredis

        return aioredis.Redis.from_url(
            self.url,
            socket_connect_timeout=self.timeout,
            socket_timeout=self.timeout + self.fetch_timeout,  # a blocked read is no timeout
            health_check_interval=1,  # a connection the server dropped is noticed
        )

    async def _join(self, client: aioredis.Redis) -> None:
        from redis import exceptions as redis_errors

        try:
            async with asyncio.timeout(self.timeout):
                await client.ping()
        except (redis_errors.RedisError, OSError, TimeoutError) as error:
            raise BrokerUnavailableError(
                f"cannot reach Redis at {self._masked}: {error}"
            ) from error
        await self._create_group(client)

    async def _create_group(self, client: aioredis.Redis) -> None:
        from redis import exceptions as redis_errors

        try:
            await client.xgroup_create(self.stream, self.group, id=self.start_id, mkstream=True)
        except redis_errors.ResponseError as error:
            if "BUSYGROUP" in str(error):
                return  # the group exists: join it as it is
            if "WRONGTYPE" in str(error):
                raise ConfigurationError(
                    f"key {self.stream!r} at {self._masked} holds no stream"
                ) from error
            raise
