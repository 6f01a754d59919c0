"""Webhooks (httpx): each message POSTed to one URL; a 2xx response is the confirm.

    https://hooks.example.com/orders?secret=s3cret&timeout=10
    http://127.0.0.1:8080/events?batch=true&concurrency=64

Options (read from the query string, which relaybox keeps for itself: a webhook URL
cannot carry a query string of its own; put what the receiver needs in the path):
    timeout=10       seconds for each request, all told (connect, send, and the
                     response's status, headers and first bytes).
    concurrency=32   requests in flight at once (and the connection pool's size).
    secret=          sign every request (see below); without it nothing is signed. An
                     empty `secret=` is refused.
    batch=false      true: the messages of a publish() call go as CloudEvents JSON
                     batches, one POST per topic (split by the next two options); the
                     response applies to every message of its batch.
    max_body_size=2097152   bytes a batch request may carry: further events of the
                     topic go in another request (an event larger on its own goes
                     alone). The receiver's default cap (`WebhookReceiver`).
    max_batch_events=1000   events a batch request may carry (the receiver's default).
    source=          the CloudEvents `source` (default `relaybox`).
`user:password@` in the URL is sent as Basic auth, and given to httpx apart from the
URL, so that nothing httpx logs carries the password.

A request follows the CloudEvents HTTP binding. One message per request (the default)
is binary mode: the body is the payload, `Content-Type` its content type, the
attributes are `ce-<name>` headers (values percent-encoded as the binding says), and
the message's own headers travel under their own names (UTF-8). A batch request has
`Content-Type: application/cloudevents-batch+json` and a JSON array of structured
events, each with `data` (JSON content types) or `data_base64` (anything else); the
messages' own headers do not travel in a batch.
Every request names the message's topic in a `Relaybox-Topic` header, since
CloudEvents has no topic attribute.

A message's own headers never take a name the publisher or HTTP uses (`ce-*`,
`Content-*`, `Relaybox-*`, `Host`, `Connection`, `Transfer-Encoding`, `Authorization`,
`Cookie`, `Proxy-*`...): `Message` refuses such names when it is created, and a stored
row carrying one anyway fails permanently, in either mode, while the others of its call
go out as usual (`relaybox.core.envelope` holds the rule every broker shares).

Signing: with `secret`, each request carries a `Relaybox-Signature` header, an
HMAC-SHA256 over a timestamp, every header relaybox sets (the `ce-` attributes,
`Relaybox-Topic`, `Content-Type`, the message's own headers) and the body.
`relaybox.publishers.webhook_signature` defines the canonical form, for receivers in
any language, and `verify_signature` checks it; `relaybox.consumers.http` is the
receiving side.

Results, one per message: 2xx is a confirm. 408, 429, 5xx and network errors are
transient (with any Retry-After in the error text); no response in time is transient
without an attempt counted (the receiver may have taken it); every other status (3xx,
4xx) is permanent, its error naming the status and the start of the response body (of
which at most `RESPONSE_READ_LIMIT` bytes are read). A message that cannot be put into
an HTTP request (a header h11 refuses, text UTF-8 cannot carry) fails permanently on
its own; no error of one request fails another's message. No error text carries the
URL's password or the secret.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import urllib.parse
from collections.abc import Iterator, Sequence

import h11
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
from relaybox.core.urls import mask_url, scrub, url_secrets
from relaybox.errors import BrokerUnavailableError, ConfigurationError, InvalidHeadersError
from relaybox.publishers.options import BrokerUrl
from relaybox.publishers.webhook_signature import SIGNATURE_HEADER, check_secret, sign

#: The CloudEvents HTTP binding names attribute headers `ce-<name>`.
PREFIX = "ce-"
TOPIC_HEADER = "Relaybox-Topic"
BATCH_CONTENT_TYPE = "application/cloudevents-batch+json"
#: The largest request body a receiver takes by default, and a batch request's limit.
DEFAULT_MAX_BODY_SIZE = 2 * 1024 * 1024
#: The most events in one batch request, on both sides, by default.
DEFAULT_MAX_BATCH_EVENTS = 1000
#: Bytes of a response body read at most (for the error text); the rest is not read.
RESPONSE_READ_LIMIT = 4096
#: Statuses that say "later": request timeout, too many requests (and every 5xx).
_TRANSIENT_STATUSES = frozenset({408, 429})
#: The client's own headers, besides those refused above; the body is read as is.
_CLIENT_HEADERS = {"Accept": "*/*", "Accept-Encoding": "identity"}
#: Printable ASCII but space, '"' and '%': what the binding lets through unencoded.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')

Header = tuple[bytes, bytes]


def from_url(url: BrokerUrl) -> HttpPublisher:
    return HttpPublisher(
        url.base,
        secret=url.optional_text("secret"),
        batch=url.flag("batch", False),
        concurrency=url.number("concurrency", 32, minimum=1),
        timeout=url.number("timeout", 10.0, minimum=0.01),
        max_body_size=url.number("max_body_size", DEFAULT_MAX_BODY_SIZE, minimum=1),
        max_batch_events=url.number("max_batch_events", DEFAULT_MAX_BATCH_EVENTS, minimum=1),
        source=url.source,
    )


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
        max_body_size: int = DEFAULT_MAX_BODY_SIZE,
        max_batch_events: int = DEFAULT_MAX_BATCH_EVENTS,
        source: str = envelope.DEFAULT_SOURCE,
    ) -> None:
        display = mask_url(url)
        check_secret(secret)
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as error:
            raise ConfigurationError(f"bad webhook URL {display!r}: {error}") from None
        if not parsed.host:
            raise ConfigurationError(f"webhook URL {display!r} has no host")
        if parsed.query or parsed.fragment:
            raise ConfigurationError(
                f"webhook URL {display!r} has a query string or fragment: relaybox reads "
                "the query as its options; put what the receiver needs in the path"
            )
        #: The URL httpx is given: no user or password, which go as `auth`.
        self.url = str(parsed.copy_with(userinfo=b""))
        self._auth = _basic_auth(parsed)
        self._hidden = _secrets(url, parsed, secret)
        self._display = display
        self._secret = secret
        self._batch = batch
        self._concurrency = concurrency
        self._timeout = timeout
        self._max_body_size = max_body_size
        self._max_batch_events = max_batch_events
        self._source = source
        self._slots = asyncio.Semaphore(concurrency)
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        limits = httpx.Limits(
            max_connections=self._concurrency, max_keepalive_connections=self._concurrency
        )
        self._client = httpx.AsyncClient(
            timeout=self._timeout, limits=limits, http2=False, auth=self._auth,
            headers=_CLIENT_HEADERS,
        )  # fmt: skip
        try:  # any response at all says a server listens; HEAD has no side effects
            await self._client.head(self.url)
        except httpx.TransportError as error:
            await self.close()
            raise BrokerUnavailableError(
                f"cannot reach the webhook {self._display}: {self._redact(_describe(error))}"
            ) from error

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if self._client is None:
            raise ConfigurationError("HttpPublisher.publish called before start()")
        if not self._batch:
            return list(await asyncio.gather(*(self._post_one(m) for m in messages)))
        return await self._post_batches(messages)

    async def _post_one(self, message: StoredMessage) -> PublishResult:
        try:
            headers = [(b"Content-Type", message.content_type.encode())]
            headers += _binary_headers(message, self._source)
        except InvalidHeadersError as error:  # a stored row's header poses as the envelope's
            return permanent(str(error))
        except ValueError as error:  # text UTF-8 cannot carry (a lone surrogate)
            return permanent(f"message cannot be sent as an HTTP request: {error}")
        return await self._post(message.topic, message.payload, headers)

    async def _post_batches(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        """Each message's event encoded on its own, so that one which cannot be fails
        alone; the rest go in batches per topic, each answer applying to its batch."""
        results: list[PublishResult] = [ACKED] * len(messages)
        by_topic: dict[str, list[tuple[int, bytes]]] = {}
        for index, message in enumerate(messages):
            try:
                event = _event(message, self._source)
            except InvalidHeadersError as error:  # a stored row's header poses as the envelope's
                results[index] = permanent(str(error))
            except (ValueError, RecursionError) as error:
                results[index] = permanent(f"message cannot be encoded as a CloudEvent: {error}")
            else:
                by_topic.setdefault(message.topic, []).append((index, event))
        batches = [
            (topic, batch)
            for topic, events in by_topic.items()
            for batch in _batches(events, self._max_body_size, self._max_batch_events)
        ]
        answers = await asyncio.gather(*(self._post_batch(topic, b) for topic, b in batches))
        for (_, batch), answer in zip(batches, answers, strict=True):
            for index, _ in batch:
                results[index] = answer
        return results

    async def _post_batch(self, topic: str, events: list[tuple[int, bytes]]) -> PublishResult:
        body = b"[" + b",".join(event for _, event in events) + b"]"
        return await self._post(topic, body, [(b"Content-Type", BATCH_CONTENT_TYPE.encode())])

    async def _post(self, topic: str, body: bytes, headers: list[Header]) -> PublishResult:
        """One request's outcome; nothing it raises reaches another message."""
        assert self._client is not None
        try:
            headers.append((TOPIC_HEADER.encode(), _percent_encode(topic).encode()))
            if self._secret is not None:
                headers.append(
                    (SIGNATURE_HEADER.encode(), sign(self._secret, headers, body).encode())
                )
            request = self._client.build_request("POST", self.url, content=body, headers=headers)
        except Exception as error:  # noqa: BLE001 - whatever it is, this message's alone
            return permanent(self._redact(f"webhook request cannot be built: {_describe(error)}"))
        async with self._slots:
            result = await self._exchange(request)
        if result.error is None:
            return result
        return dataclasses.replace(result, error=self._redact(result.error))

    async def _exchange(self, request: httpx.Request) -> PublishResult:
        assert self._client is not None
        deadline = asyncio.get_running_loop().time() + self._timeout
        try:
            async with asyncio.timeout_at(deadline):
                response = await self._client.send(request, stream=True)
        except Exception as error:  # noqa: BLE001 - whatever it is, it is this request's
            return _failure(error, self._timeout)
        try:
            start = await _read_start(response, deadline)
        finally:
            with contextlib.suppress(httpx.HTTPError, OSError):
                await response.aclose()
        return classify(response, start)

    def _redact(self, text: str) -> str:
        return scrub(text, self._hidden)


