"""The batching policy: admission, shedding, the dispatch rule and completion.

`Scheduler` is pure state plus decisions. It never reads a clock or sleeps: every call
takes `now_s`, so tests drive it with exact times. `SchedulerThread` (in
`scheduler_thread.py`) owns one and serialises every call under its lock.

Dispatch rule, evaluated only while the session is free: a batch goes out when it is
full; when work in it queued while the session was busy (backlog: batches fill by
themselves under load, with no timer); when its most urgent item has waited its lane's
max_wait; when waiting longer would miss the earliest deadline in it; or when waiting
would not pay (idle): the session has lately been busy less than half the time (so it
has capacity to spare and batching by waiting would only add latency; under load the
backlog rule forms batches by itself), or requests have lately arrived further apart
than the wait left (waiting would add nobody). Otherwise the scheduler is told when to
look again. A batch that goes full or for its backlog holds only the rows expected to
end by its earliest deadline, where that deadline's request can meet it alone; one its
deadline sends out, likewise (`Formation.trim_to_deadline`).

Which rows a batch takes (the lanes' shares and credit, the ride-along bound of an
active lane's max_wait) is `Formation`'s, in formation.py: `decide` applies the rule
above to its plan and commits it. A full batch is one at the plan's limit, or one that
left queued work out (`Plan.left_out`): waiting for company could only hold that work back.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import logging
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from laneserve.server.batch_caps import BatchCaps
from laneserve.server.clock import CALLER_END_SLACK_S
from laneserve.server.config import LaneConfig
from laneserve.server.cost_model import MAX_SIGNATURES, RunTimeModel, RunTimeModels
from laneserve.server.errors import (
    DeadlineUnmeetableError,
    DrainingError,
    EngineError,
    ExpiredInQueueError,
    InvalidInputError,
    LaneFullError,
    LaneserveError,
    MemoryPressureError,
)
from laneserve.server.events import NullEvents, SchedulerEvents
from laneserve.server.formation import (
    ACTIVE_LANE_S,
    BALANCE_DIGITS,
    GATHER_SCAN_ENTRIES,
    Formation,
    Plan,
    is_active,
    split_floor,
)
from laneserve.server.items import (
    Array,
    Batch,
    BatchResult,
    BatchSlice,
    DispatchReason,
    InferenceRequest,
    Outcome,
    Signature,
    Timing,
)
from laneserve.server.lanes import Entry, Lane
from laneserve.server.log_events import event_extra, log_event
from laneserve.server.memory import Watermark, WatermarkState, format_bytes

log = logging.getLogger(__name__)

# Weight of the newest gap in the moving average of times between admissions.
ARRIVAL_GAP_ALPHA = 0.1
# Weight of the newest batch in a lane's moving average of the rows batches give it.
SERVED_ALPHA = 0.1
# Weight of the newest request in a lane's moving averages of request sizes.
SIZE_ALPHA = 0.1
# Admission counts whole requests of the mean size in a batch (`_queue_drain_s`) only
# while sizes vary less than this (their squared coefficient of variation): exact for
# requests of one size, and far off for a mix (requests of 1 and 64 rows packed at
# 32.5 rows left 3 of them a batch, where a first fit in order holds 65 rows or 128).
UNIFORM_SIZES_CV2 = 0.05
# Weight of the newest batch in a lane's moving average of the room its whole requests
# fill (`Lane.fill_ratio`): what admission counts a batch as holding of a mix of sizes.
FILL_ALPHA = 0.1
# Admission counts a share lane's pace as what batches lately gave it only when that is
# clearly above its share: the average of a lane served its share in whole requests (0 or
# 4 rows a batch for 3.2) runs a little above it, and three in four of the requests
# admitted on it at their deadline's edge were late.
PACE_MARGIN = 1.25
# The session's utilisation is its busy share of roughly the last UTILIZATION_WINDOW_S;
# below WAIT_UTILIZATION a free session does not wait for company (see `decide`).
UTILIZATION_WINDOW_S = 0.1
WAIT_UTILIZATION = 0.5
# Admission: the least share of batches lanes above are counted as served in, however
# many whole batches lower lanes' claims are counted as taking (see `_queue_drain_s`).
MIN_SERVED_SHARE = 0.1
# Admission: the least share of the session's time counted as left to a lane's queue by
# the load arriving in the lanes above (see `_load_above`).
MIN_LEFT_BELOW = 0.05
# Admission: below this utilisation the session has time to spare, and a lane above
# with work queued does not hold a lane with a share to its share (see `_fed_above`).
FED_UTILIZATION = 0.9
# Admission's arithmetic in fractions of a row: a remainder too small to be a row.
ROUNDING_ROWS = 1e-9
# Entries of a lower lane admission reads to count what pass 1 takes for its share
# ahead of a request (see `_share_claim_rows`): a bound per admission, not the queue.
SHARE_SCAN_ENTRIES = 16
# Entries of its lane admission reads behind a request being split ahead of a whole one
# (see `Lane.split_ahead`): a bound per admission; past it, the split request's rows are
# counted whole ahead, as any request's.
SPLIT_SCAN_ENTRIES = 64
# Suggested wait before retrying a request refused for memory pressure. Constant, and
# not spread as LANE_FULL's is (`_pushback_s`): the lane reopens when device memory falls
# below the low watermark, which no rate of rows predicts, so there is no time at which
# room for each caller comes to tell it.
MEMORY_PRESSURE_RETRY_S = 0.25
# The least retry hint of a full lane: `grpc-retry-pushback-ms` counts whole ms.
MIN_PUSHBACK_S = 0.001


@dataclasses.dataclass(frozen=True, slots=True)
class Dispatch:
    batch: Batch


@dataclasses.dataclass(frozen=True, slots=True)
class WaitUntil:
    # Monotonic seconds at which the dispatch rule fires if nothing else happens first.
    at_s: float


Decision = Dispatch | WaitUntil | None  # None: nothing queued


@dataclasses.dataclass(frozen=True, slots=True)
class LaneDepth:
    name: str
    queued_rows: int
    queued_requests: int
    capacity_rows: int


def caller_end_status(now_s: float, deadline_s: float, *, queued: bool) -> str:
    """The status of a request whose callers went away with no answer due: its deadline
    had come (gRPC cancels a call at it), EXPIRED_IN_QUEUE for work still queued (shed:
    the queue's doing) and DEADLINE_EXCEEDED for work that ran (too late; the name gRPC
    gives its caller's end, not a LaneserveError: none is sent), else CANCELLED (they
    left). A caller gone within CALLER_END_SLACK_S of its deadline went by it: its
    deadline passing at its end reached the server as a cancel, a little early."""
    if now_s < deadline_s - CALLER_END_SLACK_S:
        return "CANCELLED"
    return ExpiredInQueueError.reason if queued else "DEADLINE_EXCEEDED"


def _lane_cap_note(lane: LaneConfig, own_timeout_s: float | None) -> str:
    """What a refusal or expiry message adds when `lane`'s timeout_ms, not the caller's
    own timeout (`InferenceRequest.own_timeout_s`: its gRPC deadline or its timeout_ms),
    set its deadline: refused "deadline in 199.7 ms cannot be met", a caller that had
    asked for 5 s could not tell that lane 'standard' caps every request at 200 ms. Empty
    when the caller's own is no longer than the lane's: its own applied. Told by the
    budgets, not by comparing deadlines: the service hands over the capped deadline only,
    and one computed from arrival never equals one computed again from admission (the
    note never appeared over gRPC)."""
    where = f"lane {lane.name!r} timeout_ms={lane.timeout_ms}"
    if own_timeout_s is None:
        return f" ({where}: the request set no timeout of its own)"
    if own_timeout_s * 1000 <= lane.timeout_ms:
        return ""
    return f" ({where} caps this request's {own_timeout_s * 1000:.0f} ms timeout)"


def _expiry_note(lane: LaneConfig, entry: Entry) -> str:
    """`_lane_cap_note` for `entry`, shed at its deadline. Empty when a retry that joined
    moved that deadline before the one it was admitted with (the caller the work waited
    for left, see `Scheduler.move_deadline`): the retry's own timeout set it. A deadline
    moved later stays within the lane's timeout from admission, so the note still holds
    of the request as it was queued."""
    admitted_s = lane.deadline_s(entry.enqueued_s, entry.request.deadline_s)
    if entry.deadline_s < admitted_s:
        return ""
    return _lane_cap_note(lane, entry.request.own_timeout_s)


def _folded_gap(gap_s: float | None, last_s: float | None, now_s: float) -> float | None:
    """The moving average `gap_s` of the times between admissions, the last at `last_s`,
    with one at `now_s` folded in (None until two were seen)."""
    if last_s is None:
        return gap_s
    return now_s - last_s if gap_s is None else gap_s + ARRIVAL_GAP_ALPHA * (now_s - last_s - gap_s)


class Scheduler:
    def __init__(
        self,
        lanes: Sequence[LaneConfig],
        *,
        batch_cap: int,
        run_time: RunTimeModel,
        events: SchedulerEvents | None = None,
        watermark: Watermark | None = None,
        run_time_signature: Signature | None = None,
        spread_pushback: bool = True,
    ) -> None:
        """`run_time` is measured on rows of `run_time_signature` (the probe's); batches
        of other signatures get models of their own (see `RunTimeModels`; None: one model
        for all). `spread_pushback` False advises each LANE_FULL refusal the room for its
        own rows alone, the rule before promises were counted (see `_pushback_s`): for
        scripts/simulate_admission.py's comparison; the server keeps the default."""
        assert batch_cap >= 1
        self.lanes = [
            Lane(config, priority, self._alone_s, split_over_rows=batch_cap)
            for priority, config in enumerate(lanes)
        ]
        self._by_name = {lane.name: lane for lane in self.lanes}
        self._spread_pushback = spread_pushback
        self.events = events or NullEvents()
        # The cap in force per signature; out of memory lowers one, sustained success
        # raises it back step by step, never above `batch_cap` (what the probe found).
        self.caps = BatchCaps(batch_cap, self.events)
        self.watermark = watermark
        assert watermark is None or watermark.lanes == len(self.lanes)
        # Moving average of the time between admissions (None until two were seen): how
        # long waiting for company is likely to take.
        self._arrival_gap_s: float | None = None
        self._last_admit_s: float | None = None
        # Per lane and signature (the MAX_SIGNATURES admitted most recently): the moving
        # average of the time between its admissions (None until two) and its last one.
        # Only requests of a batch's signature can join it, and those of lanes below its
        # highest only within that lane's max_wait (see `_queue_drain_s`).
        self._arrivals: collections.OrderedDict[
            tuple[int, Signature], tuple[float | None, float | None]
        ] = collections.OrderedDict()
        # Busy share of the session over about the last UTILIZATION_WINDOW_S (None until
        # a batch ran), from the run time of each batch and the time to the next dispatch.
        self.utilization: float | None = None
        self._last_dispatch_s: float | None = None
        self._last_run_s = 0.0
        # Rows per lane of the batch dispatched last (see `Lane.time_share`).
        self._last_run_rows = [0] * len(lanes)
        # When the batch running now is predicted to end (None: none runs).
        self._running_until_s: float | None = None
        self._idle_floor_logged = False  # watermark_idle_above_low (`update_memory`)
        self.run_time = run_time
        self._run_times = RunTimeModels(run_time, run_time_signature, max_rows=batch_cap)
        # Which rows each batch takes, over these same lanes, caps and models.
        self.formation = Formation(self.lanes, self.caps, self._run_times)
        # Per signature, the longest a batch of 1 to its cap rows is predicted to run (see
        # `_slowest_batch_s`), with the model, its `observations` and the cap it holds for.
        self._slowest: dict[Signature, tuple[RunTimeModel, int, int, float]] = {}
        self.accepting = True
        # Live entries: admitted and not yet answered (queued or in a running batch).
        self._entries: dict[int, Entry] = {}
        # (deadline_s, entry_id) of live entries; stale pairs (answered, or a deadline since
        # moved) are skipped when popped.
        self._deadlines: list[tuple[float, int]] = []
        # The ids given last, advanced as each is given (under the scheduler thread's
        # lock, as all of this state is). Plain ints, not itertools.count: a Scheduler is
        # deep-copied (simulate_admission's counterfactual, the tests), and copying a count
        # is deprecated from Python 3.12 and refused from 3.14.
        self._last_entry_id = 0
        self._last_batch_id = 0

    @property
    def batch_cap(self) -> int:
        """The lowest cap in force, of any signature (one, for fixed shapes)."""
        return self.caps.lowest

    @property
    def max_batch_cap(self) -> int:
        """The cap every signature starts at and recovers to: the probe's."""
        return self.caps.max_rows

    # ---- admission ---------------------------------------------------------------

    def lane(self, name: str) -> Lane:
        lane = self._by_name.get(name)
        if lane is None:
            raise InvalidInputError(
                f"unknown lane {name!r}; expected one of {[lane.name for lane in self.lanes]}"
            )
        return lane

    def count_refusal(self, request: InferenceRequest, error: LaneserveError, now_s: float) -> None:
        """`request`, refused with `error` at `now_s` and not admitted, told to the events:
        its lane, its wait since arrival, its words and its id (the refusal log's)."""
        self.events.rejected(
            request.lane,
            error.reason,
            request.waited_s(now_s),
            request_id=request.request_id,
            error=error,
        )

    def admit(self, request: InferenceRequest, now_s: float) -> int:
        """Queues `request` or raises why not; returns the entry id for `cancel`."""
        lane = self.lane(request.lane)
        self._forget_idle_pace(lane, now_s)
        try:
            self._check_admission(request, lane, now_s)
        except LaneserveError as error:
            self.count_refusal(request, error, now_s)
            raise
        deadline_s = lane.config.deadline_s(now_s, request.deadline_s)
        self._last_entry_id += 1
        entry = Entry(
            entry_id=self._last_entry_id,
            request=request,
            priority=lane.priority,
            enqueued_s=now_s,
            deadline_s=deadline_s,
            dispatch_by_s=now_s + lane.max_wait_s,
        )
        lane.push(entry)
        # Into room a batch made, it takes room a caller refused earlier was promised,
        # whether it is that caller or not (see `lanes.Promises.promised_rows`).
        lane.promises.admitted(request.rows)
        self._observe_request(lane, request, now_s)
        self._entries[entry.entry_id] = entry
        heapq.heappush(self._deadlines, (deadline_s, entry.entry_id))
        if len(self._deadlines) > 2 * len(self._entries) + 64:
            # Answered entries leave stale pairs behind until their deadline: compact,
            # so the heap stays proportional to live work, not throughput * timeout.
            self._deadlines = [
                (live.deadline_s, live.entry_id) for live in self._entries.values() if live.in_lane
            ]
            heapq.heapify(self._deadlines)
        self.events.admitted(lane.name, request.rows)
        return entry.entry_id

    @staticmethod
    def _forget_idle_pace(lane: Lane, now_s: float) -> None:
        """Forgets the pace batches gave `lane` (`Lane.served_rows_per_batch`, which
        admission promises a lane with a share, `_share_batches`) once it has had nothing
        queued for ACTIVE_LANE_S: it learns only from batches that find the lane's work
        queued, so it said what the session gave the lane before it went quiet, not what
        it gives it now. Kept for an hour idle, the 64 rows a batch a bulk lane had run
        alone were promised it behind a saturated standard lane, and 11 of its admitted
        requests expired in the queue. Empty now, the lane has been so since its last
        batch or admission, whichever came later (rows dropped since aside)."""
        if lane.queued_rows:
            return
        seen_s = max(
            (at_s for at_s in (lane.served_at_s, lane.last_admit_s) if at_s is not None),
            default=None,
        )
        if seen_s is not None and now_s - seen_s >= ACTIVE_LANE_S:
            lane.served_rows_per_batch = 0.0

    def _observe_request(self, lane: Lane, request: InferenceRequest, now_s: float) -> None:
        """Folds an admitted request into the pace of admissions (all, for `decide`; per
        lane and signature, see `_arrival_gap_at`), its lane's activity and its lane's
        size averages. Those are of what a request adds to one batch: one larger than the
        cap counts as the cap. Split, it fills the room a batch leaves it, at most that
        (`formation._Filling.fill`): counted at its half-cap floor, it would price a batch it fills
        at half its run; at its 512 rows, one such request among 1-row ones lifted the
        size of the requests expected to join a newcomer's batch from 1 to 52 rows, and
        three in five of the newcomers then refused would have met their deadlines."""
        lane.last_admit_s = now_s
        self._arrival_gap_s = _folded_gap(self._arrival_gap_s, self._last_admit_s, now_s)
        self._last_admit_s = now_s
        rows = min(request.rows, self.caps.rows(request.signature))
        if lane.request_rows_mean == 0:
            lane.request_rows_mean, lane.request_rows_square_mean = rows, rows * rows
        else:
            lane.request_rows_mean += SIZE_ALPHA * (rows - lane.request_rows_mean)
            lane.request_rows_square_mean += SIZE_ALPHA * (
                rows * rows - lane.request_rows_square_mean
            )
        key = (lane.priority, request.signature)
        gap_s, last_s = self._arrivals.pop(key, (None, None))
        self._arrivals[key] = (_folded_gap(gap_s, last_s, now_s), now_s)  # the most recent last
        if len(self._arrivals) > MAX_SIGNATURES:
            self._arrivals.popitem(last=False)

    def room_wait_s(self, lane_name: str, rows: int) -> float | None:
        """None when lane `lane_name` has room for `rows` more rows (or never will: more
        than it holds, or no such lane; admission says why), else about how long until
        it has (see `_room_in_s`). A stream item waiting for room asks it: it polls, it
        does not come back at a time it was told, so it neither reads nor adds the
        promises of LANE_FULL refusals (`_pushback_s`)."""
        lane = self._by_name.get(lane_name)
        if lane is None or rows > lane.config.capacity_rows or lane.has_room(rows):
            return None
        return self._room_in_s(lane, rows)

    def _room_in_s(self, lane: Lane, rows: int) -> float:
        """About how long until full `lane` has room for `rows` more rows: the run time
        of the rows over its room, at most the lane's timeout (by then every row queued
        now has run or expired). A run-time model that is a guess (a shape not yet run)
        or a slow outlier advised clients to stay away for minutes. The rows that leave
        first are its oldest, in batches of its head's shape: they run at that shape's
        model, not the probe's nor the new request's (a lane full of 512-token rows told
        a caller of 8 tokens to come back in the time 8-token rows take). The work queued
        in the lanes above runs first, or, for a lane with a share, its share of each
        batch moves its rows: the earlier of the two. Counted at its own rows alone, bulk
        full under a saturated standard lane advised 1.4 ms where room came after 212."""
        head = lane.head()
        assert head is not None, "a full lane holds rows"
        signature = head.request.signature
        run_time = self._run_times.get(signature)
        excess = lane.queued_rows + rows - lane.config.capacity_rows
        cap = self.caps.rows(signature)
        wait_s = run_time.drain_s(excess, cap) + sum(
            above.queued_s() for above in self.lanes[: lane.priority]
        )
        if lane.config.min_share > 0:
            batches = math.ceil(
                round(excess / self.formation.share_rows(lane, signature), BALANCE_DIGITS)
            )
            wait_s = min(wait_s, batches * run_time.predict_s(cap))
        return min(wait_s, lane.config.timeout_ms / 1000)

    def _pushback_s(self, lane: Lane, request: InferenceRequest, now_s: float) -> float:
        """The retry hint for `request`, which full `lane` refuses at `now_s`: the time
        until it has room for its rows after the rows promised to the callers it refused
        before (`lanes.Promises.promised_rows`: until the latest time advised among them, less
        the rows admitted into room a batch made since). Counted at its own rows alone,
        every caller refused in one instant was told the same time; a client that
        follows RetryInfo waits exactly that, gRPC's retry that rounded up to whole ms
        (`errors.pushback_ms`), so they came back together, the first few found the
        room and the rest were refused again: a herd every round. Counted so, the k-th
        is told when room for it comes, and their retries come back at the rate room
        opens. The first refusal (no promise outstanding) is told what it was before.

        A refusal is told that time in every case, and promises its rows only when the
        caller can come back: its time is before the request's own deadline (and so
        under the lane's timeout, the cap of `_room_in_s`: by then every row queued now
        has run or expired), and the lane holds its rows with those promised. Past its
        deadline it never comes back; more rows than the lane holds are a flood, not a
        queue of callers each finding room in turn. Promised, each refusal of a flood
        told the next one later and moved the lapse on, so the promises never lapsed:
        a standard lane twice oversubscribed by callers that never came back advised
        9999 ms where room came every 1.3 (bounded so, 341: a lane's worth of promises
        outlives its callers while refusals keep making new ones). Callers refused
        together at the cap come back together at it.

        Approximate where the clock runs on: a caller refused again before the promises
        lapse (room came later than predicted, or another took it) counts its own
        earlier promise too, and is told later than its room, by its rows for each such
        refusal."""
        if not self._spread_pushback:
            return max(self._room_in_s(lane, request.rows), MIN_PUSHBACK_S)
        promises = lane.promises
        promises.lapse(now_s)
        rows = promises.promised_rows + request.rows
        wait_s = max(self._room_in_s(lane, rows), MIN_PUSHBACK_S)
        back_s = now_s + wait_s
        if rows <= lane.config.capacity_rows and back_s < lane.config.deadline_s(
            now_s, request.deadline_s
        ):
            promises.promise(request.rows, back_s)
        return wait_s

    def _check_admission(self, request: InferenceRequest, lane: Lane, now_s: float) -> None:
        if not self.accepting:
            raise DrainingError("server is draining; retry on another instance")
        # A closed lane admits while nothing is queued or running: memory that stays in
        # use then (an allocator's cache, another process) is not freed by refusing, and
        # refusing forever would leave the server idle for good. Where an idle reading is
        # at or above the high mark (below it, every lane reopens: `update_memory`), one
        # request at a time goes in.
        if self.watermark is not None and not self._idle and self.watermark.refuses(lane.priority):
            used_bytes = self.watermark.used_bytes or 0
            mark = self.watermark
            # A lane closed above the high mark stays closed down to the low one.
            where = (
                f"above the high watermark ({format_bytes(mark.high_bytes)})"
                if used_bytes >= mark.high_bytes
                else f"still above the low watermark ({format_bytes(mark.low_bytes)}) since it "
                f"passed the high one ({format_bytes(mark.high_bytes)})"
            )
            raise MemoryPressureError(
                f"{mark.reading} ({format_bytes(used_bytes)}) is {where}: lane "
                f"{lane.name!r} admits no new work while other work is queued or running, "
                f"until it falls below {format_bytes(mark.low_bytes)}",
                retry_after_s=MEMORY_PRESSURE_RETRY_S,
            )
        lane.config.check_rows(request.rows)
        if not lane.has_room(request.rows):
            retry_after_s = self._pushback_s(lane, request, now_s)
            raise LaneFullError(
                f"lane {lane.name!r} is full: {lane.queued_rows} of "
                f"{lane.config.capacity_rows} rows queued, request has {request.rows}; "
                f"expected a retry in about {retry_after_s * 1000:.0f} ms (its RetryInfo)",
                retry_after_s=retry_after_s,
            )
        deadline_s = lane.config.deadline_s(now_s, request.deadline_s)
        if deadline_s <= now_s:  # a stream item that waited for room, up to its deadline
            raise DeadlineUnmeetableError(
                f"the deadline passed {(now_s - deadline_s) * 1000:.1f} ms before the request "
                f"reached lane {lane.name!r}" + _lane_cap_note(lane.config, request.own_timeout_s)
            )
        # With nothing queued or running the prediction is the run-time model's alone:
        # the request runs, so that a model that went wrong (a slow outlier, a probe of
        # other sizes) learns; refusing it would keep the prediction wrong for good. So
        # does a request of a shape whose model is a guess, until one of it has run.
        # Neither is predicted (the prediction is most of admission's cost).
        if self._idle or not self._run_times.knows(request.signature):
            return
        # A deadline the bound meets, the prediction (never later) meets too.
        bound_s = self._finish_bound_s(lane, request.rows, request.signature, now_s)
        if bound_s is not None and bound_s <= deadline_s:
            return
        finish_s = self._predicted_finish_s(lane, request.rows, request.signature, now_s)
        if finish_s > deadline_s:
            ahead = sum(other.queued_rows for other in self.lanes[: lane.priority + 1])
            raise DeadlineUnmeetableError(
                f"deadline in {max(deadline_s - now_s, 0) * 1000:.1f} ms cannot be met: "
                f"{ahead} rows are queued ahead in lane {lane.name!r} or above, serving them "
                f"and this request takes about {(finish_s - now_s) * 1000:.1f} ms (after the "
                "batch running now, with the lower lanes' shares and the work still "
                "arriving above, at the run times measured)"
                + _lane_cap_note(lane.config, request.own_timeout_s)
            )

    def _predicted_finish_s(
        self, lane: Lane, rows: int, signature: Signature, now_s: float
    ) -> float:
        """When `rows` rows admitted to `lane` now are expected to be done: after the
        batch running now, the rows queued in `lane` and above (and those still arriving
        above: of each second, the lanes above keep the share of the session's time they
        took lately, `_load_above`), the rows lower lanes' shares put ahead (a whole
        request of theirs in the next batch, their shares in each after) and its own. A
        lane with a share is reached by it in every batch, whatever is queued above
        (after its own work of other shapes, in batches of their own): the earlier of
        the two, unless a lane above is backlogged and still admitting (see `_fed_above`): then
        only the share is promised."""
        start_s = now_s if self._running_until_s is None else max(now_s, self._running_until_s)
        # Batches hold what the limit of the work they serve allows: an active higher
        # lane keeps them small. The smallest limit among the heads of this shape in this
        # lane and the lanes above (and this request's own) is the rate the queue drains
        # at. A head of another shape leads batches of its own (their time is counted as
        # that shape's work, `Lane.queued_as`), at its shape's cap: counted, a wide head
        # whose cap out of memory had lowered to 1 costed 200 narrow rows in batches of
        # one (refused as 209 ms; admitted, answered in 17 ms).
        # Only the limits used are worked out (the top head's is `_top_batch_rows`'s),
        # all at once: each counts the shares of the lanes below its head (see
        # `Formation.batch_limits`).
        heads = [
            head for other in self.lanes[: lane.priority + 1] if (head := other.head()) is not None
        ]
        firsts = [
            (lane.priority, signature, 0 if rows > self.caps.max_rows else rows),
            *(
                (head.priority, signature, self.formation.whole_rows(head))
                for head in heads
                if head.request.signature == signature
            ),
        ]
        if heads:
            top = heads[0]
            firsts.append((top.priority, top.request.signature, self.formation.whole_rows(top)))
        limits = self.formation.batch_limits(now_s, firsts)
        top_limit = limits.pop() if heads else None
        batch_rows = min(limits)
        arriving_above = any(is_active(above, now_s) for above in self.lanes[: lane.priority])
        # Per lane at or above: its queued rows and requests of this shape, and the seconds
        # of its work of other shapes (asked once: both estimates read them).
        queued = [other.queued_as(signature) for other in self.lanes[: lane.priority + 1]]
        drain = functools.partial(
            self._queue_drain_s,
            lane,
            rows,
            signature,
            batch_rows,
            arriving_above=arriving_above,
            lead_s=start_s - now_s,
            now_s=now_s,
        )
        drain_s = drain(queued)
        # Requests being split ahead in its lane yield it the room of every batch but
        # their floor (`formation._Filling.fill`), when it is whole: counted all ahead, a 1-row
        # request behind 2 000 rows was refused a deadline the next batch met.
        # Under a cap lowered out of memory, requests up to the probed cap are split too:
        # not counted so here, they count whole ahead, as before.
        split = (
            lane.split_ahead(signature, SPLIT_SCAN_ENTRIES)
            if rows <= self.caps.rows(signature) == self.caps.max_rows
            else None
        )
        if split is not None and split[0]:
            split_rows, split_entries, widest_rows = split
            own_rows, own_entries, own_others_s = queued[-1]
            whole = [
                *queued[:-1],
                (own_rows - split_rows, own_entries - split_entries, own_others_s),
            ]
            drain_s = min(drain_s, drain(whole, split=(split_rows, max(widest_rows, rows))))
        # Work still arriving above goes first: of each second, the lanes above take their
        # load, and the queue ahead drains in what is left.
        left = 1.0 - self._load_above(lane, now_s)
        finish_s = start_s + drain_s / max(left, MIN_LEFT_BELOW)
        if lane.config.min_share > 0:
            own_batches = self._share_batches(lane, rows, signature, batch_rows)
            run_time = self._run_times.get(signature)
            # The first head above is the highest queued work: its limit is known.
            top_rows = self._top_batch_rows(now_s, top_limit)
            own_rows = min(rows, self.caps.rows(signature))
            batch_s = run_time.predict_s(max(batch_rows, top_rows, own_rows))
            # Its share moves through the rows of every shape ahead of it in its lane; those
            # of other shapes run, besides, in batches of their own (owed to their shape,
            # or theirs as the highest work), at their shape's run time.
            above_s = sum(other_s for _, _, other_s in queued[:-1])
            share_finish_s = (
                start_s
                + self._share_wait_s(lane, rows, signature, own_batches, batch_s, top_rows, above_s)
                + queued[-1][2]
            )
            if self._fed_above(lane, now_s):
                finish_s = share_finish_s
            else:
                finish_s = min(finish_s, share_finish_s)
        return finish_s

    def _finish_bound_s(
        self, lane: Lane, rows: int, signature: Signature, now_s: float
    ) -> float | None:
        """An upper bound of `_predicted_finish_s(lane, rows, signature, now_s)` in
        O(lanes), from the counts the lanes keep (None: not bounded, when a lane above
        is fed: then only the share's promise stands, which is not bounded here). The
        prediction took 33 of the ~45 us of an admission, paid even by requests whose
        deadline is seconds away; admission skips it while this is within the deadline.

        It bounds the top-down estimate, which bounds the prediction unless a lane above
        is fed (the prediction is then the earlier of it and the share's). That estimate
        is `start_s + drain_s / max(left, MIN_LEFT_BELOW)`, `start_s` and `left` as it
        works them out, and `_queue_drain_s` is at most: the work of other shapes at and
        above, plus `2 + later / per_batch` batches (the next, `full` more and the rest),
        each at most the slowest batch of up to the cap (every batch it costs holds at
        most `batch_rows` <= the cap). Here `later` <= the rows of this shape at and above
        (this request's included), plus the cap minus the batch limit while a lower
        lane's share may claim the next batch's room; `per_batch` >= `_packed_rows`
        (monotone in the room) of the least room: the least batch limit (the cap, or
        `Formation.rows_within_wait` of the active lane above) less every lower lane's share, in
        the least served share (every lower claim counted as shutting out its head), or,
        for a request split in an active lane, no more than its floor of that room,
        which it is counted at there. One batch more absorbs rounding."""
        if lane.config.min_share > 0 and self._fed_above(lane, now_s):
            return None
        start_s = now_s if self._running_until_s is None else max(now_s, self._running_until_s)
        cap = self.caps.rows(signature)
        # The rows of this shape at and above, as `_queue_drain_s` sums them (the same
        # floats, in the same order).
        total, requests = rows, 1
        squares = float(rows * rows)
        fills = rows * lane.fill_ratio
        other_shapes_s = 0.0
        for other in self.lanes[: lane.priority + 1]:
            queued_rows, queued_entries, others_s = other.queued_as(signature)
            total += queued_rows
            requests += queued_entries
            squares += queued_entries * other.request_rows_square_mean
            fills += queued_rows * other.fill_ratio
            other_shapes_s += others_s
        # Lower lanes whose shares may claim room in this shape's batches.
        lower_claims = False
        lower_share = 0.0  # >= `_queue_drain_s`'s: every such share
        shut_out = 0.0  # >= its: every head larger than its share counted shut out
        for other in self.lanes[lane.priority + 1 :]:
            if other.config.min_share == 0 or not other.queued_rows:
                continue
            head = other.head()
            assert head is not None
            if head.request.signature != signature:
                continue
            lower_claims = True
            share = self.formation.share_rows(other, signature)
            lower_share += share / cap
            if head.queued_rows > share:
                shut_out += share / head.queued_rows
        active = next((other for other in self.lanes if is_active(other, now_s)), None)
        least_rows = (
            cap
            if active is None or active.priority >= lane.priority
            else self.formation.rows_within_wait(active, signature)
        )
        least_room = least_rows * (1 - lower_share)
        if least_room <= 0:
            return None
        mean_rows = total / requests
        uniform = squares / requests <= (1 + UNIFORM_SIZES_CV2) * mean_rows * mean_rows
        served_share = max(1.0 - shut_out, MIN_SERVED_SHARE)
        per_batch = served_share * self._packed_rows(
            least_room,
            mean_rows=mean_rows,
            fill_ratio=None if uniform else fills / total,
            cap=cap,
        )
        if rows > cap and is_active(lane, now_s):
            floor_rows = split_floor(cap)
            per_batch = min(per_batch, served_share * min(floor_rows, least_room))
        later = total + max((cap if lower_claims else 0) - least_rows, 0)
        batch_s = self._slowest_batch_s(signature, cap)
        drain_s = other_shapes_s + (3 + later / per_batch) * batch_s
        left = 1.0 - self._load_above(lane, now_s)
        return start_s + drain_s / max(left, MIN_LEFT_BELOW)

    def _slowest_batch_s(self, signature: Signature, cap: int) -> float:
        """The longest `signature`'s model predicts a batch of 0 to `cap` rows to run:
        its run time is linear between its measured sizes, flat below the smallest and
        proportional beyond the largest, so the most of its sizes up to the cap and the
        cap's. Not the cap's alone: a model learned from noisy runs may predict fewer
        rows to run longer. Kept until the model learns or the cap moves."""
        model = self._run_times.get(signature)
        kept = self._slowest.get(signature)
        if kept is not None:
            kept_model, observations, kept_cap, seconds = kept
            if kept_model is model and observations == model.observations and kept_cap == cap:
                return seconds
        seconds = max(
            [model.predict_s(cap), *(s for size, s in model.snapshot().items() if size <= cap)]
        )
        if kept is None and len(self._slowest) > MAX_SIGNATURES:
            self._slowest.clear()  # signatures whose models were dropped
        self._slowest[signature] = (model, model.observations, cap, seconds)
        return seconds

    def _share_wait_s(
        self,
        lane: Lane,
        rows: int,
        signature: Signature,
        batches: int,
        batch_s: float,
        top_rows: int,
        above_s: float,
    ) -> float:
        """Seconds of the `batches` batches until `lane`'s share serves `rows` rows of
        `signature` (in the last), each `batch_s` long. While work of another shape above (of
        `above_s` seconds in all) sets the batches' shape (the highest queued work does),
        the lane banks its share through them until a batch of its shape is owed (see
        `Formation.owed_head`): it moves by its share alone then (not at the pace batches of its
        shape gave it), through batches that run at their shape's model, for as long as
        that work lasts. Counted at this request's model and pace, a short request behind
        two batches of long rows (68 ms each) was promised the next batch, 0.5 ms."""
        if above_s == 0:
            return batches * batch_s
        top = self.formation.top_head()
        if top is None or top.request.signature == signature:
            return batches * batch_s
        top_s = self._run_times.get(top.request.signature).predict_s(top_rows)
        lasts = math.ceil(round(above_s / top_s, BALANCE_DIGITS)) if top_s > 0 else batches
        # It banks its share of each batch it waits through (in batches, see
        # `Lane.share_balance`) until its credit covers its rows ahead and this request's,
        # each row a fraction of its shape's cap.
        cap = self.caps.rows(signature)
        owed = (lane.queued_rows + min(rows, cap)) / cap - lane.share_balance
        banking = math.ceil(round(owed / lane.config.min_share, BALANCE_DIGITS))
        other_batches = min(max(batches, banking), lasts)
        # All of that work, when the lane waits through it all: its last batch may be
        # smaller.
        waited_s = min(other_batches * top_s, above_s)
        return waited_s + max(batches - other_batches, 1) * batch_s

    def _top_batch_rows(self, now_s: float, top_limit: int | None) -> int:
        """Rows of the batches the highest queued work is served in, which a lane's share
        waits through: full ones while its lane is saturated, else its queued rows and
        what rides along with them (or its head's batch limit, if smaller). Costed at the
        limit alone, a standard request behind one interactive request a batch was
        predicted to take twice as long as it did, and refused. `top_limit`: the top
        head's batch limit when the caller has it (None: worked out here)."""
        top = self.formation.top_head()
        if top is None:
            return 0
        lane = self.lanes[top.priority]
        shares = sum(
            self.formation.share_rows(below, top.request.signature)
            for below in self.lanes[top.priority + 1 :]
            if below.queued_rows
        )
        filled = max(lane.queued_rows, self.formation.rows_within_wait(lane, top.request.signature))
        limit = self.formation.limit_rows(now_s, top) if top_limit is None else top_limit
        return min(limit, math.ceil(filled + shares))

    def _arrival_gap_at(self, priority: int, signature: Signature, now_s: float) -> float | None:
        """The time between admissions of `signature` to lane `priority` now (None: none
        seen to go by): their moving average, or the time since the last one if longer
        (traffic that stopped)."""
        gap_s, last_s = self._arrivals.get((priority, signature), (None, None))
        if gap_s is None or last_s is None:
            return None
        return max(gap_s, now_s - last_s)

    def _arriving_rows(
        self, lane: Lane, signature: Signature, within_s: float, now_s: float
    ) -> tuple[float, float]:
        """Rows of `signature` expected to be admitted within `within_s`, whole requests
        at each lane's recent pace and size: to `lane` and above, and to lanes below it.
        Requests of other signatures cannot join its batches: counted, a lone request
        behind a running batch was costed a full batch of another shape's traffic."""
        above = below = 0.0
        cap = self.caps.rows(signature)
        for other in self.lanes:
            gap_s = self._arrival_gap_at(other.priority, signature, now_s)
            if gap_s is None:
                continue
            # A gap of 0, or one that decayed towards it (admissions at one instant),
            # fills a batch: counted up to the cap (every request has a row), it cannot
            # overflow.
            requests = min(within_s / gap_s, cap) if gap_s > 0 else cap
            rows = math.floor(requests) * other.request_rows_mean
            if other.priority <= lane.priority:
                above += rows
            else:
                below += rows
        return above, below

    def _idle_decay(self, now_s: float) -> float:
        """What the utilisation and the lanes' time shares keep of their weight at
        `now_s`: they are folded in at dispatches only, and a session free since its last
        batch ended has had none of their time since (1.0 while a batch runs, or before
        one ran). Read as they stood, a minute after interactive traffic stopped, its
        share still stretched every promise, and a request was refused a 2.5 ms deadline
        it met in 1.3."""
        if self._running_until_s is not None or self._last_dispatch_s is None:
            return 1.0
        free_s = now_s - self._last_dispatch_s - self._last_run_s
        return math.exp(-max(free_s, 0.0) / UTILIZATION_WINDOW_S)

    def _load_above(self, lane: Lane, now_s: float) -> float:
        """The share of the session's time the lanes above `lane` took lately: what the
        work still arriving there takes while `lane`'s queue drains. Foreseeing none, a
        standard request behind 1 040 rows, while interactive rows of another shape took
        a quarter of the time, was promised 79 ms and expired (answered in 109)."""
        load = sum(above.time_share for above in self.lanes[: lane.priority])
        return load * self._idle_decay(now_s) if load else 0.0

    def _fed_above(self, lane: Lane, now_s: float) -> bool:
        """Whether a lane above `lane` has work queued and is still admitting more (it
        is active): the queue ahead then does not drain as it stands, and the top-down
        estimate, which foresees no arrivals, is no promise. With standard saturated,
        bulk requests were admitted on that estimate, 5-10x too early, and 5 625 of them
        expired in the queue (a model whose batches of 64 rows run in 3 ms). Only while
        the session is nearly saturated (FED_UTILIZATION; unknown before a batch ran):
        with time to spare, work queued above is served as it comes, and the top-down
        estimate, with the load above counted (`_load_above`), holds. Applied at a third
        of the session's time, 14 of 20 bulk requests were refused 60 ms deadlines they
        met in 9 ms."""
        utilization = self.utilization
        if utilization is not None and utilization * self._idle_decay(now_s) < FED_UTILIZATION:
            return False
        return any(
            above.queued_rows > 0 and is_active(above, now_s)
            for above in self.lanes[: lane.priority]
        )

    def _queue_drain_s(  # noqa: PLR0912, PLR0913, PLR0915 - one pass over the lanes, every admission
        self,
        lane: Lane,
        rows: int,
        signature: Signature,
        batch_rows: int,
        queued: Sequence[tuple[int, int, float]],
        *,
        arriving_above: bool = False,
        lead_s: float = 0.0,
        now_s: float | None = None,
        split: tuple[int, int] = (0, 0),
    ) -> float:
        """Seconds until `rows` more rows in `lane` are served top-down in batches of
        `batch_rows`: the rows queued in it and above (`queued`: `Lane.queued_as` of
        each), and what lower lanes' shares take from each batch (work that arrives above
        meanwhile is not foreseen, but the room it takes in each batch is, while
        `arriving_above`: a lane above is active).
        Requests stay whole, so a batch serves the whole requests that fit, counted at
        their mean size while they come in about one size (see UNIFORM_SIZES_CV2):
        counted at the limit (8-row requests fill 16 of 21 rows), admission promised
        deadlines it then missed.

        The batch that serves the request's last rows holds, besides, the requests
        admitted after it until that batch forms (`lead_s` from `now_s` until the next
        batch forms; None: none foreseen), those of lanes below within `lane`'s max_wait
        (the budget they ride along in): costed at the rows ahead alone, a request behind
        a running batch was promised a batch of its own rows (4 ms) and ran in a full one
        (20 ms).

        Only rows of `signature` batch with it; the work of other shapes queued in `lane`
        and above runs in batches of its own shape, first, and costs what its shape's
        model says (`Lane.queued_as`, O(1) a lane). All costed at this request's model, 128
        rows of length 512 ahead were predicted to take 2 ms for a request of length 8
        (it was answered 174 ms late), and 256 rows of length 8 to take 620 ms for one of
        length 512 (refused: it would have been answered in 73 ms).

        `split`: the rows of requests larger than the cap queued ahead in `lane`, left out
        of `queued` (this request is whole), and the rows of the widest whole request from
        the first of them on, this one included (see `Lane.split_ahead`). A batch gives
        them the room the whole requests behind them leave, but at least
        SPLIT_FLOOR_SHARE of the cap (`formation._Filling.fill`): they are counted as taking that
        out of every batch and filling the room left, for as long as this request waits.
        That is too long when they run out first: then their rows counted whole ahead
        (the call without them) is the earlier estimate, and the caller takes the
        earlier of the two. A whole request wider than the room beside that floor waits
        until they are done: then only that call holds (this one is infinite).

        This request larger than the cap is split, and yields the room of each batch to
        the whole requests admitted behind it down to the same floor: while its lane is
        active, its rows and those ahead are counted at that floor a batch."""
        run_time = self._run_times.get(signature)
        cap = self.caps.rows(signature)
        split_rows, widest_rows = split
        # What requests being split ahead in `lane` take from each batch while they last.
        split_take = min(split_rows, split_floor(cap))
        total = rows  # rows of `signature` in `lane` and above, this request's included
        requests = 1  # their requests
        # Their sizes lately: the mean of the squares, weighted by queued requests.
        squares = float(rows * rows)
        # What first fit packs of them, weighted by queued rows (see `Lane.fill_ratio`).
        fills = rows * lane.fill_ratio
        # Seconds of the work of other shapes in `lane` and above: it runs ahead, in
        # batches of its own shape, at its own shape's run time (see `Lane.queued_as`);
        # the batches of this shape form after it.
        other_shapes_s = 0.0
        first_lower = 0  # what lower lanes' shares may take ahead in the next batch
        shares = 0.0  # what they take in each batch after (fractions of a row)
        lower_share = 0.0  # their shares, as a fraction of a batch
        lower_heads: list[tuple[float, int]] = []  # (share in rows, head's rows) of each
        # Whether other work takes the room whole requests leave.
        riders = arriving_above or split_take > 0
        for other in self.lanes:  # one pass: this runs for every admission
            if other.priority <= lane.priority:
                queued_rows, queued_entries, others_s = queued[other.priority]
                total += queued_rows
                requests += queued_entries
                squares += queued_entries * other.request_rows_square_mean
                fills += queued_rows * other.fill_ratio
                other_shapes_s += others_s
            elif other.queued_rows:
                head = other.head()
                assert head is not None
                if head.request.signature != signature:
                    continue  # it cannot join this request's batches
                riders = True
                if other.config.min_share == 0:
                    continue
                share = self.formation.share_rows(other, signature)
                lower_heads.append((share, head.queued_rows))
                allowance = share + self.formation.balance_rows(other, signature)
                if allowance > 0:
                    first_lower += self._share_claim_rows(
                        other, signature, allowance, cap - first_lower
                    )
        mean_rows = total / requests
        # Whether requests come in about one size (see UNIFORM_SIZES_CV2).
        uniform = squares / requests <= (1 + UNIFORM_SIZES_CV2) * mean_rows * mean_rows
        # A lower lane's share is rows out of each batch while its requests fit beside
        # these; one that does not takes a whole batch (its claim owns it, see
        # `Formation._fill_top_down`) every head / share batches. Counted as rows out of each,
        # interactive requests behind a standard backlog of 5-row requests (cap 8,
        # share 0.25) were promised 5 rows a batch and got 3: they expired in the queue.
        shut_out = 0.0  # the share of batches lower lanes' claims take whole
        for share, head_rows in lower_heads:
            if head_rows + min(mean_rows, batch_rows) > batch_rows and head_rows > share:
                shut_out += share / head_rows
            else:
                shares += share
                lower_share += share / cap
        # Their shares sum below 1: the guard keeps an estimate of several claims at
        # once (they take turns) from reading as none served at all.
        served_share = max(1.0 - shut_out, MIN_SERVED_SHARE)

        def with_arrivals(known_rows: float, forms_in_s: float) -> int:
            # The rows of the batch that serves this request's last rows: `known_rows`,
            # and what is admitted behind it before that batch forms, up to the limit.
            if now_s is None or forms_in_s <= 0:
                return min(batch_rows, math.ceil(known_rows))
            above, below = self._arriving_rows(lane, signature, forms_in_s, now_s)
            filled = min(known_rows + above, batch_rows)
            if below > 0:  # they ride along within the budget of `lane`'s max_wait
                budget = min(self.formation.rows_within_wait(lane, signature), batch_rows)
                filled = max(filled, min(known_rows + above + below, budget))
            return math.ceil(filled)

        if total + first_lower + split_take <= batch_rows:
            # One batch serves this shape's rows: the work of other shapes in this lane,
            # when it leads, which it gathers past, runs after it (see `_gathered_s`).
            first_s = other_shapes_s - self._gathered_s(lane, signature, queued[lane.priority])
            return first_s + run_time.predict_s(
                with_arrivals(total + first_lower + split_rows, lead_s + first_s)
            )

        whole = functools.partial(
            self._packed_rows,
            mean_rows=mean_rows,
            fill_ratio=None if uniform else fills / total,
            cap=cap,
        )

        # Rows of `lane` and above each batch serves: what lower lanes' shares leave (a
        # share may be a fraction of a row: at a cap of 1, 0.85 of a row a batch), and
        # never less than their fraction of it leaves (batches an active lane keeps
        # smaller than the shares of a full one).
        room = max(batch_rows - shares, batch_rows * (1 - lower_share)) - split_take
        if split_take and widest_rows > room:
            return math.inf  # a request ahead, or this one, never fits beside them
        per_batch = served_share * whole(room)
        # A batch runs at its limit while other work takes the room whole requests leave
        # (rows of lower lanes riding along, or of an active lane above: costed without
        # them, standard requests admitted at their deadline's edge beside interactive
        # traffic ran 1 % late), else at the rows it serves.
        batch_s = run_time.predict_s(
            batch_rows if riders else min(batch_rows, math.ceil(per_batch + shares))
        )
        # Rows left after the next batch; lower lanes' whole requests crossing their
        # shares may take more than that batch (then the excess comes first after it).
        first_room = batch_rows - first_lower
        first_whole = first_room - split_take
        later = total - (whole(first_whole) if first_whole > 0 else min(first_room, 0))
        if rows > cap and now_s is not None and is_active(lane, now_s):
            # This request is split, and its lane is busy: each batch gives the whole
            # requests admitted behind it the room they fit, and it what they leave, at
            # least its floor (`formation._Filling.fill`). From the next batch on, every batch that
            # serves its lane serves that many of its rows and those ahead (a request
            # split ahead keeps the floor for itself): counted so, the price holds
            # whatever arrives, and is up to twice what it takes when little does (512-row
            # requests beside 1-row ones at 500-3 000/s took 0.55-0.73 of it, simulated),
            # for requests over the cap only. Counted in full batches (as in an idle
            # lane), 512-row requests admitted at their deadline's edge beside 1-row ones
            # arriving at 500-1 500/s all ran late (by up to 21 %); at 3 000/s, all
            # expired in the queue.
            floor_rows = split_floor(cap)
            per_batch = min(per_batch, served_share * min(floor_rows, room))
            later = max(later, total - floor_rows)
        full, rest = divmod(later, per_batch)
        drain_s = (1 + int(full)) * batch_s
        if rest > ROUNDING_ROWS:
            drain_s += run_time.predict_s(
                with_arrivals(rest + shares + split_rows, lead_s + other_shapes_s + drain_s)
            )
        return other_shapes_s + drain_s

    def _gathered_s(
        self, lane: Lane, signature: Signature, queued: tuple[int, int, float]
    ) -> float:
        """Seconds of `lane`'s queued work of other shapes that the next batch passes
        over (`queued`: its `Lane.queued_as(signature)`), when `lane` holds the highest
        queued work: its head of `signature` leads that batch, and the lane gathers that
        shape past up to GATHER_SCAN_ENTRIES entries of others (`formation._Filling.fill`), which
        keep their place and run after it. 0.0 when a lane above has work (only the
        leading lane gathers: a lower lane's turn ends at its head of another shape, and
        a request there was promised the gathered batch and expired behind the leader's
        other shapes), or another shape leads (the head's, or an owed lane's,
        `Formation.owed_head`). Counted as running first, an 8-row request behind 200 wide rows,
        whose shape led the lane, was refused a 30 ms deadline (about 54 ms) and,
        admitted, was answered in the next batch (23 ms)."""
        _, entries, others_s = queued
        head = lane.head()
        if head is None or head.request.signature != signature or others_s == 0.0:
            return 0.0
        if any(above.queued_rows for above in self.lanes[: lane.priority]):
            return 0.0
        if lane.queued_entries - entries > GATHER_SCAN_ENTRIES:
            return 0.0  # the scan stops short of some of this shape's rows
        owed = self.formation.owed_head(head)
        if owed is not None and owed.request.signature != signature:
            return 0.0
        return others_s

    def _share_claim_rows(
        self, lane: Lane, signature: Signature, allowance: float, room: int
    ) -> int:
        """The rows pass 1 takes from `lane` for its `allowance` in a batch of `signature`
        with `room` rows left, as `formation._Filling.fill` takes them: entries in order while under
        the allowance, the one crossing it whole, one larger than the cap split to the
        allowance's rows, and one that does not fit, or of another shape, ends the turn.
        Counted as the head alone (up to the cap), a 2-row head before a 40-row request
        was counted 4 rows where pass 1 took 42 (a standard request was answered late),
        and a head larger than the cap 64 rows where pass 1 took 4 (an interactive request
        was refused a deadline it met). At most SHARE_SCAN_ENTRIES entries are read: past
        them (entries that small cross the allowance by little) the rest of the allowance
        is counted."""
        cap = self.caps.rows(signature)
        used = 0
        for scanned, entry in enumerate(lane):
            if used >= allowance or room <= 0:
                break
            if scanned == SHARE_SCAN_ENTRIES:
                return used + min(room, math.ceil(allowance - used))
            if entry.request.signature != signature:
                break
            left = entry.queued_rows
            if entry.request.rows > cap:
                taken = min(left, room, math.ceil(allowance - used))
            elif left <= room:
                taken = left
            else:
                break
            used += taken
            room -= taken
        return used

    def _alone_s(self, signature: Signature, rows: int) -> float:
        """Seconds `rows` queued rows of `signature` take in batches of their own at the
        cap (a lane's price of its queued work, see `Lane.queued_as`). Rows batch only
        with rows of their shape, so a few rows of a shape pay a whole run: priced at a
        full batch's cost per row, ten 1-row requests of ten lengths ahead would count as
        a tenth of a cap's run where they take ten runs. Rows of one shape in several
        lanes may share batches: counted per lane, at most a run per lane too many."""
        return self._run_times.get(signature).drain_s(rows, self.caps.rows(signature))

    @staticmethod
    def _packed_rows(room: float, *, mean_rows: float, fill_ratio: float | None, cap: int) -> float:
        """The rows of whole requests that fit `room`: of one size (`fill_ratio` None),
        those of the mean size; of a mix, the share `fill_ratio` of the room that first
        fit in order filled in the batches their lanes led lately (packed at their mean
        size, 1- and 64-row requests were counted 3 a batch where a batch holds 65 rows
        or 128). Room for less than one request is an average over batches (a share of a
        fraction of a row, a request crossing its allowance), and requests larger than
        the cap (`cap`, of their signature) are split: both fill it."""
        fits = math.floor(room / mean_rows)
        if fits < 1 or mean_rows > cap:
            return room
        if fill_ratio is None:
            return fits * mean_rows
        return max(room * fill_ratio, mean_rows)

    def _share_batches(self, lane: Lane, rows: int, signature: Signature, batch_rows: int) -> int:
        """Batches until `lane`'s share reaches `rows` more rows in it: the first whose
        allowance exceeds the rows queued ahead of them (what the lane owes counts as
        ahead); the request then goes whole, as the allowance's crossing request. A lane
        that batches lately gave more than its share (rows riding along in room the lanes
        above left) moves at that pace: at its share alone, every bulk request behind a
        saturated standard lane was refused a deadline it then met."""
        share = self.formation.share_rows(lane, signature)
        served = lane.served_rows_per_batch
        pace = served if served >= PACE_MARGIN * share else share
        balance, repaying = self.formation.balance_rows(lane, signature), 0
        top = self.formation.top_head()
        if balance < 0 and top is not None and top.request.signature != signature:
            # Its debt (a batch of its own shape it owned, charged what it shut out,
            # `formation._charge_owner`) is repaid by its share of each batch of the top's
            # shape, not at its own shape's rows: counted so (a cap lowered to 1, 0.1 of a
            # row a batch), a debt was 575 batches, and every request was refused for 430 ms
            # where it waited 45.
            repaying = math.ceil(round(-lane.share_balance / lane.config.min_share, BALANCE_DIGITS))
            balance = 0.0
        ahead = lane.queued_rows - balance
        claims_above = sum(
            self.formation.share_take_rows(above, signature)
            for above in self.lanes[: lane.priority]
        )
        if rows > self.caps.rows(signature):
            # Not taken whole: it moves on by `pace` rows a batch.
            batches = math.ceil((ahead + rows) / pace)
        elif rows > batch_rows - claims_above:
            # No room for it beside the higher lanes' work: its lane banks its share
            # until that covers it, and it goes first in the batch after.
            batches = math.ceil((ahead + rows) / share) + 1
        else:
            # Rounded as balances are: 0.1 * 19 must not floor to 18.
            batches = math.floor(round(ahead / pace, BALANCE_DIGITS)) + 1
        return max(1, repaying + batches)

    def cancel(self, entry_id: int, now_s: float, *, unless_running: bool = False) -> str | None:
        """The client went away: its queued rows are freed now and no answer is due.

        With `unless_running`, an entry that has started (any of its rows handed to a
        batch: a request larger than the cap may have chunks done, running and queued)
        is left to finish and be answered, so that its result can be replayed to a retry
        instead of its rows running twice. Returns the status the entry ended with, or
        None when it was not cancelled (its answer is given or still due): CANCELLED when
        its caller left, else its deadline had come (gRPC cancels a call at its deadline:
        the caller got DEADLINE_EXCEEDED, it did not go). Then an entry with rows still
        queued is EXPIRED_IN_QUEUE (shed: the queue's doing), one whose rows have all gone
        to the session is DEADLINE_EXCEEDED (it ran too late: not shed, no row was dropped
        unrun).
        """
        entry = self._entries.get(entry_id)
        if entry is None or (unless_running and entry.next_row > 0):
            return None
        del self._entries[entry_id]
        entry.cancelled = True
        entry.finished = True
        lane = self.lanes[entry.priority]
        status = caller_end_status(now_s, entry.deadline_s, queued=entry.in_lane)
        if entry.in_lane:
            rows = entry.queued_rows
            lane.drop(entry)
            self.events.shed(lane.name, status, rows)
        # Its terminal state: every admitted entry ends exactly once, cancelled included.
        self.events.completed(lane.name, status)
        return status

    def move_deadline(self, entry_id: int, deadline_s: float) -> bool:
        """Moves a live entry's deadline to `deadline_s`: later when a retry with a later
        deadline joined the request, earlier when the caller it waited for left (the work
        waits for the latest caller still waiting), never past its lane's timeout from
        when it queued: a retry from a lane with a longer timeout (bulk's 120 s joining
        interactive work) held the room of the lane the work is in that long. False when
        the entry has been answered (its Outcome is on its way)."""
        entry = self._entries.get(entry_id)
        if entry is None or entry.finished:
            return False
        lane = self.lanes[entry.priority]
        deadline_s = min(deadline_s, lane.config.deadline_s(entry.enqueued_s, None))
        if deadline_s != entry.deadline_s:
            entry.deadline_s = deadline_s
            heapq.heappush(self._deadlines, (deadline_s, entry_id))  # the old pair goes stale
        return True

    def stop_accepting(self) -> None:
        self.accepting = False

    # ---- shedding ----------------------------------------------------------------

    def shed_expired(
        self, now_s: float, limit: int | None = None, *, into: list[Outcome] | None = None
    ) -> list[Outcome]:
        """Answers the queued entries whose deadline has passed, earliest deadline first;
        they never run. Takes at most `limit` deadlines off the heap (None: all that are
        due), answered or stale (their entries answered, running or moved): `expired_left`
        says whether some are left, and work is not dispatched while they are (it could
        take them). The answers go into `into` as `complete`'s do.

        An entry whose rows are all in a running batch is left to finish: it is running.
        """
        outcomes: list[Outcome] = [] if into is None else into
        taken = 0
        while self.expired_left(now_s) and (limit is None or taken < limit):
            taken += 1
            deadline_s, entry_id = heapq.heappop(self._deadlines)
            entry = self._entries.get(entry_id)
            if entry is None or not entry.in_lane or entry.deadline_s != deadline_s:
                continue  # answered, all running, or its deadline was moved
            lane = self.lanes[entry.priority]
            self.events.shed(lane.name, "EXPIRED_IN_QUEUE", entry.queued_rows)
            waited_ms = (now_s - entry.enqueued_s) * 1000
            # A request split across batches may have had parts run: said, since the
            # rest, not the request, never ran.
            started = entry.request.rows - entry.queued_rows
            what = (
                "before the request could run"
                if started == 0
                else f"before the rest of the request could run ({started} of its "
                f"{entry.request.rows} rows ran or were running in earlier batches)"
            )
            note = _expiry_note(lane.config, entry)
            # Its deadline counts from its arrival: "after 42.9 ms in lane 'standard'"
            # alone read as a deadline of 43 ms where the caller had set 50 (a user's
            # evaluation; the rest went in reading it, or waiting for room).
            waited = (
                f"after {waited_ms:.1f} ms in lane {lane.name!r}"
                if entry.request.arrived_s is None
                else f"{entry.request.waited_s(now_s) * 1000:.1f} ms after the request arrived, "
                f"{waited_ms:.1f} ms of them in lane {lane.name!r},"
            )
            outcomes.append(
                self._finish_error(
                    entry, ExpiredInQueueError(f"deadline passed {waited} {what}{note}")
                )
            )
        return outcomes

    def expired_left(self, now_s: float) -> bool:
        """Whether deadlines that have passed are still on the heap (`shed_expired` left
        them, at its limit): some may be of queued entries."""
        return bool(self._deadlines) and self._deadlines[0][0] <= now_s

    def next_deadline_s(self, limit: int | None = None) -> float | None:
        """The earliest deadline of a queued entry, when `shed_expired` has work. Stale
        deadlines before it are dropped, at most `limit` of them (None: all): past that,
        the earliest left, stale or not (a wake-up too early drops more then). Stale ones
        pile up from cancelled and finished work until an admission compacts the heap:
        16 000 were dropped in one call, under the scheduler's lock."""
        dropped = 0
        while self._deadlines:
            deadline_s, entry_id = self._deadlines[0]
            entry = self._entries.get(entry_id)
            if entry is not None and entry.in_lane and entry.deadline_s == deadline_s:
                return deadline_s
            if limit is not None and dropped >= limit:
                return deadline_s
            heapq.heappop(self._deadlines)
            dropped += 1
        return None

    # ---- dispatch ------------------------------------------------------------------

    def decide(self, now_s: float, idle_since_s: float) -> Decision:
        """What to do now that the session is free (and has been since `idle_since_s`)."""
        plan = self.formation.plan(now_s)
        if not plan.taken:
            return None
        rows = sum(taken for _, taken in plan.taken)
        reason: DispatchReason | None = None
        if rows >= plan.limit_rows:
            reason = DispatchReason.FULL
        elif any(entry.enqueued_s < idle_since_s for entry, _ in plan.taken):
            reason = DispatchReason.BACKLOG
        elif plan.left_out:
            # Full too when queued work is left out of it (`Plan.left_out`): waiting
            # could only hold that work back. Tested after the backlog, so that a batch
            # that went at once anyway keeps the reason that says why.
            reason = DispatchReason.FULL
        else:
            wait_until_s = min(entry.dispatch_by_s for entry, _ in plan.taken)
            run_s = self._run_times.get(plan.taken[0][0].request.signature).predict_s(rows)
            latest_start_s = min(entry.deadline_s for entry, _ in plan.taken) - run_s
            if now_s >= latest_start_s:
                reason = DispatchReason.DEADLINE
                self.formation.trim_to_deadline(plan, now_s)
            elif now_s >= wait_until_s:
                reason = DispatchReason.MAX_WAIT
            elif not self._waiting_pays(wait_until_s - now_s):
                reason = DispatchReason.IDLE
            else:
                return WaitUntil(min(wait_until_s, latest_start_s))
        if reason is DispatchReason.FULL or reason is DispatchReason.BACKLOG:
            # The other reasons go only while the batch ends by its earliest deadline
            # (else the deadline's reason, trimmed): these go whatever it holds.
            self.formation.trim_to_deadline(plan, now_s, unless_lost=True)
        return Dispatch(self._commit(plan, reason, now_s))

    def _waiting_pays(self, wait_left_s: float) -> bool:
        """Whether holding a free session for company is worth the latency. It is not
        when the session is mostly idle: batching by waiting buys throughput nobody needs
        (a lone caller, closed loop, must not pay max_wait per call); nor when requests
        arrive further apart than the wait left: waiting would most likely add nobody;
        nor before two requests have come (no gap known): the first request after start
        waited out its lane's whole max_wait on an idle server."""
        if self.utilization is not None and self.utilization < WAIT_UTILIZATION:
            return False
        return self._arrival_gap_s is not None and self._arrival_gap_s <= wait_left_s

    def _commit(self, plan: Plan, reason: DispatchReason, now_s: float) -> Batch:
        self._observe_utilization(now_s)
        signature = plan.taken[0][0].request.signature
        if plan.fill_sample is not None:
            led, fill = plan.fill_sample
            lane = self.lanes[led]
            lane.fill_ratio += FILL_ALPHA * (min(max(fill, 0.0), 1.0) - lane.fill_ratio)
        taken = plan.taken
        served = self.formation.settle_shares(plan)
        self._last_run_rows = served
        for lane in self.lanes:
            lane.promises.room_made(served[lane.priority])
            if lane.queued_rows:
                lane.served_rows_per_batch += SERVED_ALPHA * (
                    served[lane.priority] - lane.served_rows_per_batch
                )
                lane.served_at_s = now_s
        # Slices in lane-priority then FIFO order: the batch's rows in the order their
        # requests were queued (whole ones served ahead of a split request's chunks
        # included), and each lane's entries leave its deque in that order: right behind
        # its head when that is being split (`Lane._leave` deletes them there).
        taken.sort(key=lambda pair: (pair[0].priority, pair[0].entry_id))
        slices = []
        offset = 0
        for entry, rows in taken:
            lane = self.lanes[entry.priority]
            start = lane.take(entry, rows)
            if start == 0:  # its wait ends at its first batch; later chunks wait on it
                entry.queue_s = now_s - entry.enqueued_s
            slices.append(
                BatchSlice(entry.entry_id, lane.name, start, rows, offset, entry.request.trace)
            )
            offset += rows
        names = list(taken[0][0].request.inputs)
        parts = {
            name: tuple(
                entry.request.inputs[name][piece.row_start : piece.row_start + piece.rows]
                for (entry, _), piece in zip(taken, slices, strict=True)
            )
            for name in names
        }
        self._last_batch_id += 1
        batch = Batch(
            batch_id=self._last_batch_id,
            slices=tuple(slices),
            rows=offset,
            reason=reason,
            formed_s=now_s,
            parts=parts,
            signature=signature,
        )
        self._running_until_s = now_s + self._run_times.get(batch.signature).predict_s(batch.rows)
        self.events.batch_formed(
            batch,
            [
                entry.queue_s if piece.row_start == 0 else None
                for (entry, _), piece in zip(taken, slices, strict=True)
            ],
        )
        return batch

    def _observe_utilization(self, now_s: float) -> None:
        """Folds the last dispatch interval into the utilisation: the previous batch's run
        time over the time since it was dispatched, weighted by how long that interval
        was (a long idle spell weighs as much as its length, not as one sample)."""
        if self._last_dispatch_s is not None:
            interval_s = now_s - self._last_dispatch_s
            if interval_s > 0:
                busy = min(self._last_run_s / interval_s, 1.0)
                keep = math.exp(-interval_s / UTILIZATION_WINDOW_S)
                previous = busy if self.utilization is None else self.utilization
                self.utilization = previous * keep + busy * (1.0 - keep)
                rows = sum(self._last_run_rows) or 1
                for lane, lane_rows in zip(self.lanes, self._last_run_rows, strict=True):
                    lane_busy = busy * lane_rows / rows
                    lane.time_share = lane.time_share * keep + lane_busy * (1.0 - keep)
        self._last_dispatch_s = now_s
        self._last_run_s = 0.0

    # ---- completion ----------------------------------------------------------------

    def complete(
        self,
        result: BatchResult,
        *,
        into: list[Outcome] | None = None,
        ended_s: float | None = None,
    ) -> list[Outcome]:
        """Hands each request its rows of a finished batch; answers the completed ones.
        `ended_s`: when it ended, on the scheduler's clock (None: when it formed plus its
        run time); an answer made then past its request's deadline is late
        (`Outcome.late`). The lanes' pace counts it served until it formed plus its run
        time, whatever `ended_s`.

        Each answer is appended to `into` (None: a new list) as it is made, and that list
        is returned (a caller that passes `into` ignores it: added again, each answer
        would go out twice). A request answered is no longer live, so `abort_all` will not answer
        it again: when this raises partway (a bug), the answers already made are in
        `into`, for the caller to deliver. Returned in a list of its own, they were lost
        with it (the callers waited until gRPC stopped)."""
        batch = result.batch
        self._running_until_s = None
        self._last_run_s += result.run_s
        if result.error is None and not result.split:
            self._run_times.observe(batch.signature, batch.rows, result.run_s)
            # Queued rows of its shape (of every shape, where one model predicts all) at
            # what it learned. A guess for a shape not yet run may move too (it is scaled
            # from the nearest measured model): it is priced anew when its rows next move.
            learned = batch.signature if self._run_times.per_signature else None
            for lane in self.lanes:
                lane.reprice(learned)
        self._adapt_cap(result)
        # Its lanes were served until it ended, not only when it formed: a batch of 100 ms
        # or more outlasted ACTIVE_LANE_S, and each lane whose rows all ran in it had its
        # pace forgotten at every batch (`_forget_idle_pace`; 29 % of bulk requests
        # refused in a simulation whose requests all met their deadlines before).
        ran_until_s = batch.formed_s + result.run_s
        if ended_s is None:
            ended_s = ran_until_s
        for piece in batch.slices:
            lane = self._by_name[piece.lane]
            if lane.served_at_s is None or lane.served_at_s < ran_until_s:
                lane.served_at_s = ran_until_s
        outcomes = [] if into is None else into
        for piece in batch.slices:
            entry = self._entries.get(piece.entry_id)
            if entry is None or entry.finished:
                continue  # cancelled, expired or failed while this batch ran
            entry.infer_s += result.run_s
            entry.last_batch_rows = batch.rows
            if result.error is not None:
                outcomes.append(self._finish_error(entry, result.error))
                continue
            failure = next(
                (
                    failed.error
                    for failed in result.failed_rows
                    if failed.offset < piece.offset + piece.rows
                    and piece.offset < failed.offset + failed.rows
                ),
                None,
            )
            if failure is not None:
                # (Rows not run again after an out-of-memory are no live entry's:
                # `rows_wanted` answered their callers when it left them out.)
                outcomes.append(self._finish_error(entry, failure))
                continue
            assert result.outputs is not None
            entry.chunks.append(
                (
                    piece.row_start,
                    {
                        name: array[piece.offset : piece.offset + piece.rows]
                        for name, array in result.outputs.items()
                    },
                )
            )
            entry.done_rows += piece.rows
            if entry.done_rows == entry.request.rows:
                outcomes.append(self._finish_ok(entry, ended_s))
        # A batch none of whose rows ran failed as a whole, with its first row's error.
        error = result.error
        if error is None and result.outputs is None:
            error = result.failed_rows[0].error
        failed = 0 if error is not None else sum(failed.rows for failed in result.failed_rows)
        self.events.batch_done(batch, result.run_s, error, failed, split=result.split)
        return outcomes

    def rows_wanted(
        self, batch: Batch, now_s: float, *, into: list[Outcome] | None = None
    ) -> tuple[npt.NDArray[np.bool_], list[Outcome]]:
        """For each row of `batch` (running, retried in parts after a failed run), whether
        a caller still waits for it within its deadline: the engine runs no other row
        again. The callers whose deadline has passed are answered now, not when the last
        part of the batch has run (which may take as long again); their answers go into
        `into` as `complete`'s do."""
        wanted = np.zeros(batch.rows, dtype=bool)
        outcomes: list[Outcome] = [] if into is None else into
        for piece in batch.slices:
            entry = self._entries.get(piece.entry_id)
            if entry is None or entry.finished:
                continue
            if entry.deadline_s > now_s:
                wanted[piece.offset : piece.offset + piece.rows] = True
                continue
            lane = self.lanes[entry.priority].config
            self.events.shed(lane.name, ExpiredInQueueError.reason, piece.rows + entry.queued_rows)
            note = _expiry_note(lane, entry)
            outcomes.append(
                self._finish_error(
                    entry,
                    ExpiredInQueueError(
                        "deadline passed while its batch was being retried in parts after "
                        f"a failed run; its rows were not run again{note}"
                    ),
                )
            )
        return wanted, outcomes

    def _adapt_cap(self, result: BatchResult) -> None:
        """Reports the batch's out-of-memory runs and moves its signature's cap (see
        `BatchCaps.adapt`); the queued work of the signatures whose cap moved is priced
        again at the cap it now runs at. Shapes with no cap of their own whose guess came
        from a cap that moved keep their price until their rows next move
        (`BatchCaps.adapt`): every queued shape priced again, 16 000 one-row requests of
        distinct lengths held the scheduler ~1 s."""
        for rows in result.out_of_memory_rows:
            self.events.out_of_memory(rows)
        if any(rows > 1 for rows in result.out_of_memory_rows):
            # Once per batch, however many of its parts split again (the counter said
            # "batches split" and counted every split run).
            self.events.batch_split(
                result.batch.batch_id, result.batch.rows, len(result.out_of_memory_rows)
            )
        for signature in self.caps.adapt(result):
            for lane in self.lanes:  # its queued work runs in batches of the new cap
                lane.reprice(signature)

    def update_memory(self, used_bytes: int) -> None:
        """A reading of device memory in use, for the watermark: with nothing queued or
        running, of what the server holds idle (`Watermark.update`). Lanes reopened so
        above the low mark are logged (watermark_idle_above_low), the first time: the
        low mark is below what the idle server keeps after a burst."""
        mark = self.watermark
        if mark is None:
            return
        was_closed = mark.closed
        mark.update(used_bytes, idle=self._idle)
        self.events.memory_sampled(used_bytes, mark.limit_bytes)
        # Between the marks: its advice, a low mark above this reading's share of the
        # limit, is then below the high mark (a setting the config takes).
        if (
            mark.closed < was_closed
            and mark.low_bytes <= used_bytes < mark.high_bytes
            and not self._idle_floor_logged
        ):
            self._idle_floor_logged = True
            limit = format_bytes(math.ceil(used_bytes * mark.limit_bytes / mark.low_bytes))
            share = math.ceil(used_bytes / mark.limit_bytes * 100) / 100
            log_event(
                log,
                logging.WARNING,
                "watermark_idle_above_low",
                f"memory in use with nothing queued or running is {format_bytes(used_bytes)}, "
                f"above the low watermark {format_bytes(mark.low_bytes)} that reopens lanes "
                "closed by memory (logged once): they reopen at the idle reading instead, "
                "and work admitted then may close them again soon; a memory_low_watermark "
                f"above {share:g} (or, on the CPU, a --host-memory-limit of about {limit}) "
                "keeps the idle server below the low mark",
                used_bytes=used_bytes,
                low_bytes=mark.low_bytes,
                closed_lanes=mark.closed,
            )

    @property
    def _idle(self) -> bool:
        """Nothing queued or running: memory in use is what the server holds idle."""
        return not self._entries and self._running_until_s is None

    @property
    def memory_holds_lanes_closed(self) -> bool:
        return self.watermark is not None and self.watermark.closed > 0

    def watermark_state(self) -> WatermarkState | None:
        if self.watermark is None:
            return None
        return WatermarkState(
            used_bytes=self.watermark.used_bytes,
            high_bytes=self.watermark.high_bytes,
            low_bytes=self.watermark.low_bytes,
            closed_lanes=tuple(
                lane.name for lane in self.lanes if self.watermark.refuses(lane.priority)
            ),
            limit_bytes=self.watermark.limit_bytes,
            reading=self.watermark.reading,
        )

    def abort_all(
        self, error: LaneserveError, running_error: LaneserveError | None = None
    ) -> list[Outcome]:
        """Answers every live entry with `error` (shutdown), or with `running_error` if
        given for those with rows handed to a batch (they may have run): nothing is left
        unanswered, not even an entry whose bookkeeping raises (a bug: one that raised
        once, in a lane's drop, tripped here and left every entry after it unanswered,
        under the scheduler thread's lock). Such an entry is answered without it: the
        server is stopping, and the lanes' books no longer matter."""
        outcomes: list[Outcome] = []
        logged = False
        for entry in list(self._entries.values()):
            entry_error = error if running_error is None or entry.next_row == 0 else running_error
            try:
                # It frees the entry's queued rows too.
                outcomes.append(self._finish_error(entry, entry_error))
            except Exception:  # logged once, with its traceback; answered all the same
                if not logged:
                    logged = True
                    log.exception(
                        "answering request %r at the stop failed (a scheduler bug); it "
                        "and any other such are answered without their bookkeeping",
                        entry.request.request_id,
                        extra=event_extra("scheduler_thread_failed"),
                    )
                self._entries.pop(entry.entry_id, None)
                entry.finished = True
                outcomes.append(self._error_outcome(entry, entry_error))
        return outcomes

    def _finish_ok(self, entry: Entry, ended_s: float) -> Outcome:
        """The answer of `entry`, whose last rows ran in a batch that ended at `ended_s`."""
        chunks = sorted(entry.chunks, key=lambda chunk: chunk[0])
        outputs: dict[str, Array]
        if len(chunks) == 1:
            outputs = chunks[0][1]
        else:
            try:
                outputs = {
                    name: np.concatenate([chunk[name] for _, chunk in chunks])
                    for name in chunks[0][1]
                }
            except ValueError:
                # An output whose size after the rows follows the batch (padded to its
                # longest row, or [N, N]): raised here, it stopped the scheduler, and the
                # server with it, for one request over the cap.
                shapes = {
                    name: [list(chunk[name].shape) for _, chunk in chunks] for name in chunks[0][1]
                }
                return self._finish_error(
                    entry,
                    EngineError(
                        f"the request's {entry.request.rows} rows ran in {len(chunks)} "
                        f"batches (over the batch cap), and the model's outputs for them do "
                        f"not join along the rows: {shapes}; expected outputs whose sizes "
                        f"after the first axis do not depend on the batch, or requests of at "
                        f"most the batch cap's rows (GetModel's batch_cap)"
                    ),
                )
        outcome = Outcome(
            token=entry.request.token,
            request_id=entry.request.request_id,
            outputs=outputs,
            error=None,
            timing=self._timing(entry),
            late=ended_s > entry.deadline_s,
        )
        self.events.completed(self.lanes[entry.priority].name, "OK")
        self._release(entry)
        return outcome

    def _finish_error(self, entry: Entry, error: LaneserveError) -> Outcome:
        assert not entry.finished, "every request is answered exactly once"
        outcome = self._error_outcome(entry, error)
        self.events.completed(
            self.lanes[entry.priority].name,
            error.reason,
            request_id=entry.request.request_id,
            error=error,
        )
        self._release(entry)
        return outcome

    @staticmethod
    def _error_outcome(entry: Entry, error: LaneserveError) -> Outcome:
        return Outcome(
            token=entry.request.token,
            request_id=entry.request.request_id,
            outputs=None,
            error=error,
            timing=None,
        )

    def _release(self, entry: Entry) -> None:
        """Marks `entry` answered, which ends it: the last step of `_finish_ok` and
        `_finish_error`, once its Outcome is made and its event sent. Released first, an
        entry whose Outcome then raised (a bug, or a sink outside `FanOut`) was no longer
        live, and its answer went nowhere: `abort_all` answers only live entries."""
        assert not entry.finished
        # A finished entry holds no queued rows: when one chunk of a split request
        # fails, the chunks still queued must neither run nor hold lane capacity. Marked
        # finished only once they are dropped: a drop that raises leaves it live, for
        # `abort_all` to answer (left in `_entries` marked finished, it tripped there).
        if entry.in_lane:
            self.lanes[entry.priority].drop(entry)
        entry.finished = True
        entry.chunks = []
        del self._entries[entry.entry_id]

    def _timing(self, entry: Entry) -> Timing:
        return Timing(
            lane=self.lanes[entry.priority].name,
            batch_size=entry.last_batch_rows,
            queue_s=entry.queue_s,
            infer_s=entry.infer_s,
        )

    # ---- introspection ---------------------------------------------------------------

    @property
    def live_entries(self) -> int:
        return len(self._entries)

    def depths(self) -> list[LaneDepth]:
        return [
            LaneDepth(lane.name, lane.queued_rows, lane.queued_entries, lane.config.capacity_rows)
            for lane in self.lanes
        ]


__all__ = ["Decision", "Dispatch", "LaneDepth", "Scheduler", "WaitUntil"]
