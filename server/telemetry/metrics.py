"""`Metrics`: the `SchedulerEvents` sink that records OpenTelemetry instruments.

Metric names (OpenTelemetry; Prometheus adds the unit and `_total`, e.g.
`laneserve.queue.wait` is scraped as `laneserve_queue_wait_seconds_bucket`):

    laneserve.queue.wait          histogram s       lane           admission to dispatch
    laneserve.batch.size          histogram rows                   rows per batch run
    laneserve.infer.duration      histogram s       status         session time per batch
    laneserve.request.duration    histogram s       lane, status   arrival to answer
    laneserve.requests.admitted   counter           lane
    laneserve.requests.rejected   counter           lane, reason   refused at admission
    laneserve.requests.shed       counter           lane, reason   dropped after admission
    laneserve.requests.completed  counter           lane, status   every admitted request's end
    laneserve.requests.late       counter           lane           answered OK, run past deadline
    laneserve.batches             counter           reason, status dispatch reason, outcome
    laneserve.device.out_of_memory counter                         runs out of device memory
    laneserve.batch.splits        counter                          batches run in parts after OOM
    laneserve.batch.cap.changes   counter           reason         out_of_memory / recovered
    laneserve.lane.depth          gauge rows        lane           queued rows now
    laneserve.lane.capacity       gauge rows        lane
    laneserve.batch.cap           gauge rows                       largest batch formed now
    laneserve.device.memory.used  gauge By                         at the last reading
    laneserve.device.memory.budget gauge By                        what the watermarks are
                                                                   fractions of: the GPU's total
                                                                   memory, host_memory_limit on
                                                                   the CPU
    laneserve.device.memory.high_watermark gauge By                lanes close at or above it
    laneserve.device.memory.low_watermark gauge By                 closed lanes reopen below it
    laneserve.device.memory.limit gauge By                         the arena's cap (memory_limit)
    laneserve.lane.closed_by_memory gauge           lane           1 while the watermark closes it
    laneserve.build_info          gauge             version,       1
                                                    model, model_sha256,
                                                    providers
    laneserve.server.state        gauge             state          1 for the lifecycle state now
    laneserve.device.utilization.ratio gauge 1                     NVML; absent without a GPU
    laneserve.grpc.calls          counter           state          gRPC's own count (Channelz):
                                                                   started, succeeded, failed
    laneserve.requests.idempotent counter           how            answered by request_id, not
                                                                   admitted: join, replay
    laneserve.replay_cache.entries gauge answers                   stored for replay now
    laneserve.replay_cache.size   gauge By                         the bytes they take
    laneserve.shared_memory.regions gauge regions                  registered now
    laneserve.shared_memory.bytes counter By        direction      read out of regions (inputs),
                                                                   written into them (outputs)
    laneserve.http.requests       counter           route, code    KServe v2 HTTP requests
                                                                   answered, by path template
                                                                   and HTTP status
    laneserve.text_thread.work    counter           kind           work done off the loop:
                                                                   decode, encode, hash
    laneserve.text_thread.busy    counter s         kind           its seconds on that work
    laneserve.text_thread.pending gauge             -              work given it, not ended

The text thread (`text_thread.TextThread`) decodes requests and encodes answers of long
text off the event loop, and its hasher hashes large requests with ids: `rate(busy)`
summed over decode and encode near 1 says the text thread is saturated, `hash`'s near 1
the hasher (that work queues behind them: `pending` grows). Every kind is reported from
the start, at 0.

The reasons of `laneserve.requests.rejected` and `.shed` and the statuses of `.completed`
are stats.REJECTED_REASONS, SHED_REASONS and ANSWERED_STATUSES (one per error class's
reason): a new refusal's reason goes there, and is reported at 0 from the start.

`laneserve.requests.completed` is GetStats' `lanes[].answered` (every end, by status),
not its `lanes[].completed` (the OK ends alone). `laneserve.requests.idempotent` is
GetStats' `idempotent_joins` and `idempotent_replays`: a retry the ledger answers is not
admitted, so no other request counter sees it, unless the answer cannot reach its caller
(a join answered alone at its deadline, an answer over the caller's receive limit): that
one is refused too, in `laneserve.requests.rejected`.

`laneserve.grpc.calls` counts every call on the server's ports, the operator's too
(GetStats, GetModel, health checks, reflection, Channelz: `laneserve top` makes one a
second): Channelz counts per server, not per method, and a count of our own would take
an interceptor on every call of the request path. Calls that end before the servicer
sees them count there alone: those gRPC's core refused (max_pending_calls) as started
and never ended, those cancelled or expired in gRPC's queue as failed (as is every call
ended with a status other than OK).

The counters report every series known in advance from the start, at 0: each lane with
each refusal and shed reason and each end status, each dispatch reason with each batch
status, both cap moves (see `_Counter.known`); so do `laneserve.lane.closed_by_memory`
(each lane, 0 without a watermark: nothing closes it then) and `laneserve.server.state`
(each lifecycle state). The memory figures in bytes exist where their value does: used,
budget and the two watermarks where the watermark takes readings (always on a GPU, with
host_memory_limit on the CPU), the limit where memory_limit caps the arena.

The shared memory figures exist while server.shared_memory is on, from the start (both
directions at 0), and are absent, not 0, while it is off (a 0 would read as on and
unused). Their instruments are registered either way and observe nothing while it is
off (a collection drops an instrument that observed nothing: nothing is scraped): the
switch is the server's, handed over with the sources (`MetricSources.shared_memory`),
where the GPU utilisation gauge, registered only with a device, hangs on the device
`Telemetry` itself opens, before any server exists.

`laneserve.http.requests` exists while the server has an HTTP port (server.http_port),
each series from the first request it counts: every request answered there, by `route`
(the path's template, "/v2/models/{model}/infer", or "unmatched" for a path not served
or a method a path does not take) and `code` (the HTTP status sent; 499 where the caller
left first). Most inference answers are also counted by the lanes; what only it counts
are the HTTP wire's own refusals (`kserve_http.HttpRefusal`: 429 over
max_concurrent_rpcs, 404 for another model, 413 and 415 on the headers or as the body is
read, 408, a body that does not inflate 400, 417) and the paths not served.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import PurePath

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from laneserve.server.batch_caps import CAP_CHANGE_REASONS
from laneserve.server.config import LaneConfig
from laneserve.server.errors import LaneserveError
from laneserve.server.events import NullEvents
from laneserve.server.grpc_calls import GrpcCalls
from laneserve.server.idempotency import LedgerCounts
from laneserve.server.items import Batch, DispatchReason
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.memory import WatermarkState
from laneserve.server.model_identity import SERVER_VERSION
from laneserve.server.scheduler import LaneDepth
from laneserve.server.shared_memory import SharedMemoryCounts
from laneserve.server.stats import (
    ANSWERED_STATUSES,
    BATCH_STATUSES,
    REJECTED_REASONS,
    SHED_REASONS,
    Counts,
)
from laneserve.server.telemetry.device import DeviceMonitor
from laneserve.server.text_thread import TextThreadCounts

# Bucket boundaries. histogram_quantile() interpolates linearly inside the bucket the
# quantile falls in, so its error is bounded by the ratio of adjacent bounds: at 1-2-5 per
# decade (2-2.5x) the p99 read 1.4-1.7x GetStats' exact one, and with 0.5 ms first a small
# model's runs (43 us median, 236 of 266 in the first bucket) read a 0.28 ms median.
# Times: 20 us to the bulk lane's two-minute timeout, at 1-1.5-2-3-5-7 per decade
# (adjacent bounds at most 5/3 apart). The first bucket reads as if spread from 0: a
# small model's runs on the CPU took 30-45 us, mostly below a first bound of 50 us, and
# their median read 0.76x (one run of a reviewer's script). Not finer: every bucket is
# one series per lane and status (request duration: up to 3 lanes x 8 statuses x 43),
# and 1.25x steps would take ~70 buckets for little more.
SECONDS_BUCKETS: tuple[float, ...] = (
    0.00002, 0.00003, 0.00005, 0.00007,
    0.0001, 0.00015, 0.0002, 0.0003, 0.0005, 0.0007,
    0.001, 0.0015, 0.002, 0.003, 0.005, 0.007,
    0.01, 0.015, 0.02, 0.03, 0.05, 0.07,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.7,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.0,
    10.0, 15.0, 20.0, 30.0, 50.0, 70.0,
    100.0, 120.0,
)  # fmt: skip
# Sizes: 1 to 8 one by one, then four steps per power of two (8, 10, 12, 14, 16, 20, ...)
# up to 16384. Batch caps are usually powers of two, and at powers-of-two bounds alone
# full batches at a cap of 32 all fell in (16, 32]: their median read 18.5, not 32. Now a
# power of two is the top of a bucket 1.14x wide (28, 32]. One series (no attributes),
# so the 52 buckets cost little.
ROWS_BUCKETS: tuple[float, ...] = (
    *(float(rows) for rows in range(1, 8)),
    *(
        float(octave * step // 4)
        for octave in (1 << power for power in range(3, 14))
        for step in (4, 5, 6, 7)
    ),
    float(1 << 14),
)


@dataclasses.dataclass(frozen=True, slots=True)
class MetricSources:
    """What the gauges and counters read at collection time (a scrape); handed over once
    the scheduler thread exists (`Telemetry.observe`)."""

    depths: Callable[[], Sequence[LaneDepth]]
    batch_cap: Callable[[], int]
    # The probed cap, which out-of-memory lowers the cap from and full batches raise it
    # back to (GetStats' max_batch_cap); never changes.
    max_batch_cap: int
    counts: Callable[[], Counts]
    # gRPC's own call counts; None until the gRPC server runs, or when gRPC cannot say.
    grpc_calls: Callable[[], GrpcCalls | None]
    # The idempotency ledger's; None until the servicer exists.
    ledger: Callable[[], LedgerCounts | None]
    # The scheduler's watermark, as GetStats reads it; None: no limit to watch. Read once
    # a collection (it takes the scheduler's lock), for the lanes it closes.
    watermark: Callable[[], WatermarkState | None]
    # Its marks, which never change (GetStats' memory_high_watermark_bytes and
    # memory_low_watermark_bytes); None: no watermark.
    high_watermark_bytes: int | None
    low_watermark_bytes: int | None
    state: Callable[[], Lifecycle]
    model_path: str  # as GetModel names it
    model_sha256: str  # GetModel's, hex; "" when unknown
    # The arena's cap (memory_limit), GetStats' memory_limit_bytes; None: uncapped.
    memory_limit_bytes: int | None
    # The shared memory registry's counts (`SharedMemoryRegions.counts`); None: shared
    # memory is off (server.shared_memory), and its figures absent.
    shared_memory: Callable[[], SharedMemoryCounts] | None = None
    # The HTTP front end's answers by (route, status) (`HttpFrontEnd.answered`); None
    # from the callable: no HTTP port (server.http_port), and the counter absent.
    http_requests: Callable[[], Mapping[tuple[str, int], int] | None] | None = None
    # The answers gRPC could not send, their calls ended first, by method
    # (`UnsentAnswers.counts`); None: not observed (the counter absent).
    answers_unsent: Callable[[], Mapping[str, int]] | None = None
    # The text thread's counts (`TextThread.counts`); None: not observed (absent).
    text_thread: Callable[[], TextThreadCounts] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Counter:
    """An observable counter over the stats recorder's `Counts`."""

    name: str
    description: str
    keys: tuple[str, ...]  # the attribute names of its keys
    # Where in `Counts` its values are, keyed by attribute values.
    read: Callable[[Counts], Mapping[tuple[str, ...], int]]
    # The keys it reports from the start, 0 until their first event, given the lanes'
    # names: a series that appears only at its first event cannot be alerted on with
    # increase() or rate() (Prometheus has nothing to compare its first sample with),
    # so the first refusal, shed request or failed batch went unseen. Keys outside
    # these (none is expected) appear at their first event.
    known: Callable[[Sequence[str]], Iterable[tuple[str, ...]]] = lambda _lanes: ()


