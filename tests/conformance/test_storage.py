"""What every storage backend must do, port by port (relaybox.ports); the relay and the
operator commands rely on nothing else."""

from __future__ import annotations

import asyncio
import datetime
import random
import time
import uuid

import pytest

from relaybox import Message
from relaybox.core.lifecycle import Status
from relaybox.core.message import DEFAULT_TARGET, Target
from relaybox.core.partitions import partition_for, partition_of
from relaybox.core.records import (
    Assignment,
    Failure,
    Routing,
    RowsInFlight,
    Settled,
    StoredMessage,
    seq_text,
)
from relaybox.ports import OperatorStorage, PartitionStorage, RowLeaseStorage, TableWriter
from relaybox.storage.memory import MemoryStorage
from relaybox.storage.sql import SqlStorage
from tests.conformance.conftest import Backend

ROUTING = Routing.of(["default", "partner"], ["default"])
LEASE = 30.0
#: What a heartbeat says some live relay serves, when every relay serves the default.
SERVED = frozenset({DEFAULT_TARGET})
#: How early a row may come due by the database's clock, against the test's. SQLite's
#: clock ticks in milliseconds (an INSERT's "now" is cut to the millisecond, so a delayed
#: row comes due up to 1 ms before the moment the test took plus the delay); the others
#: keep microseconds. Delays here are 50 and 300 ms.
CLOCK_TICK = 0.002
#: A lease, delay or backoff whose end a test waits for: long enough that a busy machine
#: does not pass it between two statements that must both fall inside it.
WINDOW = 1.0

#: What open_storage returns: every storage port at once.
AnyStorage = SqlStorage | MemoryStorage


async def write(backend: Backend, *messages: Message) -> None:
    await backend.storage.write(ROUTING.rows(messages))


def msg(key: str | None = None, **fields: object) -> Message:
    return Message(
        topic=str(fields.pop("topic", "orders")),
        key=key,
        payload=fields.pop("payload", {"n": 1}),
        **fields,
    )  # type: ignore[arg-type]


def test_every_backend_serves_every_port(backend: Backend) -> None:
    ports = (PartitionStorage, RowLeaseStorage, OperatorStorage, TableWriter)
    assert all(isinstance(backend.storage, port) for port in ports)


#: Times a message may carry, each to the microsecond: far back and far ahead (up to
#: the last microsecond but one of Python's calendar, the last that Message takes),
#: either side of the Unix epoch, and one given in another zone than UTC.
OCCURRED = [
    datetime.datetime(1000, 1, 1, 0, 0, 0, 1, tzinfo=datetime.UTC),
    datetime.datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=datetime.UTC),
    datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC),
    datetime.datetime(2026, 11, 28, 14, 4, 48, 200788, tzinfo=datetime.UTC),
    datetime.datetime(
        2026,
        3,
        29,
        1,
        30,
        0,
        500,
        tzinfo=datetime.timezone(datetime.timedelta(hours=5, minutes=30)),
    ),
    datetime.datetime(2107, 1, 1, 0, 0, 0, 999999, tzinfo=datetime.UTC),
    datetime.datetime(9999, 12, 31, 23, 59, 59, 999998, tzinfo=datetime.UTC),
]


async def test_occurred_at_comes_back_exact_and_in_utc_from_a_read_and_a_claim(
    backend: Backend,
) -> None:
    messages = [msg(f"k{n}", occurred_at=at) for n, at in enumerate(OCCURRED)]
    await write(backend, *messages)
    read = await backend.storage.read(limit=len(OCCURRED))
    assert [m.occurred_at for m in read] == OCCURRED
    assert {m.occurred_at.utcoffset() for m in read} == {datetime.timedelta(0)}
    claim = await backend.storage.claim("w1", limit=len(OCCURRED), lease_seconds=LEASE)
    assert [m.occurred_at for m in claim.messages] == OCCURRED
    assert {m.occurred_at.utcoffset() for m in claim.messages} == {datetime.timedelta(0)}


async def test_write_then_claim_round_trips_every_field(backend: Backend) -> None:
    occurred = datetime.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=datetime.UTC)
    original = Message(
        topic="orders",
        key="order-1",
        type="OrderPlaced",
        payload={"total": 12.5, "items": [1, 2]},
        headers={"origin": "test"},
        correlation_id="corr-1",
        causation_id="cause-1",
        tenant_id="tenant-a",
        aggregate_id="agg-9",
        occurred_at=occurred,
        targets=["default", Target("partner", external=True)],
    )
    await write(backend, original)
    claim = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert [m.target for m in claim.messages] == ["default", "partner"]
    first, second = claim.messages
    assert first.seq < second.seq
    assert first.id == second.id == original.id
    assert (first.external, second.external) == (False, True)
    assert first.topic == "orders"
    assert first.key == "order-1"
    assert first.type == "OrderPlaced"
    assert first.payload == original.body
    assert first.content_type == "application/json"
    assert dict(first.headers) == {"origin": "test"}
    assert (first.correlation_id, first.causation_id) == ("corr-1", "cause-1")
    assert (first.tenant_id, first.aggregate_id) == ("tenant-a", "agg-9")
    assert first.occurred_at == occurred
    assert first.attempts == 0
    assert first.partition == second.partition
    assert claim.token
    assert claim.worker == "w1"


async def test_bytes_and_text_payloads_keep_their_content_type(backend: Backend) -> None:
    await write(backend, msg(payload=b"\x00\xffraw"), msg(payload="héllo"))
    claim = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert [(m.payload, m.content_type) for m in claim.messages] == [
        (b"\x00\xffraw", "application/octet-stream"),
        ("héllo".encode(), "text/plain; charset=utf-8"),
    ]


async def test_claim_respects_limit_and_never_hands_out_a_leased_row(backend: Backend) -> None:
    await write(backend, *[msg() for _ in range(5)])
    first = await backend.storage.claim("w1", limit=3, lease_seconds=LEASE)
    second = await backend.storage.claim("w2", limit=10, lease_seconds=LEASE)
    third = await backend.storage.claim("w3", limit=10, lease_seconds=LEASE)
    assert len(first.messages) == 3
    assert len(second.messages) == 2
    assert not third.messages
    assert {m.seq for m in first.messages}.isdisjoint(m.seq for m in second.messages)
    assert first.token != second.token


