"""KServe v2 / Open Inference Protocol over gRPC (server/kserve.py): real gRPC on loopback
to a real in-process server with a real ONNX Runtime session, called through stubs
generated from grpc_predict_v2.proto, as a Triton or KServe client calls."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from onnx import TensorProto, helper, numpy_helper

from laneserve.client.tensors import decode_strings, encode_strings, encode_tensor, numpy_dtype
from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from laneserve.server import Engine, ServerConfig, grpc_accept, kserve_convert
from laneserve.server.cli import _parser, _serve_config
from laneserve.server.config import ConfigError
from laneserve.server.engine import TensorSpec
from laneserve.server.kserve_convert import to_infer_request
from laneserve.server.model_identity import SERVER_VERSION, write_varint
from laneserve.server.shared_memory import CallerRegions, SharedMemoryRegions
from laneserve.v1 import inference_pb2 as pb
from tests.support import (
    RecordingEngine,
    Serving,
    config,
    estimate_once,
    one_running_and_queued,
    output,
    queued_rows,
    request,
    rich_status,
    rows,
    save_model,
    serving,
    until,
    until_stats,
)

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

Request = kpb.ModelInferRequest
Mutate = Callable[[Request], None]


def kserve_stub(s: Serving) -> kpb_grpc.GRPCInferenceServiceAsyncStub:
    return kpb_grpc.GRPCInferenceServiceStub(s.channel)


def raw_request(model: str, **arrays: npt.NDArray[Any]) -> Request:
    """A ModelInfer request as tritonclient builds one: each input's bytes in
    raw_input_contents, in input order."""
    message = Request(model_name=model)
    for name, array in arrays.items():
        tensor = encode_tensor(name, array)
        message.inputs.add(
            name=name, datatype=kserve_convert.kserve_datatype(array.dtype), shape=array.shape
        )
        message.raw_input_contents.append(tensor.data)
    return message


def typed_request(model: str, **arrays: npt.NDArray[Any]) -> Request:
    """The same inputs in each input's typed contents list (no raw contents)."""
    message = Request(model_name=model)
    for name, array in arrays.items():
        datatype = kserve_convert.kserve_datatype(array.dtype)
        tensor = message.inputs.add(name=name, datatype=datatype, shape=array.shape)
        field = {kind.name: kind.contents_field for kind in kserve_convert.KSERVE_TYPES}[datatype]
        assert field is not None, datatype
        values = array.ravel().tolist()
        if datatype == "BYTES":  # one bytes value per element, as tritonclient sends text
            values = [value.encode() for value in values]
        getattr(tensor.contents, field).extend(values)
    return message


