"""Soak run: a steady message rate through PostgreSQL and NATS for a long time.

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--rate 2000] [--batch 20]
        [--keys 100] [--writers 4] [--payload-bytes 100] [--drain-seconds 30]
        [--vacuum-every 60] [--notify] [--relay-args "--batch-size 500"] [--out FILE]

Three processes besides PostgreSQL and NATS, so no one's CPU hides in another's:

- **the relay**: one `relaybox relay` subprocess with default settings (plus
  `--relay-args`), on a fresh table (`soak_<hex>`) of the shared PostgreSQL
  (`RELAYBOX_BENCH_PG`, default postgresql://postgres@127.0.0.1:5432/test), publishing to
  a private NATS server (`relaybox.tools.embedded_nats.EmbeddedNats`) whose JetStream stream
  for the soak's subject exists before the relay starts. This is the process measured.
- **the writers** (`--writers` `multiprocessing` children, 4 by default, so a slow
  COMMIT does not hold up the next transaction): `Outbox.add` of `--batch` messages per
  transaction through psycopg, `--rate / --batch` transactions a second in all;
  transaction i is due at `start + i / tx_rate` on the monotonic clock and written by
  writer i % writers (a late one is sent at once, so the rate does not drift; how late
  the latest was is reported). Message `n` has key `k<n % keys>` and the payload
  `{"n": n, "pad": "x..."}`.
- **this process**: a JetStream ordered push consumer that decodes every delivery with
  `relaybox.consumers.nats.decode` and records its arrival; every 10 s it samples the
  relay's RSS (`VmRSS` in /proc/PID/status), its CPU time, the outbox backlog and size,
  and prints a progress line on stderr. At the end it prints one JSON document on
  stdout (and into `--out`).

**Publish lag** is the consumer's arrival time minus the commit time, both
`time.monotonic()` (CLOCK_MONOTONIC, one clock for every process on Linux). The commit
time is taken in the writers, per transaction, right after `COMMIT` returned, and sent
to this process by transaction number (n // batch), not carried in the payload: a
payload is encoded when the message is built, before its INSERT and COMMIT, so a
timestamp in it would add the transaction's own duration to the lag. The row becomes
visible to the relay at some instant while COMMIT runs, so the lag from COMMIT's return
(`lag_ms`) is a slight *under*-estimate and the lag from COMMIT's start
(`lag_from_commit_start_ms`) an *over*-estimate; both are reported, with the commit's
own duration (`commit_ms`).

**Memory**: samples at 0, 10, 20, ... s after the writer started. The level "after the
first minute" is the sample at 60 s, the level "at the end" the sample when the last
transaction was due; the criterion is |end / first minute - 1| <= 10 %.

**Lost**: committed messages not received `--drain-seconds` after the writers finished
(the wait ends as soon as everything arrived); `outbox_rows_after_drain` tells how many
of them were still in the outbox (late, not gone); `ghosts` are received messages whose
transaction failed; `duplicates` are second arrivals of an id; `out_of_order` counts
arrivals of a key with a lower relaybox sequence than one already received for it
(writers of one key take turns, so sequence order is that key's commit order).

**VACUUM**: if the server runs with `autovacuum = off` (the shared development server
does), this process runs `VACUUM` on the outbox every `--vacuum-every` seconds, as
autovacuum would about once per `autovacuum_naptime` (1 min) on a table with so few live
rows; without it every message leaves dead rows behind and the table grows all run
(~40 MB a minute at 2,000 msg/s). Their durations are reported.

Everything started here is stopped by its PID in `finally` blocks (relay SIGTERM then
SIGKILL, the writers, the NATS server), and the table and its side tables are dropped.
The relay's log is kept in a temporary directory whose path the JSON gives.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import datetime
import json
import math
import multiprocessing
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_URL, cpu_seconds, machine

from relaybox import Message, Outbox, sql
from relaybox.consumers.nats import decode
from relaybox.migrations import migrate
from relaybox.tools.bench import SIDE_TABLES, percentiles
from relaybox.tools.embedded_nats import EmbeddedNats

SAMPLE_SECONDS = 10.0
FIRST_MINUTE = 60.0
RSS_TOLERANCE = 0.10
RELAY_START_SECONDS = 30.0
WRITER_START_SECONDS = 3.0
WRITERS_LATE_SECONDS = 300.0  # how long writers that fell behind may take to finish
RELAY_STOP_SECONDS = 20.0  # > the relay's --shutdown-timeout (10 s)
STREAM_MAX_AGE = 300.0  # the consumer reads live; older messages only fill the disk
NAN = math.nan


# -- the writer process ---------------------------------------------------------------


@dataclass(frozen=True)
class WriterPlan:
    table: str
    subject: str
    db_url: str
    batch: int
    keys: int
    payload_bytes: int
    tx_rate: float
    transactions: int
    start: float  # time.monotonic() at which transaction 0 is due
    notify: bool
    writers: int


def write(plan: WriterPlan, index: int, out: Any, stop: Any) -> None:
    """Commit transactions index, index + writers, ... on schedule; report their times."""
    outbox = Outbox(table=plan.table, notify=plan.notify)
    pad = "x" * plan.payload_bytes
    records: list[tuple[int, float, float]] = []  # tx, COMMIT sent, COMMIT returned (NaN: failed)
    errors: list[str] = []
    behind = 0.0
    flushed = time.monotonic()
    conn = psycopg.connect(plan.db_url)
    try:
        for tx in range(index, plan.transactions, plan.writers):
            if stop.is_set():
                break
            due = plan.start + tx / plan.tx_rate
            now = time.monotonic()
            if now < due:
                time.sleep(due - now)
            else:
                behind = max(behind, now - due)
            first = tx * plan.batch
            messages = [
                Message(topic=plan.subject, key=f"k{n % plan.keys}", type="SoakTick",
                        payload={"n": n, "pad": pad})
                for n in range(first, first + plan.batch)
            ]  # fmt: skip
            try:
                outbox.add(conn, messages)
                sent = time.monotonic()
                conn.commit()
                returned = time.monotonic()
            except psycopg.Error as error:  # counted as not committed: a COMMIT cut off
                errors.append(repr(error))  # in flight may have, and would show as ghosts
                sent = returned = NAN
                conn = _recover(conn, plan.db_url)
            records.append((tx, sent, returned))
            if time.monotonic() - flushed >= 0.5:
                out.put(("commits", records))
                records, flushed = [], time.monotonic()
    finally:
        conn.close()
        out.put(("commits", records))
        out.put(("done", {"behind_schedule_max_s": round(behind, 3),
                          "failed_transactions": len(errors), "errors": errors[:10],
                          "cpu_seconds": round(time.process_time(), 1)}))  # fmt: skip


def _recover(conn: psycopg.Connection[Any], db_url: str) -> psycopg.Connection[Any]:
    """Roll back a failed transaction, or connect again if the connection is gone."""
    if not conn.closed:
        with contextlib.suppress(psycopg.Error):
            conn.rollback()
            return conn
    with contextlib.suppress(psycopg.Error):
        conn.close()
    return psycopg.connect(db_url)


# -- what this process records --------------------------------------------------------


@dataclass
class Commits:
    """Per transaction: when its COMMIT was sent and when it returned (NaN: not yet/failed)."""

    sent: array.array[float]
    returned: array.array[float]
    writers: list[dict[str, Any]] = field(default_factory=list)  # summaries of those done

    @classmethod
    def of(cls, transactions: int) -> Commits:
        return cls(array.array("d", [NAN]) * transactions, array.array("d", [NAN]) * transactions)

    def take(self, out: Any) -> None:
        """Everything the writers have reported so far (never blocks)."""
        while True:
            try:
                kind, body = out.get_nowait()
            except queue.Empty:
                return
            if kind == "done":
                self.writers.append(body)
                continue
            for tx, sent, returned in body:
                self.sent[tx], self.returned[tx] = sent, returned

    def committed(self) -> int:
        return sum(1 for t in self.returned if not math.isnan(t))

    def summary(self) -> dict[str, Any]:
        """The writers' summaries in one."""
        errors = [e for w in self.writers for e in w["errors"]]
        return {
            "processes_done": len(self.writers),
            "behind_schedule_max_s": max((w["behind_schedule_max_s"] for w in self.writers),
                                         default=None),
            "failed_transactions": sum(w["failed_transactions"] for w in self.writers),
            "errors": errors[:10],
            "cpu_seconds": round(sum(w["cpu_seconds"] for w in self.writers), 1),
        }  # fmt: skip


