"""One batch run in parts after a failed run (`Split`): which rows ran and their outputs,
which failed and with what error, and which runs ran out of memory.

Separate from the engine, which chooses what runs (halves, the rows still wanted, the
check of a broken session) and runs it: this is the bookkeeping of the parts alone, with
no session, and what it hands back (`outputs`, `failed_rows`, `out_of_memory_runs`) is
what the batch's `BatchResult` carries to the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from laneserve.server.errors import (
    DeviceMemoryError,
    EngineError,
    ExpiredInQueueError,
    LaneserveError,
    ModelRunError,
)
from laneserve.server.items import Array, Batch, FailedRows, OutOfMemoryRun, RowsWanted
from laneserve.server.memory import format_bytes

IndexArray = npt.NDArray[np.intp]


class Split:
    """One batch being run in parts after a failed run: which rows ran, which failed and
    why, and the runs that ran out of memory."""

    def __init__(
        self, batch: Batch, rows_wanted: RowsWanted | None, memory_limit_bytes: int | None
    ) -> None:
        self.rows = batch.rows
        self.rows_wanted = rows_wanted
        self._slices = batch.slices
        # What a row that does not fit alone failed against, and what would let it run
        # (fewer rows would not: it failed alone).
        self._budget, self._remedy = (
            ("the device's memory", "narrower rows")
            if memory_limit_bytes is None
            else (
                f"the memory limit of {format_bytes(memory_limit_bytes)}",
                "a larger --memory-limit, or narrower rows",
            )
        )
        # For each row, the slice (request) it belongs to: once one row of a request
        # fails, its other rows need not run (the request's answer is that failure).
        self._owner = np.empty(batch.rows, dtype=np.intp)
        for index, piece in enumerate(batch.slices):
            self._owner[piece.offset : piece.offset + piece.rows] = index
        self._owner_failed = np.zeros(len(batch.slices), dtype=bool)
        # Per slice (request): one of its rows failed alone for want of memory.
        self._owner_unfit = np.zeros(len(batch.slices), dtype=bool)
        self._owner_error: dict[int, LaneserveError] = {}
        # Output name -> `rows` rows, allocated by the first run that succeeds; rows
        # without a valid output stay zero and are listed in `_failed`.
        self.outputs: dict[str, Array] | None = None
        self._failed: list[tuple[int, LaneserveError]] = []
        # The rows of each run that ran out of memory (None: the session probe's row).
        self._out_of_memory: list[IndexArray | None] = []
        self.session_ok = False  # an input it ran at start-up ran during this split
        # The error of rows not run again because nobody wanted them any more. No caller
        # is answered with it: `rows_wanted` (the scheduler) answered the callers whose
        # deadline had passed when it left their rows out, and the others had left.
        self.not_retried = ExpiredInQueueError(
            "deadline passed while its batch was being retried in parts after a failed "
            "run; its rows were not run again"
        )

    def still_wanted(
        self, inputs: Mapping[str, Array], positions: IndexArray
    ) -> tuple[Mapping[str, Array], IndexArray]:
        """The rows of `inputs` (at `positions`) worth running now: a caller still waits
        for them (asked now; the others fail with `not_retried`), and no other row of
        their request has failed (they fail with that row's error, without running)."""
        owners = self._owner[positions]
        doomed = self._owner_failed[owners]
        wanted = ~doomed
        for position, owner in zip(positions[doomed], owners[doomed], strict=True):
            self._failed.append((int(position), self._owner_error[int(owner)]))
        if self.rows_wanted is not None:
            waited = self.rows_wanted()[positions] | ~wanted
            self.fail(positions[~waited], self.not_retried)
            wanted &= waited
        if wanted.all():
            return inputs, positions
        return {name: array[wanted] for name, array in inputs.items()}, positions[wanted]

    def store(self, positions: IndexArray, outputs: Mapping[str, Array]) -> None:
        if self.outputs is None:
            self.outputs = {
                name: np.zeros((self.rows, *array.shape[1:]), array.dtype)
                for name, array in outputs.items()
            }
        for name, array in outputs.items():
            held = self.outputs[name]
            if array.shape[1:] != held.shape[1:]:
                # Each part's outputs must be the rows the whole batch would have given.
                raise EngineError(
                    f"model output {name!r} has shape {list(array.shape[1:])} per row in "
                    f"one part of a split batch and {list(held.shape[1:])} in another: its "
                    "size depends on which rows are batched together; expected outputs "
                    "whose per-row shape depends only on the inputs' shapes"
                )
            held[positions] = array

    def fail_alone(self, row: IndexArray, error: LaneserveError) -> None:
        """One row failed when run alone: it is the row's fault (or it does not fit)."""
        index = self._request_row(int(row[0]))
        failed: LaneserveError
        if isinstance(error, DeviceMemoryError):
            # The runtime's words alone ("Available memory of 16776960 is smaller than
            # requested bytes of 20971520") named neither the row nor the budget.
            failed = DeviceMemoryError(
                f"row {index} of this request needs more device memory than {self._budget} "
                f"allows, even run alone; expected {self._remedy}: {error.message}"
            )
            self._owner_unfit[self._owner[row]] = True
        else:
            # The runtime's words alone: translated, they began "the model failed on this
            # batch", and a row run alone is no batch.
            cause = error.runtime_message if isinstance(error, ModelRunError) else error.message
            failed = EngineError(
                f"the model failed on a row of this request (row {index}, run alone): {cause}"
            )
        failed.metadata["row"] = str(index)  # for programs (ErrorInfo.metadata)
        self.fail(row, failed)

    def _request_row(self, position: int) -> int:
        """The index within its request of the batch's row at `position`."""
        piece = self._slices[int(self._owner[position])]
        return piece.row_start + position - piece.offset

    def ran_out_of_memory(self, positions: IndexArray | None) -> None:
        """A run of the rows at `positions` (None: the session probe's one row) ran out
        of memory."""
        self._out_of_memory.append(positions)

    def out_of_memory_runs(self) -> tuple[OutOfMemoryRun, ...]:
        """The runs that ran out of memory, once the batch is done. A run held an unfit row
        when a request it held rows of has a row that failed alone, wherever in the
        batch: the halves run before either is retried, and a request's rows left once
        one of them failed alone never run again. Judged by the rows each run's own
        retries found, a request of 16 rows too large alone pulled its shape's cap from
        16 to 1 for good (no full batch of it could ever run). The probe's row says
        nothing about batch size either."""
        return tuple(
            OutOfMemoryRun(1, held_unfit_row=True)
            if positions is None
            else OutOfMemoryRun(
                len(positions),
                held_unfit_row=bool(self._owner_unfit[self._owner[positions]].any()),
            )
            for positions in self._out_of_memory
        )

    def fail(self, positions: IndexArray, error: LaneserveError) -> None:
        self._failed += [(int(position), error) for position in positions]
        for owner in np.unique(self._owner[positions]):
            if not self._owner_failed[owner]:
                self._owner_failed[owner] = True
                self._owner_error[int(owner)] = error

    def failed_rows(self) -> tuple[FailedRows, ...]:
        """The failed rows as ranges of adjacent rows with the same error, in order."""
        ranges: list[FailedRows] = []
        for position, error in sorted(self._failed, key=lambda failed: failed[0]):
            last = ranges[-1] if ranges else None
            if last is not None and last.error is error and last.offset + last.rows == position:
                ranges[-1] = FailedRows(last.offset, last.rows + 1, error)
            else:
                ranges.append(FailedRows(position, 1, error))
        return tuple(ranges)