def outputs_of(response: kpb.ModelInferResponse) -> dict[str, npt.NDArray[Any]]:
    """The answer's outputs as arrays, read as Triton's client reads them: each output's
    bytes from raw_output_contents, in the order of `outputs` (BYTES's elements each a
    4-byte length and its bytes, as tritonclient's deserialize_bytes_tensor reads them,
    decoded as text)."""
    assert len(response.raw_output_contents) == len(response.outputs)
    dtypes = {kind.name: kind.datatype for kind in kserve_convert.KSERVE_TYPES}
    arrays: dict[str, npt.NDArray[Any]] = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        shape = tuple(tensor.shape)
        if tensor.datatype == "BYTES":
            arrays[tensor.name] = decode_strings(tensor.name, raw, math.prod(shape)).reshape(shape)
        else:
            dtype = numpy_dtype(dtypes[tensor.datatype])
            arrays[tensor.name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return arrays


def parameters(response: kpb.ModelInferResponse) -> dict[str, Any]:
    return {
        key: getattr(value, value.WhichOneof("parameter_choice") or "string_param")
        for key, value in response.parameters.items()
    }


# ---- the wire contract -------------------------------------------------------------------

# The public protocol's messages (the Open Inference Protocol's grpc_predict_v2.proto, whose
# core Triton's grpc_service.proto shares): (field, number, type, repeated), literal, so
# that a renumbered or retyped field of ours fails here, not in a client's decoder.
_T = descriptor_pb2.FieldDescriptorProto
PUBLIC_MESSAGES: dict[str, list[tuple[str, int, int, bool]]] = {
    "ServerLiveResponse": [("live", 1, _T.TYPE_BOOL, False)],
    "ServerReadyResponse": [("ready", 1, _T.TYPE_BOOL, False)],
    "ModelReadyRequest": [
        ("name", 1, _T.TYPE_STRING, False),
        ("version", 2, _T.TYPE_STRING, False),
    ],
    "ModelReadyResponse": [("ready", 1, _T.TYPE_BOOL, False)],
    "ServerMetadataResponse": [
        ("name", 1, _T.TYPE_STRING, False),
        ("version", 2, _T.TYPE_STRING, False),
        ("extensions", 3, _T.TYPE_STRING, True),
    ],
    "ModelMetadataRequest": [
        ("name", 1, _T.TYPE_STRING, False),
        ("version", 2, _T.TYPE_STRING, False),
    ],
    "ModelMetadataResponse": [
        ("name", 1, _T.TYPE_STRING, False),
        ("versions", 2, _T.TYPE_STRING, True),
        ("platform", 3, _T.TYPE_STRING, False),
        ("inputs", 4, _T.TYPE_MESSAGE, True),
        ("outputs", 5, _T.TYPE_MESSAGE, True),
    ],
    "ModelMetadataResponse.TensorMetadata": [
        ("name", 1, _T.TYPE_STRING, False),
        ("datatype", 2, _T.TYPE_STRING, False),
        ("shape", 3, _T.TYPE_INT64, True),
    ],
    "InferParameter": [
        ("bool_param", 1, _T.TYPE_BOOL, False),
        ("int64_param", 2, _T.TYPE_INT64, False),
        ("string_param", 3, _T.TYPE_STRING, False),
        ("double_param", 4, _T.TYPE_DOUBLE, False),
        ("uint64_param", 5, _T.TYPE_UINT64, False),
    ],
    "InferTensorContents": [
        ("bool_contents", 1, _T.TYPE_BOOL, True),
        ("int_contents", 2, _T.TYPE_INT32, True),
        ("int64_contents", 3, _T.TYPE_INT64, True),
        ("uint_contents", 4, _T.TYPE_UINT32, True),
        ("uint64_contents", 5, _T.TYPE_UINT64, True),
        ("fp32_contents", 6, _T.TYPE_FLOAT, True),
        ("fp64_contents", 7, _T.TYPE_DOUBLE, True),
        ("bytes_contents", 8, _T.TYPE_BYTES, True),
    ],
    "ModelInferRequest": [
        ("model_name", 1, _T.TYPE_STRING, False),
        ("model_version", 2, _T.TYPE_STRING, False),
        ("id", 3, _T.TYPE_STRING, False),
        ("parameters", 4, _T.TYPE_MESSAGE, True),
        ("inputs", 5, _T.TYPE_MESSAGE, True),
        ("outputs", 6, _T.TYPE_MESSAGE, True),
        ("raw_input_contents", 7, _T.TYPE_BYTES, True),
    ],
    "ModelInferRequest.InferInputTensor": [
        ("name", 1, _T.TYPE_STRING, False),
        ("datatype", 2, _T.TYPE_STRING, False),
        ("shape", 3, _T.TYPE_INT64, True),
        ("parameters", 4, _T.TYPE_MESSAGE, True),
        ("contents", 5, _T.TYPE_MESSAGE, False),
    ],
    "ModelInferRequest.InferRequestedOutputTensor": [
        ("name", 1, _T.TYPE_STRING, False),
        ("parameters", 2, _T.TYPE_MESSAGE, True),
    ],
    "ModelInferResponse": [
        ("model_name", 1, _T.TYPE_STRING, False),
        ("model_version", 2, _T.TYPE_STRING, False),
        ("id", 3, _T.TYPE_STRING, False),
        ("parameters", 4, _T.TYPE_MESSAGE, True),
        ("outputs", 5, _T.TYPE_MESSAGE, True),
        ("raw_output_contents", 6, _T.TYPE_BYTES, True),
    ],
    "ModelInferResponse.InferOutputTensor": [
        ("name", 1, _T.TYPE_STRING, False),
        ("datatype", 2, _T.TYPE_STRING, False),
        ("shape", 3, _T.TYPE_INT64, True),
        ("parameters", 4, _T.TYPE_MESSAGE, True),
        ("contents", 5, _T.TYPE_MESSAGE, False),
    ],
}


def test_the_messages_are_the_public_protocols_names_numbers_and_types() -> None:
    assert kpb.DESCRIPTOR.package == "inference"
    service = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    assert [(m.name, m.input_type.name, m.output_type.name) for m in service.methods] == [
        ("ServerLive", "ServerLiveRequest", "ServerLiveResponse"),
        ("ServerReady", "ServerReadyRequest", "ServerReadyResponse"),
        ("ModelReady", "ModelReadyRequest", "ModelReadyResponse"),
        ("ServerMetadata", "ServerMetadataRequest", "ServerMetadataResponse"),
        ("ModelMetadata", "ModelMetadataRequest", "ModelMetadataResponse"),
        ("ModelInfer", "ModelInferRequest", "ModelInferResponse"),
        ("ModelStreamInfer", "ModelInferRequest", "ModelStreamInferResponse"),
        ("ModelConfig", "ModelConfigRequest", "ModelConfigResponse"),
        ("ModelStatistics", "ModelStatisticsRequest", "ModelStatisticsResponse"),
        ("RepositoryIndex", "RepositoryIndexRequest", "RepositoryIndexResponse"),
        ("RepositoryModelLoad", "RepositoryModelLoadRequest", "RepositoryModelLoadResponse"),
        ("RepositoryModelUnload", "RepositoryModelUnloadRequest", "RepositoryModelUnloadResponse"),
        *(
            (
                f"{kind}SharedMemory{verb}",
                f"{kind}SharedMemory{verb}Request",
                f"{kind}SharedMemory{verb}Response",
            )
            for kind in ("System", "Cuda")
            for verb in ("Status", "Register", "Unregister")
        ),
        ("TraceSetting", "TraceSettingRequest", "TraceSettingResponse"),
        ("LogSettings", "LogSettingsRequest", "LogSettingsResponse"),
    ]
    for full_name, fields in PUBLIC_MESSAGES.items():
        message = kpb.DESCRIPTOR.message_types_by_name[full_name.split(".")[0]]
        for nested in full_name.split(".")[1:]:
            message = message.nested_types_by_name[nested]
        found = [(f.name, f.number, f.type, f.is_repeated) for f in message.fields]
        assert found == fields, full_name
    assert (
        kpb_grpc.GRPCInferenceServiceStub.__module__ == "laneserve.kserve.grpc_predict_v2_pb2_grpc"
    )


# ---- the mapping, without a server -----------------------------------------------------

LANES = ["interactive", "standard", "bulk"]
DEMO_INPUTS = (TensorSpec("input", np.dtype("<f4"), (-1, 512), ("batch", None)),)
DEMO_OUTPUTS = (TensorSpec("output", np.dtype("<f4"), (-1, 10), ("batch", None)),)
# A conversion's and an answer's shared memory where no tensor is placed in any.
NO_SHARED = CallerRegions(SharedMemoryRegions(enabled=False), "ipv4:127.0.0.1:1", 1 << 26)
NONE_PLACED = kserve_convert.OutputsPlaced(NO_SHARED.regions, {})


def _converted(**params: kpb.InferParameter) -> pb.InferRequest:
    message = raw_request("m", input=rows(1))
    for key, value in params.items():
        message.parameters[key].CopyFrom(value)
    return to_infer_request(_call(message), LANES, DEMO_INPUTS, DEMO_OUTPUTS, NO_SHARED)


def _call(message: Request) -> kserve_convert.ModelInferCall:
    """`message` as ModelInfer's deserializer hands it on."""
    call = kserve_convert.read_model_infer(message.SerializeToString(), max_inputs=1, max_outputs=1)
    assert isinstance(call, kserve_convert.ModelInferCall)
    return call


@pytest.mark.parametrize(
    ("timeout_us", "timeout_ms"), [(0, 0), (1, 1), (999, 1), (1000, 1), (1001, 2), (250_000, 250)]
)
def test_the_timeout_parameter_is_microseconds_rounded_up_to_milliseconds(
    timeout_us: int, timeout_ms: int
) -> None:
    assert _converted(timeout=kpb.InferParameter(int64_param=timeout_us)).timeout_ms == timeout_ms


@pytest.mark.parametrize(("priority", "lane"), [(0, ""), (1, "interactive"), (3, "bulk")])
def test_priority_k_is_the_kth_lane_highest_first_and_0_the_default(
    priority: int, lane: str
) -> None:
    assert _converted(priority=kpb.InferParameter(uint64_param=priority)).lane == lane
    assert _converted(priority=kpb.InferParameter(int64_param=priority)).lane == lane


def test_id_lane_and_outputs_map_onto_laneserves_request() -> None:
    message = raw_request("m", input=rows(2))
    message.id = "req-7"
    message.parameters["lane"].string_param = "bulk"
    message.outputs.add(name="output")
    converted = to_infer_request(_call(message), LANES, DEMO_INPUTS, DEMO_OUTPUTS, NO_SHARED)
    assert (converted.request_id, converted.lane, list(converted.output_names)) == (
        "req-7",
        "bulk",
        ["output"],
    )
    assert converted.inputs[0] == encode_tensor("input", rows(2))


def test_a_converted_call_lets_go_of_its_message_and_data() -> None:
    """gRPC holds what ModelInfer's deserializer returned (the ModelInferCall) until the
    call ends: once converted it holds neither the message nor the raw contents read from
    it, so that a queued ModelInfer holds its data once, in the converted InferRequest (it
    had held it twice)."""
    x = rows(64)
    call = _call(raw_request("m", input=x))
    converted = to_infer_request(call, LANES, DEMO_INPUTS, DEMO_OUTPUTS, NO_SHARED)
    call.release()
    assert (call.message.ByteSize(), call.raw_contents) == (0, ())
    assert converted.inputs[0] == encode_tensor("input", x)


def _unpacked_fp32_request(model: str, name: str, array: npt.NDArray[np.float32]) -> bytes:
    """A ModelInferRequest with `array` in fp32_contents as a valid encoder may write a
    repeated float: unpacked, each value with its own tag (1 byte) and 4 bytes."""
    head = kpb.ModelInferRequest.InferInputTensor(
        name=name, datatype="FP32", shape=array.shape
    ).SerializeToString()
    values = b"".join(b"\x35" + value.tobytes() for value in array.ravel())  # field 6, fixed32
    contents = b"\x2a" + write_varint(len(values)) + values  # InferInputTensor.contents, field 5
    tensor = head + contents
    return (
        kpb.ModelInferRequest(model_name=model).SerializeToString()
        + b"\x2a"  # ModelInferRequest.inputs, field 5
        + write_varint(len(tensor))
        + tensor
    )


# ---- a server --------------------------------------------------------------------------


def test_liveness_readiness_and_metadata(small_model: Path) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            assert (await stub.ServerLive(kpb.ServerLiveRequest())).live
            assert (await stub.ServerReady(kpb.ServerReadyRequest())).ready
            for version in ("", "1"):
                ready = await stub.ModelReady(kpb.ModelReadyRequest(name="small", version=version))
                assert ready.ready
            server = await stub.ServerMetadata(kpb.ServerMetadataRequest())
            assert (server.name, server.version, list(server.extensions)) == (
                "laneserve",
                SERVER_VERSION,
                ["schedule_policy", "model_configuration", "statistics", "trace", "logging"],
            )
            model = await stub.ModelMetadata(kpb.ModelMetadataRequest(name="small"))
            assert (model.name, list(model.versions), model.platform) == (
                "small",
                ["1"],
                "onnxruntime_onnx",
            )
            assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
                ("input", "FP32", [-1, 512])
            ]
            assert [(t.name, t.datatype, list(t.shape)) for t in model.outputs] == [
                ("output", "FP32", [-1, 10])
            ]

    asyncio.run(scenario())


