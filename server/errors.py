"""The laneserve error tree, and the one place that maps it onto gRPC status.

    LaneserveError                 code                 reason (ErrorInfo)
    ├── InvalidInputError          INVALID_ARGUMENT     INVALID_INPUT
    │   └── RequestIdReusedError   INVALID_ARGUMENT     REQUEST_ID_REUSED    (same id, other inputs)
    ├── LaneFullError              RESOURCE_EXHAUSTED   LANE_FULL            (retry after pushback)
    ├── DeadlineUnmeetableError    DEADLINE_EXCEEDED    DEADLINE_UNMEETABLE
    ├── ExpiredInQueueError        DEADLINE_EXCEEDED    EXPIRED_IN_QUEUE
    ├── DrainingError              UNAVAILABLE          DRAINING             (retry elsewhere)
    ├── DeviceMemoryError          RESOURCE_EXHAUSTED   DEVICE_MEMORY        (one row too large)
    ├── AnswerTooLargeError        RESOURCE_EXHAUSTED   ANSWER_TOO_LARGE     (> max_message_bytes)
    ├── MemoryPressureError        RESOURCE_EXHAUSTED   MEMORY_PRESSURE      (retry after pushback)
    ├── JoinLimitError             RESOURCE_EXHAUSTED   JOIN_LIMIT           (retry once answered)
    ├── ModelNotFoundError         NOT_FOUND            MODEL_NOT_FOUND      (KServe: other model)
    ├── RegionNotFoundError        NOT_FOUND            REGION_NOT_FOUND     (KServe: shm region)
    ├── RegionExistsError          ALREADY_EXISTS       REGION_EXISTS        (KServe: shm register)
    ├── RegionLimitError           RESOURCE_EXHAUSTED   REGION_LIMIT         (KServe: shm register)
    ├── SharedMemoryRefusedError   PERMISSION_DENIED    SHARED_MEMORY_REFUSED (shm off/remote)
    ├── SettingsRefusedError       PERMISSION_DENIED    SETTINGS_REFUSED     (KServe: remote change)
    ├── TracingOffError            FAILED_PRECONDITION  TRACING_OFF          (KServe: trace setting)
    ├── UnsupportedError           UNIMPLEMENTED        UNSUPPORTED          (KServe: load, CUDA)
    └── EngineError                INTERNAL             ENGINE_FAILURE
        ├── ModelRunError          INTERNAL             ENGINE_FAILURE       (the model failed)
        ├── SessionBrokenError     INTERNAL             ENGINE_FAILURE       (the server stops)
        └── ServerFaultError       INTERNAL             ENGINE_FAILURE       (laneserve's own)

Servicers never choose status codes: they raise or receive one of these and hand it to
`to_rpc_status`. Foreign errors (from the runtime) are translated in the engine module.
Beside the tree, answering no request: EngineStartError, raised before serving (by the
engine and by providers, where the session runs).
"""

from __future__ import annotations

import math
from typing import ClassVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

ERROR_DOMAIN = "laneserve.dev"


class LaneserveError(Exception):
    """Base of every error laneserve answers a request with."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    reason: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        # A hint for the client: how long to wait before a retry can succeed.
        self.retry_after_s = retry_after_s
        # Facts a program reads, sent as ErrorInfo.metadata (`to_rpc_status`): "row", the
        # index in its request of a row that failed alone. Read from the message, a
        # client (laneserve-client's failed rows) hung on the engine's words.
        self.metadata: dict[str, str] = {}


class InvalidInputError(LaneserveError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_INPUT"


class RequestIdReusedError(InvalidInputError):
    """A request_id already used (in flight or recently completed) for different inputs:
    answering either request with the other's result would be wrong."""

    reason = "REQUEST_ID_REUSED"


