"""`EntityConsumer` on every backend: two copies racing, a crash between any two steps,
and what it hands back to the broker."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path

import pytest

from relaybox.core.entities import Entity
from relaybox.errors import BrokerError, EntityConflictError, InboxError
from relaybox.inbox.consumer import Processed
from relaybox.inbox.entities import EntityConsumer
from relaybox.publishers.memory import MemoryPublisher
from relaybox.storage.entities.memory import MemoryDedupStore, MemoryEntityStore
from tests.entities.support import (
    BACKENDS,
    Crash,
    Hook,
    HookedDedup,
    HookedEntities,
    HookedPublisher,
    Ledger,
    Stores,
    incoming,
    stores,
)

per_backend = pytest.mark.parametrize("backend", BACKENDS)


def consumer(
    s: Stores, ledger: Ledger, publisher: MemoryPublisher, hook: Hook | None = None
) -> EntityConsumer:
    """A consumer on stores of its own over `s`'s data, as a second process has."""
    entities, dedup = s.another()
    if hook is None:
        return EntityConsumer(
            ledger, entities=entities, dedup=dedup, publishers={"default": publisher}
        )
    return EntityConsumer(
        ledger,
        entities=HookedEntities(entities, hook),
        dedup=HookedDedup(dedup, hook),
        publishers={"default": HookedPublisher(publisher, hook)},
    )


async def _state(s: Stores) -> Entity:
    entity = await s.entities.load("order-1")
    assert entity is not None
    return entity


def _sent_ids(publisher: MemoryPublisher) -> list[uuid.UUID]:
    return [m.id for m in publisher.published]


@per_backend
@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
async def test_two_copies_racing_apply_once(backend: str, existing: bool, tmp_path: Path) -> None:
    """Both copies load the same version and pass the dedup check before either saves:
    the second save fails on the version, its consumer loads again and finds the first's
    outbox entry or its dedup entry, and never applies the message a second time."""
    async with stores(backend, tmp_path) as s:
        if existing:
            assert await s.entities.save(Entity("order-1", {"total": 10, "applied": []}, 1), 0)
        barriers = {"loaded": asyncio.Barrier(2), "save": asyncio.Barrier(2)}
        reached = {"loaded": 0, "save": 0}

        async def both_load_first(point: str) -> None:
            if point in barriers and reached[point] < 2:
                reached[point] += 1
                await barriers[point].wait()

        ledger, publisher = Ledger(), MemoryPublisher()
        first = consumer(s, ledger, publisher, both_load_first)
        second = consumer(s, ledger, publisher, both_load_first)
        outcomes = await asyncio.gather(
            first.process(incoming("m-1", amount=5)), second.process(incoming("m-1", amount=5))
        )
        assert sorted(o.value for o in outcomes) == ["applied", "duplicate"]
        assert first.conflicts + second.conflicts >= 1  # the loser's save, at least
        entity = await _state(s)
        assert entity.state == {"total": 15 if existing else 5, "applied": ["m-1"]}
        assert entity.outbox == {}
        assert await s.dedup.processed("m-1")
        # Both ran the handler on the version they loaded; only the saved run's
        # messages exist, and each went out at least once under its one id.
        assert ledger.runs == 2
        saved = [ids for ids in ledger.produced["m-1"] if set(ids) <= set(_sent_ids(publisher))]
        assert len(saved) == 1
        assert set(_sent_ids(publisher)) == set(saved[0])


@per_backend
async def test_a_copy_overtaken_between_its_first_two_steps_applies_once(
    backend: str, tmp_path: Path
) -> None:
    """The second copy stops after its first call to a store while the first copy runs
    to its end. Its first call is the load, so its dedup check comes after the first
    copy's dedup entry: a duplicate. (Were the check first, it would pass, the load
    would find the outbox entry already removed, and the handler would run again.)"""
    async with stores(backend, tmp_path) as s:
        stopped, first_done = asyncio.Event(), asyncio.Event()
        calls = 0

        async def wait_after_first_call(point: str) -> None:
            nonlocal calls
            calls += 1
            if calls == 2:  # its first call made: "load" then "loaded"
                stopped.set()
                await first_done.wait()

        ledger, publisher = Ledger(), MemoryPublisher()
        late = asyncio.create_task(
            consumer(s, ledger, publisher, wait_after_first_call).process(incoming("m-1"))
        )
        await stopped.wait()
        assert await consumer(s, ledger, publisher).process(incoming("m-1")) is Processed.APPLIED
        first_done.set()
        assert await late is Processed.DUPLICATE
        assert (await _state(s)).state == {"total": 1, "applied": ["m-1"]}
        assert ledger.runs == 1


#: Where a process dies, and what the broker's next delivery of the message does then.
CRASHES = {
    "saved": "the effects and outbox are saved, nothing sent",
    "sent": "a message is sent (one publish call of the two), the dedup entry not added",
    "added": "the dedup entry is added, the outbox entry not removed",
    "done": "everything is done, the broker not acknowledged",
}