_DISPATCH_REASONS = tuple(reason.value for reason in DispatchReason)

_COUNTERS: tuple[_Counter, ...] = (
    _Counter(
        "laneserve.requests.admitted",
        "Requests admitted",
        ("lane",),
        lambda counts: {(lane,): count for lane, count in counts.admitted.items()},
        lambda lanes: ((lane,) for lane in lanes),
    ),
    _Counter(
        "laneserve.requests.rejected",
        "Requests refused at admission, by reason",
        ("lane", "reason"),
        lambda counts: counts.rejected,
        lambda lanes: itertools.product(lanes, REJECTED_REASONS),
    ),
    _Counter(
        "laneserve.requests.shed",
        "Admitted requests dropped without running, by reason",
        ("lane", "reason"),
        lambda counts: counts.shed,
        lambda lanes: itertools.product(lanes, sorted(SHED_REASONS)),
    ),
    _Counter(
        "laneserve.requests.completed",
        "Admitted requests ended, by status (OK or the error's reason)",
        ("lane", "status"),
        lambda counts: counts.answered,
        lambda lanes: itertools.product(lanes, ANSWERED_STATUSES),
    ),
    _Counter(
        "laneserve.requests.late",
        "Admitted requests answered OK from a run that ended past their deadline (their "
        "timeout_ms or their lane's timeout): admission predicted them in time, or made no "
        "prediction (an idle server, a shape not yet run)",
        ("lane",),
        lambda counts: {(lane,): count for lane, count in counts.late.items()},
        lambda lanes: ((lane,) for lane in lanes),
    ),
    _Counter(
        "laneserve.batches",
        "Batches run, by dispatch reason and status",
        ("reason", "status"),
        lambda counts: counts.batches,
        lambda _lanes: itertools.product(_DISPATCH_REASONS, BATCH_STATUSES),
    ),
    _Counter(
        "laneserve.device.out_of_memory",
        "Runs that failed for lack of device memory",
        (),
        lambda counts: {(): counts.out_of_memory},
    ),
    _Counter(
        "laneserve.batch.splits",
        "Batches run in parts after running out of memory (once per batch)",
        (),
        lambda counts: {(): counts.batch_splits},
    ),
    _Counter(
        "laneserve.batch.cap.changes",
        "Batch cap moves: out_of_memory (lowered), recovered (raised)",
        ("reason",),
        lambda counts: {(reason,): count for reason, count in counts.cap_changes.items()},
        lambda _lanes: itertools.product(CAP_CHANGE_REASONS),
    ),
)


