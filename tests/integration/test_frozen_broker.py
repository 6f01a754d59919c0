"""A broker that takes connections and stops answering abandons nothing.

A NATS JetStream server of the test's own, reached through a proxy that freezes: the
publishes time out, and the stream may have stored them. Such a publish costs no
attempt (the row is handed back and published again; `Nats-Msg-Id` drops the copy),
while the target's circuit counts it, so the relay backs off instead of spinning.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from relaybox.core.circuit import CircuitPolicy, CircuitState
from relaybox.core.lifecycle import Status
from relaybox.core.retry import RetryPolicy
from relaybox.relay import Relay
from relaybox.tools.embedded_nats import EmbeddedNats
from tests.freezable import FreezableProxy
from tests.relay_support import OutboxDB, eventually, fast_settings, messages, outbox_db

STREAM = "frozen_broker"


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path):
        yield each


async def stored(stream: JetStreamContext) -> int:
    return int((await stream.stream_info(STREAM)).state.messages)


async def test_a_broker_that_stops_answering_abandons_nothing(db: OutboxDB) -> None:
    settings = fast_settings(
        publish_timeout=5.0,
        retry=RetryPolicy(base_delay=0.05, max_delay=0.1, jitter=0.0, max_attempts=2),
        circuit=CircuitPolicy(failure_threshold=3, open_seconds=0.3, max_open_seconds=0.6),
    )
    async with EmbeddedNats() as server:
        client = await nats.connect(server.url)
        stream = client.jetstream()
        await stream.add_stream(StreamConfig(name=STREAM, subjects=["orders"]))
        proxy = FreezableProxy(server.port)
        # The publisher's own ack timeout, well within the relay's publish_timeout.
        broker = f"nats://127.0.0.1:{proxy.port}?timeout=0.3"
        try:
            async with Relay(db.database, {"default": broker}, table=db.table,
                             settings=settings) as relay:  # fmt: skip
                first = messages(["a", "b"], per_key=1)
                await db.write(first)
                await eventually(lambda: _at_least(stream, len(first)))
                proxy.freeze()
                rest = messages(["a", "b", "c"], per_key=3)
                await db.write(rest)
                opened: list[CircuitState] = []

                def timed_out_for_a_while() -> bool:
                    if relay.circuit_states()["default"] is CircuitState.OPEN:
                        opened.append(CircuitState.OPEN)
                    return bool(opened) and relay.target_counters()["default"].unavailable >= 6

                await eventually(timed_out_for_a_while, timeout=60.0)
                counters = relay.target_counters()["default"]
                assert counters.abandoned == 0
                assert counters.retried == 0
                assert (await db.status_counts()).get(Status.ABANDONED, 0) == 0
                proxy.thaw()
                total = len(first) + len(rest)
                await eventually(lambda: _at_least(stream, total), timeout=60.0)
                await eventually(lambda: _drained(db), timeout=60.0)
                assert relay.target_counters()["default"].abandoned == 0
            assert await stored(stream) == total  # copies sent again were dropped
        finally:
            proxy.close()
            await client.close()


async def _at_least(stream: JetStreamContext, count: int) -> bool:
    return await stored(stream) >= count


async def _drained(db: OutboxDB) -> bool:
    counts = await db.status_counts()
    return not any(counts.get(s, 0) for s in (Status.PENDING, Status.FAILED, Status.ABANDONED))
