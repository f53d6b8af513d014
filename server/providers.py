"""Where the session runs: the execution providers asked for (CUDA, the CPU), the GPU
NVML sees, and the session's settings that follow from the device: its memory limit in
bytes, the CUDA provider's options, the CPU arena's process-wide cap, the intra-op
threads.

Separate from the engine, which makes the session and runs it: these change with the
machine (a driver, CUDA_VISIBLE_DEVICES, a cgroup, this onnxruntime's build), not with
how batches run. It is the only module besides the engine that imports onnxruntime: for
its providers and its allocator registry, never for a session.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import onnxruntime as ort

from laneserve.server.config import Device
from laneserve.server.errors import EngineStartError
from laneserve.server.memory import (
    MemoryEstimate,
    MemoryLimit,
    NvmlGauge,
    NvmlUnavailableError,
    cgroup_cpu_limit,
    cuda_visible_hides_every_gpu,
    format_bytes,
    session_gpu_id,
)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
DEFAULT_GPU_MEMORY_LIMIT = MemoryLimit(fraction=0.9)


def gpu_present() -> bool:
    """Whether NVML sees at least one GPU (false without a driver)."""
    try:
        import pynvml  # noqa: PLC0415 - optional at run time: absent or driverless machines

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - any NVML failure means: no usable GPU
        return False
    try:
        return int(pynvml.nvmlDeviceGetCount()) > 0
    except Exception:  # noqa: BLE001 - the count's failure too ("Unknown Error" escaped)
        return False
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def open_nvml_gauge() -> NvmlGauge:
    """The session GPU's memory gauge; EngineStartError (exit 2, no traceback) when NVML
    cannot read that GPU."""
    try:
        return NvmlGauge()
    except NvmlUnavailableError as error:
        raise nvml_start_error(error) from error


def gpu_total_bytes() -> int | None:
    """The session GPU's memory, at start; EngineStartError when NVML cannot read it: the
    engine's first reading on a GPU (a limit is a share of it), whose failure escaped as
    a traceback, exit 1."""
    gauge = open_nvml_gauge()
    try:
        return gauge.total_bytes()
    except NvmlUnavailableError as error:
        raise nvml_start_error(error) from error


def nvml_start_error(error: NvmlUnavailableError) -> EngineStartError:
    """Why the server cannot start when NVML cannot open or read the session's GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return EngineStartError(
        f"cannot read the memory of the session's GPU {session_gpu_id()!r} "
        f"(CUDA_VISIBLE_DEVICES={'unset' if visible is None else repr(visible)}): "
        f"{error}; expected nvidia-ml-py installed and CUDA_VISIBLE_DEVICES naming the "
        "GPU by its index or its whole UUID as `nvidia-smi -L` lists it (NVML takes no "
        "shortened UUID), or --device cpu"
    )


def resolve_limit(limit: MemoryLimit, device_total_bytes: int | None) -> int:
    """`limit` in bytes; EngineStartError when it is a fraction of a total unknown."""
    try:
        return limit.resolve(device_total_bytes)
    except ValueError as error:
        raise EngineStartError(
            f"server.memory_limit (--memory-limit; {DEFAULT_GPU_MEMORY_LIMIT.fraction:g} on a "
            f"GPU when unset): {error}"
        ) from error


def choose_providers(device: Device) -> list[str]:
    available = ort.get_available_providers()
    if device == "cpu":
        return [CPU]
    hidden = cuda_visible_hides_every_gpu()
    cuda_usable = CUDA in available and not hidden and gpu_present()
    if device == "cuda":
        if not cuda_usable:
            raise EngineStartError(
                f"--device cuda: {_why_no_cuda(available, hidden=hidden)} (available "
                f"providers: {available}); expected a visible GPU and onnxruntime-gpu, or "
                "--device auto / cpu to run on the CPU"
            )
        return [CUDA, CPU]
    # auto: ask for CUDA only where it can work, so no failed CUDA load is printed (and
    # where CUDA_VISIBLE_DEVICES hides every GPU, NVML's count is not CUDA's).
    return [CUDA, CPU] if cuda_usable else [CPU]


def _why_no_cuda(available: Sequence[str], *, hidden: bool) -> str:
    if CUDA not in available:
        return "this onnxruntime has no CUDA"
    if hidden:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from CUDA"
    return "no GPU is visible"


def default_intra_op_threads(
    *, on_gpu: bool, cpu_limit: Callable[[], float | None] = cgroup_cpu_limit
) -> int:
    """ONNX Runtime's intra-op threads when the configuration says 0 (auto).

    On the CPU the runtime's own default takes every core, but the event loop, gRPC's
    pollers and the scheduler need one between runs: measured on 2 cores, one runtime
    thread served 32-64 single-row callers 30-50 % faster than two (a bulk-only stream
    ran ~20 % slower: README, "Bulk jobs"). The cores are those the process may run on,
    and no more than its cgroup's CPU quota rounds up to (`cpu_limit`, the CPUs it
    allows; None: no quota): a pod limited to 2 CPUs on a 32-core node sees all 32, and
    took 31 threads that only wait for the quota's share. On a GPU the runtime's
    threads only run the few CPU-side kernels: its default stands (0).
    """
    if on_gpu:
        return 0
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere all the cores
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    quota_cpus = cpu_limit()
    if quota_cpus is not None:
        cores = min(cores, math.ceil(quota_cpus))
    return max(1, cores - 1)


