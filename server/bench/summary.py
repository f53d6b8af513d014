"""From raw per-window records to figures: percentiles, rates, goodput, stability.

Client processes record what they see of each stream in each window (`StreamWindow`);
the orchestrator merges the processes' records window by window and decides, window by
window, whether the measurement is stable. Everything here is pure.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np

from laneserve.server.bench.settings import Stream

OK: Final = "OK"
# How an answer that is not OK is counted. A reason is the server's ErrorInfo.reason
# when it sent one, else the gRPC status code's name. Rejected: refused for the load, at
# admission (as laneserve's GetStats counts them; an invalid request, which it counts
# there too, is the load generator's failure here) or by gRPC before laneserve saw it.
REJECTED_REASONS: Final = frozenset(
    {
        "LANE_FULL",
        "DEADLINE_UNMEETABLE",
        "MEMORY_PRESSURE",
        "JOIN_LIMIT",
        "DRAINING",
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
        "CANCELLED_BEFORE_DEADLINE",
    }
)
# Dropped by the server after admission. (laneserve also sheds CANCELLED work, but only
# for a client that has gone: no client ever sees that answer.)
SHED_REASONS: Final = frozenset({"EXPIRED_IN_QUEUE"})
# No answer within the gRPC deadline: the client's timer fired (DEADLINE_EXCEEDED) or the
# server's gRPC core, timing the same deadline, reset the stream first (a bare CANCELLED
# once TIMED_OUT_SHARE of the deadline had passed; see `unanswered_reason`).
TIMED_OUT_REASONS: Final = frozenset({"DEADLINE_EXCEEDED", "CANCELLED"})
# A bare CANCELLED (no ErrorInfo) that came back before this share of its call's gRPC
# deadline had passed was no timeout: gRPC's core refused a call laneserve never saw
# (more calls waiting than max_pending_calls: laneserve's README, "Errors"). The server's
# core times a deadline out a little before the client's timer does, never long before.
TIMED_OUT_SHARE: Final = 0.9
CANCELLED_BEFORE_DEADLINE: Final = "CANCELLED_BEFORE_DEADLINE"
# Fewer OK answers than this in a window: its median is too noisy to judge stability.
MIN_SAMPLES_FOR_LATENCY_STABILITY: Final = 20
# An open-loop stream was offered when the client sent at least this share of its target
# rate ...
MIN_ACHIEVED_FRACTION: Final = 0.95
# ... or, where that share is within Poisson noise of the target (few arrivals in the
# windows used), no fewer than this many standard deviations below the expected count.
ARRIVAL_NOISE_SIGMAS: Final = 3.0
# ... and when this percentile of its client lag (how late each request was sent behind
# its schedule) is within the stream's deadline, or its median latency without one.
LAG_PERCENTILE: Final = 95
# A stream's answers were timed as they came when this percentile of its client
# lateness, measured twice (the event loop's lateness to its heartbeat, and how long
# after their gRPC deadline the client saw calls end), is within its deadline, or, open
# loop without one, its median latency, and never more than this share of a window: a
# loop later than that cuts its windows where the server's readings (taken on time at
# the window boundaries) do not, so the two no longer cover the same interval.
CLIENT_LATE_PERCENTILE: Final = 95
CLIENT_LATE_WINDOW_SHARE: Final = 0.1


@dataclasses.dataclass(slots=True)
class StreamWindow:
    """What one client process saw of one stream in one window: what it sent (and the
    lag of each send) in the window it was sent in, what came back in the window it
    completed in."""

    # Requests handed to gRPC.
    sent: int = 0
    # Open loop: arrivals never sent, because this client process already had
    # MAX_OUTSTANDING requests in flight (neither sent nor answered: the load generator,
    # not the server, was the limit).
    client_backlog: int = 0
    ok_latency_s: list[float] = dataclasses.field(default_factory=list)
    # From the answer's Timing: rows in the batch that carried it (0: not reported) and
    # microseconds from admission to dispatch.
    ok_batch_rows: list[int] = dataclasses.field(default_factory=list)
    ok_queue_us: list[int] = dataclasses.field(default_factory=list)
    # "OK" or the reason of the failure, with counts.
    outcomes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # OK answers that arrived after the stream's deadline.
    late_ok: int = 0
    # OK answers dispatched after their deadline had passed, by `dispatched_late` (only
    # counted where the deadline travels as timeout_ms: under a gRPC deadline the client
    # cancels at the deadline and never sees such an answer).
    expired_executed: int = 0
    # Open loop: seconds between each sent request's scheduled arrival and its send.
    lag_s: list[float] = dataclasses.field(default_factory=list)
    # OK answers by the server process that answered (its pid, as the worker named
    # itself on the connection that carried the call); only servers that name
    # themselves (the baselines) are counted.
    ok_by_worker: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Seconds the event loop of the client process carrying the stream was late to each
    # heartbeat tick in the window (settings.HEARTBEAT_S apart): how long an answer that
    # came then waited before the client timed it. Every process carrying the stream
    # adds its own.
    loop_late_s: list[float] = dataclasses.field(default_factory=list)
    # Per call that ended in the window under a gRPC deadline (unary), the seconds past
    # that deadline when the client saw it end (0 within it): gRPC ends a call by its
    # deadline, so any time past it was the client's own (its gRPC core's or its loop's).
    past_deadline_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class WindowReport:
    """One client process's records of one window."""

    worker: int
    window: int
    streams: dict[str, StreamWindow]
    wall_s: float
    # CPU seconds the client process used in the window (all its threads).
    cpu_s: float
    # The process's connections by the server process they reached (its pid), where the
    # server names itself; the same for every window of a point.
    connections: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class MergedWindow:
    """Every client process's records of one window, combined."""

    window: int
    streams: dict[str, StreamWindow]
    wall_s: float
    # By client process (worker index): the CPU seconds it used and its window's wall time.
    client_cpu: dict[int, tuple[float, float]]
    # Every client process's connections by the server process they reached (its pid).
    connections: dict[str, int] = dataclasses.field(default_factory=dict)


