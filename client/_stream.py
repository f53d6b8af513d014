"""Bulk jobs over ``InferStream``: a window of items in flight, per-item retries, and
resumption after a dropped connection.

One `BulkStream` runs one job. Over one stream call at a time, a writer task sends items
while fewer than ``window`` are held (read from the source and not yet handed to the
caller), and a reader task turns each answer into a final `StreamResult`, or schedules
the item again when its error is retryable (same request_id, backoff, server pushback,
capped attempts). When the call breaks (connection lost, server gone), the items sent on
it and not answered are sent again on a new call, and only those: the server's
idempotency by request_id answers those that ran already without running them twice.

Ownership: everything here runs on one event loop; the writer, the reader and the
retry timers only touch the state between awaits, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import math
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
)
from typing import Any, Final

import grpc
import numpy as np
import numpy.typing as npt

from laneserve.client._channel import RECEIVE_LIMIT_KEY, checked_integer
from laneserve.client._errors import (
    OVER_RECEIVE_LIMIT,
    CallCancelledError,
    ClientClosedError,
    ExpiredInQueueError,
    InvalidInputError,
    LaneserveError,
    ResourceExhaustedError,
    UnavailableError,
    error_from_rpc,
    error_from_status,
    unreadable_answer,
)
from laneserve.client._request import (
    check_request_id,
    checked_inputs,
    encode_inputs,
    infer_request,
    refused,
    utf8_bytes,
)
from laneserve.client._retry import (
    NO_RETRIES,
    RetryPolicy,
    attempts_allowed,
    closed_within,
    effective_delay_s,
    retry_wait,
)
from laneserve.client._types import StreamRequest, StreamResult, Timing
from laneserve.client.tensors import decode_tensor
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

__all__ = [
    "BulkStream",
    "StreamItem",
    "StreamOptions",
    "StreamSource",
    "check_source",
    "row_chunks",
]

log = logging.getLogger("laneserve.client")

Arrays = Mapping[str, npt.NDArray[Any]]
# One item of a bulk job: input name to array, or a `StreamRequest` (its own request_id).
StreamItem = Arrays | StreamRequest
# A bulk job's `requests`: one mapping (split into items of `rows_per_item` rows), or an
# iterable (sync or async) of items.
StreamSource = Arrays | Iterable[StreamItem] | AsyncIterable[StreamItem]
Metadata = tuple[tuple[str, str], ...]


def check_source(source: object) -> None:
    """Refuses a bulk job's source that is a numpy array: rows without their input's
    name (``stream(rows)`` for ``stream({"input": rows})``). It type-checks (numpy's
    iteration is untyped), and each of its rows was answered alone with an error naming
    no cause ("expected a mapping ..., got ndarray"), `rows_per_item` ignored.

    Raises:
        TypeError: `source` is a numpy array, naming what was given and what is expected.
    """
    if isinstance(source, np.ndarray):
        raise TypeError(
            f"requests: expected a mapping of input name to array ({{name: rows}}: one job of "
            "rows_per_item-row items) or an iterable of items (each such a mapping or a "
            f"StreamRequest); got a numpy array of shape {source.shape}, which names no "
            "input: stream({name: rows}, ...)"
        )


def row_chunks(inputs: Arrays, rows_per_item: int) -> Iterator[Arrays]:
    """Views of `inputs` of `rows_per_item` rows each (the last may be shorter).

    `inputs` is read once (a mapping may compute its arrays at each read) and checked at
    once, as `infer` checks its inputs: what is wrong with them would be wrong with every
    item, or leave no item at all.

    Raises:
        TypeError: `inputs` is not a mapping of names to numpy arrays.
        InvalidInputError: no inputs, an input without a row (first) axis, or inputs of
            different row counts.
    """
    if rows_per_item < 1:
        raise ValueError(f"rows_per_item: expected >= 1, got {rows_per_item}")
    arrays = checked_inputs(inputs)
    if not arrays:
        raise refused("inputs: expected at least one input, got an empty mapping")
    for name, array in arrays.items():
        if array.ndim == 0:
            raise refused(
                f"input {name!r}: expected an array with a row (first) axis to split into "
                "items, got a 0-d array (a scalar)"
            )
    counts = {name: array.shape[0] for name, array in arrays.items()}
    if len(set(counts.values())) > 1:
        raise refused(f"inputs must have the same number of rows (first axis), got {counts}")
    return _chunks(arrays, next(iter(counts.values())), rows_per_item)


def _chunks(arrays: Arrays, total: int, rows_per_item: int) -> Iterator[Arrays]:
    for start in range(0, total, rows_per_item):
        yield {name: array[start : start + rows_per_item] for name, array in arrays.items()}


class _State(enum.Enum):
    QUEUED = "queued"  # waiting for the writer
    SENT = "sent"  # written on the current call, not answered
    BACKOFF = "backoff"  # answered with a retryable error; resent when its timer fires


@dataclasses.dataclass(eq=False, slots=True)
class _Item:
    index: int
    request_id: str
    message: pb.InferRequest = dataclasses.field(repr=False)
    rows: int
    # How messages name it: its index, or its caller's own request_id (see `_item_name`).
    name: str
    state: _State = _State.QUEUED
    # Sends that asked for an answer: the first, and one per retry after a retryable
    # error answer. A resend after a broken call is not one: it asks again for the answer
    # the server owes to the send before it (joined or replayed by request_id).
    attempts: int = 0
    timer: asyncio.TimerHandle | None = None
    # `timeout_ms` from its first send (time.monotonic(); None: no timeout_ms): every
    # send, a retry's or a resend's, carries what is left of it, and none starts after it.
    deadline_s: float | None = None
    # Fires at `deadline_s`: the item is answered then, whatever the server has done.
    expiry: asyncio.TimerHandle | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _CallEnded:
    # None: the server closed the stream normally (OK status).
    error: LaneserveError | None


@dataclasses.dataclass(frozen=True, slots=True)
class _Failed:
    # The job cannot go on (the client closed while the source was read, or a bug in
    # the reader): it ends with this error.
    error: Exception


_Event = StreamResult | _CallEnded | _Failed


# The lane bulk jobs ask for unless told otherwise: none, so the server's own default for
# streams applies (its `bulk` lane when it has one, else its default lane).
DEFAULT_STREAM_LANE = ""
# The lane a server queues a stream's items in when they name none, if it has it.
SERVER_STREAM_LANE = "bulk"
# A job that has had answers keeps opening new calls for this long after its last
# answer, whatever its retry policy's attempts, before it gives up: the server went away
# (a drain, then a restart at the same address) and may take seconds to come back; the
# policy's 6 attempts were spent in about 3 s.
STREAM_RESUME_S = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class StreamLimits:
    """The server's bounds on a bulk job, asked before each of its calls."""

    # Rows the job's lane holds (None: unknown): the row window's default.
    capacity_rows: int | None
    # The largest message the server reads (None: unknown).
    max_message_bytes: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class StreamOptions:
    """How a bulk job is sent; see `AsyncClient.stream`."""

    lane: str = DEFAULT_STREAM_LANE
    # Items held at once: sent and unanswered, waiting for a retry, or answered and not
    # yet taken by the caller (in order mode, waiting for an earlier item).
    window: int = 256
    # Per-item budget from its first send, retries and resends included; 0: only the
    # lane's timeout applies.
    timeout_ms: int = 0
    ordered: bool = True
    outputs: tuple[str, ...] = ()
    # Prefix of the items' request ids (f"{job_id}-{index}"); random when None. A job
    # restarted with the same id and items is answered from the server's replay cache
    # for the items that completed already.
    job_id: str | None = None
    # When the source is one mapping of arrays: rows per item.
    rows_per_item: int = 64
    # Rows sent and not finally answered, at most (one larger item still goes alone).
    # None: the lane's capacity as the server reports it, so that one job alone never
    # overfills its lane and spends its retries on LANE_FULL.
    window_rows: int | None = None

    def __post_init__(self) -> None:
        # Types first: a str compared with an int was a bare TypeError naming no option,
        # and a float timeout_ms failed at the first item ("bulk stream item 0: 'float'
        # object cannot be interpreted as an integer"). Stored as int (a numpy integer
        # is taken, and protobuf's fields take it as an int).
        for key in ("window", "timeout_ms", "rows_per_item"):
            object.__setattr__(self, key, checked_integer(key, getattr(self, key)))
        if self.window_rows is not None:
            object.__setattr__(
                self, "window_rows", checked_integer("window_rows", self.window_rows)
            )
        if self.window < 1:
            raise ValueError(f"window: expected >= 1 item, got {self.window}")
        if not 0 <= self.timeout_ms < 2**32:
            raise ValueError(f"timeout_ms: expected 0 (none) to 2**32 - 1, got {self.timeout_ms}")
        if self.rows_per_item < 1:
            raise ValueError(f"rows_per_item: expected >= 1, got {self.rows_per_item}")
        if self.window_rows is not None and self.window_rows < 1:
            raise ValueError(f"window_rows: expected >= 1 row or None, got {self.window_rows}")
        # Every item carries these: one protobuf cannot encode is refused once, here, not
        # as every item's error (InvalidInputError, naming the field).
        utf8_bytes("lane", self.lane)
        for name in self.outputs:
            utf8_bytes("output name", name)
        if self.job_id is not None:
            utf8_bytes("job_id", self.job_id)


