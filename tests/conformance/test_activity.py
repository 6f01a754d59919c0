"""The relays' activity and status rows, on every backend: counts add up per target and
minute over writes and relays, statuses are the live relays' last word, and the purge
deletes only what is past its retention."""

from __future__ import annotations

import asyncio
import datetime

from relaybox.core.activity import NO_LAG, Lag, TargetActivity
from relaybox.core.circuit import CircuitState
from relaybox.operations import watch
from tests.conformance.conftest import Backend

CLOSED, OPEN = CircuitState.CLOSED, CircuitState.OPEN


def hour_ago() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)


def counts(
    target: str, published: int = 0, failed: int = 0, abandoned: int = 0,
    lag: Lag = NO_LAG, circuit: CircuitState = CLOSED, error: str | None = None,
) -> TargetActivity:  # fmt: skip
    return TargetActivity(target, circuit, error, published, failed, abandoned, lag)


async def test_counts_add_up_per_target_and_minute_over_writes_and_relays(
    backend: Backend,
) -> None:
    storage = backend.storage
    await storage.record_activity("w1", [counts("a", 3, 1, 0, Lag(1.5, 1.0, 2)),
                                         counts("b", 2)])  # fmt: skip
    await storage.record_activity("w1", [counts("a", 4, 0, 1, Lag(3.0, 3.0, 1))])
    await storage.record_activity("w2", [counts("a", 5, 0, 0, Lag(0.5, 0.5, 1))])
    points = await storage.activity(since=hour_ago())
    # The writes may straddle a minute: sum each target's points.
    by_target: dict[str, list[int]] = {}
    lags: dict[str, Lag] = {}
    for point in points:
        summed = by_target.setdefault(point.target, [0, 0, 0])
        for index, value in enumerate((point.published, point.failed, point.abandoned)):
            summed[index] += value
        lags[point.target] = lags.get(point.target, Lag()).merged(point.lag)
        assert point.minute.tzinfo is not None
        assert point.minute.second == 0
    assert by_target == {"a": [12, 1, 1], "b": [2, 0, 0]}
    assert lags["a"] == Lag(5.0, 3.0, 4)
    assert lags["b"] == Lag()
    assert [p.target for p in points] == sorted(p.target for p in points)


async def test_activity_since_leaves_out_earlier_minutes(backend: Backend) -> None:
    await backend.storage.record_activity("w1", [counts("a", 1)])
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=2)
    assert await backend.storage.activity(since=later) == []
    assert len(await backend.storage.activity(since=hour_ago())) >= 1


async def test_a_write_with_nothing_counted_keeps_the_status_only(backend: Backend) -> None:
    await backend.storage.record_activity("w1", [counts("a", circuit=OPEN, error="refused")])
    assert await backend.storage.activity(since=hour_ago()) == []
    (status,) = await backend.storage.relay_statuses()
    assert (status.worker, status.target, status.circuit, status.last_error) == (
        "w1", "a", OPEN, "refused",
    )  # fmt: skip


async def test_a_status_is_the_relays_last_word_per_target(backend: Backend) -> None:
    storage = backend.storage
    before = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=5)
    await storage.record_activity("w2", [counts("a", circuit=OPEN, error="broker down")])
    await storage.record_activity("w1", [counts("b"), counts("a", 1, error="old")])
    await storage.record_activity("w2", [counts("a", 1, error="broker down, then up")])
    statuses = await storage.relay_statuses()
    assert [(s.target, s.worker, s.circuit, s.last_error) for s in statuses] == [
        ("a", "w1", CLOSED, "old"),
        ("a", "w2", CLOSED, "broker down, then up"),
        ("b", "w1", CLOSED, None),
    ]
    assert all(s.updated_at >= before and s.updated_at.tzinfo is not None for s in statuses)


async def test_a_status_not_written_lately_is_no_live_relays(backend: Backend) -> None:
    await backend.storage.record_activity("w1", [counts("a")])
    await asyncio.sleep(0.3)
    assert await backend.storage.relay_statuses(within=0.1) == []
    assert len(await backend.storage.relay_statuses(within=60)) == 1


async def test_the_purge_deletes_only_rows_past_the_retention_in_batches(
    backend: Backend,
) -> None:
    storage = backend.storage
    await storage.record_activity("w1", [counts("a", 1), counts("b", 1)])
    assert await storage.purge_activity(older_than=3600, batch_size=1) == 0
    assert len(await storage.relay_statuses()) == 2
    await asyncio.sleep(0.05)
    # A retention that ends two minutes ahead makes the current minute past it.
    assert await storage.purge_activity(older_than=-120, batch_size=1) == 4
    assert await storage.activity(since=hour_ago()) == []
    assert await storage.relay_statuses() == []


async def test_the_console_gets_a_point_for_every_minute_of_the_window(
    backend: Backend,
) -> None:
    storage = backend.storage
    await storage.record_activity("w1", [counts("a", 3, lag=Lag(3.0, 2.0, 2))])
    await storage.record_activity("w1", [counts("b", circuit=OPEN, error="refused")])
    now = datetime.datetime.now(datetime.UTC)
    (series,) = await watch.outbox_activity(storage, now - datetime.timedelta(minutes=10))
    assert series.target == "a"  # a target without activity has no series
    minutes = [p.minute for p in series.points]
    assert minutes == [minutes[0] + datetime.timedelta(minutes=n) for n in range(len(minutes))]
    assert minutes[0] == (now - datetime.timedelta(minutes=10)).replace(second=0, microsecond=0)
    assert len(minutes) in (11, 12)  # 12 if the window's end crossed a minute
    assert sum(p.published for p in series.points) == 3
    (shown,) = watch.target_series_json([series]).values()
    active = [p for p in shown if p["published"]]
    assert [(p["lag_avg_seconds"], p["lag_max_seconds"]) for p in active] == [(1.5, 2.0)]
    assert {(p["published"], p["lag_max_seconds"]) for p in shown if p not in active} == {(0, None)}
    statuses = await watch.relay_statuses(storage)
    assert [
        (s["target"], s["circuit"], s["last_error"]) for s in watch.statuses_json(statuses)
    ] == [
        ("a", "closed", None),
        ("b", "open", "refused"),
    ]
