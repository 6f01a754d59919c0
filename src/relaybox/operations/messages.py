"""The operator's work on messages: find, inspect, and fix what is stuck, keeping
per-key order. The command line, the JSON API and the web console all call this module,
so the three never disagree.

An action over many messages runs in two steps. `plan` finds every row it would change
(the rows a filter matches that are in a state the action applies to) and says which
keys it touches and, for a replay, which later messages of those keys have already
been published ahead of it. `apply` then changes those rows, oldest first, in pages;
each page checks again, in its own statement, that every row is still in a state the
action applies to, so a row that moved on in between is left alone and not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from relaybox.core.inspection import (
    LIVE_STATES,
    MAX_DELAY,
    MAX_PAGE,
    MAX_SEQ,
    AuditAction,
    AuditRecord,
    Change,
    MessageDetail,
    MessageFilter,
    MessageState,
    MessageSummary,
    RelayMember,
    TargetStuck,
)
from relaybox.core.records import OutboxStats
from relaybox.errors import ConfigurationError
from relaybox.ports import ActivityStorage, InspectionStorage, OperatorStorage
from relaybox.storage import open_storage

#: Rows changed per statement, and read per page while planning.
PAGE = 500
#: The later rows of a key a message's page lists.
QUEUE_SHOWN = 20

#: The states each action changes; a row in any other state is left alone.
APPLIES_TO: dict[AuditAction, frozenset[MessageState]] = {
    AuditAction.REPLAY: frozenset({MessageState.ABANDONED, MessageState.HELD}),
    AuditAction.DISCARD: frozenset(MessageState) - {MessageState.IN_FLIGHT},
    AuditAction.DELAY: frozenset(
        {MessageState.PENDING, MessageState.DELAYED, MessageState.RETRYING}
    ),
    AuditAction.EXPEDITE: frozenset(
        {MessageState.PENDING, MessageState.DELAYED, MessageState.RETRYING}
    ),
    AuditAction.HOLD: frozenset(
        {MessageState.PENDING, MessageState.DELAYED, MessageState.RETRYING}
    ),
    AuditAction.RELEASE: frozenset({MessageState.HELD}),
}

#: What a selection names: the seqs of messages, or a filter.
Selection = Sequence[int] | MessageFilter
#: Told (done, total) as an action goes through its pages.
Progress = Callable[[int, int], None]


class Storage(InspectionStorage, OperatorStorage, ActivityStorage, Protocol):
    """What the operations and the console use of a storage (every backend serves
    all three)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Page:
    """One page of a search; pass `next_after` back as `after` for the next page
    (None: this was the last)."""

    messages: list[MessageSummary]
    next_after: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class KeyQueue:
    """Where a message stands in its key's queue."""

    #: Live rows of its (target, key) before it: it waits for these.
    ahead: list[MessageSummary]
    #: Live rows of its (target, key) after it (up to QUEUE_SHOWN): they wait for it.
    behind: list[MessageSummary]
    #: Whether more live rows wait behind it than `behind` lists.
    more_behind: bool
    #: Later rows of its key already published (those a retention keeps).
    published_after: list[MessageSummary]