class BulkStream:
    """One bulk job; iterate `results()` once."""

    def __init__(  # noqa: PLR0913 - keyword-only past the policy, one per bound of a job
        self,
        stub: pb_grpc.InferenceServiceAsyncStub,
        metadata: Metadata,
        source: StreamSource,
        options: StreamOptions,
        policy: RetryPolicy,
        *,
        server_limits: Callable[[str, RetryPolicy], Awaitable[StreamLimits | None]] | None = None,
        closed: asyncio.Event | None = None,
        max_message_bytes: int | None = None,
        send_limit: tuple[int, str] | None = None,
    ) -> None:
        """`send_limit`: the largest message the channel sends, and the setting's name,
        where a caller's option set it under `max_message_bytes` (gRPC's own check would
        end the whole call on a larger item, "CLIENT: Sent message larger than max")."""
        self._stub = stub
        self._closed = closed  # set when the client closes: no new call starts
        # The server's bounds for a lane, asked with a retry policy; None: no answer.
        self._server_limits = server_limits
        # The call's metadata: the caller's, and the largest answer this client reads
        # (its message limit, both ways). The caller's holds no value of that key:
        # the server refuses a call with two (`metadata_pair` refuses it).
        self._metadata = (
            metadata
            if max_message_bytes is None
            else (*metadata, (RECEIVE_LIMIT_KEY, str(max_message_bytes)))
        )
        self._client_max_bytes: float = math.inf if max_message_bytes is None else max_message_bytes
        self._client_limit_name = "max_message_bytes"
        if send_limit is not None and send_limit[0] < self._client_max_bytes:
            self._client_max_bytes, self._client_limit_name = send_limit
        if isinstance(source, Mapping):
            source = row_chunks(source, options.rows_per_item)
        self._sync_source: Iterator[StreamItem] | None = None
        self._async_source: AsyncIterator[StreamItem] | None = None
        if isinstance(source, AsyncIterable):
            self._async_source = aiter(source)
        else:
            self._sync_source = iter(source)
        self._options = options
        self._window = options.window
        self._ordered = options.ordered
        self.job_id = options.job_id or uuid.uuid4().hex
        self._policy = policy
        self._allowed = attempts_allowed(policy)

        self._source_done = False
        # What the source raised, if it did (then `_source_done`): the job's end.
        self._source_error: Exception | None = None
        # The async source's next item while it is being produced: it outlives a writer
        # cancelled with its broken call (see _pull).
        self._source_next: asyncio.Future[StreamItem | object] | None = None
        self._pulled = 0  # items taken from the source
        # Answers the server gave (results or item errors): what tells a broken call that
        # answered something from one that answered nothing. Items this client refused
        # itself, or gave up on, are answered too, but without the server: counted as
        # progress, they reset the count of broken calls in a row.
        self._server_answers = 0
        # Pulled and not yet handed to the caller. The source is read only while these and
        # `_expired` are fewer than `window` (an expired item not yet taken counts twice).
        self._held = 0
        # The options', else the lane's capacity once known (see _set_limits).
        self._window_rows: float = options.window_rows or math.inf
        # An item over this is answered with an error, not sent: gRPC would fail the
        # whole call with it. This client's limit, and the server's once known (the
        # server the next call goes to: see _set_limits).
        self._max_item_bytes = self._client_max_bytes
        # Rows of the items taken for sending and not finally answered: at most
        # `_window_rows`, or one item alone.
        self._rows_out = 0
        # Pulled, but waits for `_rows_out` to make room for it.
        self._stashed: _Item | None = None
        # Items pulled and not finally answered, by request_id.
        self._items: dict[str, _Item] = {}
        # Items answered DeadlineExceededError while sent on the current call and not
        # answered by the server, by request_id: the server holds them still (in its lane,
        # its engine, or unread in gRPC's flow control), so they keep their place in the
        # window and their rows in `_rows_out` until its answer, which is dropped, or the
        # call's end.
        self._expired: dict[str, _Item] = {}
        self._to_send: collections.deque[_Item] = collections.deque()
        self._ready: dict[int, StreamResult] = {}  # ordered mode: answers ahead of their turn
        self._next_index = 0  # ordered mode: the next index to hand out
        self._events: asyncio.Queue[_Event] = asyncio.Queue()
        self._wakeup = asyncio.Event()  # the writer may have something to do

    # ---- the caller's side -----------------------------------------------------------

    async def results(self) -> AsyncGenerator[StreamResult, None]:
        """Final results: ordered by index, or as they come when not `ordered`. The job
        ends early (its call cancelled, its source read no further) only when this
        generator is closed: its `finally` runs then, not at the caller's ``break``."""
        failures = 0  # consecutive broken calls that answered nothing
        last_answer_s: float | None = None  # when a call last answered an item
        # The first call's limits are asked with the job's retries; a later call's once:
        # the job's own resumption retries it.
        limits_policy = self._policy
        while True:
            await self._set_limits(limits_policy)
            limits_policy = NO_RETRIES
            self._check_open()
            answered_before = self._server_answers
            call = self._stub.InferStream(metadata=self._metadata)
            tasks = (
                asyncio.create_task(self._write(call)),
                asyncio.create_task(self._read(call)),
            )
            ended: _CallEnded | None = None
            try:
                while ended is None:
                    event = await self._events.get()
                    if isinstance(event, StreamResult):
                        self._held -= 1
                        self._wakeup.set()
                        yield event
                    elif isinstance(event, _Failed):
                        raise event.error
                    else:
                        ended = event
            finally:
                call.cancel()
                for task in tasks:
                    task.cancel()
                await asyncio.wait(tasks)  # neither outlives its call
                self._forget_expired()
                if ended is None:  # the caller stopped early, or the source failed
                    await self._stop_reading()
            # Every item has its final answer: the job is done, whatever the call ended
            # with (the connection may go after the last answer, before the call's end).
            if self._source_done and not self._items:
                while not self._events.empty():  # results queued after the stream closed
                    event = self._events.get_nowait()
                    assert isinstance(event, StreamResult)
                    self._held -= 1
                    yield event
                self._raise_source_error()
                return
            self._check_open(ended.error)  # close() ended the call: whatever its error, no new one
            error = ended.error or UnavailableError(
                f"the server closed the stream with {len(self._items)} item(s) unanswered"
            )
            progressed = self._server_answers > answered_before
            failures = 0 if progressed else failures + 1
            if progressed:
                last_answer_s = time.monotonic()
            if self._gives_up(error, failures, last_answer_s):
                self._cancel_timers()
                raise error
            last_answer_s = await self._pause(error, failures, last_answer_s)

    async def _pause(
        self, error: LaneserveError, failures: int, last_answer_s: float | None
    ) -> float | None:
        """Between a broken call and the next, which resends its unanswered items first:
        the policy's backoff, or the server's pushback. close() ends the wait at once.
        Returns `last_answer_s` moved back by the wait test mode skipped: it skips the
        sleeps, not the time they stand for, so the resume window counts them as waited
        (else a job reopened its call without pause, ~1e5 calls, for STREAM_RESUME_S)."""
        resent = self._requeue_sent()
        wanted_s = self._policy.delay_s(max(failures, 1), error.retry_after_s)
        delay_s = effective_delay_s(wanted_s)
        # The first of a run of broken calls at WARNING: a job's log at the default level
        # said nothing of a server restarted under it (a user's evaluation); the rest of
        # the run (a server down, tried again with backoff) at INFO. A call that answered
        # something ends a run (`failures` 0), and so does the job's start.
        first_of_run = failures == 0 or (failures == 1 and last_answer_s is None)
        log.log(
            logging.WARNING if first_of_run else logging.INFO,
            "bulk stream %s: call broke (%s); resending %d unanswered item(s) in %.0f ms",
            self.job_id,
            error,
            resent,
            delay_s * 1000,
        )
        if await closed_within(self._closed, delay_s):
            self._check_open(error)
        return None if last_answer_s is None else last_answer_s - (wanted_s - delay_s)

    def _gives_up(self, error: LaneserveError, failures: int, last_answer_s: float | None) -> bool:
        """Whether the job ends with `error` (then noted why) after its call broke:
        for good, or after `failures` broken calls in a row that answered nothing, once
        STREAM_RESUME_S have passed since its last answer (if it had any)."""
        if not error.should_retry:  # no new call mends it (see `_call_error`)
            error.add_note(
                f"bulk stream {self.job_id}: the call failed for good; {self._unanswered()}"
            )
            return True
        resuming = last_answer_s is not None and (
            time.monotonic() - last_answer_s < STREAM_RESUME_S
        )
        if failures < self._allowed or resuming:
            return False
        error.attempts = failures
        since = "" if last_answer_s is None else f" and {STREAM_RESUME_S:g} s"
        error.add_note(
            f"bulk stream {self.job_id}: gave up after {failures} broken call(s) "
            f"in a row with no answer{since}; {self._unanswered()}"
        )
        return True

    def _raise_source_error(self) -> None:
        """Every item is answered: the source's failure, if it raised, is the job's end.

        Raises:
            Exception: what the source raised, noted with the items it gave.
        """
        if self._source_error is not None:
            self._source_error.add_note(
                f"bulk stream {self.job_id}: the source raised after {self._pulled} "
                f"item(s); all {self._pulled} were answered (yielded) before this, "
                "and the source was not read further"
            )
            raise self._source_error

    def _unanswered(self) -> str:
        """What the job leaves unanswered, as far as it knows: the items it read, and
        whether the source had more."""
        if self._source_error is not None:
            return (
                f"{len(self._items)} item(s) unanswered; the source raised after "
                f"{self._pulled} item(s) ({self._source_error!r}) and was not read further"
            )
        if self._source_done:
            return f"{len(self._items)} item(s) unanswered; the source was read to its end"
        return f"{len(self._items)} item(s) read and unanswered; the source was not read further"

    # ---- the writer ------------------------------------------------------------------

    async def _write(
        self, call: grpc.aio.StreamStreamCall[pb.InferRequest, pb.InferStreamResponse]
    ) -> None:
        while True:
            try:
                item = await self._next_to_send()
            except Exception as error:  # noqa: BLE001 - a closed client's (see _read_source): the job's end
                self._events.put_nowait(_Failed(error))
                return
            try:
                if item is None:
                    if self._expired:
                        # Every item is answered; the server's answers to these would
                        # be dropped: the call ends now, and the server frees them, not
                        # once it has run them. The reader reports the end, as always.
                        call.cancel()
                        return
                    await call.done_writing()
                    return
                if not self._within_timeout(item) or not self._within_message_limit(item):
                    continue
                item.state = _State.SENT
                if item.attempts == 0:
                    item.attempts = 1
                await call.write(item.message)
            except Exception:  # noqa: BLE001 - gRPC's, whatever its type: the reader reports how
                # The call broke or ended. Not only grpc.RpcError: a half-close on a lost
                # connection raises gRPC's internal ExecuteBatchError, which went to the
                # caller as the source's failure.
                return

    def _within_timeout(self, item: _Item) -> bool:
        """Sets the time left of `item`'s timeout_ms on its message before a send;
        False, the item answered DeadlineExceededError, when none is left: the server
        counts timeout_ms from each arrival, and a retried item had it whole each time.
        At its first send, its whole timeout_ms is left (this runs just before the write),
        and its expiry starts: the server counts from its read of the item, which can
        come long after (see `_expire`)."""
        timeout_ms = self._options.timeout_ms
        if timeout_ms == 0:
            return True
        now_s = time.monotonic()
        if item.deadline_s is None:
            item.deadline_s = now_s + timeout_ms / 1000
            item.expiry = asyncio.get_running_loop().call_later(
                timeout_ms / 1000, self._expire, item
            )
            return True
        left_ms = math.ceil((item.deadline_s - now_s) * 1000)
        if left_ms > 0:
            item.message.timeout_ms = left_ms
            return True
        self._finish(
            item,
            None,
            _timed_out(
                item,
                f"its timeout_ms ({timeout_ms} ms from its first send) passed before it "
                f"could be sent again (sent {item.attempts} time(s) for an answer, then the "
                "call broke or a retry waited)",
            ),
        )
        return False

    async def _set_limits(self, policy: RetryPolicy) -> None:
        """The limits of the server the next call goes to, asked afresh before each call:
        a server restarted at the same address (a resumed job's, or a later job's) may
        have others. Unanswered, the last known stay (at first, this client's own).

        Raises:
            InvalidInputError: the server has no lane of the job's `lane` (the job ends:
                every item would be refused alike).
        """
        if self._server_limits is None:
            return
        try:
            limits = await self._server_limits(self._options.lane, policy)
        except InvalidInputError as refusal:
            refusal.add_note(
                f"bulk stream {self.job_id}: refused before its call; {self._unanswered()}"
            )
            self._cancel_timers()
            raise
        if limits is None:
            return
        window_rows = self._options.window_rows or limits.capacity_rows
        self._window_rows = math.inf if window_rows is None else window_rows
        if limits.max_message_bytes is not None:
            self._max_item_bytes = min(self._client_max_bytes, limits.max_message_bytes)

    async def _next_to_send(self) -> _Item | None:
        """The next item to write; None when every item has its final answer."""
        while True:
            if self._to_send:
                return self._to_send.popleft()
            stashed = self._stashed
            if stashed is not None:
                if self._take(stashed):
                    self._stashed = None
                    return stashed
            elif not self._source_done and self._held + len(self._expired) < self._window:
                pulled = await self._pull()
                if pulled is None:
                    continue
                if self._take(pulled):
                    return pulled
                self._stashed = pulled
                continue
            if self._source_done and not self._items:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()

    def _take(self, item: _Item) -> bool:
        """Counts `item`'s rows as out if they fit the row window (or nothing is out)."""
        if self._rows_out and self._rows_out + item.rows > self._window_rows:
            return False
        self._rows_out += item.rows
        return True

    def _id_refusal(self, index: int, request_id: str, name: str) -> InvalidInputError | None:
        """Why item `index` (`name`, `_item_name`'s) cannot be sent with `request_id`, or
        None when it can.

        Raises:
            TypeError: `request_id` is not a str (the item is answered with it).
        """
        # Its type checked first: an id of another type may not even be hashable. Its
        # length too, before the lookup: no id over the limit is ever in flight.
        try:
            check_request_id(
                request_id,
                field=f"{name}: request_id",
                expected="a shorter id (or job_id)",
            )
        except InvalidInputError as refusal:
            return refusal
        if request_id in self._items or request_id in self._expired:
            return refused(
                f"bulk stream item {index}: request_id {request_id!r} is already in flight "
                "in this stream; expected a unique id per item",
                request_id,
            )
        return None

    async def _pull(self) -> _Item | None:
        """The next item from the source, encoded; None at the end of the source (or its
        failure), or when the item failed to encode (it is answered with its error at
        once)."""
        raw = await self._read_source()
        if raw is _SOURCE_END:
            return None
        index = self._pulled
        self._pulled += 1
        self._held += 1
        return self._encoded(raw, index)

    async def _read_source(self) -> object:
        """The source's next item, or _SOURCE_END (then `_source_done`): its end, or its
        failure (`_source_failed`)."""
        if self._async_source is not None:
            pending = self._source_next
            if pending is None:
                # A closed client's job reads its source no further: a read started while
                # the client closed (after `cancel_source_read`, as its channel closed)
                # still ran when the sync client's loop shut its generators down, which
                # could not close the source's reader then, and its thread lived on.
                self._check_open()
                pending = self._source_next = asyncio.ensure_future(_anext(self._async_source))
            # Shielded: when a call breaks, its writer is cancelled, possibly while the
            # source is producing the next item. Cancelling the source there would end
            # (an async generator) or lose that item; the next call's writer awaits the
            # same pending item instead. It stays pending until taken here: a writer
            # cancelled after the item was produced, before it resumed, must not drop it
            # (that lost an item, and shifted every later item's index by one).
            try:
                raw = await asyncio.shield(pending)
            except Exception as error:  # noqa: BLE001 - the source's, raised once its items are answered
                self._source_next = None
                self._source_failed(error)
                return _SOURCE_END
            self._source_next = None
            if raw is _SOURCE_END:
                self._source_done = True
            return raw
        assert self._sync_source is not None
        try:
            return next(self._sync_source)
        except StopIteration:
            self._source_done = True
        except Exception as error:  # noqa: BLE001 - the source's, raised once its items are answered
            self._source_failed(error)
        return _SOURCE_END

    def _encoded(self, raw: object, index: int) -> _Item | None:
        """Item `index` (`raw`, from the source) encoded, or None: answered with its
        error at once."""
        # An item this client cannot send (of a wrong type, or refused as infer() refuses
        # its inputs) is answered with its InvalidInputError, never sent, and the job goes
        # on: ending it there dropped the answers to the items sent before it.
        try:
            inputs, request_id = self._unpack(raw, index)
            name = _item_name(index, request_id, self.job_id)
            refusal = self._id_refusal(index, request_id, name)
        except TypeError as error:  # not an item, or an id not a str: no id to answer by
            self._emit(StreamResult(index, "", None, refused(str(error)), 0))
            return None
        if refusal is not None:
            self._emit(StreamResult(index, request_id, None, refusal, 0))
            return None
        try:
            message = infer_request(
                request_id,
                encode_inputs(inputs, request_id),
                lane=self._options.lane,
                timeout_ms=self._options.timeout_ms,
                outputs=self._options.outputs,
            )
        except (InvalidInputError, TypeError) as error:
            # Named by its item, as README says every item's error is: a dtype with no
            # wire type said "tensor 'input': numpy dtype complex64 ...", naming no item
            # (a review). TypeError: an input not a numpy array, a name not a str.
            text = error.message if isinstance(error, InvalidInputError) else str(error)
            named = refused(f"{name}: {text}", request_id)
            if isinstance(error, InvalidInputError):
                named.metadata.update(error.metadata)  # the row it names, where it does
            self._emit(StreamResult(index, request_id, None, named, 0))
            return None
        # From the message, not `inputs`: a mapping may compute its arrays at each read.
        rows = next((int(tensor.shape[0]) for tensor in message.inputs if tensor.shape), 0)
        item = _Item(index, request_id, message, rows, name)
        self._items[request_id] = item
        return item

    def _source_failed(self, error: Exception) -> None:
        """The source raised `error`: it is read no further, the items read from it are
        still sent and answered (ending the job there dropped the answers to those already
        sent), and `results()` raises `error` after the last of them."""
        self._source_done = True
        self._source_error = error

    def _unpack(self, raw: object, index: int) -> tuple[Arrays, str]:
        """Item `index`'s inputs and request_id (its own, else the job's for it).

        Raises:
            TypeError: the item is neither a mapping nor a StreamRequest (naming it).
        """
        if isinstance(raw, StreamRequest):
            # Not `or`: a falsy id of another type (0) is refused, not taken for none.
            if raw.request_id is None or raw.request_id == "":
                return raw.inputs, f"{self.job_id}-{index}"
            return raw.inputs, raw.request_id
        if isinstance(raw, Mapping):
            return raw, f"{self.job_id}-{index}"
        raise TypeError(
            f"bulk stream item {index}: expected a mapping of input name to numpy array or "
            f"a StreamRequest, got {type(raw).__name__}"
        )

    def _within_message_limit(self, item: _Item) -> bool:
        """False, the item answered ResourceExhaustedError, when it is larger than this
        client and the server of this call exchange: gRPC would end the whole call on it
        (every other item unanswered), and a resumed job's call again. Checked at each
        send: the limits are the current call's server's. (An answer larger than this
        client reads, the server refuses alone: see RECEIVE_LIMIT_KEY.)"""
        size = item.message.ByteSize()
        if size <= self._max_item_bytes:
            return True
        # The bound's setting: the caller's send option where it is the bound, else
        # max_message_bytes (this client's or the server's).
        named = (
            self._client_limit_name
            if self._max_item_bytes == self._client_max_bytes
            else "max_message_bytes"
        )
        error = ResourceExhaustedError(
            f"{item.name} is {size} bytes, over the largest message this "
            f"client and server exchange ({self._max_item_bytes} bytes, {named}); expected "
            "fewer rows per item",
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
            request_id=item.request_id,
        )
        error.attempts = item.attempts
        self._finish(item, None, error)
        return False

    # ---- the reader ------------------------------------------------------------------

    async def _read(
        self, call: grpc.aio.StreamStreamCall[pb.InferRequest, pb.InferStreamResponse]
    ) -> None:
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                assert isinstance(response, pb.InferStreamResponse)
                self._on_answer(response)
        except grpc.RpcError as error:
            ended = _call_error(error)
            if isinstance(ended, _OverServerLimitError):
                # The next call holds its items to the limit the server named.
                self._max_item_bytes = min(self._max_item_bytes, ended.limit_bytes)
            self._events.put_nowait(_CallEnded(ended))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # results() ends the call and waits for this task, not for an event
            # gRPC ends the read of a call cancelled under it (the client closed its
            # channel) with CancelledError too: results() waits for an event, always.
            self._events.put_nowait(
                _CallEnded(
                    CallCancelledError(
                        "the stream call was cancelled on this side",
                        code=grpc.StatusCode.CANCELLED,
                    )
                )
            )
        except Exception as error:  # noqa: BLE001 - a bug must end the job, not hang it
            self._events.put_nowait(_Failed(error))
        else:
            self._events.put_nowait(_CallEnded(None))

    def _on_answer(self, response: pb.InferStreamResponse) -> None:
        item = self._items.get(response.request_id)
        late = self._expired.pop(response.request_id, None)
        if late is not None:
            self._server_answers += 1
            self._rows_out -= late.rows
            self._wakeup.set()  # its place in the window is free
            log.debug(
                "bulk stream %s: answer for %r after its timeout_ms; dropped (the item was "
                "answered DeadlineExceededError)",
                self.job_id,
                response.request_id,
            )
            return
        if item is None or item.state is not _State.SENT:
            log.warning(
                "bulk stream %s: answer for %r, which is not awaiting one; ignored",
                self.job_id,
                response.request_id,
            )
            return
        self._server_answers += 1
        if response.WhichOneof("result") == "response":
            try:
                answer = response.response
                outputs = {tensor.name: decode_tensor(tensor) for tensor in answer.outputs}
            except ValueError as undecodable:
                unreadable = unreadable_answer(
                    str(undecodable),
                    request_id=item.request_id,
                    name=item.name,
                    attempts=item.attempts,
                )
                unreadable.__cause__ = undecodable
                self._finish(item, None, unreadable)
                return
            self._finish(item, outputs, None, timing=Timing.from_proto(answer.timing))
            return
        error = error_from_status(response.error, request_id=item.request_id)
        error.attempts = item.attempts
        if error.should_retry and item.attempts < self._allowed:
            # The decision uses the real delay; test mode only skips the waiting.
            delay_s = self._policy.delay_s(item.attempts, error.retry_after_s)
            if item.deadline_s is not None and time.monotonic() + delay_s >= item.deadline_s:
                error.add_note(
                    f"gave up after {item.attempts} attempt(s): the next would start after "
                    f"the item's timeout_ms ({self._options.timeout_ms} ms from its first "
                    f"send; {retry_wait(delay_s, error.retry_after_s)})"
                )
                self._finish(item, None, error)
                return
            delay_s = effective_delay_s(delay_s)
            item.state = _State.BACKOFF
            item.timer = asyncio.get_running_loop().call_later(delay_s, self._resend, item)
            return
        if error.should_retry:
            error.add_note(f"gave up after {item.attempts} attempt(s) (max_attempts)")
        self._finish(item, None, error)

    def _expire(self, item: _Item) -> None:
        """`item`'s timeout_ms from its first send has passed: it is answered
        DeadlineExceededError now, unless it was already. The server counts timeout_ms
        from its read of the item, which may come long after its send (unread in gRPC's
        flow control while the stream's credit window is full or another of its items
        waits for room in a lane), and then gives it timeout_ms afresh: only this side
        keeps the item's budget. An answer the server sends it later is dropped."""
        item.expiry = None
        if self._items.get(item.request_id) is not item:
            return
        error = _timed_out(
            item,
            f"no answer within its timeout_ms ({self._options.timeout_ms} ms from its first "
            f"send; sent {item.attempts} time(s) for an answer); a later answer from the "
            "server is dropped",
        )
        if item.state is _State.QUEUED:  # waiting to be sent again: it never will be
            self._to_send.remove(item)
        self._finish(item, None, error, in_flight=item.state is _State.SENT)

    def _resend(self, item: _Item) -> None:
        item.timer = None
        if self._items.get(item.request_id) is item and item.state is _State.BACKOFF:
            item.state = _State.QUEUED
            item.attempts += 1
            self._to_send.append(item)
            self._wakeup.set()

    def _finish(
        self,
        item: _Item,
        outputs: dict[str, npt.NDArray[Any]] | None,
        error: LaneserveError | None,
        *,
        in_flight: bool = False,
        timing: Timing | None = None,
    ) -> None:
        """`item`'s final answer (`timing`: the server's, of an answer). `in_flight`: the
        server has it still (see `_expired`)."""
        del self._items[item.request_id]
        _stop_timers(item)
        if in_flight:
            self._expired[item.request_id] = item
        else:
            self._rows_out -= item.rows
        self._emit(StreamResult(item.index, item.request_id, outputs, error, item.attempts, timing))
        self._wakeup.set()  # the writer may be waiting to half-close

    def _emit(self, result: StreamResult) -> None:
        if not self._ordered:
            self._events.put_nowait(result)
            return
        self._ready[result.index] = result
        while self._next_index in self._ready:
            self._events.put_nowait(self._ready.pop(self._next_index))
            self._next_index += 1

    # ---- broken calls ------------------------------------------------------------------

    def _requeue_sent(self) -> int:
        """Items sent on the broken call and not answered go first on the next one, in
        order; those waiting for a retry keep their timers."""
        sent = sorted(
            (item for item in self._items.values() if item.state is _State.SENT),
            key=lambda item: item.index,
        )
        for item in sent:
            item.state = _State.QUEUED
        queued = [item for item in self._to_send if item.state is _State.QUEUED]
        self._to_send = collections.deque(sent + queued)
        return len(sent)

    def _forget_expired(self) -> None:
        """The call ended: the server has dropped the items it held of it, and answers
        none of them any more."""
        self._rows_out -= sum(item.rows for item in self._expired.values())
        self._expired.clear()

    def _check_open(self, cause: LaneserveError | None = None) -> None:
        """Before each new call, and when one ended: a closed client starts none. `cause`:
        how the call ended, when it did."""
        if self._closed is not None and self._closed.is_set():
            self._cancel_timers()
            raise ClientClosedError(
                f"bulk stream {self.job_id}: the client was closed; {self._unanswered()}"
            ) from cause

    async def _stop_reading(self) -> None:
        """The job ends early: `_cancel_timers`, and its read of the source ends before
        the job does: the source (an async generator) cannot be closed while a read runs
        in it ("aclose(): asynchronous generator is already running")."""
        reading = self.cancel_source_read()
        self._cancel_timers()
        if reading is not None:
            await asyncio.wait([reading])

    def cancel_source_read(self) -> asyncio.Future[StreamItem | object] | None:
        """The client closes: a read of the source in progress is cancelled, returned to
        await (None: none runs). The job reads no further."""
        reading = self._source_next
        self._source_next = None
        if reading is None or reading.done():
            return None
        reading.cancel()
        return reading

    def _cancel_timers(self) -> None:
        """The job is over (done, failed, or left by the caller): nothing is resent and
        the source is not read further."""
        for item in self._items.values():
            _stop_timers(item)
        self.cancel_source_read()


