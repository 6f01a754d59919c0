"""`relaybox relay --http`: a real relay process on PostgreSQL reports its signals."""

from __future__ import annotations

import asyncio
import json
import os
import resource
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


async def _trickle(port: int, stop: asyncio.Event) -> None:
    """A client that sends its request a header line at a time, forever, and connects
    again whenever it is dropped."""
    while not stop.is_set():
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\n")
            while not stop.is_set():
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
                await asyncio.sleep(0.5)
        except OSError:
            await asyncio.sleep(0.05)
        else:
            writer.close()


def _descriptors(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


async def test_many_slow_clients_neither_starve_the_relay_nor_flood_its_log(
    db: OutboxDB, tmp_path: Path
) -> None:
    """400 clients trickle their requests to the status port of a relay allowed 256
    descriptors: the relay keeps its descriptors within the connection bound, answers a
    client that asks at once, keeps delivering, and logs a line now and then."""
    port, out, log = free_port(), tmp_path / "out.jsonl", tmp_path / "relay.log"

    command = [
        RELAYBOX, "relay", "--db", db.url, "--table", db.table, "--broker", f"default=file://{out}",
        "--http", f"127.0.0.1:{port}", "--idle-interval", "0.1", "--log-level", "INFO",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (256, 256))
    stop = asyncio.Event()
    clients: list[asyncio.Task[None]] = []
    try:
        await eventually(lambda: _get(port, "/readyz")[0] == 200, timeout=30)
        calm = _descriptors(proc.pid)
        clients = [asyncio.create_task(_trickle(port, stop)) for _ in range(400)]
        await db.write(messages(["a", "b", None], per_key=50))
        most, answers, started = calm, [], time.monotonic()
        while time.monotonic() - started < 8:
            await asyncio.sleep(0.05)
            most = max(most, _descriptors(proc.pid))
            if len(answers) < 10:
                answers.append(await asyncio.to_thread(_get, port, "/healthz"))
        assert most <= calm + 64 + 8, (calm, most)  # relaybox serves 64 connections at once
        assert answers == [(200, "ok\n")] * 10
        await eventually(lambda: out.exists() and len(out.read_text().splitlines()) == 150)
    finally:
        stop.set()
        for client in clients:
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0
    text = log.read_text()
    assert "Traceback" not in text
    assert len(text) < 5000, text[:2000]
    assert "dropped the oldest that had not sent its request yet" in text
