"""The operator commands on real tables: `relaybox status`, `abandoned`, `messages`,
`show`, and the changes (`replay`, `discard`, `delay`, `expedite`, `hold`, `release`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from relaybox import Message
from relaybox.cli.main import main
from relaybox.core.records import Failure, Routing
from relaybox.migrations import migrate
from relaybox.storage import open_storage
from tests.databases import PG_URL, drop, sqlite_url, unique_table


@pytest.fixture(params=["sqlite", "postgresql"])
def outbox(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, str, dict[str, int]]]:
    """A table with three messages: a and c abandoned (c to the 'partner' target), b pending."""
    url = PG_URL if request.param == "postgresql" else sqlite_url(tmp_path / "ops.db")
    table = unique_table("ops")
    seqs = asyncio.run(_fill(url, table))
    try:
        yield url, table, seqs
    finally:
        drop(url, table)


async def _fill(url: str, table: str) -> dict[str, int]:
    await migrate(url, table=table)
    storage = await open_storage(url, table=table)
    try:
        routing = Routing.of(["default", "partner"], ["default"])
        messages = [Message(topic="orders", key="a"), Message(topic="orders", key="b"),
                    Message(topic="orders", key="c", targets=["partner"])]  # fmt: skip
        await storage.write(routing.rows(messages))
        for target in ("default", "partner"):
            await storage.heartbeat("w1", partitions=64, lease_seconds=30, target=target)
        seqs = {m.key or "": m.seq for m in await storage.read(limit=10)}
        failures = [Failure(seqs["a"], "NOT_FOUND: no stream"), Failure(seqs["c"], "too large")]
        await storage.settle("w1", abandoned=failures)
        await storage.leave("w1")
        return seqs
    finally:
        await storage.close()


def _cli(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), input=stdin)
    return result.exit_code, result.stdout, result.stderr


def test_status_shows_every_count_and_alerts_past_a_limit(
    outbox: tuple[str, str, dict[str, int]],
) -> None:
    url, table, _ = outbox
    code, out, _ = _cli("status", "--db", url, "--table", table, "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["counts"] == {"pending": 1, "processing": 0, "published": 0, "failed": 0,
                                "abandoned": 2}  # fmt: skip
    assert report["alerts"] == []
    code, out, err = _cli("status", "--db", url, "--table", table, "--max-abandoned", "1")
    assert code == 1
    assert "abandoned" in out
    assert "ALERT: 2 abandoned, more than 1" in err


def test_abandoned_lists_the_errors_newest_first(
    outbox: tuple[str, str, dict[str, int]],
) -> None:
    url, table, seqs = outbox
    code, out, _ = _cli("abandoned", "--db", url, "--table", table, "--json")
    assert code == 0, out
    listed = json.loads(out)
    assert [(m["seq"], m["key"], m["target"], m["last_error"], m["attempts"]) for m in listed] == [
        (seqs["c"], "c", "partner", "too large", 1),
        (seqs["a"], "a", "default", "NOT_FOUND: no stream", 1),
    ]
    code, out, _ = _cli("abandoned", "--db", url, "--table", table, "--target", "default")
    assert code == 0
    assert "NOT_FOUND: no stream" in out
    assert "too large" not in out


#: What a broker's or receiver's answer could carry to an operator's terminal: a window
#: title (OSC 0, ended by BEL), a screen clear, a line break that fakes a row, a bidi
#: override and a C1 control (CSI).
HOSTILE = "\x1b]0;pwn\x07\x1b[2J bad gateway\nFAKE row\u202e\x9b2J"


def test_abandoned_prints_no_control_character_of_a_stored_row(tmp_path: Path) -> None:
    url, table = sqlite_url(tmp_path / "hostile.db"), unique_table("ops")

    async def fill() -> None:
        await migrate(url, table=table)
        storage = await open_storage(url, table=table)
        try:
            routing = Routing.of(["default"], ["default"])
            message = Message(topic="orders\x1b[8m", key="k")
            # A row written before relaybox refused such keys, or by hand: stored as is.
            message.key = "k\x1b]0;pwn\x07\x7f"
            await storage.write(routing.rows([message]))
            await storage.heartbeat("w1", partitions=64, lease_seconds=30)
            (row,) = await storage.read(limit=10)
            await storage.settle("w1", abandoned=[Failure(row.seq, HOSTILE)])
        finally:
            await storage.close()

    asyncio.run(fill())
    code, out, _ = _cli("abandoned", "--db", url, "--table", table)
    assert code == 0, out
    assert out.replace("\n", "").isprintable()
    for raw in ("\x1b", "\x07", "\x7f", "\x9b", "\u202e"):
        assert raw not in out
    assert "key=k\\x1b]0;pwn\\x07\\x7f" in out
    assert "orders\\x1b[8m" in out
    assert "\\x1b]0;pwn\\x07\\x1b[2J bad gateway\\nFAKE row\\u202e\\x9b2J" in out
    assert len(out.splitlines()) == 2  # one message, two lines: no line of the error's own
    code, out, _ = _cli("abandoned", "--db", url, "--table", table, "--json")
    assert code == 0
    assert out.isascii()
    assert json.loads(out)[0]["last_error"] == HOSTILE


def test_replay_by_seq_then_all(outbox: tuple[str, str, dict[str, int]]) -> None:
    url, table, seqs = outbox
    code, out, _ = _cli("replay", "--db", url, "--table", table, str(seqs["a"]))
    assert (code, out.strip()) == (0, "replayed 1 message(s)")
    code, out, _ = _cli("replay", "--db", url, "--table", table, "--all", stdin="n\n")
    assert code == 1  # declined: nothing replayed
    assert "would replay 1 message(s) of 1 key(s)" in out
    code, out, _ = _cli("abandoned", "--db", url, "--table", table, "--json")
    assert [m["key"] for m in json.loads(out)] == ["c"]
    code, out, _ = _cli("replay", "--db", url, "--table", table, "--all", "--yes")
    assert (code, out.strip()) == (0, "replayed 1 message(s)")
    code, out, _ = _cli("status", "--db", url, "--table", table, "--json")
    assert json.loads(out)["counts"]["pending"] == 3
    code, _, err = _cli("replay", "--db", url, "--table", table)
    assert code == 1
    assert "name the seqs" in err


def test_status_exits_2_when_it_cannot_read_the_table() -> None:
    code, _, err = _cli("status", "--db", "postgresql://postgres@127.0.0.1:1/test")
    assert code == 2
    assert "127.0.0.1" in err


async def test_replay_all_goes_oldest_first_page_by_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """So that a key's later message never becomes pending before its earlier one."""
    from relaybox.core.inspection import AuditAction, Change, MessageFilter
    from relaybox.operations.messages import Operations
    from relaybox.storage.memory import MemoryStorage

    storage = MemoryStorage()
    await storage.write(Routing().rows([Message(topic="t", key=f"k{n % 7}") for n in range(1200)]))
    await storage.heartbeat("w1", partitions=64, lease_seconds=30)
    read = await storage.read(limit=2000)
    await storage.settle("w1", abandoned=[Failure(m.seq, "no") for m in read])
    calls: list[list[int]] = []
    replay = storage.replay

    async def recorded(seqs: list[int], change: Change | None = None) -> int:
        calls.append(list(seqs))
        return await replay(seqs, change)

    monkeypatch.setattr(storage, "replay", recorded)
    operations = Operations(storage, name="t")  # type: ignore[arg-type]
    outcome = await operations.act(AuditAction.REPLAY, MessageFilter(), Change("ops"))
    assert outcome.changed == 1200
    flat = [seq for call in calls for seq in call]
    assert flat == sorted(m.seq for m in read)
    assert len(calls) == 3  # pages of 500


