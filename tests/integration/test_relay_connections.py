"""How many database connections a relay holds, as docs/deployment.md counts them for
sizing `max_connections`: claims, settles and housekeeping always, the counts' own once
the table is first counted, and LISTEN on PostgreSQL. Counted from this process's open
TCP connections to the database's port (Linux: /proc/self)."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from relaybox.relay.engine import Relay
from tests.databases import MYSQL_URL, PG_URL
from tests.relay_support import OutboxDB, eventually, fast_settings, outbox_db

pytestmark = pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs Linux")


def _connections_to(port: int) -> int:
    """This process's established TCP connections to `port`."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == "01" and fields[9] in mine:  # ESTABLISHED
                count += 1
    return count


@pytest.fixture(params=["postgresql", "mysql"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(request.param, tmp_path):
        yield each


async def test_a_relay_holds_five_connections_on_postgresql_and_four_elsewhere(
    db: OutboxDB,
) -> None:
    port = urllib.parse.urlsplit(PG_URL if db.name == "postgresql" else MYSQL_URL).port
    assert port is not None
    before = _connections_to(port)
    settings = fast_settings(cleanup_interval=60.0)  # no count of the table until asked
    relay = Relay(db.url, {"default": "noop://"}, table=db.table, settings=settings)
    async with relay:
        await eventually(lambda: relay.processors[0].heartbeat_at is not None)
        base = _connections_to(port) - before
        relay.sample_stats(60.0)  # as `--http` does at start
        await eventually(lambda: relay.processors[0].stats_sample is not None)
        counted = _connections_to(port) - before
    await eventually(lambda: _connections_to(port) == before)  # all closed on stop
    listen = 1 if db.name == "postgresql" else 0
    assert (base, counted) == (3 + listen, 4 + listen)
