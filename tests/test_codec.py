"""The wire codec (laneserve.client.tensors): round trips, byte layout and refusals."""

import asyncio
import re
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest

from laneserve.client import tensors
from laneserve.client.tensors import decode_tensor, encode_tensor
from laneserve.server import Engine, ServerConfig
from laneserve.server.codec import (
    check_counts,
    decode_inputs,
    dtype_refusal,
    extra_bytes,
    leading_rows,
)
from laneserve.server.config import GRPC_INT_MAX
from laneserve.server.engine import TensorSpec
from laneserve.server.errors import InvalidInputError
from laneserve.v1 import inference_pb2 as pb
from tests.support import estimate_once, rich_status, rows, serving

# numpy dtype, wire data type, ONNX Runtime type: the table the codec must implement.
TYPES: list[tuple[str, int, str]] = [
    ("float32", pb.DATA_TYPE_FLOAT32, "tensor(float)"),
    ("float16", pb.DATA_TYPE_FLOAT16, "tensor(float16)"),
    ("float64", pb.DATA_TYPE_FLOAT64, "tensor(double)"),
    ("int8", pb.DATA_TYPE_INT8, "tensor(int8)"),
    ("int16", pb.DATA_TYPE_INT16, "tensor(int16)"),
    ("int32", pb.DATA_TYPE_INT32, "tensor(int32)"),
    ("int64", pb.DATA_TYPE_INT64, "tensor(int64)"),
    ("uint8", pb.DATA_TYPE_UINT8, "tensor(uint8)"),
    ("uint16", pb.DATA_TYPE_UINT16, "tensor(uint16)"),
    ("uint32", pb.DATA_TYPE_UINT32, "tensor(uint32)"),
    ("uint64", pb.DATA_TYPE_UINT64, "tensor(uint64)"),
    ("bool", pb.DATA_TYPE_BOOL, "tensor(bool)"),
]
DTYPES = [numpy for numpy, _, _ in TYPES]
SHAPES: list[tuple[int, ...]] = [(), (1,), (5,), (2, 3), (2, 3, 4), (0,), (3, 0, 2)]


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> npt.NDArray[Any]:
    """Values that use the dtype's range (negatives, large magnitudes), reproducibly."""
    rng = np.random.default_rng(seed)
    kind = np.dtype(dtype)
    if kind == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if kind.kind == "f":
        return (rng.standard_normal(size=shape) * 1000).astype(kind)
    info = np.iinfo(kind)
    values: np.ndarray[Any, Any] = rng.integers(
        info.min, info.max, size=shape, dtype=kind, endpoint=True
    )
    return values


def test_table_covers_every_concrete_wire_data_type() -> None:
    """Every fixed-size type is in TYPES; STRING, of elements each its own length, is
    `test_string_maps_to_object_arrays_and_takes_every_numpy_text_dtype`'s."""
    concrete = set(pb.DataType.values()) - {pb.DATA_TYPE_UNSPECIFIED, pb.DATA_TYPE_STRING}
    assert {datatype for _, datatype, _ in TYPES} == concrete


def test_string_maps_to_object_arrays_and_takes_every_numpy_text_dtype() -> None:
    string = pb.DATA_TYPE_STRING
    assert tensors.numpy_dtype(string) == np.dtype(object)
    assert tensors.onnx_type(string) == "tensor(string)"
    assert tensors.datatype_for_onnx_type("tensor(string)") == string
    assert tensors.numpy_dtype_for_onnx_type("tensor(string)") == np.dtype(object)
    assert tensors.datatype_name(string) == "string"
    for text in ("U3", "S3", "O", np.dtypes.StringDType()):
        assert tensors.datatype_of(text) == string
        assert tensors.datatype_name(np.dtype(text)) == "string"
        assert tensors.is_text_dtype(text)
    # A structured dtype holding objects is no text (it has no wire type at all).
    others: list[npt.DTypeLike] = [*DTYPES, [("label", "O")], "V4", "complex64"]
    for other in others:
        assert not tensors.is_text_dtype(other)


