"""Validation of names that end up inside SQL text or on the wire."""

from __future__ import annotations

import re

from relaybox.errors import InvalidTableNameError

# An optional schema, then the table; short enough that derived index names fit
# in PostgreSQL's 63 and MySQL's 64 characters.
_TABLE_NAME = re.compile(r"^(?:[a-z_][a-z0-9_]{0,30}\.)?[a-z_][a-z0-9_]{0,40}$")

DEFAULT_TABLE = "relaybox_outbox"


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
