"""Payload classes: a JSON payload decoded into the handler's dataclass, validated field
by field, or into a pydantic-style model (anything with `model_validate_json`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

import pytest

from relaybox.core.incoming import Incoming
from relaybox.errors import EnvelopeError
from relaybox.inbox.payloads import decoder


@dataclasses.dataclass
class Line:
    sku: str
    quantity: int


@dataclasses.dataclass
class Order:
    order: str
    total: float
    lines: list[Line]
    channel: Literal["web", "shop"] = "web"
    note: str | None = None
    tags: dict[str, int] = dataclasses.field(default_factory=dict)
    pair: tuple[int, str] | None = None


def received(payload: Any) -> Incoming:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return Incoming.from_envelope({"id": "m1", "type": "Order"}, body)


GOOD = {"order": "o-1", "total": 30, "lines": [{"sku": "a", "quantity": 2}]}


def test_a_fitting_payload_becomes_the_dataclass() -> None:
    decode = decoder(Order)
    order = decode(received({**GOOD, "tags": {"x": 1}, "pair": [1, "b"], "channel": "shop"}))
    assert order == Order("o-1", 30.0, [Line("a", 2)], "shop", None, {"x": 1}, (1, "b"))
    assert isinstance(order.total, float)  # JSON's 30 is a float here


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ({**GOOD, "total": "30"}, "payload.total must be float, not str"),
        ({**GOOD, "lines": [{"sku": "a", "quantity": True}]}, "payload.lines[0].quantity"),
        ({**GOOD, "lines": [{"sku": "a"}]}, "payload.lines[0].quantity is missing"),
        ({**GOOD, "surprise": 1}, "unknown fields surprise"),
        ({"order": "o-1", "total": 1}, "payload.lines is missing"),
        ({**GOOD, "channel": "fax"}, "must be one of 'web', 'shop'"),
        ({**GOOD, "note": 5}, "payload.note fits none of str | null"),
        ({**GOOD, "pair": [1]}, "payload.pair fits none of"),
        ([GOOD], "payload must be a JSON object"),
        (b"{not json", "not JSON"),
    ],
)
def test_a_payload_that_does_not_fit_is_an_envelope_error(payload: Any, why: str) -> None:
    with pytest.raises(EnvelopeError, match="m1") as raised:
        decoder(Order)(received(payload))
    assert why in str(raised.value)


class Model:
    """Stands for a pydantic model: `model_validate_json`, a ValueError when invalid."""

    def __init__(self, order: str) -> None:
        self.order = order

    @classmethod
    def model_validate_json(cls, data: bytes) -> Model:
        fields = json.loads(data)
        if not isinstance(fields.get("order"), str):
            raise ValueError("order: field required")
        return cls(fields["order"])


def test_a_model_with_model_validate_json_validates_itself() -> None:
    assert decoder(Model)(received({"order": "o-9"})).order == "o-9"
    with pytest.raises(EnvelopeError, match="payload is no valid Model: order: field required"):
        decoder(Model)(received({"total": 1}))
