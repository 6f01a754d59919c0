"""`relaybox bench --cross-process`: the writers and the relay in processes of their own.

In one process the relay and the writer share an event loop and a CPU: the writer's
commits slow the relay's claims, and the relay is woken by an in-process call that no
deployment has. Users run `relaybox relay` as a process of its own beside their
application, so this setup measures that: the backlog is written by a writer process,
one or more `relaybox relay` processes (the real CLI) are started on it and stopped by
their PIDs, and the paced writer is another process that commits with `Outbox(notify=
True)`, waking the relays by NOTIFY as an application would.

The relays publish to Redis, and the bench watches the stream they write to: the drain
is timed from starting the relay processes (start-up, partition hand-over and first
claims included, as a user sees it) to the stream holding every message (each XADD's
reply is the relay's confirm, so that is its last confirm, to within a round trip), and
the paced latency is from a writer's commit returning to the bench reading the entry
off the stream (XREAD, so one Redis hop more than the relay's confirm). Both clocks are
CLOCK_MONOTONIC, which every process of the machine shares. Redis is watched, rather
than a recording publisher in the relay, because a watcher costs the relay nothing and
the confirms it sees are a real broker's.

`python -m relaybox.tools.bench_cross fill|paced JSON` is the writer process: it prints
one JSON line on stdout when done.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from relaybox.errors import RelayboxError
from relaybox.publishers.options import BrokerUrl
from relaybox.storage.urls import DatabaseUrl
from relaybox.tools import bench

#: Where `relaybox relay` reads its database URL from (keeps it out of `ps`).
DB_ENV = "RELAYBOX_DB"
#: Brokers whose stream the bench can watch.
WATCHABLE = ("redis", "rediss")
#: Seconds a relay process has to print that it runs, and to stop once signalled.
START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
#: How often the partition owners are sampled during a drain of several relays.
OWNERS_EVERY = 0.1
LIVE_HEAD = "SELECT seq FROM {table} ORDER BY seq LIMIT 1"
OWNERS = (
    "SELECT owner, count(*) FROM {table}_partitions "
    "WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner ORDER BY owner"
)
CROSS_DRAIN_NOTE = (
    "Timed from starting the relay processes to the stream holding every message (Redis "
    "confirmed each XADD); relay_start_seconds: to the last relay printing that it runs; "
    "all_settled_seconds: to the table holding no live row. Commits: xact_commit of this "
    "database from before the relays started until they exited, less the bench's own "
    "probes: they include each relay's whole life (connecting, start-up heartbeats, "
    "empty claims after the drain, leaving)."
)


def require_watchable(broker: str, *, paced_seconds: float) -> None:
    """Redis for the confirms; `noop://` for drains alone (timed to the last settle),
    the database's own limit beside the raw claim-and-delete loop, which publishes
    nothing either."""
    scheme = broker.partition("://")[0]
    if scheme == "noop" and paced_seconds == 0:
        return
    if scheme not in WATCHABLE:
        raise RelayboxError(
            "--cross-process watches the stream the relays publish to: give "
            "--broker redis://HOST:PORT (a Redis the bench can read), or noop:// with "
            "--paced-seconds 0 for drains timed to the last settle"
        )


def watchable(broker: str) -> bool:
    return broker.partition("://")[0] in WATCHABLE


# -- the stream the relays write to ---------------------------------------------------


class StreamWatch:
    """The Redis stream of the bench's topic, read from the bench's side."""

    def __init__(self, broker: str, topic: str) -> None:
        import redis.asyncio as aioredis

        url = BrokerUrl(broker)
        self.key = url.text("prefix", "") + topic
        self._client = aioredis.Redis.from_url(url.base)

    async def count(self) -> int:
        return int(await self._client.xlen(self.key))

    async def reset(self) -> None:
        await self._client.delete(self.key)

    async def arrivals(self, count: int, seen: dict[int, float]) -> None:
        """Read entries as they come until `count` are in `seen` (message number ->
        time.monotonic() when read)."""
        last: Any = "0-0"
        while len(seen) < count:
            replies: Any = await self._client.xread({self.key: last}, count=1000, block=1000)
            now = time.monotonic()
            for _key, entries in replies:
                for entry_id, fields in entries:
                    last = entry_id
                    seen[int(json.loads(fields[b"data"])["n"])] = now

    async def close(self) -> None:
        await self._client.aclose()


# -- relay processes ------------------------------------------------------------------


@dataclasses.dataclass
class RelayProcess:
    process: asyncio.subprocess.Process
    log: Path
    worker: str = ""
    #: The event loop its start-up line names (`uvloop`, `asyncio`).
    loop: str = ""

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def cpu_seconds(self) -> float:
        """utime + stime so far (Linux /proc), 0 where it cannot be read."""
        try:
            with open(f"/proc/{self.process.pid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def relay_command(options: bench.BenchOptions) -> list[str]:
    """`relaybox relay` as a user would start it for this table (the database URL goes
    in the environment, out of `ps`)."""
    command = [sys.executable, "-m", "relaybox", "relay", "--table", options.table,
               "--broker", f"default={options.broker}", "--batch-size", str(options.batch_size),
               "--idle-interval", "1.0", "--log-level", "INFO"]  # fmt: skip
    if options.max_in_flight is not None:
        command += ["--max-in-flight", str(options.max_in_flight)]
    if options.row_leases:
        command.append("--no-partition-leases")
    return command


def byte_compile() -> bool:
    """Byte-compile relaybox's modules where they lie, as installing the package does,
    so that the relay and writer processes start as those of an installed relaybox. A
    checkout installed in editable mode and run with PYTHONDONTWRITEBYTECODE (common in
    containers) would compile every module again at each start: about 0.1 s of CPU per
    process, measured. Whether it worked (a read-only install fails, and is compiled
    already)."""
    import compileall

    import relaybox

    return bool(compileall.compile_dir(Path(relaybox.__file__).parent, quiet=2))


class Fleet:
    """`relaybox relay` processes, each stopped by its PID (SIGTERM, then SIGKILL)."""

    def __init__(self, options: bench.BenchOptions, logs: Path) -> None:
        self.options = options
        self.logs = logs
        self.relays: list[RelayProcess] = []

    async def spawn(self, count: int) -> None:
        env = {**os.environ, DB_ENV: self.options.db}
        for _ in range(count):
            log = self.logs / f"relay-{len(self.relays)}.log"
            with log.open("wb") as err:
                process = await asyncio.create_subprocess_exec(
                    *relay_command(self.options), stdout=asyncio.subprocess.PIPE, stderr=err,
                    stdin=asyncio.subprocess.DEVNULL, env=env,
                )  # fmt: skip
            self.relays.append(RelayProcess(process, log))

    async def running(self) -> None:
        """Wait for each to print `relay <worker> running`; keeps the worker names."""
        await asyncio.wait_for(asyncio.gather(*map(_until_running, self.relays)), START_TIMEOUT)

    def check(self) -> None:
        for relay in self.relays:
            if relay.process.returncode is not None:
                raise RelayboxError(f"relay {relay.worker} exited:\n{relay.tail()}")

    async def stop(self) -> list[int | None]:
        for relay in self.relays:
            if relay.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(relay.process.pid, signal.SIGTERM)
        for relay in self.relays:
            try:
                await asyncio.wait_for(relay.process.wait(), STOP_TIMEOUT)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(relay.process.pid, signal.SIGKILL)
                await relay.process.wait()
        codes = [relay.process.returncode for relay in self.relays]
        self.relays = []
        return codes


async def _until_running(relay: RelayProcess) -> None:
    assert relay.process.stdout is not None
    while True:
        line = (await relay.process.stdout.readline()).decode(errors="replace")
        if not line:
            code = await relay.process.wait()
            raise RelayboxError(f"relay exited ({code}) before running:\n{relay.tail()}")
        words = line.split()
        if len(words) >= 3 and words[0] == "relay" and words[2].rstrip(";") == "running":
            relay.worker = words[1]
            relay.loop = line.rpartition("event loop:")[2].strip()
            return


@contextlib.asynccontextmanager
async def fleet(options: bench.BenchOptions) -> AsyncIterator[Fleet]:
    with tempfile.TemporaryDirectory(prefix="relaybox_bench_") as logs:
        relays = Fleet(options, Path(logs))
        try:
            yield relays
        finally:
            await relays.stop()


# -- writer processes -----------------------------------------------------------------


async def run_writer(options: bench.BenchOptions, job: str, **extra: Any) -> dict[str, Any]:
    """Run `python -m relaybox.tools.bench_cross JOB` and return the JSON it prints."""
    spec = json.dumps({"options": dataclasses.asdict(options), **extra})
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relaybox.tools.bench_cross", job, spec,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out, err = await process.communicate()
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            await process.wait()
    if process.returncode != 0:
        raise RelayboxError(f"writer process ({job}) failed:\n{err.decode(errors='replace')}")
    result: dict[str, Any] = json.loads(out.decode().splitlines()[-1])
    return result


async def _fill_job(options: bench.BenchOptions) -> dict[str, Any]:
    return await bench.write_backlog(options, bench.Workload(options))


async def _paced_job(options: bench.BenchOptions, first: int, count: int) -> dict[str, Any]:
    from relaybox.writer.outbox import Outbox

    admin = await bench.connect_admin(DatabaseUrl.parse(options.db))
    workload = bench.Workload(options)
    messages = [workload.message(first + n) for n in range(count)]
    outbox = Outbox(table=options.table, notify=True)
    connections = 1 if isinstance(admin, bench.SQLiteAdmin) else bench.PACED_WRITERS
    writers = [await admin.writer() for _ in range(connections)]
    try:
        sender = bench.PacedWriter(outbox, writers, options.rate, clock=time.monotonic)
        seconds = await sender.run(messages)
    finally:
        for writer in writers:
            await writer.close()
        await admin.close()
    committed = {first + n: sender.committed[m.id] for n, m in enumerate(messages)}
    return {"seconds": seconds, "max_lag": sender.max_lag, "connections": connections,
            "committed": committed}  # fmt: skip


def _writer_main(argv: list[str]) -> None:
    job, spec = argv[1], json.loads(argv[2])
    options = bench.BenchOptions(**spec["options"])
    if job == "fill":
        result = asyncio.run(_fill_job(options))
    elif job == "paced":
        result = asyncio.run(_paced_job(options, spec["first"], spec["count"]))
    else:
        raise SystemExit(f"unknown job {job!r}")
    print(json.dumps(result), flush=True)


# -- the phases -----------------------------------------------------------------------


async def fill(options: bench.BenchOptions, admin: bench.Admin, *, analyze: bool) -> dict[str, Any]:
    """The backlog, written by a writer process; VACUUM ANALYZE after it if `analyze`."""
    result = await run_writer(options, "fill")
    if analyze:
        await admin.vacuum(options.table)
    return {**result, "writer": "a process of its own", "vacuum_analyze": analyze}


class DrainClock:
    """What a drain of relay processes passed through, and when (seconds from the spawn)."""

    def __init__(self, options: bench.BenchOptions, probe: Any, relays: int) -> None:
        self.started = time.perf_counter()
        self.running_at: float | None = None
        self.first_at: float | None = None
        #: When the oldest row first left the table (a batch settled).
        self.first_settle_at: float | None = None
        #: Each relay's CPU seconds then.
        self.first_settle_cpu: list[float] = []
        self.probes = 0
        self.owners: list[dict[str, Any]] = []
        self._probe = probe
        self._head = LIVE_HEAD.format(table=options.table)
        self._owners_query = OWNERS.format(table=options.table)
        self._watch_owners = probe is not None and relays > 1 and not options.row_leases
        self._next_owners = 0.0
        self._last_owners: list[int] | None = None

    async def prepare(self) -> None:
        """asyncpg prepares each query on first use: before the counters are read."""
        if self._probe is not None:
            await self._probe.fetchval(self._head)
            await self._probe.fetch(self._owners_query)

    def since(self) -> float:
        return time.perf_counter() - self.started

    def note_running(self) -> None:
        if self.running_at is None:
            self.running_at = self.since()

    async def tick(self, confirmed: int, start: asyncio.Task[None]) -> None:
        """Note the first confirm, the relays running, and who holds the partitions."""
        now = self.since()
        if self.first_at is None and confirmed:
            self.first_at = now
        if self.running_at is None and start.done():
            start.result()
            self.running_at = now
        if self._watch_owners and now >= self._next_owners:
            self._next_owners = now + OWNERS_EVERY
            self.probes += 1
            held = [int(n) for _owner, n in await self._probe.fetch(self._owners_query)]
            if held != self._last_owners:
                self.owners.append({"t": round(now, 3), "held": held, "confirmed": confirmed})
                self._last_owners = held

    async def until_settled(self, fleet: Fleet) -> float:
        """Poll the head of the live rows until there is none (rows leave the table as
        they are settled); the seconds since the spawn."""
        if self._probe is not None:
            first = None
            while True:
                self.probes += 1
                head = await self._probe.fetchval(self._head)
                if first is None:
                    first = head
                elif self.first_settle_at is None and head != first:
                    self.first_settle_at = self.since()
                    self.first_settle_cpu = [r.cpu_seconds() for r in fleet.relays]
                if head is None:
                    break
                fleet.check()
                await asyncio.sleep(bench.POLL_SECONDS)
        return self.since()


async def _confirmed(
    options: bench.BenchOptions, watch: StreamWatch, processes: Fleet, clock: DrainClock
) -> None:
    """Wait until the stream holds every message; fail if it stalls or a relay exits."""
    start = asyncio.create_task(processes.running())
    try:
        last, changed = 0, time.monotonic()
        while (done := await watch.count()) < options.messages:
            await clock.tick(done, start)
            processes.check()
            if done != last:
                last, changed = done, time.monotonic()
            elif time.monotonic() - changed > bench.STALL_SECONDS:
                raise RelayboxError(f"drain: stuck at {done} of {options.messages}")
            await asyncio.sleep(bench.POLL_SECONDS)
        await clock.tick(done, start)
        await start
        if clock.running_at is None:
            clock.running_at = clock.since()
    finally:
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError, RelayboxError):
            await start


async def drain(
    options: bench.BenchOptions, admin: bench.Admin, watch: StreamWatch | None, relays: int
) -> dict[str, Any]:
    """Start `relays` relay processes on the backlog, time them to the last confirm and
    to the last settle, then stop them by PID. Without a stream to watch (a noop
    broker) the drain is timed to the last settle."""
    pg = admin if isinstance(admin, bench.PostgresAdmin) else None
    if watch is not None:
        await watch.reset()
    probe = await pg.session() if pg is not None else None
    try:
        clock = DrainClock(options, probe, relays)
        await clock.prepare()
        if pg is not None:
            await asyncio.sleep(bench.STATS_FLUSH_SECONDS)
        before = await pg.reading() if pg is not None else None
        async with fleet(options) as processes:
            cpu, clock.started = bench.CpuMark.now(), time.perf_counter()
            await processes.spawn(relays)
            if watch is not None:
                await _confirmed(options, watch, processes, clock)
                seconds, usage = clock.since(), cpu.usage()
                settled = await clock.until_settled(processes)
            else:
                # When the relays printed that they run, noted as it happens: a short
                # drain is settled before they all have.
                start = asyncio.create_task(processes.running())
                start.add_done_callback(lambda _: clock.note_running())
                settled = await clock.until_settled(processes)
                seconds, usage = settled, cpu.usage()
                await start
            lsn = await pg.wal_lsn() if pg is not None else 0
            relay_cpu = [r.cpu_seconds() for r in processes.relays]
            loops = sorted({r.loop for r in processes.relays})
            codes = await processes.stop()
    finally:
        if probe is not None:
            await probe.close()
    first = clock.first_at
    result: dict[str, Any] = {
        "messages": options.messages, "relays": relays, "seconds": round(seconds, 3),
        "msg_per_s": bench._rate(options.messages, seconds),
        "relay_start_seconds": round(clock.running_at or 0.0, 3),
        "first_confirm_seconds": None if first is None else round(first, 3),
        "msg_per_s_after_first_confirm": (
            None if first is None else bench._rate(options.messages, seconds - first)
        ),
        "all_settled_seconds": round(settled, 3), "claims": None, "cpu": usage,
        "relay_cpu_percent_of_one_core": [round(100 * c / settled, 1) for c in relay_cpu],
        "relay_exit_codes": codes, "relay_event_loops": loops,
    }  # fmt: skip
    if clock.running_at is not None and clock.running_at < seconds:
        # From the relays printing that they run (connected, their first read sent) to
        # the end: the processes' start left out, the first read on a cold table kept in.
        result["msg_per_s_from_running"] = bench._rate(options.messages, seconds - clock.running_at)
    if watch is None and clock.first_settle_at is not None:
        # Publishing nowhere, the first settle stands for the first confirm: the rate
        # after it leaves out the processes' start, as the confirmed rate above does.
        result["first_settle_seconds"] = round(clock.first_settle_at, 3)
        result["msg_per_s_after_first_settle"] = bench._rate(
            options.messages, settled - clock.first_settle_at
        )
        # What the relays' steady work costs, their start left out: CPU from the first
        # settle to the last, over the messages of the drain (as the rate above).
        result["relay_cpu_us_per_message_after_first_settle"] = round(
            1e6 * (sum(relay_cpu) - sum(clock.first_settle_cpu)) / options.messages, 2
        )
    if clock.owners:
        result["partition_owners"] = clock.owners
    if pg is not None and before is not None:
        result.update(await bench._drain_costs(pg, before, lsn, clock.probes, options.messages))
        result["note"] = CROSS_DRAIN_NOTE
    return result


async def idle_and_paced(
    options: bench.BenchOptions, admin: bench.Admin, watch: StreamWatch | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One fresh relay process: its idle load, then the paced writer's latency."""
    pg = admin if isinstance(admin, bench.PostgresAdmin) else None
    async with fleet(options) as processes:
        started = time.perf_counter()
        await processes.spawn(1)
        await processes.running()
        bench.progress(f"idle for {options.idle_seconds:g} s")
        idle = await _idle(options, pg, started)
        processes.check()
        if watch is None:  # a noop broker: nothing to time the paced messages by
            return idle, None
        bench.progress(f"paced: {options.rate:g} msg/s for {options.paced_seconds:g} s")
        paced = await _paced(options, admin, watch)
        processes.check()
    return idle, paced


