"""UUIDv7 message ids (RFC 9562).

Python gains `uuid.uuid7` only in 3.14. Ten lines here beat a dependency for 3.11-3.13:
a 48-bit millisecond clock, a 12-bit counter that keeps ids from one process strictly
increasing within a millisecond (method 1 of the RFC), and 62 random bits.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_counter = 0
_COUNTER_MAX = 0xFFF
# Random bits come from os.urandom in 4 KiB draws: one syscall per ~450 ids, not two per id.
_POOL_SIZE = 4096
_pool = b""
_pool_at = _POOL_SIZE


_UNKNOWN_SAFETY = uuid.SafeUUID.unknown


def uuid7() -> uuid.UUID:
    """A new time-ordered UUID, monotonic within this process."""
    global _last_ms, _counter, _pool, _pool_at
    with _lock:
        if _pool_at + 9 > _POOL_SIZE:
            _pool, _pool_at = os.urandom(_POOL_SIZE), 0
        entropy = _pool[_pool_at : _pool_at + 9]
        _pool_at += 9
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms = now_ms
            _counter = entropy[8]  # a random start, with headroom for the counter
        elif _counter < _COUNTER_MAX:
            _counter += 1
        else:  # 4096 ids in one millisecond: borrow the next millisecond
            _last_ms += 1
            _counter = 0
        timestamp, counter = _last_ms, _counter
    random_bits = int.from_bytes(entropy[:8], "big") & ((1 << 62) - 1)
    value = (timestamp << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | random_bits
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