def test_a_model_name_set_is_the_one_served_and_others_are_not_found(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, model_name="mlp")) as s:
            stub = kserve_stub(s)
            assert (await stub.ModelMetadata(kpb.ModelMetadataRequest(name="mlp"))).name == "mlp"
            answer = await stub.ModelInfer(raw_request("mlp", input=rows(1)))
            assert answer.model_name == "mlp"
            assert (await stub.ModelReady(kpb.ModelReadyRequest(name="mlp"))).ready
            # Asked whether it is ready, a model not served is not (as Triton answers).
            assert not (await stub.ModelReady(kpb.ModelReadyRequest(name="small"))).ready
            calls: list[Callable[[], Awaitable[Any]]] = [
                lambda: stub.ModelMetadata(kpb.ModelMetadataRequest(name="small")),
                lambda: stub.ModelInfer(raw_request("small", input=rows(1))),
            ]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call()
                assert caught.value.code() == grpc.StatusCode.NOT_FOUND
                assert "model 'small' is not served here; expected 'mlp'" in str(
                    caught.value.details()
                )
                assert rich_status(caught.value)[0] == "MODEL_NOT_FOUND"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelMetadata(kpb.ModelMetadataRequest(name="mlp", version="2"))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert "model 'mlp' has no version '2' here; expected '1' or empty" in str(
                caught.value.details()
            )

    asyncio.run(scenario())


def test_model_ready_answers_not_ready_for_a_model_or_version_not_served(
    small_model: Path,
) -> None:
    """ModelReady answers readiness, never an error, for a request that parses: another
    name, another version, a version that is no number or no name at all is ready=false
    with status OK, as a Triton server answers (a Triton client polling several names
    reads False), counted nowhere (no refusal); the served model's is the server's
    readiness, false from a stop signal's drain delay on; bytes that do not parse are
    still refused INVALID_ARGUMENT."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            # Raw bytes in, the status read off the call: as any stub calls it.
            ready: Any = s.channel.unary_unary(
                "/inference.GRPCInferenceService/ModelReady",
                request_serializer=lambda data: data,
                response_deserializer=kpb.ModelReadyResponse.FromString,
            )

            async def answer(asked: kpb.ModelReadyRequest) -> tuple[grpc.StatusCode, bool]:
                call = ready(asked.SerializeToString(), timeout=30)
                return await call.code(), (await call).ready

            not_served = [
                kpb.ModelReadyRequest(name="other"),
                kpb.ModelReadyRequest(name="other", version="1"),
                kpb.ModelReadyRequest(name="small", version="2"),
                kpb.ModelReadyRequest(name="small", version="latest"),
                kpb.ModelReadyRequest(),
            ]
            for asked in not_served:
                assert await answer(asked) == (grpc.StatusCode.OK, False), asked
            for version in ("", "1"):
                served = kpb.ModelReadyRequest(name="small", version=version)
                assert await answer(served) == (grpc.StatusCode.OK, True)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await ready(b"\x0a\x02\xff\xfe", timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "the ModelReady request does not parse" in str(caught.value.details())
            # The other Model* calls still refuse a model not served.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await kserve_stub(s).ModelMetadata(kpb.ModelMetadataRequest(name="other"))
            assert rich_status(caught.value)[0] == "MODEL_NOT_FOUND"
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert [dict(lane.rejected) for lane in stats.lanes] == [{}] * len(stats.lanes)
            await s.server.announce_not_serving()
            for asked in (kpb.ModelReadyRequest(name="small"), *not_served):
                assert await answer(asked) == (grpc.StatusCode.OK, False), asked

    asyncio.run(scenario())


def test_model_infer_answers_bit_for_bit_as_infer_does(small_model: Path) -> None:
    """Raw contents and typed contents give Infer's answer for the same rows, its bytes
    in raw_output_contents; the answer's Timing comes back as laneserve_ parameters."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            # 40 rows: 80 KiB, over the size below which a request is not measured.
            x = rows(40, seed=4)
            expected = output(await s.stub.Infer(request(x)))
            for message in (raw_request("small", input=x), typed_request("small", input=x)):
                answer = await stub.ModelInfer(message)
                assert (answer.model_name, answer.model_version, answer.id) == ("small", "1", "")
                assert [(t.name, t.datatype, list(t.shape)) for t in answer.outputs] == [
                    ("output", "FP32", [40, 10])
                ]
                assert outputs_of(answer)["output"].tobytes() == expected.tobytes()
                timing = parameters(answer)
                assert timing["laneserve_lane"] == "standard"
                assert timing["laneserve_batch_size"] >= 40
                assert set(timing) == {
                    "laneserve_lane",
                    "laneserve_batch_size",
                    "laneserve_queue_us",
                    "laneserve_infer_us",
                }

    asyncio.run(scenario())


def test_model_infer_calls_are_taken_by_the_acceptors_several_at_a_time(
    small_model: Path,
) -> None:
    """Each port keeps INFER_ACCEPTORS asks out for ModelInfer calls too, as for Infer's
    (taken at grpc.aio's own pace, ModelInfer managed 0.75x Infer's calls/s at 32
    callers): the calls they take are answered like any other, each with its own rows."""
    inputs = [rows(1, start=index) for index in range(64)]

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            expected = [output(await s.stub.Infer(request(x))) for x in inputs]
            before = sum(each.acceptors.taken for each in s.server._listeners)
            answers = await asyncio.gather(
                *(stub.ModelInfer(raw_request("small", input=x), timeout=30) for x in inputs)
            )
            taken = sum(each.acceptors.taken for each in s.server._listeners) - before
            for answer, infer in zip(answers, expected, strict=True):
                assert outputs_of(answer)["output"].tobytes() == infer.tobytes()
            assert taken > 0, "no ModelInfer call came through the acceptors"

    asyncio.run(scenario())


# One input per datatype laneserve serves, and its ONNX type.
EVERY_DTYPE = {
    "b": TensorProto.BOOL,
    "u8": TensorProto.UINT8,
    "u16": TensorProto.UINT16,
    "u32": TensorProto.UINT32,
    "u64": TensorProto.UINT64,
    "i8": TensorProto.INT8,
    "i16": TensorProto.INT16,
    "i32": TensorProto.INT32,
    "i64": TensorProto.INT64,
    "f16": TensorProto.FLOAT16,
    "f32": TensorProto.FLOAT,
    "f64": TensorProto.DOUBLE,
}


def _identity_model(path: Path, types: Mapping[str, int]) -> Path:
    """An input of each of `types`, [N, 3], and its Identity as an output "o_<input>": an
    answer equals its request's data, bit for bit."""
    graph = helper.make_graph(
        [helper.make_node("Identity", [name], [f"o_{name}"]) for name in types],
        path.stem,
        [helper.make_tensor_value_info(name, kind, ["N", 3]) for name, kind in types.items()],
        [
            helper.make_tensor_value_info(f"o_{name}", kind, ["N", 3])
            for name, kind in types.items()
        ],
    )
    return save_model(path, graph)


def _engine(path: Path) -> Engine:
    """The engine of a model of other inputs than the demo's (RecordingEngine reads
    "input")."""
    return Engine(str(path), device="cpu", estimate=estimate_once)


def _every_dtype_rows(count: int) -> dict[str, npt.NDArray[Any]]:
    rng = np.random.default_rng(count)
    values = rng.integers(0, 100, size=(count, 3))
    arrays: dict[str, npt.NDArray[Any]] = {"b": values % 2 == 0}
    integers: list[tuple[str, type[np.integer[Any]]]] = [
        ("u8", np.uint8),
        ("u16", np.uint16),
        ("u32", np.uint32),
        ("u64", np.uint64),
        ("i8", np.int8),
        ("i16", np.int16),
        ("i32", np.int32),
        ("i64", np.int64),
    ]
    for name, dtype in integers:
        info = np.iinfo(dtype)
        array = (values - 50).astype(dtype) if info.min < 0 else values.astype(dtype)
        # Each type's extremes too: a narrow type's list is widened, then narrowed back.
        array[0, :2] = (info.min, info.max)
        arrays[name] = array
    arrays["f16"] = rng.standard_normal((count, 3)).astype(np.float16)
    arrays["f32"] = rng.standard_normal((count, 3)).astype(np.float32)
    arrays["f64"] = rng.standard_normal((count, 3))
    return arrays


