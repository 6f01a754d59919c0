"""RabbitMQ (AMQP 0-9-1) publisher over aio-pika, with publisher confirms.

    amqp://guest:guest@127.0.0.1:5672/?exchange=orders&timeout=5&source=shop
    amqps://user:secret@rabbit.example.com/production

Routing: every message goes to the URL's `exchange`, with its topic as the routing key.
Without `exchange` that is RabbitMQ's default exchange, which routes a topic straight
to the queue of the same name. A target that needs another exchange gets its own URL.

Options (in the query string; the rest of the URL goes to aio-pika as it is):

- `exchange`: the exchange to publish to (default: the default exchange, ""). It must
  exist already; `start()` checks that it does (`relaybox setup` can create it).
- `timeout`: seconds (default 5) for connecting and for a whole `publish()` call; a
  message not confirmed by then is a transient failure.
- `source`: the CloudEvents `source` attribute (default "relaybox").

Topology, for `relaybox setup` (and `relaybox relay --setup-topology`); the publisher
itself only reads `exchange`:

- `exchange_type`: direct, topic, fanout or headers (default topic), for an exchange
  that `setup` creates.
- `queue`: a durable queue to create and bind to the exchange (to none with the
  default exchange, which routes by queue name already).
- `binding_key`: the binding's routing key (default `#` for a topic exchange, the
  queue's name for a direct one, "" otherwise).

An exchange or queue that exists is left as it is (its type and arguments unchecked:
whoever made it may have made it a quorum queue); the binding is declared every time,
which AMQP makes idempotent.

On the wire (CloudEvents AMQP binding, binary mode): the payload is the body; the
attributes are application headers named `cloudEvents:<name>`; the AMQP properties
carry content_type, message_id (the id), correlation_id, timestamp (occurred_at) and
type; the message's own headers travel as application headers beside them. Messages
are persistent (delivery mode 2) and published `mandatory`.

Outcomes:

- the broker acked -> ACKED.
- returned because no queue is bound for the routing key -> PERMANENT ("unroutable").
- a message with a header of its own that takes a name of the envelope or of the
  broker (`relaybox.core.envelope`: a row not written by `Message`), or one that AMQP
  cannot encode (a type, content type or correlation id over the 255 bytes of a short
  string, text that is not UTF-8) -> PERMANENT, never sent.
- a channel error caused by one message (larger than the broker's max_message_size,
  access refused, exchange gone) -> PERMANENT. Such an error closes the channel and
  fails every message in flight on it, so those are sent again one at a time on a
  private channel: only the message that fails alone is blamed.
- nacked (a full queue with `reject-publish`, a broker fault) -> TRANSIENT.
- connection refused or lost -> TRANSIENT. The next call connects again, so a publisher
  outlives a broker restart.
- no confirm within `timeout` -> TRANSIENT, without an attempt counted: the broker may
  have queued it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
from aiormq.exceptions import (
    AMQPError,
    ChannelClosed,
    ChannelInvalidStateError,
    ChannelNotFoundEntity,
    DeliveryError,
    PublishError,
)
from pamqp.common import FieldValue

from relaybox.core import envelope
from relaybox.core.publishing import (
    ACKED,
    Declared,
    Presence,
    PublisherFeatures,
    PublishResult,
    permanent,
    timed_out,
    transient,
    unavailable,
)
from relaybox.core.records import StoredMessage
from relaybox.core.urls import mask_url
from relaybox.errors import (
    BrokerError,
    BrokerUnavailableError,
    ConfigurationError,
    MessageError,
)
from relaybox.publishers.options import BrokerUrl

#: The CloudEvents AMQP binding's prefix for attributes in application properties.
PREFIX = "cloudEvents:"
#: AMQP 0-9-1 routing keys are short strings.
MAX_ROUTING_KEY_BYTES = 255

#: What a lost connection looks like, from the socket up to aio-pika.
_CONNECTION_ERRORS = (AMQPError, ConnectionError, OSError, TimeoutError)
#: ... and when opening a channel: aio-pika says RuntimeError for a connection just closed.
_OPENING_ERRORS = (*_CONNECTION_ERRORS, RuntimeError)


async def _connect(url: str, timeout: float) -> AbstractConnection:
    """`aio_pika.connect`, with a server that closes the socket before its first frame
    reported as the lost connection it is: aiormq's frame reader then ends with
    StopAsyncIteration, which would otherwise escape every handler of connection
    errors (seen when a proxy in front of a stopped broker accepts and closes)."""
    try:
        return await aio_pika.connect(url, timeout=timeout)
    except StopAsyncIteration as error:
        raise ConnectionResetError("the server closed the connection before it answered") from error


#: Exchange types `relaybox setup` may declare.
EXCHANGE_TYPES = ("direct", "topic", "fanout", "headers")

#: Turns a claimed row into what goes on the wire, and its routing key.
Encoder = Callable[[StoredMessage], tuple[aio_pika.Message, str]]


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    """What a target needs on RabbitMQ: an exchange, a queue bound to it, or both."""

    exchange: str
    exchange_type: str = "topic"
    queue: str | None = None
    binding_key: str | None = None

    def key(self) -> str:
        """The binding's routing key: given, or what suits the exchange's type."""
        if self.binding_key is not None:
            return self.binding_key
        if self.exchange_type == "topic":
            return "#"
        return (self.queue or "") if self.exchange_type == "direct" else ""


def from_url(url: BrokerUrl) -> AmqpPublisher:
    exchange = url.text("exchange", "")
    return AmqpPublisher(
        url.base,
        exchange=exchange,
        timeout=url.number("timeout", 5.0, minimum=0.1),
        source=url.source,
        topology=topology_of(url, exchange),
    )


def topology_of(url: BrokerUrl, exchange: str) -> Topology:
    """The URL's topology options (see the module's docstring)."""
    kind = url.text("exchange_type", "topic")
    if kind not in EXCHANGE_TYPES:
        raise ConfigurationError(
            f"amqp:// option exchange_type={kind!r}: use {'|'.join(EXCHANGE_TYPES)}"
        )
    return Topology(exchange, kind, url.optional_text("queue"), url.optional_text("binding_key"))


def cloudevents(source: str) -> Encoder:
    """The default encoding: the CloudEvents binding, the topic as the routing key."""

    def encode(message: StoredMessage) -> tuple[aio_pika.Message, str]:
        return amqp_message(message, source), message.topic

    return encode


def amqp_message(message: StoredMessage, source: str) -> aio_pika.Message:
    headers: dict[str, FieldValue] = dict(envelope.headers(message, PREFIX, source))
    return aio_pika.Message(
        message.payload,
        headers=headers,
        content_type=message.content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=str(message.id),
        correlation_id=message.correlation_id,
        timestamp=message.occurred_at,
        type=message.type,
    )


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _alive(connection: AbstractConnection | None) -> bool:
    # A plain (not robust) connection that the broker closed keeps is_closed False.
    return connection is not None and not connection.is_closed and connection.connected.is_set()


async def _close_quietly(connection: AbstractConnection | None, timeout: float) -> None:
    """Close, waiting `timeout` at most for a broker that does not answer."""
    if connection is not None:
        with contextlib.suppress(*_OPENING_ERRORS):
            async with asyncio.timeout(timeout):
                await connection.close()


@dataclasses.dataclass(frozen=True)
class _Lane:
    """A channel in confirm mode and the exchange object bound to it."""

    channel: AbstractChannel
    exchange: AbstractExchange


@dataclasses.dataclass(frozen=True)
class _ChannelLost:
    """The channel closed under a message: maybe its fault, maybe another's."""

    error: str


