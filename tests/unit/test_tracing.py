"""A message created inside a span carries that span's traceparent to the broker."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from relaybox import Message


def _span() -> NonRecordingSpan:
    context = SpanContext(
        trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736,
        span_id=0x00F067AA0BA902B7,
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return NonRecordingSpan(context)


def test_a_message_inside_a_span_records_its_traceparent() -> None:
    with trace.use_span(_span()):
        message = Message(topic="orders", payload={})
    assert message.headers["traceparent"] == (
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    )


def test_an_explicit_traceparent_wins_and_no_span_adds_none() -> None:
    given = "00-11111111111111111111111111111111-2222222222222222-00"
    with trace.use_span(_span()):
        message = Message(topic="orders", payload={}, headers={"traceparent": given})
    assert message.headers["traceparent"] == given
    assert "traceparent" not in Message(topic="orders", payload={}).headers


def test_a_context_with_other_values_but_no_span_adds_none() -> None:
    from opentelemetry import baggage, context

    token = context.attach(baggage.set_baggage("user", "u-1"))
    try:
        assert "traceparent" not in Message(topic="orders", payload={}).headers
    finally:
        context.detach(token)
