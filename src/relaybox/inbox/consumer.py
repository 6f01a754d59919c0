"""`Consumer`: run a message's handler once, inside a transaction with the inbox check;
park what can never succeed.

The broker consumers (`relaybox.consumers.*`) decode what their broker delivered into
an `Incoming`, call `Consumer.process`, and acknowledge the broker only after it
returned, that is after the transaction committed. So:

- the handler raised: the transaction rolled back, nothing is acknowledged, and the
  broker delivers the message again, up to `max_attempts` attempts; the last failure
  parks it instead (see `relaybox.inbox.parked`), and the parked message is acknowledged;
- the payload does not fit the handler's payload class, or is not JSON: parked at once,
  no retry can change it;
- no handler takes the message's type: `unknown_types` says ("park", "skip" or "fail");
- the process died after the commit but before the acknowledgement: the broker
  delivers it again, the inbox finds it recorded, and the copy is acknowledged without
  running the handler;
- two consumers got copies of one message at once: one commits, the other's inbox
  check waits for that commit and then skips (see `relaybox.inbox.inbox`).

Attempts are counted in the database (`<inbox>_attempts`), so they survive a
redelivery to another process. A failed attempt is counted after its rollback. One
that may have died with its process cannot be: so a delivery that the broker marks as a
redelivery (a delivery count above 1, RabbitMQ's redelivered flag, Kafka's first record
after a partition was assigned) counts its attempt before running the handler, in a
short transaction of its own, and a message redelivered after `max_attempts` such
attempts is parked without running again. A message that kills its consumer is parked
too, then.

A handler can write the next messages of a chain into the outbox through the same
connection (`Outbox.add(conn, message.follow_up(...))`): they commit, or not, with the
effects and the inbox record.

How many messages were applied, duplicates and parked, and how long each applied
message took from its creation to its commit, are added per minute to
`<inbox>_activity` for the operator's console (`relaybox.inbox.activity`), every
`activity_interval` seconds by `maintain`, and once more when a broker consumer stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Literal, TypeVar

from relaybox.core.incoming import Incoming
from relaybox.core.retry import RetryPolicy
from relaybox.errors import ConfigurationError, EnvelopeError, InboxError
from relaybox.inbox import activity, parked
from relaybox.inbox.activity import InboxTally
from relaybox.inbox.inbox import Inbox
from relaybox.inbox.parked import ParkedMessage, Reason
from relaybox.inbox.payloads import Decoder, decoder
from relaybox.inbox.rows import Work, run_sync

logger = logging.getLogger(__name__)

T = TypeVar("T")
AsyncHandler = Callable[..., Awaitable[None]]
SyncHandler = Callable[..., None]
#: Opens one transaction and yields its connection or session; commits on a clean exit,
#: rolls back on an exception. `engine.begin`, `async_sessionmaker.begin`, psycopg's
#: `pool.connection`, or a small function of your own.
Transaction = Callable[[], AbstractAsyncContextManager[Any] | AbstractContextManager[Any]]
#: What to do with a message whose type no handler takes.
UnknownTypes = Literal["park", "skip", "fail"]
UNKNOWN_TYPES: tuple[UnknownTypes, ...] = ("park", "skip", "fail")
#: Watches one call of `Consumer.process`: called with the message before anything is
#: done with it, it returns a context manager that is open while the message is
#: processed (an exception leaves through it) and yields a function that is told what
#: came of it. `relaybox.observability.otel` sets one to trace and count the messages.
Observer = Callable[[Incoming], AbstractContextManager[Callable[["Processed"], None]]]

#: Seconds between two purges of expired ids (inbox "id" mode) and attempt counts.
DEFAULT_PURGE_INTERVAL = 60.0
#: Attempts at a message before it is parked (`SharedSettings.max_attempts`).
DEFAULT_MAX_ATTEMPTS = 5
#: Seconds between two looks for parked messages an operator asked to replay.
DEFAULT_REPLAY_INTERVAL = 5.0
#: Requested replays read per query.
REPLAY_BATCH = 100
#: Seconds between two writes of the consumer's activity (`relaybox.inbox.activity`).
DEFAULT_ACTIVITY_INTERVAL = 10.0
#: Seconds between two warnings that writing the activity failed.
ACTIVITY_WARNING_INTERVAL = 300.0


class Processed(enum.Enum):
    """What `Consumer.process` did with a message; whichever, acknowledge it."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    #: Given up on and kept in the parked table (an invalid payload, no attempt left, a
    #: type without a handler).
    PARKED = "parked"
    #: A type without a handler, under unknown_types="skip": nothing was written.
    SKIPPED = "skipped"


