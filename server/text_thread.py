"""Requests and answers of many strings, decoded and encoded on a thread kept for them
(`TextThread`).

A STRING element is decoded into a Python `str` one by one (~0.3 us each,
`decode_strings`), and encoded back the same way (`encode_strings`): a 64 MiB request of
2-byte strings held the event loop, every other call with it, for 3 s. On a thread, the
work takes turns of the GIL with the loop (its switch interval, 5 ms) instead.
A request of more than EVENT_LOOP_HASH_BYTES of numbers with a ledger id is read off the
loop too, on a second thread of its own (`TextThread`'s hasher): its fingerprint
(SHA-256 of its data, ~0.6 ms a MiB) held the loop as long; hashlib lets go of the GIL
while it hashes (not while the data is copied out of the message first, ~1.3 ms at
16 MiB), and on its own thread it waits behind no decode of long text.
`scripts/bench_text_loop.py` measures it: 1-row interactive calls beside 512 000-string
bulk requests, p99 43-63 ms with the thread, 399-519 ms without (three runs). The bound,
EVENT_LOOP_TEXT_ELEMENTS, for answers too, comes from one run by hand of an earlier
version, not from a kept script: at 48 000 strings a request no difference beyond the
noise, at 12 000 the hand-offs cost more than they saved. Numbers are never decoded
away: their bytes are used in place, in microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final, TypeVar

from laneserve.client.tensors import encode_strings
from laneserve.server.codec import DecodedInputs, decode_inputs, number_bytes, text_elements
from laneserve.server.engine import TensorSpec
from laneserve.server.errors import DrainingError, JoinLimitError
from laneserve.server.idempotency import MAX_CALLERS_WAITING
from laneserve.server.items import Outcome
from laneserve.server.log_events import event_extra
from laneserve.server.occupancy import Occupancy
from laneserve.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

# The most STRING elements a request's inputs are decoded of, or a batch's answers encoded
# of, on the event loop (about 6 ms); more are by `TextThread` (see the module's note).
EVENT_LOOP_TEXT_ELEMENTS: Final = 20_000
# The most bytes of numeric data a request with a ledger id is hashed of on the event loop
# (`idempotency.fingerprint`, 0.63 ms a MiB here, 11.8 at 16 MiB); more, by `TextThread`.
# On the loop, a latency-bound caller's interactive p99 on the priority port went from
# ~10 ms alone to 58-361 ms beside two callers of 16 MiB requests with ids, 31-48 without
# ids (a user's evaluation, one run each): the hash held every call behind it.
EVENT_LOOP_HASH_BYTES: Final = 1 << 20

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True, slots=True)
class ReadInputs:
    """A request read off the loop (`TextThread.decode`): its decoded inputs and its
    fingerprint (b"": none asked)."""

    inputs: DecodedInputs
    digest: bytes


# The kinds of work done off the loop (`TextThread.counts`): a request's text decoded (and
# hashed), a batch's text answers encoded, both on the text thread; a request of many
# numbers hashed (and decoded, in place), on the hasher.
DECODE: Final = "decode"
ENCODE: Final = "encode"
HASH: Final = "hash"
KINDS: Final = (DECODE, ENCODE, HASH)


@dataclasses.dataclass(frozen=True, slots=True)
class TextThreadCounts:
    """`TextThread.counts`: by kind (KINDS), the work that ended (`done`) and the
    thread's seconds on it (`busy_s`); and the work given and not ended (`pending`)."""

    done: Mapping[str, int]
    busy_s: Mapping[str, float]
    pending: int


