"""The batch cap, per input shape: the most rows a batch of one signature holds. Out of
memory lowers a shape's cap, a run of its full batches raises it back (`BatchCaps.adapt`).

Rows batch only with rows of their signature, and memory follows the shape: a batch of
512-token rows that ran out of memory at 64 rows says nothing of 8-token rows. With one
cap for all, that one failure held 8-token traffic to half its batches until ~1 000 full
batches had run. A model with fixed shapes has one signature, and so one cap.

A shape not yet run gets its first cap from the caps out of memory taught (`BatchCaps.rows`):
given the probed cap, every new sequence length ran out of memory once before it batched
safely (96 of 100 lengths 400..499 under 40 MiB in a one-off run, each answered late after a
split, with two warnings; now the first alone: test_memory pins it on other widths).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from laneserve.server.cost_model import MAX_SIGNATURES, elements_per_row
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
    # Whether out of memory of this signature lowered it (or found it below the size that
    # failed): it then says how many rows of its shape fit, and while below the probed
    # cap other shapes' guesses are scaled from it (`BatchCaps._sources`). A guess is
    # not, until it fails itself: scaled from guesses, errors would compound. Nor is a
    # cap kept at the probed cap because a full batch ran whole there (`BatchCaps.adapt`).
    learned: bool = False
    # Whether it is in `BatchCaps._sources` (learned, and below the probed cap).
    source: bool = False
    # Whether its rows are still the guess it was kept at (`BatchCaps.adapt`): no event
    # told of it, so none tells of its forgetting.
    guessed: bool = False


def _capacity_failures(result: BatchResult) -> list[int]:
    """Sizes of the runs of `result` that ran out of memory for their size: a row that
    fails even alone says nothing about batch size, nor does a run that failed because
    it held such a row (a two-row run of rows too large alone would otherwise pull the
    cap to one for everybody's traffic)."""
    return [run.rows for run in result.out_of_memory_runs if not run.held_unfit_row]


class BatchCaps:
    """The cap in force for each signature. Until one runs out of memory every signature
    has the probed cap, `max_rows`; after that, one with no cap of its own has a cap
    guessed from those learned (see `_guessed_rows`). Its first batch to complete (some
    of its rows run) keeps that guess as its own cap (`adapt`), which then moves as a
    learned one does (raised by full batches, lowered by out of memory); a signature
    whose full batch ran whole at the probed cap keeps the probed cap, proven, where a
    guess would cut it. Of the signatures with a cap of their own, the MAX_SIGNATURES run
    most recently keep it; one forgotten has the guess again (the probed cap while none
    was learned), reported as recovered where that is higher and the cap was reported (a
    guess is not).

    Not thread-safe: owned by the scheduler (its lock); `lowest` is read anywhere."""

    def __init__(self, max_rows: int, events: SchedulerEvents) -> None:
        assert max_rows >= 1
        self.max_rows = max_rows
        self._events = events
        self._caps: collections.OrderedDict[Signature, _Cap] = collections.OrderedDict()
        # (elements per row, signature) of the caps a guess is scaled from, sorted: those
        # `_Cap.learned` below the probed cap. A cap at the probed cap says nothing of
        # memory (it may never have failed). Invariant: holds exactly the caps whose
        # `_Cap.source` is set.
        self._sources: list[tuple[int, Signature]] = []
        # The lowest cap kept (of any signature; a guess counts once its signature's
        # first batch completed and kept it): what GetStats, the metrics and the call gate
        # read, on other threads and per call, so kept rather than searched. At the probed
        # cap, no cap was lowered: no source, no guess below it.
        self.lowest = max_rows

    def rows(self, signature: Signature) -> int:
        """The most rows a batch of `signature` holds now. Asked several times a request
        (of every queued shape's work, on admission): O(1) while no cap is below the
        probed one, a guess worked out (O(log n)) for a signature with no cap of its own.
        Keeps and forgets nothing: kept here, each new shape admitted took a place among
        the MAX_SIGNATURES and pushed learned caps out (and with more shapes queued than
        are kept, every batch priced again ~1 000 of them)."""
        if self.lowest >= self.max_rows:  # none ran out of memory (the rule)
            return self.max_rows
        cap = self._caps.get(signature)
        if cap is not None:
            return cap.rows
        if not self._sources:  # the caps kept say nothing of memory: guesses, probed caps
            return self.max_rows
        return self._guessed_rows(signature)

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
        at its guess): only their queued work is priced again. The batch's signature, if it
        has no cap of its own, keeps the one it has (`rows`) from here on, at most one
        forgotten for it: O(1) signatures priced again a batch, however many shapes are
        queued. Queued work of other shapes with no cap of their own keeps the price of
        the guess it was priced at when a source of that guess moves, until its rows next
        move (a trade for O(1) pricing: 60 rows priced 2.5x too cheap until then,
        in a one-off run; admission is that much optimistic meanwhile)."""
        signature = result.batch.signature
        failed_batches = _capacity_failures(result)
        # Only a full batch that ran whole shows the cap fits: a split one (rows that
        # failed, a broken session) says nothing of the kind.
        ran_full = result.error is None and not result.split and self.full(result.batch)
        moved: list[Signature] = []
        cap = self._caps.get(signature)
        if cap is None:
            rows = self.rows(signature)
            if not (failed_batches or ran_full or rows < self.max_rows):
                return moved  # at the probed cap, unproven: nothing to keep
            if not failed_batches and result.outputs is None:
                # None of its rows ran (a row too large even alone; a batch that failed
                # outside the session): its guess was not tried. Kept, a row that never
                # fits held `lowest` (GetStats' batch_cap) at its guess, 1, for good.
                return moved
            cap, forgotten = self._keep(signature, rows)
            if forgotten is not None:
                moved.append(forgotten)
        self._caps.move_to_end(signature)  # run most recently: kept longest
        if failed_batches:
            lowered = self._lower(cap, signature, result, min(failed_batches), failed_batches)
            return [*moved, signature] if lowered else moved
        return [*moved, signature] if ran_full and self._recover(cap, signature) else moved

    def _keep(self, signature: Signature, rows: int) -> tuple[_Cap, Signature | None]:
        """Gives `signature`, which has none, a cap of its own at `rows`, the cap it has:
        nothing moved. A guess (below the probed cap) is reported by no event: an event
        per new shape was a warning per new sequence length. At the probed cap (unless a
        failure lowers it at once) a full batch ran whole there: proven, kept, where a guess
        from another shape's failure cut width 300, 100 full batches run at 128 rows, to
        66 (~500 full batches to recover). Returns it, and the signature forgotten to
        keep it (`_forget_oldest`) if that one's cap moved."""
        cap = self._caps[signature] = _Cap(rows, guessed=rows < self.max_rows)
        self.lowest = min(self.lowest, rows)
        forgotten = self._forget_oldest() if len(self._caps) > MAX_SIGNATURES else None
        return cap, forgotten

    def _lower(
        self,
        cap: _Cap,
        signature: Signature,
        result: BatchResult,
        smallest: int,
        failed_batches: list[int],
    ) -> bool:
        cap.learned = True
        self._index(cap, signature)  # a source now, if below the probed cap already
        # Full as whole requests make it at the cap counts as at it, as recovery counts a
        # full batch: 60 rows of 20-row requests under a cap of 64 or 62. Not held, the
        # cap climbed back to 62 and failed again every ~65 batches.
        at_cap = any(rows >= cap.rows for rows in failed_batches) or (
            result.batch.rows in failed_batches and self.full(result.batch)
        )
        if at_cap:
            # A batch at the cap failed: a limit, held below the smallest of its runs that
            # failed. Its parts hold rows of its one shape, as a whole batch of their size
            # would: held below the cap alone when its halves failed too (1 536 rows, then
            # both halves of 768), the cap climbed back to 768 and failed there again. A
            # failure only smaller than the cap (larger batches ran) is a passing shortage
            # and sets no ceiling.
            ceiling = cap.oom_ceiling_rows
            cap.oom_ceiling_rows = smallest if ceiling is None else min(ceiling, smallest)
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
        cap.guessed = False
        self._index(cap, signature)
        self._find_lowest()
        return True

    def _guessed_rows(self, signature: Signature) -> int:
        """A cap for `signature` from the learned caps (`_sources`, at least one) of the
        shapes nearest in elements per row, below and above: c rows of a shape of e
        elements per row fit. Memory per row grows at least as fast as the elements (a
        text model's embeddings: 68 rows of length 400 fitted under 40 MiB, 34 of 800,
        17 of 1 600) and at most as their square (attention over a sequence; a row's
        outer product: 52 rows of width 300 fitted under 18 MiB, 13 of 600; one-off runs). So from a
        larger shape c * e / e_new rows fit, from a smaller one c * (e / e_new)^2, and
        the larger of the two is taken: each fits. Scaled up by the elements alone, a
        cap that had recovered near its limit (52 at width 300: 26 at 600) fails at the
        new shape, and a failure halves the cap below the size that failed (13 rows at
        best), no more than the square's guess. Where memory grows slower than the
        elements (a fixed cost per row besides, a pooled vector), the guess from a
        larger shape is too large: it fails once, as every new shape did before."""
        elements = elements_per_row(signature)
        sources = self._sources
        at = bisect.bisect_left(sources, elements, key=lambda known: known[0])
        rows = 1
        if at < len(sources):  # the nearest at or above
            above_elements, above = sources[at]
            rows = max(rows, self._caps[above].rows * above_elements // elements)
        if at > 0:  # the nearest below
            below_elements, below = sources[at - 1]
            scaled = self._caps[below].rows * below_elements * below_elements
            rows = max(rows, scaled // (elements * elements))
        return min(rows, self.max_rows)

    def _index(self, cap: _Cap, signature: Signature) -> None:
        """Keeps `signature` in `_sources` while its cap is learned and below the probed
        cap."""
        source = cap.learned and cap.rows < self.max_rows
        if source == cap.source:
            return
        cap.source = source
        key = (elements_per_row(signature), signature)
        if source:
            bisect.insort(self._sources, key)
        else:
            self._sources.remove(key)

    def _forget_oldest(self) -> Signature | None:
        """Drops the cap of the signature run least recently: it has the guess again (the
        probed cap while no source is kept). Returns that signature if its cap moved so.
        Reported as recovered where it rose and the cap was reported; one that falls to a
        guess is not, as a guess is not."""
        signature, cap = self._caps.popitem(last=False)
        if cap.source:
            self._sources.remove((elements_per_row(signature), signature))
        # Only the least of those kept moves it, and none kept is below the probed cap while
        # `lowest` is at it (shapes proven there are kept at it: no scan per new shape).
        if cap.rows <= self.lowest < self.max_rows:
            self._find_lowest()
        rows = self.rows(signature)
        if rows == cap.rows:
            return None
        if rows > cap.rows and not cap.guessed:
            self._events.cap_changed(cap.rows, rows, "recovered", signature)
        return signature

    def _find_lowest(self) -> None:
        self.lowest = min((cap.rows for cap in self._caps.values()), default=self.max_rows)
