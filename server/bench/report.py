"""The run's document as files: JSON (every figure), Markdown (the tables and the
targets of issue 6, met or missed) and PNG plots (when matplotlib is installed).

The document is built by `run.run_bench`; `evaluate_targets` adds the verdicts, and
`write_outputs` writes everything under one folder.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

from laneserve.server.bench.procs import PSS, RSS, UNIQUE, UNIQUE_DESCRIPTION
from laneserve.server.bench.settings import (
    BULK_SATURATION,
    BUSY_OTHER_CORES,
    HEARTBEAT_S,
    SCENARIO_TITLES,
)
from laneserve.server.bench.summary import CLIENT_LATE_PERCENTILE, CLIENT_LATE_WINDOW_SHARE

log = logging.getLogger("laneserve.bench")

# Keys every document has (the tests check them; values may be None when not measured).
DOCUMENT_KEYS: Final = frozenset(
    {
        "schema",
        "created_utc",
        "command",
        "profile",
        "settings",
        "environment",
        "model",
        "primary",
        "capacity",
        "raw_ceiling",
        "configurations",
        "scenarios",
        "server_profile",
        "server_threads",
        "targets",
        "reference",
        "warnings",
        "outputs",
        "duration_s",
    }
)
POINT_KEYS: Final = frozenset(
    {
        "configuration",
        "scenario",
        "name",
        "streams",
        "stable",
        "valid",
        "invalid_reason",
        "windows_measured",
        "windows_used",
        "measured_s",
        "per_window",
        "lanes",
        "total",
        "client",
        "server",
        "workers",
        "host",
    }
)
# Keys of a point since the busy rule (BUSY_OTHER_CORES): every point of a document
# written since has them, none of one written before (the schema did not change).
BUSY_RULE_POINT_KEYS: Final = frozenset({"busy"})
STREAM_KEYS: Final = frozenset(
    {
        "label",
        "lane",
        "rows",
        "mode",
        "concurrency",
        "offered_rate_per_s",
        "deadline_ms",
        "deadline_in",
        "sent",
        "client_backlog",
        "answered",
        "ok",
        "sent_per_s",
        "achieved_rate_per_s",
        "valid",
        "invalid_reason",
        "answered_per_s",
        "throughput_per_s",
        "throughput_rows_per_s",
        "goodput_per_s",
        "goodput_rows_per_s",
        "latency",
        "latency_all_calls",
        "queue",
        "batch_rows",
        "rejected",
        "shed",
        "timed_out",
        "failed",
        "rejected_per_s",
        "shed_per_s",
        "late_ok",
        "expired_executed",
        "client_lag",
        "client_lag_limit_ms",
        "client_loop_late",
        "client_past_grpc_deadline",
        "client_late_limit_ms",
    }
)
LATENCY_KEYS: Final = frozenset(
    {"count", "p50_ms", "p95_ms", "p99_ms", "p99_9_ms", "mean_ms", "max_ms"}
)
# Keys of a configuration's `memory` and `memory_after_a` (procs.memory_figures), where
# the harness read them (None for an endpoint it did not start).
MEMORY_KEYS: Final = frozenset(
    {
        "unique_bytes",
        "unique_peak_bytes",
        "measure",
        "note",
        "processes",
        "bytes",
        "peak_bytes",
        "samples",
        "by_process",
    }
)

# The figures issue 6 quotes for a widely used Python-facing server with a C++ dynamic
# batcher on a 2-core machine, this demo model, 64 single-row callers; laneserve should
# reach twice the throughput and a third of the p99.
REFERENCE: Final = {
    "description": (
        "a widely used Python-facing server with a C++ dynamic batcher, demo model, 2 cores,"
        " its own Python client (figures quoted in issue 6)"
    ),
    "callers_64": {"throughput_per_s": 1650.0, "p50_ms": 37.0, "p99_ms": 69.0},
    "callers_1": {"throughput_per_s": 116.0, "p50_ms": 8.0},
    "throughput_factor": 2.0,
    "p99_factor": 3.0,
}


def missing_keys(document: dict[str, Any]) -> list[str]:
    """Where `document` lacks a key it must have; empty when it is well formed."""
    missing = [f"document.{key}" for key in sorted(DOCUMENT_KEYS - set(document))]
    for name, entry in document.get("configurations", {}).items():
        for figures in ("memory_after_a", "memory"):
            if entry.get(figures):
                missing += [
                    f"configurations.{name}.{figures}.{key}"
                    for key in sorted(MEMORY_KEYS - set(entry[figures]))
                ]
    point_keys = POINT_KEYS | BUSY_RULE_POINT_KEYS if busy_rule(document) else POINT_KEYS
    for scenario, points in document.get("scenarios", {}).items():
        for index, point in enumerate(points):
            where = f"scenarios.{scenario}[{index}]"
            missing += [f"{where}.{key}" for key in sorted(point_keys - set(point))]
            for label, stream in point.get("lanes", {}).items():
                missing += [
                    f"{where}.lanes.{label}.{key}" for key in sorted(STREAM_KEYS - set(stream))
                ]
                latency = stream.get("latency", {})
                missing += [
                    f"{where}.lanes.{label}.latency.{key}"
                    for key in sorted(LATENCY_KEYS - set(latency))
                ]
    return missing


def busy_rule(document: dict[str, Any]) -> bool:
    """Whether the document's points were judged by the busy rule: False for one
    written before it (its points carry no `busy`, and its verdicts stand as they were)."""
    points = [point for points in document.get("scenarios", {}).values() for point in points]
    return not points or any("busy" in point for point in points)


# ---- targets -------------------------------------------------------------------


def _points(document: dict[str, Any], scenario: str, configuration: str) -> list[dict[str, Any]]:
    return [p for p in document["scenarios"][scenario] if p["configuration"] == configuration]


def _point(
    document: dict[str, Any], scenario: str, configuration: str, name: str
) -> dict[str, Any] | None:
    for point in _points(document, scenario, configuration):
        if point["name"] == name:
            return point
    return None


def _single(point: dict[str, Any] | None, label: str = "single") -> dict[str, Any] | None:
    if point is None:
        return None
    stream: dict[str, Any] | None = point["lanes"].get(label)
    return stream


def _target(
    target_id: str,
    description: str,
    measured: str,
    required: str,
    met: bool | None,
    detail: str = "",
    *,
    points: Sequence[dict[str, Any] | None] = (),
) -> dict[str, Any]:
    """A verdict read from `points`. Where any of them is not valid (the load generator
    was the limit: it could not offer the load, or its answers waited in it), no
    verdict: `met` is None, `valid` False, and `detail` says why. Where any was measured
    while other processes kept the machine busy (the point's `busy`), no verdict either:
    `met` is None, what the figures read is `met_on_busy_machine`, and the points are in
    `busy_points`. Where any did not settle ("stable: no"), the verdict stands but says
    so (`stable` False, `unstable_points`): it is not as solid as one from stable points."""
    read = _distinct(point for point in points if point is not None)
    why = [
        f"({point['scenario']}) {point['name']}: {point['invalid_reason']}"
        for point in read
        if point.get("valid") is False
    ]
    if why:
        met = None
        detail = "not valid, the load generator was the limit: " + "; ".join(why)
    # Not valid is the stronger finding: a busy machine is not added to it.
    busy = [point for point in read if point.get("busy") is True] if not why else []
    busiest = max(busy, key=lambda point: point["host"]["other_cores"], default=None)
    met_on_busy_machine = None
    if busy:
        met_on_busy_machine, met = met, None
        detail = "; ".join(
            part
            for part in (
                detail,
                "no verdict, read from points measured while other processes kept the machine "
                "busy: "
                + ", ".join(
                    f"{_where(point)} ({point['host']['other_cores']:.2f} cores)" for point in busy
                ),
            )
            if part
        )
    unstable = [_where(point) for point in read if point.get("stable") is False]
    if unstable and not why:
        detail = "; ".join(
            part for part in (detail, "read from points not stable: " + ", ".join(unstable)) if part
        )
    return {
        "id": target_id,
        "description": description,
        "measured": measured,
        "required": required,
        "met": met,
        # False: measured, but the load generator was the limit (see detail).
        "valid": not why,
        # Read from points measured while other processes kept more than BUSY_OTHER_CORES
        # busy (none where not valid): `met` is None, and what the figures read is
        # `met_on_busy_machine`; `busy_other_cores` is the most those processes used, at
        # `busy_point`.
        "busy_points": [_where(point) for point in busy],
        "busy_point": None if busiest is None else _where(busiest),
        "busy_other_cores": None if busiest is None else busiest["host"]["other_cores"],
        "met_on_busy_machine": met_on_busy_machine,
        # False: read from a point whose windows did not agree (named in unstable_points).
        "stable": not unstable,
        "unstable_points": unstable,
        "detail": detail,
    }


def _where(point: dict[str, Any]) -> str:
    return f"{point['configuration']} ({point['scenario']}) {point['name']}"


def _distinct(points: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """`points` without repeats (the same point may feed a verdict twice), in order."""
    seen: set[tuple[str, str, str]] = set()
    distinct = []
    for point in points:
        key = (point["configuration"], point["scenario"], point["name"])
        if key not in seen:
            seen.add(key)
            distinct.append(point)
    return distinct


# A target's `met` (or `met_on_busy_machine`) in words.
_VERDICT_WORDS = {True: "met", False: "missed", None: "not measured"}


def verdict_text(target: dict[str, Any]) -> str:
    """met, missed, not valid (the load generator was the limit) or not measured; a
    verdict read from a point that did not settle says so: "met (unstable point)"; one
    read from a point measured on a busy machine is none, and says what the figures
    read and where others were busiest: "no verdict: met (machine busy at laneserve (a)
    c=2: 0.97 cores used by other processes)"."""
    if target.get("valid") is False:
        return "not valid (load generator the limit)"
    if target.get("busy_points"):
        read = _VERDICT_WORDS[target["met_on_busy_machine"]]
        # No `busy_point` in a verdict written before it was named.
        at = f" at {target['busy_point']}" if target.get("busy_point") else ""
        return (
            f"no verdict: {read} (machine busy{at}: "
            f"{target['busy_other_cores']:.2f} cores used by other processes)"
        )
    text = _VERDICT_WORDS[target["met"]]
    if target["met"] is not None and target.get("stable") is False:
        text += " (unstable point)"
    return text


