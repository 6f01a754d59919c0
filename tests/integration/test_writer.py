"""The writer through every supported driver: commit writes, rollback leaves nothing,
bad input raises a relaybox error and leaves the caller's transaction usable."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest

from relaybox import (
    Message,
    Outbox,
    PayloadTooLargeError,
    SchemaError,
    Target,
    UnknownTargetError,
)
from relaybox.errors import MessageError
from relaybox.migrations import migrate
from tests.databases import MYSQL_URL, PG_URL, drop, sqlite_url, unique_table
from tests.integration.drivers import ASYNC_CASES, SYNC_CASES, AsyncCase, SyncCase


class World:
    """An outbox table plus a business table, and a way to count what committed."""

    def __init__(self, dialect: str, db: Path) -> None:
        self.dialect, self.db = dialect, db
        self.table, self.business = unique_table("wr"), unique_table("biz")
        self.url = {"postgresql": PG_URL, "mysql": MYSQL_URL}.get(dialect, sqlite_url(db))
        self.outbox = Outbox(
            table=self.table, targets=["default", "partner"], max_payload_bytes=4096
        )

    async def setup(self) -> None:
        await migrate(self.url, table=self.table)
        self._run(f"CREATE TABLE {self.business} (name VARCHAR(50))")

    def setup_sync(self) -> None:
        asyncio.run(self.setup())

    def teardown(self) -> None:
        drop(self.url, self.table)
        if self.dialect != "sqlite":
            self._run(f"DROP TABLE IF EXISTS {self.business}")

    def count(self, table: str) -> int:
        return int(self._run(f"SELECT count(*) FROM {table}")[0][0])

    def _run(self, statement: str) -> Any:
        if self.dialect == "postgresql":
            with psycopg.connect(PG_URL, autocommit=True) as conn:
                cursor = conn.execute(statement)
                return cursor.fetchall() if cursor.description else None
        if self.dialect == "mysql":
            conn = pymysql.connect(
                host="127.0.0.1", user="root", password="", database="test", autocommit=True
            )
            with conn, conn.cursor() as cursor:
                cursor.execute(statement)
                return cursor.fetchall()
        with sqlite3.connect(self.db) as lite:
            return lite.execute(statement).fetchall()

    def rows(self) -> list[tuple[str, str | None, str, str, bytes]]:
        """(id, key, topic, type, payload) of every outbox row, in seq order."""
        key = "`key`" if self.dialect == "mysql" else "key"
        found = self._run(f"SELECT id, {key}, topic, type, payload FROM {self.table} ORDER BY seq")
        return [(str(i), k, t, ty, bytes(p)) for i, k, t, ty, p in found]

    def business_insert(self) -> str:
        return f"INSERT INTO {self.business} (name) VALUES ('order')"


def messages(n: int) -> list[Message]:
    return [Message(topic="orders", key=f"o-{i}", payload={"i": i}) for i in range(n)]


@pytest.fixture(params=sorted(SYNC_CASES))
def sync_case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[World, SyncCase]]:
    dialect, opener = SYNC_CASES[request.param]
    world = World(dialect, tmp_path / "app.db")
    world.setup_sync()
    case = opener(world.db)
    try:
        yield world, case
    finally:
        case.close()
        world.teardown()


@pytest.fixture(params=sorted(ASYNC_CASES))
async def async_case(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[World, AsyncCase]]:
    dialect, opener = ASYNC_CASES[request.param]
    world = World(dialect, tmp_path / "app.db")
    await world.setup()
    case = await opener(world.db)
    try:
        yield world, case
    finally:
        await case.close()
        world.teardown()


BAD_INPUTS = [
    pytest.param(
        lambda: Message(topic="orders", targets=["nowhere"]),
        UnknownTargetError,
        id="unknown-target",
    ),
    pytest.param(
        lambda: Message(topic="orders", payload="x" * 5000),
        PayloadTooLargeError,
        id="over-outbox-limit",
    ),
    pytest.param(lambda: "not a message", MessageError, id="not-a-message"),
]


def test_sync_commit_writes_rows(sync_case: tuple[World, SyncCase]) -> None:
    world, case = sync_case
    case.run(world.business_insert())
    first = Message(topic="orders", key="o-1", type="OrderPlaced", payload={"total": 3})
    world.outbox.add(case.handle, first)
    world.outbox.add(case.handle, Message(topic="audit", payload=b"keyless"))
    world.outbox.add(case.handle, Message(topic="audit", payload="later", delay=5))
    world.outbox.add(
        case.handle, [*messages(3), Message(topic="orders", targets=["default", "partner"])]
    )
    case.commit()
    assert world.count(world.business) == 1
    assert world.count(world.table) == 8  # 1 + 1 + 1 + 3 + one message to two targets
    rows = world.rows()  # every value landed in its own column
    assert rows[0] == (str(first.id), "o-1", "orders", "OrderPlaced", b'{"total":3}')
    assert rows[1][1:] == (None, "audit", "audit", b"keyless")


def test_sync_rollback_leaves_nothing(sync_case: tuple[World, SyncCase]) -> None:
    world, case = sync_case
    case.run(world.business_insert())
    world.outbox.add(case.handle, messages(2))
    case.rollback()
    assert world.count(world.business) == 0
    assert world.count(world.table) == 0


@pytest.mark.parametrize(("make_bad", "error"), BAD_INPUTS)
def test_sync_bad_input_raises_and_keeps_the_transaction(
    sync_case: tuple[World, SyncCase], make_bad: Any, error: type[Exception]
) -> None:
    world, case = sync_case
    case.run(world.business_insert())
    with pytest.raises(error):
        world.outbox.add(case.handle, [*messages(1), make_bad()])
    world.outbox.add(case.handle, messages(1))  # the transaction is still usable
    case.commit()
    assert world.count(world.business) == 1
    assert world.count(world.table) == 1


async def test_async_commit_writes_rows(async_case: tuple[World, AsyncCase]) -> None:
    world, case = async_case
    await case.run(world.business_insert())
    first = Message(topic="orders", key="o-1", type="OrderPlaced", payload={"total": 3})
    await world.outbox.add_async(case.handle, first)
    await world.outbox.add_async(case.handle, Message(topic="audit", payload=b"keyless"))
    await world.outbox.add_async(case.handle, Message(topic="audit", payload="later", delay=5))
    await world.outbox.add_async(
        case.handle, [*messages(3), Message(topic="orders", targets=["default", "partner"])]
    )
    await case.commit()
    assert world.count(world.business) == 1
    assert world.count(world.table) == 8  # 1 + 1 + 1 + 3 + one message to two targets
    rows = world.rows()
    assert rows[0] == (str(first.id), "o-1", "orders", "OrderPlaced", b'{"total":3}')
    assert rows[1][1:] == (None, "audit", "audit", b"keyless")


async def test_async_rollback_leaves_nothing(async_case: tuple[World, AsyncCase]) -> None:
    world, case = async_case
    await case.run(world.business_insert())
    await world.outbox.add_async(case.handle, messages(2))
    await case.rollback()
    assert world.count(world.business) == 0
    assert world.count(world.table) == 0


@pytest.mark.parametrize(("make_bad", "error"), BAD_INPUTS)
async def test_async_bad_input_raises_and_keeps_the_transaction(
    async_case: tuple[World, AsyncCase], make_bad: Any, error: type[Exception]
) -> None:
    world, case = async_case
    await case.run(world.business_insert())
    with pytest.raises(error):
        await world.outbox.add_async(case.handle, [*messages(1), make_bad()])
    await world.outbox.add_async(case.handle, messages(1))
    await case.commit()
    assert world.count(world.business) == 1
    assert world.count(world.table) == 1


def test_sync_add_to_a_table_never_migrated_says_to_migrate(
    sync_case: tuple[World, SyncCase],
) -> None:
    world, case = sync_case
    absent = unique_table("absent")
    with pytest.raises(SchemaError, match=f"{absent} .*relaybox migrate"):
        Outbox(table=absent).add(case.handle, messages(2))
    case.rollback()  # PostgreSQL aborted the transaction; the others may go on
    case.run(world.business_insert())
    case.commit()
    assert world.count(world.business) == 1


async def test_async_add_to_a_table_never_migrated_says_to_migrate(
    async_case: tuple[World, AsyncCase],
) -> None:
    world, case = async_case
    absent = unique_table("absent")
    with pytest.raises(SchemaError, match=f"{absent} .*relaybox migrate"):
        await Outbox(table=absent).add_async(case.handle, messages(2))
    await case.rollback()
    await case.run(world.business_insert())
    await case.commit()
    assert world.count(world.business) == 1


def test_other_database_errors_stay_the_drivers_own(tmp_path: Path) -> None:
    """Such as writing on a read-only transaction: the application handles it as it
    handles its own statements' errors."""
    world = World("postgresql", tmp_path / "unused.db")
    world.setup_sync()
    try:
        with psycopg.connect(PG_URL) as conn:
            conn.execute("SET TRANSACTION READ ONLY")
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                world.outbox.add(conn, messages(1))
    finally:
        world.teardown()


