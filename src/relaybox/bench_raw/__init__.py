"""Raw publish loops per broker, for `relaybox bench --broker`: the client library alone.

Each module (named as in `relaybox.publishers.SCHEMES`) exposes `prepare(url, topic)`,
`publish_raw(url, topic, count, payload)` (pipelined, every message confirmed) and
`cleanup(url, topic)`. `broker_limit` times one against the broker the relay drained to,
so the relay's rate has its ceiling beside it, measured in the same run.
"""

from __future__ import annotations

import importlib
import time
import types
import uuid
from typing import Any

from relaybox.publishers import SCHEMES


def module_for(url: str) -> types.ModuleType | None:
    """The raw loop for `url`'s broker, or None where there is none (memory, file, http)."""
    name = SCHEMES.get(url.partition("://")[0])
    if name is None:
        return None
    try:
        return importlib.import_module(f"relaybox.bench_raw.{name}")
    except ModuleNotFoundError as error:
        if error.name == f"relaybox.bench_raw.{name}":
            return None
        raise


def bench_topic() -> str:
    return f"rbbench.{uuid.uuid4().hex[:10]}"


async def broker_limit(url: str, count: int, payload_bytes: int) -> dict[str, Any] | None:
    """Publish `count` messages of `payload_bytes` straight through the client library."""
    raw = module_for(url)
    if raw is None:
        return None
    topic = bench_topic()
    await raw.prepare(url, topic)
    try:
        started = time.perf_counter()
        await raw.publish_raw(url, topic, count, b"x" * payload_bytes)
        seconds = time.perf_counter() - started
    finally:
        await raw.cleanup(url, topic)
    return {
        "messages": count,
        "payload_bytes": payload_bytes,
        "seconds": round(seconds, 3),
        "msg_per_s": round(count / seconds, 1) if seconds > 0 else None,
        "how": f"relaybox.bench_raw.{raw.__name__.rsplit('.', 1)[-1]}.publish_raw: "
        "the client library alone, pipelined, every message confirmed",
    }