def _capacity_points(
    document: dict[str, Any], *, bulk_saturation: bool = False
) -> list[dict[str, Any] | None]:
    """The points the offered rates of (b)-(d) come from: the system under test's best
    of (a) (the capacity) and, for (c) (`bulk_saturation`), its bulk saturation point
    too. (d) offers its load by the capacity alone: read with (c)'s point, its verdicts
    were marked unstable by a point they do not depend on."""
    capacity = document.get("capacity") or {}
    configuration = capacity.get("configuration")
    if configuration is None:
        return []
    points = [_point(document, "a", configuration, capacity.get("point", ""))]
    if bulk_saturation:
        points.append(_point(document, "c", configuration, BULK_SATURATION))
    return points


def _not_measured(target_id: str, description: str, required: str, why: str) -> dict[str, Any]:
    return _target(target_id, description, "not measured", required, None, why)


def evaluate_targets(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of issue 6, each with the measured figure and a verdict (None: not
    measured in this run)."""
    primary = document["primary"]
    targets = [
        _echo_target(document, primary),
        _no_batching_target(document, primary),
        *_workers_targets(document, primary),
        *_isolation_targets(document, primary),
        *_overload_targets(document, primary),
        *_reference_targets(document, primary),
    ]
    document["targets"] = targets
    document["reference"] = REFERENCE
    return targets


def _echo_target(document: dict[str, Any], primary: str) -> dict[str, Any]:
    description = "single-row throughput >= 80 % of the echo ceiling at 32 callers"
    our_point = _point(document, "a", primary, "c=32")
    echo_point = _point(document, "a", "echo", "c=32")
    ours, echo = _single(our_point), _single(echo_point)
    if ours is None or echo is None or not echo["throughput_per_s"]:
        return _not_measured("echo_ratio", description, ">= 0.80", "needs (a) c=32 on both")
    ratio = ours["throughput_per_s"] / echo["throughput_per_s"]
    return _target(
        "echo_ratio",
        description,
        f"{ratio:.2f} ({ours['throughput_per_s']:.0f} / {echo['throughput_per_s']:.0f} req/s)",
        ">= 0.80",
        ratio >= 0.8,  # noqa: PLR2004 - the issue's figure
        points=(our_point, echo_point),
    )


def _no_batching_target(document: dict[str, Any], primary: str) -> dict[str, Any]:
    description = ">= 2x the no-batching server's throughput at 64 callers, with lower p99"
    our_point = _point(document, "a", primary, "c=64")
    their_point = _point(document, "a", "no-batching", "c=64")
    ours, theirs = _single(our_point), _single(their_point)
    if ours is None or theirs is None or not theirs["throughput_per_s"]:
        return _not_measured("vs_no_batching", description, ">= 2.0x", "needs (a) c=64 on both")
    ratio = ours["throughput_per_s"] / theirs["throughput_per_s"]
    our_p99 = ours["latency"]["p99_ms"]
    their_p99 = theirs["latency"]["p99_ms"]
    lower = our_p99 is not None and their_p99 is not None and our_p99 < their_p99
    return _target(
        "vs_no_batching",
        description,
        f"{ratio:.2f}x; p99 {_ms(our_p99)} vs {_ms(their_p99)}",
        ">= 2.0x and lower p99",
        ratio >= 2.0 and lower,  # noqa: PLR2004 - the issue's figure
        points=(our_point, their_point),
    )


def _best_point(document: dict[str, Any], configuration: str) -> dict[str, Any] | None:
    """The configuration's point of (a) with the highest throughput."""
    points = _points(document, "a", configuration)
    return max(points, key=lambda p: p["total"]["throughput_per_s"]) if points else None


def _best_throughput(document: dict[str, Any], configuration: str) -> float | None:
    best = _best_point(document, configuration)
    return None if best is None else float(best["total"]["throughput_per_s"])


def _workers_targets(document: dict[str, Any], primary: str) -> list[dict[str, Any]]:
    names = [
        name for name, entry in document["configurations"].items() if entry["kind"] == "workers"
    ]
    if not names:
        return [
            _not_measured(
                "workers_throughput",
                "N workers do not beat laneserve's throughput",
                "<= laneserve",
                "no N-workers configuration ran",
            ),
            _not_measured(
                "workers_memory",
                f"N workers use at least 2x laneserve's memory ({UNIQUE}: {UNIQUE_DESCRIPTION};"
                " peak during (a))",
                ">= 2.0x",
                "no N-workers configuration ran",
            ),
        ]
    ours = _best_throughput(document, primary)
    our_peaks = _peaks_after_a(document, primary)
    targets = []
    for name in names:
        theirs = _best_throughput(document, name)
        if ours is None or theirs is None:
            targets.append(
                _not_measured(
                    f"{name}_throughput",
                    f"{name} does not beat laneserve's throughput",
                    "<= laneserve",
                    "needs (a) on both",
                )
            )
        else:
            targets.append(
                _target(
                    f"{name}_throughput",
                    f"{name} does not beat laneserve's best throughput in (a)",
                    f"{theirs:.0f} vs laneserve {ours:.0f} req/s",
                    "<= laneserve",
                    theirs <= ours,
                    points=(_best_point(document, primary), _best_point(document, name)),
                )
            )
        targets.append(_memory_target(name, our_peaks, _peaks_after_a(document, name)))
    return targets


def _memory_target(
    name: str, our_peaks: dict[str, int], their_peaks: dict[str, int]
) -> dict[str, Any]:
    """The verdict on `name`'s peak memory during (a) against laneserve's, by the first
    measure known on both: unique (each page counted once), else PSS (a document written
    before the unique measure, or smaps unreadable), else RSS; PSS's ratio beside it."""
    measure = next((m for m in (UNIQUE, PSS, RSS) if m in our_peaks and m in their_peaks), None)
    words = f"{UNIQUE}: {UNIQUE_DESCRIPTION}" if measure in (UNIQUE, None) else f"{measure}, summed"
    description = f"{name}'s peak memory during (a) is at least 2x laneserve's ({words})"
    if measure is None or not our_peaks[measure]:
        return _not_measured(
            f"{name}_memory",
            description,
            ">= 2.0x",
            "needs the peak during (a) on both, of the same measure; memory is known "
            "only for processes the harness started",
        )
    ours, theirs = our_peaks[measure], their_peaks[measure]
    ratio = theirs / ours
    beside = ""
    if measure == UNIQUE and our_peaks.get(PSS) and PSS in their_peaks:
        beside = f"; by {PSS} {their_peaks[PSS] / our_peaks[PSS]:.2f}x"
    return _target(
        f"{name}_memory",
        description,
        f"{ratio:.2f}x ({_mib(theirs)} vs {_mib(ours)}, {measure} peak during (a){beside})",
        ">= 2.0x",
        ratio >= 2.0,  # noqa: PLR2004 - the issue's figure
    )


def _peaks_after_a(document: dict[str, Any], configuration: str) -> dict[str, int]:
    """By measure (unique, and PSS or RSS), the largest memory sampled while (a) ran. Not
    the peak at the end: laneserve alone goes on to the overloads of (b)-(d), whose queues
    the baselines never hold."""
    memory = document["configurations"][configuration].get("memory_after_a") or {}
    peaks = {
        UNIQUE: memory.get("unique_peak_bytes"),
        memory.get("measure"): memory.get("peak_bytes"),
    }
    return {
        measure: value
        for measure, value in peaks.items()
        if measure is not None and value is not None
    }


def _isolation_targets(document: dict[str, Any], primary: str) -> list[dict[str, Any]]:
    """One verdict per way bulk traffic was sent in (c). The p99s are over every
    interactive call, a call not answered OK counting as +inf (`latency_all_calls`):
    over OK answers alone, a flood that had most interactive calls refused left a p99
    of the few answered, and could meet the target."""
    description = "interactive p99 under the bulk overload of (c) within 2x of its p99 alone"
    alone_point = _point(document, "c", primary, "interactive alone")
    alone = _single(alone_point, "interactive")
    loaded = [p for p in _points(document, "c", primary) if p["name"].startswith("with bulk")]
    if alone is None or not loaded:
        return [_not_measured("isolation_p99", description, "<= 2.0x", "needs (c)")]
    before = alone["latency_all_calls"]["p99_ms"]
    targets = []
    for point in loaded:
        via = point["streams"][1]["via"]
        on_priority_port = _on_priority_port(point)
        key = f"isolation_p99_{via}" + ("_priority_port" if on_priority_port else "")
        how = f"bulk over {'InferStream' if via == 'stream' else 'unary Infer'}" + (
            ", interactive on the priority port" if on_priority_port else ""
        )
        interactive = point["lanes"]["interactive"]
        every = interactive["latency_all_calls"]
        if not before:
            why = "no interactive answers alone"
            if alone["latency_all_calls"]["calls"]:
                why = f"interactive alone: {_misses(alone)}, so its p99 is +inf"
            targets.append(_not_measured(key, f"{description} ({how})", "<= 2.0x", why))
            continue
        if not every["calls"]:
            targets.append(
                _not_measured(key, f"{description} ({how})", "<= 2.0x", "no interactive calls")
            )
            continue
        after = every["p99_ms"]
        ok_share = f"{every['ok_share']:.1%} of {every['calls']} calls OK"
        if after is None:  # more than ~1 % of the calls not OK: an SLO miss outright
            targets.append(
                _target(
                    key,
                    f"{description} ({how})",
                    f"inf with bulk ({ok_share}; p99 of the OK answers "
                    f"{_ms(interactive['latency']['p99_ms'])}) vs {_ms(before)} alone",
                    "<= 2.0x",
                    False,
                    f"{_misses(interactive)}: each counts as +inf",
                    points=(alone_point, point, *_capacity_points(document, bulk_saturation=True)),
                )
            )
            continue
        ratio = after / before
        targets.append(
            _target(
                key,
                f"{description} ({how})",
                f"{ratio:.2f}x ({_ms(after)} with bulk vs {_ms(before)} alone; {ok_share})",
                "<= 2.0x",
                ratio <= 2.0,  # noqa: PLR2004 - the issue's figure
                points=(alone_point, point, *_capacity_points(document, bulk_saturation=True)),
            )
        )
    return targets


def _misses(stream: dict[str, Any]) -> str:
    """How many of a stream's calls were not answered OK, and why, by reason."""
    every = stream["latency_all_calls"]
    reasons = {**stream["rejected"], **stream["shed"], **stream["timed_out"], **stream["failed"]}
    unanswered = every["calls"] - stream["answered"] - stream["client_backlog"]
    if unanswered > 0:
        reasons["not answered within the windows"] = unanswered
    if stream["client_backlog"]:
        reasons["client backlog"] = stream["client_backlog"]
    missed = every["calls"] - stream["ok"]
    return f"{missed} of {every['calls']} calls not answered OK ({_reasons(reasons)})"


def _on_priority_port(point: dict[str, Any]) -> bool:
    """Whether the point's first stream went to the priority port (older JSON: no port)."""
    return bool(point["streams"][0].get("port") == "priority")


def _overload_targets(document: dict[str, Any], primary: str) -> list[dict[str, Any]]:
    """One goodput verdict per way of sending the deadline; the expired-executed verdict
    from the timeout_ms point, where every answer's Timing comes back."""
    goodput_description = "under (d) goodput >= 90 % of saturation throughput"
    expired_description = "under (d) no request executed after its deadline had passed"
    points = _points(document, "d", primary)
    capacity = (document.get("capacity") or {}).get("throughput_per_s")
    if not points or not capacity:
        return [
            _not_measured("overload_goodput", goodput_description, ">= 0.90", "needs (a), (d)"),
            _not_measured("overload_expired_executed", expired_description, "0", "needs (d)"),
        ]
    targets = []
    for point in points:
        stream = point["lanes"]["default"]
        ratio = stream["goodput_per_s"] / capacity
        how = point["streams"][0]["deadline_in"]
        on_priority = _on_priority_port(point)
        suffix = "_priority_port" if on_priority else ""
        where = ", on the priority port" if on_priority else ""
        targets.append(
            _target(
                f"overload_goodput_{how}{suffix}",
                f"{goodput_description} (deadline as {how}{where})",
                f"{ratio:.2f} ({stream['goodput_per_s']:.0f} / {capacity:.0f} req/s)",
                ">= 0.90",
                ratio >= 0.9,  # noqa: PLR2004 - the issue's figure
                points=(point, *_capacity_points(document)),
            )
        )
        # Under a gRPC deadline a request run after it is never seen (None): only the
        # timeout_ms point, where every answer and its Timing come back, can tell.
        expired = stream["expired_executed"]
        if how == "timeout_ms" and expired is not None:
            targets.append(
                _target(
                    f"overload_expired_executed{suffix}",
                    f"{expired_description}{' (on the priority port)' if on_priority else ''}",
                    f"{expired} (OK but later than the deadline at the client: "
                    f"{stream['late_ok']})",
                    "0",
                    expired == 0,
                    "an OK answer whose latency from its scheduled send, less the session's "
                    "run time (Timing.infer_us), exceeds the deadline was dispatched after it",
                    points=(point, *_capacity_points(document)),
                )
            )
    return targets


def _reference_targets(document: dict[str, Any], primary: str) -> list[dict[str, Any]]:
    reference = REFERENCE["callers_64"]
    assert isinstance(reference, dict)
    want_throughput = reference["throughput_per_s"] * REFERENCE["throughput_factor"]
    want_p99 = reference["p99_ms"] / REFERENCE["p99_factor"]
    point = _point(document, "a", primary, "c=64")
    ours = _single(point)
    if ours is None:
        return [
            _not_measured(
                "reference_throughput", "2x the reference's 64-caller throughput", "", "needs c=64"
            ),
            _not_measured("reference_p99", "1/3 of the reference's 64-caller p99", "", "c=64"),
        ]
    p99 = ours["latency"]["p99_ms"]
    return [
        _target(
            "reference_throughput",
            "2x the reference server's throughput at 64 single-row callers",
            f"{ours['throughput_per_s']:.0f} req/s",
            f">= {want_throughput:.0f} req/s",
            ours["throughput_per_s"] >= want_throughput,
            points=(point,),
        ),
        _target(
            "reference_p99",
            "a third of the reference server's p99 at 64 single-row callers",
            _ms(p99),
            f"<= {want_p99:.0f} ms",
            p99 is not None and p99 <= want_p99,
            points=(point,),
        ),
    ]


# ---- Markdown --------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms" if value >= 10 else f"{value:.2f} ms"  # noqa: PLR2004 - digits


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in counts.items()) or "-"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _verdict(target: dict[str, Any]) -> str:
    text = verdict_text(target)
    return f"**{text}**" if text.startswith("missed") else text


