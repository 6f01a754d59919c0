"""The chaos suite's world: a throwaway PostgreSQL and NATS, relay processes behind TCP
proxies, writers that record every outcome, an inbox consumer that applies effects, and
the history the checker reads.

    async with ChaosWorld(relays=4) as world:
        writers = world.writers(rate=1000)
        ...faults...
        report = await world.finish(writers)

Writers commit orders and their messages in one transaction straight to PostgreSQL
(the application's own connection), rolling back one transaction in ten at random; a
transaction whose COMMIT died with the connection is recorded as "unknown". Each key
belongs to one writer, so its write order is its commit order. The relays reach the
database and the broker each through a proxy of their own, which faults can cut.

What was delivered is read back from the JetStream stream at the end, in stream order
(the order the relays published in), with the server's timestamp of each message.
Meanwhile a `NatsConsumer` with an `Inbox` applies each message's effect (one row in
`effects`) in the same transaction as its inbox record: exactly once is checked there.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import math
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any

import nats
import psycopg
from nats.js.api import StorageType, StreamConfig

from relaybox import Consumer, Inbox, Incoming, Message, Outbox
from relaybox.consumers.nats import NatsConsumer
from relaybox.migrations import migrate
from relaybox.tools.embedded_nats import EmbeddedNats
from tests.chaos.checker import Delivered, Report, Written, check
from tests.chaos.cluster import Proxy, ThrowawayPostgres
from tests.databases import fetch_all

RELAYBOX = str(Path(sys.executable).with_name("relaybox"))
TOPIC = "chaos.orders"
STREAM = "CHAOS"
PARTITIONS = 16
LEASE = 3.0
#: Inbox consumers, competing on one durable.
CONSUMERS = 3
#: The stream refuses messages over this size for good: the poison message's fault.
MAX_MSG_SIZE = 64 * 1024
#: A short retry schedule (about 2 s in all), so an outage outlasts it many times over.
RELAY_OPTIONS = [
    "--lease", str(LEASE), "--partitions", str(PARTITIONS), "--batch-size", "200",
    "--idle-interval", "0.2", "--retry-base", "0.2", "--retry-max", "1", "--retry-jitter",
    "0.25", "--max-attempts", "5", "--circuit-threshold", "3", "--circuit-open", "0.5",
    "--circuit-max-open", "2",
    "--publish-timeout", "3", "--shutdown-timeout", "3", "--cleanup-interval", "5",
    "--log-level", "WARNING",
]  # fmt: skip


@dataclasses.dataclass
class Fault:
    kind: str
    at: float  # wall clock when it began
    seconds: float  # how long the fault lasted
    #: From its end until all that was committed before its end was published.
    recovery: float | None = None


@dataclasses.dataclass
class Outcome:
    report: Report
    abandoned: list[tuple[str, str]]  # (id, last error)
    effects_applied: int
    effects_twice: list[str]
    effects_ghosts: list[str]
    effects_missing: list[str]
    faults: list[Fault]
    published_at: dict[str, float]
    committed_at: dict[str, float]

    @property
    def ok(self) -> bool:
        return self.report.ok and not (
            self.abandoned or self.effects_twice or self.effects_ghosts or self.effects_missing
        )

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for fault in self.faults:
            kinds[fault.kind] = kinds.get(fault.kind, 0) + 1
        lines = [
            self.report.summary(),
            f"abandoned={len(self.abandoned)} effects applied={self.effects_applied} "
            f"twice={len(self.effects_twice)} ghosts={len(self.effects_ghosts)} "
            f"missing={len(self.effects_missing)}",
            "faults: " + (", ".join(f"{k}={n}" for k, n in sorted(kinds.items())) or "none"),
        ]
        for kind in sorted(kinds):
            times = [f.recovery for f in self.faults if f.kind == kind and f.recovery is not None]
            if times:
                times.sort()
                lines.append(
                    f"  recovery after {kind}: median {times[len(times) // 2]:.2f} s, "
                    f"max {times[-1]:.2f} s over {len(times)}"
                )
        return "\n".join(lines)


class Writers:
    """Writer tasks committing orders with their messages at a steady overall rate."""

    def __init__(
        self, url: str, outbox: Outbox, *, count: int, keys_each: int, rate: float
    ) -> None:
        self.written: list[Written] = []
        self.committed_at: dict[str, float] = {}
        self._url, self._outbox, self._rate = url, outbox, rate
        self._stop = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._writer(n, [f"w{n}-k{k}" for k in range(keys_each)], count))
            for n in range(count)
        ]

    @property
    def committed(self) -> int:
        return sum(1 for w in self.written if w.outcome == "committed")

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _writer(self, n: int, keys: list[str], count: int) -> None:
        rng = random.Random(n)
        per_txn = 5
        interval = per_txn * count / self._rate
        next_at = time.monotonic()
        conn: psycopg.AsyncConnection[Any] | None = None
        while not self._stop.is_set():
            next_at += interval
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), max(0.0, next_at - time.monotonic()))
            if self._stop.is_set():
                break
            if conn is None or conn.closed:
                try:
                    conn = await psycopg.AsyncConnection.connect(self._url, connect_timeout=2)
                except psycopg.Error:
                    await asyncio.sleep(0.2)
                    continue
            batch = [
                Message(topic=TOPIC, key=key, payload={"writer": n, "order": str(uuid.uuid4())})
                for key in rng.choices(keys, k=per_txn)
            ]
            await self._transaction(conn, batch, rollback=rng.random() < 0.1)
        if conn is not None:
            await conn.close()

    async def _transaction(
        self, conn: psycopg.AsyncConnection[Any], batch: list[Message], *, rollback: bool
    ) -> None:
        committing = False
        try:
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO orders (id, key) SELECT unnest(%s::text[]), unnest(%s::text[])",
                    ([str(m.id) for m in batch], [m.key for m in batch]),
                )
                await self._outbox.add_async(conn, batch)
                if rollback:
                    raise _Rollback
                committing = True
        except _Rollback:
            self._record(batch, "rolled_back")
        except psycopg.Error:
            # Died before COMMIT was sent: rolled back. During COMMIT: nobody knows.
            self._record(batch, "unknown" if committing else "rolled_back")
            with contextlib.suppress(psycopg.Error):
                await conn.close()
        else:
            now = time.time()
            for m in batch:
                self.committed_at[str(m.id)] = now
            self._record(batch, "committed")

    def committed_elsewhere(self, batch: list[Message]) -> None:
        """Messages committed by the test itself, to be judged with the rest."""
        now = time.time()
        for m in batch:
            self.committed_at[str(m.id)] = now
        self._record(batch, "committed")

    def _record(self, batch: list[Message], outcome: str) -> None:
        self.written.extend(Written(str(m.id), m.key, outcome) for m in batch)


class _Rollback(Exception):
    pass


class Relays:
    """`relaybox relay` processes, each reaching the database and NATS through proxies of
    its own; each is stopped by its PID."""

    def __init__(self, world: ChaosWorld, logs: Path) -> None:
        self._world = world
        self._logs = logs
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.db_proxies: dict[int, Proxy] = {}
        self.broker_proxies: dict[int, Proxy] = {}
        self.started = 0
        self.killed = 0

    def start(self, slot: int) -> None:
        world = self._world
        if slot not in self.db_proxies:
            self.db_proxies[slot] = Proxy(world.pg.port)
            self.broker_proxies[slot] = Proxy(world.nats.port)
        log = (self._logs / f"relay{slot}-{self.started}.log").open("w")
        command = [
            RELAYBOX, "relay", "--db", world.pg.url_via(self.db_proxies[slot].port),
            "--table", world.table,
            "--broker", f"default=nats://127.0.0.1:{self.broker_proxies[slot].port}",
            *RELAY_OPTIONS,
        ]  # fmt: skip
        self.started += 1
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        self.procs[slot] = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "relay <worker> running; targets: default"
        if not line.startswith("relay "):
            raise RuntimeError(f"relay {slot} did not start: {line!r}; see {self._logs}")

    def kill(self, slot: int) -> None:
        proc = self.procs.pop(slot)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        self.killed += 1

    def stop_all(self) -> None:
        self.stop_relays()
        for proxy in (*self.db_proxies.values(), *self.broker_proxies.values()):
            proxy.close()

    def stop_relays(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()


async def _bounded(what: str, step: Coroutine[Any, Any, object], seconds: float = 15.0) -> None:
    try:
        async with asyncio.timeout(seconds):
            await step
    except Exception as error:  # noqa: BLE001 - teardown goes on; the test's result stands
        print(f"chaos teardown: could not {what}: {error!r}")


class ChaosWorld:
    def __init__(self, workdir: Path, relays: int = 4) -> None:
        self.workdir = workdir
        self.relay_count = relays
        self.table = "chaos_outbox"
        self.pg = ThrowawayPostgres()
        self.nats = EmbeddedNats()
        self.outbox = Outbox(table=self.table)
        self.relays = Relays(self, workdir)
        self.faults: list[Fault] = []
        self.effects_applied = 0
        self._consumers: list[NatsConsumer] = []
        self._connections: dict[asyncio.Task[Any] | None, psycopg.AsyncConnection[Any]] = {}
        self._client: nats.aio.client.Client | None = None

    async def __aenter__(self) -> ChaosWorld:
        await asyncio.to_thread(self.pg.start)
        await asyncio.to_thread(self.nats.start)
        await migrate(self.pg.url, table=self.table)
        await migrate(self.pg.url, kind="inbox")
        async with await psycopg.AsyncConnection.connect(self.pg.url, autocommit=True) as conn:
            await conn.execute("CREATE TABLE orders (id text PRIMARY KEY, key text)")
            await conn.execute("CREATE TABLE effects (message_id text NOT NULL)")
        self._client = await nats.connect(
            self.nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2
        )
        stream = StreamConfig(
            name=STREAM, subjects=[TOPIC], storage=StorageType.FILE,
            max_msg_size=MAX_MSG_SIZE, duplicate_window=120.0,
        )  # fmt: skip
        await self._client.jetstream().add_stream(stream)
        for slot in range(self.relay_count):
            await asyncio.to_thread(self.relays.start, slot)
        inbox = Inbox(consumer="chaos")
        for _ in range(CONSUMERS):  # competing instances of one durable
            consumer = NatsConsumer(
                self.nats.url, Consumer(self._apply, inbox=inbox, transaction=self._transaction),
                stream=STREAM, durable="chaos", prefetch=50, ack_wait=10.0, retry_delay=0.2,
                max_retry_delay=2.0, reconnect_wait=0.2,
            )  # fmt: skip
            await consumer.start()
            self._consumers.append(consumer)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Every step is bounded: a hung step must not keep the servers running.
        for consumer in self._consumers:
            await _bounded("stop an inbox consumer", consumer.stop())
        for conn in self._connections.values():
            await _bounded("close a consumer's connection", conn.close())
        if self._client is not None:
            await _bounded("close the NATS client", self._client.close())
        await asyncio.to_thread(self.relays.stop_all)
        await asyncio.to_thread(self.nats.stop)
        await asyncio.to_thread(self.pg.destroy)

    # -- the inbox side ----------------------------------------------------------------

    async def _apply(self, message: Incoming, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects (message_id) VALUES (%s)", (message.id,))
        self.effects_applied += 1

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        # One connection per consumer task (they process one message at a time each),
        # opened again after the database restarts.
        task = asyncio.current_task()
        conn = self._connections.get(task)
        if conn is None or conn.closed or conn.broken:
            conn = await psycopg.AsyncConnection.connect(self.pg.url, connect_timeout=2)
            self._connections[task] = conn
        try:
            async with conn.transaction():
                yield conn
        except psycopg.OperationalError:
            with contextlib.suppress(psycopg.Error):
                await conn.close()
            raise

    # -- workload and faults -----------------------------------------------------------

    def writers(self, rate: float, count: int = 4, keys_each: int = 25) -> Writers:
        return Writers(self.pg.url, self.outbox, count=count, keys_each=keys_each, rate=rate)

    async def write(self, messages: list[Message]) -> None:
        async with await psycopg.AsyncConnection.connect(self.pg.url) as conn:
            await self.outbox.add_async(conn, messages)
            await conn.commit()

    @contextlib.asynccontextmanager
    async def fault(self, kind: str) -> AsyncIterator[None]:
        started, began = time.time(), time.monotonic()
        try:
            yield
        finally:
            self.faults.append(Fault(kind, started, time.monotonic() - began))

    async def kill_relay(self, rng: random.Random) -> None:
        slot = rng.choice(sorted(self.relays.procs))
        async with self.fault("relay SIGKILL"):
            await asyncio.to_thread(self.relays.kill, slot)
        await asyncio.to_thread(self.relays.start, slot)

    async def restart_broker(self, down: float = 1.0) -> None:
        async with self.fault("broker restart"):
            await asyncio.to_thread(self.nats.halt)
            await asyncio.sleep(down)
            await asyncio.to_thread(self.nats.start)

    async def restart_database(self, down: float = 1.0) -> None:
        async with self.fault("database restart"):
            await asyncio.to_thread(self.pg.crash)
            await asyncio.sleep(down)
            await asyncio.to_thread(self.pg.start)

    async def cut(self, rng: random.Random, seconds: float) -> None:
        slot = rng.choice(sorted(self.relays.db_proxies))
        which = rng.choice(["database", "broker"])
        proxy = (self.relays.db_proxies if which == "database" else self.relays.broker_proxies)[
            slot
        ]
        async with self.fault(f"{which} link cut"):
            await asyncio.to_thread(proxy.cut)
            await asyncio.sleep(seconds)
            await asyncio.to_thread(proxy.restore)

    async def slow_broker(self, delay: float, seconds: float) -> None:
        async with self.fault("slow broker"):
            for proxy in self.relays.broker_proxies.values():
                proxy.delay = delay
            await asyncio.sleep(seconds)
            for proxy in self.relays.broker_proxies.values():
                proxy.delay = 0.0

    # -- the end -----------------------------------------------------------------------

    async def _query(self, query: str) -> list[tuple[Any, ...]]:
        return await asyncio.to_thread(fetch_all, self.pg.url, query)

    async def live_rows(self) -> int:
        live = "status IN ('pending', 'processing', 'failed')"
        ((count,),) = await self._query(f"SELECT count(*) FROM {self.table} WHERE {live}")
        return int(count)

    async def abandoned(self) -> list[tuple[str, str]]:
        found = await self._query(
            # Abandoned rows live in the table of finished rows (migration 0007).
            f"SELECT id::text, last_error FROM {self.table}_done WHERE status = 'abandoned'"
        )
        return [(str(i), str(error)) for i, error in found]

    async def drained(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while await self.live_rows():
            if time.monotonic() > deadline:
                raise AssertionError(f"the outbox did not drain within {timeout:g} s")
            await asyncio.sleep(0.5)

    async def delivered(self) -> list[tuple[str, str | None, float]]:
        """(id, key, server timestamp) of every message in the stream, in stream order."""
        assert self._client is not None
        js = self._client.jetstream()
        info = await js.stream_info(STREAM)
        total = info.state.messages
        sub = await js.subscribe(TOPIC, ordered_consumer=True)
        found: list[tuple[str, str | None, float]] = []
        try:
            while len(found) < total:
                msg = await sub.next_msg(timeout=10)
                headers = msg.headers or {}
                stamp = msg.metadata.timestamp.timestamp()
                found.append((headers["ce-id"], headers.get("ce-partitionkey"), stamp))
        finally:
            await sub.unsubscribe()
        return found

    async def finish(self, writers: Writers, timeout: float = 180.0) -> Outcome:
        """Stop writing, let everything drain, and judge the history."""
        await writers.stop()
        await self.drained(timeout)
        delivered = await self.delivered()
        distinct = {d[0] for d in delivered}
        committed = {w.id for w in writers.written if w.outcome == "committed"}
        rolled_back = {w.id for w in writers.written if w.outcome == "rolled_back"}
        # The inbox consumers may lag behind the relays: wait while they make progress.
        effects, stalled_since = await self._effects(), time.monotonic()
        while set(effects) < distinct and time.monotonic() - stalled_since < 30.0:
            await asyncio.sleep(1.0)
            before, effects = len(effects), await self._effects()
            if len(effects) > before:
                stalled_since = time.monotonic()
        report = check(writers.written, (Delivered(i, k) for i, k, _ in delivered))
        published_at: dict[str, float] = {}
        for message_id, _, stamp in delivered:
            published_at.setdefault(message_id, stamp)
        self._recoveries(writers.committed_at, published_at)
        return Outcome(
            report=report,
            abandoned=await self.abandoned(),
            effects_applied=sum(effects.values()),
            effects_twice=sorted(i for i, n in effects.items() if n > 1),
            effects_ghosts=sorted(set(effects) & rolled_back),
            effects_missing=sorted(committed - set(effects)),
            faults=self.faults,
            published_at=published_at,
            committed_at=writers.committed_at,
        )

    async def _effects(self) -> dict[str, int]:
        found = await self._query("SELECT message_id, count(*) FROM effects GROUP BY message_id")
        return {str(i): int(n) for i, n in found}

    def _recoveries(self, committed_at: dict[str, float], published_at: dict[str, float]) -> None:
        """Per fault: from its end until every message committed before its end was
        published (as the broker's timestamps say); None if one never was."""
        order = sorted(committed_at.items(), key=lambda item: item[1])
        times = [at for _, at in order]
        latest: list[float] = []  # latest publication among the first n commits
        for message_id, _ in order:
            published = published_at.get(message_id, math.inf)
            latest.append(max(published, latest[-1]) if latest else published)
        for fault in self.faults:
            ended = fault.at + fault.seconds
            n = bisect.bisect_left(times, ended)
            if n and latest[n - 1] != math.inf:
                fault.recovery = max(0.0, latest[n - 1] - ended)
