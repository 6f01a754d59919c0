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
from typing import Any

import asyncpg
import pytest

from relaybox import Message, Outbox
from relaybox.core.circuit import CircuitPolicy, CircuitState
from relaybox.core.lifecycle import Status
from relaybox.core.publishing import PublishResult
from relaybox.core.records import Failure, StoredMessage
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


def held_by(relay: Relay, target: str = "default") -> frozenset[int]:
    """The partitions of `target` that `relay` holds in its one database."""
    return (relay.processors[0].partitions or {}).get(target, frozenset())


class _Passthrough:
    """A connection of a relay's that a subclass cuts, or watches, for some calls."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


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


class _HeldCalls(MemoryPublisher):
    """Publishes nothing until released; counts its calls waiting at once."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0
        self.most = 0
        self.release = asyncio.Event()

    async def _hold(self) -> None:
        await self.release.wait()

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        self.waiting += 1
        self.most = max(self.most, self.waiting)
        try:
            await self._hold()
        finally:
            self.waiting -= 1
        return await super().publish(messages)


async def test_by_default_three_batches_go_in_flight_where_reads_go_behind_them(
    db: OutboxDB,
) -> None:
    """Unset, max_in_flight follows the database: 3 where a read takes the rows behind
    batches in flight (PostgreSQL, the in-memory storage), 2 on MySQL and SQLite."""
    await db.write(messages([f"k{i}" for i in range(40)], per_key=1))
    publisher = _HeldCalls()
    settings = fast_settings(batch_size=5)
    assert settings.max_in_flight is None
    expected = 3 if db.name in ("postgresql", "memory") else 2
    async with relay_of(db, publisher, settings) as relay:
        await eventually(lambda: publisher.waiting == expected)
        await asyncio.sleep(0.2)  # room for a claim the limit should not let in
        assert publisher.most == expected
        assert relay.processors[0].max_in_flight == expected
        assert relay.processors[0].in_flight_now == expected  # alone: every partition
        publisher.release.set()
        await eventually(lambda: len(publisher.published) == 40)
    assert publisher.most == expected


@pytest.mark.parametrize("max_in_flight", [None, 2])
async def test_relays_sharing_the_partitions_keep_their_share_of_batches_in_flight(
    db: OutboxDB, max_in_flight: int | None
) -> None:
    """Unset, max_in_flight is a fleet's: two relays holding half the partitions each
    keep one batch in flight each (half of 3 or 2, rounded down). Set, each keeps it."""
    first, second = _HeldCalls(), _HeldCalls()
    settings = fast_settings(batch_size=5, max_in_flight=max_in_flight)
    async with relay_of(db, first, settings) as a, relay_of(db, second, settings) as b:
        held = lambda: [len((r.processors[0].partitions or {}).get("default", ())) for r in (a, b)]  # noqa: E731
        await eventually(lambda: held() == [4, 4], timeout=20)
        await db.write(messages([f"k{i}" for i in range(80)], per_key=1))
        expected = 1 if max_in_flight is None else max_in_flight
        await eventually(lambda: (first.waiting, second.waiting) == (expected, expected))
        await asyncio.sleep(0.3)  # room for a claim the share should not let in
        assert (first.most, second.most) == (expected, expected)
        assert [r.processors[0].in_flight_now for r in (a, b)] == [expected] * 2
        first.release.set()
        second.release.set()
        await eventually(lambda: len(first.published) + len(second.published) == 80)


