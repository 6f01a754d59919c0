"""Webhooks (httpx): each message POSTed to one URL; a 2xx response is the confirm.

    https://hooks.example.com/orders?secret=s3cret&timeout=10
    http://127.0.0.1:8080/events?batch=true&concurrency=64

Options (read from the query string, which relaybox keeps for itself: a webhook URL
cannot carry a query string of its own; put what the receiver needs in the path):
    timeout=10       seconds for each request (connect, send, and wait for the response).
    concurrency=32   requests in flight at once (and the connection pool's size).
    secret=          sign every request (see below); without it nothing is signed.
    batch=false      true: one POST per topic per publish() call, carrying the call's
                     messages as a CloudEvents JSON batch; the response applies to all.
    source=          the CloudEvents `source` (default `relaybox`).

A request follows the CloudEvents HTTP binding. One message per request (the default)
is binary mode: the body is the payload, `Content-Type` its content type, the
attributes are `ce-<name>` headers (values percent-encoded as the binding says), and
the message's own headers travel under their own names (UTF-8). A batch request has
`Content-Type: application/cloudevents-batch+json` and a JSON array of structured
events, each with `data` (JSON content types) or `data_base64` (anything else).
Every request names the message's topic in a `Relaybox-Topic` header, since
CloudEvents has no topic attribute. `user:password@` in the URL is sent as Basic auth.

Signing: with `secret`, each request carries

    Relaybox-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, f"{t}." + body)>

The receiver recomputes the HMAC over the timestamp, a dot and the raw body bytes, as
received, compares in constant time, and refuses a timestamp older than a few minutes,
so a captured request cannot be replayed later. `verify_signature` does all of that.

Results: 2xx is a confirm. 408, 429, 5xx and network errors are transient (with any
Retry-After in the error text); no response in time is transient without an attempt
counted (the receiver may have taken it); every other status (3xx, 4xx) is permanent,
its error naming the status and the start of the response body.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import urllib.parse
from collections.abc import Sequence

import httpx

from relaybox.core import envelope
from relaybox.core.publishing import (
    ACKED,
    PublisherFeatures,
    PublishResult,
    permanent,
    timed_out,
    transient,
    unavailable,
)
from relaybox.core.records import StoredMessage
from relaybox.core.urls import mask_password
from relaybox.errors import BrokerUnavailableError, ConfigurationError, InvalidHeadersError
from relaybox.publishers.options import BrokerUrl

#: The CloudEvents HTTP binding names attribute headers `ce-<name>`.
PREFIX = "ce-"
SIGNATURE_HEADER = "Relaybox-Signature"
TOPIC_HEADER = "Relaybox-Topic"
BATCH_CONTENT_TYPE = "application/cloudevents-batch+json"
#: Statuses that say "later": request timeout, too many requests (and every 5xx).
_TRANSIENT_STATUSES = frozenset({408, 429})
#: Headers this module sets itself, which a message header must not replace.
_OWN_HEADERS = frozenset({"content-type", SIGNATURE_HEADER.lower(), TOPIC_HEADER.lower()})
#: Printable ASCII but space, '"' and '%': what the binding lets through unencoded.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')


def from_url(url: BrokerUrl) -> HttpPublisher:
    return HttpPublisher(
        url.base,
        secret=url.optional_text("secret"),
        batch=url.flag("batch", False),
        concurrency=url.number("concurrency", 32, minimum=1),
        timeout=url.number("timeout", 10.0, minimum=0.01),
        source=url.source,
    )


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The `Relaybox-Signature` header value for `body`."""
    t = int(time.time()) if timestamp is None else timestamp
    return f"t={t},v1={_hmac(secret, t, body)}"


def verify_signature(
    secret: str, header: str, body: bytes, tolerance: float = 300, now: float | None = None
) -> bool:
    """Whether `header` (a `Relaybox-Signature` value) signs `body` with `secret` and was
    made within `tolerance` seconds of `now`. For receivers; pass the raw body bytes."""
    fields = [part.partition("=") for part in header.split(",")]
    timestamps = [value for name, _, value in fields if name.strip() == "t"]
    signatures = [value.strip() for name, _, value in fields if name.strip() == "v1"]
    if len(timestamps) != 1 or not timestamps[0].strip().isdigit() or not signatures:
        return False
    t = int(timestamps[0])
    if abs((time.time() if now is None else now) - t) > tolerance:
        return False
    expected = _hmac(secret, t, body)
    return any(hmac.compare_digest(expected, signature) for signature in signatures)


