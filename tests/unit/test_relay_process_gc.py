"""The garbage collector as a relay process sets it while the relay runs, and as it
was once the relay stopped (a management command may be called from code that goes on)."""

from __future__ import annotations

import gc
import weakref

from relaybox.relay.loops import RELAY_GC_THRESHOLD, collector_for_a_relay


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_what_lives_at_start_is_frozen_and_young_objects_wait_longer_then_all_is_back() -> None:
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with collector_for_a_relay():
        assert gc.get_freeze_count() > 1000  # the imports' objects at least
        assert gc.get_threshold() == (RELAY_GC_THRESHOLD, *before[1:])
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle made while the relay runs is still collected
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
