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


def uuid7() -> uuid.UUID:
    """A new time-ordered UUID, monotonic within this process."""
    global _last_ms, _counter
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms = now_ms
            _counter = int.from_bytes(os.urandom(1), "big")  # headroom for the counter
        elif _counter < _COUNTER_MAX:
            _counter += 1
        else:  # 4096 ids in one millisecond: borrow the next millisecond
            _last_ms += 1
            _counter = 0
        timestamp, counter = _last_ms, _counter
    random_bits = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (timestamp << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | random_bits
    return uuid.UUID(int=value)


def uuid7_time_ms(value: uuid.UUID) -> int:
    """The Unix time in milliseconds that a UUIDv7 carries."""
    return value.int >> 80
