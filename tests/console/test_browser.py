"""The console in a real browser (Debian's Chromium, driven by Playwright) over a real
outbox table that a relay fills with abandoned messages: an operator finds one, reads
why it is stuck, replays it after a dry run, and sees it delivered; changes without the
token, from another origin or with a wrong CSRF token change nothing; read-only hides
and refuses the actions; hostile message content shows as text.

With RELAYBOX_SCREENSHOTS=docs/images the replay's screenshots are written there (for
docs/operations.md); otherwise under the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from playwright.async_api import Browser, Page, expect
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Mount, Route

from relaybox import Message
from relaybox.console import create_app
from relaybox.core.inspection import MessageFilter, MessageState
from relaybox.core.records import StoredMessage
from relaybox.operations.messages import Operations
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import Relay
from tests.relay_support import OutboxDB, eventually, fast_settings, outbox_db

TOKEN = "console-token-for-the-browser-tests"
#: The browser tests' backend: the console over a real database file.
BACKEND = "sqlite"
HOSTILE = "<script>window.pwned = 1</script>"


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[OutboxDB]:
    async for each in outbox_db(BACKEND, tmp_path):
        yield each


@pytest.fixture
async def operations(db: OutboxDB) -> AsyncIterator[Operations]:
    """The console's own view of the table, through its own connection."""
    async with Operations.opened(db.url, db.table) as opened:
        yield opened


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Serve `app` on a free port of 127.0.0.1 in this event loop; its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started or task.done(), timeout=10)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def mounted(console: Any) -> Starlette:
    """The console mounted under /ops of another application, as a service would."""
    return Starlette(routes=[Mount("/ops", console)])


def numbered(message: StoredMessage) -> int:
    n: int = json.loads(message.payload)["n"]
    return n


def first_of(key: str) -> Callable[[StoredMessage], bool]:
    return lambda m: m.key == key and numbered(m) == 0


async def abandon(
    db: OutboxDB, publisher: MemoryPublisher, batch: list[Message], *, hold_keys: bool = False
) -> Relay:
    """Write `batch` and start a relay (keeping published rows) that publishes to
    `publisher`; returns once every message is published or abandoned (with
    `hold_keys`: once one is held and the keys not held are published)."""
    await db.write(batch)
    relay = Relay(
        db.database, {"default": publisher}, table=db.table,
        settings=fast_settings(published_retention=3600.0, hold_keys=hold_keys),
    )  # fmt: skip
    await relay.__aenter__()
    try:
        if hold_keys:
            await eventually(lambda: _held_one(db, published=len(batch) - 3))
        else:
            await eventually(lambda: _settled(db, len(batch)))
    except BaseException:
        await relay.__aexit__(None, None, None)
        raise
    return relay


async def _held_one(db: OutboxDB, *, published: int) -> bool:
    stats = await db.storage.stats()
    return stats.held == 1 and stats.by_status()["published"] == published


async def _settled(db: OutboxDB, count: int) -> bool:
    counts = (await db.storage.stats()).by_status()
    return counts["published"] + counts["abandoned"] == count


async def state(operations: Operations, seq: int) -> MessageState:
    view = await operations.show(seq)
    assert view is not None
    return view.detail.summary.state


def orders(key: str, count: int) -> list[Message]:
    return [Message(topic="orders", key=key, payload={"key": key, "n": n}) for n in range(count)]


class Shots:
    """Screenshots of the replay: into RELAYBOX_SCREENSHOTS when set, else tmp_path."""

    def __init__(self, tmp_path: Path) -> None:
        self.directory = Path(os.environ.get("RELAYBOX_SCREENSHOTS") or tmp_path)
        self.directory.mkdir(parents=True, exist_ok=True)

    async def take(self, page: Page, name: str) -> None:
        await page.screenshot(path=self.directory / name, full_page=True)


async def sign_in(page: Page) -> None:
    await page.get_by_label("console token").fill(TOKEN)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.get_by_role("button", name="Sign out")).to_be_visible()


