"""Bounded FIFO lanes, counted in rows, and the queued entries they hold.

Not thread-safe: every lane belongs to one `Scheduler`, whose owner serialises access.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterator

from laneserve.server.config import LaneConfig
from laneserve.server.items import Array, InferenceRequest, Signature

# Seconds the session takes to serve a number of queued rows of a signature in batches
# of their own (see `Lane.queued_as`).
ShapePrice = Callable[[Signature, int], float]
# Tombstones a lane keeps at most beyond as many as its live entries (see `Lane._leave`).
MIN_TOMBSTONES = 64


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


@dataclasses.dataclass(slots=True)
class ShapeQueue:
    """A lane's queued work of one signature."""

    rows: int = 0
    entries: int = 0
    seconds: float = 0.0  # its price, while kept (see `Lane._queued_s`)


@dataclasses.dataclass(slots=True)
class Promises:
    """What a lane told the callers it refused LANE_FULL and has not yet seen back (see
    `scheduler.Scheduler._pushback_s`): three numbers per lane, however many callers it
    refuses. Only the scheduler thread reads or changes them."""

    # Invariant: the rows of the refusals that promised them since the promises last
    # lapsed (see `_pushback_s` for which do), less the rows admitted since into room a
    # batch made (`made_rows`); never below 0. Room is made by dispatch: the scheduler's
    # `_room_in_s` predicts when batches will have taken enough rows out, and a caller
    # promised comes back to room a batch made. So an admission takes from `made_rows`
    # alone, whoever it is (a retry, a fresh caller, a stream item that waited for
    # room): that room is gone for the caller promised it, who, refused again, is
    # promised anew.
    # Rows that leave by expiry or cancel make room no hint predicted: whoever comes
    # first takes it, consuming no promise; the promises lapse at `until_s` all the same.
    # Consumed by any admission, a fresh caller in a cancelled request's room took a
    # promise it was never given, and the next caller refused was told the time of the
    # one before, a batch before its room. Consumed by dispatch itself, a caller refused
    # after the batch that made a promised caller's room, before that caller was back,
    # was told a batch before its room too (the room is in both the lane's free rows and
    # the rows dispatch took off: see
    # test_room_a_batch_made_stays_promised_until_a_caller_takes_it).
    promised_rows: int = 0
    # Of `promised_rows`, those whose room batches made since and no admission has taken
    # yet: at most `promised_rows`.
    made_rows: int = 0
    # The latest retry time advised among them (monotonic seconds), never moved earlier:
    # a later refusal may be told an earlier time (a cancel above made its rows come
    # sooner) while an earlier caller is still to come back.
    until_s: float = -math.inf

    def lapse(self, now_s: float) -> None:
        """From `until_s` on, every caller promised has come back or will not: no caller
        comes back before its time, whether it follows RetryInfo (the hint, to the ns) or
        the trailer (rounded up, `errors.pushback_ms`). Lapsing earlier (half a ms, for a
        trailer rounded to the nearest ms), a caller refused then was told the room still
        promised to one not yet back. The room made for the promises lapses with them:
        kept, an admission took it from the rows promised since, below 0."""
        if now_s >= self.until_s:
            self.promised_rows = self.made_rows = 0

    def promise(self, rows: int, back_s: float) -> None:
        self.promised_rows += rows
        self.until_s = max(self.until_s, back_s)

    def room_made(self, rows: int) -> None:
        """A batch took `rows` of the lane's rows out to run."""
        self.made_rows = min(self.made_rows + rows, self.promised_rows)

    def admitted(self, rows: int) -> None:
        taken = min(rows, self.made_rows)
        self.promised_rows -= taken
        self.made_rows -= taken
        assert 0 <= self.made_rows <= self.promised_rows


