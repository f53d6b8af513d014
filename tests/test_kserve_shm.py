"""Triton's system shared memory and model repository extensions over KServe v2 gRPC
(server/shared_memory.py, server/kserve.py): real gRPC to a real in-process server with a
real ONNX Runtime session, real POSIX shared memory objects (files of /dev/shm this test
creates, maps and unlinks, as a caller's shm_open would), called through stubs generated
from grpc_predict_v2.proto, as tritonclient calls."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import mmap
import os
import resource
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest

from laneserve.client.tensors import decode_strings, encode_strings
from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from laneserve.server import LaneServer, ServerConfig, kserve_convert
from laneserve.server import kserve as kserve_module
from laneserve.server.addresses import host_port
from laneserve.server.cli import _parser, _serve_config
from laneserve.server.config import MODEL_NAME_RULE, ConfigError
from laneserve.server.errors import RegionLimitError
from laneserve.server.model_identity import write_varint
from laneserve.server.shared_memory import (
    BYTE_SIZE_PARAMETER,
    MAX_REGIONS,
    OFFSET_PARAMETER,
    REGION_PARAMETER,
    SHM_DIRECTORY,
    Placement,
    SharedMemoryRegions,
    is_local_peer,
    placement_of,
    region_limit,
)
from laneserve.v1 import inference_pb2 as pb
from tests.support import (
    F32,
    RecordingEngine,
    Serving,
    config,
    one_running_and_queued,
    rich_status,
    rows,
    serving,
    until,
)
from tests.test_kserve import (
    LABELS,
    NUMBERS,
    TAGGED,
    TEXT,
    _engine,
    kserve_stub,
    outputs_of,
    raw_request,
)

if TYPE_CHECKING:  # the async stub's type is in the generated .pyi alone
    from laneserve.kserve.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceAsyncStub as Stub

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

Request = kpb.ModelInferRequest
MODEL = "small"  # the small model's file stem: the name it is served under
INPUT_ROW_BYTES = 512 * 4  # the small model's input: [N, 512] FP32
OUTPUT_ROW_BYTES = 10 * 4  # its output: [N, 10] FP32
PAGE_BYTES = mmap.ALLOCATIONGRANULARITY
# What a new object holds before anything is written: bytes a server write must change
# where it writes, and leave where it does not.
FILLER = b"\xab"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
REFUSED = grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND = grpc.StatusCode.NOT_FOUND
# ServerMetadata's extensions while server.shared_memory is true.
EXTENSIONS = [
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "statistics",
    "trace",
    "logging",
]


# ---- POSIX shared memory objects, as a caller creates them ---------------------------------


@dataclasses.dataclass
class SharedObject:
    """A shared memory object this test created (shm_open(key) opens the same file),
    mapped whole."""

    key: str  # "/name", as tritonclient's create_shared_memory_region takes it
    path: Path
    mapping: mmap.mmap

    def read(self, offset: int, byte_size: int) -> bytes:
        return self.mapping[offset : offset + byte_size]

    def write(self, offset: int, data: bytes) -> None:
        self.mapping[offset : offset + len(data)] = data


class SharedMemory:
    """Makes files of /dev/shm under unique names and removes every one at `close`."""

    def __init__(self) -> None:
        self._made: list[Path] = []
        self._objects: list[SharedObject] = []

    def new_path(self) -> Path:
        path = SHM_DIRECTORY / f"laneserve-test-{uuid.uuid4().hex}"
        self._made.append(path)
        return path

    def create(self, byte_size: int) -> SharedObject:
        """An object of `byte_size` bytes of FILLER."""
        path = self.new_path()
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, byte_size)
            mapping = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)  # the mapping keeps the object's pages
        mapping[:] = FILLER * byte_size
        made = SharedObject(f"/{path.name}", path, mapping)
        self._objects.append(made)
        return made

    def close(self) -> None:
        for made in self._objects:
            made.mapping.close()
        for path in self._made:
            path.unlink(missing_ok=True)


@pytest.fixture
def shm() -> Iterator[SharedMemory]:
    made = SharedMemory()
    try:
        yield made
    finally:
        made.close()


def key_of(path: Path) -> str:
    return f"/{path.name}"


# ---- requests ------------------------------------------------------------------------------


def place(parameters: Any, at: Placement, *, kind: str = "int64_param") -> None:
    """Triton's shared memory parameters for a tensor at `at`, its sizes as `kind`; the
    offset only where it is not 0, as tritonclient's set_shared_memory sets them."""
    parameters[REGION_PARAMETER].string_param = at.region
    setattr(parameters[BYTE_SIZE_PARAMETER], kind, at.byte_size)
    if at.offset:
        setattr(parameters[OFFSET_PARAMETER], kind, at.offset)


def shm_request(
    x: F32,
    *,
    input_at: Placement | None = None,
    output_at: Placement | None = None,
    request_id: str = "",
    kind: str = "int64_param",
) -> Request:
    """A ModelInfer request for `x`: its bytes in raw_input_contents, or placed in
    shared memory at `input_at` (and then none there); its output in the answer, or
    placed at `output_at`."""
    message = Request(model_name=MODEL, id=request_id)
    tensor = message.inputs.add(name="input", datatype="FP32", shape=x.shape)
    if input_at is None:
        message.raw_input_contents.append(x.tobytes())
    else:
        place(tensor.parameters, input_at, kind=kind)
    if output_at is not None:
        place(message.outputs.add(name="output").parameters, output_at, kind=kind)
    return message


def input_bytes(x: F32) -> int:
    return int(x.shape[0]) * INPUT_ROW_BYTES


def output_bytes(x: F32) -> int:
    return int(x.shape[0]) * OUTPUT_ROW_BYTES


async def register(
    stub: Stub, name: str, made: SharedObject, *, offset: int = 0, byte_size: int | None = None
) -> None:
    """Registers `made` as region `name` (from `offset` to its end by default)."""
    size = len(made.mapping) - offset if byte_size is None else byte_size
    await stub.SystemSharedMemoryRegister(
        kpb.SystemSharedMemoryRegisterRequest(
            name=name, key=made.key, offset=offset, byte_size=size
        )
    )


async def plain_output(stub: Stub, x: F32) -> bytes:
    """The output's bytes a ModelInfer with `x` in raw_input_contents answers."""
    return outputs_of(await stub.ModelInfer(raw_request(MODEL, input=x)))["output"].tobytes()


async def refused(call: Awaitable[Any], code: grpc.StatusCode, reason: str, fragment: str) -> str:
    """Awaits `call`, which must fail with `code`, ErrorInfo `reason` and `fragment` in
    its details; returns its details."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    details = str(caught.value.details())
    assert (caught.value.code(), rich_status(caught.value)[0]) == (code, reason), details
    assert fragment in details, details
    return details


async def status_of(stub: Stub, name: str = "") -> dict[str, tuple[str, str, int, int]]:
    """SystemSharedMemoryStatus's regions: name -> (name, key, offset, byte_size)."""
    answer = await stub.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest(name=name))
    return {
        key: (region.name, region.key, region.offset, region.byte_size)
        for key, region in answer.regions.items()
    }


def shm_config(model: Path, **fields: Any) -> ServerConfig:
    """`config` with shared memory turned on (server.shared_memory, off by default)."""
    return config(model, shared_memory=True, **fields)


@contextlib.asynccontextmanager
async def serving_on(
    model: Path, host: str, target_host: str, **fields: Any
) -> AsyncIterator[Stub]:
    """A started server bound to `host` (`serving` binds 127.0.0.1 only), and a KServe
    stub on a channel to it through `target_host`; always stopped afterwards."""
    engine = RecordingEngine(str(model))
    served = shm_config(model, host=host, port=0, metrics_port=-1, **fields)
    server = LaneServer(engine, served)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(host_port(target_host, port)) as channel:
            yield kpb_grpc.GRPCInferenceServiceStub(channel)
    finally:
        await server.stop(grace_s=5.0)


