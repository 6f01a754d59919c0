"""Kafka publisher (aiokafka): every message confirmed with acks=all.

    kafka://HOST:PORT[,HOST:PORT...]?timeout=5&idempotence=auto

Options:
    source            CloudEvents `source` attribute (default "relaybox").
    timeout           seconds a publish() call waits for its confirms, and aiokafka's
                      request timeout (default 5); what is unconfirmed by then is transient.
    idempotence       auto|true|false (default auto): the idempotent producer, where the
                      broker grants producer ids (auto asks it once at start; tansu does not).
    client_id         Kafka client id (default "relaybox").
    compression       none|gzip|snappy|lz4|zstd (default none).
    max_request_size  bytes; a larger record fails permanently (default 1048576).
    security_protocol PLAINTEXT|SSL (default PLAINTEXT). SSL verifies the brokers'
                      certificates against the system CAs, or `ssl_cafile`.
    ssl_cafile        a PEM file of the CA certificates that sign the brokers'.
    ssl_certfile      with ssl_keyfile: PEM files of a client certificate and its key,
                      for brokers that authenticate clients by certificate.

Topology, for `relaybox setup` (and `relaybox relay --setup-topology`):
    topics            topics to create if they do not exist (comma-separated) ...
    partitions        ... with this many partitions each (default 1) ...
    replication       ... and this replication factor (default 1).
A topic that exists is left as it is, its partitions unchecked.

    kafka://broker.example:9093?security_protocol=SSL&ssl_cafile=/etc/kafka/ca.pem

A kafka:// URL takes no `user:password@`: relaybox does not authenticate to Kafka with
SASL, and refuses credentials rather than ignore them; authenticate with a client
certificate instead.

The record key is the message key (so a key stays in one partition), the value is the
payload, and the CloudEvents Kafka binding in binary mode puts the attributes in
`ce_<name>` headers and the content type in `content-type`; the message's own headers
travel beside them. A message too large, for an invalid topic name, with a header that
takes a name of the envelope (`relaybox.core.envelope`) or refused for authorisation
fails permanently; connection loss and leader moves are transient; no
answer in time is transient without an attempt counted (the broker may hold it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import ssl
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.protocol.transaction import InitProducerIdRequest

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
from relaybox.errors import (
    BrokerError,
    BrokerUnavailableError,
    ConfigurationError,
    InvalidHeadersError,
)
from relaybox.publishers.options import BrokerUrl

PREFIX = "ce_"
DEFAULT_PORT = 9092
_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")
_IDEMPOTENCE = ("auto", "true", "false")
_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL")

#: Errors no retry can fix: the record, its topic or our rights are at fault.
_PERMANENT: tuple[type[BaseException], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.ClusterAuthorizationFailedError,
    kafka_errors.InvalidTimestampError,
    kafka_errors.UnsupportedForMessageFormatError,
    kafka_errors.PolicyViolationError,
)

#: No broker could be reached: nothing is known about the record.
_UNREACHABLE: tuple[type[BaseException], ...] = (
    kafka_errors.KafkaConnectionError,
    kafka_errors.NodeNotReadyError,
)


#: No answer in time: the broker may have written the record.
_NO_ANSWER: tuple[type[BaseException], ...] = (
    kafka_errors.KafkaTimeoutError,
    kafka_errors.RequestTimedOutError,
)


def from_url(url: BrokerUrl) -> KafkaPublisher:
    if "@" in url.parts.netloc:
        raise ConfigurationError(
            f"{url.masked()}: a kafka:// URL takes no user or password (relaybox does not "
            "authenticate to Kafka with SASL); remove them, and authenticate with a client "
            "certificate: security_protocol=SSL&ssl_certfile=PATH&ssl_keyfile=PATH"
        )
    idempotence = url.text("idempotence", "auto").lower()
    if idempotence not in _IDEMPOTENCE:
        raise ConfigurationError(
            f"kafka:// option idempotence={idempotence!r}: use auto|true|false"
        )
    return KafkaPublisher(
        bootstrap_servers(url),
        source=url.source,
        timeout=url.number("timeout", 5.0, minimum=0.1),
        idempotence=idempotence,
        client_id=url.text("client_id", "relaybox"),
        compression=url.optional_text("compression"),
        max_request_size=url.number("max_request_size", 1048576, minimum=1024),
        ssl_context=tls_context(url),
        topics=topics_of(url),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Topics:
    """The topics a target needs, with the partitions and replicas of a new one."""

    names: tuple[str, ...] = ()
    partitions: int = 1
    replication: int = 1


def topics_of(url: BrokerUrl) -> Topics:
    """The URL's `topics`, `partitions` and `replication`."""
    names = tuple(t.strip() for t in url.text("topics", "").split(",") if t.strip())
    for name in names:
        if not valid_topic(name):
            raise ConfigurationError(f"kafka:// option topics: {name[:60]!r} is no topic name")
    return Topics(
        names,
        url.number("partitions", 1, minimum=1),
        url.number("replication", 1, minimum=1),
    )


