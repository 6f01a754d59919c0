"""The relay engine against every backend (real PostgreSQL, MariaDB, SQLite; memory),
publishing to an in-memory publisher told to fail, reject, hang or slow down."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import sqlite3
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import asyncpg
import pytest

from relaybox import Outbox
from relaybox.core.circuit import CircuitPolicy, CircuitState
from relaybox.core.lifecycle import Status
from relaybox.core.records import StoredMessage
from relaybox.core.retry import RetryPolicy
from relaybox.errors import StorageOperationalError
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import Relay, RelaySettings, RelayThread
from tests.relay_support import (
    RELAY_BACKENDS,
    OutboxDB,
    Row,
    eventually,
    fast_settings,
    messages,
    outbox_db,
    rows,
)


@pytest.fixture(params=RELAY_BACKENDS)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(request.param, tmp_path, targets=("default", "partner")):
        yield each


def per_key(published: Sequence[StoredMessage]) -> dict[str | None, list[int]]:
    order: dict[str | None, list[int]] = defaultdict(list)
    for message in published:
        order[message.key].append(json.loads(message.payload)["n"])
    return order


def key_is(key: str) -> object:
    return lambda m: m.key == key


def relay_of(
    db: OutboxDB, default: MemoryPublisher, settings: RelaySettings | None = None
) -> Relay:
    """A relay of `db` publishing its default target to `default` (partner: a sink)."""
    return Relay(
        db.database,
        {"default": default, "partner": MemoryPublisher()},
        table=db.table,
        settings=settings or fast_settings(),
    )


async def test_delivers_every_message_once_in_key_order(db: OutboxDB) -> None:
    batch = messages([f"k{i}" for i in range(10)] + [None], per_key=20)
    await db.write(batch)
    publisher = MemoryPublisher()
    async with relay_of(db, publisher):
        await eventually(lambda: len(publisher.published) >= len(batch))
    ids = [m.id for m in publisher.published]
    assert len(ids) == len(set(ids)) == len(batch)
    for key, order in per_key(publisher.published).items():
        if key is not None:
            assert order == sorted(order), key
    assert await db.status_counts() == {}  # published_retention 0: deleted on publish


async def test_retention_keeps_published_rows(db: OutboxDB) -> None:
    await db.write(messages(["a"], per_key=3))
    publisher = MemoryPublisher()
    settings = fast_settings(published_retention=3600.0)
    async with relay_of(db, publisher, settings):
        await eventually(lambda: len(publisher.published) == 3)
        await eventually(lambda: _counts_are(db, {Status.PUBLISHED: 3}))


async def _counts_are(db: OutboxDB, expected: dict[Status, int]) -> bool:
    return await db.status_counts() == expected


async def test_a_failing_key_holds_back_only_itself_then_recovers_in_order(
    db: OutboxDB,
) -> None:
    await db.write(messages(["bad", "good1", "good2"], per_key=10))
    publisher = MemoryPublisher()
    fault = publisher.fail(key_is("bad"), times=3)
    async with relay_of(db, publisher):
        await eventually(lambda: len(publisher.published) == 30)
    assert fault.hits == 3
    order = per_key(publisher.published)
    assert order["bad"] == list(range(10))
    assert order["good1"] == order["good2"] == list(range(10))
    # the good keys did not wait for the bad one's retries
    last_good = max(i for i, m in enumerate(publisher.published) if m.key != "bad")
    first_bad = min(i for i, m in enumerate(publisher.published) if m.key == "bad")
    assert first_bad > 0
    assert last_good < len(publisher.published) - 1


async def test_no_claim_walks_a_deep_backlog_while_its_keys_are_in_flight(db: OutboxDB) -> None:
    """Few keys, many rows each: every batch holds the head of every key, so a second
    claim beside it could take nothing (and would scan the whole backlog to learn it).
    The relay claims again only once a batch settled: no claim comes back empty."""
    await db.write(messages(["a", "b", "c"], per_key=60))
    publisher = MemoryPublisher()
    publisher.slow(0.02)  # each call takes a while, as a real broker's would
    relay = relay_of(db, publisher, fast_settings(batch_size=30, max_in_flight=2))
    async with relay:
        await eventually(lambda: len(publisher.published) == 180)
        metrics = relay.processors[0].metrics
        claims, claimed = metrics.claims, metrics.claimed
    assert claimed == 180
    # 6 batches of 30, plus the idle polls (every 0.05 s) after the last one until the
    # test looks; claiming beside each batch in flight made 44-50 claims here.
    assert claims <= 6 + 6, claims
    assert per_key(publisher.published)["a"] == list(range(60))


async def test_claims_beside_full_batches_back_off_while_they_find_nothing(db: OutboxDB) -> None:
    """As many keys as a batch holds: each batch takes the head of every key and
    repeats none, so a claim beside it finds nothing. After such a claim the relay
    waits for 1, 2, 4 ... batches to settle before it tries again."""
    keys = [f"k{i}" for i in range(30)]
    await db.write(messages(keys, per_key=8))
    publisher = MemoryPublisher()
    publisher.slow(0.05)
    relay = relay_of(db, publisher, fast_settings(batch_size=30, max_in_flight=2))
    async with relay:
        await eventually(lambda: len(publisher.published) == 240)
        metrics = relay.processors[0].metrics
        claims, claimed = metrics.claims, metrics.claimed
    assert claimed == 240
    # 8 full batches, empty claims beside batches 1, 2, 4 and 8 at most, and the idle
    # polls after the last; claiming beside every batch in flight made 40-43 here.
    assert claims <= 8 + 4 + 10, claims
    order = per_key(publisher.published)
    assert all(order[key] == list(range(8)) for key in keys)


async def test_retries_follow_the_configured_backoff(db: OutboxDB) -> None:
    await db.write(messages(["k"], per_key=1))
    publisher = MemoryPublisher()
    publisher.fail(times=3)
    seen: list[float] = []
    original = publisher.publish

    async def timed(batch: Sequence[StoredMessage]) -> object:
        seen.append(time.monotonic())
        return await original(batch)

    publisher.publish = timed  # type: ignore[method-assign]
    settings = fast_settings(
        retry=RetryPolicy(base_delay=0.2, max_delay=2.0, jitter=0.0),
        circuit=CircuitPolicy(failure_threshold=100),
    )
    async with relay_of(db, publisher, settings):
        await eventually(lambda: len(publisher.published) == 1)
    gaps = [b - a for a, b in itertools.pairwise(seen)]
    assert len(gaps) == 3
    # 0.2, 0.4, 0.8 s apart (jitter 0); polling adds at most an idle interval or so
    for gap, nominal in zip(gaps, [0.2, 0.4, 0.8], strict=True):
        assert nominal - 0.02 <= gap <= nominal + 0.5, gaps


async def test_max_attempts_then_abandoned_with_the_last_error(db: OutboxDB) -> None:
    await db.write(messages(["k"], per_key=2))
    publisher = MemoryPublisher()
    publisher.fail(lambda m: json.loads(m.payload)["n"] == 0, error="broker says no")
    settings = fast_settings(
        retry=RetryPolicy(base_delay=0.01, max_delay=0.01, max_attempts=3, jitter=0.0),
        published_retention=3600.0,
        circuit=CircuitPolicy(failure_threshold=100),
    )
    async with relay_of(db, publisher, settings):
        await eventually(lambda: len(publisher.published) == 1)
    assert len(publisher.attempts) == 4  # three failed attempts, then the next message
    abandoned = await _abandoned(db)
    assert [(a.attempts, a.last_error) for a in abandoned] == [(3, "broker says no")]


async def _abandoned(db: OutboxDB) -> list[Row]:
    return [r for r in await asyncio.to_thread(rows, db) if r.status is Status.ABANDONED]


async def test_permanent_error_abandons_at_once_and_the_key_goes_on(db: OutboxDB) -> None:
    await db.write(messages(["k"], per_key=3))
    publisher = MemoryPublisher()
    publisher.reject(lambda m: json.loads(m.payload)["n"] == 1, error="too large")
    async with relay_of(db, publisher):
        await eventually(lambda: len(publisher.published) == 2)
        await eventually(lambda: _counts_are(db, {Status.ABANDONED: 1}))
    assert per_key(publisher.published)["k"] == [0, 2]
    assert [(a.attempts, a.last_error) for a in await _abandoned(db)] == [(1, "too large")]


async def test_open_circuit_pauses_its_target_burns_no_attempts(db: OutboxDB) -> None:
    batch = [*messages(["a1", "a2"], per_key=5, targets=["partner"]), *messages(["b"], per_key=5)]
    await db.write(batch)
    partner, default = MemoryPublisher(), MemoryPublisher()
    partner.fail()
    relay = Relay(db.database, {"default": default, "partner": partner}, table=db.table,
                  settings=fast_settings())  # fmt: skip
    async with relay:
        await eventually(lambda: len(default.published) == 5)  # the other target flows
        await eventually(lambda: relay.circuits["partner"].state is not CircuitState.CLOSED)
        # The failure that opened it is recorded once its batch is settled.
        await eventually(lambda: not any(p.in_flight for p in relay.processors))
        attempts_when_open = await _max_attempts(db)
        probes_before = len(partner.attempts)
        await asyncio.sleep(1.5)  # several probe periods (0.3 s, doubling to 0.6 s)
        assert len(partner.attempts) > probes_before  # it probes
        assert await _max_attempts(db) == attempts_when_open <= 3  # ...for free
        partner.heal()
        await eventually(lambda: len(partner.published) == 10)
    assert relay.circuits["partner"].state is CircuitState.CLOSED
    assert per_key(partner.published)["a1"] == list(range(5))


async def test_an_outage_longer_than_the_retry_schedule_abandons_nothing(db: OutboxDB) -> None:
    await db.write(messages(["a", "b", None], per_key=4))
    publisher = MemoryPublisher()
    down = publisher.down()
    # The whole schedule (2 attempts, 0.05 s apart) is far shorter than the outage.
    settings = fast_settings(
        retry=RetryPolicy(base_delay=0.05, max_delay=0.05, max_attempts=2, jitter=0.0),
        circuit=CircuitPolicy(failure_threshold=3, open_seconds=0.1, max_open_seconds=0.2),
        published_retention=3600.0,
    )
    async with relay_of(db, publisher, settings):
        await eventually(lambda: down.hits >= 10)  # tried, circuit opened, probed again
        await asyncio.sleep(1.0)
        assert await _max_attempts(db) == 0
        publisher.heal()
        await eventually(lambda: len(publisher.published) == 12)
    assert await _abandoned(db) == []
    assert per_key(publisher.published)["a"] == list(range(4))


async def _max_attempts(db: OutboxDB) -> int:
    return max((r.attempts for r in await asyncio.to_thread(rows, db)), default=0)


async def test_a_hanging_publish_times_out_and_is_retried(db: OutboxDB) -> None:
    await db.write(messages(["k"], per_key=2))
    publisher = MemoryPublisher()
    hang = publisher.hang()
    settings = fast_settings(publish_timeout=0.2)
    async with relay_of(db, publisher, settings):
        await eventually(lambda: hang.hits >= 2)
        publisher.heal()
        await eventually(lambda: len(publisher.published) >= 2)
    assert per_key(publisher.published)["k"][-2:] == [0, 1]


async def test_long_publishes_renew_their_lease(db: OutboxDB) -> None:
    await db.write(messages(["k"], per_key=1))
    slow, rival_publisher = MemoryPublisher(), MemoryPublisher()
    slow.slow(2.0)
    settings = fast_settings(lease_seconds=0.6, publish_timeout=10.0, partition_leases=False)
    async with relay_of(db, slow, settings):
        await eventually(lambda: len(slow.attempts) == 1)
        async with relay_of(db, rival_publisher, settings):
            await eventually(lambda: len(slow.published) == 1, timeout=5)
            await asyncio.sleep(0.3)
    assert rival_publisher.attempts == []  # the lease never lapsed while publishing


async def test_stop_releases_what_is_in_flight_within_the_timeout(db: OutboxDB) -> None:
    await db.write(messages(["k1", "k2"], per_key=2))
    publisher = MemoryPublisher()
    publisher.hang()
    relay = relay_of(db, publisher)
    await relay.start()
    await eventually(lambda: len(publisher.attempts) == 2)
    started = time.monotonic()
    await relay.stop(timeout=0.3)
    assert time.monotonic() - started < 2.0
    found = await asyncio.to_thread(rows, db)
    assert [(r.status, r.attempts) for r in found] == [(Status.PENDING, 0)] * 4


async def test_a_worker_that_cannot_renew_stops_at_its_lease_and_another_takes_over(
    db: OutboxDB,
) -> None:
    """Relay A's renewals fail mid-publish: its publish is cut off when its lease runs
    out (so it cannot land after the next worker's), relay B publishes the row, and A
    records nothing. (That a mark with a stale token changes nothing is checked for
    every backend in tests/conformance.)"""
    await db.write(messages(["k"], per_key=1))
    slow, rival = MemoryPublisher(), MemoryPublisher()
    slow.slow(1.5)
    settings = fast_settings(lease_seconds=0.6, partition_leases=False,
                             published_retention=3600.0)  # fmt: skip
    # One batch in flight: A claims nothing more while its slow publish runs.
    one_batch = dataclasses.replace(settings, max_in_flight=1)
    stale = relay_of(db, slow, one_batch)
    async with stale:
        for processor in stale.processors:
            processor._db = dataclasses.replace(  # cut A's renewals
                processor._db, settles=_NoRenew(processor._db.settles)
            )
        await eventually(lambda: len(slow.attempts) == 1)
        async with relay_of(db, rival, settings):
            await eventually(lambda: len(rival.published) == 1, timeout=5)
            await asyncio.sleep(1.5)  # A's publish would have finished by now
    assert slow.published == []  # cut off at its lease
    assert sum(p.metrics.published for p in stale.processors) == 0
    assert sum(p.metrics.leases_lost for p in stale.processors) >= 1
    assert [(r.status, r.attempts) for r in await asyncio.to_thread(rows, db)] == [
        (Status.PUBLISHED, 0)
    ]


class _Passthrough:
    """A settle connection that a subclass cuts for some calls."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


class _NoRenew(_Passthrough):
    """A settle connection that is cut: renewals (and releases) fail."""

    async def renew(self, token: str, seqs: Sequence[int], lease_seconds: float) -> int:
        raise StorageOperationalError("connection cut (test)")

    async def release(self, token: str, seqs: Sequence[int]) -> int:
        raise StorageOperationalError("connection cut (test)")


async def test_cleanup_honours_both_retention_windows(db: OutboxDB) -> None:
    await db.write(messages(["k"], per_key=3))
    publisher = MemoryPublisher()
    publisher.reject(lambda m: json.loads(m.payload)["n"] == 2)
    settings = fast_settings(published_retention=1.0, abandoned_retention=3.0,
                             cleanup_interval=0.1)  # fmt: skip
    async with relay_of(db, publisher, settings):
        await eventually(lambda: _counts_are(db, {Status.PUBLISHED: 2, Status.ABANDONED: 1}))
        settled = time.monotonic()
        await eventually(lambda: _counts_are(db, {Status.ABANDONED: 1}), timeout=5)
        published_gone = time.monotonic() - settled
        await eventually(lambda: _counts_are(db, {}), timeout=8)
        abandoned_gone = time.monotonic() - settled
    # each window is honoured (not purged early), and purging follows within a few polls
    assert 0.5 < published_gone < 2.5, published_gone
    assert 2.5 < abandoned_gone < 5.0, abandoned_gone


@pytest.fixture
async def sqlite_db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("sqlite", tmp_path, targets=("default", "partner")):
        yield each


@pytest.fixture
async def pg_db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path, targets=("default", "partner")):
        yield each


