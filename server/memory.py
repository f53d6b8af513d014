"""Device memory: the budget, how to read memory in use, and the watermark policy.

The budget is a hard limit given to the runtime (the CUDA arena's `gpu_mem_limit`, or a
capped CPU arena), so an allocation past it fails inside ONNX Runtime instead of taking
the process down; the engine then splits the batch. The watermark is the soft limit
beside it: above the high watermark lanes stop admitting work, lowest priority first,
until memory in use falls below the low watermark. Its marks are fractions of a limit of
their own, not of the budget: the GPU's total memory (NVML reads the whole device, every
process's use beside the arena), or on the CPU the process's host memory limit (the
arena, queued inputs and outputs all live there).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from laneserve.server.log_events import log_event

log = logging.getLogger(__name__)

# The units a size may take, in any case (1gib, 1GiB), as a refused one lists them: a
# bare k, m, g or t is decimal, as KB is.
_UNIT_NAMES: dict[str, int] = {
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
}
_UNITS = {"": 1} | {name.lower(): factor for name, factor in _UNIT_NAMES.items()}
_UNITS_TEXT = f"no unit (bytes) or one of {', '.join(_UNIT_NAMES)} (any case)"
_KIB = 1024
MAX_MEMORY_LIMIT_BYTES = 1 << 50
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryLimit:
    """Either an absolute number of bytes or a fraction of the device's memory."""

    limit_bytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        assert (self.limit_bytes is None) != (self.fraction is None)

    def resolve(self, device_total_bytes: int | None) -> int:
        if self.limit_bytes is not None:
            return self.limit_bytes
        assert self.fraction is not None
        if device_total_bytes is None:
            raise ValueError(
                f"memory limit {self.fraction:g} is a fraction of device memory, but the "
                f"device's total memory is unknown; give bytes instead, e.g. 6GiB"
            )
        return int(device_total_bytes * self.fraction)


def parse_memory_limit(text: str, *, fraction_ok: bool = True) -> MemoryLimit:
    """`6GiB`, `512MiB`, `2000000000` (bytes) or, with `fraction_ok`, `0.9` (a fraction
    of device memory). The errors offer only the forms accepted: a limit without a
    device to take a fraction of (the host's) was refused with "or a fraction such as
    0.9"."""
    bytes_like = "bytes like 6GiB"
    expected = f"{bytes_like} or a fraction like 0.9" if fraction_ok else bytes_like
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"memory limit {text!r}: expected {expected}")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "" and 0 < number <= 1 and "." in match.group(1):
        if not fraction_ok:
            raise ValueError(f"memory limit {text!r}: expected {bytes_like}, not a fraction")
        return MemoryLimit(fraction=number)
    if unit not in _UNITS:
        raise ValueError(
            f"memory limit {text!r}: unknown unit {match.group(2)!r}; expected {_UNITS_TEXT}"
        )
    limit_bytes = int(number * _UNITS[unit])
    if limit_bytes < 1024 * 1024:
        # Said how it was read: "1.5" is bytes, as a fraction it is out of range.
        fraction = ", or a fraction of device memory in (0, 1] such as 0.9" if fraction_ok else ""
        raise ValueError(
            f"memory limit {text!r} is {limit_bytes} bytes; expected at least 1MiB{fraction}"
        )
    if limit_bytes > MAX_MEMORY_LIMIT_BYTES:  # the runtime takes a 64-bit size
        raise ValueError(f"memory limit {text!r}: expected at most 1024TiB (1 PiB)")
    return MemoryLimit(limit_bytes=limit_bytes)


def format_bytes(count: int) -> str:
    """`count` bytes for people: 512B, 1.5KiB, 32.0MiB, 6.0GiB."""
    if count < _KIB:
        return f"{count}B"
    size, unit = count / _KIB, "KiB"
    for larger in ("MiB", "GiB"):
        if size < _KIB:
            break
        size, unit = size / _KIB, larger
    return f"{size:.1f}{unit}"


