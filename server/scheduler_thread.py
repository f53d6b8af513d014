"""The scheduler thread and the engine thread around one `Scheduler`.

Threads and what they own:
- Callers (the event loop) `submit` and `cancel`: both take the lock and change the
  scheduler; admission is answered at once, in the call. They wake the scheduler thread
  only when it has something to decide (the session is free, or a deadline moved up).
- The scheduler thread sheds expired work and, whenever the session is free, asks the
  dispatch rule for the next batch. It sleeps on the condition until the next deadline,
  the dispatch time, a submission or a result. It never runs the model, so shedding and
  admission stay prompt while the session is busy.
- The engine thread runs one batch at a time; after each it applies the result, sheds
  what expired meanwhile and, if the dispatch rule says go, takes the next batch itself
  (no idle hop between batches).
The scheduler's state changes only under the one lock, whichever thread holds it. Every
answer leaves through `deliver`, once per batch (or per shed round), outside the lock.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from laneserve.server.clock import Clock, SystemClock
from laneserve.server.errors import (
    DrainingError,
    LaneserveError,
    ServerFaultError,
    SessionBrokenError,
)
from laneserve.server.items import Batch, BatchResult, InferenceRequest, Outcome, RowsWanted
from laneserve.server.log_events import event_extra, log_event
from laneserve.server.memory import MemoryGauge, WatermarkState, format_bytes
from laneserve.server.scheduler import Dispatch, LaneDepth, Scheduler, WaitUntil

log = logging.getLogger(__name__)

RunBatch = Callable[[Batch, RowsWanted], BatchResult]
MEMORY_SAMPLE_PERIOD_S = 0.05
# While the watermark holds lanes closed and no batch runs, the engine is asked to give
# back what its arena keeps at most this often (see `_give_back_memory`).
MEMORY_RELEASE_PERIOD_S = 1.0
Deliver = Callable[[Sequence[Outcome]], None]
# The lanes the watermark closes and reopens are logged at most this often (the changes in
# between counted in the next line): readings come every MEMORY_SAMPLE_PERIOD_S.
CLOSED_LANES_LOG_S = 10.0
# Deadlines taken off the scheduler's heap a pass under the lock, at most (expired
# requests answered, and stale deadlines of work answered, running or moved): 16 000
# requests that expired together (a burst of bulk work with one deadline) held it ~85 ms
# in one pass, and every admission on the event loop with it; 16 000 stale deadlines,
# ~10 ms. Between passes the lock is let go and the answers go out.
SHED_CHUNK = 512


class ClosedLanesLog:
    """Logs the lanes the memory watermark closes (lanes_closed_by_memory, WARNING) and
    their reopening (lanes_reopened_by_memory, INFO): only the refusals' counts and a
    gauge told of it, and `laneserve top` showed lanes closed with memory below the
    mark shown (a review). A line for each change of the closed lanes, at most one per
    CLOSED_LANES_LOG_S: one that comes sooner is written when that time is up, saying
    how many changes it sums. Fed every reading (`observe`), on the scheduler thread."""

    def __init__(self) -> None:
        self._seen: tuple[str, ...] = ()  # the closed lanes at the last reading
        self._logged: tuple[str, ...] = ()  # ... as the last line told them
        self._changes = 0  # changes of `_seen` since the last line
        self._line_s = -math.inf

    def observe(self, state: WatermarkState, now_s: float) -> None:
        closed = state.closed_lanes
        if closed != self._seen:
            self._seen = closed
            self._changes += 1
        if closed == self._logged or now_s - self._line_s < CLOSED_LANES_LOG_S:
            return
        changes = "" if self._changes == 1 else f" ({self._changes} changes since the last line)"
        used = format_bytes(state.used_bytes or 0)
        if closed:
            log_event(
                log,
                logging.WARNING,
                "lanes_closed_by_memory",
                f"memory in use {used} passed the high watermark "
                f"{format_bytes(state.high_bytes)}: lane(s) {', '.join(closed)} admit no new "
                f"work until it falls below {format_bytes(state.low_bytes)} (with nothing "
                f"queued or running, below the high watermark){changes}",
                closed_lanes=list(closed),
                used_bytes=state.used_bytes,
                changes=self._changes,
            )
        else:
            log_event(
                log,
                logging.INFO,
                "lanes_reopened_by_memory",
                f"memory in use {used}: every lane admits work again{changes}",
                used_bytes=state.used_bytes,
                changes=self._changes,
            )
        self._logged, self._changes, self._line_s = closed, 0, now_s


class _SchedulerFailedError(Exception):
    """The scheduler raised answering the engine's question (`_rows_wanted`): a bug. It
    reaches `_run_forever` through the engine's run, and stops the server there."""


