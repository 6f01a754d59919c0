"""The JSON of `GET /api/outbox`: every signal of a running relay as plain data.

The operational signals first (pending, failed and waiting for a retry, the retry rate,
abandoned, the keys held back, and the oldest pending age) over every database, then
per database and per target. Every URL and error text in it passes `mask_url` on its
way out, whatever its source already masked.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from relaybox.core.circuit import CircuitState
from relaybox.core.log_records import format_lsn
from relaybox.core.signals import StatsSample, TargetCounters
from relaybox.core.urls import mask_url

if TYPE_CHECKING:
    from relaybox.relay.engine import Relay, Unreachable
    from relaybox.relay.log_stream import LogStreamer
    from relaybox.relay.processor import Processor


async def snapshot(relay: Relay, max_age: float = 2.0) -> dict[str, Any]:
    """`relay`'s signals now, the table's counts read again where older than `max_age`
    seconds, whatever the relay's sampling interval: what a person reads must be now."""
    await relay.refresh_stats(max_age=max_age)
    now = time.monotonic()
    databases: dict[str, Any] = {}
    processors = {p.name: p for p in relay.processors}
    for name, url in relay.database_urls.items():
        processor = processors.get(name)
        unreachable = relay.unreachable.get(name)
        databases[name] = (
            _database(relay, processor, url, now) if processor is not None
            else {"url": _shown(url), "error": _error(unreachable)}
        )  # fmt: skip
    counters = relay.target_counters()
    targets = {}
    for name, counted in counters.items():
        unreachable = relay.unreachable.get(f"target {name}")
        error = _error(unreachable)
        targets[name] = _target(counted, relay.circuits[name].state, error)
    problems = relay.readiness()
    result = {
        "worker": relay.worker,
        "table": relay.table,
        "uptime_seconds": None if relay.started_at is None else time.time() - relay.started_at,
        "ready": not problems,
        "problems": [mask_url(problem) for problem in problems],
        "signals": _signals(
            [p.stats_sample if (p := processors.get(name)) else None for name in databases],
            counters.values(),
        ),
        "databases": databases,
        "targets": targets,
    }
    streamers = getattr(relay, "streamers", None)  # a LogRelay's (log mode)
    if streamers is not None:
        result["log_streams"] = {s.name: _stream(s) for s in streamers}
    return result


def _stream(streamer: LogStreamer) -> dict[str, Any]:
    metrics = streamer.metrics
    return {
        "streaming": streamer.streaming, "standing_by": streamer.standing_by,
        "error": _shown(streamer.last_error), "confirmed_lsn": format_lsn(streamer.confirmed),
        "transactions": metrics.transactions, "published": metrics.published,
        "to_table": metrics.diverted, "undecodable": metrics.undecodable,
        "sessions": metrics.sessions, "keys_held_for_the_table": len(streamer.blocked),
    }  # fmt: skip


def _shown(text: str | None) -> str | None:
    return None if text is None else mask_url(text)


def _error(unreachable: Unreachable | None) -> str | None:
    return None if unreachable is None else mask_url(unreachable.error)


def _database(
    relay: Relay, processor: Processor[Any], url: str | None, now: float
) -> dict[str, Any]:
    return {
        "url": _shown(url),
        "error": None,
        "partitions_held": processor.partitions_held,
        "partition_count": relay.settings.partitions,
        "batches_in_flight": processor.in_flight,
        "last_heartbeat_seconds_ago": (
            None if processor.heartbeat_at is None else now - processor.heartbeat_at
        ),
        "counters": dataclasses.asdict(processor.metrics),
        "unserved_targets": dict(processor.unserved),
        "outbox": _sample(processor.stats_sample, now),
    }


def _sample(sample: StatsSample | None, now: float) -> dict[str, Any] | None:
    if sample is None:
        return None
    stats = sample.stats
    return {
        "counts": None if stats is None else stats.by_status(),
        "oldest_pending_age_seconds": None if stats is None else stats.oldest_pending_age,
        "active_leases": None if stats is None else stats.active_leases,
        "live_by_target": None if stats is None else dict(stats.live_by_target),
        "held": None if stats is None else stats.held,
        "held_keys": None if stats is None else stats.held_keys,
        "sample_age_seconds": sample.age(now),
        "error": _shown(sample.error),
    }


def _target(counters: TargetCounters, state: CircuitState, error: str | None) -> dict[str, Any]:
    return {
        "connected": error is None,
        "error": error,
        "circuit": state.value,
        "acked": counters.acked,
        "retried": counters.retried,
        "abandoned": counters.abandoned,
        "unavailable": counters.unavailable,
        "retry_rate": counters.retry_rate,
        "publish_calls": counters.publish_seconds.count,
        "publish_seconds_total": counters.publish_seconds.sum,
    }


def _signals(
    samples: list[StatsSample | None], targets: Iterable[TargetCounters]
) -> dict[str, Any]:
    """Pending, failed (waiting for a retry), the retry rate, abandoned and the keys
    held back, with the oldest pending age. Counts are None until every table was
    read."""
    read = [s.stats for s in samples if s is not None and s.stats is not None]
    total = TargetCounters()
    for counters in targets:
        total = total.merged(counters)
    ages = [s.oldest_pending_age for s in read if s.oldest_pending_age is not None]
    counted = bool(read) and len(read) == len(samples)
    return {
        "pending": sum(s.pending for s in read) if counted else None,
        "failed": sum(s.failed for s in read) if counted else None,
        "retry_rate": total.retry_rate,
        "abandoned": sum(s.abandoned for s in read) if counted else None,
        "held_keys": sum(s.held_keys for s in read) if counted else None,
        "oldest_pending_age_seconds": max(ages, default=None) if counted else None,
    }
