"""Every ```python block of the pages under docs/ is executed here, or says why not.

A page's blocks run in order in one namespace, as a reader would type them, each page on
its own: SQLite files under the test's directory, the `memory://` broker, and PostgreSQL
in a schema of the test's own where the page's example needs psycopg. A page's setup
(`SETUPS`) supplies what the page leaves to the reader (`DSN`, `DB_URL`, a handler) and
may swap a literal URL for a local one; a swap the page no longer needs fails the test,
and so does a check the setup makes once the page has run.

A block that is not run carries `<!-- excerpt: examples/PATH -->` on the line
before it: it is copied from that file, which a test runs, and must appear there
verbatim. Text that is not Python to run (a signature, a command) is fenced as
something else than ```python.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import decimal
import inspect
import re
import signal
import socket
import sys
import types
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg
import pytest

from relaybox.migrations import migrate
from tests.databases import PG_URL, sqlite_url, unique_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = "```python"
EXCERPT = re.compile(r"<!-- excerpt: (\S+) -->")


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """One ```python block of a page, with the excerpt marker before it, if any."""

    page: str
    line: int
    code: str
    excerpt: str | None

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def blocks(page: str, path: Path | None = None) -> list[Block]:
    """The python blocks of `page` (docs/PAGE, or the file at `path`), in order."""
    lines = (path or DOCS / page).read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    for number, line in enumerate(lines):
        if line.strip() != FENCE:
            continue
        end = next(i for i in range(number + 1, len(lines)) if lines[i].strip() == "```")
        before = next((text for text in reversed(lines[:number]) if text.strip()), "")
        excerpt = EXCERPT.fullmatch(before)
        found.append(
            Block(
                page=page,
                line=number + 1,
                code="\n".join(lines[number + 1 : end]) + "\n",
                excerpt=excerpt.group(1) if excerpt else None,
            )
        )
    return found


