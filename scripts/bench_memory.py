"""One burst, two designs: laneserve under a memory budget versus N worker processes.

    .venv/bin/python scripts/bench_memory.py [--workers 4] [--requests 16] [--rows 1024]

(a) laneserve: one session, the arena capped at --budget; the batch cap is forced to the
    burst's request size (--batch-cap), so out-of-memory, splitting and the cap's
    convergence happen under the burst itself.
(b) N workers: N processes behind one port (SO_REUSEPORT), each with its own uncapped
    session, each request run alone: the "just add workers" design.
Both get the same burst of concurrent multi-row requests; the script prints completed
rows, failures and peak memory per design, and the ratio. Peak memory is the largest
figure sampled (as the benchmark harness samples it) every --sample-ms while the burst
runs, *unique*: each resident page of the design's processes counted once (from
/proc/PID/smaps: their private pages, plus each shared file mapping once), so the
interpreter's and the libraries' pages the workers share count once in all. Beside it
the summed PSS, which divides shared pages with this script's own process too and so
understates one process more than N, and each process's VmHWM (peak resident set)
summed, which counts the shared pages once per process and so overstates N processes.
Figures come from one run on this machine: shared and noisy, compare ratios.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from laneserve.client.tensors import encode_tensor
from laneserve.server.bench.procs import (
    PSS,
    RSS_NOTE,
    Deployment,
    start_laneserve,
    start_workers,
)
from laneserve.server.demo_model import make_demo_model
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

MIB = 1024 * 1024


def start_laneserve_with_budget(model: str, budget: str, rows: int) -> Deployment:
    return start_laneserve(
        model,
        max_batch_size=rows,
        intra_op_threads=0,  # the runtime's default, as `laneserve serve` has it
        device="cpu",
        extra_args=("--memory-limit", budget, "--batch-cap", str(rows)),
    )


def burst(
    target: str, requests: int, rows: int, sample: Callable[[], None], every_s: float
) -> dict[str, int]:
    """Sends `requests` concurrent requests of `rows` rows and calls `sample` every
    `every_s` until all are answered, and once after; counts the outcomes."""
    inputs = np.random.default_rng(0).standard_normal((rows, 512)).astype(np.float32)
    message = pb.InferRequest(lane="bulk", inputs=[encode_tensor("input", inputs)])
    counts: collections.Counter[str] = collections.Counter()
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        calls = [stub.Infer.future(message, timeout=300) for _ in range(requests)]
        # Sampling stays on this thread, as the harness's orchestrator does it: the
        # deployment's peaks are not shared with another thread.
        while not all(call.done() for call in calls):
            sample()
            time.sleep(every_s)
        sample()
        for call in calls:
            try:
                call.result()
                counts["ok_rows"] += rows
            except grpc.RpcError as error:
                # The sync stub's RpcError is also a grpc.Call, which the stubs don't say.
                code: grpc.StatusCode = error.code()
                counts[f"failed:{code.name}"] += 1
    return dict(counts)


def laneserve_stats(target: str) -> dict[str, int]:
    with grpc.insecure_channel(target) as channel:
        stats = pb_grpc.InferenceServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    return {
        "out_of_memory_events": stats.out_of_memory_events,
        "batch_splits": stats.batch_splits,
        "batch_cap": stats.batch_cap,
        "max_batch_cap": stats.max_batch_cap,
    }


def summed_peaks(memory: dict[str, Any]) -> dict[str, Any]:
    """From a deployment's memory figures (procs.Deployment.memory, read before it
    stops): the peak unique memory sampled during the burst (None where smaps could not
    be read), the peak summed PSS (its measure is RSS where smaps_rollup could not be
    read; None where no sample was comparable) and the processes' VmHWM summed (None
    where any is unknown)."""
    hwm = [reading["peak_rss_bytes"] for reading in memory["by_process"]]
    unique = memory["unique_peak_bytes"]
    return {
        "unique_peak_mib": None if unique is None else unique / MIB,
        "measure": memory["measure"],
        "peak_mib": None if memory["peak_bytes"] is None else memory["peak_bytes"] / MIB,
        "samples": memory["samples"],
        # Each process's high-water mark, summed: shared pages counted once per process,
        # and the marks need not have been reached at one instant.
        "hwm_sum_mib": None if None in hwm else sum(hwm) / MIB,
    }


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    if numerator is None or not denominator:
        return "unknown (no comparable reading)"
    return f"{numerator / denominator:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--budget", default="32MiB", help="laneserve's --memory-limit")
    parser.add_argument("--model", help="ONNX model (default: the demo model, built here)")
    parser.add_argument(
        "--sample-ms",
        type=float,
        default=50.0,
        help="how often memory is read during the burst (default: 50)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(Path(scratch) / "demo.onnx")
        if args.model is None:
            make_demo_model(model)
        results = {}
        designs: dict[str, Callable[[], Deployment]] = {
            "laneserve": lambda: start_laneserve_with_budget(model, args.budget, args.rows),
            f"{args.workers} workers": lambda: start_workers(
                model, workers=args.workers, intra_op_threads=1, device="cpu"
            ),
        }
        for name, start in designs.items():
            deployment = start()
            try:
                outcome = burst(
                    deployment.target,
                    args.requests,
                    args.rows,
                    deployment.sample_memory,
                    args.sample_ms / 1000,
                )
                memory = deployment.memory()
                if name == "laneserve":
                    outcome.update(laneserve_stats(deployment.target))
            finally:
                deployment.stop()
            results[name] = {**outcome, **summed_peaks(memory)}
    wanted_rows = args.requests * args.rows
    print(f"burst: {args.requests} concurrent requests x {args.rows} rows = {wanted_rows} rows")
    print(f"laneserve budget: {args.budget}\n")
    print(
        "| design | completed rows | failures | peak unique (MiB) | peak PSS, summed (MiB) "
        "| VmHWM summed (MiB; counts shared pages once per process) | notes |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, result in results.items():
        failures = sum(v for k, v in result.items() if k.startswith("failed:"))
        notes = [
            f"{key}={value}"
            for key, value in result.items()
            if key in ("out_of_memory_events", "batch_splits", "batch_cap")
        ]
        notes.append(f"{result['samples']} samples")
        if result["measure"] is None:
            notes.append("no peak: a process could not be read after the burst")
        elif result["measure"] != PSS:
            notes.append(f"peak is {result['measure']}, not PSS: {RSS_NOTE}")
        print(
            f"| {name} | {result.get('ok_rows', 0)} of {wanted_rows} | {failures} | "
            f"{_mib(result['unique_peak_mib'])} | {_mib(result['peak_mib'])} | "
            f"{_mib(result['hwm_sum_mib'])} | {', '.join(notes)} |"
        )
    workers = results[f"{args.workers} workers"]
    lane = results["laneserve"]
    print(
        f"\nmemory ratio (peak unique: each page counted once), {args.workers} workers / "
        f"laneserve: {_ratio(workers['unique_peak_mib'], lane['unique_peak_mib'])}"
    )
    print(
        f"peak summed PSS's ratio (shared pages divided with this script's process too): "
        f"{_ratio(workers['peak_mib'], lane['peak_mib'])}"
    )
    print(
        f"VmHWM sums' ratio (shared pages counted once per process): "
        f"{_ratio(workers['hwm_sum_mib'], lane['hwm_sum_mib'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
