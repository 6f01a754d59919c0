"""Turning a payload into bytes plus a content type, once, at message creation."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from relaybox.errors import PayloadNotSerializableError, PayloadTooLargeError

JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
TEXT = "text/plain; charset=utf-8"

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024


def _json_default(value: Any) -> Any:
    """What the stdlib encoder cannot do alone, for the types services actually send."""
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID | decimal.Decimal):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    model_dump = getattr(value, "model_dump", None)  # pydantic v2
    if callable(model_dump):
        return model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _make_json_chunker() -> Callable[[Any, int], Sequence[str]]:
    """A compact, NaN-rejecting JSON encoder, built once: value, 0 -> text chunks.

    `json.dumps` and `JSONEncoder.encode` build a new C encoder on every call, which
    showed up as a measurable share of a writer transaction (docs/benchmarks.md).
    Without circular-reference markers the C encoder is reusable, so build it once and
    call it directly; a circular payload then fails with RecursionError, which is
    reported as not serialisable like any other bad payload.
    """
    c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
    if c_make_encoder is None:  # an interpreter without the C accelerator
        encode = json.JSONEncoder(
            default=_json_default, separators=(",", ":"), allow_nan=False
        ).encode
        return lambda value, _level: (encode(value),)
    chunker: Callable[[Any, int], Sequence[str]] = c_make_encoder(
        None,
        _json_default,
        json.encoder.encode_basestring_ascii,
        None,
        ":",
        ",",
        False,
        False,
        False,
    )
    return chunker


_json_chunks = _make_json_chunker()


def encode_payload(payload: Any, content_type: str | None) -> tuple[bytes, str]:
    """Encode `payload`: bytes pass through, str becomes UTF-8, anything else JSON."""
    if type(payload) is not dict:  # a dict is the common case: straight to JSON
        if isinstance(payload, bytes | bytearray | memoryview):
            return bytes(payload), content_type or OCTET_STREAM
        if isinstance(payload, str):
            try:
                return payload.encode("utf-8"), content_type or TEXT
            except UnicodeEncodeError as exc:
                raise PayloadNotSerializableError(
                    f"str payload is not valid Unicode: {exc}"
                ) from exc
    try:
        # The output is ASCII (non-ASCII characters are escaped), so the encode copies.
        body = "".join(_json_chunks(payload, 0)).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise PayloadNotSerializableError(
            f"payload of type {type(payload).__name__} cannot be serialised to JSON: {exc}; "
            "pass JSON-able data (dict, list, str, numbers, datetime, UUID, Decimal, "
            "dataclasses, pydantic models), bytes or str"
        ) from exc
    return body, content_type or JSON


def check_size(body: bytes, limit: int) -> None:
    if len(body) > limit:
        raise PayloadTooLargeError(
            f"payload is {len(body)} bytes, over the limit of {limit} bytes; "
            "store large data elsewhere and send a reference, or raise max_payload_bytes"
        )
