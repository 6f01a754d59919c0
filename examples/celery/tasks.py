"""The Celery side: a worker for the `shop.send_receipt` task.

    celery -A tasks worker --pool solo

The task runs once per message as a rule, but may run twice after a relay crash (the
same task id both times), so it records its task id and does nothing the second time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from celery import Celery

BROKER = os.environ.get("CELERY_BROKER", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("CELERY_QUEUE", "celery")
RECEIPTS = Path(os.environ.get("RECEIPTS", "receipts.jsonl"))

app = Celery("shop", broker=BROKER)
app.conf.task_default_queue = QUEUE
app.conf.worker_enable_remote_control = False


@app.task(name="shop.send_receipt", bind=True)
def send_receipt(self, order_id: int, email: str) -> None:
    sent = RECEIPTS.read_text().splitlines() if RECEIPTS.exists() else []
    if any(json.loads(line)["task_id"] == self.request.id for line in sent):
        return  # a second delivery of the same task
    with RECEIPTS.open("a") as receipts:
        receipt = {"task_id": self.request.id, "order_id": order_id, "email": email}
        receipts.write(json.dumps(receipt) + "\n")
