"""A database that accepts connections but never answers, or stops answering mid-run.

Each storage call is bounded: connecting by the URL's `connect_timeout`, each statement
by its `command_timeout`. A call that runs out of time drops its connection, logs a
warning and raises `StorageOperationalError` naming the database (its password masked),
and the next call connects again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator

import pytest

from relaybox.errors import StorageOperationalError
from relaybox.storage import open_storage
from tests.databases import MYSQL_URL, PG_URL, create, drop, unique_table
from tests.freezable import FreezableProxy, silent_port

#: Far beyond every bound the tests set, far below "forever".
PATIENCE = 45.0

URLS = {
    "asyncpg": PG_URL,
    "psycopg": PG_URL.replace("postgresql://", "postgresql+psycopg://", 1),
    "mysql": MYSQL_URL,
}
PORTS = {"asyncpg": 5432, "psycopg": 5432, "mysql": 3306}


def _with_options(url: str, options: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{options}"


@pytest.fixture(params=sorted(URLS))
def driver(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def table(driver: str) -> AsyncIterator[str]:
    name = unique_table("frozen")
    await create(URLS[driver], name)
    try:
        yield name
    finally:
        drop(URLS[driver], name)


@pytest.fixture
def proxy(driver: str) -> Iterator[FreezableProxy]:
    running = FreezableProxy(PORTS[driver])
    try:
        yield running
    finally:
        running.close()


async def test_a_database_that_never_answers_fails_the_connect_in_time(driver: str) -> None:
    with silent_port() as port:
        url = URLS[driver].replace("@", ":s3cret@", 1).replace(f":{PORTS[driver]}/", f":{port}/")
        async with asyncio.timeout(PATIENCE):
            with pytest.raises(StorageOperationalError) as raised:
                await open_storage(_with_options(url, "connect_timeout=1"))
    message = str(raised.value)
    assert "did not answer a new connection within 1 s" in message
    assert f"127.0.0.1:{port}" in message
    assert "s3cret" not in message


async def test_a_statement_that_stalls_drops_its_connection_warns_and_recovers(
    driver: str, table: str, proxy: FreezableProxy, caplog: pytest.LogCaptureFixture
) -> None:
    url = _with_options(proxy.url(URLS[driver]), "connect_timeout=1&command_timeout=1")
    storage = await open_storage(url, table=table)
    try:
        await storage.stats()
        proxy.freeze()
        with caplog.at_level(logging.WARNING, logger="relaybox.storage.sql"):
            async with asyncio.timeout(PATIENCE):
                with pytest.raises(StorageOperationalError) as raised:
                    await storage.stats()
                # The connection is gone: the next call must connect, which the frozen
                # link does not let it.
                with pytest.raises(StorageOperationalError, match="a new connection"):
                    await storage.stats()
        # The counts' first statement: on PostgreSQL they open a transaction of their
        # own (with sequential scans on for it), elsewhere they run as they are.
        first = "a BEGIN statement" if driver != "mysql" else "the query 'count_by_status'"
        assert f"did not answer {first} within 2 s" in str(raised.value)
        stalls = [r for r in caplog.records if "did not answer" in r.getMessage()]
        assert [r.levelno for r in stalls] == [logging.WARNING, logging.WARNING]
        proxy.thaw()
        async with asyncio.timeout(PATIENCE):
            assert (await storage.stats()).counts is not None
    finally:
        proxy.thaw()
        async with asyncio.timeout(PATIENCE):
            await storage.close()


async def test_closing_a_storage_whose_database_froze_does_not_wait_on_it(
    driver: str, table: str, proxy: FreezableProxy
) -> None:
    url = _with_options(proxy.url(URLS[driver]), "connect_timeout=1")
    storage = await open_storage(url, table=table)
    await storage.stats()
    proxy.freeze()
    async with asyncio.timeout(PATIENCE):
        await storage.close()
