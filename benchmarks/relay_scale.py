"""Drain rate of 1, 2 and 4 `relaybox relay` processes, beside the raw claim-and-delete limit.

One run, on one table it creates (`bench_relay_scale_<hex>`) and drops at the end, also
on failure:

1. for each process count N (`--processes`, default 1,2,4), on a backlog of `--messages`
   (default 200,000): N real `relaybox relay` processes (the CLI, no-op broker,
   published retention 0 = delete on publish, the CLI's other defaults: batch 500, 3
   batches in flight, or a relay's share of them in a fleet, partition leases on 64
   partitions) drain the backlog; then, after
   a refill, the plain claim-and-delete loop of `relaybox bench` (`bench._raw_drain`,
   `DELETE ... WHERE seq IN (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING ...`) drains
   the same backlog on N connections (one asyncio process, N concurrent loops);
2. the same on a backlog of `--big-messages` (default 1,000,000) with `--big-processes`
   (default 1,4).

How a relay drain is timed. The backlog is written first, then the processes are
started; a process is "running" when it prints `relay <worker> running`. Started on a
backlog, the first process would hold all 64 partitions and the others nothing until
its next heartbeats hand them over (half a second apart while the partitions are being
shared out; a partition with rows in flight goes once they are settled): a drain of a
few seconds would then measure the hand-over, not N relays. So while the processes
start, this script holds a gate that every claim waits on (an ACCESS EXCLUSIVE lock
on the outbox table, in an open transaction: a relay's read, which takes no lock of its
own, waits for it as a row-lease claim would): the relays start, heartbeat, share the
partitions and each sends its first claim, which waits. The drain clock starts when
every worker holds its fair share of partitions (`<table>_partitions`) and N claims
wait on the gate (`pg_locks`), just before the gate is released; it stops at the
first poll (every `--poll` s; one probe of the primary key, `ORDER BY seq LIMIT 1`,
never a count over the table) that finds no live row. With retention 0 a row leaves
the table when its publish is settled, so "empty" means every message was published
and settled. The processes' start-up is
reported apart: `running_seconds` (spawn to the last "running" line) and
`ready_seconds` (spawn to the gate opening, mostly waiting for the partition hand-over).
A relay's first claim was sent before the hand-over, so it covers the partitions the
relay held then (all of them for the first one): one batch of 500, then the relay
claims in its own partitions. The raw loop needs no gate: it is timed by `_raw_drain`
from its first DELETE to the last loop's empty one.

The backlog. `relaybox bench`'s workload (1,000 keys round-robin, ~100-byte JSON
payloads): the first 1,000 messages are written with `storage.write` (real rows: routing,
partition, envelope columns), the rest are copies of them made in SQL with new UUIDv7
ids from Python (`INSERT ... SELECT` over `unnest(ids) WITH ORDINALITY`, in seq order,
keys round-robin), so a 1M backlog takes seconds rather than a minute; copies repeat
their template's payload. Every fill starts from TRUNCATE and ends with VACUUM ANALYZE,
so every drain starts from the same state. Between relay runs the partition and member
tables are cleared (the processes have stopped by then and left). `--keys` matters: a
relay holds about keys / N of them, and once a batch in flight holds every key a relay
has, its next claim finds nothing to take and walks the whole backlog doing so.

Every process this script starts is stopped by its PID (SIGTERM, then SIGKILL after
`--stop-timeout` s) in a `finally`. Prints one JSON document; progress goes to stderr.

    .venv/bin/python benchmarks/relay_scale.py [--messages 200000] [--processes 1,2,4]
        [--big-messages 1000000] [--big-processes 1,4] [--db URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_URL, cpu_seconds, machine

from relaybox.core.ids import uuid7
from relaybox.core.partitions import DEFAULT_PARTITIONS, fair_share
from relaybox.migrations import migrate
from relaybox.storage import open_storage
from relaybox.storage.urls import DatabaseUrl
from relaybox.tools import bench

COPY_CHUNK = 100_000
TEMPLATE_CHUNK = 1_000
#: Waits that should take seconds; past these something is broken.
RUNNING_TIMEOUT = 60.0
READY_TIMEOUT = 90.0
STALL_SECONDS = 60.0
COPY = """
INSERT INTO {table} (id, target, external, topic, key, partition, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at)
SELECT u.id, t.target, t.external, t.topic, t.key, t.partition, t.type, t.content_type,
    t.payload, t.headers, t.correlation_id, t.causation_id, t.tenant_id, t.aggregate_id,
    t.occurred_at
FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, n)
JOIN (SELECT row_number() OVER (ORDER BY seq) AS rn, * FROM
        (SELECT * FROM {table} ORDER BY seq LIMIT $3) AS first) AS t
  ON t.rn = ($2::bigint + u.n - 1) % $3 + 1
ORDER BY u.n
"""
LIVE_HEAD = "SELECT seq FROM {table} ORDER BY seq LIMIT 1"  # live rows only (0007)
HOLDERS = (
    "SELECT owner, count(*) FROM {table}_partitions "
    "WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner"
)
#: Claims waiting on the gate: the table lock the gate holds.
WAITING = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'relation' AND NOT granted "
    "AND relation = $1::regclass"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    db: str
    table: str
    relaybox: str
    batch_size: int
    keys: int
    payload_bytes: int
    poll: float
    stop_timeout: float

    def options(self, messages: int) -> bench.BenchOptions:
        """What `relaybox bench`'s helpers (workload, raw loop) read."""
        return bench.BenchOptions(
            db=self.db, broker="noop://", messages=messages, batch_size=self.batch_size,
            max_in_flight=None, rate=1.0, paced_seconds=0.0, idle_seconds=0.0, keys=self.keys,
            payload_bytes=self.payload_bytes, skip_raw=False, table=self.table,
        )  # fmt: skip

    def relay_command(self) -> list[str]:
        return [self.relaybox, "relay", "--db", self.db, "--table", self.table,
                "--broker", "default=noop://", "--partitions", str(DEFAULT_PARTITIONS),
                "--batch-size", str(self.batch_size), "--published-retention", "0",
                "--log-level", "INFO"]  # fmt: skip


def progress(text: str) -> None:
    print(f"[relay_scale] {text}", file=sys.stderr, flush=True)


# -- the backlog ----------------------------------------------------------------------


async def fill(cfg: Config, admin: bench.PostgresAdmin, messages: int) -> dict[str, Any]:
    """TRUNCATE, write the first `keys` messages for real, copy them up to `messages`."""
    options = cfg.options(messages)
    workload = bench.Workload(options)
    started = time.perf_counter()
    session = await admin.session()
    try:
        await session.execute(f"TRUNCATE {cfg.table}")
        templates = min(cfg.keys, messages)
        storage = await open_storage(cfg.db, table=cfg.table)
        try:
            # In chunks: each keyed row takes its key's lock until the write commits,
            # and one transaction holds only so many locks (max_locks_per_transaction).
            for start in range(0, templates, TEMPLATE_CHUNK):
                numbers = range(start, min(start + TEMPLATE_CHUNK, templates))
                await storage.write(workload.routing.rows(workload.message(n) for n in numbers))
        finally:
            await storage.close()
        query = COPY.format(table=cfg.table)
        for first in range(templates, messages, COPY_CHUNK):
            ids = [uuid7() for _ in range(min(COPY_CHUNK, messages - first))]
            async with session.transaction():
                await session.execute("SET LOCAL work_mem = '256MB'")
                await session.execute(query, ids, first, templates)
        count = await session.fetchval(f"SELECT count(*) FROM {cfg.table}")
    finally:
        await session.close()
    if count != messages:
        raise RuntimeError(f"fill wrote {count} rows, not {messages}")
    written = time.perf_counter() - started
    await admin.vacuum(cfg.table)
    return {"messages": messages, "write_seconds": round(written, 3),
            "with_vacuum_seconds": round(time.perf_counter() - started, 3)}  # fmt: skip


# -- relay processes ------------------------------------------------------------------


@dataclasses.dataclass
class RelayProcess:
    process: asyncio.subprocess.Process
    log: Path
    worker: str = ""

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


