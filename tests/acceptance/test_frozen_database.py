"""A `relaybox relay` process whose database stops answering ends on SIGTERM.

The relay reaches PostgreSQL or MariaDB through a proxy that freezes mid-run (no byte
either way, nothing closed), or is pointed at a port that accepts connections and never
answers. SIGTERM must end it within its shutdown timeout and a margin, and a stalled
call is logged.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from relaybox.core.lifecycle import Status
from relaybox.tools.embedded_nats import EmbeddedNats
from tests.acceptance.test_relay_processes import RELAYBOX, published, wait_delivered
from tests.databases import MYSQL_URL, PG_URL
from tests.freezable import FreezableProxy, silent_port
from tests.relay_support import OutboxDB, eventually, messages, outbox_db

SHUTDOWN_TIMEOUT = 5.0
#: Room beyond the shutdown timeout for closing what is left, on a busy machine.
MARGIN = 10.0
PORTS = {"postgresql": 5432, "mysql": 3306}


@pytest.fixture(params=sorted(PORTS))
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(request.param, tmp_path):
        yield each


@pytest.fixture
def proxy(db: OutboxDB) -> Iterator[FreezableProxy]:
    running = FreezableProxy(PORTS[db.name])
    try:
        yield running
    finally:
        running.close()


def start_relay(
    url: str, table: str, broker: str, log: Path, *options: str
) -> subprocess.Popen[str]:
    command = [
        RELAYBOX, "relay", "--db", url, "--table", table, "--broker", f"default={broker}",
        "--lease", "3", "--partitions", "16", "--batch-size", "50", "--idle-interval", "0.1",
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--log-level", "WARNING", *options,
    ]  # fmt: skip
    with log.open("w") as errors:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)


async def running(proc: subprocess.Popen[str], log: Path) -> None:
    assert proc.stdout is not None
    line = await asyncio.to_thread(proc.stdout.readline)
    assert line.startswith("relay "), f"relay did not start: {line!r} {log.read_text()}"


def seconds_to_end(proc: subprocess.Popen[str]) -> float:
    """SIGTERM `proc`; how long it took to exit (killed, and a failure, past the bound)."""
    asked = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(SHUTDOWN_TIMEOUT + MARGIN)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail(f"the relay ignored SIGTERM for {SHUTDOWN_TIMEOUT + MARGIN:g} s")
    return time.monotonic() - asked


@pytest.mark.parametrize("command_timeout", [1, 600])
async def test_sigterm_ends_a_relay_whose_database_froze_mid_run(
    db: OutboxDB, proxy: FreezableProxy, tmp_path: Path, command_timeout: int
) -> None:
    """With a long command_timeout, the stop itself cancels what is stuck; with a short
    one, the stalled call is also logged and retried meanwhile."""
    url = f"{proxy.url(db.url)}?connect_timeout=1&command_timeout={command_timeout}"
    out, log = tmp_path / "published.jsonl", tmp_path / "relay.log"
    proc = start_relay(url, db.table, f"file://{out}", log)
    try:
        await running(proc, log)
        batch = messages([f"k{i}" for i in range(5)], per_key=4)
        await db.write(batch)
        await wait_delivered(out, {str(m.id) for m in batch})
        proxy.freeze()
        await asyncio.sleep(3 * command_timeout if command_timeout < 5 else 1)
        took = seconds_to_end(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert took < SHUTDOWN_TIMEOUT + MARGIN
    if command_timeout < 5:
        assert "did not answer" in log.read_text()
    assert len(published(out)) >= len(batch)


def _catching_sigterm(pid: int, timeout: float = 30.0) -> None:
    """Wait until process `pid` handles SIGTERM itself (its caught-signals mask in
    /proc), so that a SIGTERM sent then reaches the relay, not the default action."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:"))
                     .split()[1], 16)  # fmt: skip
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} did not take SIGTERM over within {timeout} s")


@pytest.mark.parametrize("url", [PG_URL, MYSQL_URL], ids=["postgresql", "mysql"])
def test_sigterm_ends_a_relay_whose_database_never_answers(url: str, tmp_path: Path) -> None:
    with silent_port() as port:
        silent = url.replace(f":{PORTS[url.split(':', 1)[0]]}/", f":{port}/")
        log = tmp_path / "relay.log"
        proc = start_relay(silent, "relaybox_outbox", f"file://{tmp_path / 'out'}", log)
        _catching_sigterm(proc.pid)  # past its imports, on a busy machine too
        time.sleep(1)  # starting: connecting to the database
        seconds_to_end(proc)
    assert "did not answer a new connection within 5 s" in log.read_text()


async def test_sigterm_ends_a_relay_stuck_on_a_frozen_broker_and_database(
    db: OutboxDB, proxy: FreezableProxy, tmp_path: Path
) -> None:
    """A batch is stuck at the broker when the database freezes too: at the shutdown
    timeout the batch is cancelled and hands its rows back, which the frozen database
    never answers (a statement waits up to its command_timeout, a new connection up to
    its connect_timeout, and the settle tries five times): the stop gives up on that
    after its grace."""
    async with EmbeddedNats() as server:
        client = await nats.connect(server.url)
        stream = client.jetstream()
        await stream.add_stream(StreamConfig(name="frozen_orders", subjects=["orders"]))
        broker = FreezableProxy(server.port)
        log = tmp_path / "relay.log"
        url = f"{proxy.url(db.url)}?command_timeout=600"
        nats_url = f"nats://127.0.0.1:{broker.port}?timeout=60"
        options = ("--publish-timeout", "60", "--no-partition-leases")
        proc = start_relay(url, db.table, nats_url, log, *options)
        try:
            await running(proc, log)
            first = messages(["a", "b"], per_key=2)
            await db.write(first)
            await eventually(lambda: _stored(stream, len(first)), timeout=30.0, interval=0.1)
            broker.freeze()
            await db.write(messages(["c"], per_key=1))
            await eventually(_claimed(db), timeout=30.0, interval=0.1)
            proxy.freeze()
            took = seconds_to_end(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            proxy.thaw()
            broker.close()
            await client.close()
    assert took < SHUTDOWN_TIMEOUT + MARGIN


async def _stored(stream: JetStreamContext, count: int) -> bool:
    info = await stream.stream_info("frozen_orders")
    return bool(info.state.messages >= count)


def _claimed(db: OutboxDB) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await db.status_counts()).get(Status.PROCESSING, 0) > 0

    return check
