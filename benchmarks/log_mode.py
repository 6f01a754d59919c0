"""Log mode: what the writer pays, and how soon a committed message reaches the broker.

Runs against a PostgreSQL of its own (initdb into a temporary directory, wal_level =
logical, stopped at the end), or `--url` of one that runs wal_level = logical.

1. Writer throughput. `--clients` processes run the same business transaction
   (INSERT one order row, then the variant, then COMMIT), alternating the variants
   transaction by transaction, as benchmarks/writer_overhead.py does (the commit's
   fsync drifts; alternating lets every variant see the same disk), each round of them
   in an order shuffled anew (in a fixed order, two identical variants came out 0.03
   apart: a transaction pays for what the one before it left behind):

   - `plain`: a plain INSERT of a row of the same size into a table with only a
     primary key (the hand-rolled outbox);
   - `outbox`: relaybox's table mode, `Outbox.add`;
   - `log`: relaybox's log mode, `LogOutbox.add` (pg_logical_emit_message), which
     looks for the slot at most once a second per connection;
   - `log-checked`: the same with `slot_check_interval=0`, looking at every add;
   - `walbox`: the row walbox's outbox takes (its README's table, in a publication).

   The table mode's and walbox's slots exist meanwhile, but nothing streams them:
   this is the writer's own cost.

2. Commit-to-publish latency at `--rate` messages a second, one per transaction,
   spread over `--writers` processes: relaybox's log relay (`LogRelay`, in a process
   of its own, on the event loop and collector settings of `relaybox relay`, with a
   broker that confirms at once and notes the time) and walbox
   (https://pypi.org/project/walbox/, under Python 3.13 from `--walbox-python`, a
   handler that notes the time and saves walbox's checkpoint as its README does) run
   side by side the whole time, and the writers switch between them every `--slice`
   seconds, so both see the same machine. Latency is from the moment the writer
   sends COMMIT (its fsync included) to the moment the message is handed to the
   broker (relaybox) or the handler (walbox); "after commit returned" subtracts the
   commit's own time, and may be negative: the relay may have the message before the
   writer hears its commit.

3. Drain: `--drain` messages committed while no relay runs (10 a transaction, 1,000
   keys), then a log relay with a broker that confirms at once catches up, its start
   included.

    .venv/bin/python benchmarks/log_mode.py [--seconds 20] [--clients 4]
        [--rate 500] [--writers 4] [--latency-seconds 30] [--drain 50000]
        [--walbox-python PATH]

Prints JSON. walbox needs Python 3.13: make its environment with
`/root/.pyenv/versions/3.13.0/bin/python -m venv /tmp/walbox-venv &&
/tmp/walbox-venv/bin/pip install walbox` (never a relaybox dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, padding_to_match

ROOT = Path(__file__).resolve().parent.parent
OUTBOX, LOG_TABLE, ORDERS, PLAIN = (
    "bench_lm_outbox",
    "bench_lm_log",
    "bench_lm_orders",
    "bench_lm_plain",
)
WALBOX_TABLE, WALBOX_PUB, WALBOX_SLOT = (
    "bench_lm_walbox",
    "bench_lm_walbox_pub",
    "bench_lm_walbox_slot",
)
PAYLOAD = {"order_id": 0, "customer": "c-000042", "total": "129.90", "currency": "EUR",
           "lines": [{"sku": "SKU-1", "qty": 2}, {"sku": "SKU-7", "qty": 1}]}  # fmt: skip
VARIANTS = ("plain", "outbox", "log", "log-checked", "walbox")
WALBOX_PYTHON = "/tmp/walbox-venv/bin/python"


# -- setup -------------------------------------------------------------------------------


def start_server() -> Any:
    sys.path.insert(0, str(ROOT))
    from tests.chaos.cluster import ThrowawayPostgres

    server = ThrowawayPostgres(
        {"wal_level": "logical", "max_replication_slots": "10", "max_wal_senders": "10"}
    )
    server.start()
    return server


def setup(url: str) -> bytes:
    import psycopg

    from relaybox import Message, Outbox
    from relaybox.migrations import migrate

    for table in (OUTBOX, LOG_TABLE):
        asyncio.run(migrate(url, table=table))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {OUTBOX}, {LOG_TABLE}")
        conn.execute(f"DROP TABLE IF EXISTS {ORDERS}, {PLAIN}, {WALBOX_TABLE}")
        conn.execute(f"DROP PUBLICATION IF EXISTS {WALBOX_PUB}")
        conn.execute(f"CREATE TABLE {ORDERS} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                     " customer text NOT NULL, total numeric NOT NULL,"
                     " created_at timestamptz NOT NULL DEFAULT now())")  # fmt: skip
        conn.execute(f"CREATE TABLE {PLAIN} (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                     " id uuid NOT NULL, topic text NOT NULL, key text, type text NOT NULL,"
                     " payload bytea NOT NULL, headers jsonb NOT NULL,"
                     " occurred_at timestamptz NOT NULL, padding bytea NOT NULL)")  # fmt: skip
        # walbox's README table, plus the message id the latency is matched by.
        conn.execute(f"CREATE TABLE {WALBOX_TABLE} (id BIGSERIAL PRIMARY KEY, entity_type TEXT,"
                     " entity_id TEXT, event_type TEXT, payload JSONB,"
                     " created_at TIMESTAMPTZ DEFAULT now(), msg_id uuid)")  # fmt: skip
        conn.execute(f"CREATE PUBLICATION {WALBOX_PUB} FOR TABLE {WALBOX_TABLE}")
        with conn.transaction(force_rollback=True):  # pad the plain row to the outbox row
            Outbox(table=OUTBOX).add(conn, Message(topic="orders", key="k", payload=PAYLOAD))
            plain_insert(conn, "k", b"")
            padding = padding_to_match(conn, OUTBOX, PLAIN)
    return padding


def fresh_slots(url: str) -> None:
    """Both slots anew, so that neither consumer starts behind a backlog (the
    throughput part's messages)."""
    import psycopg

    from relaybox.storage.pg_log import create_slot, drop_slot

    asyncio.run(drop_slot(url, LOG_TABLE))
    asyncio.run(create_slot(url, LOG_TABLE))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS walbox_checkpoint")
        conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                     "WHERE slot_name = %s", (WALBOX_SLOT,))  # fmt: skip
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (WALBOX_SLOT,))


