"""Test databases: the shared services' URLs, unique table names, create and drop."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import uuid
from typing import Any

import psycopg
import pymysql

from relaybox import sql
from relaybox.migrations import migrate

PG_URL = os.environ.get("RELAYBOX_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("RELAYBOX_TEST_MYSQL", "mysql://root@127.0.0.1:3306/test")
#: Tables the migrations create beside the outbox table, by suffix.
SIDE_TABLES = (
    "_migrations", "_key_locks", "_members", "_partitions", "_watermarks", "_done", "_parked",
    "_attempts", "_audit", "_backfills", "_activity", "_relay_status",
)  # fmt: skip


def unique_table(stem: str = "rbx") -> str:
    return f"{stem}_{uuid.uuid4().hex[:12]}"


def sqlite_url(path: os.PathLike[str] | str) -> str:
    return f"sqlite:///{path}"


async def create(url: str, table: str) -> None:
    await migrate(url, table=table)


def drop(url: str, table: str) -> None:
    """Drop the outbox table and the tables beside it; sync, for fixture teardown."""
    tables = (table, *(table + suffix for suffix in SIDE_TABLES))
    if url.startswith("postgresql"):
        with psycopg.connect(
            url.replace("+asyncpg", "").replace("+psycopg", ""), autocommit=True
        ) as conn:
            for name in tables:
                conn.execute(f"DROP TABLE IF EXISTS {name}")
            for function in sql.functions("postgresql", table):
                conn.execute(f"DROP FUNCTION IF EXISTS {function}")
            conn.execute(f"DROP TYPE IF EXISTS {table}_status")
    elif url.startswith("mysql"):
        conn = pymysql.connect(
            host="127.0.0.1", port=3306, user="root", password="", database="test"
        )
        try:
            with conn.cursor() as cursor:
                cursor.execute("SET SESSION lock_wait_timeout = 10")  # never hang a teardown
                for name in tables:
                    cursor.execute(f"DROP TABLE IF EXISTS {name}")
        finally:
            conn.close()


def execute(url: str, statement: str) -> None:
    """Run one statement that returns no rows (DDL, an UPDATE), autocommitted."""
    if url.startswith("postgresql"):
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(statement)
    elif url.startswith("mysql"):
        conn = pymysql.connect(
            host="127.0.0.1", port=3306, user="root", database="test", autocommit=True
        )
        try:
            with conn.cursor() as cursor:
                cursor.execute(statement)
        finally:
            conn.close()
    else:
        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as lite, lite:
            lite.execute(statement)


def fetch_all(url: str, query: str) -> list[tuple[Any, ...]]:
    """Run one read query on the database at `url` (sync, its own connection)."""
    if url.startswith("postgresql"):
        with psycopg.connect(url.replace("+asyncpg", "").replace("+psycopg", "")) as conn:
            return list(conn.execute(query).fetchall())
    if url.startswith("mysql"):
        database = url.rsplit("/", 1)[1].split("?", maxsplit=1)[0]
        conn = pymysql.connect(host="127.0.0.1", port=3306, user="root", database=database)
        try:
            with conn.cursor() as cursor:
                cursor.execute(query)
                return list(cursor.fetchall())
        finally:
            conn.close()
    with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as lite:
        return list(lite.execute(query).fetchall())
