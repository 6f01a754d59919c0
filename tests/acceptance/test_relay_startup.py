"""`relaybox relay` started while a broker or its database is down.

The relay runs anyway: /healthz answers, /readyz says what it waits for, and once the
broker or database is back it delivers everything written meanwhile, without a restart
and without counting an attempt against any message. A broker that is down is a
throwaway server not started yet, or a proxy in front of the shared one that refuses
until it is switched on. A configuration that retrying cannot mend still stops the
relay at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from relaybox import Message
from tests.acceptance.test_relay_processes import RELAYBOX, published
from tests.acceptance.test_status_process import _get
from tests.brokers.harness import BrokerHarness, free_port
from tests.chaos.cluster import Proxy
from tests.databases import PG_URL
from tests.relay_support import OutboxDB, eventually, messages, outbox_db, rows

#: A broker down at start: the harness that reads what arrived, the URL the relay is
#: given, and what brings the broker up.
DownBroker = tuple[BrokerHarness, str, Callable[[], Awaitable[None]]]


@contextlib.asynccontextmanager
async def _proxied(harness: BrokerHarness, port: int, url: str) -> AsyncIterator[DownBroker]:
    """The shared broker at `port`, reached through a proxy that refuses until on."""
    proxy = Proxy(port)
    proxy.cut()

    async def up() -> None:
        proxy.restore()

    try:
        async with harness:
            yield harness, url.format(port=proxy.port), up
    finally:
        proxy.close()


@contextlib.asynccontextmanager
async def down_broker(kind: str, topic: str, directory: Path) -> AsyncIterator[DownBroker]:
    if kind == "nats":
        from tests.brokers.test_nats import SHARED_URL, NatsHarness

        async with NatsHarness(SHARED_URL).throwaway() as nats:
            await nats.prepare(topic)  # the stream, kept over the restart
            await nats.stop()
            yield nats, nats.url, nats.start
    elif kind == "redis":
        from tests.brokers.test_redis import SHARED_URL, RedisHarness

        async with RedisHarness(SHARED_URL).throwaway() as redis:
            await redis.stop()
            yield redis, redis.url, redis.start
    elif kind == "http":
        from tests.brokers.test_http import webhook_harness

        async with webhook_harness() as webhook:
            await webhook.stop()
            yield webhook, webhook.url, webhook.start
    elif kind == "amqp":
        from tests.brokers.test_amqp import RabbitHarness

        rabbit = RabbitHarness()
        await rabbit.prepare(topic)
        async with _proxied(rabbit, 5672, "amqp://guest:guest@127.0.0.1:{port}/") as down:
            yield down
    elif kind == "kafka":
        from tests.brokers.test_kafka import KafkaHarness, TansuProcess

        tansu = TansuProcess(directory)
        kafka = KafkaHarness(tansu)
        await kafka.start()
        try:
            await kafka.prepare(topic)
            # Proxied for the bootstrap only: the broker then names its own port.
            url = "kafka://127.0.0.1:{port}?timeout=3"
            async with _proxied(kafka, tansu.port, url) as down:
                yield down
        finally:
            await asyncio.to_thread(tansu.kill)
    else:
        from tests.brokers.test_mqtt import SHARED_URL, MqttHarness

        mqtt = MqttHarness(SHARED_URL)
        await mqtt.prepare(topic)
        async with _proxied(mqtt, 1883, "mqtt://127.0.0.1:{port}") as down:
            yield down


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path, targets=("audit",)):
        yield each


def _relay(db_url: str, table: str, broker: str, port: int, log: Path) -> subprocess.Popen[str]:
    command = [
        RELAYBOX, "relay", "--db", db_url, "--table", table, "--broker", f"audit={broker}",
        "--http", f"127.0.0.1:{port}", "--idle-interval", "0.1", "--log-level", "INFO",
        "--published-retention", "3600",
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True)


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        raise


def _problems(port: int) -> tuple[int, list[str]]:
    status, body = _get(port, "/readyz")
    return status, json.loads(body)["problems"] if body else []


async def _running(port: int) -> None:
    """Until the relay has made its first attempts (the endpoints answer before)."""
    await eventually(lambda: _get(port, "/healthz")[0] == 200, timeout=60)
    await eventually(lambda: "the relay is starting" not in str(_problems(port)), timeout=60)


@pytest.mark.parametrize("kind", ["nats", "redis", "amqp", "mqtt", "http", "kafka"])
async def test_a_relay_started_before_its_broker_delivers_once_it_is_up(
    db: OutboxDB, tmp_path: Path, kind: str
) -> None:
    topic = f"rbtest.start.{kind}.{db.table}"
    batch = [
        Message(topic=topic, key=key, payload={"n": n})
        for n in range(10)
        for key in ("a", "b", None)
    ]
    async with down_broker(kind, topic, tmp_path) as (harness, url, bring_up):
        port, log = free_port(), tmp_path / "relay.log"
        proc = _relay(db.url, db.table, url, port, log)
        try:
            await _running(port)
            await db.write(batch)
            status, problems = _problems(port)
            assert status == 503
            (problem,) = problems
            assert problem.startswith("target audit: cannot ")
            assert "retrying in" in problem or "trying again now" in problem
            report = json.loads(_get(port, "/api/outbox")[1])
            assert report["targets"]["audit"]["connected"] is False
            assert report["targets"]["audit"]["error"].startswith("target audit: cannot ")
            if kind == "amqp":
                assert "guest:***@" in problem
                assert "guest:guest" not in log.read_text()

            await bring_up()
            arrived = await harness.wait_for(topic, len(batch), timeout=120)
            await eventually(lambda: _get(port, "/readyz")[0] == 200, timeout=60)
        finally:
            code = _stop(proc)
    assert code == 0
    assert {r.id for r in arrived} == {str(m.id) for m in batch}
    kept = rows(db)
    assert len(kept) == len(batch)
    assert all(row.attempts == 0 for row in kept)  # waiting burnt no attempt
    text = log.read_text()
    assert "WARNING target audit: cannot " in text
    assert "INFO target audit: connected" in text


async def test_a_relay_started_before_its_database_delivers_once_it_is_up(
    db: OutboxDB, tmp_path: Path
) -> None:
    batch = messages(["a", "b", None], per_key=10)
    await db.write(batch)
    out, port, log = tmp_path / "out.jsonl", free_port(), tmp_path / "relay.log"
    proxy = Proxy(5432)
    proxy.cut()
    try:
        secret_url = f"postgresql://postgres:s3cr3t@127.0.0.1:{proxy.port}/test"  # trust
        proc = _relay(secret_url, db.table, f"file://{out}", port, log)
        try:
            await _running(port)
            status, problems = _problems(port)
            assert status == 503
            (problem,) = problems
            masked = f"postgresql://postgres:***@127.0.0.1:{proxy.port}/test"
            expected = f"db0: cannot connect to the database {masked}: "
            assert problem.startswith(expected)
            report = json.loads(_get(port, "/api/outbox")[1])
            assert report["databases"]["db0"]["error"].startswith(expected)
            assert report["signals"]["pending"] is None  # not every table could be read

            proxy.restore()
            ids = {str(m.id) for m in batch}
            await eventually(lambda: {m["id"] for m in published(out)} >= ids, timeout=120)
            await eventually(lambda: _get(port, "/readyz")[0] == 200, timeout=60)
        finally:
            code = _stop(proc)
    finally:
        proxy.close()
    assert code == 0
    assert len(published(out)) == len(batch)
    text = log.read_text()
    assert "WARNING db0: cannot connect to the database" in text
    assert "INFO db0: connected" in text
    assert "s3cr3t" not in text


@pytest.mark.parametrize(
    ("broker", "says"),
    [
        ("nats://127.0.0.1:4222?no_such_option=1", "no_such_option"),
        ("carrier-pigeon://loft", "no publisher for broker URL scheme"),
        ("redis://127.0.0.1:6379/0?timeout=soon", "timeout"),
    ],
)
def test_a_broker_url_that_is_wrong_stops_the_relay_at_once(
    db: OutboxDB, tmp_path: Path, broker: str, says: str
) -> None:
    log = tmp_path / "relay.log"
    proc = _relay(db.url, db.table, broker, free_port(), log)
    try:
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0
    assert says in log.read_text()


def test_a_database_without_the_outbox_tables_stops_the_relay_at_once(tmp_path: Path) -> None:
    log = tmp_path / "relay.log"
    proc = _relay(PG_URL, "rbx_never_migrated", "file:///dev/null", free_port(), log)
    try:
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0
    assert "relaybox migrate" in log.read_text()
