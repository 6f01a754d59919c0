"""Publishing one claimed batch in per-key order, and sorting out what happened.

A batch is cut into chains, one per (target, key) in sequence order; a keyless message
is a chain of its own. Each wave sends the head of every chain, so one publish call
never carries two messages of one key: a key's next message goes out only after the
broker confirmed the previous one. When a message fails, the rest of its chain is
handed back untouched (no attempt counted) and stays behind it in the table.

A message given up on (a permanent error, or the last attempt failed) is final: the
rest of its chain goes on after it. With `hold_keys` (the hold-the-key policy) a
message with a key is held in the table instead, so the rest of its chain is handed
back and waits behind it.

A transient failure counts an attempt against its message, except when the broker
could not be reached at all (`PublishResult.unavailable`, and no message of the call
confirmed) or did not answer in time (`PublishResult.timed_out`: it may hold the
message): then the message is handed back as it was and the target's circuit counts
the failure, so an outage longer than the whole retry schedule, or a broker that
takes connections and never answers, abandons nothing. Only a broker's answer counts an
attempt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import operator
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from relaybox.core.circuit import CircuitBreaker, CircuitState
from relaybox.core.publishing import (
    ACKED,
    Outcome,
    PublishResult,
    timed_out,
    transient,
    unavailable,
)
from relaybox.core.records import Failure, StoredMessage
from relaybox.core.retry import RetryPolicy
from relaybox.core.signals import TargetCounters
from relaybox.core.urls import mask_url
from relaybox.ports import Publisher
from relaybox.relay.activity import Tally

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Settlement:
    """What to record for one claim: one statement per non-empty list."""

    published: list[int] = dataclasses.field(default_factory=list)
    failed: list[Failure] = dataclasses.field(default_factory=list)
    abandoned: list[Failure] = dataclasses.field(default_factory=list)
    released: list[int] = dataclasses.field(default_factory=list)

    def seqs(self) -> set[int]:
        """Every row this settlement says something about."""
        return {
            *self.published, *self.released,
            *(f.seq for f in self.failed), *(f.seq for f in self.abandoned),
        }  # fmt: skip


def chains(messages: Sequence[StoredMessage]) -> list[list[StoredMessage]]:
    """Messages grouped by (target, key), each group in sequence order."""
    seqs = [m.seq for m in messages]
    if not all(map(operator.lt, seqs, seqs[1:])):  # storages hand them out in order
        messages = sorted(messages, key=lambda m: m.seq)
    if len(set(target_keys(messages))) == len(messages):
        # Each its own (target, key), as in a batch of many keys: a chain each, made
        # without a Python step per message (keyless ones of a target share the pair
        # (target, None), and take the general way below).
        return [[message] for message in messages]
    by_key: dict[tuple[str, str], list[StoredMessage]] = {}
    result: list[list[StoredMessage]] = []
    for message in messages:
        if message.key is None:
            result.append([message])
            continue
        chain = by_key.get((message.target, message.key))
        if chain is None:
            chain = by_key[(message.target, message.key)] = []
            result.append(chain)
        chain.append(message)
    return result


def target_keys(messages: Sequence[StoredMessage]) -> Iterator[tuple[str, str | None]]:
    """Each message's (target, key), made in C."""
    return zip(map(_TARGET, messages), map(_KEY, messages), strict=True)


_TARGET, _KEY = operator.attrgetter("target"), operator.attrgetter("key")


