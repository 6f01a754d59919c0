"""The publisher conformance suite: one contract, run against every real broker.

Each broker's test module subclasses `PublisherConformance` and says how to open its
harness, and declares what its broker promises:

    class TestNats(PublisherConformance):
        def open_harness(self): return nats_harness()
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from relaybox import Message
from relaybox.core import envelope
from relaybox.core.publishing import Outcome, PublishResult, transient
from relaybox.core.records import StoredMessage
from relaybox.core.retry import RetryPolicy
from relaybox.ports import Publisher
from relaybox.relay import Relay
from tests.brokers.harness import BrokerHarness, Received, stored, unique_topic
from tests.relay_support import eventually, fast_settings, outbox_db


@contextlib.asynccontextmanager
async def started(publisher: Publisher) -> AsyncIterator[Publisher]:
    await publisher.start()
    try:
        yield publisher
    finally:
        await publisher.close()


def outcomes(results: Sequence[PublishResult]) -> list[Outcome]:
    return [r.outcome for r in results]


def first_copies(received: Sequence[Received]) -> list[Received]:
    seen: set[str] = set()
    firsts = []
    for message in received:
        if message.id not in seen:
            seen.add(message.id)
            firsts.append(message)
    return firsts


def keys_in_order(received: Sequence[Received]) -> Iterator[tuple[str, list[int]]]:
    by_key: dict[str, list[int]] = {}
    for message in first_copies(received):
        by_key.setdefault(message.attributes["subject"], []).append(
            int(message.attributes["sequence"])
        )
    yield from by_key.items()


class PublisherConformance:
    """Every publisher must pass these against its real broker."""

    def open_harness(self) -> AbstractAsyncContextManager[BrokerHarness]:
        raise NotImplementedError

    @pytest.fixture
    async def harness(self) -> AsyncIterator[BrokerHarness]:
        async with self.open_harness() as harness:
            yield harness

    @pytest.fixture
    async def topic(self, harness: BrokerHarness) -> str:
        topic = unique_topic()
        await harness.prepare(topic)
        return topic

    async def test_declares_its_features(self, harness: BrokerHarness) -> None:
        assert harness.publisher().features == harness.features

    async def test_confirms_a_pipelined_call(self, harness: BrokerHarness, topic: str) -> None:
        batch = [stored(topic, key=f"k{n}", payload=b'{"n": %d}' % n) for n in range(50)]
        async with started(harness.publisher()) as publisher:
            results = await publisher.publish(batch)
        assert outcomes(results) == [Outcome.ACKED] * 50
        received = await harness.wait_for(topic, 50)
        assert sorted(r.id for r in received) == sorted(str(m.id) for m in batch)
        assert {r.payload for r in received} == {m.payload for m in batch}

    async def test_keeps_each_keys_order_across_calls(
        self, harness: BrokerHarness, topic: str
    ) -> None:
        keys = [f"key-{n}" for n in range(5)]
        async with started(harness.publisher()) as publisher:
            for _ in range(20):  # the relay's waves: one message per key per call
                results = await publisher.publish([stored(topic, key=k) for k in keys])
                assert outcomes(results) == [Outcome.ACKED] * len(keys)
        received = await harness.wait_for(topic, 100)
        for key, seqs in keys_in_order(received):
            assert seqs == sorted(seqs), f"key {key} out of order: {seqs}"
            assert len(seqs) == 20

    async def test_carries_the_envelope_and_the_payload(
        self, harness: BrokerHarness, topic: str
    ) -> None:
        traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        message = stored(
            topic, key="order-7", payload=b'{"total": 12.5, "name": "caf\xc3\xa9"}',
            headers={"app": "shop", "traceparent": traceparent},
            correlation_id="corr-1", causation_id="cause-1", tenant_id="tenant-9",
            aggregate_id="order-7", attempts=2,
        )  # fmt: skip
        async with started(harness.publisher()) as publisher:
            assert outcomes(await publisher.publish([message])) == [Outcome.ACKED]
        (got,) = await harness.wait_for(topic, 1)
        assert got.payload == message.payload
        assert got.content_type == "application/json"
        assert got.attributes == envelope.attributes(message)
        assert got.attributes["traceparent"] == traceparent
        assert got.attributes["sequence"] == str(message.seq)
        assert got.attributes["correlationid"] == "corr-1"
        assert got.headers["app"] == "shop"
        if got.key is not None:
            assert got.key == "order-7"

    async def test_strips_the_envelope_for_an_external_target(
        self, harness: BrokerHarness, topic: str
    ) -> None:
        message = stored(topic, key="k", external=True, aggregate_id="a-1", tenant_id="t")
        async with started(harness.publisher()) as publisher:
            assert outcomes(await publisher.publish([message])) == [Outcome.ACKED]
        (got,) = await harness.wait_for(topic, 1)
        assert got.attributes == envelope.attributes(message)
        assert got.attributes["tenantid"] == "t"
        assert not envelope.INTERNAL_ATTRIBUTES & got.attributes.keys()

    async def test_a_second_copy_of_one_id(self, harness: BrokerHarness, topic: str) -> None:
        message = stored(topic)
        async with started(harness.publisher()) as publisher:
            first = await publisher.publish([message])
            second = await publisher.publish([message])
        assert outcomes(first) == outcomes(second) == [Outcome.ACKED]
        expected = 1 if harness.features.deduplicates else 2
        # Every copy expected, then a quiet period: a deduplicating broker's extra copy,
        # or a third one, would arrive after the count was reached.
        received = await harness.wait_for(topic, expected)
        assert [r.id for r in received] == [str(message.id)] * expected

    async def test_a_refused_message_fails_permanently_alone(
        self, harness: BrokerHarness, topic: str
    ) -> None:
        good = [stored(topic, key=f"g{n}") for n in range(3)]
        bad = harness.rejected(topic)
        async with started(harness.publisher()) as publisher:
            results = await publisher.publish([good[0], bad, good[1], good[2]])
        assert outcomes(results) == [
            Outcome.ACKED, Outcome.PERMANENT, Outcome.ACKED, Outcome.ACKED,
        ]  # fmt: skip
        assert results[1].error
        received = await harness.wait_for(topic, 3)
        assert sorted(r.id for r in received) == sorted(str(m.id) for m in good)

    async def test_rejects_unknown_url_options(self, harness: BrokerHarness) -> None:
        from relaybox.errors import ConfigurationError

        with pytest.raises(ConfigurationError, match="unknown"):
            harness.publisher(no_such_option="1")

    async def test_fails_transiently_while_down_and_reconnects_after_restart(
        self, harness: BrokerHarness
    ) -> None:
        async with harness.throwaway() as broker:
            topic = unique_topic()
            await broker.prepare(topic)
            before = stored(topic, key="a")
            async with started(broker.publisher()) as publisher:
                assert outcomes(await publisher.publish([before])) == [Outcome.ACKED]
                await broker.stop()
                during = await _results_or_raise(publisher, [stored(topic, key="b")])
                assert outcomes(during) == [Outcome.TRANSIENT]
                # ...and says the broker is unreachable, so the relay counts no attempt.
                assert [r.unavailable for r in during] == [True], during
                await broker.start()
                await broker.prepare(topic)
                after = stored(topic, key="c")
                await eventually(lambda: _acked(publisher, after), timeout=30, interval=0.2)
            received = await broker.wait_for(topic, 2 if broker.persistent else 1)
            ids = {r.id for r in received}
            assert str(after.id) in ids
            if broker.persistent:
                assert str(before.id) in ids

    async def test_a_relay_run_survives_a_broker_restart(
        self, harness: BrokerHarness, tmp_path: Path
    ) -> None:
        """Acceptance: the broker restarts mid-run; nothing is lost, the relay carries on."""
        async with harness.throwaway() as broker:
            topic = unique_topic()
            await broker.prepare(topic)
            outbox = outbox_db("sqlite", tmp_path)
            db = await anext(outbox)
            keys = [f"key-{n}" for n in range(8)]
            written = [
                Message(topic=topic, key=k, payload={"n": n}) for n in range(40) for k in keys
            ]
            # A retry schedule longer than the restart (some 200 s): a broker coming back
            # may refuse some messages of a call while taking others (tansu answers some
            # partitions "UnknownError"); those count as attempts, since the circuit only
            # opens when whole calls fail, and fast_settings' five tries in under a second
            # would abandon them, as relaybox may once a schedule is spent.
            retry = RetryPolicy(base_delay=0.05, max_delay=0.2, jitter=0.0, max_attempts=1000)
            settings = fast_settings(publish_timeout=2.0, retry=retry)
            try:
                async with Relay(
                    db.url, {"default": broker.url}, table=db.table, settings=settings
                ):
                    await db.write(written[:160])
                    await broker.wait_for(topic, 80, timeout=30, settle=False)  # mid-run
                    await broker.stop()
                    await db.write(written[160:])
                    await asyncio.sleep(1.0)
                    await broker.start()
                    await broker.prepare(topic)
                    # A broker that keeps nothing over a restart (tansu in memory) cannot
                    # be held to arrival: tansu also loses some records it acknowledged
                    # (acks=all) in the first moments after its restart, in about one run
                    # of three under load; only their order is checked for it.
                    if broker.persistent:
                        await _all_arrive(broker, topic, written)
            finally:
                await outbox.aclose()
            received = await broker.received(topic)
            for key, seqs in keys_in_order(received):
                assert seqs == sorted(seqs), f"key {key} out of order after the restart"


async def _publish_or_raise(publisher: Publisher, batch: list[StoredMessage]) -> list[Outcome]:
    """A publish against a stopped broker: transient results, or an exception (which
    the relay counts as transient), within the publisher's own timeout."""
    return outcomes(await _results_or_raise(publisher, batch))


