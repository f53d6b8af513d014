"""The gRPC servicer: it validates, hands work to the scheduler thread, and awaits.

Status codes come from the error types (`errors.py`); this module only carries them.
State on the event loop: the futures of waiting RPCs. Answers arrive from the scheduler
thread through `OutcomeRouter.deliver`, one loop callback per batch.

Here: one request's path (`_infer`: read, lane, ledger, admission, the wait for room,
the answer) and the stream mechanism that runs it per item (`serve_stream`). Beside it:
grpc_methods (each request read from its bytes within bounds, the methods registered,
refusals ended with rich status), streams (the parts of a stream: credit window, answer
order, room, receive limit, a front end's items and answers), stats_messages
(GetModel's and GetStats' fields), text_thread (long text off the event loop).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from laneserve.server.clock import Clock
from laneserve.server.codec import (
    DecodedInputs,
    check_counts,
    check_output_names,
    decode_inputs,
    encode_response,
    leading_rows,
)
from laneserve.server.config import LaneConfig, ServerConfig
from laneserve.server.engine import Engine, TensorSpec
from laneserve.server.errors import (
    AnswerTooLargeError,
    DeadlineUnmeetableError,
    DrainingError,
    EngineError,
    ExpiredInQueueError,
    InvalidInputError,
    JoinExpiredError,
    JoinLimitError,
    LaneFullError,
    LaneserveError,
    MemoryPressureError,
    RequestIdReusedError,
)
from laneserve.server.events import (
    NULL_TRACE,
    NullEvents,
    NullTracer,
    RequestTrace,
    RequestTracer,
    SchedulerEvents,
)
from laneserve.server.grpc_calls import GrpcCalls
from laneserve.server.grpc_methods import (
    UNDECODABLE_GET_MODEL,
    UNDECODABLE_GET_STATS,
    UNDECODABLE_REQUEST,
    OversizedOperatorRequest,
    OversizedRequest,
    abort_with,
    id_too_long,
    operator_request_too_large,
    oversized,
    release_frames,
    request_id_too_long,
    undecodable,
)
from laneserve.server.idempotency import (
    Admitted,
    Caller,
    Finish,
    LedgerCounts,
    ReplayCache,
    RequestLedger,
    Resolve,
    fingerprint,
)
from laneserve.server.items import InferenceRequest, Outcome
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.log_events import event_extra
from laneserve.server.memory import MemoryFacts, format_bytes
from laneserve.server.model_identity import SERVER_VERSION
from laneserve.server.scheduler import MEMORY_PRESSURE_RETRY_S, caller_end_status
from laneserve.server.scheduler_thread import SchedulerThread
from laneserve.server.stats import StatsRecorder
from laneserve.server.stats_messages import (
    grpc_calls_message,
    identity_fields,
    latency_summary,
    memory_fields,
    size_summary,
    tensor_spec,
    watermark_fields,
)
from laneserve.server.streams import (
    INFER_STREAM_WIRE,
    RECEIVE_LIMIT_KEY,
    AnswerOrder,
    ItemTag,
    ReceiveLimit,
    RoomWaiter,
    StreamFrontEnd,
    StreamRoom,
    StreamWindow,
    parse_receive_limit,
    stream_default_lane,
    stream_item_bytes,
)
from laneserve.server.text_thread import (
    DECODE,
    EVENT_LOOP_HASH_BYTES,
    ReadInputs,
    TextThread,
    encoded_off_loop,
    read_off_loop,
)
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _Unread:
    """`_read_inputs`' answer for a new request read off the event loop: its inputs are
    left for `TextThread` to decode and hash, as `kind` (`read_off_loop`'s) says."""

    kind: str


# A stream's items, their tags and answers (`streams.StreamFrontEnd`).
_Item = TypeVar("_Item")
_Answer = TypeVar("_Answer", bound=Message)
_Tag = TypeVar("_Tag", bound=ItemTag)


# How often the oldest stream item waiting for room in its full lane looks again: the
# lane's predicted drain time, within these bounds (the others sleep: `RoomWaiter`).
ROOM_POLL_MIN_S = 0.001
ROOM_POLL_MAX_S = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class _OnStream:
    """What `_infer` knows of the stream a request came on (None: a unary call)."""

    room: StreamRoom  # the stream's items waiting for room in a full lane
    receive_limit: ReceiveLimit | None  # None: the caller reads what the server sends


class OutcomeRouter:
    """Hands each Outcome to its request's `Resolve` (its token) on the event loop, one
    loop callback per batch; a batch with an answer of more than EVENT_LOOP_TEXT_ELEMENTS
    strings through `text` first, which encodes those answers off the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, text: TextThread | None = None) -> None:
        self._loop = loop
        self._text = text

    def deliver(self, outcomes: Sequence[Outcome]) -> None:
        """Called from the scheduler thread."""
        if (
            self._text is not None
            and any(map(encoded_off_loop, outcomes))
            and self._text.encode_then(outcomes, self._resolve)
        ):
            return
        self._resolve(outcomes)

    def _resolve(self, outcomes: Sequence[Outcome]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(_resolve_all, outcomes)


def _resolve_all(outcomes: Sequence[Outcome]) -> None:
    for outcome in outcomes:
        resolve = outcome.token
        assert callable(resolve)
        resolve(outcome)  # never raises: the ledger answers its waiters on every path


@dataclasses.dataclass(frozen=True, slots=True)
class ServiceTelemetry:
    """Where the servicer reports: each admitted request's end (`events`, the scheduler's
    sinks), its spans (`tracer`), and the GPU's utilisation for GetStats (None: no GPU)."""

    events: SchedulerEvents = dataclasses.field(default_factory=NullEvents)
    tracer: RequestTracer = dataclasses.field(default_factory=NullTracer)
    device_utilization: Callable[[], float | None] = lambda: None
    # gRPC's own call counts (Channelz); None until the server runs, or when unknown.
    grpc_calls: Callable[[], GrpcCalls | None] = lambda: None


