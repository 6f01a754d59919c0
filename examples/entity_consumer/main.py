"""A ledger service that keeps each account as one Redis key, with no relational
database to share a transaction with an inbox: `EntityConsumer` applies each deposit
once and sends each balance message at least once under one id.

A shop writes deposits to its outbox (SQLite here); the relay publishes them to a Redis
stream; `RedisConsumer` feeds them to the ledger's `EntityConsumer`, whose accounts and
dedup entries live in Redis and whose balance messages go out through the relay's Redis
publisher. Then the relay publishes one deposit a second time, as it would after dying
between Redis' confirmation and its own record of it: the ledger skips the copy.

Run: python examples/entity_consumer/main.py (Redis on 127.0.0.1:6379).
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sqlite3
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from relaybox import Incoming, Message, Outbox, Relay, RelaySettings
from relaybox.consumers.redis import RedisConsumer
from relaybox.inbox.entities import EntityConsumer
from relaybox.migrations import migrate
from relaybox.publishers import open_publisher
from relaybox.storage.entities.redis import RedisDedupStore, RedisEntityStore

REDIS = "redis://127.0.0.1:6379/0"


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)


def deposit(account: dict[str, Any] | None, message: Incoming) -> tuple[Any, list[Message]]:
    """The ledger's handler: the account's new state, and the message it owes."""
    balance = (account or {"balance": 0})["balance"] + message.json()["amount"]
    update = message.follow_up(topic="balances", key=message.key, payload={"balance": balance})
    return {"balance": balance}, [update]


async def main(workdir: pathlib.Path, prefix: str) -> dict[str, Any]:
    shop_db = workdir / "shop.db"
    await migrate(f"sqlite:///{shop_db}")
    outbox = Outbox()
    with contextlib.closing(sqlite3.connect(shop_db)) as conn:
        for account, amount in (("account-1", 10), ("account-2", 5), ("account-1", 7)):
            payload = {"amount": amount}
            outbox.add(conn, Message(topic="deposits", key=account, payload=payload))
            conn.commit()

    # The ledger: accounts and dedup entries in Redis, balances out through a publisher.
    broker = f"{REDIS}?prefix={prefix}"
    publisher = open_publisher(broker)
    await publisher.start()
    accounts = RedisEntityStore(REDIS, prefix=prefix)
    done = RedisDedupStore(REDIS, prefix=prefix, retention=7 * 24 * 3600)
    ledger = EntityConsumer(
        deposit, entities=accounts, dedup=done, publishers={"default": publisher}
    )
    receiver = RedisConsumer(REDIS, ledger, stream=f"{prefix}deposits", group="ledger",
                             fetch_timeout=0.2)  # fmt: skip
    settings = RelaySettings(idle_interval=0.1, published_retention=3600)
    relay = Relay(f"sqlite:///{shop_db}", {"default": broker}, settings=settings)
    client = aioredis.Redis.from_url(REDIS)
    try:
        async with relay, receiver:
            await until(lambda: ledger.applied == 3)
            # What a relay that died after Redis confirmed a deposit, before it recorded
            # that, leaves behind: the deposit pending again. It is published again.
            with contextlib.closing(sqlite3.connect(shop_db)) as conn, conn:
                conn.execute(
                    "UPDATE relaybox_outbox SET status = 'pending', published_at = NULL "
                    "WHERE seq = 1"
                )
            await until(lambda: ledger.duplicates == 1)
        balances = {}
        for account in ("account-1", "account-2"):
            entity = await accounts.load(account)
            balances[account] = entity.state["balance"] if entity else None
        sent = await client.xlen(f"{prefix}balances")
    finally:
        await publisher.close()
        await accounts.close()
        await done.close()
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    return {"balances": balances, "applied": ledger.applied,
            "duplicates": ledger.duplicates, "balance_messages": sent}  # fmt: skip


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as workdir:
        print(asyncio.run(main(pathlib.Path(workdir), f"ledger-{uuid.uuid4().hex[:8]}:")))