@dataclasses.dataclass(frozen=True, slots=True)
class _Route:
    """A handler, and how its payload is decoded (None: it gets the message only)."""

    handler: Callable[..., Any]
    decode: Decoder | None

    def arguments(self, message: Incoming) -> tuple[Any, ...]:
        """The handler's arguments but the connection; `EnvelopeError` for a payload
        that does not fit."""
        return (message,) if self.decode is None else (self.decode(message), message)


class _Poison(Exception):
    """Park this message now, for `reason`: no attempt of it can succeed."""

    def __init__(self, reason: Reason, error: str) -> None:
        super().__init__(error)
        self.reason: Reason = reason


class Consumer:
    """Handlers, the inbox that guards them and the transactions they run in.

    `handler` (optional) takes every message whose type has no handler of its own; a
    handler for one type is registered with `@consumer.handler("OrderPlaced")`. Each is
    called as ``handler(message, connection)``, or, registered with `payload=` a
    dataclass or pydantic model, as ``handler(payload, message, connection)``.

    ``async def`` handlers run in the event loop and `transaction` must return an
    async context manager; plain ``def`` handlers run, with their transaction, in a
    worker thread (so a sync driver never blocks the broker client's heartbeats), and
    `transaction` must return a sync one, opened in that thread. All of one consumer's
    handlers are of one kind.
    """

    def __init__(
        self,
        handler: AsyncHandler | SyncHandler | None = None,
        *,
        inbox: Inbox,
        transaction: Transaction,
        unknown_types: UnknownTypes = "park",
        purge_interval: float | None = DEFAULT_PURGE_INTERVAL,
        replay_interval: float | None = DEFAULT_REPLAY_INTERVAL,
        retry_in_place: bool | None = None,
        retry_delay: float = 0.1,
        max_retry_delay: float = 30.0,
        activity_interval: float | None = DEFAULT_ACTIVITY_INTERVAL,
    ) -> None:
        if not callable(transaction) or (handler is not None and not callable(handler)):
            raise ConfigurationError("Consumer needs a callable handler and transaction")
        if not 0 < retry_delay <= max_retry_delay:
            raise ConfigurationError("retry delays must satisfy 0 < retry_delay <= max")
        if unknown_types not in UNKNOWN_TYPES:
            raise ConfigurationError(
                f"unknown_types={unknown_types!r}: use 'park', 'skip' or 'fail'"
            )
        if replay_interval is not None and not replay_interval > 0:
            raise ConfigurationError(f"replay_interval={replay_interval!r}: must be above zero")
        if activity_interval is not None and not activity_interval > 0:
            raise ConfigurationError(
                f"activity_interval={activity_interval!r}: must be above zero (None: off)"
            )
        self.inbox = inbox
        self.transaction = transaction
        self.unknown_types: UnknownTypes = unknown_types
        self._routes: dict[str, _Route] = {}
        self._fallback: _Route | None = None
        self.is_async = True
        self._kind: bool | None = None  # is_async, once a handler decided it
        if handler is not None:
            self._fallback = self._route_for(handler, None)
        self.purge_interval = purge_interval
        self.replay_interval = replay_interval
        #: Retry a failing handler here, up to its attempts, rather than hand the message
        #: back to the broker: a watermark inbox needs it (see `process`), so it is the
        #: default there.
        self.retry_in_place = (
            inbox.mode == "watermark" if retry_in_place is None else retry_in_place
        )
        self.retry_delay, self.max_retry_delay = retry_delay, max_retry_delay
        self.failures = 0
        self._next_purge = 0.0  # the first message purges what expired while it was down
        self.applied = 0
        self.duplicates = 0
        self.parked = 0
        self.skipped = 0
        self.replayed = 0
        self.activity_interval = activity_interval
        #: Counts not written to the activity table yet.
        self._tally = InboxTally()
        #: time.monotonic() of the last warning that the activity could not be written.
        self._activity_warned: float | None = None
        #: Watches each message processed (None: nothing watches, at no cost).
        self.observer: Observer | None = None

    def handler(
        self, type_name: str, *, payload: type[Any] | None = None
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register the decorated function as the handler of messages of `type_name`
        (the CloudEvents type on the wire). With `payload`, the JSON payload is decoded
        into that dataclass or pydantic model, and validated, before the transaction;
        one that does not fit is parked."""
        if not isinstance(type_name, str) or not type_name:
            raise ConfigurationError("name the message type a handler takes")
        if type_name in self._routes:
            raise ConfigurationError(f"type {type_name!r} has a handler already")
        decode = None if payload is None else decoder(payload)

        def register(function: Callable[..., Any]) -> Callable[..., Any]:
            self._routes[type_name] = self._route_for(function, decode)
            return function

        return register

    def _route_for(self, function: Callable[..., Any], decode: Decoder | None) -> _Route:
        if not callable(function):
            raise ConfigurationError(f"handler {function!r} is not callable")
        kind = inspect.iscoroutinefunction(function)
        if self._kind is not None and kind != self._kind:
            raise ConfigurationError(
                "a consumer's handlers are all async def or all def: they share its "
                "transaction, which is either async or sync"
            )
        self._kind = self.is_async = kind
        return _Route(function, decode)

    # -- one message ----------------------------------------------------------------

    async def process(
        self,
        message: Incoming,
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        redelivered: bool = False,
    ) -> Processed:
        """Check, handle and commit `message`, or park it; raises what the handler
        raised (after the rollback) while it has attempts left, and then the message
        must not be acknowledged. `redelivered`: the broker says this may be a
        redelivery without counting deliveries (see the module's docstring).

        With `retry_in_place`, a failing handler is retried here instead (backing off
        from `retry_delay` to `max_retry_delay` seconds) until it commits or its
        attempts run out. A broker hands a negatively acknowledged message back later,
        after messages that came behind it: for a watermark inbox those would move the
        mark past it, and the late one would be skipped as a copy. Retrying in place
        keeps each lane in order, at the price of holding up what follows a failing
        message.
        """
        if max_attempts < 1:
            raise ConfigurationError(f"max_attempts={max_attempts!r}: must be at least 1")
        if self.observer is None:
            return await self._process(message, max_attempts, redelivered)
        with self.observer(message) as processed:
            outcome = await self._process(message, max_attempts, redelivered)
            processed(outcome)
            return outcome

    async def _process(self, message: Incoming, max_attempts: int, redelivered: bool) -> Processed:
        try:
            route, arguments = self._dispatch(message)
        except _Poison as poison:
            return await self._park(message, poison.reason, str(poison), 0)
        if route is None:
            self.skipped += 1
            logger.info("skipped %s: no handler for type %r", message.id, message.type,
                        extra={"action": "type_skipped", "message_id": message.id})  # fmt: skip
            return Processed.SKIPPED
        # This attempt's number, when it is counted before running it.
        counted = await self._count(message, None) if _suspect(message, redelivered) else None
        if counted is not None and counted > max_attempts:
            error = await self._last_error(message) or (
                f"attempt {counted - 1} ended without an outcome (the consumer crashed, "
                "stopped or lost its connection)"
            )
            return await self._park(message, "failed", error, counted - 1)
        pauses = RetryPolicy(base_delay=self.retry_delay, max_delay=self.max_retry_delay)
        for failures in itertools.count(1):
            try:
                outcome = await self._apply(message, route, arguments)
                break
            except (ConfigurationError, InboxError):
                self.failures += 1
                raise  # the setup is wrong, not the message: it must wait for a fix
            except EnvelopeError as error:  # the handler found the message unreadable
                self.failures += 1
                return await self._park(message, "invalid", str(error), counted or 1)
            except Exception as error:
                self.failures += 1
                attempt = counted if counted is not None else await self._failed(message, error)
                counted = None
                if attempt is not None and attempt >= max_attempts:
                    return await self._park(message, "failed", _describe(error), attempt)
                if not self.retry_in_place:
                    raise
                delay = pauses.delay(failures)
                logger.exception(
                    "handler failed for %s (attempt %s of %d); retrying in %.1fs",
                    message.id, "not counted" if attempt is None else attempt, max_attempts,
                    delay, extra={"action": "handler_retry", "message_id": message.id},
                )  # fmt: skip
                await asyncio.sleep(delay)
        if outcome is Processed.APPLIED:
            self.applied += 1
            self._tally.applied_one(message.time, time.time())
        else:
            self._duplicate(message)
        await self._maybe_purge()
        return outcome

    def _dispatch(self, message: Incoming) -> tuple[_Route | None, tuple[Any, ...]]:
        """The message's route and its handler's arguments; None: skip it. Raises
        `_Poison` for a message to park at once, `InboxError` under "fail"."""
        route = self._routes.get(message.type, self._fallback)
        if route is None:
            if self.unknown_types == "skip":
                return None, ()
            if self.unknown_types == "fail":
                raise InboxError(
                    f"no handler for type {message.type!r} (unknown_types='fail'): "
                    "it is redelivered until a consumer with one takes it"
                )
            raise _Poison("unknown_type", f"no handler for type {message.type!r}")
        if self.inbox.mode == "watermark":
            try:  # a message the watermark cannot place would fail the same way forever
                self.inbox.lane(message)
            except InboxError as error:
                raise _Poison("invalid", str(error)) from None
        try:
            return route, route.arguments(message)
        except EnvelopeError as error:
            raise _Poison("invalid", str(error)) from None

    async def _apply(
        self, message: Incoming, route: _Route, arguments: tuple[Any, ...]
    ) -> Processed:
        async def apply(work: Work) -> Processed:
            if not await work.record(message):
                return Processed.DUPLICATE
            await work.call(route.handler, *arguments, work.connection)
            await work.still_recorded(message)
            return Processed.APPLIED

        return await self._in_transaction(apply)

    def _duplicate(self, message: Incoming) -> None:
        self.duplicates += 1
        self._tally.duplicate += 1
        logger.info(
            "duplicate %s skipped", message.id,
            extra={"action": "inbox_duplicate", "message_id": message.id,
                   "consumer": self.inbox.consumer},
        )  # fmt: skip

    # -- attempts and parking ---------------------------------------------------------

    async def _failed(self, message: Incoming, error: BaseException) -> int | None:
        """Count a failed attempt; its number. Where it cannot be counted (the database
        is away too), `error` is raised, unless the message is retried in place: handed
        back, it could be overtaken by the next of its lane, which would move the mark
        past it. It is tried again here then, this attempt not counted (None)."""
        try:
            return await self._count(message, error)
        except Exception:
            if not self.retry_in_place:
                raise
            return None

    async def _count(self, message: Incoming, error: BaseException | None) -> int:
        """Count an attempt of `message` in the database; its number. An attempt that
        could not be counted (the database is away too) is not counted: `error` is
        raised as it is, and the message comes again."""
        key = (self.inbox.consumer, message.id)
        text = None if error is None else _describe(error)

        async def count(work: Work) -> int:
            params = (*key, text, text) if work.dialect == "mysql" else (*key, text)
            await work.execute("count_attempt", *params)
            ((attempts, _),) = await work.fetch("attempts", *key)
            return int(attempts)

        try:
            return await self._in_transaction(count)
        except Exception as failure:
            logger.warning("could not count an attempt of %s: %r", message.id, failure,
                           extra={"action": "attempt_not_counted"})  # fmt: skip
            if error is None:
                raise
            raise error from failure

    async def _last_error(self, message: Incoming) -> str | None:
        async def last(work: Work) -> str | None:
            rows = await work.fetch("attempts", self.inbox.consumer, message.id)
            return str(rows[0][1]) if rows and rows[0][1] is not None else None

        return await self._in_transaction(last)

    async def _park(
        self, message: Incoming, reason: Reason, error: str, attempts: int
    ) -> Processed:
        """Record `message` in the inbox and keep it in the parked table, in one
        transaction; a copy already recorded is a duplicate, and nothing is parked."""
        key = (self.inbox.consumer, message.id)

        async def park(work: Work) -> Processed:
            try:
                first = await work.record(message)
            except InboxError:  # the watermark cannot place it: recorded by its id
                first = await work.record_id(message)
            if not first:
                return Processed.DUPLICATE
            params = parked.park_params(self.inbox.consumer, message, reason, error, attempts)
            await work.execute("park", *params)
            await work.execute("forget_attempts", *key)
            return Processed.PARKED

        outcome = await self._in_transaction(park)
        if outcome is Processed.DUPLICATE:
            self._duplicate(message)
            return outcome
        self.parked += 1
        self._tally.parked += 1
        logger.error(
            "parked %s (type %r, %s after %d attempts): %s",
            message.id, message.type, reason, attempts, error,
            extra={"action": "message_parked", "message_id": message.id, "reason": reason,
                   "consumer": self.inbox.consumer, "attempts": attempts},
        )  # fmt: skip
        return outcome

    # -- replays ----------------------------------------------------------------------

    async def replay_parked(self, ids: Iterable[int] = (), *, by: str | None = None) -> int:
        """Apply the parked messages whose replay was asked for (by `relaybox parked
        replay`, or here: `ids` are asked for first); return how many were applied.

        Each runs through its handler once, in a transaction of its own whose claim on
        the parked row is the check (as the inbox record is for a delivery): applied
        once, whichever consumer of this name gets there first. A replay that fails is
        parked again with its new error. Running consumers do this every
        `replay_interval` seconds (`maintain`)."""
        wanted = list(ids)
        if wanted:
            await self._in_transaction(
                lambda work: parked.resolve(work, wanted, status="replay", by=by, note=None)
            )
        applied = 0
        while True:
            rows = await self._in_transaction(
                lambda work: work.fetch("requested", self.inbox.consumer, REPLAY_BATCH)
            )
            for row in rows:
                applied += await self._replay(parked.from_row(row))
            if len(rows) < REPLAY_BATCH:
                return applied

    async def _replay(self, row: ParkedMessage) -> int:
        message = row.message

        async def claim(work: Work, route: _Route | None, arguments: tuple[Any, ...]) -> int:
            if await work.execute("claim_replay", row.id) != 1:
                return 0  # another consumer of this name replayed it
            if route is not None:
                await work.call(route.handler, *arguments, work.connection)
            return 1

        reason: Reason = "failed"
        try:
            route, arguments = self._dispatch(message)
            done = await self._in_transaction(lambda work: claim(work, route, arguments))
        except _Poison as poison:
            reason, error = poison.reason, str(poison)
        except (ConfigurationError, InboxError):
            raise
        except Exception as failure:  # noqa: BLE001 - the handler's: parked again
            reason, error = ("invalid" if isinstance(failure, EnvelopeError) else "failed",
                             _describe(failure))  # fmt: skip
        else:
            self.replayed += done
            logger.info("replayed parked message %d (%s)", row.id, message.id,
                        extra={"action": "parked_replayed", "message_id": message.id})  # fmt: skip
            return done
        await self._in_transaction(
            lambda work: work.execute("replay_failed", reason, error, row.id)
        )
        logger.error("replay of parked message %d (%s) failed: %s; parked again", row.id,
                     message.id, error, extra={"action": "replay_failed"})  # fmt: skip
        return 0

    async def maintain(self) -> None:
        """Apply requested replays every `replay_interval` seconds and write the
        activity every `activity_interval` seconds, until cancelled. The broker
        consumers run this beside their deliveries."""
        await asyncio.gather(self._replays(), self._activity())

    async def _replays(self) -> None:
        if self.replay_interval is None:
            return
        while True:
            try:
                await self.replay_parked()
            except Exception:  # the next round tries again; a delivery never waits on it
                logger.exception("looking for parked messages to replay failed",
                                 extra={"action": "replay_sweep_failed"})  # fmt: skip
            await asyncio.sleep(self.replay_interval)

    # -- activity, for the operator's console -----------------------------------------

    async def _activity(self) -> None:
        if self.activity_interval is None:
            return
        purged_at = time.monotonic()
        while True:
            await asyncio.sleep(self.activity_interval)
            await self.record_activity()
            # Old minutes go beside the deliveries, never in the way of one.
            every = self.purge_interval
            if every is not None and time.monotonic() - purged_at >= every:
                purged_at = time.monotonic()
                try:
                    await self.purge_activity()
                except Exception as error:  # noqa: BLE001 - logged as the writes are
                    self._activity_failed(error)

    async def record_activity(self) -> bool:
        """Add the counts since the last write to this consumer's row of the current
        minute, in a short transaction of its own; False if that failed (logged now and
        then; the counts go to the next write). Nothing to add: nothing written."""
        taken = self._tally.take()
        if not taken.counted:
            return True
        consumer = self.inbox.consumer
        try:
            await self._in_transaction(lambda work: activity.record(work, consumer, taken))
        except BaseException as error:
            self._tally.add(taken)
            if not isinstance(error, Exception):
                raise
            self._activity_failed(error)
            return False
        self._activity_warned = None
        return True

    def _activity_failed(self, error: Exception) -> None:
        now = time.monotonic()
        warned = self._activity_warned
        if warned is not None and now - warned < ACTIVITY_WARNING_INTERVAL:
            return
        self._activity_warned = now
        logger.warning(
            "writing the consumer's activity failed: %s; it is tried again with the "
            "counts kept", error, extra={"action": "inbox_activity_error"},
        )  # fmt: skip

    # -- retention --------------------------------------------------------------------

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
        """Delete every id, and every attempt count, past the inbox's retention, a batch
        per transaction; return how many ids."""
        total = 0
        while True:
            ids, attempts = await self._in_transaction(self._purge_batch)
            total += ids
            if max(ids, attempts) < self.inbox.purge_batch:
                return total

    async def _purge_batch(self, work: Work) -> tuple[int, int]:
        inbox = self.inbox
        ids = await work.purge()
        params: tuple[Any, ...] = (inbox.consumer, inbox.retention_seconds, inbox.purge_batch)
        if work.dialect == "sqlite":  # `?` cannot repeat a parameter
            params = (inbox.consumer, *params)
        return ids, await work.execute("purge_attempts", *params)

    async def purge_activity(self) -> int:
        """Delete the activity rows past their retention (every consumer's), a batch
        per transaction; how many. Apart from the purge of ids, so that an inbox whose
        activity table is missing still purges its ids."""
        batch, total = self.inbox.purge_batch, 0
        while True:
            deleted = await self._in_transaction(lambda work: activity.purge(work, batch))
            total += deleted
            if deleted < batch:
                return total

    # -- transactions -----------------------------------------------------------------

    async def _in_transaction(self, work: Callable[[Work], Coroutine[Any, Any, T]]) -> T:
        """Run `work` in one transaction: in the event loop for async handlers, in a
        worker thread for sync ones."""
        if self.is_async:
            async with _async_transaction(self.transaction) as connection:
                return await work(await Work.opened(connection, self.inbox))
        return await asyncio.to_thread(self._in_sync_transaction, work)

    def _in_sync_transaction(self, work: Callable[[Work], Coroutine[Any, Any, T]]) -> T:
        with _sync_transaction(self.transaction) as connection:
            return run_sync(work(Work.opened_sync(connection, self.inbox)))


def _suspect(message: Incoming, redelivered: bool) -> bool:
    """Whether an earlier attempt at this delivery may have died uncounted."""
    count = message.delivery_count
    return count > 1 if count is not None else redelivered


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


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