class _Taken:
    """What the ledger tells one call of the answer it takes (see `Caller`), acted on once
    the answer has reached the call. Only the event loop touches it."""

    __slots__ = ("_lane", "_request_id", "_tracer", "counted_bytes", "reply")

    def __init__(self, tracer: RequestTracer, request_id: str, lane: str) -> None:
        self._tracer = tracer
        self._request_id = request_id
        self._lane = lane
        # The answer's size, when this call's refusal of it is counted already, as the
        # status of the request it submitted or joined (`Caller.counted`); None: it is not.
        self.counted_bytes: int | None = None
        # The trace of the answer this call takes when it joins a request in flight
        # (`RequestTracer.joined`); the spans of work the call queued are not in it.
        self.reply: RequestTrace = NULL_TRACE

    def joined(self) -> None:
        """The ledger let this call join the request in flight (past its bound, it raised
        JoinLimitError instead): a retry, and the trace of the answer it takes."""
        self._tracer.retried(self._request_id, self._lane, "join")
        self.reply = self._tracer.joined(self._request_id, self._lane)

    def counted(self, size_bytes: int) -> None:
        self.counted_bytes = size_bytes

    def replied(self, context: grpc.aio.ServicerContext[Any, Any], status: str) -> None:
        """Ends a joined call's `reply` with what it got: `status`, or DEADLINE_EXCEEDED
        once its gRPC deadline has passed (gRPC ends the call so, whatever it is handed).
        Nothing for any other call: its gRPC deadline is not read on every answer."""
        if self.reply is not NULL_TRACE:
            self.reply.end(status if _before_grpc_deadline(context) else "DEADLINE_EXCEEDED")


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    # Built in one place (LaneServer.start), from what the server assembled.
    def __init__(  # noqa: PLR0913, PLR0917
        self,
        config: ServerConfig,
        engine: Engine,
        scheduler: SchedulerThread,
        stats: StatsRecorder,
        state: Callable[[], Lifecycle],
        clock: Clock,
        started_s: float,
        memory: MemoryFacts | None = None,
        telemetry: ServiceTelemetry | None = None,
        instance_id: str | None = None,
        *,
        text: TextThread,
    ) -> None:
        """`instance_id`: GetStats' (a new one by default); the server gives its
        telemetry's, so that Prometheus' target_info names the same instance. `text`: the
        thread that decodes long text, the server's (its OutcomeRouter encodes answers on
        it; the server drains and closes it)."""
        self._memory = memory
        self._telemetry = telemetry or ServiceTelemetry()
        self._events = self._telemetry.events
        self._tracer = self._telemetry.tracer
        self._config = config
        self._lane_configs = {lane.name: lane for lane in config.lanes}
        self._engine = engine
        self._scheduler = scheduler
        self._stats = stats
        self._state = state
        self._clock = clock
        self._started_s = started_s
        self._instance_id = instance_id or uuid.uuid4().hex  # GetStats: which server answered
        self._input_specs = engine.inputs
        self._output_names = [spec.name for spec in engine.outputs]
        # The most another front end's answer adds to its InferResponse
        # (`widen_answer_envelope`); 0: none does.
        self._answer_extra_bytes = 0
        # The item readers of the open stream calls (see `stop_reading_streams`).
        self._stream_readers: set[asyncio.Task[None]] = set()
        # Per lane, the stream items waiting for room in it, oldest first; per key in the
        # ledger (`_infer`'s ledger_id), the same items again, for the call with their id
        # that wakes them (see `_wait_for_room`). Each waiter keyed by an id is in both,
        # or neither; one keyed by none ("") is in its lane's line alone: no call wakes it.
        self._room_lines: collections.defaultdict[str, collections.deque[RoomWaiter]]
        self._room_lines = collections.defaultdict(collections.deque)
        self._room_waiters: dict[str, list[RoomWaiter]] = {}
        self._text = text
        self._ledger = RequestLedger(
            ReplayCache(
                max_entries=config.idempotency_max_entries,
                max_bytes=config.idempotency_max_bytes,
                ttl_s=config.idempotency_ttl_s,
                clock=clock,
            ),
            clock,
        )

    async def Infer(
        self,
        request: pb.InferRequest | OversizedRequest,
        context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferResponse],
    ) -> pb.InferResponse:
        read: pb.InferRequest | None = None
        try:
            read = self._read(request)
            return await self._infer(
                read, context, self._config.default_lane, ledger_id=read.request_id
            )
        except LaneserveError as error:
            refusal = error
        # Nothing of the request stays reachable from the abort (see `abort_with`): not
        # `read` either, the same message (it kept 55 MB per refused 54 MiB call, until a
        # full collection).
        del request, read
        await abort_with(context, release_frames(refusal))
        raise AssertionError("unreachable: abort raises")

    async def run_request(
        self,
        request: pb.InferRequest | LaneserveError,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        idempotent: bool,
        lane: str = "",
    ) -> pb.InferResponse:
        """Infer's path for a request another front end converted to laneserve's own
        (KServe v2's ModelInfer, `kserve.py`): the same admission, lanes, deadlines,
        idempotency, shedding, tracing, stats and errors, the default lane Infer's.
        `request` is the conversion's refusal where it failed: counted as Infer counts a
        request refused before it has a lane (in the default lane), or as a refusal of
        `lane` where the conversion read one of the server's, then raised. Raises
        LaneserveError.

        `idempotent`: whether its request_id keys the ledger, as Infer's does (a retry
        joins or replays it, other inputs are refused REQUEST_ID_REUSED). False: the id
        only names it (echoed, quoted in errors, traced and logged, held to
        MAX_REQUEST_ID_BYTES), as a client that sends ids as correlation tags expects:
        Triton's perf_analyzer restarts its ids each run, with the same data."""
        if isinstance(request, LaneserveError) and lane in self._lane_configs:
            # As `_run` counts one; its id was in what the conversion refused.
            raise self._rejected(lane, request, arrived_s=None, request_id=None)
        return await self._run(request, context, self._config.default_lane, idempotent=idempotent)

    async def _run(
        self,
        request: pb.InferRequest | LaneserveError,
        context: grpc.aio.ServicerContext[Any, Any],
        default_lane: str,
        stream: _OnStream | None = None,
        *,
        idempotent: bool,
    ) -> pb.InferResponse:
        """`_infer`, for a request a front end converted (`request`: the conversion's
        refusal where it failed, counted and raised as `run_request` says)."""
        if isinstance(request, LaneserveError):
            # Refused as it reaches the servicer, before `_infer` reads its arrival: it
            # waited nothing here (its conversion is the front end's, as a request's
            # decoding before that arrival is).
            raise self._rejected_without_lane(request, arrived_s=None, request_id=None)
        ledger_id = request.request_id if idempotent else ""
        return await self._infer(request, context, default_lane, stream, ledger_id=ledger_id)

    def widen_answer_envelope(self, extra_bytes: int) -> None:
        """Another front end sends each answer in a message up to `extra_bytes` larger
        than its InferResponse (KServe's ModelInferResponse, or a ModelStreamInferResponse
        wrapping it: `kserve_convert.answer_extra_bytes`, `kserve_convert.stream_wrapper_bytes`):
        `_check_sendable` holds every answer to the largest. Called as the server is
        made, before it serves: an answer sent before would not have been held to it."""
        self._answer_extra_bytes = max(self._answer_extra_bytes, extra_bytes)

    def InferStream(
        self,
        request_iterator: AsyncIterator[pb.InferRequest | OversizedRequest],
        context: grpc.aio.ServicerContext[pb.InferRequest, pb.InferStreamResponse],
    ) -> AsyncIterator[pb.InferStreamResponse]:
        """Answers each request as it completes, out of order, tagged with its request_id
        (those without one in their order: `AnswerOrder`): the one stream mechanism
        (`serve_stream`), read and written as laneserve.v1's."""
        return self.serve_stream(request_iterator, context, INFER_STREAM_WIRE)

    async def serve_stream(
        self,
        items: AsyncIterator[_Item],
        context: grpc.aio.ServicerContext[Any, Any],
        wire: StreamFrontEnd[_Item, _Tag, _Answer],
    ) -> AsyncIterator[_Answer]:
        """Every front end's stream (InferStream, KServe's ModelStreamInfer): answers each
        item as it completes, out of order, tagged with its id; an item whose answer
        carries no id is answered once every such item read before it is, in their order
        (`AnswerOrder`); `wire` reads the front end's items and writes its answers
        (`StreamFrontEnd`), the rest is this.

        Credit window (`StreamWindow`): an item is read only while fewer than
        `stream_window` of this stream's items are read and unanswered, and while its
        answers finished and not yet written hold under `stream_answer_buffer_bytes`; a
        credit comes back only once the answer is written. So a fast producer holds at
        most that many items in the lanes and in the answer queue, a slow reader that many
        bytes of answers and those of the items it had read (the bound: `StreamWindow`),
        and the rest waits in gRPC's flow control. An item that finds its lane full waits
        for room, and the stream reads no more meanwhile (see `StreamRoom`): the window
        counts items, not rows. A failed item is answered with its error and the stream
        goes on. When the stream ends early (the client cancelled, the connection
        dropped) its queued items are cancelled. When the server drains, the stream reads
        no more items, answers those it read and ends UNAVAILABLE (DRAINING): its client
        resends the rest on a new call, to another instance or this one restarted (see
        `stop_reading_streams`).
        """
        if self._state() is not Lifecycle.SERVING:
            await abort_with(context, _stream_draining())
        limit_bytes = await self._receive_limit(context)
        error_limit = limit_bytes or self._config.max_message_bytes
        on_stream = _OnStream(
            StreamRoom(),
            None
            if limit_bytes is None
            else ReceiveLimit(limit_bytes, wire.envelope_bytes(limit_bytes)),
        )
        room = on_stream.room
        default_lane = stream_default_lane(self._config)
        window = StreamWindow(self._config.stream_window, self._config.stream_answer_buffer_bytes)
        # Every item read puts exactly one answer here (through `order`), with its bytes
        # (`window.finished`); `_READ_DONE` follows the last read.
        answers: asyncio.Queue[tuple[_Answer, int] | object] = asyncio.Queue()
        order: AnswerOrder[tuple[_Answer, int]] = AnswerOrder(answers.put_nowait)
        running: set[asyncio.Task[None]] = set()

        async def answer(item: _Item, turn: int | None) -> None:
            message = await self._stream_answer(
                item, wire, context, default_lane, on_stream, error_limit
            )
            order.finished(turn, (message, window.finished(wire.held_bytes(message))))

        async def read_all() -> None:
            while True:
                # Both hold as it reads: either may have changed while it waited on the other.
                while not (window.open.is_set() and room.empty.is_set()):
                    await window.open.wait()
                    await room.empty.wait()
                try:
                    item = await anext(items)
                except StopAsyncIteration:
                    return
                window.read(wire.item_bytes(item) if window.sizing_by_items else 0)
                # Its turn is its place in the order items are read: taken here.
                task = asyncio.create_task(answer(item, order.read(wire.item_id(item))))
                running.add(task)
                task.add_done_callback(running.discard)

        reader = asyncio.create_task(read_all())
        # From a done callback, not the coroutine's `finally`: a reader cancelled before
        # its first step (a drain in the same turn the stream opened) never runs its body.
        reader.add_done_callback(lambda _reader: answers.put_nowait(_READ_DONE))
        self._stream_readers.add(reader)
        try:
            reading = True
            while reading or window.unanswered:
                queued = await answers.get()
                if queued is _READ_DONE:
                    reading = False
                    continue
                assert isinstance(queued, tuple)
                message, size = queued
                yield message  # returns once gRPC has taken it: a slow reader holds it here
                window.written(size)
            if reader.cancelled():  # only stop_reading_streams cancels it before this
                await abort_with(context, _stream_draining())
            await reader  # re-raises a read failure
        finally:
            self._stream_readers.discard(reader)
            # The client went away or the stream failed: its queued items are cancelled.
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def _receive_limit(self, context: grpc.aio.ServicerContext[Any, Any]) -> int | None:
        """The stream caller's receive limit where it is below the server's (None: none);
        the call is refused when it sent one that is not a limit."""
        try:
            return parse_receive_limit(context.invocation_metadata(), self._config)
        except InvalidInputError as error:
            await abort_with(context, error)
            raise AssertionError("unreachable: abort raises") from error

    def stop_reading_streams(self) -> None:
        """The server drains: every open stream stops reading items now. Without
        this a stream stayed open until the server stopped, each further item refused
        DRAINING on a call that leads nowhere; a client retrying items on that call ran
        out of attempts instead of reconnecting. An item gRPC had received but the reader
        had not yet taken is not read: unanswered, its client resends it. An item waiting
        for room is woken: it leaves its line, answered DRAINING (`_run_when_room`)."""
        for reader in self._stream_readers:
            reader.cancel()
        for line in self._room_lines.values():
            for waiter in line:
                waiter.wake()

    @property
    def input_specs(self) -> Sequence[TensorSpec]:
        return self._input_specs

    @property
    def output_names(self) -> Sequence[str]:
        return self._output_names

    def ledger_counts(self) -> LedgerCounts:
        """The idempotency ledger's joins, replays and replay cache, for the metrics: safe
        from the metric reader's thread (`RequestLedger.counts`)."""
        return self._ledger.counts()

    def close(self) -> None:
        """The server stopped: the ledger's sweep timer goes (`RequestLedger.close`)."""
        self._ledger.close()

    async def _stream_answer(
        self,
        item: _Item,
        wire: StreamFrontEnd[_Item, _Tag, _Answer],
        context: grpc.aio.ServicerContext[Any, Any],
        default_lane: str,
        on_stream: _OnStream,
        error_limit: int,
    ) -> _Answer:
        """One stream item's answer: its response, or its error (the stream goes on),
        within the caller's receive limit (`on_stream`) and `error_limit` (the smaller of
        it and the server's)."""
        # Read before `convert` lets go of the item; outside the `try`, as `tag` never
        # raises (it reads fields only): every answer below needs it.
        tag = wire.tag(item)
        try:
            request = wire.convert(item)
            response = await self._run(
                request, context, default_lane, on_stream, idempotent=tag.idempotent
            )
            message = wire.answer(tag, response)
        except LaneserveError as error:
            message = wire.error(tag, error, error_limit)
            # Its traceback's frames held the item's request and inputs, in a cycle with
            # the ledger's waiter future that raised it (see `abort_with`).
            release_frames(error)
        except Exception as error:  # every item read gets one answer, even on a bug
            log.exception(
                "stream item %r failed unexpectedly",
                tag.item_id,
                extra=event_extra("stream_item_failed", request_id=tag.item_id),
            )
            message = wire.error(tag, EngineError(f"internal error: {error!r}"), error_limit)
        return message

    def _answer(
        self, request_id: str, outcome: Outcome, output_names: list[str]
    ) -> tuple[pb.InferResponse, int]:
        """The response for `outcome` and its size as a stream item, or its error raised."""
        if outcome.error is not None:
            raise outcome.error
        assert outcome.outputs is not None
        assert outcome.timing is not None
        response = encode_response(
            request_id, outcome.outputs, output_names, outcome.timing, outcome.text_data
        )
        return response, self._check_sendable(response)

    def _check_sendable(self, response: pb.InferResponse) -> int:
        """gRPC refuses to send a message over max_message_bytes (and fails a whole
        stream with it): such an answer is this error instead, counted and traced
        as one. Measured in the largest envelope of the front ends, an InferStream item
        or KServe's (a ModelInferResponse, alone or in a ModelStreamInferResponse: at
        most `_answer_extra_bytes` more than the response):
        the same request gets the same answer whichever call carries it, a retry joining
        it or replaying it included. Returns its size as an InferStream item (sizing a
        message costs as much as encoding it: sized once)."""
        response_bytes = response.ByteSize()
        size = stream_item_bytes(response, response_bytes)
        largest = max(size, response_bytes + self._answer_extra_bytes)
        limit = self._config.max_message_bytes
        if largest > limit:
            raise AnswerTooLargeError(
                f"the answer to request {response.request_id!r} is up to {largest} bytes as "
                f"sent (an InferStream item or KServe's answer, the larger), over the "
                f"server's max_message_bytes ({limit}); expected fewer rows per request"
            )
        return size

    def _check_receivable(
        self,
        response: pb.InferResponse,
        limit: ReceiveLimit | None,
        counted_size: int | None,
        lane: str,
        arrived_s: float,
    ) -> None:
        """Refuses `response` to a caller that reads at most `limit` (its
        RECEIVE_LIMIT_KEY; None: what the server sends, nothing to check): sent, gRPC
        would end its whole call. To this caller alone: the
        answer is kept for replay, so a retry that reads more gets it without running it
        again. `counted_size`: its size, where the refusal is counted already, as the
        status of the request this call submitted or joined (no caller taking the answer
        read it, and the ledger chose this call's refusal for it: `Caller.counted`);
        None: it is counted here as a refusal of `lane` (any other caller refused), with
        its wait from `arrived_s`."""
        if limit is None:
            return
        counted = counted_size is not None
        size = stream_item_bytes(response) if counted_size is None else counted_size
        if size <= limit.item_bytes:
            return
        # Sized as an InferStream item; in a larger envelope, at most that much larger.
        sent = f"up to {size + limit.envelope_bytes}" if limit.envelope_bytes else f"{size}"
        error = AnswerTooLargeError(
            f"the answer to request {response.request_id!r} is {sent} bytes, over the "
            f"largest message this caller reads ({limit.limit_bytes} bytes, its "
            f"{RECEIVE_LIMIT_KEY}); expected fewer rows per request, or a larger receive limit"
        )
        raise (
            error
            if counted
            else self._rejected(lane, error, arrived_s=arrived_s, request_id=response.request_id)
        )

    async def GetModel(
        self,
        request: pb.GetModelRequest | OversizedOperatorRequest,
        context: grpc.aio.ServicerContext[pb.GetModelRequest, pb.GetModelResponse],
    ) -> pb.GetModelResponse:
        if isinstance(request, OversizedOperatorRequest):
            await abort_with(context, operator_request_too_large(request))
        if request is UNDECODABLE_GET_MODEL:
            await abort_with(context, undecodable(request))
        return pb.GetModelResponse(
            model_path=self._config.model_path,
            inputs=[tensor_spec(spec) for spec in self._engine.inputs],
            outputs=[tensor_spec(spec) for spec in self._engine.outputs],
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
            stream_window=self._config.stream_window,
            max_message_bytes=self._config.max_message_bytes,
            server_version=SERVER_VERSION,
            **identity_fields(self._engine.identity),
            **memory_fields(self._memory),
            # The rows the per-row bytes were measured on: a row's bytes depend on its
            # dynamic sizes, which the probe ran at 1 unless probe_shapes gave them.
            probe_shapes={
                name: pb.RowShape(dims=shape) for name, shape in self._engine.probe_shapes.items()
            },
        )

    async def GetStats(
        self,
        request: pb.GetStatsRequest | OversizedOperatorRequest,
        context: grpc.aio.ServicerContext[pb.GetStatsRequest, pb.GetStatsResponse],
    ) -> pb.GetStatsResponse:
        if isinstance(request, OversizedOperatorRequest):
            await abort_with(context, operator_request_too_large(request))
        if request is UNDECODABLE_GET_STATS:
            await abort_with(context, undecodable(request))
        snapshot = self._stats.snapshot()
        depths = {depth.name: depth for depth in self._scheduler.depths()}
        self._ledger.replay.drop_expired()  # reported neither held nor counted (README)
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
                    queue_wait=latency_summary(lane.queue_wait),
                    request_duration=latency_summary(lane.request_duration),
                    answered=lane.answered,
                    late=lane.late,
                )
                for lane in snapshot.lanes
            ],
            batches=snapshot.batches,
            mean_batch_size=snapshot.mean_batch_size,
            run_time=latency_summary(snapshot.run_time),
            batch_cap=self._scheduler.batch_cap,
            rows_run=snapshot.rows_run,
            uptime_s=self._clock.monotonic() - self._started_s,
            state=self._state().value,
            instance_id=self._instance_id,
            batch_size=size_summary(snapshot.batch_size),
            batch_reasons=snapshot.batch_reasons,
            device_utilization=self._telemetry.device_utilization(),
            grpc_calls=grpc_calls_message(self._telemetry.grpc_calls()),
            failed_batches=snapshot.failed_batches,
            **dataclasses.asdict(self._ledger.counts()),
            out_of_memory_events=snapshot.out_of_memory,
            batch_splits=snapshot.batch_splits,
            cap_changes=snapshot.cap_changes,
            max_batch_cap=self._scheduler.max_batch_cap,
            memory_limit_bytes=self._engine.memory_limit_bytes or 0,
            **watermark_fields(self._scheduler.watermark_state()),
        )

    async def _infer(  # noqa: PLR0915 - one call's path; the ledger's callbacks close over it
        self,
        request: pb.InferRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        default_lane: str,
        stream: _OnStream | None = None,
        *,
        ledger_id: str,
    ) -> pb.InferResponse:
        """Validates, queues and awaits one request; raises LaneserveError on refusal, and
        on an answer over its stream caller's receive limit (`stream`, see
        `_check_receivable`; None, a unary call: the server's limit alone). `ledger_id`:
        its key in the ledger, its request_id, or "" (no bookkeeping) where the id only
        names it (`run_request`'s idempotent false); request_id names it everywhere else
        (its answer, errors, traces and logs).

        A stream item (`stream` given) that finds its lane full waits for room, until its
        deadline (else its lane's timeout) or a drain, instead of being refused at once:
        a stream's credit window counts items, and items of many rows (or several
        streams) filled the lane and had most of their items refused LANE_FULL."""
        arrived_s = self._clock.monotonic()
        lane, lane_config = self._lane_of(request, default_lane, ledger_id, arrived_s=arrived_s)
        # Let in while draining only as a retry of a request the server holds (`_lane_of`).
        arrived_serving = self._state() is Lifecycle.SERVING
        answer_limit = None if stream is None else stream.receive_limit
        # Budgets count from arrival: decoding is part of the time the caller waits.
        deadline_s = _deadline_s(arrived_s, context.time_remaining(), request.timeout_ms)
        if deadline_s is not None and deadline_s <= arrived_s:
            # Under overload calls can wait in gRPC's own queue past their deadline:
            # refuse them before spending any work on them.
            raise self._rejected(
                lane,
                DeadlineUnmeetableError("the deadline had passed when the request was read"),
                arrived_s=arrived_s,
                request_id=request.request_id,
            )
        # The earliest of its deadline and its lane's timeout, both counted from arrival:
        # given to the scheduler as the request's deadline. The lane's timeout counted
        # from admission gave a stream item that waited for room the whole timeout again.
        # A retry that joins the request in flight waits no longer than this either.
        wait_until_s = lane_config.deadline_s(arrived_s, deadline_s)
        try:
            output_names = check_output_names(request.output_names, self._output_names)
            # One with its id being decoded reaches the ledger first (`TextThread`).
            waited = await self._after_read_of(ledger_id, lane, wait_until_s, arrived_s)
            if waited and not arrived_serving and not self._ledger.holds(ledger_id):
                # Let in during the drain for the request it waited for, which left nothing
                # to join (refused, or its caller gone): it is new work.
                raise _new_work_draining()
            # The ledger runs it at most once per request_id: a retry joins or replays.
            digest, decoded = self._read_inputs(request, ledger_id, lane_config, output_names)
        except LaneserveError as error:  # counted as the scheduler counts its own
            raise self._rejected(
                lane, error, arrived_s=arrived_s, request_id=request.request_id
            ) from None
        if isinstance(decoded, _Unread):
            # Before a stream item's wait for room, as on the loop. A unary call's request
            # is submitted in the step its decode ends in, with no await between (see
            # `TextThread`); a stream item's, as soon as it has room.
            read = await self._decoded_aside(
                request,
                lane,
                ledger_id,
                wait_until_s,
                arrived_s,
                stream,
                output_names,
                decoded.kind,
            )
            decoded, digest = read.inputs, read.digest
        # None: a retry that joins or replays (or is refused), which waits for no room.
        assert not isinstance(decoded, _Unread)
        rows = 0 if decoded is None else decoded.rows
        # Set by `submit`, which runs only when this call (not a retry it joins) queues it;
        # NULL_TRACE again once this call is answered alone (see `expired`).
        trace = NULL_TRACE
        # What the ledger tells this call of the answer it takes (`Caller`).
        taken = _Taken(self._tracer, request.request_id, lane)

        def submit(resolve: Resolve) -> Admitted:
            nonlocal trace
            # Not decoded: its request left the ledger since it was read (see `_read_inputs`).
            read = (
                decoded
                if isinstance(decoded, DecodedInputs)
                else self._decoded(request, lane, arrived_s)
            )
            # The deadline the scheduler keeps (`wait_until_s`), from now: a stream item's
            # lane timeout counted from its arrival, not again from here after its wait for
            # room (`enqueue` showed a deadline later than the one it was shed at).
            budget_s = wait_until_s - self._clock.monotonic()
            trace = self._tracer.start(request.request_id, lane, read.rows, budget_s)
            try:
                entry_id = self._scheduler.submit(
                    InferenceRequest(
                        request_id=request.request_id,
                        lane=lane,
                        inputs=read.arrays,
                        rows=read.rows,
                        signature=read.signature,
                        deadline_s=wait_until_s,
                        token=resolve,
                        trace=trace,
                        # Its messages say whether the lane's timeout cut it
                        # (`wait_until_s` holds the cap already).
                        own_timeout_s=None if deadline_s is None else deadline_s - arrived_s,
                        arrived_s=arrived_s,  # the scheduler's refusals count from it
                    )
                )
            except LaneserveError as error:
                trace.end(error.reason)
                raise

            return self._admitted(entry_id, lane, trace, arrived_s)

        def finish(
            outcome: Outcome, ended: str | None, read_limit: int | None, own: Caller
        ) -> pb.InferResponse:
            trace.replying()
            # Counted as what its callers got: when none waits any more (they left, or
            # their deadlines passed while it ran on for replay), not OK. By the last one
            # to go (`ended`), not this call's: a retry may have extended it and left after
            # this call's deadline (it was counted DEADLINE_EXCEEDED). That one is judged
            # against its own deadline at its own going, not when the answer comes: a
            # caller that left was counted DEADLINE_EXCEEDED once the work ran past its
            # deadline, and one whose deadline passed CANCELLED when the work beat the
            # server's reading of that deadline.
            status = "OK" if ended is None else ended
            try:
                response, size = self._answer(request.request_id, outcome, output_names)
            except Exception as error:
                # Counted and traced as answered: the ledger answers a bug ENGINE_FAILURE.
                status = error.reason if isinstance(error, LaneserveError) else EngineError.reason
                raise
            else:
                # By the callers that take it (`read_limit`, the largest they read), not by
                # this call's limit alone: it may have left, and a retry that joined it
                # with a larger limit took the answer (it was counted ANSWER_TOO_LARGE).
                if status == "OK" and read_limit is not None and size > read_limit:
                    # What they get: counted here once, for the caller `own` (this call
                    # while it takes the answer), not again as its refusal.
                    status = AnswerTooLargeError.reason
                    own.counted(size)
                return response
            finally:
                self._request_over(lane, trace, status, arrived_s, late=outcome.late)

        def expired(error: JoinExpiredError) -> None:
            nonlocal trace
            trace = self._answered_alone(lane, trace, error, arrived_s, request.request_id)

        # Its caller, as the ledger sees it: a call whose gRPC deadline has passed takes
        # no answer (gRPC ends it DEADLINE_EXCEEDED; the answer was counted OK), and a
        # caller answered alone at its deadline is counted as its lane's refusal.
        caller = Caller(
            functools.partial(_before_grpc_deadline, context),
            expired,
            None if answer_limit is None else answer_limit.item_bytes,
            joined=taken.joined,
            counted=taken.counted,
        )
        run = functools.partial(
            self._run_once,
            lane,
            ledger_id,
            digest,
            submit,
            finish,
            wait_until_s,
            caller,
            arrived_s,  # positional: a keyword takes partial off its fast call path
        )

        if stream is None or self._ledger.holds(ledger_id):
            # A stream item that joins its request in flight, replays its stored answer or
            # is refused for reusing an id adds no rows to its lane: waiting for room there
            # held it, and its stream's reading, up to its deadline for nothing.
            answer = run()
        else:
            answer = self._run_when_room(
                run,
                lane,
                rows,
                wait_until_s,
                stream.room,
                ledger_id,
                arrived_s=arrived_s,
                request_id=request.request_id,
            )
        return await self._take(answer, taken, context, answer_limit, lane, arrived_s)

    async def _take(
        self,
        answer: Awaitable[pb.InferResponse],
        taken: _Taken,
        context: grpc.aio.ServicerContext[Any, Any],
        answer_limit: ReceiveLimit | None,
        lane: str,
        arrived_s: float,
    ) -> pb.InferResponse:
        """The call's `answer`, refused where over `answer_limit` (`_check_receivable`);
        a call that joined a request in flight has its reply traced, with what it got."""
        try:
            response = await answer
            taken.reply.replying()
            self._check_receivable(response, answer_limit, taken.counted_bytes, lane, arrived_s)
        except JoinExpiredError:
            raise  # answered alone, before any answer came: no reply (nor the submitter's)
        except LaneserveError as error:
            taken.replied(context, error.reason)  # the request's error, or its refusal
            raise
        taken.replied(context, "OK")
        return response

    def _read_inputs(
        self,
        request: pb.InferRequest,
        ledger_id: str,
        lane_config: LaneConfig,
        output_names: list[str],
    ) -> tuple[bytes, DecodedInputs | _Unread | None]:
        """The request's fingerprint (b"" without a `ledger_id`, its key in the ledger)
        and its decoded inputs, rows and signature; None for a retry that joins its
        request in flight or replays its stored answer, and for a request that would be
        read off the loop the ledger refuses (its id reused for other inputs), which
        needs no inputs;
        an `_Unread` for a new request read off the event loop (`read_off_loop`: long text,
        or much data to hash), its rows checked where they can be counted, its digest
        b"" (`_infer` has it decoded and hashed by `TextThread`). Raises why the
        request is refused.

        A retry's fingerprint equals the first attempt's, which was decoded and validated:
        it is not decoded again (a join kept that copy of its inputs as long as it waited;
        gRPC keeps its message, which `RequestLedger` bounds). Told so in the step the
        ledger answers it in, it is never decoded; `submit` decodes it should it run."""
        check_counts(request.inputs, self._input_specs)  # before anything walks them
        held = self._ledger.holds(ledger_id)
        rows = None
        digest = b""  # a new request's is taken once its inputs are read (below)
        if held:
            digest = fingerprint(request, output_names)
            if self._ledger.answers_as(ledger_id, digest) in ("join", "replay"):
                return digest, None
        elif any(
            tensor.shape and tensor.shape[0] > lane_config.capacity_rows
            for tensor in request.inputs
        ):
            # Only a shape[0] over the lane's capacity can be refused here (`leading_rows`
            # counts one shape[0] for all), so only such a request is walked: the walk
            # repeats what `decode_inputs` checks (1-row requests: the event loop's 232 ->
            # 226 us a request, median of 4 rounds of bench_request_path.py --a-rev HEAD).
            rows = leading_rows(
                request.inputs,
                self._input_specs,
                max_message_bytes=self._config.max_message_bytes,
            )
            if rows is not None:
                # Admission's refusal, before the inputs are copied and hashed: refused
                # after, a 62 MiB request cost the event loop 143-223 ms. Not a retry's: it
                # queues no rows.
                lane_config.check_rows(rows)
        kind = read_off_loop(request.inputs, hashed=bool(ledger_id))
        if kind is not None:
            # Held: refused REQUEST_ID_REUSED (a join or replay returned above), unread.
            # New: decoded and hashed by `TextThread` (`_infer`).
            return digest, None if held else _Unread(kind)
        read = decode_inputs(request.inputs, self._input_specs)  # refused before hashed
        if not held and ledger_id:
            digest = fingerprint(request, output_names)
        return digest, read

    def _decoded(self, request: pb.InferRequest, lane: str, arrived_s: float) -> DecodedInputs:
        """`decode_inputs` of `request`, its refusal counted as one of `lane`."""
        try:
            return decode_inputs(request.inputs, self._input_specs)
        except LaneserveError as error:
            raise self._rejected(
                lane, error, arrived_s=arrived_s, request_id=request.request_id
            ) from None

    async def _decoded_aside(
        self,
        request: pb.InferRequest,
        lane: str,
        ledger_id: str,
        until_s: float,
        arrived_s: float,
        stream: _OnStream | None,
        output_names: list[str],
        kind: str,
    ) -> ReadInputs:
        """`_decoded`, and its fingerprint where it has a `ledger_id` (else b""), by
        `TextThread`, until `until_s`: at it, refused EXPIRED_IN_QUEUE
        (one still queued never runs), as the scheduler sheds one queued past it; a
        caller that goes meanwhile is counted as `_left_unadmitted` says. A stream item
        holds its stream's reading while it is decoded, as while it waits for room
        (`StreamRoom`): without that hold, a stream's items held 11-13 decoded copies
        where on the loop they held 2 (+500 MiB; a review, once). It is decoded before its
        wait for room, as on the loop: decoded after, between its turn in the room's line
        and its admission, another item took its room, and it went to the back of the
        line."""
        # Bounded by its deadline: one queued behind others is not decoded past it, nor
        # one whose deadline passed already (it waited for another's decode).
        left_s = until_s - self._clock.monotonic()
        if left_s <= 0:
            raise self._rejected(
                lane,
                _read_expired(request, kind, until_s, arrived_s),
                arrived_s=arrived_s,
                request_id=request.request_id,
            )
        if stream is not None:
            stream.room.enter()
        try:
            async with asyncio.timeout(left_s):
                return await self._text.decode(
                    ledger_id,
                    request.inputs,
                    self._input_specs,
                    functools.partial(fingerprint, request, output_names) if ledger_id else None,
                    kind,
                )
        except TimeoutError:
            expired = _read_expired(request, kind, until_s, arrived_s)
            raise self._rejected(
                lane, expired, arrived_s=arrived_s, request_id=request.request_id
            ) from None
        except LaneserveError as error:
            raise self._rejected(
                lane, error, arrived_s=arrived_s, request_id=request.request_id
            ) from None
        except asyncio.CancelledError:
            self._left_unadmitted(lane, until_s, arrived_s)
            raise
        finally:
            if stream is not None:
                stream.room.leave()

    async def _after_read_of(
        self, ledger_id: str, lane: str, until_s: float, arrived_s: float
    ) -> bool:
        """Returns once no request with `ledger_id` is being decoded (`TextThread`):
        whether it waited (False at once, without yielding, where none is). A caller that
        goes meanwhile is counted as `_left_unadmitted` says; at `until_s` raises
        ExpiredInQueueError: it is answered no earlier than that decode ends."""
        if not self._text.reading(ledger_id):
            return False
        try:
            decoded = await self._text.after(ledger_id, until_s - self._clock.monotonic())
        except asyncio.CancelledError:
            self._left_unadmitted(lane, until_s, arrived_s)
            raise
        if not decoded:
            raise ExpiredInQueueError(
                f"the request with request_id {ledger_id!r} sent before this one was still "
                f"being read (its text decoded, or its data hashed) at this one's deadline, "
                f"{(until_s - arrived_s) * 1000:.0f} ms after it arrived; expected a longer "
                "deadline, or another request_id for other inputs"
            )
        return True

    def _left_unadmitted(self, lane: str, until_s: float, arrived_s: float) -> None:
        """Counts a call that went (cancelled, its stream ended, its deadline came) while
        its request, read, was not yet admitted: it was counted nowhere. Counted as its
        lane's refusal, by why its caller went (see `caller_end_status`: a stream call's
        gRPC deadline ends its items too), its wait from `arrived_s`."""
        now_s = self._clock.monotonic()
        status = caller_end_status(now_s, until_s, queued=True)
        self._events.rejected(lane, status, now_s - arrived_s)

    def _read(self, request: pb.InferRequest | OversizedRequest) -> pb.InferRequest:
        """`request`, unless it is an OversizedRequest: refused unread, counted (only its
        id was kept, for its stream answer)."""
        if isinstance(request, OversizedRequest):
            # Refused as it reaches the servicer, before `_infer` reads its arrival.
            raise self._rejected_without_lane(
                oversized(request), arrived_s=None, request_id=request.request_id
            )
        return request

    def _lane_of(
        self,
        request: pb.InferRequest,
        default_lane: str,
        ledger_id: str,
        *,
        arrived_s: float,
    ) -> tuple[str, LaneConfig]:
        """The lane `request` queues in, and its configuration; raises (counted) the
        refusals that come before its inputs are read. `ledger_id`: its key in the ledger
        (`_infer`). `arrived_s`: its arrival, which its refusals count from."""
        if request is UNDECODABLE_REQUEST:
            raise self._rejected_without_lane(
                undecodable(request), arrived_s=arrived_s, request_id=None
            )
        lane = request.lane or default_lane
        lane_config = self._lane_configs.get(lane)
        if id_too_long(request.request_id):  # before any other refusal quotes or echoes it
            raise self._rejected(
                lane if lane_config is not None else self._config.default_lane,
                request_id_too_long(request.request_id),
                arrived_s=arrived_s,
                request_id=None,  # too long to quote
            )
        if lane_config is None:  # here, not only at admission: a retry that joins or
            # replays is never admitted, and must not be answered OK for a wrong lane
            raise self._rejected_without_lane(
                InvalidInputError(
                    f"unknown lane {lane!r}; expected one of {list(self._lane_configs)}"
                ),
                request_id=request.request_id,
                arrived_s=arrived_s,
            )
        if (
            self._state() is not Lifecycle.SERVING
            and not self._ledger.holds(ledger_id)
            and not self._text.reading(ledger_id)
        ):
            # A retry of a request this server holds costs no work here, so the ledger
            # answers it while the server drains too: a completed one's stored answer, or
            # the answer of one still being decoded, queued or running, which the drain
            # waits for. Refused, it ran again on another instance.
            raise self._rejected(
                lane,
                _new_work_draining(),
                arrived_s=arrived_s,
                request_id=request.request_id,
            )
        return lane, lane_config

    def _admitted(
        self, entry_id: int, lane: str, trace: RequestTrace, arrived_s: float
    ) -> Admitted:
        """How the ledger cancels the queued entry `entry_id` or moves its deadline."""

        def cancel(unless_running: bool) -> bool:
            status = self._scheduler.cancel(entry_id, unless_running=unless_running)
            if status is not None:  # no Outcome will come: `finish` never runs
                self._request_over(lane, trace, status, arrived_s)
            return status is not None

        def move(deadline_s: float) -> bool:
            return self._scheduler.move_deadline(entry_id, deadline_s)

        return Admitted(cancel, move)

    async def _run_once(
        self,
        lane: str,
        ledger_id: str,
        digest: bytes,
        submit: Callable[[Resolve], Admitted],
        finish: Finish,
        wait_until_s: float,
        caller: Caller,
        arrived_s: float,
    ) -> pb.InferResponse:
        """The request's answer from the ledger (see `RequestLedger.run`), keyed
        `ledger_id` (`_infer`'s: "" keys none): it waits until `wait_until_s` at
        most, a retry joining the request in flight too. Its refusals count their wait
        from `arrived_s` (a stream item may have waited for room first)."""
        # Told here, as the ledger is asked: a stream item may have waited for room first.
        retry = self._ledger.answers_as(ledger_id, digest)
        if retry == "join":  # refused before it joins: traced a retry once it does (`_Taken`)
            refusal = self._join_memory_refusal(lane, ledger_id)
            if refusal is not None:
                raise self._rejected(lane, refusal, arrived_s=arrived_s, request_id=ledger_id)
        elif retry == "replay":  # not "reused": that call is refused, not a retry
            self._tracer.retried(ledger_id, lane, retry)
        if retry is None:
            # It starts a flight (unless refused): the stream items with its id that wait
            # for room join it instead. Woken now, each looks once this task yields, and
            # the ledger records the flight before its first await.
            for waiter in self._room_waiters.get(ledger_id, ()):
                waiter.wake()
        try:
            return await self._ledger.run(
                ledger_id, digest, submit, finish, deadline_s=wait_until_s, caller=caller
            )
        except (RequestIdReusedError, JoinLimitError) as error:
            # Answered, but no entry of its own was shed: counted as its lane's refusal
            # (it was counted nowhere, and the counters missed an answer). So is a waiter
            # answered alone at its deadline, by `caller.expired`.
            raise self._rejected(lane, error, arrived_s=arrived_s, request_id=ledger_id) from None

    def _join_memory_refusal(self, lane: str, request_id: str) -> LaneserveError | None:
        """Why a retry in `lane` may not join the request `request_id` in flight for
        memory (None: it may). It queues nothing, but gRPC holds its request message as
        long as a new request's: so it is refused where the memory watermark closed its
        lane, as new work is (the client retries after the pushback, by then likely a
        replay). The callers one request may have are the ledger's bound (`JoinLimitError`
        from `RequestLedger.run`)."""
        state = self._scheduler.watermark_state()
        if state is not None and lane in state.closed_lanes:
            return MemoryPressureError(
                f"{state.reading} ({format_bytes(state.used_bytes or 0)}) is over the "
                f"watermark: lane {lane!r} takes no new work, nor a retry joining "
                f"request_id {request_id!r} in flight (gRPC holds its message as a new "
                f"request's), until it falls below {format_bytes(state.low_bytes)}; expected "
                "a retry after the pushback",
                retry_after_s=MEMORY_PRESSURE_RETRY_S,
            )
        return None

    async def _run_when_room(
        self,
        run: Callable[[], Awaitable[pb.InferResponse]],
        lane: str,
        rows: int,
        until_s: float,
        room: StreamRoom,
        ledger_id: str,
        *,
        arrived_s: float,
        request_id: str,
    ) -> pb.InferResponse:
        """`run()` once `lane` has room for `rows` rows (see `_wait_for_room`), or at once
        once a request with its `ledger_id` is in flight (it joins: no room needed);
        again when another caller took the room first, while there is time. Its refusals
        count their wait from `arrived_s`, the wait for room included, and name
        `request_id` (its `ledger_id` is empty where the id only names it)."""
        retried = False
        while True:
            waited = await self._wait_for_room(
                lane, rows, until_s, room, ledger_id, arrived_s=arrived_s
            )
            if (waited or retried) and self._state() is not Lifecycle.SERVING:
                # The wait ends at the drain, whose scheduler may still admit a moment:
                # retried there, a full lane refused it in a loop that never yielded
                # (the drain could not start; a LANE_FULL counted each turn). One that
                # found room at once runs, as a unary call does: its long text decoded
                # while the drain began (which waited for it), it was refused here.
                raise self._rejected(
                    lane, _item_draining(), arrived_s=arrived_s, request_id=request_id
                )
            try:
                return await run()
            except LaneFullError:
                if self._clock.monotonic() >= until_s:
                    raise
            retried = True
            await asyncio.sleep(ROOM_POLL_MIN_S)  # a retry never spins the loop

    async def _wait_for_room(
        self,
        lane: str,
        rows: int,
        until_s: float,
        room: StreamRoom,
        ledger_id: str,
        *,
        arrived_s: float,
    ) -> bool:
        """Returns once `lane` has room for `rows` more rows and no stream item that began
        waiting for room in it earlier still waits, at `until_s`, when the server stops
        serving, or once the ledger holds `ledger_id` (a call with it began meanwhile, in
        another lane: the item joins it instead of waiting for room it will not use):
        whether it waited (False: room at once, nobody waiting before it).
        First come, first served: polling each on its own, the small items of one stream
        took every row that freed, and a stream of large items in the same lane waited
        until its items' deadlines (answered LANE_FULL). Only the oldest polls; the
        others sleep until woken (`RoomWaiter`: their turn, the drain, a call with their
        id) or their deadline."""
        line = self._room_lines[lane]
        wait_s = self._scheduler.room_wait_s(lane, rows)
        if wait_s is None and not line:
            return False
        # Invariant: the first waiter of a line, and it alone, is `oldest`.
        waiter = RoomWaiter()
        waiter.oldest = not line
        line.append(waiter)
        # Before the ledger is asked below: a call with its id that begins later wakes it.
        if ledger_id:  # "" keys nothing: no call has its id
            self._room_waiters.setdefault(ledger_id, []).append(waiter)
        room.enter()
        try:
            while self._state() is Lifecycle.SERVING and not self._ledger.holds(ledger_id):
                left_s = until_s - self._clock.monotonic()
                if left_s <= 0:
                    return True
                sleep_s = left_s
                if waiter.oldest:
                    wait_s = self._scheduler.room_wait_s(lane, rows)
                    if wait_s is None:
                        return True
                    sleep_s = min(max(wait_s, ROOM_POLL_MIN_S), ROOM_POLL_MAX_S, left_s)
                await waiter.sleep(sleep_s)
        except asyncio.CancelledError:
            self._left_unadmitted(lane, until_s, arrived_s)  # its stream ended meanwhile
            raise
        finally:
            room.leave()
            line.remove(waiter)
            if ledger_id:
                same_id = self._room_waiters[ledger_id]
                same_id.remove(waiter)
                if not same_id:
                    del self._room_waiters[ledger_id]
            if waiter.oldest and line:
                line[0].oldest = True
                line[0].wake()  # its turn, after this one's admission (same step)
            if not line:
                del self._room_lines[lane]
        return True

    def _answered_alone(
        self,
        lane: str,
        trace: RequestTrace,
        error: JoinExpiredError,
        arrived_s: float,
        request_id: str,
    ) -> RequestTrace:
        """Counts a call answered alone at its deadline while the work goes on for a
        retry that joined it with a later deadline; the trace the call keeps (none).

        The answer will be that retry's: the spans of work this call queued (`trace`)
        end now, with what the call got, and no reply of that answer is traced as this
        call's (it was, status OK, after this call had ended in error). Counted with
        its wait from `arrived_s`, until its deadline."""
        self._rejected(lane, error, arrived_s=arrived_s, request_id=request_id)
        trace.end(error.reason)
        return NULL_TRACE

    def _rejected(
        self, lane: str, error: LaneserveError, *, arrived_s: float | None, request_id: str | None
    ) -> LaneserveError:
        """`error`, counted as a refusal of `lane` (a lane the server has: see
        `_rejected_without_lane`) as the scheduler counts its own: the lanes' `rejected`,
        the metrics, the refusal log and ModelStatistics' `fail`, with its wait from
        `arrived_s` (`_infer`'s) to now. None: refused as it reached the servicer, before
        its arrival was read: it waited nothing here. `request_id`: its request's, for
        the refusal log and the trace (None: none known, or none to quote); required, so
        that no refusal leaves it out by accident."""
        waited_s = 0.0 if arrived_s is None else self._clock.monotonic() - arrived_s
        self._events.rejected(lane, error.reason, waited_s, request_id=request_id, error=error)
        return error

    def _rejected_without_lane(
        self, error: LaneserveError, *, arrived_s: float | None, request_id: str | None
    ) -> LaneserveError:
        """`error`, for a request refused before it has a lane of the server's (its bytes
        do not parse, or it names a lane the server lacks), counted as a refusal of the
        default lane: a label the server chose, since one per name a client sent would
        grow the metrics' label set (and GetStats' lanes) without bound. `arrived_s` and
        `request_id`: as `_rejected`'s."""
        return self._rejected(
            self._config.default_lane, error, arrived_s=arrived_s, request_id=request_id
        )

    def _request_over(
        self, lane: str, trace: RequestTrace, status: str, arrived_s: float, *, late: bool = False
    ) -> None:
        """Ends an admitted request's trace and counts its end; `late`: its run ended past
        its deadline (`Outcome.late`), counted where it is answered OK."""
        late = late and status == "OK"
        trace.end(status, late=late)
        self._events.request_finished(lane, status, self._clock.monotonic() - arrived_s, late=late)


