"""NATS JetStream publisher (nats-py): each message acked by the stream that stored it.

    nats://user:password@127.0.0.1:4222?timeout=5&source=orders
    tls://nats.example.com:4222

The subject is the message's topic; a JetStream stream must capture it (relaybox
creates no streams). Headers follow the CloudEvents NATS binding in binary mode:
`ce-id`, `ce-type`, ... , the content type in `content-type`, then the message's own
headers; the payload is the body. `Nats-Msg-Id` carries the message id, so the stream's
duplicate window drops a second copy of a message that was published twice.

Options:
    source           CloudEvents `source` (default "relaybox").
    timeout          seconds a publish() call waits for the acks of its messages;
                     the rest fail transiently (default 5).
    connect_timeout  seconds start() keeps trying before it gives up (default 5).
    reconnect_wait   seconds between reconnect attempts; the client reconnects for
                     as long as the publisher is open (default 0.5).
    name             the connection's name in the server's monitoring (default "relaybox").

Outcomes: no stream for the subject, a message over the server's max_payload or the
stream's max_msg_size, a bad subject or header, a denied subject -> permanent; a
full stream with discard=new, a JetStream API 5xx, a lost connection, no ack in time
-> transient.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Mapping, Sequence

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import AuthorizationError, BadHeaderError, BadSubjectError, MaxPayloadError

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

logger = logging.getLogger(__name__)

PREFIX = "ce-"
#: What the NATS protocol puts around headers: the `NATS/1.0` line and CRLFs.
_HEADER_FRAME = len(b"NATS/1.0\r\n\r\n")
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
    )


def wire_headers(message: StoredMessage, source: str) -> dict[str, str]:
    """CloudEvents NATS binding, binary mode; `Nats-Msg-Id` for JetStream's dedup."""
    headers = envelope.headers(message, PREFIX, source)
    headers["content-type"] = message.content_type
    headers["Nats-Msg-Id"] = str(message.id)
    return headers


def wire_size(message: StoredMessage, headers: Mapping[str, str]) -> int:
    """Header block plus payload: what the server holds against its max_payload."""
    names = sum(map(len, headers))  # header names are ASCII, or nats-py refuses them
    values = len("".join(headers.values()).encode())
    return _HEADER_FRAME + names + values + 4 * len(headers) + len(message.payload)  # "k: v\r\n"


def ack_result(reply: Msg, subject: str) -> PublishResult:
    """The outcome a JetStream publish reply (PubAck, API error or status) stands for."""
    if reply.headers and reply.headers.get("Status") == "503":
        return permanent(f"unroutable: no JetStream stream captures subject {subject!r}")
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


class _Acks:
    """Futures for replies to pipelined publishes, keyed by the reply subject.

    nats-py's `publish_async` does the same, but leaks a pending slot when a publish
    raises (bad subject, lost connection); this one forgets a reply it gave up on.
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._prefix = client.new_inbox() + "."
        self._tokens = itertools.count()
        self._waiting: dict[str, tuple[str, asyncio.Future[PublishResult]]] = {}

    async def listen(self) -> None:
        await self._client.subscribe(self._prefix + "*", cb=self._on_reply)

    def expect(self, subject: str) -> tuple[str, asyncio.Future[PublishResult]]:
        reply = f"{self._prefix}{next(self._tokens)}"
        future: asyncio.Future[PublishResult] = asyncio.get_running_loop().create_future()
        self._waiting[reply] = (subject, future)
        return reply, future

    def forget(self, reply: str) -> None:
        self._waiting.pop(reply, None)

    async def _on_reply(self, reply: Msg) -> None:
        subject, future = self._waiting.pop(reply.subject, (None, None))
        if future is not None and subject is not None and not future.done():
            future.set_result(ack_result(reply, subject))

    def deny(self, subject: str, error: str) -> None:
        """The server refused `subject` to this connection: fail its waiting publishes."""
        for reply, (waiting_subject, future) in list(self._waiting.items()):
            if waiting_subject == subject and not future.done():
                self._waiting.pop(reply, None)
                future.set_result(permanent(error))


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
    ) -> None:
        self._server = server
        self._source = source
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._reconnect_wait = reconnect_wait
        self._name = name
        self._masked = mask_password(server)
        self._client: Client | None = None
        self._acks: _Acks | None = None
        self._last_error: Exception | None = None
        self._refused = asyncio.Event()

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
        client, self._client, self._acks = self._client, None, None
        if client is not None and not client.is_closed:
            await client.close()  # flushes what is buffered, then disconnects

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
        replies: list[str] = []
        try:
            outcomes = [await self._send(client, acks, m, replies) for m in messages]
            waiting = [o for o in outcomes if isinstance(o, asyncio.Future)]
            if waiting:
                await asyncio.wait(waiting, timeout=self._timeout)
        finally:
            for reply in replies:
                acks.forget(reply)
        connected = client.is_connected
        return [self._outcome(o, connected) for o in outcomes]

    async def _send(
        self, client: Client, acks: _Acks, message: StoredMessage, replies: list[str]
    ) -> PublishResult | asyncio.Future[PublishResult]:
        headers = wire_headers(message, self._source)
        size = wire_size(message, headers)
        if size > client.max_payload:
            return permanent(
                f"message of {size} bytes exceeds the NATS server's max_payload of "
                f"{client.max_payload}"
            )
        reply, future = acks.expect(message.topic)
        replies.append(reply)
        try:
            await client.publish(message.topic, message.payload, reply=reply, headers=headers)
        except (BadSubjectError, BadHeaderError, MaxPayloadError) as error:
            return permanent(f"NATS refused {message.topic!r}: {error}")
        except Exception as error:  # noqa: BLE001 - a lost connection fails this one only
            if not client.is_connected:
                return unavailable(f"NATS publish to {message.topic!r} failed: {error!r}")
            return transient(f"NATS publish to {message.topic!r} failed: {error!r}")
        return future

    def _outcome(
        self, sent: PublishResult | asyncio.Future[PublishResult], connected: bool
    ) -> PublishResult:
        if isinstance(sent, PublishResult):
            return sent
        if sent.done():
            return sent.result()
        if not connected:  # the connection dropped while we waited
            return unavailable(f"NATS connection to {self._masked} lost before the ack")
        return transient(f"no JetStream ack within {self._timeout} s")
