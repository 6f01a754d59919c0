"""NATS JetStream publisher (nats-py): each message acked by the stream that stored it.

    nats://user:password@127.0.0.1:4222?timeout=5&source=orders
    tls://nats.example.com:4222

The subject is the message's topic; a JetStream stream must capture it (`relaybox
setup` creates one from the URL's `stream` and `subjects`). Headers follow the
CloudEvents NATS binding in binary mode: `ce-id`, `ce-type`, ... , the content type in
`content-type`, then the message's own headers; the payload is the body.
`Nats-Msg-Id` carries the message id, so the stream's duplicate window drops a second
copy of a message that was published twice.

Options:
    source           CloudEvents `source` (default "relaybox").
    timeout          seconds a publish() call waits for the acks of its messages;
                     the rest fail transiently (default 5).
    connect_timeout  seconds start() keeps trying before it gives up (default 5).
    reconnect_wait   seconds between reconnect attempts; the client reconnects for
                     as long as the publisher is open (default 0.5).
    name             the connection's name in the server's monitoring (default "relaybox").

Topology, for `relaybox setup` (and `relaybox relay --setup-topology`):
    stream           a JetStream stream to create if it does not exist ...
    subjects         ... capturing these subjects (comma-separated, wildcards allowed).
A stream that exists is left as it is, its subjects unchecked.

The frames are built here, not by nats-py's `publish()` (see
`relaybox.publishers.nats_protocol` for why), and written through the client's own
send buffer, so its connection, reconnects, flushing and subscriptions stay nats-py's.
PubAcks come back on one inbox subscription and settle the call that waits for them.

Outcomes: no stream for the subject, a message over the server's max_payload or the
stream's max_msg_size, a bad subject or header (or one of its own headers that takes
a name of the envelope, `relaybox.core.envelope`), a denied subject -> permanent; a
full stream with discard=new, a JetStream API 5xx, a lost connection -> transient; no
ack in time -> transient without an attempt counted (the stream may have stored it:
`Nats-Msg-Id` drops the copy sent again).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
from collections.abc import Sequence
from typing import cast

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import AuthorizationError, BadHeaderError, BadSubjectError
from nats.errors import Error as NatsError
from nats.js.errors import APIError, NotFoundError

from relaybox.core import envelope
from relaybox.core.publishing import (
    ACKED,
    Declared,
    Outcome,
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
from relaybox.publishers import nats_protocol
from relaybox.publishers.options import BrokerUrl

logger = logging.getLogger(__name__)

PREFIX = "ce-"
ID_HEADER = PREFIX + "id"
#: JetStream API error codes that may pass: timeout, throttled (5xx are too).
_RETRYABLE_CODES = frozenset({408, 429})
_PERMISSION_ERROR = "permissions violation for publish to"
#: How nats-py reports the server's -ERR for bad credentials (a plain `nats.errors.Error`).
_AUTH_ERROR = "authorization violation"


def from_url(url: BrokerUrl) -> NatsPublisher:
    return NatsPublisher(
        url.base,
        source=url.source,
        timeout=url.number("timeout", 5.0, minimum=0.001),
        connect_timeout=url.number("connect_timeout", 5.0, minimum=0.001),
        reconnect_wait=url.number("reconnect_wait", 0.5, minimum=0.0),
        name=url.text("name", "relaybox"),
        stream=stream_of(url),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Stream:
    """A JetStream stream a target needs: its name and the subjects it captures."""

    name: str
    subjects: tuple[str, ...]


def stream_of(url: BrokerUrl) -> Stream | None:
    """The URL's `stream` and `subjects`, which go together."""
    name, subjects = url.optional_text("stream"), url.optional_text("subjects")
    listed = tuple(s.strip() for s in (subjects or "").split(",") if s.strip())
    if (name is None) != (subjects is None) or (name is not None and not (name and listed)):
        raise ConfigurationError(
            "nats:// options stream and subjects go together: stream=NAME&subjects=A,B"
        )
    return None if name is None else Stream(name, listed)


