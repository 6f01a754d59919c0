"""The writer's settings and input, refused with a relaybox error before any I/O."""

from __future__ import annotations

import math
import sqlite3
from typing import Any

import pytest

from relaybox import ConfigurationError, MessageError, Outbox


@pytest.mark.parametrize("size", [0, -1, "x", 1.5, True])
def test_a_payload_limit_that_is_not_a_positive_integer_is_refused(size: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_payload_bytes"):
        Outbox(max_payload_bytes=size)


@pytest.mark.parametrize("interval", [math.inf, math.nan, -0.5])
def test_a_notify_interval_that_is_not_finite_and_positive_is_refused(interval: float) -> None:
    with pytest.raises(ConfigurationError, match="notify="):
        Outbox(notify=interval)


@pytest.mark.parametrize("given", [None, 42])
def test_adding_something_that_is_no_message_is_a_message_error(given: Any) -> None:
    with pytest.raises(MessageError, match=r"relaybox\.Message"):
        Outbox().add(sqlite3.connect(":memory:"), given)
