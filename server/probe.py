"""The start-up probe: what a server runs on its engine once, before it serves.

`probe_engine` (called as `Engine.probe`) checks that the model's rows can be
batched (no output sized by the batch after its first axis, each row's outputs
computed from its own inputs alone, a fixed first axis one of rows), warms the
session up, finds the batch cap (the largest batch that fits the memory budget, by
powers of two and a bisection; on the CPU without a limit, before the host's memory
runs short: `_HostRoom`), times each size, and fits memory in use by rows. It runs
the session only through the Engine's own methods (`run`, `example_inputs`): the
runtime, and the out-of-memory retries and splits of serving, stay in `engine`,
which imports this module only when a probe runs.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Literal

import numpy as np

from laneserve.server.engine import Engine, inputs_named
from laneserve.server.errors import (
    DeviceMemoryError,
    EngineError,
    EngineStartError,
    ModelRunError,
)
from laneserve.server.items import Array
from laneserve.server.log_events import log_event
from laneserve.server.memory import (
    MemoryEstimate,
    MemoryGauge,
    NvmlUnavailableError,
    ProcessRssGauge,
    fit_memory,
    format_bytes,
)
from laneserve.server.providers import CUDA, nvml_start_error

log = logging.getLogger(__name__)

# On the CPU without a memory limit, the share of the host's available memory the probe's
# next size may be predicted to need (see `_HostRoom`): the arena grows by powers of two
# (up to twice what a run needs), and the lanes' queued inputs and the answers being
# sent live in the same memory while serving.
HOST_PROBE_SHARE = 0.5
# Why the probe's sizes stopped growing (`Probe.stop_reason`): the configured maximum
# reached; the lanes' capacity together reached (no batch can hold more rows); a size
# ran out of memory (`Probe.first_failing_rows`); the next size was predicted to need
# more than HOST_PROBE_SHARE of the host's available memory.
ProbeStopReason = Literal["max_batch_size", "queue_rows", "out_of_memory", "host_memory"]
# The probe's timed runs of one size end once they took this long together (at least one
# run, at most `repeats`): the repeats are there for noise, which is large against a run
# of a few milliseconds and small against one of a second. A 1.5 GiB model's start spent
# about half its time in the probe's runs of a second and more (a warm-up and three
# timed runs of each size).
PROBE_REPEATS_WITHIN_S = 0.25
# Rows of random values the start-up check compares, batched and alone, to see each
# row's outputs depend on its own inputs alone (`_check_rows_independent`; where
# the first axis is fixed, the first of its rows).
ROWS_CHECKED = 4
# How far a row's outputs batched may differ from its run alone, relative to the row's
# largest magnitude, by the float's size in bytes, before its answers are said to depend
# on the rows batched with it: ~800 float32 epsilons, 10 float16 ones. The kernels of
# another batch size may sum in another order; a batch quantized with one scale moved a
# row's values by up to half (a review's dynamically quantized model).
ROUNDING_RTOL = {2: 1e-2, 4: 1e-4, 8: 1e-10}
# What the probe times runs with (a test gives a clock it moves itself).
_timer: Callable[[], float] = time.perf_counter


class ProbeStopped(Exception):  # noqa: N818 - not a failure: the start was stopped
    """The start-up probe was asked to stop (`Engine.probe`'s `stopping`: a stop signal
    while starting) and timed no further batch size: the server will not serve."""


def probe_engine(
    engine: Engine,
    max_batch_size: int,
    *,
    repeats: int,
    fixed_cap: bool,
    gauge: MemoryGauge | None,
    queue_rows: int | None,
    host_available: Callable[[], int | None],
    stopping: threading.Event | None,
) -> Probe:
    """Warms the session up, finds the largest batch that fits the memory budget and
    measures run seconds at powers of two up to it.

    No size above `queue_rows` is run, nor, without `fixed_cap`, the cap set above
    it: the rows the lanes can queue together, more than any batch can hold. On the
    CPU without a memory limit only the host's memory would end the sizes' growth,
    so there the probe
    stops before a size predicted to need more than HOST_PROBE_SHARE of what
    `host_available` reads (see `_HostRoom`), and the last size run is the cap (with
    `fixed_cap`, the largest size timed: the cap stays).

    Sizes grow until one fails to allocate or the cap is reached; between the last
    size that fitted and the first that failed a bisection finds the boundary. Each
    size larger than the one before runs in an arena shrunk first (see `Engine.run`; in the
    regions smaller sizes left, the demo model under 32 MiB settled on 352 rows where
    750 fit). The best of `repeats` runs is kept (fewer where they are long:
    PROBE_REPEATS_WITHIN_S): the figure the scheduler plans with is what a warm
    session does, not what a noisy neighbour did once. With
    `fixed_cap` the operator has chosen the cap: sizes are measured while they fit,
    nothing is searched, and the cap stays `max_batch_size` (out of memory at run
    time then lowers it like any other).

    With a `gauge`, memory in use is read after each growing size and fitted as
    fixed + per_row * rows: the measured counterpart of the static estimate (NVML on
    a GPU; resident memory on the CPU, where the arena grows by what runs need).

    Once `stopping` is set (from another thread: a stop signal while starting) no
    further size is timed: ProbeStopped. A size already running is finished (a run
    cannot be interrupted here), so the probe ends within one size's runs.
    """
    host_room = None
    if engine.memory_limit_bytes is None and engine.providers[0] != CUDA:
        host_room = _HostRoom(
            host_available,
            gauge or ProcessRssGauge(),
            fixed_cap=max_batch_size if fixed_cap else None,
        )
    try:
        return _probe(
            engine, max_batch_size, repeats, fixed_cap, gauge, queue_rows, host_room, stopping
        )
    except NvmlUnavailableError as error:  # a memory reading after a probe size
        raise nvml_start_error(error) from error
    except EngineError as error:  # the model cannot be batched (see `Engine.run`)
        shapes = {name: [1, *shape] for name, shape in engine.probe_shapes.items()}
        hint = (
            f"; the start-up probe ran zero-filled inputs of shapes {shapes} (dynamic "
            "sizes not configured are 1): if the model needs other sizes, set "
            "server.probe_shapes (--probe-shape NAME=D1,D2,...)"
            if any(dim < 0 for spec in engine.inputs for dim in spec.shape[1:])
            else ""
        )
        raise EngineStartError(
            f"cannot serve model {engine.model_path!r}: {error}{hint}"
        ) from error


def _probe(
    engine: Engine,
    max_batch_size: int,
    repeats: int,
    fixed_cap: bool,
    gauge: MemoryGauge | None,
    queue_rows: int | None,
    host_room: _HostRoom | None,
    stopping: threading.Event | None,
) -> Probe:
    max_batch_size = _check_batching(engine, max_batch_size)
    measured: dict[int, float] = {}
    memory_bytes: dict[int, int] = {}
    fits, fails = 0, None
    largest = max_batch_size if queue_rows is None else min(max_batch_size, queue_rows)
    stop_reason: ProbeStopReason = "max_batch_size" if largest == max_batch_size else "queue_rows"
    for rows in _powers_of_two_up_to(largest):
        _check_not_stopping(stopping)
        if host_room is not None and fits > 0 and not host_room.admits(rows, fits):
            stop_reason = "host_memory"
            break
        seconds = _time_rows(engine, rows, repeats)
        if seconds is None:
            fails, stop_reason = rows, "out_of_memory"
            break
        measured[rows], fits = seconds, rows
        used_bytes = None if gauge is None else gauge.used_bytes()
        if used_bytes is not None:
            memory_bytes[rows] = used_bytes
        if host_room is not None:  # its gauge is `gauge` where one was given: read above
            host_room.ran(rows, _row_bytes(engine) if rows == 1 else None, used_bytes)
    memory_fit = fit_memory(memory_bytes)
    if fits == 0:
        raise EngineStartError(
            "the model does not run even one row within the memory budget of "
            f"{format_bytes(engine.memory_limit_bytes or 0)}; raise --memory-limit"
        )
    if stop_reason == "queue_rows":
        log_event(
            log,
            logging.INFO,
            "probe_queue_rows",
            f"probe: sizes up to {largest} rows, what the lanes queue together (no "
            f"batch holds more), not max_batch_size {max_batch_size}",
            queue_rows=largest,
            max_batch_size=max_batch_size,
        )
    if fixed_cap:
        return Probe(measured, max_batch_size, fails, memory_bytes, memory_fit, stop_reason)
    if fails is not None:
        fits = _search_boundary(engine, fits, fails, repeats, measured, stopping)
    return Probe(measured, fits, fails, memory_bytes, memory_fit, stop_reason)


def _search_boundary(
    engine: Engine,
    fits: int,
    fails: int,
    repeats: int,
    measured: dict[int, float],
    stopping: threading.Event | None,
) -> int:
    """The largest size that fits, between `fits` and `fails` rows (within ~6 %); its
    run seconds go into `measured`. ProbeStopped once `stopping` is set."""
    low, high = fits, fails
    while high - low > max(1, low // 16):  # within ~6 % of the boundary
        middle = (low + high) // 2
        _check_not_stopping(stopping)
        if _time_rows(engine, middle, 1) is None:
            high = middle
        else:
            low = middle
    fits = low
    # The boundary itself is verified after the failures above (the arena
    # shrinks back first): the cap must be a size that fits after an OOM. The
    # verifying runs are its timing: timed again, the cap ran a warm-up and up to
    # `repeats` runs more (PROBE_REPEATS_WITHIN_S: one more of 1.8 s for 272 MiB of
    # weights).
    _check_not_stopping(stopping)
    seconds = _time_rows(engine, fits, repeats)
    while seconds is None and fits > 1:
        fits = max(1, fits * 7 // 8)
        _check_not_stopping(stopping)
        seconds = _time_rows(engine, fits, repeats)
    if seconds is not None:
        measured[fits] = seconds
    return fits


def _row_bytes(engine: Engine) -> int:
    """The bytes of one probe row's inputs and outputs (a run of one row): held beside
    the session's own memory during a run, and given back after it."""
    inputs = engine.example_inputs(1)
    try:
        outputs = engine.run(inputs)
    except DeviceMemoryError:  # one row ran just now: the outputs are left uncounted
        outputs = {}
    return sum(map(held_bytes, (*inputs.values(), *outputs.values())))


