"""Commit-to-publish latency with the relay in a process of its own, and what waking it costs.

    .venv/bin/python benchmarks/wakeup_latency.py [--rate 500] [--writers 4]
        [--seconds 10] [--rounds 3] [--throughput-seconds 10] [--idle-seconds 20]
        [--trickle-rate 1] [--variants poll,wake,window] [--relay-args "..."] [--out FILE]

The deployment measured is the common one: writer processes commit, and `relaybox
relay`, started here as a subprocess (stopped by its PID), publishes from a process of
its own. Nothing in the writers announces a commit to the relay but what a variant
turns on:

- `poll`: writers with `Outbox(notify=False)`, relay with `--fast-poll-window 0`: the
  adaptive poll alone (10 ms after an empty read, doubling to 1 s).
- `wake`: writers with `Outbox(notify=True)` (a NOTIFY at most every 0.05 s each),
  relay with its defaults (a fast window after a NOTIFY or a read that found rows).
- `window`: writers without NOTIFY, relay with its defaults: what a relay gets where
  no NOTIFY exists (MariaDB, SQLite), measured here on PostgreSQL.

Phases, each alternating the variants run by run (`--rounds` runs of each):

1. **latency**: `--writers` processes (spawned) each commit `--rate / --writers`
   messages a second, one per transaction, due at evenly staggered times (a late one is
   sent at once). Each writer records, per message id, `time.monotonic()` when COMMIT
   returned. The relay publishes to Redis Streams (a stream of this run's own); this
   process reads it with a blocking XREAD and records each entry's arrival on the same
   clock (CLOCK_MONOTONIC is one clock for every process on Linux). Latency is arrival
   minus commit return; the first 2 s of each run (the relay taking its partitions) are
   not counted. The relay runs on its own connections, not through the proxy below.
   Each run also says where the machine's time went: the relay's share of a core, its
   PostgreSQL sessions', this process's (the stream's reader), and the whole machine's
   busy share (of every core).
2. **throughput**: the same writers, unpaced, for `--throughput-seconds`, with the relay
   running; transactions/s of the `wake` variant over those of `poll` in the same round.
   Writers alternate notify settings only between runs; the relay's setting is the
   variant's.
3. **idle**: the relay through a TCP proxy in this process that counts what the relay
   sends PostgreSQL: every simple Query and every Execute of the extended protocol, on
   all its connections (claims, settles, housekeeping, LISTEN and its probes). Counted
   over `--idle-seconds` after 3 s of settling, nothing written.
4. **trickle**: the same count while one writer commits `--trickle-rate` messages a
   second (0: skipped): what a burst's end costs, repeated.

With `--db mysql://...` (MariaDB, MySQL) the writers use PyMySQL, `wake` is `window`
(there is no NOTIFY), and the idle and trickle counts are skipped (the proxy reads
PostgreSQL's protocol only).

Prints one JSON document (and writes it to `--out`). The table (`wake_<hex>`) and the
Redis stream are removed at the end; every process started here is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing
import os
import shlex
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_seconds, machine

from relaybox import Message, Outbox
from relaybox.migrations import migrate
from relaybox.storage.urls import DatabaseUrl
from relaybox.tools.bench import CpuMark, connect_admin, percentiles

DEFAULT_DB = os.environ.get(
    "RELAYBOX_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/relaybox_bench"
)
TOPIC = "wake"
WARMUP_SECONDS = 2.0
IDLE_SETTLE_SECONDS = 3.0
RELAY_START_SECONDS = 30.0
WRITER_START_SECONDS = 3.0  # spawned interpreters import psycopg and relaybox

#: Per variant: the writers' `notify`, the relay's extra arguments.
VARIANTS: dict[str, tuple[bool, list[str]]] = {
    "poll": (False, ["--fast-poll-window", "0"]),
    "wake": (True, []),
    "window": (False, []),
}


@dataclass(frozen=True)
class WriterPlan:
    db: str
    table: str
    notify: bool
    #: Messages a second for this writer; 0: as fast as it can.
    rate: float
    start: float
    seconds: float
    #: Seconds after `start` of this writer's first message.
    offset: float


def write(plan: WriterPlan, index: int, out: Any) -> None:
    """A writer process: one message per transaction, paced or not; sends back
    (index, transactions, [(id hex, began, COMMIT sent, COMMIT returned), ...])."""
    outbox = Outbox(table=plan.table, notify=plan.notify)
    commits: list[tuple[str, float, float, float]] = []
    with contextlib.closing(connect(plan.db)) as conn:
        for n in range(5):  # warm: prepared statements, caches
            outbox.add(conn, Message(topic=TOPIC, key=f"w{index}-warm", payload={"n": n}))
            conn.commit()
        outbox._next_notify = 0.0  # the measured run starts as a fresh process would
        time.sleep(max(0.0, plan.start - time.monotonic()))
        end = plan.start + plan.seconds
        n = 0
        while True:
            if plan.rate:
                due = plan.start + plan.offset + n / plan.rate
                if due >= end:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
            elif time.monotonic() >= end:
                break
            began = time.monotonic()
            message = Message(topic=TOPIC, key=f"w{index}-{n % 50}", payload={"n": n})
            outbox.add(conn, message)
            committing = time.monotonic()
            conn.commit()
            commits.append((message.id.hex, began, committing, time.monotonic()))
            n += 1
    out.put((index, n, commits))


def connect(db: str) -> Any:
    """A writer's connection: psycopg on PostgreSQL, PyMySQL on MySQL/MariaDB."""
    if not db.startswith("mysql"):
        return psycopg.connect(db)
    import pymysql

    url = DatabaseUrl.parse(db)
    return pymysql.connect(host=url.host or "127.0.0.1", port=url.port or 3306,
                           user=url.user or "root", password=url.password or "",
                           database=url.database)  # fmt: skip


