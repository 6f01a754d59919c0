"""Proof under faults: real relay processes, a throwaway database and broker, and faults
of every kind, judged by the checker and by the inbox's effects.

Each scenario runs on combinations of a database (PostgreSQL, MariaDB, SQLite) and a
broker (NATS, Redis, RabbitMQ). `make test` runs each one short: the fault scenario on
all nine combinations (on three that between them hold every database and every broker
with several faults of each kind, on the other six with one), the others on PostgreSQL
with NATS; `make chaos` runs them long
(RELAYBOX_CHAOS=full): the fault scenario on all nine combinations, PostgreSQL with NATS
at full size (100,000+ messages, 50+ relay SIGKILLs, 5+ broker restarts, 3+ database
restarts, 20+ connection cuts, with 4 relays) and the others smaller, and prints each
report. SQLite is a file: no database restarts and no database link cuts there.

Log mode runs as a tenth combination, "postgresql-log" with NATS: writers emit through
`LogOutbox`, relays stream the slot (`--mode log`), and every other relay SIGKILL hits
the one streaming it. It takes all three scenarios: `make test` runs the fault scenario
with several faults of each kind (as on the other CI combinations), `make chaos` at the
reference's full size; the judgement is the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from relaybox import Message
from tests.chaos.brokers import TOPIC, ChaosBroker
from tests.chaos.report import record
from tests.chaos.world import LEASE, ChaosWorld, Combination, Outcome

FULL = os.environ.get("RELAYBOX_CHAOS") == "full"


@dataclasses.dataclass(frozen=True)
class Plan:
    rate: float  # messages written per second
    kills: int
    broker_restarts: int
    database_restarts: int
    cuts: int
    slow_periods: int
    pause: float  # seconds between faults
    messages: int  # committed messages, at least
    outage: float  # the broker outage that outlasts the retry schedule


SHORT = Plan(
    rate=300, kills=6, broker_restarts=1, database_restarts=1, cuts=4, slow_periods=1,
    pause=1.5, messages=5_000, outage=8.0,
)  # fmt: skip
LONG = Plan(
    rate=700, kills=55, broker_restarts=6, database_restarts=4, cuts=24, slow_periods=3,
    pause=1.2, messages=100_000, outage=30.0,
)  # fmt: skip
#: The other combinations: every kind of fault, fewer of each, so that the whole
#: matrix fits in `make chaos` and the CI runs stay short.
SHORT_OTHER = Plan(
    rate=300, kills=3, broker_restarts=1, database_restarts=1, cuts=3, slow_periods=1,
    pause=1.5, messages=2_500, outage=8.0,
)  # fmt: skip
LONG_OTHER = Plan(
    rate=500, kills=16, broker_restarts=2, database_restarts=2, cuts=8, slow_periods=1,
    pause=1.2, messages=20_000, outage=30.0,
)  # fmt: skip
#: `make test` runs the six combinations beyond CI_COMBINATIONS this short: one fault of
#: each kind, so that every pairing of a database and a broker meets every fault there.
SMOKE = Plan(
    rate=300, kills=1, broker_restarts=1, database_restarts=1, cuts=1, slow_periods=0,
    pause=1.0, messages=1_000, outage=8.0,
)  # fmt: skip
PLAN = LONG if FULL else SHORT

REFERENCE = Combination("postgresql", "nats")
#: Log mode (writers emit into the WAL, relays stream the slot), on PostgreSQL with NATS.
LOG = Combination("postgresql-log", "nats")
#: Between them every database and every broker: CI's short runs with several faults.
CI_COMBINATIONS = [
    REFERENCE, Combination("mariadb", "redis"), Combination("sqlite", "rabbitmq"),
]  # fmt: skip
ALL_COMBINATIONS = [
    Combination(database, broker)
    for database in ("postgresql", "mariadb", "sqlite")
    for broker in ("nats", "redis", "rabbitmq")
] + [LOG]


def plan_for(combination: Combination) -> Plan:
    if combination == REFERENCE:
        return PLAN
    if combination == LOG:
        return LONG if FULL else SHORT_OTHER
    if FULL:
        plan = LONG_OTHER
    elif combination in CI_COMBINATIONS:
        plan = SHORT_OTHER
    else:
        plan = SMOKE
    if combination.database == "sqlite":  # a file: nothing to restart
        plan = dataclasses.replace(plan, database_restarts=0)
    return plan


def combinations(chosen: list[Combination]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("world", chosen, ids=lambda c: c.name, indirect=True)


@pytest.fixture
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ChaosWorld]:
    async with ChaosWorld(tmp_path, request.param, relays=4) as each:
        yield each


def publish(name: str, world: ChaosWorld, outcome: Outcome, **extra: object) -> None:
    """Print the report (`make chaos` shows it), keep it beside the test's files, and
    add its line to the table printed at the end of the run."""
    combination = world.combination.name
    record(name, combination, outcome, extra.get("seconds"))
    text = f"\n=== chaos: {name} on {combination} ===\n{outcome.summary()}"
    for key, value in extra.items():
        text += f"\n{key}: {value}"
    print(text)
    reports = os.environ.get("RELAYBOX_CHAOS_REPORTS") if FULL else None
    if reports:
        out = Path(reports)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name} {combination}.txt".replace(" ", "-")).write_text(text + "\n")


def judge(outcome: Outcome, *, rollbacks: bool = True) -> None:
    report = outcome.report
    assert not report.lost, f"lost {len(report.lost)}: {report.lost[:5]}"
    assert not report.ghosts, f"ghosts: {report.ghosts[:5]}"
    assert not report.order_violations, f"out of order: {report.order_violations[:5]}"
    assert not report.unexpected, report.unexpected[:5]
    assert not outcome.effects_twice, f"applied twice: {outcome.effects_twice[:5]}"
    assert not outcome.effects_ghosts, outcome.effects_ghosts[:5]
    assert not outcome.effects_missing, f"never applied: {outcome.effects_missing[:5]}"
    assert report.committed > 0
    if rollbacks:  # the forced rollbacks happened, and stayed unpublished
        assert report.rolled_back > 0


@combinations(ALL_COMBINATIONS)
async def test_nothing_lost_ghosted_or_reordered_under_every_kind_of_fault(
    world: ChaosWorld,
) -> None:
    plan, rng = plan_for(world.combination), random.Random(6)
    faults = (
        ["kill"] * plan.kills + ["broker"] * plan.broker_restarts
        + ["database"] * plan.database_restarts + ["cut"] * plan.cuts
        + ["slow"] * plan.slow_periods
    )  # fmt: skip
    rng.shuffle(faults)
    writers = world.writers(rate=plan.rate)
    started = time.monotonic()
    for kind in faults:
        await asyncio.sleep(plan.pause * rng.uniform(0.5, 1.5))
        if kind == "kill":
            await world.kill_relay(rng)
        elif kind == "broker":
            await world.restart_broker(down=rng.uniform(0.5, 2.0))
        elif kind == "database":
            await world.restart_database(down=rng.uniform(0.5, 2.0))
        elif kind == "cut":
            await world.cut(rng, seconds=rng.uniform(0.2, 2.0))
        else:
            await world.slow_broker(delay=0.05, seconds=3.0)
    while writers.committed < plan.messages:
        await asyncio.sleep(0.5)
    outcome = await world.finish(writers)
    elapsed = time.monotonic() - started
    extra: dict[str, object] = {}
    if world.database.log:  # of the kills, those that made another relay take the slot
        extra["kills_of_the_streaming_relay"] = world.relays.stream_kills
    publish(
        "every fault", world, outcome, relays=4, seconds=f"{elapsed:.0f}",
        relay_processes_started=world.relays.started, **extra,
    )  # fmt: skip
    assert not outcome.abandoned, f"abandoned by faults alone: {outcome.abandoned[:5]}"
    judge(outcome)
    kinds = [f.kind for f in outcome.faults]
    assert kinds.count("relay SIGKILL") == plan.kills
    assert kinds.count("broker restart") == plan.broker_restarts
    assert kinds.count("database restart") == plan.database_restarts
    assert sum(k.endswith("link cut") for k in kinds) == plan.cuts
    assert outcome.report.committed >= plan.messages


@combinations([*CI_COMBINATIONS, LOG] if FULL else [REFERENCE, LOG])
async def test_a_broker_outage_longer_than_the_retry_schedule_abandons_nothing(
    world: ChaosWorld,
) -> None:
    # The relays' schedule: 5 attempts, 0.2 s doubling to 1 s: about 2.4 s in all.
    plan = plan_for(world.combination)
    writers = world.writers(rate=plan.rate)
    started = time.monotonic()
    await asyncio.sleep(2.0)
    await world.restart_broker(down=plan.outage)
    await asyncio.sleep(2.0)
    outcome = await world.finish(writers)
    publish(
        "broker outage", world, outcome, outage_seconds=plan.outage,
        seconds=f"{time.monotonic() - started:.0f}",
    )  # fmt: skip
    assert outcome.abandoned == []
    judge(outcome)


@combinations([*CI_COMBINATIONS, LOG] if FULL else [REFERENCE, LOG])
async def test_a_poison_message_is_abandoned_and_the_other_keys_flow(world: ChaosWorld) -> None:
    """The broker refuses the poison messages for good (`ChaosBroker.poison`). With the
    relays stopped, a backlog is written twice, without and then with poison messages
    among it, and each is drained; its rate is its messages over the span of their
    publication timestamps, where the broker keeps them."""
    per_run, keys, pairs = (20_000, 200, 3) if FULL else (3_000, 50, 1)
    clean_backlogs, poisoned_backlogs = [], []
    for _ in range(pairs):  # alternated, so that a busy moment of the machine hits both
        clean_backlogs.append(backlog(world.broker, per_run, keys, poison=0))
        await drain_backlog(world, clean_backlogs[-1])
        poisoned_backlogs.append(backlog(world.broker, per_run, keys, poison=5))
        await drain_backlog(world, poisoned_backlogs[-1])
    poison_ids = {str(m.id) for b in poisoned_backlogs for m in b if m.key == "poison"}
    writers = world.writers(rate=PLAN.rate, count=0)  # no writer tasks: the backlogs only
    for clean_one, poisoned_one in zip(clean_backlogs, poisoned_backlogs, strict=True):
        writers.committed_elsewhere(clean_one)  # in the order they were written: the
        writers.committed_elsewhere(poisoned_one)  # checker takes it as each key's order
    outcome = await world.finish(writers)
    timed = bool(outcome.published_at)  # RabbitMQ stamps no arrival time
    rates: dict[str, object] = {}
    if timed:
        clean = statistics.median(drain_rate(outcome, b) for b in clean_backlogs)
        poisoned = statistics.median(drain_rate(outcome, b) for b in poisoned_backlogs)
        rates = {
            "clean_msgs_per_s": [f"{drain_rate(outcome, b):.0f}" for b in clean_backlogs],
            "poisoned_msgs_per_s": [f"{drain_rate(outcome, b):.0f}" for b in poisoned_backlogs],
            "median_ratio": f"{poisoned / clean:.2f}",
        }
    publish("poison message", world, outcome, pairs=pairs, **rates)
    assert {i for i, _ in outcome.abandoned} == poison_ids
    refusal = world.broker.refusal
    assert all(any(word in error for word in refusal) for _, error in outcome.abandoned), (
        outcome.abandoned
    )
    report = outcome.report
    assert set(report.lost) == poison_ids  # abandoned, so never delivered
    assert not report.order_violations
    assert not report.unexpected
    assert not outcome.effects_twice
    assert set(outcome.effects_missing) == poison_ids
    # A measurement: `make chaos` holds the acceptance figure, CI does not. Log mode only
    # prints it: there no message waits for a poison one (the stream sends it to the
    # table at its first refusal and goes on), and the stream drains each backlog in
    # about a second, too short a span to hold a 10 % figure on a shared machine (the
    # median ratio was 0.59-1.06 over four runs, single pairs 0.32-1.12).
    if FULL and timed and not world.database.log:
        assert poisoned / clean >= 0.9, f"the other keys kept {poisoned / clean:.0%}"


def drain_rate(outcome: Outcome, messages: list[Message]) -> float:
    """Messages published per second over the span of their publication."""
    stamps = [outcome.published_at[str(m.id)] for m in messages if m.key != "poison"]
    return len(stamps) / (max(stamps) - min(stamps))


def backlog(broker: ChaosBroker, count: int, keys: int, poison: int) -> list[Message]:
    messages = [Message(topic=TOPIC, key=f"key-{n % keys}", payload={"n": n}) for n in range(count)]
    for n in range(poison):  # spread through the backlog, one key of their own
        messages.insert((n + 1) * count // (poison + 1), broker.poison(n))
    return messages


async def drain_backlog(world: ChaosWorld, messages: list[Message]) -> None:
    """Stop the relays, write `messages`, start the relays and wait for the drain."""
    await asyncio.to_thread(world.relays.stop_relays)
    for start in range(0, len(messages), 1000):
        await world.write(messages[start : start + 1000])
    await asyncio.gather(*(world.start_relay(slot) for slot in range(world.relay_count)))
    await world.drained(timeout=120 + 2 * LEASE)
