"""Seeded simulation of admission: what `Scheduler` promises, and what it then delivers.

    .venv/bin/python scripts/simulate_admission.py                  # one shape, 3 seeds
    .venv/bin/python scripts/simulate_admission.py --shapes two --bulk-deadline-ms 100,1000
    .venv/bin/python scripts/simulate_admission.py --counterfactual # + refusals it got wrong
    .venv/bin/python scripts/simulate_admission.py --retries 4 --lane-rows 64,128,1024 --burst 8

The scheduler alone, no server, session or clock: a discrete-event loop drives it as the
scheduler thread does (admit each arrival when its time comes, shed, dispatch when the
session is free, complete each batch when its run ends), on simulated time. So a run is
deterministic: the same arguments print the same figures on any machine, however busy.

Traffic: Poisson arrivals for one second into the default lanes, at each of `--loads` times
300/s interactive (1-2 rows, 10-50 ms deadlines), 600/s standard (1-8 rows, 20-200 ms)
and 100/s bulk (8-100 rows, `--bulk-deadline-ms`). Rows are 2 wide, or 2 or 8 at random
(`--shapes two`). A batch of r 2-wide rows runs for exactly 1 ms + 3 ms * (r-1)/63 (for
r up to 64; proportionally beyond), and r rows of width w as long as r * w/2 2-wide rows
(its elements): the scheduler is told the 2-wide time and learns the other from the
batches it completes. At load 1.0 one shape keeps the session about 85 % busy.

Per load and lane it prints the requests admitted and how they ended (ok: answered by
the deadline; late: answered after it; expired: shed in the queue) and those refused
as unable to meet their deadline (unmeetable) or for want of room (full). With
`--counterfactual`, each unmeetable refusal is replayed in a copy of the simulation that
admits the request anyway, with the same arrivals after it, up to its deadline: `wrong`
counts those that would have been answered by their deadline while every other request
answered in the replay that met its deadline without it still did (slow: one copy per
refusal; a request it would have pushed past its deadline later is not seen).

With `--retries N`, a request refused LANE_FULL comes back exactly its pushback later
(its `grpc-retry-pushback-ms`, whole ms: what gRPC's built-in retry and clients that
follow RetryInfo wait, with no jitter), up to N times, while that is before its deadline.
Each load then runs twice on the same arrivals, with the hint of each refusal counted at
its own rows alone (`old`, `Scheduler(spread_pushback=False)`) and counting the rows
promised to the callers refused before it (`new`, the server's rule), and prints, summed
over the seeds: the requests answered by their deadline (goodput), the LANE_FULL
refusals (retries refused again among them), the retries, the most retries arriving
within 1 ms (the largest of any seed), and the requests whose last attempt was refused
LANE_FULL. `--lane-rows` sets the lanes' capacities (the defaults hold more than their
deadlines let admission fill: they refuse DEADLINE_UNMEETABLE first), and `--burst K`
brings requests K at a time, at the same instant (a caller fanning out, or callers
answered by one batch asking again together), at the same load. It takes no
`--counterfactual`: its table has no column for wrong refusals, and the replays are slow.

It also checks that every admitted request was answered exactly once, and exits 1 if
not. This is a measurement, not a test: nothing here asserts a rate.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import heapq
import math
import random
import sys
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from laneserve.server.config import DEFAULT_LANES, LaneConfig
from laneserve.server.cost_model import RunTimeModel
from laneserve.server.errors import LaneFullError, LaneserveError, pushback_ms
from laneserve.server.items import Batch, BatchResult, InferenceRequest, Outcome, Signature
from laneserve.server.scheduler import Dispatch, Scheduler, WaitUntil

BATCH_CAP = 64
# The true 2-wide run time, rows -> seconds (other widths scale it); the scheduler is
# told it, in a model of its own (it learns from what it completes).
RUN_TIME_POINTS = {1: 0.001, BATCH_CAP: 0.004}
BASE_WIDTH = 2
LANE_ORDER = ("interactive", "standard", "bulk")
COLUMNS = ("admitted", "ok", "late", "expired", "unmeetable", "wrong", "full")
RETRY_COLUMNS = ("goodput", "full", "refull", "retries", "max/1ms", "gave_up")


@dataclasses.dataclass(frozen=True)
class Arrival:
    at_s: float
    index: int
    lane: str
    rows: int
    width: int
    deadline_s: float
    attempt: int = 0  # 0: the request's first; n: its n-th retry


@dataclasses.dataclass
class RetryCounts:
    """What one run's LANE_FULL refusals and retries came to (see `--retries`)."""

    full: int = 0  # LANE_FULL refusals, retries' included
    refull: int = 0  # of them, refusals of a retry
    retries: int = 0  # retries that arrived
    max_in_1ms: int = 0  # the most retries that arrived within 1 ms


