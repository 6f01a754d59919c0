"""Writer overhead: a business transaction with one outbox message vs a plain INSERT.

4 client processes on PostgreSQL run the same transaction: INSERT one order row, then
either `Outbox.add(conn, Message(...))` or a plain INSERT of a row of the same size into
a table with only a primary key, then COMMIT.

The commit's fsync dominates, and its latency drifts a lot on this VM's disk (steal
time, neighbours), so separate runs per variant are not comparable. Each client
therefore alternates the variants transaction by transaction, and each variant's
throughput is clients / mean transaction time: all see the same disk at the same
moments. Prints JSON. The tables (and the outbox's functions and type) it made are
dropped when it ends.

Variants (`--variants`, comma-separated, rotated in that order):

- `plain`: the plain INSERT.
- `outbox`: `Outbox(notify=False)`.
- `outbox-notify`: `Outbox(notify=True)`, a NOTIFY at most every 0.05 s per client
  (`--notify-interval S`: every S seconds instead).
- `outbox-notify-every`: `Outbox(notify=0)`, a NOTIFY in every transaction.
- `outbox-two-indexes`: `Outbox(notify=False)` into a second outbox table from which
  the two indexes that a writer's row never enters (`unkeyed_ix`, `waits_ix`) were
  dropped: what those indexes cost the writer. Not a table a relay can serve.
- `outbox-fillfactor-100`: `Outbox(notify=False)` into a third outbox table whose
  pages are filled (fillfactor 100, not 50): what the room kept for a row-lease
  claim's in-place update costs the writer.

`--notify` is short for `--variants outbox,outbox-notify,outbox-notify-every`. While
any variant notifies, a relaybox listener (`relaybox.storage.pg_listen`) runs in its
own process, as a relay would, and counts what it receives.

Alternating per transaction in a fixed order, a variant also meets the one before it:
with three or more variants, the one that follows an outbox variant ran 0.2-1.1 points
faster than the one that follows the plain row, whichever it was. To compare three or
more, use `--slice 0.05`.

Alternating per transaction, a NOTIFY-every-time variant commits next to other
variants' transactions, so only part of the clients contend for NOTIFY's commit lock
at any moment. `--slice S` instead switches all clients to the next variant together
every S seconds of wall-clock time: each variant then runs at full contention, and
drift still hits all variants alike.

    .venv/bin/python benchmarks/writer_overhead.py [--seconds 30] [--clients 4]
        [--variants plain,outbox | --notify] [--slice 0.5] [--notify-interval 1]
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
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_URL, machine, padding_to_match

from relaybox import Message, Outbox, sql
from relaybox.migrations import migrate

OUTBOX, ORDERS, PLAIN = "bench_writer_outbox", "bench_writer_orders", "bench_writer_plain"
#: The outbox tables of the `outbox-two-indexes` and `outbox-fillfactor-100` variants.
FEWER, FILLED = "bench_writer_fewer", "bench_writer_filled"
PAYLOAD = {"order_id": 0, "customer": "c-000042", "total": "129.90", "currency": "EUR",
           "lines": [{"sku": "SKU-1", "qty": 2}, {"sku": "SKU-7", "qty": 1}]}  # fmt: skip


def setup() -> bytes:
    for table in (OUTBOX, FEWER, FILLED):
        asyncio.run(migrate(PG_URL, table=table))
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"DROP INDEX {FEWER}_unkeyed_ix, {FEWER}_waits_ix")
        conn.execute(f"ALTER TABLE {FILLED} SET (fillfactor = 100)")
        conn.execute(f"TRUNCATE {FEWER}, {FILLED}")
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
            Outbox(table=OUTBOX).add(conn, sample_message("order-0-0"))
            plain_insert(conn, "order-0-0", b"")
            padding = padding_to_match(conn, OUTBOX, PLAIN)
    return padding


def teardown() -> None:
    """Leave the database as the run found it: the outbox's tables, functions and type
    go, and the two tables beside it."""
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {ORDERS}, {PLAIN}")
        for table in (OUTBOX, FEWER, FILLED):
            for statement in sql.drops("postgresql", table):
                conn.execute(statement)


def sample_message(key: str) -> Message:
    return Message(topic="orders", key=key, type="OrderPlaced", payload=PAYLOAD)


def plain_insert(conn: psycopg.Connection, key: str, padding: bytes) -> None:
    conn.execute(
        f"INSERT INTO {PLAIN} (id, topic, key, type, payload, headers, occurred_at, padding)"
        " VALUES (%s, %s, %s, %s, %s, %s::jsonb, now(), %s)",
        (uuid.uuid4(), "orders", key, "OrderPlaced", json.dumps(PAYLOAD).encode(),
         "{}", padding),
    )  # fmt: skip


NOTIFY_SETTINGS: dict[str, bool | float] = {
    "outbox": False,
    "outbox-notify": True,
    "outbox-notify-every": 0,
    "outbox-two-indexes": False,
    "outbox-fillfactor-100": False,
}
#: The outbox table each variant writes to.
TABLES = {"outbox-two-indexes": FEWER, "outbox-fillfactor-100": FILLED}
VARIANTS = ("plain", *NOTIFY_SETTINGS)


def transaction(conn: psycopg.Connection, outbox: Outbox | None, key: str, padding: bytes) -> bool:
    """One business transaction; True if it carried a NOTIFY."""
    conn.execute(f"INSERT INTO {ORDERS} (customer, total) VALUES (%s, %s)", ("c-000042", 129.9))
    notified = False
    if outbox is None:
        plain_insert(conn, key, padding)
    else:
        before = outbox._next_notify
        outbox.add(conn, sample_message(key))
        notified = outbox._next_notify != before
    conn.commit()
    return notified


def client(
    index: int,
    seconds: float,
    variants: list[str],
    slice_seconds: float | None,
    padding: bytes,
    queue: multiprocessing.Queue,  # type: ignore[type-arg]
) -> None:
    outboxes = {
        v: None if v == "plain" else Outbox(table=TABLES.get(v, OUTBOX), notify=NOTIFY_SETTINGS[v])
        for v in variants
    }
    spent = dict.fromkeys(variants, 0.0)
    count = dict.fromkeys(variants, 0)
    notified = dict.fromkeys(variants, 0)
    with psycopg.connect(PG_URL) as conn:
        for n in range(20):  # warm up: prepared statements, caches
            transaction(conn, outboxes[variants[n % len(variants)]], f"warm-{index}-{n}", padding)
        deadline = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < deadline:
            if slice_seconds:  # the same variant in every client at the same moment
                variant = variants[int(time.time() / slice_seconds) % len(variants)]
            else:
                variant = variants[n % len(variants)]
            start = time.perf_counter()
            key = f"order-{index}-{n}"  # every order its own key, as in a shop
            notified[variant] += transaction(conn, outboxes[variant], key, padding)
            spent[variant] += time.perf_counter() - start
            count[variant] += 1
            n += 1
    queue.put((spent, count, notified))


def listener(ready: Any, stop: Any, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """A relay's LISTEN, counting wake-ups until `stop` is set."""
    from relaybox.storage.pg_listen import listen

    async def run() -> int:
        wakes = [0]

        def woken() -> None:
            wakes[0] += 1

        found = await listen(PG_URL, OUTBOX, woken)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await found.close()
        return wakes[0]

    queue.put(asyncio.run(run()))


