"""`Outbox`: write messages in the caller's transaction, sync or async."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from relaybox.core.identifiers import DEFAULT_TABLE, notify_channel, validate_table_name
from relaybox.core.message import Message, Target
from relaybox.core.payload import DEFAULT_MAX_PAYLOAD_BYTES, check_size
from relaybox.core.records import InsertRow, Routing
from relaybox.errors import ConfigurationError, MessageError, SchemaError
from relaybox.sql.inserts import Statement, basic_insert, inserts
from relaybox.writer.connections import (
    Channel,
    async_channel,
    missing_table,
    no_transaction,
    sync_channel,
)

logger = logging.getLogger(__name__)

CommitListener = Callable[[Sequence[Message]], None]

#: Seconds between two NOTIFYs from one `Outbox` when `notify=True`.
DEFAULT_NOTIFY_INTERVAL = 0.05


class Outbox:
    """Writes messages into the outbox table through the caller's connection or session.

    `add` and `add_async` join whatever transaction the connection is in and never
    commit, roll back or close it: the messages become visible exactly when the
    caller's business rows do. Every message is validated before the first statement
    runs, so bad input raises a `MessageError` and leaves the transaction as it was.

    A connection in autocommit mode with no transaction open (psycopg's autocommit=True,
    asyncpg outside `transaction()`, sqlite3 with isolation_level=None, a MySQL session
    with autocommit on, an AUTOCOMMIT SQLAlchemy engine, Django outside `atomic()`) would
    commit the messages on their own, apart from the business rows: the one thing an
    outbox exists to prevent. `add` refuses it with a `NoTransactionError`, asking only
    the driver's in-process state; `allow_autocommit=True` lets a caller who means it
    write anyway. (A connection that is not in autocommit mode, such as psycopg's
    default, begins a transaction at its first statement: that is the caller's.)

    `notify` wakes relays that LISTEN on PostgreSQL (`relaybox.storage.pg_listen`):
    when on, an add through a PostgreSQL connection also NOTIFYs the table's channel
    (`notify_channel`, which states what a relay must do on a wake-up), inside the same
    INSERT, so it costs no round trip and is sent only if the caller commits. NOTIFY
    takes a database-wide lock at commit, so it is debounced: at most one add per
    `notify_interval` seconds per `Outbox` carries it. `True` means every
    `DEFAULT_NOTIFY_INTERVAL` (0.05 s), a number sets the interval (0: every add).
    Other databases ignore it. Leave it off if you use two-phase commit (PostgreSQL
    cannot PREPARE a transaction that notified).

    It is off by default because its cost grows with the number of writer processes
    (each has its own `Outbox`, so up to 20 NOTIFYs a second each): measured with
    `benchmarks/writer_overhead.py`, the debounced NOTIFY is within noise for 4 writer
    processes and cost about 2% of their throughput at 12; a NOTIFY on every
    transaction costs clearly more. A relay in another process does not need it to keep
    up with a stream: once it has found a message it reads again within a millisecond or
    so for as long as messages keep coming (`RelaySettings.fast_poll_window`). What the
    NOTIFY buys is the first message after a quiet spell, published at once instead of
    at the relay's next idle poll (up to its `idle_interval`, 1 s). Turn it on where a
    few writer processes share the database and that first message's latency matters
    (docs/benchmarks.md, "Commit-to-publish latency across processes").
    """

    def __init__(
        self,
        *,
        table: str = DEFAULT_TABLE,
        targets: Iterable[str | Target] | None = None,
        default_targets: Iterable[str] | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        notify: bool | float = False,
    ) -> None:
        self.table = validate_table_name(table)
        self.routing = Routing.of(targets, default_targets)
        if type(max_payload_bytes) is not int or max_payload_bytes < 1:  # bool is no size
            raise ConfigurationError(
                f"max_payload_bytes={max_payload_bytes!r}: give a positive number of bytes"
            )
        self.max_payload_bytes = max_payload_bytes
        self.notify_interval = _notify_interval(notify)
        self.notify_channel = notify_channel(self.table)
        self._next_notify = 0.0  # time.monotonic() from which the next add notifies
        self._listeners: list[CommitListener] = []
        # Where a message that names no target goes when that is one target, not
        # external: then a single message may take sql.inserts.basic_insert.
        defaults = [self.routing.targets[name] for name in self.routing.default_targets]
        only = defaults[0] if len(defaults) == 1 and not defaults[0].external else None
        self._only_target = None if only is None else only.name

    def rows(self, messages: Message | Iterable[Message]) -> tuple[list[Message], list[InsertRow]]:
        """Validate `messages` against this outbox and turn them into rows; no I/O."""
        limit = self.max_payload_bytes
        if isinstance(messages, Message):  # the usual add: no copy, no loop
            if len(messages.body) > limit:
                check_size(messages.body, limit)
            batch = [messages]
            return batch, self.routing.rows(batch)
        if not isinstance(messages, Iterable):
            raise MessageError(
                f"expected a relaybox.Message or an iterable of them, got {type(messages).__name__}"
            )
        batch = list(messages)
        for message in batch:
            if isinstance(message, Message) and len(message.body) > limit:
                check_size(message.body, limit)
        return batch, self.routing.rows(batch)

    def add(
        self,
        connection: Any,
        messages: Message | Iterable[Message],
        *,
        allow_autocommit: bool = False,
    ) -> list[Message]:
        """Write `messages` through a sync connection or session, in its transaction."""
        batch, rows = self._checked(messages)
        if batch:
            channel = sync_channel(connection)
            if not allow_autocommit and channel.alone():
                raise no_transaction(connection, "Outbox.add")
            notify = None if self.notify_interval is None else self._take_notify(channel.dialect)
            try:
                for query, params in self._statements(channel, batch, rows, notify):
                    channel.execute(query, params)
            except BaseException as error:
                self._give_back_notify(notify)
                self._raise_if_missing(error, channel.dialect)
                raise
        return batch

    async def add_async(
        self,
        connection: Any,
        messages: Message | Iterable[Message],
        *,
        allow_autocommit: bool = False,
    ) -> list[Message]:
        """Write `messages` through an async connection or session, in its transaction."""
        batch, rows = self._checked(messages)
        if batch:
            channel = await async_channel(connection)
            if not allow_autocommit and channel.alone():
                raise no_transaction(connection, "Outbox.add_async")
            notify = None if self.notify_interval is None else self._take_notify(channel.dialect)
            try:
                for query, params in self._statements(channel, batch, rows, notify):
                    await channel.execute(query, params)
            except BaseException as error:
                self._give_back_notify(notify)
                self._raise_if_missing(error, channel.dialect)
                raise
        return batch

    def _raise_if_missing(self, error: BaseException, dialect: str) -> None:
        """A missing outbox table (the first error of a service that never migrated)
        becomes a `SchemaError` that says what to do. Every other database error stays
        the driver's own, so the application's retry rules (deadlocks, serialization
        failures) still see what they expect."""
        if not missing_table(error):
            return
        aborted = " The failed statement aborted the transaction: roll it back." * (
            dialect == "postgresql"
        )
        raise SchemaError(
            f"the outbox table {self.table} (or a table beside it) does not exist in this "
            f"connection's database: create it with `relaybox migrate --db URL --table "
            f"{self.table}` (or `relaybox schema` for your own migrations). Nothing was "
            f"written.{aborted}"
        ) from error

    def _checked(
        self, messages: Message | Iterable[Message]
    ) -> tuple[list[Message], list[InsertRow] | None]:
        """`rows`, except that a single message to the only default target is checked
        but not made into a row yet: on PostgreSQL it takes `basic_insert`."""
        if isinstance(messages, Message) and messages.targets is None and self._only_target:
            if len(messages.body) > self.max_payload_bytes:
                check_size(messages.body, self.max_payload_bytes)
            return [messages], None
        return self.rows(messages)  # no rows exactly when no messages

    def _statements(
        self,
        channel: Channel,
        batch: list[Message],
        rows: list[InsertRow] | None,
        notify: str | None,
    ) -> Sequence[Statement]:
        if rows is None:
            if channel.dialect == "postgresql":
                statement = basic_insert(
                    self.table, channel.style, batch[0], cast(str, self._only_target),
                    notify, channel.text_values,
                )  # fmt: skip
                if statement is not None:
                    return (statement,)
            rows = self.routing.rows(batch)
        return inserts(
            channel.dialect, self.table, channel.style, rows,
            notify=notify, text_values=channel.text_values,
        )  # fmt: skip

    def _take_notify(self, dialect: str) -> str | None:
        """The channel to NOTIFY with this add, if it is PostgreSQL and the interval is up.

        Unlocked on purpose: two threads racing here send one NOTIFY too many, harmless.
        """
        if self.notify_interval is None or dialect != "postgresql":
            return None
        now = time.monotonic()
        if now < self._next_notify:
            return None
        self._next_notify = now + self.notify_interval
        return self.notify_channel

    def _give_back_notify(self, notify: str | None) -> None:
        """The statement that carried the NOTIFY failed: let the next add send one."""
        if notify is not None:
            self._next_notify = 0.0

    # -- post-commit hand-off to a relay in this process ----------------------------
    # A relay in this process subscribes here; integrations that can see the commit
    # (SQLAlchemy's after_commit, Django's on_commit) call `committed`. The database
    # stays the truth: a lost signal only delays a message until the next poll.

    def subscribe(self, listener: CommitListener) -> Callable[[], None]:
        """Call `listener` with messages whose transaction committed; returns unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def committed(self, messages: Sequence[Message]) -> None:
        """Announce that `messages` were committed (called after the caller's commit)."""
        for listener in list(self._listeners):
            try:
                listener(messages)
            except Exception:  # a listener must never break the caller's request
                logger.exception("commit listener failed", extra={"action": "notify"})


def _notify_interval(notify: bool | float) -> float | None:
    """`Outbox(notify=...)` as seconds between NOTIFYs, or None for off."""
    if notify is True:
        return DEFAULT_NOTIFY_INTERVAL
    if notify is False:
        return None
    if not isinstance(notify, int | float) or not 0 <= notify < math.inf:
        raise ConfigurationError(
            f"notify={notify!r}: pass True, False or the seconds between NOTIFYs (>= 0)"
        )
    return float(notify)