async def test_mark_published_keeps_or_deletes_and_is_fenced_by_token(backend: Backend) -> None:
    await write(backend, msg(), msg())
    claim = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    kept, deleted = (m.seq for m in claim.messages)
    assert await backend.storage.mark_published(str(uuid.uuid4()), [kept, deleted]) == 0
    assert await backend.storage.mark_published(claim.token, [kept]) == 1
    assert await backend.storage.mark_published(claim.token, [deleted], delete=True) == 1
    assert await backend.storage.mark_published(claim.token, [kept]) == 0  # already done
    stats = await backend.storage.stats()
    assert stats.counts.get(Status.PUBLISHED) == 1
    assert stats.pending == 0
    assert sum(stats.counts.values()) == 1


async def test_failed_row_counts_an_attempt_and_waits_for_its_backoff(backend: Backend) -> None:
    await write(backend, msg())
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    (row,) = claim.messages
    assert (
        await backend.storage.mark_failed(claim.token, [Failure(row.seq, "broker down", WINDOW)])
        == 1
    )
    assert not (await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)).messages
    stats = await backend.storage.stats()
    assert stats.failed == 1
    await asyncio.sleep(WINDOW + 0.3)
    again = await backend.storage.claim("w2", limit=1, lease_seconds=LEASE)
    assert [m.seq for m in again.messages] == [row.seq]
    assert again.messages[0].attempts == 1


async def test_abandon_keeps_the_error_and_replay_makes_it_pending(backend: Backend) -> None:
    await write(backend, msg(key="k"), msg(key="k"))
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    (row,) = claim.messages
    assert await backend.storage.abandon(claim.token, [Failure(row.seq, "unroutable")]) == 1
    stats = await backend.storage.stats()
    assert stats.abandoned == 1
    # An abandoned row no longer holds back its key.
    nxt = await backend.storage.claim("w1", limit=5, lease_seconds=LEASE)
    assert [m.seq for m in nxt.messages] == [row.seq + 1]
    await backend.storage.mark_published(nxt.token, [row.seq + 1])
    assert await backend.storage.replay([row.seq]) == 1
    replayed = await backend.storage.claim("w2", limit=5, lease_seconds=LEASE)
    assert [(m.seq, m.attempts) for m in replayed.messages] == [(row.seq, 0)]


async def test_release_returns_rows_without_an_attempt(backend: Backend) -> None:
    await write(backend, msg())
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    assert await backend.storage.release(claim.token, [m.seq for m in claim.messages]) == 1
    again = await backend.storage.claim("w2", limit=1, lease_seconds=LEASE)
    assert [m.attempts for m in again.messages] == [0]


async def test_expired_lease_is_taken_over_and_the_stale_mark_is_ignored(backend: Backend) -> None:
    await write(backend, msg())
    other = await backend.another()
    stale = await backend.storage.claim("w1", limit=1, lease_seconds=WINDOW)
    assert not (await other.claim("w2", limit=1, lease_seconds=LEASE)).messages
    await asyncio.sleep(WINDOW + 0.3)
    fresh = await other.claim("w2", limit=1, lease_seconds=LEASE)
    assert [m.seq for m in fresh.messages] == [m.seq for m in stale.messages]
    seqs = [m.seq for m in stale.messages]
    assert await backend.storage.mark_published(stale.token, seqs) == 0
    assert await backend.storage.mark_failed(stale.token, [Failure(seqs[0], "late")]) == 0
    assert await backend.storage.release(stale.token, seqs) == 0
    assert await other.mark_published(fresh.token, seqs) == 1


async def test_renew_extends_the_lease(backend: Backend) -> None:
    await write(backend, msg())
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=WINDOW)
    seqs = [m.seq for m in claim.messages]
    assert await backend.storage.renew(claim.token, seqs, LEASE) == 1
    await asyncio.sleep(WINDOW + 0.3)
    other = await backend.another()
    assert not (await other.claim("w2", limit=1, lease_seconds=LEASE)).messages
    assert await backend.storage.renew(str(uuid.uuid4()), seqs, LEASE) == 0


async def test_a_key_held_by_one_worker_is_not_handed_to_another(backend: Backend) -> None:
    await write(backend, msg("k1"), msg("k1"), msg("k2"), msg(None))
    first = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    assert [m.key for m in first.messages] == ["k1"]
    other = await backend.another()
    second = await other.claim("w2", limit=10, lease_seconds=LEASE)
    assert [m.key for m in second.messages] == ["k2", None]  # k1's second row waits
    await backend.storage.mark_published(first.token, [first.messages[0].seq])
    third = await other.claim("w2", limit=10, lease_seconds=LEASE)
    assert [m.key for m in third.messages] == ["k1"]
    assert third.messages[0].seq > first.messages[0].seq


async def test_one_claim_takes_a_key_run_in_order(backend: Backend) -> None:
    await write(backend, msg("k"), msg("k"), msg("k"))
    claim = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    seqs = [m.seq for m in claim.messages]
    assert len(seqs) == 3
    assert seqs == sorted(seqs)


async def test_a_failing_row_holds_back_only_its_key(backend: Backend) -> None:
    await write(backend, msg("bad"), msg("bad"), msg("good"), msg("good"))
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    (head,) = claim.messages
    await backend.storage.mark_failed(claim.token, [Failure(head.seq, "nope", 60)])
    rest = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert [m.key for m in rest.messages] == ["good", "good"]


async def test_the_same_key_on_another_target_is_independent(backend: Backend) -> None:
    await write(backend, msg("k", targets=["default", "partner"]), msg("k", targets=["partner"]))
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    assert [m.target for m in claim.messages] == ["default"]
    held = await backend.storage.claim("w2", limit=1, lease_seconds=LEASE)
    assert [m.target for m in held.messages] == ["partner"]
    # partner's second row waits for partner's first, not for default's.
    assert not (await backend.storage.claim("w3", limit=10, lease_seconds=LEASE)).messages
    await backend.storage.mark_published(held.token, [held.messages[0].seq])
    last = await backend.storage.claim("w3", limit=10, lease_seconds=LEASE)
    assert [m.target for m in last.messages] == ["partner"]


async def test_delayed_messages_wait_until_due(backend: Backend) -> None:
    await write(backend, msg(delay=WINDOW), msg())
    now = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert len(now.messages) == 1
    await asyncio.sleep(WINDOW + 0.3)
    later = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert len(later.messages) == 1
    assert later.messages[0].seq < now.messages[0].seq


async def test_claim_filters_by_partition_and_target(backend: Backend) -> None:
    keys = [f"key-{i}" for i in range(20)]
    await write(backend, *[msg(k, targets=["default", "partner"]) for k in keys])
    wanted = sorted({partition_of(ROUTING.rows([msg(k)])[0][5], 64) for k in keys[:5]})
    claim = await backend.storage.claim(
        "w1", limit=100, lease_seconds=LEASE, partitions=wanted, targets=["partner"]
    )
    assert claim.messages
    assert all(m.partition in wanted and m.target == "partner" for m in claim.messages)
    assert {m.key for m in claim.messages} >= set(keys[:5])


