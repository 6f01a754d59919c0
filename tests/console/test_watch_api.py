"""The console's watching and backfill API over real tables (SQLite and PostgreSQL; the
inboxes on MariaDB too): the targets' activity and the relays' circuits as the relays
write them, the consumers' activity and parked messages read from their own database,
and a backfill planned, started as a task of the console, followed to its end and
refused when it may not run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from relaybox import Message
from relaybox.console import create_app
from relaybox.core.activity import NO_LAG, TargetActivity
from relaybox.core.circuit import CircuitState
from relaybox.core.inspection import MessageFilter
from relaybox.inbox import parked
from relaybox.operations.inboxes import InboxWatch
from relaybox.operations.messages import Operations
from tests.inbox.support import InboxWorld, incoming
from tests.relay_support import OutboxDB, outbox_db

TOKEN = "console-token-for-the-watch-tests"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
#: PostgreSQL here trusts local connections: a password in a URL stands for a real one
#: that must show nowhere.
PASSWORD = "s3cret-of-the-inbox"


@pytest.fixture(params=["sqlite", "postgresql"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(request.param, tmp_path, targets=("default", "late")):
        yield each


@pytest.fixture
async def operations(db: OutboxDB) -> AsyncIterator[Operations]:
    async with Operations.opened(db.url, db.table) as opened:
        yield opened


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console")


@pytest.fixture
async def http(operations: Operations) -> AsyncIterator[httpx.AsyncClient]:
    async with client(create_app([operations], token=TOKEN)) as opened:
        yield opened


# -- the targets' activity ---------------------------------------------------------------


async def test_activity_has_a_point_per_minute_per_target_and_the_relays_circuits(
    db: OutboxDB, http: httpx.AsyncClient
) -> None:
    refused = "amqp://relay:***@broker.example:5672/ refused"
    await db.storage.record_activity("relay-1", [
        TargetActivity("default", CircuitState.CLOSED, published=3, lag=NO_LAG.observed(0.5)),
        TargetActivity("late", CircuitState.OPEN, last_error=refused, failed=2),
    ])  # fmt: skip
    answer = await http.get("/api/tables/0/activity?minutes=5")
    assert answer.status_code == 200, answer.text
    found = answer.json()
    assert found["minutes"] == 5
    assert sorted(found["targets"]) == ["default", "late"]
    default = found["targets"]["default"]
    assert 5 <= len(default) <= 6  # a minute may turn between the write and the read
    assert sum(p["published"] for p in default) == 3
    (busy,) = [p for p in default if p["published"]]
    assert busy["lag_avg_seconds"] == busy["lag_max_seconds"] == 0.5
    assert all(p["lag_max_seconds"] is None for p in default if p is not busy)
    assert sum(p["failed"] for p in found["targets"]["late"]) == 2
    statuses = [
        (s["worker"], s["target"], s["circuit"], s["last_error"]) for s in found["statuses"]
    ]
    assert statuses == [
        ("relay-1", "default", "closed", None),
        ("relay-1", "late", "open", refused),
    ]
    assert found["relays"] == []  # no relay holds partitions
    assert found["oldest_pending_age"] is None
    assert (found["held"], found["held_keys"]) == (0, 0)


async def test_an_activity_window_is_1_to_120_minutes(http: httpx.AsyncClient) -> None:
    for bad in ("0", "121", "abc", "-1", "60&minutes=5"):
        answer = await http.get(f"/api/tables/0/activity?minutes={bad}")
        assert answer.status_code == 400, bad
        assert "minutes" in answer.json()["error"]
    hour = (await http.get("/api/tables/0/activity")).json()
    assert (hour["minutes"], hour["targets"]) == (60, {})
    assert (await http.get("/api/tables/1/activity")).status_code == 404


# -- the consumers' activity ---------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql", "mysql"])
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld(request.param, tmp_path) as opened:
        yield opened


async def refuse(message: Any) -> None:
    if message.id.startswith("poison"):
        raise RuntimeError("cannot apply it")


def with_password(url: str) -> str:
    return url.replace("postgres@", f"postgres:{PASSWORD}@")


async def test_an_inbox_shows_each_consumers_minutes_and_its_parked_messages(
    world: InboxWorld, operations: Operations
) -> None:
    consumer = world.consumer(before_effect=refuse)
    for message_id in ("m1", "m2"):
        await consumer.process(incoming(message_id))
    await consumer.process(incoming("m1"))  # a copy
    await consumer.process(incoming("poison-1"), max_attempts=1)
    other = world.consumer(name="other")
    await other.process(incoming("o1"))
    assert await consumer.record_activity()
    assert await other.record_activity()
    watched = InboxWatch(with_password(world.url), world.table)
    async with client(create_app([operations], token=TOKEN, inboxes=[watched])) as http:
        listed = (await http.get("/api/inboxes")).json()["inboxes"]
        assert [inbox["index"] for inbox in listed] == [0]
        assert world.table in listed[0]["name"]
        answer = await http.get("/api/inboxes/0/activity?minutes=10")
        assert answer.status_code == 200, answer.text
        assert PASSWORD not in answer.text + str(listed)
        async with world.transaction() as connection:
            (poison,) = await parked.list_parked(connection, table=world.table)
            await parked.discard(connection, [poison.id], reason="a test", table=world.table)
        later = (await http.get("/api/inboxes/0/activity?minutes=10")).json()
        assert later["parked_now"] == {}  # discarded: no longer parked
    found = answer.json()
    assert found["minutes"] == 10
    assert sorted(found["consumers"]) == ["other", "test"]

    def totals(name: str) -> tuple[int, int, int]:
        points = found["consumers"][name]
        assert 10 <= len(points) <= 11
        return (sum(p["applied"] for p in points), sum(p["duplicate"] for p in points),
                sum(p["parked"] for p in points))  # fmt: skip

    assert totals("test") == (2, 1, 1)
    assert totals("other") == (1, 0, 0)
    assert found["parked_now"] == {"test": 1}


async def test_a_console_without_inboxes_lists_none(http: httpx.AsyncClient) -> None:
    assert (await http.get("/api/inboxes")).json() == {"inboxes": []}
    assert (await http.get("/api/inboxes/0/activity")).status_code == 404


async def test_a_missing_inbox_table_is_named_without_the_password(
    db: OutboxDB, operations: Operations
) -> None:
    url = with_password(db.url)
    watched = InboxWatch(url, "no_such_inbox")
    async with client(create_app([operations], token=TOKEN, inboxes=[watched])) as http:
        answer = await http.get("/api/inboxes/0/activity")
    assert answer.status_code == 503, answer.text  # the database is not ready for it
    assert "relaybox migrate --inbox" in answer.json()["error"]
    assert PASSWORD not in answer.text


# -- backfill ------------------------------------------------------------------------------


async def published(db: OutboxDB, *keys: str) -> list[int]:
    """A message to "default" per key, published and kept (as a retention keeps them)."""
    await db.write([Message(topic="orders", key=key, payload={"key": key}) for key in keys])
    claim = await db.storage.claim("w1", limit=len(keys), lease_seconds=30.0)
    seqs = [m.seq for m in claim.messages]
    assert await db.storage.mark_published(claim.token, seqs) == len(keys)
    return sorted(seqs)


def backfill(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "filter": {"target": "default"}, "to": "late", "actor": "ana",
            "reason": "a new consumer needs the history", **fields}  # fmt: skip


async def copies(operations: Operations) -> list[str | None]:
    page = await operations.search(MessageFilter(target="late"), limit=100, newest_first=False)
    return [m.key for m in page.messages]


async def finished(http: httpx.AsyncClient, name: str) -> dict[str, Any]:
    """The backfill's status once it has finished (within 15 s)."""
    deadline = time.monotonic() + 15
    while True:
        status: dict[str, Any] = (await http.get(f"/api/tables/0/backfills/{name}")).json()
        if status["job"] and status["job"]["finished"] and not status["running"]:
            return status
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.05)


