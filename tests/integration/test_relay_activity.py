"""A relay writes its activity per target for the operator's console, on each database:
what it published, each target's circuit state and last error (secrets masked), once
more on stop; and a write that fails is logged once and stops nothing."""

from __future__ import annotations

import datetime
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from relaybox import Relay
from relaybox.core.circuit import CircuitState
from relaybox.core.publishing import PublishResult
from relaybox.core.records import StoredMessage
from relaybox.publishers.memory import MemoryPublisher
from tests.databases import execute
from tests.relay_support import OutboxDB, eventually, fast_settings, messages, outbox_db

SECRET = "hunter2"


@pytest.fixture(params=["postgresql", "mysql", "sqlite"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(request.param, tmp_path, targets=("default", "audit")):
        yield each


class Refusing(MemoryPublisher):
    """A broker whose every publish raises, naming a URL with a password."""

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        raise ConnectionError(f"amqp://relay:{SECRET}@broker.example:5672/ refused")


def hour_ago() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)


async def published_by_target(db: OutboxDB) -> dict[str, int]:
    found: dict[str, int] = {}
    for point in await db.storage.activity(since=hour_ago()):
        found[point.target] = found.get(point.target, 0) + point.published
    return found


@pytest.mark.parametrize("partition_leases", [True, False])
async def test_after_a_stop_the_activity_holds_every_published_message_and_a_status(
    db: OutboxDB, partition_leases: bool
) -> None:
    await db.write(messages(["a", "b", None], per_key=4, targets=["default", "audit"]))
    default, audit = MemoryPublisher(), MemoryPublisher()
    # Only the write on stop falls within the test: an hour between the others.
    settings = fast_settings(activity_interval=3600.0, partition_leases=partition_leases)
    relay = Relay(db.database, {"default": default, "audit": audit}, table=db.table,
                  settings=settings, worker="relay-1")  # fmt: skip
    async with relay:
        await eventually(lambda: len(default.published) == 12 and len(audit.published) == 12)
        assert await db.storage.activity(since=hour_ago()) == []
    assert await published_by_target(db) == {"audit": 12, "default": 12}
    lags = [point.lag for point in await db.storage.activity(since=hour_ago())]
    assert sum(lag.count for lag in lags) >= 2  # a publish call each, at least
    statuses = await db.storage.relay_statuses()
    assert [(s.worker, s.target, s.circuit, s.last_error) for s in statuses] == [
        ("relay-1", "audit", CircuitState.CLOSED, None),
        ("relay-1", "default", CircuitState.CLOSED, None),
    ]


async def test_a_running_relay_shows_an_open_circuit_and_its_last_error_masked(
    db: OutboxDB,
) -> None:
    await db.write(messages(["a"], per_key=2, targets=["default", "audit"]))
    default, audit = MemoryPublisher(), Refusing()
    relay = Relay(db.database, {"default": default, "audit": audit}, table=db.table,
                  settings=fast_settings(activity_interval=0.05), worker="relay-2")  # fmt: skip

    async def audit_open() -> bool:
        found = {s.target: s for s in await db.storage.relay_statuses()}
        return "audit" in found and found["audit"].circuit is CircuitState.OPEN

    async with relay:
        await eventually(lambda: len(default.published) == 2)
        await eventually(audit_open)
        await eventually(lambda: published_by_target(db))
        found = {s.target: s for s in await db.storage.relay_statuses()}
    error = found["audit"].last_error
    assert error is not None
    assert "refused" in error
    assert SECRET not in error
    assert found["default"].last_error is None
    assert (await published_by_target(db)).get("default") == 2


async def test_a_failing_activity_write_is_logged_once_and_the_relay_goes_on(
    db: OutboxDB, caplog: pytest.LogCaptureFixture
) -> None:
    execute(db.url, f"DROP TABLE {db.table}_activity")
    await db.write(messages(["a", "b"], per_key=5, targets=["default"]))
    default = MemoryPublisher()
    relay = Relay(db.database, {"default": default, "audit": MemoryPublisher()},
                  table=db.table, settings=fast_settings(activity_interval=0.02))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="relaybox.relay.activity"):
        async with relay:
            await eventually(lambda: len(default.published) == 10)
            processor = relay.processors[0]
            await eventually(lambda: processor._activity_log._failures >= 3)
            assert relay.readiness() == []
            await db.write(messages(["c"], per_key=3, targets=["default"]))
            await eventually(lambda: len(default.published) == 13)
    failures = [r for r in caplog.records if "activity failed" in r.getMessage()]
    assert len(failures) == 1
