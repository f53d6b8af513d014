"""The laneserve client: typed access to a laneserve server over gRPC.

    from laneserve.client import Client

    with Client("127.0.0.1:50051") as client:
        scores = client.infer({"input": rows}, lane="interactive", timeout=0.5)["output"]

`Client` blocks; `AsyncClient` is the same for asyncio. Both send numpy arrays and return
numpy arrays, raise the typed errors below (never a bare ``grpc.RpcError``), retry what
is retryable with the same request_id within the call's timeout (`RetryPolicy`; overload
refusals within the client's `RetryBudget` too), and run bulk jobs over the bidirectional
stream with `stream()`.
`set_testing(True)` removes the backoff sleeps in tests.

Errors (each carries the server's message, ``reason``, ``code`` and ``retry_after_s``)::

    LaneserveError
    ├── InvalidInputError (also a ValueError)
    │   └── RequestIdReusedError
    ├── ResourceExhaustedError
    │   ├── LaneFullError                retryable
    │   ├── MemoryPressureError          retryable
    │   ├── JoinLimitError               retryable
    │   ├── DeviceMemoryError
    │   ├── AnswerTooLargeError
    │   └── ServerBusyError              retryable (gRPC's call limit)
    ├── DeadlineExceededError
    │   ├── DeadlineUnmeetableError
    │   └── ExpiredInQueueError
    ├── UnavailableError                 retryable
    │   └── ServerDrainingError          retryable
    ├── EngineError
    ├── UnreadableAnswerError            (an answer this client could not read: the server's fault)
    ├── CallCancelledError               retryable (cut off, or refused unread)
    └── ClientClosedError                (the client was closed)

`Client(..., timeout=s)` / `AsyncClient(..., timeout=s)` is the timeout of every unary
call made without one. The type aliases a typed caller needs are here too:
`MetadataLike`, `TlsLike`, `Outputs` (`infer`'s answer), `StreamSource` and `StreamItem`
(`stream()`'s requests).

The wire codec (numpy arrays to and from ``laneserve.v1.Tensor``) lives in
:mod:`laneserve.client.tensors` and is shared with the server.
"""

from laneserve.client._aio import AsyncClient, MetadataLike, Outputs, TlsLike
from laneserve.client._channel import DEFAULT_TARGET, TlsConfig
from laneserve.client._errors import (
    AnswerTooLargeError,
    CallCancelledError,
    ClientClosedError,
    DeadlineExceededError,
    DeadlineUnmeetableError,
    DeviceMemoryError,
    EngineError,
    ExpiredInQueueError,
    InvalidInputError,
    JoinLimitError,
    LaneFullError,
    LaneserveError,
    MemoryPressureError,
    RequestIdReusedError,
    ResourceExhaustedError,
    ServerBusyError,
    ServerDrainingError,
    UnavailableError,
    UnreadableAnswerError,
    error_from_rpc,
    error_from_status,
)
from laneserve.client._retry import NO_RETRIES, RetryBudget, RetryPolicy, is_testing, set_testing
from laneserve.client._stream import StreamItem, StreamSource, row_chunks
from laneserve.client._sync import Client
from laneserve.client._types import (
    InferAnswer,
    LaneInfo,
    ModelInfo,
    StreamRequest,
    StreamResult,
    TensorInfo,
    Timing,
)
from laneserve.client.tensors import (
    DataType,
    datatype_for_onnx_type,
    datatype_name,
    datatype_of,
    decode_tensor,
    encode_tensor,
    numpy_dtype,
    numpy_dtype_for_onnx_type,
    onnx_type,
)

__all__ = [
    "DEFAULT_TARGET",
    "NO_RETRIES",
    "AnswerTooLargeError",
    "AsyncClient",
    "CallCancelledError",
    "Client",
    "ClientClosedError",
    "DataType",
    "DeadlineExceededError",
    "DeadlineUnmeetableError",
    "DeviceMemoryError",
    "EngineError",
    "ExpiredInQueueError",
    "InferAnswer",
    "InvalidInputError",
    "JoinLimitError",
    "LaneFullError",
    "LaneInfo",
    "LaneserveError",
    "MemoryPressureError",
    "MetadataLike",
    "ModelInfo",
    "Outputs",
    "RequestIdReusedError",
    "ResourceExhaustedError",
    "RetryBudget",
    "RetryPolicy",
    "ServerBusyError",
    "ServerDrainingError",
    "StreamItem",
    "StreamRequest",
    "StreamResult",
    "StreamSource",
    "TensorInfo",
    "Timing",
    "TlsConfig",
    "TlsLike",
    "UnavailableError",
    "UnreadableAnswerError",
    "datatype_for_onnx_type",
    "datatype_name",
    "datatype_of",
    "decode_tensor",
    "encode_tensor",
    "error_from_rpc",
    "error_from_status",
    "is_testing",
    "numpy_dtype",
    "numpy_dtype_for_onnx_type",
    "onnx_type",
    "row_chunks",
    "set_testing",
]
