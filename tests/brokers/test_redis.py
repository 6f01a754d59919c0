"""The Redis Streams publisher against the shared Redis, and a private one for restarts.

The private redis-server writes an fsync'd append-only file in its temp directory, so
what it confirmed survives a restart: `persistent = True`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from relaybox.consumers.redis import decode
from relaybox.core import envelope
from relaybox.core.publishing import Outcome, PublisherFeatures
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError
from relaybox.publishers import open_publisher
from relaybox.publishers import redis as redis_publisher
from tests.brokers.conformance import PublisherConformance, outcomes, started
from tests.brokers.harness import (
    Received,
    RestartableHarness,
    end_process,
    free_port,
    stored,
    unique_topic,
    wait_port,
)

SHARED_URL = "redis://127.0.0.1:6379/0"


class RedisHarness(RestartableHarness):
    features = PublisherFeatures(deduplicates=False, batching=True)
    persistent = True

    def __init__(self, url: str) -> None:
        self.base = url
        self.url = f"{url}?timeout=3"
        self.client = aioredis.Redis.from_url(url)
        #: Every key prepare() or rejected() touched, deleted again by close().
        self.keys: set[str] = set()

    async def prepare(self, topic: str) -> None:
        self.keys.add(topic)  # XADD creates the stream

    async def received(self, topic: str) -> list[Received]:
        return [Received.of(decode(entry)) for _, entry in await self.client.xrange(topic)]

    def rejected(self, topic: str) -> StoredMessage:
        # A key that holds a string refuses XADD with WRONGTYPE.
        key = f"{topic}.string"
        self.keys.add(key)
        with redis.Redis.from_url(self.base) as client:  # rejected() is not async
            client.set(key, "not a stream")
        return stored(key, key="poison")

    async def close(self) -> None:
        if self.keys:
            await self.client.delete(*self.keys)
        await self.client.aclose()

    def throwaway(self) -> contextlib.AbstractAsyncContextManager[RestartableHarness]:
        return _private_redis()

    async def stop(self) -> None:
        raise NotImplementedError  # only the private harness restarts

    async def start(self) -> None:
        raise NotImplementedError


class PrivateRedisHarness(RedisHarness):
    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        super().__init__(f"redis://127.0.0.1:{self.port}/0")

    async def start(self) -> None:
        with open(self.directory / "redis.log", "ab") as log:
            self.process = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                 "--dir", str(self.directory), "--appendonly", "yes",
                 "--appendfsync", "always", "--save", ""],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        await wait_port(self.port)
        await _until_loaded(self.client)

    async def stop(self) -> None:
        if self.process is not None:
            process, self.process = self.process, None
            await asyncio.to_thread(end_process, process)


async def _until_loaded(client: aioredis.Redis) -> None:
    for _ in range(200):
        with contextlib.suppress(aioredis.BusyLoadingError, aioredis.ConnectionError):
            await client.ping()
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the private redis-server did not finish loading")


@contextlib.asynccontextmanager
async def _private_redis() -> AsyncIterator[RestartableHarness]:
    directory = Path(tempfile.mkdtemp(prefix="rbredis-"))
    harness = PrivateRedisHarness(directory)
    try:
        await harness.start()
        yield harness
    finally:
        with contextlib.suppress(aioredis.RedisError):
            await harness.close()
        await harness.stop()
        shutil.rmtree(directory, ignore_errors=True)


class TestRedisPublisher(PublisherConformance):
    def open_harness(self) -> contextlib.AbstractAsyncContextManager[RedisHarness]:
        return RedisHarness(SHARED_URL)


# Redis-specific behaviour, on the shared Redis.


@pytest.fixture
async def shared() -> AsyncIterator[RedisHarness]:
    async with RedisHarness(SHARED_URL) as harness:
        yield harness


async def test_prefix_and_exact_maxlen_shape_the_stream(shared: RedisHarness) -> None:
    topic = unique_topic()
    key = f"relaybox:{topic}"
    shared.keys.add(key)
    batch = [stored(topic, key=f"k{n}") for n in range(30)]
    publisher = shared.publisher(prefix="relaybox:", maxlen="10", approximate="false")
    async with started(publisher):
        assert outcomes(await publisher.publish(batch)) == [Outcome.ACKED] * 30
    assert await shared.client.xlen(key) == 10
    assert [r.id for r in await shared.received(key)] == [str(m.id) for m in batch[-10:]]


async def test_a_header_named_as_an_attribute_is_never_sent(shared: RedisHarness) -> None:
    """Prefixed, such a header could not shadow an attribute here, but it could on MQTT,
    where attributes and headers share their names: a row holding one goes nowhere."""
    topic = unique_topic()
    await shared.prepare(topic)
    posing = stored(topic, headers={"id": "forged", "data": "forged"})
    good = stored(topic, headers={"app": "shop"})
    async with started(shared.publisher()) as publisher:
        results = await publisher.publish([posing, good])
    assert outcomes(results) == [Outcome.PERMANENT, Outcome.ACKED]
    (got,) = await shared.wait_for(topic, 1)
    assert (got.id, got.headers) == (str(good.id), {"app": "shop"})


async def test_start_fails_clearly_without_a_server() -> None:
    publisher = open_publisher(f"redis://127.0.0.1:{free_port()}/0?timeout=1")
    with pytest.raises(BrokerUnavailableError, match="cannot reach Redis"):
        await publisher.start()


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (redis.ResponseError("WRONGTYPE Operation against a key"), Outcome.PERMANENT),
        (redis.ResponseError("ERR The MAXLEN argument must be >= 0."), Outcome.PERMANENT),
        (redis.exceptions.NoPermissionError("NOPERM no permissions"), Outcome.PERMANENT),
        (redis.AuthenticationError("invalid password"), Outcome.PERMANENT),
        (redis.exceptions.OutOfMemoryError("OOM command not allowed"), Outcome.TRANSIENT),
        (redis.exceptions.ReadOnlyError("READONLY replica"), Outcome.TRANSIENT),
        (redis.BusyLoadingError("LOADING"), Outcome.TRANSIENT),
        (redis.ConnectionError("Connection reset"), Outcome.TRANSIENT),
        (redis.TimeoutError("Timeout reading"), Outcome.TRANSIENT),
    ],
)
def test_classifies_errors(error: Exception, outcome: Outcome) -> None:
    result = redis_publisher.classify(error)
    assert result.outcome is outcome
    assert result.error


def test_parses_its_url_options() -> None:
    publisher = open_publisher("rediss://:pw@h:6380/2?prefix=p:&maxlen=5&approximate=no&timeout=2")
    assert isinstance(publisher, redis_publisher.RedisPublisher)
    assert publisher.url == "rediss://:pw@h:6380/2"
    assert publisher.prefix == "p:"


async def test_the_raw_bench_loop_publishes_every_message(shared: RedisHarness) -> None:
    from relaybox.tools.bench_raw import redis as raw

    topic = unique_topic()
    shared.keys.add(topic)
    await raw.prepare(shared.url, topic)
    await raw.publish_raw(shared.url, topic, 200, b"x" * 200)
    assert await shared.client.xlen(topic) == 200
    await raw.cleanup(shared.url, topic)
    assert await shared.client.exists(topic) == 0


async def test_text_round_trips_and_text_utf8_cannot_carry_fails_alone(
    shared: RedisHarness,
) -> None:
    topic = unique_topic()
    await shared.prepare(topic)
    wide = stored(topic, key="clé-📦", headers={"word": "naïve café", "tab": "a\tb"},
                  type="commande.payée", tenant_id="société")  # fmt: skip
    broken = stored(topic, key="k", headers={"bad": "\ud800"})
    async with started(shared.publisher()) as publisher:
        results = await publisher.publish([wide, broken, stored(topic, key="after")])
    assert outcomes(results) == [Outcome.ACKED, Outcome.PERMANENT, Outcome.ACKED]
    first, second = await shared.wait_for(topic, 2)
    assert first.attributes == envelope.attributes(wide)
    assert first.headers == {"word": "naïve café", "tab": "a\tb"}
    assert first.payload == wide.payload
    assert second.attributes["subject"] == "after"