def most_within(times_s: Sequence[float], window_s: float) -> int:
    """The most of `times_s` (sorted) that fall within any `window_s` (from one of them)."""
    most = start = 0
    for end, at_s in enumerate(times_s):
        while at_s - times_s[start] >= window_s:
            start += 1
        most = max(most, end - start + 1)
    return most


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One lane's arrivals: the rate at load 1.0 and how each request is drawn."""

    lane: str
    rate_per_s: float
    rows: tuple[int, int]  # inclusive range
    budget_s: tuple[float, float]  # deadline after arrival, uniform in this range


class _Scheduler(Scheduler):
    """The scheduler, with a switch that admits one request past its admission check
    (for the counterfactual replay of a refusal: nothing else changes)."""

    forcing = False

    def _check_admission(self, *args: object, **kwargs: object) -> None:
        if not self.forcing:
            super()._check_admission(*args, **kwargs)  # type: ignore[arg-type]


class Simulation:
    def __init__(
        self, lanes: Sequence[LaneConfig], *, retries: int = 0, spread_pushback: bool = True
    ) -> None:
        """`retries`: the most times a request refused LANE_FULL comes back, each exactly
        its pushback later; `spread_pushback`: the scheduler's rule for that pushback."""
        self.scheduler = _Scheduler(
            lanes,
            batch_cap=BATCH_CAP,
            run_time=RunTimeModel(RUN_TIME_POINTS),
            run_time_signature=((BASE_WIDTH,),),
            spread_pushback=spread_pushback,
        )
        self.retries = retries
        # Retries due: (at_s, order pushed, arrival), the earliest first.
        self.retry_queue: list[tuple[float, int, Arrival]] = []
        self.retry_counts = RetryCounts()
        self.retry_at_s: list[float] = []  # when each retry arrived, in order
        self._true_times = {BASE_WIDTH: RunTimeModel(RUN_TIME_POINTS)}
        self.now_s = 0.0
        self.free_s = -math.inf  # when the session last became free
        self.running: tuple[Batch, float] | None = None  # the batch and when it ends
        self.wake_s = math.inf
        self.busy_s = 0.0
        # Per arrival index: its status (admitted or the refusal's reason), its deadline
        # once admitted, and how it was answered.
        self.status: dict[int, str] = {}
        self.deadline_s: dict[int, float] = {}
        self.answers: dict[int, tuple[float, str]] = {}
        self.errors: list[str] = []

    def true_run_s(self, signature: Signature, rows: int) -> float:
        width = signature[0][0]
        if width not in self._true_times:
            base = self._true_times[BASE_WIDTH]
            self._true_times[width] = base.scaled(width / BASE_WIDTH)
        return self._true_times[width].predict_s(rows)

    def record(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            index = outcome.token
            assert isinstance(index, int)
            if index in self.answers:
                self.errors.append(f"request {index} was answered twice")
            reason = "OK" if outcome.error is None else outcome.error.reason
            self.answers[index] = (self.now_s, reason)

    def admit(self, arrival: Arrival) -> bool:
        inputs = {"x": np.zeros((arrival.rows, arrival.width), dtype=np.float32)}
        request = InferenceRequest(
            request_id=f"r{arrival.index}",
            lane=arrival.lane,
            inputs=inputs,
            rows=arrival.rows,
            signature=((arrival.width,),),
            deadline_s=arrival.deadline_s,
            token=arrival.index,
        )
        if arrival.attempt:
            self.retry_counts.retries += 1
            self.retry_at_s.append(self.now_s)
        try:
            self.scheduler.admit(request, self.now_s)
        except LaneserveError as error:
            self.status[arrival.index] = error.reason
            if isinstance(error, LaneFullError):
                self._retry_later(arrival, error)
            return False
        self.status[arrival.index] = "ADMITTED"
        config = self.scheduler.lane(arrival.lane).config
        self.deadline_s[arrival.index] = config.deadline_s(self.now_s, arrival.deadline_s)
        return True

    def _retry_later(self, arrival: Arrival, error: LaneFullError) -> None:
        """Counts the refusal; queues its retry exactly the pushback later, as gRPC's
        retry does, unless the retries are spent or its deadline comes first."""
        self.retry_counts.full += 1
        self.retry_counts.refull += arrival.attempt > 0
        delay_ms = pushback_ms(error)
        if arrival.attempt >= self.retries or delay_ms is None:
            return
        at_s = self.now_s + delay_ms / 1000
        if at_s < arrival.deadline_s:
            retry = dataclasses.replace(arrival, at_s=at_s, attempt=arrival.attempt + 1)
            heapq.heappush(self.retry_queue, (at_s, self.retry_counts.full, retry))

    def _step(self) -> None:
        """What the scheduler thread does at `now_s`: shed, then dispatch if free."""
        self.record(self.scheduler.shed_expired(self.now_s))
        if self.running is not None:
            return
        decision = self.scheduler.decide(self.now_s, self.free_s)
        self.wake_s = math.inf
        if isinstance(decision, Dispatch):
            batch = decision.batch
            run_s = self.true_run_s(batch.signature, batch.rows)
            self.running = (batch, self.now_s + run_s)
            self.busy_s += run_s
        elif isinstance(decision, WaitUntil):
            self.wake_s = max(decision.at_s, self.now_s)

    def _complete(self) -> None:
        assert self.running is not None
        batch, _ = self.running
        outputs = {"y": np.concatenate(batch.parts["x"])}
        self.running = None
        self.free_s = self.now_s
        run_s = self.true_run_s(batch.signature, batch.rows)
        self.record(self.scheduler.complete(BatchResult(batch, outputs, None, run_s)))

    def run(
        self,
        arrivals: Sequence[Arrival],
        *,
        until_s: float = math.inf,
        on_refusal: Callable[[Simulation, Arrival, Sequence[Arrival]], None] | None = None,
    ) -> None:
        """Runs until nothing is left to happen (or past `until_s`); `on_refusal` sees
        each refused arrival and the arrivals after it."""
        next_arrival = 0
        while True:
            end_s = self.running[1] if self.running is not None else math.inf
            deadline_s = self.scheduler.next_deadline_s()
            at_s = min(
                arrivals[next_arrival].at_s if next_arrival < len(arrivals) else math.inf,
                self.retry_queue[0][0] if self.retry_queue else math.inf,
                end_s,
                self.wake_s,
                math.inf if deadline_s is None else deadline_s,
            )
            if at_s == math.inf or at_s > until_s:
                return
            self.now_s = max(self.now_s, at_s)
            if self.running is not None and end_s <= self.now_s:
                self._complete()
            while next_arrival < len(arrivals) and arrivals[next_arrival].at_s <= self.now_s:
                arrival = arrivals[next_arrival]
                next_arrival += 1
                if not self.admit(arrival) and on_refusal is not None:
                    on_refusal(self, arrival, arrivals[next_arrival:])
            while self.retry_queue and self.retry_queue[0][0] <= self.now_s:
                _, _, retry = heapq.heappop(self.retry_queue)
                if not self.admit(retry) and on_refusal is not None:
                    on_refusal(self, retry, arrivals[next_arrival:])
            self._step()


class WrongRefusals:
    """Replays each unmeetable refusal admitted anyway, up to its deadline. The refusal
    was wrong if the request would have been answered by then, and no other request
    the replay answered missed a deadline that, without it, it met (`wrong`, once the
    simulation has ended: the others' outcomes are known only then)."""

    def __init__(self) -> None:
        # Per refusal that the replay answered in time: the others the replay saw miss.
        self._met: dict[int, set[int]] = {}

    def __call__(self, simulation: Simulation, arrival: Arrival, rest: Sequence[Arrival]) -> None:
        if simulation.status[arrival.index] != "DEADLINE_UNMEETABLE":
            return
        replay = copy.deepcopy(simulation)
        replay.scheduler.forcing = True
        admitted = replay.admit(arrival)
        replay.scheduler.forcing = False
        assert admitted, "a forced admission was refused"
        deadline_s = replay.deadline_s[arrival.index]
        replay.run(rest, until_s=deadline_s + 0.001)
        if _met(replay, arrival.index):
            self._met[arrival.index] = {
                index
                for index in replay.answers
                if index != arrival.index and not _met(replay, index)
            }

    def wrong(self, simulation: Simulation) -> set[int]:
        return {
            index
            for index, missed in self._met.items()
            if not any(_met(simulation, other) for other in missed)
        }


def _met(simulation: Simulation, index: int) -> bool:
    """Whether request `index` was answered by its deadline."""
    answer = simulation.answers.get(index)
    return answer is not None and answer[1] == "OK" and answer[0] <= simulation.deadline_s[index]


def draw(
    seed: int, load: float, traffic: Sequence[Traffic], widths: Sequence[int], burst: int = 1
) -> list[Arrival]:
    """Poisson arrivals for one second, `burst` requests at each (at the same load)."""
    rng = random.Random(seed)  # noqa: S311 (seeded on purpose: the runs are reproducible)
    drawn: list[tuple[float, str, int, int, float]] = []
    for lane in traffic:
        at_s = 0.0
        while True:
            at_s += rng.expovariate(lane.rate_per_s * load / burst)
            if at_s >= 1.0:
                break
            for _ in range(burst):
                rows = rng.randint(*lane.rows)
                width = rng.choice(widths)
                drawn.append((at_s, lane.lane, rows, width, at_s + rng.uniform(*lane.budget_s)))
    drawn.sort()
    return [
        Arrival(at_s, index, lane, rows, width, deadline_s)
        for index, (at_s, lane, rows, width, deadline_s) in enumerate(drawn)
    ]


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every run of one invocation shares."""

    traffic: Sequence[Traffic]
    widths: Sequence[int]
    lanes: Sequence[LaneConfig]
    counterfactual: bool = False
    burst: int = 1
    retries: int = 0


def simulate(
    seed: int, load: float, setup: Setup, *, spread_pushback: bool = True
) -> tuple[dict[str, Counter[str]], float, list[str], RetryCounts]:
    """Per lane, the counts of `COLUMNS`; the session's busy fraction; what broke the
    exactly-once rule; and the LANE_FULL refusals and retries."""
    counterfactual = setup.counterfactual
    arrivals = draw(seed, load, setup.traffic, setup.widths, setup.burst)
    simulation = Simulation(setup.lanes, retries=setup.retries, spread_pushback=spread_pushback)
    refusals = WrongRefusals()
    simulation.run(arrivals, on_refusal=refusals if counterfactual else None)
    counts: dict[str, Counter[str]] = {lane: Counter() for lane in LANE_ORDER}
    wrong = refusals.wrong(simulation)
    errors = list(simulation.errors)
    for arrival in arrivals:
        count = counts[arrival.lane]
        status = simulation.status[arrival.index]
        answer = simulation.answers.get(arrival.index)
        if status != "ADMITTED":
            count["unmeetable" if status == "DEADLINE_UNMEETABLE" else "full"] += 1
            count["wrong"] += arrival.index in wrong
            if answer is not None:
                errors.append(f"request {arrival.index} was refused and answered")
            continue
        count["admitted"] += 1
        if answer is None:
            errors.append(f"request {arrival.index} was admitted and never answered")
        elif answer[1] == "EXPIRED_IN_QUEUE":
            count["expired"] += 1
        elif answer[1] != "OK":
            errors.append(f"request {arrival.index} failed: {answer[1]}")
        else:
            count["ok" if answer[0] <= simulation.deadline_s[arrival.index] else "late"] += 1
    retried = simulation.retry_counts
    retried.max_in_1ms = most_within(simulation.retry_at_s, 0.001)
    return counts, simulation.busy_s / max(simulation.now_s, 1e-9), errors, retried


def _pair(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    try:
        pair = (float(low), float(high))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LOW,HIGH in milliseconds, got {text!r}"
        ) from None
    if not 0 < pair[0] <= pair[1] < math.inf:
        raise argparse.ArgumentTypeError(f"expected finite 0 < LOW <= HIGH, got {text!r}")
    return pair


def _seeds(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _loads(text: str) -> list[float]:
    """Positive and finite: arrivals are drawn until one second has passed, which a load
    of 0, below 0, NaN or infinity never reaches."""
    try:
        loads = [float(part) for part in text.split(",")]
    except ValueError:
        loads = []
    if not loads or not all(0 < load < math.inf for load in loads):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive finite numbers, got {text!r}"
        )
    return loads


def _count(text: str, least: int) -> int:
    try:
        count = int(text)
    except ValueError:
        count = least - 1
    if count < least:
        raise argparse.ArgumentTypeError(f"expected an integer of at least {least}, got {text!r}")
    return count


def _lane_rows(text: str) -> list[int]:
    """One capacity per default lane, in their order."""
    try:
        rows = [int(part) for part in text.split(",")]
    except ValueError:
        rows = []
    if len(rows) != len(DEFAULT_LANES) or not all(row >= 1 for row in rows):
        raise argparse.ArgumentTypeError(
            f"expected {len(DEFAULT_LANES)} comma-separated positive integers, got {text!r}"
        )
    return rows


def _print_lanes(args: argparse.Namespace, setup: Setup) -> list[str]:
    """The table by lane (without `--retries`); returns what broke exactly-once."""
    print(f"{'load':>5} {'busy':>5} {'lane':<12}" + "".join(f"{c:>11}" for c in COLUMNS))
    broken: list[str] = []
    for load in args.loads:
        totals: dict[str, Counter[str]] = {lane: Counter() for lane in LANE_ORDER}
        busy = 0.0
        for seed in args.seeds:
            counts, busy_fraction, errors, _ = simulate(seed, load, setup)
            busy += busy_fraction / len(args.seeds)
            broken += [f"seed {seed}, load {load:g}: {error}" for error in errors]
            for lane in LANE_ORDER:
                totals[lane].update(counts[lane])
        for lane in LANE_ORDER:
            cells = "".join(
                f"{'-' if c == 'wrong' and not args.counterfactual else totals[lane][c]:>11}"
                for c in COLUMNS
            )
            print(f"{load:>5g} {busy:>5.2f} {lane:<12}{cells}", flush=True)
    return broken


def _print_retries(args: argparse.Namespace, setup: Setup) -> list[str]:
    """The table of retries, old rule against new (`--retries`); returns what broke
    exactly-once."""
    print(
        f"{'load':>5} {'rule':<5} {'busy':>5} {'offered':>8}"
        + "".join(f"{c:>9}" for c in RETRY_COLUMNS)
    )
    broken: list[str] = []
    for load in args.loads:
        for rule, spread in (("old", False), ("new", True)):
            totals: Counter[str] = Counter()
            busy = 0.0
            offered = 0
            for seed in args.seeds:
                counts, busy_fraction, errors, retried = simulate(
                    seed, load, setup, spread_pushback=spread
                )
                busy += busy_fraction / len(args.seeds)
                broken += [f"seed {seed}, load {load:g}, {rule}: {error}" for error in errors]
                for lane in LANE_ORDER:
                    offered += sum(counts[lane][c] for c in ("admitted", "unmeetable", "full"))
                    totals["goodput"] += counts[lane]["ok"]
                    totals["gave_up"] += counts[lane]["full"]
                totals["full"] += retried.full
                totals["refull"] += retried.refull
                totals["retries"] += retried.retries
                totals["max/1ms"] = max(totals["max/1ms"], retried.max_in_1ms)
            cells = "".join(f"{totals[c]:>9}" for c in RETRY_COLUMNS)
            print(f"{load:>5g} {rule:<5} {busy:>5.2f} {offered:>8}{cells}", flush=True)
    return broken


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=_seeds, default=[1, 2, 3], help="default: 1,2,3")
    parser.add_argument(
        "--loads", type=_loads, default=[0.5, 1.0, 1.5, 2.5], help="default: 0.5,1,1.5,2.5"
    )
    parser.add_argument("--shapes", choices=("one", "two"), default="one")
    parser.add_argument(
        "--bulk-deadline-ms", type=_pair, default=(20.0, 200.0), help="default: 20,200"
    )
    parser.add_argument("--counterfactual", action="store_true", help="count wrong refusals")
    parser.add_argument(
        "--retries",
        type=lambda text: _count(text, 0),
        default=0,
        help="retries of a LANE_FULL refusal, each after its pushback; compares the rules "
        "(default: 0, none)",
    )
    parser.add_argument(
        "--burst",
        type=lambda text: _count(text, 1),
        default=1,
        help="requests arriving together at each arrival (default: 1)",
    )
    parser.add_argument(
        "--lane-rows",
        type=_lane_rows,
        default=None,
        help="capacity_rows of interactive,standard,bulk (default: the default lanes')",
    )
    args = parser.parse_args(argv)
    if args.counterfactual and args.retries:
        # Ran, the replays took minutes and the table of retries printed nothing of them.
        parser.error(
            "--counterfactual counts wrong refusals in the table by lane; --retries prints "
            "the table of retries, without them: use one or the other"
        )
    low_ms, high_ms = args.bulk_deadline_ms
    traffic = (
        Traffic("interactive", 300.0, (1, 2), (0.010, 0.050)),
        Traffic("standard", 600.0, (1, 8), (0.020, 0.200)),
        Traffic("bulk", 100.0, (8, 100), (low_ms / 1000, high_ms / 1000)),
    )
    lanes = DEFAULT_LANES
    if args.lane_rows is not None:
        lanes = tuple(
            dataclasses.replace(lane, capacity_rows=rows)
            for lane, rows in zip(DEFAULT_LANES, args.lane_rows, strict=True)
        )
    setup = Setup(
        traffic=traffic,
        widths=(BASE_WIDTH,) if args.shapes == "one" else (BASE_WIDTH, 8),
        lanes=lanes,
        counterfactual=args.counterfactual,
        burst=args.burst,
        retries=args.retries,
    )
    print(
        f"seeds {','.join(str(s) for s in args.seeds)}, shapes {args.shapes}, "
        f"bulk deadlines {low_ms:g}-{high_ms:g} ms, lane rows "
        f"{','.join(str(lane.capacity_rows) for lane in lanes)}, burst {args.burst}, "
        f"retries {args.retries} (sums over the seeds)"
    )
    broken = (_print_retries if args.retries else _print_lanes)(args, setup)
    for error in broken:
        print(f"exactly-once broken: {error}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
