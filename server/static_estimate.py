"""A model's memory from its file alone: weights, and per-row activations from ONNX shape
inference. Run as a script in a child process (`memory.estimate_memory`), so the serving
process never imports onnx or parses the weights; of laneserve it imports only
model_identity's protobuf walk, which nothing of onnx's or the server's comes with.

    python .../static_estimate.py MODEL [PROBE_SHAPES [PARENT_PID]]
    # prints: FIXED_BYTES PER_ROW_BYTES

PROBE_SHAPES: a JSON object, input name -> its shape after the row axis (the engine's
probe_shapes). PARENT_PID: the serving process, whose death ends the script
(`_exit_when_orphaned`).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import onnx

from laneserve.server.model_identity import (
    LENGTH_DELIMITED,
    protobuf_fields,
    read_varint,
    write_varint,
)

# Initializers larger than this lose their data before shape inference (small ones may
# be shape constants that inference folds, e.g. a Reshape target).
_KEEP_INITIALIZER_BYTES = 4 * 1024

# ONNX's field numbers (onnx.proto) on the way to the weights, and the fields of a
# tensor that hold its data inline (float_data, int32_data, int64_data, raw_data,
# double_data, uint64_data; string_data is kept: a STRING weight is counted 8 bytes an
# element whatever its strings, as ever).
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_INITIALIZER = 1, 5
_NODE_OP_TYPE, _NODE_ATTRIBUTE = 4, 5
_ATTRIBUTE_NAME, _ATTRIBUTE_TENSOR = 1, 5
_TENSOR_DIMS, _TENSOR_DATA_TYPE = 1, 2
_TENSOR_DATA = frozenset({4, 5, 7, 9, 10, 11})
# int64 dims as the wire holds them: a negative one is its two's complement in 64 bits.
_INT64_SIGN = 1 << 63

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
    model = _load_without_weights(model_path)
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
    fixed_bytes = sum(_tensor_bytes(tensor.data_type, math.prod(tensor.dims)) for tensor in weights)
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


def _load_without_weights(model_path: str) -> onnx.ModelProto:
    """The model in `model_path` (protobuf, its external data not read), parsed from a
    copy without its weights' data: the weights larger than _KEEP_INITIALIZER_BYTES lose
    their inline data, keeping their dims and data_type. Parsed whole (`onnx.load`), the
    child peaked at about twice the model's size (README: measured once), its weights
    read into the protobuf and copied again, only to be dropped: a pod sized for twice its model
    could be killed for memory at start-up. The file is mapped and walked field by field
    (`protobuf_fields`), the weights' data stepped over unread."""
    with (
        Path(model_path).open("rb") as file,
        mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data,
    ):
        try:
            stripped = model_without_weights(data)
        except (IndexError, ValueError) as error:  # IndexError: a varint cut by the end
            raise ValueError(
                f"{model_path}: not a well-formed ONNX model file ({error})"
            ) from error
    return onnx.load_from_string(stripped)


def model_without_weights(data: mmap.mmap) -> bytes:
    """The serialized ModelProto in `data` without the data of its weights larger than
    _KEEP_INITIALIZER_BYTES: the main graph's initializers and the `value` of its
    Constant nodes, the weights `static_estimate` counts. Every other field is copied as
    it is: a message's fields in their order, only the lengths of those holding a weight
    rewritten. ValueError (or IndexError) when `data` is not a well-formed protobuf."""
    return _copy(data, 0, len(data), {_MODEL_GRAPH: _graph})


_Rewrite = Callable[[mmap.mmap, int, int], bytes]


def _copy(data: mmap.mmap, start: int, end: int, rewrites: Mapping[int, _Rewrite]) -> bytes:
    """The message in `data[start:end]` with its length-delimited fields numbered in
    `rewrites` rewritten by theirs, and every other field as it is."""
    parts: list[bytes] = []
    for field in protobuf_fields(data, start, end):
        rewrite = rewrites.get(field.number)
        if rewrite is None or field.wire_type != LENGTH_DELIMITED:
            parts.append(data[field.start : field.end])
            continue
        value = rewrite(data, field.value_start, field.end)
        parts += [
            write_varint(field.number << 3 | LENGTH_DELIMITED),
            write_varint(len(value)),
            value,
        ]
    return b"".join(parts)


