"""The browser the console's browser tests drive: Debian's Chromium, through Playwright."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture
async def browser() -> AsyncIterator[object]:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            yield launched
        finally:
            await launched.close()
