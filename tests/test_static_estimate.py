"""The static estimate counts a tensor's bytes as ONNX packs it: types below a byte (INT4,
UINT4, FLOAT4E2M1, INT2, UINT2, FLOAT6E2M3, FLOAT6E3M2) at their bits, not at the byte
numpy's stand-ins for them take, in the weights and in a row's activations alike. It
reads the model without its weights' data: the copy it parses is what parsing the whole
model and dropping the data gave, and small whatever the weights' size."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from laneserve.server.demo_model import make_demo_model
from laneserve.server.model_identity import write_varint
from laneserve.server.static_estimate import (
    _KEEP_INITIALIZER_BYTES,
    _load_without_weights,
    _tensor_bytes,
    model_without_weights,
    static_estimate,
)
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


def _loaded_whole(path: Path) -> onnx.ModelProto:
    """The model as the estimate read it before: parsed whole (onnx.load), then the data
    of its weights over _KEEP_INITIALIZER_BYTES cleared (uint64_data now too)."""
    model = onnx.load(str(path), load_external_data=False)
    weights = [
        *model.graph.initializer,
        *(
            attribute.t
            for node in model.graph.node
            if node.op_type == "Constant"
            for attribute in node.attribute
            if attribute.name == "value"
        ),
    ]
    for tensor in weights:
        if _tensor_bytes(tensor.data_type, int(np.prod(tensor.dims))) > _KEEP_INITIALIZER_BYTES:
            for field in (
                *("raw_data", "float_data", "int32_data", "int64_data"),
                *("double_data", "uint64_data"),
            ):
                tensor.ClearField(field)
    return model


def _demo(path: Path) -> Path:
    make_demo_model(path, input_dim=64, hidden_dim=128, hidden_layers=2, output_dim=8)
    return path


def _demo_external(path: Path, *, one_file: bool) -> Path:
    model = onnx.load(str(_demo(path)))
    onnx.save(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=one_file,
        location=f"{path.name}.data" if one_file else None,
        size_threshold=1024,
    )
    return path


def _demo_as_constants(path: Path) -> Path:
    """The demo's weights as Constant nodes' values, beside a ConstantOfShape whose tensor
    `value` is kept, and a Reshape to a shape given as a (small, kept) initializer."""
    model = onnx.load(str(_demo(path)))
    nodes = [
        *(
            helper.make_node("Constant", [], [weight.name], value=weight)
            for weight in model.graph.initializer
        ),
        *model.graph.node,
    ]
    del model.graph.initializer[:]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    output_name = model.graph.output[0].name
    model.graph.node[-1].output[0] = "before_reshape"
    model.graph.node.extend(
        [
            helper.make_node("Reshape", ["before_reshape", "shape"], [output_name]),
            helper.make_node(
                "ConstantOfShape",
                ["shape"],
                ["filled"],
                value=helper.make_tensor("fill", TensorProto.FLOAT, [1], [1.0]),
            ),
        ]
    )
    model.graph.initializer.append(numpy_helper.from_array(np.array([-1, 2, 4]), "shape"))
    model.graph.output.append(helper.make_tensor_value_info("filled", TensorProto.FLOAT, None))
    onnx.save(model, str(path))
    return path


def _typed_data(path: Path) -> Path:
    """Weights written in the typed fields (float_data, int64_data, uint64_data,
    double_data, int32_data) rather than raw_data, over and under the size kept."""
    names = ["f32", "i64", "u64", "f64", "f16", "small"]
    weights = [
        helper.make_tensor("f32", TensorProto.FLOAT, [40, 40], np.ones(1600).tolist()),
        helper.make_tensor("i64", TensorProto.INT64, [1000], list(range(1000))),
        helper.make_tensor("u64", TensorProto.UINT64, [1000], list(range(1000))),
        helper.make_tensor("f64", TensorProto.DOUBLE, [600], np.ones(600).tolist()),
        # 3 000 zeros of FLOAT16 in int32_data: 6 000 bytes counted, 3 000 written.
        helper.make_tensor("f16", TensorProto.FLOAT16, [3000], np.zeros(3000, np.float16)),
        helper.make_tensor("small", TensorProto.FLOAT, [8], np.ones(8).tolist()),
    ]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["output"])],
        "typed",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 3])],
        weights,
    )
    assert [weight.name for weight in graph.initializer] == names
    onnx.save(helper.make_model(graph), str(path))
    return path


@pytest.mark.parametrize(
    "make",
    [
        _demo,
        lambda path: _demo_external(path, one_file=True),
        lambda path: _demo_external(path, one_file=False),
        _demo_as_constants,
        lambda path: _int4_model(path, 256, 96),
        _typed_data,
    ],
    ids=["demo", "external_one_file", "external_per_tensor", "constants", "int4", "typed"],
)
def test_the_model_parsed_is_the_whole_one_without_its_weights_data(
    tmp_path: Path, make: Callable[[Path], Path]
) -> None:
    """The copy parsed is field for field the model parsed whole with its weights' data
    dropped, as the estimate parsed it before: the estimate is the same number."""
    path = make(tmp_path / "model.onnx")
    assert _load_without_weights(str(path)) == _loaded_whole(path)


def test_the_demo_models_estimate_is_unchanged(demo_model: Path) -> None:
    """The demo model's estimate, as the estimate that parsed it whole gave it (made here:
    models/demo.onnx exists only once `./scripts/serve` has built it, not in a clone)."""
    assert static_estimate(str(demo_model)) == (21069864, 51280)


def test_a_large_weight_is_not_in_the_copy_parsed(tmp_path: Path) -> None:
    """A 64 MiB initializer inline: the copy handed to onnx is under a KiB (parsed whole,
    the estimate's child held the weights twice over), and still counts 64 MiB."""
    weight = numpy_helper.from_array(np.zeros((4096, 4096), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["output"])],
        "big",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4096])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 4096])],
        [weight],
    )
    path = tmp_path / "big.onnx"
    onnx.save(helper.make_model(graph), str(path))
    del weight, graph
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        copy = model_without_weights(data)
    assert path.stat().st_size > 64 * 1024 * 1024
    assert len(copy) < 1024
    assert static_estimate(str(path)) == (64 * 1024 * 1024, 2 * 4096 * 4)


