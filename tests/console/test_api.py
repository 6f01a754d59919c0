"""The console's JSON API over a real table (SQLite and PostgreSQL): each action through
HTTP changes what the operations module says it does, searches page by seq, and a bad
value is a 400 from the real operations too."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from relaybox import Message
from relaybox.console import create_app
from relaybox.core.inspection import MessageState
from relaybox.operations.messages import Operations
from tests.relay_support import OutboxDB, outbox_db

TOKEN = "console-token-for-the-api-tests"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(params=["sqlite", "postgresql"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(request.param, tmp_path):
        yield each


@pytest.fixture
async def http(db: OutboxDB) -> AsyncIterator[httpx.AsyncClient]:
    async with Operations.opened(db.url, db.table) as operations:
        app = create_app([operations], token=TOKEN)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as client:
            yield client


async def _states(http: httpx.AsyncClient, *seqs: int) -> list[str]:
    found = []
    for seq in seqs:
        answer = await http.get(f"/api/tables/0/messages/{seq}")
        found.append(answer.json()["state"])
    return found


async def _act(http: httpx.AsyncClient, action: str, **body: Any) -> dict[str, Any]:
    answer = await http.post(
        f"/api/tables/0/actions/{action}", json={"actor": "ana", **body}, headers=BEARER
    )
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


async def test_each_action_changes_the_table_as_the_plan_said(
    db: OutboxDB, http: httpx.AsyncClient
) -> None:
    await db.write([Message(topic="orders", key="k", payload={"n": n}) for n in range(3)])
    first, second, third = [
        m["seq"] for m in (await http.get("/api/tables/0/messages?order=oldest")).json()["messages"]
    ]

    dry = await _act(http, "hold", seqs=[second], dry_run=True)
    assert (dry["matched"], dry["changed"], dry["seqs"]) == (1, 0, [first])  # the key's head
    assert await _states(http, first) == ["pending"]
    assert (await _act(http, "hold", seqs=[second]))["changed"] == 1
    assert await _states(http, first, second) == ["held", "pending"]
    view = (await http.get(f"/api/tables/0/messages/{second}")).json()
    assert [m["seq"] for m in view["queue"]["ahead"]] == [first]
    assert [m["seq"] for m in view["queue"]["behind"]] == [third]

    assert (await _act(http, "release", filter={"state": ["held"]}))["changed"] == 1
    assert await _states(http, first) == ["pending"]
    assert (await _act(http, "delay", seqs=[third], delay=3600))["changed"] == 1
    assert await _states(http, third) == ["delayed"]
    assert (await _act(http, "expedite", seqs=[third]))["changed"] == 1
    assert await _states(http, third) == ["pending"]
    assert (await _act(http, "discard", seqs=[second], reason="a duplicate"))["changed"] == 1
    assert (await http.get(f"/api/tables/0/messages/{second}")).status_code == 404

    records = (await http.get("/api/tables/0/audit")).json()["records"]
    assert [(r["action"], r["seq"]) for r in records] == [
        ("discard", second), ("expedite", third), ("delay", third), ("release", first),
        ("hold", first),
    ]  # fmt: skip
    assert records[0]["reason"] == "a duplicate"
    older = (await http.get(f"/api/tables/0/audit?limit=2&before={records[1]['id']}")).json()
    assert [r["action"] for r in older["records"]] == ["delay", "release"]
    assert older["next_before"] == records[3]["id"]


async def test_a_search_pages_by_seq_both_ways(db: OutboxDB, http: httpx.AsyncClient) -> None:
    await db.write([Message(topic="orders", key=f"k{n}", payload={}) for n in range(5)])
    seen: list[int] = []
    query = "order=oldest&limit=2"
    while True:
        page = (await http.get(f"/api/tables/0/messages?{query}")).json()
        seen += [m["seq"] for m in page["messages"]]
        if page["next_after"] is None:
            break
        query = f"order=oldest&limit=2&after={page['next_after']}"
    assert seen == sorted(seen)
    assert len(seen) == 5
    newest = (await http.get("/api/tables/0/messages?limit=3")).json()
    assert [m["seq"] for m in newest["messages"]] == seen[:-4:-1]
    keyed = (await http.get("/api/tables/0/messages?key=k3&state=pending")).json()
    assert [m["key"] for m in keyed["messages"]] == ["k3"]


async def test_bad_values_are_400s_from_the_real_operations(http: httpx.AsyncClient) -> None:
    too_big = await http.get(f"/api/tables/0/messages/{2**63}")
    assert too_big.status_code == 400
    assert "seqs run from 1" in too_big.json()["error"]
    delay = await http.post(
        "/api/tables/0/actions/delay", json={"seqs": [1], "actor": "ana"}, headers=BEARER
    )
    assert delay.status_code == 400
    assert "a delay is a number of seconds above 0" in delay.json()["error"]
    assert (await http.get("/api/tables/0/messages/abc")).status_code == 404
    assert (await http.get("/api/tables/0/messages?state=held&state=nope")).status_code == 400


async def test_message_states_the_console_offers_are_the_operations_states(
    http: httpx.AsyncClient,
) -> None:
    for state in MessageState:
        answer = await http.get(f"/api/tables/0/messages?state={state}")
        assert answer.status_code == 200, state
