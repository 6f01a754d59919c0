"""`relaybox relay` with its URLs in the environment and in files, none on its command line
(nor, with a configuration file, any other option).

What `ps` shows of the process holds no secret, nor does what it prints or serves, and
the secrets still do their work: the webhook receives every message signed with the
secret of the broker URL and with its Basic credentials.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from relaybox import Message
from relaybox.publishers import webhook_signature
from tests.acceptance.test_relay_processes import RELAYBOX
from tests.brokers.harness import free_port
from tests.brokers.test_http import HttpHarness, webhook_harness
from tests.databases import PG_URL
from tests.relay_support import OutboxDB, eventually, outbox_db

#: Any password logs in to the test PostgreSQL (it trusts local logins).
DB_PASSWORD = "DbPassw0rd"
BASIC_PASSWORD = "HookPassw0rd"
SIGNING_SECRET = "SigningS3cret"
SECRETS = (DB_PASSWORD, BASIC_PASSWORD, SIGNING_SECRET)


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path):
        yield each


@pytest.fixture
async def webhook() -> AsyncIterator[HttpHarness]:
    async with webhook_harness() as harness:
        yield harness


def _leaked(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return str(answer.read().decode())


@pytest.mark.parametrize("where", ["db-in-environment", "db-in-file", "config-file"])
async def test_a_relay_runs_with_its_urls_only_in_the_environment_and_files(
    db: OutboxDB, webhook: HttpHarness, tmp_path: Path, where: str
) -> None:
    db_url = PG_URL.replace("postgres@", f"postgres:{DB_PASSWORD}@")
    hook = (
        f"http://relay:{BASIC_PASSWORD}@127.0.0.1:{webhook.server.port}/hooks"
        f"?secret={SIGNING_SECRET}"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYBOX_")}
    status_port = free_port()
    command = [RELAYBOX, "relay", "--table", db.table, "--idle-interval", "0.1",
               "--http", f"127.0.0.1:{status_port}", "--log-level", "INFO"]  # fmt: skip
    if where == "db-in-environment":  # and the broker in a file
        env["RELAYBOX_DB"] = db_url
        (tmp_path / "hook.url").write_text(hook + "\n")
        command += ["--broker-file", f"default={tmp_path / 'hook.url'}"]
    elif where == "config-file":  # every option in relaybox.toml, the URLs in files
        (tmp_path / "db.url").write_text(db_url + "\n")
        (tmp_path / "hook.url").write_text(hook + "\n")
        (tmp_path / "relaybox.toml").write_text(
            f'[relay]\ntable = "{db.table}"\nidle_interval = 0.1\n'
            f'http = "127.0.0.1:{status_port}"\ndb_file = "{tmp_path / "db.url"}"\n'
            f'[relay.broker_files]\ndefault = "{tmp_path / "hook.url"}"\n'
        )
        command = [RELAYBOX, "relay", "--config", str(tmp_path / "relaybox.toml")]
    else:  # and the broker in the environment
        (tmp_path / "db.url").write_text(db_url + "\n")
        env["RELAYBOX_BROKER"] = f"default={hook}"
        command += ["--db-file", str(tmp_path / "db.url")]
    log = tmp_path / "relay.log"
    with log.open("w") as stderr:
        relay = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                 env=env)  # fmt: skip
    try:
        assert relay.stdout is not None
        running = await asyncio.to_thread(relay.stdout.readline)
        assert running.startswith("relay "), log.read_text()

        await db.write([Message(topic="orders", payload={"n": 1}, key="k")])
        await eventually(lambda: webhook.server.accepted, timeout=30)
        (request,) = webhook.server.accepted
        signed = webhook_signature.verify_signature(SIGNING_SECRET, request.headers, request.body)
        assert "ce-id" in signed
        basic = base64.b64encode(f"relay:{BASIC_PASSWORD}".encode()).decode()
        assert request.headers["authorization"] == f"Basic {basic}"

        argv = Path(f"/proc/{relay.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        shown = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(relay.pid)],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        served = await asyncio.to_thread(_get, status_port, "/api/outbox")
        assert json.loads(served)["ready"]
        assert "***" in served  # the database URL, masked
    finally:
        relay.send_signal(signal.SIGTERM)
        output, _ = await asyncio.to_thread(relay.communicate, timeout=30)
    assert relay.returncode == 0, log.read_text()
    assert "relay" in shown
    assert _leaked(argv + shown) == []
    assert _leaked(served) == []
    assert _leaked(running + output + log.read_text()) == []
