"""UUIDv7 message ids (RFC 9562).

Python gains `uuid.uuid7` only in 3.14. A short function here beats a dependency for
3.11-3.13: a 48-bit millisecond clock, a 12-bit counter that keeps ids from one process
strictly increasing within a millisecond (method 1 of the RFC), and 62 random bits.
"""

from __future__ import annotations

import array
import os
import threading
import time
import uuid
from collections.abc import Callable

_lock = threading.Lock()
_last_ms = 0
_counter = 0
_COUNTER_MAX = 0xFFF
# Random bits come from os.urandom in 4 KiB draws, read as 64-bit words: one syscall
# per ~300 ids, not two per id, and indexing an array costs less than slicing bytes
# and converting them.
_POOL_WORDS = 512
_pool = array.array("Q")
_pool_at = _POOL_WORDS
_RANDOM_62 = (1 << 62) - 1
_VERSION_AND_VARIANT = (0x7 << 76) | (0b10 << 62)
_UNKNOWN_SAFETY = uuid.SafeUUID.unknown
_time_ns = time.time_ns
_new = object.__new__
#: The slots' own setters: UUID.__setattr__ refuses every assignment.
_set_int: Callable[[uuid.UUID, int], None] = vars(uuid.UUID)["int"].__set__
_set_safe: Callable[[uuid.UUID, uuid.SafeUUID], None] = vars(uuid.UUID)["is_safe"].__set__


def _forget_pool() -> None:
    """A forked child must not draw its parent's remaining random words: both processes
    would then make ids with the same random bits (with the same clock and counter,
    the same ids). Writer processes are commonly forked from one that wrote already."""
    global _pool, _pool_at
    _pool, _pool_at = array.array("Q"), _POOL_WORDS


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_pool)


def uuid7() -> uuid.UUID:
    """A new time-ordered UUID, monotonic within this process.

    It runs once per message inside the caller's transaction, so every step counts
    (docs/benchmarks.md times it beside `uuid.uuid4()`): the clock is read before the
    lock, both random words are taken in one step, and the UUID's two slots are set
    through their descriptors (UUID(int=...) re-validates what is valid by construction).
    """
    global _last_ms, _counter, _pool, _pool_at
    now_ms = _time_ns() // 1_000_000
    with _lock:
        at = _pool_at
        if at > _POOL_WORDS - 2:  # two words may be needed: refill early
            _pool, at = array.array("Q", os.urandom(8 * _POOL_WORDS)), 0
        random_bits = _pool[at] & _RANDOM_62
        if now_ms > _last_ms:
            _last_ms = now_ms
            _counter = _pool[at + 1] & 0xFF  # a random start, with headroom for the counter
            _pool_at = at + 2
        else:
            _pool_at = at + 1
            if _counter < _COUNTER_MAX:
                _counter += 1
            else:  # 4096 ids in one millisecond: borrow the next millisecond
                _last_ms += 1
                _counter = 0
        value = (_last_ms << 80) | (_counter << 64) | _VERSION_AND_VARIANT | random_bits
    made: uuid.UUID = _new(uuid.UUID)
    _set_int(made, value)
    _set_safe(made, _UNKNOWN_SAFETY)
    return made


def uuid7_time_ms(value: uuid.UUID) -> int:
    """The Unix time in milliseconds that a UUIDv7 carries."""
    return value.int >> 80


def instance_name() -> str:
    """A name unique per process and instance: host, pid and a random suffix (a relay
    worker's, a Redis group consumer's)."""
    import socket

    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
