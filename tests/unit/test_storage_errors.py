"""How driver errors map onto relaybox's: an operational one drops the connection."""

from __future__ import annotations

import asyncpg
import pytest

from relaybox.errors import StorageError, StorageOperationalError
from relaybox.storage.postgres import translate


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions.InternalClientError(
            "cannot switch to state 11; another operation (2) is in progress"
        ),
        asyncpg.exceptions.InterfaceError(
            "cannot perform operation: another operation is in progress"
        ),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed"),
        ConnectionResetError(),
    ],
)
def test_a_connection_in_an_unknown_state_is_operational(error: BaseException) -> None:
    """The storage drops the connection on an operational error and opens another on
    its next call; any other error keeps it, so a protocol left mid-way would fail
    every later call on it."""
    assert isinstance(translate(error), StorageOperationalError)


def test_a_statement_error_keeps_its_connection() -> None:
    error = translate(asyncpg.exceptions.UniqueViolationError("duplicate key"))
    assert isinstance(error, StorageError)
    assert not isinstance(error, StorageOperationalError)