async def test_an_operator_finds_an_abandoned_message_and_replays_it_in_key_order(
    db: OutboxDB, operations: Operations, browser: Browser, tmp_path: Path
) -> None:
    publisher = MemoryPublisher()
    publisher.reject(first_of("order-1"), error="422 Unprocessable: schema v2 unknown")
    relay = await abandon(db, publisher, [*orders("order-1", 3), *orders("order-2", 2)])
    try:
        (stuck,) = (
            await operations.search(MessageFilter(key="order-1", states=_ABANDONED))
        ).messages
        publisher.heal()  # the target accepts it now
        shots = Shots(tmp_path)
        async with serving(mounted(create_app([operations], token=TOKEN))) as base:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.goto(f"{base}/ops/")
            await expect(page.get_by_role("heading", name=operations.name)).to_be_visible()
            await sign_in(page)
            default = page.locator('table.targets tr[data-target="default"] td')
            await expect(default.nth(3)).to_have_text("1")  # abandoned, linked to its search
            await expect(default.nth(4)).not_to_have_text("—")  # stuck since
            relays = page.locator("table.relays tr").nth(1)  # the running relay, all 8 partitions
            await expect(relays.locator("td").nth(1)).to_have_text("default")
            await expect(relays.locator("td").nth(2)).to_have_text("8")
            await shots.take(page, "console-overview.png")

            await page.get_by_role("link", name="Search").click()
            await page.get_by_label("key", exact=True).fill("order-1")
            await page.locator("input[name=state][value=abandoned]").check()
            await page.get_by_role("button", name="Search").click()
            rows = page.locator("table.results tr[data-seq]")
            await expect(rows).to_have_count(1)
            await expect(rows.first).to_contain_text("schema v2 unknown")
            await shots.take(page, "console-search.png")

            await rows.first.get_by_role("link", name=f"#{stuck.seq}").click()
            await expect(page.locator("#last-error")).to_have_text(
                "422 Unprocessable: schema v2 unknown"
            )
            await expect(page.locator("#payload")).to_contain_text('"key": "order-1"')
            published_after = [stuck.seq + 1, stuck.seq + 2]  # order-1's n=1 and n=2
            await expect(page.get_by_text("Already published after it")).to_be_visible()
            for seq in published_after:
                await expect(page.get_by_role("link", name=f"#{seq}", exact=True)).to_be_visible()
            await shots.take(page, "console-message.png")

            await page.locator("#actor").fill("ana")
            await page.locator("#reason").fill("the partner deployed schema v2")
            await page.locator("button[data-action=replay]").click()
            ahead = ", ".join(f"#{seq} (default/order-1)" for seq in published_after)
            await expect(page.locator("#preview")).to_contain_text(
                f"Will replay 1 message (#{stuck.seq}) of key default/order-1; "
                f"already published ahead: {ahead}."
            )
            assert await state(operations, stuck.seq) is MessageState.ABANDONED  # a dry run
            await shots.take(page, "console-replay-preview.png")

            await page.locator("#confirm").click()
            await expect(page.locator("#done")).to_contain_text("replay changed 1 of 1 message")
            await eventually(lambda: any(first_of("order-1")(m) for m in publisher.published))
            await eventually(lambda: _in_state(operations, stuck.seq, MessageState.PUBLISHED))
            await page.get_by_role("button", name="Reload").click()
            await expect(page.locator("h2")).to_contain_text("published")

            await page.goto(f"{base}/ops/#/t/0/audit")
            audit = page.locator("table.audit tr").nth(1)
            await expect(audit).to_contain_text("ana")
            await expect(audit).to_contain_text("the partner deployed schema v2")
            await shots.take(page, "console-audit.png")
    finally:
        await relay.__aexit__(None, None, None)
    order_1 = [numbered(m) for m in publisher.published if m.key == "order-1"]
    assert order_1 == [1, 2, 0]  # as the preview said: 1 and 2 went ahead of the replay
    (record,) = await operations.audit()
    assert (record.actor, record.seq, str(record.action)) == ("ana", stuck.seq, "replay")


_ABANDONED = frozenset({MessageState.ABANDONED})


