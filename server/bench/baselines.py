"""The baselines laneserve is measured against, each runnable as its own process.

    python -m laneserve.server.bench.baselines echo   --model M [--port P]
    python -m laneserve.server.bench.baselines single --model M [--port P] [--threads T]
                                                      [--reuse-port] [--intra-op-threads I]
    python -m laneserve.server.bench.baselines raw    --model M --max-batch-size B

- ``echo``: a bare grpc.aio server speaking laneserve.v1 that answers every Infer with a
  fixed, prebuilt response of the right size (the model's outputs for that many rows, all
  zeros) and never runs the model: the cost of Python gRPC itself, the ceiling of any
  Python gRPC server on this machine.
- ``single``: the "no batching" design: validates like laneserve, then runs each request
  alone on one shared session from a thread pool of ``--threads``. With ``--reuse-port``
  and ``--threads 1``, N of them behind one port are the "just add workers" design. Its
  InferStream is the naive one: every item is read as it arrives and run alone in the
  same pool, in arrival order, answered as it completes (no window, no priority).
- ``raw``: the session alone, back-to-back at each power-of-two batch size, no RPC;
  prints one JSON object (rows per second by batch size and the best of them).

The servers log ``serving KIND on HOST:PORT`` once listening and stop on SIGTERM/SIGINT.
Their sessions come from `laneserve.server.engine.Engine` (the one that makes onnxruntime
sessions).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import numpy as np

from laneserve.client.tensors import datatype_of, encode_tensor
from laneserve.server.bench.settings import WORKER_METADATA_KEY
from laneserve.server.codec import check_output_names, decode_inputs, encode_response
from laneserve.server.config import DEVICES
from laneserve.server.engine import Engine, TensorSpec, no_static_estimate, zero_value
from laneserve.server.errors import LaneserveError, to_rpc_status
from laneserve.server.grpc_methods import abort_with, release_frames
from laneserve.server.items import Timing
from laneserve.server.process import tune_for_serving
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger("laneserve.bench.baseline")

MESSAGE_LIMIT_BYTES = 64 * 1024 * 1024
STOP_GRACE_S = 2.0


def _model_response(engine: Engine, batch_cap: int) -> pb.GetModelResponse:
    def spec(tensor: TensorSpec) -> pb.TensorSpec:
        return pb.TensorSpec(
            name=tensor.name, dtype=datatype_of(tensor.dtype), shape=list(tensor.shape)
        )

    return pb.GetModelResponse(
        model_path=engine.model_path,
        inputs=[spec(tensor) for tensor in engine.inputs],
        outputs=[spec(tensor) for tensor in engine.outputs],
        batch_cap=batch_cap,
        max_batch_size=batch_cap,
        providers=engine.providers,
    )


async def _name_this_worker(
    context: grpc.aio.ServicerContext[pb.GetModelRequest, pb.GetModelResponse],
) -> None:
    """Says which process answers (its pid, in the initial metadata): the load generator
    asks once per connection, to count the calls each of N workers on one port answered."""
    await context.send_initial_metadata(((WORKER_METADATA_KEY, str(os.getpid())),))


class _InferOnly(pb_grpc.InferenceServiceServicer):
    """Baselines serve Infer and GetModel (the no-batching one InferStream too); the rest
    of the API is refused as unimplemented (the harness then reports no server-side
    figures for them)."""

    def InferStream(
        self,
        request_iterator: AsyncIterator[pb.InferRequest],
        context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferStreamResponse],
    ) -> AsyncIterator[pb.InferStreamResponse]:
        return _refuse_stream(context)

    async def GetStats(
        self,
        request: pb.GetStatsRequest,
        context: grpc.aio.ServicerContext[pb.GetStatsRequest, pb.GetStatsResponse],
    ) -> pb.GetStatsResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a baseline keeps no statistics")


async def _refuse_stream(
    context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferStreamResponse],
) -> AsyncIterator[pb.InferStreamResponse]:
    nothing: list[pb.InferStreamResponse] = []
    for message in nothing:  # makes this an async generator, as gRPC expects
        yield message
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a baseline serves Infer only")


class EchoServicer(_InferOnly):
    """Answers without running anything: one prebuilt response per row count."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._responses: dict[int, pb.InferResponse] = {}

    def _response(self, rows: int) -> pb.InferResponse:
        response = self._responses.get(rows)
        if response is None:
            outputs = [
                encode_tensor(
                    spec.name,
                    np.full(
                        (rows, *(d if d > 0 else 1 for d in spec.shape[1:])),
                        zero_value(spec.dtype),
                        spec.dtype,
                    ),
                )
                for spec in self._engine.outputs
            ]
            response = pb.InferResponse(outputs=outputs, timing=pb.Timing(batch_size=rows))
            self._responses[rows] = response
        return response

    async def Infer(
        self,
        request: pb.InferRequest,
        context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferResponse],
    ) -> pb.InferResponse:
        rows = request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1
        return self._response(max(rows, 1))

    async def GetModel(
        self,
        request: pb.GetModelRequest,
        context: grpc.aio.ServicerContext[pb.GetModelRequest, pb.GetModelResponse],
    ) -> pb.GetModelResponse:
        await _name_this_worker(context)
        return _model_response(self._engine, 0)


