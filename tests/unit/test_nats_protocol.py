"""The NATS publisher's hand-built HPUB frames and its reading of JetStream replies.

The frames must be byte for byte what nats-py's own `publish()` sends for the same
subject, reply, headers and payload: that is read here from nats-py itself (a client
that is not connected buffers what it would send, as it does while reconnecting), so a
nats-py release that changes its encoding fails these tests instead of the wire.
"""

from __future__ import annotations

import sys

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import BadHeaderError, BadSubjectError

from relaybox.core.publishing import Outcome
from relaybox.core.records import StoredMessage
from relaybox.publishers import nats_protocol
from relaybox.publishers.nats import ack_result, header_block, wire_headers
from tests.brokers.harness import stored
from tests.unit.test_envelope import variants

SUBJECT = "orders.paid"
REPLY = "_INBOX.abcdefghijklmnopqrstuv.17"
WHITESPACE = "".join(c for c in map(chr, range(sys.maxunicode + 1)) if c.isspace())


async def nats_py_frame(subject: str, headers: dict[str, str], payload: bytes) -> bytes:
    """What nats-py's publish() hands to its send buffer for these arguments."""
    client = Client()
    client._max_pending_size = 1 << 24  # buffer while not connected, as when reconnecting
    await client.publish(subject, payload, reply=REPLY, headers=headers)
    return b"".join(client._pending)


def ours(subject: str, headers: dict[str, str], payload: bytes) -> bytes:
    nats_protocol.check_subject(subject)
    block = nats_protocol.header_block(headers)
    return b"".join(nats_protocol.hpub(subject, REPLY, block, payload))


HEADERS = [
    pytest.param({"a": "1"}, id="one"),
    pytest.param({"app": "naïve café", "emoji": "📦"}, id="non-ascii"),
    pytest.param({"a": "", "b": "x"}, id="empty-value"),
    pytest.param({"a": "colon:  two spaces", "b": "x: y"}, id="colons"),
    pytest.param({"a": "in\tside", "b": "nb\xa0sp", "c": "in\u2028side"}, id="space-inside"),
]
#: Values nats-py sends changed: stripped, their line breaks turned into spaces.
CHANGED = [
    pytest.param({"a": "  padded\t", "b": "\tx"}, id="untrimmed"),
    pytest.param({"a": "line\r\nInjected: yes", "b": "cr\ronly", "c": "lf\nonly"}, id="newlines"),
    pytest.param({"a": "x\r\n", "b": "\r\n"}, id="trailing-crlf"),
    pytest.param({"a": "ends\u2028", "b": "\x85starts", "c": "nb\xa0sp\xa0"}, id="unicode-space"),
    pytest.param({"a": f"{WHITESPACE}x{WHITESPACE}", "b": f"in{WHITESPACE}side"}, id="all-space"),
]


@pytest.mark.parametrize("headers", HEADERS)
async def test_frames_are_the_bytes_nats_py_sends(headers: dict[str, str]) -> None:
    payload = b'{"total": 3}'
    assert ours(SUBJECT, headers, payload) == await nats_py_frame(SUBJECT, headers, payload)


@pytest.mark.parametrize("headers", CHANGED)
async def test_a_value_nats_py_would_change_is_refused(headers: dict[str, str]) -> None:
    """nats-py would send these (changed); relaybox refuses them: "k" and "k " must not
    reach a consumer as one key."""
    frame = await nats_py_frame(SUBJECT, headers, b"")
    assert not all(f"{name}: {value}\r\n".encode() in frame for name, value in headers.items())
    with pytest.raises(BadHeaderError, match="changed"):
        ours(SUBJECT, headers, b"")


@pytest.mark.parametrize(
    "message",
    [
        stored("orders.paid", key="k1"),
        stored("orders.paid", key=None, headers={"traceparent": "00-ab-cd-01", "app": "é"}),
        stored("orders.paid", payload=b""),
    ],
)
async def test_a_relaybox_message_frames_as_nats_py_would(message: StoredMessage) -> None:
    headers = wire_headers(message, "relaybox")
    payload = message.payload
    assert ours(SUBJECT, headers, payload) == await nats_py_frame(SUBJECT, headers, payload)


def test_the_block_of_a_message_without_headers_is_that_of_its_wire_headers() -> None:
    """The shortcut for messages without headers of their own gives the same bytes."""
    checked = 0
    for message in variants():
        for source in ("relaybox", "shop"):
            expected = nats_protocol.header_block(wire_headers(message, source))
            assert header_block(message, source) == expected
            checked += not message.headers
    assert checked > 100