_READ_DONE = object()  # a stream's reader has read its last item


def _read_expired(
    request: pb.InferRequest, kind: str, until_s: float, arrived_s: float
) -> LaneserveError:
    """The refusal of a request read off the loop (`TextThread`, as `kind`) that its
    deadline found still waiting for its read: its text, or its data's hash."""
    after = f"at its deadline, {(until_s - arrived_s) * 1000:.0f} ms after it arrived"
    if kind == DECODE:
        return ExpiredInQueueError(
            f"request {request.request_id!r} was still waiting for its text to be decoded "
            f"{after} (long text is decoded on one thread, in turn); expected a longer "
            "deadline, or fewer strings per request"
        )
    return ExpiredInQueueError(
        f"request {request.request_id!r} was still waiting for its data to be hashed {after} "
        f"(a request of more than {EVENT_LOOP_HASH_BYTES >> 20} MiB with an id is hashed on "
        "one thread, in turn); "
        "expected a longer deadline, or smaller requests"
    )


def _before_grpc_deadline(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    """Whether the call's gRPC deadline, if it has one, is still ahead."""
    remaining_s: float | None = context.time_remaining()  # None: no deadline
    return remaining_s is None or remaining_s > 0


def _deadline_s(now_s: float, remaining_s: float | None, timeout_ms: int) -> float | None:
    """The request's own deadline on the scheduler's clock: gRPC's or timeout_ms, earliest."""
    candidates = []
    if remaining_s is not None:
        candidates.append(now_s + remaining_s)
    if timeout_ms > 0:
        candidates.append(now_s + timeout_ms / 1000)
    return min(candidates) if candidates else None


def _new_work_draining() -> DrainingError:
    return DrainingError("server is draining; retry on another instance")


def _item_draining() -> DrainingError:
    return DrainingError(
        "server is draining: this item waited for room in its lane and was not run; resend "
        "it on a new call, to another instance"
    )


def _stream_draining() -> DrainingError:
    return DrainingError(
        "server is draining: this stream takes no more items (those it read were "
        "answered); resend the rest on a new call, to another instance"
    )
