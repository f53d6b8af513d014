"""The conversion between KServe v2's messages (grpc_predict_v2.proto) and laneserve.v1's,
for the KServe front end (`kserve`): each ModelInferRequest read from its bytes within
bounds (`read_model_infer`) and converted to an InferRequest (`to_infer_request`), each
InferResponse converted back to a ModelInferResponse (`to_model_infer_response`),
ModelStreamInfer's items and answers (`ModelStreamWire`), and the protocol's datatypes
and the parameters read and written on the way.

Kept apart from the servicer (`kserve.KServeServicer`, `kserve.add_kserve_to_server`),
which checks the model named, runs the converted request through Infer's path and aborts
the call with the refusals raised here: nothing here holds a gRPC call or the servicer's
state (the shared memory regions read and written are passed in), so the conversion is
read and tested alone, and the HTTP/REST front end (`kserve_json`) reads its requests
into these types without importing the servicer and, through it, the service. Nothing
here imports `kserve`: the servicer imports this module.

The mapping (README.md, "KServe v2 / Triton clients"):

    ModelInferRequest                InferRequest
    model_name, model_version        the served model (server.model_name), "" or "1";
                                     another: NOT_FOUND (ModelNotFoundError)
    id                               request_id, echoed in the answer's id: it names the
                                     request (errors, traces, logs) and keys nothing,
                                     unless parameters["laneserve_idempotent"] (bool) is
                                     true: then a retry joins or replays it, as Infer's
    parameters["lane"] string        lane
    parameters["timeout"] int64 us   timeout_ms, rounded up (Triton's clients send us;
                                     uint64 too)
    parameters["priority"] uint64    0: none; k >= 1: the k-th lane, highest first
                                     (Triton's 1 is its highest priority)
    inputs + raw_input_contents      inputs, each Tensor's data the raw bytes (one
                                     entry per input not in shared memory); BYTES is
                                     STRING, its raw encoding (each element a 4-byte
                                     length and its UTF-8) a STRING tensor's data
    inputs[].contents (typed lists)  inputs, the list converted to little-endian bytes
                                     (bytes_contents: one element per value, each
                                     given its length)
    inputs[].parameters shared_memory_region, _byte_size, _offset
                                     inputs, the bytes copied out of the region
                                     (server/shared_memory.py)
    outputs[].name                   output_names
    outputs[].parameters shared_memory_*
                                     the output written into the region with the answer

    InferResponse                    ModelInferResponse
    outputs                          outputs (name, datatype, shape) and, in their
                                     order, raw_output_contents
    timing                           parameters laneserve_lane, laneserve_batch_size,
                                     laneserve_queue_us, laneserve_infer_us
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np
from google.protobuf.message import DecodeError, Message

from laneserve.client.tensors import (
    MAX_DIMS,
    STRING_LENGTH_BYTES,
    datatype_of,
    length_prefixed,
    numpy_dtype,
)
from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.server.codec import MAX_EXTRA_BYTES, text_bytes, too_many_inputs, varint_bytes
from laneserve.server.config import UINT32_MAX
from laneserve.server.engine import TensorSpec
from laneserve.server.errors import (
    InvalidInputError,
    LaneserveError,
    bounded_message,
    pushback_ms,
)
from laneserve.server.grpc_methods import (
    MAX_OPERATOR_REQUEST_BYTES,
    OversizedOperatorRequest,
    answer_id,
    read_operator_request,
)
from laneserve.server.shared_memory import (
    BYTE_SIZE_PARAMETER,
    CallerRegions,
    InputBudget,
    Placement,
    Region,
    SharedMemoryRegions,
    output_too_large,
    placement_of,
)
from laneserve.server.streams import ItemTag
from laneserve.v1 import inference_pb2 as pb

# A server of one model has one version; "" asks for the server's choice, this one.
MODEL_VERSION: Final = "1"
# A ModelStreamInfer error's parameters, in its infer_response: what an InferStream
# item's error (a google.rpc.Status) carries, typed, for callers that read the message
# (tritonclient passes on error_message alone): gRPC's code as its number
# (int64_param), laneserve's reason (string_param) and, where a retry is advised, the
# wait in whole ms, rounded up, as grpc-retry-pushback-ms (int64_param).
ERROR_CODE_PARAMETER: Final = "laneserve_error_code"
ERROR_REASON_PARAMETER: Final = "laneserve_error_reason"
RETRY_AFTER_PARAMETER: Final = "laneserve_retry_after_ms"
# Triton's parameter for decoupled models, which perf_analyzer sends on every request,
# ModelInfer's and ModelStreamInfer's: a bool_param asking that a stream mark each item's
# last answer, by the answer's bool_param FINAL_RESPONSE_PARAMETER (a client reading the
# answers of a decoupled model waits for it). Every answer here is its request's one and
# last: a ModelInfer answer needs no mark, and on a stream the answer of each item that
# asked (an error's too) is marked true, as Triton marks per request; no other is.
FINAL_RESPONSE_FLAG: Final = "triton_enable_empty_final_response"
FINAL_RESPONSE_PARAMETER: Final = "triton_final_response"
# laneserve's parameter (a bool_param, default false) making a request's `id` its
# request_id in the ledger's sense: a retry with it joins the request in flight or has
# its stored answer replayed, other inputs with it are refused REQUEST_ID_REUSED, in one
# id space with Infer and InferStream. Without it the id is a correlation tag, as Triton's
# clients send it (perf_analyzer restarts its ids each run, with the same data; scripts
# send "1" for any inputs): echoed and quoted, keying nothing.
IDEMPOTENT_PARAMETER: Final = "laneserve_idempotent"
# Response parameters that carry laneserve's Timing (pb.Timing's fields, prefixed): its
# lane a string_param, the others int64_params.
TIMING_PREFIX: Final = "laneserve_"
_TIMING_LANE: Final = "lane"
_TIMING_INTEGERS: Final = ("batch_size", "queue_us", "infer_us")
# The request parameters understood, and the kinds of InferParameter each takes.
LANE_PARAMETER: Final = "lane"
TIMEOUT_PARAMETER: Final = "timeout"
PRIORITY_PARAMETER: Final = "priority"
_INTEGER_KINDS: Final = ("int64_param", "uint64_param")
_PARAMETER_KINDS: Final[dict[str, tuple[str, ...]]] = {
    LANE_PARAMETER: ("string_param",),
    TIMEOUT_PARAMETER: _INTEGER_KINDS,
    PRIORITY_PARAMETER: _INTEGER_KINDS,
    FINAL_RESPONSE_FLAG: ("bool_param",),
    IDEMPOTENT_PARAMETER: ("bool_param",),
}
# The most unknown parameter or tensor parameter names a refusal quotes.
_MAX_NAMED: Final = 8
_UNDERSTOOD: Final = (
    f"{LANE_PARAMETER!r} (string_param, a lane's name), {TIMEOUT_PARAMETER!r} (int64_param or "
    f"uint64_param, microseconds), {PRIORITY_PARAMETER!r} (uint64_param or int64_param), "
    f"{FINAL_RESPONSE_FLAG!r} (bool_param) and {IDEMPOTENT_PARAMETER!r} (bool_param)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class KServeType:
    """One protocol datatype laneserve serves: its wire DataType, and the typed contents
    list that carries its values (None: raw contents only, as FP16 has)."""

    name: str  # "FP32"
    datatype: pb.DataType.ValueType
    contents_field: str | None
    # The dtype the typed list holds, converted from before the range check (int_contents
    # is int32 for INT8 too); None where the list's values are the datatype's own.
    wide_dtype: str | None = None


# Text: each element a 4-byte little-endian length and its bytes (UTF-8), in
# raw_input_contents, raw_output_contents, binary data and shared memory alike; in
# bytes_contents one element per value. The one datatype of no fixed size per element:
# its numpy dtype (object) has an itemsize that sizes nothing, and its data is a
# laneserve STRING tensor's as it is.
BYTES: Final = "BYTES"


KSERVE_TYPES: Final[tuple[KServeType, ...]] = (
    KServeType("BOOL", pb.DATA_TYPE_BOOL, "bool_contents"),
    KServeType("UINT8", pb.DATA_TYPE_UINT8, "uint_contents", "<u4"),
    KServeType("UINT16", pb.DATA_TYPE_UINT16, "uint_contents", "<u4"),
    KServeType("UINT32", pb.DATA_TYPE_UINT32, "uint_contents"),
    KServeType("UINT64", pb.DATA_TYPE_UINT64, "uint64_contents"),
    KServeType("INT8", pb.DATA_TYPE_INT8, "int_contents", "<i4"),
    KServeType("INT16", pb.DATA_TYPE_INT16, "int_contents", "<i4"),
    KServeType("INT32", pb.DATA_TYPE_INT32, "int_contents"),
    KServeType("INT64", pb.DATA_TYPE_INT64, "int64_contents"),
    KServeType("FP16", pb.DATA_TYPE_FLOAT16, None),
    KServeType("FP32", pb.DATA_TYPE_FLOAT32, "fp32_contents"),
    KServeType("FP64", pb.DATA_TYPE_FLOAT64, "fp64_contents"),
    KServeType(BYTES, pb.DATA_TYPE_STRING, "bytes_contents"),
)
_BY_NAME: Final = {kind.name: kind for kind in KSERVE_TYPES}
# Each datatype's numpy dtype, little-endian as the wire's (a ModelInferResponse's
# outputs are read by their datatype's name); BYTES's object, of no size per element.
KSERVE_DTYPES: Final = {kind.name: numpy_dtype(kind.datatype) for kind in KSERVE_TYPES}
_BY_DATATYPE: Final = {kind.datatype: kind for kind in KSERVE_TYPES}
_NAMES: Final = ", ".join(kind.name for kind in KSERVE_TYPES)
# The protocol's datatypes laneserve does not serve, refused in words that say so.
_NOT_SERVED: Final = frozenset({"BF16"})


def kserve_datatype(dtype: np.dtype[Any]) -> str:
    """The protocol's name of a numpy dtype the engine serves ("FP32")."""
    return _BY_DATATYPE[datatype_of(dtype)].name


