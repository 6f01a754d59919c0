"""Django: `add_messages` writes in the atomic block and announces only after commit."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from relaybox import Message, Outbox
from relaybox.migrations import migrate
from tests.databases import sqlite_url, unique_table


@pytest.fixture
def django_outbox(tmp_path: Path) -> tuple[Outbox, Path]:
    from tests.integration.django_setup import configure

    db = tmp_path / "dj.db"
    table = unique_table("dj")
    asyncio.run(migrate(sqlite_url(db), table=table))
    configure(db)
    return Outbox(table=table), db


def count(db: Path, table: str) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def test_messages_are_announced_after_commit_only(django_outbox: tuple[Outbox, Path]) -> None:
    from django.db import transaction

    from relaybox.integrations.django import add_messages

    outbox, db = django_outbox
    announced: list[Message] = []
    outbox.subscribe(announced.extend)
    with transaction.atomic():
        written = add_messages(outbox, [Message(topic="orders", key="1"), Message(topic="orders")])
        assert not announced  # not before the commit
    assert [m.id for m in announced] == [m.id for m in written]
    assert count(db, outbox.table) == 2


def test_rolled_back_messages_are_neither_written_nor_announced(
    django_outbox: tuple[Outbox, Path],
) -> None:
    from django.db import transaction

    from relaybox.integrations.django import add_messages

    outbox, db = django_outbox
    announced: list[Message] = []
    outbox.subscribe(announced.extend)

    def failing_view() -> None:
        with transaction.atomic():
            add_messages(outbox, Message(topic="orders"))
            raise RuntimeError("the view failed")

    with pytest.raises(RuntimeError, match="the view failed"):
        failing_view()
    assert not announced
    assert count(db, outbox.table) == 0
