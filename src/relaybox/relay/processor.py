"""One database's relay: claim, publish, settle, with leases, partitions and cleanup.

Three connections per database, so that no kind of work waits behind another: one
claims, one settles (and renews), one keeps house (heartbeats, expired leases, purges).
A second claiming connection, each on half the partitions, was measured: it drained
slower (25-29k against 36-39k msg/s), because a claim must skip every key that a batch
still in flight holds, and halving the keys per connection doubled the skipping.

Two ways to hold rows while they are published:

- With partition leases (the default, seed 002), the relay holds whole partitions: it
  alone may publish their rows for as long as its heartbeats renew the lease. A claim
  is then a read that writes nothing (`OutboxStorage.read`): the rows it took stay
  pending in the table and the relay keeps them in memory as in flight, skipping them
  and their keys in the next read; one atomic statement settles each batch, fenced by
  the partitions the relay still holds. No publish outlives the partition lease as
  last renewed. Partitions it must give back drain first (no new reads there), so the
  next owner never publishes a row a second time. This is what drains at the raw
  claim-and-delete rate (docs/benchmarks.md): a per-row lease writes every row twice.
- Without partition leases every relay claims from every partition, and each row is
  leased on its own (seed 000's `processing`, `locked_by`, `locked_until`, fencing
  token), renewed while a publish runs, released when it does not go out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

from relaybox.core.circuit import CircuitBreaker, CircuitState
from relaybox.core.records import Claim, StoredMessage
from relaybox.core.signals import StatsSample, TargetCounters
from relaybox.errors import RelayboxError
from relaybox.ports import OutboxStorage, Publisher
from relaybox.relay.delivery import Delivery, Settlement
from relaybox.relay.settings import RelaySettings
from relaybox.relay.waker import Waker

logger = logging.getLogger(__name__)

#: Pauses between the tries of a settle that fails (a lost connection is reopened by
#: the next try). After the last, the batch is given up: its rows are read again.
SETTLE_RETRY_DELAYS = (0.05, 0.2, 0.8, 3.2)


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
class Connections:
    claims: OutboxStorage
    settles: OutboxStorage
    housekeeping: OutboxStorage


class Processor:
    def __init__(
        self,
        name: str,
        connections: Connections,
        publishers: Mapping[str, Publisher],
        circuits: Mapping[str, CircuitBreaker],
        settings: RelaySettings,
        worker: str,
        stats_connection: Callable[[], Awaitable[OutboxStorage]],
    ) -> None:
        self.name = name
        self.worker = worker
        self.metrics = ProcessorMetrics()
        self.partitions: frozenset[int] | None = None
        #: What claims pass as `partitions`: None for all, [] for none (not yet held).
        self._scope: list[int] | None = [] if settings.partition_leases else None
        #: Partition leases: claims are reads, and what is in flight lives here.
        self._owned = settings.partition_leases
        self._flight = _InFlightRows()
        #: Until when (time.monotonic) the partitions are surely ours: the start of the
        #: last successful heartbeat plus the partition lease.
        self._held_until = 0.0
        self._guards: set[asyncio.Timeout] = set()
        self._probe_in: float | None = None
        self._db = connections
        self._publishers = publishers
        self._targets = sorted(publishers)
        self._circuits = circuits
        self._settings = settings
        self._waker = Waker(settings.min_poll_interval, settings.idle_interval)
        self._slots = asyncio.Semaphore(settings.max_in_flight)
        self._delivery = Delivery(publishers, circuits, settings.retry, settings.publish_timeout)
        self._deliveries: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._assigned = asyncio.Event()
        #: Whether the latest claim took two rows or more of one key, and whether it was
        #: full (see _claim_loop).
        self._deep = False
        self._full = False
        #: Claims beside a full batch in flight that came back empty, in a row, and how
        #: many batches must settle before the next claim beside one (see _claim_loop).
        self._futile = 0
        self._hold = 0
        self._settled = asyncio.Event()
        if not settings.partition_leases:
            self._assigned.set()
        #: The table's counts as last read (see `refresh_stats`); None until asked.
        self.stats_sample: StatsSample | None = None
        self._stats_reading: asyncio.Task[None] | None = None
        #: Seconds between readings of the counts; 0: none unless asked.
        self._stats_every = 0.0
        #: Opens the connection the counts are read on, when first asked: not the
        #: housekeeping one, where a count over a large table would hold up heartbeats.
        self._open_stats = stats_connection
        self._stats_storage: OutboxStorage | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._claim_loop(), name=f"relay-claims-{self.name}")]
        if self._settings.partition_leases:
            self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
        self._tasks.append(asyncio.create_task(self._cleanup_loop()))
        if self._stats_every:
            self._tasks.append(asyncio.create_task(self._stats_loop()))

    def wake(self) -> None:
        self._waker.wake()

    @property
    def in_flight(self) -> int:
        """Claimed batches being published or settled now."""
        return len(self._deliveries)

    @property
    def heartbeat_at(self) -> float | None:
        """time.monotonic() of the last heartbeat that renewed the partitions (None: not
        yet, or row leases): it is what their lease is held from."""
        if not self._held_until:
            return None
        return self._held_until - self._settings.partition_lease_seconds

    @property
    def target_counters(self) -> dict[str, TargetCounters]:
        return self._delivery.counters

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

    async def stop(self, timeout: float) -> None:
        """Stop claiming; let in-flight batches finish for `timeout`, then release them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._stopping.set()
        self.wake()
        self._assigned.set()
        self._settled.set()
        # The claim loop ends after the claim it may be running (whose batch it launches,
        # so the batch is settled or released below), or when it next gets a slot.
        claim_loop = self._tasks[:1]
        if claim_loop:
            await asyncio.wait(claim_loop, timeout=timeout)
        while self._deliveries and loop.time() < deadline:
            await asyncio.wait(set(self._deliveries), timeout=deadline - loop.time())
        pending = set(self._deliveries)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        reading = [self._stats_reading] if self._stats_reading is not None else []
        for task in (*self._tasks, *reading):
            task.cancel()
        await asyncio.gather(*self._tasks, *reading, return_exceptions=True)
        if self._settings.partition_leases:
            with contextlib.suppress(RelayboxError):
                await self._db.housekeeping.leave(self.worker)

    # -- claiming --------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        waker = self._waker
        while not self._stopping.is_set():
            await waker.wait()
            await self._assigned.wait()
            if self._stopping.is_set():
                return
            await self._slots.acquire()
            if self._stopping.is_set():  # stop() came while we waited for a slot
                self._slots.release()
                return
            if self._deliveries and (self._deep or self._hold):
                # A claim beside the batch in flight would likely take nothing: that
                # batch holds several rows of one key (the backlog is deep per key, so
                # it likely holds the head of every key), or such claims came back
                # empty beside full batches (every key this relay may take has its
                # head in flight). Claim again once a batch has settled.
                self._slots.release()
                self._settled.clear()
                await self._settled.wait()
                continue
            beside = bool(self._deliveries) and self._full
            try:
                claim = await self._claim()
            except RelayboxError as error:
                self._slots.release()
                logger.warning("claim failed: %s", error, extra={"action": "claim_error"})
                waker.found_nothing()
                continue
            if claim is None or not claim.messages:
                self._slots.release()
                waker.found_nothing()
                if beside and claim is not None:
                    # Wait for 1, 2, 4 ... 32 batches to settle before the next try.
                    self._futile = min(self._futile + 1, 6)
                    self._hold = 2 ** (self._futile - 1)
            else:
                waker.found_work()
                self._deep = _deep(claim.messages)
                self._full = len(claim.messages) >= self._settings.batch_size
                if beside or not self._full:
                    # A claim beside one paid off, or the backlog is gone.
                    self._futile = self._hold = 0
                self._launch(claim)
            if self._probe_in is not None:  # come back when an open circuit may be probed
                waker.wait_at_most(self._probe_in)

    async def _claim(self) -> Claim | None:
        targets = self._claimable_targets()
        if not targets:
            return None
        if self._scope == []:
            return None  # no partition held (yet): nothing is ours to claim
        settings = self._settings
        if self._owned:
            messages = await self._db.claims.read(
                limit=settings.batch_size,
                partitions=self._scope,
                targets=targets,
                partition_count=settings.partitions,
                in_flight=self._flight.messages(),
            )
            claim = Claim("", self.worker, messages)
        else:
            claim = await self._db.claims.claim(
                self.worker,
                limit=settings.batch_size,
                lease_seconds=settings.lease_seconds,
                partitions=self._scope,
                targets=targets,
                partition_count=settings.partitions,
            )
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
        if self._owned:
            self._flight.add(claim.messages)
            task = asyncio.create_task(self._deliver_owned(claim))
        else:
            task = asyncio.create_task(self._deliver(claim))
        self._deliveries.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            if self._owned:
                self._flight.remove(claim.messages)
            self._deliveries.discard(finished)
            self._slots.release()
            self._hold = max(0, self._hold - 1)
            self._settled.set()
            self.wake()  # a slot is free: there may be more to claim

        task.add_done_callback(done)

    # -- publishing and settling -----------------------------------------------------

    async def _deliver(self, claim: Claim) -> None:
        """Publish and settle one claim, never past its lease: a publish still running
        when the lease (as last renewed) runs out is cancelled, since another worker
        may take the rows then and publish the key's next messages."""
        lease = self._settings.lease_seconds
        margin = min(1.0, lease / 10)
        deadline = [time.monotonic() + lease]
        settlement = Settlement()
        try:
            async with asyncio.timeout_at(deadline[0] - margin) as guard:
                renewer = asyncio.create_task(self._renew(claim, deadline, guard, margin))
                try:
                    await self._delivery.run(
                        claim.messages, settlement, lambda: time.monotonic() < deadline[0]
                    )
                except asyncio.CancelledError:  # stop() or the lease guard
                    if guard.expired():
                        self.metrics.leases_lost += 1
                    settled = settlement.seqs()
                    settlement.released.extend(
                        m.seq for m in claim.messages if m.seq not in settled
                    )
                    await asyncio.shield(self._settle(claim, settlement))
                    raise
                finally:
                    renewer.cancel()
        except TimeoutError:
            logger.warning(
                "lease ran out while publishing; the rest is left to the next claim",
                extra={"action": "lease_lost"},
            )
            return
        await self._settle(claim, settlement)

    async def _deliver_owned(self, claim: Claim) -> None:
        """Publish and settle rows read from held partitions, never past the partition
        lease as last renewed: once it may have run out, another relay may own them."""
        settlement = Settlement()
        margin = self._guard_margin()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(self._guard_at(loop, margin)) as guard:
                self._guards.add(guard)
                try:
                    await self._delivery.run(
                        claim.messages, settlement, lambda: time.monotonic() < self._held_until
                    )
                except asyncio.CancelledError:  # stop() or the lease guard
                    if guard.expired():
                        self.metrics.leases_lost += 1
                    await asyncio.shield(self._settle_owned(settlement))
                    raise
                finally:
                    self._guards.discard(guard)
        except TimeoutError:
            logger.warning(
                "partition lease ran out while publishing; the rest is left to the next owner",
                extra={"action": "lease_lost"},
            )
            return
        await self._settle_owned(settlement)

    def _guard_margin(self) -> float:
        return min(1.0, self._settings.partition_lease_seconds / 10)

    def _guard_at(self, loop: asyncio.AbstractEventLoop, margin: float) -> float:
        """The partitions' lease end (less `margin`) on `loop`'s clock."""
        return loop.time() + (self._held_until - margin - time.monotonic())

    def _extend_guards(self) -> None:
        """A heartbeat renewed the partitions: publishes in flight may go on longer."""
        loop = asyncio.get_running_loop()
        when = self._guard_at(loop, self._guard_margin())
        for guard in self._guards:
            guard.reschedule(when)

    async def _settle_owned(self, settlement: Settlement) -> None:
        """Record a batch's outcomes in one atomic statement (so nothing is recorded
        half: if it cannot be recorded at all, its rows are simply read again, in
        order). Rows neither published nor failed (released) stay pending as they are."""
        if not (settlement.published or settlement.failed or settlement.abandoned):
            self.metrics.released += len(settlement.released)
            return
        settings = self._settings
        for attempt, delay in enumerate((*SETTLE_RETRY_DELAYS, None)):
            try:
                settled = await self._db.settles.settle_owned(
                    self.worker,
                    partition_count=settings.partitions,
                    failed=settlement.failed,
                    abandoned=settlement.abandoned,
                    published=settlement.published,
                    delete=settings.published_retention == 0,
                )
            except RelayboxError as error:
                logger.warning(
                    "settle failed (attempt %d): %s", attempt + 1, error,
                    extra={"action": "settle_error"},
                )  # fmt: skip
                if delay is not None:
                    await asyncio.sleep(delay)
                continue
            metrics = self.metrics
            metrics.published += settled.published
            metrics.failed += settled.failed
            metrics.abandoned += settled.abandoned
            metrics.released += len(settlement.released)
            return

    async def _renew(
        self, claim: Claim, deadline: list[float], guard: asyncio.Timeout, margin: float
    ) -> None:
        seqs = [m.seq for m in claim.messages]
        while True:
            await asyncio.sleep(self._settings.renew_interval)
            asked = time.monotonic()
            try:
                renewed = await self._db.settles.renew(
                    claim.token, seqs, self._settings.lease_seconds
                )
            except RelayboxError as error:
                logger.warning("lease renewal failed: %s", error, extra={"action": "renew"})
                continue
            if renewed < len(seqs):  # some rows went to another worker: stop publishing
                deadline[0] = 0.0
                guard.reschedule(asyncio.get_running_loop().time())
                return
            deadline[0] = asked + self._settings.lease_seconds
            guard.reschedule(deadline[0] - margin)

    async def _settle(self, claim: Claim, settlement: Settlement) -> None:
        """Record the outcomes, failures first. If a failure cannot be recorded, the
        later messages of its key are not recorded as published either: the failed
        one comes back when the lease runs out, and they come back after it, in order
        (published twice, but never first after their predecessor)."""
        storage, token = self._db.settles, claim.token
        held_back: dict[tuple[str, str], int] = {}  # (target, key) -> first unrecorded
        by_seq = {m.seq: m for m in claim.messages}
        if settlement.abandoned:
            abandoned = settlement.abandoned
            if not await self._record("abandoned", lambda: storage.abandon(token, abandoned)):
                _hold_back(held_back, by_seq, (f.seq for f in abandoned))
        if settlement.failed:
            failed = settlement.failed
            if not await self._record("failed", lambda: storage.mark_failed(token, failed)):
                _hold_back(held_back, by_seq, (f.seq for f in failed))
        published = [s for s in settlement.published if not _behind(held_back, by_seq[s])]
        if published:
            delete = self._settings.published_retention == 0
            await self._record(
                "published", lambda: storage.mark_published(token, published, delete=delete)
            )
        if settlement.released:
            released = settlement.released
            await self._record("released", lambda: storage.release(token, released))

    async def _record(self, kind: str, step: Callable[[], Awaitable[int]]) -> bool:
        """Settle with a few retries and count it; False if it could not be recorded.
        Giving up loses nothing: the lease expires and the rows are delivered again."""
        for attempt, delay in enumerate((*SETTLE_RETRY_DELAYS, None)):
            try:
                count = await step()
            except RelayboxError as error:
                logger.warning(
                    "settle %s failed (attempt %d): %s", kind, attempt + 1, error,
                    extra={"action": "settle_error"},
                )  # fmt: skip
                if delay is not None:
                    await asyncio.sleep(delay)
                continue
            setattr(self.metrics, kind, getattr(self.metrics, kind) + count)
            return True
        return False

    # -- partitions and housekeeping -------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        settings = self._settings
        last_ok = time.monotonic()
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                assignment = await self._db.housekeeping.heartbeat(
                    self.worker,
                    partitions=settings.partitions,
                    lease_seconds=settings.partition_lease_seconds,
                    busy=self._flight.partitions() if self._owned else (),
                )
            except RelayboxError as error:
                logger.warning("heartbeat failed: %s", error, extra={"action": "heartbeat"})
                if time.monotonic() - last_ok > settings.partition_lease_seconds * 0.9:
                    self._assign(frozenset())  # others may own them by now
            else:
                last_ok = started
                self.metrics.heartbeats += 1
                self._held_until = started + settings.partition_lease_seconds
                self._extend_guards()
                self._assign(assignment.partitions - assignment.draining)
            await self._sleep(settings.heartbeat_interval)

    def _assign(self, partitions: frozenset[int]) -> None:
        """Claim from `partitions` from now on (draining ones are already left out)."""
        if partitions != self.partitions:
            logger.info(
                "%s holds %d partitions", self.worker, len(partitions),
                extra={"action": "rebalance", "partitions": sorted(partitions)},
            )  # fmt: skip
            self.partitions = partitions
            # Holding all of them, a claim takes one lock instead of one per partition.
            held_all = len(partitions) >= self._settings.partitions
            self._scope = None if held_all else sorted(partitions)
            self.wake()
        self._assigned.set()

    async def _cleanup_loop(self) -> None:
        settings = self._settings
        while not self._stopping.is_set():
            await self._sleep(settings.cleanup_interval)
            if self._stopping.is_set():
                return
            try:  # (expired leases need no sweep here: every claim takes them back)
                self.metrics.purged += await self._db.housekeeping.purge(
                    published_older_than=settings.published_retention,
                    abandoned_older_than=settings.abandoned_retention,
                    batch_size=settings.cleanup_batch,
                )
            except RelayboxError as error:
                logger.warning("cleanup failed: %s", error, extra={"action": "cleanup"})

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)


