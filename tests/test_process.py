"""The interpreter settings `laneserve serve` applies once started."""

from __future__ import annotations

import gc
import sys

from laneserve.server.process import GC_THRESHOLDS, GIL_SWITCH_INTERVAL_S, tune_for_serving


def test_tune_for_serving_sets_switch_interval_and_freezes_the_start_up_heap() -> None:
    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    try:
        tune_for_serving()
        assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0, "the start-up heap is out of collections"
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(interval)
