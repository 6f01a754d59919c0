"""The shop's tests, with relaybox's pytest fixtures and its in-process pipeline."""

import asyncio
import contextlib
import sqlite3

import pytest
from shop import place_order, shipping

from relaybox.testing import OutboxProbe, Pipeline


def test_placing_an_order_writes_its_message(db: str, relaybox_outbox: OutboxProbe) -> None:
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        place_order(conn, "order-1", 30)

    (placed,) = relaybox_outbox.assert_written(1, topic="orders", key="order-1")
    assert placed.type == "OrderPlaced"
    assert placed.json() == {"order": "order-1", "amount": 30}


def test_a_rolled_back_order_writes_no_message(db: str, relaybox_outbox: OutboxProbe) -> None:
    opened = contextlib.closing(sqlite3.connect(db))
    with pytest.raises(ValueError, match="positive"), opened as conn, conn:
        place_order(conn, "order-2", 0)

    relaybox_outbox.assert_nothing_written()


def test_an_order_is_shipped_once(db: str, relaybox_database: str) -> None:
    consumer = shipping(db)

    async def scenario() -> None:
        async with Pipeline(relaybox_database, consumer) as pipeline:
            with contextlib.closing(sqlite3.connect(db)) as conn, conn:
                place_order(conn, "order-3", 20)
            handed = await pipeline.run_until_idle()  # OrderPlaced, then OrderShipped

            assert [message.type for message in handed] == ["OrderPlaced", "OrderShipped"]
            pipeline.assert_published(1, topic="shipments", key="order-3")
            # The broker delivers OrderPlaced again: the inbox skips the copy.
            await consumer.process(handed[0])

    asyncio.run(scenario())
    assert consumer.duplicates == 1
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT order_id FROM shipments").fetchall() == [("order-3",)]


def test_a_broker_that_refuses_a_message_leaves_it_unshipped(
    db: str, relaybox_database: str
) -> None:
    async def scenario() -> None:
        async with Pipeline(relaybox_database, shipping(db)) as pipeline:
            pipeline.publishers["default"].reject(lambda message: message.key == "order-4")
            with contextlib.closing(sqlite3.connect(db)) as conn, conn:
                place_order(conn, "order-4", 40)
                place_order(conn, "order-5", 50)
            await pipeline.run_until_idle()

            pipeline.assert_published(0, key="order-4")
            pipeline.assert_published(1, topic="shipments", key="order-5")

    asyncio.run(scenario())
