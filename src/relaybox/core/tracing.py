"""The writer's trace context, carried to the broker as `traceparent` (W3C Trace Context).

When opentelemetry-api is installed (`relaybox[tracing]`) and a span is current where a
`Message` is created, the message records that span's `traceparent` header; each
publisher then puts it on the wire, so a trace runs from the writer's request, through
the outbox, to the consumer. Without OpenTelemetry this costs one cached lookup.
"""

from __future__ import annotations

from collections.abc import Callable


def _first_lookup() -> str | None:
    global current_traceparent
    current_traceparent = _load()
    return current_traceparent()


#: The current span's `traceparent`, or None (no OpenTelemetry, or no valid span). The
#: first call imports OpenTelemetry, if installed, and puts the real lookup here, so
#: that later calls through `tracing.current_traceparent` cost one call, not two.
current_traceparent: Callable[[], str | None] = _first_lookup


def _no_trace() -> None:
    return None


def _load() -> Callable[[], str | None]:
    try:
        from opentelemetry import context, trace
    except ImportError:
        return _no_trace

    def lookup() -> str | None:
        current = context.get_current()
        # An empty context holds no span: the common case where opentelemetry-api is
        # installed (often as another package's dependency) but nothing is traced.
        # One call instead of the six that get_current_span() takes to say so.
        if not current:
            return None
        span = trace.get_current_span(current).get_span_context()
        if not span.is_valid:
            return None
        return f"00-{span.trace_id:032x}-{span.span_id:016x}-{span.trace_flags:02x}"

    return lookup
