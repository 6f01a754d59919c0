"""The checker finds each kind of anomaly, and passes a clean history with duplicates."""

from __future__ import annotations

from tests.chaos.checker import Delivered, Written, check


def writes() -> list[Written]:
    return [
        Written("a1", "a", "committed"),
        Written("a2", "a", "committed"),
        Written("a3", "a", "rolled_back"),
        Written("a4", "a", "committed"),
        Written("b1", "b", "unknown"),
        Written("b2", "b", "committed"),
        Written("n1", None, "committed"),
    ]


def test_a_clean_history_with_duplicates_passes() -> None:
    history = [Delivered(i, k) for i, k in
               [("n1", None), ("a1", "a"), ("b2", "b"), ("a2", "a"), ("a1", "a"),
                ("a4", "a"), ("a2", "a")]]  # fmt: skip
    report = check(writes(), history)
    assert report.ok, report.summary()
    assert report.duplicates == 2
    assert (report.committed, report.rolled_back, report.unknown) == (5, 1, 1)


def test_loss_ghost_reorder_and_strangers_are_reported() -> None:
    history = [Delivered(i, k) for i, k in
               [("a2", "a"), ("a1", "a"), ("a3", "a"), ("b1", "b"), ("b2", "b"),
                ("zz", "z")]]  # fmt: skip
    report = check(writes(), history)
    assert not report.ok
    assert sorted(report.lost) == ["a4", "n1"]
    assert report.ghosts == ["a3"]
    assert report.order_violations == [("a", "a1", "a2")]
    assert report.unexpected == ["zz"]


def test_an_unknown_outcome_delivered_late_is_an_order_violation() -> None:
    history = [Delivered("b2", "b"), Delivered("b1", "b")]
    report = check(writes(), history)
    assert report.order_violations == [("b", "b1", "b2")]
