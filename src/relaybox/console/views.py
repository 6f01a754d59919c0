"""The console's requests: what a query or a body asks for, read into the operations
module's types. What the operations return is written by relaybox.operations.views, the
shapes the command line's --json prints too; a table's counts are written here.

Everything a request carries is hostile until read here: a bad value is a
ConfigurationError naming the parameter, which the application answers with a 400.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from relaybox.console.backfills import BackfillRequest
from relaybox.core.inspection import (
    MAX_PAGE,
    MAX_SEQ,
    AuditAction,
    BackfillJob,
    Change,
    MessageFilter,
    MessageState,
    RelayMember,
    TargetStuck,
)
from relaybox.core.message import Target
from relaybox.core.records import OutboxStats
from relaybox.errors import ConfigurationError
from relaybox.operations.backfill import BackfillPlan
from relaybox.operations.messages import Selection

#: The actions a request may ask for (a backfill has its own command).
ACTIONS = frozenset(AuditAction) - {AuditAction.BACKFILL}
#: The most seqs one action request may name.
MAX_NAMED = MAX_PAGE
#: The states an overview counts as stuck.
STUCK = (MessageState.RETRYING, MessageState.HELD, MessageState.ABANDONED)
#: The longest text a filter field may carry.
MAX_TEXT = 1000
_TEXT_FIELDS = (
    "target",
    "topic",
    "key",
    "type",
    "correlation_id",
    "causation_id",
    "tenant_id",
    "aggregate_id",
)
#: Every query parameter a search reads (besides `state`, which may repeat).
FILTER_FIELDS = (*_TEXT_FIELDS, "id", "min_seq", "max_seq", "since", "until")
#: The longest window, in minutes, an activity request may ask for.
MAX_MINUTES = 120
#: The most messages per second a backfill may be told to copy.
MAX_RATE = 1_000_000.0


@dataclasses.dataclass(frozen=True, slots=True)
class Search:
    """A search request: the filter, the page size, where the page starts, the order."""

    where: MessageFilter
    limit: int
    after: int | None
    newest_first: bool


# -- reading requests ------------------------------------------------------------------


def search_of(query: Mapping[str, Sequence[str]]) -> Search:
    """A search from query parameters (each name to its values, in order)."""
    order = _one(query, "order") or "newest"
    if order not in ("newest", "oldest"):
        raise ConfigurationError(f"order {shown(order)}: newest or oldest")
    limit = _one(query, "limit")
    after = _one(query, "after")
    return Search(
        where=filter_of(query),
        limit=50 if limit is None else _integer("limit", limit, 1, MAX_PAGE),
        after=None if after is None else _integer("after", after, 1, MAX_SEQ),
        newest_first=order == "newest",
    )


def filter_of(fields: Mapping[str, Sequence[str]]) -> MessageFilter:
    """A filter from named values: `state` may repeat, every other field is given once;
    an empty value is a field not given."""
    states = frozenset(_state(value) for value in fields.get("state", ()) if value)
    values: dict[str, Any] = {"states": states}
    for name in _TEXT_FIELDS:
        text = _one(fields, name)
        if text is not None:
            values[name] = _text(name, text)
    if (text := _one(fields, "id")) is not None:
        values["id"] = _uuid(text)
    for name in ("min_seq", "max_seq"):
        if (text := _one(fields, name)) is not None:
            values[name] = _integer(name, text, 1, MAX_SEQ)
    for name in ("since", "until"):
        if (text := _one(fields, name)) is not None:
            values[name] = _instant(name, text)
    return MessageFilter(**values)


def selection_of(body: Mapping[str, Any]) -> Selection:
    """What an action request names: `seqs` (a list of seqs) or `filter` (an object of
    the search's fields, `state` a list), not both; a filter that names nothing would
    take the whole table, so it is refused."""
    seqs, where = body.get("seqs"), body.get("filter")
    if (seqs is None) == (where is None):
        raise ConfigurationError("name the messages: seqs, or a filter (not both)")
    if seqs is not None:
        if not isinstance(seqs, list) or not seqs:
            raise ConfigurationError("seqs: a list of at least one seq")
        if len(seqs) > MAX_NAMED:
            raise ConfigurationError(f"seqs: at most {MAX_NAMED} at once; use a filter")
        return [_seq(value) for value in seqs]
    if not isinstance(where, dict):
        raise ConfigurationError("filter: an object of search fields")
    unknown = set(where) - {*FILTER_FIELDS, "state"}
    if unknown:
        raise ConfigurationError(f"filter: unknown field {shown(sorted(unknown)[0])}")
    fields = {name: _strings(name, value) for name, value in where.items()}
    chosen = filter_of(fields)
    if chosen.empty:
        raise ConfigurationError("filter: name at least one field (it would take every message)")
    return chosen


def change_of(body: Mapping[str, Any], user: str | None = None) -> Change:
    """Who changes and why; `user`, the one the host application authenticated, is the
    actor whatever the body says."""
    actor, reason = user or body.get("actor"), body.get("reason")
    if not isinstance(actor, str):
        raise ConfigurationError("name who makes the change (the actor)")
    if reason is not None and not isinstance(reason, str):
        raise ConfigurationError("reason: text")
    return Change(actor.strip(), reason.strip() or None if reason else None)


def delay_of(body: Mapping[str, Any]) -> float:
    delay = body.get("delay", 0.0)
    if isinstance(delay, bool) or not isinstance(delay, int | float):
        raise ConfigurationError("delay: a number of seconds")
    if not 0 <= delay <= 366 * 86400:
        raise ConfigurationError("delay: 0 to 366 days, in seconds")
    return float(delay)


def action_of(name: str) -> AuditAction:
    if name not in {str(action) for action in ACTIONS}:
        raise ConfigurationError(f"action {shown(name)}: one of {', '.join(sorted(ACTIONS))}")
    return AuditAction(name)


def minutes_of(query: Mapping[str, Sequence[str]]) -> int:
    """The window of an activity request, in minutes (60 unless told)."""
    minutes = _one(query, "minutes")
    return 60 if minutes is None else _integer("minutes", minutes, 1, MAX_MINUTES)


def backfill_of(body: Mapping[str, Any], user: str | None = None) -> BackfillRequest:
    """A backfill request: `name`, `filter` (the search's fields; its `target` is the
    source), `to` and `external` (the destination), `rate` (per second, or null), and
    who asks and why."""
    name, to, external, rate = (
        body.get("name"),
        body.get("to"),
        body.get("external"),
        body.get("rate"),
    )
    if not isinstance(name, str) or not name.strip():
        raise ConfigurationError("name the backfill (name)")
    if not isinstance(to, str) or not to.strip():
        raise ConfigurationError("to: the target to copy the messages to")
    if not isinstance(external, bool | None):
        raise ConfigurationError("external: true or false")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)):
        raise ConfigurationError("rate: a number of messages per second, or null")
    if rate is not None and not 0 < rate <= MAX_RATE:
        raise ConfigurationError(f"rate: above 0, at most {MAX_RATE:g} messages per second")
    where = body.get("filter", {})
    if not isinstance(where, dict):
        raise ConfigurationError("filter: an object of search fields")
    unknown = set(where) - set(FILTER_FIELDS)
    if unknown:
        raise ConfigurationError(f"filter: unknown field {shown(sorted(unknown)[0])}")
    source = filter_of({field: _strings(field, value) for field, value in where.items()})
    return BackfillRequest(
        name=name.strip(),
        source=source,
        to=Target(_text("to", to.strip()), external=bool(external)),
        rate=None if rate is None else float(rate),
        change=change_of(body, user),
    )


def audit_page_of(query: Mapping[str, Sequence[str]]) -> tuple[int, int | None]:
    limit, before = _one(query, "limit"), _one(query, "before")
    return (
        50 if limit is None else _integer("limit", limit, 1, MAX_PAGE),
        None if before is None else _integer("before", before, 1, MAX_SEQ),
    )


# -- writing answers -------------------------------------------------------------------


def table_json(
    index: int,
    name: str,
    stats: OutboxStats,
    stuck: Sequence[TargetStuck],
    relays: Sequence[RelayMember],
) -> dict[str, Any]:
    """A table's overview: its counts by status; per target the messages still to
    deliver and those stuck (retrying, held, abandoned), with the oldest stuck one's
    time; and the live relays with the partitions each holds."""
    targets: dict[str, dict[str, Any]] = {
        target: _target(live) for target, live in stats.live_by_target.items()
    }
    for each in stuck:
        counts = targets.setdefault(each.target, _target(0))
        counts.update(retrying=each.retrying, held=each.held, abandoned=each.abandoned,
                      stuck_since=each.oldest_written)  # fmt: skip
    return {
        "index": index,
        "name": name,
        "counts": {str(status): count for status, count in stats.by_status().items()},
        "held": stats.held,
        "targets": {
            target: {**counts, "stuck_since": _time(counts["stuck_since"])}
            for target, counts in sorted(targets.items())
        },
        "oldest_pending_age": stats.oldest_pending_age,
        "active_leases": stats.active_leases,
        "relays": relays_json(relays),
    }


def relays_json(relays: Sequence[RelayMember]) -> list[dict[str, Any]]:
    """The live relays, each with the partitions it holds."""
    return [
        {
            "worker": relay.worker,
            "target": relay.target,
            "joined_at": _time(relay.joined_at),
            "lease_until": _time(relay.lease_until),
            "partitions": list(relay.partitions),
        }
        for relay in relays
    ]


def backfill_json(
    name: str, job: BackfillJob | None, running: bool, error: str | None
) -> dict[str, Any]:
    """Where a backfill stands: `job` as the table records it (None: not begun yet),
    whether this console runs it now, and why its last run here failed."""
    shown: dict[str, Any] = {"name": name, "running": running, "error": error, "job": None}
    if job is not None:
        shown["job"] = {
            "source_target": job.source.target,
            "to": job.target,
            "external": job.external,
            "cursor": job.cursor,
            "last_seq": job.source.max_seq,
            "copied": job.copied,
            "actor": job.actor,
            "reason": job.reason,
            "created_at": _time(job.created_at),
            "finished_at": _time(job.finished_at),
            "finished": job.finished_at is not None,
        }
    return shown


def plan_json(plan: BackfillPlan) -> dict[str, Any]:
    return {
        "count": plan.count,
        "keys": plan.keys,
        "keys_live_on_target": plan.keys_live_on_target,
    }


# -- inside ----------------------------------------------------------------------------


def _target(live: int) -> dict[str, Any]:
    return {"live": live, **{str(state): 0 for state in STUCK}, "stuck_since": None}


def _time(value: datetime.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _one(fields: Mapping[str, Sequence[str]], name: str) -> str | None:
    """The one value of `name` (None when absent or empty)."""
    values = [value for value in fields.get(name, ()) if value != ""]
    if len(values) > 1:
        raise ConfigurationError(f"{name}: give it once")
    return values[0] if values else None


def _strings(name: str, value: object) -> list[str]:
    """A filter field of a JSON body as the query's list of strings."""
    items = value if isinstance(value, list) and name == "state" else [value]
    if not all(isinstance(item, str | int) and not isinstance(item, bool) for item in items):
        raise ConfigurationError(f"filter: {name} must be text")
    return [str(item) for item in items]


def _state(text: str) -> MessageState:
    try:
        return MessageState(text)
    except ValueError:
        states = ", ".join(str(state) for state in MessageState)
        raise ConfigurationError(f"state {shown(text)}: one of {states}") from None


def _text(name: str, text: str) -> str:
    if len(text) > MAX_TEXT:
        raise ConfigurationError(f"{name}: at most {MAX_TEXT} characters")
    return text


def _uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise ConfigurationError(f"id {shown(text)}: not a UUID") from None


def _integer(name: str, text: str, low: int, high: int) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= 19):
        raise ConfigurationError(f"{name} {shown(text)}: a whole number from {low} to {high}")
    value = int(text)
    if not low <= value <= high:
        raise ConfigurationError(f"{name} {value}: a whole number from {low} to {high}")
    return value


def _seq(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigurationError("seqs: whole numbers")
    return _integer("seq", str(value), 1, MAX_SEQ)


def _instant(name: str, text: str) -> datetime.datetime:
    """An ISO 8601 time; one without a zone is UTC (what the form's fields send)."""
    try:
        value = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigurationError(
            f"{name} {shown(text)}: an ISO 8601 time, e.g. 2024-05-01T12:00:00Z"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=datetime.UTC)


def shown(text: str) -> str:
    """A value of the request, quoted and cut short, for an error message."""
    return json.dumps(text[:80] + ("..." if len(text) > 80 else ""))