def render_markdown(document: dict[str, Any]) -> str:
    env = document["environment"]
    model = document["model"]
    profile = document["profile"]
    lines = [
        f"# laneserve benchmark ({document['profile']['name']} profile)",
        "",
        f"Command: `{document['command']}`",
        "",
        f"Machine: {env['cpu_count']} CPUs, {env['platform']}, Python {env['python']}, "
        + ", ".join(f"{name} {version}" for name, version in env["versions"].items())
        + f". Load average at start {_loads(env['loadavg_start'])}, at end "
        f"{_loads(env['loadavg_end'])}.",
        "",
        (
            f"Model: `{model.get('served_path') or model.get('path')}`, providers "
            f"{model.get('providers')}, batch cap {model.get('batch_cap')}. Client: "
            f"{document['settings']['client_processes']} processes x "
            f"{document['settings']['channels_per_process']} channels. Windows of "
            f"{profile['window_s']} s after {profile['warmup_s']} s of warm-up, until "
            f"{profile['stable_windows']} agree within {profile['tolerance']:.0%} of their "
            f"smallest value, (max - min) / min, with OK answers in every one (at most "
            f"{profile['max_windows']})."
        ),
        "",
        *_host_note(document),
        "## Targets (issue 6)",
        "",
        *_table(
            ["target", "measured", "required", "verdict"],
            (
                [t["description"], t["measured"], t["required"], _verdict(t)]
                for t in document["targets"]
            ),
        ),
        "",
    ]
    lines += _raw_section(document)
    lines += _scenario_a(document)
    lines += _scenario_b(document)
    lines += _scenario_c(document)
    lines += _scenario_d(document)
    lines += _scenario_x(document)
    lines += _workers_section(document)
    lines += _memory_section(document)
    lines += _server_section(document)
    lines += _threads_section(document)
    lines += _profile_section(document)
    if document["warnings"]:
        lines += ["## Warnings", "", *(f"- {w}" for w in document["warnings"]), ""]
    if document["outputs"].get("plots"):
        lines += ["## Plots", ""]
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in document["outputs"]["plots"]]
        lines.append("")
    return "\n".join(lines)


