"""`Relay`: moves committed messages from one or more outbox tables to brokers.

    async with Relay(["postgresql://..."], {"default": "nats://..."}) as relay:
        relay.attach(outbox)            # in-process commits wake it at once
        await relay.wait_closed()

One `Processor` per database, sharing the publishers and their circuit
breakers, so a broken broker pauses its target in every database at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from relaybox.core.circuit import CircuitBreaker, CircuitState
from relaybox.core.identifiers import DEFAULT_TABLE, validate_table_name
from relaybox.core.ids import instance_name
from relaybox.core.message import Message
from relaybox.core.signals import TargetCounters
from relaybox.errors import ConfigurationError
from relaybox.ports import OperatorStorage, PartitionStorage, Publisher, RowLeaseStorage, Storage
from relaybox.publishers import open_publisher
from relaybox.relay.partition_leases import PartitionLeaseProcessor
from relaybox.relay.processor import Connections, Processor, ProcessorMetrics
from relaybox.relay.row_leases import RowLeaseProcessor
from relaybox.relay.settings import RelaySettings
from relaybox.storage import open_storage
from relaybox.storage.urls import DatabaseUrl

if TYPE_CHECKING:
    from relaybox.storage.memory import MemoryStorage
    from relaybox.storage.pg_listen import Listener
    from relaybox.storage.sql import SqlStorage


logger = logging.getLogger(__name__)

#: A database URL, or a storage object that serves the ports the relay's mode needs.
Database = str | Storage


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
        if isinstance(databases, str | Storage):
            databases = [databases]
        if not databases:
            raise ConfigurationError("a relay needs at least one database")
        if not brokers:
            raise ConfigurationError("a relay needs at least one broker (target name -> URL)")
        self.settings = settings or RelaySettings()
        self.worker = worker or instance_name()
        self.table = validate_table_name(table)
        self._databases = list(databases)
        self._publishers = {
            name: open_publisher(b) if isinstance(b, str) else b for name, b in brokers.items()
        }
        self.circuits = {name: CircuitBreaker(self.settings.circuit) for name in self._publishers}
        self.processors: list[Processor[Any]] = []
        self._opened: list[Storage] = []
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
                processor = await self._processor(f"db{index}", database)
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

    async def _processor(self, name: str, database: Database) -> Processor[Any]:
        """One database's processor, of the mode the settings ask for."""
        common = (self._publishers, self.circuits, self.settings, self.worker,
                  self._stats_connection(database))  # fmt: skip
        if self.settings.partition_leases:
            owned = await self._connect(database, PartitionStorage)
            return PartitionLeaseProcessor(name, owned, *common)
        leased = await self._connect(database, RowLeaseStorage)
        return RowLeaseProcessor(name, leased, *common)

    async def _connect(self, database: Database, port: type[Any]) -> Connections[Any]:
        """Three connections of their own to a database URL; a storage object given
        serves as all three."""
        if isinstance(database, str):
            claims, settles, housekeeping = [await self._open(database) for _ in range(3)]
            return Connections(claims, settles, housekeeping, housekeeping)
        if not isinstance(database, port) or not isinstance(database, OperatorStorage):
            raise ConfigurationError(
                f"{type(database).__name__} does not serve {port.__name__} and "
                "OperatorStorage, which this relay needs"
            )
        return Connections(database, database, database, database)

    def _stats_connection(self, database: Database) -> Callable[[], Awaitable[OperatorStorage]]:
        """A connection of its own for reading the table's counts, opened when first
        asked and closed with the others (a storage given as an object is used as is)."""

        async def opened() -> OperatorStorage:
            if isinstance(database, str):
                return await self._open(database)
            if not isinstance(database, OperatorStorage):
                raise ConfigurationError(f"{type(database).__name__} cannot count its rows")
            return database

        return opened

    async def _listen(self, database: Database, processor: Processor[Any]) -> None:
        """On PostgreSQL, wake on the writers' NOTIFY too (see `notify_channel`)."""
        if not self.settings.listen or not isinstance(database, str):
            return
        if DatabaseUrl.parse(database).dialect != "postgresql":
            return
        from relaybox.storage.pg_listen import listen

        self._listeners.append(await listen(database, self.table, processor.wake))

    async def _open(self, url: str) -> SqlStorage | MemoryStorage:
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
        """Wake on every commit an `Outbox` of this process announces."""
        self._unsubscribe.append(outbox.subscribe(lambda _messages: self.wake()))

    def metrics(self) -> dict[str, ProcessorMetrics]:
        return {p.name: p.metrics for p in self.processors}

    def circuit_states(self) -> dict[str, CircuitState]:
        return {name: circuit.state for name, circuit in self.circuits.items()}

    # -- operational signals: relaybox.observability reads these

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
        for processor in self.processors:
            for target, count in processor.unserved.items():
                problems.append(
                    f"{processor.name}: {count} rows wait for target {target}, "
                    "which no live relay of the table serves"
                )
        for target, state in self.circuit_states().items():
            if state is CircuitState.OPEN:
                problems.append(f"target {target}: circuit open (the broker keeps failing)")
        return problems

    @property
    def database_urls(self) -> list[str | None]:
        """Each database's URL with its password masked (None: a storage given as an
        object), in the order of `processors`."""
        return [
            DatabaseUrl.parse(d).masked if isinstance(d, str) else None for d in self._databases
        ]


class _Subscribable(Protocol):
    def subscribe(self, listener: Callable[[Sequence[Message]], None]) -> Callable[[], None]: ...
