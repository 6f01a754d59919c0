"""LISTEN/NOTIFY on PostgreSQL: a commit wakes the relay's listener, a rollback does not,
the writer's NOTIFY is debounced, and a listener whose connection is killed comes back."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relaybox import ConfigurationError, Message, Outbox, StorageOperationalError
from relaybox.core.identifiers import notify_channel
from relaybox.storage import pg_listen
from relaybox.storage.pg_listen import APPLICATION_NAME, Listener, listen
from relaybox.storage.urls import DatabaseUrl
from relaybox.writer.outbox import DEFAULT_NOTIFY_INTERVAL
from tests.databases import PG_URL, create, drop, unique_table
from tests.integration.drivers import ASYNC_CASES, SYNC_CASES, Case

LISTEN_URLS = {
    "asyncpg": PG_URL,
    "psycopg": PG_URL.replace("postgresql://", "postgresql+psycopg://"),
}
PG_SYNC = sorted(name for name, (dialect, _) in SYNC_CASES.items() if dialect == "postgresql")
PG_ASYNC = sorted(name for name, (dialect, _) in ASYNC_CASES.items() if dialect == "postgresql")
QUIET = 0.3  # how long "no wake-up" is watched for; a wake-up takes milliseconds


class Wakes:
    """An `on_notify` that counts, and lets a test wait for a count."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = asyncio.Event()

    def __call__(self) -> None:
        self.count += 1
        self._changed.set()

    async def reach(self, count: int, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while self.count < count:
                self._changed.clear()
                await self._changed.wait()

    async def stays(self, count: int) -> None:
        await asyncio.sleep(QUIET)
        assert self.count == count


class Writer:
    """A writer connection of any kind, driven from async code.

    Sync connections live on one thread of their own (Django's are per thread, and
    refuse to run inside an event loop)."""

    def __init__(self, case: Case, thread: concurrent.futures.ThreadPoolExecutor | None) -> None:
        self.case, self._thread = case, thread

    @classmethod
    async def open(cls, name: str, tmp_path: Path) -> Writer:
        if name in ASYNC_CASES:
            return cls(await ASYNC_CASES[name][1](tmp_path / "app.db"), None)
        thread = concurrent.futures.ThreadPoolExecutor(1)
        case = await asyncio.get_running_loop().run_in_executor(
            thread, SYNC_CASES[name][1], tmp_path / "app.db"
        )
        return cls(case, thread)

    async def _call(self, function: Callable[..., Any], *args: Any) -> None:
        if self._thread is None:
            await function(*args)
        else:
            await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    async def add(self, outbox: Outbox, messages: Message | list[Message]) -> None:
        if self._thread is None:
            await outbox.add_async(self.case.handle, messages)
        else:
            await self._call(outbox.add, self.case.handle, messages)

    async def commit(self) -> None:
        await self._call(self.case.commit)

    async def rollback(self) -> None:
        await self._call(self.case.rollback)

    async def run(self, statement: str) -> None:
        await self._call(self.case.run, statement)

    async def close(self) -> None:
        await self._call(self.case.close)
        if self._thread is not None:
            self._thread.shutdown()


@pytest.fixture
async def table() -> AsyncIterator[str]:
    name = unique_table("nt")
    await create(PG_URL, name)
    yield name
    drop(PG_URL, name)


@pytest.fixture
async def wakes() -> Wakes:
    return Wakes()


@pytest.fixture(params=sorted(LISTEN_URLS))
async def listener(
    request: pytest.FixtureRequest, table: str, wakes: Wakes
) -> AsyncIterator[Listener]:
    found = await listen(LISTEN_URLS[request.param], table, wakes, retry_delay=0.05)
    yield found
    await found.close()


@pytest.fixture
async def asyncpg_listener(table: str, wakes: Wakes) -> AsyncIterator[Listener]:
    found = await listen(PG_URL, table, wakes)
    yield found
    await found.close()


@pytest.fixture
async def writer(tmp_path: Path) -> AsyncIterator[Writer]:
    found = await Writer.open("asyncpg", tmp_path)
    yield found
    await found.close()


def message(n: int = 0, **fields: Any) -> Message:
    return Message(topic="orders", key=f"o-{n}", payload={"n": n}, **fields)


# -- the writer's side, through every PostgreSQL connection kind ------------------------


@pytest.mark.parametrize("kind", PG_SYNC + PG_ASYNC)
async def test_every_postgresql_writer_wakes_on_commit_only(
    kind: str, table: str, wakes: Wakes, asyncpg_listener: Listener, tmp_path: Path
) -> None:
    outbox = Outbox(table=table, notify=0)  # every add notifies: each INSERT shape runs
    writer = await Writer.open(kind, tmp_path)
    try:
        batches: list[Message | list[Message]] = [
            message(1),  # insert_one_basic_notify
            message(6, headers={"h": "v"}),  # insert_one_now_notify
            message(2, delay=30),  # insert_one_notify
            [message(3), message(4)],  # insert_many_notify
        ]
        for count, batch in enumerate(batches, start=1):
            await writer.add(outbox, batch)
            await wakes.stays(count - 1)  # nothing before the commit
            await writer.commit()
            await wakes.reach(count)
        await writer.add(outbox, message(5))
        await writer.rollback()
        await wakes.stays(4)
    finally:
        await writer.close()
    assert _count(table) == 5


async def test_a_commit_wakes_and_a_rollback_does_not(
    table: str, wakes: Wakes, listener: Listener, writer: Writer
) -> None:
    outbox = Outbox(table=table, notify=0)
    await writer.add(outbox, message())
    await writer.rollback()
    await wakes.stays(0)
    await writer.add(outbox, message())
    await writer.commit()
    await wakes.reach(1)
    await wakes.stays(1)


async def test_notify_true_uses_the_default_interval(
    table: str, wakes: Wakes, asyncpg_listener: Listener, writer: Writer
) -> None:
    outbox = Outbox(table=table, notify=True)
    assert outbox.notify_interval == DEFAULT_NOTIFY_INTERVAL == 0.05
    await writer.add(outbox, message())
    await writer.commit()
    await wakes.reach(1)


@pytest.mark.parametrize("notify", [False, None], ids=["false", "default"])
async def test_notify_off_sends_nothing(
    notify: bool | None, table: str, wakes: Wakes, asyncpg_listener: Listener, writer: Writer
) -> None:
    outbox = Outbox(table=table) if notify is None else Outbox(table=table, notify=notify)
    for n in range(3):
        await writer.add(outbox, message(n))
        await writer.commit()
    await wakes.stays(0)
    assert _count(table) == 3


async def test_adds_within_the_interval_send_one_notify(
    table: str,
    wakes: Wakes,
    asyncpg_listener: Listener,
    writer: Writer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The writer's clock, moved by the test: the five commits fall within the interval
    # and the sixth after it, however long each takes on a busy machine.
    clock = FakeClock(1000.0)
    monkeypatch.setattr("relaybox.writer.outbox.time", clock)
    interval = 2.0
    outbox = Outbox(table=table, notify=interval)
    for n in range(5):
        await writer.add(outbox, message(n))
        await writer.commit()
        clock.now += interval / 10
    await wakes.reach(1)
    await wakes.stays(1)
    clock.now = 1000.0 + interval
    await writer.add(outbox, message(9))
    await writer.commit()
    await wakes.reach(2)
    await wakes.stays(2)


class FakeClock:
    """Stands in for the `time` module of relaybox.writer.outbox: its monotonic() is
    whatever the test says."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


async def test_a_failed_add_hands_its_notify_to_the_next(
    table: str, wakes: Wakes, asyncpg_listener: Listener, writer: Writer
) -> None:
    outbox = Outbox(table=table, notify=60)
    with pytest.raises(Exception, match="does_not_exist"):
        await writer.run("SELECT * FROM does_not_exist")
    with pytest.raises(Exception, match="aborted"):
        await writer.add(outbox, message())  # the NOTIFY it carried is rolled back
    await writer.rollback()
    await writer.add(outbox, message())
    await writer.commit()
    await wakes.reach(1)


# -- the relay's side: the listener ------------------------------------------------------


async def test_the_listener_survives_its_idle_probes(
    table: str, writer: Writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    probes = _count_probes(monkeypatch)
    wakes = Wakes()
    for count, url in enumerate(LISTEN_URLS.values(), start=1):
        # A probe unanswered within probe_every counts the connection dead: 0.5 s is
        # ample for a SELECT 1 on a busy machine.
        found = await listen(url, table, wakes, probe_every=0.5)
        try:
            pid, before = found.backend_pid, len(probes)
            async with asyncio.timeout(30):  # two probes answered, however long they take
                while len(probes) < before + 2:
                    await asyncio.sleep(0.05)
            # The same connection, never dropped: a reconnect would also have woken it.
            assert found.backend_pid == pid
            assert wakes.count == count - 1
            await writer.add(Outbox(table=table, notify=0), message())
            await writer.commit()
            await wakes.reach(count)
        finally:
            await found.close()


def _count_probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Note each probe answered, by either driver's listening connection (its pid)."""
    answered: list[int] = []
    for session in (pg_listen._AsyncpgSession, pg_listen._PsycopgSession):

        def counting(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
            async def probe(self: Any) -> None:
                await original(self)
                answered.append(self.backend_pid)

            return probe

        monkeypatch.setattr(session, "probe", counting(session.probe))
    return answered


async def test_a_killed_listener_reconnects_and_wakes(
    table: str, wakes: Wakes, listener: Listener, writer: Writer
) -> None:
    pid = await _the_listening_pid(table)
    assert pid == listener.backend_pid
    assert _run("SELECT pg_terminate_backend(%s)", pid) == [(True,)]
    await wakes.reach(1)  # woken after reconnecting: it may have missed a NOTIFY
    new_pid = await _the_listening_pid(table, other_than=pid)
    assert new_pid == listener.backend_pid
    await writer.add(Outbox(table=table, notify=0), message())
    await writer.commit()
    await wakes.reach(2)


async def test_a_listener_comes_back_after_every_kill(
    table: str, wakes: Wakes, listener: Listener
) -> None:
    pid = None
    for kills in range(1, 4):
        pid = await _the_listening_pid(table, other_than=pid)
        _run("SELECT pg_terminate_backend(%s)", pid)
        await wakes.reach(kills)
    await _the_listening_pid(table, other_than=pid)


@pytest.mark.parametrize("driver", sorted(LISTEN_URLS))
async def test_a_listener_retries_until_the_database_is_back(
    driver: str, table: str, wakes: Wakes, proxy: Proxy, writer: Writer
) -> None:
    found = await listen(proxy.url(driver), table, wakes, retry_delay=0.05, max_retry_delay=0.2)
    try:
        await proxy.cut()
        await asyncio.sleep(1.0)  # several refused attempts, backing off
        assert wakes.count == 0
        assert found.backend_pid is None
        await proxy.start()
        await wakes.reach(1)
        await writer.add(Outbox(table=table, notify=0), message())
        await writer.commit()
        await wakes.reach(2)
    finally:
        await found.close()


@pytest.mark.parametrize("driver", sorted(LISTEN_URLS))
async def test_a_silently_dead_connection_is_found_by_the_probe(
    driver: str, table: str, wakes: Wakes, proxy: Proxy, writer: Writer
) -> None:
    found = await listen(proxy.url(driver), table, wakes, probe_every=0.2, retry_delay=0.05)
    try:
        pid = found.backend_pid
        proxy.freeze()  # the connection stays open and never answers again
        await wakes.reach(1)
        assert found.backend_pid not in (None, pid)
        await writer.add(Outbox(table=table, notify=0), message())
        await writer.commit()
        await wakes.reach(2)
    finally:
        await found.close()


async def test_close_ends_the_listening(table: str, writer: Writer) -> None:
    wakes = Wakes()
    found = await listen(PG_URL, table, wakes)
    assert _listening_pids(table)
    await found.close()
    await found.close()  # twice is fine
    assert found.backend_pid is None
    await writer.add(Outbox(table=table, notify=0), message())
    await writer.commit()
    await wakes.stays(0)
    assert _listening_pids(table) == []


async def test_a_failing_callback_does_not_stop_the_listener(table: str, writer: Writer) -> None:
    calls: list[int] = []

    def on_notify() -> None:
        calls.append(1)
        raise RuntimeError("broken callback")

    found = await listen(PG_URL, table, on_notify)
    try:
        outbox = Outbox(table=table, notify=0)
        for n in range(2):
            await writer.add(outbox, message(n))
            await writer.commit()
            async with asyncio.timeout(30):
                while len(calls) <= n:
                    await asyncio.sleep(0.01)
    finally:
        await found.close()


async def test_listen_refuses_other_databases_and_reports_connect_errors() -> None:
    with pytest.raises(ConfigurationError, match="PostgreSQL"):
        await listen("sqlite:///x.db", "outbox", lambda: None)
    for scheme in ("postgresql", "postgresql+psycopg"):
        with pytest.raises(StorageOperationalError):
            await listen(f"{scheme}://postgres@127.0.0.1:1/test", "outbox", lambda: None)


# -- helpers --------------------------------------------------------------------------


class Proxy:
    """A TCP proxy in front of PostgreSQL that a test can cut (connections reset, new
    ones refused) or freeze (its connections stay open and go silent)."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: list[list[asyncio.StreamWriter]] = []
        self._frozen: list[list[asyncio.StreamWriter]] = []

    def url(self, driver: str) -> str:
        scheme = "postgresql+psycopg" if driver == "psycopg" else "postgresql"
        return f"{scheme}://postgres@127.0.0.1:{self.port}/{PG.database}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(PG.host, PG.port or 5432)
        link = [writer, up_writer]
        self._links.append(link)
        await asyncio.gather(
            self._pipe(reader, up_writer, link), self._pipe(up_reader, writer, link)
        )

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, link: list[Any]
    ) -> None:
        try:
            while data := await source.read(65536):
                if link not in self._frozen:
                    sink.write(data)
                    await sink.drain()
        except OSError:
            pass
        finally:
            sink.close()

    def freeze(self) -> None:
        self._frozen.extend(self._links)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in self._links:
            for writer in link:
                writer.transport.abort()
        self._links.clear()
        if self._server is not None:
            await self._server.wait_closed()

    async def stop(self) -> None:
        await self.cut()
        for link in self._frozen:
            for writer in link:
                writer.transport.abort()


PG = DatabaseUrl.parse(PG_URL)


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    found = Proxy()
    await found.start()
    yield found
    await found.stop()


def _run(query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def _count(table: str) -> int:
    return int(_run(f"SELECT count(*) FROM {table}")[0][0])


async def _the_listening_pid(table: str, other_than: int | None = None) -> int:
    """The one listener's pid, once a killed one (`other_than`) has gone."""
    async with asyncio.timeout(30):
        while True:
            pids = _listening_pids(table)
            if len(pids) == 1 and pids[0] != other_than:
                return pids[0]
            await asyncio.sleep(0.02)


def _listening_pids(table: str) -> list[int]:
    """Server pids of relaybox listeners on `table`'s channel, found as an operator would."""
    found = _run(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND query LIKE %s",
        APPLICATION_NAME,
        f'LISTEN "{notify_channel(table)}"',
    )
    return [pid for (pid,) in found]


async def test_a_relay_opens_its_listener_beside_its_storage_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh relay does not wait for its listener's connection before it opens the
    others (nor after: its first heartbeat waited for it): each storage connection here
    opens only once the listener has begun to open, which would never happen were the
    listener opened after them. And the listener wakes the relay once it runs."""
    from relaybox import Relay
    from relaybox.publishers.memory import MemoryPublisher
    from relaybox.relay import engine
    from tests.relay_support import fast_settings

    listening = asyncio.Event()
    real_listen, real_open = pg_listen.listen, engine.open_storage

    async def begun_listening(*args: Any, **kwargs: Any) -> Listener:
        listening.set()
        return await real_listen(*args, **kwargs)

    async def opened_after_the_listener_began(*args: Any, **kwargs: Any) -> Any:
        await asyncio.wait_for(listening.wait(), timeout=5)
        return await real_open(*args, **kwargs)

    monkeypatch.setattr(pg_listen, "listen", begun_listening)
    monkeypatch.setattr(engine, "open_storage", opened_after_the_listener_began)
    table = unique_table("beside")
    await create(PG_URL, table)
    relay = Relay(PG_URL, {"default": MemoryPublisher()}, table=table, settings=fast_settings())
    try:
        async with relay:
            (processor,) = relay.processors
            hints = Wakes()
            monkeypatch.setattr(processor, "hint", hints)
            async with await psycopg.AsyncConnection.connect(PG_URL) as conn:
                await Outbox(table=table, notify=0).add_async(conn, Message(topic="t", key="k"))
                await conn.commit()
            await hints.reach(1, timeout=10)
    finally:
        drop(PG_URL, table)
