"""The web integrations hand a request's committed messages to the relay of its process:
with an idle interval of a minute, only that hand-off publishes them within seconds."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from relaybox import Message, Outbox, Relay, RelaySettings
from relaybox.integrations.asgi import relay_lifespan
from relaybox.integrations.flask import Relaybox
from relaybox.publishers.memory import MemoryPublisher
from tests.databases import create, sqlite_url, unique_table

#: A relay that, left to itself, looks again only a minute after each read.
IDLE = RelaySettings(idle_interval=60.0, min_poll_interval=60.0, fast_poll_window=0.0)


@pytest.fixture
async def table(tmp_path: Path) -> str:
    name = unique_table("web")
    await create(sqlite_url(tmp_path / "web.db"), name)
    return name


def _published(publisher: MemoryPublisher, count: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while len(publisher.published) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@contextlib.contextmanager
def _connection(db: Path) -> Iterator[sqlite3.Connection]:
    with contextlib.closing(sqlite3.connect(db)) as connection:
        yield connection


def test_a_flask_request_that_ends_well_wakes_the_relay(tmp_path: Path, table: str) -> None:
    db, publisher, outbox = tmp_path / "web.db", MemoryPublisher(), Outbox(table=table)
    app = Flask(__name__)
    relaybox = Relaybox(
        app, outbox=outbox,
        relay=lambda: Relay(sqlite_url(db), {"default": publisher}, table=table, settings=IDLE),
    )  # fmt: skip

    @app.post("/<name>")
    def order(name: str) -> str:
        with _connection(db) as connection, connection:
            relaybox.add(connection, Message(topic="orders", key=name, payload={}))
        if name == "failing":
            raise RuntimeError("the request fails after its commit")
        return name

    client = app.test_client()
    try:
        assert client.post("/first").status_code == 200
        assert _published(publisher, 1, 5.0)
        time.sleep(0.5)  # the relay reads once more after work, then idles a minute
        assert client.post("/failing").status_code == 500
        assert not _published(publisher, 2, 1.0)  # no hand-off after an error: next poll
    finally:
        relaybox.stop()
    assert relaybox.relay is None


def test_the_asgi_lifespan_attaches_the_outbox(tmp_path: Path, table: str) -> None:
    db, publisher, outbox = tmp_path / "web.db", MemoryPublisher(), Outbox(table=table)

    def order(request: Request) -> JSONResponse:
        with _connection(db) as connection, connection:
            written = outbox.add(connection, Message(topic="orders", key="k", payload={}))
        outbox.committed(written)
        return JSONResponse({"worker": request.state.relay.worker})

    def make_relay() -> Relay:
        return Relay(sqlite_url(db), {"default": publisher}, table=table, settings=IDLE)

    app = Starlette(routes=[Route("/", order, methods=["POST"])],
                    lifespan=relay_lifespan(make_relay, outbox))  # fmt: skip
    with TestClient(app) as client:
        time.sleep(0.5)  # past the relay's first reads: idle now
        assert client.post("/").json()["worker"]
        assert _published(publisher, 1, 5.0)
    assert outbox._listeners == []  # the stopped relay let go of the outbox