def _loads(values: Sequence[float] | None) -> str:
    return "-" if not values else " / ".join(f"{value:.2f}" for value in values)


def _raw_section(document: dict[str, Any]) -> list[str]:
    raw = document["raw_ceiling"]
    if not raw:
        return []
    return [
        "## Raw ceiling (the session alone, back-to-back, no RPC)",
        "",
        *_table(
            ["batch rows", "rows/s"],
            ([rows, _num(value)] for rows, value in raw["rows_per_s_by_batch_rows"].items()),
        ),
        "",
        (
            f"Best: {_num(raw['best_rows_per_s'])} rows/s at {raw['best_batch_rows']} rows per "
            f"run{_raw_busy(raw)}."
        ),
        "",
    ]


def _raw_busy(raw: dict[str, Any]) -> str:
    """The mark of a sweep measured while other processes kept the machine busy."""
    if not raw.get("busy"):
        return ""
    cores = raw["host"]["other_cores"]
    return f" (machine busy: {cores:.2f} cores used by other processes; it may read low)"


def _client(point: dict[str, Any]) -> str:
    client = point["client"]
    mark = " (saturated)" if client["saturated"] else ""
    return f"{client['cpu_fraction_max']:.0%}{mark}"


def _scenario_a(document: dict[str, Any]) -> list[str]:
    points = document["scenarios"]["a"]
    if not points:
        return []
    rows = []
    for point in points:
        stream = point["lanes"]["single"]
        latency = stream["latency"]
        batch = stream["batch_rows"]
        rows.append(
            [
                point["configuration"],
                str(stream["concurrency"]),
                _num(stream["throughput_per_s"]),
                _ms(latency["p50_ms"]),
                _ms(latency["p95_ms"]),
                _ms(latency["p99_ms"]),
                _ms(latency["p99_9_ms"]),
                _num(batch["mean"], 1) if batch else "-",
                _client(point),
                _cores(point["host"]["server_cores"]),
                _cpu_per_request(point["host"]["server_cores"], stream["answered_per_s"]),
                _cores(point["host"].get("harness_cores")),
                _others(point),
                "yes" if point["stable"] else "no",
                _valid(point),
            ]
        )
    return [
        f"## (a) {SCENARIO_TITLES['a']}",
        "",
        (
            "Client CPU: the busiest load generator process (share of one core). Server cores, "
            "harness and others: cores used by the server's processes, by the harness's own "
            "and by everything else on the machine (other users included) while the point "
            "ran; server CPU per request is the server's CPU time divided by the requests it "
            "answered. Mean batch: of the batches the answers came in, per answer (the "
            "server's own mean, per batch, is in the server-side table). "
            f"{CLIENT_LATE_NOTE}"
        ),
        "",
        *_table(
            [
                "configuration",
                "callers",
                "req/s",
                "p50",
                "p95",
                "p99",
                "p99.9",
                "mean batch",
                "client CPU",
                "server cores",
                "server CPU per request",
                "harness",
                "others",
                "stable",
                "valid",
            ],
            rows,
        ),
        "",
    ]


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cpu_per_request(cores: float | None, per_s: float) -> str:
    return "-" if cores is None or not per_s else _ms(cores * 1000 / per_s)