class Delivery:
    """Publishes one claim wave by wave and collects its settlement."""

    def __init__(
        self,
        publishers: Mapping[str, Publisher],
        circuits: Mapping[str, CircuitBreaker],
        retry: RetryPolicy,
        publish_timeout: float,
        rng: random.Random | None = None,
        *,
        hold_keys: bool = False,
    ) -> None:
        self._publishers = publishers
        self._circuits = circuits
        self._retry = retry
        self._timeout = publish_timeout
        self._hold_keys = hold_keys
        self._rng = rng or random.Random()
        #: Per target, what came of its messages (read by `Relay.target_counters`).
        self.counters = {target: TargetCounters() for target in publishers}
        #: Per target, what came of its messages since the activity was last written.
        self.tallies = {target: Tally() for target in publishers}

    async def run(
        self,
        messages: Sequence[StoredMessage],
        settlement: Settlement,
        still_ours: Callable[[], bool] | None = None,
    ) -> None:
        """Publish `messages`, filling `settlement` as outcomes arrive (so a cancelled
        delivery still tells what it confirmed).

        The work starts one turn of the event loop later, so that whatever launched the
        batch goes on first: a claim loop, which launches a batch and at once reads the
        next, sends that read before this batch is grouped, published and settled, and
        the database runs it meanwhile instead of waiting for that work."""
        await asyncio.sleep(0)
        active = chains(messages)
        depth = 0  # wave `depth` sends each active chain's message at that position
        while active:
            if still_ours is not None and not still_ours():
                # The lease ran out: someone else may hold these rows now. Publish no more
                # and record nothing for the rest (their marks would be refused anyway).
                logger.warning("lease lost mid-batch", extra={"action": "lease_lost"})
                break
            wave = [chain[depth] for chain in active]
            results = await self._publish_wave(wave)
            survivors = []
            published = settlement.published
            depth += 1
            for chain, message, result in zip(active, wave, results, strict=True):
                if result.outcome is Outcome.ACKED:  # the rule: no call to _settle_one
                    published.append(message.seq)
                    if len(chain) > depth:
                        survivors.append(chain)
                elif self._settle_one(message, result, settlement) and len(chain) > depth:
                    survivors.append(chain)
                else:
                    settlement.released.extend(m.seq for m in chain[depth:])
            active = survivors

    def held_back(
        self, messages: Sequence[StoredMessage], settlement: Settlement
    ) -> frozenset[tuple[str, str]]:
        """The (target, key)s of `messages` whose next rows may not follow once
        `settlement` is recorded: a row of theirs here was not published, nor abandoned
        where that is final (a held one keeps its key waiting, see the module's
        docstring)."""
        if len(settlement.published) == len(messages):  # the rule: every row published
            return frozenset()
        final = set(settlement.published)
        if not self._hold_keys:
            final.update(failure.seq for failure in settlement.abandoned)
        return frozenset(
            (m.target, m.key) for m in messages if m.key is not None and m.seq not in final
        )

    def _settle_one(self, message: StoredMessage, result: PublishResult, out: Settlement) -> bool:
        """Record one outcome; True if the rest of the message's chain may go on."""
        if result.outcome is Outcome.ACKED:
            out.published.append(message.seq)
            return True
        # A broker's or receiver's words are stored and shown to operators: any URL in
        # them leaves without its secrets.
        error = mask_url(result.error or result.outcome.value)
        counters, tally = self.counters[message.target], self.tallies[message.target]
        if result is not _OPEN:  # the circuit's own pause is no error of the broker's
            tally.failure(error)
        if result.outcome is Outcome.PERMANENT:
            return self._give_up(message, error, out)
        if result.unavailable or result.timed_out:  # down, paused or silent: no verdict
            counters.unavailable += 1
            out.released.append(message.seq)
            return False
        failures = message.attempts + 1
        if self._retry.exhausted(failures):
            return self._give_up(message, error, out)
        counters.retried += 1
        tally.failed += 1
        out.failed.append(Failure(message.seq, error, self._retry.delay(failures, self._rng)))
        return False

    def _give_up(self, message: StoredMessage, error: str, out: Settlement) -> bool:
        """Abandon `message` (or hold it, see the module's docstring); True if the rest
        of its chain may go on: abandoned is final, the key's next message may follow
        it, where a held one keeps it waiting."""
        self.counters[message.target].abandoned += 1
        self.tallies[message.target].abandoned += 1
        out.abandoned.append(Failure(message.seq, error))
        return not (self._hold_keys and message.key is not None)

    async def _publish_wave(self, wave: list[StoredMessage]) -> Sequence[PublishResult]:
        """The results of `wave`, in its order; one publish call per target, at once."""
        target = wave[0].target
        if all(message.target == target for message in wave):
            return await self._publish_target(target, wave)
        by_target: dict[str, list[StoredMessage]] = {}
        for message in wave:
            by_target.setdefault(message.target, []).append(message)
        results = await asyncio.gather(
            *(self._publish_target(target, batch) for target, batch in by_target.items())
        )
        outcomes: dict[int, PublishResult] = {}
        for batch, batch_results in zip(by_target.values(), results, strict=True):
            outcomes.update(zip((m.seq for m in batch), batch_results, strict=True))
        return [outcomes[message.seq] for message in wave]

    async def _publish_target(
        self, target: str, batch: list[StoredMessage]
    ) -> Sequence[PublishResult]:
        circuit = self._circuits[target]
        state = circuit.state
        if state is CircuitState.OPEN:
            return [_OPEN] * len(batch)
        if state is CircuitState.HALF_OPEN:  # one message probes; the rest wait their turn
            if not circuit.allow_probe():
                return [_OPEN] * len(batch)
            try:
                probe, _ = await self._call(target, batch[:1])
            except BaseException:  # cancelled: no result, so another probe may go
                circuit.probe_abandoned()
                raise
            if probe[0].outcome is Outcome.TRANSIENT:
                circuit.record_failure()
                return [_OPEN] * len(batch)  # a failed probe burns no attempt
            circuit.record_success()
            return [*probe, *await self._publish_target(target, batch[1:])] if batch[1:] else probe
        results, acked = await self._call(target, batch)
        if acked:
            circuit.record_success()
            # The broker confirmed others of this call: it is up, so a failure here is
            # the message's own and counts an attempt, whatever the publisher thought.
            if acked < len(results) and any(r.unavailable for r in results):
                results = [
                    dataclasses.replace(r, unavailable=False) if r.unavailable else r
                    for r in results
                ]
        elif all(r.outcome is Outcome.TRANSIENT for r in results):
            circuit.record_failure()
            if circuit.state is CircuitState.OPEN:
                logger.warning(
                    "circuit opened for target %s", target,
                    extra={"action": "circuit_open", "target": target},
                )  # fmt: skip
        return results

    async def _call(
        self, target: str, batch: list[StoredMessage]
    ) -> tuple[Sequence[PublishResult], int]:
        """The call's results, and how many of them the broker confirmed."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._timeout):
                results = await self._publishers[target].publish(batch)
        except TimeoutError:
            silent = timed_out(f"no answer from the broker within {self._timeout:g} s")
            results = [silent] * len(batch)
        except Exception as error:  # noqa: BLE001 - any publisher failure is retried later
            logger.warning("publish to target %s raised %s", target, mask_url(repr(error)),
                           extra={"action": "publish_error", "target": target})  # fmt: skip
            results = [transient(f"{type(error).__name__}: {error}")] * len(batch)
        if not isinstance(results, Sequence) or len(results) != len(batch):
            results = [transient("publisher returned a wrong number of results")] * len(batch)
        return results, self._count(target, batch, results, started)

    def _count(
        self, target: str, batch: list[StoredMessage], results: Sequence[PublishResult],
        started: float,
    ) -> int:  # fmt: skip
        """Count the call, per call and not per message, and return how many were acked.
        relaybox's publishers answer success with the one `ACKED`, which `list.count`
        matches by identity in C, far cheaper than reading each outcome; results made
        elsewhere are counted by their outcome."""
        counters = self.counters[target]
        counters.publish_seconds.observe(time.monotonic() - started)
        if not results:
            return 0
        if results[0] is ACKED:
            acked = results.count(ACKED)
        else:
            acked = list(map(_OUTCOME, results)).count(Outcome.ACKED)
        if acked:
            counters.acked += acked
            # The writer's clock, which may be ahead of ours: never a negative lag.
            lag = max(0.0, time.time() - batch[0].occurred_at.timestamp())
            counters.lag_seconds.observe(lag)
            tally = self.tallies[target]
            tally.published += acked
            tally.lag = tally.lag.observed(lag)
        return acked


_OUTCOME = operator.attrgetter("outcome")
#: Not a failure of the message: its target paused.
_OPEN = unavailable("circuit open")
