"""relaybox.testing on PostgreSQL: the probe sees what a transaction committed, nothing
of one rolled back, and says what it saw when an assertion fails; the pipeline hands
an async consumer what the relay published and retries a failing handler."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relaybox import Consumer, Incoming, Message, Outbox
from relaybox.inbox import Inbox
from relaybox.migrations import migrate
from relaybox.testing import OutboxProbe, Pipeline, run_aside
from tests.databases import PG_URL, drop, unique_table
from tests.inbox.support import InboxWorld


@pytest.fixture
def table() -> Iterator[str]:
    name = unique_table("probe")
    run_aside(migrate(PG_URL, table=name))
    yield name
    drop(PG_URL, name)


def write(table: str, *messages: Message, commit: bool = True) -> None:
    with psycopg.connect(PG_URL) as conn:
        Outbox(table=table).add(conn, list(messages))
        if not commit:
            conn.rollback()


def test_the_probe_sees_what_was_committed_since_it_was_made(table: str) -> None:
    write(table, Message(topic="before", key="0"))
    with OutboxProbe(PG_URL, table=table) as probe:
        write(table, Message(topic="orders", key="1", type="Placed", payload={"n": 1}),
              Message(topic="orders", key="2"))  # fmt: skip
        write(table, Message(topic="orders", key="3"), commit=False)
        (placed,) = probe.assert_written(1, key="1", type="Placed")
        assert placed.json() == {"n": 1}
        assert [m.key for m in probe.messages()] == ["1", "2"]
        with pytest.raises(AssertionError, match=r"expected 1 .* key='3', found 0; written: 2"):
            probe.assert_written(1, key="3")
        probe.mark()
        probe.assert_nothing_written()


async def test_the_pipeline_retries_a_failing_handler_and_runs_until_idle(
    tmp_path: Path, table: str
) -> None:
    failures: list[str] = []

    async with InboxWorld("sqlite", tmp_path) as world:

        async def handle(message: Incoming, conn: Any) -> None:
            if not failures:
                failures.append(message.id)
                raise RuntimeError("the first attempt fails")
            await world.write_effect(conn, message, "test")

        inbox = Inbox(consumer="test", table=world.table)
        consumer = Consumer(handle, inbox=inbox, transaction=world.transaction)
        async with Pipeline(PG_URL, consumer, table=table) as pipeline:
            write(table, Message(topic="orders", key="1"), Message(topic="orders", key="2"))
            handed = await pipeline.run_until_idle()
            assert [m.key for m in handed] == ["1", "2"]
            pipeline.assert_published(2, topic="orders")
            assert await pipeline.run_until_idle() == []
        assert len(failures) == 1
        assert sorted(world.effects().values()) == [1, 1]