async def test_mounted_behind_the_application_s_own_sign_in_the_user_replays_as_themselves(
    db: OutboxDB, operations: Operations, browser: Browser
) -> None:
    """No console token: the host application's signed-in user may change messages, and
    is the actor of the audit record."""
    publisher = MemoryPublisher()
    publisher.reject(first_of("order-7"), error="400 Bad Request")
    relay = await abandon(db, publisher, orders("order-7", 1))
    await relay.__aexit__(None, None, None)
    (stuck,) = (await operations.search(MessageFilter(states=_ABANDONED))).messages

    async def login(request: Any) -> Any:  # the host application's own sign-in
        response = HTMLResponse("signed in")
        response.set_cookie("host_session", "ana@example.com", httponly=True, samesite="strict")
        return response

    def authorize(request: Any) -> str | None:
        user: str | None = request.cookies.get("host_session")
        return user

    console = create_app([operations], authorize=authorize)
    host = Starlette(routes=[Route("/login", login), Mount("/ops", console)])
    async with serving(host) as base:
        page = await browser.new_page()
        await page.goto(f"{base}/ops/#/t/0/m/{stuck.seq}")
        await expect(
            page.get_by_text("Sign in to the application to act on messages.")
        ).to_be_visible()
        await expect(page.locator("#host-user")).to_have_text("Not signed in to the application")
        await page.goto(f"{base}/login")
        await page.goto(f"{base}/ops/#/t/0/m/{stuck.seq}")
        await expect(page.locator("#host-user")).to_have_text("Signed in as ana@example.com")
        await expect(page.locator("#actor")).to_have_value("ana@example.com")
        await page.locator("#reason").fill("the receiver accepts it now")
        await page.locator("button[data-action=replay]").click()
        await expect(page.locator("#preview p")).to_contain_text(
            f"Will replay 1 message (#{stuck.seq})"
        )
        await page.locator("#confirm").click()
        await expect(page.locator("#done")).to_contain_text("replay changed 1 of 1 message")
    assert await state(operations, stuck.seq) is MessageState.PENDING
    (record,) = await operations.audit()
    assert (record.actor, record.reason) == ("ana@example.com", "the receiver accepts it now")


async def test_with_keys_held_a_replayed_message_goes_out_first_and_its_key_follows_in_order(
    db: OutboxDB, operations: Operations, browser: Browser, tmp_path: Path
) -> None:
    """The hold-the-key policy: the refused message holds its key; after the replay the
    key's messages reach the broker in their written order, without a gap."""
    publisher = MemoryPublisher()
    publisher.reject(first_of("order-1"), error="422 Unprocessable: schema v2 unknown")
    batch = [*orders("order-1", 3), *orders("order-2", 2)]
    relay = await abandon(db, publisher, batch, hold_keys=True)
    try:
        assert [m.key for m in publisher.published] == ["order-2", "order-2"]
        publisher.heal()
        async with serving(create_app([operations], token=TOKEN)) as base:
            page = await browser.new_page()
            await page.goto(f"{base}/")
            await sign_in(page)
            await page.get_by_role("link", name="Search").click()
            await page.get_by_label("key", exact=True).fill("order-1")
            await page.locator("input[name=state][value=held]").check()
            await page.get_by_role("button", name="Search").click()
            rows = page.locator("table.results tr[data-seq]")
            await expect(rows).to_have_count(1)
            held = int(await rows.first.get_attribute("data-seq") or 0)
            await rows.first.get_by_role("link", name=f"#{held}").click()
            await expect(page.locator("h2")).to_contain_text("held")
            for seq in (held + 1, held + 2):  # order-1's n=1 and n=2 wait behind it
                await expect(page.get_by_role("link", name=f"#{seq}", exact=True)).to_be_visible()
            await page.locator("#actor").fill("ana")
            await page.locator("button[data-action=replay]").click()
            await expect(page.locator("#preview p")).to_have_text(
                f"Will replay 1 message (#{held}) of key default/order-1; "
                "already published ahead: none."
            )
            await Shots(tmp_path).take(page, "console-held.png")
            assert await state(operations, held) is MessageState.HELD  # a dry run
            await page.locator("#confirm").click()
            await expect(page.locator("#done")).to_contain_text("replay changed 1 of 1 message")
            await eventually(lambda: len(publisher.published) == len(batch))
    finally:
        await relay.__aexit__(None, None, None)
    order_1 = [numbered(m) for m in publisher.published if m.key == "order-1"]
    assert order_1 == [0, 1, 2]


async def _in_state(operations: Operations, seq: int, wanted: MessageState) -> bool:
    return await state(operations, seq) is wanted


@pytest.fixture
async def one_abandoned(db: OutboxDB, operations: Operations) -> int:
    """A table with one abandoned message; its seq."""
    publisher = MemoryPublisher()
    publisher.reject(error="400 Bad Request")
    relay = await abandon(db, publisher, orders("order-9", 1))
    await relay.__aexit__(None, None, None)
    (found,) = (await operations.search(MessageFilter(states=_ABANDONED))).messages
    return found.seq


