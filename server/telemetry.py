"""OpenTelemetry traces and metrics, the Prometheus endpoint, NVML, and event logs.

The only module that imports opentelemetry. Everything here listens; nothing decides:

- `Metrics`, `Tracing` and `EventLog` are `SchedulerEvents` sinks (events.py). They are
  called by the scheduler's owner under its lock (or, for `request_finished`, on the
  event loop), so each call stays small: a count, a histogram sample, span bookkeeping;
  never a wait. Spans leave through the SDK's batch processor thread; the only I/O is a
  log line, rate-limited for refusals and rare for memory events.
- `Tracing` is also the service's `RequestTracer`: one `enqueue` span per queued request
  (admission to first dispatch) and one `reply` span (answer back on the event loop to
  encoded), both children of the gRPC server span that `ServerSpans` opens from the
  caller's W3C `traceparent`. Each batch gets a root `batch` span with a link to every
  request span it serves, and an `infer` child for the session run.
- `Telemetry` assembles them from the config and the standard `OTEL_*` variables:
  tracing only when `OTEL_TRACES_EXPORTER` names an exporter (default none: then no
  interceptor, no span, no per-request allocation), metrics only when something reads
  them (the Prometheus endpoint, or a reader a test passes in).

Metric names (OpenTelemetry; Prometheus adds the unit and `_total`, e.g.
`laneserve.queue.wait` is scraped as `laneserve_queue_wait_seconds_bucket`):

    laneserve.queue.wait          histogram s       lane           admission to dispatch
    laneserve.batch.size          histogram rows                   rows per batch run
    laneserve.infer.duration      histogram s       status         session time per run
    laneserve.request.duration    histogram s       lane, status   arrival to answer
    laneserve.requests.admitted   counter           lane
    laneserve.requests.rejected   counter           lane, reason   refused at admission
    laneserve.requests.shed       counter           lane, reason   dropped after admission
    laneserve.requests.completed  counter           lane, status   every admitted request's end
    laneserve.batches             counter           reason, status dispatch reason, outcome
    laneserve.device.out_of_memory counter                         runs out of device memory
    laneserve.batch.splits        counter                          failed runs split in halves
    laneserve.batch.cap.changes   counter           reason         out_of_memory / recovered
    laneserve.lane.depth          gauge rows        lane           queued rows now
    laneserve.lane.capacity       gauge rows        lane
    laneserve.batch.cap           gauge rows                       largest batch formed now
    laneserve.device.memory.used  gauge By                         at the last reading
    laneserve.device.memory.budget gauge By                        the memory limit
    laneserve.device.utilization  gauge 1                          NVML; absent without a GPU
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc
import prometheus_client
from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry import trace as otel_trace
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import Attributes

from laneserve.server.config import ConfigError, LaneConfig, ServerConfig
from laneserve.server.engine import CUDA
from laneserve.server.errors import LaneserveError
from laneserve.server.events import NULL_TRACE, RequestTrace, SchedulerEvents
from laneserve.server.items import Batch
from laneserve.server.scheduler import LaneDepth

log = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "laneserve"

# Bucket boundaries. Times: from a fraction of a millisecond (an interactive batch on a
# GPU) to the bulk lane's two-minute timeout, roughly 1-2-5 per decade. Sizes: powers
# of two, the sizes the probe measures and batch caps usually are.
SECONDS_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
    60.0, 120.0,
)  # fmt: skip
ROWS_BUCKETS: tuple[float, ...] = tuple(float(1 << power) for power in range(15))

# gRPC methods that get a server span: the inference path. GetStats is polled (by
# `laneserve top`, every second) and would drown the traces that matter.
TRACED_METHODS = frozenset(
    {"/laneserve.v1.InferenceService/Infer", "/laneserve.v1.InferenceService/InferStream"}
)
# Server span status is Error only for these codes (OpenTelemetry's RPC conventions):
# the others describe the caller's request, not a server fault.
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
# Request ends that are not failures of the request's own span.
_NOT_ERRORS = frozenset({"OK", "CANCELLED"})

# Refusals are logged in aggregate: the first at once, then at most one line per interval.
REFUSAL_LOG_INTERVAL_S = 10.0


# ---- configuration from the environment -----------------------------------------------


def _exporter_entry_point(name: str, environ: Mapping[str, str]) -> tuple[str, str]:
    """The entry point in `opentelemetry_traces_exporter` for an OTEL_TRACES_EXPORTER name,
    and the package that provides it."""
    if name != "otlp":
        package = {
            "otlp_proto_grpc": "opentelemetry-exporter-otlp-proto-grpc",
            "otlp_proto_http": "opentelemetry-exporter-otlp-proto-http",
        }.get(name, f"the package that provides the {name!r} exporter")
        return name, package
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if protocol == "grpc":
        return "otlp_proto_grpc", "opentelemetry-exporter-otlp-proto-grpc"
    if protocol == "http/protobuf":
        return "otlp_proto_http", "opentelemetry-exporter-otlp-proto-http"
    raise ConfigError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL: expected grpc or http/protobuf, got {protocol!r}"
    )


def _load_exporter(name: str, environ: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    entry_name, package = _exporter_entry_point(name, environ)
    found = importlib.metadata.entry_points(group="opentelemetry_traces_exporter", name=entry_name)
    if not found:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={name}: no span exporter {entry_name!r} is installed; "
            f"install {package}, or set OTEL_TRACES_EXPORTER to console or none"
        )
    exporter_class = next(iter(found)).load()
    exporter = exporter_class()
    if not isinstance(exporter, SpanExporter):
        raise ConfigError(f"OTEL_TRACES_EXPORTER={name}: {exporter_class!r} is not a span exporter")
    return exporter


def tracer_provider_from_env(environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """The tracer provider the standard variables ask for, or None: tracing off.

    `OTEL_TRACES_EXPORTER`: comma-separated exporters, `none` (the default here, unlike
    the SDK's own), `console`, `otlp` (protocol from `OTEL_EXPORTER_OTLP_PROTOCOL`, grpc
    by default; endpoint, headers and the rest from `OTEL_EXPORTER_OTLP_*`, read by the
    exporter itself) or any installed exporter's entry point name. `OTEL_SDK_DISABLED=true`
    turns tracing off. Sampling: `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`; batch
    spans are sampled whenever a request they serve is (see `BatchLinkSampler`).
    """
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [
        name.strip().lower()
        for name in environ.get("OTEL_TRACES_EXPORTER", "none").split(",")
        if name.strip()
    ]
    names = [name for name in names if name != "none"]
    if not names:
        return None
    exporters = [_load_exporter(name, environ) for name in names]
    provider = TracerProvider(resource=_resource())
    # The sampler the variables chose, wrapped before any tracer exists (tracers copy it).
    provider.sampler = BatchLinkSampler(provider.sampler)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _resource() -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME, with service.name laneserve by default."""
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "laneserve"}))
    return resource