def merge_window(reports: Sequence[WindowReport]) -> MergedWindow:
    assert reports, "a window is merged from at least one report"
    assert len({report.window for report in reports}) == 1, "one window at a time"
    merged: dict[str, StreamWindow] = {}
    for report in reports:
        for label, part in report.streams.items():
            merged[label] = combine([merged[label], part]) if label in merged else part
    wall_s = sum(report.wall_s for report in reports) / len(reports)
    connections: collections.Counter[str] = collections.Counter()
    for report in reports:
        connections.update(report.connections)
    return MergedWindow(
        window=reports[0].window,
        streams=merged,
        wall_s=wall_s,
        client_cpu={report.worker: (report.cpu_s, report.wall_s) for report in reports},
        connections=dict(connections),
    )


def worker_split(
    windows: Sequence[MergedWindow], pids: Sequence[int]
) -> list[dict[str, Any]] | None:
    """How the windows' calls were shared out over a deployment's server processes
    (`pids`, in start order): per process, the client connections it held and the OK
    answers it gave, with their share. Processes that got no connection are listed with
    0; a pid the deployment does not know (an external endpoint) comes after, without an
    index. None when no server process named itself (laneserve, or any endpoint that
    does not)."""
    answered: collections.Counter[str] = collections.Counter()
    for window in windows:
        for record in window.streams.values():
            answered.update(record.ok_by_worker)
    connections = windows[-1].connections if windows else {}
    named = set(answered) | set(connections)
    if not named:
        return None
    known = [str(pid) for pid in pids]
    total = sum(answered.values())
    return [
        {
            "worker": known.index(pid) if pid in known else None,
            "pid": int(pid),
            "connections": connections.get(pid, 0),
            "ok": answered[pid],
            "ok_share": answered[pid] / total if total else None,
        }
        for pid in [*known, *sorted(named - set(known))]
    ]


def client_cpu_fractions(windows: Iterable[MergedWindow]) -> list[float]:
    """Each client process's CPU over `windows` as a share of one core: its CPU seconds
    over its wall seconds, summed first. Per window the ratio is noise when a late client
    catches up through windows of a few milliseconds (the kernel credits the CPU of its
    other threads at clock ticks): it read 490 % of a core on a 2-core machine."""
    totals: dict[int, tuple[float, float]] = {}
    for window in windows:
        for worker, (cpu_s, wall_s) in window.client_cpu.items():
            total_cpu_s, total_wall_s = totals.get(worker, (0.0, 0.0))
            totals[worker] = (total_cpu_s + cpu_s, total_wall_s + wall_s)
    return [cpu_s / wall_s for cpu_s, wall_s in totals.values() if wall_s > 0]