def run_writers(
    db: str, table: str, *, writers: int, rate: float, seconds: float, notify: bool
) -> tuple[list[int], dict[str, tuple[float, float, float]], float]:
    """Run the writer processes; (transactions per writer, by message id its
    transaction's start, COMMIT sent and COMMIT returned, the start of the run)."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start = time.monotonic() + WRITER_START_SECONDS
    each = rate / writers
    procs = [
        context.Process(
            target=write,
            args=(
                WriterPlan(db, table, notify, each, start, seconds, i / rate if rate else 0),
                i,
                out,
            ),
            name=f"wake-writer-{i}",
        )
        for i in range(writers)
    ]
    for proc in procs:
        proc.start()
    try:
        parts = [out.get(timeout=WRITER_START_SECONDS + seconds + 60) for _ in procs]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
                proc.join()
    counts = [0] * writers
    committed: dict[str, tuple[float, float, float]] = {}
    for index, count, commits in parts:
        counts[index] = count
        committed.update((key, times) for key, *times in commits)
    return counts, committed, start


# -- the relay process -------------------------------------------------------------


def start_relay(command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start `relaybox relay` with its output in `log_path`; wait for its "running" line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + RELAY_START_SECONDS
    while True:
        text = log_path.read_text(errors="replace")
        if any(line.startswith("relay ") and " running" in line for line in text.splitlines()):
            return process
        if process.poll() is not None or time.monotonic() > deadline:
            stop_process(process)
            raise RuntimeError(f"the relay did not start (exit {process.poll()}):\n{text[-2000:]}")
        time.sleep(0.05)


def stop_process(process: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


class Relay:
    """`relaybox relay` for one variant, as a context manager."""

    def __init__(self, bench: Bench, variant: str, db: str | None = None) -> None:
        self.command = [
            str(Path(sys.executable).with_name("relaybox")), "relay",
            "--db", db or bench.db, "--broker", f"default={bench.redis_url}",
            "--table", bench.table, "--log-level", "WARNING", *VARIANTS[variant][1],
            *shlex.split(bench.args.relay_args),
        ]  # fmt: skip
        self.log = bench.work_dir / f"relay-{variant}-{uuid.uuid4().hex[:6]}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Relay:
        self.process = start_relay(self.command, self.log)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            stop_process(self.process)


# -- counting what the relay sends PostgreSQL ----------------------------------------


class CountingProxy:
    """A TCP proxy to PostgreSQL that counts the frontend's Query ('Q') and Execute
    ('E') messages: one per statement run, whatever the driver."""

    SSL, GSS, PROTOCOL_3 = 80877103, 80877104, 196608

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.statements = 0
        #: Transactions: a BEGIN ... COMMIT block counts once, a statement outside one too.
        self.transactions = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._writers += [writer, up_writer]
        await asyncio.gather(self._frontend(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        sink.close()

    async def _frontend(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        buffer, typed, block = b"", False, False
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
                buffer += data
                while True:
                    if not typed:  # SSLRequest, GSSENCRequest, StartupMessage: untyped
                        if len(buffer) < 8:
                            break
                        length, code = struct.unpack("!ii", buffer[:8])
                        if len(buffer) < length:
                            break
                        buffer, typed = buffer[length:], code == self.PROTOCOL_3
                        continue
                    if len(buffer) < 5:
                        break
                    kind, length = buffer[:1], struct.unpack("!i", buffer[1:5])[0]
                    if len(buffer) < 1 + length:
                        break
                    if kind in (b"Q", b"E"):
                        self.statements += 1
                        text = buffer[5:12].upper() if kind == b"Q" else b""
                        if text.startswith(b"BEGIN"):
                            block = True
                            self.transactions += 1
                        elif text.startswith((b"COMMIT", b"ROLLBAC")):
                            block = False
                        elif not block:
                            self.transactions += 1
                    buffer = buffer[1 + length :]
        sink.close()


# -- the bench -------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.db = args.db
        self.table = f"wake_{uuid.uuid4().hex[:10]}"
        self.prefix = f"{self.table}:"
        self.stream = f"{self.prefix}{TOPIC}"
        self.redis_url = f"{args.redis}?prefix={self.prefix}"
        self.work_dir = Path(tempfile.mkdtemp(prefix="relaybox-wake-"))
        self.postgresql = DatabaseUrl.parse(self.db).dialect == "postgresql"

    async def receive(self, stop: asyncio.Event, arrivals: dict[str, float]) -> None:
        """Read the relay's stream from its start, noting each entry's arrival."""
        import redis.asyncio as aioredis

        client = aioredis.from_url(self.args.redis)
        last: Any = "$"  # the runs before this one are not read again
        try:
            while not stop.is_set():
                found: Any = await client.xread({self.stream: last}, count=1000, block=200)
                now = time.monotonic()
                for _, entries in found:
                    for entry_id, fields in entries:
                        last = entry_id
                        arrivals[uuid.UUID(fields[b"id"].decode()).hex] = now
        finally:
            await client.aclose()

    async def vacuum(self) -> None:
        """What autovacuum would do between runs (the shared server runs without it):
        reads would otherwise step over the dead rows of every run before."""
        if not self.postgresql:
            return
        async with await psycopg.AsyncConnection.connect(self.db, autocommit=True) as conn:
            await conn.execute(f"VACUUM {self.table}")

    async def latency_run(self, variant: str) -> dict[str, Any]:
        args = self.args
        notify = VARIANTS[variant][0]
        stop, arrivals = asyncio.Event(), dict[str, float]()
        await self.vacuum()
        with Relay(self, variant) as relay:
            assert relay.process is not None
            cpu_before, machine = cpu_seconds(relay.process.pid), CpuMark.now()
            receiving = asyncio.create_task(self.receive(stop, arrivals))
            _, committed, start = await asyncio.to_thread(
                run_writers, self.db, self.table, writers=args.writers, rate=args.rate,
                seconds=WARMUP_SECONDS + args.seconds, notify=notify,
            )  # fmt: skip
            deadline = time.monotonic() + 10
            while not committed.keys() <= arrivals.keys() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            stop.set()
            await receiving
            cpu = cpu_seconds(relay.process.pid) - cpu_before
            usage = machine.usage()
            sessions = await self.relay_sessions_cpu()
        spent = args.seconds
        lifetime = WRITER_START_SECONDS + WARMUP_SECONDS + spent
        counted = {k: t for k, t in committed.items() if t[2] >= start + WARMUP_SECONDS}
        lags = [arrivals[k] - t[2] for k, t in counted.items() if k in arrivals]
        upper = [arrivals[k] - t[1] for k, t in counted.items() if k in arrivals]
        spans = [t[2] - t[0] for t in counted.values()]
        return {
            "variant": variant, "messages": len(counted),
            "missing": sum(k not in arrivals for k in committed),
            "rate": round(len(counted) / args.seconds, 1), **percentiles(lags),
            "from_commit_sent": percentiles(upper),
            "writer_transaction_ms": round(statistics.fmean(spans) * 1000, 3),
            "load_average_1m": round(os.getloadavg()[0], 2),  # others' load on the machine
            "relay_cpu_share": round(cpu / lifetime, 3),
            # Where the machine's time went (on 2 cores, the tail follows it): the
            # relay's database sessions over the same time, this process (the stream
            # reader), and the whole machine.
            "relay_sessions_cpu_share": None if sessions is None else round(sessions / lifetime, 3),
            "bench_process_cpu_share": _percent(usage["bench_process_percent"]),
            "machine_busy_share": _percent(usage["machine_busy_percent"]),
        }  # fmt: skip

    async def relay_sessions_cpu(self) -> float | None:
        """CPU seconds of the relay's PostgreSQL sessions so far (they start with it)."""
        if not self.postgresql:
            return None
        async with await psycopg.AsyncConnection.connect(self.db, autocommit=True) as conn:
            rows = await (await conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'relaybox'"
                " AND datname = current_database() AND pid <> pg_backend_pid()"
            )).fetchall()  # fmt: skip
        return sum(cpu_seconds(pid) for (pid,) in rows)

    async def throughput_run(self, variant: str) -> dict[str, Any]:
        args = self.args
        await self.vacuum()
        with Relay(self, variant):
            counts, _, _ = await asyncio.to_thread(
                run_writers, self.db, self.table, writers=args.writers, rate=0,
                seconds=args.throughput_seconds, notify=VARIANTS[variant][0],
            )  # fmt: skip
        return {"variant": variant, "tps": round(sum(counts) / args.throughput_seconds, 1),
                "load_average_1m": round(os.getloadavg()[0], 2)}  # fmt: skip

    async def idle_run(self, variant: str) -> dict[str, Any]:
        """The relay's statements per second with nothing to do."""
        async with counting(self) as (proxy, via), asyncio_relay(self, variant, via):
            await asyncio.sleep(IDLE_SETTLE_SECONDS)
            before, began = (proxy.statements, proxy.transactions), time.monotonic()
            await asyncio.sleep(self.args.idle_seconds)
            spent = time.monotonic() - began
            counted = (proxy.statements - before[0], proxy.transactions - before[1])
        return {"variant": variant, "seconds": round(spent, 1), "statements": counted[0],
                "statements_per_s": round(counted[0] / spent, 2),
                "transactions_per_s": round(counted[1] / spent, 2)}  # fmt: skip


