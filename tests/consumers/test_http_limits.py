"""What a webhook receiver takes in: a capped body, a capped batch, and 4xx for anything
a request holds (5xx is for its handlers' and its database's failures alone).

`AsgiServer` serves `WebhookReceiver` as an ASGI application over HTTP/1.1 (h11) on a
local socket, and counts the body bytes the application asked for; `ReceiverServer`
(test_http.py) calls `WebhookReceiver.handle` with the whole body, as any other
framework would.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import h11
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relaybox.consumers.http import WebhookReceiver, decode_request
from relaybox.errors import ConfigurationError, EnvelopeError
from relaybox.publishers.http import BATCH_CONTENT_TYPE, DEFAULT_MAX_BODY_SIZE
from tests.brokers.harness import free_port
from tests.consumers.conformance import idle_consumer
from tests.consumers.test_http import ReceiverServer

MiB = 1024 * 1024
CHUNK = 64 * 1024


class AsgiServer:
    """One request per connection, handed to an ASGI application."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hooks"
        #: Body bytes the application received.
        self.taken = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> AsgiServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = h11.Connection(h11.SERVER)

        async def next_event() -> Any:
            while (event := connection.next_event()) is h11.NEED_DATA:
                connection.receive_data(await reader.read(CHUNK))
            return event

        async def receive() -> dict[str, Any]:
            event = await next_event()
            if isinstance(event, h11.Data):
                self.taken += len(event.data)
                return {"type": "http.request", "body": bytes(event.data), "more_body": True}
            if isinstance(event, h11.EndOfMessage):
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [*message["headers"], (b"connection", b"close")]
                writer.write(connection.send(h11.Response(status_code=message["status"],
                                                          headers=headers)))  # fmt: skip
            else:
                writer.write(connection.send(h11.Data(data=message["body"])))
                writer.write(connection.send(h11.EndOfMessage()))

        try:
            request = await next_event()
            scope = {"type": "http", "method": request.method.decode(),
                     "path": request.target.decode(), "headers": list(request.headers)}  # fmt: skip
            await self.app(scope, receive, send)
            await writer.drain()
            # As servers do: read what is left of the request (and drop it), so that the
            # client, still sending, reads the answer instead of a reset connection.
            while connection.their_state is h11.SEND_BODY:
                if isinstance(await next_event(), h11.ConnectionClosed):
                    break
        except (ConnectionError, h11.RemoteProtocolError):
            pass
        finally:
            writer.close()


async def _chunks(size: int) -> AsyncIterator[bytes]:
    for _ in range(size // CHUNK):
        yield b"x" * CHUNK


async def test_the_asgi_app_reads_a_body_no_further_than_its_cap() -> None:
    receiver = WebhookReceiver(idle_consumer(), unsigned=True)  # the default cap
    async with AsgiServer(receiver) as server, httpx.AsyncClient(timeout=30) as client:
        streamed = await client.post(server.url, content=_chunks(3 * MiB))  # chunked
        taken_streamed, server.taken = server.taken, 0
        declared = await client.post(server.url, content=b"x" * (3 * MiB))
    assert (streamed.status_code, declared.status_code) == (413, 413)
    assert DEFAULT_MAX_BODY_SIZE < taken_streamed <= DEFAULT_MAX_BODY_SIZE + CHUNK
    assert server.taken == 0  # its Content-Length said enough
    assert receiver.rejected == 2


async def test_handle_refuses_a_body_over_its_cap() -> None:
    receiver = WebhookReceiver(idle_consumer(), max_body_size=MiB, unsigned=True)
    async with ReceiverServer(receiver) as server, httpx.AsyncClient() as client:
        response = await client.post(server.url, content=b"[" + b" " * MiB + b"]",
                                     headers={"content-type": BATCH_CONTENT_TYPE})  # fmt: skip
    assert response.status_code == 413
    assert response.json() == {"error": f"request body over {MiB} bytes"}


def _event(**fields: Any) -> dict[str, Any]:
    return {"specversion": "1.0", "id": "e1", "source": "s", "type": "t", **fields}


NESTED = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    ("content_type", "body", "error"),
    [
        (BATCH_CONTENT_TYPE, NESTED, "deeper than"),
        (BATCH_CONTENT_TYPE, b'[{"id": "e1", "data": ' + NESTED + b"}]", "deeper than"),
        ("application/cloudevents+json", json.dumps(_event(data="\ud800")).encode(), "Unicode"),
        ("application/cloudevents+json",
         json.dumps(_event(datacontenttype="text/plain", data="\udfff")).encode(), "Unicode"),
        (BATCH_CONTENT_TYPE, json.dumps([_event(id=f"e{n}") for n in range(4)]).encode(),
         "4 events, over this receiver's limit of 3 (max_batch_events)"),
    ],
    ids=["nested-batch", "nested-data", "lone-surrogate-json", "lone-surrogate-text",
         "too-many-events"],
)  # fmt: skip
async def test_a_request_nothing_can_read_is_answered_400(
    content_type: str, body: bytes, error: str
) -> None:
    receiver = WebhookReceiver(idle_consumer(), max_batch_events=3, unsigned=True)
    async with ReceiverServer(receiver) as server, httpx.AsyncClient() as client:
        response = await client.post(server.url, content=body,
                                     headers={"content-type": content_type})  # fmt: skip
    assert response.status_code == 400
    assert error in response.json()["error"]
    assert receiver.rejected == 1


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_body_size", 0), ("max_batch_events", 0), ("max_attempts", 0), ("tolerance", 0.0)],
)
def test_limits_must_be_positive(option: str, value: float) -> None:
    with pytest.raises(ConfigurationError, match=option):
        WebhookReceiver(idle_consumer(), **{option: value}, unsigned=True)


# Any JSON at all, text with lone surrogates included, nested as deep as it likes.
_text = st.text(
    st.characters(codec=None, categories=["Cs"]) | st.characters(categories=["L", "N", "P"]),
    max_size=8,
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=30,
)
#: An event with an id and data, each as often readable as not, and the other attributes
#: now and then, so that decoding gets past the first check.
_event = st.fixed_dictionaries(
    {"id": st.text(min_size=1, max_size=8) | _json, "data": _text | _json},
    optional={
        "datacontenttype": st.sampled_from(["application/json", "text/plain"]) | _json,
        "data_base64": st.binary().map(base64.b64encode).map(bytes.decode) | _json,
        "source": _json, "type": _json, "subject": _json, "time": _json,
        "sequence": st.integers().map(str) | _json, "partition": st.integers() | _json,
    },
)  # fmt: skip
_events = st.lists(_event | st.dictionaries(_text, _json, max_size=4), max_size=4)


@given(events=_events | _json)
def test_a_batch_decodes_or_is_an_envelope_error(events: Any) -> None:
    body = json.dumps(events, ensure_ascii=True).encode()
    with contextlib.suppress(EnvelopeError):
        decode_request({"content-type": BATCH_CONTENT_TYPE}, body, max_events=3)
