"""`Consumer`: run a handler once per message, inside a transaction with the inbox check.

The broker consumers (`relaybox.consumers.*`) decode what their broker delivered into
an `Incoming`, call `Consumer.process`, and acknowledge the broker only after it
returned, that is after the transaction committed. So:

- the handler raised: the transaction rolled back, nothing is acknowledged, and the
  broker delivers the message again;
- the process died after the commit but before the acknowledgement: the broker
  delivers it again, the inbox finds it recorded, and the copy is acknowledged without
  running the handler;
- two consumers got copies of one message at once: one commits, the other's inbox
  check waits for that commit and then skips (see `relaybox.inbox.inbox`).

A handler can write the next messages of a chain into the outbox through the same
connection (`Outbox.add(conn, message.follow_up(...))`): they commit, or not, with the
effects and the inbox record.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from relaybox.core.incoming import Incoming
from relaybox.core.retry import RetryPolicy
from relaybox.errors import ConfigurationError, EnvelopeError, InboxError
from relaybox.inbox.inbox import Inbox

logger = logging.getLogger(__name__)

AsyncHandler = Callable[[Incoming, Any], Awaitable[None]]
SyncHandler = Callable[[Incoming, Any], None]
#: Opens one transaction and yields its connection or session; commits on a clean exit,
#: rolls back on an exception. `engine.begin`, `async_sessionmaker.begin`, psycopg's
#: `pool.connection`, or a small function of your own.
Transaction = Callable[[], AbstractAsyncContextManager[Any] | AbstractContextManager[Any]]

#: Seconds between two purges of expired ids (inbox "id" mode).
DEFAULT_PURGE_INTERVAL = 60.0


class Processed(enum.Enum):
    """What `Consumer.process` did with a message; either way, acknowledge it."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"


class Consumer:
    """A handler, the inbox that guards it and the transactions it runs in.

    An ``async def`` handler runs in the event loop and `transaction` must return an
    async context manager; a plain ``def`` handler runs, with its transaction, in a
    worker thread (so a sync driver never blocks the broker client's heartbeats), and
    `transaction` must return a sync one, opened in that thread.
    """

    def __init__(
        self,
        handler: AsyncHandler | SyncHandler,
        *,
        inbox: Inbox,
        transaction: Transaction,
        purge_interval: float | None = DEFAULT_PURGE_INTERVAL,
        retry_in_place: bool | None = None,
        retry_delay: float = 0.1,
        max_retry_delay: float = 30.0,
    ) -> None:
        if not callable(handler) or not callable(transaction):
            raise ConfigurationError("Consumer needs a callable handler and transaction")
        if not 0 < retry_delay <= max_retry_delay:
            raise ConfigurationError("retry delays must satisfy 0 < retry_delay <= max")
        self.handler = handler
        self.inbox = inbox
        self.transaction = transaction
        self.is_async = inspect.iscoroutinefunction(handler)
        self.purge_interval = purge_interval
        #: Retry a failing handler here, until it succeeds or the consumer stops, rather
        #: than hand the message back to the broker: a watermark inbox needs it (see
        #: `process`), so it is the default there.
        self.retry_in_place = (
            inbox.mode == "watermark" if retry_in_place is None else retry_in_place
        )
        self.retry_delay, self.max_retry_delay = retry_delay, max_retry_delay
        self.failures = 0
        self._next_purge = 0.0  # the first message purges what expired while it was down
        self.applied = 0
        self.duplicates = 0

    async def process(self, message: Incoming) -> Processed:
        """Check, handle and commit `message`; raises what the handler raised (after the
        rollback), and then the message must not be acknowledged.

        With `retry_in_place`, a failing handler is retried here instead (backing off
        from `retry_delay` to `max_retry_delay` seconds), and this returns only once it
        committed. A broker hands a negatively acknowledged message back later, after
        messages that came behind it: for a watermark inbox those would move the mark
        past it, and the late one would be skipped as a copy. Retrying in place keeps
        each lane in order, at the price of holding up what follows a failing message.
        """
        pauses = RetryPolicy(base_delay=self.retry_delay, max_delay=self.max_retry_delay)
        for failures in itertools.count(1):
            try:
                outcome = await self._once(message)
                break
            except (ConfigurationError, EnvelopeError, InboxError):
                self.failures += 1
                raise  # retrying cannot help: the setup or the message is wrong
            except Exception:
                self.failures += 1
                if not self.retry_in_place:
                    raise
                delay = pauses.delay(failures)
                logger.exception(
                    "handler failed for %s; retrying in %.1fs", message.id, delay,
                    extra={"action": "handler_retry", "message_id": message.id},
                )  # fmt: skip
                await asyncio.sleep(delay)
        if outcome is Processed.APPLIED:
            self.applied += 1
        else:
            self.duplicates += 1
            logger.info(
                "duplicate %s skipped", message.id,
                extra={"action": "inbox_duplicate", "message_id": message.id,
                       "consumer": self.inbox.consumer},
            )  # fmt: skip
        await self._maybe_purge()
        return outcome

    async def _once(self, message: Incoming) -> Processed:
        if self.is_async:
            return await self._process_async(message)
        return await asyncio.to_thread(self._process_sync, message)

    async def _process_async(self, message: Incoming) -> Processed:
        async with _async_transaction(self.transaction) as connection:
            if not await self.inbox.record_async(connection, message):
                return Processed.DUPLICATE
            await self.handler(message, connection)  # type: ignore[misc]
        return Processed.APPLIED

    def _process_sync(self, message: Incoming) -> Processed:
        with _sync_transaction(self.transaction) as connection:
            if not self.inbox.record(connection, message):
                return Processed.DUPLICATE
            self.handler(message, connection)
        return Processed.APPLIED

    async def _maybe_purge(self) -> None:
        """Now and then, delete expired ids in short transactions of their own."""
        if self.purge_interval is None:
            return
        if time.monotonic() < self._next_purge:
            return
        self._next_purge = time.monotonic() + self.purge_interval
        try:
            await self.purge()
        except Exception:  # a failed purge costs disk, never a message
            logger.exception("inbox purge failed", extra={"action": "inbox_purge"})

    async def purge(self) -> int:
        """Delete every id past the inbox's retention, a batch per transaction."""
        total = 0
        while True:
            if self.is_async:
                async with _async_transaction(self.transaction) as connection:
                    count = await self.inbox.purge_async(connection)
            else:
                count = await asyncio.to_thread(self._purge_sync)
            total += count
            if count < self.inbox.purge_batch:
                return total

    def _purge_sync(self) -> int:
        with _sync_transaction(self.transaction) as connection:
            return self.inbox.purge(connection)


def _async_transaction(transaction: Transaction) -> AbstractAsyncContextManager[Any]:
    opened = transaction()
    if not isinstance(opened, AbstractAsyncContextManager):
        raise ConfigurationError(
            "an async handler needs a transaction that returns an async context manager "
            f"(got {type(opened).__name__}); use a def handler for a sync driver"
        )
    return opened


def _sync_transaction(transaction: Transaction) -> AbstractContextManager[Any]:
    opened = transaction()
    if not isinstance(opened, AbstractContextManager):
        raise ConfigurationError(
            "a def handler needs a transaction that returns a sync context manager "
            f"(got {type(opened).__name__}); use an async def handler for an async driver"
        )
    return opened