def plain_insert(conn: Any, key: str, padding: bytes) -> None:
    conn.execute(
        f"INSERT INTO {PLAIN} (id, topic, key, type, payload, headers, occurred_at, padding)"
        " VALUES (%s, %s, %s, %s, %s, %s::jsonb, now(), %s)",
        (uuid.uuid4(), "orders", key, "OrderPlaced", json.dumps(PAYLOAD).encode(),
         "{}", padding),
    )  # fmt: skip


def walbox_insert(conn: Any, key: str, msg_id: uuid.UUID) -> None:
    conn.execute(
        f"INSERT INTO {WALBOX_TABLE} (entity_type, entity_id, event_type, payload, msg_id)"
        " VALUES (%s, %s, %s, %s::jsonb, %s)",
        ("order", key, "OrderPlaced", json.dumps(PAYLOAD), msg_id),
    )


# -- 1. writer throughput ----------------------------------------------------------------


def throughput_client(url: str, index: int, seconds: float, padding: bytes, queue: Any) -> None:
    import psycopg

    from relaybox import LogOutbox, Message, Outbox

    outbox, log = Outbox(table=OUTBOX), LogOutbox(table=LOG_TABLE)
    checked = LogOutbox(table=LOG_TABLE, slot_check_interval=0)
    writers: dict[str, Any] = {"outbox": outbox, "log": log, "log-checked": checked}
    spent = dict.fromkeys(VARIANTS, 0.0)
    count = dict.fromkeys(VARIANTS, 0)

    def transaction(conn: Any, variant: str, key: str) -> None:
        conn.execute(f"INSERT INTO {ORDERS} (customer, total) VALUES (%s, %s)",
                     ("c-000042", 129.9))  # fmt: skip
        if variant == "plain":
            plain_insert(conn, key, padding)
        elif variant == "walbox":
            walbox_insert(conn, key, uuid.uuid4())
        else:
            message = Message(topic="orders", key=key, type="OrderPlaced", payload=PAYLOAD)
            writers[variant].add(conn, message)
        conn.commit()

    with psycopg.connect(url) as conn:
        for n in range(40):
            transaction(conn, VARIANTS[n % len(VARIANTS)], f"warm-{index}-{n}")
        deadline = time.perf_counter() + seconds
        n = 0
        order: list[str] = []
        shuffle = random.Random(index)
        while time.perf_counter() < deadline:
            if not order:  # each round of the variants in an order of its own
                order = shuffle.sample(VARIANTS, len(VARIANTS))
            variant = order.pop()
            start = time.perf_counter()
            transaction(conn, variant, f"order-{index}-{n}")
            spent[variant] += time.perf_counter() - start
            count[variant] += 1
            n += 1
    queue.put((spent, count))