async def test_purge_honours_both_retention_windows(backend: Backend) -> None:
    await write(backend, *[msg() for _ in range(7)])
    claim = await backend.storage.claim("w1", limit=7, lease_seconds=LEASE)
    seqs = [m.seq for m in claim.messages]
    await backend.storage.mark_published(claim.token, seqs[:5])
    await backend.storage.abandon(claim.token, [Failure(s, "bad") for s in seqs[5:]])
    await asyncio.sleep(0.3)
    purged = await backend.storage.purge(
        published_older_than=0, abandoned_older_than=3600, batch_size=2
    )
    assert purged == 5
    stats = await backend.storage.stats()
    assert stats.counts.get(Status.PUBLISHED, 0) == 0
    assert stats.abandoned == 2
    assert await backend.storage.purge(published_older_than=0, abandoned_older_than=0.1) == 2
    assert sum((await backend.storage.stats()).counts.values()) == 0


async def test_stats_report_counts_oldest_age_and_leases(backend: Backend) -> None:
    empty = await backend.storage.stats()
    assert empty.oldest_pending_age is None
    assert empty.active_leases == 0
    await write(backend, msg(), msg(), msg())
    await asyncio.sleep(0.2)
    await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    stats = await backend.storage.stats()
    assert stats.pending == 2
    assert stats.counts.get(Status.PROCESSING) == 1
    assert stats.active_leases == 1
    assert stats.oldest_pending_age is not None
    assert 0.1 <= stats.oldest_pending_age < 30


async def test_concurrent_claimers_never_share_a_row(backend: Backend) -> None:
    await write(backend, *[msg(f"k{i % 7}" if i % 3 else None) for i in range(120)])
    workers = [await backend.another() for _ in range(4)]
    seen: list[int] = []

    async def drain(index: int) -> None:
        storage = workers[index]
        while True:
            claim = await storage.claim(f"w{index}", limit=7, lease_seconds=LEASE)
            if not claim.messages:
                stats = await storage.stats()
                if stats.pending == 0 and stats.counts.get(Status.PROCESSING, 0) == 0:
                    return
                await asyncio.sleep(0.01)
                continue
            seen.extend(m.seq for m in claim.messages)
            await storage.mark_published(claim.token, [m.seq for m in claim.messages])

    await asyncio.wait_for(asyncio.gather(*(drain(i) for i in range(4))), timeout=60)
    assert len(seen) == 120
    assert len(set(seen)) == 120


async def test_a_blocked_key_does_not_use_up_the_claim_limit(backend: Backend) -> None:
    # Head-of-line: many rows wait behind a failing head; other keys must still flow.
    await write(backend, *[msg("bad") for _ in range(6)], msg("good"), msg(None))
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    (head,) = claim.messages
    await backend.storage.mark_failed(claim.token, [Failure(head.seq, "nope", 60)])
    rest = await backend.storage.claim("w1", limit=2, lease_seconds=LEASE)
    assert [m.key for m in rest.messages] == ["good", None]


async def test_a_blocked_backlog_far_longer_than_the_claim_hides_no_other_row(
    backend: Backend,
) -> None:
    # PostgreSQL reads a window of 4 x limit rows, then looks past it by key heads (with
    # the runs behind them) and keyless rows: behind 150 blocked rows, one claim finds
    # the others, in order, and none of the blocked rows is handed out.
    await write(backend, *[msg("bad") for _ in range(150)])
    await write(backend, msg("good"), msg("good"), msg(None), msg("other"))
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    (head,) = claim.messages
    await backend.storage.mark_failed(claim.token, [Failure(head.seq, "nope", 3.0)])
    found = (await backend.storage.claim("w1", limit=4, lease_seconds=LEASE)).messages
    assert [m.key for m in found] == ["good", "good", None, "other"]
    assert [m.seq for m in found] == sorted(m.seq for m in found)
    assert not (await backend.storage.claim("w1", limit=4, lease_seconds=LEASE)).messages
    await asyncio.sleep(3.2)
    taken: list[int] = []
    while (claim := await backend.storage.claim("w1", limit=4, lease_seconds=LEASE)).messages:
        assert {m.key for m in claim.messages} == {"bad"}
        taken.extend(m.seq for m in claim.messages)
        await backend.storage.mark_published(claim.token, [m.seq for m in claim.messages])
    assert len(taken) == 150
    assert taken == sorted(taken)


def sized(key: str | None, size: int) -> Message:
    """A message whose payload is `size` bytes (one target: the default)."""
    return Message(topic="orders", key=key, payload=b"x" * size, targets=["default"])


async def test_a_claim_stops_at_its_byte_budget_and_a_larger_payload_goes_alone(
    backend: Backend,
) -> None:
    await write(backend, sized("a", 300), sized("b", 300), sized("a", 300), sized(None, 900),
                sized("b", 0), sized("c", 100))  # fmt: skip
    claims = []
    while (claim := await backend.storage.claim("w1", limit=10, lease_seconds=LEASE,
                                                max_bytes=700)).messages:  # fmt: skip
        claims.append([(m.key, len(m.payload)) for m in claim.messages])
        await backend.storage.mark_published(claim.token, [m.seq for m in claim.messages])
    assert claims == [
        [("a", 300), ("b", 300)],
        [("a", 300)],
        [(None, 900)],  # larger than the budget on its own: alone
        [("b", 0), ("c", 100)],
    ]


async def test_a_claim_past_a_blocked_window_keeps_its_byte_budget(backend: Backend) -> None:
    await write(backend, *[sized("bad", 10) for _ in range(150)])
    await write(backend, sized("good", 300), sized("good", 300), sized(None, 300))
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    (head,) = claim.messages
    await backend.storage.mark_failed(claim.token, [Failure(head.seq, "nope", 60)])
    found = await backend.storage.claim("w1", limit=4, lease_seconds=LEASE, max_bytes=650)
    assert [(m.key, len(m.payload)) for m in found.messages] == [("good", 300), ("good", 300)]
    alone = await backend.storage.claim("w1", limit=4, lease_seconds=LEASE, max_bytes=100)
    assert [(m.key, len(m.payload)) for m in alone.messages] == [(None, 300)]


async def test_rows_whose_lease_ran_out_are_claimed_again_within_the_byte_budget(
    backend: Backend,
) -> None:
    await write(backend, sized("a", 400), sized("b", 400), sized("c", 400))
    stale = await backend.storage.claim("w1", limit=2, lease_seconds=WINDOW)
    assert [m.key for m in stale.messages] == ["a", "b"]
    await asyncio.sleep(WINDOW + 0.3)
    again = await backend.storage.claim("w2", limit=10, lease_seconds=LEASE, max_bytes=500)
    assert [m.key for m in again.messages] == ["a"]
    rest = await backend.storage.claim("w2", limit=10, lease_seconds=LEASE, max_bytes=900)
    assert [m.key for m in rest.messages] == ["b", "c"]