async def test_an_attached_outbox_wakes_an_idle_relay_at_once(sqlite_db: OutboxDB) -> None:
    """Seed 001: a commit in the relay's own process is picked up without polling."""
    db = sqlite_db
    outbox = Outbox(table=db.table, targets=["default", "partner"])
    publisher = MemoryPublisher()
    settings = fast_settings(idle_interval=30.0, min_poll_interval=30.0)
    async with relay_of(db, publisher, settings) as relay:
        relay.attach(outbox)
        await asyncio.sleep(0.2)  # the first (empty) claim is done; now it would sleep 30 s
        with sqlite3.connect(db.url.removeprefix("sqlite:///")) as conn:
            written = outbox.add(conn, messages(["k"], per_key=1))
        outbox.committed(written)
        started = time.monotonic()
        await eventually(lambda: len(publisher.published) == 1, timeout=5)
        assert time.monotonic() - started < 1.0


async def test_a_notify_from_another_process_wakes_an_idle_relay(pg_db: OutboxDB) -> None:
    db = pg_db
    outbox = Outbox(table=db.table, targets=["default", "partner"], notify=True)
    publisher = MemoryPublisher()
    settings = fast_settings(idle_interval=30.0, min_poll_interval=30.0)
    async with relay_of(db, publisher, settings):
        await asyncio.sleep(0.3)
        conn = await asyncpg.connect(db.url)
        try:
            async with conn.transaction():
                await outbox.add_async(conn, messages(["k"], per_key=1))
        finally:
            await conn.close()
        started = time.monotonic()  # not announced in-process: only the NOTIFY can wake it
        await eventually(lambda: len(publisher.published) == 1, timeout=5)
        assert time.monotonic() - started < 1.0


