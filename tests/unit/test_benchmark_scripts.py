"""The scripts behind docs/benchmarks.md still load against the package as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted(
    p for p in (Path(__file__).parents[2] / "benchmarks").glob("*.py") if not p.name.startswith("_")
)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_script_starts(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
