"""RabbitMQ consumer (aio-pika): one durable queue, manual acks after the commit.

    consumer = AmqpConsumer("amqp://guest:guest@127.0.0.1:5672/", Consumer(handle, ...),
                            queue="billing.orders", exchange="orders", routing_keys=["orders"])
    async with consumer:
        ...

The queue is declared durable, with `queue_arguments` (a quorum queue, a dead-letter
exchange, a delivery limit...), unless `declare=False`, which only checks that it exists.
`relaybox.publishers.amqp` sends each message to its URL's exchange with the topic as
routing key: with `exchange` set, the queue is bound to that exchange by each of
`routing_keys` (by default the queue's own name); without it, RabbitMQ's default
exchange delivers to the queue whatever was published with the queue's name as topic.
Several consumers on one queue share its messages (competing consumers).

Deliveries arrive up to `prefetch` at a time (basic.qos), are processed one by one in
arrival order and are settled, never auto-acked, only after `Consumer.process` returned:

    ACK     basic.ack, after the commit (the effects applied, or a duplicate skipped).
    ACK     also for a message parked once its `max_attempts` ran out (see
            `relaybox.inbox.consumer`): the database keeps it, not the queue.
    RETRY   basic.nack(requeue=True) after a backoff (`retry_delay`, doubled per
            consecutive failure up to `max_retry_delay`), so a failing handler does not
            spin; RabbitMQ puts the message back and delivers it again, to this or another
            consumer. Deliveries prefetched behind it are processed meanwhile, so with
            `prefetch` above 1 a retried message may be applied after later messages of
            its key.
    REJECT  basic.reject(requeue=False): dropped for good, or dead-lettered where the
            queue has a dead-letter exchange (`x-dead-letter-exchange`).

Redelivery: a delivery still unsettled when its channel closes (the process died, the
connection dropped, `stop()` during a handler) goes back to the queue and is delivered
again with `redelivered` set; if its transaction had committed, the inbox acknowledges
the copy as a duplicate. `Incoming.delivery_count` is a quorum queue's
`x-delivery-count` header + 1 (the header counts earlier failed deliveries), 1 for a
delivery that RabbitMQ marks as not redelivered, and None for a redelivery of unknown
count (a classic queue); such a redelivery counts its attempt in the database before
its handler runs, so a message that crashes the consumer is parked all the same.

Reconnects: `connect_robust` connects again every `reconnect_wait` seconds after a lost
connection (aio-pika's own loop: unlike the other consumers' waits, this one does not
grow) and restores the channel, its prefetch, the queue, its bindings and the consumer.
Deliveries of the lost channel still waiting in this process are dropped unprocessed,
and a settle on a closed channel is logged and ignored: RabbitMQ requeued them all when
the channel closed.
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relaybox.consumers.base import (
    DEFAULTS,
    Backoff,
    BrokerConsumer,
    Verdict,
    check_positive,
    redelivery_policy,
)
from relaybox.core import envelope
from relaybox.core.incoming import Incoming
from relaybox.core.urls import mask_url
from relaybox.errors import BrokerError, BrokerUnavailableError, ConfigurationError, EnvelopeError
from relaybox.inbox.processor import Processor
from relaybox.publishers.amqp import PREFIX

if TYPE_CHECKING:
    from aio_pika.abc import (
        AbstractIncomingMessage,
        AbstractQueue,
        AbstractRobustConnection,
    )

logger = logging.getLogger(__name__)

#: The quorum queue header counting a message's earlier failed deliveries.
DELIVERY_COUNT_HEADER = "x-delivery-count"


def decode(message: AbstractIncomingMessage) -> Incoming:
    """The relaybox envelope of a RabbitMQ delivery: the inverse of
    `relaybox.publishers.amqp.amqp_message` (`cloudEvents:` application headers)."""
    received = {
        name: text
        for name, value in (message.headers or {}).items()
        if name != DELIVERY_COUNT_HEADER
        and (text := _text(value, strict=name.startswith(PREFIX))) is not None
    }
    attributes, headers = envelope.split(received, PREFIX)
    return Incoming.from_envelope(
        attributes,
        message.body,
        headers=headers,
        content_type=message.content_type,
        topic=message.routing_key or "",
        delivery_count=delivery_count(message),
    )


def delivery_count(message: AbstractIncomingMessage) -> int | None:
    """How many times RabbitMQ delivered this message, where it says (1 = first)."""
    earlier = (message.headers or {}).get(DELIVERY_COUNT_HEADER)
    if isinstance(earlier, int) and not isinstance(earlier, bool) and earlier >= 0:
        return earlier + 1
    return 1 if message.redelivered is False else None


def _text(value: object, *, strict: bool) -> str | None:
    """A header value as a string; None for an AMQP table or array (such as `x-death`),
    which is broker bookkeeping, not an attribute or a header of the message. Bytes
    (what pamqp hands over for a string that is not UTF-8) are refused for an attribute
    (`strict`): replaced characters could make two ids one."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8", "strict" if strict else "replace")
        except UnicodeDecodeError:
            raise EnvelopeError("a CloudEvents attribute of the delivery is not UTF-8") from None
    if isinstance(value, bool):  # CloudEvents' canonical boolean strings
        return "true" if value else "false"
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:  # AMQP timestamps are UTC seconds
            value = value.replace(tzinfo=datetime.UTC)
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, int | float | decimal.Decimal):
        return str(value)
    return None


