"""examples/django: `manage.py migrate`, `place_order` and `relaybox_relay`, each a process
of this interpreter, on a SQLite file and a private NATS server; the order's message
arrives on the stream, and the relay stops on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import nats

from relaybox.tools.embedded_nats import EmbeddedNats
from tests.relay_support import eventually

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "django"


def _manage(env: dict[str, str], *arguments: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "manage.py", *arguments], cwd=PROJECT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _finished(process: subprocess.Popen[str]) -> str:
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    return output


async def test_an_order_placed_in_the_example_reaches_nats(tmp_path: Path) -> None:
    async with EmbeddedNats() as server:
        client = await nats.connect(server.url)
        try:
            stream = client.jetstream()
            await stream.add_stream(name="ORDERS", subjects=["orders"])

            async def stored() -> int:
                return int((await stream.stream_info("ORDERS")).state.messages)

            env = {**os.environ, "SHOP_DB": str(tmp_path / "shop.db"), "SHOP_BROKER": server.url}
            _finished(_manage(env, "migrate", "-v", "0"))
            assert "order 1 placed" in _finished(_manage(env, "place_order", "book"))
            relay = _manage(env, "relaybox_relay")
            try:
                await eventually(stored, timeout=30, interval=0.1)
            finally:
                relay.send_signal(signal.SIGTERM)
                output = _finished(relay)
            assert "stopped" in output
            assert await stored() == 1
            delivered = await stream.get_msg("ORDERS", 1)
            assert json.loads(delivered.data or b"") == {"order": 1, "item": "book"}
            assert (delivered.headers or {})["ce-subject"] == "1"  # the message's key
        finally:
            await client.close()