def _check_later_axes_fixed(engine: Engine) -> None:
    """Refuses (EngineError) a model an output of which is sized by the batch after its
    first axis, whatever the axes' names (the engine's `_check_batch_axis_unique` sees only
    names): q [N, d] @ k [M, d]^T is [N, M], and M is the batch's rows too, since
    every input of a request has its rows. Batched with other requests, a request's
    answer then took their size, and values computed from their inputs. Seen from
    shapes: an output that mixes rows within fixed sizes (x - mean(x, axis=0)) is
    not caught here."""
    try:
        one = engine.run(engine.example_inputs(1))
        two = engine.run(engine.example_inputs(2))
    except DeviceMemoryError:
        return  # the probe below meets it and reports it
    for name in engine.output_names:
        if one[name].shape[1:] != two[name].shape[1:]:
            raise EngineError(
                f"model output {name!r} has shape {list(one[name].shape)} for 1 input "
                f"row and {list(two[name].shape)} for 2: its axes after the first "
                "follow the row count, so a request batched with others would get an "
                "answer of their size, computed from their inputs; expected sizes "
                "after the first axis that do not depend on the rows (or "
                "max_batch_size 1)"
            )


def _check_batching(engine: Engine, max_batch_size: int) -> int:
    """Refuses (EngineError) a model whose answers would depend on the rows batched
    with them, where shapes or a run can show it; the largest batch (at most a fixed
    first axis's rows)."""
    asked = max_batch_size
    if engine.fixed_rows is not None:  # no batch holds more rows than a run
        max_batch_size = min(max_batch_size, engine.fixed_rows)
    if max_batch_size > 1:  # one row per run: nothing is batched together
        _check_later_axes_fixed(engine)
    # A fixed axis of F rows runs F rows together whatever the cap (the padding's
    # copies beside a lone row): checked at any cap.
    if (engine.fixed_rows or max_batch_size) > 1:  # the cap is at most fixed_rows
        _check_rows_independent(engine, max_batch_size)
    if engine.fixed_rows is not None:
        _warn_fixed_rows(engine, asked, max_batch_size)
    return max_batch_size


