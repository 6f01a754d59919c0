"""examples/entity_consumer runs as it stands, on the real Redis: three deposits applied
once each, the relay's second copy of one skipped, one balance message per deposit."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).parents[2] / "examples" / "entity_consumer" / "main.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("entity_consumer_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_ledger_applies_each_deposit_once(tmp_path: Path) -> None:
    result = await _load().main(tmp_path, f"rbx-test-{uuid.uuid4().hex[:12]}:")
    assert result == {
        "balances": {"account-1": 17, "account-2": 5},
        "applied": 3,
        "duplicates": 1,
        "balance_messages": 3,
    }