@pytest.mark.parametrize(("numpy", "datatype", "onnx"), TYPES)
def test_type_mappings_agree_both_ways(numpy: str, datatype: int, onnx: str) -> None:
    wire = pb.DataType.ValueType(datatype)
    assert tensors.numpy_dtype(wire) == np.dtype(numpy)
    assert tensors.datatype_of(numpy) == datatype
    assert tensors.datatype_of(np.dtype(numpy).newbyteorder(">")) == datatype
    assert tensors.onnx_type(wire) == onnx
    assert tensors.datatype_for_onnx_type(onnx) == datatype
    assert tensors.numpy_dtype_for_onnx_type(onnx) == np.dtype(numpy)
    assert tensors.datatype_name(datatype) == numpy
    assert tensors.datatype_name(np.dtype(numpy)) == numpy
    assert pb.DataType.Name(wire) == "DATA_TYPE_" + numpy.upper()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_keeps_dtype_shape_and_values(dtype: str, shape: tuple[int, ...]) -> None:
    array = sample(dtype, shape)

    tensor = encode_tensor("x", array)
    decoded = decode_tensor(pb.Tensor.FromString(tensor.SerializeToString()))

    assert tensor.name == "x"
    assert tensor.dtype == tensors.datatype_of(dtype)
    assert list(tensor.shape) == list(shape)
    assert tensor.data == array.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    assert decoded.dtype == np.dtype(dtype)
    assert decoded.shape == shape
    np.testing.assert_array_equal(decoded, array)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_input_is_sent_in_row_major_order(dtype: str) -> None:
    base = sample(dtype, (4, 6, 3))
    for view in (base[:, ::2], base.transpose(2, 0, 1), base[::-1, 1:, 0], np.asfortranarray(base)):
        tensor = encode_tensor("v", view)
        assert tensor.data == np.ascontiguousarray(view).tobytes()
        np.testing.assert_array_equal(decode_tensor(tensor), view)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if np.dtype(d).itemsize > 1])
def test_big_endian_input_is_sent_little_endian(dtype: str) -> None:
    little = sample(dtype, (3, 4))
    big = little.astype(np.dtype(dtype).newbyteorder(">"))

    tensor = encode_tensor("b", big)

    assert tensor.data == little.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    decoded = decode_tensor(tensor)
    assert decoded.dtype.byteorder in "<=|"
    np.testing.assert_array_equal(decoded, little)


def test_known_bytes_are_little_endian() -> None:
    tensor = encode_tensor("k", np.array([1, 256], dtype=np.uint16))
    assert tensor.data == b"\x01\x00\x00\x01"
    assert tensor.dtype == pb.DATA_TYPE_UINT16


def test_decode_is_a_read_only_view_of_the_bytes() -> None:
    tensor = encode_tensor("r", np.arange(12, dtype=np.float32).reshape(3, 4))
    decoded = decode_tensor(tensor)
    assert not decoded.flags.writeable
    assert not decoded.flags.owndata
    base = decoded.base
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, bytes)


def test_int64_aliases_map_to_one_wire_type() -> None:
    for alias in (np.int64, np.longlong, np.intp):
        assert tensors.datatype_of(alias) == pb.DATA_TYPE_INT64


@pytest.mark.parametrize("dtype", ["complex64", "float128", "datetime64[s]", "timedelta64[s]"])
def test_encode_refuses_unsupported_dtype_naming_the_tensor(dtype: str) -> None:
    try:
        array = np.zeros(2, dtype=dtype)
    except TypeError:
        pytest.skip(f"numpy has no {dtype} on this platform")
    with pytest.raises(ValueError, match=r"tensor 'weird': numpy dtype .* is not supported"):
        encode_tensor("weird", array)


@pytest.mark.parametrize(
    ("datatype", "shown"),
    [(pb.DATA_TYPE_UNSPECIFIED, "unspecified"), (99, "unknown data type 99")],
)
def test_decode_refuses_dtype_without_numpy_type(datatype: int, shown: str) -> None:
    tensor = pb.Tensor(name="in", shape=[1], data=b"\x00" * 4)
    tensor.dtype = pb.DataType.ValueType(datatype)
    with pytest.raises(
        ValueError, match=rf"tensor 'in': dtype is {shown}; expected one of float32"
    ):
        decode_tensor(tensor)