def throughput(url: str, clients: int, seconds: float, padding: bytes) -> dict[str, Any]:
    queue: Any = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=throughput_client,
                                     args=(url, i, seconds, padding, queue))
             for i in range(clients)]  # fmt: skip
    for p in procs:
        p.start()
    parts = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    tps = {}
    for variant in VARIANTS:
        spent = sum(part[0][variant] for part in parts)
        tps[variant] = clients * sum(part[1][variant] for part in parts) / spent
    result: dict[str, Any] = {f"tps_{v}": round(tps[v], 1) for v in VARIANTS}
    result["transactions"] = {v: sum(part[1][v] for part in parts) for v in VARIANTS}
    for variant in ("outbox", "log", "log-checked", "walbox"):
        result[f"{variant}_vs_plain"] = round(tps[variant] / tps["plain"], 3)
    result["log_vs_outbox"] = round(tps["log"] / tps["outbox"], 3)
    return result


# -- 2. commit-to-publish latency ------------------------------------------------------------


def latency_writer(
    url: str, index: int, writers: int, rate: float, seconds: float, slice_seconds: float,
    start_at: float, out: str,
) -> None:  # fmt: skip
    import psycopg

    from relaybox import LogOutbox, Message

    log = LogOutbox(table=LOG_TABLE)
    interval = writers / rate
    records = []
    with psycopg.connect(url) as conn:
        time.sleep(max(0.0, start_at - time.time()))
        due = time.perf_counter() + index * interval / writers
        end = time.perf_counter() + seconds
        n = 0
        while True:
            due += interval
            if due > end:
                break
            time.sleep(max(0.0, due - time.perf_counter()))
            kind = "relaybox" if int(time.time() / slice_seconds) % 2 == 0 else "walbox"
            key = f"order-{index}-{n}"
            msg_id = uuid.uuid4()
            conn.execute(f"INSERT INTO {ORDERS} (customer, total) VALUES (%s, %s)",
                         ("c-000042", 129.9))  # fmt: skip
            if kind == "relaybox":
                message = Message(topic="orders", key=key, type="OrderPlaced", payload=PAYLOAD)
                log.add(conn, message)
                msg_id = message.id
            else:
                walbox_insert(conn, key, msg_id)
            sent = time.time()
            conn.commit()
            records.append((kind, str(msg_id), sent, time.time()))
            n += 1
    Path(out).write_text(json.dumps(records))


