"""The client's error tree, and the one place that translates gRPC failures into it.

    LaneserveError                       any status this tree has no class for
    ├── InvalidInputError                INVALID_ARGUMENT      (INVALID_INPUT)
    │   └── RequestIdReusedError         INVALID_ARGUMENT      REQUEST_ID_REUSED
    ├── ResourceExhaustedError           RESOURCE_EXHAUSTED    (e.g. gRPC's message size limit)
    │   ├── LaneFullError                RESOURCE_EXHAUSTED    LANE_FULL            retryable
    │   ├── MemoryPressureError          (any)                 MEMORY_PRESSURE      retryable
    │   ├── DeviceMemoryError            (any)                 DEVICE_MEMORY
    │   ├── AnswerTooLargeError          (any)                 ANSWER_TOO_LARGE
    │   ├── JoinLimitError               RESOURCE_EXHAUSTED    JOIN_LIMIT           retryable
    │   └── ServerBusyError              RESOURCE_EXHAUSTED    (the call limit)     retryable
    ├── DeadlineExceededError            DEADLINE_EXCEEDED     (the caller's own deadline)
    │   ├── DeadlineUnmeetableError      DEADLINE_EXCEEDED     DEADLINE_UNMEETABLE
    │   └── ExpiredInQueueError          DEADLINE_EXCEEDED     EXPIRED_IN_QUEUE
    ├── UnavailableError                 UNAVAILABLE           (no connection)      retryable
    │   └── ServerDrainingError          UNAVAILABLE           DRAINING             retryable
    ├── EngineError                      INTERNAL              ENGINE_FAILURE
    ├── UnreadableAnswerError            INTERNAL              (an answer not readable here)
    ├── CallCancelledError               CANCELLED             (network, backlog)   retryable
    └── ClientClosedError                (this client was closed)

The server's ``google.rpc.ErrorInfo`` reason (domain ``laneserve.dev``) picks the class
when there is one; the status code picks it otherwise, so a plain gRPC status without
details (a dropped connection: UNAVAILABLE) maps too, and so does one whose
``grpc-status-details-bin`` trailer does not parse (a proxy's, a peer not laneserve):
its message says so. Every error carries the server's
message, the code, the reason, and the server's retry hint in seconds (``RetryInfo``, or
the ``grpc-retry-pushback-ms`` trailer).

``retryable`` marks the outcomes worth the same request again after a pause: a full lane,
memory pressure, a draining or unreachable server, a call the network cut off. Everything
else is the request's own fault, or will not change by retrying it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

__all__ = [
    "AnswerTooLargeError",
    "CallCancelledError",
    "ClientClosedError",
    "DeadlineExceededError",
    "DeadlineUnmeetableError",
    "DeviceMemoryError",
    "EngineError",
    "ExpiredInQueueError",
    "InvalidInputError",
    "JoinLimitError",
    "LaneFullError",
    "LaneserveError",
    "MemoryPressureError",
    "RequestIdReusedError",
    "ResourceExhaustedError",
    "ServerBusyError",
    "ServerDrainingError",
    "UnavailableError",
    "UnreadableAnswerError",
    "error_from_rpc",
    "error_from_status",
]

ERROR_DOMAIN = "laneserve.dev"
_PUSHBACK_KEY = "grpc-retry-pushback-ms"
_DETAILS_KEY = "grpc-status-details-bin"


class LaneserveError(Exception):
    """A request failed. Raised by every client call; never a bare ``grpc.RpcError``."""

    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        reason: str = "",
        retry_after_s: float | None = None,
        request_id: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        # The server's message (or gRPC's, for a failure without a server answer).
        self.message = message
        self.code = code
        # ErrorInfo.reason, e.g. "LANE_FULL"; "" when the status had no laneserve details.
        self.reason = reason
        # The server's hint: seconds until a retry can succeed (None: no hint).
        self.retry_after_s = retry_after_s
        self.request_id = request_id
        # ErrorInfo.metadata from the server.
        self.metadata: dict[str, str] = dict(metadata or {})
        # The server asked not to retry (a negative grpc-retry-pushback-ms).
        self.no_retry = False
        # Attempts sent before this error was raised: 1 for a call answered without
        # retries, 0 for a request this client refused itself (never sent).
        self.attempts = 1

    @property
    def should_retry(self) -> bool:
        """Whether the same request may succeed after a pause."""
        return self.retryable and not self.no_retry

    def __str__(self) -> str:
        what = self.reason or self.code.name
        return f"{what}: {self.message}"


class InvalidInputError(LaneserveError, ValueError):
    """The request is wrong for this model or server (names, dtypes, shapes, lane)."""


class RequestIdReusedError(InvalidInputError):
    """The request_id was used recently for other inputs; use a new id for new inputs."""


class ResourceExhaustedError(LaneserveError):
    """The server or gRPC refused for lack of a resource (e.g. the message size limit)."""


class JoinLimitError(ResourceExhaustedError):
    """The request's request_id is queued or running with as many callers waiting for it
    as one request may have (retries and hedges of it): retried after a pause, it joins
    or gets the stored answer without running again."""

    retryable = True


class ServerBusyError(ResourceExhaustedError):
    """The server refused the call at once: as many calls as it admits at once (its
    ``max_concurrent_rpcs``; for InferStream half of it, for GetModel and GetStats a
    bound of their own, which the message names) were in progress. The call never ran;
    retry."""

    retryable = True


class LaneFullError(ResourceExhaustedError):
    """The lane holds as many rows as it may; retry after ``retry_after_s``."""

    retryable = True


class MemoryPressureError(ResourceExhaustedError):
    """The server is short of device memory for now; retry after ``retry_after_s``."""

    retryable = True


class DeviceMemoryError(ResourceExhaustedError):
    """The model ran out of device memory on this request's batch."""