def wire_headers(message: StoredMessage, source: str) -> dict[str, str]:
    """CloudEvents NATS binding, binary mode; `Nats-Msg-Id` for JetStream's dedup."""
    headers = envelope.headers(message, PREFIX, source)
    headers["content-type"] = message.content_type
    headers["Nats-Msg-Id"] = headers[ID_HEADER]  # str(message.id), already made once
    return headers


def header_block(message: StoredMessage, source: str) -> bytes:
    """`wire_headers(message, source)` as the NATS header block.

    Without headers of its own, a message's header names are all relaybox's (tokens,
    none colliding), so its lines are formatted straight from its attributes, which
    measured faster than building the dict and then checking every name in it.
    """
    values = envelope.common_values(message)
    if values is not None:
        block = _common_block(message, values, source)
        if block is not None:
            return block
    if not message.headers:
        attributes = envelope.attributes(message, source)
        content_type, message_id = message.content_type, attributes["id"]
        lines = "".join([f"{PREFIX}{name}: {value}\r\n" for name, value in attributes.items()])
        lines = f"{lines}content-type: {content_type}\r\nNats-Msg-Id: {message_id}\r\n"
        block = nats_protocol.block_of_lines(
            lines, [*attributes.values(), content_type, message_id]
        )
        if block is not None:
            return block
    return nats_protocol.header_block(wire_headers(message, source))


#: The lines of a block of the commonest message (`_common_block`).
_COMMON_LINES = len(envelope.COMMON_ATTRIBUTES) + 2 + 2  # content-type, id; NATS/1.0, end


def _common_block(
    message: StoredMessage, values: tuple[str, str, str, str, str], source: str
) -> bytes | None:
    """The block of a message of the commonest shape (`envelope.common_values` gave
    `values`) in one template: the bytes of the way below (a test holds it to that),
    measured faster. None if a value needs cleaning."""
    ident, time, seq, partition, attempts = values
    kind, key, content_type = message.type, cast(str, message.key), message.content_type
    block = (
        f"{nats_protocol.HEADER_LINE}{PREFIX}specversion: {envelope.SPEC_VERSION}\r\n"
        f"{ID_HEADER}: {ident}\r\n{PREFIX}source: {source}\r\n{PREFIX}type: {kind}\r\n"
        f"{PREFIX}time: {time}\r\n{PREFIX}subject: {key}\r\n{PREFIX}partitionkey: {key}\r\n"
        f"{PREFIX}sequence: {seq}\r\n{PREFIX}partition: {partition}\r\n"
        f"{PREFIX}attempts: {attempts}\r\ncontent-type: {content_type}\r\n"
        f"Nats-Msg-Id: {ident}\r\n\r\n"
    )
    clean = (
        block.count("\n") == _COMMON_LINES
        and block.count("\r") == _COMMON_LINES
        and kind.strip() == kind
        and key.strip() == key
        and content_type.strip() == content_type
        and source.strip() == source
    )
    return block.encode() if clean else None


def wire_size(message: StoredMessage, source: str) -> int:
    """Header block plus payload: what the server holds against its max_payload."""
    return len(header_block(message, source)) + len(message.payload)


def ack_result(reply: Msg, subject: str) -> PublishResult:
    """The outcome a JetStream publish reply (PubAck, API error or status) stands for."""
    if not reply.headers and nats_protocol.is_plain_ack(reply.data):
        return ACKED  # the common reply, recognised without parsing it
    if reply.headers and reply.headers.get("Status") == "503":
        return _NoResponders(
            Outcome.PERMANENT, f"unroutable: no JetStream stream captures subject {subject!r}"
        )
    try:
        answer = json.loads(reply.data)
    except ValueError:
        return transient(f"unreadable JetStream reply on {subject!r}: {reply.data[:200]!r}")
    error = answer.get("error") if isinstance(answer, dict) else None
    if error is None:
        return ACKED  # a duplicate within the stream's window is acked too
    code = int(error.get("code", 0))
    text = f"JetStream refused {subject!r}: {error.get('description')} ({error.get('err_code')})"
    # 503 covers a full stream with discard=new, which may drain later.
    return transient(text) if code >= 500 or code in _RETRYABLE_CODES else permanent(text)


