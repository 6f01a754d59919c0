"""The operations the console and the command line share, on every backend: plans and
dry runs, per-key order on replay and hold, and the audit of every change."""

from __future__ import annotations

import dataclasses

from relaybox.core.inspection import AuditAction, Change, MessageFilter, MessageState
from relaybox.core.records import Failure
from relaybox.operations.messages import Operations
from tests.conformance.conftest import Backend
from tests.conformance.test_storage import LEASE, msg, write

ANA = Change("ana", "broker refused the schema")


def ops(backend: Backend) -> Operations:
    return Operations(backend.storage, name="test")  # type: ignore[arg-type]


async def abandon_first(backend: Backend) -> int:
    """Claim the first due row and abandon it; its seq."""
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    (row,) = claim.messages
    assert await backend.storage.abandon(claim.token, [Failure(row.seq, "refused")]) == 1
    return row.seq


async def states(backend: Backend, *seqs: int) -> list[MessageState | None]:
    found = []
    for seq in seqs:
        detail = await backend.storage.message(seq)
        found.append(None if detail is None else detail.summary.state)
    return found


async def test_a_replay_plan_names_its_keys_and_what_was_published_ahead(
    backend: Backend,
) -> None:
    await write(backend, msg("k"), msg("k"), msg("k"), msg("j"))
    first = await abandon_first(backend)
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    (second,) = claim.messages
    assert await backend.storage.mark_published(claim.token, [second.seq]) == 1  # retained
    plan = await ops(backend).plan(AuditAction.REPLAY, MessageFilter(key="k"))
    assert plan.seqs == [first]
    assert plan.keys == [("default", "k")]
    assert [m.seq for m in plan.published_ahead] == [second.seq]


async def test_a_dry_run_changes_nothing_and_the_replay_goes_before_its_keys_later_rows(
    backend: Backend,
) -> None:
    await write(backend, msg("k"), msg("k"))
    first = await abandon_first(backend)
    later = first + 1
    operations = ops(backend)
    dry = await operations.act(AuditAction.REPLAY, MessageFilter(key="k"), ANA, dry_run=True)
    assert (dry.dry_run, dry.changed, dry.plan.seqs) == (True, 0, [first])
    assert await states(backend, first) == [MessageState.ABANDONED]
    assert await operations.audit() == []
    done = await operations.act(AuditAction.REPLAY, MessageFilter(key="k"), ANA)
    assert done.changed == 1
    claim = await backend.storage.claim("w2", limit=10, lease_seconds=LEASE)
    assert [(m.seq, m.attempts) for m in claim.messages] == [(first, 0), (later, 0)]
    (record,) = await operations.audit()
    assert (record.action, record.actor, record.reason, record.seq) == (
        AuditAction.REPLAY, "ana", "broker refused the schema", first,
    )  # fmt: skip


async def test_holding_a_key_holds_its_first_live_row_and_the_rest_wait_behind(
    backend: Backend,
) -> None:
    await write(backend, msg("k"), msg("k"), msg("j"))
    operations = ops(backend)
    rows = (await operations.search(MessageFilter(key="k"), newest_first=False)).messages
    head, behind = (m.seq for m in rows)
    outcome = await operations.act(AuditAction.HOLD, seq_filter(behind), ANA)
    assert outcome.plan.seqs == [head]  # holding any row of a key holds the key's head
    assert outcome.changed == 1
    assert await states(backend, head, behind) == [MessageState.HELD, MessageState.PENDING]
    read = await backend.storage.read(limit=10)
    assert [m.key for m in read] == ["j"]
    view = await operations.show(behind)
    assert view is not None
    assert view.queue is not None
    assert [m.seq for m in view.queue.ahead] == [head]
    released = await operations.act(AuditAction.RELEASE, MessageFilter(key="k"), ANA)
    assert released.changed == 1
    read = await backend.storage.read(limit=10)
    assert [m.seq for m in read] == [head, behind, behind + 1]


def seq_filter(seq: int) -> MessageFilter:
    return MessageFilter(min_seq=seq, max_seq=seq)


async def test_discard_leaves_an_audit_record_and_the_message_is_gone(backend: Backend) -> None:
    await write(backend, msg("k"), msg("k"))
    operations = ops(backend)
    first = await abandon_first(backend)
    outcome = await operations.act(AuditAction.DISCARD, [first], Change("bo", "poison"))
    assert outcome.changed == 1
    assert await backend.storage.message(first) is None
    (record,) = await operations.audit()
    assert (record.action, record.actor, record.reason, record.key) == (
        AuditAction.DISCARD, "bo", "poison", "k",
    )  # fmt: skip


async def test_a_delay_holds_back_the_key_and_an_expedite_lets_it_go(backend: Backend) -> None:
    await write(backend, msg("k"), msg("k"), msg("j"))
    operations = ops(backend)
    head = (await operations.search(MessageFilter(key="k"), newest_first=False)).messages[0].seq
    delayed = await operations.act(AuditAction.DELAY, [head], ANA, delay=3600)
    assert delayed.changed == 1
    assert await states(backend, head) == [MessageState.DELAYED]
    assert [m.key for m in await backend.storage.read(limit=10)] == ["j"]
    expedited = await operations.act(AuditAction.EXPEDITE, [head], ANA)
    assert expedited.changed == 1
    assert [m.key for m in await backend.storage.read(limit=10)] == ["k", "k", "j"]
    assert [r.action for r in await operations.audit()] == [
        AuditAction.EXPEDITE, AuditAction.DELAY,
    ]  # fmt: skip


