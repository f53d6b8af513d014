"""Interpreter settings for a serving process, applied once by `laneserve serve` (and by
the benchmark's baselines, so that the comparison is of designs, not of tuning); and the
stop signals' dispositions before `serve` handles them itself (`catch_stop_signals_early`).

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
import os
import resource
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn


def open_file_limit() -> int | None:
    """The process's open-file limit (`ulimit -n`, the soft one); None where it is
    infinite. What the bounds on connections and shared memory regions are shares of."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


GIL_SWITCH_INTERVAL_S = 0.001
GC_THRESHOLDS = (2_000, 10, 100)

# The signals that stop `serve` (a drain once it serves). SIGHUP too: its terminal or
# ssh session closed, or a supervisor's stop; its default killed the process at once,
# queued work unanswered.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The stop signals an ignored disposition at start is kept for: the caller asked for the
# server to be left alone by them. SIGHUP under `nohup` (it is to outlive its terminal);
# SIGINT in a background job of a non-interactive shell (`laneserve serve &` in a script:
# the shell ignores it there, so that the script's Ctrl-C is not the job's; Python keeps
# it ignored too, raising no KeyboardInterrupt). Not SIGTERM: no caller ignores it to
# ask anything, and it is how a supervisor or a container runtime stops the server.
LEFT_IGNORED = (signal.SIGINT, signal.SIGHUP)

# A signal's disposition as `signal.getsignal` gives it (None: not set from Python).
_Disposition = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
# The dispositions `catch_stop_signals_early` replaced, for `release_stop_signals`.
_before_caught: dict[int, _Disposition] = {}


def tune_for_serving() -> None:
    """Call once, after start-up (the model loaded), before serving traffic."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def stop_signals_taken() -> tuple[signal.Signals, ...]:
    """The stop signals this process acts on: not SIGHUP nor SIGINT where it was ignored
    at start (`LEFT_IGNORED`). Read before anything here replaced them, and again by
    `serve`, which finds them as `catch_stop_signals_early` left them."""
    return tuple(
        signum
        for signum in STOP_SIGNALS
        if signum not in LEFT_IGNORED or signal.getsignal(signum) != signal.SIG_IGN
    )


def catch_stop_signals_early() -> None:
    """Until `serve` handles them itself (cli._serve), a stop signal ends the process at
    once, by that signal (`die_by_signal`): nothing is accepted yet. Both ways of running
    the command line call it first (laneserve.server.entry: the console script, and
    `python -m laneserve.server.cli`, which goes there), before the imports of ONNX
    Runtime and gRPC (about a second, twice with JSON logs' restart): as PID 1 (a
    container's entrypoint) a signal with no handler is ignored, and a SIGTERM then was
    lost, the pod waiting out its whole termination grace period. Unblocks them too: the
    restart for JSON logs blocks them across its exec, so that one sent meanwhile waits
    for this handler instead of meeting none. Call it on the main thread."""
    for signum in stop_signals_taken():
        _before_caught.setdefault(signum, signal.getsignal(signum))
        signal.signal(signum, _exit_at_once)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def release_stop_signals() -> None:
    """The dispositions `catch_stop_signals_early` replaced, back: for the commands that
    take signals their own way (Ctrl-C ends `laneserve top` with 0, through
    KeyboardInterrupt)."""
    for signum, handler in _before_caught.items():
        if handler is not None:  # None: not set from Python, nothing to restore
            signal.signal(signum, handler)
    _before_caught.clear()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def die_by_signal(signum: int) -> NoReturn:
    """Ends the process by `signum`'s default action, at once (no cleanup, nothing
    flushed): its parent sees a death by the signal, as from a process with no handler.
    An exit with 128 + the number instead read as a failure: systemd counts a death by
    SIGTERM as a clean stop and an exit with 143 as a failed unit (unless listed in
    SuccessExitStatus), and bash ends the script it runs when a child dies by a Ctrl-C's
    SIGINT, but goes on after an exit with 130. As PID 1 (a container's entrypoint) the
    kernel drops a signal with no handler, this process's own too: it exits with 128 +
    the number then, as the container runtime reports a death by it. Main thread only."""
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signum,))
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def _exit_at_once(signum: int, _frame: FrameType | None) -> None:
    die_by_signal(signum)


__all__ = [
    "GC_THRESHOLDS",
    "GIL_SWITCH_INTERVAL_S",
    "LEFT_IGNORED",
    "STOP_SIGNALS",
    "catch_stop_signals_early",
    "die_by_signal",
    "release_stop_signals",
    "stop_signals_taken",
    "tune_for_serving",
]
