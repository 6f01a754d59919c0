"""Kafka consumer (aiokafka): a consumer group, offsets committed only after the commit.

    consumer = KafkaConsumer("127.0.0.1:9092", Consumer(handle, inbox=..., ...),
                             topics=["orders"], group_id="billing")
    async with consumer:
        ...

The consumer joins `group_id` with `enable_auto_commit=False` and
`auto_offset_reset="earliest"` (a new group starts at the beginning of each partition).
Several `KafkaConsumer`s in one group share the topics' partitions (Kafka's competing
consumers). Each poll takes up to `prefetch` records (waiting `fetch_timeout` for them);
each assigned partition is processed in offset order, one record at a time, by a task
of its own: while it works, the partition is paused (nothing more is fetched for it),
so a slow or retrying partition holds up only itself and every key keeps its order; the
other partitions go on.

Verdicts, settled only after `Consumer.process` returned (after the database commit):
    ACK     commit offset + 1 for the record's partition (one OffsetCommit per record).
            A commit that fails (a rebalance took the partition away, the broker is
            gone) is logged: the next owner, or this consumer after a restart, starts
            from the last committed offset and the inbox acknowledges the copies as
            duplicates.
    RETRY   seek the partition back to the record's offset and resume it after a
            backoff (`retry_delay`, doubled per consecutive failure of that record up
            to `max_retry_delay`): the broker delivers the record again, and nothing
            behind it in the partition is processed before it (per-key order).
    A record whose `max_attempts` ran out is parked in the inbox's database and
            committed past like ACK (`relaybox.inbox.consumer`).
    REJECT  logged and committed past (Kafka cannot delete one record; there is no
            dead-letter topic here): the partition goes on with the next record.

Redelivery: Kafka does not track records one by one; the group's committed offset per
partition says where the next consumer of the partition starts. A record processed but
not committed (the process died between the database commit and the offset commit, or
the partition moved to another group member) is therefore delivered again, with those
after it, and the inbox skips what was already applied. When partitions are revoked in
a rebalance, each partition's task finishes the record in hand (and commits it) before
the partition is given up.

Headers: the CloudEvents Kafka binding as `relaybox.publishers.kafka` writes it:
`ce_<name>` attributes (UTF-8 bytes), the content type in `content-type`, the message's
own headers beside them; the record key is the message key. Kafka has no delivery
count, so `Incoming.delivery_count` is None: attempts are counted in the database,
and the first record of a partition after it was assigned, which may be one that
crashed its last consumer, counts its attempt before its handler runs.

aiokafka reconnects to the cluster by itself once started (fetches wait, commits retry
until the broker is back); a poll that fails nonetheless is tried again after
`reconnect_wait`, doubled per further failure. Only the first connection must succeed,
otherwise `start()` / `run()` raise `BrokerUnavailableError`. There is no `timeout`:
joining the group takes as long as the group's rebalance does, which Kafka's own
`session_timeout`, `max_poll_interval` and `request_timeout` bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

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
from relaybox.errors import BrokerUnavailableError, ConfigurationError, EnvelopeError
from relaybox.inbox.processor import Processor
from relaybox.publishers.kafka import DEFAULT_PORT, PREFIX

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, TopicPartition

logger = logging.getLogger(__name__)

#: The binding's header for `datacontenttype`: not one of the message's own headers.
CONTENT_TYPE_HEADER = "content-type"


class KafkaRecord(Protocol):
    """What `decode` reads from a record (aiokafka's `ConsumerRecord`)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]]


def decode(record: KafkaRecord) -> Incoming:
    """The relaybox envelope of a Kafka record: the inverse of
    `relaybox.publishers.kafka.wire_headers` (attributes in `ce_` headers, the content
    type in `content-type`, the key as the record key). Kafka keeps every header a
    record was given, so an attribute (or the content type) named twice, which no
    relaybox publisher sends, is refused (`EnvelopeError`) rather than read either way."""
    received: dict[str, str] = {}
    for name, raw in record.headers or ():
        if name in received and (name.startswith(PREFIX) or name == CONTENT_TYPE_HEADER):
            raise EnvelopeError(f"Kafka header {name[:60]!r} comes twice in one record")
        if name.startswith(PREFIX):
            try:
                received[name] = (raw or b"").decode("utf-8")
            except UnicodeDecodeError:
                raise EnvelopeError(f"Kafka header {name!r} is not UTF-8") from None
        else:
            received[name] = (raw or b"").decode("utf-8", "replace")
    attributes, others = envelope.split(received, PREFIX)
    content_type = others.pop(CONTENT_TYPE_HEADER, None)
    return Incoming.from_envelope(
        attributes,
        record.value or b"",
        headers=others,
        content_type=content_type,
        topic=record.topic,
        # For a producer that keys its records without the binding's partitionkey.
        key=None if record.key is None else record.key.decode("utf-8", "replace"),
    )


def parse_servers(servers: str) -> str:
    """`host:port,...` from either that or a `kafka://host:port,...` URL (no options:
    the consumer takes them as keyword arguments)."""
    shown = mask_url(servers)
    if "://" not in servers:
        hosts = servers
    else:
        parts = urllib.parse.urlsplit(servers)
        if parts.scheme != "kafka" or parts.query or parts.path not in ("", "/"):
            raise ConfigurationError(
                f"Kafka bootstrap servers {shown!r}: give host:port[,host:port] or "
                "kafka://host:port[,...] without a path or options (pass those as "
                "KafkaConsumer keyword arguments)"
            )
        hosts = parts.netloc
    if "@" in hosts:
        raise ConfigurationError(
            f"Kafka bootstrap servers {shown!r} carry credentials, which the consumer "
            "would not use: remove them, and pass security_protocol, sasl_mechanism, "
            "sasl_plain_username, sasl_plain_password or ssl_context in `settings`"
        )
    found = [h.strip() for h in hosts.split(",") if h.strip()]
    if not found:
        raise ConfigurationError(f"no Kafka bootstrap server in {shown!r}")
    return ",".join(h if ":" in h else f"{h}:{DEFAULT_PORT}" for h in found)


@dataclasses.dataclass
class _Worker:
    """The task working through one partition's fetched records."""

    task: asyncio.Task[None]
    #: Set when the partition is being revoked: stop after the record in hand.
    stopping: asyncio.Event


class KafkaConsumer(BrokerConsumer):
    """Consume `topics` as a member of `group_id`, one task per assigned partition."""

    def __init__(
        self,
        url: str,
        consumer: Processor,
        *,
        topics: str | Iterable[str],
        group_id: str,
        client_id: str = "relaybox",
        prefetch: int = DEFAULTS.prefetch,
        fetch_timeout: float = DEFAULTS.fetch_timeout,
        retry_delay: float = DEFAULTS.retry_delay,
        max_retry_delay: float = DEFAULTS.max_retry_delay,
        reconnect_wait: float = DEFAULTS.reconnect_wait,
        max_attempts: int = DEFAULTS.max_attempts,
        session_timeout: float = 10.0,
        heartbeat_interval: float = 3.0,
        max_poll_interval: float = 300.0,
        request_timeout: float = 40.0,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        """`url` is the bootstrap servers, `host:port[,host:port]` or
        `kafka://host:port[,...]`. `settings` go to `AIOKafkaConsumer` as they are
        (security_protocol, sasl_mechanism, ssl_context...); they cannot override the
        group, commit and offset-reset settings this consumer depends on."""
        super().__init__(consumer, max_attempts=max_attempts)
        self.bootstrap_servers = parse_servers(url)
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        if not self.topics or not all(isinstance(t, str) and t for t in self.topics):
            raise ConfigurationError(f"topics={topics!r}: name at least one topic")
        if not isinstance(group_id, str) or not group_id:
            raise ConfigurationError("KafkaConsumer needs a group_id")
        check_positive(prefetch=prefetch, fetch_timeout=fetch_timeout)
        if not 0 < heartbeat_interval < session_timeout:
            raise ConfigurationError("heartbeat_interval must be shorter than session_timeout")
        reserved = {"group_id", "enable_auto_commit", "auto_offset_reset", "bootstrap_servers"}
        if settings and reserved & settings.keys():
            raise ConfigurationError(
                f"settings may not set {', '.join(sorted(reserved & settings.keys()))}"
            )
        self.group_id = group_id
        self.prefetch = prefetch
        self.fetch_timeout = fetch_timeout
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        self._delays = redelivery_policy(retry_delay, max_retry_delay)
        self.reconnect_wait = reconnect_wait
        self._reconnects = Backoff.reconnects(reconnect_wait)
        self._settings: dict[str, Any] = {
            "client_id": client_id,
            "session_timeout_ms": int(session_timeout * 1000),
            "heartbeat_interval_ms": int(heartbeat_interval * 1000),
            "max_poll_interval_ms": int(max_poll_interval * 1000),
            "request_timeout_ms": int(request_timeout * 1000),
            **(settings or {}),
        }
        self._kafka: AIOKafkaConsumer | None = None
        self._workers: dict[TopicPartition, _Worker] = {}
        #: Partitions revoked in the rebalance under way: kept paused until it ends.
        self._revoked: set[TopicPartition] = set()
        #: Partitions assigned whose first record is still to come: it may be one that
        #: crashed the partition's last consumer.
        self._fresh: set[TopicPartition] = set()
        #: Consecutive failures of the record a partition is retrying: (offset, count).
        self._failures: dict[TopicPartition, tuple[int, int]] = {}
        #: Offsets committed, per (topic, partition): what this consumer acknowledged.
        self.committed: dict[tuple[str, int], int] = {}

    # -- the main loop ----------------------------------------------------------------

    async def consume(self) -> None:
        from aiokafka.errors import KafkaError

        kafka = await self._connect()
        try:
            self.ready()
            while True:
                try:
                    batch = await kafka.getmany(
                        timeout_ms=int(self.fetch_timeout * 1000), max_records=self.prefetch
                    )
                except KafkaError as error:  # a fetch or group error; the client recovers
                    logger.error("Kafka fetch failed: %s", error,
                                 extra={"action": "kafka_fetch_failed"})  # fmt: skip
                    await self._reconnects.wait()
                    continue
                self._reconnects.succeeded()
                for partition, records in batch.items():
                    if records:
                        self._dispatch(kafka, partition, records)
        finally:
            await self._abandon()
            self._kafka = None
            await kafka.stop()

    async def _connect(self) -> AIOKafkaConsumer:
        from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
        from aiokafka.errors import KafkaError

        owner = self

        class Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
            async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
                await owner._release(revoked)

            async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
                owner._revoked.clear()  # a new assignment: its partitions start unpaused
                owner._fresh |= assigned
                logger.info("assigned %s in group %s", sorted(map(str, assigned)),
                            owner.group_id, extra={"action": "partitions_assigned"})  # fmt: skip

        kafka = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **self._settings,
        )
        kafka.subscribe(self.topics, listener=Rebalance())
        try:
            await kafka.start()  # returns once the group is joined and partitions assigned
        except KafkaError as error:
            await kafka.stop()
            raise BrokerUnavailableError(
                f"cannot consume from Kafka at {self.bootstrap_servers}: {error}"
            ) from error
        except BaseException:
            await kafka.stop()
            raise
        self._kafka = kafka
        return kafka

    def _dispatch(
        self, kafka: AIOKafkaConsumer, partition: TopicPartition, records: list[Any]
    ) -> None:
        if partition in self._workers or partition in self._revoked:
            # Paused meanwhile (by its task, or for a rebalance): not processed now. The
            # partition's position goes back to them, for whoever works on it next.
            self._seek(kafka, partition, records[0].offset)
            return
        kafka.pause(partition)
        stopping = asyncio.Event()
        task = asyncio.create_task(
            self._work(kafka, partition, records, stopping), name=f"relaybox-kafka-{partition}"
        )
        self._workers[partition] = _Worker(task, stopping)
        task.add_done_callback(functools.partial(self._finished, kafka, partition))

    def _finished(
        self, kafka: AIOKafkaConsumer, partition: TopicPartition, task: asyncio.Task[None]
    ) -> None:
        worker = self._workers.get(partition)
        if worker is not None and worker.task is task:
            del self._workers[partition]
        if not task.cancelled() and task.exception() is not None:
            logger.error("partition %s task failed", partition, exc_info=task.exception(),
                         extra={"action": "kafka_partition_failed"})  # fmt: skip
        if partition not in self._revoked and partition in kafka.assignment():
            kafka.resume(partition)

    # -- one partition ----------------------------------------------------------------

    async def _work(
        self,
        kafka: AIOKafkaConsumer,
        partition: TopicPartition,
        records: list[Any],
        stopping: asyncio.Event,
    ) -> None:
        #: The first record not settled yet: where the partition goes on from if this
        #: task stops early (a retry, a revocation, a lost commit, a crash).
        unsettled = records[0].offset
        try:
            for record in records:
                if stopping.is_set():
                    return  # revoked: the partition's next owner reads the rest
                first = partition in self._fresh
                self._fresh.discard(partition)
                verdict = await self.handle(functools.partial(decode, record), redelivered=first)
                if verdict is Verdict.RETRY:
                    await self._backoff(partition, record.offset, stopping)
                    return  # ...then read again from this record, by the broker
                self._failures.pop(partition, None)
                if verdict is Verdict.REJECT:
                    logger.error(
                        "skipped the unreadable record %s[%d] at offset %d",
                        record.topic, record.partition, record.offset,
                        extra={"action": "kafka_record_rejected"},
                    )  # fmt: skip
                unsettled = record.offset + 1
                if not await self._commit(kafka, partition, unsettled):
                    return
        finally:
            if unsettled <= records[-1].offset:
                self._seek(kafka, partition, unsettled)

    async def _commit(
        self, kafka: AIOKafkaConsumer, partition: TopicPartition, offset: int
    ) -> bool:
        """Commit `offset` (the next record to read) for `partition`: the acknowledgement.
        False when the partition is no longer ours, so its task should stop."""
        from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

        try:
            await kafka.commit({partition: offset})
        except (CommitFailedError, IllegalStateError) as error:
            logger.warning(
                "offset %d of %s not committed (%s); its next owner gets the record again "
                "and the inbox skips it", offset, partition, error,
                extra={"action": "kafka_commit_failed"},
            )  # fmt: skip
            return False
        except KafkaError as error:
            logger.warning("offset %d of %s not committed: %s", offset, partition, error,
                           extra={"action": "kafka_commit_failed"})  # fmt: skip
            return True
        self.committed[(partition.topic, partition.partition)] = offset
        return True

    def _seek(self, kafka: AIOKafkaConsumer, partition: TopicPartition, offset: int) -> None:
        from aiokafka.errors import IllegalStateError

        # Revoked meanwhile: its next owner starts from the committed offset.
        with contextlib.suppress(IllegalStateError):
            kafka.seek(partition, offset)

    async def _backoff(
        self, partition: TopicPartition, offset: int, stopping: asyncio.Event
    ) -> None:
        previous_offset, count = self._failures.get(partition, (offset, 0))
        count = count + 1 if previous_offset == offset else 1
        self._failures[partition] = (offset, count)
        with contextlib.suppress(TimeoutError):  # or cut short by a revocation
            await asyncio.wait_for(stopping.wait(), timeout=self._delays.nominal_delay(count))

    # -- rebalances and shutdown ------------------------------------------------------

    async def _release(self, revoked: set[TopicPartition]) -> None:
        """Before a rebalance: each revoked partition's task finishes (and commits) the
        record in hand, then the partition is given up."""
        self._revoked |= revoked
        if self._kafka is not None:
            assigned = self._kafka.assignment()
            self._kafka.pause(*(p for p in revoked if p in assigned))
        workers = [self._workers[p] for p in revoked if p in self._workers]
        for worker in workers:
            worker.stopping.set()
        if workers:
            await asyncio.wait([w.task for w in workers])
        for partition in revoked:
            self._failures.pop(partition, None)

    async def _abandon(self) -> None:
        """On shutdown: a record being processed is abandoned unacknowledged (its
        transaction rolled back, or committed: either way it is safe to deliver again)."""
        tasks = [worker.task for worker in self._workers.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
