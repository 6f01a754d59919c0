"""KafkaConsumer against tansu (a Kafka-protocol broker), with the inbox on PostgreSQL.

One private tansu per module, started and stopped by PID as in tests/brokers/test_kafka.py.
Every test publishes with relaybox's own Kafka publisher, so it also proves that
`decode` is the inverse of what the publisher writes. "Nothing left unacknowledged"
is read from the broker: the group's committed offset of every partition equals the
partition's end offset.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import DefaultPartitioner

from relaybox.consumers import Verdict
from relaybox.consumers.kafka import KafkaConsumer, decode, parse_servers
from relaybox.core import envelope
from relaybox.core.incoming import Incoming
from relaybox.core.records import StoredMessage
from relaybox.errors import ConfigurationError, EnvelopeError
from relaybox.inbox import Consumer
from relaybox.publishers import kafka as kafka_publisher
from relaybox.publishers import open_publisher
from tests.brokers.conformance import outcomes, started
from tests.brokers.harness import stored, unique_topic
from tests.brokers.test_kafka import TansuProcess, _wait_port_sync
from tests.consumers.conformance import (
    DEEP_JSON,
    Run,
    check_one_applied_while_the_other_waited,
    failing_once,
    idle_consumer,
    out_of_bounds,
    timed,
)
from tests.inbox.support import InboxWorld, wait_until

PARTITIONS = 3
#: Short group timings: tansu answers a JoinGroup after about half the session timeout.
FAST = {"session_timeout": 2.0, "heartbeat_interval": 0.3, "retry_delay": 0.2,
        "reconnect_wait": 0.2}  # fmt: skip


@pytest.fixture(scope="module")
def broker() -> Iterator[TansuProcess]:
    directory = Path(tempfile.mkdtemp(prefix="rbtansu-"))
    process = TansuProcess(directory)
    try:
        process.spawn()
        _wait_port_sync(process.port)
        yield process
    finally:
        process.kill()
        shutil.rmtree(directory, ignore_errors=True)


class Kafka:
    """The test's view of the broker: topics, publishing, and what a group committed."""

    def __init__(self, broker: TansuProcess) -> None:
        self.bootstrap = f"127.0.0.1:{broker.port}"
        self.topic = unique_topic()
        self.group = f"rbgroup-{self.topic}"

    async def create_topic(self) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(self.topic, PARTITIONS, 1)])
        finally:
            await admin.close()

    async def publish(self, *messages: StoredMessage) -> None:
        async with started(open_publisher(f"kafka://{self.bootstrap}?timeout=5")) as publisher:
            results = await publisher.publish(list(messages))
        assert [o.value for o in outcomes(results)] == ["acked"] * len(messages)

    async def produce_raw(self, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(self.topic, value, key=key, headers=headers)
        finally:
            await producer.stop()

    async def unacknowledged(self) -> int:
        """Records of the topic past the group's committed offsets, over all partitions."""
        partitions = [TopicPartition(self.topic, p) for p in range(PARTITIONS)]
        ends = await self._ends(partitions)
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            committed = await admin.list_consumer_group_offsets(self.group, partitions=partitions)
        finally:
            await admin.close()
        done = {tp: meta.offset for tp, meta in committed.items() if meta.offset >= 0}
        return sum(end - done.get(tp, 0) for tp, end in ends.items())

    async def _ends(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """Each partition's end offset, found by reading it all: tansu 0.6 answers
        ListOffsets(latest) with the last record *batch's* base offset + 1, so
        `end_offsets()` undercounts a partition written in multi-record batches."""
        reader = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None,
                                  enable_auto_commit=False)  # fmt: skip
        await reader.start()
        try:
            reader.assign(partitions)
            await reader.seek_to_beginning()
            ends = dict.fromkeys(partitions, 0)
            while batch := await reader.getmany(timeout_ms=300):
                for tp, records in batch.items():
                    ends[tp] = max(ends[tp], *(r.offset + 1 for r in records))
        finally:
            await reader.stop()
        return ends

    async def wait_all_acknowledged(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (left := await self.unacknowledged()) != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"{left} records not acknowledged after {timeout}s")
            await asyncio.sleep(0.1)

    def consumer(self, consumer: Consumer, **options: Any) -> KafkaConsumer:
        return KafkaConsumer(
            self.bootstrap, consumer, topics=self.topic, group_id=self.group, **{**FAST, **options}
        )


@pytest.fixture
async def kafka(broker: TansuProcess) -> Kafka:
    kafka = Kafka(broker)
    await kafka.create_topic()
    return kafka


def _key_of(message: Incoming) -> str:
    assert message.key is not None
    return message.key


# -- acceptance -------------------------------------------------------------------------


async def test_each_message_is_applied_once_in_per_key_order(
    kafka: Kafka, world: InboxWorld
) -> None:
    seen: dict[str, list[str]] = {}

    async def record(message: Incoming) -> None:
        seen.setdefault(_key_of(message), []).append(message.id)

    messages = [
        stored(kafka.topic, key=f"key-{n % 4}", payload=b'{"n": %d}' % n,
               headers={"app": "shop"}, correlation_id=f"c{n}")
        for n in range(16)
    ]  # fmt: skip
    await kafka.publish(*messages)
    consumer = world.consumer(before_effect=record)
    async with kafka.consumer(consumer):
        await wait_until(lambda: consumer.applied == 16)
        await kafka.wait_all_acknowledged()
    assert world.effects() == {str(m.id): 1 for m in messages}
    assert consumer.duplicates == 0
    published: dict[str, list[str]] = {}
    for m in messages:
        published.setdefault(m.key or "", []).append(str(m.id))
    assert seen == published


async def test_a_second_copy_is_a_duplicate_and_acknowledged(
    kafka: Kafka, world: InboxWorld
) -> None:
    twice, other = stored(kafka.topic, key="a"), stored(kafka.topic, key="b")
    await kafka.publish(twice)
    await kafka.publish(twice, other)  # the relay published it again: two copies
    consumer = world.consumer()
    async with kafka.consumer(consumer) as receiver:
        await wait_until(lambda: consumer.applied + consumer.duplicates == 3)
        await kafka.wait_all_acknowledged()
    assert world.effects() == {str(twice.id): 1, str(other.id): 1}
    assert (consumer.applied, consumer.duplicates) == (2, 1)
    assert receiver.rejected == receiver.retried == 0


async def test_a_failed_handler_gets_the_record_again_from_the_broker(
    kafka: Kafka, world: InboxWorld
) -> None:
    messages = [stored(kafka.topic, key="same") for _ in range(4)]
    flaky = str(messages[1].id)
    attempts: list[str] = []
    await kafka.publish(*messages)
    consumer = world.consumer(before_effect=failing_once(flaky, attempts))
    async with kafka.consumer(consumer) as receiver:
        await wait_until(lambda: consumer.applied == 4)
        await kafka.wait_all_acknowledged()
    assert receiver.retried == 1
    assert world.effects() == {str(m.id): 1 for m in messages}
    # Seek back: the failed record came again before anything behind it (per-key order).
    ids = [str(m.id) for m in messages]
    assert attempts == [ids[0], flaky, flaky, ids[2], ids[3]]


class CrashBeforeAck(KafkaConsumer):
    """Dies between the database commit and the offset commit of its first record."""

    crashed: asyncio.Event

    async def _commit(self, kafka: Any, partition: TopicPartition, offset: int) -> bool:
        self.crashed.set()
        await asyncio.Event().wait()  # never acknowledges; stop() cancels it here
        raise AssertionError("unreachable")


async def test_a_crash_after_commit_before_ack_redelivers_a_duplicate(
    kafka: Kafka, world: InboxWorld
) -> None:
    message = stored(kafka.topic, key="k")
    await kafka.publish(message)
    first = world.consumer()
    dying = CrashBeforeAck(kafka.bootstrap, first, topics=kafka.topic, group_id=kafka.group,
                           **FAST)  # fmt: skip
    dying.crashed = asyncio.Event()
    async with dying:
        await asyncio.wait_for(dying.crashed.wait(), 20)
    assert first.applied == 1
    assert world.effects() == {str(message.id): 1}
    assert await kafka.unacknowledged() == 1  # committed in the database, not in Kafka

    second = world.consumer()
    async with kafka.consumer(second):
        await wait_until(lambda: second.duplicates == 1)
        await kafka.wait_all_acknowledged()
    assert (second.applied, second.duplicates) == (0, 1)
    assert world.effects() == {str(message.id): 1}


async def test_two_group_members_racing_on_one_message_apply_it_once(
    kafka: Kafka, world: InboxWorld
) -> None:
    runs: list[Run] = []
    begun: list[str] = []

    async def hold(message: Incoming) -> None:
        # The first copy's transaction stays open until the other copy came in too,
        # however slowly it comes: the two race whatever the machine's speed.
        await wait_until(lambda: len(begun) == 2, timeout=30)

    one, two = (
        timed(world.consumer(before_effect=hold), "one", runs, begun),
        timed(world.consumer(before_effect=hold), "two", runs, begun),
    )
    async with kafka.consumer(one) as first, kafka.consumer(two) as second:
        await wait_until(lambda: _split(first, second), timeout=30)
        # The same message id on a partition of each member: two copies at once.
        key_one = _key_for(_assigned(first))
        key_two = _key_for(_assigned(second))
        message = stored(kafka.topic, key=key_one)
        copy = stored(kafka.topic, key=key_two, id=message.id)
        await kafka.publish(message, copy)
        await wait_until(lambda: len(runs) == 2)
        await kafka.wait_all_acknowledged()
    assert world.effects() == {str(message.id): 1}
    check_one_applied_while_the_other_waited(runs)
    assert {run.name for run in runs} == {"one", "two"}


async def test_a_rebalance_lets_the_record_in_hand_finish_and_commit(
    kafka: Kafka, world: InboxWorld
) -> None:
    entered = asyncio.Event()

    async def slow(message: Incoming) -> None:
        entered.set()
        await asyncio.sleep(0.3)

    messages = [stored(kafka.topic, key=f"key-{n % 5}") for n in range(15)]
    await kafka.publish(*messages)
    one, two = world.consumer(before_effect=slow), world.consumer(before_effect=slow)
    async with kafka.consumer(one) as first:
        await asyncio.wait_for(entered.wait(), 20)
        # A second member joins while the first is working: partitions are revoked.
        async with kafka.consumer(two) as second:
            await wait_until(lambda: one.applied + two.applied == 15, timeout=30)
            await kafka.wait_all_acknowledged()
            assert _assigned(second)
    assert world.effects() == {str(m.id): 1 for m in messages}
    # Each revoked partition's record in hand was committed before it moved on.
    assert one.duplicates + two.duplicates == 0
    assert first.rejected == second.retried == 0


def _assigned(receiver: KafkaConsumer) -> set[int]:
    kafka = receiver._kafka
    return set() if kafka is None else {tp.partition for tp in kafka.assignment()}


def _split(first: KafkaConsumer, second: KafkaConsumer) -> bool:
    one, two = _assigned(first), _assigned(second)
    return bool(one) and bool(two) and not one & two and len(one | two) == PARTITIONS


def _key_for(partitions: set[int]) -> str:
    """A key that the publisher's default partitioner puts on one of `partitions`."""
    every = list(range(PARTITIONS))
    return next(
        key
        for key in (f"race-{n}" for n in range(1000))
        if DefaultPartitioner()(key.encode(), every, every) in partitions
    )


async def test_an_unreadable_record_is_rejected_and_does_not_block_the_partition(
    kafka: Kafka, world: InboxWorld
) -> None:
    await kafka.produce_raw(b"k", b"not relaybox", [("app", b"other")])
    behind = [stored(kafka.topic, key="k") for _ in range(2)]  # same key: same partition
    await kafka.publish(*behind)
    consumer = world.consumer()
    async with kafka.consumer(consumer) as receiver:
        await wait_until(lambda: consumer.applied == 2)
        await kafka.wait_all_acknowledged()
    assert receiver.rejected == 1
    assert receiver.retried == 0
    assert world.effects() == {str(m.id): 1 for m in behind}


async def test_an_envelope_out_of_bounds_is_rejected_and_its_partition_goes_on(
    kafka: Kafka, world: InboxWorld
) -> None:
    """As the conformance case of the other brokers: rejected for good when decoded,
    or parked at the first attempt (the deep payload); the partition goes on."""
    hostile = out_of_bounds(carries_nul=True)
    for attributes in hostile:  # the same record key as the rest: the same partition
        await kafka.produce_raw(
            b"k", b"{}", [(f"ce_{n}", v.encode()) for n, v in attributes.items()]
        )
    deep = stored(kafka.topic, key="k", payload=DEEP_JSON, seq=10)
    good = stored(kafka.topic, key="k", seq=11)
    await kafka.publish(deep, good)

    async def parse(message: Incoming) -> None:
        message.json()

    consumer = world.consumer(mode="watermark", before_effect=parse)
    async with kafka.consumer(consumer) as receiver:
        await wait_until(lambda: consumer.applied + consumer.parked == 2)
        await kafka.wait_all_acknowledged()
    assert (receiver.rejected, receiver.retried) == (len(hostile), 0)
    assert world.effects() == {str(good.id): 1}
    ((parked_id, reason, attempts, error, _, _),) = world.parked()
    assert (parked_id, reason, attempts) == (str(deep.id), "invalid", 1)
    assert "deeper than" in error


async def test_stopping_while_a_partition_waits_to_retry_loses_nothing(
    kafka: Kafka, world: InboxWorld
) -> None:
    message = stored(kafka.topic, key="k")

    async def always_fail(_: Incoming) -> None:
        raise RuntimeError("down")

    await kafka.publish(message)
    failing = world.consumer(before_effect=always_fail)
    async with kafka.consumer(failing, retry_delay=5.0) as receiver:
        await wait_until(lambda: receiver.retried >= 1)
    assert await kafka.unacknowledged() == 1
    healthy = world.consumer()
    async with kafka.consumer(healthy):
        await wait_until(lambda: healthy.applied == 1)
        await kafka.wait_all_acknowledged()
    assert world.effects() == {str(message.id): 1}


# -- decode -----------------------------------------------------------------------------


class Record:
    def __init__(self, headers: list[tuple[str, bytes | None]], key: bytes | None = None,
                 value: bytes | None = b"{}") -> None:  # fmt: skip
        self.topic, self.partition, self.offset = "orders", 0, 7
        self.key, self.value, self.headers = key, value, headers


def test_decode_is_the_inverse_of_the_publisher() -> None:
    message = stored("orders", key="order-7", tenant_id="t1", headers={"app": "shop"},
                     correlation_id="corr")  # fmt: skip
    record = Record(kafka_publisher.wire_headers(message, "shop-service"), key=b"order-7",
                    value=message.payload)  # fmt: skip
    got = decode(record)
    assert got.id == str(message.id)
    assert got.source == "shop-service"
    assert got.key == "order-7"
    assert got.tenant_id == "t1"
    assert got.correlation_id == "corr"
    assert got.partition == message.partition
    assert got.sequence == message.seq
    assert got.content_type == "application/json"
    assert got.headers == {"app": "shop"}
    assert got.payload == message.payload
    assert got.topic == "orders"
    assert dict(got.attributes) == envelope.attributes(message, "shop-service")


def test_decode_rejects_what_has_no_id_or_an_unreadable_attribute() -> None:
    with pytest.raises(EnvelopeError, match="no CloudEvents id"):
        decode(Record([("app", b"shop")]))
    with pytest.raises(EnvelopeError, match="not UTF-8"):
        decode(Record([("ce_id", b"\xff\xfe")]))


def test_decode_takes_the_record_key_when_no_attribute_names_one() -> None:
    got = decode(Record([("ce_id", b"1"), ("ce_source", b"other")], key=b"k9", value=None))
    assert got.key == "k9"
    assert got.payload == b""
    assert decode(Record([("ce_id", b"1"), ("note", None)])).headers == {"note": ""}


async def test_handle_maps_decode_errors_to_reject() -> None:
    receiver = KafkaConsumer("h:1", idle_consumer(), topics="t", group_id="g")
    assert await receiver.handle(lambda: decode(Record([]))) is Verdict.REJECT
    assert receiver.rejected == 1


@pytest.mark.parametrize(
    ("given", "servers"),
    [("h:1", "h:1"), ("a, b:2", "a:9092,b:2"), ("kafka://a:1,b", "a:1,b:9092"),
     ("kafka://a:1/", "a:1")],
)  # fmt: skip
def test_parses_bootstrap_servers(given: str, servers: str) -> None:
    assert parse_servers(given) == servers


@pytest.mark.parametrize(
    ("options", "error"),
    [({"url": "kafka://a:1?timeout=3"}, "without a path or options"),
     ({"url": "nats://a"}, "without a path or options"),
     ({"url": " , "}, "no Kafka bootstrap server"),
     ({"url": "kafka://u:p@a:1/"}, "carry credentials"),
     ({"topics": []}, "name at least one topic"),
     ({"group_id": ""}, "needs a group_id"),
     ({"retry_delay": -1}, "retry_delay"),
     ({"retry_delay": 5.0, "max_retry_delay": 1.0}, "retry_delay <= max_retry_delay"),
     ({"prefetch": 0}, "prefetch"),
     ({"reconnect_wait": 0}, "reconnect_wait"),
     ({"heartbeat_interval": 20.0}, "heartbeat_interval"),
     ({"settings": {"enable_auto_commit": True}}, "may not set enable_auto_commit")],
)  # fmt: skip
def test_checks_its_options(options: dict[str, Any], error: str) -> None:
    arguments: dict[str, Any] = {"topics": "t", "group_id": "g", **options}
    url = arguments.pop("url", "h:1")
    with pytest.raises(ConfigurationError, match=error):
        KafkaConsumer(url, idle_consumer(), **arguments)


async def test_start_fails_clearly_without_a_broker(world: InboxWorld) -> None:
    from tests.brokers.harness import free_port

    receiver = KafkaConsumer(f"127.0.0.1:{free_port()}", world.consumer(), topics="t",
                             group_id="g", request_timeout=2.0)  # fmt: skip
    from relaybox.errors import BrokerUnavailableError

    with pytest.raises(BrokerUnavailableError, match="cannot consume from Kafka"):
        await receiver.start(timeout=30)
