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

__all__ = ["LaneInfo", "ModelInfo", "StreamRequest", "StreamResult", "TensorInfo"]

Arrays = Mapping[str, npt.NDArray[Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    # None: a data type this client does not know (a newer server's, say): it can
    # neither send nor read this tensor; `datatype` names it.
    dtype: np.dtype[Any] | None
    # None for a dynamic dimension; the first is the row (batch) axis.
    shape: tuple[int | None, ...]
    # The data type's name, whether or not this client knows it ("float32", "unknown
    # data type 13").
    datatype: str = ""

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
            return TensorInfo(
                spec.name,
                dtype,
                tuple(None if dim < 0 else int(dim) for dim in spec.shape),
                datatype_name(spec.dtype),
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
    attempts: int  # times the item was sent, 1 when no retry was needed

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> dict[str, npt.NDArray[Any]]:
        """The outputs, or the item's error raised."""
        if self.error is not None:
            raise self.error
        assert self.outputs is not None
        return self.outputs