def _failure(error: Exception, timeout: float) -> PublishResult:
    """What an exception from sending one request means for its message(s)."""
    match error:
        case httpx.LocalProtocolError() | h11.LocalProtocolError() | ValueError() | TypeError():
            # the request cannot go on the wire as it is (a header h11 will not send)
            result = permanent(f"webhook request refused by the HTTP client: {_describe(error)}")
        case httpx.ConnectError() | httpx.ConnectTimeout():  # never sent
            result = unavailable(f"webhook unreachable: {_describe(error)}")
        case httpx.TimeoutException() | TimeoutError():  # the receiver may have acted on it
            result = timed_out(f"webhook timed out after {timeout:g} s")
        case httpx.TransportError():
            result = transient(f"webhook connection failed: {_describe(error)}")
        case _:  # a client library's surprise: worth another try
            result = transient(f"webhook request failed: {type(error).__name__}: {error}")
    return result


def classify(response: httpx.Response, start: bytes = b"") -> PublishResult:
    """What a webhook's response means for the message(s) it answers; `start` is the
    start of its body, for the error text."""
    status = response.status_code
    if 200 <= status < 300:
        return ACKED
    error = f"webhook answered {status} {response.reason_phrase}"
    excerpt = " ".join(start.decode("utf-8", "replace")[:200].split())
    if excerpt and response.headers.get("Content-Encoding", "identity") == "identity":
        error += f": {excerpt}"
    if status in _TRANSIENT_STATUSES or status >= 500:
        retry_after = response.headers.get("Retry-After", "")[:64]
        return transient(f"{error} (Retry-After: {retry_after})" if retry_after else error)
    return permanent(error)