def format_bytes_beyond(count: int, *, above: bool) -> str:
    """`count` bytes as format_bytes writes them, rounded away from `count` (up where
    `above`, else down) to the last digit shown and by 2 bytes or more: a bound a message
    names as "above X" or "below X", where the figure printed must lie on the side asked
    for itself. Rounded to nearest, "--memory-limit below 71.5GiB" named a figure above
    the bound (71.49 GiB), and setting it brought the same warning back. The 2 bytes
    cover the float product parse_memory_limit truncates to whole bytes."""
    if count < _KIB:
        return f"{max(count + 2 if above else count - 2, 0)}B"
    unit_bytes, unit = _KIB, "KiB"
    for larger in ("MiB", "GiB"):
        if count < unit_bytes * _KIB:
            break
        unit_bytes, unit = unit_bytes * _KIB, larger
    # In tenths of the unit: the first past count + 2, or the last at or below count - 2.
    tenths = (count + 2) * 10 // unit_bytes + 1 if above else (count - 2) * 10 // unit_bytes
    return f"{tenths / 10:.1f}{unit}"


def share_above(part_bytes: int, whole_bytes: int) -> float:
    """`part_bytes` as a fraction of `whole_bytes`, rounded up to 3 significant digits and
    past it by 2 bytes or more: a watermark set to it (int(limit * mark) bytes, as the
    server takes it) lies above `part_bytes`, so a message's "memory_high_watermark
    above S" holds for S itself. Rounded to nearest, 0.9996 was named "above 1", a mark
    the config refuses, and 0.9564 "above 0.956", below the share."""
    assert part_bytes > 0 < whole_bytes
    decimals = max(2 - math.floor(math.log10(part_bytes / whole_bytes)), 0)
    scale = int(10**decimals)  # decimals >= 0: an int (mypy reads int ** int as Any)
    return ((part_bytes + 2) * scale // whole_bytes + 1) / scale


# ---- reading memory in use -------------------------------------------------------------


class MemoryGauge(Protocol):
    def used_bytes(self) -> int | None:
        """Memory in use now, or None when it cannot be read."""
        ...

    def total_bytes(self) -> int | None:
        """The device's capacity, or None when unknown."""
        ...


def session_gpu(nvml: Any) -> Any:
    """NVML's handle of the GPU the session runs on: CUDA's device 0, which is the first
    GPU CUDA_VISIBLE_DEVICES lists (an index or a UUID), or GPU 0 when it is unset. NVML
    numbers GPUs in PCI bus order; CUDA's indices follow it too where CUDA_DEVICE_ORDER
    is PCI_BUS_ID, which the engine sets unless the environment says otherwise
    (`prefer_pci_order`). Read at NVML's index 0 whatever the variable said, a server
    started with CUDA_VISIBLE_DEVICES=3 took its memory budget and watermark readings
    from another process's GPU."""
    first = session_gpu_id()
    if first.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(first))
    return nvml.nvmlDeviceGetHandleByUUID(first)


def session_gpu_id() -> str:
    """The session's GPU as CUDA_VISIBLE_DEVICES names it (an index or a UUID; "0" when
    it is unset): see `session_gpu`."""
    return _first_visible_entry() or "0"


