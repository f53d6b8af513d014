"""The static estimate counts a tensor's bytes as ONNX packs it: types below a byte (INT4,
UINT4, FLOAT4E2M1, INT2, UINT2, FLOAT6E2M3, FLOAT6E3M2) at their bits, not at the byte
numpy's stand-ins for them take, in the weights and in a row's activations alike."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from laneserve.server.static_estimate import static_estimate
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import ServerProcess, output, request

INT4 = helper.tensor_dtype_to_np_dtype(TensorProto.INT4)


def _int4_model(path: Path, k: int, n: int) -> Path:
    """y = x @ DequantizeLinear(w[int4, k x n], scale): weight-only INT4 as quantizers
    write it (opset 21); its k * n / 2 bytes of weights are packed two to a byte."""
    values = np.random.default_rng(0).integers(-8, 8, size=(k, n)).astype(INT4)
    weights = numpy_helper.from_array(values, "wq")
    scale = numpy_helper.from_array(np.array(0.01, np.float32), "scale")
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "scale"], ["w"]),
        helper.make_node("MatMul", ["input", "w"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "int4",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", n])],
        [weights, scale],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10  # what onnxruntime 1.31 reads
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_int4_weights_count_their_packed_bytes(tmp_path: Path) -> None:
    """63 x 33 INT4 weights are 1 040 bytes in the file (an odd count: the last byte
    holds one); counted a byte each they were 2 079, twice what the runtime holds."""
    path = _int4_model(tmp_path / "int4.onnx", 63, 33)
    weights, scale = onnx.load(str(path)).graph.initializer
    assert len(weights.raw_data) == 1040, "onnx packs them two to a byte"
    fixed_bytes, _ = static_estimate(str(path))
    assert fixed_bytes == len(weights.raw_data) + len(scale.raw_data)


@pytest.mark.parametrize(
    "data_type",
    [
        name
        for name in TensorProto.DataType.keys()  # noqa: SIM118 - a protobuf enum, not a dict
        if name not in {"UNDEFINED", "STRING"}  # no size per element
    ],
)
def test_weights_of_every_type_count_as_onnx_packs_them(tmp_path: Path, data_type: str) -> None:
    """Every type this onnx knows, including any it adds later below a byte: 7 elements
    weigh what onnx writes for them (7 bytes of INT8, 4 of INT4, 2 of INT2, 6 of FLOAT6)."""
    values = np.zeros(7, helper.tensor_dtype_to_np_dtype(TensorProto.DataType.Value(data_type)))
    weights = numpy_helper.from_array(values, "w")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["output"])],
        "one_weight",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1])],
        [weights],
    )
    path = tmp_path / "one_weight.onnx"
    onnx.save(helper.make_model(graph), str(path))
    assert static_estimate(str(path))[0] == len(weights.raw_data)


def test_int4_activations_count_their_packed_bytes_per_row(tmp_path: Path) -> None:
    """x -> QuantizeLinear to INT4 -> DequantizeLinear: a row is 33 floats in, 33 INT4
    values between (17 bytes packed, not 33), and 33 floats out."""
    zero_point = helper.make_tensor("zero_point", TensorProto.INT4, [], [0])
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "scale")
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["input", "scale", "zero_point"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "scale", "zero_point"], ["output"]),
        ],
        "int4_rows",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 33])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 33])],
        [scale, zero_point],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    path = tmp_path / "int4_rows.onnx"
    onnx.save(model, str(path))
    assert static_estimate(str(path)) == (4 + 1, 33 * 4 + 17 + 33 * 4)


def test_a_cpu_budget_that_holds_packed_int4_weights_serves_and_is_enforced(
    tmp_path: Path,
) -> None:
    """16 MiB of packed INT4 weights were counted 32 MiB, and a 28 MiB budget was refused
    ("does not hold the model's weights (32.0MiB)"). ONNX Runtime holds about 24 MiB of
    this model in the arena (its MatMulNBits rewrite adds a scale per 32 weights, and a
    prepacked copy), so 28 MiB is enforced: the probe runs out of memory before 1 024
    rows (32 MiB of output alone), and the cap it finds serves."""
    model = _int4_model(tmp_path / "int4.onnx", 4096, 8192)
    max_batch_size = 1024
    server = ServerProcess(
        [
            *("--model", str(model), "--port", "0", "--memory-limit", "28MiB"),
            *("--max-batch-size", str(max_batch_size)),
        ]
    )
    try:
        probe = server.wait_for(r"probe: batch_cap=(\d+) .*stopped by (\w+)")
        port = server.port()
        x = np.random.default_rng(1).standard_normal((4, 4096)).astype(np.float32)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            model_info = stub.GetModel(pb.GetModelRequest(), timeout=10)
            answer = stub.Infer(request(x), timeout=60)
    finally:
        server.close()
    assert model_info.estimated_fixed_bytes == 4096 * 8192 // 2 + 4
    assert probe.group(2) == "out_of_memory", "the arena's cap held"
    assert 1 <= int(probe.group(1)) < max_batch_size
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(output(answer), reference.run(None, {"input": x})[0])
