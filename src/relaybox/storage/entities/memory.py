"""Entity and dedup stores in this process's memory: for tests and single-process
tools. They keep entities as the JSON documents the other stores keep, so what they
accept is what those accept, and they pass the same conformance suite
(tests/entities)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

from relaybox.core.entities import DEFAULT_DEDUP_RETENTION, Entity, check_id, retention_seconds


class MemoryEntityStore:
    """Entities as JSON documents in a dict; a save compares versions and writes in one
    step of the event loop, so it is atomic among the loop's tasks."""

    def __init__(self) -> None:
        self.documents: dict[str, str] = {}

    async def load(self, entity_id: str) -> Entity | None:
        document = self.documents.get(check_id("entity id", entity_id))
        return None if document is None else Entity.from_document(entity_id, document)

    async def save(self, entity: Entity, expected_version: int) -> bool:
        entity_id = check_id("entity id", entity.id)
        document = entity.document()
        stored = self.documents.get(entity_id)
        version = 0 if stored is None else Entity.from_document(entity_id, stored).version
        if version != expected_version:
            return False
        self.documents[entity_id] = document
        return True

    async def close(self) -> None:
        """Nothing to release."""


class MemoryDedupStore:
    """Message ids with the monotonic time they expire at."""

    def __init__(
        self,
        *,
        retention: datetime.timedelta | float = DEFAULT_DEDUP_RETENTION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.retention = retention_seconds(retention)
        self.clock = clock
        self.expiries: dict[str, float] = {}

    async def processed(self, message_id: str) -> bool:
        expiry = self.expiries.get(check_id("message id", message_id))
        return expiry is not None and expiry > self.clock()

    async def add(self, message_id: str) -> None:
        key, now = check_id("message id", message_id), self.clock()
        if self.expiries.get(key, now) <= now:  # absent or expired: (re)start its retention
            self.expiries[key] = now + self.retention

    async def close(self) -> None:
        """Nothing to release."""