class AmqpConsumer(BrokerConsumer):
    """Runs `consumer` on the deliveries of one RabbitMQ queue."""

    def __init__(
        self,
        url: str,
        consumer: Processor,
        *,
        queue: str,
        exchange: str = "",
        routing_keys: Sequence[str] | None = None,
        declare: bool = True,
        queue_arguments: Mapping[str, Any] | None = None,
        prefetch: int = DEFAULTS.prefetch,
        retry_delay: float = DEFAULTS.retry_delay,
        max_retry_delay: float = DEFAULTS.max_retry_delay,
        timeout: float = DEFAULTS.timeout,
        reconnect_wait: float = DEFAULTS.reconnect_wait,
        max_attempts: int = DEFAULTS.max_attempts,
        name: str = "relaybox-consumer",
    ) -> None:
        """
        url              the broker, `amqp://user:password@host:port/vhost` or `amqps://`.
        queue            the queue to consume (shared by competing consumers).
        exchange         bind the queue to this exchange (it must exist); "" binds nothing.
        routing_keys     the topics to bind it by (default: the queue's name).
        declare          declare the queue durable (True) or only check that it exists.
        queue_arguments  `x-` arguments of the declaration, e.g. {"x-queue-type":
                         "quorum"} or {"x-dead-letter-exchange": "dlx"}; they must match
                         an existing queue's.
        prefetch         unacknowledged deliveries RabbitMQ sends ahead (basic.qos).
        retry_delay      seconds before a RETRY is requeued, doubled per consecutive
                         failure...
        max_retry_delay  ... up to this.
        timeout          seconds to connect and set up (`start()` fails after it).
        reconnect_wait   seconds between reconnect attempts after a lost connection.
        max_attempts     attempts at a message before it is parked (and acknowledged).
        name             the connection's name in RabbitMQ's management tools.
        """
        super().__init__(consumer, max_attempts=max_attempts)
        if not queue:
            raise ConfigurationError("AmqpConsumer needs a queue name")
        check_positive(prefetch=prefetch, timeout=timeout, reconnect_wait=reconnect_wait)
        self.url = url
        self.queue = queue
        self.exchange = exchange
        self.routing_keys = list(routing_keys) if routing_keys is not None else [queue]
        self.declare = declare
        self.queue_arguments = dict(queue_arguments or {})
        self.prefetch = prefetch
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        #: Consecutive RETRY verdicts, whatever the message: the handler's trouble.
        self._retries = Backoff(redelivery_policy(retry_delay, max_retry_delay))
        self.timeout = timeout
        self.reconnect_wait = reconnect_wait
        self.name = name
        self._masked = mask_url(url)

    # -- the loop ---------------------------------------------------------------------

    async def consume(self) -> None:
        connection = await self._connect()
        try:
            deliveries: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
            async with asyncio.timeout(self.timeout):
                queue = await self._subscribe(connection)
                await queue.consume(deliveries.put, no_ack=False)  # restored on reconnect
            self.ready()
            while True:
                delivery = await deliveries.get()
                if _orphaned(delivery):
                    continue  # its channel closed: RabbitMQ requeued it already
                if delivery.redelivered:
                    logger.debug("redelivered: %s", delivery.message_id,
                                 extra={"action": "redelivered", "broker": "amqp"})  # fmt: skip
                verdict = await self.handle(
                    functools.partial(decode, delivery), redelivered=bool(delivery.redelivered)
                )
                await self.settle(delivery, verdict)
        finally:
            await connection.close()

    async def settle(self, delivery: AbstractIncomingMessage, verdict: Verdict) -> None:
        """Tell RabbitMQ the verdict; if the channel is gone, it has requeued the delivery."""
        from aiormq.exceptions import AMQPError

        if verdict is Verdict.RETRY:
            await self._retries.wait()
        else:
            self._retries.succeeded()
        try:
            if verdict is Verdict.ACK:
                await delivery.ack()
            elif verdict is Verdict.RETRY:
                await delivery.nack(requeue=True)
            else:
                await delivery.reject(requeue=False)
        except (AMQPError, RuntimeError, ConnectionError) as error:  # RuntimeError: closed
            logger.warning(
                "could not %s a delivery from %s: %r; RabbitMQ delivers it again",
                verdict.value, self.queue, error,
                extra={"action": "settle_failed", "broker": "amqp"},
            )  # fmt: skip

    # -- connecting and subscribing ---------------------------------------------------

    async def _connect(self) -> AbstractRobustConnection:
        import aio_pika

        try:
            return await aio_pika.connect_robust(
                self.url,
                timeout=self.timeout,
                reconnect_interval=self.reconnect_wait,
                client_properties={"connection_name": self.name},
            )
        except Exception as error:
            raise BrokerUnavailableError(
                f"cannot connect to RabbitMQ at {self._masked}: {error!r}"
            ) from error

    async def _subscribe(self, connection: AbstractRobustConnection) -> AbstractQueue:
        """Open the channel, declare (or check) the queue and bind it; all of it is
        declared again by the robust channel after a reconnect."""
        from aiormq.exceptions import ChannelClosed

        channel = await connection.channel()
        await channel.set_qos(prefetch_count=self.prefetch)
        queue: AbstractQueue
        try:
            if self.declare:
                queue = await channel.declare_queue(
                    self.queue, durable=True, arguments=self.queue_arguments
                )
            else:
                queue = await channel.get_queue(self.queue, ensure=True)
            if self.exchange:
                for routing_key in self.routing_keys:
                    await queue.bind(self.exchange, routing_key)
        except ChannelClosed as error:  # not found, or declared with other arguments
            raise BrokerError(
                f"cannot consume queue {self.queue!r} (exchange {self.exchange!r}) on "
                f"{self._masked}: {error}"
            ) from error
        return queue


def _orphaned(delivery: AbstractIncomingMessage) -> bool:
    """True when the channel that delivered it has closed (aio-pika raises then)."""
    try:
        return bool(delivery.channel.is_closed)
    except RuntimeError:  # aiormq's ChannelInvalidStateError
        return True
