"""The caller's trace context on every call: a caller's trace continues through laneserve.

Uses the globally configured OpenTelemetry propagators (W3C `traceparent` by default);
with no active span nothing is added.
"""

from __future__ import annotations

from opentelemetry import propagate


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current OpenTelemetry context, if any."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())
