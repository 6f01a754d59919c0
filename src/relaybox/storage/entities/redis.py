"""Entity and dedup stores on Redis (redis-py, the `redis` extra).

An entity is one string key, `<prefix>entity:<id>`, holding its JSON document with the
version first (`Entity.document`). A save is a Lua script that Redis runs atomically
(sent once, then called by its SHA, EVALSHA): it reads the stored version, compares it
with the expected one and sets the new document, or does nothing. A dedup entry is one
key, `<prefix>done:<message id>`, set with SET NX PX: it expires after the retention.

Both must read and write the primary. A replica may answer a load with an older
version (the save still checks the primary's, so that costs a retry) and, worse, a
`processed` with "no" for an id the primary has: a copy is then applied again. Redis
replicates asynchronously: a failover can lose the writes the old primary
acknowledged last (a save, a dedup entry), unless `WAIT` or `min-replicas-to-write`
bound it. docs/entities.md says what each loss costs.
"""

from __future__ import annotations

import datetime
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from relaybox.core.entities import DEFAULT_DEDUP_RETENTION, Entity, check_id, retention_seconds
from relaybox.core.urls import mask_url
from relaybox.errors import StorageOperationalError

DEFAULT_PREFIX = "relaybox:"

#: KEYS[1] the entity's key; ARGV[1] the expected version, ARGV[2] the new document.
#: The stored document starts with its version (`{"version":N,...`), which the script
#: reads without decoding the rest.
_SAVE = """
local current = redis.call('GET', KEYS[1])
local version = 0
if current then
  version = tonumber(string.match(current, '^{"version":(%d+),'))
  if version == nil then return redis.error_reply('entity document without a version') end
end
if version ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""


def _client(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, socket_connect_timeout=10, socket_timeout=30)


class _RedisStore:
    def __init__(self, url: str, *, prefix: str) -> None:
        self.masked = mask_url(url)
        self.prefix = prefix
        self.client = _client(url)

    async def _run(self, what: str, call: Any) -> Any:
        try:
            return await call
        except redis_errors.RedisError as error:
            raise StorageOperationalError(
                f"{what} at {self.masked} failed: {type(error).__name__}: {error}"
            ) from None

    async def close(self) -> None:
        await self.client.aclose()


class RedisEntityStore(_RedisStore):
    """Entities as JSON documents, one key each, saved by compare-and-set."""

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(url, prefix=prefix)
        self._save = self.client.register_script(_SAVE)

    def key(self, entity_id: str) -> str:
        return f"{self.prefix}entity:{check_id('entity id', entity_id)}"

    async def load(self, entity_id: str) -> Entity | None:
        document = await self._run("loading an entity", self.client.get(self.key(entity_id)))
        return None if document is None else Entity.from_document(entity_id, document)

    async def save(self, entity: Entity, expected_version: int) -> bool:
        keys = [self.key(entity.id)]
        args: list[str | int] = [expected_version, entity.document()]
        saved = await self._run("saving an entity", self._save(keys=keys, args=args))
        return bool(saved)


class RedisDedupStore(_RedisStore):
    """Processed message ids as keys that expire after `retention`."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        retention: datetime.timedelta | float = DEFAULT_DEDUP_RETENTION,
    ) -> None:
        super().__init__(url, prefix=prefix)
        self.retention = retention_seconds(retention)

    def key(self, message_id: str) -> str:
        return f"{self.prefix}done:{check_id('message id', message_id)}"

    async def processed(self, message_id: str) -> bool:
        found = await self._run("reading a dedup entry", self.client.exists(self.key(message_id)))
        return bool(found)

    async def add(self, message_id: str) -> None:
        milliseconds = max(1, round(self.retention * 1000))
        added = self.client.set(self.key(message_id), b"1", nx=True, px=milliseconds)
        await self._run("adding a dedup entry", added)