class SingleServicer(_InferOnly):
    """Each request runs alone on the shared session, from a thread pool."""

    def __init__(self, engine: Engine, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self._engine = engine
        self._pool = pool
        self._output_names = [spec.name for spec in engine.outputs]

    async def Infer(
        self,
        request: pb.InferRequest,
        context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferResponse],
    ) -> pb.InferResponse:
        try:
            return await self._answer(request)
        except LaneserveError as error:
            refusal = error
        del request  # as laneserve lets go of it (see `abort_with`)
        await abort_with(context, release_frames(refusal))
        raise AssertionError("unreachable: abort raises")

    async def InferStream(
        self,
        request_iterator: AsyncIterator[pb.InferRequest],
        context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferStreamResponse],
    ) -> AsyncIterator[pb.InferStreamResponse]:
        """Every item read as soon as it arrives and run alone in the pool, in arrival
        order (unary calls share that queue), each answered as it completes: a stream
        server without a window or priorities, what the naive design does with a bulk
        job."""
        answers: asyncio.Queue[pb.InferStreamResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def answer(request: pb.InferRequest) -> None:
            message = pb.InferStreamResponse(request_id=request.request_id)
            try:
                message.response.CopyFrom(await self._answer(request))
            except LaneserveError as error:
                message.error.CopyFrom(to_rpc_status(error))
            answers.put_nowait(message)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(answer(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:
                    await asyncio.wait(tuple(running))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (message := await answers.get()) is not None:
                yield message
            await reader  # raises what ended the reading, if anything did
        finally:
            reader.cancel()
            for task in tuple(running):
                task.cancel()

    async def _answer(self, request: pb.InferRequest) -> pb.InferResponse:
        """`request` run alone in the pool; raises LaneserveError for invalid input."""
        decoded = decode_inputs(request.inputs, self._engine.inputs)
        inputs, rows = decoded.arrays, decoded.rows
        names = check_output_names(request.output_names, self._output_names)
        queued_s = time.perf_counter()
        started_s, finished_s, outputs = await asyncio.get_running_loop().run_in_executor(
            self._pool, self._run, inputs
        )
        timing = Timing(
            lane="", batch_size=rows, queue_s=started_s - queued_s, infer_s=finished_s - started_s
        )
        return encode_response(request.request_id, outputs, names, timing)

    def _run(self, inputs: dict[str, np.ndarray]) -> tuple[float, float, dict[str, np.ndarray]]:
        started_s = time.perf_counter()
        outputs = self._engine.run(inputs)
        return started_s, time.perf_counter(), outputs

    async def GetModel(
        self,
        request: pb.GetModelRequest,
        context: grpc.aio.ServicerContext[pb.GetModelRequest, pb.GetModelResponse],
    ) -> pb.GetModelResponse:
        await _name_this_worker(context)
        return _model_response(self._engine, 1)


async def serve(
    kind: str,
    engine: Engine,
    *,
    host: str,
    port: int,
    threads: int,
    reuse_port: bool,
) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="laneserve-single")
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MESSAGE_LIMIT_BYTES),
            ("grpc.max_send_message_length", MESSAGE_LIMIT_BYTES),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ]
    )
    servicer = EchoServicer(engine) if kind == "echo" else SingleServicer(engine, pool)
    pb_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    log.info("serving %s on %s:%d threads=%d reuse_port=%s", kind, host, bound, threads, reuse_port)
    await stopping.wait()
    await server.stop(grace=STOP_GRACE_S)
    pool.shutdown(wait=True, cancel_futures=True)
    log.info("stopped")


