"""Signed webhooks end to end: relaybox's publisher signs, `WebhookReceiver` checks,
over HTTP on local sockets, with the inbox on PostgreSQL.

The requests are taken from the publisher by a server that only records them
(`WebhookServer` of tests/brokers/test_http.py), then sent to the receiver as an
attacker who captured them would: as they are (a duplicate the inbox skips), or with
something changed (refused, 401).
"""

from __future__ import annotations

import hashlib
import hmac
import time
import uuid

import httpx
import pytest

from relaybox.consumers.http import WebhookReceiver
from relaybox.core.incoming import Incoming
from relaybox.core.publishing import Outcome
from relaybox.core.records import StoredMessage
from relaybox.errors import ConfigurationError, SignatureError
from relaybox.publishers.webhook_signature import sign, verify_signature
from tests.brokers.conformance import outcomes, started
from tests.brokers.harness import stored, unique_topic
from tests.brokers.test_http import Request, webhook_harness
from tests.consumers.conformance import idle_consumer
from tests.consumers.test_http import ReceiverServer
from tests.inbox.support import InboxWorld

SECRET = "a-long-random-secret"
#: What the sending client adds itself; an attacker's client adds its own.
CLIENT_HEADERS = {"host", "content-length", "connection", "accept", "accept-encoding",
                  "user-agent"}  # fmt: skip

Headers = dict[str, str]


async def captured(messages: list[StoredMessage], **options: str) -> list[Request]:
    """The signed requests relaybox's publisher sends for `messages`."""
    async with webhook_harness() as harness:
        async with started(harness.publisher(secret=SECRET, **options)) as publisher:
            results = await publisher.publish(messages)
        assert outcomes(results) == [Outcome.ACKED] * len(messages)
        return list(harness.server.accepted)


async def send(server: ReceiverServer, headers: Headers, body: bytes) -> httpx.Response:
    """POST with these headers, as UTF-8."""
    raw = [(name.encode(), value.encode()) for name, value in headers.items()]
    async with httpx.AsyncClient() as client:
        return await client.post(server.url, content=body, headers=raw)


def as_sent(request: Request) -> Headers:
    return {n: v for n, v in request.headers.items() if n not in CLIENT_HEADERS}


def changed(headers: Headers, name: str, value: str | None) -> Headers:
    altered = {n: v for n, v in headers.items() if n != name}
    return altered if value is None else {**altered, name: value}


async def test_a_captured_request_is_applied_once_and_refused_when_changed(
    world: InboxWorld,
) -> None:
    topic = unique_topic()
    message = stored(topic, headers={"app": "shop"})
    (request,) = await captured([message])
    headers, body = as_sent(request), request.body
    forgeries: dict[str, tuple[Headers, bytes]] = {
        "another id": (changed(headers, "ce-id", str(uuid.uuid4())), body),
        "another type": (changed(headers, "ce-type", "order.refunded"), body),
        "another topic": (changed(headers, "relaybox-topic", "payments"), body),
        "no topic, so the path": (changed(headers, "relaybox-topic", None), body),
        "another content type": (changed(headers, "content-type", "text/plain"), body),
        "another own header": (changed(headers, "app", "admin"), body),
        "an added attribute": (changed(headers, "ce-tenantid", "someone-else"), body),
        "an added content type": (changed(headers, "ce-datacontenttype", "text/x"), body),
        "another body": (headers, b'{"n": 2}'),
        "another timestamp": (
            changed(headers, "relaybox-signature",
                    headers["relaybox-signature"].replace("t=", "t=1", 1)), body),
        "no signature": (changed(headers, "relaybox-signature", None), body),
    }  # fmt: skip
    consumer = world.consumer()
    receiver = WebhookReceiver(consumer, secret=SECRET)
    async with ReceiverServer(receiver) as server:
        first = await send(server, headers, body)
        refused = {name: await send(server, *forgery) for name, forgery in forgeries.items()}
        again = await send(server, headers, body)
    assert first.json() == {"received": 1, "applied": 1, "duplicates": 0, "parked": 0}
    assert {name: r.status_code for name, r in refused.items()} == dict.fromkeys(forgeries, 401)
    assert again.json() == {"received": 1, "applied": 0, "duplicates": 1, "parked": 0}
    assert world.effects() == {str(message.id): 1}
    assert receiver.unauthorized == len(forgeries)


async def test_a_signed_batch_is_checked_whole(world: InboxWorld) -> None:
    topic = unique_topic()
    messages = [stored(topic, key="a"), stored(topic, key="b")]
    (request,) = await captured(messages, batch="true")
    headers, body = as_sent(request), request.body
    consumer = world.consumer()
    async with ReceiverServer(WebhookReceiver(consumer, secret=SECRET)) as server:
        retopiced = await send(server, changed(headers, "relaybox-topic", "payments"), body)
        other_id = body.replace(str(messages[1].id).encode(), str(uuid.uuid4()).encode())
        reidentified = await send(server, headers, other_id)
        first = await send(server, headers, body)
        again = await send(server, headers, body)
    assert (retopiced.status_code, reidentified.status_code) == (401, 401)
    assert first.json() == {"received": 2, "applied": 2, "duplicates": 0, "parked": 0}
    assert again.json() == {"received": 2, "applied": 0, "duplicates": 2, "parked": 0}
    assert world.effects() == {str(m.id): 1 for m in messages}