async def spawn(cfg: Config, logs: Path, index: int) -> RelayProcess:
    log = logs / f"relay-{index}.log"
    with log.open("wb") as err:
        process = await asyncio.create_subprocess_exec(
            *cfg.relay_command(), stdout=asyncio.subprocess.PIPE, stderr=err,
            stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
    return RelayProcess(process, log)


async def until_running(relay: RelayProcess) -> None:
    """Read stdout until `relay <worker> running`; the worker name is kept."""
    assert relay.process.stdout is not None
    while True:
        line = (await relay.process.stdout.readline()).decode(errors="replace")
        if not line:
            code = await relay.process.wait()
            raise RuntimeError(f"relay exited ({code}) before running:\n{relay.log_tail()}")
        words = line.split()
        if len(words) >= 3 and words[0] == "relay" and words[2].rstrip(";") == "running":
            relay.worker = words[1]
            return


async def stop(relays: list[RelayProcess], timeout: float) -> list[int | None]:
    """SIGTERM each by PID, wait, SIGKILL what is left; the exit codes."""
    for relay in relays:
        if relay.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(relay.process.pid, signal.SIGTERM)
    for relay in relays:
        try:
            await asyncio.wait_for(relay.process.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(relay.process.pid, signal.SIGKILL)
            await relay.process.wait()
    return [relay.process.returncode for relay in relays]


async def until_ready(watch: Any, cfg: Config, workers: list[str]) -> None:
    """Every worker holds its fair share of partitions and has a claim at the gate."""
    share = fair_share(DEFAULT_PARTITIONS, len(workers))
    holders_query, deadline = HOLDERS.format(table=cfg.table), time.monotonic() + READY_TIMEOUT
    while True:
        holders = dict(await watch.fetch(holders_query))
        waiting = await watch.fetchval(WAITING, cfg.table)
        balanced = (
            set(holders) == set(workers)
            and sum(holders.values()) == DEFAULT_PARTITIONS
            and max(holders.values()) <= share
        )
        if balanced and waiting == len(workers):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"relays not ready: partitions {holders}, {waiting} at the gate")
        await asyncio.sleep(0.1)


async def until_empty(watch: Any, cfg: Config, relays: list[RelayProcess]) -> int:
    """Poll the head of the live rows until there is none; the number of polls."""
    query, polls = LIVE_HEAD.format(table=cfg.table), 0
    last, changed = None, time.monotonic()
    while True:
        head = await watch.fetchval(query)
        polls += 1
        if head is None:
            return polls
        for relay in relays:
            if relay.process.returncode is not None:
                raise RuntimeError(f"relay {relay.worker} exited:\n{relay.log_tail()}")
        if head != last:
            last, changed = head, time.monotonic()
        elif time.monotonic() - changed > STALL_SECONDS:
            raise RuntimeError(f"drain stuck at seq {head} for {STALL_SECONDS:.0f} s")
        await asyncio.sleep(cfg.poll)


async def relay_drain(
    cfg: Config, admin: bench.PostgresAdmin, processes: int, messages: int
) -> dict[str, Any]:
    filled = await fill(cfg, admin, messages)
    gate, watch = await admin.session(), await admin.session()
    relays: list[RelayProcess] = []
    exit_codes: list[int | None] = []
    try:
        await gate.execute(f"BEGIN; LOCK TABLE {cfg.table} IN ACCESS EXCLUSIVE MODE")
        with tempfile.TemporaryDirectory(prefix="relay_scale_") as logs:
            spawned = time.perf_counter()
            try:
                for index in range(processes):
                    relays.append(await spawn(cfg, Path(logs), index))
                await asyncio.wait_for(
                    asyncio.gather(*(until_running(r) for r in relays)), RUNNING_TIMEOUT
                )
                running = time.perf_counter() - spawned
                await until_ready(watch, cfg, [r.worker for r in relays])
                ready = time.perf_counter() - spawned
                cpu, relay_cpu = bench.CpuMark.now(), [cpu_seconds(r.process.pid) for r in relays]
                started = time.perf_counter()
                await gate.execute("COMMIT")
                polls = await until_empty(watch, cfg, relays)
                seconds, usage = time.perf_counter() - started, cpu.usage()
                relay_cpu = [
                    cpu_seconds(r.process.pid) - c for r, c in zip(relays, relay_cpu, strict=True)
                ]
            finally:
                with contextlib.suppress(Exception):
                    await gate.close()  # opens the gate if something failed before
                exit_codes = await stop(relays, cfg.stop_timeout)
    finally:
        with contextlib.suppress(Exception):
            await gate.close()
        try:
            await watch.execute(f"DELETE FROM {cfg.table}_members")
            await watch.execute(
                f"UPDATE {cfg.table}_partitions SET owner = NULL, lease_until = NULL"
            )
        finally:
            await watch.close()
    return {
        "processes": processes, "messages": messages, "fill": filled,
        "seconds": round(seconds, 3), "msg_per_s": bench._rate(messages, seconds),
        "running_seconds": round(running, 3), "ready_seconds": round(ready, 3),
        "polls": polls, "cpu": usage,
        "relay_cpu_percent_of_one_core": [round(100 * c / seconds, 1) for c in relay_cpu],
        "exit_codes": exit_codes,
    }  # fmt: skip


async def raw_drain(
    cfg: Config, admin: bench.PostgresAdmin, connections: int, messages: int
) -> dict[str, Any]:
    filled = await fill(cfg, admin, messages)
    cpu = bench.CpuMark.now()
    rate = await bench._raw_drain(cfg.options(messages), admin, connections=connections)
    return {"connections": connections, "messages": messages, "fill": filled,
            "msg_per_s": rate, "cpu": cpu.usage()}  # fmt: skip


async def series(
    cfg: Config, admin: bench.PostgresAdmin, counts: list[int], messages: int
) -> dict[str, Any]:
    """For each N: N relays, then the raw loop on N connections, on the same backlog."""
    runs: list[dict[str, Any]] = []
    for n in counts:
        progress(f"{messages} messages: {n} relay process(es)")
        relay = await relay_drain(cfg, admin, n, messages)
        progress(f"  {relay['msg_per_s']} msg/s; raw loop on {n} connection(s)")
        raw = await raw_drain(cfg, admin, n, messages)
        progress(f"  {raw['msg_per_s']} msg/s")
        ratio = _ratio(relay["msg_per_s"], raw["msg_per_s"])
        runs.append({"processes": n, "relay": relay, "raw": raw, "relay_vs_raw_same_n": ratio})
    limit = max(run["raw"]["msg_per_s"] or 0.0 for run in runs)
    return {
        "messages": messages,
        "relay_msg_per_s": {str(r["processes"]): r["relay"]["msg_per_s"] for r in runs},
        "raw_msg_per_s": {str(r["processes"]): r["raw"]["msg_per_s"] for r in runs},
        "raw_limit_msg_per_s": limit,
        "relay_vs_raw_limit": {str(r["processes"]): _ratio(r["relay"]["msg_per_s"], limit)
                               for r in runs},
        "runs": runs,
    }  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# -- putting it together --------------------------------------------------------------


async def run(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    url = DatabaseUrl.parse(cfg.db)
    admin = await bench.PostgresAdmin.connect(url)
    report: dict[str, Any] = {
        "benchmark": "relay_scale",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": {**machine(), "load_average_at_start": [round(v, 2) for v in os.getloadavg()]},
        "database": {"url": url.masked, "table": cfg.table},
        "settings": {
            "relay_command": shlex.join(cfg.relay_command()).replace(cfg.db, url.masked),
            "relay": "CLI defaults besides the flags above: 3 batches in flight (a relay "
                     "of a fleet its share of them, at least one), lease 30 s (partition "
                     "heartbeat every 5 s), LISTEN on",
            "raw_query": bench.RAW_CLAIM.format(table="<table>"),
            "raw_loop": "bench._raw_drain: N asyncpg connections in this process, one "
                        "loop each, timed from the first DELETE to the last empty one",
            "batch_size": cfg.batch_size, "keys": cfg.keys, "payload_bytes": cfg.payload_bytes,
            "partitions": DEFAULT_PARTITIONS, "poll_seconds": cfg.poll,
            "relay_timing": "from opening the claim gate (all relays running, partitions "
                            "shared, one claim each waiting) to the first poll finding no "
                            "live row; start-up reported apart (running_seconds, "
                            "ready_seconds)",
        },
    }  # fmt: skip
    started = time.perf_counter()
    try:
        await migrate(cfg.db, table=cfg.table)
        if args.processes:
            report["scale"] = await series(cfg, admin, args.processes, args.messages)
        if args.big_processes:
            report["big"] = await series(cfg, admin, args.big_processes, args.big_messages)
    finally:
        await admin.drop(cfg.table)
        await admin.close()
    report["machine"]["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    report["seconds_total"] = round(time.perf_counter() - started, 1)
    return report


def _counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--db", default=PG_URL)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--processes", type=_counts, default=[1, 2, 4],
                        help="relay process counts for --messages (1,2,4); '' skips")  # fmt: skip
    parser.add_argument("--big-messages", type=int, default=1_000_000)
    parser.add_argument("--big-processes", type=_counts, default=[1, 4],
                        help="relay process counts for --big-messages; '' skips")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--payload-bytes", type=int, default=100)
    parser.add_argument("--poll", type=float, default=0.05, help="seconds between polls")
    parser.add_argument("--stop-timeout", type=float, default=15.0)
    parser.add_argument("--relaybox", default=str(Path(sys.executable).parent / "relaybox"))
    args = parser.parse_args()
    cfg = Config(
        db=args.db, table=f"bench_relay_scale_{uuid.uuid4().hex[:8]}", relaybox=args.relaybox,
        batch_size=args.batch_size, keys=args.keys, payload_bytes=args.payload_bytes,
        poll=args.poll, stop_timeout=args.stop_timeout,
    )  # fmt: skip
    print(json.dumps(asyncio.run(run(cfg, args)), indent=2))


if __name__ == "__main__":
    main()
