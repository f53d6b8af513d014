"""The one ONNX Runtime session, and the one place that translates the runtime's errors.

Only this module and `providers` (where the session runs) import onnxruntime.
`Engine.run_batch` is called from one thread at a time (the engine thread); `Engine.run`
is safe from any thread, as the session is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from laneserve.client.tensors import datatype_for_onnx_type, numpy_dtype_for_onnx_type
from laneserve.server.config import DEVICES, ConfigError, Device
from laneserve.server.errors import (
    DeviceMemoryError,
    DrainingError,
    EngineError,
    EngineStartError,
    LaneserveError,
    ModelRunError,
    SessionBrokenError,
    bounded_message,
)
from laneserve.server.items import (
    Array,
    Batch,
    BatchResult,
    RowsWanted,
    Signature,
)
from laneserve.server.log_events import log_event
from laneserve.server.memory import (
    MemoryEstimate,
    MemoryGauge,
    MemoryLimit,
    ProcessRssGauge,
    estimate_memory,
    format_bytes,
    host_available_bytes,
    prefer_pci_order,
)
from laneserve.server.model_identity import (
    find_model_files,
    model_identity,
)
from laneserve.server.providers import (
    CPU,
    CUDA,
    DEFAULT_GPU_MEMORY_LIMIT,
    cap_cpu_arena,
    check_cpu_budget,
    choose_providers,
    cuda_provider_options,
    cuda_unavailable_cause,
    default_intra_op_threads,
    gpu_total_bytes,
    resolve_limit,
)
from laneserve.server.split_runs import IndexArray, Split

if TYPE_CHECKING:  # annotations only: the probe module imports this one
    from laneserve.server.probe import Probe

log = logging.getLogger(__name__)

# A part of a split that failed: its inputs, their positions in the batch, its error.
_FailedPart = tuple[Mapping[str, Array], IndexArray, LaneserveError]

# The model file's static memory estimate from its path (`estimate_memory`'s, the probe's
# shapes given): None when it could not be worked out.
StaticEstimate = Callable[[str], MemoryEstimate | None]


def no_static_estimate(_model_path: str) -> MemoryEstimate | None:
    """The `estimate` of an Engine whose static estimate nothing reads: no caller asks
    its server's GetModel for the figures (0 without it), and it has no CPU budget (one
    is checked against the estimate's weights; with none known nothing is refused).
    Every Engine otherwise runs the estimate's child, ~1 s and a peak of about twice the
    weights: the bench's baselines and raw sweeps paid it for nothing."""
    return None


# Messages of allocation failures: the BFC arena (CPU and CUDA), CUDA itself, and the
# CUDA libraries' own workspaces ("CUBLAS failure 3: CUBLAS_STATUS_ALLOC_FAILED", cuDNN's
# and cuFFT's alike): taken for a model failure, they lowered no cap and a row that
# failed alone was answered ENGINE_FAILURE. cuDNN 9 names its allocation failures
# CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED (4004) and _HOST_ (4003), which
# "_ALLOC_FAILED" does not match. A bare CUDNN_STATUS_INTERNAL_ERROR (cudnnCreate's on a
# full GPU, and on a CUDA/cuDNN/driver version mismatch alike), and
# CUDNN_STATUS_EXECUTION_FAILED, stay model failures: a handle that cannot be made or a
# kernel that failed to run (a bad launch, an illegal address that leaves the context
# broken) is no sure want of memory, and splitting would halve a broken session's
# batches down to rows answered DEVICE_MEMORY (and a start refused as "raise
# --memory-limit", which cannot help).
_OUT_OF_MEMORY = re.compile(
    r"Failed to allocate memory|BFCArena|bfc_arena|out of memory|"
    r"Available memory of \d+ is smaller than requested bytes|"
    r"_ALLOC_FAILED|_ALLOCATION_FAILED|cudaErrorMemoryAllocation",
    re.IGNORECASE,
)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: np.dtype[np.generic]
    # -1 for a dynamic dimension; the first is the row axis.
    shape: tuple[int, ...]
    # Per dimension, its symbolic name in the model (None: fixed or unnamed). Inputs
    # that share a name must agree on its size.
    dim_names: tuple[str | None, ...] = ()
    # On each input's spec alike: the model's initializers a caller could override in ONNX
    # Runtime (graph inputs with a default), which laneserve runs at their defaults. Kept
    # here, not on the Engine, because the front ends hand the codec the input specs
    # alone, and a request that sends one is refused saying so, not "not an input".
    overridable_initializers: tuple[str, ...] = ()


def _check_arguments(model_path: str, device: Device) -> None:
    """Raises EngineStartError for a model path that is not a file, or a device that is
    not one of DEVICES (an embedder's Engine(device="tpu") ran as "auto")."""
    not_a_file = _not_a_file(Path(model_path))
    if not_a_file is not None:
        raise EngineStartError(
            f"cannot load model {model_path!r}: {not_a_file}; expected an ONNX model file"
        )
    if device not in DEVICES:
        raise EngineStartError(f"device: expected one of {DEVICES}, got {device!r}")


