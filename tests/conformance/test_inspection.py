"""The operator's console over every backend (relaybox.ports.InspectionStorage): the
state read off each row, searches and their pages, a message in full, and each change
with its check of the row's state and its audit record."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from typing import cast

import pytest

from relaybox import Message
from relaybox.core.inspection import (
    AuditAction,
    Change,
    MessageFilter,
    MessageState,
    MessageSummary,
)
from relaybox.core.records import Failure, Routing
from relaybox.errors import ConfigurationError
from relaybox.operations.messages import Operations, Storage
from tests.conformance.conftest import Backend

ROUTING = Routing.of(["default", "partner"], ["default"])
LEASE = 30.0
#: A lease a test waits out.
SHORT_LEASE = 1.5
ALICE = Change("alice", "stuck behind a bad row")
BOB = Change("bob")
S = MessageState


def ops(backend: Backend) -> Storage:
    """The backend's storage, as the operations module sees it."""
    return cast(Storage, backend.storage)


async def write(backend: Backend, *messages: Message) -> None:
    await backend.storage.write(ROUTING.rows(messages))


def msg(key: str | None = None, **fields: object) -> Message:
    return Message(
        topic=str(fields.pop("topic", "orders")),
        key=key,
        payload=fields.pop("payload", {"n": 1}),
        **fields,
    )  # type: ignore[arg-type]


async def everything(backend: Backend, **where: object) -> list[MessageSummary]:
    """Every message matching `where`, oldest first."""
    return await ops(backend).search(
        MessageFilter(**where),  # type: ignore[arg-type]
        limit=1000,
        newest_first=False,
    )


async def seqs(backend: Backend, **where: object) -> list[int]:
    return [m.seq for m in await everything(backend, **where)]


async def states(backend: Backend) -> dict[int, MessageState]:
    return {m.seq: m.state for m in await everything(backend)}


async def one_written(backend: Backend, message: Message) -> int:
    """Write `message` (one target) and return its seq."""
    before = set(await seqs(backend))
    await write(backend, message)
    (seq,) = set(await seqs(backend)) - before
    return seq


async def claim_one(backend: Backend, lease: float = LEASE) -> tuple[str, int]:
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=lease)
    (row,) = claim.messages
    return claim.token, row.seq


async def every_state(backend: Backend) -> dict[MessageState, int]:
    """One row in each state, each of its own key: their seqs by state."""
    storage = backend.storage
    found: dict[MessageState, int] = {}
    await write(backend, msg("in-flight"))
    _, found[S.IN_FLIGHT] = await claim_one(backend)
    await write(backend, msg("retrying"))
    token, found[S.RETRYING] = await claim_one(backend)
    assert await storage.mark_failed(token, [Failure(found[S.RETRYING], "down", 60)]) == 1
    await write(backend, msg("abandoned"))
    token, found[S.ABANDONED] = await claim_one(backend)
    assert await storage.abandon(token, [Failure(found[S.ABANDONED], "refused")]) == 1
    await write(backend, msg("published"))
    token, found[S.PUBLISHED] = await claim_one(backend)
    assert await storage.mark_published(token, [found[S.PUBLISHED]]) == 1
    found[S.HELD] = await one_written(backend, msg("held"))
    assert await ops(backend).hold([found[S.HELD]], ALICE) == 1
    found[S.DELAYED] = await one_written(backend, msg("delayed", delay=60))
    found[S.PENDING] = await one_written(backend, msg("pending"))
    return found


async def test_each_state_is_read_off_its_row(backend: Backend) -> None:
    found = await every_state(backend)
    assert await states(backend) == {seq: state for state, seq in found.items()}
    for state, seq in found.items():
        assert await seqs(backend, states=frozenset({state})) == [seq]
        detail = await ops(backend).message(seq)
        assert detail is not None
        assert detail.summary.state is state
    live = await seqs(backend, states=frozenset({S.PENDING, S.HELD, S.PUBLISHED}))
    assert live == sorted([found[S.PENDING], found[S.HELD], found[S.PUBLISHED]])