def test_sync_writer_rejects_an_async_connection_clearly(tmp_path: Path) -> None:
    from relaybox import UnsupportedConnectionError

    async def check() -> None:
        conn = await psycopg.AsyncConnection.connect(PG_URL)
        try:
            with pytest.raises(UnsupportedConnectionError, match="add_async"):
                Outbox().add(conn, messages(1))
        finally:
            await conn.close()

    asyncio.run(check())


def test_the_writer_never_commits(tmp_path: Path) -> None:
    table = unique_table("wr")
    asyncio.run(migrate(sqlite_url(tmp_path / "a.db"), table=table))
    conn = sqlite3.connect(tmp_path / "a.db")
    Outbox(table=table).add(conn, messages(2))
    assert conn.in_transaction  # still open: committing is the caller's job
    conn.close()  # closing without commit discards
    with sqlite3.connect(tmp_path / "a.db") as check:
        assert check.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)


def test_psycopg_with_raw_cursors_gets_numbered_parameters(tmp_path: Path) -> None:
    world = World("postgresql", tmp_path / "unused.db")
    world.setup_sync()
    try:
        for factory in (psycopg.RawCursor, psycopg.ClientCursor):
            with psycopg.connect(PG_URL, cursor_factory=factory) as conn:
                world.outbox.add(conn, messages(2))
                world.outbox.add(conn, messages(1))
        assert world.count(world.table) == 6
    finally:
        world.teardown()


