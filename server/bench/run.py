"""The orchestrator: starts each configuration in its own processes, offers it the
scenarios' load points through the client pool, and gathers every figure in one document.

Order of a run: the raw ceiling (the machine still quiet), then the system under test
(laneserve, or an external endpoint) whose saturation throughput sets the offered rates
of scenarios (b)-(d) for every configuration, then the baselines one at a time: each is
started, measured, its memory read, and stopped before the next starts. Memory is
sampled at every window boundary while the load runs, and reported twice: after (a), the
work every configuration does, and at the end.

Every server-side reading of a point (GetStats, the processes' CPU, the machine's) is
taken at the window boundaries, so its differences span exactly the windows whose client
figures the point reports, and never the stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import logging
import math
import os
import platform
import resource
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import grpc
from google.protobuf import json_format

from laneserve.client.tensors import numpy_dtype
from laneserve.server.bench import procs
from laneserve.server.bench.loadgen import ClientPool, InputSpec
from laneserve.server.bench.profiling import PySpy, py_spy_binary
from laneserve.server.bench.settings import (
    BULK_SATURATION,
    BUSY_OTHER_CORES,
    DEFAULT_SCENARIOS,
    SCENARIOS,
    ConfigurationKind,
    DeadlineIn,
    MixStream,
    Point,
    Profile,
    ScenarioId,
    Stream,
    Via,
)
from laneserve.server.bench.summary import (
    client_cpu_fractions,
    combine,
    is_stable,
    summarize_stream,
    window_figures,
    worker_split,
)
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger("laneserve.bench")

SCHEMA: Final = "laneserve.bench/1"
# A client process busier than this fraction of one core may be what limits a point.
CLIENT_SATURATED_FRACTION: Final = 0.9
RPC_TIMEOUT_S: Final = 10.0
RAW_TIMEOUT_S: Final = 600.0
DEFAULT_MODEL: Final = "models/demo.onnx"
# Scenario (c) pins interactive to client process 1 and bulk to client process 0.
MIN_CLIENT_PROCESSES_FOR_C: Final = 2


@dataclasses.dataclass(frozen=True, slots=True)
class BenchSettings:
    profile: Profile
    out_dir: Path
    # The model every configuration serves; created (the demo model) when missing.
    model_path: str | None = None
    # An endpoint speaking laneserve.v1 to measure instead of starting laneserve, and
    # its priority port, if it serves one.
    target: str | None = None
    target_priority: str | None = None
    configurations: tuple[ConfigurationKind, ...] = ("laneserve", "echo", "no-batching", "workers")
    scenarios: tuple[ScenarioId, ...] = DEFAULT_SCENARIOS
    # The streams of scenario (x), offered together as one point.
    mix: tuple[MixStream, ...] = ()
    raw_ceiling: bool = True
    client_processes: int = 2
    channels_per_process: int = 4
    max_batch_size: int = 128
    intra_op_threads: int = 0
    device: str = "auto"
    # Pool threads of the no-batching server (each runs one request at a time).
    no_batching_threads: int = dataclasses.field(default_factory=procs.usable_cores)
    laneserve_config: str | None = None
    workers: tuple[int, ...] | None = None  # None: the profile's
    py_spy: bool = False
    seed: int = 0
    command: str = ""

    def __post_init__(self) -> None:
        if "x" in self.scenarios and not self.mix:
            raise ValueError("scenario x offers the streams of --mix; none was given")
        if self.target_priority is not None and self.target is None:
            raise ValueError("--target-priority names the priority port of a --target; no --target")
        if "c" in self.scenarios and self.client_processes < MIN_CLIENT_PROCESSES_FOR_C:
            raise ValueError(
                f"scenario c pins its interactive and bulk streams to client processes of "
                f"their own; with --client-procs {self.client_processes} they would share one"
                f", and the bulk flood would delay interactive calls inside the load "
                f"generator. Give --client-procs {MIN_CLIENT_PROCESSES_FOR_C} or more, or "
                f"--scenarios without c"
            )


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Runs everything `settings` asks for and returns the document (not yet written)."""
    started_s = time.monotonic()
    model_path = _model_path(settings)
    document = _new_document(settings, model_path)
    if settings.raw_ceiling and model_path is not None:
        log.info("raw ceiling: back-to-back session runs, no RPC")
        raw = _raw_ceiling(settings, model_path)
        document["raw_ceiling"] = raw
        if raw["busy"]:
            _warn(document, busy_warning("raw ceiling", raw["host"]["other_cores"]))
    with ClientPool(
        processes=settings.client_processes,
        channels=settings.channels_per_process,
        seed=settings.seed,
    ) as pool:
        runner = _Runner(settings, pool, document)
        for kind in _kinds_in_order(settings, model_path):
            for starter in _starters(settings, kind, model_path):
                runner.run_configuration(starter)
    document["duration_s"] = time.monotonic() - started_s
    document["environment"]["loadavg_end"] = list(os.getloadavg())
    return document


