"""OpenTelemetry traces and metrics, the Prometheus endpoint, NVML, and event logs.

The only package that imports opentelemetry. Everything here listens; nothing decides:

- `Metrics`, `Tracing` and `EventLog` are `SchedulerEvents` sinks (events.py). They are
  called by the scheduler's owner under its lock (or, for `request_finished`, on the
  event loop), so each call stays small: a count, a histogram sample, span bookkeeping;
  never a wait. Spans leave through the SDK's batch processor thread; the only I/O is a
  log line, aggregated (at most one per 10 s each) for refusals, sheds and failed
  requests, and rare for memory events.
- `Tracing` is also the service's `RequestTracer`: one `enqueue` span per queued request
  (admission to first dispatch) and one `reply` span (answer back on the event loop to
  encoded), both children of the gRPC server span that `ServerSpans` opens from the
  caller's W3C `traceparent`. Each batch gets a root `batch` span with a link to every
  request span it serves, and an `infer` child for the session run.
- `Telemetry` assembles them from the config and the standard `OTEL_*` variables:
  tracing only when `OTEL_TRACES_EXPORTER` names an exporter (default none: then no
  interceptor, no span, no per-request allocation), metrics only when something reads
  them (the Prometheus endpoint, or a reader a test passes in).

Modules: environment (the tracer provider and resource from `OTEL_*`) -> tracing
(request and batch spans, the batch-link sampler, the root sampler whose ratio
TraceSetting changes) and server_spans (the gRPC server interceptor) -> metrics
(instruments; the metric names are listed there), device (NVML) and endpoint
(Prometheus) -> logs (formatters, `EventLog`, the log threshold) -> assembly
(`Telemetry`).
"""

from laneserve.server.log_events import log_event
from laneserve.server.telemetry.assembly import Telemetry
from laneserve.server.telemetry.device import DeviceMonitor
from laneserve.server.telemetry.endpoint import MetricsEndpoint
from laneserve.server.telemetry.environment import tracer_provider_from_env
from laneserve.server.telemetry.logs import (
    EventLog,
    JsonFormatter,
    TextFormatter,
    configure_logging,
    log_format,
    set_log_level,
)
from laneserve.server.telemetry.metrics import Metrics, MetricSources
from laneserve.server.telemetry.server_spans import (
    HTTP_CALLER_LEFT,
    HttpServerSpans,
    ServerSpans,
)
from laneserve.server.telemetry.tracing import BatchLinkSampler, RatioSampler, Sampling, Tracing

__all__ = [
    "HTTP_CALLER_LEFT",
    "BatchLinkSampler",
    "DeviceMonitor",
    "EventLog",
    "HttpServerSpans",
    "JsonFormatter",
    "MetricSources",
    "Metrics",
    "MetricsEndpoint",
    "RatioSampler",
    "Sampling",
    "ServerSpans",
    "Telemetry",
    "TextFormatter",
    "Tracing",
    "configure_logging",
    "log_event",
    "log_format",
    "set_log_level",
    "tracer_provider_from_env",
]
