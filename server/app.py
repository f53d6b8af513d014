"""Assembly of a serving process: engine, scheduler thread, servicers, lifecycle; the
ports (one gRPC server per gRPC port, the HTTP port), health, reflection and Channelz;
and the drain and stop (`LaneServer.stop`: the grace, then the fixed waits for a batch
still running, RUNNING_BATCH_WAIT_S, and text answers still encoded,
TEXT_ANSWERS_WAIT_S).

server = LaneServer(load_engine(config), config)   # slow: loads and probes the model
port = await server.start()                        # listening, health SERVING
...
await server.stop()                                # drains, answers everything, stops
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
from grpc_channelz.v1 import channelz, channelz_pb2
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from laneserve.server.addresses import bare_host, bind_refusal, host_port
from laneserve.server.clock import Clock, SystemClock
from laneserve.server.config import ConfigError, ServerConfig
from laneserve.server.cost_model import RunTimeModel
from laneserve.server.engine import Engine
from laneserve.server.errors import DrainingError, LaneserveError, SessionBrokenError
from laneserve.server.events import FanOut, NullTracer, SchedulerEvents
from laneserve.server.grpc_accept import (
    CallGate,
    ParallelAcceptors,
)
from laneserve.server.grpc_calls import GrpcCallCounts, GrpcCalls
from laneserve.server.grpc_methods import add_grpc_service, add_to_server
from laneserve.server.idempotency import LedgerCounts
from laneserve.server.kserve import INFER_METHOD as KSERVE_INFER_METHOD
from laneserve.server.kserve import SERVICE_NAME as KSERVE_SERVICE_NAME
from laneserve.server.kserve import KServeServicer, add_kserve_to_server
from laneserve.server.kserve_http import IDLE_CONNECTION_S, HttpFrontEnd
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.memory import (
    MemoryEstimate,
    MemoryFacts,
    MemoryGauge,
    format_bytes,
    parse_memory_limit,
)
from laneserve.server.memory_start import (
    device_gauge,
    on_gpu,
    warn_if_the_fixed_cap_exceeds_the_fit,
    watch_memory,
)
from laneserve.server.process import open_file_limit
from laneserve.server.scheduler import Scheduler
from laneserve.server.scheduler_thread import SchedulerThread
from laneserve.server.service import InferenceServicer, OutcomeRouter, ServiceTelemetry
from laneserve.server.settings import TraceSettings
from laneserve.server.shared_memory import SharedMemoryRegions
from laneserve.server.stats import StatsRecorder
from laneserve.server.telemetry import MetricSources, Telemetry, log_event
from laneserve.server.text_thread import TextThread
from laneserve.server.tls import https_context, server_credentials
from laneserve.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)
# Held while a gRPC server is made and its Channelz id read (see `_grpc_server`).
_SERVERS_BEING_MADE = threading.Lock()

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
CHANNELZ_SERVICE_NAME = channelz_pb2.DESCRIPTOR.services_by_name["Channelz"].full_name
# Both front ends' unary inference methods, by full name (gRPC's method paths).
INFERENCE_METHODS = (f"/{SERVICE_NAME}/Infer", f"/{KSERVE_SERVICE_NAME}/{KSERVE_INFER_METHOD}")
# The names the health service answers for: the server as a whole (""), and each
# inference service every port serves (a probe naming KServe's, as a KServe deployment's
# does, was answered NOT_FOUND).
HEALTH_SERVICES = ("", SERVICE_NAME, KSERVE_SERVICE_NAME)
# After the drain, how long the stop waits for the engine thread once the run in progress
# was told to end (its requests are already answered): a run the runtime does not end in
# that time is left behind, and `laneserve serve` exits without it.
RUNNING_BATCH_WAIT_S = 1.0
# After the last batch, how long the stop waits for its answers' text to be encoded off
# the event loop (`TextThread`): a 64 MiB answer of 2-byte strings, 13 M of them, takes
# about 5 s at `scripts/bench_text.py`'s 0.36 us an element.
TEXT_ANSWERS_WAIT_S = 10.0
# Before gRPC stops, the event loop reads what gRPC's core still holds (gRPC's stop would
# cancel it, bare CANCELLED), each call answered DRAINING, for as long as the count of
# calls not yet ended falls from one interval to the next (a free loop reads thousands of
# calls a second: 256 held ones take ~0.1 s here), and at most for the bound.
CORE_QUEUE_SETTLE_S = 0.05
CORE_QUEUE_WAIT_S = 2.0
# Inference calls (Infer; ModelInfer) each port asks gRPC's core for at once, per method,
# beside grpc.aio's own one (see grpc_accept). Quick runs of (a) on 2 cores: 0 -> 3 -> 7
# took 1 916 -> 2 593 -> 2 689 calls/s at 32 callers and 2 123 -> 3 039 -> 3 303 at 128,
# with p99 falling. An ask waits in gRPC's core, which completes it when a call comes:
# nothing polls.
INFER_ACCEPTORS = 8
# ... while the port has fewer calls in progress than this many batches at the cap (see
# grpc_accept): enough to fill the next batches.
ACCEPT_BELOW_BATCHES = 2
# How long a stop waits for the acceptors to see their asks fail.
ACCEPTORS_CLOSE_S = 1.0
# The shortest interval between a client's keepalive pings on a connection without
# traffic that the server takes (`_bare_grpc_server`). gRPC's default takes one per 5 min
# and, at the third ping sooner, hangs up (GOAWAY too_many_pings, which grpc-js and
# grpc-go answer by doubling their interval): clients ping to find a dead connection
# sooner than that.
MIN_CLIENT_PING_INTERVAL_MS = 60_000
# A gRPC connection with no call in progress is closed (GOAWAY) after this long, the
# HTTP port's own bound; a client's channel connects again on its next call. gRPC kept
# one for ever: 400 connections that sent their preface and nothing more took every file
# of the process, and both ports and the metrics endpoint stopped answering (a review).
IDLE_CONNECTION_MS = round(IDLE_CONNECTION_S * 1000)
# The share of the open-file limit one gRPC port's connections may take at once (a
# quarter, as shared memory regions may take another): past it gRPC closes a new
# connection at once, and the process keeps files for the rest.
CONNECTION_SHARE_OF_FILES = 4
# gRPC's bitset of the compression algorithms it takes (bit 0: identity): identity only
# refuses a compressed request UNIMPLEMENTED on its header, before inflating it.
IDENTITY_ONLY_ALGORITHMS = 1


def pending_call_limits(max_pending_calls: int) -> list[tuple[str, int]]:
    """gRPC core's limits on calls not yet taken by the event loop: refusals start at
    three quarters of `max_pending_calls` (at random, ever likelier) and are certain at
    it. The soft limit sits high so that bursts below it pass untouched."""
    return [
        ("grpc.server.max_pending_requests", max_pending_calls * 3 // 4),
        ("grpc.server.max_pending_requests_hard_limit", max_pending_calls),
    ]


async def _give_back(servers: list[grpc.aio.Server]) -> None:
    """Closes the ports of `servers`, started or not, so that an embedder whose start
    failed can retry on them. gRPC closes a server's listeners only once it has started
    (an unstarted one holds them until the process exits, collected or not), so each is
    started, where it has not been, and stopped at once; a call in between is refused
    UNAVAILABLE (the state is not SERVING)."""
    for server in servers:
        with contextlib.suppress(Exception):  # started already, or its start fails again
            await server.start()
        await server.stop(None)


def _rows_or_none(rows: int | None) -> str:
    return "none" if rows is None else f"{rows} rows"


# What to do about a start out of file descriptors (EMFILE).
OPEN_FILES_HINT = (
    "expected a higher open-file limit (`ulimit -n`: the server holds a few dozen files of "
    "its own and one per client connection)"
)
# The open-file limit (`ulimit -n`) under which a server refuses to start: an idle server
# holds ~20 files (17 measured, with the HTTP and metrics ports open), each client
# connection one more. Below it a start ran out midway: Python's EMFILE where it came
# first, or (Python 3.13, `ulimit -n 12`) an abort inside gRPC's core, which takes no
# error it cannot open its wakeup fd ("Eventfd wakeup fd is not supported", SIGABRT).
MIN_OPEN_FILES = 64


def receive_window_options(window_bytes: int) -> list[tuple[str, int]]:
    """gRPC's options for server.receive_window_bytes: none at 0 (its own sizing, by
    bandwidth-delay probes, which grows a stream's window as fast as the caller sends,
    unread or not); else the probes off and every stream's window fixed at
    `window_bytes` (its lookahead). A message larger than it still passes, once read:
    the core widens the window to the message a pending read waits for."""
    if window_bytes == 0:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window_bytes)]


def connection_limit() -> list[tuple[str, int]]:
    """gRPC's option bounding a port's connections to a quarter of the open-file limit
    (CONNECTION_SHARE_OF_FILES); none where the limit is infinite."""
    limit = open_file_limit()
    if limit is None:
        return []
    return [("grpc.max_allowed_incoming_connections", max(1, limit // CONNECTION_SHARE_OF_FILES))]


def check_open_file_limit() -> None:
    """Refuses a process whose open-file limit is under MIN_OPEN_FILES, naming both:
    `serve` before the model loads, and every LaneServer's start (an embedder's too)."""
    limit = open_file_limit()
    if limit is not None and limit < MIN_OPEN_FILES:
        raise ConfigError(
            f"the open-file limit is {limit}, under the {MIN_OPEN_FILES} a server needs at "
            f"the least; {OPEN_FILES_HINT}"
        )


class _LongStreams:
    """The server's long-lived streams, every port's (health Watch, reflection), which
    the drain ends (`end`): open as long as their callers keep them, each held the stop
    for gRPC's whole grace, then ended UNAVAILABLE. `end` cancels the task of each
    stream `running`; the stream, seeing `ended`, takes the cancel for its end and ends
    OK in its own way."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[object]] = set()
        self.ended = False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The current task is a long stream until the block ends."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)

    def end(self) -> None:
        self.ended = True
        for task in self._tasks:
            task.cancel()