def cuda_provider_options(memory_limit_bytes: int) -> dict[str, str]:
    """The CUDA provider's options for a session capped at `memory_limit_bytes`."""
    return {
        "gpu_mem_limit": str(memory_limit_bytes),
        # Near a hard limit, growing by powers of two would fail allocations that fit.
        "arena_extend_strategy": "kSameAsRequested",
        # The default, EXHAUSTIVE, benchmarks every cuDNN convolution algorithm for each
        # new input shape (0.3-1.3 s a shape: onnxruntime issues #709, #6978), and the
        # scheduler forms batches of every size from 1 to the cap: each size's first
        # batch would stall its callers that long. HEURISTIC asks cuDNN's heuristics
        # instead, without running anything.
        "cudnn_conv_algo_search": "HEURISTIC",
    }


def cuda_unavailable_cause() -> str:
    """Why the runtime left its CUDA provider out of a session, as far as Python can
    tell. The runtime prints its own reason on stderr ("Failed to create
    CUDAExecutionProvider"), where no caller reads it; loading the provider's library
    again gives the loader's words for the usual cause, a CUDA or cuDNN library it
    cannot find."""
    needs = (
        f"the CUDA {_built_for()} libraries on the loader's path (LD_LIBRARY_PATH) and "
        "an NVIDIA driver that supports that CUDA"
    )
    library = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    if not library.is_file():
        return f"this onnxruntime's CUDA provider did not start; it needs {needs}"
    try:
        ctypes.CDLL(str(library))
    except OSError as error:
        return f"its CUDA provider library does not load ({error}); it needs {needs}"
    return (
        "its CUDA provider library loads but the provider did not start (onnxruntime's "
        f"reason is on stderr); it needs {needs}"
    )


def _built_for() -> str:
    """The CUDA and cuDNN versions this onnxruntime was built for ("13.0 / cuDNN 9"):
    CUDA's from its build information, cuDNN's major from its wheel's `cudnn` extra."""
    cuda = getattr(ort, "cuda_version", None) or "?"
    cudnn = "?"
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for requirement in importlib.metadata.requires("onnxruntime-gpu") or []:
            found = re.match(r"nvidia-cudnn-cu\d+\s*~=\s*(\d+)", requirement)
            if found is not None:
                cudnn = found.group(1)
    return f"{cuda} / cuDNN {cudnn}"


_CPU_ARENA_LIMIT_BYTES: int | None = None


def check_cpu_budget(estimate: MemoryEstimate | None, limit_bytes: int) -> None:
    """Refuses a CPU budget that cannot hold the model's weights: ONNX Runtime then keeps
    them, and runs every batch, outside the capped arena, so the budget is silently not
    enforced (measured with the demo model's 20.1 MiB of weights: budgets up to 20 MiB
    ran 4 096-row batches, 21 MiB failed at 64 rows). The weights come from the static
    `estimate` (None: unknown, nothing is refused)."""
    if estimate is not None and limit_bytes <= estimate.fixed_bytes:
        weights = format_bytes(estimate.fixed_bytes)
        raise EngineStartError(
            f"memory limit {format_bytes(limit_bytes)} does not hold the model's weights "
            f"({weights}), and ONNX Runtime would run without the cap; expected more than "
            f"{weights}, plus the activations of a batch"
        )


def cap_cpu_arena(limit_bytes: int) -> None:
    """Registers the process-wide CPU arena capped at `limit_bytes` (once per process:
    ONNX Runtime keeps registered allocators for the life of its environment)."""
    global _CPU_ARENA_LIMIT_BYTES  # noqa: PLW0603 - mirrors the runtime's process-wide state
    if _CPU_ARENA_LIMIT_BYTES is not None:
        if limit_bytes != _CPU_ARENA_LIMIT_BYTES:
            raise EngineStartError(
                f"this process's CPU arena is already capped at "
                f"{format_bytes(_CPU_ARENA_LIMIT_BYTES)}; one memory budget per process"
            )
        return
    memory_info = ort.OrtMemoryInfo(
        "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
    )
    # max_mem, arena_extend_strategy (1 = kSameAsRequested), initial chunk, max dead bytes.
    ort.create_and_register_allocator(memory_info, ort.OrtArenaCfg(limit_bytes, 1, -1, -1))
    _CPU_ARENA_LIMIT_BYTES = limit_bytes
