"""Raw publish loops per broker, for `relaybox bench --broker`: the client library alone.

Each module (named as in `relaybox.publishers.SCHEMES`) exposes `prepare(url, topic)`,
`publish_raw(url, topic, count, payload, attributes=None)` (pipelined, every message
confirmed; `attributes` as CloudEvents headers in the broker's binding) and
`cleanup(url, topic)`. `broker_limit` times one against the broker the relay drained to,
so the relay's rate has its ceiling beside it, measured in the same run.
"""

from __future__ import annotations

import datetime
import importlib
import time
import types
import uuid
from typing import Any

from relaybox.core import envelope
from relaybox.core.ids import uuid7
from relaybox.core.records import StoredMessage
from relaybox.publishers import SCHEMES


def module_for(url: str) -> types.ModuleType | None:
    """The raw loop for `url`'s broker, or None where there is none (memory, file, http)."""
    name = SCHEMES.get(url.partition("://")[0])
    if name is None:
        return None
    try:
        return importlib.import_module(f"relaybox.tools.bench_raw.{name}")
    except ModuleNotFoundError as error:
        if error.name == f"relaybox.tools.bench_raw.{name}":
            return None
        raise


def bench_topic() -> str:
    return f"rbbench.{uuid.uuid4().hex[:10]}"


def sample_attributes(topic: str, payload: bytes) -> dict[str, str]:
    """The envelope the relay's publisher puts on one of the bench's messages."""
    now = datetime.datetime.now(datetime.UTC)
    message = StoredMessage(
        seq=123_456, id=uuid7(), target="default", external=False, topic=topic, key="k123",
        partition=17, type=topic, content_type="application/json", payload=payload,
        headers={}, correlation_id=None, causation_id=None, tenant_id=None,
        aggregate_id=None, occurred_at=now, attempts=0,
    )  # fmt: skip
    return {**envelope.attributes(message), "datacontenttype": message.content_type}


async def broker_limit(url: str, count: int, payload_bytes: int) -> dict[str, Any] | None:
    """Publish `count` messages of `payload_bytes` straight through the client library,
    bare, then carrying the relay's envelope (prebuilt once): two ceilings for the relay."""
    raw = module_for(url)
    if raw is None:
        return None
    payload = b"x" * payload_bytes
    result: dict[str, Any] = {
        "messages": count,
        "payload_bytes": payload_bytes,
        "how": f"{raw.__name__}.publish_raw: "
        "the client library alone, pipelined, every message confirmed",
    }
    for name, with_envelope in (("bare", False), ("with_envelope", True)):
        topic = bench_topic()
        attributes = sample_attributes(topic, payload) if with_envelope else None
        await raw.prepare(url, topic)
        try:
            started = time.perf_counter()
            await raw.publish_raw(url, topic, count, payload, attributes)
            seconds = time.perf_counter() - started
        finally:
            await raw.cleanup(url, topic)
        result[f"{name}_msg_per_s"] = round(count / seconds, 1) if seconds > 0 else None
    return result