# ---- reading requests ---------------------------------------------------------------------

# What ModelInfer receives for bytes that do not parse as a ModelInferRequest (another
# schema, invalid UTF-8 in a string field): refused INVALID_ARGUMENT, not gRPC's UNKNOWN
# with a traceback. Compared by identity; never changed.
UNDECODABLE_MODEL_INFER: Final = kpb.ModelInferRequest()
# What a ModelInferCall holds once converted (`ModelInferCall.release`). Compared by
# identity; never changed.
RELEASED_MODEL_INFER: Final = kpb.ModelInferRequest()


@dataclasses.dataclass(frozen=True, slots=True)
class OversizedModelInfer:
    """What ModelInfer receives for a request carrying more than MAX_EXTRA_BYTES besides
    its tensors' data (raw_input_contents and the inputs' typed contents): refused
    INVALID_ARGUMENT, as Infer refuses its own (a queued request's message stays in
    memory, and lanes count its rows, not its bytes). Its size, its id and whether it
    asked for Triton's final mark are kept: a ModelStreamInfer answers the refusal tagged
    with the id, and marked where asked, as it does any item (InferStream its own:
    `grpc_methods.OversizedRequest`)."""

    extra_bytes: int
    # "" where over MAX_REQUEST_ID_BYTES bytes: more than the id an answer echoes.
    request_id: str
    final_response: bool  # FINAL_RESPONSE_FLAG