async def _anext(source: AsyncIterator[StreamItem]) -> StreamItem | object:
    """The source's next item, or _SOURCE_END."""
    try:
        return await anext(source)
    except StopAsyncIteration:
        return _SOURCE_END


_SOURCE_END: Final = object()


def _stop_timers(item: _Item) -> None:
    """Cancels `item`'s resend and expiry timers: nothing more is due to it."""
    for timer in (item.timer, item.expiry):
        if timer is not None:
            timer.cancel()
    item.timer = item.expiry = None


def _item_name(index: int, request_id: object, job_id: str) -> str:
    """How messages name item `index`: by its own request_id where its caller gave it one,
    the caller's key for it (a caller that streams some of its items only, as a resumed
    `laneserve-client bulk` does, numbers them its own way: the index named another item
    of its job), else by its index (its id is then f"{job_id}-{index}"). An id that is not
    a str, too long to repeat in a message, or not UTF-8 text (refused for that: named
    by itself, its refusal named nothing the caller can find), leaves the index."""
    if (
        isinstance(request_id, str)
        and request_id != f"{job_id}-{index}"
        and len(request_id) <= _NAMED_ID_CHARS
    ):
        try:
            utf8_bytes("request_id", request_id)
        except InvalidInputError:  # a lone surrogate
            pass
        else:
            return f"bulk stream request {request_id!r}"
    return f"bulk stream item {index}"