def _check_rows_independent(engine: Engine, max_batch_size: int) -> None:
    """Whether each row's outputs depend on its own inputs alone: the first rows of a
    batch of random rows (0 or 1 for integers and bools, uniform in [0, 1) for
    floats, at the probe's shapes; ROWS_CHECKED of them, of a batch of that many or,
    where the first axis is fixed, of its F) against their runs alone (padded with
    copies of themselves where the axis is fixed), beyond rounding: the kernels of
    another batch size or position may round otherwise (a sum along a row differed
    by an ulp at row 2 of 4, a review). Not checked: a model that fails on such rows,
    or whose outputs differ between two runs of the same row (a random op, a
    nondeterministic kernel: batched or not would say nothing).

    A fixed first axis whose rows differ so is refused (EngineError): it is not one of
    rows (a sequence, a set of boxes: an LSTM's time axis first, as torch exports it,
    a cumulative sum; the first row alone missed those), and an answer would be
    computed from the rows run beside it, the padding's copies too, whatever the
    batch cap. Rows of a dynamic one that differ are warned of (`rows_mix`), and the
    model served: an answer then depends on the rows batched with it, for one of two
    causes the outputs cannot tell apart. A statistic of the batch, as
    DynamicQuantizeLinear's one scale for the whole batch (onnxruntime's
    quantize_dynamic; a caller's logits moved by up to half, a review found): a cap of
    1 gives each row its own, as a run of that row alone does. Or a first axis that is
    not one of rows though dynamic (a sequence: a time-major [T, N, ...] export, a
    cumulative sum over time): no batching of rows serves it (other callers' rows joined
    a caller's sum under load), and a cap of 1 splits every request into runs of one
    row, wrong for every request of more than one (an evaluation's time-major model)."""
    fixed = engine.fixed_rows
    batch_rows = fixed or min(max_batch_size, ROWS_CHECKED)
    checked = min(batch_rows, ROWS_CHECKED)
    generator = np.random.default_rng(0)
    batch = {
        spec.name: _random_rows(
            generator, spec.dtype, (batch_rows, *engine.probe_shapes[spec.name])
        )
        for spec in engine.inputs
    }

    def alone(row: int) -> dict[str, Array]:
        return engine.run({name: array[row : row + 1] for name, array in batch.items()})

    try:
        first, again = alone(0), alone(0)
        unsteady = next(
            (name for name in engine.output_names if _beyond_rounding(first[name], again[name])),
            None,
        )
        if unsteady is not None:
            _rows_unchecked(
                engine,
                f"its output {unsteady!r} differs between two runs of the same row (a "
                "random op, a nondeterministic kernel)",
            )
            return
        together = engine.run(batch)
        apart = [first, *(alone(row) for row in range(1, checked))]
    except DeviceMemoryError:
        return  # the probe below meets it and reports it
    except ModelRunError as error:
        _rows_unchecked(engine, f"it failed on random rows ({error.runtime_message})")
        return
    for name in engine.output_names:
        for row in range(checked):
            # Slices, not elements: an element of a 1-D string output is a str.
            if not _beyond_rounding(together[name][row : row + 1], apart[row][name][:1]):
                continue
            if fixed is not None:
                raise EngineError(
                    f"model output {name!r}: row {row} of {fixed} along the inputs' "
                    "fixed first axis changed with the values of the other rows, so "
                    f"that axis (of {inputs_named(engine.fixed_row_inputs)}) is not one "
                    "of independent rows (a sequence, a set), and "
                    "a request's answer would be computed from the rows run beside it; "
                    "expected a batch axis whose rows do not affect each other's "
                    "outputs: export the model with a dynamic first axis of rows"
                )
            log_event(
                log,
                logging.WARNING,
                "rows_mix",
                f"model output {name!r}: row {row} of {batch_rows} random rows batched "
                "together differs from its run alone beyond rounding, so an answer "
                "depends on the requests batched with it. Either the model takes a "
                "statistic of the batch (DynamicQuantizeLinear, from onnxruntime's "
                "quantize_dynamic, one scale for the whole batch): --max-batch-size 1 "
                "gives each row its own, as a run of that row alone does; or its first "
                "axis is not one of independent rows (a sequence: time-major [T, N, ...]): "
                "such a model cannot be served by batching rows at all (export it "
                "batch-first), and --max-batch-size 1 splits every request into runs of "
                "one row",
                output=name,
                row=row,
                rows=batch_rows,
            )
            return