def test_messages_finds_by_key_and_state_and_exits_1_when_nothing_matched(
    outbox: tuple[str, str, dict[str, int]],
) -> None:
    url, table, seqs = outbox
    where = ("--db", url, "--table", table)
    code, out, _ = _cli("messages", *where, "--key", "a", "--json")
    assert code == 0
    (found,) = json.loads(out)["messages"]
    assert (found["seq"], found["state"], found["last_error"]) == (
        seqs["a"], "abandoned", "NOT_FOUND: no stream",
    )  # fmt: skip
    code, out, _ = _cli("messages", *where, "--state", "pending")
    assert code == 0
    assert "key=b" in out
    assert "key=a" not in out
    code, _, err = _cli("messages", *where, "--key", "nobody")
    assert code == 1
    assert "no message matched" in err
    code, _, err = _cli("messages", *where, "--since", "yesterday")
    assert code == 2
    assert "ISO 8601" in err


def test_messages_pages_follow_the_cursor(outbox: tuple[str, str, dict[str, int]]) -> None:
    url, table, _ = outbox
    where = ("--db", url, "--table", table, "--order", "oldest", "--limit", "2", "--json")
    code, out, _ = _cli("messages", *where)
    assert code == 0, out
    first = json.loads(out)
    assert [m["key"] for m in first["messages"]] == ["a", "b"]
    code, out, _ = _cli("messages", *where, "--after", str(first["next_after"]))
    assert code == 0, out
    second = json.loads(out)
    assert ([m["key"] for m in second["messages"]], second["next_after"]) == (["c"], None)