@dataclass
class Receiver:
    """Arrival time per message number, from the JetStream deliveries."""

    arrived: array.array[float]
    count: int = 0
    duplicates: int = 0
    out_of_order: int = 0
    undecodable: int = 0
    window: list[int] = field(default_factory=list)  # numbers received since the last sample
    last_by_key: dict[str | None, int] = field(default_factory=dict)  # highest sequence

    async def on_message(self, message: Any) -> None:
        now = time.monotonic()
        try:
            incoming = decode(message)
            n = int(json.loads(incoming.payload)["n"])
            seen = self.arrived[n]
        except Exception:  # noqa: BLE001 - counted and reported, the soak goes on
            self.undecodable += 1
            return
        if not math.isnan(seen):
            self.duplicates += 1
            return
        self.arrived[n] = now
        self.count += 1
        self.window.append(n)
        sequence = n if incoming.sequence is None else incoming.sequence
        if sequence < self.last_by_key.get(incoming.key, -1):
            self.out_of_order += 1
        else:
            self.last_by_key[incoming.key] = sequence


# -- the relay process ----------------------------------------------------------------


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
        time.sleep(0.1)


def stop_process(process: subprocess.Popen[bytes], grace: float = RELAY_STOP_SECONDS) -> int:
    """SIGTERM, then SIGKILL after `grace` seconds; the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def proc_status(pid: int | None) -> dict[str, int]:
    """VmRSS and VmHWM in KiB."""
    if pid is None:
        return {}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(value.split()[0])
    return found


def log_summary(log_path: Path) -> dict[str, Any]:
    lines = log_path.read_text(errors="replace").splitlines()
    problems = [line for line in lines if " WARNING " in line or " ERROR " in line
                or " CRITICAL " in line or line.startswith("Traceback")]  # fmt: skip
    return {
        "log": str(log_path),
        "log_lines": len(lines),
        "warnings": sum(" WARNING " in line for line in lines),
        "errors": sum(" ERROR " in line or " CRITICAL " in line for line in lines),
        "tracebacks": sum(line.startswith("Traceback") for line in lines),
        "first_problems": [line[:300] for line in problems[:10]],
    }


# -- the database ---------------------------------------------------------------------


async def table_state(conn: psycopg.AsyncConnection[Any], table: str) -> dict[str, int]:
    """Rows still in the outbox (pending or in flight), its size and its dead rows."""
    cursor = await conn.execute(
        f"SELECT (SELECT count(*) FROM {table}), pg_total_relation_size(%s::regclass),"
        " coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = %s::regclass), 0)",
        (table, table),
    )
    backlog, size, dead = await cursor.fetchone() or (0, 0, 0)
    return {"backlog": backlog, "table_kib": size // 1024, "dead_rows": dead}


def drop_tables(db_url: str, table: str) -> None:
    names = ", ".join([table, *(f"{table}_{suffix}" for suffix in SIDE_TABLES)])
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {names}")
        for function in sql.functions("postgresql", table):
            conn.execute(f"DROP FUNCTION IF EXISTS {function}")


# -- the run --------------------------------------------------------------------------


@dataclass
class Run:
    args: argparse.Namespace
    table: str
    subject: str
    transactions: int
    work_dir: Path
    samples: list[dict[str, Any]] = field(default_factory=list)
    relay_command: list[str] = field(default_factory=list)
    relay_exit: int | None = None
    start: float = 0.0
    writing_ended: float = 0.0
    drained: float = 0.0
    autovacuum: str = "?"  # the server's setting
    vacuums: list[float] = field(default_factory=list)  # seconds each manual VACUUM took


async def soak(run: Run) -> dict[str, Any]:
    args = run.args
    server = EmbeddedNats()
    relay: subprocess.Popen[bytes] | None = None
    writers: list[Any] = []
    stop = out = None
    nc: Any = None
    commits = Commits.of(run.transactions)
    receiver = Receiver(array.array("d", [NAN]) * (run.transactions * args.batch))
    migrated = False
    try:
        await asyncio.to_thread(server.start)
        await migrate(PG_URL, table=run.table)
        migrated = True
        nc = await _consume(server.url, run, receiver)
        relay_url = f"{server.url}?name=soak-relay"
        run.relay_command = [str(Path(sys.executable).with_name("relaybox")), "relay",
                             "--db", PG_URL, "--broker", f"default={relay_url}",
                             "--table", run.table, *shlex.split(args.relay_args)]  # fmt: skip
        relay = await asyncio.to_thread(start_relay, run.relay_command, run.work_dir / "relay.log")
        context = multiprocessing.get_context("spawn")
        stop, out = context.Event(), context.Queue()
        run.start = time.monotonic() + WRITER_START_SECONDS  # their interpreters start
        plan = WriterPlan(run.table, run.subject, PG_URL, args.batch, args.keys,
                          args.payload_bytes, args.rate / args.batch, run.transactions,
                          run.start, args.notify, args.writers)  # fmt: skip
        for index in range(args.writers):
            writers.append(context.Process(target=write, args=(plan, index, out, stop),
                                           name=f"soak-writer-{index}"))  # fmt: skip
            writers[-1].start()
        async with await psycopg.AsyncConnection.connect(PG_URL, autocommit=True) as db:
            run.autovacuum = str((await (await db.execute("SHOW autovacuum")).fetchone() or "?")[0])
            vacuuming = asyncio.create_task(_vacuum(run))
            try:
                await _sample_until_end(run, relay, server, db, commits, receiver, out)
                await _drain(run, commits, receiver, out)
            finally:
                vacuuming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await vacuuming
            run.samples.append({"t": round(time.monotonic() - run.start, 1), "drained": True,
                                **await table_state(db, run.table)})  # fmt: skip
        await _finish_writers(writers, stop, out, commits)
        run.relay_exit = stop_process(relay)
        return report(run, commits, receiver, server, relay)
    finally:
        if any(writer.is_alive() for writer in writers):
            await _finish_writers(writers, stop, out, commits)
        if relay is not None and relay.poll() is None:
            run.relay_exit = stop_process(relay)
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        await asyncio.to_thread(server.stop)
        if migrated:
            await asyncio.to_thread(drop_tables, PG_URL, run.table)


async def _consume(url: str, run: Run, receiver: Receiver) -> Any:
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(url, name="soak-consumer", max_reconnect_attempts=-1)
    js = nc.jetstream()
    stream = f"SOAK_{run.table.upper()}"
    await js.add_stream(StreamConfig(name=stream, subjects=[run.subject],
                                     storage=StorageType.FILE, max_age=STREAM_MAX_AGE))  # fmt: skip
    await js.subscribe(run.subject, cb=receiver.on_message, ordered_consumer=True)
    return nc


async def _vacuum(run: Run) -> None:
    """Stand in for autovacuum where the server has it off: without it every message
    leaves dead rows behind and the outbox grows for the whole run. Autovacuum would
    visit this table once per `autovacuum_naptime` (1 min), as its live rows are few."""
    every = run.args.vacuum_every
    if run.autovacuum != "off" or every <= 0:
        return
    async with await psycopg.AsyncConnection.connect(PG_URL, autocommit=True) as conn:
        while True:
            await asyncio.sleep(max(0.0, run.start + (len(run.vacuums) + 1) * every
                                    - time.monotonic()))  # fmt: skip
            began = time.monotonic()
            await conn.execute(f"VACUUM {run.table}")
            run.vacuums.append(time.monotonic() - began)


async def _sample_until_end(
    run: Run, relay: subprocess.Popen[bytes], server: EmbeddedNats,
    db: psycopg.AsyncConnection[Any], commits: Commits, receiver: Receiver, out: Any,
) -> None:  # fmt: skip
    """One sample every SAMPLE_SECONDS from the writer's start to its last transaction."""
    seconds = run.args.minutes * 60
    count = math.ceil(seconds / SAMPLE_SECONDS)
    for k in range(count + 1):
        at = run.start + min(k * SAMPLE_SECONDS, seconds)
        while (left := at - time.monotonic()) > 0:
            commits.take(out)
            await asyncio.sleep(min(left, 0.5))
        commits.take(out)
        sample = await _sample(run, relay, server, db, commits, receiver)
        sample["t"] = round(at - run.start, 1)
        run.samples.append(sample)
        print(progress(sample), file=sys.stderr, flush=True)
        if relay.poll() is not None:
            raise RuntimeError(f"the relay exited with {relay.returncode}; see {run.work_dir}")
    run.writing_ended = time.monotonic()