def _model_path(settings: BenchSettings) -> str | None:
    if settings.model_path is not None:
        path = Path(settings.model_path)
        if not path.is_file():
            found = "is a directory" if path.is_dir() else "no such file"
            raise FileNotFoundError(
                f"--model {settings.model_path}: {found}; expected an ONNX model file"
            )
        return settings.model_path
    if settings.target is not None:
        return None  # an external endpoint alone: no baselines, no raw ceiling
    path = Path(DEFAULT_MODEL)
    if not path.exists():
        from laneserve.server.demo_model import make_demo_model  # noqa: PLC0415 - needs onnx

        log.info("writing the demo model to %s", path)
        make_demo_model(path)
    return str(path)


def _kinds_in_order(settings: BenchSettings, model_path: str | None) -> list[ConfigurationKind]:
    kinds: list[ConfigurationKind] = ["laneserve"]  # the system under test always runs
    if model_path is None:
        return kinds
    return kinds + [kind for kind in settings.configurations if kind != "laneserve"]


def _starters(
    settings: BenchSettings, kind: ConfigurationKind, model_path: str | None
) -> list[Callable[[], procs.Deployment]]:
    if kind == "laneserve" and settings.target is not None:
        target, priority = settings.target, settings.target_priority
        return [
            lambda: procs.Deployment(
                name="target", kind="external", target=target, priority_target=priority
            )
        ]
    assert model_path is not None
    device = settings.device
    if kind == "laneserve":
        return [
            lambda: procs.start_laneserve(
                model_path,
                max_batch_size=settings.max_batch_size,
                intra_op_threads=settings.intra_op_threads,
                device=device,
                config_path=settings.laneserve_config,
            )
        ]
    if kind == "echo":
        return [lambda: procs.start_echo(model_path, device=device)]
    if kind == "no-batching":
        return [
            lambda: procs.start_no_batching(
                model_path,
                threads=settings.no_batching_threads,
                intra_op_threads=settings.intra_op_threads,
                device=device,
            )
        ]

    def workers(count: int) -> Callable[[], procs.Deployment]:
        # --intra-op-threads applies to every configuration; 0 (auto) shares the usable
        # cores out among the workers instead of letting each take them all.
        threads = settings.intra_op_threads or procs.default_worker_threads(count)
        return lambda: procs.start_workers(
            model_path, workers=count, intra_op_threads=threads, device=device
        )

    return [workers(count) for count in settings.workers or settings.profile.workers]


def _new_document(settings: BenchSettings, model_path: str | None) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": settings.command,
        "profile": dataclasses.asdict(settings.profile),
        "settings": {
            "target": settings.target,
            "target_priority": settings.target_priority,
            "mix": [mix.spec for mix in settings.mix],
            "configurations": list(settings.configurations),
            "scenarios": list(settings.scenarios),
            "client_processes": settings.client_processes,
            "channels_per_process": settings.channels_per_process,
            "max_batch_size": settings.max_batch_size,
            "intra_op_threads": settings.intra_op_threads,
            "device": settings.device,
            "no_batching_threads": settings.no_batching_threads,
            "laneserve_config": settings.laneserve_config,
            "seed": settings.seed,
        },
        "environment": _environment(),
        "model": {"path": model_path},
        "primary": None,
        "capacity": None,
        "raw_ceiling": None,
        "configurations": {},
        "scenarios": {scenario: [] for scenario in SCENARIOS},
        "server_profile": None,
        "server_threads": None,
        "targets": [],
        "warnings": [],
        "outputs": {},
        "duration_s": None,
    }


