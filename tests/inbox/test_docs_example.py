"""docs/inbox.md's example, run as the page shows it: the code is read from the page."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).parents[2] / "docs" / "inbox.md"


def example_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks, "docs/inbox.md has no python example"
    return blocks[0]


def test_the_inbox_example_applies_each_order_once(tmp_path: Path) -> None:
    namespace: dict[str, Any] = {"__name__": "inbox_example"}
    exec(compile(example_code(), str(DOC), "exec"), namespace)
    result = asyncio.run(namespace["main"](tmp_path))
    assert result == {"applied": 3, "duplicates": 1, "invoices": 3, "follow_ups": 3}
    assert "{'applied': 3, 'duplicates': 1, 'invoices': 3, 'follow_ups': 3}" in DOC.read_text()
