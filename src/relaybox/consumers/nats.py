"""NATS JetStream consumer (nats-py): a durable pull consumer with explicit acks.

    consumer = NatsConsumer("nats://127.0.0.1:4222", Consumer(handle, inbox=..., ...),
                            stream="ORDERS", subject="orders.>", durable="billing")
    async with consumer:
        ...

The stream must exist (relaybox creates no streams). The durable consumer is created on
first use with explicit acks, `ack_wait` and `max_deliver`; an existing one is bound as it
is, so change its settings with the nats CLI. Several `NatsConsumer`s on one durable
share its messages (competing consumers); each fetches up to `prefetch` at a time and
processes them one by one, in stream order.

Verdicts, settled only after `Consumer.process` returned (after the commit):
    ACK     `+ACK` sent as a request (nats-py `ack_sync`): counted done once the server
            confirmed it. An ack that is lost (connection down, no reply in
            `ack_timeout`) is logged; the server redelivers after `ack_wait` and the
            inbox acknowledges the copy as a duplicate.
    RETRY   `-NAK` with a delay: `retry_delay`, doubled per delivery up to
            `max_retry_delay`, so a failing handler does not spin. The consumer goes on
            with the next messages meanwhile, so a retried message is applied after
            later messages of its key.
    REJECT  `+TERM`: the server never delivers it again.
A message whose `max_attempts` ran out is parked in the inbox's database and ACKed
(`relaybox.inbox.consumer`); with `max_deliver` set, keep it above `max_attempts`, or
the server stops delivering before the consumer parks.

Redelivery: a message fetched and not settled within `ack_wait` (the process died, the
connection dropped, a batch waited behind a slow handler) is delivered again, to this
or another instance of the durable; `Incoming.delivery_count` is JetStream's
`num_delivered`. With `max_deliver` set, the server stops redelivering after that many
deliveries (unlimited by default).

The client reconnects for as long as the consumer runs, every `reconnect_wait` seconds
(nats-py's own loop); a closed connection or a JetStream API error (the durable deleted,
the server restarted without it) makes the consumer connect and bind again after
`reconnect_wait`, doubled per further failed attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.header
import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from relaybox.consumers.base import (
    DEFAULTS,
    Backoff,
    BrokerConsumer,
    Verdict,
    check_positive,
    close_within,
    redelivery_policy,
)
from relaybox.core import envelope
from relaybox.core.incoming import Incoming
from relaybox.core.urls import mask_url
from relaybox.errors import BrokerUnavailableError, ConfigurationError, EnvelopeError
from relaybox.inbox.processor import Processor
from relaybox.publishers.nats import PREFIX

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.api import RawStreamMsg

logger = logging.getLogger(__name__)

#: Headers of the NATS binding that are not the message's own: the content type and
#: JetStream's deduplication id, both written by `relaybox.publishers.nats`.
MSG_ID_HEADER = "Nats-Msg-Id"
BINDING_HEADERS = frozenset({"content-type", MSG_ID_HEADER})

DeliverFrom = Literal["all", "new"]


def decode(message: Msg | RawStreamMsg) -> Incoming:
    """The relaybox envelope of a JetStream message (delivered, or read with `get_msg`):
    the inverse of `relaybox.publishers.nats.wire_headers`.

    nats-py hands the headers over as a dict in which a name sent twice keeps its last
    value, with names stripped of spaces: so the id JetStream deduplicated by
    (`Nats-Msg-Id`, the first of its lines) must be the id decoded (`ce-id`), or the
    message is refused (`EnvelopeError`): a header that posed as either would otherwise
    make it another message's copy.
    """
    received: Mapping[str, str] = {
        name: value if isinstance(value, str) else _header_text(value)
        for name, value in (message.headers or {}).items()
    }
    attributes, others = envelope.split(received, PREFIX)
    deduplicated = received.get(MSG_ID_HEADER)
    if deduplicated is not None and deduplicated != attributes.get("id"):
        raise EnvelopeError(
            f"message on {message.subject!r}: its {MSG_ID_HEADER} is not its ce-id, so one "
            "of them was not written by relaybox's publisher"
        )
    headers = {name: value for name, value in others.items() if name not in BINDING_HEADERS}
    return Incoming.from_envelope(
        attributes,
        message.data or b"",
        headers=headers,
        content_type=received.get("content-type"),
        topic=message.subject or "",
        delivery_count=_delivery_count(message),
    )


def _header_text(value: object) -> str:
    """A header value nats-py's `get_msg` read with the email parser, which gives a
    non-ASCII one as an email `Header`: its bytes, read as UTF-8 (as a delivered
    message's are)."""
    parts = email.header.decode_header(value)  # type: ignore[arg-type]
    raw = b"".join(part if isinstance(part, bytes) else part.encode() for part, _ in parts)
    return raw.decode("utf-8", "replace")


def _delivery_count(message: Msg | RawStreamMsg) -> int | None:
    reply = getattr(message, "reply", "")
    if not reply or not reply.startswith("$JS.ACK."):
        return None  # a stream read (get_msg) or a core NATS message: never delivered
    try:
        return int(message.metadata.num_delivered)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - a reply subject nats-py cannot read: count unknown
        return None


class NatsConsumer(BrokerConsumer):
    """Runs `consumer` on the messages of a JetStream durable pull consumer."""

    def __init__(
        self,
        url: str,
        consumer: Processor,
        *,
        stream: str,
        subject: str | None = None,
        durable: str = "relaybox",
        prefetch: int = DEFAULTS.prefetch,
        fetch_timeout: float = DEFAULTS.fetch_timeout,
        ack_wait: float = 30.0,
        ack_timeout: float = 5.0,
        max_deliver: int = -1,
        retry_delay: float = DEFAULTS.retry_delay,
        max_retry_delay: float = DEFAULTS.max_retry_delay,
        deliver: DeliverFrom = "all",
        timeout: float = DEFAULTS.timeout,
        reconnect_wait: float = DEFAULTS.reconnect_wait,
        max_attempts: int = DEFAULTS.max_attempts,
        name: str = "relaybox-consumer",
    ) -> None:
        """
        url              the NATS server, `nats://[user:password@]host:port` or `tls://`.
        stream           the JetStream stream to consume (it must exist).
        subject          a filter within the stream (default: all its subjects).
        durable          the durable consumer's name, shared by competing instances.
        prefetch         messages fetched per pull request.
        fetch_timeout    seconds a pull request waits for messages (a long poll).
        ack_wait         seconds before the server redelivers an unsettled message
                         (applies when this creates the durable).
        ack_timeout      seconds to wait for the server to confirm an ack.
        max_deliver      deliveries before the server gives up on a message (-1: never;
                         applies when this creates the durable).
        retry_delay      seconds before a RETRY is redelivered, doubled per delivery...
        max_retry_delay  ... up to this.
        deliver          "all": a new durable starts at the stream's first message;
                         "new": at the next one published.
        timeout          seconds `start()` keeps trying to connect, and each JetStream
                         API request's timeout (binding the durable).
        reconnect_wait   seconds between the client's reconnect attempts, and before
                         binding again (doubled per further failed attempt).
        name             the connection's name in the server's monitoring.
        max_attempts     attempts at a message before it is parked (and acknowledged).
        """
        super().__init__(consumer, max_attempts=max_attempts)
        if not stream or not durable:
            raise ConfigurationError("NatsConsumer needs a stream and a durable name")
        check_positive(prefetch=prefetch, fetch_timeout=fetch_timeout, ack_wait=ack_wait,
                       ack_timeout=ack_timeout, timeout=timeout)  # fmt: skip
        if deliver not in ("all", "new"):
            raise ConfigurationError(f"deliver={deliver!r}: use 'all' or 'new'")
        self.url = url
        self.stream = stream
        self.subject = subject
        self.durable = durable
        self.prefetch = prefetch
        self.fetch_timeout = fetch_timeout
        self.ack_wait = ack_wait
        self.ack_timeout = ack_timeout
        self.max_deliver = max_deliver
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        self._delays = redelivery_policy(retry_delay, max_retry_delay)
        self.deliver: DeliverFrom = deliver
        self.timeout = timeout
        self.reconnect_wait = reconnect_wait
        self._reconnects = Backoff.reconnects(reconnect_wait)
        self.name = name
        self._masked = mask_url(url)

    # -- the loop ---------------------------------------------------------------------

    async def consume(self) -> None:
        client = await self._connect()
        try:
            subscription = await self._bind(client)
            self.ready()
            while True:
                try:
                    await self._consume(subscription)
                except Exception as error:  # noqa: BLE001 - connection or API trouble: rebind
                    logger.warning(
                        "NATS consumer %s on %s interrupted: %r; binding again",
                        self.durable, self.stream, error,
                        extra={"action": "consumer_reconnect", "broker": "nats"},
                    )  # fmt: skip
                with contextlib.suppress(Exception):  # a dead subscription is gone anyway
                    await subscription.unsubscribe()
                client, subscription = await self._recover(client)
        finally:
            await close_within(client.close(), self.timeout)

    async def _consume(self, subscription: JetStreamContext.PullSubscription) -> None:
        import nats.errors

        while True:
            try:
                messages = await subscription.fetch(self.prefetch, timeout=self.fetch_timeout)
            except nats.errors.TimeoutError:
                continue  # nothing to do, or disconnected and reconnecting
            for message in messages:
                verdict = await self.handle(functools.partial(decode, message))
                await self.settle(message, verdict)

    async def settle(self, message: Msg, verdict: Verdict) -> None:
        """Tell JetStream the verdict; a settle that fails is left to `ack_wait`."""
        import nats.errors

        try:
            if verdict is Verdict.ACK:
                await message.ack_sync(timeout=self.ack_timeout)
            elif verdict is Verdict.RETRY:
                deliveries = _delivery_count(message) or 1
                await message.nak(delay=self._delays.nominal_delay(deliveries))
            else:
                await message.term()
        except (nats.errors.Error, TimeoutError) as error:
            logger.warning(
                "could not %s a message of %s: %r; JetStream redelivers it after ack_wait",
                verdict.value, self.stream, error,
                extra={"action": "settle_failed", "broker": "nats"},
            )  # fmt: skip

    # -- connecting and binding -------------------------------------------------------

    async def _connect(self) -> Client:
        from nats.aio.client import Client

        client = Client()

        async def on_error(error: Exception) -> None:
            logger.debug("nats client error: %s", error, extra={"action": "nats_error"})

        try:
            async with asyncio.timeout(self.timeout):
                # nats-py annotates these waits as int but sleeps and times out on floats.
                await client.connect(
                    servers=[self.url],
                    name=self.name,
                    error_cb=on_error,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,  # for as long as the consumer runs
                    reconnect_time_wait=self.reconnect_wait,  # type: ignore[arg-type]
                    connect_timeout=min(self.timeout, 2.0),  # type: ignore[arg-type]
                )
        except Exception as error:
            await client.close()
            raise BrokerUnavailableError(
                f"cannot connect to NATS at {self._masked}: {error!r}"
            ) from error
        return client

    async def _bind(self, client: Client) -> JetStreamContext.PullSubscription:
        """Create the durable unless it exists, then subscribe to its deliveries."""
        from nats.js.errors import NotFoundError

        js = client.jetstream(timeout=self.timeout)
        try:
            await js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            try:
                await js.add_consumer(self.stream, self._config())
            except NotFoundError as error:
                raise ConfigurationError(
                    f"no JetStream stream {self.stream!r} at {self._masked}: create it first"
                ) from error
        return await js.pull_subscribe_bind(durable=self.durable, stream=self.stream)

    async def _recover(self, client: Client) -> tuple[Client, JetStreamContext.PullSubscription]:
        """Connect again if the client gave up, and bind again, once the server answers.
        Deliveries fetched but not settled come back after `ack_wait`."""
        while True:
            await self._reconnects.wait()
            try:
                if client.is_closed:
                    client = await self._connect()
                subscription = await self._bind(client)
            except ConfigurationError:
                raise  # the stream is gone: no retry brings it back
            except Exception as error:  # noqa: BLE001 - not reachable yet: try again
                logger.debug("binding %s again failed: %r", self.durable, error,
                             extra={"action": "consumer_reconnect"})  # fmt: skip
            else:
                self._reconnects.succeeded()
                return client, subscription

    def _config(self) -> Any:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        return ConsumerConfig(
            name=self.durable,
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait,
            max_deliver=self.max_deliver,
            deliver_policy=DeliverPolicy.ALL if self.deliver == "all" else DeliverPolicy.NEW,
            filter_subject=self.subject,
        )