class TextThread:
    """The decodes of requests, and the encodes of a batch's answers, of more than
    EVENT_LOOP_TEXT_ELEMENTS strings, on one thread kept for them, and the hashes of new
    requests of more than EVENT_LOOP_HASH_BYTES of numbers with ids on a second (the
    hasher; "decode" below is either read, their invariants the same): not the loop's default
    executor, where the drain's `wait_drained` runs and a
    queue of decodes would hold it back; one for all, since each holds the GIL but for
    its switches, and each more thread would take turns from the event loop too.

    Invariants, which keep a request decoded here answered as one decoded on the loop:
    - a call with the `ledger_id` of a request being decoded waits for that decode
      (`after`) before the ledger is asked about it: the request read first reaches the
      ledger first (a retry joins it instead of decoding again; another request with its
      id, sent second, is the one refused), as when decoding took no await;
    - `_reads` holds the decodes awaited and the calls waiting for one (`after`); the
      drain waits until it finds `_reads.empty` set
      (`_wait_idle`, which looks again after each wake: a call that leaves `after` goes
      on to its own decode, or to the scheduler, in that step) before the scheduler stops
      admitting, so a request read before the drain is admitted. Where the drain stops
      waiting (its grace, a second signal), the decodes still awaited end refused
      DRAINING (`_abandon`), as requests queued then are.
    And one for answers: a batch encoded here is handed to the loop whole, in one
    callback, as the router hands any batch; the stop waits for the batches given to the
    thread (`encoded`) before gRPC's stop would cancel their calls."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="laneserve-text")
        # Reads of many numbers (HASH): behind the text thread's decodes, a 1.15 MiB
        # interactive request waited 171 ms for one of 512 000 strings (a review), where
        # hashed on the loop it took 1 ms. One thread: hashing lets go of the GIL.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="laneserve-hash")
        # Per ledger_id, the first decode in progress of a request with it (set once it
        # ends), and how many calls wait for it in `after`.
        self._by_id: dict[str, asyncio.Event] = {}
        self._waiters: dict[str, int] = {}
        self._reads = Occupancy()
        # Owned by the event loop: the decodes' state.
        self._turn = asyncio.Lock()  # held by the one decode given to the thread
        self._waiting_turn = 0  # decodes waiting for `_turn` (read by `counts`)
        # The decodes awaited (`_abandon`), and of them those `_abandon` cancelled, not a
        # caller.
        self._decodes: set[asyncio.Future[ReadInputs]] = set()
        self._abandoned = False  # `_abandon` was called: a decode asked now is refused
        self._cancelled: set[asyncio.Future[ReadInputs]] = set()
        self._cut = asyncio.Event()  # `cut`: `_wait_idle` and `encoded` return at once
        # The batches given to the thread to encode and not yet handed to the loop; the
        # scheduler thread adds them, the text thread takes them away.
        self._encodes_lock = threading.Lock()
        self._encodes: set[Future[None]] = set()
        # What `counts` reads: per kind of work, how much ended and the thread's seconds
        # on it, and how much was given and has not ended (queued or running). Any thread.
        self._counts_lock = threading.Lock()
        self._done: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._busy_s: dict[str, float] = dict.fromkeys(KINDS, 0.0)
        self._pending = 0

    def _submit(self, kind: str, work: Callable[..., _T], *args: object) -> Future[_T]:
        """`work(*args)` given to the thread, counted as `kind` (`counts`). Raises
        RuntimeError where the thread has stopped."""
        with self._counts_lock:  # before: it may end before `submit` returns
            self._pending += 1
        executor = self._hasher if kind == HASH else self._executor
        try:
            future = executor.submit(self._timed, kind, work, *args)
        except RuntimeError:
            self._ended(None)
            raise
        future.add_done_callback(self._ended)  # cancelled before it ran, too
        return future

    def _timed(self, kind: str, work: Callable[..., _T], *args: object) -> _T:
        started_s = time.perf_counter()
        try:
            return work(*args)
        finally:
            busy_s = time.perf_counter() - started_s
            with self._counts_lock:
                self._done[kind] += 1
                self._busy_s[kind] += busy_s

    def _ended(self, _future: Future[Any] | None) -> None:
        with self._counts_lock:
            self._pending -= 1

    def counts(self) -> TextThreadCounts:
        """What the thread has done, by kind, and what waits for it: a Prometheus
        scrape's (laneserve.text_thread.*), from its thread."""
        with self._counts_lock:
            done, busy_s, pending = dict(self._done), dict(self._busy_s), self._pending
        # The decodes waiting their turn, read from the metric reader's thread: an int.
        return TextThreadCounts(done, busy_s, pending + self._waiting_turn)

    def reading(self, ledger_id: str) -> bool:
        """Whether a request with `ledger_id` ("": none) is being decoded."""
        return ledger_id in self._by_id

    async def decode(
        self,
        ledger_id: str,
        tensors: Sequence[pb.Tensor],
        specs: Sequence[TensorSpec],
        digest_of: Callable[[], bytes] | None = None,
        kind: str = DECODE,
    ) -> ReadInputs:
        """`decode_inputs(tensors, specs)` off the loop, then `digest_of()` (the request's
        fingerprint; b"" without one): refused inputs are not hashed, as on the loop.
        `kind` (`read_off_loop`'s): DECODE, long text, on the text thread, in turn; HASH,
        a request of numbers, on the hasher. Raises the
        refusal, or DrainingError where the drain stopped waiting for it (`_abandon`). A
        caller cancelled meanwhile leaves a read begun to finish (a thread is not
        interrupted; its answer is dropped), and one not begun is never run."""
        text = kind == DECODE
        if self._abandoned:
            raise _abandoned(text=text)
        ended = asyncio.Event()
        if ledger_id:
            self._by_id.setdefault(ledger_id, ended)
        self._reads.enter()
        try:
            if not text:  # no decode to take turns with: the hasher's queue is its order
                return await self._decoded(HASH, tensors, specs, digest_of)
            # One decode at a time given to the thread: a batch's answers (encodes, their
            # callers waiting) run next, not behind every decode queued (in a review's
            # reproduction they took 2.5 s behind three, and a queued decode held its
            # request in the executor's queue after its caller had gone). asyncio's lock
            # wakes its waiters in order.
            self._waiting_turn += 1
            try:
                await self._turn.acquire()
            finally:
                self._waiting_turn -= 1
            try:
                if self._abandoned:
                    raise _abandoned(text=True)
                return await self._decoded(DECODE, tensors, specs, digest_of)
            finally:
                self._turn.release()
        finally:
            if self._by_id.get(ledger_id) is ended:
                del self._by_id[ledger_id]
            ended.set()
            self._reads.leave()

    async def _decoded(
        self,
        kind: str,
        tensors: Sequence[pb.Tensor],
        specs: Sequence[TensorSpec],
        digest_of: Callable[[], bytes] | None,
    ) -> ReadInputs:
        work = asyncio.wrap_future(self._submit(kind, _read, tensors, specs, digest_of))
        self._decodes.add(work)
        try:
            return await work
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if work in self._cancelled and task is not None and not task.cancelling():
                # `_abandon` cancelled it, not its caller.
                raise _abandoned(text=kind == DECODE) from None
            raise
        finally:
            self._decodes.discard(work)
            self._cancelled.discard(work)

    async def after(self, ledger_id: str, timeout_s: float) -> bool:
        """Returns once the request with `ledger_id` being decoded (`reading`: its caller
        asks first) is, or False after `timeout_s`. Raises JoinLimitError where
        MAX_CALLERS_WAITING callers wait on that request already (its own caller one of
        them), as the ledger refuses a retry past them once it runs."""
        assert ledger_id in self._by_id, "asked only while `reading`"
        others = self._waiters.get(ledger_id, 0)
        waiting = 1 + others  # its own caller waits too
        if waiting >= MAX_CALLERS_WAITING:
            raise JoinLimitError(
                f"request_id {ledger_id!r} is being decoded with {waiting} callers waiting "
                f"for its answer, the most one request has ({MAX_CALLERS_WAITING}); "
                "expected a retry once it is answered (its answer is then stored and given "
                "without running it again), or fewer retries and hedges of it at a time"
            )
        self._waiters[ledger_id] = others + 1
        self._reads.enter()
        try:
            # Not wait_for: on 3.11 it can swallow the caller's cancel as the event is set.
            async with asyncio.timeout(timeout_s):
                while (ended := self._by_id.get(ledger_id)) is not None:
                    await ended.wait()
        except TimeoutError:
            return False
        finally:
            if self._waiters[ledger_id] == 1:
                del self._waiters[ledger_id]
            else:
                self._waiters[ledger_id] -= 1
            self._reads.leave()
        return True

    async def reads_finished(self, timeout_s: float) -> int:
        """The server drains: waits until every request read before is decoded (0), or
        `timeout_s` passed or `cut` was called: then those still being decoded, or waiting
        their turn, are refused DRAINING, as queued ones are (`_abandon`), and their count
        returned. Called before the scheduler stops admitting: a request of long text read
        before the drain, decoded within it, is run (or refused for itself), as one
        decoded on the event loop is."""
        if await self._wait_idle(timeout_s):
            return 0
        return self._abandon()

    async def _wait_idle(self, timeout_s: float) -> bool:
        """Waits until no decode is awaited and no call waits for one (True), `timeout_s`
        passed or `cut` was called (False)."""
        loop = asyncio.get_running_loop()
        until_s = loop.time() + timeout_s
        while not self._reads.empty.is_set() and not self._cut.is_set():
            left_s = until_s - loop.time()
            if left_s <= 0:
                break
            idle = asyncio.ensure_future(self._reads.empty.wait())
            cut = asyncio.ensure_future(self._cut.wait())
            try:
                await asyncio.wait((idle, cut), timeout=left_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                idle.cancel()
                cut.cancel()
        return self._reads.empty.is_set()

    def _abandon(self) -> int:
        """The drain stops waiting for decodes: each one awaited or waiting its turn ends
        now, its caller refused DRAINING (one not begun is never run), and a decode asked
        from now on is refused so. Returns how many it refused."""
        self._abandoned = True
        refused = self._waiting_turn
        for work in self._decodes:
            if work.cancel():
                self._cancelled.add(work)
                refused += 1
        return refused

    def cut(self) -> None:
        """A drain in progress, or the next one, stops waiting for the thread: its
        `reads_finished` and `encoded` return now (the operator asked twice)."""
        self._cut.set()

    def encode_then(
        self, outcomes: Sequence[Outcome], resolve: Callable[[Sequence[Outcome]], None]
    ) -> bool:
        """Has the thread encode `outcomes`' text outputs (`text_encoded`), then call
        `resolve` with them there; False where it has stopped (nothing done: the caller
        resolves them as they are, encoded on the loop). Called from the scheduler thread."""
        try:
            work = self._submit(ENCODE, _encode_then, outcomes, resolve)
        except RuntimeError:  # shut down
            return False
        # Not under the lock: `submit` takes the executor's, which `close` holds while a
        # cancelled encode's callback takes this one (both threads stuck).
        with self._encodes_lock:
            self._encodes.add(work)
        work.add_done_callback(self._encoded)  # at once where it has ended already
        return True

    def _encoded(self, work: Future[None]) -> None:
        with self._encodes_lock:
            self._encodes.discard(work)

    async def encoded(self, timeout_s: float) -> None:
        """Returns once the batches given to the thread to encode have been handed to the
        loop (their `resolve` called, and those callbacks run before this returns), or
        after `timeout_s`, or at `cut` (they may come later, or not at all). Called once
        no batch runs any more."""
        with self._encodes_lock:
            pending = [asyncio.wrap_future(work) for work in self._encodes]
        if not pending:
            return
        # Not cancelled at the timeout (asyncio.wait cancels nothing): cancelled, the
        # encodes not yet begun would be dropped, their calls left unanswered.
        handed = asyncio.gather(*pending, return_exceptions=True)
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            await asyncio.wait(
                (handed, cut), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            cut.cancel()

    def close(self) -> None:
        """The server stopped: the thread goes once the work it began ends; work not begun
        is dropped (no call is left to answer)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._hasher.shutdown(wait=False, cancel_futures=True)


def _abandoned(*, text: bool) -> DrainingError:
    waiting = "text was still being decoded" if text else "data was still being hashed"
    return DrainingError(
        f"server is draining, and its grace ended while this request's {waiting}; "
        "retry on another instance"
    )


def long_text(tensors: Sequence[pb.Tensor]) -> bool:
    """Whether `tensors` hold more than EVENT_LOOP_TEXT_ELEMENTS strings (their shapes
    say, their data unread): decoded by the text thread, in turn."""
    return text_elements(tensors) > EVENT_LOOP_TEXT_ELEMENTS


def read_off_loop(tensors: Sequence[pb.Tensor], *, hashed: bool) -> str | None:
    """How a new request of `tensors` is read by `TextThread` (decoded, and hashed where
    `hashed`: it has a ledger id), their data unread: DECODE, more than
    EVENT_LOOP_TEXT_ELEMENTS strings (the text thread); HASH, hashed and more than
    EVENT_LOOP_HASH_BYTES of numbers (the hasher); None: on the loop (the strings of a
    few long elements too: their size is their data's, read only by a copy). Asked once
    per request: `TextThread.decode` and the refusals take its answer."""
    if long_text(tensors):
        return DECODE
    return HASH if hashed and number_bytes(tensors) > EVENT_LOOP_HASH_BYTES else None


def _read(
    tensors: Sequence[pb.Tensor],
    specs: Sequence[TensorSpec],
    digest_of: Callable[[], bytes] | None,
) -> ReadInputs:
    """A request's read on the thread (`TextThread.decode`): its inputs decoded, then
    hashed (b"" without `digest_of`)."""
    decoded = decode_inputs(tensors, specs)  # refused before hashed, as on the loop
    return ReadInputs(decoded, b"" if digest_of is None else digest_of())


def encoded_off_loop(outcome: Outcome) -> bool:
    """Whether `outcome`'s answer holds more than EVENT_LOOP_TEXT_ELEMENTS strings: each
    answer is encoded in its own step of the loop, so its own strings, not its batch's,
    say what that step would cost."""
    if outcome.outputs is None:
        return False
    strings = sum(array.size for array in outcome.outputs.values() if array.dtype.hasobject)
    return strings > EVENT_LOOP_TEXT_ELEMENTS


def text_encoded(outcome: Outcome) -> Outcome:
    """`outcome` with each text output's data encoded (`Outcome.text_data`), as
    `encode_tensor` encodes it. An output that does not encode is left to the loop's
    encode, which refuses it as the answer's failure, as it did every answer."""
    if outcome.outputs is None:
        return outcome
    text_data: dict[str, bytes] = {}
    for name, array in outcome.outputs.items():
        if array.dtype.hasobject:
            with contextlib.suppress(ValueError):
                text_data[name] = encode_strings(f"tensor {name!r}", array)
    return dataclasses.replace(outcome, text_data=text_data) if text_data else outcome


def _encode_then(outcomes: Sequence[Outcome], resolve: Callable[[Sequence[Outcome]], None]) -> None:
    """The answers of `outcomes` over the loop's share encoded (`encoded_off_loop`), the
    rest left to the loop; then `resolve` with all of them, whatever happened."""
    try:
        encoded = [
            text_encoded(outcome) if encoded_off_loop(outcome) else outcome for outcome in outcomes
        ]
    except Exception:  # every answer is resolved, encoded here or not
        log.exception(
            "encoding a batch's text answers failed; they are encoded on the event loop",
            extra=event_extra("text_encode_failed"),
        )
        encoded = list(outcomes)
    resolve(encoded)
