"""`ServerSpans`: the gRPC server interceptor that opens a SERVER span per traced RPC
from the caller's W3C `traceparent`, and records the status code the caller receives;
`HttpServerSpans`: the same for KServe v2's HTTP inference calls (`kserve_http`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry import trace as otel_trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from laneserve.server.clock import CALLER_END_SLACK_S

# gRPC methods that get a server span: the inference path (KServe v2's ModelInfer runs
# Infer's). GetStats is polled (by `laneserve top`, every second) and would drown the
# traces that matter.
TRACED_METHODS = frozenset(
    {
        "/laneserve.v1.InferenceService/Infer",
        "/laneserve.v1.InferenceService/InferStream",
        "/inference.GRPCInferenceService/ModelInfer",
        # Left out, its items' spans were roots of traces of their own (the caller's
        # traceparent and sampling ignored), each reply in another (a review).
        "/inference.GRPCInferenceService/ModelStreamInfer",
    }
)
# Server span status is Error only for these codes (OpenTelemetry's RPC conventions):
# the others describe the caller's request, not a server fault.
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


# The servicer's method (grpc's stubs type it as a synchronous one).
_Behavior = Callable[..., Any]
_Answer = TypeVar("_Answer")
# The status an HTTP caller that left is recorded with (nginx's: no caller reads it).
HTTP_CALLER_LEFT = 499


class ServerSpans(grpc.aio.ServerInterceptor):
    """Opens a SERVER span around each traced RPC, as a child of the caller's W3C
    `traceparent` (any propagator `OTEL_PROPAGATORS` names), current while the servicer
    runs, so the request's own spans become its children.

    Written here rather than taken from opentelemetry-instrumentation-grpc: its asyncio
    interceptor leaves the status code at OK when the handler raises or the caller
    cancels, and it wraps the servicer context in a proxy. This one reads the final
    code from the context (set by `abort`), maps an exception to UNKNOWN and a
    cancellation to CANCELLED or DEADLINE_EXCEEDED, as gRPC itself answers them.
    """

    def __init__(self, tracer: otel_trace.Tracer) -> None:
        self._tracer = tracer

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in TRACED_METHODS:
            return handler
        carrier = {
            key: value
            for key, value in handler_call_details.invocation_metadata or ()
            if isinstance(value, str)
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, carrier, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(method, carrier, handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # no such method in the traced service

    def _start(self, method: str, carrier: Mapping[str, str]) -> otel_trace.Span:
        service, _, name = method.lstrip("/").partition("/")
        return self._tracer.start_span(
            method.lstrip("/"),
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )

    def _unary(
        self, method: str, carrier: Mapping[str, str], behavior: _Behavior
    ) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
        async def traced(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            span = self._start(method, carrier)
            token = otel_context.attach(otel_trace.set_span_in_context(span))
            # Neither the request nor the error stays in this frame: gRPC keeps an abort's
            # AbortError in a reference cycle with the frames it passed through, and they
            # held the request's bytes (see laneserve.server.grpc_methods.abort_with).
            handling = behavior(request, context)
            del request
            error: BaseException | None = None
            try:
                return await handling
            except BaseException as raised:
                error = raised
                raise
            finally:
                _end_server_span(span, context, error)
                error = None
                otel_context.detach(token)

        return traced

    def _streaming(
        self, method: str, carrier: Mapping[str, str], behavior: _Behavior
    ) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]:
        async def traced(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            span = self._start(method, carrier)
            current = otel_trace.set_span_in_context(span)
            responses = behavior(requests, context)
            error: BaseException | None = None
            try:
                while True:
                    # The span is the current context while the behaviour runs, one step
                    # at a time: attached across a `yield`, it was detached in another
                    # context when the caller cancelled the stream (an ERROR with a
                    # traceback logged for every cancelled InferStream).
                    token = otel_context.attach(current)
                    try:
                        response = await anext(responses)
                    except StopAsyncIteration:
                        break
                    finally:
                        otel_context.detach(token)
                    yield response
            except BaseException as raised:
                error = raised
                raise
            finally:
                await responses.aclose()  # its own cleanup runs now, not when collected
                _end_server_span(span, context, error)

        return traced


def _end_server_span(
    span: otel_trace.Span, context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None
) -> None:
    """Records the status the caller receives, as gRPC decides it."""
    remaining_s: float | None = context.time_remaining()  # None: no deadline
    # A cancel this close to the deadline came from the caller's own timer, which runs
    # ahead of the server's copy of the deadline (see CALLER_END_SLACK_S).
    cancelled = error is not None and not isinstance(error, Exception)
    if remaining_s is not None and remaining_s <= (CALLER_END_SLACK_S if cancelled else 0.0):
        # gRPC ended the call at its deadline, whatever the handler did after (an abort
        # then fails inside gRPC): the caller gets DEADLINE_EXCEEDED.
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    elif error is None or isinstance(error, grpc.aio.AbortError):
        # abort() set the code it answers with; None (typeshed says otherwise) when not set.
        set_code: grpc.StatusCode | None = context.code()
        code = grpc.StatusCode.OK if set_code is None else set_code
    elif not isinstance(error, Exception):
        code = grpc.StatusCode.CANCELLED  # asyncio.CancelledError, GeneratorExit: caller left
    else:
        span.record_exception(error)
        code = grpc.StatusCode.UNKNOWN  # what gRPC answers for an unhandled exception
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


class HttpServerSpans:
    """Opens a SERVER span around each HTTP inference call (`kserve_http`), as
    `ServerSpans` does around gRPC's: a child of the caller's W3C `traceparent` (any
    propagator `OTEL_PROPAGATORS` names), current while the call runs, so the request's
    own spans become its children; OpenTelemetry's HTTP server conventions (span name
    "POST /v2/models/{model}/infer", `http.response.status_code`, status Error for 5xx)."""

    def __init__(self, tracer: otel_trace.Tracer) -> None:
        self._tracer = tracer

    async def traced(
        self,
        method: str,
        route: str,
        headers: Mapping[str, str],
        handle: Callable[[], Awaitable[_Answer]],
        status_of: Callable[[_Answer], int],
    ) -> _Answer:
        """`handle()`'s answer, in a span that records `status_of` it (500 where it
        raised, HTTP_CALLER_LEFT where the caller left and cancelled it)."""
        carrier = {key.lower(): value for key, value in headers.items()}
        span = self._tracer.start_span(
            f"{method} {route}",
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route},
        )
        token = otel_context.attach(otel_trace.set_span_in_context(span))
        status = 500
        try:
            answer = await handle()
            status = status_of(answer)
        except asyncio.CancelledError:
            status = HTTP_CALLER_LEFT
            raise
        except Exception as error:
            span.record_exception(error)
            raise
        finally:
            otel_context.detach(token)
            span.set_attribute("http.response.status_code", status)
            if status >= HTTPStatus.INTERNAL_SERVER_ERROR:
                span.set_status(Status(StatusCode.ERROR, str(status)))
            span.end()
        return answer