async def test_a_plan_carried_out_late_changes_only_rows_still_in_its_state(
    backend: Backend,
) -> None:
    await write(backend, msg("k"), msg("q"))
    operations = ops(backend)
    first = await abandon_first(backend)
    second = await abandon_first(backend)
    plan = await operations.plan(AuditAction.REPLAY, MessageFilter())
    assert plan.seqs == [first, second]
    assert await backend.storage.replay([first]) == 1  # someone else was quicker
    outcome = await operations.apply(plan, ANA)
    assert outcome.changed == 1
    assert [r.seq for r in await operations.audit()] == [second]


async def test_named_seqs_are_planned_only_in_a_state_the_action_applies_to(
    backend: Backend,
) -> None:
    await write(backend, msg("a"), msg("b"), msg("c"))
    operations = ops(backend)
    abandoned = await abandon_first(backend)
    pending = abandoned + 1
    plan = await operations.plan(AuditAction.REPLAY, [abandoned, pending])
    assert plan.seqs == [abandoned]
    plan = await operations.plan(AuditAction.EXPEDITE, [abandoned, pending])
    assert plan.seqs == [pending]


async def test_search_pages_follow_the_cursor_both_ways(backend: Backend) -> None:
    await write(backend, *(msg(f"k{n}") for n in range(7)))
    operations = ops(backend)
    for newest_first in (True, False):
        seen: list[int] = []
        after = None
        while True:
            page = await operations.search(limit=3, after=after, newest_first=newest_first)
            seen += [m.seq for m in page.messages]
            if page.next_after is None:
                break
            after = page.next_after
        assert len(seen) == 7
        assert seen == sorted(seen, reverse=newest_first)


async def test_the_live_relays_are_listed_with_the_partitions_each_holds(
    backend: Backend,
) -> None:
    storage = backend.storage
    assert await ops(backend).relays() == []
    await storage.heartbeat("w1", partitions=4, lease_seconds=LEASE)
    await storage.heartbeat("w2", partitions=2, lease_seconds=LEASE, target="partner")
    relays = await ops(backend).relays()
    assert [(r.worker, r.target, r.partitions) for r in relays] == [
        ("w1", "default", (0, 1, 2, 3)), ("w2", "partner", (0, 1)),
    ]  # fmt: skip
    assert all(r.joined_at <= r.lease_until for r in relays)
    await storage.leave("w1")
    assert [r.worker for r in await ops(backend).relays()] == ["w2"]


async def test_a_key_searched_without_a_target_is_found_in_every_target(backend: Backend) -> None:
    await write(backend, msg("k"), msg("j"), msg("k", targets=["partner"]), msg("k"))
    first = await abandon_first(backend)  # one finished row of the key, in default
    operations = ops(backend)
    for newest_first in (True, False):
        seen: list[tuple[int, str]] = []
        after = None
        while True:
            page = await operations.search(
                MessageFilter(key="k"), limit=2, after=after, newest_first=newest_first
            )
            seen += [(m.seq, m.target) for m in page.messages]
            if page.next_after is None:
                break
            after = page.next_after
        expected = [(first, "default"), (first + 2, "partner"), (first + 3, "default")]
        assert seen == (expected[::-1] if newest_first else expected)


async def test_abandoned_messages_alone_page_both_ways_among_live_ones(backend: Backend) -> None:
    await write(backend, *(msg(f"k{n}") for n in range(5)), msg("p", targets=["partner"]))
    abandoned = [await abandon_first(backend) for _ in range(4)]  # k0..k3; k4 and p stay live
    operations = ops(backend)
    only = MessageFilter(states=frozenset({MessageState.ABANDONED}))
    for newest_first in (True, False):
        seen: list[int] = []
        after = None
        while True:
            page = await operations.search(only, limit=3, after=after, newest_first=newest_first)
            assert all(m.state is MessageState.ABANDONED for m in page.messages)
            seen += [m.seq for m in page.messages]
            if page.next_after is None:
                break
            after = page.next_after
        assert seen == sorted(abandoned, reverse=newest_first)
    keyed = dataclasses.replace(only, key="k2", target="default")
    assert [m.seq for m in (await operations.search(keyed)).messages] == [abandoned[2]]
    assert (await operations.search(dataclasses.replace(only, target="partner"))).messages == []


async def test_stuck_messages_are_counted_per_target(backend: Backend) -> None:
    await write(backend, msg("a"), msg("b"), msg("c"), msg("d"), msg("p", targets=["partner"]))
    operations = ops(backend)
    abandoned = await abandon_first(backend)  # a
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)  # b
    assert await backend.storage.mark_failed(claim.token, [Failure(claim.messages[0].seq, "x", 60)])
    held = abandoned + 2  # c
    assert (await operations.act(AuditAction.HOLD, [held], ANA)).changed == 1
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE, targets=["partner"])
    assert await backend.storage.abandon(claim.token, [Failure(claim.messages[0].seq, "no")])
    stuck = {s.target: s for s in await operations.stuck()}  # d stays pending, due
    assert set(stuck) == {"default", "partner"}
    default, partner = stuck["default"], stuck["partner"]
    assert (default.retrying, default.held, default.abandoned) == (1, 1, 1)
    assert (partner.retrying, partner.held, partner.abandoned) == (0, 0, 1)
    first = await backend.storage.message(abandoned)
    assert first is not None
    assert default.oldest_written == first.summary.created_at
