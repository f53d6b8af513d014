"""Validation of requests against the model's signature, and encoding of responses.

Runs on the event loop, never on the scheduler thread: protobuf work stays off the
batching path. Every refusal names the tensor and what was expected.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import numpy as np

from laneserve.client.tensors import (
    MAX_DIMS,
    STRING_LENGTH_BYTES,
    StringElementError,
    datatype_name,
    decode_tensor,
    encode_tensor,
    named_dimension_conflict,
    numpy_dtype,
)
from laneserve.server.engine import TensorSpec
from laneserve.server.errors import InvalidInputError
from laneserve.server.items import Array, Signature, Timing
from laneserve.v1 import inference_pb2 as pb

# The most bytes an InferRequest may carry besides its tensors' data, as their shapes and
# dtypes size it, and one copy of each of its fields (`extra_bytes`): fields this server
# does not know (protobuf keeps them), fields sent more than once (the last counts),
# data beyond its shape. A queued request's message stays in memory while its caller
# waits, and lanes count its rows, not its bytes: 60 one-row requests padded with 8 MiB
# each held 1 GiB at depth 60/2048. Far above what a newer client's added fields take.
MAX_EXTRA_BYTES = 64 * 1024

# The dtypes of a fixed size per element, by that size; and every dtype known (STRING's
# elements are each as long as their text).
_ITEM_BYTES: dict[int, int] = {
    datatype: numpy_dtype(datatype).itemsize
    for datatype in pb.DataType.values()
    if datatype not in (pb.DATA_TYPE_UNSPECIFIED, pb.DATA_TYPE_STRING)
}
_KNOWN_DTYPES = frozenset((*_ITEM_BYTES, pb.DATA_TYPE_STRING))


def check_counts(tensors: Sequence[pb.Tensor], specs: Sequence[TensorSpec]) -> None:
    """Refuses more inputs, or dimensions, than any request the model takes, before
    anything walks them: hashing them (a request_id) cost the event loop time in
    proportion, up to a whole message of them (`check_output_names` bounds the names)."""
    if len(tensors) > len(specs):
        raise too_many_inputs(tensors, specs)
    for tensor in tensors:
        if len(tensor.shape) > MAX_DIMS:  # decode_tensor's refusal, in its words
            raise InvalidInputError(
                f"tensor {tensor.name!r}: shape has {len(tensor.shape)} dimensions; expected "
                f"at most {MAX_DIMS}"
            )


class Named(Protocol):
    """A request's input, of either front end (laneserve's Tensor, KServe's
    InferInputTensor)."""

    @property
    def name(self) -> str: ...


def too_many_inputs(
    tensors: Sequence[Named], specs: Sequence[TensorSpec], *, count: int | None = None
) -> InvalidInputError:
    """The refusal of a request with more inputs than the model's (every front end's).
    `count`: how many it has, where `tensors` are only its first len(specs) + 1 (KServe
    HTTP's, named from its JSON before any is read)."""
    expected = [spec.name for spec in specs]
    total = len(tensors) if count is None else count
    extra = extra_inputs(tensors, expected, overridable=_overridable(specs), count=total)
    return InvalidInputError(
        f"request has {total} inputs; {extra}; expected the model's inputs {expected}, each once"
    )


def extra_inputs(
    tensors: Sequence[Named],
    expected: Sequence[str],
    *,
    overridable: Collection[str] = (),
    count: int | None = None,
) -> str:
    """Which of more inputs than `expected` made them too many ("request has 4 inputs"
    named none): the names none of the model's inputs, and those given more than once,
    among the first len(expected) + 1 only, so that the work stays bounded however many
    the request holds. Among that many, one name at least is either. Names among
    `overridable` (the model's overridable initializers) are said to be those: "not an
    input of the model" told a caller who sent the model's optional input nothing of
    why. Infer's words, and ModelInfer's (`kserve_convert._check_counts`)."""
    known = set(expected)
    read = [tensor.name for tensor in tensors[: len(expected) + 1]]
    counts = collections.Counter(read)  # in first-read order
    unknown = [name for name in counts if name not in known and name not in overridable]
    initializers = [name for name in counts if name not in known and name in overridable]
    repeated = [name for name, count in counts.items() if count > 1 and name in known]
    assert unknown or initializers or repeated, "len(expected) + 1 names hold one such"
    found = []
    if unknown:
        verb = "is not an input" if len(unknown) == 1 else "are not inputs"
        found.append(f"{', '.join(map(repr, unknown))} {verb} of the model")
    if initializers:
        found.append(_overridden_initializers(initializers))
    if repeated:
        found.append(given_more_than_once(repeated))
    total = len(tensors) if count is None else count
    return among_first(len(read), total) + " and ".join(found)


def given_more_than_once(names: Sequence[str]) -> str:
    """A refusal's words for `names`, each given more than once (inputs or outputs; every
    front end's)."""
    verb = "is" if len(names) == 1 else "are"
    return f"{', '.join(map(repr, names))} {verb} given more than once"


def among_first(read: int, total: int) -> str:
    """The words "among its first N, " where a refusal names what it found among the
    first `read` of `total` (the rest unread, to keep its work bounded); "" where it read
    them all."""
    return f"among its first {read}, " if read < total else ""


def _overridden_initializers(names: Sequence[str]) -> str:
    """What a request that sends the model's overridable initializers `names` is told."""
    if len(names) == 1:
        return (
            f"{names[0]!r} is an initializer the model lets callers override; laneserve "
            "runs it at its default and takes no input of that name"
        )
    return (
        f"{', '.join(map(repr, names))} are initializers the model lets callers override; "
        "laneserve runs them at their defaults and takes no inputs of those names"
    )


def _overridable(specs: Sequence[TensorSpec]) -> frozenset[str]:
    """The model's overridable initializers, which its input specs carry alike."""
    return frozenset(name for spec in specs for name in spec.overridable_initializers)


def leading_rows(
    tensors: Sequence[pb.Tensor], specs: Sequence[TensorSpec], *, max_message_bytes: int
) -> int | None:
    """The rows `decode_inputs` counts if it accepts `tensors` (their shape[0]), read
    without decoding them; None unless they are the model's inputs, each once, each of
    its input's dtype and shape (`_takes`), all of one shape[0], their dtypes and shapes
    sizing at most the data a request could carry (`max_message_bytes`, the server's),
    agreeing on the dimensions the model names alike (`named_dimension_conflict`):
    `decode_inputs` says what is wrong. Counted, a misspelled input of 3 000 rows was
    refused as too many rows, to be split, and so was a shape of 2**40 rows over one
    row's data, whose fault was its data's length; and so, with the bound at gRPC's
    largest message (2 GiB), was one of 100 000 rows of 512 float32 (205 MB) against a
    64 MiB limit; and so, in a lane smaller than its shape[0] (but not in one with room),
    a flattened batch, a wrong width, rank or dtype, and inputs with K = 3 and K = 4 for
    a[N, K] and b[N, K], every part split from which is refused for K.

    The data is not read, so not measured: each read is a copy (~80 ms for 64 MiB), and
    this runs for every request; a STRING tensor's alone is read, its length sizing it
    (`data_bytes`). A shape that sizes at most `max_message_bytes` over data that does
    not match it is still counted by its shape."""
    expected = {spec.name: spec for spec in specs}
    if len(tensors) != len(expected) or {tensor.name for tensor in tensors} != expected.keys():
        return None  # an unknown, missing or repeated input
    claimed_bytes = 0
    for tensor in tensors:
        tensor_bytes = data_bytes(tensor)  # None for a negative dynamic dimension
        if tensor_bytes is None or not _takes(expected[tensor.name], tensor):
            return None
        claimed_bytes += tensor_bytes
    row_counts = {tensor.shape[0] for tensor in tensors}
    if len(row_counts) != 1 or claimed_bytes > max_message_bytes:
        return None
    # Each input is here, of its rank (`_takes`), as the check needs; its cost is in
    # proportion to the inputs' dimensions, which `check_counts` bounds.
    if named_dimension_conflict({tensor.name: tensor for tensor in tensors}, specs) is not None:
        return None
    return row_counts.pop()


def _takes(spec: TensorSpec, tensor: pb.Tensor) -> bool:
    """Whether `spec`'s input takes `tensor`'s dtype and shape, its data unread."""
    return _is_dtype(spec, tensor.dtype) and _fits_shape(spec, tensor.shape)


def extra_bytes(request: pb.InferRequest, wire_bytes: int) -> int | None:
    """How many of the `wire_bytes` `request` was read from are neither its tensors' data,
    as their shapes and dtypes size it, nor one copy of each of its fields (see
    MAX_EXTRA_BYTES). None when a tensor's dtype or shape sizes no data (a request that
    validation refuses). Reads no tensor's data (each read is a copy) but a STRING
    tensor's (`data_bytes`), and its cost is in proportion to its inputs, dimensions and
    output names: `check_counts` bounds them."""
    known = text_bytes(request.request_id) + text_bytes(request.lane)
    if request.timeout_ms:
        known += 1 + varint_bytes(request.timeout_ms)
    for name in request.output_names:  # a repeated field's every element, empty ones too
        known += 1 + _length_prefixed_bytes(_utf8_bytes(name))
    for tensor in request.inputs:
        tensor_bytes = data_bytes(tensor)
        if tensor_bytes is None:
            return None
        size = text_bytes(tensor.name) + 1 + varint_bytes(tensor.dtype)
        if tensor.shape:  # packed
            size += 1 + _length_prefixed_bytes(sum(map(varint_bytes, tensor.shape)))
        if tensor_bytes:
            size += 1 + _length_prefixed_bytes(tensor_bytes)
        known += 1 + _length_prefixed_bytes(size)
    return wire_bytes - known


def text_elements(tensors: Sequence[pb.Tensor]) -> int:
    """How many STRING elements `tensors`' shapes hold (a shape `decode_tensor` refuses
    holds none), their data unread: what decoding them costs, element by element."""
    return sum(_elements(tensor) or 0 for tensor in tensors if tensor.dtype == pb.DATA_TYPE_STRING)


def number_bytes(tensors: Sequence[pb.Tensor]) -> int:
    """The bytes of data the numeric tensors of `tensors` hold, as their dtypes and shapes
    size them, their data unread (a STRING tensor's: none, see `text_elements`): what
    hashing them costs (an accepted request's data is its shape's: `read_infer_request`)."""
    return sum(data_bytes(tensor) or 0 for tensor in tensors if tensor.dtype != pb.DATA_TYPE_STRING)


def _elements(tensor: pb.Tensor) -> int | None:
    """The elements `tensor`'s shape holds; None for one `decode_tensor` refuses (more
    than MAX_DIMS dimensions, a negative one)."""
    if len(tensor.shape) > MAX_DIMS or min(tensor.shape, default=0) < 0:
        return None
    return math.prod(tensor.shape)


def data_bytes(tensor: pb.Tensor) -> int | None:
    """The bytes of data `tensor`'s dtype and shape size, its data unread; None where they
    size none (an unknown dtype, more than MAX_DIMS dimensions, a negative one), which
    `decode_tensor` refuses. A STRING tensor's data sizes itself: its length, read (a
    copy), or None where it is shorter than its shape's elements' length prefixes."""
    count = _elements(tensor)
    if tensor.dtype not in _KNOWN_DTYPES or count is None:
        return None
    if tensor.dtype == pb.DATA_TYPE_STRING:
        size = len(tensor.data)
        return size if size >= count * STRING_LENGTH_BYTES else None
    return count * _ITEM_BYTES[tensor.dtype]


def text_bytes(text: str) -> int:
    """A string field's encoded size (none when empty: proto3 leaves it out)."""
    return 1 + _length_prefixed_bytes(_utf8_bytes(text)) if text else 0


def _utf8_bytes(text: str) -> int:
    # isascii() is O(1) in CPython: most names and ids need no encoding to be measured.
    return len(text) if text.isascii() else len(text.encode())


def _length_prefixed_bytes(size: int) -> int:
    return varint_bytes(size) + size


def varint_bytes(value: int) -> int:
    """An integer's size as a protobuf varint, in bytes."""
    if value < 0:  # an int64 or enum below zero: ten bytes, as two's complement
        return 10
    return max(1, (value.bit_length() + 6) // 7)


@dataclasses.dataclass(frozen=True, slots=True)
class DecodedInputs:
    """A request's inputs read (`decode_inputs`); made on the text thread for long text
    (`text_thread`), and handed to the event loop."""

    arrays: dict[str, Array] = dataclasses.field(repr=False)  # by input name, specs' order
    rows: int  # the rows (first axis) every input has
    signature: Signature  # the inputs' shapes past the rows: who may batch together


def decode_inputs(tensors: Sequence[pb.Tensor], specs: Sequence[TensorSpec]) -> DecodedInputs:
    """The request's arrays by input name, its row count and its batching signature."""
    expected = {spec.name: spec for spec in specs}
    arrays: dict[str, Array] = {}
    for tensor in tensors:
        spec = expected.get(tensor.name)
        if spec is None:
            unknown = (
                _overridden_initializers([tensor.name])
                if tensor.name in _overridable(specs)
                else f"unknown input {tensor.name!r}"
            )
            raise InvalidInputError(f"{unknown}; expected the model's inputs {list(expected)}")
        if tensor.name in arrays:
            raise InvalidInputError(
                f"input {tensor.name!r} is given more than once; expected each input once"
            )
        _check_dtype(tensor, spec)
        # The shape is the model's before the data is read: one of another rank was
        # refused by the decoder first, in numpy's words where numpy could not hold it
        # ("numpy cannot hold shape [4294967296, 4294967296, 0]"), not the model's.
        _check_shape(tensor.name, tensor.shape, spec)
        try:
            array = decode_tensor(tensor)
        except StringElementError as error:
            raise _element_refusal(tensor, error) from error
        except ValueError as error:
            raise InvalidInputError(str(error)) from error
        # Its dtype is the model's (`_check_dtype`): the array's is the tensor's.
        assert array.dtype == spec.dtype, (tensor.name, array.dtype, spec.dtype)
        arrays[tensor.name] = array
    missing = [name for name in expected if name not in arrays]
    if missing:
        wanted = ", ".join(f"{name!r} ({_describe(expected[name])})" for name in missing)
        raise InvalidInputError(f"missing input(s) {wanted}")
    rows = {name: array.shape[0] for name, array in arrays.items()}
    if len(set(rows.values())) != 1:
        raise InvalidInputError(
            f"inputs must have the same number of rows (first axis), got {rows}"
        )
    count = next(iter(rows.values()))
    if count == 0:
        raise InvalidInputError("request has 0 rows; expected at least 1 row along the first axis")
    _check_named_dimensions(arrays, specs)
    signature = tuple(tuple(arrays[spec.name].shape[1:]) for spec in specs)
    return DecodedInputs({spec.name: arrays[spec.name] for spec in specs}, count, signature)


def _element_refusal(tensor: pb.Tensor, error: StringElementError) -> InvalidInputError:
    """The refusal of a request whose `tensor` has an element that cannot be read, naming
    the row it is in (ErrorInfo metadata "row" too): a bulk job's failed rows named no
    input row for it, though the element's index says which (a user's evaluation)."""
    refusal = InvalidInputError(error.in_row(tensor.shape))
    refusal.metadata.update(error.row_metadata(tensor.shape))
    return refusal


def check_output_names(names: Sequence[str], available: Sequence[str]) -> list[str]:
    """The outputs to return: all when `names` is empty, else `names` if they all exist."""
    if not names:
        return list(available)
    if len(names) > len(available):  # before they are walked: up to a message of them
        raise InvalidInputError(
            f"output_names has {len(names)} names; expected at most {len(available)}, each "
            f"of the model's outputs {list(available)} at most once"
        )
    unknown = [name for name in names if name not in available]
    if unknown:
        raise InvalidInputError(
            f"unknown output(s) {unknown}; expected some of the model's outputs {list(available)}"
        )
    if len(set(names)) != len(names):
        repeated = sorted(name for name, count in collections.Counter(names).items() if count > 1)
        raise InvalidInputError(
            f"output_names repeats {repeated}; expected each output at most once"
        )
    return list(names)


def encode_response(
    request_id: str,
    outputs: Mapping[str, Array],
    names: Sequence[str],
    timing: Timing,
    text_data: Mapping[str, bytes] | None = None,
) -> pb.InferResponse:
    """`text_data`: text outputs' data by name, encoded already (`Outcome.text_data`)."""
    return pb.InferResponse(
        request_id=request_id,
        outputs=[_output_tensor(name, outputs[name], text_data) for name in names],
        timing=pb.Timing(
            lane=timing.lane,
            batch_size=timing.batch_size,
            queue_us=round(timing.queue_s * 1e6),
            infer_us=round(timing.infer_s * 1e6),
        ),
    )


def _output_tensor(name: str, array: Array, text_data: Mapping[str, bytes] | None) -> pb.Tensor:
    data = None if text_data is None else text_data.get(name)
    if data is None:
        return encode_tensor(name, array)
    return pb.Tensor(name=name, dtype=pb.DATA_TYPE_STRING, shape=array.shape, data=data)


def dtype_refusal(tensors: Sequence[pb.Tensor], specs: Sequence[TensorSpec]) -> str | None:
    """The refusal `_check_dtype` gives the first of `tensors` with a known dtype other
    than its model input's, or None; reads no data. None as well where an input before
    it is unknown or repeated: `decode_inputs` refuses that first, for a fault this
    request's own refusal covers (the unknown name is not quoted), not for a dtype
    ([a float32, a float16] was told a's dtype, not "'a' is given more than once"). For
    a request refused unread (`grpc_methods.read_infer_request`), whose dtype is the fault to
    name before its data's length: float32 data labelled float16."""
    expected = {spec.name: spec for spec in specs}
    seen: set[str] = set()
    for tensor in tensors:
        spec = expected.get(tensor.name)
        if spec is None or tensor.name in seen:
            return None
        if _is_other_dtype(spec, tensor.dtype):
            return _wrong_dtype(tensor, spec)
        seen.add(tensor.name)
    return None


def _check_dtype(tensor: pb.Tensor, spec: TensorSpec) -> None:
    """Refuses a known dtype other than the model's input's before `decode_tensor` sizes
    the data by it: float32 data labelled DATA_TYPE_FLOAT64 was told "data is 2048 bytes;
    expected 4096 (512 float64 ...)", which steered its client to send twice the data.
    This server converts no dtype. An unspecified or unknown one is `decode_tensor`'s to
    refuse: its words list the dtypes there are."""
    if _is_other_dtype(spec, tensor.dtype):
        raise InvalidInputError(_wrong_dtype(tensor, spec))


def _wrong_dtype(tensor: pb.Tensor, spec: TensorSpec) -> str:
    return (
        f"input {tensor.name!r} has dtype {datatype_name(tensor.dtype)}; expected {_describe(spec)}"
    )


def _is_dtype(spec: TensorSpec, datatype: pb.DataType.ValueType) -> bool:
    """Whether `datatype` is a known dtype, `spec`'s input's."""
    return datatype in _KNOWN_DTYPES and numpy_dtype(datatype) == spec.dtype


def _is_other_dtype(spec: TensorSpec, datatype: pb.DataType.ValueType) -> bool:
    """Whether `datatype` is a known dtype other than `spec`'s input's."""
    return datatype in _KNOWN_DTYPES and numpy_dtype(datatype) != spec.dtype


def _check_shape(name: str, shape: Sequence[int], spec: TensorSpec) -> None:
    if not _fits_shape(spec, shape):
        raise InvalidInputError(
            f"input {name!r} has shape {list(shape)}; expected {_describe(spec)}"
        )


def _fits_shape(spec: TensorSpec, shape: Sequence[int]) -> bool:
    """Whether `shape` is of `spec`'s rank, each fixed dimension of its size."""
    return len(shape) == len(spec.shape) and all(
        want < 0 or got == want for got, want in zip(shape, spec.shape, strict=True)
    )


def _check_named_dimensions(arrays: Mapping[str, Array], specs: Sequence[TensorSpec]) -> None:
    """Dimensions the model names alike (say K in a[N, K] and b[N, K]) have one size; the
    runtime would otherwise fail the whole batch, every request in it, with INTERNAL.
    The row axis is checked above, for every input."""
    conflict = named_dimension_conflict(arrays, specs)
    if conflict is not None:
        first, other, how = conflict
        raise InvalidInputError(f"inputs {first!r} and {other!r} {how}")


def _describe(spec: TensorSpec) -> str:
    return f"{datatype_name(np.dtype(spec.dtype))} with shape {list(spec.shape)}, -1 = any size"
