"""Outbox rows as the content of a PostgreSQL logical decoding message (log mode).

In log mode a writer does not insert its rows: it emits them into the write-ahead log
inside its transaction, `pg_logical_emit_message(true, prefix, content)`, and the relay
reads them back from a logical replication slot once the transaction has committed.
This module is the wire format between the two, and the names both sides derive from
the table: I/O-free, so the writer and the relay share one definition.

The content holds the very `InsertRow`s that `Routing.rows` makes for table mode, so a
message the relay cannot publish becomes the same row the writer would have inserted:

    b"1" b"\n" JSON metadata b"\n" payload bytes, concatenated in row order

The metadata is a JSON array with one array per row: the row's columns except the
payload, whose length takes its place, with the id as 32 hex digits and `occurred_at`
as ISO 8601. JSON (ASCII-only, so it never holds a newline) because the standard
library writes it in C: this runs inside every business transaction.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import uuid
from collections.abc import Sequence

from relaybox.core.identifiers import notify_channel, validate_table_name
from relaybox.core.records import InsertRow
from relaybox.errors import MessageError

#: The format's version, the content's first line.
FORMAT = b"1"
_HEAD = FORMAT + b"\n"
_PREFIX = "relaybox:"
_encode = json.JSONEncoder(separators=(",", ":")).encode


def log_prefix(table: str) -> str:
    """The logical message prefix of `table`'s messages: `relaybox:` and the table.

    A replication slot decodes every message of its database; the relay of a table
    takes those of its prefix and passes over the rest."""
    return _PREFIX + validate_table_name(table)


def log_slot(table: str) -> str:
    """The replication slot (and the publication) `table`'s relay streams from.

    A name of lower-case letters, digits and underscores, as slot names must be:
    `relaybox_` and the table (`relaybox_outbox`). A schema's `.` is spelled `__`, which
    a table name may hold as well, so a schema-qualified name also ends in 8 hex digits
    of a digest of the whole name: `app.outbox` and `app__outbox` never share a slot
    (whose relay would take one table's messages and confirm past the other's)."""
    name = validate_table_name(table)
    if "." not in name:
        return notify_channel(name)
    digest = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    return f"relaybox_{name.replace('.', '__')[:44]}_{digest}"


def format_lsn(lsn: int) -> str:
    """A WAL position as PostgreSQL writes it, `16/B374D848`."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """A WAL position as PostgreSQL writes it, as a number."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def encode_rows(rows: Sequence[InsertRow]) -> bytes:
    """The content of one logical message carrying `rows`."""
    meta = []
    payloads = []
    for row in rows:
        (id_, target, external, topic, key, partition, type_, content_type, payload,
         headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
         delay) = row  # fmt: skip
        payloads.append(payload)
        meta.append([
            id_.hex, target, external, topic, key, partition, type_, content_type,
            len(payload), headers, correlation_id, causation_id, tenant_id, aggregate_id,
            occurred_at.isoformat(), delay,
        ])  # fmt: skip
    return b"".join((_HEAD, _encode(meta).encode(), b"\n", *payloads))


class UnknownFormatError(MessageError):
    """A log message of a format this relaybox cannot read: written by a newer one."""


def decode_rows(content: bytes) -> list[InsertRow]:
    """The rows `encode_rows` wrote; a `MessageError` for content it did not write, an
    `UnknownFormatError` for content of another format (a number on its first line)."""
    first = content.find(b"\n")
    second = content.find(b"\n", first + 1)
    head = content[:first] if first >= 0 else b""
    if head != FORMAT and 0 < len(head) <= 9 and head.isdigit():
        raise UnknownFormatError(
            f"a relaybox log message of format {head.decode()}, which this relaybox (format "
            f"{FORMAT.decode()}) cannot read: upgrade the relays before the writers"
        )
    if first < 0 or second < 0 or head != FORMAT:
        raise MessageError(f"not a relaybox log message of format {FORMAT.decode()}")
    try:
        meta = json.loads(content[first + 1 : second])
        offset = second + 1
        rows: list[InsertRow] = []
        for (id_hex, target, external, topic, key, partition, type_, content_type, size,
             headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred,
             delay) in meta:  # fmt: skip
            payload = content[offset : offset + size]
            offset += size
            rows.append((
                uuid.UUID(hex=id_hex), target, bool(external), topic, key, int(partition),
                type_, content_type, payload, headers, correlation_id, causation_id,
                tenant_id, aggregate_id, datetime.datetime.fromisoformat(occurred),
                float(delay),
            ))  # fmt: skip
    except (ValueError, TypeError) as error:
        raise MessageError(f"a relaybox log message that does not decode: {error}") from None
    if offset != len(content):
        raise MessageError("a relaybox log message whose payloads do not add up")
    return rows