async def test_finished_rows_have_no_due_time_and_keep_their_times(backend: Backend) -> None:
    found = await every_state(backend)
    rows = {m.seq: m for m in await everything(backend)}
    published, abandoned = rows[found[S.PUBLISHED]], rows[found[S.ABANDONED]]
    assert published.available_at is None
    assert published.published_at is not None
    assert abandoned.available_at is None
    assert abandoned.abandoned_at is not None
    assert abandoned.last_error == "refused"
    assert abandoned.attempts == 1
    assert rows[found[S.RETRYING]].attempts == 1
    delayed = rows[found[S.DELAYED]]
    assert delayed.available_at is not None
    assert delayed.available_at > delayed.created_at + datetime.timedelta(seconds=50)


async def test_a_row_whose_lease_ran_out_counts_by_its_attempts(backend: Backend) -> None:
    await write(backend, msg("fresh"))
    _, fresh = await claim_one(backend, lease=SHORT_LEASE)
    await write(backend, msg("tried"))
    token, tried = await claim_one(backend)
    await backend.storage.mark_failed(token, [Failure(tried, "down", 0)])
    _, tried_again = await claim_one(backend, lease=SHORT_LEASE)
    assert tried_again == tried
    assert await states(backend) == {fresh: S.IN_FLIGHT, tried: S.IN_FLIGHT}
    await asyncio.sleep(SHORT_LEASE + 0.3)
    assert await states(backend) == {fresh: S.PENDING, tried: S.RETRYING}


async def test_a_search_matches_every_field_given(backend: Backend) -> None:
    first_id = uuid.uuid4()
    first = msg(
        "k1", topic="orders", type="OrderPlaced", id=first_id, correlation_id="corr-1",
        causation_id="cause-1", tenant_id="tenant-1", aggregate_id="agg-1",
        targets=["default", "partner"],
    )  # fmt: skip
    await write(backend, first)
    await asyncio.sleep(0.05)
    await write(backend, msg("k2", topic="invoices", type="InvoiceSent"))
    await write(backend, msg("k1", topic="orders", tenant_id="tenant-2"))
    rows = await everything(backend)
    a, b, c, d = (m.seq for m in rows)
    assert [m.target for m in rows] == ["default", "partner", "default", "default"]
    assert await seqs(backend, target="partner") == [b]
    assert await seqs(backend, topic="invoices") == [c]
    assert await seqs(backend, key="k1") == [a, b, d]
    assert await seqs(backend, target="default", key="k1") == [a, d]
    assert await seqs(backend, type="OrderPlaced") == [a, b]
    assert await seqs(backend, id=first_id) == [a, b]
    assert await seqs(backend, id=uuid.uuid4()) == []
    assert await seqs(backend, correlation_id="corr-1") == [a, b]
    assert await seqs(backend, causation_id="cause-1") == [a, b]
    assert await seqs(backend, tenant_id="tenant-2") == [d]
    assert await seqs(backend, aggregate_id="agg-1") == [a, b]
    assert await seqs(backend, min_seq=b, max_seq=c) == [b, c]
    assert await seqs(backend, min_seq=c) == [c, d]
    assert await seqs(backend, max_seq=a) == [a]
    between = rows[1].created_at + (rows[2].created_at - rows[1].created_at) / 2
    assert await seqs(backend, since=between) == [c, d]
    assert await seqs(backend, until=between) == [a, b]
    assert await seqs(backend, since=between, until=between) == []
    assert await seqs(backend, key="k1", tenant_id="tenant-1", target="partner") == [b]
    assert await seqs(backend, key="absent") == []
    assert await seqs(backend, target="default", key="k1", states=frozenset({S.HELD})) == []


async def test_pages_walk_both_ways_with_their_cursors(backend: Backend) -> None:
    await write(backend, *[msg(f"k{i % 3}") for i in range(7)])
    token, seq = await claim_one(backend)
    await backend.storage.mark_published(token, [seq])  # a finished row among live ones
    every = await seqs(backend)
    assert len(every) == 7
    for newest_first in (True, False):
        walked, after = [], None
        while True:
            page = await ops(backend).search(
                MessageFilter(), limit=3, after=after, newest_first=newest_first
            )
            walked += [m.seq for m in page]
            if len(page) < 3:
                break
            after = page[-1].seq
        assert walked == (every[::-1] if newest_first else every)
    newest = await ops(backend).search(MessageFilter(), limit=2)
    assert [m.seq for m in newest] == every[:-3:-1]
    below = await ops(backend).search(MessageFilter(key="k0"), limit=10, after=every[3])
    assert [m.seq for m in below] == [every[0]]
    keyed = await ops(backend).search(
        MessageFilter(target="default", key="k1"), limit=1, after=every[1], newest_first=False
    )
    assert [m.seq for m in keyed] == [every[4]]
    assert await ops(backend).search(MessageFilter(), limit=5, after=every[0]) == []
    assert await ops(backend).search(MessageFilter(), limit=0) == []


