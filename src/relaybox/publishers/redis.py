"""Redis Streams publisher (redis-py asyncio): one XADD per message, its entry id the confirm.

    redis://[:PASSWORD@]HOST:PORT/DB?prefix=outbox:&maxlen=100000&timeout=5
    rediss://...   (TLS)

Options:
    source       CloudEvents `source` attribute (default "relaybox").
    prefix       prepended to the topic to make the stream key (default "").
    maxlen       trim each stream to about this many entries (default: no trimming).
    approximate  true|false: trim with `~`, cheap, or exactly (default true).
    timeout      seconds for connecting and for a whole publish() call (default 5).

Topology, for `relaybox setup` (and `relaybox relay --setup-topology`):
    group        a consumer group to create (XGROUP CREATE ... MKSTREAM) on ...
    streams      ... each of these topics' streams (comma-separated; prefix prepended),
    group_start  reading from the stream's first entry ("0", the default: what the
                 relay sent before the group existed is read too) or only from entries
                 added afterwards ("$").
A group that exists is left as it is.

Redis has no CloudEvents binding; an entry's fields are
    data               the payload, as bytes
    datacontenttype    the content type
    <attribute>        each CloudEvents attribute under its own name (id, type, source, ...)
    h_<name>           each of the message's own headers, prefixed so that none can
                       shadow an attribute or `data`.

One write per call carries every XADD, pipelined on one pooled connection (no MULTI);
each reply is read and checked on its own. The commands are encoded here, not by
redis-py (see `relaybox.publishers.redis_protocol` for why), and go through redis-py's
connection (`send_packed_command`, `read_response`: what its own pipelines use), so
connecting, AUTH, TLS, health checks and reply parsing stay redis-py's.

A key holding another type (WRONGTYPE), a refused permission, a bad argument, text
UTF-8 cannot carry or a header that takes a name of the envelope
(`relaybox.core.envelope`) fails permanently; connection loss, OOM, loading and read-only
replicas are transient; no reply in time is transient without an attempt counted (the
entry may have been added). Replies read before a connection broke keep their
outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import cast

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.connection import AbstractConnection
from redis.typing import EncodableT, FieldT

from relaybox.core import envelope
from relaybox.core.publishing import (
    ACKED,
    Declared,
    Presence,
    PublisherFeatures,
    PublishResult,
    permanent,
    timed_out,
    transient,
    unavailable,
)
from relaybox.core.records import StoredMessage
from relaybox.core.urls import mask_url
from relaybox.errors import (
    BrokerError,
    BrokerUnavailableError,
    ConfigurationError,
    InvalidHeadersError,
)
from relaybox.publishers import redis_protocol
from relaybox.publishers.options import BrokerUrl

DATA_FIELD = "data"
CONTENT_TYPE_FIELD = "datacontenttype"
HEADER_PREFIX = "h_"
#: Every entry's fields but the headers, whose RESP text is made once.
_FIELD_HEADS = redis_protocol.field_heads((CONTENT_TYPE_FIELD, *envelope.ATTRIBUTE_NAMES))
#: The commonest entry's fields (`common_entry`), as `text_fields` orders them.
_COMMON_FIELDS = (CONTENT_TYPE_FIELD, *envelope.COMMON_ATTRIBUTES)
_H = {name: _FIELD_HEADS[name] for name in _COMMON_FIELDS}
_SPEC = _H["specversion"] + redis_protocol.bulk(envelope.SPEC_VERSION)[1:]
_DATA = redis_protocol.bulk(DATA_FIELD)

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
        groups=groups_of(url),
    )


async def connect(url: str, timeout: float) -> aioredis.Redis:
    """A client of the Redis at `url` that answered a PING within `timeout` seconds;
    `BrokerUnavailableError` (the URL masked) otherwise."""
    client = aioredis.Redis.from_url(
        url,
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        # A pooled connection the server dropped (restart) is noticed before use.
        health_check_interval=1,
    )
    try:
        async with asyncio.timeout(timeout):
            await client.ping()
    except (redis_errors.RedisError, OSError, TimeoutError) as error:
        await client.aclose()
        raise BrokerUnavailableError(f"cannot reach Redis at {mask_url(url)}: {error}") from error
    return client


@dataclasses.dataclass(frozen=True, slots=True)
class Groups:
    """A consumer group a target's streams need, and where it starts reading."""

    group: str
    streams: tuple[str, ...]
    start: str = "0"


