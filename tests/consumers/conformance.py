"""The broker consumer conformance suite: one contract, run against every real broker.

Each broker's test module subclasses `ConsumerConformance` and says how to open its
harness (as tests/brokers/conformance.py does for the publishers):

    class TestNatsConsumer(ConsumerConformance):
        def open_harness(self): return NatsHarness()

A broker that meets a case in its own way overrides that case (MQTT retries a failed
handler in place, and runs the crash case at each QoS; RabbitMQ runs the retry case on
each queue type). The cases take the `world` fixture: the inbox on PostgreSQL
(tests/consumers/conftest.py), unless the module gives its own. Kafka and webhooks
have cases of their own shape (a group's partitions, a publisher that resends) and
share only the helpers below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from relaybox.consumers import BrokerConsumer
from relaybox.core.incoming import Incoming
from relaybox.core.records import StoredMessage
from relaybox.inbox import Consumer, Inbox, Processed
from tests.brokers.harness import stored
from tests.consumers.harness import ConsumerHarness, counting_arrivals, dies_before_acking
from tests.inbox.support import Hook, InboxWorld, wait_until


def recorder(seen: list[Incoming]) -> Callable[[Incoming], Any]:
    async def record(message: Incoming) -> None:
        seen.append(message)

    return record


def failing_once(failing: str, attempts: list[str]) -> Hook:
    """A hook that notes in `attempts` the id of each message it runs for, and fails
    the first run for the message `failing`."""

    async def fail_once(message: Incoming) -> None:
        attempts.append(message.id)
        if message.id == failing and attempts.count(failing) == 1:
            raise RuntimeError("the handler fails the first time")

    return fail_once


def check_carries_the_envelope(got: Incoming, message: StoredMessage, topic: str) -> None:
    """`got` is `message`, published with headers {"app": "shop", "traceparent":
    "00-ab-cd-01"}, correlation "corr", tenant "t1" and aggregate "order-1", decoded
    with every attribute the publisher sends."""
    assert (got.id, got.payload, got.topic) == (str(message.id), message.payload, topic)
    assert got.headers == {"app": "shop", "traceparent": "00-ab-cd-01"}
    assert set(got.attributes) == {
        "specversion", "id", "source", "type", "time", "subject", "partitionkey",
        "correlationid", "tenantid", "aggregateid", "traceparent", "sequence",
        "partition", "attempts",
    }  # fmt: skip
    assert (got.correlation_id, got.tenant_id, got.key, got.type) == (
        "corr", "t1", "k", "order.created",
    )  # fmt: skip
    assert (got.partition, got.sequence, got.traceparent) == (3, message.seq, "00-ab-cd-01")
    assert got.time == message.occurred_at


def idle_consumer() -> Consumer:
    """A `Consumer` that is never asked to process anything (for option checks)."""

    def unreachable() -> Any:
        raise AssertionError("not reached")

    return Consumer(lambda message, conn: None, inbox=Inbox(consumer="x"),
                    transaction=unreachable)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Run:
    """One `Consumer.process` call: whose, when, and what came of it."""

    name: str
    began: float
    ended: float
    outcome: Processed


def timed(
    consumer: Consumer, name: str, runs: list[Run], begun: list[str] | None = None
) -> Consumer:
    """Make `consumer` note each `process` call in `runs` as it ends, and its name in
    `begun` as it begins."""
    process = consumer.process

    async def timed_process(message: Incoming, **options: Any) -> Processed:
        began = time.monotonic()
        if begun is not None:
            begun.append(name)
        outcome = await process(message, **options)
        runs.append(Run(name, began, time.monotonic(), outcome))
        return outcome

    consumer.process = timed_process  # type: ignore[method-assign]
    return consumer


def check_one_applied_while_the_other_waited(runs: list[Run]) -> None:
    assert sorted(run.outcome.value for run in runs) == ["applied", "duplicate"]
    applied = next(run for run in runs if run.outcome is Processed.APPLIED)
    duplicate = next(run for run in runs if run.outcome is Processed.DUPLICATE)
    assert duplicate.began < applied.ended  # they overlapped: the duplicate waited on the first


#: The attributes of a valid envelope in partition 3 (the one `stored` messages take).
BASE_ATTRIBUTES = {
    "specversion": "1.0", "source": "relaybox", "type": "order.created", "partition": "3",
}  # fmt: skip
#: A payload nested deeper than anything decodes it (json.loads ran out of stack).
DEEP_JSON = b"[" * 10_000 + b"]" * 10_000


def out_of_bounds(carries_nul: bool) -> list[dict[str, str]]:
    """Envelopes with a value no inbox stores as it is, each of partition 3."""
    found = [
        {**BASE_ATTRIBUTES, "id": "sequence-past-int64", "sequence": str(2**63)},
        {**BASE_ATTRIBUTES, "id": "x" * 256, "sequence": "5"},
        {**BASE_ATTRIBUTES, "id": "key-too-long", "sequence": "6", "subject": "k" * 300,
         "partitionkey": "k" * 300},
        {**BASE_ATTRIBUTES, "id": "partition-past-int32", "sequence": "7",
         "partition": str(2**31)},
    ]  # fmt: skip
    if carries_nul:
        found.append({**BASE_ATTRIBUTES, "id": "nul\x00id", "sequence": "8"})
        found.append({**BASE_ATTRIBUTES, "id": "nul-source", "source": "re\x00laybox",
                      "sequence": "9"})  # fmt: skip
    return found


class ConsumerConformance:
    """Every broker consumer must pass these against its real broker."""

    def open_harness(self) -> ConsumerHarness:
        raise NotImplementedError

    @pytest.fixture
    async def harness(self) -> AsyncIterator[ConsumerHarness]:
        async with self.open_harness() as harness:
            yield harness

    async def test_applies_each_message_once_in_per_key_order(
        self, world: InboxWorld, harness: ConsumerHarness
    ) -> None:
        seen: list[Incoming] = []
        messages = [stored(harness.topic, key=f"k{n % 3}", payload=b'{"n": %d}' % n)
                    for n in range(12)]  # fmt: skip
        await harness.prepare()
        async with harness.consumer(world.consumer(before_effect=recorder(seen))) as consumer:
            await harness.publish(*messages)
            await wait_until(lambda: consumer.consumer.applied == 12)
            await harness.settling()
        assert world.effects() == {str(m.id): 1 for m in messages}
        assert (consumer.consumer.applied, consumer.consumer.duplicates) == (12, 0)
        for key in ("k0", "k1", "k2"):
            expected = [str(m.id) for m in messages if m.key == key]
            assert [m.id for m in seen if m.key == key] == expected
        first = seen[0]
        assert (first.topic, first.payload) == (harness.topic, messages[0].payload)
        assert (first.content_type, first.sequence) == ("application/json", messages[0].seq)
        assert first.delivery_count == harness.first_delivery_count
        await harness.check_settled(consumer)

    async def test_an_envelope_out_of_bounds_is_rejected_and_its_partition_goes_on(
        self, world: InboxWorld, harness: ConsumerHarness
    ) -> None:
        """A value no inbox could store as it is (a sequence past 2**63 - 1, a NUL, an id
        or key longer than its column) is rejected for good when it is decoded, and a
        payload nested 10,000 deep is parked at its first attempt: none is retried for
        ever, and the next message of their partition is applied by a watermark inbox."""
        hostile = out_of_bounds(harness.carries_nul)
        deep = stored(harness.topic, payload=DEEP_JSON, seq=10)
        good = stored(harness.topic, seq=11)

        async def parse(message: Incoming) -> None:
            message.json()

        await harness.prepare()
        consumer = world.consumer(mode="watermark", before_effect=parse)
        async with harness.consumer(consumer) as running:
            for attributes in hostile:
                await harness.publish_envelope(attributes, b"{}")
            await harness.publish(deep, good)
            await wait_until(lambda: running.consumer.applied + running.consumer.parked == 2)
            await harness.settling()
        assert running.rejected == len(hostile)
        assert running.consumer.failures == 1  # the deep one, once
        assert world.effects() == {str(good.id): 1}
        ((parked_id, reason, attempts, error, _, _),) = world.parked()
        assert (parked_id, reason, attempts) == (str(deep.id), "invalid", 1)
        assert "deeper than" in error
        await harness.check_settled(running)

    async def test_a_second_copy_is_a_duplicate_and_acknowledged(
        self, world: InboxWorld, harness: ConsumerHarness
    ) -> None:
        message = stored(harness.topic)

        async def publish_two_copies() -> None:
            await harness.publish(message)
            await harness.publish_copy(message)

        await harness.prepare()
        if harness.holds_messages:  # both copies wait on the broker for the consumer
            await publish_two_copies()
            assert await harness.held() == 2
        async with harness.consumer(world.consumer()) as consumer:
            if not harness.holds_messages:
                await publish_two_copies()
            await wait_until(lambda: consumer.consumer.duplicates == 1)
            await harness.settling()
        assert world.effects() == {str(message.id): 1}
        assert (consumer.consumer.applied, consumer.consumer.duplicates) == (1, 1)
        await harness.check_settled(consumer)  # both copies acknowledged

    async def test_a_failed_handler_is_retried_and_applied_once(
        self, world: InboxWorld, harness: ConsumerHarness
    ) -> None:
        messages = [stored(harness.topic, key=f"k{n}") for n in range(5)]
        failing = str(messages[2].id)
        deliveries: list[int | None] = []

        async def fail_once(message: Incoming) -> None:
            if message.id == failing:
                deliveries.append(message.delivery_count)
                if len(deliveries) == 1:
                    raise RuntimeError("the handler fails the first time")

        await harness.prepare()
        async with harness.retrying(world.consumer(before_effect=fail_once)) as consumer:
            await harness.publish(*messages)
            await wait_until(lambda: consumer.consumer.applied == 5)
            await harness.settling()
        assert world.effects() == {str(m.id): 1 for m in messages}
        assert (consumer.consumer.applied, consumer.consumer.duplicates) == (5, 0)
        assert consumer.retried == 1
        assert deliveries == list(harness.retry_delivery_counts)
        await harness.check_settled(consumer)

    async def test_a_crash_after_commit_is_redelivered_and_skipped(
        self, world: InboxWorld, harness: ConsumerHarness
    ) -> None:
        message = stored(harness.topic)
        await harness.prepare()
        crashing = harness.crashing(world.consumer())
        committed = dies_before_acking(crashing)
        async with crashing:
            await harness.publish(message)
            await asyncio.wait_for(committed.wait(), 20)
        assert world.effects() == {str(message.id): 1}
        await harness.check_unsettled()  # committed, never acknowledged

        seen: list[Incoming] = []
        fresh = harness.successor(crashing, world.consumer(before_effect=recorder(seen)))
        async with fresh:
            await wait_until(lambda: fresh.consumer.duplicates == 1)
            await harness.settling()
        assert world.effects() == {str(message.id): 1}
        assert (crashing.consumer.applied, crashing.consumer.duplicates) == (1, 0)
        assert (fresh.consumer.applied, fresh.consumer.duplicates) == (0, 1)
        assert seen == []  # the handler did not run again
        await harness.check_settled(fresh)

    async def test_two_consumers_racing_on_one_message_apply_it_once(
        self, world: InboxWorld, harness: ConsumerHarness
    ) -> None:
        arrived: list[BrokerConsumer] = []

        async def hold_the_first_copy(message: Incoming) -> None:
            # Keep this transaction open until the rival copy has arrived too, and then a
            # little longer, so the rival's inbox check waits on this uncommitted record.
            await wait_until(lambda: len(arrived) == 2, timeout=10)
            await asyncio.sleep(0.3)

        def racer() -> BrokerConsumer:
            consumer = harness.racer(world.consumer(before_effect=hold_the_first_copy))
            return counting_arrivals(consumer, arrived)

        message = stored(harness.topic)
        await harness.prepare()
        async with racer() as one, racer() as two:
            await harness.publish(message)
            if harness.competing:  # otherwise each racer gets a copy of the one message
                await harness.publish_copy(message)
            await wait_until(lambda: one.consumer.duplicates + two.consumer.duplicates == 1)
            await harness.settling()
        assert world.effects() == {str(message.id): 1}
        assert sorted(arrived, key=id) == sorted([one, two], key=id)  # one copy each
        counts = sorted([(c.consumer.applied, c.consumer.duplicates) for c in (one, two)])
        assert counts == [(0, 1), (1, 0)]
        await harness.check_settled(one, two)

    async def test_an_undecodable_message_is_rejected_and_does_not_block(
        self, world: InboxWorld, harness: ConsumerHarness
    ) -> None:
        messages = [stored(harness.topic, key=f"k{n}") for n in range(3)]
        consumer = await harness.rejecting(world.consumer())
        await harness.prepare()
        async with consumer:
            await harness.publish_undecodable()
            await harness.publish(*messages)
            await wait_until(lambda: consumer.consumer.applied == 3)
            await harness.settling()
            await asyncio.sleep(harness.redelivery_wait)  # a rejected one is not redelivered
        assert consumer.rejected == 1
        assert world.effects() == {str(m.id): 1 for m in messages}
        await harness.check_settled(consumer)
        await harness.check_rejected()

    async def test_a_message_that_always_fails_is_parked_and_does_not_block(
        self, world: InboxWorld, harness: ConsumerHarness
    ) -> None:
        messages = [stored(harness.topic, key=f"k{n}") for n in range(3)]
        poison = str(messages[1].id)
        runs: list[int | None] = []

        async def always_fail(message: Incoming) -> None:
            if message.id == poison:
                runs.append(message.delivery_count)
                raise RuntimeError("this message always fails")

        await harness.prepare()
        consumer = harness.retrying(world.consumer(before_effect=always_fail))
        consumer.max_attempts = 3
        async with consumer:
            await harness.publish(*messages)
            await wait_until(
                lambda: (consumer.consumer.applied, consumer.consumer.parked) == (2, 1), timeout=60
            )
            await harness.settling()
        assert world.effects() == {str(m.id): 1 for m in messages if str(m.id) != poison}
        assert len(runs) == 3  # bounded: three attempts, then parked
        ((message_id, reason, attempts, error, payload, status),) = world.parked()
        assert (message_id, reason, attempts, status) == (poison, "failed", 3, "parked")
        assert "this message always fails" in error
        assert payload == messages[1].payload
        await harness.check_settled(consumer)  # the parked message was acknowledged
