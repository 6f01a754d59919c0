"""Backfill: publish retained messages again, in seq order, to a target that exists or
was added later (a new consumer that needs the history).

A backfill copies the published messages a filter matches (those a published retention
kept) as new live rows for the target: the same message id, envelope and payload, a new
seq, due at once. The relay then publishes them like any other, in per-key order among
themselves. Copies are made a page at a time; each page's copies and the job's cursor
(the last source seq copied) are written in one transaction, so a backfill stopped at any
point (Ctrl-C, a crash, a lost connection) goes on from its cursor when run again with
the same name, and copies every message exactly once. Consumers that deduplicate by
message id (relaybox's inbox does) see a copy of a message they already applied as a
duplicate.

The source is bounded when the job starts: at most the highest seq in the table then,
so the copies a backfill makes are never copied again, even when the source target and
the destination are the same.

A copy follows the messages of its key already live for the target; the plan names the
keys that have some, so an operator can backfill a new target before it takes traffic.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from relaybox.core.inspection import (
    LIVE_STATES,
    MAX_PAGE,
    BackfillJob,
    Change,
    MessageDetail,
    MessageFilter,
    MessageState,
    MessageSummary,
)
from relaybox.core.message import Target
from relaybox.core.records import InsertRow
from relaybox.errors import ConfigurationError, RelayboxError
from relaybox.operations.messages import Operations, Progress

#: Source messages read, and copies written, per transaction.
BATCH = 200
_PUBLISHED = frozenset({MessageState.PUBLISHED})


class BackfillConflict(RelayboxError):
    """Another run of the same backfill moved its cursor first: this one stopped."""


@dataclasses.dataclass(frozen=True, slots=True)
class BackfillPlan:
    """What a backfill would copy: `count` messages of `keys` keys, of which
    `keys_live_on_target` already have messages live for the target (the copies go out
    after those)."""

    count: int
    keys: int
    keys_live_on_target: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class BackfillOutcome:
    job: BackfillJob | None
    plan: BackfillPlan
    #: Copies written by this run (0 on a dry run).
    copied: int
    dry_run: bool


async def backfill(
    operations: Operations,
    name: str,
    source: MessageFilter,
    to: Target,
    change: Change,
    *,
    rate: float | None = None,
    batch: int = BATCH,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> BackfillOutcome:
    """Copy the published messages `source` matches to target `to`, `rate` per second
    at most, under the job `name` (run again with the same name to go on)."""
    _check(name, source, rate, batch)
    storage = operations.storage
    job = await storage.backfill_job(name)
    if job is not None:
        _same(job, source, to)
        source = job.source
    else:
        source = await _bounded(operations, source)
    after = 0 if job is None else job.cursor
    plan = await _plan(operations, source, to.name, after)
    if dry_run:
        return BackfillOutcome(job, plan, 0, dry_run=True)
    if job is None:
        job = await storage.backfill_begin(
            name, source=source, target=to.name, external=to.external, change=change
        )
        _same(job, source, to)  # another run began it first
    if job.finished_at is not None:
        return BackfillOutcome(job, plan, 0, dry_run=False)
    copied = await _copy(operations, job, plan.count, rate, batch, progress)
    return BackfillOutcome(await storage.backfill_job(name), plan, copied, dry_run=False)


def _check(name: str, source: MessageFilter, rate: float | None, batch: int) -> None:
    if not name or len(name) > 200 or not name.isprintable():
        raise ConfigurationError("name the backfill: 1 to 200 printable characters")
    if source.target is None:
        raise ConfigurationError(
            "name the target whose messages to copy (the filter's target), so that a "
            "message written to several targets is copied once"
        )
    if source.states and source.states != _PUBLISHED:
        raise ConfigurationError("a backfill copies published messages (those retained)")
    if rate is not None and not rate > 0:
        raise ConfigurationError("a backfill's rate is a number of messages per second above 0")
    if not 1 <= batch <= MAX_PAGE:
        raise ConfigurationError(f"a backfill's batch is 1 to {MAX_PAGE} messages")


def _same(job: BackfillJob, source: MessageFilter, to: Target) -> None:
    given = dataclasses.replace(source, max_seq=None, states=_PUBLISHED)
    kept = dataclasses.replace(job.source, max_seq=None, states=_PUBLISHED)
    if (kept, job.target, job.external) != (given, to.name, to.external):
        raise ConfigurationError(
            f"a backfill named {job.name!r} already exists with another filter or target "
            f"(to {job.target}): name a new one"
        )


async def _bounded(operations: Operations, source: MessageFilter) -> MessageFilter:
    """The source, published messages only, up to the highest seq in the table now."""
    newest = await operations.storage.search(MessageFilter(), limit=1, newest_first=True)
    top = newest[0].seq if newest else 1
    bound = top if source.max_seq is None else min(source.max_seq, top)
    return dataclasses.replace(source, states=_PUBLISHED, max_seq=bound)


async def _plan(
    operations: Operations, source: MessageFilter, target: str, after: int
) -> BackfillPlan:
    count = 0
    keys: set[str] = set()
    cursor = after
    while True:
        page = await _page(operations, source, cursor, MAX_PAGE)
        count += len(page)
        keys.update(m.key for m in page if m.key is not None)
        if len(page) < MAX_PAGE:
            break
        cursor = page[-1].seq
    live = []
    for key in sorted(keys):
        ahead = await operations.storage.search(
            MessageFilter(target=target, key=key, states=LIVE_STATES), limit=1
        )
        if ahead:
            live.append(key)
    return BackfillPlan(count, len(keys), live)


async def _page(
    operations: Operations, source: MessageFilter, after: int, limit: int
) -> list[MessageSummary]:
    """The next source messages past seq `after`, oldest first."""
    start = max(after + 1, source.min_seq or 1)
    if source.max_seq is not None and start > source.max_seq:
        return []
    where = dataclasses.replace(source, min_seq=start)
    return await operations.storage.search(where, limit=limit, newest_first=False)


async def _copy(
    operations: Operations, job: BackfillJob, total: int, rate: float | None, batch: int,
    progress: Progress | None,
) -> int:  # fmt: skip
    storage = operations.storage
    copied = 0
    started = time.monotonic()
    cursor = job.cursor
    while True:
        page = await _page(operations, job.source, cursor, batch)
        details = await storage.messages([m.seq for m in page])
        rows = [_copy_row(detail, job) for detail in details]
        last = page[-1].seq if page else cursor
        finished = len(page) < batch
        if not await storage.backfill_copy(job.name, rows, cursor=last, finished=finished):
            raise BackfillConflict(
                f"backfill {job.name!r}: another run copied past seq {cursor} first; "
                "this one stopped (run it again to see where it stands)"
            )
        copied += len(rows)
        cursor = last
        if progress is not None:
            progress(copied, total)
        if finished:
            return copied
        if rate is not None:
            ahead = copied / rate - (time.monotonic() - started)
            if ahead > 0:
                await asyncio.sleep(ahead)


def _copy_row(detail: MessageDetail, job: BackfillJob) -> InsertRow:
    message = detail.summary
    headers = json.dumps(dict(detail.headers), separators=(",", ":")) if detail.headers else "{}"
    return (
        message.id, job.target, job.external, message.topic, message.key, detail.partition,
        message.type, detail.content_type, detail.payload, headers, message.correlation_id,
        detail.causation_id, detail.tenant_id, detail.aggregate_id, message.occurred_at, 0.0,
    )  # fmt: skip
