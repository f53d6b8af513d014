"""Batch formation: which queued rows the next batch takes, and the share and credit
arithmetic that decides it.

`Formation.plan` forms the next batch without changing any state: pass 1 serves the lanes'
minimum shares (deficit round robin, credit banked by lanes shut out), pass 2 fills what
is left top-down. `Scheduler.decide` (scheduler.py) applies the dispatch rule to that plan
and commits it; admission reads the same arithmetic (shares, balances, batch limits, the
owed head) to predict where a request's rows will run. Kept apart from the scheduler so
that how a batch is formed has one home, separate from admission's estimates, shedding
and completion; it holds no state of its own beyond the scheduler's lanes, caps and
run-time models it is handed.

A lane's max_wait is also the longest its requests wait for lower lanes' sake (beyond
the shortest run, one row's, which no batch avoids): rows of lower lanes ride along in
its batch only within it, and while the lane is active (it admitted a request within
ACTIVE_LANE_S) a batch of lower lanes alone holds only what runs within it (or its head
request, unless it is split anyway (over the probed cap), with the minimum shares of the
lanes below on top; or what an owed lane's credit covers), so the session is busy with
bulk work for little longer than an interactive request accepts to wait (see `plan`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from laneserve.server.batch_caps import BatchCaps
from laneserve.server.cost_model import RunTimeModels
from laneserve.server.items import Signature
from laneserve.server.lanes import Entry, Lane

# A lane that admitted a request within this long is active: a batch without its rows
# then runs no longer than its max_wait (see `plan`), so its next request does not
# wait behind a long run of lower lanes.
ACTIVE_LANE_S = 0.1
# Decimal places a lane's share balance is kept to (see `Formation.settle_shares`).
BALANCE_DIGITS = 9
# Entries of other shapes the batch's own lane passes over to gather more of the batch's
# shape (requests of mixed sequence lengths in one lane ran one per batch: each ended the
# turn). Bounds the scan per batch; they keep their place in the lane.
GATHER_SCAN_ENTRIES = 256
# A request split across batches (over the cap) yields each batch's room to the whole
# requests queued behind it in its lane, in FIFO order, but keeps at least this share of
# the batch's cap (see `_Filling.fill`). Taken in order alone, a 512-row interactive
# request held the 1-row requests behind it for four batches (5 % of them refused, and
# a queue-wait p99 of 36 ms where they waited 0.8 alone); the floor bounds what yielding
# costs it (its batches at most about double under a flood of small ones).
SPLIT_FLOOR_SHARE = 0.5


def split_floor(cap: int) -> int:
    """The rows a request being split keeps of a batch of `cap` (SPLIT_FLOOR_SHARE)."""
    return math.ceil(cap * SPLIT_FLOOR_SHARE)


def is_active(lane: Lane, now_s: float) -> bool:
    """Whether `lane` admitted a request within ACTIVE_LANE_S: more is likely on the
    way, and batches of lower lanes keep within its max_wait."""
    return lane.last_admit_s is not None and now_s - lane.last_admit_s < ACTIVE_LANE_S


@dataclasses.dataclass(slots=True)
class Plan:
    # The next batch: (entry, rows) in the order they were taken.
    taken: list[tuple[Entry, int]] = dataclasses.field(default_factory=list)
    # Per lane priority served in pass 1: (allowance, rows taken against it).
    share_used: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # Lanes with a share and credit whose head (of the batch's shape) did not fit the room
    # left (see `owed_head`).
    room_blocked: set[int] = dataclasses.field(default_factory=set)
    # Per blocked lane (by shape or room), the credit it banks up to, in batches (see
    # `plan`, `Lane.share_balance`).
    bank_to: dict[int, float] = dataclasses.field(default_factory=dict)
    # The most rows this batch may hold: the cap, or less where a higher lane is active.
    limit_rows: int = 0
    # The lane whose banked credit covered its head, which goes first (see `owed_head`).
    owed_priority: int | None = None
    # (lane, fill): the lane that leads the batch and the share of the room left it that
    # its whole requests filled, when its next request did not fit (see `Lane.fill_ratio`).
    fill_sample: tuple[int, float] | None = None
    # A queued request of the batch's shape did not fit the room left (or the ride-along
    # budget), or the highest queued work has another shape than an owed batch: waiting
    # for company would hold it back, and nothing that waiting brings goes ahead of it.
    left_out: bool = False


class _Filling:
    """A batch being planned: the entries taken so far and the room left."""

    def __init__(self, signature: Signature, room: int, batch_cap: int) -> None:
        self.signature = signature
        self.room = room
        self.batch_cap = batch_cap
        # entry_id -> (entry, rows taken from it), in the order they were taken.
        self.taken: dict[int, tuple[Entry, int]] = {}
        self.present: set[int] = set()  # priorities of the lanes with rows in the batch
        # Per lane priority, the rows its entries larger than the cap have in the batch
        # (over both passes): together they keep at least SPLIT_FLOOR_SHARE of the cap.
        self.split_rows: dict[int, int] = {}

    def fill(self, lane: Lane, allowance: float, *, gather: bool = False) -> tuple[int, int]:
        """Takes `lane`'s entries in FIFO order up to `allowance` rows (the one crossing
        it whole) while they fit; one that does not fit ends the turn (only entries
        larger than the cap are split), and so does an entry of another shape, unless
        `gather`: then it is passed over (it keeps its place: the batch's lane leads the
        next batch with its oldest entry), up to GATHER_SCAN_ENTRIES of them. Returns the
        rows taken and the rows of the entry the turn ended at for want of room (0: it
        ended for another reason).

        An entry larger than the cap (split across batches; its last chunk too) takes at
        first only what is left of its lane's floor in the batch (SPLIT_FLOOR_SHARE of
        the cap, less what entries of its lane larger than the cap already have in it):
        the whole requests behind it take the room they fit, in order, and it gets what
        they leave when the turn ends, within the allowance. Taking its last chunk whole,
        it held the requests behind it a batch more. Its rows still go in order
        (`Lane.take`), so it is reassembled as before."""
        used = 0
        passed_over = 0
        unfit = 0
        split: list[Entry] = []  # entries larger than the cap, oldest first: they fill last
        floor_rows = split_floor(self.batch_cap)
        for entry in lane:
            if used >= allowance:
                break
            left = entry.queued_rows - self._rows_of(entry)
            if left == 0:
                continue
            if entry.request.signature != self.signature:
                passed_over += 1
                if gather and passed_over <= GATHER_SCAN_ENTRIES:
                    continue
                break
            if entry.request.rows > self.batch_cap and self.room > 0:
                split.append(entry)
                floor_left = floor_rows - self.split_rows.get(lane.priority, 0)
                rows = min(left, self.room, math.ceil(allowance - used), max(floor_left, 0))
            elif left <= self.room:
                rows = left
            else:
                unfit = left
                break
            used += self._take(lane, entry, rows)
        for entry in split:
            if self.room == 0 or used >= allowance:
                break
            left = entry.queued_rows - self._rows_of(entry)
            used += self._take(lane, entry, min(left, self.room, math.ceil(allowance - used)))
        return used, unfit

    def _rows_of(self, entry: Entry) -> int:
        """The rows of `entry` taken so far."""
        return self.taken[entry.entry_id][1] if entry.entry_id in self.taken else 0

    def _take(self, lane: Lane, entry: Entry, rows: int) -> int:
        """Takes `rows` more rows of `lane`'s `entry` (0: none); returns them."""
        if rows == 0:
            return 0
        self.taken[entry.entry_id] = (entry, self._rows_of(entry) + rows)
        self.room -= rows
        self.present.add(lane.priority)
        if entry.request.rows > self.batch_cap:
            self.split_rows[lane.priority] = self.split_rows.get(lane.priority, 0) + rows
        return rows


