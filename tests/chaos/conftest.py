"""Print the chaos runs' table at the end of the session."""

from __future__ import annotations

import pytest

from tests.chaos.report import ROWS, table


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ROWS:
        terminalreporter.section("chaos: faults injected and outcome, per combination")
        for line in table():
            terminalreporter.write_line(line)