def _rows_unchecked(engine: Engine, why: str) -> None:
    log_event(
        log,
        logging.WARNING,
        "rows_unchecked",
        f"model {engine.model_path}: {why}: whether each row's outputs depend on its own "
        "inputs alone was not checked; if they do not, an answer depends on the "
        "requests batched with it (where the first axis is one of independent rows, "
        "--max-batch-size 1 runs each row alone: a request in runs of one row)",
        model=engine.model_path,
    )


def _warn_fixed_rows(engine: Engine, asked: int, max_batch_size: int) -> None:
    """Tells of a fixed first axis (once its rows are known independent): what it costs,
    and a cap asked above it, lowered."""
    fixed = engine.fixed_rows
    lowered = (
        f" (the batch cap asked, {asked}, lowered to {fixed})" if asked > max_batch_size else ""
    )
    named = inputs_named(engine.fixed_row_inputs)
    dynamic = [spec.name for spec in engine.inputs if spec.name not in engine.fixed_row_inputs]
    if dynamic:
        # A [1, D] input beside [N, D] rows (a "config"): "its inputs' first axis"
        # named neither, and "export it with a dynamic first axis" read as done.
        fixes = (
            f"the first axis of {named} at {fixed} row(s) (that of {inputs_named(dynamic)} "
            "is dynamic)"
        )
        remedy = (
            f"for requests to batch together, export {named} with a dynamic first axis too "
            "(laneserve cuts every input along its first axis, so a request sends as many "
            f"rows of each as of {inputs_named(dynamic)})"
        )
    else:
        fixes = f"its inputs' first axis ({named}) at {fixed} row(s)"
        remedy = (
            "for requests to batch together, export it with a dynamic first axis "
            "(torch.onnx.export's dynamic_axes or dynamic_shapes)"
        )
    log_event(
        log,
        logging.WARNING,
        "fixed_batch_axis",
        f"model {engine.model_path} fixes {fixes}: every run holds {fixed}, so no batch "
        f"holds more{lowered} (fewer are padded with copies of their last row, whose "
        f"outputs are dropped); {remedy}",
        model=engine.model_path,
        fixed_rows=fixed,
        fixed_inputs=list(engine.fixed_row_inputs),
        max_batch_size=asked,
    )


