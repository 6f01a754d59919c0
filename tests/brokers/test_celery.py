"""Celery targets against a real Celery worker (`celery worker --pool solo`, a process of
this test), on RabbitMQ and on Redis: tasks written through the outbox and relayed run
once each, under the message's id; a broker down at commit time only delays them.

Each test has its own queue (and, on RabbitMQ, exchange) and removes them afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import redis.asyncio as aioredis

from relaybox import Message
from relaybox.core.lifecycle import Status
from relaybox.core.publishing import Outcome
from relaybox.errors import ConfigurationError, MessageError
from relaybox.publishers import celery, open_publisher
from relaybox.relay import Relay
from tests.brokers.harness import end_process, free_port, stored, wait_port
from tests.relay_support import OutboxDB, eventually, fast_settings, outbox_db

AMQP = "amqp://guest:guest@127.0.0.1:5672/"
REDIS = "redis://127.0.0.1:6379/0"
TASK = "rbtest.record"

#: The worker's app: each run of the task appends its id and arguments to a file.
APP = textwrap.dedent(
    """
    import json, os
    from celery import Celery

    app = Celery("rbtest", broker=os.environ["RBTEST_BROKER"])
    app.conf.update(
        task_default_queue=os.environ["RBTEST_QUEUE"],
        worker_enable_remote_control=False,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )

    @app.task(name="rbtest.record", bind=True)
    def record(self, *args, **kwargs):
        with open(os.environ["RBTEST_RUNS"], "a") as runs:
            runs.write(json.dumps([self.request.id, args, kwargs]) + "\\n")
    """
)


class Worker:
    """One Celery worker process consuming `queue` from `broker`, stopped by PID."""

    def __init__(self, directory: Path, broker: str, queue: str) -> None:
        (directory / "rbtest_app.py").write_text(APP)
        self.runs = directory / "runs.jsonl"
        self.runs.touch()
        self.log = directory / "worker.log"
        env = {
            **os.environ, "PYTHONPATH": str(directory), "RBTEST_BROKER": broker,
            "RBTEST_QUEUE": queue, "RBTEST_RUNS": str(self.runs),
        }  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "rbtest_app", "worker", "--pool", "solo",
                 "--without-heartbeat", "--without-gossip", "--without-mingle", "-Q", queue,
                 "--loglevel", "INFO"],
                cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def executed(self) -> list[list[Any]]:
        """Each run of the task: [task id, args, kwargs]."""
        return [json.loads(line) for line in self.runs.read_text().splitlines()]

    def stop(self) -> None:
        end_process(self.process)


@pytest.fixture
def queue() -> str:
    return f"rbtest-celery-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for outbox in outbox_db("postgresql", tmp_path):
        yield outbox


@pytest.fixture
def worker_factory(tmp_path: Path) -> Iterator[list[Worker]]:
    workers: list[Worker] = []
    yield workers
    _stop(workers)


def _stop(workers: list[Worker]) -> None:
    while workers:
        workers.pop().stop()


async def _remove_amqp(queue: str) -> None:
    connection = await aio_pika.connect(AMQP)
    async with connection, connection.channel() as channel:
        await channel.queue_delete(queue)
        await channel.exchange_delete(queue)


async def _remove_redis(url: str, queue: str) -> None:
    client = aioredis.Redis.from_url(url)
    async with client:
        # The queue's list, and the worker's record of its binding (to the exchange
        # of the queue's name).
        await client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")


def tasks(count: int) -> list[Message]:
    """Half with positional arguments, half with keyword arguments."""
    return [
        Message(topic="tasks", type=TASK, payload=[n, "x"] if n % 2 else {"n": n})
        for n in range(count)
    ]


def expected(messages: list[Message]) -> dict[str, tuple[list[object], dict[str, object]]]:
    return {
        str(m.id): ((m.payload, {}) if isinstance(m.payload, list) else ([], m.payload))
        for m in messages
    }


async def _run_once_each(db: OutboxDB, target: str, worker: Worker, count: int = 20) -> None:
    messages = tasks(count)
    await db.write(messages)
    async with Relay(
        db.database,
        {"default": target},
        table=db.table,
        settings=fast_settings(published_retention=3600),
    ):
        await eventually(lambda: len(worker.executed()) >= count, timeout=30)
        await eventually(lambda: _all_published(db, count), timeout=10)
    runs = worker.executed()
    assert Counter(run[0] for run in runs) == Counter(str(m.id) for m in messages)
    assert {run[0]: (run[1], run[2]) for run in runs} == expected(messages)


async def _all_published(db: OutboxDB, count: int) -> bool:
    return (await db.status_counts()).get(Status.PUBLISHED, 0) == count


async def test_tasks_run_once_each_on_rabbitmq(
    db: OutboxDB, queue: str, tmp_path: Path, worker_factory: list[Worker]
) -> None:
    target = f"celery+{AMQP}?queue={queue}"
    try:
        # The relay declares the queue (as Celery would) before the worker is up.
        worker_factory.append(worker := Worker(tmp_path, AMQP, queue))
        await _run_once_each(db, target, worker)
    finally:
        _stop(worker_factory)  # first: a worker that loses its queue declares it again
        await _remove_amqp(queue)


async def test_tasks_run_once_each_on_redis(
    db: OutboxDB, queue: str, tmp_path: Path, worker_factory: list[Worker]
) -> None:
    try:
        worker_factory.append(worker := Worker(tmp_path, REDIS, queue))
        await _run_once_each(db, f"celery+{REDIS}?queue={queue}", worker)
        client = aioredis.Redis.from_url(REDIS)
        async with client:
            assert await client.llen(queue) == 0
    finally:
        _stop(worker_factory)
        await _remove_redis(REDIS, queue)


async def test_a_task_committed_while_redis_is_down_runs_once_it_is_back(
    db: OutboxDB, queue: str, tmp_path: Path, worker_factory: list[Worker]
) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    messages = tasks(6)
    await db.write(messages)  # committed; nothing listens on the broker's port yet
    relay = Relay(db.database, {"default": f"celery+{url}?queue={queue}&timeout=0.5"},
                  table=db.table, settings=fast_settings(published_retention=3600))  # fmt: skip
    server = None
    try:
        await relay.start()
        await asyncio.sleep(1.0)  # the relay tries, and fails, for a while
        assert (await db.status_counts()).get(Status.PUBLISHED, 0) == 0
        server = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        await wait_port(port)
        worker_factory.append(worker := Worker(tmp_path, url, queue))
        await eventually(lambda: len(worker.executed()) >= len(messages), timeout=30)
        await eventually(lambda: _all_published(db, len(messages)), timeout=10)
    finally:
        await relay.stop()
        _stop(worker_factory)
        if server is not None:
            end_process(server)
    runs = worker.executed()
    assert Counter(run[0] for run in runs) == Counter(str(m.id) for m in messages)


def test_the_task_message_is_celerys_protocol_2() -> None:
    message = stored("tasks", payload=b'{"order": 7}', headers={"task": "shop.charge"})
    headers, body = celery.task_message(message, "relaybox@host")
    assert headers["task"] == "shop.charge"
    assert headers["id"] == headers["root_id"] == str(message.id)
    assert json.loads(body) == [[], {"order": 7}, celery._EMBED]
    for nothing in (b"", b"null"):
        assert celery.task_message(stored("tasks", payload=nothing), "o")[1].startswith(b"[[],{},")


async def test_text_utf8_cannot_carry_is_sent_escaped(queue: str) -> None:
    """A payload's escaped lone surrogate (valid JSON, no valid UTF-8) reaches the task."""
    payload = b'["\\ud800", "caf\xc3\xa9"]'
    headers, body = celery.task_message(stored("tasks", payload=payload), "o")
    assert json.loads(body)[0] == ["\ud800", "café"]
    assert headers["argsrepr"].isascii()
    publisher = open_publisher(f"celery+{AMQP}?queue={queue}")
    try:
        await publisher.start()
        (result,) = await publisher.publish([stored("tasks", payload=payload)])
        assert result.outcome is Outcome.ACKED
    finally:
        await publisher.close()
        await _remove_amqp(queue)


@pytest.mark.parametrize("payload", [b"7", b'"text"', b"{not json", b"\xff\xfe", b"[" * 100_000])
async def test_a_payload_that_is_no_call_fails_permanently(payload: bytes, queue: str) -> None:
    with pytest.raises(MessageError):
        celery.task_message(stored("tasks", payload=payload), "o")
    publisher = open_publisher(f"celery+{REDIS}?queue={queue}")
    await publisher.start()
    try:
        (result,) = await publisher.publish([stored("tasks", payload=payload)])
        assert result.outcome is Outcome.PERMANENT
        client = aioredis.Redis.from_url(REDIS)
        async with client:
            assert await client.exists(queue) == 0
    finally:
        await publisher.close()


@pytest.mark.parametrize(
    "url",
    ["celery+kafka://127.0.0.1:9092", f"celery+{REDIS}?queue=", f"celery+{REDIS}?exchange=x"],
)
def test_bad_celery_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        open_publisher(url)
