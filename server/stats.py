"""Counters and recent-latency windows behind GetStats.

Written by the scheduler's owner (under its lock), read by the event loop: a lock of its
own keeps each reading consistent. Percentiles are over a window of recent samples, the
view an operator wants of "now"; Prometheus histograms keep the long view. The window is
the samples of the last WINDOW_S seconds, at most the newest WINDOW_SAMPLES of them: by
count alone, a burst's p99 was still reported after 20 s idle, and after 300 fast calls
that followed it. A summary's `count` is the number of samples in its window when read
(0 after WINDOW_S without any), not a running total: the counters are those.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from laneserve.server.clock import Clock, SystemClock
from laneserve.server.errors import (
    AnswerTooLargeError,
    DeadlineUnmeetableError,
    DeviceMemoryError,
    DrainingError,
    EngineError,
    ExpiredInQueueError,
    InvalidInputError,
    JoinExpiredError,
    JoinLimitError,
    LaneFullError,
    LaneserveError,
    MemoryPressureError,
    RegionNotFoundError,
    RequestIdReusedError,
    SharedMemoryRefusedError,
)
from laneserve.server.items import Batch, Signature

WINDOW_SAMPLES = 4096
WINDOW_S = 60.0


def _reasons(*errors: type[LaneserveError]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(error.reason for error in errors))


# The reasons and statuses the counters are kept by, as far as they are known in advance
# (the Prometheus counters report each from the start: see telemetry/metrics.py).
# Refused before admission, by the servicer's checks or the scheduler's. JoinExpiredError:
# a retry whose deadline passed while it waited for the request with its id in flight.
# EngineError: a submission after the scheduler failed for good (the server then stops;
# after a broken session such submissions are refused DRAINING instead).
# AnswerTooLargeError: a retry that joined or replayed an answer larger than its caller
# reads (the call that ran it counts it among `answered`). CANCELLED: a stream item whose
# stream ended while it waited for room in its full lane (read, never admitted).
# RegionNotFoundError, SharedMemoryRefusedError: a KServe request placing a tensor in a
# shared memory region not registered, or while it may not (refused as it is converted).
REJECTED_REASONS = (
    *_reasons(
        AnswerTooLargeError,
        InvalidInputError,
        RequestIdReusedError,
        DrainingError,
        DeadlineUnmeetableError,
        JoinExpiredError,
        MemoryPressureError,
        JoinLimitError,
        LaneFullError,
        EngineError,
        RegionNotFoundError,
        SharedMemoryRefusedError,
    ),
    "CANCELLED",
)
# Reasons counted as shed (dropped after admission), not as failures.
SHED_REASONS = frozenset({ExpiredInQueueError.reason, "CANCELLED"})
# How an admitted request ends (`answered`): OK, the error it was answered with,
# CANCELLED (its caller left) or DEADLINE_EXCEEDED (its gRPC deadline passed while it
# ran: gRPC answered the caller; see `Scheduler.cancel`). DRAINING: the server stopped
# before it could run.
ANSWERED_STATUSES = (
    "OK",
    *_reasons(
        ExpiredInQueueError, EngineError, DeviceMemoryError, AnswerTooLargeError, DrainingError
    ),
    "CANCELLED",
    "DEADLINE_EXCEEDED",
)
# How a batch run ends: OK, or the error of a batch none of whose rows ran (DRAINING: the
# server stopped it unfinished).
BATCH_STATUSES = (
    "OK",
    *_reasons(EngineError, DeviceMemoryError, ExpiredInQueueError, DrainingError),
)


@dataclasses.dataclass(frozen=True, slots=True)
class Percentiles:
    count: int
    p50_ms: float
    p95_ms: float
    p99_ms: float


def percentiles_ms(samples_s: Iterable[float]) -> Percentiles:
    values = np.fromiter(samples_s, dtype=np.float64)
    if values.size == 0:
        return Percentiles(0, 0.0, 0.0, 0.0)
    p50, p95, p99 = np.percentile(values, [50, 95, 99]) * 1000
    return Percentiles(int(values.size), float(p50), float(p95), float(p99))


@dataclasses.dataclass(frozen=True, slots=True)
class Distribution:
    """A summary of recent values that are not times (batch sizes, in rows)."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float


def distribution(samples: Iterable[float]) -> Distribution:
    values = np.fromiter(samples, dtype=np.float64)
    if values.size == 0:
        return Distribution(0, 0.0, 0.0, 0.0, 0.0)
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return Distribution(int(values.size), float(values.mean()), float(p50), float(p95), float(p99))