async def test_relay_thread_runs_a_relay_for_sync_code(sqlite_db: OutboxDB) -> None:
    db = sqlite_db
    publisher = MemoryPublisher()
    await db.write(messages(["a", "b"], per_key=5))

    def run() -> None:
        with RelayThread(lambda: relay_of(db, publisher)):
            deadline = time.monotonic() + 15
            while len(publisher.published) < 10 and time.monotonic() < deadline:
                time.sleep(0.02)

    await asyncio.to_thread(run)
    assert len(publisher.published) == 10
    assert await db.status_counts() == {}


async def test_an_unrecorded_failure_holds_back_its_keys_later_successes(db: OutboxDB) -> None:
    """K:0 is refused for good, K:1 goes out; if the abandon of K:0 cannot be recorded,
    K:1 is not recorded as published either, so neither comes back out of order."""
    await db.write(messages(["k"], per_key=2))
    publisher = MemoryPublisher()
    publisher.reject(lambda m: json.loads(m.payload)["n"] == 0, error="too large")
    settings = fast_settings(lease_seconds=0.8, published_retention=3600.0,
                             partition_leases=False)  # fmt: skip
    relay = relay_of(db, publisher, settings)
    async with relay:
        cut = [_NoAbandon(p._db.settles) for p in relay.processors]
        for processor, settles in zip(relay.processors, cut, strict=True):
            processor._db = dataclasses.replace(processor._db, settles=settles)
        await eventually(lambda: len(publisher.published) >= 1)
        await asyncio.sleep(0.2)
        assert {r.status for r in await asyncio.to_thread(rows, db)} == {Status.PROCESSING}
        for settles in cut:
            settles.healed = True
        await eventually(lambda: _counts_are(db, {Status.ABANDONED: 1, Status.PUBLISHED: 1}))