def relaybox_consumer(url: str, out: str, ready: str) -> None:
    """A log relay whose broker confirms at once and notes when each message came."""
    from collections.abc import Sequence

    from relaybox.core.publishing import ACKED, PublisherFeatures, PublishResult
    from relaybox.core.records import StoredMessage
    from relaybox.relay import loops
    from relaybox.relay.log_stream import LogRelay
    from relaybox.relay.settings import RelaySettings

    seen: dict[str, float] = {}

    class Timing:
        features = PublisherFeatures(deduplicates=False, batching=True)

        async def start(self) -> None:
            return None

        async def close(self) -> None:
            return None

        async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
            now = time.time()
            for message in messages:
                seen.setdefault(str(message.id), now)
            return [ACKED] * len(messages)

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        relay = LogRelay([url], {"default": Timing()}, table=LOG_TABLE, settings=RelaySettings())
        await relay.start()
        while not relay.streamers[0].streaming:
            await asyncio.sleep(0.01)
        Path(ready).touch()
        await stop.wait()
        await relay.stop()

    loops.run_relay(run())  # as `relaybox relay --mode log` runs it
    Path(out).write_text(json.dumps(seen))


def walbox_consumer(url: str, out: str, ready: str) -> None:
    """walbox with a handler that notes when each message came and saves walbox's
    checkpoint (on one kept connection), as walbox's README has it."""
    import contextlib

    import psycopg
    from walbox import (  # type: ignore[import-not-found]  # in a venv of its own
        ChangeKind,
        CheckpointHandle,
        Transaction,
        Walbox,
        WalboxOptions,
    )

    seen: dict[str, float] = {}

    class OneConnection:
        def __init__(self, connection: Any) -> None:
            self._connection = connection
            self._lock = asyncio.Lock()

        @contextlib.asynccontextmanager
        async def connection(self) -> Any:
            async with self._lock:
                yield self._connection

    async def handle(tx: Transaction, checkpoint: CheckpointHandle) -> None:
        now = time.time()
        for change in tx.changes:
            if change.kind == ChangeKind.INSERT and change.new:
                seen.setdefault(str(change.new["msg_id"]), now)
        await checkpoint.save(tx.commit_lsn)

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        connection = await psycopg.AsyncConnection.connect(url)
        options = WalboxOptions(consumer_name="bench", dsn=url, slot_name=WALBOX_SLOT,
                                publication_name=WALBOX_PUB)  # fmt: skip
        client = Walbox.build_with_pool(options, OneConnection(connection))
        task = asyncio.create_task(client.run(handle))
        await asyncio.sleep(1.0)
        Path(ready).touch()
        await stop.wait()
        client.close()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 5)
        await connection.close()

    asyncio.run(run())
    Path(out).write_text(json.dumps(seen))


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {"p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0), "n": len(ordered),
            "mean_ms": round(statistics.fmean(ordered) * 1000, 3)}  # fmt: skip


