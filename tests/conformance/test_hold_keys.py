"""The hold-the-key policy, on every backend: a keyed row the relay gives up on stays
live and held, and the later rows of its (target, key) wait behind it, in reads and in
claims alike; keyless rows are abandoned as without it; held rows are counted apart;
and a hold is never undone by a failure or an abandon that a relay settles late, nor a
delay shortened by a failure settled late."""

from __future__ import annotations

import asyncio
import datetime

from relaybox.core.inspection import Change
from relaybox.core.lifecycle import Status
from relaybox.core.records import Failure, Settled
from tests.conformance.conftest import Backend
from tests.conformance.test_storage import LEASE, hold_everything, msg, write


async def test_an_abandoned_keyed_row_is_held_and_holds_back_its_key_in_reads(
    backend: Backend,
) -> None:
    await hold_everything(backend)
    await write(backend, msg("k"), msg("k"), msg("other"), msg(None), msg("k"))
    head, *_ = await backend.storage.read(limit=1)
    settled = await backend.storage.settle(
        "w1", abandoned=[Failure(head.seq, "refused")], hold_keys=True
    )
    assert settled == Settled(abandoned=1)
    found = await backend.storage.read(limit=10)
    assert [m.key for m in found] == ["other", None]
    assert head.seq not in {m.seq for m in found}
    # Nothing of the key comes later either, in a read nor in a claim.
    await asyncio.sleep(0.2)
    assert [m.key for m in await backend.storage.read(limit=10)] == ["other", None]
    claim = await backend.storage.claim("w2", limit=10, lease_seconds=LEASE)
    assert [m.key for m in claim.messages] == ["other", None]


async def test_a_row_lease_abandon_holds_the_key_in_claims_and_reads(backend: Backend) -> None:
    await write(backend, msg("k"), msg("k"), msg("other"))
    claim = await backend.storage.claim("w1", limit=1, lease_seconds=LEASE)
    (head,) = claim.messages
    held = await backend.storage.abandon(
        claim.token, [Failure(head.seq, "refused")], hold_keys=True
    )
    assert held == 1
    nxt = await backend.storage.claim("w1", limit=10, lease_seconds=LEASE)
    assert [m.key for m in nxt.messages] == ["other"]
    await backend.storage.mark_published(nxt.token, [m.seq for m in nxt.messages])
    await hold_everything(backend)
    assert await backend.storage.read(limit=10) == []
    again = await backend.storage.claim("w2", limit=10, lease_seconds=LEASE)
    assert again.messages == []
    stats = await backend.storage.stats()
    assert (stats.held, stats.held_keys, stats.pending, stats.abandoned) == (1, 1, 1, 0)


async def test_keyless_rows_are_abandoned_as_without_the_policy(backend: Backend) -> None:
    await hold_everything(backend)
    await write(backend, msg(None), msg("k"), msg(None))
    first, keyed, _ = await backend.storage.read(limit=10)
    settled = await backend.storage.settle(
        "w1", abandoned=[Failure(first.seq, "refused"), Failure(keyed.seq, "refused")],
        hold_keys=True,
    )  # fmt: skip
    assert settled == Settled(abandoned=2)
    listed = await backend.storage.abandoned(limit=10)
    assert [(m.seq, m.last_error) for m in listed] == [(first.seq, "refused")]
    claim = await backend.storage.claim("w2", limit=10, lease_seconds=LEASE)
    (last,) = claim.messages
    assert last.key is None
    dropped = await backend.storage.abandon(claim.token, [Failure(last.seq, "no")], hold_keys=True)
    assert dropped == 1
    stats = await backend.storage.stats()
    assert (stats.abandoned, stats.held, stats.held_keys) == (2, 1, 1)


async def test_without_the_policy_a_keyed_row_is_abandoned_and_its_key_goes_on(
    backend: Backend,
) -> None:
    await hold_everything(backend)
    await write(backend, msg("k"), msg("k"))
    head, _ = await backend.storage.read(limit=10)
    assert await backend.storage.settle("w1", abandoned=[Failure(head.seq, "x")]) == Settled(
        abandoned=1
    )
    assert [m.seq for m in await backend.storage.read(limit=10)] == [head.seq + 1]
    stats = await backend.storage.stats()
    assert (stats.abandoned, stats.held, stats.held_keys) == (1, 0, 0)