def groups_of(url: BrokerUrl) -> Groups | None:
    """The URL's `group`, `streams` and `group_start`."""
    group, streams = url.optional_text("group"), url.optional_text("streams")
    start = url.text("group_start", "0")
    listed = tuple(s.strip() for s in (streams or "").split(",") if s.strip())
    if (group is None) != (streams is None) or (group is not None and not (group and listed)):
        raise ConfigurationError(
            "redis:// options group and streams go together: group=NAME&streams=A,B"
        )
    if start not in {"0", "$"}:
        raise ConfigurationError(f"redis:// option group_start={start!r}: use 0 or $")
    return None if group is None else Groups(group, listed, start)


def fields(message: StoredMessage, source: str) -> dict[FieldT, EncodableT]:
    """The whole entry, in order, as redis-py's `xadd` would take it."""
    entry: dict[FieldT, EncodableT] = {DATA_FIELD: message.payload}
    entry.update(text_fields(message, source))
    return entry


def text_fields(message: StoredMessage, source: str) -> dict[str, str]:
    """Every field of the entry after `data`: content type, attributes, headers."""
    entry = {CONTENT_TYPE_FIELD: message.content_type, **envelope.attributes(message, source)}
    if message.headers:
        entry.update({HEADER_PREFIX + name: value for name, value in message.headers.items()})
    return entry


def entry(stream: str, trim: tuple[int, str], message: StoredMessage, source: str) -> list[bytes]:
    """The parts of one message's XADD command: `common_entry` for the commonest shape,
    else `redis_protocol.xadd` of every field. Raises UnicodeEncodeError for text UTF-8
    cannot carry and InvalidHeadersError for a header that poses as the envelope's."""
    values = envelope.common_values(message)
    command = None if values is None else common_entry(stream, trim, message, values, source)
    return command or redis_protocol.xadd(
        stream, trim, DATA_FIELD, message.payload, text_fields(message, source), _FIELD_HEADS
    )


def common_entry(
    stream: str, trim: tuple[int, str], message: StoredMessage,
    values: tuple[str, str, str, str, str], source: str,
) -> list[bytes] | None:  # fmt: skip
    """`redis_protocol.xadd` of `text_fields` for a message of the commonest shape
    (`envelope.common_values` gave `values`), formatted in one template: the same
    bytes (a test holds it to that), measured faster. None if some text is not ASCII
    (then `xadd` counts its bytes)."""
    ident, time, seq, partition, attempts = values
    kind, key, content_type, h = message.type, cast(str, message.key), message.content_type, _H
    pairs = (
        f"\r\n{h[CONTENT_TYPE_FIELD]}{len(content_type)}\r\n{content_type}\r\n{_SPEC}"
        f"{h['id']}{len(ident)}\r\n{ident}\r\n{h['source']}{len(source)}\r\n{source}\r\n"
        f"{h['type']}{len(kind)}\r\n{kind}\r\n{h['time']}{len(time)}\r\n{time}\r\n"
        f"{h['subject']}{len(key)}\r\n{key}\r\n{h['partitionkey']}{len(key)}\r\n{key}\r\n"
        f"{h['sequence']}{len(seq)}\r\n{seq}\r\n{h['partition']}{len(partition)}\r\n"
        f"{partition}\r\n{h['attempts']}{len(attempts)}\r\n{attempts}\r\n"
    )
    if not pairs.isascii():
        return None
    count, options = trim
    head = (
        f"*{5 + count + 2 * len(_COMMON_FIELDS)}\r\n$4\r\nXADD\r\n"
        f"{redis_protocol.bulk(stream)}{options}$1\r\n*\r\n{_DATA}${len(message.payload)}\r\n"
    )
    return [head.encode(), message.payload, pairs.encode()]


