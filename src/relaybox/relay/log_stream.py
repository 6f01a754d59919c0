"""Log mode: publish what the writers emitted into the WAL, from the table's slot.

`LogRelay` is a `Relay` (the table mode's, unchanged, over the same outbox table) plus
one `LogStreamer` per database. The streamer reads committed transactions from the
table's replication slot (`relaybox.storage.pg_log`) and publishes their messages;
the table relay beside it delivers what the streamer could not.

The streamer works in batches, one at a time: the transactions that arrived (whole
transactions, up to `batch_size` messages), published by `Delivery` as the table relay
publishes a claim (per (target, key) chains, one message of a key per call, the shared
circuit breakers and publish timeout). Whatever the broker did not confirm goes into
the outbox table through the normal insert, in stream order, and from there takes the
table relay's retry path. Only then is the position after the batch confirmed to the
server, so the slot never moves past a message that is neither confirmed by its
broker nor committed to the table. A streamer that stops or crashes before that
leaves the batch unconfirmed, and the next stream sends it again: at least once.

Per-key order. The stream is in commit order, which is the order of a key's messages:
of two transactions that emit messages of one key, the one that commits first comes
first (no key lock is needed, unlike the table's sequence numbers). When one of them
goes to the table, every later message of its key must follow it there, or it would
overtake the one the table relay retries. So the streamer keeps the (target, key)
pairs it knows to have rows in the table as blocked: the rest of a failed message's
chain in the batch goes to the table behind it, and so does any later message of a
blocked key. A blocked key is looked up again when a batch holds a message of it, and
freed once the table holds no row of it (the table relay deletes a row, or moves it to
the done table, only after its broker confirmed it, or when it abandons it, after
which table mode lets the key's next message go too). Every `PRUNE_INTERVAL` seconds
all blocked keys are looked up, so that keys no later message asks about do not pile
up in memory. When a stream starts, every key with a row in the table is blocked:
rows that an earlier streamer wrote may still be there. A message with a delay, or for
a target this relay has no broker for, goes to the table as well (the table relay
honours the delay; another relay may serve that target), and blocks its key likewise.

Writing one table from both modes at once (an `Outbox` and a `LogOutbox` with the same
keys) gives no order between the two: use one mode per table.

The slot: one process streams it at a time. The relay creates the slot (and its
publication) at start if missing, but messages emitted before the slot existed are
lost, so `relaybox migrate --log` should create it before the first writer runs. A
second relay of the table finds the slot busy and stands by, trying again every
`STANDBY_INTERVAL` seconds, so it takes over when the first one stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from relaybox.core.circuit import CircuitBreaker
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.log_records import UnknownFormatError, decode_rows
from relaybox.core.publishing import Outcome, PublishResult
from relaybox.core.records import InsertRow, StoredMessage
from relaybox.core.signals import TargetCounters
from relaybox.errors import (
    ConfigurationError,
    MessageError,
    RelayboxError,
    SchemaError,
    StorageError,
    StorageOperationalError,
)
from relaybox.ports import Publisher
from relaybox.relay.delivery import Delivery, Settlement
from relaybox.relay.engine import RECONNECT, Database, Relay
from relaybox.relay.settings import RelaySettings
from relaybox.storage.pg_log import (
    Committed,
    Event,
    LogStream,
    LogTable,
    SlotBusyError,
    create_slot,
)
from relaybox.storage.rows import headers_of
from relaybox.storage.urls import DatabaseUrl

logger = logging.getLogger(__name__)

#: Seconds between attempts of a relay standing by for a slot another one streams.
STANDBY_INTERVAL = 1.0
#: Seconds a read waits for the stream before the streamer looks at its other duties.
READ_WAIT = 1.0
#: Seconds between looks at whether a status update is due, whatever the stream does.
KEEP_ALIVE_CHECK = 1.0
#: Seconds between looks at every blocked key, so that keys no message asks about
#: again are forgotten once the table holds none of their rows.
PRUNE_INTERVAL = 10.0
#: Keys per look.
PRUNE_CHUNK = 1000
#: Pauses between attempts at writing the messages a batch could not publish.
WRITE_RETRY = (0.1, 0.5, 1.0, 2.0, 5.0)

Pair = tuple[str, str]


@dataclasses.dataclass
class StreamMetrics:
    transactions: int = 0
    published: int = 0
    #: Messages written to the table (failed, delayed, behind a key there, no broker).
    diverted: int = 0
    undecodable: int = 0
    sessions: int = 0


class _StreamDelivery(Delivery):
    """`Delivery`, except that any outcome but a confirm hands the message back, and
    with it the rest of its chain: all of it goes to the table, in order. (Table
    mode lets a key's next message follow an abandoned one; a message the table
    relay will try again must not be overtaken.)"""

    def _settle_one(self, message: StoredMessage, result: PublishResult, out: Settlement) -> bool:
        if result.outcome is Outcome.ACKED:
            out.published.append(message.seq)
            return True
        counters = self.counters[message.target]
        if result.unavailable or result.timed_out:
            counters.unavailable += 1
        else:  # the table relay tries it again
            counters.retried += 1
        out.released.append(message.seq)
        return False


class LogStreamer:
    """Streams one database's slot for a table; see the module's docstring."""

    def __init__(
        self,
        name: str,
        url: str,
        table: str,
        publishers: Mapping[str, Publisher],
        circuits: Mapping[str, CircuitBreaker],
        settings: RelaySettings,
        on_diverted: Callable[[], None] = lambda: None,
    ) -> None:
        self.name = name
        self.table = table
        self.metrics = StreamMetrics()
        self._url = DatabaseUrl.parse(url)
        self._publishers = publishers
        self._settings = settings
        self._delivery = _StreamDelivery(
            publishers, circuits, settings.retry, settings.publish_timeout
        )
        self._on_diverted = on_diverted
        self._blocked: set[Pair] = set()
        self._seq = 0
        self._prune_at = 0.0
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._table: LogTable | None = None  # opened by the first session
        #: True while this relay streams the slot (False: connecting or standing by).
        self.streaming = False
        #: True while another relay streams the slot and this one waits for it.
        self.standing_by = False
        #: Why the last session ended, if it failed (None once streaming).
        self.last_error: str | None = None
        #: The last position confirmed to the server (0: none in this process).
        self.confirmed = 0

    @property
    def target_counters(self) -> Mapping[str, TargetCounters]:
        """Per target, what came of the messages published from the stream."""
        return self._delivery.counters

    @property
    def blocked(self) -> frozenset[Pair]:
        """The (target, key) pairs whose messages go to the table, as last known."""
        return frozenset(self._blocked)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"relay-log-{self.name}")

    async def stop(self, timeout: float) -> None:
        """Finish the batch in hand (its publishes, its writes, its confirm) within
        `timeout`, then close; a batch cut short is sent again by the next stream."""
        self._stopping.set()
        task = self._task
        if task is not None:
            _, busy = await asyncio.wait({task}, timeout=timeout)
            if busy:
                task.cancel()
                await asyncio.wait({task}, timeout=timeout)
        if self._table is not None:
            await self._table.close()
            self._table = None

    # -- sessions -----------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                await self._session()
                failures = 0
                continue
            except RelayboxError as error:
                if isinstance(error, SlotBusyError):
                    if not self.standing_by:
                        logger.info("%s: the slot is streamed by another relay; standing by",
                                    self.name, extra={"action": "log_standby"})  # fmt: skip
                    self.standing_by = True
                    failures = 0  # the server answered: a later failure is a first one
                    delay = STANDBY_INTERVAL
                else:
                    self.last_error = str(error)
                    failures = self._failed(failures)
                    delay = RECONNECT.delay(failures)
                    level = logging.WARNING if isinstance(error, StorageError) else logging.ERROR
                    logger.log(level, "%s: log stream failed (%s); again in %.1f s",
                               self.name, error, delay, extra={"action": "log_stream"})  # fmt: skip
            except Exception as error:  # the stream must outlive a surprise: logged, retried
                self.last_error = f"{type(error).__name__}: {error}"
                failures = self._failed(failures)
                delay = RECONNECT.delay(failures)
                logger.exception("%s: log stream failed; again in %.1f s", self.name, delay,
                                 extra={"action": "log_stream"})  # fmt: skip
            finally:
                self.streaming = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    def _failed(self, failures: int) -> int:
        """The failures in a row, counting the one that just ended a session. A
        session that streamed ended the run before it, so losing it is a first
        failure: the pauses start over from the shortest, rather than growing with
        every connection the relay ever lost until each loss costs the longest."""
        return 1 if self.streaming else failures + 1

    async def _session(self) -> None:
        if self._table is None:
            self._table = await LogTable.connect(self._url, table=self.table)
        table = self._table
        try:
            stream = await LogStream.open(self._url, self.table)
        except SchemaError:  # no slot: make it (what was emitted before it is lost)
            if await create_slot(self._url.url, self.table):
                logger.warning("%s: created the replication slot for %s now; messages "
                               "emitted before it existed were not recorded", self.name,
                               self.table, extra={"action": "log_slot"})  # fmt: skip
            stream = await LogStream.open(self._url, self.table)
        self.metrics.sessions += 1
        try:
            # Rows an earlier streamer wrote may still wait in the table: their keys'
            # messages must follow them.
            self._blocked = await _live_keys(table)
            self.streaming, self.standing_by, self.last_error = True, False, None
            logger.info("%s: streaming %s", self.name, self.table, extra={"action": "log_stream"})
            beat = asyncio.create_task(_keep_alive(stream), name=f"relay-log-beat-{self.name}")
            try:
                await self._serve(stream, table)
            finally:
                beat.cancel()
        finally:
            await stream.close()

    async def _serve(self, stream: LogStream, table: LogTable) -> None:
        limit = self._settings.batch_size
        while not self._stopping.is_set():
            events = await stream.read(READ_WAIT, limit)
            if events:
                await self._settle(events, table)
                stream.confirm(_position(events))
                self.confirmed = stream.confirmed
            if self._blocked and time.monotonic() >= self._prune_at:
                await self._prune(table)

    # -- one batch ----------------------------------------------------------------------

    async def _settle(self, events: Sequence[Event], table: LogTable) -> None:
        """Publish the messages of `events`; write what was not confirmed to the
        table. Returns once every one is confirmed or written."""
        committed = [event for event in events if isinstance(event, Committed)]
        if not committed:
            return
        self.metrics.transactions += len(committed)
        rows = self._rows([content for event in committed for content in event.contents])
        await self._refresh_blocked(rows, table)
        partitions = self._settings.partitions
        direct: list[StoredMessage] = []
        by_seq: dict[int, InsertRow] = {}
        diverted: list[tuple[int, InsertRow]] = []
        blocked = self._blocked
        for row in rows:
            self._seq += 1
            seq, target, key = self._seq, row[1], row[4]
            pair = None if key is None else (target, key)
            if row[15] or target not in self._publishers or pair in blocked:
                diverted.append((seq, row))
                if pair is not None:
                    blocked.add(pair)
                continue
            by_seq[seq] = row
            direct.append(StoredMessage(
                seq, row[0], target, row[2], row[3], key, row[5] % partitions, row[6],
                row[7], row[8], headers_of(row[9]), row[10], row[11], row[12], row[13],
                row[14], 0,
            ))  # fmt: skip
        if direct:
            settlement = Settlement()
            await self._delivery.run(direct, settlement)
            self.metrics.published += len(settlement.published)
            for seq in settlement.released:
                row = by_seq[seq]
                diverted.append((seq, row))
                if row[4] is not None:
                    blocked.add((row[1], row[4]))
        if diverted:
            diverted.sort(key=lambda item: item[0])
            await self._write([_due(row) for _, row in diverted], table)
            self.metrics.diverted += len(diverted)
            self._on_diverted()

    def _rows(self, contents: Sequence[bytes]) -> list[InsertRow]:
        rows: list[InsertRow] = []
        for content in contents:
            try:
                rows.extend(decode_rows(content))
            except UnknownFormatError:
                # A newer writer's message: a newer relay must publish it. Nothing is
                # confirmed past it; the stream stops here and tries again.
                raise
            except MessageError as error:  # no writer of any relaybox wrote it
                self.metrics.undecodable += 1
                logger.error("%s: skipped a log message: %s", self.name, error,
                             extra={"action": "log_decode"})  # fmt: skip
        return rows

    async def _refresh_blocked(self, rows: Sequence[InsertRow], table: LogTable) -> None:
        """Free the blocked keys of `rows` that no longer have a row in the table."""
        blocked = self._blocked
        if not blocked:
            return
        asked = {(row[1], key) for row in rows if (key := row[4]) is not None} & blocked
        if asked:
            await self._unblock(sorted(asked), table)

    async def _prune(self, table: LogTable) -> None:
        """Forget the blocked keys that have no row in the table any more."""
        self._prune_at = time.monotonic() + PRUNE_INTERVAL
        pairs = sorted(self._blocked)
        for start in range(0, len(pairs), PRUNE_CHUNK):
            if not await self._unblock(pairs[start : start + PRUNE_CHUNK], table):
                return

    async def _unblock(self, pairs: list[Pair], table: LogTable) -> bool:
        """Free those of the blocked `pairs` that have no row in the table any more;
        False if the table could not be read (they stay blocked: the safe side)."""
        try:
            live = await table.live_keys(pairs)
        except StorageError as error:
            logger.warning("%s: reading the table's keys failed: %s", self.name, error,
                           extra={"action": "log_keys"})  # fmt: skip
            return False
        self._blocked -= set(pairs) - live
        return True

    async def _write(self, rows: list[InsertRow], table: LogTable) -> None:
        """Insert `rows`, trying again until it works: the slot cannot move past them
        before. A relay told to stop gives up (the next stream sends them again)."""
        attempt = 0
        while True:
            try:
                await table.write(rows)
                return
            except StorageError as error:
                attempt += 1
                logger.warning("%s: writing %d unpublished message(s) to the table failed "
                               "(attempt %d): %s", self.name, len(rows), attempt, error,
                               extra={"action": "log_divert"})  # fmt: skip
                if self._stopping.is_set():
                    raise
                delay = WRITE_RETRY[min(attempt, len(WRITE_RETRY)) - 1]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
                if self._stopping.is_set():
                    raise


async def _live_keys(table: LogTable) -> set[Pair]:
    """Every key with a row in the table, asked twice if the first answer is a lost
    connection: the table's connection outlives the stream's sessions, and when the
    server dropped both (a restart), the first use of the old one is what finds out
    (the storage then drops it, and the second asking opens a new one)."""
    try:
        return await table.live_keys()
    except StorageOperationalError:
        return await table.live_keys()


async def _keep_alive(stream: LogStream) -> None:
    """Send the confirmed position every `pg_log.STATUS_INTERVAL` seconds whatever the
    streamer is doing: a batch may take longer than the server's wal_sender_timeout
    (a slow broker, a key's long chain, the table down), and a server that heard
    nothing for that long drops the stream, which would then bring the same batch
    again, and again."""
    while True:
        await asyncio.sleep(KEEP_ALIVE_CHECK)
        if stream.status_due():
            stream.send_status()


def _position(events: Sequence[Event]) -> int:
    """The position after the last of `events`."""
    return max(event.end_lsn if isinstance(event, Committed) else event.lsn for event in events)


def _due(row: InsertRow) -> InsertRow:
    """`row` as the table takes it now: a delay counts from when the message occurred,
    so what is left of it (the stream may have brought it late)."""
    delay = row[15]
    if not delay:
        return row
    elapsed = (datetime.datetime.now(datetime.UTC) - row[14]).total_seconds()
    return (*row[:15], max(0.0, delay - elapsed))


class LogRelay(Relay):
    """A relay in log mode: streams each PostgreSQL database's slot of the table, and
    runs the table relay beside it for the messages the stream could not publish.

    Databases are PostgreSQL URLs (the stream opens connections of its own)."""

    def __init__(
        self,
        databases: Sequence[Database] | Database,
        brokers: Mapping[str, Publisher | str],
        *,
        table: str = DEFAULT_TABLE,
        settings: RelaySettings | None = None,
        worker: str | None = None,
    ) -> None:
        super().__init__(databases, brokers, table=table, settings=settings, worker=worker)
        for database in self._databases:
            if not isinstance(database, str) or DatabaseUrl.parse(database).dialect != (
                "postgresql"
            ):
                raise ConfigurationError(
                    "log mode streams PostgreSQL's write-ahead log: give PostgreSQL URLs"
                )
        self.streamers: list[LogStreamer] = []

    async def start(self) -> None:
        """Create each database's slot if missing (a database that cannot be reached
        yet is left to its streamer, which keeps trying), start the table relay, then
        the streamers."""
        from relaybox.storage.pg_log import create_slot

        for database in self._databases:
            try:
                await create_slot(str(database), self.table)
            except StorageOperationalError as error:
                logger.warning("cannot reach %s yet: %s", DatabaseUrl.parse(str(database)).masked,
                               error, extra={"action": "log_slot"})  # fmt: skip
        await super().start()
        for index, database in enumerate(self._databases):
            streamer = LogStreamer(
                f"log{index}", str(database), self.table, self.publishers, self.circuits,
                self.settings, on_diverted=self._waker(f"db{index}"),
            )  # fmt: skip
            self.streamers.append(streamer)
            streamer.start()

    def readiness(self) -> list[str]:
        """The table relay's reasons, and each stream that is neither streaming nor
        standing by for another relay of the table."""
        problems = super().readiness()
        if self.started_at is None or problems[:1] == ["the relay is not running"]:
            return problems
        for streamer in self.streamers:
            if not streamer.streaming and not streamer.standing_by:
                why = streamer.last_error or "connecting"
                problems.append(f"{streamer.name}: not streaming the slot: {why}")
        return problems

    def target_counters(self) -> dict[str, TargetCounters]:
        """Per target, over the table relay and the streams."""
        totals = super().target_counters()
        for streamer in self.streamers:
            for name, counters in streamer.target_counters.items():
                totals[name] = totals[name].merged(counters)
        return totals

    def _waker(self, name: str) -> Callable[[], None]:
        def wake() -> None:
            for processor in self.processors:
                if processor.name == name:
                    processor.wake()

        return wake

    async def stop(self, timeout: float | None = None) -> None:
        timeout = self.settings.shutdown_timeout if timeout is None else timeout
        started = time.monotonic()
        await asyncio.gather(*(s.stop(timeout) for s in self.streamers))
        await super().stop(max(0.0, timeout - (time.monotonic() - started)))