@pytest.mark.parametrize("data_len", [0, 23, 25, 48])
def test_decode_refuses_data_length_not_matching_shape(data_len: int) -> None:
    tensor = pb.Tensor(name="in", dtype=pb.DATA_TYPE_FLOAT32, shape=[2, 3], data=b"\x00" * data_len)
    with pytest.raises(
        ValueError,
        match=(
            rf"tensor 'in': data is {data_len} bytes; expected 24 "
            r"\(6 float32 of 4 bytes for shape \[2, 3\]\)"
        ),
    ):
        decode_tensor(tensor)


def test_decode_refuses_data_for_empty_shape() -> None:
    tensor = pb.Tensor(name="e", dtype=pb.DATA_TYPE_INT8, shape=[0, 4], data=b"\x01")
    with pytest.raises(ValueError, match=r"tensor 'e': data is 1 bytes; expected 0"):
        decode_tensor(tensor)


def test_decode_refuses_negative_dimension() -> None:
    tensor = pb.Tensor(name="neg", dtype=pb.DATA_TYPE_FLOAT32, shape=[-1, 2], data=b"")
    with pytest.raises(ValueError, match=r"tensor 'neg': shape \[-1, 2\] has a negative dimension"):
        decode_tensor(tensor)


def test_decode_refuses_a_shape_numpy_cannot_index_naming_the_tensor() -> None:
    """numpy's own words alone named neither the tensor nor what was expected."""
    tensor = pb.Tensor(name="big", dtype=pb.DATA_TYPE_FLOAT32, shape=[0, 2**62, 2**62], data=b"")
    with pytest.raises(
        ValueError, match=r"tensor 'big': numpy cannot hold shape .*expected at most 64 dim"
    ):
        decode_tensor(tensor)


@pytest.mark.parametrize(
    "shape",
    [[1] * 65, [2**62] * 300, [2] * 200_000],
    ids=["65-dimensions", "300-huge-dimensions", "200000-dimensions"],
)
def test_decode_refuses_more_dimensions_than_numpy_holds_before_sizing_the_data(
    shape: list[int],
) -> None:
    """The dimensions are counted before they are multiplied: the product of 300 sizes
    near 2**62 failed Python's int-to-text limit, and the refusal read "Exceeds the limit
    (4300 digits) for integer string conversion" (neither the tensor nor what was
    expected); the product of a million dimensions took seconds, on the server's event
    loop, while every other call waited."""
    tensor = pb.Tensor(name="deep", dtype=pb.DATA_TYPE_FLOAT32, shape=shape, data=b"\0" * 4)
    with pytest.raises(
        ValueError,
        match=rf"^tensor 'deep': shape has {len(shape)} dimensions; expected at most 64$",
    ):
        decode_tensor(tensor)


def test_decode_refuses_bool_bytes_other_than_zero_and_one() -> None:
    tensor = pb.Tensor(name="flags", dtype=pb.DATA_TYPE_BOOL, shape=[3], data=b"\x00\x01\x02")
    with pytest.raises(ValueError, match=r"tensor 'flags': bool data has bytes other than 0 and 1"):
        decode_tensor(tensor)


@pytest.mark.parametrize("datatype", [pb.DATA_TYPE_UNSPECIFIED, 42])
def test_wire_to_numpy_and_onnx_refuse_non_concrete_types(datatype: int) -> None:
    wire = pb.DataType.ValueType(datatype)
    with pytest.raises(ValueError, match="expected one of"):
        tensors.numpy_dtype(wire)
    with pytest.raises(ValueError, match="expected one of"):
        tensors.onnx_type(wire)


def test_onnx_types_without_wire_type_are_refused() -> None:
    for onnx in ("tensor(bfloat16)", "tensor(complex64)", "seq(tensor(float))", "float"):
        with pytest.raises(
            ValueError, match=re.escape(f"ONNX Runtime type '{onnx}' is not supported")
        ):
            tensors.datatype_for_onnx_type(onnx)
        assert tensors.numpy_dtype_for_onnx_type(onnx) is None


