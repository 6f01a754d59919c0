"""One database's relay: claim, publish, settle, with cleanup and the table's counts.

Three connections per database, so that no kind of work waits behind another: one
claims, one settles (and renews), one keeps house (heartbeats, purges). One claiming
connection, not two on half the partitions each: a claim skips every key that a batch
still in flight holds, and halving the keys per connection doubles the skipping.

There are two ways to hold rows while they are published, one subclass each:

- `PartitionLeaseProcessor` (relay/partition_leases.py, the default): the relay holds
  whole partitions by lease, reads their rows without writing, and settles each batch
  in one atomic step fenced by the partitions it still holds.
- `RowLeaseProcessor` (relay/row_leases.py): every relay claims from every partition,
  and each row is leased on its own under a token.

What both share lives here: the claim loop and its pacing, the launch of each batch,
the purge of finished rows, writing the relay's activity for the operator's console
(relay/activity.py), reading the table's counts, and stopping.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, TypeVar

from relaybox.core.circuit import CircuitBreaker, CircuitState
from relaybox.core.records import Claim, OutboxStats
from relaybox.core.signals import StatsSample, TargetCounters
from relaybox.errors import RelayboxError
from relaybox.ports import ActivityStorage, OperatorStorage, Publisher, Storage
from relaybox.relay.activity import ActivityLog
from relaybox.relay.delivery import Delivery
from relaybox.relay.pacing import ClaimPacing
from relaybox.relay.settings import RelaySettings
from relaybox.relay.waker import Waker

logger = logging.getLogger(__name__)

#: Pauses between the tries of a settle that fails (a lost connection is reopened by
#: the next try). After the last, the batch is given up: its rows come back later.
SETTLE_RETRY_DELAYS = (0.05, 0.2, 0.8, 3.2)

#: After the shutdown timeout, how long cancelled batches may take to record what was
#: confirmed, and then how long giving the partitions back may take.
STOP_GRACE = 2.0

P = TypeVar("P", bound=Storage)
R = TypeVar("R")


@dataclasses.dataclass
class ProcessorMetrics:
    claims: int = 0
    claimed: int = 0
    published: int = 0
    failed: int = 0
    abandoned: int = 0
    released: int = 0
    leases_lost: int = 0
    heartbeats: int = 0
    purged: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Connections(Generic[P]):
    """A processor's connections, each as the port of its job."""

    claims: P
    settles: P
    housekeeping: P
    #: The housekeeping connection, as what it is to an operator (the purge).
    upkeep: OperatorStorage


