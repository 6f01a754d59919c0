"""Validation of names that end up inside SQL text or on the wire."""

from __future__ import annotations

import hashlib
import re

from relaybox.errors import InvalidTableNameError

# An optional schema, then the table; short enough that derived index names fit
# in PostgreSQL's 63 and MySQL's 64 characters.
_TABLE_NAME = re.compile(r"^(?:[a-z_][a-z0-9_]{0,30}\.)?[a-z_][a-z0-9_]{0,40}$")

DEFAULT_TABLE = "relaybox_outbox"
DEFAULT_INBOX = "relaybox_inbox"


def validate_table_name(name: str) -> str:
    """Return `name` if it is a safe, lower-case SQL identifier, else raise."""
    if not isinstance(name, str) or not _TABLE_NAME.fullmatch(name):
        raise InvalidTableNameError(
            f"invalid table name {name!r}: use lower-case letters, digits and underscores, "
            "starting with a letter or underscore, at most 41 characters, optionally "
            "prefixed by 'schema.'"
        )
    return name


def index_prefix(table: str) -> str:
    """The stem for names derived from a table: `app.outbox` becomes `app_outbox`."""
    return table.replace(".", "_")


# PostgreSQL silently truncates identifiers past 63 bytes in LISTEN, but pg_notify()
# rejects a longer channel; long names keep a readable stem plus a digest of the whole.
_CHANNEL_LIMIT = 63
_CHANNEL_PREFIX = "relaybox_"


def notify_channel(table: str) -> str:
    """The LISTEN/NOTIFY channel that wakes the relays of `table` on PostgreSQL.

    `relaybox_` plus the table name with `.` spelled `__` (`app.outbox` gives
    `relaybox_app__outbox`); a name past PostgreSQL's 63 characters keeps a 45-character
    stem and adds 8 hex digits of a digest of the table name. Two tables may share a
    channel (`a__b` and `a.b`): that costs a spurious wake-up, never a lost message.

    The contract between `Outbox(notify=...)` and a relay that listens here:

    - A NOTIFY is a hint, sent at the commit of a transaction that added messages; it
      carries no payload and is never the only way a message is found.
    - The writer sends it at most once per `notify_interval` seconds per `Outbox`
      (default `relaybox.writer.outbox.DEFAULT_NOTIFY_INTERVAL`, 0.05 s), on the first
      add after the interval has passed; the adds that follow within the interval
      commit without one. So a relay that is woken must claim at once *and claim again
      `notify_interval` seconds after the wake-up* (and keep claiming while it finds
      rows), or those quiet commits wait for its poll. The relay cannot see the
      writers' setting: it uses an interval at least as long as theirs.
    - What that second look cannot catch is left to the relay's adaptive poll, whose
      ceiling is the worst-case latency: a transaction that carried the NOTIFY and
      rolled back (the quiet ones after it then wake nobody), and a quiet transaction
      that commits after the second look (a long transaction).
    - A listener that loses its connection misses what was sent meanwhile: after it
      reconnects it must claim as if woken (`pg_listen` calls `on_notify` then).
    """
    stem = validate_table_name(table).replace(".", "__")
    channel = _CHANNEL_PREFIX + stem
    if len(channel) <= _CHANNEL_LIMIT:
        return channel
    digest = hashlib.blake2b(table.encode(), digest_size=4).hexdigest()
    return f"{_CHANNEL_PREFIX}{stem[:45]}_{digest}"
