"""Watching an outbox and an inbox from a process that is neither relay nor consumer:
what the operator's console charts and the command line prints.

Relays write their activity per target and minute, and their circuit state per
target, to the outbox's database (relay/activity.py); consumers write theirs per minute
to the inbox's (inbox/activity.py). These functions read them back as one series per
target or consumer, a point for every minute of the window, minutes without activity
as zeros, so a chart needs no gap filling of its own.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from relaybox.core.activity import (
    NO_LAG,
    STATUS_LIVE_SECONDS,
    ActivityPoint,
    InboxActivityPoint,
    Lag,
    RelayStatus,
    minute_of,
    minute_start,
)
from relaybox.core.identifiers import DEFAULT_INBOX
from relaybox.inbox.activity import read_activity
from relaybox.ports import ActivityStorage

P = TypeVar("P", ActivityPoint, InboxActivityPoint)


@dataclasses.dataclass(frozen=True, slots=True)
class TargetSeries:
    """One target's relay activity, a point per minute, oldest first."""

    target: str
    points: tuple[ActivityPoint, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerSeries:
    """One consumer's inbox activity, a point per minute, oldest first."""

    consumer: str
    points: tuple[InboxActivityPoint, ...]


async def outbox_activity(
    storage: ActivityStorage, since: datetime.datetime, *, until: datetime.datetime | None = None
) -> list[TargetSeries]:
    """Per target (by name), its activity in every minute from the one that holds
    `since` to the one that holds `until` (None: now), summed over the relays."""
    found = await storage.activity(since=since)
    minutes = _minutes(since, until, (minute_of(p.minute) for p in found))
    by_target: dict[str, dict[int, ActivityPoint]] = {}
    for point in found:
        by_target.setdefault(point.target, {})[minute_of(point.minute)] = point
    return [
        TargetSeries(target, _filled(points, minutes, functools.partial(_no_delivery, target)))
        for target, points in sorted(by_target.items())
    ]


async def relay_statuses(
    storage: ActivityStorage, *, within: float = STATUS_LIVE_SECONDS
) -> list[RelayStatus]:
    """The live relays' circuit state and last error per target (written within the
    last `within` seconds), by target and worker."""
    return await storage.relay_statuses(within=within)


async def inbox_activity(
    connection: Any,
    since: datetime.datetime,
    *,
    table: str = DEFAULT_INBOX,
    consumer: str | None = None,
    until: datetime.datetime | None = None,
) -> list[ConsumerSeries]:
    """Per consumer (only `consumer`, if given), its inbox activity in every minute from
    the one that holds `since` to the one that holds `until` (None: now), through an
    async connection or session to the inbox's database."""
    found = await read_activity(connection, since=since, table=table, consumer=consumer)
    minutes = _minutes(since, until, (minute_of(p.minute) for p in found))
    by_consumer: dict[str, dict[int, InboxActivityPoint]] = {}
    for point in found:
        by_consumer.setdefault(point.consumer, {})[minute_of(point.minute)] = point
    return [
        ConsumerSeries(name, _filled(points, minutes, functools.partial(_no_message, name)))
        for name, points in sorted(by_consumer.items())
    ]


def _minutes(
    since: datetime.datetime, until: datetime.datetime | None, seen: Iterable[int]
) -> range:
    """The window's minutes; it reaches any minute a point has, should the database's
    clock run ahead of ours."""
    last = minute_of(until or datetime.datetime.now(datetime.UTC))
    return range(minute_of(since), max([last, *seen]) + 1)


def _filled(points: dict[int, P], minutes: range, empty: Callable[[int], P]) -> tuple[P, ...]:
    return tuple(points.get(minute) or empty(minute) for minute in minutes)


def _no_delivery(target: str, minute: int) -> ActivityPoint:
    return ActivityPoint(target, minute_start(minute), 0, 0, 0, NO_LAG)


def _no_message(consumer: str, minute: int) -> InboxActivityPoint:
    return InboxActivityPoint(consumer, minute_start(minute), 0, 0, 0, NO_LAG)


# -- as JSON, for the console's API and `--json` ----------------------------------------


def _lag(lag: Lag) -> dict[str, Any]:
    return {
        "lag_avg_seconds": lag.average,
        "lag_max_seconds": lag.largest if lag.count else None,
    }


def target_series_json(series: Sequence[TargetSeries]) -> dict[str, Any]:
    """{target: [{minute, published, failed, abandoned, lag_avg_seconds,
    lag_max_seconds}, ...]}."""
    return {
        each.target: [
            {
                "minute": p.minute.isoformat(),
                "published": p.published,
                "failed": p.failed,
                "abandoned": p.abandoned,
                **_lag(p.lag),
            }
            for p in each.points
        ]
        for each in series
    }


def consumer_series_json(series: Sequence[ConsumerSeries]) -> dict[str, Any]:
    """{consumer: [{minute, applied, duplicate, parked, lag_avg_seconds,
    lag_max_seconds}, ...]}."""
    return {
        each.consumer: [
            {
                "minute": p.minute.isoformat(),
                "applied": p.applied,
                "duplicate": p.duplicate,
                "parked": p.parked,
                **_lag(p.lag),
            }
            for p in each.points
        ]
        for each in series
    }


def statuses_json(statuses: Sequence[RelayStatus]) -> list[dict[str, Any]]:
    """The status rows as JSON-ready dicts; `last_error` is the broker's own words (its
    URLs masked) and must be escaped where it is shown."""
    return [
        {"worker": s.worker, "target": s.target, "circuit": s.circuit.value,
         "last_error": s.last_error, "updated_at": s.updated_at.isoformat()}
        for s in statuses
    ]  # fmt: skip
