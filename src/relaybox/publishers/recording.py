"""A publisher wrapper that watches the confirms go by: for `relaybox bench` and the demo."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from relaybox.core.publishing import Outcome, PublishResult
from relaybox.core.records import StoredMessage
from relaybox.ports import Publisher

#: Called with a call's confirmed messages and when (`time.perf_counter`) they came back.
OnConfirmed = Callable[[Sequence[StoredMessage], float], None]


class ConfirmRecorder:
    """Wraps a publisher: counts confirmed messages and, while `on_confirmed` is set,
    hands it each call's confirmed messages with the moment their confirms came back."""

    def __init__(self, inner: Publisher, on_confirmed: OnConfirmed | None = None) -> None:
        self.inner = inner
        self.features = inner.features
        self.confirmed = 0
        self.on_confirmed = on_confirmed

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def publish(self, messages: Sequence[StoredMessage]) -> Sequence[PublishResult]:
        results = await self.inner.publish(messages)
        now = time.perf_counter()
        if self.on_confirmed is None:  # counting only (a drain): no list per call
            self.confirmed += sum(r.outcome is Outcome.ACKED for r in results)
            return results
        acked = [m for m, r in zip(messages, results, strict=True) if r.acked]
        self.confirmed += len(acked)
        self.on_confirmed(acked, now)
        return results
