"""What the plan tests of each database share: the backlog, the relay's hot calls, and
a connection that keeps what a call ran in a transaction the test rolls back.

Each call goes through the storage itself, so that what is measured is the SQL the
relay sends, bound as the relay binds it."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from relaybox.core.records import Failure
from relaybox.storage.sql import Connection, SqlStorage

ROWS = 100_000
#: Finished rows older than the backlog, kept under a retention (they stay in the outbox
#: table on MariaDB and SQLite, with their status), which a walk in seq order would read.
RETAINED = 20_000
#: The relay's default batch, and one past the length at which MariaDB turns a list of
#: values (`seq IN (...)`) into a table of values joined to the statement's tables.
BATCHES = (500, 2000)
PARTITIONS = 64
#: Keys written in turn: ten rows each, the oldest row of each key its head.
KEYS = 10_000
WORKER = "w1"
#: The oldest LEASED rows are leased under this token, as a row-lease relay holds them.
TOKEN = str(uuid.uuid4())
LEASED = 500

Call = Callable[[SqlStorage, list[int]], Awaitable[Any]]


def _failures(seqs: list[int]) -> list[Failure]:
    return [Failure(s, "e", 1.0) for s in seqs]


#: name -> the storage call that runs the statement (or the steps) of that name, on the
#: oldest seqs, a batch of them (`_holding`: with the hold-the-key policy on).
CALLS: dict[str, Call] = {
    "read": lambda s, seqs: s.read(
        limit=len(seqs), partitions=range(PARTITIONS), partition_count=PARTITIONS,
        targets=["default"], max_bytes=8 << 20,
    ),
    "fail_owned": lambda s, seqs: s.settle(
        WORKER, partition_count=PARTITIONS, failed=_failures(seqs)
    ),
    "abandon_owned": lambda s, seqs: s.settle(
        WORKER, partition_count=PARTITIONS, abandoned=_failures(seqs)
    ),
    "abandon_owned_holding": lambda s, seqs: s.settle(
        WORKER, partition_count=PARTITIONS, abandoned=_failures(seqs), hold_keys=True
    ),
    "delete_owned": lambda s, seqs: s.settle(WORKER, partition_count=PARTITIONS, published=seqs),
    "publish_owned": lambda s, seqs: s.settle(
        WORKER, partition_count=PARTITIONS, published=seqs, delete=False
    ),
    "claim": lambda s, seqs: s.claim(
        "w2", limit=len(seqs), lease_seconds=30.0, targets=["default"], partition_count=PARTITIONS,
        max_bytes=8 << 20,
    ),
    "mark_published": lambda s, seqs: s.mark_published(TOKEN, seqs),
    "delete_published": lambda s, seqs: s.mark_published(TOKEN, seqs, delete=True),
    "mark_failed": lambda s, seqs: s.mark_failed(TOKEN, _failures(seqs)),
    "abandon": lambda s, seqs: s.abandon(TOKEN, _failures(seqs)),
    "abandon_holding": lambda s, seqs: s.abandon(TOKEN, _failures(seqs), hold_keys=True),
    "release": lambda s, seqs: s.release(TOKEN, seqs),
    "renew": lambda s, seqs: s.renew(TOKEN, seqs, 30.0),
}  # fmt: skip


class Recorder:
    """A storage's connection that keeps every statement in one transaction, for the
    test to measure and roll back, and remembers what it ran."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.ran: list[tuple[str, Sequence[Any]]] = []
        self.dropped = False
        self._open = False

    async def _begin(self) -> None:
        if not self._open:
            await self.inner.begin()
            self._open = True

    async def fetch(self, query: str, args: Sequence[Any]) -> list[Sequence[Any]]:
        await self._begin()
        self.ran.append((query, args))
        return await self.inner.fetch(query, args)

    async def execute(self, query: str, args: Sequence[Any]) -> int:
        await self._begin()
        self.ran.append((query, args))
        return await self.inner.execute(query, args)

    async def begin(self) -> None:
        await self._begin()

    async def commit(self) -> None:
        pass  # kept open: the test rolls it back

    async def rollback(self) -> None:
        self._open = False
        if not self.dropped:
            await self.inner.rollback()

    async def close(self) -> None:
        await self.inner.close()

    async def discard(self) -> None:
        self.dropped = True
        await self.inner.discard()
