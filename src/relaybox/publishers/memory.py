"""In-memory publishers for tests and benchmarks.

`MemoryPublisher` records what it confirmed and can be told to fail (transient), be down
(unreachable: transient, costing no attempt), reject (permanent), hang or slow down, for
all messages or those a predicate picks, a number of times or until healed. `NoopPublisher`
confirms everything and keeps only a count.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Callable, Sequence

from relaybox.core import envelope
from relaybox.core.publishing import (
    ACKED,
    PublisherFeatures,
    PublishResult,
    permanent,
    transient,
    unavailable,
)
from relaybox.core.records import StoredMessage
from relaybox.errors import InvalidHeadersError
from relaybox.ports import Publisher
from relaybox.publishers.options import BrokerUrl

#: `memory://NAME` publishers, so a test can reach the one a relay opened by URL.
_named: dict[str, MemoryPublisher] = {}


def from_url(url: BrokerUrl) -> Publisher:
    """`noop://`; `memory://` (a new one) or `memory://NAME` (one per name, shared)."""
    if url.scheme == "noop":
        return NoopPublisher()
    name = url.parts.netloc
    return named(name) if name else MemoryPublisher()


def named(name: str) -> MemoryPublisher:
    """The publisher that `memory://NAME` opens."""
    return _named.setdefault(name, MemoryPublisher())


class FaultKind(enum.Enum):
    FAIL = "fail"
    DOWN = "down"
    REJECT = "reject"
    HANG = "hang"
    SLOW = "slow"


@dataclasses.dataclass
class Fault:
    kind: FaultKind
    match: Callable[[StoredMessage], bool]
    times: int | None  # None: until healed
    error: str = ""
    seconds: float = 0.0
    hits: int = 0

    def applies(self, message: StoredMessage) -> bool:
        return (self.times is None or self.hits < self.times) and self.match(message)


def _everything(_: StoredMessage) -> bool:
    return True


class MemoryPublisher:
    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(self) -> None:
        self.published: list[StoredMessage] = []
        self.attempts: list[StoredMessage] = []
        self._faults: list[Fault] = []
        self._released = asyncio.Event()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._released.set()

    def fail(
        self,
        match: Callable[[StoredMessage], bool] = _everything,
        *,
        times: int | None = None,
        error: str = "broker unavailable",
    ) -> Fault:
        return self._add(Fault(FaultKind.FAIL, match, times, error))

    def down(
        self,
        match: Callable[[StoredMessage], bool] = _everything,
        *,
        times: int | None = None,
        error: str = "connection refused",
    ) -> Fault:
        """Answer as a broker that cannot be reached (`PublishResult.unavailable`)."""
        return self._add(Fault(FaultKind.DOWN, match, times, error))

    def reject(
        self, match: Callable[[StoredMessage], bool] = _everything, *, error: str = "rejected"
    ) -> Fault:
        return self._add(Fault(FaultKind.REJECT, match, None, error))

    def hang(self, match: Callable[[StoredMessage], bool] = _everything) -> Fault:
        self._released.clear()
        return self._add(Fault(FaultKind.HANG, match, None))

    def slow(self, seconds: float, match: Callable[[StoredMessage], bool] = _everything) -> Fault:
        return self._add(Fault(FaultKind.SLOW, match, None, seconds=seconds))

    def heal(self) -> None:
        """Remove every fault and let hung publishes finish."""
        self._faults.clear()
        self._released.set()

    def _add(self, fault: Fault) -> Fault:
        self._faults.append(fault)
        return fault

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        # Concurrently, as a pipelining broker client would: a hung or slow message
        # does not delay the others of the call.
        return list(await asyncio.gather(*(self._publish_one(m) for m in messages)))

    async def _publish_one(self, message: StoredMessage) -> PublishResult:
        self.attempts.append(message)
        if message.headers:
            try:  # as every broker's publisher refuses it
                envelope.check_stored_headers(message)
            except InvalidHeadersError as error:
                return permanent(str(error))
        fault = next((f for f in self._faults if f.applies(message)), None)
        if fault is None:
            self.published.append(message)
            return ACKED
        fault.hits += 1
        if fault.kind is FaultKind.FAIL:
            return transient(fault.error)
        if fault.kind is FaultKind.DOWN:
            return unavailable(fault.error)
        if fault.kind is FaultKind.REJECT:
            return permanent(fault.error)
        if fault.kind is FaultKind.HANG:
            await self._released.wait()
        else:
            await asyncio.sleep(fault.seconds)
        self.published.append(message)
        return ACKED


class NoopPublisher:
    """Confirms at once and keeps nothing but a count: the relay's own cost, measured."""

    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(self) -> None:
        self.count = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        self.count += len(messages)
        return [ACKED] * len(messages)