class BatchLinkSampler(Sampler):
    """Samples a `batch` span whenever one of the request spans it links to is sampled;
    everything else as `inner` decides.

    A batch span is a root (it serves many traces), so a ratio sampler alone would keep
    it independently of its requests, and a sampled request would usually lose it.
    """

    def __init__(self, inner: Sampler) -> None:
        self._inner = inner

    def should_sample(
        self,
        parent_context: otel_context.Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: otel_trace.TraceState | None = None,
    ) -> SamplingResult:
        if name == "batch" and any(link.context.trace_flags.sampled for link in links or ()):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self._inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"BatchLinkSampler{{{self._inner.get_description()}}}"


# ---- traces ------------------------------------------------------------------------------


class _RequestSpans:
    """One request's `enqueue` and `reply` spans (a `RequestTrace`).

    `enqueue` runs from admission to the request's first dispatch (its queue wait), or to
    its end when it never ran (refused, expired, cancelled, shut down), and then carries
    that status. `reply` runs from the answer's return to the event loop to its encoding.
    Dispatch comes from the scheduler thread, the rest from the event loop: the lock
    makes ending `enqueue` happen once.
    """

    __slots__ = ("_enqueue_open", "_lock", "_parent", "_reply", "_tracer", "enqueue")

    def __init__(self, tracer: otel_trace.Tracer, attributes: Attributes) -> None:
        self._tracer = tracer
        # The gRPC server span, where the servicer runs: the parent of both spans.
        self._parent = otel_context.get_current()
        self.enqueue = tracer.start_span("enqueue", context=self._parent, attributes=attributes)
        self._reply: otel_trace.Span | None = None
        self._lock = threading.Lock()
        self._enqueue_open = True

    def dispatched(self) -> None:
        self._end_enqueue(None)

    def replying(self) -> None:
        self._reply = self._tracer.start_span("reply", context=self._parent)

    def end(self, status: str) -> None:
        self._end_enqueue(status)
        if self._reply is not None:
            _set_request_status(self._reply, status)
            self._reply.end()

    def _end_enqueue(self, status: str | None) -> None:
        with self._lock:
            if not self._enqueue_open:
                return
            self._enqueue_open = False
        if status is not None:
            _set_request_status(self.enqueue, status)
        self.enqueue.end()


