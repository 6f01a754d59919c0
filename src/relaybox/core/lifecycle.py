"""The states an outbox row moves through.

pending -> processing -> published
processing -> failed -> (backoff) -> processing ...
failed -> abandoned            (max attempts, or a permanent error)
processing -> pending          (released, or its lease expired)
abandoned -> pending           (operator replay)

`processing` is a claim. A relay that holds its partitions by lease (the default)
claims whole partitions in `<table>_partitions` (owner, lease_until) rather than each
row, so its rows go from pending (or failed) to published, failed or abandoned directly
while the partition row records who holds them; a relay without partition leases marks
each claimed row `processing` with `locked_by`, `locked_until` and a fencing token.
"""

from __future__ import annotations

import enum


class Status(enum.StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    PUBLISHED = "published"
    FAILED = "failed"
    ABANDONED = "abandoned"


#: States in which a row still has to be published; they hold back later rows of its key.
LIVE_STATES = frozenset({Status.PENDING, Status.PROCESSING, Status.FAILED})
#: States a row never leaves except by purge or replay.
FINAL_STATES = frozenset({Status.PUBLISHED, Status.ABANDONED})
