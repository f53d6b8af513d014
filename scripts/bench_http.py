#!/usr/bin/env python3
"""What KServe v2's HTTP front end costs against the gRPC one, one host, one run.

    .venv/bin/python scripts/bench_http.py                        # the demo model, defaults
    .venv/bin/python scripts/bench_http.py --rows 1,256,4096 --callers 1,4 --seconds 5

`laneserve serve --http-port 0` starts in a child process on loopback: one server, its
gRPC port and its HTTP port (read from its startup line, "..., HTTP port N") in front of
the same engine. Then, for each `--rows` value (rows per request) and each `--callers`
value (callers at once, each an asyncio task calling back to back, closed loop), three
paths, each for `--seconds`:

- grpc: `ModelInfer` on one channel, each input's bytes in `raw_input_contents` and the
  outputs read from `raw_output_contents`, as tritonclient.grpc sends and reads them;
- http-binary: POST /v2/models/NAME/infer with Triton's binary tensor data (a JSON
  header, each input's `binary_data_size`, its bytes after the header and the header's
  length in `Inference-Header-Content-Length`) and `binary_data_output: true`; the answer
  read the same way (its JSON header, then `np.frombuffer` over each output's bytes);
- http-json: the same POST with each input's values in JSON `data` (a flat list, made
  before the timed loop) and the answer's JSON `data` read back with `np.asarray`.

Every call makes a new request from the caller's data (a new message, a new body: what
a client sends when its inputs are new), so the client's figures include encoding the
request and decoding the answer. Each HTTP path has one aiohttp session whose connector
holds a kept-alive connection per caller. Before measuring, one request per size runs on
each path alone: the grpc and http-binary outputs must be equal bit for bit, and the
http-json ones equal to them once read as the output's datatype (the script raises if
not).

Rounds interleave the paths (each round starts one place further along grpc, http-binary,
http-json) so that all three see the same machine; the best round of each is reported
(neighbours on a shared machine only ever slow a round down) with the median beside it,
and CPU milliseconds per 1000 rows of the server process and of this one (the client),
from that best round. Client and server share this machine's cores. Requests go to
`--lane` (bulk by default: the only default lane whose `capacity_rows`, 16 384, holds 8
callers of 1024 rows; a request refused is an error and the script stops: a benchmark
with failures is void). Both wires share the server's `--max-message-bytes` (a JSON body
is about 20 bytes per float32 value). Prints a Markdown table: rows per request | callers
| path | request body | requests/s (best) | rows/s (best) | rows/s (median) | path / grpc
(best) | server and client CPU ms per 1000 rows. The server is stopped on every way out.
Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import dataclasses
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final

import aiohttp
import grpc
import numpy as np
import numpy.typing as npt

from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from laneserve.server.bench.procs import process_cpu_s, start_laneserve
from laneserve.server.bench.script_parts import (
    ClosedLoopDefaults,
    Tensor,
    add_closed_loop_arguments,
    closed_loop_arguments,
    cpu_text,
    describe_host,
    random_arrays,
    size_text,
    tensors_of,
)
from laneserve.server.demo_model import make_demo_model
from laneserve.server.kserve_convert import KSERVE_DTYPES
from laneserve.server.kserve_json import (
    ALL_BINARY_PARAMETER,
    BINARY_SIZE_PARAMETER,
    HEADER_LENGTH,
)

Arrays = list[npt.NDArray[Any]]
GRPC: Final = "grpc"
HTTP_BINARY: Final = "http-binary"
HTTP_JSON: Final = "http-json"
PATHS: Final = (GRPC, HTTP_BINARY, HTTP_JSON)
CALL_TIMEOUT_S: Final = 120.0


def main() -> int:
    args = parse_args()
    # Terminated like Ctrl-C, so that the `finally` below stops the server process too.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(args.model) if args.model else Path(scratch) / "demo.onnx"
        if not args.model:
            make_demo_model(model)
        print(f"# bench_http: {describe_host()}", file=sys.stderr)
        server = start_laneserve(
            str(model),
            max_batch_size=args.max_batch_size,
            intra_op_threads=args.intra_op_threads,
            device="auto",
            extra_args=[
                "--http-port",
                "0",
                "--max-message-bytes",
                str(args.max_message_bytes),
            ],
        )
        try:
            if server.http_target is None:
                raise SystemExit("the server's startup line names no HTTP port")
            http_base = f"http://{server.http_target}"
            results = asyncio.run(
                measure(server.target, http_base, server.processes[0].pid, model.stem, args)
            )
        finally:
            server.stop()
    print_table(results, args)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = ClosedLoopDefaults(
        [1, 64, 1024],
        [1, 8],
        2.5,
        "server and channel message limit, HTTP bodies too (default 64 MiB, the server's)",
    )
    add_closed_loop_arguments(parser, defaults)
    return closed_loop_arguments(parser)


# ---- the model's tensors -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
    """What every call names and sends: the served model, the lane, the inputs."""

    name: str
    lane: str
    inputs: list[Tensor]

    def random_inputs(self, rows: int, seed: int) -> Arrays:
        return random_arrays(self.inputs, rows, np.random.default_rng(seed))


# ---- the three paths -----------------------------------------------------------------------


class Wire(abc.ABC):
    """One path: `prepare` turns a caller's inputs into what its calls encode (before
    the timed loop), `infer` makes one call and returns the outputs read from the answer,
    `body_bytes` is the size of the request it sends."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def prepare(self, inputs: Arrays) -> Any:
        return inputs

    @abc.abstractmethod
    async def infer(self, prepared: Any) -> Arrays: ...

    @abc.abstractmethod
    def body_bytes(self, prepared: Any) -> int: ...


