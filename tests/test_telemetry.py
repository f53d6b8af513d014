"""Traces, metrics, the Prometheus endpoint and event logs, on a real server.

Spans are collected with the SDK's InMemorySpanExporter (a SimpleSpanProcessor exports
each span as it ends), metrics with its InMemoryMetricReader. Each test builds its own
`Telemetry`, so nothing global (no global tracer or meter provider) is touched.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import importlib.metadata
import io
import itertools
import json
import logging
import os
import queue
import re
import resource
import socket
import sys
import threading
import types
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import numpy as np
import onnx
import prometheus_client
import pytest
from onnx import TensorProto, helper
from opentelemetry.exporter import prometheus as otel_prometheus
from opentelemetry.metrics import NoOpMeter
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
    Sum,
)
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Decision, Sampler, TraceIdRatioBased
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from prometheus_client.parser import text_string_to_metric_families

from laneserve.client import AsyncClient, Client
from laneserve.client.tensors import encode_tensor
from laneserve.server import LaneConfig, ManualClock, ServerConfig
from laneserve.server.config import DEFAULT_LANES, ConfigError
from laneserve.server.cost_model import RunTimeModel
from laneserve.server.errors import (
    DeviceMemoryError,
    EngineError,
    InvalidInputError,
    LaneserveError,
    ServerFaultError,
)
from laneserve.server.events import FanOut
from laneserve.server.grpc_calls import GrpcCalls
from laneserve.server.idempotency import LedgerCounts
from laneserve.server.items import (
    Batch,
    BatchResult,
    BatchSlice,
    DispatchReason,
    FailedRows,
    InferenceRequest,
    Outcome,
    RowsWanted,
)
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.memory import (
    NvmlGauge,
    WatermarkState,
    parse_memory_limit,
    prefer_pci_order,
)
from laneserve.server.scheduler import Dispatch, LaneDepth, Scheduler
from laneserve.server.scheduler_thread import SchedulerThread
from laneserve.server.shared_memory import Placement, SharedMemoryCounts, SharedMemoryRegions
from laneserve.server.stats import StatsRecorder
from laneserve.server.telemetry import (
    BatchLinkSampler,
    EventLog,
    JsonFormatter,
    ServerSpans,
    Telemetry,
    TextFormatter,
    assembly,
    log_event,
    tracer_provider_from_env,
)
from laneserve.server.telemetry.device import DeviceMonitor
from laneserve.server.telemetry.endpoint import MetricsEndpoint
from laneserve.server.telemetry.logs import (
    GRPC_PER_CALL_LOGGER,
    LOG_QUEUE_CHARS,
    MAX_REQUEST_IDS,
    QueuedStreamHandler,
    configure_logging,
    flush_logs,
    start_timer,
)
from laneserve.server.telemetry.metrics import Metrics, MetricSources
from laneserve.server.text_thread import TextThreadCounts
from laneserve.v1 import inference_pb2 as pb
from tests.support import (
    REPO,
    FakeTimers,
    RecordingEngine,
    Serving,
    SettableGauge,
    config,
    one_running_and_queued,
    queued_never_ran_as_the_drain_ended,
    queued_rows,
    request,
    rows,
    serving,
    until_stats,
)
from tests.test_kserve import kserve_stub
from tests.test_kserve_shm import (
    SharedMemory,
    input_bytes,
    output_bytes,
    register,
    shm_config,
    shm_request,
)
from tests.test_kserve_stream import item as stream_item

# A caller's W3C trace context: version 00, trace id, parent span id, sampled.
CALLER_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CALLER_SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{CALLER_TRACE_ID:032x}-{CALLER_SPAN_ID:016x}-01"
INFER_SPAN = "laneserve.v1.InferenceService/Infer"
STREAM_SPAN = "laneserve.v1.InferenceService/InferStream"


def traced(
    engine: RecordingEngine,
    server_config: ServerConfig,
    *,
    span_limits: SpanLimits | None = None,
    reader: InMemoryMetricReader | None = None,
    sampler: Sampler | None = None,
) -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler, span_limits=span_limits, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(
        lanes=server_config.lanes,
        providers=engine.providers,
        max_batch_size=server_config.max_batch_size,
        tracer_provider=provider,
        metric_readers=[] if reader is None else [reader],
    )
    return telemetry, exporter


@asynccontextmanager
async def serving_traced(
    engine: RecordingEngine, server_config: ServerConfig, **traced_options: Any
) -> AsyncIterator[tuple[Serving, InMemorySpanExporter]]:
    """`serving` with telemetry that records spans (`traced`): the server and its spans."""
    telemetry, exporter = traced(engine, server_config, **traced_options)
    async with serving(engine, server_config, telemetry=telemetry) as s:
        yield s, exporter


def cpu_telemetry(**options: Any) -> Telemetry:
    """Telemetry of a CPU server with the default lanes and `options` (its sinks)."""
    return Telemetry(
        lanes=ServerConfig(model_path="m.onnx").lanes,
        providers=["CPUExecutionProvider"],
        max_batch_size=64,
        **options,
    )


def cpu_sources(stats: StatsRecorder) -> MetricSources:
    """What the metrics of `cpu_telemetry` read with no scheduler behind them: nothing
    queued, a cap of 64, `stats`' counts, no watermark (no memory limit)."""
    return MetricSources(
        depths=list,
        batch_cap=lambda: 64,
        max_batch_cap=64,
        counts=stats.counts,
        grpc_calls=lambda: None,
        ledger=lambda: None,
        watermark=lambda: None,
        high_watermark_bytes=None,
        low_watermark_bytes=None,
        state=lambda: Lifecycle.SERVING,
        model_path="m.onnx",
        model_sha256="",
        memory_limit_bytes=None,
    )


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def only(spans: Sequence[ReadableSpan]) -> ReadableSpan:
    assert len(spans) == 1, [span.name for span in spans]
    return spans[0]


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


def parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.trace_id)


def attr(span: ReadableSpan, key: str) -> Any:
    assert span.attributes is not None
    return span.attributes[key]


def by_request_id(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    found = {}
    for span in spans_named(exporter, "enqueue"):
        assert span.attributes is not None
        found[str(span.attributes["laneserve.request_id"])] = span
    return found


def queued_requests(s: Serving) -> int:
    thread = s.server._thread
    assert thread is not None
    return sum(depth.queued_requests for depth in thread.depths())


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Polls for a state the server reaches (not a timing assumption)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while not condition():
        if loop.time() > give_up:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.002)


async def entered(engine: RecordingEngine) -> None:
    assert await asyncio.to_thread(engine.entered.acquire, True, 10), "no batch started"


# ---- traces -----------------------------------------------------------------------------


