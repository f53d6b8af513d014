"""The demo model: a small seeded MLP written as ONNX, for ``scripts/serve`` and the tests.

Shape: ``input`` float32 ``[batch, input_dim]`` → ``hidden_layers`` blocks of (MatMul, Add,
Relu) → MatMul, Add → ``output`` float32 ``[batch, output_dim]``, where ``batch`` is a
symbolic dimension. The weights are seeded, so one seed always gives the same file, and
scaled by ``1/sqrt(fan_in)`` so activations stay near unit size: outputs are finite and
not all zero for inputs of ordinary size.

The text model (``make_text_model``) takes and gives string tensors, for the tests and
for trying text requests: ``text`` string ``[batch]`` → ``tagged`` (each text with "!"
appended) and ``label`` (its index in TEXT_LABELS, -1 if none); ``numbers`` string
``[batch, 2]`` → ``value`` (each parsed as float32; text that is no number fails the run).

Only this module and the engine know ONNX; the server never builds a model at run time.
"""

import math
import os
from pathlib import Path
from typing import Final

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["OPSET", "TEXT_LABELS", "make_demo_model", "make_text_model"]

OPSET: Final = 17
# IR version 9 (ONNX 1.14) rather than the newest onnx writes: every ONNX Runtime release
# this project supports reads it, and the file does not depend on the onnx installed.
_IR_VERSION: Final = 9
# StringConcat is in ONNX's opset 20 (ONNX Runtime 1.17); LabelEncoder (ai.onnx.ml, string
# keys since that domain's opset 2) is declared at its opset 3.
_TEXT_OPSET: Final = 20
_TEXT_ML_OPSET: Final = 3
TEXT_LABELS: Final = ("cat", "dog", "bird")


def make_demo_model(
    path: str | os.PathLike[str],
    *,
    input_dim: int = 512,
    hidden_dim: int = 2048,
    hidden_layers: int = 2,
    output_dim: int = 10,
    seed: int = 0,
) -> None:
    """Writes the demo MLP to ``path`` (parent folders are created).

    Raises:
        ValueError: a dimension is < 1 or ``hidden_layers`` is < 0.
        onnx.checker.ValidationError: the built graph is invalid (a bug here).
    """
    for key, value in (
        ("input_dim", input_dim),
        ("hidden_dim", hidden_dim),
        ("output_dim", output_dim),
    ):
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    if hidden_layers < 0:
        raise ValueError(f"hidden_layers must be >= 0, got {hidden_layers}")

    rng = np.random.default_rng(seed)
    initializers: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def dense(x: str, fan_in: int, fan_out: int, prefix: str, out: str) -> None:
        """Appends ``out = x @ weight + bias``."""
        scale = np.float32(1 / math.sqrt(fan_in))
        weight = rng.standard_normal((fan_in, fan_out), dtype=np.float32) * scale
        bias = rng.standard_normal(fan_out, dtype=np.float32) * np.float32(0.1)
        initializers.append(numpy_helper.from_array(weight, f"{prefix}.weight"))
        initializers.append(numpy_helper.from_array(bias, f"{prefix}.bias"))
        nodes.append(helper.make_node("MatMul", [x, f"{prefix}.weight"], [f"{prefix}.matmul"]))
        nodes.append(helper.make_node("Add", [f"{prefix}.matmul", f"{prefix}.bias"], [out]))

    x = "input"
    fan_in = input_dim
    for layer in range(hidden_layers):
        prefix = f"hidden{layer}"
        dense(x, fan_in, hidden_dim, prefix, f"{prefix}.add")
        nodes.append(helper.make_node("Relu", [f"{prefix}.add"], [f"{prefix}.relu"]))
        x = f"{prefix}.relu"
        fan_in = hidden_dim
    dense(x, fan_in, output_dim, "head", "output")

    graph = helper.make_graph(
        nodes,
        "laneserve_demo_mlp",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", input_dim])],
        outputs=[helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", output_dim])],
        initializer=initializers,
    )
    _save(graph, [helper.make_opsetid("", OPSET)], path)


def make_text_model(path: str | os.PathLike[str]) -> None:
    """Writes the text model (the module's docstring) to ``path`` (parent folders are
    created)."""
    suffix = numpy_helper.from_array(np.array("!", dtype=object), "suffix")
    nodes = [
        helper.make_node("Constant", [], ["suffix"], value=suffix),
        helper.make_node("StringConcat", ["text", "suffix"], ["tagged"]),
        helper.make_node(
            "LabelEncoder",
            ["text"],
            ["label"],
            domain="ai.onnx.ml",
            keys_strings=list(TEXT_LABELS),
            values_int64s=list(range(len(TEXT_LABELS))),
            default_int64=-1,
        ),
        helper.make_node("Cast", ["numbers"], ["value"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "laneserve_text",
        inputs=[
            helper.make_tensor_value_info("text", TensorProto.STRING, ["batch"]),
            helper.make_tensor_value_info("numbers", TensorProto.STRING, ["batch", 2]),
        ],
        outputs=[
            helper.make_tensor_value_info("tagged", TensorProto.STRING, ["batch"]),
            helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
            helper.make_tensor_value_info("value", TensorProto.FLOAT, ["batch", 2]),
        ],
    )
    opsets = [
        helper.make_opsetid("", _TEXT_OPSET),
        helper.make_opsetid("ai.onnx.ml", _TEXT_ML_OPSET),
    ]
    _save(graph, opsets, path)


def _save(
    graph: onnx.GraphProto, opsets: list[onnx.OperatorSetIdProto], path: str | os.PathLike[str]
) -> None:
    """`graph` as a model of `opsets` and _IR_VERSION, checked, written to `path` (its
    parent folders made)."""
    model = helper.make_model(graph, opset_imports=opsets, producer_name="laneserve.demo_model")
    model.ir_version = _IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, target)
