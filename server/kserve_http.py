"""KServe v2's HTTP/REST protocol, with Triton's extensions: the same model, lanes and
answers as the gRPC front ends, for callers that speak HTTP (curl, tritonclient.http,
perf_analyzer's default protocol, KServe's InferenceService probes).

Each route reads its request into the gRPC front end's message (`kserve.py`'s
GRPCInferenceService), runs that service's own method and writes its answer back as
JSON: one converter, one set of checks and errors for both wires. The service's methods
take a gRPC servicer context; `HttpCall` is that context for an HTTP request (its peer,
no deadline, `abort` raising `HttpAbort`), and `_answer_error` writes the status the
method aborted with as an HTTP status and a JSON body `{"error": ...}`, as Triton's
server does, with laneserve's reason and retry hint beside it.

The JSON and Triton's binary tensor data are read and written by `kserve_json`; here
are the HTTP server (aiohttp, on the server's event loop beside grpc.aio: an HTTP call
costs the loop what a ModelInfer does, plus the JSON), its routes, its bounds (bodies:
`_read_body`; calls in progress: max_concurrent_rpcs) and its answers and errors.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import logging
import math
import socket
import ssl
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from http import HTTPStatus
from typing import Any, Final, NoReturn

import grpc
from aiohttp import StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError
from google.rpc import error_details_pb2, status_pb2

from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.server.addresses import listening_sockets
from laneserve.server.config import UINT32_MAX
from laneserve.server.errors import (
    DrainingError,
    InvalidInputError,
    LaneserveError,
    ModelNotFoundError,
)
from laneserve.server.grpc_accept import CALL_LIMIT_DETAILS
from laneserve.server.grpc_methods import DETAILS_TRAILER, PUSHBACK_TRAILER, status_trailers
from laneserve.server.kserve import KServeServicer
from laneserve.server.kserve_json import (
    BINARY_TENSOR_EXTENSION,
    HEADER_LENGTH,
    json_object,
    json_size,
    message_json,
    parse_json,
    read_infer,
    typed,
    write_answer,
)
from laneserve.server.settings import TRACE_LEVEL
from laneserve.server.telemetry import HTTP_CALLER_LEFT, EventLog, HttpServerSpans

# The HTTP status for each gRPC code a method aborts with (Triton's HTTP server answers
# 400 for most of them; these say more, and clients read the status alone as ok or not).
_HTTP_STATUS: Final[Mapping[grpc.StatusCode, int]] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    # No caller reads it (the caller left): laneserve.http.requests and the span do.
    grpc.StatusCode.CANCELLED: HTTP_CALLER_LEFT,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# RESOURCE_EXHAUSTED refusals that a retry of the same request never gets past (429
# says "come back"): the request is too large for the server, and must be split.
_TOO_LARGE_REASONS: Final[Mapping[str, int]] = {
    "DEVICE_MEMORY": HTTPStatus.REQUEST_ENTITY_TOO_LARGE,  # one row over the memory budget
    "ANSWER_TOO_LARGE": HTTPStatus.REQUEST_ENTITY_TOO_LARGE,  # over max_message_bytes
}


class HttpAbort(Exception):  # noqa: N818 - not a failure here: the answer the method chose
    """What `HttpCall.abort` raises: the status a KServe method ended its call with."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailers: Sequence[tuple[str, str | bytes]]
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailers = tuple(trailers)


