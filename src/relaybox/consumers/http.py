"""Webhooks: the receiving side of `relaybox.publishers.http`.

    receiver = WebhookReceiver(Consumer(handle, inbox=..., transaction=...), secret="s3cret")
    app.mount("/hooks/orders", receiver)            # Starlette / FastAPI: an ASGI 3 app
    status, body = await receiver.handle("POST", headers, raw_body)   # any other framework

`decode_request(headers, body)` reads the three forms of the CloudEvents HTTP binding
that the publisher sends: binary mode (the body is the payload, `ce-<name>` headers
carry the attributes, percent-encoded, the `Content-Type` the content type, the
message's own headers beside them), structured mode (`application/cloudevents+json`:
one JSON event) and batch mode (`application/cloudevents-batch+json`: a JSON array of
events). The topic is the `Relaybox-Topic` header, or the request path without it.

A webhook has no broker that redelivers: the publisher (the relay) does, when it gets
no 2xx. So the verdicts are HTTP statuses, sent only after `Consumer.process` returned:
    ACK     every message of the request committed (applied, or a duplicate skipped):
            200, with a JSON summary.
    PARKED  a handler failed on its `max_attempts`-th attempt (counted in the
            inbox's database across the publisher's resends), or the payload does not
            fit its handler's class: the message is parked (`relaybox.inbox.parked`)
            and the request answered 200, so the publisher stops resending it.
    RETRY   a handler raised with attempts left: its transaction rolled back; 500.
            The publisher treats 5xx (and a dropped connection, a timeout) as
            transient and sends the request again later: that is the redelivery. A
            batch is processed in order, each message in its own transaction, and
            stops at the first failure: the messages before it are committed, so in
            the resent batch they are duplicates, acknowledged without running the
            handler again.
    REJECT  the request is no readable envelope (no id, bad JSON, a batch with one bad
            event): 400, which the publisher takes as a permanent failure. Nothing of
            such a batch is processed.
A receiver takes the publisher's `secret` (or `unsigned=True`, said out loud, where
every request is authenticated before it arrives: then no signature is checked and
handlers see every header). With the secret, a request is processed only if its
`Relaybox-Signature` is valid
(`relaybox.publishers.webhook_signature` defines it: an HMAC-SHA256 over a timestamp,
the signed headers and the raw body, at most `tolerance` seconds old): anything else,
or a request carrying a `ce-` attribute, a `Content-Type` or a `Relaybox-Topic` the
signature does not cover, is refused with 401 before anything is decoded, and the
handlers see only signed headers. `HEAD` (the publisher's reachability check at start)
answers 200; other methods but POST, 405.

Limits, each an option of `WebhookReceiver`: a body over `max_body_size` (2 MiB by
default: a message at the writer's default limit of 1 MiB, also base64-encoded in a
batch) is refused with 413, the ASGI adapter reading no further (nor at all when the
request's `Content-Length` says so); a batch of more than `max_batch_events` (1000)
events, or JSON nested too deeply to decode, is refused with 400. The publisher splits
its batches by the same defaults (its `max_body_size` and `max_batch_events` options).
So the receiver answers 4xx for whatever a request holds, and 5xx only when a handler
or the inbox's database fails.

If the receiver commits and the connection drops before the response reaches the
publisher, the publisher sees a transient failure and sends the message again: the
inbox finds it recorded and the copy is acknowledged (200) as a duplicate.

Order: requests are processed as they arrive, concurrently if they arrive together;
the messages of one request in the request's order. The publisher's default mode
POSTs the messages of one publish call concurrently, so only `?batch=true` (one
request per topic per call) delivers one key's messages in order; with "id" inbox
mode, an out-of-order arrival is still applied exactly once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

from relaybox.consumers.base import DEFAULTS
from relaybox.core import envelope
from relaybox.core.incoming import Incoming, parse_json
from relaybox.errors import ConfigurationError, EnvelopeError, SignatureError
from relaybox.inbox.consumer import Processed
from relaybox.inbox.processor import Processor
from relaybox.publishers.http import (
    BATCH_CONTENT_TYPE,
    DEFAULT_MAX_BATCH_EVENTS,
    DEFAULT_MAX_BODY_SIZE,
    PREFIX,
    TOPIC_HEADER,
)
from relaybox.publishers.webhook_signature import (
    DEFAULT_TOLERANCE,
    SIGNATURE_HEADER,
    Headers,
    check_secret,
    normalise_headers,
    verify_signature,
)

logger = logging.getLogger(__name__)

#: The structured mode's media type (one event as a JSON object).
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json"
#: Headers of the transport and of the binding, not the message's own.
TRANSPORT_HEADERS = envelope.HTTP_TRANSPORT_HEADERS | {
    "content-encoding", "content-length", "content-type", "proxy-authorization",
    SIGNATURE_HEADER.lower(), TOPIC_HEADER.lower(),
}  # fmt: skip
#: Headers that steer how a request is decoded: a signature must cover each present.
_DECISIVE_HEADERS = frozenset({"content-type", TOPIC_HEADER.lower()})
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def decode_request(
    headers: Headers, body: bytes, *, path: str = "", max_events: int | None = None
) -> list[Incoming]:
    """The messages one webhook request carries, in order; raises `EnvelopeError` when
    the request, or any event of a batch, is not a readable envelope, or a batch holds
    more than `max_events` events.

    `headers` is a mapping or (name, value) pairs, names in any case (str or bytes:
    ASGI's raw headers are fine); `body` the raw request body.
    """
    try:
        return _decode(normalise_headers(headers), body, path, max_events)
    except RecursionError:
        raise EnvelopeError("the request's JSON is nested too deeply") from None
    except UnicodeError as error:  # text UTF-8 cannot carry: a lone surrogate escaped
        raise EnvelopeError(f"the request carries text that is not Unicode: {error}") from None


def _decode(
    received: dict[str, str], body: bytes, path: str, max_events: int | None
) -> list[Incoming]:
    topic = urllib.parse.unquote(received.get(TOPIC_HEADER.lower(), "")) or path
    own = {
        name: value
        for name, value in received.items()
        if not name.startswith(PREFIX) and name not in TRANSPORT_HEADERS
    }
    content_type = received.get("content-type") or None
    media = (content_type or "").partition(";")[0].strip().lower()
    if media == BATCH_CONTENT_TYPE:
        events = _json(body)
        if not isinstance(events, list):
            raise EnvelopeError("a CloudEvents batch must be a JSON array of events")
        if max_events is not None and len(events) > max_events:
            raise EnvelopeError(
                f"the batch holds {len(events)} events, over this receiver's limit of "
                f"{max_events} (max_batch_events)"
            )
        return [_structured(event, topic, own) for event in events]
    if media == STRUCTURED_CONTENT_TYPE:
        return [_structured(_json(body), topic, own)]
    attributes, _ = envelope.split(received, PREFIX)
    attributes = {name: urllib.parse.unquote(value) for name, value in attributes.items()}
    return [
        Incoming.from_envelope(
            attributes, body, headers=own, content_type=content_type, topic=topic
        )
    ]


def _json(body: bytes) -> Any:
    return parse_json(body, "the request body")


def _structured(event: Any, topic: str, headers: Mapping[str, str]) -> Incoming:
    """One event in structured JSON mode: the inverse of `envelope.structured`."""
    if not isinstance(event, dict):
        raise EnvelopeError("a structured CloudEvent must be a JSON object")
    fields = dict(event)
    content_type = fields.pop("datacontenttype", None)
    if content_type is not None and not isinstance(content_type, str):
        raise EnvelopeError("datacontenttype must be a string")
    if "data_base64" in fields:
        fields.pop("data", None)
        encoded = fields.pop("data_base64")
        try:
            payload = base64.b64decode(encoded, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise EnvelopeError("data_base64 is not base64") from None
    elif "data" in fields:
        data = fields.pop("data")
        if isinstance(data, str) and not envelope.is_json(content_type or "application/json"):
            payload = data.encode("utf-8")  # text data of a non-JSON content type
        else:
            payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    else:
        payload = b""
    attributes = {name: _attribute(value) for name, value in fields.items() if value is not None}
    return Incoming.from_envelope(
        attributes, payload, headers=headers, content_type=content_type, topic=topic
    )


def _attribute(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _answer(status: int, **fields: Any) -> tuple[int, bytes]:
    return status, json.dumps(fields, separators=(",", ":")).encode()


class WebhookReceiver:
    """Receives webhook requests for a `Consumer`: `handle` for any framework, and an
    ASGI 3 application (call the receiver itself) for Starlette, FastAPI, uvicorn...

    `secret` is the publisher's `?secret=` (never empty): only requests whose
    `Relaybox-Signature` it made are processed. Whoever reaches the receiver's URL could
    otherwise post any message, with any id, so a receiver needs one: give it, or say
    `unsigned=True` where something in front of the receiver already authenticates
    every request (a mutual-TLS proxy, a private network only the relays reach), and
    the signatures are not checked. `tolerance` is how many seconds a
    signature's timestamp may be from this clock, `max_body_size` the largest body
    taken (413 beyond; the ASGI adapter reads no further), `max_batch_events` the most
    events in a batch (400 beyond), `max_attempts` the attempts at a message before it
    is parked. With other frameworks, pass `handle` the raw header bytes where the
    framework has them: a header value it decoded as Latin-1 no longer matches its
    signature. Under ASGI, the lifespan runs `Consumer.maintain` (requested replays);
    elsewhere, run it yourself.
    """

    def __init__(
        self,
        consumer: Processor,
        *,
        secret: str | None = None,
        unsigned: bool = False,
        tolerance: float = DEFAULT_TOLERANCE,
        max_body_size: int = DEFAULT_MAX_BODY_SIZE,
        max_batch_events: int = DEFAULT_MAX_BATCH_EVENTS,
        max_attempts: int = DEFAULTS.max_attempts,
    ) -> None:
        for name, value in (("max_attempts", max_attempts), ("max_body_size", max_body_size),
                            ("max_batch_events", max_batch_events)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name}={value!r}: must be at least 1")
        if not tolerance > 0:
            raise ConfigurationError(f"tolerance={tolerance!r}: must be above zero")
        if secret is not None and not secret:  # check_secret's words are the publisher's
            raise ConfigurationError(
                "the webhook secret is empty: give the publisher's (a long random one), or "
                "unsigned=True if every request is authenticated before it reaches the "
                "receiver"
            )
        check_secret(secret)
        if (secret is None) is not bool(unsigned):
            raise ConfigurationError(
                "a WebhookReceiver checks signatures made with the publisher's secret: "
                "give secret= (the relay's ?secret=), or unsigned=True if every request "
                "is authenticated before it reaches the receiver"
                if secret is None
                else "secret= and unsigned=True contradict each other: give one"
            )
        self.consumer = consumer
        self.secret = secret
        self.tolerance = tolerance
        self.max_body_size = max_body_size
        self.max_batch_events = max_batch_events
        self.max_attempts = max_attempts
        #: Requests refused as unreadable or too large (400, 413), and for their
        #: signature (401).
        self.rejected = 0
        self.unauthorized = 0
        #: Requests answered 500 because a handler raised (the publisher resends them).
        self.retried = 0

    async def handle(
        self, method: str, headers: Headers, body: bytes, *, path: str = ""
    ) -> tuple[int, bytes]:
        """Process one request; return the status and a (JSON) body to answer with."""
        method = method.upper()
        if method == "HEAD":
            return 200, b""
        if method != "POST":
            return _answer(405, error="webhooks are POSTed")
        if len(body) > self.max_body_size:
            return self._too_large()
        received = normalise_headers(headers)
        if self.secret is not None:
            try:
                received = self._signed(self.secret, received, body)
            except SignatureError as error:
                self.unauthorized += 1
                logger.warning("refused a webhook request: %s", error,
                               extra={"action": "webhook_unauthorized"})  # fmt: skip
                return _answer(401, error=str(error))
        try:
            messages = decode_request(received, body, path=path, max_events=self.max_batch_events)
        except EnvelopeError as error:
            self.rejected += 1
            logger.error("rejected an unreadable webhook request: %s", error,
                         extra={"action": "envelope_rejected"})  # fmt: skip
            return _answer(400, error=str(error))
        return await self._process(messages)

    def _signed(self, secret: str, received: dict[str, str], body: bytes) -> dict[str, str]:
        """The request's headers that its signature covers; raises `SignatureError`
        when it has no valid one, or one that leaves out a header that decides how the
        request is read."""
        signed = verify_signature(secret, received, body, tolerance=self.tolerance)
        unsigned = sorted(
            name
            for name in received
            if name not in signed and (name.startswith(PREFIX) or name in _DECISIVE_HEADERS)
        )
        if unsigned:
            raise SignatureError(f"the signature does not cover the headers {', '.join(unsigned)}")
        return {name: value for name, value in received.items() if name in signed}

    async def _process(self, messages: list[Incoming]) -> tuple[int, bytes]:
        applied = duplicates = parked = 0
        for message in messages:
            try:
                outcome = await self.consumer.process(message, max_attempts=self.max_attempts)
            except asyncio.CancelledError:
                raise
            except Exception:  # the handler's error: rolled back; the publisher resends
                self.retried += 1
                logger.exception(
                    "handler failed for %s; the publisher will send it again", message.id,
                    extra={"action": "handler_failed", "message_id": message.id},
                )  # fmt: skip
                return _answer(500, error=f"processing {message.id} failed; send it again",
                               applied=applied, duplicates=duplicates)  # fmt: skip
            applied += outcome is Processed.APPLIED
            duplicates += outcome is Processed.DUPLICATE
            parked += outcome is Processed.PARKED
        return _answer(200, received=len(messages), applied=applied, duplicates=duplicates,
                       parked=parked)  # fmt: skip

    def _too_large(self) -> tuple[int, bytes]:
        self.rejected += 1
        logger.error("refused a webhook request over max_body_size=%d bytes", self.max_body_size,
                     extra={"action": "envelope_rejected"})  # fmt: skip
        return _answer(413, error=f"request body over {self.max_body_size} bytes")

    # -- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI 3 application: HTTP requests go to `handle`; lifespan is accepted."""
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self.consumer)
            return
        if scope["type"] != "http":
            raise RuntimeError(f"WebhookReceiver serves HTTP, not {scope['type']}")
        headers = scope.get("headers", [])
        if _declared_length(headers) > self.max_body_size:
            await _respond(send, *self._too_large())  # refused before a byte is read
            return
        body = bytearray()
        while True:
            event = await receive()
            if event["type"] == "http.disconnect":
                return  # the client went away before sending it all: nothing to answer
            body += event.get("body", b"")
            if len(body) > self.max_body_size:
                await _respond(send, *self._too_large())
                return
            if not event.get("more_body", False):
                break
        status, answer = await self.handle(
            scope["method"], headers, bytes(body), path=scope.get("path", "")
        )
        await _respond(send, status, answer)


def _declared_length(headers: Iterable[tuple[bytes, bytes]]) -> int:
    """The request's Content-Length, or 0 when it has none (chunked) or a bad one."""
    for name, value in headers:
        if name.lower() == b"content-length" and value.isdigit() and len(value) <= 18:
            return int(value)
    return 0


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if body:
        headers.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send, consumer: Processor) -> None:
    """Requested replays are applied while the application runs."""
    replays = asyncio.create_task(consumer.maintain(), name="relaybox-replays")
    try:
        while True:
            event = await receive()
            if event["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif event["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    finally:
        replays.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await replays