@contextlib.asynccontextmanager
async def counting(bench: Bench) -> Any:
    """A counting proxy to the bench's database, and the URL through it."""
    url = DatabaseUrl.parse(bench.db)
    proxy = CountingProxy(url.host or "127.0.0.1", url.port or 5432)
    await proxy.start()
    via = bench.db.replace(f"{url.host}:{url.port or 5432}", f"127.0.0.1:{proxy.port}", 1)
    try:
        yield proxy, via
    finally:
        await proxy.close()


@contextlib.asynccontextmanager
async def asyncio_relay(bench: Bench, variant: str, db: str) -> Any:
    """`Relay` started and stopped off the event loop, which serves the proxy."""
    relay = Relay(bench, variant, db=db)
    await asyncio.to_thread(relay.__enter__)
    try:
        yield relay
    finally:
        await asyncio.to_thread(relay.__exit__)


async def counted_trickle(bench: Bench, variant: str, rate: float) -> dict[str, Any]:
    """The relay's statements per second while one writer commits `rate` messages a
    second, counted over the writer's span."""
    async with counting(bench) as (proxy, via), asyncio_relay(bench, variant, via):
        await asyncio.sleep(IDLE_SETTLE_SECONDS)
        marks: list[tuple[float, int]] = []

        async def sample() -> None:
            while True:
                marks.append((time.monotonic(), proxy.statements))
                await asyncio.sleep(0.05)

        sampling = asyncio.create_task(sample())
        try:
            _, committed, start = await asyncio.to_thread(
                run_writers, bench.db, bench.table, writers=1, rate=rate,
                seconds=bench.args.idle_seconds, notify=VARIANTS[variant][0],
            )  # fmt: skip
        finally:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
    end = start + bench.args.idle_seconds
    inside = [(at, count) for at, count in marks if start <= at <= end]
    spent = inside[-1][0] - inside[0][0] if len(inside) > 1 else 0.0
    statements = inside[-1][1] - inside[0][1] if len(inside) > 1 else 0
    return {"variant": variant, "trickle_rate": rate, "messages": len(committed),
            "statements": statements, "queries_per_s": round(statements / (spent or 1), 1),
            "per_message": round(statements / max(1, len(committed)), 1)}  # fmt: skip