async def test_live_and_finished_rows_merge_in_seq_order(backend: Backend) -> None:
    await write(backend, *[msg("k") for _ in range(7)], msg("other"))
    done = []
    for _ in range(3):  # the key's first rows, finished one by one, in turn
        token, seq = await claim_one(backend)
        await backend.storage.mark_published(token, [seq])
        done.append(seq)
        token, seq = await claim_one(backend)
        await backend.storage.abandon(token, [Failure(seq, "refused")])
        done.append(seq)
    every = await seqs(backend, key="k")
    assert every[:6] == done
    for where in (MessageFilter(key="k"), MessageFilter(target="default", key="k")):
        for newest_first in (True, False):
            found = await ops(backend).search(where, limit=4, newest_first=newest_first)
            expected = every[::-1][:4] if newest_first else every[:4]
            assert [m.seq for m in found] == expected
            after = await ops(backend).search(
                where, limit=4, after=found[-1].seq, newest_first=newest_first
            )
            assert [m.seq for m in after] == (every[::-1][4:8] if newest_first else every[4:8])
    for state, expected in ((S.PUBLISHED, done[0::2]), (S.ABANDONED, done[1::2])):
        found = await ops(backend).search(
            MessageFilter(target="default", key="k", states=frozenset({state})),
            limit=10,
            newest_first=False,
        )
        assert [m.seq for m in found] == expected
    live = await seqs(backend, target="default", key="k", states=frozenset({S.PENDING}))
    assert live == every[6:]


async def test_a_message_in_full(backend: Backend) -> None:
    occurred = datetime.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=datetime.UTC)
    payload = bytes(range(256))
    message = Message(
        topic="orders", key="order-1", type="OrderPlaced", payload=payload,
        headers={"origin": "test", "trace": "x-1"}, correlation_id="corr-1",
        causation_id="cause-1", tenant_id="tenant-a", aggregate_id="agg-9",
        occurred_at=occurred, targets=["partner"],
    )  # fmt: skip
    seq = await one_written(backend, message)
    detail = await ops(backend).message(seq)
    assert detail is not None
    summary = detail.summary
    assert (summary.seq, summary.id, summary.state) == (seq, message.id, S.PENDING)
    assert (summary.target, summary.topic, summary.key, summary.type) == (
        "partner", "orders", "order-1", "OrderPlaced",
    )  # fmt: skip
    assert summary.occurred_at == occurred
    assert summary.correlation_id == "corr-1"
    assert detail.payload == payload
    assert detail.headers == {"origin": "test", "trace": "x-1"}
    assert (detail.causation_id, detail.tenant_id, detail.aggregate_id) == (
        "cause-1", "tenant-a", "agg-9",
    )  # fmt: skip
    assert detail.content_type == message.content_type
    assert detail.locked_by is None
    assert detail.locked_until is None
    token = (await backend.storage.claim("w7", limit=1, lease_seconds=LEASE)).token
    leased = await ops(backend).message(seq)
    assert leased is not None
    assert leased.summary.state is S.IN_FLIGHT
    assert leased.locked_by == "w7"
    assert leased.locked_until is not None
    await backend.storage.mark_published(token, [seq])
    finished = await ops(backend).message(seq)
    assert finished is not None
    assert finished.summary.state is S.PUBLISHED
    assert finished.payload == payload
    assert finished.headers == detail.headers
    assert await ops(backend).message(seq + 1000) is None


