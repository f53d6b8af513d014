"""Building requests: arrays in, wire tensors out, with the client's errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from laneserve.client._errors import InvalidInputError
from laneserve.client.tensors import encode_tensor
from laneserve.v1 import inference_pb2 as pb

# The server's bound on a request_id, in bytes of UTF-8 (MAX_REQUEST_ID_BYTES in
# laneserve.server.service; documented in inference.proto).
MAX_REQUEST_ID_BYTES = 256


def encode_inputs(inputs: Mapping[str, npt.NDArray[Any]], request_id: str) -> list[pb.Tensor]:
    """The request's tensors.

    Raises:
        TypeError: `inputs` is not a mapping of names to numpy arrays (a caller's bug).
        InvalidInputError: an array's dtype has no wire type (names the input).
    """
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"inputs: expected a mapping of input name to numpy array, got {type(inputs).__name__}"
        )
    for name, array in inputs.items():
        if not isinstance(array, np.ndarray):
            raise TypeError(f"input {name!r}: expected a numpy array, got {type(array).__name__}")
    try:
        return [encode_tensor(name, array) for name, array in inputs.items()]
    except ValueError as error:
        raise InvalidInputError(
            str(error), code=grpc.StatusCode.INVALID_ARGUMENT, request_id=request_id
        ) from error


def infer_request(
    request_id: str,
    tensors: Sequence[pb.Tensor],
    *,
    lane: str | None,
    timeout_ms: int = 0,
    outputs: Sequence[str] = (),
) -> pb.InferRequest:
    """The InferRequest the client sends: built in one place, so that what it checks
    before sending (its size: laneserve-client's limits) is what it sends."""
    return pb.InferRequest(
        request_id=request_id,
        lane=lane or "",
        timeout_ms=timeout_ms,
        inputs=tensors,
        output_names=outputs,
    )