@dataclasses.dataclass(frozen=True, slots=True)
class _NoResponders(PublishResult):
    """A 503 "no responders" reply: no stream captures the subject, or JetStream is not
    ready yet (it says the same for a while after the server restarts). `publish`
    asks JetStream which it is before the message is abandoned."""


class _Call:
    """The messages of one publish() call: a result per message as its reply arrives,
    and one future for the whole call (not one per message: 500 futures and their
    wake-ups cost more than the counting)."""

    __slots__ = ("done", "remaining", "results", "subjects")

    def __init__(self, subjects: list[str]) -> None:
        self.subjects = subjects
        self.results: list[PublishResult | None] = [None] * len(subjects)
        self.remaining = len(subjects)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not subjects:
            self.done.set_result(None)

    def settle(self, index: int, result: PublishResult) -> None:
        if self.results[index] is not None:
            return
        self.results[index] = result
        self.remaining -= 1
        if not self.remaining and not self.done.done():
            self.done.set_result(None)


class _Acks:
    """The calls waiting for replies to their publishes, keyed by reply subject.

    nats-py's `publish_async` does the same with a future per message, and leaks a
    pending slot when a publish raises; this one forgets what it gave up on.
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._prefix = client.new_inbox() + "."
        self._tokens = itertools.count()
        self._waiting: dict[str, tuple[_Call, int]] = {}

    async def listen(self) -> None:
        await self._client.subscribe(self._prefix + "*", cb=self._on_reply)

    def reply_subject(self) -> str:
        return f"{self._prefix}{next(self._tokens)}"

    def expect(self, reply: str, call: _Call, index: int) -> None:
        self._waiting[reply] = (call, index)

    def forget(self, replies: list[str]) -> None:
        waiting = self._waiting
        for reply in replies:
            waiting.pop(reply, None)

    async def _on_reply(self, reply: Msg) -> None:
        entry = self._waiting.pop(reply.subject, None)
        if entry is not None:
            call, index = entry
            call.settle(index, ack_result(reply, call.subjects[index]))

    def deny(self, subject: str, error: str) -> None:
        """The server refused `subject` to this connection: fail its waiting publishes."""
        for reply, (call, index) in list(self._waiting.items()):
            if call.subjects[index] == subject:
                self._waiting.pop(reply, None)
                call.settle(index, permanent(error))


class NatsPublisher:
    features = PublisherFeatures(deduplicates=True, batching=True)

    def __init__(
        self,
        server: str,
        *,
        source: str = envelope.DEFAULT_SOURCE,
        timeout: float = 5.0,
        connect_timeout: float = 5.0,
        reconnect_wait: float = 0.5,
        name: str = "relaybox",
        stream: Stream | None = None,
    ) -> None:
        self._server = server
        self._stream = stream
        self._source = source
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._reconnect_wait = reconnect_wait
        self._name = name
        self._masked = mask_url(server)
        self._client: Client | None = None
        self._acks: _Acks | None = None
        self._last_error: Exception | None = None
        self._refused = asyncio.Event()

    async def setup_topology(self) -> list[Declared]:
        """Create the URL's stream if it does not exist."""
        if self._stream is None:
            return []
        client = Client()
        try:
            # nats-py retries a first connection too (max_reconnect_attempts): bound it.
            async with asyncio.timeout(self._connect_timeout):
                await client.connect(
                    servers=[self._server], name=self._name, allow_reconnect=False,
                    connect_timeout=self._connect_timeout,  # type: ignore[arg-type]
                    error_cb=self._on_error,
                )  # fmt: skip
        except (NatsError, OSError) as error:  # TimeoutError too
            await client.close()
            raise BrokerUnavailableError(
                f"cannot connect to NATS at {self._masked}: {error or 'timed out'}"
            ) from None
        try:
            return [await _ensure_stream(client, self._stream, self._timeout)]
        except APIError as error:  # overlapping subjects, a bad name, no JetStream
            raise BrokerError(f"JetStream at {self._masked} refused: {error}") from None
        except (NatsError, OSError) as error:
            raise BrokerUnavailableError(f"NATS at {self._masked} failed: {error}") from None
        finally:
            await client.close()

    async def start(self) -> None:
        self._refused.clear()
        client = Client()
        connecting = asyncio.ensure_future(self._connect(client))
        refused = asyncio.ensure_future(self._refused.wait())
        await asyncio.wait(
            {connecting, refused},
            timeout=self._connect_timeout,
            return_when=asyncio.FIRST_COMPLETED,
        )
        refused.cancel()
        if not connecting.done() or connecting.exception() is not None:
            connecting.cancel()
            await client.close()
            raise BrokerUnavailableError(
                f"cannot connect to NATS at {self._masked}: {self._last_error or 'timed out'}"
            )
        self._client = client
        self._acks = _Acks(client)
        await self._acks.listen()

    async def _connect(self, client: Client) -> None:
        # nats-py annotates the two waits as int but sleeps and times out on floats.
        await client.connect(
            servers=[self._server],
            name=self._name,
            error_cb=self._on_error,
            allow_reconnect=True,
            max_reconnect_attempts=-1,  # for as long as the publisher is open
            reconnect_time_wait=self._reconnect_wait,  # type: ignore[arg-type]
            connect_timeout=min(self._connect_timeout, 2.0),  # type: ignore[arg-type]
        )

    async def _on_error(self, error: Exception) -> None:
        self._last_error = error
        text = str(error)
        if isinstance(error, AuthorizationError) or _AUTH_ERROR in text.lower():
            self._refused.set()  # retrying the same credentials will not help start()
        elif self._acks is not None and _PERMISSION_ERROR in text.lower():
            subject = text.rsplit(" ", 1)[-1].strip("\"'")
            self._acks.deny(subject, f"permission denied: {text}")
        logger.debug("nats client error: %s", text, extra={"action": "nats_error"})

    async def close(self) -> None:
        """Flush what is buffered and disconnect; a server that takes nothing more
        within `timeout` is left behind."""
        client, self._client, self._acks = self._client, None, None
        if client is not None and not client.is_closed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._timeout):
                    await client.close()

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if self._client is None:
            raise ConfigurationError("NatsPublisher.publish called before start()")
        if self._client.is_closed:
            # nats-py stops reconnecting after some server errors: start over.
            await self.start()
        client, acks = self._client, self._acks
        assert acks is not None
        if not client.is_connected:
            error = unavailable(f"NATS connection to {self._masked} lost; reconnecting")
            return [error] * len(messages)
        call = _Call([m.topic for m in messages])
        replies: list[str] = []
        try:
            frames = self._frames(client, acks, call, messages, replies)
            if frames:
                await self._send(client, call, replies, frames)
            if call.remaining:
                await asyncio.wait([call.done], timeout=self._timeout)
        finally:
            acks.forget(replies)
        connected = client.is_connected
        results = [r if r is not None else self._missing(connected) for r in call.results]
        if any(isinstance(r, _NoResponders) for r in results):
            results = await self._unroutable_or_not_ready(client, messages, results)
        return results

    async def _unroutable_or_not_ready(
        self, client: Client, messages: Sequence[StoredMessage], results: list[PublishResult]
    ) -> list[PublishResult]:
        """Tell "no stream captures the subject" (permanent) from "JetStream is not
        ready" (the broker is not really there yet: no attempt counted) by asking the
        JetStream API which stream captures each such subject."""
        verdicts: dict[str, PublishResult] = {}
        for message, result in zip(messages, results, strict=True):
            if isinstance(result, _NoResponders) and message.topic not in verdicts:
                verdicts[message.topic] = await self._stream_verdict(client, message.topic, result)
        return [
            verdicts[m.topic] if isinstance(r, _NoResponders) else r
            for m, r in zip(messages, results, strict=True)
        ]

    async def _stream_verdict(
        self, client: Client, subject: str, result: PublishResult
    ) -> PublishResult:
        try:
            await client.jetstream(timeout=min(self._timeout, 2.0)).find_stream_name_by_subject(
                subject
            )
        except NotFoundError:
            return permanent(result.error or "unroutable")
        except Exception as error:  # noqa: BLE001 - no answer at all: JetStream is not up
            return unavailable(f"JetStream at {self._masked} is not ready: {error!r}")
        return unavailable(
            f"JetStream at {self._masked} has a stream for {subject!r} "
            "but did not answer for it yet"
        )

    def _frames(
        self,
        client: Client,
        acks: _Acks,
        call: _Call,
        messages: Sequence[StoredMessage],
        replies: list[str],
    ) -> list[bytes]:
        """The HPUB frames of the messages NATS may take; the others are settled here."""
        frames: list[bytes] = []
        limit = client.max_payload
        for index, message in enumerate(messages):
            reply = acks.reply_subject()
            frame = self._frame(message, reply, limit)
            if isinstance(frame, PublishResult):
                call.settle(index, frame)
                continue
            acks.expect(reply, call, index)
            replies.append(reply)
            frames += frame
        return frames

    def _frame(self, message: StoredMessage, reply: str, limit: int) -> list[bytes] | PublishResult:
        """One message's HPUB frame, or why NATS would never take it."""
        topic = message.topic
        try:
            nats_protocol.check_subject(topic)
            block = header_block(message, self._source)
            frame = nats_protocol.hpub(topic, reply, block, message.payload)
        except (BadSubjectError, BadHeaderError, UnicodeEncodeError) as error:
            return permanent(f"NATS refused {topic!r}: {error}")
        except InvalidHeadersError as error:  # a stored row's header poses as the envelope's
            return permanent(str(error))
        size = len(block) + len(message.payload)
        if size > limit:
            return permanent(
                f"message of {size} bytes exceeds the NATS server's max_payload of {limit}"
            )
        return frame

    async def _send(
        self, client: Client, call: _Call, replies: list[str], frames: list[bytes]
    ) -> None:
        """All frames in one write through nats-py's send buffer and flusher.

        `_send_command` and `_flush_pending` are what nats-py's own `publish()` ends in;
        tests/brokers/test_nats.py fails if a nats-py release changes either.
        """
        try:
            await client._send_command(b"".join(frames))
            await client._flush_pending()
        except Exception as error:  # noqa: BLE001 - the connection failed them all
            failed = (
                unavailable(f"NATS publish to {self._masked} failed: {error!r}")
                if not client.is_connected
                else transient(f"NATS publish failed: {error!r}")
            )
            for index, result in enumerate(call.results):
                if result is None:
                    call.settle(index, failed)
            return
        client.stats["out_msgs"] += len(replies)  # as publish() counts them

    def _missing(self, connected: bool) -> PublishResult:
        if not connected:  # the connection dropped while we waited
            return unavailable(f"NATS connection to {self._masked} lost before the ack")
        return timed_out(f"no JetStream ack within {self._timeout:g} s")


async def _ensure_stream(client: Client, stream: Stream, timeout: float) -> Declared:
    jetstream = client.jetstream(timeout=timeout)
    try:
        await jetstream.stream_info(stream.name)
    except NotFoundError:
        await jetstream.add_stream(name=stream.name, subjects=list(stream.subjects))
        return Declared("stream", stream.name, Presence.CREATED)
    return Declared("stream", stream.name, Presence.EXISTED)