def test_a_model_infer_sending_an_overridable_initializer_is_told_what_it_is(
    tmp_path: Path,
) -> None:
    """scale, a graph input with an initializer default (ONNX Runtime's overridable
    initializers), is not one of the inputs laneserve serves: ModelInfer's refusal said
    "'scale' is not an input of the model". It says what Infer's says (`codec`): an
    initializer laneserve runs at its default, whether x is sent beside it or not."""
    scale = numpy_helper.from_array(np.array([[1, 2, 3, 4]], np.float32), "scale")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "scale"], ["y"])],
        "optional",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, [1, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[scale],
    )
    path = save_model(tmp_path / "optional.onnx", graph)
    x, other = np.ones((2, 4), np.float32), np.full((1, 4), 10, np.float32)

    async def scenario() -> None:
        async with serving(_engine(path), config(path)) as s:
            stub = kserve_stub(s)
            metadata = await stub.ModelMetadata(kpb.ModelMetadataRequest(name="optional"))
            assert [tensor.name for tensor in metadata.inputs] == ["x"]
            for sent, expected in (
                ({"x": x, "scale": other}, "expected the model's inputs ['x'], each once"),
                ({"scale": other}, "expected the model's inputs ['x']"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ModelInfer(raw_request("optional", **sent))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert refused.value.details() == (
                    f"{'request has 2 inputs; ' if 'x' in sent else ''}'scale' is an "
                    "initializer the model lets callers override; laneserve runs it at its "
                    f"default and takes no input of that name; {expected}"
                )

    asyncio.run(scenario())


def test_every_datatype_in_raw_contents_answers_as_infer(tmp_path: Path) -> None:
    path = _identity_model(tmp_path / "every.onnx", EVERY_DTYPE)

    async def scenario() -> None:
        async with serving(_engine(path), config(path)) as s:
            stub = kserve_stub(s)
            arrays = _every_dtype_rows(4)
            infer = await s.stub.Infer(
                pb.InferRequest(inputs=[encode_tensor(n, a) for n, a in arrays.items()])
            )
            expected = {tensor.name: tensor.data for tensor in infer.outputs}
            answer = await stub.ModelInfer(raw_request("every", **arrays))
            assert [t.datatype for t in answer.outputs] == [
                "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8",
                "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
            ]  # fmt: skip
            answers = outputs_of(answer)
            for name, array in arrays.items():
                assert answers[f"o_{name}"].tobytes() == array.tobytes() == expected[f"o_{name}"]
            # FP16 has no typed list: its bytes go raw only, and so every input's, in a
            # request with typed contents, whether the FP16 input has a list or none.
            for has in (" (it has fp32_contents)", ""):
                typed = typed_request("every", **{n: a for n, a in arrays.items() if n != "f16"})
                typed.inputs.add(name="f16", datatype="FP16", shape=[4, 3])
                if has:
                    typed.inputs[-1].contents.fp32_contents.extend(arrays["f16"].ravel().tolist())
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.ModelInfer(typed)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert caught.value.details() == (
                    f"input 'f16' is FP16, which has no typed contents{has}; expected its "
                    "bytes in raw_input_contents, and so every input's data there (a request "
                    "has raw_input_contents for all of its inputs or for none)"
                )

    asyncio.run(scenario())


def test_every_typed_contents_list_answers_as_raw_contents(tmp_path: Path) -> None:
    """bool_contents, int_contents (INT8/16/32), int64_contents, uint_contents
    (UINT8/16/32), uint64_contents, fp32_contents and fp64_contents, each converted to its
    datatype's bytes; a value outside a narrow datatype's range is refused."""
    types = {name: kind for name, kind in EVERY_DTYPE.items() if name != "f16"}
    path = _identity_model(tmp_path / "typed.onnx", types)

    async def scenario() -> None:
        async with serving(_engine(path), config(path)) as s:
            stub = kserve_stub(s)
            arrays = {n: a for n, a in _every_dtype_rows(3).items() if n in types}
            raw = outputs_of(await stub.ModelInfer(raw_request("typed", **arrays)))
            typed = outputs_of(await stub.ModelInfer(typed_request("typed", **arrays)))
            for name, array in arrays.items():
                assert typed[f"o_{name}"].tobytes() == raw[f"o_{name}"].tobytes()
                assert typed[f"o_{name}"].tobytes() == array.tobytes()
            for name, field, bad in [
                ("i8", "int_contents", 128),
                ("i16", "int_contents", -32769),
                ("u8", "uint_contents", 256),
                ("u16", "uint_contents", 65536),
            ]:
                message = typed_request("typed", **arrays)
                (tensor,) = [t for t in message.inputs if t.name == name]
                getattr(tensor.contents, field)[1] = bad
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.ModelInfer(message)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                info = np.iinfo(arrays[name].dtype)
                assert caught.value.details() == (
                    f"input {name!r} is {tensor.datatype} and holds {bad} in {field}; "
                    f"expected values from {info.min} to {info.max}"
                )

    asyncio.run(scenario())


def test_an_answer_too_large_in_either_encoding_is_refused_counted_and_never_stored(
    tmp_path: Path,
) -> None:
    """80 rows of 3 float32 (960 bytes) fit a 1 024-byte limit as Infer's answer, not as a
    ModelInferResponse, with its names and parameters: the request is refused
    ANSWER_TOO_LARGE whichever call carries it, and counted so when it is answered (it
    had been counted OK and stored, then refused to ModelInfer alone, and replayed OK to
    Infer). Not stored: a retry of its id, on either call, runs again and is refused."""
    path = _identity_model(tmp_path / "f32.onnx", {"x": TensorProto.FLOAT})
    x = np.arange(240, dtype=np.float32).reshape(80, 3)

    async def scenario() -> None:
        async with serving(_engine(path), config(path, max_message_bytes=1024)) as s:
            fits = await kserve_stub(s).ModelInfer(raw_request("f32", x=x[:64]))
            assert outputs_of(fits)["o_x"].tobytes() == x[:64].tobytes()
            message = _idempotent(raw_request("f32", x=x))
            message.id = "big"
            calls: list[Callable[[], Awaitable[Any]]] = [
                lambda: kserve_stub(s).ModelInfer(message),
                lambda: kserve_stub(s).ModelInfer(message),
                lambda: s.stub.Infer(
                    pb.InferRequest(request_id="big", inputs=[encode_tensor("x", x)])
                ),
            ]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call()
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert rich_status(caught.value)[0] == "ANSWER_TOO_LARGE"
                assert "over the server's max_message_bytes (1024)" in str(caught.value.details())
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            (standard,) = [lane for lane in stats.lanes if lane.name == "standard"]
            assert dict(standard.answered) == {"OK": 1, "ANSWER_TOO_LARGE": 3}
            assert (stats.idempotent_joins, stats.idempotent_replays) == (0, 0)
            assert stats.replay_cache_entries == 0, "nothing stored for a retry to replay"

    asyncio.run(scenario())


def test_answer_extra_bytes_bounds_every_model_infer_answer_and_is_reached() -> None:
    """`answer_extra_bytes`, the most a ModelInferResponse adds to its InferResponse, over
    answers at the edges of every length it counts: a 256-byte model name (the longest
    server.model_name), timing values of 0 (sent as parameters, left out of Timing) and
    the largest, empty and full outputs, names at a length prefix's boundary (117 bytes:
    an empty output's tensor is 125 bytes in one encoding, 129 or 131 in the other).
    Exact: some answer takes all of it."""
    specs = (
        TensorSpec("a", np.dtype("<u2"), (-1, 3)),  # UINT16: the longest datatype name
        TensorSpec("b", np.dtype("bool"), (-1, 3)),
    )
    lanes = ["interactive", "standard", "l" * 120]
    reached = False
    for model_name in ("m", "m" * 127, "\u00e9" * 128):
        bound = kserve_convert.answer_extra_bytes(model_name, specs, lanes)
        for lane, timing_value, request_id, name_bytes, data_rows in itertools.product(
            lanes, (0, 2**32 - 1), ("", "r" * 200), (100, 117, 125), (0, 1, 50)
        ):
            answer = pb.InferResponse(
                request_id=request_id,
                outputs=[
                    encode_tensor(spec.name * name_bytes, np.zeros((data_rows, 3), spec.dtype))
                    for spec in specs
                ],
                timing=pb.Timing(
                    lane=lane,
                    batch_size=timing_value,
                    queue_us=timing_value and 2**63 - 1,
                    infer_us=timing_value and 2**63 - 1,
                ),
            )
            converted = kserve_convert.to_model_infer_response(answer, model_name, NONE_PLACED)
            added = converted.ByteSize() - answer.ByteSize()
            assert added <= bound, (model_name[:4], lane, timing_value, name_bytes, data_rows)
            reached = reached or added == bound
    assert reached, "the bound is some answer's"


def _set(path: str, value: Any) -> Mutate:
    """Sets the field at the dotted `path` of the request."""

    def mutate(message: Request) -> None:
        *parents, last = path.split(".")
        target: Any = message
        for part in parents:
            target = target[int(part)] if part.isdigit() else getattr(target, part)
        if isinstance(value, list):  # a repeated field is replaced, not assigned
            del getattr(target, last)[:]
            getattr(target, last).extend(value)
        else:
            setattr(target, last, value)

    return mutate


def _parameter(key: str, **value: Any) -> Mutate:
    def mutate(message: Request) -> None:
        message.parameters[key].CopyFrom(kpb.InferParameter(**value))

    return mutate


def _typed(field: str, values: list[Any]) -> Mutate:
    """Moves input 0's data from raw contents to the typed list `field`."""

    def mutate(message: Request) -> None:
        del message.raw_input_contents[:]
        getattr(message.inputs[0].contents, field).extend(values)

    return mutate


def _also(*steps: Mutate) -> Mutate:
    def mutate(message: Request) -> None:
        for step in steps:
            step(message)

    return mutate


def _input_parameter(message: Request) -> None:
    message.inputs[0].parameters["binary_data"].bool_param = True


def _output_parameter(message: Request) -> None:
    message.outputs.add(name="output").parameters["classification"].int64_param = 3


def _both_raw_and_typed(message: Request) -> None:
    message.inputs[0].contents.fp32_contents.extend([1.0])


def _second_raw(message: Request) -> None:
    message.raw_input_contents.append(b"")


def _two_inputs(message: Request) -> None:
    message.inputs.add(name="input", datatype="FP32", shape=[1, 512])


def _output(name: str) -> Mutate:
    def mutate(message: Request) -> None:
        message.outputs.add(name=name)

    return mutate


def _two_outputs(message: Request) -> None:
    message.outputs.add(name="output")
    message.outputs.add(name="output")


@dataclasses.dataclass(frozen=True)
class Refusal:
    mutate: Mutate
    code: grpc.StatusCode
    fragment: str
    reason: str = "INVALID_INPUT"


INVALID = grpc.StatusCode.INVALID_ARGUMENT
ALL_TYPES = (
    "BOOL, UINT8, UINT16, UINT32, UINT64, INT8, INT16, INT32, INT64, FP16, FP32, FP64, BYTES"
)
REFUSALS = {
    "other model": Refusal(
        _set("model_name", "resnet"),
        grpc.StatusCode.NOT_FOUND,
        "model 'resnet' is not served here; expected 'small'",
        "MODEL_NOT_FOUND",
    ),
    "other version": Refusal(
        _set("model_version", "3"),
        grpc.StatusCode.NOT_FOUND,
        "model 'small' has no version '3' here",
        "MODEL_NOT_FOUND",
    ),
    "BYTES for a numeric input": Refusal(
        _set("inputs.0.datatype", "BYTES"),
        INVALID,
        "input 'input' has datatype BYTES; expected FP32, the model's input's, with shape "
        "[-1, 512] (-1 = any size)",
    ),
    "BYTES in bytes_contents for a numeric input": Refusal(
        _also(_set("inputs.0.datatype", "BYTES"), _typed("bytes_contents", [b"1"] * 512)),
        INVALID,
        "input 'input' has datatype BYTES; expected FP32",
    ),
    "BF16": Refusal(
        _set("inputs.0.datatype", "BF16"),
        INVALID,
        "input 'input' has datatype 'BF16'; laneserve serves no bfloat16 tensors (numpy has "
        f"no such dtype); expected one of {ALL_TYPES}",
    ),
    "unknown datatype": Refusal(
        _set("inputs.0.datatype", "FLOAT"),
        INVALID,
        f"input 'input' has datatype 'FLOAT'; expected one of {ALL_TYPES}",
    ),
    "another datatype than the model's": Refusal(
        _set("inputs.0.datatype", "FP64"),
        INVALID,
        "input 'input' has datatype FP64; expected FP32, the model's input's, with shape "
        "[-1, 512] (-1 = any size)",
    ),
    "raw contents for some inputs": Refusal(
        _second_raw,
        INVALID,
        "request has 2 raw_input_contents for 1 inputs; expected one per input",
    ),
    "raw and typed contents": Refusal(
        _both_raw_and_typed,
        INVALID,
        "input 'input' has contents while the request has raw_input_contents; expected each "
        "input's data in one place",
    ),
    "typed contents of another kind": Refusal(
        _typed("int_contents", [1] * 512),
        INVALID,
        "input 'input' is FP32 and has int_contents; expected its values in fp32_contents",
    ),
    "typed count other than the shape's": Refusal(
        _typed("fp32_contents", [1.0] * 7),
        INVALID,
        "input 'input' has 7 values in fp32_contents; expected 512 (shape [1, 512])",
    ),
    "raw data shorter than the shape": Refusal(
        _set("inputs.0.shape", [2, 512]),
        INVALID,
        "tensor 'input': data is 2048 bytes; expected 4096",
    ),
    "unknown input": Refusal(
        _set("inputs.0.name", "image"),
        INVALID,
        "unknown input 'image'; expected the model's inputs ['input']",
    ),
    "more inputs than the model's, one repeated": Refusal(
        _also(_two_inputs, _second_raw),
        INVALID,
        "request has 2 inputs; 'input' is given more than once; expected the model's inputs "
        "['input'], each once",
    ),
    "more inputs than the model's, one unknown": Refusal(
        _also(_two_inputs, _second_raw, _set("inputs.1.name", "image")),
        INVALID,
        "request has 2 inputs; 'image' is not an input of the model; expected the model's "
        "inputs ['input'], each once",
    ),
    "more outputs than the model's": Refusal(
        _two_outputs,
        INVALID,
        "request asks for 2 outputs; expected at most 1",
    ),
    "unknown output": Refusal(
        _output("logits"),
        INVALID,
        "unknown output(s) ['logits']; expected some of the model's outputs ['output']",
    ),
    "unknown parameter": Refusal(
        _parameter("sequence_id", int64_param=7),
        INVALID,
        "unknown request parameter(s) 'sequence_id'; expected some of 'lane' (string_param, a "
        "lane's name), 'timeout' (int64_param or uint64_param, microseconds), 'priority' "
        "(uint64_param or int64_param), 'triton_enable_empty_final_response' (bool_param) and "
        "'laneserve_idempotent' (bool_param) (laneserve has no sequence batching",
    ),
    "laneserve_idempotent of another kind": Refusal(
        _parameter("laneserve_idempotent", string_param="true"),
        INVALID,
        "request parameter 'laneserve_idempotent' is a string_param; expected bool_param",
    ),
    "laneserve_idempotent without an id": Refusal(
        _parameter("laneserve_idempotent", bool_param=True),
        INVALID,
        "request parameter 'laneserve_idempotent' is true and the request has no id; expected "
        "an id with it (laneserve's request_id, the same on each retry), or no "
        "laneserve_idempotent",
    ),
    "lane of another kind": Refusal(
        _parameter("lane", int64_param=1),
        INVALID,
        "request parameter 'lane' is an int64_param; expected string_param",
    ),
    "timeout of another kind": Refusal(
        _parameter("timeout", string_param="1s"),
        INVALID,
        "request parameter 'timeout' is a string_param; expected int64_param or uint64_param",
    ),
    "unknown lane": Refusal(
        _parameter("lane", string_param="gold"),
        INVALID,
        "unknown lane 'gold'; expected one of ['interactive', 'standard', 'bulk']",
    ),
    "priority past the lanes": Refusal(
        _parameter("priority", uint64_param=4),
        INVALID,
        "request parameter 'priority' is 4; expected 0 (the default lane) or 1 to 3, the lanes "
        "highest first ['interactive', 'standard', 'bulk'], or a 'lane' parameter",
    ),
    "priority and lane disagreeing": Refusal(
        _also(_parameter("priority", uint64_param=1), _parameter("lane", string_param="bulk")),
        INVALID,
        "request parameters 'priority' (1: lane 'interactive') and 'lane' ('bulk') name "
        "different lanes",
    ),
    "negative timeout": Refusal(
        _parameter("timeout", int64_param=-5),
        INVALID,
        "request parameter 'timeout' is -5; expected microseconds >= 0",
    ),
    "timeout past 2**32 - 1 ms": Refusal(
        _parameter("timeout", int64_param=2**32 * 1000),
        INVALID,
        "expected at most 4294967295000 (2**32 - 1 ms, about 49.7 days)",
    ),
    "input parameter": Refusal(
        _input_parameter,
        INVALID,
        "input 'input' has parameters ['binary_data']; expected none",
    ),
    "output parameter": Refusal(
        _output_parameter,
        INVALID,
        "output 'output' has parameters ['classification']; expected none",
    ),
    "request_id over 256 bytes": Refusal(
        _set("id", "k" * 300),
        INVALID,
        "request_id is 300 bytes, over the limit of 256 bytes",
    ),
    # Not "more than 64 KiB besides its tensors' data": an id is a field, as for Infer.
    "request_id over 64 KiB": Refusal(
        _set("id", "k" * 70_000),
        INVALID,
        "request_id is 70000 bytes, over the limit of 256 bytes",
    ),
}


def test_each_fault_is_refused_naming_it(small_model: Path) -> None:
    """One server, every refusal: its status code, ErrorInfo reason and words. Those of
    Infer's own checks (lane, shape, names, request_id) are Infer's words."""

    async def scenario() -> dict[str, str]:
        failures: dict[str, str] = {}
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            for name, refusal in REFUSALS.items():
                message = raw_request("small", input=rows(1))
                refusal.mutate(message)
                try:
                    await stub.ModelInfer(message, timeout=30)
                except grpc.aio.AioRpcError as error:
                    got = (error.code(), rich_status(error)[0])
                    if got != (refusal.code, refusal.reason) or refusal.fragment not in str(
                        error.details()
                    ):
                        failures[name] = f"{got}: {error.details()}"
                else:
                    failures[name] = "answered OK"
            # Every refusal but another model's is counted, as Infer's are.
            counted = len(REFUSALS) - 2
            await until_stats(
                s,
                lambda stats: (
                    sum(lane.rejected.get("INVALID_INPUT", 0) for lane in stats.lanes) == counted
                ),
            )
        return failures

    assert asyncio.run(scenario()) == {}


def test_unreadable_requests_are_refused_invalid_argument(small_model: Path) -> None:
    """Bytes that do not parse, a ModelInfer carrying more than 64 KiB besides its data,
    and a metadata request over 64 KiB: INVALID_ARGUMENT naming the fault, never gRPC's
    UNKNOWN."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            infer: Any = s.channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=lambda data: data,
                response_deserializer=kpb.ModelInferResponse.FromString,
            )
            metadata: Any = s.channel.unary_unary(
                "/inference.GRPCInferenceService/ModelMetadata",
                request_serializer=lambda data: data,
                response_deserializer=kpb.ModelMetadataResponse.FromString,
            )
            padded = raw_request("small", input=rows(1))
            padded.id = "x"
            # An unknown field (number 127, length-delimited) of 70 000 bytes.
            unknown = b"\xfa\x07" + write_varint(70_000) + bytes(70_000)
            padded_bytes = padded.SerializeToString() + unknown
            cases = [
                (infer, b"\x0a\x02\xff\xfe", "the ModelInfer request does not parse"),
                (infer, padded_bytes, "besides its tensors' data"),
                (metadata, b"\x0a\x02\xff\xfe", "the ModelMetadata request does not parse"),
                (
                    metadata,
                    kpb.ModelMetadataRequest(name="n" * 70_000).SerializeToString(),
                    "over the limit of 65536 bytes for KServe's requests other than ModelInfer's",
                ),
            ]
            for call, data, fragment in cases:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(data, timeout=30)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fragment
                assert fragment in str(caught.value.details())

    asyncio.run(scenario())


def test_typed_contents_written_unpacked_are_data_not_extra_bytes(small_model: Path) -> None:
    """140 rows of 512 float32 in fp32_contents written unpacked take 1 byte more per value
    than packed (71 680 bytes): data all the same, answered as Infer answers them, not
    refused for carrying more than 64 KiB besides its tensors' data."""
    x = rows(140, seed=3)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            infer: Any = s.channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=lambda data: data,
                response_deserializer=kpb.ModelInferResponse.FromString,
            )
            data = _unpacked_fp32_request("small", "input", x)
            assert len(kpb.ModelInferRequest.FromString(data).inputs[0].contents.fp32_contents)
            answer = await infer(data, timeout=30)
            expected = output(await s.stub.Infer(request(x)))
            assert outputs_of(answer)["output"].tobytes() == expected.tobytes()

    asyncio.run(scenario())


def test_a_queued_model_infer_holds_its_data_once(small_model: Path) -> None:
    """While a ModelInfer waits in its lane, what gRPC holds of it (its ModelInferCall)
    holds no tensor data: the converted request alone does."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            engine.hold_next()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            assert await asyncio.to_thread(engine.entered.acquire, timeout=30), "a batch ran"
            queued = asyncio.ensure_future(
                kserve_stub(s).ModelInfer(raw_request("small", input=rows(64, start=1)))
            )
            await until(lambda: queued_rows(s) == 64)
            gc.collect()
            calls = [
                obj for obj in gc.get_objects() if isinstance(obj, kserve_convert.ModelInferCall)
            ]
            assert calls, "gRPC holds the queued call's"
            held = [(call.message.ByteSize(), call.raw_contents) for call in calls]
            assert held == [(0, ())] * len(calls)
            engine.release()
            assert outputs_of(await queued)["output"].shape == (64, 10)
            await running

    asyncio.run(scenario())


def test_grpc_failing_to_send_a_model_infer_answer_to_an_ended_call_is_not_an_error(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As for Infer (test_server.py): gRPC's traceback for a ModelInfer answer it could not
    send, its call having ended in its core, is dropped; another record is kept."""
    core = logging.getLogger("grpc._cython.cygrpc")
    unsent = grpc_accept.cygrpc.ExecuteBatchError('Failed "execute_batch"')
    method = "/inference.GRPCInferenceService/ModelInfer"

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)):
            with caplog.at_level(logging.ERROR, logger=core.name):
                core.error(
                    "ExecuteBatchError raised in core by servicer method [%s]" % method,  # noqa: UP031 - gRPC's own form
                    exc_info=(type(unsent), unsent, None),
                )
                core.error("Unexpected [%s] raised by servicer method [%s]", "Boom", method)

    asyncio.run(scenario())
    assert [record.getMessage() for record in caplog.records if record.name == core.name] == [
        f"Unexpected [Boom] raised by servicer method [{method}]"
    ]