class _HealthServicer(health.aio.HealthServicer):
    """gRPC's health service, whose Watch calls end (OK, after their last status) when
    the server stops (`streams.end`)."""

    def __init__(self, streams: _LongStreams) -> None:
        super().__init__()
        self._streams = streams

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        if self._streams.ended:
            # Opened after the watches ended, late in a stop: its status, then its end.
            # Waiting, it held gRPC's stop for its whole grace and ended UNAVAILABLE.
            await context.write(_stopped_status(request.service))
            return
        with self._streams.running():
            await self._watch_until_ended(request, context)

    async def _watch_until_ended(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> None:
        """gRPC's Watch, ended OK by the drain after its last status."""
        written = _LastWritten(context)
        try:
            # gRPC's servicer uses its context's `write` alone, which `written` has.
            await super().Watch(request, written)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            if not self._streams.ended:
                raise  # the caller went away
            # gRPC's servicer sends NOT_SERVING to one watch at a time (each write under
            # its lock): the drain ended the rest before their turn, 7 of 10 open
            # watches and 991 of 1 000 ending OK without it. Sent now, where not yet sent.
            last = _stopped_status(request.service)
            if written.status != last.status:
                await context.write(last)


def _stopped_status(service: str) -> health_pb2.HealthCheckResponse:
    """A stopped server's health answer to a Watch of `service`."""
    known = service in HEALTH_SERVICES
    return health_pb2.HealthCheckResponse(status="NOT_SERVING" if known else "SERVICE_UNKNOWN")


class _LastWritten:
    """A Watch call's context as gRPC's health servicer uses it, keeping the status it
    last wrote (`status`; None: none yet). Set as the write begins: once it is awaited
    the message is gRPC's to send, and a write cut off by the drain still goes out.
    Set after it, the drain wrote the status again while gRPC still sent the first:
    refused (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS), the call never ended and held the
    stop for gRPC's whole grace (2 of 45 stops with watches open)."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self.status: int | None = None

    async def write(self, answer: health_pb2.HealthCheckResponse) -> None:
        self.status = answer.status
        await self._context.write(answer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class _PortHealth:
    """The health service as one port serves it: the server's own (`_HealthServicer`,
    one for every port: one status to set, one drain that ends every watch), its Watch
    streams counted by the port's gate (`CallGate.gate_watch`), so that a flood of them
    on the main port never refuses the priority port's. Its other methods (Check) are
    the shared servicer's, uncounted."""

    def __init__(self, shared: _HealthServicer, gate: CallGate) -> None:
        self._shared = shared
        self.Watch = gate.gate_watch(shared.Watch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)


