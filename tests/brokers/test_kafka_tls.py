"""The Kafka publisher over TLS, with a client certificate, as its URL options ask.

tansu serves plaintext only, so a TLS terminator in front of it plays the broker's TLS
listener: it presents a certificate signed by a throwaway CA, demands a client
certificate signed by the same CA, and tansu advertises the terminator's port, so every
connection the client makes (bootstrap, metadata, produce) goes through TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from relaybox.core.publishing import Outcome
from relaybox.errors import BrokerUnavailableError, ConfigurationError
from relaybox.publishers import open_publisher
from tests.brokers.conformance import outcomes, started
from tests.brokers.harness import end_process, free_port, stored, unique_topic, wait_port
from tests.brokers.test_kafka import TANSU


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(name: str, subject: str, extension: str, directory: Path) -> None:
    """`name`.pem and `name`.key, signed by ca.pem."""
    (directory / f"{name}.ext").write_text(extension + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
             cwd=directory)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
             "-extfile", f"{name}.ext", cwd=directory)  # fmt: skip


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a certificate for 127.0.0.1 and a client certificate, all signed by it."""
    directory = tmp_path_factory.mktemp("kafka-tls")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=relaybox test CA", cwd=directory)  # fmt: skip
    _signed("server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1", directory)
    _signed("client", "/CN=relay", "extendedKeyUsage=clientAuth", directory)
    return directory


class TlsTerminator:
    """TLS on `port`, plaintext to tansu's `upstream`; it requires a client certificate."""

    def __init__(self, certificates: Path, port: int, upstream: int) -> None:
        self.port = port
        self.upstream = upstream
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certificates / "server.pem", certificates / "server.key")
        self.context.load_verify_locations(certificates / "ca.pem")
        self.context.verify_mode = ssl.CERT_REQUIRED
        #: The common name of each client certificate presented.
        self.clients: list[str] = []
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, ssl=self.context
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        subject = dict(pair[0] for pair in writer.get_extra_info("peercert")["subject"])
        self.clients.append(subject["commonName"])
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        pipes = {asyncio.ensure_future(_pipe(reader, up_writer)),
                 asyncio.ensure_future(_pipe(up_reader, writer))}  # fmt: skip
        self._pipes |= pipes
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for pipe in pipes:
            pipe.cancel()
        self._pipes -= pipes
        for each in (writer, up_writer):
            each.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


@pytest.fixture(scope="module")
def tansu_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """(tansu's plaintext port, the port it advertises: the terminator's)."""
    plain, advertised = free_port(), free_port()
    directory = tmp_path_factory.mktemp("tansu-tls")
    with open(directory / "tansu.log", "ab") as log:
        process = subprocess.Popen(
            [str(TANSU), "broker", "--listener-url", f"tcp://127.0.0.1:{plain}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{advertised}",
             "--storage-engine", "memory://tansu/"],
            cwd=directory, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield plain, advertised
    finally:
        end_process(process)


@pytest.fixture
async def terminator(
    certificates: Path, tansu_port: tuple[int, int]
) -> AsyncIterator[TlsTerminator]:
    plain, advertised = tansu_port
    await wait_port(plain)
    proxy = TlsTerminator(certificates, advertised, plain)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


def _client_context(certificates: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=certificates / "ca.pem")
    context.load_cert_chain(certificates / "client.pem", certificates / "client.key")
    return context


@contextlib.asynccontextmanager
async def _topic(port: int, certificates: Path) -> AsyncIterator[str]:
    topic = unique_topic()
    admin = AIOKafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}", security_protocol="SSL",
                                ssl_context=_client_context(certificates))  # fmt: skip
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
        yield topic
    finally:
        await admin.close()


async def _read(port: int, topic: str, certificates: Path) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=f"127.0.0.1:{port}", security_protocol="SSL",
        ssl_context=_client_context(certificates), enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.seek_to_beginning()
        batch = await consumer.getmany(timeout_ms=5000)
        return [record.value for records in batch.values() for record in records]
    finally:
        await consumer.stop()


async def test_publishes_over_tls_with_a_client_certificate(
    terminator: TlsTerminator, certificates: Path
) -> None:
    url = (
        f"kafka://127.0.0.1:{terminator.port}?timeout=5&security_protocol=SSL"
        f"&ssl_cafile={certificates / 'ca.pem'}&ssl_certfile={certificates / 'client.pem'}"
        f"&ssl_keyfile={certificates / 'client.key'}"
    )
    async with _topic(terminator.port, certificates) as topic:
        message = stored(topic)
        async with started(open_publisher(url)) as publisher:
            assert outcomes(await publisher.publish([message])) == [Outcome.ACKED]
        assert await _read(terminator.port, topic, certificates) == [message.payload]
    assert "relay" in terminator.clients  # the publisher presented its certificate


@pytest.mark.parametrize(
    "options",
    [
        "",  # the system CAs do not know the throwaway CA
        "&ssl_cafile={ca}",  # no client certificate, which the broker requires
    ],
)
async def test_a_tls_connection_the_broker_or_client_refuses_is_unavailable(
    terminator: TlsTerminator, certificates: Path, options: str
) -> None:
    url = f"kafka://127.0.0.1:{terminator.port}?timeout=2&security_protocol=SSL" + options.format(
        ca=certificates / "ca.pem"
    )
    with pytest.raises(BrokerUnavailableError):
        async with started(open_publisher(url)):
            pass


@pytest.mark.parametrize(
    ("options", "complaint"),
    [
        ("ssl_cafile={ca}", "need security_protocol=SSL"),
        ("security_protocol=SSL&ssl_certfile={ca}", "go together"),
        ("security_protocol=SSL&ssl_cafile=/nonexistent/ca.pem", "TLS files"),
        ("security_protocol=SASL_SSL", "PLAINTEXT or SSL"),
    ],
)
def test_tls_options_are_checked(certificates: Path, options: str, complaint: str) -> None:
    with pytest.raises(ConfigurationError, match=complaint):
        open_publisher(f"kafka://127.0.0.1:9092?{options.format(ca=certificates / 'ca.pem')}")
