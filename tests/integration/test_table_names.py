"""Table names: a reserved word is refused up front, at every entry, with the rule; every
other keyword a live database knows works there unquoted."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable
from typing import Any

import psycopg
import pymysql
import pytest
from click.testing import CliRunner

from relaybox import Inbox, InvalidTableNameError, Outbox, Relay
from relaybox.cli.main import main
from relaybox.core.identifiers import RESERVED_WORDS, validate_table_name
from relaybox.migrations import migrate
from relaybox.publishers.memory import MemoryPublisher
from tests.databases import PG_URL

#: Every statement shape relaybox's SQL puts a table name in.
_SHAPES = (
    "CREATE {temporary} TABLE {name} (x int)",
    "CREATE INDEX {name}_ix ON {name} (x)",
    "INSERT INTO {name} (x) VALUES (1)",
    "SELECT x FROM {name} WHERE x = 1",
    "SELECT t.x FROM {name} AS t",
    "SELECT 1 FROM {name} WHERE 1 = 0 UNION ALL SELECT 1 FROM {name} WHERE 1 = 0",
    "UPDATE {name} SET x = 2 WHERE x = 1",
    "DELETE FROM {name} WHERE x = 2",
)


def _statements(name: str, temporary: str) -> list[str]:
    return [shape.format(name=name, temporary=temporary) for shape in _SHAPES]


def _accepted(words: list[str]) -> list[str]:
    found = []
    for word in {w.lower() for w in words}:
        with contextlib.suppress(InvalidTableNameError):
            found.append(validate_table_name(word))
    return sorted(found)


def _refused(run: Callable[[str], Any], words: list[str]) -> list[str]:
    refused = []
    for word in words:
        try:
            run(word)
        except Exception:  # noqa: BLE001 - any refusal counts; the list names the word
            refused.append(word)
    return refused


def test_every_postgresql_keyword_relaybox_accepts_works_unquoted() -> None:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        keywords = [word for (word,) in conn.execute("SELECT word FROM pg_get_keywords()")]

        def run(name: str) -> None:
            with contextlib.suppress(_RolledBack), conn.transaction():
                for statement in _statements(name, "TEMPORARY"):
                    conn.execute(statement)
                raise _RolledBack

        assert _refused(run, _accepted(keywords)) == []


def test_every_mariadb_keyword_relaybox_accepts_works_unquoted() -> None:
    conn = pymysql.connect(host="127.0.0.1", user="root", database="test", autocommit=True)
    with conn, conn.cursor() as cursor:
        cursor.execute("SELECT word FROM information_schema.keywords")
        keywords = [word for (word,) in cursor.fetchall()]

        def run(name: str) -> None:
            try:
                for statement in _statements(name, "TEMPORARY"):
                    cursor.execute(statement)
            finally:
                with contextlib.suppress(pymysql.MySQLError):
                    cursor.execute(f"DROP TEMPORARY TABLE IF EXISTS {name}")

        assert _refused(run, _accepted(keywords)) == []


#: SQLite's keywords as its documentation lists them (Python's sqlite3 has no call that
#: lists them).
_SQLITE_DOCUMENTED = """
abort action add after all alter always analyze and as asc attach autoincrement before
begin between by cascade case cast check collate column commit conflict constraint create
cross current current_date current_time current_timestamp database default deferrable
deferred delete desc detach distinct do drop each else end escape except exclude exclusive
exists explain fail filter first following for foreign from full generated glob group
groups having if ignore immediate in index indexed initially inner insert instead intersect
into is isnull join key last left like limit match materialized natural no not nothing
notnull null nulls of offset on or order others outer over partition plan pragma preceding
primary query raise range recursive references regexp reindex release rename replace
restrict returning right rollback row rows savepoint select set table temp temporary then
ties to transaction trigger unbounded union unique update using vacuum values view virtual
when where window with without
"""


def test_every_sqlite_keyword_relaybox_accepts_works_unquoted() -> None:
    def run(name: str) -> None:
        with contextlib.closing(sqlite3.connect(":memory:")) as lite:
            for statement in _statements(name, ""):
                lite.execute(statement)

    assert _refused(run, _accepted(_SQLITE_DOCUMENTED.split())) == []


class _RolledBack(Exception):
    """Ends a transaction that only tried statements."""


@pytest.mark.parametrize("reserved", ["order", "select", "user", "public.order", "order.outbox"])
def test_a_reserved_word_is_refused_by_the_writer_inbox_and_relay(reserved: str) -> None:
    makers: list[Callable[[], object]] = [
        lambda: Outbox(table=reserved),
        lambda: Inbox(table=reserved),
        lambda: Relay("memory://", {"default": MemoryPublisher()}, table=reserved),
        lambda: asyncio.run(migrate(PG_URL, table=reserved)),
    ]
    for make in makers:
        with pytest.raises(InvalidTableNameError, match="reserved word"):
            make()


@pytest.mark.parametrize(
    "command",
    [
        ["migrate", "--db", PG_URL],
        ["migrate", "--db", PG_URL, "--inbox"],
        ["schema", "--dialect", "mysql"],
        ["status", "--db", PG_URL],
        ["abandoned", "--db", PG_URL],
        ["replay", "--db", PG_URL, "1"],
    ],
    ids=lambda command: "-".join(part for part in command if not part.startswith("post")),
)
def test_the_command_line_refuses_a_reserved_word_in_one_line(command: list[str]) -> None:
    result = CliRunner().invoke(main, [*command, "--table", "order"])
    assert result.exit_code != 0
    assert "'order' is a reserved word" in result.stderr
    assert "Traceback" not in result.output + result.stderr


def test_the_list_holds_plain_lower_case_words() -> None:
    assert all(word.isidentifier() and word == word.lower() for word in RESERVED_WORDS)
    assert {"order", "select", "user", "group", "table", "rank"} <= RESERVED_WORDS
    assert validate_table_name("orders") == "orders"