async def post_from(page: Page, url: str, headers: dict[str, str], body: dict[str, Any]) -> int:
    """POST `body` as JSON from the page's own script; the answer's status."""
    status: int = await page.evaluate(
        """async ([url, headers, body]) => {
            const answer = await fetch(url, {method: "POST", credentials: "include",
              headers: {"Content-Type": "application/json", ...headers},
              body: JSON.stringify(body)});
            return answer.status;
        }""",
        [url, headers, body],
    )
    return status


async def test_changes_without_the_token_from_another_origin_or_a_wrong_csrf_token_fail(
    operations: Operations, one_abandoned: int, browser: Browser
) -> None:
    seq = one_abandoned
    replay = {"seqs": [seq], "actor": "mallory"}
    console = create_app([operations], token=TOKEN)
    async with serving(mounted(console)) as base:
        action = f"{base}/ops/api/tables/0/actions/replay"
        attack = f"""<script>
            fetch({json.dumps(action)}, {{method: "POST", credentials: "include", mode: "no-cors",
              headers: {{"Content-Type": "text/plain"}}, body: {json.dumps(json.dumps(replay))}}})
              .finally(() => {{ document.title = "sent"; }});
            </script>"""

        async def evil(_: Any) -> HTMLResponse:
            return HTMLResponse(attack)

        async with serving(Starlette(routes=[Route("/", evil)])) as other:
            context = await browser.new_context()
            page = await context.new_page()
            await page.goto(f"{base}/ops/#/t/0/m/{seq}")
            await expect(page.get_by_text("Sign in to act on messages.")).to_be_visible()
            await expect(page.locator("button[data-action]")).to_have_count(0)
            assert await post_from(page, action, {}, replay) == 401  # not signed in

            await sign_in(page)
            await expect(page.locator("button[data-action=replay]")).to_be_visible()
            wrong = {"X-CSRF-Token": "0" * 64}
            assert await post_from(page, action, wrong, replay) == 403
            assert await post_from(page, action, {"Authorization": "Bearer guess"}, replay) == 401

            # A page of another origin (another port of the same host: the same site, so
            # the browser sends the session cookie) posts to the console.
            foreign = await context.new_page()
            await foreign.goto(other)
            await expect(foreign).to_have_title("sent")
    assert await state(operations, seq) is MessageState.ABANDONED
    assert await operations.audit() == []


async def test_read_only_hides_and_refuses_the_actions(
    operations: Operations, one_abandoned: int, browser: Browser
) -> None:
    seq = one_abandoned
    async with serving(create_app([operations], token=TOKEN, read_only=True)) as base:
        page = await browser.new_page()
        await page.goto(f"{base}/#/t/0/m/{seq}")
        await expect(page.get_by_text("Read-only: the console runs read-only")).to_be_visible()
        await expect(page.locator("#last-error")).to_have_text("400 Bad Request")
        await expect(page.locator("button[data-action]")).to_have_count(0)
        await expect(page.get_by_label("console token")).to_have_count(0)
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        body = {"seqs": [seq], "actor": "ana"}
        assert await post_from(page, "api/tables/0/actions/replay", bearer, body) == 403
    assert await state(operations, seq) is MessageState.ABANDONED


async def test_hostile_content_shows_as_text(
    db: OutboxDB, operations: Operations, browser: Browser
) -> None:
    publisher = MemoryPublisher()
    publisher.reject(error=f"refused {HOSTILE}")
    hostile = Message(
        topic="orders", key=HOSTILE, type="<img src=x onerror='window.pwned=2'>",
        payload={"note": HOSTILE}, headers={"note": HOSTILE},
    )  # fmt: skip
    relay = await abandon(db, publisher, [hostile])
    await relay.__aexit__(None, None, None)
    (found,) = (await operations.search()).messages
    async with serving(create_app([operations], token=TOKEN)) as base:
        page = await browser.new_page()
        await page.goto(f"{base}/#/t/0/search?{_query(key=HOSTILE)}")
        await expect(page.locator("table.results tr[data-seq]")).to_contain_text(HOSTILE)
        await page.goto(f"{base}/#/t/0/m/{found.seq}")
        await expect(page.locator("#last-error")).to_have_text(f"refused {HOSTILE}")
        await expect(page.locator("#payload")).to_contain_text(HOSTILE)
        await expect(page.locator("table.fields").first).to_contain_text(HOSTILE)
        await expect(
            page.get_by_text(f"Waits for: live messages of default/{HOSTILE}")
        ).to_be_visible()
        assert await page.locator("main script, main img").count() == 0
        assert await page.evaluate("window.pwned") is None


def _query(**fields: str) -> str:
    from urllib.parse import urlencode

    return urlencode(fields)
