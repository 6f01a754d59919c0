"""The hold-the-key policy in a running relay, on the real databases, in both ways of
holding rows (partition leases, row leases): a message its broker refuses for good is
held with the later messages of its key behind it, and goes out first, with them
after it in order, once it is due again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from relaybox import Message
from relaybox.core.lifecycle import Status
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import Relay
from tests.databases import execute
from tests.relay_support import OutboxDB, eventually, fast_settings, outbox_db, rows

#: An operator's release, as the test makes it: the held row due now.
_DUE_NOW = {
    "postgresql": "now()",
    "mysql": "UTC_TIMESTAMP(6)",
    "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now')",
}


@pytest.fixture(params=["postgresql", "mysql", "sqlite"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(request.param, tmp_path):
        yield each


def _numbers(publisher: MemoryPublisher, key: str) -> list[int]:
    return [json.loads(m.payload)["n"] for m in publisher.published if m.key == key]


def _batch() -> list[Message]:
    """Messages 1, 2, 3 of key K, interleaved with messages 1, 2, 3 of key other."""
    return [
        Message(topic="orders", key=key, payload={"n": n})
        for n in (1, 2, 3)
        for key in ("K", "other")
    ]


def _refuse_first_of_k(publisher: MemoryPublisher) -> None:
    publisher.reject(lambda m: m.key == "K" and json.loads(m.payload)["n"] == 1, error="refused")


@pytest.mark.parametrize("partition_leases", [True, False], ids=["partitions", "row-leases"])
async def test_a_refused_message_holds_its_key_until_it_is_due_again(
    db: OutboxDB, partition_leases: bool
) -> None:
    await db.write(_batch())
    publisher = MemoryPublisher()
    _refuse_first_of_k(publisher)
    settings = fast_settings(hold_keys=True, partition_leases=partition_leases)
    async with Relay(db.database, {"default": publisher}, table=db.table, settings=settings):
        await eventually(lambda: _numbers(publisher, "other") == [1, 2, 3])
        await eventually(lambda: _held_stats(db))
        await asyncio.sleep(0.5)  # long enough for several reads: K's 2 and 3 stay
        assert _numbers(publisher, "K") == []
        (held,) = [r for r in await asyncio.to_thread(rows, db) if r.key == "K" and r.attempts]
        assert (held.status, held.attempts, held.last_error) == (Status.FAILED, 1, "refused")
        assert [m.key for m in publisher.attempts].count("K") == 1
        publisher.heal()
        release = f"UPDATE {db.table} SET available_at = {_DUE_NOW[db.name]} WHERE seq = {held.seq}"
        await asyncio.to_thread(execute, db.url, release)
        await eventually(lambda: _numbers(publisher, "K") == [1, 2, 3])
    stats = await db.storage.stats()
    assert (stats.held, stats.held_keys, stats.abandoned) == (0, 0, 0)


async def _held_stats(db: OutboxDB) -> bool:
    stats = await db.storage.stats()
    return (stats.held, stats.held_keys, stats.pending, stats.failed) == (1, 1, 2, 0)


async def test_without_the_policy_the_key_goes_on_past_the_refused_message(db: OutboxDB) -> None:
    await db.write(_batch())
    publisher = MemoryPublisher()
    _refuse_first_of_k(publisher)
    async with Relay(db.database, {"default": publisher}, table=db.table, settings=fast_settings()):
        await eventually(lambda: _numbers(publisher, "K") == [2, 3])
        await eventually(lambda: _numbers(publisher, "other") == [1, 2, 3])
    stats = await db.storage.stats()
    assert (stats.abandoned, stats.held, stats.held_keys) == (1, 0, 0)
