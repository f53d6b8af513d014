"""Request and batch spans: `Tracing` (the service's `RequestTracer` and a
`SchedulerEvents` sink) and the sampler that keeps a batch span with its requests.

One `enqueue` span per queued request (admission to first dispatch, or to its end, with
its status, when it never ran) and, once it ran, one `reply` span (answer back on the
event loop to encoded; zero-length when the request ended running, with no answer, for
its status), both children of the gRPC server span
(server_spans.py). A call that joins a request in flight queues nothing: it gets a
`reply` alone, with what it got (`Tracing.joined`). Each batch gets a root `batch` span
with a link to every request span it serves, and an `infer` child for the session run.

The root of the sampling decision, for a trace that no caller's sampled context decides, is
a `RatioSampler`, whose ratio Triton's TraceSetting changes while the server runs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import Attributes

from laneserve.server.errors import DrainingError, LaneserveError, bounded_message
from laneserve.server.events import NULL_TRACE, NullEvents, RequestTrace
from laneserve.server.items import Batch

# Request ends that are not failures of the request's own span.
_NOT_ERRORS = frozenset({"OK", "CANCELLED"})


def _unsampled() -> bool:
    """Whether the current call's trace was not sampled: the request's spans would be
    dropped too (the samplers decide per trace), and even a dropped span costs the SDK
    ~8 us."""
    server_span = otel_trace.get_current_span()
    return server_span.get_span_context().is_valid and not server_span.is_recording()


@dataclasses.dataclass(frozen=True, slots=True)
class Sampling:
    """What a `RatioSampler` samples: while `on`, the traces whose id falls in `ratio`
    of the id space (TraceIdRatioBased's rule); else none. Triton's trace_level
    (TIMESTAMPS while on, OFF) and trace_rate (1 / `ratio`: one trace in N), kept apart
    as Triton keeps them, so that turning sampling off and on again keeps the rate."""

    on: bool
    ratio: float  # 0 < ratio <= 1, also while off: the ratio it samples at once on

    def __post_init__(self) -> None:
        assert 0.0 < self.ratio <= 1.0, self.ratio

    @classmethod
    def of_ratio(cls, ratio: float) -> Sampling:
        """The sampling of an OTEL_TRACES_SAMPLER ratio from 0 to 1: off at 0 (the rate
        it would sample at once turned on: every trace, 1)."""
        return cls(on=True, ratio=ratio) if ratio > 0.0 else cls(on=False, ratio=1.0)


class RatioSampler(Sampler):
    """The root sampler laneserve builds from OTEL_TRACES_SAMPLER (its ratio, 1 for
    always_on, 0 for always_off; a parent-based sampler has it as its root): decides as
    TraceIdRatioBased does at its `sampling`'s ratio while on, drops everything while
    off. `set` replaces its sampling while the server runs (Triton's TraceSetting).

    `should_sample` runs on every thread that starts a span (the event loop for request
    spans, the scheduler thread for batch spans) and takes no lock: it reads `_now`
    once, an immutable pair (the sampling and the SDK sampler that decides it) that
    `set` (called on the event loop alone) replaces whole in one assignment, so a
    decision is made wholly under the old sampling or wholly under the new. `start` is
    the sampling it was built with, what a setting cleared comes back to."""

    def __init__(self, sampling: Sampling) -> None:
        self.start = sampling
        self._now: tuple[Sampling, Sampler] = (sampling, _deciding(sampling))

    @property
    def sampling(self) -> Sampling:
        return self._now[0]

    def set(self, sampling: Sampling) -> Sampling:
        """Samples as `sampling` says from now on; returns the sampling it replaced."""
        old, _ = self._now
        # Built before it is published; one assignment publishes both halves at once.
        self._now = (sampling, _deciding(sampling))
        return old

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
        _, deciding = self._now
        return deciding.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        sampling = self.sampling
        return f"RatioSampler{{{sampling.ratio if sampling.on else 0.0}}}"


def _deciding(sampling: Sampling) -> Sampler:
    """The SDK's sampler for `sampling`: its static ones at the ends, which skip the
    trace id's arithmetic."""
    if not sampling.on:
        return ALWAYS_OFF
    if sampling.ratio >= 1.0:
        return ALWAYS_ON
    return TraceIdRatioBased(sampling.ratio)


class BatchLinkSampler(Sampler):
    """Samples a `batch` span whenever one of the request spans it links to is sampled,
    and the `infer` child of a sampled batch; everything else as `inner` decides.

    A batch span is a root (it serves many traces), so a ratio sampler alone would keep
    it independently of its requests, and a sampled request would usually lose it. Its
    `infer` child is in the batch's own trace: a ratio sampler that is not parent-based
    (traceidratio) would decide on that random trace id and drop most of the runs of the
    batches kept.

    `root`: the `RatioSampler` at the root of `inner` (`inner` itself, or a parent-based
    sampler's root), whose sampling Triton's TraceSetting reads and changes; None where
    `inner` has none (a sampler laneserve did not build: then nothing changes it).
    """

    def __init__(self, inner: Sampler, *, root: RatioSampler | None = None) -> None:
        self._inner = inner
        self.root = root

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
        if name == "infer":
            parent = otel_trace.get_current_span(parent_context).get_span_context()
            if parent.is_valid and parent.trace_flags.sampled:
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, parent.trace_state)
        return self._inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"BatchLinkSampler{{{self._inner.get_description()}}}"


class _RequestSpans:
    """One request's `enqueue` and `reply` spans (a `RequestTrace`).

    `enqueue` runs from admission to the request's first dispatch (its queue wait), or to
    its end when it never ran (refused, expired, cancelled, shut down), and then carries
    that status, alone: such a request gets no `reply`. `reply` runs from the answer's
    return to the event loop to its encoding.
    A request that ends once dispatched with no answer to encode (its caller left while
    its batch ran) gets a zero-length `reply` for its status: every request's trace says
    how it ended. Dispatch comes from the scheduler thread, the rest from the event loop:
    the lock makes ending `enqueue` happen once.
    """

    __slots__ = (
        "_ended",
        "_enqueue_open",
        "_lock",
        "_parent",
        "_reply",
        "_reply_attributes",
        "_tracer",
        "enqueue",
    )

    def __init__(self, tracer: otel_trace.Tracer, attributes: Attributes, request_id: str) -> None:
        self._tracer = tracer
        self._reply_attributes = _whose(request_id)
        # The gRPC server span, where the servicer runs: the parent of both spans.
        self._parent = otel_context.get_current()
        self.enqueue = tracer.start_span("enqueue", context=self._parent, attributes=attributes)
        self._reply: otel_trace.Span | None = None
        self._lock = threading.Lock()
        self._enqueue_open = True
        self._ended = False  # on the event loop only, as `end`

    def dispatched(self) -> None:
        self._end_enqueue(None)

    def replying(self) -> None:
        with self._lock:
            dispatched = not self._enqueue_open
        # An outcome of a request never dispatched (expired in its queue, shut down) is an
        # error and no answer: `enqueue` alone says how it ended (`end`). Dispatch happens
        # before its batch runs, on the scheduler thread, so an answer finds it ended.
        if dispatched:
            self._reply = self._tracer.start_span(
                "reply", context=self._parent, attributes=self._reply_attributes
            )

    def end(self, status: str, *, late: bool = False) -> None:
        # Once: a caller answered alone at its deadline ends its request's spans then, while
        # the work goes on for a retry that joined it, and may still be cancelled later.
        if self._ended:
            return
        self._ended = True
        if self._end_enqueue(status) and self._reply is None:
            return  # it never ran: `enqueue` says how it ended
        if self._reply is not None:
            _set_request_status(self._reply, status)
            if late:
                # An OK status alone hid it: the span's times against `enqueue`'s
                # laneserve.deadline_ms were the only sign.
                self._reply.set_attribute("laneserve.late", True)
            self._reply.end()
            return
        # It ran, and ends with no answer to encode (its caller left while its batch ran):
        # a `reply` of no length says how, or none of its spans would.
        _empty_reply(self._tracer, self._parent, status, self._reply_attributes)

    def _end_enqueue(self, status: str | None) -> bool:
        """Ends `enqueue` with `status` (None: dispatched) unless it has ended already;
        whether this call ended it."""
        with self._lock:
            if not self._enqueue_open:
                return False
            self._enqueue_open = False
        if status is not None:
            _set_request_status(self.enqueue, status)
        self.enqueue.end()
        return True


class _JoinedReply:
    """The `reply` of a call that joined a request in flight (a `RequestTrace`), a child
    of that call's server span: from the answer reaching it to its end, with what it got
    (the answer, its refusal, or the request's error; of no length when nothing of the
    answer was handed to it). Only the event loop touches it; `end` ends it once."""

    __slots__ = ("_attributes", "_ended", "_parent", "_reply", "_tracer")

    def __init__(self, tracer: otel_trace.Tracer, request_id: str) -> None:
        self._tracer = tracer
        self._parent = otel_context.get_current()  # the joined call's server span
        self._reply: otel_trace.Span | None = None
        self._ended = False
        # A stream item resent after a broken call joins the request it sent before.
        self._attributes = _whose(request_id)

    def replying(self) -> None:
        if self._reply is None and not self._ended:
            self._reply = self._tracer.start_span(
                "reply", context=self._parent, attributes=self._attributes
            )

    def end(self, status: str, *, late: bool = False) -> None:
        del late  # told on the request's own `reply` (the submitter's)
        if self._ended:
            return
        self._ended = True
        if self._reply is None:
            _empty_reply(self._tracer, self._parent, status, self._attributes)
            return
        _set_request_status(self._reply, status)
        self._reply.end()


def _whose(request_id: str) -> Attributes:
    """A `reply`'s attributes: its request's id (none without one). A stream's one span
    holds many requests' replies, in the order they complete: nothing told which was
    whose."""
    return {"laneserve.request_id": request_id} if request_id else None


def _empty_reply(
    tracer: otel_trace.Tracer,
    parent: otel_context.Context,
    status: str,
    attributes: Attributes = None,
) -> None:
    """A `reply` of no length under `parent`, saying how a request ended with no answer."""
    now_ns = time.time_ns()
    reply = tracer.start_span("reply", context=parent, start_time=now_ns, attributes=attributes)
    _set_request_status(reply, status)
    reply.end(end_time=now_ns)


def _set_request_status(span: otel_trace.Span, status: str) -> None:
    span.set_attribute("laneserve.status", status)
    if status not in _NOT_ERRORS:
        span.set_status(Status(StatusCode.ERROR, status))


class Tracing(NullEvents):
    """The service's `RequestTracer`, and a `SchedulerEvents` sink for batch spans."""

    def __init__(
        self,
        tracer: otel_trace.Tracer,
        providers: Sequence[str],
    ) -> None:
        self._tracer = tracer
        self._providers = tuple(providers)
        # Open batch spans by batch id. Only the scheduler's owner touches it (under its
        # lock), and `close` once the scheduler has stopped.
        self._batches: dict[int, otel_trace.Span] = {}

    # RequestTracer
    def start(self, request_id: str, lane: str, rows: int, budget_s: float) -> RequestTrace:
        if _unsampled():
            return NULL_TRACE
        attributes: dict[str, str | int | float] = {"laneserve.lane": lane, "laneserve.rows": rows}
        if request_id:
            attributes["laneserve.request_id"] = request_id
        # The deadline the scheduler keeps, as given: re-derived here from the request's
        # own and the lane's timeout counted from now, it overstated a stream item's that
        # had waited for room (its lane's timeout counts from its arrival).
        attributes["laneserve.deadline_ms"] = round(budget_s * 1000, 3)
        return _RequestSpans(self._tracer, attributes, request_id)

    def joined(self, request_id: str, lane: str) -> RequestTrace:
        del lane  # on the call's `laneserve.retry` event (`retried`)
        return NULL_TRACE if _unsampled() else _JoinedReply(self._tracer, request_id)

    def retried(self, request_id: str, lane: str, how: str) -> None:
        # An event on the call's span, not spans of its own: nothing of it is queued or
        # run. An event, not attributes: an InferStream's one span carries many items.
        otel_trace.get_current_span().add_event(
            "laneserve.retry",
            {
                "laneserve.idempotency": how,
                "laneserve.request_id": request_id,
                "laneserve.lane": lane,
            },
        )

    # SchedulerEvents
    def rejected(
        self,
        lane: str,
        reason: str,
        waited_s: float,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        # An event on the call's span (on the event loop, in the call's context): a
        # refusal before the request's spans start (a bad input, an unknown lane, an
        # item of a stream) left the trace with a status code alone, and a stream's span
        # ended OK with nothing of its refused items (a review). Its reason alone: one
        # refused before it had a lane of the server's is counted under the default lane,
        # which it never asked for. Its words too, as its caller got them: a stream's span
        # carries many items' refusals, and the reason alone ("INVALID_INPUT") told an
        # operator nothing of what was wrong.
        del lane, waited_s
        span = otel_trace.get_current_span()
        if span.is_recording():
            attributes = {"laneserve.reason": reason}
            if error is not None:
                attributes["laneserve.message"] = bounded_message(error.message)
            if request_id:
                attributes["laneserve.request_id"] = request_id
            span.add_event("laneserve.refused", attributes)

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float | None]) -> None:
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
                "laneserve.batch.max_queue_wait_ms": round(
                    max((wait for wait in queue_waits_s if wait is not None), default=0) * 1e3, 3
                ),
            },
        )

    def batch_done(
        self,
        batch: Batch,
        run_s: float,
        error: LaneserveError | None,
        failed_rows: int = 0,
        *,
        split: bool = False,
    ) -> None:
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
        if failed_rows:  # rows that failed alone, the others answered
            span.set_attribute("laneserve.batch.failed_rows", failed_rows)
        if error is not None:
            for failed in (infer, span):
                failed.set_attribute("laneserve.status", error.reason)
                failed.set_status(Status(StatusCode.ERROR, error.reason))
        infer.end(end_time=end_ns)
        span.end(end_time=end_ns)

    def close(self) -> None:
        """Ends the spans of batches that never finished (the server stopped). A batch
        that still runs may end meanwhile (`batch_done`, on its thread): each span is
        taken with one atomic pop, so it is ended once, by one of them, and the dict is
        never iterated while it changes."""
        for batch_id in list(self._batches):
            span = self._batches.pop(batch_id, None)
            if span is not None:  # an ERROR, as `batch_done` has a run answered DRAINING
                span.set_attribute("laneserve.status", DrainingError.reason)
                span.set_status(Status(StatusCode.ERROR, DrainingError.reason))
                span.end()

    def batch_split(self, batch_id: int, rows: int, out_of_memory_runs: int) -> None:
        span = self._batches.get(batch_id)
        if span is not None:  # its run, and some of its parts', ran out of memory
            span.set_attribute("laneserve.batch.split", True)
            span.set_attribute("laneserve.batch.out_of_memory_runs", out_of_memory_runs)
