"""Backfills the console runs: each one a task of the console's own process, at most
one per table and job name at a time.

A backfill records its cursor in the table as it copies (relaybox.operations.backfill),
so the console keeps nothing of a job but the task and how it ended: what a job has
done is read back from the table, and a job stopped with the console (or failed) goes on
from its cursor when started again under the same name, from the console or the command
line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from relaybox.core.inspection import Change, MessageFilter
from relaybox.core.message import Target
from relaybox.errors import ConfigurationError, RelayboxError
from relaybox.operations.backfill import BATCH, BackfillOutcome, backfill
from relaybox.operations.messages import Operations

log = logging.getLogger("relaybox.console")


@dataclasses.dataclass(frozen=True, slots=True)
class BackfillRequest:
    """A backfill as a request asks for it."""

    name: str
    source: MessageFilter
    to: Target
    rate: float | None
    change: Change


@dataclasses.dataclass(slots=True)
class _Run:
    task: asyncio.Task[BackfillOutcome]
    #: Why the run stopped before it finished (None: it did not fail).
    error: str | None = None


class Backfills:
    """The backfill tasks of one console, by table and job name."""

    def __init__(self) -> None:
        self._runs: dict[tuple[int, str], _Run] = {}

    async def plan(self, operations: Operations, asked: BackfillRequest) -> BackfillOutcome:
        """What the backfill would copy (from its cursor, when it exists already)."""
        return await backfill(
            operations, asked.name, asked.source, asked.to, asked.change, dry_run=True
        )

    def start(self, table: int, operations: Operations, asked: BackfillRequest) -> None:
        """Start copying in a task of this process; refused while the same job runs."""
        if self.running(table, asked.name):
            raise ConfigurationError(f"backfill {asked.name!r} is running already")
        task = asyncio.create_task(
            backfill(operations, asked.name, asked.source, asked.to, asked.change,
                     rate=asked.rate, batch=_batch(asked.rate)),
            name=f"relaybox backfill {asked.name}",
        )  # fmt: skip
        run = _Run(task)
        self._runs[(table, asked.name)] = run
        task.add_done_callback(lambda done: _ended(run, done))

    def running(self, table: int, name: str) -> bool:
        run = self._runs.get((table, name))
        return run is not None and not run.task.done()

    def error(self, table: int, name: str) -> str | None:
        """Why this console's last run of the job failed; None if it did not."""
        run = self._runs.get((table, name))
        return None if run is None else run.error


def _batch(rate: float | None) -> int:
    """Copies per transaction: with a rate, about a second's worth, so the job's
    progress moves every second or so; without, the most."""
    return BATCH if rate is None else max(1, min(BATCH, int(rate)))


def _ended(run: _Run, task: asyncio.Task[BackfillOutcome]) -> None:
    """Keep why a run failed: relaybox's own words (they hold no secret), anything
    else only in the log."""
    if task.cancelled():
        run.error = "stopped with the console; start it again to go on"
        return
    error = task.exception()
    if error is None:
        return
    if isinstance(error, RelayboxError):
        run.error = str(error)
    else:
        run.error = "the backfill failed; see the console's log"
    log.error("backfill failed: %s", run.error, exc_info=error)