def _graph(data: mmap.mmap, start: int, end: int) -> bytes:
    return _copy(data, start, end, {_GRAPH_NODE: _node, _GRAPH_INITIALIZER: _tensor})


def _node(data: mmap.mmap, start: int, end: int) -> bytes:
    """A node, the `value` of a Constant node without its weight's data (as
    `static_estimate` counts them, from any domain)."""
    op_type = _last_string(data, start, end, _NODE_OP_TYPE)
    if op_type != b"Constant":
        return data[start:end]
    return _copy(data, start, end, {_NODE_ATTRIBUTE: _attribute})


def _attribute(data: mmap.mmap, start: int, end: int) -> bytes:
    if _last_string(data, start, end, _ATTRIBUTE_NAME) != b"value":
        return data[start:end]
    return _copy(data, start, end, {_ATTRIBUTE_TENSOR: _tensor})


def _tensor(data: mmap.mmap, start: int, end: int) -> bytes:
    """A tensor, without its inline data where it weighs more than
    _KEEP_INITIALIZER_BYTES: its dims (packed or not) and data_type are all inference
    needs of it."""
    dims: list[int] = []
    data_type = 0
    for field in protobuf_fields(data, start, end):
        if field.number == _TENSOR_DATA_TYPE and field.wire_type == 0:
            data_type = field.value
        elif field.number == _TENSOR_DIMS and field.wire_type == 0:
            dims.append(field.value)
        elif field.number == _TENSOR_DIMS and field.wire_type == LENGTH_DELIMITED:
            position = field.value_start
            while position < field.end:
                dim, position = read_varint(data, position)
                dims.append(dim)
    signed_dims = [dim - 2 * _INT64_SIGN if dim >= _INT64_SIGN else dim for dim in dims]
    try:
        size = _tensor_bytes(data_type, math.prod(signed_dims))
    except KeyError:  # no data_type here (a tensor written twice, merged by protobuf)
        return data[start:end]  # kept whole: the count after parsing sizes it
    if size <= _KEEP_INITIALIZER_BYTES:
        # Small ones may be shape constants that inference folds (a Reshape target).
        return data[start:end]
    return b"".join(
        data[field.start : field.end]
        for field in protobuf_fields(data, start, end)
        if field.number not in _TENSOR_DATA
    )


def _last_string(data: mmap.mmap, start: int, end: int, number: int) -> bytes | None:
    """The bytes of field `number` of the message in `data[start:end]` (the last written,
    as protobuf reads a field written twice), None where it is not set."""
    value = None
    for field in protobuf_fields(data, start, end):
        if field.number == number and field.wire_type == LENGTH_DELIMITED:
            value = data[field.value_start : field.end]
    return value


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


# How often the script looks for its parent gone, and its exit status then (the parent's
# answer is unread: nobody waits for it).
ORPHAN_CHECK_S = 0.5
ORPHANED_EXIT = 3


def _exit_when_orphaned(parent_pid: int) -> None:
    """Ends this process once its parent is no longer `parent_pid` (it died: the child is
    re-parented, to init or a subreaper). The server ends its children when it stops
    (`memory.stop_estimates`), but a server SIGKILLed (the OOM killer, a container
    runtime's kill) runs nothing, and PR_SET_PDEATHSIG would not do it: it fires when the
    thread that started the child ends, a loading thread, long before the process. An
    orphan parsed the model on, GBs resident, until done. Checked from the first: the
    parent may be gone before this runs. A daemon thread: the parse holds the main one."""
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(ORPHANED_EXIT)


def main(argv: Sequence[str]) -> int:
    if len(argv) > 2:  # noqa: PLR2004 - MODEL PROBE_SHAPES PARENT_PID
        threading.Thread(target=_exit_when_orphaned, args=(int(argv[2]),), daemon=True).start()
    probe_shapes = json.loads(argv[1]) if len(argv) > 1 else None
    fixed_bytes, per_row_bytes = static_estimate(argv[0], probe_shapes)
    print(fixed_bytes, per_row_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
