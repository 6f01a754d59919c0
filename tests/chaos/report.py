"""One line per chaos run, gathered while the suite runs and printed as a table at its
end (`tests/chaos/conftest.py`): the faults each combination took and what came out."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.chaos.world import Outcome

HEADER = (
    "scenario", "combination", "kills", "broker restarts", "db restarts", "cuts",
    "committed", "delivered", "lost", "ghosts", "order violations", "duplicates",
    "inbox effects", "seconds",
)  # fmt: skip
ROWS: list[tuple[str, ...]] = []


def record(scenario: str, combination: str, outcome: Outcome, seconds: object) -> None:
    kinds = [fault.kind for fault in outcome.faults]
    report = outcome.report
    counts = (
        kinds.count("relay SIGKILL"), kinds.count("broker restart"),
        kinds.count("database restart"), sum(k.endswith("link cut") for k in kinds),
        report.committed, report.delivered, len(report.lost), len(report.ghosts),
        len(report.order_violations), report.duplicates, outcome.effects_applied,
    )  # fmt: skip
    ROWS.append((scenario, combination, *map(str, counts), str(seconds or "")))


def table() -> list[str]:
    widths = [max(len(row[i]) for row in (HEADER, *ROWS)) for i in range(len(HEADER))]
    return [
        "  ".join(cell.rjust(width) if n > 1 else cell.ljust(width)
                  for n, (cell, width) in enumerate(zip(row, widths, strict=True)))
        for row in (HEADER, *ROWS)
    ]  # fmt: skip
