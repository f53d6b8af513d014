"""The batch cap, per input shape: the most rows a batch of one signature holds. Out of
memory lowers a shape's cap, a run of its full batches raises it back (`BatchCaps.adapt`).

Rows batch only with rows of their signature, and memory follows the shape: a batch of
512-token rows that ran out of memory at 64 rows says nothing of 8-token rows. With one
cap for all, that one failure held 8-token traffic to half its batches until ~1 000 full
batches had run. A model with fixed shapes has one signature, and so one cap.
"""

from __future__ import annotations

import collections
import dataclasses

from laneserve.server.cost_model import MAX_SIGNATURES
from laneserve.server.events import SchedulerEvents
from laneserve.server.items import Batch, BatchResult, Signature

# Full batches that must succeed in a row before a cap rises one step after an
# out-of-memory; and the step, as a fraction (1/n) of the probed cap.
CAP_RECOVERY_BATCHES = 64
CAP_RECOVERY_STEPS = 16
# A cap does not rise to a size that ran out of memory until this many full batches in a
# row have succeeded below it: then it probes once more (memory may have been freed).
# Without that ceiling it climbed straight back past the failing size, every few hundred
# batches.
CAP_CEILING_BATCHES = 16 * CAP_RECOVERY_BATCHES
# Why a cap moves (`SchedulerEvents.cap_changed`): lowered, raised back.
CAP_CHANGE_REASONS = ("out_of_memory", "recovered")


@dataclasses.dataclass(slots=True)
class _Cap:
    """One signature's cap and what its recovery remembers."""

    rows: int
    full_batches_since_change: int = 0
    # The smallest size that ran out of memory for its size, until probed again.
    oom_ceiling_rows: int | None = None
    # The last cap that ran CAP_RECOVERY_BATCHES full batches, until a run at or below it
    # fails: where a failed probe above it returns.
    proven_rows: int | None = None


def _capacity_failures(result: BatchResult) -> list[int]:
    """Sizes of the runs of `result` that ran out of memory for their size: a row that
    fails even alone says nothing about batch size, nor does a run that failed because
    it held such a row (a two-row run of rows too large alone would otherwise pull the
    cap to one for everybody's traffic)."""
    return [run.rows for run in result.out_of_memory_runs if not run.held_unfit_row]