def _field(number: int, message: bytes) -> bytes:
    """`message` as length-delimited field `number` of the message around it."""
    return write_varint(number << 3 | 2) + write_varint(len(message)) + message


def test_a_weight_whose_data_comes_before_its_dims_is_still_left_out(tmp_path: Path) -> None:
    """onnx.save writes a tensor's fields in number order, but protobuf lets any writer
    put raw_data first and merges a message written in parts: the walk reads dims and
    data_type wherever they are, and the estimate is the whole parse's."""
    raw = TensorProto(raw_data=bytes(1024 * 1024 * 4)).SerializeToString()
    shape = TensorProto(name="w", dims=[1024, 1024], data_type=TensorProto.FLOAT)
    weight = raw + shape.SerializeToString()  # raw_data (field 9) before dims and type
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["output"])],
        "parts",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1024])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1024])],
    )
    model = helper.make_model(graph)
    model.ClearField("graph")
    path = tmp_path / "parts.onnx"
    path.write_bytes(
        model.SerializeToString() + _field(7, graph.SerializeToString() + _field(5, weight))
    )
    whole = onnx.load(str(path))
    assert list(whole.graph.initializer[0].dims) == [1024, 1024], "one tensor, merged"
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        assert len(model_without_weights(data)) < 1024
    assert static_estimate(str(path)) == (4 * 1024 * 1024, 2 * 1024 * 4)


def test_a_file_cut_inside_a_varint_is_refused_naming_the_file(tmp_path: Path) -> None:
    """A file that ends inside a varint raised mmap's "index out of range", which the
    server logged as the estimate's failure, naming nothing."""
    path = tmp_path / "cut.onnx"
    path.write_bytes(b"\x3a\x80")
    with pytest.raises(ValueError, match="not a well-formed ONNX model file"):
        static_estimate(str(path))