def test_numpy_dtypes_without_wire_type_are_refused_and_keep_their_name() -> None:
    with pytest.raises(ValueError, match="numpy dtype complex128 is not supported"):
        tensors.datatype_of(np.complex128)
    assert tensors.datatype_name(np.complex64) == "complex64"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_extra_bytes_of_a_request_as_any_encoder_writes_it_is_zero(
    dtype: str, shape: tuple[int, ...]
) -> None:
    """`extra_bytes` sizes each field as protobuf encodes it, with no tensor data read."""
    message = pb.InferRequest(
        request_id="é" * 40,
        lane="bulk",
        timeout_ms=70_000,
        inputs=[encode_tensor("a", sample(dtype, shape)), encode_tensor("", sample(dtype, (3,)))],
        output_names=["output", ""],
    )
    wire = message.SerializeToString()
    assert extra_bytes(pb.InferRequest.FromString(wire), len(wire)) == 0
    unknown = b"\xc2\x3e\x03abc"  # field 1000, 3 bytes
    padded = wire + unknown
    assert extra_bytes(pb.InferRequest.FromString(padded), len(padded)) == len(unknown)


def test_extra_bytes_are_not_measured_for_a_tensor_that_sizes_no_data() -> None:
    for tensor in (pb.Tensor(name="a"), pb.Tensor(name="a", dtype=pb.DATA_TYPE_INT8, shape=[-1])):
        message = pb.InferRequest(inputs=[tensor])
        assert extra_bytes(message, message.ByteSize()) is None


ROWS_SPEC = TensorSpec("input", np.dtype(np.float32), (-1, 4))
# One row of data under a shape of 2**40 rows: more data than any request can carry.
MISSHAPEN = pb.Tensor(name="input", dtype=pb.DATA_TYPE_FLOAT32, shape=[2**40, 4], data=b"\0" * 16)


@pytest.mark.parametrize(
    ("shape", "data"),
    [([2**32, 2**32, 0], b""), ([2, 2, 2], b"\0" * 32), ([3], b"\0" * 12)],
    ids=["huge-dimensions", "a-dimension-too-many", "a-dimension-too-few"],
)
def test_a_shape_of_another_rank_is_refused_as_the_models_before_its_data_is_read(
    shape: list[int], data: bytes
) -> None:
    """Of the model's input [-1, 4], a shape of another rank is named against the
    model's (it was refused by the decoder first: "numpy cannot hold shape ... expected at
    most 64 dimensions", of a 3-dimensional shape)."""
    tensor = pb.Tensor(name="input", dtype=pb.DATA_TYPE_FLOAT32, shape=shape, data=data)
    with pytest.raises(InvalidInputError) as refused:
        decode_inputs([tensor], [ROWS_SPEC])
    assert refused.value.message == (
        f"input 'input' has shape {shape}; expected float32 with shape [-1, 4], -1 = any size"
    )


def test_a_shape_no_request_could_carry_is_refused_for_its_data_not_counted_as_rows() -> None:
    """Its 2**40 rows were counted (and refused as too many, "split it"): its fault is
    its data's length, which `decode_inputs` names."""
    assert leading_rows([MISSHAPEN], [ROWS_SPEC], max_message_bytes=GRPC_INT_MAX) is None
    with pytest.raises(InvalidInputError) as refused:
        decode_inputs([MISSHAPEN], [ROWS_SPEC])
    assert str(refused.value) == (
        "tensor 'input': data is 16 bytes; expected 17592186044416 (4398046511104 float32 "
        "of 4 bytes for shape [1099511627776, 4])"
    )


def test_leading_rows_count_a_shape_up_to_the_servers_largest_request_unread() -> None:
    """The bound is the most bytes a message to this server may have (its
    max_message_bytes, at most GRPC_INT_MAX): it was GRPC_INT_MAX whatever the server's,
    so a shape of 205 MB against a 64 MiB limit was counted as rows, to be split. Within
    it the shape is counted without its data read."""
    spec = TensorSpec("input", np.dtype(np.uint8), (-1,))

    def shaped(row_count: int) -> pb.Tensor:
        return pb.Tensor(name="input", dtype=pb.DATA_TYPE_UINT8, shape=[row_count])

    for limit in (64 * 2**20, GRPC_INT_MAX):
        assert leading_rows([shaped(limit)], [spec], max_message_bytes=limit) == limit
        assert leading_rows([shaped(limit + 1)], [spec], max_message_bytes=limit) is None
    unknown_dtype = pb.Tensor(name="input", shape=[2**40])
    assert leading_rows([unknown_dtype], [spec], max_message_bytes=GRPC_INT_MAX) is None


