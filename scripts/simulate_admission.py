"""Seeded simulation of admission: what `Scheduler` promises, and what it then delivers.

    .venv/bin/python scripts/simulate_admission.py                  # one shape, 3 seeds
    .venv/bin/python scripts/simulate_admission.py --shapes two --bulk-deadline-ms 100,1000
    .venv/bin/python scripts/simulate_admission.py --counterfactual # + refusals it got wrong

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

It also checks that every admitted request was answered exactly once, and exits 1 if
not. This is a measurement, not a test: nothing here asserts a rate.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import random
import sys
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from laneserve.server.config import DEFAULT_LANES, LaneConfig
from laneserve.server.cost_model import RunTimeModel
from laneserve.server.errors import LaneserveError
from laneserve.server.items import Batch, BatchResult, InferenceRequest, Outcome, Signature
from laneserve.server.scheduler import Dispatch, Scheduler, WaitUntil

BATCH_CAP = 64
# The true 2-wide run time, rows -> seconds (other widths scale it); the scheduler is
# told it, in a model of its own (it learns from what it completes).
RUN_TIME_POINTS = {1: 0.001, BATCH_CAP: 0.004}
BASE_WIDTH = 2
LANE_ORDER = ("interactive", "standard", "bulk")
COLUMNS = ("admitted", "ok", "late", "expired", "unmeetable", "wrong", "full")


@dataclasses.dataclass(frozen=True)
class Arrival:
    at_s: float
    index: int
    lane: str
    rows: int
    width: int
    deadline_s: float


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
    def __init__(self, lanes: Sequence[LaneConfig]) -> None:
        self.scheduler = _Scheduler(
            lanes,
            batch_cap=BATCH_CAP,
            run_time=RunTimeModel(RUN_TIME_POINTS),
            run_time_signature=((BASE_WIDTH,),),
        )
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
        try:
            self.scheduler.admit(request, self.now_s)
        except LaneserveError as error:
            self.status[arrival.index] = error.reason
            return False
        self.status[arrival.index] = "ADMITTED"
        config = self.scheduler.lane(arrival.lane).config
        self.deadline_s[arrival.index] = config.deadline_s(self.now_s, arrival.deadline_s)
        return True

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
    seed: int, load: float, traffic: Sequence[Traffic], widths: Sequence[int]
) -> list[Arrival]:
    rng = random.Random(seed)  # noqa: S311 (seeded on purpose: the runs are reproducible)
    drawn: list[tuple[float, str, int, int, float]] = []
    for lane in traffic:
        at_s = 0.0
        while True:
            at_s += rng.expovariate(lane.rate_per_s * load)
            if at_s >= 1.0:
                break
            rows = rng.randint(*lane.rows)
            width = rng.choice(widths)
            drawn.append((at_s, lane.lane, rows, width, at_s + rng.uniform(*lane.budget_s)))
    drawn.sort()
    return [
        Arrival(at_s, index, lane, rows, width, deadline_s)
        for index, (at_s, lane, rows, width, deadline_s) in enumerate(drawn)
    ]


def simulate(
    seed: int,
    load: float,
    traffic: Sequence[Traffic],
    widths: Sequence[int],
    counterfactual: bool,
) -> tuple[dict[str, Counter[str]], float, list[str]]:
    """Per lane, the counts of `COLUMNS`; the session's busy fraction; and what broke
    the exactly-once rule."""
    arrivals = draw(seed, load, traffic, widths)
    simulation = Simulation(DEFAULT_LANES)
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
    return counts, simulation.busy_s / max(simulation.now_s, 1e-9), errors


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
    args = parser.parse_args(argv)
    low_ms, high_ms = args.bulk_deadline_ms
    traffic = (
        Traffic("interactive", 300.0, (1, 2), (0.010, 0.050)),
        Traffic("standard", 600.0, (1, 8), (0.020, 0.200)),
        Traffic("bulk", 100.0, (8, 100), (low_ms / 1000, high_ms / 1000)),
    )
    widths = (BASE_WIDTH,) if args.shapes == "one" else (BASE_WIDTH, 8)
    print(
        f"seeds {','.join(str(s) for s in args.seeds)}, shapes {args.shapes}, "
        f"bulk deadlines {low_ms:g}-{high_ms:g} ms (sums over the seeds)"
    )
    print(f"{'load':>5} {'busy':>5} {'lane':<12}" + "".join(f"{c:>11}" for c in COLUMNS))
    broken: list[str] = []
    for load in args.loads:
        totals: dict[str, Counter[str]] = {lane: Counter() for lane in LANE_ORDER}
        busy = 0.0
        for seed in args.seeds:
            counts, busy_fraction, errors = simulate(
                seed, load, traffic, widths, args.counterfactual
            )
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
    for error in broken:
        print(f"exactly-once broken: {error}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