def routed_ipv4() -> str:
    """This host's IPv4 address on its default route: what a caller elsewhere reaches it
    by. A UDP socket's connect sends nothing; it picks the source address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.1", 9))  # TEST-NET-3 (RFC 5737): never answered
        except OSError as error:
            raise AssertionError(
                f"this test needs an IPv4 route off the host (a non-loopback address): {error}"
            ) from error
        address: str = probe.getsockname()[0]
    assert not ipaddress.ip_address(address).is_loopback, address
    return address


# ---- who is on this host --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5", True),
        ("ipv4:127.3.4.5:5", True),  # all of 127/8 is loopback
        ("ipv4:10.0.0.1:5", False),
        ("ipv4:192.0.2.2:42038", False),
        # gRPC's own spelling of an IPv6 peer: the brackets percent-encoded.
        ("ipv6:%5B::1%5D:5", True),
        ("ipv6:[::1]:5", True),
        ("ipv6:%5B::ffff:127.0.0.1%5D:5", True),  # IPv4-mapped loopback
        ("ipv6:%5B::ffff:10.0.0.1%5D:5", False),
        ("ipv6:%5B2001:db8::1%5D:5", False),
        ("ipv6:%5Bfe80::1%25eth0%5D:5", False),  # a zone is no loopback
        ("unix:/tmp/x.sock", True),
        ("unix:", True),  # what gRPC reports for a caller on a Unix socket
        ("unix-abstract:x", True),
        ("ipv4:localhost:5", False),  # a name is no address
        ("ipv4:127.0.0.1", False),  # no port: the host is cut off
        ("garbage", False),
        ("", False),
    ],
)
def test_is_local_peer_takes_loopback_and_unix_socket_peers_only(peer: str, local: bool) -> None:
    assert is_local_peer(peer) is local


# ---- ModelInfer with tensors in shared memory ---------------------------------------------


def test_model_infer_reads_its_input_from_and_writes_its_output_to_shared_memory(
    small_model: Path, shm: SharedMemory
) -> None:
    """40 rows placed in region "in", the output placed in region "out" (two regions of
    one object): the region holds, bit for bit, what a ModelInfer with raw contents
    answers; the answer's raw_output_contents entry is empty, its outputs[] entry has
    the name, datatype and shape, and no parameters."""
    x = rows(40, seed=7)
    made = shm.create(2 * PAGE_BYTES + input_bytes(x))
    made.write(0, x.tobytes())
    out_offset = input_bytes(x) + PAGE_BYTES

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            expected = await plain_output(stub, x)
            await register(stub, "in", made, byte_size=input_bytes(x))
            await register(stub, "out", made, offset=out_offset)
            answer = await stub.ModelInfer(
                shm_request(
                    x,
                    input_at=Placement("in", 0, input_bytes(x)),
                    output_at=Placement("out", 0, output_bytes(x)),
                    request_id="shm-1",
                )
            )
            assert (answer.model_name, answer.model_version, answer.id) == (MODEL, "1", "shm-1")
            (tensor,) = answer.outputs
            assert (tensor.name, tensor.datatype, list(tensor.shape)) == (
                "output",
                "FP32",
                [40, 10],
            )
            assert not tensor.parameters
            assert list(answer.raw_output_contents) == [b""]
            assert made.read(out_offset, output_bytes(x)) == expected, "bit for bit"
            assert made.read(out_offset + output_bytes(x), 1) == FILLER, "nothing past it"

    asyncio.run(scenario())


def test_regions_and_placements_at_offsets_that_are_not_page_aligned(
    small_model: Path, shm: SharedMemory
) -> None:
    """Regions registered 100 bytes and a page and 100 bytes into their object, tensors
    placed 1000 and 12 bytes into them, the input crossing a page: each read and written
    exactly there, the bytes around left alone."""
    x = rows(3, seed=8)
    made = shm.create(4 * PAGE_BYTES)
    in_region, in_offset = PAGE_BYTES + 100, 1000
    out_region, out_offset = 100, 12
    made.write(in_region + in_offset, x.tobytes())

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            expected = await plain_output(stub, x)
            await register(stub, "in", made, offset=in_region, byte_size=2 * PAGE_BYTES)
            await register(stub, "out", made, offset=out_region, byte_size=PAGE_BYTES)
            await stub.ModelInfer(
                shm_request(
                    x,
                    input_at=Placement("in", in_offset, input_bytes(x)),
                    output_at=Placement("out", out_offset, output_bytes(x)),
                )
            )
            start = out_region + out_offset
            assert made.read(start, output_bytes(x)) == expected
            assert made.read(start - 1, 1) == made.read(start + output_bytes(x), 1) == FILLER

    asyncio.run(scenario())


def test_placement_sizes_given_as_uint64_params_are_read(
    small_model: Path, shm: SharedMemory
) -> None:
    """shared_memory_byte_size and shared_memory_offset as uint64_param (Triton's server
    takes either kind) place the tensors as int64_param's do."""
    x = rows(2, seed=9)
    made = shm.create(2 * PAGE_BYTES)
    made.write(8, x.tobytes())

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "r", made)
            message = shm_request(
                x,
                input_at=Placement("r", 8, input_bytes(x)),
                output_at=Placement("r", 6000, output_bytes(x)),
                kind="uint64_param",
            )
            await stub.ModelInfer(message)
            assert made.read(6000, output_bytes(x)) == await plain_output(stub, x)

    asyncio.run(scenario())


def test_an_input_in_shared_memory_with_its_output_in_the_answer_and_the_reverse(
    small_model: Path, shm: SharedMemory
) -> None:
    """The small model has one input and one output: mixing is the input in shared
    memory with the output in raw_output_contents, or the input in raw_input_contents
    with the output in shared memory."""
    x = rows(5, seed=10)
    made = shm.create(PAGE_BYTES + input_bytes(x))
    made.write(0, x.tobytes())
    out_offset = input_bytes(x) + 64

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            expected = await plain_output(stub, x)
            await register(stub, "r", made)
            from_shm = await stub.ModelInfer(
                shm_request(x, input_at=Placement("r", 0, input_bytes(x)))
            )
            assert outputs_of(from_shm)["output"].tobytes() == expected
            to_shm = await stub.ModelInfer(
                shm_request(x, output_at=Placement("r", out_offset, output_bytes(x)))
            )
            assert list(to_shm.raw_output_contents) == [b""]
            assert [(t.name, list(t.shape)) for t in to_shm.outputs] == [("output", [5, 10])]
            assert made.read(out_offset, output_bytes(x)) == expected

    asyncio.run(scenario())