class AnswerTooLargeError(ResourceExhaustedError):
    """The request ran, but its answer is over the server's max_message_bytes, or over
    this client's own receive limit (`reason` empty then): send fewer rows per request,
    ask for fewer outputs, or raise the limit."""


class DeadlineExceededError(LaneserveError):
    """The deadline passed before an answer came (this one: the caller's own deadline)."""


class DeadlineUnmeetableError(DeadlineExceededError):
    """Refused at once: the rows queued ahead could not be served before the deadline."""


class ExpiredInQueueError(DeadlineExceededError):
    """The deadline passed while the request waited in its lane; it never ran (one split
    across batches, over the server's batch cap: its rows not yet run never ran)."""


class UnavailableError(LaneserveError):
    """The server could not be reached or answered UNAVAILABLE."""

    retryable = True


class ServerDrainingError(UnavailableError):
    """The server is shutting down; retry (on another instance)."""


class EngineError(LaneserveError):
    """The model failed on the batch that carried this request."""


class UnreadableAnswerError(LaneserveError):
    """The server answered, but this client could not read the answer (a tensor whose
    data disagrees with its shape and dtype, text that is not UTF-8): a fault of the
    server or of a peer between, never of the request, which ran. Not a ValueError, as
    InvalidInputError is: a service that maps ValueError to its caller's fault must not
    blame its caller for a broken server. Not retried: a retry with the same request_id
    is answered the same (replayed)."""

    def __init__(self, message: str, **fields: Any) -> None:
        fields.setdefault("code", grpc.StatusCode.INTERNAL)
        super().__init__(message, **fields)


class CallCancelledError(LaneserveError):
    """The call was cancelled by something other than this client: gRPC reports
    CANCELLED for calls cut off by a closing connection (grpc/grpc#41785), as it reports
    UNAVAILABLE for others, and for calls the server's gRPC core refused unread because
    its backlog of calls not yet taken was full (the server's ``max_pending_calls``:
    those never ran). The caller's own cancellation never arrives as this error (it is
    ``asyncio.CancelledError`` or ``KeyboardInterrupt``), so a retry with the same
    request_id is safe and is made."""

    retryable = True


class ClientClosedError(LaneserveError):
    """The call was made on a closed client, or the client was closed while the call
    waited to retry (its last error is the cause). Not retried: the client is gone."""

    def __init__(self, message: str = "the client is closed; open a new one", **fields: Any):
        fields.setdefault("code", grpc.StatusCode.CANCELLED)
        super().__init__(message, **fields)


def unreadable_answer(
    why: str, *, request_id: str = "", name: str = "", attempts: int = 1
) -> UnreadableAnswerError:
    """The error for an answer this client could not decode (`why`: the codec's words);
    `name` prefixes it (a bulk job's item); `attempts`, the attempts sent."""
    prefix = f"{name}: " if name else ""
    error = UnreadableAnswerError(
        f"{prefix}the server's answer could not be read: {why}; the server (or a peer "
        "between) sent a malformed answer: no fault of the request, which ran",
        request_id=request_id,
    )
    error.attempts = attempts
    return error


