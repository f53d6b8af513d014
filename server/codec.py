"""Validation of requests against the model's signature, and encoding of responses.

Runs on the event loop, never on the scheduler thread: protobuf work stays off the
batching path. Every refusal names the tensor and what was expected.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import numpy as np

from laneserve.client.tensors import datatype_name, decode_tensor, encode_tensor
from laneserve.server.engine import TensorSpec
from laneserve.server.errors import InvalidInputError
from laneserve.server.items import Array, Signature, Timing
from laneserve.v1 import inference_pb2 as pb


def decode_inputs(
    tensors: Sequence[pb.Tensor], specs: Sequence[TensorSpec]
) -> tuple[dict[str, Array], int, Signature]:
    """The request's arrays by input name, its row count and its batching signature."""
    expected = {spec.name: spec for spec in specs}
    arrays: dict[str, Array] = {}
    for tensor in tensors:
        spec = expected.get(tensor.name)
        if spec is None:
            raise InvalidInputError(
                f"unknown input {tensor.name!r}; expected the model's inputs {list(expected)}"
            )
        if tensor.name in arrays:
            raise InvalidInputError(
                f"input {tensor.name!r} is given twice; expected each input once"
            )
        try:
            array = decode_tensor(tensor)
        except ValueError as error:
            raise InvalidInputError(str(error)) from error
        _check_against_spec(tensor.name, array, spec)
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
    return {spec.name: arrays[spec.name] for spec in specs}, count, signature


def check_output_names(names: Sequence[str], available: Sequence[str]) -> list[str]:
    """The outputs to return: all when `names` is empty, else `names` if they all exist."""
    if not names:
        return list(available)
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
    request_id: str, outputs: Mapping[str, Array], names: Sequence[str], timing: Timing
) -> pb.InferResponse:
    return pb.InferResponse(
        request_id=request_id,
        outputs=[encode_tensor(name, outputs[name]) for name in names],
        timing=pb.Timing(
            lane=timing.lane,
            batch_size=timing.batch_size,
            queue_us=round(timing.queue_s * 1e6),
            infer_us=round(timing.infer_s * 1e6),
        ),
    )


def _check_against_spec(name: str, array: Array, spec: TensorSpec) -> None:
    if array.dtype != spec.dtype:
        raise InvalidInputError(
            f"input {name!r} has dtype {datatype_name(array.dtype)}; expected {_describe(spec)}"
        )
    shape_ok = array.ndim == len(spec.shape) and all(
        want < 0 or got == want for got, want in zip(array.shape, spec.shape, strict=True)
    )
    if not shape_ok:
        raise InvalidInputError(
            f"input {name!r} has shape {list(array.shape)}; expected {_describe(spec)}"
        )


def _check_named_dimensions(arrays: Mapping[str, Array], specs: Sequence[TensorSpec]) -> None:
    """Dimensions the model names alike (say K in a[N, K] and b[N, K]) have one size; the
    runtime would otherwise fail the whole batch, every request in it, with INTERNAL.
    The row axis is checked above, for every input."""
    seen: dict[str, tuple[str, int, int]] = {}  # dimension name -> (input, axis, size)
    for spec in specs:
        for axis, dim_name in enumerate(spec.dim_names[1:], start=1):
            if dim_name is None:
                continue
            size = arrays[spec.name].shape[axis]
            first = seen.setdefault(dim_name, (spec.name, axis, size))
            if first[2] != size:
                raise InvalidInputError(
                    f"inputs {first[0]!r} and {spec.name!r} must agree on the model's "
                    f"dimension {dim_name!r}: axis {first[1]} of {first[0]!r} is {first[2]}, "
                    f"axis {axis} of {spec.name!r} is {size}"
                )


def _describe(spec: TensorSpec) -> str:
    return f"{datatype_name(np.dtype(spec.dtype))} with shape {list(spec.shape)}, -1 = any size"