class HttpRefusal(Exception):  # noqa: N818 - an answer, as HttpAbort is
    """A request refused by the HTTP wire itself, not by a KServe method: before its body
    is read (over max_concurrent_rpcs 429, another model 404, a coding 415, too long by
    its Content-Length 413, an Expect 417) or as it is read (413, a pause or a slow body
    408, a body that does not inflate 400). Counted in laneserve.http.requests alone, in
    no lane nor ModelStatistics (as gRPC's core and call bound refuse a call before
    laneserve reads it)."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason

    def answer(self, *, close: bool = True) -> web.Response:
        """The refusal as an answer; with `close` (where the body is not all read) with
        `Connection: close`: the rest of the body is not waited for (see LINGER_S)."""
        answer = _error_body(self.status, self.message, self.reason)
        if close:
            answer.force_close()
        return answer


class HttpCall(grpc.aio.ServicerContext[Any, Any]):
    """The servicer context of one HTTP request: what the KServe methods and the
    inference path read of a call (its peer, its deadline: none, whether it ended) and
    `abort`, which raises HttpAbort for `_answer_error`. The streaming side of a context
    (read, write, metadata sent) has no use on a request answered once: it raises."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._code: grpc.StatusCode | None = None
        self._details = ""

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Any = (),  # what abort_with passes: (key, value) pairs
    ) -> NoReturn:
        self._code, self._details = code, details
        raise HttpAbort(code, details, tuple(trailing_metadata))

    async def abort_with_status(self, status: Any) -> NoReturn:
        await self.abort(status.code, status.details, status.trailing_metadata)

    def peer(self) -> str:
        """The caller's address as a gRPC peer string ("ipv4:127.0.0.1:50000",
        "ipv6:[::1]:50000"; gRPC percent-encodes the brackets, which
        `shared_memory.is_local_peer` reads either way)."""
        transport = self._request.transport
        peername = None if transport is None else transport.get_extra_info("peername")
        if not isinstance(peername, tuple):
            return "unknown"
        host, port = peername[:2]
        return f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"

    def time_remaining(self) -> float | None:  # type: ignore[override]  # None: grpc.aio's own
        return None  # HTTP has no deadline: the request's `timeout` parameter is its own

    def cancelled(self) -> bool:
        transport = self._request.transport
        return transport is None or transport.is_closing()

    def done(self) -> bool:
        return self.cancelled()

    def code(self) -> grpc.StatusCode:
        return self._code  # type: ignore[return-value]  # None until aborted, as grpc.aio's

    def details(self) -> str:
        return self._details

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def invocation_metadata(self) -> None:
        return None  # read only by streams' receive limits: HTTP has no stream

    def trailing_metadata(self) -> Any:
        return ()

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        pass

    def add_done_callback(self, callback: Any) -> None:
        raise NotImplementedError("an HTTP request has no done callbacks")

    async def read(self) -> Any:
        raise NotImplementedError("an HTTP request is read whole, not as a stream")

    async def write(self, message: Any) -> None:
        raise NotImplementedError("an HTTP request is answered once, not as a stream")

    async def send_initial_metadata(self, initial_metadata: Any) -> None:
        raise NotImplementedError("an HTTP answer has no initial metadata")

    def set_compression(self, compression: Any) -> None:
        raise NotImplementedError("HTTP answers are not compressed")

    def disable_next_message_compression(self) -> None:
        pass

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> Mapping[str, Iterable[bytes]]:
        return {}


# ---- Answers and errors ------------------------------------------------------------------


def _json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(body).encode(), status=status, content_type="application/json"
    )


def _error_body(status: int, message: str, reason: str = "") -> web.Response:
    body: dict[str, object] = {"error": message}
    if reason:
        body["reason"] = reason
    return _json_response(body, status)


def _answer_error(abort: HttpAbort) -> web.Response:
    """The status a method aborted with, as Triton's HTTP server writes one (`{"error":
    message}`, which tritonclient reads), with laneserve's reason (ErrorInfo.reason, e.g.
    "LANE_FULL") and, where a retry is advised, `retry_after_ms` and a Retry-After header
    (whole seconds, rounded up: HTTP has no finer one)."""
    body: dict[str, object] = {"error": abort.details}
    headers: dict[str, str] = {}
    for key, value in abort.trailers:
        if key == DETAILS_TRAILER and isinstance(value, bytes):
            body.update(_reason_of(value))
        elif key == PUSHBACK_TRAILER and isinstance(value, str) and value.isdigit():
            body["retry_after_ms"] = int(value)
            headers["Retry-After"] = str(max(1, math.ceil(int(value) / 1000)))
    status = _TOO_LARGE_REASONS.get(str(body.get("reason", "")))
    if status is None:
        status = _HTTP_STATUS.get(abort.code, HTTPStatus.INTERNAL_SERVER_ERROR)
    response = _json_response(body, status)
    response.headers.update(headers)
    return response


def _reason_of(details: bytes) -> dict[str, object]:
    """ErrorInfo's reason in a status's details (the rich status laneserve sends)."""
    status = status_pb2.Status.FromString(details)
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return {"reason": info.reason}
    return {}


# ---- The front end ------------------------------------------------------------------------

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The route a request counts under where its path names none of the front end's.
UNMATCHED_ROUTE: Final = "unmatched"
# The route counted for a request aiohttp's parser refused before any route was matched
# (`_MalformedRequests`).
MALFORMED_ROUTE: Final = "malformed"
# aiohttp's logger of the requests its parser refuses.
AIOHTTP_SERVER_LOGGER: Final = "aiohttp.server"


class _MalformedRequests(logging.Filter):
    """On aiohttp's logger: its ERROR record of each request its parser refused (a bad
    header or chunk, an unknown method; answered 400 in plain text before any route),
    with a traceback repeating the client's bytes, becomes a count in `answered`
    (MALFORMED_ROUTE, the refusal's status) and in the event log's aggregated
    `http_requests_malformed` line (INFO). Any client wrote ERROR lines at will (500
    requests: 273 KB of them in 0.3 s), which an alert on ERROR lines takes for a fault.
    Every other record passes (a handler's own failure stays an ERROR). Not counted: a
    first request whose method is not HTTP's (a scan, TLS on the plain port), which
    aiohttp logs at DEBUG, below the level a filter sees; nor a bad chunk that comes
    after its headers, which aiohttp does not tell the reader of (the body stalls: 408).
    With two front ends in one process the first one's filter counts both."""

    def __init__(
        self, answered: collections.Counter[tuple[str, int]], events: EventLog | None
    ) -> None:
        super().__init__()
        self._answered = answered  # the front end's; both touched on the event loop alone
        self._events = events

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError) or not str(record.msg).startswith(
            "Error handling request"
        ):
            return True
        self._answered[MALFORMED_ROUTE, error.code or HTTPStatus.BAD_REQUEST] += 1
        if self._events is not None:
            self._events.http_malformed(type(error).__name__)
        return False


