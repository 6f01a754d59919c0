"""The seams between relaybox's core and the outside world.

The relay engine talks to storage only through `OutboxStorage`; it never imports a
database driver. Every backend, the in-memory one included, passes one conformance
suite (tests/conformance).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

from relaybox.core.partitions import DEFAULT_PARTITIONS
from relaybox.core.publishing import PublisherFeatures, PublishResult
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
class OutboxStorage(Protocol):
    """What the relay needs from an outbox table. All times use the database's clock."""

    table: str

    async def write(self, rows: Sequence[InsertRow]) -> None:
        """Insert rows in a transaction of the storage's own (tests, tools, demos)."""

    async def claim(
        self,
        worker: str,
        *,
        limit: int,
        lease_seconds: float,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
    ) -> Claim:
        """Lease up to `limit` due rows, oldest first, keeping per-(target, key) order.

        A row is handed out only if no earlier row of its (target, key) is still live
        outside this claim, so two workers can never publish one key out of order.
        `partitions` are of `partition_count` (a row's partition is its stored hash
        modulo the count); None means all. For relays without partition leases.
        """

    async def read(
        self,
        *,
        limit: int,
        partitions: Sequence[int] | None = None,
        targets: Sequence[str] | None = None,
        partition_count: int = DEFAULT_PARTITIONS,
        in_flight: Sequence[StoredMessage] = (),
    ) -> list[StoredMessage]:
        """Up to `limit` due rows of `partitions`, oldest first, in per-key order,
        writing nothing: for a relay that holds these partitions by lease.

        Rows `in_flight` (read earlier, not settled yet) are left out,
        and so is every row whose (target, key) has an earlier row in flight, waiting (a
        delay or a backoff) or claimed by a row-lease relay. Keys with a waiting head
        never use up `limit` for the others, however long their backlog. Rows come in
        seq order.
        """

    async def settle_owned(
        self,
        worker: str,
        *,
        partition_count: int = DEFAULT_PARTITIONS,
        failed: Sequence[Failure] = (),
        abandoned: Sequence[Failure] = (),
        published: Sequence[int] = (),
        delete: bool = True,
    ) -> Settled:
        """Record, atomically, what happened to rows `worker` read: count a failed
        attempt (due again after `retry_in`), abandon, publish (delete, or keep with
        `delete=False`). Only live rows in partitions `worker` holds are changed: one
        that lost a partition changes nothing there (the fence of `read`)."""

    async def mark_published(self, token: str, seqs: Sequence[int], *, delete: bool = False) -> int:
        """Record success for rows still held under `token`; others are left alone."""

    async def mark_failed(self, token: str, failures: Sequence[Failure]) -> int:
        """Count a failed attempt and make each row due again after its `retry_in`."""

    async def abandon(self, token: str, failures: Sequence[Failure]) -> int:
        """Give up on rows (max attempts or a permanent error), keeping the error."""

    async def release(self, token: str, seqs: Sequence[int]) -> int:
        """Hand rows back as pending without counting an attempt (shutdown, open circuit)."""

    async def renew(self, token: str, seqs: Sequence[int], lease_seconds: float) -> int:
        """Extend the lease of rows still held under `token`."""

    async def recover_expired(self) -> int:
        """Return rows whose lease has run out to pending."""

    async def purge(
        self,
        *,
        published_older_than: float,
        abandoned_older_than: float,
        batch_size: int = 500,
    ) -> int:
        """Delete finished rows past their retention, in batches of `batch_size`."""

    async def replay(self, seqs: Sequence[int]) -> int:
        """Operator replay: abandoned rows become pending with a fresh attempt count."""

    async def abandoned(
        self, *, limit: int, before: int | None = None, target: str | None = None
    ) -> list[AbandonedMessage]:
        """Abandoned rows, newest (highest seq) first: up to `limit` of those with a
        seq below `before` (None: from the newest), of `target` (None: any)."""

    async def stats(self) -> OutboxStats:
        """Counts by status, the age of the oldest due row, and active leases."""

    async def heartbeat(
        self, worker: str, *, partitions: int, lease_seconds: float, busy: Collection[int] = ()
    ) -> Assignment:
        """Keep `worker` a live member and rebalance partitions 0..partitions-1 (seed 002).

        In one transaction: extend the worker's membership and the leases of the
        partitions it holds by `lease_seconds`; give back the partitions beyond its fair
        share (ceil(partitions / live members)), highest first, except those `busy`
        (rows in flight: kept, renewed and reported `draining` until a later heartbeat);
        take free or expired partitions, lowest first, up to the share. A process that
        stops heartbeating loses its partitions when their lease runs out, and the
        others take them over.
        """

    async def leave(self, worker: str) -> None:
        """Give back every partition `worker` holds and end its membership at once."""

    async def close(self) -> None:
        """Release connections the storage opened itself."""


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