def test_shared_memory_inputs_count_toward_max_message_bytes(
    small_model: Path, shm: SharedMemory
) -> None:
    """With max_message_bytes 64 KiB and a region of 128 KiB: 20 rows (40 KiB) from the
    region are answered, 40 rows (80 KiB) refused naming max_message_bytes, as a message
    carrying them would be."""
    made = shm.create(128 * 1024)
    made.write(0, rows(40, seed=11).tobytes())

    async def scenario() -> None:
        async with serving(
            RecordingEngine(str(small_model)), shm_config(small_model, max_message_bytes=64 * 1024)
        ) as s:
            stub = kserve_stub(s)
            await register(stub, "r", made)
            fits = rows(20, seed=11)
            answer = await stub.ModelInfer(
                shm_request(fits, input_at=Placement("r", 0, input_bytes(fits)))
            )
            assert outputs_of(answer)["output"].tobytes() == await plain_output(stub, fits)
            details = await refused(
                stub.ModelInfer(shm_request(rows(40), input_at=Placement("r", 0, 40 * 2048))),
                INVALID,
                "INVALID_INPUT",
                "input 'input' asks for 81920 bytes of shared memory, over the ",
            )
            assert "of the request's max_message_bytes (65536, " in details
            # 31 rows from the region fit alone, not with 4 KiB of the message's own (a
            # field this server does not know, kept unparsed): the two are counted together.
            most = rows(31, seed=11)
            placed = shm_request(most, input_at=Placement("r", 0, input_bytes(most)))
            await stub.ModelInfer(placed)
            padded = placed.SerializeToString() + _unknown_field(4096)
            await refused(
                _raw_model_infer(s)(padded),
                INVALID,
                "INVALID_INPUT",
                "input 'input' asks for 63488 bytes of shared memory, over the ",
            )

    asyncio.run(scenario())


def _unknown_field(size: int) -> bytes:
    """A length-delimited field numbered 1000 (none of ModelInferRequest's) of `size`
    bytes, as a message from a newer schema carries one."""
    return write_varint(1000 << 3 | 2) + write_varint(size) + b"p" * size


def _raw_model_infer(s: Serving) -> Callable[[bytes], Awaitable[kpb.ModelInferResponse]]:
    """ModelInfer with the request's bytes as given."""
    call: Callable[[bytes], Awaitable[kpb.ModelInferResponse]] = s.channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=lambda data: data,
        response_deserializer=kpb.ModelInferResponse.FromString,
    )
    return call


@dataclasses.dataclass(frozen=True)
class Fault:
    """A request that must be refused `code` and `reason` with `fragment`."""

    request: Callable[[], Request]
    fragment: str
    code: grpc.StatusCode = INVALID
    reason: str = "INVALID_INPUT"


def _with_contents(message: Request, x: F32) -> Request:
    message.inputs[0].contents.fp32_contents.extend(x.ravel().tolist())
    return message


def _with_raw(message: Request, x: F32) -> Request:
    message.raw_input_contents.append(x.tobytes())
    return message


def _with_parameter(message: Request, key: str, **value: Any) -> Request:
    message.inputs[0].parameters[key].CopyFrom(kpb.InferParameter(**value))
    return message


def _with_output_parameter(message: Request, key: str, **value: Any) -> Request:
    message.outputs.add(name="output").parameters[key].CopyFrom(kpb.InferParameter(**value))
    return message


REGION_BYTES = 8 * INPUT_ROW_BYTES  # region "r" of the faults below
ONE = rows(1, seed=12)
AT_0 = Placement("r", 0, INPUT_ROW_BYTES)
PLACEMENT_FAULTS: dict[str, Fault] = {
    "input in an unregistered region": Fault(
        lambda: shm_request(ONE, input_at=Placement("nope", 0, INPUT_ROW_BYTES)),
        "input 'input' is placed in region 'nope', which is not registered; expected a "
        "region registered by SystemSharedMemoryRegister (registered: ['r'])",
        NOT_FOUND,
        "REGION_NOT_FOUND",
    ),
    "input past the region's end": Fault(
        lambda: shm_request(ONE, input_at=Placement("r", REGION_BYTES - 2047, 2048)),
        "input 'input' is placed at bytes 14337 to 16385 of region 'r', which has 16384",
    ),
    "output in an unregistered region": Fault(
        lambda: shm_request(ONE, output_at=Placement("nope", 0, OUTPUT_ROW_BYTES)),
        "output 'output' is placed in region 'nope', which is not registered",
        NOT_FOUND,
        "REGION_NOT_FOUND",
    ),
    "output past the region's end": Fault(
        lambda: shm_request(ONE, output_at=Placement("r", REGION_BYTES - 39, OUTPUT_ROW_BYTES)),
        "output 'output' is placed at bytes 16345 to 16385 of region 'r', which has 16384",
    ),
    "input in a region and in contents": Fault(
        lambda: _with_contents(shm_request(ONE, input_at=AT_0), ONE),
        "input 'input' is placed in shared memory (region 'r') and has contents; expected "
        "its data in one place",
    ),
    "raw contents for the input in a region": Fault(
        lambda: _with_raw(shm_request(ONE, input_at=AT_0), ONE),
        "request has 1 raw_input_contents for 0 inputs (1 more in shared memory); expected "
        "one per input not in shared memory",
    ),
    "input bytes short of its shape": Fault(
        lambda: shm_request(ONE, input_at=Placement("r", 0, INPUT_ROW_BYTES - 4)),
        "input 'input' has shared_memory_byte_size 2044 in region 'r'; expected 2048, the "
        "bytes of its shape [1, 512] of FP32",
    ),
    "an unknown input parameter": Fault(
        lambda: _with_parameter(raw_request(MODEL, input=ONE), "binary_data_size", int64_param=4),
        "input 'input' has parameters ['binary_data_size']; expected none, or Triton's "
        "shared memory ones: 'shared_memory_region' (string_param), 'shared_memory_byte_size' "
        "and optionally 'shared_memory_offset' (int64_param or uint64_param)",
    ),
    "an unknown parameter beside a placement": Fault(
        lambda: _with_parameter(shm_request(ONE, input_at=AT_0), "binary_data", bool_param=True),
        "input 'input' has parameters ['binary_data']",
    ),
    "an unknown output parameter": Fault(
        lambda: _with_output_parameter(
            raw_request(MODEL, input=ONE), "classification", int64_param=3
        ),
        "output 'output' has parameters ['classification']",
    ),
    "a byte size without a region": Fault(
        lambda: _with_parameter(
            raw_request(MODEL, input=ONE), BYTE_SIZE_PARAMETER, int64_param=2048
        ),
        "input 'input' has ['shared_memory_byte_size'] without 'shared_memory_region'",
    ),
    "a region without a byte size": Fault(
        lambda: _with_parameter(raw_request(MODEL, input=ONE), REGION_PARAMETER, string_param="r"),
        "input 'input' has 'shared_memory_region' without 'shared_memory_byte_size'",
    ),
    "a region named by a number": Fault(
        lambda: _with_parameter(shm_request(ONE, input_at=AT_0), REGION_PARAMETER, int64_param=1),
        "input 'input''s parameter 'shared_memory_region' is int64_param; expected string_param",
    ),
    "a byte size as a string": Fault(
        lambda: _with_parameter(
            shm_request(ONE, input_at=AT_0), BYTE_SIZE_PARAMETER, string_param="2048"
        ),
        "input 'input''s parameter 'shared_memory_byte_size' is string_param; expected "
        "int64_param or uint64_param",
    ),
    "a negative offset": Fault(
        lambda: _with_parameter(shm_request(ONE, input_at=AT_0), OFFSET_PARAMETER, int64_param=-1),
        "input 'input' has shared_memory_offset -1; expected bytes >= 0",
    ),
}


def test_each_placement_fault_is_refused_naming_it(small_model: Path, shm: SharedMemory) -> None:
    """One server, one region "r" of 16 KiB, every faulty placement: refused in words
    naming the fault, INVALID_ARGUMENT INVALID_INPUT, or NOT_FOUND REGION_NOT_FOUND for a
    region not registered (as Triton's server)."""
    made = shm.create(REGION_BYTES)
    made.write(0, ONE.tobytes())

    async def scenario() -> dict[str, str]:
        failures: dict[str, str] = {}
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "r", made)
            for name, fault in PLACEMENT_FAULTS.items():
                try:
                    await stub.ModelInfer(fault.request(), timeout=30)
                except grpc.aio.AioRpcError as error:
                    got = (error.code(), rich_status(error)[0])
                    if got != (fault.code, fault.reason) or fault.fragment not in str(
                        error.details()
                    ):
                        failures[name] = f"{got}: {error.details()}"
                else:
                    failures[name] = "answered OK"
        return failures

    assert asyncio.run(scenario()) == {}


