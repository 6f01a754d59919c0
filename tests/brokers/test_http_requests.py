"""What the webhook publisher puts on the wire, and what it reads back: message headers
that would steer the HTTP exchange are refused, each message gets an outcome of its
own, a response is read only in part, and no secret reaches a log or an error.

The receivers are local servers on asyncio streams: `WebhookServer` of test_http.py,
and `StreamingServer` here, which answers every POST with a body that does not end.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import tracemalloc

import pytest

from relaybox.core.publishing import Outcome
from relaybox.errors import ConfigurationError
from relaybox.publishers import http, open_publisher
from tests.brokers.conformance import outcomes, started
from tests.brokers.harness import free_port, stored, unique_topic
from tests.brokers.test_http import (
    Request,
    Response,
    _publish_to,
    default_response,
    webhook_harness,
)

A, T, P = Outcome.ACKED, Outcome.TRANSIENT, Outcome.PERMANENT

#: A second request, hidden in a payload, that a desynchronised receiver would run.
SMUGGLED = b"POST /smuggled HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"


# -- message headers ----------------------------------------------------------------------


def _down_when_keyed_down(request: Request) -> Response:
    if request.headers.get("ce-subject") == "down":
        return Response(503, b"busy")
    return default_response(request)


@pytest.mark.parametrize("batch", ["false", "true"])
async def test_a_message_with_a_header_that_steers_http_is_refused_and_the_rest_go(
    batch: str,
) -> None:
    topic = unique_topic()
    refused = {
        "Transfer-Encoding": "chunked", "Content-Length": "0", "host": "other.example",
        "Connection": "close", "KEEP-ALIVE": "timeout=1", "TE": "trailers",
        "Trailer": "x", "Upgrade": "h2c", "Expect": "100-continue",
        "Content-Encoding": "gzip", "Authorization": "Bearer stolen",
        "Proxy-Authorization": "Basic eDp5", "Proxy-Connection": "close", "Cookie": "a=1",
    }  # fmt: skip
    good, down = stored(topic, key="good"), stored(topic, key="down")
    bad = [stored(topic, key=f"bad-{n}", payload=SMUGGLED, headers={name: value})
           for n, (name, value) in enumerate(refused.items())]  # fmt: skip
    messages = [good, *bad, down] if batch == "false" else [good, *bad]
    async with webhook_harness(_down_when_keyed_down) as harness:
        async with started(harness.publisher(batch=batch)) as publisher:
            results = await publisher.publish(messages)
        sent = [r for r in harness.server.accepted if r.method == "POST"]
    expected = [A, *[P] * len(bad)] + ([T] if batch == "false" else [])
    assert outcomes(results) == expected
    for result, name in zip(results[1 : 1 + len(bad)], refused, strict=True):
        assert repr(name) in (result.error or "")
    assert [r.path for r in sent] == ["/hooks/relaybox"]  # nothing smuggled through
    (request,) = sent
    own = {"host", "connection", "content-length"}  # httpx sets them from the request
    assert not set(request.headers) & ({name.lower() for name in refused} - own)
    assert request.headers["host"] == f"127.0.0.1:{harness.server.port}"
    assert request.headers["connection"] == "keep-alive"
    assert request.headers["content-length"] == str(len(request.body))


async def test_a_message_header_never_replaces_one_the_publisher_sets() -> None:
    topic = unique_topic()
    forged = {"CONTENT-TYPE": "text/evil", "User-Agent": "evil", "Accept-Encoding": "gzip",
              "Relaybox-Signature": "t=1,h=,v2=0", "CE-ID": "forged"}  # fmt: skip
    kept = stored(topic, headers={"app": "kept"})
    messages = [kept, *(stored(topic, headers={name: value}) for name, value in forged.items())]
    got, errors, harness = await _publish_to(default_response, messages, secret="s3cret")
    assert got == [A, *[P] * len(forged)]
    for n, name in enumerate(forged, start=1):
        assert repr(name) in errors[n]
    (request,) = harness.server.accepted
    assert request.headers["content-type"] == "application/json"
    assert request.headers["user-agent"].startswith("python-httpx/")
    assert request.headers["accept-encoding"] == "identity"
    assert request.headers["ce-id"] == str(kept.id)
    assert request.headers["relaybox-signature"].startswith("t=")
    assert request.headers["app"] == "kept"


# -- one outcome per message --------------------------------------------------------------


async def test_messages_that_cannot_be_sent_fail_alone_one_at_a_time() -> None:
    topic = unique_topic()
    messages = [
        stored(topic, key="first"),
        stored(topic, headers={"x-caf\u00e9": "1"}),  # no header name
        stored(topic, headers={"x-a": "line\nbreak"}),  # h11 refuses the value
        stored(topic, headers={"x-a": "\ud800"}),  # UTF-8 cannot carry it
        stored(topic, tenant_id="\udfff"),  # nor this attribute
        stored(topic, content_type="text/plain\r\nX-Injected: 1"),
        stored(topic, key="last"),
    ]
    got, errors, harness = await _publish_to(default_response, messages)
    assert got == [A, P, P, P, P, P, A]
    assert all(errors[n] for n in range(1, 6))
    subjects = sorted(r.headers["ce-subject"] for r in harness.server.accepted)
    assert subjects == ["first", "last"]  # each sent once


async def test_messages_that_cannot_be_encoded_leave_their_batch_to_the_rest() -> None:
    topic = unique_topic()
    messages = [
        stored(topic, key="first"),
        stored(topic, key="odd", payload=b'"\\ud800"'),  # JSON of text UTF-8 cannot carry
        stored(topic, correlation_id="\udfff"),
        stored(topic, key="last"),
    ]
    got, errors, harness = await _publish_to(default_response, messages, batch="true")
    assert got == [A, A, P, A]
    assert "cannot be encoded as a CloudEvent" in (errors[2] or "")
    (request,) = harness.server.accepted
    events = json.loads(request.body)
    assert [e["subject"] for e in events] == ["first", "odd", "last"]
    assert base64.b64decode(events[1]["data_base64"]) == b'"\\ud800"'  # its bytes, as stored


async def test_batches_are_split_to_stay_within_the_receivers_limits() -> None:
    topic = unique_topic()
    small = [stored(topic, key=f"k{n}", payload=b'{"n": %d}' % n) for n in range(5)]
    big = stored(topic, key="big", payload=json.dumps({"x": "y" * 5000}).encode())
    limits = {"batch": "true", "max_batch_events": "2", "max_body_size": "3000"}
    got, _, harness = await _publish_to(default_response, [*small, big], **limits)
    assert got == [A] * 6
    batches = [[e["subject"] for e in json.loads(r.body)] for r in harness.server.accepted]
    assert sorted(batches) == [["big"], ["k0", "k1"], ["k2", "k3"], ["k4"]]
    assert all(len(r.body) <= 3000 for r in harness.server.accepted if b"yyy" not in r.body)


# -- responses ----------------------------------------------------------------------------


class StreamingServer:
    """Answers each POST with the status its `ce-subject` names (s200, s503) and a
    body that never ends: fast in 64 KiB chunks, or, keyed "trickle", a byte at a time."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sent = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> StreamingServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            if head.startswith("HEAD"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
            lines = {
                name.lower(): value
                for name, _, value in (line.partition(": ") for line in head.split("\r\n")[1:])
            }
            await reader.readexactly(int(lines["content-length"]))
            key = lines["ce-subject"]
            status = 200 if key == "s200" else 503
            writer.write(f"HTTP/1.1 {status} X\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
            chunk, pause = (b"x" * 65536, 0.0) if key != "trickle" else (b"y", 0.2)
            framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
            while True:
                writer.write(framed)
                await writer.drain()
                self.sent += len(chunk)
                await asyncio.sleep(pause)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)


