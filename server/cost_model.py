"""Predicted session run time per batch size, from the start-up probe and live runs.

The scheduler asks it two questions: how long will a batch of n rows run (to dispatch
before the earliest deadline in it), and how long until n queued rows are served (to
refuse a request whose deadline cannot be met).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Iterable, Mapping, Sequence

from laneserve.server.items import Signature

# Weight of the newest observation in a size's moving average.
_EWMA_ALPHA = 0.2
# An observation counts as at most this many times the prediction (or at least its
# inverse): one run of an outlier input (a 15 000-token sequence among short ones) moved
# a size's estimate by 3 000x, and admission then refused every request of that size as
# unmeetable; refused requests never run, so the estimate never came back. A sustained
# change still moves it by up to 1.6x per run.
_OUTLIER_RATIO = 4.0
# A new signature's first run is averaged with its guess when the guess comes from a
# measured signature at most this many times larger or smaller in elements per row
# (see `RunTimeModels.observe`): nearer, the guess was within 1.5x of the run time
# for 86-89 % of lengths on a real trace, the first run for ~90 %.
_NEAR_GUESS_RATIO = 2.0
# Signatures whose models are kept (least recently used dropped): inputs with dynamic
# sizes may come in any number of shapes. Sequence lengths 8..512 are 505 of them: at
# 256, 23 % of a real trace's batches were guessed again after their length had been
# dropped. A model is about 1 kB: the probe's sizes, up to twice as many they map to
# and the batch sizes it ran (see `RunTimeModel.scaled`).
MAX_SIGNATURES = 1024
# Guesses kept for shapes not yet run (see `RunTimeModels.get`): one per shape priced
# between the changes that move them, as many as the models kept.
_GUESS_ENTRIES = MAX_SIGNATURES
# `RunTimeModel.rows_within_s` answers kept until the next observation: a lane's max_wait
# is asked again and again, a batch's deadline budget (any number) seldom twice, and a
# shape whose batches stop succeeding (failing, split) is not observed at all.
_WITHIN_ENTRIES = 64


class RunTimeModel:
    """Run seconds by batch size, measured at a few sizes and interpolated between them.

    Not thread-safe: owned by the scheduler (its lock).
    """

    def __init__(
        self,
        measured_s: Mapping[int, float],
        *,
        grid: Sequence[int] | None = None,
        grid_ratio: float = 1.0,
        ran: Iterable[int] = (),
    ) -> None:
        """For a model derived from another (`times`, `scaled`): `grid`, the probe's
        sizes (None: those of `measured_s`, the probe's); `grid_ratio`, how many times as
        large its rows are as the probe's; `ran`, the row counts it ran."""
        if not measured_s or any(rows < 1 or s < 0 for rows, s in measured_s.items()):
            raise ValueError(f"expected run times for batch sizes >= 1, got {dict(measured_s)}")
        self._sizes = sorted(measured_s)
        self._seconds = [float(measured_s[rows]) for rows in self._sizes]
        # What a model scaled from this one maps (see `scaled`): the probe's sizes (this
        # model's own where it is the probe's), carried from model to model with how many
        # times as large this model's rows are as the probe's, and the row counts this
        # model ran (at most the cap).
        self._grid = tuple(self._sizes if grid is None else grid)
        self._grid_ratio = grid_ratio
        self._ran = set(ran)
        # rows_within_s answers until the next observation: asked for each lane's
        # max_wait on every admission and plan, a bisection of ~7 predictions each time.
        self._within: dict[tuple[float, int], int] = {}
        # Runs folded in so far: a model scaled from this one is stale once it grows.
        self.observations = 0

    def predict_s(self, rows: float) -> float:
        """Seconds one batch of `rows` rows is expected to run."""
        if rows <= 0:
            return 0.0
        sizes, seconds = self._sizes, self._seconds
        at = bisect.bisect_left(sizes, rows)
        if at < len(sizes) and sizes[at] == rows:
            return seconds[at]
        if at == 0:
            return seconds[0]  # run time does not fall below the smallest batch's
        if at == len(sizes):
            return seconds[-1] * rows / sizes[-1]  # beyond the probe: proportional
        low, high = sizes[at - 1], sizes[at]
        weight = (rows - low) / (high - low)
        return seconds[at - 1] + weight * (seconds[at] - seconds[at - 1])

    def rows_within_s(self, seconds: float, cap: int) -> int:
        """The most rows (1 to `cap`) one batch of which is expected to run within
        `seconds` (by bisection: run time grows with rows)."""
        known = self._within.get((seconds, cap))
        if known is not None:
            return known
        if len(self._within) >= _WITHIN_ENTRIES:
            self._within.clear()
        low, high = 1, cap
        while low < high:
            middle = (low + high + 1) // 2
            if self.predict_s(middle) <= seconds:
                low = middle
            else:
                high = middle - 1
        self._within[(seconds, cap)] = low
        return low

    def drain_s(self, rows: int, batch_cap: int) -> float:
        """Seconds to serve `rows` queued rows in batches of at most `batch_cap`."""
        full, rest = divmod(max(rows, 0), batch_cap)
        return full * self.predict_s(batch_cap) + self.predict_s(rest)

    def observe(self, rows: int, run_s: float) -> None:
        """Folds one measured run into the nearest measured size (or adds the size)."""
        if rows <= 0 or not math.isfinite(run_s) or run_s < 0:
            return
        self.observations += 1
        self._within.clear()
        self._ran.add(rows)
        predicted_s = self.predict_s(rows)
        if predicted_s > 0:
            run_s = min(max(run_s, predicted_s / _OUTLIER_RATIO), predicted_s * _OUTLIER_RATIO)
        at = bisect.bisect_left(self._sizes, rows)
        if at < len(self._sizes) and self._sizes[at] == rows:
            self._seconds[at] += _EWMA_ALPHA * (run_s - self._seconds[at])
        else:
            # A new size starts from the interpolated prediction, moved like any other
            # observation: one slow run must not become the model's truth.
            self._sizes.insert(at, rows)
            self._seconds.insert(at, predicted_s + _EWMA_ALPHA * (run_s - predicted_s))

    def snapshot(self) -> dict[int, float]:
        return dict(zip(self._sizes, self._seconds, strict=True))

    def times(self, factor: float) -> RunTimeModel:
        """This model with every run `factor` times as long."""
        return RunTimeModel(
            {rows: s * factor for rows, s in self.snapshot().items()},
            grid=self._grid,
            grid_ratio=self._grid_ratio,
            ran=self._ran,
        )

    def scaled(self, row_ratio: float, max_rows: int | None = None) -> RunTimeModel:
        """A model for rows `row_ratio` times as large: n of them are predicted to run as
        long as n * row_ratio rows of this model (the run time of a batch follows the
        elements it holds). Its sizes, 1 to `max_rows` (None: no upper bound), are where
        its curve bends: the probe's, those they map to from this model's rows and from
        the probe's, and those the rows this model ran map to.

        Not this model's other sizes: a guess kept them all, and one scaled from a model
        learned from a guess (the nearest measured) held every size of the chain before
        it: 12 777 after 399 sequence lengths run one after another, up to 17 964 rows at
        a cap of 128, rebuilt on each admission of a new length. A model now holds at
        most three times the probe's sizes, the rows it ran and those its source ran;
        over that chain its predictions moved by at most 6 %."""
        grid_ratio = self._grid_ratio * row_ratio
        mapped = [
            *(round(rows / row_ratio) for rows in (*self._grid, *self._ran)),
            *(round(rows / grid_ratio) for rows in self._grid),
        ]
        sizes = {
            max(1, rows if max_rows is None else min(rows, max_rows))
            for rows in (*self._grid, *mapped)
        }
        return RunTimeModel(
            {rows: self.predict_s(rows * row_ratio) for rows in sizes},
            grid=self._grid,
            grid_ratio=grid_ratio,
        )


def elements_per_row(signature: Signature) -> int:
    """Values one row holds across the inputs (each input's shape after the row axis)."""
    return max(1, sum(math.prod(shape) for shape in signature))


class RunTimeModels:
    """A run-time model per input signature: batches of other shapes (a model with
    dynamic sizes, such as sequence lengths) run for other times. The probe's signature
    has the probe's model; another is predicted, until its first run, from the measured
    model (the probe's or one learned) whose rows hold the nearest number of elements,
    scaled by the ratio of elements, and from then on has its own model, learning from
    its runs (the MAX_SIGNATURES most recently run are kept). With no probe signature
    every signature shares one model.

    Not thread-safe: owned by the scheduler (its lock).
    """

    def __init__(
        self, base: RunTimeModel, base_signature: Signature | None, max_rows: int | None = None
    ) -> None:
        """`max_rows`: the most rows a batch holds (the cap), the largest size a guess
        holds (None: no bound)."""
        self.base = base
        self._max_rows = max_rows
        self._base_signature = base_signature
        self._others: collections.OrderedDict[Signature, RunTimeModel] = collections.OrderedDict()
        # (elements per row, signature) of every measured model, the probe's included,
        # sorted: where a guess finds its nearest.
        self._by_elements: list[tuple[int, Signature]] = (
            [] if base_signature is None else [(elements_per_row(base_signature), base_signature)]
        )
        # Per signature not yet run, its guess (`_scaled`), the model it was scaled from
        # and that model's `observations` then. A guess is asked at every price of its
        # queued rows (each push, take and re-pricing): built each time, a lane's
        # re-pricing of 16 000 queued lengths took ~1 s. Invariant: a guess kept whose
        # source's `observations` has not grown is the one `_scaled` builds now. It moves
        # only when its source learns (it is built again when next asked) or the set of
        # measured models changes (another may be the nearest: all are dropped).
        self._guesses: dict[Signature, tuple[RunTimeModel, RunTimeModel, int]] = {}

    def get(self, signature: Signature) -> RunTimeModel:
        """The model to predict `signature`'s runs with (no model is stored: a signature
        that never runs, refused or cancelled, evicts no model that learned; its guess is
        kept, see `_guesses`)."""
        if self._shares_base(signature):
            return self.base
        return self._others.get(signature) or self._guess(signature)

    @property
    def per_signature(self) -> bool:
        """Whether signatures other than the probe's have models of their own (else one
        model, learning from every run, predicts them all)."""
        return self._base_signature is not None

    def knows(self, signature: Signature) -> bool:
        """Whether `signature`'s model was measured: the probe's, or learned from runs.
        A scaled guess is not: refusing on it, the signature might never run to learn
        (a dynamic size the probe ran at 1 is predicted far too slow at 128)."""
        return self._shares_base(signature) or signature in self._others

    def observe(self, signature: Signature, rows: int, run_s: float) -> None:
        """Folds one run of a batch of `signature` into its model."""
        if self._shares_base(signature):
            self.base.observe(rows, run_s)
            return
        model = self._others.get(signature)
        if model is not None:
            self._others.move_to_end(signature)
            model.observe(rows, run_s)
            return
        if rows <= 0 or not math.isfinite(run_s) or run_s <= 0:
            return
        # Its first run sets its level, the guess's curve its shape. A guess from a far
        # shape has no weight to average with (averaged in, a guess 8x too slow still
        # refused the shape after its first run, and it never ran again). One from a
        # near shape does: it is about as often right as the first run, which may have
        # paid for the new shape (on the CPU, over 1.5x the later runs for 1 length in
        # 12, up to 4.8x); taken alone, that run had its shape refused on a model 4x
        # too slow.
        guess = self._guess(signature)
        predicted_s = guess.predict_s(rows)
        level = run_s / predicted_s if predicted_s > 0 else 1.0
        if self._near_elements_ratio(signature) <= _NEAR_GUESS_RATIO:
            level = math.sqrt(level)  # halfway, on the log scale
        model = guess.times(level)
        self._others[signature] = model
        bisect.insort(self._by_elements, (elements_per_row(signature), signature))
        if len(self._others) > MAX_SIGNATURES:
            evicted, _ = self._others.popitem(last=False)
            self._by_elements.remove((elements_per_row(evicted), evicted))
        self._guesses.clear()  # a guess's nearest measured model may be another now

    def _shares_base(self, signature: Signature) -> bool:
        return self._base_signature is None or signature == self._base_signature or not signature

    def _guess(self, signature: Signature) -> RunTimeModel:
        """`_scaled(signature)`, kept until it may move (see `_guesses`)."""
        kept = self._guesses.get(signature)
        if kept is not None:
            guess, source, observations = kept
            if source.observations == observations:
                return guess
        guess, source = self._scaled(signature)
        if kept is None and len(self._guesses) >= _GUESS_ENTRIES:
            del self._guesses[next(iter(self._guesses))]  # the one built first
        self._guesses[signature] = (guess, source, source.observations)
        return guess

    def _scaled(self, signature: Signature) -> tuple[RunTimeModel, RunTimeModel]:
        """The guess for `signature`, and the model it is scaled from: the measured model
        nearest in elements per row (by their ratio), scaled. Run time grows faster than
        the elements where a row's cost does (attention over a sequence: its length
        squared), so a near shape's model guesses better than a far one's: scaled from a
        probe at length 8, length 512 was predicted at 0.36 of its run time, from a
        learned length near it at ~1.0."""
        near_elements, near_signature = self._nearest(signature)
        model = (
            self.base if near_signature == self._base_signature else self._others[near_signature]
        )
        return model.scaled(elements_per_row(signature) / near_elements, self._max_rows), model

    def _near_elements_ratio(self, signature: Signature) -> float:
        """How many times more (or fewer) elements a row of `signature` holds than one of
        the measured signature nearest to it (>= 1)."""
        near_elements, _ = self._nearest(signature)
        elements = elements_per_row(signature)
        return max(elements / near_elements, near_elements / elements)

    def _nearest(self, signature: Signature) -> tuple[int, Signature]:
        """(elements per row, signature) of the measured model nearest to `signature` in
        elements per row, by their ratio: of the one below and the one above, the nearer;
        the larger on a tie (a cost growing faster than the elements is then
        overestimated, not under)."""
        assert self._by_elements
        elements = elements_per_row(signature)
        at = bisect.bisect_left(self._by_elements, (elements, signature))
        near = self._by_elements[max(at - 1, 0) : at + 1]
        return min(near, key=lambda known: (abs(math.log(known[0] / elements)), -known[0]))