def _first_visible_entry() -> str | None:
    """CUDA_VISIBLE_DEVICES' first entry, stripped; None where it is unset."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else visible.split(",")[0].strip()


def cuda_visible_hides_every_gpu() -> bool:
    """Whether CUDA_VISIBLE_DEVICES leaves CUDA no GPU: set empty, or its first entry no
    GPU at all: a negative id ("-1", the usual way to hide them all: CUDA reads the list
    up to the first invalid id) or a word that is neither an index nor a GPU-/MIG- UUID
    (SLURM's "NoDevFiles" for a job that asked for none). NVML ignores the variable and
    still counts every GPU: taken for a visible GPU, "-1" refused the start (NVML has no
    GPU '-1') and "" took its memory limit from a GPU that CUDA could not see."""
    first = _first_visible_entry()
    if first is None:
        return False
    return re.fullmatch(r"\d+|(GPU|MIG)-[0-9A-Za-z/-]+", first) is None


def prefer_pci_order() -> None:
    """CUDA numbers GPUs fastest first by default, NVML by PCI bus: on a host of unlike
    GPUs, index 1 in CUDA_VISIBLE_DEVICES was another GPU to each. Called before the
    runtime initialises CUDA; a CUDA_DEVICE_ORDER already set is left as it is."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


class NvmlUnavailableError(RuntimeError):
    """NVML cannot read the session's GPU: pynvml is missing, NVML does not start, or it
    knows no GPU by the id CUDA_VISIBLE_DEVICES gives (`providers.nvml_start_error` turns
    it into an EngineStartError)."""


class NvmlGauge:
    """The session's GPU's memory as NVML reports it: used by every process on the
    device, since a neighbour's allocations leave laneserve less room just as its own
    do. A reading NVML fails raises NvmlUnavailableError: the start is refused naming the
    GPU (see `providers.nvml_start_error`); while serving the scheduler fails and the server
    stops for its supervisor to restart it (a lost device's readings: memory is a hard
    limit, not watched blind)."""

    def __init__(self) -> None:
        """Raises NvmlUnavailableError, saying why, when the GPU cannot be read: CUDA
        takes a UUID's prefix in CUDA_VISIBLE_DEVICES (GPU-8932f937), NVML's look-up by
        UUID only the whole UUID, and its NVMLError_NotFound escaped as a traceback."""
        try:
            import pynvml  # noqa: PLC0415 - only on machines with a GPU
        except ImportError as error:
            raise NvmlUnavailableError(f"cannot import pynvml ({error})") from error
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            raise NvmlUnavailableError(f"NVML did not start ({_nvml_error(error)})") from error
        try:
            self._handle = session_gpu(pynvml)
        except pynvml.NVMLError as error:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
            raise NvmlUnavailableError(
                f"NVML has no GPU {session_gpu_id()!r} ({_nvml_error(error)})"
            ) from error
        self._nvml = pynvml

    def used_bytes(self) -> int | None:
        return int(self._memory_info().used)

    def total_bytes(self) -> int | None:
        return int(self._memory_info().total)

    def _memory_info(self) -> Any:
        try:
            return self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except self._nvml.NVMLError as error:
            raise NvmlUnavailableError(
                f"NVML cannot read the memory of GPU {session_gpu_id()!r} ({_nvml_error(error)})"
            ) from error


def _nvml_error(error: Exception) -> str:
    """NVML's error with its kind: pynvml's messages alone are terse ("Not Found")."""
    return f"{type(error).__name__}: {error}"


class ProcessRssGauge:
    """This process's resident memory: on the CPU the "device" is host memory, and the
    arena, queued inputs and outputs all live in it.

    Fed to a `watermark`, a reading taken while that holds lanes closed, or at or above
    its high mark, first has the C library give back the free heap it keeps
    (`release_free_heap`): glibc keeps what a burst freed resident, and the reading with
    it closed every lane, interactive too, for good (the demo model's server, limit
    150 MiB: 116 MiB idle, 204 MiB 3 s after a burst; given back, 124-132 MiB).
    """

    _PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, watermark: Watermark | None = None) -> None:
        # Read where the watermark is updated (the scheduler thread; at start, before it).
        self._watermark = watermark

    def used_bytes(self) -> int | None:
        used = self._resident_bytes()
        mark = self._watermark
        if (
            used is not None
            and mark is not None
            and (mark.closed > 0 or used >= mark.high_bytes)
            and release_free_heap()
        ):
            used = self._resident_bytes()
        return used

    def _resident_bytes(self) -> int | None:
        try:
            fields = Path("/proc/self/statm").read_text(encoding="ascii").split()
        except OSError:
            return None
        return int(fields[1]) * self._PAGE_BYTES

    def total_bytes(self) -> int | None:
        """The host's memory, or the least memory limit of the process's cgroups where
        that is lower (a container's): what a CPU budget's fraction (--memory-limit 0.5)
        is of. Of the host's alone, a 4 GiB pod on a 256 GiB host capped its arena at
        128 GiB, and the OOM killer came first."""
        physical = int(os.sysconf("SC_PHYS_PAGES") * self._PAGE_BYTES)
        cgroup = cgroup_memory_limit()
        return physical if cgroup is None else min(physical, cgroup.limit_bytes)


