"""Place an order and enqueue its receipt as a Celery task in the same transaction, then
relay the task to Celery's broker.

    relaybox migrate --db sqlite:///shop.db
    python shop.py 1 ada@example.com

If the transaction rolls back, no task is sent; if the broker is down when it commits,
the relay sends the task once the broker is back.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys

from relaybox import Message, Outbox, Relay

DATABASE = os.environ.get("SHOP_DB", "shop.db")
QUEUE = os.environ.get("CELERY_QUEUE", "celery")
TARGET = os.environ.get("CELERY_TARGET", f"celery+redis://127.0.0.1:6379/0?queue={QUEUE}")

outbox = Outbox()


def place_order(order_id: int, email: str) -> str:
    """Commit the order with its task; the task's id (the message's) is returned."""
    task = Message(
        topic="tasks",
        type="shop.send_receipt",  # the Celery task's name
        key=str(order_id),
        payload={"order_id": order_id, "email": email},  # its keyword arguments
    )
    connection = sqlite3.connect(DATABASE)
    with connection:  # one transaction: the order and its task, or neither
        connection.execute("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, email TEXT)")
        connection.execute("INSERT INTO orders (id, email) VALUES (?, ?)", (order_id, email))
        outbox.add(connection, task)
    connection.close()
    return str(task.id)


async def relay_until_sent(count: int) -> None:
    """Run the relay until the broker confirmed `count` tasks."""
    async with Relay(f"sqlite:///{DATABASE}", {"default": TARGET}) as relay:
        while relay.target_counters()["default"].acked < count:
            await asyncio.sleep(0.05)


if __name__ == "__main__":
    task_id = place_order(int(sys.argv[1]), sys.argv[2])
    asyncio.run(relay_until_sent(1))
    print(f"order {sys.argv[1]}: receipt task {task_id} sent")