async def test_a_backfill_is_planned_then_copies_in_a_task_and_reports_its_progress(
    db: OutboxDB, operations: Operations, http: httpx.AsyncClient
) -> None:
    seqs = await published(db, "a", "b", "a")
    await db.write([Message(topic="orders", key="a", payload={}, targets=["late"])])
    dry = await http.post("/api/tables/0/backfills", json=backfill("late-1", dry_run=True),
                          headers=BEARER)  # fmt: skip
    assert dry.status_code == 200, dry.text
    plan = dry.json()
    assert plan["plan"] == {"count": 3, "keys": 2, "keys_live_on_target": ["a"]}
    assert (plan["job"], plan["running"]) == (None, False)
    assert await copies(operations) == ["a"]  # a dry run copies nothing
    assert (await http.get("/api/tables/0/backfills/late-1")).status_code == 404

    started = await http.post("/api/tables/0/backfills", json=backfill("late-1"), headers=BEARER)
    assert started.status_code == 202, started.text
    assert started.json()["running"] is True
    status = await finished(http, "late-1")
    job = status["job"]
    assert (job["copied"], job["cursor"], job["to"], job["actor"]) == (3, seqs[-1], "late", "ana")
    assert job["source_target"] == "default"
    assert status["error"] is None
    assert await copies(operations) == ["a", "a", "b", "a"]
    again = await http.post("/api/tables/0/backfills", json=backfill("late-1"), headers=BEARER)
    assert again.status_code == 202  # finished: it copies nothing more
    await finished(http, "late-1")
    assert len(await copies(operations)) == 4