class _Window:
    """Samples of the last WINDOW_S seconds, at most the newest WINDOW_SAMPLES. Guarded
    by the recorder's lock. Adding is O(1) (the scheduler's threads add while holding
    their own lock); reading changes nothing: samples older than WINDOW_S stay until
    newer ones push them out. A read that dropped them popped up to WINDOW_SAMPLES per
    window under the lock (~2 ms for GetStats' eight after a quiet minute, the
    scheduler's threads waiting) and copied the times with the values."""

    __slots__ = ("_at_s", "_values")

    def __init__(self) -> None:
        # Parallel: `_at_s[i]` is when `_values[i]` was added, read under the recorder's
        # lock, so the times never go down and the oldest are on the left. Same maxlen,
        # so they drop their oldest together.
        self._at_s: collections.deque[float] = collections.deque(maxlen=WINDOW_SAMPLES)
        self._values: collections.deque[float] = collections.deque(maxlen=WINDOW_SAMPLES)

    def add(self, now_s: float, value: float) -> None:
        self._at_s.append(now_s)
        self._values.append(value)

    def recent(self, now_s: float) -> list[float]:
        """The samples added within WINDOW_S before `now_s`, oldest first, as a copy.
        The cut is a binary search of the (sorted) times, each probe a walk of at most
        WINDOW_SAMPLES / 128 of a deque's 64-item blocks; the copy is the values after it,
        without the times: O(WINDOW_SAMPLES) at most, all in C (~20 us a full window,
        measured once).
        The deques stay, not numpy rings (reads of ~5 us): `add` is the hot path, and
        a ring's element stores took twice a deque's append."""
        cut = bisect.bisect_left(self._at_s, now_s - WINDOW_S)
        return list(itertools.islice(self._values, cut, None))