class _SlowCalls(_HeldCalls):
    """Takes `seconds` over each call; counts its calls running at once."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def _hold(self) -> None:
        await asyncio.sleep(self.seconds)


async def test_relays_sharing_the_partitions_go_deeper_when_their_brokers_are_slow(
    db: OutboxDB,
) -> None:
    """A fleet keeps fewer batches in flight only while the database is what they wait
    for: where each publish takes far longer than a read, two relays holding half the
    partitions each go as deep as one relay would."""
    first, second = _SlowCalls(0.25), _SlowCalls(0.25)
    settings = fast_settings(batch_size=5)
    async with relay_of(db, first, settings) as a, relay_of(db, second, settings) as b:
        held = lambda: [len((r.processors[0].partitions or {}).get("default", ())) for r in (a, b)]  # noqa: E731
        await eventually(lambda: held() == [4, 4], timeout=20)
        await db.write(messages([f"k{i}" for i in range(160)], per_key=1))
        await eventually(lambda: len(first.published) + len(second.published) == 160, timeout=30)
        limit = a.processors[0].max_in_flight
        assert [r.processors[0].in_flight_now for r in (a, b)] == [limit, limit]
    assert (first.most, second.most) == (limit, limit)


async def test_no_claim_walks_a_deep_backlog_while_its_keys_are_in_flight(db: OutboxDB) -> None:
    """Few keys, many rows each: every batch holds the head of every key, so a second
    claim beside it could take nothing (and would scan the whole backlog to learn it).
    The relay claims again only once a batch settled: no claim comes back empty."""
    await db.write(messages(["a", "b", "c"], per_key=60))
    publisher = MemoryPublisher()
    publisher.slow(0.02)  # each call takes a while, as a real broker's would
    relay = relay_of(db, publisher, fast_settings(batch_size=30, max_in_flight=2))
    async with relay:
        reads = _count_reads(relay)
        await eventually(lambda: len(publisher.published) == 180)
    assert relay.processors[0].metrics.claimed == 180
    # Not one empty read while rows were left. The reads after the last batch are idle
    # polls, as many as the time until the test looked allowed: they are not counted.
    during = _while_rows_were_left(reads[0].sizes)
    assert 0 not in during, during
    assert sum(during) == 180
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
        reads = _count_reads(relay)
        await eventually(lambda: len(publisher.published) == 240)
    assert relay.processors[0].metrics.claimed == 240
    # Empty reads beside batches 1, 2 and 4 while rows were left, and beside batch 8 at
    # most once the last rows were taken (claiming beside every batch in flight made 27-28
    # empty reads here); the idle polls after the last batch are not counted.
    during = _while_rows_were_left(reads[0].sizes)
    assert during.count(0) <= 4, during
    assert sum(during) == 240
    order = per_key(publisher.published)
    assert all(order[key] == list(range(8)) for key in keys)


async def test_a_batch_read_beside_another_publishes_a_key_only_after_it_settled(
    db: OutboxDB,
) -> None:
    """Few keys, many rows each. A storage that reads behind rows in flight gives a
    read beside a batch the next rows of that batch's keys; the relay publishes them
    only once the batch ahead has settled the rows before them. So every key reaches
    the broker in order, and no row goes out while an earlier row of its key is live
    (a crash then would redeliver that earlier row after it). The other storages
    leave the keys in flight out of such a read."""
    keys = ["a", "b", "c"]
    await db.write(messages(keys, per_key=40))
    publisher = MemoryPublisher()
    publisher.slow(0.01)
    confirmed: dict[int, float] = {}
    original = publisher.publish

    async def timed(batch: Sequence[StoredMessage]) -> object:
        results = await original(batch)
        now = time.monotonic()
        confirmed.update((m.seq, now) for m in batch if m in publisher.published)
        return results

    publisher.publish = timed  # type: ignore[method-assign]
    relay = relay_of(db, publisher, fast_settings(batch_size=30, max_in_flight=2))
    async with relay:
        reads = _count_reads(relay)
        settles = _note_settles(relay)
        await eventually(lambda: len(publisher.published) == 120)
        await eventually(lambda: _counts_are(db, {}))
    order = per_key(publisher.published)
    assert all(order[key] == list(range(40)) for key in keys), order
    settled = settles[0].settled
    for key in keys:
        seqs = sorted(m.seq for m in publisher.published if m.key == key)
        for ahead, behind in itertools.pairwise(seqs):
            (call_ahead, at), (call_behind, _) = settled[ahead], settled[behind]
            if call_ahead != call_behind:  # in batches of their own
                assert confirmed[behind] >= at, (key, ahead, behind)
    behind_in_flight = reads[0].behind_in_flight
    if relay.processors[0]._db.claims.reads_behind_in_flight:
        assert behind_in_flight > 0  # the relay did read past the batches in flight...
    else:
        assert behind_in_flight == 0
    assert relay.processors[0].metrics.released == 0  # ...and published what it read


class _HoldsKey(MemoryPublisher):
    """Holds every call that carries `key` until released; the others take a moment."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.release = asyncio.Event()

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if any(m.key == self.key for m in messages):
            await self.release.wait()
        else:
            await asyncio.sleep(0.02)
        return await super().publish(messages)


