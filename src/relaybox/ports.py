"""The seams between relaybox's core and the outside world.

Storage is split by job, so that each user of a table sees only what it needs: a relay
that holds partition leases (`PartitionStorage`), a relay that leases each row
(`RowLeaseStorage`), an operator (`OperatorStorage`), and tools that write rows of their
own (`TableWriter`), the operator's console (`InspectionStorage`), and the relays'
activity the console charts (`ActivityStorage`). Every backend serves all six, and one
conformance suite
(tests/conformance) holds every backend, the in-memory one included, to them. The relay
engine never imports a database driver.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

from relaybox.core.activity import (
    ACTIVITY_RETENTION,
    STATUS_LIVE_SECONDS,
    ActivityPoint,
    RelayStatus,
    TargetActivity,
)
from relaybox.core.entities import Entity
from relaybox.core.inspection import (
    AuditRecord,
    BackfillJob,
    Change,
    MessageDetail,
    MessageFilter,
    MessageSummary,
    RelayMember,
    TargetStuck,
)
from relaybox.core.message import DEFAULT_TARGET
from relaybox.core.partitions import DEFAULT_PARTITIONS
from relaybox.core.publishing import Declared, PublisherFeatures, PublishResult
from relaybox.core.records import (
    AbandonedMessage,
    Assignment,
    Claim,
    Failure,
    InsertRow,
    OutboxStats,
    Settled,
    StoredMessage,
)


@runtime_checkable
class Storage(Protocol):
    """An outbox table through connections the storage opened itself. All times use
    the database's clock."""

    table: str

    async def close(self) -> None:
        """Release the connections the storage opened."""


@runtime_checkable
class PartitionStorage(Storage, Protocol):
    """What a relay needs that holds partitions by lease (the default): it alone may
    publish their rows, so it reads them without writing and settles each batch in one
    atomic step, fenced by the partitions it still holds."""

    #: Whether `read(after_in_flight=True)` takes the rows behind those in flight.
    reads_behind_in_flight: bool

    async def read(
        self,
        *,
        limit: int,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
        in_flight: Sequence[StoredMessage] = (),
        after_in_flight: bool = False,
        max_bytes: int | None = None,
        at_least_one: bool = True,
    ) -> list[StoredMessage]:
        """Up to `limit` due rows of `partitions` (of `partition_count`; a row's
        partition is its stored key hash modulo the count; None: all) and `targets`
        (None: all), oldest first, in per-key order, writing nothing.

        Rows `in_flight` (read earlier, not settled yet) are left out, and so is every
        row whose (target, key) has an earlier row in flight, waiting (a delay or a
        backoff) or claimed by a row-lease relay. Keys with a waiting head never use up
        `limit` for the others, however long their backlog. Rows come in seq order.

        With `after_in_flight`, a storage whose `reads_behind_in_flight` is true also
        returns the rows that only rows in flight hold back: each key's next rows after
        them, in order (the caller publishes them only after those ahead). The others
        read as without it; leaving such rows out is always safe.

        With `max_bytes`, the rows stop before the one that would take their payloads
        together past it, and a first row larger on its own comes alone (or, without
        `at_least_one`, not at all): the database sends no more than that.
        """

    async def settle(
        self,
        worker: str,
        *,
        partition_count: int = DEFAULT_PARTITIONS,
        failed: Sequence[Failure] = (),
        abandoned: Sequence[Failure] = (),
        published: Sequence[int] = (),
        delete: bool = True,
        hold_keys: bool = False,
    ) -> Settled:
        """Record, atomically, what happened to rows `worker` read: count a failed
        attempt (due again after `retry_in`), abandon, publish (delete, or keep with
        `delete=False`). Only live rows in a partition of their target that `worker`
        holds are changed: one that lost a partition changes nothing there (the fence
        of `read`).

        With `hold_keys`, an abandoned row with a key is held instead (see
        `relaybox.core.inspection.HELD_UNTIL`: live, failed, with its error and the
        attempt counted), so the later rows of its (target, key) wait behind it; keyless
        rows are abandoned still. A row held meanwhile stays held: neither a failure
        nor an abandon changes it (a publish still does: the message went out)."""

    async def heartbeat(
        self,
        worker: str,
        *,
        partitions: int,
        lease_seconds: float,
        busy: Collection[int] = (),
        target: str = DEFAULT_TARGET,
    ) -> Assignment:
        """Keep `worker` a live member serving `target`, and rebalance that target's
        partitions 0..partitions-1 among the live members that serve it.

        In one transaction: extend the worker's membership and the leases of the
        target's partitions it holds by `lease_seconds`; give back those beyond its fair
        share (ceil(partitions / live members serving the target)), highest first,
        except those `busy` (rows in flight: kept, renewed and reported `draining` until
        a later heartbeat); take free or expired partitions, lowest first, up to the
        share. Each target's partitions are leased apart, so relays that serve different
        targets never hold back each other's rows. A process that stops heartbeating
        loses its partitions when their lease runs out, and the others take them over.
        The assignment also says which targets some live relay serves.
        """

    async def leave(self, worker: str) -> None:
        """Give back every partition `worker` holds and end its membership at once."""


