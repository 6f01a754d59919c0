"""`LogOutbox`: write messages into PostgreSQL's write-ahead log instead of a table.

Log mode trades the outbox table for a logical replication slot. Each add runs one
`SELECT pg_logical_emit_message(true, prefix, content)` in the caller's transaction: a
transactional message is decoded only if the transaction commits, so the relay
(`relaybox relay --mode log`) sees exactly the committed messages, in commit order,
and never an uncommitted one. Nothing is inserted, so the table and its indexes take no
write, no vacuum and no read by the relay; the rows the relay could not publish are
the only ones the table ever holds (`relaybox.relay.log_stream`).

The messages are validated and routed exactly as `Outbox` does it (the same `Message`,
targets, size limit and `InsertRow`s), and the content carries those rows
(`relaybox.core.log_records`), so the relay can write any of them to the table as the
writer would have.

PostgreSQL only, and it needs `wal_level = logical` and the table's slot: a message
emitted while no slot exists would be decoded by nobody. So the emit runs only where the
table's slot exists in this database, is ready (its creation has finished, so it will
decode every transaction that emits after) and has not been invalidated (a slot past
`max_slot_wal_keep_size` decodes nothing more): `SELECT ... FROM
pg_get_replication_slots() WHERE ...`, which gives no row otherwise, and the add then
raises `ConfigurationError`, with nothing written and the caller's transaction still
usable. Create the slot before the first writer runs, with `relaybox migrate --db URL
--table NAME --log`.

Listing the slots costs the server more than the emit itself (measured: a writer
transaction at 0.87 of a plain INSERT with it, 0.97 without), so a connection whose
emit found the slot emits without the check for the next `slot_check_interval`
seconds (1 s by default; 0 checks every add). A slot that stops being there ends the
writes at each connection's next check, so drop a slot only once its writers stopped.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.log_records import encode_rows, log_prefix, log_slot
from relaybox.core.message import Message, Target
from relaybox.core.payload import DEFAULT_MAX_PAYLOAD_BYTES
from relaybox.core.records import InsertRow
from relaybox.errors import ConfigurationError
from relaybox.sql.params import ParamStyle, styled
from relaybox.writer.connections import (
    Channel,
    async_channel,
    in_pipeline,
    no_transaction,
    sync_channel,
    weak_ref,
)
from relaybox.writer.outbox import CommitListener, Outbox


class LogOutbox:
    """Writes messages as transactional logical decoding messages, through the caller's
    PostgreSQL connection or session, in its transaction.

    The same API as `Outbox` (`add`, `add_async`, `rows`, `subscribe`, `committed`),
    and the same rules: it never commits, rolls back or closes anything; bad input
    raises a `MessageError` before any statement; a connection with no transaction open
    is refused unless `allow_autocommit=True`.
    """

    def __init__(
        self,
        *,
        table: str = DEFAULT_TABLE,
        targets: Iterable[str | Target] | None = None,
        default_targets: Iterable[str] | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        slot_check_interval: float = 1.0,
    ) -> None:
        if (
            isinstance(slot_check_interval, bool)
            or not isinstance(slot_check_interval, (int, float))
            or not 0 <= slot_check_interval < float("inf")
        ):
            raise ConfigurationError(
                f"slot_check_interval={slot_check_interval!r}: must be seconds, 0 or more"
            )
        #: Seconds a connection whose emit found the slot emits without checking again.
        self.slot_check_interval = float(slot_check_interval)
        #: Per connection (by id, while it lives): until when (time.monotonic) its
        #: emits skip the slot check.
        self._checked: dict[int, tuple[weakref.ref[Any], float]] = {}
        # Validation and routing as table mode does them; this one never writes.
        self._table_mode = Outbox(
            table=table, targets=targets, default_targets=default_targets,
            max_payload_bytes=max_payload_bytes,
        )  # fmt: skip
        self.table = self._table_mode.table
        self.routing = self._table_mode.routing
        self.max_payload_bytes = max_payload_bytes
        #: The logical message prefix the table's relay reads.
        self.prefix = log_prefix(self.table)
        #: The table's slot, named once: every emit that checks it names it.
        self._slot = log_slot(self.table)

    def rows(self, messages: Message | Iterable[Message]) -> tuple[list[Message], list[InsertRow]]:
        """Validate `messages` and turn them into rows, as `Outbox.rows`; no I/O."""
        return self._table_mode.rows(messages)

    def add(
        self,
        connection: Any,
        messages: Message | Iterable[Message],
        *,
        allow_autocommit: bool = False,
    ) -> list[Message]:
        """Emit `messages` through a sync connection or session, in its transaction."""
        batch, rows = self._table_mode.rows(messages)
        if batch:
            channel = sync_channel(connection, "LogOutbox.add")
            if not allow_autocommit and channel.alone():
                raise no_transaction(connection, "LogOutbox.add")
            checked = self._must_check(connection)
            self._not_blind(connection, checked)
            count = channel.execute(self._emit(channel, checked), (encode_rows(rows),))
            self._emitted(connection, count, checked)
        return batch

    async def add_async(
        self,
        connection: Any,
        messages: Message | Iterable[Message],
        *,
        allow_autocommit: bool = False,
    ) -> list[Message]:
        """Emit `messages` through an async connection or session, in its transaction."""
        batch, rows = self._table_mode.rows(messages)
        if batch:
            channel = await async_channel(connection, "LogOutbox.add_async")
            if not allow_autocommit and channel.alone():
                raise no_transaction(connection, "LogOutbox.add_async")
            checked = self._must_check(connection)
            self._not_blind(connection, checked)
            count = await channel.execute(self._emit(channel, checked), (encode_rows(rows),))
            self._emitted(connection, count, checked)
        return batch

    def _emit(self, channel: Channel, checked: bool) -> str:
        if channel.dialect != "postgresql":
            raise ConfigurationError(
                f"LogOutbox writes into PostgreSQL's write-ahead log; this connection is "
                f"{channel.dialect}: use Outbox there"
            )
        return _emit_statement(self.prefix, self._slot, channel.style, checked)

    def _must_check(self, connection: Any) -> bool:
        """Whether this emit checks the slot: none of `connection`'s found it within
        the last `slot_check_interval` seconds."""
        known = self._checked.get(id(connection))
        return known is None or known[0]() is not connection or time.monotonic() >= known[1]

    def _forget(self, key: int) -> None:
        """A connection died: its id may be taken by a new object."""
        self._checked.pop(key, None)

    def _not_blind(self, connection: Any, checked: bool) -> None:
        """Refuse an emit that must check the slot where its answer would come too
        late: an emit that finds no ready slot emits nothing, and says so only by its
        row count, which psycopg gives in pipeline mode only at the pipeline's sync."""
        if checked and in_pipeline(connection):
            raise self._blind()

    def _blind(self) -> ConfigurationError:
        return ConfigurationError(
            f"LogOutbox checks that table {self.table!r} has a ready replication slot by "
            "the row count of its emit, which psycopg gives in pipeline mode only at the "
            "pipeline's sync, too late to refuse the message: add it outside "
            "`connection.pipeline()` (a connection whose emit found the slot there skips "
            "the check for `slot_check_interval` seconds, in pipelines too)"
        )

    def _emitted(self, connection: Any, count: int, checked: bool) -> None:
        """Refuse an emit that found no ready slot, or that cannot tell (-1: a psycopg
        pipeline behind a wrapper that `_not_blind` could not see through). One that
        found it spares the connection's next checks for a while."""
        if checked and count < 0:
            raise self._blind()
        if checked and count > 0 and self.slot_check_interval > 0:
            key = id(connection)
            known = self._checked.get(key)
            ref = known[0] if known is not None and known[0]() is connection else None
            if ref is None:
                ref = weak_ref(connection, lambda _: self._forget(key))
                if ref is None:  # not weakly referable: every emit checks
                    return
            self._checked[key] = (ref, time.monotonic() + self.slot_check_interval)
        if count == 0:
            raise ConfigurationError(
                f"table {self.table!r} has no ready replication slot "
                f"({log_slot(self.table)!r}) in this database, so nobody would read these "
                "messages; nothing was written. Create it with `relaybox migrate --db URL "
                f"--table {self.table} --log` before writing with LogOutbox"
            )

    def subscribe(self, listener: CommitListener) -> Callable[[], None]:
        """Call `listener` with messages whose transaction committed (as `Outbox`)."""
        return self._table_mode.subscribe(listener)

    def committed(self, messages: Sequence[Message]) -> None:
        """Announce that `messages` were committed (called after the caller's commit)."""
        self._table_mode.committed(messages)


@functools.lru_cache(maxsize=64)
def _emit_statement(prefix: str, slot: str, style: ParamStyle, checked: bool) -> str:
    # The prefix is `relaybox:` and a validated table name, the slot name letters,
    # digits and underscores: no quote can be in either. A slot still being created
    # has no confirmed position yet, and will not decode a transaction already running;
    # an invalidated one ('lost') decodes nothing more. The slots come from the function
    # under pg_replication_slots, without that view's join to pg_database (the dearer
    # half of the check, measured).
    query = f"SELECT pg_logical_emit_message(true, '{prefix}', $1::bytea)"
    if checked:
        query += (
            f" FROM pg_get_replication_slots() s WHERE s.slot_name = '{slot}'"
            " AND s.datoid = (SELECT d.oid FROM pg_database d"
            " WHERE d.datname = current_database())"
            " AND s.confirmed_flush_lsn IS NOT NULL AND s.wal_status IS DISTINCT FROM 'lost'"
        )
    return styled(query, "postgresql", style)[0]