class Lane:
    """A FIFO of entries with a bound on queued rows.

    Dropping an entry from the middle (expiry, cancellation), or serving one behind a
    request still being split (whole requests go ahead of its chunks, see
    `formation._Filling.fill`), frees its rows at once. Right behind the head (served
    behind a head being split: they leave in FIFO order) it is deleted there, in O(1);
    elsewhere it leaves a tombstone that is skipped and popped later: O(1) instead of a
    deque scan. Tombstones are kept no more numerous than the live entries (or
    MIN_TOMBSTONES), so a scan of the lane costs what is queued: behind a 60 000-row
    request split 64 rows a batch, the 1-row requests served ahead of its chunks stayed,
    47 106 entries for 962 live after 721 batches, and every batch's fill and
    admission's `split_ahead` walked them.
    """

    def __init__(
        self, config: LaneConfig, priority: int, price: ShapePrice, *, split_over_rows: int
    ) -> None:
        """`price` prices the queued rows of a signature (see `queued_as`); requests of
        more than `split_over_rows` rows (the probed batch cap) are split across batches
        whatever the room (see `split_ahead`)."""
        self.config = config
        self.priority = priority
        self.max_wait_s = config.max_wait_ms / 1000
        # Invariant: holds the live entries in FIFO order, and at most
        # max(queued_entries, MIN_TOMBSTONES) tombstones, never in its first two places.
        self._entries: collections.deque[Entry] = collections.deque()
        # Invariant: _split holds exactly the live entries of more than split_over_rows
        # rows, oldest first. A lane holds few (its capacity over the cap): admission
        # sees whether one is queued without scanning the lane (see `split_ahead`).
        self.split_over_rows = split_over_rows
        self._split: dict[int, Entry] = {}
        # Invariant: queued_rows == sum(e.queued_rows for live e in _entries), and
        # queued_entries counts those live entries.
        self.queued_rows = 0
        self.queued_entries = 0
        # The same per signature (signatures with nothing queued are absent), and the
        # session seconds of all of it: each signature's rows priced as batches of their
        # own (rows batch only with rows of their shape), repriced whenever they change
        # (and by `reprice`). Kept as a running sum, so that admission reads what the
        # work of other shapes ahead costs in O(1) per lane: while two signatures or more
        # are queued, _queued_s == the sum of `_shapes[*].seconds`, up to rounding. With
        # one (most models have fixed shapes), prices are not kept (pushes and takes
        # would pay for them on every request) and _queued_s is 0.0: that shape's price
        # is worked out when asked (`queued_as`), and kept from the push of a second.
        self._price = price
        self._shapes: dict[Signature, ShapeQueue] = {}
        self._queued_s = 0.0
        # Deficit round robin for min_share: what this lane is owed (> 0) or has
        # overdrawn (< 0) ahead of higher lanes, in batches: each amount is counted as a
        # fraction of the cap of the batch it was taken in (`Formation.balance_rows`
        # gives it in rows of a shape). In rows, a debt charged at one shape's cap was
        # repaid, or bounded, at another's: a lane whose shape's cap out of memory had
        # lowered to 1 took half the batches for a share of 0.1. Only the scheduler
        # changes it.
        self.share_balance = 0.0
        # Whether the last batch left this lane's share unused because its head (of the
        # batch's shape) did not fit the room left: it then banks up to that head and,
        # once its credit covers it, goes first (see `Formation.owed_head`).
        self.room_blocked = False
        # Rows a batch gave this lane lately while it had work queued (a moving average
        # over batches): its share, and what it rode along with. Forgotten once the lane
        # has had nothing queued for a while (`Scheduler._forget_idle_pace`). Only the
        # scheduler changes it.
        self.served_rows_per_batch = 0.0
        # When a batch last formed while this lane had work queued, or one that served it
        # ended, whichever is later (None: never): `served_rows_per_batch` is forgotten
        # ACTIVE_LANE_S after. Only the scheduler changes it.
        self.served_at_s: float | None = None
        # What its LANE_FULL refusals were promised (see `Promises`).
        self.promises = Promises()
        # When this lane last admitted a request (None: never): it is active for
        # ACTIVE_LANE_S after, and batches of lower lanes then keep within its max_wait.
        self.last_admit_s: float | None = None
        # The share of the session's time lately spent on this lane's rows (each batch's
        # run time split by rows, averaged as the utilisation is): what arriving work of
        # this lane takes from the lanes below (see `Scheduler._load_above`). Only the
        # scheduler changes it.
        self.time_share = 0.0
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

    def queued_as(self, signature: Signature) -> tuple[int, int, float]:
        """The rows and entries queued of `signature`, and the session seconds of the
        queued work of other signatures: exactly 0.0 when there is none (a lane of one
        shape adds nothing to admission's arithmetic, not a rounding residue). One call
        per lane: admission asks it of every lane at or above the request's."""
        shape = self._shapes.get(signature)
        if shape is None:
            if len(self._shapes) == 1:  # one other shape: its price is not kept
                ((other, only),) = self._shapes.items()
                return 0, 0, self._price(other, only.rows)
            return 0, 0, self._queued_s
        if shape.rows == self.queued_rows:
            return shape.rows, shape.entries, 0.0
        return shape.rows, shape.entries, max(self._queued_s - shape.seconds, 0.0)

    def queued_s(self) -> float:
        """The session seconds of all its queued work, each shape in batches of its own."""
        if len(self._shapes) == 1:  # one shape: its price is not kept
            ((signature, only),) = self._shapes.items()
            return self._price(signature, only.rows)
        return self._queued_s

    def split_ahead(self, signature: Signature, scan_entries: int) -> tuple[int, int, int] | None:
        """For a request of `signature` of at most `split_over_rows` rows joining the lane
        now: the rows and entries queued of it in requests larger than that (split
        whatever the room: each batch gives them the room the whole requests behind them
        leave, down to a floor, see `formation._Filling.fill`), and the rows of the
        widest whole request from the first of them on ((0, 0, 0): none queued). None
        when that is not known from the first `scan_entries` entries, or an entry of
        another shape follows the first of them (it may end the lane's turn)."""
        if all(entry.request.signature != signature for entry in self._split.values()):
            return 0, 0, 0
        split_rows = split_entries = widest_rows = 0
        for scanned, entry in enumerate(self):
            if scanned == scan_entries:
                return None
            if entry.request.signature != signature:
                if split_entries:
                    return None
            elif entry.request.rows > self.split_over_rows:
                split_rows += entry.queued_rows
                split_entries += 1
            elif split_entries:
                widest_rows = max(widest_rows, entry.queued_rows)
        return split_rows, split_entries, widest_rows

    def reprice(self, signature: Signature | None = None) -> None:
        """Prices the queued rows of `signature` (None: of every signature) again: its
        run-time model learned, or its batch cap moved."""
        for key in list(self._shapes) if signature is None else [signature]:
            shape = self._shapes.get(key)
            if shape is not None:
                self._set_rows(key, shape, shape.rows)

    def push(self, entry: Entry) -> None:
        assert entry.next_row == 0
        assert entry.in_lane
        self._entries.append(entry)
        if entry.request.rows > self.split_over_rows:
            self._split[entry.entry_id] = entry
        self.queued_rows += entry.request.rows
        self.queued_entries += 1
        signature = entry.request.signature
        shape = self._shapes.get(signature)
        if shape is None:
            if len(self._shapes) == 1:  # a second shape: prices are kept from now on
                ((other, only),) = self._shapes.items()
                only.seconds = self._queued_s = self._price(other, only.rows)
            shape = self._shapes[signature] = ShapeQueue()
        shape.entries += 1
        self._set_rows(signature, shape, shape.rows + entry.request.rows)

    def take(self, entry: Entry, rows: int) -> int:
        """Hands `rows` rows of the live `entry` to a batch; returns their first row."""
        assert entry.in_lane
        assert 0 < rows <= entry.queued_rows
        start = entry.next_row
        entry.next_row += rows
        self.queued_rows -= rows
        if entry.queued_rows == 0:
            self._leave(entry)
        self._shape_took(entry, rows)
        return start

    def drop(self, entry: Entry) -> None:
        """Frees the queued rows of the live `entry` (shedding); they will never run."""
        assert entry.in_lane
        rows = entry.queued_rows
        self.queued_rows -= rows
        self._leave(entry)
        self._shape_took(entry, rows)

    def oldest_enqueued_s(self) -> float | None:
        head = self.head()
        return None if head is None else head.enqueued_s

    def _shape_took(self, entry: Entry, rows: int) -> None:
        """`rows` rows of `entry` left the queue (it left too, unless still in the lane)."""
        signature = entry.request.signature
        shape = self._shapes[signature]
        if not entry.in_lane:
            shape.entries -= 1
        self._set_rows(signature, shape, shape.rows - rows)

    def _set_rows(self, signature: Signature, shape: ShapeQueue, rows: int) -> None:
        """Sets `signature`'s queued rows, priced anew while prices are kept, and the
        lane's running sum."""
        assert (rows == 0) == (shape.entries == 0)
        shape.rows = rows
        if rows == 0:
            del self._shapes[signature]
        if len(self._shapes) <= 1:  # one shape or none: prices not kept
            self._queued_s = 0.0  # exactly: no rounding residue outlives the mix
            return
        seconds = self._price(signature, rows) if rows else 0.0
        self._queued_s += seconds - shape.seconds
        shape.seconds = seconds

    def _leave(self, entry: Entry) -> None:
        entry.in_lane = False
        self.queued_entries -= 1
        self._split.pop(entry.entry_id, None)
        while self._entries and not self._entries[0].in_lane:
            self._entries.popleft()
        # Entries served behind a head still being split leave in FIFO order, each next
        # to it: deleted there in O(1), they leave no tombstone for its whole life.
        while len(self._entries) > 1 and not self._entries[1].in_lane:
            del self._entries[1]
        if len(self._entries) - self.queued_entries > max(self.queued_entries, MIN_TOMBSTONES):
            # Tombstones elsewhere (entries dropped from the middle, served behind an
            # older entry than the head). Amortised O(1): the copy is of fewer than twice
            # the tombstones, one per `_leave` since the last. No walk of the lane is in
            # progress: the scheduler takes a batch's rows once it is planned.
            self._entries = collections.deque(entry for entry in self._entries if entry.in_lane)
