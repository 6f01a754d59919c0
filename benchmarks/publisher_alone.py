"""A broker publisher alone, beside its client library's raw loops, in one process.

No database and no relay: `--messages` stored messages shaped like `relaybox bench`'s
(keys round-robin, a JSON payload of `--payload-bytes`, no headers of their own) go to
the publisher in calls of `--batch`, `--in-flight` calls at a time, as the relay's
delivery does; then `relaybox.tools.bench_raw.<broker>.publish_raw` runs bare and with the
envelope. Each of the three is run `--rounds` times, interleaved; prints the rates of
every round, this process's CPU time per message (less noisy than the rate on a
shared machine: it leaves out the time spent waiting for the broker), and their medians
as JSON.

    PYTHONPATH=src .venv/bin/python benchmarks/publisher_alone.py nats://127.0.0.1:4222
    PYTHONPATH=src .venv/bin/python benchmarks/publisher_alone.py redis://127.0.0.1:6379/0

To compare two versions of the code, run this once per source tree (PYTHONPATH), in
alternation, several times.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

from relaybox.core.ids import uuid7
from relaybox.core.publishing import Outcome
from relaybox.core.records import StoredMessage
from relaybox.publishers import open_publisher
from relaybox.tools import bench_raw


def messages(topic: str, count: int, payload_bytes: int, keys: int) -> list[StoredMessage]:
    now = datetime.datetime.now(datetime.UTC)
    pad = "x" * max(0, payload_bytes - len('{"n":"000000000","pad":""}'))
    return [message(topic, n, pad, keys, now) for n in range(count)]


def message(topic: str, n: int, pad: str, keys: int, now: datetime.datetime) -> StoredMessage:
    return StoredMessage(
        seq=n, id=uuid7(), target="default", external=False, topic=topic,
        key=f"k{n % keys}", partition=n % 64, type=topic, content_type="application/json",
        payload=f'{{"n":"{n:09d}","pad":"{pad}"}}'.encode(), headers={},
        correlation_id=None, causation_id=None, tenant_id=None, aggregate_id=None,
        occurred_at=now, attempts=0,
    )  # fmt: skip


async def publisher_rate(url: str, args: argparse.Namespace) -> tuple[float, float]:
    raw = bench_raw.module_for(url)
    assert raw is not None
    topic = bench_raw.bench_topic()
    batch = messages(topic, args.messages, args.payload_bytes, args.keys)
    calls = [batch[i : i + args.batch] for i in range(0, len(batch), args.batch)]
    await raw.prepare(url, topic)
    publisher = open_publisher(url)
    await publisher.start()
    try:
        queue = iter(calls)
        failed = 0

        async def worker() -> None:
            nonlocal failed
            for call in queue:
                results = await publisher.publish(call)
                failed += sum(r.outcome is not Outcome.ACKED for r in results)

        cpu, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.in_flight)))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await publisher.close()
        await raw.cleanup(url, topic)
    if failed:
        raise SystemExit(f"{failed} messages not acked")
    return args.messages / seconds, cpu / args.messages


async def raw_rate(url: str, args: argparse.Namespace, with_envelope: bool) -> tuple[float, float]:
    raw = bench_raw.module_for(url)
    assert raw is not None
    topic = bench_raw.bench_topic()
    payload = b"x" * args.payload_bytes
    attributes = bench_raw.sample_attributes(topic, payload) if with_envelope else None
    await raw.prepare(url, topic)
    try:
        cpu, started = time.process_time(), time.perf_counter()
        await raw.publish_raw(url, topic, args.messages, payload, attributes)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await raw.cleanup(url, topic)
    return args.messages / seconds, cpu / args.messages


async def main(args: argparse.Namespace) -> dict[str, Any]:
    variants: dict[str, Callable[[], Coroutine[Any, Any, tuple[float, float]]]] = {
        "publisher": lambda: publisher_rate(args.url, args),
        "raw_bare": lambda: raw_rate(args.url, args, False),
        "raw_with_envelope": lambda: raw_rate(args.url, args, True),
    }
    chosen = {name: variants[name] for name in args.only or variants}
    rates: dict[str, list[float]] = {name: [] for name in chosen}
    cpu: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(args.rounds):
        for name, run in chosen.items():
            rate, cpu_per_message = await run()
            rates[name].append(round(rate))
            cpu[name].append(round(cpu_per_message * 1e6, 2))
    return {
        "url": args.url,
        "messages": args.messages,
        "batch": args.batch,
        "in_flight": args.in_flight,
        "rounds": rates,
        "median_msg_per_s": {name: statistics.median(r) for name, r in rates.items()},
        "cpu_us_per_msg": cpu,
        "median_cpu_us_per_msg": {name: statistics.median(c) for name, c in cpu.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--payload-bytes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=["publisher", "raw_bare", "raw_with_envelope"])
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
