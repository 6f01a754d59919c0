"""Fleets whose relays serve different targets: each target's partitions are leased
among the relays that serve it, so no relay holds back rows it cannot publish; rows of
a target that no live relay serves are reported (log, readiness, metrics)."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import pytest

from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import Relay
from tests.relay_support import (
    RELAY_BACKENDS,
    OutboxDB,
    eventually,
    fast_settings,
    messages,
    outbox_db,
)


@pytest.fixture(params=RELAY_BACKENDS)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(request.param, tmp_path, targets=("default", "audit")):
        yield each


def relay(db: OutboxDB, brokers: Mapping[str, MemoryPublisher], **settings: object) -> Relay:
    return Relay(db.database, dict(brokers), table=db.table, settings=fast_settings(**settings))


def orders(published: Sequence[StoredMessage]) -> dict[str | None, list[int]]:
    """Each key's payload numbers, in the order they were published."""
    order: dict[str | None, list[int]] = defaultdict(list)
    for message in sorted(published, key=lambda m: m.seq):
        order[message.key].append(json.loads(message.payload)["n"])
    return order


def in_key_order(published: Sequence[StoredMessage], per_key: int) -> bool:
    return all(numbers == list(range(per_key)) for numbers in orders(published).values())


async def test_relays_serving_different_targets_deliver_every_target_s_rows(
    db: OutboxDB,
) -> None:
    """One relay serves only `default`, the other only `audit`: with one set of
    partitions shared by both, each would hold back the other's rows in its half."""
    keys = [f"k{i}" for i in range(24)]
    await db.write(messages(keys, per_key=4, targets="default"))
    await db.write(messages(keys, per_key=4, targets="audit"))
    default, audit = MemoryPublisher(), MemoryPublisher()
    async with relay(db, {"default": default}), relay(db, {"audit": audit}):
        await eventually(lambda: len(default.published) >= 96 and len(audit.published) >= 96)
    for publisher in (default, audit):
        ids = [m.id for m in publisher.published]
        assert len(ids) == len(set(ids)) == 96
        assert in_key_order(publisher.published, per_key=4)
    assert {m.target for m in default.published} == {"default"}
    assert {m.target for m in audit.published} == {"audit"}


async def test_a_rolling_deploy_that_adds_a_target_strands_nothing(db: OutboxDB) -> None:
    """Old relays serve `default`; new ones serve `default` and `audit`, join while
    rows flow, and the old ones leave: every row goes out once, in key order."""
    keys = [f"k{i}" for i in range(16)]
    old_default, new_default, new_audit = MemoryPublisher(), MemoryPublisher(), MemoryPublisher()
    batches = [messages(keys, per_key=3, targets=["default", "audit"]) for _ in range(3)]
    old = relay(db, {"default": old_default})
    await old.start()
    try:
        await db.write(batches[0])
        async with relay(db, {"default": new_default, "audit": new_audit}):
            await db.write(batches[1])
            # During the rollout, with old and new relays side by side:
            await eventually(lambda: len(new_audit.published) >= 96)
            await old.stop()
            await db.write(batches[2])
            await eventually(
                lambda: (
                    len(old_default.published) + len(new_default.published) >= 144
                    and len(new_audit.published) >= 144
                )
            )
    finally:
        await old.stop()
    defaults = old_default.published + new_default.published
    for published in (defaults, new_audit.published):
        ids = [m.id for m in published]
        assert len(ids) == len(set(ids)) == 144
        by_key = orders(published)
        for key in keys:  # three batches of 0, 1, 2 each
            assert by_key[key] == [0, 1, 2] * 3, key
    assert new_default.published, "the new relays took a share of the default target"


async def test_rows_of_a_target_no_live_relay_serves_are_reported(
    db: OutboxDB, caplog: pytest.LogCaptureFixture
) -> None:
    await db.write(messages(["a", "b"], per_key=3, targets="audit"))
    await db.write(messages(["a"], per_key=1, targets="default"))
    default, audit = MemoryPublisher(), MemoryPublisher()
    caplog.set_level(logging.WARNING, logger="relaybox")
    async with relay(db, {"default": default}) as alone:
        await eventually(lambda: alone.processors[0].unserved == {"audit": 6})
        assert any("audit" in p and "no live relay" in p for p in alone.readiness())
        assert any("audit (6 rows)" in r.getMessage() for r in caplog.records)
        async with relay(db, {"audit": audit}):
            await eventually(lambda: len(audit.published) == 6)
            await eventually(lambda: alone.processors[0].unserved == {})
            assert not [p for p in alone.readiness() if "no live relay" in p]
    assert len(default.published) == 1


class _Unreachable(MemoryPublisher):
    """A broker the relay cannot reach (yet)."""

    async def start(self) -> None:
        raise BrokerUnavailableError("cannot connect to the test's broker: refused")


async def test_a_relay_that_has_not_reached_a_target_s_broker_holds_none_of_its_rows(
    db: OutboxDB,
) -> None:
    """Its partitions of that target go to the relays that reached the broker."""
    keys = [f"k{i}" for i in range(24)]
    await db.write(messages(keys, per_key=3, targets="default"))
    reached = MemoryPublisher()
    async with relay(db, {"default": _Unreachable()}) as cut_off:
        async with relay(db, {"default": reached}):
            await eventually(lambda: len(reached.published) >= 72)
        assert (cut_off.processors[0].partitions or {}).get("default", frozenset()) == set()
    assert in_key_order(reached.published, per_key=3)