def _time_rows(engine: Engine, rows: int, repeats: int) -> float | None:
    """Best run seconds at `rows` rows after one warm-up run, of `repeats` runs or as
    many as PROBE_REPEATS_WITHIN_S holds (at least one); None: out of memory,
    the session's or the host's (MemoryError: building the inputs or copying the
    outputs, on the CPU without a memory limit, where the host's memory ends the
    probe's growth, before `_HostRoom`'s prediction where an address-space limit
    ends it or the host's available memory is unknown: it failed the start with a
    traceback)."""
    best = float("inf")
    try:
        inputs = engine.example_inputs(rows)
        engine.run(inputs)  # warm-up: first runs allocate and pick kernels
        timed_s = 0.0
        for _ in range(repeats):
            started = _timer()
            engine.run(inputs)
            seconds = _timer() - started
            best, timed_s = min(best, seconds), timed_s + seconds
            if timed_s >= PROBE_REPEATS_WITHIN_S:
                break
    except (DeviceMemoryError, MemoryError):
        return None
    return best


def _check_not_stopping(stopping: threading.Event | None) -> None:
    """ProbeStopped where the probe is asked to stop: checked before each size it times."""
    if stopping is not None and stopping.is_set():
        raise ProbeStopped("the start-up probe stopped: a stop was asked while starting")


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    # Best run seconds by batch size.
    run_s: dict[int, float]
    # The largest batch that fits the memory budget (at most the configured maximum, and
    # the rows the lanes queue together); with a fixed cap, that cap.
    batch_cap: int
    # The smallest size seen to fail with out-of-memory; None if none failed.
    first_failing_rows: int | None
    # Memory in use after each size ran, and its linear fit (None: no gauge, or too
    # few sizes to fit).
    memory_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    memory_fit: MemoryEstimate | None = None
    # Why the sizes stopped growing.
    stop_reason: ProbeStopReason = "max_batch_size"


