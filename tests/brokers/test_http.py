"""The webhook publisher against a local HTTP/1.1 server the tests start themselves.

The "broker" is `WebhookServer`: a minimal keep-alive HTTP/1.1 server on asyncio
streams that keeps every POST it answered with a 2xx, per `Relaybox-Topic` header. It
refuses (422) a message keyed "poison". Stopping it closes the listening socket and
every open connection, so a publisher sees refused connections, as with a dead host;
what it recorded lives on in the harness, so a restart loses nothing (persistent).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable

import pytest

from relaybox.consumers.http import decode_request
from relaybox.core import envelope
from relaybox.core.publishing import Outcome, PublisherFeatures
from relaybox.core.records import StoredMessage
from relaybox.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    EnvelopeError,
    SignatureError,
)
from relaybox.publishers import http, open_publisher
from relaybox.publishers.webhook_signature import SIGNATURE_HEADER, verify_signature
from tests.brokers.conformance import PublisherConformance, outcomes, started
from tests.brokers.harness import Received, RestartableHarness, free_port, stored, unique_topic

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 422: "Unprocessable Content",
            429: "Too Many Requests", 503: "Service Unavailable"}  # fmt: skip


@dataclasses.dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclasses.dataclass
class Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    delay: float = 0.0
    #: Hold the answer (before its `delay`) until this many requests are being answered
    #: at once, so that a client's concurrency shows whatever the machine's speed; after
    #: CROWD_WAIT seconds without such a crowd, no request waits for one any more.
    crowd: int = 0


CROWD_WAIT = 5.0  # under the publisher's own 10 s timeout


def default_response(request: Request) -> Response:
    subjects = {r.attributes.get("subject") for r in received_from(request)}
    if request.method == "POST" and "poison" in subjects:
        return Response(422, b'{"error": "poison message"}')
    return Response(200)


class WebhookServer:
    def __init__(self, respond: Callable[[Request], Response] = default_response) -> None:
        self.port = free_port()
        self.respond = respond
        #: Every POST answered with a 2xx, in arrival order.
        self.accepted: list[Request] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.crowded = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task, writer in list(self._connections.items()):
            writer.close()
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            while (request := await _read_request(reader)) is not None:
                writer.write(await self._answer(request))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # stop(): end quietly (3.11's streams log a cancelled handler as an error)
        finally:
            self._connections.pop(task, None)
            writer.close()

    async def _answer(self, request: Request) -> bytes:
        response = self.respond(request)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if response.crowd:
                await self._wait_for_a_crowd(response.crowd)
            await asyncio.sleep(response.delay)
        finally:
            self.in_flight -= 1
        if request.method == "POST" and 200 <= response.status < 300:
            self.accepted.append(request)
        head = [f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Status')}"]
        headers = {"Content-Length": str(len(response.body)), **response.headers}
        head += [f"{name}: {value}" for name, value in headers.items()]
        body = b"" if request.method == "HEAD" else response.body
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body

    async def _wait_for_a_crowd(self, size: int) -> None:
        if self.in_flight >= size:
            self.crowded.set()
        try:
            await asyncio.wait_for(self.crowded.wait(), CROWD_WAIT)
        except TimeoutError:
            self.crowded.set()  # none came: let the rest through (the test sees the peak)


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    line = await reader.readline()
    if not line:
        return None
    method, path, _ = line.decode("ascii").split(" ", 2)
    headers: dict[str, str] = {}
    while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = header.decode("utf-8").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Request(method, path, headers, body)


def received_from(request: Request) -> list[Received]:
    """What relaybox's webhook receiver decodes from a request: one message (binary
    mode) or a batch's; nothing from a request that carries no envelope (a HEAD)."""
    try:
        messages = decode_request(request.headers, request.body, path=request.path)
    except EnvelopeError:
        return []
    return [Received.of(m) for m in messages]


class HttpHarness(RestartableHarness):
    features = PublisherFeatures(deduplicates=False, batching=True)
    persistent = True

    def __init__(self, server: WebhookServer) -> None:
        self.server = server
        self.url = f"http://127.0.0.1:{server.port}/hooks/relaybox"

    async def prepare(self, topic: str) -> None:
        return None  # every topic is routable: the server keeps whatever it accepts

    async def received(self, topic: str) -> list[Received]:
        return [
            message
            for request in self.server.accepted
            if request.headers.get(http.TOPIC_HEADER.lower()) == topic
            for message in received_from(request)
        ]

    def rejected(self, topic: str) -> StoredMessage:
        return stored(topic, key="poison")

    def throwaway(self) -> contextlib.AbstractAsyncContextManager[RestartableHarness]:
        return webhook_harness()

    async def stop(self) -> None:
        await self.server.stop()

    async def start(self) -> None:
        await self.server.start()


