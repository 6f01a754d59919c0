"""An inbox as the operator's console watches it: the consumers' activity per minute
and the messages parked now, read from the consumers' database by URL.

Each read opens a connection, reads in one short transaction and closes it, as
`relaybox parked` does: the console holds no connection to a consumer's database
between its refreshes, so a restarted database or a dropped connection costs one
failed refresh, never a console stuck on a dead connection.
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from relaybox.core.identifiers import DEFAULT_INBOX, validate_table_name
from relaybox.core.urls import scrub
from relaybox.errors import RelayboxError, SchemaError, StorageError
from relaybox.inbox.parked import parked_counts
from relaybox.operations.watch import ConsumerSeries, inbox_activity
from relaybox.storage.connect import transaction
from relaybox.storage.urls import DatabaseUrl
from relaybox.writer.connections import missing_table

T = TypeVar("T")


class InboxWatch:
    """One inbox table of a consumer's database, read-only."""

    def __init__(self, db_url: str, table: str = DEFAULT_INBOX) -> None:
        validate_table_name(table)
        self._url = DatabaseUrl.parse(db_url)
        self.table = table
        #: How the console names this inbox (the masked URL and the table).
        self.name = f"{self._url.masked} {table}"

    async def activity(self, since: datetime.datetime) -> list[ConsumerSeries]:
        """Per consumer, a point per minute from the one that holds `since` to now."""
        return await self._read(
            lambda connection: inbox_activity(connection, since, table=self.table)
        )

    async def parked_now(self) -> dict[str, int]:
        """Per consumer, how many of its messages are parked now."""
        return await self._read(lambda connection: parked_counts(connection, table=self.table))

    async def _read(self, work: Callable[[Any], Awaitable[T]]) -> T:
        hint = (
            f"no inbox table {self.table} (or its _parked and _activity tables): create "
            f"them with `relaybox migrate --inbox --db {self._url.masked} --table {self.table}`"
        )
        return await in_transaction(self._url, work, missing_hint=hint)


async def in_transaction(
    url: DatabaseUrl, work: Callable[[Any], Awaitable[T]], *, missing_hint: str
) -> T:
    """`work` on a new connection to `url`, in one transaction committed when it
    returns. A driver's error becomes relaybox's, its text with the URL's secrets
    masked; a missing table's says `missing_hint`."""
    try:
        async with transaction(url) as connection:
            return await work(connection)
    except RelayboxError:
        raise
    except Exception as error:  # noqa: BLE001 - a driver's, told as relaybox's
        text = scrub(str(error), url.secrets)  # a driver may quote the password
        if missing_table(error):
            raise SchemaError(f"{url.masked}: {missing_hint}") from None
        raise StorageError(f"{url.masked}: {type(error).__name__}: {text}") from None
