"""Delivery of one claim: chains per (target, key), waves, and what is settled how."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from relaybox.core.circuit import CircuitBreaker, CircuitPolicy, CircuitState
from relaybox.core.publishing import PublishResult, permanent, timed_out, transient, unavailable
from relaybox.core.records import StoredMessage
from relaybox.core.retry import RetryPolicy
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay.delivery import Delivery, Settlement, chains
from tests.brokers import harness


def stored(seq: int, key: str | None, target: str = "default", attempts: int = 0) -> StoredMessage:
    return harness.stored("t", key, seq=seq, target=target, attempts=attempts)


def test_chains_group_by_target_and_key_in_seq_order() -> None:
    batch = [stored(3, "a"), stored(1, "a"), stored(2, None), stored(4, "a", "other"),
             stored(5, None), stored(6, "b")]  # fmt: skip
    assert [[m.seq for m in chain] for chain in chains(batch)] == [[1, 3], [2], [4], [5], [6]]


KEYS = [None, *(f"k{n}" for n in range(40))]


@given(
    st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(["default", "other"])), max_size=30),
    st.randoms(use_true_random=False),
)
def test_chains_are_each_target_and_keys_rows_in_seq_order(
    rows: list[tuple[str | None, str]], rng: random.Random
) -> None:
    """Batches of distinct (target, key)s (a chain each, made at once) and batches that
    share some, in any order: the chains are the same as grouping row by row."""
    seqs = list(range(1, len(rows) + 1))
    rng.shuffle(seqs)
    batch = [stored(seq, key, target) for seq, (key, target) in zip(seqs, rows, strict=True)]
    expected: list[list[StoredMessage]] = []
    by_key: dict[tuple[str, str], list[StoredMessage]] = {}
    for message in sorted(batch, key=lambda m: m.seq):
        if message.key is None:
            expected.append([message])
        elif (message.target, message.key) in by_key:
            by_key[(message.target, message.key)].append(message)
        else:
            expected.append(by_key.setdefault((message.target, message.key), [message]))
    assert [[m.seq for m in chain] for chain in chains(batch)] == [
        [m.seq for m in chain] for chain in expected
    ]


class Recorder(MemoryPublisher):
    def __init__(self, outcomes: dict[int, PublishResult]) -> None:
        super().__init__()
        self.calls: list[list[int]] = []
        self._outcomes = outcomes

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        self.calls.append([m.seq for m in messages])
        results = await super().publish(messages)
        return [self._outcomes.get(m.seq, r) for m, r in zip(messages, results, strict=True)]


def delivery(
    publisher: MemoryPublisher, max_attempts: int = 5, *, hold_keys: bool = False
) -> Delivery:
    retry = RetryPolicy(base_delay=1.0, jitter=0.0, max_attempts=max_attempts)
    circuits = {"default": CircuitBreaker(CircuitPolicy(failure_threshold=100))}
    return Delivery(
        {"default": publisher}, circuits, retry, publish_timeout=1.0, hold_keys=hold_keys
    )


async def test_a_call_never_carries_two_messages_of_one_key() -> None:
    publisher = Recorder({})
    settlement = Settlement()
    await delivery(publisher).run(
        [stored(1, "a"), stored(2, "a"), stored(3, "b"), stored(4, None)], settlement
    )
    assert publisher.calls == [[1, 3, 4], [2]]
    assert settlement.published == [1, 3, 4, 2]


async def test_a_transient_failure_stops_its_chain_and_hands_the_rest_back() -> None:
    publisher = Recorder({2: transient("down")})
    settlement = Settlement()
    batch = [stored(1, "a"), stored(2, "a", attempts=2), stored(3, "a"), stored(4, "b")]
    await delivery(publisher).run(batch, settlement)
    assert settlement.published == [1, 4]
    assert [(f.seq, f.error, f.retry_in) for f in settlement.failed] == [(2, "down", 4.0)]
    assert settlement.released == [3]  # not attempted, no attempt counted
    assert publisher.calls == [[1, 4], [2]]


async def test_an_unreachable_broker_costs_no_attempt() -> None:
    publisher = MemoryPublisher()
    publisher.down()
    settlement = Settlement()
    batch = [stored(1, "a", attempts=4), stored(2, "a"), stored(3, "b", attempts=4)]
    await delivery(publisher, max_attempts=5).run(batch, settlement)
    assert not settlement.failed  # each was one failure from the limit
    assert not settlement.abandoned
    assert sorted(settlement.released) == [1, 2, 3]


async def test_unreachable_is_not_believed_when_the_same_call_confirmed_others() -> None:
    publisher = Recorder({2: unavailable("refused")})
    settlement = Settlement()
    await delivery(publisher).run([stored(1, "a"), stored(2, "b")], settlement)
    assert settlement.published == [1]
    assert [(f.seq, f.error) for f in settlement.failed] == [(2, "refused")]


class Silent(MemoryPublisher):
    """A broker that takes the call and never answers."""

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_broker_that_never_answers_costs_no_attempt_and_opens_the_circuit() -> None:
    circuit = CircuitBreaker(CircuitPolicy(failure_threshold=3))
    retry = RetryPolicy(base_delay=1.0, jitter=0.0, max_attempts=2)
    silent = Delivery({"default": Silent()}, {"default": circuit}, retry, publish_timeout=0.01)
    for _ in range(3):
        settlement = Settlement()
        await silent.run([stored(1, "a", attempts=1), stored(2, "a")], settlement)
        assert settlement.released == [1, 2]  # the broker may hold 1: not its last attempt
        assert not settlement.failed
        assert not settlement.abandoned
    assert circuit.state is CircuitState.OPEN
    assert silent.counters["default"].unavailable == 3


async def test_no_answer_in_time_costs_no_attempt_even_beside_confirmed_messages() -> None:
    publisher = Recorder({2: timed_out("no ack in time")})
    settlement = Settlement()
    await delivery(publisher, max_attempts=1).run([stored(1, "a"), stored(2, "b")], settlement)
    assert settlement.published == [1]
    assert settlement.released == [2]
    assert not settlement.failed
    assert not settlement.abandoned


async def test_permanent_failures_and_exhausted_retries_are_abandoned() -> None:
    publisher = Recorder({1: permanent("too large"), 3: transient("down")})
    settlement = Settlement()
    batch = [stored(1, "a"), stored(2, "a"), stored(3, "b", attempts=2)]
    await delivery(publisher, max_attempts=3).run(batch, settlement)
    assert [(f.seq, f.error) for f in settlement.abandoned] == [(1, "too large"), (3, "down")]
    assert settlement.published == [2]  # the key goes on after an abandoned message


async def test_holding_the_keys_a_given_up_message_hands_its_chain_back() -> None:
    publisher = Recorder({1: permanent("too large"), 4: transient("down"), 6: permanent("no")})
    settlement = Settlement()
    batch = [stored(1, "a"), stored(2, "a"), stored(3, "a"), stored(4, "b", attempts=2),
             stored(5, "b"), stored(6, None), stored(7, None)]  # fmt: skip
    await delivery(publisher, max_attempts=3, hold_keys=True).run(batch, settlement)
    assert [(f.seq, f.error) for f in settlement.abandoned] == [
        (1, "too large"), (4, "down"), (6, "no"),
    ]  # fmt: skip
    assert sorted(settlement.released) == [2, 3, 5]  # they wait behind the held message
    assert settlement.published == [7]
    assert publisher.calls == [[1, 4, 6, 7]]


async def test_a_publisher_that_raises_or_miscounts_fails_transiently() -> None:
    class Broken(MemoryPublisher):
        async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
            if len(messages) > 1:
                raise ConnectionError("reset by peer")
            return []

    settlement = Settlement()
    await delivery(Broken()).run([stored(1, "a"), stored(2, "b")], settlement)
    assert [f.error for f in settlement.failed] == ["ConnectionError: reset by peer"] * 2
    settlement = Settlement()
    await delivery(Broken()).run([stored(1, "a")], settlement)
    assert [f.error for f in settlement.failed] == ["publisher returned a wrong number of results"]

    class Nothing(MemoryPublisher):
        async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
            return None  # type: ignore[return-value]

    settlement = Settlement()
    await delivery(Nothing()).run([stored(1, "a")], settlement)
    assert [f.error for f in settlement.failed] == ["publisher returned a wrong number of results"]


async def test_lost_lease_stops_further_waves() -> None:
    publisher = Recorder({})
    settlement = Settlement()
    calls = iter([True, False])
    await delivery(publisher).run([stored(1, "a"), stored(2, "a")], settlement, lambda: next(calls))
    assert publisher.calls == [[1]]
    assert settlement.published == [1]
    assert not settlement.released  # not ours any more: nothing to record for seq 2


async def test_a_failure_s_words_are_kept_without_the_secrets_of_urls_in_them() -> None:
    said = "connection to amqp://relay:hunter2@mq.internal:5672/ refused; retry ?token=t0k3n"
    publisher = Recorder({1: permanent(said), 2: transient(said)})
    settlement = Settlement()
    await delivery(publisher).run([stored(1, "a"), stored(2, "b")], settlement)
    kept = [f.error for f in settlement.abandoned + settlement.failed]
    assert len(kept) == 2
    for error in kept:
        assert "hunter2" not in error
        assert "t0k3n" not in error
        assert "mq.internal:5672" in error  # what helps an operator stays