def _hmac(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


class HttpPublisher:
    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(
        self,
        url: str,
        *,
        secret: str | None = None,
        batch: bool = False,
        concurrency: int = 32,
        timeout: float = 10.0,
        source: str = envelope.DEFAULT_SOURCE,
    ) -> None:
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as error:
            raise ConfigurationError(f"bad webhook URL {mask_password(url)!r}: {error}") from None
        if not parsed.host:
            raise ConfigurationError(f"webhook URL {mask_password(url)!r} has no host")
        self.url = url
        self._display = mask_password(url)
        self._secret = secret
        self._batch = batch
        self._concurrency = concurrency
        self._timeout = timeout
        self._source = source
        self._slots = asyncio.Semaphore(concurrency)
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        limits = httpx.Limits(
            max_connections=self._concurrency, max_keepalive_connections=self._concurrency
        )
        self._client = httpx.AsyncClient(timeout=self._timeout, limits=limits, http2=False)
        try:  # any response at all says a server listens; HEAD has no side effects
            await self._client.head(self.url)
        except httpx.TransportError as error:
            await self.close()
            raise BrokerUnavailableError(
                f"cannot reach the webhook {self._display}: {_describe(error)}"
            ) from error

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if self._client is None:
            raise ConfigurationError("HttpPublisher.publish called before start()")
        refused = _refused(messages)
        if refused:  # each alone, never in a request: see `envelope.check_stored_headers`
            sent = iter(await self.publish([m for i, m in enumerate(messages) if i not in refused]))
            return [refused.get(i) or next(sent) for i in range(len(messages))]
        if not self._batch:
            return list(await asyncio.gather(*(self._post_one(m) for m in messages)))
        by_topic: dict[str, list[int]] = {}
        for index, message in enumerate(messages):
            by_topic.setdefault(message.topic, []).append(index)
        groups = list(by_topic.values())
        answers = await asyncio.gather(
            *(self._post_batch([messages[i] for i in group]) for group in groups)
        )
        results: list[PublishResult] = [ACKED] * len(messages)
        for group, answer in zip(groups, answers, strict=True):
            for index in group:
                results[index] = answer
        return results

    async def _post_one(self, message: StoredMessage) -> PublishResult:
        headers = [(b"Content-Type", message.content_type.encode())]
        headers += _binary_headers(message, self._source)
        return await self._post(message.topic, message.payload, headers)

    async def _post_batch(self, messages: Sequence[StoredMessage]) -> PublishResult:
        events = [envelope.structured(m, self._source) for m in messages]
        body = json.dumps(events, separators=(",", ":"), ensure_ascii=False).encode()
        headers = [(b"Content-Type", BATCH_CONTENT_TYPE.encode())]
        return await self._post(messages[0].topic, body, headers)

    async def _post(
        self, topic: str, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> PublishResult:
        assert self._client is not None
        headers.append((TOPIC_HEADER.encode(), _percent_encode(topic).encode()))
        if self._secret is not None:
            headers.append((SIGNATURE_HEADER.encode(), sign(self._secret, body).encode()))
        async with self._slots:
            try:
                response = await self._client.post(self.url, content=body, headers=headers)
            except httpx.LocalProtocolError as error:  # a header h11 will not send
                return permanent(f"webhook request refused by the HTTP client: {error}")
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:  # never sent
                return unavailable(f"webhook unreachable: {_describe(error)}")
            except httpx.TimeoutException:  # the receiver may have acted on it
                return timed_out(f"webhook timed out after {self._timeout:g} s")
            except httpx.TransportError as error:
                return transient(f"webhook connection failed: {_describe(error)}")
        return classify(response)


def classify(response: httpx.Response) -> PublishResult:
    """What a webhook's response means for the message(s) it answers."""
    status = response.status_code
    if 200 <= status < 300:
        return ACKED
    error = f"webhook answered {status} {response.reason_phrase}"
    excerpt = " ".join(response.text[:200].split())
    if excerpt:
        error += f": {excerpt}"
    if status in _TRANSIENT_STATUSES or status >= 500:
        retry_after = response.headers.get("Retry-After")
        return transient(f"{error} (Retry-After: {retry_after})" if retry_after else error)
    return permanent(error)


def _binary_headers(message: StoredMessage, source: str) -> list[tuple[bytes, bytes]]:
    attributes = envelope.attributes(message, source)
    found = [
        (f"{PREFIX}{name}".encode(), _percent_encode(v).encode()) for name, v in attributes.items()
    ]
    taken = {f"{PREFIX}{name}" for name in attributes} | _OWN_HEADERS
    own = (
        (name.encode(), value.encode())
        for name, value in message.headers.items()
        if name.lower() not in taken  # never let a header pose as an attribute
    )
    return found + list(own)


def _refused(messages: Sequence[StoredMessage]) -> dict[int, PublishResult]:
    """The messages with a header of their own that takes a name of the envelope or of
    HTTP (rows `Message` did not write), by index, each failed for good."""
    refused = {}
    for index, message in enumerate(messages):
        if message.headers:
            try:
                envelope.check_stored_headers(message)
            except InvalidHeadersError as error:
                refused[index] = permanent(str(error))
    return refused


def _percent_encode(value: str) -> str:
    return urllib.parse.quote(value, safe=_HEADER_SAFE)


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__