class SchedulerThread:
    def __init__(
        self,
        scheduler: Scheduler,
        run_batch: RunBatch,
        deliver: Deliver,
        *,
        clock: Clock | None = None,
        memory_gauge: MemoryGauge | None = None,
        release_memory: Callable[[], object] | None = None,
        on_failure: Callable[[LaneserveError], object] | None = None,
    ) -> None:
        """`on_failure` is called (from the failing thread) once the scheduler or engine
        thread has failed for good and every live request has been answered with the
        error: the server cannot serve any more. `release_memory` (the engine's
        `release_idle_memory`) is called, with no batch running and outside the lock,
        before a memory reading, at most every MEMORY_RELEASE_PERIOD_S, while the
        watermark holds lanes closed."""
        self._scheduler = scheduler
        self._on_failure = on_failure
        # Read at most every MEMORY_SAMPLE_PERIOD_S by the scheduler thread, which then
        # never sleeps longer than that: a closed lane must reopen while idle too.
        self._memory_gauge = memory_gauge
        self._memory_sampled_s = -math.inf
        self._closed_lanes_log = ClosedLanesLog()
        # The runtime's arena keeps the regions a burst of large batches grew, and the
        # watermark's reading with them held every lane closed, interactive too, for
        # good: it is asked to give them back, at most every MEMORY_RELEASE_PERIOD_S, while
        # lanes are closed (once per idle spell, lanes stayed closed in 2 of 3 runs).
        self._release_memory = release_memory
        self._memory_released_s = -math.inf  # when it was last asked to
        self._release_due = False  # `_step` asked for it: the scheduler thread runs it next
        self._run_batch = run_batch
        self._deliver = deliver
        self._clock = clock or SystemClock()
        # Guards everything below and the scheduler itself.
        self._cond = threading.Condition()
        self._busy = False  # a batch is in the engine thread
        # When the scheduler thread wakes by itself next (inf: only when notified).
        self._wake_at_s = -math.inf
        # When the session last became free; work queued before it waited on a busy
        # session and goes out at once.
        self._idle_since_s = -math.inf
        self._closing = False
        self._grace_ended = False  # end_grace: wait_drained returns at once
        # Set once the server cannot serve any more: every later submission is refused
        # with it. After a broken session, a DrainingError (that work never runs, and may
        # run elsewhere), not the error the server fails with (see `_fail`).
        self._refusal: LaneserveError | None = None
        self._work: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(
                target=self._schedule_forever, name="laneserve-scheduler", daemon=True
            ),
            threading.Thread(target=self._run_forever, name="laneserve-engine", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    # ---- called from any thread -------------------------------------------------

    def submit(self, request: InferenceRequest) -> int:
        """Admits `request` (its answer comes through `deliver`) or raises why not."""
        with self._cond:
            refusal = self._refusal
            if refusal is None and self._closing:
                refusal = DrainingError("server is shutting down; retry on another instance")
            if refusal is not None:
                # Counted as the scheduler counts its own refusals (they went uncounted).
                self._scheduler.count_refusal(request, refusal, self._clock.monotonic())
                raise refusal
            entry_id = self._scheduler.admit(request, self._clock.monotonic())
            # While a batch runs the scheduler has nothing to decide about new work, so
            # it is woken only if this entry's deadline comes before its next wake-up:
            # under load, submissions do not each wake a thread.
            deadline_s = self._scheduler.next_deadline_s(SHED_CHUNK)
            if not self._busy or (deadline_s is not None and deadline_s < self._wake_at_s):
                self._cond.notify_all()
            return entry_id

    def cancel(self, entry_id: int, *, unless_running: bool = False) -> str | None:
        """See `Scheduler.cancel`: the status it ended with, None when an answer is due."""
        with self._cond:
            cancelled = self._scheduler.cancel(
                entry_id, self._clock.monotonic(), unless_running=unless_running
            )
            self._cond.notify_all()
            return cancelled

    def move_deadline(self, entry_id: int, deadline_s: float) -> bool:
        """See `Scheduler.move_deadline`. Wakes the scheduler thread: a deadline moved
        earlier may come before its next wake-up (it would shed or dispatch late)."""
        with self._cond:
            moved = self._scheduler.move_deadline(entry_id, deadline_s)
            if moved:
                self._cond.notify_all()
            return moved

    def stop_accepting(self) -> None:
        with self._cond:
            self._scheduler.stop_accepting()

    def wait_drained(self, timeout_s: float) -> bool:
        """Blocks until every admitted request has been answered (True), or `timeout_s`
        passed or `end_grace` was called (False). Only after `stop_accepting`: the engine
        thread wakes this condition after a batch only then (see `_finish`), so a wait
        while accepting would sleep out its timeout."""
        with self._cond:
            assert not self._scheduler.accepting, "wait_drained follows stop_accepting"
            self._cond.wait_for(
                lambda: self._scheduler.live_entries == 0 or self._grace_ended, timeout_s
            )
            return self._scheduler.live_entries == 0

    def end_grace(self) -> None:
        """A drain in progress stops waiting for queued work (the operator asked twice)."""
        with self._cond:
            self._grace_ended = True
            self._cond.notify_all()

    @property
    def grace_ended(self) -> bool:
        """Whether `end_grace` was called (a drain that ends incomplete was cut short)."""
        with self._cond:
            return self._grace_ended

    def depths(self) -> list[LaneDepth]:
        with self._cond:
            return self._scheduler.depths()

    def room_wait_s(self, lane: str, rows: int) -> float | None:
        """See `Scheduler.room_wait_s`."""
        with self._cond:
            return self._scheduler.room_wait_s(lane, rows)

    @property
    def batch_cap(self) -> int:
        return self._scheduler.batch_cap

    @property
    def max_batch_cap(self) -> int:
        return self._scheduler.max_batch_cap

    def watermark_state(self) -> WatermarkState | None:
        with self._cond:
            return self._scheduler.watermark_state()

    def close(
        self,
        error: LaneserveError | None = None,
        *,
        running_error: LaneserveError | None = None,
        join_timeout_s: float | None = None,
    ) -> bool:
        """Answers whatever is left with `error` (default: draining; requests in the
        running batch with `running_error`, if given) and stops both threads, waiting at
        most `join_timeout_s` for them. False when the engine thread was still running a
        batch then: it is left to finish in the background, its result discarded (the
        threads are daemons: they never hold up the process's exit)."""
        with self._cond:
            self._closing = True
            outcomes = self._scheduler.abort_all(
                error or DrainingError("server shut down"), running_error
            )
            self._cond.notify_all()
        if outcomes:
            self._deliver(outcomes)
        self._work.put(None)
        return self.join(join_timeout_s)

    def join(self, timeout_s: float | None = None) -> bool:
        """Waits at most `timeout_s` for both threads to end (after `close`); whether
        they did."""
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout_s)
        return not any(thread.is_alive() for thread in self._threads)

    # ---- the scheduler thread ----------------------------------------------------

    def _schedule_forever(self) -> None:
        # Answers made but not yet handed to `deliver`, each added as it is made (the
        # scheduler fills it: see `Scheduler.complete`): a failure after, or while, they
        # were taken from the scheduler must not lose them (_fail answers only what it
        # still holds).
        outcomes: list[Outcome] = []
        try:
            while True:
                with self._cond:
                    timeout_s = self._step(outcomes)
                    release = self._release_due
                    if not outcomes and not release:
                        if self._closing:
                            return
                        self._cond.wait(timeout_s)
                        continue
                    if outcomes:
                        self._cond.notify_all()  # wait_drained may be waiting on these
                if release:
                    self._give_back_memory()
                if outcomes:
                    ready, outcomes = outcomes, []
                    self._deliver(ready)
        except Exception:  # logged with its traceback; the thread ends here
            log.exception(
                "scheduler thread failed; answering all queued work",
                extra=event_extra("scheduler_thread_failed"),
            )
            self._fail_for_a_bug(outcomes)

    def _fail_for_a_bug(self, outcomes: list[Outcome]) -> None:
        """After the scheduler raised (a bug, or a lost device's readings; logged by the
        caller with its traceback): the answers made before it raised are delivered (the
        scheduler adds each as it makes it), then the server fails: `_fail` answers only
        what is left."""
        if outcomes:
            self._deliver(outcomes)
        self._fail(ServerFaultError("the scheduler failed; the server must be restarted"))

    def _give_back_memory(self) -> None:
        """Runs `release_memory` (a session run of its own) outside the lock: admissions
        from the event loop take the lock, and waited for the run under it. `_step` set
        the engine busy for it; it is free again after, and memory is read at once."""
        assert self._release_memory is not None
        try:
            self._release_memory()
        finally:
            with self._cond:
                self._release_due = False
                self._busy = False
                self._memory_sampled_s = -math.inf
                self._cond.notify_all()

    def _step(self, outcomes: list[Outcome]) -> float | None:
        """One pass under the lock: adds what to answer now to `outcomes`; returns how
        long to sleep after."""
        scheduler = self._scheduler
        now_s = self._clock.monotonic()
        if (
            self._memory_gauge is not None
            and now_s - self._memory_sampled_s >= MEMORY_SAMPLE_PERIOD_S
        ):
            self._memory_sampled_s = now_s
            if (
                self._release_memory is not None
                and not self._busy  # the engine thread is idle: nothing else runs
                and now_s - self._memory_released_s >= MEMORY_RELEASE_PERIOD_S
                and scheduler.memory_holds_lanes_closed
            ):
                # Given back outside the lock, then read (see `_give_back_memory`); the
                # engine counts as busy meanwhile, so that nothing is dispatched to it.
                self._memory_released_s = now_s
                self._release_due = True
                self._busy = True
            else:
                used_bytes = self._memory_gauge.used_bytes()
                if used_bytes is not None:
                    scheduler.update_memory(used_bytes)
                    state = scheduler.watermark_state()
                    if state is not None:
                        self._closed_lanes_log.observe(state, now_s)
                now_s = self._clock.monotonic()  # a reading takes time: shed with the time after
        scheduler.shed_expired(now_s, SHED_CHUNK, into=outcomes)
        if scheduler.expired_left(now_s):
            return 0.0  # more may be due: answered first, the lock let go, then the rest
        timeout_s: float | None = None
        if not self._busy and not self._closing:
            decision = scheduler.decide(now_s, self._idle_since_s)
            if isinstance(decision, Dispatch):
                self._busy = True
                self._work.put(decision.batch)
            elif isinstance(decision, WaitUntil):
                timeout_s = decision.at_s - now_s
        if self._memory_gauge is not None:
            timeout_s = (
                MEMORY_SAMPLE_PERIOD_S
                if timeout_s is None
                else min(timeout_s, MEMORY_SAMPLE_PERIOD_S)
            )
        next_deadline_s = scheduler.next_deadline_s(SHED_CHUNK)
        if next_deadline_s is not None:
            until_deadline_s = next_deadline_s - now_s
            timeout_s = until_deadline_s if timeout_s is None else min(timeout_s, until_deadline_s)
        timeout_s = None if timeout_s is None else max(timeout_s, 0.0)
        self._wake_at_s = math.inf if timeout_s is None else now_s + timeout_s
        return timeout_s

    def _fail(
        self,
        error: LaneserveError,
        refusal: LaneserveError | None = None,
        partly_run: LaneserveError | None = None,
    ) -> None:
        """The server fails with `error` (handed to `on_failure`). Every live request is
        answered: one with rows handed to a batch (some may have run) with `partly_run`,
        the rest, and every later submission, with `refusal` (each defaults to `error`).
        A broken session's are DrainingErrors (`_broken`): no row of such
        a request was in the batch that failed, so it could not have broken the session,
        and it is retried elsewhere (UNAVAILABLE is what clients and gRPC retry policies
        retry); after a scheduler failure everything gets `error`: the rows of the batch
        it was applying may have run."""
        refusal = error if refusal is None else refusal
        partly_run = error if partly_run is None else partly_run
        with self._cond:
            self._refusal = refusal
            self._closing = True
            outcomes = self._scheduler.abort_all(refusal, partly_run)
            self._cond.notify_all()
        if outcomes:
            self._deliver(outcomes)
        if self._on_failure is not None:
            self._on_failure(error)

    # ---- the engine thread -------------------------------------------------------

    def _run_forever(self) -> None:
        """Runs batches; after each, applies its result and, when the dispatch rule says
        go (work that queued meanwhile always does), takes the next batch itself: the
        session is not left idle for a hop through the scheduler thread."""
        batch = self._work.get()
        while batch is not None:
            with self._cond:
                if self._closing:
                    # close() (or a failure) has answered every live request, this
                    # batch's too: they were told they never ran, so they do not.
                    return
            try:
                result = self._run_batch(batch, functools.partial(self._rows_wanted, batch))
            except _SchedulerFailedError:  # logged with its traceback; the thread ends here
                log.exception(
                    "the scheduler failed while batch %d ran; answering all queued work",
                    batch.batch_id,
                    extra=event_extra("scheduler_thread_failed"),
                )
                # The answers it made before it raised are out (`_rows_wanted`).
                self._fail_for_a_bug([])
                return
            except Exception as error:
                log.exception(
                    "batch %d failed outside the runtime",
                    batch.batch_id,
                    extra=event_extra("batch_failed", batch_id=batch.batch_id),
                )
                # Every request of the batch is told it was not its own input (a server
                # fault, logged above: the batch_failed line's id), and that a retry may
                # run: "batch failed: RuntimeError(...)" read as a verdict on the request.
                fault = ServerFaultError(
                    f"batch {batch.batch_id} failed in the server outside the model's run, "
                    f"not for this request's input: {error!r}; a retry may succeed"
                )
                result = BatchResult(batch, None, fault, 0.0)
            failure = _session_failure(result)
            refusal = None if failure is None else _broken(failure, "this request never ran")
            outcomes: list[Outcome] = []
            try:
                batch = self._finish(result, outcomes, refusal)
            except Exception:  # logged with its traceback; the thread ends here
                log.exception(
                    "applying a batch result failed; answering all queued work",
                    extra=event_extra("scheduler_thread_failed"),
                )
                self._fail_for_a_bug(outcomes)
                return
            if outcomes:
                self._deliver(outcomes)
            if failure is not None:  # this batch's answers are out: now the rest
                log_event(
                    log,
                    logging.ERROR,
                    "session_broken",
                    f"the session is broken ({failure.cause}); answering all queued work "
                    "and stopping (the process must be restarted)",
                    batch_id=result.batch.batch_id,
                    error=failure.cause,
                )
                self._fail(
                    failure,
                    refusal,
                    _broken(failure, "part of this request ran, but its answer was not kept"),
                )
                return
            if batch is None:
                batch = self._work.get()

    def _rows_wanted(self, batch: Batch) -> npt.NDArray[np.bool_]:
        """Asked by the engine before each part of a split batch: the rows to run; the
        callers whose deadline passed are answered now, not when the batch ends."""
        outcomes: list[Outcome] = []
        try:
            with self._cond:
                wanted, _ = self._scheduler.rows_wanted(
                    batch, self._clock.monotonic(), into=outcomes
                )
                if outcomes:
                    self._cond.notify_all()  # wait_drained may be waiting on these
        except Exception as error:
            # A scheduler bug stops the server, as one in `_step` or `_finish` does: taken
            # for the batch's own failure (the engine's run raised), it failed the batch
            # alone and the server went on serving on a scheduler it may have left
            # half-updated. `_run_forever` catches it.
            raise _SchedulerFailedError from error
        finally:
            # Delivered when the scheduler raised partway too, before the failure
            # answers the requests still live.
            if outcomes:
                self._deliver(outcomes)
        return wanted

    def _finish(
        self,
        result: BatchResult,
        outcomes: list[Outcome],
        refusal: DrainingError | None = None,
    ) -> Batch | None:
        """Under the lock: adds the answers of a finished batch to `outcomes`; returns the
        next batch if due. `refusal`: the batch found the session broken (see
        `_session_failure`), and what never runs is answered with it; nothing is due
        then."""
        with self._cond:
            if refusal is not None:
                # No batch can run any more: none is dispatched (by either thread), and
                # submissions are refused with it, until `_fail` answers what is left.
                self._refusal, self._closing = refusal, True
            self._idle_since_s = self._clock.monotonic()
            self._scheduler.complete(result, into=outcomes, ended_s=self._idle_since_s)
            # Shed before deciding, as the scheduler thread does, with the time after
            # completing (it takes time): work whose deadline passed while this batch ran
            # must not become the next batch, and the scheduler thread, asleep until that
            # deadline, may not have woken yet.
            now_s = self._clock.monotonic()
            self._scheduler.shed_expired(now_s, SHED_CHUNK, into=outcomes)
            self._busy = False
            if self._scheduler.expired_left(now_s):
                # More may be due: the scheduler thread sheds the rest, a chunk a pass,
                # and decides after them (a batch must not take them).
                self._cond.notify_all()
                return None
            decision = None if self._closing else self._scheduler.decide(now_s, self._idle_since_s)
            following = None
            if isinstance(decision, Dispatch):
                self._busy = True
                following = decision.batch
            # The scheduler thread is woken only when it has a timer to set: the dispatch
            # time of work left waiting (it plans none while a batch runs), or a drain
            # (wait_drained sees the answers). Its deadline timer needs no update: it
            # already covers every live entry, and a completion only removes some. Woken
            # after every batch, it took the GIL while the event loop was handed this
            # batch's answers (with one caller: 135 us from hand-off to the loop's
            # callback, 75 us without it).
            if isinstance(decision, WaitUntil) or self._closing or not self._scheduler.accepting:
                self._cond.notify_all()
            return following


