"""The one ONNX Runtime session, and the one place that translates the runtime's errors.

Only this module imports onnxruntime. `Engine.run_batch` is called from one thread at a
time (the engine thread); `Engine.run` is safe from any thread, as the session is.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from laneserve.client.tensors import numpy_dtype_for_onnx_type
from laneserve.server.config import Device
from laneserve.server.errors import DeviceMemoryError, EngineError, LaneserveError
from laneserve.server.items import Array, Batch, BatchResult

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

# Messages of allocation failures: the BFC arena (CPU and CUDA), CUDA itself.
_OUT_OF_MEMORY = re.compile(
    r"Failed to allocate memory|BFCArena|bfc_arena|out of memory|"
    r"Available memory of \d+ is smaller than requested bytes",
    re.IGNORECASE,
)


class EngineStartError(RuntimeError):
    """The model or the requested device cannot be used; raised before serving."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: np.dtype[np.generic]
    # -1 for a dynamic dimension; the first is the row axis.
    shape: tuple[int, ...]


def gpu_present() -> bool:
    """Whether NVML sees at least one GPU (false without a driver)."""
    try:
        import pynvml  # noqa: PLC0415 - optional at run time: absent or driverless machines

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - any NVML failure means: no usable GPU
        return False
    try:
        return int(pynvml.nvmlDeviceGetCount()) > 0
    finally:
        pynvml.nvmlShutdown()


def choose_providers(device: Device) -> list[str]:
    available = ort.get_available_providers()
    if device == "cpu":
        return [CPU]
    cuda_usable = CUDA in available and gpu_present()
    if device == "cuda":
        if not cuda_usable:
            why = "no GPU is visible" if CUDA in available else "this onnxruntime has no CUDA"
            raise EngineStartError(f"--device cuda: {why} (available providers: {available})")
        return [CUDA, CPU]
    # auto: ask for CUDA only where it can work, so no failed CUDA load is printed.
    return [CUDA, CPU] if cuda_usable else [CPU]


class Engine:
    def __init__(
        self,
        model_path: str,
        *,
        device: Device = "auto",
        intra_op_threads: int = 0,
    ) -> None:
        self.model_path = model_path
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        # The scheduler runs one batch at a time: no inter-op pool is needed.
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # errors are translated and reported by us
        requested = choose_providers(device)
        try:
            self._session = ort.InferenceSession(model_path, options, providers=requested)
        except Exception as error:
            raise EngineStartError(f"cannot load model {model_path!r}: {error}") from error
        self.providers: list[str] = list(self._session.get_providers())
        if device == "cuda" and CUDA not in self.providers:
            raise EngineStartError(f"--device cuda: the session fell back to {self.providers}")
        self.inputs = tuple(self._spec(arg) for arg in self._session.get_inputs())
        self.outputs = tuple(self._spec(arg) for arg in self._session.get_outputs())
        self.output_names = [spec.name for spec in self.outputs]
        for spec in self.inputs + self.outputs:
            if not spec.shape or spec.shape[0] != -1:
                raise EngineStartError(
                    f"model {spec.name!r} has shape {list(spec.shape)}: laneserve batches along "
                    f"the first axis, which must be dynamic (a symbolic or -1 dimension)"
                )
        log.info("session ready: model=%s providers=%s", model_path, self.providers)

    @staticmethod
    def _spec(arg: ort.NodeArg) -> TensorSpec:
        dtype = numpy_dtype_for_onnx_type(arg.type)
        if dtype is None:
            raise EngineStartError(f"model tensor {arg.name!r} has unsupported type {arg.type}")
        shape = tuple(dim if isinstance(dim, int) and dim >= 0 else -1 for dim in arg.shape)
        return TensorSpec(arg.name, dtype, shape)

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        """One session run over whole arrays; runtime errors come out as LaneserveError."""
        try:
            values = self._session.run(self.output_names, dict(inputs))
        except Exception as error:
            raise translate_runtime_error(error) from error
        return dict(zip(self.output_names, values, strict=True))

    def run_batch(self, batch: Batch) -> BatchResult:
        """Concatenates the batch's rows, runs them once, times the run."""
        inputs = {name: _concat(parts) for name, parts in batch.parts.items()}
        started = time.perf_counter()
        try:
            outputs = self.run(inputs)
        except LaneserveError as error:
            return BatchResult(batch, None, error, time.perf_counter() - started)
        return BatchResult(batch, outputs, None, time.perf_counter() - started)

    def example_inputs(self, rows: int) -> dict[str, Array]:
        """Zero-filled inputs of `rows` rows (dynamic trailing dimensions become 1)."""
        return {
            spec.name: np.zeros(
                (rows, *(dim if dim > 0 else 1 for dim in spec.shape[1:])), dtype=spec.dtype
            )
            for spec in self.inputs
        }

    def probe(self, max_batch_size: int, *, repeats: int = 3) -> dict[int, float]:
        """Warms the session up and measures run seconds at powers of two up to the cap.

        The best of `repeats` runs is kept: the figure the scheduler plans with is what a
        warm session does, not what a noisy neighbour did once.
        """
        sizes = sorted({min(1 << power, max_batch_size) for power in range(32)} - {0})
        sizes = [size for size in sizes if size <= max_batch_size]
        measured: dict[int, float] = {}
        for rows in sizes:
            inputs = self.example_inputs(rows)
            self.run(inputs)  # warm-up: first runs allocate and pick kernels
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                self.run(inputs)
                best = min(best, time.perf_counter() - started)
            measured[rows] = best
        return measured


def translate_runtime_error(error: Exception) -> LaneserveError:
    message = str(error)
    if _OUT_OF_MEMORY.search(message):
        return DeviceMemoryError(
            f"device memory exhausted while running the batch: {_tail(message)}"
        )
    return EngineError(f"the model failed on this batch: {_tail(message)}")


def _tail(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else "..." + message[-limit:]


def _concat(parts: Sequence[Array]) -> Array:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