class GrpcWire(Wire):
    def __init__(self, model: Model, stub: kpb_grpc.GRPCInferenceServiceAsyncStub) -> None:
        super().__init__(model)
        self.stub = stub

    def request(self, inputs: Arrays) -> kpb.ModelInferRequest:
        """Each input's bytes in raw_input_contents, as tritonclient sends them."""
        message = kpb.ModelInferRequest(model_name=self.model.name)
        message.parameters["lane"].string_param = self.model.lane
        for tensor, array in zip(self.model.inputs, inputs, strict=True):
            message.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=array.shape)
            message.raw_input_contents.append(array.tobytes())
        return message

    async def infer(self, prepared: Arrays) -> Arrays:
        answer = await self.stub.ModelInfer(self.request(prepared), timeout=CALL_TIMEOUT_S)
        return [
            np.frombuffer(raw, dtype=KSERVE_DTYPES[output.datatype]).reshape(tuple(output.shape))
            for output, raw in zip(answer.outputs, answer.raw_output_contents, strict=True)
        ]

    def body_bytes(self, prepared: Arrays) -> int:
        return self.request(prepared).ByteSize()


class HttpWire(Wire):
    def __init__(self, model: Model, session: aiohttp.ClientSession, base: str) -> None:
        super().__init__(model)
        self.session = session
        self.url = f"{base}/v2/models/{model.name}/infer"

    @abc.abstractmethod
    def encode(self, prepared: Any) -> tuple[bytes, dict[str, str]]:
        """The request's body and headers."""

    @abc.abstractmethod
    def decode(self, body: bytes, header_length: str | None) -> Arrays: ...

    async def infer(self, prepared: Any) -> Arrays:
        body, headers = self.encode(prepared)
        async with self.session.post(self.url, data=body, headers=headers) as response:
            answer = await response.read()
            if response.status != HTTPStatus.OK:
                said = answer[:500].decode(errors="replace")
                raise RuntimeError(f"POST {self.url}: HTTP {response.status}: {said}")
            return self.decode(answer, response.headers.get(HEADER_LENGTH))

    def body_bytes(self, prepared: Any) -> int:
        return len(self.encode(prepared)[0])