def test_an_output_placement_too_small_for_the_answer_refuses_the_model_infer(
    small_model: Path, shm: SharedMemory
) -> None:
    """An output of 40 bytes placed where 39 fit is refused before the request runs (its
    size is known: the model's output is rows x 10 float32), naming both sizes; nothing
    is written into the region. Placed where 40 fit, the same request is answered."""
    x = rows(1, seed=13)
    made = shm.create(PAGE_BYTES)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "out", made)
            await refused(
                stub.ModelInfer(shm_request(x, output_at=Placement("out", 0, 39))),
                INVALID,
                "INVALID_INPUT",
                "output 'output' is 40 bytes for the request's 1 rows, over the 39 of its "
                "shared_memory_byte_size in region 'out'",
            )
            assert made.read(0, PAGE_BYTES) == FILLER * PAGE_BYTES
            await stub.ModelInfer(shm_request(x, output_at=Placement("out", 0, 40)))
            assert made.read(0, 40) == await plain_output(stub, x)

    asyncio.run(scenario())


def test_an_output_placement_too_small_is_counted_a_refusal_not_an_answer(
    small_model: Path, shm: SharedMemory
) -> None:
    """Refused before it runs, it is counted as Infer counts a refusal (the default lane's
    rejected INVALID_INPUT), never answered OK: refused once written, it had been."""
    made = shm.create(PAGE_BYTES)

    async def scenario() -> pb.LaneStats:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "out", made)
            await refused(
                stub.ModelInfer(shm_request(ONE, output_at=Placement("out", 0, 39))),
                INVALID,
                "INVALID_INPUT",
                "output 'output' is 40 bytes",
            )
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        return next(lane for lane in stats.lanes if lane.name == "standard")

    standard = asyncio.run(scenario())
    assert "OK" not in standard.answered, dict(standard.answered)
    counted = standard.answered.get("INVALID_INPUT", 0) + standard.rejected.get("INVALID_INPUT", 0)
    assert counted == 1, (dict(standard.answered), dict(standard.rejected))


def test_a_region_whose_object_shrank_is_refused_not_read(
    small_model: Path, shm: SharedMemory
) -> None:
    """An object truncated under its registered region: a tensor placed in it is refused
    naming the object's size now (read through a mapping, it faulted the server)."""
    made = shm.create(3 * PAGE_BYTES)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "r", made)
            os.truncate(made.path, 100)  # the test's own mapping is not touched again
            for message in (
                shm_request(ONE, input_at=AT_0),
                shm_request(ONE, output_at=Placement("r", 0, OUTPUT_ROW_BYTES)),
            ):
                await refused(
                    stub.ModelInfer(message),
                    INVALID,
                    "INVALID_INPUT",
                    f"region 'r''s object {made.key!r} is now 100 bytes, short of the "
                    f"{3 * PAGE_BYTES} it had when registered",
                )
            assert (await stub.ServerLive(kpb.ServerLiveRequest())).live

    asyncio.run(scenario())


# ---- ModelStreamInfer ----------------------------------------------------------------------


def test_stream_items_read_and_write_shared_memory_and_a_bad_region_is_one_items_error(
    small_model: Path, shm: SharedMemory
) -> None:
    """Items of 1, 3, 2 and 5 rows, each read from its own slice of region "in" and
    written to its own slice of region "out", are answered with empty raw contents and
    the region holding a ModelInfer's output bytes for their rows; an item whose output
    or input names a region not registered is answered with its error, and the items
    after it are answered."""
    arrays = [rows(count, seed=20 + count) for count in (1, 3, 2, 5)]
    out_region = 12 * PAGE_BYTES  # "in" is what comes before, "out" one page from there
    made = shm.create(out_region + PAGE_BYTES)
    placements: list[tuple[Placement, Placement]] = []
    in_offset = out_offset = 0
    for x in arrays:
        made.write(in_offset, x.tobytes())
        placements.append(
            (
                Placement("in", in_offset, input_bytes(x)),
                Placement("out", out_offset, output_bytes(x)),
            )
        )
        in_offset += input_bytes(x)
        out_offset += output_bytes(x)
    items = [
        shm_request(x, input_at=at_in, output_at=at_out, request_id=f"i{index}")
        for index, (x, (at_in, at_out)) in enumerate(zip(arrays, placements, strict=True))
    ]
    items[2:2] = [
        shm_request(ONE, output_at=Placement("gone", 0, 40), request_id="lost-out"),
        shm_request(ONE, input_at=Placement("gone", 0, 2048), request_id="lost-in"),
    ]

    async def scenario() -> tuple[list[kpb.ModelStreamInferResponse], list[bytes]]:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "in", made, byte_size=out_region)
            await register(stub, "out", made, offset=out_region)
            call = stub.ModelStreamInfer(iter(items), timeout=30)
            answers = [answer async for answer in call]
            expected = [await plain_output(stub, x) for x in arrays]
        return answers, expected

    answers, expected = asyncio.run(scenario())
    by_id = {answer.infer_response.id: answer for answer in answers}
    assert sorted(by_id) == ["i0", "i1", "i2", "i3", "lost-in", "lost-out"]
    for index, (x, (_, at_out)) in enumerate(zip(arrays, placements, strict=True)):
        answer = by_id[f"i{index}"]
        assert answer.error_message == "", answer.error_message
        response = answer.infer_response
        assert [(t.name, list(t.shape)) for t in response.outputs] == [("output", [x.shape[0], 10])]
        assert list(response.raw_output_contents) == [b""]
        assert made.read(out_region + at_out.offset, at_out.byte_size) == expected[index]
    for item_id, what in (("lost-out", "output 'output'"), ("lost-in", "input 'input'")):
        assert by_id[item_id].error_message.startswith(
            f"NOT_FOUND REGION_NOT_FOUND: [request id: {item_id}] {what} is placed in "
            "region 'gone', which is not registered"
        ), by_id[item_id].error_message


# ---- the registry: status, register, unregister --------------------------------------------


def test_status_lists_the_registered_regions_and_an_unknown_name_is_not_found(
    small_model: Path, shm: SharedMemory
) -> None:
    first, second = shm.create(PAGE_BYTES), shm.create(3 * PAGE_BYTES)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            assert await status_of(stub) == {}
            await register(stub, "a", first)
            await register(stub, "b", second, offset=100, byte_size=5000)
            assert await status_of(stub) == {
                "a": ("a", first.key, 0, PAGE_BYTES),
                "b": ("b", second.key, 100, 5000),
            }
            assert await status_of(stub, "b") == {"b": ("b", second.key, 100, 5000)}
            await refused(
                stub.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest(name="c")),
                grpc.StatusCode.NOT_FOUND,
                "REGION_NOT_FOUND",
                "no region 'c' is registered; expected one of ['a', 'b'] (name '' lists them all)",
            )

    asyncio.run(scenario())


def test_registering_a_name_twice_is_refused_already_exists(
    small_model: Path, shm: SharedMemory
) -> None:
    """The second registration is refused naming the one held, which stays."""
    first, second = shm.create(PAGE_BYTES), shm.create(PAGE_BYTES)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "r", first, byte_size=100)
            await refused(
                register(stub, "r", second),
                grpc.StatusCode.ALREADY_EXISTS,
                "REGION_EXISTS",
                f"region 'r' is registered already (key {first.key!r}, 100 bytes at offset 0)",
            )
            assert await status_of(stub) == {"r": ("r", first.key, 0, 100)}

    asyncio.run(scenario())


