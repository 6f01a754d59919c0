"""WebhookReceiver fed by relaybox's own HTTP publisher, with the inbox on PostgreSQL.

`ReceiverServer` is the small keep-alive HTTP/1.1 server of tests/brokers/test_http.py,
except that its answers come from `WebhookReceiver.handle`. A webhook has no broker
that redelivers: the publisher does, for a transient failure (5xx, a dropped
connection), the next time the relay publishes. `deliver` plays that relay: it
publishes again what came back transient, until everything is acknowledged.
"""

from __future__ import annotations

import asyncio
import base64
import http
import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from relaybox.consumers.http import WebhookReceiver, decode_request
from relaybox.core import envelope
from relaybox.core.incoming import Incoming
from relaybox.core.publishing import Outcome
from relaybox.core.records import StoredMessage
from relaybox.errors import ConfigurationError, EnvelopeError
from relaybox.ports import Publisher
from relaybox.publishers import http as http_publisher
from relaybox.publishers import open_publisher
from tests.brokers.conformance import outcomes, started
from tests.brokers.harness import free_port, stored, unique_topic
from tests.brokers.test_http import _read_request
from tests.consumers.conformance import (
    Run,
    check_one_applied_while_the_other_waited,
    failing_once,
    idle_consumer,
    timed,
)
from tests.inbox.support import InboxWorld, wait_until


class ReceiverServer:
    """HTTP/1.1 on asyncio streams; every request goes to `receiver.handle`."""

    def __init__(self, receiver: WebhookReceiver) -> None:
        self.port = free_port()
        self.receiver = receiver
        self.url = f"http://127.0.0.1:{self.port}/hooks/orders"
        #: The status `handle` returned for each POST, in order.
        self.statuses: list[int] = []
        #: POSTs to process and then answer by closing the connection (a crash
        #: after the commit, before the response).
        self.drop_responses = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> ReceiverServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._connections):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            while (request := await _read_request(reader)) is not None:
                status, body = await self.receiver.handle(
                    request.method, request.headers, request.body, path=request.path
                )
                if request.method == "POST":
                    self.statuses.append(status)
                    if self.drop_responses:
                        self.drop_responses -= 1
                        return  # committed, and gone before answering
                phrase = http.HTTPStatus(status).phrase
                head = f"HTTP/1.1 {status} {phrase}\r\nContent-Length: {len(body)}\r\n\r\n"
                writer.write(head.encode() + (b"" if request.method == "HEAD" else body))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._connections.discard(writer)
            writer.close()


async def deliver(
    publisher: Publisher, messages: Sequence[StoredMessage], rounds: int = 5
) -> list[list[Outcome]]:
    """Publish; publish again what was transient (as the relay would), up to `rounds`."""
    history: list[list[Outcome]] = []
    pending = list(messages)
    while pending and len(history) < rounds:
        got = outcomes(await publisher.publish(pending))
        history.append(got)
        pending = [m for m, o in zip(pending, got, strict=True) if o is Outcome.TRANSIENT]
    return history


def publisher_for(server: ReceiverServer, **options: str) -> Publisher:
    query = "&".join(f"{name}={value}" for name, value in options.items())
    return open_publisher(server.url + (f"?{query}" if query else ""))


A, T = Outcome.ACKED, Outcome.TRANSIENT


# -- acceptance -------------------------------------------------------------------------


async def test_a_batch_is_applied_once_per_message_in_order(world: InboxWorld) -> None:
    topic = unique_topic()
    seen: dict[str, list[str]] = {}

    async def record(message: Incoming) -> None:
        assert message.key is not None
        seen.setdefault(message.key, []).append(message.id)

    messages = [stored(topic, key=f"key-{n % 3}", payload=b'{"n": %d}' % n) for n in range(12)]
    consumer = world.consumer(before_effect=record)
    async with (
        ReceiverServer(WebhookReceiver(consumer, unsigned=True)) as server,
        started(publisher_for(server, batch="true")) as publisher,
    ):
        assert await deliver(publisher, messages) == [[A] * 12]
    assert server.statuses == [200]  # one request carried them all
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert (consumer.applied, consumer.duplicates) == (12, 0)
    published: dict[str, list[str]] = {}
    for m in messages:
        published.setdefault(m.key or "", []).append(str(m.id))
    assert seen == published