def tls_context(url: BrokerUrl) -> ssl.SSLContext | None:
    """The TLS context the URL's `security_protocol` and `ssl_*` options ask for (None:
    plaintext)."""
    protocol = url.text("security_protocol", "PLAINTEXT").upper()
    files = {name: url.optional_text(f"ssl_{name}") for name in ("cafile", "certfile", "keyfile")}
    if protocol not in _SECURITY_PROTOCOLS:
        raise ConfigurationError(
            f"kafka:// option security_protocol={protocol}: use PLAINTEXT or SSL (relaybox "
            "does not authenticate to Kafka with SASL; use a client certificate)"
        )
    if protocol == "PLAINTEXT":
        if any(files.values()):
            raise ConfigurationError("kafka:// ssl_* options need security_protocol=SSL")
        return None
    if (files["certfile"] is None) != (files["keyfile"] is None):
        raise ConfigurationError("kafka:// options ssl_certfile and ssl_keyfile go together")
    try:
        context = ssl.create_default_context(cafile=files["cafile"])
        if files["certfile"] is not None:
            context.load_cert_chain(files["certfile"], files["keyfile"])
    except (OSError, ssl.SSLError) as error:
        raise ConfigurationError(f"kafka:// TLS files: {error}") from None
    return context


def bootstrap_servers(url: BrokerUrl) -> str:
    """`host:port,...` from the URL, each host with Kafka's default port if it has none."""
    hosts = url.parts.netloc.rpartition("@")[2]
    servers = [h if ":" in h else f"{h}:{DEFAULT_PORT}" for h in hosts.split(",") if h]
    return ",".join(servers) or f"127.0.0.1:{DEFAULT_PORT}"


def valid_topic(topic: str) -> bool:
    return _TOPIC.fullmatch(topic) is not None and topic not in {".", ".."}


def wire_headers(message: StoredMessage, source: str) -> list[tuple[str, bytes]]:
    found = envelope.headers(message, PREFIX, source)
    found["content-type"] = message.content_type  # the binding's datacontenttype
    return [(name, value.encode("utf-8")) for name, value in found.items()]


def classify(error: BaseException) -> PublishResult:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, _PERMANENT):
        return permanent(text)
    if isinstance(error, _NO_ANSWER):
        return timed_out(text)
    return unavailable(text) if isinstance(error, _UNREACHABLE) else transient(text)