def test_a_project_session_subclass_is_recognised(tmp_path: Path) -> None:
    import sqlalchemy
    from sqlalchemy.orm import Session

    class AppSession(Session):
        pass

    world = World("sqlite", tmp_path / "app.db")
    world.setup_sync()
    engine = sqlalchemy.create_engine(f"sqlite:///{world.db}")
    try:
        with AppSession(engine) as session:
            world.outbox.add(session, messages(2))
            session.commit()
        assert world.count(world.table) == 2
    finally:
        engine.dispose()


def test_postgresql_each_insert_shape_stores_every_column(tmp_path: Path) -> None:
    """A basic row (insert_one_basic) leaves its columns to their defaults; the others
    (insert_one_now, insert_one) store what the message says."""
    world = World("postgresql", tmp_path / "unused.db")
    world.outbox = Outbox(table=world.table, targets=["default", Target("partner", True)])
    world.setup_sync()
    full = {"headers": {"h": "v"}, "correlation_id": "c", "causation_id": "u",
            "tenant_id": "t", "aggregate_id": "a"}  # fmt: skip
    written = [
        Message(topic="orders", key="k"),
        Message(topic="orders", key="k", **full),  # type: ignore[arg-type]
        Message(topic="orders", key="k", targets=["partner"]),
        Message(topic="orders", key="k", delay=60, **full),  # type: ignore[arg-type]
    ]
    try:
        with psycopg.connect(PG_URL) as conn:
            for message in written:
                world.outbox.add(conn, message)
        stored = world._run(
            "SELECT external, headers, correlation_id, causation_id, tenant_id, aggregate_id,"
            f" available_at > created_at + interval '50 seconds' FROM {world.table} ORDER BY seq"
        )
    finally:
        world.teardown()
    assert stored == [
        (False, {}, None, None, None, None, False),
        (False, {"h": "v"}, "c", "u", "t", "a", False),
        (True, {}, None, None, None, None, False),
        (False, {"h": "v"}, "c", "u", "t", "a", True),
    ]