def test_unregister_lets_go_of_one_region_or_every_one_and_an_unknown_name_is_no_error(
    small_model: Path, shm: SharedMemory
) -> None:
    made = shm.create(PAGE_BYTES)

    async def unregister(stub: Stub, name: str) -> None:
        await stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest(name=name))

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            for name in ("a", "b", "c"):
                await register(stub, name, made)
            await unregister(stub, "a")
            assert sorted(await status_of(stub)) == ["b", "c"]
            await unregister(stub, "nope")
            assert sorted(await status_of(stub)) == ["b", "c"]
            await refused(
                stub.ModelInfer(shm_request(ONE, input_at=Placement("a", 0, 2048))),
                NOT_FOUND,
                "REGION_NOT_FOUND",
                "region 'a', which is not registered; expected a region registered by "
                "SystemSharedMemoryRegister (registered: ['b', 'c'])",
            )
            await unregister(stub, "")
            assert await status_of(stub) == {}
            assert s.server.shared_memory.status("") == []
            await register(stub, "a", made, byte_size=10)  # the name is free again
            assert await status_of(stub) == {"a": ("a", made.key, 0, 10)}

    asyncio.run(scenario())


def test_each_register_fault_is_refused_invalid_argument_naming_it(
    small_model: Path, shm: SharedMemory
) -> None:
    """A key with no object, a key that is no shm_open name, a symbolic link or a FIFO in
    /dev/shm, bytes past the object's end, byte_size 0, and a name empty or too long:
    each refused naming the fault, and nothing registered."""
    made = shm.create(PAGE_BYTES)
    missing = shm.new_path()
    link = shm.new_path()
    link.symlink_to(made.path)
    fifo = shm.new_path()
    os.mkfifo(fifo, 0o600)
    faults: list[tuple[str, str, int, int, str]] = [  # name, key, offset, byte_size, words
        (
            "r",
            key_of(missing),
            0,
            10,
            (
                f"shared memory object {key_of(missing)!r} cannot be opened for reading and "
                "writing (No such file or directory"
            ),
        ),
        ("r", "/a/b", 0, 10, "shared memory key '/a/b' is no shm_open name"),
        ("r", "", 0, 10, "shared memory key '' is no shm_open name"),
        ("r", "/..", 0, 10, "shared memory key '/..' is no shm_open name"),
        ("r", "/" + "k" * 256, 0, 10, "is no shm_open name; expected '/' and then 1 to 255"),
        ("r", key_of(link), 0, 10, f"{key_of(link)!r} cannot be opened for reading and writing"),
        ("r", key_of(fifo), 0, 10, f"{key_of(fifo)!r} is not a regular file"),
        (
            "r",
            made.key,
            100,
            PAGE_BYTES,
            (
                f"region 'r' asks for bytes 100 to {PAGE_BYTES + 100} of shared memory "
                f"object {made.key!r}, which has {PAGE_BYTES}"
            ),
        ),
        ("r", made.key, 0, 0, "region 'r' has byte_size 0; expected 1 byte or more"),
        ("", made.key, 0, 10, f"region name is ''; expected {MODEL_NAME_RULE}"),
        ("n" * 257, made.key, 0, 10, "region name is 257 bytes (starting 'nnn"),
        # A model name's rule: no control character, no whitespace at either end.
        (
            "\x00\n",
            made.key,
            0,
            10,
            (
                "region name is '\\x00\\n', which holds the control character '\\x00'; "
                f"expected {MODEL_NAME_RULE}"
            ),
        ),
        ("r\x7f", made.key, 0, 10, "region name is 'r\\x7f', which holds the control character"),
        ("r ", made.key, 0, 10, "region name is 'r '; expected 1 to 256 bytes"),
    ]

    async def scenario() -> dict[str, str]:
        failures: dict[str, str] = {}
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            for name, key, offset, byte_size, fragment in faults:
                message = kpb.SystemSharedMemoryRegisterRequest(
                    name=name, key=key, offset=offset, byte_size=byte_size
                )
                try:
                    await stub.SystemSharedMemoryRegister(message)
                except grpc.aio.AioRpcError as error:
                    got = (error.code(), rich_status(error)[0])
                    if got != (INVALID, "INVALID_INPUT") or fragment not in str(error.details()):
                        failures[fragment] = f"{got}: {error.details()}"
                else:
                    failures[fragment] = "registered"
            assert await status_of(stub) == {}
        return failures

    assert asyncio.run(scenario()) == {}


def _open_at(fd: int, path: Path) -> bool:
    """Whether this process's file descriptor `fd` is open on `path`."""
    try:
        return Path(f"/proc/self/fd/{fd}").readlink() == path
    except FileNotFoundError:
        return False


def test_the_server_lets_go_of_its_regions_as_it_stops(
    small_model: Path, shm: SharedMemory
) -> None:
    made = shm.create(PAGE_BYTES)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            await register(kserve_stub(s), "r", made)
            (region,) = s.server.shared_memory.status("")
            assert _open_at(region.fd, made.path)
        assert s.server.shared_memory.status("") == []
        assert not _open_at(region.fd, made.path)

    asyncio.run(scenario())


# ---- who may use shared memory -------------------------------------------------------------


def shared_memory_calls(stub: Stub, made: SharedObject) -> list[Callable[[], Awaitable[Any]]]:
    """Every use of shared memory: registering, listing all and one, unregistering, an
    input and an output placed in a region."""
    return [
        lambda: register(stub, "r", made),
        lambda: stub.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest()),
        lambda: stub.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest(name="r")),
        lambda: stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest()),
        lambda: stub.ModelInfer(shm_request(ONE, input_at=AT_0)),
        lambda: stub.ModelInfer(shm_request(ONE, output_at=Placement("r", 0, 40))),
    ]


def test_shared_memory_turned_off_refuses_every_use_permission_denied(
    small_model: Path, shm: SharedMemory
) -> None:
    """server.shared_memory = false: registering, listing, unregistering and a tensor
    placed in a region are refused PERMISSION_DENIED SHARED_MEMORY_REFUSED, ServerMetadata
    lists no system_shared_memory, and ModelInfer with raw contents is answered."""
    made = shm.create(PAGE_BYTES)
    off = "shared memory is off on this server (server.shared_memory = false, the default"

    async def scenario() -> None:
        async with serving(
            RecordingEngine(str(small_model)), config(small_model, shared_memory=False)
        ) as s:
            stub = kserve_stub(s)
            for call in shared_memory_calls(stub, made):
                await refused(call(), REFUSED, "SHARED_MEMORY_REFUSED", off)
            # Refused that first, whatever else is wrong with the placement.
            wrong_size = shm_request(ONE, input_at=Placement("r", 0, INPUT_ROW_BYTES - 4))
            await refused(stub.ModelInfer(wrong_size), REFUSED, "SHARED_MEMORY_REFUSED", off)
            metadata = await stub.ServerMetadata(kpb.ServerMetadataRequest())
            assert list(metadata.extensions) == [
                name for name in EXTENSIONS if name != "system_shared_memory"
            ]
            assert len(await plain_output(stub, ONE)) == OUTPUT_ROW_BYTES
            assert s.server.shared_memory.status("") == []

    asyncio.run(scenario())