class BinaryWire(HttpWire):
    """Triton's binary tensor data both ways, as tritonclient.http sends it with
    binary_data=True and binary_data_output=True."""

    def encode(self, prepared: Arrays) -> tuple[bytes, dict[str, str]]:
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": tensor.name,
                        "shape": list(array.shape),
                        "datatype": tensor.datatype,
                        "parameters": {BINARY_SIZE_PARAMETER: array.nbytes},
                    }
                    for tensor, array in zip(self.model.inputs, prepared, strict=True)
                ],
                "parameters": {"lane": self.model.lane, ALL_BINARY_PARAMETER: True},
            }
        ).encode()
        # The arrays' own (C-contiguous) buffers: one copy, into the body.
        body = b"".join([header, *(array.data for array in prepared)])
        return body, {HEADER_LENGTH: str(len(header)), "Content-Type": "application/octet-stream"}

    def decode(self, body: bytes, header_length: str | None) -> Arrays:
        if header_length is None:
            raise RuntimeError(f"POST {self.url}: the answer has no {HEADER_LENGTH} header")
        at = int(header_length)
        outputs = []
        for output in json.loads(body[:at])["outputs"]:
            dtype = KSERVE_DTYPES[output["datatype"]]
            size = output["parameters"][BINARY_SIZE_PARAMETER]
            values = np.frombuffer(body, dtype=dtype, count=size // dtype.itemsize, offset=at)
            outputs.append(values.reshape(output["shape"]))
            at += size
        return outputs


class JsonWire(HttpWire):
    """Every tensor's values in JSON `data`, both ways."""

    def prepare(self, inputs: Arrays) -> list[tuple[list[int], list[Any]]]:
        return [(list(array.shape), array.ravel().tolist()) for array in inputs]

    def encode(self, prepared: list[tuple[list[int], list[Any]]]) -> tuple[bytes, dict[str, str]]:
        body = json.dumps(
            {
                "inputs": [
                    {"name": tensor.name, "shape": shape, "datatype": tensor.datatype, "data": data}
                    for tensor, (shape, data) in zip(self.model.inputs, prepared, strict=True)
                ],
                "parameters": {"lane": self.model.lane},
            }
        ).encode()
        return body, {"Content-Type": "application/json"}

    def decode(self, body: bytes, header_length: str | None) -> Arrays:
        return [
            np.asarray(output["data"], dtype=KSERVE_DTYPES[output["datatype"]]).reshape(
                output["shape"]
            )
            for output in json.loads(body)["outputs"]
        ]


# ---- the measurement -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    requests_per_s: float
    rows_per_s: float
    # CPU milliseconds per 1000 rows, by process ("server", "client": this one).
    cpu_ms_per_krow: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Results:
    # (rows per request, callers, path) -> one Run per round
    runs: dict[tuple[int, int, str], list[Run]]
    # (rows per request, path) -> bytes of one request's body (the gRPC message's)
    body_bytes: dict[tuple[int, str], int]


async def measure(
    target: str, http_base: str, server_pid: int, model_name: str, args: argparse.Namespace
) -> Results:
    limit = [
        ("grpc.max_send_message_length", args.max_message_bytes),
        ("grpc.max_receive_message_length", args.max_message_bytes),
    ]
    most_callers = max(args.callers)
    timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
    async with (
        grpc.aio.insecure_channel(target, options=limit) as channel,
        # One session per HTTP path, a kept-alive connection per caller.
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=most_callers), timeout=timeout
        ) as binary_session,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=most_callers), timeout=timeout
        ) as json_session,
    ):
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        metadata = await stub.ModelMetadata(
            kpb.ModelMetadataRequest(name=model_name), timeout=CALL_TIMEOUT_S
        )
        model = Model(model_name, args.lane, tensors_of(metadata.inputs))
        wires: dict[str, Wire] = {
            GRPC: GrpcWire(model, stub),
            HTTP_BINARY: BinaryWire(model, binary_session, http_base),
            HTTP_JSON: JsonWire(model, json_session, http_base),
        }
        return await rounds(wires, model, server_pid, args)


async def rounds(
    wires: dict[str, Wire], model: Model, server_pid: int, args: argparse.Namespace
) -> Results:
    # Caller c's inputs for each size: its own data, the same on every path.
    data = {
        rows: [model.random_inputs(rows, seed) for seed in range(max(args.callers))]
        for rows in args.rows
    }
    body_bytes: dict[tuple[int, str], int] = {}
    for rows in args.rows:
        await check_outputs_agree(wires, data[rows][0], rows)
        for path, wire in wires.items():
            body_bytes[rows, path] = wire.body_bytes(wire.prepare(data[rows][0]))
            # Warm-up: one call of each caller at once, each path.
            await calls(wire, [wire.prepare(inputs) for inputs in data[rows]], 0.0, at_least=1)
    runs: dict[tuple[int, int, str], list[Run]] = {
        (rows, count, path): [] for rows in args.rows for count in args.callers for path in PATHS
    }
    for number in range(args.rounds):
        order = PATHS[number % len(PATHS) :] + PATHS[: number % len(PATHS)]
        for rows in args.rows:
            for count in args.callers:
                for path in order:
                    run = await phase(
                        wires[path], data[rows][:count], server_pid, rows, args.seconds
                    )
                    runs[rows, count, path].append(run)
                    print(
                        f"# round {number + 1}: {rows} rows, {count} callers, {path}: "
                        f"{run.requests_per_s:,.1f} requests/s, {run.rows_per_s:,.0f} rows/s, "
                        f"CPU ms per 1000 rows {cpu_text(run.cpu_ms_per_krow)}",
                        file=sys.stderr,
                    )
    return Results(runs, body_bytes)


