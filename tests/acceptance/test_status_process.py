"""`relaybox relay --http`: a real relay process on PostgreSQL reports its signals."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.acceptance.test_relay_processes import RELAYBOX
from tests.brokers.harness import free_port
from tests.relay_support import OutboxDB, eventually, messages, outbox_db


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path):
        yield each


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def _relay(db: OutboxDB, out: Path, port: int, log: Path) -> subprocess.Popen[str]:
    command = [
        RELAYBOX, "relay", "--db", db.url, "--table", db.table,
        "--broker", f"default=file://{out}", "--http", f"127.0.0.1:{port}",
        "--idle-interval", "0.1", "--log-level", "WARNING",
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)


async def test_a_relay_process_serves_its_signals(db: OutboxDB, tmp_path: Path) -> None:
    port = free_port()
    proc = _relay(db, tmp_path / "out.jsonl", port, tmp_path / "relay.log")
    try:
        await eventually(lambda: _get(port, "/readyz")[0] == 200, timeout=30)
        await db.write(messages(["a", "b", None], per_key=40))

        async def delivered() -> bool:
            status, body = await asyncio.to_thread(_get, port, "/api/outbox")
            report = json.loads(body) if status == 200 else {}
            return bool(report) and report["targets"]["default"]["acked"] == 120

        await eventually(delivered, timeout=30)
        done = time.monotonic()

        async def read_since() -> dict[str, Any]:  # the table is read again every 15 s
            # The sample's age is as of the answer, which comes after `asked`: younger
            # than the time from `done` to `asked`, it was taken after `done`, however
            # slow the answer was.
            asked = time.monotonic()
            report = json.loads((await asyncio.to_thread(_get, port, "/api/outbox"))[1])
            age = report["databases"]["db0"]["outbox"]["sample_age_seconds"]
            return report if age < asked - done else {}

        await eventually(read_since, timeout=40, interval=0.5)
        report = await read_since() or json.loads(_get(port, "/api/outbox")[1])
        assert report["signals"]["pending"] == 0
        assert report["signals"]["abandoned"] == 0
        assert report["databases"]["db0"]["url"].startswith("postgresql://")
        status, body = await asyncio.to_thread(_get, port, "/metrics")
        assert status == 200
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body)
            for s in family.samples
        }
        key = ("relaybox_relay_settled_messages_total",
               (("database", "db0"), ("outcome", "published")))  # fmt: skip
        assert samples[key] == 120
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0
    assert _get(port, "/healthz") == (0, "")  # the endpoints went with the relay


def test_a_port_in_use_is_a_clear_error(db: OutboxDB, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _relay(db, tmp_path / "out.jsonl", port, tmp_path / "relay.log")
        code = proc.wait(30)
    assert code != 0
    assert "cannot serve the status endpoints on 127.0.0.1" in (tmp_path / "relay.log").read_text()
