"""JSON-lines sink: one line per confirmed message, appended to a file.

A message counts as published once its line reached the kernel (one `os.write` per
call, on a file opened with O_APPEND, so several relay processes may share one file
and a process killed afterwards loses nothing). `fsync=True` also survives a crash of
the machine, at the cost of a disk flush per call.

For tests and demos the URL can ask for trouble: `file:///tmp/out.jsonl?delay=0.05`
waits that long per call (a slow broker); `fail_keys=a,b&fail_until=<unix time>` fails
messages of those keys transiently until then (a key that fails, then recovers).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from collections.abc import Sequence

from relaybox.core.publishing import ACKED, PublisherFeatures, PublishResult, transient
from relaybox.core.records import StoredMessage
from relaybox.errors import ConfigurationError
from relaybox.publishers.options import BrokerUrl


def line(message: StoredMessage) -> dict[str, object]:
    try:
        payload: str = message.payload.decode("utf-8")
        encoding = "utf-8"
    except UnicodeDecodeError:
        payload, encoding = base64.b64encode(message.payload).decode("ascii"), "base64"
    return {
        "id": str(message.id), "target": message.target, "topic": message.topic,
        "key": message.key, "seq": message.seq, "partition": message.partition,
        "type": message.type, "content_type": message.content_type,
        "headers": dict(message.headers), "payload": payload, "encoding": encoding,
        "attempts": message.attempts, "published_ns": time.time_ns(), "pid": os.getpid(),
    }  # fmt: skip


def from_url(url: BrokerUrl) -> FilePublisher:
    return FilePublisher(
        url.parts.netloc + url.path,
        fsync=url.flag("fsync", False),
        delay=url.number("delay", 0.0, minimum=0.0),
        fail_keys=frozenset(filter(None, url.text("fail_keys", "").split(","))),
        fail_until=url.number("fail_until", 0.0),
    )


class FilePublisher:
    features = PublisherFeatures(deduplicates=False, batching=True)

    def __init__(
        self,
        path: str,
        *,
        fsync: bool = False,
        delay: float = 0.0,
        fail_keys: frozenset[str] = frozenset(),
        fail_until: float = 0.0,
    ) -> None:
        if not path:
            raise ConfigurationError("file:// needs a path, like file:///tmp/relaybox.jsonl")
        self.path = path
        self._delay = delay
        self._fail_keys = fail_keys
        self._fail_until = fail_until
        self._fsync = fsync
        self._fd: int | None = None

    async def start(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as error:
            raise ConfigurationError(f"cannot open {self.path!r} for appending: {error}") from error

    async def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if self._fd is None:
            raise ConfigurationError("FilePublisher.publish called before start()")
        if self._delay:
            await asyncio.sleep(self._delay)
        failing = self._fail_keys and time.time() < self._fail_until
        results = [
            transient("injected failure") if failing and m.key in self._fail_keys else ACKED
            for m in messages
        ]
        written = [m for m, r in zip(messages, results, strict=True) if r.acked]
        data = "".join(json.dumps(line(m), separators=(",", ":")) + "\n" for m in written)
        view = memoryview(data.encode("utf-8"))
        while view:  # a regular file takes it all in one go; be sure anyway
            view = view[os.write(self._fd, view) :]
        if self._fsync:
            os.fsync(self._fd)
        return results
