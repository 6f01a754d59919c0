"""Relay fleets publishing to a slow webhook receiver: where the broker, not the
database, is the limit.

A receiver (an ASGI app under uvicorn, one process, started here and stopped by its
PID) answers every request after `--delay` seconds (50 ms). The outbox table is filled
with `--rows` messages spread over `--keys` keys (row i has key i mod keys, so a key's
rows are spread through the table), then `relaybox relay` processes, spawned at once,
publish them in batch mode (`?batch=true`: one request per batch and topic); the figure
is the time from the spawn until the table is empty. Each relay's share of the keys
decides how much it can keep going at once: a key's rows go one request after
another, so a relay whose keys are fewer than a batch sends its batches one after
another, and a batch that holds a key twice sends its second rows in a request of
their own. Prints JSON; the table is dropped at the end.

    .venv/bin/python benchmarks/slow_receiver.py [--relays 1,2,4] [--keys 1000,10000]
        [--rows 50000] [--delay 0.05] [--rounds 1] [--relay-args "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine

from relaybox import Message, Outbox, sql
from relaybox.migrations import migrate

DB = os.environ.get("RELAYBOX_BENCH_DB", "postgresql://postgres@127.0.0.1:5432/relaybox_bench")
TABLE = "bench_slow_receiver"
BIN = Path(sys.executable).parent

RECEIVER = textwrap.dedent(
    """
    import asyncio, os

    DELAY = float(os.environ["RECEIVER_DELAY"])

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        more = scope["method"] == "POST"
        while more:
            more = (await receive()).get("more_body", False)
        if scope["method"] == "POST":
            await asyncio.sleep(DELAY)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_receiver(workdir: Path, delay: float) -> tuple[subprocess.Popen[bytes], int]:
    (workdir / "slow_app.py").write_text(RECEIVER)
    port = free_port()
    env = {**os.environ, "RECEIVER_DELAY": str(delay)}
    process = subprocess.Popen(
        [str(BIN / "uvicorn"), "slow_app:app", "--port", str(port), "--log-level", "warning"],
        cwd=workdir, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, port
        except OSError:
            time.sleep(0.05)
    stop(process)
    raise RuntimeError("the receiver did not start")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def fill(rows: int, keys: int) -> None:
    with psycopg.connect(DB, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {TABLE}, {TABLE}_partitions, {TABLE}_members, {TABLE}_done")
    outbox = Outbox(table=TABLE)
    with psycopg.connect(DB) as conn:
        for start in range(0, rows, 5000):
            batch = range(start, min(rows, start + 5000))
            outbox.add(conn, [Message(topic="orders", key=f"k-{i % keys}", type="Placed",
                                      payload={"i": i}) for i in batch])  # fmt: skip
        conn.commit()


def drain(relays: int, port: int, relay_args: list[str], logs: Path) -> float:
    url = f"default=http://127.0.0.1:{port}/hooks?batch=true"
    command = [str(BIN / "relaybox"), "relay", "--db", DB, "--table", TABLE, "--broker", url,
               *relay_args]  # fmt: skip
    began = time.monotonic()
    processes = []
    for index in range(relays):
        with (logs / f"relay-{relays}-{index}.log").open("wb") as log:
            processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
    try:
        with psycopg.connect(DB, autocommit=True) as conn:
            while True:
                (left,) = conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone() or (0,)
                if not left:
                    return time.monotonic() - began
                if time.monotonic() - began > 300:
                    raise RuntimeError(f"{left} rows still there after 300 s")
                time.sleep(0.02)
    finally:
        for process in processes:
            stop(process)


def teardown() -> None:
    with psycopg.connect(DB, autocommit=True) as conn:
        for statement in sql.drops("postgresql", TABLE):
            conn.execute(statement)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--relays", default="1,2,4")
    parser.add_argument("--keys", default="1000,10000")
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--relay-args", default="")
    args = parser.parse_args()
    relay_counts = [int(n) for n in args.relays.split(",")]
    key_counts = [int(n) for n in args.keys.split(",")]
    asyncio.run(migrate(DB, table=TABLE))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="relaybox-slow-") as workdir:
        receiver, port = start_receiver(Path(workdir), args.delay)
        try:
            for _ in range(args.rounds):
                for keys in key_counts:
                    for relays in relay_counts:
                        fill(args.rows, keys)
                        seconds = drain(relays, port, shlex.split(args.relay_args), Path(workdir))
                        runs.append({"keys": keys, "relays": relays, "seconds": round(seconds, 2),
                                     "msg_per_s": round(args.rows / seconds)})  # fmt: skip
                        print(json.dumps(runs[-1]), file=sys.stderr)
        finally:
            stop(receiver)
            teardown()
    result = {"benchmark": "slow_receiver", "rows": args.rows, "delay": args.delay,
              "relay_args": args.relay_args, "runs": runs, "machine": machine()}  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