@pytest.mark.parametrize(
    "fields",
    [
        {"type": " padded "},
        {"key": "two\r\nlines"},
        {"correlation_id": "cr\ronly", "tenant_id": "lf\nonly"},
        {"content_type": "application/json\t"},
        {"key": ""},
        {"key": "clé", "type": "x\u00a0"},
        {"key": "ünïcode"},
    ],
)
async def test_a_value_to_clean_takes_the_careful_way(fields: dict[str, str]) -> None:
    """A stored row with an attribute NATS would change (`Message` refuses to make one)
    is refused by the careful way, never sent changed; one it keeps is sent as nats-py
    would send it."""
    message = stored(SUBJECT, **fields)
    headers = wire_headers(message, "relaybox")
    if any(value != value.strip() or "\r" in value or "\n" in value for value in headers.values()):
        with pytest.raises(BadHeaderError, match="changed"):
            header_block(message, "relaybox")
        return
    frame = b"".join(nats_protocol.hpub(SUBJECT, REPLY, header_block(message, "relaybox"), b"{}"))
    assert frame == await nats_py_frame(SUBJECT, headers, b"{}")


@pytest.mark.parametrize("name", ["bad name", "a:b", "é", "new\r\nline"])
async def test_a_name_nats_py_refuses_is_refused(name: str) -> None:
    headers = {"ok": "1", name: "x"}
    with pytest.raises(BadHeaderError):
        await nats_py_frame(SUBJECT, headers, b"")
    with pytest.raises(BadHeaderError):
        nats_protocol.header_block(headers)


@pytest.mark.parametrize("subject", ["", "bad subject", "tab\there", "cr\rlf\n"])
async def test_a_subject_nats_py_refuses_is_refused(subject: str) -> None:
    with pytest.raises(BadSubjectError):
        await nats_py_frame(subject, {"a": "1"}, b"")
    with pytest.raises(BadSubjectError):
        nats_protocol.check_subject(subject)


def test_the_header_frame_size_is_the_block_around_the_lines() -> None:
    assert len(nats_protocol.header_block({})) == nats_protocol.HEADER_FRAME


def reply(data: bytes, headers: dict[str, str] | None = None) -> Msg:
    return Msg(_client=None, subject=REPLY, data=data, headers=headers)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "plain"),
    [
        (b'{"stream":"ORDERS", "seq":1}', True),
        (b'{"stream":"ORDERS", "seq":2,"duplicate": true}', True),
        (b'{"stream":"ORDERS","seq":3,"domain":"hub"}', True),
        (
            b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"},'
            b'"stream":"ORDERS","seq":0}',
            False,
        ),
        (b'{"stream":"ORDERS","seq":0,"error":{"code":400,"description":"bad"}}', False),
        (b'{"stream":"ORDERS","domain":"error"}', False),  # an ack, but not recognised as plain
        (b"", False),
        (b"+OK", False),
    ],
)
def test_plain_acks_are_recognised_and_nothing_else(data: bytes, plain: bool) -> None:
    assert nats_protocol.is_plain_ack(data) is plain


@pytest.mark.parametrize(
    ("data", "headers", "outcome", "error"),
    [
        (b'{"stream":"ORDERS", "seq":1}', None, Outcome.ACKED, None),
        (b'{"stream":"ORDERS","domain":"error"}', None, Outcome.ACKED, None),
        (
            b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"},'
            b'"stream":"ORDERS","seq":0}',
            None,
            Outcome.TRANSIENT,
            "maximum messages",
        ),
        (
            b'{"stream":"ORDERS","seq":0,"error":{"code":400,"description":"bad"}}',
            None,
            Outcome.PERMANENT,
            "bad",
        ),
        (b"", {"Status": "503"}, Outcome.PERMANENT, "unroutable"),
        (b"not json", None, Outcome.TRANSIENT, "unreadable"),
    ],
)
def test_replies_are_read_as_before(
    data: bytes, headers: dict[str, str] | None, outcome: Outcome, error: str | None
) -> None:
    result = ack_result(reply(data, headers), SUBJECT)
    assert result.outcome is outcome
    assert (result.error is None) if error is None else (error in (result.error or ""))


@pytest.mark.parametrize("name", [" Nats-Msg-Id", "ce-id ", "\tce-type", "", "  "])
async def test_a_name_nats_py_would_strip_or_skip_is_refused(name: str) -> None:
    """Stripped, " Nats-Msg-Id" would be a second Nats-Msg-Id line (JetStream then
    takes one message for a copy of another); skipped, a header would vanish."""
    headers = {"Nats-Msg-Id": "real", name: "forged"}
    with pytest.raises(BadHeaderError):
        nats_protocol.header_block(headers)