@dataclasses.dataclass(slots=True)
class _LaneCounters:
    admitted: int = 0
    completed: int = 0  # answered OK (the Prometheus counter "completed" is `answered`)
    failed: int = 0  # answered neither OK nor a SHED_REASONS status
    rejected: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    shed: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Terminal state of every admitted request: "OK", an error reason, "CANCELLED" or
    # "DEADLINE_EXCEEDED" (see ANSWERED_STATUSES).
    # Invariant once idle: admitted == sum(answered.values()).
    answered: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    late: int = 0  # of those answered OK, the ones answered after their deadline
    queue_wait_s: _Window = dataclasses.field(default_factory=_Window)
    # Arrival to answer of the requests answered OK (see `request_finished`).
    request_s: _Window = dataclasses.field(default_factory=_Window)

    def read(self, name: str, now_s: float) -> _LaneReading:
        """Its counters, and its windows as they stand at `now_s`, in containers the
        recorder will not change (taken under its lock)."""
        return _LaneReading(
            name,
            self.admitted,
            self.completed,
            self.failed,
            dict(self.rejected),
            dict(self.shed),
            dict(self.answered),
            self.late,
            self.queue_wait_s.recent(now_s),
            self.request_s.recent(now_s),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _LaneReading:
    """A lane's `_LaneCounters` as read under the recorder's lock; its percentiles are
    worked out after it."""

    name: str
    admitted: int
    completed: int
    failed: int
    rejected: dict[str, int]
    shed: dict[str, int]
    answered: dict[str, int]
    late: int
    queue_wait_s: list[float]
    request_s: list[float]

    def snapshot(self) -> LaneSnapshot:
        return LaneSnapshot(
            name=self.name,
            admitted=self.admitted,
            completed=self.completed,
            failed=self.failed,
            rejected=self.rejected,
            shed=self.shed,
            answered=self.answered,
            late=self.late,
            queue_wait=percentiles_ms(self.queue_wait_s),
            request_duration=percentiles_ms(self.request_s),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class LaneSnapshot:
    name: str
    admitted: int
    completed: int
    failed: int
    rejected: dict[str, int]
    shed: dict[str, int]
    answered: dict[str, int]
    late: int  # answered OK after their deadline (`SchedulerEvents.request_finished`)
    queue_wait: Percentiles
    request_duration: Percentiles


@dataclasses.dataclass(frozen=True, slots=True)
class StatsSnapshot:
    lanes: list[LaneSnapshot]
    batches: int
    rows_run: int
    mean_batch_size: float
    run_time: Percentiles
    batch_reasons: dict[str, int]
    out_of_memory: int
    batch_splits: int
    cap_changes: dict[str, int]
    memory_used_bytes: int | None
    batch_size: Distribution
    failed_batches: int


@dataclasses.dataclass(frozen=True, slots=True)
class Counts:
    """The recorder's counters alone, without the latency windows: cheap to take, and
    the one source of both GetStats' counts and the Prometheus counters."""

    admitted: dict[str, int]  # lane ->
    rejected: dict[tuple[str, ...], int]  # (lane, reason) ->
    shed: dict[tuple[str, ...], int]  # (lane, reason) ->
    answered: dict[tuple[str, ...], int]  # (lane, status: "OK" or the error's reason) ->
    late: dict[str, int]  # lane -> answered OK after their deadline
    batches: dict[tuple[str, ...], int]  # (dispatch reason, status) -> batches run
    out_of_memory: int
    batch_splits: int
    cap_changes: dict[str, int]  # reason ->


@dataclasses.dataclass(slots=True)
class _Duration:
    """A count and the sum of the durations counted. Guarded by the recorder's lock."""

    count: int = 0
    ns: int = 0

    def frozen(self) -> Duration:
        """Its reading now (`Cumulative`)."""
        return Duration(self.count, self.ns)


@dataclasses.dataclass(slots=True)
class _Forming:
    """A batch formed and not yet done (`StatsRecorder.batch_formed`): its requests
    whose first batch it is, and the sum of their waits in their lanes. Guarded by the
    recorder's lock."""

    first_batches: int
    waited_ns: int


@dataclasses.dataclass(slots=True)
class _BatchDurations:
    """The batches run of one size, and their times (`Cumulative.batch_sizes`). Guarded
    by the recorder's lock."""

    count: int = 0
    input_ns: int = 0
    infer_ns: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Duration:
    count: int
    ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class BatchSizeTotals:
    """The batches of `rows` rows that ran (error None), and their times in nanoseconds."""

    rows: int
    count: int
    input_ns: int
    infer_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Cumulative:
    """Totals since the server started, in the meanings of Triton's statistics extension
    (ModelStatistics, `kserve_config.model_statistics`): they only grow, and one reading
    is taken under the recorder's lock, so a reader subtracts one from a later one (as
    perf_analyzer does around each measurement window). Kept as integer adds on the
    request path; nothing is allocated per request."""

    # Admitted requests answered OK, from arrival to answer (`request_finished`).
    success: Duration
    # Every other end of a request, from its arrival to its end: admitted ones answered
    # with an error or whose caller left, and every refusal before admission (`rejected`),
    # with what it waited (a retry that waited for the request with its id in flight until
    # its deadline, JoinExpiredError, answered EXPIRED_IN_QUEUE; a stream item refused
    # after waiting for room in its full lane; about nothing for one refused as it arrived).
    fail: Duration
    # Per request run, once (at its first batch): its wait in its lane, from admission
    # until its first batch was formed (Timing.queue_us).
    queue: Duration
    # Per request run, its count with queue's and, per batch that carried its rows, that
    # batch's time counted for it as for every request in the batch (Triton's: each
    # request of a batch reports the batch's times). `compute_infer`: the session's run
    # (its inputs' and outputs' copies to and from the device included: ONNX Runtime's
    # run does them), Timing.infer_us; for a batch retried in parts after a failed run,
    # every run of it, the failed one included. `compute_input`: the rest of the batch's
    # time from formed to completed (concatenating its inputs, the hand-offs to and from
    # the engine thread, slicing each request's rows out of the outputs). Encoding an
    # answer happens after, on the event loop: in `success`, outside the compute times,
    # as Triton's front end's own work is.
    compute_input: Duration
    compute_infer: Duration
    # The rows of the batches that ran (error None), less those that failed or were not
    # run again in them (`failed_rows`, a split batch's). A row counts once it ran,
    # whatever came of its request after: its caller may have left, or another batch of
    # it failed, before it was answered (Triton's inference_count counts the rows of
    # requests answered OK).
    rows_run: int
    # Batches that ran whole in one execution, and per size in rows, smallest first
    # (Triton's: each execution is one of its size's). A batch retried in parts after a
    # failed run (`batch_done`'s `split`: out of memory, or any other failure) is in
    # neither: its parts were executions of other sizes, its run_s the failed run's and
    # all of theirs, and the recorder is not told their sizes.
    executions: int
    batch_sizes: tuple[BatchSizeTotals, ...]
    # Seconds on the recorder's clock from the last request answered OK to this reading;
    # None before the first.
    last_success_ago_s: float | None


class StatsRecorder:
    """A `SchedulerEvents` sink that keeps what GetStats reports (and what the Prometheus
    counters read, through `counts`)."""

    def __init__(self, lane_names: Sequence[str], clock: Clock | None = None) -> None:
        # Times each sample as it is recorded, and the window's end as it is read (under
        # the lock, so that samples are added in the order of their times).
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._lanes = {name: _LaneCounters() for name in lane_names}
        self._batch_rows = 0  # rows of every batch run, failed ones too
        self._rows_run = 0  # rows of batches that ran, less those that failed (`Cumulative`)
        self._run_s = _Window()
        # Batches run by (dispatch reason, status): OK or the error's reason. The number of
        # batches run, those that failed, and those of each reason are sums over it.
        self._batch_outcomes: collections.Counter[tuple[str, ...]] = collections.Counter()
        self._out_of_memory = 0
        self._batch_splits = 0
        self._cap_changes: collections.Counter[str] = collections.Counter()
        self._memory_used_bytes: int | None = None
        self._batch_sizes = _Window()
        # The totals `cumulative` reads (see `Cumulative` for what each counts).
        self._success = _Duration()
        self._fail = _Duration()
        self._queue = _Duration()
        self._compute_input = _Duration()
        self._compute_infer = _Duration()
        self._executions = 0
        self._by_batch_size: dict[int, _BatchDurations] = {}
        self._last_success_s: float | None = None
        # Per batch formed and not yet done, by batch_id: its requests' first batches and
        # their waits in nanoseconds, counted once the batch has run (a batch that fails
        # whole ran no request). One entry per batch running; a stop may leave one.
        self._forming: dict[int, _Forming] = {}

    def admitted(self, lane: str, rows: int) -> None:
        with self._lock:
            self._lanes[lane].admitted += 1

    def rejected(
        self,
        lane: str,
        reason: str,
        waited_s: float,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        with self._lock:
            self._lanes[lane].rejected[reason] += 1
            self._fail.count += 1
            self._fail.ns += round(waited_s * 1e9)

    def shed(self, lane: str, reason: str, rows: int) -> None:
        with self._lock:
            self._lanes[lane].shed[reason] += 1

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float | None]) -> None:
        with self._lock:
            now_s = self._clock.monotonic()
            forming = _Forming(first_batches=0, waited_ns=0)
            for piece, wait_s in zip(batch.slices, queue_waits_s, strict=True):
                if wait_s is not None:
                    self._lanes[piece.lane].queue_wait_s.add(now_s, wait_s)
                    forming.first_batches += 1
                    forming.waited_ns += round(wait_s * 1e9)
            self._forming[batch.batch_id] = forming

    def batch_done(
        self,
        batch: Batch,
        run_s: float,
        error: LaneserveError | None,
        failed_rows: int = 0,
        *,
        split: bool = False,
    ) -> None:
        with self._lock:
            now_s = self._clock.monotonic()
            status = "OK" if error is None else error.reason
            self._batch_outcomes[batch.reason.value, status] += 1
            self._batch_rows += batch.rows
            self._batch_sizes.add(now_s, batch.rows)
            forming = self._forming.pop(batch.batch_id, _Forming(first_batches=0, waited_ns=0))
            if error is None:
                self._rows_run += batch.rows - failed_rows
                self._run_s.add(now_s, run_s)
                self._batch_ran(batch, run_s, now_s, forming, split=split)

    def _batch_ran(
        self,
        batch: Batch,
        run_s: float,
        now_s: float,
        forming: _Forming,
        *,
        split: bool,
    ) -> None:
        """Adds a batch that ran to the totals (`Cumulative`); under the lock. Its slices
        whose rows failed after a split (rare: a row that fails alone) are counted with
        the others: `batch_done` does not say which they were. `split`: it ran in parts
        after a failed run, no execution of its size."""
        infer_ns = round(run_s * 1e9)
        # formed_s is on this clock (the scheduler's); run_s on the engine's timer.
        input_ns = max(round((now_s - batch.formed_s - run_s) * 1e9), 0)
        requests = len(batch.slices)
        self._queue.count += forming.first_batches
        self._queue.ns += forming.waited_ns
        self._compute_input.count += forming.first_batches
        self._compute_input.ns += input_ns * requests
        self._compute_infer.count += forming.first_batches
        self._compute_infer.ns += infer_ns * requests
        if split:
            return
        self._executions += 1
        size = self._by_batch_size.get(batch.rows)
        if size is None:
            size = self._by_batch_size[batch.rows] = _BatchDurations()
        size.count += 1
        size.input_ns += input_ns
        size.infer_ns += infer_ns

    def completed(
        self,
        lane: str,
        status: str,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        pass  # counted as the caller was answered: see `request_finished`

    def out_of_memory(self, rows: int) -> None:
        with self._lock:
            self._out_of_memory += 1

    def batch_split(self, batch_id: int, rows: int, out_of_memory_runs: int) -> None:
        with self._lock:
            self._batch_splits += 1

    def cap_changed(self, old_rows: int, new_rows: int, reason: str, signature: Signature) -> None:
        with self._lock:
            self._cap_changes[reason] += 1

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        with self._lock:
            self._memory_used_bytes = used_bytes

    def request_finished(
        self, lane: str, status: str, duration_s: float, *, late: bool = False
    ) -> None:
        """Counts each admitted request's end as its caller saw it: the scheduler's
        outcome, unless answering failed after it (an answer over max_message_bytes)."""
        with self._lock:
            now_s = self._clock.monotonic()
            counters = self._lanes[lane]
            counters.answered[status] += 1
            counters.late += late
            ended = self._success if status == "OK" else self._fail
            ended.count += 1
            ended.ns += round(duration_s * 1e9)
            if status == "OK":
                counters.completed += 1
                counters.request_s.add(now_s, duration_s)
                self._last_success_s = now_s
            elif status not in SHED_REASONS:
                counters.failed += 1

    def cumulative(self) -> Cumulative:
        """The totals since start (`Cumulative`), read at once under the lock."""
        with self._lock:
            now_s = self._clock.monotonic()
            return Cumulative(
                success=self._success.frozen(),
                fail=self._fail.frozen(),
                queue=self._queue.frozen(),
                compute_input=self._compute_input.frozen(),
                compute_infer=self._compute_infer.frozen(),
                rows_run=self._rows_run,
                executions=self._executions,
                batch_sizes=tuple(
                    BatchSizeTotals(rows, size.count, size.input_ns, size.infer_ns)
                    for rows, size in sorted(self._by_batch_size.items())
                ),
                last_success_ago_s=(
                    None if self._last_success_s is None else now_s - self._last_success_s
                ),
            )

    def counts(self) -> Counts:
        with self._lock:
            return Counts(
                admitted={name: lane.admitted for name, lane in self._lanes.items()},
                rejected={
                    (name, reason): count
                    for name, lane in self._lanes.items()
                    for reason, count in lane.rejected.items()
                },
                shed={
                    (name, reason): count
                    for name, lane in self._lanes.items()
                    for reason, count in lane.shed.items()
                },
                answered={
                    (name, status): count
                    for name, lane in self._lanes.items()
                    for status, count in lane.answered.items()
                },
                late={name: lane.late for name, lane in self._lanes.items()},
                batches=dict(self._batch_outcomes),
                out_of_memory=self._out_of_memory,
                batch_splits=self._batch_splits,
                cap_changes=dict(self._cap_changes),
            )

    def snapshot(self) -> StatsSnapshot:
        # Copy under the lock (microseconds), compute percentiles after it (milliseconds):
        # the scheduler's threads record into this lock while holding theirs.
        with self._lock:
            now_s = self._clock.monotonic()
            lanes = [counters.read(name, now_s) for name, counters in self._lanes.items()]
            batch_outcomes = dict(self._batch_outcomes)
            batch_rows, rows_run = self._batch_rows, self._rows_run
            run_s, batch_sizes = self._run_s.recent(now_s), self._batch_sizes.recent(now_s)
            cap_changes = dict(self._cap_changes)
            out_of_memory, batch_splits = self._out_of_memory, self._batch_splits
            memory_used_bytes = self._memory_used_bytes
        batches = sum(batch_outcomes.values())
        # From the batches that ended, as `batches` and laneserve_batches_total count them:
        # counted as each formed, a running batch (or one a stop left running) was in
        # batch_reasons and in neither of them.
        batch_reasons: collections.Counter[str] = collections.Counter()
        for (reason, _), count in batch_outcomes.items():
            batch_reasons[reason] += count
        failed_batches = sum(
            count for (_, status), count in batch_outcomes.items() if status != "OK"
        )
        return StatsSnapshot(
            lanes=[lane.snapshot() for lane in lanes],
            batches=batches,
            rows_run=rows_run,
            mean_batch_size=batch_rows / batches if batches else 0.0,
            run_time=percentiles_ms(run_s),
            batch_reasons=dict(batch_reasons),
            out_of_memory=out_of_memory,
            batch_splits=batch_splits,
            cap_changes=cap_changes,
            memory_used_bytes=memory_used_bytes,
            batch_size=distribution(batch_sizes),
            failed_batches=failed_batches,
        )