def _percent(value: float | None) -> float | None:
    return None if value is None else round(value / 100, 3)


def summarize(runs: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    values = [run[key] for run in runs if run.get(key) is not None]
    if not values:
        return {}
    return {"median": round(statistics.median(values), 3), "min": min(values),
            "max": max(values), "runs": values}  # fmt: skip


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: some of {', '.join(VARIANTS)}")
    report: dict[str, Any] = {
        "benchmark": "wakeup_latency", "rate": args.rate, "writers": args.writers,
        "seconds": args.seconds, "rounds": args.rounds, "variants": variants,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "table": bench.table, "logs": str(bench.work_dir),
    }  # fmt: skip
    await migrate(bench.db, table=bench.table)
    try:
        latency: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for round_ in range(args.rounds):
            for variant in variants if round_ % 2 == 0 else variants[::-1]:
                run = await bench.latency_run(variant)
                latency[variant].append(run)
                print(json.dumps({"phase": "latency", **run}), file=sys.stderr)
        keys = (
            "p50_ms",
            "p99_ms",
            "max_ms",
            "writer_transaction_ms",
            "relay_cpu_share",
            "relay_sessions_cpu_share",
            "bench_process_cpu_share",
            "machine_busy_share",
        )
        report["latency"] = {
            v: {k: summarize(runs, k) for k in keys} | {"runs": runs} for v, runs in latency.items()
        }
        if args.throughput_seconds > 0:
            tps: dict[str, list[float]] = {v: [] for v in variants}
            for round_ in range(args.rounds):
                for variant in variants if round_ % 2 == 0 else variants[::-1]:
                    run = await bench.throughput_run(variant)
                    tps[variant].append(run["tps"])
                    print(json.dumps({"phase": "throughput", **run}), file=sys.stderr)
            report["writer_tps"] = {v: summarize([{"t": t} for t in ts], "t")
                                    for v, ts in tps.items()}  # fmt: skip
            if "poll" in tps:
                report["writer_tps_vs_poll"] = {
                    v: summarize([{"r": a / b} for a, b in zip(ts, tps["poll"], strict=True)],
                                 "r")
                    for v, ts in tps.items() if v != "poll"
                }  # fmt: skip
        if args.idle_seconds > 0 and bench.postgresql:  # the proxy speaks PostgreSQL
            report["idle"] = {v: await bench.idle_run(v) for v in variants}
            if args.trickle_rate > 0:
                report["trickle"] = {
                    v: await counted_trickle(bench, v, args.trickle_rate) for v in variants
                }
    finally:
        admin = await connect_admin(DatabaseUrl.parse(bench.db))
        try:
            await admin.drop(bench.table)
        finally:
            await admin.close()
        import redis

        client = redis.Redis.from_url(args.redis)
        client.delete(bench.stream)
        client.close()
    report["machine"] = machine()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default=DEFAULT_DB)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--throughput-seconds", type=float, default=10.0)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--trickle-rate", type=float, default=1.0)
    parser.add_argument("--variants", default="poll,wake,window")
    parser.add_argument("--relay-args", default="", help="more `relaybox relay` options")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
