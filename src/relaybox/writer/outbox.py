"""`Outbox`: write messages in the caller's transaction, sync or async."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from relaybox.core.identifiers import DEFAULT_TABLE, validate_table_name
from relaybox.core.message import Message, Target
from relaybox.core.partitions import DEFAULT_PARTITIONS
from relaybox.core.payload import DEFAULT_MAX_PAYLOAD_BYTES, check_size
from relaybox.core.records import InsertRow, Routing
from relaybox.sql.inserts import inserts
from relaybox.writer.connections import async_channel, sync_channel

logger = logging.getLogger(__name__)

CommitListener = Callable[[Sequence[Message]], None]


class Outbox:
    """Writes messages into the outbox table through the caller's connection or session.

    `add` and `add_async` join whatever transaction the connection is in and never
    commit, roll back or close it: the messages become visible exactly when the
    caller's business rows do. Every message is validated before the first statement
    runs, so bad input raises a `MessageError` and leaves the transaction as it was.
    """

    def __init__(
        self,
        *,
        table: str = DEFAULT_TABLE,
        targets: Iterable[str | Target] | None = None,
        default_targets: Iterable[str] | None = None,
        partitions: int = DEFAULT_PARTITIONS,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        self.table = validate_table_name(table)
        self.routing = Routing.of(targets, default_targets, partitions)
        self.max_payload_bytes = max_payload_bytes
        self._listeners: list[CommitListener] = []

    def rows(self, messages: Message | Iterable[Message]) -> tuple[list[Message], list[InsertRow]]:
        """Validate `messages` against this outbox and turn them into rows; no I/O."""
        batch = [messages] if isinstance(messages, Message) else list(messages)
        limit = self.max_payload_bytes
        for message in batch:
            if isinstance(message, Message) and len(message.body) > limit:
                check_size(message.body, limit)
        return batch, self.routing.rows(batch)

    def add(self, connection: Any, messages: Message | Iterable[Message]) -> list[Message]:
        """Write `messages` through a sync connection or session, in its transaction."""
        batch, rows = self.rows(messages)
        if rows:
            channel = sync_channel(connection)
            for statement in inserts(channel.dialect, self.table, channel.style, rows):
                channel.execute(statement.query, statement.params)
        return batch

    async def add_async(
        self, connection: Any, messages: Message | Iterable[Message]
    ) -> list[Message]:
        """Write `messages` through an async connection or session, in its transaction."""
        batch, rows = self.rows(messages)
        if rows:
            channel = await async_channel(connection)
            for statement in inserts(channel.dialect, self.table, channel.style, rows):
                await channel.execute(statement.query, statement.params)
        return batch

    # -- post-commit hand-off (seed 001) --------------------------------------------
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