def _run(key: str, numbers: range) -> list[Message]:
    return [Message(topic="orders", key=key, payload={"key": key, "n": n}) for n in numbers]


async def _the_others_go_while_one_key_is_held(
    db: OutboxDB, written: list[Message], held: str, **settings: Any
) -> None:
    """Write `written` and relay it with every call carrying `held` held at the broker
    (well past the wait below: only a publish timeout could free it). Where reads go
    behind batches in flight, every other key's rows go out meanwhile; then all do,
    each key in order. Elsewhere a batch is read once those ahead have settled, so the
    keys may share a call: there the order is all that is checked."""
    expected: dict[str | None, list[int]] = defaultdict(list)
    for message in written:
        expected[message.key].append(json.loads(message.body)["n"])
    others = {key: numbers for key, numbers in expected.items() if key != held}
    await db.write(written)
    publisher = _HoldsKey(held)
    relay = relay_of(db, publisher, fast_settings(publish_timeout=30.0, **settings))
    async with relay:
        if relay.processors[0]._db.claims.reads_behind_in_flight:
            count = sum(map(len, others.values()))
            await eventually(lambda: len(publisher.published) == count, timeout=10.0)
            assert per_key(publisher.published) == others
        publisher.release.set()
        await eventually(lambda: len(publisher.published) == len(written))
    assert per_key(publisher.published) == expected


async def test_the_rows_behind_a_batch_ahead_do_not_wait_for_the_other_keys_of_theirs(
    db: OutboxDB,
) -> None:
    """The second batch, read beside the first, holds a's next rows and b's first. b's
    rows go out at once and a's once the first batch has settled, each on its own: a
    slow request for b does not hold up a (their keys differ, so neither waits for the
    other)."""
    a, b = _run("a", range(15)), _run("b", range(5))
    written = [*a[:10], *itertools.chain(*zip(a[10:], b, strict=True))]
    await _the_others_go_while_one_key_is_held(db, written, "b", batch_size=10, max_in_flight=2)


async def test_rows_behind_wait_only_for_the_batches_ahead_that_hold_their_key(
    db: OutboxDB,
) -> None:
    """Three batches of 4: a's first rows, h's first rows (held at the broker), then
    a4, a5, h4, h5, read beside both. a4 and a5 wait for the first batch alone, so
    they go out while h is held; h4 and h5 wait for the second. (Waiting for every
    batch ahead that shares any key, a relay whose batches each shared a key or two
    with the one before published them one at a time.)"""
    written = [*_run("a", range(4)), *_run("h", range(4)), *_run("a", range(4, 6)),
               *_run("h", range(4, 6))]  # fmt: skip
    await _the_others_go_while_one_key_is_held(db, written, "h", batch_size=4, max_in_flight=3)


async def test_a_failure_ahead_hands_back_the_rows_read_behind_it(db: OutboxDB) -> None:
    """k:5 fails in the first batch while the second, read beside it, holds k's later
    rows: those are handed back untouched, and k goes on from k:5 once it is retried,
    never past it; the other key is not held up."""
    await db.write(messages(["k", "j"], per_key=40))
    publisher = MemoryPublisher()
    fault = publisher.fail(lambda m: m.key == "k" and json.loads(m.payload)["n"] == 5, times=1)
    publisher.slow(0.01)  # faults apply in the order given: k:5 fails without the wait
    relay = relay_of(db, publisher, fast_settings(batch_size=30, max_in_flight=2))
    async with relay:
        reads = _count_reads(relay)
        await eventually(lambda: len(publisher.published) == 80)
    assert fault.hits == 1
    tried = [json.loads(m.payload)["n"] for m in publisher.attempts if m.key == "k"]
    assert tried == [*range(6), *range(5, 40)], tried
    assert per_key(publisher.published)["j"] == list(range(40))
    if relay.processors[0]._db.claims.reads_behind_in_flight:
        assert reads[0].behind_in_flight > 0