async def test_each_change_leaves_rows_in_other_states_alone(backend: Backend) -> None:
    found = await every_state(backend)
    every = list(found.values())
    storage = ops(backend)

    def now_in(*wanted: MessageState) -> set[MessageState]:
        return {state for state, seq in found.items() if current[seq] in wanted}

    # Pending, delayed and retrying rows are rescheduled; the rest are left alone.
    assert await storage.reschedule(every, delay=120, change=ALICE) == 3
    current = await states(backend)
    assert now_in(S.DELAYED) == {S.PENDING, S.DELAYED}
    assert current[found[S.RETRYING]] is S.RETRYING  # attempted before: still retrying
    assert await storage.reschedule(every, delay=0, change=ALICE) == 3
    current = await states(backend)
    assert now_in(S.PENDING) == {S.PENDING, S.DELAYED}
    # Only held rows are released; every live row not in flight (nor held) is held.
    assert await storage.release_held(every, ALICE) == 1
    current = await states(backend)
    assert now_in(S.PENDING) == {S.PENDING, S.DELAYED, S.HELD}
    assert await storage.hold(every, ALICE) == 4
    current = await states(backend)
    assert now_in(S.HELD) == {S.PENDING, S.DELAYED, S.HELD, S.RETRYING}
    assert now_in(S.IN_FLIGHT, S.ABANDONED, S.PUBLISHED) == {
        S.IN_FLIGHT, S.ABANDONED, S.PUBLISHED,
    }  # fmt: skip
    assert await storage.hold(every, ALICE) == 0  # held already
    assert await storage.reschedule(every, delay=5, change=ALICE) == 0
    # Replay takes held and abandoned rows, with a fresh attempt count.
    assert await storage.replay(every, BOB) == 5
    current = await states(backend)
    assert now_in(S.PENDING) == {S.PENDING, S.DELAYED, S.HELD, S.RETRYING, S.ABANDONED}
    assert (current[found[S.IN_FLIGHT]], current[found[S.PUBLISHED]]) == (
        S.IN_FLIGHT, S.PUBLISHED,
    )  # fmt: skip
    assert await storage.replay(every, BOB) == 0
    assert await storage.release_held(every, BOB) == 0
    # Discard takes every row but the one in flight.
    assert await storage.discard(every, BOB) == 6
    assert await states(backend) == {found[S.IN_FLIGHT]: S.IN_FLIGHT}


async def test_changes_of_no_row_or_unknown_rows_change_nothing(backend: Backend) -> None:
    seq = await one_written(backend, msg("k"))
    storage = ops(backend)
    assert await storage.discard([], ALICE) == 0
    assert await storage.hold([seq + 100], ALICE) == 0
    assert await storage.replay([]) == 0
    assert await storage.audit(limit=10) == []
    operations = Operations(storage, name="test")
    for delay in (-1.0, 0.0, float("nan"), float("inf"), 1e12):
        with pytest.raises(ConfigurationError):
            await operations.act(AuditAction.DELAY, [seq], ALICE, delay=delay)
    assert await states(backend) == {seq: S.PENDING}


async def test_a_row_in_flight_is_not_discarded(backend: Backend) -> None:
    await write(backend, msg("k"))
    token, seq = await claim_one(backend)
    assert await ops(backend).discard([seq], ALICE) == 0
    assert await ops(backend).hold([seq], ALICE) == 0
    assert await ops(backend).audit(limit=10) == []
    assert await backend.storage.mark_published(token, [seq], delete=True) == 1
    assert await states(backend) == {}


async def test_a_row_whose_lease_ran_out_can_be_held_and_no_claim_takes_it(
    backend: Backend,
) -> None:
    await write(backend, msg("k"), msg("k"))
    _, seq = await claim_one(backend, lease=SHORT_LEASE)
    await asyncio.sleep(SHORT_LEASE + 0.3)
    assert await ops(backend).hold([seq], ALICE) == 1
    assert not (await backend.storage.claim("w2", limit=5, lease_seconds=LEASE)).messages
    assert await backend.storage.read(limit=5) == []
    assert (await states(backend))[seq] is S.HELD