async def test_a_key_leased_elsewhere_does_not_use_up_the_claim_limit(backend: Backend) -> None:
    await write(backend, *[msg("busy") for _ in range(30)], msg("free"))
    first = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    assert [m.key for m in first.messages] == ["busy"]
    other = await backend.another()
    second = await other.claim("w2", limit=1, lease_seconds=LEASE)
    assert [m.key for m in second.messages] == ["free"]


# Partition leases.


async def workers(backend: Backend, count: int) -> list[AnyStorage]:
    """One storage (one connection) per relay process."""
    return [backend.storage, *[await backend.another() for _ in range(count - 1)]]


async def test_a_lone_worker_holds_every_partition(backend: Backend) -> None:
    assignment = await backend.storage.heartbeat("w1", partitions=64, lease_seconds=LEASE)
    assert assignment == Assignment(frozenset(range(64)), 1, served=SERVED)


async def test_a_second_worker_gets_half_once_the_first_gives_it_back(backend: Backend) -> None:
    first, second = await workers(backend, 2)
    await first.heartbeat("w1", partitions=64, lease_seconds=LEASE)
    joined = await second.heartbeat("w2", partitions=64, lease_seconds=LEASE)
    assert joined == Assignment(frozenset(), 2, served=SERVED)  # all still leased to w1
    kept = await first.heartbeat("w1", partitions=64, lease_seconds=LEASE)
    assert kept == Assignment(frozenset(range(32)), 2, served=SERVED)  # the highest go back
    taken = await second.heartbeat("w2", partitions=64, lease_seconds=LEASE)
    assert taken == Assignment(frozenset(range(32, 64)), 2, served=SERVED)


async def test_three_workers_share_ten_partitions_without_overlap(backend: Backend) -> None:
    storages = await workers(backend, 3)
    latest: dict[str, frozenset[int]] = {}
    for _ in range(3):
        for index, storage in enumerate(storages):
            assignment = await storage.heartbeat(f"w{index}", partitions=10, lease_seconds=LEASE)
            assert assignment.members == len(latest | {f"w{index}": frozenset()})
            latest[f"w{index}"] = assignment.partitions
            held = [p for partitions in latest.values() for p in partitions]
            assert len(held) == len(set(held)), latest
    assert set().union(*latest.values()) == set(range(10))
    assert sorted(len(p) for p in latest.values()) == [2, 4, 4]  # fair share: ceil(10 / 3)


async def test_concurrent_heartbeats_never_share_a_partition(backend: Backend) -> None:
    storages = await workers(backend, 4)

    async def beat(index: int) -> tuple[str, frozenset[int]]:
        found = await storages[index].heartbeat(f"w{index}", partitions=16, lease_seconds=LEASE)
        return f"w{index}", found.partitions

    latest: dict[str, frozenset[int]] = {}
    for _ in range(4):
        latest.update(await asyncio.gather(*(beat(i) for i in range(4))))
        held = [p for partitions in latest.values() for p in partitions]
        assert len(held) == len(set(held)), latest
    for _ in range(2):  # settle in turns
        for index in range(4):
            latest.update([await beat(index)])
    assert {name: len(p) for name, p in latest.items()} == {f"w{i}": 4 for i in range(4)}
    assert set().union(*latest.values()) == set(range(16))


async def test_a_silent_worker_loses_its_partitions_when_its_lease_runs_out(
    backend: Backend,
) -> None:
    silent, survivor = await workers(backend, 2)
    await silent.heartbeat("silent", partitions=10, lease_seconds=WINDOW)
    assert (await survivor.heartbeat("w2", partitions=10, lease_seconds=LEASE)).partitions == set()
    await asyncio.sleep(WINDOW + 0.3)
    taken = await survivor.heartbeat("w2", partitions=10, lease_seconds=LEASE)
    assert taken == Assignment(frozenset(range(10)), 1, served=SERVED)


async def test_leave_frees_the_partitions_at_once(backend: Backend) -> None:
    first, second = await workers(backend, 2)
    for storage, name in ((first, "w1"), (second, "w2"), (first, "w1"), (second, "w2")):
        await storage.heartbeat(name, partitions=10, lease_seconds=LEASE)
    await first.leave("w1")
    taken = await second.heartbeat("w2", partitions=10, lease_seconds=LEASE)
    assert taken == Assignment(frozenset(range(10)), 1, served=SERVED)
    await first.leave("w1")  # leaving twice changes nothing


async def test_each_target_s_partitions_are_shared_by_the_relays_that_serve_it(
    backend: Backend,
) -> None:
    """Relays of one table that serve different targets (a rolling deploy that adds
    one) lease each target's partitions apart: none holds back another's rows."""
    plain, audit, both = await workers(backend, 3)
    alone = await plain.heartbeat("plain", partitions=10, lease_seconds=LEASE)
    assert alone == Assignment(frozenset(range(10)), 1, served=SERVED)
    first = await audit.heartbeat("audit", partitions=10, lease_seconds=LEASE, target="partner")
    assert first == Assignment(frozenset(range(10)), 1, served={"default", "partner"})
    # A relay serving both shares each target with the one that serves it.
    for turn in range(2):
        for storage, name, targets in (
            (plain, "plain", ["default"]), (audit, "audit", ["partner"]),
            (both, "both", ["default", "partner"]),
        ):  # fmt: skip
            for target in targets:
                found = await storage.heartbeat(
                    name, partitions=10, lease_seconds=LEASE, target=target
                )
                assert found.members == 2 or turn == 0
    held = {
        (name, target): (await storage.heartbeat(
            name, partitions=10, lease_seconds=LEASE, target=target)).partitions
        for storage, name, target in (
            (plain, "plain", "default"), (audit, "audit", "partner"),
            (both, "both", "default"), (both, "both", "partner"),
        )
    }  # fmt: skip
    assert held[("plain", "default")] | held[("both", "default")] == set(range(10))
    assert not held[("plain", "default")] & held[("both", "default")]
    assert held[("audit", "partner")] | held[("both", "partner")] == set(range(10))
    assert not held[("audit", "partner")] & held[("both", "partner")]
    assert {len(p) for p in held.values()} == {5}
    await both.leave("both")
    back = await audit.heartbeat("audit", partitions=10, lease_seconds=LEASE, target="partner")
    assert back.partitions == frozenset(range(10))


