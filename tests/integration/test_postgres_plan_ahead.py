"""PostgreSQL: a relay's claiming and settling connections plan the read and the settle
ahead of their first real call, by running each on nothing: nothing is read, nothing is
changed, and the plan each real call then runs on is the one made then."""

from __future__ import annotations

from typing import Any

from relaybox.core.records import Routing
from relaybox.storage.postgres import PostgresStorage
from relaybox.storage.urls import DatabaseUrl
from tests.databases import PG_URL, create, drop, fetch_all, unique_table
from tests.relay_support import messages

LEASE = 30.0
PARTITIONS = 16


async def _plans(storage: PostgresStorage) -> dict[str, tuple[int, int]]:
    """The connection's prepared statements that touch the table, by their first
    line: how many generic and custom plans each has run on."""
    connection: Any = storage._connection
    rows = await connection.fetch(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements", []
    )
    return {
        row[0].strip().splitlines()[0]: (row[1], row[2]) for row in rows if storage.table in row[0]
    }


async def test_planning_ahead_reads_and_changes_nothing_and_leaves_the_plans_made() -> None:
    table = unique_table("plan")
    await create(PG_URL, table)
    url = DatabaseUrl.parse(PG_URL)
    writer = await PostgresStorage.connect(url, table=table)
    claims = await PostgresStorage.connect(url, table=table, generic_plans=True)
    settles = await PostgresStorage.connect(url, table=table, generic_plans=True)
    try:
        await writer.write(Routing.of(["default"], None).rows(messages(["a", "b"], per_key=3)))
        held = await writer.heartbeat("w1", partitions=PARTITIONS, lease_seconds=LEASE)
        assert held.partitions == set(range(PARTITIONS))
        await claims.plan_read(PARTITIONS)
        await settles.plan_settle(PARTITIONS)
        await settles.plan_settle(PARTITIONS, delete=False)
        assert fetch_all(PG_URL, f"SELECT count(*) FROM {table}") == [(6,)]
        assert fetch_all(PG_URL, f"SELECT count(*) FROM {table}_done") == [(0,)]
        read, delete, keep = "WITH picked AS (", f"DELETE FROM {table} o", "WITH finished AS ("
        assert (await _plans(claims))[read] == (1, 0)
        assert {k: v for k, v in (await _plans(settles)).items() if k in (delete, keep)} == {
            delete: (1, 0),
            keep: (1, 0),
        }

        found = await claims.read(limit=10, partition_count=PARTITIONS)
        assert sorted(m.key or "" for m in found) == ["a", "a", "a", "b", "b", "b"]
        settled = await settles.settle(
            "w1", partition_count=PARTITIONS, published=[m.seq for m in found]
        )
        assert settled.published == 6
        # The real calls ran on the plans made ahead: none was planned again.
        assert (await _plans(claims))[read] == (2, 0)
        assert (await _plans(settles))[delete] == (2, 0)
        assert fetch_all(PG_URL, f"SELECT count(*) FROM {table}") == [(0,)]
    finally:
        for storage in (writer, claims, settles):
            await storage.close()
        drop(PG_URL, table)
