"""A history checker for relaybox runs: what was committed against what was delivered.

Writers record, per message, whether its transaction committed, rolled back, or ended
without the writer learning which (the connection died during COMMIT: "unknown").
Consumers record every delivery, in the order they received it. `check` then reports:

- lost: committed but never delivered;
- ghosts: rolled back but delivered (an uncommitted message published);
- order violations: for a key, a message first delivered after a message that was
  committed later for that key (each key is written by one writer, in order, so the
  writer's order is the commit order);
- duplicates: deliveries beyond the first of each id (allowed: at least once).

Unknown outcomes may be delivered or not; either is fine, but once delivered they take
their place in their key's order like any committed message.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True, slots=True)
class Written:
    id: str
    key: str | None
    outcome: str  # "committed", "rolled_back" or "unknown"


@dataclasses.dataclass(frozen=True, slots=True)
class Delivered:
    id: str
    key: str | None


@dataclasses.dataclass
class Report:
    committed: int
    rolled_back: int
    unknown: int
    delivered: int
    lost: list[str]
    ghosts: list[str]
    order_violations: list[tuple[str, str, str]]  # (key, earlier id, later id)
    duplicates: int
    unexpected: list[str]  # delivered, never written by this run

    @property
    def ok(self) -> bool:
        return not (self.lost or self.ghosts or self.order_violations or self.unexpected)

    def summary(self) -> str:
        return (
            f"committed={self.committed} rolled_back={self.rolled_back} "
            f"unknown={self.unknown} delivered={self.delivered} lost={len(self.lost)} "
            f"ghosts={len(self.ghosts)} order_violations={len(self.order_violations)} "
            f"duplicates={self.duplicates} unexpected={len(self.unexpected)}"
        )


def check(written: Iterable[Written], delivered: Iterable[Delivered]) -> Report:
    writes = list(written)
    deliveries = list(delivered)
    outcome = {w.id: w.outcome for w in writes}
    position: dict[str, int] = {}  # index of a message in its key's write order
    per_key: Counter[str | None] = Counter()
    for w in writes:
        position[w.id] = per_key[w.key]
        per_key[w.key] += 1
    seen: Counter[str] = Counter(d.id for d in deliveries)
    lost = [w.id for w in writes if w.outcome == "committed" and w.id not in seen]
    ghosts = [w.id for w in writes if w.outcome == "rolled_back" and w.id in seen]
    unexpected = sorted({d.id for d in deliveries if d.id not in outcome})
    violations: list[tuple[str, str, str]] = []
    last: dict[str, tuple[int, str]] = {}  # key -> (position, id) of its latest first delivery
    first_seen: set[str] = set()
    for d in deliveries:
        if d.id in first_seen or d.id not in outcome or d.key is None:
            first_seen.add(d.id)
            continue
        first_seen.add(d.id)
        here = position[d.id]
        previous = last.get(d.key)
        if previous is not None and here < previous[0]:
            violations.append((d.key, d.id, previous[1]))
        if previous is None or here > previous[0]:
            last[d.key] = (here, d.id)
    counts = Counter(w.outcome for w in writes)
    return Report(
        committed=counts["committed"],
        rolled_back=counts["rolled_back"],
        unknown=counts["unknown"],
        delivered=len(deliveries),
        lost=lost,
        ghosts=ghosts,
        order_violations=violations,
        duplicates=sum(n - 1 for n in seen.values()),
        unexpected=unexpected,
    )
