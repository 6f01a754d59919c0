"""relaybox beside another outbox relay, on the same backlogs, in one run.

The same measurement for each: a backlog of `--messages` rows (keys round-robin over
`--keys`, ~`--payload-bytes` JSON payloads) is written by a writer process, then a relay
process of its own is started on it and timed from its spawn to the Redis stream it
publishes to holding every message (each XADD's reply is the relay's confirm); then it
is stopped by its PID. Three starts, in this order, each with a fresh relay process:

    cold_fresh_table      the table just created, never vacuumed or analyzed
    cold_truncated_table  TRUNCATE, refilled, never vacuumed or analyzed
    warm                  TRUNCATE, refilled, VACUUM ANALYZE

relaybox is measured by `relaybox bench --cross-process --cold --skip-raw` (the same
phases; its report's `drains`); the peers by this script. Peers are installed into a
virtual environment of their own (`--setup` makes it, under /tmp), never into the
project's: this script runs them there as processes, through a small driver it writes
next to them, and reports their versions.

    txoutbox  PyPI `txoutbox` (asyncpg adapter, its defaults: strict per-key ordering,
              10 groups published at once) with `batch_size=500` and `delete_on_ack=True`
              (relaybox deletes a row on publish too); its publisher is what a user
              writes for it: one awaited XADD per message (fields data, id, key) on a
              redis-py asyncio client. Its rows carry no CloudEvents envelope, which
              relaybox's do: the peer publishes fewer bytes per message.

Rounds alternate relaybox and the peers (`--rounds`); the machine is shared, so report
medians with their range. Every table and stream is dropped at the end, also on failure.

    .venv/bin/python benchmarks/peers.py --setup [--messages 20000,100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_URL, machine

PEER_VENV = Path("/tmp/relaybox-peers")
PEER_PACKAGES = ("txoutbox", "asyncpg", "redis")
REDIS_URL = "redis://127.0.0.1:6379/0"
STALL_SECONDS = 60.0
POLL_SECONDS = 0.005

#: Run by the peers' interpreter: `driver.py JOB JSON`.
DRIVER = r"""
import asyncio, json, sys, time
from datetime import timedelta

import asyncpg
import redis.asyncio as aioredis


async def schema(spec):
    from txoutbox.adapters.postgres import PostgresStorage

    storage = await PostgresStorage.connect(spec["dsn"], table=spec["table"],
                                            min_size=1, max_size=1)
    try:
        await storage.create_schema()
    finally:
        await storage.close()


async def fill(spec):
    pad = "x" * max(0, spec["payload_bytes"] - 26)
    connection = await asyncpg.connect(spec["dsn"])
    started = time.perf_counter()
    try:
        for first in range(0, spec["messages"], 1000):
            numbers = range(first, min(spec["messages"], first + 1000))
            keys = [f"k{n % spec['keys']}" for n in numbers]
            payloads = [json.dumps({"n": f"{n:09d}", "pad": pad}, separators=(",", ":")).encode()
                        for n in numbers]
            await connection.execute(
                f"INSERT INTO {spec['table']} (topic, key, payload) "
                "SELECT 'bench', k, p FROM unnest($1::text[], $2::bytea[]) AS u(k, p)",
                keys, payloads,
            )
    finally:
        await connection.close()
    print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)


async def relay(spec):
    from txoutbox import Relay, RelayConfig
    from txoutbox.adapters.postgres import PostgresStorage

    client = aioredis.Redis.from_url(spec["redis"])
    stream = spec["stream"]

    async def publish(message):
        await client.xadd(stream, {"data": message.payload, "id": str(message.id),
                                   "key": message.key or ""})

    storage = await PostgresStorage.connect(spec["dsn"], table=spec["table"],
                                            delete_on_ack=True)
    try:
        config = RelayConfig(batch_size=spec["batch_size"])
        print("running", flush=True)
        await Relay(storage, publish, config=config).run(handle_signals=True)
    finally:
        await storage.close()
        await client.aclose()


def versions(spec):
    from importlib.metadata import version

    print(json.dumps({name: version(name) for name in spec["packages"]}), flush=True)


job, spec = sys.argv[1], json.loads(sys.argv[2])
if job == "versions":
    versions(spec)
else:
    asyncio.run({"schema": schema, "fill": fill, "relay": relay}[job](spec))
"""


def progress(text: str) -> None:
    print(f"[peers] {text}", file=sys.stderr, flush=True)


def setup(python: str) -> None:
    """A virtual environment of the peers' own, with the peers in it."""
    if not Path(python).exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", *PEER_PACKAGES], check=True)


