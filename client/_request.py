"""Building requests: arrays in, wire tensors out, with the client's errors."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from laneserve.client._errors import InvalidInputError, ResourceExhaustedError
from laneserve.client.tensors import StringElementError, encode_tensor
from laneserve.v1 import inference_pb2 as pb

# The server's bound on a request_id, in bytes of UTF-8 (MAX_REQUEST_ID_BYTES in
# laneserve.server.grpc_methods; documented in inference.proto).
MAX_REQUEST_ID_BYTES = 256
# The server's ErrorInfo reason for a request it refuses as wrong for its model or lanes.
INVALID_INPUT = "INVALID_INPUT"


def refused(message: str, request_id: str = "") -> InvalidInputError:
    """An InvalidInputError for a request this client refused to send: its attempts 0
    (a LaneserveError counts 1, the one attempt a server answered), so that a caller
    reading `attempts` tells a request never sent from one the server refused. Its
    reason is the server's for a refused input, INVALID_INPUT: code that sorts errors
    by reason (laneserve-client's bulk summary) counts both alike."""
    error = InvalidInputError(
        message,
        code=grpc.StatusCode.INVALID_ARGUMENT,
        reason=INVALID_INPUT,
        request_id=request_id,
    )
    error.attempts = 0
    return error


def checked_inputs(inputs: object) -> dict[str, npt.NDArray[Any]]:
    """`inputs` as a dict, read once: a mapping may compute its values on each read (numpy's
    NpzFile, from ``np.load("x.npz")``, decompresses every array again).

    Raises:
        TypeError: `inputs` is not a mapping of str names to numpy arrays (a caller's bug),
            or one is a masked array.
    """
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"inputs: expected a mapping of input name to numpy array, got {type(inputs).__name__}"
        )
    arrays = dict(inputs.items())
    for name, array in arrays.items():
        checked_str("input name", name)
        if not isinstance(array, np.ndarray):
            raise TypeError(f"input {name!r}: expected a numpy array, got {type(array).__name__}")
        if isinstance(array, np.ma.MaskedArray):
            # An ndarray whose buffer holds the masked values too: the model would read
            # them, the mask dropped without a word.
            raise TypeError(
                f"input {name!r}: expected a plain numpy array, got a masked array (the model "
                "would read the values under its mask); fill them first: array.filled(value)"
            )
    return arrays


def encode_inputs(inputs: Mapping[str, npt.NDArray[Any]], request_id: str) -> list[pb.Tensor]:
    """The request's tensors.

    Raises:
        TypeError: `inputs` is not a mapping of str names to numpy arrays (a caller's bug).
        InvalidInputError: an array's dtype has no wire type, or a name is not UTF-8 text
            (names the input).
    """
    arrays = checked_inputs(inputs)
    tensors = []
    for name, array in arrays.items():
        try:
            tensors.append(encode_tensor(name, array))
        except UnicodeEncodeError:  # before ValueError, which it is
            # Which one, and what is wrong with its text, worked out only when protobuf
            # refused (the types are checked on every request, above).
            utf8_bytes("input name", name, request_id=request_id)
            raise
        except StringElementError as error:
            raise _element_refused(array, error, request_id) from error
        except ValueError as error:
            raise refused(str(error), request_id) from error
    return tensors


def _element_refused(
    array: npt.NDArray[Any], error: StringElementError, request_id: str
) -> InvalidInputError:
    """`refused` for a text element of `array` this client cannot send, naming its row
    (ErrorInfo's "row" as the server's refusal of a row gives it: a bulk job's failed
    rows name the input row, where "element 36" of an item named none)."""
    refusal = refused(error.in_row(array.shape), request_id)
    refusal.metadata.update(error.row_metadata(array.shape))
    return refusal


def output_names(outputs: Sequence[str] | None) -> tuple[str, ...]:
    """The names of the outputs asked for; () for all of them.

    Raises:
        TypeError: `outputs` is one str (its characters would be taken for the names) or
            bytes (its byte values: "output name 121").
    """
    if isinstance(outputs, (str, bytes)):
        raise TypeError(
            f"outputs: expected a sequence of output names, got {type(outputs).__name__} "
            f"({outputs!r}); [{outputs!r}] for that one output"
        )
    return tuple(outputs or ())


def checked_str(field: str, value: object) -> str:
    """`value`, a str, for a string field of a message.

    Raises:
        TypeError: `value` is not a str, naming `field` (protobuf's own TypeError says only
            "bad argument type for built-in operation").
    """
    if not isinstance(value, str):
        # reprlib: the value is the caller's, of any type and size.
        raise TypeError(f"{field} {reprlib.repr(value)}: expected str, got {type(value).__name__}")
    return value