async def _read_start(response: httpx.Response, deadline: float) -> bytes:
    """Up to RESPONSE_READ_LIMIT bytes of the body, as sent, before the deadline: a
    receiver that answers on and on costs nothing more. (A body read to its end leaves
    the connection for the next request; closing one read in part drops it.)"""
    start = bytearray()
    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        async with asyncio.timeout_at(deadline):
            async for chunk in response.aiter_raw():
                start += chunk
                if len(start) >= RESPONSE_READ_LIMIT:
                    break
    return bytes(start[:RESPONSE_READ_LIMIT])


def _binary_headers(message: StoredMessage, source: str) -> list[Header]:
    attributes = envelope.attributes(message, source)
    found = [
        (f"{PREFIX}{name}".encode(), _percent_encode(v).encode()) for name, v in attributes.items()
    ]
    # `attributes` refused the message if a header of its own takes a name of the
    # envelope's, HTTP's or this module's: what is left travels as it is.
    return found + [(name.encode(), value.encode()) for name, value in message.headers.items()]


def _event(message: StoredMessage, source: str) -> bytes:
    event = envelope.structured(message, source)
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()


def _batches(
    events: list[tuple[int, bytes]], max_size: int, max_events: int
) -> Iterator[list[tuple[int, bytes]]]:
    """Consecutive runs of `events` whose JSON array stays within both limits."""
    batch: list[tuple[int, bytes]] = []
    size = 2  # the brackets
    for item in events:
        grown = size + len(item[1]) + (1 if batch else 0)
        if batch and (grown > max_size or len(batch) >= max_events):
            yield batch
            batch, grown = [], 2 + len(item[1])
        batch.append(item)
        size = grown
    if batch:
        yield batch


def _basic_auth(url: httpx.URL) -> httpx.BasicAuth | None:
    if not url.userinfo:
        return None
    return httpx.BasicAuth(url.username, url.password)


def _secrets(url: str, parsed: httpx.URL, secret: str | None) -> frozenset[str]:
    """What no error text may show: the URL's secrets (as written and decoded), the
    Basic credentials as sent, and the signing secret."""
    found = set(url_secrets(url))
    if secret:
        found.add(secret)
    if parsed.password:
        credentials = f"{parsed.username}:{parsed.password}".encode()
        found.add(base64.b64encode(credentials).decode("ascii"))
    return frozenset(found)


def _percent_encode(value: str) -> str:
    return urllib.parse.quote(value, safe=_HEADER_SAFE)


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__