@pytest.mark.parametrize(
    ("targets", "defaults", "expected"),
    [
        (["a"], None, [("a", False)]),  # one message, one target: sql.inserts.basic_insert
        (["a", "b"], ["a", "b"], [("a", False), ("b", False)]),
        ([Target("x", external=True)], None, [("x", True)]),
    ],
)
def test_postgresql_a_single_message_reaches_every_default_target(
    tmp_path: Path, targets: list[Any], defaults: list[str] | None, expected: list[Any]
) -> None:
    world = World("postgresql", tmp_path / "unused.db")
    world.outbox = Outbox(table=world.table, targets=targets, default_targets=defaults)
    world.setup_sync()
    try:
        with psycopg.connect(PG_URL) as conn:
            world.outbox.add(conn, Message(topic="orders", key="k", payload={"n": 1}))
        stored = world._run(f"SELECT target, external FROM {world.table} ORDER BY seq")
    finally:
        world.teardown()
    assert stored == expected


def test_a_psycopg_connection_is_not_kept_alive_by_its_channel(tmp_path: Path) -> None:
    import gc
    import weakref

    world = World("postgresql", tmp_path / "unused.db")
    world.setup_sync()
    try:
        conn = psycopg.connect(PG_URL)
        world.outbox.add(conn, messages(1))  # its channel now keeps a cursor
        conn.commit()
        alive = weakref.ref(conn)
        del conn
        gc.collect()
        assert alive() is None
        with psycopg.connect(PG_URL) as conn:  # a new connection, maybe at the same id
            world.outbox.add(conn, messages(2))
        assert world.count(world.table) == 3
    finally:
        world.teardown()