HOST_HEADER: Final = "cores: server / clients / harness / others"


def _host(point: dict[str, Any]) -> str:
    host = point["host"]
    return " / ".join(
        (
            _cores(host["server_cores"]),
            _cores(host["client_cores"]),
            # None also in a document written before the harness was counted apart.
            _cores(host.get("harness_cores")),
            _others(point),
        )
    )


def _others(point: dict[str, Any]) -> str:
    """The cores other processes used while the point ran, marked where that made the
    point busy; with a server the harness did not start, its cores and the others'
    together, which cannot be told apart."""
    host = point["host"]
    together = host.get("server_and_other_cores")
    if together is not None:
        return f"{_cores(together)} (server + others)"
    others = _cores(host["other_cores"])
    return f"{others} (busy)" if point.get("busy") else others


def _host_note(document: dict[str, Any]) -> list[str]:
    """What harness and others are, and the rule that marks a point busy, or that the
    points were measured before it; with --target, why it marks none."""
    note = (
        "Harness: the cores the harness's own processes used while a point ran (the "
        "orchestrator reading /proc and GetStats, and py-spy where it samples). Others: "
        "the cores busy on the machine beyond the server's "
        "processes, the load generator's and the harness's (where harness shows -, its "
        "cores are among them): other users of the machine, and the kernel's work for "
        "loopback traffic, which no process is charged for."
    )
    if not busy_rule(document):
        return [f"{note} Measured before the busy rule (verdicts stand as they were).", ""]
    note += (
        f" A point where others used more than {BUSY_OTHER_CORES} cores is *busy*: its "
        "figures describe a shared machine, a target read from it gets no verdict, and it "
        "is listed under warnings."
    )
    if document["settings"].get("target"):
        note += (
            " The server under test runs outside the harness (--target, no process id "
            "here): its CPU cannot be told from other processes', so its points show "
            "server + others together and none of them is marked busy."
        )
    return [note, ""]


# Arrivals not sent count as offered for validity (summary.offer_problem): the server
# held the calls that kept them back.
BACKLOG_NOTE: Final = (
    "client backlog (a client process held 20 000 unanswered calls: the server's doing, "
    "unless the client was late to see them end, which the client lateness rule judges)"
)


def _scenario_b(document: dict[str, Any]) -> list[str]:
    points = document["scenarios"]["b"]
    if not points:
        return []
    rows = []
    for point in points:
        stream = point["lanes"]["single"]
        latency = stream["latency"]
        rows.append(
            [
                point["configuration"],
                point["name"],
                _num(stream["offered_rate_per_s"]),
                _num(stream.get("achieved_rate_per_s")),
                _num(stream["throughput_per_s"]),
                _ms(latency["p50_ms"]),
                _ms(latency["p95_ms"]),
                _ms(latency["p99_ms"]),
                _ms(latency["p99_9_ms"]),
                _lag(stream),
                _late(stream),
                _host(point),
                "yes" if point["stable"] else "no",
                _valid(point),
            ]
        )
    return [
        f"## (b) {SCENARIO_TITLES['b']}",
        "",
        (
            "Latency counts from each request's scheduled arrival; client lag is how late the "
            "load generator sent it. Sent/s is the rate it achieved; a point where that, "
            f"with the arrivals held back as {BACKLOG_NOTE}, is under 95 % of the offered "
            "rate (beyond Poisson noise), or where its client lag p95 exceeds the stream's "
            "p50 latency (no deadline here: more than 5 % of the requests waited in the "
            "load generator longer than the typical request took in all), is not valid: "
            f"the load generator, not the server, was the limit. {CLIENT_LATE_NOTE}"
        ),
        "",
        *_table(
            [
                "configuration",
                "load",
                "offered/s",
                "sent/s",
                "answered OK/s",
                "p50",
                "p95",
                "p99",
                "p99.9",
                LAG_HEADER,
                LATE_HEADER,
                HOST_HEADER,
                "stable",
                "valid",
            ],
            rows,
        ),
        "",
    ]