async def test_every_change_leaves_its_audit_records_newest_first(backend: Backend) -> None:
    await write(backend, msg("a"), msg("b"), msg(None))
    a, b, c = await seqs(backend)
    storage = ops(backend)
    assert await storage.hold([a, b], ALICE) == 2
    assert await storage.release_held([a], BOB) == 1
    assert await storage.reschedule([a], delay=30, change=BOB) == 1
    assert await storage.reschedule([a], delay=0, change=BOB) == 1
    assert await storage.replay([b], Change("carol", "fixed upstream")) == 1
    assert await storage.discard([a, c], ALICE) == 2
    records = await storage.audit(limit=100)
    assert [(r.actor, r.action, r.reason, r.seq) for r in records] == [
        ("alice", AuditAction.DISCARD, ALICE.reason, c),
        ("alice", AuditAction.DISCARD, ALICE.reason, a),
        ("carol", AuditAction.REPLAY, "fixed upstream", b),
        ("bob", AuditAction.EXPEDITE, None, a),
        ("bob", AuditAction.DELAY, None, a),
        ("bob", AuditAction.RELEASE, None, a),
        ("alice", AuditAction.HOLD, ALICE.reason, b),
        ("alice", AuditAction.HOLD, ALICE.reason, a),
    ]
    assert [r.id for r in records] == sorted((r.id for r in records), reverse=True)
    first = records[-1]
    assert (first.target, first.key) == ("default", "a")
    assert first.at <= datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=5)
    assert len({r.message_id for r in records if r.seq == a}) == 1
    page = await storage.audit(limit=3, before=records[2].id)
    assert page == records[3:6]
    assert await storage.audit(limit=0) == []
    # A replay without a change (the plain operator command) writes no record.
    assert await storage.hold([b], BOB) == 1
    assert await storage.replay([b]) == 1
    assert (await storage.audit(limit=1))[0].action is AuditAction.HOLD


async def test_a_delayed_head_holds_back_its_key_in_reads_and_claims(backend: Backend) -> None:
    await write(backend, msg("k"), msg("k"), msg("other"))
    head, second, other = await seqs(backend)
    assert await ops(backend).reschedule([head], delay=60, change=ALICE) == 1
    assert [m.seq for m in await backend.storage.read(limit=10)] == [other]
    claim = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert [m.seq for m in claim.messages] == [other]
    assert await ops(backend).reschedule([head], delay=0, change=ALICE) == 1
    assert [m.seq for m in await backend.storage.read(limit=10)] == [head, second]
    claim = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert [m.seq for m in claim.messages] == [head, second]


async def test_a_held_head_holds_back_its_key_until_released(backend: Backend) -> None:
    await write(backend, msg("k"), msg("k"), msg("k"), msg("other"))
    head, second, third, other = await seqs(backend)
    assert await ops(backend).hold([head], ALICE) == 1
    assert [m.seq for m in await backend.storage.read(limit=10)] == [other]
    claim = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert [m.seq for m in claim.messages] == [other]
    assert await ops(backend).release_held([head], BOB) == 1
    assert [m.seq for m in await backend.storage.read(limit=10)] == [head, second, third]
    claim = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert [(m.seq, m.attempts) for m in claim.messages] == [(head, 0), (second, 0), (third, 0)]


async def test_a_held_row_that_failed_before_is_replayed_with_a_fresh_count(
    backend: Backend,
) -> None:
    await write(backend, msg("k"), msg("k"))
    head, second = await seqs(backend)
    token, _ = await claim_one(backend)
    await backend.storage.mark_failed(token, [Failure(head, "down", 0)])
    assert await ops(backend).hold([head], ALICE) == 1
    assert await backend.storage.read(limit=10) == []
    assert not (await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)).messages
    assert await ops(backend).replay([head], BOB) == 1
    claim = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert [(m.seq, m.attempts) for m in claim.messages] == [(head, 0), (second, 0)]


async def test_a_held_row_outlives_a_key_written_after_it(backend: Backend) -> None:
    """A row written after the hold waits behind the held head too."""
    seq = await one_written(backend, msg("k"))
    assert await ops(backend).hold([seq], ALICE) == 1
    later = await one_written(backend, msg("k"))
    assert await backend.storage.read(limit=10) == []
    assert await ops(backend).discard([seq], BOB) == 1
    assert [m.seq for m in await backend.storage.read(limit=10)] == [later]


async def test_search_states_mirror_the_operations_module(backend: Backend) -> None:
    """A plan of each action finds exactly the rows its change then counts."""
    found = await every_state(backend)
    operations = Operations(ops(backend), name="test")
    plan = await operations.plan(AuditAction.REPLAY, MessageFilter())
    assert plan.seqs == sorted([found[S.ABANDONED], found[S.HELD]])
    outcome = await operations.apply(plan, ALICE)
    assert outcome.changed == plan.count
    hold = await operations.plan(AuditAction.HOLD, MessageFilter(key="delayed"))
    assert hold.seqs == [found[S.DELAYED]]