def test_threads_sharing_a_psycopg_connection_each_read_their_own_row_count() -> None:
    """Threads may share a psycopg connection, but not a cursor, and the channel keeps
    one cursor per connection: each statement's row count (the inbox's answer to "first
    copy?") must still reach the thread that ran it. Threads switch between any two
    steps here, as under load; without the channel's lock about 1 in 1,500 counts
    came back from another thread's statement."""
    import threading

    from relaybox.writer.connections import sync_channel

    wrong: list[tuple[int, int]] = []
    start = threading.Barrier(6)

    def count_rows(conn: psycopg.Connection[Any], rows: int) -> None:
        channel = sync_channel(conn)
        start.wait()
        for _ in range(2000):
            counted = channel.execute("SELECT generate_series(1, %s)", (rows,))
            if counted != rows:
                wrong.append((rows, counted))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            threads = [
                threading.Thread(target=count_rows, args=(conn, rows)) for rows in range(1, 7)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []


def test_a_changed_client_encoding_reaches_the_writer(tmp_path: Path) -> None:
    """The channel's kept cursor encodes text in the client encoding it was made under:
    after a `SET client_encoding` the writer must encode in the new one."""
    world = World("postgresql", tmp_path / "unused.db")
    world.setup_sync()
    try:
        with psycopg.connect(PG_URL) as conn:
            world.outbox.add(conn, Message(topic="t", key="before", payload={}))
            conn.execute("SET client_encoding TO 'LATIN1'")
            world.outbox.add(conn, Message(topic="t", key="clé", payload={}))
        assert [key for _, key, *_ in world.rows()] == ["before", "clé"]
    finally:
        world.teardown()


def test_the_inbox_refuses_a_psycopg_pipeline_and_the_writer_works_in_one(tmp_path: Path) -> None:
    """In pipeline mode a statement's row count comes only at the pipeline's end: the
    inbox cannot answer "first copy?" there and says so; the writer needs no count."""
    from relaybox import Inbox, InboxError
    from tests.inbox.support import incoming

    world = World("postgresql", tmp_path / "unused.db")
    world.setup_sync()
    inbox_table = unique_table("ib")
    asyncio.run(migrate(PG_URL, table=inbox_table, kind="inbox"))
    inbox = Inbox(consumer="piped", table=inbox_table)
    try:
        with psycopg.connect(PG_URL) as conn:
            assert inbox.record(conn, incoming("m-1"))  # outside: the usual answer
            with conn.pipeline():
                world.outbox.add(conn, messages(2))
                world.outbox.add(conn, messages(1))
                with pytest.raises(InboxError, match="pipeline"):
                    inbox.record(conn, incoming("m-2"))
            assert inbox.record(conn, incoming("m-2"))  # refused before it wrote anything
        assert world.count(world.table) == 3
    finally:
        world.teardown()
        drop(PG_URL, inbox_table)


def _keyed(count: int) -> list[Message]:
    return [Message(topic="t", key=f"k{n % 7}", payload={"n": n}) for n in range(count)]


def test_a_bulk_add_is_one_insert_statement_on_sqlite(tmp_path: Path) -> None:
    table, db = unique_table("bulk"), tmp_path / "bulk.db"
    asyncio.run(migrate(sqlite_url(db), table=table))
    seen: list[str] = []
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.set_trace_callback(seen.append)
        Outbox(table=table).add(conn, _keyed(300))
        conn.commit()
        assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (300,)
    assert len([s for s in seen if s.lstrip().upper().startswith("INSERT")]) == 1


def test_a_bulk_add_is_one_insert_statement_on_postgresql() -> None:
    """Counted by a statement-level trigger on the outbox table."""
    table = unique_table("bulk")
    counter = f"{table}_statements"
    asyncio.run(migrate(PG_URL, table=table))
    try:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {counter} (n int NOT NULL)")
            conn.execute(f"INSERT INTO {counter} VALUES (0)")
            conn.execute(
                f"CREATE FUNCTION {counter}() RETURNS trigger LANGUAGE plpgsql AS"
                f" $$ BEGIN UPDATE {counter} SET n = n + 1; RETURN NULL; END $$"
            )
            conn.execute(
                f"CREATE TRIGGER {counter} AFTER INSERT ON {table}"
                f" FOR EACH STATEMENT EXECUTE FUNCTION {counter}()"
            )
        with psycopg.connect(PG_URL) as conn:
            Outbox(table=table).add(conn, _keyed(300))
        with psycopg.connect(PG_URL) as conn:
            assert conn.execute(f"SELECT n FROM {counter}").fetchone() == (1,)
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (300,)
    finally:
        drop(PG_URL, table)
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {counter}")
            conn.execute(f"DROP FUNCTION IF EXISTS {counter}()")


async def test_an_asyncpg_pool_connection_writes_in_its_transaction(tmp_path: Path) -> None:
    import asyncpg

    world = World("postgresql", tmp_path / "unused.db")
    await world.setup()
    pool = await asyncpg.create_pool(PG_URL, min_size=1, max_size=2)

    async def rolled_back(conn: Any) -> None:
        async with conn.transaction():
            await world.outbox.add_async(conn, messages(3))
            raise RuntimeError("rolled back")

    try:
        async with pool.acquire() as conn:
            async with conn.transaction():
                await world.outbox.add_async(conn, messages(2))
            with pytest.raises(RuntimeError, match="rolled back"):
                await rolled_back(conn)
        assert world.count(world.table) == 2
    finally:
        await pool.close()
        world.teardown()
