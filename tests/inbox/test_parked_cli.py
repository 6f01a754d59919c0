"""`relaybox parked list | replay | discard` against each real database."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from relaybox.cli.main import main
from relaybox.inbox import Processed
from tests.databases import PG_URL, unique_table
from tests.inbox.support import DIALECTS, InboxWorld, incoming
from tests.inbox.test_parked import failing


@pytest.fixture(params=DIALECTS)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld(request.param, tmp_path) as opened:
        yield opened


async def relaybox(*args: str) -> Result:
    """The command line, in a thread of its own (it runs its own event loop)."""
    return await asyncio.to_thread(CliRunner().invoke, main, list(args))


async def test_list_replay_and_discard_parked_messages(world: InboxWorld) -> None:
    broken = {"bad", "worse"}
    consumer = world.consumer(before_effect=failing(broken))
    for message_id in ("bad", "worse"):
        outcome = await consumer.process(incoming(message_id, payload=b'{"n": 7}'), max_attempts=1)
        assert outcome is Processed.PARKED
    where = ("--db", world.url, "--inbox-table", world.table)

    listed = await relaybox("parked", "list", *where)
    assert listed.exit_code == 0, listed.output
    assert "id=bad" in listed.output
    assert "id=worse" in listed.output
    assert "RuntimeError: bad cannot be applied" in listed.output
    rows = json.loads((await relaybox("parked", "list", *where, "--json")).output)
    assert [row["message_id"] for row in rows] == ["worse", "bad"]  # newest first
    assert (rows[1]["payload"], rows[1]["attempts"], rows[1]["reason"]) == ('{"n": 7}', 1, "failed")
    assert rows[1]["attributes"]["type"] == "test.event"
    none = await relaybox("parked", "list", *where, "--type", "order.placed")
    assert "no parked messages" in none.output

    bad, worse = rows[1]["id"], rows[0]["id"]
    replay = await relaybox("parked", "replay", *where, str(bad), "--by", "ops")
    assert replay.exit_code == 0, replay.output
    broken.clear()
    assert await consumer.replay_parked() == 1
    assert world.effects() == {"bad": 1}

    discard = await relaybox("parked", "discard", *where, str(worse), "--reason", "test data")
    assert discard.exit_code == 0, discard.output
    (gone,) = json.loads(
        (await relaybox("parked", "list", *where, "--status", "discarded", "--json")).output
    )
    assert (gone["message_id"], gone["note"]) == ("worse", "test data")
    assert gone["changed_by"]  # the operating system's user, without --by

    unknown = await relaybox("parked", "replay", *where, "999999")
    assert unknown.exit_code == 1
    assert "no parked message has id 999999" in unknown.output
    again = await relaybox("parked", "discard", *where, str(bad), "--reason", "x")
    assert again.exit_code == 1
    assert "is replayed, not parked" in again.output
    assert (await relaybox("parked", "discard", *where, str(bad))).exit_code == 2  # no reason


async def test_a_missing_table_and_an_unreachable_database_are_clear_errors() -> None:
    missing = await relaybox("parked", "list", "--db", PG_URL, "--inbox-table", unique_table())
    assert missing.exit_code == 1
    assert "relaybox migrate --inbox" in missing.output
    away = "postgresql://postgres:s3cret@127.0.0.1:1/test"
    unreachable = await relaybox("parked", "list", "--db", away)
    assert unreachable.exit_code == 1
    assert "s3cret" not in unreachable.output
    assert "postgres:***@127.0.0.1:1" in unreachable.output


async def test_parked_list_prints_no_control_character_of_a_stored_row(
    world: InboxWorld,
) -> None:
    """A message id (and so the handler's error, which repeats it) carrying a window
    title, a screen clear and a bidi override reaches the terminal escaped."""
    hostile = "evil\x1b]0;pwn\x07\x1b[2J\u202e"
    consumer = world.consumer(before_effect=failing({hostile}))
    outcome = await consumer.process(incoming(hostile), max_attempts=1)
    assert outcome is Processed.PARKED
    listed = await relaybox("parked", "list", "--db", world.url, "--inbox-table", world.table)
    assert listed.exit_code == 0, listed.output
    assert listed.output.replace("\n", "").isprintable()
    escaped = "evil\\x1b]0;pwn\\x07\\x1b[2J\\u202e"
    assert f"id={escaped}" in listed.output
    assert f"RuntimeError: {escaped} cannot be applied" in listed.output
    as_json = await relaybox("parked", "list", "--db", world.url, "--inbox-table", world.table,
                             "--json")  # fmt: skip
    assert as_json.output.isascii()
    assert json.loads(as_json.output)[0]["message_id"] == hostile
