"""examples/fastapi and examples/flask, each served by a real server process against a
SQLite file and an embedded NATS JetStream server: an order posted over HTTP arrives on
NATS as its event, published by the relay inside the web process.

`order_arrives_on_nats` takes the Python that runs the server, so the packaging tests
run the same steps from a fresh virtual environment holding the built wheel."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from relaybox.tools.embedded_nats import EmbeddedNats
from tests.brokers.harness import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


#: How each example is served: `python -m` and these arguments, `{port}` filled in.
SERVERS = {
    "fastapi": ["uvicorn", "app:app", "--port", "{port}"],
    "flask": ["gunicorn", "--preload", "-w", "2", "app:app", "-b", "127.0.0.1:{port}"],
}


@pytest.fixture
def broker() -> Iterator[EmbeddedNats]:
    with nats_broker() as server:
        yield server


@contextlib.contextmanager
def nats_broker() -> Iterator[EmbeddedNats]:
    """A private NATS JetStream server with the examples' `ORDERS` stream."""
    server = EmbeddedNats().start()
    try:
        asyncio.run(_add_stream(server.url))
        yield server
    finally:
        server.stop()


async def _add_stream(url: str) -> None:
    connection = await nats.connect(url)
    try:
        await connection.jetstream().add_stream(name="ORDERS", subjects=["orders"])
    finally:
        await connection.close()


async def _last_order(url: str) -> dict[str, object] | None:
    connection = await nats.connect(url)
    try:
        message = await connection.jetstream().get_last_msg("ORDERS", "orders")
    except nats.js.errors.NotFoundError:
        return None
    finally:
        await connection.close()
    return json.loads(message.data)  # type: ignore[no-any-return]


def _post(port: int, body: bytes, proc: subprocess.Popen[bytes]) -> tuple[int, dict[str, str]]:
    """POST an order once the server answers (it may still be starting)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/orders", data=body,
        headers={"content-type": "application/json"}, method="POST",
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as error:
            return error.code, json.load(error)
        except OSError:
            assert proc.poll() is None, f"the server ended ({proc.returncode})"
            assert time.monotonic() < deadline, "the server did not answer within 30 s"
            time.sleep(0.1)


@pytest.mark.parametrize("example", sorted(SERVERS))
def test_an_order_posted_to_the_example_arrives_on_nats(
    example: str, broker: EmbeddedNats, tmp_path: Path
) -> None:
    order_arrives_on_nats(example, Path(sys.executable), broker, tmp_path)


def order_arrives_on_nats(example: str, python: Path, broker: EmbeddedNats, tmp_path: Path) -> None:
    """Migrate a SQLite file, serve the example with `python`, post an order and find its
    event on NATS; an order missing its total is refused. The server is stopped after."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(SHOP_DB=str(tmp_path / "shop.db"), NATS_URL=broker.url)
    subprocess.run(
        [python, "-m", "relaybox", "migrate", "--db", f"sqlite:///{env['SHOP_DB']}"],
        env=env, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    port = free_port()
    server = [part.format(port=port) for part in SERVERS[example]]
    proc = subprocess.Popen(
        [python, "-m", *server],
        cwd=EXAMPLES / example, env=env,
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "server.log").open("w"),
    )  # fmt: skip
    try:
        status, said = _post(port, b'{"customer": "ada", "total": 42}', proc)
        assert status == 201
        deadline = time.monotonic() + 10
        while (event := asyncio.run(_last_order(broker.url))) is None:
            assert time.monotonic() < deadline, "the order's event did not reach NATS"
            time.sleep(0.1)
        assert event == {"id": said["id"], "customer": "ada", "total": 42}
        assert _post(port, b'{"customer": "ada"}', proc)[0] in (400, 422)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            # uvicorn ends by the signal it was stopped with, once it has shut down.
            assert proc.wait(30) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