@contextlib.asynccontextmanager
async def webhook_harness(
    respond: Callable[[Request], Response] = default_response,
) -> AsyncIterator[HttpHarness]:
    server = WebhookServer(respond)
    await server.start()
    try:
        yield HttpHarness(server)
    finally:
        await server.stop()


class TestHttpPublisher(PublisherConformance):
    def open_harness(self) -> contextlib.AbstractAsyncContextManager[HttpHarness]:
        return webhook_harness()


# Webhook-specific behaviour.


async def _publish_to(
    respond: Callable[[Request], Response], messages: list[StoredMessage], **options: str
) -> tuple[list[Outcome], list[str | None], HttpHarness]:
    async with webhook_harness(respond) as harness:
        publisher = harness.publisher(**options)
        async with started(publisher):
            results = await publisher.publish(messages)
    return outcomes(results), [r.error for r in results], harness


async def test_signs_every_request_so_the_receiver_can_verify_it() -> None:
    topic = unique_topic()
    message = stored(topic, headers={"app": "shop"})
    got, _, harness = await _publish_to(default_response, [message], secret="s3cret")
    assert got == [Outcome.ACKED]
    (request,) = harness.server.accepted
    headers, body = request.headers, request.body
    signed = verify_signature("s3cret", headers, body)
    attributes = {f"ce-{name}" for name in envelope.attributes(message)}
    assert signed == attributes | {"content-type", "relaybox-topic", "app"}
    for wrong in (
        lambda: verify_signature("wrong", headers, body),
        lambda: verify_signature("s3cret", headers, body + b" "),
        lambda: verify_signature("s3cret", headers, body, now=time.time() + 301),
        lambda: verify_signature("s3cret", {**headers, "ce-type": "other"}, body),
        lambda: verify_signature("s3cret", {**headers, "relaybox-signature": "v1=abc"}, body),
    ):
        with pytest.raises(SignatureError):
            wrong()


async def test_unsigned_without_a_secret() -> None:
    _, _, harness = await _publish_to(default_response, [stored(unique_topic())])
    assert SIGNATURE_HEADER.lower() not in harness.server.accepted[0].headers


def _status_by_key(request: Request) -> Response:
    status = int(request.headers.get("ce-subject", "s200")[1:])
    headers = {"Retry-After": "7"} if status == 429 else {}
    return Response(status, b"nope: " + b"x" * 500, headers)


async def test_classifies_statuses() -> None:
    topic = unique_topic()
    keys = ["s200", "s429", "s503", "s408", "s400", "s404", "s422"]
    got, errors, _ = await _publish_to(_status_by_key, [stored(topic, key=k) for k in keys])
    T, P = Outcome.TRANSIENT, Outcome.PERMANENT
    assert got == [Outcome.ACKED, T, T, T, P, P, P]
    assert "429" in (errors[1] or "")
    assert "Retry-After: 7" in (errors[1] or "")
    assert (errors[4] or "").startswith("webhook answered 400 Bad Request: nope: xxx")
    assert len(errors[4] or "") < 300


async def test_a_slow_receiver_times_out_transiently() -> None:
    # The receiver answers after 60 s; the publisher's own 0.3 s timeout must end the
    # call. Its error names that timeout, and a call that waited for the answer fails
    # at the bound, half the receiver's delay, which a busy machine never comes near.
    def slow(request: Request) -> Response:
        return Response(200, delay=60.0 if request.method == "POST" else 0.0)

    async with asyncio.timeout(30):
        got, errors, _ = await _publish_to(slow, [stored(unique_topic())], timeout="0.3")
    assert got == [Outcome.TRANSIENT]
    assert "timed out after 0.3 s" in (errors[0] or "")


