"""A small shop on SQLite: an order and its OrderPlaced message commit together, and
the shipping consumer ships each order once, announcing it with OrderShipped."""

import contextlib
import sqlite3
from collections.abc import Iterator

from relaybox import Consumer, Inbox, Incoming, Message, Outbox

outbox = Outbox()


def create_tables(path: str) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, amount INTEGER)")
        conn.execute("CREATE TABLE shipments (order_id TEXT)")


def place_order(conn: sqlite3.Connection, order_id: str, amount: int) -> None:
    """Record an order and its event, in the caller's transaction."""
    conn.execute("INSERT INTO orders VALUES (?, ?)", (order_id, amount))
    payload = {"order": order_id, "amount": amount}
    outbox.add(conn, Message(topic="orders", key=order_id, type="OrderPlaced", payload=payload))
    if amount <= 0:  # found out late: the caller's transaction rolls back, message and all
        raise ValueError("an order needs a positive amount")


def shipping(path: str) -> Consumer:
    """The consumer that ships placed orders, its inbox in the same database."""

    @contextlib.contextmanager
    def transaction() -> Iterator[sqlite3.Connection]:
        with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn, conn:
            yield conn

    consumer = Consumer(inbox=Inbox(consumer="shipping"), transaction=transaction)

    @consumer.handler("OrderPlaced")
    def ship(message: Incoming, conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO shipments VALUES (?)", (message.key,))
        shipped = message.follow_up(topic="shipments", key=message.key, type="OrderShipped")
        outbox.add(conn, shipped)

    return consumer
