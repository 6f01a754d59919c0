"""The Django app: its migrations build what `relaybox migrate` builds, ORM writes and
messages commit together, and its commands relay and consume.

In-process tests run on the aliases of tests/integration/django_setup.py, each pointed
at a database of its own (a new PostgreSQL or MariaDB database, a new SQLite file), so
that Django's own record of applied migrations starts empty. The commands that run
until a signal run as processes (`python -m django ...`, settings from
tests/integration/djangoshop/settings.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest

from relaybox import Message, sql
from relaybox.errors import ConfigurationError
from relaybox.migrations import migrate
from tests.databases import MYSQL_URL, PG_URL, fetch_all, sqlite_url, unique_table
from tests.migration.test_migrations import _catalog
from tests.relay_support import eventually

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret-of-the-broker"
_ALIASES = {"postgresql": "pg", "mysql": "mysql", "sqlite": "default"}


@contextlib.contextmanager
def fresh_database(dialect: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A database of its own for `dialect`'s alias: (alias, relaybox URL of it)."""
    from django.db import connections

    from tests.integration.django_setup import configure

    configure(tmp_path / "django.db")
    alias = _ALIASES[dialect]
    if dialect == "sqlite":
        yield alias, sqlite_url(tmp_path / "django.db")
        return
    name = unique_table("rbxdj")
    _server(dialect, f"CREATE DATABASE {name}")
    given = connections[alias].settings_dict
    before = given["NAME"]
    connections[alias].close()
    given["NAME"] = name
    server = PG_URL if dialect == "postgresql" else MYSQL_URL
    try:
        yield alias, server.rsplit("/", 1)[0] + f"/{name}"
    finally:
        connections[alias].close()
        given["NAME"] = before
        _server(dialect, f"DROP DATABASE {name}" + " WITH (FORCE)" * (dialect == "postgresql"))


def _server(dialect: str, statement: str) -> None:
    if dialect == "postgresql":
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(statement)
        return
    conn = pymysql.connect(host="127.0.0.1", user="root", password="", autocommit=True)
    with conn, conn.cursor() as cursor:
        cursor.execute(statement)


def _tables() -> dict[str, str]:
    return {"OUTBOX_TABLE": unique_table("djo"), "INBOX_TABLE": unique_table("dji")}


@pytest.mark.parametrize("dialect", sql.DIALECTS)
def test_manage_py_migrate_builds_what_relaybox_migrate_builds(
    dialect: sql.Dialect, tmp_path: Path
) -> None:
    from django.core.management import call_command
    from django.db import connections
    from django.db.migrations.recorder import MigrationRecorder
    from django.test.utils import override_settings

    with fresh_database(dialect, tmp_path) as (alias, url):
        tables = _tables()
        with override_settings(RELAYBOX=tables):
            call_command("migrate", "relaybox", database=alias, verbosity=0)
        applied = MigrationRecorder(connections[alias]).applied_migrations()
        assert ("relaybox", "0001_initial") in applied
        db = tmp_path / "django.db"
        for kind, key in (("outbox", "OUTBOX_TABLE"), ("inbox", "INBOX_TABLE")):
            by_django, by_relaybox = tables[key], unique_table("cli")
            asyncio.run(migrate(url, table=by_relaybox, kind=kind))  # type: ignore[arg-type]
            expected = _catalog(dialect, by_relaybox, db, kind, url)  # type: ignore[arg-type]
            assert expected  # the catalog found the tables
            assert _catalog(dialect, by_django, db, kind, url) == expected  # type: ignore[arg-type]
            rows = "SELECT version, name FROM {}_migrations ORDER BY version"
            assert fetch_all(url, rows.format(by_django)) == fetch_all(
                url, rows.format(by_relaybox)
            )
            # relaybox migrate takes over the tables Django made: nothing left to do.
            report = asyncio.run(migrate(url, table=by_django, kind=kind))  # type: ignore[arg-type]
            assert report.applied == ()


