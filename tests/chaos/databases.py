"""The databases a chaos world runs on: PostgreSQL, MariaDB and SQLite, each private,
and PostgreSQL in log mode.

A `ChaosDatabase` gives the world what differs between them: its server (started,
crashed and started again, where there is one), the URL a relay gets (through a proxy
port, where there is a link to cut), and a `Session`: the application's own connection,
used by the writers and by the inbox consumers, through psycopg, aiomysql or
aiosqlite. SQLite is a file that several relay processes share: it has no server to
restart and no link to cut, so those faults do not apply to it (`server = False`).

Log mode (`log = True`) is a database of its own here because everything differs on
the server's side: a PostgreSQL with wal_level=logical, the table's replication slot
made at migration, writers emitting into the write-ahead log (`LogOutbox`) instead of
inserting rows, and relays streaming the slot (`relaybox relay --mode log`). The
faults are the same ones, and so is the judgement.
"""

from __future__ import annotations

import abc
import contextlib
import sqlite3
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import aiomysql
import aiosqlite
import psycopg
import pymysql

from tests.chaos.cluster import ThrowawayMariaDB, ThrowawayPostgres
from tests.databases import fetch_all

#: What an application table needs in every dialect (`key` is reserved in MySQL).
ORDERS = "CREATE TABLE orders (id VARCHAR(36) PRIMARY KEY, order_key VARCHAR(64))"
EFFECTS = "CREATE TABLE effects (message_id VARCHAR(64) NOT NULL)"


