"""What every broker consumer shares: decode, process, then settle with the broker.

A broker consumer receives from its broker, decodes each delivery into an `Incoming`,
hands it to a `Consumer` (handler + inbox + transaction), and settles the delivery by
the verdict: `ACK` after the transaction committed (the handler's effects, or a
duplicate skipped), `RETRY` when the handler raised (the transaction rolled back: the
broker must deliver it again), `REJECT` when the delivery is not a readable envelope
(it never will be: drop it, or dead-letter it where the broker can).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Self

from relaybox.core.incoming import Incoming
from relaybox.errors import EnvelopeError
from relaybox.inbox.consumer import Consumer

logger = logging.getLogger(__name__)


class Verdict(enum.Enum):
    ACK = "ack"
    RETRY = "retry"
    REJECT = "reject"


class BrokerConsumer(abc.ABC):
    """Runs a `Consumer` on one broker's deliveries; use as an async context manager
    (runs in a background task) or await `run()` (runs until cancelled)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.rejected = 0
        self.retried = 0
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @abc.abstractmethod
    async def run(self) -> None:
        """Connect, subscribe, call `self.ready()`, then consume until cancelled."""

    def ready(self) -> None:
        """Subclasses call this once they are subscribed and receiving."""
        self._ready.set()

    async def start(self, timeout: float = 30.0) -> None:
        """Start `run` in a background task; return once it is receiving."""
        self._task = asyncio.create_task(self.run(), name=f"relaybox-{type(self).__name__}")
        ready = asyncio.create_task(self._ready.wait())
        done, _ = await asyncio.wait({self._task, ready}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if ready not in done:
            ready.cancel()
            if self._task in done:
                self._task.result()  # raises what stopped it
            await self.stop()
            raise TimeoutError(f"{type(self).__name__} did not start within {timeout:g}s")

    async def stop(self) -> None:
        """Stop receiving; a message being processed is abandoned unacknowledged (its
        transaction rolls back or has committed: either way a redelivery is safe)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def handle(self, decode: Callable[[], Incoming]) -> Verdict:
        """Decode one delivery and process it; the verdict says how to settle it."""
        try:
            message = decode()
        except EnvelopeError as error:
            self.rejected += 1
            logger.error("rejected an unreadable delivery: %s", error,
                         extra={"action": "envelope_rejected"})  # fmt: skip
            return Verdict.REJECT
        try:
            await self.consumer.process(message)
        except asyncio.CancelledError:
            raise
        except Exception:  # the handler's error: its transaction rolled back, redeliver
            self.retried += 1
            logger.exception(
                "handler failed for %s; it will be redelivered", message.id,
                extra={"action": "handler_failed", "message_id": message.id},
            )  # fmt: skip
            return Verdict.RETRY
        return Verdict.ACK


async def close_within(closing: Awaitable[object], seconds: float) -> None:
    """Await a client's close for at most `seconds`, ignoring its errors. A consumer that
    stops must stop: nats-py's close can wait forever on a connection that is
    reconnecting, and redis-py's on one cancelled in the middle of a blocking read."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(seconds):
            await closing
