"""What a publisher reports for each message, and what it can promise."""

from __future__ import annotations

import dataclasses
import enum


class Outcome(enum.StrEnum):
    #: The broker confirmed it (publisher confirm, JetStream ack, acks=all, 2xx).
    ACKED = "acked"
    #: Worth trying again later: connection lost, timeout, throttled, broker down.
    TRANSIENT = "transient"
    #: Will never succeed: too large, unroutable, rejected; the message is abandoned.
    PERMANENT = "permanent"


@dataclasses.dataclass(frozen=True, slots=True)
class PublishResult:
    outcome: Outcome
    error: str | None = None
    #: A TRANSIENT failure because the broker could not be reached at all (not
    #: connected, connection refused or lost before a reply). It says nothing about the
    #: message, so it costs the message no attempt: an outage, however long, abandons
    #: nothing; the target's circuit pauses it instead.
    unavailable: bool = False
    #: A TRANSIENT failure because the broker did not answer in time: it may have
    #: stored the message. It costs the message no attempt either (a broker that takes
    #: connections and never answers would otherwise abandon messages it may hold); the
    #: message is published again, and a broker that deduplicates drops the copy. The
    #: target's circuit counts the failure.
    timed_out: bool = False

    @property
    def acked(self) -> bool:
        return self.outcome is Outcome.ACKED


ACKED = PublishResult(Outcome.ACKED)


def transient(error: str) -> PublishResult:
    return PublishResult(Outcome.TRANSIENT, error)


def unavailable(error: str) -> PublishResult:
    """The broker is unreachable: retried without counting an attempt."""
    return PublishResult(Outcome.TRANSIENT, error, unavailable=True)


def timed_out(error: str) -> PublishResult:
    """No answer in time, so the outcome is unknown: retried without counting an attempt."""
    return PublishResult(Outcome.TRANSIENT, error, timed_out=True)


def permanent(error: str) -> PublishResult:
    return PublishResult(Outcome.PERMANENT, error)


@dataclasses.dataclass(frozen=True, slots=True)
class PublisherFeatures:
    """What a publisher's broker promises: the broker conformance tests hold each
    publisher to what it declares here."""

    #: The broker drops a second copy carrying the same message id.
    deduplicates: bool = False
    #: One publish() call may carry many messages (sent pipelined, confirmed together).
    batching: bool = True


class Presence(enum.StrEnum):
    """What setting up a target found for one thing it needs on the broker."""

    #: It was missing, and is there now.
    CREATED = "created"
    #: It was there already, and was left as it is.
    EXISTED = "existed"
    #: Declared without asking first, as the broker cannot say whether it was there
    #: (an AMQP binding): it is there now.
    ENSURED = "ensured"


@dataclasses.dataclass(frozen=True, slots=True)
class Declared:
    """One thing a target needs on its broker (an exchange, a queue, a binding, a
    stream, a topic, a consumer group), after `relaybox setup` saw to it."""

    kind: str
    name: str
    presence: Presence

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: {self.presence}"
