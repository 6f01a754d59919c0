"""The in-memory publisher passes the conformance suite, so unit tests may rely on it.

Its "broker" is the publisher's own record; a "restart" is a spell of transient
failures (there is no process to stop).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from relaybox.core import envelope
from relaybox.core.publishing import PublisherFeatures
from relaybox.core.records import StoredMessage
from relaybox.publishers import memory
from tests.brokers.conformance import PublisherConformance
from tests.brokers.harness import Received, RestartableHarness, stored


def _received(message: StoredMessage) -> Received:
    return Received(
        payload=message.payload,
        attributes=envelope.attributes(message),
        headers=dict(message.headers),
        content_type=message.content_type,
        key=message.key,
    )


class MemoryHarness(RestartableHarness):
    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(self) -> None:
        self.name = f"conformance-{uuid.uuid4().hex[:8]}"
        self.url = f"memory://{self.name}"
        self._broker = memory.named(self.name)

    async def prepare(self, topic: str) -> None:
        return None

    async def received(self, topic: str) -> list[Received]:
        return [_received(m) for m in self._broker.published if m.topic == topic]

    def rejected(self, topic: str) -> StoredMessage:
        message = stored(topic, key="poison")
        self._broker.reject(lambda m: m.id == message.id, error="poison message")
        return message

    @contextlib.asynccontextmanager
    async def throwaway(self) -> AsyncIterator[RestartableHarness]:
        yield MemoryHarness()

    async def stop(self) -> None:
        self._broker.down(error="broker stopped")

    async def start(self) -> None:
        self._broker.heal()


class TestMemoryPublisher(PublisherConformance):
    def open_harness(self) -> contextlib.AbstractAsyncContextManager[MemoryHarness]:
        return contextlib.nullcontext(MemoryHarness())  # type: ignore[return-value]
