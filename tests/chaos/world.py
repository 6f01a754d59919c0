"""The chaos suite's world: a throwaway database and broker, relay processes behind TCP
proxies, writers that record every outcome, an inbox consumer that applies effects, and
the history the checker reads.

    async with ChaosWorld(tmp_path, Combination("postgresql", "nats"), relays=4) as world:
        writers = world.writers(rate=1000)
        ...faults...
        report = await world.finish(writers)

The database is PostgreSQL, MariaDB or SQLite (`tests.chaos.databases`), the broker
NATS JetStream, Redis Streams or RabbitMQ (`tests.chaos.brokers`), each private.
Writers commit orders and their messages in one transaction straight to the database
(the application's own connection), rolling back one transaction in ten at random; a
transaction whose COMMIT died with the connection is recorded as "unknown". Each key
belongs to one writer, so its write order is its commit order. The relays reach the
database and the broker each through a proxy of their own, which faults can cut (an
SQLite file has no link: its relays open it directly).

On "postgresql-log" the world runs log mode: the table's replication slot is made with
the migration, before any writer; writers emit through `LogOutbox` in the same
transactions (rollbacks included); the relays run `--mode log`, one streaming the slot
while the others stand by (running the table relay for what the stream could not
publish), so a SIGKILL of the streaming one, which every other kill picks there, hands
the slot over. The outbox has drained once the slot's confirmed position has passed a
mark put into the WAL at the end and the table holds no live row.

What was delivered is read back from the broker at the end, in the broker's order (the
order the relays published in), with the broker's timestamp of each message where it
keeps one. Meanwhile the broker's relaybox consumer with an `Inbox` applies each
message's effect (one row in `effects`) in the same transaction as its inbox record:
exactly once is checked there.

Three seams for scenarios the faults here do not make: `ChaosWorld(start_relays=False)`
with `start_relay(slot)` after `world.broker.halt()` starts a relay while its broker is
down; `Relays.targets` names the targets each slot's relay serves (`--broker
NAME=URL`, all on this world's broker); `stall_database(slot)` makes a relay's
database accept connections and never answer.
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
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any

from relaybox import Consumer, Inbox, Incoming, LogOutbox, Message, Outbox
from relaybox.consumers.base import BrokerConsumer
from relaybox.core.log_records import log_slot, parse_lsn
from relaybox.migrations import migrate
from relaybox.storage.pg_log import confirmed_position, create_slot
from tests.chaos.brokers import BROKERS, TOPIC, ChaosBroker
from tests.chaos.checker import Delivered, Report, Written, check
from tests.chaos.cluster import Proxy
from tests.chaos.databases import DATABASES, EFFECTS, ORDERS, ChaosDatabase, Session

RELAYBOX = str(Path(sys.executable).with_name("relaybox"))
PARTITIONS = 16
LEASE = 3.0
#: Inbox consumers, competing on one durable, group or queue.
CONSUMERS = 3
#: A short retry schedule (about 2 s in all), so an outage outlasts it many times over.
RELAY_OPTIONS = [
    "--lease", str(LEASE), "--partitions", str(PARTITIONS), "--batch-size", "200",
    "--idle-interval", "0.2", "--retry-base", "0.2", "--retry-max", "1", "--retry-jitter",
    "0.25", "--max-attempts", "5", "--circuit-threshold", "3", "--circuit-open", "0.5",
    "--circuit-max-open", "2",
    "--publish-timeout", "3", "--shutdown-timeout", "3", "--cleanup-interval", "5",
    "--log-level", "WARNING",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Combination:
    """One database (a key of `DATABASES`) with one broker (a key of `BROKERS`)."""

    database: str
    broker: str

    @property
    def name(self) -> str:
        return f"{self.database}+{self.broker}"


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
        cuts = sum(n for kind, n in kinds.items() if kind.endswith("link cut"))
        lines = [
            f"faults injected: kills={kinds.get('relay SIGKILL', 0)} "
            f"broker_restarts={kinds.get('broker restart', 0)} "
            f"db_restarts={kinds.get('database restart', 0)} cuts={cuts} "
            f"slow_periods={kinds.get('slow broker', 0)}",
            self.report.summary(),
            f"abandoned={len(self.abandoned)} inbox effects applied={self.effects_applied} "
            f"twice={len(self.effects_twice)} ghosts={len(self.effects_ghosts)} "
            f"missing={len(self.effects_missing)}",
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
        self, database: ChaosDatabase, outbox: Outbox | LogOutbox, *, count: int,
        keys_each: int, rate: float,
    ) -> None:  # fmt: skip
        self.written: list[Written] = []
        self.committed_at: dict[str, float] = {}
        self._database, self._outbox, self._rate = database, outbox, rate
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
        session: Session | None = None
        while not self._stop.is_set():
            next_at += interval
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), max(0.0, next_at - time.monotonic()))
            if self._stop.is_set():
                break
            if session is None:
                try:
                    session = await self._database.connect()
                except self._database.errors:
                    await asyncio.sleep(0.2)
                    continue
            batch = [
                Message(topic=TOPIC, key=key, payload={"writer": n, "order": str(uuid.uuid4())})
                for key in rng.choices(keys, k=per_txn)
            ]
            if not await self._transaction(session, batch, rollback=rng.random() < 0.1):
                session = None
        if session is not None:
            await session.close()

    async def _transaction(self, session: Session, batch: list[Message], *, rollback: bool) -> bool:
        """One transaction; False if its connection is to be dropped."""
        mark = self._database.placeholder
        insert = "INSERT INTO orders (id, order_key) VALUES " + ", ".join(
            f"({mark}, {mark})" for _ in batch
        )
        committing = False
        try:
            await session.begin()
            await session.execute(insert, tuple(v for m in batch for v in (str(m.id), m.key)))
            await self._outbox.add_async(session.raw, batch)
            if rollback:
                await session.rollback()
                self._record(batch, "rolled_back")
                return True
            committing = True
            await session.commit()
        except self._database.errors:
            # Died before COMMIT was sent: rolled back. During COMMIT: nobody knows.
            self._record(batch, "unknown" if committing else "rolled_back")
            with contextlib.suppress(*self._database.errors):
                await session.close()
            return False
        now = time.time()
        for m in batch:
            self.committed_at[str(m.id)] = now
        self._record(batch, "committed")
        return True

    def committed_elsewhere(self, batch: list[Message]) -> None:
        """Messages committed by the test itself, to be judged with the rest."""
        now = time.time()
        for m in batch:
            self.committed_at[str(m.id)] = now
        self._record(batch, "committed")

    def _record(self, batch: list[Message], outcome: str) -> None:
        self.written.extend(Written(str(m.id), m.key, outcome) for m in batch)


class Relays:
    """`relaybox relay` processes, each reaching the database and the broker through
    proxies of its own; each is stopped by its PID."""

    def __init__(self, world: ChaosWorld, logs: Path) -> None:
        self._world = world
        self._logs = logs
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.db_proxies: dict[int, Proxy] = {}
        self.broker_proxies: dict[int, Proxy] = {}
        #: The targets each slot's relay serves, by name, each on this world's broker
        #: through the slot's proxy; by default one, "default".
        self.targets: dict[int, list[str]] = {}
        #: Query options added to every relay's database URL (e.g. a command_timeout).
        self.db_options: dict[str, str] = {}
        self.started = 0
        self.killed = 0
        #: Log mode: kills of the relay that was streaming the slot (each a takeover).
        self.stream_kills = 0

    def start(self, slot: int) -> None:
        world = self._world
        if slot not in self.broker_proxies:
            if world.database.port is not None:
                self.db_proxies[slot] = Proxy(world.database.port)
            self.broker_proxies[slot] = Proxy(world.broker.port)
        db_proxy = self.db_proxies.get(slot)
        broker_url = world.broker.relay_url(self.broker_proxies[slot].port)
        targets = dict.fromkeys(self.targets.get(slot, ["default"]), broker_url)
        log = (self._logs / f"relay{slot}-{self.started}.log").open("w")
        db_url = world.database.relay_url(None if db_proxy is None else db_proxy.port)
        options = dict(self.db_options)
        if world.database.log:  # the server names the relay that streams the slot
            options["application_name"] = application_name(slot)
        if options:
            db_url += ("&" if "?" in db_url else "?") + urllib.parse.urlencode(options)
        mode = ["--mode", "log"] if world.database.log else []
        command = [
            RELAYBOX, "relay",
            "--db", db_url,
            "--table", world.table,
            *mode,
            *(arg for name, url in targets.items() for arg in ("--broker", f"{name}={url}")),
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


def application_name(slot: int) -> str:
    return f"chaos-relay{slot}"


async def _bounded(what: str, step: Coroutine[Any, Any, object], seconds: float = 15.0) -> None:
    try:
        async with asyncio.timeout(seconds):
            await step
    except Exception as error:  # noqa: BLE001 - teardown goes on; the test's result stands
        print(f"chaos teardown: could not {what}: {error!r}")


class ChaosWorld:
    def __init__(
        self, workdir: Path, combination: Combination, relays: int = 4, *,
        start_relays: bool = True,
    ) -> None:  # fmt: skip
        self.workdir = workdir
        self.combination = combination
        self.relay_count = relays
        self.table = "chaos_outbox"
        self.database: ChaosDatabase = DATABASES[combination.database]()
        self.broker: ChaosBroker = BROKERS[combination.broker]()
        self.outbox: Outbox | LogOutbox = (
            LogOutbox(table=self.table) if self.database.log else Outbox(table=self.table)
        )
        self.relays = Relays(self, workdir)
        self.faults: list[Fault] = []
        self.effects_applied = 0
        self._start_relays = start_relays
        self._consumers: list[BrokerConsumer] = []
        self._sessions: dict[asyncio.Task[Any] | None, Session] = {}

    async def __aenter__(self) -> ChaosWorld:
        try:
            await self._set_up()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _set_up(self) -> None:
        await asyncio.to_thread(self.database.start)
        await self.broker.start()
        await migrate(self.database.url, table=self.table)
        if self.database.log:  # as `relaybox migrate --log`: the slot before any writer
            await create_slot(self.database.url, self.table)
        await migrate(self.database.url, kind="inbox")
        await asyncio.to_thread(self.database.run, ORDERS)
        await asyncio.to_thread(self.database.run, EFFECTS)
        if self._start_relays:
            for slot in range(self.relay_count):
                await self.start_relay(slot)
        inbox = Inbox(consumer="chaos")
        for _ in range(CONSUMERS):  # competing instances of one durable, group or queue
            consumer = self.broker.consumer(
                Consumer(self._apply, inbox=inbox, transaction=self._transaction)
            )
            await consumer.start()
            self._consumers.append(consumer)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Every step is bounded: a hung step must not keep the servers running.
        for consumer in self._consumers:
            await _bounded("stop an inbox consumer", consumer.stop())
        for session in self._sessions.values():
            await _bounded("close a consumer's connection", session.close())
        await asyncio.to_thread(self.relays.stop_all)
        await _bounded("stop the broker", self.broker.destroy(), 60.0)
        await asyncio.to_thread(self.database.destroy)

    async def start_relay(self, slot: int) -> None:
        await asyncio.to_thread(self.relays.start, slot)

    # -- the inbox side ----------------------------------------------------------------

    async def _apply(self, message: Incoming, conn: Any) -> None:
        # `conn` is the raw connection of this task's session (see `_transaction`).
        session = self._sessions[asyncio.current_task()]
        assert session.raw is conn
        mark = self.database.placeholder
        await session.execute(f"INSERT INTO effects (message_id) VALUES ({mark})", (message.id,))
        self.effects_applied += 1

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Any]:
        # One connection per consumer task (they process one message at a time each),
        # opened again after the database restarts.
        task = asyncio.current_task()
        session = self._sessions.get(task)
        if session is None or not session.usable:
            session = await self.database.connect()
            self._sessions[task] = session
        try:
            await session.begin()
            yield session.raw
            await session.commit()
        except BaseException:
            with contextlib.suppress(*self.database.errors):
                await session.rollback()
            if not session.usable:
                del self._sessions[task]
            raise

    # -- workload and faults -----------------------------------------------------------

    def writers(self, rate: float, count: int = 4, keys_each: int = 25) -> Writers:
        return Writers(self.database, self.outbox, count=count, keys_each=keys_each, rate=rate)

    async def write(self, messages: list[Message]) -> None:
        session = await self.database.connect()
        try:
            await session.begin()
            await self.outbox.add_async(session.raw, messages)
            await session.commit()
        finally:
            await session.close()

    @contextlib.asynccontextmanager
    async def fault(self, kind: str) -> AsyncIterator[None]:
        started, began = time.time(), time.monotonic()
        try:
            yield
        finally:
            self.faults.append(Fault(kind, started, time.monotonic() - began))

    async def kill_relay(self, rng: random.Random) -> None:
        """SIGKILL one relay and start it again; in log mode every other kill, from the
        first, hits the one streaming the slot (waiting a little for one to stream,
        after a fault that stopped them all)."""
        slot = rng.choice(sorted(self.relays.procs))
        if self.database.log:
            hunting = self.relays.killed % 2 == 0
            streaming = await self.streaming_relay(wait=5.0 if hunting else 0.0)
            if streaming is not None and hunting:
                slot = streaming
            self.relays.stream_kills += slot == streaming
        async with self.fault("relay SIGKILL"):
            await asyncio.to_thread(self.relays.kill, slot)
        await self.start_relay(slot)

    async def streaming_relay(self, wait: float = 0.0) -> int | None:
        """Log mode: the slot of the relay streaming the table's replication slot
        (None: none does, after `wait` seconds)."""
        deadline = time.monotonic() + wait
        while True:
            found = await self._query(
                "SELECT a.application_name FROM pg_replication_slots s "
                "JOIN pg_stat_activity a ON a.pid = s.active_pid "
                f"WHERE s.slot_name = '{log_slot(self.table)}'"
            )
            names = {application_name(slot): slot for slot in self.relays.procs}
            streaming = next((names[name] for (name,) in found if name in names), None)
            if streaming is not None or time.monotonic() >= deadline:
                return streaming
            await asyncio.sleep(0.2)

    async def restart_broker(self, down: float = 1.0) -> None:
        async with self.fault("broker restart"):
            await self.broker.halt()
            await asyncio.sleep(down)
            await self.broker.resume()

    async def restart_database(self, down: float = 1.0) -> None:
        async with self.fault("database restart"):
            await asyncio.to_thread(self.database.crash)
            await asyncio.sleep(down)
            await asyncio.to_thread(self.database.start)

    async def cut(self, rng: random.Random, seconds: float) -> None:
        """Cut one relay's link to the broker or to the database (where it has one)."""
        slot = rng.choice(sorted(self.relays.broker_proxies))
        which = rng.choice(["database", "broker"]) if self.relays.db_proxies else "broker"
        proxies = self.relays.db_proxies if which == "database" else self.relays.broker_proxies
        async with self.fault(f"{which} link cut"):
            await asyncio.to_thread(proxies[slot].cut)
            await asyncio.sleep(seconds)
            await asyncio.to_thread(proxies[slot].restore)

    async def stall_database(self, slot: int) -> None:
        """From now on, relay `slot`'s database takes connections and never answers
        (until `self.relays.db_proxies[slot].restore()`)."""
        await asyncio.to_thread(self.relays.db_proxies[slot].stall)

    async def slow_broker(self, delay: float, seconds: float) -> None:
        async with self.fault("slow broker"):
            for proxy in self.relays.broker_proxies.values():
                proxy.delay = delay
            await asyncio.sleep(seconds)
            for proxy in self.relays.broker_proxies.values():
                proxy.delay = 0.0

    # -- the end -----------------------------------------------------------------------

    async def _query(self, query: str) -> list[tuple[Any, ...]]:
        return await asyncio.to_thread(self.database.fetch_all, query)

    async def live_rows(self) -> int:
        live = "status IN ('pending', 'processing', 'failed')"
        ((count,),) = await self._query(f"SELECT count(*) FROM {self.table} WHERE {live}")
        return int(count)

    async def abandoned(self) -> list[tuple[str, str]]:
        found = await self._query(
            f"SELECT {self.database.id_text}, last_error "
            f"FROM {self.table}{self.database.finished_suffix} WHERE status = 'abandoned'"
        )
        return [(str(i), str(error)) for i, error in found]

    async def drained(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        if self.database.log:
            await self._stream_settled(deadline, timeout)
        while await self.live_rows():
            if time.monotonic() > deadline:
                raise AssertionError(f"the outbox did not drain within {timeout:g} s")
            await asyncio.sleep(0.5)

    async def _stream_settled(self, deadline: float, timeout: float) -> None:
        """Log mode: wait until the slot's confirmed position passes a mark put into
        the WAL now (a message of another prefix, which the relays skip): every
        message committed before it was then published or written to the table."""
        ((mark,),) = await self._query(
            "SELECT pg_logical_emit_message(false, 'chaos-mark', '')::text"
        )
        while (await confirmed_position(self.database.url, self.table) or 0) < parse_lsn(mark):
            if time.monotonic() > deadline:
                raise AssertionError(f"the slot did not pass {mark} within {timeout:g} s")
            await asyncio.sleep(0.5)

    async def finish(self, writers: Writers, timeout: float = 180.0) -> Outcome:
        """Stop writing, let everything drain, and judge the history."""
        await writers.stop()
        await self.drained(timeout)
        delivered = await self.broker.delivered()
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
            if stamp is not None:
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
