"""Helpers for an application's own tests: what a transaction wrote to the outbox, and
an in-process relay that hands what it published to a consumer.

    probe = OutboxProbe("sqlite:///test.db")       # remembers where the table ends
    place_order(connection, outbox)                # the code under test, in its transaction
    probe.assert_written(topic="orders", key="42") # one message at least, of that topic and key

`OutboxProbe` reads the outbox table the application writes to, through the same
storage a relay uses, and sees only what was committed: a rolled-back transaction
leaves nothing for it (`assert_nothing_written`). Its methods are plain functions that
work in sync and async tests alike: its database work runs on an event loop of its own,
in a thread of its own.

`Pipeline` runs a real `Relay` in the test's event loop, publishing the table to
in-memory publishers (`relaybox.publishers.memory.MemoryPublisher`, one per target, to
inject faults into), and hands each published message to a `Consumer` as a broker
consumer would: decoded from the envelope the relay sent. `run_until_idle` returns once
nothing is left to deliver or to hand over, the messages the handlers wrote meanwhile
included.

The pytest fixtures built on these are in `relaybox.testing.plugin`, which pytest loads
by itself once relaybox is installed; docs/testing.md shows them at work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any, Self, TypeVar

from relaybox.core import envelope
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.incoming import Incoming
from relaybox.core.inspection import MessageDetail, MessageFilter
from relaybox.core.lifecycle import LIVE_STATES
from relaybox.core.message import DEFAULT_TARGET
from relaybox.core.records import StoredMessage
from relaybox.core.retry import RetryPolicy
from relaybox.inbox.consumer import Consumer
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay.engine import Relay
from relaybox.relay.settings import RelaySettings
from relaybox.storage import open_storage
from relaybox.storage.memory import MemoryStorage
from relaybox.storage.sql import SqlStorage

__all__ = ["OutboxProbe", "Pipeline", "WrittenMessage", "run_aside"]

T = TypeVar("T")
#: Rows read per query when listing what was written.
_PAGE = 500
#: A relay for tests: it looks at the table often and retries a failure at once.
QUICK = RelaySettings(
    idle_interval=0.02,
    min_poll_interval=0.002,
    retry=RetryPolicy(base_delay=0.01, max_delay=0.05, jitter=0.0, max_attempts=3),
    cleanup_interval=3600.0,
    shutdown_timeout=2.0,
    activity_interval=None,
)


@dataclasses.dataclass(frozen=True, slots=True)
class WrittenMessage:
    """One message as the outbox holds it (or as the relay published it)."""

    seq: int
    id: str
    target: str
    topic: str
    key: str | None
    type: str
    payload: bytes
    headers: Mapping[str, str]
    correlation_id: str | None
    causation_id: str | None

    def json(self) -> Any:
        """The payload, decoded from JSON."""
        return json.loads(self.payload)

    def matches(
        self,
        *,
        topic: str | None,
        key: str | None,
        type: str | None,  # noqa: A002 - the field's name
    ) -> bool:
        """Whether each of `topic`, `key` and `type` that is given is this message's."""
        return all(
            wanted is None or wanted == found
            for wanted, found in ((topic, self.topic), (key, self.key), (type, self.type))
        )

    @classmethod
    def of_detail(cls, detail: MessageDetail) -> WrittenMessage:
        summary = detail.summary
        return cls(
            summary.seq, str(summary.id), summary.target, summary.topic, summary.key,
            summary.type, detail.payload, dict(detail.headers), summary.correlation_id,
            detail.causation_id,
        )  # fmt: skip

    @classmethod
    def of_stored(cls, message: StoredMessage) -> WrittenMessage:
        return cls(
            message.seq, str(message.id), message.target, message.topic, message.key,
            message.type, message.payload, dict(message.headers), message.correlation_id,
            message.causation_id,
        )  # fmt: skip


def select(
    messages: Iterable[WrittenMessage],
    count: int | None,
    *,
    topic: str | None,
    key: str | None,
    type: str | None,  # noqa: A002 - the field's name
    what: str,
) -> list[WrittenMessage]:
    """The messages that match, checked to be `count` of them (None: at least one);
    an `AssertionError` that lists every message seen otherwise."""
    seen = list(messages)
    found = [m for m in seen if m.matches(topic=topic, key=key, type=type)]
    if (len(found) == count) if count is not None else bool(found):
        return found
    wanted = ", ".join(
        f"{name}={value!r}"
        for name, value in (("topic", topic), ("key", key), ("type", type))
        if value is not None
    )
    expected = "at least one" if count is None else str(count)
    listing = "".join(f"\n  {m.topic!r} key={m.key!r} type={m.type!r}" for m in seen)
    raise AssertionError(
        f"expected {expected} message(s) {what} with {wanted or 'any fields'}, found "
        f"{len(found)}; {what}: {len(seen)}{listing}"
    )


class _Loop:
    """An event loop running in a thread of its own: sync callers, and async ones whose
    loop must not be re-entered, hand it coroutines and wait for their results."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="relaybox-outbox-probe", daemon=True
        )
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def run_aside(work: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run `work` to its end on an event loop of its own, from sync code or from inside
    a running loop alike (a fixture, say)."""
    loop = _Loop()
    try:
        return loop.run(work, timeout)
    finally:
        loop.close()


