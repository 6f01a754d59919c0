"""OpenTelemetry: one trace from the writer's span through the relay's send to the
consumer's processing, on SQLite and the shared Redis, read back through the SDK's
in-memory exporters; and the relay's and consumer's metrics after those messages."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from relaybox import Message, Outbox
from relaybox.consumers.redis import RedisConsumer
from relaybox.core.incoming import Incoming
from relaybox.errors import ConfigurationError
from relaybox.observability.otel import instrument_consumer, instrument_relay
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import Relay
from relaybox.storage.memory import MemoryStorage
from tests.databases import create, drop, sqlite_url, unique_table
from tests.inbox.support import InboxWorld
from tests.relay_support import eventually, fast_settings

REDIS_URL = "redis://127.0.0.1:6379/0"
COUNT = 5


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


@pytest.fixture
def reader() -> Iterator[tuple[MeterProvider, InMemoryMetricReader]]:
    metric_reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[metric_reader])
    yield provider, metric_reader
    provider.shutdown()


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Every data point collected now, by metric name."""
    found: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def value(found: dict[str, list[Any]], name: str, **attributes: str) -> Any:
    (point,) = [p for p in found[name] if dict(p.attributes) == attributes]
    return point.value if hasattr(point, "value") else point


def by_kind(exporter: InMemorySpanExporter, kind: SpanKind) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.kind is kind]


