"""Everything that tunes a relay, in one place (read from the CLI or built in code)."""

from __future__ import annotations

import dataclasses
import math

from relaybox.core.activity import ACTIVITY_RETENTION
from relaybox.core.circuit import CircuitPolicy
from relaybox.core.partitions import DEFAULT_PARTITIONS, require_partitions
from relaybox.core.retry import RetryPolicy
from relaybox.errors import ConfigurationError


@dataclasses.dataclass(frozen=True, slots=True)
class RelaySettings:
    #: Rows per claim; one commit claims them and one settles them.
    batch_size: int = 500
    #: Payload bytes one claim may hold, whatever its rows: a claim takes rows in seq
    #: order while their payloads together stay within this, and a message larger on
    #: its own comes alone. A relay holds at most `max_in_flight` claims.
    max_claim_bytes: int = 8 * 1024 * 1024
    #: Claimed batches being published at once: the window of unacknowledged sends.
    #: None: as the database's reads suit (`in_flight_limit`), and in a fleet, this
    #: relay's share of it (`in_flight_share`).
    max_in_flight: int | None = None
    #: How long a claim (and a partition) stays ours without renewal.
    lease_seconds: float = 30.0
    #: A publish call that takes longer counts as a transient failure.
    publish_timeout: float = 10.0
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    circuit: CircuitPolicy = dataclasses.field(default_factory=CircuitPolicy)
    #: Partitions the relays of a table share (a row's is its stored key hash modulo
    #: this); every relay of one table must use the same count.
    partitions: int = DEFAULT_PARTITIONS
    #: Spread partitions across relay processes by leases; a relay then
    #: reads its partitions' rows without leasing each one. Off: every process claims
    #: from every partition, leasing each row (still safe, a slower drain). Every
    #: relay of one table must use the same setting.
    partition_leases: bool = True
    #: Adaptive poll: right after an empty claim wait `min_poll_interval`, doubling
    #: up to `idle_interval` while nothing turns up. Work or a wakeup resets it.
    min_poll_interval: float = 0.01
    idle_interval: float = 1.0
    #: The fast window (relay/waker.py): after a writer's NOTIFY, or a read that found
    #: rows, read again `fast_poll_interval` seconds after a read that found rows, and
    #: after an empty one a quarter of the time since rows were last found or a NOTIFY
    #: came (at least `fast_poll_interval`), for `fast_poll_window` seconds, each read
    #: that finds rows extending it; then the adaptive poll again. Writers announce at
    #: most one commit per notify interval (`Outbox(notify=...)`, 0.05 s by default),
    #: so the window must be longer than theirs: the commits they leave unannounced
    #: then fall inside it. A burst's last message costs about 20 empty reads by
    #: default, an idle relay none. 0 turns the window off (the adaptive poll alone).
    fast_poll_interval: float = 0.001
    fast_poll_window: float = 0.2
    #: On PostgreSQL, also wake on the writers' debounced NOTIFY (`Outbox(notify=...)`).
    listen: bool = True
    #: Published rows are kept this long (0: deleted as soon as they are published).
    published_retention: float = 0.0
    abandoned_retention: float = 7 * 24 * 3600.0
    cleanup_interval: float = 60.0
    cleanup_batch: int = 500
    #: On stop, in-flight batches get this long to finish before they are released.
    shutdown_timeout: float = 10.0
    #: Hold the key: a message with a key that the relay gives up on (its last attempt
    #: failed, or its broker refused it for good) stays in the table, held, and the
    #: later messages of its (target, key) wait behind it until an operator replays it
    #: or discards it. Off: it is abandoned and they go on. Keyless messages are
    #: abandoned either way.
    hold_keys: bool = False
    #: Seconds between writes of the relay's activity per target (counts per minute,
    #: delivery lag, circuit state and last error) to the table's `_activity` and
    #: `_relay_status` tables, which the operator's console reads; one more write on
    #: stop. None: not written.
    activity_interval: float | None = 10.0
    #: Activity and status rows older than this are deleted by the cleanup.
    activity_retention: float = ACTIVITY_RETENTION

    def __post_init__(self) -> None:
        limits = (self.batch_size, self.cleanup_batch, self.max_claim_bytes)
        if min(*limits, 1 if self.max_in_flight is None else self.max_in_flight) < 1:
            raise ConfigurationError(
                "batch_size, max_in_flight, max_claim_bytes and cleanup_batch must be >= 1"
            )
        if not self.lease_seconds > 0 or not self.publish_timeout > 0:
            raise ConfigurationError("lease_seconds and publish_timeout must be positive")
        if not 0 < self.min_poll_interval <= self.idle_interval:
            raise ConfigurationError("poll intervals must satisfy 0 < min <= idle")
        if not 0 < self.fast_poll_interval <= self.idle_interval or self.fast_poll_window < 0:
            raise ConfigurationError(
                "fast_poll_interval must satisfy 0 < fast <= idle_interval, and "
                "fast_poll_window cannot be negative"
            )
        if self.published_retention < 0 or self.abandoned_retention < 0:
            raise ConfigurationError("retention windows cannot be negative")
        if self.activity_interval is not None and not self.activity_interval > 0:
            raise ConfigurationError("activity_interval must be positive (None: off)")
        if not self.activity_retention > 0:
            raise ConfigurationError("activity_retention must be positive")
        require_partitions(self.partitions)

    def in_flight_limit(self, reads_behind: bool) -> int:
        """How many batches go in flight at once: `max_in_flight` if set; else 3 where
        a read takes the rows behind batches in flight (PostgreSQL, the in-memory
        storage), whose third batch lets the next read overlap two batches being
        published and settled, and 2 elsewhere, where a read beside two batches finds
        only keys in none of them, and a third measured slower (docs/benchmarks.md)."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        return 3 if reads_behind else 2

    def in_flight_share(self, limit: int, share: float, waits: float = 0.0) -> int:
        """How many of `limit` batches go in flight while a relay holds `share` (0 to 1)
        of the partitions: all of them if `max_in_flight` is set or the relay holds
        every partition; else the share of `limit`, rounded down, at least one, or, if
        more, `waits` rounded up (within `limit`): how many reads fit in the time a
        batch waits for its brokers.

        A fleet keeps about as many batches in flight as one relay would. Every read
        walks the live rows from the oldest, and the rows in flight, the whole fleet's,
        are the oldest: with every relay three batches deep, each read of a fleet of
        four walks past twelve batches, and the database does that work for every
        batch. On one machine, four relays one batch deep each drained faster than four
        three deep, and two one deep as fast as two deep (docs/benchmarks.md, Fleets).
        That holds while the database is what a batch waits for. Where the brokers are
        slower than a read (a broker confirming each message, a webhook far away), a
        relay one batch deep would sit idle through every publish and the fleet would
        drain no faster than one relay, so each goes as deep as its publishes need."""
        if self.max_in_flight is not None or share >= 1.0:
            return limit
        return min(limit, max(1, int(limit * share), math.ceil(waits)))

    @property
    def partition_lease_seconds(self) -> float:
        """A dead process's partitions expire within 2/3 of the lease and are seen
        expired within 1/6 more, so others take them over within `lease_seconds`."""
        return self.lease_seconds * 2 / 3

    @property
    def heartbeat_interval(self) -> float:
        return self.lease_seconds / 6

    @property
    def renew_interval(self) -> float:
        return self.lease_seconds / 3