def test_lane_and_priority_parameters_choose_the_lane(small_model: Path) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            by_lane = raw_request("small", input=rows(2))
            by_lane.parameters["lane"].string_param = "interactive"
            by_priority = raw_request("small", input=rows(1))
            by_priority.parameters["priority"].uint64_param = 3
            assert parameters(await stub.ModelInfer(by_lane))["laneserve_lane"] == "interactive"
            assert parameters(await stub.ModelInfer(by_priority))["laneserve_lane"] == "bulk"
            await until_stats(
                s,
                lambda stats: (
                    {lane.name: lane.completed for lane in stats.lanes}
                    == {"interactive": 1, "standard": 0, "bulk": 1}
                ),
            )

    asyncio.run(scenario())


def test_tritons_final_response_flag_is_read_and_a_model_infer_answer_needs_no_mark(
    small_model: Path,
) -> None:
    # perf_analyzer sends it on every ModelInfer: refused as unknown, it ran nothing.
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            asked = raw_request("small", input=rows(1))
            asked.parameters["triton_enable_empty_final_response"].bool_param = True
            answer = await stub.ModelInfer(asked)
            assert answer.outputs[0].shape[0] == 1
            assert "triton_final_response" not in answer.parameters
            wrong = raw_request("small", input=rows(1))
            wrong.parameters["triton_enable_empty_final_response"].int64_param = 1
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfer(wrong)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details() == (
                "request parameter 'triton_enable_empty_final_response' is an int64_param; "
                "expected bool_param"
            )

    asyncio.run(scenario())