def _deep(messages: Iterable[StoredMessage]) -> bool:
    seen: set[tuple[str, str]] = set()
    for message in messages:
        if message.key is not None:
            chain = (message.target, message.key)
            if chain in seen:
                return True
            seen.add(chain)
    return False


def _hold_back(
    held_back: dict[tuple[str, str], int], by_seq: dict[int, StoredMessage], seqs: Iterable[int]
) -> None:
    for seq in seqs:
        message = by_seq[seq]
        if message.key is not None:
            chain = (message.target, message.key)
            held_back[chain] = min(held_back.get(chain, seq), seq)


def _behind(held_back: dict[tuple[str, str], int], message: StoredMessage) -> bool:
    if message.key is None or not held_back:
        return False
    first = held_back.get((message.target, message.key))
    return first is not None and message.seq > first


class _InFlightRows:
    """The rows a relay holding its partitions has read and not yet settled."""

    def __init__(self) -> None:
        self._batches: list[Sequence[StoredMessage]] = []

    def add(self, messages: Sequence[StoredMessage]) -> None:
        self._batches.append(messages)

    def remove(self, messages: Sequence[StoredMessage]) -> None:
        self._batches = [batch for batch in self._batches if batch is not messages]

    def messages(self) -> list[StoredMessage]:
        return [m for batch in self._batches for m in batch]

    def partitions(self) -> frozenset[int]:
        return frozenset(m.partition for batch in self._batches for m in batch)
