"""The shop's tables beside relaybox's, in the database the relaybox fixtures made."""

import pytest
from shop import create_tables


@pytest.fixture
def db(relaybox_database: str) -> str:
    """The path of the test's SQLite database, with the shop's tables."""
    path = relaybox_database.removeprefix("sqlite:///")
    create_tables(path)
    return path