async def test_rows_read_behind_a_batch_whose_settle_failed_wait_to_be_read_again(
    db: OutboxDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first batch is published but its settle cannot be recorded: its rows stay
    live, to be published again. The rows of its keys read behind it are handed back
    too, not recorded published ahead of them: each key is recorded in order."""
    import relaybox.relay.processor

    monkeypatch.setattr(relaybox.relay.processor, "SETTLE_RETRY_DELAYS", (0.01,))
    await db.write(messages(["a", "b"], per_key=40))
    publisher = MemoryPublisher()
    publisher.slow(0.01)
    relay = relay_of(db, publisher, fast_settings(batch_size=30, max_in_flight=2))
    async with relay:
        reads = _count_reads(relay)
        settles = _note_settles(relay, refuse=2)  # both tries of the first settle
        await eventually(lambda: _counts_are(db, {}))
    assert settles[0].refused == 2
    recorded = sorted(settles[0].settled.items(), key=lambda item: item[1])
    by_seq = {m.seq: m for m in publisher.attempts}
    for key in ("a", "b"):
        order = [json.loads(by_seq[seq].payload)["n"] for seq, _ in recorded
                 if by_seq[seq].key == key]  # fmt: skip
        assert order == list(range(40)), (key, order)
    if relay.processors[0]._db.claims.reads_behind_in_flight:
        assert reads[0].behind_in_flight > 0


async def test_a_batch_handed_back_at_once_does_not_keep_the_rows_behind_it_going_round(
    db: OutboxDB,
) -> None:
    """One key, full batches. The broker is unreachable for the first message, so the
    first batch hands back all its rows without a statement to the database, at once;
    the batch read beside it holds the rows behind them and hands them back too. The
    reads that follow must not go on reading behind such batches (each batch would hand
    back the next, nothing published): once the broker answers, the key goes out, in
    order. Each read yields, as a database's does."""
    await db.write(messages(["k"], per_key=100))
    publisher = MemoryPublisher()
    down = publisher.down(times=1)
    relay = relay_of(db, publisher, fast_settings(batch_size=30, max_in_flight=2))
    async with relay:
        _slow_reads(relay, 0.005)
        await eventually(lambda: len(publisher.published) == 100)
    assert down.hits == 1
    assert per_key(publisher.published)["k"] == list(range(100))


class _SlowReads(_Passthrough):
    """A claims connection whose reads take `seconds` before they start."""

    def __init__(self, inner: object, seconds: float) -> None:
        super().__init__(inner)
        self._seconds = seconds

    async def read(self, **options: object) -> list[StoredMessage]:
        await asyncio.sleep(self._seconds)
        found: list[StoredMessage] = await self._inner.read(**options)  # type: ignore[attr-defined]
        return found


def _slow_reads(relay: Relay, seconds: float) -> None:
    for processor in relay.processors:
        slow = _SlowReads(processor._db.claims, seconds)
        processor._db = dataclasses.replace(processor._db, claims=slow)


class _Reads(_Passthrough):
    """A claims connection that notes how many rows each read took, in order."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)
        self.sizes: list[int] = []
        #: Rows read of keys that had rows in flight (behind them in their key).
        self.behind_in_flight = 0

    async def read(self, **options: object) -> list[StoredMessage]:
        found: list[StoredMessage] = await self._inner.read(**options)  # type: ignore[attr-defined]
        self.sizes.append(len(found))
        in_flight = options.get("in_flight", ())
        assert isinstance(in_flight, Sequence)
        busy = {(m.target, m.key) for m in in_flight if m.key is not None}
        self.behind_in_flight += sum((m.target, m.key) in busy for m in found)
        return found


def _count_reads(relay: Relay) -> list[_Reads]:
    """Note every read of each processor of `relay` from now on. Called as soon as the
    relay has started, before the test awaits anything, it sees the first read too."""
    reads = [_Reads(p._db.claims) for p in relay.processors]
    for processor, counted in zip(relay.processors, reads, strict=True):
        processor._db = dataclasses.replace(processor._db, claims=counted)
    return reads


class _Settles(_Passthrough):
    """A settles connection that notes, per row recorded published, which settle call
    recorded it and when that call returned (time.monotonic)."""

    def __init__(self, inner: object, refuse: int = 0) -> None:
        super().__init__(inner)
        self.settled: dict[int, tuple[int, float]] = {}
        self._calls = 0
        self._refuse = refuse  # fail this many settles first, as a cut connection would
        self.refused = 0

    async def settle(self, worker: str, **outcomes: object) -> object:
        if self.refused < self._refuse:
            self.refused += 1
            raise StorageOperationalError("connection cut (test)")
        settled = await self._inner.settle(worker, **outcomes)  # type: ignore[attr-defined]
        self._calls += 1
        now = time.monotonic()
        published = outcomes.get("published", ())
        assert isinstance(published, Sequence)
        self.settled.update((seq, (self._calls, now)) for seq in published)
        return settled


def _note_settles(relay: Relay, refuse: int = 0) -> list[_Settles]:
    """Note every settle of each processor of `relay` from now on (see _count_reads),
    after refusing the first `refuse`."""
    noted = [_Settles(p._db.settles, refuse) for p in relay.processors]
    for processor, settles in zip(relay.processors, noted, strict=True):
        processor._db = dataclasses.replace(processor._db, settles=settles)
    return noted


def _while_rows_were_left(sizes: Sequence[int]) -> list[int]:
    """The reads up to the last one that took rows (after it, the table was drained)."""
    last = max(i for i, size in enumerate(sizes) if size)
    return list(sizes[: last + 1])


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
    relay = relay_of(db, publisher, settings)
    async with relay:
        recorded = _note_failures(relay)
        await eventually(lambda: len(publisher.published) == 1)
    failures = recorded[0].failures
    # The relay asked for 0.2, 0.4 and 0.8 s (jitter 0), as the policy says...
    assert [delay for _, delay in failures] == pytest.approx([0.2, 0.4, 0.8])
    # ...and kept to them: each retry came no sooner than its delay after the failure
    # was recorded (the row is not read before), and soon after it. The relay looks
    # every idle_interval (0.05 s); the bound leaves a busy machine thirty times that.
    retries = seen[1:]
    for (failed_at, delay), retried_at in zip(failures, retries, strict=True):
        assert delay - 0.02 <= retried_at - failed_at <= delay + 1.5, (failures, seen)


class _Failures(_Passthrough):
    """A settle connection that notes each failure it records: when the statement was
    sent (time.monotonic) and the delay before the row may be read again."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)
        self.failures: list[tuple[float, float]] = []

    async def settle(self, worker: str, **outcomes: object) -> object:
        sent = time.monotonic()
        settled = await self._inner.settle(worker, **outcomes)  # type: ignore[attr-defined]
        failed: Sequence[Failure] = outcomes["failed"]  # type: ignore[assignment]
        self.failures.extend((sent, failure.retry_in) for failure in failed)
        return settled


def _note_failures(relay: Relay) -> list[_Failures]:
    """Note every recorded failure of each processor of `relay` (see _count_reads)."""
    noted = [_Failures(p._db.settles) for p in relay.processors]
    for processor, settles in zip(relay.processors, noted, strict=True):
        processor._db = dataclasses.replace(processor._db, settles=settles)
    return noted


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
        # It probes (every 0.3 s, doubling to 0.6 s): three probes, however long they take.
        await eventually(lambda: len(partner.attempts) >= probes_before + 3)
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
        # The outage goes on for several more probes, each 0.1-0.2 s apart: many times
        # the schedule, whatever the machine's speed.
        hits = down.hits
        await eventually(lambda: down.hits >= hits + 5)
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
    # A publish of 2.5 leases. Renewals come every 0.4 s (a third of the lease) and each
    # must land within 0.68 s of the last (the lease less the cut-off margin): twice
    # the room a 0.6 s lease left a busy machine.
    slow.slow(3.0)
    settings = fast_settings(lease_seconds=1.2, publish_timeout=10.0, partition_leases=False)
    async with relay_of(db, slow, settings):
        await eventually(lambda: len(slow.attempts) == 1)
        async with relay_of(db, rival_publisher, settings):
            await eventually(lambda: len(slow.published) == 1)
            await asyncio.sleep(0.3)
    assert rival_publisher.attempts == []  # the lease never lapsed while publishing


async def test_stop_releases_what_is_in_flight_within_the_timeout(db: OutboxDB) -> None:
    await db.write(messages(["k1", "k2"], per_key=2))
    publisher = MemoryPublisher()
    publisher.hang()
    # The hung publishes would end only at the publish timeout or when the partition
    # lease (2/3 of lease_seconds) runs out after the last heartbeat, and a stop without
    # a timeout of its own would wait shutdown_timeout: all 40 s or more here, so only
    # stop(timeout=0.3) itself can end it under the 30 s bound, which leaves a busy
    # machine a hundred times the 0.3 s.
    long = fast_settings(lease_seconds=60.0, publish_timeout=60.0, shutdown_timeout=60.0)
    relay = relay_of(db, publisher, long)
    await relay.start()
    await eventually(lambda: len(publisher.attempts) == 2)
    started = time.monotonic()
    await relay.stop(timeout=0.3)
    took = time.monotonic() - started
    assert 0.29 <= took < 30.0, took  # the batches had their 0.3 s, and no more
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
            await eventually(lambda: len(rival.published) == 1)
            await asyncio.sleep(1.5)  # A's publish would have finished by now
    assert slow.published == []  # cut off at its lease
    assert sum(p.metrics.published for p in stale.processors) == 0
    assert sum(p.metrics.leases_lost for p in stale.processors) >= 1
    assert [(r.status, r.attempts) for r in await asyncio.to_thread(rows, db)] == [
        (Status.PUBLISHED, 0)
    ]


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
    attempted: list[float] = []
    original = publisher.publish

    async def timed(batch: Sequence[StoredMessage]) -> object:
        attempted.append(time.monotonic())
        return await original(batch)

    publisher.publish = timed  # type: ignore[method-assign]
    settings = fast_settings(published_retention=1.0, abandoned_retention=3.0,
                             cleanup_interval=0.1)  # fmt: skip
    seen: list[tuple[dict[Status, int], float]] = []  # the counts, and when they were read
    async with relay_of(db, publisher, settings):
        deadline = time.monotonic() + 30  # purging follows: 3 s, plus a busy machine's delays
        while not seen or seen[-1][0]:
            assert time.monotonic() < deadline, f"rows never purged: {seen[-1]}"
            counts = await db.status_counts()
            seen.append((counts, time.monotonic()))
            await asyncio.sleep(0.02)
    # The rows settled after the last publish attempt: their retention runs from later.
    settled_after = attempted[-1]
    finished = [(c, at) for c, at in seen if set(c) <= {Status.PUBLISHED, Status.ABANDONED}]
    states = [c for c, _ in finished]
    # Each read that found a kind of row gone ended after that row was purged, so it
    # came no sooner than its retention after the publishing: neither window is cut short.
    published_gone = next(at for c, at in finished if Status.PUBLISHED not in c)
    abandoned_gone = next(at for c, at in finished if Status.ABANDONED not in c)
    assert published_gone - settled_after >= 1.0 - 0.02, (published_gone - settled_after, seen)
    assert abandoned_gone - settled_after >= 3.0 - 0.02, (abandoned_gone - settled_after, seen)
    # The published rows went first: no read found the abandoned row gone while they were
    # there, and a read found it alone (it stays 2 s longer: reads come every 20 ms).
    assert len(publisher.published) == 2
    assert all(c.get(Status.ABANDONED) == 1 for c in states if Status.PUBLISHED in c), seen
    assert {Status.ABANDONED: 1} in states, seen


@pytest.fixture
async def sqlite_db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("sqlite", tmp_path, targets=("default", "partner")):
        yield each


@pytest.fixture
async def pg_db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path, targets=("default", "partner")):
        yield each


