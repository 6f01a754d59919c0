"""JSON-lines sinks: `file://PATH` appends one line per confirmed message; `stdout://`
prints them. For the demo, for debugging, and as the relay tests' witness.

Each line is a CloudEvent in structured JSON mode (`data` when the payload is JSON,
else `data_base64`), plus the members `topic`, `target`, `headers` (the message's own),
`pid` and `published_ns` (when this process confirmed it), which a checker reads.

A message counts as published once its line reached the kernel (one `os.write` per
call, on a file opened with O_APPEND, so several relay processes may share one file
and a process killed afterwards loses nothing). `?fsync=true` also survives a crash of
the machine, at the cost of a disk flush per call.

For tests and demos the URL can ask for trouble: `file:///tmp/out.jsonl?delay=0.05`
waits that long per call (a slow broker); `fail_keys=a,b&fail_until=<unix time>` fails
messages of those keys transiently until then (a key that fails, then recovers).
Common option: `source=` (the CloudEvents source).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence

from relaybox.core import envelope
from relaybox.core.envelope import DEFAULT_SOURCE
from relaybox.core.publishing import (
    ACKED,
    PublisherFeatures,
    PublishResult,
    permanent,
    transient,
)
from relaybox.core.records import StoredMessage
from relaybox.errors import ConfigurationError, InvalidHeadersError
from relaybox.publishers.options import BrokerUrl


def line(message: StoredMessage, source: str = DEFAULT_SOURCE) -> dict[str, object]:
    event = envelope.structured(message, source)
    event.update(
        topic=message.topic, target=message.target, headers=dict(message.headers),
        pid=os.getpid(), published_ns=time.time_ns(),
    )  # fmt: skip
    return event


def from_url(url: BrokerUrl) -> FilePublisher:
    if url.scheme == "stdout":
        return FilePublisher("-", source=url.source)
    return FilePublisher(
        url.parts.netloc + url.path,
        source=url.source,
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
        source: str = DEFAULT_SOURCE,
    ) -> None:
        if not path:
            raise ConfigurationError("file:// needs a path, like file:///tmp/relaybox.jsonl")
        self.path = path  # "-": standard output
        self.source = source
        self._delay = delay
        self._fail_keys = fail_keys
        self._fail_until = fail_until
        self._fsync = fsync
        self._fd: int | None = None

    async def start(self) -> None:
        if self.path == "-":
            self._fd = sys.stdout.fileno()
            return
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as error:
            raise ConfigurationError(f"cannot open {self.path!r} for appending: {error}") from error

    async def close(self) -> None:
        if self._fd is not None and self.path != "-":
            os.close(self._fd)
        self._fd = None

    async def publish(self, messages: Sequence[StoredMessage]) -> list[PublishResult]:
        if self._fd is None:
            raise ConfigurationError("FilePublisher.publish called before start()")
        if self._delay:
            await asyncio.sleep(self._delay)
        failing = self._fail_keys and time.time() < self._fail_until
        results: list[PublishResult] = []
        lines: list[bytes] = []
        for message in messages:
            if failing and message.key in self._fail_keys:
                results.append(transient("injected failure"))
                continue
            try:
                lines.append((_dumps(line(message, self.source)) + "\n").encode("utf-8"))
            except InvalidHeadersError as error:  # a stored row's header poses as the envelope's
                results.append(permanent(str(error)))
                continue
            except UnicodeEncodeError as error:  # a stored row's text that is not Unicode
                results.append(permanent(f"the line cannot be written as UTF-8: {error}"))
                continue
            results.append(ACKED)
        view = memoryview(b"".join(lines))
        while view:  # a regular file takes it all in one go; be sure anyway
            view = view[os.write(self._fd, view) :]
        if self._fsync:
            os.fsync(self._fd)
        return results


def _dumps(event: dict[str, object]) -> str:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False)
