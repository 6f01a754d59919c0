"""Model-based: a thousand histories (thousands under `make fuzz`) of two or three
copies of each of one or two messages, interleaved step by step at every call
`EntityConsumer` makes to a store or a publisher, with crashes anywhere (a crash's copy
is delivered again). At the end of each history, every copy delivered until it is
acknowledged, it checks:

- effects once: the entity applied each message exactly once;
- messages at least once, ids stable: each message's outgoing messages were saved under
  one set of ids only, every one of them was published, and nothing else was.

On the in-memory stores with many histories, and on Redis with a few.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from relaybox.core.entities import Entity
from relaybox.inbox.consumer import Processed
from relaybox.inbox.entities import EntityConsumer
from relaybox.ports import DedupStore, EntityStore
from relaybox.publishers.memory import MemoryPublisher
from relaybox.storage.entities.memory import MemoryDedupStore, MemoryEntityStore
from relaybox.storage.entities.redis import RedisDedupStore, RedisEntityStore
from tests.entities.support import (
    REDIS_URL,
    Crash,
    HookedDedup,
    HookedEntities,
    HookedPublisher,
    Ledger,
    _delete_prefix,
    incoming,
)

#: Steps a copy may take at the end of a history to be acknowledged.
MAX_DRAIN_STEPS = 200


class Recording:
    """An entity store that keeps, per message, every set of outgoing ids saved for it."""

    def __init__(self, inner: EntityStore) -> None:
        self.inner = inner
        self.saved: dict[str, set[tuple[uuid.UUID, ...]]] = {}

    async def load(self, entity_id: str) -> Entity | None:
        return await self.inner.load(entity_id)

    async def save(self, entity: Entity, expected_version: int) -> bool:
        saved = await self.inner.save(entity, expected_version)
        if saved:
            for message_id, outgoing in entity.outbox.items():
                self.saved.setdefault(message_id, set()).add(tuple(o.id for o in outgoing))
        return saved

    async def close(self) -> None:
        await self.inner.close()


class Pauser:
    """Stops its copy at each point until `release`d; crashes it there if asked."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.go = asyncio.Event()
        self.crash = False

    async def __call__(self, point: str) -> None:
        self.arrived.set()
        await self.go.wait()
        self.go.clear()
        if self.crash:
            raise Crash(point)

    def release(self, *, crash: bool) -> None:
        self.arrived.clear()
        self.crash = crash
        self.go.set()


@dataclasses.dataclass
class Copy:
    """One copy of a message, as the broker holds it: delivered (a task running),
    returned (processed, not acknowledged yet), or acknowledged."""

    message_id: str
    amount: int
    deliveries: int = 0
    task: asyncio.Task[Processed] | None = None
    pauser: Pauser | None = None
    returned: bool = False
    acked: bool = False