async def test_stats_count_held_rows_and_keys_apart_from_failed_and_pending(
    backend: Backend,
) -> None:
    await hold_everything(backend)
    await write(backend, msg("k"), msg("k"), msg("j"), msg("retry"), msg(None))
    k1, k2, j, retry, _ = await backend.storage.read(limit=10)
    await backend.storage.settle(
        "w1", abandoned=[Failure(s, "refused") for s in (k1.seq, k2.seq, j.seq)],
        failed=[Failure(retry.seq, "flaky", 60)], hold_keys=True,
    )  # fmt: skip
    await asyncio.sleep(0.2)
    stats = await backend.storage.stats()
    assert (stats.held, stats.held_keys) == (3, 2)
    assert (stats.pending, stats.failed, stats.abandoned) == (1, 1, 0)
    assert stats.counts.get(Status.PROCESSING, 0) == 0
    assert stats.live_by_target == {"default": 5}
    # The oldest due row is the keyless one, written a moment ago: not a held row.
    assert stats.oldest_pending_age is not None
    assert stats.oldest_pending_age < 30


async def test_a_held_row_is_not_due_for_the_oldest_pending_age(backend: Backend) -> None:
    await hold_everything(backend)
    await write(backend, msg("k"))
    (head,) = await backend.storage.read(limit=10)
    await backend.storage.settle("w1", abandoned=[Failure(head.seq, "refused")], hold_keys=True)
    stats = await backend.storage.stats()
    assert stats.oldest_pending_age is None
    assert (stats.pending, stats.failed, stats.held) == (0, 0, 1)


async def test_a_hold_survives_a_late_failed_or_abandoned_settle(backend: Backend) -> None:
    """A relay read the row; it was held before that relay settled its failure: the
    failure, or an abandon without the policy, leaves the hold as it is."""
    await hold_everything(backend)
    await write(backend, msg("k"), msg("k"))
    head, nxt = await backend.storage.read(limit=10)
    await backend.storage.settle("w1", abandoned=[Failure(head.seq, "first")], hold_keys=True)
    late = await backend.storage.settle(
        "w1", failed=[Failure(head.seq, "late", 0)], abandoned=[Failure(nxt.seq, "x")]
    )
    assert late == Settled(abandoned=1)  # only the row that was not held
    assert await backend.storage.settle("w1", abandoned=[Failure(head.seq, "late")]) == Settled()
    assert (
        await backend.storage.settle("w1", abandoned=[Failure(head.seq, "late")], hold_keys=True)
        == Settled()
    )
    stats = await backend.storage.stats()
    assert (stats.held, stats.failed, stats.abandoned) == (1, 0, 1)
    assert [m.seq for m in await backend.storage.abandoned(limit=10)] == [nxt.seq]
    await asyncio.sleep(0.2)
    assert await backend.storage.read(limit=10) == []
    # A publish settled late still goes through: the message went out.
    assert await backend.storage.settle("w1", published=[head.seq]) == Settled(published=1)
    stats = await backend.storage.stats()
    assert (stats.held, stats.held_keys) == (0, 0)


async def test_a_held_key_s_long_backlog_hides_no_other_row(backend: Backend) -> None:
    """Past the window of rows a read or a claim looks at first, the held key's rows
    stay behind its head, and the rows of other keys are found."""
    await hold_everything(backend)
    await write(backend, *[msg("held") for _ in range(150)])
    await write(backend, msg("good"), msg("good"), msg(None), msg("other"))
    head, *_ = await backend.storage.read(limit=1)
    await backend.storage.settle("w1", abandoned=[Failure(head.seq, "refused")], hold_keys=True)
    found = await backend.storage.read(limit=4)
    assert [m.key for m in found] == ["good", "good", None, "other"]
    claim = await backend.storage.claim("w2", limit=10, lease_seconds=LEASE)
    assert [m.key for m in claim.messages] == ["good", "good", None, "other"]


async def test_a_delay_made_after_the_read_outlasts_a_late_failed_settle(
    backend: Backend,
) -> None:
    """A relay read the row; an operator delayed it by an hour before that relay settled
    its failure with a short retry: the row stays due in an hour, not in a second."""
    await hold_everything(backend)
    await write(backend, msg("k"), msg("k"))
    head, _ = await backend.storage.read(limit=10)
    delayed = await backend.storage.reschedule(  # type: ignore[union-attr]
        [head.seq], delay=3600, change=Change("ops")
    )
    assert delayed == 1
    settled = await backend.storage.settle("w1", failed=[Failure(head.seq, "down", 1)])
    assert settled == Settled(failed=1)
    detail = await backend.storage.message(head.seq)  # type: ignore[union-attr]
    assert detail is not None
    due = detail.summary.available_at
    assert due is not None
    due_in = due - datetime.datetime.now(datetime.UTC)
    assert due_in > datetime.timedelta(minutes=59)
    assert await backend.storage.read(limit=10) == []  # and the key waits behind it