class Peer:
    """One peer relay on one table of its own, driven through its interpreter."""

    name = "txoutbox"

    def __init__(self, args: argparse.Namespace, driver: Path) -> None:
        self.args = args
        self.driver = driver
        self.table = f"peer_txoutbox_{uuid.uuid4().hex[:8]}"
        self.stream = f"rbpeer.{uuid.uuid4().hex[:10]}"

    def spec(self, **extra: Any) -> str:
        return json.dumps({"dsn": self.args.db, "table": self.table, "redis": self.args.broker,
                           "stream": self.stream, "batch_size": self.args.batch_size,
                           "keys": self.args.keys, "payload_bytes": self.args.payload_bytes,
                           **extra})  # fmt: skip

    def run(self, job: str, **extra: Any) -> str:
        done = subprocess.run([self.args.peer_python, str(self.driver), job, self.spec(**extra)],
                              capture_output=True, text=True, check=False, timeout=600)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{self.name} {job} failed:\n{done.stderr}")
        return done.stdout

    async def drains(self, messages: int, db: Any, redis: Any) -> dict[str, Any]:
        self.run("schema")
        try:
            result = {}
            for start in ("cold_fresh_table", "cold_truncated_table", "warm"):
                if start != "cold_fresh_table":
                    await db.execute(f"TRUNCATE {self.table}")
                fill = json.loads(self.run("fill", messages=messages).splitlines()[-1])
                if start == "warm":
                    await db.execute(f"VACUUM ANALYZE {self.table}")
                progress(f"  {self.name} {start}: draining {messages}")
                drained = await self.drain(messages, redis)
                result[start] = {"fill_seconds": round(fill["seconds"], 3), **drained}
            return result
        finally:
            await db.execute(f"DROP TABLE IF EXISTS {self.table}")
            await redis.delete(self.stream)

    async def drain(self, messages: int, redis: Any) -> dict[str, Any]:
        await redis.delete(self.stream)
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            self.args.peer_python, str(self.driver), "relay", self.spec(),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            first, last, changed = None, 0, time.monotonic()
            while (done := int(await redis.xlen(self.stream))) < messages:
                if process.returncode is not None:
                    raise RuntimeError(f"{self.name} relay exited ({process.returncode})")
                if first is None and done:
                    first = time.perf_counter() - started
                if done != last:
                    last, changed = done, time.monotonic()
                elif time.monotonic() - changed > STALL_SECONDS:
                    raise RuntimeError(f"{self.name}: stuck at {done} of {messages}")
                await asyncio.sleep(POLL_SECONDS)
            seconds = time.perf_counter() - started
        finally:
            await stop(process)
        return {"seconds": round(seconds, 3), "msg_per_s": round(messages / seconds, 1),
                "first_confirm_seconds": None if first is None else round(first, 3),
                "exit_code": process.returncode}  # fmt: skip


async def stop(process: asyncio.subprocess.Process, timeout: float = 15.0) -> None:
    """SIGTERM by PID, then SIGKILL if it does not go."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        await process.wait()


def relaybox_drains(args: argparse.Namespace, messages: int) -> dict[str, Any]:
    """`relaybox bench --cross-process --cold` on the same backlog: its drains."""
    command = [sys.executable, "-m", "relaybox", "bench", "--db", args.db, "--broker",
               args.broker, "--messages", str(messages), "--batch-size", str(args.batch_size),
               "--keys", str(args.keys), "--payload-bytes", str(args.payload_bytes),
               "--cross-process", "--cold", "--skip-raw", "--idle-seconds", "0",
               "--paced-seconds", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"relaybox bench failed:\n{done.stderr}")
    report = json.loads(done.stdout)

    keys = ("seconds", "msg_per_s", "first_confirm_seconds", "relay_start_seconds",
            "table_at_start")  # fmt: skip

    def drained(drain: dict[str, Any]) -> dict[str, Any]:
        return {key: drain.get(key) for key in keys}

    return {
        "cold_fresh_table": drained(report["cold"]["fresh_table"]["drain"]),
        "cold_truncated_table": drained(report["cold"]["truncated_table"]["drain"]),
        "warm": drained(report["drain"]),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median msg/s (and range) per relay, start and backlog."""
    rates: dict[str, list[float]] = {}
    for run in runs:
        for start, drain in run["drains"].items():
            name = f"{run['relay']} {run['messages']} {start}"
            rates.setdefault(name, []).append(drain["msg_per_s"])
    return {name: {"median_msg_per_s": round(statistics.median(v), 1),
                   "min": min(v), "max": max(v), "runs": len(v)}
            for name, v in rates.items()}  # fmt: skip


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import asyncpg
    import redis.asyncio as aioredis

    with tempfile.TemporaryDirectory(prefix="relaybox_peers_") as folder:
        driver = Path(folder) / "driver.py"
        driver.write_text(DRIVER)
        versions = json.loads(subprocess.run(
            [args.peer_python, str(driver), "versions", json.dumps({"packages": PEER_PACKAGES})],
            capture_output=True, text=True, check=True).stdout)  # fmt: skip
        db = await asyncpg.connect(args.db)
        redis = aioredis.Redis.from_url(args.broker)
        runs: list[dict[str, Any]] = []
        try:
            for round_ in range(args.rounds):
                for messages in args.messages:
                    order = ["relaybox", "txoutbox"][:: 1 if round_ % 2 == 0 else -1]
                    for relay in order:
                        progress(f"round {round_ + 1}: {relay}, {messages} messages")
                        if relay == "relaybox":
                            drains = relaybox_drains(args, messages)
                        else:
                            drains = await Peer(args, driver).drains(messages, db, redis)
                        runs.append({"relay": relay, "messages": messages, "round": round_ + 1,
                                     "drains": drains})  # fmt: skip
        finally:
            await db.close()
            await redis.aclose()
    return {"versions": versions, "summary": summary(runs), "runs": runs}


def _counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--db", default=os.environ.get("RELAYBOX_BENCH_PG", PG_URL))
    parser.add_argument("--broker", default=REDIS_URL, help="Redis the relays publish to")
    parser.add_argument("--messages", type=_counts, default=[20_000, 100_000])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--payload-bytes", type=int, default=100)
    parser.add_argument("--peer-python", default=str(PEER_VENV / "bin" / "python"))
    parser.add_argument(
        "--setup", action="store_true", help=f"create the peers' environment ({PEER_VENV})"
    )
    args = parser.parse_args()
    if args.setup:
        setup(args.peer_python)
    started = time.perf_counter()
    report = {
        "benchmark": "peers",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": {**machine(), "load_average_at_start": [round(v, 2) for v in os.getloadavg()]},
        **asyncio.run(measure(args)),
    }
    report["seconds_total"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