async def test_binary_mode_requests_are_decoded_and_applied_once(world: InboxWorld) -> None:
    topic = unique_topic()
    received: list[Incoming] = []

    async def record(message: Incoming) -> None:
        received.append(message)

    special = stored(topic, key="k 1", tenant_id='café "100%" ü', headers={"app": "naïve"},
                     correlation_id="corr-1")  # fmt: skip
    binary = stored(
        topic, key="k2", payload=b"\xff\xfe\x01", content_type="application/octet-stream"
    )
    consumer = world.consumer(before_effect=record)
    async with (
        ReceiverServer(WebhookReceiver(consumer, unsigned=True)) as server,
        started(publisher_for(server, source="shop")) as publisher,
    ):
        assert await deliver(publisher, [special, binary]) == [[A, A]]
    assert world.effects() == {str(special.id): 1, str(binary.id): 1}
    got = {m.id: m for m in received}
    first = got[str(special.id)]
    assert first.tenant_id == 'café "100%" ü'
    assert first.key == "k 1"
    assert first.source == "shop"
    assert first.correlation_id == "corr-1"
    assert first.topic == topic
    assert first.headers == {"app": "naïve"}
    assert first.content_type == "application/json"
    assert first.sequence == special.seq
    assert dict(first.attributes) == envelope.attributes(special, "shop")
    second = got[str(binary.id)]
    assert second.payload == b"\xff\xfe\x01"
    assert second.content_type == "application/octet-stream"


async def test_a_second_copy_is_a_duplicate_and_acknowledged(world: InboxWorld) -> None:
    message = stored(unique_topic())
    consumer = world.consumer()
    async with (
        ReceiverServer(WebhookReceiver(consumer, unsigned=True)) as server,
        started(publisher_for(server)) as publisher,
    ):
        assert await deliver(publisher, [message]) == [[A]]
        assert await deliver(publisher, [message]) == [[A]]  # published again
    assert server.statuses == [200, 200]
    assert world.effects() == {str(message.id): 1}
    assert (consumer.applied, consumer.duplicates) == (1, 1)


async def test_a_failed_handler_makes_the_publisher_resend_the_batch(world: InboxWorld) -> None:
    topic = unique_topic()
    messages = [stored(topic, key="k") for _ in range(3)]
    flaky = str(messages[1].id)
    attempts: list[str] = []
    consumer = world.consumer(before_effect=failing_once(flaky, attempts))
    receiver = WebhookReceiver(consumer, unsigned=True)
    async with (
        ReceiverServer(receiver) as server,
        started(publisher_for(server, batch="true")) as publisher,
    ):
        assert await deliver(publisher, messages) == [[T, T, T], [A, A, A]]
    assert server.statuses == [500, 200]
    assert receiver.retried == 1
    assert world.effects() == {str(m.id): 1 for m in messages}
    # The first message committed before the failure: a duplicate in the resent batch.
    assert (consumer.applied, consumer.duplicates) == (3, 1)
    ids = [str(m.id) for m in messages]
    assert attempts == [ids[0], flaky, flaky, ids[2]]


async def test_a_failed_handler_in_binary_mode_is_resent(world: InboxWorld) -> None:
    message = stored(unique_topic())
    calls: list[str] = []

    async def fail_once(incoming: Incoming) -> None:
        calls.append(incoming.id)
        if len(calls) == 1:
            raise RuntimeError("database said no")

    consumer = world.consumer(before_effect=fail_once)
    async with (
        ReceiverServer(WebhookReceiver(consumer, unsigned=True)) as server,
        started(publisher_for(server)) as publisher,
    ):
        assert await deliver(publisher, [message]) == [[T], [A]]
    assert server.statuses == [500, 200]
    assert world.effects() == {str(message.id): 1}
    assert (consumer.applied, consumer.duplicates) == (1, 0)