@dataclasses.dataclass(slots=True)
class ModelInferCall:
    """A ModelInferRequest as read (`read_model_infer`), with its raw_input_contents read
    out once: each read of a bytes element is a copy (~35 ms for 64 MiB), and measuring
    the request reads them already. `raw_contents` is empty, unread, where the request
    has more inputs, raw contents or outputs than the model has (the conversion refuses it
    on those counts) or does not parse.

    gRPC holds what its deserializer returned until the call ends: `release` lets go of
    the message and the copies once converted, so that a queued call holds its
    InferRequest alone. Kept, the message held the tensors' data a second time (a queued
    62 MiB ModelInfer held 124 MiB)."""

    message: kpb.ModelInferRequest
    raw_contents: tuple[bytes, ...]
    # The message's bytes as received: what its inputs may read from shared memory is
    # max_message_bytes less these (`shared_memory.InputBudget`).
    wire_bytes: int

    def release(self) -> None:
        self.message = RELEASED_MODEL_INFER
        self.raw_contents = ()


@dataclasses.dataclass(frozen=True, slots=True)
class UndecodableKServeRequest:
    """What a metadata or liveness call receives for bytes that do not parse."""

    method: str  # "ModelMetadata"


def read_model_infer(
    data: bytes, *, max_inputs: int, max_outputs: int
) -> ModelInferCall | OversizedModelInfer:
    """`data` read as a ModelInferCall (its message UNDECODABLE_MODEL_INFER where it does
    not parse), or an OversizedModelInfer. A request with more inputs, raw contents or
    outputs than the model has is passed on unmeasured and unread: the conversion refuses
    it on those counts before walking them.

    Its id is not counted as extra, as Infer counts one copy of each of its fields: an id
    over MAX_REQUEST_ID_BYTES is Infer's to refuse, in its words ("request_id is N
    bytes"), not this bound's."""
    try:
        request = kpb.ModelInferRequest.FromString(data)
    except DecodeError:
        return ModelInferCall(UNDECODABLE_MODEL_INFER, (), len(data))
    if (
        len(request.inputs) > max_inputs
        or len(request.raw_input_contents) > max_inputs
        or len(request.outputs) > max_outputs
    ):
        return ModelInferCall(request, (), len(data))
    raw = tuple(request.raw_input_contents)
    if len(data) <= MAX_EXTRA_BYTES:  # its extra bytes are some of its bytes
        return ModelInferCall(request, raw, len(data))
    known = sum(map(len, raw)) + sum(_contents_bytes(tensor.contents) for tensor in request.inputs)
    extra = len(data) - known - text_bytes(request.id)
    if extra > MAX_EXTRA_BYTES:
        # The id a copy, bounded: nothing of the message, or of its bytes, stays reachable.
        return OversizedModelInfer(
            extra, answer_id(request.id), _flag(request.parameters, FINAL_RESPONSE_FLAG)
        )
    return ModelInferCall(request, raw, len(data))


def _contents_bytes(contents: kpb.InferTensorContents) -> int:
    """The most bytes `contents` (data) takes on the wire. ByteSize() sizes its lists
    packed, as this client's encoder writes them; a valid encoder may write them
    unpacked, each value with its own tag: one byte more per value (field numbers under
    16), less the list's one tag and length. Sizing is an encoding: ~1 ms per MiB of
    fp32 or fp64 values, 2-4 ms of varint ones (int, uint, bool)."""
    values = sum(len(field_values) for _, field_values in contents.ListFields())
    return contents.ByteSize() + values


def read_operator_call(
    request_type: type[Message], method: str, data: bytes
) -> Message | OversizedOperatorRequest | UndecodableKServeRequest:
    """A metadata or liveness request: refused unparsed over MAX_OPERATOR_REQUEST_BYTES
    (`read_operator_request`), as GetModel's is; its stand-in where it does not parse."""
    try:
        return read_operator_request(request_type.FromString, method, data)
    except DecodeError:
        return UndecodableKServeRequest(method)


def unreadable(request: object, method: str) -> LaneserveError | None:
    """The refusal of a request's stand-in (`read_model_infer`, `read_operator_call`);
    None for a request read."""
    expected = f"expected an inference.{method}Request message encoded from grpc_predict_v2.proto"
    if isinstance(request, ModelInferCall) and request.message is UNDECODABLE_MODEL_INFER:
        request = UndecodableKServeRequest(method)
    if isinstance(request, UndecodableKServeRequest):
        return InvalidInputError(
            f"the {method} request does not parse as an inference.{method}Request message "
            f"(strings in UTF-8); {expected}"
        )
    if isinstance(request, OversizedModelInfer):
        return InvalidInputError(
            f"the {method} request carries {request.extra_bytes} bytes besides its tensors' "
            f"data (raw_input_contents and the inputs' contents), over the limit of "
            f"{MAX_EXTRA_BYTES}; {expected}, with no fields this server does not know"
        )
    if isinstance(request, OversizedOperatorRequest):
        return InvalidInputError(
            f"the {method} request is {request.size_bytes} bytes, over the limit of "
            f"{MAX_OPERATOR_REQUEST_BYTES} bytes for KServe's requests other than "
            f"ModelInfer's; {expected} (names, keys and sizes: tens of bytes)"
        )
    return None


# ---- ModelInfer: the request ---------------------------------------------------------------


