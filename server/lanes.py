"""Bounded FIFO lanes, counted in rows, and the queued entries they hold.

Not thread-safe: every lane belongs to one `Scheduler`, whose owner serialises access.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

from laneserve.server.config import LaneConfig
from laneserve.server.items import Array, InferenceRequest


@dataclasses.dataclass(eq=False, slots=True)
class Entry:
    """An admitted request and its progress. Mutable: owned by the scheduler."""

    entry_id: int
    request: InferenceRequest = dataclasses.field(repr=False)
    priority: int  # index of its lane, 0 = highest
    enqueued_s: float
    deadline_s: float  # effective: the earliest of gRPC, timeout_ms and lane timeout
    dispatch_by_s: float  # enqueued_s + the lane's max_wait
    next_row: int = 0  # rows [0, next_row) have been handed to batches
    done_rows: int = 0  # rows whose outputs came back
    chunks: list[tuple[int, dict[str, Array]]] = dataclasses.field(default_factory=list, repr=False)
    in_lane: bool = True  # still queued (some rows not yet handed out, not dropped)
    cancelled: bool = False  # the client went away; no answer is due
    finished: bool = False  # its one answer has been given, or none is due
    queue_s: float = 0.0
    infer_s: float = 0.0
    last_batch_rows: int = 0

    @property
    def queued_rows(self) -> int:
        return self.request.rows - self.next_row


class Lane:
    """A FIFO of entries with a bound on queued rows.

    Dropping an entry from the middle (expiry, cancellation) frees its rows at once but
    leaves a tombstone that is skipped and popped later: O(1) instead of a deque scan.
    """

    def __init__(self, config: LaneConfig, priority: int) -> None:
        self.config = config
        self.priority = priority
        self.max_wait_s = config.max_wait_ms / 1000
        self._entries: collections.deque[Entry] = collections.deque()
        # Invariant: queued_rows == sum(e.queued_rows for live e in _entries), and
        # queued_entries counts those live entries.
        self.queued_rows = 0
        self.queued_entries = 0
        # Deficit round robin for min_share: rows this lane is owed (> 0) or has
        # overdrawn (< 0) ahead of higher lanes; fractional, as shares of a batch are.
        # Only the scheduler changes it.
        self.share_balance_rows = 0.0
        # Whether the last batch left this lane's share unused because its head (of the
        # batch's shape) did not fit the room left: it then banks up to that head and,
        # once its credit covers it, goes first (see `Scheduler._owed_head`).
        self.room_blocked = False
        # Rows a batch gave this lane lately while it had work queued (a moving average
        # over batches): its share, and what it rode along with. Only the scheduler
        # changes it.
        self.served_rows_per_batch = 0.0
        # When this lane last admitted a request (None: never): it is active for
        # ACTIVE_LANE_S after, and batches of lower lanes then keep within its max_wait.
        self.last_admit_s: float | None = None
        # Moving averages of the rows of the requests it admitted lately, and of their
        # squares (0 until the first): how much request sizes vary (see
        # `Scheduler._queue_drain_s`). Only the scheduler changes them.
        self.request_rows_mean = 0.0
        self.request_rows_square_mean = 0.0
        # A moving average of how much of the room a batch left it its whole requests
        # filled, over the batches it led whose next request did not fit (1.0 until the
        # first): what first fit in order packs of its sizes. Only the scheduler changes it.
        self.fill_ratio = 1.0

    @property
    def name(self) -> str:
        return self.config.name

    def __iter__(self) -> Iterator[Entry]:
        """Live entries, oldest first."""
        return (entry for entry in self._entries if entry.in_lane)

    def head(self) -> Entry | None:
        """The oldest live entry (None: none), in O(1): tombstones never lead the deque
        (`_leave` pops them)."""
        return self._entries[0] if self._entries else None

    def has_room(self, rows: int) -> bool:
        return self.queued_rows + rows <= self.config.capacity_rows

    def push(self, entry: Entry) -> None:
        assert entry.next_row == 0
        assert entry.in_lane
        self._entries.append(entry)
        self.queued_rows += entry.request.rows
        self.queued_entries += 1

    def take(self, entry: Entry, rows: int) -> int:
        """Hands `rows` rows of the live `entry` to a batch; returns their first row."""
        assert entry.in_lane
        assert 0 < rows <= entry.queued_rows
        start = entry.next_row
        entry.next_row += rows
        self.queued_rows -= rows
        if entry.queued_rows == 0:
            self._leave(entry)
        return start

    def drop(self, entry: Entry) -> None:
        """Frees the queued rows of the live `entry` (shedding); they will never run."""
        assert entry.in_lane
        self.queued_rows -= entry.queued_rows
        self._leave(entry)

    def oldest_enqueued_s(self) -> float | None:
        head = self.head()
        return None if head is None else head.enqueued_s

    def _leave(self, entry: Entry) -> None:
        entry.in_lane = False
        self.queued_entries -= 1
        while self._entries and not self._entries[0].in_lane:
            self._entries.popleft()