class _HostRoom:
    """Whether the host has room for the probe's next size, on the CPU without a memory
    limit. There only the host's memory ends the sizes' growth, and it ends it late:
    max_batch_size 4294967295 (which the config accepts) on the demo model was still
    probing after 114 s (four runs of 65 536 rows took 40 s; 131 072 need ~4.5 GiB),
    and where memory is overcommitted the OOM killer, not a MemoryError, ends it, maybe
    in another process.

    A size's peak is predicted as its rows times the bytes a row took so far: a row's
    inputs and outputs (held during a run, given back after it, so not in the readings)
    plus the growth of memory in use per row from the first size to the last one run
    (the arena keeps what runs needed). Before each larger size the host's available
    memory is read again: what earlier sizes took is no longer in it.

    Under a fixed cap (--batch-cap) it bounds only the sizes timed: the operator chose
    the cap, and it stays; but a start-up that runs every power of two up to it, each
    twice the last, must not take the host's memory (the OOM killer, maybe in another
    process) before anything is served, so the larger sizes go untimed.
    """

    def __init__(
        self,
        available: Callable[[], int | None],
        resident: MemoryGauge,
        *,
        fixed_cap: int | None = None,
    ) -> None:
        self._available = available
        self._resident = resident
        self._fixed_cap = fixed_cap
        self._io_bytes_per_row = 0
        # (rows, memory in use after them) of the first size and of the last one run.
        self._first: tuple[int, int] | None = None
        self._last: tuple[int, int] | None = None

    def ran(self, rows: int, io_bytes_per_row: int | None, used_bytes: int | None) -> None:
        """Size `rows` ran; `io_bytes_per_row`: one row's inputs and outputs, once known;
        `used_bytes`: its gauge's reading since, if the caller took one."""
        if io_bytes_per_row is not None:
            self._io_bytes_per_row = io_bytes_per_row
        if used_bytes is None:
            used_bytes = self._resident.used_bytes()
        if used_bytes is None:
            return
        if self._first is None:
            self._first = (rows, used_bytes)
        else:
            self._last = (rows, used_bytes)

    def row_bytes(self) -> int:
        """The bytes a row is predicted to take at a larger size."""
        if self._first is None or self._last is None:
            return self._io_bytes_per_row
        (first_rows, first_bytes), (last_rows, last_bytes) = self._first, self._last
        growth = max(last_bytes - first_bytes, 0) // (last_rows - first_rows)
        return self._io_bytes_per_row + growth

    def admits(self, rows: int, fits: int) -> bool:
        """Whether size `rows` is predicted to fit HOST_PROBE_SHARE of the available
        memory (`fits`: the last size that ran, the cap if not); logs why not."""
        available_bytes = self._available()
        if available_bytes is None:  # unknown (not Linux): the old growth, until it fails
            return True
        row_bytes = self.row_bytes()
        need_bytes = rows * row_bytes
        if need_bytes <= available_bytes * HOST_PROBE_SHARE:
            return True
        if self._fixed_cap is None:
            stopped = f"stopped at {fits} rows"
            outcome = "set --memory-limit for a cap measured against a budget"
        else:  # the operator's cap: only the sizes timed stop here
            stopped = f"timed sizes up to {fits} rows"
            outcome = (
                f"the batch cap stays --batch-cap {self._fixed_cap}, its larger batches untimed"
            )
        log_event(
            log,
            logging.WARNING,
            "probe_host_memory",
            f"probe: {stopped}: {rows} rows are predicted to need "
            f"{format_bytes(need_bytes)} ({format_bytes(row_bytes)} a row), over "
            f"{HOST_PROBE_SHARE:.0%} of the host's available {format_bytes(available_bytes)}; "
            f"{outcome}",
            rows=rows,
            timed_rows=fits,
            batch_cap=fits if self._fixed_cap is None else self._fixed_cap,
            need_bytes=need_bytes,
            row_bytes=row_bytes,
            available_bytes=available_bytes,
        )
        return False


