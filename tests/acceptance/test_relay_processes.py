"""Real `relaybox relay` processes on real PostgreSQL, MariaDB and SQLite.

Each relay appends what it publishes to one shared JSON-lines file (O_APPEND, written
before the broker "confirms"), so the file's line order is the order of publication
across processes: it is checked for loss, duplicates and per-key order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from relaybox import Message
from tests.databases import fetch_all
from tests.relay_support import OutboxDB, messages, outbox_db

RELAYBOX = str(Path(sys.executable).with_name("relaybox"))
LEASE = 3.0
#: How long the failing key of the key-order test fails, from before the relays start.
FAIL_FOR = 8.0
PARTITIONS = 16
BACKENDS = ["postgresql", "mysql", "sqlite"]


@pytest.fixture(params=BACKENDS)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(request.param, tmp_path):
        yield each


class Relays:
    """Relay processes started by a test; every one is stopped by its PID at the end."""

    def __init__(self, db: OutboxDB, out: Path, logs: Path) -> None:
        self.db, self.out, self.logs = db, out, logs
        self.procs: list[subprocess.Popen[str]] = []
        self.workers: list[str] = []

    def start(self, count: int, query: str = "", options: tuple[str, ...] = ()) -> None:
        for _ in range(count):
            index = len(self.procs)
            log = (self.logs / f"relay{index}.log").open("w")
            command = [
                RELAYBOX, "relay", "--db", self.db.url, "--table", self.db.table,
                "--broker", f"default=file://{self.out}{query}", "--lease", str(LEASE),
                "--partitions", str(PARTITIONS), "--batch-size", "50", "--idle-interval",
                "0.1", "--retry-base", "0.2", "--retry-max", "0.5", "--retry-jitter", "0",
                "--cleanup-interval", "1", "--shutdown-timeout", "5", "--log-level", "WARNING",
                *options,
            ]  # fmt: skip
            self.procs.append(
                subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
            )
        for proc in self.procs[-count:]:  # wait until each is running
            self.workers.append(self._running(proc))

    @staticmethod
    def _running(proc: subprocess.Popen[str]) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "relay <worker> running; targets: default"
        assert line.startswith("relay "), f"relay did not start: {line!r}"
        return line.split()[1]

    def worker(self, index: int) -> str:
        return self.workers[index]

    def kill(self, index: int) -> None:
        self.procs[index].send_signal(signal.SIGKILL)
        self.procs[index].wait(10)

    def stop_all(self) -> list[int | None]:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(20))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
                codes.append(None)
        return codes


@pytest.fixture
def relays(db: OutboxDB, tmp_path: Path) -> Iterator[Relays]:
    running = Relays(db, tmp_path / "published.jsonl", tmp_path)
    try:
        yield running
    finally:
        running.stop_all()


def published(out: Path) -> list[dict[str, object]]:
    if not out.exists():
        return []
    text = out.read_text()
    complete = text[: text.rfind("\n") + 1]  # a relay may be writing the last line now
    return [json.loads(line) for line in complete.splitlines()]


async def write_in_transactions(db: OutboxDB, batch: list[Message], per_txn: int = 50) -> None:
    for start in range(0, len(batch), per_txn):
        await db.write(batch[start : start + per_txn])
        await asyncio.sleep(0.005)


async def wait_delivered(out: Path, ids: set[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while {str(line["id"]) for line in published(out)} < ids:
        if time.monotonic() > deadline:
            missing = ids - {str(line["id"]) for line in published(out)}
            raise AssertionError(f"{len(missing)} messages never published")
        await asyncio.sleep(0.1)


def check_history(lines: list[dict[str, object]], written: list[Message]) -> Counter[str]:
    """No loss, nothing unknown, per-key order by first publication; returns duplicates."""
    ids = [str(line["id"]) for line in lines]
    assert set(ids) == {str(m.id) for m in written}
    by_key: dict[object, list[int]] = defaultdict(list)
    seen: set[str] = set()
    for line in lines:
        if line["id"] in seen or "subject" not in line:
            continue
        seen.add(str(line["id"]))
        by_key[line["subject"]].append(line["data"]["n"])  # type: ignore[index]
    for key, order in by_key.items():
        assert order == sorted(order), f"key {key} published out of order: {order}"
    return Counter(i for i, n in Counter(ids).items() if n > 1)


@pytest.mark.parametrize("processes", [1, 4])
async def test_no_loss_no_duplicate_in_normal_operation(
    db: OutboxDB, relays: Relays, processes: int
) -> None:
    relays.start(processes)
    batch = messages([f"k{i}" for i in range(40)] + [None], per_key=25)
    await write_in_transactions(db, batch)
    await wait_delivered(relays.out, {str(m.id) for m in batch})
    assert relays.stop_all() == [0] * processes  # graceful exit on SIGTERM
    duplicates = check_history(published(relays.out), batch)
    assert not duplicates, f"published twice in normal operation: {len(duplicates)}"
    assert await db.status_counts() == {}


async def test_key_order_with_four_processes_while_one_key_fails_and_recovers(
    db: OutboxDB, relays: Relays
) -> None:
    # "bad" fails until FAIL_FOR seconds from now. Starting four processes eats into
    # that (seconds, on a busy machine), and the batch must be written and its first
    # messages published while "bad" still fails; so the window is long, and "bad" is
    # retried (every 0.5 s at most) and never abandoned nor paused for it meanwhile.
    fail_until = time.time() + FAIL_FOR
    relays.start(
        4, query=f"?fail_keys=bad&fail_until={fail_until}",
        options=("--max-attempts", "1000", "--circuit-threshold", "1000"),
    )  # fmt: skip
    batch = messages(["bad"] + [f"k{i}" for i in range(30)], per_key=20)
    await write_in_transactions(db, batch)
    await wait_delivered(relays.out, {str(m.id) for m in batch})
    relays.stop_all()
    lines = published(relays.out)
    check_history(lines, batch)
    first_bad = next(i for i, line in enumerate(lines) if line.get("subject") == "bad")
    # Other keys flowed while "bad" was failing: published before it recovered, and so
    # before the first "bad" line.
    assert first_bad > 0
    flowed = [line for line in lines[:first_bad] if line["published_ns"] < fail_until * 1e9]
    assert flowed, "nothing was published while bad was failing"


async def test_sigkill_mid_batch_loses_nothing_and_partitions_move_within_the_lease(
    db: OutboxDB, relays: Relays
) -> None:
    relays.start(4, query="?delay=0.05")  # a slow broker keeps batches in flight
    workers = [relays.worker(i) for i in range(4)]
    batch = messages([f"k{i}" for i in range(60)] + [None], per_key=30)
    await write_in_transactions(db, batch)
    victim_parts = await _owned_when_balanced(db, workers, victim=workers[0])
    deadline = time.monotonic() + 60
    while len(published(relays.out)) < len(batch) // 5:
        assert time.monotonic() < deadline, "the relays never got going"
        await asyncio.sleep(0.05)
    relays.kill(0)
    killed_at = time.monotonic()
    # Polled until it happens (or for ten leases): whether it came in time is judged below.
    while await _owners(db, victim_parts) & {workers[0], None}:
        assert time.monotonic() - killed_at < 10 * LEASE, "partitions never taken over"
        await asyncio.sleep(0.05)
    takeover = time.monotonic() - killed_at
    await wait_delivered(relays.out, {str(m.id) for m in batch})
    duplicates = check_history(published(relays.out), batch)
    # A dead relay's partitions expire 2/3 of a lease after its last heartbeat and are
    # seen expired within 1/6 more: 2.5 s here, if the survivors' heartbeats and this
    # poll run on time. On a busy machine they run late, so the bound is twice the lease
    # (3.5 s of room); a takeover that never came is caught by the loop above.
    assert takeover <= 2 * LEASE, f"takeover took {takeover:.2f}s, lease is {LEASE}s"
    print(f"takeover {takeover:.2f}s; duplicates after SIGKILL: {sum(duplicates.values())}")


async def _owned_when_balanced(db: OutboxDB, workers: list[str], victim: str) -> set[int]:
    deadline = time.monotonic() + 10 * LEASE  # four processes starting on a busy machine
    while time.monotonic() < deadline:
        owners = await _partition_owners(db)
        held = Counter(owners.values())
        if len(owners) == PARTITIONS and all(held[w] == PARTITIONS // 4 for w in workers):
            return {p for p, owner in owners.items() if owner == victim}
        await asyncio.sleep(0.1)
    raise AssertionError(f"partitions never balanced: {await _partition_owners(db)}")


async def _owners(db: OutboxDB, partitions: set[int]) -> set[str | None]:
    owners = await _partition_owners(db)
    return {owners.get(p) for p in partitions}


async def _partition_owners(db: OutboxDB) -> dict[int, str | None]:
    return await asyncio.to_thread(_read_owners, db)


def _read_owners(db: OutboxDB) -> dict[int, str | None]:
    column = "`partition`" if db.name == "mysql" else "partition"
    return dict(fetch_all(db.url, f"SELECT {column}, owner FROM {db.table}_partitions"))


def test_relay_command_rejects_a_bad_broker_option() -> None:
    result = subprocess.run(
        [RELAYBOX, "relay", "--db", "memory://", "--broker", "nonsense"],
        capture_output=True, text=True, timeout=30, env={**os.environ}, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "NAME=URL" in result.stderr