def _ended_by_the_drain(
    behavior: Callable[..., Any], streams: _LongStreams
) -> Callable[..., AsyncIterator[Any]]:
    """`behavior` (reflection's stream: an async generator of answers), ended OK by the
    drain (`streams.end`); one opened after it ends at once."""

    async def ended(requests: Any, context: Any) -> AsyncIterator[Any]:
        if streams.ended:
            return
        with streams.running():
            try:
                async for answer in behavior(requests, context):
                    yield answer
            except asyncio.CancelledError:
                if not streams.ended:
                    raise  # the caller went away
                # Ended by the drain while it waited for its caller's next request (where
                # an open stream waits): returned, the stream ends OK.

    return ended


class _PortReflection:
    """gRPC's reflection service as one port serves it: its streams, open as long as
    their callers keep them, counted with the port's health watches
    (`CallGate.gate_reflection`) and ended by the drain (`_LongStreams`)."""

    def __init__(
        self,
        shared: reflection.aio.ReflectionServicer,
        gate: CallGate,
        streams: _LongStreams,
    ) -> None:
        self._shared = shared
        self.ServerReflectionInfo = gate.gate_reflection(
            _ended_by_the_drain(shared.ServerReflectionInfo, streams)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)


@dataclasses.dataclass(frozen=True, slots=True)
class _Listener:
    """One port's gRPC server: the port it bound, the acceptors that take its inference
    calls (to start once it has started), and its Channelz ids (gRPC's call counts)."""

    server: grpc.aio.Server
    port: int
    acceptors: ParallelAcceptors
    channelz_ids: frozenset[int]


def _retrieve_error(task: asyncio.Future[Any]) -> None:
    """Takes a shielded task's error: its caller, cancelled, takes none, and asyncio
    would log it as "never retrieved"."""
    if not task.cancelled():
        task.exception()


def load_engine(config: ServerConfig) -> Engine:
    return Engine(
        config.model_path,
        device=config.device,
        intra_op_threads=config.intra_op_threads,
        memory_limit=None
        if config.memory_limit is None
        else parse_memory_limit(config.memory_limit),
        probe_shapes=config.probe_shapes,
    )


def _line(estimate: MemoryEstimate | None) -> str:
    if estimate is None:
        return "n/a"
    return f"{format_bytes(estimate.fixed_bytes)} + {format_bytes(estimate.per_row_bytes)}/row"