def _beyond_rounding(mixed: Array, own: Array) -> bool:
    """Whether `mixed` and `own` (one row's outputs from two runs: batched and alone, or
    alone twice) differ by more than the kernels of another batch size may round:
    exactly for all but floats (integers, bools, text), else by more than ROUNDING_RTOL
    (by the float's size) of the row's largest magnitude.
    Relative to the row, not to each value: a value that sums to near 0 keeps the
    rounding of its terms."""
    if mixed.dtype.kind != "f":
        return not np.array_equal(mixed, own)
    a, b = mixed.astype(np.float64), own.astype(np.float64)
    differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    if not differ.any():
        return False
    if not (np.isfinite(a[differ]).all() and np.isfinite(b[differ]).all()):
        return True
    finite = np.abs(np.concatenate([a[np.isfinite(a)], b[np.isfinite(b)]]))
    scale = float(finite.max())
    gap = float(np.abs(a[differ] - b[differ]).max())
    return gap > ROUNDING_RTOL[mixed.dtype.itemsize] * scale


def _random_rows(
    generator: np.random.Generator, dtype: np.dtype[np.generic], shape: tuple[int, ...]
) -> Array:
    """Random values of `dtype`: uniform in [0, 1) for floats, 0 or 1 otherwise (any
    integer input takes them: an index, a token id, a flag), and for text the strings
    "0" or "1" (any string input takes them: a category, a word, a number Cast parses)."""
    if dtype.kind == "f":
        return generator.random(shape).astype(dtype)
    digits = generator.integers(0, 2, shape)
    if dtype.hasobject:
        return np.array(["0", "1"], dtype=object)[digits]
    return digits.astype(dtype)


def held_bytes(array: Array) -> int:
    """The memory `array` holds: its buffer, and for text (an object array) each
    element's str object too, as a string tensor's bytes are its text's."""
    if not array.dtype.hasobject:
        return array.nbytes
    return array.nbytes + sum(map(sys.getsizeof, array.flat))


def _powers_of_two_up_to(limit: int) -> list[int]:
    sizes = [1 << power for power in range(limit.bit_length()) if 1 << power <= limit]
    return sizes if sizes[-1] == limit else [*sizes, limit]
