"""The Celery side: a worker for the `shop.send_receipt` task.

    relaybox migrate --db sqlite:///receipts.db --inbox
    celery -A tasks worker --pool solo

A task sent from the outbox may come twice (after a relay crash, under the same task
id), so its effect and relaybox's inbox record of the task id commit together: a
second copy finds the id recorded and does nothing.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3

from celery import Celery

from relaybox import Inbox

BROKER = os.environ.get("CELERY_BROKER", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("CELERY_QUEUE", "celery")
RECEIPTS = os.environ.get("RECEIPTS_DB", "receipts.db")

app = Celery("shop", broker=BROKER)
app.conf.task_default_queue = QUEUE
app.conf.worker_enable_remote_control = False

inbox = Inbox(consumer="receipts")


@app.task(name="shop.send_receipt", bind=True)
def send_receipt(self, order_id: int, email: str) -> None:
    with contextlib.closing(sqlite3.connect(RECEIPTS)) as connection, connection:
        if not inbox.record(connection, self.request.id):
            return  # this task ran already
        connection.execute("CREATE TABLE IF NOT EXISTS receipts (order_id INTEGER, email TEXT)")
        connection.execute("INSERT INTO receipts VALUES (?, ?)", (order_id, email))
