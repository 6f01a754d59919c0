"""The relay's event loop: uvloop where it is installed, asyncio's own when asked, a
clear error for a loop that cannot be had, and the same deliveries on either."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import uvloop

from relaybox import Message, Outbox
from relaybox.errors import ConfigurationError
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import Relay, RelayThread, loops
from relaybox.storage.memory import MemoryStorage
from tests.databases import create, sqlite_url, unique_table
from tests.relay_support import fast_settings


async def _running() -> str:
    return loops.running_loop_name()


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_asyncio_s_loop() -> None:
    assert loops.loop_factory("auto") is uvloop.new_event_loop
    assert loops.run(_running()) == "uvloop"
    assert loops.run(_running(), loop="uvloop") == "uvloop"
    assert loops.loop_factory("asyncio") is None
    assert loops.run(_running(), loop="asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert loops.loop_factory("auto") is None
    assert loops.run(_running()) == "asyncio"
    with pytest.raises(ConfigurationError, match="uvloop is not installed"):
        loops.loop_factory("uvloop")


def test_an_unknown_loop_is_refused_and_its_coroutine_closed() -> None:
    work = _running()
    with pytest.raises(ConfigurationError, match="unknown event loop 'trio'"):
        loops.run(work, loop="trio")
    assert work.cr_frame is None  # closed: no "never awaited" warning at collection
    with pytest.raises(ConfigurationError, match="unknown event loop"):
        RelayThread(lambda: Relay(MemoryStorage(), {"default": MemoryPublisher()}), loop="x")


@pytest.mark.parametrize("loop", ["auto", "asyncio"])
def test_a_relay_thread_runs_on_the_loop_it_was_given(loop: str) -> None:
    storage, publisher = MemoryStorage(), MemoryPublisher()
    outbox = Outbox()
    for n in range(20):
        asyncio.run(storage.write(outbox.rows(Message(topic="t", key="k", payload={"n": n}))[1]))
    runner = RelayThread(
        lambda: Relay(storage, {"default": publisher}, settings=fast_settings()), loop=loop
    )
    with runner:
        assert runner._loop is not None
        expected = uvloop.Loop if loop == "auto" else asyncio.BaseEventLoop
        assert isinstance(runner._loop, expected)
        if loop == "asyncio":
            assert not isinstance(runner._loop, uvloop.Loop)
        published = asyncio.run_coroutine_threadsafe(_wait_for(publisher, 20), runner._loop).result(
            15
        )
    assert [json.loads(m.payload)["n"] for m in published] == list(range(20))


async def _wait_for(publisher: MemoryPublisher, count: int) -> list[object]:
    while len(publisher.published) < count:
        await asyncio.sleep(0.01)
    return list(publisher.published)


@pytest.mark.parametrize(("flag", "expected"), [([], "uvloop"), (["--loop", "asyncio"], "asyncio")])
async def test_the_relay_command_says_its_loop_and_delivers_the_same_on_either(
    tmp_path: Path, flag: list[str], expected: str
) -> None:
    url, table = sqlite_url(tmp_path / "outbox.db"), unique_table("loops")
    await create(url, table)
    written = [Message(topic="t", key=f"k{n % 3}", payload={"n": n}) for n in range(30)]
    with sqlite3.connect(tmp_path / "outbox.db") as conn:
        Outbox(table=table).add(conn, written)
    sink = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "relaybox", "relay", "--db", url, "--table", table,
               "--broker", f"default=file://{sink}", "--max-seconds", "2", *flag]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    running = next(line for line in done.stdout.splitlines() if " running;" in line)
    assert running.endswith(f"event loop: {expected}")
    delivered = [json.loads(line) for line in sink.read_text().splitlines()]
    assert sorted(d["id"] for d in delivered) == sorted(str(m.id) for m in written)
    for key in ("k0", "k1", "k2"):  # per-key order, whatever the loop
        ns = [d["data"]["n"] for d in delivered if d["partitionkey"] == key]
        assert ns == sorted(ns)


def test_the_relay_command_refuses_a_loop_it_does_not_know(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "relaybox", "relay", "--db", "sqlite:///x.db",
               "--broker", "default=noop://", "--loop", "gevent"]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )
    assert done.returncode == 2
    assert "'gevent' is not one of 'auto', 'uvloop', 'asyncio'" in done.stderr