async def test_settle_is_fenced_by_the_partitions_of_the_row_s_own_target(
    backend: Backend,
) -> None:
    await write(backend, msg("k"), msg("k", targets="partner"), msg(None, targets="partner"))
    default, partner, keyless = await backend.storage.read(limit=10)
    assert (default.target, partner.target) == ("default", "partner")
    await hold_everything(backend, "w1")  # every partition of the default target
    settled = await backend.storage.settle("w1", published=[default.seq, partner.seq])
    assert settled == Settled(published=1)  # not the partner row: w1 holds none of its
    other = backend.storage if isinstance(backend.storage, MemoryStorage) else (
        await backend.another()
    )  # fmt: skip
    await other.heartbeat("w2", partitions=64, lease_seconds=LEASE, target="partner")
    assert await backend.storage.settle("w1", published=[keyless.seq]) == Settled()
    settled = await other.settle("w2", published=[partner.seq, keyless.seq])
    assert settled == Settled(published=2)
    assert await backend.storage.read(limit=10) == []


async def test_heartbeats_follow_the_partition_count(backend: Backend) -> None:
    storage = backend.storage
    everything = Assignment(frozenset(range(10)), 1, served=SERVED)
    assert await storage.heartbeat("w1", partitions=10, lease_seconds=LEASE) == everything
    assert await storage.heartbeat("w1", partitions=10, lease_seconds=LEASE) == everything
    fewer = await storage.heartbeat("w1", partitions=4, lease_seconds=LEASE)
    assert fewer == Assignment(frozenset(range(4)), 1, served=SERVED)  # rows 4..9 are left alone
    assert await storage.heartbeat("w1", partitions=10, lease_seconds=LEASE) == everything


async def test_a_keys_rows_share_one_partition_whatever_the_partition_count(
    backend: Backend,
) -> None:
    """Rows store their key's hash; a relay's partition is that hash modulo its count,
    so a change of count (a rolling deploy) never splits a key over two partitions."""
    key = "k-moved"
    first, second = msg(key, payload={"n": 1}), msg(key, payload={"n": 2})
    await write(backend, first, second)
    stored = partition_for(key, first.id)
    for count in (7, 64):
        mine = partition_of(stored, count)
        others = [p for p in range(count) if p != mine]
        assert not await backend.storage.read(limit=10, partitions=others, partition_count=count)
        found = await backend.storage.read(limit=10, partitions=[mine], partition_count=count)
        assert [m.id for m in found] == [first.id, second.id]
        assert {m.partition for m in found} == {mine}
        claim = await backend.storage.claim(
            "w", limit=10, lease_seconds=LEASE, partitions=[mine], partition_count=count
        )
        assert [m.id for m in claim.messages] == [first.id, second.id]
        await backend.storage.release(claim.token, [m.seq for m in claim.messages])


# Owned reads: a relay that holds its partitions reads rows without writing anything.


def in_flight(*messages: StoredMessage) -> RowsInFlight:
    """Rows in flight as a relay hands them to a read: batch by batch (here, one)."""
    return RowsInFlight([(messages, seq_text(messages))])


async def hold_everything(
    backend: Backend, worker: str = "w1", targets: tuple[str, ...] = (DEFAULT_TARGET,)
) -> None:
    """Make `worker` the holder of every partition of `targets`."""
    for target in targets:
        assignment = await backend.storage.heartbeat(
            worker, partitions=64, lease_seconds=LEASE, target=target
        )
        assert assignment.partitions == frozenset(range(64))


async def test_a_read_writes_nothing_and_keeps_key_order(backend: Backend) -> None:
    await write(backend, msg("k1"), msg("k2"), msg("k1"), msg(None))
    found = await backend.storage.read(limit=10)
    assert [m.key for m in found] == ["k1", "k2", "k1", None]
    assert [m.seq for m in found] == sorted(m.seq for m in found)
    assert (await backend.storage.stats()).pending == 4
    assert [m.seq for m in await backend.storage.read(limit=10)] == [m.seq for m in found]
    assert [m.key for m in await backend.storage.read(limit=2)] == ["k1", "k2"]


async def test_a_read_skips_what_is_in_flight_and_holds_back_its_keys(backend: Backend) -> None:
    await write(backend, msg("k1"), msg("k1"), msg("k2"), msg(None), msg(None), msg("k1"))
    first = await backend.storage.read(limit=2)
    assert [m.key for m in first] == ["k1", "k1"]
    beside = await backend.storage.read(limit=10, in_flight=in_flight(*first))
    assert [m.key for m in beside] == ["k2", None, None]
    rest = await backend.storage.read(limit=10, in_flight=in_flight(*first, *beside))
    assert rest == []
    keyless = [m for m in beside if m.key is None]
    again = await backend.storage.read(limit=10, in_flight=in_flight(*keyless))
    assert [m.key for m in again] == ["k1", "k1", "k2", "k1"]


async def test_rows_in_flight_read_alike_as_a_list_and_batch_by_batch(backend: Backend) -> None:
    """A relay hands its rows in flight batch by batch, each batch's seqs made text
    once; a read leaves out exactly what it leaves out of the same rows in a list."""
    await write(backend, msg("k1"), msg("k2"), msg("k1"), msg(None), msg("k3"), msg("k2"))
    first = await backend.storage.read(limit=3)
    assert [m.key for m in first] == ["k1", "k2", "k1"]
    batches = RowsInFlight(
        [(first[:1], seq_text(first[:1])), ((), ""), (first[1:], seq_text(first[1:]))]
    )
    assert list(batches) == first
    assert batches.seq_text == ",".join(str(m.seq) for m in first)
    for after in (False, True):
        listed = await backend.storage.read(limit=10, in_flight=list(first), after_in_flight=after)
        batched = await backend.storage.read(limit=10, in_flight=batches, after_in_flight=after)
        assert [m.seq for m in batched] == [m.seq for m in listed]
        assert [m.key for m in batched][:2] == [None, "k3"]
        assert not {m.seq for m in batched} & {m.seq for m in first}


async def test_a_read_after_in_flight_takes_the_rows_behind_them_in_order(
    backend: Backend,
) -> None:
    """Where the storage reads behind rows in flight, each key's next rows come after
    them, in order; the others read as without it. Either way nothing in flight comes
    back, and no row comes back whose earlier row of its key is live and not in flight."""
    await write(backend, msg("k1"), msg("k1"), msg("k2"), msg("k1"), msg(None))
    first = await backend.storage.read(limit=2)
    assert [m.key for m in first] == ["k1", "k1"]
    behind = await backend.storage.read(limit=10, in_flight=first, after_in_flight=True)
    if backend.storage.reads_behind_in_flight:
        assert [m.key for m in behind] == ["k2", "k1", None]
    else:
        assert [m.key for m in behind] == ["k2", None]
    assert [m.seq for m in behind] == sorted(m.seq for m in behind)
    assert not {m.seq for m in behind} & {m.seq for m in first}
    # Only a later row of k1 in flight, its head not: k1 stays back whatever is asked.
    later = await backend.storage.read(limit=10, in_flight=first[1:], after_in_flight=False)
    assert [m.key for m in later] == ["k2", None]