class Histories(RuleBasedStateMachine):
    """Copies of messages to one entity, advanced or crashed one step at a time."""

    #: Opens (entity store, dedup store) in the running loop, and removes them after.
    open_stores: Callable[
        [], Awaitable[tuple[EntityStore, DedupStore, Callable[[], Awaitable[None]]]]
    ]

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        entities, self.dedup, self.remove = self.loop.run_until_complete(type(self).open_stores())
        self.entities = Recording(entities)
        self.publisher = MemoryPublisher()
        self.ledger = Ledger()
        self.copies: list[Copy] = []

    @initialize(messages=st.integers(1, 2), copies=st.integers(2, 3))
    def deliver(self, messages: int, copies: int) -> None:
        self.copies = [Copy(f"m-{m}", amount=10**m) for m in range(messages) for _ in range(copies)]

    @rule(which=st.integers(0, 5))
    def step(self, which: int) -> None:
        self.loop.run_until_complete(
            self._advance(self.copies[which % len(self.copies)], crash=False)
        )

    @rule(which=st.integers(0, 5))
    def crash(self, which: int) -> None:
        self.loop.run_until_complete(
            self._advance(self.copies[which % len(self.copies)], crash=True)
        )

    async def _advance(self, copy: Copy, *, crash: bool) -> None:
        """Take one step of `copy`: deliver it, let it run to its next call, crash it
        there, or acknowledge (or, crashing, redeliver) what it returned."""
        if copy.acked:
            return
        if copy.returned:
            copy.returned, copy.acked = crash, not crash  # a crash before the ack: again
            return
        if copy.task is None:
            copy.deliveries += 1
            copy.pauser = Pauser()
            copy.task = asyncio.create_task(self._consumer(copy.pauser).process(
                incoming(copy.message_id, amount=copy.amount, delivery_count=copy.deliveries)
            ))  # fmt: skip
        else:
            assert copy.pauser is not None
            copy.pauser.release(crash=crash)
        arrived = asyncio.ensure_future(copy.pauser.arrived.wait())
        await asyncio.wait({arrived, copy.task}, return_when=asyncio.FIRST_COMPLETED)
        arrived.cancel()
        if copy.task.done():
            error = copy.task.exception()
            if error is not None and not isinstance(error, Crash):
                raise error
            copy.returned = error is None
            copy.task = None

    def _consumer(self, pauser: Pauser) -> EntityConsumer:
        return EntityConsumer(
            self.ledger,
            entities=HookedEntities(self.entities, pauser),
            dedup=HookedDedup(self.dedup, pauser),
            publishers={"default": HookedPublisher(self.publisher, pauser)},
            max_conflicts=50,
        )

    @invariant()
    def published_ids_were_saved(self) -> None:
        saved = {i for ids in self.entities.saved.values() for group in ids for i in group}
        assert {m.id for m in self.publisher.published} <= saved
        for message_id, groups in self.entities.saved.items():
            assert len(groups) == 1, f"{message_id} saved under two sets of ids"

    def teardown(self) -> None:
        try:
            if self.copies:
                self.loop.run_until_complete(self._drain())
                self.loop.run_until_complete(self._check())
        finally:
            self.loop.run_until_complete(self.remove())
            self.loop.close()

    async def _drain(self) -> None:
        """Deliver every copy until it is acknowledged, one after the other."""
        for copy in self.copies:
            for _ in range(MAX_DRAIN_STEPS):
                if copy.acked:
                    break
                await self._advance(copy, crash=False)
            assert copy.acked, f"{copy} was never acknowledged"

    async def _check(self) -> None:
        entity = await self.entities.load("order-1")
        assert entity is not None
        wanted = sorted({copy.message_id for copy in self.copies})
        assert sorted(entity.state["applied"]) == wanted  # each once
        assert entity.state["total"] == sum(10 ** int(m[2:]) for m in wanted)
        assert entity.outbox == {}
        published = {m.id for m in self.publisher.published}
        for message_id in wanted:
            assert await self.dedup.processed(message_id)
            (ids,) = self.entities.saved[message_id]
            assert set(ids) <= published  # every one at least once, under its saved id


async def _memory() -> tuple[EntityStore, DedupStore, Callable[[], Awaitable[None]]]:
    async def nothing() -> None:
        return None

    return MemoryEntityStore(), MemoryDedupStore(), nothing


async def _redis() -> tuple[EntityStore, DedupStore, Callable[[], Awaitable[None]]]:
    prefix = f"rbx-test-{uuid.uuid4().hex[:12]}:"
    entities = RedisEntityStore(REDIS_URL, prefix=prefix)
    dedup = RedisDedupStore(REDIS_URL, prefix=prefix)

    async def remove() -> None:
        await entities.close()
        await dedup.close()
        await _delete_prefix(prefix)

    return entities, dedup, remove


class MemoryHistories(Histories):
    open_stores = staticmethod(_memory)


class RedisHistories(Histories):
    open_stores = staticmethod(_redis)


TestMemoryHistories = MemoryHistories.TestCase
#: Two thousand histories in a test run (about fifteen seconds on two cores), more
#: under `make fuzz`.
TestMemoryHistories.settings = settings(
    max_examples=max(2000, settings.default.max_examples), stateful_step_count=25
)
TestRedisHistories = RedisHistories.TestCase
TestRedisHistories.settings = settings(max_examples=15, stateful_step_count=25)
