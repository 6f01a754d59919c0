"""PostgreSQL: a relay's claiming and settling connections run every statement on its
generic plan (none is planned again at every call), so every statement they run must be
one whose generic plan test_postgres_plans.py holds. Each way of holding rows is driven
through every kind of settle (published and deleted or kept, failed, abandoned, keys
held), and each statement sent is recorded with the kind of connection that sent it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay.engine import Relay
from relaybox.storage.postgres import session_settings
from relaybox.storage.sql import SqlStorage
from relaybox.storage.urls import DatabaseUrl
from tests.integration.test_postgres_plans import QUERIES, STATEMENTS
from tests.relay_support import OutboxDB, eventually, fast_settings, messages, outbox_db

#: What a connection runs when it opens: it reads the catalog for the table's names.
OPENING = {"probe"}
HELD = {QUERIES.get(name, name) for name in STATEMENTS} | OPENING


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("postgresql", tmp_path):
        yield each


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, str]]:
    """Every named statement a storage binds: (whether its connection runs generic
    plans, the query's name)."""
    seen: list[tuple[bool, str]] = []
    bind = SqlStorage._bind

    def recording(self: SqlStorage, name: str, args: Sequence[Any]) -> tuple[str, Sequence[Any]]:
        seen.append((self._generic_plans, name))
        return bind(self, name, args)

    monkeypatch.setattr(SqlStorage, "_bind", recording)
    return seen


def test_the_setting_is_asked_only_for_generic_plans() -> None:
    url = DatabaseUrl.parse("postgresql://u@h/d")
    assert session_settings(url, generic_plans=True)["plan_cache_mode"] == "force_generic_plan"
    assert "plan_cache_mode" not in session_settings(url)


@pytest.mark.parametrize(
    ("partition_leases", "retention", "hold_keys"),
    [(True, 0.0, False), (True, 60.0, True), (False, 0.0, False), (False, 60.0, True)],
)
async def test_the_generic_connections_run_only_statements_whose_generic_plans_are_held(
    db: OutboxDB,
    sent: list[tuple[bool, str]],
    partition_leases: bool,
    retention: float,
    hold_keys: bool,
) -> None:
    await db.write(messages(["ok", "retry", "poison", None], per_key=3))
    publisher = MemoryPublisher()
    publisher.fail(lambda m: m.key == "retry", times=2)
    publisher.reject(lambda m: m.key == "poison")
    settings = fast_settings(
        partition_leases=partition_leases, published_retention=retention, hold_keys=hold_keys
    )
    relay = Relay(db.url, {"default": publisher}, table=db.table, settings=settings)
    async with relay:
        await eventually(lambda: {m.key for m in publisher.published} == {"ok", "retry", None})
        await eventually(lambda: len(publisher.published) == 9)
        (processor,) = relay.processors
        modes = {}
        for role in ("claims", "settles", "housekeeping"):
            storage = getattr(processor._db, role)
            (row,) = await storage._run(
                lambda session: session.connection.fetch("SHOW plan_cache_mode", [])
            )
            modes[role] = row[0]
    assert modes == {"claims": "force_generic_plan", "settles": "force_generic_plan",
                     "housekeeping": "auto"}  # fmt: skip
    generic = {name for is_generic, name in sent if is_generic}
    # Reads or claims, and settles of each kind, went through them: the check has teeth.
    claimed = "read" if partition_leases else "claim"
    published = {
        (True, 0.0): "delete_owned", (True, 60.0): "publish_owned",
        (False, 0.0): "delete_published", (False, 60.0): "mark_published",
    }[partition_leases, retention]  # fmt: skip
    failed = "fail_owned" if partition_leases else "mark_failed"
    abandoned = "abandon_owned" if partition_leases else "abandon"
    assert {claimed, published, failed, abandoned} <= generic
    assert generic <= HELD, f"run on generic plans but not held: {sorted(generic - HELD)}"
