"""Scenarios beyond the fault plan, through the world's seams: relays started while
their broker is down, a fleet whose relays serve different targets, and a database
whose open connections never answer again. `make test` runs each on PostgreSQL with
NATS; `make chaos` also on MariaDB with Redis and SQLite with RabbitMQ (a SQLite file
has no connection to stall).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relaybox import Message, Outbox
from tests.chaos.brokers import TOPIC
from tests.chaos.test_chaos import CI_COMBINATIONS, FULL, REFERENCE, judge
from tests.chaos.world import ChaosWorld, Combination

#: The combinations each scenario runs on.
CHOSEN = CI_COMBINATIONS if FULL else [REFERENCE]
each = pytest.mark.parametrize("combination", CHOSEN, ids=lambda c: c.name)
with_connections = pytest.mark.parametrize(
    "combination", [c for c in CHOSEN if c.database != "sqlite"], ids=lambda c: c.name
)


@each
async def test_a_relay_started_while_its_broker_is_down_delivers_once_it_is_back(
    tmp_path: Path, combination: Combination
) -> None:
    async with ChaosWorld(tmp_path, combination, relays=2, start_relays=False) as world:
        await world.broker.halt()
        writers = world.writers(rate=200)
        starting = asyncio.gather(*(world.start_relay(slot) for slot in range(2)))
        await asyncio.sleep(5.0)
        await world.broker.resume()
        await starting
        await asyncio.sleep(2.0)
        outcome = await world.finish(writers)
        assert world.relays.started == 2  # neither had to be started again
        assert outcome.abandoned == []
        judge(outcome)


@each
async def test_a_fleet_whose_relays_serve_different_targets_delivers_every_target(
    tmp_path: Path, combination: Combination
) -> None:
    async with ChaosWorld(tmp_path, combination, relays=4, start_relays=False) as world:
        world.outbox = Outbox(table=world.table, targets=["billing", "shipping"])
        for slot in range(4):
            world.relays.targets[slot] = ["billing" if slot < 2 else "shipping"]
            await world.start_relay(slot)
        writers = world.writers(rate=0, count=0)  # the messages below only
        for n in range(20):
            batch = [
                Message(topic=TOPIC, key=f"key-{k}", payload={"n": n, "k": k},
                        targets=["billing" if k % 2 else "shipping"])
                for k in range(50)
            ]  # fmt: skip
            await world.write(batch)
            writers.committed_elsewhere(batch)
        outcome = await world.finish(writers, timeout=60.0)
        assert outcome.abandoned == []
        judge(outcome, rollbacks=False)


@with_connections
async def test_a_relay_whose_database_connections_hang_after_a_failover_carries_on(
    tmp_path: Path, combination: Combination
) -> None:
    """The open connections never answer again; new ones reach the database. (A
    statement may take 3 s here, so that the relay gives up on them sooner than by
    default.)"""
    async with ChaosWorld(tmp_path, combination, relays=1, start_relays=False) as world:
        world.relays.db_options["command_timeout"] = "3"
        await world.start_relay(0)
        writers = world.writers(rate=200)
        await asyncio.sleep(2.0)
        await world.stall_database(0)
        await asyncio.sleep(2.0)
        await asyncio.to_thread(world.relays.db_proxies[0].strand)
        await asyncio.sleep(5.0)
        outcome = await world.finish(writers, timeout=60.0)
        assert world.relays.started == 1
        assert outcome.abandoned == []
        judge(outcome)
