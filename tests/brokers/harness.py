"""What the publisher conformance suite needs from each broker's test harness.

A harness knows one real broker: how to make a topic routable and read back what was
published to it (`prepare`, `received`), a message that broker refuses for good
(`rejected`), and how to start a throwaway instance of it that the test may stop and
start again (`throwaway`), never touching the shared service.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import datetime
import random
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Self

from relaybox.core.ids import uuid7
from relaybox.core.incoming import Incoming
from relaybox.core.publishing import PublisherFeatures
from relaybox.core.records import StoredMessage
from relaybox.ports import Publisher
from relaybox.publishers import open_publisher


@dataclasses.dataclass
class Received:
    """One message as a consumer of the broker got it."""

    payload: bytes
    #: CloudEvents attributes, decoded from the broker's binding (without the prefix).
    attributes: dict[str, str]
    #: The message's own headers, apart from the attributes.
    headers: dict[str, str]
    content_type: str | None = None
    #: The broker's own message key, where it has one (Kafka).
    key: str | None = None

    @classmethod
    def of(cls, incoming: Incoming, key: str | None = None) -> Received:
        """What relaybox's consumer decoded (`relaybox.consumers.<broker>.decode`)."""
        return cls(
            incoming.payload, dict(incoming.attributes), dict(incoming.headers),
            incoming.content_type, key,
        )  # fmt: skip

    @property
    def id(self) -> str:
        return self.attributes["id"]


#: How long a topic must stay unchanged before `BrokerHarness.wait_for` takes it as
#: settled: a copy the broker still had on the way (a late duplicate) arrives within it.
#: Short, since every test that reads a topic back pays it once.
QUIET = 0.3
#: ...and in how many reads in a row, whatever the clock says meanwhile.
QUIET_READS = 3


class BrokerHarness(abc.ABC):
    #: The publisher URL for this broker (the shared service, or a throwaway one).
    url: str
    #: What the publisher is expected to declare.
    features: PublisherFeatures
    #: Messages the broker acknowledged before a restart are still there after it.
    persistent: bool = True

    def publisher(self, **options: str) -> Publisher:
        url = self.url
        if options:
            url += ("&" if "?" in url else "?") + "&".join(f"{k}={v}" for k, v in options.items())
        return open_publisher(url)

    @abc.abstractmethod
    async def prepare(self, topic: str) -> None:
        """Make `topic` routable and start recording what is published to it."""

    @abc.abstractmethod
    async def received(self, topic: str) -> list[Received]:
        """Everything recorded on `topic` so far, in the broker's order."""

    @abc.abstractmethod
    def rejected(self, topic: str) -> StoredMessage:
        """A message on `topic` that this broker refuses for good (too large, unroutable)."""

    def throwaway(self) -> AbstractAsyncContextManager[RestartableHarness]:
        """A harness for a private instance of this broker, started on a free port."""
        raise NotImplementedError

    async def close(self) -> None:  # noqa: B027 - most harnesses have nothing to close
        """Delete what `prepare` made and disconnect."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def wait_for(
        self, topic: str, count: int, timeout: float = 15.0, *, settle: bool = True
    ) -> list[Received]:
        """At least `count` messages of `topic`, then every later one until the topic
        settles (see `settled`): a copy that arrives after the count was reached, such as
        a duplicate, is in the answer, so a test that counts copies sees it. Without
        `settle`, as soon as `count` are there (to act while more are on the way)."""
        deadline = time.monotonic() + timeout
        while True:
            found = await self.received(topic)
            if len(found) >= count:
                return await self.settled(topic, found, timeout) if settle else found
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(found)} of {count} messages arrived on {topic!r}")
            await asyncio.sleep(0.05)

    async def settled(self, topic: str, found: list[Received], timeout: float) -> list[Received]:
        """Read `topic` again until it stays the same for QUIET seconds and QUIET_READS
        reads in a row; every new arrival starts the quiet period over. Both must pass, so
        a test process too busy to read during the quiet period does not end it early.
        Messages that keep arriving end it after `timeout`, with what arrived by then."""
        give_up = time.monotonic() + timeout
        unchanged, since = 0, time.monotonic()
        while unchanged < QUIET_READS or time.monotonic() - since < QUIET:
            if time.monotonic() > give_up:
                break
            await asyncio.sleep(0.05)
            again = await self.received(topic)
            if len(again) != len(found):
                found, unchanged, since = again, 0, time.monotonic()
            else:
                unchanged += 1
        return found


class RestartableHarness(BrokerHarness):
    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop the broker process (SIGTERM, then SIGKILL), keeping its data directory."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Start it again on the same port; return once it accepts connections."""


def end_process(process: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """SIGTERM (a broker saves its data then), SIGKILL after `grace` s; wait for the exit."""
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def unique_topic() -> str:
    return f"rbtest.{uuid.uuid4().hex[:12]}"


#: Where free_port draws from: below the kernel's ephemeral range. A port that range
#: hands out (bind to port 0) can be taken, before the server it was picked for binds it,
#: as the local port of any outgoing connection on the machine, and a RabbitMQ node takes
#: seconds to boot: one failed so (eaddrinuse) while other tests made connections.
_LOWEST_PORT = 20000
_draw = random.SystemRandom()  # not the seeded `random`: each worker draws its own


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now, outside the ephemeral range (where
    that range leaves too little room below it, one the kernel hands out)."""
    top = _ephemeral_low()
    for _ in range(200 if top - _LOWEST_PORT >= 1000 else 0):
        port = _draw.randrange(_LOWEST_PORT, top)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on port {port} after {timeout}s") from None
            await asyncio.sleep(0.05)
        else:
            writer.close()
            return


_seq = iter(range(1, 1 << 62))


def stored(
    topic: str,
    key: str | None = "k",
    payload: bytes = b'{"n": 1}',
    *,
    headers: Mapping[str, str] | None = None,
    **fields: Any,
) -> StoredMessage:
    """A claimed row, as the relay would hand it to a publisher."""
    now = datetime.datetime.now(datetime.UTC)
    values: dict[str, Any] = {
        "seq": next(_seq), "id": uuid7(), "target": "default", "external": False,
        "topic": topic, "key": key, "partition": 3, "type": "order.created",
        "content_type": "application/json", "payload": payload,
        "headers": dict(headers or {}), "correlation_id": None, "causation_id": None,
        "tenant_id": None, "aggregate_id": None, "occurred_at": now,
        "attempts": 0,
    }  # fmt: skip
    values.update(fields)
    return StoredMessage(**values)
