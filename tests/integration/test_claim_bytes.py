"""A relay's claims hold no more payload than its byte budget (`max_claim_bytes`), on
every backend and both ways of holding rows, and every message still goes, in order: a
message larger than the budget goes alone."""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from relaybox import Message
from relaybox.core.publishing import ACKED, PublisherFeatures, PublishResult
from relaybox.core.records import Claim, StoredMessage
from relaybox.relay import Relay, RelaySettings
from tests.relay_support import RELAY_BACKENDS, OutboxDB, eventually, fast_settings, outbox_db

KIB = 1024
MIB = 1024 * KIB


@pytest.fixture(params=RELAY_BACKENDS)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(request.param, tmp_path):
        yield each


@pytest.fixture
async def pg(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path):
        yield each


class Tally:
    """A publisher that keeps, of what it confirms, each key's sequence numbers (from the
    `n` header) and nothing of the payloads."""

    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(self) -> None:
        self.order: dict[str | None, list[int]] = defaultdict(list)
        self.count = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        for message in messages:
            self.order[message.key].append(int(message.headers["n"]))
        self.count += len(messages)
        return [ACKED] * len(messages)


class Reads:
    """A claims connection that notes the payload sizes of every read or claim."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.sizes: list[list[int]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def read(self, **options: object) -> list[StoredMessage]:
        found: list[StoredMessage] = await self._inner.read(**options)  # type: ignore[attr-defined]
        self.sizes.append([len(m.payload) for m in found])
        return found

    async def claim(self, *args: object, **options: object) -> Claim:
        found: Claim = await self._inner.claim(*args, **options)  # type: ignore[attr-defined]
        self.sizes.append([len(m.payload) for m in found.messages])
        return found


def watch(relay: Relay) -> Reads:
    """Note every read of the relay's one processor from now on (called right after the
    relay started, before the test awaits anything, it sees the first read too)."""
    (processor,) = relay.processors
    reads = Reads(processor._db.claims)
    processor._db = dataclasses.replace(processor._db, claims=reads)
    return reads


def sized(key: str | None, n: int, size: int) -> Message:
    return Message(
        topic="blobs", key=key, payload=os.urandom(size), headers={"n": str(n)},
        max_payload_bytes=max(size, MIB),
    )  # fmt: skip


def within(sizes: list[int], budget: int) -> bool:
    """A read within the budget, or one message alone."""
    return sum(sizes) <= budget or len(sizes) == 1


@pytest.mark.parametrize("partition_leases", [True, False], ids=["partitions", "rows"])
async def test_no_claim_holds_more_than_the_byte_budget(
    db: OutboxDB, partition_leases: bool
) -> None:
    budget = 600 * KIB
    keys = ["a", "b", "c", None]
    backlog = [sized(key, n, 100 * KIB) for n in range(12) for key in keys]
    backlog.insert(20, sized("b", -1, 900 * KIB))  # larger than the budget on its own
    await db.write(backlog)
    tally = Tally()
    settings = fast_settings(max_claim_bytes=budget, partition_leases=partition_leases)
    async with Relay(db.database, {"default": tally}, table=db.table, settings=settings) as relay:
        reads = watch(relay)
        await eventually(lambda: tally.count == len(backlog), timeout=60)
    taken = [sizes for sizes in reads.sizes if sizes]
    assert all(within(sizes, budget) for sizes in taken), taken
    assert [900 * KIB] in taken
    assert max(sum(sizes) for sizes in taken if len(sizes) > 1) > budget // 2  # not one by one
    expected: dict[str | None, list[int]] = defaultdict(list)
    for message in backlog:
        expected[message.key].append(int(message.headers["n"]))
    assert sorted(tally.order.pop(None)) == sorted(expected.pop(None))  # keyless: unordered
    assert tally.order == expected  # every message once, each key in order


async def test_a_backlog_of_large_messages_is_read_within_the_default_budget(
    pg: OutboxDB,
) -> None:
    """200 messages of 1 MiB: a relay with its default settings reads a few at a time,
    where a whole batch of them would hold 200 MiB."""
    keys = [f"k{i}" for i in range(5)] + [None]
    for start in range(0, 200, 20):  # written in parts: this process holds little at once
        await pg.write(sized(keys[n % 6], n, MIB) for n in range(start, start + 20))
    tally = Tally()
    settings = RelaySettings(min_poll_interval=0.005, idle_interval=0.05)
    budget = 8 * MIB  # the default max_claim_bytes (docs/configuration.md)
    async with Relay(pg.url, {"default": tally}, table=pg.table, settings=settings) as relay:
        reads = watch(relay)
        await eventually(lambda: tally.count == 200, timeout=120)
    taken = [sizes for sizes in reads.sizes if sizes]
    assert max(sum(sizes) for sizes in taken) <= budget, [len(sizes) for sizes in taken]
    assert sum(map(len, taken)) == 200
    assert sorted(tally.order[None]) == list(range(5, 200, 6))  # keyless: unordered
    assert all(tally.order[key] == list(range(i, 200, 6)) for i, key in enumerate(keys[:5]))


@pytest.fixture
async def two_targets(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("memory", tmp_path, targets=("default", "audit")):
        yield each


async def test_a_claim_over_several_sets_of_partitions_keeps_one_budget(
    two_targets: OutboxDB,
) -> None:
    """Relay `both` serves two targets; relay `audit` shares one of them, so `both` holds
    all of one target's partitions and half of the other's, and reads each set on its
    own in every claim. The claim's payloads stay within one budget over both reads, and
    a message larger than the budget, on either target, still goes (alone)."""
    db, budget, large = two_targets, 300 * KIB, 400 * KIB
    backlog = [
        Message(topic="blobs", key=key, payload=os.urandom(size), headers={"n": str(n)},
                targets=[target])
        for n in range(10)
        for target in ("default", "audit")
        for key, size in (("a", 60 * KIB), ("b", 60 * KIB), (None, large if n == 5 else 1))
    ]  # fmt: skip
    default, audit, shared = Tally(), Tally(), Tally()
    settings = fast_settings(max_claim_bytes=budget)
    both = Relay(db.database, {"default": default, "audit": audit}, table=db.table,
                 settings=settings)  # fmt: skip
    other = Relay(db.database, {"audit": shared}, table=db.table, settings=settings)
    claims: list[tuple[int, int]] = []  # (sets of partitions read, payload bytes)
    async with both, other:
        (processor,) = both.processors
        claim = processor._claim

        async def noted(targets: list[str]) -> Claim | None:
            sets = len({str(processor._scope.get(t)) for t in targets})  # type: ignore[attr-defined]
            found = await claim(targets)
            if found is not None and found.messages:
                claims.append((sets, sum(len(m.payload) for m in found.messages)))
            return found

        processor._claim = noted  # type: ignore[method-assign]
        held = lambda: processor.partitions or {}  # noqa: E731
        await eventually(lambda: 0 < len(held().get("audit", ())) < 8 == len(held()["default"]))
        await db.write(backlog)
        both.wake()
        other.wake()
        await eventually(lambda: default.count + audit.count + shared.count == len(backlog))
    assert any(sets == 2 for sets, _ in claims), claims
    assert all(total <= budget or total == large for _, total in claims), claims
    assert default.count == 30
    for tally in (default, audit, shared):  # each key in order (keyless ones are not)
        assert all(numbers == sorted(numbers) for key, numbers in tally.order.items() if key)