def _charge_owner(plan: Plan, priority: int, shut_out_rows: float) -> None:
    """The batch is the owed lane's (its shape): it costs the lanes it shuts out the batch
    they would have had (`shut_out_rows`), so it counts against the lane's credit as that
    at least. Charged only its rows, a batch held to a few rows by an active lane's bound
    cost exactly the share the lane banked each batch, and it owned every batch after
    (interactive starved)."""
    allowance, _ = plan.share_used[priority]
    owned = sum(rows for entry, rows in plan.taken if entry.priority == priority)
    # What other lanes' shares took of it they paid for themselves.
    paid = sum(used for other, (_, used) in plan.share_used.items() if other != priority)
    plan.share_used[priority] = (allowance, max(owned, shut_out_rows - paid))


class Formation:
    """What the next batch takes: the two passes over the lanes and the share and credit
    arithmetic they follow, which admission reads too to predict where a request's rows
    will run."""

    def __init__(self, lanes: list[Lane], caps: BatchCaps, run_times: RunTimeModels) -> None:
        # The scheduler's own lanes, caps and run-time models (the same objects, not
        # copies: a deep copy of the scheduler copies this with them). Only the scheduler
        # thread mutates them, under its lock; of them this writes only what
        # `settle_shares` settles on the lanes (share balances, room_blocked).
        self.lanes = lanes
        self.caps = caps
        self._run_times = run_times

    def top_head(self) -> Entry | None:
        """The highest queued work: the head of the highest lane with work (None: none)."""
        return next((head for lane in self.lanes if (head := lane.head()) is not None), None)

    def trim_to_deadline(self, plan: Plan, now_s: float, *, unless_lost: bool = False) -> None:
        """Holds a batch its deadline sends out to the rows predicted to end by the
        earliest deadline among them: the first of that deadline whatever its size, then
        the others of that deadline, then the rest, each in lane then FIFO order, while
        they fit. Rows that came while it waited for that deadline joined it unbounded
        (only lower lanes' riders were bounded), and made the request it waited for late;
        so did rows of the same deadline (40 of a shape not yet run, admitted unpredicted:
        all 40 ran and were late, where the first ones fitted). Rows left out go next, or
        expire in the queue unrun; a lane with a share banks what it did not get.

        With `unless_lost`, for a batch that goes full or for its backlog: held so only
        where the request of that deadline can meet it alone. Under backlog a batch took
        every row that queued during the run before it, however late that made the
        oldest (admission promised each request its place behind the rows ahead of it,
        and the rows after it joined its batch): on a model whose run time grows faster
        than its rows (200 ms a row, 890 ms for four), 22-27 of ~48 answers of four 1-row
        callers with 800 ms deadlines came late, from 3-row batches run as fast as the
        probe had measured. A request that cannot meet its deadline even alone leaves
        the batch whole: held to that one late row, it would only cost the rest their batch."""
        model = self._run_times.get(plan.taken[0][0].request.signature)
        earliest_s = min(entry.deadline_s for entry, _ in plan.taken)
        if (
            unless_lost
            and now_s + model.predict_s(sum(rows for _, rows in plan.taken)) <= earliest_s
        ):
            return  # whole, it ends in time (asked of every full batch: no sort for it)
        ordered = sorted(plan.taken, key=lambda pair: (pair[0].priority, pair[0].entry_id))
        # The request the deadline sent the batch out for goes whatever its place in
        # order (an older one of its lane with a later deadline, a higher lane's, came
        # first, and it was the one left out, to expire in the queue).
        due = [pair for pair in ordered if pair[0].deadline_s == earliest_s]
        rest = [pair for pair in ordered if pair[0].deadline_s != earliest_s]
        if unless_lost and now_s + model.predict_s(due[0][1]) > earliest_s:
            return
        kept = due[:1]
        rows = due[0][1]
        for entry, taken in due[1:] + rest:
            if now_s + model.predict_s(rows + taken) > earliest_s:
                break
            kept.append((entry, taken))
            rows += taken
        if len(kept) == len(ordered):
            return
        plan.taken = kept
        for priority, (allowance, used) in plan.share_used.items():
            kept_rows = sum(taken for entry, taken in kept if entry.priority == priority)
            plan.share_used[priority] = (allowance, min(used, kept_rows))

    def plan(self, now_s: float) -> Plan:
        """The next batch, without changing any state.

        Pass 1 serves the minimum shares as deficit round robin: a lane with work may
        take rows up to its allowance (its share of the cap plus its balance), the entry
        that crosses the allowance whole, and the overdraft is repaid from later
        allowances. So requests stay whole, a share smaller than one request still
        moves, and over k batches a lane gets at least k * share rows (less one request)
        and claims no more than that ahead of higher lanes: a batch whose claims pushed a
        higher lane's next request out belongs to the lowest claimant, charged for all
        its rows (`_fill_top_down`), and a lane whose head finds no room banks credit up
        to that head and then goes first (`owed_head`). Pass 2 fills what is left
        top-down. Within a lane order is FIFO: the first whole entry that does not fit
        ends that lane's turn. Only entries with more rows than the cap are split, and
        one being split yields: it takes at first only its floor (SPLIT_FLOOR_SHARE of
        the cap), the whole entries behind it take the room they fit, in order, and it
        gets what they leave (`_Filling.fill`). Rows batch together only when their
        signatures are equal: an entry of another shape ends its lane's turn too, except
        in the lane that leads the batch (see `_fill_top_down`).

        Lower lanes ride along only within the time the batch's highest lane accepts:
        once that lane is in, rows of the lanes below fill the batch (beyond their
        minimum shares) only up to what is expected to run within its max_wait beyond
        the shortest run (or its own rows' run time, if longer). An interactive request
        waits for company at most its max_wait; padding its batch with bulk rows would
        make it wait longer in the session instead.

        The same bound holds for a lane that is active (it admitted a request within
        ACTIVE_LANE_S) but has nothing queued: a batch of lower lanes then holds only what
        is expected to run within that lane's max_wait beyond the shortest run (at least
        one whole request, unless it is split anyway: over the probed cap; and what a lane
        owed a batch of its shape banked for, `owed_head`), since its next request would
        wait for the whole run.
        """
        plan = Plan()
        # The batch takes the shape of the highest-priority queued work, fixed before
        # pass 1: a lower lane's share must never shut a higher lane's differently
        # shaped work out of every batch. Unless a lane with a share has banked a batch
        # of its own shape (`owed_head`): its shape never fitted the batches it was
        # owed rows in.
        top = self.top_head()
        if top is None:
            return plan
        owed = self.owed_head(top)
        first = owed or top
        plan.owed_priority = None if owed is None else owed.priority
        if owed is None:
            limit = self.limit_rows(now_s, top)
        else:
            # What its credit covers: its head whole, or a batch of it (split or not).
            owed_rows = min(owed.queued_rows, self.caps.rows(owed.request.signature))
            if owed.request.signature == top.request.signature:
                # Owed for want of room: the batch is sized for the highest work as
                # usual, and holds the owed head whole.
                limit = max(self.limit_rows(now_s, top), owed_rows)
            else:
                # Owed a batch of its shape. Held to what an active lane allows a head
                # that is split (`whole_rows`), a head over the cap ran a few rows for
                # the batch of credit it banked, and its lane got about half its share.
                limit = self._batch_limit(now_s, owed.priority, owed.request.signature, owed_rows)
        plan.limit_rows = limit
        signature = first.request.signature
        batch = _Filling(signature, limit, self.caps.rows(signature))

        share_lanes = [
            lane for lane in self.lanes if lane.config.min_share > 0 and lane.queued_rows
        ]
        if owed is not None:  # the owed lane's claim comes first
            share_lanes.sort(key=lambda lane: lane.priority != owed.priority)
        for lane in share_lanes:
            allowance = self._allowance(lane, signature)
            # An owed head goes first, alone: the rest of its lane's allowance must not
            # push the top lane's rows out of the batch raised for that head.
            take = (
                min(allowance, owed.queued_rows)
                if owed is not None and owed.priority == lane.priority
                else allowance
            )
            used, unfit = batch.fill(lane, take)
            plan.left_out = plan.left_out or unfit > 0
            plan.share_used[lane.priority] = (allowance, used)
            head = lane.head()
            assert head is not None
            # Blocked lanes bank credit up to their head, and the share that may cross
            # it: none is lost between the batch its credit first covers the head and
            # the one it runs (see `owed_head`). Room an owed head took makes nobody
            # owed in turn (each owed batch made the next lane owed: a chain).
            if head.request.signature != batch.signature:
                plan.bank_to[lane.priority] = self._bank_target(
                    lane, head.queued_rows, head.request.signature
                )
            elif unfit:
                plan.bank_to[lane.priority] = self._bank_target(lane, unfit, signature)
                if owed is None:
                    plan.room_blocked.add(lane.priority)
        shape_owner = None if first.request.signature == top.request.signature else first.priority
        # The lane whose head set the shape gathers: the top's, unless an owed lane's head
        # of another shape set it (an owed head of the top's shape rides in the top's
        # batch: gathering there, it took ride-along room beyond its share, uncharged).
        leader = top.priority if shape_owner is None else shape_owner
        self._fill_top_down(plan, batch, shape_owner, leader, now_s)
        plan.taken = list(batch.taken.values())
        if shape_owner is not None:
            # What it shut out, in rows of this batch: a batch of the top's, at that cap.
            top_cap = self.caps.rows(top.request.signature)
            shut_out = self.limit_rows(now_s, top) * batch.batch_cap / top_cap
            _charge_owner(plan, first.priority, shut_out)
            # The highest queued work is left out of it too (another shape): waiting for
            # company would hold it back, and it leads the next batch (unless another lane
            # is owed one). Led by the owed lane's max_wait, a batch of bulk's shape waited
            # 20 ms (its default max_wait) with the session free while an interactive
            # request expired in the queue.
            plan.left_out = True
        return plan

    def _fill_top_down(
        self, plan: Plan, batch: _Filling, owner: int | None, leader: int, now_s: float
    ) -> None:
        """Pass 2: fills what pass 1 left, lane by lane from the top, lanes below the
        batch's highest within its ride-along budget. The lane whose head set the batch's
        shape (`leader`) gathers its entries of that shape past those of other shapes:
        its head leads every batch it is in, so none waits more than a batch for them.
        Other lanes stay in order (a lane's head of another shape ends its turn): rows
        behind it riding along would take the share it banks for it.

        Rows lower lanes claimed in pass 1 can push a higher lane's next request out of
        the batch (it would fit without them). The batch then belongs to the lowest lane
        that claimed (its claim tipped it): that lane fills the room next, ahead of the
        lanes between, and every row it takes counts against its share, as in a batch
        owed to its shape. Else lower lanes would fill, uncharged, the room a claim took
        from a higher lane's request: a lane whose share crosses into a large higher
        request took most of every batch (a priority inversion).

        A batch of `owner`'s shape (its banked credit covered a batch of its own) is its
        from the start: it fills first, charged; else lanes of the same shape filled the
        batch it paid for, and a lane of another shape got a row per owed batch.

        A lane riding along whose next request does not fit the room left (claims aside)
        ends the fill: the lanes below it keep what pass 1 gave them, and get no more. The
        session time their rows would add comes out of that lane's next batch: bulk rows
        filling the ride-along room a 20-row standard request did not fit took a fifth of
        standard's rows while standard was saturated. The batch's highest lane's own
        leftover room stays open: its max_wait accepts lower lanes' rows."""
        claims_below = sum(used for _, used in plan.share_used.values())
        order = list(self.lanes)
        if owner is not None:
            order.insert(0, order.pop(owner))
        lead_seen = False
        for position, lane in enumerate(order):  # `order` may change ahead of `position`
            claims_below -= plan.share_used.get(lane.priority, (0, 0))[1]
            used, unfit = batch.fill(lane, batch.batch_cap, gather=lane.priority == leader)
            # Only a request of the batch's highest lane or above: waiting could bring
            # nothing that goes ahead of it. A lower lane's rider that does not fit the
            # room left leaves room for the requests waiting would bring ahead of it (it
            # sent a lone interactive row at once, as FULL, while bulk was queued).
            plan.left_out = plan.left_out or (unfit > 0 and not lead_seen)
            if lane.priority == owner:
                allowance, claimed = plan.share_used[lane.priority]
                plan.share_used[lane.priority] = (allowance, claimed + used)
            if owner is None and unfit and unfit <= batch.room + claims_below:
                owner = max(
                    priority
                    for priority, (_, claimed) in plan.share_used.items()
                    if priority > lane.priority and claimed > 0
                )
                owner_lane = self.lanes[owner]
                order.remove(owner_lane)
                order.insert(position + 1, owner_lane)
            elif unfit and lead_seen and lane.priority != owner:
                batch.room = 0
            if not lead_seen and lane.priority in batch.present:
                lead_seen = True  # the batch's highest lane: budget the lanes below it
                rows = plan.limit_rows - batch.room
                room = plan.limit_rows - claims_below
                if unfit and owner is None and room > 0:
                    plan.fill_sample = (lane.priority, (rows - claims_below) / room)
                budget_rows = max(rows, self._ride_along_rows(lane, batch, now_s))
                batch.room = min(batch.room, budget_rows - rows)

    def owed_head(self, top: Entry) -> Entry | None:
        """The head of a lane with a share whose credit covers that head (or a whole
        batch) after it banked its share for batches it could not join: its head had
        another shape than `top` (the highest queued work), or found no room. Of several,
        the one owed the most batches of its own share. The head then goes first, and of
        another shape it sets the batch's shape. Deficit round robin across shapes and
        request sizes: such a lane banks its share every batch it cannot join, up to its
        head or a batch."""
        covered = ((lane, self._covered_head(lane)) for lane in self.lanes)
        owed = [
            (lane, head)
            for lane, head in covered
            if head is not None
            and (lane.room_blocked or head.request.signature != top.request.signature)
        ]
        if not owed:
            return None
        # The lane owed the most batches of its own share goes first (then the highest).
        # The highest first, a lane owed more than whole requests can give it (a share of
        # 0.7, 40-row requests at a cap of 64: one a batch) was owed after every batch,
        # and a lane below with a share of 0.2 and 40-row requests got no row at all (a
        # grid of shares and sizes). Owed the most of its share, a small share's lane
        # goes once its credit covers its head: it gets most of its share (77 % there),
        # and a large one what is left.
        _, head = min(
            owed,
            key=lambda owed_head: (
                -owed_head[0].share_balance / owed_head[0].config.min_share,
                owed_head[0].priority,
            ),
        )
        return head

    def _covered_head(self, lane: Lane) -> Entry | None:
        """`lane`'s head where the lane has a share and credit that covers that head (or a
        whole batch of its shape); else None."""
        if lane.config.min_share == 0 or lane.queued_rows == 0:
            return None
        head = lane.head()
        assert head is not None
        signature = head.request.signature
        covers = self.balance_rows(lane, signature) >= min(
            head.queued_rows, self.caps.rows(signature)
        )
        return head if covers else None

    def limit_rows(self, now_s: float, first: Entry) -> int:
        return self._batch_limit(
            now_s, first.priority, first.request.signature, self.whole_rows(first)
        )

    def whole_rows(self, entry: Entry) -> int:
        """The rows of `entry` a batch must hold whole for it to move (see
        `_batch_limit`): all it has queued, or none for a request larger than the probed
        cap, which is split whatever the room and the cap (`_Filling.fill`; what is left
        of it too). Counted whole, such a bulk request lifted an active lane's limit to
        the cap: full bulk batches ran ahead of its next request (simulated, interactive's
        queue-wait p99 6.8 ms where the bound kept it at 2.5). One over a cap that out of
        memory lowered is split only until the cap recovers, which takes full batches of
        it: held to the bound too, none was full, and the cap stayed low while
        interactive was active."""
        if entry.request.rows > self.caps.max_rows:
            return 0
        return entry.queued_rows

    def _batch_limit(
        self, now_s: float, priority: int, signature: Signature, head_rows: int
    ) -> int:
        """The most rows of a batch whose first work (the highest queued) is a head of
        `head_rows` rows of `signature` in lane `priority`: the batch cap, or the rows
        expected to run within the max_wait of the highest active lane above it, never
        below what pass 1 claims: the head (or its lane's share, if larger; `head_rows`
        is 0 for a head that is split anyway, `whole_rows`) and the minimum shares of
        the lanes below it. Those shares are claims ahead of higher lanes, so they come
        on top of the head's rows, not out of them (else a head as large as the limit
        never fits once a lower lane took its share, and the lower lanes fill every
        batch: a priority inversion)."""
        (limit,) = self.batch_limits(now_s, [(priority, signature, head_rows)])
        return limit

    def batch_limits(self, now_s: float, firsts: Sequence[tuple[int, Signature, int]]) -> list[int]:
        """`_batch_limit` of each (priority, signature, head_rows) of `firsts`, in
        O(lanes) per signature among them: the highest active lane is found once, and
        each signature's share takes are summed once, from the bottom lane up to the
        highest lane asked. Admission asks the limit of the head of every lane at or
        above its request's: summed lane by lane, each over the lanes below, 64 lanes
        took 2.2 ms an admission (3 lanes 43 us)."""
        active = next((lane for lane in self.lanes if is_active(lane, now_s)), None)
        # Per signature, the highest lane asked below the active lane (else its limit is
        # the cap), and the share takes of it and the lanes below, summed from the bottom:
        # takes[signature][k] is the sum over lanes[top + k :].
        tops: dict[Signature, int] = {}
        for priority, signature, _ in firsts:
            if active is not None and active.priority < priority:
                tops[signature] = min(priority, tops.get(signature, priority))
        takes: dict[Signature, list[int]] = {}
        for signature, top in tops.items():
            sums = [0] * (len(self.lanes) - top + 1)
            for k in reversed(range(len(sums) - 1)):
                sums[k] = sums[k + 1] + self.share_take_rows(self.lanes[top + k], signature)
            takes[signature] = sums
        limits = []
        for priority, signature, head_rows in firsts:
            cap = self.caps.rows(signature)
            if active is None or active.priority >= priority:
                limits.append(cap)
                continue
            sums, top = takes[signature], tops[signature]
            shares = sums[priority - top + 1]  # the lanes below
            own = sums[priority - top] - shares
            limits.append(
                max(
                    self.rows_within_wait(active, signature),
                    min(max(head_rows, own) + shares, cap),
                )
            )
        return limits

    def _ride_along_rows(self, lead: Lane, batch: _Filling, now_s: float) -> int:
        """The most rows `batch`, led by `lead`, may hold with lower lanes riding along:
        what runs within `lead`'s max_wait (`rows_within_wait`), and, starting now, by
        the earliest deadline of the rows it holds so far: riders must not make those
        late (within the max_wait budget alone, an interactive request admitted for a
        1-row run ran beside 7 bulk rows and was answered after its deadline)."""
        within_wait = self.rows_within_wait(lead, batch.signature)
        model = self._run_times.get(batch.signature)
        left_s = min(entry.deadline_s for entry, _ in batch.taken.values()) - now_s
        if model.predict_s(within_wait) <= left_s:
            return within_wait  # the deadline does not bind (no search, nothing memoized)
        return model.rows_within_s(left_s, within_wait)

    def rows_within_wait(self, lane: Lane, signature: Signature) -> int:
        """Rows expected to run within `lane`'s max_wait beyond the shortest run (one
        row's): how much lower lanes' work may keep it waiting (in its batch, or ahead of
        its next request) beyond the run no batch is shorter than. Counted from zero, a
        model whose one row takes longer than the max_wait (a GPU's fixed cost) held
        every batch of lower lanes to a row while the lane was active."""
        model = self._run_times.get(signature)
        return model.rows_within_s(lane.max_wait_s + model.predict_s(1), self.caps.rows(signature))

    def share_take_rows(self, lane: Lane, signature: Signature) -> int:
        """The rows pass 1 is expected to give `lane` for its share in a batch of
        `signature`: its share (credit it banked does not lift an active lane's limit: a
        lane owed more goes first, `owed_head`) rounded up to whole rows (pass 1 takes
        the row that crosses it), or its head request whole when that crosses it by less
        than one more share (a larger request is not counted: one would raise the limit
        to the cap); none when it is in debt or its head has another shape (it cannot
        join)."""
        if lane.config.min_share == 0 or lane.queued_rows == 0:
            return 0
        allowance = self._allowance(lane, signature)
        head = lane.head()
        assert head is not None
        if allowance <= 0 or head.request.signature != signature:
            return 0
        share = self.share_rows(lane, signature)
        take = min(allowance, share)
        head_rows = head.queued_rows
        return head_rows if take < head_rows <= take + share else math.ceil(take)

    def _bank_target(self, lane: Lane, head_rows: int, signature: Signature) -> float:
        """Credit a blocked lane banks up to, in batches (see `Lane.share_balance`): its
        head (at most a batch) and the share that may cross it (its balance is below the
        head before a batch's share comes in, so it never exceeds this: none is lost).
        `signature`: the head's."""
        cap = self.caps.rows(signature)
        return min(head_rows, cap) / cap + lane.config.min_share

    def _allowance(self, lane: Lane, signature: Signature) -> float:
        """Rows `lane` may take in pass 1 of a batch of `signature`: its share and its
        balance."""
        return self.share_rows(lane, signature) + self.balance_rows(lane, signature)

    def balance_rows(self, lane: Lane, signature: Signature) -> float:
        """`lane`'s share balance in rows of `signature`, at its cap (rounded as balances
        are, so that ten shares of 0.1 still cover a row)."""
        return round(lane.share_balance * self.caps.rows(signature), BALANCE_DIGITS)

    def share_rows(self, lane: Lane, signature: Signature) -> float:
        """The lane's share of one batch, in rows, unrounded: a share under one row (a
        small cap) is one row every few batches, not one in each. Rounded up per batch,
        the default shares took every row at a cap of 2 (interactive starved). A batch is
        of `signature` (the batch the share is taken in, or the head it banks for), at
        that signature's cap."""
        return lane.config.min_share * self.caps.rows(signature)

    def settle_shares(self, plan: Plan) -> list[int]:
        """Settles the share balances of the lanes for the batch `plan` formed (see
        `owed_head`): unused allowance banked, an overdraft owed back. Returns the rows
        each lane has in the batch, by priority."""
        signature = plan.taken[0][0].request.signature
        cap = self.caps.rows(signature)
        served = [0] * len(self.lanes)
        for entry, rows in plan.taken:
            served[entry.priority] += rows
        for lane in self.lanes:
            lane.room_blocked = lane.priority in plan.room_blocked
            if lane.priority in plan.share_used:
                allowance, used = plan.share_used[lane.priority]
                # Unused allowance is banked up to one share, up to a batch while the
                # lane's shape is shut out and up to its head while that finds no room
                # (see `owed_head`), and credit banked so is kept while the lane gets
                # nothing; an overdraft is repaid from the next allowances.
                share = self.share_rows(lane, signature)
                banked = max(share, plan.bank_to.get(lane.priority, 0) * cap)
                if used == 0:
                    banked = max(banked, self.balance_rows(lane, signature))
                if lane.priority == plan.owed_priority:
                    # What its credit held beyond the head it ran (less than a share,
                    # with this batch's share under two) is kept: a share that does not
                    # divide the head evenly lost the overshoot every time.
                    banked = max(banked, min(allowance - used, 2 * share))
                # Rounded so that sums of fractional shares do not drift below a whole
                # request (ten shares of 0.1 must cover a row). Debt is bounded by a
                # batch: a lane charged for a batch it owned (or more, while in debt) is
                # never shut out for longer than a batch's worth of its shares.
                # Rounded in rows, then kept unrounded in batches: read back at the same cap
                # (`balance_rows`) it is those rows again. Rounded in batches at a cap such
                # as 7, the error grew by 1.4e-10 rows a batch, and ties broke.
                balance = round(min(allowance - used, banked), BALANCE_DIGITS)
                if served[lane.priority] - used >= share:
                    # Pass 2 gave it its share on top of its claims (room the lanes above
                    # left): it is owed nothing for this batch, and its claims are still
                    # owed back. Banked, a lane that got every row through pass 2 earned
                    # its share each batch, and every ~20 batches claimed a whole head
                    # ahead of a queued interactive row (whose p99 doubled, simulated).
                    # Under saturation pass 2 leaves it less: shares are as before.
                    balance = round(min(allowance - share - used, 0.0), BALANCE_DIGITS)
                lane.share_balance = max(balance / cap, -1.0)
            else:
                # An idle lane banks nothing, but still owes what it took ahead of higher
                # lanes: a lane whose next request always came after the next batch was
                # formed (a closed-loop caller) had its debt forgiven every time and took
                # twice its share.
                lane.share_balance = min(lane.share_balance, 0.0)
        return served
