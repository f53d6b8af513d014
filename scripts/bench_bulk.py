#!/usr/bin/env python3
"""Bulk-stream throughput against the raw session ceiling, measured in the same run.

    .venv/bin/python scripts/bench_bulk.py                 # the demo model, defaults
    .venv/bin/python scripts/bench_bulk.py --rows 400000 --rows-per-item 64,256

1. Sweep: one `Engine` (the server's own session settings) runs the model back to back
   on ready-made inputs at each candidate batch size; the fastest is the best batch size.
2. `laneserve serve` starts in a child process with that batch size as its
   `--max-batch-size`.
3. Rounds, interleaved so that both see the same machine: the raw session at the best
   batch size for `--seconds` (the ceiling; the idle server takes no CPU meanwhile), then
   one `AsyncClient.stream` job of `--rows` rows (lane bulk, ordered results) per
   `--rows-per-item` value, timed from the first send to the last result.

The best round of each is reported (neighbours on a shared machine only ever slow a
round down), with the median beside it. Client and server share this machine's cores:
the ratio is what one host gets end to end, not the server's overhead alone. Prints a
Markdown table: path | batch cap | rows per item | rows/s (best) | rows/s (median) | of
ceiling | CPU ms per 1000 rows (by process). The README's table under "Bulk jobs" >
"Throughput" merges two runs of it (default and `--intra-op-threads 2`, a column saying
which) and keeps the best rows/s only. Not a test: numbers depend on the machine and its
load.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from laneserve.client import AsyncClient
from laneserve.server.bench.procs import Deployment, process_cpu_s, start_laneserve
from laneserve.server.bench.script_parts import describe_host, sizes
from laneserve.server.demo_model import make_demo_model
from laneserve.server.engine import Engine, no_static_estimate


def main() -> int:
    args = parse_args()
    # Terminated like Ctrl-C, so that the `finally` below stops the server process too.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(args.model) if args.model else Path(scratch) / "demo.onnx"
        if not args.model:
            make_demo_model(model)
        print(f"# bench_bulk: {describe_host()}", file=sys.stderr)
        # The raw sweep's session alone (the server it compares is a process of its
        # own): no static estimate is read, and no CPU budget checked against it.
        engine = Engine(
            str(model), intra_op_threads=args.intra_op_threads, estimate=no_static_estimate
        )
        sweep = {batch: raw_rate(engine, batch, args.seconds) for batch in args.batch_sizes}
        for batch, rate in sweep.items():
            print(f"# sweep: raw session, batch {batch}: {rate:,.0f} rows/s", file=sys.stderr)
        best_batch = max(sweep, key=lambda batch: sweep[batch])
        server = start_laneserve(
            str(model),
            max_batch_size=best_batch,
            intra_op_threads=args.intra_op_threads,
            device="auto",
        )
        try:
            ceilings, streams = asyncio.run(rounds(engine, best_batch, server, args))
        finally:
            server.stop()
    print_table(best_batch, ceilings, streams, args)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="ONNX model (default: the demo model, built here)")
    parser.add_argument("--rows", type=int, default=200_000, help="rows per stream job")
    parser.add_argument(
        "--rows-per-item", type=sizes, default=[64, 256], help="comma-separated, e.g. 64,256"
    )
    parser.add_argument("--window", type=int, default=256, help="stream window (items)")
    parser.add_argument(
        "--batch-sizes", type=sizes, default=[32, 64, 128, 256, 512], help="for the sweep"
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="per raw measurement")
    parser.add_argument("--rounds", type=int, default=3, help="ceiling + stream rounds")
    parser.add_argument(
        "--intra-op-threads", type=int, default=0, help="ONNX Runtime threads (0 = auto)"
    )
    return parser.parse_args()


@dataclasses.dataclass(frozen=True)
class Run:
    rows_per_s: float
    # CPU milliseconds per 1000 rows, by process ("session": the raw runs; "client" and
    # "server": a stream job). Where the cores went, when the rate falls short.
    cpu_ms_per_krow: dict[str, float]


def raw_rate(engine: Engine, batch: int, seconds: float) -> float:
    return raw_run(engine, batch, seconds).rows_per_s


def raw_run(engine: Engine, batch: int, seconds: float) -> Run:
    """Back-to-back session runs on one ready-made batch (no server, no copies)."""
    rng = np.random.default_rng(0)
    inputs = {
        name: rng.standard_normal(array.shape).astype(array.dtype)
        for name, array in engine.example_inputs(batch).items()
    }
    for _ in range(3):
        engine.run(inputs)  # warm-up
    runs = 0
    cpu_started = time.process_time()
    started = time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        engine.run(inputs)
        runs += 1
    rows = runs * batch
    return Run(rows / elapsed, {"session": (time.process_time() - cpu_started) / rows * 1e6})


async def rounds(
    engine: Engine, batch: int, server: Deployment, args: argparse.Namespace
) -> tuple[list[Run], dict[int, list[Run]]]:
    ceilings: list[Run] = []
    streams: dict[int, list[Run]] = {per_item: [] for per_item in args.rows_per_item}
    server_pid = server.processes[0].pid
    async with AsyncClient(server.target) as client:
        (spec,) = (await client.model()).inputs
        width = tuple(dim or 1 for dim in spec.shape[1:])
        data = np.random.default_rng(1).standard_normal((args.rows, *width)).astype(spec.dtype)
        await job(client, data[: min(args.rows, 20_000)], 256, args.window)  # warm-up
        for number in range(1, args.rounds + 1):
            ceilings.append(raw_run(engine, batch, args.seconds))
            print(f"# round {number}: raw {ceilings[-1]}", file=sys.stderr)
            for per_item, runs in streams.items():
                client_cpu_s, server_cpu_s = time.process_time(), process_cpu_s(server_pid)
                started = time.perf_counter()
                await job(client, data, per_item, args.window)
                elapsed_s = time.perf_counter() - started
                krows = args.rows / 1000
                cpu = {"client": (time.process_time() - client_cpu_s) * 1000 / krows}
                if server_cpu_s is not None:
                    server_now_s = process_cpu_s(server_pid)
                    assert server_now_s is not None
                    cpu["server"] = (server_now_s - server_cpu_s) * 1000 / krows
                runs.append(Run(args.rows / elapsed_s, cpu))
                print(
                    f"# round {number}: stream, {per_item} rows/item: {runs[-1]}", file=sys.stderr
                )
    return ceilings, streams


async def job(client: AsyncClient, data: npt.NDArray[Any], per_item: int, window: int) -> None:
    count = 0
    async for result in client.stream({"input": data}, rows_per_item=per_item, window=window):
        result.unwrap()  # raises the item's error: a benchmark with failures is void
        count += 1
    assert count == -(-len(data) // per_item)


def print_table(
    batch: int, ceilings: list[Run], streams: dict[int, list[Run]], args: argparse.Namespace
) -> None:
    best_raw = max(ceilings, key=lambda run: run.rows_per_s)
    ceiling = best_raw.rows_per_s
    print(f"rows per stream job: {args.rows:,}; window {args.window} items; rounds {args.rounds}")
    print()
    print(
        "| path | batch cap | rows per item | rows/s (best) | rows/s (median) | of ceiling "
        "| CPU ms per 1000 rows |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| raw `session.run`, back to back (ceiling) | {batch} | {batch} | {ceiling:,.0f} "
        f"| {statistics.median(run.rows_per_s for run in ceilings):,.0f} | 100% "
        f"| {_cpu(best_raw)} |"
    )
    for per_item, runs in streams.items():
        best = max(runs, key=lambda run: run.rows_per_s)
        print(
            f"| `InferStream` via `AsyncClient.stream` | {batch} | {per_item} "
            f"| {best.rows_per_s:,.0f} | {statistics.median(run.rows_per_s for run in runs):,.0f} "
            f"| {best.rows_per_s / ceiling:.0%} | {_cpu(best)} |"
        )


def _cpu(run: Run) -> str:
    return ", ".join(f"{name} {ms:.0f}" for name, ms in run.cpu_ms_per_krow.items())


if __name__ == "__main__":
    sys.exit(main())