class LaneFullError(LaneserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "LANE_FULL"


class DeadlineUnmeetableError(LaneserveError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_UNMEETABLE"


class ExpiredInQueueError(LaneserveError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "EXPIRED_IN_QUEUE"


class JoinExpiredError(ExpiredInQueueError):
    """A caller waiting for the request with its id in flight (a retry that joined it,
    or the first caller once a retry with a later deadline extended the request's) whose
    own deadline passed first: the same answer on the wire, but no entry was shed."""


class DrainingError(LaneserveError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "DRAINING"


class DeviceMemoryError(LaneserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "DEVICE_MEMORY"


class AnswerTooLargeError(LaneserveError):
    """The request ran, but its answer is over max_message_bytes: gRPC would refuse to
    send it (and fail a whole InferStream with it)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "ANSWER_TOO_LARGE"


class MemoryPressureError(LaneserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "MEMORY_PRESSURE"


class JoinLimitError(LaneserveError):
    """A retry that would join its request in flight, which enough callers wait on
    already: gRPC holds each waiting call's request message, which no lane counts."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "JOIN_LIMIT"


class ModelNotFoundError(LaneserveError):
    """A KServe v2 call that names a model (or version) other than the one served: this
    server has one model, and a client that meant another must hear so, not be answered
    by this one."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "MODEL_NOT_FOUND"


class RegionNotFoundError(LaneserveError):
    """A shared memory region asked for by a name not registered: its status, or a
    tensor placed in it (one unregistered while its request ran too)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "REGION_NOT_FOUND"


class RegionExistsError(LaneserveError):
    """A shared memory region registered under a name already registered."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "REGION_EXISTS"


class RegionLimitError(LaneserveError):
    """A shared memory region registered while the most a server holds are registered,
    or with no file left to open its object."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "REGION_LIMIT"


class SharedMemoryRefusedError(LaneserveError):
    """Shared memory asked for (a region registered, or a tensor placed in one) while
    server.shared_memory is false, or by a caller not on this host."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "SHARED_MEMORY_REFUSED"


class SettingsRefusedError(LaneserveError):
    """A change of the log or trace settings (Triton's LogSettings, TraceSetting) by a
    caller not on the server's host."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "SETTINGS_REFUSED"


class TracingOffError(LaneserveError):
    """A change of the trace settings where nothing traces: no exporter
    (OTEL_TRACES_EXPORTER), or a sampler laneserve did not build."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "TRACING_OFF"


class UnsupportedError(LaneserveError):
    """A method of Triton's protocol laneserve serves only to refuse, saying why (a model
    load or unload, a CUDA shared memory region)."""

    code = grpc.StatusCode.UNIMPLEMENTED
    reason = "UNSUPPORTED"


class EngineError(LaneserveError):
    code = grpc.StatusCode.INTERNAL
    reason = "ENGINE_FAILURE"


class ModelRunError(EngineError):
    """The runtime failed a run, not for want of memory (see
    `engine.translate_runtime_error`); `runtime_message` keeps its words apart from where
    the run failed."""

    def __init__(self, runtime_message: str) -> None:
        super().__init__(f"the model failed on this batch: {runtime_message}")
        self.runtime_message = runtime_message


class SessionBrokenError(EngineError):
    """The session failed an input it ran at start-up, after a batch failed: no request
    can run on it any more (a sticky CUDA error, a GPU off the bus). The engine answers
    that batch's failed rows with it; the scheduler thread, seeing it, fails for good and
    the server stops, so that health says NOT_SERVING and a supervisor restarts it.
    `cause` keeps the runtime's words apart from the request the message speaks of."""

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class ServerFaultError(EngineError):
    """A request failed by laneserve's own failure, not the model's: the scheduler thread
    failed (a bug, or a lost device whose memory readings fail: every live request is
    answered with it), or a batch failed outside the runtime. The same answer on the
    wire; the failure is logged once, at ERROR with its traceback, where it happened, so
    the event log does not count these requests among those the model failed on
    (`requests_failed`)."""


class EngineStartError(RuntimeError):
    """The model or the requested device cannot be used; raised before serving."""


# The most bytes of an error message sent: messages quote what the client sent (names,
# lanes, ids), and a status travels twice in the trailers (grpc-message, percent-encoded,
# and grpc-status-details-bin); past gRPC's 8 KiB metadata limit the client got
# RESOURCE_EXHAUSTED "received metadata size exceeds limit" instead of the error.
MAX_MESSAGE_BYTES = 1024


def bounded_message(message: str, max_bytes: int = MAX_MESSAGE_BYTES) -> str:
    """`message`, cut to at most about `max_bytes` of UTF-8, saying so if cut. Cut in the
    middle: a message names what was wrong first and what was expected last, and what
    makes one long is the client's value quoted between (cut at its end, a 1 KiB lane
    name left "unknown lane 'LLL..." and nothing of the lanes there are)."""
    encoded = message.encode()
    if len(encoded) <= max_bytes:
        return message
    marker = f" ... (message cut: {len(encoded)} bytes in all) ... "
    room = max(max_bytes - len(marker.encode()), 0)
    head = encoded[: room // 2].decode(errors="ignore")
    tail = encoded[len(encoded) - (room - room // 2) :].decode(errors="ignore")
    return f"{head}{marker}{tail}"


def pushback_ms(error: LaneserveError) -> int | None:
    """The `grpc-retry-pushback-ms` value for `error`, or None when no retry is advised:
    its hint rounded up to whole ms, at least 1. A hint says "not before": a full lane's
    promises to the callers it refused lapse at the latest time it advised (see
    `scheduler._Promises`), and a caller back before its time counts its own promise as
    another's. Rounded to the nearest ms, one told 1.33 ms was back after 1 and was told
    2.67. The hint is taken at whole ns first, as RetryInfo's is, so that float noise
    rounds no whole ms up (9 batches of 1 ms are 9.000000000000002 ms)."""
    if error.retry_after_s is None:
        return None
    return max(1, math.ceil(round(error.retry_after_s * 1000, 6)))


def to_rpc_status(
    error: LaneserveError, *, metadata: dict[str, str] | None = None
) -> status_pb2.Status:
    """`google.rpc.Status` for `error`, with `ErrorInfo` and, when retryable, `RetryInfo`."""
    info = error_details_pb2.ErrorInfo(
        reason=error.reason, domain=ERROR_DOMAIN, metadata={**error.metadata, **(metadata or {})}
    )
    details = [_pack(info)]
    if error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(round(error.retry_after_s * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(
        # grpc.StatusCode values are (number, name); the number is google.rpc.Code.
        code=error.code.value[0],
        message=bounded_message(error.message),
        details=details,
    )


def _pack(message: error_details_pb2.ErrorInfo | error_details_pb2.RetryInfo) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