def release_free_heap() -> bool:
    """Has the C library give the free heap it keeps back to the system (glibc's
    `malloc_trim(0)`, well under a millisecond); whether it could: not on another system
    or C library, where this does nothing."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], object] | None:
    """glibc's malloc_trim, looked up once; None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):  # musl, or an allocator without it
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


# A cgroup memory limit at or above this is none (v1 writes "no limit" as ~2^63).
_NO_CGROUP_LIMIT_BYTES = 1 << 60


@dataclasses.dataclass(frozen=True, slots=True)
class _CgroupMemoryFiles:
    """Where one cgroup version keeps a cgroup's memory limit and usage."""

    limit: str
    usage: str
    # memory.stat's inactive page cache: counted in the usage, but reclaimed before the
    # OOM killer runs (kubelet's working set leaves it out too). A model file copied in
    # held a container's usage at its limit: no room, and the probe capped at 1 row.
    inactive_file: str
    # memory.stat's effective limit, the least of its own and its ancestors' (v1 only).
    hierarchical_limit: str | None


_CGROUP_V2 = _CgroupMemoryFiles("memory.max", "memory.current", "inactive_file", None)
_CGROUP_V1 = _CgroupMemoryFiles(
    "memory.limit_in_bytes",
    "memory.usage_in_bytes",
    "total_inactive_file",
    "hierarchical_memory_limit",
)