class HttpFrontEnd:
    """KServe v2's HTTP/REST protocol on one port, in front of `kserve` (the gRPC front
    end's servicer, itself in front of the server's lanes). At most `max_calls`
    inference calls in progress (max_concurrent_rpcs, as each gRPC port): past it one is
    refused 429 before its body is read. A body is read up to `max_body_bytes`
    (max_message_bytes), inflated where compressed and `compressed_requests` allows."""

    def __init__(
        self,
        kserve: KServeServicer,
        *,
        max_calls: int,
        max_body_bytes: int,
        compressed_requests: bool,
        spans: HttpServerSpans | None,
        events: EventLog | None = None,
    ) -> None:
        self._kserve = kserve
        self._max_calls = max_calls
        self._infer_body = _BodyLimit(
            max_body_bytes,
            "server.max_message_bytes",
            "fewer rows per request, its tensors as binary data rather than JSON, or in "
            "shared memory",
        )
        self._compressed_requests = compressed_requests
        self._spans = spans
        self._calls = 0  # inference calls in progress; only the event loop touches it
        # Answers by (route template, HTTP status): `answered`, for Prometheus.
        self._answered: collections.Counter[tuple[str, int]] = collections.Counter()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None  # once started
        # The requests reading their bodies now (`_read_body`): a stop ends each read
        # (cancelled, then answered DRAINING: `_stopping`).
        self._bodies_reading: set[asyncio.Task[object]] = set()
        self._stopping = False
        self._malformed = _MalformedRequests(self._answered, events)

    def application(self) -> web.Application:
        """The routes, Triton's HTTP paths (a version path beside each model path)."""
        # The body limit is the front end's own (`_read_body`): aiohttp's answers plain text.
        app = web.Application(middlewares=[self._answer_json], client_max_size=2**63 - 1)
        get, post = app.router.add_get, app.router.add_post
        get("/v2/health/live", self._live)
        get("/v2/health/ready", self._ready)
        get("/v2", self._server_metadata)
        get("/v2/models/stats", self._statistics)  # before /v2/models/{model}
        for model in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            get(model, self._model_metadata)
            get(f"{model}/ready", self._model_ready)
            get(f"{model}/config", self._model_config)
            get(f"{model}/stats", self._statistics)
            post(f"{model}/infer", self._infer, expect_handler=self._expect_continue)
        post("/v2/repository/index", self._repository_index)
        post("/v2/repository/models/{model}/load", self._refuse_model_control)
        post("/v2/repository/models/{model}/unload", self._refuse_model_control)
        for kind in ("systemsharedmemory", "cudasharedmemory"):
            get(f"/v2/{kind}/status", self._region_status)
            get(f"/v2/{kind}/region/{{name}}/status", self._region_status)
            post(f"/v2/{kind}/region/{{name}}/register", self._register)
            post(f"/v2/{kind}/unregister", self._unregister)
            post(f"/v2/{kind}/region/{{name}}/unregister", self._unregister)
        get("/v2/logging", self._log_settings)
        post("/v2/logging", self._log_settings)
        for path in ("/v2/trace/setting", "/v2/models/{model}/trace/setting"):
            get(path, self._trace_settings)
            post(path, self._trace_settings)
        return app

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        """Listens on `host`:`port` (0: any free port) as gRPC's port does
        (`listening_sockets`); returns the port bound. Raises OSError where it cannot."""
        runner = web.AppRunner(
            self.application(),
            handle_signals=False,
            access_log=None,
            # A caller that leaves cancels its request, as a gRPC caller's cancel does:
            # what it queued is dropped before it runs.
            handler_cancellation=True,
            # Bodies are inflated by `_read_body`, within the limit, and a coding it does
            # not take is refused in JSON (aiohttp answered a corrupt one with a bare 500).
            auto_decompress=False,
            # Every request has its answer when the server stops it (after the drain).
            shutdown_timeout=2.0,
            lingering_time=LINGER_S,
            # A connection with no request under way, before its first (nothing sent, or
            # a request line or headers cut short) as between two, is closed after this:
            # aiohttp's default hour let idle or stalled connections pile up until the
            # process ran out of files (290 under `ulimit -n 300`: gRPC's health checks
            # timed out, and accept() failed ~2 000 times a second, each logged).
            keepalive_timeout=IDLE_CONNECTION_S,
        )
        await runner.setup()
        logging.getLogger(AIOHTTP_SERVER_LOGGER).addFilter(self._malformed)
        sockets: list[socket.socket] = []
        try:
            sockets = listening_sockets(host, port)
            for each in sockets:
                await web.SockSite(runner, each, ssl_context=tls).start()
        except BaseException:
            await runner.cleanup()
            logging.getLogger(AIOHTTP_SERVER_LOGGER).removeFilter(self._malformed)
            for each in sockets:  # those no site served yet (closing twice is no fault)
                each.close()
            raise
        self._runner = runner
        self.port = int(sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stops listening and closes its connections (the drain answered every call it
        admitted). A request whose body is still arriving is answered 503 DRAINING first:
        left to aiohttp's stop, it waited out the stop's timeout and was cancelled, the
        caller's connection closed without an answer and counted as a caller who left."""
        self._stopping = True
        for reading in self._bodies_reading:
            reading.cancel()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
            logging.getLogger(AIOHTTP_SERVER_LOGGER).removeFilter(self._malformed)

    def answered(self) -> Mapping[tuple[str, int], int]:
        """The requests answered so far, by route template (UNMATCHED_ROUTE for a path
        that names none) and HTTP status (HTTP_CALLER_LEFT where the caller left first)."""
        return dict(self._answered)

    @web.middleware
    async def _answer_json(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Every answer JSON, errors too: a method's abort as its HTTP status, and aiohttp's
        own refusals (no such path, a method the path does not take) in words that name
        what is served; each counted by route and status. Inference calls traced, as
        gRPC's are (`ServerSpans`)."""
        route = request.match_info.route
        template = _route_of(request)
        status: int = HTTPStatus.INTERNAL_SERVER_ERROR  # where answering raised
        try:
            if self._spans is not None and route.handler == self._infer:
                answer = await self._spans.traced(
                    request.method,
                    template,
                    request.headers,
                    lambda: self._answered_json(request, handler),
                    lambda answer: answer.status,
                )
            else:
                answer = await self._answered_json(request, handler)
            status = answer.status
        except asyncio.CancelledError:
            status = HTTP_CALLER_LEFT
            raise
        finally:
            self._answered[template, status] += 1
        return answer

    async def _answered_json(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except HttpAbort as abort:
            return _answer_error(abort)
        except HttpRefusal as refusal:
            # A fault found once the whole body was read keeps the connection.
            return refusal.answer(close=not request.content.is_eof())
        except LaneserveError as error:  # an operator call's body refused as it is read, or
            # any body as a stop ends its read (`stop`): then the rest is not waited for.
            answer = _answer_error(HttpAbort(error.code, error.message, status_trailers(error)))
            if not request.content.is_eof():
                answer.force_close()
            return answer
        except web.HTTPNotFound:
            return _error_body(
                HTTPStatus.NOT_FOUND,
                f"no such path: {request.method} {request.path}; expected KServe v2's "
                "(Triton's) paths under /v2, e.g. GET /v2/health/ready, POST "
                "/v2/models/<model>/infer",
            )
        except web.HTTPMethodNotAllowed as error:
            allowed = ", ".join(sorted(error.allowed_methods))
            not_allowed = _error_body(
                HTTPStatus.METHOD_NOT_ALLOWED,
                f"{request.path} takes no {request.method}; expected {allowed}",
            )
            not_allowed.headers["Allow"] = allowed  # as HTTP asks of a 405
            return not_allowed

    # -- health and metadata: the gRPC methods' own answers, as JSON

    async def _live(self, request: web.Request) -> web.Response:
        answer = await self._kserve.ServerLive(kpb.ServerLiveRequest(), HttpCall(request))
        return _json_response({"live": answer.live})

    async def _ready(self, request: web.Request) -> web.Response:
        answer = await self._kserve.ServerReady(kpb.ServerReadyRequest(), HttpCall(request))
        return _json_response({"ready": answer.ready}, 200 if answer.ready else 503)

    async def _model_ready(self, request: web.Request) -> web.Response:
        model, version = _model_of(request)
        call = HttpCall(request)
        # Over HTTP the status is the answer (200: ready; tritonclient's is_model_ready
        # reads the status alone, False for any other), and a Triton server answers a
        # model or version it lacks with an error status too (400 "Model version not
        # ready"): here 404 MODEL_NOT_FOUND, which says what is served. gRPC's
        # ModelReady answers ready=false instead: there an error status is no answer.
        await self._kserve.abort_unless_served(model, version, call)
        asked = kpb.ModelReadyRequest(name=model, version=version)
        answer = await self._kserve.ModelReady(asked, call)
        return _json_response({"name": model, "ready": answer.ready}, 200 if answer.ready else 503)

    async def _server_metadata(self, request: web.Request) -> web.Response:
        answer = await self._kserve.ServerMetadata(kpb.ServerMetadataRequest(), HttpCall(request))
        answer.extensions.append(BINARY_TENSOR_EXTENSION)  # this wire's own
        return _json_response(message_json(answer))

    async def _model_metadata(self, request: web.Request) -> web.Response:
        model, version = _model_of(request)
        asked = kpb.ModelMetadataRequest(name=model, version=version)
        answer = await self._kserve.ModelMetadata(asked, HttpCall(request))
        return _json_response(message_json(answer))

    async def _model_config(self, request: web.Request) -> web.Response:
        model, version = _model_of(request)
        asked = kpb.ModelConfigRequest(name=model, version=version)
        answer = await self._kserve.ModelConfig(asked, HttpCall(request))
        return _json_response(message_json(answer.config))  # Triton's: the config itself

    async def _statistics(self, request: web.Request) -> web.Response:
        model, version = _model_of(request)
        asked = kpb.ModelStatisticsRequest(name=model, version=version)
        answer = await self._kserve.ModelStatistics(asked, HttpCall(request))
        return _json_response(message_json(answer))

    async def _repository_index(self, request: web.Request) -> web.Response:
        body = json_object(
            await self._small_json(request), "the request", ("repository_name", "ready")
        )
        asked = kpb.RepositoryIndexRequest(
            repository_name=typed(
                body.get("repository_name", ""), str, "'repository_name'", "a string"
            ),
            ready=typed(body.get("ready", False), bool, "'ready'", "true or false"),
        )
        answer = await self._kserve.RepositoryIndex(asked, HttpCall(request))
        return _json_response([message_json(model) for model in answer.models])  # Triton's

    async def _refuse_model_control(self, request: web.Request) -> web.Response:
        call = HttpCall(request)
        if request.path.endswith("/load"):
            await self._kserve.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(), call)
        await self._kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(), call)
        raise AssertionError("unreachable: both refuse")

    # -- log and trace settings: the gRPC methods, one root logger and one sampler

    async def _log_settings(self, request: web.Request) -> web.Response:
        """Triton's /v2/logging: LogSettings, each setting a JSON value of its kind (true
        or false for bool_param, a whole number for uint32_param, a string for
        string_param), as asked in a POST's object and answered."""
        asked = kpb.LogSettingsRequest()
        if request.method == "POST":
            body = typed(await self._small_json(request), dict, "the request", _LOG_OBJECT)
            for key, value in body.items():
                _read_log_setting(value, repr(key), asked.settings[typed(key, str, "a key", "")])
        answer = await self._kserve.LogSettings(asked, HttpCall(request))
        return _json_response(
            {
                key: getattr(value, str(value.WhichOneof("parameter_choice")))
                for key, value in answer.settings.items()
            }
        )

    async def _trace_settings(self, request: web.Request) -> web.Response:
        """Triton's /v2[/models/{model}]/trace/setting: TraceSetting, each setting a
        string, but trace_level a list of strings, as answered and asked in a POST's
        object (where a setting may be a list of strings, or null: its value at start)."""
        asked = kpb.TraceSettingRequest(model_name=request.match_info.get("model", ""))
        if request.method == "POST":
            body = typed(await self._small_json(request), dict, "the request", _TRACE_OBJECT)
            for key, value in body.items():
                values = asked.settings[typed(key, str, "a key", "")].value
                if isinstance(value, list):
                    values.extend(
                        typed(item, str, f"an item of {key!r}", "a string") for item in value
                    )
                elif value is not None:  # null: the setting cleared, of no value
                    values.append(typed(value, str, repr(key), "a string, strings or null"))
        answer = await self._kserve.TraceSetting(asked, HttpCall(request))
        return _json_response(
            {
                key: list(value.value) if key == TRACE_LEVEL else value.value[0]
                for key, value in answer.settings.items()
            }
        )

    # -- shared memory: the gRPC methods, one registry

    async def _region_status(self, request: web.Request) -> web.Response:
        await self._no_body(request)
        name = request.match_info.get("name", "")
        call = HttpCall(request)
        if "/cudasharedmemory/" in request.path:
            asked_cuda = kpb.CudaSharedMemoryStatusRequest(name=name)
            cuda = await self._kserve.CudaSharedMemoryStatus(asked_cuda, call)
            return _json_response([message_json(each) for each in cuda.regions.values()])
        asked = kpb.SystemSharedMemoryStatusRequest(name=name)
        answer = await self._kserve.SystemSharedMemoryStatus(asked, call)
        # Triton's HTTP answer: a list of the regions, not the gRPC answer's map.
        return _json_response([message_json(each) for each in answer.regions.values()])

    async def _register(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        call = HttpCall(request)
        if "/cudasharedmemory/" in request.path:
            await self._kserve.CudaSharedMemoryRegister(kpb.CudaSharedMemoryRegisterRequest(), call)
            raise AssertionError("unreachable: CUDA registration is refused")
        keys = ("key", "offset", "byte_size")
        body = json_object(await self._small_json(request), "the request", keys)
        asked = kpb.SystemSharedMemoryRegisterRequest(
            name=name,
            key=typed(body.get("key"), str, "'key'", "the shared memory object's name"),
            offset=json_size(body.get("offset", 0), "'offset'"),
            byte_size=json_size(body.get("byte_size"), "'byte_size'"),
        )
        await self._kserve.SystemSharedMemoryRegister(asked, call)
        return _json_response({})

    async def _unregister(self, request: web.Request) -> web.Response:
        await self._no_body(request)  # before anything is let go of
        name = request.match_info.get("name", "")
        call = HttpCall(request)
        if "/cudasharedmemory/" in request.path:
            asked_cuda = kpb.CudaSharedMemoryUnregisterRequest(name=name)
            await self._kserve.CudaSharedMemoryUnregister(asked_cuda, call)
        else:
            asked = kpb.SystemSharedMemoryUnregisterRequest(name=name)
            await self._kserve.SystemSharedMemoryUnregister(asked, call)
        return _json_response({})

    async def _small_json(
        self, request: web.Request, expected: str = "a JSON object of a few fields"
    ) -> Any:
        """An operator call's JSON body ({} where it has none), refused unread over
        _OPERATOR_BODY_LIMIT (these take a few fields), or as JSON that does not parse,
        naming what was `expected`."""
        self._check_headers(request, _OPERATOR_BODY_LIMIT)
        body = await self._read_body(request, _OPERATOR_BODY_LIMIT)
        if not body.strip():
            return {}
        return parse_json(body, expected)

    async def _no_body(self, request: web.Request) -> None:
        """Refuses (400) a body on a shared memory status or unregister call, which
        takes none (Triton's: the region's name is in the path, or none for every
        region), but an empty one or `{}`: a body ignored was a body misread, and
        `POST /v2/systemsharedmemory/unregister` with one (a name, or `garbage`) let go
        of every region."""
        route = _route_of(request)
        if "{name}" in route:
            means = "the region's name is in the path"
        else:  # /v2/{kind}/{verb}
            _, _, kind, verb = route.split("/")
            means = f"it means every region; one is /v2/{kind}/region/<name>/{verb}"
        expected = f"no body, or {{}}: {request.method} {route} reads none ({means})"
        body = typed(await self._small_json(request, expected), dict, "the request", expected)
        if body:
            raise InvalidInputError(f"the request has keys {sorted(body)[:8]}; expected {expected}")

    # -- inference

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        unread = self._refused_unread(request)
        if unread is not None:
            return unread
        call = HttpCall(request)
        model, version = _model_of(request)
        self._calls += 1
        try:
            body = await self._read_body(request, self._infer_body)
            message = kpb.ModelInferRequest(model_name=model, model_version=version)
            try:
                read = read_infer(
                    body,
                    request.headers.get(HEADER_LENGTH),
                    message,
                    input_specs=self._kserve.input_specs,
                    max_outputs=self._kserve.max_outputs,
                )
            except InvalidInputError as refusal:
                del body
                # Counted in the lane its parameters name, where they were read and name
                # one: as ModelInfer's data faults, found in that lane's path.
                await self._kserve.refuse_unconverted(refusal, call, message.parameters)
            del body  # the call holds its inputs' bytes, and lets go of them once converted
            answer = await self._kserve.ModelInfer(read.call, call)
            written, header_length = write_answer(answer, read)
            if header_length is None:
                return web.Response(body=written, content_type="application/json")
            binary = web.Response(body=written, content_type="application/octet-stream")
            binary.headers[HEADER_LENGTH] = str(header_length)
            return binary
        finally:
            self._calls -= 1

    def _refused_unread(self, request: web.Request) -> web.Response | None:
        """An inference call's refusal before its body is read (None: none), an
        HttpRefusal's: over max_concurrent_rpcs (429), for another model (404: no request
        to this one, whatever its body holds), compressed where that is off or in a
        coding this server does not inflate (415), longer than the limit by its
        Content-Length (413). The connection closes after it."""
        if self._calls >= self._max_calls:
            busy = HttpRefusal(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"{CALL_LIMIT_DETAILS} ({self._max_calls} inference calls in progress, "
                "max_concurrent_rpcs); expected a retry after a moment",
                "SERVER_BUSY",
            ).answer()
            # HTTP's least delay: a client or gateway that follows Retry-After on a 429
            # had nothing to follow (the call limit's pushback is not known here).
            busy.headers["Retry-After"] = "1"
            return busy
        try:
            self._kserve.check_served(*_model_of(request))
            self._check_headers(request, self._infer_body)
        except HttpRefusal as refusal:
            return refusal.answer()
        except ModelNotFoundError as error:
            return HttpRefusal(HTTPStatus.NOT_FOUND, error.message, error.reason).answer()
        return None

    async def _expect_continue(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` on an inference call: its refusal before the body is
        sent (`_refused_unread`), else "100 Continue" (aiohttp's own handler sent it
        before any check, and the client sent a body only to have it refused)."""
        if request.headers.get("Expect", "").lower() == "100-continue":
            refusal = self._refused_unread(request)
        else:
            refusal = HttpRefusal(
                HTTPStatus.EXPECTATION_FAILED,
                f"unknown Expect header {request.headers.get('Expect')!r}; expected "
                "100-continue or none",
            ).answer()
        if refusal is not None:  # answered here, not through the middleware: counted and
            # traced here, as the same refusal of a request without Expect is
            self._answered[_route_of(request), refusal.status] += 1
            if self._spans is not None:
                await self._spans.traced(
                    request.method,
                    _route_of(request),
                    request.headers,
                    functools.partial(_given, refusal),
                    lambda answer: answer.status,
                )
            return refusal
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # as aiohttp's own handler: the answer is unsent
        return None

    def _check_headers(self, request: web.Request, limit: _BodyLimit) -> None:
        """Refuses (HttpRefusal) a body compressed where that is off, or in a coding this
        server does not inflate, and one over `limit` by its Content-Length."""
        coding = _coding(request)
        if coding != "identity":
            if not self._compressed_requests:
                raise HttpRefusal(
                    HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                    f"request body is {coding}-compressed and this server takes no "
                    "compressed requests (server.compressed_requests false); expected an "
                    "uncompressed body",
                )
            if coding not in _INFLATE_WBITS:
                raise HttpRefusal(
                    HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                    f"request body is {coding}-compressed; expected gzip, deflate or none",
                )
        length = request.content_length
        if length is not None and length > limit.max_bytes:
            raise _too_large(length, limit)

    async def _read_body(self, request: web.Request, limit: _BodyLimit) -> bytes:
        """The request's body, its headers checked already (`_check_headers`: a coding
        it does not take, a Content-Length over `limit`), inflated where compressed
        (gzip, deflate), refused over `limit` as it comes or as it inflates (413),
        malformed (400), or paused BODY_IDLE_S or under BODY_MIN_BYTES_PER_S (408).
        Inflated here, bounded as it goes, not by aiohttp (which turned a coding it
        lacks, or a corrupt body, into a bare 500 or 400)."""
        wbits = _INFLATE_WBITS.get(_coding(request))
        inflater = None if wbits is None else zlib.decompressobj(wbits)
        task = asyncio.current_task()
        assert task is not None
        self._bodies_reading.add(task)
        try:
            return await self._read_chunks(request, limit, request.content, inflater)
        except asyncio.CancelledError:
            if not self._stopping:
                raise  # the caller left (aiohttp's handler_cancellation)
            # A stop's cancel (`stop`): the caller waits for an answer. The body's rest is
            # read and dropped as a refused body's is (LINGER_S), not reset under it.
            task.uncancel()
            raise DrainingError(
                "server is stopping and this request's body had not all arrived; retry on "
                "another instance"
            ) from None
        finally:
            self._bodies_reading.discard(task)

    async def _read_chunks(
        self,
        request: web.Request,
        limit: _BodyLimit,
        content: StreamReader,
        inflater: zlib._Decompress | None,
    ) -> bytes:
        """`_read_body`'s reading of `content`, chunk by chunk."""
        chunks: list[bytes] = []
        sent = size = 0
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        while True:
            # Due by then: BODY_IDLE_S, and a second more for each BODY_MIN_BYTES_PER_S bytes
            # come, and never more than BODY_IDLE_S from the last bytes.
            due_s = started_s + BODY_IDLE_S + sent / BODY_MIN_BYTES_PER_S
            waited_from_s = loop.time()
            try:
                async with asyncio.timeout(min(BODY_IDLE_S, due_s - waited_from_s)):
                    chunk = await content.readany()
            except TimeoutError:
                # Named a pause where it was one, or nearly (both rules may be broken at
                # once: early on, the rate's due time is a pause's, give or take the time
                # since the body began).
                paused = loop.time() - waited_from_s >= 0.9 * BODY_IDLE_S
                raise _stalled(sent, loop.time() - started_s, slow=not paused) from None
            except web.RequestPayloadError as error:  # a chunked body that does not parse
                raise HttpRefusal(
                    HTTPStatus.BAD_REQUEST,
                    f"request body is malformed ({error}); expected HTTP/1.1's chunked "
                    "coding, or a Content-Length",
                ) from None
            if not chunk:
                break
            sent += len(chunk)
            if inflater is not None:
                chunk = _inflated(inflater, chunk, limit.max_bytes - size + 1)
            size += len(chunk)
            if sent > limit.max_bytes:
                raise _too_large(sent, limit, read=True)
            if size > limit.max_bytes:  # inflated (else `size` is `sent`)
                raise _too_large(size, limit, read=True, inflated=_coding(request))
            chunks.append(chunk)
        if inflater is not None and not inflater.eof:
            raise HttpRefusal(
                HTTPStatus.BAD_REQUEST,
                f"request body ends before its {_coding(request)} stream does; expected a "
                "whole compressed body",
            )
        if inflater is not None and inflater.unused_data:
            raise HttpRefusal(
                HTTPStatus.BAD_REQUEST,
                f"request body goes on {len(inflater.unused_data)} bytes past the end of "
                f"its {_coding(request)} stream; expected one compressed stream (one gzip "
                "member), nothing after it",
            )
        return b"".join(chunks)


# How long aiohttp reads on (and drops) what a client still sends of a body refused
# unread, after the answer and before it closes the connection: time for the client to
# read the answer before the close resets the connection. aiohttp's default, 10 s, had
# the event loop read 9.5 GB of a body refused 413 on loopback (a socket left unread is
# read again by aiohttp's own flow control: there is no not reading it).
LINGER_S: Final = 1.0
# How long a connection may stay open with no request under way (`start`): nginx's
# keep-alive default; a client's pool reconnects past it.
IDLE_CONNECTION_S: Final = 75.0
# A request body holds one of max_concurrent_rpcs calls while it comes: it may pause at
# most BODY_IDLE_S, and must come at BODY_MIN_BYTES_PER_S on average past its first
# BODY_IDLE_S (Apache's mod_reqtimeout's rule), else 408. A body dripping a byte at a
# time held a call for good, and as many as the bound shut every other caller out.
BODY_IDLE_S: Final = 30.0
BODY_MIN_BYTES_PER_S: Final = 64 * 1024
# zlib's window bits for each Content-Encoding inflated: gzip's wrapper, and zlib's
# (HTTP's "deflate" is RFC 1950's zlib format, as tritonclient sends it).
_INFLATE_WBITS: Final[Mapping[str, int]] = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _coding(request: web.Request) -> str:
    coding = request.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
    return "gzip" if coding == "x-gzip" else coding  # RFC 9110: x-gzip is gzip


def _inflated(inflater: Any, chunk: bytes, most_bytes: int) -> bytes:
    """`chunk` inflated, at most `most_bytes` of it (more is over the limit, whatever
    the rest holds: it is not inflated); refused 400 where it is no such stream."""
    try:
        return bytes(inflater.decompress(chunk, most_bytes))
    except zlib.error as error:
        raise HttpRefusal(
            HTTPStatus.BAD_REQUEST,
            f"request body does not inflate ({error}); expected a body its Content-Encoding "
            "names (gzip's format for gzip, zlib's for deflate)",
        ) from None


def _stalled(sent: int, taken_s: float, *, slow: bool) -> HttpRefusal:
    """The 408 of a body that paused BODY_IDLE_S, or (`slow`) came under
    BODY_MIN_BYTES_PER_S on average past its first BODY_IDLE_S, naming which."""
    broken = (
        f"came at {sent / taken_s:.0f} bytes/s, under {BODY_MIN_BYTES_PER_S:g} bytes/s on "
        f"average past its first {BODY_IDLE_S:g} s"
        if slow
        else f"paused {BODY_IDLE_S:g} s"
    )
    return HttpRefusal(
        HTTPStatus.REQUEST_TIMEOUT,
        f"request body stalled: {sent} bytes in {taken_s:.1f} s, and it {broken}; expected "
        "the whole body at once (a body holds one of the max_concurrent_rpcs calls while "
        "it comes)",
    )


async def _given(answer: web.Response) -> web.Response:
    return answer


def _route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return UNMATCHED_ROUTE if resource is None else resource.canonical


def _model_of(request: web.Request) -> tuple[str, str]:
    return request.match_info.get("model", ""), request.match_info.get("version", "")


def _too_large(
    size: int, limit: _BodyLimit, *, read: bool = False, inflated: str | None = None
) -> HttpRefusal:
    """The 413 of a body of `size` bytes (`read`: of that many so far), or of a body whose
    `inflated` coding (gzip, deflate) inflates to that many: its size as sent is less."""
    so_far = "at least " if read else ""
    body = f"inflates ({inflated}) to" if inflated else "is"
    return HttpRefusal(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        f"request body {body} {so_far}{size} bytes, over the limit of {limit.max_bytes} "
        f"({limit.named}); expected {limit.expected}",
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _BodyLimit:
    """The most bytes a body may hold, with the words its refusal names it in."""

    max_bytes: int
    named: str  # "server.max_message_bytes"
    expected: str  # what to send instead


_LOG_OBJECT: Final = 'an object of log settings, e.g. {"log_verbose_level": 1}'
_TRACE_OBJECT: Final = 'an object of trace settings, e.g. {"trace_rate": "100"}'


def _read_log_setting(value: Any, what: str, setting: kpb.LogSettingsRequest.SettingValue) -> None:
    """A log setting's JSON `value` into `setting`, by its JSON kind: true or false a
    bool_param, a whole number a uint32_param, a string a string_param."""
    if isinstance(value, bool):
        setting.bool_param = value
    elif isinstance(value, int):
        if not 0 <= value <= UINT32_MAX:
            raise InvalidInputError(
                f"{what} is {value}; expected a whole number from 0 to {UINT32_MAX}"
            )
        setting.uint32_param = value
    else:
        setting.string_param = typed(value, str, what, "true or false, a whole number or a string")


_OPERATOR_BODY_LIMIT: Final = _BodyLimit(
    64 * 1024, "that of an operator call's body", "a JSON object of a few fields"
)
