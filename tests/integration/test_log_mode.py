"""Log mode against a PostgreSQL of its own (wal_level=logical; the shared one runs
wal_level=replica): a committed message is published and a rolled-back one never is;
the slot's position never passes a message its broker has not confirmed, and one that
was not confirmed is streamed again to the next relay; a message the broker refuses
goes to the table and is delivered from there, with the later messages of its key
behind it; a second relay of the table stands by until the first lets go."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from relaybox import ConfigurationError, LogOutbox, Message, NoTransactionError
from relaybox.core.log_records import decode_rows, log_prefix, log_slot, parse_lsn
from relaybox.observability.snapshot import snapshot
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import log_stream
from relaybox.relay.engine import RECONNECT
from relaybox.relay.log_stream import LogRelay
from relaybox.storage import pg_log
from relaybox.storage.pg_log import (
    Committed,
    LogStream,
    LogTable,
    SlotBusyError,
    confirmed_position,
    create_slot,
    drop_slot,
)
from relaybox.writer import log_outbox
from tests.chaos.cluster import ThrowawayPostgres
from tests.databases import create, unique_table
from tests.integration import drivers
from tests.integration.drivers import ASYNC_CASES, SYNC_CASES
from tests.relay_support import eventually, fast_settings

LOGICAL = {"wal_level": "logical", "max_replication_slots": "20", "max_wal_senders": "20"}


@pytest.fixture(scope="module")
def logical_pg() -> Iterator[str]:
    server = ThrowawayPostgres(LOGICAL)
    try:
        server.start()
        yield server.url
    finally:
        server.destroy()


@pytest.fixture
async def table(logical_pg: str) -> AsyncIterator[str]:
    name = unique_table("logm")
    await create(logical_pg, name)
    assert await create_slot(logical_pg, name)
    try:
        yield name
    finally:
        await drop_slot(logical_pg, name)


def write(url: str, table: str, *batches: list[Message], rollback: bool = False) -> None:
    """Each batch in a transaction of its own (all rolled back with `rollback`)."""
    outbox = LogOutbox(table=table)
    with psycopg.connect(url) as connection:
        for batch in batches:
            outbox.add(connection, batch)
            connection.rollback() if rollback else connection.commit()


def msg(key: str | None, n: int, **fields: Any) -> Message:
    return Message(topic="orders", key=key, payload={"key": key, "n": n}, **fields)


def numbers(publisher: MemoryPublisher, key: str) -> list[int]:
    """The `n` of each confirmed message of `key`, in the order the broker took them."""
    return [json.loads(m.payload)["n"] for m in publisher.published if m.key == key]


@contextlib.asynccontextmanager
async def log_relay(url: str, table: str, publisher: MemoryPublisher) -> AsyncIterator[LogRelay]:
    relay = LogRelay([url], {"default": publisher}, table=table, settings=fast_settings())
    await relay.start()
    try:
        yield relay
    finally:
        await relay.stop()


async def test_committed_is_published_and_rolled_back_never(logical_pg: str, table: str) -> None:
    publisher = MemoryPublisher()
    async with log_relay(logical_pg, table, publisher) as relay:
        write(logical_pg, table, [msg("a", 0), msg("b", 0)], [msg("a", 1)])
        write(logical_pg, table, [msg("a", 99), msg(None, 99)], rollback=True)
        write(logical_pg, table, [msg("a", 2)])
        await eventually(lambda: len(numbers(publisher, "a")) == 3)
        assert numbers(publisher, "a") == [0, 1, 2]
        assert numbers(publisher, "b") == [0]
        assert len(publisher.published) == 4  # the rolled-back two never came
        assert relay.streamers[0].metrics.diverted == 0
        assert relay.target_counters()["default"].acked == 4
        shown = (await snapshot(relay))["log_streams"]["log0"]
        assert shown["streaming"]
        assert (shown["published"], shown["to_table"], shown["transactions"]) == (4, 0, 3)
        stored = publisher.published[0]
        assert (stored.topic, stored.type, stored.attempts) == ("orders", "orders", 0)


def emit_raw(url: str, table: str, content: bytes) -> None:
    """Content under the table's prefix, as no writer of this relaybox writes it."""
    with psycopg.connect(url) as connection:
        connection.execute(
            "SELECT pg_logical_emit_message(true, %s, %s)", (log_prefix(table), content)
        )
        connection.commit()


