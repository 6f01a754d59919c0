"""Entity and dedup stores on every backend, cleaned up after; and wrappers that stop
or crash an `EntityConsumer` between its steps."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from relaybox.core.entities import Entity
from relaybox.core.incoming import Incoming
from relaybox.core.message import Message
from relaybox.core.publishing import PublishResult
from relaybox.core.records import StoredMessage
from relaybox.ports import DedupStore, EntityStore, Publisher
from relaybox.storage.entities.memory import MemoryDedupStore, MemoryEntityStore
from relaybox.storage.entities.redis import RedisDedupStore, RedisEntityStore
from relaybox.storage.entities.sql import SqlDedupStore, SqlEntityStore, create_tables
from tests.databases import MYSQL_URL, PG_URL, execute, sqlite_url, unique_table

REDIS_URL = "redis://127.0.0.1:6379/0"
BACKENDS = ["memory", "redis", "postgresql", "mysql", "sqlite"]


@dataclasses.dataclass
class Stores:
    """One backend's entity store and dedup store, and how to open another pair on the
    same data (a second process)."""

    name: str
    entities: EntityStore
    dedup: DedupStore
    another: Callable[[], tuple[EntityStore, DedupStore]]


@contextlib.asynccontextmanager
async def stores(name: str, tmp_path: Path, *, retention: float = 3600.0) -> AsyncIterator[Stores]:
    """The stores of backend `name`, on a unique prefix or table, removed afterwards."""
    opened: list[EntityStore | DedupStore] = []

    def pair(make: Callable[[], tuple[EntityStore, DedupStore]]) -> tuple[EntityStore, DedupStore]:
        made = make()
        opened.extend(made)
        return made

    if name == "memory":
        shared = (MemoryEntityStore(), MemoryDedupStore(retention=retention))
        entities, dedup = shared
        yield Stores(name, entities, dedup, lambda: shared)
        return
    if name == "redis":
        prefix = f"rbx-test-{uuid.uuid4().hex[:12]}:"

        def make() -> tuple[EntityStore, DedupStore]:
            return (RedisEntityStore(REDIS_URL, prefix=prefix),
                    RedisDedupStore(REDIS_URL, prefix=prefix, retention=retention))  # fmt: skip

        try:
            entities, dedup = pair(make)
            yield Stores(name, entities, dedup, lambda: pair(make))
        finally:
            for store in opened:
                await store.close()
            await _delete_prefix(prefix)
        return
    url = {
        "postgresql": PG_URL,
        "postgresql+psycopg": PG_URL.replace("postgresql://", "postgresql+psycopg://"),
        "mysql": MYSQL_URL,
        "mysql+asyncmy": MYSQL_URL.replace("mysql://", "mysql+asyncmy://"),
        "sqlite": sqlite_url(tmp_path / "e.db"),
    }[name]
    table = unique_table("ent")
    if name == "sqlite":
        (tmp_path / "e.db").touch()
    await create_tables(url, table)

    def make_sql() -> tuple[EntityStore, DedupStore]:
        return (SqlEntityStore(url, table=table),
                SqlDedupStore(url, table=table, retention=retention))  # fmt: skip

    try:
        entities, dedup = pair(make_sql)
        yield Stores(name, entities, dedup, lambda: pair(make_sql))
    finally:
        if name != "sqlite":
            execute(url.replace("+psycopg", "").replace("+asyncmy", ""),
                    f"DROP TABLE IF EXISTS {table}, {table}_dedup")  # fmt: skip


async def _delete_prefix(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


class Crash(Exception):
    """The process died here."""


#: Called at each point an `EntityConsumer` reaches through the wrapped ports.
Hook = Callable[[str], Awaitable[None]]


async def _nothing(_: str) -> None:
    return None


class HookedEntities:
    """An entity store that calls `hook("load")`/`hook("save")` before each call, and
    `hook("loaded")`/`hook("saved")`/`hook("refused")` after."""

    def __init__(self, inner: EntityStore, hook: Hook = _nothing) -> None:
        self.inner, self.hook = inner, hook

    async def load(self, entity_id: str) -> Entity | None:
        await self.hook("load")
        entity = await self.inner.load(entity_id)
        await self.hook("loaded")
        return entity

    async def save(self, entity: Entity, expected_version: int) -> bool:
        await self.hook("save")
        saved = await self.inner.save(entity, expected_version)
        await self.hook("saved" if saved else "refused")
        return saved

    async def close(self) -> None:
        await self.inner.close()


class HookedDedup:
    """A dedup store that calls `hook("check")` before `processed` and `hook("add")`,
    `hook("added")` around `add`."""

    def __init__(self, inner: DedupStore, hook: Hook = _nothing) -> None:
        self.inner, self.hook = inner, hook
        self.retention = inner.retention

    async def processed(self, message_id: str) -> bool:
        await self.hook("check")
        return await self.inner.processed(message_id)

    async def add(self, message_id: str) -> None:
        await self.hook("add")
        await self.inner.add(message_id)
        await self.hook("added")

    async def close(self) -> None:
        await self.inner.close()


class HookedPublisher:
    """A publisher that calls `hook("send")` and `hook("sent")` around each publish."""

    def __init__(self, inner: Publisher, hook: Hook = _nothing) -> None:
        self.inner, self.hook = inner, hook
        self.features = inner.features

    async def start(self) -> None:
        await self.inner.start()

    async def publish(self, messages: Sequence[StoredMessage]) -> Sequence[PublishResult]:
        await self.hook("send")
        results = await self.inner.publish(messages)
        await self.hook("sent")
        return results

    async def close(self) -> None:
        await self.inner.close()


def incoming(message_id: str, entity: str = "order-1", amount: int = 1, **fields: Any) -> Incoming:
    """A delivery of message `message_id` to entity `entity`, adding `amount`."""
    payload = f'{{"amount": {amount}}}'.encode()
    return Incoming(id=message_id, payload=payload, type="Added", key=entity, **fields)


class Ledger:
    """A handler that adds each message's amount to the entity's total, lists the
    messages it applied, and produces two messages; it keeps every id it produced."""

    def __init__(self) -> None:
        self.runs = 0
        self.produced: dict[str, list[list[uuid.UUID]]] = {}

    async def __call__(self, state: Any, message: Incoming) -> tuple[Any, list[Message]]:
        self.runs += 1
        state = state or {"total": 0, "applied": []}
        amount = message.json()["amount"]
        state = {"total": state["total"] + amount, "applied": [*state["applied"], message.id]}
        out = [
            message.follow_up(topic="ledger.added", key=message.key, payload={"amount": amount}),
            message.follow_up(topic="ledger.total", key=message.key, payload=state["total"]),
        ]
        self.produced.setdefault(message.id, []).append([m.id for m in out])
        return state, out
