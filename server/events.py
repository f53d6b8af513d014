"""What the scheduler tells the outside world, through one small interface.

Implemented by the stats recorder (GetStats) and the OpenTelemetry adapter. Calls come
from the scheduler's owner under its lock: implementations must be quick and must not
call back into the scheduler. The exception is `request_finished`, which the service
calls from the event loop: implementations guard their own state.

`RequestTracer` is the service's side of tracing: one opaque `RequestTrace` per queued
request, which the scheduler carries (`InferenceRequest.trace`, `BatchSlice.trace`)
without looking inside, so that the telemetry adapter can link each batch to the
requests it serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from laneserve.server.errors import LaneserveError
from laneserve.server.items import Batch, Signature
from laneserve.server.log_events import event_extra

log = logging.getLogger(__name__)


class SchedulerEvents(Protocol):
    def admitted(self, lane: str, rows: int) -> None: ...

    def rejected(
        self,
        lane: str,
        reason: str,
        waited_s: float,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        """A request was refused without being admitted. `waited_s`: from its arrival in
        the servicer (before decoding, as `request_finished`'s `duration_s`) to its
        refusal: a retry refused after waiting for the request it joined, a stream item
        after waiting for room in its full lane; about 0 for one refused as it reached
        the servicer (its bytes did not parse: the microseconds since its arrival was
        read), 0.0 where it never had one here (an oversized request, another front end's
        conversion of it failed, `InferenceRequest.arrived_s` None). `request_id`: its
        request's ("" or None: none, or one not quoted: over MAX_REQUEST_ID_BYTES); `error`:
        the refusal its caller got (None: none, its caller had left), as `completed`
        takes them: what an operator reads of a flood of bad requests."""
        ...

    def shed(self, lane: str, reason: str, rows: int) -> None:
        """Queued rows dropped without running; reason EXPIRED_IN_QUEUE or CANCELLED."""
        ...

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float | None]) -> None:
        """`queue_waits_s`: per slice of the batch, how long its request waited for its
        first batch; None for a later chunk of a request larger than the cap (a request
        has one queue wait, however many batches carry it)."""
        ...

    def batch_done(
        self,
        batch: Batch,
        run_s: float,
        error: LaneserveError | None,
        failed_rows: int = 0,
        *,
        split: bool = False,
    ) -> None:
        """A batch ran: `error` when it failed whole, else `failed_rows` of its rows failed
        (a split batch) and the rest ran. `split`: it ran in parts after a failed run (out
        of memory, or a failure a part may not repeat), so `run_s` is no one run's."""
        ...

    def completed(
        self,
        lane: str,
        status: str,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        """An admitted request ended: "OK", the error's reason, "CANCELLED" (its caller left:
        no answer due) or "DEADLINE_EXCEEDED" (its gRPC deadline passed while it ran:
        gRPC answered the caller). `request_id` and `error`: given when it was answered
        with an error (the event log names the requests a model failed on)."""
        ...

    def out_of_memory(self, rows: int) -> None:
        """A run of `rows` rows failed to allocate device memory (split when it has more
        than one row; one row fails alone, or was the engine's probe)."""
        ...

    def batch_split(self, batch_id: int, rows: int, out_of_memory_runs: int) -> None:
        """Batch `batch_id` of `rows` rows was run in parts after running out of memory
        (once per batch, however many times its parts split again; `out_of_memory_runs`
        of its runs did). Before its `batch_done`."""
        ...

    def cap_changed(self, old_rows: int, new_rows: int, reason: str, signature: Signature) -> None:
        """The batch cap of rows of `signature` (each input's shape after the row axis)
        moved: reason "out_of_memory" (down) or "recovered" (up)."""
        ...

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        """Device memory in use, as the watermark sees it."""
        ...

    def request_finished(
        self, lane: str, status: str, duration_s: float, *, late: bool = False
    ) -> None:
        """The service answered an admitted request ("OK" or the error's reason), its
        caller left ("CANCELLED"), or its gRPC deadline passed while it ran
        ("DEADLINE_EXCEEDED"). `duration_s` runs from the request's arrival in the
        servicer (before decoding) to its answer. `late`: answered OK after the deadline
        the scheduler kept (its timeout_ms or its lane's timeout; a gRPC deadline passed
        is DEADLINE_EXCEEDED): its run ended past it (`Outcome.late`). Called on the event
        loop, not under the scheduler's lock."""
        ...


class RequestTrace(Protocol):
    """One request's spans. Called on the event loop: `replying` at most once, then `end`."""

    def replying(self) -> None:
        """The answer is back on the event loop: the reply starts."""
        ...

    def end(self, status: str, *, late: bool = False) -> None:
        """The request is over: "OK", why it was refused or failed, or "CANCELLED".
        `late`: answered OK from a run that ended past its deadline (`Outcome.late`)."""
        ...


class RequestTracer(Protocol):
    def start(self, request_id: str, lane: str, rows: int, budget_s: float) -> RequestTrace:
        """A validated request is about to be queued. `budget_s`: the time left before the
        deadline the scheduler keeps (its own, or its lane's timeout from its arrival)."""
        ...

    def retried(self, request_id: str, lane: str, how: str) -> None:
        """A request is answered by the ledger without being queued: `how` is "join" (one
        with its request_id is in flight) or "replay" (its answer is stored)."""
        ...

    def joined(self, request_id: str, lane: str) -> RequestTrace:
        """A call joins the request `request_id` in flight: the trace of the answer it
        takes, a `reply` alone (`replying` as the answer reaches it, then `end` with what
        it got); it queued nothing, and the request's spans are the submitter's."""
        ...


class _NullTrace:
    def replying(self) -> None:
        pass

    def end(self, status: str, *, late: bool = False) -> None:
        pass


NULL_TRACE: RequestTrace = _NullTrace()


class NullTracer:
    """Tracing off: one shared do-nothing trace, nothing allocated per request."""

    def start(self, request_id: str, lane: str, rows: int, budget_s: float) -> RequestTrace:
        return NULL_TRACE

    def retried(self, request_id: str, lane: str, how: str) -> None:
        pass

    def joined(self, request_id: str, lane: str) -> RequestTrace:
        return NULL_TRACE


class NullEvents:
    def admitted(self, lane: str, rows: int) -> None:
        pass

    def rejected(
        self,
        lane: str,
        reason: str,
        waited_s: float,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        pass

    def shed(self, lane: str, reason: str, rows: int) -> None:
        pass

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float | None]) -> None:
        pass

    def batch_done(
        self,
        batch: Batch,
        run_s: float,
        error: LaneserveError | None,
        failed_rows: int = 0,
        *,
        split: bool = False,
    ) -> None:
        pass

    def completed(
        self,
        lane: str,
        status: str,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        pass

    def out_of_memory(self, rows: int) -> None:
        pass

    def batch_split(self, batch_id: int, rows: int, out_of_memory_runs: int) -> None:
        pass

    def cap_changed(self, old_rows: int, new_rows: int, reason: str, signature: Signature) -> None:
        pass

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        pass

    def request_finished(
        self, lane: str, status: str, duration_s: float, *, late: bool = False
    ) -> None:
        pass


class FanOut:
    """Sends every event to several sinks, in order.

    A sink that raises is a telemetry bug, not a reason to stop serving: the event still
    reaches the other sinks, the scheduler goes on (it calls these under its lock, in the
    middle of answering requests), and the failure is logged with its traceback the
    first time per sink and event, counted after that (`failures`).
    """

    def __init__(self, *sinks: SchedulerEvents) -> None:
        self._sinks = sinks
        self.failures: dict[tuple[str, str], int] = {}

    def _each(self, event: str, call: Callable[[SchedulerEvents], None]) -> None:
        for sink in self._sinks:
            try:
                call(sink)
            except Exception:  # a telemetry bug must not stop serving
                key = (type(sink).__name__, event)
                count = self.failures[key] = self.failures.get(key, 0) + 1
                if count == 1:
                    log.exception(
                        "telemetry sink %s failed on %s; serving goes on, later failures "
                        "of it are counted, not logged",
                        *key,
                        extra=event_extra("telemetry_sink_failed", sink=key[0], on=event),
                    )

    def admitted(self, lane: str, rows: int) -> None:
        self._each("admitted", lambda sink: sink.admitted(lane, rows))

    def rejected(
        self,
        lane: str,
        reason: str,
        waited_s: float,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        self._each(
            "rejected",
            lambda sink: sink.rejected(lane, reason, waited_s, request_id=request_id, error=error),
        )

    def shed(self, lane: str, reason: str, rows: int) -> None:
        self._each("shed", lambda sink: sink.shed(lane, reason, rows))

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float | None]) -> None:
        self._each("batch_formed", lambda sink: sink.batch_formed(batch, queue_waits_s))

    def batch_done(
        self,
        batch: Batch,
        run_s: float,
        error: LaneserveError | None,
        failed_rows: int = 0,
        *,
        split: bool = False,
    ) -> None:
        self._each(
            "batch_done",
            lambda sink: sink.batch_done(batch, run_s, error, failed_rows, split=split),
        )

    def completed(
        self,
        lane: str,
        status: str,
        *,
        request_id: str | None = None,
        error: LaneserveError | None = None,
    ) -> None:
        self._each(
            "completed",
            lambda sink: sink.completed(lane, status, request_id=request_id, error=error),
        )

    def out_of_memory(self, rows: int) -> None:
        self._each("out_of_memory", lambda sink: sink.out_of_memory(rows))

    def batch_split(self, batch_id: int, rows: int, out_of_memory_runs: int) -> None:
        self._each("batch_split", lambda sink: sink.batch_split(batch_id, rows, out_of_memory_runs))

    def cap_changed(self, old_rows: int, new_rows: int, reason: str, signature: Signature) -> None:
        self._each(
            "cap_changed", lambda sink: sink.cap_changed(old_rows, new_rows, reason, signature)
        )

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        self._each("memory_sampled", lambda sink: sink.memory_sampled(used_bytes, budget_bytes))

    def request_finished(
        self, lane: str, status: str, duration_s: float, *, late: bool = False
    ) -> None:
        self._each(
            "request_finished",
            lambda sink: sink.request_finished(lane, status, duration_s, late=late),
        )