def test_the_timeout_parameter_bounds_the_request_in_its_lane(small_model: Path) -> None:
    """A request queued behind a held batch with a 1 ms budget (timeout 1 us, rounded up)
    ends DEADLINE_EXCEEDED, as Infer's timeout_ms does; one with no timeout waits."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            stub = kserve_stub(s)
            engine.hold_next()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            assert await asyncio.to_thread(engine.entered.acquire, timeout=30), "a batch ran"
            bounded = raw_request("small", input=rows(1, start=1))
            bounded.parameters["timeout"].int64_param = 1
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfer(bounded)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert rich_status(caught.value)[0] in ("DEADLINE_UNMEETABLE", "EXPIRED_IN_QUEUE")
            waiting = asyncio.ensure_future(stub.ModelInfer(raw_request("small", input=rows(2))))
            await until(lambda: queued_rows(s) == 2)
            engine.release()
            assert outputs_of(await waiting)["output"].shape == (2, 10)
            await running

    asyncio.run(scenario())


def _idempotent(message: Request) -> Request:
    """`message`, asking that its id key the request (laneserve_idempotent true)."""
    message.parameters["laneserve_idempotent"].bool_param = True
    return message


def test_an_id_is_echoed_and_keys_nothing_unless_the_request_asks(small_model: Path) -> None:
    """Triton's clients send `id` as a correlation tag: perf_analyzer restarts its ids
    each run with the same data, scripts send request_id="1" for other inputs. Without
    laneserve_idempotent each request runs, its id echoed: none is replayed, none refused
    REQUEST_ID_REUSED (by ModelInfer or by Infer's id space)."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            stub = kserve_stub(s)
            message = raw_request("small", input=rows(2, start=10))
            message.id = "1"
            first = await stub.ModelInfer(message)
            again = await stub.ModelInfer(message)
            other = raw_request("small", input=rows(1, start=30))
            other.id = "1"
            third = await stub.ModelInfer(other)
            assert first.id == again.id == third.id == "1"
            assert list(first.raw_output_contents) == list(again.raw_output_contents)
            infer = await s.stub.Infer(request(rows(1, start=40), request_id="1"))
            assert infer.request_id == "1"
            # Infer's request "1" keys the ledger; a ModelInfer with id "1" still runs.
            assert (await stub.ModelInfer(message)).id == "1"
            assert sorted(engine.ran_tags) == [10, 10, 10, 11, 11, 11, 30, 40], "each ran"
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert (stats.idempotent_joins, stats.idempotent_replays) == (0, 0)
            assert stats.replay_cache_entries == 1, "Infer's answer alone"

    asyncio.run(scenario())


def test_laneserve_idempotent_makes_the_id_laneserves_request_id(small_model: Path) -> None:
    """With laneserve_idempotent true the id is Infer's request_id: a retry is replayed
    (echoed, its Timing too), and the id is one space with Infer's: other inputs are
    refused REQUEST_ID_REUSED there, and a request without the parameter keys nothing."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            stub = kserve_stub(s)
            message = _idempotent(raw_request("small", input=rows(2, start=10)))
            message.id = "kserve-1"
            first = await stub.ModelInfer(message)
            again = await stub.ModelInfer(message)
            assert first.id == again.id == "kserve-1"
            assert list(first.raw_output_contents) == list(again.raw_output_contents)
            assert parameters(first) == parameters(again), "the run's Timing, replayed"
            assert sorted(engine.ran_tags) == [10, 11], "ran once"
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert stats.idempotent_replays == 1
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(1), request_id="kserve-1"))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(caught.value)[0] == "REQUEST_ID_REUSED"
            reused = _idempotent(raw_request("small", input=rows(1, start=50)))
            reused.id = "kserve-1"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfer(reused)
            assert rich_status(caught.value)[0] == "REQUEST_ID_REUSED"
            assert "'kserve-1'" in str(caught.value.details())
            del reused.parameters["laneserve_idempotent"]
            assert (await stub.ModelInfer(reused)).id == "kserve-1"
            assert sorted(engine.ran_tags) == [10, 11, 50]

    asyncio.run(scenario())


def test_one_request_id_is_one_request_in_raw_contents_typed_contents_or_infers_bytes(
    small_model: Path,
) -> None:
    """ModelInfer's id, idempotent, is Infer's request_id, one space for both services: the same
    values sent in typed contents, in raw contents or over Infer are one request, run
    once and replayed to the others with its Timing."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            stub = kserve_stub(s)
            x = rows(2, start=20)
            typed = _idempotent(typed_request("small", input=x))
            typed.id = "shared-1"
            first = await stub.ModelInfer(typed)
            raw = _idempotent(raw_request("small", input=x))
            raw.id = "shared-1"
            again = await stub.ModelInfer(raw)
            infer = await s.stub.Infer(request(x, request_id="shared-1"))
            assert list(first.raw_output_contents) == list(again.raw_output_contents)
            assert first.raw_output_contents[0] == infer.outputs[0].data
            assert parameters(first) == parameters(again)
            assert infer.timing.queue_us == parameters(first)["laneserve_queue_us"]
            assert sorted(engine.ran_tags) == [20, 21], "ran once"
            assert (await s.stub.GetStats(pb.GetStatsRequest())).idempotent_replays == 2

    asyncio.run(scenario())


def test_readiness_is_false_once_the_drain_starts_and_model_infer_is_refused(
    small_model: Path,
) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            stub = kserve_stub(s)
            assert (await stub.ServerReady(kpb.ServerReadyRequest())).ready
            running, queued = await one_running_and_queued(s, engine)
            stopping = asyncio.ensure_future(s.server.stop(grace_s=30))
            await until(lambda: s.server.state.value == "DRAINING")
            assert (await stub.ServerLive(kpb.ServerLiveRequest())).live
            assert not (await stub.ServerReady(kpb.ServerReadyRequest())).ready
            assert not (await stub.ModelReady(kpb.ModelReadyRequest(name="small"))).ready
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfer(raw_request("small", input=rows(1)))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert rich_status(caught.value)[0] == "DRAINING"
            engine.release()
            await asyncio.gather(running, queued)
            await stopping

    asyncio.run(scenario())


def test_model_infer_is_counted_by_the_ports_call_limit(small_model: Path) -> None:
    """ModelInfer takes an inference slot, as Infer does: over max_concurrent_rpcs it is
    refused at once in gRPC's words with the call-limit trailer, while the metadata calls
    (operator calls, counted apart) are answered."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_concurrent_rpcs=1)) as s:
            stub = kserve_stub(s)
            engine.hold_next()
            running = asyncio.ensure_future(stub.ModelInfer(raw_request("small", input=rows(1))))
            assert await asyncio.to_thread(engine.entered.acquire, timeout=30), "a batch ran"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(1)))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert grpc_accept.CALL_LIMIT_KEY in dict(caught.value.trailing_metadata() or ())
            assert (await stub.ModelMetadata(kpb.ModelMetadataRequest(name="small"))).inputs
            engine.release()
            assert outputs_of(await running)["output"].shape == (1, 10)

    asyncio.run(scenario())


def test_reflection_lists_the_service(small_model: Path) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub: Any = reflection_pb2_grpc.ServerReflectionStub(s.channel)  # type: ignore[arg-type]
            call = stub.ServerReflectionInfo(
                iter(
                    [
                        reflection_pb2.ServerReflectionRequest(list_services=""),
                        reflection_pb2.ServerReflectionRequest(
                            file_containing_symbol="inference.GRPCInferenceService"
                        ),
                    ]
                )
            )
            answers = [answer async for answer in call]
            services = {svc.name for svc in answers[0].list_services_response.service}
            assert "inference.GRPCInferenceService" in services
            (file,) = answers[1].file_descriptor_response.file_descriptor_proto
            assert descriptor_pb2.FileDescriptorProto.FromString(file).package == "inference"

    asyncio.run(scenario())


def test_the_model_name_defaults_to_the_files_stem_and_is_a_setting_and_a_flag() -> None:
    assert ServerConfig(model_path="models/demo.onnx").served_model_name == "demo"
    assert ServerConfig(model_path="m.onnx", model_name="mlp").served_model_name == "mlp"
    with pytest.raises(ConfigError, match=r"server\.model_name: expected 1 to 256 bytes"):
        ServerConfig(model_path="m.onnx", model_name="")
    args = _parser().parse_args(["serve", "--model", "m.onnx", "--model-name", "ranker"])
    assert _serve_config(args)[0].served_model_name == "ranker"


# ---- BYTES: text tensors ----------------------------------------------------------------------

# The text model's rows (`demo_model.make_text_model`): text [N], numbers [N, 2], both
# strings; ASCII, non-ASCII and empty text among them.
TEXT = np.array(["cat", "h\u00e9llo, w\u00f6rld \u2713", "", "dog"], dtype=object)
NUMBERS = np.array([["1", "2.5"], ["-3", "0"], ["1000", "7"], ["0.5", "-0.25"]], dtype=object)
# Its answers for them: tagged = text + "!", label = the index in TEXT_LABELS (else -1),
# value = float(numbers).
TAGGED = [f"{text}!" for text in TEXT]
LABELS = [0, -1, -1, 1]
VALUES = NUMBERS.astype(np.float32)
TEXT_OUTPUTS = [("tagged", "BYTES", [4]), ("label", "INT64", [4]), ("value", "FP32", [4, 2])]


def text_request() -> Request:
    """The text model's request for TEXT and NUMBERS, in raw contents."""
    return raw_request("text", text=TEXT, numbers=NUMBERS)


def test_bytes_inputs_raw_or_in_bytes_contents_answer_the_text_infer_answers(
    text_model: Path,
) -> None:
    """BYTES inputs (a 1-D and a 2-D one) in raw_input_contents, each element a 4-byte
    length and its UTF-8, as tritonclient serializes them, and the same values in
    bytes_contents (one element per value): both answered as Infer answers the same
    strings, bit for bit. The BYTES output's raw_output_contents entry is the STRING
    tensor's data as it is (each element length-prefixed), beside INT64 and FP32
    outputs; outputs asked for by name are answered in the order asked."""

    async def scenario() -> tuple[pb.InferResponse, list[kpb.ModelInferResponse]]:
        async with serving(_engine(text_model), config(text_model)) as s:
            stub = kserve_stub(s)
            infer = await s.stub.Infer(
                pb.InferRequest(
                    inputs=[encode_tensor("text", TEXT), encode_tensor("numbers", NUMBERS)]
                )
            )
            asked = text_request()
            for name in ("value", "tagged"):
                asked.outputs.add(name=name)
            answers = [
                await stub.ModelInfer(text_request()),
                await stub.ModelInfer(typed_request("text", text=TEXT, numbers=NUMBERS)),
                await stub.ModelInfer(asked),
            ]
        return infer, answers

    infer, (raw, typed, asked) = asyncio.run(scenario())
    assert [(t.name, t.datatype, list(t.shape)) for t in raw.outputs] == TEXT_OUTPUTS
    assert list(raw.raw_output_contents) == [tensor.data for tensor in infer.outputs]
    assert list(typed.raw_output_contents) == list(raw.raw_output_contents)
    assert raw.raw_output_contents[0] == encode_strings("tagged", np.array(TAGGED, dtype=object))
    found = outputs_of(raw)
    assert (
        found["tagged"].tolist()
        == TAGGED
        == ["cat!", "h\u00e9llo, w\u00f6rld \u2713!", "!", "dog!"]
    )
    assert found["label"].tolist() == LABELS
    assert found["value"].tobytes() == VALUES.tobytes()
    assert [(t.name, t.datatype) for t in asked.outputs] == [("value", "FP32"), ("tagged", "BYTES")]
    assert outputs_of(asked)["tagged"].tolist() == TAGGED


def _text_data(**over: bytes) -> Request:
    """A text request whose raw contents are `over`'s where given (by input name)."""
    message = text_request()
    for index, tensor in enumerate(message.inputs):
        if tensor.name in over:
            message.raw_input_contents[index] = over[tensor.name]
    return message


def _text_typed(text: list[bytes]) -> Request:
    """A text request with `text` in the text input's bytes_contents."""
    message = typed_request("text", text=TEXT, numbers=NUMBERS)
    del message.inputs[0].contents.bytes_contents[:]
    message.inputs[0].contents.bytes_contents.extend(text)
    return message


def _text_as_fp32() -> Request:
    message = text_request()
    message.inputs[0].datatype = "FP32"
    message.raw_input_contents[0] = np.zeros(4, np.float32).tobytes()
    return message


def _text_in_fp32_contents() -> Request:
    message = typed_request("text", text=TEXT, numbers=NUMBERS)
    message.inputs[0].contents.ClearField("bytes_contents")
    message.inputs[0].contents.fp32_contents.extend([1.0] * 4)
    return message


_SERIALIZED_TEXT = encode_strings("text", TEXT)
_NOT_UTF8 = b"".join(len(value).to_bytes(4, "little") + value for value in (b"a", b"\xff\xfe"))


@dataclasses.dataclass(frozen=True)
class BytesRefusal:
    build: Callable[[], Request]
    fragment: str


BYTES_REFUSALS = {
    "FP32 for a BYTES input": BytesRefusal(
        _text_as_fp32,
        "input 'text' has datatype FP32; expected BYTES, the model's input's, with shape "
        "[-1] (-1 = any size)",
    ),
    "BYTES datatype, values in fp32_contents": BytesRefusal(
        _text_in_fp32_contents,
        "input 'text' is BYTES and has fp32_contents; expected its values in bytes_contents",
    ),
    "an element not UTF-8 in raw contents": BytesRefusal(
        lambda: _text_data(
            text=_NOT_UTF8 + encode_strings("t", np.array(["x", "y"], dtype=object))
        ),
        "tensor 'text': element 1 is not UTF-8 (invalid start byte at byte 0); expected text",
    ),
    "an element not UTF-8 in bytes_contents": BytesRefusal(
        lambda: _text_typed([b"cat", b"ok", b"\xc3", b"dog"]),
        "tensor 'text': element 2 is not UTF-8 (unexpected end of data at byte 0)",
    ),
    "too few bytes_contents": BytesRefusal(
        lambda: _text_typed([b"cat", b"ok", b"dog"]),
        "input 'text' has 3 values in bytes_contents; expected 4 (shape [4])",
    ),
    "too many bytes_contents": BytesRefusal(
        lambda: _text_typed([b"a"] * 5),
        "input 'text' has 5 values in bytes_contents; expected 4 (shape [4])",
    ),
    "raw data cut short in its last element": BytesRefusal(
        lambda: _text_data(text=_SERIALIZED_TEXT[:-2]),
        "tensor 'text': element 3 says 3 bytes, 1 are left",
    ),
    "raw data past its last element": BytesRefusal(
        lambda: _text_data(text=_SERIALIZED_TEXT + b"\x00\x00"),
        "tensor 'text': data has 2 bytes after its 4 string elements",
    ),
    "raw data shorter than its elements' lengths": BytesRefusal(
        lambda: _text_data(text=b"\x03\x00"),
        "tensor 'text': data is 2 bytes; expected at least 16 (4 string elements",
    ),
}


def test_bytes_faults_are_refused_invalid_argument_naming_them(text_model: Path) -> None:
    """One server, every fault of a BYTES input: INVALID_ARGUMENT INVALID_INPUT in words
    naming the input and the element or count at fault (a BYTES input given for a
    numeric one: REFUSALS)."""

    async def scenario() -> dict[str, str]:
        failures: dict[str, str] = {}
        async with serving(_engine(text_model), config(text_model)) as s:
            stub = kserve_stub(s)
            for name, refusal in BYTES_REFUSALS.items():
                try:
                    await stub.ModelInfer(refusal.build(), timeout=30)
                except grpc.aio.AioRpcError as error:
                    got = (error.code(), rich_status(error)[0])
                    if got != (INVALID, "INVALID_INPUT") or refusal.fragment not in str(
                        error.details()
                    ):
                        failures[name] = f"{got}: {error.details()}"
                else:
                    failures[name] = "answered OK"
        return failures

    assert asyncio.run(scenario()) == {}