LAG_HEADER: Final = "client lag p50 / p95 / p99"
LATE_HEADER: Final = "client late p95: loop / past gRPC deadline"
# The rule of summary.late_problem, as the tables' notes give it.
CLIENT_LATE_NOTE: Final = (
    "Client late: how late each client process's event loop was to a heartbeat every "
    f"{HEARTBEAT_S * 1000:g} ms, and how long past its gRPC deadline the client saw each "
    "call end (0 within it: gRPC ends every call by its deadline, so the rest was the "
    f"client's). Where the p{CLIENT_LATE_PERCENTILE} of either exceeds the stream's "
    "deadline, or without one its p50 latency (open loop), or "
    f"{CLIENT_LATE_WINDOW_SHARE * 100:g} % of the window, answers waited in the load "
    "generator: the point is not valid."
)


def _lag(stream: dict[str, Any]) -> str:
    """An open-loop stream's client lag percentiles (the validity rule reads the p95)."""
    lag = stream["client_lag"] or {}
    return " / ".join(_ms(lag.get(key)) for key in ("p50_ms", "p95_ms", "p99_ms"))


def _late(stream: dict[str, Any]) -> str:
    """The p95s of the client's lateness that the validity rule reads."""
    return " / ".join(
        _ms((stream[key] or {}).get("p95_ms"))
        for key in ("client_loop_late", "client_past_grpc_deadline")
    )


def _valid(point: dict[str, Any]) -> str:
    """Whether the load generator was not the limit (the reason is a warning)."""
    return "no" if point.get("valid") is False else "yes"


def _offered(stream: dict[str, Any]) -> str:
    """A stream's load: its callers (closed loop) or its rate (open loop), with why the
    stream is not valid where it is not (the rate achieved is in that reason where the
    load generator could not send the rate)."""
    if stream["mode"] == "closed":
        offered = f"{stream['concurrency']} callers"
    else:
        offered = f"{_num(stream['offered_rate_per_s'])}/s"
    if stream.get("valid") is False:
        offered += f" (not valid: {stream['invalid_reason']})"
    return offered


def _scenario_c(document: dict[str, Any]) -> list[str]:
    points = document["scenarios"]["c"]
    if not points:
        return []
    rows = []
    for point in points:
        for label, stream in point["lanes"].items():
            latency = stream["latency"]
            offered = _offered(stream)
            rows.append(
                [
                    point["configuration"],
                    point["name"],
                    f"{label} ({stream['rows']} rows)",
                    offered,
                    _num(stream["throughput_per_s"]),
                    _ms(latency["p50_ms"]),
                    _ms(latency["p99_ms"]),
                    _ms(latency["p99_9_ms"]),
                    _share(stream["latency_all_calls"]["ok_share"]),
                    _all_calls_p99(stream),
                    _reasons(stream["rejected"]),
                    _reasons({**stream["shed"], **stream["timed_out"], **stream["failed"]}),
                    _host(point),
                ]
            )
    return [
        f"## (c) {SCENARIO_TITLES['c']}",
        "",
        (
            "p50 / p99 / p99.9 are over OK answers. The isolation target reads the p99 over "
            "every call instead: a call not answered OK (refused, shed, timed out, failed, "
            "unanswered at the end of the windows) counts as +inf, an SLO miss, so that p99 "
            "is inf once more than about 1 % of the calls were not OK; the OK share is next "
            "to it."
        ),
        "",
        *_table(
            [
                "configuration",
                "point",
                "stream",
                "offered",
                "OK/s",
                "p50 (OK)",
                "p99 (OK)",
                "p99.9 (OK)",
                "OK share",
                "p99, all calls",
                "rejected",
                "shed / timed out / failed",
                HOST_HEADER,
            ],
            rows,
        ),
        "",
    ]


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _all_calls_p99(stream: dict[str, Any]) -> str:
    """The p99 over every call; inf where it falls on a call not answered OK."""
    every = stream["latency_all_calls"]
    if not every["calls"]:
        return "-"
    return "inf" if every["p99_ms"] is None else _ms(every["p99_ms"])


def _scenario_d(document: dict[str, Any]) -> list[str]:
    points = document["scenarios"]["d"]
    if not points:
        return []
    capacity = (document.get("capacity") or {}).get("throughput_per_s")
    rows = []
    for point in points:
        stream = point["lanes"]["default"]
        latency = stream["latency"]
        share = stream["goodput_per_s"] / capacity if capacity else None
        expired = stream["expired_executed"]
        rows.append(
            [
                point["configuration"],
                (stream["deadline_in"] or "-")
                + (", priority port" if _on_priority_port(point) else ""),
                _num(stream["offered_rate_per_s"]),
                _num(stream.get("achieved_rate_per_s")),
                _num(stream["goodput_per_s"]),
                "-" if share is None else f"{share:.0%}",
                _ms(latency["p50_ms"]),
                _ms(latency["p99_ms"]),
                _reasons(stream["rejected"]),
                _reasons({**stream["shed"], **stream["timed_out"], **stream["failed"]}),
                str(stream["late_ok"]),
                "- (not seen)" if expired is None else str(expired),
                _lag(stream),
                _late(stream),
                _host(point),
                _valid(point),
            ]
        )
    return [
        f"## (d) {SCENARIO_TITLES['d']}",
        "",
        (
            "Expired executed: OK answers whose latency from the scheduled send, less the "
            "session's run time (Timing.infer_us), exceeds the deadline, so they ran after "
            "it. Under a gRPC deadline the client cancels at the deadline and never sees "
            "such an answer: not measurable there. Sent/s is the rate the load generator "
            f"achieved; with the arrivals held back as {BACKLOG_NOTE} under 95 % of the "
            "offered rate, or where its client lag p95 exceeds the deadline (more than 5 % "
            f"of the requests were late before they left), the point is not valid. "
            f"{CLIENT_LATE_NOTE}"
        ),
        "",
        *_table(
            [
                "configuration",
                "deadline as",
                "offered/s",
                "sent/s",
                "goodput/s",
                "of capacity",
                "p50 (OK)",
                "p99 (OK)",
                "rejected",
                "shed / timed out / failed",
                "OK but late",
                "expired executed",
                LAG_HEADER,
                LATE_HEADER,
                HOST_HEADER,
                "valid",
            ],
            rows,
        ),
        "",
    ]