async def test_a_message_that_always_fails_is_parked_and_the_publisher_stops(
    world: InboxWorld,
) -> None:
    """The publisher's resends are the attempts, counted in the database: the last one
    parks the message and is answered 200, so the relay stops sending it."""
    message, other = stored(unique_topic()), stored(unique_topic())

    async def always_fail(incoming: Incoming) -> None:
        if incoming.id == str(message.id):
            raise RuntimeError("this message always fails")

    consumer = world.consumer(before_effect=always_fail)
    async with (
        ReceiverServer(WebhookReceiver(consumer, max_attempts=3, unsigned=True)) as server,
        started(publisher_for(server)) as publisher,
    ):
        assert await deliver(publisher, [message]) == [[T], [T], [A]]
        assert await deliver(publisher, [other]) == [[A]]
    assert server.statuses == [500, 500, 200, 200]
    assert (consumer.applied, consumer.parked) == (1, 1)
    assert world.effects() == {str(other.id): 1}
    ((message_id, reason, attempts, _, payload, _),) = world.parked()
    assert (message_id, reason, attempts, payload) == (str(message.id), "failed", 3,
                                                      message.payload)  # fmt: skip


async def test_a_crash_after_commit_before_the_response_is_resent_as_a_duplicate(
    world: InboxWorld,
) -> None:
    message = stored(unique_topic())
    consumer = world.consumer()
    async with ReceiverServer(WebhookReceiver(consumer, unsigned=True)) as server:
        server.drop_responses = 1
        async with started(publisher_for(server)) as publisher:
            first = await publisher.publish([message])
            assert outcomes(first) == [T]  # the connection closed: no response
            assert world.effects() == {str(message.id): 1}  # but it was committed
            assert await deliver(publisher, [message]) == [[A]]
    assert server.statuses == [200, 200]
    assert world.effects() == {str(message.id): 1}
    assert (consumer.applied, consumer.duplicates) == (1, 1)


async def test_two_receivers_racing_on_one_message_apply_it_once(world: InboxWorld) -> None:
    runs: list[Run] = []
    begun: list[str] = []

    async def hold(message: Incoming) -> None:
        # The first copy's transaction stays open until the other copy came in too,
        # however slowly it comes: the two race whatever the machine's speed.
        await wait_until(lambda: len(begun) == 2, timeout=30)

    message = stored(unique_topic())
    one = WebhookReceiver(
        timed(world.consumer(before_effect=hold), "one", runs, begun), unsigned=True
    )
    two = WebhookReceiver(
        timed(world.consumer(before_effect=hold), "two", runs, begun), unsigned=True
    )
    # Two instances of the receiving service behind a load balancer, each sent a copy.
    async with (
        ReceiverServer(one) as first,
        ReceiverServer(two) as second,
        started(publisher_for(first)) as p1,
        started(publisher_for(second)) as p2,
    ):
        results = await asyncio.gather(deliver(p1, [message]), deliver(p2, [message]))
    assert results == [[[A]], [[A]]]
    assert world.effects() == {str(message.id): 1}
    check_one_applied_while_the_other_waited(runs)


