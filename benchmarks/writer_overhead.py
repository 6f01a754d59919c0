"""Writer overhead: a business transaction with one outbox message vs a plain INSERT.

Each variant runs the same transaction from 4 client processes on PostgreSQL:
INSERT one order row, then either `Outbox.add(conn, Message(...))` or a plain INSERT of a
row of the same size into a table with only a primary key, then COMMIT. Variants
alternate in rounds so drift on the machine hits both alike. Prints JSON.

    .venv/bin/python benchmarks/writer_overhead.py [--seconds 10] [--rounds 3] [--clients 4]
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


def setup() -> None:
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
                     " occurred_at timestamptz NOT NULL)")  # fmt: skip


def client(variant: str, seconds: float, counter: multiprocessing.Value) -> None:  # type: ignore[type-arg]
    outbox = Outbox(table=OUTBOX)
    done = 0
    with psycopg.connect(PG_URL) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.execute(
                f"INSERT INTO {ORDERS} (customer, total) VALUES (%s, %s)", ("c-000042", 129.9)
            )
            if variant == "outbox":
                outbox.add(conn, Message(topic="orders", key=f"order-{done}", type="OrderPlaced",
                                         payload=PAYLOAD))  # fmt: skip
            else:
                conn.execute(
                    f"INSERT INTO {PLAIN} (id, topic, key, type, payload, headers, occurred_at)"
                    " VALUES (%s, %s, %s, %s, %s, %s::jsonb, now())",
                    (uuid.uuid4(), "orders", f"order-{done}", "OrderPlaced",
                     json.dumps(PAYLOAD).encode(), "{}"),
                )  # fmt: skip
            conn.commit()
            done += 1
    with counter.get_lock():
        counter.value += done


def run(variant: str, seconds: float, clients: int) -> float:
    counter = multiprocessing.Value("q", 0)
    procs = [
        multiprocessing.Process(target=client, args=(variant, seconds, counter))
        for _ in range(clients)
    ]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return counter.value / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    setup()
    results: dict[str, list[float]] = {"plain": [], "outbox": []}
    for _ in range(args.rounds):
        for variant in ("plain", "outbox"):
            results[variant].append(round(run(variant, args.seconds, args.clients), 1))
    plain, outbox = (sum(v) / len(v) for v in (results["plain"], results["outbox"]))
    print(json.dumps({
        "benchmark": "writer_overhead", "clients": args.clients, "seconds_per_run": args.seconds,
        "tps_plain_runs": results["plain"], "tps_outbox_runs": results["outbox"],
        "tps_plain": round(plain, 1), "tps_outbox": round(outbox, 1),
        "outbox_vs_plain": round(outbox / plain, 3), "machine": machine(),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