def _scenario_x(document: dict[str, Any]) -> list[str]:
    points = document["scenarios"].get("x") or []
    if not points:
        return []
    rows = []
    for point in points:
        for label, stream in point["lanes"].items():
            latency = stream["latency"]
            offered = _offered(stream)
            deadline = stream["deadline_ms"]
            rows.append(
                [
                    point["configuration"],
                    f"{label} ({stream['rows']} rows, {stream['lane'] or 'default lane'})",
                    offered,
                    "-" if deadline is None else f"{deadline} ms as {stream['deadline_in']}",
                    _num(stream["throughput_per_s"]),
                    _num(stream["throughput_rows_per_s"]),
                    _num(stream["goodput_per_s"]),
                    _ms(latency["p50_ms"]),
                    _ms(latency["p99_ms"]),
                    _ms(latency["p99_9_ms"]),
                    _reasons(stream["rejected"]),
                    _reasons({**stream["shed"], **stream["timed_out"], **stream["failed"]}),
                    _host(point),
                    "yes" if point["stable"] else "no",
                ]
            )
    return [
        f"## (x) {SCENARIO_TITLES['x']}",
        "",
        "Streams: " + "; ".join(f"`{spec}`" for spec in document["settings"].get("mix", [])),
        "",
        *_table(
            [
                "configuration",
                "stream",
                "offered",
                "deadline",
                "OK/s",
                "OK rows/s",
                "goodput/s",
                "p50",
                "p99",
                "p99.9",
                "rejected",
                "shed / timed out / failed",
                HOST_HEADER,
                "stable",
            ],
            rows,
        ),
        "",
    ]


def _workers_section(document: dict[str, Any]) -> list[str]:
    """How the kernel shared the N-workers baseline's load out over its processes."""
    rows = []
    for scenario in ("a", "b", "c", "d", "x"):
        for point in document["scenarios"].get(scenario) or []:
            entry = document["configurations"].get(point["configuration"]) or {}
            split = point.get("workers")
            if entry.get("kind") != "workers" or not split:
                continue
            rows.append(
                [
                    point["configuration"],
                    f"({scenario}) {point['name']}",
                    "; ".join(_worker_cell(worker) for worker in split),
                ]
            )
    if not rows:
        return []
    return [
        "## N workers: how SO_REUSEPORT shared the load out",
        "",
        (
            "The kernel hands each client connection to one worker when it opens (a hash "
            "of its addresses) and it stays there, so with a few connections the split is "
            "uneven (3/5 or 7/1 of 8) and the busiest worker bounds the point. Per worker: "
            "the client connections it held and the OK answers it gave (share). Counted by "
            "the client: each connection asks GetModel once as it opens and the worker "
            "answering names itself (its pid, in the initial metadata); a connection is "
            "taken to stay on its worker for the point."
        ),
        "",
        *_table(["configuration", "point", "per worker: connections, OK answers"], rows),
        "",
    ]


def _worker_cell(worker: dict[str, Any]) -> str:
    name = f"w{worker['worker']}" if worker["worker"] is not None else f"pid {worker['pid']}"
    share = "" if worker["ok_share"] is None else f" ({worker['ok_share']:.0%})"
    return f"{name}: {worker['connections']} conn, {_num(worker['ok'])} OK{share}"


def _memory_section(document: dict[str, Any]) -> list[str]:
    rows = []
    notes = []
    for name, entry in document["configurations"].items():
        memory = entry.get("memory")
        after_a = entry.get("memory_after_a") or {}
        if memory or after_a:
            memory = memory or {}
            measure = memory.get("measure") or after_a.get("measure")
            rows.append(
                [
                    name,
                    str(memory.get("processes", after_a.get("processes", "-"))),
                    _mib(after_a.get("unique_peak_bytes")),
                    _mib(memory.get("unique_peak_bytes")),
                    _mib(memory.get("unique_bytes")),
                    measure or "-",
                    _mib(after_a.get("peak_bytes")),
                    _mib(memory.get("peak_bytes")),
                    _mib(memory.get("bytes")),
                ]
            )
            if memory.get("note") or after_a.get("note"):
                notes.append(f"{name}: {memory.get('note') or after_a.get('note')}.")
    if not rows:
        return []
    return [
        f"## Memory of the server processes ({UNIQUE}, and PSS summed beside it)",
        "",
        (
            f"*{UNIQUE}*: {UNIQUE_DESCRIPTION}, from /proc/PID/smaps: every process's "
            "private pages, plus the pages of each mapped file the processes share, once "
            "however many of them map it. The memory target reads it. PSS (proportional "
            "set size, from /proc/PID/smaps_rollup), summed, is beside it: it divides each "
            "shared page among all the processes that map it, the harness's load generators "
            "among them, so it understates a configuration, one process by more than N. A "
            "peak is the largest figure sampled at the window boundaries while the load "
            "ran. The memory target compares the peak during (a), the work every "
            "configuration does: laneserve alone also runs (b)-(d), whose overloads fill its "
            "queues, so its peak over the whole run is not comparable with the baselines'."
        ),
        "",
        *notes,
        *([""] if notes else []),
        *_table(
            [
                "configuration",
                "processes",
                f"{UNIQUE}: peak during (a)",
                f"{UNIQUE}: peak during the run",
                f"{UNIQUE}: after the run",
                "measure",
                "peak during (a)",
                "peak during the run",
                "after the run",
            ],
            rows,
        ),
        "",
    ]


def _server_section(document: dict[str, Any]) -> list[str]:
    rows = []
    for scenario in ("a", "b", "c", "d"):
        for point in document["scenarios"][scenario]:
            server = point["server"]
            if not server:
                continue
            waits = ", ".join(
                f"{lane} {_ms(figures['queue_wait_ms']['p99'])}"
                for lane, figures in server["lanes"].items()
                if figures["admitted"]
            )
            # Run-time percentiles are the server's recent window at the point's end: with
            # no batch in the measured windows they describe an earlier point.
            ran = bool(server["batches"])
            rows.append(
                [
                    point["configuration"],
                    f"({scenario}) {point['name']}",
                    _num(server["batches"]),
                    _num(server["mean_batch_rows"], 1),
                    _ms(server["run_time_ms"]["p50"]) if ran else "-",
                    _ms(server["run_time_ms"]["p99"]) if ran else "-",
                    waits or "-",
                ]
            )
    if not rows:
        return []
    return [
        (
            "## Server side (GetStats: counts over the windows each point reports; run "
            "p50/p99 over the server's last 4096 runs, and queue wait p99 over each lane's "
            "last 4096 waits, at the end of those windows)"
        ),
        "",
        *_table(
            [
                "configuration",
                "point",
                "batches",
                "mean batch rows",
                "run p50",
                "run p99",
                "queue wait p99 by lane",
            ],
            rows,
        ),
        "",
    ]