def _check_batch_axis_unique(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
    """Refuses a model that names a later axis like a first one (z [N, N], the batch's
    row count wide): batched with other requests, a request's answer took their size,
    and values computed from their inputs."""
    first = {
        spec.dim_names[0]
        for spec in (*inputs, *outputs)
        if spec.dim_names and spec.dim_names[0] is not None
    }
    for role, specs in (("input", inputs), ("output", outputs)):
        for spec in specs:
            for axis, name in enumerate(spec.dim_names[1:], start=1):
                if name is not None and name in first:
                    named = [
                        dim if dim is not None else size
                        for dim, size in zip(spec.dim_names, spec.shape, strict=True)
                    ]
                    raise EngineStartError(
                        f"model {role} {spec.name!r} has shape {named}: its axis {axis} is "
                        f"{name!r}, a first axis, along which laneserve batches requests, "
                        "so a request's answer would depend on the requests batched with "
                        "it; expected sizes after the first axis that do not follow it"
                    )


def _fixed_rows(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> int | None:
    """The rows every run must hold where the model fixes its inputs' first axis (an export
    without a dynamic batch axis, at 1 most often); None where every input's is dynamic.
    Refuses (EngineStartError) first axes that cannot be read as rows: fixed at different
    sizes or at 0, or an output's fixed at another size than the inputs' (or at all, of
    a model whose inputs' are dynamic): answers are cut from outputs by row."""
    fixed = {spec.name: spec.shape[0] for spec in inputs if spec.shape[0] >= 0}
    sizes = set(fixed.values())
    if len(sizes) > 1:
        raise EngineStartError(
            f"model inputs' first axes are fixed at different sizes {fixed}: laneserve "
            "batches requests along the first axis; expected one size for every input's "
            "first axis, or dynamic ones (a symbolic or -1 dimension)"
        )
    rows = sizes.pop() if sizes else None
    if rows == 0:
        raise EngineStartError(
            f"model inputs' first axes are fixed at 0 {fixed}: laneserve batches requests "
            "along the first axis; expected a dynamic first axis (a symbolic or -1 "
            "dimension) or a fixed one of at least 1 row"
        )
    for spec in outputs:
        if spec.shape[0] >= 0 and spec.shape[0] != rows:
            inputs_axis = (
                "dynamic" if rows is None else f"fixed at {rows} ({inputs_named(list(fixed))})"
            )
            raise EngineStartError(
                f"model output {spec.name!r} has shape {list(spec.shape)}, its first axis "
                f"fixed at {spec.shape[0]} where the inputs' is {inputs_axis}: laneserve "
                "cuts answers from the outputs along the first axis; expected one output "
                "row per input row (a first axis like the inputs')"
            )
    return rows


def inputs_named(names: Sequence[str]) -> str:
    """The inputs `names` in a message: "input 'cfg'", "inputs 'a', 'b'"."""
    return f"input{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))}"


def _rows_dynamic(specs: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
    """`specs` with the first axis dynamic: requests may hold any number of rows."""
    return tuple(dataclasses.replace(spec, shape=(-1, *spec.shape[1:])) for spec in specs)


def _not_a_file(path: Path) -> str | None:
    """What is at `path` when it is not a regular file this process can read; None when
    it is. Checked before the runtime reads it: it takes a directory for a model that
    fails to parse (INVALID_PROTOBUF), which names the content, not the path, and an
    unreadable file came out as its "system error number 13" after the static estimate's
    child had started and warned twice."""
    if path.is_file():
        try:
            with path.open("rb"):
                return None
        except OSError as error:
            return error.strerror or str(error)
    if path.is_dir():
        return "is a directory"
    return "is not a regular file" if path.exists() else "no such file"


class Engine:
    def __init__(
        self,
        model_path: str,
        *,
        device: Device = "auto",
        intra_op_threads: int = 0,
        memory_limit: MemoryLimit | None = None,
        probe_shapes: Mapping[str, tuple[int, ...]] | None = None,
        estimate: StaticEstimate | None = None,
    ) -> None:
        """`probe_shapes`: input name -> its shape after the row axis for the inputs the
        start-up probe (and the broken-session check) runs; else dynamic sizes are 1.
        `estimate`: the model file's static memory estimate (by default `estimate_memory`
        with `probe_shapes`, from a child process, ~1 s; tests that build many engines
        pass one computed once, callers that never read it `no_static_estimate`)."""
        _check_arguments(model_path, device)
        probe_shapes = probe_shapes or {}
        self.model_path = model_path
        if device != "cpu":
            prefer_pci_order()  # before anything initialises CUDA
        requested = choose_providers(device)
        # The model file's static memory estimate (None: it could not be worked out; it
        # is not tried again), before any session is made: its child parses the whole
        # model, file and message (584 MiB at its peak for 272 MiB of weights), and made
        # beside a session that held the weights already, server and child peaked at
        # 927 MiB, 657 with the estimate first. A CPU budget is checked against it.
        self.static_estimate = (
            estimate_memory(model_path, probe_shapes=probe_shapes)
            if estimate is None
            else estimate(model_path)
        )
        # The model's files as found before the session reads them: hashed after it has
        # (its read warmed the page cache; the hash's CPU time, ~0.7-0.9 s a GiB as
        # measured here, is still the start's), they are checked to be the same files (if
        # not, the hash is left empty, warned about: the session loaded fine, so the
        # server serves).
        files = find_model_files(model_path)
        # The hard limit on the session's device memory; None: the runtime's default.
        self.memory_limit_bytes: int | None
        self._session, self.memory_limit_bytes = self._open_session(
            requested, memory_limit, intra_op_threads
        )
        self.providers: list[str] = list(self._session.get_providers())
        if requested[0] == CUDA and CUDA not in self.providers:
            self._fall_back_to_cpu(device, requested, memory_limit, intra_op_threads)
        self.identity = model_identity(model_path, files, self._session.get_modelmeta())
        on_gpu = self.providers[0] == CUDA
        memory_limit_bytes = self.memory_limit_bytes
        inputs = self._input_specs(model_path)
        outputs = tuple(self._spec(arg, "output") for arg in self._session.get_outputs())
        # Rows every run holds where the model fixes its first axis (None: dynamic). The
        # specs then read that axis as dynamic: a request has any number of rows, which
        # runs of exactly that many take (`run`).
        self.fixed_rows = _fixed_rows(inputs, outputs)
        # The inputs whose first axis the model fixes (at `fixed_rows`): all of them, or
        # some beside dynamic ones (a cfg [1, 3] beside x [N, 3]), which the warnings name.
        self.fixed_row_inputs = tuple(spec.name for spec in inputs if spec.shape[0] >= 0)
        # Graph inputs with an initializer as their default: ONNX Runtime lists them apart
        # from the inputs (`get_inputs` leaves them out), and a run may pass any value for
        # them. laneserve passes none: rows of one batch would have to share a value, a
        # part of the batch's signature every front end would have to carry.
        # By name, their shapes (for the start's line, `_log_overridable_initializers`).
        self._overridable_shapes = {
            arg.name: list(arg.shape) for arg in self._session.get_overridable_initializers()
        }
        self.overridable_initializers = tuple(self._overridable_shapes)
        inputs = tuple(
            dataclasses.replace(spec, overridable_initializers=self.overridable_initializers)
            for spec in inputs
        )
        self.inputs = _rows_dynamic(inputs)
        self.outputs = _rows_dynamic(outputs)
        _check_batch_axis_unique(self.inputs, self.outputs)
        self.output_names = [spec.name for spec in self.outputs]
        self._probe_shapes = self._check_probe_shapes(probe_shapes)
        # After an allocation failure the arena keeps the regions the failed run grew;
        # it is asked to shrink back at once (`_shrink_arena`), so a batch that fitted
        # before the failure fits after it.
        self._arena = "gpu:0" if self.providers[0] == CUDA else "cpu:0"
        # On the CPU under a budget the outputs `session.run` returns are views of the
        # runtime's buffers in the capped arena (their base is a PyCapsule), and the
        # scheduler holds a batch's until its answers are written, while the next batch
        # runs: held, they made every 512-row batch of the demo model after the first run
        # out of memory under 32 MiB. They are copied out. On a GPU the outputs reach
        # Python in host memory, outside the device arena the budget caps; without a
        # budget nothing is capped: no copy there.
        self._copies_outputs = not on_gpu and memory_limit_bytes is not None
        # The arena grows regions of the sizes runs ask for (kSameAsRequested) and keeps
        # them, and a larger run cannot use the smaller regions earlier runs left: under
        # 32 MiB the demo model ran 512 rows, then ran out of memory at 544 (750 fit a
        # shrunk arena). So under a budget the arena shrinks before a run larger, in
        # input bytes or in rows, than any since it last shrank: each larger size of the
        # probe, a cap raised at run time. Rows too: with a dynamic width, a batch of
        # more, narrower rows (fewer input bytes, more activations) ran among a wide
        # batch's regions and ran out of memory, though it fitted a shrunk arena.
        # `_arena_run` is that largest run since the arena last shrank, (bytes, rows):
        # None when none has run since; (0, 0) when none has run yet, and the arena has
        # not shrunk either. Still, memory need is not monotonic in input bytes and rows
        # (a dynamic width): under 18 MiB one row of width 2 048 ran out of memory after
        # four rows of width 512 (equal bytes, fewer rows), though it had just run alone,
        # and was answered DEVICE_MEMORY; two rows of width 1 400 after eight of 512 were
        # split, and the batch cap fell from 8 to 1 for everyone. So a run out of memory
        # with another run since the last shrink runs once more after the shrink that
        # follows the failure, and only that run counts (see `run`). Runs on two threads
        # at once could race on `_arena_run`: one shrink or retry too many or too few.
        self._shrinks_before_growth = memory_limit_bytes is not None
        self._arena_run: tuple[int, int] | None = (0, 0)
        self._shrink_failure_logged = False  # `_shrink_failed` logs the first failure
        # The options of the run in progress, so that `terminate_runs` can end it: a
        # process that exits while the runtime is inside a run aborts (SIGABRT).
        self._lock = threading.Lock()
        self._running: ort.RunOptions | None = None
        # `_claimed`: set by the LaneServer it serves (`claim`), cleared when that server's
        # start fails (`release_claim`): a server's stop ends the engine's runs for good
        # (`_terminated`, `terminate_runs`): it serves one.
        self._terminated = self._claimed = False
        # The last batch failed and nothing showed the session sound since: none of its
        # runs succeeded, and it ran no start-up input (`_session_broken`). Only the engine
        # thread (`run_batch`) reads and sets it.
        self._last_batch_failed = False
        limit = "none" if memory_limit_bytes is None else format_bytes(memory_limit_bytes)
        log_event(
            log,
            logging.INFO,
            "session_ready",
            f"session ready: model={model_path} providers={self.providers} memory_limit={limit}",
            model=model_path,
            providers=list(self.providers),
            memory_limit_bytes=memory_limit_bytes,
        )
        if self.overridable_initializers:
            self._log_overridable_initializers()

    def _log_overridable_initializers(self) -> None:
        """Says at start which initializers the model lets callers override: nothing else
        shows them (GetModel and ModelMetadata list the inputs), and a caller who sends
        one is refused (`codec.extra_inputs`)."""
        log_event(
            log,
            logging.INFO,
            "overridable_initializers",
            f"model {self.model_path} lets callers override initializer(s) "
            f"{self._overridable_shapes} (graph inputs with a default): laneserve always "
            "runs them at their defaults and takes no inputs of those names",
            model=self.model_path,
            initializers=list(self.overridable_initializers),
        )

    def _open_session(
        self,
        requested: Sequence[str],
        memory_limit: MemoryLimit | None,
        intra_op_threads: int,
    ) -> tuple[ort.InferenceSession, int | None]:
        """A session asking for the `requested` providers, and its memory limit in bytes
        (None: the runtime's default; on a GPU DEFAULT_GPU_MEMORY_LIMIT when none is
        given). Under a CPU budget the model's weights (`static_estimate`'s) are checked
        against it first and the process-wide CPU arena is capped at it."""
        on_gpu = requested[0] == CUDA
        if memory_limit is None and on_gpu:
            memory_limit = DEFAULT_GPU_MEMORY_LIMIT
        limit_bytes = (
            None
            if memory_limit is None
            else resolve_limit(
                memory_limit,
                gpu_total_bytes() if on_gpu else ProcessRssGauge().total_bytes(),
            )
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads or default_intra_op_threads(on_gpu=on_gpu)
        # The scheduler runs one batch at a time: no inter-op pool is needed.
        options.inter_op_num_threads = 1
        # Idle intra-op threads sleep instead of spinning: the event loop and the
        # scheduler need those cores between runs (measured on 2 cores: a spinning
        # pool burned 0.4 of a core and made runs 3x slower under load).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # 4 = fatal only: every runtime error is translated, and logged once, by us.
        options.log_severity_level = 4
        providers: list[str | tuple[str, dict[str, str]]] = list(requested)
        if limit_bytes is not None:
            if on_gpu:
                providers[0] = (CUDA, cuda_provider_options(limit_bytes))
            else:
                check_cpu_budget(self.static_estimate, limit_bytes)
                cap_cpu_arena(limit_bytes)
                options.add_session_config_entry("session.use_env_allocators", "1")
        # What the runtime's Python constructor prints when CUDA's provider raised and it
        # built the session on the CPU instead ("EP Error ...": a busy or full GPU, a
        # driver error): on stdout, where no caller reads it. Caught only where CUDA is
        # asked for, and written on afterwards: sys.stdout is the process's, and an
        # embedding application's prints meanwhile are its own.
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed) if on_gpu else contextlib.nullcontext():
                session = ort.InferenceSession(self.model_path, options, providers=providers)
        except Exception as error:
            raise EngineStartError(
                f"cannot load model {self.model_path!r}: {error}; expected an ONNX model "
                f"file that this onnxruntime can run{_load_hint(str(error))}"
            ) from error
        finally:
            self._runtime_printed = printed.getvalue().strip()
            if self._runtime_printed:
                sys.stdout.write(printed.getvalue())
        return session, limit_bytes

    def _fall_back_to_cpu(
        self,
        device: Device,
        requested: Sequence[str],
        memory_limit: MemoryLimit | None,
        intra_op_threads: int,
    ) -> None:
        """The runtime built the session without CUDA although NVML sees a GPU (its CUDA
        provider did not load: a CUDA or cuDNN library missing, a driver too old). It
        says so only on stderr, and the session ran on the CPU under a limit worked out
        from the GPU's memory (72 GiB of an 80 GiB GPU), which capped nothing, while the
        probe skipped the host-memory guard it keeps for the CPU without a limit. With
        --device cuda that is refused; with auto the engine becomes a CPU engine, warned
        about: the session is made again as on the CPU, so a limit given applies to the
        CPU arena (a fraction to the host's memory), and none is taken from the GPU."""
        cause = (
            f"onnxruntime fell back itself, saying {self._runtime_printed[:500]!r}"
            if "EP Error" in self._runtime_printed
            else cuda_unavailable_cause()
        )
        if device == "cuda":
            raise EngineStartError(
                f"--device cuda: the session fell back to {self.providers}: {cause}; "
                "expected the GPU usable by onnxruntime, or --device auto / cpu to run on "
                "the CPU"
            )
        log_event(
            log,
            logging.WARNING,
            "cuda_unavailable",
            f"CUDA unavailable: asked onnxruntime for {list(requested)} (NVML sees a GPU), "
            f"got {self.providers}: {cause}; serving on the CPU, with the CPU's memory "
            "limits (--device cuda refuses to start instead)",
            requested=list(requested),
            providers=list(self.providers),
            cause=cause,
        )
        # Let go of the first session before the second loads: both held the model (a
        # 400 MiB model's start peaked 400 MiB higher, on hosts sized for one copy).
        del self._session
        self._session, self.memory_limit_bytes = self._open_session(
            [CPU], memory_limit, intra_op_threads
        )
        self.providers = list(self._session.get_providers())

    def _input_specs(self, model_path: str) -> tuple[TensorSpec, ...]:
        """The specs of the model's inputs; EngineStartError when it has none. Checked
        before the outputs: a model with no inputs has no rows to batch along, whatever
        its outputs declare (and a run counts a batch's rows on its first input)."""
        inputs = tuple(self._spec(arg, "input") for arg in self._session.get_inputs())
        if not inputs:
            raise EngineStartError(
                f"model {model_path!r} has no inputs: laneserve batches requests along the "
                "inputs' first axis; expected at least one input whose first axis is the "
                "batch (rows) axis, e.g. ['N', ...]"
            )
        return inputs

    @staticmethod
    def _spec(arg: ort.NodeArg, role: str) -> TensorSpec:
        """The spec of model input or output (`role`) `arg`, if laneserve can serve it."""
        try:
            datatype_for_onnx_type(arg.type)  # says which types the wire carries
        except ValueError as error:
            # scikit-learn classifiers converted by skl2onnx give their probabilities as
            # a sequence of maps (ZipMap) unless told otherwise.
            hint = (
                "; a scikit-learn model converted by skl2onnx gives tensors with "
                "options={id(model): {'zipmap': False}}"
                if arg.type.startswith(("seq(", "map("))
                else ""
            )
            raise EngineStartError(f"model {role} {arg.name!r}: {error}{hint}") from None
        dtype = numpy_dtype_for_onnx_type(arg.type)
        assert dtype is not None
        # ONNX Runtime gives [] (None in some versions) for a shape the model never
        # declares as for a scalar's: which one it was, it cannot say.
        dims = arg.shape or []
        if not dims:
            raise EngineStartError(
                f"model {role} {arg.name!r} declares no shape (or a scalar one, which ONNX "
                "Runtime reads alike): laneserve batches along the first axis; expected a "
                "shape whose first axis is dynamic (a symbolic or -1 dimension), e.g. ['N', ...]"
            )
        shape = tuple(dim if isinstance(dim, int) and dim >= 0 else -1 for dim in dims)
        names = tuple(dim if isinstance(dim, str) and dim else None for dim in dims)
        return TensorSpec(arg.name, dtype, shape, names)

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        """The outputs of `inputs`' rows; runtime errors come out as LaneserveError. One
        session run (`_run_whole`), or, where the model fixes its first axis
        (`fixed_rows`), runs of exactly that many rows: rows past it run in runs of their
        own, and a run of fewer is padded with copies of its last row, whose outputs are
        dropped. Copies, not zeros: a run whose padding fails is a run whose own row
        fails (an input the model refuses, out of memory at its size), so the split that
        looks for failing rows (`run_batch`) finds real ones, and a zero no caller sent
        (a token id, an index) never reaches the model."""
        fixed = self.fixed_rows
        rows = len(next(iter(inputs.values())))
        if fixed is None or rows in (0, fixed):
            return self._run_whole(inputs)
        parts = []
        for start in range(0, rows, fixed):
            taken = min(fixed, rows - start)
            chunk = {name: array[start : start + taken] for name, array in inputs.items()}
            if taken < fixed:
                chunk = {
                    name: np.concatenate([array, np.repeat(array[-1:], fixed - taken, axis=0)])
                    for name, array in chunk.items()
                }
            outputs = self._run_whole(chunk)
            parts.append({name: value[:taken] for name, value in outputs.items()})
        return {name: _concat([part[name] for part in parts]) for name in self.output_names}

    def _run_whole(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        """One session run over whole arrays; runtime errors come out as LaneserveError.

        Out of memory with another run in the arena since it last shrank, it runs once
        more after the shrink that follows the failure, and only that run counts: its
        error, or its outputs (a batch that fits is then no failure, for the split and
        for the cap alike). On the normal path nothing is added: no shrink, no retry."""
        # Buffers' bytes (a string tensor's: its pointers), not `probe.held_bytes`: walking
        # each string's object took 83 ms a million elements, on every run.
        size = (sum(array.nbytes for array in inputs.values()), len(next(iter(inputs.values()))))
        largest = self._arena_run
        if (
            self._shrinks_before_growth
            and largest is not None
            and largest[0] > 0
            and (size[0] > largest[0] or size[1] > largest[1])
        ):
            self._shrink_arena()
        fresh = self._arena_run is None
        try:
            values = self._run_once(inputs, size)
        except DeviceMemoryError as error:
            if fresh:
                raise
            log_event(
                log,
                logging.DEBUG,
                "arena_fragmented",
                f"out of memory among earlier runs' regions ({size[1]} rows, {size[0]} input "
                f"bytes): running again in the arena shrunk after it ({error.message})",
                rows=size[1],
                input_bytes=size[0],
            )
            values = self._run_once(inputs, size)
        rows = size[1]
        for name, value in zip(self.output_names, values, strict=True):
            # Answers are cut from the outputs by row position: an output of another
            # length would hand callers each other's rows.
            if value.shape[:1] != (rows,):
                raise EngineError(
                    f"model output {name!r} has shape {list(value.shape)} for {rows} input "
                    "row(s); expected one output row per input row (laneserve batches "
                    "requests along the first axis)"
                )
        if self._copies_outputs:
            values = [np.array(value, copy=True) for value in values]
        return dict(zip(self.output_names, values, strict=True))

    def _run_once(self, inputs: Mapping[str, Array], size: tuple[int, int]) -> list[Array]:
        """One session run of `inputs` (`size`: input bytes, rows), its error translated;
        out of memory, the arena is shrunk before the error is raised."""
        largest = self._arena_run or (0, 0)
        self._arena_run = (max(largest[0], size[0]), max(largest[1], size[1]))
        try:
            return self._run_session(inputs, ort.RunOptions())
        except Exception as error:
            if self._terminated:  # `terminate_runs`: the server stopped it, not the model
                raise DrainingError(
                    "the server stopped while this batch ran; it was ended unfinished"
                ) from error
            translated = translate_runtime_error(error)
            if isinstance(translated, DeviceMemoryError):
                self._shrink_arena()
            raise translated from error

    def _run_session(self, inputs: Mapping[str, Array], options: ort.RunOptions) -> list[Array]:
        """The runtime's run, registered with `terminate_runs` while it lasts."""
        with self._lock:
            options.terminate = self._terminated
            self._running = options
        try:
            values: list[Array] = self._session.run(self.output_names, dict(inputs), options)
        finally:
            with self._lock:
                self._running = None
        return values

    def release_idle_memory(self) -> None:
        """Gives back the arena's regions no run uses (with none running): a burst of
        large batches grew regions the arena keeps, and resident memory never fell back
        below the watermark's low mark."""
        self._shrink_arena()

    def _shrink_arena(self) -> None:
        """Has the arena give back every region with nothing in use, now.

        The runtime shrinks at the end of a run that asks it to, failed or not, while
        that run's outputs are held. Asked on the next real run (as it was), the shrink
        came after that run, which ran among the failed run's regions: under 32 MiB the
        demo model ran out of memory at 1 024 rows, then at 640, which fits a shrunk
        arena (as 750 do). A run of zero rows allocates nothing and keeps no output, so
        it carries the request alone (where the first axis is fixed, a run of its F rows,
        which allocates them: zero rows failed the runtime's input check).
        It failing (a model that cannot run zero rows) does not matter: the runtime
        shrinks after a failed run too.
        """
        self._arena_run = None
        options = ort.RunOptions()
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", self._arena)
        # A fixed first axis takes its F rows alone: zero rows failed the runtime's input
        # check, before it read the shrink asked for (nothing ever shrank).
        rows = self.fixed_rows or 0
        try:
            self._run_session(self.example_inputs(rows), options)
        except Exception as error:  # noqa: BLE001 - the shrink is done either way (see above)
            self._shrink_failed(error)

    def _shrink_failed(self, error: Exception) -> None:
        """Logs the first failed shrink run: a model that cannot run zero rows is no
        harm, but a failure before the run ("Did not find an arena based allocator
        registered for device-id combination in the memory arena shrink list", for a
        name the runtime does not know) shrinks nothing, and swallowed it left a GPU
        whose arena never gave back what a burst took, with no line saying so."""
        if self._shrink_failure_logged or self._terminated:  # the server stopped it
            return
        self._shrink_failure_logged = True
        log_event(
            log,
            logging.WARNING,
            "arena_shrink_failed",
            f"the run that shrinks the {self._arena} arena failed (logged once): "
            f"{_runtime_words(str(error))}; if the model cannot run zero rows the arena shrank "
            "anyway, else it keeps the regions runs grew",
            arena=self._arena,
            error=_runtime_words(str(error)),
        )

    def check_free(self) -> None:
        """Raises RuntimeError, saying why, when this engine cannot serve a new LaneServer:
        one serves on it (a server's stop ends its runs for good: another server on it was
        left SERVING and answering every request DRAINING), or one stopped on it."""
        with self._lock:
            self._check_free()

    def claim(self) -> None:
        """Taken by the LaneServer it is to serve, once that server is made (`check_free`
        says why not); `release_claim` when its start fails: it served nothing."""
        with self._lock:
            self._check_free()
            self._claimed = True

    def release_claim(self) -> None:
        with self._lock:
            self._claimed = False

    def _check_free(self) -> None:
        expected = "expected a new Engine for each LaneServer"
        if self._terminated:
            raise RuntimeError(
                "LaneServer(engine): this Engine served a LaneServer that stopped (a stop "
                f"ends its runs for good); {expected}"
            )
        if self._claimed:
            raise RuntimeError(
                f"LaneServer(engine): this Engine serves another LaneServer; {expected}"
            )

    def terminate_runs(self) -> None:
        """Ends the run in progress, and every later one, with an error (the server stops
        and has answered their requests already)."""
        with self._lock:
            self._terminated = True
            if self._running is not None:
                self._running.terminate = True

    def run_batch(self, batch: Batch, rows_wanted: RowsWanted | None = None) -> BatchResult:
        """Concatenates the batch's rows and runs them once; out of memory, in halves.

        A run that fails is split in two and each half retried, down to single rows:
        only the rows that fail alone fail, each request with the error of its row
        (DEVICE_MEMORY for a row that does not fit, ENGINE_FAILURE for one the model
        fails on); every other request in the batch is answered. One bad input no longer
        takes the requests batched with it down. Each retry is a new execution, so
        before it `rows_wanted` (the scheduler's view at that moment) says which rows
        still have a caller waiting within its deadline: the others are not run again.
        A run out of memory among earlier runs' regions that fits once the arena shrank
        is no failure (see `run`): the batch is not split. That second run is the same
        execution's, whole, without asking `rows_wanted`: rows whose callers left during
        the failed run run once more (rare: a fragmented arena; asking, and splitting off
        the rows no longer wanted, would count the failure against the cap).
        """
        inputs = {name: _concat(parts) for name, parts in batch.parts.items()}
        started = time.perf_counter()
        try:
            outputs = self.run(inputs)
        except DrainingError as error:  # no part of it would run either
            return BatchResult(batch, None, error, time.perf_counter() - started)
        except LaneserveError as error:
            split = Split(batch, rows_wanted, self.memory_limit_bytes)
            self._retry_in_halves(inputs, np.arange(batch.rows), error, split)
            self._last_batch_failed = split.outputs is None and not split.session_ok
            return BatchResult(
                batch,
                split.outputs,
                None,
                time.perf_counter() - started,
                failed_rows=split.failed_rows(),
                out_of_memory_runs=split.out_of_memory_runs(),
                split=True,
            )
        self._last_batch_failed = False
        return BatchResult(batch, outputs, None, time.perf_counter() - started)

    def _retry_in_halves(
        self,
        inputs: Mapping[str, Array],
        positions: IndexArray,
        error: LaneserveError,
        split: Split,
    ) -> None:
        """After `inputs` (the batch's rows at `positions`) failed with `error`: runs each
        half's rows still wanted (asked just before it runs), splits again a half that
        fails, and records every row's outcome in `split`. A single row fails alone.
        When both halves fail with an error other than out of memory, or a batch of one
        row does after the batch before it failed too, the failure may be no row's (a
        broken session): see `_session_broken`; its rows then fail with
        SessionBrokenError, which stops the server. Rows the server's stop ended
        (DrainingError, `terminate_runs`) fail with it, as a batch it ends whole does:
        every later run would end so, and it says nothing of the rows or the session.
        Each run out of memory here ran in a shrunk arena (or ran again in one: see
        `run`), so a single row that fails does not fit alone, whatever ran before it."""
        if isinstance(error, DrainingError):
            split.fail(positions, error)
            return
        out_of_memory = isinstance(error, DeviceMemoryError)
        if out_of_memory:
            split.ran_out_of_memory(positions)
        if len(positions) == 1:
            # A batch of one row has no halves: a server serving a row at a time (an
            # interactive lane at low load) on a broken session answered every call
            # ENGINE_FAILURE behind SERVING, never running the start-up input. It runs
            # only when the batch before failed too: a broken session fails every batch
            # (seen one answer later), and run after each failed row it doubled the work
            # of a model that fails many single rows (max_batch_size 1, low load).
            if (
                split.rows == 1
                and not out_of_memory
                and self._last_batch_failed
                and self._session_broken(split)
            ):
                split.fail(positions, _session_broken_error("this request's row", error))
            else:
                split.fail_alone(positions, error)
        else:
            failures = self._run_halves(inputs, positions, split)
            both_failed = len(failures) == 2 and not any(  # noqa: PLR2004 - two halves
                isinstance(failure, DeviceMemoryError | DrainingError) for _, _, failure in failures
            )
            broken = both_failed and self._session_broken(split)
            for failed_inputs, failed_positions, failure in failures:
                if broken:
                    split.fail(
                        failed_positions,
                        _session_broken_error(
                            "the batch holding this request, on both halves of it", failure
                        ),
                    )
                else:
                    self._retry_in_halves(failed_inputs, failed_positions, failure, split)

    def _run_halves(
        self, inputs: Mapping[str, Array], positions: IndexArray, split: Split
    ) -> list[_FailedPart]:
        """Runs each half of the rows still wanted, in turn; the halves that failed."""
        half = len(positions) // 2
        failures: list[_FailedPart] = []
        for part in (slice(0, half), slice(half, None)):
            part_inputs, part_positions = split.still_wanted(
                {name: array[part] for name, array in inputs.items()}, positions[part]
            )
            if len(part_positions) == 0:
                continue
            try:
                split.store(part_positions, self.run(part_inputs))
            except LaneserveError as run_error:
                failures.append((part_inputs, part_positions, run_error))
        return failures

    def _session_broken(self, split: Split) -> bool:
        """Both halves of a run failed, not for want of memory: bad rows in both, or a
        broken session. An input the session ran at start-up (`example_inputs`) tells:
        it failing too means the session is broken, and every row fails at once (four
        runs per batch, not two per row). Checked once per batch: a probe of the batch's
        own rows could hit bad rows and fail good requests with them. A probe out of
        memory tells nothing (the halves are tried again) but is counted, as a run of one
        row that did not fit: it says nothing about batch size. Nor does a probe the
        server's stop ended (DrainingError): every run fails so after `terminate_runs`,
        and a drain was taken for a broken session (the server failed, exit 1)."""
        if split.session_ok:
            return False
        try:
            self.run(self.example_inputs(1))
        except DeviceMemoryError:
            split.ran_out_of_memory(None)
            return False
        except DrainingError:
            return False
        except LaneserveError:
            return True
        split.session_ok = True
        return False

    def _check_probe_shapes(
        self, shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, tuple[int, ...]]:
        """Each input's shape after the row axis for `example_inputs`: the configured one
        (checked against the model), else its fixed sizes with dynamic ones at 1. An input
        the model lacks is the setting's refusal, keyed (`serve` names its flag)."""
        specs = {spec.name: spec for spec in self.inputs}
        unknown = sorted(set(shapes) - set(specs))
        if unknown:
            raise ConfigError(
                f"unknown input(s) {unknown}; the model's inputs are {sorted(specs)}",
                key="server.probe_shapes",
            )
        checked = {}
        for name, spec in specs.items():
            fixed = spec.shape[1:]
            shape = tuple(shapes.get(name, (dim if dim > 0 else 1 for dim in fixed)))
            if len(shape) != len(fixed) or any(
                dim > 0 and dim != size for dim, size in zip(fixed, shape, strict=True)
            ):
                model_shape = ["?" if dim < 0 else dim for dim in fixed]
                # Keyed, as the unknown input's: `serve` names --probe-shape where the
                # flag gave it.
                raise ConfigError(
                    f"input {name!r} given shape {list(shape)} after the row axis; expected "
                    f"one that fits the model's {model_shape}",
                    key="server.probe_shapes",
                )
            checked[name] = shape
        return checked

    @property
    def probe_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each input's shape after the row axis in the rows the probe runs."""
        return dict(self._probe_shapes)

    @property
    def probe_signature(self) -> Signature:
        """The batching signature of `example_inputs` (the rows the probe timed)."""
        return tuple(self._probe_shapes[spec.name] for spec in self.inputs)

    def example_inputs(self, rows: int) -> dict[str, Array]:
        """Zero-filled inputs of `rows` rows, of the shapes in `probe_shapes` (dynamic
        sizes not given there are 1): inputs the start-up probe ran. A string input's
        zero is the text "0" (`zero_value`)."""
        return {
            spec.name: np.full(
                (rows, *self._probe_shapes[spec.name]), zero_value(spec.dtype), dtype=spec.dtype
            )
            for spec in self.inputs
        }

    def probe(
        self,
        max_batch_size: int,
        *,
        repeats: int = 3,
        fixed_cap: bool = False,
        gauge: MemoryGauge | None = None,
        queue_rows: int | None = None,
        host_available: Callable[[], int | None] = host_available_bytes,
        stopping: threading.Event | None = None,
    ) -> Probe:
        """The start-up probe of this engine (`probe.probe_engine` says what it runs and
        finds). A method, as LaneServer calls it: a test's Engine subclass overrides it
        to give the probe memory readings of its own."""
        from laneserve.server.probe import probe_engine  # noqa: PLC0415 - it imports this module

        return probe_engine(
            self,
            max_batch_size,
            repeats=repeats,
            fixed_cap=fixed_cap,
            gauge=gauge,
            queue_rows=queue_rows,
            host_available=host_available,
            stopping=stopping,
        )


def _load_hint(runtime_message: str) -> str:
    """What to do about a load failure whose cause is the machine, not the file. A
    StringNormalizer (in every TfidfVectorizer / CountVectorizer skl2onnx converts) takes
    its `locale` attribute, en_US.UTF-8 unless set, from the machine's locales: a slim
    container has none but C.UTF-8 and POSIX."""
    if "StringNormalizer" not in runtime_message or "locale" not in runtime_message:
        return ""
    return (
        "; a StringNormalizer uses the locale its `locale` attribute names (en_US.UTF-8 "
        "unless set): install that locale on this machine (Debian: the locales package, "
        "locale-gen), or convert the model with one the machine has (`locale -a`; skl2onnx: "
        "options={id(vectorizer): {'locale': 'C.UTF-8'}})"
    )


def zero_value(dtype: np.dtype[np.generic]) -> object:
    """The value inputs are filled with where any will do: zero, or "0" for text (as ONNX
    Runtime runs string tensors, their elements are Python str)."""
    return "0" if dtype.hasobject else 0


def translate_runtime_error(error: Exception) -> LaneserveError:
    message = str(error)
    if _OUT_OF_MEMORY.search(message):
        return DeviceMemoryError(
            f"device memory exhausted while running the batch: {_runtime_words(message)}"
        )
    return ModelRunError(_runtime_words(message))


def _session_broken_error(failed_on: str, error: LaneserveError) -> SessionBrokenError:
    """The error of rows whose failure was the session's: it failed `failed_on` with
    `error`, and an input it ran at start-up too (`Engine._session_broken`)."""
    cause = error.runtime_message if isinstance(error, ModelRunError) else error.message
    return SessionBrokenError(
        f"the model failed on {failed_on}, and on an input it ran at start-up: the session "
        f"is broken ({cause}); the server is stopping and must be restarted",
        cause=cause,
    )


# The most bytes of the runtime's message an error keeps (`_runtime_words`): room for
# ONNX Runtime's usual one whole (~370 for an Add node's failed broadcast), within an
# answer's MAX_MESSAGE_BYTES beside laneserve's own words.
RUNTIME_MESSAGE_BYTES = 600


def _runtime_words(message: str) -> str:
    """The runtime's `message` as an error quotes it: its trailing newline stripped, and
    past RUNTIME_MESSAGE_BYTES cut in the middle, saying so (`bounded_message`). Its
    start is its code and category ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION :
    Non-zero status code returned while running Add node") and its end what failed
    ("... 64 by 70"); between them the runtime's source file and function. Its last 300
    characters alone, as kept before, lost the code, the category and the node's kind
    of a message of ~370."""
    return bounded_message(message.rstrip(), RUNTIME_MESSAGE_BYTES)


def _concat(parts: Sequence[Array]) -> Array:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