class Processor(abc.ABC, Generic[P]):
    def __init__(
        self,
        name: str,
        connections: Connections[P],
        publishers: Mapping[str, Publisher],
        circuits: Mapping[str, CircuitBreaker],
        settings: RelaySettings,
        worker: str,
        stats_connection: Callable[[], Awaitable[OperatorStorage]],
    ) -> None:
        self.name = name
        self.worker = worker
        self.metrics = ProcessorMetrics()
        #: The partitions this relay holds, per target (None: every one, leasing rows
        #: instead).
        self.partitions: Mapping[str, frozenset[int]] | None = None
        self._db = connections
        self._publishers = publishers
        self._targets = sorted(publishers)
        self._circuits = circuits
        self._settings = settings
        self._probe_in: float | None = None
        self._waker = Waker(
            settings.min_poll_interval,
            settings.idle_interval,
            fast_interval=settings.fast_poll_interval,
            fast_window=settings.fast_poll_window,
        )
        #: Batches in flight at most.
        self.max_in_flight = settings.in_flight_limit(self._reads_behind_in_flight())
        #: Batches in flight at most for now: `max_in_flight`, or fewer while this relay
        #: is one of a fleet (`RelaySettings.in_flight_share`). The claim loop, the only
        #: one to launch batches, counts those in flight (`_deliveries`) against it.
        self.in_flight_now = self.max_in_flight
        self._delivery = Delivery(
            publishers, circuits, settings.retry, settings.publish_timeout,
            hold_keys=settings.hold_keys,
        )  # fmt: skip
        self._deliveries: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._pacing = ClaimPacing(settings.batch_size)
        self._settled = asyncio.Event()
        #: Set while claims may run (a partition-lease relay waits for its partitions).
        self._claiming = asyncio.Event()
        self._claiming.set()
        #: The table's counts as last read (see `refresh_stats`); None until asked.
        self.stats_sample: StatsSample | None = None
        self._stats_reading: asyncio.Task[None] | None = None
        #: Seconds between readings of the counts; 0: none unless asked.
        self._stats_every = 0.0
        #: Opens the connection the counts are read on, when first asked: not the
        #: housekeeping one, where a count over a large table would hold up heartbeats.
        self._open_stats = stats_connection
        self._stats_storage: OperatorStorage | None = None
        #: Rows waiting per target that no live relay of the table serves, as last
        #: counted (a relay holding partitions finds them; see `_counted`).
        self.unserved: dict[str, int] = {}
        #: Where the activity is written: the housekeeping connection, if its storage
        #: keeps activity.
        upkeep = connections.upkeep
        self._activity_store = upkeep if isinstance(upkeep, ActivityStorage) else None
        self._activity_log = ActivityLog()

    # -- what each way of holding rows supplies ---------------------------------------

    @abc.abstractmethod
    async def _claim(self, targets: list[str]) -> Claim | None:
        """Rows to publish next for `targets` (None: nothing may be claimed now)."""

    @abc.abstractmethod
    async def _deliver(self, claim: Claim) -> None:
        """Publish `claim` and record what came of it."""

    def _reads_behind_in_flight(self) -> bool:
        """Whether this way of holding rows reads the rows queued behind those in
        flight in their keys (it sets how many batches go in flight by default)."""
        return False

    def _tasks_of_mode(self) -> list[asyncio.Task[None]]:
        """Tasks this way of holding rows runs beside the claim loop."""
        return []

    def _launched(self, claim: Claim) -> None:
        """`claim` is on its way to the brokers."""

    def _finished(self, claim: Claim) -> None:
        """`claim` is settled (or given up)."""

    async def _left(self) -> None:
        """The processor stopped: give back what it holds."""

    @property
    def heartbeat_at(self) -> float | None:
        """time.monotonic() of the last heartbeat that renewed the partitions (None:
        not yet, or rows leased one by one)."""
        return None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._claim_loop(), name=f"relay-claims-{self.name}")]
        self._tasks.extend(self._tasks_of_mode())
        self._tasks.append(asyncio.create_task(self._cleanup_loop()))
        if self._activity_store is not None and self._settings.activity_interval is not None:
            self._tasks.append(asyncio.create_task(self._activity_loop()))
        if self._stats_every:
            self._tasks.append(asyncio.create_task(self._stats_loop()))

    def wake(self) -> None:
        self._waker.wake()

    def reached(self, target: str) -> None:
        """The broker of `target` was reached just now (the engine's call)."""
        self.wake()

    def hint(self) -> None:
        """Rows may have been committed and more may follow unannounced (a writer's
        NOTIFY): look now, then fast for `fast_poll_window` (see `relay.waker`)."""
        self._waker.hint()

    @property
    def polling_fast(self) -> bool:
        """Whether the fast window is open (`RelaySettings.fast_poll_window`)."""
        return self._waker.fast

    @property
    def partitions_held(self) -> int | None:
        """How many partitions this relay holds, over its targets (None: it leases rows)."""
        if self.partitions is None:
            return None
        return sum(len(held) for held in self.partitions.values())

    @property
    def in_flight(self) -> int:
        """Claimed batches being published or settled now."""
        return len(self._deliveries)

    @property
    def target_counters(self) -> dict[str, TargetCounters]:
        return self._delivery.counters

    async def stop(self, timeout: float) -> None:
        """Stop claiming; let in-flight batches finish for `timeout`, then cancel them
        and what else runs. A cancelled batch records what its brokers confirmed and
        hands back the rest, within STOP_GRACE; then the partitions are given back,
        within STOP_GRACE too. Nothing waits longer on a database or broker that froze:
        what is still stuck is cancelled again, and its rows come back later."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._stopping.set()
        self.wake()
        self._claiming.set()
        self._settled.set()
        # The claim loop ends after the claim it may be running (whose batch it launches,
        # so the batch is settled or released below), or when it next wakes.
        claim_loop = self._tasks[:1]
        if claim_loop:
            await asyncio.wait(claim_loop, timeout=timeout)
        while self._deliveries and loop.time() < deadline:
            await asyncio.wait(set(self._deliveries), timeout=deadline - loop.time())
        reading = [self._stats_reading] if self._stats_reading is not None else []
        running = {*self._deliveries, *self._tasks, *reading}
        for task in running:
            task.cancel()
        await _end(running, STOP_GRACE)
        await self._last_activity()
        try:
            async with asyncio.timeout(STOP_GRACE):
                await self._left()
        except TimeoutError:
            logger.warning(
                "gave up giving the partitions back after %g s; they expire instead",
                STOP_GRACE, extra={"action": "stop"},
            )  # fmt: skip

    # -- the table's counts, for the operational signals ----------------------------

    async def refresh_stats(self, *, max_age: float, wait: float) -> StatsSample | None:
        """Read the table's counts again if the last reading is older than `max_age`,
        waiting for it at most `wait` seconds. A reading that takes longer goes on in
        the background (a caller that stops waiting does not cancel it; stop() does)
        and the older sample stays meanwhile."""
        sample = self.stats_sample
        age = None if sample is None else sample.age(time.monotonic())
        if sample is not None and age is not None and age < max_age and sample.error is None:
            return sample
        if self._stopping.is_set():
            return sample
        reading = self._stats_reading
        if reading is None or reading.done():
            reading = self._stats_reading = asyncio.create_task(self._read_stats())
        await asyncio.wait({reading}, timeout=wait)
        return self.stats_sample

    async def _read_stats(self) -> None:
        try:
            if self._stats_storage is None:
                self._stats_storage = await self._open_stats()
            stats = await self._stats_storage.stats()
        except RelayboxError as error:
            last = self.stats_sample
            self.stats_sample = StatsSample(
                last.stats if last else None, last.taken_at if last else None, str(error)
            )
            logger.warning("reading the outbox counts failed: %s", error,
                           extra={"action": "stats"})  # fmt: skip
        else:
            self.stats_sample = StatsSample(stats, time.monotonic())
            self._counted(stats)

    def _counted(self, stats: OutboxStats) -> None:
        """The table's counts were just read."""

    def sample_stats(self, every: float) -> None:
        """Read the table's counts every `every` seconds from now on (for exporters
        that read `stats_sample` between scrapes)."""
        if not every > 0:
            raise ValueError("sample the counts every so many seconds, more than 0")
        first = not self._stats_every
        self._stats_every = every
        if first and self._tasks:  # started already (else start() launches it)
            self._tasks.append(asyncio.create_task(self._stats_loop()))

    async def _stats_loop(self) -> None:
        while not self._stopping.is_set():
            await self.refresh_stats(max_age=0.0, wait=self._stats_every)
            await self._sleep(self._stats_every)

    # -- claiming --------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        waker, pacing = self._waker, self._pacing
        while not self._stopping.is_set():
            await waker.wait()
            await self._claiming.wait()
            if self._stopping.is_set():
                return
            if len(self._deliveries) >= self.in_flight_now or pacing.wait_for_a_settle(
                bool(self._deliveries)
            ):
                self._settled.clear()
                await self._settled.wait()
                continue
            beside = pacing.beside(bool(self._deliveries))
            try:
                claim = await self._next_claim()
            except RelayboxError as error:
                logger.warning("claim failed: %s", error, extra={"action": "claim_error"})
                waker.found_nothing(looked=False)
                continue
            except Exception:  # a surprise: logged, and the next claim comes after a pause
                logger.exception("claim failed", extra={"action": "claim_error"})
                waker.found_nothing(looked=False)
                continue
            if claim is None or not claim.messages:
                waker.found_nothing(looked=claim is not None)
                if claim is not None:
                    pacing.found_nothing(beside=beside)
            else:
                pacing.took(claim.messages, len(claim.messages), beside=beside)
                waker.found_work(more=pacing.full)
                self._launch(claim)
            if self._probe_in is not None:  # come back when an open circuit may be probed
                waker.wait_at_most(self._probe_in)

    async def _next_claim(self) -> Claim | None:
        targets = self._claimable_targets()
        if not targets:
            return None
        claim = await self._claim(targets)
        if claim is not None:
            self.metrics.claims += 1
            self.metrics.claimed += len(claim.messages)
        return claim

    def _claimable_targets(self) -> list[str]:
        """Targets whose circuit is not open (a half-open one is probed on delivery)."""
        targets = []
        self._probe_in = None
        for target in self._targets:
            circuit = self._circuits[target]
            state = circuit.state
            if state is CircuitState.CLOSED or (
                state is CircuitState.HALF_OPEN and not circuit.probing
            ):
                targets.append(target)
                continue
            if state is CircuitState.HALF_OPEN:  # a probe is out: wait for its answer
                self._probe_in = self._settings.min_poll_interval
                continue
            wait = max(circuit.seconds_until_probe(), self._settings.min_poll_interval)
            self._probe_in = min(self._probe_in or wait, wait)
        return targets

    def _launch(self, claim: Claim) -> None:
        self._launched(claim)
        task = asyncio.create_task(self._deliver(claim))
        self._deliveries.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            self._finished(claim)
            self._deliveries.discard(finished)
            self._pacing.settled()
            self._settled.set()
            self.wake()  # room in flight: there may be more to claim

        task.add_done_callback(done)

    async def _with_retries(self, kind: str, step: Callable[[], Awaitable[R]]) -> R | None:
        """Run a settle step, trying again after each pause of SETTLE_RETRY_DELAYS; what
        it returned, or None if it could not be recorded (nothing is lost: the rows come
        back to be published again)."""
        for attempt, delay in enumerate((*SETTLE_RETRY_DELAYS, None)):
            try:
                return await step()
            except RelayboxError as error:
                logger.warning(
                    "settle %s failed (attempt %d): %s", kind, attempt + 1, error,
                    extra={"action": "settle_error"},
                )  # fmt: skip
                if delay is not None:
                    await asyncio.sleep(delay)
        return None

    # -- housekeeping ----------------------------------------------------------------

    async def _cleanup_loop(self) -> None:
        settings = self._settings
        while not self._stopping.is_set():
            await self._sleep(settings.cleanup_interval)
            if self._stopping.is_set():
                return
            try:  # (expired row leases need no sweep: every claim takes them back)
                self.metrics.purged += await self._db.upkeep.purge(
                    published_older_than=settings.published_retention,
                    abandoned_older_than=settings.abandoned_retention,
                    batch_size=settings.cleanup_batch,
                )
            except RelayboxError as error:
                logger.warning("cleanup failed: %s", error, extra={"action": "cleanup"})
            await self._purge_activity()

    async def _purge_activity(self) -> None:
        """Delete activity and status rows past their retention, in small batches."""
        store, settings = self._activity_store, self._settings
        if store is None or settings.activity_interval is None:
            return
        try:
            await store.purge_activity(
                older_than=settings.activity_retention, batch_size=settings.cleanup_batch
            )
        except RelayboxError as error:
            self._activity_log.failed("purging", error)

    # -- the relay's activity, for the operator's console -----------------------------

    async def _activity_loop(self) -> None:
        every = self._settings.activity_interval or 0.0
        while not self._stopping.is_set():
            await self._sleep(every)
            if self._stopping.is_set():
                return
            await self.record_activity()

    async def record_activity(self) -> None:
        """Write what each target's deliveries came to since the last write, with its
        circuit state and last error. A failure is logged (now and then) and the counts
        go to the next write."""
        store = self._activity_store
        if store is None:
            return
        tallies = self._delivery.tallies
        taken = [tallies[t].take(t, self._circuits[t].state) for t in self._targets]
        try:
            await store.record_activity(self.worker, taken)
        except BaseException as error:
            for each in taken:
                tallies[each.target].give_back(each)
            if not isinstance(error, RelayboxError):
                raise
            self._activity_log.failed("writing", error)
        else:
            self._activity_log.succeeded()

    async def _last_activity(self) -> None:
        """On stop: write what the last batches came to, within STOP_GRACE."""
        if self._settings.activity_interval is None:
            return
        try:
            async with asyncio.timeout(STOP_GRACE):
                await self.record_activity()
        except TimeoutError:
            logger.warning("gave up writing the relay's activity after %g s", STOP_GRACE,
                           extra={"action": "stop"})  # fmt: skip

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)


async def _end(tasks: set[asyncio.Task[None]], grace: float) -> None:
    """Wait `grace` seconds for cancelled `tasks` to wind up, then cancel those still
    busy (a settle stuck on a silent database) and wait as long again for them."""
    if not tasks:
        return
    _, busy = await asyncio.wait(tasks, timeout=grace)
    for task in busy:
        task.cancel()
    if busy:
        _, stuck = await asyncio.wait(busy, timeout=grace)
        if stuck:
            logger.warning(
                "%d task(s) did not end when cancelled", len(stuck), extra={"action": "stop"}
            )
