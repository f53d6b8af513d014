"""The state that crosses the boundaries between service, scheduler and engine.

All of it is frozen; `__repr__` never prints tensors (they can be megabytes).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping

import numpy as np
import numpy.typing as npt

from laneserve.server.errors import LaneserveError

Array = npt.NDArray[np.generic]
# Trailing (non-row) shape of every input, in input order: items batch together only
# when their signatures are equal, since their rows are concatenated along axis 0.
Signature = tuple[tuple[int, ...], ...]
# Asked by the engine before it runs rows of a batch again (after an out-of-memory): for
# each row of the batch, whether a caller still waits for it within its deadline.
RowsWanted = Callable[[], npt.NDArray[np.bool_]]


@dataclasses.dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One validated request, as the service hands it to the scheduler."""

    request_id: str
    lane: str
    # Model input name -> array whose first axis holds `rows` rows.
    inputs: Mapping[str, Array] = dataclasses.field(repr=False)
    rows: int
    signature: Signature
    # Monotonic seconds by which the answer is due. The service always gives one: the
    # earliest of the gRPC deadline, the request's timeout_ms and its lane's timeout, all
    # counted from arrival (`LaneConfig.deadline_s`). None: the lane's timeout counted from
    # admission (a caller other than the service).
    deadline_s: float | None
    # Opaque to the scheduler: handed back in the request's `Outcome`.
    token: object = dataclasses.field(repr=False, compare=False)
    # Opaque to the scheduler: the request's `RequestTrace` (events.py), copied into every
    # slice of it so that telemetry can link a batch to the requests it serves.
    trace: object = dataclasses.field(default=None, repr=False, compare=False)
    # For messages only: the caller's own budget in seconds from arrival, before its lane's
    # timeout capped it (the shorter of its gRPC deadline's remaining time and its
    # timeout_ms); None when it set neither. `deadline_s` holds the cap already, so a
    # refusal or expiry could not tell whether the lane's timeout or the caller's set it.
    own_timeout_s: float | None = None
    # Monotonic seconds (the scheduler's clock, the service's) when it reached the
    # servicer, before decoding: a refusal counts its wait from here (`waited_s`). None:
    # it arrived as it was submitted (a caller other than the service).
    arrived_s: float | None = None

    def waited_s(self, now_s: float) -> float:
        """Seconds from its arrival to `now_s` (0.0 without `arrived_s`): what a refusal
        at `now_s` is counted with (`SchedulerEvents.rejected`)."""
        return 0.0 if self.arrived_s is None else now_s - self.arrived_s


class DispatchReason(enum.Enum):
    # It reached its limit (the cap, or less while a higher lane is active), or queued
    # work was left out of it (a request that did not fit, work of another shape):
    # waiting could only hold that work back.
    FULL = "full"
    MAX_WAIT = "max_wait"  # its most urgent item waited its lane's max_wait_ms
    DEADLINE = "deadline"  # waiting longer would miss the earliest deadline in it
    BACKLOG = "backlog"  # its work queued while the session was busy: no reason to wait
    IDLE = "idle"  # the session is free and no more work is expected within the wait


@dataclasses.dataclass(frozen=True, slots=True)
class BatchSlice:
    """Rows [row_start, row_start + rows) of one request, at `offset` in the batch."""

    entry_id: int
    lane: str
    row_start: int
    rows: int
    offset: int
    # The request's `InferenceRequest.trace`.
    trace: object = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    batch_id: int
    slices: tuple[BatchSlice, ...]
    rows: int
    reason: DispatchReason
    formed_s: float
    # Per model input, the row blocks to concatenate, in slice order. Concatenation is
    # left to the engine thread so the scheduler thread stays responsive.
    parts: Mapping[str, tuple[Array, ...]] = dataclasses.field(repr=False)
    # The shapes of its rows after the row axis, one per input (empty: not known).
    signature: Signature = ()


@dataclasses.dataclass(frozen=True, slots=True)
class FailedRows:
    """Rows [offset, offset + rows) of a batch left without outputs: a row that failed
    even when run alone, or rows not run again after an out-of-memory because nobody
    wanted them any more (their deadline passed or their caller left)."""

    offset: int
    rows: int
    error: LaneserveError


@dataclasses.dataclass(frozen=True, slots=True)
class OutOfMemoryRun:
    """A run of `rows` rows that failed to allocate device memory (it was then split)."""

    rows: int
    # It held a row that failed even when run alone, or a row of a request that had such
    # a row: its failure says nothing about batch size (see `BatchCaps.adapt`).
    held_unfit_row: bool


@dataclasses.dataclass(frozen=True, slots=True)
class BatchResult:
    batch: Batch
    # Model output name -> array with `batch.rows` rows; None when the run failed or no
    # run succeeded (then every row is in `failed_rows`).
    outputs: Mapping[str, Array] | None = dataclasses.field(repr=False)
    # The whole batch failed with this, outside the session's runs (a bug: see the engine
    # thread); a run that fails is split and its rows fail one by one (`failed_rows`).
    error: LaneserveError | None
    run_s: float
    # Rows without valid outputs, each range with its own error; every other row's
    # output is valid.
    failed_rows: tuple[FailedRows, ...] = ()
    # The runs that ran out of device memory (each recorded when it failed, then marked
    # once the rows split from it are done).
    out_of_memory_runs: tuple[OutOfMemoryRun, ...] = ()
    # The batch was run in parts after a failed run (its run time is not one run's).
    split: bool = False

    @property
    def out_of_memory_rows(self) -> tuple[int, ...]:
        """Row counts of the runs that ran out of device memory."""
        return tuple(run.rows for run in self.out_of_memory_runs)

    def __post_init__(self) -> None:
        if self.error is not None:
            assert self.outputs is None, "a failed batch has no outputs"
            assert not self.failed_rows, "a failed batch fails every row with its error"
        elif self.outputs is None:
            assert sum(failed.rows for failed in self.failed_rows) == self.batch.rows, (
                "without outputs every row has its error"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class Timing:
    lane: str
    batch_size: int  # rows in the last batch that carried the request
    queue_s: float  # admission to the dispatch of its first batch
    infer_s: float  # session time of all its batches


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """The one answer to one admitted request: outputs, or an error."""

    token: object = dataclasses.field(repr=False)
    request_id: str
    outputs: Mapping[str, Array] | None = dataclasses.field(repr=False)
    error: LaneserveError | None
    timing: Timing | None
    # Text outputs' wire data by name, encoded off the event loop (`text_thread`); an
    # output not in it is encoded as the answer is made.
    text_data: Mapping[str, bytes] | None = dataclasses.field(default=None, repr=False)
    # Its outputs came from a run that ended after its deadline (the one the scheduler
    # kept, a retry's moves included): admission predicted it in time, or made no
    # prediction (an idle server, a shape not yet run: `Scheduler._check_admission`).
    # Answered all the same (the work is done; a gRPC deadline passed ends the call
    # DEADLINE_EXCEEDED anyway), and counted late (`SchedulerEvents.request_finished`).
    late: bool = False