def test_leading_rows_are_not_counted_for_a_dtype_or_shape_the_input_does_not_take() -> None:
    """Counted, each was refused as too many rows ("split it") in a lane too small for its
    shape[0], and for its real fault in a lane with room: a flattened batch, a wrong
    width, a wrong dtype, a wrong rank. `decode_inputs` names it. A dtype and shape the
    input takes are counted, the data unread: one whose data is short still is."""

    def tensor(datatype: int, shape: list[int], name: str = "input") -> pb.Tensor:
        return pb.Tensor(name=name, dtype=pb.DataType.ValueType(datatype), shape=shape)

    float32 = pb.DATA_TYPE_FLOAT32
    misfits = {
        "flattened": tensor(float32, [3000 * 4]),
        "wrong width": tensor(float32, [3000, 2]),
        "wrong dtype": tensor(pb.DATA_TYPE_FLOAT64, [3000, 4]),
        "wrong rank": tensor(float32, [3000, 4, 1]),
    }
    for what, misfit in misfits.items():
        assert leading_rows([misfit], [ROWS_SPEC], max_message_bytes=GRPC_INT_MAX) is None, what
    short = pb.Tensor(name="input", dtype=float32, shape=[3000, 4], data=b"\0")
    assert leading_rows([short], [ROWS_SPEC], max_message_bytes=GRPC_INT_MAX) == 3000
    # Each input is read so, not the first alone; and they are the model's, each once.
    specs = [ROWS_SPEC, TensorSpec("mask", np.dtype(np.uint8), (-1, 2))]
    first = tensor(float32, [3000, 4])
    mask = tensor(pb.DATA_TYPE_UINT8, [3000, 2], "mask")
    assert leading_rows([first, mask], specs, max_message_bytes=GRPC_INT_MAX) == 3000
    for what, others in {
        "second misfit": [tensor(pb.DATA_TYPE_UINT8, [3000, 3], "mask")],
        "rows differ": [tensor(pb.DATA_TYPE_UINT8, [2, 2], "mask")],
        "missing": [],
        "repeated": [first],
        "unknown": [tensor(pb.DATA_TYPE_UINT8, [3000, 2], "maks")],
    }.items():
        assert leading_rows([first, *others], specs, max_message_bytes=GRPC_INT_MAX) is None, what


# Add(a[N, K], b[N, K]): inputs that must agree on K.
NAMED_SPECS = [TensorSpec(name, np.dtype(np.float32), (-1, -1), ("N", "K")) for name in ("a", "b")]


def test_leading_rows_are_not_counted_for_inputs_that_disagree_on_a_named_dimension() -> None:
    """K = 3 in a and 4 in b, 3000 rows: counted, a lane smaller than 3000 refused it as
    too many rows ("split it"), though every part split from it is refused for K, which
    `decode_inputs` names. Agreeing on K, they are counted."""

    def named(name: str, width: int) -> pb.Tensor:
        return pb.Tensor(name=name, dtype=pb.DATA_TYPE_FLOAT32, shape=[3000, width])

    disagreeing = [named("a", 3), named("b", 4)]
    assert leading_rows(disagreeing, NAMED_SPECS, max_message_bytes=GRPC_INT_MAX) is None
    filled = [encode_tensor(t.name, np.zeros(list(t.shape), np.float32)) for t in disagreeing]
    with pytest.raises(InvalidInputError) as refused:
        decode_inputs(filled, NAMED_SPECS)
    assert refused.value.message == (
        "inputs 'a' and 'b' must agree on the model's dimension 'K': axis 1 of 'a' is 3, "
        "axis 1 of 'b' is 4"
    )
    agreeing = [named("a", 3), named("b", 3)]
    assert leading_rows(agreeing, NAMED_SPECS, max_message_bytes=GRPC_INT_MAX) == 3000


