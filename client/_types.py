"""What the client hands back: the model's description and bulk-stream results.

Frozen dataclasses; ``__repr__`` never prints arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from laneserve.client._errors import LaneserveError
from laneserve.client.tensors import datatype_name, numpy_dtype
from laneserve.v1 import inference_pb2 as pb

__all__ = [
    "InferAnswer",
    "LaneInfo",
    "ModelInfo",
    "StreamRequest",
    "StreamResult",
    "TensorInfo",
    "Timing",
]

Arrays = Mapping[str, npt.NDArray[Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class Timing:
    """How the server served a request (its answer's `Timing`)."""

    lane: str  # the lane it ran in
    batch_size: int  # rows of the (last) batch that carried it, as it was formed
    queue_us: int  # from its admission to its first batch's dispatch
    infer_us: int  # the session's run of the batches that carried its rows, summed

    @classmethod
    def from_proto(cls, message: pb.Timing) -> Timing:
        return cls(message.lane, message.batch_size, message.queue_us, message.infer_us)


@dataclasses.dataclass(frozen=True, slots=True)
class InferAnswer:
    """`infer_detailed`'s answer: the outputs, and what a service logs beside them (the
    request's id, the server's timing). `infer` returns the outputs alone."""

    outputs: dict[str, npt.NDArray[Any]] = dataclasses.field(repr=False)
    request_id: str
    timing: Timing


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    # None: a data type this client does not know (a newer server's, say): it can
    # neither send nor read this tensor; `datatype` names it. ``object`` for a string
    # tensor (`datatype` "string"): sent from any array of text, answered as an object
    # array of str.
    dtype: np.dtype[Any] | None
    # None for a dynamic dimension; the first is the row (batch) axis.
    shape: tuple[int | None, ...]
    # The data type's name, whether or not this client knows it ("float32", "unknown
    # data type 13").
    datatype: str = ""
    # Per dimension, its symbolic name in the model (None: fixed or unnamed); inputs that
    # name a dimension alike (K in a[N, K] and b[N, K]) must agree on its size. Empty
    # from a server older than the field: the names are unknown, and nothing is checked.
    # Not compared: a spec written as TensorInfo(name, dtype, shape) still equals the
    # server's (the names came later, and a caller's own spec rarely has them).
    dim_names: tuple[str | None, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.datatype and self.dtype is not None:
            object.__setattr__(self, "datatype", datatype_name(self.dtype))


@dataclasses.dataclass(frozen=True, slots=True)
class LaneInfo:
    name: str
    priority: int  # 0 is the highest
    capacity_rows: int
    timeout_ms: int
    max_wait_ms: int
    min_share: float
    is_default: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model's signature and how the server schedules it."""

    model_path: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    batch_cap: int  # the largest batch (rows) the scheduler forms now
    max_batch_size: int
    lanes: tuple[LaneInfo, ...]
    providers: tuple[str, ...]
    # Requests one InferStream may have unanswered on the server (0: not reported).
    stream_window: int
    # The largest message the server receives or sends, in bytes (0: not reported).
    max_message_bytes: int = 0
    # Which model answers (GetModelResponse's fields; "" / None from a server older than
    # them). model_sha256: hex SHA-256 of the model file (and its external data files),
    # e.g. to check a rollout against `sha256sum model.onnx`; "" when the server could
    # not work it out.
    model_sha256: str = ""
    # The model's own metadata, as its author set it: None / "" / {} where it sets none.
    model_version: int | None = None
    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    # Left out of hash() (a dict has none; equality still compares it): a ModelInfo
    # stays hashable, as it was before the field.
    custom_metadata: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)
    # The laneserve release that serves ("" from a server older than the field).
    server_version: str = ""
    # Per input, in the model's order: (name, the shape of the rows the server's start-up
    # probe ran, after the row axis), e.g. (("input_ids", (512,)),). The server's memory
    # figures per row hold for such rows; dynamic sizes are its probe_shapes
    # (--probe-shape), else 1. Pairs, not a dict: a ModelInfo stays hashable. Empty from
    # a server older than the field.
    probe_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def default_lane(self) -> str:
        return next((lane.name for lane in self.lanes if lane.is_default), "")

    def input(self, name: str) -> TensorInfo:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(f"no input {name!r}; the model's inputs are {[s.name for s in self.inputs]}")

    @classmethod
    def from_proto(cls, message: pb.GetModelResponse) -> ModelInfo:
        def tensor(spec: pb.TensorSpec) -> TensorInfo:
            # A data type this client does not know leaves that tensor's dtype unknown,
            # not the whole description: its lanes and limits still serve the client.
            try:
                dtype: np.dtype[Any] | None = numpy_dtype(spec.dtype)
            except ValueError:
                dtype = None
            # One name per dimension, or none (a server older than dim_names); a list of
            # another length cannot say which dimension a name is for.
            names = tuple(name or None for name in spec.dim_names)
            return TensorInfo(
                spec.name,
                dtype,
                tuple(None if dim < 0 else int(dim) for dim in spec.shape),
                datatype_name(spec.dtype),
                names if len(names) == len(spec.shape) else (),
            )

        return cls(
            model_path=message.model_path,
            inputs=tuple(tensor(spec) for spec in message.inputs),
            outputs=tuple(tensor(spec) for spec in message.outputs),
            batch_cap=message.batch_cap,
            max_batch_size=message.max_batch_size,
            lanes=tuple(
                LaneInfo(
                    lane.name,
                    lane.priority,
                    lane.capacity_rows,
                    lane.timeout_ms,
                    lane.max_wait_ms,
                    lane.min_share,
                    lane.is_default,
                )
                for lane in message.lanes
            ),
            providers=tuple(message.providers),
            stream_window=message.stream_window,
            max_message_bytes=message.max_message_bytes,
            model_sha256=message.model_sha256,
            model_version=message.model_version if message.HasField("model_version") else None,
            producer_name=message.producer_name,
            graph_name=message.graph_name,
            domain=message.domain,
            description=message.description,
            custom_metadata=dict(message.custom_metadata),
            server_version=message.server_version,
            probe_shapes=tuple(
                (spec.name, tuple(message.probe_shapes[spec.name].dims))
                for spec in message.inputs
                if spec.name in message.probe_shapes
            ),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class StreamRequest:
    """One item of a bulk stream, when it needs its own request_id.

    A plain mapping of input name to array is an item too; its id is then
    ``f"{job_id}-{index}"``.
    """

    inputs: Arrays = dataclasses.field(repr=False)
    request_id: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class StreamResult:
    """The final answer to one item of a bulk stream: outputs, or an error."""

    index: int  # the item's position in the input, from 0
    request_id: str
    outputs: dict[str, npt.NDArray[Any]] | None = dataclasses.field(repr=False)
    error: LaneserveError | None
    # Sends that asked for an answer: 1, plus one per retry after a retryable error
    # answer (LANE_FULL, ...); 0 for an item never sent (refused by this client). A resend
    # after a broken call (a lost connection, a drain) is not one: it asks again for the
    # answer owed to the send before it, which the server joins or replays by request_id.
    attempts: int
    # The server's timing of an answered item (lane, batch rows, queue and run
    # microseconds); None for an item that failed.
    timing: Timing | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> dict[str, npt.NDArray[Any]]:
        """The outputs, or the item's error raised."""
        if self.error is not None:
            raise self.error
        assert self.outputs is not None
        return self.outputs
