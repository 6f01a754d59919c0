"""The RESP bytes of the Redis publisher's XADD commands, built by hand.

Hand-written for a measured need: redis-py's `pack_command` encodes every argument on
its own (an encoder call with its isinstance chain, a str -> bytes encode and a bytes
join per argument), which for the many arguments of a relaybox entry measured costlier
than the rest of a publish; here the whole command is one formatted string, two encodes
and a join (docs/benchmarks.md). The bytes are the ones redis-py would send for the
same `xadd` (a test holds it to that), the RESP of any client:

    *<n>\\r\\n $4\\r\\nXADD\\r\\n $<len>\\r\\n<key>\\r\\n [MAXLEN [~] <n>] $1\\r\\n*\\r\\n
    $<len>\\r\\n<field>\\r\\n $<len>\\r\\n<value>\\r\\n ...

Text is UTF-8, as redis-py's default encoder sends it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def bulk(text: str) -> str:
    """One RESP bulk string, as text (its length counted in UTF-8 bytes)."""
    size = len(text) if text.isascii() else len(text.encode())
    return f"${size}\r\n{text}\r\n"


def field_heads(names: Iterable[str]) -> dict[str, str]:
    """The RESP text of field names up to their value's `$`, for `xadd`'s `known`: made
    once for the names every entry has (a lookup instead of formatting each again)."""
    return {name: _head(name) for name in names}


def _head(name: str) -> str:
    return f"{bulk(name)}$"


def trim_options(maxlen: int | None, approximate: bool) -> tuple[int, str]:
    """XADD's trimming arguments: how many, and their RESP text."""
    if maxlen is None:
        return 0, ""
    words = ["MAXLEN", *(["~"] if approximate else []), str(maxlen)]
    return len(words), "".join(bulk(word) for word in words)


def xadd(key: str, trim: tuple[int, str], payload_field: str, payload: bytes,
         fields: Mapping[str, str], known: Mapping[str, str]) -> list[bytes]:  # fmt: skip
    """The pieces of `XADD key [trim] * payload_field payload name value ...`, to be
    joined with the other commands of a call.

    Raises UnicodeEncodeError for text UTF-8 cannot carry (a lone surrogate).
    """
    pairs = "".join([f"{known.get(n) or _head(n)}{len(v)}\r\n{v}\r\n" for n, v in fields.items()])
    if not pairs.isascii():  # the lengths above counted characters, not bytes
        pairs = "".join([bulk(name) + bulk(value) for name, value in fields.items()])
    count, options = trim
    head = (
        f"*{5 + count + 2 * len(fields)}\r\n$4\r\nXADD\r\n{bulk(key)}{options}$1\r\n*\r\n"
        f"{bulk(payload_field)}${len(payload)}\r\n"
    )
    return [head.encode(), payload, f"\r\n{pairs}".encode()]