def classify(error: BaseException) -> PublishResult:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, _REFUSED):
        return permanent(text)
    if isinstance(error, redis_errors.ResponseError) and not isinstance(error, _TRANSIENT_REPLIES):
        return permanent(text)  # WRONGTYPE, a bad MAXLEN, an unknown command
    if isinstance(error, redis_errors.TimeoutError | TimeoutError):
        return timed_out(text)  # the server may have run the command
    if isinstance(error, redis_errors.ConnectionError | ConnectionError):
        return unavailable(text)  # refused, reset, closed: the server is not there
    return transient(text)  # BUSY LOADING, OOM, READONLY


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
        groups: Groups | None = None,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self._groups = groups
        self._source = source
        self._trim = redis_protocol.trim_options(maxlen, approximate)
        self._timeout = timeout
        self._client: aioredis.Redis | None = None

    async def start(self) -> None:
        self._client = await connect(self.url, self._timeout)

    async def setup_topology(self) -> list[Declared]:
        """Create the URL's consumer group on each of its streams that lacks it."""
        if self._groups is None:
            return []
        groups = self._groups
        client = aioredis.Redis.from_url(
            self.url, socket_connect_timeout=self._timeout, socket_timeout=self._timeout
        )
        try:
            return [
                await _ensure_group(client, self.prefix + topic, groups) for topic in groups.streams
            ]
        except redis_errors.ResponseError as error:  # WRONGTYPE, no permission
            raise BrokerError(f"Redis at {mask_url(self.url)} refused: {error}") from None
        except (redis_errors.RedisError, OSError) as error:
            raise BrokerUnavailableError(
                f"cannot reach Redis at {mask_url(self.url)}: {error}"
            ) from error
        finally:
            await client.aclose()

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(TimeoutError):  # a server that does not answer
                async with asyncio.timeout(self._timeout):
                    await client.aclose()

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if self._client is None:
            raise ConfigurationError("RedisPublisher.publish called before start()")
        refused: dict[int, PublishResult] = {}
        commands: list[bytes] = []
        source, trim = self._source, self._trim
        for index, message in enumerate(messages):
            stream = self.prefix + message.topic
            try:
                commands += entry(stream, trim, message, source)
            except UnicodeEncodeError as error:
                refused[index] = permanent(f"the entry cannot be sent as UTF-8: {error}")
            except InvalidHeadersError as error:  # a stored row's header poses as the envelope's
                refused[index] = permanent(str(error))
        count = len(messages) - len(refused)
        replies = iter(await self._send(self._client, commands, count) if count else [])
        return [refused.get(index) or next(replies) for index in range(len(messages))]

    async def _send(
        self, client: aioredis.Redis, commands: list[bytes], count: int
    ) -> list[PublishResult]:
        """One write of `count` XADDs, then their replies in order; those left unread
        when the connection failed or time ran out share what befell them."""
        pool = client.connection_pool
        connection: AbstractConnection | None = None
        replies: list[PublishResult] = []
        try:
            async with asyncio.timeout(self._timeout):
                connection = await pool.get_connection()  # type: ignore[no-untyped-call]
                await connection.send_packed_command(b"".join(commands))
                for _ in range(count):
                    replies.append(await _reply(connection))
        except TimeoutError:
            failure = (
                timed_out(f"no reply from Redis within {self._timeout:g} s")
                if connection is not None
                else unavailable(f"no connection to Redis within {self._timeout:g} s")
            )
        except (redis_errors.RedisError, OSError) as error:
            failure = classify(error)
        else:
            return replies
        finally:
            if connection is not None:
                # A connection left with replies unread was disconnected by redis-py.
                await pool.release(connection)
        return replies + [failure] * (count - len(replies))


async def _reply(connection: AbstractConnection) -> PublishResult:
    try:
        # No timeout per reply (math.inf: redis-py's documented "block" opt-in): the
        # whole call has one, and a timer set and cancelled per reply is a measurable
        # cost on every message.
        await connection.read_response(timeout=math.inf)
    except redis_errors.ResponseError as error:  # this XADD's own error reply
        return classify(error)
    return ACKED


async def _ensure_group(client: aioredis.Redis, stream: str, groups: Groups) -> Declared:
    name = f"{groups.group} on {stream}"
    try:
        await client.xgroup_create(stream, groups.group, id=groups.start, mkstream=True)
    except redis_errors.ResponseError as error:
        if not str(error).startswith("BUSYGROUP"):
            raise
        return Declared("consumer group", name, Presence.EXISTED)
    return Declared("consumer group", name, Presence.CREATED)
