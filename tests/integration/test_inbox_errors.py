"""The inbox's errors speak relaybox: a database never migrated for it, and a record of
something that is not a received message."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest

from relaybox import Inbox, InboxError, Message, SchemaError
from tests.databases import unique_table
from tests.integration.drivers import MYSQL_KW, PG_DSN


@contextlib.contextmanager
def _psycopg(_: Path) -> Iterator[Any]:
    with psycopg.connect(PG_DSN) as conn:
        yield conn


@contextlib.contextmanager
def _pymysql(_: Path) -> Iterator[Any]:
    kw = dict(MYSQL_KW, database=MYSQL_KW["db"])
    del kw["db"]
    with contextlib.closing(pymysql.connect(**kw)) as conn:
        yield conn


@contextlib.contextmanager
def _sqlite3(db: Path) -> Iterator[Any]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        yield conn


OPENERS: dict[str, Callable[[Path], contextlib.AbstractContextManager[Any]]] = {
    "psycopg": _psycopg,
    "pymysql": _pymysql,
    "sqlite3": _sqlite3,
}


@pytest.mark.parametrize("kind", sorted(OPENERS))
def test_an_unmigrated_inbox_says_to_migrate_it(kind: str, tmp_path: Path) -> None:
    table = unique_table("nomig")
    with OPENERS[kind](tmp_path / "app.db") as conn:
        with pytest.raises(SchemaError) as raised:
            Inbox(table=table).record(conn, "m-1")
        conn.rollback()
    assert f"relaybox migrate --db URL --inbox --table {table}" in str(raised.value)
    assert "does not exist" in str(raised.value)


async def test_an_unmigrated_inbox_says_to_migrate_it_on_asyncpg() -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_DSN)
    try:
        async with conn.transaction():
            with pytest.raises(SchemaError, match="--inbox"):
                await Inbox(table=unique_table("nomig")).record_async(conn, "m-1")
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (Message(topic="orders"), "a Message is what a producer writes"),
        (Message(topic="orders").id, "not UUID"),
        (42, "not int"),
    ],
    ids=["message", "uuid", "int"],
)
def test_recording_something_not_received_says_what_record_takes(
    given: object, said: str, tmp_path: Path
) -> None:
    with _sqlite3(tmp_path / "app.db") as conn, pytest.raises(InboxError) as raised:
        Inbox().record(conn, given)  # type: ignore[arg-type]
    assert "an Incoming" in str(raised.value)
    assert said in str(raised.value)