@dataclasses.dataclass(frozen=True, slots=True)
class MessageView:
    detail: MessageDetail
    #: None for a message without a key: it waits for nothing and holds nothing back.
    queue: KeyQueue | None


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What an action would change: `seqs` in seq order and the keys they belong to."""

    action: AuditAction
    seqs: list[int]
    keys: list[tuple[str, str | None]]
    #: Replay only: later messages of the replayed keys already published (retained
    #: ones), which consumers have seen before the replayed message.
    published_ahead: list[MessageSummary]

    @property
    def count(self) -> int:
        return len(self.seqs)


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    plan: Plan
    #: Rows changed (0 on a dry run); below plan.count when rows moved on meanwhile.
    changed: int
    dry_run: bool


class Operations:
    """The operator's view of one outbox table. Open with `Operations.open(url, table)`
    (or `Operations.opened(...)` as a context manager); close when done."""

    def __init__(self, storage: Storage, *, name: str) -> None:
        self.storage = storage
        #: How the console names this table (the masked URL and the table).
        self.name = name

    @classmethod
    async def open(cls, db_url: str, table: str) -> Operations:
        from relaybox.storage.urls import DatabaseUrl

        storage = await open_storage(db_url, table=table)
        masked = DatabaseUrl.parse(db_url).masked
        return cls(storage, name=f"{masked} {table}")

    @classmethod
    @contextlib.asynccontextmanager
    async def opened(cls, db_url: str, table: str) -> AsyncIterator[Operations]:
        operations = await cls.open(db_url, table)
        try:
            yield operations
        finally:
            await operations.close()

    async def close(self) -> None:
        await self.storage.close()

    # -- reading -----------------------------------------------------------------------

    async def stats(self) -> OutboxStats:
        return await self.storage.stats()

    async def relays(self) -> list[RelayMember]:
        return await self.storage.relays()

    async def stuck(self) -> list[TargetStuck]:
        """Per target: its retrying, held and abandoned messages, and the oldest one."""
        return await self.storage.stuck_by_target()

    async def search(
        self,
        where: MessageFilter | None = None,
        *,
        limit: int = 50,
        after: int | None = None,
        newest_first: bool = True,
    ) -> Page:
        if not 1 <= limit <= MAX_PAGE:
            raise ConfigurationError(f"limit {limit}: a page holds 1 to {MAX_PAGE} messages")
        if after is not None and not 1 <= after <= MAX_SEQ:
            raise ConfigurationError(f"after {after}: seqs run from 1 to {MAX_SEQ}")
        found = await self.storage.search(
            where or MessageFilter(), limit=limit + 1, after=after, newest_first=newest_first
        )
        more = len(found) > limit
        found = found[:limit]
        return Page(found, found[-1].seq if more else None)

    async def show(self, seq: int) -> MessageView | None:
        _check_seq(seq)
        detail = await self.storage.message(seq)
        if detail is None:
            return None
        summary = detail.summary
        if summary.key is None:
            return MessageView(detail, None)
        key = MessageFilter(target=summary.target, key=summary.key)
        live = LIVE_STATES
        ahead = await self._all(
            dataclasses.replace(key, states=live, max_seq=seq - 1) if seq > 1 else None
        )
        behind = await self.storage.search(
            dataclasses.replace(key, states=live, min_seq=seq + 1) if seq < MAX_SEQ else key,
            limit=QUEUE_SHOWN + 1, newest_first=False,
        )  # fmt: skip
        published = await self.storage.search(
            dataclasses.replace(key, states=frozenset({MessageState.PUBLISHED}), min_seq=seq + 1)
            if seq < MAX_SEQ else key,
            limit=QUEUE_SHOWN, newest_first=False,
        )  # fmt: skip
        queue = KeyQueue(ahead, behind[:QUEUE_SHOWN], len(behind) > QUEUE_SHOWN, published)
        return MessageView(detail, queue)

    async def audit(self, *, limit: int = 50, before: int | None = None) -> list[AuditRecord]:
        if not 1 <= limit <= MAX_PAGE:
            raise ConfigurationError(f"limit {limit}: a page holds 1 to {MAX_PAGE} records")
        return await self.storage.audit(limit=limit, before=before)

    # -- changing ----------------------------------------------------------------------

    async def plan(self, action: AuditAction, selection: Selection) -> Plan:
        """What `action` would change of `selection`, without changing anything."""
        if action is AuditAction.BACKFILL:
            raise ConfigurationError("a backfill is planned by its own command")
        states = APPLIES_TO[action]
        if isinstance(selection, MessageFilter):
            wanted = states & selection.states if selection.states else states
            if not wanted:  # the filter asks only for states the action leaves alone
                return Plan(action, [], [], [])
            rows = await self._all(dataclasses.replace(selection, states=frozenset(wanted)))
        else:
            rows = [row for row in await self._named(selection) if row.state in states]
        if action is AuditAction.HOLD:
            rows = await self._key_heads(rows)
        keys = sorted({(row.target, row.key) for row in rows}, key=_key_order)
        published: list[MessageSummary] = []
        if action is AuditAction.REPLAY:
            published = await self._published_ahead(rows)
        return Plan(action, [row.seq for row in rows], keys, published)

    async def apply(
        self,
        plan: Plan,
        change: Change,
        *,
        delay: float = 0.0,
        progress: Progress | None = None,
    ) -> Outcome:
        """Carry out a plan, oldest row first, a page per statement."""
        if plan.action is AuditAction.DELAY and not 0 < delay <= MAX_DELAY:
            raise ConfigurationError(
                f"a delay is a number of seconds above 0, at most {MAX_DELAY:g}"
            )
        changed = 0
        for start in range(0, plan.count, PAGE):
            page = plan.seqs[start : start + PAGE]
            changed += await self._change(plan.action, page, change, delay)
            if progress is not None:
                progress(min(start + PAGE, plan.count), plan.count)
        return Outcome(plan, changed, dry_run=False)

    async def act(
        self,
        action: AuditAction,
        selection: Selection,
        change: Change,
        *,
        dry_run: bool = False,
        delay: float = 0.0,
        progress: Progress | None = None,
    ) -> Outcome:
        """Plan `action` over `selection` and, unless `dry_run`, carry it out."""
        plan = await self.plan(action, selection)
        if dry_run:
            return Outcome(plan, 0, dry_run=True)
        return await self.apply(plan, change, delay=delay, progress=progress)

    # -- inside --------------------------------------------------------------------------

    async def _change(
        self, action: AuditAction, seqs: list[int], change: Change, delay: float
    ) -> int:
        storage = self.storage
        if action is AuditAction.REPLAY:
            return await storage.replay(seqs, change)
        if action is AuditAction.DISCARD:
            return await storage.discard(seqs, change)
        if action is AuditAction.DELAY:
            return await storage.reschedule(seqs, delay=delay, change=change)
        if action is AuditAction.EXPEDITE:
            return await storage.reschedule(seqs, delay=0.0, change=change)
        if action is AuditAction.HOLD:
            return await storage.hold(seqs, change)
        if action is AuditAction.RELEASE:
            return await storage.release_held(seqs, change)
        raise ConfigurationError(f"{action} is not a change of messages")

    async def _all(self, where: MessageFilter | None) -> list[MessageSummary]:
        """Every message matching `where`, oldest first."""
        if where is None:
            return []
        found: list[MessageSummary] = []
        after = None
        while page := await self.storage.search(where, limit=PAGE, after=after, newest_first=False):
            found += page
            if len(page) < PAGE:
                break
            after = page[-1].seq
        return found

    async def _named(self, selection: Sequence[int]) -> list[MessageSummary]:
        """The messages of these seqs, in seq order, a page of seqs per query (never a
        walk of every seq between the lowest and the highest)."""
        seqs = sorted(set(selection))
        if not seqs:
            raise ConfigurationError("name at least one seq, or a filter")
        for seq in seqs:
            _check_seq(seq)
        found: list[MessageSummary] = []
        for start in range(0, len(seqs), PAGE):
            found += (m.summary for m in await self.storage.messages(seqs[start : start + PAGE]))
        return found

    async def _key_heads(self, rows: list[MessageSummary]) -> list[MessageSummary]:
        """For a hold: a keyed row is held through the first live row of its key (the
        rest wait behind that one); a row without a key is held itself."""
        heads: dict[tuple[str, str], MessageSummary] = {}
        alone: list[MessageSummary] = []
        for row in rows:
            if row.key is None:
                alone.append(row)
                continue
            if (row.target, row.key) in heads:
                continue
            first = await self.storage.search(
                MessageFilter(target=row.target, key=row.key, states=APPLIES_TO[AuditAction.HOLD]),
                limit=1, newest_first=False,
            )  # fmt: skip
            heads[(row.target, row.key)] = first[0] if first else row
        return sorted([*alone, *heads.values()], key=lambda row: row.seq)

    async def _published_ahead(self, rows: list[MessageSummary]) -> list[MessageSummary]:
        first: dict[tuple[str, str], int] = {}
        for row in rows:
            if row.key is not None:
                first.setdefault((row.target, row.key), row.seq)
        gone: list[MessageSummary] = []
        for (target, key), seq in sorted(first.items()):
            if seq >= MAX_SEQ:
                continue
            gone += await self._all(
                MessageFilter(
                    target=target, key=key, min_seq=seq + 1,
                    states=frozenset({MessageState.PUBLISHED}),
                )
            )  # fmt: skip
        return sorted(gone, key=lambda row: row.seq)


def _check_seq(seq: int) -> None:
    if not 1 <= seq <= MAX_SEQ:
        raise ConfigurationError(f"seq {seq}: seqs run from 1 to {MAX_SEQ}")


def _key_order(key: tuple[str, str | None]) -> tuple[str, bool, str]:
    return (key[0], key[1] is not None, key[1] or "")
