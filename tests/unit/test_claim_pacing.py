"""Each fact that steers a claim beside batches in flight, one by one (relay/pacing.py).
tests/integration/test_relay_engine.py shows them at work in a relay."""

from __future__ import annotations

import datetime
import uuid

from relaybox.core.records import StoredMessage
from relaybox.relay.pacing import MOST_FUTILE, ClaimPacing

BATCH = 4


def rows(*keys: str | None) -> list[StoredMessage]:
    now = datetime.datetime.now(datetime.UTC)
    return [
        StoredMessage(
            seq,
            uuid.uuid4(),
            "default",
            False,
            "t",
            key,
            0,
            "T",
            "text/plain",
            b"",
            {},
            None,
            None,
            None,
            None,
            now,
            0,
        )
        for seq, key in enumerate(keys, 1)
    ]


def test_a_deep_batch_makes_the_next_claim_wait_for_a_settle() -> None:
    pacing = ClaimPacing(BATCH)
    pacing.took(rows("a", "a", "b"), 3, beside=False)
    assert pacing.deep
    assert pacing.wait_for_a_settle(in_flight=True)
    assert not pacing.wait_for_a_settle(in_flight=False)  # nothing in flight: claim


def test_a_deep_batch_read_while_reads_followed_holds_claims_once_they_no_longer_do() -> None:
    """Reads that follow the rows in flight find the keys' next rows beside a deep
    batch; once a settle stops them following, the same batch makes claims wait."""
    pacing = ClaimPacing(BATCH)
    pacing.follows = True
    pacing.took(rows("a", "a"), 2, beside=False)
    assert not pacing.wait_for_a_settle(in_flight=True)
    pacing.follows = False  # a batch beside it left rows of its keys in the table
    pacing.found_nothing(beside=False)  # an empty claim tells nothing of the batch
    assert pacing.wait_for_a_settle(in_flight=True)
    pacing.took(rows("a", "b"), 2, beside=False)
    assert not pacing.wait_for_a_settle(in_flight=True)


def test_keyless_rows_and_distinct_keys_are_not_deep() -> None:
    pacing = ClaimPacing(BATCH)
    pacing.took(rows(None, None, "a", "b"), 4, beside=False)
    assert not pacing.deep
    assert not pacing.wait_for_a_settle(in_flight=True)


def test_the_same_key_on_two_targets_is_two_chains() -> None:
    pacing = ClaimPacing(BATCH)
    first, second = rows("a", "a")
    pacing.took([first, second._replace(target="audit")], 2, beside=False)
    assert not pacing.deep


def test_only_a_full_batch_makes_claims_run_beside_it() -> None:
    pacing = ClaimPacing(BATCH)
    pacing.took(rows("a", "b", "c", "d"), BATCH, beside=False)
    assert pacing.full
    assert pacing.beside(in_flight=True)
    assert not pacing.beside(in_flight=False)
    pacing.took(rows("a"), 1, beside=False)
    assert not pacing.full
    assert not pacing.beside(in_flight=True)


def test_empty_claims_beside_full_batches_hold_for_1_2_4_up_to_32_settles() -> None:
    pacing = ClaimPacing(BATCH)
    holds = []
    for _ in range(MOST_FUTILE + 2):
        pacing.found_nothing(beside=True)
        holds.append(pacing.hold)
    assert holds == [1, 2, 4, 8, 16, 32, 32, 32]
    assert pacing.wait_for_a_settle(in_flight=True)
    for _ in range(31):
        pacing.settled()
    assert pacing.wait_for_a_settle(in_flight=True)
    pacing.settled()
    assert not pacing.wait_for_a_settle(in_flight=True)
    pacing.settled()
    assert pacing.hold == 0  # never below zero


def test_an_empty_claim_with_nothing_in_flight_holds_nothing() -> None:
    pacing = ClaimPacing(BATCH)
    pacing.found_nothing(beside=False)
    assert (pacing.futile, pacing.hold) == (0, 0)


def test_a_claim_beside_that_pays_off_or_a_short_one_ends_the_hold() -> None:
    paid_off, drained, still_full = ClaimPacing(BATCH), ClaimPacing(BATCH), ClaimPacing(BATCH)
    for pacing in (paid_off, drained, still_full):
        pacing.found_nothing(beside=True)
        pacing.found_nothing(beside=True)
    paid_off.took(rows("a", "b", "c", "d"), BATCH, beside=True)
    drained.took(rows("a"), 1, beside=False)
    still_full.took(rows("a", "b", "c", "d"), BATCH, beside=False)
    assert (paid_off.futile, paid_off.hold) == (0, 0)
    assert (drained.futile, drained.hold) == (0, 0)
    assert (still_full.futile, still_full.hold) == (2, 2)  # full, but not beside: keeps it
