"""What an embedded relay tells its operator: a target that cannot be reached at start
(and the rest flowing meanwhile), circuits opening and closing, publish errors naming
their target, and /api/outbox counts read when asked."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from relaybox import Relay
from relaybox.core.circuit import CircuitState
from relaybox.core.publishing import PublishResult
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError
from relaybox.observability.prometheus import render
from relaybox.observability.snapshot import snapshot
from relaybox.publishers.memory import MemoryPublisher
from tests.relay_support import OutboxDB, eventually, fast_settings, messages, outbox_db, rows


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path, targets=("default", "audit")):
        yield each


class Unreachable(MemoryPublisher):
    """A broker that refuses connections until `up` is set, then takes everything."""

    def __init__(self) -> None:
        super().__init__()
        self.up = False
        self.tries = 0

    async def start(self) -> None:
        self.tries += 1
        if not self.up:
            raise BrokerUnavailableError("cannot connect to the test broker: refused")


class RaisesFirst(MemoryPublisher):
    """A publisher whose first call raises, as a client library's bug would."""

    def __init__(self) -> None:
        super().__init__()
        self.raised = False

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if not self.raised:
            self.raised = True
            raise RuntimeError("client library fell over")
        return await super().publish(messages)


async def test_a_target_down_at_start_waits_while_the_others_flow(db: OutboxDB) -> None:
    await db.write(messages(["a", "b"], per_key=5, targets=["default", "audit"]))
    default, audit = MemoryPublisher(), Unreachable()
    relay = Relay(db.database, {"default": default, "audit": audit}, table=db.table,
                  settings=fast_settings(published_retention=3600))  # fmt: skip
    async with relay:
        await eventually(lambda: len(default.published) == 10)
        assert audit.published == []
        (problem,) = relay.readiness()
        assert problem.startswith("target audit: cannot connect to the test broker: refused;")
        assert relay.circuits["audit"].state is CircuitState.OPEN
        audit.up = True
        await eventually(lambda: len(audit.published) == 10, timeout=30)
        await eventually(lambda: relay.readiness() == [])
    kept = rows(db)
    assert len(kept) == 20
    assert all(row.attempts == 0 for row in kept)  # the wait burnt no attempt
    assert audit.tries >= 2


async def test_circuits_opening_and_closing_are_logged_with_their_target(
    db: OutboxDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="relaybox")
    await db.write(messages(["a"], per_key=3, targets=["audit"]))
    audit = MemoryPublisher()
    audit.down()
    relay = Relay(db.database, {"default": MemoryPublisher(), "audit": audit},
                  table=db.table, settings=fast_settings())  # fmt: skip
    async with relay:
        await eventually(lambda: relay.circuits["audit"].state is not CircuitState.CLOSED)
        audit.heal()
        await eventually(lambda: len(audit.published) == 3)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.WARNING, "circuit opened for target audit") in said
    closed = [m for level, m in said if level == logging.INFO and "circuit closed" in m]
    assert closed == ["circuit closed for target audit: the broker answers again"]


async def test_a_publish_that_raises_is_logged_with_its_target(
    db: OutboxDB, caplog: pytest.LogCaptureFixture
) -> None:
    await db.write(messages(["a"], per_key=2, targets=["audit"]))
    audit = RaisesFirst()
    relay = Relay(db.database, {"default": MemoryPublisher(), "audit": audit},
                  table=db.table, settings=fast_settings())  # fmt: skip
    async with relay:
        await eventually(lambda: len(audit.published) == 2)
    raised = [r.getMessage() for r in caplog.records if "fell over" in r.getMessage()]
    assert raised
    assert all("target audit" in message for message in raised)


async def test_the_outbox_report_reads_the_counts_when_asked(db: OutboxDB) -> None:
    """A relay that samples its counts every 15 s (as `relaybox relay --http` does)
    still answers /api/outbox with counts read after the last delivery."""
    await db.write(messages(["a", "b"], per_key=5))
    default = MemoryPublisher()
    relay = Relay(db.database, {"default": default, "audit": MemoryPublisher()},
                  table=db.table, settings=fast_settings())  # fmt: skip
    relay.sample_stats(15.0)
    async with relay:
        await eventually(lambda: len(default.published) == 10)
        await eventually(lambda: not any(p.in_flight for p in relay.processors))
        settled = time.monotonic()
        await asyncio.sleep(3.0)  # older than the report's 2 s, younger than the 15 s
        report = await snapshot(relay)
        asked = time.monotonic()
    outbox = report["databases"]["db0"]["outbox"]
    # Younger than the time since every batch was settled: read after it, however slow.
    assert outbox["sample_age_seconds"] < asked - settled
    assert report["signals"]["pending"] == 0


async def test_the_metrics_say_which_targets_are_connected(db: OutboxDB) -> None:
    audit = Unreachable()
    relay = Relay(db.database, {"default": MemoryPublisher(), "audit": audit},
                  table=db.table, settings=fast_settings())  # fmt: skip
    async with relay:
        text = render(relay).decode()
        assert 'relaybox_target_connected{target="audit"} 0.0' in text
        assert 'relaybox_target_connected{target="default"} 1.0' in text
        assert 'relaybox_database_connected{database="db0"} 1.0' in text
        audit.up = True
        await eventually(lambda: not relay.unreachable, timeout=30)
        assert 'relaybox_target_connected{target="audit"} 1.0' in render(relay).decode()
