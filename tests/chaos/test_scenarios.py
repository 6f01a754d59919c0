"""Scenarios beyond the fault plan, through the world's seams, on PostgreSQL with NATS:
a fleet whose relays serve different targets.
"""

from __future__ import annotations

from pathlib import Path

from relaybox import Message, Outbox
from tests.chaos.brokers import TOPIC
from tests.chaos.test_chaos import REFERENCE, judge
from tests.chaos.world import ChaosWorld


async def test_a_fleet_whose_relays_serve_different_targets_delivers_every_target(
    tmp_path: Path,
) -> None:
    async with ChaosWorld(tmp_path, REFERENCE, relays=4, start_relays=False) as world:
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
