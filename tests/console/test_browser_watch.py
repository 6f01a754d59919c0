"""Watching and backfilling in a real browser (Debian's Chromium, driven by Playwright)
over real tables: a relay publishes to one target and is refused by another, a
consumer applies messages; the overview charts what the relay published, shows the
refused target's open circuit with its last error masked, and the consumer's counts.
An operator then backfills a target from the page, after a dry run, and the relay
publishes the copies.

With RELAYBOX_SCREENSHOTS=docs/images the screenshots are written there (for
docs/operations.md); otherwise under the test's temporary directory.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from playwright.async_api import Browser, expect

from relaybox import Message
from relaybox.console import create_app
from relaybox.core.circuit import CircuitPolicy, CircuitState
from relaybox.core.incoming import Incoming
from relaybox.core.publishing import PublishResult
from relaybox.core.records import StoredMessage
from relaybox.operations.inboxes import InboxWatch
from relaybox.operations.messages import Operations
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import Relay
from tests.console.test_browser import TOKEN, Shots, serving, sign_in
from tests.inbox.support import InboxWorld, incoming
from tests.relay_support import OutboxDB, eventually, fast_settings, outbox_db

SECRET = "hunter2-of-the-broker"


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db("sqlite", tmp_path, targets=("default", "audit", "late")):
        yield each


@pytest.fixture
async def operations(db: OutboxDB) -> AsyncIterator[Operations]:
    async with Operations.opened(db.url, db.table) as opened:
        yield opened


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[InboxWorld]:
    async with InboxWorld("sqlite", tmp_path) as opened:
        yield opened


class Refusing(MemoryPublisher):
    """A broker whose every publish raises, naming a URL with a password."""

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        raise ConnectionError(f"amqp://relay:{SECRET}@broker.example:5672/ refused")


def orders(key: str, count: int, **fields: object) -> list[Message]:
    return [
        Message(topic="orders", key=key, payload={"key": key, "n": n}, **fields)  # type: ignore[arg-type]
        for n in range(count)
    ]


def relay(db: OutboxDB, publishers: dict[str, MemoryPublisher]) -> Relay:
    """A relay that keeps what it published, writes its activity often, and keeps a
    circuit open for a minute once it opens."""
    settings = fast_settings(
        published_retention=3600.0, activity_interval=0.05,
        circuit=CircuitPolicy(failure_threshold=3, open_seconds=60.0, max_open_seconds=60.0),
    )  # fmt: skip
    return Relay(db.database, dict(publishers), table=db.table, settings=settings,
                 worker="relay-1")  # fmt: skip


def written(message_id: str, seconds_ago: float) -> Incoming:
    """A message its writer created `seconds_ago`, for a lag to chart."""
    at = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds_ago)
    return dataclasses.replace(incoming(message_id), time=at)


async def audit_open(db: OutboxDB) -> bool:
    found = {s.target: s for s in await db.storage.relay_statuses()}
    return "audit" in found and found["audit"].circuit is CircuitState.OPEN


async def counted(db: OutboxDB, target: str, published: int) -> bool:
    """Whether the relay's activity counts `published` messages published to `target`."""
    hour_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)
    points = await db.storage.activity(since=hour_ago)
    return sum(p.published for p in points if p.target == target) == published