@runtime_checkable
class PlansAhead(Protocol):
    """A storage that parses and plans each statement on a connection the first time it
    runs it there (PostgreSQL), and can do so ahead of time: a relay asks for its
    first batch's statements while its first heartbeat takes the partitions."""

    async def plan_read(self, partition_count: int = DEFAULT_PARTITIONS) -> None:
        """Plan `PartitionStorage.read` by running it once on nothing."""

    async def plan_settle(
        self, partition_count: int = DEFAULT_PARTITIONS, *, delete: bool = True
    ) -> None:
        """Plan the settle of published rows (deleted, or kept with `delete` false) by
        running it once on no row."""


@runtime_checkable
class RowLeaseStorage(Storage, Protocol):
    """What a relay needs that leases each row (run without partition leases): a claim
    moves rows to processing under a token, and every mark is fenced by it."""

    async def claim(
        self,
        worker: str,
        *,
        limit: int,
        lease_seconds: float,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
        max_bytes: int | None = None,
    ) -> Claim:
        """Lease up to `limit` due rows, oldest first, keeping per-(target, key) order.

        A row is handed out only if no earlier row of its (target, key) is still live
        outside this claim, so two workers can never publish one key out of order. A
        row whose lease ran out is taken again. `partitions`, `targets` and `max_bytes`
        as in `PartitionStorage.read`.
        """

    async def mark_published(self, token: str, seqs: Sequence[int], *, delete: bool = False) -> int:
        """Record success for rows still held under `token`; others are left alone."""

    async def mark_failed(self, token: str, failures: Sequence[Failure]) -> int:
        """Count a failed attempt and make each row due again after its `retry_in` (a
        row held stays held)."""

    async def abandon(
        self, token: str, failures: Sequence[Failure], *, hold_keys: bool = False
    ) -> int:
        """Give up on rows (max attempts or a permanent error), keeping the error; with
        `hold_keys`, hold those with a key instead, as `PartitionStorage.settle` does."""

    async def release(self, token: str, seqs: Sequence[int]) -> int:
        """Hand rows back as pending without counting an attempt (shutdown, open circuit)."""

    async def renew(self, token: str, seqs: Sequence[int], lease_seconds: float) -> int:
        """Extend the lease of rows still held under `token`."""


