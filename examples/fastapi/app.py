"""An order service on FastAPI: each order and its event commit in one transaction, and
the relay inside the web process publishes the event as soon as the commit is done.

    relaybox migrate --db sqlite:///shop.db
    SHOP_DB=shop.db NATS_URL=nats://127.0.0.1:4222 uvicorn app:app
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"customer": "ada", "total": 42}'
"""

import os
import sqlite3
import uuid

import aiosqlite
from fastapi import FastAPI
from pydantic import BaseModel

from relaybox import Message, Outbox, Relay
from relaybox.integrations.asgi import relay_lifespan

DB = os.environ.get("SHOP_DB", "shop.db")
ORDERS = "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT, total INTEGER)"
sqlite3.connect(DB, isolation_level=None).execute(ORDERS).close()

outbox = Outbox()


def make_relay() -> Relay:
    """Built by the lifespan, in each worker process, after any fork."""
    return Relay(f"sqlite:///{DB}", {"default": os.environ.get("NATS_URL", "nats://127.0.0.1")})


app = FastAPI(lifespan=relay_lifespan(make_relay, outbox))


class Order(BaseModel):
    customer: str
    total: int


@app.post("/orders", status_code=201)
async def place_order(order: Order) -> dict[str, str]:
    order_id = str(uuid.uuid4())
    async with aiosqlite.connect(DB) as db:
        await db.execute(
            "INSERT INTO orders VALUES (?, ?, ?)", (order_id, order.customer, order.total)
        )
        event = Message(
            topic="orders", key=order_id, payload={"id": order_id, **order.model_dump()}
        )
        written = await outbox.add_async(db, event)  # in the same transaction
        await db.commit()
    outbox.committed(written)  # wakes this process's relay: no wait for its next poll
    return {"id": order_id}
