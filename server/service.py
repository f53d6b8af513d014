"""The gRPC servicer: thin. It validates, hands work to the scheduler thread, and awaits.

Status codes come from the error types (`errors.py`); this module only carries them.
State on the event loop: the futures of waiting RPCs. Answers arrive from the scheduler
thread through `OutcomeRouter.deliver`, one loop callback per batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from laneserve.client.tensors import datatype_of
from laneserve.server.clock import Clock
from laneserve.server.codec import check_output_names, decode_inputs, encode_response
from laneserve.server.config import ServerConfig
from laneserve.server.engine import Engine, TensorSpec
from laneserve.server.errors import DrainingError, LaneserveError, pushback_ms, to_rpc_status
from laneserve.server.items import InferenceRequest, Outcome
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.scheduler_thread import SchedulerThread
from laneserve.server.stats import Percentiles, StatsRecorder
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

# Requests one stream may have admitted and unanswered at once; the stream is not read
# further until one of them is answered, so a fast producer cannot flood the lanes.
STREAM_WINDOW = 256
STREAM_DEFAULT_LANE = "bulk"


class OutcomeRouter:
    """Resolves each waiting RPC's future on its event loop, one callback per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def deliver(self, outcomes: Sequence[Outcome]) -> None:
        """Called from the scheduler thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(_resolve_all, outcomes)


def _resolve_all(outcomes: Sequence[Outcome]) -> None:
    for outcome in outcomes:
        future = outcome.token
        assert isinstance(future, asyncio.Future)
        if not future.done():  # a cancelled RPC has cancelled its future
            future.set_result(outcome)


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(
        self,
        config: ServerConfig,
        engine: Engine,
        scheduler: SchedulerThread,
        stats: StatsRecorder,
        state: Callable[[], Lifecycle],
        clock: Clock,
        started_s: float,
    ) -> None:
        self._config = config
        self._engine = engine
        self._scheduler = scheduler
        self._stats = stats
        self._state = state
        self._clock = clock
        self._started_s = started_s
        self._input_specs = engine.inputs
        self._output_names = [spec.name for spec in engine.outputs]

    async def Infer(
        self,
        request: pb.InferRequest,
        context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferResponse],
    ) -> pb.InferResponse:
        try:
            return await self._infer(request, context, self._config.default_lane)
        except LaneserveError as error:
            await abort_with(context, error)
            raise AssertionError("unreachable: abort raises") from error

    async def InferStream(
        self,
        request_iterator: AsyncIterator[pb.InferRequest],
        context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferStreamResponse],
    ) -> AsyncIterator[pb.InferStreamResponse]:
        default_lane = (
            STREAM_DEFAULT_LANE
            if any(lane.name == STREAM_DEFAULT_LANE for lane in self._config.lanes)
            else self._config.default_lane
        )
        answers: asyncio.Queue[pb.InferStreamResponse | None] = asyncio.Queue()
        window = asyncio.Semaphore(STREAM_WINDOW)
        items: set[asyncio.Task[None]] = set()

        async def answer(request: pb.InferRequest) -> None:
            try:
                response = await self._infer(request, context, default_lane)
                await answers.put(
                    pb.InferStreamResponse(request_id=request.request_id, response=response)
                )
            except LaneserveError as error:
                await answers.put(
                    pb.InferStreamResponse(
                        request_id=request.request_id, error=to_rpc_status(error)
                    )
                )
            finally:
                window.release()

        async def read_all() -> None:
            async for request in request_iterator:
                await window.acquire()
                task = asyncio.create_task(answer(request))
                items.add(task)
                task.add_done_callback(items.discard)
            if items:
                await asyncio.gather(*items)
            await answers.put(None)

        reader = asyncio.create_task(read_all())
        try:
            while (message := await answers.get()) is not None:
                yield message
            await reader  # re-raises a read failure
        finally:
            # The client went away or the stream failed: its queued items are cancelled.
            reader.cancel()
            for task in list(items):
                task.cancel()

    async def GetModel(
        self,
        request: pb.GetModelRequest,
        context: grpc.aio.ServicerContext[pb.GetModelRequest, pb.GetModelResponse],
    ) -> pb.GetModelResponse:
        return pb.GetModelResponse(
            model_path=self._config.model_path,
            inputs=[_tensor_spec(spec) for spec in self._engine.inputs],
            outputs=[_tensor_spec(spec) for spec in self._engine.outputs],
            batch_cap=self._scheduler.batch_cap,
            max_batch_size=self._config.max_batch_size,
            lanes=[
                pb.LaneSpec(
                    name=lane.name,
                    priority=priority,
                    capacity_rows=lane.capacity_rows,
                    timeout_ms=lane.timeout_ms,
                    max_wait_ms=lane.max_wait_ms,
                    min_share=lane.min_share,
                    is_default=lane.name == self._config.default_lane,
                )
                for priority, lane in enumerate(self._config.lanes)
            ],
            providers=self._engine.providers,
        )

    async def GetStats(
        self,
        request: pb.GetStatsRequest,
        context: grpc.aio.ServicerContext[pb.GetStatsRequest, pb.GetStatsResponse],
    ) -> pb.GetStatsResponse:
        snapshot = self._stats.snapshot()
        depths = {depth.name: depth for depth in self._scheduler.depths()}
        return pb.GetStatsResponse(
            lanes=[
                pb.LaneStats(
                    name=lane.name,
                    depth_rows=depths[lane.name].queued_rows,
                    depth_requests=depths[lane.name].queued_requests,
                    capacity_rows=depths[lane.name].capacity_rows,
                    admitted=lane.admitted,
                    completed=lane.completed,
                    failed=lane.failed,
                    rejected=lane.rejected,
                    shed=lane.shed,
                    queue_wait=_summary(lane.queue_wait),
                )
                for lane in snapshot.lanes
            ],
            batches=snapshot.batches,
            mean_batch_size=snapshot.mean_batch_size,
            run_time=_summary(snapshot.run_time),
            batch_cap=self._scheduler.batch_cap,
            rows_run=snapshot.rows_run,
            uptime_s=self._clock.monotonic() - self._started_s,
            state=self._state().value,
        )

    async def _infer(
        self,
        request: pb.InferRequest,
        context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferResponse]
        | grpc.aio.ServicerContext[pb.InferRequest, pb.InferStreamResponse],
        default_lane: str,
    ) -> pb.InferResponse:
        """Validates, queues and awaits one request; raises LaneserveError on refusal."""
        if self._state() is not Lifecycle.SERVING:
            raise DrainingError("server is draining; retry on another instance")
        inputs, rows, signature = decode_inputs(request.inputs, self._input_specs)
        output_names = check_output_names(request.output_names, self._output_names)
        deadline_s = _deadline_s(
            self._clock.monotonic(), context.time_remaining(), request.timeout_ms
        )
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        entry_id = self._scheduler.submit(
            InferenceRequest(
                request_id=request.request_id,
                lane=request.lane or default_lane,
                inputs=inputs,
                rows=rows,
                signature=signature,
                deadline_s=deadline_s,
                token=future,
            )
        )
        try:
            outcome = await future
        except asyncio.CancelledError:
            self._scheduler.cancel(entry_id)
            raise
        if outcome.error is not None:
            raise outcome.error
        assert outcome.outputs is not None
        assert outcome.timing is not None
        return encode_response(request.request_id, outcome.outputs, output_names, outcome.timing)


def _deadline_s(now_s: float, remaining_s: float | None, timeout_ms: int) -> float | None:
    """The request's own deadline on the scheduler's clock: gRPC's or timeout_ms, earliest."""
    candidates = []
    if remaining_s is not None:
        candidates.append(now_s + remaining_s)
    if timeout_ms > 0:
        candidates.append(now_s + timeout_ms / 1000)
    return min(candidates) if candidates else None


async def abort_with(
    context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferResponse], error: LaneserveError
) -> None:
    """Ends the RPC with `error`'s status, rich details and, if retryable, the pushback."""
    trailers: list[tuple[str, str | bytes]] = [
        ("grpc-status-details-bin", to_rpc_status(error).SerializeToString())
    ]
    delay_ms = pushback_ms(error)
    if delay_ms is not None:
        trailers.append(("grpc-retry-pushback-ms", str(delay_ms)))
    await context.abort(error.code, error.message, trailing_metadata=tuple(trailers))


def _tensor_spec(spec: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=spec.name, dtype=datatype_of(spec.dtype), shape=list(spec.shape))


def _summary(percentiles: Percentiles) -> pb.LatencySummary:
    return pb.LatencySummary(
        count=percentiles.count,
        p50_ms=percentiles.p50_ms,
        p95_ms=percentiles.p95_ms,
        p99_ms=percentiles.p99_ms,
    )