async def test_rows_read_past_the_window_stop_before_a_row_in_flight(backend: Backend) -> None:
    """A key whose head is live while a later row of it is in flight (a relay that
    reads behind rows in flight handed the head back while the later row is out): a
    read past a window that other keys filled takes the head's run only up to that
    row, never the row itself or what follows it."""
    await hold_everything(backend)
    await write(backend, *[msg("busy") for _ in range(40)])
    await write(backend, *[msg("k") for _ in range(8)])
    rows = await backend.storage.read(limit=100)
    busy_head = rows[0]
    ks = [m for m in rows if m.key == "k"]
    out = [busy_head, ks[5]]  # a later row of k is in flight, its head is not
    found = await backend.storage.read(limit=10, in_flight=out)
    taken = [m.seq for m in found if m.key == "k"]
    assert all(seq < ks[5].seq for seq in taken), (taken, ks[5].seq)
    assert not {m.seq for m in found} & {m.seq for m in out}


async def test_a_key_in_flight_to_one_target_holds_back_that_target_only(
    backend: Backend,
) -> None:
    both = ["default", "partner"]
    await write(backend, msg("k", targets=both), msg("k", targets=both), msg("k-other"))
    head = await backend.storage.read(limit=1)
    assert [(m.target, m.key) for m in head] == [("default", "k")]
    beside = await backend.storage.read(limit=10, in_flight=in_flight(*head))
    assert [(m.target, m.key) for m in beside] == [
        ("partner", "k"), ("partner", "k"), ("default", "k-other"),
    ]  # fmt: skip
    assert [m.seq for m in beside] == sorted(m.seq for m in beside)
    rest = await backend.storage.read(limit=10, in_flight=in_flight(*head, *beside))
    assert rest == []


async def test_a_read_stops_at_its_byte_budget_and_a_larger_payload_goes_alone(
    backend: Backend,
) -> None:
    await write(backend, sized("a", 300), sized("b", 300), sized("a", 300), sized(None, 900),
                sized("b", 0), sized("c", 100))  # fmt: skip
    first = await backend.storage.read(limit=10, max_bytes=700)
    assert [(m.key, len(m.payload)) for m in first] == [("a", 300), ("b", 300)]
    assert await backend.storage.read(limit=10, max_bytes=700) == first  # nothing written
    alone = await backend.storage.read(limit=10, max_bytes=700, in_flight=first)
    assert [(m.key, len(m.payload)) for m in alone] == [(None, 900)]
    none = await backend.storage.read(limit=10, max_bytes=700, in_flight=first,
                                      at_least_one=False)  # fmt: skip
    assert none == []
    rest = await backend.storage.read(limit=10, max_bytes=700, in_flight=[*first, *alone])
    assert [(m.key, len(m.payload)) for m in rest] == [("c", 100)]
    assert len(await backend.storage.read(limit=10)) == 6  # without a budget: every row


async def test_a_read_past_a_blocked_window_keeps_its_byte_budget(backend: Backend) -> None:
    await hold_everything(backend)
    await write(backend, *[sized("bad", 10) for _ in range(150)])
    await write(backend, sized("good", 300), sized("good", 300), sized(None, 300))
    head, *_ = await backend.storage.read(limit=1)
    await backend.storage.settle("w1", failed=[Failure(head.seq, "nope", 60)])
    found = await backend.storage.read(limit=4, max_bytes=650)
    assert [(m.key, len(m.payload)) for m in found] == [("good", 300), ("good", 300)]
    alone = await backend.storage.read(limit=4, max_bytes=100, in_flight=found)
    assert [(m.key, len(m.payload)) for m in alone] == [(None, 300)]


async def test_settle_changes_only_rows_in_partitions_the_worker_holds(
    backend: Backend,
) -> None:
    await write(backend, msg("a"), msg("b"), msg("c"), msg("d"))
    a, b, c, d = await backend.storage.read(limit=10)
    nobody = await backend.storage.settle(
        "w1", published=[a.seq], failed=[Failure(b.seq, "x")], abandoned=[Failure(c.seq, "y")]
    )
    assert nobody == Settled(0, 0, 0)  # w1 holds no partition yet
    await hold_everything(backend)
    assert await backend.storage.settle("w2", published=[a.seq]) == Settled(0, 0, 0)
    settled = await backend.storage.settle(
        "w1", published=[a.seq], failed=[Failure(b.seq, "flaky", 60)],
        abandoned=[Failure(c.seq, "refused")],
    )  # fmt: skip
    assert settled == Settled(failed=1, abandoned=1, published=1)
    stats = await backend.storage.stats()
    assert (stats.pending, stats.failed, stats.abandoned) == (1, 1, 1)
    assert stats.counts.get(Status.PUBLISHED, 0) == 0  # deleted
    assert [m.key for m in await backend.storage.read(limit=10)] == ["d"]
    kept = await backend.storage.settle("w1", published=[d.seq], delete=False)
    assert kept == Settled(published=1)
    assert (await backend.storage.stats()).counts.get(Status.PUBLISHED) == 1
    # Finished rows are left alone by a late settle.
    assert await backend.storage.settle("w1", failed=[Failure(d.seq, "late")]) == Settled()


async def test_any_error_text_a_broker_gives_is_recorded(backend: Backend) -> None:
    """An error comes from outside (a broker's or a receiver's answer): a NUL, a lone
    surrogate or quotes must not make the step that records it fail, in either mode."""
    hostile = 'refused: \x00 "quoted" \ud800 \\ end'
    await write(backend, msg("a"), msg("b"), msg("c"))
    await hold_everything(backend)
    a, b, _ = await backend.storage.read(limit=10)
    settled = await backend.storage.settle(
        "w1", failed=[Failure(a.seq, hostile, 60)], abandoned=[Failure(b.seq, hostile)]
    )
    assert settled == Settled(failed=1, abandoned=1)
    claim = await backend.storage.claim("w2", limit=1, lease_seconds=LEASE)
    (c,) = claim.messages
    assert await backend.storage.abandon(claim.token, [Failure(c.seq, hostile)]) == 1
    listed = await backend.storage.abandoned(limit=10)
    assert {m.seq for m in listed} == {b.seq, c.seq}
    assert all(m.last_error and m.last_error.startswith("refused: ") for m in listed)


