"""Per-request cost of tracing: the same load with tracing off and on, in one run.

    .venv/bin/python scripts/bench_tracing.py                 # defaults: small model
    .venv/bin/python scripts/bench_tracing.py --requests 500 --rounds 7 --concurrency 16

Four servers run side by side in this process, on loopback with ephemeral ports and
the same generated model: tracing off and metrics off (`bare`), metrics on (`metrics`,
the default configuration: a Prometheus reader), and metrics plus tracing with every span
sampled and exported through the production BatchSpanProcessor into an exporter that
drops them (`traced`: the instrumentation's own cost, no I/O), and the same with 1 % of
traces sampled (`sampled`, `--ratio`: what a production setting pays). Rounds alternate between
the servers so that drift on a shared machine hits all alike; the median of the
rounds is reported, as per-request time (wall time of a round / requests) and as the
ratio to `bare`. It also times the call sites that stay on the request path when tracing
is off (one `NullTracer.start` and its `end`), to show what "off" costs.

This is a measurement, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

from laneserve.client.tensors import encode_tensor
from laneserve.server import Engine, LaneServer, ServerConfig
from laneserve.server.demo_model import make_demo_model
from laneserve.server.engine import no_static_estimate
from laneserve.server.events import NullTracer
from laneserve.server.telemetry import BatchLinkSampler, Telemetry
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc


class DroppingExporter(SpanExporter):
    """Counts spans and throws them away: the cost measured is producing them."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


@dataclasses.dataclass
class Mode:
    name: str
    server: LaneServer
    stub: pb_grpc.InferenceServiceAsyncStub
    channel: grpc.aio.Channel
    per_request_s: list[float] = dataclasses.field(default_factory=list)
    # This process's CPU time (servers and client together) per request: much less
    # disturbed than wall time by other work on a shared machine.
    cpu_per_request_s: list[float] = dataclasses.field(default_factory=list)


def telemetry_for(
    name: str, config: ServerConfig, engine: Engine, ratio: float
) -> tuple[Telemetry, DroppingExporter | None]:
    # The Prometheus reader aggregates exactly as this one does; it only renders on scrape.
    readers = [] if name == "bare" else [InMemoryMetricReader()]
    provider = None
    exporter = None
    if name in {"traced", "sampled"}:
        exporter = DroppingExporter()
        # As tracer_provider_from_env builds it: `traced` samples every trace, `sampled`
        # the ratio (OTEL_TRACES_SAMPLER=parentbased_traceidratio).
        inner = ALWAYS_ON if name == "traced" else ParentBased(TraceIdRatioBased(ratio))
        provider = TracerProvider(sampler=BatchLinkSampler(inner), shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    telemetry = Telemetry(
        lanes=config.lanes,
        providers=engine.providers,
        max_batch_size=config.max_batch_size,
        metric_readers=readers,
        tracer_provider=provider,
        owns_tracer_provider=True,
    )
    return telemetry, exporter


async def one_round(mode: Mode, requests: int, concurrency: int, message: pb.InferRequest) -> None:
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await mode.stub.Infer(message, timeout=30)

    started = time.perf_counter()
    cpu_started = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    mode.per_request_s.append((time.perf_counter() - started) / requests)
    mode.cpu_per_request_s.append((time.process_time() - cpu_started) / requests)


async def bench(args: argparse.Namespace, model: str) -> None:
    config = ServerConfig(model_path=model, host="127.0.0.1", port=0, metrics_port=-1)
    message = pb.InferRequest(
        inputs=[encode_tensor("input", np.ones((args.rows, 512), dtype=np.float32))]
    )
    modes: list[Mode] = []
    warm_up = max(args.requests // 10, 10)
    exporters: dict[str, DroppingExporter | None] = {}
    for name in ("bare", "metrics", "traced", "sampled"):
        # Nothing here asks GetModel or sets a CPU budget: the static estimate's child
        # (~1 s, twice the weights at its peak) would run four times for nothing.
        engine = Engine(model, intra_op_threads=1, estimate=no_static_estimate)
        telemetry, exporter = telemetry_for(name, config, engine, args.ratio)
        exporters[name] = exporter
        server = LaneServer(engine, config, telemetry=telemetry)
        port = await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        modes.append(Mode(name, server, pb_grpc.InferenceServiceStub(channel), channel))
    try:
        for mode in modes:  # warm-up: connections, first batches
            await one_round(mode, warm_up, args.concurrency, message)
            mode.per_request_s.clear()
            mode.cpu_per_request_s.clear()
        for round_index in range(args.rounds):
            # Rotate the order each round: no mode always runs first or last.
            shift = round_index % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                await one_round(mode, args.requests, args.concurrency, message)
    finally:
        for mode in modes:
            await mode.channel.close()
            await mode.server.stop(grace_s=5.0)

    print(
        f"laneserve tracing overhead: {args.rounds} rounds x {args.requests} requests of "
        f"{args.rows} rows, concurrency {args.concurrency}, median of rounds"
    )
    for label, figure in (("wall", "per_request_s"), ("cpu", "cpu_per_request_s")):
        samples = {mode.name: getattr(mode, figure) for mode in modes}
        bare_s = statistics.median(samples["bare"])
        print(f" {label} time per request (median [min-max] of rounds):")
        for mode in modes:
            median_s = statistics.median(samples[mode.name])
            spread = f"[{min(samples[mode.name]) * 1e6:.0f}-{max(samples[mode.name]) * 1e6:.0f}]"
            line = f"  {mode.name:<8} {median_s * 1e6:8.1f} us {spread:>14}"
            if mode is not modes[0]:
                line += (
                    f"   {(median_s - bare_s) * 1e6:+7.1f} us   x{median_s / bare_s:.3f} of bare"
                )
            print(line)
        metrics_s = statistics.median(samples["metrics"])
        for name in ("traced", "sampled"):
            median_s = statistics.median(samples[name])
            print(
                f"  {name}: tracing on / off (both with metrics) x{median_s / metrics_s:.3f}, "
                f"{(median_s - metrics_s) * 1e6:+.1f} us/request"
            )
    total = args.rounds * args.requests + warm_up
    for name in ("traced", "sampled"):
        exporter = exporters[name]
        assert exporter is not None
        print(f"  {name}: {exporter.spans / total:.2f} spans exported per request")
    tracer = NullTracer()

    def off_call_sites() -> None:
        tracer.start("", "standard", 1, 1.0).end("OK")

    repeats = 200_000
    cost_s = min(timeit.repeat(off_call_sites, number=repeats, repeat=5)) / repeats
    print(f"  tracing off, call sites left on the request path: {cost_s * 1e9:.0f} ns/request")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="ONNX model (default: a small generated MLP)")
    parser.add_argument("--requests", type=int, default=300, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--rows", type=int, default=1, help="rows per request")
    parser.add_argument(
        "--ratio", type=float, default=0.01, help="sampling ratio of the `sampled` mode"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        model = args.model
        if model is None:
            model = str(Path(folder) / "small.onnx")
            make_demo_model(model, hidden_dim=64, hidden_layers=1)
        asyncio.run(bench(args, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