async def test_a_trace_runs_from_the_writer_through_the_relay_to_the_consumer(
    tmp_path: Path,
    spans: tuple[TracerProvider, InMemorySpanExporter],
    reader: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    tracer_provider, exporter = spans
    meter_provider, metric_reader = reader
    url, table = sqlite_url(tmp_path / "outbox.db"), unique_table("otel")
    topic = f"otel-{uuid.uuid4().hex[:10]}"
    await create(url, table)
    tracer = tracer_provider.get_tracer("the application")
    outbox = Outbox(table=table)
    with sqlite3.connect(tmp_path / "outbox.db") as conn:  # commits at the end
        for n in range(COUNT):
            with tracer.start_as_current_span("place order"):
                outbox.add(conn, Message(topic=topic, key=f"k{n}", payload={"n": n}))
    writers = {span.context.span_id: span for span in exporter.get_finished_spans()}
    assert len(writers) == COUNT

    relay = Relay(url, {"default": REDIS_URL}, table=table, settings=fast_settings())
    instrument_relay(relay, tracer_provider=tracer_provider, meter_provider=meter_provider)
    redis = aioredis.Redis.from_url(REDIS_URL)
    try:
        async with InboxWorld("sqlite", tmp_path) as world:
            broker = RedisConsumer(REDIS_URL, world.consumer(), stream=topic, fetch_timeout=0.2)
            instrument_consumer(
                broker, tracer_provider=tracer_provider, meter_provider=meter_provider
            )
            async with relay, broker:
                await eventually(lambda: len(by_kind(exporter, SpanKind.CONSUMER)) == COUNT)
                assert sum(world.effects().values()) == COUNT
                await eventually(lambda: relay.metrics()["db0"].published == COUNT)
    finally:
        await redis.delete(topic)
        await redis.aclose()
        drop(url, table)

    sends = by_kind(exporter, SpanKind.PRODUCER)
    processes = {span.parent.span_id: span for span in by_kind(exporter, SpanKind.CONSUMER)}
    assert len(sends) == len(processes) == COUNT
    for send in sends:
        writer = writers[send.parent.span_id]  # the writer's span is the send's parent
        assert send.context.trace_id == writer.context.trace_id
        assert send.name == f"send {topic}"
        assert send.attributes["messaging.system"] == "redis"
        assert send.attributes["messaging.destination.name"] == topic
        assert send.attributes["messaging.operation.type"] == "send"
        uuid.UUID(str(send.attributes["messaging.message.id"]))
        assert send.status.status_code is StatusCode.UNSET
        process = processes[send.context.span_id]  # the send is the processing's parent
        assert process.context.trace_id == writer.context.trace_id
        assert process.attributes["messaging.operation.type"] == "process"
        assert process.attributes["messaging.message.id"] == send.attributes["messaging.message.id"]
        assert process.attributes["relaybox.outcome"] == "applied"

    found = points(metric_reader)
    assert value(found, "relaybox_publish_messages", target="default", outcome="acked") == COUNT
    assert value(found, "relaybox_relay_claimed_messages", database="db0") == COUNT
    published = value(found, "relaybox_relay_settled_messages", database="db0", outcome="published")
    assert published == COUNT
    lag = value(found, "relaybox_delivery_lag_seconds", target="default")
    calls = value(found, "relaybox_publish_duration_seconds", target="default").count
    assert 1 <= lag.count == calls <= COUNT  # once per publish call that was confirmed
    assert lag.explicit_bounds[0] == 0.005  # the Prometheus histogram's bounds
    assert value(found, "relaybox_consumer_messages", consumer="test", outcome="applied") == COUNT
    assert value(found, "relaybox_consumer_lag_seconds", consumer="test").count == COUNT


async def test_a_refused_message_ends_its_send_span_with_the_error(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    tracer_provider, exporter = spans
    storage = MemoryStorage()
    publisher = MemoryPublisher()
    publisher.reject(lambda message: message.key == "bad", error="too large for the broker")
    await storage.write(
        [row for m in (Message(topic="t", key="bad"), Message(topic="t", key="good"))
         for row in Outbox().rows(m)[1]]
    )  # fmt: skip
    relay = Relay(storage, {"default": publisher}, settings=fast_settings())
    instrument_relay(relay, tracer_provider=tracer_provider, metrics=False)
    async with relay:
        await eventually(lambda: len(exporter.get_finished_spans()) == 2)
    ended = {span.status.status_code: span for span in exporter.get_finished_spans()}
    bad, good = ended[StatusCode.ERROR], ended[StatusCode.UNSET]
    assert bad.status.description == "too large for the broker"
    assert bad.attributes["error.type"] == "permanent"
    # The broker got each message with its own send span's context.
    (sent,) = publisher.published
    assert sent.headers["traceparent"].split("-")[2] == f"{good.context.span_id:016x}"


async def test_publishers_are_wrapped_only_before_the_relay_starts() -> None:
    relay = Relay(MemoryStorage(), {"default": MemoryPublisher()}, settings=fast_settings())
    async with relay:
        with pytest.raises(ConfigurationError, match="before the relay starts"):
            instrument_relay(relay, tracer_provider=TracerProvider(), metrics=False)


async def test_metrics_alone_leave_what_is_sent_as_it_was(
    reader: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    meter_provider, metric_reader = reader
    storage, publisher = MemoryStorage(), MemoryPublisher()
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    written = [Message(topic="t", key=f"k{n}", headers={"traceparent": traceparent})
               for n in range(3)]  # fmt: skip
    await storage.write(Outbox().rows(written)[1])
    relay = Relay(storage, {"default": publisher}, settings=fast_settings())
    instrument_relay(relay, meter_provider=meter_provider, traces=False)
    async with relay:
        await eventually(lambda: relay.metrics()["db0"].published == 3)
    assert [m.headers["traceparent"] for m in publisher.published] == [traceparent] * 3
    found = points(metric_reader)
    assert value(found, "relaybox_publish_messages", target="default", outcome="acked") == 3
    assert value(found, "relaybox_delivery_lag_seconds", target="default").count >= 1


def test_a_follow_up_continues_the_span_current_where_it_is_made(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, _ = spans
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    received = Incoming(id="m1", payload=b"{}", traceparent=traceparent)
    assert received.follow_up(topic="next").headers["traceparent"] == traceparent
    with provider.get_tracer("t").start_as_current_span("process") as span:
        made = received.follow_up(topic="next")
    assert made.headers["traceparent"].split("-")[2] == f"{span.get_span_context().span_id:016x}"


#: `relaybox relay --opentelemetry` in a process whose global tracer provider records
#: in memory; it prints how many send spans it made.
RELAY_PROCESS = """
import sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from relaybox.cli.main import main

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
try:
    main(sys.argv[1:])
finally:
    ended = exporter.get_finished_spans()
    print("sends:", sum(span.kind is trace.SpanKind.PRODUCER for span in ended))
"""


@pytest.mark.parametrize("flag", [["--opentelemetry"], []])
async def test_the_relay_command_traces_only_when_asked(tmp_path: Path, flag: list[str]) -> None:
    url, table = sqlite_url(tmp_path / "outbox.db"), unique_table("otel")
    await create(url, table)
    with sqlite3.connect(tmp_path / "outbox.db") as conn:
        Outbox(table=table).add(conn, [Message(topic="t", key=f"k{n}") for n in range(3)])
    command = [sys.executable, "-c", RELAY_PROCESS, "relay", "--db", url, "--table", table,
               "--broker", "default=noop://", "--max-seconds", "1", *flag]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"sends: {3 if flag else 0}" in done.stdout


@pytest.mark.parametrize(
    "traceparent",
    ["00-zz-not-a-trace", "00-00000000000000000000000000000000-b7ad6b7169203331-01", None],
)
async def test_a_message_without_a_usable_trace_is_processed_in_a_trace_of_its_own(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter], traceparent: str | None
) -> None:
    provider, exporter = spans
    async with InboxWorld("sqlite", tmp_path) as world:
        consumer = world.consumer()
        instrument_consumer(consumer, tracer_provider=provider, metrics=False)
        received = Incoming(id="m1", payload=b"{}", topic="orders", traceparent=traceparent)
        await consumer.process(received)
        assert world.effects() == {"m1": 1}
    (span,) = exporter.get_finished_spans()
    assert span.parent is None
    assert span.attributes["relaybox.outcome"] == "applied"


async def test_a_written_trace_that_is_no_trace_starts_the_send_in_a_trace_of_its_own(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    storage, publisher = MemoryStorage(), MemoryPublisher()
    written = Message(topic="t", key="k", headers={"traceparent": "garbage", "origin": "shop"})
    await storage.write(Outbox().rows(written)[1])
    relay = Relay(storage, {"default": publisher}, settings=fast_settings())
    instrument_relay(relay, tracer_provider=provider, metrics=False)
    async with relay:
        await eventually(lambda: len(publisher.published) == 1)
    (span,) = exporter.get_finished_spans()
    assert span.parent is None
    (sent,) = publisher.published
    assert sent.headers["origin"] == "shop"
    ids = span.context
    assert sent.headers["traceparent"] == (
        f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{ids.trace_flags:02x}"
    )
