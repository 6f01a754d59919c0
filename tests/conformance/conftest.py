"""One storage conformance suite, run against every backend: each test takes `backend`."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from relaybox.storage import open_storage
from relaybox.storage.memory import MemoryStorage
from relaybox.storage.sql import SqlStorage
from tests.databases import MYSQL_URL, PG_URL, create, drop, sqlite_url, unique_table

BACKENDS = ["postgresql", "postgresql+psycopg", "mysql", "sqlite", "memory"]

#: What open_storage returns: every storage port at once.
AnyStorage = SqlStorage | MemoryStorage


@dataclasses.dataclass
class Backend:
    name: str
    storage: AnyStorage
    another: Callable[[], Awaitable[AnyStorage]]


def _url(name: str, tmp_path: Path) -> str:
    if name == "postgresql":
        return PG_URL
    if name == "postgresql+psycopg":
        return PG_URL.replace("postgresql://", "postgresql+psycopg://")
    if name == "mysql":
        return MYSQL_URL
    if name == "sqlite":
        return sqlite_url(tmp_path / "outbox.db")
    return "memory://"


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    name: str = request.param
    url = _url(name, tmp_path)
    table = unique_table("conf")
    try:
        await create(url, table)
        storage = await open_storage(url, table=table)
    except BaseException:
        drop(url, table)  # a failed migration may have left its tracking table
        raise
    opened = [storage]

    async def another() -> AnyStorage:
        if name == "memory":  # one process, one store: share it
            return storage
        extra = await open_storage(url, table=table)
        opened.append(extra)
        return extra

    try:
        yield Backend(name, storage, another)
    finally:
        for each in opened:
            await each.close()
        drop(url, table)
