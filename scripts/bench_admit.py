"""Cost of one admission (`Scheduler.admit`): its deadline estimate runs on every request.

    .venv/bin/python scripts/bench_admit.py            # 3 and 8 lanes, 0 / 300 / 3 000 queued

The scheduler alone, no RPC: each trial admits `--requests` 2-row requests into the lanes
below the top one while `queued` entries wait, the top lane active (it admitted a request
just before, so batch limits and the share rules come into play) or idle. Each lane below
the top has a share of 0.02; the run-time model is fixed. The best of `--rounds` trials is
reported in microseconds per admission.

This is a measurement, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np

from laneserve.server.config import LaneConfig
from laneserve.server.cost_model import RunTimeModel
from laneserve.server.items import InferenceRequest
from laneserve.server.scheduler import Scheduler

START_S = 1_000.0
ROW = np.zeros((2, 4), dtype=np.float32)


def lanes(count: int) -> list[LaneConfig]:
    top = LaneConfig("top", capacity_rows=10**6, timeout_ms=10**6, max_wait_ms=1, min_share=0.0)
    return [top] + [
        LaneConfig(f"lane{k}", 10**6, timeout_ms=10**6, max_wait_ms=4 * k, min_share=0.02)
        for k in range(1, count)
    ]


def request(index: int, lane: str) -> InferenceRequest:
    return InferenceRequest(
        request_id=f"r{index}",
        lane=lane,
        inputs={"x": ROW},
        rows=2,
        signature=((4,),),
        deadline_s=None,
        token=index,
    )


def trial(lane_count: int, queued: int, requests: int, top_active: bool) -> float:
    scheduler = Scheduler(
        lanes(lane_count),
        batch_cap=64,
        run_time=RunTimeModel({1: 0.001, 8: 0.0015, 64: 0.004}),
    )
    names = [lane.name for lane in scheduler.lanes]
    lower = names[1:]
    for index in range(queued):
        scheduler.admit(request(index, lower[index % len(lower)]), START_S)
    if top_active:
        scheduler.admit(request(-1, "top"), START_S)
    batch = [request(queued + k, lower[k % len(lower)]) for k in range(requests)]
    started = time.perf_counter()
    for k, item in enumerate(batch):
        scheduler.admit(item, START_S + 1e-6 * k)
    return (time.perf_counter() - started) / requests * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=2000, help="admissions per trial")
    parser.add_argument("--rounds", type=int, default=5, help="trials per figure (best kept)")
    args = parser.parse_args(argv)
    print("lanes  queued  top lane  us per admission")
    for lane_count in (3, 8):
        for queued in (0, 300, 3000):
            for active in (False, True):
                best = min(
                    trial(lane_count, queued, args.requests, active) for _ in range(args.rounds)
                )
                state = "active" if active else "idle"
                print(f"{lane_count:5d}  {queued:6d}  {state:8s}  {best:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
