"""Shared helpers for relay tests: an outbox on each backend, fast settings, waiting."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

from relaybox import Message
from relaybox.core.circuit import CircuitPolicy
from relaybox.core.lifecycle import Status
from relaybox.core.records import Routing
from relaybox.core.retry import RetryPolicy
from relaybox.relay import RelaySettings
from relaybox.storage import open_storage
from relaybox.storage.memory import MemoryStorage
from relaybox.storage.sql import SqlStorage
from tests.databases import (
    MYSQL_URL,
    PG_URL,
    create,
    drop,
    fetch_all,
    sqlite_url,
    unique_table,
)

#: What open_storage returns: every storage port at once.
AnyStorage = SqlStorage | MemoryStorage

RELAY_BACKENDS = ["postgresql", "mysql", "sqlite", "memory"]


def backend_url(name: str, tmp_path: Path) -> str:
    return {
        "postgresql": PG_URL,
        "mysql": MYSQL_URL,
        "sqlite": sqlite_url(tmp_path / "outbox.db"),
        "memory": "memory://",
    }[name]


@dataclasses.dataclass
class OutboxDB:
    """An outbox table on one backend; `database` is what a Relay is given."""

    name: str
    url: str
    table: str
    storage: AnyStorage  # for writing and inspecting
    routing: Routing

    @property
    def database(self) -> str | AnyStorage:
        return self.storage if self.name == "memory" else self.url

    async def write(self, messages: Iterable[Message]) -> None:
        await self.storage.write(self.routing.rows(list(messages)))

    async def status_counts(self) -> dict[Status, int]:
        return dict((await self.storage.stats()).counts)


async def outbox_db(
    name: str, tmp_path: Path, targets: Iterable[str] = ("default",)
) -> AsyncIterator[OutboxDB]:
    url = backend_url(name, tmp_path)
    table = unique_table("relay")
    if name == "memory":
        storage: AnyStorage = MemoryStorage(table=table)
    else:
        try:
            await create(url, table)
            storage = await open_storage(url, table=table)
        except BaseException:
            drop(url, table)
            raise
    try:
        yield OutboxDB(name, url, table, storage, Routing.of(list(targets), None))
    finally:
        await storage.close()
        if name != "memory":
            drop(url, table)


def fast_settings(**overrides: Any) -> RelaySettings:
    values: dict[str, Any] = {
        "batch_size": 50,
        "lease_seconds": 3.0,
        "publish_timeout": 2.0,
        "min_poll_interval": 0.005,
        "idle_interval": 0.05,
        "partitions": 8,
        "retry": RetryPolicy(base_delay=0.05, max_delay=0.2, jitter=0.0, max_attempts=5),
        "circuit": CircuitPolicy(failure_threshold=3, open_seconds=0.3, max_open_seconds=0.6),
        "cleanup_interval": 0.1,
        "shutdown_timeout": 2.0,
    }
    values.update(overrides)
    return RelaySettings(**values)


async def eventually(
    check: Callable[[], Any], timeout: float = 15.0, interval: float = 0.02
) -> None:
    """Wait until `check()` (sync or async) is truthy; fail with its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition still false after {timeout}s: {value!r}")
        await asyncio.sleep(interval)


def messages(keys: Iterable[str | None], per_key: int, **fields: Any) -> list[Message]:
    """per_key messages for each key, interleaved, payload {'key':..., 'n': i}."""
    result = []
    for n in range(per_key):
        for key in keys:
            result.append(Message(topic="orders", key=key, payload={"key": key, "n": n}, **fields))
    return result


@dataclasses.dataclass(frozen=True)
class Row:
    seq: int
    key: str | None
    status: Status
    attempts: int
    last_error: str | None


_ROWS_SQL = "SELECT seq, {key}, status, attempts, last_error FROM {table} ORDER BY seq"
#: PostgreSQL keeps finished rows in a table of their own ({table}_done).
_PG_ROWS_SQL = (
    "SELECT seq, key, status, attempts, last_error FROM {table}"
    " UNION ALL SELECT seq, key, status, attempts, last_error FROM {table}_done ORDER BY seq"
)


def rows(db: OutboxDB) -> list[Row]:
    """Every row of the outbox table, read straight from the database."""
    if db.name == "memory":
        stored = db.storage._rows.values()  # type: ignore[attr-defined]
        return [Row(r.seq, r.key, r.status, r.attempts, r.last_error) for r in stored]
    key = "`key`" if db.name == "mysql" else "key"
    query = _PG_ROWS_SQL if db.url.startswith("postgresql") else _ROWS_SQL
    found = fetch_all(db.url, query.format(key=key, table=db.table))
    return [Row(seq, key, Status(status), tries, error) for seq, key, status, tries, error in found]