async def test_an_unreadable_request_is_refused_for_good_and_blocks_nothing(
    world: InboxWorld,
) -> None:
    topic = unique_topic()
    good = stored(topic)
    half_bad = [envelope.structured(stored(topic)), {"specversion": "1.0", "type": "x"}]
    consumer = world.consumer()
    receiver = WebhookReceiver(consumer, unsigned=True)
    async with ReceiverServer(receiver) as server:
        async with httpx.AsyncClient() as client:
            no_id = await client.post(server.url, content=b"{}", headers={"ce-type": "x"})
            batch = {"content-type": http_publisher.BATCH_CONTENT_TYPE}
            not_json = await client.post(server.url, content=b"[1,", headers=batch)
            bad_batch = await client.post(server.url, json=half_bad, headers=batch)
        assert [no_id.status_code, not_json.status_code, bad_batch.status_code] == [400] * 3
        assert "no CloudEvents id" in no_id.json()["error"]
        # The publisher takes a 400 as permanent: never resent. The next message passes.
        refusal = http_publisher.classify(no_id)
        assert refusal.outcome is Outcome.PERMANENT
        async with started(publisher_for(server)) as publisher:
            assert await deliver(publisher, [good]) == [[A]]
    assert receiver.rejected == 3
    assert world.effects() == {str(good.id): 1}  # nothing of the bad batch was applied
    assert consumer.applied == 1


async def test_with_a_secret_only_signed_requests_are_processed(world: InboxWorld) -> None:
    topic = unique_topic()
    signed, forged = stored(topic), stored(topic)
    consumer = world.consumer()
    receiver = WebhookReceiver(consumer, secret="s3cret")
    async with ReceiverServer(receiver) as server:
        async with started(publisher_for(server, secret="s3cret")) as publisher:
            assert await deliver(publisher, [signed]) == [[A]]
        async with started(publisher_for(server, secret="guess")) as publisher:
            assert await deliver(publisher, [forged]) == [[Outcome.PERMANENT]]
        async with started(publisher_for(server)) as publisher:  # unsigned
            assert await deliver(publisher, [forged]) == [[Outcome.PERMANENT]]
    assert server.statuses == [200, 401, 401]
    assert receiver.unauthorized == 2
    assert world.effects() == {str(signed.id): 1}


async def test_a_structured_event_is_decoded(world: InboxWorld) -> None:
    topic = unique_topic()
    text = stored(topic, payload=b"plain", content_type="text/plain", tenant_id="t")
    received: list[Incoming] = []

    async def record(message: Incoming) -> None:
        received.append(message)

    receiver = WebhookReceiver(world.consumer(before_effect=record), unsigned=True)
    async with ReceiverServer(receiver) as server, httpx.AsyncClient() as client:
        response = await client.post(
            server.url, content=json.dumps(envelope.structured(text)).encode(),
            headers={"content-type": "application/cloudevents+json; charset=utf-8",
                     http_publisher.TOPIC_HEADER: topic},
        )  # fmt: skip
    assert response.status_code == 200
    assert response.json() == {"received": 1, "applied": 1, "duplicates": 0, "parked": 0}
    (got,) = received
    assert got.id == str(text.id)
    assert got.payload == b"plain"
    assert got.content_type == "text/plain"
    assert got.tenant_id == "t"
    assert got.topic == topic


# -- the ASGI adapter ---------------------------------------------------------------------


async def test_the_asgi_app_takes_what_the_publisher_sends(world: InboxWorld) -> None:
    topic = unique_topic()
    messages = [stored(topic, key="k"), stored(topic, key="k")]
    consumer = world.consumer()
    receiver = WebhookReceiver(consumer, secret="s3cret")
    transport = httpx.ASGITransport(app=receiver)
    for batch in ("false", "true"):
        publisher = open_publisher(f"http://testserver/hooks/orders?secret=s3cret&batch={batch}")
        assert isinstance(publisher, http_publisher.HttpPublisher)
        # The publisher's own requests, through httpx's in-process ASGI transport.
        publisher._client = httpx.AsyncClient(transport=transport)
        try:
            assert await deliver(publisher, messages) == [[A, A]]
        finally:
            await publisher.close()
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert (consumer.applied, consumer.duplicates) == (2, 2)