class KafkaPublisher:
    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        source: str = envelope.DEFAULT_SOURCE,
        timeout: float = 5.0,
        idempotence: str = "auto",
        client_id: str = "relaybox",
        compression: str | None = None,
        max_request_size: int = 1048576,
        ssl_context: ssl.SSLContext | None = None,
        topics: Topics | None = None,
    ) -> None:
        """`ssl_context`: connect over TLS with it (None: plaintext)."""
        self.bootstrap_servers = bootstrap_servers
        self._topics = topics or Topics()
        self._source = source
        self._timeout = timeout
        self._idempotence = idempotence
        self._settings: dict[str, Any] = {
            "client_id": client_id,
            "compression_type": compression,
            "max_request_size": max_request_size,
            "security_protocol": "PLAINTEXT" if ssl_context is None else "SSL",
            "ssl_context": ssl_context,
        }
        self._producer: AIOKafkaProducer | None = None
        #: Whether the running producer is idempotent (known after start()).
        self.idempotent = False

    def _new_producer(self, idempotent: bool) -> AIOKafkaProducer:
        return AIOKafkaProducer(
            bootstrap_servers=self.bootstrap_servers,
            acks="all",
            enable_idempotence=idempotent,
            # A batch that finds no broker within the timeout fails instead of waiting.
            request_timeout_ms=int(self._timeout * 1000),
            retry_backoff_ms=100,
            **self._settings,
        )

    async def setup_topology(self) -> list[Declared]:
        """Create the URL's topics that do not exist."""
        if not self._topics.names:
            return []
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.bootstrap_servers,
            client_id=self._settings["client_id"],
            request_timeout_ms=int(self._timeout * 1000),
            security_protocol=self._settings["security_protocol"],
            ssl_context=self._settings["ssl_context"],
        )
        try:
            await admin.start()
        except kafka_errors.KafkaError as error:
            await admin.close()
            raise BrokerUnavailableError(
                f"cannot connect to Kafka at {self.bootstrap_servers}: {error}"
            ) from error
        try:
            return [await self._create(admin, name) for name in self._topics.names]
        except kafka_errors.BrokerResponseError as error:  # refused: not allowed, bad count
            raise BrokerError(f"Kafka at {self.bootstrap_servers} refused: {error}") from error
        except kafka_errors.KafkaError as error:
            raise BrokerUnavailableError(
                f"Kafka at {self.bootstrap_servers} failed: {error}"
            ) from error
        finally:
            await admin.close()

    async def _create(self, admin: AIOKafkaAdminClient, name: str) -> Declared:
        topic = NewTopic(name, self._topics.partitions, self._topics.replication)
        response = await admin.create_topics([topic])
        ((_, code, *detail),) = response.topic_errors  # (topic, error code, [message])
        if code == kafka_errors.TopicAlreadyExistsError.errno:
            return Declared("topic", name, Presence.EXISTED)
        if code:
            error = kafka_errors.for_code(code)
            raise BrokerError(
                f"Kafka at {self.bootstrap_servers} refused topic {name!r}: "
                f"{error.__name__} {detail[0] if detail else ''}".rstrip()
            )
        return Declared("topic", name, Presence.CREATED)

    async def start(self) -> None:
        if self._idempotence == "true":
            self._producer, self.idempotent = await self._connect(idempotent=True), True
            return
        producer = await self._connect(idempotent=False)
        if self._idempotence == "auto" and await _grants_producer_ids(producer):
            await producer.stop()
            producer, self.idempotent = await self._connect(idempotent=True), True
        self._producer = producer

    async def _connect(self, *, idempotent: bool) -> AIOKafkaProducer:
        producer = self._new_producer(idempotent)
        try:
            await producer.start()
        except kafka_errors.BrokerResponseError as error:
            await producer.stop()
            hint = "; it grants no producer ids: use idempotence=auto" if idempotent else ""
            raise BrokerError(
                f"Kafka at {self.bootstrap_servers} refused the producer: {error}{hint}"
            ) from error
        except kafka_errors.KafkaError as error:
            await producer.stop()
            raise BrokerUnavailableError(
                f"cannot connect to Kafka at {self.bootstrap_servers}: {error}"
            ) from error
        return producer

    async def close(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            with contextlib.suppress(TimeoutError):  # brokers that do not answer
                async with asyncio.timeout(2 * self._timeout):
                    await producer.stop()  # flushes; unconfirmed batches expire

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if self._producer is None:
            raise ConfigurationError("KafkaPublisher.publish called before start()")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        # Every record goes into aiokafka's batches before any confirm is awaited.
        sent = [await self._send(self._producer, m, deadline) for m in messages]
        futures = [s for s in sent if isinstance(s, asyncio.Future)]
        if futures:
            await asyncio.wait(futures, timeout=max(0.0, deadline - loop.time()))
        outcomes = [self._outcome(s) if isinstance(s, asyncio.Future) else s for s in sent]
        answered = [o for o in outcomes if isinstance(o, PublishResult)]
        if len(answered) == len(outcomes):
            return answered
        down: PublishResult | None = None
        if not any(r.acked for r in answered) and not await self._reachable():
            # aiokafka keeps a record waiting while no broker answers, so an outage shows
            # only as timeouts: a TCP probe of the bootstrap servers tells them apart.
            down = unavailable(f"no Kafka broker at {self.bootstrap_servers} accepts connections")
        return [o if isinstance(o, PublishResult) else down or timed_out(o.error) for o in outcomes]

    async def _reachable(self) -> bool:
        """Whether any bootstrap server accepts a TCP connection (within a second)."""
        for server in self.bootstrap_servers.split(","):
            host, _, port = server.rpartition(":")
            try:
                async with asyncio.timeout(1.0):
                    _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            except (OSError, TimeoutError, ValueError):
                continue
            writer.close()
            return True
        return False

    async def _send(
        self, producer: AIOKafkaProducer, message: StoredMessage, deadline: float
    ) -> PublishResult | _NoAnswer | asyncio.Future[Any]:
        if not valid_topic(message.topic):
            return permanent(f"invalid Kafka topic name {message.topic!r}")
        try:
            key = message.key.encode("utf-8") if message.key is not None else None
            headers = wire_headers(message, self._source)
        except InvalidHeadersError as error:  # a stored row's header poses as the envelope's
            return permanent(str(error))
        except UnicodeEncodeError as error:  # a stored row's text that is not Unicode
            return permanent(f"the record cannot be sent as UTF-8: {error}")
        try:
            # send() waits for the topic's metadata and for room in aiokafka's buffer.
            async with asyncio.timeout_at(deadline):
                future: asyncio.Future[Any] = await producer.send(
                    message.topic, message.payload, key=key, headers=headers
                )
        except TimeoutError:
            return _NoAnswer(f"Kafka took no record for {message.topic!r} within {self._timeout}s")
        except kafka_errors.KafkaError as error:
            return classify(error)
        future.add_done_callback(_retrieve)
        return future

    def _outcome(self, future: asyncio.Future[Any]) -> PublishResult | _NoAnswer:
        if not future.done():
            return _NoAnswer(f"no confirm from Kafka within {self._timeout}s")
        error = future.exception()
        return ACKED if error is None else classify(error)


async def _grants_producer_ids(producer: AIOKafkaProducer) -> bool:
    """Ask the broker for a producer id, as the idempotent producer would at start."""
    try:
        node = producer.client.get_random_node()
        response = await producer.client.send(node, InitProducerIdRequest(None, 60000))
    except kafka_errors.KafkaError:
        return False
    return int(response.error_code) == 0


@dataclasses.dataclass(frozen=True, slots=True)
class _NoAnswer:
    """A record Kafka neither took nor confirmed in time: a transient failure, or the
    broker unreachable (publish tells which)."""

    error: str


def _retrieve(future: asyncio.Future[Any]) -> None:
    # A confirm that arrives after publish() gave up must not be logged as unretrieved.
    if not future.cancelled():
        future.exception()
