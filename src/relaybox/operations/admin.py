"""What an operator asks of an outbox table without a relay: `relaybox status` and
`relaybox abandoned` (investigate abandoned messages before the cleanup removes the
evidence; relaybox.operations.messages replays them).

Each call opens its own storage on the table and closes it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from relaybox.core.records import AbandonedMessage, OutboxStats
from relaybox.errors import ConfigurationError
from relaybox.ports import OperatorStorage
from relaybox.storage import open_storage

#: The most `abandoned` lists at once: what every database takes as a LIMIT.
MAX_LIMIT = 2**31 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class Thresholds:
    """Alert when a signal passes its limit (None: no limit)."""

    max_pending: int | None = None
    max_failed: int | None = None
    max_abandoned: int | None = None
    max_oldest_age: float | None = None

    def breaches(self, stats: OutboxStats) -> list[str]:
        found = []
        checks = (
            ("pending", stats.pending, self.max_pending),
            ("failed (waiting for a retry)", stats.failed, self.max_failed),
            ("abandoned", stats.abandoned, self.max_abandoned),
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