#: The poll of an idle relay in the wake-up tests: a message it publishes sooner than
#: this was woken for. The tests wait a third of it, far more than a wake-up takes on a
#: busy machine (milliseconds; a poll of this relay is the only other way to find it).
IDLE_POLL = 60.0


async def test_an_attached_outbox_wakes_an_idle_relay_at_once(sqlite_db: OutboxDB) -> None:
    """A commit in the relay's own process is picked up without polling."""
    db = sqlite_db
    outbox = Outbox(table=db.table, targets=["default", "partner"])
    publisher = MemoryPublisher()
    settings = fast_settings(idle_interval=IDLE_POLL, min_poll_interval=IDLE_POLL)
    async with relay_of(db, publisher, settings) as relay:
        relay.attach(outbox)
        # The first read found nothing: the next poll is a minute away.
        await eventually(lambda: relay.processors[0].metrics.claims >= 1)
        with sqlite3.connect(db.url.removeprefix("sqlite:///")) as conn:
            written = outbox.add(conn, messages(["k"], per_key=1))
        outbox.committed(written)
        await eventually(lambda: len(publisher.published) == 1, timeout=IDLE_POLL / 3)


async def test_a_notify_from_another_process_wakes_an_idle_relay(pg_db: OutboxDB) -> None:
    db = pg_db
    outbox = Outbox(table=db.table, targets=["default", "partner"], notify=True)
    publisher = MemoryPublisher()
    settings = fast_settings(idle_interval=IDLE_POLL, min_poll_interval=IDLE_POLL)
    async with relay_of(db, publisher, settings) as relay:
        # The first read found nothing: the next poll is a minute away.
        await eventually(lambda: relay.processors[0].metrics.claims >= 1)
        conn = await asyncpg.connect(db.url)
        try:
            async with conn.transaction():
                await outbox.add_async(conn, messages(["k"], per_key=1))
        finally:
            await conn.close()
        # Not announced in-process: only the NOTIFY can wake it.
        await eventually(lambda: len(publisher.published) == 1, timeout=IDLE_POLL / 3)


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


