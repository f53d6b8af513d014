"""What the measurement scripts under scripts/ share: the host's description every one
prints, comma-separated counts, and for the scripts that compare KServe paths on one
server (bench_http.py, bench_shared_memory.py) their closed-loop arguments, the model's
tensors as ModelMetadata gives them and the words of their tables. Each script keeps
its paths, its rounds and its table."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import math
import os
import platform
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.server.kserve_convert import BYTES, KSERVE_DTYPES

KIB: Final = 1024
MIB: Final = 1024 * KIB


@dataclasses.dataclass(frozen=True)
class ClosedLoopDefaults:
    """A script's defaults for `add_closed_loop_arguments`."""

    rows: list[int]
    callers: list[int]
    seconds: float
    # What --max-message-bytes bounds besides the server's and the channel's messages.
    limit_help: str = "server and channel message limit (default 64 MiB, the server's own)"


def add_closed_loop_arguments(
    parser: argparse.ArgumentParser, defaults: ClosedLoopDefaults
) -> None:
    """--model, --rows, --callers, --seconds, --rounds, --lane, --max-batch-size,
    --max-message-bytes and --intra-op-threads; `closed_loop_arguments` checks them."""
    parser.add_argument("--model", help="ONNX model (default: the demo model, built here)")
    example = ",".join(map(str, defaults.rows))
    parser.add_argument(
        "--rows", type=sizes, default=defaults.rows, help=f"rows per request, e.g. {example}"
    )
    example = ",".join(map(str, defaults.callers))
    parser.add_argument(
        "--callers", type=sizes, default=defaults.callers, help=f"callers at once, e.g. {example}"
    )
    parser.add_argument(
        "--seconds", type=float, default=defaults.seconds, help="per path and round"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every measurement")
    parser.add_argument("--lane", default="bulk", help="the lane requests go to")
    parser.add_argument("--max-batch-size", type=int, default=512, help="server batch cap")
    parser.add_argument("--max-message-bytes", type=int, default=64 * MIB, help=defaults.limit_help)
    parser.add_argument(
        "--intra-op-threads", type=int, default=0, help="ONNX Runtime threads (0 = auto)"
    )


def closed_loop_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed arguments, refused (parser.error) where a count is not positive."""
    args = parser.parse_args()
    if not args.rows or min(args.rows) < 1 or not args.callers or min(args.callers) < 1:
        parser.error("--rows and --callers take positive counts")
    if args.seconds <= 0 or args.rounds < 1:
        parser.error("--seconds must be positive and --rounds at least 1")
    return args


def sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def describe_host() -> str:
    """The processor, CPU count, load and ONNX Runtime release of this run's machine."""
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}, onnxruntime {_installed('onnxruntime-gpu', 'onnxruntime')}"
    )


def _installed(*packages: str) -> str:
    """The version of the first of `packages` installed (read from its metadata: a script
    does not import onnxruntime itself before laneserve.server has turned its telemetry
    off)."""
    for package in packages:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(package)
    return "not installed"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One input or output of the model, as ModelMetadata gives it."""

    name: str
    datatype: str  # the protocol's name: "FP32"
    dtype: np.dtype[Any]
    row_shape: tuple[int, ...]  # the dimensions after the row axis

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize


def tensors_of(metadata: Sequence[kpb.ModelMetadataResponse.TensorMetadata]) -> list[Tensor]:
    """The tensors ModelMetadata lists; SystemExit for one a script cannot size by rows (a
    datatype not served, BYTES, whose rows are as long as their text, a dynamic axis
    after the rows)."""
    tensors = []
    for spec in metadata:
        fixed = spec.datatype in KSERVE_DTYPES and spec.datatype != BYTES
        if not fixed or any(dim < 0 for dim in spec.shape[1:]):
            raise SystemExit(
                f"{spec.name}: {spec.datatype} {list(spec.shape)}; expected a served datatype "
                "of a fixed size (not BYTES) and no dynamic axis after the rows"
            )
        row_shape = tuple(spec.shape[1:])
        tensors.append(Tensor(spec.name, spec.datatype, KSERVE_DTYPES[spec.datatype], row_shape))
    return tensors


def random_arrays(
    tensors: Sequence[Tensor], rows: int, rng: np.random.Generator
) -> list[np.ndarray[Any, Any]]:
    """`rows` rows of each tensor: normal values for floats, 0 or 1 for the others (in
    range for every integer type, and bool)."""
    arrays = []
    for tensor in tensors:
        shape = (rows, *tensor.row_shape)
        if tensor.dtype.kind == "f":
            arrays.append(rng.standard_normal(shape).astype(tensor.dtype))
        else:
            arrays.append(rng.integers(0, 2, shape).astype(tensor.dtype))
    return arrays


def size_text(count: int) -> str:
    """Bytes as a table writes them: "2.0 MiB", "128 KiB", "12 B"."""
    if count >= MIB:
        return f"{count / MIB:.1f} MiB"
    return f"{count / KIB:.0f} KiB" if count >= KIB else f"{count} B"


def cpu_text(cpu_ms_per_krow: Mapping[str, float]) -> str:
    """CPU milliseconds per 1000 rows, by process: "server 118.1, client 2.8"."""
    return ", ".join(f"{name} {ms:.1f}" for name, ms in cpu_ms_per_krow.items())
