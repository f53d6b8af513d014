"""The server's lifecycle: STARTING -> SERVING -> DRAINING -> STOPPED, never backwards;
and what each stop signal asks of it (`StopSignals`)."""

from __future__ import annotations

import enum

from laneserve.server.clock import Clock


class Lifecycle(enum.Enum):
    STARTING = "STARTING"  # loading the model and probing; not yet listening
    SERVING = "SERVING"  # admitting requests
    DRAINING = "DRAINING"  # refusing new requests, finishing queued ones
    STOPPED = "STOPPED"  # every request answered, threads joined


# The same stop signal again this soon after the first is the same request delivered
# twice, not "stop now": a wrapper that forwards a signal both to its child and to the
# child's process group (GNU `timeout`, `tini -g`, a shell's `kill 0`) delivers one
# SIGTERM twice, microseconds apart, and cut the drain short (2 runs of 5). Both copies
# are written to the event loop's wake-up pipe at once, and their handlers run at most a
# loop turn or two apart: milliseconds, 25-40 ms where a garbage collection under a bulk
# flood stalls the loop (laneserve.server.process), five times less than this window.
# Short for a person: with a window of 1 s, a second Ctrl-C 0.3 s after the first was
# swallowed, the drain going on. One pressed within 0.2 s still counts once, and its line
# (`signal_repeated`) says to press it again.
REPEAT_WINDOW_S = 0.2


class SignalMeaning(enum.Enum):
    STOP = "STOP"  # the first: stop (after the drain delay, a drain within its grace)
    REPEAT = "REPEAT"  # the first signal again within REPEAT_WINDOW_S: nothing more
    STOP_NOW = "STOP_NOW"  # any other later one: no more waiting, for the delay or grace


class StopSignals:
    """What each stop signal asks, in the order they come. Whoever handles the signals
    owns it (`serve`: the event loop)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        # The first signal and when it came; None until one has.
        self._first: tuple[int, float] | None = None

    def meaning(self, signum: int) -> SignalMeaning:
        now_s = self._clock.monotonic()
        if self._first is None:
            self._first = (signum, now_s)
            return SignalMeaning.STOP
        first_signum, first_s = self._first
        # Another signal (SIGINT after SIGTERM) is never the same request.
        if signum == first_signum and now_s - first_s < REPEAT_WINDOW_S:
            return SignalMeaning.REPEAT
        return SignalMeaning.STOP_NOW