async def test_a_malformed_message_is_skipped_and_one_of_a_newer_format_stops_the_stream(
    logical_pg: str, table: str
) -> None:
    """Content of this relaybox's format that does not decode came from no writer of
    relaybox: counted, logged and passed over. Content of another format came from a
    newer writer: nothing is confirmed past it, and only a newer relay goes on."""
    publisher = MemoryPublisher()
    async with log_relay(logical_pg, table, publisher) as relay:
        emit_raw(logical_pg, table, b"1\nnot json\n")
        write(logical_pg, table, [msg("a", 0)])
        await eventually(lambda: numbers(publisher, "a") == [0])
        (streamer,) = relay.streamers
        assert streamer.metrics.undecodable == 1
        emit_raw(logical_pg, table, b"2\n[]\n")
        write(logical_pg, table, [msg("a", 1)])
        await eventually(lambda: "format 2" in (streamer.last_error or ""))
        await asyncio.sleep(0.5)
        assert numbers(publisher, "a") == [0]  # stopped before the newer message


async def test_slot_stays_before_an_unconfirmed_message_which_comes_again(
    logical_pg: str, table: str
) -> None:
    """The broker never answers: the relay stops (as a crash would leave it, nothing
    confirmed), and the slot's position is still before the message's commit, so the
    next stream brings it again; a relay then publishes it."""
    hung = MemoryPublisher()
    hung.hang()
    relay = LogRelay([logical_pg], {"default": hung}, table=table,
                     settings=fast_settings(publish_timeout=30.0))  # fmt: skip
    await relay.start()
    write(logical_pg, table, [msg("k", 0)])
    await eventually(lambda: len(hung.attempts) == 1)
    before = await confirmed_position(logical_pg, table)
    await relay.stop(timeout=0.2)  # cut short mid-publish: nothing confirmed
    after = await confirmed_position(logical_pg, table)
    assert before is not None
    assert after is not None

    stream = await LogStream.open(logical_pg, table)
    try:
        events: list[Any] = []
        for _ in range(50):
            events += await stream.read(0.1)
            if any(isinstance(e, Committed) for e in events):
                break
        committed = [e for e in events if isinstance(e, Committed)]
        assert committed, events
        assert max(before, after) < committed[0].end_lsn  # the slot never passed it
        (row,) = decode_rows(committed[0].contents[0])
        assert row[4] == "k"
    finally:
        await stream.close()  # confirmed nothing

    publisher = MemoryPublisher()
    async with log_relay(logical_pg, table, publisher):
        await eventually(lambda: numbers(publisher, "k") == [0])


async def test_position_is_confirmed_once_published(logical_pg: str, table: str) -> None:
    publisher = MemoryPublisher()
    async with log_relay(logical_pg, table, publisher) as relay:
        with psycopg.connect(logical_pg) as connection:
            LogOutbox(table=table).add(connection, msg("k", 0))
            row = connection.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
            assert row is not None
            written = parse_lsn(row[0])  # the commit comes after it
            connection.commit()
        await eventually(lambda: numbers(publisher, "k") == [0])
        await eventually(lambda: relay.streamers[0].confirmed >= written)
        position = await confirmed_position(logical_pg, table)
        assert position is not None
        assert position >= written


async def test_a_failed_message_goes_to_the_table_and_its_key_follows_it(
    logical_pg: str, table: str
) -> None:
    """k's first message fails at the broker for a while: it is written to the table
    and delivered by the table relay, and k's later messages, committed meanwhile,
    go behind it instead of overtaking it; another key is not held up."""
    publisher = MemoryPublisher()
    publisher.fail(lambda m: m.key == "k" and b'"n":0' in m.payload, times=4)
    async with log_relay(logical_pg, table, publisher) as relay:
        write(logical_pg, table, [msg("k", 0)], [msg("k", 1)], [msg("other", 0)],
              [msg("k", 2), msg("k", 3)], [msg("other", 1)])  # fmt: skip
        await eventually(lambda: len(numbers(publisher, "k")) == 4)
        await eventually(lambda: len(numbers(publisher, "other")) == 2)
        assert numbers(publisher, "k") == [0, 1, 2, 3]
        assert numbers(publisher, "other") == [0, 1]
        metrics = relay.streamers[0].metrics
        assert metrics.diverted == 4  # k's four, none of other's
        assert metrics.published == 2
        # Once the table holds no row of k, its messages go straight out again.
        await eventually(lambda: _empty(logical_pg, table))
        write(logical_pg, table, [msg("k", 4)])
        await eventually(lambda: numbers(publisher, "k") == [0, 1, 2, 3, 4])
        assert relay.streamers[0].metrics.diverted == 4