def test_dtype_refusal_is_the_one_decode_inputs_gives_first() -> None:
    """For a request refused unread: an unknown or repeated input is refused by
    `decode_inputs` before a later input's dtype, so its dtype was named for [a float32,
    a float16], refused for "'a' is given more than once". None there (the oversized
    request's own refusal is given); the dtype's where `decode_inputs` names it first."""

    def tensor(name: str, datatype: int) -> pb.Tensor:
        wire = pb.DataType.ValueType(datatype)
        return pb.Tensor(name=name, dtype=wire, shape=[1, 4], data=bytes(16))

    float32, float16 = pb.DATA_TYPE_FLOAT32, pb.DATA_TYPE_FLOAT16
    cases = {
        "repeated": [tensor("a", float32), tensor("a", float16)],
        "unknown first": [tensor("x", float16), tensor("b", float16)],
        "unknown of its dtype first": [tensor("x", float32), tensor("b", float16)],
        "dtype first": [tensor("a", float16), tensor("x", float32)],
        "dtype second": [tensor("a", float32), tensor("b", float16)],
    }
    for what, given in cases.items():
        with pytest.raises(InvalidInputError) as refused:
            decode_inputs(given, NAMED_SPECS)
        first = refused.value.message
        found = dtype_refusal(given, NAMED_SPECS)
        if found is not None:
            assert found == first, what
        else:
            assert "has dtype" not in first, what
    assert dtype_refusal(cases["repeated"], NAMED_SPECS) is None
    assert dtype_refusal(cases["dtype second"], NAMED_SPECS) == (
        "input 'b' has dtype float16; expected float32 with shape [-1, -1], -1 = any size"
    )


