"""The claim at a 1M-row backlog: is it still an index scan, and how long does it take?

Fills the outbox with N pending rows straight from SQL (generate_series, 1,000 keys),
ANALYZEs, prints the claim's plan (EXPLAIN ANALYZE) and times claims of a batch through
`PostgresStorage`, then does the same on a 1,000-row table for comparison. Prints JSON.

    .venv/bin/python benchmarks/claim_backlog.py [--rows 1000000] [--batch 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_URL, machine

from relaybox import sql
from relaybox.migrations import migrate
from relaybox.storage.postgres import PostgresStorage

TABLE = "bench_claim_backlog"
FILL = """
INSERT INTO {table} (id, target, topic, key, partition, type, content_type, payload,
                     headers, occurred_at)
SELECT gen_random_uuid(), 'default', 'orders', 'k' || (i %% 1000), (i %% 1000) %% 64,
       'OrderPlaced', 'application/json', convert_to(repeat('x', 200), 'UTF8'), '{{}}',
       now()
FROM generate_series(1, %s) AS i
"""


def fill(rows: int) -> None:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {TABLE}")
        conn.execute(FILL.format(table=TABLE), (rows,))
        conn.execute(f"VACUUM ANALYZE {TABLE}")


async def plan(batch: int) -> list[str]:
    import asyncpg

    conn = await asyncpg.connect(PG_URL)
    try:
        tx = conn.transaction()
        await tx.start()
        rows = await conn.fetch(
            "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) "
            + sql.queries("postgresql", TABLE)["claim"],
            "explain", batch, None, None, uuid.uuid4(), 60.0,
        )  # fmt: skip
        await tx.rollback()  # leave the rows pending
    finally:
        await conn.close()
    return [row[0] for row in rows]


async def time_claims(batch: int, claims: int) -> list[float]:
    storage = await PostgresStorage.connect(PG_URL, table=TABLE)
    timings = []
    try:
        for _ in range(claims):
            start = time.perf_counter()
            claim = await storage.claim("bench", limit=batch, lease_seconds=60)
            timings.append((time.perf_counter() - start) * 1000)
            await storage.mark_published(claim.token, [m.seq for m in claim.messages], delete=True)
    finally:
        await storage.close()
    return timings


def measure(rows: int, batch: int) -> dict[str, object]:
    fill(rows)
    lines = asyncio.run(plan(batch))
    timings = asyncio.run(time_claims(batch, 20))
    return {
        "rows": rows,
        "claim_ms_median": round(statistics.median(timings), 2),
        "claim_ms_max": round(max(timings), 2),
        # Live rows in seq order: the primary key since migration 0007 (live_ix before).
        "index_scan_on_primary_key": any(f"{TABLE}_pkey" in line for line in lines),
        "seq_scan": any("Seq Scan" in line for line in lines),
        "plan": lines,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()
    asyncio.run(migrate(PG_URL, table=TABLE))
    small = measure(1_000 + 20 * args.batch, args.batch)
    large = measure(args.rows, args.batch)
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {TABLE}")
    result = {"benchmark": "claim_backlog", "batch": args.batch, "small": small, "large": large,
              "machine": machine()}  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
