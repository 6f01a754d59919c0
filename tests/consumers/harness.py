"""What the consumer conformance suite needs from each broker's test harness.

A harness owns a place of its own on one real broker (a stream, a queue, a topic) and
knows how to publish there with relaybox's own publisher (so every case also checks a
consumer's `decode` against what the publisher writes), how to put a delivery there
that is no relaybox envelope, which consumer to make for each role a case needs, and
whether the broker still holds anything unacknowledged ("settled").

The role factories default to `consumer()`; a harness overrides the ones its broker
needs tuned (a short `ack_wait` or `claim_idle` so that a redelivery comes within a
test's patience, a fetch of one message at a time so that two racers each get one).
The hooks marked optional do nothing unless a broker has something to do or to check
there: some can tell "settled" while consuming (`settling`), others only once the
consumers stopped (`check_settled`).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Self

from relaybox.consumers import BrokerConsumer, Verdict
from relaybox.core.incoming import Incoming
from relaybox.core.publishing import Outcome
from relaybox.core.records import StoredMessage
from relaybox.inbox import Consumer
from relaybox.publishers import open_publisher
from tests.brokers.conformance import outcomes, started


class ConsumerHarness(abc.ABC):
    #: The publisher URL of the broker.
    url: str
    #: Where the cases publish (a subject, a stream key, a queue's name, a topic).
    topic: str
    #: `Incoming.delivery_count` of a first delivery; None where the broker counts none.
    first_delivery_count: int | None = 1
    #: The `delivery_count`s a message whose handler failed once arrives with.
    retry_delivery_counts: tuple[int | None, ...] = (1, 2)
    #: What is published before a consumer subscribes waits for it on the broker.
    holds_messages: bool = True
    #: Consumers of one harness compete for its deliveries; False: each gets them all.
    competing: bool = True
    #: Seconds within which the `rejecting()` consumer would get an unsettled delivery
    #: again: a case waits that long to see that a rejected one stays away.
    redelivery_wait: float = 0.0

    @abc.abstractmethod
    def consumer(self, consumer: Consumer, **options: Any) -> BrokerConsumer:
        """A broker consumer of this harness's deliveries."""

    def retrying(self, consumer: Consumer) -> BrokerConsumer:
        """One that gets a message whose handler failed again soon."""
        return self.consumer(consumer)

    def crashing(self, consumer: Consumer) -> BrokerConsumer:
        """One that `dies_before_acking` will make crash."""
        return self.consumer(consumer)

    def successor(self, crashed: BrokerConsumer, consumer: Consumer) -> BrokerConsumer:
        """One that gets again, soon, what `crashed` left unacknowledged."""
        return self.consumer(consumer)

    def racer(self, consumer: Consumer) -> BrokerConsumer:
        """One of two that each get one copy of a message published twice."""
        return self.consumer(consumer)

    async def rejecting(self, consumer: Consumer) -> BrokerConsumer:
        """One whose rejected deliveries go where `check_rejected` looks for them."""
        return self.consumer(consumer)

    async def prepare(self) -> None:  # noqa: B027 - optional
        """Make the place exist before anything is published to it."""

    async def publish(self, *messages: StoredMessage, url: str | None = None) -> None:
        """Publish with relaybox's publisher for `url` (default: the harness's)."""
        async with started(open_publisher(url or self.url)) as publisher:
            results = await publisher.publish(messages)
        assert outcomes(results) == [Outcome.ACKED] * len(messages)

    async def publish_copy(self, message: StoredMessage) -> None:
        """Put a second copy of `message`, already published, on the broker."""
        await self.publish(message)

    @abc.abstractmethod
    async def publish_undecodable(self) -> None:
        """Put a delivery there that carries no relaybox envelope (no CloudEvents id)."""

    #: The broker carries a NUL in a header value (MQTT 5 forbids it in any string).
    carries_nul: bool = True

    @abc.abstractmethod
    async def publish_envelope(self, attributes: Mapping[str, str], payload: bytes) -> None:
        """Put a delivery there with these CloudEvents attributes, in the broker's binding,
        as a producer other than relaybox's publisher might."""

    async def held(self) -> int:
        """How many messages the broker holds for the consumers (`holds_messages`)."""
        raise NotImplementedError

    async def settling(self) -> None:  # noqa: B027 - optional
        """While consumers run: wait until the broker says that nothing is left to
        deliver or acknowledge, where it can tell."""

    async def check_settled(self, *consumers: BrokerConsumer) -> None:  # noqa: B027 - optional
        """Once `consumers` stopped: assert that they left nothing unacknowledged."""

    async def check_unsettled(self) -> None:  # noqa: B027 - optional
        """After a crash before the acknowledgement: assert that the broker knows."""

    async def check_rejected(self) -> None:  # noqa: B027 - optional
        """After the undecodable delivery was rejected: assert what became of it."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Delete what the harness made and disconnect."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def dies_before_acking(consumer: BrokerConsumer) -> asyncio.Event:
    """Make `consumer` commit, then hang instead of settling until it is stopped: a
    crash between the commit and the acknowledgement. The event is set at the commit.

    Every broker consumer settles through its own `settle(<delivery...>, verdict)`.
    """
    committed = asyncio.Event()

    async def hang(*delivery: Any) -> None:
        assert delivery[-1] is Verdict.ACK
        committed.set()
        await asyncio.Event().wait()

    consumer.settle = hang  # type: ignore[attr-defined]
    return committed


def counting_arrivals(consumer: BrokerConsumer, arrived: list[BrokerConsumer]) -> BrokerConsumer:
    """Make `consumer` note itself in `arrived` as each delivery arrives, before the
    inbox sees it."""
    handle = consumer.handle

    async def arriving(decode: Callable[[], Incoming], **options: Any) -> Verdict:
        arrived.append(consumer)
        return await handle(decode, **options)

    consumer.handle = arriving  # type: ignore[method-assign]
    return consumer
