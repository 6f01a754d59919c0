"""Migrations applied in order yield exactly the reviewed schema (schema.sql), and are
idempotent."""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pymysql
import pytest

from relaybox import sql
from relaybox.migrations import migrate
from tests.databases import MYSQL_URL, PG_URL, drop, sqlite_url, unique_table

#: What the PostgreSQL catalog says of a table (each query takes the table's name) and of
#: the enum types and functions its migrations made (each takes a LIKE pattern of names
#: starting with it): their definitions, bodies included (the claim and the read live there).
_PG_TABLE_CATALOG = (
    "SELECT column_name, data_type, udt_name, is_nullable, column_default, is_identity,"
    " collation_name, ordinal_position FROM information_schema.columns"
    " WHERE table_name = %s ORDER BY ordinal_position",
    "SELECT indexdef FROM pg_indexes WHERE tablename = %s ORDER BY indexname",
    "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass"
    " ORDER BY conname",
    "SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
    "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = %s::regclass"
    " AND NOT tgisinternal ORDER BY tgname",
)
_PG_NAMED_CATALOG = (
    "SELECT t.typname, string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)"
    " FROM pg_type t JOIN pg_enum e ON e.enumtypid = t.oid"
    " WHERE t.typname LIKE %s GROUP BY t.typname ORDER BY t.typname",
    "SELECT pg_get_functiondef(p.oid) FROM pg_proc p WHERE p.proname LIKE %s"
    " ORDER BY p.proname, pg_get_function_identity_arguments(p.oid)",
)


def _pg_catalog(table: str, url: str = PG_URL) -> list[tuple[object, ...]]:
    with psycopg.connect(url) as conn:
        catalog = [
            row
            for queries, arg in ((_PG_TABLE_CATALOG, table), (_PG_NAMED_CATALOG, table + "\\_%"))
            for query in queries
            for row in conn.execute(query, (arg,)).fetchall()
        ]
    return [tuple(str(v).replace(table, "T") for v in row) for row in catalog]


def _mysql_catalog(table: str, url: str = MYSQL_URL) -> list[tuple[object, ...]]:
    database = url.rsplit("/", 1)[1]
    conn = pymysql.connect(host="127.0.0.1", user="root", password="", database=database)
    with conn, conn.cursor() as cursor:
        cursor.execute(f"SHOW CREATE TABLE {table}")
        ((_, ddl),) = cursor.fetchall()
    ddl = ddl.replace(table, "T").split("AUTO_INCREMENT=")[0]
    return [(line.strip(),) for line in ddl.splitlines()]


def _sqlite_catalog(db: Path, table: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE tbl_name = ? ORDER BY name", (table,)
        ).fetchall()
    return [tuple(" ".join(str(v).replace(table, "T").split()) for v in row) for row in rows]


def _apply_schema(dialect: str, url: str, table: str, db: Path, kind: sql.Kind) -> None:
    statements = sql.statements(sql.schema(dialect, table, kind))  # type: ignore[arg-type]
    if dialect == "postgresql":
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)
    elif dialect == "mysql":
        conn = pymysql.connect(host="127.0.0.1", user="root", password="", database="test")
        with conn, conn.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)
    else:
        with sqlite3.connect(db) as lite:
            for statement in statements:
                lite.execute(statement)


#: The tables the migrations create beside the outbox table, by suffix.
_SIDE_TABLES = {
    "postgresql": (
        "_members",
        "_partitions",
        "_done",
        "_audit",
        "_backfills",
        "_activity",
        "_relay_status",
    ),
    "mysql": (
        "_key_locks",
        "_members",
        "_partitions",
        "_audit",
        "_backfills",
        "_activity",
        "_relay_status",
    ),
    "sqlite": ("_members", "_partitions", "_audit", "_backfills", "_activity", "_relay_status"),
}
#: The tables the inbox migrations create beside the inbox table, by suffix.
_INBOX_SIDE_TABLES = ("_watermarks", "_parked", "_attempts", "_activity")


def _catalog(
    dialect: str, table: str, db: Path, kind: sql.Kind, url: str | None = None
) -> list[tuple[object, ...]]:
    """The catalog of the outbox (or inbox) table and every table beside it, rows tagged;
    `url`: a PostgreSQL or MySQL database other than the shared test one."""
    side = _SIDE_TABLES[dialect] if kind == "outbox" else _INBOX_SIDE_TABLES
    # A side table's catalog may name the outbox table too (its enum type, say).
    return [
        (suffix, *(str(v).replace(table, "T") for v in row))
        for suffix in ("", *side)
        for row in _table_catalog(dialect, table + suffix, db, url)
    ]


def _table_catalog(
    dialect: str, table: str, db: Path, url: str | None = None
) -> list[tuple[object, ...]]:
    if dialect == "postgresql":
        return _pg_catalog(table, url or PG_URL)
    if dialect == "mysql":
        return _mysql_catalog(table, url or MYSQL_URL)
    return _sqlite_catalog(db, table)


@pytest.fixture(params=sql.DIALECTS)
def dialect(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=sql.KINDS)
def kind(request: pytest.FixtureRequest) -> sql.Kind:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Path]:
    return tmp_path / "m.db"