async def test_an_unrecorded_failure_holds_back_its_keys_later_successes(
    db: OutboxDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K:0 is refused for good, K:1 goes out; if the abandon of K:0 cannot be recorded,
    K:1 is not recorded as published either, so neither comes back out of order."""
    import relaybox.relay.processor

    # Two tries of each settle, 0.01 s apart: the abandon is given up at once, not after
    # the 4 s of the usual retries (a test that heals the connection sooner never sees
    # a settle given up, and holds nothing back).
    monkeypatch.setattr(relaybox.relay.processor, "SETTLE_RETRY_DELAYS", (0.01,))
    await db.write(messages(["k"], per_key=2))
    publisher = MemoryPublisher()
    publisher.reject(lambda m: json.loads(m.payload)["n"] == 0, error="too large")
    settings = fast_settings(lease_seconds=0.8, published_retention=3600.0,
                             partition_leases=False)  # fmt: skip
    relay = relay_of(db, publisher, settings)
    recorded: list[tuple[str, list[int]]] = []  # what the settles recorded, in order
    async with relay:
        cut = [_NoAbandon(p._db.settles, recorded) for p in relay.processors]
        for processor, settles in zip(relay.processors, cut, strict=True):
            processor._db = dataclasses.replace(processor._db, settles=settles)
        # The abandon was refused twice (given up) and the batch's settle is over.
        await eventually(lambda: sum(settles.refused for settles in cut) >= 2)
        await eventually(lambda: not any(p.in_flight for p in relay.processors))
        assert len(publisher.published) >= 1  # K:1 went out...
        assert recorded == []  # ...and was not recorded as published
        assert {r.status for r in await asyncio.to_thread(rows, db)} == {Status.PROCESSING}
        for settles in cut:
            settles.healed = True
        await eventually(lambda: _counts_are(db, {Status.ABANDONED: 1, Status.PUBLISHED: 1}))
    k0, k1 = sorted(r.seq for r in await asyncio.to_thread(rows, db))
    abandoned = recorded.index(("abandoned", [k0]))
    assert abandoned < recorded.index(("published", [k1])), recorded  # in order, once healed


class _NoAbandon(_Passthrough):
    """A settle connection on which abandons fail until it is `healed`; it notes what
    it recorded (abandons, publishes) in `recorded`, in order."""

    healed = False

    def __init__(self, inner: object, recorded: list[tuple[str, list[int]]]) -> None:
        super().__init__(inner)
        self.recorded = recorded
        self.refused = 0

    async def abandon(
        self, token: str, failures: Sequence[Failure], *, hold_keys: bool = False
    ) -> int:
        if not self.healed:
            self.refused += 1
            raise StorageOperationalError("connection cut (test)")
        count: int = await self._inner.abandon(token, failures, hold_keys=hold_keys)  # type: ignore[attr-defined]
        if count:
            self.recorded.append(("abandoned", [f.seq for f in failures]))
        return count

    async def mark_published(self, token: str, seqs: Sequence[int], *, delete: bool) -> int:
        count: int = await self._inner.mark_published(token, seqs, delete=delete)  # type: ignore[attr-defined]
        if count:
            self.recorded.append(("published", list(seqs)))
        return count


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
            await eventually(lambda: len(rival.published) == 1)
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
    # The first relay's batches hang until the second has joined and the first has given
    # back its share: whatever the machine's speed, batches are in flight as it joins,
    # and rows are left for it.
    first.hang()
    settings = fast_settings(batch_size=20, publish_timeout=30.0)
    async with relay_of(db, first, settings) as running:
        await eventually(lambda: len(first.attempts) >= 20)
        async with relay_of(db, second, settings) as joined:
            await eventually(lambda: len(held_by(running)) < 8)
            first.heal()
            await eventually(lambda: len(first.published) + len(second.published) >= 400)
            await eventually(lambda: held_by(joined))
    ids = [m.id for m in first.published + second.published]
    assert len(ids) == len(set(ids)) == 400
    assert second.published, "the second relay took partitions over"
    both = sorted(first.published + second.published, key=lambda m: m.seq)
    for key, order in per_key(both).items():
        assert order == list(range(10)), key


async def test_relays_started_together_share_the_partitions_before_a_regular_heartbeat(
    db: OutboxDB,
) -> None:
    """The first relay of a fleet takes every partition and learns that the others
    joined only at a heartbeat of its own: while the partitions are being shared out,
    those come every SHARING_HEARTBEAT_SECONDS, not every lease / 6 (10 s here)."""
    settings = fast_settings(lease_seconds=60.0)
    async with relay_of(db, MemoryPublisher(), settings) as first:
        await eventually(lambda: len(held_by(first)) == 8)
        async with relay_of(db, MemoryPublisher(), settings) as second:
            await eventually(lambda: (len(held_by(first)), len(held_by(second))) == (4, 4),
                             timeout=settings.heartbeat_interval / 2)  # fmt: skip


class _HeldReads(_Passthrough):
    """A relay's storage whose reads return only once `gate` opens (`began`: one did)."""

    def __init__(self, inner: object, gate: asyncio.Event, began: asyncio.Event) -> None:
        super().__init__(inner)
        self._gate, self._began = gate, began

    async def read(self, **query: object) -> object:
        rows = await self._inner.read(**query)  # type: ignore[attr-defined]
        self._began.set()
        await self._gate.wait()
        return rows


async def test_a_read_that_spans_a_rebalance_publishes_nothing_given_away(
    db: OutboxDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read runs while a heartbeat gives half the partitions to a relay that joined:
    the rows being read were not in flight yet, so the heartbeat could give their
    partitions away. Those rows are the new owner's alone: none is published twice."""
    keys = [f"k{i}" for i in range(40)]
    await db.write(messages(keys, per_key=10))
    gate, began = asyncio.Event(), asyncio.Event()
    first, second = MemoryPublisher(), MemoryPublisher()
    held = _HeldReads(db.storage, gate, began)
    if db.name != "memory":  # the relay opens its own connections: hold theirs
        from relaybox.relay import engine

        real_open = engine.open_storage

        async def held_open(url: str, **options: object) -> object:
            return _HeldReads(await real_open(url, **options), gate, began)  # type: ignore[arg-type]

        monkeypatch.setattr(engine, "open_storage", held_open)
    running = Relay(
        db.url if db.name != "memory" else held,  # type: ignore[arg-type]
        {"default": first, "partner": MemoryPublisher()}, table=db.table,
        settings=fast_settings(batch_size=100),
    )  # fmt: skip
    async with running:
        await asyncio.wait_for(began.wait(), 15)  # a read of all 8 partitions is under way
        monkeypatch.undo()
        async with relay_of(db, second, fast_settings(batch_size=100)) as joined:
            await eventually(lambda: len(held_by(running)) < 8)
            await eventually(lambda: len(second.published) > 0)
            gate.set()
            await eventually(lambda: len(first.published) + len(second.published) >= 400)
            await asyncio.sleep(0.5)  # time for a late second copy to show
    ids = [m.id for m in first.published + second.published]
    assert len(ids) == len(set(ids)) == 400
    both = sorted(first.published + second.published, key=lambda m: m.seq)
    for key, order in per_key(both).items():
        assert order == list(range(10)), key
    assert held_by(joined)
