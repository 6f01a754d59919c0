"""The INSERT statements that write outbox rows, per dialect, parameter style and count.

One builder for every writer of rows: `Outbox.add` (in the caller's style) and each
storage backend's own `write` (in the dialect's native style), so both take the same
key locks and chunk the same way."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

from relaybox import sql
from relaybox.core.message import Message
from relaybox.core.partitions import key_lock_id, key_lock_slot, partition_and_lock
from relaybox.core.records import InsertRow
from relaybox.sql.params import ParamStyle, in_order, row_params, styled

#: Rows per multi-row INSERT on MySQL and SQLite (16 parameters each, well under limits).
CHUNK_ROWS = 1000
#: Bytes per multi-row INSERT: under MySQL's default max_allowed_packet (16 MiB on
#: MariaDB, 64 MiB on MySQL 8), so a bulk add never kills the caller's connection.
CHUNK_BYTES = 4 * 1024 * 1024


class Statement(NamedTuple):
    # A NamedTuple, not a frozen dataclass: one is built per add, and a frozen
    # dataclass's __init__ costs a call of object.__setattr__ per field.
    query: str
    params: Sequence[Any]


_NO_IDS = (None, None, None, None)
#: Statement(query, params) calls a Python __new__; tuple.__new__ is cheaper.
_new = tuple.__new__


@functools.lru_cache(maxsize=512)
def _text(
    dialect: str, table: str, style: ParamStyle, name: str, rows: int = 1
) -> tuple[str, tuple[int, ...] | None]:
    queries = sql.queries(dialect, table)
    if name == "insert_values":
        query = queries["insert_values"] + " " + ", ".join([queries["insert_row"]] * rows)
    elif name == "lock_keys":
        marks = ", ".join(["%s"] * rows)
        query = f"{queries['lock_keys']} ({marks}) ORDER BY slot FOR UPDATE"
    else:
        query = queries[name]
    return styled(query, dialect, style)


def _statement(
    dialect: str, table: str, style: ParamStyle, name: str, params: Sequence[Any], rows: int = 1
) -> Statement:
    text, order = _text(dialect, table, style, name, rows)
    return Statement(text, in_order(params, order))


def _chunks(rows: Sequence[InsertRow]) -> list[Sequence[InsertRow]]:
    """Rows per multi-row INSERT, under both a row and a byte budget (max_allowed_packet)."""
    chunks: list[Sequence[InsertRow]] = []
    start, size = 0, 0
    for index, row in enumerate(rows):
        row_size = len(row[8]) + 512  # payload plus a generous allowance for the rest
        if index > start and (index - start >= CHUNK_ROWS or size + row_size > CHUNK_BYTES):
            chunks.append(rows[start:index])
            start, size = index, 0
        size += row_size
    chunks.append(rows[start:])
    return chunks


def inserts(
    dialect: str,
    table: str,
    style: ParamStyle,
    rows: Sequence[InsertRow],
    *,
    notify: str | None = None,
    text_values: bool = False,
) -> list[Statement]:
    """The statements that write `rows`: one for a single row, one per chunk for many.

    `notify` (PostgreSQL only) names a channel that the INSERT also NOTIFYs, in the
    same statement: see `relaybox.core.identifiers.notify_channel`. `text_values`
    (PostgreSQL, one row) passes the id, partition and key lock as text, for drivers
    that send text untyped and pay per distinct parameter type (`Channel.text_values`).
    """
    if dialect == "postgresql":
        if len(rows) == 1:
            return [_postgres_one(table, style, rows[0], notify, text_values)]
        return [_postgres_many(table, style, rows, notify)]
    if dialect == "mysql":  # writers of one key take turns (PostgreSQL does it in the INSERT)
        slots = sorted({key_lock_slot(row[4]) for row in rows if row[4] is not None})
        locks = [_statement(dialect, table, style, "lock_keys", slots, len(slots))] if slots else []
        return locks + _inserts(dialect, table, style, rows)
    return _inserts(dialect, table, style, rows)


def _postgres_many(
    table: str, style: ParamStyle, rows: Sequence[InsertRow], notify: str | None
) -> Statement:
    """Arrays, one per column, then the key-lock ids, then the channel to NOTIFY."""
    columns: list[Any] = [list(column) for column in zip(*rows, strict=True)]
    columns.append([key_lock_id(table, row[4]) for row in rows])
    name = "insert_many"
    if notify is not None:
        columns.append(notify)
        name = "insert_many_notify"
    return _statement("postgresql", table, style, name, columns)


def _postgres_one(
    table: str, style: ParamStyle, row: InsertRow, notify: str | None, text_values: bool
) -> Statement:
    """The one-row INSERT: the row's values, the key-lock id, the channel to NOTIFY.

    This runs in every business transaction that writes one message (unless it takes
    `basic_insert`), so its three texts come from one cached lookup."""
    delayed, now, basic = _one_row_texts(table, style, notify is not None)
    id_: Any = row[0]
    partition: int | str = row[5]
    lock: int | str | None = key_lock_id(table, row[4])
    if text_values:  # 32 hex digits are a valid uuid literal (and to_bytes().hex()
        # is cheaper than an f-string's formatting of a 128-bit int)
        id_, partition = id_.int.to_bytes(16).hex(), str(partition)
        lock = None if lock is None else str(lock)
    extra = () if notify is None else (notify,)
    if row[15]:  # a delay: available_at is computed from it
        return _new(Statement, (delayed, (id_, *row[1:5], partition, *row[6:], lock, *extra)))
    if not row[2] and row[9] == "{}" and row[10:14] == _NO_IDS:  # only defaults left
        values = (id_, row[1], row[3], row[4], partition, row[6], row[7], row[8], row[14])
        return _new(Statement, (basic, (*values, lock, *extra)))
    # available_at takes its default
    return _new(Statement, (now, (id_, *row[1:5], partition, *row[6:15], lock, *extra)))


def basic_insert(
    table: str,
    style: ParamStyle,
    message: Message,
    target: str,
    notify: str | None = None,
    text_values: bool = False,
) -> Statement | None:
    """PostgreSQL's insert_one_basic for `message` to `target` (not external), made from
    the message itself; None if it needs another shape (headers, ids or a delay).

    The writer's commonest add is one such message, and building an InsertRow first and
    then slicing it (Routing.rows, inserts) costs it five calls and a 16-tuple in every
    business transaction. The statement is the one `inserts` makes from the message's
    row: tests/unit/test_sql_and_routing.py holds the two to it.
    """
    if (
        message.headers
        or message.delay_seconds
        or message.correlation_id is not None
        or message.causation_id is not None
        or message.tenant_id is not None
        or message.aggregate_id is not None
    ):
        return None
    key, id_ = message.key, cast(Any, message.id)
    partition: int | str
    lock: int | str | None
    partition, lock = partition_and_lock(table, key, id_)
    if text_values:  # as in _postgres_one
        id_, partition = id_.int.to_bytes(16).hex(), str(partition)
        lock = None if lock is None else str(lock)
    query = _one_row_texts(table, style, notify is not None)[2]
    params = (id_, target, message.topic, key, partition, message.type,
              message.content_type or "", message.body, message.occurred_at, lock)  # fmt: skip
    return _new(Statement, (query, params if notify is None else (*params, notify)))


@functools.lru_cache(maxsize=256)
def _one_row_texts(table: str, style: ParamStyle, notify: bool) -> tuple[str, str, str]:
    """insert_one, insert_one_now and insert_one_basic (or their _notify twins) in `style`."""
    suffix = "_notify" if notify else ""
    texts = []
    for name in ("insert_one", "insert_one_now", "insert_one_basic"):
        text, order = _text("postgresql", table, style, name + suffix)
        if order is not None:  # each takes $1, $2 ... once, in order, in every style
            raise AssertionError(f"{name}{suffix} does not take its parameters in order")
        texts.append(text)
    return texts[0], texts[1], texts[2]


def _inserts(
    dialect: str, table: str, style: ParamStyle, rows: Sequence[InsertRow]
) -> list[Statement]:
    if len(rows) == 1:
        return [_statement(dialect, table, style, "insert_one", row_params(dialect, rows[0]))]
    statements = []
    for chunk in _chunks(rows):
        params = [value for row in chunk for value in row_params(dialect, row)]
        statements.append(_statement(dialect, table, style, "insert_values", params, len(chunk)))
    return statements
