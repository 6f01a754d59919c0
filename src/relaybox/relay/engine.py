"""`Relay`: moves committed messages from one or more outbox tables to brokers.

    async with Relay(["postgresql://..."], {"default": "nats://..."}) as relay:
        relay.attach(outbox)            # in-process commits wake it at once (seed 001)
        await relay.wait_closed()

One `Processor` per database (seed 000), sharing the publishers and their circuit
breakers, so a broken broker pauses its target in every database at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from relaybox.core.circuit import CircuitBreaker, CircuitState
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.ids import instance_name
from relaybox.core.message import Message
from relaybox.core.signals import StatsSample, TargetCounters
from relaybox.errors import ConfigurationError
from relaybox.ports import OutboxStorage, Publisher
from relaybox.publishers import open_publisher
from relaybox.relay.processor import Connections, Processor, ProcessorMetrics
from relaybox.relay.settings import RelaySettings
from relaybox.storage import open_storage
from relaybox.storage.urls import DatabaseUrl

if TYPE_CHECKING:
    from relaybox.storage.pg_listen import Listener

logger = logging.getLogger(__name__)

Database = str | OutboxStorage


class Relay:
    def __init__(
        self,
        databases: Sequence[Database] | Database,
        brokers: Mapping[str, Publisher | str],
        *,
        table: str = DEFAULT_TABLE,
        settings: RelaySettings | None = None,
        worker: str | None = None,
    ) -> None:
        if isinstance(databases, str | OutboxStorage):
            databases = [databases]
        if not databases:
            raise ConfigurationError("a relay needs at least one database")
        if not brokers:
            raise ConfigurationError("a relay needs at least one broker (target name -> URL)")
        self.settings = settings or RelaySettings()
        self.worker = worker or instance_name()
        self.table = table
        self._databases = list(databases)
        self._publishers = {
            name: open_publisher(b) if isinstance(b, str) else b for name, b in brokers.items()
        }
        self.circuits = {name: CircuitBreaker(self.settings.circuit) for name in self._publishers}
        self.processors: list[Processor] = []
        self._opened: list[OutboxStorage] = []
        self._listeners: list[Listener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = asyncio.Event()
        self._stopping = False
        self._unsubscribe: list[Callable[[], None]] = []
        #: time.time() when start() finished (None: not running yet).
        self.started_at: float | None = None
        self._stats_every: float | None = None

    @property
    def publishers(self) -> Mapping[str, Publisher]:
        return self._publishers

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            for publisher in self._publishers.values():
                await publisher.start()
            for index, database in enumerate(self._databases):
                connections = await self._connect(database)
                name = f"db{index}"
                processor = Processor(
                    name, connections, self._publishers, self.circuits, self.settings,
                    self.worker, self._stats_connection(database),
                )  # fmt: skip
                self.processors.append(processor)
                await self._listen(database, processor)
        except BaseException:
            await self._close_resources()
            raise
        for processor in self.processors:
            if self._stats_every is not None:
                processor.sample_stats(self._stats_every)
            processor.start()
        self.started_at = time.time()
        logger.info(
            "relay %s started: %d database(s), targets %s", self.worker, len(self.processors),
            ", ".join(self._publishers), extra={"action": "start"},
        )  # fmt: skip

    async def _connect(self, database: Database) -> Connections:
        if not isinstance(database, str):
            return Connections(database, database, database)
        claims, settles, housekeeping = [await self._open(database) for _ in range(3)]
        return Connections(claims, settles, housekeeping)

    def _stats_connection(self, database: Database) -> Callable[[], Awaitable[OutboxStorage]]:
        """A connection of its own for reading the table's counts, opened when first
        asked and closed with the others (a storage given as an object is used as is)."""

        async def opened() -> OutboxStorage:
            return await self._open(database) if isinstance(database, str) else database

        return opened

    async def _listen(self, database: Database, processor: Processor) -> None:
        """On PostgreSQL, wake on the writers' NOTIFY too (see `notify_channel`)."""
        if not self.settings.listen or not isinstance(database, str):
            return
        if DatabaseUrl.parse(database).dialect != "postgresql":
            return
        from relaybox.storage.pg_listen import listen

        self._listeners.append(await listen(database, self.table, processor.wake))

    async def _open(self, url: str) -> OutboxStorage:
        storage = await open_storage(url, table=self.table)
        self._opened.append(storage)
        return storage

    async def stop(self, timeout: float | None = None) -> None:
        """Stop claiming, finish or release what is in flight, close what we opened."""
        if self._closed.is_set():
            return
        timeout = self.settings.shutdown_timeout if timeout is None else timeout
        self._stopping = True
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        await asyncio.gather(*(p.stop(timeout) for p in self.processors))
        await self._close_resources()
        self._closed.set()
        logger.info("relay %s stopped", self.worker, extra={"action": "stop"})

    async def _close_resources(self) -> None:
        for listener in self._listeners:
            await listener.close()
        self._listeners.clear()
        for publisher in self._publishers.values():
            try:
                await publisher.close()
            except Exception:  # closing must go on for the rest
                logger.exception("closing a publisher failed", extra={"action": "stop"})
        for storage in self._opened:
            await storage.close()
        self._opened.clear()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def wake(self) -> None:
        """Look for work now. Safe to call from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake_all()
        else:
            loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        for processor in self.processors:
            processor.wake()

    def attach(self, outbox: _Subscribable) -> None:
        """Wake on every commit an `Outbox` of this process announces (seed 001)."""
        self._unsubscribe.append(outbox.subscribe(lambda _messages: self.wake()))

    def metrics(self) -> dict[str, ProcessorMetrics]:
        return {p.name: p.metrics for p in self.processors}

    def circuit_states(self) -> dict[str, CircuitState]:
        return {name: circuit.state for name, circuit in self.circuits.items()}

    # -- operational signals (seed 000): relaybox.relay.http and .prometheus read these

    def target_counters(self) -> dict[str, TargetCounters]:
        """Per target, what came of its messages, over every database."""
        totals = {name: TargetCounters() for name in self._publishers}
        for processor in self.processors:
            for name, counters in processor.target_counters.items():
                totals[name] = totals[name].merged(counters)
        return totals

    def sample_stats(self, every: float = 15.0) -> None:
        """Read each table's counts every `every` seconds, for exporters that read the
        last sample when scraped (`RelayCollector`). Off until called: the relay adds
        no query for signals nobody reads."""
        self._stats_every = every
        for processor in self.processors:
            processor.sample_stats(every)

    async def refresh_stats(self, max_age: float = 5.0, wait: float = 2.0) -> None:
        """Read each table's counts again where the last reading is older than
        `max_age` (or than the `sample_stats` interval, if longer), waiting `wait`
        seconds at most (a slow reading finishes later)."""
        max_age = max(max_age, self._stats_every or 0.0)
        await asyncio.gather(
            *(p.refresh_stats(max_age=max_age, wait=wait) for p in self.processors)
        )

    def readiness(self) -> list[str]:
        """Why this relay is not doing its job now; empty when it is."""
        if self.started_at is None or self._closed.is_set():
            return ["the relay is not running"]
        if self._stopping:
            return ["the relay is stopping"]
        problems = []
        now = time.monotonic()
        lease = self.settings.partition_lease_seconds
        for processor in self.processors if self.settings.partition_leases else ():
            if processor.heartbeat_at is None:
                problems.append(f"{processor.name}: no partition heartbeat has succeeded yet")
            elif now - processor.heartbeat_at > lease:
                problems.append(
                    f"{processor.name}: the last partition heartbeat succeeded "
                    f"{now - processor.heartbeat_at:.0f} s ago (the lease is {lease:g} s)"
                )
        for target, state in self.circuit_states().items():
            if state is CircuitState.OPEN:
                problems.append(f"target {target}: circuit open (the broker keeps failing)")
        return problems

    async def status(self, max_age: float = 5.0) -> dict[str, Any]:
        """Every signal as plain data (`GET /api/outbox`): seed 000's four signals
        over all databases, then per database and per target."""
        await self.refresh_stats(max_age=max_age)
        now = time.monotonic()
        databases = {p.name: self._database_status(i, p, now)
                     for i, p in enumerate(self.processors)}  # fmt: skip
        counters = self.target_counters()
        targets = {name: _target_status(counted, self.circuits[name].state)
                   for name, counted in counters.items()}  # fmt: skip
        problems = self.readiness()
        return {
            "worker": self.worker,
            "table": self.table,
            "uptime_seconds": None if self.started_at is None else time.time() - self.started_at,
            "ready": not problems,
            "problems": problems,
            "signals": _signals([p.stats_sample for p in self.processors], counters.values()),
            "databases": databases,
            "targets": targets,
        }

    def _database_status(self, index: int, processor: Processor, now: float) -> dict[str, Any]:
        database = self._databases[index]
        sample = processor.stats_sample
        return {
            "url": DatabaseUrl.parse(database).masked if isinstance(database, str) else None,
            "partitions_held": None if processor.partitions is None else len(processor.partitions),
            "partition_count": self.settings.partitions,
            "batches_in_flight": processor.in_flight,
            "last_heartbeat_seconds_ago": (
                None if processor.heartbeat_at is None else now - processor.heartbeat_at
            ),
            "counters": dataclasses.asdict(processor.metrics),
            "outbox": _sample_status(sample, now),
        }


def _sample_status(sample: StatsSample | None, now: float) -> dict[str, Any] | None:
    if sample is None:
        return None
    stats = sample.stats
    return {
        "counts": None if stats is None else stats.by_status(),
        "oldest_pending_age_seconds": None if stats is None else stats.oldest_pending_age,
        "active_leases": None if stats is None else stats.active_leases,
        "sample_age_seconds": sample.age(now),
        "error": sample.error,
    }


def _target_status(counters: TargetCounters, state: CircuitState) -> dict[str, Any]:
    return {
        "circuit": state.value,
        "acked": counters.acked,
        "retried": counters.retried,
        "abandoned": counters.abandoned,
        "unavailable": counters.unavailable,
        "retry_rate": counters.retry_rate,
        "publish_calls": counters.publish_seconds.count,
        "publish_seconds_total": counters.publish_seconds.sum,
    }


def _signals(
    samples: list[StatsSample | None], targets: Iterable[TargetCounters]
) -> dict[str, Any]:
    """Seed 000's four: pending, failed (waiting for a retry), retry rate, abandoned;
    with the oldest pending age. Counts are None until a table was read."""
    read = [s.stats for s in samples if s is not None and s.stats is not None]
    total = TargetCounters()
    for counters in targets:
        total = total.merged(counters)
    ages = [s.oldest_pending_age for s in read if s.oldest_pending_age is not None]
    counted = bool(read) and len(read) == len(samples)
    return {
        "pending": sum(s.pending for s in read) if counted else None,
        "failed": sum(s.failed for s in read) if counted else None,
        "retry_rate": total.retry_rate,
        "abandoned": sum(s.abandoned for s in read) if counted else None,
        "oldest_pending_age_seconds": max(ages, default=None) if counted else None,
    }


class _Subscribable(Protocol):
    def subscribe(self, listener: Callable[[Sequence[Message]], None]) -> Callable[[], None]: ...