@pytest.mark.parametrize("row_count", [2**40, 100_000], ids=["over-2GiB", "over-64MiB"])
def test_a_shape_no_request_could_carry_is_refused_for_its_data_over_grpc(
    small_model: Path, row_count: int
) -> None:
    """Neither is counted as rows over the lane's capacity ("split it"): 100 000 rows of
    512 float32 are 205 MB, more than the server's max_message_bytes (64 MiB) lets a
    request carry, though less than gRPC's largest message."""

    async def scenario() -> None:
        engine = Engine(str(small_model), estimate=estimate_once)
        async with serving(engine, ServerConfig(model_path=str(small_model))) as s:
            one_row = rows(1)
            misshapen = pb.Tensor(
                name="input",
                dtype=pb.DATA_TYPE_FLOAT32,
                shape=[row_count, one_row.shape[1]],
                data=one_row.tobytes(),
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(pb.InferRequest(inputs=[misshapen]))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(caught.value)[0] == "INVALID_INPUT"
            details = caught.value.details() or ""
            assert "tensor 'input': data is 2048 bytes; expected" in details
            assert "split it" not in details

    asyncio.run(scenario())


def test_a_dtype_other_than_the_models_is_named_before_the_data_is_sized() -> None:
    """float32 data labelled DATA_TYPE_FLOAT64 (a client's wrong enum) was told "data is
    2048 bytes; expected 4096 (512 float64 ...)": its data's length, sized by the wrong
    dtype, which steered the client to send twice the data. The server converts no
    dtype: one other than the model's is the fault, named first, whatever the data's
    length. An unspecified or unknown one is refused in the words that list them all."""
    data = np.zeros((2, 4), dtype=np.float32).tobytes()

    def refusal(datatype: int) -> str:
        wire = pb.DataType.ValueType(datatype)
        tensor = pb.Tensor(name="input", dtype=wire, shape=[2, 4], data=data)
        with pytest.raises(InvalidInputError) as caught:
            decode_inputs([tensor], [ROWS_SPEC])
        return caught.value.message

    for datatype, name in [
        (pb.DATA_TYPE_FLOAT64, "float64"),  # the data is shorter than its dtype sizes
        (pb.DATA_TYPE_FLOAT16, "float16"),  # longer
        (pb.DATA_TYPE_INT32, "int32"),  # as long
    ]:
        assert refusal(datatype) == (
            f"input 'input' has dtype {name}; expected float32 with shape [-1, 4], -1 = any size"
        )
    assert refusal(pb.DATA_TYPE_UNSPECIFIED).startswith(
        "tensor 'input': dtype is unspecified; expected one of float32, "
    )
    assert refusal(99).startswith("tensor 'input': dtype is unknown data type 99; expected one")
    tensor = pb.Tensor(name="input", dtype=pb.DATA_TYPE_FLOAT32, shape=[2, 4], data=data)
    assert decode_inputs([tensor], [ROWS_SPEC]).rows == 2


def test_float32_data_labelled_float64_is_told_its_dtype_over_grpc(small_model: Path) -> None:
    async def scenario() -> None:
        engine = Engine(str(small_model), estimate=estimate_once)
        async with serving(engine, ServerConfig(model_path=str(small_model))) as s:
            one_row = rows(1)
            mislabelled = pb.Tensor(
                name="input",
                dtype=pb.DATA_TYPE_FLOAT64,
                shape=one_row.shape,
                data=one_row.tobytes(),
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(pb.InferRequest(inputs=[mislabelled]))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(caught.value)[0] == "INVALID_INPUT"
            assert caught.value.details() == (
                "input 'input' has dtype float64; expected float32 with shape [-1, 512], "
                "-1 = any size"
            )

    asyncio.run(scenario())


def test_too_many_inputs_are_refused_naming_the_unknown_or_repeated_ones() -> None:
    """ "request has 4 inputs; expected the model's inputs ['a', 'b', 's'], each once" did
    not say which one was extra. The names are read from the first len(specs) + 1 inputs
    only (the count bounds the work a hostile request makes), and among that many, one at
    least is unknown or repeated."""
    specs = [TensorSpec(name, np.dtype(np.float32), (-1,)) for name in ("a", "b", "s")]
    expected = "expected the model's inputs ['a', 'b', 's'], each once"

    def refusal(*names: str) -> str:
        with pytest.raises(InvalidInputError) as caught:
            check_counts([pb.Tensor(name=name) for name in names], specs)
        return caught.value.message

    assert refusal("a", "b", "s", "extra") == (
        f"request has 4 inputs; 'extra' is not an input of the model; {expected}"
    )
    assert refusal("a", "b", "a", "s") == (
        f"request has 4 inputs; 'a' is given more than once; {expected}"
    )
    assert refusal("x", "a", "x", "a", "y") == (
        "request has 5 inputs; among its first 4, 'x' is not an input of the model and 'a' "
        f"is given more than once; {expected}"
    )
    assert refusal("x", "y", "z", "w", *["a"] * 10_000) == (
        f"request has 10004 inputs; among its first 4, 'x', 'y', 'z', 'w' are not inputs of "
        f"the model; {expected}"
    )
    check_counts([pb.Tensor(name=name) for name in ("b", "a")], specs)  # counted, not named


def test_a_repeated_input_within_the_count_is_refused_in_the_counts_words() -> None:
    """Within the model's count, `decode_inputs` finds the repeat: in the words the count's
    refusal uses ("given more than once"; it said "given twice", the same fault)."""
    specs = [TensorSpec(name, np.dtype(np.float32), (-1,)) for name in ("a", "b")]
    column = np.zeros(2, dtype=np.float32)
    with pytest.raises(InvalidInputError) as caught:
        decode_inputs([encode_tensor("a", column), encode_tensor("a", column)], specs)
    assert caught.value.message == "input 'a' is given more than once; expected each input once"


def test_an_extra_input_is_named_in_the_refusal_over_grpc(small_model: Path) -> None:
    async def scenario() -> None:
        engine = Engine(str(small_model), estimate=estimate_once)
        async with serving(engine, ServerConfig(model_path=str(small_model))) as s:
            given = encode_tensor("input", rows(1))
            extra = encode_tensor("mask", rows(1))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(pb.InferRequest(inputs=[given, extra]))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(caught.value)[0] == "INVALID_INPUT"
            assert caught.value.details() == (
                "request has 2 inputs; 'mask' is not an input of the model; expected the "
                "model's inputs ['input'], each once"
            )

    asyncio.run(scenario())
