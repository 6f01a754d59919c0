"""Where a writer transaction's server time goes: the outbox row against a plain row.

`benchmarks/writer_overhead.py` measures the writer as a client sees it, round trips
and commit flushes included. This one asks the server alone: a procedure runs the
business transaction (INSERT an order row, then the row of a variant, then COMMIT) in
a loop, with `synchronous_commit = off` so that no disk flush is in the figure, and the
time per transaction is the server's work for it. Variants, alternated round by round:

- `plain`: the same-sized row of `writer_overhead.py` into a table with only a
  primary key;
- `outbox`: the outbox row as `Outbox.add` writes it: the key lock taken in the same
  statement, every index of the outbox table;
- `outbox_no_key_lock`: the same row without the key lock;
- `keyed_index_only`, `keyed_and_keyless_indexes`, `no_secondary_index`: the row
  without the key lock into copies of the outbox table (same columns, defaults and
  fillfactor) that have only some of its indexes, copied from the migrated table.

The differences between neighbours are what each part costs a transaction. Prints
JSON; the tables and procedures it made are dropped when it ends.

    .venv/bin/python benchmarks/writer_server_cost.py [--transactions 3000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_URL, machine
from writer_overhead import ORDERS, OUTBOX, PAYLOAD, PLAIN, setup, teardown

COPIES = {  # copy of the outbox table -> the outbox's indexes it keeps (name suffixes)
    "bench_wsc_keyed": ("_keyed_ix",),
    "bench_wsc_keyed_keyless": ("_keyed_ix", "_unkeyed_ix"),
    "bench_wsc_bare": (),
}
OUTBOX_COLUMNS = "id, target, topic, key, partition, type, content_type, payload, occurred_at"


def variants(padding: bytes) -> dict[str, str]:
    """Each variant's INSERT, in a loop over `i` (every row its own key)."""
    payload = "'\\x" + json.dumps(PAYLOAD).encode().hex() + "'::bytea"
    values = (f"gen_random_uuid(), 'default', 'orders', 'order-' || i, i % 256, "
              f"'OrderPlaced', 'application/json', {payload}, now()")  # fmt: skip

    def row(table: str) -> str:
        return f"INSERT INTO {table} ({OUTBOX_COLUMNS}) VALUES ({values})"

    return {
        "plain": f"INSERT INTO {PLAIN} (id, topic, key, type, payload, headers, occurred_at,"
        f" padding) VALUES (gen_random_uuid(), 'orders', 'order-' || i, 'OrderPlaced',"
        f" {payload}, '{{}}'::jsonb, now(), '\\x{padding.hex()}'::bytea)",
        "outbox": f"INSERT INTO {OUTBOX} ({OUTBOX_COLUMNS}) SELECT {values}"
        " FROM (SELECT pg_advisory_xact_lock(i::bigint)) AS key_lock",
        "outbox_no_key_lock": row(OUTBOX),
        "keyed_index_only": row("bench_wsc_keyed"),
        "keyed_and_keyless_indexes": row("bench_wsc_keyed_keyless"),
        "no_secondary_index": row("bench_wsc_bare"),
    }


def make_copies(conn: psycopg.Connection) -> None:
    indexes = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", (OUTBOX,)
    ).fetchall()
    for copy, kept in COPIES.items():
        conn.execute(
            f"CREATE TABLE {copy} (LIKE {OUTBOX} INCLUDING DEFAULTS INCLUDING IDENTITY,"
            " PRIMARY KEY (seq)) WITH (fillfactor = 50)"
        )
        for name, definition in indexes:
            if name.endswith(kept) and kept:
                conn.execute(
                    definition.replace(
                        f"INDEX {name}", f"INDEX {copy}{name[len(OUTBOX) :]}"
                    ).replace(f"public.{OUTBOX} ", f"public.{copy} ")
                )


def drop(conn: psycopg.Connection, names: list[str]) -> None:
    for name in names:
        conn.execute(f"DROP PROCEDURE IF EXISTS bench_wsc_{name}")
    conn.execute(f"DROP TABLE IF EXISTS {', '.join(COPIES)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transactions", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    padding = setup()
    statements = variants(padding)
    spent: dict[str, list[float]] = {name: [] for name in statements}
    try:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            make_copies(conn)
            conn.execute("SET synchronous_commit = off")
            order = f"INSERT INTO {ORDERS} (customer, total) VALUES ('c-000042', 129.9)"
            for name, statement in statements.items():
                conn.execute(
                    f"CREATE PROCEDURE bench_wsc_{name}(a bigint, b bigint) LANGUAGE plpgsql"
                    f" AS $$ BEGIN FOR i IN a..b LOOP {order}; {statement}; COMMIT;"
                    " END LOOP; END $$"
                )
            n = args.transactions
            for round_ in range(args.rounds + 1):  # the first round warms up
                for index, name in enumerate(statements):
                    first = (round_ * len(statements) + index) * n
                    began = time.perf_counter()
                    conn.execute(f"CALL bench_wsc_{name}({first}, {first + n - 1})")
                    if round_:
                        spent[name].append((time.perf_counter() - began) / n * 1e6)
            drop(conn, list(statements))
    finally:
        teardown()
    print(json.dumps(report(args, spent), indent=2))


def report(args: argparse.Namespace, spent: dict[str, list[float]]) -> dict[str, Any]:
    medians = {name: statistics.median(times) for name, times in spent.items()}
    return {
        "benchmark": "writer_server_cost",
        "transactions_per_round": args.transactions,
        "rounds": args.rounds,
        "us_per_transaction": {
            name: {"median": round(medians[name], 2), "runs": [round(t, 2) for t in times]}
            for name, times in spent.items()
        },
        "over_plain_us": {
            name: round(medians[name] - medians["plain"], 2) for name in spent if name != "plain"
        },
        "machine": machine(),
    }


if __name__ == "__main__":
    main()