async def test_a_failed_head_holds_back_its_key_in_reads_until_due(backend: Backend) -> None:
    await hold_everything(backend)
    await write(backend, msg("bad"), msg("bad"), msg("good"), msg(None))
    head, *_ = await backend.storage.read(limit=1)
    await backend.storage.settle("w1", failed=[Failure(head.seq, "nope", WINDOW)])
    found = await backend.storage.read(limit=10)
    assert [m.key for m in found] == ["good", None]
    await asyncio.sleep(WINDOW + 0.3)
    again = await backend.storage.read(limit=10)
    assert [m.key for m in again] == ["bad", "bad", "good", None]
    assert again[0].seq == head.seq
    assert again[0].attempts == 1


async def test_a_head_failed_under_a_row_lease_holds_back_its_key_in_reads_until_due(
    backend: Backend,
) -> None:
    await write(backend, msg("bad"), msg("bad"), msg("good"), msg(None))
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    (head,) = claim.messages
    assert await backend.storage.mark_failed(claim.token, [Failure(head.seq, "nope", WINDOW)])
    assert [m.key for m in await backend.storage.read(limit=10)] == ["good", None]
    await asyncio.sleep(WINDOW + 0.3)
    again = await backend.storage.read(limit=10)
    assert [m.key for m in again] == ["bad", "bad", "good", None]
    assert (again[0].seq, again[0].attempts) == (head.seq, 1)


async def test_a_blocked_backlog_far_longer_than_the_read_hides_no_other_row(
    backend: Backend,
) -> None:
    await hold_everything(backend)
    await write(backend, *[msg("bad") for _ in range(150)])
    await write(backend, msg("good"), msg("good"), msg(None), msg("other"))
    head, *_ = await backend.storage.read(limit=1)
    await backend.storage.settle("w1", failed=[Failure(head.seq, "nope", 60)])
    found = await backend.storage.read(limit=4)
    assert [m.key for m in found] == ["good", "good", None, "other"]
    assert [m.seq for m in found] == sorted(m.seq for m in found)
    busy = await backend.storage.read(limit=4, in_flight=in_flight(found[0], found[2]))
    assert [m.key for m in busy] == ["other"]


async def test_a_key_claimed_by_a_row_lease_relay_is_held_back_in_reads(
    backend: Backend,
) -> None:
    await write(backend, msg("k"), msg("k"), msg("free"))
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=WINDOW)
    assert [m.key for m in claim.messages] == ["k"]
    assert [m.key for m in await backend.storage.read(limit=10)] == ["free"]
    await asyncio.sleep(WINDOW + 0.3)  # the lease ran out: the row may go again, first
    assert [m.key for m in await backend.storage.read(limit=10)] == ["k", "k", "free"]


async def test_reads_filter_by_partition_and_target(backend: Backend) -> None:
    keys = [f"key-{i}" for i in range(20)]
    await write(backend, *[msg(k, targets=["default", "partner"]) for k in keys])
    wanted = sorted({partition_of(partition_for(k, uuid.uuid4()), 8) for k in keys[:5]})
    found = await backend.storage.read(
        limit=100, partitions=wanted, partition_count=8, targets=["partner"]
    )
    assert {m.key for m in found} >= set(keys[:5])
    assert all(m.partition in wanted and m.target == "partner" for m in found)
    assert not await backend.storage.read(limit=100, partitions=[])


async def test_busy_partitions_drain_before_they_are_given_back(backend: Backend) -> None:
    first, second = await workers(backend, 2)
    await first.heartbeat("w1", partitions=10, lease_seconds=LEASE)
    assert (await second.heartbeat("w2", partitions=10, lease_seconds=LEASE)).partitions == set()
    kept = await first.heartbeat("w1", partitions=10, lease_seconds=LEASE, busy={7, 9})
    assert kept == Assignment(frozenset({0, 1, 2, 3, 4, 7, 9}), 2, frozenset({7, 9}), served=SERVED)
    taken = await second.heartbeat("w2", partitions=10, lease_seconds=LEASE)
    assert taken.partitions == {5, 6, 8}
    drained = await first.heartbeat("w1", partitions=10, lease_seconds=LEASE, busy={9})
    assert drained == Assignment(frozenset({0, 1, 2, 3, 4, 9}), 2, frozenset({9}), served=SERVED)
    assert (await second.heartbeat("w2", partitions=10, lease_seconds=LEASE)).partitions == {
        5, 6, 7, 8,
    }  # fmt: skip


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_owned_histories_keep_every_key_in_order(backend: Backend, seed: int) -> None:
    """A relay's owned reads beside its own batches in flight, with random writes (some
    delayed) and settles (publish, fail with a short backoff, abandon, leave pending),
    as the processor does: no read may return a row in flight, finished, not yet due,
    or ahead of an unfinished earlier row of its key outside the batch."""
    rng = random.Random(seed)
    await hold_everything(backend)
    written: dict[str | None, list[uuid.UUID]] = {}
    finished: set[uuid.UUID] = set()
    published: dict[str | None, list[uuid.UUID]] = {}
    batches: list[list[StoredMessage]] = []
    due_after: dict[uuid.UUID, float] = {}

    async def read(limit: int) -> None:
        flying = [m for batch in batches for m in batch]
        got = await backend.storage.read(limit=limit, in_flight=in_flight(*flying))
        ended = time.monotonic()
        taken = {m.id for m in got}
        assert all(due_after.get(i, 0.0) <= ended + CLOCK_TICK for i in taken), "taken early"
        assert not taken & {m.id for m in flying}, "a row in flight was read again"
        assert not taken & finished, "a finished row was read"
        for message in got:
            earlier = written[message.key][: written[message.key].index(message.id)]
            if message.key is not None:
                assert all(i in finished or i in taken for i in earlier), message
        if got:
            batches.append(got)

    async def settle(batch: list[StoredMessage]) -> None:
        stuck: set[str | None] = set()
        done: list[int] = []
        failed: list[Failure] = []
        abandoned: list[Failure] = []
        for m in batch:
            if m.key is not None and m.key in stuck:
                continue
            roll = rng.random()
            if roll < 0.7:
                done.append(m.seq)
                finished.add(m.id)
                published.setdefault(m.key, []).append(m.id)
                continue
            stuck.add(m.key)
            if roll < 0.85:
                failed.append(Failure(m.seq, "transient", rng.choice([0.0, 0.05])))
                due_after[m.id] = time.monotonic()
            elif roll < 0.9:
                abandoned.append(Failure(m.seq, "permanent"))
                finished.add(m.id)
        await backend.storage.settle("w1", failed=failed, abandoned=abandoned,
                                           published=done)  # fmt: skip

    for _ in range(150):
        action = rng.random()
        if action < 0.35:
            batch = [
                msg(rng.choice(["a", "b", "c", "d", None]), delay=rng.choice([0.0, 0.0, 0.0, 0.3]))
                for _ in range(rng.randint(1, 6))
            ]
            for message in batch:
                written.setdefault(message.key, []).append(message.id)
                due_after[message.id] = time.monotonic() + message.delay_seconds
            await write(backend, *batch)
        elif action < 0.7 and len(batches) < 3:
            await read(rng.randint(1, 5))
        elif batches:
            await settle(batches.pop(rng.randrange(len(batches))))
    while batches:
        await settle(batches.pop())
    total = sum(len(ids) for ids in written.values())
    for _ in range(400):
        if len(finished) == total:
            break
        await read(5)
        while batches:
            await settle(batches.pop())
        await asyncio.sleep(0.01)
    assert len(finished) == total
    for key, ids in published.items():
        if key is not None:
            assert ids == [i for i in written[key] if i in ids], key