@runtime_checkable
class OperatorStorage(Storage, Protocol):
    """What operators (and the relay's housekeeping) need: counts, the abandoned rows,
    replay, and the purge of finished rows past their retention."""

    async def stats(self) -> OutboxStats:
        """Counts by status (held rows apart), the held rows and keys, the age of the
        oldest due row, and active leases."""

    async def abandoned(
        self, *, limit: int, before: int | None = None, target: str | None = None
    ) -> list[AbandonedMessage]:
        """Abandoned rows, newest (highest seq) first: up to `limit` of those with a
        seq below `before` (None: from the newest), of `target` (None: any)."""

    async def replay(self, seqs: Sequence[int], change: Change | None = None) -> int:
        """Abandoned rows, and held ones, become pending with a fresh attempt count,
        due now, under their own seq (so a key's order holds when its rows are replayed
        oldest first). With `change`, each row replayed gets an audit record in the same
        transaction."""

    async def relays(self) -> list[RelayMember]:
        """The live relays (memberships within their lease) by target, with the
        partitions each holds."""

    async def purge(
        self,
        *,
        published_older_than: float,
        abandoned_older_than: float,
        batch_size: int = 500,
    ) -> int:
        """Delete finished rows past their retention, in batches of `batch_size`."""


@runtime_checkable
class InspectionStorage(Storage, Protocol):
    """What the operator's console needs: find any message, live or finished, read it
    whole, and change rows one by one with an audit record of who did it and why.

    Every change takes seqs an earlier search found, checks in the same statement that
    each row is still in a state the change applies to (a row that moved on is left
    alone and not counted), and writes one audit record per row changed, in the same
    transaction."""

    async def search(
        self,
        where: MessageFilter,
        *,
        limit: int,
        after: int | None = None,
        newest_first: bool = True,
    ) -> list[MessageSummary]:
        """Up to `limit` messages matching `where`, live and finished, in seq order
        (descending with `newest_first`), starting past the seq `after` (below it when
        newest first, above it otherwise; None: from the start)."""

    async def message(self, seq: int) -> MessageDetail | None:
        """The message with this seq, live or finished; None if there is none."""

    async def messages(self, seqs: Sequence[int]) -> list[MessageDetail]:
        """The messages with these seqs, live or finished, in seq order, in one query;
        seqs of no message are left out."""

    async def discard(self, seqs: Sequence[int], change: Change) -> int:
        """Delete these rows, live or finished, except rows in flight (leased under a
        row lease that has not run out)."""

    async def reschedule(self, seqs: Sequence[int], *, delay: float, change: Change) -> int:
        """Make these live rows (pending, delayed or retrying; not in flight, not
        held) due `delay` seconds from now (0: now). Audited as a delay, or with 0 as
        an expedite."""

    async def hold(self, seqs: Sequence[int], change: Change) -> int:
        """Hold these live rows (not in flight): the relay leaves them, and the later
        rows of their (target, key), until they are released, replayed or discarded."""

    async def release_held(self, seqs: Sequence[int], change: Change) -> int:
        """Held rows become due now with a fresh attempt count."""

    async def audit(self, *, limit: int, before: int | None = None) -> list[AuditRecord]:
        """Audit records, newest first: up to `limit` with an id below `before`."""

    async def stuck_by_target(self) -> list[TargetStuck]:
        """Per target (by name) that has any: its retrying, held and abandoned messages,
        counted in one pass over the live rows and from the abandoned rows' own index."""

    async def backfill_job(self, name: str) -> BackfillJob | None:
        """The backfill of this name, or None."""

    async def backfill_begin(
        self, name: str, *, source: MessageFilter, target: str, external: bool, change: Change
    ) -> BackfillJob:
        """Record a new backfill (cursor 0), or return the one of this name as it is."""

    async def backfill_copy(
        self, name: str, rows: Sequence[InsertRow], *, cursor: int, finished: bool
    ) -> bool:
        """In one transaction: move the backfill's cursor forward to `cursor` (and
        mark it finished), then insert `rows`. False, with nothing written, when the
        cursor is already there or past it (another run of the same backfill copied
        these) or the backfill is finished."""


