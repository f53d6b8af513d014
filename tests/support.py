"""Helpers for the server tests: request building, a recording engine, a served server."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from laneserve.client.tensors import decode_tensor, encode_tensor
from laneserve.server import Engine, LaneServer, ServerConfig
from laneserve.server.items import Batch, BatchResult
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

F32 = npt.NDArray[np.float32]


def rows(count: int, *, seed: int = 0, start: int | None = None) -> F32:
    """`count` input rows for the demo models; with `start`, row i's first value is start+i
    (a tag that identifies the row in the engine's record of what ran)."""
    array = np.random.default_rng(seed).standard_normal((count, 512)).astype(np.float32)
    if start is not None:
        array[:, 0] = np.arange(start, start + count, dtype=np.float32)
    return array


def request(array: F32, **fields: Any) -> pb.InferRequest:
    return pb.InferRequest(inputs=[encode_tensor("input", array)], **fields)


def output(response: pb.InferResponse) -> F32:
    (tensor,) = response.outputs
    result: F32 = decode_tensor(tensor)
    return result


class RecordingEngine(Engine):
    """The real engine, which records the tagged rows it ran and can be held or broken.

    Fault injection only: outputs always come from the real session.
    """

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        super().__init__(model_path, **kwargs)
        self.ran_tags: list[int] = []
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)  # released once per batch that starts
        self.fail_when: Callable[[Batch], bool] = lambda _batch: False
        self._lock = threading.Lock()

    def run_batch(self, batch: Batch) -> BatchResult:
        self.entered.release()
        self.gate.wait()
        if self.fail_when(batch):
            raise RuntimeError("injected fault")
        result = super().run_batch(batch)
        with self._lock:
            self.batches.append(batch.rows)
            for part in batch.parts["input"]:
                self.ran_tags.extend(int(tag) for tag in part[:, 0])
        return result

    def hold(self) -> None:
        """The next batch blocks inside the engine (the session is busy) until release."""
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()


@dataclasses.dataclass
class Serving:
    server: LaneServer
    channel: grpc.aio.Channel
    stub: pb_grpc.InferenceServiceAsyncStub
    target: str


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    # The health stubs' types lack the RPC attributes; the call itself is plain.
    stub: Any = health_pb2_grpc.HealthStub(channel)
    response: health_pb2.HealthCheckResponse = await stub.Check(
        health_pb2.HealthCheckRequest(service=service)
    )
    return response.status


@contextlib.asynccontextmanager
async def serving(engine: Engine, config: ServerConfig) -> AsyncIterator[Serving]:
    """A started server on 127.0.0.1:0 and a channel to it; always stopped afterwards."""
    server = LaneServer(engine, dataclasses.replace(config, host="127.0.0.1", port=0))
    port = await server.start()
    target = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            yield Serving(server, channel, pb_grpc.InferenceServiceStub(channel), target)
    finally:
        engine_gate = getattr(engine, "gate", None)
        if engine_gate is not None:
            engine_gate.set()
        await server.stop(grace_s=5.0)


def rich_status(error: grpc.aio.AioRpcError) -> tuple[str, dict[str, Any]]:
    """The ErrorInfo reason and the other details of a failed call."""
    found: dict[str, Any] = {}
    reason = ""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            assert isinstance(value, bytes)
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                retry = error_details_pb2.RetryInfo()
                if detail.Unpack(info):
                    reason = info.reason
                elif detail.Unpack(retry):
                    found["retry_delay_s"] = retry.retry_delay.ToTimedelta().total_seconds()
        elif key == "grpc-retry-pushback-ms":
            found["pushback_ms"] = int(value)
    return reason, found