class _NoAbandon(_Passthrough):
    """A settle connection on which abandons fail until it is `healed`."""

    healed = False

    async def abandon(self, token: str, failures: Sequence[object]) -> int:
        if self.healed:
            return await self._inner.abandon(token, failures)  # type: ignore[attr-defined,no-any-return]
        raise StorageOperationalError("connection cut (test)")


# Relays that hold their partitions (the default): reads that write nothing.


async def test_row_leases_deliver_every_message_once_in_key_order(db: OutboxDB) -> None:
    batch = messages([f"k{i}" for i in range(6)] + [None], per_key=15)
    await db.write(batch)
    publisher = MemoryPublisher()
    publisher.fail(key_is("k0"), times=2)
    async with relay_of(db, publisher, fast_settings(partition_leases=False)):
        await eventually(lambda: len(publisher.published) >= len(batch))
    ids = [m.id for m in publisher.published]
    assert len(ids) == len(set(ids)) == len(batch)
    for key, order in per_key(publisher.published).items():
        if key is not None:
            assert order == list(range(15)), key
    assert await db.status_counts() == {}


async def test_a_relay_whose_partition_lease_lapses_stops_and_another_takes_over(
    db: OutboxDB,
) -> None:
    """Relay A's heartbeats fail mid-publish: its publish is cut off before its
    partition lease runs out (so it cannot land after the next owner's), relay B takes
    the partitions once the lease has run out and publishes the row; A records nothing."""
    await db.write(messages(["k"], per_key=1))
    slow, rival = MemoryPublisher(), MemoryPublisher()
    slow.slow(1.5)
    settings = fast_settings(lease_seconds=0.6, published_retention=3600.0)
    stale = relay_of(db, slow, dataclasses.replace(settings, max_in_flight=1))
    async with stale:
        await eventually(lambda: len(slow.attempts) == 1)
        for processor in stale.processors:  # cut A's heartbeats
            processor._db = dataclasses.replace(
                processor._db, housekeeping=_NoHeartbeat(processor._db.housekeeping)
            )
        async with relay_of(db, rival, settings):
            await eventually(lambda: len(rival.published) == 1, timeout=5)
            await asyncio.sleep(1.5)  # A's publish would have finished by now
    assert slow.published == []  # cut off at its lease
    assert sum(p.metrics.published for p in stale.processors) == 0
    assert sum(p.metrics.leases_lost for p in stale.processors) >= 1
    assert [(r.status, r.attempts) for r in await asyncio.to_thread(rows, db)] == [
        (Status.PUBLISHED, 0)
    ]