def _session_failure(result: BatchResult) -> SessionBrokenError | None:
    """The error the server fails with when `result` found the session broken (rows failed
    with SessionBrokenError: the engine ran an input it ran at start-up, and that failed
    too); None otherwise. The live requests not in that batch are answered `_broken`.
    Every later batch would fail the same way, behind health that said SERVING."""
    broken = next(
        (
            failed.error
            for failed in result.failed_rows
            if isinstance(failed.error, SessionBrokenError)
        ),
        None,
    )
    if broken is None:
        return None
    return SessionBrokenError(
        f"the model's session is broken ({broken.cause}); the server is stopping and must "
        "be restarted",
        cause=broken.cause,
    )


def _broken(failure: SessionBrokenError, what: str) -> DrainingError:
    """The answer, after the session was found broken, for a request with no row in the
    batch that found it (it could not have broken the session): "this request never ran"
    (none of its rows handed to a batch; every later submission too), or "part of this
    request ran, but its answer was not kept" (split over batches, rows run in earlier
    ones). UNAVAILABLE (DRAINING), which clients and gRPC retry policies retry on another
    instance: INTERNAL told them not to. The server still fails with `failure`."""
    return DrainingError(
        f"the model's session is broken ({failure.cause}); {what}: retry on another "
        "instance (this server is stopping)"
    )