class LaneServer:
    """One model served over gRPC. Create and start it inside the event loop it serves on."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        *,
        events: SchedulerEvents | None = None,
        clock: Clock | None = None,
        memory_gauge: MemoryGauge | None = None,
        telemetry: Telemetry | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        """`engine`: this server's alone (its stop ends the engine's runs for good): a
        new Engine for each LaneServer; one serving another, or spent by a stop, is
        refused (RuntimeError). One whose server could not be made, or failed to start,
        may serve another.
        `telemetry`: traces, metrics and event logs; by default from the config and the
        OTEL_* variables (Telemetry.from_config). A server refused at start closes the
        telemetry it built; one passed in stays the caller's to close. `events`: one more
        sink, for tests. `stopping`: set from another thread (a stop signal while
        starting), the start-up probe times no further batch size and the server is not
        made (ProbeStopped)."""
        engine.check_free()  # first: a spent or shared engine is refused before its probe
        self.config = config
        self.engine = engine
        self.clock = clock or SystemClock()
        self.state = Lifecycle.STARTING
        device = device_gauge(engine)
        # The engine's, worked out before its session (a failed one too, None: the child
        # ran ~1 s and logged why; a second run would do both again).
        self.memory_estimate = engine.static_estimate
        self.probe = engine.probe(
            config.batch_cap or config.max_batch_size,
            fixed_cap=config.batch_cap is not None,
            gauge=device,
            # No batch holds more rows than the lanes queue together.
            queue_rows=sum(lane.capacity_rows for lane in config.lanes),
            stopping=stopping,
        )
        run_ms = {rows: round(seconds * 1000, 3) for rows, seconds in self.probe.run_s.items()}
        limit = engine.memory_limit_bytes
        # The per-row figures hold for rows of these shapes only: a text model probed at
        # sequence length 1 read 214 B/row where its rows at 512 took 535 KiB.
        probe_shapes = {name: list(shape) for name, shape in engine.probe_shapes.items()}
        sizes_note = (
            " (dynamic sizes not configured are 1, longer rows take more: set "
            "server.probe_shapes, --probe-shape NAME=D1,D2,...)"
            if any(
                dim < 0
                for spec in engine.inputs
                if spec.name not in config.probe_shapes
                for dim in spec.shape[1:]
            )
            else ""
        )
        log_event(
            log,
            logging.INFO,
            "probe",
            f"probe: batch_cap={self.probe.batch_cap} (max_batch_size {config.max_batch_size}, "
            f"first out-of-memory at {_rows_or_none(self.probe.first_failing_rows)}; "
            f"stopped by {self.probe.stop_reason}) "
            f"memory_limit={'none' if limit is None else format_bytes(limit)} "
            f"probe_shapes={probe_shapes}{sizes_note} "
            f"estimate={_line(self.memory_estimate)} measured={_line(self.probe.memory_fit)} "
            f"run time by batch size { {rows: f'{ms:.2f}ms' for rows, ms in run_ms.items()} }",
            batch_cap=self.probe.batch_cap,
            max_batch_size=config.max_batch_size,
            first_failing_rows=self.probe.first_failing_rows,
            stop_reason=self.probe.stop_reason,
            memory_limit_bytes=limit,
            probe_shapes=probe_shapes,
            run_ms=run_ms,
        )
        warn_if_the_fixed_cap_exceeds_the_fit(config, self.probe)
        self.stats = StatsRecorder([lane.name for lane in config.lanes], clock=self.clock)
        self.telemetry = telemetry or Telemetry.from_config(config, engine.providers)
        self.telemetry.event_log.arena = "device" if on_gpu(engine) else "host arena"
        try:
            # The watermark's reading: the device's, unless a test supplies its own.
            # The weights (the static estimate's, 0 unknown) count in the idle reading.
            weights_bytes = self.memory_estimate.fixed_bytes if self.memory_estimate else 0
            # On a GPU the probe's NVML gauge reads for the watermark too (one opened, not
            # two); the CPU's takes the watermark, made after.
            watermark, self.memory_gauge = watch_memory(
                config,
                engine,
                memory_gauge or (device if on_gpu(engine) else None),
                weights_bytes,
                self.probe,
            )
        except BaseException:
            # Refused, no stop() will close it: its exporters' threads stayed behind.
            if telemetry is None:
                self.telemetry.close()
            raise
        sinks = [self.stats, *self.telemetry.events, *([] if events is None else [events])]
        self.events = FanOut(*sinks)
        self.scheduler = Scheduler(
            config.lanes,
            batch_cap=self.probe.batch_cap,
            run_time=RunTimeModel(self.probe.run_s),
            events=self.events,
            watermark=watermark,
            run_time_signature=engine.probe_signature,
        )
        self._long_streams = _LongStreams()  # health watches and reflection streams
        self._health = _HealthServicer(self._long_streams)
        # Triton's system shared memory regions, one registry for every port's KServe
        # front end; let go of as the server stops.
        self.shared_memory = SharedMemoryRegions(enabled=config.shared_memory)
        self._thread: SchedulerThread | None = None
        self._servicer: InferenceServicer | None = None
        # Long text is decoded (the servicer) and answers of it encoded (the router) on
        # it; once started.
        self._text: TextThread | None = None
        self._listeners: list[_Listener] = []  # the main port's first, once started
        self._grpc_calls: GrpcCallCounts | None = None  # once the gRPC server runs
        self._stopped = asyncio.Event()
        # Set once start() has returned or raised. What a start has started (threads,
        # bound ports, the metrics endpoint) is known only then, so stop() waits for it:
        # a stop that ran in between saw nothing started, and the start went on to serve.
        self._start_ended: asyncio.Event | None = None
        # Set when the scheduler or engine thread failed; the server then stops itself.
        self.failure: LaneserveError | None = None
        # After stop: whether the engine thread ended (a run the runtime would not end
        # is still going; the process must not wait for it, see cli).
        self.threads_stopped = True
        self._grace_ended = False  # end_grace() was called (see there)
        # A stop the server began itself (its scheduler failed, its start was cancelled),
        # held so that the task is not collected; and the drain a stop() began.
        self._own_stop: asyncio.Future[None] | None = None
        self._stopping: asyncio.Future[None] | None = None
        self.port = 0
        self.priority_port: int | None = None  # bound, when configured
        self.metrics_port: int | None = None  # the Prometheus endpoint's, once started
        self.http_port: int | None = None  # KServe v2 HTTP's, once started (configured)
        self._http: HttpFrontEnd | None = None
        # Last: a server that could not be made leaves its engine free for another.
        engine.claim()

    async def start(self) -> int:
        """Binds, starts the threads and serves; returns the bound port. A LaneServer
        starts once: a second start, or one after stop(), raises RuntimeError."""
        once = "a LaneServer starts once (create another to serve again)"
        if self.state is not Lifecycle.STARTING:
            raise RuntimeError(f"LaneServer.start(): the server is {self.state.value}; {once}")
        if self._start_ended is not None:
            how = "failed" if self._start_ended.is_set() else "is in progress"
            raise RuntimeError(
                f"LaneServer.start(): the server is STARTING and its start {how}; {once}"
            )
        ended = self._start_ended = asyncio.Event()
        # A start, once begun, runs to its end, and a caller that cancels it (wait_for's
        # timeout, a task group's failure) leaves the server to stop once started:
        # cancelled in gRPC's start, after the threads started and every port was bound,
        # it left them running with nothing to stop them.
        starting = asyncio.ensure_future(self._start())

        starting.add_done_callback(lambda _: ended.set())
        starting.add_done_callback(_retrieve_error)
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            self._own_stop = asyncio.ensure_future(self.stop())
            raise
        except BaseException:
            # A start that failed (a port in use) served nothing: its engine may serve
            # another server (an embedder retrying on other ports).
            self.engine.release_claim()
            raise

    async def _start(self) -> int:
        check_open_file_limit()
        credentials = server_credentials(self.config)  # unreadable files fail before all else
        self.telemetry.count_unsent_answers((SERVICE_NAME, KSERVE_SERVICE_NAME), INFERENCE_METHODS)
        # NOT_SERVING until it serves (gRPC's health servicer begins SERVING): the main
        # port answers while the priority port starts, and refuses Infer meanwhile.
        for name in HEALTH_SERVICES:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        text = self._text = TextThread()
        router = OutcomeRouter(loop, text)
        thread = self._thread = SchedulerThread(
            self.scheduler,
            self.engine.run_batch,
            router.deliver,
            clock=self.clock,
            memory_gauge=self.memory_gauge,
            release_memory=self.engine.release_idle_memory,
            on_failure=lambda error: loop.call_soon_threadsafe(self._scheduler_failed, error),
        )
        if self._grace_ended:
            thread.end_grace()
            text.cut()
        watermark = self.scheduler.watermark  # its marks are set once, when it is made
        self.telemetry.observe(
            MetricSources(
                depths=thread.depths,
                batch_cap=lambda: thread.batch_cap,
                max_batch_cap=thread.max_batch_cap,
                counts=self.stats.counts,
                grpc_calls=self.grpc_calls,
                ledger=self.ledger_counts,
                watermark=thread.watermark_state,  # what GetStats reports
                high_watermark_bytes=None if watermark is None else watermark.high_bytes,
                low_watermark_bytes=None if watermark is None else watermark.low_bytes,
                state=lambda: self.state,
                model_path=self.config.model_path,  # as GetModel names it
                model_sha256=self.engine.identity.sha256,
                memory_limit_bytes=self.engine.memory_limit_bytes,
                # None while shared memory is off: its figures absent, not 0.
                shared_memory=self.shared_memory.counts if self.shared_memory.enabled else None,
                # None until the HTTP port serves (none configured: absent throughout).
                http_requests=lambda: None if self._http is None else self._http.answered(),
                answers_unsent=self.telemetry.unsent_answers.counts,
                text_thread=text.counts,
            )
        )
        servicer = self._servicer = InferenceServicer(
            self.config,
            self.engine,
            self._thread,
            self.stats,
            state=lambda: self.state,
            clock=self.clock,
            started_s=self.clock.monotonic(),
            memory=MemoryFacts(
                limit_bytes=self.engine.memory_limit_bytes,
                probed_batch_cap=self.probe.batch_cap,
                estimate=self.memory_estimate,
                measured=self.probe.memory_fit,
            ),
            telemetry=ServiceTelemetry(
                events=self.events,
                tracer=self.telemetry.tracing or NullTracer(),
                device_utilization=self.telemetry.device_utilization,
                grpc_calls=self.grpc_calls,
            ),
            # One id for GetStats and the metrics' target_info.
            instance_id=self.telemetry.instance_id,
            text=text,
        )
        # One gRPC server per port, all in front of the same servicer and lanes: gRPC's
        # core queues the calls the event loop has not yet taken per server (and per
        # method), so calls on the priority port never wait behind a flood queued on the
        # main port.
        listeners: list[_Listener] = []  # the main port's first
        try:
            listeners.append(
                self._grpc_server(
                    servicer, credentials, self.config.port, "port", self.config.max_pending_calls
                )
            )
            if self.config.priority_port >= 0:
                listeners.append(
                    self._grpc_server(
                        servicer,
                        credentials,
                        self.config.priority_port,
                        "priority_port",
                        self.config.priority_max_pending_calls,
                    )
                )
            self.metrics_port = self.telemetry.serve_metrics(
                self.config.host, self.config.metrics_port, https_context(self.config)
            )
        except BaseException:
            await _give_back([each.server for each in listeners])  # no acceptor started
            self.telemetry.close()  # its exporter threads, and the metrics endpoint
            raise
        self.port = listeners[0].port
        if len(listeners) > 1:
            self.priority_port = listeners[1].port
        servers = [each.server for each in listeners]
        self._thread.start()
        try:
            for each in servers:
                await each.start()
            for listener in listeners:
                listener.acceptors.start()
            self.http_port = await self._start_http(servicer)
        except BaseException:
            # gRPC's own start, or the HTTP port's, failed: what this start began is
            # stopped here, since a stop() after a failed start finds nothing started.
            # Nothing was admitted (the state is not SERVING), so no request is left
            # without its answer.
            await self._stop_http()
            await asyncio.to_thread(self._thread.close, join_timeout_s=RUNNING_BATCH_WAIT_S)
            await _give_back(servers)
            for listener in listeners:
                await listener.acceptors.wait_closed(ACCEPTORS_CLOSE_S)
            self.telemetry.close()
            raise
        self._grpc_calls = GrpcCallCounts(set().union(*(each.channelz_ids for each in listeners)))
        self._listeners = listeners
        self.state = Lifecycle.SERVING
        if self.failure is not None:  # the scheduler failed while the server started
            self._own_stop = asyncio.ensure_future(self.stop())
            return self.port
        for name in HEALTH_SERVICES:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        identity = self.engine.identity
        log_event(
            log,
            logging.INFO,
            "startup",
            # Which model this instance ran: its files' hash (short here, whole in the
            # field) and its own version, as GetModel reports them.
            f"serving {self.config.model_path} (sha256 {identity.sha256[:12] or 'unknown'}, "
            f"model_version {'none' if identity.version is None else identity.version}) "
            f"on {host_port(self.config.host, self.port)}"
            + ("" if self.priority_port is None else f", priority port {self.priority_port}")
            + ("" if self.http_port is None else f", HTTP port {self.http_port}"),
            model=self.config.model_path,
            model_sha256=identity.sha256,
            model_version=identity.version,
            port=self.port,
            priority_port=self.priority_port,
            http_port=self.http_port,
            providers=self.engine.providers,
            batch_cap=self.scheduler.batch_cap,
            max_batch_size=self.config.max_batch_size,
            memory_limit_bytes=self.engine.memory_limit_bytes,
            lanes=[lane.name for lane in self.config.lanes],
            metrics_port=self.metrics_port,
            tracing=self.telemetry.tracing is not None,
        )
        return self.port

    def _bare_grpc_server(self, max_pending_calls: int) -> grpc.aio.Server:
        """A gRPC server with laneserve's options, no service yet (see `_grpc_server`)."""
        limit = self.config.max_message_bytes
        # gRPC inflates a compressed request up to `limit` before laneserve reads a byte
        # of it (78 KiB of gzip took 0.4 s to refuse): off, none is inflated.
        compression = (
            []
            if self.config.compressed_requests
            else [("grpc.compression_enabled_algorithms_bitset", IDENTITY_ONLY_ALGORITHMS)]
        )
        return grpc.aio.server(
            interceptors=self.telemetry.interceptors,
            # max_concurrent_rpcs is the CallGate's: gRPC's count misses the calls the
            # ParallelAcceptors take.
            maximum_concurrent_rpcs=None,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # A port another server listens on is refused, not shared: with gRPC's
                # default (SO_REUSEPORT) the kernel would split the connections.
                ("grpc.so_reuseport", 0),
                # gRPC ignores an option name it does not know: this is the string the
                # core reads (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS's).
                ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
                # ... and on a connection with no call too (else one per 2 h is taken):
                # grpc-js' keepalive_permit_without_calls and grpc-go's
                # PermitWithoutStream ping idle connections. At one a minute at most, an
                # idle connection costs a few bytes a minute.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
                *connection_limit(),
                *receive_window_options(self.config.receive_window_bytes),
                *compression,
                *pending_call_limits(max_pending_calls),
            ],
        )

    def _grpc_server(
        self,
        servicer: InferenceServicer,
        credentials: grpc.ServerCredentials | None,
        port: int,
        setting: str,
        max_pending_calls: int,
    ) -> _Listener:
        """A gRPC server with every service, bound to `port` on the configured host, its
        core holding at most `max_pending_calls` calls not yet taken. Raises OSError
        naming `setting` when it cannot bind."""
        # Its own Channelz id: the ids made while it was made. Read with no await between,
        # and under a lock of the process's: ids read around start()'s awaits, or while
        # a server started on another thread's loop, counted that server's as this one's.
        thread = self._thread
        assert thread is not None
        gate = CallGate(
            # The probed cap, not the lowest in force: one shape's out-of-memory leaves
            # the others' batches at it (a number fixed at start, not asked per call).
            self.config.max_concurrent_rpcs,
            ACCEPT_BELOW_BATCHES * thread.max_batch_cap,
        )
        with _SERVERS_BEING_MADE:
            known = GrpcCallCounts.server_ids()
            server = self._bare_grpc_server(max_pending_calls)
            channelz_ids = frozenset(GrpcCallCounts.server_ids() - known)
            # Its handlers registered under the lock too: gRPC's core aborted the process
            # (once in a CI run) when Channelz listed the servers on one thread while
            # another registered a server's methods.
            handlers = add_to_server(servicer, server, gate)
            # KServe v2 / Triton clients' service, in front of the same servicer, counted
            # by the same gate (server/kserve.py).
            handlers |= add_kserve_to_server(self._kserve_servicer(servicer), server, gate)
        # Both front ends' inference calls taken several at a time (a ModelInfer had been
        # taken at grpc.aio's own pace: 0.75x Infer's calls/s at 32 callers).
        acceptors = ParallelAcceptors(
            server,
            INFERENCE_METHODS,
            handlers,
            self.telemetry.interceptors,
            gate,
            count=INFER_ACCEPTORS,
        )
        # gRPC's own services, as their add_*_to_server and enable_server_reflection add
        # them, each request read only up to a bound (see `add_grpc_service`).
        add_grpc_service(server, health.SERVICE_NAME, _PortHealth(self._health, gate))
        # gRPC's own view: calls started, succeeded and failed, sockets. Calls its core
        # refused (max_pending_calls) count as started and never end.
        add_grpc_service(server, CHANNELZ_SERVICE_NAME, channelz.aio.ChannelzServicer())
        reflection_servicer = reflection.aio.ReflectionServicer(
            (
                SERVICE_NAME,
                KSERVE_SERVICE_NAME,
                health.SERVICE_NAME,
                CHANNELZ_SERVICE_NAME,
                reflection.SERVICE_NAME,
            )
        )
        # Only v1alpha is served: a grpc.reflection.v1 service added here needs its own
        # streams gated too.
        add_grpc_service(
            server,
            reflection.SERVICE_NAME,
            _PortReflection(reflection_servicer, gate, self._long_streams),
        )
        address = host_port(self.config.host, port)
        bound = 0
        try:
            bound = (
                server.add_insecure_port(address)
                if credentials is None
                else server.add_secure_port(address, credentials)
            )
        except RuntimeError as error:  # what grpc raises when it cannot bind
            log_event(
                log,
                logging.DEBUG,
                "bind_failed",
                f"binding {address}: {error}",
                address=address,
                error=str(error),
            )
        if bound == 0:
            refusal = bind_refusal(self.config.host, port, setting)
            # An OSError, as ever, for an embedder's start (`serve` checked the ports).
            raise OSError(
                f"cannot listen on {address} (server.{setting}): gRPC could not bind it; "
                "expected a local address and a free port (0: any free port)"
                if refusal is None
                else str(refusal)
            )
        return _Listener(server, bound, acceptors, channelz_ids)

    def grpc_calls(self) -> GrpcCalls | None:
        """gRPC's own call counts, summed over this server's ports; None before start."""
        return None if self._grpc_calls is None else self._grpc_calls.read()

    def ledger_counts(self) -> LedgerCounts | None:
        """The idempotency ledger's joins, replays and replay cache; None before start.
        Safe from any thread (the metric reader's)."""
        servicer = self._servicer
        return None if servicer is None else servicer.ledger_counts()

    def _kserve_servicer(self, servicer: InferenceServicer) -> KServeServicer:
        """KServe v2 / Triton clients' service in front of `servicer`: one per front end
        (each gRPC port, the HTTP port), all in front of the same lanes and regions."""
        return KServeServicer(
            servicer,
            self.config,
            self.engine.inputs,
            self.engine.outputs,
            self._health,
            totals=self.stats.cumulative,
            # ONNX Runtime's CUDA provider runs on its default device, 0: the first GPU
            # CUDA_VISIBLE_DEVICES lists (memory.session_gpu).
            gpu_id=0 if on_gpu(self.engine) else None,
            regions=self.shared_memory,
            trace_settings=TraceSettings(
                tracing=self.telemetry.tracing is not None,
                root=self.telemetry.root_sampler,
                model_name=self.config.served_model_name,
            ),
        )

    async def _start_http(self, servicer: InferenceServicer) -> int | None:
        """Serves KServe v2's HTTP protocol on server.http_port, in front of `servicer`
        (the main port's default lane); returns the port bound (None: not configured).
        Raises ConfigError naming server.http_port (or server.host) where it cannot
        bind."""
        if self.config.http_port < 0:
            return None
        http = self._http = HttpFrontEnd(
            self._kserve_servicer(servicer),
            max_calls=self.config.max_concurrent_rpcs,
            max_body_bytes=self.config.max_message_bytes,
            compressed_requests=self.config.compressed_requests,
            spans=self.telemetry.http_spans,
            events=self.telemetry.event_log,
        )
        host, port = bare_host(self.config.host), self.config.http_port
        tls = https_context(self.config)
        try:
            return await http.start(host, port, tls)
        except OSError as error:
            refusal = bind_refusal(self.config.host, port, "http_port")
            raise (refusal or error) from None

    async def _stop_http(self) -> None:
        if self._http is not None:
            await self._http.stop()

    async def announce_not_serving(self) -> None:
        """Health says NOT_SERVING from now on, for good (gRPC's health servicer takes no
        status after it), while the server still admits and serves: a lame-duck period
        before `stop` (`drain_delay_s`), for health checks to send callers elsewhere."""
        await self._health.enter_graceful_shutdown()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains: refuses new work, lets queued work finish within the grace period (or
        until `end_grace`), answers the rest UNAVAILABLE, then stops listening. Safe to
        call twice, and before, during or after a `start` (one in progress ends first).
        A caller that cancels it ends the grace (`end_grace`) and stops waiting; the stop
        goes on to its end (`wait_stopped`)."""
        if self._start_ended is not None:
            await self._start_ended.wait()
        if self.state in (Lifecycle.DRAINING, Lifecycle.STOPPED):
            await self._stopped.wait()
            return
        if not self._listeners:  # never started, or its start failed: nothing to drain
            self.state = Lifecycle.STOPPED
            self._release()
            await self._health.enter_graceful_shutdown()  # as every stopped server says
            self._stopped.set()
            return
        self.state = Lifecycle.DRAINING
        # A stop, once begun, runs to its end. Cancelled mid-drain (wait_for's timeout),
        # it said STOPPED with its ports open, its threads running and admitted calls
        # unanswered, and every later stop returned at once.
        stopping = self._stopping = asyncio.ensure_future(
            self._drain_then_stop(self.config.drain_grace_s if grace_s is None else grace_s)
        )
        stopping.add_done_callback(_retrieve_error)
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            self.end_grace()  # the caller gave up waiting: what is queued is answered now
            raise

    async def _drain_then_stop(self, grace_s: float) -> None:
        try:
            drained = await self._drain(grace_s)
        finally:
            self._release()
            self.state = Lifecycle.STOPPED
            self._stopped.set()
        log_event(log, logging.INFO, "shutdown", "stopped", drained=drained)

    def _release(self) -> None:
        """What a stopped server lets go of, whatever its start made: the ledger's sweep
        timer (none is armed again: no timer outlives the server), the text thread and
        its hasher (they go once the work they began ends), telemetry, and the shared
        memory regions (the servers have stopped: no call reads one)."""
        if self._servicer is not None:
            self._servicer.close()
        if self._text is not None:
            self._text.close()
        self.telemetry.close()
        self.shared_memory.close()

    async def _drain(self, grace_s: float) -> bool:
        assert self._servicer is not None
        assert self._thread is not None
        assert self._text is not None
        self._servicer.stop_reading_streams()
        await self._health.enter_graceful_shutdown()
        started_s = self.clock.monotonic()
        # Requests read before the drain whose long text is still being decoded, or data
        # hashed (off the loop), are admitted as they would have been read on the event
        # loop: the scheduler stops admitting once they are, within the grace.
        decoding = await self._text.reads_finished(0.0 if self._grace_ended else grace_s)
        self._thread.stop_accepting()
        left_s = max(0.0, grace_s - (self.clock.monotonic() - started_s))
        drained = await asyncio.to_thread(self._thread.wait_drained, left_s) and not decoding
        if not drained:
            self._log_drain_incomplete(grace_s, self.clock.monotonic() - started_s, decoding)
        await asyncio.to_thread(
            functools.partial(
                self._thread.close,
                DrainingError("server shut down before this request could run"),
                running_error=DrainingError(
                    "server shut down while this request's batch was running; its answer "
                    "was not kept (it may have run)"
                ),
                join_timeout_s=0.0,
            )
        )
        # Every request has its answer: a run still in the runtime is ended (a process
        # that exits while one runs aborts), and waited for a moment.
        self.engine.terminate_runs()
        stopped = await asyncio.to_thread(self._thread.join, RUNNING_BATCH_WAIT_S)
        self.threads_stopped = stopped
        if not stopped:
            log_event(
                log,
                logging.WARNING,
                "batch_still_running",
                f"a batch still runs {RUNNING_BATCH_WAIT_S:.1f}s after the drain; stopping "
                "without waiting for it",
                waited_s=RUNNING_BATCH_WAIT_S,
            )
        # No batch runs any more: the answers of the last ones whose text was encoded off
        # the loop reach it now.
        await self._text.encoded(TEXT_ANSWERS_WAIT_S)
        # Every RPC now has its answer; give them a moment to be written. Health watches
        # (NOT_SERVING sent) and reflection streams end now: the grace would wait for
        # them in full.
        self._long_streams.end()
        await self._read_what_grpc_holds()
        await asyncio.gather(
            *(each.server.stop(grace=2.0) for each in self._listeners),
            self._stop_http(),
        )
        for each in self._listeners:  # their asks failed as the servers stopped
            await each.acceptors.wait_closed(ACCEPTORS_CLOSE_S)
        return drained

    async def _read_what_grpc_holds(self) -> None:
        """Waits while the event loop reads (and answers DRAINING) the calls gRPC's core
        still holds, so that gRPC's stop has none left to cancel. gRPC does not say how
        many it holds; "started, not ended" holds them, plus the calls the core refused
        or dropped (never ended) and a few in progress. It falls while the held ones are
        read and stops falling when none are left: then gRPC stops. Not "until no call
        ends": a client resending on its open connection, DRAINING after DRAINING, ends
        calls all the time, and would wait for gRPC's GOAWAY (its sign to reconnect,
        elsewhere) for the whole bound. Calls arriving faster than the loop reads keep
        it from falling too: under such a flood those gRPC cancels are not avoidable."""
        assert self._grpc_calls is not None
        loop = asyncio.get_running_loop()
        until_s = loop.time() + CORE_QUEUE_WAIT_S
        calls = self._grpc_calls.read()
        while calls is not None and loop.time() < until_s:
            await asyncio.sleep(CORE_QUEUE_SETTLE_S)
            before, calls = calls, self._grpc_calls.read()
            if calls is not None and calls.unended >= before.unended:
                return

    def _log_drain_incomplete(self, grace_s: float, waited_s: float, decoding: int) -> None:
        """What the drain left: cut short by a second signal (`end_grace`), or its grace
        over; how much was queued, which batch ran, and how many requests' long text was
        still being decoded (`decoding`), all of it answered UNAVAILABLE. A drain cut short
        after a moment said it "ended after at most" its grace."""
        assert self._thread is not None
        cut_short = self._thread.grace_ended
        depths = self._thread.depths()
        queued_requests = sum(depth.queued_requests for depth in depths)
        queued_rows = sum(depth.queued_rows for depth in depths)
        running = self.telemetry.event_log.running_batch
        why = (
            f"drain cut short by a second signal after {waited_s:.1f}s of its {grace_s:.1f}s grace"
            if cut_short
            else f"drain grace of {grace_s:.1f}s over"
        )
        queued = (
            f"{queued_requests} request(s) ({queued_rows} rows) still queued"
            if queued_requests
            else "nothing queued"
        )
        if decoding:
            queued += f", {decoding} request(s) whose text was still being decoded"
        ran = "no batch" if running is None else f"batch {running.batch_id} ({running.rows} rows)"
        # The operator's second signal asked for it; a grace too short for the queue is
        # the operator's setting to change.
        remedy = (
            ""
            if cut_short
            else " (raise --drain-grace-s for the queue to finish, keeping --drain-delay-s "
            "plus it below the supervisor's kill grace: Kubernetes' "
            "terminationGracePeriodSeconds, systemd's TimeoutStopSec)"
        )
        log_event(
            log,
            logging.WARNING,
            "drain_incomplete",
            f"{why} with {queued} and {ran} running; answering them UNAVAILABLE{remedy}",
            grace_s=grace_s,
            waited_s=round(waited_s, 3),
            cut_short=cut_short,
            queued_requests=queued_requests,
            queued_rows=queued_rows,
            running_batch_id=None if running is None else running.batch_id,
            running_rows=0 if running is None else running.rows,
            decoding_requests=decoding,
        )

    def _scheduler_failed(self, error: LaneserveError) -> None:
        """The scheduler or engine thread failed for good, or the engine found the session
        broken (every live request has its answer): the server stops, so that health
        checks say NOT_SERVING and load balancers and supervisors act, instead of every
        call failing behind SERVING. The line says which, with the error: after
        session_broken it had said "the scheduler failed", the scheduler being sound."""
        if self.failure is not None:
            return
        self.failure = error
        failed = (
            f"the model's session is broken ({error.cause})"
            if isinstance(error, SessionBrokenError)
            else "the scheduler failed"
        )
        log_event(
            log,
            logging.ERROR,
            "scheduler_failed",
            f"{failed}; stopping (the process must be restarted)",
            error=error.message,
        )
        if self.state is Lifecycle.SERVING:  # while STARTING, start() stops it at its end
            self._own_stop = asyncio.ensure_future(self.stop())

    def end_grace(self) -> None:
        """A drain in progress (or the next one) answers what is queued now instead of
        waiting out its grace (a second SIGTERM or Ctrl-C)."""
        self._grace_ended = True  # for a thread not made yet: asked before start() made it
        if self._thread is not None:
            self._thread.end_grace()
        if self._text is not None:
            self._text.cut()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