@per_backend
@pytest.mark.parametrize("point", list(CRASHES), ids=list(CRASHES))
async def test_a_crash_between_two_steps_then_a_redelivery_applies_once(
    backend: str, point: str, tmp_path: Path
) -> None:
    async with stores(backend, tmp_path) as s:
        ledger, publisher = Ledger(), MemoryPublisher()
        crashed = False

        async def crash_once(reached: str) -> None:
            nonlocal crashed
            if reached == point and not crashed:
                crashed = True
                raise Crash(CRASHES[point])

        doomed = consumer(s, ledger, publisher, crash_once)
        if point == "done":  # it returned; the process died before acknowledging
            assert await doomed.process(incoming("m-1", amount=5)) is Processed.APPLIED
        else:
            with pytest.raises(Crash):
                await doomed.process(incoming("m-1", amount=5))
            assert crashed
        sent_before = _sent_ids(publisher)
        # The broker delivers the message again, to another process.
        successor = consumer(s, ledger, publisher)
        outcome = await successor.process(incoming("m-1", amount=5, delivery_count=2))
        assert outcome is Processed.DUPLICATE
        assert successor.resumed == (1 if point in ("saved", "sent") else 0)
        entity = await _state(s)
        assert entity.state == {"total": 5, "applied": ["m-1"]}
        assert entity.outbox == {}
        assert ledger.runs == 1
        (produced,) = ledger.produced["m-1"]
        assert set(_sent_ids(publisher)) == set(produced)  # each at least once, its one id
        if point == "saved":
            assert sent_before == []
        if point == "sent":  # after the first publish call: one of the two went out
            assert sent_before == produced[:1]
            assert _sent_ids(publisher) == [*sent_before, *produced]  # all again, same ids


@per_backend
async def test_an_unconfirmed_message_is_sent_again_with_its_id(
    backend: str, tmp_path: Path
) -> None:
    async with stores(backend, tmp_path) as s:
        ledger, publisher = Ledger(), MemoryPublisher()
        publisher.fail(times=1)
        with pytest.raises(BrokerError):
            await consumer(s, ledger, publisher).process(incoming("m-1"))
        assert not await s.dedup.processed("m-1")
        assert await consumer(s, ledger, publisher).process(incoming("m-1")) is Processed.DUPLICATE
        (produced,) = ledger.produced["m-1"]
        assert set(_sent_ids(publisher)) == set(produced)
        assert (await _state(s)).outbox == {}


async def test_a_failing_handler_saves_nothing_and_is_redelivered() -> None:
    entities, dedup, publisher = MemoryEntityStore(), MemoryDedupStore(), MemoryPublisher()

    async def refuse(state: object, message: object) -> tuple[object, list[object]]:
        raise ValueError("not today")

    runner = EntityConsumer(
        refuse, entities=entities, dedup=dedup, publishers={"default": publisher}
    )
    with pytest.raises(ValueError, match="not today"):
        await runner.process(incoming("m-1", delivery_count=5), max_attempts=5)
    assert entities.documents == {}
    assert not await dedup.processed("m-1")


async def test_a_failing_handler_is_parked_on_its_last_attempt() -> None:
    entities, dedup, publisher = MemoryEntityStore(), MemoryDedupStore(), MemoryPublisher()
    parked: list[tuple[str, str]] = []

    def refuse(state: object, message: object) -> tuple[object, list[object]]:
        raise ValueError("not today")

    async def park(message: object, error: str) -> None:
        parked.append((getattr(message, "id", ""), error))

    runner = EntityConsumer(
        refuse, entities=entities, dedup=dedup, publishers={"default": publisher}, park=park
    )
    with pytest.raises(ValueError, match="not today"):
        await runner.process(incoming("m-1", delivery_count=4), max_attempts=5)
    assert (
        await runner.process(incoming("m-1", delivery_count=5), max_attempts=5) is Processed.PARKED
    )
    assert parked == [("m-1", "ValueError: not today")]
    assert await runner.process(incoming("m-1", delivery_count=6)) is Processed.DUPLICATE
    assert entities.documents == {}


async def test_an_entity_that_keeps_changing_hands_the_message_back() -> None:
    class Busy(MemoryEntityStore):
        async def save(self, entity: Entity, expected_version: int) -> bool:
            return False

    ledger, publisher = Ledger(), MemoryPublisher()
    runner = EntityConsumer(
        ledger, entities=Busy(), dedup=MemoryDedupStore(), publishers={"default": publisher},
        max_conflicts=3,
    )  # fmt: skip
    with pytest.raises(EntityConflictError):
        await runner.process(incoming("m-1"))
    assert runner.conflicts == 3
    assert publisher.published == []


async def test_a_message_without_an_entity_is_parked_on_its_last_attempt() -> None:
    parked: list[str] = []

    async def park(message: object, error: str) -> None:
        parked.append(error)

    runner = EntityConsumer(
        Ledger(), entities=MemoryEntityStore(), dedup=MemoryDedupStore(),
        publishers={"default": MemoryPublisher()}, park=park,
    )  # fmt: skip
    keyless = incoming("m-1", entity="x", delivery_count=1)
    keyless = dataclasses.replace(keyless, key=None)
    with pytest.raises(InboxError, match="no key"):
        await runner.process(keyless, max_attempts=2)
    last = dataclasses.replace(keyless, delivery_count=2)
    assert await runner.process(last, max_attempts=2) is Processed.PARKED
    assert parked == ["InboxError: message m-1 has no key to name its entity by"]
