"""A cold drain by `relaybox relay` beside the raw claim-and-delete loop, pair by pair.

`relaybox bench --cross-process --cold` measures the raw loop once, after its drains;
on a shared machine whose speed drifts from one minute to the next (the raw loop alone
has drained 100k rows at 78k msg/s in one run and 126k in the next, under a minute later),
a ratio of two figures measured a minute apart says as much about the drift as about
the relay. This script measures the two side by side, a few seconds apart, round after
round, and reports each round's ratio, then their median.

A round, on two tables it creates (`bench_cold_raw_<hex>`) and drops at its end, also on
failure:

- relay: a writer process fills `--messages` rows (relaybox bench's workload: 1,000
  keys round-robin, ~100-byte JSON payloads) into the freshly migrated table, never
  vacuumed or analyzed; a fresh `relaybox relay` process (no-op broker, the CLI's
  defaults) drains it, timed to the table holding no live row (`bench_cross.drain`, as
  `relaybox bench` times it) from three starts: its spawn (the interpreter's start and
  imports included); its printing that it runs (connected, its first read sent: the
  read on the cold table included); and its first settle (the first batch's time left
  out);
- raw: `relaybox bench`'s own raw limit (`bench.raw_limit`) on the other table: the
  same rows, written by this process and VACUUM ANALYZEd (the raw loop's best case),
  drained by the raw loop (`DELETE ... WHERE seq IN (SELECT ... FOR UPDATE SKIP
  LOCKED) RETURNING ...`) on one connection, refilled, and drained on two: the faster
  is the raw limit.

Rounds alternate which goes first. The relay processes are stopped by their PIDs.
Prints one JSON document; progress goes to stderr.

    .venv/bin/python benchmarks/cold_vs_raw.py [--messages 100000] [--rounds 5] [--db URL]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine

from relaybox.migrations import migrate
from relaybox.storage.urls import DatabaseUrl
from relaybox.tools import bench, bench_cross

DEFAULT_DB = "postgresql://postgres@127.0.0.1:5432/relaybox_bench"
#: The relay's three clocks: name -> the drain's rate by it.
CLOCKS = {
    "after_first_settle": "msg_per_s_after_first_settle",
    "from_running": "msg_per_s_from_running",
    "from_spawn": "msg_per_s",
}


def options_for(db: str, messages: int, table: str) -> bench.BenchOptions:
    return bench.BenchOptions(
        db=db, broker="noop://", messages=messages, batch_size=500, max_in_flight=None,
        rate=500.0, paced_seconds=0.0, idle_seconds=0.0, keys=1000, payload_bytes=100,
        skip_raw=False, table=table, cross_process=True, cold=True,
    )  # fmt: skip


async def relay_drain(options: bench.BenchOptions, admin: bench.Admin) -> dict[str, Any]:
    await bench_cross.fill(options, admin, analyze=False)
    drained = await bench_cross.drain(options, admin, None, 1)
    return {
        "msg_per_s": drained["msg_per_s"],
        "msg_per_s_after_first_settle": drained.get("msg_per_s_after_first_settle"),
        "msg_per_s_from_running": drained.get("msg_per_s_from_running"),
        "relay_start_seconds": drained["relay_start_seconds"],
        "first_settle_seconds": drained.get("first_settle_seconds"),
        "relay_cpu_us_per_message_after_first_settle": drained.get(
            "relay_cpu_us_per_message_after_first_settle"
        ),
        "machine_busy_percent": drained["cpu"]["machine_busy_percent"],
    }


async def one_round(db: str, messages: int, relay_first: bool) -> dict[str, Any]:
    admin = await bench.connect_admin(DatabaseUrl.parse(db))
    assert isinstance(admin, bench.PostgresAdmin), "the raw loop runs on PostgreSQL"
    tables = [f"bench_cold_raw_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    result: dict[str, Any] = {"relay_first": relay_first}
    try:
        for table in tables:
            await migrate(db, table=table)
        relay_options, raw_options = (options_for(db, messages, t) for t in tables)
        for step in ("relay", "raw") if relay_first else ("raw", "relay"):
            print(f"[cold_vs_raw]   {step}", file=sys.stderr, flush=True)
            if step == "relay":
                result["relay"] = await relay_drain(relay_options, admin)
            else:
                result["raw"] = await bench.raw_limit(
                    raw_options, admin, bench.Workload(raw_options)
                )
    finally:
        for table in tables:
            await admin.drop(table)
        await admin.close()
    raw = result["raw"]["raw_limit_msg_per_s"]
    for name, key in CLOCKS.items():
        rate = result["relay"][key]
        result[f"relay_vs_raw_{name}"] = round(rate / raw, 3) if rate and raw else None
    return result


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "min": min(values),
            "max": max(values)}  # fmt: skip


async def main(args: argparse.Namespace) -> dict[str, Any]:
    compiled = bench_cross.byte_compile()
    rounds = []
    for n in range(args.rounds):
        print(f"[cold_vs_raw] round {n + 1} of {args.rounds}", file=sys.stderr, flush=True)
        rounds.append(await one_round(args.db, args.messages, relay_first=n % 2 == 0))
    summary = {
        f"relay_vs_raw_{name}": spread(
            [r[f"relay_vs_raw_{name}"] for r in rounds if r[f"relay_vs_raw_{name}"] is not None]
        )
        for name in CLOCKS
    }
    paths = {f"relay_msg_per_s_{name}": ("relay", key) for name, key in CLOCKS.items()}
    paths["raw_limit_msg_per_s"] = ("raw", "raw_limit_msg_per_s")
    for name, (side, key) in paths.items():
        summary[name] = spread([v for r in rounds if (v := r[side][key])])
    return {
        "benchmark": "cold_vs_raw",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": machine(),
        "settings": {
            **dataclasses.asdict(options_for(args.db, args.messages, "<table>")),
            "rounds": args.rounds,
            "byte_compiled": compiled,
        },
        "summary": summary,
        "rounds": rounds,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default=DEFAULT_DB, help="a PostgreSQL URL")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse())), indent=2))
