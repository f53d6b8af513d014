"""Idempotency by request_id: a retry never runs its rows a second time.

A client retries with the same ``request_id`` when it cannot know whether its first
attempt ran (the connection dropped, its deadline passed in flight, a bulk stream broke).
`RequestLedger` answers such a retry without running it again:

- **in flight**: the id's request is queued or running. The retry joins it and gets the
  same answer. The admitted work belongs to the ledger, not to the RPC that brought it:
  it is cancelled (its queued rows freed) only when its last waiting RPC has gone, and
  then only if none of its rows has gone to the session; a request already started
  finishes (all its chunks, when it is split across batches), and its answer is kept
  for the retry that is likely on its way. Each waiter keeps its own deadline: the work
  waits as long as the latest of those still waiting (a retry or hedge with a later
  deadline extends it; when that one leaves, it returns to the latest of the others),
  and a waiter whose deadline passes first is answered alone. At most
  `MAX_CALLERS_WAITING` callers wait on one request: a retry past them is refused
  (`JoinLimitError`, RESOURCE_EXHAUSTED) and gets the stored answer once it is answered.
- **completed**: the id's request succeeded recently. The retry gets the stored answer.
  Stored answers are bounded by count and by bytes, each kept at most ``ttl_s``; the
  oldest stored go first.
- Errors are not stored: a request refused or failed may be retried and run.

Reusing an id for *different* inputs or outputs is refused (`RequestIdReusedError`,
INVALID_ARGUMENT) while the first request is in flight or stored: answering either with
the other's result would be silently wrong, and running both would break the promise a
retry relies on. The comparison is by a digest of the inputs and output names, so the
lane and the timeout of a retry may differ from the first attempt's.

Requests without a request_id run as before, with no bookkeeping.

Ownership: the event loop. Only coroutines and loop callbacks touch the ledger, so it
needs no lock; the one exception is `RequestLedger.counts`, which another thread (a
metric reader) may call: it only reads.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import math
import struct
import sys
from collections.abc import Callable, Sequence

from laneserve.server.clock import CALLER_END_SLACK_S, Clock, StartTimer, Timer
from laneserve.server.errors import (
    EngineError,
    JoinExpiredError,
    JoinLimitError,
    LaneserveError,
    RequestIdReusedError,
)
from laneserve.server.items import Outcome
from laneserve.server.log_events import event_extra
from laneserve.server.scheduler import caller_end_status
from laneserve.v1 import inference_pb2 as pb

# Bytes counted per stored answer on top of its id and its record: the objects' headers
# and the table's slots. Measured with tracemalloc over 100 000 answers of the demo
# model: ~326 bytes each in all for a 96-byte answer (~478 when a record was a tuple of
# four). Keeps the byte bound near the memory the cache really holds, and a flood of
# tiny answers within it too (test_the_byte_bound_counts_the_memory_the_cache_holds).
ENTRY_OVERHEAD_BYTES = 176
_EMPTY_STR_BYTES = sys.getsizeof("")

# How long past its TTL a stored answer may still be held while no request comes (the
# TTL itself, when shorter): the ledger's sweep fires this long after the oldest stored
# answer expires. So a busy cache is swept at most once per this long, each sweep
# dropping every answer that expired meanwhile, not once per answer stored.
SWEEP_SLACK_S = 1.0

# The most callers that wait on one request in flight: the one that queued it and retries
# (or hedges) that joined it. A join queues no rows, so no lane's capacity bounds it, but
# gRPC holds a unary call's request message until the call is answered: unbounded, 80
# joins of a 4 MiB request held 1 GiB. So what joined callers hold is at most this many
# times the request, which its lane counts once. A client retries a request whose fate
# it cannot know, or hedges it once or twice: more at a time is a retry loop.
MAX_CALLERS_WAITING = 5
# `fingerprint` feeds tensor data of up to PIECED_MAX_BYTES to the digest in pieces of
# PIECE_BYTES: hashlib releases the GIL for an update of 2048 bytes or more (CPython's
# HASHLIB_GIL_MINSIZE), and the event loop then waits behind the engine's and the
# scheduler's threads to take it back. Hashed whole, one 512-float row (2048 bytes) took
# 27-29 us of CPU and 42-252 us of wall time a fingerprint; in pieces 15-20 and 22-59.
# Larger data takes long enough to hash that letting other threads run meanwhile pays.
PIECE_BYTES = 2047
PIECED_MAX_BYTES = 64 * 1024

log = logging.getLogger(__name__)


def fingerprint(request: pb.InferRequest, output_names: Sequence[str]) -> bytes:
    """A digest of what determines the answer: the inputs (in any order) and the outputs
    it carries, in their order: `output_names` as resolved (`check_output_names`), so
    that none asked for and all of them listed in the model's order are one answer. Lane,
    timeout and request_id are left out: a retry may change them."""
    # SHA-256: with the SHA extensions of current CPUs it hashes 2-3x faster than blake2b,
    # and this runs for every request that carries an id: on the event loop, but for a
    # new one of more than text_thread.EVENT_LOOP_HASH_BYTES (hashed off it).
    digest = hashlib.sha256()
    tensors: Sequence[pb.Tensor] = request.inputs
    if len(tensors) > 1:
        tensors = sorted(tensors, key=lambda tensor: tensor.name)
    for tensor in tensors:
        name = tensor.name.encode()
        shape = tensor.shape
        data = tensor.data
        # Every variable part is preceded by its length, so no two different requests
        # hash the same bytes; one header per tensor keeps the Python calls few.
        header = struct.pack(
            f"<QiQ{len(shape)}qQ", len(name), tensor.dtype, len(shape), *shape, len(data)
        )
        digest.update(header + name)
        if PIECE_BYTES < len(data) <= PIECED_MAX_BYTES:
            # The same digest as one update: SHA-256 hashes a stream of bytes.
            view = memoryview(data)
            for start in range(0, len(data), PIECE_BYTES):
                digest.update(view[start : start + PIECE_BYTES])
        else:
            digest.update(data)
    digest.update(b"outputs")
    for output in output_names:
        name = output.encode()
        digest.update(struct.pack("<Q", len(name)) + name)
    return digest.digest()


# Given the request's one Outcome, on the event loop (OutcomeRouter calls it).
Resolve = Callable[[Outcome], None]
# Cancels an admitted request in the scheduler; with `unless_running`, a started request
# (any chunk run or running) is left to finish. Returns True when cancelled, False when
# its Outcome is still coming.
Cancel = Callable[[bool], bool]
# Turns a request's Outcome into its answer (or raises its error). The second argument is
# None while a caller still waits for it; else every caller left or timed out while it
# ran (the answer is only kept for replay), and it is how the last of them ended, judged
# as it went, against its own deadline (`caller_end_status`): CANCELLED (it left) or
# DEADLINE_EXCEEDED. Judged when the answer came, against its deadline, a caller that
# left long before was counted DEADLINE_EXCEEDED once the work ran past it. The third is
# the largest answer in bytes the callers that take it read (None: one of them reads what
# the server sends, or none takes it): the answer's status is what the best placed of
# them gets. The fourth is the caller that status stands for when it is a refusal of the
# answer (ANY_CALLER when none takes it): the first still taking it, the one that
# submitted it while it does. `finish` tells it (`Caller.counted`), so that its own
# refusal is not counted again.
Finish = Callable[[Outcome, str | None, int | None, "Caller"], pb.InferResponse]
# Moves an admitted request's deadline (scheduler clock), later or earlier; False when
# its answer is already on its way (nothing to move).
Move = Callable[[float], bool]


@dataclasses.dataclass(frozen=True, slots=True)
class Admitted:
    """What `submit` returns for a request the scheduler queued: how to cancel it, and
    how to move its deadline."""

    cancel: Cancel
    move: Move


def _reachable() -> bool:
    return True


def _unreported(_error: JoinExpiredError) -> None:
    pass


def _untold(*_facts: object) -> None:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    """What the ledger asks of, and tells, one RPC waiting for an answer: `reachable()`,
    whether an answer handed out now still reaches it (False once gRPC's deadline for
    it has passed: `finish` then counts the answer as its caller got it); `expired`,
    told when it is answered alone at its deadline (JoinExpiredError) while the work
    goes on for another caller, so that it can be counted; `read_limit`, the largest
    answer in bytes it reads (a stream's receive limit; None: what the server sends);
    `joined`, told when it joins a request in flight (it queues nothing, and the answer
    it takes is that request's); `counted`, told with the answer's size before the answer
    reaches it, when its refusal of the answer (over its `read_limit`) is counted already
    as the request's own status: every caller refused is counted once."""

    reachable: Callable[[], bool] = _reachable
    expired: Callable[[JoinExpiredError], object] = _unreported
    read_limit: int | None = None
    joined: Callable[[], object] = _untold
    counted: Callable[[int], object] = _untold


# A caller always reachable, whose expiry nobody counts.
ANY_CALLER = Caller()


@dataclasses.dataclass(frozen=True, slots=True)
class LedgerCounts:
    """What `RequestLedger.counts` reads; the fields are GetStats' of the same names."""

    idempotent_joins: int  # requests that joined the one in flight with their id
    idempotent_replays: int  # requests answered from the replay cache
    replay_cache_entries: int  # answers stored now
    replay_cache_bytes: int  # bytes they take (what idempotency_max_bytes bounds)


class _Waiter:
    """One RPC waiting for a flight's answer, with its own deadline (`math.inf`: none).
    A timer answers it alone at that deadline while the work waits longer (for a waiter
    with a later deadline); otherwise the scheduler's answer at the deadline reaches it."""

    __slots__ = ("caller", "deadline_s", "future", "timer")

    def __init__(
        self, future: asyncio.Future[pb.InferResponse], deadline_s: float, caller: Caller
    ) -> None:
        self.future = future
        self.deadline_s = deadline_s
        self.caller = caller
        self.timer: asyncio.TimerHandle | None = None

    def takes_answer(self) -> bool:
        """Whether it still waits and its caller can take the answer (no gRPC deadline
        has passed: gRPC ends that call DEADLINE_EXCEEDED, whatever it is handed)."""
        return not self.future.done() and self.caller.reachable()


class _Flight:
    """One admitted request and the RPCs waiting for its answer.

    Each waiter awaits a future of its own, so one going away (cancelled) never cancels
    the answer for the others; the answer reaches every waiter in the same loop callback
    that brought the Outcome (no hop through further futures).
    """

    __slots__ = (
        "admitted",
        "answered",
        "deadline_s",
        "ended",
        "fingerprint",
        "request_id",
        "waiters",
    )

    def __init__(
        self, request_id: str, fingerprint: bytes, admitted: Admitted, deadline_s: float
    ) -> None:
        self.request_id = request_id
        self.fingerprint = fingerprint
        self.admitted = admitted
        # The work's deadline in the scheduler: the latest of its waiters' still waiting.
        # Invariant: a waiter with an earlier deadline has its timer, the others none.
        self.deadline_s = deadline_s
        self.waiters: list[_Waiter] = []
        # How the last waiter to go that was counted nowhere else ended (`_gone`), set as
        # it went: what `finish` is given when none waits. Read only while `waiters` is
        # empty, once a waiter has gone (a retry that joins afterwards sets it anew when
        # it goes, unless it is counted as its refusal). Until set, CANCELLED: the last
        # to go was counted as its refusal, and the one before it, not the work's
        # deadline-keeper any more, left.
        self.ended = "CANCELLED"
        # Set once: the answer was handed out, or the work was cancelled (no answer comes).
        self.answered = False

    def succeed(self, response: pb.InferResponse) -> None:
        for waiter in self._take_waiters():
            waiter.set_result(response)

    def fail(self, error: Exception) -> None:
        for waiter in self._take_waiters():
            waiter.set_exception(error)

    def _take_waiters(self) -> list[asyncio.Future[pb.InferResponse]]:
        """Marks the flight answered; the waiters still waiting (a cancelled RPC has
        cancelled its own future and leaves by itself, an expired one was answered)."""
        self.answered = True
        waiters, self.waiters = self.waiters, []
        return [waiter.future for waiter in waiters if not waiter.future.done()]


# A stored answer is one bytes object, its record: the time it was stored (a float64),
# the fingerprint's length (one byte), the fingerprint, then the serialized
# InferResponse. One object, on purpose: the cache may hold 100 000 of them. Bytes are
# never walked by the garbage collector (a protobuf message, a slotted object or a
# NamedTuple would be, on every full collection, holding the GIL and stalling every
# thread), and one object instead of a tuple of four costs ~120 bytes less per answer.
_HEADER = struct.Struct("<dB")


def _record(stored_s: float, fingerprint: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(stored_s, len(fingerprint)) + fingerprint + payload


def _stored_s(record: bytes) -> float:
    stored_s: float = _HEADER.unpack_from(record)[0]
    return stored_s


def _digest_end(record: bytes) -> int:
    """Where the fingerprint ends in `record` (its length is the header's last byte)."""
    return _HEADER.size + record[_HEADER.size - 1]


def _size_bytes(request_id: str, record: bytes) -> int:
    # The id's characters as Python holds them: 1, 2 or 4 bytes each, by its widest.
    return len(record) + sys.getsizeof(request_id) - _EMPTY_STR_BYTES + ENTRY_OVERHEAD_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class Replayed:
    """A stored answer, as `ReplayCache.get` hands it out."""

    fingerprint: bytes
    response: pb.InferResponse


class ReplayCache:
    """Completed answers by request_id, bounded by count and bytes, each for at most
    ``ttl_s`` from when it was stored; the oldest stored go first.

    In the order they were stored, which is the order they expire in: a hit does not move
    an answer (it was an LRU: a replayed answer moved to the back, expired there, and a
    store evicted the live answers ahead of it, whose retries then ran again). So the
    expired are always at the front, and are dropped from there before the bounds evict
    anything live: whenever something is stored, when the cache is counted (GetStats),
    and at the ledger's sweep (`drop_expired`, see `RequestLedger`), so that an idle
    server does not hold them, nor report them, for good.
    """

    def __init__(self, *, max_entries: int, max_bytes: int, ttl_s: float, clock: Clock) -> None:
        assert max_entries >= 0
        assert max_bytes >= 0
        assert ttl_s >= 0
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        # Invariant: _bytes == the sum of `_size_bytes` over the entries,
        # len(_entries) <= max_entries and _bytes <= max_bytes. Oldest stored first.
        self._entries: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        """Answers held, the expired dropped first: agrees with `size_bytes` read in
        either order."""
        self._evict(self._clock.monotonic())
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        """Bytes held (what `max_bytes` bounds), the expired dropped first."""
        self._evict(self._clock.monotonic())
        return self._bytes

    @property
    def held_entries(self) -> int:
        """Answers held now, the expired not dropped first: for a reader on another thread,
        which must not touch the entries (the event loop owns them)."""
        return len(self._entries)

    @property
    def held_bytes(self) -> int:
        """Bytes held now, the expired not dropped first (see `held_entries`)."""
        return self._bytes

    def oldest_expires_in_s(self) -> float | None:
        """Seconds until the oldest stored answer expires (0 when it has); None: none is
        stored. Every other expires no earlier: they were stored no earlier."""
        if not self._entries:
            return None
        oldest = next(iter(self._entries.values()))
        return max(_stored_s(oldest) + self.ttl_s - self._clock.monotonic(), 0.0)

    def drop_expired(self) -> None:
        """Drops the answers past their TTL (the bounds already hold)."""
        self._evict(self._clock.monotonic())

    def get(self, request_id: str) -> Replayed | None:
        record = self._entries.get(request_id)
        if record is None:
            return None
        if self._expired(record):
            self._remove(request_id)
            return None
        digest_end = _digest_end(record)
        return Replayed(
            record[_HEADER.size : digest_end], pb.InferResponse.FromString(record[digest_end:])
        )

    def holds(self, request_id: str) -> bool:
        """Whether `get` would find an answer for `request_id` (without decoding it)."""
        return self.fingerprint_of(request_id) is not None

    def fingerprint_of(self, request_id: str) -> bytes | None:
        """The fingerprint of the answer `get` would find for `request_id` (without
        decoding it); None: none is stored."""
        record = self._entries.get(request_id)
        if record is None or self._expired(record):
            return None
        return record[_HEADER.size : _digest_end(record)]

    def _expired(self, record: bytes) -> bool:
        return self._clock.monotonic() - _stored_s(record) >= self.ttl_s

    def put(self, request_id: str, fingerprint: bytes, response: pb.InferResponse) -> bool:
        """Stores an answer; False when it cannot be kept (larger than the byte bound, or
        the cache is off). Evicts the oldest stored answers to make room."""
        if self.max_entries == 0 or self.ttl_s == 0:
            return False
        now_s = self._clock.monotonic()
        record = _record(now_s, fingerprint, response.SerializeToString())
        size_bytes = _size_bytes(request_id, record)
        if size_bytes > self.max_bytes:
            return False
        if request_id in self._entries:
            self._remove(request_id)
        self._entries[request_id] = record
        self._bytes += size_bytes
        self._evict(now_s)
        return True

    def _evict(self, now_s: float) -> None:
        """Drops the expired answers, then the oldest while a bound is exceeded."""
        while self._entries:
            request_id, oldest = next(iter(self._entries.items()))
            expired = now_s - _stored_s(oldest) >= self.ttl_s
            if not expired and (
                len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes
            ):
                return
            self._remove(request_id)

    def _remove(self, request_id: str) -> None:
        self._bytes -= _size_bytes(request_id, self._entries.pop(request_id))


class RequestLedger:
    """Runs each request once per request_id; see the module docstring.

    Usage, from a servicer::

        response = await ledger.run(request_id, fingerprint(request, outputs), submit, finish)

    where `submit(resolve)` admits the request to the scheduler with `resolve` as its
    token (or raises why not) and returns how to cancel it, and `finish(outcome, ended,
    read_limit, own)` turns its Outcome into the answer (or raises its error); `ended`
    is None while a caller still waits for it, else how the last caller to go ended (the
    answer is only kept for replay); see `Finish` for the others.

    Stored answers expire with no request coming too: one loop timer, the sweep, fires
    `SWEEP_SLACK_S` (or the TTL, when shorter) after the oldest stored answer expires and
    drops every expired one; without it an idle server held them all (up to
    idempotency_max_bytes) until the next store or GetStats. `close` cancels it, at stop.
    """

    def __init__(
        self, replay: ReplayCache, clock: Clock, *, call_later: StartTimer | None = None
    ) -> None:
        self.replay = replay
        self._clock = clock  # the deadlines' clock (the scheduler's)
        self._flights: dict[str, _Flight] = {}
        # Requests answered from the replay cache, and requests that joined a flight.
        self.replays = 0
        self.joins = 0
        self._call_later = call_later  # on the event loop; None: the running loop's
        # Invariant: while the ledger is open and answers it stored are held, the sweep is
        # armed, due no later than the slack past the oldest one's expiry. Never armed
        # once closed, nor when nothing can be stored (idempotency_max_entries 0).
        self._sweep: Timer | None = None
        self._closed = False

    async def run(
        self,
        request_id: str,
        digest: bytes,
        submit: Callable[[Resolve], Admitted],
        finish: Finish,
        *,
        deadline_s: float = math.inf,
        caller: Caller = ANY_CALLER,
    ) -> pb.InferResponse:
        """The request's answer, running it only if no request with its id is in flight
        or stored. `submit(resolve)` admits the request with `resolve` as the token its
        Outcome comes back to and `deadline_s` as its deadline (or raises why not).
        Raises the request's LaneserveError, RequestIdReusedError, or JoinLimitError (a
        retry that would join it past MAX_CALLERS_WAITING).

        A retry that joins a request in flight waits until its own `deadline_s` (on the
        ledger's clock) at most; a later one than the work's extends the work's. A waiter
        whose deadline passes while the work waits on for another is answered
        JoinExpiredError alone, and reported to `caller.expired`."""
        if not request_id:
            alone = self._start("", b"", submit, finish, deadline_s)
            return await self._wait(alone, deadline_s, caller)
        stored = self.replayed(request_id, digest)
        if stored is not None:
            return stored
        flight = self._flights.get(request_id)
        if flight is None:
            flight = self._start(request_id, digest, submit, finish, deadline_s)
            self._flights[request_id] = flight
            return await self._wait(flight, deadline_s, caller)
        _check_same(request_id, flight.fingerprint, digest, "still queued or running")
        _check_room(flight)
        self.joins += 1
        caller.joined()
        if deadline_s > flight.deadline_s:
            self._extend(flight, deadline_s)
        return await self._wait(flight, deadline_s, caller)

    def counts(self) -> LedgerCounts:
        """Joins and replays so far, and what the replay cache holds. Safe from another
        thread (a metric reader): it only reads, and drops nothing (the sweep drops the
        expired); the four are read one after another, not as one snapshot."""
        return LedgerCounts(
            idempotent_joins=self.joins,
            idempotent_replays=self.replays,
            replay_cache_entries=self.replay.held_entries,
            replay_cache_bytes=self.replay.held_bytes,
        )

    def close(self) -> None:
        """Cancels the sweep, for good: at stop, on the loop (no timer outlives the
        server). Answers stored afterwards are still replayed, and dropped only as before
        the sweep existed: by a store, a read or a count."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def _arm_sweep(self) -> None:
        """Arms the sweep for the oldest stored answer, unless it is armed already (then
        for an answer stored no later) or the ledger is closed."""
        if self._sweep is not None or self._closed:
            return
        expires_in_s = self.replay.oldest_expires_in_s()
        if expires_in_s is None:
            return
        # The slack keeps each delay above 0: a sweep never re-arms itself for "now".
        delay_s = expires_in_s + min(self.replay.ttl_s, SWEEP_SLACK_S)
        call_later = self._call_later or asyncio.get_running_loop().call_later
        self._sweep = call_later(delay_s, self._swept)

    def _swept(self) -> None:
        self._sweep = None
        self.replay.drop_expired()
        self._arm_sweep()  # for the answers left, which expire later

    def holds(self, request_id: str) -> bool:
        """Whether a request with `request_id` is answered here without being admitted:
        one with that id is in flight (it joins) or stored (it replays, or is refused
        REQUEST_ID_REUSED)."""
        return bool(request_id) and (self.replay.holds(request_id) or request_id in self._flights)

    def answers_as(self, request_id: str, digest: bytes) -> str | None:
        """How `run` answers a request with `request_id` and fingerprint `digest` now
        without admitting it: "replay" (its answer is stored), "join" (one with its id is
        in flight), "reused" (one with its id but other inputs is stored or in flight: it
        is refused REQUEST_ID_REUSED); None: it runs."""
        if not request_id:
            return None
        known = self.replay.fingerprint_of(request_id)
        how = "replay"
        if known is None:
            flight = self._flights.get(request_id)
            if flight is None:
                return None
            known, how = flight.fingerprint, "join"
        return how if known == digest else "reused"

    def replayed(self, request_id: str, digest: bytes) -> pb.InferResponse | None:
        """The stored answer of the completed request `request_id`, counted as a replay
        (None: none is stored); RequestIdReusedError when it had other inputs."""
        stored = self.replay.get(request_id)
        if stored is None:
            return None
        _check_same(request_id, stored.fingerprint, digest, "completed")
        self.replays += 1
        return stored.response

    def _start(
        self,
        request_id: str,
        digest: bytes,
        submit: Callable[[Resolve], Admitted],
        finish: Finish,
        deadline_s: float,
    ) -> _Flight:
        # `resolve` runs from a loop callback, never before `_start` has returned: by then
        # `flight` is bound.
        def resolve(outcome: Outcome) -> None:
            if self._flights.get(request_id) is flight:
                del self._flights[request_id]
            if flight.answered:  # every waiter has gone and the work was cancelled
                return
            takers = [waiter for waiter in flight.waiters if waiter.takes_answer()]
            # Waiters in the order they came: the submitter's first while it waits.
            own = takers[0].caller if takers else ANY_CALLER
            ended = None if takers else self._ended(flight)
            try:
                response = finish(outcome, ended, _largest_read(takers), own)
            except Exception as error:
                # Every waiter gets an answer on every path, a bug in `finish` included.
                failure = error
                if not isinstance(error, LaneserveError):
                    log.exception(
                        "answering request %r failed",
                        request_id,
                        extra=event_extra("answer_failed", request_id=request_id),
                    )
                    failure = EngineError(f"internal error: {error!r}")
                flight.fail(failure)
                return
            if request_id and self.replay.put(request_id, digest, response):
                self._arm_sweep()
            flight.succeed(response)

        # Raises when refused: nothing is recorded then.
        flight = _Flight(request_id, digest, submit(resolve), deadline_s)
        return flight

    async def _wait(self, flight: _Flight, deadline_s: float, caller: Caller) -> pb.InferResponse:
        """Waits for `flight`'s answer, until `deadline_s` at most (then JoinExpiredError).
        The waiter joins in the caller's step, before anything is awaited: a wait in a
        task of its own (`asyncio.wait_for`, Python 3.11) began one loop turn later, and a
        retry whose flight was answered in between joined a dead flight and waited out
        its timeout."""
        waiter = _Waiter(asyncio.get_running_loop().create_future(), deadline_s, caller)
        flight.waiters.append(waiter)
        if deadline_s < flight.deadline_s:
            self._arm(flight, waiter)
        counted = False  # its end counted as its lane's refusal (`caller.expired`)
        try:
            return await waiter.future
        except JoinExpiredError as error:
            counted = True
            caller.expired(error)
            raise
        except asyncio.CancelledError:
            # gRPC cancels the call at its deadline too, around the timer's instant (the
            # caller's own deadline reaches the server as a cancel, early by the call's
            # transit: CALLER_END_SLACK_S): when its cancel came first, the caller was
            # answered alone at its deadline all the same (gRPC's DEADLINE_EXCEEDED), and
            # was counted nowhere.
            now_s = self._clock.monotonic()
            if waiter.timer is not None and now_s >= waiter.deadline_s - CALLER_END_SLACK_S:
                counted = True
                caller.expired(_join_expired(flight.request_id))
            raise
        finally:
            if waiter.timer is not None:
                waiter.timer.cancel()
            if not flight.answered:
                flight.waiters.remove(waiter)
                if not flight.waiters:
                    # The work's status stands for a caller counted nowhere else: a last
                    # caller counted as its refusal keeps how the one before it ended (it
                    # was counted twice, and the caller before it not at all).
                    if not counted:
                        flight.ended = self._gone(waiter)
                    self._abandon(flight)
                elif waiter.deadline_s >= flight.deadline_s:
                    self._shorten(flight)

    def _gone(self, waiter: _Waiter) -> str:
        """How `waiter`'s caller ended, judged now, as it goes, against its own deadline:
        by the last one to go, not the work's deadline (a retry may have extended it), and
        not when the answer comes (the work ran on past the deadline of a caller that had
        left long before: it was counted DEADLINE_EXCEEDED)."""
        return caller_end_status(self._clock.monotonic(), waiter.deadline_s, queued=False)

    def _ended(self, flight: _Flight) -> str:
        """How the callers of `flight` ended, none of whom takes its answer: as the last
        to go did when it went; while some are still going (cancelled, or past gRPC's
        deadline, in this instant), judged now, by the latest deadline among them."""
        if not flight.waiters:
            return flight.ended
        latest_s = max(waiter.deadline_s for waiter in flight.waiters)
        return caller_end_status(self._clock.monotonic(), latest_s, queued=False)

    def _extend(self, flight: _Flight, deadline_s: float) -> None:
        """A waiter with a later deadline than the work's joined: the work waits for it
        (the scheduler moves the entry's deadline), and the waiters with earlier ones
        get their timers (the scheduler's answer at their deadline no longer comes)."""
        if not flight.admitted.move(deadline_s):
            return  # answered already: its Outcome is on its way
        # The caller's own deadline, though the scheduler keeps the entry's within its
        # lane's timeout from when it queued: `finish` counts a caller that left by it
        # (the scheduler's bound counted one that left before its own DEADLINE_EXCEEDED).
        # A waiter between the two gets a timer it never needs: the scheduler answers it.
        flight.deadline_s = deadline_s
        for waiter in flight.waiters:
            if waiter.timer is None and waiter.deadline_s < deadline_s:
                self._arm(flight, waiter)

    def _shorten(self, flight: _Flight) -> None:
        """The waiter the work waited for (the latest deadline) went away: the work waits
        for the latest of those still waiting, whom the scheduler now answers at that
        deadline (their timers go). It waited on for the one that left: the last timer
        answered its caller refused and then cancelled the queued work, counted CANCELLED
        where its deadline had passed in the queue (EXPIRED_IN_QUEUE)."""
        waiting = [waiter for waiter in flight.waiters if not waiter.future.done()]
        if not waiting:
            return  # each has its answer: the last to go abandons the work
        latest_s = max(waiter.deadline_s for waiter in waiting)
        if latest_s >= flight.deadline_s or not flight.admitted.move(latest_s):
            return  # nothing earlier, or answered already: its Outcome is on its way
        flight.deadline_s = latest_s
        for waiter in waiting:
            if waiter.timer is not None and waiter.deadline_s >= latest_s:
                waiter.timer.cancel()
                waiter.timer = None

    def _arm(self, flight: _Flight, waiter: _Waiter) -> None:
        """Answers `waiter` alone at its deadline, unless the flight's answer came first."""
        request_id = flight.request_id

        def expire() -> None:
            if not waiter.future.done():
                waiter.future.set_exception(_join_expired(request_id))

        delay_s = max(waiter.deadline_s - self._clock.monotonic(), 0.0)
        waiter.timer = asyncio.get_running_loop().call_later(delay_s, expire)

    def _abandon(self, flight: _Flight) -> None:
        """The last RPC waiting for `flight` went away. Its queued rows are freed; work
        with a request_id that is already running finishes, and its answer is stored for
        the retry that is likely on its way (a request split across batches counts as
        running once its first chunk has gone: no row may run twice)."""
        if flight.admitted.cancel(bool(flight.request_id)):
            if self._flights.get(flight.request_id) is flight:
                del self._flights[flight.request_id]
            flight.answered = True


def _largest_read(takers: list[_Waiter]) -> int | None:
    """The largest answer any of `takers` reads; None when one reads what the server
    sends, or there is none. Judged by the caller that submitted the work alone, an
    answer a joined retry read was counted ANSWER_TOO_LARGE after that caller left."""
    limits = [waiter.caller.read_limit for waiter in takers]
    if not limits or None in limits:
        return None
    return max(limit for limit in limits if limit is not None)


def _join_expired(request_id: str) -> JoinExpiredError:
    return JoinExpiredError(
        f"deadline passed while this request waited for the answer of request_id "
        f"{request_id!r} (queued or running); the request goes on, for a caller with a "
        "later deadline or, once it runs, to keep its answer for a retry"
    )


def _check_room(flight: _Flight) -> None:
    """Raises JoinLimitError when as many callers as MAX_CALLERS_WAITING wait for
    `flight`: a retry may not join it now."""
    # An expired waiter's future is done, and it leaves in its next step.
    waiting = sum(1 for waiter in flight.waiters if not waiter.future.done())
    if waiting >= MAX_CALLERS_WAITING:
        raise JoinLimitError(
            f"request_id {flight.request_id!r} is queued or running with {waiting} callers "
            f"waiting for its answer, the most one request has ({MAX_CALLERS_WAITING}); "
            "expected a retry once it is answered (its answer is then stored and given "
            "without running it again), or fewer retries and hedges of it at a time"
        )


def _check_same(request_id: str, known: bytes, digest: bytes, state: str) -> None:
    if known != digest:
        raise RequestIdReusedError(
            f"request_id {request_id!r} was already used for a request with other inputs or "
            f"outputs, which is {state}; expected the same inputs and outputs as that "
            f"request (a retry), or a new request_id for a new request"
        )


__all__ = [
    "ANY_CALLER",
    "ENTRY_OVERHEAD_BYTES",
    "MAX_CALLERS_WAITING",
    "SWEEP_SLACK_S",
    "Admitted",
    "Caller",
    "Cancel",
    "Finish",
    "LedgerCounts",
    "Move",
    "ReplayCache",
    "RequestLedger",
    "Resolve",
    "fingerprint",
]
