"""PostgreSQL: the owned read's second half ({prefix}_read_past) sees the snapshot of the
read that calls it. A volatile PL/pgSQL function takes a new snapshot for each query in
it, so a row committed while the read runs, with a seq below the window's end (a writer
that drew its seq before others and committed after them), would shorten the window
that the function finds and make it return rows that the read's first half had taken.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from relaybox.core.identifiers import index_prefix
from relaybox.migrations import migrate
from tests.databases import PG_URL, drop, unique_table

#: The window's size: the rows the read's first half looks at.
WINDOW = 3


@pytest.fixture
def table() -> Iterator[str]:
    import asyncio

    name = unique_table("snapshot")
    asyncio.run(migrate(PG_URL, table=name))
    try:
        yield name
    finally:
        drop(PG_URL, name)


def _insert(conn: psycopg.Connection[object], table: str, key: str) -> None:
    conn.execute(
        f"INSERT INTO {table} (id, target, topic, key, partition, type, content_type,"
        " payload, occurred_at)"
        " VALUES (%s, 'default', 't', %s, 1, 'x', 'application/json', '\\x7b7d', now())",
        (uuid.uuid4(), key),
    )


def test_rows_committed_during_a_read_do_not_move_its_window(table: str) -> None:
    late = psycopg.connect(PG_URL)  # a transaction: it draws seq 1 and commits last
    try:
        _insert(late, table, "late")
        with psycopg.connect(PG_URL, autocommit=True) as writer:
            for key in ("a", "a", "c", "b"):  # seqs 2, 3, 4, 5
                _insert(writer, table, key)
        # Without the late row the window is seqs 2-4 (full, c's head inside it), so
        # only b's head lies past it; with it, the window is 1-3 and c's head past it.
        timer = threading.Timer(0.5, late.commit)
        with psycopg.connect(PG_URL, autocommit=True) as reader:
            timer.start()
            started = time.monotonic()
            rows = reader.execute(
                f"SELECT r.key FROM (SELECT pg_sleep(1.0), 10 AS room) AS s,"
                f" LATERAL {index_prefix(table)}_read_past(s.room, NULL, 64, NULL,"
                f" '{{}}', {WINDOW}, 9223372036854775807, true) AS r"
            ).fetchall()
            timer.join()
        assert time.monotonic() - started >= 1.0  # the commit came during the read
        assert [key for (key,) in rows] == ["b"]
    finally:
        late.close()