async def test_handlers_see_only_signed_headers(world: InboxWorld) -> None:
    message = stored(unique_topic(), headers={"app": "shop"})
    (request,) = await captured([message])
    seen: list[Incoming] = []

    async def record(incoming: Incoming) -> None:
        seen.append(incoming)

    receiver = WebhookReceiver(world.consumer(before_effect=record), secret=SECRET)
    async with ReceiverServer(receiver) as server:
        added = {**as_sent(request), "role": "admin", "traceparent": "00-" + "1" * 32 + "-"}
        response = await send(server, added, request.body)
    assert response.status_code == 200
    (got,) = seen
    assert got.headers == {"app": "shop"}
    assert got.traceparent is None


#: A valid-looking digest, so only the part under test is wrong; each header carries
#: it under the older scheme's name too, which a receiver skips.
DIGEST = "0" * 64
DIGESTS = f"v1={DIGEST},v2={DIGEST}"


@pytest.mark.parametrize(
    "header",
    [
        f"t=\u00b2,h=,{DIGESTS}",  # a digit, but not an ASCII one
        f"t=\u0661\u0667\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660,h=,{DIGESTS}",
        f"t={'9' * 5000},h=,{DIGESTS}",
        "t={now},h=,v1=\u00e9" + "0" * 63 + ",v2=\u00e9" + "0" * 63,
        "t={now},h=,v2=" + "0" * 5000,
        "t={now},h=,v1=" + DIGEST,  # the older scheme alone
        "t={now},t={now},h=," + DIGESTS,
        "t={now}," + DIGESTS,
        "t={now},h=Content-Type," + DIGESTS,
        "t={now},h=ce-id;ce-id," + DIGESTS,
        "t={now},h=relaybox-signature," + DIGESTS,
        "t={now}, h=," + DIGESTS,
        "t={now},h=," + DIGESTS,  # well formed, and wrong
        ",,,,",
        "=" * 20000,
        "t=-5,h=," + DIGESTS,
    ],
    ids=["superscript-digit", "arabic-indic-digits", "5000-digits", "non-ascii-digest",
         "long-digest", "only-v1", "two-timestamps", "no-h", "upper-case-name",
         "repeated-name", "signs-itself", "blank-key", "wrong-digest", "empty-fields",
         "long-header", "negative-t"],
)  # fmt: skip
async def test_any_malformed_signature_is_refused_with_401(header: str) -> None:
    receiver = WebhookReceiver(idle_consumer(), secret=SECRET)
    headers = {"content-type": "application/json", "ce-id": "m1",
               "relaybox-signature": header.replace("{now}", str(int(time.time())))}  # fmt: skip
    async with ReceiverServer(receiver) as server:
        response = await send(server, headers, b"{}")
    assert response.status_code == 401
    assert receiver.unauthorized == 1


def test_a_receiver_takes_a_secret_unless_told_its_requests_come_authenticated() -> None:
    """Whoever reaches a receiver's URL could post any message with any id: a receiver
    made without a secret would apply it, or take the id of a message yet to come and
    have that one skipped as its copy. So it needs the secret, or `unsigned=True`."""
    with pytest.raises(ConfigurationError, match=r"secret=.*unsigned=True"):
        WebhookReceiver(idle_consumer())
    with pytest.raises(ConfigurationError, match="contradict"):
        WebhookReceiver(idle_consumer(), secret=SECRET, unsigned=True)
    with pytest.raises(ConfigurationError, match=r"empty.*unsigned=True"):
        WebhookReceiver(idle_consumer(), secret="")
    assert WebhookReceiver(idle_consumer(), secret=SECRET).secret == SECRET
    assert WebhookReceiver(idle_consumer(), unsigned=True).secret is None


async def test_an_unsigned_receiver_processes_what_it_is_given(world: InboxWorld) -> None:
    """`unsigned=True` checks no signature: the request is processed as it came."""
    handled: list[str] = []

    async def record(message: Incoming) -> None:
        handled.append(message.id)

    receiver = WebhookReceiver(world.consumer(before_effect=record), unsigned=True)
    headers = {"content-type": "application/json", "ce-id": "m-unsigned",
               "ce-source": "test", "ce-type": "t", "ce-specversion": "1.0"}  # fmt: skip
    async with ReceiverServer(receiver) as server:
        response = await send(server, headers, b"{}")
    assert response.status_code == 200, response.text
    assert handled == ["m-unsigned"]


def test_the_signature_is_the_documented_canonical_form() -> None:
    """What a receiver in another language computes, from the module's docstring."""
    headers = [("Content-Type", "application/json"), ("ce-id", "m1"),
               ("Relaybox-Topic", "orders"), ("X-Tag", " a "), ("x-tag", "b")]  # fmt: skip
    header = sign("k", headers, b'{"n":1}', timestamp=1700000000)
    assert header.startswith("t=1700000000,h=content-type;ce-id;relaybox-topic;x-tag,v2=")
    canonical = (
        b"relaybox-webhook-v2\n1700000000\n"
        b"content-type:application/json\nce-id:m1\nrelaybox-topic:orders\nx-tag:a, b\n"
        b'\n{"n":1}'
    )
    digest = hmac.new(b"k", canonical, hashlib.sha256).hexdigest()
    assert header.endswith(f",v2={digest}")
    received = [(name.lower().encode(), value.encode()) for name, value in headers]
    signed = verify_signature("k", [*received, (b"relaybox-signature", header.encode())],
                              b'{"n":1}', now=1700000100)  # fmt: skip
    assert signed == {"content-type", "ce-id", "relaybox-topic", "x-tag"}
    with pytest.raises(SignatureError, match="timestamp"):
        verify_signature("k", [*received, (b"relaybox-signature", header.encode())],
                         b'{"n":1}', now=1700000301)  # fmt: skip
