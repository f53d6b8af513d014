"""A model's memory from its file alone: weights, and per-row activations from ONNX shape
inference. Run as a script in a child process (`memory.estimate_memory`), so it imports
nothing from laneserve and the serving process never imports onnx or parses the weights.

    python .../static_estimate.py MODEL [PROBE_SHAPES]   # prints: FIXED_BYTES PER_ROW_BYTES

PROBE_SHAPES: a JSON object, input name -> its shape after the row axis (the engine's
probe_shapes).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence

import onnx

# Initializers larger than this lose their data before shape inference (small ones may
# be shape constants that inference folds, e.g. a Reshape target).
_KEEP_INITIALIZER_BYTES = 4 * 1024

# Bits per element of the types ONNX packs below a byte (onnx.proto, TensorProto.raw_data:
# two 4-bit, four 2-bit, or four 6-bit elements in three bytes, the last byte padded).
# numpy's stand-ins for them (ml_dtypes) take a whole byte each: counted so, a model of
# 16 MiB of packed INT4 weights was 32 MiB, and a 28 MiB CPU budget, which ONNX Runtime
# enforced, was refused. tests/test_static_estimate.py checks every type onnx knows.
_PACKED_BITS: dict[int, int] = {
    onnx.TensorProto.INT4: 4,
    onnx.TensorProto.UINT4: 4,
    onnx.TensorProto.FLOAT4E2M1: 4,
    onnx.TensorProto.INT2: 2,
    onnx.TensorProto.UINT2: 2,
    onnx.TensorProto.FLOAT6E2M3: 6,
    onnx.TensorProto.FLOAT6E3M2: 6,
}


def static_estimate(
    model_path: str, probe_shapes: Mapping[str, Sequence[int]] | None = None
) -> tuple[int, int]:
    """(fixed_bytes, per_row_bytes): the initializers' bytes, and every batch-shaped
    tensor of one row summed without the runtime's buffer reuse (so the estimate is high:
    a starting point that the start-up probe verifies by running). A row is one of the
    shapes the probe runs: `probe_shapes` (input name -> its shape after the row axis)
    for the inputs' dynamic sizes, 1 for those not given."""
    model = onnx.load(model_path, load_external_data=False)
    _fix_input_sizes(model.graph, probe_shapes or {})
    # Weights are initializers, or the `value` of Constant nodes (some exporters write
    # them so): counted from initializers alone, such a model's weights were 0 bytes and
    # any CPU budget was taken, the weights then held outside the capped arena.
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
    fixed_bytes = 0
    for tensor in weights:
        size = _tensor_bytes(tensor.data_type, math.prod(tensor.dims))
        fixed_bytes += size
        if size > _KEEP_INITIALIZER_BYTES:
            # Shapes are all inference needs; dropping the weights' bytes keeps the
            # serialized copy handed to inference small.
            for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
                tensor.ClearField(field)
    graph = onnx.shape_inference.infer_shapes(model).graph
    per_row_bytes = 0
    batch_dims = {
        dim.dim_param or str(dim.dim_value)
        for value in graph.input
        for dim in value.type.tensor_type.shape.dim[:1]
    }
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor_type = value.type.tensor_type
        dims = tensor_type.shape.dim
        if not dims or (dims[0].dim_param or str(dims[0].dim_value)) not in batch_dims:
            continue
        row_elements = math.prod(dim.dim_value or 1 for dim in dims[1:])
        per_row_bytes += _tensor_bytes(tensor_type.elem_type, row_elements)
    return int(fixed_bytes), int(per_row_bytes)


def _tensor_bytes(data_type: int, elements: int) -> int:
    """A tensor's bytes as ONNX packs them: sub-byte types padded to a whole byte per
    tensor (for one row of activations, per row: a high count by under a byte a row)."""
    bits = _PACKED_BITS.get(data_type)
    if bits is None:
        return elements * onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    return -(-elements * bits // 8)


def _fix_input_sizes(graph: onnx.GraphProto, probe_shapes: Mapping[str, Sequence[int]]) -> None:
    """Gives the inputs' dynamic sizes after the row axis the probe's values, before shape
    inference: left dynamic, each tensor sized by one counted 1 wide, and a model of
    dynamic width was estimated at 20 bytes a row where the probe's 256-wide rows used
    264 KiB (its [batch, width, width] outer product). A shape of another rank than the
    input's (the engine refuses it) counts as not given."""
    weights = {tensor.name for tensor in graph.initializer}  # inputs too, before IR 4
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name in weights or not dims:
            continue
        given = probe_shapes.get(value.name)
        if given is not None and len(given) != len(dims) - 1:
            given = None
        for index, dim in enumerate(dims[1:]):
            if not dim.HasField("dim_value"):
                dim.dim_value = 1 if given is None else int(given[index])


def main(argv: Sequence[str]) -> int:
    probe_shapes = json.loads(argv[1]) if len(argv) > 1 else None
    fixed_bytes, per_row_bytes = static_estimate(argv[0], probe_shapes)
    print(fixed_bytes, per_row_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