@runtime_checkable
class ActivityStorage(Storage, Protocol):
    """The relays' activity per target and minute, and each relay's circuit state per
    target: written by every relay's housekeeping, read by the operator's console from a
    process of its own. Minutes and times are the database's clock."""

    async def record_activity(self, worker: str, activity: Sequence[TargetActivity]) -> None:
        """For each target: add its counts to the row of (target, the current minute,
        `worker`), and set `worker`'s status row of the target (circuit state, last
        error, updated now). One transaction."""

    async def activity(self, *, since: datetime.datetime) -> list[ActivityPoint]:
        """Per target and minute, from the minute that holds `since` on, the counts
        summed over the relays, ordered by target and minute. Minutes nothing was
        written in are absent."""

    async def relay_statuses(self, *, within: float = STATUS_LIVE_SECONDS) -> list[RelayStatus]:
        """The status rows written within the last `within` seconds (the live relays'),
        ordered by target and worker."""

    async def purge_activity(
        self, *, older_than: float = ACTIVITY_RETENTION, batch_size: int = 500
    ) -> int:
        """Delete activity rows of minutes that ended more than `older_than` seconds
        ago, and status rows not written for as long, in batches of `batch_size`."""


@runtime_checkable
class TableWriter(Storage, Protocol):
    """Rows written by the storage itself, for tools, tests and demos (services write
    through `relaybox.Outbox`, in their own transaction)."""

    async def write(self, rows: Sequence[InsertRow]) -> None:
        """Insert rows in one transaction of the storage's own."""


@runtime_checkable
class Publisher(Protocol):
    """One broker destination. Success means the broker confirmed, never "sent"."""

    features: PublisherFeatures

    async def start(self) -> None:
        """Connect; raise a relaybox error if the broker cannot be reached or configured."""

    async def publish(self, messages: Sequence[StoredMessage]) -> Sequence[PublishResult]:
        """Send `messages` (pipelined where the broker allows) and wait for each confirm.

        Returns one result per message, in the same order. The relay never hands one
        call two messages of the same key, so a publisher need not order them itself.
        A raised exception counts as a transient failure of every message in the call.
        """

    async def close(self) -> None:
        """Flush and disconnect."""


@runtime_checkable
class TopologyOwner(Protocol):
    """A publisher whose URL says what it needs on the broker (exchanges, queues,
    streams, topics, consumer groups), which `relaybox setup` creates."""

    async def setup_topology(self) -> Sequence[Declared]:
        """Create what is missing and leave what exists as it is, on a connection of
        its own (before `start()`, which may check that it exists); safe to call again.
        Raise a relaybox error if the broker cannot be reached or refuses."""


@runtime_checkable
class EntityStore(Protocol):
    """Where a consumer without a relational transaction keeps its entities
    (`relaybox.core.entities.Entity`): one record per entity, state and outbox together.

    Reads and writes must go to one linearizable copy of each record (a database's
    primary, never a replica), or a save's version check compares against a stale
    version."""

    async def load(self, entity_id: str) -> Entity | None:
        """The entity as last saved, or None if it never was."""

    async def save(self, entity: Entity, expected_version: int) -> bool:
        """Write `entity` (state, version and outbox, in one single-record write) if the
        stored version is still `expected_version` (0: no record yet), atomically;
        False, writing nothing, when it moved. `entity.version` is the version it is
        saved as."""

    async def close(self) -> None:
        """Release the connections the store opened."""


@runtime_checkable
class DedupStore(Protocol):
    """The ids of messages whose effects were applied and whose messages were sent,
    each kept for `retention` seconds at least.

    An id added must be seen by every later `processed`, from any process: read and
    write one linearizable copy (a primary, not a replica, not an eventually consistent
    store). docs/entities.md says why, and what a too-short retention costs."""

    retention: float

    async def processed(self, message_id: str) -> bool:
        """Whether `message_id` was added (and has not expired)."""

    async def add(self, message_id: str) -> None:
        """Record `message_id`, for `retention` seconds at least; adding it again is
        harmless."""

    async def close(self) -> None:
        """Release the connections the store opened."""