async def _sample(
    run: Run, relay: subprocess.Popen[bytes], server: EmbeddedNats,
    db: psycopg.AsyncConnection[Any], commits: Commits, receiver: Receiver,
) -> dict[str, Any]:  # fmt: skip
    status = proc_status(relay.pid)
    window, receiver.window = receiver.window, []
    lags = [
        receiver.arrived[n] - commits.returned[n // run.args.batch]
        for n in window
        if not math.isnan(commits.returned[n // run.args.batch])
    ]
    window_lag = percentiles(lags)
    return {
        "rss_kib": status.get("VmRSS"),
        "rss_hwm_kib": status.get("VmHWM"),
        "relay_cpu_s": round(cpu_seconds(relay.pid), 1),
        "nats_rss_kib": proc_status(server.pid).get("VmRSS"),
        "vacuums": len(run.vacuums),
        "written": commits.committed() * run.args.batch,
        "received": receiver.count,
        "window_messages": len(lags),
        "window_lag_p99_ms": window_lag["p99_ms"],
        "window_lag_max_ms": window_lag["max_ms"],
        **await table_state(db, run.table),
    }


def progress(sample: dict[str, Any]) -> str:
    rss = sample["rss_kib"]
    return (
        f"[{sample['t']:6.0f} s] written {sample['written']:>9,}  received "
        f"{sample['received']:>9,}  backlog {sample['backlog']:>6,}  relay RSS "
        f"{(rss or 0) / 1024:7.1f} MiB  CPU {sample['relay_cpu_s']:7.1f} s  "
        f"lag p99/max (10 s) {sample['window_lag_p99_ms']} / {sample['window_lag_max_ms']} ms  "
        f"table {sample['table_kib'] / 1024:.1f} MiB"
    )


async def _drain(run: Run, commits: Commits, receiver: Receiver, out: Any) -> None:
    """Wait for the writers to finish (if they fell behind), then up to `drain_seconds`
    until every committed message arrived."""
    deadline = time.monotonic() + WRITERS_LATE_SECONDS
    while len(commits.writers) < run.args.writers and time.monotonic() < deadline:
        commits.take(out)
        await asyncio.sleep(0.2)
    deadline = time.monotonic() + run.args.drain_seconds
    while time.monotonic() < deadline:
        commits.take(out)
        if receiver.count >= commits.committed() * run.args.batch:
            break
        await asyncio.sleep(0.2)
    commits.take(out)
    run.drained = time.monotonic()


async def _finish_writers(writers: list[Any], stop: Any, out: Any, commits: Commits) -> None:
    """Ask the writers to stop, keep reading their queue (or they cannot exit), then end
    any still running by its pid."""
    stop.set()
    deadline = time.monotonic() + 10
    while any(w.is_alive() for w in writers) and time.monotonic() < deadline:
        commits.take(out)
        await asyncio.sleep(0.2)
    for writer in writers:
        if writer.is_alive():
            writer.terminate()  # SIGTERM
            await asyncio.to_thread(writer.join, 5)
        if writer.is_alive():
            writer.kill()
        await asyncio.to_thread(writer.join)
    commits.take(out)


# -- the report -----------------------------------------------------------------------


def _received(lags: list[float]) -> dict[str, Any]:
    return {"received": len(lags), **percentiles(lags)}


def report(
    run: Run, commits: Commits, receiver: Receiver, server: EmbeddedNats,
    relay: subprocess.Popen[bytes],
) -> dict[str, Any]:  # fmt: skip
    args, batch = run.args, run.args.batch
    lags, upper, commit_times, ghosts, lost, last_commit = [], [], [], 0, 0, run.start
    per_minute: dict[int, list[float]] = {}  # by the minute of the commit
    committed_per_minute: dict[int, int] = {}
    for tx in range(run.transactions):
        returned, sent = commits.returned[tx], commits.sent[tx]
        failed = math.isnan(returned)
        minute = 0
        if not failed:
            commit_times.append(returned - sent)
            last_commit = max(last_commit, returned)
            minute = int((returned - run.start) // 60) + 1
            committed_per_minute[minute] = committed_per_minute.get(minute, 0) + batch
        for n in range(tx * batch, (tx + 1) * batch):
            arrived = receiver.arrived[n]
            if failed:
                ghosts += not math.isnan(arrived)
            elif math.isnan(arrived):
                lost += 1
            else:
                lags.append(arrived - returned)
                upper.append(arrived - sent)
                per_minute.setdefault(minute, []).append(arrived - returned)
    written = len(commit_times) * batch
    seconds = args.minutes * 60
    timed = [s for s in run.samples if "rss_kib" in s and s["rss_kib"] is not None]
    first = next((s["rss_kib"] for s in timed if s["t"] >= FIRST_MINUTE), None)
    end = timed[-1]["rss_kib"] if timed else None
    ratio = end / first if first and end else None
    within = None if ratio is None else abs(ratio - 1) <= RSS_TOLERANCE
    rss_minutes = [{"minute": m, "samples_kib": [s["rss_kib"] for s in timed
                                                 if 60 * (m - 1) < s["t"] <= 60 * m]}
                   for m in range(1, math.ceil(seconds / 60) + 1)]  # fmt: skip
    cpu = round(timed[-1]["relay_cpu_s"] - timed[0]["relay_cpu_s"], 1) if timed else 0.0
    return {
        "benchmark": "soak",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", "benchmarks/soak.py", *sys.argv[1:]]),
        "machine": machine(),
        "settings": {
            "minutes": args.minutes,
            "rate": args.rate,
            "batch": batch,
            "keys": args.keys,
            "payload_bytes": args.payload_bytes,
            "notify": args.notify,
            "drain_seconds": args.drain_seconds,
            "server_autovacuum": run.autovacuum,
            "vacuum_every": args.vacuum_every if run.autovacuum == "off" else None,
            "relay_command": shlex.join(run.relay_command),
        },
        "duration_s": round(run.writing_ended - run.start, 1),
        "written": written,
        "last_commit_s": round(last_commit - run.start, 1),
        "written_rate": round(written / max(last_commit - run.start, 1e-9), 1),
        "received": receiver.count,
        "lost": lost,
        "outbox_rows_after_drain": run.samples[-1].get("backlog") if run.samples else None,
        "ghosts": ghosts,
        "duplicates": receiver.duplicates,
        "out_of_order": receiver.out_of_order,
        "undecodable": receiver.undecodable,
        "drained_after_end_s": round(run.drained - run.writing_ended, 1),
        "writers": commits.summary(),
        "commit_ms": percentiles(commit_times),
        "vacuum_ms": percentiles(run.vacuums) | {"runs": len(run.vacuums)},
        "lag_ms": percentiles(lags),
        "lag_from_commit_start_ms": percentiles(upper),
        "lag_per_minute_ms": [
            {"minute": m, "committed": c, **_received(per_minute.get(m, []))}
            for m, c in sorted(committed_per_minute.items())
        ],
        "rss_start_kib": timed[0]["rss_kib"] if timed else None,
        "rss_per_minute_kib": rss_minutes,
        "rss_first_minute_kib": first,
        "rss_end_kib": end,
        "rss_end_over_first_minute": None if ratio is None else round(ratio, 4),
        "rss_within_10_percent": within,
        "rss_criterion": "n/a" if within is None else ("pass" if within else "fail"),
        "relay": {
            "pid": relay.pid,
            "exit_code": run.relay_exit,
            "rss_peak_kib": timed[-1]["rss_hwm_kib"] if timed else None,
            "cpu_seconds_while_writing": cpu,
            "cpu_percent_of_one_core": round(100 * cpu / seconds, 1),
            **log_summary(run.work_dir / "relay.log"),
        },
        "measurer_cpu_seconds": round(time.process_time(), 1),
        "samples": run.samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=2000.0, help="messages per second")
    parser.add_argument("--batch", type=int, default=20, help="messages per transaction")
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--writers", type=int, default=4, help="writer processes")
    parser.add_argument("--payload-bytes", type=int, default=100, help="padding in the payload")
    parser.add_argument("--drain-seconds", type=float, default=30.0)
    parser.add_argument("--vacuum-every", type=float, default=60.0,
                        help="seconds between VACUUMs of the outbox if the server's "
                        "autovacuum is off (0: never)")  # fmt: skip
    parser.add_argument("--notify", action="store_true", help="Outbox(notify=True)")
    parser.add_argument("--relay-args", default="", help="more `relaybox relay` options")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.minutes * 60 <= FIRST_MINUTE:
        parser.error("--minutes must be more than 1 (the criterion compares with minute 1)")
    transactions = math.ceil(args.minutes * 60 * args.rate / args.batch)
    suffix = uuid.uuid4().hex[:12]
    run = Run(args, table=f"soak_{suffix}", subject=f"soak.{suffix}",
              transactions=transactions,
              work_dir=Path(tempfile.mkdtemp(prefix="relaybox-soak-")))  # fmt: skip
    result = asyncio.run(_main(run))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


async def _main(run: Run) -> dict[str, Any]:
    """`soak`, cancelled (so its clean-up runs) on SIGTERM as on Ctrl-C."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await soak(run)


if __name__ == "__main__":
    main()
