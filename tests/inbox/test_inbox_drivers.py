"""The inbox through every supported driver, sync and async: a first copy is applied,
a second is skipped, a rollback forgets the record, a consumer name scopes it, and bad
input raises a relaybox error that leaves the caller's transaction usable."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from relaybox import Inbox, InboxError, Message
from relaybox.migrations import migrate
from tests.databases import drop
from tests.inbox.support import incoming
from tests.integration.drivers import ASYNC_CASES, SYNC_CASES, AsyncCase, SyncCase
from tests.integration.test_writer import World


class InboxWorld(World):
    """The writer tests' world (a business table, an outbox) plus an inbox table."""

    def __init__(self, dialect: str, db: Path) -> None:
        super().__init__(dialect, db)
        self.inbox_table = self.table + "_in"
        self.inbox = Inbox(consumer="billing", table=self.inbox_table)
        self.watermarks = Inbox(consumer="billing", table=self.inbox_table, mode="watermark")

    async def setup(self) -> None:
        await super().setup()
        await migrate(self.url, table=self.inbox_table, kind="inbox")

    def teardown(self) -> None:
        super().teardown()
        drop(self.url, self.inbox_table)

    def recorded(self) -> int:
        return self.count(self.inbox_table)


@pytest.fixture(params=sorted(SYNC_CASES))
def sync_case(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[InboxWorld, SyncCase]]:
    dialect, opener = SYNC_CASES[request.param]
    world = InboxWorld(dialect, tmp_path / "app.db")
    world.setup_sync()
    case = opener(world.db)
    try:
        yield world, case
    finally:
        case.close()
        world.teardown()


@pytest.fixture(params=sorted(ASYNC_CASES))
async def async_case(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[InboxWorld, AsyncCase]]:
    dialect, opener = ASYNC_CASES[request.param]
    world = InboxWorld(dialect, tmp_path / "app.db")
    await world.setup()
    case = await opener(world.db)
    try:
        yield world, case
    finally:
        await case.close()
        world.teardown()


def test_sync_first_copy_applies_and_later_copies_skip(
    sync_case: tuple[InboxWorld, SyncCase],
) -> None:
    world, case = sync_case
    message = incoming("order-1-paid")
    assert world.inbox.record(case.handle, message) is True
    case.run(world.business_insert())
    assert world.inbox.record(case.handle, message) is False  # same transaction
    case.commit()
    assert world.inbox.record(case.handle, message) is False  # a later transaction
    other = Inbox(consumer="shipping", table=world.inbox_table)
    assert other.record(case.handle, message) is True  # another consumer's first copy
    assert world.inbox.record(case.handle, "plain-id") is True  # a bare id works too
    case.commit()
    assert world.recorded() == 3
    assert world.count(world.business) == 1


def test_sync_rollback_forgets_the_record(sync_case: tuple[InboxWorld, SyncCase]) -> None:
    world, case = sync_case
    message = incoming("order-2-paid")
    assert world.inbox.record(case.handle, message) is True
    case.run(world.business_insert())
    case.rollback()  # the handler failed: neither the effect nor the record stays
    assert world.recorded() == 0
    assert world.inbox.record(case.handle, message) is True  # the redelivery applies
    case.commit()
    assert world.recorded() == 1


def test_sync_watermark_moves_only_forward(sync_case: tuple[InboxWorld, SyncCase]) -> None:
    world, case = sync_case
    marks = [
        world.watermarks.record(case.handle, incoming(f"m{s}", partition=7, sequence=s))
        for s in (10, 12, 12, 11, 13)
    ]
    case.commit()
    assert marks == [True, True, False, False, True]
    assert world.watermarks.record(case.handle, incoming("m14", partition=8, sequence=1))


@pytest.mark.parametrize(
    ("inbox_args", "message", "error"),
    [
        pytest.param({}, "x" * 256, InboxError, id="id-too-long"),
        pytest.param({}, "", InboxError, id="empty-id"),
        pytest.param({"mode": "watermark"}, incoming("no-seq"), InboxError, id="no-sequence"),
    ],
)
def test_sync_bad_input_raises_and_keeps_the_transaction(
    sync_case: tuple[InboxWorld, SyncCase],
    inbox_args: dict[str, str],
    message: object,
    error: type[Exception],
) -> None:
    world, case = sync_case
    inbox = Inbox(consumer="billing", table=world.inbox_table, **inbox_args)  # type: ignore[arg-type]
    case.run(world.business_insert())
    with pytest.raises(error):
        inbox.record(case.handle, message)  # type: ignore[arg-type]
    assert world.inbox.record(case.handle, incoming("after-the-error")) is True
    case.commit()
    assert world.count(world.business) == 1
    assert world.recorded() == 1


def test_sync_handler_writes_its_follow_up_in_the_same_transaction(
    sync_case: tuple[InboxWorld, SyncCase],
) -> None:
    world, case = sync_case
    received = incoming("order-3-placed")
    assert world.inbox.record(case.handle, received)
    follow_up = received.follow_up(topic="invoices", key="order-3", payload={"n": 3})
    world.outbox.add(case.handle, follow_up)
    case.rollback()
    assert (world.recorded(), world.count(world.table)) == (0, 0)
    assert world.inbox.record(case.handle, received)
    world.outbox.add(case.handle, follow_up)
    case.commit()
    assert (world.recorded(), world.count(world.table)) == (1, 1)
    assert follow_up.causation_id == received.id
    assert follow_up.correlation_id == received.id  # it started the conversation


async def test_async_first_copy_applies_and_later_copies_skip(
    async_case: tuple[InboxWorld, AsyncCase],
) -> None:
    world, case = async_case
    message = incoming("order-1-paid")
    assert await world.inbox.record_async(case.handle, message) is True
    await case.run(world.business_insert())
    assert await world.inbox.record_async(case.handle, message) is False
    await case.commit()
    assert await world.inbox.record_async(case.handle, message) is False
    other = Inbox(consumer="shipping", table=world.inbox_table)
    assert await other.record_async(case.handle, message) is True
    await case.commit()
    assert world.recorded() == 2
    assert world.count(world.business) == 1


async def test_async_rollback_forgets_the_record(
    async_case: tuple[InboxWorld, AsyncCase],
) -> None:
    world, case = async_case
    message = incoming("order-2-paid")
    assert await world.inbox.record_async(case.handle, message) is True
    await world.outbox.add_async(case.handle, Message(topic="invoices", payload={"n": 2}))
    await case.rollback()
    assert (world.recorded(), world.count(world.table)) == (0, 0)
    assert await world.inbox.record_async(case.handle, message) is True
    await case.commit()
    assert world.recorded() == 1


async def test_async_watermark_moves_only_forward(
    async_case: tuple[InboxWorld, AsyncCase],
) -> None:
    world, case = async_case
    marks = [
        await world.watermarks.record_async(case.handle, incoming(f"m{s}", partition=7, sequence=s))
        for s in (10, 12, 12, 11, 13)
    ]
    await case.commit()
    assert marks == [True, True, False, False, True]


async def test_async_bad_input_raises_and_keeps_the_transaction(
    async_case: tuple[InboxWorld, AsyncCase],
) -> None:
    world, case = async_case
    await case.run(world.business_insert())
    with pytest.raises(InboxError):
        await world.watermarks.record_async(case.handle, incoming("stripped-envelope"))
    with pytest.raises(InboxError):
        await world.inbox.record_async(case.handle, "x" * 256)
    assert await world.inbox.record_async(case.handle, incoming("after-the-error")) is True
    await case.commit()
    assert world.count(world.business) == 1
    assert world.recorded() == 1
