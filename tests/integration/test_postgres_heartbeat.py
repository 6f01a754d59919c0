"""PostgreSQL: an idle relay's partition heartbeat is one statement, and so is a
fresh relay's first.

A relay renews its partitions every few seconds for as long as it runs, busy or not, so
what a heartbeat sends the database is most of what an idle relay costs it; a fresh
relay's first heartbeat stands between it and its first batch. Every
statement counts, BEGIN and COMMIT included: the storage's connection is wrapped so
that each call it makes of the driver is recorded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from relaybox.storage.postgres import PostgresStorage
from relaybox.storage.sql import Connection
from relaybox.storage.urls import DatabaseUrl
from tests.databases import PG_URL, create, drop, unique_table

LEASE = 30.0
PARTITIONS = 64


class _Counted:
    """A driver connection that records every statement it is asked to run."""

    def __init__(self, connection: Connection, sent: list[str]) -> None:
        self._connection = connection
        self._sent = sent

    async def fetch(self, query: str, args: Sequence[Any]) -> list[Sequence[Any]]:
        self._sent.append(query)
        return await self._connection.fetch(query, args)

    async def execute(self, query: str, args: Sequence[Any]) -> int:
        self._sent.append(query)
        return await self._connection.execute(query, args)

    async def begin(self) -> None:
        self._sent.append("BEGIN")
        await self._connection.begin()

    async def commit(self) -> None:
        self._sent.append("COMMIT")
        await self._connection.commit()

    async def rollback(self) -> None:
        self._sent.append("ROLLBACK")
        await self._connection.rollback()

    async def close(self) -> None:
        await self._connection.close()

    async def discard(self) -> None:
        await self._connection.discard()


class _CountedStorage(PostgresStorage):
    def __init__(self, url: DatabaseUrl, *, table: str) -> None:
        super().__init__(url, table=table)
        #: Every statement sent, in order.
        self.sent: list[str] = []

    async def _open(self) -> Connection:
        return _Counted(await super()._open(), self.sent)

    def names(self) -> list[str]:
        """The statements sent so far, by query name (BEGIN and the like as they are);
        and forget them."""
        names = [self._query_names.get(query, query) for query in self.sent]
        self.sent.clear()
        return names


@pytest.fixture(params=["postgresql", "postgresql+psycopg"])
async def tables(request: pytest.FixtureRequest) -> AsyncIterator[tuple[DatabaseUrl, str]]:
    base = PG_URL.replace("postgresql://", f"{request.param}://")
    table = unique_table("beat")
    try:
        await create(base, table)
        yield DatabaseUrl.parse(base), table
    finally:
        drop(base, table)


async def test_an_idle_relays_heartbeat_is_one_statement(tables: tuple[DatabaseUrl, str]) -> None:
    url, table = tables
    storage = await _CountedStorage.connect(url, table=table)
    try:
        first = await storage.heartbeat("w1", partitions=PARTITIONS, lease_seconds=LEASE)
        assert first.partitions == set(range(PARTITIONS))
        storage.names()
        for _ in range(3):  # the steady state: nothing changes hands
            again = await storage.heartbeat("w1", partitions=PARTITIONS, lease_seconds=LEASE)
            assert again == first
            assert storage.names() == ["heartbeat"]
    finally:
        await storage.close()


async def test_a_heartbeat_takes_its_share_itself_and_gives_back_in_a_second_step(
    tables: tuple[DatabaseUrl, str],
) -> None:
    url, table = tables
    first = await _CountedStorage.connect(url, table=table)
    second = await _CountedStorage.connect(url, table=table)
    first.names(), second.names()  # the probes of connecting
    try:
        fresh = await first.heartbeat("w1", partitions=PARTITIONS, lease_seconds=LEASE)
        assert fresh.partitions == set(range(PARTITIONS))  # its share, at once
        assert first.names() == ["heartbeat"]
        joined = await second.heartbeat("w2", partitions=PARTITIONS, lease_seconds=LEASE)
        assert joined.partitions == set()  # all held: it takes nothing yet
        assert second.names() == ["heartbeat"]
        kept = await first.heartbeat("w1", partitions=PARTITIONS, lease_seconds=LEASE)
        assert kept.partitions == set(range(PARTITIONS // 2))
        assert first.names() == ["heartbeat", "partitions_release"]
        taken = await second.heartbeat("w2", partitions=PARTITIONS, lease_seconds=LEASE)
        assert taken.partitions == set(range(PARTITIONS // 2, PARTITIONS))
        assert second.names() == ["heartbeat"]
        for storage, name in ((first, "w1"), (second, "w2")):
            await storage.heartbeat(name, partitions=PARTITIONS, lease_seconds=LEASE)
            assert storage.names() == ["heartbeat"]
        # Fewer partitions: the ones past the count go back while the share grows.
        fewer = await first.heartbeat("w1", partitions=16, lease_seconds=LEASE)
        assert fewer.partitions == set(range(8))
        assert first.names() == ["heartbeat", "partitions_release"]
        # A relay that holds partitions past the count takes its share below it (the
        # function counts only those below) and gives the rest back.
        grown = await second.heartbeat("w2", partitions=16, lease_seconds=LEASE)
        assert grown.partitions == set(range(8, 16))
        assert second.names() == ["heartbeat", "partitions_release"]
    finally:
        await first.close()
        await second.close()


async def test_a_fresh_relays_statements_ask_asyncpg_for_no_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """asyncpg learns an array type it does not know (an array of integers) by asking
    the server, about 4 ms of server time on each new connection: a fresh relay did
    so before its first heartbeat and again before its first read. Its statements
    take and return such arrays as text, so no connection asks."""
    import asyncpg

    asked: list[object] = []
    introspect = asyncpg.Connection._introspect_types

    async def recorded(self: Any, typeoids: Any, timeout: Any) -> Any:
        asked.append(typeoids)
        return await introspect(self, typeoids, timeout)

    monkeypatch.setattr(asyncpg.Connection, "_introspect_types", recorded)
    table = unique_table("beat")
    await create(PG_URL, table)
    storage = await PostgresStorage.connect(DatabaseUrl.parse(PG_URL), table=table)
    try:
        held = await storage.heartbeat("w1", partitions=PARTITIONS, lease_seconds=LEASE)
        assert held.partitions == set(range(PARTITIONS))
        mine = sorted(held.partitions)[:4]
        assert await storage.read(limit=10, partitions=mine, partition_count=PARTITIONS) == []
        claim = await storage.claim("w1", limit=10, lease_seconds=LEASE, partitions=mine)
        assert claim.messages == []
        assert asked == []
    finally:
        await storage.close()
        drop(PG_URL, table)