def test_manage_py_migrate_takes_over_from_relaybox_migrate(tmp_path: Path) -> None:
    from django.core.management import call_command
    from django.test.utils import override_settings

    with fresh_database("sqlite", tmp_path) as (alias, url):
        tables = _tables()
        asyncio.run(migrate(url, table=tables["OUTBOX_TABLE"]))
        rows = f"SELECT version, name, applied_at FROM {tables['OUTBOX_TABLE']}_migrations"
        before = fetch_all(url, rows)
        with override_settings(RELAYBOX=tables):
            call_command("migrate", "relaybox", database=alias, verbosity=0)
        assert fetch_all(url, rows) == before  # nothing applied twice
        assert fetch_all(url, f"SELECT count(*) FROM {tables['INBOX_TABLE']}_migrations") == [
            (len(sql.migrations("sqlite", "t", "inbox")),)
        ]


def test_migrating_backwards_is_refused_and_drops_nothing(tmp_path: Path) -> None:
    from django.core.management import call_command
    from django.db.migrations.exceptions import IrreversibleError
    from django.test.utils import override_settings

    with (
        fresh_database("sqlite", tmp_path) as (alias, url),
        override_settings(RELAYBOX=(tables := _tables())),
    ):
        call_command("migrate", "relaybox", database=alias, verbosity=0)
        with pytest.raises(IrreversibleError, match="relaybox has no down migrations"):
            call_command("migrate", "relaybox", "zero", database=alias, verbosity=0)
        assert fetch_all(url, f"SELECT count(*) FROM {tables['OUTBOX_TABLE']}") == [(0,)]


def test_the_latest_django_migration_reaches_relaybox_latest_schema() -> None:
    """A relaybox migration added without a Django migration that applies it fails here."""
    from tests.integration.django_setup import configure

    configure(Path("unused.db"))
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(None, ignore_no_migrations=True)
    reached: dict[str, int] = {}
    for (app, _), migration in sorted(loader.disk_migrations.items()):
        for operation in migration.operations if app == "relaybox" else ():
            reached[operation.kind] = max(reached.get(operation.kind, 0), operation.version)
    for dialect in sql.DIALECTS:
        for kind in sql.KINDS:
            assert reached[kind] == sql.migrations(dialect, "t", kind)[-1][0]


@pytest.mark.parametrize("dialect", sql.DIALECTS)
def test_an_orm_write_and_its_message_commit_together_or_not_at_all(
    dialect: sql.Dialect, tmp_path: Path
) -> None:
    from django.core.management import call_command
    from django.db import transaction
    from django.test.utils import override_settings

    from relaybox.integrations.django import add_messages, outbox
    from tests.integration.djangoshop.models import Order

    with fresh_database(dialect, tmp_path) as (alias, url):
        tables = {**_tables(), "DATABASE": alias}
        with override_settings(RELAYBOX=tables):
            call_command("migrate", database=alias, run_syncdb=True, verbosity=0)
            box = outbox()
            assert box is outbox()  # one per configuration: its listeners stay
            announced: list[Message] = []
            box.subscribe(announced.extend)
            with transaction.atomic(using=alias):
                order = Order.objects.using(alias).create(item="book")
                add_messages(box, Message(topic="orders", key=str(order.pk)))
                assert not announced  # not before the commit

            def failing_view() -> None:
                with transaction.atomic(using=alias):
                    Order.objects.using(alias).create(item="lamp")
                    add_messages(box, Message(topic="orders", key="lost"))
                    raise RuntimeError("the view failed")

            with pytest.raises(RuntimeError, match="the view failed"):
                failing_view()
        assert [o.item for o in Order.objects.using(alias).all()] == ["book"]
        column = "`key`" if dialect == "mysql" else '"key"'
        keys = fetch_all(url, f"SELECT {column} FROM {tables['OUTBOX_TABLE']}")
        assert keys == [(str(order.pk),)]
        assert len(announced) == 1