def _set_request_status(span: otel_trace.Span, status: str) -> None:
    span.set_attribute("laneserve.status", status)
    if status not in _NOT_ERRORS:
        span.set_status(Status(StatusCode.ERROR, status))


class Tracing:
    """The service's `RequestTracer`, and a `SchedulerEvents` sink for batch spans."""

    def __init__(
        self,
        tracer: otel_trace.Tracer,
        lanes: Sequence[LaneConfig],
        providers: Sequence[str],
    ) -> None:
        self._tracer = tracer
        self._lane_timeout_s = {lane.name: lane.timeout_ms / 1000 for lane in lanes}
        self._providers = tuple(providers)
        # Open batch spans by batch id. Only the scheduler's owner touches it (under its
        # lock), and `close` once the scheduler has stopped.
        self._batches: dict[int, otel_trace.Span] = {}

    # RequestTracer
    def start(self, request_id: str, lane: str, rows: int, budget_s: float | None) -> RequestTrace:
        server_span = otel_trace.get_current_span()
        if server_span.get_span_context().is_valid and not server_span.is_recording():
            # Its trace was not sampled: the request's spans would be dropped too (the
            # samplers decide per trace), and even a dropped span costs the SDK ~8 us.
            return NULL_TRACE
        lane_timeout_s = self._lane_timeout_s.get(lane)
        # The effective deadline, as the scheduler will compute it at admission.
        candidates = [s for s in (budget_s, lane_timeout_s) if s is not None]
        attributes: dict[str, str | int | float] = {"laneserve.lane": lane, "laneserve.rows": rows}
        if request_id:
            attributes["laneserve.request_id"] = request_id
        if candidates:
            attributes["laneserve.deadline_ms"] = round(min(candidates) * 1000, 3)
        return _RequestSpans(self._tracer, attributes)

    # SchedulerEvents
    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float]) -> None:
        requests = [
            (piece, piece.trace) for piece in batch.slices if isinstance(piece.trace, _RequestSpans)
        ]
        for _, spans in requests:
            spans.dispatched()  # its first batch ends its queue wait; later ones are no-ops
        if not any(spans.enqueue.get_span_context().trace_flags.sampled for _, spans in requests):
            return  # no traced request in it: a batch span would link to nothing kept
        links = [
            Link(
                spans.enqueue.get_span_context(),
                {
                    "laneserve.lane": piece.lane,
                    "laneserve.rows": piece.rows,
                    "laneserve.row_start": piece.row_start,
                },
            )
            for piece, spans in requests
        ]
        lanes = sorted({piece.lane for piece in batch.slices})
        # Links past the SDK's limit (OTEL_SPAN_LINK_COUNT_LIMIT, 128 by default) are
        # dropped by the SDK and counted on the span; `requests` keeps the true number.
        self._batches[batch.batch_id] = self._tracer.start_span(
            "batch",
            context=otel_context.Context(),  # a root: it serves many traces
            links=links,
            attributes={
                "laneserve.batch.id": batch.batch_id,
                "laneserve.batch.size": batch.rows,
                "laneserve.batch.requests": len(batch.slices),
                "laneserve.batch.lanes": lanes,
                "laneserve.batch.lanes_mixed": len(lanes) > 1,
                "laneserve.batch.wait_reason": batch.reason.value,
                "laneserve.batch.max_queue_wait_ms": round(max(queue_waits_s, default=0) * 1e3, 3),
            },
        )

    def batch_done(self, batch: Batch, run_s: float, error: LaneserveError | None) -> None:
        span = self._batches.pop(batch.batch_id, None)
        if span is None:
            return
        # The run is over: its span is placed `run_s` back from now (the engine measured
        # it; this thread learns of it a moment after it ended).
        end_ns = time.time_ns()
        infer = self._tracer.start_span(
            "infer",
            context=otel_trace.set_span_in_context(span),
            start_time=end_ns - round(run_s * 1e9),
            attributes={
                "laneserve.batch.size": batch.rows,
                "laneserve.infer.duration_ms": round(run_s * 1e3, 3),
                "laneserve.infer.providers": self._providers,
            },
        )
        if error is not None:
            for failed in (infer, span):
                failed.set_attribute("laneserve.status", error.reason)
                failed.set_status(Status(StatusCode.ERROR, error.reason))
        infer.end(end_time=end_ns)
        span.end(end_time=end_ns)

    def close(self) -> None:
        """Ends the spans of batches that never finished (the server stopped)."""
        for span in self._batches.values():
            span.set_attribute("laneserve.status", "DRAINING")
            span.end()
        self._batches.clear()

    def admitted(self, lane: str, rows: int) -> None:
        pass

    def rejected(self, lane: str, reason: str) -> None:
        pass

    def shed(self, lane: str, reason: str, rows: int) -> None:
        pass

    def completed(self, lane: str, status: str) -> None:
        pass

    def out_of_memory(self, rows: int) -> None:
        pass

    def batch_split(self, rows: int) -> None:
        pass

    def cap_changed(self, old_rows: int, new_rows: int, reason: str) -> None:
        pass

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        pass

    def request_finished(self, lane: str, status: str, duration_s: float) -> None:
        pass


