"""Writer overhead: a business transaction with one outbox message vs a plain INSERT.

4 client processes on PostgreSQL run the same transaction: INSERT one order row, then
either `Outbox.add(conn, Message(...))` or a plain INSERT of a row of the same size into
a table with only a primary key, then COMMIT.

The commit's fsync dominates, and its latency drifts a lot on this VM's disk (steal
time, neighbours), so separate runs per variant are not comparable. Each client
therefore alternates the two variants transaction by transaction, and each variant's
throughput is clients / mean transaction time: both see the same disk at the same
moments. Prints JSON.

    .venv/bin/python benchmarks/writer_overhead.py [--seconds 30] [--clients 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
import uuid
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_URL, machine

from relaybox import Message, Outbox
from relaybox.migrations import migrate

OUTBOX, ORDERS, PLAIN = "bench_writer_outbox", "bench_writer_orders", "bench_writer_plain"
PAYLOAD = {"order_id": 0, "customer": "c-000042", "total": "129.90", "currency": "EUR",
           "lines": [{"sku": "SKU-1", "qty": 2}, {"sku": "SKU-7", "qty": 1}]}  # fmt: skip


def setup() -> bytes:
    asyncio.run(migrate(PG_URL, table=OUTBOX))
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {OUTBOX}")
        conn.execute(f"DROP TABLE IF EXISTS {ORDERS}, {PLAIN}")
        conn.execute(f"CREATE TABLE {ORDERS} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                     " customer text NOT NULL, total numeric NOT NULL,"
                     " created_at timestamptz NOT NULL DEFAULT now())")  # fmt: skip
        # What a hand-rolled outbox row would hold, with only a primary key.
        conn.execute(f"CREATE TABLE {PLAIN} (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                     " id uuid NOT NULL, topic text NOT NULL, key text, type text NOT NULL,"
                     " payload bytea NOT NULL, headers jsonb NOT NULL,"
                     " occurred_at timestamptz NOT NULL, padding bytea NOT NULL)")  # fmt: skip
        # "Same-sized": pad the plain row to the outbox row's size, measured, not guessed.
        with conn.transaction(force_rollback=True):
            Outbox(table=OUTBOX).add(conn, sample_message(0))
            plain_insert(conn, 0, b"")
            (outbox_size,) = conn.execute(f"SELECT pg_column_size(t.*) FROM {OUTBOX} t").fetchone()
            (plain_size,) = conn.execute(f"SELECT pg_column_size(t.*) FROM {PLAIN} t").fetchone()
    return b"p" * max(0, outbox_size - plain_size)


def sample_message(n: int) -> Message:
    return Message(topic="orders", key=f"order-{n}", type="OrderPlaced", payload=PAYLOAD)


def plain_insert(conn: psycopg.Connection, n: int, padding: bytes) -> None:
    conn.execute(
        f"INSERT INTO {PLAIN} (id, topic, key, type, payload, headers, occurred_at, padding)"
        " VALUES (%s, %s, %s, %s, %s, %s::jsonb, now(), %s)",
        (uuid.uuid4(), "orders", f"order-{n}", "OrderPlaced", json.dumps(PAYLOAD).encode(),
         "{}", padding),
    )  # fmt: skip


def transaction(
    conn: psycopg.Connection, outbox: Outbox, variant: str, n: int, padding: bytes
) -> None:
    conn.execute(f"INSERT INTO {ORDERS} (customer, total) VALUES (%s, %s)", ("c-000042", 129.9))
    if variant == "outbox":
        outbox.add(conn, sample_message(n))
    else:
        plain_insert(conn, n, padding)
    conn.commit()


def client(seconds: float, padding: bytes, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    outbox = Outbox(table=OUTBOX)
    spent = {"plain": 0.0, "outbox": 0.0}
    count = {"plain": 0, "outbox": 0}
    with psycopg.connect(PG_URL) as conn:
        for n in range(20):  # warm up: prepared statements, caches
            transaction(conn, outbox, ("plain", "outbox")[n % 2], n, padding)
        deadline = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < deadline:
            variant = ("plain", "outbox")[n % 2]
            start = time.perf_counter()
            transaction(conn, outbox, variant, n, padding)
            spent[variant] += time.perf_counter() - start
            count[variant] += 1
            n += 1
    queue.put((spent, count))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    padding = setup()
    queue: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    procs = [multiprocessing.Process(target=client, args=(args.seconds, padding, queue))
             for _ in range(args.clients)]  # fmt: skip
    for p in procs:
        p.start()
    parts = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    tps = {}
    for variant in ("plain", "outbox"):
        spent = sum(part[0][variant] for part in parts)
        count = sum(part[1][variant] for part in parts)
        tps[variant] = args.clients * count / spent
    print(json.dumps({
        "benchmark": "writer_overhead", "clients": args.clients, "seconds": args.seconds,
        "transactions": {v: sum(part[1][v] for part in parts) for v in tps},
        "plain_row_padding_bytes": len(padding),
        "tps_plain": round(tps["plain"], 1), "tps_outbox": round(tps["outbox"], 1),
        "outbox_vs_plain": round(tps["outbox"] / tps["plain"], 3), "machine": machine(),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