async def check_outputs_agree(wires: dict[str, Wire], inputs: Arrays, rows: int) -> None:
    """One request of `rows` rows on each path, alone: grpc's and http-binary's outputs
    equal bit for bit, http-json's equal to them once read as the output's datatype."""
    answers = {path: await wire.infer(wire.prepare(inputs)) for path, wire in wires.items()}
    expected = answers[GRPC]
    for path in (HTTP_BINARY, HTTP_JSON):
        got = answers[path]
        same = len(got) == len(expected) and all(
            a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
            for a, b in zip(expected, got, strict=False)
        )
        if not same:
            raise RuntimeError(
                f"{rows} rows: {path}'s outputs ({[(a.dtype.name, a.shape) for a in got]}) "
                f"differ from grpc's ({[(a.dtype.name, a.shape) for a in expected]})"
            )


async def phase(
    wire: Wire, inputs: list[Arrays], server_pid: int, rows: int, seconds: float
) -> Run:
    """Every caller calling back to back for `seconds` (the call in flight then ends and
    counts); timed until the last one ends."""
    prepared = [wire.prepare(each) for each in inputs]
    client_cpu_s, server_cpu_s = time.process_time(), process_cpu_s(server_pid)
    started = time.perf_counter()
    requests = await calls(wire, prepared, started + seconds)
    elapsed_s = time.perf_counter() - started
    krows = requests * rows / 1000
    cpu = {"server": math.nan, "client": (time.process_time() - client_cpu_s) * 1000 / krows}
    server_now_s = process_cpu_s(server_pid)
    if server_cpu_s is not None and server_now_s is not None:
        cpu["server"] = (server_now_s - server_cpu_s) * 1000 / krows
    return Run(requests / elapsed_s, requests * rows / elapsed_s, cpu)


async def calls(wire: Wire, prepared: list[Any], deadline_s: float, *, at_least: int = 0) -> int:
    """Requests made: one caller per entry of `prepared`, calling back to back until
    `deadline_s` (perf_counter seconds) and at least `at_least` times."""

    async def caller(request: Any) -> int:
        made = 0
        while made < at_least or time.perf_counter() < deadline_s:
            await wire.infer(request)
            made += 1
        return made

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(caller(request)) for request in prepared]
    return sum(task.result() for task in tasks)


# ---- the report ----------------------------------------------------------------------------


def print_table(results: Results, args: argparse.Namespace) -> None:
    print(
        f"{args.rounds} rounds of {args.seconds:g} s per path; lane {args.lane}; batch cap "
        f"{args.max_batch_size}; best round's CPU; host {describe_host()}"
    )
    print()
    print(
        "| rows per request | callers | path | request body | requests/s (best) "
        "| rows/s (best) | rows/s (median) | path / grpc (best) "
        "| server CPU ms per 1000 rows | client CPU ms per 1000 rows |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        for count in args.callers:
            grpc_best = _best(results.runs[rows, count, GRPC])
            for path in PATHS:
                best = _best(results.runs[rows, count, path])
                median = statistics.median(
                    run.rows_per_s for run in results.runs[rows, count, path]
                )
                print(
                    f"| {rows:,} | {count} | {path} | {size_text(results.body_bytes[rows, path])} "
                    f"| {best.requests_per_s:,.1f} | {best.rows_per_s:,.0f} | {median:,.0f} "
                    f"| {best.rows_per_s / grpc_best.rows_per_s:.2f}x "
                    f"| {best.cpu_ms_per_krow['server']:.1f} "
                    f"| {best.cpu_ms_per_krow['client']:.1f} |"
                )


def _best(runs: Sequence[Run]) -> Run:
    return max(runs, key=lambda run: run.rows_per_s)


if __name__ == "__main__":
    sys.exit(main())
