"""Interpreter settings for a serving process, applied once by `laneserve serve` (and by
the benchmark's baselines, so that the comparison is of designs, not of tuning).

Both exist because one process runs the event loop, the scheduler thread and the engine
thread under one GIL:

- **GIL switch interval 1 ms** (CPython's default is 5 ms): the engine and scheduler
  threads need the GIL back after every run and wake-up, and the event loop holds it for
  up to the interval first. Measured on 2 cores (two A/B pairs): +3-25 % throughput at
  1-64 callers.
- **Garbage collection**: a full collection walks every tracked object and holds the GIL
  while it does, so every thread stalls. With CPython's defaults (700, 10, 10) the
  server ran one every second or two under load, each 15-90 ms, and they were most of
  the interactive p99 under bulk load. The start-up heap (modules, the runtime, the
  protocol descriptors) is frozen out of collections, the youngest generation is
  collected every 2 000 allocations and the oldest a hundred times more rarely.
  Measured: under scenarios (a)-(b) of the benchmark one collection in a minute took
  over 2 ms; under the bulk floods of (c) some still take 25-40 ms (the queued requests
  are live objects every collection walks). Requests make almost no cyclic garbage (5
  objects each, inside gRPC), so the rarer collections cost little memory (RSS flat
  under a 40 s load once the replay cache is full).
"""

from __future__ import annotations

import gc
import sys

GIL_SWITCH_INTERVAL_S = 0.001
GC_THRESHOLDS = (2_000, 10, 100)


def tune_for_serving() -> None:
    """Call once, after start-up (the model loaded), before serving traffic."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


__all__ = ["GC_THRESHOLDS", "GIL_SWITCH_INTERVAL_S", "tune_for_serving"]