def _environment() -> dict[str, Any]:
    versions = {}
    for package in ("grpcio", "protobuf", "numpy", "onnxruntime-gpu", "onnxruntime"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return {
        "cpu_count": os.cpu_count(),
        # The cores this run may use (its CPU affinity), which may be fewer.
        "usable_cores": procs.usable_cores(),
        "loadavg_start": list(os.getloadavg()),
        "loadavg_end": None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def _raw_ceiling(settings: BenchSettings, model_path: str) -> dict[str, Any]:
    argv = procs.python_module(
        procs.BASELINES_MODULE,
        "raw",
        "--model",
        model_path,
        "--max-batch-size",
        str(settings.max_batch_size),
        "--seconds-per-size",
        str(settings.profile.raw_seconds_per_size),
        "--intra-op-threads",
        str(settings.intra_op_threads),
        "--device",
        settings.device,
    )
    # The sweep's process stands in the server's place: the machine's busy cores less its
    # own and the orchestrator's (waiting for it) are the others'.
    start = _sweep_mark()
    done = subprocess.run(  # noqa: S603 - argv is built here, never from input
        argv, capture_output=True, text=True, timeout=RAW_TIMEOUT_S, check=False
    )
    end = _sweep_mark()
    if done.returncode != 0:
        raise procs.StartError(f"raw ceiling failed (exit {done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    # Over the whole sweep, the session's start-up included; no clients run.
    host = _host_figures(start, end, 0.0)
    result["host"] = {
        "cpu_count": host["cpu_count"],
        "raw_cores": host["server_cores"],
        "harness_cores": host["harness_cores"],
        "machine_busy_cores": host["machine_busy_cores"],
        "other_cores": host["other_cores"],
    }
    result["busy"] = machine_busy(host["other_cores"])
    return result


def _sweep_mark() -> Mark:
    return Mark(
        at_s=time.monotonic(),
        stats=None,
        server_cpu_s=_children_cpu_s(),
        machine_busy_s=procs.machine_busy_s(),
        threads=None,
        harness_cpu_s=harness_cpu_s(()),
    )


def _children_cpu_s() -> float:
    """CPU seconds used by this process's children that have ended and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load_inputs(model: pb.GetModelResponse) -> tuple[InputSpec, ...]:
    """The served model's inputs as the load generator fills them (dynamic sizes 1)."""
    return tuple(
        InputSpec(
            name=spec.name,
            dtype=numpy_dtype(spec.dtype).str,
            trailing_shape=tuple(dim if dim > 0 else 1 for dim in spec.shape[1:]),
        )
        for spec in model.inputs
    )


class _Runner:
    def __init__(self, settings: BenchSettings, pool: ClientPool, document: dict[str, Any]):
        self.settings = settings
        self.profile = settings.profile
        self.pool = pool
        self.document = document
        self.inputs: tuple[InputSpec, ...] = ()
        self.lanes: list[str] = []
        # Set by the system under test, used for every configuration's offered load.
        self.capacity_per_s: float | None = None
        self.bulk_capacity_rows_per_s: float | None = None

    def run_configuration(self, start: Callable[[], procs.Deployment]) -> None:
        deployment = start()
        try:
            primary = self.document["primary"] is None
            if primary:
                self.document["primary"] = deployment.name
                self._read_model(deployment)
            scenarios = self._scenarios_for(deployment, primary=primary)
            entry: dict[str, Any] = {
                "kind": deployment.kind,
                "target": deployment.target,
                "settings": deployment.settings,
                "scenarios_run": scenarios,
                # The baselines run (a) alone while the system under test goes on to the
                # overloads of (b)-(d): only the peak during (a) compares the same work.
                "memory_after_a": None,
                "memory": None,
            }
            self.document["configurations"][deployment.name] = entry
            log.info("%s on %s: scenarios %s", deployment.name, deployment.target, scenarios)
            for scenario in scenarios:
                measured = False
                points = self._points(
                    scenario, primary=primary, priority=deployment.priority_target is not None
                )
                for point in points:
                    self._measure(deployment, point)
                    measured = True
                    if primary and scenario == "a":
                        self._note_capacity(deployment.name)
                    if primary and point.name == BULK_SATURATION:
                        self._note_bulk_capacity(deployment.name)
                if scenario == "a" and measured and deployment.processes:
                    entry["memory_after_a"] = deployment.memory()
            entry["memory"] = deployment.memory() if deployment.processes else None
        finally:
            codes = deployment.stop()
            if any(code not in (0, None) for code in codes):
                self._warn(f"{deployment.name} exited with status {codes} when stopped")

    def _scenarios_for(self, deployment: procs.Deployment, *, primary: bool) -> list[ScenarioId]:
        wanted: set[ScenarioId] = set(self.settings.scenarios)
        mix = self.settings.mix
        to_priority = any(each.template.port == "priority" for each in mix)
        if primary:
            if wanted & {"b", "c", "d"}:
                wanted.add("a")  # the offered rates of (b)-(d) come from its capacity
            if "x" in wanted:
                self._check_mix(deployment)
                if any(each.capacity_share is not None for each in mix):
                    wanted.add("a")
            if "c" in wanted and not {"interactive", "bulk"} <= set(self.lanes):
                self._warn(f"(c) skipped: {deployment.name} has no 'interactive' and 'bulk' lanes")
                wanted.discard("c")
        elif deployment.kind == "echo":
            wanted &= {"a"}
        else:
            wanted &= set(self.profile.baseline_scenarios)
            if self.capacity_per_s is None:
                wanted &= {"a"}
            if self.bulk_capacity_rows_per_s is None:
                wanted.discard("c")
            if "x" in wanted and to_priority:
                self._warn(f"(x) skipped on {deployment.name}: it has no priority port")
                wanted.discard("x")
        return [scenario for scenario in SCENARIOS if scenario in wanted]

    def _check_mix(self, deployment: procs.Deployment) -> None:
        """Refuses, before anything runs, a mix the system under test cannot serve."""
        for each in self.settings.mix:
            lane = each.template.lane
            if lane and lane not in self.lanes:
                raise ValueError(
                    f"--mix {each.label}: lane {lane!r} is not served by {deployment.name}; "
                    f"expected one of {self.lanes}"
                )
            if each.template.port == "priority" and deployment.priority_target is None:
                raise ValueError(
                    f"--mix {each.label}: port=priority, but {deployment.name} has no "
                    "priority port (with --target, give it as --target-priority HOST:PORT)"
                )

    def _points(
        self, scenario: ScenarioId, *, primary: bool, priority: bool = False
    ) -> Iterator[Point]:
        """The points of `scenario`; `priority`: the server has a priority port, and (c)
        measures the unary flood once more with interactive calls sent there, (d) its
        overload once more sent there."""
        profile = self.profile
        if scenario == "a":
            for callers in profile.concurrencies:
                yield Point("a", f"c={callers}", (Stream("single", concurrency=callers),))
            return
        if scenario == "x":  # a rate given as a share of the capacity made (a) run first
            mix = self.settings.mix
            yield Point(
                "x", "mix", tuple(m.stream(capacity_per_s=self.capacity_per_s) for m in mix)
            )
            return
        capacity = self.capacity_per_s
        assert capacity is not None, "(a) runs first"
        if scenario == "b":
            for fraction in profile.load_fractions:
                yield Point(
                    "b",
                    f"{fraction:.0%}",
                    (Stream("single", rate_per_s=fraction * capacity),),
                )
        elif scenario == "c":
            # Interactive and bulk callers are different services: each is pinned to a
            # client process of its own (own connections, own event loop), so the bulk
            # flood cannot delay interactive calls inside the load generator itself.
            interactive = Stream(
                "interactive",
                lane="interactive",
                rate_per_s=profile.interactive_fraction * capacity,
                client=1,
            )
            yield Point("c", "interactive alone", (interactive,))
            if primary:
                callers = max(2, math.ceil(2 * self.settings.max_batch_size / profile.bulk_rows))
                yield Point(
                    "c",
                    BULK_SATURATION,
                    (Stream("bulk", lane="bulk", rows=profile.bulk_rows, concurrency=callers),),
                )
            bulk_rows_per_s = self.bulk_capacity_rows_per_s
            assert bulk_rows_per_s is not None, "the bulk saturation point runs first"
            # Twice: bulk over InferStream, the bulk API (the server reads a stream only
            # as fast as its window allows), and as a flood of unary calls.
            ways: tuple[tuple[Via, str], ...] = (("stream", "InferStream"), ("unary", "Infer"))
            for via, how in ways:
                bulk = Stream(
                    "bulk",
                    lane="bulk",
                    rows=profile.bulk_rows,
                    rate_per_s=profile.bulk_fraction * bulk_rows_per_s / profile.bulk_rows,
                    via=via,
                    client=0,
                )
                yield Point(
                    "c",
                    f"with bulk at {profile.bulk_fraction:.0%} over {how}",
                    (interactive, bulk),
                )
                if via == "unary" and priority:
                    # The deployment that meets a unary flood: interactive callers on the
                    # priority port, where gRPC's core does not queue them behind bulk.
                    yield Point(
                        "c",
                        f"with bulk at {profile.bulk_fraction:.0%} over Infer, "
                        "interactive on the priority port",
                        (dataclasses.replace(interactive, port="priority"), bulk),
                    )
        else:
            # Twice: the deadline as timeout_ms, where every answer and its Timing come
            # back (an expired request that ran is seen), and as a plain gRPC deadline.
            deadlines: tuple[tuple[DeadlineIn, str], ...] = (
                ("timeout_ms", "timeout_ms"),
                ("grpc", "gRPC deadline"),
            )
            overload = Stream(
                "default",
                rate_per_s=profile.overload_fraction * capacity,
                deadline_ms=profile.overload_deadline_ms,
            )
            label = f"{profile.overload_fraction:.0%}, {profile.overload_deadline_ms} ms"
            for deadline_in, how in deadlines:
                yield Point(
                    "d",
                    f"{label} {how}",
                    (dataclasses.replace(overload, deadline_in=deadline_in),),
                )
            if priority:
                # The deployment for deadline-bound callers: the priority port, whose
                # queue in gRPC's core is bounded for deadlines (priority_max_pending_calls).
                yield Point(
                    "d",
                    f"{label} timeout_ms, on the priority port",
                    (dataclasses.replace(overload, deadline_in="timeout_ms", port="priority"),),
                )

    def _read_model(self, deployment: procs.Deployment) -> None:
        """Reads the system under test's model and lanes; raises StartError when it does
        not answer GetModel (nothing listens at a --target, or it is not laneserve.v1)."""
        target = deployment.target
        with grpc.insecure_channel(target) as channel:
            try:
                model = pb_grpc.InferenceServiceStub(channel).GetModel(
                    pb.GetModelRequest(), timeout=RPC_TIMEOUT_S
                )
            except grpc.RpcError as error:
                call: Any = error  # at run time also a grpc.Call; the stubs cannot say so
                where = (
                    f"--target {target}"
                    if deployment.kind == "external"
                    else f"{deployment.name} on {target}"
                )
                raise procs.StartError(
                    f"{where}: {call.code().name}: {call.details()} (GetModel); expected a "
                    "reachable laneserve.v1 endpoint"
                ) from None
        self.inputs = load_inputs(model)
        self.lanes = [lane.name for lane in model.lanes]
        self.document["model"].update(
            {
                "served_path": model.model_path,
                "inputs": [_spec(spec) for spec in model.inputs],
                "outputs": [_spec(spec) for spec in model.outputs],
                "batch_cap": model.batch_cap,
                "providers": list(model.providers),
                "lanes": [
                    {
                        "name": lane.name,
                        "capacity_rows": lane.capacity_rows,
                        "timeout_ms": lane.timeout_ms,
                        "max_wait_ms": lane.max_wait_ms,
                        "min_share": lane.min_share,
                        "is_default": lane.is_default,
                    }
                    for lane in model.lanes
                ],
            }
        )

    def _measure(self, deployment: procs.Deployment, point: Point) -> None:
        log.info("  %s (%s) %s", deployment.name, point.scenario, point.name)
        profile = self.profile
        # Readings at every window boundary, by boundary (0: the end of the warm-up).
        marks: dict[int, Mark] = {}
        # The server's CPU by thread, at the point where the server is profiled.
        by_thread = self._profiled_point(deployment, point)

        spy = self._maybe_spy(deployment, point)
        # py-spy is the harness's: its CPU is not counted as other processes'.
        helper_pids = (spy.pid,) if spy is not None else ()

        def at_boundary(index: int) -> None:
            marks[index] = take_mark(deployment, by_thread=by_thread, helper_pids=helper_pids)

        try:
            run = self.pool.run_point(
                deployment.target,
                point.streams,
                self.inputs,
                profile=profile,
                judge=lambda windows: is_stable(
                    [window_figures(window) for window in windows],
                    count=profile.stable_windows,
                    tolerance=profile.tolerance,
                ),
                on_boundary=at_boundary,
                priority_target=deployment.priority_target,
            )
        finally:
            spied = spy.stop() if spy is not None else None
        # The readings around the windows the client figures come from.
        start = marks.get(run.used[0].window)
        end = marks.get(run.used[-1].window + 1)
        if start is not None and end is not None and start.threads and end.threads:
            self.document["server_threads"] = {
                "configuration": deployment.name,
                "scenario": point.scenario,
                "point": point.name,
                "threads": _thread_cores((start.at_s, start.threads), (end.at_s, end.threads)),
            }
        if spy is not None and spied is not None:
            self.document["server_profile"] = {
                "configuration": deployment.name,
                "scenario": point.scenario,
                "point": point.name,
                "file": str(spy.output),
                "summary": spied,
            }
        duration_s = sum(window.wall_s for window in run.used)
        lanes = {
            stream.label: summarize_stream(
                stream,
                combine(window.streams[stream.label] for window in run.used),
                duration_s,
                window_s=profile.window_s,
            )
            for stream in point.streams
        }
        invalid = [
            f"{label}: {lane['invalid_reason']}"
            for label, lane in lanes.items()
            if not lane["valid"]
        ]
        cpu = client_cpu_fractions(run.used) or [0.0]
        saturated = max(cpu) >= CLIENT_SATURATED_FRACTION
        result: dict[str, Any] = {
            "configuration": deployment.name,
            "scenario": point.scenario,
            "name": point.name,
            "streams": [dataclasses.asdict(stream) for stream in point.streams],
            "stable": run.stable,
            # False: the load generator was the limit for one of the streams (see
            # invalid_reason); its figures do not describe the server at that load.
            "valid": not invalid,
            "invalid_reason": "; ".join(invalid) or None,
            "windows_measured": len(run.windows),
            "windows_used": len(run.used),
            "measured_s": duration_s,
            "per_window": [
                {
                    "window": window.window,
                    "wall_s": window.wall_s,
                    "streams": window_figures(window),
                }
                for window in run.windows
            ],
            "lanes": lanes,
            "total": {
                key: sum(lane[key] for lane in lanes.values())
                for key in (
                    "sent_per_s",
                    "answered_per_s",
                    "throughput_per_s",
                    "throughput_rows_per_s",
                    "goodput_per_s",
                    "goodput_rows_per_s",
                )
            },
            "client": {
                "processes": self.pool.processes,
                "channels_per_process": self.pool.channels,
                "cpu_fraction_max": max(cpu),
                "cpu_fraction_mean": sum(cpu) / len(cpu),
                "saturated": saturated,
                # The client's lateness at the validity rule's percentile, the largest
                # of the streams' (None: not measured); per stream in `lanes`.
                "loop_late_p95_ms": _largest(lanes, "client_loop_late"),
                "past_grpc_deadline_p95_ms": _largest(lanes, "client_past_grpc_deadline"),
            },
            "server": stats_delta(
                start.stats if start is not None else None, end.stats if end is not None else None
            ),
            # Per server process (N workers behind one port): the connections it held and
            # the OK answers it gave; None where the server does not name its processes.
            "workers": worker_split(run.used, [process.pid for process in deployment.processes]),
            "host": _host_figures(start, end, sum(cpu)),
        }
        # True: other processes kept the machine busy (`host.other_cores` over
        # BUSY_OTHER_CORES), and no target verdict is read from the point; None: not
        # known (no /proc, or a server the harness did not start: its CPU is the others').
        result["busy"] = machine_busy(result["host"]["other_cores"])
        self.document["scenarios"][point.scenario].append(result)
        where = f"{deployment.name} ({point.scenario}) {point.name}"
        if result["busy"]:
            self._warn(busy_warning(where, result["host"]["other_cores"]))
        if not run.stable:
            self._warn(f"{where}: not stable within {len(run.windows)} windows")
        if invalid:
            self._warn(
                f"{where}: not valid, the load generator was the limit ({result['invalid_reason']})"
            )
        if saturated:
            self._warn(
                f"{where}: a client process used {max(cpu):.0%} of a core; the load "
                "generator may be the limit"
            )

    def _profiled_point(self, deployment: procs.Deployment, point: Point) -> bool:
        """laneserve started here, at the highest load of (a)."""
        return bool(
            deployment.kind == "laneserve"
            and deployment.processes
            and point.name == f"c={max(self.profile.concurrencies)}"
        )

    def _maybe_spy(self, deployment: procs.Deployment, point: Point) -> PySpy | None:
        if not (self.settings.py_spy and self._profiled_point(deployment, point)):
            return None
        binary = py_spy_binary()
        if binary is None:
            self._warn("--py-spy: py-spy is not installed (pip install 'laneserve[bench]')")
            return None
        output = self.settings.out_dir / "py-spy-laneserve.txt"
        output.parent.mkdir(parents=True, exist_ok=True)
        return PySpy(binary, deployment.processes[0].pid, output)

    def _note_capacity(self, name: str) -> None:
        points = [p for p in self.document["scenarios"]["a"] if p["configuration"] == name]
        best = max(points, key=lambda p: p["total"]["throughput_per_s"])
        self.capacity_per_s = best["total"]["throughput_per_s"]
        self.document["capacity"] = {
            "configuration": name,
            "point": best["name"],
            "throughput_per_s": self.capacity_per_s,
            # False: the point did not settle; the verdicts read from it say so.
            "stable": best["stable"],
        }

    def _note_bulk_capacity(self, name: str) -> None:
        (point,) = [
            p
            for p in self.document["scenarios"]["c"]
            if p["configuration"] == name and p["name"] == BULK_SATURATION
        ]
        self.bulk_capacity_rows_per_s = point["lanes"]["bulk"]["throughput_rows_per_s"]
        assert self.document["capacity"] is not None
        self.document["capacity"]["bulk_rows_per_s"] = self.bulk_capacity_rows_per_s

    def _warn(self, message: str) -> None:
        _warn(self.document, message)


def _warn(document: dict[str, Any], message: str) -> None:
    log.warning("%s", message)
    document["warnings"].append(message)


def machine_busy(other_cores: float | None) -> bool | None:
    """Whether processes other than the ones measured kept more than BUSY_OTHER_CORES
    busy; None where that is not known."""
    return None if other_cores is None else other_cores > BUSY_OTHER_CORES


def busy_warning(where: str, other_cores: float) -> str:
    return (
        f"{where}: machine busy: {other_cores:.2f} cores used by other processes (more than "
        f"{BUSY_OTHER_CORES}); its figures describe a shared machine"
    )


def _largest(lanes: dict[str, dict[str, Any]], key: str) -> float | None:
    """The largest p95 of the percentiles under `key` over the streams of a point."""
    return max(
        (late for lane in lanes.values() if (late := lane[key]["p95_ms"]) is not None),
        default=None,
    )


def _thread_cores(
    start: tuple[float, dict[int, tuple[str, float]]],
    end: tuple[float, dict[int, tuple[str, float]]],
) -> list[dict[str, Any]]:
    """Cores each thread used between two readings, busiest first (idle ones left out).
    Python does not name its threads for the OS, so its threads are all called after the
    interpreter here; py-spy's thread ids tell them apart in the report."""
    wall_s = end[0] - start[0]
    used = []
    for tid, (name, cpu_s) in end[1].items():
        cores = (cpu_s - start[1].get(tid, (name, 0.0))[1]) / wall_s
        if cores >= IDLE_THREAD_CORES:
            used.append({"tid": tid, "name": name, "cores": cores})
    return sorted(used, key=lambda entry: -entry["cores"])


IDLE_THREAD_CORES: Final = 0.005


@dataclasses.dataclass(frozen=True, slots=True)
class Mark:
    """The server-side readings taken at one window boundary, while the load runs."""

    at_s: float  # monotonic
    # GetStats (None: the server does not implement it).
    stats: pb.GetStatsResponse | None
    # CPU seconds used so far by the server's processes, and by the whole machine.
    server_cpu_s: float | None
    machine_busy_s: float | None
    # By thread of the server's first process: its name and CPU seconds (None: not read).
    threads: dict[int, tuple[str, float]] | None
    # CPU seconds used so far by the harness itself (harness_cpu_s; None: not known).
    harness_cpu_s: float | None


def take_mark(deployment: procs.Deployment, *, by_thread: bool, helper_pids: Sequence[int]) -> Mark:
    """Readings at a window boundary; samples the deployment's memory too. The clocks
    are read first, the GetStats call (milliseconds) last; its CPU is the harness's,
    read at the next boundary."""
    mark = Mark(
        at_s=time.monotonic(),
        stats=None,
        server_cpu_s=deployment.cpu_s(),
        machine_busy_s=procs.machine_busy_s(),
        threads=procs.thread_cpu_s(deployment.processes[0].pid) if by_thread else None,
        harness_cpu_s=harness_cpu_s(helper_pids),
    )
    deployment.sample_memory()
    # On the priority port where there is one: gRPC's core queues calls per port, so the
    # reading is not held up behind the load it measures.
    stats = get_stats(deployment.priority_target or deployment.target)
    return dataclasses.replace(mark, stats=stats)


def harness_cpu_s(helper_pids: Sequence[int]) -> float | None:
    """CPU seconds used so far by the harness itself: this process (the orchestrator:
    its /proc readings, GetStats calls, the client pool's pipes; the client processes
    count apart) and the helpers it runs beside the server (py-spy; see
    BUSY_OTHER_CORES). None where a helper cannot be read (gone, or no /proc): its seconds so far
    would be missing from the sum."""
    used = time.process_time()
    for pid in helper_pids:
        helper = procs.process_cpu_s(pid)
        if helper is None:
            return None
        used += helper
    return used


def _host_figures(start: Mark | None, end: Mark | None, client_cores: float) -> dict[str, Any]:
    """Cores busy between two boundaries: the server's processes, the client processes,
    the harness's own (`harness_cpu_s`), the whole machine, and what is left for
    everything else (other users of the machine; `other_cores` counts the harness there
    only where its CPU is not known). Where the server's CPU is not known (an endpoint
    the harness did not start: no pid) it cannot be told from the others': the rest of
    the machine is `server_and_other_cores`, and `other_cores` None."""
    figures: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "server_cores": None,
        "client_cores": client_cores,
        "harness_cores": None,
        "machine_busy_cores": None,
        "other_cores": None,
        "server_and_other_cores": None,
    }
    if start is None or end is None or end.at_s <= start.at_s:
        return figures
    server_start, busy_start = start.server_cpu_s, start.machine_busy_s
    server_end, busy_end = end.server_cpu_s, end.machine_busy_s
    wall_s = end.at_s - start.at_s
    if server_start is not None and server_end is not None:
        figures["server_cores"] = (server_end - server_start) / wall_s
    if start.harness_cpu_s is not None and end.harness_cpu_s is not None:
        figures["harness_cores"] = (end.harness_cpu_s - start.harness_cpu_s) / wall_s
    if busy_start is not None and busy_end is not None:
        figures["machine_busy_cores"] = (busy_end - busy_start) / wall_s
        rest = figures["machine_busy_cores"] - client_cores - (figures["harness_cores"] or 0.0)
        if figures["server_cores"] is None:
            figures["server_and_other_cores"] = max(0.0, rest)
        else:
            figures["other_cores"] = max(0.0, rest - figures["server_cores"])
    return figures


def _spec(spec: pb.TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "dtype": numpy_dtype(spec.dtype).name, "shape": list(spec.shape)}


def get_stats(target: str) -> pb.GetStatsResponse | None:
    """The server's GetStats; None from a server that does not implement it."""
    with grpc.insecure_channel(target) as channel:
        try:
            response: pb.GetStatsResponse = pb_grpc.InferenceServiceStub(channel).GetStats(
                pb.GetStatsRequest(), timeout=RPC_TIMEOUT_S
            )
        except grpc.RpcError as error:
            # At run time the error is also a grpc.Call; the stubs cannot say so.
            call: Any = error
            if call.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise procs.ServerError(
                f"GetStats on {target}: {call.code().name}: {call.details()}; expected the "
                "server under test to answer while the load runs (did it exit?)"
            ) from None
    return response


def stats_delta(
    before: pb.GetStatsResponse | None, after: pb.GetStatsResponse | None
) -> dict[str, Any] | None:
    """Server-side figures between two readings (the boundaries of the windows a point
    reports): counters as differences, latency summaries as the server's recent window
    at the end."""
    if before is None or after is None:
        return None
    batches = after.batches - before.batches
    rows = after.rows_run - before.rows_run
    earlier = {lane.name: lane for lane in before.lanes}
    lanes = {}
    for lane in after.lanes:
        old = earlier.get(lane.name, pb.LaneStats())
        lanes[lane.name] = {
            "admitted": lane.admitted - old.admitted,
            "completed": lane.completed - old.completed,
            "failed": lane.failed - old.failed,
            "rejected": _map_delta(lane.rejected, old.rejected),
            "shed": _map_delta(lane.shed, old.shed),
            "queue_wait_ms": _summary(lane.queue_wait),
            "depth_rows_at_end": lane.depth_rows,
        }
    return {
        # Everything the server reported at the end, including fields newer than this
        # harness (uint64 values are strings there, as protobuf's JSON mapping has it).
        "snapshot_at_end": json_format.MessageToDict(after, preserving_proto_field_name=True),
        "batches": batches,
        "rows_run": rows,
        "mean_batch_rows": rows / batches if batches else None,
        "run_time_ms": _summary(after.run_time),
        "batch_cap": after.batch_cap,
        "lanes": lanes,
    }


def _map_delta(after: Any, before: Any) -> dict[str, int]:
    return {
        key: int(value) - int(before.get(key, 0))
        for key, value in sorted(after.items())
        if int(value) - int(before.get(key, 0))
    }


def _summary(summary: pb.LatencySummary) -> dict[str, float]:
    return {"p50": summary.p50_ms, "p95": summary.p95_ms, "p99": summary.p99_ms}


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(argv)
