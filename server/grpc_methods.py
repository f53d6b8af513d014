"""laneserve's methods, and gRPC's own services beside them, as gRPC's core calls them.

Each request is read from its bytes here, within the bounds a server exposed to any
caller needs before any Python work is spent on it: its size besides its tensors' data
(`read_infer_request`), an operator request's size (`read_operator_request`), bytes that do
not parse (`read_request`), the length of its request_id (`answer_id`). Each method is
registered with its port's call gate (`add_to_server`, `add_grpc_service`), and a refusal
ends its call with rich status (`abort_with`). The servicer (service.py) sees only what
passed, or the stand-in of its refusal.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final, Protocol, TypeVar

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from laneserve.server.codec import MAX_EXTRA_BYTES, dtype_refusal, extra_bytes
from laneserve.server.engine import TensorSpec
from laneserve.server.errors import (
    InvalidInputError,
    LaneserveError,
    bounded_message,
    pushback_ms,
    to_rpc_status,
)
from laneserve.server.grpc_accept import OPERATOR_METHODS, CallGate, abort_unless_gone
from laneserve.v1 import inference_pb2 as pb

# The longest request_id accepted, in bytes of UTF-8 (documented in inference.proto). An
# id travels in every answer (twice in a stream's: the item's and its response's), is
# quoted in error messages, keys the ledger and the replay cache, and labels spans and
# logs: unbounded, one near max_message_bytes made its item's answer larger than gRPC
# sends, and the whole stream failed with it. 256 holds the ids clients generate (a UUID
# is 36 characters; the Python client's are a 32-character job id, a dash and an index)
# and is about Stripe's bound on its idempotency keys (255 characters); at the smallest
# max_message_bytes (1024) it leaves room for the rest of an answer that carries it
# twice, or beside an error.
MAX_REQUEST_ID_BYTES = 256
# The largest request an operator method (OPERATOR_METHODS) reads, in bytes on the wire,
# and gRPC's own services beside laneserve's (health, Channelz, reflection:
# `add_grpc_service`); one larger is refused unparsed (`read_operator_request`). Their
# requests are empty messages (GetModelRequest, GetStatsRequest) or a name or an id: a
# field added later, a filter or a flag, is tens of bytes, and 64 KiB leaves room for that
# a thousand times over. What it spares is Python's share of a large body: no parsed copy
# (its unknown fields copied beside its bytes), no echo (reflection's answer repeats its
# request), and the call ended at once. Not the body: gRPC's core holds it whole before
# any Python runs (16 concurrent GetStats of 48 MiB raised the server's RSS by 1.2-1.5 GiB
# parsed, by 0.8-0.9 GiB refused unparsed). The bound on bodies in memory is
# max_message_bytes times the calls gRPC holds (max_pending_calls not yet taken, and the
# calls in progress): a port exposed to untrusted callers lowers max_message_bytes.
MAX_OPERATOR_REQUEST_BYTES = 64 * 1024


# What the servicer receives for bytes that do not parse as its method's request (another
# schema, invalid UTF-8 in a string field): refused INVALID_ARGUMENT (`undecodable`),
# where gRPC's own deserializer failure answered UNKNOWN "Unexpected DecodeError" (and
# ended a whole InferStream). Compared by identity; never changed.
UNDECODABLE_REQUEST = pb.InferRequest()
UNDECODABLE_GET_MODEL = pb.GetModelRequest()
UNDECODABLE_GET_STATS = pb.GetStatsRequest()
_M = TypeVar("_M", bound=Message)
_E = TypeVar("_E", bound=BaseException)
_UNDECODABLE: dict[type[Message], Message] = {
    type(message): message
    for message in (UNDECODABLE_REQUEST, UNDECODABLE_GET_MODEL, UNDECODABLE_GET_STATS)
}


def read_request(request_type: type[_M], data: bytes) -> _M:
    try:
        return request_type.FromString(data)
    except DecodeError:
        undecodable = _UNDECODABLE[request_type]
        assert isinstance(undecodable, request_type)
        return undecodable


@dataclasses.dataclass(frozen=True, slots=True)
class OversizedRequest:
    """What the servicer receives for an InferRequest carrying more than MAX_EXTRA_BYTES
    besides its tensors' data and one copy of each field (`read_infer_request`): refused
    INVALID_ARGUMENT (`oversized`), as an undecodable one is. Its id alone is kept, not
    its message: a stream answers the refusal tagged with it, as it answers its items'
    other refusals (an empty id left its client unable to tell which item it was)."""

    # As a stream answer echoes it (`answer_id`): empty where over MAX_REQUEST_ID_BYTES.
    request_id: str
    # The refusal of an input's dtype other than the model's input's (`codec.dtype_refusal`),
    # its words made of the model's names and dtypes: float32 data labelled float16, over
    # 64 rows of 512, is more than 64 KiB longer than its shape, and was told that, not
    # its dtype. None where each input's dtype is its model input's, or unknown.
    dtype_refusal: str | None = None


def read_infer_request(
    data: bytes,
    max_inputs: int,
    max_outputs: int,
    *,
    input_specs: Sequence[TensorSpec] = (),
) -> pb.InferRequest | OversizedRequest:
    """`data` read as an InferRequest (`read_request`), or an OversizedRequest. Measured
    here, where its size on the wire is known: a message's own ByteSize() encodes it again
    (1 ms per MiB of data). A request with more inputs than `max_inputs` or more output
    names than `max_outputs` is passed on unmeasured: validation refuses it on those
    counts. An OversizedRequest's inputs are checked against `input_specs` (the model's)
    for a dtype other than theirs, the fault to name first."""
    request = read_request(pb.InferRequest, data)
    if request is UNDECODABLE_REQUEST:
        return request  # empty: measured, every byte read would count as extra
    if len(request.inputs) > max_inputs or len(request.output_names) > max_outputs:
        return request
    if len(data) <= MAX_EXTRA_BYTES:
        # Its extra bytes are some of its bytes: never more than MAX_EXTRA_BYTES. Not
        # walked (4.8 us a one-row request, where it parsed in 0.4).
        return request
    extra = extra_bytes(request, len(data))
    if extra is not None and extra > MAX_EXTRA_BYTES:
        # The id is a copy: nothing of the message, or of its bytes, stays reachable.
        return OversizedRequest(
            answer_id(request.request_id), dtype_refusal(request.inputs, input_specs)
        )
    return request


@dataclasses.dataclass(frozen=True, slots=True)
class OversizedOperatorRequest:
    """What an operator method's servicer receives for a request over
    MAX_OPERATOR_REQUEST_BYTES (`read_operator_request`): refused INVALID_ARGUMENT
    (`operator_request_too_large`), as an undecodable one is. Its size alone is kept,
    not its bytes."""

    method: str  # "GetStats"; of gRPC's own services, "/grpc.health.v1.Health/Check"
    size_bytes: int  # on the wire


def read_operator_request(
    read: Callable[[bytes], Message], method: str, data: bytes
) -> Message | OversizedOperatorRequest:
    """`data` read by `read` (the method's `read_request`), or an OversizedOperatorRequest
    where it is over MAX_OPERATOR_REQUEST_BYTES: measured before the parse, which would
    copy every unknown field of it into the message."""
    if len(data) > MAX_OPERATOR_REQUEST_BYTES:
        return OversizedOperatorRequest(method, len(data))
    return read(data)


def operator_request_too_large(request: OversizedOperatorRequest) -> InvalidInputError:
    """The refusal of an OversizedOperatorRequest."""
    return _too_large(
        request,
        f"{' and '.join(sorted(OPERATOR_METHODS))} requests; expected a "
        f"laneserve.v1.{request.method}Request message encoded from "
        "protos/laneserve/v1/inference.proto",
    )


def _too_large(request: OversizedOperatorRequest, bound_and_expected: str) -> InvalidInputError:
    """The refusal of an OversizedOperatorRequest: its size over MAX_OPERATOR_REQUEST_BYTES
    for `bound_and_expected` (what the bound is for, and what was expected)."""
    return InvalidInputError(
        f"the {request.method} request is {request.size_bytes} bytes, over the limit of "
        f"{MAX_OPERATOR_REQUEST_BYTES} bytes for {bound_and_expected}"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class UndecodableGrpcRequest:
    """What a handler of one of gRPC's own services (`add_grpc_service`) receives for a
    request that does not parse: refused INVALID_ARGUMENT (`grpc_request_undecodable`).
    Left to the generated deserializer, the DecodeError ended the call UNKNOWN and logged
    a traceback at ERROR for each such call."""

    method: str  # "/grpc.health.v1.Health/Check"
    message: str  # the request's full type name


def read_grpc_request(request_type: type[Message], method: str, data: bytes) -> Any:
    """`data` as `request_type`, or its refusal's stand-in: an OversizedOperatorRequest
    (over MAX_OPERATOR_REQUEST_BYTES, measured before the parse) or an
    UndecodableGrpcRequest."""
    try:
        return read_operator_request(request_type.FromString, method, data)
    except DecodeError:
        return UndecodableGrpcRequest(method, request_type.DESCRIPTOR.full_name)


def grpc_request_undecodable(request: UndecodableGrpcRequest) -> InvalidInputError:
    """The refusal of an UndecodableGrpcRequest."""
    return InvalidInputError(
        f"the {request.method} request does not parse as a {request.message} message; "
        "expected that message, encoded"
    )


def grpc_request_too_large(request: OversizedOperatorRequest) -> InvalidInputError:
    """The refusal of an OversizedOperatorRequest to one of gRPC's own services
    (`add_grpc_service`)."""
    return _too_large(
        request,
        "the requests of gRPC's health, Channelz and reflection services; expected that "
        "method's request message (names and ids, tens of bytes)",
    )


def oversized(request: OversizedRequest) -> InvalidInputError:
    """The refusal of an OversizedRequest: its dtype's where one is wrong (the data of
    another dtype is why it is longer than its shape), its extra bytes' otherwise."""
    if request.dtype_refusal is not None:
        return InvalidInputError(request.dtype_refusal)
    return InvalidInputError(
        f"the request carries more than {MAX_EXTRA_BYTES} bytes besides its tensors' data "
        "(as their shapes and dtypes size it) and one copy of each of its fields: fields "
        "this server does not know, fields sent more than once, or data longer than its "
        f"shape; expected at most {MAX_EXTRA_BYTES} bytes besides the data, with the "
        "fields of protos/laneserve/v1/inference.proto"
    )