async def test_the_overview_charts_deliveries_circuits_and_consumers(
    db: OutboxDB, operations: Operations, world: InboxWorld, browser: Browser, tmp_path: Path
) -> None:
    consumer = world.consumer()
    for message_id, seconds_ago in (("m1", 4.0), ("m2", 1.5), ("m3", 0.5)):
        await consumer.process(written(message_id, seconds_ago))
    await consumer.process(incoming("m1"))  # a copy
    assert await consumer.record_activity()
    await db.write([*orders("order-1", 4), *orders("audit-1", 2, targets=["audit"])])
    default = MemoryPublisher()
    async with relay(db, {"default": default, "audit": Refusing()}):
        await eventually(lambda: len(default.published) == 4)
        await eventually(lambda: audit_open(db))
        await eventually(lambda: counted(db, "default", 4))
        inbox = InboxWatch(world.url, world.table)
        app = create_app([operations], token=TOKEN, inboxes=[inbox])
        async with serving(app) as base:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.clock.install()  # the refresh's timer runs when the test says
            await page.goto(f"{base}/")
            chart = page.locator('.watch[data-target="default"] svg.chart-published')
            await expect(chart).to_be_visible()
            bars = chart.locator('rect.bar:not([data-count="0"])')
            await expect(bars.first).to_be_visible()  # a minute that published
            await expect(page.locator('.watch[data-target="default"] .totals')).to_contain_text(
                "published 4"
            )
            assert sum([int(await bar.get_attribute("data-count") or 0)
                        for bar in await bars.all()]) == 4  # fmt: skip
            audit = page.locator('.watch[data-target="audit"] li[data-worker="relay-1"]')
            await expect(audit.locator(".circuit")).to_have_text("open")
            await expect(audit.locator(".last-error")).to_contain_text(
                "broker.example:5672/ refused"
            )
            assert SECRET not in await page.content()
            row = page.locator('table.consumers tr[data-consumer="test"]')
            await expect(row.locator("td.applied")).to_have_text("3")
            await expect(row.locator("td.parked-now")).to_have_text("0")
            await expect(row.locator("svg.chart-consumer-lag circle.lag-max")).to_have_count(1)
            await expect(page.locator("#oldest-pending")).to_contain_text("Oldest due message")
            await Shots(tmp_path).take(page, "console-watch.png")

            await consumer.process(written("m4", 1.0))
            assert await consumer.record_activity()
            await page.clock.run_for(9_000)
            await expect(row.locator("td.applied")).to_have_text("3")  # not yet
            await page.clock.run_for(1_000)
            await expect(row.locator("td.applied")).to_have_text("4")  # every 10 s


async def test_an_operator_backfills_a_new_target_after_a_dry_run_and_the_relay_publishes_it(
    db: OutboxDB, operations: Operations, browser: Browser, tmp_path: Path
) -> None:
    default, late = MemoryPublisher(), MemoryPublisher()
    await db.write([*orders("order-1", 2), *orders("order-2", 1)])
    async with relay(db, {"default": default, "late": late}):
        await eventually(lambda: len(default.published) == 3)
        # Live for late while the operator plans: due in a few seconds.
        waiting = orders("order-2", 1, targets=["late"], delay=5.0)
        await db.write(waiting)
        async with serving(create_app([operations], token=TOKEN)) as base:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.goto(f"{base}/")
            await sign_in(page)
            await page.get_by_role("link", name="Backfill").click()
            await page.locator("#bf-name").fill("late-history")
            await page.locator("#bf-source").fill("default")
            await page.locator("#bf-to").fill("late")
            await page.locator("#bf-rate").fill("100")
            await page.locator("#bf-actor").fill("ana")
            await page.locator("#bf-reason").fill("the late service needs the history")
            await page.get_by_role("button", name="Dry run").click()
            await expect(page.locator("#preview")).to_contain_text(
                "Will copy 3 messages of 2 keys to late."
            )
            await expect(page.locator("#live-keys li")).to_have_text(["order-2"])
            assert await db.storage.backfill_job("late-history") is None  # a dry run
            await page.locator("#confirm").click()
            status = page.locator("#backfill-status")
            await expect(status).to_have_attribute("data-state", "finished")
            await expect(status).to_contain_text("finished; 3 copied of 3")
            await expect(status).to_contain_text("by ana: the late service needs the history")
            await Shots(tmp_path).take(page, "console-backfill.png")
            await eventually(lambda: len(late.published) == 4, timeout=20)
            await page.goto(f"{base}/#/t/0/backfill")  # a later visit finds it by name
            await page.locator("#bf-lookup").fill("late-history")
            await page.get_by_role("button", name="Show").click()
            await expect(status).to_contain_text("finished; 3 copied, up to seq")
    originals = {(m.key, json.loads(m.payload)["n"]): m.id for m in default.published}
    # order-2's live message first, then the copy behind it; order-1's copies in order.
    assert [m.id for m in late.published if m.key == "order-2"] == [
        waiting[0].id, originals[("order-2", 0)],
    ]  # fmt: skip
    assert [m.id for m in late.published if m.key == "order-1"] == [
        originals[("order-1", 0)], originals[("order-1", 1)],
    ]  # fmt: skip