def test_a_caller_on_another_host_is_refused_shared_memory(
    small_model: Path, shm: SharedMemory
) -> None:
    """Served on 0.0.0.0 and called through this host's routed address (a peer that is
    not loopback, as a caller elsewhere is): every shared memory call and placement is
    refused PERMISSION_DENIED naming the peer, a stream's item placing a tensor too (the
    stream's peer judged, the stream going on); raw contents are answered."""
    address = routed_ipv4()
    made = shm.create(PAGE_BYTES)

    async def scenario() -> None:
        async with serving_on(small_model, "0.0.0.0", address) as stub:  # noqa: S104 - on purpose
            remote = (
                "shared memory is for callers on the server's host, and this call comes "
                f"from 'ipv4:{address}:"
            )
            for call in shared_memory_calls(stub, made):
                await refused(call(), REFUSED, "SHARED_MEMORY_REFUSED", remote)
            assert len(await plain_output(stub, ONE)) == OUTPUT_ROW_BYTES
            items = [
                shm_request(ONE, output_at=Placement("r", 0, 40), request_id="placed"),
                shm_request(ONE, request_id="plain"),
            ]
            answers = {
                answer.infer_response.id: answer.error_message
                async for answer in stub.ModelStreamInfer(iter(items), timeout=30)
            }
            assert answers["placed"].startswith(
                "PERMISSION_DENIED SHARED_MEMORY_REFUSED: [request id: placed] "
            ), answers
            assert answers["plain"] == "", answers

    asyncio.run(scenario())


def test_a_caller_over_ipv6_loopback_may_use_shared_memory(
    small_model: Path, shm: SharedMemory
) -> None:
    """gRPC names such a peer "ipv6:%5B::1%5D:PORT": on this host."""
    x = rows(2, seed=30)
    made = shm.create(PAGE_BYTES)
    made.write(0, x.tobytes())

    async def scenario() -> None:
        async with serving_on(small_model, "::1", "::1") as stub:
            await register(stub, "r", made)
            assert await status_of(stub) == {"r": ("r", made.key, 0, PAGE_BYTES)}
            at_out = Placement("r", 3000, output_bytes(x))
            await stub.ModelInfer(
                shm_request(x, input_at=Placement("r", 0, input_bytes(x)), output_at=at_out)
            )
            assert made.read(3000, output_bytes(x)) == await plain_output(stub, x)

    asyncio.run(scenario())


# ---- CUDA shared memory: none -----------------------------------------------------------


def test_cuda_shared_memory_is_refused_unimplemented_and_lists_none(small_model: Path) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            await refused(
                stub.CudaSharedMemoryRegister(
                    kpb.CudaSharedMemoryRegisterRequest(name="g", byte_size=64)
                ),
                grpc.StatusCode.UNIMPLEMENTED,
                "UNSUPPORTED",
                "laneserve maps no CUDA memory of another process (CUDA IPC)",
            )
            listed = await stub.CudaSharedMemoryStatus(kpb.CudaSharedMemoryStatusRequest())
            assert not listed.regions
            await refused(
                stub.CudaSharedMemoryStatus(kpb.CudaSharedMemoryStatusRequest(name="g")),
                grpc.StatusCode.NOT_FOUND,
                "REGION_NOT_FOUND",
                "no CUDA shared memory region 'g' is registered",
            )
            for name in ("g", ""):
                await stub.CudaSharedMemoryUnregister(
                    kpb.CudaSharedMemoryUnregisterRequest(name=name)
                )

    asyncio.run(scenario())


# ---- the model repository ----------------------------------------------------------------


def index_of(answer: kpb.RepositoryIndexResponse) -> list[tuple[str, str, str, str]]:
    return [(model.name, model.version, model.state, model.reason) for model in answer.models]


def test_the_repository_index_lists_the_one_model_ready_and_loads_nothing(
    small_model: Path,
) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            for ready in (False, True):
                answer = await stub.RepositoryIndex(kpb.RepositoryIndexRequest(ready=ready))
                assert index_of(answer) == [(MODEL, "1", "READY", "")]
            await refused(
                stub.RepositoryIndex(kpb.RepositoryIndexRequest(repository_name="x")),
                INVALID,
                "INVALID_INPUT",
                "repository 'x' is not here; expected '' (laneserve serves one model, "
                "'small', from no named repository)",
            )
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                (
                    "loads",
                    lambda: stub.RepositoryModelLoad(
                        kpb.RepositoryModelLoadRequest(model_name=MODEL)
                    ),
                ),
                (
                    "unloads",
                    lambda: stub.RepositoryModelUnload(
                        kpb.RepositoryModelUnloadRequest(model_name=MODEL)
                    ),
                ),
            ]
            for verb, call in calls:
                await refused(
                    call(),
                    grpc.StatusCode.UNIMPLEMENTED,
                    "UNSUPPORTED",
                    f"laneserve {verb} no model while it serves: its one model ('small')",
                )
            assert (await stub.ModelReady(kpb.ModelReadyRequest(name=MODEL))).ready

    asyncio.run(scenario())


def test_while_draining_the_index_lists_the_model_unavailable(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, shm_config(small_model)) as s:
            stub = kserve_stub(s)
            running, queued = await one_running_and_queued(s, engine)
            stopping = asyncio.ensure_future(s.server.stop(grace_s=30))
            await until(lambda: s.server.state.value == "DRAINING")
            answer = await stub.RepositoryIndex(kpb.RepositoryIndexRequest())
            assert index_of(answer) == [(MODEL, "1", "UNAVAILABLE", kserve_module.NOT_READY_REASON)]
            assert "the server is not ready" in kserve_module.NOT_READY_REASON
            ready_only = await stub.RepositoryIndex(kpb.RepositoryIndexRequest(ready=True))
            assert index_of(ready_only) == []
            engine.release()
            await asyncio.gather(running, queued)
            await stopping

    asyncio.run(scenario())


# ---- what a caller's object cannot do to the server ----------------------------------------


def test_outputs_over_the_models_count_are_refused_before_any_is_read(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request asking for more outputs than the model has is refused on its count
    without a placement read of any: a message holds millions of outputs (1 M with a bad
    parameter took 4 s of the event loop to walk)."""
    reads = 0

    def counted(what: str, parameters: Any) -> Placement | None:
        nonlocal reads
        reads += 1
        return placement_of(what, parameters)

    monkeypatch.setattr(kserve_convert, "placement_of", counted)
    message = raw_request(MODEL, input=ONE)
    message.outputs.extend([Request.InferRequestedOutputTensor(name="output")] * 100_000)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            await refused(
                kserve_stub(s).ModelInfer(message), INVALID, "INVALID_INPUT", "100000 outputs"
            )

    asyncio.run(scenario())
    assert reads == 0


def test_a_registered_region_holds_one_open_file(small_model: Path, shm: SharedMemory) -> None:
    """One file per region, no more (a mapping held a second: 500 regions used up a soft
    open-file limit of 1 024 and new connections hung)."""
    made = [shm.create(PAGE_BYTES) for _ in range(40)]

    async def scenario() -> int:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "first", made[0])  # the channel's own files are open now
            before = _open_files()
            for index, each in enumerate(made[1:]):
                await register(stub, f"r{index}", each)
            return _open_files() - before

    # One file each (39); two each were 78. The slack: a file gRPC's threads may open.
    assert asyncio.run(scenario()) < 1.5 * (len(made) - 1)


def _open_files() -> int:
    return sum(1 for _ in Path("/proc/self/fd").iterdir())


def test_a_sparse_object_registered_takes_no_address_space(shm: SharedMemory) -> None:
    """A 4 TiB object made by ftruncate costs no memory; mapped, each region took 4 TiB of
    the server's address space, and ~50 left a 4 MiB request none (the server
    segfaulted). Registered, it takes none; its bytes read as the zeros they are."""
    path = shm.new_path()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4 << 40)
    finally:
        os.close(fd)
    regions = SharedMemoryRegions(enabled=True)
    before = _address_space_kib()
    try:
        regions.register("huge", key_of(path), 0, 4 << 40)
        assert _address_space_kib() - before < 1 << 20  # under 1 GiB
        assert regions.read(Placement("huge", 3 << 40, 8), "input 'x'") == bytes(8)
    finally:
        regions.close()


def _address_space_kib() -> int:
    status = Path("/proc/self/status").read_text(encoding="ascii")
    line = next(line for line in status.splitlines() if line.startswith("VmSize:"))
    return int(line.split()[1])


# Run in a mount namespace of its own over a 1 MiB tmpfs (`_on_a_full_tmpfs`): a sparse
# object there, the tmpfs then filled, and a write and a read of its never-written pages.
_FULL_TMPFS_CHILD = r"""
import os, sys
from pathlib import Path
from laneserve.server.errors import InvalidInputError
from laneserve.server.shared_memory import Placement, SharedMemoryRegions
directory = Path(sys.argv[1])
fd = os.open(directory / "object", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 20)
fill = os.open(directory / "fill", os.O_CREAT | os.O_RDWR, 0o600)
try:
    while True:
        os.write(fill, bytes(65536))