async def test_a_response_that_never_ends_is_read_only_in_part() -> None:
    topic = unique_topic()
    messages = [stored(topic, key="s200"), stored(topic, key="s503"),
                stored(topic, key="trickle")]  # fmt: skip
    async with StreamingServer() as server:
        publisher = open_publisher(f"http://127.0.0.1:{server.port}/hook?timeout=2")
        async with started(publisher):
            tracemalloc.start()
            began = time.monotonic()
            try:
                async with asyncio.timeout(30):
                    results = await publisher.publish(messages)
                took = time.monotonic() - began
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
        await asyncio.sleep(0.2)  # the server sees the closed connections
        sent = server.sent
    assert outcomes(results) == [A, T, T]
    assert (results[1].error or "").startswith("webhook answered 503 X: xxxx")
    assert len(results[1].error or "") < 300
    assert "webhook answered 503 X: yyy" in (results[2].error or "")  # what came in time
    assert took < 10  # the trickle held on to the 2 s timeout, no longer
    # Whatever the sockets' buffers took in: far from what a whole read would have.
    assert sent < 16 * 1024 * 1024
    assert peak < 8 * 1024 * 1024


# -- secrets ------------------------------------------------------------------------------


PASSWORD, SECRET = "pw-Qz8wx1", "sig-Hk3vb7"


def _echo_credentials(request: Request) -> Response:
    """A receiver that answers 400 with what it was sent, credentials and all."""
    if request.method == "POST" and request.headers.get("ce-subject") == "echo":
        echoed = f"refused {request.path} with {request.headers['authorization']}"
        return Response(400, echoed.encode())
    return Response(200)


async def test_no_password_or_secret_reaches_a_log_or_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    topic = unique_topic()
    async with webhook_harness(_echo_credentials) as harness:
        url = f"http://hook%40user:{PASSWORD}@127.0.0.1:{harness.server.port}/in?secret={SECRET}"
        async with started(open_publisher(url)) as publisher:
            results = await publisher.publish([stored(topic), stored(topic, key="echo")])
        accepted = harness.server.accepted
    assert outcomes(results) == [A, P]
    token = base64.b64encode(f"hook@user:{PASSWORD}".encode()).decode()
    assert accepted[0].headers["authorization"] == f"Basic {token}"  # auth still sent
    assert "refused /in with Basic ***" in (results[1].error or "")
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "HTTP Request: POST" in logged  # httpx did log each request
    for hidden in (PASSWORD, SECRET, token):
        assert hidden not in logged
        assert all(hidden not in (result.error or "") for result in results)


async def test_an_unreachable_webhook_names_no_password() -> None:
    publisher = open_publisher(f"http://u:{PASSWORD}@127.0.0.1:{free_port()}/hook")
    with pytest.raises(Exception, match="cannot reach") as raised:
        await publisher.start()
    assert PASSWORD not in str(raised.value)


def test_a_webhook_url_of_the_publisher_takes_no_query_string_or_empty_secret() -> None:
    with pytest.raises(ConfigurationError, match="query string"):
        http.HttpPublisher("http://h/x?token=1")
    with pytest.raises(ConfigurationError, match="secret is empty"):
        http.HttpPublisher("http://h/x", secret="")