# The servicer's method (grpc's stubs type it as a synchronous one).
_Behavior = Callable[..., Any]


class ServerSpans(grpc.aio.ServerInterceptor):
    """Opens a SERVER span around each traced RPC, as a child of the caller's W3C
    `traceparent` (any propagator `OTEL_PROPAGATORS` names), current while the servicer
    runs, so the request's own spans become its children.

    Written here rather than taken from opentelemetry-instrumentation-grpc: its asyncio
    interceptor leaves the status code at OK when the handler raises or the caller
    cancels, and it wraps the servicer context in a proxy. This one reads the final
    code from the context (set by `abort`), maps an exception to UNKNOWN and a
    cancellation to CANCELLED or DEADLINE_EXCEEDED, as gRPC itself answers them.
    """

    def __init__(self, tracer: otel_trace.Tracer, methods: frozenset[str] = TRACED_METHODS) -> None:
        self._tracer = tracer
        self._methods = methods

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._methods:
            return handler
        carrier = {
            key: value
            for key, value in handler_call_details.invocation_metadata or ()
            if isinstance(value, str)
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, carrier, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(method, carrier, handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # no such method in the traced service

    def _start(self, method: str, carrier: Mapping[str, str]) -> otel_trace.Span:
        service, _, name = method.lstrip("/").partition("/")
        return self._tracer.start_span(
            method.lstrip("/"),
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )

    def _unary(
        self, method: str, carrier: Mapping[str, str], behavior: _Behavior
    ) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
        async def traced(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            span = self._start(method, carrier)
            token = otel_context.attach(otel_trace.set_span_in_context(span))
            error: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as raised:
                error = raised
                raise
            finally:
                _end_server_span(span, context, error)
                otel_context.detach(token)

        return traced

    def _streaming(
        self, method: str, carrier: Mapping[str, str], behavior: _Behavior
    ) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]:
        async def traced(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            span = self._start(method, carrier)
            token = otel_context.attach(otel_trace.set_span_in_context(span))
            error: BaseException | None = None
            try:
                async for response in behavior(requests, context):
                    yield response
            except BaseException as raised:
                error = raised
                raise
            finally:
                _end_server_span(span, context, error)
                otel_context.detach(token)

        return traced


def _end_server_span(
    span: otel_trace.Span, context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None
) -> None:
    """Records the status the caller receives, as gRPC decides it."""
    remaining_s: float | None = context.time_remaining()  # None: no deadline
    if remaining_s is not None and remaining_s <= 0:
        # gRPC ended the call at its deadline, whatever the handler did after (an abort
        # then fails inside gRPC): the caller gets DEADLINE_EXCEEDED.
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    elif error is None or isinstance(error, grpc.aio.AbortError):
        # abort() set the code it answers with; None (typeshed says otherwise) when not set.
        set_code: grpc.StatusCode | None = context.code()
        code = grpc.StatusCode.OK if set_code is None else set_code
    elif not isinstance(error, Exception):
        code = grpc.StatusCode.CANCELLED  # asyncio.CancelledError, GeneratorExit: caller left
    else:
        span.record_exception(error)
        code = grpc.StatusCode.UNKNOWN  # what gRPC answers for an unhandled exception
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


# ---- metrics -------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Sources:
    """What the gauges read at collection time; set once the scheduler thread exists."""

    depths: Callable[[], Sequence[LaneDepth]]
    batch_cap: Callable[[], int]


# Counter name, description, and the attribute names of its keys.
_COUNTERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("laneserve.requests.admitted", "Requests admitted", ("lane",)),
    ("laneserve.requests.rejected", "Requests refused at admission, by reason", ("lane", "reason")),
    (
        "laneserve.requests.shed",
        "Admitted requests dropped without running, by reason",
        ("lane", "reason"),
    ),
    (
        "laneserve.requests.completed",
        "Admitted requests ended, by status (OK or the error's reason)",
        ("lane", "status"),
    ),
    ("laneserve.batches", "Batches run, by dispatch reason and status", ("reason", "status")),
    ("laneserve.device.out_of_memory", "Runs that failed for lack of device memory", ()),
    ("laneserve.batch.splits", "Failed runs split in halves and retried", ()),
    (
        "laneserve.batch.cap.changes",
        "Batch cap moves: out_of_memory (lowered), recovered (raised)",
        ("reason",),
    ),
)


class Metrics:
    """A `SchedulerEvents` sink that records OpenTelemetry instruments.

    The SDK spends 10-20 us on each synchronous measurement, so only the histograms are
    recorded as events happen (two per request, two per batch). Counters are plain
    integers here, which the SDK reads through observable counters when a reader
    collects (a Prometheus scrape), as it reads the gauges: nothing between scrapes.
    The counts are written only by the scheduler's owner, under its lock; a reader
    copies each dict whole (one C call, atomic under the GIL).
    """

    def __init__(self, meter: Meter, device: DeviceMonitor | None = None) -> None:
        self._sources: _Sources | None = None
        self._device = device
        self._memory: tuple[int, int | None] | None = None  # (used, budget) bytes
        self._lane_attributes: dict[str, dict[str, str]] = {}
        # Counter name -> attribute values -> count.
        self._counts: dict[str, dict[tuple[str, ...], int]] = {name: {} for name, *_ in _COUNTERS}
        self._queue_wait = meter.create_histogram(
            "laneserve.queue.wait",
            unit="s",
            description="Time from admission to dispatch in a batch, per lane",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self._batch_size = meter.create_histogram(
            "laneserve.batch.size",
            unit="{row}",
            description="Rows per batch run",
            explicit_bucket_boundaries_advisory=ROWS_BUCKETS,
        )
        self._infer = meter.create_histogram(
            "laneserve.infer.duration",
            unit="s",
            description="Session time of one batch run",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self._request = meter.create_histogram(
            "laneserve.request.duration",
            unit="s",
            description="Arrival in the server to answer, per lane and final status",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        for name, description, keys in _COUNTERS:
            meter.create_observable_counter(
                name,
                callbacks=[self._counter_callback(name, keys)],
                unit="{event}",
                description=description,
            )
        meter.create_observable_gauge(
            "laneserve.lane.depth",
            callbacks=[self._observe_depth],
            unit="{row}",
            description="Rows queued in the lane",
        )
        meter.create_observable_gauge(
            "laneserve.lane.capacity",
            callbacks=[self._observe_capacity],
            unit="{row}",
            description="Rows the lane holds at most",
        )
        meter.create_observable_gauge(
            "laneserve.batch.cap",
            callbacks=[self._observe_cap],
            unit="{row}",
            description="Largest batch the scheduler forms now",
        )
        meter.create_observable_gauge(
            "laneserve.device.memory.used",
            callbacks=[self._observe_memory_used],
            unit="By",
            description="Device memory in use at the last reading",
        )
        meter.create_observable_gauge(
            "laneserve.device.memory.budget",
            callbacks=[self._observe_memory_budget],
            unit="By",
            description="The device memory limit (budget)",
        )
        if device is not None:
            # Registered only with a GPU in use: absent, not zero, without one.
            meter.create_observable_gauge(
                "laneserve.device.utilization",
                callbacks=[self._observe_utilization],
                unit="1",
                description="GPU utilisation over NVML's last sample period, in [0, 1]",
            )

    def observe(
        self, depths: Callable[[], Sequence[LaneDepth]], batch_cap: Callable[[], int]
    ) -> None:
        self._sources = _Sources(depths, batch_cap)

    def _lane(self, lane: str) -> dict[str, str]:
        attributes = self._lane_attributes.get(lane)
        if attributes is None:
            attributes = self._lane_attributes.setdefault(lane, {"lane": lane})
        return attributes

    def _count(self, name: str, *key: str) -> None:
        counts = self._counts[name]
        counts[key] = counts.get(key, 0) + 1

    def _counter_callback(
        self, name: str, keys: tuple[str, ...]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            counts = dict(self._counts[name])
            return [
                Observation(count, dict(zip(keys, values, strict=True)))
                for values, count in counts.items()
            ]

        return observe

    # SchedulerEvents
    def admitted(self, lane: str, rows: int) -> None:
        self._count("laneserve.requests.admitted", lane)

    def rejected(self, lane: str, reason: str) -> None:
        self._count("laneserve.requests.rejected", lane, reason)

    def shed(self, lane: str, reason: str, rows: int) -> None:
        self._count("laneserve.requests.shed", lane, reason)

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float]) -> None:
        for piece, wait_s in zip(batch.slices, queue_waits_s, strict=True):
            self._queue_wait.record(wait_s, self._lane(piece.lane))

    def batch_done(self, batch: Batch, run_s: float, error: LaneserveError | None) -> None:
        status = "OK" if error is None else error.reason
        self._batch_size.record(batch.rows)
        self._infer.record(run_s, {"status": status})
        self._count("laneserve.batches", batch.reason.value, status)

    def completed(self, lane: str, status: str) -> None:
        self._count("laneserve.requests.completed", lane, status)

    def request_finished(self, lane: str, status: str, duration_s: float) -> None:
        self._request.record(duration_s, {"lane": lane, "status": status})

    def out_of_memory(self, rows: int) -> None:
        self._count("laneserve.device.out_of_memory")

    def batch_split(self, rows: int) -> None:
        self._count("laneserve.batch.splits")

    def cap_changed(self, old_rows: int, new_rows: int, reason: str) -> None:
        self._count("laneserve.batch.cap.changes", reason)

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        self._memory = (used_bytes, budget_bytes)  # one assignment: readers see a pair

    # gauges, called by the reader's thread at collection
    def _observe_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        if self._sources is None:
            return []
        return [
            Observation(depth.queued_rows, self._lane(depth.name))
            for depth in self._sources.depths()
        ]

    def _observe_capacity(self, options: CallbackOptions) -> Iterable[Observation]:
        if self._sources is None:
            return []
        return [
            Observation(depth.capacity_rows, self._lane(depth.name))
            for depth in self._sources.depths()
        ]

    def _observe_cap(self, options: CallbackOptions) -> Iterable[Observation]:
        return [] if self._sources is None else [Observation(self._sources.batch_cap())]

    def _observe_memory_used(self, options: CallbackOptions) -> Iterable[Observation]:
        memory = self._memory
        return [] if memory is None else [Observation(memory[0])]

    def _observe_memory_budget(self, options: CallbackOptions) -> Iterable[Observation]:
        memory = self._memory
        return [] if memory is None or memory[1] is None else [Observation(memory[1])]

    def _observe_utilization(self, options: CallbackOptions) -> Iterable[Observation]:
        assert self._device is not None
        utilization = self._device.utilization()
        return [] if utilization is None else [Observation(utilization)]


class DeviceMonitor:
    """GPU utilisation from NVML, for the GPU the session runs on.

    NVML numbers GPUs physically; CUDA numbers the ones CUDA_VISIBLE_DEVICES lists, and
    the session uses CUDA's device 0, so that is the first entry there (an index or a
    UUID), or NVML's device 0 when the variable is unset.
    """

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle

    @classmethod
    def open(cls, providers: Sequence[str]) -> DeviceMonitor | None:
        """The monitor, or None when the session is not on a GPU or NVML cannot be used."""
        if CUDA not in providers:
            return None
        try:
            import pynvml  # noqa: PLC0415 - only where a GPU is in use

            pynvml.nvmlInit()
        except Exception as error:  # noqa: BLE001 - any NVML failure: no utilisation figure
            log.warning("NVML unavailable, no device utilisation: %s", error)
            return None
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        try:
            if first.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        except pynvml.NVMLError as error:
            log.warning("NVML cannot open GPU %r, no device utilisation: %s", first, error)
            pynvml.nvmlShutdown()
            return None
        return cls(pynvml, handle)

    def utilization(self) -> float | None:
        try:
            return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu) / 100
        except self._nvml.NVMLError:
            return None

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


class MetricsEndpoint:
    """The Prometheus scrape endpoint (HTTP GET /metrics) over one registry."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, host: str, port: int) -> None:
        address = host.strip("[]")  # "[::]" as gRPC writes it
        try:
            self._server, self._thread = prometheus_client.start_http_server(
                port, addr=address, registry=registry
            )
        except OSError as error:
            raise OSError(
                f"cannot serve metrics on {host}:{port}: {error.strerror or error}; choose "
                f"another --metrics-port (0: any free port, -1: no endpoint)"
            ) from error
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


# ---- logs ------------------------------------------------------------------------------------


def log_event(logger: logging.Logger, level: int, event: str, message: str, **fields: Any) -> None:
    """One log line for one event: `message` for people, `fields` for machines (rendered
    as key=value in text, as JSON members with --log-format json)."""
    logger.log(level, message, extra={"event": event, "fields": fields})


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields: Mapping[str, Any] = getattr(record, "fields", {})
        if not fields:
            return line
        head, newline, rest = line.partition("\n")  # a traceback stays below
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        return f"{head} {pairs}{newline}{rest}"


def _text_value(value: Any) -> str:
    if not isinstance(value, str):
        return json.dumps(value, default=str, separators=(",", ":"))
    return json.dumps(value) if value == "" or any(c.isspace() for c in value) else value


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, event, message and
    the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
        }
        event = getattr(record, "event", None)
        if event is not None:
            document["event"] = event
        document["message"] = record.getMessage()
        document.update(getattr(record, "fields", {}))
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


def configure_logging(level: str, *, json_lines: bool = False) -> None:
    """The process's log handler: one line per event on stderr, text or JSON."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)


class EventLog:
    """A `SchedulerEvents` sink for the events an operator must hear of unasked.

    Refusals come in bursts of thousands, so they are logged in aggregate: the first at
    once, then at most one line per `interval_s` with the counts by lane and reason (the
    last burst is flushed by the next event after the interval, or by `close`). Out of
    memory and each move of the batch cap are logged as they happen; they are rare by
    construction (the cap halves on each).
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_batch_size = max_batch_size
        self._interval_s = interval_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._refused: dict[str, int] = {}
        self._window_start_s = monotonic()
        self._last_line_s = -float("inf")

    def rejected(self, lane: str, reason: str) -> None:
        key = f"{lane}/{reason}"
        with self._lock:
            self._refused[key] = self._refused.get(key, 0) + 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self._refused and self._monotonic() - self._last_line_s >= self._interval_s:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._refused:
                return
            refused, self._refused = self._refused, {}
            now_s = self._monotonic()
            window_s = now_s - self._window_start_s
            self._window_start_s = self._last_line_s = now_s
        log_event(
            log,
            logging.WARNING,
            "admission_refused",
            f"admission refused {sum(refused.values())} requests in {window_s:.1f}s",
            refused=refused,
            window_s=round(window_s, 3),
        )

    def admitted(self, lane: str, rows: int) -> None:
        self._maybe_flush()

    def batch_done(self, batch: Batch, run_s: float, error: LaneserveError | None) -> None:
        self._maybe_flush()

    def out_of_memory(self, rows: int) -> None:
        log_event(
            log,
            logging.WARNING,
            "out_of_memory",
            f"out of device memory running {rows} rows; splitting and retrying",
            rows=rows,
        )

    def cap_changed(self, old_rows: int, new_rows: int, reason: str) -> None:
        lowered = new_rows < old_rows
        if lowered:
            message = f"batch cap lowered {old_rows} -> {new_rows} ({reason})"
        elif new_rows >= self._max_batch_size:
            message = f"batch cap recovered {old_rows} -> {new_rows} (max_batch_size)"
        else:
            message = f"batch cap raised {old_rows} -> {new_rows} ({reason})"
        log_event(
            log,
            logging.WARNING if lowered else logging.INFO,
            "batch_cap_changed",
            message,
            old_rows=old_rows,
            new_rows=new_rows,
            reason=reason,
        )

    def shed(self, lane: str, reason: str, rows: int) -> None:
        pass

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float]) -> None:
        pass

    def completed(self, lane: str, status: str) -> None:
        pass

    def batch_split(self, rows: int) -> None:
        pass

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        pass

    def request_finished(self, lane: str, status: str, duration_s: float) -> None:
        pass


# ---- assembly ----------------------------------------------------------------------------------


class Telemetry:
    """Everything above for one server: build it, hand its parts to the server, close it.

    telemetry = Telemetry.from_config(config, engine.providers)
    sinks = telemetry.events                 # SchedulerEvents sinks
    tracer = telemetry.tracer                # RequestTracer, or None: tracing off
    interceptors = telemetry.interceptors    # for grpc.aio.server
    telemetry.observe(thread.depths, lambda: thread.batch_cap)
    port = telemetry.serve_metrics(host, config.metrics_port)
    ...
    telemetry.close()
    """

    def __init__(
        self,
        *,
        lanes: Sequence[LaneConfig],
        providers: Sequence[str],
        max_batch_size: int,
        tracer_provider: TracerProvider | None = None,
        metric_readers: Sequence[MetricReader] = (),
        prometheus: bool = False,
        owns_tracer_provider: bool = False,
        device: DeviceMonitor | None = None,
    ) -> None:
        """`tracer_provider` None: tracing off. `metric_readers` and, with `prometheus`,
        a Prometheus reader collect the metrics; with neither, no metric is recorded."""
        self._tracer_provider = tracer_provider
        self._owns_tracer_provider = owns_tracer_provider
        self._device = device
        self._endpoint: MetricsEndpoint | None = None
        self.event_log = EventLog(max_batch_size=max_batch_size)
        self.events: list[SchedulerEvents] = [self.event_log]
        readers = list(metric_readers)
        self._registry: prometheus_client.CollectorRegistry | None = None
        if prometheus:
            # Imported here: its module registers nothing, but the exporter package is
            # only needed by processes that serve the endpoint.
            from opentelemetry.exporter.prometheus import PrometheusMetricReader  # noqa: PLC0415

            # A registry per server: several servers in one process (tests) must not
            # mix their figures in the default one.
            self._registry = prometheus_client.CollectorRegistry(auto_describe=True)
            readers.append(PrometheusMetricReader(registry=self._registry))
        self._meter_provider: MeterProvider | None = None
        self.metrics: Metrics | None = None
        if readers:
            # Closed by `close`; no exit hook, so servers in tests leave nothing behind.
            self._meter_provider = MeterProvider(
                metric_readers=readers,
                resource=_resource(),
                shutdown_on_exit=False,
                # Exemplars would look up the current span on every measurement.
                exemplar_filter=AlwaysOffExemplarFilter(),
            )
            self.metrics = Metrics(self._meter_provider.get_meter(INSTRUMENTATION_NAME), device)
            self.events.append(self.metrics)
        self.tracing: Tracing | None = None
        self.interceptors: list[grpc.aio.ServerInterceptor] = []
        if tracer_provider is not None:
            tracer = tracer_provider.get_tracer(INSTRUMENTATION_NAME)
            self.tracing = Tracing(tracer, lanes, providers)
            self.events.append(self.tracing)
            self.interceptors.append(ServerSpans(tracer))

    @classmethod
    def from_config(cls, config: ServerConfig, providers: Sequence[str]) -> Telemetry:
        """Tracing from the OTEL_* variables; Prometheus unless metrics_port is -1."""
        tracer_provider = tracer_provider_from_env()
        return cls(
            lanes=config.lanes,
            providers=providers,
            max_batch_size=config.max_batch_size,
            tracer_provider=tracer_provider,
            owns_tracer_provider=tracer_provider is not None,
            prometheus=config.metrics_port >= 0,
            device=DeviceMonitor.open(providers),
        )

    @property
    def tracer(self) -> Tracing | None:
        return self.tracing

    def observe(
        self, depths: Callable[[], Sequence[LaneDepth]], batch_cap: Callable[[], int]
    ) -> None:
        """Where the gauges read lane depths and the batch cap."""
        if self.metrics is not None:
            self.metrics.observe(depths, batch_cap)

    def serve_metrics(self, host: str, port: int) -> int | None:
        """Starts the Prometheus endpoint; returns its port (None: not configured)."""
        if self._registry is None or port < 0:
            return None
        self._endpoint = MetricsEndpoint(self._registry, host, port)
        return self._endpoint.port

    def device_utilization(self) -> float | None:
        return None if self._device is None else self._device.utilization()

    def close(self) -> None:
        """Flushes spans and the refusal log, stops the endpoint. Call once, at stop."""
        self.event_log.flush()
        if self.tracing is not None:
            self.tracing.close()
        if self._tracer_provider is not None:
            if self._owns_tracer_provider:
                self._tracer_provider.shutdown()
            else:
                self._tracer_provider.force_flush()
        if self._endpoint is not None:
            self._endpoint.close()
        if self._meter_provider is not None:
            self._meter_provider.shutdown()
        if self._device is not None:
            self._device.close()


__all__ = [
    "BatchLinkSampler",
    "DeviceMonitor",
    "EventLog",
    "JsonFormatter",
    "Metrics",
    "MetricsEndpoint",
    "ServerSpans",
    "Telemetry",
    "TextFormatter",
    "Tracing",
    "configure_logging",
    "log_event",
    "tracer_provider_from_env",
]
