"""How a port takes its calls from gRPC's core: several inference calls at a time (Infer,
and KServe v2's ModelInfer), and at most `max_concurrent_rpcs` inference calls in
progress, of which at most half streams.

grpc.aio asks its core for one call per registered method at a time: once a call is
taken, the next is asked for only when the event loop has run the task that took it and
the task that asks again (`AioServer._server_main_loop`), two or three turns of a loop
busy with every other call. The core hands a call only to an ask that is out, so under
load calls waited in the core's queue for the loop's pace, not for the server's work:
at 128 callers gRPC counted 129 calls open while 1-18 were inside laneserve, the loop
idle 11-25 % of the time, and the lanes never saw enough rows at once to fill a batch.

`ParallelAcceptors` keeps `count` more asks out for each of its methods and hands each
call taken to gRPC's own handling, as the stock loop hands it (`_handle_rpc` under
`_schedule_rpc_coro`: deserialising, the interceptors, cancellation, the status). It uses
grpc.aio internals, checked at start: where the installed grpc lacks any, or their
signatures differ, nothing is added and the stock loop alone takes calls (logged).

The asks are out only while the port has fewer unary calls in progress than
`CallGate`'s `accept_below` (two batches' worth): they are there to fill batches. Past it the lanes
hold what the next batches take, and calls taken faster only queue, or are refused in
Python at the cost of the event loop's time: under a unary flood at 200 % the main
port's extra asks took it so fast that the priority port's interactive p99 went from
2.5-3.6x its unloaded p99 to 9x. Past it grpc.aio's own pace stands, and the rest wait in
the core, whose queue sheds cheaply (max_pending_calls).

Calls taken so bypass gRPC's own `maximum_concurrent_rpcs`, which counts the stock loop's
calls alone: the limit is `CallGate`'s instead, one count per port of the inference
calls in progress, however taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, NoReturn

import grpc

log = logging.getLogger(__name__)

# grpc's compiled core, untyped (no stubs): what is used of it is checked at start.
cygrpc: Any = importlib.import_module("grpc._cython.cygrpc")

# gRPC's words for a call over its concurrent call limit, which clients know (the
# Python client's ServerBusyError): `CallGate` refuses in them.
CALL_LIMIT_DETAILS = "Concurrent RPC limit exceeded!"
# The trailer that names the bound a stream over the streams' own bound met: its status
# is in gRPC's own words for a port at its limit (CALL_LIMIT_DETAILS), which every
# version of the Python client retries (words of their own were final to clients that
# predate the bound: their bulk jobs failed where they had waited).
STREAM_LIMIT_KEY = "laneserve-stream-limit"
# The trailer that names max_concurrent_rpcs on the refusal of an inference call over it.
# Its words alone (CALL_LIMIT_DETAILS) are gRPC's, and RESOURCE_EXHAUSTED is also gRPC's
# final refusal of a message over its size limit: a client in another language told this
# retryable refusal from that one only by matching text.
CALL_LIMIT_KEY = "laneserve-call-limit"
# The service's methods that read the server's state and wait on nothing (no lane, no
# other call): an operator's, called most when the server is overloaded. They are counted
# apart from the inference calls (`CallGate.gate_operator`), so that a port whose every
# inference slot is taken still answers them; those not yet taken wait in gRPC's core,
# bounded per method (max_pending_calls), as health checks do.
OPERATOR_METHODS = frozenset({"GetModel", "GetStats"})
# The operator calls in progress on one port, at most: a bound of their own, not a share
# of max_concurrent_rpcs, which a flood of inference calls fills. Each is answered in the
# loop turn it starts in, so in ordinary use one or two are in progress at once; 64 is
# room for every dashboard, scraper and grpcurl pointed at a port together. Unbounded,
# they were the only calls nothing bounded, and a handler that awaits (an interceptor's,
# or one added later) let them pile up. It bounds calls, not memory: gRPC's core holds
# each body whole before any Python runs, up to max_message_bytes (grpc_methods'
# MAX_OPERATOR_REQUEST_BYTES spares the parse and ends the call at once), and the calls
# not yet taken too (max_pending_calls): bodies in memory are bounded by
# max_message_bytes times the calls gRPC holds, those and the calls in progress.
OPERATOR_LIMIT = 64
# The trailer that names the operator calls' bound, on the refusal of the one over it
# (in gRPC's words for a full port, CALL_LIMIT_DETAILS, as a stream over its bound is).
OPERATOR_LIMIT_KEY = "laneserve-operator-limit"
# The health service's Watch streams open on one port, at most (`CallGate.gate_watch`;
# Check, unary and answered at once, is not counted). Each holds a task, a waiter and
# gRPC's call, ~23 KiB of the server's memory (measured: 4 000 watches on the demo model
# raised its RSS by 88 MiB), for as long as its caller keeps it open: unbounded, a
# misconfigured prober or a hostile client held memory without end. Probes (Kubernetes',
# grpc-health-probe, Envoy's) call Check; a Watch is a gRPC channel's client-side health
# check (gRFC A17), one per connection of a channel whose service config asks for it, and
# a refused one puts that connection in TRANSIENT_FAILURE, retried with backoff: the
# client sends this port nothing meanwhile. So the bound is room for a fleet of such
# clients, 1 024 connections per port (~23 MiB), not for a few probers as the operator
# bound is; counted apart from the operator calls, which a port full of watches, held
# open for hours, would otherwise refuse.
WATCH_LIMIT = 1024
# The trailer that names the watches' bound, on the refusal of the one over it (in gRPC's
# words for a full port, CALL_LIMIT_DETAILS, as the other bounds').
WATCH_LIMIT_KEY = "laneserve-watch-limit"
# What `CallGate.deserializer` hands a unary handler over the limit (and
# `operator_deserializer` an operator's over its own), instead of parsing.
OVER_LIMIT = object()


# What is used of grpc.aio's internals, by name and the parameters expected.
_SERVER_ASK = "_make_request_call_future"
_EXPECTED: Mapping[str, tuple[str, ...]] = {
    "_handle_rpc": (
        "method_name",
        "method_resolver",
        "interceptors",
        "rpc_state",
        "loop",
        "concurrency_exceeded",
    ),
    "_schedule_rpc_coro": ("rpc_coro", "rpc_state", "loop", "method_name"),
}


def _internals_missing(core_server: object) -> list[str]:
    """What `ParallelAcceptors` needs and the installed grpc lacks (or has otherwise)."""
    missing = []
    for name, parameters in _EXPECTED.items():
        function = getattr(cygrpc, name, None)
        try:
            found = tuple(inspect.signature(function).parameters) if function else None
        except (TypeError, ValueError):
            found = None
        if found != parameters:
            missing.append(f"cygrpc.{name}{parameters}")
    if not hasattr(cygrpc, "_MethodResolver"):
        missing.append("cygrpc._MethodResolver")
    # The ask, and whether the server still runs (each acceptor's loop stops with it): an
    # AioServer without the second had failed the start, not fallen back.
    missing.extend(
        f"AioServer.{name}"
        for name in (_SERVER_ASK, "is_running")
        if not callable(getattr(core_server, name, None))
    )
    return missing


class ParallelAcceptors:
    """`count` asks kept out for each of `methods` (full names, "/pkg.Service/Method") of
    `server`, whose handlers are `handlers` (by full name) and interceptors
    `interceptors`. `start` after the server's own start; `wait_closed` after its stop
    (each ask fails as the server stops, and its acceptor ends). An ask waits in gRPC's
    core until a call of its method comes: a method nobody calls costs nothing but its
    asks."""

    def __init__(
        self,
        server: grpc.aio.Server,
        methods: Sequence[str],
        handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]],
        interceptors: Sequence[grpc.aio.ServerInterceptor],
        gate: CallGate,
        *,
        count: int,
    ) -> None:
        self._server = server
        self._gate = gate
        self._methods = tuple(methods)
        self._handlers = dict(handlers)
        self._interceptors = tuple(interceptors)
        self._count = count
        self._acceptors: list[asyncio.Task[None]] = []
        # The calls taken here and not yet ended: the loop keeps weak references only.
        self._calls: set[asyncio.Task[Any]] = set()
        self.taken = 0  # calls taken here so far

    def start(self) -> bool:
        """Starts the acceptors; False (nothing started) where grpc lacks what they use."""
        if self._count <= 0:
            return False
        core_server: Any = getattr(self._server, "_server", None)
        missing = (
            ["grpc.aio.Server._server"] if core_server is None else _internals_missing(core_server)
        )
        if missing:
            log.warning(
                "grpc %s lacks %s: each method's calls are taken one at a time (grpc.aio's "
                "own pace)",
                grpc.__version__,
                ", ".join(missing),
            )
            return False
        resolver = cygrpc._MethodResolver([], self._handlers)  # noqa: SLF001
        ask = getattr(core_server, _SERVER_ASK)
        loop = asyncio.get_running_loop()
        self._acceptors = [
            loop.create_task(self._accept(method, core_server.is_running, ask, resolver))
            for method in self._methods
            for _ in range(self._count)
        ]
        return True

    async def _accept(
        self,
        method: str,
        running: Callable[[], bool],
        ask: Callable[[bytes], Awaitable[Any]],
        resolver: object,
    ) -> None:
        loop = asyncio.get_running_loop()
        method_bytes = method.encode()
        while running():
            await self._gate.below_accept.wait()
            if not running():  # it stopped while this waited: an ask would reach no server
                return
            try:
                rpc_state = await ask(method_bytes)
            except Exception as error:  # noqa: BLE001 - gRPC's, whatever its type
                if running():  # not the stop failing the asks: said, not retried in a loop
                    log.warning("an ask for %s calls failed (%r); one ask fewer", method, error)
                return
            self.taken += 1
            # Never gRPC's own refusal (concurrency_exceeded): it sends no trailer, and
            # the CALL_LIMIT_KEY trailer is what tells a full port from a message too
            # large. Over the limit the handler refuses it (`CallGate.refuse_call`), its
            # message read but not parsed (`CallGate.deserializer`), as the stock loop's
            # calls are. Rare: the asks are out only below `accept_below` unary calls, so
            # a call they take is over the limit only where max_concurrent_rpcs is below
            # `accept_below` plus the streams' half, or (at most `count` per method each
            # time the port fills) by an ask already out when it filled.
            handling = cygrpc._handle_rpc(  # noqa: SLF001
                method, resolver, self._interceptors, rpc_state, loop, False
            )
            call = loop.create_task(
                cygrpc._schedule_rpc_coro(handling, rpc_state, loop, method)  # noqa: SLF001
            )
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def wait_closed(self, timeout_s: float) -> None:
        """Waits for the acceptors to end (the server has stopped: its asks fail), at most
        `timeout_s`; the rest are cancelled."""
        if not self._acceptors:
            return
        _, pending = await asyncio.wait(self._acceptors, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._acceptors, return_exceptions=True)
        self._acceptors.clear()


async def abort_unless_gone(
    context: grpc.aio.ServicerContext[Any, Any],
    code: grpc.StatusCode,
    details: str,
    trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
) -> NoReturn:
    """Ends the call with `code` and `details` (trailers only). A call that has ended (its
    caller left, or its deadline passed: nothing can be sent any more) ends as the cancel
    it is: trying raised, and gRPC logged a traceback at ERROR per call under overload.
    It may end in gRPC's core between the check and the abort (a caller whose deadline is
    the request's own timeout): sending the status then fails with ExecuteBatchError,
    logged so 40 times in 20 s of such load. (The status sent raises AbortError, a
    BaseError beside it.)"""
    if context.cancelled():
        raise asyncio.CancelledError
    try:
        await context.abort(code, details, trailing_metadata=trailing_metadata)
    except grpc.aio.InternalError:
        raise asyncio.CancelledError from None


async def refuse_over_limit(
    context: grpc.aio.ServicerContext[Any, Any],
    trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
) -> NoReturn:
    """Ends a call over the limit RESOURCE_EXHAUSTED, in gRPC's own words."""
    await abort_unless_gone(
        context, grpc.StatusCode.RESOURCE_EXHAUSTED, CALL_LIMIT_DETAILS, trailing_metadata
    )


