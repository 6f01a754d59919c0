"""The relay's operational signals over HTTP: /api/outbox, /metrics,
/healthz and /readyz, read while a relay works."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relaybox import Message, Relay, RelaySettings, RetryPolicy
from relaybox.core.circuit import CircuitPolicy
from relaybox.core.records import Routing
from relaybox.observability.http import StatusServer, parse_address
from relaybox.publishers.memory import MemoryPublisher
from relaybox.storage.memory import MemoryStorage
from tests.relay_support import eventually

SETTINGS = RelaySettings(
    retry=RetryPolicy(base_delay=0.05, max_delay=0.05, max_attempts=2),
    circuit=CircuitPolicy(failure_threshold=3, open_seconds=30.0),
    idle_interval=0.05,
)


class Running:
    def __init__(self, relay: Relay, server: StatusServer, storage: MemoryStorage,
                 publisher: MemoryPublisher) -> None:  # fmt: skip
        self.relay, self.server, self.storage, self.publisher = relay, server, storage, publisher

    async def get(self, path: str, method: str = "GET") -> tuple[int, str]:
        def fetch() -> tuple[int, str]:
            url = f"http://127.0.0.1:{self.server.port}{path}"
            request = urllib.request.Request(url, method=method)
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    return response.status, response.read().decode()
            except urllib.error.HTTPError as error:
                return error.code, error.read().decode()

        return await asyncio.to_thread(fetch)

    async def write(self, *messages: Message) -> None:
        await self.storage.write(Routing().rows(messages))
        self.relay.wake()

    async def settled(self, count: int) -> None:
        def enough() -> bool:
            metrics = self.relay.metrics()["db0"]
            return metrics.published + metrics.abandoned >= count

        await eventually(enough)


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    storage, publisher = MemoryStorage(), MemoryPublisher()
    async with Relay(storage, {"default": publisher}, settings=SETTINGS) as relay:
        server = StatusServer(relay, "127.0.0.1", 0)
        await server.start()
        try:
            yield Running(relay, server, storage, publisher)
        finally:
            await server.close()


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_api_outbox_reports_the_four_signals_and_what_each_target_did(
    running: Running,
) -> None:
    running.publisher.reject(lambda m: m.key == "poison", error="too large")
    running.publisher.fail(lambda m: m.key == "flaky", times=1)
    keyed = [Message(topic="t", key=f"k{n % 4}") for n in range(20)]
    await running.write(*keyed, Message(topic="t", key="poison"), Message(topic="t", key="flaky"))
    await running.settled(22)
    status, body = await running.get("/api/outbox")
    assert status == 200
    report = json.loads(body)
    assert report["ready"] is True
    assert report["signals"]["pending"] == 0
    assert report["signals"]["abandoned"] == 1  # the poison message
    target = report["targets"]["default"]
    assert (target["acked"], target["retried"], target["abandoned"]) == (21, 1, 1)
    assert target["retry_rate"] == pytest.approx(1 / 23)
    assert report["signals"]["retry_rate"] == pytest.approx(1 / 23)
    database = report["databases"]["db0"]
    assert database["counters"]["published"] == 21
    assert database["outbox"]["counts"]["abandoned"] == 1
    assert database["partitions_held"] == SETTINGS.partitions


async def test_metrics_are_prometheus_text_with_every_signal(running: Running) -> None:
    running.publisher.reject(lambda m: m.key == "poison")
    await running.write(*(Message(topic="t", key=f"k{n}") for n in range(10)),
                        Message(topic="t", key="poison"))  # fmt: skip
    await running.settled(11)
    status, body = await running.get("/metrics")
    assert status == 200
    samples = _samples(body)

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    assert value("relaybox_publish_messages_total", target="default", outcome="acked") == 10
    assert value("relaybox_publish_messages_total", target="default", outcome="abandoned") == 1
    assert value("relaybox_outbox_messages", database="db0", status="abandoned") == 1
    assert value("relaybox_outbox_messages", database="db0", status="pending") == 0
    assert value("relaybox_relay_settled_messages_total", database="db0",
                 outcome="published") == 10  # fmt: skip
    assert value("relaybox_circuit_state", target="default", state="closed") == 1
    assert value("relaybox_publish_duration_seconds_count", target="default") >= 1
    assert value("relaybox_delivery_lag_seconds_bucket", target="default", le="+Inf") >= 1
    assert value("relaybox_outbox_sample_ok", database="db0") == 1


async def test_keys_held_by_the_policy_are_reported_as_json_and_metrics() -> None:
    storage, publisher = MemoryStorage(), MemoryPublisher()
    publisher.reject(lambda m: m.key == "poison")
    settings = dataclasses.replace(SETTINGS, hold_keys=True)
    async with Relay(storage, {"default": publisher}, settings=settings) as relay:
        server = StatusServer(relay, "127.0.0.1", 0)
        await server.start()
        try:
            running = Running(relay, server, storage, publisher)
            poison = [Message(topic="t", key="poison") for _ in range(3)]
            await running.write(*poison, Message(topic="t", key="fine"))
            await eventually(lambda: len(publisher.published) == 1)
            await running.settled(2)
            report = json.loads((await running.get("/api/outbox"))[1])
            samples = _samples((await running.get("/metrics"))[1])
        finally:
            await server.close()
    assert report["signals"]["held_keys"] == 1
    assert report["signals"]["failed"] == 0
    assert report["signals"]["pending"] == 2  # the key's later messages, waiting behind it
    outbox = report["databases"]["db0"]["outbox"]
    assert (outbox["held"], outbox["held_keys"]) == (1, 1)
    assert samples[("relaybox_outbox_held_keys", frozenset({("database", "db0")}))] == 1
    assert samples[("relaybox_outbox_held", frozenset({("database", "db0")}))] == 1
    failed = frozenset({("database", "db0"), ("status", "failed")})
    assert samples[("relaybox_outbox_messages", failed)] == 0


async def test_readiness_fails_while_a_circuit_is_open_and_health_does_not(
    running: Running,
) -> None:
    assert await running.get("/readyz") == (200, json.dumps(
        {"ready": True, "problems": []}, indent=2) + "\n")  # fmt: skip
    running.publisher.down()  # unreachable: no attempt counted, the circuit counts
    await running.write(*(Message(topic="t", key=f"k{n}") for n in range(3)))
    await eventually(running.relay.readiness)  # open for 30 s once it opens
    status, body = await running.get("/readyz")
    assert status == 503
    assert json.loads(body)["problems"] == [
        "target default: circuit open (the broker keeps failing)"
    ]
    assert await running.get("/healthz") == (200, "ok\n")
    report = json.loads((await running.get("/api/outbox"))[1])
    assert report["ready"] is False
    assert report["targets"]["default"]["circuit"] == "open"
    assert report["targets"]["default"]["unavailable"] >= 3
    assert report["targets"]["default"]["retried"] == 0  # an outage burns no attempts


async def test_unknown_paths_and_methods_are_refused(running: Running) -> None:
    status, body = await running.get("/nowhere")
    assert status == 404
    assert "/metrics" in body
    assert (await running.get("/metrics", method="POST"))[0] == 405
    assert (await running.get("/healthz", method="HEAD")) == (200, "")


async def test_a_client_that_sends_nothing_is_dropped_and_others_are_served(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("relaybox.observability.http.REQUEST_TIMEOUT", 0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", running.server.port)
    assert await running.get("/healthz") == (200, "ok\n")  # served meanwhile
    # Dropped by the server's request timeout: the bound only keeps a server that never
    # drops it from hanging the test, and leaves a busy machine ample room.
    answer = await asyncio.wait_for(reader.read(), 30)
    assert answer.startswith(b"HTTP/1.1 400 ")
    writer.close()


def test_http_addresses() -> None:
    assert parse_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_address(":9464") == ("0.0.0.0", 9464)
    assert parse_address("9464") == ("127.0.0.1", 9464)
    assert parse_address("[::1]:9464") == ("::1", 9464)
    for bad in ("host:port", "127.0.0.1:70000", ""):
        with pytest.raises(Exception, match="HOST:PORT"):
            parse_address(bad)


async def test_a_client_that_hangs_up_at_once_logs_no_error(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(3):  # a TCP probe: connect, then close without a request
        _, writer = await asyncio.open_connection("127.0.0.1", running.server.port)
        writer.close()
        await writer.wait_closed()
    assert await running.get("/healthz") == (200, "ok\n")
    await asyncio.sleep(0.05)
    assert [r for r in caplog.records if r.levelname == "ERROR"] == []


async def test_a_request_too_long_is_refused(running: Running) -> None:
    """Each header line fits the reader's limit; together they are over the request's."""
    reader, writer = await asyncio.open_connection("127.0.0.1", running.server.port)
    pad = b"X-Pad: " + b"x" * 4000 + b"\r\n"
    writer.write(b"GET /healthz HTTP/1.1\r\n" + pad + pad + pad + b"\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)
    assert answer.startswith(b"HTTP/1.1 400 ")
    writer.close()
    assert await running.get("/healthz") == (200, "ok\n")