def latency(url: str, args: argparse.Namespace) -> dict[str, Any]:
    fresh_slots(url)
    work = Path(tempfile.mkdtemp(prefix="relaybox-logbench-"))
    consumers = {
        "relaybox": [sys.executable, __file__, "_consumer", "relaybox", url, str(work)],
        "walbox": [args.walbox_python, __file__, "_consumer", "walbox", url, str(work)],
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = {}
    for name, command in consumers.items():
        if name == "walbox" and not Path(args.walbox_python).exists():
            continue
        procs[name] = subprocess.Popen(command, env=env if name == "relaybox" else None)
    deadline = time.time() + 60
    while not all((work / f"{name}.ready").exists() for name in procs):
        if time.time() > deadline or any(p.poll() is not None for p in procs.values()):
            raise SystemExit("a consumer did not start")
        time.sleep(0.1)
    start_at = time.time() + 1.0
    writers = [multiprocessing.Process(target=latency_writer, args=(
        url, i, args.writers, args.rate, args.latency_seconds, args.slice, start_at,
        str(work / f"writer{i}.json"))) for i in range(args.writers)]  # fmt: skip
    for p in writers:
        p.start()
    for p in writers:
        p.join()
    time.sleep(2.0)  # the last messages' way through
    for consumer in procs.values():
        consumer.send_signal(signal.SIGTERM)
    for consumer in procs.values():
        consumer.wait(30)
    records = [r for i in range(args.writers)
               for r in json.loads((work / f"writer{i}.json").read_text())]  # fmt: skip
    seen_by = {name: json.loads((work / f"{name}.json").read_text()) for name in procs}
    shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {}
    for name, seen in seen_by.items():
        mine = [r for r in records if r[0] == name]
        from_commit = [seen[r[1]] - r[2] for r in mine if r[1] in seen]
        after_return = [seen[r[1]] - r[3] for r in mine if r[1] in seen]
        result[name] = {
            "written": len(mine),
            "missing": sum(r[1] not in seen for r in mine),
            "from_commit_sent": percentiles(from_commit),
            "after_commit_returned": percentiles(after_return),
            "commit": percentiles([r[3] - r[2] for r in mine]),
        }
    return result


# -- 3. draining a backlog -------------------------------------------------------------------


def drain(url: str, count: int) -> dict[str, Any]:
    """`count` messages committed while no relay runs (10 a transaction, 1,000 keys),
    then a log relay with a broker that confirms at once: how fast it catches up, its
    start included."""
    import psycopg

    from relaybox import LogOutbox, Message
    from relaybox.publishers.memory import NoopPublisher
    from relaybox.relay import loops
    from relaybox.relay.log_stream import LogRelay
    from relaybox.relay.settings import RelaySettings
    from relaybox.storage.pg_log import create_slot, drop_slot

    asyncio.run(drop_slot(url, LOG_TABLE))
    asyncio.run(create_slot(url, LOG_TABLE))
    log = LogOutbox(table=LOG_TABLE)
    with psycopg.connect(url) as conn:
        for first in range(0, count, 10):
            log.add(conn, [Message(topic="orders", key=f"order-{(first + n) % 1000}",
                                   payload=PAYLOAD) for n in range(10)])  # fmt: skip
            conn.commit()

    async def run() -> float:
        broker = NoopPublisher()
        relay = LogRelay([url], {"default": broker}, table=LOG_TABLE, settings=RelaySettings())
        started = time.perf_counter()
        await relay.start()
        while broker.count < count:
            await asyncio.sleep(0.002)
        elapsed = time.perf_counter() - started
        await relay.stop()
        return elapsed

    elapsed = loops.run_relay(run())
    return {"messages": count, "seconds": round(elapsed, 3), "msg_per_s": round(count / elapsed)}


def consumer_main(kind: str, url: str, work: str) -> None:
    out, ready = f"{work}/{kind}.json", f"{work}/{kind}.ready"
    if kind == "relaybox":
        relaybox_consumer(url, out, ready)
    else:
        walbox_consumer(url, out, ready)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_consumer":
        consumer_main(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default=None, help="a PostgreSQL with wal_level = logical")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rate", type=float, default=500)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--latency-seconds", type=float, default=30)
    parser.add_argument("--slice", type=float, default=2.0)
    parser.add_argument("--walbox-python", default=WALBOX_PYTHON)
    parser.add_argument("--drain", type=int, default=50_000, help="backlog size (0: skip)")
    parser.add_argument("--skip", default="", help="throughput,latency")
    args = parser.parse_args()
    server = None if args.url else start_server()
    url = args.url if server is None else server.url
    try:
        padding = setup(url)
        result: dict[str, Any] = {"benchmark": "log_mode", "clients": args.clients,
                                  "seconds": args.seconds, "rate": args.rate,
                                  "writers": args.writers}  # fmt: skip
        if "throughput" not in args.skip:
            fresh_slots(url)  # LogOutbox emits only where its table's slot is ready
            result["throughput"] = throughput(url, args.clients, args.seconds, padding)
        if "latency" not in args.skip:
            result["latency"] = latency(url, args)
        if args.drain:
            result["drain"] = drain(url, args.drain)
        result["machine"] = machine()
    finally:
        if server is not None:
            server.destroy()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
