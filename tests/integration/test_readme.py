"""The README's first example runs as written, against the test database."""

from __future__ import annotations

import asyncio
import decimal
import re
from pathlib import Path

import psycopg

from relaybox.migrations import migrate
from tests.databases import PG_URL, drop, unique_table

README = Path(__file__).resolve().parents[2] / "README.md"


def _first_example() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## First example", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found, "README: no python block under 'First example'"
    return found.group(1)


def _replace(code: str, old: str, new: str) -> str:
    assert old in code, f"README's first example no longer has {old!r}"
    return code.replace(old, new)


def test_the_first_example_writes_its_order_and_message() -> None:
    table, orders = unique_table("readme"), unique_table("orders")
    asyncio.run(migrate(PG_URL, table=table))
    try:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {orders} (id bigint PRIMARY KEY, total numeric)")
        code = _replace(_first_example(), '"postgresql://localhost/shop"', repr(PG_URL))
        code = _replace(code, "INSERT INTO orders ", f"INSERT INTO {orders} ")
        code = _replace(code, "Outbox()", f"Outbox(table={table!r})")
        exec(code, {"order_id": 42, "total": decimal.Decimal("129.90")})
        with psycopg.connect(PG_URL) as conn:
            assert conn.execute(f"SELECT id, total FROM {orders}").fetchall() == [
                (42, decimal.Decimal("129.90"))
            ]
            rows = conn.execute(f"SELECT topic, key, type, payload FROM {table}").fetchall()
        assert rows == [("orders", "42", "OrderPlaced", b'{"order_id":42,"total":"129.90"}')]
    finally:
        drop(PG_URL, table)
        drop(PG_URL, orders)