async def test_batch_mode_posts_a_structured_batch_per_topic() -> None:
    first, second = unique_topic(), unique_topic()
    messages = [
        stored(first, key="a", payload=b'{"n": 1}'),
        stored(second, key="b", payload=b"\x00\xff", content_type="application/octet-stream"),
        stored(first, key="c", payload=b'{"n": 2}', headers={"app": "shop"}),
    ]
    got, _, harness = await _publish_to(default_response, messages, batch="true")
    assert got == [Outcome.ACKED] * 3
    requests = harness.server.accepted
    assert len(requests) == 2
    assert {r.headers["content-type"] for r in requests} == {http.BATCH_CONTENT_TYPE}
    events = json.loads(next(r for r in requests if r.headers["relaybox-topic"] == first).body)
    assert [e["data"] for e in events] == [{"n": 1}, {"n": 2}]
    assert [e["id"] for e in events] == [str(messages[0].id), str(messages[2].id)]
    assert events[0]["specversion"] == "1.0"
    assert events[0]["subject"] == "a"
    (binary,) = await harness.received(second)
    assert binary.payload == b"\x00\xff"
    assert binary.content_type == "application/octet-stream"


async def test_a_refused_batch_fails_all_its_messages() -> None:
    topic = unique_topic()
    messages = [stored(topic, key="ok"), stored(topic, key="poison")]
    got, errors, _ = await _publish_to(default_response, messages, batch="true")
    assert got == [Outcome.PERMANENT] * 2
    assert "422" in (errors[0] or "")


async def test_non_ascii_attributes_are_percent_encoded() -> None:
    topic = unique_topic()
    message = stored(topic, tenant_id='café "100%" ü', headers={"name": "naïve"})
    async with webhook_harness() as harness:
        async with started(harness.publisher()) as publisher:
            assert outcomes(await publisher.publish([message])) == [Outcome.ACKED]
        (got,) = await harness.received(topic)
    assert harness.server.accepted[0].headers["ce-tenantid"].isascii()
    assert got.attributes["tenantid"] == 'café "100%" ü'
    assert got.headers["name"] == "naïve"


@pytest.mark.parametrize("batch", ["false", "true"])
async def test_a_message_header_posing_as_an_attribute_or_the_topic_is_never_sent(
    batch: str,
) -> None:
    topic = unique_topic()
    posing = [stored(topic, headers={name: "forged"}) for name in ("ce-id", "relaybox-topic")]
    good = stored(topic, headers={"app": "shop"})
    async with webhook_harness() as harness:
        async with started(harness.publisher(batch=batch)) as publisher:
            results = await publisher.publish([posing[0], good, posing[1]])
        assert outcomes(results) == [Outcome.PERMANENT, Outcome.ACKED, Outcome.PERMANENT]
        (got,) = await harness.received(topic)
    assert got.id == str(good.id)


async def test_start_fails_clearly_when_nothing_listens() -> None:
    publisher = open_publisher(f"http://127.0.0.1:{free_port()}/hook")
    with pytest.raises(BrokerUnavailableError, match="cannot reach the webhook"):
        await publisher.start()


def test_reads_its_options() -> None:
    url = "https://u:pw@hooks.example/in?secret=s&batch=yes&concurrency=4&timeout=2.5"
    publisher = open_publisher(url)
    assert isinstance(publisher, http.HttpPublisher)
    assert publisher.url == "https://hooks.example/in"  # the credentials go apart
    assert publisher._auth is not None
    assert publisher._secret == "s"
    assert publisher._batch is True
    assert publisher._concurrency == 4
    assert publisher._timeout == 2.5
    assert "pw" not in publisher._display


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("http://h/x?concurrency=0", "at least 1"),
        ("http://h/x?batch=maybe", "true or false"),
        ("http://h/x?token=1", "unknown http:// options: token"),
        ("http:///x", "has no host"),
        ("http://h/x?secret=", "secret is empty"),
        ("http://h/x?max_batch_events=0", "at least 1"),
    ],
)
def test_rejects_bad_urls(url: str, error: str) -> None:
    with pytest.raises(ConfigurationError, match=error):
        open_publisher(url)


async def test_concurrency_bounds_requests_in_flight() -> None:
    batch = [stored(unique_topic(), key=f"k{n}") for n in range(40)]

    # The first answers wait until five requests are in at once: a publisher that sends
    # five together reaches the peak even when a busy machine slows it down between
    # requests, and one that sends more shows them in that first crowd.
    def respond(request: Request) -> Response:
        return Response(200, delay=0.05, crowd=5 if request.method == "POST" else 0)

    got, _, harness = await _publish_to(respond, batch, concurrency="5")
    assert got == [Outcome.ACKED] * 40
    assert harness.server.peak_in_flight == 5