def test_one_request_yields_the_four_span_kinds_under_its_server_span(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        # interactive's max_wait long: the default 1 ms passed before a loaded machine's
        # scheduler thread woke, and the batch went out for max_wait, not as idle.
        lanes = tuple(
            dataclasses.replace(lane, max_wait_ms=10_000) if lane.name == "interactive" else lane
            for lane in DEFAULT_LANES
        )
        async with serving_traced(engine, config(small_model, lanes=lanes)) as (s, exporter):
            await s.stub.Infer(request(rows(3), request_id="one", lane="interactive"), timeout=10)
        server = only(spans_named(exporter, INFER_SPAN))
        enqueue = only(spans_named(exporter, "enqueue"))
        reply = only(spans_named(exporter, "reply"))
        batch = only(spans_named(exporter, "batch"))
        infer = only(spans_named(exporter, "infer"))

        assert server.kind is SpanKind.SERVER
        assert server.parent is None  # no traceparent came with the call
        assert server.attributes is not None
        assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
        # The request's own spans are children of the gRPC server span.
        for child in (enqueue, reply):
            assert parent_id(child) == span_id(server)
            assert trace_id(child) == trace_id(server)
        assert enqueue.attributes is not None
        assert enqueue.attributes["laneserve.lane"] == "interactive"
        assert enqueue.attributes["laneserve.rows"] == 3
        assert 0 < attr(enqueue, "laneserve.deadline_ms") <= 10_000
        assert reply.attributes is not None
        assert reply.attributes["laneserve.status"] == "OK"
        # The batch is a root of its own, linked to the request it served.
        assert batch.parent is None
        assert [link.context.span_id for link in batch.links] == [span_id(enqueue)]
        assert batch.attributes is not None
        assert batch.attributes["laneserve.batch.size"] == 3
        # Alone on a fresh server: it went at once (nobody was known to be coming).
        assert batch.attributes["laneserve.batch.wait_reason"] == "idle"
        assert parent_id(infer) == span_id(batch)
        assert infer.attributes is not None
        assert infer.attributes["laneserve.infer.providers"] == tuple(engine.providers)
        assert infer.attributes["laneserve.batch.size"] == 3
        # Order in time: queued, then run, then answered.
        assert enqueue.end_time is not None
        assert infer.start_time is not None
        assert reply.start_time is not None
        assert infer.end_time is not None
        assert batch.start_time is not None
        assert enqueue.end_time <= batch.start_time
        assert infer.end_time <= reply.start_time

    asyncio.run(scenario())


def test_a_retry_answered_by_the_ledger_says_so_on_its_call_span(small_model: Path) -> None:
    """A retry that joins the request in flight, or replays its stored answer, queues and
    runs nothing: its call's span had no children and no attributes, nothing saying how
    it was answered. It carries an event now."""

    async def scenario() -> list[ReadableSpan]:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            engine.hold()
            first = asyncio.ensure_future(s.stub.Infer(request(rows(1), request_id="r")))
            await entered(engine)  # bounded: a batch that never starts fails the test
            joined = asyncio.ensure_future(s.stub.Infer(request(rows(1), request_id="r")))
            await until_joined(s)
            # An id reused for other inputs is refused, not a retry (it had the event).
            with pytest.raises(grpc.aio.AioRpcError):
                await s.stub.Infer(request(rows(1, start=9), request_id="r"))
            engine.release()
            await asyncio.gather(first, joined)
            await s.stub.Infer(request(rows(1), request_id="r"))  # replayed
            with pytest.raises(grpc.aio.AioRpcError):
                await s.stub.Infer(request(rows(1, start=9), request_id="r"))
        return sorted(spans_named(exporter, INFER_SPAN), key=lambda span: span.start_time or 0)

    first, joined, reused_in_flight, replayed, reused_stored = asyncio.run(scenario())
    assert not first.events
    # A reused id is a refusal, not a retry: its event says so.
    for reused in (reused_in_flight, reused_stored):
        ((name, attributes),) = [
            (event.name, dict(event.attributes or {})) for event in reused.events
        ]
        assert name == "laneserve.refused"
        assert str(attributes.pop("laneserve.message")).startswith("request_id 'r' ")
        assert attributes == {"laneserve.reason": "REQUEST_ID_REUSED", "laneserve.request_id": "r"}
    for span, how in ((joined, "join"), (replayed, "replay")):
        (event,) = span.events
        assert event.name == "laneserve.retry"
        assert dict(event.attributes or {}) == {
            "laneserve.idempotency": how,
            "laneserve.request_id": "r",
            "laneserve.lane": "standard",
        }


async def until_joined(s: Serving, joins: int = 1) -> None:
    await until_stats(s, lambda stats: stats.idempotent_joins >= joins)


def test_a_batch_run_in_parts_after_running_out_of_memory_says_so(small_model: Path) -> None:
    """The batch and infer spans of a batch split after an out-of-memory looked like any
    other: nothing said it ran in parts, how many runs ran out of memory, or that rows
    failed alone."""

    class OutOfMemoryOverOneRow(RecordingEngine):
        armed = False  # after the start-up probe, which would set the batch cap to 1

        def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
            if self.armed and len(next(iter(inputs.values()))) > 1:
                raise DeviceMemoryError("injected: out of memory over one row")
            return super().run(inputs)

    async def scenario() -> ReadableSpan:
        engine = OutOfMemoryOverOneRow(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            engine.armed = True
            await s.stub.Infer(request(rows(4), request_id="four"))
        return only(spans_named(exporter, "batch"))

    batch = asyncio.run(scenario())
    assert batch.attributes is not None
    assert batch.attributes["laneserve.batch.split"] is True
    assert batch.attributes["laneserve.batch.out_of_memory_runs"] == 3, "4 rows, then 2 and 2"
    assert "laneserve.batch.failed_rows" not in batch.attributes, "every row ran alone"


def test_caller_traceparent_becomes_the_parent(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            await s.stub.Infer(
                request(rows(1)), timeout=10, metadata=(("traceparent", TRACEPARENT),)
            )
        server = only(spans_named(exporter, INFER_SPAN))
        assert server.parent is not None
        assert server.parent.is_remote
        assert (server.parent.trace_id, server.parent.span_id) == (CALLER_TRACE_ID, CALLER_SPAN_ID)
        for name in ("enqueue", "reply"):
            assert trace_id(only(spans_named(exporter, name))) == CALLER_TRACE_ID

    asyncio.run(scenario())


def test_a_caller_that_does_not_sample_gets_no_spans(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model)
        telemetry, exporter = traced(engine, server_config)  # parent-based: follows the caller
        unsampled = TRACEPARENT.removesuffix("-01") + "-00"
        async with serving(engine, server_config, telemetry=telemetry) as s:
            await s.stub.Infer(request(rows(1)), timeout=10, metadata=(("traceparent", unsampled),))
            await s.stub.Infer(request(rows(1), request_id="sampled"), timeout=10)
        # Only the second request's trace, and the batch that served it.
        assert sorted(span.name for span in exporter.get_finished_spans()) == sorted(
            [INFER_SPAN, "enqueue", "reply", "batch", "infer"]
        )
        assert list(by_request_id(exporter)) == ["sampled"]

    asyncio.run(scenario())


def test_batch_span_links_to_every_request_it_serves(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            engine.hold()
            first = asyncio.ensure_future(s.stub.Infer(request(rows(1), request_id="first")))
            await entered(engine)  # the session is busy: the next ones queue as backlog
            lanes = {"a": "interactive", "b": "standard", "c": "standard", "d": "bulk"}
            queued = [
                asyncio.ensure_future(
                    s.stub.Infer(request(rows(2), request_id=request_id, lane=lane))
                )
                for request_id, lane in lanes.items()
            ]
            await until(lambda: queued_requests(s) == len(lanes))
            engine.release()
            await asyncio.gather(first, *queued)
        enqueue = by_request_id(exporter)
        batches = {
            attr(span, "laneserve.batch.requests"): span for span in spans_named(exporter, "batch")
        }
        assert sorted(batches) == [1, 4]
        served = batches[4]
        assert {link.context.span_id for link in served.links} == {
            span_id(enqueue[request_id]) for request_id in lanes
        }
        link_lanes = sorted(str((link.attributes or {})["laneserve.lane"]) for link in served.links)
        assert link_lanes == sorted(lanes.values())
        assert served.attributes is not None
        assert served.attributes["laneserve.batch.size"] == 8
        assert served.attributes["laneserve.batch.wait_reason"] == "backlog"
        assert served.attributes["laneserve.batch.lanes"] == ("bulk", "interactive", "standard")
        assert served.attributes["laneserve.batch.lanes_mixed"] is True
        (first_link,) = batches[1].links
        assert first_link.context.span_id == span_id(enqueue["first"])

    asyncio.run(scenario())


def test_batch_links_stay_within_the_sdk_link_limit(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(
            engine, config(small_model), span_limits=SpanLimits(max_links=2)
        ) as (s, exporter):
            engine.hold()
            first = asyncio.ensure_future(s.stub.Infer(request(rows(1))))
            await entered(engine)
            queued = [asyncio.ensure_future(s.stub.Infer(request(rows(1)))) for _ in range(5)]
            await until(lambda: queued_requests(s) == 5)
            engine.release()
            await asyncio.gather(first, *queued)
        (batch,) = [
            span
            for span in spans_named(exporter, "batch")
            if span.attributes is not None and span.attributes["laneserve.batch.requests"] == 5
        ]
        assert len(batch.links) == 2
        assert batch.dropped_links == 3

    asyncio.run(scenario())


def test_status_codes_are_recorded_on_the_server_span(small_model: Path) -> None:
    lanes = (
        LaneConfig("standard", capacity_rows=5, timeout_ms=60_000, max_wait_ms=0, min_share=0.0),
    )

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, lanes=lanes)
        telemetry, exporter = traced(engine, server_config)
        engine.fail_when = lambda batch: batch.rows == 3

        async def code_of(call: Any) -> grpc.StatusCode:
            try:
                await call
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

        async with serving(engine, server_config, telemetry=telemetry) as s:
            codes = [
                await code_of(s.stub.Infer(request(rows(1), request_id="ok"))),
                await code_of(s.stub.Infer(request(rows(1), request_id="bad", lane="nope"))),
                await code_of(s.stub.Infer(request(rows(3), request_id="failing"))),
            ]
            engine.hold_next()
            busy = asyncio.ensure_future(s.stub.Infer(request(rows(1), request_id="busy")))
            await entered(engine)
            filler = asyncio.ensure_future(s.stub.Infer(request(rows(4), request_id="filler")))
            cancelled = s.stub.Infer(request(rows(1), request_id="cancelled"))
            await until(lambda: queued_requests(s) == 2)  # the lane is full now
            codes.append(await code_of(s.stub.Infer(request(rows(1), request_id="full"))))
            cancelled.cancel()
            await until(lambda: queued_requests(s) == 1)
            codes.append(
                await code_of(s.stub.Infer(request(rows(1), request_id="late"), timeout=0.2))
            )
            engine.release()
            await asyncio.gather(busy, filler)
            await until(lambda: len(spans_named(exporter, INFER_SPAN)) == 8)
        assert codes == [
            grpc.StatusCode.OK,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.INTERNAL,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ]
        recorded = sorted(
            (attr(span, "rpc.grpc.status_code"), span.status.status_code.value)
            for span in spans_named(exporter, INFER_SPAN)
        )
        ok, error, unset = grpc.StatusCode.OK, StatusCode.ERROR.value, StatusCode.UNSET.value
        assert recorded == sorted(
            [
                (ok.value[0], unset),  # ok
                (ok.value[0], unset),  # busy
                (ok.value[0], unset),  # filler
                (grpc.StatusCode.INVALID_ARGUMENT.value[0], unset),  # the caller's fault
                (grpc.StatusCode.INTERNAL.value[0], error),
                (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], unset),
                (grpc.StatusCode.CANCELLED.value[0], unset),
                (grpc.StatusCode.DEADLINE_EXCEEDED.value[0], error),
            ]
        )
        enqueue = by_request_id(exporter)
        assert enqueue["full"].status.status_code is StatusCode.ERROR
        assert enqueue["full"].attributes is not None
        assert enqueue["full"].attributes["laneserve.status"] == "LANE_FULL"
        failed_infer = [
            span
            for span in spans_named(exporter, "infer")
            if span.status.status_code is StatusCode.ERROR
        ]
        assert len(failed_infer) == 1

    asyncio.run(scenario())


def traceparent(trace: int) -> tuple[tuple[str, str]]:
    """Call metadata that puts the call in trace `trace` (sampled)."""
    return (("traceparent", f"00-{trace:032x}-{CALLER_SPAN_ID:016x}-01"),)


def in_trace(exporter: InMemorySpanExporter, trace: int) -> dict[str, list[ReadableSpan]]:
    """The finished spans of trace `trace`, by name."""
    found: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        if trace_id(span) == trace:
            found.setdefault(span.name, []).append(span)
    return found


def test_a_request_that_ends_while_its_batch_runs_says_how_on_a_reply_span(
    small_model: Path,
) -> None:
    """A call without a request_id that is cancelled, or whose gRPC deadline passes, while
    its batch runs ends there (the scheduler's cancel), with no answer to reply with: its
    `enqueue` had ended at dispatch, and how it ended was recorded on no span of its own."""

    async def scenario() -> InMemorySpanExporter:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            engine.hold_next()
            cancelled = s.stub.Infer(request(rows(1)), metadata=traceparent(1))
            await entered(engine)
            cancelled.cancel()
            await until(lambda: INFER_SPAN in in_trace(exporter, 1))  # the call ended
            engine.release()
            await until(lambda: "batch" in {span.name for span in exporter.get_finished_spans()})
            engine.hold()
            late = s.stub.Infer(request(rows(1)), metadata=traceparent(2), timeout=0.2)
            await entered(engine)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await late
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: INFER_SPAN in in_trace(exporter, 2))  # the call ended
            engine.release()
        return exporter

    exporter = asyncio.run(scenario())
    for trace, status, code in (
        (1, "CANCELLED", StatusCode.UNSET),
        (2, "DEADLINE_EXCEEDED", StatusCode.ERROR),
    ):
        spans = in_trace(exporter, trace)
        server, enqueue, reply = (only(spans[name]) for name in (INFER_SPAN, "enqueue", "reply"))
        assert attr(reply, "laneserve.status") == status
        assert reply.status.status_code is code
        assert parent_id(reply) == span_id(server)
        assert reply.start_time == reply.end_time, "nothing was encoded"
        assert server.end_time is not None
        assert reply.end_time is not None
        assert reply.end_time <= server.end_time, "said within the call"
        assert enqueue.attributes is not None
        assert "laneserve.status" not in enqueue.attributes, "it ended at dispatch"


def test_a_caller_answered_alone_at_its_deadline_gets_no_reply_of_the_retrys_answer(
    small_model: Path,
) -> None:
    """A request_id call whose retry joined with a later deadline is answered alone at its
    own deadline (EXPIRED_IN_QUEUE) while the work goes on for the retry. The answer's
    `reply`, status OK, was made in the first call's trace, after its server span had
    ended in error; and its `enqueue` never said how it ended (CANCELLED instead, when the
    retry left too and the work was cancelled)."""

    async def scenario() -> InMemorySpanExporter:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            engine.hold()
            busy = asyncio.ensure_future(s.stub.Infer(request(rows(1)), timeout=60))
            await entered(engine)
            # Queued behind the held batch until their deadlines pass (the only waits).
            # Deadlines of timeout_ms, which the server alone keeps: a gRPC deadline may
            # reach the server as the client's cancel first (CANCELLED, not answered alone).
            first = [
                s.stub.Infer(
                    request(rows(1, seed=seed), request_id=rid, timeout_ms=1_000), metadata=tp
                )
                for seed, rid, tp in ((5, "C", traceparent(3)), (6, "D", traceparent(5)))
            ]
            await until(lambda: queued_requests(s) == 2)
            retry_c = s.stub.Infer(
                request(rows(1, seed=5), request_id="C"), metadata=traceparent(4), timeout=60
            )
            retry_d = s.stub.Infer(
                request(rows(1, seed=6), request_id="D"), metadata=traceparent(6), timeout=60
            )
            await until_joined(s, joins=2)
            for call in first:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            retry_d.cancel()  # its work, still queued, is cancelled
            await until(lambda: queued_requests(s) == 1)
            engine.release()
            await asyncio.gather(busy, retry_c)
        return exporter

    exporter = asyncio.run(scenario())
    for first, retry in ((3, 4), (5, 6)):
        spans = in_trace(exporter, first)
        assert sorted(spans) == sorted([INFER_SPAN, "enqueue"]), "no reply: it got no answer"
        enqueue = only(spans["enqueue"])
        assert attr(enqueue, "laneserve.status") == "EXPIRED_IN_QUEUE"
        assert enqueue.status.status_code is StatusCode.ERROR
        (event,) = only(in_trace(exporter, retry)[INFER_SPAN]).events
        assert event.name == "laneserve.retry"


def test_a_request_that_expires_in_its_queue_is_told_by_its_enqueue_alone(
    small_model: Path,
) -> None:
    """A request shed EXPIRED_IN_QUEUE never ran: its `enqueue` ends in error with that
    status. It had a `reply` too, in error with the same status, though no answer came
    back to encode: one end told twice, as two failures."""

    async def scenario() -> InMemorySpanExporter:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            engine.hold_next()
            busy = asyncio.ensure_future(s.stub.Infer(request(rows(1)), timeout=60))
            await entered(engine)
            # Queued behind the held batch until its deadline passes (the only wait): one
            # of timeout_ms, which the server alone keeps (see the test above).
            late = s.stub.Infer(
                request(rows(1, seed=5), timeout_ms=200), metadata=traceparent(7), timeout=60
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await late
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: INFER_SPAN in in_trace(exporter, 7))  # the call ended
            engine.release()
            await busy
        return exporter

    exporter = asyncio.run(scenario())
    spans = in_trace(exporter, 7)
    assert sorted(spans) == sorted([INFER_SPAN, "enqueue"]), "no reply: it never ran"
    enqueue = only(spans["enqueue"])
    assert attr(enqueue, "laneserve.status") == "EXPIRED_IN_QUEUE"
    assert enqueue.status.status_code is StatusCode.ERROR
    told = [
        span.name
        for found in spans.values()
        for span in found
        if span.status.description == "EXPIRED_IN_QUEUE"
    ]
    assert told == ["enqueue"], "one end, told once"


def test_a_retry_that_joins_a_request_in_flight_gets_a_reply_of_its_own(
    small_model: Path,
) -> None:
    """A retry that joins the request with its id in flight queues and runs nothing: the
    request's spans are in the trace of the call that queued it. Its own trace had the
    `laneserve.retry` event alone, nothing saying what answer it got; every other answered
    call has a `reply`. It has one now, with what it got: the answer, or the request's
    error. The trace of the call that queued it keeps its spans, one `reply` among them."""

    async def scenario() -> InMemorySpanExporter:
        engine = RecordingEngine(str(small_model))
        engine.fail_when = lambda batch: batch.rows == 3
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            for joins, (first_trace, retry_trace, count) in enumerate(((11, 12, 1), (13, 14, 3))):
                engine.hold_next()
                shared = request(rows(count), request_id=f"shared-{count}")
                first = s.stub.Infer(shared, metadata=traceparent(first_trace))
                await entered(engine)
                retry = s.stub.Infer(shared, metadata=traceparent(retry_trace))
                await until_joined(s, joins=joins + 1)
                engine.release()
                await asyncio.gather(first, retry, return_exceptions=True)
            await until(lambda: len(spans_named(exporter, INFER_SPAN)) == 4)
        return exporter

    exporter = asyncio.run(scenario())
    for first_trace, retry_trace, status, code in (
        (11, 12, "OK", StatusCode.UNSET),
        (13, 14, "ENGINE_FAILURE", StatusCode.ERROR),
    ):
        first = in_trace(exporter, first_trace)
        assert sorted(first) == sorted([INFER_SPAN, "enqueue", "reply"])
        assert attr(only(first["reply"]), "laneserve.status") == status
        spans = in_trace(exporter, retry_trace)
        assert sorted(spans) == sorted([INFER_SPAN, "reply"]), "nothing queued: no enqueue"
        server, reply = only(spans[INFER_SPAN]), only(spans["reply"])  # ended once
        (event,) = server.events
        assert event.name == "laneserve.retry"
        assert parent_id(reply) == span_id(server)
        assert attr(reply, "laneserve.status") == status
        # Whose reply it is, as the queued request's (it had the status alone).
        assert attr(reply, "laneserve.request_id") == f"shared-{1 if first_trace == 11 else 3}"
        assert reply.status.status_code is code
        assert server.end_time is not None
        assert reply.end_time is not None
        assert reply.end_time <= server.end_time, "said within the call"


def test_a_batch_still_running_at_stop_ends_its_span_in_error(small_model: Path) -> None:
    """A batch that outlives the stop's wait has its span ended by the stop, status DRAINING:
    it was left UNSET there, where a batch answered DRAINING by its run is an ERROR."""

    async def scenario() -> InMemorySpanExporter:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            engine.hold()
            call = s.stub.Infer(request(rows(1)), metadata=traceparent(7))
            await entered(engine)
            await asyncio.wait_for(s.server.stop(grace_s=0.05), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            engine.release()  # the held batch ends; its result is discarded
            thread = s.server._thread  # its engine thread must end before the test does
            assert thread is not None
            assert await asyncio.to_thread(thread.close, join_timeout_s=30)
        return exporter

    batch = only(spans_named(asyncio.run(scenario()), "batch"))
    assert attr(batch, "laneserve.status") == "DRAINING"
    assert batch.status.status_code is StatusCode.ERROR
    assert batch.status.description == "DRAINING"


def test_stream_items_are_children_of_the_stream_span(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            items = [request(rows(1), request_id=f"item-{index}") for index in range(3)]
            answers = [answer async for answer in s.stub.InferStream(iter(items), timeout=10)]
            assert len(answers) == 3
        stream = only(spans_named(exporter, STREAM_SPAN))
        assert stream.attributes is not None
        assert stream.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
        enqueue = by_request_id(exporter)
        assert sorted(enqueue) == ["item-0", "item-1", "item-2"]
        assert {parent_id(span) for span in enqueue.values()} == {span_id(stream)}
        replies = spans_named(exporter, "reply")
        assert {parent_id(span) for span in replies} == {span_id(stream)}
        # Each reply says whose it is: they come in the order their items complete.
        assert sorted(attr(span, "laneserve.request_id") for span in replies) == sorted(enqueue)

    asyncio.run(scenario())


def test_kserve_stream_items_are_children_of_the_callers_trace(small_model: Path) -> None:
    """ModelStreamInfer had no server span: its items' enqueue spans were roots of traces
    of their own, each reply in yet another, the caller's traceparent (and its sampling
    decision) ignored (a review). Traced as InferStream is now."""
    x = rows(1)

    async def scenario() -> InMemorySpanExporter:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            items = [stream_item(x, f"ks-{index}") for index in range(3)]
            call = kserve_stub(s).ModelStreamInfer(iter(items), metadata=traceparent(11))
            answers = [answer async for answer in call]
            assert [answer.error_message for answer in answers] == ["", "", ""]
        return exporter

    exporter = asyncio.run(scenario())
    spans = in_trace(exporter, 11)
    (stream,) = spans["inference.GRPCInferenceService/ModelStreamInfer"]
    assert parent_id(stream) == CALLER_SPAN_ID
    assert sorted(attr(span, "laneserve.request_id") for span in spans["enqueue"]) == [
        "ks-0",
        "ks-1",
        "ks-2",
    ]
    assert {parent_id(span) for span in spans["enqueue"] + spans["reply"]} == {span_id(stream)}
    assert len(spans["reply"]) == 3


def test_a_refused_stream_item_is_an_event_on_the_calls_span(small_model: Path) -> None:
    """Items refused before their spans start (a bad shape, a lane the server lacks): the
    stream's span ended OK with nothing of them, though the caller got two errors (a
    review). Each is a `laneserve.refused` event with its lane and reason."""

    async def scenario() -> InMemorySpanExporter:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            items = [
                request(rows(1), request_id="good"),
                request(rows(1)[:, :100], request_id="narrow"),
                request(rows(1), request_id="nowhere", lane="nowhere"),
            ]
            call = s.stub.InferStream(iter(items), metadata=traceparent(12), timeout=10)
            answers = [answer async for answer in call]
            assert len(answers) == 3
        return exporter

    (stream,) = in_trace(asyncio.run(scenario()), 12)[STREAM_SPAN]
    refused = [dict(event.attributes or {}) for event in stream.events]
    # No lane: the unknown lane's refusal is counted under the default lane, which a lane
    # attribute named as if the item had asked for it (a review). Its words and its id:
    # "INVALID_INPUT" alone said nothing of which item, or what was wrong with it.
    messages = [str(attributes.pop("laneserve.message")) for attributes in refused]
    assert refused == [
        {"laneserve.reason": "INVALID_INPUT", "laneserve.request_id": "narrow"},
        {"laneserve.reason": "INVALID_INPUT", "laneserve.request_id": "nowhere"},
    ]
    assert "expected" in messages[0]
    assert messages[1].startswith("unknown lane 'nowhere'")
    assert {event.name for event in stream.events} == {"laneserve.refused"}


def test_a_stream_closed_from_another_context_ends_its_span_without_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """gRPC closes the servicer's response generator of a cancelled InferStream where it
    was suspended, from another context. The stream span's context was attached across
    the generator's yields: detaching it there failed, and "Failed to detach context"
    was logged as an ERROR, with a traceback, for every cancelled stream."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = ServerSpans(provider.get_tracer("test"))

    async def behavior(*_: object) -> AsyncIterator[int]:
        yield 1
        yield 2

    class NoDeadline:
        def time_remaining(self) -> None:
            return None

        def code(self) -> None:
            return None

    async def scenario() -> None:
        context: Any = NoDeadline()
        stream: Any = spans._streaming(STREAM_SPAN, {}, behavior)(None, context)
        assert await anext(stream) == 1
        await asyncio.create_task(stream.aclose(), context=contextvars.Context())

    caplog.set_level(logging.WARNING)
    asyncio.run(scenario())
    assert [record.getMessage() for record in caplog.records] == []
    span = only(spans_named(exporter, STREAM_SPAN))
    assert span.attributes is not None
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]


def test_tracing_off_installs_nothing_on_the_request_path(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            telemetry = s.server.telemetry
            assert telemetry.tracing is None
            assert telemetry.interceptors == []
            assert not any(type(sink).__name__ == "Tracing" for sink in telemetry.events)
            await s.stub.Infer(request(rows(1)), timeout=10)

    asyncio.run(scenario())


def test_exporters_come_from_the_standard_variables() -> None:
    assert tracer_provider_from_env({}) is None  # default: none
    assert tracer_provider_from_env({"OTEL_TRACES_EXPORTER": "none"}) is None
    disabled = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}
    assert tracer_provider_from_env(disabled) is None
    for names in ("console", "otlp", "console,otlp"):
        provider = tracer_provider_from_env({"OTEL_TRACES_EXPORTER": names})
        assert provider is not None, names
        assert isinstance(provider.sampler, BatchLinkSampler)
        provider.shutdown()
    with pytest.raises(ConfigError, match=r"no span exporter 'nope'.*install"):
        tracer_provider_from_env({"OTEL_TRACES_EXPORTER": "nope"})
    with pytest.raises(ConfigError, match="expected grpc or http/protobuf"):
        tracer_provider_from_env(
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"}
        )


def test_exporters_built_before_one_that_fails_are_shut_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shut: list[ConsoleSpanExporter] = []

    def shutdown(exporter: ConsoleSpanExporter) -> None:
        shut.append(exporter)

    monkeypatch.setattr(ConsoleSpanExporter, "shutdown", shutdown)
    with pytest.raises(ConfigError, match=r"no span exporter 'nope'"):
        tracer_provider_from_env({"OTEL_TRACES_EXPORTER": "console,nope"})
    assert len(shut) == 1


def test_batch_spans_are_sampled_with_the_requests_they_serve() -> None:
    sampler = BatchLinkSampler(ALWAYS_OFF)

    def link(flags: int) -> Link:
        return Link(SpanContext(CALLER_TRACE_ID, CALLER_SPAN_ID, False, TraceFlags(flags)))

    def decision(name: str, links: list[Link]) -> Decision:
        return sampler.should_sample(None, CALLER_TRACE_ID, name, links=links).decision

    assert decision("batch", [link(0), link(TraceFlags.SAMPLED)]) is Decision.RECORD_AND_SAMPLE
    assert decision("batch", [link(0)]) is Decision.DROP
    assert decision("enqueue", [link(TraceFlags.SAMPLED)]) is Decision.DROP  # not a batch


def test_the_infer_span_of_a_sampled_batch_is_sampled_under_a_ratio_sampler(
    small_model: Path,
) -> None:
    """OTEL_TRACES_SAMPLER=traceidratio (not parent-based): batch spans were kept for
    their sampled requests, but their `infer` child was sampled on the batch's own random
    trace id, and most kept batches lost their run (40 requests at a ratio of 0.3: 10
    batch spans, 2 infer spans)."""
    # The ratio keeps trace ids whose low 64 bits are below 18 (of 2**64): the caller's,
    # and practically never a batch's random one.
    sampler = BatchLinkSampler(TraceIdRatioBased(1e-18))
    traceparent = f"00-{CALLER_TRACE_ID >> 64 << 64 | 1:032x}-{CALLER_SPAN_ID:016x}-01"

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model), sampler=sampler) as (s, exporter):
            for _ in range(3):  # one after another: three batches
                await s.stub.Infer(
                    request(rows(1)), timeout=10, metadata=(("traceparent", traceparent),)
                )
        batches = spans_named(exporter, "batch")
        assert len(batches) == 3
        assert len(spans_named(exporter, "enqueue")) == 3
        infers = spans_named(exporter, "infer")
        assert len(infers) == 3
        assert {parent_id(infer) for infer in infers} == {span_id(batch) for batch in batches}

    asyncio.run(scenario())
    # The rule alone: an infer span follows its batch; anything else the inner sampler
    # (which keeps none of these trace ids).
    dropped_id = CALLER_TRACE_ID | (1 << 64) - 1
    batch = SpanContext(dropped_id, CALLER_SPAN_ID, False, TraceFlags(TraceFlags.SAMPLED))
    unsampled = SpanContext(dropped_id, CALLER_SPAN_ID, False, TraceFlags(0))

    def decision(name: str, parent: SpanContext) -> Decision:
        context = set_span_in_context(NonRecordingSpan(parent))
        return sampler.should_sample(context, parent.trace_id, name).decision

    assert decision("infer", batch) is Decision.RECORD_AND_SAMPLE
    assert decision("infer", unsampled) is Decision.DROP
    assert decision("reply", batch) is Decision.DROP  # not an infer: the ratio decides


# ---- metrics ------------------------------------------------------------------------------


Points = dict[tuple[str, frozenset[tuple[str, Any]]], float]


def collect(reader: InMemoryMetricReader) -> Points:
    """Every data point: counters and gauges by value, histograms by count."""
    points: Points = {}
    data = reader.get_metrics_data()
    if data is None:
        return points
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                assert isinstance(metric.data, Sum | Gauge | Histogram)
                for point in metric.data.data_points:
                    key = (metric.name, frozenset((point.attributes or {}).items()))
                    if isinstance(point, HistogramDataPoint):
                        points[key] = point.count
                    else:
                        assert isinstance(point, NumberDataPoint)
                        points[key] = point.value
    return points


def at(points: Points, name: str, **attributes: Any) -> float:
    return points.get((name, frozenset(attributes.items())), 0)


def names(points: Points) -> set[str]:
    return {name for name, _ in points}


def check_recorded_metrics(points: Points, max_batch_size: int) -> None:
    """The metrics after the scenario below: what happened to each request and batch."""
    counters = {
        ("admitted", "standard"): at(points, "laneserve.requests.admitted", lane="standard"),
        ("admitted", "interactive"): at(points, "laneserve.requests.admitted", lane="interactive"),
        ("admitted", "bulk"): at(points, "laneserve.requests.admitted", lane="bulk"),
    }
    assert counters == {
        ("admitted", "standard"): 2,
        ("admitted", "interactive"): 1,
        ("admitted", "bulk"): 1,
    }
    assert at(points, "laneserve.requests.rejected", lane="interactive", reason="LANE_FULL") == 1
    assert at(points, "laneserve.requests.shed", lane="standard", reason="EXPIRED_IN_QUEUE") == 1
    assert at(points, "laneserve.requests.shed", lane="bulk", reason="CANCELLED") == 1
    assert at(points, "laneserve.requests.completed", lane="standard", status="OK") == 1
    assert at(points, "laneserve.requests.completed", lane="interactive", status="OK") == 1
    assert (
        at(points, "laneserve.requests.completed", lane="standard", status="EXPIRED_IN_QUEUE") == 1
    )
    # Histograms: one sample per request answered, per request dispatched, per batch.
    duration = "laneserve.request.duration"
    assert at(points, duration, lane="standard", status="OK") == 1
    assert at(points, duration, lane="interactive", status="OK") == 1
    assert at(points, duration, lane="standard", status="EXPIRED_IN_QUEUE") == 1
    assert at(points, duration, lane="bulk", status="CANCELLED") == 1
    assert at(points, "laneserve.queue.wait", lane="standard") == 1
    assert at(points, "laneserve.queue.wait", lane="interactive") == 1
    assert at(points, "laneserve.batch.size") == 2
    assert at(points, "laneserve.infer.duration", status="OK") == 2
    assert at(points, "laneserve.batch.cap") == max_batch_size
    assert at(points, "laneserve.lane.depth", lane="interactive") == 0
    # No GPU and no memory limit here: those gauges are absent, not zero.
    assert "laneserve.device.utilization" not in names(points)
    assert "laneserve.device.memory.used" not in names(points)


def test_get_stats_counts_a_batch_by_reason_once_it_has_run(small_model: Path) -> None:
    """`batch_reasons` counted a batch as it formed, `batches` (and Prometheus'
    laneserve_batches_total{reason}) as it ended: while a batch ran they disagreed, and
    for good when a stop left one running."""

    async def scenario() -> list[tuple[int, int]]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            engine.hold()
            call = asyncio.ensure_future(s.stub.Infer(request(rows(1))))
            await entered(engine)
            running = await s.stub.GetStats(pb.GetStatsRequest())
            engine.release()
            await call
            ran = await s.stub.GetStats(pb.GetStatsRequest())
        return [(stats.batches, sum(stats.batch_reasons.values())) for stats in (running, ran)]

    assert asyncio.run(scenario()) == [(0, 0), (1, 1)]


def check_same_figures_in_get_stats(stats: pb.GetStatsResponse, points: Points) -> None:
    """GetStats after the scenario above reports what the metrics recorded."""
    lane_stats = {lane.name: lane for lane in stats.lanes}
    # Every end of an admitted request, by status, is `answered` and the Prometheus
    # counter "completed"; GetStats' `completed` counts the OK ends alone, `failed` those
    # neither OK nor shed (as the proto's comments say: the names differ, the counts not).
    completed = series(points, "laneserve.requests.completed", "lane", "status")
    for lane in stats.lanes:
        ends = {status: count for (name, status), count in completed.items() if name == lane.name}
        assert dict(lane.answered) == {status: count for status, count in ends.items() if count}
        assert lane.completed == lane.answered.get("OK", 0)
        shed = lane.answered.get("EXPIRED_IN_QUEUE", 0) + lane.answered.get("CANCELLED", 0)
        assert lane.admitted == lane.completed + lane.failed + shed
    assert lane_stats["standard"].admitted == 2
    assert dict(lane_stats["interactive"].rejected) == {"LANE_FULL": 1}
    assert dict(lane_stats["standard"].shed) == {"EXPIRED_IN_QUEUE": 1}
    assert dict(lane_stats["bulk"].shed) == {"CANCELLED": 1}
    assert dict(lane_stats["standard"].answered) == {"OK": 1, "EXPIRED_IN_QUEUE": 1}
    assert lane_stats["standard"].request_duration.count == 1
    assert lane_stats["interactive"].request_duration.count == 1
    assert lane_stats["interactive"].queue_wait.count == 1
    assert stats.batch_size.count == 2
    assert stats.batch_size.mean == 3.0  # batches of 2 and 4 rows
    assert sum(stats.batch_reasons.values()) == 2
    assert stats.failed_batches == 0
    assert not stats.HasField("device_utilization")


def test_metrics_move_as_requests_are_admitted_refused_shed_and_completed(
    small_model: Path,
) -> None:
    lanes = (
        LaneConfig("interactive", capacity_rows=4, timeout_ms=60_000, max_wait_ms=0, min_share=0),
        LaneConfig("standard", capacity_rows=64, timeout_ms=60_000, max_wait_ms=0, min_share=0),
        LaneConfig("bulk", capacity_rows=64, timeout_ms=60_000, max_wait_ms=0, min_share=0),
    )

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, lanes=lanes)
        reader = InMemoryMetricReader()
        telemetry = Telemetry(
            lanes=lanes,
            providers=engine.providers,
            max_batch_size=server_config.max_batch_size,
            metric_readers=[reader],
        )
        async with serving(engine, server_config, telemetry=telemetry) as s:
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(2), lane="standard")))
            await entered(engine)
            full = asyncio.ensure_future(s.stub.Infer(request(rows(4), lane="interactive")))
            await until(lambda: queued_requests(s) == 1)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.Infer(request(rows(1), lane="interactive"))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await s.stub.Infer(request(rows(1), lane="standard", timeout_ms=50))
            assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            abandoned = s.stub.Infer(request(rows(1), lane="bulk"))
            await until(lambda: queued_requests(s) == 2)
            abandoned.cancel()
            await until(lambda: queued_requests(s) == 1)
            before = collect(reader)
            assert at(before, "laneserve.lane.depth", lane="interactive") == 4
            assert at(before, "laneserve.lane.capacity", lane="interactive") == 4
            engine.release()
            await asyncio.gather(running, full)
            await until(
                lambda: (
                    at(collect(reader), "laneserve.requests.shed", lane="bulk", reason="CANCELLED")
                    == 1
                )
            )
            points = collect(reader)
            stats = await s.stub.GetStats(pb.GetStatsRequest())

        check_recorded_metrics(points, server_config.max_batch_size)
        check_same_figures_in_get_stats(stats, points)

    asyncio.run(scenario())


def test_the_proto_says_which_count_of_request_ends_is_which() -> None:
    """GetStats' lanes[].completed counts the OK ends and laneserve_requests_completed_total
    every end (GetStats' lanes[].answered): the fields keep their names for wire
    compatibility, so their comments say which is which (the README said GetStats and
    Prometheus report the same figures, and the fields had no comment)."""
    proto = (REPO / "protos" / "laneserve" / "v1" / "inference.proto").read_text()
    lane_stats = proto[proto.index("message LaneStats {") :]
    lines = lane_stats[: lane_stats.index("\n}")].splitlines()

    def comment(field: str) -> str:
        """The comment lines right above `field`, as one line."""
        at = start = lines.index(f"  {field}")
        while lines[start - 1].startswith("  //"):
            start -= 1
        return " ".join(line.removeprefix("  //").strip() for line in lines[start:at])

    assert 'answered["OK"]' in comment("uint64 completed = 5;")
    assert "laneserve_requests_completed_total" in comment("uint64 completed = 5;")
    assert "neither OK nor EXPIRED_IN_QUEUE nor CANCELLED" in comment("uint64 failed = 6;")
    assert "laneserve_requests_completed_total" in comment("map<string, uint64> answered = 21;")
    assert "laneserve_requests_late_total" in comment("uint64 late = 22;")


def test_an_answer_run_past_its_timeout_is_counted_late_where_an_operator_looks(
    small_model: Path,
) -> None:
    """On a manual clock: a request of timeout_ms 1 000 is admitted and runs; its run is
    held while the clock moves 2 s. It is answered OK (the work is done, and no gRPC
    deadline ended its call), and counted late: GetStats' lanes[].late,
    laneserve_requests_late_total{lane} and its `reply` span's laneserve.late. One
    answered in time counts in none. An answer past its own timeout_ms was counted OK
    like any other, and nothing showed that admission had misjudged the run time (an
    operator's evaluation: 352 of 750 such answers, none seen)."""
    reader = InMemoryMetricReader()

    async def scenario() -> tuple[pb.GetStatsResponse, Points, InMemorySpanExporter]:
        clock = ManualClock()
        engine = RecordingEngine(str(small_model))
        # A batch of one row is full: it goes at once, where one waiting for company on
        # this clock would wait until the test moved it.
        server_config = config(small_model, max_batch_size=1)
        telemetry, exporter = traced(engine, server_config, reader=reader)
        async with serving(engine, server_config, telemetry=telemetry, clock=clock) as s:
            await s.stub.Infer(request(rows(1), request_id="in-time", timeout_ms=1_000))
            engine.hold_next()
            late = asyncio.ensure_future(
                s.stub.Infer(request(rows(1), request_id="late", timeout_ms=1_000))
            )
            await entered(engine)
            clock.advance(2.0)
            engine.release()
            answer = await late
            assert answer.request_id == "late"
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            return stats, collect(reader), exporter

    stats, points, exporter = asyncio.run(scenario())
    lanes = {lane.name: lane for lane in stats.lanes}
    assert (lanes["standard"].completed, lanes["standard"].late) == (2, 1)
    assert {name: lane.late for name, lane in lanes.items() if name != "standard"} == {
        "interactive": 0,
        "bulk": 0,
    }
    assert series(points, "laneserve.requests.late", "lane") == {
        ("interactive",): 0,
        ("standard",): 1,
        ("bulk",): 0,
    }
    replies = {
        str(dict(span.attributes or {}).get("laneserve.request_id")): dict(span.attributes or {})
        for span in spans_named(exporter, "reply")
    }
    assert replies["late"].get("laneserve.late") is True
    assert "laneserve.late" not in replies["in-time"]


def test_memory_and_out_of_memory_events_reach_the_metrics() -> None:
    """As in a server: events reach the stats recorder and the metrics sink; the counters
    are read from the recorder (one count for GetStats and Prometheus), the memory
    gauges from the sink."""
    reader = InMemoryMetricReader()
    lanes = ServerConfig(model_path="m.onnx").lanes
    telemetry = cpu_telemetry(metric_readers=[reader])
    metrics = telemetry.metrics
    assert metrics is not None
    stats = StatsRecorder([lane.name for lane in lanes])
    telemetry.observe(cpu_sources(stats))
    events = FanOut(stats, metrics)
    events.out_of_memory(64)
    events.batch_split(1, 64, 1)
    events.cap_changed(64, 32, "out_of_memory", ((4,),))
    events.memory_sampled(3 << 30, 8 << 30)
    points = collect(reader)
    telemetry.close()
    assert at(points, "laneserve.device.out_of_memory") == 1
    assert at(points, "laneserve.batch.splits") == 1
    assert at(points, "laneserve.batch.cap.changes", reason="out_of_memory") == 1
    assert at(points, "laneserve.device.memory.used") == 3 << 30
    assert at(points, "laneserve.device.memory.budget") == 8 << 30


def test_the_infer_duration_has_a_sample_per_batch_under_its_status(small_model: Path) -> None:
    """An operator read laneserve_infer_duration_seconds after out of memory: its count
    was the batches', all OK, and none of the runs that ran out of memory, where the
    README said "every run, failed ones under their status". It has one sample per batch,
    as laneserve_batches_total counts them (a batch run in parts after out of memory is
    one, OK while rows of it ran: the session time of all its runs), under the error of
    a batch none of whose rows ran; the runs out of memory are
    laneserve_device_out_of_memory_total's."""
    too_large = 1_000.0  # a row tagged so fails even alone

    class OutOfMemoryOverOneRow(RecordingEngine):
        armed = False  # after the start-up probe, which would set the batch cap to 1

        def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
            rows_in = next(iter(inputs.values()))
            if self.armed and (len(rows_in) > 1 or rows_in[0, 0] >= too_large):
                raise DeviceMemoryError("injected: out of memory")
            return super().run(inputs)

    async def scenario() -> Points:
        engine = OutOfMemoryOverOneRow(str(small_model))
        server_config = config(small_model)
        reader = InMemoryMetricReader()
        telemetry = Telemetry(
            lanes=server_config.lanes,
            providers=engine.providers,
            max_batch_size=server_config.max_batch_size,
            metric_readers=[reader],
        )
        async with serving(engine, server_config, telemetry=telemetry) as s:
            engine.armed = True
            await s.stub.Infer(request(rows(4), request_id="split"))  # runs of 4, 2, 2 fail
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.Infer(request(rows(1, start=int(too_large)), request_id="large"))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await until(lambda: at(collect(reader), "laneserve.batch.size") == 2)
            points = collect(reader)
        telemetry.close()
        return points

    points = asyncio.run(scenario())
    assert series(points, "laneserve.infer.duration", "status") == {
        ("OK",): 1,
        ("DEVICE_MEMORY",): 1,
    }
    assert sum(series(points, "laneserve.batches", "reason", "status").values()) == 2
    assert at(points, "laneserve.device.out_of_memory") == 3 + 1


def test_the_memory_gauges_say_what_they_read_on_the_cpu_too() -> None:
    """On the CPU the "device memory" gauges read this process's resident memory against
    --host-memory-limit (the watermark's limit), not the arena's --memory-limit; their
    help said "Device memory in use" and "The device memory limit (budget)", so a
    scraper read 4 GiB as the arena's budget of 256 MiB."""
    reader = InMemoryMetricReader()
    telemetry = cpu_telemetry(metric_readers=[reader])
    assert telemetry.metrics is not None
    telemetry.metrics.memory_sampled(3 << 30, 8 << 30)
    data = reader.get_metrics_data()
    telemetry.close()
    assert data is not None
    help_of = {
        metric.name: metric.description or ""
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert "resident memory" in help_of["laneserve.device.memory.used"]
    assert "host_memory_limit" in help_of["laneserve.device.memory.budget"]


def series(points: Points, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """The values of metric `name`, keyed by the values of its attributes `keys`."""
    return {
        tuple(str(dict(attributes)[key]) for key in keys): value
        for (metric, attributes), value in points.items()
        if metric == name
    }


def test_every_counter_series_is_reported_from_the_start_at_zero() -> None:
    """A series that appears only at its first event cannot be alerted on with increase()
    or rate(): Prometheus has no earlier sample to compare it with, so the first refusal,
    shed request or failed batch went unseen. Each lane's refusal reasons, shed reasons
    and end statuses, and each dispatch reason's batch statuses, are 0 from the start."""
    reader = InMemoryMetricReader()
    lanes = ServerConfig(model_path="m.onnx").lanes
    telemetry = cpu_telemetry(metric_readers=[reader])
    stats = StatsRecorder([lane.name for lane in lanes])
    telemetry.observe(cpu_sources(stats))
    before = collect(reader)
    stats.rejected("bulk", "LANE_FULL", 0.0)
    after = collect(reader)
    telemetry.close()

    lane_names = ("interactive", "standard", "bulk")
    refusals = (
        "ANSWER_TOO_LARGE",  # a retry that joined or replayed an answer over its limit
        "INVALID_INPUT",
        "REQUEST_ID_REUSED",
        "DRAINING",
        "DEADLINE_UNMEETABLE",
        "EXPIRED_IN_QUEUE",  # a retry that waited for its request_id's flight too long
        "MEMORY_PRESSURE",
        "JOIN_LIMIT",  # a retry past the callers one request in flight may have
        "LANE_FULL",
        "ENGINE_FAILURE",  # a submission after the scheduler failed for good
        "REGION_NOT_FOUND",  # a KServe tensor placed in a shared memory region not there
        "SHARED_MEMORY_REFUSED",  # ... or while shared memory is off, or from elsewhere
        "CANCELLED",  # a stream item whose stream ended while it waited for room
    )
    ends = (
        "OK",
        "EXPIRED_IN_QUEUE",
        "ENGINE_FAILURE",
        "DEVICE_MEMORY",
        "ANSWER_TOO_LARGE",
        "DRAINING",
        "CANCELLED",
        "DEADLINE_EXCEEDED",
    )
    shed = ("EXPIRED_IN_QUEUE", "CANCELLED")
    dispatch = ("full", "max_wait", "deadline", "backlog", "idle")
    batch_ends = ("OK", "ENGINE_FAILURE", "DEVICE_MEMORY", "EXPIRED_IN_QUEUE", "DRAINING")
    # Metric: its attribute names, and every key it reports from the start.
    expected: dict[str, tuple[tuple[str, ...], Iterable[tuple[str, ...]]]] = {
        "laneserve.requests.admitted": (("lane",), itertools.product(lane_names)),
        "laneserve.requests.rejected": (
            ("lane", "reason"),
            itertools.product(lane_names, refusals),
        ),
        "laneserve.requests.shed": (("lane", "reason"), itertools.product(lane_names, shed)),
        "laneserve.requests.completed": (
            ("lane", "status"),
            itertools.product(lane_names, ends),
        ),
        "laneserve.batches": (("reason", "status"), itertools.product(dispatch, batch_ends)),
        "laneserve.batch.cap.changes": (
            ("reason",),
            itertools.product(("out_of_memory", "recovered")),
        ),
    }
    for name, (attributes, known) in expected.items():
        zeros = dict.fromkeys(known, 0)
        assert series(before, name, *attributes) == zeros, name
        moved: dict[tuple[str, ...], int] = (
            {("bulk", "LANE_FULL"): 1} if name == "laneserve.requests.rejected" else {}
        )
        assert series(after, name, *attributes) == {**zeros, **moved}, name
    assert at(before, "laneserve.device.out_of_memory") == 0
    assert at(before, "laneserve.batch.splits") == 0


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback http
        text: str = response.read().decode()
        return text


def test_prometheus_endpoint_serves_the_metrics_over_http(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:  # metrics on an ephemeral port
            port = s.server.metrics_port
            assert port is not None
            assert port > 0
            await s.stub.Infer(request(rows(2), lane="interactive"), timeout=10)
            text = await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/metrics")
        families = {family.name: family for family in text_string_to_metric_families(text)}
        admitted = [
            sample
            for sample in families["laneserve_requests_admitted"].samples
            if sample.name == "laneserve_requests_admitted_total"
        ]
        # Every lane's counter exists from the start (0 until its first request), so a
        # rate over it is defined from the first scrape.
        assert {sample.labels["lane"]: sample.value for sample in admitted} == {
            "interactive": 1.0,
            "standard": 0.0,
            "bulk": 0.0,
        }
        wait = families["laneserve_queue_wait_seconds"]
        assert wait.type == "histogram"
        bounds = {sample.labels["le"] for sample in wait.samples if sample.name.endswith("_bucket")}
        assert {"0.0005", "0.001", "120.0", "+Inf"} <= bounds
        assert families["laneserve_batch_size"].type == "histogram"
        capacity = {
            sample.labels["lane"]: sample.value
            for sample in families["laneserve_lane_capacity"].samples
        }
        assert capacity == {"interactive": 512.0, "standard": 2048.0, "bulk": 16384.0}
        assert "laneserve_request_duration_seconds" in families
        # gRPC's own count of the server's calls (Channelz): the one Infer call.
        grpc_calls = {
            sample.labels["state"]: sample.value
            for sample in families["laneserve_grpc_calls"].samples
            if sample.name == "laneserve_grpc_calls_total"
        }
        assert grpc_calls == {"started": 1.0, "succeeded": 1.0, "failed": 0.0}
        # The cap's moves too (it appeared only at its first change).
        cap_changes = {
            sample.labels["reason"]: sample.value
            for sample in families["laneserve_batch_cap_changes"].samples
            if sample.name == "laneserve_batch_cap_changes_total"
        }
        assert cap_changes == {"out_of_memory": 0.0, "recovered": 0.0}
        # The cap against the probed cap it returns to: a cap below it was not seen on
        # /metrics, only in GetStats (a review).
        (cap,) = families["laneserve_batch_cap"].samples
        (probed,) = families["laneserve_batch_cap_max"].samples
        assert probed.value == cap.value > 0

        def total(family: str, **labels: str) -> float | None:
            samples = families[family].samples if family in families else []
            return next(
                (
                    sample.value
                    for sample in samples
                    if sample.name == f"{family}_total"
                    and all(sample.labels.get(key) == value for key, value in labels.items())
                ),
                None,
            )

        # So are the other counters' series, before their first event (every one of them:
        # test_every_counter_series_is_reported_from_the_start_at_zero).
        assert total("laneserve_requests_rejected", lane="bulk", reason="LANE_FULL") == 0.0
        assert total("laneserve_requests_shed", lane="bulk", reason="EXPIRED_IN_QUEUE") == 0.0
        assert total("laneserve_requests_completed", lane="interactive", status="OK") == 1.0
        assert total("laneserve_requests_completed", lane="bulk", status="ENGINE_FAILURE") == 0.0
        assert total("laneserve_batches", reason="full", status="ENGINE_FAILURE") == 0.0
        assert "laneserve_device_utilization_ratio" not in families  # no GPU here
        # The endpoint goes away with the server.
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/metrics")

    asyncio.run(scenario())


# ---- what Prometheus sees, against GetStats ---------------------------------------------

MIB = 1 << 20


def scrape(port: int | None) -> dict[str, Any]:
    """The server's /metrics, as metric families by name."""
    assert port is not None
    text = fetch(f"http://127.0.0.1:{port}/metrics")
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_answers_grpc_could_not_send_are_scraped_by_method_from_the_start(
    small_model: Path,
) -> None:
    """laneserve_answers_unsent_total{method}: what the answers_unsent line counts (gRPC's
    record of an answer it could not send, its call ended first), there at 0 for the
    unary inference methods from the first scrape (a rate over a series that appears
    later is none)."""
    from grpc._cython import cygrpc  # noqa: PLC0415 - the exception gRPC raises

    core = logging.getLogger("grpc._cython.cygrpc")
    unsent = cygrpc.ExecuteBatchError('Failed "execute_batch"')
    infer = "/laneserve.v1.InferenceService/Infer"
    model_infer = "/inference.GRPCInferenceService/ModelInfer"

    async def scenario() -> tuple[dict[str, float], dict[str, float]]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            before = await asyncio.to_thread(scrape, s.server.metrics_port)
            for _ in range(2):
                core.error(
                    "ExecuteBatchError raised in core by servicer method [%s]" % infer,  # noqa: UP031 - gRPC's own form
                    exc_info=(type(unsent), unsent, None),
                )
            after = await asyncio.to_thread(scrape, s.server.metrics_port)
        name = "laneserve_answers_unsent"
        return values(before, name, "method"), values(after, name, "method")

    before, after = asyncio.run(scenario())
    assert before == {infer: 0.0, model_infer: 0.0}
    assert after == {infer: 2.0, model_infer: 0.0}


def test_the_process_open_files_and_their_limit_are_scraped(small_model: Path) -> None:
    """Idle connections took every file of the process and nothing on the endpoint told
    it: prometheus_client's process figures (open files, their limit, resident memory,
    CPU) are scraped beside laneserve's."""

    async def scenario() -> dict[str, Any]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(scrape, s.server.metrics_port)

    families = asyncio.run(scenario())
    (open_files,) = families["process_open_fds"].samples
    (limit,) = families["process_max_fds"].samples
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert limit.value == soft
    assert 0 < open_files.value < limit.value
    assert families["process_resident_memory_bytes"].samples[0].value > 0


def test_grpcs_unsent_answer_records_are_taken_only_from_the_start_to_the_close() -> None:
    """The filter on gRPC's logger goes on as the server starts and off at close: one put
    on as the telemetry was made took every later server's records where it was never
    closed (a server that never started). A record whose arguments do not format is left
    to its handler, not raised into gRPC."""
    core = logging.getLogger("grpc._cython.cygrpc")
    telemetry = cpu_telemetry()
    try:
        assert telemetry.unsent_answers not in core.filters
        telemetry.count_unsent_answers(("laneserve.v1.InferenceService",), ())
        assert telemetry.unsent_answers in core.filters
        broken = logging.LogRecord(core.name, logging.ERROR, "x", 1, "%s and %s", ("one",), None)
        assert telemetry.unsent_answers.filter(broken)
    finally:
        telemetry.close()
    assert telemetry.unsent_answers not in core.filters


def values(families: dict[str, Any], name: str, key: str) -> dict[str, float]:
    """The samples of gauge `name`, by the value of their label `key`."""
    return {sample.labels[key]: sample.value for sample in families[name].samples}


def only_value(families: dict[str, Any], name: str) -> float:
    (sample,) = families[name].samples
    return float(sample.value)


def histogram_quantile(q: float, families: dict[str, Any], name: str) -> float:
    """Prometheus' histogram_quantile over the buckets of histogram `name` (one series):
    linear interpolation inside the bucket that holds the rank q * count."""
    buckets: list[tuple[float, float]] = sorted(
        (float(sample.labels["le"]), float(sample.value))
        for sample in families[name].samples
        if sample.name == f"{name}_bucket"
    )
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    raise AssertionError("no bucket holds the rank")


def test_lanes_closed_by_the_memory_watermark_and_its_marks_are_scraped(
    small_model: Path,
) -> None:
    """GetStats showed the lanes the watermark closed; /metrics showed nothing of it, and
    rejected{reason="MEMORY_PRESSURE"} stops moving while lanes stay closed (nobody
    calls a closed lane for long), so no alert could see it. Each lane's closed state is
    scraped (0 or 1, from the first scrape), with both marks in the units of
    laneserve_device_memory_used_bytes (`used >= high` is the alert), the budget they
    are fractions of, and the arena's cap (memory_limit) as its own gauge."""
    lanes = ("interactive", "standard", "bulk")

    async def scenario() -> None:
        gauge = SettableGauge()
        # 32 MiB: the CPU arena's cap is one per process, and other tests' engines in this
        # process take that one (test_ledger's ARENA, test_memory's DEMO_BUDGET).
        server_config = config(small_model, host_memory_limit="100MiB", memory_limit="32MiB")
        engine = RecordingEngine(str(small_model), memory_limit=parse_memory_limit("32MiB"))
        async with serving(engine, server_config, memory_gauge=gauge) as s:
            watermark = s.server.scheduler.watermark
            assert watermark is not None
            port = s.server.metrics_port

            async def closed_at(used_bytes: int) -> tuple[dict[str, Any], pb.GetStatsResponse]:
                gauge.value = used_bytes
                await until(lambda: watermark.used_bytes == used_bytes)  # sampled every 50 ms
                families = await asyncio.to_thread(scrape, port)
                return families, await s.stub.GetStats(pb.GetStatsRequest())

            for used_bytes, closed in (
                (50 * MIB, []),
                (99 * MIB, ["standard", "bulk"]),
                # Idle (nothing queued or running): the reading's own level, no hysteresis.
                (96 * MIB, ["bulk"]),
                (90 * MIB, []),
            ):
                families, stats = await closed_at(used_bytes)
                assert list(stats.lanes_closed_by_memory) == closed
                assert values(families, "laneserve_lane_closed_by_memory", "lane") == {
                    lane: float(lane in closed) for lane in lanes
                }
                used = only_value(families, "laneserve_device_memory_used_bytes")
                high = only_value(families, "laneserve_device_memory_high_watermark_bytes")
                low = only_value(families, "laneserve_device_memory_low_watermark_bytes")
                assert used == stats.memory_used_bytes == used_bytes
                assert (high, low) == (
                    stats.memory_high_watermark_bytes,
                    stats.memory_low_watermark_bytes,
                )
                assert (used >= high) == (used_bytes >= 95 * MIB)
                budget = only_value(families, "laneserve_device_memory_budget_bytes")
                assert budget == stats.memory_watermark_limit_bytes == 100 * MIB
                limit = only_value(families, "laneserve_device_memory_limit_bytes")
                assert limit == stats.memory_limit_bytes == 32 * MIB
            help_of = {
                name: family.documentation
                for name, family in (await asyncio.to_thread(scrape, port)).items()
            }
            assert "host_memory_limit on the CPU" in help_of["laneserve_device_memory_budget_bytes"]
            assert "memory_limit" in help_of["laneserve_device_memory_limit_bytes"]

    asyncio.run(scenario())


def test_without_a_memory_limit_every_lane_is_open_and_no_mark_is_scraped(
    small_model: Path,
) -> None:
    """On the CPU without host_memory_limit there is no watermark: every lane is scraped
    open (an alert on laneserve_lane_closed_by_memory needs no other series), and the
    figures in bytes that do not exist are absent, not 0."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            families = await asyncio.to_thread(scrape, s.server.metrics_port)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        assert values(families, "laneserve_lane_closed_by_memory", "lane") == {
            "interactive": 0.0,
            "standard": 0.0,
            "bulk": 0.0,
        }
        assert stats.memory_high_watermark_bytes == 0  # no watermark
        for absent in ("used", "budget", "high_watermark", "low_watermark", "limit"):
            assert f"laneserve_device_memory_{absent}_bytes" not in families

    asyncio.run(scenario())


def test_a_collection_reads_the_watermark_once() -> None:
    """Each read of the watermark takes the scheduler's lock, which admission and batch
    forming wait on: a scrape read it three times (the closed lanes and each mark). The
    marks never change and are handed over as values; the closed lanes are read once."""
    reader = InMemoryMetricReader()
    telemetry = cpu_telemetry(metric_readers=[reader])
    reads: list[WatermarkState] = []

    def watermark() -> WatermarkState:
        reads.append(WatermarkState(None, 90, 80, ("bulk",), limit_bytes=100))
        return reads[-1]

    sources = dataclasses.replace(
        cpu_sources(StatsRecorder(["interactive", "standard", "bulk"])),
        watermark=watermark,
        high_watermark_bytes=90,
        low_watermark_bytes=80,
    )
    telemetry.observe(sources)
    points = collect(reader)
    telemetry.close()
    assert len(reads) == 1
    assert at(points, "laneserve.device.memory.high_watermark") == 90
    assert at(points, "laneserve.device.memory.low_watermark") == 80
    assert series(points, "laneserve.lane.closed_by_memory", "lane") == {
        ("interactive",): 0,
        ("standard",): 0,
        ("bulk",): 1,
    }


def test_build_info_and_the_server_state_say_what_serves_and_whether_it_drains(
    small_model: Path,
) -> None:
    """A CUDA session the runtime built on the CPU (cuda_unavailable) and a server that
    drains were invisible to Prometheus: laneserve_build_info names the version, the model
    and the session's providers as GetModel does, and laneserve_server_state is 1 for
    the lifecycle state now, 0 for the others. The model is the file's name and the start
    of its SHA-256: its path as typed (./m.onnx or absolute) named the same model two ways
    and stayed the same when the file was replaced."""
    states = ("STARTING", "SERVING", "DRAINING", "STOPPED")

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            port = s.server.metrics_port
            model = await s.stub.GetModel(pb.GetModelRequest())
            serving_now = await asyncio.to_thread(scrape, port)
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1))))
            await entered(engine)
            stopping = asyncio.ensure_future(s.server.stop(grace_s=30.0))
            await until(lambda: s.server.state is Lifecycle.DRAINING)
            draining = await asyncio.to_thread(scrape, port)
            engine.release()
            await running
            await stopping
        (info,) = serving_now["laneserve_build_info"].samples
        assert info.value == 1
        keys = ("version", "model", "model_sha256", "providers")
        assert {key: info.labels[key] for key in keys} == {
            "version": importlib.metadata.version("laneserve"),
            "model": Path(model.model_path).name,
            "model_sha256": model.model_sha256[:12],
            "providers": ",".join(model.providers),
        }
        assert model.server_version == info.labels["version"]
        assert model.model_path == str(small_model) != small_model.name
        assert len(model.model_sha256) == 64  # hex SHA-256: the label is its start
        for families, now in ((serving_now, "SERVING"), (draining, "DRAINING")):
            assert values(families, "laneserve_server_state", "state") == {
                state: float(state == now) for state in states
            }

    asyncio.run(scenario())


def test_target_info_names_the_instance_get_stats_names(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """target_info's service_instance_id (the SDK's, one per process) was not GetStats'
    instance_id (the servicer's): a dashboard could not join the two. One id is made per
    server and given to both. An instance named in OTEL_RESOURCE_ATTRIBUTES wins in
    target_info (the operator's join key); GetStats keeps its per-start id, which
    `laneserve top` reads to tell a restart from the same server."""

    async def instance_ids() -> tuple[str, str]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            families = await asyncio.to_thread(scrape, s.server.metrics_port)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        (target,) = families["target_info"].samples
        return target.labels["service_instance_id"], stats.instance_id

    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    scraped, reported = asyncio.run(instance_ids())
    assert scraped == reported != ""
    again, reported_again = asyncio.run(instance_ids())
    assert again == reported_again != reported  # one per server, not per process
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=replica-7")
    scraped, reported = asyncio.run(instance_ids())
    assert scraped == "replica-7"
    assert reported not in ("", "replica-7", reported_again)


def test_latency_buckets_are_fine_enough_for_histogram_quantile(small_model: Path) -> None:
    """histogram_quantile() interpolates inside a bucket, so adjacent bounds 2-2.5x apart
    (1-2-5 per decade from 0.5 ms) read p99 at 1.4-1.7x GetStats' exact one, and a small
    model's 43 us median as 282 us. Bounds from 50 us or less to 120 s, at most 5/3
    apart, and few enough that buckets x lanes x statuses stays moderate."""

    async def scenario() -> dict[str, Any]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            await s.stub.Infer(request(rows(1)))
            return await asyncio.to_thread(scrape, s.server.metrics_port)

    families = asyncio.run(scenario())
    for name in (
        "laneserve_queue_wait_seconds",
        "laneserve_infer_duration_seconds",
        "laneserve_request_duration_seconds",
    ):
        bounds = sorted(
            {
                float(sample.labels["le"])
                for sample in families[name].samples
                if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf"
            }
        )
        assert bounds[0] <= 0.00005, name
        assert bounds[-1] >= 120.0, name
        assert max(upper / lower for lower, upper in itertools.pairwise(bounds)) <= 5 / 3 + 1e-9
        assert len(bounds) <= 45, name


def test_the_median_of_mostly_full_batches_reads_near_get_stats_median(
    small_model: Path,
) -> None:
    """Batch sizes at powers-of-two bounds alone put every full batch at a cap of 32 in
    (16, 32]: histogram_quantile(0.5) read 18.5 rows where GetStats' p50 was 32. With
    steps of a quarter between powers of two it reads within 15% (rows are exact: each
    request below runs as a batch of its own)."""

    async def scenario() -> tuple[dict[str, Any], pb.GetStatsResponse]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=32)) as s:
            for size in (5, 5, 5) + (32,) * 9:  # one after another: one batch each
                await s.stub.Infer(request(rows(size), lane="standard"))
            families = await asyncio.to_thread(scrape, s.server.metrics_port)
            return families, await s.stub.GetStats(pb.GetStatsRequest())

    families, stats = asyncio.run(scenario())
    assert stats.batch_cap == 32
    assert stats.batch_size.count == 12
    assert stats.batch_size.p50 == 32
    median = histogram_quantile(0.5, families, "laneserve_batch_size")
    assert abs(median / stats.batch_size.p50 - 1) <= 0.15, median


# How long the first of two scrapes waits for the second to collect beside it. Scrapes
# taken one at a time never do: the wait lapses, and its length is asserted nowhere.
SCRAPE_OVERLAP_WAIT_S = 2.0


def type_lines(body: str) -> list[str]:
    return sorted(line for line in body.splitlines() if line.startswith("# TYPE"))


def test_scrapes_at_the_same_time_each_get_every_metric_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two scrapers at once (an HA pair of Prometheus servers, a scrape and a curl): the
    exporter queues each scrape's collection in one shared deque and writes out all it
    finds there, so one scrape wrote every family twice (duplicate `# TYPE` lines, which
    Prometheus rejects) and the other came back empty (every series stale)."""
    stats = StatsRecorder([lane.name for lane in ServerConfig(model_path="m.onnx").lanes])
    telemetry = cpu_telemetry(prometheus=True)
    telemetry.observe(cpu_sources(stats))
    first_collected, second_collected = threading.Event(), threading.Event()
    add_metrics_data = otel_prometheus._CustomCollector.add_metrics_data
    overlap = False  # the scrape alone first: it waits for none

    def add_then_wait(collector: Any, data: Any) -> None:
        add_metrics_data(collector, data)
        if first_collected.is_set():
            second_collected.set()
        elif overlap:
            first_collected.set()
            second_collected.wait(SCRAPE_OVERLAP_WAIT_S)

    monkeypatch.setattr(otel_prometheus._CustomCollector, "add_metrics_data", add_then_wait)
    bodies: dict[str, str] = {}

    def scrape(name: str) -> None:
        bodies[name] = fetch(f"http://127.0.0.1:{port}/metrics")

    try:
        port = telemetry.serve_metrics("127.0.0.1", 0)
        scrape("alone")
        overlap = True
        first = threading.Thread(target=scrape, args=("first",))
        first.start()
        assert first_collected.wait(30), "the first scrape collected nothing"
        second = threading.Thread(target=scrape, args=("second",))
        second.start()
        first.join(30)
        second.join(30)
    finally:
        telemetry.close()
    alone = type_lines(bodies["alone"])
    assert "# TYPE laneserve_requests_rejected_total counter" in alone
    assert len(alone) == len(set(alone))
    assert type_lines(bodies["first"]) == alone, "each family once"
    assert type_lines(bodies["second"]) == alone, "every family"


def test_a_scrape_for_some_names_gets_those_samples_alone() -> None:
    """`?name[]=...` (prometheus_client's filter, for a curl of one family) came back
    empty: the registry keeps only collectors that declare their names, and
    OpenTelemetry's declares none."""
    stats = StatsRecorder([lane.name for lane in ServerConfig(model_path="m.onnx").lanes])
    telemetry = cpu_telemetry(prometheus=True)
    telemetry.observe(cpu_sources(stats))
    try:
        port = telemetry.serve_metrics("127.0.0.1", 0)
        whole = fetch(f"http://127.0.0.1:{port}/metrics")
        some = fetch(
            f"http://127.0.0.1:{port}/metrics"
            "?name[]=laneserve_requests_rejected_total&name[]=laneserve_batch_cap"
        )
    finally:
        telemetry.close()
    wanted = {"laneserve_requests_rejected_total", "laneserve_batch_cap"}

    def named(body: str) -> list[str]:
        return [line for line in body.splitlines() if re.split("[{ ]", line)[0] in wanted]

    samples = [line for line in some.splitlines() if line and not line.startswith("#")]
    assert samples, some
    assert samples == named(some), "those names alone"
    assert samples == named(whole), "every sample of them"
    assert sorted(type_lines(some)) == [
        "# TYPE laneserve_batch_cap gauge",
        "# TYPE laneserve_requests_rejected_total counter",
    ]


def test_retries_answered_by_request_id_are_counted_and_the_replay_cache_measured(
    small_model: Path,
) -> None:
    """A retry joined to its request in flight, or answered from the stored answer, is
    neither admitted nor refused: no Prometheus counter saw it, and README's rule read
    the gap such retries open between grpc_calls started and the requests counted as
    calls gRPC's core refused. They are counted by how, from the start at 0, and the
    replay cache's gauges say what GetStats says it holds."""

    async def scenario() -> tuple[list[str], pb.GetStatsResponse]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            url = f"http://127.0.0.1:{s.server.metrics_port}/metrics"
            scrapes = [await asyncio.to_thread(fetch, url)]
            await s.stub.Infer(request(rows(1), request_id="once"), timeout=10)
            await s.stub.Infer(request(rows(1), request_id="once"), timeout=10)  # replayed
            engine.hold()
            first = asyncio.ensure_future(s.stub.Infer(request(rows(2), request_id="held")))
            await entered(engine)
            joined = asyncio.ensure_future(s.stub.Infer(request(rows(2), request_id="held")))
            await until_joined(s)
            engine.release()
            await asyncio.gather(first, joined)
            scrapes.append(await asyncio.to_thread(fetch, url))
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        return scrapes, stats

    scrapes, stats = asyncio.run(scenario())

    def figures(text: str) -> dict[str, float]:
        families = {family.name: family for family in text_string_to_metric_families(text)}
        found = {
            sample.labels["how"]: sample.value
            for sample in families["laneserve_requests_idempotent"].samples
            if sample.name == "laneserve_requests_idempotent_total"
        }
        for gauge in ("laneserve_replay_cache_entries", "laneserve_replay_cache_size_bytes"):
            (sample,) = families[gauge].samples
            found[gauge] = sample.value
        return found

    before, after = (figures(text) for text in scrapes)
    assert before == {
        "join": 0.0,
        "replay": 0.0,
        "laneserve_replay_cache_entries": 0.0,
        "laneserve_replay_cache_size_bytes": 0.0,
    }
    assert (stats.idempotent_joins, stats.idempotent_replays) == (1, 1)
    assert stats.replay_cache_entries == 2  # "once" and "held"
    assert stats.replay_cache_bytes > 0
    assert after == {
        "join": stats.idempotent_joins,
        "replay": stats.idempotent_replays,
        "laneserve_replay_cache_entries": stats.replay_cache_entries,
        "laneserve_replay_cache_size_bytes": stats.replay_cache_bytes,
    }


SHARED_MEMORY_METRICS = ("laneserve.shared_memory.regions", "laneserve.shared_memory.bytes")


def test_shared_memory_figures_are_the_registrys_and_absent_while_it_is_off(
    tmp_path: Path,
) -> None:
    """The regions registered now and the bytes each read took out of a region and each
    write put into one, both directions at 0 from the start; with shared memory off (no
    counts in the sources) neither figure is reported, not even 0."""
    reader = InMemoryMetricReader()
    telemetry = cpu_telemetry(metric_readers=[reader])
    sources = cpu_sources(StatsRecorder([lane.name for lane in DEFAULT_LANES]))
    regions = SharedMemoryRegions(enabled=True, directory=tmp_path)
    (tmp_path / "object").write_bytes(bytes(1024))
    try:
        telemetry.observe(sources)
        off = collect(reader)
        telemetry.observe(dataclasses.replace(sources, shared_memory=regions.counts))
        start = collect(reader)
        regions.register("r", "/object", 0, 1024)
        regions.read(Placement("r", 100, 300), "input 'x'")
        regions.write(Placement("r", 500, 200), b"\x01" * 150, "output 'y'", regions.get("r"))
        moved = collect(reader)
        regions.unregister("r")
        after = collect(reader)
    finally:
        regions.close()
        telemetry.close()

    def figures(points: Points) -> dict[str, float]:
        return {
            "regions": at(points, "laneserve.shared_memory.regions"),
            **{
                direction: value
                for (direction,), value in series(
                    points, "laneserve.shared_memory.bytes", "direction"
                ).items()
            },
        }

    assert not names(off) & set(SHARED_MEMORY_METRICS)
    assert set(SHARED_MEMORY_METRICS) <= names(start)
    assert figures(start) == {"regions": 0, "read": 0, "written": 0}
    assert figures(moved) == {"regions": 1, "read": 300, "written": 150}
    assert figures(after) == {"regions": 0, "read": 300, "written": 150}


def scraped_shared_memory(families: dict[str, Any]) -> dict[str, float]:
    """The shared memory figures of a scrape, under README's names."""
    found = {
        sample.labels["direction"]: sample.value
        for sample in families["laneserve_shared_memory_bytes"].samples
        if sample.name == "laneserve_shared_memory_bytes_total"
    }
    found["regions"] = only_value(families, "laneserve_shared_memory_regions")
    return found


def test_a_model_infer_through_shared_memory_is_scraped_as_its_regions_and_bytes(
    small_model: Path,
) -> None:
    """Shared memory on: Prometheus sees 0 regions and 0 bytes each way before any use,
    then the region registered, the input's bytes read out of it and the output's written
    into it by a ModelInfer placing both there (README's names)."""
    x = rows(3, seed=5)
    made_shm = SharedMemory()
    made = made_shm.create(input_bytes(x) + output_bytes(x))
    made.write(0, x.tobytes())

    async def scenario() -> list[dict[str, Any]]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, shm_config(small_model)) as s:
            stub = kserve_stub(s)
            scrapes = [await asyncio.to_thread(scrape, s.server.metrics_port)]
            await register(stub, "r", made)
            await stub.ModelInfer(
                shm_request(
                    x,
                    input_at=Placement("r", 0, input_bytes(x)),
                    output_at=Placement("r", input_bytes(x), output_bytes(x)),
                ),
                timeout=10,
            )
            scrapes.append(await asyncio.to_thread(scrape, s.server.metrics_port))
        return scrapes

    try:
        before, after = asyncio.run(scenario())
    finally:
        made_shm.close()
    assert scraped_shared_memory(before) == {"regions": 0.0, "read": 0.0, "written": 0.0}
    assert scraped_shared_memory(after) == {
        "regions": 1.0,
        "read": float(input_bytes(x)),
        "written": float(output_bytes(x)),
    }
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "`laneserve_shared_memory_regions`" in readme
    assert "`laneserve_shared_memory_bytes_total{direction=read|written}`" in readme


def test_shared_memory_off_scrapes_no_shared_memory_series(small_model: Path) -> None:
    """server.shared_memory false (the default): the figures are absent, not 0 (a 0
    would read as on and unused)."""

    async def scenario() -> dict[str, Any]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            assert not s.server.shared_memory.enabled
            await s.stub.Infer(request(rows(1)), timeout=10)
            return await asyncio.to_thread(scrape, s.server.metrics_port)

    families = asyncio.run(scenario())
    assert "laneserve_requests_admitted" in families  # the scrape has the others
    assert "laneserve_shared_memory_regions" not in families
    assert "laneserve_shared_memory_bytes" not in families


class _StandInNvml:
    """NVML's calls DeviceMonitor makes, answering a fixed utilisation: no GPU here."""

    class NVMLError(Exception):
        pass

    @staticmethod
    def nvmlDeviceGetUtilizationRates(_handle: object) -> Any:  # noqa: N802 - NVML's name
        return types.SimpleNamespace(gpu=37)

    @staticmethod
    def nvmlShutdown() -> None:  # noqa: N802 - NVML's name
        pass


def test_nvml_that_cannot_start_is_logged_as_an_event(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The NVML warnings were plain lines: no "event" member with --log-format json."""

    def refuse() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=refuse))
    caplog.set_level(logging.WARNING, logger="laneserve.server.telemetry")
    assert DeviceMonitor.open(["CUDAExecutionProvider", "CPUExecutionProvider"]) is None
    (record,) = caplog.records
    assert getattr(record, "event", None) == "nvml_unavailable"
    assert getattr(record, "fields", {}) == {"error": "NVML Shared Library Not Found"}
    document = json.loads(JsonFormatter().format(record))
    assert document["event"] == "nvml_unavailable"


class _RecordingNvml:
    """NVML's calls that open a GPU, recording which GPU each asked for: no GPU here."""

    NVMLError = RuntimeError

    def __init__(self) -> None:
        self.opened: list[tuple[str, object]] = []

    def nvmlInit(self) -> None:  # noqa: N802 - NVML's name
        pass

    def nvmlShutdown(self) -> None:  # noqa: N802 - NVML's name
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:  # noqa: N802 - NVML's name
        self.opened.append(("index", index))
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> object:  # noqa: N802 - NVML's name
        self.opened.append(("uuid", uuid))
        return uuid


@pytest.mark.parametrize(
    ("visible", "expected"),
    [(None, ("index", 0)), ("3,1", ("index", 3)), ("GPU-5d1c-aa01,2", ("uuid", "GPU-5d1c-aa01"))],
    ids=["unset", "indices", "uuid"],
)
def test_memory_and_utilisation_are_read_from_the_gpu_the_session_runs_on(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, expected: tuple[str, object]
) -> None:
    """The memory gauge read NVML's GPU 0 whatever CUDA_VISIBLE_DEVICES said: a server
    on GPU 3 took its memory budget and watermark readings from another GPU (the
    utilisation gauge read the right one). Both read CUDA's device 0 now."""
    nvml = _RecordingNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    NvmlGauge()
    monitor = DeviceMonitor.open(["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert monitor is not None
    assert nvml.opened == [expected, expected]


def test_the_engine_numbers_gpus_in_pci_order_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA numbers GPUs fastest first, NVML by PCI bus: on a host of unlike GPUs an
    index in CUDA_VISIBLE_DEVICES meant another GPU to each."""
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    prefer_pci_order()
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    prefer_pci_order()
    assert os.environ["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST", "an operator's choice stands"


def test_device_utilization_is_scraped_under_its_documented_name() -> None:
    """README names the gauge laneserve_device_utilization_ratio; the exporter gives unit
    "1" no suffix, so the instrument was scraped as laneserve_device_utilization."""
    telemetry = Telemetry(
        lanes=ServerConfig(model_path="m.onnx").lanes,
        providers=["CUDAExecutionProvider"],
        max_batch_size=64,
        prometheus=True,
        device=DeviceMonitor(_StandInNvml, handle=0),
    )
    try:
        port = telemetry.serve_metrics("127.0.0.1", 0)
        assert port is not None
        text = fetch(f"http://127.0.0.1:{port}/metrics")
    finally:
        telemetry.close()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    (sample,) = families["laneserve_device_utilization_ratio"].samples
    assert sample.value == pytest.approx(0.37)
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "`laneserve_device_utilization_ratio`" in readme


def test_no_help_text_names_a_metric_as_opentelemetry_names_it() -> None:
    """laneserve_answers_unsent_total's HELP said an OK answer "is counted OK in
    laneserve.requests.completed": the instrument's OpenTelemetry name, which no
    Prometheus query finds. A HELP names another metric as /metrics shows it. Scraped
    with every source on (an instrument that observes nothing has no HELP line), and
    checked to hold a HELP of every instrument `Metrics` creates."""
    lanes = ServerConfig(model_path="m.onnx").lanes
    device = DeviceMonitor(_StandInNvml, handle=0)
    meter = mock.Mock(wraps=NoOpMeter("laneserve"))
    Metrics(meter, lanes, device, ["CUDAExecutionProvider"])
    created = [call.args[0] for call in meter.method_calls if call[0].startswith("create_")]
    telemetry = Telemetry(
        lanes=lanes,
        providers=["CUDAExecutionProvider"],
        max_batch_size=64,
        prometheus=True,
        device=device,
    )
    stats = StatsRecorder([lane.name for lane in lanes])
    text_counts = TextThreadCounts(done={"decode": 1}, busy_s={"decode": 0.5}, pending=0)
    sources = dataclasses.replace(
        cpu_sources(stats),
        depths=lambda: [LaneDepth("standard", 3, 1, 2048)],
        grpc_calls=lambda: GrpcCalls(started=1, succeeded=1, failed=0),
        ledger=lambda: LedgerCounts(1, 1, 1, 100),
        watermark=lambda: WatermarkState(3 << 30, 6 << 30, 5 << 30, ("bulk",), 8 << 30),
        high_watermark_bytes=6 << 30,
        low_watermark_bytes=5 << 30,
        memory_limit_bytes=4 << 30,
        shared_memory=lambda: SharedMemoryCounts(regions=1, read_bytes=8, written_bytes=8),
        http_requests=lambda: {("/v2/health/ready", 200): 1},
        answers_unsent=lambda: {"/laneserve.v1.InferenceService/Infer": 1},
        text_thread=lambda: text_counts,
    )
    metrics = telemetry.metrics
    assert metrics is not None
    batch = Batch(7, (BatchSlice(1, "standard", 0, 2, 0),), 2, DispatchReason.FULL, 0.0, {})
    try:
        telemetry.observe(sources)
        metrics.memory_sampled(3 << 30, 8 << 30)
        metrics.batch_formed(batch, [0.001])
        metrics.batch_done(batch, 0.002, None)
        metrics.request_finished("standard", "OK", 0.003)
        port = telemetry.serve_metrics("127.0.0.1", 0)
        assert port is not None
        text = fetch(f"http://127.0.0.1:{port}/metrics")
    finally:
        telemetry.close()
    helps = {line.split()[2]: line for line in text.splitlines() if line.startswith("# HELP ")}
    dotted = [line for line in helps.values() if re.search(r"laneserve\.[a-z]", line)]
    assert not dotted
    assert "laneserve_requests_completed_total" in helps["laneserve_answers_unsent_total"]
    named = {
        other
        for name, line in helps.items()
        for other in re.findall(r"laneserve_[a-z_]+", line.removeprefix(f"# HELP {name} "))
    }
    assert named - set(helps) == set(), "each metric a HELP names is scraped as it names it"
    # Prometheus names an instrument with "_" for ".", and a unit or _total after it;
    # as many HELP lines as instruments: "batch.cap" matches batch_cap_max's too.
    ours = [name for name in helps if name.startswith("laneserve_")]
    unscraped = [
        name
        for name in created
        if not any(re.fullmatch(name.replace(".", "_") + "(_[a-z]+)*", each) for each in ours)
    ]
    assert (unscraped, len(ours)) == ([], len(created)), "a HELP line for every instrument"


def test_metrics_port_minus_one_records_nothing_and_opens_no_port(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, metrics_port=-1)) as s:
            assert s.server.metrics_port is None
            assert s.server.telemetry.metrics is None
            await s.stub.Infer(request(rows(1)), timeout=10)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert stats.batch_size.count == 1  # GetStats does not depend on metrics

    asyncio.run(scenario())


def test_metrics_port_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"server\.metrics_port: expected an integer in \[-1"):
        ServerConfig(model_path="m.onnx", metrics_port=-2)
    assert dataclasses.replace(ServerConfig(model_path="m.onnx"), metrics_port=0).metrics_port == 0
    assert ServerConfig(model_path="m.onnx").metrics_port == 9464


# ---- logs --------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


# A refusal line's first refusal and ids where its refusals gave none (`Window.firsts`).
NO_FIRSTS: dict[str, Any] = {"first_refusal": "", "request_ids": []}


def test_refusals_are_logged_in_aggregate_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, timers = FakeClock(), FakeTimers()
    events = EventLog(max_batch_size=64, interval_s=10.0, monotonic=clock, timer=timers)
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    events.rejected("standard", "LANE_FULL", 0.0)  # the first is logged at once
    for _ in range(500):
        events.rejected("standard", "LANE_FULL", 0.0)
    events.rejected("bulk", "MEMORY_PRESSURE", 0.0)
    clock.now_s += 5
    assert len(caplog.records) == 1
    clock.now_s += 5
    (timer,) = timers.started
    timer.action()  # the interval is over: the burst is summed up
    events.rejected("standard", "LANE_FULL", 0.0)
    events.flush()  # at shutdown: whatever is left
    lines = [(record.getMessage(), record.fields) for record in caplog.records]  # type: ignore[attr-defined]
    # The burst of 501 took no time: it was written 10 s after (a window from the first
    # refusal to the line read "in 10.0s"; a 4 s flood logged 22 s later read 22.5 s).
    assert lines == [
        (
            "admission refused 1 request(s) in 0.0s",
            {**NO_FIRSTS, "refused": {"standard/LANE_FULL": 1}, "window_s": 0.0, "last_ago_s": 0.0},
        ),
        (
            "admission refused 501 request(s) in 0.0s, the last 10.0s ago",
            {
                "refused": {"standard/LANE_FULL": 500, "bulk/MEMORY_PRESSURE": 1},
                **NO_FIRSTS,
                "window_s": 0.0,
                "last_ago_s": 10.0,
            },
        ),
        (
            "admission refused 1 request(s) in 0.0s",
            {**NO_FIRSTS, "refused": {"standard/LANE_FULL": 1}, "window_s": 0.0, "last_ago_s": 0.0},
        ),
    ]
    assert all(record.levelno == logging.WARNING for record in caplog.records)


def test_the_last_refusals_of_a_burst_are_logged_when_their_interval_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A flood, then nothing: its line waited for the next event (which an idle server may
    not see for hours) or for shutdown. A timer writes it when its interval ends."""
    clock, timers = FakeClock(), FakeTimers()
    events = EventLog(max_batch_size=64, interval_s=10.0, monotonic=clock, timer=timers)
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    events.rejected("standard", "LANE_FULL", 0.0)  # logged at once: no timer
    assert timers.started == []
    clock.now_s += 2
    for _ in range(300):
        events.rejected("standard", "LANE_FULL", 0.0)
    (timer,) = timers.started  # one for the burst, due when the interval ends
    assert timer.delay_s == pytest.approx(8.0)
    clock.now_s += 8
    timer.action()
    assert [record.getMessage() for record in caplog.records] == [
        "admission refused 1 request(s) in 0.0s",
        "admission refused 300 request(s) in 0.0s, the last 8.0s ago",
    ]
    events.rejected("bulk", "LANE_FULL", 0.0)  # the next burst gets a timer of its own
    assert len(timers.started) == 2
    events.close()
    assert timers.started[1].cancelled
    assert caplog.records[-1].getMessage() == "admission refused 1 request(s) in 0.0s"


def test_refusals_held_while_an_old_timer_fires_get_a_timer_of_their_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A burst's timer woken at its due time may wait (for the GIL) while a refusal on the
    loop writes the line the interval allows, and another refusal is held: no timer was
    armed for that one (the old one was still set), and the old one, run at last, found
    the interval not yet over, so it was written only at the next event or at close."""
    clock, timers = FakeClock(), FakeTimers()
    events = EventLog(max_batch_size=64, interval_s=10.0, monotonic=clock, timer=timers)
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    events.rejected("standard", "LANE_FULL", 0.0)  # logged at once
    clock.now_s += 2
    events.rejected("standard", "LANE_FULL", 0.0)  # held: a timer due when the interval ends
    (late,) = timers.started
    clock.now_s += 8  # the timer is due, and not yet run
    events.rejected("standard", "LANE_FULL", 0.0)  # the interval is over: both written now
    events.rejected("bulk", "LANE_FULL", 0.0)  # held: the old timer is still set
    assert len(caplog.records) == 2
    late.action()  # nothing to write yet: the interval began at the line just written
    assert len(caplog.records) == 2
    assert len(timers.started) == 2, "the held refusal has no timer"
    due = timers.started[1]
    assert due.delay_s == pytest.approx(10.0)
    clock.now_s += 10
    due.action()
    assert (
        caplog.records[-1].getMessage()
        == "admission refused 1 request(s) in 0.0s, the last 10.0s ago"
    )
    events.close()
    assert len(caplog.records) == 3


def test_out_of_memory_and_recovery_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    events = EventLog(max_batch_size=64, timer=FakeTimers())
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    events.out_of_memory(64)
    events.cap_changed(64, 32, "out_of_memory", ((512,),))
    events.cap_changed(32, 36, "recovered", ((512,),))
    events.cap_changed(60, 64, "recovered", ((8,), (3, 2)))
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [
        ("WARNING", "out of memory (device) running 64 rows; splitting them and retrying"),
        ("WARNING", "batch cap of rows shaped [512] lowered 64 -> 32 (out_of_memory)"),
        ("INFO", "batch cap of rows shaped [512] raised 32 -> 36 (recovered)"),
        ("INFO", "batch cap of rows shaped [8], [3, 2] recovered 60 -> 64 (max_batch_size)"),
    ]
    assert caplog.records[1].fields["shape"] == [[512]]  # type: ignore[attr-defined]


def _events_of(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if getattr(record, "event", None) == event]


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = getattr(record, "fields", {})
    return fields


def test_refusals_for_overload_and_routine_ones_are_logged_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A deploy's drain (DRAINING) and clients' bugs (INVALID_INPUT) were summed with
    overload into one WARNING line: each kind has its own line and window now, the
    routine one at INFO, and admission_refused keeps overload alone. An answer over the
    caller's own receive limit (ANSWER_TOO_LARGE) is the client's choice, not overload."""
    clock, timers = FakeClock(), FakeTimers()
    events = EventLog(max_batch_size=64, interval_s=10.0, monotonic=clock, timer=timers)
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    events.rejected("standard", "LANE_FULL", 0.0)  # each kind's first is logged at once
    events.rejected("bulk", "DRAINING", 0.0)
    clock.now_s += 1
    events.rejected("standard", "INVALID_INPUT", 0.0)  # held: the routine line's interval runs
    events.rejected("standard", "REQUEST_ID_REUSED", 0.0)
    events.rejected("standard", "ANSWER_TOO_LARGE", 0.0)  # over the caller's own receive limit
    # A shared memory region not registered, shared memory off, a feature not served.
    events.rejected("standard", "REGION_NOT_FOUND", 0.0)
    events.rejected("standard", "SHARED_MEMORY_REFUSED", 0.0)
    events.rejected("standard", "UNSUPPORTED", 0.0)
    events.rejected("interactive", "DEADLINE_UNMEETABLE", 0.0)  # held: overload's interval runs
    assert len(timers.started) == 2, "a timer for each held line"
    clock.now_s += 9
    for timer in timers.started:
        timer.action()
    lines = [(r.levelname, r.event, r.getMessage(), _fields(r)) for r in caplog.records]  # type: ignore[attr-defined]
    assert lines == [
        (
            "WARNING",
            "admission_refused",
            "admission refused 1 request(s) in 0.0s",
            {**NO_FIRSTS, "refused": {"standard/LANE_FULL": 1}, "window_s": 0.0, "last_ago_s": 0.0},
        ),
        (
            "INFO",
            "admission_refused_routine",
            (
                "admission refused 1 request(s) in 0.0s, none for overload (draining, invalid or "
                "withdrawn requests, shared memory not registered or refused, features not "
                "served, answers over a caller's receive limit)"
            ),
            {**NO_FIRSTS, "refused": {"bulk/DRAINING": 1}, "window_s": 0.0, "last_ago_s": 0.0},
        ),
        (
            "INFO",
            "admission_refused_routine",
            (
                "admission refused 6 request(s) in 0.0s, the last 9.0s ago, none for overload "
                "(draining, invalid or withdrawn requests, shared memory not registered or "
                "refused, features not served, answers over a caller's receive limit)"
            ),
            {
                **NO_FIRSTS,
                "refused": {
                    "standard/INVALID_INPUT": 1,
                    "standard/REQUEST_ID_REUSED": 1,
                    "standard/ANSWER_TOO_LARGE": 1,
                    "standard/REGION_NOT_FOUND": 1,
                    "standard/SHARED_MEMORY_REFUSED": 1,
                    "standard/UNSUPPORTED": 1,
                },
                "window_s": 0.0,
                "last_ago_s": 9.0,
            },
        ),
        (
            "WARNING",
            "admission_refused",
            "admission refused 1 request(s) in 0.0s, the last 9.0s ago",
            {
                **NO_FIRSTS,
                "refused": {"interactive/DEADLINE_UNMEETABLE": 1},
                "window_s": 0.0,
                "last_ago_s": 9.0,
            },
        ),
    ]


def test_a_refusal_line_says_what_the_first_was_told_and_whose_the_first_few_were(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A flood of bad requests was logged as {"interactive/INVALID_INPUT": 3935} alone:
    nothing of what was wrong, nor whose they were (an operator's evaluation). A line
    now carries the first refusal's words (the first that had any: a caller that left was
    told none) and the first MAX_REQUEST_IDS ids, in fields, as requests_failed does."""
    clock, timers = FakeClock(), FakeTimers()
    events = EventLog(max_batch_size=64, interval_s=10.0, monotonic=clock, timer=timers)
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    events.rejected("standard", "DRAINING", 0.0)  # the window's first line, at once
    clock.now_s += 1
    events.rejected("standard", "CANCELLED", 0.0)  # its caller left: told nothing
    for index in range(7):
        events.rejected(
            "interactive",
            "INVALID_INPUT",
            0.0,
            request_id=f"bad-{index}",
            error=InvalidInputError(f"input 'input' has dtype float64; expected float32 ({index})"),
        )
    (timer,) = timers.started
    clock.now_s += 9
    timer.action()
    first, held = [_fields(record) for record in _events_of(caplog, "admission_refused_routine")]
    assert (first["first_refusal"], first["request_ids"]) == ("", [])  # DRAINING: no error
    assert held["refused"] == {"standard/CANCELLED": 1, "interactive/INVALID_INPUT": 7}
    assert held["first_refusal"] == "input 'input' has dtype float64; expected float32 (0)"
    assert held["request_ids"] == [f"bad-{index}" for index in range(MAX_REQUEST_IDS)]


def test_sheds_are_logged_in_aggregate_at_warning_once_any_expired(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Work accepted, then dropped unrun (its deadline passed in the queue, or its caller
    left) left no line at all. Callers that left are no overload: INFO; a window with an
    expiry in it is: WARNING."""
    clock, timers = FakeClock(), FakeTimers()
    events = EventLog(max_batch_size=64, interval_s=10.0, monotonic=clock, timer=timers)
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    events.shed("standard", "CANCELLED", 2)  # logged at once
    clock.now_s += 2
    events.shed("bulk", "EXPIRED_IN_QUEUE", 64)
    events.shed("bulk", "EXPIRED_IN_QUEUE", 64)
    events.shed("standard", "CANCELLED", 1)
    (timer,) = timers.started
    assert timer.delay_s == pytest.approx(8.0)
    clock.now_s += 8
    timer.action()
    lines = [(r.levelname, r.event, r.getMessage(), _fields(r)) for r in caplog.records]  # type: ignore[attr-defined]
    assert lines == [
        (
            "INFO",
            "requests_shed",
            "dropped 1 queued request(s) (2 rows) without running them in 0.0s; their callers left",
            {"shed": {"standard/CANCELLED": 1}, "rows": 2, "window_s": 0.0, "last_ago_s": 0.0},
        ),
        (
            "WARNING",
            "requests_shed",
            (
                "dropped 3 queued request(s) (129 rows) without running them in 0.0s, the last "
                "8.0s ago; 2 of them expired in the queue (overload: the lanes hold more than "
                "the session serves within their deadlines)"
            ),
            {
                "shed": {"bulk/EXPIRED_IN_QUEUE": 2, "standard/CANCELLED": 1},
                "rows": 129,
                "window_s": 0.0,
                "last_ago_s": 8.0,
            },
        ),
    ]


def test_failed_requests_are_logged_with_the_first_error_and_their_first_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model failing on an input left no server line at all: a client's INTERNAL could
    not be matched to anything. Failures are logged as refusals are, with the window's
    first error and the first MAX_REQUEST_IDS request ids; other ends are not failures."""
    clock, timers = FakeClock(), FakeTimers()
    events = EventLog(max_batch_size=64, interval_s=10.0, monotonic=clock, timer=timers)
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    events.completed("standard", "OK")
    events.completed(
        "standard", "DRAINING", request_id="d", error=DeviceMemoryError("not a failure")
    )
    events.completed(
        "standard", "ENGINE_FAILURE", request_id="poison-1", error=EngineError("idx=99 (first)")
    )
    clock.now_s += 1
    for index in range(7):
        lane = "bulk" if index < 5 else "interactive"
        events.completed(
            lane, "ENGINE_FAILURE", request_id=f"p{index}", error=EngineError(f"idx={index}")
        )
    events.completed("bulk", "DEVICE_MEMORY", request_id="big", error=DeviceMemoryError("big"))
    (timer,) = timers.started
    clock.now_s += 9
    timer.action()
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    first, burst = _events_of(caplog, "requests_failed")
    assert first.getMessage() == "1 request(s) failed in the model in 0.0s"
    assert _fields(first) == {
        "failed": {"standard/ENGINE_FAILURE": 1},
        "first_error": "idx=99 (first)",
        "request_ids": ["poison-1"],
        "window_s": 0.0,
        "last_ago_s": 0.0,
    }
    assert burst.getMessage() == "8 request(s) failed in the model in 0.0s, the last 9.0s ago"
    assert _fields(burst) == {
        "failed": {
            "bulk/ENGINE_FAILURE": 5,
            "interactive/ENGINE_FAILURE": 2,
            "bulk/DEVICE_MEMORY": 1,
        },
        "first_error": "idx=0",
        "request_ids": [f"p{index}" for index in range(MAX_REQUEST_IDS)],
        "window_s": 0.0,
        "last_ago_s": 9.0,
    }


def _lookup_model(path: Path) -> Path:
    """value[N, 1] = table[input[N, 1]] over a table of 10: an index past it fails in
    the runtime (Gather), as a model fails on a bad input."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [10], [float(i) for i in range(10)])
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input"], ["value"], axis=0)],
        "lookup",
        [helper.make_tensor_value_info("input", TensorProto.INT64, ["N", 1])],
        [helper.make_tensor_value_info("value", TensorProto.FLOAT, ["N", 1])],
        initializer=[table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _lookup(request_id: str, index: int) -> pb.InferRequest:
    value = np.full((1, 1), index, dtype=np.int64)
    return pb.InferRequest(request_id=request_id, inputs=[encode_tensor("input", value)])


def test_requests_the_model_fails_on_are_logged_naming_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Real runtime failures (Gather past its table): the first is logged at once with
    its request id and the runtime's words, the second at the stop, and the good
    request between them in neither."""
    path = _lookup_model(tmp_path / "lookup.onnx")
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")

    async def scenario() -> None:
        engine = RecordingEngine(str(path), device="cpu")
        async with serving(engine, ServerConfig(model_path=str(path))) as s:
            with pytest.raises(grpc.aio.AioRpcError) as first:
                await s.stub.Infer(_lookup("poison-1", 99), timeout=10)
            assert first.value.code() == grpc.StatusCode.INTERNAL
            assert len(_events_of(caplog, "requests_failed")) == 1, "the first at once"
            await s.stub.Infer(_lookup("good-1", 3), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError):
                await s.stub.Infer(_lookup("poison-2", 98), timeout=10)

    asyncio.run(scenario())
    first, rest = _events_of(caplog, "requests_failed")
    assert first.levelno == logging.WARNING
    assert _fields(first)["failed"] == {"standard/ENGINE_FAILURE": 1}
    assert _fields(first)["request_ids"] == ["poison-1"]
    error = _fields(first)["first_error"]
    assert error.startswith("the model failed on a row of this request"), error
    assert "Gather" in error, error
    assert _fields(rest)["request_ids"] == ["poison-2"]
    assert _fields(rest)["failed"] == {"standard/ENGINE_FAILURE": 1}


def _request(request_id: str, lane: str, count: int, deadline_s: float) -> InferenceRequest:
    return InferenceRequest(
        request_id=request_id,
        lane=lane,
        inputs={"input": np.zeros((count, 2), np.float32)},
        rows=count,
        signature=((2,),),
        deadline_s=deadline_s,
        token=request_id,
    )


def _running_batch_id(events: EventLog) -> int | None:
    batch = events.running_batch
    return None if batch is None else batch.batch_id


def test_the_scheduler_tells_the_event_log_what_failed_and_what_it_shed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The scheduler hands each failed request's id and error to the log, and each
    expiry in its queue (a scheduler on a manual clock: no sleeps)."""
    clock = ManualClock(1_000.0)
    events = EventLog(max_batch_size=8, monotonic=clock.monotonic, timer=FakeTimers())
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    lanes = [
        LaneConfig("standard", capacity_rows=64, timeout_ms=60_000, max_wait_ms=0, min_share=0),
    ]
    scheduler = Scheduler(lanes, batch_cap=8, run_time=RunTimeModel({1: 0.001}), events=events)
    scheduler.admit(_request("good", "standard", 2, 1_010.0), clock.monotonic())
    scheduler.admit(_request("bad", "standard", 1, 1_010.0), clock.monotonic())
    decision = scheduler.decide(clock.monotonic(), clock.monotonic())
    assert isinstance(decision, Dispatch)
    batch = decision.batch
    assert _running_batch_id(events) == batch.batch_id
    failure = EngineError("the model failed on a row of this request (row 0, run alone): x")
    scheduler.complete(
        BatchResult(
            batch,
            {"out": np.zeros((3, 1), np.float32)},
            None,
            0.001,
            failed_rows=(FailedRows(2, 1, failure),),
        )
    )
    assert _running_batch_id(events) is None
    scheduler.admit(_request("late", "standard", 3, 1_001.0), clock.monotonic())
    clock.advance(2.0)
    scheduler.shed_expired(clock.monotonic())
    events.close()
    (failed,) = _events_of(caplog, "requests_failed")
    assert _fields(failed)["failed"] == {"standard/ENGINE_FAILURE": 1}
    assert _fields(failed)["request_ids"] == ["bad"]
    assert _fields(failed)["first_error"] == failure.message
    (shed,) = _events_of(caplog, "requests_shed")
    assert shed.levelno == logging.WARNING
    assert (_fields(shed)["shed"], _fields(shed)["rows"]) == ({"standard/EXPIRED_IN_QUEUE": 1}, 3)


class _LostGauge:
    """Memory readings that raise, as NVML does once the GPU is lost: the scheduler
    thread, which reads them first thing, fails for good."""

    def used_bytes(self) -> int | None:
        raise RuntimeError("injected fault: the device is lost")

    def total_bytes(self) -> int | None:
        return 2**34


def _fails_outside_the_runtime(_batch: Batch, _rows_wanted: RowsWanted) -> BatchResult:
    """An engine that fails every batch in laneserve's own code, not the runtime's."""
    raise RuntimeError("injected fault: stacking the outputs")


def test_requests_failed_by_laneserve_itself_are_not_blamed_on_the_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A scheduler thread that failed answered every live request ENGINE_FAILURE, as did a
    batch that failed outside the runtime, and requests_failed said "N request(s) failed
    in the model" of each, beside the ERROR line with its traceback that says what did
    fail. They are ServerFaultErrors (the same answer on the wire): left out of it."""
    clock = ManualClock(1_000.0)
    events = EventLog(max_batch_size=8, monotonic=clock.monotonic, timer=FakeTimers())
    caplog.set_level(logging.INFO)
    lanes = [
        LaneConfig("standard", capacity_rows=64, timeout_ms=60_000, max_wait_ms=0, min_share=0),
    ]
    answered: queue.SimpleQueue[Outcome] = queue.SimpleQueue()

    def deliver(outcomes: Sequence[Outcome]) -> None:
        for outcome in outcomes:
            answered.put(outcome)

    def scheduler() -> Scheduler:
        return Scheduler(lanes, batch_cap=8, run_time=RunTimeModel({1: 0.001}), events=events)

    # A batch that fails outside the runtime: the server goes on.
    engine_fault = SchedulerThread(scheduler(), _fails_outside_the_runtime, deliver, clock=clock)
    engine_fault.start()
    try:
        engine_fault.submit(_request("batch-fault", "standard", 1, 1_010.0))
        batch_fault = answered.get(timeout=30)
    finally:
        engine_fault.close()
    # A scheduler thread that fails (its first memory reading) with a request queued.
    failures: list[LaneserveError] = []
    crashed = SchedulerThread(
        scheduler(),
        _fails_outside_the_runtime,
        deliver,
        clock=clock,
        memory_gauge=_LostGauge(),
        on_failure=failures.append,
    )
    crashed.submit(_request("queued", "standard", 1, 1_010.0))
    crashed.start()
    try:
        queued = answered.get(timeout=30)
        # Once it has answered what was live, every submission is refused with its error,
        # counted among the WARNING's refusals: the server is stopping, not draining.
        with pytest.raises(ServerFaultError):
            crashed.submit(_request("after", "standard", 1, 1_010.0))
    finally:
        crashed.close()
    for outcome in (batch_fault, queued):
        assert isinstance(outcome.error, ServerFaultError), outcome
        assert outcome.error.reason == EngineError.reason  # the same answer on the wire
    # Its callers are told it was not their input, and that a retry may run ("batch
    # failed: RuntimeError(...)" read as a verdict on the request).
    assert batch_fault.error is not None
    assert re.fullmatch(
        r"batch \d+ failed in the server outside the model's run, not for this request's "
        r"input: RuntimeError\('injected fault: stacking the outputs'\); a retry may succeed",
        batch_fault.error.message,
    ), batch_fault.error.message
    (failure,) = failures
    assert isinstance(failure, ServerFaultError)
    assert failure.message == "the scheduler failed; the server must be restarted"
    events.completed("standard", "ENGINE_FAILURE", request_id="model", error=EngineError("x"))
    events.close()
    (failed,) = _events_of(caplog, "requests_failed")  # the model's failure alone
    assert _fields(failed)["request_ids"] == ["model"]
    (refused,) = _events_of(caplog, "admission_refused")
    assert refused.levelname == "WARNING"
    assert _fields(refused)["refused"] == {"standard/ENGINE_FAILURE": 1}
    logged = {getattr(record, "event", None) for record in caplog.records}
    assert {"batch_failed", "scheduler_thread_failed"} <= logged


class _CountingClock(FakeClock):
    def __init__(self) -> None:
        super().__init__()
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return self.now_s


def test_admissions_and_batch_ends_leave_the_event_log_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """admitted() and batch_done() run under the scheduler's lock, on every admission and
    batch; each read the clock and took every aggregated line's lock while one held
    counts, to write lines that their timers write when due anyway."""
    clock, timers = _CountingClock(), FakeTimers()
    events = EventLog(max_batch_size=64, interval_s=10.0, monotonic=clock, timer=timers)
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    for _ in range(2):  # the first of each is written, the second held
        events.rejected("standard", "LANE_FULL", 0.0)
        events.rejected("standard", "DRAINING", 0.0)
        events.shed("standard", "EXPIRED_IN_QUEUE", 1)
        events.completed("standard", "ENGINE_FAILURE", error=EngineError("x"))
    assert (len(caplog.records), len(timers.started)) == (4, 4)
    batch = Batch(7, (), 64, DispatchReason.FULL, 0.0, {})
    events.batch_formed(batch, [])
    clock.now_s += 10  # every held line is due
    readings = clock.readings
    events.admitted("standard", 1)
    events.batch_done(batch, 0.1, None)
    assert clock.readings == readings, "the clock is not read"
    assert len(caplog.records) == 4, "the held lines are their timers' to write"
    assert events.running_batch is None
    for timer in timers.started:
        timer.action()
    assert len(caplog.records) == 8


def test_an_occurrence_after_the_log_closed_is_written_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refusal after close (a call the stop had not yet answered) was held within its
    interval, for a timer that close no longer arms: never written."""
    clock, timers = FakeClock(), FakeTimers()
    events = EventLog(max_batch_size=64, interval_s=10.0, monotonic=clock, timer=timers)
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    events.rejected("standard", "LANE_FULL", 0.0)  # written at once
    events.close()
    clock.now_s += 1
    events.rejected("standard", "LANE_FULL", 0.0)  # within the interval
    assert [record.getMessage() for record in caplog.records] == [
        "admission refused 1 request(s) in 0.0s",
        "admission refused 1 request(s) in 0.0s",
    ]
    assert timers.started == []


def test_the_log_timers_are_named_as_laneserves_threads() -> None:
    """They were Thread-N: the tests' check for laneserve threads left running did not
    see them."""
    ran = threading.Event()
    timer = start_timer(0.0, ran.set)
    assert isinstance(timer, threading.Thread)
    assert timer.name == "laneserve-log-timer"
    assert ran.wait(timeout=30)
    timer.join(timeout=30)


def test_an_out_of_memory_names_the_memory_and_its_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It said "out of device memory" on a CPU server too, and named no batch."""
    events = EventLog(max_batch_size=64, timer=FakeTimers())
    events.arena = "host arena"  # the server's, from where its session runs
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    batch = Batch(7, (), 64, DispatchReason.FULL, 0.0, {})
    events.batch_formed(batch, [])
    events.out_of_memory(64)
    events.out_of_memory(1)
    events.batch_done(batch, 0.1, None)
    events.out_of_memory(1)  # no batch runs: the engine's own run
    assert [(r.getMessage(), _fields(r)) for r in caplog.records] == [
        (
            "out of memory (host arena) running 64 rows of batch 7; splitting them and retrying",
            {"rows": 64, "batch_id": 7, "memory": "host arena"},
        ),
        (
            "out of memory (host arena) running 1 rows of batch 7",
            {"rows": 1, "batch_id": 7, "memory": "host arena"},
        ),
        (
            "out of memory (host arena) running 1 rows",
            {"rows": 1, "batch_id": None, "memory": "host arena"},
        ),
    ]


def test_a_server_on_the_cpu_says_its_out_of_memory_is_the_host_arenas(
    small_model: Path,
) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model), device="cpu")
        async with serving(engine, config(small_model, metrics_port=-1)) as s:
            assert s.server.telemetry.event_log.arena == "host arena"

    asyncio.run(scenario())


def test_an_incomplete_drain_says_what_it_left_and_what_to_change(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ "drain grace of 0.2s over; answering what is left UNAVAILABLE" said neither how
    much was left nor what to do about it."""
    caplog.set_level(logging.INFO, logger="laneserve.server.app")

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, metrics_port=-1)) as s:
            running, queued = await one_running_and_queued(s, engine)
            held = s.server.telemetry.event_log.running_batch
            assert held is not None
            stopping = asyncio.ensure_future(s.server.stop(grace_s=0.0))
            await queued_never_ran_as_the_drain_ended(running, queued, engine, stopping)
        (record,) = _events_of(caplog, "drain_incomplete")
        assert record.levelno == logging.WARNING
        assert _fields(record) == {
            "grace_s": 0.0,
            "waited_s": _fields(record)["waited_s"],
            "cut_short": False,
            "queued_requests": 1,
            "queued_rows": 2,
            "running_batch_id": held.batch_id,
            "running_rows": 1,
            "decoding_requests": 0,
        }
        assert record.getMessage() == (
            f"drain grace of 0.0s over with 1 request(s) (2 rows) still queued and batch "
            f"{held.batch_id} (1 rows) running; answering them UNAVAILABLE (raise "
            "--drain-grace-s for the queue to finish, keeping --drain-delay-s plus it below "
            "the supervisor's kill grace: Kubernetes' terminationGracePeriodSeconds, "
            "systemd's TimeoutStopSec)"
        )

    asyncio.run(scenario())


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("verbosity", [None, "debug"])
def test_debug_logs_leave_out_grpcs_per_call_lines_unless_grpc_verbosity_asks(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, verbosity: str | None
) -> None:
    """At --log-level debug grpc's asyncio layer logged "[_cygrpc] Loaded running loop" at
    DEBUG on every call and "RPC cancelled for servicer method" on every cancelled one
    (5 819 and 868: with one more at start, its logger wrote 6 688 of 6 698 lines in 25 s
    of overload). GRPC_VERBOSITY=DEBUG, which asks for gRPC's debugging, lets them
    through."""
    if verbosity is None:
        monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    else:
        monkeypatch.setenv("GRPC_VERBOSITY", verbosity)
    keep = _Keep()
    try:
        configure_logging("debug")
        logging.getLogger().addHandler(keep)

        async def scenario() -> None:
            engine = RecordingEngine(str(small_model))
            async with serving(engine, config(small_model, metrics_port=-1)) as s:
                for _ in range(3):
                    await s.stub.Infer(request(rows(1)), timeout=10)

        asyncio.run(scenario())
    finally:
        logging.getLogger(GRPC_PER_CALL_LOGGER).setLevel(logging.NOTSET)
    per_call = [
        record
        for record in keep.records
        if record.name == GRPC_PER_CALL_LOGGER and record.levelno == logging.DEBUG
    ]
    ours = [record for record in keep.records if record.name.startswith("laneserve")]
    assert ours, "laneserve's lines are logged"
    if verbosity is None:
        assert per_call == []
    else:
        assert any("Loaded running loop" in record.getMessage() for record in per_call)


def test_log_lines_carry_their_fields_as_text_or_json() -> None:
    logger = logging.getLogger("laneserve.test")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger.addHandler(handler)
    try:
        log_event(
            logger,
            logging.WARNING,
            "admission_refused",
            "admission refused 3 requests in 10.0s",
            refused={"standard/LANE_FULL": 3},
            lane="standard lane",
        )
    finally:
        logger.removeHandler(handler)
    (record,) = records
    text = TextFormatter().format(record)
    assert text.endswith(
        "laneserve.test: admission refused 3 requests in 10.0s event=admission_refused "
        'refused={"standard/LANE_FULL":3} lane="standard lane"'
    )
    document = json.loads(JsonFormatter().format(record))
    assert document["level"] == "WARNING"
    assert document["event"] == "admission_refused"
    assert document["message"] == "admission refused 3 requests in 10.0s"
    assert document["refused"] == {"standard/LANE_FULL": 3}
    assert document["time"].endswith("+00:00")


def test_a_json_line_of_another_library_has_an_event_too() -> None:
    """Log shippers key on `event`: grpc's and asyncio's lines had none with
    --log-format json."""
    record = logging.LogRecord("grpc._cython", logging.ERROR, __file__, 1, "boom %d", (7,), None)
    document = json.loads(JsonFormatter().format(record))
    assert (document["event"], document["logger"], document["message"]) == (
        "log",
        "grpc._cython",
        "boom 7",
    )


class HeldStream(io.StringIO):
    """A stream whose writes wait until `opened` is set: a pipe nobody reads."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = threading.Event()
        self.entered = threading.Event()  # a write is waiting

    def write(self, text: str) -> int:
        self.entered.set()
        assert self.opened.wait(timeout=60), "the test never opened the stream"
        return super().write(text)


def queued_log(
    handler: QueuedStreamHandler, formatter: logging.Formatter | None = None
) -> logging.Logger:
    """A logger of its own writing to `handler` alone, with `formatter` (by default the
    message alone)."""
    handler.setFormatter(formatter or logging.Formatter("%(message)s"))
    logger = logging.getLogger(f"laneserve.test.queued.{id(handler)}")
    logger.propagate = False
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    return logger


def test_log_lines_wait_in_a_queue_while_stderr_is_not_read() -> None:
    """Each line was written by the thread that logged it: with stderr a full pipe, the
    event loop's first refusal line stopped the event loop and the scheduler thread."""
    stream = HeldStream()
    handler = QueuedStreamHandler(stream)
    logger = queued_log(handler)
    try:
        for index in range(3):
            logger.warning("line %d", index)  # returns while the first write waits
        assert stream.entered.wait(timeout=60)
        assert stream.getvalue() == ""
        stream.opened.set()
        assert handler.flush_lines()
        assert stream.getvalue() == "line 0\nline 1\nline 2\n"
        assert handler.dropped_lines == 0
    finally:
        stream.opened.set()
        handler.close()


@pytest.mark.parametrize("json_lines", [False, True])
def test_log_lines_past_the_queue_are_dropped_and_counted(json_lines: bool) -> None:
    stream = HeldStream()
    handler = QueuedStreamHandler(stream, max_lines=2)
    logger = queued_log(handler, JsonFormatter() if json_lines else TextFormatter())
    try:
        logger.warning("line 0")
        assert stream.entered.wait(timeout=60)  # the writer holds line 0: 2 may wait
        for index in range(1, 6):
            logger.warning("line %d", index)
        assert handler.dropped_lines == 3
        stream.opened.set()
        assert handler.flush_lines()
    finally:
        stream.opened.set()
        handler.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4, lines
    if json_lines:
        documents = [json.loads(line) for line in lines]
        assert [document["message"] for document in documents[:3]] == ["line 0", "line 1", "line 2"]
        assert documents[3]["event"] == "log_lines_dropped"
        assert documents[3]["dropped"] == 3
        assert documents[3]["level"] == "WARNING"
    else:
        assert [line.rpartition(": ")[2] for line in lines[:3]] == ["line 0", "line 1", "line 2"]
        assert "WARNING laneserve.server.telemetry: dropped 3 log line(s)" in lines[3]
        assert lines[3].endswith(f"dropped=3 queue_lines=2 queue_chars={LOG_QUEUE_CHARS}")
    assert handler.dropped_lines == 3  # in all: the line that said so reset nothing


def test_closing_the_log_writes_its_queued_lines_then_writes_at_once() -> None:
    stream = HeldStream()
    handler = QueuedStreamHandler(stream)
    logger = queued_log(handler)
    logger.warning("queued")
    assert stream.entered.wait(timeout=60)
    logger.warning("queued too")
    stream.opened.set()
    handler.close()
    assert stream.getvalue() == "queued\nqueued too\n"
    logger.warning("after close")  # at exit, by atexit hooks: written where it is logged
    assert stream.getvalue() == "queued\nqueued too\nafter close\n"


def test_closing_the_log_gives_up_on_a_stream_that_never_drains() -> None:
    """The process's exit waits for its log lines a bounded time (the writer's stall),
    not for ever: a supervisor that stopped reading would have kept it from exiting."""
    stream = HeldStream()
    handler = QueuedStreamHandler(stream, stall_s=0.05)
    logger = queued_log(handler)
    try:
        logger.warning("stuck")
        assert stream.entered.wait(timeout=60)
        logger.warning("behind it")
        assert not handler.flush_lines()
        handler.close()  # returns: the writer is given up on
        logger.warning("after close")  # does not block either: it waits behind them
        assert stream.getvalue() == ""
    finally:
        stream.opened.set()  # the writer given up on writes what it holds, and ends


def returns_within(action: Callable[[], object], timeout_s: float = 60.0) -> object:
    """`action()`'s result, run on a thread of its own: a guard against a hang (the test
    fails instead of waiting for ever), not a timing check."""
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(action()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert results, f"{action} had not returned after {timeout_s} s"
    return results[0]


def test_a_log_writer_that_cannot_start_leaves_the_line_written_where_it_was_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No thread can start at the thread limit, nor at interpreter shutdown on Python >=
    3.12 (a first line logged from an atexit hook): the logging call raised, and flushing
    or closing the log (at exit) waited for ever for the writer that never ran."""
    stream = io.StringIO()
    handler = QueuedStreamHandler(stream)
    logger = queued_log(handler)
    start = threading.Thread.start

    def refuse_once(_thread: threading.Thread) -> None:
        monkeypatch.setattr(threading.Thread, "start", start)
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse_once)
    logger.warning("no writer")  # does not raise
    assert stream.getvalue() == "no writer\n"
    assert returns_within(handler.flush_lines)
    logger.warning("a writer")  # threads start again: this line goes through one
    assert returns_within(handler.flush_lines)
    assert stream.getvalue() == "no writer\na writer\n"
    returns_within(handler.close)


class WriterKilled(BaseException):
    """Ends the thread it is raised in (`logging.Handler` catches `Exception` alone)."""


class DyingStream(io.StringIO):
    """Its first write logs one more line, from the writer thread, then ends that thread."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.killed = False

    def write(self, text: str) -> int:
        written = super().write(text)
        if not self.killed:
            self.killed = True
            self.logger.warning("behind it")  # queued while the writer is alive
            raise WriterKilled
        return written


def test_a_log_writer_that_died_is_replaced_and_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer thread's excepthook (`configure_logging`'s: it flushes the log) waited
    for the writer itself, for ever, with a line queued; and the lines logged after it
    died were never written, while each flush waited for them."""
    died = threading.Event()
    seen: list[threading.ExceptHookArgs] = []

    def hook(args: threading.ExceptHookArgs) -> None:
        seen.append(args)
        died.set()

    monkeypatch.setattr(threading, "excepthook", hook)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # configure_logging wraps both
    logger = logging.getLogger("laneserve.test.dying")
    stream = DyingStream(logger)
    monkeypatch.setattr(sys, "stderr", stream)
    configure_logging("info")
    logger.warning("first")
    assert died.wait(timeout=60)  # the hook ran: it did not wait for its own thread
    (args,) = seen
    assert args.exc_type is WriterKilled
    assert args.thread is not None
    args.thread.join(timeout=60)
    assert not args.thread.is_alive()
    logger.warning("after")  # a new writer writes the line left queued, then this one
    assert flush_logs()
    messages = [line.rpartition(": ")[2] for line in stream.getvalue().splitlines()]
    assert messages == ["first", "behind it", "after"]


def test_a_log_writer_that_died_with_its_queue_full_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The queue full when the writer died, the next line was dropped before a writer was
    looked for: none was started, the queued lines were never written and every later
    line was dropped too."""
    died: list[threading.Thread | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.thread))
    logger = logging.getLogger("laneserve.test.dying_full")
    logger.propagate = False
    stream = DyingStream(logger)
    handler = QueuedStreamHandler(stream, max_lines=1)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    try:
        logger.warning("first")  # its write queues "behind it" (the queue is full), then dies
        writer = handler._writer
        assert writer is not None
        writer.join(timeout=60)
        assert died == [writer]
        logger.warning("after")  # dropped: the queue is still full
        assert handler.flush_lines(), "a new writer wrote what waited"
        lines = stream.getvalue().splitlines()
        assert lines[:2] == ["first", "behind it"]
        assert lines[2].startswith("dropped 1 log line(s)")
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_closing_the_log_writes_the_lines_left_behind_a_writer_that_died(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A writer that died with a line queued behind it, and no line logged since to
    replace it: close() found no live writer and returned, the line lost at exit."""
    monkeypatch.setattr(threading, "excepthook", lambda _args: None)
    logger = logging.getLogger("laneserve.test.dying_close")
    logger.propagate = False
    stream = DyingStream(logger)
    handler = QueuedStreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    try:
        logger.warning("first")  # its write queues "behind it", then the writer dies
        writer = handler._writer
        assert writer is not None
        writer.join(timeout=60)
        assert not writer.is_alive()
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert stream.getvalue().splitlines() == ["first", "behind it"]


class WriterHeldStream(HeldStream):
    """Holds the log writer's writes until `opened` is set; another thread's (a
    traceback's) go through at once."""

    def write(self, text: str) -> int:
        if threading.current_thread().name == "laneserve-log-writer":
            return super().write(text)
        return io.StringIO.write(self, text)


def crash() -> None:
    raise RuntimeError("crash")


@pytest.mark.parametrize("hook", ["sys", "threading"])
def test_lines_logged_before_an_uncaught_exception_come_before_its_traceback(
    hook: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python writes an uncaught exception's traceback to stderr directly: the lines
    logged before it, still queued for the writer, came after it."""
    stream = WriterHeldStream()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    configure_logging("info")
    configure_logging("info")  # again, as tests do: the hooks are wrapped once
    (handler,) = logging.getLogger().handlers
    assert isinstance(handler, QueuedStreamHandler)
    flushes: list[bool] = []
    flush_lines = handler.flush_lines

    def open_then_flush() -> bool:
        stream.opened.set()  # stderr is read again once the hook waits for its lines
        flushes.append(flush_lines())
        return flushes[-1]

    monkeypatch.setattr(handler, "flush_lines", open_then_flush)
    logger = logging.getLogger("laneserve.test.crash")
    try:
        for index in range(3):
            logger.warning("line %d", index)
        assert stream.entered.wait(timeout=60)
        try:
            crash()
        except RuntimeError as error:
            if hook == "sys":
                sys.excepthook(type(error), error, error.__traceback__)
            else:
                threading.excepthook(
                    threading.ExceptHookArgs(
                        [type(error), error, error.__traceback__, threading.current_thread()]
                    )
                )
        assert flushes == [True]
    finally:
        stream.opened.set()
    assert handler.flush_lines()
    text = stream.getvalue()
    assert text.index("line 2") < text.index("Traceback") < text.index("RuntimeError: crash")


def test_log_lines_past_the_queues_characters_are_dropped_and_counted() -> None:
    """A line with a traceback is kilobytes: 10 000 of them waiting held tens of MiB."""
    stream = HeldStream()
    handler = QueuedStreamHandler(stream, max_chars=12)
    logger = queued_log(handler)
    try:
        logger.warning("line 0")
        assert stream.entered.wait(timeout=60)  # the writer holds line 0: 12 chars may wait
        for index in range(1, 6):
            logger.warning("line %d", index)  # 6 characters each
        assert handler.dropped_lines == 3
        stream.opened.set()
        assert handler.flush_lines()
        logger.warning("a line longer than the bound")  # nothing waits: it is written
        assert handler.flush_lines()
    finally:
        stream.opened.set()
        handler.close()
    lines = stream.getvalue().splitlines()
    assert lines[:3] == ["line 0", "line 1", "line 2"]
    assert lines[3].startswith("dropped 3 log line(s)")
    assert lines[4:] == ["a line longer than the bound"]
    assert handler.dropped_lines == 3


def test_configured_logging_writes_every_logger_to_stderr_through_the_queue(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", json_lines=True)
    (handler,) = logging.getLogger().handlers
    try:
        assert isinstance(handler, QueuedStreamHandler)
        log_event(logging.getLogger("laneserve.test"), logging.INFO, "ours", "one", n=1)
        logging.getLogger("grpc._cython").warning("two")  # another library's, via the root
        assert flush_logs()
        documents = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert [(d["event"], d["message"]) for d in documents] == [("ours", "one"), ("log", "two")]
    finally:
        handler.close()


def test_a_late_refusal_burst_is_timed_from_its_first_refusal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    events = EventLog(max_batch_size=64, interval_s=10.0, monotonic=clock, timer=FakeTimers())
    caplog.set_level(logging.INFO, logger="laneserve.server.telemetry")
    clock.now_s += 3600  # an hour of quiet after start-up
    events.rejected("bulk", "LANE_FULL", 0.0)
    (record,) = caplog.records
    assert record.getMessage() == "admission refused 1 request(s) in 0.0s"


def test_the_client_libraries_continue_the_callers_trace(small_model: Path) -> None:
    """AsyncClient and Client (whose calls run on its own loop thread) both send the
    caller's current span as the parent of the server's spans."""
    caller = TracerProvider().get_tracer("caller")

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving_traced(engine, config(small_model)) as (s, exporter):
            with caller.start_as_current_span("async caller") as span:
                async with AsyncClient(s.target) as client:
                    await client.infer({"input": rows(1)}, request_id="async", timeout=10)
                async_trace = span.get_span_context().trace_id

            def call_sync() -> int:
                with (
                    caller.start_as_current_span("sync caller") as span,
                    Client(s.target) as client,
                ):
                    client.infer({"input": rows(1)}, request_id="sync", timeout=10)
                    return span.get_span_context().trace_id

            sync_trace = await asyncio.to_thread(call_sync)
        traces = {
            request_id: trace_id(span) for request_id, span in by_request_id(exporter).items()
        }
        assert traces == {"async": async_trace, "sync": sync_trace}

    asyncio.run(scenario())


class _StuckExporter(InMemorySpanExporter):
    """An exporter whose shutdown waits for `release` (a collector that never answers,
    retried for the exporter's own timeout: fault injection)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def shutdown(self) -> None:
        self.release.wait()
        super().shutdown()


def test_stopping_waits_a_bounded_time_for_an_exporter_that_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exporter retrying an unreachable collector held every stop for its timeout (a
    second signal's too): stopping waits SPAN_FLUSH_S for the last spans, then goes on."""
    monkeypatch.setattr(assembly, "SPAN_FLUSH_S", 0.05)
    exporter = _StuckExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = cpu_telemetry(tracer_provider=provider, owns_tracer_provider=True)
    closing = threading.Thread(target=telemetry.close, daemon=True)
    closing.start()
    closing.join(30)
    stuck = not exporter.release.is_set()
    exporter.release.set()  # the flush thread ends: nothing is left running
    assert stuck
    assert not closing.is_alive(), "close() waited for the exporter"


def test_a_metrics_port_in_use_on_ipv6_is_named_as_a_reader_can_split_it() -> None:
    """The refusal printed "cannot serve metrics on ::1:9464": host and port ran into
    each other. It brackets the address as gRPC's own errors do."""
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with pytest.raises(OSError, match=re.escape(f"cannot serve metrics on [::1]:{taken}: ")):
            MetricsEndpoint(prometheus_client.CollectorRegistry(), "::1", taken)


def test_enqueue_carries_the_deadline_of_a_stream_item_that_waited_for_room(
    small_model: Path,
) -> None:
    """A stream item waits 1 s (a manual clock) for room in the full bulk lane, whose
    timeout is 3 s. The scheduler counts that timeout from the item's arrival: 2 s are
    left when it is queued. `enqueue`'s laneserve.deadline_ms counted the timeout in full
    from then (3000 ms), a second past the deadline the item is shed at."""
    lanes = (
        LaneConfig("interactive", capacity_rows=64, timeout_ms=60_000, max_wait_ms=0, min_share=0),
        LaneConfig("bulk", capacity_rows=2, timeout_ms=3_000, max_wait_ms=0, min_share=0),
    )

    async def scenario() -> Any:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, lanes=lanes, default_lane="bulk")
        telemetry, exporter = traced(engine, server_config)
        clock = ManualClock()
        async with serving(engine, server_config, telemetry=telemetry, clock=clock) as s:
            servicer = s.server._servicer
            assert servicer is not None
            engine.hold_next()
            held = asyncio.ensure_future(s.stub.Infer(request(rows(2), lane="bulk")))
            await entered(engine)
            queued = asyncio.ensure_future(s.stub.Infer(request(rows(2), lane="bulk")))
            await until(lambda: queued_rows(s, "bulk") == 2)  # the lane is full
            item = request(rows(2), request_id="waited", lane="bulk")
            answers = s.stub.InferStream(iter([item]))
            await until(lambda: bool(servicer._room_lines.get("bulk")))  # it waits for room
            clock.advance(1.0)
            engine.release()
            await asyncio.gather(held, queued)
            answer = await answers.read()
            assert isinstance(answer, pb.InferStreamResponse)
            assert answer.WhichOneof("result") == "response"
        (enqueue,) = [
            span
            for span in spans_named(exporter, "enqueue")
            if span.attributes and span.attributes.get("laneserve.request_id") == "waited"
        ]
        return attr(enqueue, "laneserve.deadline_ms")

    assert asyncio.run(scenario()) == 2000.0
