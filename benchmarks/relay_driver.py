"""asyncpg vs psycopg 3 for the relay's own PostgreSQL connection.

Fills the outbox with N messages, then drains it the way the relay does (claim a batch
under a lease, delete on publish) through `PostgresStorage` on each driver, alternating
drivers over several rounds. Also times the same loop's stats query. Prints JSON.

    .venv/bin/python benchmarks/relay_driver.py [--messages 50000] [--batch 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_URL, machine

from relaybox import Message
from relaybox.core.records import Routing
from relaybox.migrations import migrate
from relaybox.storage.postgres import PostgresStorage

TABLE = "bench_relay_driver"
DRIVERS = {"asyncpg": PG_URL, "psycopg": PG_URL.replace("postgresql://", "postgresql+psycopg://")}


async def fill(n: int) -> None:
    routing = Routing.of(None, None)
    storage = await PostgresStorage.connect(PG_URL, table=TABLE)
    try:
        for start in range(0, n, 5000):
            batch = [Message(topic="orders", key=f"k{i % 1000}", payload={"i": i, "pad": "x" * 100})
                     for i in range(start, min(n, start + 5000))]  # fmt: skip
            await storage.write(routing.rows(batch))
    finally:
        await storage.close()
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {TABLE}")


async def drain(url: str, batch: int) -> tuple[int, float]:
    storage = await PostgresStorage.connect(url, table=TABLE)
    drained = 0
    start = time.perf_counter()
    try:
        while True:
            claim = await storage.claim("bench", limit=batch, lease_seconds=60)
            if not claim.messages:
                break
            await storage.mark_published(claim.token, [m.seq for m in claim.messages], delete=True)
            drained += len(claim.messages)
    finally:
        await storage.close()
    return drained, time.perf_counter() - start


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    await migrate(PG_URL, table=TABLE)
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {TABLE}")
    runs: dict[str, list[float]] = {name: [] for name in DRIVERS}
    for _ in range(args.rounds):
        for name, url in DRIVERS.items():
            await fill(args.messages)
            drained, seconds = await drain(url, args.batch)
            assert drained == args.messages, (name, drained)
            runs[name].append(round(drained / seconds))
    best = {name: max(values) for name, values in runs.items()}
    print(json.dumps({
        "benchmark": "relay_driver", "messages": args.messages, "batch": args.batch,
        "drain_msg_per_s_runs": runs, "drain_msg_per_s_best": best,
        "machine": machine(),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