async def test_migrations_yield_the_published_schema(
    dialect: str, db: Path, kind: sql.Kind
) -> None:
    url = {"postgresql": PG_URL, "mysql": MYSQL_URL}.get(dialect, sqlite_url(db))
    migrated, published = unique_table("mig"), unique_table("pub")
    try:
        await migrate(url, table=migrated, kind=kind)
        _apply_schema(dialect, url, published, db, kind)
        expected = _catalog(dialect, published, db, kind)
        assert expected  # the catalog query found the table
        assert _catalog(dialect, migrated, db, kind) == expected
    finally:
        drop(url, migrated)
        drop(url, published)


def test_the_postgresql_catalog_sees_function_bodies_and_enums() -> None:
    """The comparison above covers the claim and read functions, bodies included, and the
    status enum, not only columns and indexes: a schema.sql whose claim differs by one
    word from the migrations' gives another catalog."""
    migrated, edited = unique_table("cat"), unique_table("cat")
    try:
        asyncio.run(migrate(PG_URL, table=migrated))
        catalog = "\n".join(" ".join(row) for row in _pg_catalog(migrated))  # type: ignore[arg-type]
        for expected in ("FUNCTION public.T_claim(", "FUNCTION public.T_read_past(",
                         "FUNCTION public.T_within(", "T_status pending,processing"):  # fmt: skip
            assert expected in catalog
        script = sql.schema("postgresql", edited).replace(
            "v_window integer := 4 * p_limit", "v_window integer := 5 * p_limit"
        )
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            for statement in sql.statements(script):
                conn.execute(statement)
        assert _pg_catalog(edited) != _pg_catalog(migrated)
    finally:
        drop(PG_URL, migrated)
        drop(PG_URL, edited)


@pytest.mark.parametrize("dialect", sql.DIALECTS)
def test_each_dialect_numbers_its_migrations_once_and_has_each_function_once(
    dialect: str,
) -> None:
    """Versions start at 1 and none repeats (a gap is allowed: migrations are applied
    by what is missing, in version order)."""
    for kind in sql.KINDS:
        versions = [v for v, _, _ in sql.migrations(dialect, "t", kind)]  # type: ignore[arg-type]
        assert versions[0] == 1
        assert versions == sorted(set(versions))
    script = sql.schema(dialect, "t")  # type: ignore[arg-type]
    functions = re.findall(r"CREATE (?:OR REPLACE )?FUNCTION (\w+)\(", script)
    assert len(functions) == len(set(functions))


@pytest.mark.parametrize(
    "variant",
    [
        PG_URL.replace("postgresql://", "postgresql+psycopg://"),
        MYSQL_URL.replace("mysql://", "mysql+asyncmy://"),
    ],
)
async def test_every_driver_migrates_to_the_same_schema(variant: str, tmp_path: Path) -> None:
    """`relaybox migrate` runs through the driver the URL names (a service that installed
    only psycopg or asyncmy can migrate) and gives the schema of the default driver."""
    url = PG_URL if variant.startswith("postgresql") else MYSQL_URL
    dialect = "postgresql" if variant.startswith("postgresql") else "mysql"
    default, named = unique_table("drv"), unique_table("drv")
    try:
        await migrate(url, table=default)
        report = await migrate(variant, table=named)
        assert report.applied == tuple(v for v, _, _ in sql.migrations(dialect, named))  # type: ignore[arg-type]
        assert (await migrate(variant, table=named)).applied == ()
        db = tmp_path / "unused.db"
        assert _catalog(dialect, named, db, "outbox") == _catalog(dialect, default, db, "outbox")
    finally:
        drop(url, default)
        drop(url, named)


async def test_migrate_twice_changes_nothing_the_second_time(
    dialect: str, db: Path, kind: sql.Kind
) -> None:
    url = {"postgresql": PG_URL, "mysql": MYSQL_URL}.get(dialect, sqlite_url(db))
    table = unique_table("mig")
    try:
        first = await migrate(url, table=table, kind=kind)
        before = _catalog(dialect, table, db, kind)
        second = await migrate(url, table=table, kind=kind)
        steps = sql.migrations(dialect, table, kind)  # type: ignore[arg-type]
        assert first.applied == tuple(v for v, _, _ in steps)
        assert second.applied == ()
        assert second.version == first.version
        assert _catalog(dialect, table, db, kind) == before
    finally:
        drop(url, table)


async def test_concurrent_migrations_of_one_sqlite_file_all_succeed(tmp_path: Path) -> None:
    import asyncio

    url = sqlite_url(tmp_path / "race.db")
    reports = await asyncio.gather(*(migrate(url, table="raced") for _ in range(6)))
    applied = [r.applied for r in reports]
    assert applied.count(()) == 5  # exactly one run applied the migrations
    assert sum(len(a) for a in applied) == len(sql.migrations("sqlite", "raced"))


async def test_an_unreachable_database_is_a_migration_error() -> None:
    from relaybox import MigrationError

    with pytest.raises(MigrationError, match="cannot migrate"):
        await migrate("postgresql://postgres@127.0.0.1:1/test", table="nowhere")