def test_unknown_settings_are_named_with_the_known_ones(tmp_path: Path) -> None:
    from django.test.utils import override_settings

    from relaybox.cli.relay import relay_settings
    from relaybox.integrations.django.conf import settings
    from tests.integration.django_setup import configure

    configure(tmp_path / "unused.db")
    with (
        override_settings(RELAYBOX={"OUTBOX_TABEL": "x"}),
        pytest.raises(ConfigurationError, match="unknown keys OUTBOX_TABEL; known: BROKERS"),
    ):
        settings()
    consumer = {"URL": "nats://127.0.0.1:4222", "HANDLER": "x.y"}
    with (
        override_settings(RELAYBOX={"CONSUMERS": {"billing": consumer}}),
        pytest.raises(ConfigurationError, match=r"\['billing'\] has unknown keys HANDLER"),
    ):
        settings()
    with pytest.raises(ConfigurationError, match="'hold_key' is not one of: "):
        relay_settings(hold_key=True)
    assert relay_settings(hold_keys=True, retry={"max_attempts": 2}).retry.max_attempts == 2


def _command(
    tmp_path: Path, db: Path, relaybox: dict[str, Any], *arguments: str
) -> subprocess.Popen[str]:
    """`python -m django <arguments>` on the SQLite file `db`, with `relaybox` as
    settings.RELAYBOX."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "tests.integration.djangoshop.settings",
        "RELAYBOX_TEST_SQLITE": str(db),
        "RELAYBOX_TEST_SETTINGS": json.dumps(relaybox),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "django", *arguments], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _stopped(process: subprocess.Popen[str], *, exits: tuple[int, ...] = (0,)) -> str:
    """Send SIGTERM; the process must exit cleanly (with one of `exits`) within
    seconds. Its output."""
    process.send_signal(signal.SIGTERM)
    try:
        output, _ = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(f"still running 20 s after SIGTERM:\n{output}") from None
    assert process.returncode in exits, output
    return output


def _migrated(tmp_path: Path, relaybox: dict[str, Any]) -> Path:
    db = tmp_path / "shop.db"
    migrating = _command(tmp_path, db, relaybox, "migrate", "--run-syncdb", "-v", "0")
    output, _ = migrating.communicate(timeout=60)
    assert migrating.returncode == 0, output
    return db


async def test_the_relay_command_delivers_and_stops_on_sigterm(tmp_path: Path) -> None:
    sink = tmp_path / "delivered.jsonl"
    relaybox = {
        **_tables(),
        # A second target on a server that is down: its errors are logged, its
        # password never.
        "BROKERS": {
            "default": f"file://{sink}",
            "audit": f"nats://relay:{SECRET}@127.0.0.1:1?connect_timeout=0.5",
        },
        "RELAY": {"idle_interval": 0.05, "activity_interval": None},
    }
    db = _migrated(tmp_path, relaybox)
    from relaybox import Outbox

    message = Message(topic="orders", key="1", payload={"item": "book"})
    with contextlib.closing(sqlite3.connect(db)) as lite, lite:
        Outbox(table=relaybox["OUTBOX_TABLE"]).add(lite, message)
    relay = _command(tmp_path, db, relaybox, "relaybox_relay")
    try:
        await eventually(lambda: sink.exists() and str(message.id) in sink.read_text())
    finally:
        output = _stopped(relay)
    assert "stopped" in output
    assert "event loop: uvloop" in output  # the relay process's loop, as `relaybox relay`
    assert "127.0.0.1:1" in output  # the down server was logged
    assert SECRET not in output
    lines = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [(line["id"], line["data"]) for line in lines] == [(str(message.id), {"item": "book"})]


async def test_the_consume_command_applies_a_message_once(tmp_path: Path) -> None:
    from tests.brokers.harness import stored
    from tests.consumers.test_nats import NatsHarness

    async with NatsHarness() as stream:
        relaybox = {
            **_tables(),
            "CONSUMERS": {
                "billing": {
                    "URL": stream.url,
                    "HANDLERS": {"*": "tests.integration.djangoshop.handlers.record_order"},
                    "OPTIONS": {"stream": stream.name, "durable": "billing"},
                }
            },
        }
        db = _migrated(tmp_path, relaybox)
        message = stored(stream.topic)
        await stream.publish(message)
        await stream.publish_copy(message)  # a second delivery of the same message

        def orders() -> list[tuple[str]]:
            with contextlib.closing(sqlite3.connect(db)) as lite:
                return lite.execute("SELECT item FROM djangoshop_order").fetchall()

        consumer = _command(tmp_path, db, relaybox, "relaybox_consume", "billing")
        try:
            await eventually(orders)
            await stream.settling()  # the copy, too, was delivered and acknowledged
        finally:
            output = _stopped(consumer)
        assert "consumer billing stopped" in output
        assert orders() == [(str(message.id),)]


async def test_the_console_command_serves_the_outbox_and_inbox_of_the_settings(
    tmp_path: Path,
) -> None:
    from tests.brokers.harness import free_port
    from tests.console.test_command import _call

    consumer = {"URL": "nats://127.0.0.1:4222", "HANDLERS": {"*": "unused.handler"}}
    relaybox = {**_tables(), "CONSUMERS": {"billing": consumer}}
    db = _migrated(tmp_path, relaybox)
    port = free_port()
    console = _command(tmp_path, db, relaybox, "relaybox_console", "--listen", str(port))
    try:
        await eventually(lambda: _call(port, "/api/session")[0] == 200, timeout=30)
        assert _call(port, "/api/session")[1]["changes"] is False  # no token: read-only
        status, tables = _call(port, "/api/tables")
        assert status == 200
        assert relaybox["OUTBOX_TABLE"] in json.dumps(tables)
        status, inboxes = _call(port, "/api/inboxes")
        assert status == 200
        assert relaybox["INBOX_TABLE"] in json.dumps(inboxes)
    finally:
        # uvicorn shuts down, then raises the signal again, as `relaybox console` does.
        output = _stopped(console, exits=(0, -signal.SIGTERM))
    assert "relaybox console on http://127.0.0.1:" in output


def test_the_commands_reach_the_orm_database_or_the_url_given(tmp_path: Path) -> None:
    from django.db import connections
    from django.test.utils import override_settings

    from relaybox.integrations.django.conf import settings
    from relaybox.integrations.django.management.setup import database_url
    from relaybox.storage.urls import DatabaseUrl
    from tests.integration.django_setup import configure

    configure(tmp_path / "orm.db")
    with override_settings(RELAYBOX={"DATABASE": "pg"}):
        assert database_url(settings()) == "postgresql://postgres@127.0.0.1:5432/test"
    with override_settings(RELAYBOX={}):
        assert database_url(settings()) == f"sqlite:///{tmp_path / 'orm.db'}"
    given = connections["mysql"].settings_dict
    with override_settings(RELAYBOX={"DATABASE": "mysql"}):
        given["PASSWORD"] = "p@ss/w:rd?"
        try:
            url = DatabaseUrl.parse(database_url(settings()))
        finally:
            given["PASSWORD"] = ""
        assert (url.dialect, url.host, url.port, url.user) == ("mysql", "127.0.0.1", 3306, "root")
        assert (url.password, url.database) == ("p@ss/w:rd?", "test")
    pg = connections["pg"].settings_dict
    with override_settings(RELAYBOX={"DATABASE": "pg"}):
        pg["HOST"] = "/run/postgresql"
        try:
            with pytest.raises(ConfigurationError, match=r"a Unix socket: .*'DATABASE_URL'"):
                database_url(settings())
        finally:
            pg["HOST"] = "127.0.0.1"
    socket = "postgresql://shop@/shop?host=/run/postgresql"
    with override_settings(RELAYBOX={"DATABASE": "pg", "DATABASE_URL": socket}):
        assert database_url(settings()) == socket
    with (
        override_settings(RELAYBOX={"DATABASE": "nowhere"}),
        pytest.raises(ConfigurationError, match="no database 'nowhere'"),
    ):
        database_url(settings())


def test_tables_at_a_newer_schema_than_this_relaybox_knows_are_left_alone(
    tmp_path: Path,
) -> None:
    from django.core.management import call_command
    from django.test.utils import override_settings

    from relaybox.errors import SchemaError

    with (
        fresh_database("sqlite", tmp_path) as (alias, url),
        override_settings(RELAYBOX=(tables := _tables())),
    ):
        outbox = tables["OUTBOX_TABLE"]
        asyncio.run(migrate(url, table=outbox))
        rows = f"SELECT version FROM {outbox}_migrations ORDER BY version"
        with contextlib.closing(sqlite3.connect(tmp_path / "django.db")) as lite, lite:
            lite.execute(f"INSERT INTO {outbox}_migrations (version, name) VALUES (99, 'later')")
        with pytest.raises(SchemaError, match="newer than this relaybox knows"):
            call_command("migrate", "relaybox", database=alias, verbosity=0)
        assert fetch_all(url, rows)[-1] == (99,)


@pytest.mark.parametrize(
    ("consumer", "error"),
    [
        ({"URL": "nats://127.0.0.1:4222", "HANDLERS": {"*": "no.such.module"}},
         "consumer 'billing': No module named 'no'"),
        ({"URL": "nats://127.0.0.1:4222",
          "HANDLERS": {"*": "tests.integration.djangoshop.handlers.record_order_async"}},
         "plain `def` functions, not `async def`"),
        ({"URL": "gopher://127.0.0.1:70",
          "HANDLERS": {"*": "tests.integration.djangoshop.handlers.record_order"}},
         "URL scheme 'gopher' is not one of amqp, amqps, kafka"),
        ({"URL": "nats://127.0.0.1:4222", "INBOX": {"mood": "id"},
          "HANDLERS": {"*": "tests.integration.djangoshop.handlers.record_order"}},
         "consumer 'billing' INBOX: .*'mood'"),
        ({"URL": "nats://127.0.0.1:4222", "OPTIONS": {"streem": "ORDERS"},
          "HANDLERS": {"*": "tests.integration.djangoshop.handlers.record_order"}},
         "consumer 'billing' OPTIONS: .*'streem'"),
    ],
)  # fmt: skip
def test_the_consume_command_refuses_a_consumer_it_cannot_build(
    consumer: dict[str, Any], error: str, tmp_path: Path
) -> None:
    from django.core.management import CommandError, call_command
    from django.test.utils import override_settings

    from tests.integration.django_setup import configure

    configure(tmp_path / "unused.db")
    with override_settings(RELAYBOX={"CONSUMERS": {"billing": consumer}}):
        with pytest.raises(CommandError, match=error):
            call_command("relaybox_consume", "billing")
        with pytest.raises(CommandError, match=r"no consumer 'shipping' \(configured: billing\)"):
            call_command("relaybox_consume", "shipping")


@pytest.mark.parametrize(
    ("relaybox", "error"),
    [
        ({}, r"RELAYBOX\['BROKERS'\] names no broker"),
        ({"BROKERS": {"default": "memory://"}, "RELAY": {"hold_key": True}},
         "relay option 'hold_key' is not one of: "),
        ({"BROKERS": {"default": "memory://"}, "RELAY": {"batch_size": 0}},
         "batch_size, max_in_flight, max_claim_bytes and cleanup_batch must be >= 1"),
    ],
)  # fmt: skip
def test_the_relay_command_refuses_settings_it_cannot_run(
    relaybox: dict[str, Any], error: str, tmp_path: Path
) -> None:
    from django.core.management import CommandError, call_command
    from django.test.utils import override_settings

    from tests.integration.django_setup import configure

    configure(tmp_path / "unused.db")
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with override_settings(RELAYBOX=relaybox), pytest.raises(CommandError, match=error):
        call_command("relaybox_relay")
    # The command called in-process leaves this process's signal handling as it was.
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