async def test_a_second_start_of_a_running_backfill_is_refused(
    db: OutboxDB, operations: Operations, http: httpx.AsyncClient
) -> None:
    await published(db, "a", "b", "c", "d")
    body = backfill("slow", rate=2)  # two a second, a transaction each: two seconds
    first = await http.post("/api/tables/0/backfills", json=body, headers=BEARER)
    assert first.status_code == 202, first.text
    second = await http.post("/api/tables/0/backfills", json=body, headers=BEARER)
    assert second.status_code == 409
    assert "running already" in second.json()["error"]
    dry = await http.post("/api/tables/0/backfills", json={**body, "dry_run": True},
                          headers=BEARER)  # fmt: skip
    assert dry.status_code == 409
    running = (await http.get("/api/tables/0/backfills/slow")).json()
    assert running["running"] is True
    assert (await finished(http, "slow"))["job"]["copied"] == 4
    assert await copies(operations) == ["a", "b", "c", "d"]  # each once


async def test_a_backfill_needs_the_token_and_a_console_that_changes(
    db: OutboxDB, operations: Operations, http: httpx.AsyncClient
) -> None:
    await published(db, "a")
    no_token = await http.post("/api/tables/0/backfills", json=backfill("late-2"))
    assert no_token.status_code == 401
    wrong = {"Authorization": "Bearer " + "x" * len(TOKEN)}
    assert (await http.post("/api/tables/0/backfills", json=backfill("late-2"),
                            headers=wrong)).status_code == 401  # fmt: skip
    async with client(create_app([operations], token=TOKEN, read_only=True)) as read_only:
        for dry_run in (True, False):
            answer = await read_only.post("/api/tables/0/backfills",
                                          json=backfill("late-2", dry_run=dry_run),
                                          headers=BEARER)  # fmt: skip
            assert answer.status_code == 403
            assert "read-only" in answer.json()["error"]
    await asyncio.sleep(0.1)
    assert await copies(operations) == []
    assert await db.storage.backfill_job("late-2") is None


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"filter": {}}, "name the target whose messages to copy"),
        ({"filter": {"target": "default", "nope": "1"}}, "unknown field"),
        ({"filter": {"target": "default", "min_seq": "x"}}, "min_seq"),
        ({"to": ""}, "to:"),
        ({"to": "not a target!"}, "invalid target name"),
        ({"rate": 0}, "rate"),
        ({"rate": "fast"}, "rate"),
        ({"external": "yes"}, "external"),
        ({"name": ""}, "name the backfill"),
        ({"actor": None}, "actor"),
    ],
)
async def test_a_bad_backfill_request_is_a_400_naming_what_is_wrong(
    http: httpx.AsyncClient, fields: dict[str, Any], error: str
) -> None:
    answer = await http.post("/api/tables/0/backfills", json={**backfill("bad", dry_run=True),
                             **fields}, headers=BEARER)  # fmt: skip
    assert answer.status_code == 400, answer.text
    assert error in answer.json()["error"]
