"""The relay's activity warnings keep to one per interval, whatever succeeds between."""

from __future__ import annotations

import logging

import pytest

from relaybox.relay.activity import ActivityLog


def test_a_write_that_works_between_failures_does_not_let_a_second_warning_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = ActivityLog(every=300.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="relaybox.relay.activity"):
        log.failed("writing", RuntimeError("no table"))
        now[0] = 10.0
        log.succeeded()  # a write of the status alone
        now[0] = 20.0
        log.failed("writing", RuntimeError("no table"))
        log.failed("purging", RuntimeError("no table"))
        now[0] = 400.0
        log.failed("writing", RuntimeError("no table"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "(3 failure(s) since writing it last worked)" in warnings[1]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        "writing the relay's activity works again"
    ]