def utf8_bytes(field: str, text: object, *, request_id: str = "") -> int:
    """The length of `text` in bytes of UTF-8, which protobuf sends it as.

    Raises:
        TypeError: `text` is not a str, naming `field`.
        InvalidInputError: `text` has a character with no UTF-8 encoding (a lone
            surrogate, as ``os.fsdecode`` makes of bytes that are not UTF-8), naming `field`.
    """
    text = checked_str(field, text)
    try:
        return len(text.encode())
    except UnicodeEncodeError as error:
        raise refused(
            f"{field} {text!r}: expected UTF-8 text; the character at position "
            f"{error.start} has no UTF-8 encoding (a lone surrogate)",
            request_id,
        ) from None


def check_request_id(
    request_id: str, *, field: str = "request_id", expected: str = "a shorter id"
) -> None:
    """Refuses, before sending, a request_id the server would refuse or protobuf could not
    send. The server's refusal of one over MAX_REQUEST_ID_BYTES carries no id (the id is
    what would not fit): a bulk job could not match it to its item. `field` names the id
    in the refusal (a bulk job's item: with its index); `expected` is what the refusal
    asks for instead (a bulk job's: "or job_id" too, which its ids are made of).

    Raises:
        TypeError: `request_id` is not a str, naming `field`.
        InvalidInputError: not UTF-8 text, or longer than the server takes, naming `field`.
    """
    id_bytes = utf8_bytes(field, request_id, request_id=request_id)
    if id_bytes > MAX_REQUEST_ID_BYTES:
        raise refused(
            f"{field} is {id_bytes} bytes, over the server's limit of "
            f"{MAX_REQUEST_ID_BYTES} bytes (UTF-8); expected {expected}",
            request_id,
        )


def infer_request(
    request_id: str,
    tensors: Sequence[pb.Tensor],
    *,
    lane: str | None,
    timeout_ms: int = 0,
    outputs: Sequence[str] = (),
) -> pb.InferRequest:
    """The InferRequest the client sends: built in one place, so that what it checks
    before sending (its size: laneserve-client's limits) is what it sends. `request_id`
    is not checked here: every caller checks it first (`check_request_id`), before its
    inputs are encoded, or makes it of ASCII (a uuid's hex; the CLI's zeros for a size).

    Raises:
        TypeError: a lane or output name is not a str, naming the field.
        InvalidInputError: a lane or output name is not UTF-8 text (protobuf raised a
            bare UnicodeEncodeError), naming the field.
    """
    # protobuf takes UTF-8 bytes for a string field: a bytes lane or output name was sent
    # (b"nosuch" came back the server's INVALID_INPUT, counted there). A type check each.
    # Not `lane or ""`: a falsy lane of another type is refused, not taken for none.
    lane_name = "" if lane is None else checked_str("lane", lane)
    for name in outputs:
        checked_str("output name", name)
    try:
        return pb.InferRequest(
            request_id=request_id,
            lane=lane_name,
            timeout_ms=timeout_ms,
            inputs=tensors,
            output_names=outputs,
        )
    except UnicodeEncodeError:
        # Which one, worked out only when protobuf refused: not on every request.
        utf8_bytes("lane", lane_name, request_id=request_id)
        for name in outputs:
            utf8_bytes("output name", name, request_id=request_id)
        raise


def check_request_bytes(
    request: pb.InferRequest, limit: tuple[int, str] | None, *, request_id: str
) -> None:
    """Refuses, before sending, a request larger than the client sends (`limit`: its
    bytes and the setting that set it; None for no limit). gRPC failed it itself
    with RESOURCE_EXHAUSTED ("CLIENT: Sent message larger than max"), `attempts` 1 as if
    a server had refused it, and no word of what to do. Its encoded size is what gRPC
    compares with the limit.

    Raises:
        ResourceExhaustedError: over the limit (the class `stream()` answers an item over
            it with), `attempts` 0, naming the size, the limit and what to do.
    """
    if limit is None:
        return
    limit_bytes, limit_name = limit
    size = request.ByteSize()
    if size <= limit_bytes:
        return
    error = ResourceExhaustedError(
        f"the request is {size} bytes encoded, over the largest message this client sends "
        f"({limit_bytes} bytes, {limit_name}); expected fewer rows per call, or a larger "
        f"limit ({limit_name}, and the server's max_message_bytes: it reads no larger "
        "message)",
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        request_id=request_id,
    )
    error.attempts = 0
    raise error
