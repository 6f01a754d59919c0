"""An order service on Flask: each order and its event commit in one SQLAlchemy
transaction, and the relay running in the worker publishes the event once the request
is done.

    relaybox migrate --db sqlite:///shop.db
    SHOP_DB=shop.db NATS_URL=nats://127.0.0.1:4222 gunicorn --preload -w 2 app:app
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"customer": "ada", "total": 42}'
"""

import os
import uuid

from flask import Flask, request
from sqlalchemy import create_engine, text

from relaybox import Message, Outbox, Relay
from relaybox.integrations.flask import Relaybox

DB = os.environ.get("SHOP_DB", "shop.db")
engine = create_engine(f"sqlite:///{DB}")
with engine.begin() as connection:
    connection.execute(
        text(
            "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT, total INTEGER)"
        )
    )

app = Flask(__name__)
relaybox = Relaybox(
    app,
    outbox=Outbox(),
    # Called in each worker, at its first request: never in a master that forks.
    relay=lambda: Relay(
        f"sqlite:///{DB}", {"default": os.environ.get("NATS_URL", "nats://127.0.0.1")}
    ),
)


@app.post("/orders")
def place_order() -> tuple[dict[str, str], int]:
    body = request.get_json(silent=True) or {}
    if not isinstance(body.get("customer"), str) or type(body.get("total")) is not int:
        return {"error": "send a customer (text) and a total (an integer)"}, 400
    order = {"id": str(uuid.uuid4()), "customer": body["customer"], "total": body["total"]}
    with engine.begin() as connection:  # one transaction: the order and its event
        connection.execute(text("INSERT INTO orders VALUES (:id, :customer, :total)"), order)
        relaybox.add(connection, Message(topic="orders", key=order["id"], payload=order))
    return {"id": order["id"]}, 201
