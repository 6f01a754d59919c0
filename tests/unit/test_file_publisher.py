"""The JSON-lines sinks write CloudEvents in structured mode, one line per message."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from relaybox.core.publishing import Outcome
from relaybox.errors import ConfigurationError
from relaybox.publishers import open_publisher
from tests.brokers.harness import stored


async def test_a_line_is_a_structured_cloudevent(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    publisher = open_publisher(f"file://{out}?source=orders-service")
    json_message = stored("orders", key="c-1", payload=b'{"total": 3}', headers={"x": "1"})
    binary = stored(
        "orders", key=None, payload=b"\xff\x00", content_type="application/octet-stream"
    )
    await publisher.start()
    results = await publisher.publish([json_message, binary])
    await publisher.close()
    assert [r.outcome for r in results] == [Outcome.ACKED, Outcome.ACKED]
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert first["id"] == str(json_message.id)
    assert first["source"] == "orders-service"
    assert first["subject"] == "c-1"
    assert first["data"] == {"total": 3}
    assert first["datacontenttype"] == "application/json"
    assert first["headers"] == {"x": "1"}
    assert first["sequence"] == str(json_message.seq)
    assert "subject" not in second
    assert second["data_base64"] == "/wA="


async def test_stdout_prints_one_line_per_message(capfd: pytest.CaptureFixture[str]) -> None:
    publisher = open_publisher("stdout://")
    await publisher.start()
    await publisher.publish([stored("orders", key="a"), stored("orders", key="b")])
    await publisher.close()
    lines = capfd.readouterr().out.splitlines()
    assert [json.loads(line)["subject"] for line in lines] == ["a", "b"]


def test_unknown_or_bad_options_are_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match="unknown file:// options: colour"):
        open_publisher("file:///tmp/x.jsonl?colour=red")
    with pytest.raises(ConfigurationError, match="delay"):
        open_publisher("file:///tmp/x.jsonl?delay=soon")
    with pytest.raises(ConfigurationError, match="no publisher for broker URL scheme 'gopher'"):
        open_publisher("gopher://x")


async def test_a_row_it_cannot_write_fails_alone(tmp_path: Path) -> None:
    """Rows `Message` would not have made (a header posing as an attribute, text that is
    not Unicode) used to raise out of publish(), failing the whole call."""
    out = tmp_path / "out.jsonl"
    publisher = open_publisher(f"file://{out}")
    posing, broken = stored("orders", headers={"id": "forged"}), stored("orders", key="\ud800")
    good = stored("orders")
    await publisher.start()
    results = await publisher.publish([posing, good, broken])
    await publisher.close()
    assert [r.outcome for r in results] == [Outcome.PERMANENT, Outcome.ACKED, Outcome.PERMANENT]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [str(good.id)]


@pytest.mark.parametrize(
    "payload",
    [b'{"half": "\\ud800"}', b"[" * 10_000 + b"]" * 10_000, b'"\xed\xa0\x80"'],
    ids=["half-a-surrogate-pair", "nested-10000-deep", "not-utf8"],
)
async def test_json_no_line_could_hold_travels_as_base64(tmp_path: Path, payload: bytes) -> None:
    """JSON whose data no UTF-8 line can hold (half a surrogate pair) or that nests too
    deep to decode and encode again used to raise out of publish(): it is the payload's
    bytes, as data_base64, like any payload that is not JSON."""
    out = tmp_path / "out.jsonl"
    publisher = open_publisher(f"file://{out}")
    await publisher.start()
    results = await publisher.publish([stored("orders", payload=payload)])
    await publisher.close()
    assert [r.outcome for r in results] == [Outcome.ACKED]
    (line,) = out.read_text().splitlines()
    assert base64.b64decode(json.loads(line)["data_base64"]) == payload


async def test_an_escaped_surrogate_pair_stays_json_data(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    publisher = open_publisher(f"file://{out}")
    await publisher.start()
    await publisher.publish([stored("orders", payload=b'{"emoji": "\\ud83d\\ude00"}')])
    await publisher.close()
    assert json.loads(out.read_text())["data"] == {"emoji": "😀"}
