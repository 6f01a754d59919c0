"""What every broker consumer shares: decode, process, then settle with the broker.

A broker consumer receives from its broker, decodes each delivery into an `Incoming`,
hands it to a `Consumer` (handler + inbox + transaction), and settles the delivery by
the verdict: `ACK` after the transaction committed (the handler's effects, a duplicate
skipped, or the message parked once its `max_attempts` ran out), `RETRY` when the
handler raised with attempts left (the transaction rolled back: the broker must deliver
it again), `REJECT` when the delivery is not a readable envelope (it never will be:
drop it, or dead-letter it where the broker can).

Beside the deliveries, `run` applies the parked messages an operator asked to replay
(`Consumer.maintain`).

The settings the consumers share are named and defaulted here, once (`SharedSettings`);
their backoffs, after a handler failed and after a lost connection, are
`relaybox.core.retry.RetryPolicy` delays.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import enum
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Self

from relaybox.core.config import load_dataclass
from relaybox.core.incoming import Incoming
from relaybox.core.retry import RetryPolicy
from relaybox.errors import ConfigurationError, EnvelopeError
from relaybox.inbox.consumer import DEFAULT_MAX_ATTEMPTS
from relaybox.inbox.processor import Processor

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class SharedSettings:
    """What the broker consumers have in common, each under one name with one default.

    Every consumer's constructor takes the broker's address first, as `url`, then
    those of these settings that apply to its broker, under these names and defaulting
    to `DEFAULTS`; its broker's own settings keep its broker's names.
    """

    #: Deliveries taken from the broker ahead of processing, unacknowledged: RabbitMQ's
    #: prefetch count, a JetStream fetch, an XREADGROUP's COUNT, a Kafka poll's records,
    #: MQTT's Receive Maximum. More keeps a fast handler busy; fewer holds less back
    #: from competing consumers, and less waits behind a slow message.
    prefetch: int = 10
    #: Seconds a pull waits for new deliveries before asking again (a long poll).
    fetch_timeout: float = 1.0
    #: Seconds before a delivery whose handler failed is tried again, doubled per
    #: further failure of it...
    retry_delay: float = 1.0
    #: ... up to this.
    max_retry_delay: float = 30.0
    #: Attempts at a message before it is parked in the inbox's database and
    #: acknowledged (`relaybox.inbox.parked`); counted across redeliveries.
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    #: Seconds to connect and set up (declare, bind, subscribe): `start()` fails then.
    timeout: float = 10.0
    #: Seconds before reconnecting after a lost connection, doubled per further failed
    #: attempt up to `MAX_RECONNECT_WAIT` (or this, if it is longer).
    reconnect_wait: float = 1.0

    @classmethod
    def load(
        cls,
        config: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        **given: Any,
    ) -> SharedSettings:
        """The settings from `given` (the program's own command line), then the
        environment (RELAYBOX_CONSUMER_<FIELD>, e.g. RELAYBOX_CONSUMER_PREFETCH), then
        the [consumer] section of the TOML file `config` (or RELAYBOX_CONFIG's), then
        the defaults. An unknown key or a bad value is a `ConfigurationError` naming it
        and where it came from."""
        return load_dataclass(cls, "consumer", path=config, environ=environ, given=given)

    def arguments(self, consumer_class: Callable[..., object]) -> dict[str, Any]:
        """The settings `consumer_class`'s constructor takes, as its keyword arguments:
        `NatsConsumer(url, consumer, **settings.arguments(NatsConsumer))`."""
        taken = inspect.signature(consumer_class).parameters
        return {name: value for name, value in dataclasses.asdict(self).items() if name in taken}


DEFAULTS = SharedSettings()
#: The longest wait between reconnect attempts while a broker stays unreachable.
MAX_RECONNECT_WAIT = 10.0
#: Seconds a stopping consumer gives its last write of the activity.
ACTIVITY_GRACE = 2.0

#: Stopping cancels the consuming task, and again every STOP_GRACE seconds while it runs
#: on, STOP_ROUNDS times at most (see `BrokerConsumer.stop`).
STOP_GRACE = 5.0
STOP_ROUNDS = 3


def check_positive(**settings: float) -> None:
    """Refuse a count, timeout or wait that is not above zero, naming it."""
    for name, value in settings.items():
        if not value > 0:
            raise ConfigurationError(f"{name}={value!r}: must be above zero")


def redelivery_policy(retry_delay: float, max_retry_delay: float) -> RetryPolicy:
    """The backoff before a delivery whose handler failed is tried again."""
    if not 0 <= retry_delay <= max_retry_delay:
        raise ConfigurationError(
            f"retry_delay={retry_delay!r}, max_retry_delay={max_retry_delay!r}: "
            "need 0 <= retry_delay <= max_retry_delay"
        )
    return RetryPolicy(base_delay=retry_delay, max_delay=max_retry_delay)


class Backoff:
    """Consecutive failures of one thing, and the wait before its next attempt: the
    policy's delay for that many failures; a success starts it over."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.failures = 0

    @classmethod
    def reconnects(cls, reconnect_wait: float) -> Backoff:
        """The waits between attempts to reach a broker again (`reconnect_wait`)."""
        check_positive(reconnect_wait=reconnect_wait)
        most = max(reconnect_wait, MAX_RECONNECT_WAIT)
        return cls(RetryPolicy(base_delay=reconnect_wait, max_delay=most))

    def failed(self) -> float:
        """Count a failure; return the seconds to wait before trying again."""
        self.failures += 1
        return self.policy.nominal_delay(self.failures)

    def succeeded(self) -> None:
        self.failures = 0

    async def wait(self) -> None:
        """Count a failure and wait as long as it says."""
        await asyncio.sleep(self.failed())


class Verdict(enum.Enum):
    ACK = "ack"
    RETRY = "retry"
    REJECT = "reject"


class BrokerConsumer(abc.ABC):
    """Runs a `Consumer` on one broker's deliveries; use as an async context manager
    (runs in a background task) or await `run()` (runs until cancelled)."""

    def __init__(self, consumer: Processor, *, max_attempts: int = DEFAULTS.max_attempts) -> None:
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigurationError(f"max_attempts={max_attempts!r}: must be at least 1")
        self.consumer = consumer
        self.max_attempts = max_attempts
        self.rejected = 0
        self.retried = 0
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Consume until cancelled, applying requested replays and writing the
        activity beside; the activity is written once more on the way out."""
        replays = asyncio.create_task(self.consumer.maintain(), name="relaybox-replays")
        try:
            await self.consume()
        finally:
            replays.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replays
            if self.consumer.activity_interval is not None:
                await close_within(self.consumer.record_activity(), ACTIVITY_GRACE)

    @abc.abstractmethod
    async def consume(self) -> None:
        """Connect, subscribe, call `self.ready()`, then consume until cancelled."""

    def ready(self) -> None:
        """Subclasses call this once they are subscribed and receiving."""
        self._ready.set()

    async def start(self, timeout: float = 30.0) -> None:
        """Start `run` in a background task; return once it is receiving."""
        self._task = asyncio.create_task(self.run(), name=f"relaybox-{type(self).__name__}")
        ready = asyncio.create_task(self._ready.wait())
        done, _ = await asyncio.wait({self._task, ready}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if ready not in done:
            ready.cancel()
            if self._task in done:
                self._task.result()  # raises what stopped it
            await self.stop()
            raise TimeoutError(f"{type(self).__name__} did not start within {timeout:g}s")

    async def stop(self) -> None:
        """Stop receiving; a message being processed is abandoned unacknowledged (its
        transaction rolls back or has committed: either way a redelivery is safe).

        A broker client may swallow a cancellation that lands at the wrong moment of a
        blocking read (redis-py has done so) and go on, or wait forever on its own
        connection's clean-up. So the consuming task is cancelled again every
        `STOP_GRACE` seconds until it ends, and after `STOP_ROUNDS` of them it is left
        behind with a warning: a consumer that stops must stop."""
        task, self._task = self._task, None
        if task is None:
            return
        for _ in range(STOP_ROUNDS):
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=STOP_GRACE)
            if done:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return
        logger.warning(
            "%s did not stop within %gs of being cancelled %d times; left behind",
            type(self).__name__, STOP_GRACE * STOP_ROUNDS, STOP_ROUNDS,
            extra={"action": "consumer_stop_abandoned"},
        )  # fmt: skip

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def handle(self, decode: Callable[[], Incoming], *, redelivered: bool = False) -> Verdict:
        """Decode one delivery and process it; the verdict says how to settle it.
        `redelivered`: the broker marks it as a redelivery but gives no count."""
        try:
            message = decode()
        except EnvelopeError as error:
            self.rejected += 1
            logger.error("rejected an unreadable delivery: %s", error,
                         extra={"action": "envelope_rejected"})  # fmt: skip
            return Verdict.REJECT
        try:
            await self.consumer.process(
                message, max_attempts=self.max_attempts, redelivered=redelivered
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # the handler's error: its transaction rolled back, redeliver
            self.retried += 1
            logger.exception(
                "handler failed for %s; it will be redelivered", message.id,
                extra={"action": "handler_failed", "message_id": message.id},
            )  # fmt: skip
            return Verdict.RETRY
        return Verdict.ACK


async def close_within(closing: Awaitable[object], seconds: float) -> None:
    """Await a client's close for at most `seconds`, ignoring its errors. A consumer that
    stops must stop: nats-py's close can wait forever on a connection that is
    reconnecting, and redis-py's on one cancelled in the middle of a blocking read."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(seconds):
            await closing