def raw_ceiling(
    engine: Engine, *, max_batch_size: int, seconds_per_size: float, seed: int = 0
) -> dict[str, object]:
    """Rows per second of back-to-back session runs at each power-of-two batch size up
    to `max_batch_size` (and the cap itself), after one warm-up run each."""
    rng = np.random.default_rng(seed)
    sizes = sorted({1 << power for power in range(max_batch_size.bit_length())} | {max_batch_size})
    by_size: dict[str, float] = {}
    for rows in sizes:
        inputs = {
            name: (
                rng.standard_normal(array.shape).astype(array.dtype)
                if array.dtype.kind == "f"
                else array
            )
            for name, array in engine.example_inputs(rows).items()
        }
        engine.run(inputs)
        runs = 0
        started_s = time.perf_counter()
        while (elapsed_s := time.perf_counter() - started_s) < seconds_per_size or runs < 3:  # noqa: PLR2004 - a few runs at least
            engine.run(inputs)
            runs += 1
        by_size[str(rows)] = runs * rows / elapsed_s
    best = max(by_size, key=lambda size: by_size[size])
    return {
        "rows_per_s_by_batch_rows": by_size,
        "best_batch_rows": int(best),
        "best_rows_per_s": by_size[best],
        "providers": engine.providers,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m laneserve.server.bench.baselines", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("echo", "single"):
        command = commands.add_parser(name)
        command.add_argument("--model", required=True)
        command.add_argument("--host", default="127.0.0.1")
        command.add_argument("--port", type=int, default=0)
        command.add_argument("--threads", type=int, default=1)
        command.add_argument("--intra-op-threads", type=int, default=0)
        command.add_argument("--reuse-port", action="store_true")
        command.add_argument("--device", choices=DEVICES, default="auto")
    raw = commands.add_parser("raw")
    raw.add_argument("--model", required=True)
    raw.add_argument("--max-batch-size", type=int, required=True)
    raw.add_argument("--seconds-per-size", type=float, default=1.0)
    raw.add_argument("--intra-op-threads", type=int, default=0)
    raw.add_argument("--device", choices=DEVICES, default="auto")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # No baseline reads the static estimate (their GetModel has no memory figures) or
    # sets a CPU budget: its child would cost each start ~1 s and twice the weights.
    engine = Engine(
        args.model,
        device=args.device,
        intra_op_threads=args.intra_op_threads,
        estimate=no_static_estimate,
    )
    if args.command == "raw":
        result = raw_ceiling(
            engine, max_batch_size=args.max_batch_size, seconds_per_size=args.seconds_per_size
        )
        print(json.dumps(result))
        return 0
    tune_for_serving()  # as `laneserve serve` does: the comparison is of designs
    asyncio.run(
        serve(
            args.command,
            engine,
            host=args.host,
            port=args.port,
            threads=args.threads,
            reuse_port=args.reuse_port,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