def test_show_prints_the_message_and_its_key_queue(outbox: tuple[str, str, dict[str, int]]) -> None:
    url, table, seqs = outbox
    where = ("--db", url, "--table", table)
    code, out, _ = _cli("show", *where, str(seqs["b"]))
    assert code == 0, out
    assert "state           pending" in out
    assert "waits for (0):" in out
    code, out, _ = _cli("show", *where, str(seqs["b"]), "--json")
    shown = json.loads(out)
    assert shown["payload"]["kind"] in {"json", "text", "hex"}
    assert shown["queue"] == {"ahead": [], "behind": [], "more_behind": False,
                              "published_after": []}  # fmt: skip
    code, _, err = _cli("show", *where, "999999")
    assert code == 1
    assert "no message with seq 999999" in err


def test_a_dry_run_changes_nothing_and_the_change_is_audited(
    outbox: tuple[str, str, dict[str, int]],
) -> None:
    url, table, seqs = outbox
    where = ("--db", url, "--table", table)
    code, out, _ = _cli("discard", *where, "--target", "partner", "--dry-run")
    assert code == 0, out
    assert "would discard 1 message(s) of 1 key(s)" in out
    assert "partner/c" in out
    code, out, _ = _cli("messages", *where, "--key", "c", "--json")
    assert json.loads(out)["messages"][0]["state"] == "abandoned"
    code, out, _ = _cli("discard", *where, "--target", "partner", "--yes", "--by", "ana",
                        "--reason", "poison", "--json")  # fmt: skip
    assert code == 0, out
    assert (json.loads(out)["changed"], json.loads(out)["seqs"]) == (1, [seqs["c"]])
    code, _, _ = _cli("messages", *where, "--key", "c")
    assert code == 1


def test_hold_then_release_a_key_and_delay_then_expedite(
    outbox: tuple[str, str, dict[str, int]],
) -> None:
    url, table, seqs = outbox
    where = ("--db", url, "--table", table)

    def state(key: str) -> str:
        code, out, _ = _cli("messages", *where, "--key", key, "--json")
        assert code == 0, out
        return str(json.loads(out)["messages"][0]["state"])

    code, out, _ = _cli("hold", *where, "--key", "b", "--yes")
    assert (code, out.strip()) == (0, "held 1 message(s)")
    assert state("b") == "held"
    code, _, err = _cli("hold", *where, "--key", "b", "--yes")
    assert code == 1
    assert "nothing held" in err
    code, out, _ = _cli("release", *where, str(seqs["b"]))
    assert (code, out.strip()) == (0, "released 1 message(s)")
    assert state("b") == "pending"
    code, out, _ = _cli("delay", *where, str(seqs["b"]), "--seconds", "3600")
    assert (code, out.strip()) == (0, "delayed 1 message(s)")
    assert state("b") == "delayed"
    code, out, _ = _cli("expedite", *where, str(seqs["b"]))
    assert (code, out.strip()) == (0, "expedited 1 message(s)")
    assert state("b") == "pending"
    code, _, err = _cli("delay", *where, str(seqs["b"]))
    assert code == 2
    assert "--seconds" in err
