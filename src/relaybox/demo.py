"""`relaybox demo`: an order service writing orders and their events in one transaction.

Runs on the embedded default, SQLite, with nothing to install or start: it creates a
database, writes orders through `Outbox.add` (rolling some transactions back on purpose),
then runs the relay (`Relay`) into an in-memory publisher until it has published every
committed event, and checks that every committed event, and no rolled-back one, came out
once, in per-key order. (A real broker, embedded NATS, comes with the brokers.)
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import tempfile
from collections import defaultdict
from pathlib import Path

import click

from relaybox.core.message import Message
from relaybox.migrations import migrate
from relaybox.publishers.memory import MemoryPublisher
from relaybox.relay import Relay, RelaySettings
from relaybox.writer.outbox import Outbox

TABLE = "relaybox_outbox"
_STEP = {"OrderPlaced": 0, "OrderPriced": 1}


def _write_orders(db: Path, orders: int, outbox: Outbox) -> tuple[set[str], set[str]]:
    committed: set[str] = set()
    rolled_back: set[str] = set()
    rng = random.Random(7)
    conn = sqlite3.connect(db)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT, total REAL)"
    )
    try:
        for n in range(orders):
            order_id, customer = f"order-{n:05d}", f"customer-{rng.randrange(20):02d}"
            conn.execute("INSERT INTO orders VALUES (?, ?, ?)", (order_id, customer, n * 1.5))
            events = [
                Message(topic="orders", key=customer, type=kind, payload={"order": order_id})
                for kind in ("OrderPlaced", "OrderPriced")
            ]
            outbox.add(conn, events)
            if rng.random() < 0.1:  # the business logic changes its mind: nothing may leak
                conn.rollback()
                rolled_back.add(order_id)
            else:
                conn.commit()
                committed.add(order_id)
    finally:
        conn.close()
    return committed, rolled_back


async def _drain(url: str, expected: int) -> list[dict[str, str]]:
    """Run the relay until it has published `expected` events, then stop it."""
    publisher = MemoryPublisher()
    settings = RelaySettings(idle_interval=0.05, min_poll_interval=0.005)
    async with Relay(url, {"default": publisher}, table=TABLE, settings=settings):
        deadline = asyncio.get_running_loop().time() + 60
        while len(publisher.published) < expected:
            if asyncio.get_running_loop().time() > deadline:
                break  # the summary will show what was lost
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # anything beyond `expected` would be a ghost: let it show
    return [
        {"key": m.key or "", "type": m.type, "payload": m.payload.decode()}
        for m in publisher.published
    ]


def run_demo(orders: int = 500, directory: Path | None = None) -> dict[str, object]:
    """Run the demo; returns the summary it prints."""
    with tempfile.TemporaryDirectory(prefix="relaybox-demo-") as scratch:
        db = (directory or Path(scratch)) / "orders.db"
        url = f"sqlite:///{db}"
        asyncio.run(migrate(url, table=TABLE))
        outbox = Outbox(table=TABLE)
        click.echo(f"writing {orders} orders with 2 events each into {db} ...")
        committed, rolled_back = _write_orders(db, orders, outbox)
        delivered = asyncio.run(_drain(url, 2 * len(committed)))
    seen_orders = {json.loads(d["payload"])["order"] for d in delivered}
    # Per key (customer), events must come out exactly in the order they were written.
    per_key: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for item in delivered:
        per_key[item["key"]].append((json.loads(item["payload"])["order"], _STEP[item["type"]]))
    in_order = all(events == sorted(events) for events in per_key.values())
    summary: dict[str, object] = {
        "orders_committed": len(committed),
        "orders_rolled_back": len(rolled_back),
        "events_written": 2 * len(committed),
        "events_delivered": len(delivered),
        "lost": len(committed - seen_orders),
        "ghosts": len(seen_orders & rolled_back),
        "per_key_order_kept": in_order,
    }
    return summary


@click.command("demo")
@click.option("--orders", default=500, show_default=True, help="How many orders to write.")
def demo(orders: int) -> None:
    """Write orders and events in one transaction on SQLite, drain them, check the result."""
    summary = run_demo(orders)
    for name, value in summary.items():
        click.echo(f"  {name:<20} {value}")
    ok = summary["lost"] == 0 and summary["ghosts"] == 0 and summary["per_key_order_kept"]
    click.echo(
        "demo OK: every committed event delivered, no rolled-back event leaked"
        if ok
        else "demo FAILED"
    )
    if not ok:
        raise SystemExit(1)