except OSError:
    pass
regions = SharedMemoryRegions(enabled=True, directory=directory)
regions.register("r", "/object", 0, 1 << 20)
print("read", regions.read(Placement("r", 4096, 160), "input 'input'") == bytes(160))
try:
    regions.write(Placement("r", 0, 160), bytes(range(160)), "output 'output'", regions.get("r"))
except InvalidInputError as error:
    print("refused:", error)
"""


def test_a_sparse_object_on_a_full_tmpfs_is_refused_not_a_fault(tmp_path: Path) -> None:
    """Written through a mapping, a never-written page of a full tmpfs faulted the server
    (SIGBUS: a real server exited 135, with no race): the write is refused naming the
    filesystem's error, and a read of such pages gives their zeros."""
    mount = tmp_path / "shm"
    mount.mkdir()
    script = f'mount -t tmpfs -o size=1m tmpfs {mount} && exec {sys.executable} -c "$0" {mount}'
    done = subprocess.run(
        ["unshare", "--map-root-user", "--mount", "bash", "-c", script, _FULL_TMPFS_CHILD],  # noqa: S607
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    assert "read True" in done.stdout, done.stdout
    assert "refused: output 'output' could not be written into region 'r'" in done.stdout
    assert "No space left on device" in done.stdout, done.stdout


async def _held_while_unregistered(
    s: Serving,
    engine: RecordingEngine,
    made: SharedObject,
    call: Callable[[], Awaitable[Any]],
    *,
    meanwhile: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Starts `call` with the engine held, unregisters region "out" while its request
    runs (and runs `meanwhile`), then lets it go."""
    await register(kserve_stub(s), "out", made)
    engine.hold_next()
    running = asyncio.ensure_future(call())
    # Bounded: a request that never runs fails the test instead of hanging the suite.
    assert await asyncio.to_thread(engine.entered.acquire, timeout=30)
    await kserve_stub(s).SystemSharedMemoryUnregister(
        kpb.SystemSharedMemoryUnregisterRequest(name="out")
    )
    if meanwhile is not None:
        await meanwhile()
    engine.release()
    await running


def test_a_model_infer_whose_output_region_went_while_it_ran_is_refused_naming_it(
    small_model: Path, shm: SharedMemory
) -> None:
    made = shm.create(PAGE_BYTES)
    engine = RecordingEngine(str(small_model))

    async def scenario() -> None:
        async with serving(engine, shm_config(small_model)) as s:
            stub = kserve_stub(s)
            request = shm_request(ONE, output_at=Placement("out", 0, OUTPUT_ROW_BYTES))
            fragment = (
                "output 'output' is placed in region 'out', which was unregistered while its "
                "request ran"
            )

            async def call() -> None:
                await refused(stub.ModelInfer(request), NOT_FOUND, "REGION_NOT_FOUND", fragment)

            await _held_while_unregistered(s, engine, made, call)
            assert made.read(0, PAGE_BYTES) == FILLER * PAGE_BYTES

    asyncio.run(scenario())


def test_an_output_goes_into_the_region_it_was_checked_against_or_none(
    small_model: Path, shm: SharedMemory
) -> None:
    """Region "out" unregistered and registered again over another object while its
    request runs: the output goes into neither (not into an object the request never
    named, perhaps another caller's), and the request is refused NOT_FOUND."""
    made, other = shm.create(PAGE_BYTES), shm.create(PAGE_BYTES)
    engine = RecordingEngine(str(small_model))

    async def scenario() -> None:
        async with serving(engine, shm_config(small_model)) as s:
            stub = kserve_stub(s)
            request = shm_request(ONE, output_at=Placement("out", 0, OUTPUT_ROW_BYTES))

            async def call() -> None:
                await refused(
                    stub.ModelInfer(request), NOT_FOUND, "REGION_NOT_FOUND", "while its request ran"
                )

            async def register_other() -> None:
                await register(stub, "out", other)

            await _held_while_unregistered(s, engine, made, call, meanwhile=register_other)

    asyncio.run(scenario())
    assert made.read(0, PAGE_BYTES) == FILLER * PAGE_BYTES
    assert other.read(0, PAGE_BYTES) == FILLER * PAGE_BYTES


def test_a_stream_item_whose_output_region_went_while_it_ran_gets_one_error_answer(
    small_model: Path, shm: SharedMemory
) -> None:
    """Its answer is the error; the stream goes on and answers the next item."""
    made = shm.create(PAGE_BYTES)
    engine = RecordingEngine(str(small_model))

    async def scenario() -> list[kpb.ModelStreamInferResponse]:
        async with serving(engine, shm_config(small_model)) as s:
            queue: asyncio.Queue[Request | None] = asyncio.Queue()

            async def items() -> AsyncIterator[Request]:
                while (item := await queue.get()) is not None:
                    yield item

            stream = kserve_stub(s).ModelStreamInfer(items(), timeout=30)
            answers: list[kpb.ModelStreamInferResponse] = []

            async def first() -> None:
                at = Placement("out", 0, OUTPUT_ROW_BYTES)
                await queue.put(shm_request(ONE, output_at=at, request_id="a"))
                answers.append(await _stream_answer(stream))

            await _held_while_unregistered(s, engine, made, first)
            await queue.put(shm_request(ONE, request_id="b"))
            answers.append(await _stream_answer(stream))
            await queue.put(None)
            return answers

    first, second = asyncio.run(scenario())
    assert first.infer_response.id == "a"
    assert first.error_message.startswith("NOT_FOUND REGION_NOT_FOUND: [request id: a] ")
    assert "which was unregistered while its request ran" in first.error_message
    assert (second.infer_response.id, second.error_message) == ("b", "")


async def _stream_answer(stream: Any) -> kpb.ModelStreamInferResponse:
    answer = await stream.read()
    assert isinstance(answer, kpb.ModelStreamInferResponse)
    return answer


def test_shared_memory_is_off_by_default_and_a_setting_and_a_flag(tmp_path: Path) -> None:
    assert ServerConfig(model_path="m.onnx").shared_memory is False
    with pytest.raises(ConfigError, match=r"server\.shared_memory: expected true or false"):
        ServerConfig(model_path="m.onnx", shared_memory=1)  # type: ignore[arg-type]
    settings = tmp_path / "laneserve.toml"
    settings.write_text("[server]\nshared_memory = true\n", encoding="utf-8")
    for argv, expected in (
        ([], False),
        (["--shared-memory"], True),
        (["--config", str(settings)], True),
        (["--config", str(settings), "--no-shared-memory"], False),
    ):
        args = _parser().parse_args(["serve", "--model", "m.onnx", *argv])
        assert _serve_config(args)[0].shared_memory is expected, argv


@contextlib.contextmanager
def _open_file_limit(soft: int) -> Iterator[None]:
    """This process's soft open-file limit lowered to `soft` within, restored after."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_regions_are_bounded_by_a_quarter_of_the_open_file_limit(shm: SharedMemory) -> None:
    """Under a soft limit of 64 files, 16 regions: the 17th is refused REGION_LIMIT, and
    registers once one is unregistered."""
    made = shm.create(PAGE_BYTES)
    with _open_file_limit(64):
        assert region_limit() == 16
        regions = SharedMemoryRegions(enabled=True)
    try:
        for index in range(16):
            regions.register(f"r{index}", made.key, 0, PAGE_BYTES)
        with pytest.raises(RegionLimitError, match="16 regions are registered, the most"):
            regions.register("r16", made.key, 0, PAGE_BYTES)
        regions.unregister("r0")
        regions.register("r16", made.key, 0, PAGE_BYTES)
    finally:
        regions.close()
    assert region_limit() == min(MAX_REGIONS, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)


def test_a_region_with_no_file_left_to_open_is_refused_region_limit(shm: SharedMemory) -> None:
    """Out of files (EMFILE) before the bound: refused REGION_LIMIT naming the open-file
    limit, not INVALID_ARGUMENT blaming the caller's key."""
    made = shm.create(PAGE_BYTES)
    regions = SharedMemoryRegions(enabled=True)
    try:
        with _open_file_limit(_open_files() + 2), pytest.raises(RegionLimitError) as caught:
            _register_many(regions, made, 8)
        assert "the server has no file left to open shared memory object" in str(caught.value)
        assert "open-file limit" in str(caught.value)
    finally:
        regions.close()


def _register_many(regions: SharedMemoryRegions, made: SharedObject, count: int) -> None:
    for index in range(count):
        regions.register(f"r{index}", made.key, 0, PAGE_BYTES)


# ---- BYTES in shared memory --------------------------------------------------------------


_TEXT_BYTES = encode_strings("text", TEXT)
_NUMBERS_BYTES = encode_strings("numbers", NUMBERS)
_TAGGED_BYTES = encode_strings("tagged", np.array(TAGGED, dtype=object))


def text_shm_request(
    *, text_at: Placement | None = None, tagged_at: Placement | None = None
) -> Request:
    """The text model's request for TEXT and NUMBERS: text's serialized bytes (each
    element a 4-byte length and its UTF-8, as tritonclient's serialize_byte_tensor writes
    them) placed at `text_at`, or in raw contents with numbers'; output tagged placed at
    `tagged_at` (with label asked for in the answer), or every output in the answer."""
    message = Request(model_name="text")
    text = message.inputs.add(name="text", datatype="BYTES", shape=[4])
    message.inputs.add(name="numbers", datatype="BYTES", shape=[4, 2])
    if text_at is None:
        message.raw_input_contents.append(_TEXT_BYTES)
    else:
        place(text.parameters, text_at)
    message.raw_input_contents.append(_NUMBERS_BYTES)
    if tagged_at is not None:
        place(message.outputs.add(name="tagged").parameters, tagged_at)
        message.outputs.add(name="label")
    return message


def test_bytes_tensors_are_read_from_and_written_to_shared_memory_serialized(
    text_model: Path, shm: SharedMemory
) -> None:
    """A BYTES input placed in a region as tritonclient's simple_grpc_shm_string_client
    places one (its serialized bytes, byte_size their size) and a BYTES output placed in
    a region larger than it: the output's serialized bytes are written at its placement,
    nothing past them, and read back as the strings a ModelInfer with raw contents
    answers; its raw_output_contents entry is empty, the label beside it in the answer."""
    made = shm.create(2 * PAGE_BYTES)
    made.write(100, _TEXT_BYTES)

    async def scenario() -> kpb.ModelInferResponse:
        async with serving(_engine(text_model), shm_config(text_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "in", made, byte_size=PAGE_BYTES)
            await register(stub, "out", made, offset=PAGE_BYTES)
            return await stub.ModelInfer(
                text_shm_request(
                    text_at=Placement("in", 100, len(_TEXT_BYTES)),
                    tagged_at=Placement("out", 10, PAGE_BYTES - 10),
                )
            )

    answer = asyncio.run(scenario())
    assert [(t.name, t.datatype, list(t.shape)) for t in answer.outputs] == [
        ("tagged", "BYTES", [4]),
        ("label", "INT64", [4]),
    ]
    assert answer.raw_output_contents[0] == b""
    assert np.frombuffer(answer.raw_output_contents[1], "<i8").tolist() == LABELS
    written = made.read(PAGE_BYTES + 10, len(_TAGGED_BYTES))
    assert written == _TAGGED_BYTES
    assert decode_strings("tagged", written, 4).tolist() == TAGGED
    assert made.read(PAGE_BYTES + 10 + len(_TAGGED_BYTES), 1) == FILLER, "nothing past it"
    assert made.read(PAGE_BYTES, 10) == FILLER * 10, "nothing before it"


def test_bytes_placements_that_do_not_hold_their_text_are_refused_naming_it(
    text_model: Path, shm: SharedMemory
) -> None:
    """A BYTES input's byte_size under a length per element (refused before it is read,
    naming the placement), or one that cuts its last element short or runs past its
    last (refused as its data is read, naming the element): INVALID_ARGUMENT. A BYTES
    output's placement under a length per element is refused before the request runs;
    one that holds that much but not the text is refused once it has run (its size is
    known then), naming both sizes; neither is written into its region."""
    made = shm.create(PAGE_BYTES)
    made.write(0, _TEXT_BYTES + b"\x00")
    size = len(_TEXT_BYTES)

    async def scenario() -> None:
        async with serving(_engine(text_model), shm_config(text_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "in", made, byte_size=size + 1)
            await register(stub, "out", made, offset=PAGE_BYTES // 2)
            under_lengths = (
                "input 'text' has shared_memory_byte_size 15 in region 'in'; expected at least "
                "16 for its shape [4] of BYTES"
            )
            for byte_size, fragment in [
                (15, under_lengths),
                (size - 1, "tensor 'text': element 3 says 3 bytes, 2 are left"),
                (size + 1, "tensor 'text': data has 1 byte after its 4 string elements"),
            ]:
                await refused(
                    stub.ModelInfer(text_shm_request(text_at=Placement("in", 0, byte_size))),
                    INVALID,
                    "INVALID_INPUT",
                    fragment,
                )
            await refused(
                stub.ModelInfer(text_shm_request(tagged_at=Placement("out", 0, 15))),
                INVALID,
                "INVALID_INPUT",
                "output 'tagged' is at least 16 bytes for the request's 4 rows (a 4-byte length "
                "per element, and its text), over the 15 of its shared_memory_byte_size in "
                "region 'out'",
            )
            await refused(
                stub.ModelInfer(text_shm_request(tagged_at=Placement("out", 0, 20))),
                INVALID,
                "INVALID_INPUT",
                f"output 'tagged' is {len(_TAGGED_BYTES)} bytes, over the 20 of its "
                "shared_memory_byte_size in region 'out'",
            )
            assert made.read(PAGE_BYTES // 2, PAGE_BYTES // 2) == FILLER * (PAGE_BYTES // 2)

    asyncio.run(scenario())
