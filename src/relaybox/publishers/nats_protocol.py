"""The NATS protocol bytes the JetStream publisher writes itself, and its PubAck check.

Hand-written for a measured need: nats-py's `publish()` builds the header block in a
Python loop of regex match, strip, translate and three `bytearray.extend` per header,
which for the dozen headers of a relaybox message measured costlier than the rest of a
publish, then queues a flush per message. Here a message's whole `HPUB` frame is one
join, and one publish() call hands all its frames to the client in one write
(docs/benchmarks.md). The bytes are the ones nats-py would send for the same subject,
reply, headers and payload (a test holds it to that, header by header), so the server
and every NATS client read them alike:

    HPUB <subject> <reply> <header bytes> <total bytes>\\r\\n
    NATS/1.0\\r\\n<name>: <value>\\r\\n ... \\r\\n<payload>\\r\\n

as nats-py 2.16 encodes headers: names must be RFC 7230 tokens (else `BadHeaderError`).
Where nats-py changes what it sends, this refuses (`BadHeaderError`) instead: a name
it would strip or skip (stripped, " Nats-Msg-Id" would become a second `Nats-Msg-Id`,
with which JetStream drops other messages as copies of one), and a value it would
strip or whose CR/LF it would turn into spaces (two keys, "k" and "k ", would reach a
consumer as one). `relaybox.core.envelope` and `Message` refuse such headers and
attributes long before: this is the last line.

A JetStream PubAck is JSON; most replies are `{"stream":"S","seq":N}`, and parsing
each with `json.loads` is a measurable cost per message. `is_plain_ack` recognises them
without a parse; anything else (an error, a status, an odd shape) goes to the full
reading.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from nats.errors import BadHeaderError, BadSubjectError

HEADER_LINE = "NATS/1.0\r\n"
#: What the NATS protocol puts around headers: the `NATS/1.0` line and CRLFs.
HEADER_FRAME = len(HEADER_LINE) + 2

#: RFC 7230 token characters: the header names nats-py and the server accept.
_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
#: What nats-py refuses in a subject it publishes to (the server judges the rest).
_BAD_SUBJECT = re.compile(r"[ \t\r\n]")

_ACK_START = b'{"stream":'
_ERROR_KEY = b'"error"'


def header_block(headers: Mapping[str, str]) -> bytes:
    """`NATS/1.0`, one `name: value` line per header, an empty line: nats-py's bytes.

    Raises `BadHeaderError` for a name that is not a token, as nats-py does, and for a
    name or value that nats-py would change (see the module docstring).
    """
    lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    tokens = all(headers) and _NAME.fullmatch("".join(headers)) is not None
    if not (tokens and _plain(lines, list(headers.values()))):
        lines = _careful_lines(headers)
    return f"{HEADER_LINE}{lines}\r\n".encode()


def block_of_lines(lines: str, values: list[str]) -> bytes | None:
    """The header block of `lines`, formatted as `header_block` does from names known
    to be tokens and these `values`, one line each; None if a value needs nats-py's
    cleaning (then `header_block` gives the block)."""
    return f"{HEADER_LINE}{lines}\r\n".encode() if _plain(lines, values) else None


def _plain(lines: str, values: list[str]) -> bool:
    """No value holds CR or LF, none has anything to strip: nats-py would send them as
    they are. Checked for a block at once: measured faster than a regex over it."""
    count = len(values)
    return (
        lines.count("\n") == count
        and lines.count("\r") == count
        and [value.strip() for value in values] == values
    )


def _careful_lines(headers: Mapping[str, str]) -> str:
    """nats-py's rules one header at a time, for the rare block the fast path refuses:
    what nats-py would change is refused (see the module docstring)."""
    lines = []
    for name, value in headers.items():
        if _NAME.fullmatch(name) is None:
            raise BadHeaderError(name)
        if value.strip().translate(_NEWLINES) != value:
            raise BadHeaderError(
                f"{name}: {value[:40]!r} would reach a consumer changed (NATS strips a "
                "header value and turns its line breaks into spaces)"
            )
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines)


def check_subject(subject: str) -> None:
    """Raises `BadSubjectError` for a subject nats-py would not publish to."""
    if not subject or _BAD_SUBJECT.search(subject):
        raise BadSubjectError


def hpub(subject: str, reply: str, block: bytes, payload: bytes) -> list[bytes]:
    """The pieces of one HPUB frame, to be joined with the other frames of a call."""
    size = len(block)
    head = f"HPUB {subject} {reply} {size} {size + len(payload)}\r\n".encode()
    return [head, block, payload, b"\r\n"]


def is_plain_ack(data: bytes) -> bool:
    """A PubAck with no error: `{"stream":...}` without an `"error"` key anywhere.

    A stream name cannot hide `"error"` (its quotes would be escaped), so a reply this
    accepts is an ack; one it refuses may still be one, and is parsed in full.
    """
    return data.startswith(_ACK_START) and _ERROR_KEY not in data
