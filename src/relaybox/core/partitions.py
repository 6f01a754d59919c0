"""Stable partitioning of keys: the same key maps to the same partition in every process.

Python's `hash()` is salted per process, so it is useless here; CRC-32 is stable,
cheap and spreads short keys well enough for work distribution.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
import zlib
from collections.abc import Iterable

from relaybox.errors import ConfigurationError

DEFAULT_PARTITIONS = 64

#: The stored `partition` column holds this many bits of a stable hash; a relay's
#: partition of a row is that hash modulo the relay's partition count. So writers need
#: no partition count, and a key stays in one partition whatever count relays use.
_HASH_MASK = 0x7FFFFFFF


def partition_for(key: str | None, message_id: uuid.UUID) -> int:
    """The stored partition hash of a message: from its key, or its id when keyless."""
    if key is None:
        return message_id.int & _HASH_MASK
    return zlib.crc32(key.encode("utf-8")) & _HASH_MASK


def partition_of(stored: int, partitions: int) -> int:
    """The partition (of `partitions`) that a row with this stored hash belongs to."""
    return stored % partitions


#: Lock slots for writers of one key on databases without transaction-scoped advisory
#: locks (MySQL/MariaDB): see the key lock table in sql/mysql/schema.sql.
KEY_LOCK_SLOTS = 4096


def key_lock_slot(key: str) -> int:
    return zlib.crc32(key.encode()) % KEY_LOCK_SLOTS


def lock_scope(table: str) -> bytes:
    """What a table's lock ids hash: its unqualified, case-folded name, so `outbox`,
    `OUTBOX` and `public.outbox` (one table to PostgreSQL) take the same locks. Two
    schemas' tables of one name then share lock ids: needless waits, never a missed one."""
    return table.rpartition(".")[2].lower().encode("utf-8")


def claim_lock_key(table: str) -> int:
    """A signed 32-bit key for `table`'s claim locks (PostgreSQL's two-int lock space)."""
    return zlib.crc32(lock_scope(table)) - (1 << 31)


def key_lock_id(table: str, key: str | None) -> int | None:
    """A signed 64-bit advisory-lock id for (table, key); None for keyless messages."""
    if key is None:
        return None
    return (_lock_id_base(table) | zlib.crc32(key.encode())) - (1 << 63)


def partition_and_lock(
    table: str, key: str | None, message_id: uuid.UUID
) -> tuple[int, int | None]:
    """`partition_for` and `key_lock_id` together, from one CRC of the key: the writer
    needs both for every message."""
    if key is None:
        return message_id.int & _HASH_MASK, None
    crc = zlib.crc32(key.encode())
    return crc & _HASH_MASK, (_lock_id_base(table) | crc) - (1 << 63)


@functools.lru_cache(maxsize=256)
def _lock_id_base(table: str) -> int:
    """The table's half of its key-lock ids, worked out once: the writer needs it in
    every transaction."""
    return zlib.crc32(lock_scope(table)) << 32


@dataclasses.dataclass(frozen=True, slots=True)
class Rebalance:
    """What a relay process does with its partitions at a heartbeat.

    `draining` are partitions beyond the fair share that still have rows in flight:
    they are renewed, not given back, until those rows are settled (so the next owner
    never publishes them a second time); the relay reads no more rows from them.
    """

    keep: tuple[int, ...]
    release: tuple[int, ...]
    wanted: int
    draining: tuple[int, ...] = ()


def require_partitions(partitions: int) -> int:
    """`partitions` if it is a usable partition count; a `ConfigurationError` if not."""
    if not isinstance(partitions, int) or partitions < 1:
        raise ConfigurationError("partitions must be a positive integer")
    return partitions


def fair_share(partitions: int, members: int) -> int:
    """Each live member's share, rounded up so that no partition is left over."""
    return -(-partitions // max(members, 1))


def rebalance(
    held: Iterable[int], partitions: int, members: int, busy: Iterable[int] = ()
) -> Rebalance:
    """Keep the lowest `held` partitions up to the fair share; give back the rest,
    except those `busy` (rows in flight), which drain first.

    Partitions numbered `partitions` or above (the count was lowered) are given back
    too; `wanted` is how many free or expired ones to take to reach the share.
    """
    owned = sorted(set(held))
    share = fair_share(partitions, members)
    keep = tuple(p for p in owned if 0 <= p < partitions)[:share]
    busy = frozenset(busy)
    beyond = [p for p in owned if p not in keep]
    release = tuple(p for p in beyond if p not in busy)
    draining = tuple(p for p in beyond if p in busy)
    return Rebalance(keep, release, share - len(keep), draining)
