"""A relay that holds partitions by lease (the default).

Keys are spread over partitions, and the live relay processes of a table share the
partitions by leases that their heartbeats renew. A relay alone may publish the rows of
the partitions it holds, so it needs no lease on each row: a claim is a read that
writes nothing (`PartitionStorage.read`), the rows stay pending in the table while the
relay keeps them in memory as in flight (skipping them in the next read), and one
atomic step settles each batch, fenced by the partitions the relay still holds.
No publish outlives the partition lease as last renewed. Partitions it must give back
drain first (no new reads there), so the next owner never publishes a row a second time.
A per-row lease would write every row twice; a read that writes nothing lets the relay
drain near the rate of a bare claim-and-delete loop (docs/benchmarks.md).

A read beside batches in flight may take the rows queued behind theirs in the same key
(where the storage reads them: `PartitionStorage.reads_behind_in_flight`), so a relay
whose keys are fewer than a batch still keeps every batch it may going. Such a batch
publishes a key's rows only once every earlier batch holding that key has settled it,
each of its rows recorded published (or abandoned, where that lets the key go on): if
one failed, was handed back, or could not be recorded, the rows behind it are handed
back untouched and wait in the table behind it. So the broker never gets a key's row
before the one ahead of it is confirmed, and no row is recorded published while an
earlier row of its key is still live: a redelivery after a crash comes in key order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import operator
import time
from collections.abc import Sequence
from typing import Any, cast

from relaybox.core.partitions import fair_share
from relaybox.core.records import Claim, OutboxStats, RowsInFlight, StoredMessage, seq_text
from relaybox.errors import RelayboxError
from relaybox.ports import PartitionStorage, PlansAhead
from relaybox.relay.delivery import Settlement, target_keys
from relaybox.relay.processor import Processor

logger = logging.getLogger(__name__)

#: In a relay's first heartbeat interval, heartbeats come this often (at most every
#: heartbeat interval): a holder learns that others joined only at its own heartbeat,
#: so relays started together would otherwise leave every partition with the first of
#: them until its next regular one (lease / 6). In its first STARTING_SECONDS, when
#: the relays deployed with it join, every STARTING_HEARTBEAT_SECONDS.
JOINING_HEARTBEAT_SECONDS = 0.5
STARTING_SECONDS = 2.0
STARTING_HEARTBEAT_SECONDS = 0.25
#: While partitions change hands between live relays (one gives back, another is short
#: of its share, or the count of relays changed), heartbeats come this often: a given
#: back partition is read by nobody until its next owner's heartbeat takes it. A relay
#: alone never heartbeats this fast, so an idle relay costs no more.
SHARING_HEARTBEAT_SECONDS = 0.1
#: For how long a relay short of its fair share keeps that pace, waiting for the others
#: to give back theirs (a dead relay's partitions are free only once their lease ends).
SHORT_SHARING_SECONDS = 2.0


class PartitionLeaseProcessor(Processor[PartitionStorage]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Per target, what reads pass as `partitions`: None for all, [] (or no entry)
        #: for none (not yet held).
        self._scope: dict[str, list[int] | None] = {}
        self._flight = _InFlightRows()
        #: The (target, key) of a keyless row of each target: in no batch's keys.
        self._keyless = frozenset((target, None) for target in self._targets)
        #: The batches in flight when the last read was sent (see `_launched`).
        self._read_beside: list[_Batch] = []
        #: Batches that left rows of a key in the table, or may hold rows behind such
        #: rows, while they are in flight (see `_claim`).
        self._unfollowed: set[_Batch] = set()
        self._reads_behind = self._reads_behind_in_flight()
        self._pacing.follows = self._reads_behind
        #: Which set of partitions reads first in the next claim (see `_claim`).
        self._first_group = 0
        #: Until when (time.monotonic) the partitions are surely ours: the start of the
        #: oldest of the last successful heartbeats of each target, plus the lease.
        self._held_until = 0.0
        #: Per target, when (time.monotonic) its last successful heartbeat started.
        self._renewed_at: dict[str, float] = {}
        #: The targets some live relay of the table serves, as the last heartbeat saw.
        self.served: frozenset[str] = frozenset()
        #: Per target, how many live relays serve it, as the last heartbeat saw.
        self._members: dict[str, int] = {}
        #: Whether the last round of heartbeats changed who holds what (see `_pause`).
        self._sharing = True
        self.partitions = {}  # none held until the first heartbeat
        self._guards: set[asyncio.Timeout] = set()
        #: Set while no heartbeat runs (see `_claim`).
        self._between_heartbeats = asyncio.Event()
        self._between_heartbeats.set()
        #: Per target, the partitions being given back once their rows in flight settle.
        self._draining: dict[str, frozenset[int]] = {}
        #: Per target, since when (time.monotonic) the relay holds less than its share.
        self._short_since: dict[str, float] = {}
        #: Set to run the next heartbeat now (see `_pause_for`).
        self._heartbeat_now = asyncio.Event()
        #: Seconds a read and a batch's publishing took lately (moving averages; 0 until
        #: measured): how deep a relay of a fleet goes (`_share_in_flight`).
        self._read_seconds = 0.0
        self._publish_seconds = 0.0
        self._claiming.clear()  # until the first heartbeat says which partitions are ours

    @property
    def heartbeat_at(self) -> float | None:
        if not self._held_until:
            return None
        return self._held_until - self._settings.partition_lease_seconds

    def _tasks_of_mode(self) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self._heartbeat_loop(), name=f"relay-heartbeats-{self.name}"),
            asyncio.create_task(self._plan_ahead(), name=f"relay-plans-{self.name}"),
            asyncio.create_task(self._watch_targets(), name=f"relay-targets-{self.name}"),
        ]

    async def _plan_ahead(self) -> None:
        """Have the read and the settle planned while the first heartbeat runs. A new
        connection's server process parses and plans a statement when it first runs
        it, its catalog caches empty: milliseconds that the first batch would wait for,
        after the heartbeat, on a fresh relay's way to its first publish. Run on
        nothing, each is ready by then. A failure only leaves the planning to the first
        real call."""
        settings, db = self._settings, self._db
        plans = []
        if isinstance(db.claims, PlansAhead):
            plans.append(db.claims.plan_read(settings.partitions))
        if isinstance(db.settles, PlansAhead):
            delete = settings.published_retention == 0
            plans.append(db.settles.plan_settle(settings.partitions, delete=delete))
        for result in await asyncio.gather(*plans, return_exceptions=True):
            if isinstance(result, Exception):
                logger.debug("planning ahead failed: %s", result, extra={"action": "plan_ahead"})

    def reached(self, target: str) -> None:
        """A target's broker was reached: its heartbeat, skipped until now, comes at
        once, so the relay takes its share of that target without waiting a pause."""
        super().reached(target)
        self._heartbeat_now.set()

    def _reads_behind_in_flight(self) -> bool:
        return bool(self._db.claims.reads_behind_in_flight)

    async def _left(self) -> None:
        # A batch still running now (it outlived its cancel) publishes nothing more: the
        # partitions are given back.
        self._held_until = 0.0
        with contextlib.suppress(RelayboxError):
            await self._db.housekeeping.leave(self.worker)

    # -- reading -----------------------------------------------------------------------

    async def _claim(self, targets: list[str]) -> Claim | None:
        """Read the next batch of the partitions held, of each target. Targets whose
        relays hold the same partitions are read together; each set of partitions takes
        a read of its own, within what the reads before it left of the byte budget (the
        sets take turns at reading first, so that a message too large for what is left
        does not wait behind the others for good). A heartbeat that runs meanwhile does
        not count the rows being read as in flight, and may give their partitions away:
        the batch keeps only the rows of partitions still held once no heartbeat runs
        (and it goes in flight before the next one can start), so the next owner is the
        only one to publish the rest."""
        groups: dict[tuple[int, ...] | None, list[str]] = {}
        for target in targets:
            scope = self._scope.get(target, [])
            if scope != []:  # [] (or none yet): no partition of it held
                groups.setdefault(None if scope is None else tuple(scope), []).append(target)
        if not groups:
            return None  # nothing is ours to read (yet)
        settings = self._settings
        beside = self._read_beside = self._flight.batches()
        in_flight = RowsInFlight((batch.messages, batch.seq_text) for batch in beside)
        # Rows in flight are the earliest live rows of their keys, and a read may take
        # what follows them, unless a batch left rows of its keys in the table (failed,
        # handed back, not recorded) while later rows of those keys may be in flight:
        # then reads leave out every key in flight until those batches have settled.
        self._unfollowed.intersection_update(beside)
        follow = self._reads_behind and not self._unfollowed
        self._pacing.follows = follow  # else a read beside a deep batch finds nothing
        messages: list[StoredMessage] = []
        budget = settings.max_claim_bytes
        order = list(groups.items())
        first = self._first_group = (self._first_group + 1) % len(order)
        began = time.monotonic()
        for partitions, group in order[first:] + order[:first]:
            found = await self._db.claims.read(
                limit=settings.batch_size,
                partitions=None if partitions is None else list(partitions),
                targets=group,
                partition_count=settings.partitions,
                in_flight=in_flight,
                after_in_flight=follow,
                max_bytes=budget,
                at_least_one=not messages,
            )
            messages += found
            budget -= sum(len(m.payload) for m in found)
            if budget <= 0:
                break
        self._read_seconds = _moving(self._read_seconds, time.monotonic() - began)
        if len(groups) > 1:
            messages.sort(key=lambda m: m.seq)
        await self._between_heartbeats.wait()
        held = self.partitions or {}
        if any(len(held.get(t, ())) < settings.partitions for t in targets):
            messages = [m for m in messages if m.partition in held.get(m.target, ())]
        return Claim("", self.worker, messages)

    def _launched(self, claim: Claim) -> None:
        # What the read was given as in flight, not what is in flight now: a batch that
        # settled meanwhile may have handed back rows that this one's rows follow.
        keyed = frozenset(target_keys(claim.messages)) - self._keyless
        keys = cast(frozenset[tuple[str, str]], keyed)
        ahead = [batch for batch in self._read_beside if not keys.isdisjoint(batch.keys)]
        batch = _Batch(claim.messages, keys, ahead, seq_text(claim.messages))
        # A batch read beside one that has since left rows in the table may hold rows
        # behind them (which it hands back): no read follows it either.
        if not self._unfollowed.isdisjoint(self._read_beside):
            self._unfollowed.add(batch)
        self._read_beside = []
        self._flight.add(batch)

    def _finished(self, claim: Claim) -> None:
        self._flight.remove(claim.messages)
        # Partitions being given back wait for their rows in flight; once none is left,
        # the next heartbeat gives them back now rather than at its time.
        if self._draining and not any(
            draining & self._flight.partitions(target)
            for target, draining in self._draining.items()
        ):
            self._draining = {}
            self._heartbeat_now.set()

    # -- publishing and settling -----------------------------------------------------

    async def _deliver(self, claim: Claim) -> None:
        """Publish and settle rows read from held partitions, never past the partition
        lease as last renewed: once it may have run out, another relay may own them.
        Cancelled (stop()), it settles what the brokers confirmed, unless cancelled
        again meanwhile."""
        batch = self._flight.batch_of(claim.messages)
        settlement = Settlement()
        loop = asyncio.get_running_loop()
        held_back = batch.keys  # unless its settle is recorded in full
        try:
            try:
                at = self._guard_at(loop, self._guard_margin())
                async with asyncio.timeout_at(at) as guard:
                    self._guards.add(guard)
                    try:
                        self._published_in(await self._publish(batch, settlement))
                    finally:
                        self._guards.discard(guard)
            except TimeoutError:
                self.metrics.leases_lost += 1
                logger.warning(
                    "partition lease ran out while publishing; the rest is left to the next owner",
                    extra={"action": "lease_lost"},
                )
            except asyncio.CancelledError:
                await self._settle(settlement)
                raise
            except Exception:  # a publisher's bug: what the brokers confirmed is settled
                logger.exception("publishing a batch failed", extra={"action": "publish_failed"})
            try:
                recorded = await self._settle(settlement)
            except asyncio.CancelledError:
                # Stopped while settling (in a pause between tries): one more try now,
                # so that what the brokers confirmed is not published again.
                await self._settle(settlement)
                raise
            if recorded:
                held_back = self._delivery.held_back(batch.messages, settlement)
        finally:
            batch.finish(held_back)
            if held_back:  # this batch and every one in flight beside it
                self._unfollowed.update(self._flight.batches())

    async def _publish(self, batch: _Batch, settlement: Settlement) -> float:
        """Publish `batch`: at once the rows of keys no batch ahead of it holds, and the
        rows of each other key as soon as the batches ahead that hold that key have
        settled. Rows waiting for the same batches go together, each such group beside
        the others (their keys differ, so none waits for another): a batch that shares
        a key or two with the one just before it would otherwise hold all its rows
        back until that one settled, and the relay's batches went out one at a time.
        The rows of keys that may not go on after the batches ahead are handed back
        (`released`). Returns the seconds it spent publishing (waiting for the batches
        ahead left out): the longest of its groups."""

        def ours() -> bool:
            return time.monotonic() < self._held_until

        async def run(messages: Sequence[StoredMessage]) -> float:
            began = time.monotonic()
            await self._delivery.run(messages, settlement, ours)
            return time.monotonic() - began

        if not batch.ahead:
            return await run(batch.messages)
        ahead = batch.ahead
        # The keys this batch shares with each batch ahead, intersected in C: a row
        # waits for the batches ahead whose shares hold its key.
        shared = [batch.keys & earlier.keys for earlier in ahead]
        first: list[StoredMessage] = []
        waiting: dict[tuple[int, ...], list[StoredMessage]] = {}
        if len(shared) == 1:  # the rule in a drain: one batch ahead, one membership test
            # Made in C: a keyless row's (target, None) is in no batch's keys.
            held = list(map(shared[0].__contains__, target_keys(batch.messages)))
            first = list(itertools.compress(batch.messages, map(operator.not_, held)))
            if behind := list(itertools.compress(batch.messages, held)):
                waiting[(0,)] = behind
        else:
            holders_of: dict[tuple[str, str], tuple[int, ...]] = {}
            for message in batch.messages:
                if message.key is None:
                    first.append(message)
                    continue
                key = (message.target, message.key)
                holders = holders_of.get(key)
                if holders is None:
                    holders = holders_of[key] = tuple(
                        i for i, keys in enumerate(shared) if key in keys
                    )
                if holders:
                    waiting.setdefault(holders, []).append(message)
                else:
                    first.append(message)

        async def after(holders: tuple[int, ...], rows: list[StoredMessage]) -> float:
            those = [ahead[i] for i in holders]
            for earlier in those:
                await earlier.settled.wait()
            if stopped := frozenset().union(*(earlier.held_back for earlier in those)):
                settlement.released.extend(m.seq for m in rows if (m.target, m.key) in stopped)
                rows = [m for m in rows if (m.target, m.key) not in stopped]
            return await run(rows) if rows else 0.0

        async with asyncio.TaskGroup() as groups:  # cancelled or failed: all end
            tasks = [groups.create_task(run(first))] if first else []
            tasks += [groups.create_task(after(*group)) for group in waiting.items()]
        return max((task.result() for task in tasks), default=0.0)

    def _guard_margin(self) -> float:
        return min(1.0, self._settings.partition_lease_seconds / 10)

    def _guard_at(self, loop: asyncio.AbstractEventLoop, margin: float) -> float:
        """The partitions' lease end (less `margin`) on `loop`'s clock."""
        return loop.time() + (self._held_until - margin - time.monotonic())

    def _extend_guards(self) -> None:
        """A heartbeat renewed the partitions: publishes in flight may go on longer. A
        guard that has fired already stays fired (its delivery is unwinding, and an
        asyncio timeout that has expired cannot be moved)."""
        loop = asyncio.get_running_loop()
        when = self._guard_at(loop, self._guard_margin())
        for guard in self._guards:
            if not guard.expired():
                guard.reschedule(when)

    async def _settle(self, settlement: Settlement) -> bool:
        """Record a batch's outcomes in one atomic step (so nothing is recorded half: if
        it cannot be recorded at all, its rows are simply read again, in order). Rows
        neither published nor failed (released) stay pending as they are. True if every
        row published or abandoned was recorded so (none fenced off, no failure)."""
        metrics, settings = self.metrics, self._settings
        recorded = True
        if settlement.published or settlement.failed or settlement.abandoned:
            settled = await self._with_retries(
                "batch",
                lambda: self._db.settles.settle(
                    self.worker,
                    partition_count=settings.partitions,
                    failed=settlement.failed,
                    abandoned=settlement.abandoned,
                    published=settlement.published,
                    delete=settings.published_retention == 0,
                    hold_keys=settings.hold_keys,
                ),
            )
            if settled is None:
                return False
            metrics.published += settled.published
            metrics.failed += settled.failed
            metrics.abandoned += settled.abandoned
            recorded = (settled.published, settled.abandoned) == (
                len(settlement.published),
                len(settlement.abandoned),
            )
        metrics.released += len(settlement.released)
        return recorded

    # -- partitions ------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        begun = time.monotonic()
        while not self._stopping.is_set():
            self._between_heartbeats.clear()
            self._heartbeat_now.clear()  # what asks for one from here on gets the next
            self._sharing = False
            try:
                for target in self._targets:
                    # A target whose broker the relay has not reached yet is left to the
                    # relays that have: it joins that target's share once connected.
                    if self._circuits[target].held:
                        continue
                    try:
                        await self._heartbeat(target, begun)
                    except Exception:
                        # Whatever went wrong, the other targets and the next heartbeat
                        # go on: without heartbeats the partitions lapse, and every
                        # publish would stop at its lease's end.
                        logger.exception(
                            "heartbeat failed for target %s", target,
                            extra={"action": "heartbeat", "target": target},
                        )  # fmt: skip
            finally:
                self._between_heartbeats.set()
            await self._pause_for(self._pause(begun))

    async def _pause_for(self, seconds: float) -> None:
        """Wait `seconds`, or less: until the relay stops or the partitions it gives
        back have nothing in flight any more (`_finished`), or a broker is reached."""
        waits = {asyncio.create_task(self._heartbeat_now.wait()),
                 asyncio.create_task(self._stopping.wait())}  # fmt: skip
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    def _pause(self, begun: float) -> float:
        """Until the next heartbeat: shortest while partitions change hands (see
        SHARING_HEARTBEAT_SECONDS), short in the first heartbeat interval (shorter in
        its first seconds), else the heartbeat interval. A heartbeat comes early once
        the partitions being given back have nothing in flight (`_finished`)."""
        interval = self._settings.heartbeat_interval
        if self._sharing:
            return min(interval, SHARING_HEARTBEAT_SECONDS)
        running = time.monotonic() - begun
        if running < min(interval, STARTING_SECONDS):
            return min(interval, STARTING_HEARTBEAT_SECONDS)
        if running < interval:
            return min(interval, JOINING_HEARTBEAT_SECONDS)
        return interval

    async def _heartbeat(self, target: str, begun: float) -> None:
        """Renew and rebalance `target`'s partitions (`begun`: when the loop started)."""
        settings = self._settings
        started = time.monotonic()
        try:
            assignment = await self._db.housekeeping.heartbeat(
                self.worker,
                partitions=settings.partitions,
                lease_seconds=settings.partition_lease_seconds,
                busy=self._flight.partitions(target),
                target=target,
            )
        except RelayboxError as error:
            logger.warning("heartbeat of target %s failed: %s", target, error,
                           extra={"action": "heartbeat", "target": target})  # fmt: skip
            last_ok = self._renewed_at.get(target, begun)
            if time.monotonic() - last_ok > settings.partition_lease_seconds * 0.9:
                self._assign(target, frozenset())  # others may own them by now
            else:
                # It may have failed after giving partitions back (a commit whose answer
                # was lost): those had nothing in flight, and another relay may take
                # them at once. Until a heartbeat succeeds, read only partitions with
                # rows in flight, which no heartbeat gives back.
                held = (self.partitions or {}).get(target, frozenset())
                self._assign(target, held & self._flight.partitions(target))
                self._sharing = True  # the next heartbeat comes soon
        else:
            self.metrics.heartbeats += 1
            self._renewed_at[target] = started
            self.served = assignment.served
            held = assignment.partitions - assignment.draining
            if (
                assignment.draining
                or self._members.get(target) != assignment.members
                or (self.partitions or {}).get(target) != held
            ):
                self._sharing = True
            if len(held) >= fair_share(settings.partitions, assignment.members):
                self._short_since.pop(target, None)
            elif started - self._short_since.setdefault(target, started) < SHORT_SHARING_SECONDS:
                # Short of its share: others are giving theirs back by now, or have died
                # and their leases run out later (then the usual pace is enough).
                self._sharing = True
            self._members[target] = assignment.members
            if assignment.draining:
                self._draining[target] = assignment.draining
            else:
                self._draining.pop(target, None)
            self._assign(target, held)
        self._hold()

    def _hold(self) -> None:
        """Work out until when the rows of every batch in flight, and of every partition
        held, are surely ours: the oldest renewal among the targets that hold
        partitions or have rows in flight (a batch mixes targets)."""
        if not self._renewed_at:
            return
        held, busy = self.partitions or {}, self._flight.targets()
        starts = [self._renewed_at.get(t, 0.0) for t in self._targets if held.get(t) or t in busy]
        start = min(starts) if starts else max(self._renewed_at.values())
        self._held_until = start + self._settings.partition_lease_seconds
        self._extend_guards()

    def _assign(self, target: str, partitions: frozenset[int]) -> None:
        """Read `target`'s rows from `partitions` from now on (draining ones are already
        left out)."""
        held = self.partitions if self.partitions is not None else {}
        if partitions != held.get(target):
            logger.info(
                "%s holds %d partitions of target %s", self.worker, len(partitions), target,
                extra={"action": "rebalance", "target": target, "partitions": sorted(partitions)},
            )  # fmt: skip
            self.partitions = {**held, target: partitions}
            # Holding all of them, a read takes no partition filter.
            held_all = len(partitions) >= self._settings.partitions
            self._scope[target] = None if held_all else sorted(partitions)
            self._share_in_flight()
            self.wake()
        self._claiming.set()

    def _share_in_flight(self) -> None:
        """Go as many batches deep as this relay's share of the partitions suits (the
        largest share it holds of any target's), or as its brokers' waits need."""
        count = self._settings.partitions
        share = max((len(held) / count for held in (self.partitions or {}).values()), default=0)
        waits = self._publish_seconds / self._read_seconds if self._read_seconds else 0.0
        self.in_flight_now = self._settings.in_flight_share(self.max_in_flight, share, waits)

    def _published_in(self, seconds: float) -> None:
        self._publish_seconds = _moving(self._publish_seconds, seconds)
        self._share_in_flight()

    # -- targets nobody serves ---------------------------------------------------------

    async def _watch_targets(self) -> None:
        """Count the table's rows per target every cleanup interval (or as often as the
        counts are sampled anyway), to find rows of targets no live relay serves."""
        every = self._settings.cleanup_interval
        while not self._stopping.is_set():
            await self._sleep(every)
            if not self._stopping.is_set():
                await self.refresh_stats(max_age=every, wait=every)

    def _counted(self, stats: OutboxStats) -> None:
        """Rows of a target that no live relay of the table serves wait until one that
        does starts: say so, as nothing else would."""
        served = self.served  # empty until a heartbeat: nothing known of the others
        self.unserved = {
            target: count
            for target, count in sorted(stats.live_by_target.items())
            if served and count and target not in served
        }
        if unserved := self.unserved:
            logger.warning(
                "rows wait for targets that no live relay of table %s serves (or has "
                "reached): %s; start a relay with --broker NAME=URL for each",
                self._db.housekeeping.table,
                ", ".join(f"{t} ({n} rows)" for t, n in unserved.items()),
                extra={"action": "unserved_targets", "targets": unserved},
            )  # fmt: skip


