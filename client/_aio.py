"""`AsyncClient`: the asyncio client, on which the sync `Client` is built."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import numbers
import os
import reprlib
import threading
import time
import uuid
import weakref
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Any, Final, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from laneserve.client._channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TARGET,
    TlsConfig,
    channel_spec,
    checked_message_bytes,
    checked_metadata,
    forked_message,
    open_channel,
    send_limit,
)
from laneserve.client._errors import (
    ClientClosedError,
    LaneserveError,
    closed_before_sending,
    error_from_rpc,
    unreadable_answer,
)
from laneserve.client._request import (
    check_request_bytes,
    check_request_id,
    encode_inputs,
    infer_request,
    output_names,
    refused,
)
from laneserve.client._retry import (
    RetryBudget,
    RetryPolicy,
    RetryTokens,
    call_with_retries,
    checked_budget,
    checked_policy,
)
from laneserve.client._stream import (
    DEFAULT_STREAM_LANE,
    SERVER_STREAM_LANE,
    BulkStream,
    StreamLimits,
    StreamOptions,
    StreamSource,
    check_source,
)
from laneserve.client._tracing import trace_metadata
from laneserve.client._types import InferAnswer, ModelInfo, StreamResult, Timing
from laneserve.client.tensors import decode_tensor
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

__all__ = ["MAX_TIMEOUT_S", "AsyncClient", "MetadataLike", "Outputs", "TlsLike"]

log = logging.getLogger("laneserve.client")

T = TypeVar("T")
# The longest `timeout` of a call: the longest timeout a lane can have (uint32
# milliseconds); no request waits longer on the server. It is far within gRPC's own
# limit: a deadline as int64 nanoseconds since the epoch, which a timeout of ~7e9 s
# overflows (the call then failed at once with DEADLINE_EXCEEDED).
MAX_TIMEOUT_S: Final = (2**32 - 1) / 1000
# How long a bulk job waits for the server's GetModel answer (its limits) before a call.
STREAM_LIMITS_TIMEOUT_S: Final = 10.0
# The client's `metadata`: pairs of key and value, or a mapping of them.
MetadataLike = Mapping[str, str] | Iterable[tuple[str, str]]
# The client's `tls`. True: TLS with the system's roots; None or False: plaintext.
TlsLike = TlsConfig | bool | None
# What `infer` answers: output name to array.
Outputs = dict[str, npt.NDArray[Any]]


class AsyncClient:
    """A laneserve client for asyncio code. It serves the event loop it is first used on:
    it may be made anywhere (at import, with no loop running), and opens its channel at
    its first call, on that call's loop. A call from another loop while that one is open
    is refused (RuntimeError): make one client per event loop that runs at once (per
    thread's loop). Once its loop is closed (an ``asyncio.run`` ended, a test's loop), the
    next call opens a new channel on its own loop, which the client serves from then on.

    Example::

        async with AsyncClient("127.0.0.1:50051") as client:
            outputs = await client.infer({"input": rows}, lane="interactive", timeout=0.5)
            scores = outputs["output"]
            async for result in client.stream({"input": many_rows}, rows_per_item=64):
                ...

    Every call raises a `LaneserveError` subclass on failure and retries the retryable
    ones (`RetryPolicy`) with the same request_id, within its `timeout`; its overload
    refusals also within the client's `RetryBudget`, which all its unary calls share.

    `timeout`: the seconds of every unary call (`infer`, `infer_detailed`, `model`,
    `stats`) made without one (``timeout=None``); a call's own wins, ``math.inf`` for
    none. None: no default. Not `stream()`'s: its items have their own budget,
    `timeout_ms`.
    """

    def __init__(  # noqa: PLR0913 - keyword-only settings of one client, each with a default
        self,
        target: str = DEFAULT_TARGET,
        *,
        tls: TlsLike = None,
        metadata: MetadataLike | None = None,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
        retry_budget: RetryBudget | None = None,
        timeout: float | None = None,
    ) -> None:
        # Each argument is checked here, naming it: taken unchecked, a wrong type failed
        # later, at each call, with an AttributeError or an unpacking error naming none.
        self.target = target
        # Seconds: the timeout of a unary call given none (None: no default).
        # Read-only (`timeout`): checked once, here (set later, 0 failed every call unsent).
        self._timeout_s_default = default_timeout_s(timeout)
        self.retry = checked_policy(retry, "retry") or RetryPolicy()
        # The client's, not a call's (a call's `retry` replaces the policy, never the
        # budget): the overload refusals of every unary call on any loop draw on these
        # tokens, so that all of them together send an overloaded server few retries.
        self.retry_budget = checked_budget(retry_budget, "retry_budget") or RetryBudget()
        self._retry_tokens = RetryTokens(self.retry_budget)
        # Sent with every call (e.g. authorization); refused here, naming the key, when
        # gRPC would fail every call with it.
        self.metadata: tuple[tuple[str, str], ...] = checked_metadata(metadata)
        tls_config = _tls_config(tls)
        # An int: a bulk job sends it as call metadata, and sizes its items within it.
        self._max_message_bytes = checked_message_bytes(max_message_bytes)
        self._channel_spec = channel_spec(
            target,
            tls=tls_config,
            max_message_bytes=self._max_message_bytes,
            options=options,
            interceptors=interceptors,
        )
        # The largest request the channel sends (None: no limit): max_message_bytes, unless
        # the caller's `options` replace it. A larger one is refused before it is sent.
        self._send_limit = send_limit(self._channel_spec.options, self._max_message_bytes)
        # Set by the first call (`_stub_here`): the channel, on that call's loop; set again
        # by the first call on another loop once that one is closed. Made here, it bound
        # to whichever loop was current (at import, one never run), and every call from
        # the app's own loop failed with gRPC's "attached to a different loop".
        self._opened: _Opened | None = None
        # Set by close(): no call starts or retries after it (ClientClosedError). Replaced
        # (unset) with the channel when the client moves to a new loop: an asyncio.Event
        # binds to the first loop that waits on it, and a wait on another loop failed
        # ("bound to a different event loop").
        self._closed = asyncio.Event()
        # The bulk jobs started on the client's loop and not yet collected: close() ends
        # their source reads. Replaced with the channel, as `_closed` is.
        self._jobs: weakref.WeakSet[BulkStream] = weakref.WeakSet()
        # Held while `_opened` is read to be replaced, or `_closed` to be set, so that one
        # channel is open at a time: threads' loops making their first calls at once each
        # opened one, every one but the last leaked, and their later calls failed.
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()

    def _own_lock(self) -> threading.Lock:
        """`_lock`, new in a child forked while another thread of the parent held it (it
        stays held there for good: a child whose parent forked during a first call's open
        blocked its every call and close(), their timeouts ignored). A fresh child runs
        one thread: nothing else holds or waits for the new one."""
        if self._lock_pid != os.getpid():
            self._lock = threading.Lock()
            self._lock_pid = os.getpid()
        return self._lock

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel; calls in progress end with ClientClosedError, those on the
        wire cancelled, those waiting to retry at once. Safe to call twice, and before any
        call (there is no channel yet). Made on the loop the client serves, or on any once
        that loop is closed; in a child forked from the process that opened the channel
        it returns at once, leaving gRPC alone (its state did not survive the fork)."""
        opened = self._opened
        # Before the lock, which a child replaces (`_own_lock`): gRPC's state is the
        # parent's.
        if opened is not None and opened.pid != os.getpid():
            return
        loop = asyncio.get_running_loop()
        with self._own_lock():
            opened = self._opened
            if opened is not None and loop is not opened.loop and not opened.loop.is_closed():
                # Refused before anything changes: its calls run on that loop, in another
                # thread, and gRPC's channel is not safe to close from this one.
                raise RuntimeError(_other_loop("close()"))
            self._closed.set()  # under the lock: no call opens a channel after it
        if opened is None:
            return
        # A job's read of its source in progress (an async generator running in a task
        # of its own) ends first: left running, the loop's shutdown could not close that
        # generator ("aclose(): asynchronous generator is already running"), whose
        # `finally` (a source thread's stop) then never ran. (A closed loop's are over.)
        jobs = list(self._jobs) if loop is opened.loop else []
        reads = [read for job in jobs if (read := job.cancel_source_read())]
        await opened.channel.close()
        if reads:
            await asyncio.wait(reads)

    async def infer(
        self,
        inputs: Mapping[str, npt.NDArray[Any]],
        *,
        lane: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a gRPC deadline the server sees too
        request_id: str | None = None,
        outputs: Sequence[str] | None = None,
        retry: RetryPolicy | None = None,
    ) -> Outputs:
        """Runs one request (one or more rows along the first axis of every input).

        Args:
            inputs: input name to array; dtypes must match the model's (see `model()`).
                A string input (dtype ``object`` in `model()`) takes any array of text:
                numpy ``str_``, ``object`` holding ``str``, or ``bytes_`` of UTF-8.
            lane: the lane to queue in; None: the server's default lane.
            timeout: seconds for the whole call from this call, building its request
                and retries included; what is left is the gRPC deadline of every attempt,
                so the server sheds the request once it passes. At most 2**32 - 1 ms (a
                lane's longest timeout); None: the client's `timeout` (by default none);
                ``math.inf``: none; 0 or less (what was left of a deadline), or one the
                build outlasts: DeadlineExceededError, nothing sent.
            request_id: reused by every attempt, so the server runs the request once
                however often it is retried; a random id when None.
            outputs: the names of the outputs to return (``["output"]``); None: all of
                them. One str (``"output"``) type-checks, as a str is a sequence of str,
                and is refused: TypeError.
            retry: overrides the client's `RetryPolicy` for this call.

        Returns:
            Output name to array. The arrays are read-only views of the received bytes
            (no copy); ``.copy()`` one to write to it. A string output is a new
            ``object`` array of ``str``.

        Raises:
            LaneserveError: the call failed (its subclass says how), or its answer could
                not be read (`UnreadableAnswerError`, code INTERNAL: the server's fault).
            TypeError: an argument of the wrong type (`inputs` not a mapping of names to
                numpy arrays, `outputs` one str), naming it.
        """
        answer = await self.infer_detailed(
            inputs, lane=lane, timeout=timeout, request_id=request_id, outputs=outputs, retry=retry
        )
        return answer.outputs

    async def infer_detailed(
        self,
        inputs: Mapping[str, npt.NDArray[Any]],
        *,
        lane: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a gRPC deadline, as in infer()
        request_id: str | None = None,
        outputs: Sequence[str] | None = None,
        retry: RetryPolicy | None = None,
    ) -> InferAnswer:
        """`infer`, answered with the outputs, the request's id (the random one where none
        was given) and the server's `Timing` of it (lane, batch size, queue and run
        microseconds): what a service logs beside its own latency. Arguments as `infer`'s."""
        sending = self._infer_call(inputs, lane, timeout, request_id, outputs, retry)
        return answer_of(await sending)

    def _infer_call(
        self,
        inputs: Mapping[str, npt.NDArray[Any]],
        lane: str | None,
        timeout: object,
        request_id: str | None,
        outputs: Sequence[str] | None,
        retry: RetryPolicy | None,
    ) -> Coroutine[Any, Any, Answered]:
        """Infer's call up to sending: its arguments checked and its request built now,
        on the calling thread (the sync `Client`'s caller's: built on the client's one
        thread, a large request held up every other thread's calls), its time counted
        from now (building is inside its timeout: 61 MB of input took 221 ms to encode,
        and a 5 ms timeout was raised after 361 ms, a review). The coroutine that sends
        it, answered with the request's id (a random one where none was given)."""
        started_s = time.monotonic()
        policy = checked_policy(retry, "retry") or self.retry
        timeout_s = self._timeout_s(timeout)
        # Checked first: a falsy id of another type (0) is refused, not taken for none.
        if request_id is not None:
            check_request_id(request_id)
        request_id = request_id or uuid.uuid4().hex
        request = infer_request(
            request_id, encode_inputs(inputs, request_id), lane=lane, outputs=output_names(outputs)
        )
        check_request_bytes(request, self._send_limit, request_id=request_id)
        return self._infer_sent(request, request_id, policy, timeout_s, started_s)

    async def _infer_sent(
        self,
        request: pb.InferRequest,
        request_id: str,
        policy: RetryPolicy,
        timeout_s: float | None,
        started_s: float,
    ) -> Answered:
        """`request` (`_infer_call`'s) sent, retried, within `timeout_s` of
        `started_s` (time.monotonic(), when the call began); its answer undecoded
        (`answer_of`: on the sync `Client`'s calling thread)."""
        sent = 0

        async def attempt(left_s: float | None) -> pb.InferResponse:
            nonlocal sent
            # call_with_retries' count of attempts (it returns none): the one refusal
            # before sending, a closed client's, is never retried.
            sent += 1
            return await self._call(_infer, request, left_s, request_id)

        response = await self._retried(
            attempt,
            policy=policy,
            timeout=timeout_s,
            what=f"Infer {request_id!r}",
            request_id=request_id,
            started_s=started_s,
        )
        return Answered(response, request_id, sent)

    async def model(self, *, timeout: float | None = None) -> ModelInfo:  # noqa: ASYNC109
        """The served model's signature, batch cap, lanes and providers, asked of the
        server at each call: never cached, as a server restarted at the same address may
        differ (a bulk job asks afresh too, before each of its calls). `timeout` as
        `infer`'s (None: the client's)."""
        return await self._model(self.retry, self._timeout_s(timeout))

    async def _model(
        self,
        policy: RetryPolicy,
        timeout: float | None,  # noqa: ASYNC109 - a gRPC deadline, as in infer()
    ) -> ModelInfo:
        async def attempt(timeout_s: float | None) -> ModelInfo:
            response = await self._call(_get_model, pb.GetModelRequest(), timeout_s, "")
            return ModelInfo.from_proto(response)

        return await self._retried(attempt, policy=policy, timeout=timeout, what="GetModel")

    async def stats(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - a gRPC deadline, as in infer()
    ) -> pb.GetStatsResponse:
        """Live counters and latency summaries. The message itself, so fields the server
        adds later are visible without a client release. `timeout` as `infer`'s (None:
        the client's)."""

        async def attempt(timeout_s: float | None) -> pb.GetStatsResponse:
            return await self._call(_get_stats, pb.GetStatsRequest(), timeout_s, "")

        return await self._retried(
            attempt, policy=self.retry, timeout=self._timeout_s(timeout), what="GetStats"
        )

    @property
    def timeout(self) -> float | None:
        """Seconds: the timeout of a unary call made without one (None: no default)."""
        return self._timeout_s_default

    def _timeout_s(self, timeout: object) -> float | None:
        """A unary call's `timeout` in seconds, checked: its own, else (None) the
        client's `timeout`."""
        return self._timeout_s_default if timeout is None else timeout_seconds(timeout)

    def stream(  # noqa: PLR0913 - keyword-only options of one call, each with a default
        self,
        requests: StreamSource,
        *,
        lane: str = DEFAULT_STREAM_LANE,
        window: int = 256,
        timeout_ms: int = 0,
        ordered: bool = True,
        outputs: Sequence[str] | None = None,
        job_id: str | None = None,
        rows_per_item: int = 64,
        window_rows: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> AsyncGenerator[StreamResult, None]:
        """Runs a bulk job over one InferStream call and yields one result per item.

        Leaving the iteration early (``break``, an exception) cancels the job (its call,
        the server's queued items, the reading of `requests`) only once the generator is
        closed: ``async with contextlib.aclosing(client.stream(...)) as results:``, or
        ``await results.aclose()``. One that nothing refers to any more is closed by
        garbage collection; one still referenced runs on until then.

        Args:
            requests: either one mapping of input name to array, sent as items of
                `rows_per_item` rows each; or an iterable (sync or async) of items, each a
                mapping of input name to array or a `StreamRequest` with its own id. A
                bare numpy array (rows without their input's name) type-checks, numpy's
                iteration being untyped, and is refused: TypeError.
            lane: the lane every item is queued in; "" (the default): the server's lane
                for streams (its `bulk` lane when it has one, else its default lane).
            window: items held at once (sent and unanswered, waiting for a retry, or, in
                order mode, answered ahead of an earlier item); the source is read no
                faster than that.
            timeout_ms: each item's budget, from its first send: a retry (or a resend
                over a new call) carries what is left, and none starts after it; an item
                unanswered when it passes is answered `DeadlineExceededError` then (the
                server's later answer dropped); 0: only the lane's timeout. The client's
                `timeout` does not apply: a job's items wait behind its own window, which
                a unary call's deadline does not count.
            ordered: yield results in item order (default), or as they arrive.
            outputs: the names of the outputs to return; None: all (one str is refused,
                as `infer` refuses it).
            job_id: the prefix of the items' request ids (``f"{job_id}-{index}"``). Give
                the same id to rerun a job after a crash: items the server completed
                within its replay window are answered without running again.
            rows_per_item: see `requests`.
            window_rows: rows sent and not answered, at most; None: the lane's capacity
                (from `model()`), so that one job never overfills its lane.
            retry: overrides the client's `RetryPolicy`: the attempts per item, and the
                consecutive broken calls (with no answer in between) before giving up.

        Yields:
            `StreamResult` per item, with outputs or the item's error (after its
            retries): a failed item never ends the job. An item this client cannot
            encode (not a mapping of input name to numpy array or a `StreamRequest`, an
            input that is not an array, a dtype with no wire type) is answered with
            `InvalidInputError` naming it, never sent. A source that raises is read no
            further: the items it gave are answered, then its exception is raised (a note
            says how many). An answer this client cannot read is that item's
            `UnreadableAnswerError`. A broken connection is
            resumed on a new call, resending only the unanswered items; when that
            keeps failing the iteration raises the connection's `LaneserveError`.

        Raises:
            TypeError: `requests` is a numpy array (see `requests`), or an option is of
                the wrong type, naming it; at the call, before anything is sent.
        """
        check_source(requests)
        policy = checked_policy(retry, "retry") or self.retry
        options = StreamOptions(
            lane=lane,
            window=window,
            timeout_ms=timeout_ms,
            ordered=ordered,
            outputs=output_names(outputs),
            job_id=job_id,
            rows_per_item=rows_per_item,
            window_rows=window_rows,
        )
        if self._closed.is_set():
            raise closed_before_sending()
        # First: on a new loop it replaces `_closed`, which the job waits on.
        stub = self._stub_here("stream()")
        job = BulkStream(
            stub,
            self.metadata + trace_metadata(),  # the context the job was started in
            requests,
            options,
            policy,
            server_limits=self._stream_limits,
            closed=self._closed,
            max_message_bytes=self._max_message_bytes,
            send_limit=self._send_limit,
        )
        self._jobs.add(job)
        return job.results()

    async def _stream_limits(self, lane: str, policy: RetryPolicy) -> StreamLimits | None:
        """The server's bounds on a bulk job in `lane`, from `model()`: the lane's capacity
        in rows, and the largest message the server reads; None when it did not answer.
        Asked before each call of a job, never kept: a server restarted at the same
        address may have others (a smaller message limit ended the whole call on an item
        within the old one).

        Raises:
            InvalidInputError: the server has no lane `lane`: every item would be
                answered so, one by one (a job of 2000 items, 2000 errors).
        """
        try:
            model = await self._model(policy, STREAM_LIMITS_TIMEOUT_S)
        except LaneserveError as error:
            log.debug("no server limits for the stream: %s", error)
            return None
        names = [info.name for info in model.lanes]
        if lane and names and lane not in names:  # no lanes: a server that names none
            raise refused(f"unknown lane {lane!r}; expected one of the server's lanes {names}")
        # The lane the server queues the items in (its rule for streams, when none is named).
        name = lane or (SERVER_STREAM_LANE if SERVER_STREAM_LANE in names else model.default_lane)
        capacity = next((info.capacity_rows for info in model.lanes if info.name == name), None)
        return StreamLimits(capacity, model.max_message_bytes or None)

    async def _retried(
        self,
        attempt: Callable[[float | None], Awaitable[T]],
        *,
        policy: RetryPolicy,
        timeout: object,  # noqa: ASYNC109 - a gRPC deadline, as in infer()
        what: str,
        request_id: str = "",
        started_s: float | None = None,
    ) -> T:
        """`attempt` run by `call_with_retries` within the call's `timeout` from
        `started_s` (None: now), on the client's channel for the running loop, opened (or
        moved to this loop) first: its backoffs wait on the `_closed` of the loop they
        run on."""
        timeout_s = timeout_seconds(timeout)
        if not self._closed.is_set():  # a closed client's attempt says so itself
            self._stub_here("a call", request_id)
        return await call_with_retries(
            attempt,
            policy=policy,
            timeout_s=timeout_s,
            what=what,
            closed=self._closed,
            budget=self._retry_tokens,
            spent_s=0.0 if started_s is None else time.monotonic() - started_s,
            request_id=request_id,
        )

    def _stub_here(self, call: str, request_id: str = "") -> pb_grpc.InferenceServiceAsyncStub:
        """The stub of the client's channel, for a `call` on the running loop; the first
        call opens the channel on its loop, which the client serves from then on (until
        that loop is closed: see `_open_here`).

        Raises:
            RuntimeError: the call is made with no loop running, on a loop other than
                the client's while that one is open, or in a child forked from the
                process that opened the channel; before gRPC is called (its refusal left
                a coroutine of its own never awaited, and a RuntimeWarning).
            ClientClosedError: the client was closed (from another loop, its own being
                closed) as this call was about to open a channel.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                f"AsyncClient.{call} was called with no event loop running; expected a "
                "call in a coroutine on the loop the client serves (`async for result in "
                "client.stream(...)`)"
            ) from None
        opened = self._opened
        if opened is None or opened.loop is not loop or opened.pid != os.getpid():
            opened = self._open_here(loop, call, request_id)
        return opened.stub

    def _open_here(self, loop: asyncio.AbstractEventLoop, call: str, request_id: str) -> _Opened:
        """The client's channel for a `call` on `loop`: opened there when the client has
        none yet, or when the loop it served is closed. The old channel cannot be closed
        on its closed loop: it is dropped, and gRPC's channel closes itself as it is freed
        (nothing of it runs on that loop, and nothing is printed). Raises as `_stub_here`."""
        opened = self._opened
        # The process first: a child forked inside a running loop runs that very loop.
        if opened is not None and opened.pid != os.getpid():
            raise RuntimeError(
                forked_message("the channel of this laneserve AsyncClient", opened.pid)
            )
        with self._own_lock():
            opened = self._opened
            # Read again under the lock: another thread, on its own loop, may have opened it.
            if opened is not None and opened.loop is loop:
                return opened
            if opened is not None and not opened.loop.is_closed():
                raise RuntimeError(_other_loop(call))
            if self._closed.is_set():
                raise closed_before_sending(request_id)
            if opened is not None:
                # The old loop's are over: its calls and jobs ended as it closed.
                self._closed = asyncio.Event()
                self._jobs = weakref.WeakSet()
            channel = open_channel(self._channel_spec)
            self._opened = _Opened(
                channel, pb_grpc.InferenceServiceStub(channel), loop, os.getpid()
            )
            return self._opened

    async def _call(
        self,
        method_of: Callable[[pb_grpc.InferenceServiceAsyncStub], Callable[..., Awaitable[T]]],
        request: Any,
        timeout_s: float | None,
        request_id: str,
    ) -> T:
        if self._closed.is_set():  # `call_with_retries` counts no attempt refused so
            raise closed_before_sending(request_id)
        method = method_of(self._stub_here("a call", request_id))
        try:
            metadata = self.metadata + trace_metadata()
            return await method(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as error:
            if self._closed.is_set():  # cancelled by close(), not by the network
                raise ClientClosedError(request_id=request_id) from error
            raise error_from_rpc(error, request_id=request_id) from error
        except grpc.aio.UsageError as error:  # the channel closed under the call
            raise ClientClosedError(request_id=request_id) from error
        except asyncio.CancelledError as cancelled:
            # gRPC ends a call that close() cancelled on the wire with CancelledError; the
            # caller's own cancellation of this task stays a cancellation.
            task = asyncio.current_task()
            if self._closed.is_set() and task is not None and not task.cancelling():
                raise ClientClosedError(request_id=request_id) from cancelled
            raise


@dataclasses.dataclass(frozen=True, slots=True)
class _Opened:
    """A client's channel, from its first call on `loop` (in `pid`) until a call on
    another loop once `loop` is closed: the client serves `loop`, in `pid`."""

    channel: grpc.aio.Channel
    stub: pb_grpc.InferenceServiceAsyncStub
    loop: asyncio.AbstractEventLoop
    pid: int


def _infer(
    stub: pb_grpc.InferenceServiceAsyncStub,
) -> Callable[..., Awaitable[pb.InferResponse]]:
    return stub.Infer


def _get_model(
    stub: pb_grpc.InferenceServiceAsyncStub,
) -> Callable[..., Awaitable[pb.GetModelResponse]]:
    return stub.GetModel


def _get_stats(
    stub: pb_grpc.InferenceServiceAsyncStub,
) -> Callable[..., Awaitable[pb.GetStatsResponse]]:
    return stub.GetStats


def _other_loop(call: str) -> str:
    """The refusal of a `call` made on another event loop than the client's, still open."""
    return (
        "this laneserve AsyncClient serves the event loop it was first used on (still "
        f"open, in another thread or idle), and {call} was made on another loop: a gRPC "
        "channel belongs to the loop it was opened on. Expected one AsyncClient per event "
        "loop that runs at the same time (per thread's loop), made or first used on it and "
        "closed there; a client moves to another loop only once its loop is closed"
    )


def _tls_config(tls: object) -> TlsConfig | None:
    """The `tls` argument's settings; None: plaintext.

    Raises:
        TypeError: `tls` is not a TlsConfig, a bool (numpy's too, as numpy's integers are
            integers) or None (a string was taken for a TlsConfig, and failed with
            AttributeError on its `server_name`).
    """
    if tls is None or isinstance(tls, bool | np.bool_):
        return TlsConfig() if tls else None
    if not isinstance(tls, TlsConfig):
        raise TypeError(
            f"tls: expected True (the system's roots), False or None (plaintext), or a "
            f"TlsConfig; got {type(tls).__name__} ({reprlib.repr(tls)})"
        )
    return tls


@dataclasses.dataclass(frozen=True, slots=True)
class Answered:
    """An Infer call's answer, not yet decoded (`answer_of`)."""

    response: pb.InferResponse = dataclasses.field(repr=False)
    request_id: str
    attempts: int  # the attempts sent, the answered one included


def answer_of(answered: Answered) -> InferAnswer:
    """An Infer answer decoded (its arrays views of its bytes).

    Raises:
        UnreadableAnswerError: a tensor of the answer does not decode (the server's
            fault: a ValueError, as the codec raises, blamed the caller).
    """
    response = answered.response
    try:
        outputs = {tensor.name: decode_tensor(tensor) for tensor in response.outputs}
    except ValueError as error:
        raise unreadable_answer(
            str(error), request_id=answered.request_id, attempts=answered.attempts
        ) from error
    return InferAnswer(outputs, answered.request_id, Timing.from_proto(response.timing))


def default_timeout_s(timeout: object) -> float | None:
    """The client's `timeout` in seconds, checked; None: no default.

    Raises:
        TypeError: not a number or None.
        ValueError: 0 or less (every call would fail, nothing sent), or over
            MAX_TIMEOUT_S.
    """
    seconds = timeout_seconds(timeout)
    if seconds is not None and seconds <= 0:
        raise ValueError(
            f"timeout: expected the seconds of a call made without one, > 0, or None (no "
            f"default) or inf; got {timeout!r}"
        )
    return seconds


def timeout_seconds(timeout: object) -> float | None:
    """The call's `timeout` in seconds, checked; None: none."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"timeout: expected seconds (a number) or None, got {type(timeout).__name__}"
        )
    seconds = float(timeout)
    if seconds == math.inf:
        return None
    if not seconds <= MAX_TIMEOUT_S:  # also true for nan
        raise ValueError(
            f"timeout: expected seconds <= {MAX_TIMEOUT_S} (2**32 - 1 ms), or None or inf for "
            f"none; got {timeout!r}"
        )
    # 0 or less: a deadline passed already (a service passing on what is left of its
    # own), the call's DeadlineExceededError, never sent (`call_with_retries`); a
    # ValueError, it was no LaneserveError, and a service mapped it to a 500, not a 504.
    return max(seconds, 0.0)
