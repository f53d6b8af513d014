"""Time as an interface, so the scheduler can be tested with exact, instant time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

# A call that ends this close to its deadline ended by it: gRPC times a deadline from its
# own reading (the caller's, carried in the call; the server's, from when the call came),
# a few microseconds to a millisecond apart from the scheduler's.
DEADLINE_SLACK_S = 0.001

# A caller that goes this close before its deadline is taken to have gone by it
# (`caller_end_status`: DEADLINE_EXCEEDED, not CANCELLED). Wider than DEADLINE_SLACK_S:
# gRPC's deadline on the server is the caller's plus the time the call took to arrive,
# and a deadline that passes at the caller reaches the server as a plain cancel, up to
# that transit time before the server's copy of the deadline (a network's latency; a
# busy event loop shared by client and server, in-process). Of the two errors, a caller
# that truly left in the last 50 ms counted DEADLINE_EXCEEDED is the lesser one.
CALLER_END_SLACK_S = 0.050


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards; only differences mean anything."""
        ...


class Timer(Protocol):
    def cancel(self) -> None: ...


# Runs the action (no argument) after the delay in seconds, unless cancelled first: how a
# component that acts later is given its timers (a test passes one it fires by hand).
StartTimer = Callable[[float, Callable[[], None]], Timer]


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to: `advance(0.005)` is five milliseconds later."""

    def __init__(self, start_s: float = 1_000.0) -> None:
        self._now_s = start_s

    def monotonic(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes backwards"
        self._now_s += seconds
