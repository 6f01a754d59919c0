"""examples/celery: an order and its receipt task committed together, relayed to Redis,
run by a real Celery worker of the example's own app.

`receipt_task_runs_once` takes the Python that runs the shop and the worker, so the
packaging tests run the same steps from a fresh virtual environment holding the built
wheel."""

from __future__ import annotations

import contextlib
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
    await receipt_task_runs_once(Path(sys.executable), tmp_path)


async def receipt_task_runs_once(python: Path, tmp_path: Path) -> None:
    """Migrate the shop's and the worker's SQLite files, start a worker with `python` on
    a queue of its own, place an order and find its receipt written once. The worker is
    stopped and the queue's Redis keys deleted after."""
    queue = f"rbtest-example-{uuid.uuid4().hex[:10]}"
    receipts, database = tmp_path / "receipts.db", tmp_path / "shop.db"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(
        CELERY_BROKER=REDIS, CELERY_QUEUE=queue,
        RECEIPTS_DB=str(receipts), SHOP_DB=str(database),
    )  # fmt: skip
    relaybox = [python, "-m", "relaybox", "migrate"]
    subprocess.run([*relaybox, "--db", f"sqlite:///{database}"], check=True, capture_output=True)
    subprocess.run(
        [*relaybox, "--db", f"sqlite:///{receipts}", "--inbox"], check=True, capture_output=True
    )
    with (tmp_path / "worker.log").open("ab") as log:
        worker = subprocess.Popen(
            [python, "-m", "celery", "-A", "tasks", "worker", "--pool", "solo",
             "--without-heartbeat", "--without-gossip", "--without-mingle"],
            cwd=EXAMPLE, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        shop = subprocess.run(
            [python, "shop.py", "7", "ada@example.com"],
            cwd=EXAMPLE, env=env, check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        task_id = shop.stdout.split()[4]
        assert shop.stdout.strip() == f"order 7: receipt task {task_id} sent"
        await eventually(lambda: _rows(receipts, "SELECT order_id, email FROM receipts"), 30)
        assert _rows(receipts, "SELECT order_id, email FROM receipts") == [(7, "ada@example.com")]
        assert _rows(receipts, "SELECT message_id FROM relaybox_inbox") == [(task_id,)]
        assert _rows(database, "SELECT id, email FROM orders") == [(7, "ada@example.com")]
    finally:
        end_process(worker)
        redis.Redis.from_url(REDIS).delete(
            queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"
        )


def _rows(database: Path, query: str) -> list[tuple[object, ...]]:
    """The rows of `query`, none while its table does not exist yet."""
    with contextlib.closing(sqlite3.connect(database)) as connection:
        try:
            return connection.execute(query).fetchall()
        except sqlite3.OperationalError:
            return []