def host_available_bytes(
    proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Memory the host could still give this process: the kernel's MemAvailable, or less
    where a cgroup the process is in leaves less (a container's limit, or a parent's: a
    systemd slice's MemoryMax; v2 or v1); None where neither can be read (not Linux). In
    a container MemAvailable is the whole machine's, and past a cgroup's limit the OOM
    killer ends the process. Neither counts page cache the kernel reclaims first as
    taken (MemAvailable counts it available). `proc` and `cgroups` are where the
    kernel's files are read from (tests give others)."""
    rooms = [_meminfo_available_bytes(proc), _cgroup_room_bytes(proc, cgroups)]
    known = [room for room in rooms if room is not None]
    return min(known) if known else None


def _meminfo_available_bytes(proc: Path) -> int | None:
    try:
        lines = (proc / "meminfo").read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            with contextlib.suppress(ValueError):
                return int(value.split()[0]) * _KIB  # "MemAvailable: 23882396 kB"
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class CgroupMemoryLimit:
    """The least memory limit of the cgroups the process is in, and where it was read."""

    limit_bytes: int
    source: str  # the file (and, for memory.stat, the entry) it was read from


def cgroup_memory_limit(
    proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")
) -> CgroupMemoryLimit | None:
    """The least memory limit of the process's cgroups, its own and each one above it (a
    container's, a pod's, a systemd slice's MemoryMax; v2 or v1): past it the OOM killer
    ends the process. None without one ("max"), or where none can be read (not Linux).
    `proc` and `cgroups` as `host_available_bytes`'s."""
    limits = [
        limit
        for folder, files in _memory_cgroup_folders(proc, cgroups)
        if (limit := _cgroup_level_limit(folder, files)) is not None
    ]
    return min(limits, key=lambda limit: limit.limit_bytes, default=None)


def _cgroup_room_bytes(proc: Path, cgroups: Path) -> int | None:
    """The least room (limit less usage) the process's memory cgroups leave: its own
    and each one above it up to its controller's mount, since a parent's limit holds
    its children's usage together. None without a limit, or where none can be read."""
    rooms = [
        room
        for folder, files in _memory_cgroup_folders(proc, cgroups)
        if (room := _cgroup_level_room_bytes(folder, files)) is not None
    ]
    return min(rooms) if rooms else None


def _memory_cgroup_folders(proc: Path, cgroups: Path) -> list[tuple[Path, _CgroupMemoryFiles]]:
    """The folders of the process's memory cgroups, each with its version's files: for
    each hierarchy it is in, its own cgroup's and each one's above it (`_cgroup_folders`)."""
    return [
        (folder, _CGROUP_V2 if v2 else _CGROUP_V1)
        for v2, mount, path in _own_cgroups(proc, cgroups, "memory")
        for folder in _cgroup_folders(mount, path)
    ]


def _own_cgroups(proc: Path, cgroups: Path, controller: str) -> list[tuple[bool, Path, str]]:
    """The process's cgroups where `controller` ("memory", "cpu") may apply, from
    /proc/self/cgroup: for each, whether it is v2's, its controller's mount, and its path
    under the mount."""
    try:
        lines = (proc / "self" / "cgroup").read_text(encoding="ascii").splitlines()
    except OSError:
        return []
    found: list[tuple[bool, Path, str]] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:  # noqa: PLR2004 - hierarchy:controllers:path
            continue
        _, controllers, path = fields
        if controllers == "":  # v2, "0::/path"
            found.append((True, cgroups, path))
        elif controller in controllers.split(","):  # v1, "4:memory:/path", "2:cpu,cpuacct:/"
            # v1 mounts a hierarchy at its controllers' names ("cpu,cpuacct", "cpu" a link
            # to it where systemd mounts them): the controller's own name is looked for.
            found.append((False, cgroups / controller, path))
    return found


def _cgroup_folders(mount: Path, path: str) -> list[Path]:
    """The folders of the cgroup at `path` and of its ancestors up to `mount`, the mount
    last. Only the mount where the cgroup is not found under it: a container's own
    cgroup namespace mounts its cgroup there, and a path climbing out of the namespace
    ("/../..") must not be followed out of the mount."""
    names = [name for name in path.split("/") if name not in ("", ".")]
    leaf = mount.joinpath(*names)
    if ".." in names or not leaf.is_dir():
        return [mount]
    return [mount.joinpath(*names[:depth]) for depth in range(len(names), -1, -1)]


def _cgroup_level_room_bytes(folder: Path, files: _CgroupMemoryFiles) -> int | None:
    """One cgroup's limit less its usage without its inactive page cache (at least 0);
    None without a limit ("max", ~2^63), or where it cannot be read."""
    limit = _cgroup_level_limit(folder, files)
    if limit is None:
        return None  # no limit at this level (most of a path's): nothing more to read
    used = _read_bytes(folder / files.usage)
    if used is None:
        return None
    # The inactive cache can read larger than the usage read a moment before it.
    working_set = max(used - _memory_stat(folder).get(files.inactive_file, 0), 0)
    return max(limit.limit_bytes - working_set, 0)


def _cgroup_level_limit(folder: Path, files: _CgroupMemoryFiles) -> CgroupMemoryLimit | None:
    """One cgroup's memory limit (v1: or the effective one of memory.stat, its
    ancestors' counted); None without one ("max", ~2^63), or where it cannot be read."""
    path = folder / files.limit
    limit = _read_bytes(path)
    limits = [] if limit is None else [CgroupMemoryLimit(limit, str(path))]
    if files.hierarchical_limit is not None:
        stat = _memory_stat(folder)
        hierarchical = stat.get(files.hierarchical_limit)
        if hierarchical is not None:
            source = f"{folder / 'memory.stat'} {files.hierarchical_limit}"
            limits.append(CgroupMemoryLimit(hierarchical, source))
    return min(
        (limit for limit in limits if limit.limit_bytes < _NO_CGROUP_LIMIT_BYTES),
        key=lambda limit: limit.limit_bytes,
        default=None,
    )


def cgroup_cpu_limit(
    proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")
) -> float | None:
    """The CPUs the process's cgroups let it use, as the least quota over period of its
    own cgroup and each one above it (v2 cpu.max "200000 100000": 2.0; v1
    cpu.cfs_quota_us over cpu.cfs_period_us); None without a quota ("max", -1), or where
    none can be read. A container's CPU limit leaves the machine's CPUs all visible:
    more threads than the quota only wait for their share. `proc` and `cgroups` as
    `host_available_bytes`'s."""
    quotas = [
        quota
        for v2, mount, path in _own_cgroups(proc, cgroups, "cpu")
        for folder in _cgroup_folders(mount, path)
        if (quota := _cpu_quota(folder, v2=v2)) is not None
    ]
    return min(quotas, default=None)


def _cpu_quota(folder: Path, *, v2: bool) -> float | None:
    """One cgroup's CPU quota in CPUs; None without one, or where it cannot be read."""
    if v2:  # "200000 100000", or "max 100000" without a quota
        quota, _, period = _read_text(folder / "cpu.max").partition(" ")
    else:  # -1 without a quota
        quota, period = (
            _read_text(folder / name) for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        )
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max", or a file that could not be read
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def _read_text(path: Path) -> str:
    """A cgroup file's text; "" where it cannot be read."""
    try:
        return path.read_text(encoding="ascii")
    except OSError:
        return ""


def _read_bytes(path: Path) -> int | None:
    """A cgroup file's one number; None where it is missing or not a number ("max")."""
    try:
        return int(path.read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None


def _memory_stat(folder: Path) -> dict[str, int]:
    """A cgroup's memory.stat ("inactive_file 1234" a line); empty where unreadable."""
    try:
        lines = (folder / "memory.stat").read_text(encoding="ascii").splitlines()
    except OSError:
        return {}
    stat: dict[str, int] = {}
    for line in lines:
        name, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            stat[name] = int(value)
    return stat


# ---- the watermark -----------------------------------------------------------------------


class Watermark:
    """Which lanes refuse work because memory is short. Pure: fed readings, no clock.

    At or above `high_bytes` the lowest-priority lane closes; the closer memory gets to
    `limit_bytes`, the more lanes close, bottom up; the highest lane closes only at the
    limit itself (a single lane too: it is the highest). Closed lanes stay closed until
    memory falls below `low_bytes` (hysteresis: no flapping at the boundary while work
    runs), or, with nothing queued or running, are those of the reading alone.
    """

    def __init__(
        self, *, lanes: int, high_bytes: int, low_bytes: int, limit_bytes: int, reading: str
    ) -> None:
        if not 0 < low_bytes <= high_bytes <= limit_bytes:
            raise ValueError(
                f"watermarks: expected 0 < low ({low_bytes}) <= high ({high_bytes}) <= "
                f"limit ({limit_bytes})"
            )
        self.lanes = lanes
        self.high_bytes = high_bytes
        self.low_bytes = low_bytes
        self.limit_bytes = limit_bytes
        # What its readings measure, as refusals name it: "memory in use on GPU '0'", or
        # on the CPU "this process's resident memory" (a CPU server's refusals said
        # "device memory in use" of its resident memory).
        self.reading = reading
        # Lanes closed, counted from the bottom: lane i is closed if i >= lanes - closed.
        self.closed = 0
        self.used_bytes: int | None = None

    def update(self, used_bytes: int, *, idle: bool = False) -> None:
        """A reading. `idle`: nothing queued or running, so the reading is what the server
        holds with no work (an allocator's cache of a burst's batches, another process):
        refusing work cannot lower it, and the hysteresis holds no lane closed, only the
        reading's own level does. Held to the low mark, a server whose idle reading
        stayed between the marks after a burst (140-145 MiB against 127.5 under a 150
        MiB limit, a review) kept every lane closed for good, one request at a time
        admitted while idle."""
        self.used_bytes = used_bytes
        if used_bytes < self.low_bytes or (idle and used_bytes < self.high_bytes):
            self.closed = 0
        elif idle:
            self.closed = self._closed_at(used_bytes)
        elif used_bytes >= self.high_bytes:
            self.closed = max(self.closed, self._closed_at(used_bytes))

    def _closed_at(self, used_bytes: int) -> int:
        """The lanes a reading at or above the high mark closes."""
        if used_bytes >= self.limit_bytes:
            return self.lanes
        span = max(self.limit_bytes - self.high_bytes, 1)
        wanted = 1 + math.floor((used_bytes - self.high_bytes) / span * (self.lanes - 1))
        # Below the limit the highest lane stays open: with one lane, 1 + 0 closed it at
        # the high mark.
        return min(wanted, self.lanes - 1)

    def refuses(self, priority: int) -> bool:
        return priority >= self.lanes - self.closed


@dataclasses.dataclass(frozen=True, slots=True)
class WatermarkState:
    used_bytes: int | None
    high_bytes: int
    low_bytes: int
    closed_lanes: tuple[str, ...]
    # What used_bytes and the marks refer to, never the arena's budget: the GPU's total
    # memory, or on the CPU the host limit.
    limit_bytes: int = 0
    # What used_bytes measures, as refusals name it (`Watermark.reading`).
    reading: str = "memory in use"


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryFacts:
    """What start-up learned about memory, as GetModel reports it."""

    limit_bytes: int | None
    probed_batch_cap: int
    # From the model file (estimate_memory); None when it could not be worked out.
    estimate: MemoryEstimate | None
    # Fitted from memory in use during the probe; None when it could not be read.
    measured: MemoryEstimate | None = None


# ---- a static estimate from the model file --------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """memory(rows) ~= fixed_bytes + per_row_bytes * rows."""

    fixed_bytes: int  # the weights (initializers)
    per_row_bytes: int  # every batch-shaped tensor of one row, as if none were reused

    def rows_within(self, budget_bytes: int) -> int:
        """Rows that fit `budget_bytes` by this estimate (an upper bound on activations,
        so a lower bound on rows); 0 when even the weights do not fit."""
        if self.per_row_bytes <= 0:
            return 1 << 30
        return max((budget_bytes - self.fixed_bytes) // self.per_row_bytes, 0)


def fit_memory(used_bytes_by_rows: dict[int, int]) -> MemoryEstimate | None:
    """Least-squares fixed + per_row * rows through (rows, memory in use) readings; None
    with fewer than two sizes. Readings include what the process held before the model
    (in `fixed_bytes`); a slope below zero (noise) is reported as 0."""
    if len(used_bytes_by_rows) < 2:  # noqa: PLR2004 - a line needs two points
        return None
    rows = np.array(list(used_bytes_by_rows), dtype=np.float64)
    used = np.array(list(used_bytes_by_rows.values()), dtype=np.float64)
    per_row, fixed = np.polyfit(rows, used, 1)
    return MemoryEstimate(fixed_bytes=max(round(fixed), 0), per_row_bytes=max(round(per_row), 0))


# The signals that stop a server, sent to its process group: the estimate's child
# ended by one of them was stopped with the server, it did not fail.
_STOPPING_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})

# The estimates' children running now, and whether the process is ending
# (`stop_estimates`). Only under the lock, which is held from a child's start to its
# entry here: a child starting while `stop_estimates` runs is either ended there or
# never started.
_ESTIMATES_LOCK = threading.Lock()
_running_estimates: set[subprocess.Popen[str]] = set()
_estimates_stopped = threading.Event()  # set once, under the lock
# How long `stop_estimates` waits for a killed child to be gone (it dies at once).
_KILLED_WAIT_S = 1.0


def stop_estimates() -> None:
    """Ends the estimates' children now (SIGKILL), and starts none after: a stop signal
    while starting (the estimate's answer would go unused), and the second one, after
    which the process ends without waiting for its threads (`die_by_signal`): an
    estimate's child, parsing the whole model, had run on orphaned for up to its timeout
    with GBs resident. Any thread; waits at most _KILLED_WAIT_S for each to end."""
    with _ESTIMATES_LOCK:
        _estimates_stopped.set()
        children = list(_running_estimates)
    for child in children:
        child.kill()  # nothing, where its thread has reaped it already
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=_KILLED_WAIT_S)


def estimate_memory(
    model_path: str,
    *,
    probe_shapes: Mapping[str, Sequence[int]] | None = None,
    timeout_s: float = 120.0,
) -> MemoryEstimate | None:
    """Weights plus per-row activations from the model file (`static_estimate`), a row of
    the shape the probe runs (`probe_shapes`: an input's dynamic sizes after the row axis;
    those not given are 1), worked out in a child process; None, with a warning, when
    that fails: a model shape inference cannot read still serves, unestimated (GetModel
    reports 0, a CPU budget goes unchecked against its weights). The warning says
    nothing of what follows: it comes before the session is made, and a file the runtime
    cannot load either is refused next.

    In the serving process the estimate would cost what it estimates: importing onnx and
    parsing the model with its weights kept ~35 MiB resident for good (110 -> 146 MiB on
    the demo model, a quarter of the server) and raised the start-up peak as much. The
    child hands all of it back when it exits (~1 s, most of it importing onnx).
    """
    script = Path(__file__).with_name("static_estimate.py")
    with _ESTIMATES_LOCK:
        if _estimates_stopped.is_set():  # the process is ending: see stop_estimates
            return None
        child = subprocess.Popen(  # noqa: S603 - our own script, this interpreter
            [
                sys.executable,
                str(script),
                model_path,
                json.dumps({name: list(shape) for name, shape in (probe_shapes or {}).items()}),
                str(os.getpid()),  # it exits once this process is gone, however it died
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _running_estimates.add(child)
    try:
        stdout, stderr = _child_output(child, timeout_s)
    except subprocess.TimeoutExpired:
        log_event(
            log,
            logging.WARNING,
            "static_estimate_failed",
            f"static memory estimate of {model_path}: no answer within {timeout_s:.0f}s",
            model=model_path,
            timeout_s=timeout_s,
        )
        return None
    finally:
        with _ESTIMATES_LOCK:
            _running_estimates.discard(child)
            stopped = _estimates_stopped.is_set()
    if stopped:  # killed by stop_estimates: no failure to warn of, the process is ending
        return None
    if -child.returncode in _STOPPING_SIGNALS:
        # Ctrl-C at a terminal (or a stop sent to the process group) reaches the child
        # with the server, which is stopping: no failure of the estimate to warn about.
        # Another signal (SIGKILL from the OOM killer, SIGSEGV) is a failure, below.
        name = signal.Signals(-child.returncode).name
        log_event(
            log,
            logging.INFO,
            "static_estimate_stopped",
            f"static memory estimate of {model_path} stopped by {name}",
            model=model_path,
            signal=name,
        )
        return None
    fields = stdout.split()
    if child.returncode != 0 or len(fields) != 2:  # noqa: PLR2004 - two numbers
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        log_event(
            log,
            logging.WARNING,
            "static_estimate_failed",
            f"static memory estimate of {model_path} failed (exit {child.returncode}: {last})",
            model=model_path,
            exit_code=child.returncode,
            error=last,
        )
        return None
    return MemoryEstimate(fixed_bytes=int(fields[0]), per_row_bytes=int(fields[1]))


def _child_output(child: subprocess.Popen[str], timeout_s: float) -> tuple[str, str]:
    """`child`'s stdout and stderr once it exits, as `subprocess.run` waits: past
    `timeout_s`, or on any error here, the child is killed and reaped first."""
    with child:
        try:
            return child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        except BaseException:
            child.kill()
            raise