async def _idle(
    options: bench.BenchOptions, pg: bench.PostgresAdmin | None, started: float
) -> dict[str, Any]:
    settle = bench.IDLE_SETTLE_SECONDS if pg is None else bench.PG_IDLE_FLUSH_SECONDS
    await asyncio.sleep(max(bench.IDLE_SETTLE_SECONDS, started + settle - time.perf_counter()))
    before = await pg.reading() if pg is not None else None
    began = time.perf_counter()
    await asyncio.sleep(options.idle_seconds)
    after = await pg.reading() if pg is not None else None
    seconds = time.perf_counter() - began
    total = rollbacks = None
    if before is not None and after is not None:
        own = after.own_statements - before.own_statements
        total = after.commits + after.rollbacks - before.commits - before.rollbacks - own
        rollbacks = after.rollbacks - before.rollbacks
    return {
        "seconds": round(seconds, 3),
        "queries_per_s": bench._rate(total, seconds) if total is not None else None,
        "transactions": total, "rollbacks": rollbacks,
        "relay_claims": None, "relay_heartbeats": None, "relay_counted_per_s": None,
        "note": bench._idle_note(pg) + " The relay is a process of its own here: what it "
        "counted itself is not read.",
    }  # fmt: skip


async def _paced(
    options: bench.BenchOptions, admin: bench.Admin, watch: StreamWatch
) -> dict[str, Any]:
    count = max(1, round(options.rate * options.paced_seconds))
    await watch.reset()
    seen: dict[int, float] = {}
    reader = asyncio.create_task(watch.arrivals(count, seen))
    cpu = bench.CpuMark.now()
    try:
        written = await run_writer(options, "paced", first=options.messages, count=count)
        await asyncio.wait_for(asyncio.shield(reader), bench.STALL_SECONDS)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    committed = {int(n): t for n, t in written["committed"].items()}
    latencies = [seen[n] - t for n, t in committed.items()]
    return {
        "messages": count, "writer_connections": written["connections"],
        "target_rate": options.rate, "achieved_rate": bench._rate(count, written["seconds"]),
        "max_send_lag_ms": round(written["max_lag"] * 1000, 3),
        "commit_to_confirm": bench.percentiles(latencies), "cpu": cpu.usage(),
        "below_zero": sum(latency < 0 for latency in latencies),
        "note": "writer: a process of its own, Outbox(notify=True) (the relay is woken by "
                "NOTIFY, at most one per 50 ms); latency: from a commit returning in the "
                "writer to the bench reading the entry off the Redis stream. A commit is "
                "visible once the server has made it, before its reply reaches the writer: "
                "a writer process kept off the CPU in between reads its clock late, and "
                "such a message counts below zero (below_zero)",
    }  # fmt: skip


if __name__ == "__main__":
    _writer_main(sys.argv)