async def _results_or_raise(
    publisher: Publisher, batch: list[StoredMessage]
) -> Sequence[PublishResult]:
    try:
        # Three times the longest publisher timeout here (the webhook's 10 s): a publish
        # that ends by its own timeout passes on a busy machine; one that hangs fails.
        async with asyncio.timeout(30):
            return await publisher.publish(batch)
    except TimeoutError:
        raise AssertionError("a publish to a stopped broker hung past 30 s") from None
    except Exception as error:  # noqa: BLE001 - the protocol allows any exception here
        return [transient(repr(error))] * len(batch)


async def _acked(publisher: Publisher, message: StoredMessage) -> bool:
    return await _publish_or_raise(publisher, [message]) == [Outcome.ACKED]


async def _all_arrive(broker: BrokerHarness, topic: str, written: list[Message]) -> None:
    wanted = {str(m.id) for m in written}
    left = set(wanted)

    async def nothing_missing() -> bool:
        left.intersection_update(wanted - {r.id for r in await broker.received(topic)})
        return not left

    try:
        await eventually(nothing_missing, timeout=60, interval=0.2)
    except AssertionError:
        raise AssertionError(
            f"{len(left)} of {len(wanted)} messages never arrived, e.g. {sorted(left)[:3]}"
        ) from None