class AmqpPublisher:
    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "",
        timeout: float = 5.0,
        source: str = envelope.DEFAULT_SOURCE,
        topology: Topology | None = None,
        encode: Encoder | None = None,
        declare: bool = False,
    ) -> None:
        self._url = url
        self._display = mask_url(url)
        self._exchange = exchange
        self._timeout = timeout
        self._topology = topology or Topology(exchange)
        self._encode = encode or cloudevents(source)
        #: Declare the topology in start(), as Celery's producer does before it publishes.
        self._declare = declare
        self._connection: AbstractConnection | None = None
        self._lane: _Lane | None = None
        # One connection and one shared channel, even under concurrent calls.
        self._lock = asyncio.Lock()

    async def setup_topology(self) -> list[Declared]:
        """Create the URL's exchange and queue if missing, and bind them."""
        try:
            connection = await _connect(self._url, self._timeout)
        except _OPENING_ERRORS as error:
            raise BrokerUnavailableError(
                f"cannot connect to RabbitMQ at {self._display}: {_describe(error)}"
            ) from error
        try:
            async with asyncio.timeout(self._timeout):
                return await _declare(connection, self._topology)
        except ChannelClosed as error:  # refused: access, or an argument of the broker's
            raise BrokerError(f"RabbitMQ at {self._display} refused: {_describe(error)}") from None
        except _OPENING_ERRORS as error:
            raise BrokerUnavailableError(
                f"RabbitMQ at {self._display} failed: {_describe(error)}"
            ) from error
        finally:
            await _close_quietly(connection, self._timeout)

    async def start(self) -> None:
        if self._declare:
            await self.setup_topology()
        try:
            async with asyncio.timeout(self._timeout):
                await self._ready()
                await self._check_exchange()
        except ChannelNotFoundEntity:
            await self.close()
            raise BrokerError(
                f"exchange {self._exchange!r} does not exist on {self._display}; declare it first"
            ) from None
        except _OPENING_ERRORS as error:
            await self.close()
            raise BrokerUnavailableError(
                f"cannot connect to RabbitMQ at {self._display}: {_describe(error)}"
            ) from error

    async def close(self) -> None:
        async with self._lock:
            connection, self._connection, self._lane = self._connection, None, None
        await _close_quietly(connection, self._timeout)

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        deadline = asyncio.get_running_loop().time() + self._timeout
        try:
            async with asyncio.timeout_at(deadline):
                lane = await self._ready()
        except _OPENING_ERRORS as error:
            failure = unavailable(f"RabbitMQ at {self._display} unavailable: {_describe(error)}")
            return [failure] * len(messages)
        sent = await asyncio.gather(*(self._send(lane, m, deadline) for m in messages))
        lost = [m for m, r in zip(messages, sent, strict=True) if isinstance(r, _ChannelLost)]
        retried = iter(await self._one_by_one(lost, deadline) if lost else [])
        return [next(retried) if isinstance(r, _ChannelLost) else r for r in sent]

    async def _ready(self) -> _Lane:
        async with self._lock:
            if self._lane is None or self._lane.channel.is_closed:
                self._lane = await self._open_lane()
            return self._lane

    async def _open_lane(self) -> _Lane:
        connection = self._connection
        if connection is None or not _alive(connection):
            await _close_quietly(connection, self._timeout)
            self._connection = None
            connection = self._connection = await _connect(self._url, self._timeout)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        if not self._exchange:
            return _Lane(channel, channel.default_exchange)
        return _Lane(channel, await channel.get_exchange(self._exchange, ensure=False))

    async def _check_exchange(self) -> None:
        if self._exchange and self._connection is not None:
            # A passive declare of a missing exchange closes its channel: use a spare one.
            async with self._connection.channel() as channel:
                await channel.get_exchange(self._exchange, ensure=True)

    async def _send(
        self, lane: _Lane, message: StoredMessage, deadline: float
    ) -> PublishResult | _ChannelLost:
        try:
            outgoing, routing_key = self._encode(message)
        except MessageError as error:  # a stored row's header poses as the envelope's
            return permanent(str(error))
        if len(routing_key.encode()) > MAX_ROUTING_KEY_BYTES:
            return permanent(f"routing key {routing_key[:40]!r}... is longer than 255 bytes")
        try:
            async with asyncio.timeout_at(deadline):
                await lane.exchange.publish(outgoing, routing_key, mandatory=True)
        except asyncio.CancelledError as error:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the call itself is cancelled, not just the confirm it waited for
            return self._lost(error)
        except Exception as error:  # noqa: BLE001 - _failure re-raises what it does not know
            return self._failure(routing_key, error)
        return ACKED

    def _failure(self, routing_key: str, error: Exception) -> PublishResult | _ChannelLost:
        if isinstance(error, PublishError):
            return permanent(
                f"unroutable: no queue bound for routing key {routing_key!r} on exchange "
                f"{self._exchange!r} ({_describe(error)})"
            )
        if isinstance(error, DeliveryError):
            return transient(f"RabbitMQ refused to confirm: {_describe(error)}")
        if isinstance(error, TimeoutError):
            return timed_out(f"no confirm from RabbitMQ within {self._timeout:g} s")
        if isinstance(error, ChannelClosed | ChannelInvalidStateError):
            return self._lost(error)
        if isinstance(error, _CONNECTION_ERRORS):
            return unavailable(f"connection to RabbitMQ lost: {_describe(error)}")
        if isinstance(error, TypeError | ValueError):  # pamqp cannot encode it, nor ever will
            return permanent(f"RabbitMQ cannot carry this message: {_describe(error)}")
        raise error

    def _lost(self, error: BaseException) -> PublishResult | _ChannelLost:
        if not _alive(self._connection):
            return unavailable(f"connection to RabbitMQ lost: {_describe(error)}")
        return _ChannelLost(_describe(error))

    async def _one_by_one(
        self, messages: Sequence[StoredMessage], deadline: float
    ) -> list[PublishResult]:
        """Send each message alone on a private channel; one that closes it is to blame."""
        results: list[PublishResult] = []
        lane: _Lane | None = None
        try:
            for message in messages:
                try:
                    async with asyncio.timeout_at(deadline):
                        if lane is None or lane.channel.is_closed:
                            lane = await self._private_lane()
                except _OPENING_ERRORS as error:
                    results.append(unavailable(f"cannot reopen a channel: {_describe(error)}"))
                    continue
                result = await self._send(lane, message, deadline)
                if isinstance(result, _ChannelLost):
                    result = permanent(f"RabbitMQ closed the channel over it: {result.error}")
                results.append(result)
        finally:
            if lane is not None and not lane.channel.is_closed:
                with contextlib.suppress(*_OPENING_ERRORS):
                    await lane.channel.close()
        return results

    async def _private_lane(self) -> _Lane:
        async with self._lock:
            try:
                return await self._open_lane()
            except _OPENING_ERRORS:
                # aiormq may still write to a channel the broker closed, which makes the
                # broker close the whole connection (504 CHANNEL_ERROR): connect again.
                await _close_quietly(self._connection, self._timeout)
                self._connection, self._lane = None, None
                return await self._open_lane()