async def test_the_asgi_app_answers_other_requests(world: InboxWorld) -> None:
    consumer = world.consumer()
    receiver = WebhookReceiver(consumer, max_body_size=1000, unsigned=True)
    message = stored(unique_topic())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=receiver), base_url="http://testserver"
    ) as client:
        assert (await client.head("/hooks")).status_code == 200
        assert (await client.get("/hooks")).status_code == 405
        assert (await client.post("/hooks", content=b"x" * 1001)).status_code == 413
        unreadable = await client.post("/hooks", content=b"{}")
        assert unreadable.status_code == 400
        assert unreadable.headers["content-type"] == "application/json"
        headers = {"content-type": "application/json", "ce-id": str(message.id),
                   "ce-specversion": "1.0", "ce-source": "relaybox"}  # fmt: skip
        ok = await client.post("/hooks/orders", content=b'{"n": 1}', headers=headers)
        assert ok.status_code == 200
        assert ok.json() == {"received": 1, "applied": 1, "duplicates": 0, "parked": 0}
    assert world.effects() == {str(message.id): 1}


async def test_the_asgi_app_handles_lifespan() -> None:
    receiver = WebhookReceiver(idle_consumer(), unsigned=True)
    events = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(events)

    async def send(event: Any) -> None:
        sent.append(event)

    await receiver({"type": "lifespan"}, receive, send)
    assert [e["type"] for e in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


# -- decode_request -----------------------------------------------------------------------


def test_decodes_asgi_raw_headers_and_percent_encoding() -> None:
    headers = [(b"Content-Type", b"application/json"), (b"CE-ID", b"m1"),
               (b"ce-tenantid", b"caf%C3%A9%20%22100%25%22"), (b"Relaybox-Topic", b"orders%20eu"),
               (b"X-Tag", b"a"), (b"x-tag", b"b"), (b"user-agent", b"httpx")]  # fmt: skip
    (got,) = decode_request(headers, b"{}", path="/hooks")
    assert got.id == "m1"
    assert got.tenant_id == 'café "100%"'
    assert got.topic == "orders eu"
    assert got.headers == {"x-tag": "a, b"}
    assert got.content_type == "application/json"
    (untitled,) = decode_request({"ce-id": "m2"}, b"", path="/hooks/x")
    assert untitled.topic == "/hooks/x"
    assert untitled.content_type is None


def test_decodes_structured_events_of_any_attribute_type() -> None:
    event = {"specversion": "1.0", "id": "e1", "source": "s", "type": "t", "sequence": 7,
             "flag": True, "datacontenttype": "application/json",
             "data": {"a": [1, "ü"]}}  # fmt: skip
    image = {**event, "id": "e2", "datacontenttype": "image/png", "data": None,
             "data_base64": base64.b64encode(b"\x89P").decode()}  # fmt: skip
    body = json.dumps([event, image])
    first, second = decode_request({"content-type": http_publisher.BATCH_CONTENT_TYPE},
                                   body.encode())  # fmt: skip
    assert first.payload == '{"a":[1,"ü"]}'.encode()
    assert first.sequence == 7
    assert first.attributes["flag"] == "true"
    assert "datacontenttype" not in first.attributes
    assert second.payload == b"\x89P"
    assert second.content_type == "image/png"
    assert decode_request({"content-type": http_publisher.BATCH_CONTENT_TYPE}, b"[]") == []


@pytest.mark.parametrize(
    ("content_type", "body", "error"),
    [(http_publisher.BATCH_CONTENT_TYPE, b'{"id": "x"}', "JSON array"),
     (http_publisher.BATCH_CONTENT_TYPE, b"[1]", "JSON object"),
     ("application/cloudevents+json", b"nope", "not JSON"),
     ("application/cloudevents+json", b'{"id": "x", "data_base64": "%%"}', "not base64"),
     ("application/cloudevents+json", b'{"type": "x"}', "no CloudEvents id"),
     ("application/json", b"{}", "no CloudEvents id")],
)  # fmt: skip
def test_refuses_what_is_no_envelope(content_type: str, body: bytes, error: str) -> None:
    with pytest.raises(EnvelopeError, match=error):
        decode_request({"content-type": content_type}, body)


def test_an_empty_secret_is_a_mistake() -> None:
    with pytest.raises(ConfigurationError, match="secret"):
        WebhookReceiver(idle_consumer(), secret="")