class OutboxProbe:
    """What was committed to one outbox table since the probe was made (or since its
    last `mark`). Close it, or use it as a context manager."""

    def __init__(self, database: str, *, table: str = DEFAULT_TABLE) -> None:
        self._loop = _Loop()
        try:
            self._storage = self._loop.run(open_storage(database, table=table))
            self._mark = self._last_seq()
        except BaseException:
            self._loop.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._loop.run(self._storage.close())
        finally:
            self._loop.close()

    def mark(self) -> None:
        """Forget what the table holds now: later calls see only what comes after."""
        self._mark = self._last_seq()

    def messages(self) -> list[WrittenMessage]:
        """Every message committed since the mark, in the order it was written."""
        return self._loop.run(self._since(self._mark))

    def assert_written(
        self,
        count: int | None = None,
        *,
        topic: str | None = None,
        key: str | None = None,
        type: str | None = None,  # noqa: A002 - the field's name
    ) -> list[WrittenMessage]:
        """The messages committed since the mark with this topic, key and type (those
        given), checked to be `count` of them (None: at least one)."""
        return select(self.messages(), count, topic=topic, key=key, type=type, what="written")

    def assert_nothing_written(self) -> None:
        """No message was committed since the mark: a rolled-back transaction's."""
        select(self.messages(), 0, topic=None, key=None, type=None, what="written")

    def _last_seq(self) -> int:
        newest = self._loop.run(self._storage.search(MessageFilter(), limit=1))
        return newest[0].seq if newest else 0

    async def _since(self, mark: int) -> list[WrittenMessage]:
        found: list[WrittenMessage] = []
        where = MessageFilter(min_seq=mark + 1)
        after = None
        while page := await self._storage.search(
            where, limit=_PAGE, after=after, newest_first=False
        ):
            # One query a page; a message gone meanwhile (a relay purged it) is left out.
            details = await self._storage.messages([summary.seq for summary in page])
            found += (WrittenMessage.of_detail(detail) for detail in details)
            after = page[-1].seq
        return found


class Pipeline:
    """A relay from `database`'s outbox `table` to in-memory publishers, one per target
    (`publishers`), and `consumer` (optional) handed what they published. Use it as an
    async context manager in the test's event loop."""

    def __init__(
        self,
        database: str,
        consumer: Consumer | None = None,
        *,
        table: str = DEFAULT_TABLE,
        targets: Iterable[str] = (DEFAULT_TARGET,),
        settings: RelaySettings = QUICK,
        max_attempts: int = 3,
    ) -> None:
        self.database, self.table = database, table
        self.consumer = consumer
        self.max_attempts = max_attempts
        self.publishers = {target: MemoryPublisher() for target in targets}
        self.relay = Relay(database, dict(self.publishers), table=table, settings=settings)
        #: The messages handed to the consumer, in the order it got them.
        self.handed: list[Incoming] = []
        self._storage: SqlStorage | MemoryStorage | None = None
        self._taken = dict.fromkeys(self.publishers, 0)

    async def __aenter__(self) -> Self:
        self._storage = await open_storage(self.database, table=self.table)
        try:
            await self.relay.start()
        except BaseException:
            await self._storage.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.relay.stop()
        finally:
            if self._storage is not None:
                await self._storage.close()

    @property
    def published(self) -> list[WrittenMessage]:
        """Every message the relay published, target by target, in publish order."""
        return [
            WrittenMessage.of_stored(message)
            for publisher in self.publishers.values()
            for message in publisher.published
        ]

    def assert_published(
        self,
        count: int | None = None,
        *,
        topic: str | None = None,
        key: str | None = None,
        type: str | None = None,  # noqa: A002 - the field's name
    ) -> list[WrittenMessage]:
        """The published messages with this topic, key and type (those given), checked
        to be `count` of them (None: at least one)."""
        return select(self.published, count, topic=topic, key=key, type=type, what="published")

    async def run_until_idle(self, timeout: float = 10.0) -> list[Incoming]:
        """Publish everything the table holds, hand each published message to the
        consumer, and go on with what the handlers wrote, until nothing is left to
        deliver; return what the consumer was handed by this call. A message the
        relay abandoned is not waited for; one written with a delay is, so give it a
        `timeout` (seconds) that covers the delay."""
        deadline = time.monotonic() + timeout
        handed: list[Incoming] = []
        while True:
            await self._delivered(deadline)
            fresh = self._fresh()
            if not fresh:
                return handed
            for message in fresh:
                if self.consumer is not None:
                    await self._hand(self.consumer, message)
                handed.append(message)
                self.handed.append(message)

    async def _delivered(self, deadline: float) -> None:
        """Wait until the table holds nothing to deliver and no batch is in flight."""
        if self._storage is None:
            raise RuntimeError("use the Pipeline as an async context manager first")
        while True:
            stats = await self._storage.stats()
            live = sum(stats.counts.get(status, 0) for status in LIVE_STATES)
            if not live and not any(p.in_flight for p in self.relay.processors):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{live} message(s) still to deliver from {self.table}")
            self.relay.wake()
            await asyncio.sleep(0.005)

    def _fresh(self) -> list[Incoming]:
        """What the publishers confirmed since last asked, as a consumer receives it."""
        fresh: list[StoredMessage] = []
        for target, publisher in self.publishers.items():
            fresh.extend(publisher.published[self._taken[target] :])
            self._taken[target] = len(publisher.published)
        return [_received(message) for message in fresh]

    async def _hand(self, consumer: Consumer, message: Incoming) -> None:
        """Process `message` as a broker consumer would: a failed handler gets it again,
        up to `max_attempts`, the last of which parks it."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                await consumer.process(message, max_attempts=self.max_attempts)
                return
            except Exception:
                if attempt == self.max_attempts:
                    raise


def _received(message: StoredMessage) -> Incoming:
    """`message` decoded as a broker consumer decodes the envelope the relay sent."""
    return Incoming.from_envelope(
        envelope.attributes(message), message.payload, headers=dict(message.headers),
        content_type=message.content_type, topic=message.topic,
    )  # fmt: skip
