"""The hand-written parts of relaybox's hot paths, each beside the plain way it replaces.

Each pair does the same work on the same input, in this one process, timed by `timeit`
(the best of `--repeat` runs of `--number` calls, in microseconds a call), and the
process's CPU time per statement for the two psycopg ways (a round trip each, so the
wall time would be the server's). The pairs:

- `uuid`: `relaybox.core.ids.uuid7()` (a message id, drawn in every writer transaction)
  beside `uuid.uuid4()`.
- `json`: `relaybox.core.payload.encode_payload` of a dict (the encoder made once)
  beside `json.dumps(..., separators=(",", ":")).encode()`, which builds its encoder at
  every call.
- `record`: a row read by asyncpg made a `StoredMessage` by `storage.rows.decode_exact`
  (a named tuple, made in C) beside the same fields given to a slotted dataclass.
- `redis`: one relaybox message's XADD bytes as the Redis publisher makes them beside
  the same entry (`publishers.redis.fields`) packed by redis-py's `pack_commands`.
- `nats`: one relaybox message's HPUB frame as the NATS publisher makes it beside
  nats-py's own `publish()` of the same headers (`publishers.nats.wire_headers`) into a
  client's send buffer (not connected; the frame is what the tests compare).
- `in_flight`: what a relay's read sends of the rows in flight, in a drain: two batches
  of 500 rows beside it. Batch by batch (`RowsInFlight`: each batch's seqs made text
  once, when it goes in flight, and a read joins the texts; a call makes one batch's
  text, as each read of a drain follows one new batch) beside every seq made text at
  every read. `--number` / 50 calls.
- `psycopg`: a writer statement executed through one kept cursor (what the writer's
  psycopg channel does) beside `Connection.execute`, which makes a cursor per call;
  process CPU per statement over `--statements` statements each, alternated in rounds.

Prints JSON.

    .venv/bin/python benchmarks/hot_parts.py [--number 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import operator
import statistics
import sys
import time
import timeit
import uuid
from pathlib import Path
from typing import Any

import psycopg
from nats.aio.client import Client as NatsClient
from redis.asyncio.connection import Connection as RedisConnection

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_URL, machine

from relaybox.core.ids import uuid7
from relaybox.core.payload import encode_payload
from relaybox.core.records import RowsInFlight, StoredMessage, seq_text
from relaybox.publishers import nats as nats_publisher
from relaybox.publishers import nats_protocol, redis_protocol
from relaybox.publishers import redis as redis_publisher
from relaybox.storage import postgres as postgres_storage
from relaybox.storage.rows import decode_exact

SOURCE = "/relaybox/bench"
PAYLOAD = {"order_id": "o-000001234", "amount": "129.90", "currency": "EUR", "items": 3}


#: The fields of a StoredMessage, as a slotted dataclass (the alternative).
RowAsDataclass = dataclasses.make_dataclass("RowAsDataclass", StoredMessage._fields, slots=True)


def a_message() -> StoredMessage:
    """A message of the shape `relaybox bench` writes: a key, a JSON payload of about
    100 bytes, no headers of its own."""
    return StoredMessage(
        seq=123456, id=uuid7(), target="default", external=False, topic="orders",
        key="k417", partition=17, type="orders", content_type="application/json",
        payload=b'{"n":"000123456","pad":"' + b"x" * 74 + b'"}', headers={},
        correlation_id=None, causation_id=None, tenant_id=None, aggregate_id=None,
        occurred_at=datetime.datetime.now(datetime.UTC), attempts=0,
    )  # fmt: skip


def best_us(call: Any, number: int, repeat: int) -> float:
    return round(min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6, 3)


def pair(ours: Any, theirs: Any, number: int, repeat: int) -> dict[str, float]:
    a, b = best_us(ours, number, repeat), best_us(theirs, number, repeat)
    return {"relaybox_us": a, "plain_way_us": b, "relaybox_over_plain": round(a / b, 3)}


def redis_pair(message: StoredMessage, number: int, repeat: int) -> dict[str, float]:
    trim = redis_protocol.trim_options(None, True)
    stream = "outbox:" + message.topic

    def ours() -> bytes:
        return b"".join(redis_publisher.entry(stream, trim, message, SOURCE))

    connection = RedisConnection()

    def theirs() -> bytes:
        args: list[Any] = ["XADD", stream, "*"]
        for name, value in redis_publisher.fields(message, SOURCE).items():
            args += (name, value)
        return b"".join(connection.pack_commands([args]))

    assert ours() == theirs(), "the two ways must send the same bytes"
    return pair(ours, theirs, number, repeat)


def nats_pair(message: StoredMessage, number: int, repeat: int) -> dict[str, float]:
    subject, reply = message.topic, "_INBOX.bench.1"

    def ours() -> bytes:
        block = nats_publisher.header_block(message, SOURCE)
        return b"".join(nats_protocol.hpub(subject, reply, block, message.payload))

    client = NatsClient()
    client._max_pending_size = 1 << 40  # buffered as while reconnecting: never sent
    loop = asyncio.new_event_loop()

    async def publish_many(count: int) -> None:
        for _ in range(count):
            headers = nats_publisher.wire_headers(message, SOURCE)
            await client.publish(subject, message.payload, reply=reply, headers=headers)
            client._pending.clear()
            client._pending_data_size = 0

    async def one() -> bytes:
        headers = nats_publisher.wire_headers(message, SOURCE)
        await client.publish(subject, message.payload, reply=reply, headers=headers)
        frame = b"".join(client._pending)
        client._pending.clear()
        client._pending_data_size = 0
        return frame

    try:
        assert ours() == loop.run_until_complete(one()), "the two ways must send the same bytes"
        a = best_us(ours, number, repeat)
        # nats-py's publish is a coroutine: timed in batches inside one loop run.
        runs = []
        for _ in range(repeat):
            started = time.perf_counter()
            loop.run_until_complete(publish_many(number))
            runs.append(time.perf_counter() - started)
        b = round(min(runs) / number * 1e6, 3)
    finally:
        loop.close()
    return {"relaybox_us": a, "plain_way_us": b, "relaybox_over_plain": round(a / b, 3)}


def in_flight_pair(message: StoredMessage, number: int, repeat: int) -> dict[str, float]:
    older, newer = (
        [message._replace(seq=seq) for seq in range(start, start + 500)]
        for start in (10_000_000, 10_000_500)
    )
    older_text = seq_text(older)

    def ours() -> str:
        in_flight = RowsInFlight([(older, older_text), (newer, seq_text(newer))])
        return postgres_storage._in_flight_text(in_flight)

    def theirs() -> str:
        in_flight = [m for batch in (older, newer) for m in batch]
        return postgres_storage._array_text(map(operator.attrgetter("seq"), in_flight))

    if ours() != theirs():
        raise AssertionError("the two ways sent different seqs")
    return pair(ours, theirs, max(1, number // 50), repeat)


def psycopg_pair(url: str, statements: int, rounds: int) -> dict[str, Any]:
    """Client CPU per INSERT: one kept cursor against a cursor per call."""
    query = "INSERT INTO bench_hot_parts (id, key, payload) VALUES (%s, %s, %s)"
    kept_cpu: list[float] = []
    fresh_cpu: list[float] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE bench_hot_parts (id uuid, key text, payload bytea)")
        cursor = conn.cursor()
        body = json.dumps(PAYLOAD).encode()
        for _ in range(rounds):
            for way, into in (("kept", kept_cpu), ("fresh", fresh_cpu)):
                cpu = time.process_time()
                for n in range(statements):
                    params = (uuid.uuid4(), f"k{n}", body)
                    if way == "kept":
                        cursor.execute(query, params)
                    else:
                        conn.execute(query, params)
                into.append((time.process_time() - cpu) / statements * 1e6)
                conn.execute("TRUNCATE bench_hot_parts")
    kept, fresh = statistics.median(kept_cpu), statistics.median(fresh_cpu)
    return {
        "relaybox_us": round(kept, 2), "plain_way_us": round(fresh, 2),
        "relaybox_over_plain": round(kept / fresh, 3), "rounds": rounds,
        "statements_per_round": statements,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--statements", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--db", default=PG_URL)
    args = parser.parse_args()
    number, repeat = args.number, args.repeat
    message = a_message()
    row = (*message[:10], "{}", *message[11:])  # as asyncpg returns it: headers as text

    def as_dataclass() -> Any:
        return RowAsDataclass(*row[:10], message.headers, *row[11:])

    result = {
        "benchmark": "hot_parts",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": vars(args),
        "uuid": pair(uuid7, uuid.uuid4, number, repeat),
        "json": pair(
            lambda: encode_payload(PAYLOAD, None),
            lambda: json.dumps(PAYLOAD, separators=(",", ":")).encode(),
            number,
            repeat,
        ),
        "record": pair(lambda: decode_exact(row), as_dataclass, number, repeat),
        "redis": redis_pair(message, number, repeat),
        "nats": nats_pair(message, number, repeat),
        "in_flight": in_flight_pair(message, number, repeat),
        "psycopg": psycopg_pair(args.db, args.statements, args.rounds),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