def closed_before_sending(request_id: str = "") -> ClientClosedError:
    """The refusal of a call made on a client already closed: nothing of it was sent, so
    its `attempts` is 0, as for every request the client refuses itself (it counted 1, as
    if a server had answered it)."""
    error = ClientClosedError(request_id=request_id)
    error.attempts = 0
    return error


_BY_REASON: Mapping[str, type[LaneserveError]] = {
    "INVALID_INPUT": InvalidInputError,
    "REQUEST_ID_REUSED": RequestIdReusedError,
    "LANE_FULL": LaneFullError,
    "MEMORY_PRESSURE": MemoryPressureError,
    "DEVICE_MEMORY": DeviceMemoryError,
    "ANSWER_TOO_LARGE": AnswerTooLargeError,
    "JOIN_LIMIT": JoinLimitError,
    "DEADLINE_UNMEETABLE": DeadlineUnmeetableError,
    "EXPIRED_IN_QUEUE": ExpiredInQueueError,
    "DRAINING": ServerDrainingError,
    "ENGINE_FAILURE": EngineError,
}

_BY_CODE: Mapping[grpc.StatusCode, type[LaneserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInputError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.CANCELLED: CallCancelledError,
}

# gRPC's own CANCELLED carries no words; what it means for a call to laneserve.
_BARE_CANCELLED = (
    "CANCELLED by gRPC before an answer: the connection closed, or the server's gRPC core "
    "refused the call unread because its backlog was full (server setting "
    "max_pending_calls; such a call never ran); retryable with the same request_id"
)

# What gRPC's server says, and nothing more, when it refuses a call over its concurrent
# call limit (grpc.aio's and the sync server's words alike); a laneserve server says the
# same over its own (max_concurrent_rpcs).
_GRPC_CALL_LIMIT = "Concurrent RPC limit exceeded!"
_SERVER_BUSY = (
    "the server refused the call at once: it admits max_concurrent_rpcs calls at once "
    "(InferStream calls half of them) and that many were in progress (server setting "
    "max_concurrent_rpcs); the call never ran; retryable with the same request_id"
)

# The trailers a laneserve server adds to its refusal in those words, each naming the
# bound (server/grpc_accept.py's CALL_LIMIT_KEY, STREAM_LIMIT_KEY and
# OPERATOR_LIMIT_KEY): inference calls at once (max_concurrent_rpcs), InferStream calls
# at once (half of it), and GetModel and GetStats calls at once (counted apart, without a
# request_id). A server that predates a trailer sends the words alone (_SERVER_BUSY).
_LIMIT_KEYS = ("laneserve-call-limit", "laneserve-stream-limit", "laneserve-operator-limit")

# google.rpc.Code numbers (in a Status message) to grpc's enum.
_CODES_BY_NUMBER: Mapping[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def error_from_status(
    status: status_pb2.Status, *, request_id: str = "", pushback_ms: str | None = None
) -> LaneserveError:
    """The typed error for a ``google.rpc.Status`` (an InferStream item's error, or the
    decoded ``grpc-status-details-bin`` trailer of a failed call)."""
    code = _CODES_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    reason = ""
    metadata: Mapping[str, str] = {}
    retry_after_s: float | None = None
    message = status.message
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        retry = error_details_pb2.RetryInfo()
        try:
            if detail.Unpack(info):
                if info.domain in (ERROR_DOMAIN, ""):
                    reason = info.reason
                    metadata = info.metadata
            elif detail.Unpack(retry):
                retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
        except DecodeError as undecodable:  # bytes that are not the type it names
            # Left out, and said: the others still pick the class, or the code alone.
            message = (
                f"{message} (its status detail {detail.type_url} did not parse: {undecodable})"
            )
    pushback_s = None if pushback_ms is None else _parse_pushback_s(pushback_ms)
    if retry_after_s is None:
        retry_after_s = pushback_s
    cls = _BY_REASON.get(reason) or _BY_CODE.get(code, LaneserveError)
    error = cls(
        message,
        code=code,
        reason=reason,
        retry_after_s=retry_after_s,
        request_id=request_id,
        metadata=metadata,
    )
    # A negative or unreadable pushback means "do not retry" (gRPC's retry design, A6).
    error.no_retry = pushback_ms is not None and pushback_s is None
    return error


def error_from_rpc(error: grpc.RpcError, *, request_id: str = "") -> LaneserveError:
    """The typed error for a failed gRPC call (sync or asyncio)."""
    code, details, trailers = _parts(error)
    pushback: str | None = None
    status: status_pb2.Status | None = None
    bound: str | None = None
    # Why the status details trailer was not read, where it did not parse.
    unread: str | None = None
    for key, value in trailers:
        if key == _DETAILS_KEY and isinstance(value, bytes):
            try:
                status = status_pb2.Status.FromString(value)
            except DecodeError as undecodable:
                # A proxy's or another peer's trailer: the code alone picks the class (a
                # raw DecodeError escaped every call that got one).
                unread = f"{_DETAILS_KEY} did not parse ({undecodable})"
        elif key == _PUSHBACK_KEY:
            pushback = value.decode() if isinstance(value, bytes) else value
        elif key in _LIMIT_KEYS:
            bound = value.decode(errors="replace") if isinstance(value, bytes) else value
    if code is grpc.StatusCode.CANCELLED and details in ("", "CANCELLED"):
        details = _BARE_CANCELLED
    if status is None or status.code != _number(code):
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and details == _GRPC_CALL_LIMIT:
            return ServerBusyError(_server_busy(bound), code=code, request_id=request_id)
        over = OVER_RECEIVE_LIMIT.search(details)
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and over is not None and over[1] == "CLIENT":
            return AnswerTooLargeError(
                _over_own_limit(over, details), code=code, request_id=request_id
            )
        if unread is not None:
            details = (
                f"{details} (the status details were not read: {unread}; the error is "
                "mapped by its status code alone)"
            )
        status = status_pb2.Status(code=_number(code), message=details)
    return error_from_status(status, request_id=request_id, pushback_ms=pushback)


# gRPC's words (its core's) for a message over a receive limit: "CLIENT: ..." this
# client's (an answer: `error_from_rpc`), "SERVER: ..." the server's (a stream's item:
# `_stream._call_error`); the sizes the message's and the limit.
OVER_RECEIVE_LIMIT: Final = re.compile(
    r"(?<![A-Za-z])(CLIENT|SERVER): Received message larger than max \((\d+) vs\. (\d+)\)"
)


def _over_own_limit(over: re.Match[str], details: str) -> str:
    """An answer over this client's receive limit (the client's max_message_bytes, or a
    grpc.max_receive_message_length option): the request had run. gRPC's bare words
    named no limit of the caller's and said nothing of the request."""
    return (
        f"the server's answer ({over[2]} bytes) is over this client's receive limit "
        f"({over[3]} bytes: its max_message_bytes, or a grpc.max_receive_message_length "
        "option); the request ran: raise the limit, or ask for fewer rows or outputs "
        f"(gRPC: {details})"
    )


def _server_busy(bound: str | None) -> str:
    """What a refusal in gRPC's words for a full port means: over max_concurrent_rpcs,
    or over the bound a laneserve server named in its trailer (`_LIMIT_KEYS`)."""
    if bound is None:
        return _SERVER_BUSY
    return (
        "the server refused the call at once: as many calls were in progress as its bound "
        f"admits ({bound}); the call never ran; retryable"
    )


def _parts(
    error: grpc.RpcError,
) -> tuple[grpc.StatusCode, str, Sequence[tuple[str, str | bytes]]]:
    # Every RpcError raised by a call is also a grpc.Call (sync) or an AioRpcError.
    code_of = getattr(error, "code", None)
    details_of = getattr(error, "details", None)
    trailers_of = getattr(error, "trailing_metadata", None)
    code = code_of() if callable(code_of) else grpc.StatusCode.UNKNOWN
    details = details_of() if callable(details_of) else str(error)
    trailers = trailers_of() if callable(trailers_of) else None
    return (
        code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN,
        details or "",
        tuple(trailers or ()),
    )


def _number(code: grpc.StatusCode) -> int:
    number = code.value[0]
    assert isinstance(number, int)
    return number


def _parse_pushback_s(value: str) -> float | None:
    try:
        milliseconds = int(value)
    except ValueError:
        return None
    return None if milliseconds < 0 else milliseconds / 1000