def _threads_section(document: dict[str, Any]) -> list[str]:
    threads = document["server_threads"]
    if not threads:
        return []
    # py-spy names the Python threads by their OS thread id: "thread (1234): MainThread".
    profile = document["server_profile"] or {}
    python_names = {
        int(match.group(1)): match.group(2)
        for key in (profile.get("summary") or {}).get("by_thread", {})
        if (match := re.match(r"thread \((\d+)\): (.+)", key))
    }
    rows = [
        [
            str(entry["tid"]),
            python_names.get(entry["tid"], entry["name"]),
            _cores(entry["cores"]),
        ]
        for entry in threads["threads"]
    ]
    title = (
        f"## The server's CPU by thread ({threads['configuration']} at ({threads['scenario']}) "
        f"{threads['point']}; from /proc, native threads included)"
    )
    note = (
        "Threads py-spy saw carry their Python names; the rest are native (ONNX Runtime's "
        "pool, gRPC's pollers) or, without --py-spy, unnamed."
    )
    return [title, "", note, "", *_table(["thread id", "thread", "cores"], rows), ""]


def _profile_section(document: dict[str, Any]) -> list[str]:
    profile = document["server_profile"]
    if not profile or "summary" not in profile or "top_self" not in profile["summary"]:
        return []
    summary = profile["summary"]
    threads = ", ".join(
        f"{thread} {share:.0%}" for thread, share in list(summary["by_thread"].items())[:6]
    )
    return [
        (
            f"## Where the server's CPU goes (py-spy, {profile['configuration']} at "
            f"({profile['scenario']}) {profile['point']})"
        ),
        "",
        f"{summary['samples']} samples; by thread: {threads}.",
        "",
        *_table(
            ["self", "function"],
            ([f"{t['fraction']:.1%}", f"`{t['frame']}`"] for t in summary["top_self"]),
        ),
        "",
        *_table(
            ["inclusive", "function"],
            ([f"{t['fraction']:.1%}", f"`{t['frame']}`"] for t in summary["top_inclusive"]),
        ),
        "",
    ]


# ---- plots ---------------------------------------------------------------------


def write_plots(document: dict[str, Any], out_dir: Path) -> tuple[list[str], str | None]:
    """PNG plots; ([], why) when matplotlib is not installed."""
    try:
        import matplotlib as mpl  # noqa: PLC0415 - optional: the `bench` extra

        mpl.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the backend
    except ImportError:
        return [], (
            "plots skipped: matplotlib is not installed (pip install 'laneserve[bench]');"
            " the JSON and Markdown have every figure"
        )
    paths = []
    figure, axes = plt.subplots(figsize=(8, 5))
    for name in document["configurations"]:
        points = sorted(
            _points(document, "a", name), key=lambda p: p["lanes"]["single"]["concurrency"]
        )
        if not points:
            continue
        xs = [p["lanes"]["single"]["throughput_per_s"] for p in points]
        (line,) = axes.plot(
            xs,
            [p["lanes"]["single"]["latency"]["p50_ms"] for p in points],
            "o-",
            label=f"{name} p50",
        )
        axes.plot(
            xs,
            [p["lanes"]["single"]["latency"]["p99_ms"] for p in points],
            "s--",
            color=line.get_color(),
            label=f"{name} p99",
        )
        open_points = _points(document, "b", name)
        if open_points:
            axes.plot(
                [p["lanes"]["single"]["throughput_per_s"] for p in open_points],
                [p["lanes"]["single"]["latency"]["p99_ms"] for p in open_points],
                "x",
                markersize=9,
                color=line.get_color(),
                label=f"{name} p99, open loop (b)",
            )
    axes.set_xlabel("throughput (single-row requests/s)")
    axes.set_ylabel("latency (ms)")
    axes.set_yscale("log")
    axes.set_title("Latency versus throughput (closed loop by callers; x: open loop)")
    axes.grid(visible=True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    path = out_dir / "latency_vs_throughput.png"
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    paths.append(str(path))

    paths += _p99_bars(plt, document, out_dir)
    return paths, None


def _p99_bars(plt: Any, document: dict[str, Any], out_dir: Path) -> list[str]:
    """The p99 of every stream of (c), (d) and (x); [] when there is none."""
    # One bar per stream and point, read top-down: a horizontal chart keeps the long
    # point names on one line each, legible at any number of bars.
    bars: list[tuple[str, float, str]] = []
    for scenario in ("c", "d", "x"):
        for point in document["scenarios"].get(scenario) or []:
            if point["name"].startswith("bulk alone"):
                continue
            for label, stream in point["lanes"].items():
                p99 = stream["latency"]["p99_ms"]
                if p99 is not None:
                    where = f"{point['configuration']} ({scenario}) {point['name']}: {label}"
                    bars.append((where, p99, stream.get("lane") or label))
    if not bars:
        return []
    figure, axes = plt.subplots(figsize=(13.5, 1.2 + 0.32 * len(bars)))
    palette = {"interactive": "tab:blue", "bulk": "tab:orange"}
    rows = range(len(bars))
    axes.barh(
        rows,
        [value for _, value, _ in bars],
        color=[palette.get(lane, "tab:gray") for _, _, lane in bars],
    )
    for row, (_, value, _) in zip(rows, bars, strict=True):
        axes.annotate(
            _ms(value),
            (value, row),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    axes.set_yticks(rows, [where for where, _, _ in bars], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("p99 latency of OK answers (ms, log scale)")
    axes.set_xscale("log")
    axes.set_title("p99 per stream: isolation (c), overload (d), your mix (x)")
    axes.grid(visible=True, axis="x", which="both", alpha=0.3)
    path = out_dir / "p99_by_lane_under_overload.png"
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return [str(path)]


def write_outputs(document: dict[str, Any], out_dir: Path, *, plots: bool) -> dict[str, Any]:
    """Writes results.json, report.md and the plots into `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    evaluate_targets(document)
    outputs: dict[str, Any] = {
        "json": str(out_dir / "results.json"),
        "markdown": str(out_dir / "report.md"),
        "plots": [],
    }
    document["outputs"] = outputs
    if plots:
        outputs["plots"], skipped = write_plots(document, out_dir)
        if skipped:
            log.warning("%s", skipped)
            document["warnings"].append(skipped)
    Path(outputs["json"]).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    Path(outputs["markdown"]).write_text(render_markdown(document), encoding="utf-8")
    return outputs
