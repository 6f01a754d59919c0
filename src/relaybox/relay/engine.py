"""`Relay`: moves committed messages from one or more outbox tables to brokers.

    async with Relay(["postgresql://..."], {"default": "nats://..."}) as relay:
        relay.attach(outbox)            # in-process commits wake it at once
        await relay.wait_closed()

One `Processor` per database, sharing the publishers and their circuit
breakers, so a broken broker pauses its target in every database at once.

A broker or database that cannot be reached when the relay starts does not stop it:
the relay runs, `readiness()` says what it waits for, and each one is connected again
in the background, with backoff, until it answers. Meanwhile a target's circuit is
held open (its rows stay pending and burn no attempt) and a database has no processor.
Only what retrying cannot mend fails at once: a bad URL, a missing extra, a missing
schema, a broker that refuses the configuration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from relaybox.core.circuit import CircuitBreaker, CircuitState
from relaybox.core.identifiers import DEFAULT_TABLE, validate_table_name
from relaybox.core.ids import instance_name
from relaybox.core.message import Message
from relaybox.core.retry import RetryPolicy
from relaybox.core.signals import TargetCounters
from relaybox.errors import BrokerUnavailableError, ConfigurationError, StorageOperationalError
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

#: The pauses between connection attempts to a broker or database that is down:
#: doubling from 1 s to 30 s, jittered so that relays started together spread out.
RECONNECT = RetryPolicy(base_delay=1.0, max_delay=30.0, jitter=0.1)

#: What a connection attempt raises when retrying may help; anything else is a
#: configuration to fix, and fails at start.
_UNREACHABLE = (BrokerUnavailableError, StorageOperationalError)


@dataclasses.dataclass
class Unreachable:
    """A broker or database the relay is still trying to connect to."""

    #: What `readiness()` names it by: "target audit", "db0".
    name: str
    #: Why the last attempt failed, naming it (secrets masked).
    error: str
    #: time.monotonic() of the next attempt (None: one is running).
    retry_at: float | None = None

    def describe(self, now: float) -> str:
        if self.retry_at is None:
            return f"{self.error}; trying again now"
        return f"{self.error}; retrying in {max(0.0, self.retry_at - now):.0f} s"


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
        self.circuits = {
            name: CircuitBreaker(self.settings.circuit, on_close=_log_closed(name))
            for name in self._publishers
        }
        self.processors: list[Processor[Any]] = []
        #: What the relay is still connecting to, by target name or database name.
        self.unreachable: dict[str, Unreachable] = {}
        self._reconnecting: set[asyncio.Task[None]] = set()
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

    def wrap_publishers(self, wrap: Callable[[str, Publisher], Publisher]) -> None:
        """Replace each target's publisher by `wrap(target, publisher)`, before `start`.

        How instrumentation (`relaybox.observability.otel`) watches every publish call
        without a branch on the relay's path: a relay nobody wraps runs as it would
        without this method.
        """
        if self._loop is not None:
            raise ConfigurationError("wrap the publishers before the relay starts")
        for target, publisher in list(self._publishers.items()):
            self._publishers[target] = wrap(target, publisher)

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect to each broker and database once; what cannot be reached yet is
        retried in the background. Raises only for what retrying cannot mend."""
        self._loop = asyncio.get_running_loop()
        for circuit in self.circuits.values():  # until its publisher is connected
            circuit.hold()
        try:
            await self._first_attempts()
        except BaseException:
            await self._stop_reconnecting()
            self.processors.clear()
            await self._close_resources()
            raise
        for processor in self.processors:  # all at once, now that none can fail
            self._run(processor)
        self.started_at = time.time()
        logger.info(
            "relay %s started: %d of %d database(s) and %d of %d target(s) connected",
            self.worker, len(self.processors), len(self._databases),
            len(self._publishers) - sum(n.startswith("target ") for n in self.unreachable),
            len(self._publishers), extra={"action": "start"},
        )  # fmt: skip

    async def _first_attempts(self) -> None:
        """One attempt at every broker and database, all at once. The first error that
        retrying cannot mend is raised; what is only unreachable is retried later."""
        names = [f"target {name}" for name in self._publishers]
        names.extend(f"db{index}" for index in range(len(self._databases)))
        attempts = [self._connector(name, run=False)() for name in names]
        results = await asyncio.gather(*attempts, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, _UNREACHABLE):
                raise result
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                self._retry_later(name, result)

    def _connector(self, name: str, *, run: bool = True) -> Callable[[], Awaitable[None]]:
        """What connects `name`: "target X" (its publisher) or "dbN" (its processor,
        started unless `run` is false)."""
        if name.startswith("target "):
            return functools.partial(self._start_publisher, name.removeprefix("target "))
        database = self._databases[int(name.removeprefix("db"))]
        return functools.partial(self._start_database, name, database, run=run)

    async def _start_publisher(self, target: str) -> None:
        await self._publishers[target].start()
        self.circuits[target].release()
        for processor in self.processors:
            processor.reached(target)

    async def _start_database(self, name: str, database: Database, *, run: bool) -> None:
        """Open a database's connections and add its processor, started if `run`; on
        failure, close what this attempt opened."""
        opened: list[Storage] = []
        listening: list[Listener] = []
        made: list[Processor[Any]] = []  # the processor, for the listener's wake-ups
        try:
            # The listener's connection opens beside the storage's three: a fresh
            # relay waited for it before its first heartbeat. A NOTIFY that comes before
            # the processor is made wakes nothing, and needs not: its first read follows.
            processor, _ = await _side_by_side(
                self._processor(name, database, opened),
                self._listen(database, lambda: made[0].hint() if made else None, listening),
            )
        except BaseException:
            for storage in opened:
                await storage.close()
            for listener in listening:
                await listener.close()
            raise
        made.append(processor)
        self._listeners.extend(listening)
        self._opened.extend(opened)
        self.processors.append(processor)
        self.processors.sort(key=lambda p: int(p.name.removeprefix("db")))
        if run:
            self._run(processor)

    def _run(self, processor: Processor[Any]) -> None:
        if self._stats_every is not None:
            processor.sample_stats(self._stats_every)
        processor.start()

    def _retry_later(self, name: str, error: BaseException) -> None:
        """Keep trying to connect `name` in the background until it answers."""
        self.unreachable[name] = Unreachable(name, _describe(name, error, self._databases))
        reconnect = self._reconnect(name, self._connector(name))
        task = asyncio.create_task(reconnect, name=f"relay-connect-{name}")
        self._reconnecting.add(task)
        task.add_done_callback(self._reconnecting.discard)

    async def _reconnect(self, name: str, connect: Callable[[], Awaitable[None]]) -> None:
        """Try `connect` after each of RECONNECT's pauses until it succeeds, logging
        each failure with the wait before the next try. A configuration error found
        only now cannot stop a running relay: it is logged as an error and tried again
        too, so that fixing it is enough."""
        state = self.unreachable[name]
        level, failures = logging.WARNING, 1
        while True:
            delay = RECONNECT.delay(failures)
            state.retry_at = time.monotonic() + delay
            logger.log(
                level, "%s; retrying in %.0f s", state.error, delay,
                extra={"action": "connect_retry", "connecting": name},
            )  # fmt: skip
            await asyncio.sleep(delay)
            state.retry_at = None
            try:
                await connect()
            except Exception as error:  # noqa: BLE001 - the relay runs on; the log says why
                state.error = _describe(name, error, self._databases)
                level = logging.WARNING if isinstance(error, _UNREACHABLE) else logging.ERROR
            else:
                del self.unreachable[name]
                logger.info(
                    "%s: connected", name, extra={"action": "connected", "connecting": name}
                )
                return
            failures += 1

    async def _stop_reconnecting(self) -> None:
        tasks = list(self._reconnecting)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _processor(
        self, name: str, database: Database, opened: list[Storage]
    ) -> Processor[Any]:
        """One database's processor, of the mode the settings ask for; the connections
        it opens are added to `opened`."""
        common = (self._publishers, self.circuits, self.settings, self.worker,
                  self._stats_connection(database))  # fmt: skip
        if self.settings.partition_leases:
            owned = await self._connect(database, PartitionStorage, opened)
            return PartitionLeaseProcessor(name, owned, *common)
        leased = await self._connect(database, RowLeaseStorage, opened)
        return RowLeaseProcessor(name, leased, *common)

    async def _connect(
        self, database: Database, port: type[Any], opened: list[Storage]
    ) -> Connections[Any]:
        """Three connections of their own to a database URL; a storage object given
        serves as all three. The claiming and settling ones run only statements whose
        generic plans are right (held by test), and run them so: none is planned again
        at every call."""
        if isinstance(database, str):
            # Side by side: each is a few round trips (connect, sign in, the schema
            # check), and a fresh relay waits for all three before its first read. Every
            # attempt ends before an error is raised, so `opened` holds all that opened.
            claims, settles, housekeeping = await _side_by_side(
                self._open(database, opened, hot=True), self._open(database, opened, hot=True),
                self._open(database, opened),
            )  # fmt: skip
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
                return await self._open(database, self._opened)
            if not isinstance(database, OperatorStorage):
                raise ConfigurationError(f"{type(database).__name__} cannot count its rows")
            return database

        return opened

    async def _listen(
        self, database: Database, hint: Callable[[], None], into: list[Listener]
    ) -> None:
        """On PostgreSQL, a listener (added to `into`) that calls `hint` on the writers'
        NOTIFY (see `notify_channel`): the processor looks at once, then polls fast for
        a while (`RelaySettings.fast_poll_window`)."""
        if not self.settings.listen or not isinstance(database, str):
            return
        if DatabaseUrl.parse(database).dialect != "postgresql":
            return
        from relaybox.storage.pg_listen import listen

        into.append(await listen(database, self.table, hint))

    async def _open(
        self, url: str, into: list[Storage], *, hot: bool = False
    ) -> SqlStorage | MemoryStorage:
        storage = await open_storage(url, table=self.table, generic_plans=hot)
        into.append(storage)
        return storage

    async def stop(self, timeout: float | None = None) -> None:
        """Stop claiming, finish or release what is in flight, close what we opened."""
        if self._closed.is_set():
            return
        timeout = self.settings.shutdown_timeout if timeout is None else timeout
        self._stopping = True
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        await self._stop_reconnecting()
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

    async def refresh_stats(self, max_age: float | None = None, wait: float = 2.0) -> None:
        """Read each table's counts again where the last reading is older than
        `max_age` seconds (None: the `sample_stats` interval, or 5 s without one),
        waiting `wait` seconds at most (a slow reading finishes later)."""
        if max_age is None:
            max_age = self._stats_every or 5.0
        await asyncio.gather(
            *(p.refresh_stats(max_age=max_age, wait=wait) for p in self.processors)
        )

    def readiness(self) -> list[str]:
        """Why this relay is not doing its job now; empty when it is."""
        if self._loop is None or self._closed.is_set():
            return ["the relay is not running"]
        if self.started_at is None:
            return ["the relay is starting: connecting to its brokers and databases"]
        if self._stopping:
            return ["the relay is stopping"]
        now = time.monotonic()
        problems = [each.describe(now) for each in self.unreachable.values()]
        lease = self.settings.partition_lease_seconds
        # A relay that has reached none of its brokers yet holds no partition (the
        # reasons above say why), so it has no heartbeat to miss.
        reached = any(not circuit.held for circuit in self.circuits.values())
        for processor in self.processors if self.settings.partition_leases and reached else ():
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
            if state is CircuitState.OPEN and f"target {target}" not in self.unreachable:
                problems.append(f"target {target}: circuit open (the broker keeps failing)")
        return problems

    @property
    def database_urls(self) -> dict[str, str | None]:
        """Each database's URL with its password masked (None: a storage given as an
        object), by the name of its processor."""
        return {f"db{index}": _masked(d) for index, d in enumerate(self._databases)}


async def _side_by_side(*steps: Awaitable[Any]) -> list[Any]:
    """Run `steps` at once and return what each returned. Every step ends before the
    first failure is raised, so whatever the others opened is known to the caller."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _masked(database: Database) -> str | None:
    return DatabaseUrl.parse(database).masked if isinstance(database, str) else None


def _describe(name: str, error: BaseException, databases: Sequence[Database]) -> str:
    """Why connecting to `name` failed, naming it; a database's error is the driver's
    own words, so the (masked) URL is added."""
    if name.startswith("target "):
        return f"{name}: {error}"
    url = _masked(databases[int(name.removeprefix("db"))])
    where = f" {url}" if url else ""
    if isinstance(error, StorageOperationalError):
        return f"{name}: cannot connect to the database{where}: {error}"
    return f"{name}: the database{where} failed: {error}"


def _log_closed(target: str) -> Callable[[], None]:
    def closed() -> None:
        logger.info(
            "circuit closed for target %s: the broker answers again", target,
            extra={"action": "circuit_close", "target": target},
        )  # fmt: skip

    return closed


class _Subscribable(Protocol):
    def subscribe(self, listener: Callable[[Sequence[Message]], None]) -> Callable[[], None]: ...