class _NoHeartbeat(_Passthrough):
    """A housekeeping connection that is cut: heartbeats fail."""

    async def heartbeat(self, worker: str, **options: object) -> object:
        raise StorageOperationalError("connection cut (test)")


async def test_a_settle_that_cannot_be_recorded_leaves_the_batch_to_be_read_again(
    db: OutboxDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settle is one atomic statement: if it never gets through, nothing of the
    batch is recorded and its rows are read again, in order (published twice, never
    out of order); once the settles get through, every row ends settled."""
    import relaybox.relay.processor

    monkeypatch.setattr(relaybox.relay.processor, "SETTLE_RETRY_DELAYS", (0.01,))
    await db.write(messages(["k"], per_key=3))
    publisher = MemoryPublisher()
    publisher.reject(lambda m: json.loads(m.payload)["n"] == 0, error="too large")
    relay = relay_of(db, publisher, fast_settings(published_retention=3600.0))
    async with relay:
        cut = [_NoSettle(p._db.settles) for p in relay.processors]
        for processor, settles in zip(relay.processors, cut, strict=True):
            processor._db = dataclasses.replace(processor._db, settles=settles)
        await eventually(lambda: len(publisher.published) >= 4)  # k:1, k:2 twice
        assert {r.status for r in await asyncio.to_thread(rows, db)} == {Status.PENDING}
        for settles in cut:
            settles.healed = True
        await eventually(lambda: _counts_are(db, {Status.ABANDONED: 1, Status.PUBLISHED: 2}))
    sent = [json.loads(m.payload)["n"] for m in publisher.attempts]
    assert sent[:3] == [0, 1, 2]
    assert all(sent[i : i + 3] == [0, 1, 2] for i in range(0, len(sent) - 2, 3)), sent


class _NoSettle(_Passthrough):
    """A settle connection on which owned settles fail until it is `healed`."""

    healed = False

    async def settle(self, worker: str, **outcomes: object) -> object:
        if self.healed:
            return await self._inner.settle(worker, **outcomes)  # type: ignore[attr-defined]
        raise StorageOperationalError("connection cut (test)")


async def test_partitions_in_flight_drain_before_a_joining_relay_takes_them(
    db: OutboxDB,
) -> None:
    """A second relay joins while the first has batches in flight: the first gives
    back only partitions with nothing in flight, so no row is published twice."""
    keys = [f"k{i}" for i in range(40)]
    await db.write(messages(keys, per_key=10))
    first, second = MemoryPublisher(), MemoryPublisher()
    first.slow(0.1)
    second.slow(0.1)
    settings = fast_settings(batch_size=20)
    async with relay_of(db, first, settings):
        await eventually(lambda: len(first.attempts) >= 20)
        async with relay_of(db, second, settings) as joined:
            await eventually(lambda: len(first.published) + len(second.published) >= 400)
            assert all(p.partitions for p in joined.processors)
    ids = [m.id for m in first.published + second.published]
    assert len(ids) == len(set(ids)) == 400
    assert second.published, "the second relay took partitions over"
    both = sorted(first.published + second.published, key=lambda m: m.seq)
    for key, order in per_key(both).items():
        assert order == list(range(10)), key
