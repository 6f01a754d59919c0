"""The one-transaction connection that the command line, the console and the entity and
dedup stores open by URL is bounded as a storage is: a host that takes the connection
and never answers fails within the URL's connect_timeout, without the URL's password in
the error, and a PostgreSQL statement stops at its command_timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from relaybox.errors import StorageOperationalError
from relaybox.storage.connect import transaction
from relaybox.storage.urls import DatabaseUrl
from tests.databases import PG_URL

SECRET = "s3cr3t-pw"


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """A port whose server accepts connections and never says a word."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "scheme", ["postgresql+asyncpg", "postgresql+psycopg", "mysql+aiomysql", "mysql+asyncmy"]
)
async def test_a_host_that_never_answers_fails_within_the_connect_timeout(
    silent_port: int, scheme: str
) -> None:
    url = DatabaseUrl.parse(
        f"{scheme}://app:{SECRET}@127.0.0.1:{silent_port}/db?connect_timeout=0.5"
    )
    started = time.monotonic()
    with pytest.raises(StorageOperationalError) as raised:
        async with transaction(url):
            pytest.fail("connected to a server that never answered")
    assert time.monotonic() - started < 0.5 + 1.0
    assert "did not answer a new connection within 0.5 s" in str(raised.value)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize("scheme", ["postgresql+asyncpg", "postgresql+psycopg"])
async def test_a_postgresql_statement_stops_at_the_command_timeout(scheme: str) -> None:
    url = DatabaseUrl.parse(PG_URL.replace("postgresql", scheme, 1) + "?command_timeout=0.3")
    started = time.monotonic()
    with pytest.raises(Exception, match=r"statement timeout|canceling statement"):
        async with transaction(url) as connection:
            await connection.execute("SELECT pg_sleep(5)")  # asyncpg's and psycopg's alike
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("scheme", ["postgresql+asyncpg", "postgresql+psycopg"])
async def test_a_statement_within_the_bound_commits(scheme: str) -> None:
    url = DatabaseUrl.parse(PG_URL.replace("postgresql", scheme, 1) + "?command_timeout=5")
    async with transaction(url) as connection:
        if scheme.endswith("asyncpg"):
            value = await connection.fetchval("SELECT current_setting('statement_timeout')")
        else:
            cursor = await connection.execute("SELECT current_setting('statement_timeout')")
            (value,) = await cursor.fetchone()
    assert value == "5s"
