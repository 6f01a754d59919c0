"""The inbox the consumer tests run on: PostgreSQL, unless a module gives its own
`world` (test_nats.py runs on every database)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.inbox.support import InboxWorld


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld("postgresql", tmp_path) as opened:
        yield opened