# The server's reason for a deadline that passed while the request waited (see `_timed_out`).
_EXPIRED_IN_QUEUE: Final = "EXPIRED_IN_QUEUE"
# The longest request_id a message names an item by (a CLI job's: 32 + 1 + digits).
_NAMED_ID_CHARS: Final = 80


def _timed_out(item: _Item, why: str) -> ExpiredInQueueError:
    """Item `item`'s answer once its timeout_ms has passed (`why`), its attempts counted.

    The server's reason for a deadline that passed before the item's answer could start,
    EXPIRED_IN_QUEUE: the server counts the item's timeout_ms from its read of it, later
    than this client does, so at this client's deadline the server has not yet expired
    it, and in the case this answers (a window of work ahead of the item) it waits: unread
    in the stream's flow control, or in its lane. Without a reason it was the one item
    error that named none (`reason` "", where the CLI's summary counts by reason).
    """
    error = ExpiredInQueueError(
        f"{item.name}: {why}",
        code=grpc.StatusCode.DEADLINE_EXCEEDED,
        reason=_EXPIRED_IN_QUEUE,
        request_id=item.request_id,
    )
    error.attempts = item.attempts
    return error


class _OverServerLimitError(ResourceExhaustedError):
    """A call the server ended on an item over its message limit (`limit_bytes`), smaller
    than the job knew: retryable, as the next call answers that item alone."""

    retryable = True

    def __init__(self, message: str, *, limit_bytes: int, code: grpc.StatusCode) -> None:
        super().__init__(message, code=code)
        self.limit_bytes = limit_bytes


