#!/usr/bin/env python3
"""What Triton's system shared memory saves over tensors in the gRPC message, one host.

    .venv/bin/python scripts/bench_shared_memory.py                  # the demo model, defaults
    .venv/bin/python scripts/bench_shared_memory.py --rows 1,1024,8192 --callers 1,2,8

`laneserve serve --shared-memory` starts in a child process on loopback (shared memory
is off unless asked for, and served to loopback peers only). This process
creates two POSIX shared memory objects (files of /dev/shm under unique names, as
shm_open would) and registers one region over each (`SystemSharedMemoryRegister`): one
for inputs, one for outputs. Each caller owns a slice of both, as large as its largest
request. Then, for each `--rows` value (rows per request) and each `--callers` value
(callers at once, each an asyncio task calling `ModelInfer` back to back on one channel,
closed loop), two paths, each for `--seconds`:

- raw: the input's bytes in `raw_input_contents`, the output read from
  `raw_output_contents`, as tritonclient sends and reads them (a new message per call:
  its inputs are the caller's new data);
- shm: the caller writes its input into its input slice before each call, the request
  places the input and the output in the regions (Triton's `shared_memory_region`,
  `shared_memory_byte_size`, `shared_memory_offset` parameters; the same message every
  call, as a caller reusing its slice sends it), and the caller copies its output out of
  its output slice after the answer.

Both paths copy the caller's input once before the call and its output once after it;
what differs is the bytes in the messages (serialized, sent over loopback, parsed) and
the server's copies out of and into the regions. Before measuring, one request per size
runs on each path alone and the two outputs must be equal bit for bit (the script raises
if not; the shm answer's `raw_output_contents` entry must be empty).

Rounds interleave the paths (odd rounds raw first, even rounds shm first) so that both
see the same machine; the best round of each is reported (neighbours on a shared machine
only ever slow a round down) with the median beside it, and CPU milliseconds per 1000
rows of the server process and of this one (the client), from that best round. Client and
server share this machine's cores. Requests go to `--lane` (bulk by default: the only
default lane whose `capacity_rows`, 16 384, holds 4 callers of 4096 rows; a request that
does not fit is refused and the script stops: a benchmark with failures is void). The
largest raw request must fit `--max-message-bytes` (passed to the server; shared memory
inputs count toward it too). Prints a Markdown table: rows per request | input per
request | callers | path | requests/s (best) | rows/s (best) | rows/s (median) | shm / raw
(best) | CPU ms per 1000 rows (by process). The regions are unregistered and the objects
unlinked on every way out. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import mmap
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

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
from laneserve.server.shared_memory import (
    BYTE_SIZE_PARAMETER,
    OFFSET_PARAMETER,
    REGION_PARAMETER,
    SHM_DIRECTORY,
)

Request = kpb.ModelInferRequest
Response = kpb.ModelInferResponse
RAW: Final = "raw"
SHM: Final = "shm"
PATH_NAMES: Final = {
    RAW: "`ModelInfer`, bytes in the message",
    SHM: "`ModelInfer`, system shared memory",
}
# Room in a request's size for what is not tensor bytes (names, shapes, parameters).
MESSAGE_OVERHEAD_BYTES: Final = 64 * 1024
CALL_TIMEOUT_S: Final = 120.0


def main() -> int:
    args = parse_args()
    # Terminated like Ctrl-C, so that the `finally` blocks below unregister the regions,
    # unlink the objects and stop the server process too.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(args.model) if args.model else Path(scratch) / "demo.onnx"
        if not args.model:
            make_demo_model(model)
        print(f"# bench_shared_memory: {describe_host()}", file=sys.stderr)
        server = start_laneserve(
            str(model),
            max_batch_size=args.max_batch_size,
            intra_op_threads=args.intra_op_threads,
            device="auto",
            # Shared memory is off unless asked for (server.shared_memory).
            extra_args=["--shared-memory", "--max-message-bytes", str(args.max_message_bytes)],
        )
        try:
            tensors, runs = asyncio.run(
                measure(server.target, server.processes[0].pid, model.stem, args)
            )
        finally:
            server.stop()
    print_table(tensors, runs, args)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_closed_loop_arguments(parser, ClosedLoopDefaults([1, 256, 4096], [1, 4], 1.5))
    return closed_loop_arguments(parser)


# ---- the model's tensors and where each caller's bytes lie ---------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where caller `c`'s slice of tensor `t` lies in its region: from
    `c * caller_bytes + starts[t]`, `max_rows` rows of `t`."""

    tensors: list[Tensor]
    max_rows: int
    starts: list[int]
    caller_bytes: int

    @classmethod
    def of(cls, tensors: list[Tensor], max_rows: int) -> Layout:
        starts, at = [], 0
        for tensor in tensors:
            starts.append(at)
            at += max_rows * tensor.row_bytes
        return cls(tensors, max_rows, starts, at)

    def offset(self, caller: int, index: int) -> int:
        return caller * self.caller_bytes + self.starts[index]