def to_infer_request(
    call: ModelInferCall,
    lanes: Sequence[str],
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    shared: CallerRegions,
) -> pb.InferRequest:
    """`call`'s request as laneserve's InferRequest (the model's name and version checked
    by the caller), its inputs placed in shared memory read out of `shared`'s regions,
    its outputs placed there checked to have a region that holds them (written with the
    answer: `to_model_infer_response`). Its counts are checked before anything walks
    them: a message holds up to millions of empty inputs. Raises InvalidInputError
    naming the fault, SharedMemoryRefusedError where the caller may not use shared
    memory."""
    request = call.message
    assert request is not RELEASED_MODEL_INFER, "converted once"
    _check_counts(request, inputs, outputs)
    placements = [
        placement_of(f"input {tensor.name!r}", tensor.parameters) for tensor in request.inputs
    ]
    _check_raw_count(request, sum(placement is not None for placement in placements))
    # Read out unless over the counts just checked (`read_model_infer`).
    assert len(call.raw_contents) == len(request.raw_input_contents)
    lane, timeout_ms = request_parameters(request.parameters, lanes)
    if not request.id and asks_idempotency(request):
        raise InvalidInputError(
            f"request parameter {IDEMPOTENT_PARAMETER!r} is true and the request has no id; "
            "expected an id with it (laneserve's request_id, the same on each retry), or no "
            f"{IDEMPOTENT_PARAMETER}"
        )
    for output in request.outputs:
        what = f"output {output.name!r}"
        placement = placement_of(what, output.parameters)
        if placement is not None:  # written with the answer, into the region checked here
            shared.usable().checked_region(placement, what)
            spec = next((spec for spec in outputs if spec.name == output.name), None)
            _check_output_room(what, placement, spec, request)
    converted = pb.InferRequest(
        request_id=request.id,
        lane=lane,
        timeout_ms=timeout_ms,
        output_names=[output.name for output in request.outputs],
    )
    specs = {spec.name: spec for spec in inputs}
    raw = iter(call.raw_contents)  # one per input not in shared memory, in order
    budget = InputBudget(shared.max_message_bytes, call.wire_bytes)
    for tensor, placement in zip(request.inputs, placements, strict=True):
        kind = _input_type(tensor, specs.get(tensor.name))
        if placement is not None:
            data = _shared_input(tensor, kind, placement, shared, budget)
        else:
            data = _input_data(request, tensor, kind, next(raw, None))
        # Built in place: a Tensor made apart and then put in its request is copied again
        # (100 ms more of the event loop for 62 MiB).
        converted.inputs.add(name=tensor.name, dtype=kind.datatype, shape=tensor.shape, data=data)
    return converted