def parse_variants(args: argparse.Namespace) -> list[str]:
    if args.notify:
        return ["outbox", "outbox-notify", "outbox-notify-every"]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown or not variants or len(set(variants)) != len(variants):
        raise SystemExit(f"--variants: pick distinct ones of {', '.join(VARIANTS)}")
    return variants


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--variants", default="plain,outbox")
    parser.add_argument("--notify", action="store_true")
    parser.add_argument("--slice", type=float, default=None)
    parser.add_argument("--notify-interval", type=float, default=None)
    args = parser.parse_args()
    if args.notify_interval is not None:  # the clients fork from here and inherit it
        NOTIFY_SETTINGS["outbox-notify"] = args.notify_interval
    variants = parse_variants(args)
    padding = setup()
    try:
        measured = run(args, variants, padding)
    finally:
        teardown()
    print(json.dumps(measured, indent=2))


def run(args: argparse.Namespace, variants: list[str], padding: bytes) -> dict[str, Any]:
    """The clients (and the listener, if a variant notifies), then their report."""
    queue: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    wakes_queue: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    ready, stop = multiprocessing.Event(), multiprocessing.Event()
    listening = any(NOTIFY_SETTINGS.get(v) is not False for v in variants if v != "plain")
    if listening:
        watcher = multiprocessing.Process(target=listener, args=(ready, stop, wakes_queue))
        watcher.start()
        ready.wait(30)
    work = (args.seconds, variants, args.slice, padding, queue)
    procs = [multiprocessing.Process(target=client, args=(i, *work)) for i in range(args.clients)]
    for p in procs:
        p.start()
    parts = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    wakes = None
    if listening:
        stop.set()
        wakes = wakes_queue.get()
        watcher.join()
    return report(args, variants, padding, parts, wakes)


def report(
    args: argparse.Namespace, variants: list[str], padding: bytes, parts: list[Any],
    wakes: int | None,
) -> dict[str, Any]:  # fmt: skip
    tps = {}
    for variant in variants:
        spent = sum(part[0][variant] for part in parts)
        count = sum(part[1][variant] for part in parts)
        tps[variant] = args.clients * count / spent
    result: dict[str, Any] = {
        "benchmark": "writer_overhead", "clients": args.clients, "seconds": args.seconds,
        "alternation": f"{args.slice} s slices" if args.slice else "per transaction",
        "transactions": {v: sum(part[1][v] for part in parts) for v in variants},
        "notified": {v: sum(part[2][v] for part in parts) for v in variants if v != "plain"},
        "listener_wakes": wakes,
        "plain_row_padding_bytes": len(padding),
    }  # fmt: skip
    for variant in variants:
        result[f"tps_{variant.replace('-', '_')}"] = round(tps[variant], 1)
    first = variants[0]
    for variant in variants[1:]:
        result[f"{variant}_vs_{first}".replace("-", "_")] = round(tps[variant] / tps[first], 3)
    result["machine"] = machine()
    return result


if __name__ == "__main__":
    main()
