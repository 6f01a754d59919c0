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
With a `secret`, a request without a valid `Relaybox-Signature` (see
`relaybox.publishers.http.verify_signature`: HMAC-SHA256 of the raw body, at most
`tolerance` seconds old) is refused with 401 before anything is decoded. `HEAD` (the
publisher's reachability check at start) answers 200; other methods but POST, 405.

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
from relaybox.core.incoming import Incoming
from relaybox.errors import ConfigurationError, EnvelopeError
from relaybox.inbox.consumer import Consumer, Processed
from relaybox.publishers.http import (
    BATCH_CONTENT_TYPE,
    PREFIX,
    SIGNATURE_HEADER,
    TOPIC_HEADER,
    verify_signature,
)

logger = logging.getLogger(__name__)

#: The structured mode's media type (one event as a JSON object).
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json"
#: Requests larger than this are refused (413) by the ASGI adapter.
DEFAULT_MAX_BODY_SIZE = 16 * 1024 * 1024

#: Headers of the transport and of the binding, not the message's own.
TRANSPORT_HEADERS = frozenset(
    {
        "accept", "accept-encoding", "authorization", "connection", "content-length",
        "content-type", "expect", "host", "keep-alive", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "user-agent",
        SIGNATURE_HEADER.lower(), TOPIC_HEADER.lower(),
    }
)  # fmt: skip

Headers = Mapping[str, str] | Iterable[tuple[str | bytes, str | bytes]]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def decode_request(headers: Headers, body: bytes, *, path: str = "") -> list[Incoming]:
    """The messages one webhook request carries, in order; raises `EnvelopeError` when
    the request, or any event of a batch, is not a readable envelope.

    `headers` is a mapping or (name, value) pairs, names in any case (str or bytes:
    ASGI's raw headers are fine); `body` the raw request body.
    """
    received = _normalise(headers)
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


def _normalise(headers: Headers) -> dict[str, str]:
    """Lower-case names; repeated headers joined with ", " (as HTTP allows)."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    found: dict[str, str] = {}
    for raw_name, raw_value in pairs:
        name = _text(raw_name).strip().lower()
        value = _text(raw_value).strip()
        found[name] = f"{found[name]}, {value}" if name in found else value
    return found


def _text(value: str | bytes) -> str:
    # The publisher sends its headers as UTF-8 (attributes percent-encoded to ASCII).
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as error:
        raise EnvelopeError(f"the request body is not JSON: {error}") from None


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

    `secret` turns on signature checks (`Relaybox-Signature`, made with the same secret
    as the publisher's `?secret=`), `tolerance` is the signature's maximum age in
    seconds, `max_body_size` the largest body the ASGI adapter reads (413 beyond),
    `max_attempts` the attempts at a message before it is parked. Under ASGI, the
    lifespan runs `Consumer.maintain` (requested replays); elsewhere, run it yourself.
    """

    def __init__(
        self,
        consumer: Consumer,
        *,
        secret: str | None = None,
        tolerance: float = 300.0,
        max_body_size: int = DEFAULT_MAX_BODY_SIZE,
        max_attempts: int = DEFAULTS.max_attempts,
    ) -> None:
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigurationError(f"max_attempts={max_attempts!r}: must be at least 1")
        if secret is not None and not secret:
            raise ConfigurationError("secret must not be empty (None: requests are unsigned)")
        self.consumer = consumer
        self.secret = secret
        self.tolerance = tolerance
        self.max_body_size = max_body_size
        self.max_attempts = max_attempts
        #: Requests refused as unreadable (400) and for their signature (401).
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
        received = _normalise(headers)
        if self.secret is not None:
            signature = received.get(SIGNATURE_HEADER.lower())
            if signature is None or not verify_signature(
                self.secret, signature, body, tolerance=self.tolerance
            ):
                self.unauthorized += 1
                logger.warning("refused a webhook request with a missing or bad signature",
                               extra={"action": "webhook_unauthorized"})  # fmt: skip
                return _answer(401, error="missing or invalid Relaybox-Signature")
        try:
            messages = decode_request(received, body, path=path)
        except EnvelopeError as error:
            self.rejected += 1
            logger.error("rejected an unreadable webhook request: %s", error,
                         extra={"action": "envelope_rejected"})  # fmt: skip
            return _answer(400, error=str(error))
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

    # -- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI 3 application: HTTP requests go to `handle`; lifespan is accepted."""
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self.consumer)
            return
        if scope["type"] != "http":
            raise RuntimeError(f"WebhookReceiver serves HTTP, not {scope['type']}")
        body = bytearray()
        while True:
            event = await receive()
            if event["type"] == "http.disconnect":
                return  # the client went away before sending it all: nothing to answer
            body += event.get("body", b"")
            if len(body) > self.max_body_size:
                await _respond(send, *_answer(413, error="request body too large"))
                return
            if not event.get("more_body", False):
                break
        status, answer = await self.handle(
            scope["method"], scope.get("headers", []), bytes(body), path=scope.get("path", "")
        )
        await _respond(send, status, answer)


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if body:
        headers.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send, consumer: Consumer) -> None:
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
