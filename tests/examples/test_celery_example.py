"""examples/celery: an order and its receipt task committed together, relayed to Redis,
run by a real Celery worker of the example's own app."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import redis

from tests.brokers.harness import end_process
from tests.relay_support import eventually

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "celery"
REDIS = "redis://127.0.0.1:6379/0"


async def test_the_receipt_task_runs_once(tmp_path: Path) -> None:
    queue = f"rbtest-example-{uuid.uuid4().hex[:10]}"
    receipts, database = tmp_path / "receipts.jsonl", tmp_path / "shop.db"
    env = {
        **os.environ, "CELERY_BROKER": REDIS, "CELERY_QUEUE": queue,
        "RECEIPTS": str(receipts), "SHOP_DB": str(database),
    }  # fmt: skip
    with (tmp_path / "worker.log").open("ab") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--pool", "solo",
             "--without-heartbeat", "--without-gossip", "--without-mingle"],
            cwd=EXAMPLE, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        migrate = [sys.executable, "-m", "relaybox", "migrate", "--db", f"sqlite:///{database}"]
        subprocess.run(migrate, check=True, capture_output=True, env=env)
        shop = subprocess.run(
            [sys.executable, "shop.py", "7", "ada@example.com"],
            cwd=EXAMPLE, env=env, check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        task_id = shop.stdout.split()[4]
        assert shop.stdout.strip() == f"order 7: receipt task {task_id} sent"
        await eventually(receipts.exists, timeout=30)
        (line,) = receipts.read_text().splitlines()
        assert json.loads(line) == {"task_id": task_id, "order_id": 7, "email": "ada@example.com"}
        with sqlite3.connect(database) as connection:
            orders = connection.execute("SELECT id, email FROM orders").fetchall()
        assert orders == [(7, "ada@example.com")]
    finally:
        end_process(worker)
        redis.Redis.from_url(REDIS).delete(queue, f"_kombu.binding.{queue}")