async def test_a_key_no_message_asks_about_again_is_forgotten(
    logical_pg: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(log_stream, "PRUNE_INTERVAL", 0.1)
    publisher = MemoryPublisher()
    publisher.fail(lambda m: m.key == "once", times=1)
    async with log_relay(logical_pg, table, publisher) as relay:
        write(logical_pg, table, [msg("once", 0)])
        await eventually(lambda: numbers(publisher, "once") == [0])
        assert relay.streamers[0].metrics.diverted == 1
        await eventually(lambda: not relay.streamers[0].blocked)


async def test_keys_waiting_in_the_table_at_start_hold_their_stream(
    logical_pg: str, table: str
) -> None:
    """A row of k waits in the table (delayed) when the relay starts: k's message from
    the stream goes behind it, and is published after it."""
    storage = await LogTable.connect(logical_pg, table=table)
    try:
        outbox = LogOutbox(table=table)
        _, rows = outbox.rows(msg("k", 0, delay=2.0))
        await storage.write(rows)
    finally:
        await storage.close()
    publisher = MemoryPublisher()
    async with log_relay(logical_pg, table, publisher) as relay:
        await eventually(lambda: relay.streamers[0].streaming)
        write(logical_pg, table, [msg("k", 1)], [msg("free", 0)])
        await eventually(lambda: numbers(publisher, "free") == [0])
        await eventually(lambda: len(numbers(publisher, "k")) == 2)
        assert numbers(publisher, "k") == [0, 1]
        assert relay.streamers[0].metrics.diverted == 1


async def test_a_delayed_message_waits_in_the_table(logical_pg: str, table: str) -> None:
    publisher = MemoryPublisher()
    async with log_relay(logical_pg, table, publisher):
        started = datetime.datetime.now(datetime.UTC)
        write(logical_pg, table, [msg("d", 0, delay=0.5)])
        await eventually(lambda: numbers(publisher, "d") == [0])
        assert datetime.datetime.now(datetime.UTC) - started >= datetime.timedelta(seconds=0.5)


async def test_a_second_relay_stands_by_then_takes_over(logical_pg: str, table: str) -> None:
    first, second = MemoryPublisher(), MemoryPublisher()
    relay_one = LogRelay([logical_pg], {"default": first}, table=table, settings=fast_settings())
    relay_two = LogRelay([logical_pg], {"default": second}, table=table, settings=fast_settings())
    await relay_one.start()
    try:
        await eventually(lambda: relay_one.streamers[0].streaming)
        await relay_two.start()
        write(logical_pg, table, [msg("k", 0)])
        await eventually(lambda: numbers(first, "k") == [0])
        await eventually(lambda: relay_two.streamers[0].standing_by)
        assert not relay_two.streamers[0].streaming
        with pytest.raises(SlotBusyError):
            await LogStream.open(logical_pg, table)
        # Standing by is its job: ready once its table relay has had its first heartbeat
        # (which may come a moment after its broker is reached).
        await eventually(lambda: relay_two.readiness() == [], timeout=5)
        assert relay_one.readiness() == []
        await relay_one.stop()
        await eventually(lambda: relay_two.streamers[0].streaming)
        write(logical_pg, table, [msg("k", 1)])
        await eventually(lambda: numbers(second, "k") == [1])
        assert numbers(first, "k") == [0]
    finally:
        await relay_one.stop()
        await relay_two.stop()


async def test_the_relay_creates_a_missing_slot(logical_pg: str, table: str) -> None:
    await drop_slot(logical_pg, table)
    publisher = MemoryPublisher()
    async with log_relay(logical_pg, table, publisher) as relay:
        await eventually(lambda: relay.streamers[0].streaming)
        write(logical_pg, table, [msg("k", 0)])
        await eventually(lambda: numbers(publisher, "k") == [0])
    with psycopg.connect(logical_pg) as connection:
        row = connection.execute(
            "SELECT plugin FROM pg_replication_slots WHERE slot_name = %s", (log_slot(table),)
        ).fetchone()
    assert row == ("pgoutput",)


def test_a_writer_refuses_to_emit_where_no_slot_would_read_it(logical_pg: str, table: str) -> None:
    asyncio.run(drop_slot(logical_pg, table))
    with psycopg.connect(logical_pg) as connection:
        connection.execute("CREATE TEMPORARY TABLE business (n integer)")
        connection.execute("INSERT INTO business VALUES (1)")
        with pytest.raises(ConfigurationError, match="no ready replication slot"):
            LogOutbox(table=table).add(connection, msg("k", 0))
        # Nothing was written, and the caller's transaction goes on.
        assert connection.execute("SELECT count(*) FROM business").fetchone() == (1,)
        connection.rollback()
    assert asyncio.run(create_slot(logical_pg, table))
    write(logical_pg, table, [msg("k", 1)])


async def test_in_a_pipeline_a_writer_refuses_an_emit_it_cannot_check(
    logical_pg: str, table: str
) -> None:
    """An emit that finds no slot emits nothing and says so by its row count, which a
    psycopg pipeline gives only at its sync: such an emit is refused before it is sent.
    A connection whose emit found the slot outside a pipeline emits inside one."""
    await drop_slot(logical_pg, table)
    try:
        with psycopg.connect(logical_pg) as connection:
            with connection.pipeline(), pytest.raises(ConfigurationError, match="pipeline"):
                LogOutbox(table=table).add(connection, msg("k", 0))
            connection.rollback()
    finally:
        await create_slot(logical_pg, table)
    outbox = LogOutbox(table=table)
    with psycopg.connect(logical_pg) as connection:
        outbox.add(connection, msg("k", 1))  # outside: it checks, and finds the slot
        with connection.pipeline():
            outbox.add(connection, msg("k", 2))
        connection.commit()
    rows = await _streamed(logical_pg, table)
    assert [json.loads(row[8])["n"] for row in rows] == [1, 2]


def test_a_connection_checks_the_slot_again_once_its_interval_is_over(
    logical_pg: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An emit that found the slot spares that connection's checks for
    `slot_check_interval` seconds (the clock here is the test's); a new connection,
    or one past the interval, checks again, and a writer with an interval of 0 checks
    at every add."""
    clock = [1000.0]
    monkeypatch.setattr(log_outbox, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    outbox, strict = LogOutbox(table=table), LogOutbox(table=table, slot_check_interval=0)
    try:
        with psycopg.connect(logical_pg) as connection, psycopg.connect(logical_pg) as other:
            outbox.add(connection, msg("k", 0))  # found the slot
            strict.add(other, msg("k", 0))
            connection.rollback()
            other.rollback()
            asyncio.run(drop_slot(logical_pg, table))
            clock[0] += 0.5
            outbox.add(connection, msg("k", 1))  # within its interval: not checked
            connection.rollback()
            with pytest.raises(ConfigurationError, match="no ready replication slot"):
                strict.add(other, msg("k", 1))
            other.rollback()
            with pytest.raises(ConfigurationError, match="no ready replication slot"):
                outbox.add(other, msg("k", 1))  # this outbox never checked on `other`
            other.rollback()
            clock[0] += 0.6
            with pytest.raises(ConfigurationError, match="no ready replication slot"):
                outbox.add(connection, msg("k", 2))
            connection.rollback()
    finally:
        asyncio.run(create_slot(logical_pg, table))


@pytest.mark.parametrize("interval", [-1, float("nan"), float("inf"), "1", True])
def test_the_slot_check_interval_is_seconds(interval: Any) -> None:
    with pytest.raises(ConfigurationError, match="slot_check_interval"):
        LogOutbox(slot_check_interval=interval)


async def test_the_stream_comes_back_after_its_connection_is_killed(
    logical_pg: str, table: str
) -> None:
    publisher = MemoryPublisher()
    async with log_relay(logical_pg, table, publisher) as relay:
        streamer = relay.streamers[0]
        write(logical_pg, table, [msg("k", 0)])
        await eventually(lambda: numbers(publisher, "k") == [0])
        with psycopg.connect(logical_pg, autocommit=True) as connection:
            connection.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                "WHERE slot_name = %s",
                (log_slot(table),),
            )
        write(logical_pg, table, [msg("k", 1)], [msg("k", 2)])
        await eventually(lambda: streamer.metrics.sessions == 2)
        await eventually(lambda: numbers(publisher, "k")[-2:] == [1, 2])
        assert set(numbers(publisher, "k")) == {0, 1, 2}


async def test_each_lost_stream_starts_the_reconnect_pauses_over(
    logical_pg: str, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream lost after it streamed is a first failure: the pause before the next
    attempt is the schedule's first, however many streams the relay lost before (they
    must not add up, over a relay's life, to the schedule's longest pause)."""
    caplog.set_level(logging.WARNING, logger=log_stream.__name__)
    async with log_relay(logical_pg, table, MemoryPublisher()) as relay:
        streamer = relay.streamers[0]
        for session in (1, 2, 3):
            await eventually(
                lambda n=session: streamer.streaming and streamer.metrics.sessions == n,
                timeout=30,
            )
            terminate_stream(logical_pg, table)
        await eventually(lambda: streamer.metrics.sessions == 4, timeout=30)
    pauses = [r.args[-1] for r in caplog.records if "log stream failed" in str(r.msg)]
    first = RECONNECT.nominal_delay(1) * (1 + RECONNECT.jitter)
    assert len(pauses) == 3
    assert all(pause <= first for pause in pauses), pauses


async def test_after_the_server_dropped_every_connection_the_stream_fails_once(
    logical_pg: str, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that restarts drops the stream and the connection the streamer reads
    the table's keys on; the next session reads them on a new connection, rather
    than failing on the dropped one and pausing once more."""
    caplog.set_level(logging.WARNING, logger=log_stream.__name__)
    async with log_relay(logical_pg, table, MemoryPublisher()) as relay:
        streamer = relay.streamers[0]
        await eventually(lambda: streamer.streaming)
        with psycopg.connect(logical_pg, autocommit=True) as connection:
            connection.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND backend_type IN ('client backend', 'walsender')"
            )
        await eventually(lambda: streamer.streaming and streamer.metrics.sessions >= 2)
    failures = [r.getMessage() for r in caplog.records if "log stream failed" in str(r.msg)]
    assert len(failures) == 1, failures


def terminate_stream(url: str, table: str) -> None:
    """End the server's side of the slot's stream, as a lost connection would."""
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (log_slot(table),),
        )


async def test_a_surprise_in_the_stream_does_not_end_it(
    logical_pg: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    original, calls = LogStream.read, [0]

    async def surprising(stream: LogStream, wait: float, limit: int = 1000) -> list[Any]:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a surprise")
        return await original(stream, wait, limit)

    monkeypatch.setattr(LogStream, "read", surprising)
    publisher = MemoryPublisher()
    async with log_relay(logical_pg, table, publisher) as relay:
        write(logical_pg, table, [msg("k", 0)])
        await eventually(lambda: numbers(publisher, "k") == [0])
        assert relay.streamers[0].metrics.sessions == 2


RELAYBOX = str(Path(sys.executable).with_name("relaybox"))


def test_a_killed_relay_process_loses_nothing_and_keeps_key_order(
    logical_pg: str, table: str, tmp_path: Path
) -> None:
    """A `relaybox relay --mode log` process is killed (SIGKILL) while its slow broker
    holds messages it has not confirmed, and while one key fails at the broker (its
    messages wait in the table); the next process delivers every committed message
    (some twice), each key's in the order written."""
    out = tmp_path / "out.jsonl"
    broker = f"file://{out}?delay=0.01&fail_keys=key1&fail_until={time.time() + 4:.3f}"
    command = [RELAYBOX, "relay", "--mode", "log", "--db", logical_pg, "--table", table,
               "--broker", f"default={broker}", "--batch-size", "20", "--idle-interval",
               "0.1", "--retry-base", "0.2", "--retry-max", "0.5", "--log-level",
               "WARNING"]  # fmt: skip
    keys = [f"key{i}" for i in range(4)]
    written: list[Message] = [msg(keys[n % 4], n // 4) for n in range(400)]

    def writer() -> None:
        for each in written:
            write(logical_pg, table, [each])

    def published() -> list[dict[str, Any]]:
        if not out.exists():
            return []
        # A relay may be appending a line as we read: its end is not there yet.
        text = out.read_text()
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]

    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    second = None
    try:
        assert first.stdout is not None
        assert first.stdout.readline().startswith("relay ")
        thread = threading.Thread(target=writer)
        thread.start()
        _wait(lambda: len(published()) >= 100)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        second = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)  # fmt: skip
        thread.join(60)
        ids = {str(m.id) for m in written}
        _wait(lambda: ids <= {line["id"] for line in published()})
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(15)
    lines = published()
    for key in keys:
        seen: list[int] = []
        for line in lines:
            if line["data"]["key"] == key and line["data"]["n"] not in seen:
                seen.append(line["data"]["n"])
        assert seen == sorted(seen), key  # first deliveries in the order written
    assert {line["data"]["key"] for line in lines} == set(keys)


def _wait(check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# Django's connections are configured once, for the shared server.
PG_SYNC = sorted(name for name, (dialect, _) in SYNC_CASES.items()
                 if dialect == "postgresql" and not name.startswith("django"))  # fmt: skip
PG_ASYNC = sorted(name for name, (dialect, _) in ASYNC_CASES.items() if dialect == "postgresql")


def _drivers_to(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setattr(drivers, "PG_DSN", url)
    monkeypatch.setattr(drivers, "SA_URLS", {
        "postgresql": url.replace("postgresql://", "postgresql+psycopg://")})  # fmt: skip
    monkeypatch.setattr(drivers, "SA_ASYNC_URLS", {
        "postgresql": url.replace("postgresql://", "postgresql+asyncpg://")})  # fmt: skip


async def _streamed(url: str, table: str) -> list[Any]:
    """The rows of the first committed transaction in the slot (confirming nothing)."""
    stream = await LogStream.open(url, table)
    try:
        for _ in range(100):
            for event in await stream.read(0.1):
                if isinstance(event, Committed):
                    return [row for c in event.contents for row in decode_rows(c)]
    finally:
        await stream.close()
    raise AssertionError("nothing streamed")


@pytest.mark.parametrize("name", PG_SYNC)
async def test_every_sync_driver_emits(
    name: str, logical_pg: str, table: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _drivers_to(monkeypatch, logical_pg)
    case = SYNC_CASES[name][1](tmp_path)
    message = msg("k", 0, headers={"h": "v"}, tenant_id="t")
    try:
        LogOutbox(table=table).add(case.handle, message)
        case.commit()
    finally:
        case.close()
    (row,) = await _streamed(logical_pg, table)
    assert (row[0], row[8], row[9], row[12]) == (message.id, message.body, '{"h":"v"}', "t")


OTHERS = sorted(name for name, (dialect, _) in SYNC_CASES.items()
                if name not in PG_SYNC and dialect != "sqlite")  # fmt: skip


@pytest.mark.parametrize("name", OTHERS)
def test_django_and_other_databases(name: str, tmp_path: Path) -> None:
    """Django's connection (configured for the shared server, which has no slot: the
    server's answer, no ready slot, shows the statement went through it) takes the
    statement; a MySQL connection is refused before any statement (SQLite: the test
    above)."""
    dialect, open_case = SYNC_CASES[name]
    case = open_case(tmp_path)
    try:
        if dialect == "postgresql":
            with pytest.raises(ConfigurationError, match="no ready replication slot"):
                LogOutbox().add(case.handle, msg("k", 0))
        else:
            with pytest.raises(ConfigurationError, match="PostgreSQL"):
                LogOutbox().add(case.handle, msg("k", 0))
    finally:
        case.rollback()
        case.close()


@pytest.mark.parametrize("name", PG_ASYNC)
async def test_every_async_driver_emits(
    name: str, logical_pg: str, table: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _drivers_to(monkeypatch, logical_pg)
    case = await ASYNC_CASES[name][1](tmp_path)
    batch = [msg("k", 0), Message(topic="bytes", payload=b"\x00\xff")]
    try:
        await LogOutbox(table=table).add_async(case.handle, batch)
        await case.commit()
    finally:
        await case.close()
    rows = await _streamed(logical_pg, table)
    assert [(row[0], row[8]) for row in rows] == [(m.id, m.body) for m in batch]


async def test_a_batch_longer_than_the_servers_patience_keeps_its_stream(
    logical_pg: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow broker and one key's long chain: the batch takes longer than the
    server's wal_sender_timeout, and the stream stays up meanwhile (it would
    otherwise be dropped, and the batch published again, for good)."""
    monkeypatch.setattr(pg_log, "STATUS_INTERVAL", 0.5)
    monkeypatch.setattr(log_stream, "KEEP_ALIVE_CHECK", 0.1)
    with psycopg.connect(logical_pg, autocommit=True) as connection:
        connection.execute("ALTER SYSTEM SET wal_sender_timeout = '2s'")
        connection.execute("SELECT pg_reload_conf()")
    try:
        publisher = MemoryPublisher()
        publisher.slow(0.25)
        async with log_relay(logical_pg, table, publisher) as relay:
            write(logical_pg, table, [msg("k", n) for n in range(16)])  # 4 s, one by one
            await eventually(lambda: len(numbers(publisher, "k")) >= 16, timeout=30)
            await asyncio.sleep(2.5)  # a dropped stream would be back, publishing again
            assert numbers(publisher, "k") == list(range(16))
            assert relay.streamers[0].metrics.sessions == 1
    finally:
        with psycopg.connect(logical_pg, autocommit=True) as connection:
            connection.execute("ALTER SYSTEM RESET wal_sender_timeout")
            connection.execute("SELECT pg_reload_conf()")


def test_migrate_log_creates_the_slot_and_relay_mode_log_wants_postgresql(
    logical_pg: str, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from relaybox.cli.main import main

    name = unique_table("logm")
    try:
        first = CliRunner().invoke(main, ["migrate", "--db", logical_pg, "--table", name, "--log"])
        again = CliRunner().invoke(main, ["migrate", "--db", logical_pg, "--table", name, "--log"])
        assert first.exit_code == 0, first.output
        assert f"replication slot {log_slot(name)}" in first.output
        assert "created" in first.output
        assert "already there" in again.output
        with psycopg.connect(logical_pg) as connection:
            row = connection.execute(
                "SELECT count(*) FROM pg_publication WHERE pubname = %s", (log_slot(name),)
            ).fetchone()
        assert row == (1,)
    finally:
        asyncio.run(drop_slot(logical_pg, name))
    sqlite = f"sqlite:///{tmp_path / 'x.db'}"
    refused = CliRunner().invoke(main, ["relay", "--mode", "log", "--db", sqlite,
                                        "--broker", "default=noop://"])  # fmt: skip
    assert refused.exit_code != 0
    assert "PostgreSQL" in refused.output


async def test_slot_needs_wal_level_logical(pg_url: str) -> None:
    with pytest.raises(ConfigurationError, match="wal_level = logical"):
        await create_slot(pg_url, unique_table("logm"))


def test_log_outbox_refuses_other_databases_and_autocommit(logical_pg: str) -> None:
    outbox = LogOutbox()
    with pytest.raises(ConfigurationError, match="PostgreSQL"):
        outbox.add(sqlite3.connect(":memory:"), msg("k", 0), allow_autocommit=True)
    with (
        psycopg.connect(logical_pg, autocommit=True) as connection,
        pytest.raises(NoTransactionError),
    ):
        outbox.add(connection, msg("k", 0))


def _empty(url: str, table: str) -> bool:
    with psycopg.connect(url) as connection:
        row = connection.execute(f"SELECT count(*) FROM {table}").fetchone()
    return row == (0,)
