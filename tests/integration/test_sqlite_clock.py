"""SQLite's owned read judges every row against one 'now'.

SQLite keeps 'now' steady only within one sqlite3_step, and a SELECT returns each row in
a step of its own. Here SQLite's two-argument strftime is replaced by a clock that moves
one second at every call, so each use of 'now' in the read sees a later time than the
one before: the read must still hold a key's later row back behind a head that was not
due when the read began.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

from relaybox import Message, Outbox, sql
from relaybox.migrations import migrate
from tests.databases import sqlite_url, unique_table

START = "2030-01-01 00:00:00.000"


def test_a_head_whose_delay_ends_during_the_read_still_holds_its_key_back(
    tmp_path: Path,
) -> None:
    db, table = tmp_path / "clock.db", unique_table("clock")
    asyncio.run(migrate(sqlite_url(db), table=table))
    with contextlib.closing(sqlite3.connect(db)) as conn:
        Outbox(table=table).add(conn, [Message(topic="t", key="k"), Message(topic="t", key="k")])
        head, behind = (seq for (seq,) in conn.execute(f"SELECT seq FROM {table} ORDER BY seq"))
        # The head is due 1.5 s after the read starts; the row behind it long ago.
        conn.execute(
            f"UPDATE {table} SET available_at = '2030-01-01 00:00:01.500' WHERE seq = ?", (head,)
        )
        conn.execute(
            f"UPDATE {table} SET available_at = '2000-01-01 00:00:00.000' WHERE seq = ?", (behind,)
        )
        conn.commit()

        calls = [0]

        def ticking_strftime(fmt: str, when: str) -> str:
            assert when == "now"
            calls[0] += 1
            return f"2030-01-01 00:00:{calls[0] - 1:02d}.000"

        conn.create_function("strftime", 2, ticking_strftime)
        query = sql.queries("sqlite", table)["read"]
        # in flight: none; all partitions and targets; limit 10; no byte budget to speak of
        rows = conn.execute(query, ("[]", None, 16, None, 10, 2**63 - 1, True)).fetchall()
    assert calls[0] >= 1  # the read did ask the replaced clock
    assert rows == []  # neither the head (not due) nor the row behind it