class BatchCaps:
    """The cap in force for each signature. A signature that never ran out of memory has
    the probed cap, `max_rows`; of those that did, the MAX_SIGNATURES run most recently
    keep their own. One forgotten is back at the probed cap (reported as recovered: the
    logs and GetStats' lowest cap moved), meets its limit again, and is split like any
    out-of-memory."""

    def __init__(self, max_rows: int, events: SchedulerEvents) -> None:
        assert max_rows >= 1
        self.max_rows = max_rows
        self._events = events
        self._caps: collections.OrderedDict[Signature, _Cap] = collections.OrderedDict()
        # The lowest cap in force (of any signature): what GetStats, the metrics and the
        # call gate read, on other threads and per call, so kept rather than searched.
        self.lowest = max_rows

    def rows(self, signature: Signature) -> int:
        """The most rows a batch of `signature` holds now."""
        if not self._caps:  # none ran out of memory (the rule): asked several times a request
            return self.max_rows
        cap = self._caps.get(signature)
        return self.max_rows if cap is None else cap.rows

    def full(self, batch: Batch) -> bool:
        """Whether `batch` is as full as whole requests make it at its cap: no request of
        its size would fit beside it. Requests whose size does not divide the cap (48 rows
        under a cap of 120) never fill it to the row, and the cap never recovered."""
        return batch.rows + max(piece.rows for piece in batch.slices) > self.rows(batch.signature)

    def adapt(self, result: BatchResult) -> list[Signature]:
        """Out of memory halves the cap of the batch's signature below the smallest run
        that failed; a run of full batches that succeeded raises it one step (AIMD, as in
        congestion control: quick to back off, slow to probe upwards). Returns the
        signatures whose cap moved (none, the batch's, or besides it one forgotten, back
        at the probed cap): only their queued work is priced again."""
        signature = result.batch.signature
        failed_batches = _capacity_failures(result)
        moved: list[Signature] = []
        cap = self._caps.get(signature)
        if cap is None:
            if not failed_batches:
                return moved  # at the probed cap already: nothing to recover
            cap = self._caps[signature] = _Cap(self.max_rows)
            if len(self._caps) > MAX_SIGNATURES:
                forgotten = self._forget_oldest()
                if forgotten is not None:
                    moved.append(forgotten)
        self._caps.move_to_end(signature)  # run most recently: kept longest
        if failed_batches:
            lowered = self._lower(cap, signature, result, min(failed_batches), failed_batches)
            return [*moved, signature] if lowered else moved
        # Only a full batch that ran whole shows the cap fits: a split one (rows that
        # failed, a broken session) says nothing of the kind.
        ran_full = result.error is None and not result.split and self.full(result.batch)
        return [*moved, signature] if ran_full and self._recover(cap, signature) else moved

    def _lower(
        self,
        cap: _Cap,
        signature: Signature,
        result: BatchResult,
        smallest: int,
        failed_batches: list[int],
    ) -> bool:
        at_cap = [rows for rows in failed_batches if rows >= cap.rows]
        if result.batch.rows in failed_batches and self.full(result.batch):
            # Full as whole requests make it at the cap, as recovery counts a full batch:
            # 60 rows of 20-row requests under a cap of 64 or 62. Not held, the cap
            # climbed back to 62 and failed again every ~65 batches.
            at_cap.append(result.batch.rows)
        if at_cap:
            # A batch at the cap failed: a limit, held below, even when its halves failed
            # too (rows of uneven size: without the ceiling the cap climbed back and
            # failed again every ~65 batches). A failure only smaller than the cap (larger
            # batches ran) is a passing shortage and sets no ceiling.
            failed_at = min(at_cap)
            ceiling = cap.oom_ceiling_rows
            cap.oom_ceiling_rows = failed_at if ceiling is None else min(ceiling, failed_at)
        if cap.proven_rows is not None and cap.proven_rows < smallest:
            # A probe above a size that ran CAP_RECOVERY_BATCHES full batches failed: back
            # to that size, not to half the probe (60 -> 64 failed: 32).
            return self._set(cap, signature, min(cap.rows, cap.proven_rows), "out_of_memory")
        cap.proven_rows = None  # it failed at or below it: memory shrank
        return self._set(cap, signature, min(cap.rows, smallest // 2), "out_of_memory")

    def _recover(self, cap: _Cap, signature: Signature) -> bool:
        cap.full_batches_since_change += 1
        if cap.full_batches_since_change < CAP_RECOVERY_BATCHES or cap.rows >= self.max_rows:
            return False
        cap.proven_rows = cap.rows
        step = max(1, self.max_rows // CAP_RECOVERY_STEPS)
        target = min(self.max_rows, cap.rows + step)
        ceiling = cap.oom_ceiling_rows
        if ceiling is not None and target >= ceiling:
            if cap.full_batches_since_change < CAP_CEILING_BATCHES:
                return False  # held at the last size that ran, below the failing one
            # Probe the failing size once more: that size, not a step past it (62 -> 66
            # past a ceiling of 64: it then held at 62 and probed 66, never the size that
            # failed).
            cap.oom_ceiling_rows = None
            target = max(min(target, ceiling), cap.rows + 1)
        return self._set(cap, signature, target, "recovered")

    def _set(self, cap: _Cap, signature: Signature, rows: int, reason: str) -> bool:
        rows = max(rows, 1)
        cap.full_batches_since_change = 0
        if rows == cap.rows:
            return False
        self._events.cap_changed(cap.rows, rows, reason, signature)
        cap.rows = rows
        self._find_lowest()
        return True

    def _forget_oldest(self) -> Signature | None:
        """Drops the cap of the signature run least recently: back at the probed cap.
        Returns that signature if its cap moved so (None: it was there already)."""
        signature, cap = self._caps.popitem(last=False)
        if cap.rows >= self.max_rows:
            return None
        self._events.cap_changed(cap.rows, self.max_rows, "recovered", signature)
        self._find_lowest()
        return signature

    def _find_lowest(self) -> None:
        self.lowest = min((cap.rows for cap in self._caps.values()), default=self.max_rows)