def undecodable(request: Message) -> InvalidInputError:
    """The refusal of an `UNDECODABLE_*` request."""
    return InvalidInputError(
        f"the request does not parse as a {request.DESCRIPTOR.full_name} message; expected "
        "one encoded from protos/laneserve/v1/inference.proto (strings in UTF-8)"
    )


class InferenceMethods(Protocol):
    """What `add_to_server` reads of laneserve.v1's servicer (`service.InferenceServicer`)
    besides a method per name the proto declares (looked up by name): the model's inputs
    and outputs, which bound how much of an InferRequest is read."""

    @property
    def input_specs(self) -> Sequence[TensorSpec]: ...

    @property
    def output_names(self) -> Sequence[str]: ...


# gRPC's handler factory for each (client streams, server streams) of a method.
HANDLER_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_to_server(
    servicer: InferenceMethods, server: grpc.aio.Server, gate: CallGate
) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """What the generated `add_InferenceServiceServicer_to_server` does, with
    `read_request` as the deserializer of the requests that have an `UNDECODABLE_*`: every
    method of the service as the proto declares it (a method added there is served once
    the servicer has it), each inference call counted by the port's `gate`, and each
    operator call (OPERATOR_METHODS) counted apart, its request read only up to
    MAX_OPERATOR_REQUEST_BYTES. Returns the handlers by full method name
    ("/laneserve.v1.InferenceService/Infer")."""
    service = pb.DESCRIPTOR.services_by_name["InferenceService"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        read: Callable[[bytes], Any] = (
            functools.partial(read_request, request_type)
            if request_type in _UNDECODABLE
            else request_type.FromString
        )
        if request_type is pb.InferRequest:
            read = functools.partial(
                read_infer_request,
                max_inputs=len(servicer.input_specs),
                max_outputs=len(servicer.output_names),
                input_specs=servicer.input_specs,
            )
        behavior = getattr(servicer, method.name)
        if method.name in OPERATOR_METHODS:  # counted apart: answered while inference is full
            assert not method.client_streaming, method.name  # `CallGate.gate_operator`: unary
            assert not method.server_streaming, method.name
            read = functools.partial(read_operator_request, read, method.name)
            read = gate.operator_deserializer(read)
            behavior = gate.gate_operator(behavior)
        else:
            if not method.client_streaming:  # a stream's items are read within its call
                read = gate.deserializer(read)
            behavior = gate.gate(behavior, response_streaming=method.server_streaming)
        handlers[method.name] = HANDLER_KINDS[method.client_streaming, method.server_streaming](
            behavior,
            request_deserializer=read,
            response_serializer=response_type.SerializeToString,
        )
    _register(server, service.full_name, handlers)
    return {f"/{service.full_name}/{name}": handler for name, handler in handlers.items()}


def add_grpc_service(server: grpc.aio.Server, service_name: str, servicer: object) -> None:
    """What gRPC's generated `add_*Servicer_to_server` does for one of its own services
    beside laneserve's (health, Channelz, reflection), with `read_operator_request` as
    each method's deserializer: a request over MAX_OPERATOR_REQUEST_BYTES ends its call
    INVALID_ARGUMENT (`grpc_request_too_large`), unparsed. Their requests are names and
    ids, yet were read up to max_message_bytes, and reflection's answer repeats its
    request, unknown fields included: 16 streams of 48 MiB took the server to a 3.7 GiB
    peak. `service_name`: its full name, its generated module imported (which puts it in
    protobuf's default pool). `servicer`: grpc.aio's, whose methods are coroutine or async
    generator functions (one that reads its requests through `context.read()` would get
    the refusal's stand-in: none of gRPC's does)."""
    service = descriptor_pool.Default().FindServiceByName(service_name)
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        full_name = f"/{service.full_name}/{method.name}"
        behavior = getattr(servicer, method.name)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            # Not implemented by the grpc.aio servicer (health's List): the generated
            # base's stub, answering UNIMPLEMENTED, as gRPC does a method it lacks.
            continue
        handlers[method.name] = HANDLER_KINDS[method.client_streaming, method.server_streaming](
            _refusing_oversized(behavior, requests_streamed=method.client_streaming),
            request_deserializer=functools.partial(read_grpc_request, request_type, full_name),
            response_serializer=response_type.SerializeToString,
        )
    _register(server, service.full_name, handlers)


def _register(
    server: grpc.aio.Server, service_name: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
) -> None:
    """`handlers` (by method name) as a generated `add_*Servicer_to_server` adds them:
    registered (each asked for from gRPC's core by name), and generic for the rest."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)


def _refusing_oversized(
    behavior: Callable[..., Any], *, requests_streamed: bool
) -> Callable[..., Any]:
    """`behavior` (a grpc.aio handler), its call ended INVALID_ARGUMENT where a request is
    an OversizedOperatorRequest or an UndecodableGrpcRequest: before it runs, or, its
    requests streamed, when it reads that one. A coroutine function or an async generator
    function as `behavior` is: gRPC tells how to call a handler by its kind."""

    async def checked(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, OversizedOperatorRequest):
            await abort_with(context, grpc_request_too_large(request))
        if isinstance(request, UndecodableGrpcRequest):
            await abort_with(context, grpc_request_undecodable(request))
        return request

    async def each_checked(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async for request in requests:
            yield await checked(request, context)

    async def given(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return (
            each_checked(request, context) if requests_streamed else await checked(request, context)
        )

    if inspect.isasyncgenfunction(behavior):

        async def answers(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            responses = behavior(await given(request, context), context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()  # its cleanup as the call ends, not when collected

        return answers

    async def answer(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await behavior(await given(request, context), context)

    return answer


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], error: LaneserveError) -> None:
    """Ends the RPC with `error`'s status, rich details and, if retryable, the pushback:
    trailers only, no message (a handler that sets its status and returns sends an empty
    message before it, which a JSON transcoder answers as a body).

    gRPC keeps the AbortError this raises in a reference cycle with every frame it passes
    through, freed only by a full garbage collection: a frame on the way that still holds
    the request kept its bytes and decoded inputs as long, hundreds of MiB after a burst of
    large refusals, enough to close every lane at the host memory watermark. So the
    callers let go of the request first (`release_frames`, and the wrappers of
    grpc_accept and server_spans)."""
    await abort_unless_gone(
        context, error.code, bounded_message(error.message), status_trailers(error)
    )


def release_frames(error: _E) -> _E:
    """`error`, with the locals of the finished frames its traceback (and those of the
    errors chained to it) passed through cleared: they held the request and its decoded
    inputs (see `abort_with`)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        chained = pending.pop()
        if chained is None or id(chained) in seen:
            continue
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained.__traceback__ = None
        pending += (chained.__context__, chained.__cause__)
    return error


# The trailers of a refusal: its rich status (google.rpc.Status), and gRPC's retry hint.
DETAILS_TRAILER: Final = "grpc-status-details-bin"
PUSHBACK_TRAILER: Final = "grpc-retry-pushback-ms"


def status_trailers(error: LaneserveError) -> tuple[tuple[str, str | bytes], ...]:
    trailers: list[tuple[str, str | bytes]] = [
        (DETAILS_TRAILER, to_rpc_status(error).SerializeToString())
    ]
    delay_ms = pushback_ms(error)
    if delay_ms is not None:
        trailers.append((PUSHBACK_TRAILER, str(delay_ms)))
    return tuple(trailers)


def id_too_long(request_id: str) -> bool:
    # A character is at most 4 bytes of UTF-8: a short id needs no encoding.
    return len(request_id) * 4 > MAX_REQUEST_ID_BYTES and (
        len(request_id.encode()) > MAX_REQUEST_ID_BYTES
    )


def answer_id(request_id: str) -> str:
    """The request_id a stream answer carries: empty for one over MAX_REQUEST_ID_BYTES."""
    return "" if id_too_long(request_id) else request_id


def request_id_too_long(request_id: str) -> InvalidInputError:
    return InvalidInputError(
        f"request_id is {len(request_id.encode())} bytes, over the limit of "
        f"{MAX_REQUEST_ID_BYTES} bytes (UTF-8); expected a shorter id (this one starts "
        f"{request_id[:16]!r})"
    )
