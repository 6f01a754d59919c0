"""Every entity store and dedup store, the in-memory ones included, against one suite:
what `EntityConsumer` relies on."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from pathlib import Path

import pytest

from relaybox.core.entities import Entity, Outgoing
from relaybox.core.message import Message, Target
from relaybox.errors import ConfigurationError, InboxError, StorageOperationalError
from relaybox.storage.entities.memory import MemoryDedupStore
from relaybox.storage.entities.redis import RedisEntityStore
from relaybox.storage.entities.sql import SqlDedupStore, SqlEntityStore
from tests.entities.support import BACKENDS, stores

#: Each SQL client relaybox speaks, too: PostgreSQL through psycopg, MariaDB through asyncmy.
per_backend = pytest.mark.parametrize("backend", [*BACKENDS, "postgresql+psycopg", "mysql+asyncmy"])


def _outgoing() -> tuple[Outgoing, ...]:
    message = Message(
        topic="orders.billed", key="order-1", payload=b"\x00\xffbytes", headers={"h": "v"},
        correlation_id="c-1", targets=["default", Target("partner", external=True)],
    )  # fmt: skip
    return (Outgoing.of(message), Outgoing.of(Message(topic="orders.noted", payload={"n": 1})))


@per_backend
async def test_a_saved_entity_loads_as_it_was_saved(backend: str, tmp_path: Path) -> None:
    async with stores(backend, tmp_path) as s:
        assert await s.entities.load("order-1") is None
        entity = Entity("order-1", {"total": 3, "name": "Zoë \u2603"}, 1, {"m-1": _outgoing()})
        assert await s.entities.save(entity, 0)
        loaded = await s.entities.load("order-1")
        assert loaded == entity
        assert loaded is not None
        assert loaded.outbox["m-1"][0].payload == b"\x00\xffbytes"
        assert await s.entities.load("ORDER-1") is None  # ids compare byte for byte


@per_backend
async def test_a_save_checks_the_version(backend: str, tmp_path: Path) -> None:
    async with stores(backend, tmp_path) as s:
        first = Entity("order-1", {"n": 1}, 1)
        assert await s.entities.save(first, 0)
        assert not await s.entities.save(Entity("order-1", {"n": 9}, 1), 0)  # not new any more
        assert await s.entities.save(Entity("order-1", {"n": 2}, 2), 1)
        assert not await s.entities.save(Entity("order-1", {"n": 9}, 2), 1)  # moved on
        assert not await s.entities.save(Entity("order-2", {"n": 9}, 4), 3)  # never saved
        loaded = await s.entities.load("order-1")
        assert loaded is not None
        assert (loaded.state, loaded.version) == ({"n": 2}, 2)
        assert await s.entities.load("order-2") is None


@per_backend
async def test_of_two_concurrent_saves_of_one_version_one_wins(
    backend: str, tmp_path: Path
) -> None:
    async with stores(backend, tmp_path) as s:
        other, _ = s.another()
        for version in (0, 1):
            saves = await asyncio.gather(
                s.entities.save(Entity("order-1", "a", version + 1), version),
                other.save(Entity("order-1", "b", version + 1), version),
            )
            assert sorted(saves) == [False, True]


@per_backend
async def test_the_dedup_store_remembers_ids(backend: str, tmp_path: Path) -> None:
    async with stores(backend, tmp_path) as s:
        _, dedup = s.another()
        assert not await s.dedup.processed("m-1")
        await s.dedup.add("m-1")
        await s.dedup.add("m-1")  # again: harmless
        assert await s.dedup.processed("m-1")
        assert await dedup.processed("m-1")  # another process sees it at once
        assert not await dedup.processed("m-2")


@per_backend
async def test_ids_out_of_range_are_refused(backend: str, tmp_path: Path) -> None:
    async with stores(backend, tmp_path) as s:
        for bad in ("", "x" * 256):
            with pytest.raises(InboxError):
                await s.entities.load(bad)
            with pytest.raises(InboxError):
                await s.dedup.processed(bad)


@per_backend
async def test_dedup_entries_expire_after_the_retention(backend: str, tmp_path: Path) -> None:
    async with stores(backend, tmp_path, retention=0.2) as s:
        await s.dedup.add("m-1")
        assert await s.dedup.processed("m-1")
        if isinstance(s.dedup, MemoryDedupStore):
            s.dedup.clock = lambda: float("inf")
        else:
            await asyncio.sleep(0.3)
        if isinstance(s.dedup, SqlDedupStore):  # kept until purged
            assert await s.dedup.processed("m-1")
            assert await s.dedup.purge() == 1
        assert not await s.dedup.processed("m-1")


def test_a_retention_must_be_a_time_above_zero() -> None:
    for bad in (0, -1.0, float("nan"), datetime.timedelta(0)):
        with pytest.raises(ConfigurationError):
            MemoryDedupStore(retention=bad)


async def test_an_unreachable_store_fails_without_saying_its_password() -> None:
    for store in (RedisEntityStore("redis://:s3cret@127.0.0.1:1/0"),
                  SqlEntityStore("postgresql://u:s3cret@127.0.0.1:1/test")):  # fmt: skip
        with pytest.raises(StorageOperationalError) as raised:
            await store.load(str(uuid.uuid4()))
        assert "s3cret" not in str(raised.value)
        await store.close()