def _call_error(error: grpc.RpcError) -> LaneserveError:
    """How a stream call ended, as the job reports it. gRPC ends a call whose write
    failed with INTERNAL ("Internal error from Core") in place of the status the server
    sent: a drain's UNAVAILABLE (DRAINING), or none on a dropped connection. The server
    never sends INTERNAL for a whole stream (item failures come back as items), so an
    INTERNAL without a laneserve reason is UnavailableError (retryable); a job that gave
    up raised it as a bare INTERNAL LaneserveError, not retryable, naming no drain."""
    ended = error_from_rpc(error)
    # gRPC's words on the server ("SERVER: ...") for an item over its limit: the whole
    # call ends RESOURCE_EXHAUSTED on it, no laneserve reason. Items are held to the limit
    # the server gave before each call (`_set_limits`); a server restarted with a smaller
    # limit whose ask went unanswered (its connection not yet up) got an item over it,
    # and the job failed for good. Not the client's own words ("CLIENT: ...": an answer
    # over this client's limit, an AnswerTooLargeError), which no new call mends.
    over = OVER_RECEIVE_LIMIT.search(ended.message)
    if (
        ended.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        and not ended.reason
        and over is not None
        and over[1] == "SERVER"
    ):
        limited = _OverServerLimitError(
            f"the server refused an item of {over[2]} bytes, over its message limit "
            f"({over[3]} bytes), smaller than this job knew (a server restarted with "
            "another max_message_bytes); the next call holds items to it",
            limit_bytes=int(over[3]),
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        limited.__cause__ = ended
        return limited
    if ended.code != grpc.StatusCode.INTERNAL or ended.reason:
        return ended
    unavailable = UnavailableError(
        "the stream call broke while this client was sending (the server ended it, e.g. "
        f"draining, or the connection dropped); gRPC said INTERNAL {ended.message!r}",
        code=grpc.StatusCode.UNAVAILABLE,
    )
    unavailable.__cause__ = ended
    return unavailable
