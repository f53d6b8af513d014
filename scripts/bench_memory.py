"""One burst, two designs: laneserve under a memory budget versus N worker processes.

    .venv/bin/python scripts/bench_memory.py [--workers 4] [--requests 16] [--rows 1024]

(a) laneserve: one session, the arena capped at --budget; the batch cap is forced to the
    burst's request size (--batch-cap), so out-of-memory, splitting and the cap's
    convergence happen under the burst itself.
(b) N workers: N processes behind one port (SO_REUSEPORT), each with its own uncapped
    session, each request run alone: the "just add workers" design.
Both get the same burst of concurrent multi-row requests; the script prints completed
rows, failures and peak resident memory (VmHWM, summed over processes) per design, and
the ratios. Figures come from one run on this machine: shared and noisy, compare ratios.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from laneserve.client.tensors import encode_tensor
from laneserve.server.bench.procs import Deployment, start_laneserve, start_workers
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


def burst(target: str, requests: int, rows: int) -> dict[str, int]:
    """Sends `requests` concurrent requests of `rows` rows; counts the outcomes."""
    inputs = np.random.default_rng(0).standard_normal((rows, 512)).astype(np.float32)
    message = pb.InferRequest(lane="bulk", inputs=[encode_tensor("input", inputs)])
    counts: collections.Counter[str] = collections.Counter()
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        calls = [stub.Infer.future(message, timeout=300) for _ in range(requests)]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--budget", default="32MiB", help="laneserve's --memory-limit")
    parser.add_argument("--model", help="ONNX model (default: the demo model, built here)")
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
                outcome = burst(deployment.target, args.requests, args.rows)
                memory = deployment.memory()
                if name == "laneserve":
                    outcome.update(laneserve_stats(deployment.target))
            finally:
                deployment.stop()
            # VmHWM of each process, summed: the high-water marks, not one sampled sum.
            peak_bytes = sum(reading["peak_rss_bytes"] or 0 for reading in memory["by_process"])
            results[name] = {**outcome, "peak_rss_mib": peak_bytes / MIB}
    wanted_rows = args.requests * args.rows
    print(f"burst: {args.requests} concurrent requests x {args.rows} rows = {wanted_rows} rows")
    print(f"laneserve budget: {args.budget}\n")
    print("| design | completed rows | failures | peak RSS (MiB) | notes |")
    print("|---|---|---|---|---|")
    for name, result in results.items():
        failures = sum(v for k, v in result.items() if k.startswith("failed:"))
        notes = ", ".join(
            f"{key}={value}"
            for key, value in result.items()
            if key in ("out_of_memory_events", "batch_splits", "batch_cap")
        )
        print(
            f"| {name} | {result.get('ok_rows', 0)} of {wanted_rows} | {failures} | "
            f"{result['peak_rss_mib']:.0f} | {notes} |"
        )
    workers_rss = results[f"{args.workers} workers"]["peak_rss_mib"]
    lane_rss = results["laneserve"]["peak_rss_mib"]
    print(f"\nmemory ratio, {args.workers} workers / laneserve: {workers_rss / lane_rss:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
