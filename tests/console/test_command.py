"""`relaybox console` as a process: it serves the tables it is given, takes its token
from the environment or a file (never the command line), and without one is read-only.
The database's password shows nowhere."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.test_relay_processes import RELAYBOX
from tests.brokers.harness import free_port
from tests.inbox.support import InboxWorld, incoming
from tests.relay_support import OutboxDB, eventually, outbox_db

TOKEN = "a-token-for-the-console-process"
#: PostgreSQL here trusts local connections, so a password in the URL is never checked:
#: it stands for a real one that must not show.
PASSWORD = "s3cret-in-the-url"


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path):
        yield each


def _call(port: int, path: str, body: dict[str, Any] | None = None, **headers: str) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers={
        "Content-Type": "application/json", **headers,
    })  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except OSError:
        return 0, None


class Console:
    def __init__(self, db: OutboxDB, tmp_path: Path, *options: str, token: str | None) -> None:
        self.port = free_port()
        url = db.url.replace("postgres@", f"postgres:{PASSWORD}@")
        env = {k: v for k, v in os.environ.items() if k != "RELAYBOX_CONSOLE_TOKEN"}
        if token is not None:
            env["RELAYBOX_CONSOLE_TOKEN"] = token
        self.log = tmp_path / f"console-{self.port}.log"
        self.process = subprocess.Popen(
            [RELAYBOX, "console", "--db", url, "--table", db.table,
             "--listen", f"127.0.0.1:{self.port}", *options],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip

    def call(self, path: str, body: dict[str, Any] | None = None, **headers: str) -> Any:
        return _call(self.port, path, body, **headers)

    def stop(self) -> str:
        self.process.terminate()
        self.process.wait(timeout=15)
        return self.log.read_text()


@pytest.fixture
def consoles() -> Iterator[list[Console]]:
    started: list[Console] = []
    yield started
    for console in started:
        if console.process.poll() is None:
            console.stop()


async def test_the_console_serves_with_the_token_from_the_environment(
    db: OutboxDB, tmp_path: Path, consoles: list[Console]
) -> None:
    console = Console(db, tmp_path, token=TOKEN)
    consoles.append(console)
    await eventually(lambda: console.call("/api/session")[0] == 200, timeout=30)
    assert console.call("/api/session")[1]["changes"] is True
    status, tables = console.call("/api/tables")
    assert status == 200
    (table,) = tables["tables"]
    assert table["name"].endswith(f" {db.table}")
    assert PASSWORD not in json.dumps(tables)
    dry = {"filter": {"state": ["abandoned"]}, "actor": "ana", "dry_run": True}
    action = "/api/tables/0/actions/replay"
    assert console.call(action, dry, Authorization=f"Bearer {TOKEN}") == (200, {
        "action": "replay", "dry_run": True, "matched": 0, "changed": 0, "seqs": [],
        "keys": [], "published_ahead": [],
    })  # fmt: skip
    assert console.call(action, dry, Authorization="Bearer wrong")[0] == 401
    said = console.stop()
    assert f"relaybox console on http://127.0.0.1:{console.port}/" in said
    assert PASSWORD not in said
    assert TOKEN not in said


async def test_without_a_token_it_is_read_only_and_a_token_file_changes_that(
    db: OutboxDB, tmp_path: Path, consoles: list[Console]
) -> None:
    bare = Console(db, tmp_path, token=None)
    consoles.append(bare)
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    filed = Console(db, tmp_path, "--token-file", str(token_file), token=None)
    consoles.append(filed)
    for console in (bare, filed):
        await eventually(lambda c=console: c.call("/api/session")[0] == 200, timeout=30)
    assert bare.call("/api/session")[1]["changes"] is False
    body = {"seqs": [1], "actor": "ana", "dry_run": True}
    refused = bare.call("/api/tables/0/actions/replay", body, Authorization=f"Bearer {TOKEN}")
    assert refused == (403, {"error": "no token is configured, so the console is read-only"})
    assert "(read-only)" in bare.stop()
    allowed = filed.call("/api/tables/0/actions/replay", body, Authorization=f"Bearer {TOKEN}")
    assert allowed[0] == 200


async def test_inbox_databases_given_by_url_and_by_file_are_watched_with_passwords_masked(
    db: OutboxDB, tmp_path: Path, consoles: list[Console]
) -> None:
    async with InboxWorld("postgresql", tmp_path) as world:
        consumer = world.consumer(name="billing")
        await consumer.process(incoming("m1"))
        assert await consumer.record_activity()
        secret_url = world.url.replace("postgres@", f"postgres:{PASSWORD}@")
        url_file = tmp_path / "inbox-url"
        url_file.write_text(f"{secret_url}\n")
        console = Console(db, tmp_path, "--inbox-db", secret_url, "--inbox-db-file",
                          str(url_file), "--inbox-table", world.table, token=None)  # fmt: skip
        consoles.append(console)
        await eventually(lambda: console.call("/api/session")[0] == 200, timeout=30)
        status, listed = console.call("/api/inboxes")
        assert status == 200
        assert [inbox["index"] for inbox in listed["inboxes"]] == [0, 1]
        assert all(inbox["name"].endswith(f" {world.table}") for inbox in listed["inboxes"])
        status, activity = console.call("/api/inboxes/1/activity?minutes=5")
        assert status == 200
        assert sum(p["applied"] for p in activity["consumers"]["billing"]) == 1
        assert PASSWORD not in json.dumps([listed, activity])
        said = console.stop()
    assert f"inbox {listed['inboxes'][0]['name']}" in said
    assert PASSWORD not in said


def test_the_token_is_never_an_option_and_a_bad_listen_address_is_refused(
    tmp_path: Path,
) -> None:
    on_line = subprocess.run(
        [RELAYBOX, "console", "--db", "sqlite:///x.db", "--token", TOKEN],
        check=False, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert on_line.returncode == 2
    assert "No such option '--token'" in on_line.stderr
    bad = subprocess.run(
        [RELAYBOX, "console", "--db", "sqlite:///x.db", "--listen", "127.0.0.1:http"],
        check=False, capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )  # fmt: skip
    assert bad.returncode == 1
    assert "--listen '127.0.0.1:http': give HOST:PORT" in bad.stderr