# ---- POSIX shared memory objects, made and removed here ------------------------------------


@dataclasses.dataclass(frozen=True)
class SharedObject:
    key: str  # "/name": what shm_open takes, and SystemSharedMemoryRegister's key
    mapping: mmap.mmap  # the whole object


@contextlib.contextmanager
def shared_object(byte_size: int) -> Iterator[SharedObject]:
    """A new object of `byte_size` bytes under a unique name, mapped; unlinked on exit."""
    path = SHM_DIRECTORY / f"laneserve-bench-{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.ftruncate(fd, byte_size)
            mapping = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)  # the mapping keeps the object's pages
        try:
            yield SharedObject(f"/{path.name}", mapping)
        finally:
            # Views into the mapping still held (by a traceback's frames) keep it open;
            # it goes with this process then, and the name is gone either way.
            with contextlib.suppress(BufferError):
                mapping.close()
    finally:
        path.unlink(missing_ok=True)


@contextlib.asynccontextmanager
async def registered(
    stub: kpb_grpc.GRPCInferenceServiceAsyncStub, objects: dict[str, SharedObject]
) -> AsyncIterator[None]:
    """Registers each object whole as the region named by its key in `objects`; every
    name is unregistered on exit (a name asked for, in case the server registered it
    though the call failed: unregistering an unknown name is no error)."""
    asked: list[str] = []
    try:
        for name, made in objects.items():
            asked.append(name)
            await stub.SystemSharedMemoryRegister(
                kpb.SystemSharedMemoryRegisterRequest(
                    name=name, key=made.key, offset=0, byte_size=len(made.mapping)
                ),
                timeout=CALL_TIMEOUT_S,
            )
        yield
    finally:
        for name in asked:
            try:
                await stub.SystemSharedMemoryUnregister(
                    kpb.SystemSharedMemoryUnregisterRequest(name=name), timeout=CALL_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as error:  # the server may be gone: the objects still go
                print(
                    f"# unregistering {name}: {error.code().name}: {error.details()}",
                    file=sys.stderr,
                )


# ---- callers -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Regions:
    inputs: str
    outputs: str


class Caller:
    """One caller: its input data (`max_rows` rows of each input, its own), views of its
    input slices and the offsets of its output slices."""

    def __init__(
        self,
        index: int,
        inputs: Layout,
        outputs: Layout,
        input_object: SharedObject,
        output_object: SharedObject,
    ) -> None:
        rng = np.random.default_rng(index)
        self.inputs = inputs
        self.outputs = outputs
        self.output_mapping = output_object.mapping
        self.data = random_arrays(inputs.tensors, inputs.max_rows, rng)
        self.input_views = [
            np.ndarray(
                (inputs.max_rows, *tensor.row_shape),
                dtype=tensor.dtype,
                buffer=input_object.mapping,
                offset=inputs.offset(index, number),
            )
            for number, tensor in enumerate(inputs.tensors)
        ]
        self.output_offsets = [
            outputs.offset(index, number) for number in range(len(outputs.tensors))
        ]
        self.input_offsets = [inputs.offset(index, number) for number in range(len(inputs.tensors))]

    def raw_request(self, model: str, lane: str, rows: int) -> Request:
        """Each input's bytes in raw_input_contents, as tritonclient sends them."""
        message = Request(model_name=model)
        message.parameters["lane"].string_param = lane
        for tensor, data in zip(self.inputs.tensors, self.data, strict=True):
            message.inputs.add(
                name=tensor.name, datatype=tensor.datatype, shape=(rows, *tensor.row_shape)
            )
            message.raw_input_contents.append(data[:rows].tobytes())
        return message

    def shm_request(self, model: str, lane: str, rows: int, regions: Regions) -> Request:
        """Every input and output placed in this caller's slices, as tritonclient's
        set_shared_memory places them."""
        message = Request(model_name=model)
        message.parameters["lane"].string_param = lane
        for tensor, offset in zip(self.inputs.tensors, self.input_offsets, strict=True):
            placed = message.inputs.add(
                name=tensor.name, datatype=tensor.datatype, shape=(rows, *tensor.row_shape)
            )
            _place(placed.parameters, regions.inputs, offset, rows * tensor.row_bytes)
        for tensor, offset in zip(self.outputs.tensors, self.output_offsets, strict=True):
            _place(
                message.outputs.add(name=tensor.name).parameters,
                regions.outputs,
                offset,
                rows * tensor.row_bytes,
            )
        return message

    def write_inputs(self, rows: int) -> None:
        for view, data in zip(self.input_views, self.data, strict=True):
            view[:rows] = data[:rows]

    def read_shm_outputs(self, response: Response) -> list[npt.NDArray[Any]]:
        """Copies of the outputs from this caller's slices (the answer gives their shapes)."""
        return [
            np.frombuffer(
                self.output_mapping,
                dtype=tensor.dtype,
                count=math.prod(answer.shape),
                offset=offset,
            )
            .reshape(tuple(answer.shape))
            .copy()
            for tensor, offset, answer in zip(
                self.outputs.tensors, self.output_offsets, response.outputs, strict=True
            )
        ]

    def spoil_outputs(self, rows: int) -> None:
        """Fills this caller's output slices with 0xff (NaN in floats), so that an output
        the server did not write cannot pass for one it did."""
        for tensor, offset in zip(self.outputs.tensors, self.output_offsets, strict=True):
            self.output_mapping[offset : offset + rows * tensor.row_bytes] = b"\xff" * (
                rows * tensor.row_bytes
            )


def _place(parameters: Any, region: str, offset: int, byte_size: int) -> None:
    parameters[REGION_PARAMETER].string_param = region
    parameters[BYTE_SIZE_PARAMETER].int64_param = byte_size
    parameters[OFFSET_PARAMETER].int64_param = offset


def read_raw_outputs(outputs: list[Tensor], response: Response) -> list[npt.NDArray[Any]]:
    """The outputs from raw_output_contents, as tritonclient's as_numpy reads them."""
    by_name = {tensor.name: tensor for tensor in outputs}
    return [
        np.frombuffer(raw, dtype=by_name[answer.name].dtype).reshape(tuple(answer.shape))
        for answer, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    ]


# ---- the measurement -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    requests_per_s: float
    rows_per_s: float
    # CPU milliseconds per 1000 rows, by process ("server", "client": this one).
    cpu_ms_per_krow: dict[str, float]


# (rows per request, callers, path) -> one Run per round
Runs = dict[tuple[int, int, str], list[Run]]


async def measure(
    target: str, server_pid: int, model: str, args: argparse.Namespace
) -> tuple[list[Tensor], Runs]:
    limit = [
        ("grpc.max_send_message_length", args.max_message_bytes),
        ("grpc.max_receive_message_length", args.max_message_bytes),
    ]
    async with grpc.aio.insecure_channel(target, options=limit) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        metadata = await stub.ModelMetadata(
            kpb.ModelMetadataRequest(name=model), timeout=CALL_TIMEOUT_S
        )
        inputs, outputs = tensors_of(metadata.inputs), tensors_of(metadata.outputs)
        max_rows, most_callers = max(args.rows), max(args.callers)
        largest = max_rows * sum(tensor.row_bytes for tensor in inputs) + MESSAGE_OVERHEAD_BYTES
        if largest > args.max_message_bytes:
            raise SystemExit(
                f"a {max_rows}-row request needs about {largest:,} bytes, over "
                f"--max-message-bytes {args.max_message_bytes:,}: raise it, or lower --rows"
            )
        in_layout, out_layout = Layout.of(inputs, max_rows), Layout.of(outputs, max_rows)
        regions = Regions(f"bench-inputs-{uuid.uuid4().hex}", f"bench-outputs-{uuid.uuid4().hex}")
        with (
            shared_object(most_callers * in_layout.caller_bytes) as input_object,
            shared_object(most_callers * out_layout.caller_bytes) as output_object,
        ):
            async with registered(
                stub, {regions.inputs: input_object, regions.outputs: output_object}
            ):
                callers = [
                    Caller(index, in_layout, out_layout, input_object, output_object)
                    for index in range(most_callers)
                ]
                service = Service(stub, model, args.lane, regions)
                runs = await rounds(service, callers, server_pid, args)
    return inputs, runs


@dataclasses.dataclass(frozen=True)
class Service:
    """What every call names: the server's stub, the served model, the lane, the regions."""

    stub: kpb_grpc.GRPCInferenceServiceAsyncStub
    model: str
    lane: str
    regions: Regions


async def rounds(
    service: Service, callers: list[Caller], server_pid: int, args: argparse.Namespace
) -> Runs:
    for rows in args.rows:
        await check_outputs_agree(service, callers[0], rows)
        for path in (RAW, SHM):  # warm-up: one call of each caller at once, each path
            await calls(service, callers, rows, path, deadline=0.0, at_least=1)
    runs: Runs = {
        (rows, count, path): []
        for rows in args.rows
        for count in args.callers
        for path in (RAW, SHM)
    }
    for number in range(1, args.rounds + 1):
        order = (RAW, SHM) if number % 2 else (SHM, RAW)
        for rows in args.rows:
            for count in args.callers:
                for path in order:
                    run = await phase(
                        service, callers[:count], server_pid, rows, path, args.seconds
                    )
                    runs[rows, count, path].append(run)
                    print(
                        f"# round {number}: {rows} rows, {count} callers, {path}: "
                        f"{run.requests_per_s:,.1f} requests/s, {run.rows_per_s:,.0f} rows/s, "
                        f"CPU ms per 1000 rows {cpu_text(run.cpu_ms_per_krow)}",
                        file=sys.stderr,
                    )
    return runs


async def check_outputs_agree(service: Service, caller: Caller, rows: int) -> None:
    """One request of `rows` rows on each path, alone: the outputs must match bit for bit."""
    raw = read_raw_outputs(
        caller.outputs.tensors,
        await service.stub.ModelInfer(
            caller.raw_request(service.model, service.lane, rows), timeout=CALL_TIMEOUT_S
        ),
    )
    caller.spoil_outputs(rows)
    caller.write_inputs(rows)
    answer = await service.stub.ModelInfer(
        caller.shm_request(service.model, service.lane, rows, service.regions),
        timeout=CALL_TIMEOUT_S,
    )
    if any(answer.raw_output_contents):
        raise RuntimeError(
            f"{rows} rows: an output placed in shared memory came in the message too"
        )
    shm = caller.read_shm_outputs(answer)
    for tensor, expected, got in zip(caller.outputs.tensors, raw, shm, strict=True):
        if expected.shape != got.shape or expected.tobytes() != got.tobytes():
            raise RuntimeError(
                f"{rows} rows: output {tensor.name!r} from shared memory (shape {got.shape}) "
                f"differs from the one in the message (shape {expected.shape})"
            )


async def phase(
    service: Service,
    callers: list[Caller],
    server_pid: int,
    rows: int,
    path: str,
    seconds: float,
) -> Run:
    """Every caller calling back to back for `seconds` (the call in flight then ends and
    counts); timed until the last one ends."""
    client_cpu_s, server_cpu_s = time.process_time(), process_cpu_s(server_pid)
    started = time.perf_counter()
    requests = await calls(service, callers, rows, path, deadline=started + seconds)
    elapsed_s = time.perf_counter() - started
    krows = requests * rows / 1000
    cpu = {"server": math.nan, "client": (time.process_time() - client_cpu_s) * 1000 / krows}
    server_now_s = process_cpu_s(server_pid)
    if server_cpu_s is not None and server_now_s is not None:
        cpu["server"] = (server_now_s - server_cpu_s) * 1000 / krows
    return Run(requests / elapsed_s, requests * rows / elapsed_s, cpu)


async def calls(
    service: Service,
    callers: list[Caller],
    rows: int,
    path: str,
    *,
    deadline: float,
    at_least: int = 0,
) -> int:
    """Requests made: every caller calling back to back, on `path`, until `deadline`
    (perf_counter seconds) and at least `at_least` times."""
    call = call_raw if path == RAW else call_shm
    async with asyncio.TaskGroup() as group:
        tasks = [
            group.create_task(call(service, caller, rows, deadline, at_least)) for caller in callers
        ]
    return sum(task.result() for task in tasks)


async def call_raw(
    service: Service, caller: Caller, rows: int, deadline: float, at_least: int
) -> int:
    """A new message per call, its inputs the caller's (new) data."""
    made = 0
    while made < at_least or time.perf_counter() < deadline:
        answer = await service.stub.ModelInfer(
            caller.raw_request(service.model, service.lane, rows), timeout=CALL_TIMEOUT_S
        )
        read_raw_outputs(caller.outputs.tensors, answer)
        made += 1
    return made


async def call_shm(
    service: Service, caller: Caller, rows: int, deadline: float, at_least: int
) -> int:
    """The same message every call: only the bytes in the caller's slices change."""
    request = caller.shm_request(service.model, service.lane, rows, service.regions)
    made = 0
    while made < at_least or time.perf_counter() < deadline:
        caller.write_inputs(rows)
        answer = await service.stub.ModelInfer(request, timeout=CALL_TIMEOUT_S)
        caller.read_shm_outputs(answer)
        made += 1
    return made


# ---- the report ----------------------------------------------------------------------------


def print_table(inputs: list[Tensor], runs: Runs, args: argparse.Namespace) -> None:
    row_bytes = sum(tensor.row_bytes for tensor in inputs)
    print(
        f"{args.rounds} rounds of {args.seconds:g} s per path; lane {args.lane}; batch cap "
        f"{args.max_batch_size}; input {row_bytes:,} bytes a row; best round's CPU"
    )
    print()
    print(
        "| rows per request | input per request | callers | path | requests/s (best) "
        "| rows/s (best) | rows/s (median) | shm / raw (best) | CPU ms per 1000 rows |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        for count in args.callers:
            raw_best = max(runs[rows, count, RAW], key=lambda run: run.rows_per_s)
            for path in (RAW, SHM):
                best = max(runs[rows, count, path], key=lambda run: run.rows_per_s)
                median = statistics.median(run.rows_per_s for run in runs[rows, count, path])
                ratio = "" if path == RAW else f"{best.rows_per_s / raw_best.rows_per_s:.2f}x"
                print(
                    f"| {rows:,} | {size_text(rows * row_bytes)} | {count} | {PATH_NAMES[path]} "
                    f"| {best.requests_per_s:,.1f} | {best.rows_per_s:,.0f} | {median:,.0f} "
                    f"| {ratio} | {cpu_text(best.cpu_ms_per_krow)} |"
                )


if __name__ == "__main__":
    sys.exit(main())
