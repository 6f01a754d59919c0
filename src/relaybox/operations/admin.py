"""What an operator asks of an outbox table without a relay: `relaybox status`,
`relaybox abandoned` and `relaybox replay` (investigate abandoned messages before the
cleanup removes the evidence, then replay them).

Each call opens its own storage on the table and closes it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from relaybox.core.records import AbandonedMessage, OutboxStats
from relaybox.errors import ConfigurationError
from relaybox.ports import OperatorStorage
from relaybox.storage import open_storage

#: Rows listed, or replayed, per query.
PAGE = 500
#: The most `abandoned` lists at once: what every database takes as a LIMIT.
MAX_LIMIT = 2**31 - 1
#: The largest seq a table can hold (a signed 64-bit integer).
MAX_SEQ = 2**63 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class Thresholds:
    """Alert when a signal passes its limit (None: no limit)."""

    max_pending: int | None = None
    max_failed: int | None = None
    max_abandoned: int | None = None
    max_oldest_age: float | None = None
    #: Held messages (each holds back the later messages of its key).
    max_held: int | None = None

    def breaches(self, stats: OutboxStats) -> list[str]:
        found = []
        checks = (
            ("pending", stats.pending, self.max_pending),
            ("failed (waiting for a retry)", stats.failed, self.max_failed),
            ("abandoned", stats.abandoned, self.max_abandoned),
            (f"held (holding back {stats.held_keys} keys)", stats.held, self.max_held),
        )
        for name, value, limit in checks:
            if limit is not None and value > limit:
                found.append(f"{value} {name}, more than {limit}")
        age = stats.oldest_pending_age
        if self.max_oldest_age is not None and age is not None and age > self.max_oldest_age:
            found.append(f"the oldest pending message has waited {age:.1f} s, "
                         f"more than {self.max_oldest_age:g} s")  # fmt: skip
        return found


@contextlib.asynccontextmanager
async def _opened(db_url: str, table: str) -> AsyncIterator[OperatorStorage]:
    storage = await open_storage(db_url, table=table)
    try:
        yield storage
    finally:
        await storage.close()


async def table_stats(db_url: str, table: str) -> OutboxStats:
    async with _opened(db_url, table) as storage:
        return await storage.stats()


async def list_abandoned(
    db_url: str, table: str, *, limit: int, target: str | None = None
) -> list[AbandonedMessage]:
    """The newest `limit` abandoned messages (of `target`), newest first."""
    if not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(f"--limit {limit}: list between 1 and {MAX_LIMIT} messages")
    async with _opened(db_url, table) as storage:
        return await storage.abandoned(limit=limit, target=target)


async def replay(
    db_url: str, table: str, *, seqs: Sequence[int] = (), every: bool = False,
    target: str | None = None,
) -> int:  # fmt: skip
    """Make abandoned rows pending again with a fresh attempt count: those of `seqs`,
    or with `every`, all of them (of `target`). Returns how many were replayed; a seq
    that is not abandoned (published, pending, gone) is left alone."""
    if seqs and every:
        raise ConfigurationError("replay the seqs given or every abandoned message, not both")
    if not seqs and not every:
        raise ConfigurationError("name the seqs of abandoned messages to replay, or all of them")
    outside = [seq for seq in seqs if not 1 <= seq <= MAX_SEQ]
    if outside:
        raise ConfigurationError(f"seq {outside[0]}: seqs run from 1 to {MAX_SEQ}")
    async with _opened(db_url, table) as storage:
        if seqs:
            return await storage.replay(sorted(set(seqs)))
        found: list[int] = []
        before = None
        while page := await storage.abandoned(limit=PAGE, before=before, target=target):
            before = page[-1].seq
            found += (m.seq for m in page)
        # Oldest first: when a key's later message becomes pending, its earlier one
        # already is (or is published), so the relay still sends them in order. Newest
        # first, a later message could go out before its predecessor was replayed.
        found.sort()
        replayed = 0
        for start in range(0, len(found), PAGE):
            replayed += await storage.replay(found[start : start + PAGE])
        return replayed
