"""The subtle case: two copies of one message processed at once by two consumers
must not both apply their effects, on PostgreSQL, MariaDB and SQLite.

The copies race for real: both consumers run concurrently against the shared database,
and the first copy holds its transaction open (inside the handler, after its inbox
record) while the second arrives. The second copy's check must wait for the first's
commit and then skip, or, when the first rolls back, apply.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from relaybox.core.incoming import Incoming
from relaybox.inbox import Processed
from tests.databases import fetch_all
from tests.inbox.support import DIALECTS, InboxWorld, incoming


@pytest.fixture(params=DIALECTS)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld(request.param, tmp_path) as opened:
        yield opened


class Gate:
    """A `before_effect` hook that holds the first copy's transaction open, after its
    inbox record, until `release` is set; with `fail`, that copy then raises."""

    def __init__(self, *, fail: bool = False) -> None:
        self.first_inside = asyncio.Event()
        self.release = asyncio.Event()
        self.fail = fail

    async def __call__(self, message: Incoming) -> None:
        if self.first_inside.is_set():
            return
        self.first_inside.set()
        await self.release.wait()
        if self.fail:
            raise RuntimeError("the first consumer crashes mid-handler")


async def test_second_copy_waits_for_the_first_and_skips(world: InboxWorld) -> None:
    gate = Gate()
    one = world.consumer(name="billing", before_effect=gate)
    two = world.consumer(name="billing", before_effect=gate)
    copy = incoming("payment-1")
    first = asyncio.create_task(one.process(copy))
    await gate.first_inside.wait()
    second = asyncio.create_task(two.process(copy))
    try:
        await held_up_by_the_first(world)
        assert not second.done(), "the second copy must wait for the first copy's transaction"
    finally:
        gate.release.set()  # (a failure above must not leave the first copy hanging)
    assert await first is Processed.APPLIED
    assert await second is Processed.DUPLICATE
    assert world.effects("billing") == {"payment-1": 1}


async def held_up_by_the_first(world: InboxWorld) -> None:
    """Until the database shows a statement on the inbox waiting for a lock: the second
    copy's check, held up by the first copy's uncommitted record. Awaited, not slept
    for, so a busy machine cannot let the test look before the second copy got there."""
    like = f"'%{world.table}%'"
    if world.dialect == "postgresql":
        query = (
            "SELECT count(*) FROM pg_stat_activity"
            f" WHERE wait_event_type = 'Lock' AND query LIKE {like}"
        )
    elif world.dialect == "mysql":
        query = (
            "SELECT count(*) FROM information_schema.innodb_trx"
            f" WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE {like}"
        )
    else:  # SQLite shows no connection waiting for its write lock: give it time
        await asyncio.sleep(0.5)
        return
    async with asyncio.timeout(30):
        while not fetch_all(world.url, query)[0][0]:
            # Not faster: MariaDB refreshes innodb_trx only when it was last read over
            # 0.1 s ago, so reading it more often shows the same old rows for ever.
            await asyncio.sleep(0.25)


async def test_second_copy_applies_when_the_first_rolls_back(world: InboxWorld) -> None:
    gate = Gate(fail=True)
    one = world.consumer(name="billing", before_effect=gate)
    two = world.consumer(name="billing", before_effect=gate)
    copy = incoming("payment-2")
    first = asyncio.create_task(one.process(copy))
    await gate.first_inside.wait()
    second = asyncio.create_task(two.process(copy))
    try:
        await held_up_by_the_first(world)
    finally:
        gate.release.set()
    with pytest.raises(RuntimeError):
        await first
    assert await second is Processed.APPLIED
    assert world.effects("billing") == {"payment-2": 1}


async def test_many_consumers_many_copies_apply_each_message_once(world: InboxWorld) -> None:
    """Four consumers each get every one of 40 messages (160 deliveries, all at once
    where the database allows): every message's effect is applied exactly once."""
    consumers = [world.consumer(name="stress") for _ in range(4)]
    messages = [incoming(f"m-{n}") for n in range(40)]

    async def deliver_all(index: int) -> list[Processed]:
        order = messages[index:] + messages[:index]  # each consumer starts elsewhere
        return [await consumers[index].process(message) for message in order]

    outcomes = [o for run in await asyncio.gather(*map(deliver_all, range(4))) for o in run]
    assert outcomes.count(Processed.APPLIED) == 40
    assert outcomes.count(Processed.DUPLICATE) == 120
    assert world.effects("stress") == {message.id: 1 for message in messages}


async def test_watermark_copies_racing_apply_once(world: InboxWorld) -> None:
    gate = Gate()
    one = world.consumer(name="wm", mode="watermark", before_effect=gate)
    two = world.consumer(name="wm", mode="watermark", before_effect=gate)
    copy = incoming("seq-5", partition=2, sequence=5)
    first = asyncio.create_task(one.process(copy))
    await gate.first_inside.wait()
    second = asyncio.create_task(two.process(copy))
    try:
        await held_up_by_the_first(world)
    finally:
        gate.release.set()
    assert {await first, await second} == {Processed.APPLIED, Processed.DUPLICATE}
    assert world.effects("wm") == {"seq-5": 1}
