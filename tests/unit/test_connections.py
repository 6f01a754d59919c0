"""The writer's per-connection channels: recognised once, kept weakly, style kept fresh."""

from __future__ import annotations

import gc
import sqlite3
import weakref
from typing import Any

from relaybox.writer import connections
from relaybox.writer.connections import sync_channel


class _Cursor:
    """Shaped like psycopg's: made on a connection, run, counted."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.rowcount = -1

    def execute(self, query: bytes, params: Any) -> _Cursor:
        self.connection.ran.append((query, params))
        self.rowcount = 1
        return self


class RawCursorMixin:  # psycopg's marker of cursors that take $n
    pass


class _RawCursor(RawCursorMixin, _Cursor):
    pass


class _PGconn:
    pipeline_status = 0  # psycopg.pq.PipelineStatus.OFF

    def __init__(self) -> None:
        self.encoding = b"UTF8"

    def parameter_status(self, name: bytes) -> bytes | None:
        return self.encoding if name == b"client_encoding" else None


class Connection:
    """Recognised as psycopg's by its module and name, without a server."""

    __module__ = "psycopg.connection"

    def __init__(self) -> None:
        self.cursor_factory: type = _Cursor
        self.pgconn = _PGconn()
        self.ran: list[tuple[bytes, Any]] = []


def test_a_connection_is_recognised_once_and_its_channel_kept() -> None:
    conn = Connection()
    channel = sync_channel(conn)
    assert (channel.dialect, channel.style) == ("postgresql", "format")
    assert sync_channel(conn) is channel
    assert channel.execute("SELECT %s", (1,)) == 1
    assert conn.ran == [(b"SELECT %s", (1,))]  # psycopg gets the text as bytes
    assert sync_channel(Connection()) is not channel  # one per connection object


def test_a_swapped_cursor_factory_changes_the_style() -> None:
    conn = Connection()
    assert sync_channel(conn).style == "format"
    conn.cursor_factory = _RawCursor
    assert sync_channel(conn).style == "numeric_dollar"


def test_a_changed_client_encoding_gets_a_new_channel() -> None:
    """The kept cursor encodes text in the client encoding it was made under."""
    conn = Connection()
    channel = sync_channel(conn)
    conn.pgconn.encoding = b"LATIN1"
    assert sync_channel(conn) is not channel


def test_the_cache_never_keeps_a_connection_alive() -> None:
    conn = Connection()
    sync_channel(conn)
    key, alive = id(conn), weakref.ref(conn)
    del conn
    gc.collect()
    assert alive() is None
    assert key not in connections._channels


def test_connections_without_weak_references_get_a_channel_per_call() -> None:
    conn = sqlite3.connect(":memory:")
    try:
        first = sync_channel(conn)
        assert sync_channel(conn) is not first
        assert first.execute("CREATE TABLE t (x)", ()) in (-1, 0)
        assert sync_channel(conn).execute("INSERT INTO t VALUES (?)", (1,)) == 1
    finally:
        conn.close()
