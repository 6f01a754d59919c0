"""examples/testing: an application's tests written with relaybox's pytest fixtures,
run by pytest in a process of its own, the fixtures found through the installed
plugin as in any project that depends on relaybox; and docs/testing.md shows the
example as it stands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "testing"


def test_the_example_tests_pass(pytester: pytest.Pytester) -> None:
    for path in EXAMPLE.glob("*.py"):
        pytester.makepyfile(**{path.stem: path.read_text()})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


def test_a_project_that_uses_no_fixture_runs_as_before(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_plain():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fixtures")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*relaybox_outbox*"])  # offered, never forced
    plain = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    plain.assert_outcomes(passed=1)


def test_the_guide_shows_the_example_as_it_is() -> None:
    guide = (ROOT / "docs" / "testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.DOTALL)
    sources = "\n".join(path.read_text() for path in EXAMPLE.glob("*.py"))
    assert blocks
    for block in blocks:
        assert block in sources, block[:200]