@dataclasses.dataclass(eq=False)
class _Batch:
    """A batch in flight: its rows, their keys, the earlier batches holding some of
    those keys, and, once settled, the keys whose next rows may follow."""

    messages: Sequence[StoredMessage]
    keys: frozenset[tuple[str, str]]
    ahead: list[_Batch]
    #: The rows' seqs as `RowsInFlight` takes them, made once for the reads beside it.
    seq_text: str
    #: The keys with a row here not recorded published (or abandoned where that lets
    #: the key go on): their rows behind may not follow (set when `settled` is).
    held_back: frozenset[tuple[str, str]] = frozenset()
    settled: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def finish(self, held_back: frozenset[tuple[str, str]]) -> None:
        self.held_back = held_back
        self.ahead = []  # what is behind waits on this batch alone, not on its chain
        self.settled.set()


class _InFlightRows:
    """The batches this relay has read and not yet settled."""

    def __init__(self) -> None:
        self._batches: list[_Batch] = []

    def add(self, batch: _Batch) -> None:
        self._batches.append(batch)

    def remove(self, messages: Sequence[StoredMessage]) -> None:
        self._batches = [batch for batch in self._batches if batch.messages is not messages]

    def batch_of(self, messages: Sequence[StoredMessage]) -> _Batch:
        return next(batch for batch in self._batches if batch.messages is messages)

    def batches(self) -> list[_Batch]:
        return list(self._batches)

    def targets(self) -> frozenset[str]:
        return frozenset(m.target for batch in self._batches for m in batch.messages)

    def partitions(self, target: str) -> frozenset[int]:
        """The partitions of `target` with rows in flight."""
        return frozenset(m.partition for batch in self._batches for m in batch.messages
                         if m.target == target)  # fmt: skip


def _moving(average: float, seconds: float) -> float:
    """A moving average of durations: a fifth of each new one (the first, whole)."""
    return seconds if not average else average + (seconds - average) / 5
