"""A `RelayThread` started when a web application is imported, as Flask apps do.

The thread is a daemon: a process that ends by SIGTERM or by leaving its main thread
does not wait for it. The relay must give its partitions back all the same, so that
the next relay takes them at once rather than when their lease runs out. A process
forked from one with a running RelayThread has no relay thread, and says so.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.databases import fetch_all
from tests.relay_support import OutboxDB, outbox_db

#: The application: a relay started at import, then the "server" runs.
APP = """
import os, sys, time
from relaybox import Relay, RelaySettings, RelayThread

runner = RelayThread(lambda: Relay({url!r}, {{"default": "noop://"}}, table={table!r},
                                   settings=RelaySettings(idle_interval=0.1)))
relay = runner.start()
while not relay.processors[0].partitions:
    time.sleep(0.05)
print(relay.worker, flush=True)
{serve}
"""

#: Serve until a signal ends the process.
SERVE_FOREVER = "while True:\n    time.sleep(1)"
#: Read the line that tells the process to end, then leave the main thread.
SERVE_UNTIL_TOLD = "sys.stdin.readline()"
#: Fork a worker, which tries to use the relay it inherited.
FORK = """
child = os.fork()
if child == 0:
    try:
        runner.attach(None)
    except Exception as error:
        print("child:", type(error).__name__, error, flush=True)
    else:
        print("child: attached", flush=True)
    os._exit(0)
os.waitpid(child, 0)
runner.stop()
"""


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path):
        yield each


def _app(db: OutboxDB, tmp_path: Path, serve: str) -> subprocess.Popen[str]:
    script = tmp_path / "app.py"
    script.write_text(APP.format(url=db.url, table=db.table, serve=textwrap.dedent(serve)))
    return subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=(tmp_path / "app.log").open("w"), text=True,
    )  # fmt: skip


def _owned_by(db: OutboxDB, worker: str) -> int:
    assert worker.replace("-", "").isalnum()  # a worker name, safe inside the query
    query = f"SELECT count(*) FROM {db.table}_partitions WHERE owner = '{worker}'"
    return int(fetch_all(db.url, query)[0][0])


def _running(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    worker = proc.stdout.readline().strip()
    assert worker, "the application did not start its relay"
    return worker


def _ended(proc: subprocess.Popen[str]) -> int:
    try:
        return proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_sigterm_gives_the_partitions_back_then_ends_the_process(
    db: OutboxDB, tmp_path: Path
) -> None:
    proc = _app(db, tmp_path, SERVE_FOREVER)
    worker = _running(proc)
    assert _owned_by(db, worker) > 0
    proc.send_signal(signal.SIGTERM)
    assert _ended(proc) == -signal.SIGTERM  # SIGTERM's default action, after the relay
    assert _owned_by(db, worker) == 0


def test_leaving_the_main_thread_gives_the_partitions_back(db: OutboxDB, tmp_path: Path) -> None:
    proc = _app(db, tmp_path, SERVE_UNTIL_TOLD)
    worker = _running(proc)
    assert _owned_by(db, worker) > 0
    assert proc.stdin is not None
    proc.stdin.write("end\n")
    proc.stdin.flush()
    assert _ended(proc) == 0
    assert _owned_by(db, worker) == 0


def test_a_forked_child_refuses_the_relay_thread_it_inherited(db: OutboxDB, tmp_path: Path) -> None:
    proc = _app(db, tmp_path, FORK)
    worker = _running(proc)
    assert proc.stdout is not None
    said = proc.stdout.readline()
    assert _ended(proc) == 0
    assert said.startswith("child: RelayboxError this RelayThread was started in process")
    assert "start a RelayThread in each process after the fork" in said
    assert _owned_by(db, worker) == 0
