"""What the scheduler tells the outside world, through one small interface.

Implemented by the stats recorder (GetStats) and the OpenTelemetry adapter. Calls come
from the scheduler's owner under its lock: implementations must be quick and must not
call back into the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from laneserve.server.errors import LaneserveError
from laneserve.server.items import Batch


class SchedulerEvents(Protocol):
    def admitted(self, lane: str, rows: int) -> None: ...

    def rejected(self, lane: str, reason: str) -> None: ...

    def shed(self, lane: str, reason: str, rows: int) -> None:
        """Queued rows dropped without running; reason EXPIRED_IN_QUEUE or CANCELLED."""
        ...

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float]) -> None:
        """`queue_waits_s`: per slice of the batch, how long its request had waited."""
        ...

    def batch_done(self, batch: Batch, run_s: float, error: LaneserveError | None) -> None: ...

    def completed(self, lane: str, status: str) -> None:
        """An admitted request ended: "OK", the error's reason, or "CANCELLED" (no answer due)."""
        ...

    def out_of_memory(self, rows: int) -> None:
        """A run of `rows` rows failed to allocate device memory (it will be split)."""
        ...

    def batch_split(self, rows: int) -> None:
        """A batch of `rows` rows was split in halves after running out of memory."""
        ...

    def cap_changed(self, old_rows: int, new_rows: int, reason: str) -> None:
        """The batch cap moved: reason "out_of_memory" (down) or "recovered" (up)."""
        ...

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        """Device memory in use, as the watermark sees it."""
        ...


class NullEvents:
    def admitted(self, lane: str, rows: int) -> None:
        pass

    def rejected(self, lane: str, reason: str) -> None:
        pass

    def shed(self, lane: str, reason: str, rows: int) -> None:
        pass

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float]) -> None:
        pass

    def batch_done(self, batch: Batch, run_s: float, error: LaneserveError | None) -> None:
        pass

    def completed(self, lane: str, status: str) -> None:
        pass

    def out_of_memory(self, rows: int) -> None:
        pass

    def batch_split(self, rows: int) -> None:
        pass

    def cap_changed(self, old_rows: int, new_rows: int, reason: str) -> None:
        pass

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        pass


class FanOut:
    """Sends every event to several sinks, in order."""

    def __init__(self, *sinks: SchedulerEvents) -> None:
        self._sinks = sinks

    def admitted(self, lane: str, rows: int) -> None:
        for sink in self._sinks:
            sink.admitted(lane, rows)

    def rejected(self, lane: str, reason: str) -> None:
        for sink in self._sinks:
            sink.rejected(lane, reason)

    def shed(self, lane: str, reason: str, rows: int) -> None:
        for sink in self._sinks:
            sink.shed(lane, reason, rows)

    def batch_formed(self, batch: Batch, queue_waits_s: Sequence[float]) -> None:
        for sink in self._sinks:
            sink.batch_formed(batch, queue_waits_s)

    def batch_done(self, batch: Batch, run_s: float, error: LaneserveError | None) -> None:
        for sink in self._sinks:
            sink.batch_done(batch, run_s, error)

    def completed(self, lane: str, status: str) -> None:
        for sink in self._sinks:
            sink.completed(lane, status)

    def out_of_memory(self, rows: int) -> None:
        for sink in self._sinks:
            sink.out_of_memory(rows)

    def batch_split(self, rows: int) -> None:
        for sink in self._sinks:
            sink.batch_split(rows)

    def cap_changed(self, old_rows: int, new_rows: int, reason: str) -> None:
        for sink in self._sinks:
            sink.cap_changed(old_rows, new_rows, reason)

    def memory_sampled(self, used_bytes: int, budget_bytes: int | None) -> None:
        for sink in self._sinks:
            sink.memory_sampled(used_bytes, budget_bytes)
