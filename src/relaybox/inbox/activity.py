"""A consumer's activity per minute in `<inbox>_activity`, for the operator's console:
how many messages were applied, skipped as duplicates and parked, and the time from a
message's creation (its `time`, the writer's clock) to the commit of its effects.

The consumer counts in memory (`InboxTally`) and adds the counts to the row of the
database's current minute every `Consumer.activity_interval` seconds and when its
broker consumer stops, in a short transaction of its own; a write that fails keeps the
counts for the next one. `read_activity` reads the rows back through any connection
the inbox takes, from any process.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from relaybox.core.activity import (
    ACTIVITY_RETENTION,
    NO_LAG,
    InboxActivityPoint,
    Lag,
    minute_of,
    minute_start,
)
from relaybox.core.identifiers import DEFAULT_INBOX
from relaybox.inbox.inbox import Inbox
from relaybox.inbox.rows import Work


@dataclasses.dataclass(slots=True)
class InboxTally:
    """A consumer's counts since they were last written."""

    applied: int = 0
    duplicate: int = 0
    parked: int = 0
    lag: Lag = NO_LAG

    def applied_one(self, occurred_at: datetime.datetime | None, now: float) -> None:
        """A message was applied and its transaction committed at `now` (epoch seconds);
        its lag counts when the message says when it was created."""
        self.applied += 1
        if occurred_at is not None:
            self.lag = self.lag.observed(now - occurred_at.timestamp())

    def take(self) -> InboxTally:
        """The counts so far; they start again at zero."""
        taken = InboxTally(self.applied, self.duplicate, self.parked, self.lag)
        self.applied = self.duplicate = self.parked = 0
        self.lag = NO_LAG
        return taken

    def add(self, other: InboxTally) -> None:
        """Counts taken for a write that failed: the next write adds them."""
        self.applied += other.applied
        self.duplicate += other.duplicate
        self.parked += other.parked
        self.lag = self.lag.merged(other.lag)

    @property
    def counted(self) -> bool:
        return bool(self.applied or self.duplicate or self.parked)


async def record(work: Work, consumer: str, tally: InboxTally) -> None:
    """Add `tally` to `consumer`'s row of the current minute, in `work`'s transaction."""
    counts = (tally.applied, tally.duplicate, tally.parked, tally.lag.total,
              tally.lag.largest, tally.lag.count)  # fmt: skip
    # MySQL's statement names each count twice: once to insert, once to add.
    params = (consumer, *counts, *counts) if work.dialect == "mysql" else (consumer, *counts)
    await work.execute("activity_add", *params)


async def purge(work: Work, batch_size: int, older_than: float = ACTIVITY_RETENTION) -> int:
    """Delete up to `batch_size` activity rows of minutes that ended more than
    `older_than` seconds ago; how many."""
    return await work.execute("activity_purge", float(older_than), batch_size)


async def read_activity(
    connection: Any,
    *,
    since: datetime.datetime,
    table: str = DEFAULT_INBOX,
    consumer: str | None = None,
) -> list[InboxActivityPoint]:
    """Per consumer (only `consumer`'s, if given) and minute, from the minute that
    holds `since` on, through an async connection or session; ordered by consumer and
    minute. Minutes nothing was written in are absent."""
    work = await Work.opened(connection, Inbox(table=table))
    rows = await work.fetch("activity_since", minute_of(since))
    return [
        InboxActivityPoint(
            str(name),
            minute_start(minute),
            int(applied),
            int(duplicate),
            int(parked),
            Lag(float(total), float(largest), int(count)),
        )
        for name, minute, applied, duplicate, parked, total, largest, count in rows
        if consumer is None or name == consumer
    ]
