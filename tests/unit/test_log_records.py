"""The log mode's message content: the rows table mode would insert, and back."""

from __future__ import annotations

import re
import uuid

import pytest

from relaybox import Message, MessageError, Target
from relaybox.core.log_records import (
    UnknownFormatError,
    decode_rows,
    encode_rows,
    log_prefix,
    log_slot,
)
from relaybox.core.records import Routing


def test_rows_come_back_as_they_went() -> None:
    routing = Routing.of(["default", Target("audit", external=True)], ["default"])
    batch = [
        Message(topic="orders", key="k1", payload={"a": "é\n"}, headers={"h": "v"},
                correlation_id=uuid.uuid4(), tenant_id="t", delay=1.5),
        Message(topic="orders", payload=b"\x00\xff\n1\n", targets=["default", "audit"]),
        Message(topic="empty", payload=b""),
    ]  # fmt: skip
    rows = routing.rows(batch)
    assert decode_rows(encode_rows(rows)) == rows


@pytest.mark.parametrize(
    "content",
    [b"", b"2\n[]\n", b"1\n[1]\n", b"1\nnot json\n", b"1\n[]\nleft over",
     b'1\n[["00","t",false,"x",null,1,"x","",5,"{}",null,null,null,null,"2024",0]]\n'],
)  # fmt: skip
def test_foreign_content_is_refused(content: bytes) -> None:
    with pytest.raises(MessageError):
        decode_rows(content)


def test_names_derive_from_the_table() -> None:
    assert log_prefix("app.outbox") == "relaybox:app.outbox"
    assert log_slot("relaybox_outbox") == "relaybox_relaybox_outbox"
    assert log_slot("app.outbox").startswith("relaybox_app__outbox_")
    # A schema's dot and a double underscore never share a slot.
    names = ["app.outbox", "app__outbox", "a.pp__outbox", "app__.outbox", "app__outbox_x"]
    slots = [log_slot(name) for name in names]
    assert len(set(slots)) == len(names)
    for slot in [*slots, log_slot("s" * 30 + "." + "t" * 41), log_slot("t" * 41)]:
        assert re.fullmatch(r"[a-z0-9_]{1,63}", slot), slot


def test_content_of_another_format_is_told_apart_from_foreign_content() -> None:
    with pytest.raises(UnknownFormatError, match="format 2"):
        decode_rows(b"2\n[]\n")
    for foreign in (b"1\nnot json\n", b"x\n[]\n", b"", b"12345678901\n[]\n"):
        with pytest.raises(MessageError) as raised:
            decode_rows(foreign)
        assert not isinstance(raised.value, UnknownFormatError)
