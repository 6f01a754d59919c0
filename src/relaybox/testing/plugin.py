"""pytest fixtures for an application's tests of the messages it writes.

pytest loads this module by itself wherever relaybox is installed (the `pytest11` entry
point). It adds fixtures and nothing else: no hook, no option, nothing imported until
a test asks for one of them, all named `relaybox_*`, and a fixture of the same name in
a project's own conftest.py takes precedence over it.

- `relaybox_database`: the URL of the database the application's outbox is in. By
  default a new SQLite file per test, with the outbox and inbox tables migrated
  (needs `relaybox[sqlite]`); override it in conftest.py to test against your own
  database, which must have the tables.
- `relaybox_table`: the outbox table's name, "outbox" unless overridden.
- `relaybox_outbox`: an `OutboxProbe` of that table, made when the test starts, so it
  sees what the test commits: `relaybox_outbox.assert_written(topic="orders")`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from relaybox.testing import OutboxProbe


@pytest.fixture
def relaybox_table() -> str:
    """The outbox table the application writes to."""
    from relaybox.core.identifiers import DEFAULT_TABLE

    return DEFAULT_TABLE


@pytest.fixture
def relaybox_database(tmp_path: Path, relaybox_table: str) -> str:
    """A new SQLite database for this test, its outbox and inbox tables migrated."""
    from relaybox.migrations import migrate
    from relaybox.testing import run_aside

    url = f"sqlite:///{tmp_path / 'relaybox.db'}"
    run_aside(migrate(url, table=relaybox_table))
    run_aside(migrate(url, kind="inbox"))
    return url


@pytest.fixture
def relaybox_outbox(relaybox_database: str, relaybox_table: str) -> Iterator[OutboxProbe]:
    """What the test commits to the outbox table, read back."""
    from relaybox.testing import OutboxProbe

    with OutboxProbe(relaybox_database, table=relaybox_table) as probe:
        yield probe
