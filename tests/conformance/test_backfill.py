"""Backfill on every backend: retained messages copied in order to a target, once,
resumable from any stop."""

from __future__ import annotations

import pytest

from relaybox.core.inspection import Change, MessageFilter, MessageState
from relaybox.core.message import Target
from relaybox.errors import ConfigurationError
from relaybox.operations.backfill import backfill
from relaybox.operations.messages import Operations
from tests.conformance.conftest import Backend
from tests.conformance.test_storage import LEASE, msg, write

OPS = Change("ops", "a new consumer needs the history")
SOURCE = MessageFilter(target="default")


def ops(backend: Backend) -> Operations:
    return Operations(backend.storage, name="test")  # type: ignore[arg-type]


async def published(backend: Backend, *keys: str) -> list[int]:
    """Write a message per key and publish them all, kept (a published retention)."""
    await write(backend, *(msg(key) for key in keys))
    claim = await backend.storage.claim("w1", limit=len(keys), lease_seconds=LEASE)
    seqs = [m.seq for m in claim.messages]
    assert await backend.storage.mark_published(claim.token, seqs) == len(keys)
    return seqs


async def copies(backend: Backend, target: str) -> list[tuple[str | None, object]]:
    page = await ops(backend).search(MessageFilter(target=target), limit=100, newest_first=False)
    return [(m.key, m.id) for m in page.messages]


async def test_a_backfill_copies_the_retained_messages_in_order_to_a_later_target(
    backend: Backend,
) -> None:
    seqs = await published(backend, "a", "b", "a")
    originals = [(await backend.storage.message(seq)) for seq in seqs]
    outcome = await backfill(ops(backend), "late-1", SOURCE, Target("late"), OPS)
    assert (outcome.copied, outcome.plan.count, outcome.plan.keys) == (3, 3, 2)
    assert outcome.job is not None
    assert outcome.job.finished_at is not None
    assert outcome.job.cursor == seqs[-1]
    assert await copies(backend, "late") == [(d.summary.key, d.summary.id) for d in originals if d]
    new = (await ops(backend).search(MessageFilter(target="late"), limit=1)).messages[0]
    assert new.state is MessageState.PENDING
    detail = await backend.storage.message(new.seq)
    assert detail is not None
    assert originals[-1] is not None
    assert detail.payload == originals[-1].payload
    again = await backfill(ops(backend), "late-1", SOURCE, Target("late"), OPS)
    assert again.copied == 0  # finished: a second run copies nothing
    assert len(await copies(backend, "late")) == 3


async def test_a_stopped_backfill_goes_on_from_its_cursor_and_copies_each_message_once(
    backend: Backend,
) -> None:
    await published(backend, "a", "b", "c", "d", "e")

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await backfill(ops(backend), "late-2", SOURCE, Target("late"), OPS, batch=2,
                       progress=stop)  # fmt: skip
    assert len(await copies(backend, "late")) == 2
    outcome = await backfill(ops(backend), "late-2", SOURCE, Target("late"), OPS, batch=2)
    assert outcome.copied == 3
    assert [key for key, _ in await copies(backend, "late")] == ["a", "b", "c", "d", "e"]


async def test_a_backfill_to_its_own_source_target_ends(backend: Backend) -> None:
    await published(backend, "a", "b")
    outcome = await backfill(ops(backend), "again", SOURCE, Target("default"), OPS, batch=1)
    assert outcome.copied == 2
    live = await ops(backend).search(
        MessageFilter(target="default", states=frozenset({MessageState.PENDING})), limit=10
    )
    assert len(live.messages) == 2


async def test_a_dry_run_counts_and_names_the_keys_already_live_on_the_target(
    backend: Backend,
) -> None:
    await published(backend, "a", "b")
    await write(backend, msg("b", targets=["partner"]))
    outcome = await backfill(ops(backend), "p", SOURCE, Target("partner"), OPS, dry_run=True)
    assert (outcome.dry_run, outcome.copied, outcome.plan.count) == (True, 0, 2)
    assert outcome.plan.keys_live_on_target == ["b"]
    assert outcome.job is None
    assert await backend.storage.backfill_job("p") is None


async def test_a_backfill_refuses_a_source_without_a_target_or_a_name_reused(
    backend: Backend,
) -> None:
    await published(backend, "a")
    with pytest.raises(ConfigurationError, match="name the target whose messages to copy"):
        await backfill(ops(backend), "x", MessageFilter(), Target("late"), OPS)
    await backfill(ops(backend), "x", SOURCE, Target("late"), OPS)
    with pytest.raises(ConfigurationError, match="already exists with another filter"):
        await backfill(ops(backend), "x", SOURCE, Target("other"), OPS)