PAGES = sorted(
    page
    for page in (path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    if blocks(page)
)


def _compile(block: Block, code: str) -> Any:
    return compile(code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def _run(block: Block, code: str, namespace: dict[str, Any]) -> None:
    """Run the block; one with a top-level `await` or `async with` on an event loop."""
    compiled = _compile(block, code)
    if compiled.co_flags & inspect.CO_COROUTINE:
        asyncio.run(eval(compiled, namespace))
    else:
        exec(compiled, namespace)


@dataclasses.dataclass(slots=True)
class Setting:
    """What a page's setup gives its blocks: names to start from, literals to swap."""

    namespace: dict[str, Any] = dataclasses.field(default_factory=dict)
    swaps: dict[str, str] = dataclasses.field(default_factory=dict)


Setup = Callable[[Path], contextlib.AbstractContextManager[Setting]]


def _sqlite(path: Path, table: str | None = None) -> str:
    url = sqlite_url(path)
    asyncio.run(migrate(url, table=table))
    return url


@contextlib.contextmanager
def _schema(columns: str) -> Iterator[tuple[str, str]]:
    """A PostgreSQL schema of the test's own with relaybox's outbox and inbox tables
    under their default names and an `orders` table of `columns`: (schema, its DSN)."""
    schema = unique_table("docs")
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        asyncio.run(migrate(PG_URL, table=f"{schema}.relaybox_outbox"))
        asyncio.run(migrate(PG_URL, table=f"{schema}.relaybox_inbox", kind="inbox"))
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {schema}.orders ({columns})")
        yield schema, f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def _outbox_rows(schema: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(PG_URL) as conn:
        query = f"SELECT topic, key, target FROM {schema}.relaybox_outbox ORDER BY seq"
        return conn.execute(query).fetchall()


@dataclasses.dataclass(frozen=True, slots=True)
class _Pool:
    """Stands for the application's asyncpg pool: each `acquire` is a new connection
    to the test's schema, opened on the running event loop."""

    schema: str

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Any]:
        import asyncpg

        conn = await asyncpg.connect(PG_URL, server_settings={"search_path": self.schema})
        try:
            yield conn
        finally:
            await conn.close()


@contextlib.contextmanager
def _django(path: Path) -> Iterator[type[Any]]:
    """Django configured as the integration tests do, its default database the SQLite
    file at `path` with relaybox's outbox and the test app's `Order` table; the model is
    importable as `shop.models.Order`, the project the page writes about."""
    from django.db import connection

    from tests.integration.django_setup import configure

    configure(path)
    from tests.integration import djangoshop
    from tests.integration.djangoshop.models import Order

    _sqlite(path)
    with connection.schema_editor() as editor:
        editor.create_model(Order)
    sys.modules.update({"shop": djangoshop, "shop.models": djangoshop.models})
    try:
        yield Order
    finally:
        del sys.modules["shop"], sys.modules["shop.models"]
        connection.close()


@dataclasses.dataclass(frozen=True, slots=True)
class _Orm:
    """The SQLAlchemy application of the domain events example: `Base`, and a
    `SessionFactory` on `engine`; `models` holds the classes the page maps
    (SQLAlchemy itself only refers to them weakly)."""

    engine: Any
    models: list[type[Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def on(cls, url: str) -> _Orm:
        from sqlalchemy import create_engine

        return cls(create_engine(url.replace("sqlite://", "sqlite+pysqlite://", 1)))

    def names(self) -> dict[str, Any]:
        from sqlalchemy.orm import DeclarativeBase, sessionmaker

        models = self.models

        class Base(DeclarativeBase):
            def __init_subclass__(cls, **kwargs: Any) -> None:
                super().__init_subclass__(**kwargs)
                models.append(cls)

        return {"Base": Base, "SessionFactory": sessionmaker(self.engine)}

    def place_an_order(self, made: dict[str, Any]) -> int:
        """Place an order through the page's tracked session; the messages it wrote."""
        from sqlalchemy import text

        (order_class,) = self.models
        made["Base"].metadata.create_all(self.engine)
        with made["SessionFactory"]() as session:
            order = order_class(id=7)
            session.add(order)
            session.flush()
            order.place()
            session.commit()
        with self.engine.connect() as conn:
            query = text("SELECT count(*) FROM relaybox_outbox WHERE key = '7'")
            return int(conn.execute(query).scalar_one())


@contextlib.contextmanager
def getting_started(tmp_path: Path) -> Iterator[Setting]:
    """The psycopg and asyncpg examples on PostgreSQL, in a schema of its own (its
    `Outbox()` writes to the default table name), domain events on SQLite, Django on its
    test app; the relay examples on SQLite and the memory broker."""
    with (
        _schema("id bigint, total numeric") as (schema, dsn),
        _django(tmp_path / "django.db") as django_order,
    ):
        database = _sqlite(tmp_path / "shop.db")
        orm = _Orm.on(_sqlite(tmp_path / "orm.db"))
        setting = Setting(
            namespace={
                "psycopg": psycopg,
                "DSN": dsn,
                "order_id": 42,
                "total": decimal.Decimal("129.90"),
                "order": {"order_id": 42, "total": "129.90"},
                "pool": _Pool(schema),
                "DB_URL": database,
                "BROKER_URL": "memory://",
                **orm.names(),
            },
            swaps={"postgresql://localhost/shop": database, "nats://localhost:4222": "memory://"},
        )
        yield setting
        assert _outbox_rows(schema) == [
            ("orders", "42", "default"),
            ("orders", "42", "default"),
            ("orders", None, "default"),
            ("orders", None, "default"),
            ("orders", None, "partner"),
        ]
        assert django_order.objects.filter(item="lamp").count() == 1
        assert orm.place_an_order(setting.namespace) == 1


@contextlib.contextmanager
def django(tmp_path: Path) -> Iterator[Setting]:
    """The test app's `Order` and an item to order; the consumer's handler is the
    reader's."""
    with _django(tmp_path / "django.db") as order:
        yield Setting(
            namespace={"Order": order, "item": "lamp", "handle": lambda message, connection: None}
        )
        assert order.objects.filter(item="lamp").count() == 1


@contextlib.contextmanager
def celery(tmp_path: Path) -> Iterator[Setting]:
    """The shop's `orders` table and the worker's `receipts` table on PostgreSQL, a
    Celery `app` whose task is then called directly, twice under one task id: the
    inbox lets the first call write its receipt and the second nothing."""
    from celery import Celery

    columns = "id bigint, email text"
    with _schema(columns) as (schema, dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE receipts (order_id bigint, email text)")
        app = Celery("docs", broker="memory://")
        setting = Setting(
            namespace={
                "psycopg": psycopg,
                "DSN": dsn,
                "order_id": 42,
                "email": "ada@example.com",
                "app": app,
            }
        )
        yield setting
        assert _outbox_rows(schema) == [("tasks", "42", "default")]
        task = setting.namespace["send_receipt"]
        for _ in range(2):
            task.apply(kwargs={"order_id": 42, "email": "ada@example.com"}, task_id="7e4f")
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT order_id FROM receipts").fetchall() == [(42,)]


async def _deposit(ledger: Any) -> None:
    """Apply one deposit through the page's consumer, then close its Redis clients."""
    from relaybox import Incoming

    try:
        message = Incoming(id="d-1", payload=b'{"amount": 5}', key="acct-1", topic="deposits")
        await ledger.process(message)
    finally:
        await ledger.entities.client.aclose()
        await ledger.dedup.client.aclose()


@contextlib.contextmanager
def entities(tmp_path: Path) -> Iterator[Setting]:
    """Redis at 127.0.0.1 under a prefix of the test's own (its keys deleted
    afterwards) and a memory publisher; one deposit then goes through the ledger and its
    balance message is published."""
    import redis

    from relaybox.publishers.memory import MemoryPublisher

    prefix = unique_table("docs") + ":"
    publisher = MemoryPublisher()
    setting = Setting(
        namespace={"publisher": publisher},
        swaps={
            "redis://primary:6379/0": "redis://127.0.0.1:6379/0",
            'prefix="ledger:"': f"prefix={prefix!r}",
            "redis://...": "redis://127.0.0.1:6379/0",
        },
    )
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        yield setting
        asyncio.run(_deposit(setting.namespace["ledger"]))
        assert [m.payload for m in publisher.published] == [b'{"balance":5}']
    finally:
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
        client.close()


@contextlib.asynccontextmanager
async def _transaction() -> AsyncIterator[None]:
    """Stands for the consumer's transaction, which the page's first example makes."""
    yield None


@contextlib.contextmanager
def inbox(tmp_path: Path) -> Iterator[Setting]:
    """The first example only defines `main`: tests/inbox/test_docs_example.py runs it
    (an embedded NATS server) and checks what it returns. The typed handler's block
    needs the transaction the first example makes inside `main`."""
    yield Setting(namespace={"dataclasses": dataclasses, "transaction": _transaction})


@contextlib.contextmanager
def observability(tmp_path: Path) -> Iterator[Setting]:
    """The relay's database, its broker and the consumer's parts are the reader's."""
    from relaybox import Consumer, Inbox, Relay
    from relaybox.consumers.nats import NatsConsumer

    yield Setting(
        namespace={
            "Relay": Relay,
            "Consumer": Consumer,
            "NatsConsumer": NatsConsumer,
            "database_url": _sqlite(tmp_path / "shop.db"),
            "broker_url": "nats://127.0.0.1:4222",
            "handler": lambda message, connection: None,
            "inbox": Inbox(consumer="docs"),
            "begin": _transaction,
        }
    )


async def _served(app: Any, path: str) -> int:
    """The status of a GET of `path` from `app`, inside the application's lifespan."""
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client,
    ):
        return (await client.get(path)).status_code


@contextlib.contextmanager
def frameworks(tmp_path: Path) -> Iterator[Setting]:
    """What the FastAPI and Flask services import and define before the page's code: a
    SQLite database with the outbox table `outbox`, its engine and `orders` table, an
    `Order` request body; the relay publishes to the memory broker. Flask's extension
    takes SIGTERM where it has its default action: the handler is put back afterwards."""
    import flask
    import pydantic
    import sqlalchemy
    from fastapi import FastAPI

    from relaybox import Message, Outbox, Relay
    from relaybox.integrations.asgi import relay_lifespan
    from relaybox.integrations.flask import Relaybox

    class Order(pydantic.BaseModel):
        item: str

    database = _sqlite(tmp_path / "shop.db", table="outbox")
    _sqlite(tmp_path / "shop.db")
    metadata = sqlalchemy.MetaData()
    orders = sqlalchemy.Table("orders", metadata, sqlalchemy.Column("item", sqlalchemy.Text))
    engine = sqlalchemy.create_engine(database.replace("sqlite:", "sqlite+pysqlite:", 1))
    before = signal.getsignal(signal.SIGTERM)
    try:
        names = {"Outbox": Outbox, "Relay": Relay, "Message": Message, "FastAPI": FastAPI}
        names |= {"relay_lifespan": relay_lifespan, "Relaybox": Relaybox, "Flask": flask.Flask}
        names |= {"DB_URL": database, "orders": orders, "Order": Order, "engine": engine}
        setting = Setting(
            namespace={**names, "request": flask.request},
            swaps={"nats://nats:4222": "memory://"},
        )
        yield setting
        with engine.begin() as connection:
            metadata.create_all(connection)
        relaybox = setting.namespace["relaybox"]
        try:
            answer = setting.namespace["app"].test_client().post("/orders", json={"item": "lamp"})
        finally:
            relaybox.stop()
        assert answer.get_json() == {"item": "lamp"}
        with engine.connect() as connection:
            assert connection.execute(orders.select()).all() == [("lamp",)]
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def log_mode(tmp_path: Path) -> Iterator[Setting]:
    """The writer on a throwaway PostgreSQL with wal_level=logical (the shared one runs
    replica), its outbox table and slot made as `relaybox migrate --log` makes them. The
    order is written and the outbox table stays empty: the message went to the log."""
    from relaybox.storage.pg_log import create_slot
    from tests.chaos.cluster import ThrowawayPostgres
    from tests.databases import create

    server = ThrowawayPostgres({"wal_level": "logical", "max_replication_slots": "2"})
    try:
        server.start()
        asyncio.run(create(server.url, "relaybox_outbox"))
        assert asyncio.run(create_slot(server.url, "relaybox_outbox"))
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (id bigint, total numeric)")
        yield Setting(
            namespace={
                "psycopg": psycopg,
                "DSN": server.url,
                "order_id": 42,
                "total": decimal.Decimal("129.90"),
            }
        )
        with psycopg.connect(server.url) as conn:
            assert conn.execute("SELECT id FROM orders").fetchall() == [(42,)]
            assert conn.execute("SELECT count(*) FROM relaybox_outbox").fetchone() == (0,)
    finally:
        server.destroy()


def _free_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return int(listener.getsockname()[1])


@contextlib.contextmanager
def operations(tmp_path: Path) -> Iterator[Setting]:
    """The status server on a free port and the collector in a registry of the test's
    own, standing for the process-wide one; the console mounted in a FastAPI
    application: its lifespan opens the table and the mounted console answers."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    setting = Setting(
        namespace={
            "DB_URL": _sqlite(tmp_path / "shop.db"),
            "BROKER_URL": "memory://",
            "DATABASE_URL": _sqlite(tmp_path / "shop.db", table="outbox"),
            "CONSOLE_TOKEN": "a-console-token-of-the-docs",
        },
        swaps={'"127.0.0.1", 9464': f'"127.0.0.1", {_free_port()}'},
    )
    with mock.patch.object(prometheus_client, "REGISTRY", registry):
        yield setting
    assert "relaybox_outbox_messages" in {metric.name for metric in registry.collect()}
    assert asyncio.run(_served(setting.namespace["app"], "/ops/")) == 200


SETUPS: dict[str, Setup] = {
    "getting-started.md": getting_started,
    "celery.md": celery,
    "django.md": django,
    "entities.md": entities,
    "frameworks.md": frameworks,
    "log-mode.md": log_mode,
    "inbox.md": inbox,
    "observability.md": observability,
    "operations.md": operations,
}


@contextlib.contextmanager
def _nothing(tmp_path: Path) -> Iterator[Setting]:
    yield Setting()


@contextlib.contextmanager
def _module(page: str) -> Iterator[dict[str, Any]]:
    """A module for the page's blocks to run in (a dataclass looks its module up), and
    gone again afterwards."""
    module = types.ModuleType("docs_" + re.sub(r"\W", "_", page.removesuffix(".md")))
    sys.modules[module.__name__] = module
    try:
        yield module.__dict__
    finally:
        del sys.modules[module.__name__]


def _swapped(code: str, swaps: dict[str, str]) -> str:
    for old, new in swaps.items():
        code = code.replace(old, new)
    return code


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_runs_or_says_why_not(page: str, tmp_path: Path) -> None:
    found = blocks(page)
    with SETUPS.get(page, _nothing)(tmp_path) as setting, _module(page) as namespace:
        namespace.update(setting.namespace)
        for old in setting.swaps:
            assert any(old in block.code for block in found), f"{page} no longer has {old!r}"
        for block in found:
            if block.excerpt is not None:
                source = (ROOT / block.excerpt).read_text(encoding="utf-8")
                assert block.code in source, f"{block.where} is not in {block.excerpt}"
            else:
                _run(block, _swapped(block.code, setting.swaps), namespace)
        setting.namespace.update(namespace)  # what the page made, for the setup's checks


def test_a_block_without_an_excerpt_marker_is_run(tmp_path: Path) -> None:
    """Any other comment before a block, such as an old reason to skip it, leaves it
    to be run."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- fragment: the reader's own connection -->\n\n"
        f"{FENCE}\nconn.execute(...)\n```\n\n"
        f"{FENCE}\nimport json\n```\n\n"
        "<!-- excerpt: examples/testing/shop.py -->\n"
        f"{FENCE}\nimport sqlite3\n```\n",
        encoding="utf-8",
    )
    commented, plain, excerpt = blocks("page.md", page)
    assert (commented.excerpt, commented.code) == (None, "conn.execute(...)\n")
    assert (plain.excerpt, plain.code) == (None, "import json\n")
    assert (excerpt.excerpt, excerpt.line) == ("examples/testing/shop.py", 12)


def test_no_page_marks_a_block_as_not_run() -> None:
    """Only excerpts of examples that tests run are left out: no page keeps a block
    behind another marker."""
    marked = [
        f"docs/{page}"
        for page in sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
        if "<!-- fragment:" in (DOCS / page).read_text(encoding="utf-8")
    ]
    assert marked == []