def combine(parts: Iterable[StreamWindow]) -> StreamWindow:
    total = StreamWindow()
    for part in parts:
        total.sent += part.sent
        total.client_backlog += part.client_backlog
        total.ok_latency_s += part.ok_latency_s
        total.ok_batch_rows += part.ok_batch_rows
        total.ok_queue_us += part.ok_queue_us
        total.outcomes.update(part.outcomes)
        total.late_ok += part.late_ok
        total.expired_executed += part.expired_executed
        total.lag_s += part.lag_s
        total.ok_by_worker.update(part.ok_by_worker)
        total.loop_late_s += part.loop_late_s
        total.past_deadline_s += part.past_deadline_s
    return total


def percentiles_ms(samples_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50 / p95 / p99 / p99.9, mean and max in milliseconds; None when there are none."""
    if not samples_s:
        return {
            "count": 0,
            "p50_ms": None,
            "p95_ms": None,
            "p99_ms": None,
            "p99_9_ms": None,
            "mean_ms": None,
            "max_ms": None,
        }
    values = np.asarray(samples_s, dtype=np.float64) * 1000
    p50, p95, p99, p999 = np.percentile(values, [50, 95, 99, 99.9])
    return {
        "count": int(values.size),
        "p50_ms": float(p50),
        "p95_ms": float(p95),
        "p99_ms": float(p99),
        "p99_9_ms": float(p999),
        "mean_ms": float(values.mean()),
        "max_ms": float(np.max(values)),
    }


def all_calls_latency(record: StreamWindow) -> dict[str, float | int | None]:
    """Latency percentiles over every call of a stream, not only its OK answers: a call
    not answered OK (refused, shed, timed out, failed, still unanswered at the end of
    the windows, or held back as client backlog) counts as +inf, an SLO miss. So the p99
    is +inf once more than about 1 % of the calls were not OK. The calls are the
    requests sent (or the answers received, where more came back in the windows than
    were sent in them) plus the client backlog.

    A percentile that falls on a call not answered OK is None (+inf: JSON has no
    infinity), as are all of them when there were no calls."""
    answered = sum(record.outcomes.values())
    calls = max(record.sent, answered) + record.client_backlog
    ok = sorted(record.ok_latency_s)
    figures: dict[str, float | int | None] = {
        "calls": calls,
        "ok_share": len(ok) / calls if calls else None,
    }
    for key, q in ALL_CALLS_PERCENTILES.items():
        figures[key] = _with_misses_ms(ok, calls, q) if calls else None
    return figures


# The percentiles of `all_calls_latency`, by key.
ALL_CALLS_PERCENTILES: Final = {"p50_ms": 50.0, "p95_ms": 95.0, "p99_ms": 99.0, "p99_9_ms": 99.9}


def _with_misses_ms(ok_sorted_s: Sequence[float], calls: int, q: float) -> float | None:
    """The q-th percentile, in ms, of `calls` values: `ok_sorted_s` and +inf for the
    rest; None when it is +inf. Interpolated linearly between the two nearest ranks, as
    `percentiles_ms` (numpy's default) does; numpy itself turns inf - inf into nan."""
    position = q / 100 * (calls - 1)
    low = math.floor(position)
    high = math.ceil(position)
    if high >= len(ok_sorted_s):
        return None  # a rank it stands on or leans towards is a miss
    low_s, high_s = ok_sorted_s[low], ok_sorted_s[high]
    return (low_s + (high_s - low_s) * (position - low)) * 1000


def classify(outcomes: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """Non-OK outcomes split into rejected / shed / timed_out / failed, by reason."""
    groups: dict[str, dict[str, int]] = {"rejected": {}, "shed": {}, "timed_out": {}, "failed": {}}
    for reason, count in sorted(outcomes.items()):
        if reason == OK:
            continue
        if reason in REJECTED_REASONS:
            groups["rejected"][reason] = count
        elif reason in SHED_REASONS:
            groups["shed"][reason] = count
        elif reason in TIMED_OUT_REASONS:
            groups["timed_out"][reason] = count
        else:
            groups["failed"][reason] = count
    return groups


def unanswered_reason(reason: str, elapsed_s: float, call_timeout_s: float) -> str:
    """The reason a failure is counted under: a bare CANCELLED that came back `elapsed_s`
    after its send, well before its gRPC deadline (`call_timeout_s`; inf where the call
    has none), is CANCELLED_BEFORE_DEADLINE, a refusal; every other reason is itself."""
    if reason == "CANCELLED" and elapsed_s < TIMED_OUT_SHARE * call_timeout_s:
        return CANCELLED_BEFORE_DEADLINE
    return reason


def window_figures(window: MergedWindow) -> dict[str, dict[str, float | None]]:
    """Per stream: OK answers per second and median latency, the figures stability is
    judged on."""
    figures: dict[str, dict[str, float | None]] = {}
    for label, record in window.streams.items():
        ok = record.outcomes.get(OK, 0)
        figures[label] = {
            "throughput_per_s": ok / window.wall_s,
            "p50_ms": (
                float(np.median(record.ok_latency_s)) * 1000
                if len(record.ok_latency_s) >= MIN_SAMPLES_FOR_LATENCY_STABILITY
                else None
            ),
        }
    return figures


def is_stable(
    windows: Sequence[Mapping[str, Mapping[str, float | None]]], *, count: int, tolerance: float
) -> bool:
    """Whether the last `count` windows agree: for every stream, throughput and median
    latency each spread by at most `tolerance` (a fraction) of their smallest value over
    those windows, (max - min) / min, so that no two windows differ by more. A window
    without OK answers is never stable (a point where everything fails is reported as
    not stable, not accepted); a median missing from any window (too few samples) is not
    judged."""
    if len(windows) < count:
        return False
    recent = windows[-count:]
    for label in recent[-1]:
        for key in ("throughput_per_s", "p50_ms"):
            values = [window[label][key] if label in window else None for window in recent]
            if any(value is None for value in values):
                if key == "throughput_per_s":
                    return False
                continue
            numbers = [float(value) for value in values if value is not None]
            low, high = min(numbers), max(numbers)
            if low <= 0 or high - low > tolerance * low:
                return False
    return True


def dispatched_late(latency_s: float, infer_us: int, deadline_s: float) -> bool:
    """Whether an OK answer's request ran after its deadline had passed, as the client
    can tell: of its latency (from the scheduled send), everything but the session's own
    run time (Timing.infer_us; 0 where the server does not report it) went by before
    the run, so the run started after the deadline when that exceeds it. Time in gRPC's
    queues, decoding and client lag count, not only the server's own queue time."""
    return latency_s - infer_us / 1e6 > deadline_s


def lag_limit_ms(stream: Stream, latency_p50_ms: float | None) -> float | None:
    """The most an open-loop stream's LAG_PERCENTILE client lag may be: its deadline, or
    without one its median latency (from the scheduled arrival, over OK answers): a
    longer lag means more than 5 % of its requests waited in the load generator longer
    than the typical request took in all. None: closed loop, or no OK answer to hold
    the lag against."""
    if stream.mode != "open":
        return None
    if stream.deadline_ms is not None:
        return float(stream.deadline_ms)
    return latency_p50_ms


def offer_problem(
    stream: Stream,
    sent: int,
    duration_s: float,
    lag_s: Sequence[float],
    *,
    latency_p50_ms: float | None,
) -> str:
    """Empty when the load generator offered an open-loop stream's load over
    `duration_s`; else why not: it sent under MIN_ACHIEVED_FRACTION of its target rate
    (beyond Poisson noise), or the LAG_PERCENTILE of its lag behind the schedule exceeds
    `lag_limit_ms` (more than 5 % of the requests were late before they left: a median
    lag let a point whose p95 lag was past its deadline count every late answer against
    the server). `sent` counts the arrivals held back because MAX_OUTSTANDING calls were
    unanswered: the server held those calls, so they are its answer to the load, not the
    load generator's limit. Closed loop: always empty. Over InferStream the rate is not
    judged (the server's credit window holds items back, its backpressure by design, so
    a rate under the target is the server's answer to the load), the lag is: it is taken
    before an item is handed to the stream, so it is the client's alone."""
    if stream.mode != "open" or duration_s <= 0:
        return ""
    problems = []
    expected = stream.rate_per_s * duration_s
    floor = min(
        MIN_ACHIEVED_FRACTION * expected, expected - ARRIVAL_NOISE_SIGMAS * math.sqrt(expected)
    )
    if stream.via != "stream" and sent < floor:
        problems.append(
            f"sent {sent / duration_s:,.0f}/s of the {stream.rate_per_s:,.0f}/s target "
            f"({sent / expected:.0%})"
        )
    limit_ms = lag_limit_ms(stream, latency_p50_ms)
    if limit_ms is not None and lag_s:
        lag_ms = float(np.percentile(lag_s, LAG_PERCENTILE)) * 1000
        if lag_ms > limit_ms:
            against = (
                f"the {stream.deadline_ms} ms deadline"
                if stream.deadline_ms is not None
                else f"the stream's p50 latency, {limit_ms:,.1f} ms (no deadline)"
            )
            problems.append(f"client lag p{LAG_PERCENTILE} {lag_ms:,.0f} ms exceeds {against}")
    return "; ".join(problems)


def client_late_limit_ms(stream: Stream, latency_p50_ms: float | None, window_s: float) -> float:
    """The most the CLIENT_LATE_PERCENTILE of a stream's client lateness may be:
    CLIENT_LATE_WINDOW_SHARE of a `window_s` window, or less where the stream's deadline,
    or, open loop without one, its median latency, is less (the bound `lag_limit_ms`
    holds the lag to: an answer the client sees late is as late as a request it sent
    late). A closed-loop stream without a deadline has the window's share alone, as its
    lag is not judged either: its latency is the round trip one caller sees, client
    included, and a client that sends late offers less, which its throughput shows."""
    limits_ms = [window_s * 1000 * CLIENT_LATE_WINDOW_SHARE]
    if stream.deadline_ms is not None:
        limits_ms.append(float(stream.deadline_ms))
    elif stream.mode == "open" and latency_p50_ms is not None:
        limits_ms.append(latency_p50_ms)
    return min(limits_ms)


def late_problem(
    stream: Stream,
    record: StreamWindow,
    *,
    latency_p50_ms: float | None,
    window_s: float,
) -> str:
    """Empty when the client processes carrying a stream saw its answers as they came;
    else why not: the CLIENT_LATE_PERCENTILE of their event loops' lateness to the
    heartbeat (`loop_late_s`), or of the time past their gRPC deadline at which they saw
    calls end (`past_deadline_s`), exceeds `client_late_limit_ms`. Either way more than
    5 % of the time, or of the calls, an answer waited in the load generator longer than
    the limit before it was timed (a (d) point read OK answers 9 s after their send
    under a 100 ms gRPC deadline, with its send lag within the deadline), or the client
    cut its windows where the server's readings do not. The loop's lateness alone
    misses a wait in the client's gRPC core (in a starved run, OK answers were seen over
    a second later than the server, the send lag and the loop's lateness together could
    make them); the calls past their deadline alone see nothing without a short gRPC
    deadline. Without samples, nothing is judged."""
    limit_ms = client_late_limit_ms(stream, latency_p50_ms, window_s)
    if stream.deadline_ms is not None and limit_ms == stream.deadline_ms:
        against = f"the {stream.deadline_ms} ms deadline"
    elif limit_ms == latency_p50_ms:
        against = f"the stream's p50 latency, {limit_ms:,.1f} ms (no deadline)"
    else:
        against = (
            f"{CLIENT_LATE_WINDOW_SHARE:.0%} of the {window_s:g} s window ({limit_ms:,.0f} ms)"
        )
    problems = []
    for what, samples_s in (
        ("client loop late", record.loop_late_s),
        ("client late past the gRPC deadline", record.past_deadline_s),
    ):
        if not samples_s:
            continue
        late_ms = float(np.percentile(samples_s, CLIENT_LATE_PERCENTILE)) * 1000
        if late_ms > limit_ms:
            problems.append(f"{what} p{CLIENT_LATE_PERCENTILE} {late_ms:,.0f} ms exceeds {against}")
    return "; ".join(problems)


def summarize_stream(
    stream: Stream, record: StreamWindow, duration_s: float, *, window_s: float
) -> dict[str, Any]:
    """Every client-side figure of one stream over `duration_s` seconds of windows of
    `window_s` seconds each (nominally: the server's readings are taken at their
    boundaries)."""
    ok = record.outcomes.get(OK, 0)
    answered = sum(record.outcomes.values())
    groups = classify(record.outcomes)
    good = ok - record.late_ok
    timed = any(rows > 0 for rows in record.ok_batch_rows)
    latency = percentiles_ms(record.ok_latency_s)
    latency_p50_ms = latency["p50_ms"]
    problems = [
        offer_problem(
            stream,
            record.sent + record.client_backlog,
            duration_s,
            record.lag_s,
            latency_p50_ms=latency_p50_ms,
        ),
        late_problem(stream, record, latency_p50_ms=latency_p50_ms, window_s=window_s),
    ]
    problem = "; ".join(part for part in problems if part)
    # Under a gRPC deadline an answer later than the deadline is cancelled, never seen.
    expired_seen = stream.deadline_in == "timeout_ms" or stream.deadline_ms is None
    return {
        "label": stream.label,
        "lane": stream.lane,
        "rows": stream.rows,
        "mode": stream.mode,
        "concurrency": stream.concurrency,
        "offered_rate_per_s": stream.rate_per_s,
        "deadline_ms": stream.deadline_ms,
        "deadline_in": stream.deadline_in if stream.deadline_ms is not None else None,
        "sent": record.sent,
        "client_backlog": record.client_backlog,
        "answered": answered,
        "ok": ok,
        "sent_per_s": record.sent / duration_s,
        # Open loop: the rate the load generator achieved, next to offered_rate_per_s.
        "achieved_rate_per_s": record.sent / duration_s if stream.mode == "open" else None,
        # False: the load generator was the limit (it could not offer the load, or answers
        # waited in it); the figures do not describe the server at that load.
        "valid": not problem,
        "invalid_reason": problem or None,
        "answered_per_s": answered / duration_s,
        "throughput_per_s": ok / duration_s,
        "throughput_rows_per_s": ok * stream.rows / duration_s,
        "goodput_per_s": good / duration_s,
        "goodput_rows_per_s": good * stream.rows / duration_s,
        "latency": latency,
        # Over every call: one not answered OK counts as +inf (None here).
        "latency_all_calls": all_calls_latency(record),
        "queue": percentiles_ms([us / 1e6 for us in record.ok_queue_us]) if timed else None,
        "batch_rows": _batch_rows(record.ok_batch_rows) if timed else None,
        "rejected": groups["rejected"],
        "shed": groups["shed"],
        "timed_out": groups["timed_out"],
        "failed": groups["failed"],
        "rejected_per_s": sum(groups["rejected"].values()) / duration_s,
        "shed_per_s": sum(groups["shed"].values()) / duration_s,
        "late_ok": record.late_ok,
        # None: not measurable (a gRPC deadline).
        "expired_executed": record.expired_executed if expired_seen else None,
        "client_lag": percentiles_ms(record.lag_s) if stream.mode == "open" else None,
        # What the validity rule holds the client lag's LAG_PERCENTILE against (None:
        # closed loop, or no OK answer).
        "client_lag_limit_ms": lag_limit_ms(stream, latency_p50_ms),
        # The client's lateness, twice: how late the event loops of the client processes
        # carrying the stream were to their heartbeat, and how long past its gRPC
        # deadline each call (unary) was seen to end (0 within it); and what the
        # validity rule holds the CLIENT_LATE_PERCENTILE of each against.
        "client_loop_late": percentiles_ms(record.loop_late_s),
        "client_past_grpc_deadline": percentiles_ms(record.past_deadline_s),
        "client_late_limit_ms": client_late_limit_ms(stream, latency_p50_ms, window_s),
    }


def _batch_rows(values: Sequence[int]) -> dict[str, Any]:
    array = np.asarray(values, dtype=np.int64)
    sizes, counts = np.unique(array, return_counts=True)
    return {
        "mean": float(array.mean()),
        "p50": float(np.percentile(array, 50)),
        "p95": float(np.percentile(array, 95)),
        "max": int(np.max(array)),
        # Batch size -> how many OK answers came from a batch of that size.
        "histogram": {
            str(int(size)): int(count) for size, count in zip(sizes, counts, strict=True)
        },
    }
