"""examples/django's own tests (shop/tests.py) under Django's test runner: `manage.py
test shop`, a process of this interpreter, on SQLite, PostgreSQL and MariaDB. The runner
builds its test database with `migrate`, relaybox's tables included, and the tests pass
on each. The PostgreSQL and MariaDB databases are made for the test and dropped after,
with the `test_` database the runner makes beside them. About a second a database."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pymysql
import pytest

from tests.databases import PG_URL, unique_table

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "django"
#: The tests in shop/tests.py.
SHOP_TESTS = 3


def _postgres(statement: str) -> None:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(statement)


def _mariadb(statement: str) -> None:
    conn = pymysql.connect(host="127.0.0.1", port=3306, user="root", password="")
    with conn, conn.cursor() as cursor:
        cursor.execute(statement)


_SERVERS: dict[str, tuple[str, Callable[[str], None], str]] = {
    "postgresql": ("SHOP_POSTGRES", _postgres, " WITH (FORCE)"),
    "mariadb": ("SHOP_MYSQL", _mariadb, ""),
}
_VARIABLES = {variable for variable, _, _ in _SERVERS.values()}


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def shop(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[dict[str, str], str]]:
    """The environment of a shop on one database, and the test database Django's runner
    makes of it: a SQLite file (the runner tests in memory), or a PostgreSQL or MariaDB
    database of the test's own, dropped afterwards with the runner's `test_` database
    if one is left."""
    env = {name: value for name, value in os.environ.items() if name not in _VARIABLES}
    env["SHOP_DB"] = str(tmp_path / "shop.db")
    if request.param == "sqlite":
        yield env, "file:memorydb_default?mode=memory&cache=shared"
        return
    variable, execute, force = _SERVERS[request.param]
    name = unique_table("shopdj")
    execute(f"CREATE DATABASE {name}")
    try:
        yield {**env, variable: name}, f"test_{name}"
    finally:
        for database in (name, f"test_{name}"):
            execute(f"DROP DATABASE IF EXISTS {database}{force}")


def test_the_shops_tests_pass_under_djangos_test_runner(
    shop: tuple[dict[str, str], str],
) -> None:
    env, test_database = shop
    process = subprocess.run(
        [sys.executable, "manage.py", "test", "shop", "--noinput", "--verbosity", "2"],
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    output = process.stdout + process.stderr
    assert process.returncode == 0, output
    assert f"Creating test database for alias 'default' ('{test_database}')" in output
    assert "Applying relaybox.0001_initial... OK" in output  # relaybox's tables, by migrate
    assert f"Ran {SHOP_TESTS} tests" in output
    assert "\nOK\n" in output