class CallGate:
    """The inference calls (Infer, InferStream, ModelInfer, ModelStreamInfer) in progress
    on one port, at most `limit` (max_concurrent_rpcs): a call over it is refused at once,
    RESOURCE_EXHAUSTED in gRPC's own words, its message not parsed, the bound in the
    CALL_LIMIT_KEY trailer (`refuse_call`). Of them at most `stream_limit` streams: one
    more is refused at once in the same words, the bound in the STREAM_LIMIT_KEY trailer.
    Operator calls (OPERATOR_METHODS) are counted apart, at most `operator_limit`
    (`gate_operator`): one more is refused in the same words, the bound in the
    OPERATOR_LIMIT_KEY trailer. Health Watch streams likewise, at most `watch_limit`
    (`gate_watch`), the bound in the WATCH_LIMIT_KEY trailer. Counted by the handlers (`gate`),
    so every call is, however it was taken (see `ParallelAcceptors`). `below_accept` is
    set while fewer unary calls than `accept_below` are in progress (the extra asks are
    out only then): a stream's call stays open for a whole job, and its items do not
    come through asks."""

    def __init__(self, limit: int, accept_below: int) -> None:
        self.limit = limit
        self.operator_limit = OPERATOR_LIMIT
        # Not in `calls`: an operator call neither takes an inference slot nor holds the
        # asks back (see OPERATOR_LIMIT).
        self.operator_calls = 0
        # Not in `calls` either, nor in `operator_calls`: a watch is open for hours.
        self.watch_limit = WATCH_LIMIT
        self.watch_calls = 0
        # Streams hold at most half the slots (at least one, so that a port of limit 1
        # still takes a stream): the rest always stays for unary calls. A stream is a
        # whole bulk job, open while its source is read, sending or not: 4 200 that sent
        # nothing took every slot of the default 4 096, and every Infer and GetStats was
        # refused while the health check said SERVING. Thousands of concurrent bulk jobs
        # on one server is no workload; thousands of unary calls is (the bulk lane's
        # 16 384 rows are 2 048 calls of 8 rows), and the lanes bound those by priority.
        self.stream_limit = max(1, limit // 2)
        self.unary_calls = 0
        self.stream_calls = 0
        self._accept_below = accept_below
        self.below_accept = asyncio.Event()
        self.below_accept.set()

    @property
    def calls(self) -> int:
        """The inference calls in progress on the port."""
        return self.unary_calls + self.stream_calls

    @property
    def full(self) -> bool:
        """Whether a call taken now is refused: `limit` calls are in progress."""
        return self.calls >= self.limit

    @property
    def streams_full(self) -> bool:
        """Whether a stream taken now is refused: `stream_limit` streams are in progress."""
        return self.stream_calls >= self.stream_limit

    @property
    def operators_full(self) -> bool:
        """Whether an operator call taken now is refused: `operator_limit` are in progress."""
        return self.operator_calls >= self.operator_limit

    @property
    def watches_full(self) -> bool:
        """Whether a health Watch taken now is refused: `watch_limit` are open."""
        return self.watch_calls >= self.watch_limit

    async def refuse_operator(self, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
        """Ends an operator call over `operator_limit` RESOURCE_EXHAUSTED in gRPC's words
        for a full port, the bound in the OPERATOR_LIMIT_KEY trailer."""
        methods = " and ".join(sorted(OPERATOR_METHODS))
        bound = (
            f"{self.operator_limit} {methods} calls at once, counted apart from the "
            f"inference calls (server setting max_concurrent_rpcs {self.limit})"
        )
        await refuse_over_limit(context, ((OPERATOR_LIMIT_KEY, bound),))

    async def refuse_watch(self, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
        """Ends a health Watch over `watch_limit` RESOURCE_EXHAUSTED in gRPC's words for a
        full port, the bound in the WATCH_LIMIT_KEY trailer."""
        bound = (
            f"{self.watch_limit} health Watch and reflection streams "
            "(grpc.health.v1.Health/Watch, grpc.reflection.v1alpha.ServerReflection/"
            "ServerReflectionInfo) at once on this port, counted apart from every other "
            "call; Check is not counted"
        )
        await refuse_over_limit(context, ((WATCH_LIMIT_KEY, bound),))

    async def refuse_call(self, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
        """Ends an inference call over `limit` RESOURCE_EXHAUSTED in gRPC's words for a
        full port (which older Python clients match), the bound in the CALL_LIMIT_KEY
        trailer."""
        bound = (
            f"{self.limit} inference calls at once (Infer, InferStream, ModelInfer and "
            f"ModelStreamInfer), server setting max_concurrent_rpcs {self.limit}"
        )
        await refuse_over_limit(context, ((CALL_LIMIT_KEY, bound),))

    async def refuse_stream(self, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
        """Ends a stream over `stream_limit` RESOURCE_EXHAUSTED in gRPC's words for a full
        port, the bound in the STREAM_LIMIT_KEY trailer."""
        bound = (
            f"{self.stream_limit} stream calls (InferStream and ModelStreamInfer) at once, "
            f"half of server setting max_concurrent_rpcs {self.limit}; unary calls keep the rest"
        )
        await refuse_over_limit(context, ((STREAM_LIMIT_KEY, bound),))

    def _enter_unary(self) -> None:
        self.unary_calls += 1
        if self.unary_calls >= self._accept_below:
            self.below_accept.clear()

    def _leave_unary(self) -> None:
        self.unary_calls -= 1
        if self.unary_calls < self._accept_below:
            self.below_accept.set()

    def deserializer(self, read: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        """`read` (a unary method's request deserializer), skipped over the limit: the
        handler then refuses `OVER_LIMIT` without the copy and parse of a message of up
        to max_message_bytes (gRPC's own limit refused before reading it)."""

        def read_within(data: bytes) -> Any:
            return OVER_LIMIT if self.full else read(data)

        return read_within

    def operator_deserializer(self, read: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        """`read` (an operator method's request deserializer), skipped over
        `operator_limit`: the handler (`gate_operator`) then refuses `OVER_LIMIT`, as
        `deserializer` has it for the inference calls."""

        def read_within(data: bytes) -> Any:
            return OVER_LIMIT if self.operators_full else read(data)

        return read_within

    def gate_operator(self, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        """`behavior` (an operator method's handler, unary), counted in `operator_calls`
        while it runs and refused over `operator_limit`; not in `calls`, so that it is
        answered while every inference slot is taken."""

        async def gated(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            # The request let go of before anything is awaited, as in `_gate_unary`.
            if request is OVER_LIMIT or self.operators_full:
                del request
                await self.refuse_operator(context)
            handling = behavior(request, context)
            del request
            self.operator_calls += 1
            try:
                return await handling
            finally:
                self.operator_calls -= 1

        return gated

    def gate_watch(self, behavior: Callable[..., Awaitable[None]]) -> Callable[..., Any]:
        """`behavior` (gRPC's health Watch: a coroutine function that writes its answers
        through the context and ends when the call does), counted in `watch_calls` while
        it runs and refused over `watch_limit` (`_watch_slot`)."""

        async def gated(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            async with self._watch_slot(context):
                await behavior(request, context)

        return gated

    def gate_reflection(self, behavior: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
        """`behavior` (gRPC's reflection stream: an async generator of answers, open as
        long as its caller keeps it), counted with the health Watch streams
        (`_watch_slot`): 20 000 of them, never read, held 640 MiB (a review)."""

        async def gated(
            requests: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            async with self._watch_slot(context):
                async for answer in behavior(requests, context):
                    yield answer

        return gated

    @contextlib.asynccontextmanager
    async def _watch_slot(self, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
        """One of the `watch_limit` slots of the long-lived streams (health Watch,
        reflection) for as long as the block runs, the one over refused. Freed once,
        however the stream ends: its caller gone (cancelled), the drain (`app._LongStreams.end`),
        or an error."""
        if self.watches_full:
            await self.refuse_watch(context)
        self.watch_calls += 1
        try:
            yield
        finally:
            self.watch_calls -= 1

    def gate(self, behavior: Callable[..., Any], *, response_streaming: bool) -> Callable[..., Any]:
        """`behavior` (a handler's, taking the request or its iterator and the context),
        counted while it runs and refused over the limit."""
        if response_streaming:
            return self._gate_stream(behavior)
        return self._gate_unary(behavior)

    def _gate_unary(self, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        async def gated(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            # This frame lets go of the request before anything is awaited: an abort
            # below keeps the frames it passes through (see grpc_methods.abort_with).
            if request is OVER_LIMIT or self.full:
                del request
                await self.refuse_call(context)
            handling = behavior(request, context)
            del request
            self._enter_unary()
            try:
                return await handling
            finally:
                self._leave_unary()

        return gated

    def _gate_stream(self, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
        async def gated(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            if self.streams_full:
                await self.refuse_stream(context)
            # OVER_LIMIT: a unary request (deserializer) with a streamed answer.
            if request is OVER_LIMIT or self.full:
                await self.refuse_call(context)
            self.stream_calls += 1
            responses = behavior(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                self.stream_calls -= 1
                # Closed now, not when collected: its own cleanup (the stream's queued
                # items cancelled) runs as the call ends.
                await responses.aclose()  # type: ignore[attr-defined]

        return gated