class Session(abc.ABC):
    """One application connection: explicit transactions, statements with parameters."""

    #: The driver's connection, as `Outbox.add_async` and `Inbox` take it.
    raw: Any

    @abc.abstractmethod
    async def begin(self) -> None: ...

    @abc.abstractmethod
    async def execute(self, query: str, params: tuple[Any, ...]) -> None: ...

    @abc.abstractmethod
    async def commit(self) -> None: ...

    @abc.abstractmethod
    async def rollback(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @property
    @abc.abstractmethod
    def usable(self) -> bool: ...


class ChaosDatabase(abc.ABC):
    name: ClassVar[str]
    #: Whether there is a server to restart and a link to cut.
    server: ClassVar[bool] = True
    #: The driver's errors: a statement or a connection that failed.
    errors: ClassVar[tuple[type[BaseException], ...]]
    #: The driver's parameter placeholder.
    placeholder: ClassVar[str] = "%s"
    #: The outbox id as text, in a query.
    id_text: ClassVar[str] = "id"
    #: Where finished (published, abandoned) rows live: beside the outbox table
    #: (PostgreSQL's `_done`), or in it.
    finished_suffix: ClassVar[str] = ""
    #: Log mode: writers emit into PostgreSQL's write-ahead log (`LogOutbox`) and the
    #: relays stream the table's replication slot (`relaybox relay --mode log`).
    log: ClassVar[bool] = False
    #: The database's port, which a proxy forwards to (None: no server).
    port: int | None

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The database's own URL, for migrations and for the checker's reads."""

    @abc.abstractmethod
    def relay_url(self, proxy_port: int | None) -> str:
        """What a relay gets: the URL through its proxy, where there is one."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start the server (again, on the same port and data after `crash()`)."""

    def crash(self) -> None:
        raise NotImplementedError(f"{self.name} has no server to crash")

    @abc.abstractmethod
    def destroy(self) -> None:
        """Stop the server by its PID and delete its data."""

    @abc.abstractmethod
    async def connect(self) -> Session:
        """A new application connection; raises one of `errors` when it cannot."""

    def fetch_all(self, query: str) -> list[tuple[Any, ...]]:
        return fetch_all(self.url, query)

    @abc.abstractmethod
    def run(self, statement: str) -> None:
        """Run one statement that returns no rows, autocommitted."""


# -- PostgreSQL ---------------------------------------------------------------------


class _PsycopgSession(Session):
    def __init__(self, raw: psycopg.AsyncConnection[Any]) -> None:
        self.raw = raw

    async def begin(self) -> None:
        pass  # psycopg opens a transaction at the first statement

    async def execute(self, query: str, params: tuple[Any, ...]) -> None:
        await self.raw.execute(query, params)

    async def commit(self) -> None:
        await self.raw.commit()

    async def rollback(self) -> None:
        await self.raw.rollback()

    async def close(self) -> None:
        await self.raw.close()

    @property
    def usable(self) -> bool:
        return not (self.raw.closed or self.raw.broken)


class _ServerDatabase(ChaosDatabase):
    """A database served by a throwaway server of the test's own, reached by relays
    through their proxies."""

    def __init__(self, server: ThrowawayPostgres | ThrowawayMariaDB) -> None:
        self.server_process = server
        self.port = server.port

    @property
    def url(self) -> str:
        return self.server_process.url

    def relay_url(self, proxy_port: int | None) -> str:
        assert proxy_port is not None
        return self.server_process.url_via(proxy_port)

    def start(self) -> None:
        self.server_process.start()

    def crash(self) -> None:
        self.server_process.crash()

    def destroy(self) -> None:
        self.server_process.destroy()


class ChaosPostgres(_ServerDatabase):
    name = "PostgreSQL"
    errors = (psycopg.Error,)
    id_text = "id::text"
    finished_suffix = "_done"

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        super().__init__(ThrowawayPostgres(settings))

    async def connect(self) -> Session:
        return _PsycopgSession(await psycopg.AsyncConnection.connect(self.url, connect_timeout=2))

    def run(self, statement: str) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(statement)


#: What log mode needs of the server: logical decoding, and a WAL sender for each relay
#: (one streams the slot; the others keep trying, each attempt a sender of its own).
LOGICAL = {"wal_level": "logical", "max_replication_slots": "10", "max_wal_senders": "20"}


class ChaosPostgresLog(ChaosPostgres):
    name = "PostgreSQL (log mode)"
    log = True

    def __init__(self) -> None:
        super().__init__(LOGICAL)


# -- MariaDB ------------------------------------------------------------------------


class _AiomysqlSession(Session):
    def __init__(self, raw: aiomysql.Connection) -> None:
        self.raw = raw

    async def begin(self) -> None:
        await self.raw.begin()

    async def execute(self, query: str, params: tuple[Any, ...]) -> None:
        async with self.raw.cursor() as cursor:
            await cursor.execute(query, params)

    async def commit(self) -> None:
        await self.raw.commit()

    async def rollback(self) -> None:
        await self.raw.rollback()

    async def close(self) -> None:
        self.raw.close()  # no goodbye to a server that may be gone

    @property
    def usable(self) -> bool:
        return not self.raw.closed


class ChaosMariaDB(_ServerDatabase):
    name = "MariaDB"
    # aiomysql raises PyMySQL's errors; a connection lost mid-read is an OSError.
    errors = (pymysql.Error, OSError, TimeoutError)

    def __init__(self) -> None:
        super().__init__(ThrowawayMariaDB())

    async def connect(self) -> Session:
        raw = await aiomysql.connect(
            host="127.0.0.1", port=self.port, user="root", db=ThrowawayMariaDB.database,
            autocommit=False, connect_timeout=2,
        )  # fmt: skip
        return _AiomysqlSession(raw)

    def fetch_all(self, query: str) -> list[tuple[Any, ...]]:
        with contextlib.closing(self.server_process.connect()) as conn, conn.cursor() as cursor:
            cursor.execute(query)
            return list(cursor.fetchall())

    def run(self, statement: str) -> None:
        with contextlib.closing(self.server_process.connect()) as conn, conn.cursor() as cursor:
            cursor.execute(statement)


# -- SQLite -------------------------------------------------------------------------

#: How long a connection waits for the file's write lock before it gives up (ms).
SQLITE_BUSY_MS = 30_000


class _AiosqliteSession(Session):
    def __init__(self, raw: aiosqlite.Connection) -> None:
        self.raw = raw

    async def begin(self) -> None:
        await self.raw.execute("BEGIN IMMEDIATE")  # the write lock first: no deadlock

    async def execute(self, query: str, params: tuple[Any, ...]) -> None:
        await self.raw.execute(query, params)

    async def commit(self) -> None:
        await self.raw.execute("COMMIT")

    async def rollback(self) -> None:
        if self.raw.in_transaction:
            await self.raw.execute("ROLLBACK")

    async def close(self) -> None:
        await self.raw.close()

    @property
    def usable(self) -> bool:
        return True


class ChaosSQLite(ChaosDatabase):
    name = "SQLite"
    server = False
    errors = (sqlite3.Error,)
    placeholder = "?"

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="relaybox-chaos-sqlite-"))
        self.path = self.dir / "chaos.db"
        self.port = None

    @property
    def url(self) -> str:
        return f"sqlite:///{self.path}"

    def relay_url(self, proxy_port: int | None) -> str:
        return self.url

    def start(self) -> None:
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            conn.execute("PRAGMA journal_mode = WAL")

    def destroy(self) -> None:
        for each in self.dir.iterdir():
            each.unlink()
        self.dir.rmdir()

    async def connect(self) -> Session:
        raw = await aiosqlite.connect(self.path, isolation_level=None)
        await raw.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_MS}")
        return _AiosqliteSession(raw)

    def fetch_all(self, query: str) -> list[tuple[Any, ...]]:
        with contextlib.closing(sqlite3.connect(self.path, timeout=SQLITE_BUSY_MS / 1000)) as conn:
            return list(conn.execute(query).fetchall())

    def run(self, statement: str) -> None:
        with (
            contextlib.closing(sqlite3.connect(self.path, timeout=SQLITE_BUSY_MS / 1000)) as conn,
            conn,
        ):
            conn.execute(statement)


DATABASES: dict[str, type[ChaosDatabase]] = {
    "postgresql": ChaosPostgres,
    "postgresql-log": ChaosPostgresLog,
    "mariadb": ChaosMariaDB,
    "sqlite": ChaosSQLite,
}
