"""Relays inside web servers that fork their workers.

A `RelayThread` started when a web application is imported: the thread is a daemon, so
a process that ends by SIGTERM or by leaving its main thread does not wait for it. The
relay must give its partitions back all the same, so that the next relay takes them at
once rather than when their lease runs out. A process forked from one with a running
RelayThread has no relay thread, and says so.

The integrations keep the rules themselves: under gunicorn with `--preload` (the
application imported in the master, then forked) and under `uvicorn --workers`, an ASGI
application's `relay_lifespan` runs one relay in each worker and none in the master, and
the Flask extension starts one in a worker when it serves its first request; stopping
the server stops them all, their partitions given back.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.brokers.harness import free_port
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


#: An ASGI application whose lifespan runs the relay; it says which process serves.
ASGI_APP = """
import os
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from relaybox import Outbox, Relay, RelaySettings
from relaybox.integrations.asgi import relay_lifespan

IMPORTED_IN = os.getpid()
outbox = Outbox(table={table!r})


def make_relay():
    settings = RelaySettings(idle_interval=0.1)
    return Relay({url!r}, {{"default": "noop://"}}, table={table!r}, settings=settings)


async def serving(request):
    worker = request.state.relay.worker
    return JSONResponse({{"pid": os.getpid(), "imported_in": IMPORTED_IN, "worker": worker}})


app = Starlette(routes=[Route("/", serving)], lifespan=relay_lifespan(make_relay, outbox))
"""

#: The same for Flask, with the extension.
FLASK_APP = """
import os
from flask import Flask
from relaybox import Outbox, Relay, RelaySettings
from relaybox.integrations.flask import Relaybox

IMPORTED_IN = os.getpid()
app = Flask(__name__)
relaybox = Relaybox(app, outbox=Outbox(table={table!r}), relay=lambda: Relay(
    {url!r}, {{"default": "noop://"}}, table={table!r}, settings=RelaySettings(idle_interval=0.1)
))


@app.get("/")
def serving():
    return {{"pid": os.getpid(), "imported_in": IMPORTED_IN, "worker": relaybox.relay.worker}}
"""


def _server(db: OutboxDB, tmp_path: Path, app: str, command: list[str]) -> subprocess.Popen[bytes]:
    (tmp_path / "webapp.py").write_text(app.format(url=db.url, table=db.table))
    return subprocess.Popen(
        [sys.executable, "-m", *command], cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "server.log").open("w"),
    )  # fmt: skip


def _wait(condition: object, what: str, proc: subprocess.Popen[bytes], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert proc.poll() is None, f"the server ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.1)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


def _members(db: OutboxDB) -> list[str]:
    return [str(row[0]) for row in fetch_all(db.url, f"SELECT worker FROM {db.table}_members")]


def _pid_of(worker: str) -> int:
    """The process a relay runs in, from its name (host-pid-suffix)."""
    return int(worker.rsplit("-", 2)[1])


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def _owned(db: OutboxDB) -> int:
    query = f"SELECT count(*) FROM {db.table}_partitions WHERE owner IS NOT NULL"
    return int(fetch_all(db.url, query)[0][0])


@pytest.mark.parametrize(
    "server",
    [
        ["gunicorn", "--preload", "-w", "2", "-k", "uvicorn.workers.UvicornWorker"],
        ["uvicorn", "--workers", "2"],
    ],
    ids=["gunicorn-preload", "uvicorn-workers"],
)
def test_the_asgi_lifespan_runs_one_relay_in_each_worker_and_stops_them(
    db: OutboxDB, tmp_path: Path, server: list[str]
) -> None:
    port = free_port()
    bind = ["-b", f"127.0.0.1:{port}"] if server[0] == "gunicorn" else ["--port", str(port)]
    proc = _server(db, tmp_path, ASGI_APP, [*server, *bind, "webapp:app"])
    try:
        _wait(lambda: len(_members(db)) == 2, "two relays", proc)
        pids = {_pid_of(worker) for worker in _members(db)}
        assert len(pids) == 2
        assert proc.pid not in pids  # none in the master, which imported the application
        _wait(lambda: _listening(port), "a listening server", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
            said = json.load(response)
        assert said["pid"] in pids
        assert _pid_of(said["worker"]) == said["pid"]
    finally:
        assert _stop(proc) == 0
    assert _members(db) == []
    assert _owned(db) == 0


def test_the_flask_extension_starts_a_relay_in_a_worker_that_serves(
    db: OutboxDB, tmp_path: Path
) -> None:
    port = free_port()
    command = ["gunicorn", "--preload", "-w", "2", "-b", f"127.0.0.1:{port}", "webapp:app"]
    proc = _server(db, tmp_path, FLASK_APP, command)
    try:
        _wait(lambda: _listening(port), "a listening server", proc)
        assert _members(db) == []  # neither the master nor an idle worker runs a relay
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
            said = json.load(response)
        assert said["imported_in"] == proc.pid != said["pid"]
        assert _pid_of(said["worker"]) == said["pid"]
        _wait(lambda: said["worker"] in _members(db), "the worker's relay joining", proc)
        _wait(lambda: _owned(db) > 0, "partitions taken", proc)
    finally:
        assert _stop(proc) == 0
    assert _members(db) == []
    assert _owned(db) == 0