async def _declare(connection: AbstractConnection, topology: Topology) -> list[Declared]:
    declared: list[Declared] = []
    async with connection.channel() as channel:
        exchange: AbstractExchange = channel.default_exchange
        if topology.exchange:
            found = await _exists(connection, "exchange", topology.exchange)
            exchange = await channel.declare_exchange(
                topology.exchange, topology.exchange_type, durable=True, passive=found
            )
            declared.append(_declared("exchange", topology.exchange, found))
        if topology.queue is None:
            return declared
        found = await _exists(connection, "queue", topology.queue)
        queue = await channel.declare_queue(topology.queue, durable=True, passive=found)
        declared.append(_declared("queue", topology.queue, found))
        if topology.exchange:
            await queue.bind(exchange, topology.key())
            name = f"{topology.exchange} -> {topology.queue} ({topology.key()!r})"
            declared.append(Declared("binding", name, Presence.ENSURED))
    return declared


async def _exists(connection: AbstractConnection, kind: str, name: str) -> bool:
    """Whether the exchange or queue exists: a passive declare on a spare channel, as a
    missing one closes the channel it was asked on."""
    try:
        async with connection.channel() as channel:
            if kind == "exchange":
                await channel.get_exchange(name, ensure=True)
            else:
                await channel.get_queue(name, ensure=True)
    except ChannelNotFoundEntity:
        return False
    return True


def _declared(kind: str, name: str, found: bool) -> Declared:
    return Declared(kind, name, Presence.EXISTED if found else Presence.CREATED)