Taken = tuple[int, uuid.UUID, str | None]  # seq, message id, key


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_random_histories_keep_every_key_in_order(backend: Backend, seed: int) -> None:
    """Random writes (some delayed), claims of random size by two workers, and settles
    that publish, fail, abandon or release, as the relay would (a key's rows after one
    that did not go out are released). Every claim must hand out a row only with all
    its key's earlier unfinished rows before it in the same claim; in the end every row
    is finished and each key was published in write order."""
    rng = random.Random(seed)
    workers = [backend.storage, await backend.another()]
    written: dict[str | None, list[uuid.UUID]] = {}
    finished: set[uuid.UUID] = set()
    published: dict[str | None, list[uuid.UUID]] = {}
    in_flight: list[tuple[AnyStorage, str, list[Taken]]] = []
    due_after: dict[uuid.UUID, float] = {}  # no claim that ends before this may take it

    async def claim(worker: AnyStorage, limit: int) -> None:
        got = await worker.claim(f"w{workers.index(worker)}", limit=limit, lease_seconds=LEASE)
        ended = time.monotonic()
        taken = {m.id for m in got.messages}
        assert all(due_after.get(i, 0.0) <= ended + CLOCK_TICK for i in taken), "taken early"
        held = {i for _, _, rows in in_flight for _, i, _ in rows}
        assert not taken & held, "a row in flight was handed out again"
        assert not taken & finished, "a finished row was handed out"
        for message in got.messages:
            earlier = written[message.key][: written[message.key].index(message.id)]
            if message.key is not None:
                assert all(i in finished or i in taken for i in earlier), message
        if got.messages:
            rows = [(m.seq, m.id, m.key) for m in got.messages]
            in_flight.append((worker, got.token, rows))

    async def settle(worker: AnyStorage, token: str, rows: list[Taken]) -> None:
        stuck: set[str | None] = set()
        done: list[int] = []
        released: list[int] = []
        failed: list[Failure] = []
        abandoned: list[Failure] = []
        for seq, message_id, key in sorted(rows):
            if key is not None and key in stuck:
                released.append(seq)
                continue
            roll = rng.random()
            if roll < 0.7:
                done.append(seq)
                finished.add(message_id)
                published.setdefault(key, []).append(message_id)
                continue
            stuck.add(key)
            if roll < 0.85:
                failed.append(Failure(seq, "transient", rng.choice([0.0, 0.05])))
            elif roll < 0.9:
                abandoned.append(Failure(seq, "permanent"))
                finished.add(message_id)
            else:
                released.append(seq)
        await worker.mark_published(token, done)
        await worker.mark_failed(token, failed)
        await worker.abandon(token, abandoned)
        await worker.release(token, released)

    for _ in range(150):
        action = rng.random()
        if action < 0.35:
            batch = [
                msg(rng.choice(["a", "b", "c", "d", None]), delay=rng.choice([0.0, 0.0, 0.0, 0.3]))
                for _ in range(rng.randint(1, 6))
            ]
            for message in batch:
                written.setdefault(message.key, []).append(message.id)
                due_after[message.id] = time.monotonic() + message.delay_seconds
            await write(backend, *batch)
        elif action < 0.7:
            await claim(rng.choice(workers), rng.randint(1, 5))
        elif in_flight:
            await settle(*in_flight.pop(rng.randrange(len(in_flight))))
    while in_flight:
        await settle(*in_flight.pop())
    total = sum(len(ids) for ids in written.values())
    for _ in range(400):
        if len(finished) == total:
            break
        await claim(workers[0], 5)
        while in_flight:
            await settle(*in_flight.pop())
        await asyncio.sleep(0.01)
    assert len(finished) == total
    for key, ids in published.items():
        if key is not None:
            assert ids == [i for i in written[key] if i in ids], key


async def test_abandoned_rows_are_listed_newest_first_with_their_error(backend: Backend) -> None:
    await hold_everything(backend, targets=("default", "partner"))
    before = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=5)
    await write(backend, msg("a"), msg("b"), msg(None), msg("c", targets=["partner"]))
    read = {m.key: m for m in await backend.storage.read(limit=10)}
    errors = {"a": "unroutable", None: "too large", "c": "rejected"}
    await backend.storage.settle(
        "w1",
        abandoned=[Failure(read[k].seq, error) for k, error in errors.items()],
        published=[read["b"].seq],
    )
    listed = await backend.storage.abandoned(limit=10)
    assert [(m.seq, m.id, m.key, m.target, m.last_error, m.attempts) for m in listed] == sorted(
        ((read[k].seq, read[k].id, k, read[k].target, e, 1) for k, e in errors.items()),
        reverse=True,
    )
    for row in listed:
        assert before <= row.abandoned_at <= datetime.datetime.now(datetime.UTC)
        assert row.occurred_at == read[row.key].occurred_at
        assert (row.topic, row.type) == ("orders", "orders")
    # Pages, newest first; a target of its own.
    first = await backend.storage.abandoned(limit=2)
    rest = await backend.storage.abandoned(limit=2, before=first[-1].seq)
    assert [m.seq for m in (*first, *rest)] == [m.seq for m in listed]
    assert [m.key for m in await backend.storage.abandoned(limit=10, target="partner")] == ["c"]
    assert await backend.storage.abandoned(limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        await backend.storage.abandoned(limit=-1)
    # Replayed, a row is no longer abandoned.
    assert await backend.storage.replay([read["a"].seq]) == 1
    assert read["a"].seq not in {m.seq for m in await backend.storage.abandoned(limit=10)}
