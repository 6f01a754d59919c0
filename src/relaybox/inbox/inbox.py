"""`Inbox`: record a processed message in the consumer's own transaction.

The check and the record are one statement, run through the caller's connection inside
the transaction that also holds the handler's effects. Its row count answers "is this
the first copy?": 1, apply the effects; 0, a copy was already applied, skip. Because
the record is a row under a primary key, written before the effects and committed with
them, two copies of one message processed at once by two consumers cannot both apply
theirs (the subtle case): the second copy's statement waits on the first copy's
uncommitted row, then finds it committed (skip) or rolled back (apply). Nothing is
read first and decided later, so there is no window between check and record.

Two modes (docs/inbox.md says when each applies):

- ``"id"``: one row per (consumer, message id), kept for `retention` and purged in
  small batches by `purge`. Works with any delivery order; a duplicate arriving after
  the retention window is applied again.
- ``"watermark"``: one row per (consumer, source, lane) holding the highest sequence
  applied; a message at or below it is a duplicate. Nothing to purge, ever; but it is
  only correct where each lane is delivered in sequence order, since a message that
  arrives after a later one of its lane is taken for a duplicate and skipped. A lane is
  a partition (``scope="partition"``: one row per partition) or a key
  (``scope="key"``: one row per key; relaybox's per-key order makes it safe with
  relaybox's relay, where partitions are not delivered in order; keyless messages
  have no order and are deduplicated by id instead).
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Sequence
from typing import Any, Literal, cast

from relaybox import sql
from relaybox.core.identifiers import DEFAULT_INBOX, validate_table_name
from relaybox.core.incoming import MAX_ID_LENGTH, Incoming, check_text
from relaybox.core.message import Message
from relaybox.errors import ConfigurationError, EnvelopeError, InboxError, SchemaError
from relaybox.sql.params import ParamStyle, in_order, styled
from relaybox.writer.connections import (
    Channel,
    async_channel,
    in_pipeline,
    missing_table,
    no_transaction,
    sync_channel,
)

Mode = Literal["id", "watermark"]
MODES: tuple[Mode, ...] = ("id", "watermark")
Scope = Literal["partition", "key"]
SCOPES: tuple[Scope, ...] = ("partition", "key")
#: The longest consumer name (it is part of every inbox key).
MAX_CONSUMER_LENGTH = 100
#: How long processed ids are kept in "id" mode: a week, longer than any redelivery.
DEFAULT_RETENTION = datetime.timedelta(days=7)
#: Rows one `purge` call deletes at most: short enough never to hold writers up.
DEFAULT_PURGE_BATCH = 1000

_Step = tuple[str, Sequence[Any]]


class Inbox:
    """Deduplicates received messages for one consumer, in the consumer's transaction.

    `consumer` names the handler whose effects are being deduplicated: two handlers of
    one message each apply it once. `record` / `record_async` take the same connections
    and sessions as `Outbox.add` and never commit, roll back or close them; like it, they
    refuse a connection in autocommit mode with no transaction open (the record would
    commit before the effects it guards) unless passed `allow_autocommit=True`.
    """

    def __init__(
        self,
        *,
        consumer: str = "default",
        table: str = DEFAULT_INBOX,
        mode: Mode = "id",
        scope: Scope = "partition",
        retention: datetime.timedelta | float = DEFAULT_RETENTION,
        purge_batch: int = DEFAULT_PURGE_BATCH,
    ) -> None:
        if not isinstance(consumer, str) or not 0 < len(consumer) <= MAX_CONSUMER_LENGTH:
            raise ConfigurationError(
                f"consumer={consumer!r}: name it with 1-{MAX_CONSUMER_LENGTH} characters"
            )
        if mode not in MODES:
            raise ConfigurationError(f"mode={mode!r}: use 'id' or 'watermark'")
        if scope not in SCOPES:
            raise ConfigurationError(f"scope={scope!r}: use 'partition' or 'key'")
        seconds = (
            retention.total_seconds()
            if isinstance(retention, datetime.timedelta)
            else float(retention)
        )
        if not seconds > 0:
            raise ConfigurationError(f"retention={retention!r}: must be longer than zero")
        if not isinstance(purge_batch, int) or purge_batch < 1:
            raise ConfigurationError(f"purge_batch={purge_batch!r}: must be a positive integer")
        self.consumer = consumer
        self.table = validate_table_name(table)
        self.mode: Mode = mode
        self.scope: Scope = scope
        self.retention_seconds = seconds
        self.purge_batch = purge_batch

    def __repr__(self) -> str:
        scope = f", scope={self.scope!r}" if self.mode == "watermark" else ""
        return f"Inbox(consumer={self.consumer!r}, table={self.table!r}, mode={self.mode!r}{scope})"

    # -- the check ------------------------------------------------------------------

    def record(
        self, connection: Any, message: Incoming | str, *, allow_autocommit: bool = False
    ) -> bool:
        """Record `message` as processed, in the connection's transaction.

        True: this is the first copy, apply its effects in the same transaction.
        False: a copy was already applied (or is being applied by a transaction that
        has now committed): skip it, and acknowledge it to the broker.
        """
        channel = sync_channel(connection, "Inbox.record")
        _check_counts(connection)
        if not allow_autocommit and channel.alone():
            raise no_transaction(connection, "Inbox.record")
        count = 0
        try:
            for query, params in self._steps(channel, message):
                count = channel.execute(query, params)
        except Exception as error:
            self._raise_if_missing(error, channel.dialect)
            raise
        return _first_copy(count)

    async def record_async(
        self, connection: Any, message: Incoming | str, *, allow_autocommit: bool = False
    ) -> bool:
        """`record` for an async connection or session."""
        channel = await async_channel(connection, "Inbox.record")
        _check_counts(connection)
        if not allow_autocommit and channel.alone():
            raise no_transaction(connection, "Inbox.record_async")
        count = 0
        try:
            for query, params in self._steps(channel, message):
                count = await channel.execute(query, params)
        except Exception as error:
            self._raise_if_missing(error, channel.dialect)
            raise
        return _first_copy(count)

    def _raise_if_missing(self, error: Exception, dialect: str) -> None:
        """A missing inbox table (a consumer whose database was never migrated for it)
        becomes a `SchemaError` that says what to do; every other error stays the
        driver's, for the application's retry rules."""
        if missing_table(error):
            aborted = " The failed statement aborted the transaction: roll it back." * (
                dialect == "postgresql"
            )
            raise SchemaError(
                f"the inbox table {self.table} (or a table beside it) does not exist in "
                f"this connection's database: create it with `relaybox migrate --db URL "
                f"--inbox --table {self.table}` (or `relaybox schema --inbox` for your own "
                f"migrations). Nothing was recorded.{aborted}"
            ) from error

    def _steps(self, channel: Channel, message: Incoming | str) -> list[_Step]:
        if not isinstance(message, str | Incoming):
            raise _not_received(message)
        dialect, style = channel.dialect, channel.style
        lane = None if self.mode == "id" else self.lane(message)
        if lane is None:
            message_id = message if isinstance(message, str) else message.id
            _check_id(message_id)
            return [self._step(dialect, style, "claim_id", (self.consumer, message_id))]
        received = cast(Incoming, message)  # lane() refused a bare id
        sequence = cast(int, received.sequence)  # and a message without a sequence
        where = (self.consumer, received.source, lane)
        if dialect == "mysql":  # two statements: see sql/mysql/inbox/queries.sql
            guarded = (sequence, *where, sequence)
            return [
                self._step(dialect, style, "watermark_row", where),
                self._step(dialect, style, "claim_watermark", guarded),
            ]
        return [self._step(dialect, style, "claim_watermark", (*where, sequence))]

    def proof(self, message: Incoming) -> tuple[str, tuple[Any, ...]]:
        """The named statement (and its parameters) that finds the record `record` made
        for `message`: run in the same transaction after the handler, it finds nothing,
        or fails, if that transaction failed meanwhile."""
        lane = None if self.mode == "id" else self.lane(message)
        if lane is None:
            return "recorded_id", (self.consumer, message.id)
        return "recorded_watermark", (self.consumer, message.source, lane, message.sequence)

    def lane(self, message: Incoming | str) -> str | None:
        """The watermark's lane for `message`; None: a keyless message, checked by id.
        `InboxError` if the watermark cannot place it (no sequence, or no partition
        when scoped by partition)."""
        if isinstance(message, str) or message.sequence is None:
            raise InboxError(
                "the watermark inbox needs each message's sequence; this one has none (an "
                "external target's stripped envelope, or not from relaybox): use "
                "Inbox(mode='id') for it"
            )
        if self.scope == "key":
            return None if message.key is None else "k/" + message.key
        if message.partition is None:
            raise InboxError("the watermark inbox (scope='partition') needs a partition")
        return f"p/{message.partition}"

    # -- retention ------------------------------------------------------------------

    def purge(self, connection: Any) -> int:
        """Delete up to `purge_batch` ids older than the retention window; return how many.

        Run it in a short transaction of its own, again while it returns `purge_batch`.
        (Watermark mode records ids only for keyless messages with scope="key".)
        """
        channel = sync_channel(connection, "Inbox.purge")
        query, params = self._purge_step(channel)
        count: int = channel.execute(query, params)
        return count

    async def purge_async(self, connection: Any) -> int:
        """`purge` for an async connection or session."""
        channel = await async_channel(connection, "Inbox.purge")
        query, params = self._purge_step(channel)
        count: int = await channel.execute(query, params)
        return count

    def _purge_step(self, channel: Channel) -> _Step:
        seconds, limit = self.retention_seconds, self.purge_batch
        params: tuple[Any, ...] = (self.consumer, seconds, limit)
        if channel.dialect == "sqlite":  # `?` cannot repeat a parameter
            params = (self.consumer, self.consumer, seconds, limit)
        return self._step(channel.dialect, channel.style, "purge", params)

    def _step(self, dialect: str, style: ParamStyle, name: str, params: Sequence[Any]) -> _Step:
        return statement(dialect, self.table, style, name, params)


def statement(
    dialect: str, table: str, style: ParamStyle, name: str, params: Sequence[Any]
) -> _Step:
    """The named inbox query of `dialect` for `table`, with `params` in the order that
    its text for `style` takes them."""
    text, order = _text(dialect, table, style, name)
    return text, in_order(params, order)


@functools.lru_cache(maxsize=256)
def _text(
    dialect: sql.Dialect, table: str, style: ParamStyle, name: str
) -> tuple[str, tuple[int, ...] | None]:
    if dialect not in sql.DIALECTS:
        raise InboxError(f"the inbox cannot run on {dialect}")
    return styled(sql.queries(dialect, table, "inbox")[name], dialect, style)


def _not_received(message: object) -> InboxError:
    sent = (
        ": a Message is what a producer writes; record what the consumer received "
        "(the Incoming a relaybox consumer hands its handler, or Incoming.from_envelope), "
        "or str(message.id)"
    ) * isinstance(message, Message)
    return InboxError(
        f"Inbox.record takes the received message (an Incoming) or its id (a str), not "
        f"{type(message).__qualname__}{sent}"
    )


def _check_id(message_id: str) -> None:
    """An id given as it is, checked as a received message's is (`Incoming`)."""
    try:
        if not message_id:
            raise EnvelopeError("it is empty")
        check_text("it", message_id, MAX_ID_LENGTH)
    except EnvelopeError as error:
        raise InboxError(
            f"message id {message_id[:60]!r} cannot be recorded: {error} (an id is "
            f"1-{MAX_ID_LENGTH} characters of text without NUL)"
        ) from None


def _check_counts(connection: Any) -> None:
    """The answer is the row count of the check's statement: refuse, before writing
    anything, a connection that will not give it."""
    if in_pipeline(connection):
        raise InboxError(
            "the inbox's check needs its statement's row count, which psycopg gives in "
            "pipeline mode only at the pipeline's end: record the message outside "
            "`connection.pipeline()`"
        )


def _first_copy(count: int) -> bool:
    """The answer in the last statement's row count (see the dialect's inbox queries)."""
    if count < 0:
        raise InboxError(f"the inbox's check got no row count from the driver ({count})")
    return count == 1