def _check_counts(
    request: kpb.ModelInferRequest, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> None:
    if len(request.inputs) > len(inputs):  # named as Infer names them
        raise too_many_inputs(request.inputs, inputs)
    if len(request.outputs) > len(outputs):
        names = [spec.name for spec in outputs]
        raise InvalidInputError(
            f"request asks for {len(request.outputs)} outputs; expected at most "
            f"{len(names)}, each of the model's outputs {names} at most once"
        )


def _check_output_room(
    what: str, placement: Placement, spec: TensorSpec | None, request: kpb.ModelInferRequest
) -> None:
    """Refuses a placement too small for its output where the output's size is known
    before the request runs: the model's output has a row axis and fixed dimensions
    after it, and the request's first input says its rows (a request whose inputs
    disagree is the normal path's to refuse). Refused now, not once written: an answer
    refused after its run is counted answered OK, and ran for nothing. Other outputs are
    held to their placement as they are written (`SharedMemoryRegions.write`). A BYTES
    output's size is its text's, known once it has run: only the least it takes, a
    4-byte length per element, is checked here."""
    if spec is None or not request.inputs or not request.inputs[0].shape:
        return
    rows = request.inputs[0].shape[0]
    row = spec.shape[1:]
    if rows < 0 or spec.shape[0] >= 0 or min(row, default=0) < 0:
        return
    text = kserve_datatype(spec.dtype) == BYTES
    needed = rows * math.prod(row) * (STRING_LENGTH_BYTES if text else spec.dtype.itemsize)
    if needed > placement.byte_size:
        size = (
            f"at least {needed} bytes for the request's {rows} rows (a {STRING_LENGTH_BYTES}-byte "
            "length per element, and its text)"
            if text
            else f"{needed} bytes for the request's {rows} rows"
        )
        raise output_too_large(what, size, placement)


def _check_raw_count(request: kpb.ModelInferRequest, placed: int) -> None:
    """raw_input_contents holds one entry per input not placed in shared memory (`placed`
    are), in order, or none (as Triton's server reads them)."""
    raw = len(request.raw_input_contents)
    sent = len(request.inputs) - placed
    if raw and raw != sent:
        in_memory = f" ({placed} more in shared memory)" if placed else ""
        raise InvalidInputError(
            f"request has {raw} raw_input_contents for {sent} inputs{in_memory}; expected "
            "one per input not in shared memory, in the order of `inputs` (or none, with "
            "each input's data in its contents)"
        )


def asks_idempotency(request: kpb.ModelInferRequest) -> bool:
    """Whether the request's `id` keys it in the ledger (IDEMPOTENT_PARAMETER true). Of
    another kind than bool_param, the parameter is the conversion's to refuse."""
    return _flag(request.parameters, IDEMPOTENT_PARAMETER)


def _flag(parameters: Mapping[str, kpb.InferParameter], key: str) -> bool:
    """A bool_param request parameter's value; False where absent or of another kind."""
    return key in parameters and parameters[key].bool_param


def request_parameters(parameters: Any, lanes: Sequence[str]) -> tuple[str, int]:
    """The lane ("" for the default) and timeout_ms (0: none) the request's parameters
    give; raises on any other parameter, or a value of another kind."""
    unknown = sorted(key for key in parameters if key not in _PARAMETER_KINDS)
    if unknown:
        # All of them, in order, bounded: Triton's sequence parameters come as three.
        named = ", ".join(map(repr, unknown[:_MAX_NAMED]))
        more = f" and {len(unknown) - _MAX_NAMED} more" if len(unknown) > _MAX_NAMED else ""
        raise InvalidInputError(
            f"unknown request parameter(s) {named}{more}; expected some of {_UNDERSTOOD} "
            "(laneserve has no sequence batching and reads no other parameter)"
        )
    values = {
        key: _parameter_value(key, parameters[key], _PARAMETER_KINDS[key]) for key in parameters
    }
    lane = values.get(LANE_PARAMETER, "")
    priority = values.get(PRIORITY_PARAMETER, 0)
    if priority:
        lane = _lane_of_priority(priority, lane, lanes)
    return lane, _timeout_ms(values.get(TIMEOUT_PARAMETER, 0))


def _parameter_value(key: str, parameter: kpb.InferParameter, kinds: Sequence[str]) -> Any:
    kind = parameter.WhichOneof("parameter_choice")
    if kind is None or kind not in kinds:
        raise InvalidInputError(
            f"request parameter {key!r} is {_kind_named(kind)}; expected {' or '.join(kinds)}"
        )
    return getattr(parameter, kind)


def _kind_named(kind: str | None) -> str:
    """The kind of parameter given, with its article: "an int64_param", "a uint64_param"
    (you-int), or "unset"."""
    if kind is None:
        return "unset"
    return f"{'an' if kind[0] in 'aeio' else 'a'} {kind}"


def _lane_of_priority(priority: int, lane: str, lanes: Sequence[str]) -> str:
    """The lane Triton's `priority` names: 1 is its highest priority, and the lanes are
    ordered highest first, so priority k is the k-th lane. A "lane" parameter given as
    well must name the same lane."""
    if not 1 <= priority <= len(lanes):
        raise InvalidInputError(
            f"request parameter 'priority' is {priority}; expected 0 (the default lane) or 1 "
            f"to {len(lanes)}, the lanes highest first {list(lanes)}, or a 'lane' "
            "parameter (string_param) naming one"
        )
    named = lanes[priority - 1]
    if lane and lane != named:
        raise InvalidInputError(
            f"request parameters 'priority' ({priority}: lane {named!r}) and 'lane' "
            f"({lane!r}) name different lanes; expected one of them, or both naming the same "
            f"lane of {list(lanes)}"
        )
    return named


def _timeout_ms(timeout_us: int) -> int:
    """Triton's `timeout` (microseconds) as timeout_ms, rounded up: a budget is never cut
    short. 0: none of its own."""
    if timeout_us < 0:
        raise InvalidInputError(
            f"request parameter 'timeout' is {timeout_us}; expected microseconds >= 0 "
            "(0: no timeout of its own)"
        )
    timeout_ms = -(-timeout_us // 1000)
    if timeout_ms > UINT32_MAX:
        raise InvalidInputError(
            f"request parameter 'timeout' is {timeout_us} microseconds; expected at most "
            f"{UINT32_MAX * 1000} (2**32 - 1 ms, about 49.7 days)"
        )
    return timeout_ms


def _input_data(
    request: kpb.ModelInferRequest,
    tensor: kpb.ModelInferRequest.InferInputTensor,
    kind: KServeType,
    raw: bytes | None,
) -> bytes:
    """One input's data, as a laneserve Tensor's: `raw` (its raw_input_contents; None
    where the request has none) or its typed contents. Its data's length against its
    shape is the normal path's check (`codec.decode_inputs`), as for Infer's own."""
    if raw is not None:
        if tensor.contents.ListFields():
            raise InvalidInputError(
                f"input {tensor.name!r} has contents while the request has "
                "raw_input_contents; expected each input's data in one place: "
                "raw_input_contents for every input, or contents for every input"
            )
        return raw
    return _typed_data(request, tensor, kind)


def _shared_input(
    tensor: kpb.ModelInferRequest.InferInputTensor,
    kind: KServeType,
    placement: Placement,
    shared: CallerRegions,
    budget: InputBudget,
) -> bytes:
    """A copy of the input's bytes from its region, within the request's budget, once
    their count is checked against its shape (before the copy, and in words that name
    the placement; a shape that is itself wrong is the normal path's to refuse). A
    caller that may not use shared memory is refused that first, whatever else is wrong."""
    what = f"input {tensor.name!r}"
    regions = shared.usable()
    if tensor.contents.ListFields():
        raise InvalidInputError(
            f"{what} is placed in shared memory (region {placement.region!r}) and has "
            "contents; expected its data in one place"
        )
    shape = list(tensor.shape)
    if len(shape) <= MAX_DIMS and min(shape, default=0) >= 0:
        _check_placed_size(what, kind, shape, placement)
    budget.take(what, placement.byte_size)
    return regions.read(placement, what)


def _check_placed_size(
    what: str, kind: KServeType, shape: Sequence[int], placement: Placement
) -> None:
    """Refuses a byte_size other than the bytes of `shape` of `kind`. A BYTES input's
    byte_size is its serialized text's (as tritonclient's serialized_byte_size gives
    it): at least a 4-byte length per element, the rest checked as its data is read
    (`decode_strings`: each element's length, the bytes left over, UTF-8)."""
    count = math.prod(shape)
    if kind.name == BYTES:
        least = count * STRING_LENGTH_BYTES
        if placement.byte_size < least:
            raise InvalidInputError(
                f"{what} has {BYTE_SIZE_PARAMETER} {placement.byte_size} in region "
                f"{placement.region!r}; expected at least {least} for its shape {list(shape)} "
                f"of BYTES (each element a {STRING_LENGTH_BYTES}-byte little-endian length and its "
                "bytes: the serialized tensor's size)"
            )
        return
    expected = count * KSERVE_DTYPES[kind.name].itemsize
    if placement.byte_size != expected:
        raise InvalidInputError(
            f"{what} has {BYTE_SIZE_PARAMETER} {placement.byte_size} in region "
            f"{placement.region!r}; expected {expected}, the bytes of its shape {list(shape)} "
            f"of {kind.name}"
        )


def _input_type(
    tensor: kpb.ModelInferRequest.InferInputTensor, spec: TensorSpec | None
) -> KServeType:
    """The input's datatype, refused unless laneserve serves it and (for an input of the
    model's) the model's input has it: this server converts no dtype. An unknown input is
    the normal path's to refuse, in its words."""
    kind = _BY_NAME.get(tensor.datatype)
    if kind is None:
        not_served = (
            "laneserve serves no bfloat16 tensors (numpy has no such dtype); "
            if tensor.datatype in _NOT_SERVED
            else ""
        )
        raise InvalidInputError(
            f"input {tensor.name!r} has datatype {tensor.datatype!r}; {not_served}expected one "
            f"of {_NAMES}"
        )
    if spec is not None:
        wanted = kserve_datatype(spec.dtype)
        if wanted != kind.name:
            raise InvalidInputError(
                f"input {tensor.name!r} has datatype {kind.name}; expected {wanted}, the "
                f"model's input's, with shape {list(spec.shape)} (-1 = any size)"
            )
    return kind


def _typed_data(
    request: kpb.ModelInferRequest, tensor: kpb.ModelInferRequest.InferInputTensor, kind: KServeType
) -> bytes:
    """The input's typed contents (the request has no raw contents) as little-endian
    bytes of its datatype. The count is checked against the shape before anything is
    converted: nothing is allocated from a client's shape, only from the values it sent."""
    lists = [field.name for field, _ in tensor.contents.ListFields()]
    if kind.contents_field is None:
        if lists or _holds_values(tensor.shape):
            raise InvalidInputError(_raw_only(request, tensor, kind, lists))
        return b""  # a shape of no values takes none
    wrong = [name for name in lists if name != kind.contents_field]
    if wrong:
        raise InvalidInputError(
            f"input {tensor.name!r} is {kind.name} and has {wrong[0]}; expected its values in "
            f"{kind.contents_field}"
        )
    shape = list(tensor.shape)
    if len(shape) > MAX_DIMS or min(shape, default=0) < 0:
        return b""  # the normal path refuses the shape itself, in its words
    values = getattr(tensor.contents, kind.contents_field)
    expected = math.prod(shape)
    if len(values) != expected:
        raise InvalidInputError(
            f"input {tensor.name!r} has {len(values)} values in {kind.contents_field}; "
            f"expected {expected} (shape {shape})"
        )
    if kind.name == BYTES:
        # Each under 4 GiB (it came in a message of at most 2 GiB); UTF-8 is the normal
        # path's to check (`decode_strings`, naming the element), as for raw contents.
        return length_prefixed(values)
    return _as_bytes(tensor.name, values, kind)


def _holds_values(shape: Sequence[int]) -> bool:
    """Whether a shape sizes one value or more (a bad one is the normal path's)."""
    return len(shape) <= MAX_DIMS and min(shape, default=1) > 0


def _raw_only(
    request: kpb.ModelInferRequest,
    tensor: kpb.ModelInferRequest.InferInputTensor,
    kind: KServeType,
    lists: Sequence[str],
) -> str:
    """The refusal of an input of a datatype with no typed list (FP16) in a request with
    no raw contents: its bytes go only in raw_input_contents, and a request carries raw
    contents for all of its inputs or for none, so every input's must go there."""
    has = f" (it has {lists[0]})" if lists else ""
    others = (
        ", and so every input's data there (a request has raw_input_contents for all of "
        "its inputs or for none)"
        if len(request.inputs) > 1
        else ""
    )
    return (
        f"input {tensor.name!r} is {kind.name}, which has no typed contents{has}; expected "
        f"its bytes in raw_input_contents{others}"
    )


def _as_bytes(name: str, values: Sequence[Any], kind: KServeType) -> bytes:
    target = numpy_dtype(kind.datatype)  # little-endian, as the wire's
    array = np.array(values, dtype=kind.wide_dtype or target)
    if kind.wide_dtype is not None:
        check_integer_range(f"input {name!r}", kind.name, array, f" in {kind.contents_field}")
    return array.astype(target, copy=False).tobytes()


def check_integer_range(what: str, datatype: str, values: np.ndarray[Any, Any], where: str) -> None:
    """Refuses integer `values` (of a wider dtype, or Python integers) that `datatype`
    (an integer datatype's name) cannot hold, naming the first bound crossed and `where`
    they were given (" in int_contents")."""
    if not values.size:
        return
    bounds = np.iinfo(KSERVE_DTYPES[datatype])
    low, high = int(values.min()), int(values.max())
    if low < bounds.min or high > bounds.max:
        raise InvalidInputError(
            f"{what} is {datatype} and holds {low if low < bounds.min else high}{where}; "
            f"expected values from {bounds.min} to {bounds.max}"
        )


# ---- ModelInfer: the answer ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class OutputsPlaced:
    """Where a request asked its outputs written (by name; the others go in the answer),
    each with the region registered under its name as the request was read (None:
    none), and the regions they are written into: an output goes into that region or
    none (`SharedMemoryRegions.write`)."""

    regions: SharedMemoryRegions
    placements: Mapping[str, tuple[Placement, Region | None]]


def placed_outputs(
    request: object, regions: SharedMemoryRegions, max_outputs: int
) -> OutputsPlaced:
    """The outputs a request (a ModelInferCall, before its conversion lets go of the
    message; anything else places none) places in shared memory, read without refusing:
    a placement that does not read is the conversion's to refuse, and a request refused
    gets no answer to write. One asking for more than `max_outputs` outputs (the model's)
    is refused on that count, before anything walks them: none is read. Read in the same
    step of the event loop as the conversion that checks each placement's region, so
    that the region kept is the one checked."""
    placements: dict[str, tuple[Placement, Region | None]] = {}
    if isinstance(request, ModelInferCall) and len(request.message.outputs) <= max_outputs:
        for output in request.message.outputs:
            try:
                placement = placement_of(output.name, output.parameters)
            except InvalidInputError:
                continue
            if placement is not None:
                placements[output.name] = (placement, regions.get(placement.region))
    return OutputsPlaced(regions, placements)


def to_model_infer_response(
    answer: pb.InferResponse,
    model_name: str,
    placed: OutputsPlaced,
    into: kpb.ModelInferResponse | None = None,
) -> kpb.ModelInferResponse:
    """laneserve's answer as a ModelInferResponse: each output's name, datatype and shape,
    its bytes in raw_output_contents (what Triton's server sends and its clients read), and
    the answer's Timing as parameters prefixed TIMING_PREFIX. An output `placed` in shared
    memory is written there, its entry in raw_output_contents empty (its name, datatype
    and shape say what was written, all that tritonclient reads of it): so an answer is
    never larger than with the bytes in it, and stays within the envelope it was held to
    (`answer_extra_bytes`). Raises RegionNotFoundError where its region went while the
    request ran, InvalidInputError where it no longer holds the output. `into`: an empty
    message to fill (a ModelStreamInferResponse's infer_response: filled in place, not
    copied in with every output's bytes); a new one by default."""
    response = kpb.ModelInferResponse() if into is None else into
    response.model_name = model_name
    response.model_version = MODEL_VERSION
    response.id = answer.request_id
    for tensor in answer.outputs:
        response.outputs.add(
            name=tensor.name, datatype=_BY_DATATYPE[tensor.dtype].name, shape=tensor.shape
        )
        place = placed.placements.get(tensor.name)
        if place is None:
            response.raw_output_contents.append(tensor.data)
            continue
        placement, region = place
        placed.regions.write(placement, tensor.data, f"output {tensor.name!r}", region)
        response.raw_output_contents.append(b"")
    timing = answer.timing
    response.parameters[TIMING_PREFIX + _TIMING_LANE].string_param = timing.lane
    for field in _TIMING_INTEGERS:
        response.parameters[TIMING_PREFIX + field].int64_param = getattr(timing, field)
    # Within max_message_bytes: the normal path held the answer to it in this encoding
    # too (`answer_extra_bytes`, `service._check_sendable`), so it is not sized again.
    return response


def answer_extra_bytes(model_name: str, outputs: Sequence[TensorSpec], lanes: Sequence[str]) -> int:
    """The most bytes `to_model_infer_response` adds to an answer of this model over its
    InferResponse's ByteSize(): the normal path holds every answer to max_message_bytes
    in this envelope too (`InferenceServicer.widen_answer_envelope`), so that an answer
    too large for a ModelInfer caller is refused ANSWER_TOO_LARGE when it is made,
    counted and traced as such, and never stored for a retry to replay.

    Reached by some answer, from the two encodings (every tag here is one byte):
    - model_name and model_version are added; id is request_id again, of its size;
    - per output of the model (an answer has each at most once), its datatype's name (2
      bytes and the name) replaces its dtype (2: an enum under 128), and its data leaves
      the tensor for raw_output_contents with its tag and length, where empty data takes
      2 bytes the tensor did not spend; the tensor's length may take a byte more: the
      name's length and 3, at most;
    - Timing's field goes (2 bytes at least: `encode_response` always sets it) and each
      of its fields is a parameter instead, a map entry: an integer's adds its key and
      6 bytes of tags and lengths, and 2 more where it is 0 (sent in a parameter, left
      out of Timing); the lane's adds its key and tags and lengths (`_lane_extra_bytes`).
    """
    total = text_bytes(model_name) + text_bytes(MODEL_VERSION) - 2
    total += sum(len(kserve_datatype(spec.dtype)) + 3 for spec in outputs)
    total += sum(text_bytes(TIMING_PREFIX + field) + 6 for field in _TIMING_INTEGERS)
    return total + max(map(_lane_extra_bytes, lanes))


def _lane_extra_bytes(lane: str) -> int:
    """What the laneserve_lane parameter of an answer in `lane` adds over Timing.lane: the
    entry's key, the entry's and the value's tags and lengths. Its value is sent even
    when empty (a oneof's field), which Timing.lane is not."""
    size = len(lane.encode())
    value = 1 + varint_bytes(size) + size  # InferParameter.string_param
    entry = text_bytes(TIMING_PREFIX + _TIMING_LANE) + 1 + varint_bytes(value) + value
    return 1 + varint_bytes(entry) + entry - text_bytes(lane)


# ---- ModelStreamInfer: the items and the answers ---------------------------------------------

# What ModelStreamInfer reads: a ModelInferRequest as ModelInfer reads one.
ModelStreamItem = ModelInferCall | OversizedModelInfer
# Bytes per value of each datatype's tensor of a fixed size per value
# (`ModelStreamWire.held_bytes`): all but BYTES.
_VALUE_BYTES: Final = {
    name: dtype.itemsize for name, dtype in KSERVE_DTYPES.items() if name != BYTES
}
# The FINAL_RESPONSE_PARAMETER entry in a ModelInferResponse's parameters, in bytes.
_FINAL_RESPONSE_BYTES: Final = kpb.ModelInferResponse(
    parameters={FINAL_RESPONSE_PARAMETER: kpb.InferParameter(bool_param=True)}
).ByteSize()


def stream_wrapper_bytes(limit_bytes: int) -> int:
    """The most a ModelStreamInferResponse adds to its item's ModelInferResponse, of at
    most `limit_bytes`: the FINAL_RESPONSE_PARAMETER entry, and the infer_response field's
    tag and length. Added to `answer_extra_bytes` for the envelope every answer is held to
    (`InferenceServicer.widen_answer_envelope`): an answer that fits a ModelInfer caller
    and not a ModelStreamInfer one would fail that whole stream."""
    return _FINAL_RESPONSE_BYTES + 1 + varint_bytes(limit_bytes)


def stream_error_message(item_id: str, error: LaneserveError) -> str:
    """`error` as a ModelStreamInfer answer's error_message, all that tritonclient passes
    on of an error answer (its InferenceServerException, with no code and no id): gRPC's
    code and laneserve's reason first, words a caller matches ("RESOURCE_EXHAUSTED
    LANE_FULL: "), then the item's id as Triton's server tags its errors ("[request id:
    a1] "), then the message."""
    tag = f"[request id: {item_id}] " if item_id else ""
    return f"{error.code.name} {error.reason}: {tag}{bounded_message(error.message)}"


@dataclasses.dataclass(frozen=True, slots=True)
class ModelStreamTag(ItemTag):
    """A ModelStreamInfer item's tag (`ModelStreamWire.tag`): its id, whether it keys the
    ledger (IDEMPOTENT_PARAMETER), whether its answer is marked its last
    (FINAL_RESPONSE_FLAG), and where its outputs are written (`placed_outputs`). Of
    another kind than bool_param, a flag reads false here, and the conversion refuses
    it."""

    final_response: bool = False
    placed: OutputsPlaced | None = None


class ModelStreamWire:
    """ModelStreamInfer's items and answers (`streams.StreamFrontEnd`): each item read
    and converted as ModelInfer's request (`read_model_infer`, `convert`), each answer a
    ModelStreamInferResponse holding the ModelInferResponse ModelInfer would send, or an
    error: error_message (`stream_error_message`) and an infer_response with the item's
    id, the model's name and version and the error's parameters (ERROR_CODE_PARAMETER,
    ERROR_REASON_PARAMETER, RETRY_AFTER_PARAMETER), nothing else. Either is marked its
    item's last (FINAL_RESPONSE_PARAMETER) where that item asked (FINAL_RESPONSE_FLAG).
    Stateless: what an answer needs of its item is in the item's tag."""

    def __init__(
        self,
        convert: Callable[[ModelStreamItem], pb.InferRequest | LaneserveError],
        model_name: str,
        answer_extra_bytes: int,
        regions: SharedMemoryRegions,
        max_outputs: int,
    ) -> None:
        """`convert`: ModelInfer's conversion for this stream's caller
        (`kserve.KServeServicer._converted`). `answer_extra_bytes`: what
        `to_model_infer_response` adds over an InferResponse (`answer_extra_bytes`).
        `regions`: where outputs placed in shared memory are written. `max_outputs`: the
        model's outputs (`placed_outputs`)."""
        self._convert = convert
        self._model_name = model_name
        self._answer_extra_bytes = answer_extra_bytes
        self._regions = regions
        self._max_outputs = max_outputs

    def item_id(self, item: ModelStreamItem) -> str:
        if isinstance(item, OversizedModelInfer):
            return item.request_id
        return answer_id(item.message.id)

    def tag(self, item: ModelStreamItem) -> ModelStreamTag:
        if isinstance(item, OversizedModelInfer):  # refused unread: its id alone was kept
            return ModelStreamTag(
                item.request_id, idempotent=False, final_response=item.final_response
            )
        request = item.message
        return ModelStreamTag(
            answer_id(request.id),
            idempotent=asks_idempotency(request),
            final_response=_flag(request.parameters, FINAL_RESPONSE_FLAG),
            placed=placed_outputs(item, self._regions, self._max_outputs),
        )

    def convert(self, item: ModelStreamItem) -> pb.InferRequest | LaneserveError:
        return self._convert(item)

    def answer(
        self, tag: ModelStreamTag, response: pb.InferResponse
    ) -> kpb.ModelStreamInferResponse:
        message = kpb.ModelStreamInferResponse()
        placed = tag.placed or OutputsPlaced(self._regions, {})
        # The id is the request's: its request_id whether or not it keys the ledger. An
        # output its region no longer holds raises: the item is answered with the error.
        to_model_infer_response(response, self._model_name, placed, message.infer_response)
        _mark_final(tag, message.infer_response)
        return message

    def error(
        self, tag: ModelStreamTag, error: LaneserveError, limit_bytes: int
    ) -> kpb.ModelStreamInferResponse:
        message = kpb.ModelStreamInferResponse(
            error_message=stream_error_message(tag.item_id, error)
        )
        response = message.infer_response
        response.model_name = self._model_name
        response.model_version = MODEL_VERSION
        response.id = tag.item_id
        response.parameters[ERROR_CODE_PARAMETER].int64_param = error.code.value[0]
        response.parameters[ERROR_REASON_PARAMETER].string_param = error.reason
        retry_ms = pushback_ms(error)
        if retry_ms is not None:
            response.parameters[RETRY_AFTER_PARAMETER].int64_param = retry_ms
        _mark_final(tag, response)
        excess = message.ByteSize() - limit_bytes
        if excess > 0:  # only at a small limit: the text is ~1 KiB at most
            text = message.error_message
            message.error_message = bounded_message(text, len(text.encode()) - excess)
            # The rest (an id and a model name of 256 bytes at most, the parameters) takes
            # under 700 of the 1024 bytes the limit is at least.
            assert message.ByteSize() <= limit_bytes
        return message

    def held_bytes(self, answer: kpb.ModelStreamInferResponse) -> int:
        # From the shapes and datatypes the server wrote: reading raw_output_contents
        # copies the bytes (`streams.held_answer_bytes`). An output written to shared
        # memory is counted too, as if its bytes were here: the window holds such a
        # stream to what it would hold without (its answers carry no mark to tell). A
        # BYTES output's entry is read, as InferStream reads a STRING output's data: its
        # text sizes it; written to shared memory (an empty entry), it is counted at the
        # least it took, a length per element.
        response = answer.infer_response
        total = 0
        for index, tensor in enumerate(response.outputs):
            count = math.prod(tensor.shape)
            if tensor.datatype == BYTES:
                raw = len(response.raw_output_contents[index])
                total += max(raw, count * STRING_LENGTH_BYTES)
            else:
                total += count * _VALUE_BYTES[tensor.datatype]
        return total

    def item_bytes(self, item: ModelStreamItem) -> int:
        # Its message's size as received, measured already: raw and typed contents alike
        # (an input in shared memory counts nothing, as its answer's may not).
        return 0 if isinstance(item, OversizedModelInfer) else item.wire_bytes

    def envelope_bytes(self, limit_bytes: int) -> int:
        # Over an InferStream item (its tag, its length, of a byte at least, and the
        # InferResponse; the id again beside it), an answer within `limit_bytes` takes the
        # ModelInferResponse's extra (`answer_extra_bytes`: the id once), and its own
        # (`stream_wrapper_bytes`) less the item's tag and least length, at most.
        return self._answer_extra_bytes + stream_wrapper_bytes(limit_bytes) - 2


def _mark_final(tag: ModelStreamTag, response: kpb.ModelInferResponse) -> None:
    if tag.final_response:
        response.parameters[FINAL_RESPONSE_PARAMETER].bool_param = True
