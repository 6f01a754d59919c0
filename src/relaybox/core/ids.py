"""UUIDv7 message ids (RFC 9562).

Python gains `uuid.uuid7` only in 3.14. Ten lines here beat a dependency for 3.11-3.13:
a 48-bit millisecond clock, a 12-bit counter that keeps ids from one process strictly
increasing within a millisecond (method 1 of the RFC), and 62 random bits.
"""

from __future__ import annotations

import array
import os
import threading
import time
import uuid

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


def _word() -> int:
    """The next random 64-bit word; call with _lock held."""
    global _pool, _pool_at
    if _pool_at == _POOL_WORDS:
        _pool, _pool_at = array.array("Q", os.urandom(8 * _POOL_WORDS)), 0
    _pool_at += 1
    return _pool[_pool_at - 1]


def _forget_pool() -> None:
    """A forked child must not draw its parent's remaining random words: both processes
    would then make ids with the same random bits (with the same clock and counter,
    the same ids). Writer processes are commonly forked from one that wrote already."""
    global _pool, _pool_at
    _pool, _pool_at = array.array("Q"), _POOL_WORDS


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_pool)


def uuid7() -> uuid.UUID:
    """A new time-ordered UUID, monotonic within this process."""
    global _last_ms, _counter, _pool_at
    with _lock:
        if _pool_at < _POOL_WORDS:  # _word(), inline: this runs once per message
            random_bits = _pool[_pool_at] & _RANDOM_62
            _pool_at += 1
        else:
            random_bits = _word() & _RANDOM_62
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms = now_ms
            _counter = _word() & 0xFF  # a random start, with headroom for the counter
        elif _counter < _COUNTER_MAX:
            _counter += 1
        else:  # 4096 ids in one millisecond: borrow the next millisecond
            _last_ms += 1
            _counter = 0
        value = (_last_ms << 80) | (_counter << 64) | _VERSION_AND_VARIANT | random_bits
    # UUID(int=...) re-validates what is valid by construction; this is what it stores.
    made = object.__new__(uuid.UUID)
    object.__setattr__(made, "int", value)
    object.__setattr__(made, "is_safe", _UNKNOWN_SAFETY)
    return made


def uuid7_time_ms(value: uuid.UUID) -> int:
    """The Unix time in milliseconds that a UUIDv7 carries."""
    return value.int >> 80


def instance_name() -> str:
    """A name unique per process and instance: host, pid and a random suffix (a relay
    worker's, a Redis group consumer's)."""
    import socket

    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