class Metrics(NullEvents):
    """A `SchedulerEvents` sink that records OpenTelemetry instruments (the events it
    does not override it has no use for: NullEvents ignores them).

    The SDK spends 10-20 us on each synchronous measurement, so only the histograms are
    recorded as events happen (two per request, two per batch). The counters are the
    stats recorder's (the ones GetStats reports, so the two never disagree), read
    through observable counters when a reader collects (a Prometheus scrape), as the
    gauges are: nothing between scrapes.
    """

    def __init__(
        self,
        meter: Meter,
        lanes: Sequence[LaneConfig],
        device: DeviceMonitor | None = None,
        providers: Sequence[str] = (),
    ) -> None:
        """`providers`: the session's, for laneserve.build_info."""
        self._sources: MetricSources | None = None
        self._lane_names = [lane.name for lane in lanes]
        self._capacities = [(lane.name, lane.capacity_rows) for lane in lanes]
        self._providers = ",".join(providers)
        self._device = device
        self._memory: tuple[int, int | None] | None = None  # (used, budget) bytes
        self._lane_attributes: dict[str, dict[str, str]] = {}
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
            description="Session time of one batch, under OK while rows of it ran, else its "
            "error's reason; a batch run in parts after out of memory is one sample, the time "
            "of all its runs, those that failed included",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self._request = meter.create_histogram(
            "laneserve.request.duration",
            unit="s",
            description="Arrival in the server to answer, per lane and final status",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        for counter in _COUNTERS:
            meter.create_observable_counter(
                counter.name,
                callbacks=[self._counter_callback(counter, self._lane_names)],
                unit="{event}",
                description=counter.description,
            )
        meter.create_observable_counter(
            "laneserve.grpc.calls",
            callbacks=[self._observe_grpc_calls],
            unit="{call}",
            description="gRPC's own count of this server's calls (Channelz), by state: "
            "started, succeeded, failed; every call on its ports, GetStats, GetModel and "
            "health checks too",
        )
        meter.create_observable_counter(
            "laneserve.requests.idempotent",
            callbacks=[self._observe_idempotent],
            unit="{request}",
            description="Requests answered by request_id without being admitted, by how: "
            "join (one with its id was in flight), replay (its answer was stored)",
        )
        meter.create_observable_gauge(
            "laneserve.replay_cache.entries",
            callbacks=[self._observe_replay_entries],
            unit="{answer}",
            description="Answers stored for replay to a retry with the same request_id",
        )
        meter.create_observable_gauge(
            "laneserve.replay_cache.size",
            callbacks=[self._observe_replay_bytes],
            unit="By",
            description="Bytes the stored answers take (what idempotency_max_bytes bounds)",
        )
        meter.create_observable_gauge(
            "laneserve.shared_memory.regions",
            callbacks=[self._observe_shared_memory_regions],
            unit="{region}",
            description="Triton system shared memory regions registered now; absent while "
            "shared memory is off (server.shared_memory)",
        )
        meter.create_observable_counter(
            "laneserve.shared_memory.bytes",
            callbacks=[self._observe_shared_memory_bytes],
            unit="By",
            description="Tensor bytes moved through Triton system shared memory, by "
            "direction: read (inputs, out of regions), written (outputs, into regions); "
            "absent while shared memory is off (server.shared_memory)",
        )
        meter.create_observable_counter(
            "laneserve.http.requests",
            callbacks=[self._observe_http_requests],
            unit="{request}",
            description="KServe v2 HTTP requests answered, by route (the path's template, "
            "or unmatched) and code (the HTTP status; 499: the caller left first); absent "
            "without an HTTP port (server.http_port)",
        )
        meter.create_observable_counter(
            "laneserve.text_thread.work",
            callbacks=[self._observe_text_work],
            unit="{work}",
            description="Work done off the event loop, by kind: decode (a request's long text) "
            "and encode (a batch's text answers) on the text thread, hash (a request of more "
            "than 1 MiB of numbers with an id) on the hasher",
        )
        meter.create_observable_counter(
            "laneserve.text_thread.busy",
            callbacks=[self._observe_text_busy],
            unit="s",
            description="Seconds of work off the event loop, by kind; the rate of decode and "
            "encode summed near 1: the text thread is saturated, of hash: the hasher; and "
            "that work queues behind it",
        )
        meter.create_observable_gauge(
            "laneserve.text_thread.pending",
            callbacks=[self._observe_text_pending],
            unit="{work}",
            description="Work given the text thread or the hasher and not ended (queued or "
            "running)",
        )
        meter.create_observable_counter(
            "laneserve.answers.unsent",
            callbacks=[self._observe_answers_unsent],
            unit="{answer}",
            description="Answers gRPC could not send because their calls had ended first (a "
            "deadline passed, or the caller left, while the answer waited for the event "
            "loop), by method; an OK one is counted OK in laneserve_requests_completed_total "
            "though its caller never received it",
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
            description="Largest batch the scheduler forms now (the lowest cap of any input shape)",
        )
        meter.create_observable_gauge(
            "laneserve.batch.cap.max",
            callbacks=[self._fixed_gauge(lambda sources: sources.max_batch_cap)],
            unit="{row}",
            description="The probed batch cap: out of memory lowers the cap below it, full "
            "batches raise it back (a cap below it: batches of that size did not fit)",
        )
        meter.create_observable_gauge(
            "laneserve.device.memory.used",
            callbacks=[self._observe_memory_used],
            unit="By",
            description="Memory in use at the last reading: the GPU's (NVML), or on the CPU "
            "this process's resident memory",
        )
        meter.create_observable_gauge(
            "laneserve.device.memory.budget",
            callbacks=[self._observe_memory_budget],
            unit="By",
            description="What the watermark fractions (memory_high_watermark, "
            "memory_low_watermark) are of, and memory in use is measured against: the GPU's "
            "total memory, host_memory_limit on the CPU; not the arena's cap "
            "(laneserve_device_memory_limit_bytes)",
        )
        meter.create_observable_gauge(
            "laneserve.device.memory.high_watermark",
            callbacks=[self._fixed_gauge(lambda sources: sources.high_watermark_bytes)],
            unit="By",
            description="Memory in use at or above which the watermark closes lanes, lowest "
            "priority first (memory_high_watermark of the budget)",
        )
        meter.create_observable_gauge(
            "laneserve.device.memory.low_watermark",
            callbacks=[self._fixed_gauge(lambda sources: sources.low_watermark_bytes)],
            unit="By",
            description="Memory in use below which lanes closed by the watermark reopen "
            "(memory_low_watermark of the budget)",
        )
        meter.create_observable_gauge(
            "laneserve.device.memory.limit",
            callbacks=[self._fixed_gauge(lambda sources: sources.memory_limit_bytes)],
            unit="By",
            description="The cap on the session's memory arena (memory_limit, GetStats' "
            "memory_limit_bytes); absent when uncapped",
        )
        meter.create_observable_gauge(
            "laneserve.lane.closed_by_memory",
            callbacks=[self._observe_closed_by_memory],
            description="1 while the memory watermark closes the lane (it refuses new "
            "requests with MEMORY_PRESSURE), else 0",
        )
        meter.create_observable_gauge(
            "laneserve.build_info",
            callbacks=[self._observe_build_info],
            description="1, with the package version, the model file's name and the first "
            "12 hex digits of its SHA-256 (GetModel's model_sha256; empty when unknown), and "
            "the session's execution providers (a CUDA session the runtime built on the "
            "CPU says CPUExecutionProvider)",
        )
        meter.create_observable_gauge(
            "laneserve.server.state",
            callbacks=[self._observe_state],
            description="1 for the server's lifecycle state now, 0 for the others",
        )
        if device is not None:
            # Registered only with a GPU in use: absent, not zero, without one.
            meter.create_observable_gauge(
                # ".ratio" in the name: the Prometheus exporter gives unit "1" no suffix,
                # and Prometheus names a [0, 1] gauge *_ratio.
                "laneserve.device.utilization.ratio",
                callbacks=[self._observe_utilization],
                unit="1",
                description="GPU utilisation over NVML's last sample period, in [0, 1]",
            )

    def observe(self, sources: MetricSources) -> None:
        self._sources = sources

    def _observe_grpc_calls(self, options: CallbackOptions) -> Iterable[Observation]:
        calls = None if self._sources is None else self._sources.grpc_calls()
        if calls is None:
            return []
        return [
            Observation(calls.started, {"state": "started"}),
            Observation(calls.succeeded, {"state": "succeeded"}),
            Observation(calls.failed, {"state": "failed"}),
        ]

    def _ledger(self) -> LedgerCounts | None:
        return None if self._sources is None else self._sources.ledger()

    def _observe_idempotent(self, options: CallbackOptions) -> Iterable[Observation]:
        # Both series from the servicer's start, at 0 (see `_Counter.known`).
        ledger = self._ledger()
        if ledger is None:
            return []
        return [
            Observation(ledger.idempotent_joins, {"how": "join"}),
            Observation(ledger.idempotent_replays, {"how": "replay"}),
        ]

    def _observe_replay_entries(self, options: CallbackOptions) -> Iterable[Observation]:
        ledger = self._ledger()
        return [] if ledger is None else [Observation(ledger.replay_cache_entries)]

    def _observe_replay_bytes(self, options: CallbackOptions) -> Iterable[Observation]:
        ledger = self._ledger()
        return [] if ledger is None else [Observation(ledger.replay_cache_bytes)]

    def _shared_memory(self) -> SharedMemoryCounts | None:
        counts = None if self._sources is None else self._sources.shared_memory
        return None if counts is None else counts()

    def _observe_shared_memory_regions(self, options: CallbackOptions) -> Iterable[Observation]:
        counts = self._shared_memory()
        return [] if counts is None else [Observation(counts.regions)]

    def _observe_shared_memory_bytes(self, options: CallbackOptions) -> Iterable[Observation]:
        # Both series from the start, at 0 (see `_Counter.known`).
        counts = self._shared_memory()
        if counts is None:
            return []
        return [
            Observation(counts.read_bytes, {"direction": "read"}),
            Observation(counts.written_bytes, {"direction": "written"}),
        ]

    def _observe_http_requests(self, options: CallbackOptions) -> Iterable[Observation]:
        source = None if self._sources is None else self._sources.http_requests
        answered = None if source is None else source()
        if answered is None:
            return []
        return [
            Observation(count, {"route": route, "code": str(code)})
            for (route, code), count in answered.items()
        ]

    def _observe_answers_unsent(self, options: CallbackOptions) -> Iterable[Observation]:
        source = None if self._sources is None else self._sources.answers_unsent
        if source is None:
            return []
        return [Observation(count, {"method": method}) for method, count in source().items()]

    def _text_thread(self) -> TextThreadCounts | None:
        counts = None if self._sources is None else self._sources.text_thread
        return None if counts is None else counts()

    def _observe_text_work(self, options: CallbackOptions) -> Iterable[Observation]:
        counts = self._text_thread()
        if counts is None:
            return []
        return [Observation(done, {"kind": kind}) for kind, done in counts.done.items()]

    def _observe_text_busy(self, options: CallbackOptions) -> Iterable[Observation]:
        counts = self._text_thread()
        if counts is None:
            return []
        return [Observation(busy_s, {"kind": kind}) for kind, busy_s in counts.busy_s.items()]

    def _observe_text_pending(self, options: CallbackOptions) -> Iterable[Observation]:
        counts = self._text_thread()
        return [] if counts is None else [Observation(counts.pending)]

    def _lane(self, lane: str) -> dict[str, str]:
        attributes = self._lane_attributes.get(lane)
        if attributes is None:
            attributes = self._lane_attributes.setdefault(lane, {"lane": lane})
        return attributes

    def _counter_callback(
        self, counter: _Counter, lane_names: Sequence[str]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        zeros = dict.fromkeys(counter.known(lane_names), 0)

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            if self._sources is None:
                return []
            values = {**zeros, **counter.read(self._sources.counts())}
            return [
                Observation(count, dict(zip(counter.keys, key, strict=True)))
                for key, count in values.items()
            ]

        return observe

    # SchedulerEvents (the counted ones are the stats recorder's: see `_COUNTERS`)
    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float | None]) -> None:
        for piece, wait_s in zip(batch.slices, queue_waits_s, strict=True):
            if wait_s is not None:
                self._queue_wait.record(wait_s, self._lane(piece.lane))

    def batch_done(
        self,
        batch: Batch,
        run_s: float,
        error: LaneserveError | None,
        failed_rows: int = 0,
        *,
        split: bool = False,
    ) -> None:
        status = "OK" if error is None else error.reason
        self._batch_size.record(batch.rows)
        # A sample per batch, as laneserve_batches_total counts them: the runs of a batch
        # split after out of memory are timed together (`BatchResult.run_s`), and those
        # that failed are counted apart (laneserve_device_out_of_memory_total).
        self._infer.record(run_s, {"status": status})

    def request_finished(
        self, lane: str, status: str, duration_s: float, *, late: bool = False
    ) -> None:
        self._request.record(duration_s, {"lane": lane, "status": status})

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
        return [Observation(rows, self._lane(name)) for name, rows in self._capacities]

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

    def _fixed_gauge(
        self, read: Callable[[MetricSources], int | None]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """A gauge of a value the sources hold from the start (None: absent)."""

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            value = None if self._sources is None else read(self._sources)
            return [] if value is None else [Observation(value)]

        return observe

    def _observe_closed_by_memory(self, options: CallbackOptions) -> Iterable[Observation]:
        # Every lane, 0 without a watermark: an alert on it needs no other series.
        if self._sources is None:
            return []
        state = self._sources.watermark()
        closed = () if state is None else state.closed_lanes
        return [Observation(int(name in closed), self._lane(name)) for name in self._lane_names]

    def _observe_build_info(self, options: CallbackOptions) -> Iterable[Observation]:
        if self._sources is None:
            return []
        # The file's name, not the path as typed: the same label whether the model was
        # named ./m.onnx or by its absolute path; its hash says when the file changed.
        info = {
            "version": SERVER_VERSION,
            "model": PurePath(self._sources.model_path).name,
            "model_sha256": self._sources.model_sha256[:12],
            "providers": self._providers,
        }
        return [Observation(1, info)]

    def _observe_state(self, options: CallbackOptions) -> Iterable[Observation]:
        if self._sources is None:
            return []
        now = self._sources.state()
        return [Observation(int(state is now), {"state": state.value}) for state in Lifecycle]
