#!/usr/bin/env python3
"""The request path of two laneserve source trees, A against B, on one machine.

    .venv/bin/python scripts/bench_request_path.py --a-rev b7b83cd~1   # B: this checkout
    .venv/bin/python scripts/bench_request_path.py --a ../old/src --b src --rounds 5 \\
        --json ab.json

Each tree's `laneserve serve` runs in a process of its own (`python -m
laneserve.server.cli serve`, port 0, metrics off, the demo model, `--max-batch-size`),
with PYTHONPATH set to that tree's `src/` so that it and any process it starts import
that tree; a probe checks that it does before anything is measured. A revision
(`--a-rev`, `--b-rev`) is exported with `git archive` into a temporary folder, removed
at the end: nothing in the checkout or its .git changes. One server runs at a time:
started, warmed up, measured for `--seconds`, stopped. Rounds alternate the order (A B,
B A, A B, ...), so that drift on a shared machine, and going second, weigh on both.

The load is the benchmark harness's own (`laneserve.server.bench.loadgen`, this
checkout's for both trees): `--callers` closed-loop callers of one row each over real
gRPC, from `--client-procs` client processes with `--channels` channels each.

Read over each measured span (the server's CPU from /proc/PID/task/TID/stat, user +
system, at the load generator's window boundaries):
- answers/s, and p50 / p99 latency of the OK answers as the callers saw them;
- the event loop's CPU a request: the server's main thread (tid == pid), which runs
  `laneserve serve`'s asyncio loop and gRPC's handlers on it;
- the server's CPU a request: the whole process (/proc/PID/stat, so threads that ended
  count too), and in the JSON by thread name (comm) for the other threads. Python 3.11
  does not name its threads for the OS: the scheduler, engine and log threads sum under
  the interpreter's name, beside ONNX Runtime's and gRPC's native threads;
- the cores the load generator and the rest of the machine kept busy meanwhile
  (`other`: anything above ~0.1 on a quiet machine is a neighbour, and noise).

Prints Markdown tables: each round and the median over the rounds, with B/A per round
and the median of the rounds' ratios; `--json PATH` writes every figure. Linux only.
Not a test: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import grpc

from laneserve.server.bench import procs
from laneserve.server.bench.cli import interrupted, stop_signals_interrupt
from laneserve.server.bench.loadgen import ClientError, ClientPool, InputSpec, PointRun
from laneserve.server.bench.run import load_inputs
from laneserve.server.bench.settings import MAX_WINDOW_S, MIN_STABLE_WINDOWS, Profile, Stream
from laneserve.server.bench.summary import OK, client_cpu_fractions, combine, percentiles_ms
from laneserve.server.config import UINT32_MAX
from laneserve.server.flag_values import integer, seconds
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

REPO: Final = Path(__file__).resolve().parent.parent
DEFAULT_MODEL: Final = REPO / "models" / "demo.onnx"
SCHEMA: Final = "laneserve.bench_request_path/1"
LABEL: Final = "single"
RPC_TIMEOUT_S: Final = 10.0
PROBE_TIMEOUT_S: Final = 60.0
# The figures compared, in the tables' order: key -> column heading.
FIGURES: Final = {
    "answers_per_s": "answers/s",
    "latency_p50_ms": "p50 ms",
    "latency_p99_ms": "p99 ms",
    "event_loop_us_per_request": "event loop us/req",
    "server_us_per_request": "server us/req",
}
# Beside them, what shared the machine (not compared).
LOAD_FIGURES: Final = {"client_cores": "client cores", "other_cores": "other cores"}
# The event-loop thread's entry in a run's CPU by thread.
EVENT_LOOP: Final = "event loop (main thread)"
# Where `laneserve serve`'s module is found: the probe asks without running it.
PROBE: Final = (
    "import importlib.util; print(importlib.util.find_spec('laneserve.server.cli').origin)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Tree:
    """One side of the comparison: the folder that holds its `laneserve` package."""

    key: str  # "a" or "b"
    src: Path
    # The revision as given and its commit (None: a folder was given).
    rev: str | None = None
    commit: str | None = None

    @property
    def label(self) -> str:
        if self.rev is None:
            return str(self.src)
        assert self.commit is not None
        return f"{self.rev} ({self.commit[:7]})"

    def figures(self) -> dict[str, Any]:
        return {"label": self.label, "src": str(self.src), "rev": self.rev, "commit": self.commit}


@dataclasses.dataclass(frozen=True, slots=True)
class Reading:
    """The server's and the machine's CPU at one window boundary."""

    at_s: float  # monotonic
    # CPU seconds the whole process has used (its ended threads included).
    process_s: float | None
    # By thread id: its name (comm) and the CPU seconds it has used.
    threads: dict[int, tuple[str, float]]
    machine_busy_s: float | None


def read_server(pid: int) -> Reading:
    return Reading(
        at_s=time.monotonic(),
        process_s=procs.process_cpu_s(pid),
        threads=procs.thread_cpu_s(pid),
        machine_busy_s=procs.machine_busy_s(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path("/proc/self/task").is_dir():
        print("bench_request_path: needs Linux's /proc (per-thread CPU)", file=sys.stderr)
        return 2
    try:
        with stop_signals_interrupt(), contextlib.ExitStack() as stack:
            trees = [tree_of(stack, key, args) for key in ("a", "b")]
            for tree in trees:
                check_imports(tree)
            model = model_path(args.model)
            document = run_rounds(trees, model, args)
    except (procs.StartError, procs.ServerError, ClientError, ValueError) as error:
        print(f"bench_request_path: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:
        return interrupted("bench_request_path", error)
    document["command"] = shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    print_tables(document)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_request_path.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a_tree = parser.add_mutually_exclusive_group(required=True)
    a_tree.add_argument("--a", type=Path, help="tree A: a folder holding laneserve/ (its src)")
    a_tree.add_argument("--a-rev", help="tree A: a git revision of this checkout")
    b_tree = parser.add_mutually_exclusive_group()
    b_tree.add_argument(
        "--b", type=Path, help="tree B: a folder holding laneserve/ (default: this checkout's src)"
    )
    b_tree.add_argument("--b-rev", help="tree B: a git revision of this checkout")
    parser.add_argument("--callers", type=integer(1), default=32, help="default: %(default)s")
    parser.add_argument("--rounds", type=integer(1), default=3, help="default: %(default)s")
    parser.add_argument(
        "--seconds",
        type=seconds(zero_ok=False, maximum_s=MAX_WINDOW_S),
        default=10.0,
        help="measured per tree and round (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup-s",
        type=seconds(zero_ok=True, maximum_s=MAX_WINDOW_S),
        default=2.0,
        help="load before each measurement, not measured (default: %(default)s)",
    )
    parser.add_argument(
        "--client-procs", type=integer(1), default=2, help="load generator processes"
    )
    parser.add_argument(
        "--channels", type=integer(1), default=4, help="gRPC channels per client process"
    )
    parser.add_argument(
        "--max-batch-size", type=integer(1, UINT32_MAX), default=128, help="serve's batch cap"
    )
    parser.add_argument(
        "--model", type=Path, help=f"ONNX model (default: {DEFAULT_MODEL}, written if absent)"
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    return parser.parse_args(argv)


def tree_of(stack: contextlib.ExitStack, key: str, args: argparse.Namespace) -> Tree:
    """Tree `key` as the flags give it; a revision is exported into a temporary folder
    that `stack` removes."""
    rev: str | None = getattr(args, f"{key}_rev")
    if rev is None:
        folder: Path | None = getattr(args, key)
        return Tree(key, source_folder(f"--{key}", folder or REPO / "src"))
    root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"laneserve-{key}-")))
    commit = export_revision(f"--{key}-rev", rev, root)
    return Tree(key, source_folder(f"--{key}-rev", root / "src"), rev, commit)


def source_folder(flag: str, folder: Path) -> Path:
    """The folder holding `laneserve/`: `folder`, or a checkout's `src` below it."""
    folder = folder.absolute()
    for candidate in (folder, folder / "src"):
        if (candidate / "laneserve").is_dir():
            return candidate
    raise ValueError(f"{flag} {folder}: no laneserve/ in it or in its src/; expected a source tree")


def export_revision(flag: str, rev: str, into: Path) -> str:
    """Writes the tracked files of revision `rev` of this checkout into `into` (`git
    archive`: the index, the working tree and .git are left alone); its commit."""
    if rev.startswith("-"):
        raise ValueError(f"{flag} {rev!r}: expected a revision, not an option")
    where = f"{flag} {rev}"
    commit = git(where, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").decode().strip()
    archive = git(where, "archive", "--format=tar", commit)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        # "data": nothing written outside `into`; src/laneserve's links to ../../server
        # and the like stay inside it.
        tar.extractall(into, filter="data")
    return commit


def git(where: str, *args: str) -> bytes:
    """`git ARGS` in this checkout; its stdout. Refused naming `where` (the flag and its
    value) when it fails."""
    binary = shutil.which("git")
    if binary is None:
        raise ValueError(f"{where}: git is not on PATH")
    done = subprocess.run(  # noqa: S603 - git, with this script's own arguments
        [binary, "-C", str(REPO), *args], capture_output=True, check=False
    )
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip() or "no such revision"
        raise ValueError(f"{where}: git {args[0]} failed: {said}")
    return done.stdout


def server_env(tree: Tree) -> list[str]:
    """The command prefix that runs Python on `tree`: PYTHONPATH goes before the
    installed laneserve, and is inherited by the processes the server starts itself. `env`
    execs Python, so the pid the harness holds is the server's."""
    return ["env", f"PYTHONPATH={tree.src}", sys.executable]


def check_imports(tree: Tree) -> None:
    """Refuses a tree whose server would import laneserve from elsewhere (a folder
    without the server, or a layout this PYTHONPATH does not reach)."""
    done = subprocess.run(  # noqa: S603 - this interpreter, with a fixed probe
        [*server_env(tree), "-c", PROBE],
        capture_output=True,
        text=True,
        check=False,
        timeout=PROBE_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    origin = done.stdout.strip()
    if done.returncode != 0 or not Path(origin).is_relative_to(tree.src):
        found = origin or (done.stderr.strip().splitlines() or ["nowhere"])[-1]
        raise ValueError(
            f"tree {tree.key.upper()} ({tree.label}): laneserve.server.cli came from {found}; "
            f"expected it under {tree.src}"
        )


def model_path(given: Path | None) -> Path:
    if given is not None:
        if not given.is_file():
            raise ValueError(f"--model {given}: no such file; expected an ONNX model file")
        return given.absolute()
    if not DEFAULT_MODEL.exists():
        from laneserve.server.demo_model import make_demo_model  # noqa: PLC0415 - needs onnx

        print(f"writing the demo model to {DEFAULT_MODEL}", file=sys.stderr)
        make_demo_model(DEFAULT_MODEL)
    return DEFAULT_MODEL


def run_rounds(trees: Sequence[Tree], model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every round, each tree's server in turn (the order alternates); the document."""
    # The pool cuts a measurement into windows (two at least); the figures span them all.
    profile = Profile(
        name="request-path",
        warmup_s=args.warmup_s,
        window_s=args.seconds / MIN_STABLE_WINDOWS,
        stable_windows=MIN_STABLE_WINDOWS,
        max_windows=MIN_STABLE_WINDOWS,
        tolerance=0.5,
        concurrencies=(args.callers,),
        load_fractions=(1.0,),
        workers=(1,),
        baseline_scenarios=("a",),
        raw_seconds_per_size=0.0,
    )
    stream = Stream(label=LABEL, rows=1, concurrency=args.callers)
    document: dict[str, Any] = {
        "schema": SCHEMA,
        "settings": {
            "callers": args.callers,
            "rows": 1,
            "rounds": args.rounds,
            "measured_s": args.seconds,
            "warmup_s": args.warmup_s,
            "client_procs": args.client_procs,
            "channels_per_client_proc": args.channels,
            "serve_args": serve_args(model, args.max_batch_size),
        },
        "machine": {"cpu_count": os.cpu_count(), "loadavg_start": list(os.getloadavg())},
        "trees": {tree.key: tree.figures() for tree in trees},
        "rounds": [],
    }
    with ClientPool(processes=args.client_procs, channels=args.channels) as pool:
        for index in range(args.rounds):
            order = trees if index % 2 == 0 else trees[::-1]
            runs = {}
            for tree in order:
                print(f"round {index + 1}: {tree.key.upper()} {tree.label}", file=sys.stderr)
                runs[tree.key] = measure(pool, tree, model, stream, profile, args)
            document["rounds"].append(
                {
                    "round": index + 1,
                    "order": [tree.key for tree in order],
                    "a": runs["a"],
                    "b": runs["b"],
                    "ratio": ratios(runs["a"], runs["b"]),
                }
            )
    document["machine"]["loadavg_end"] = list(os.getloadavg())
    document["median"] = medians(document["rounds"])
    return document


def serve_args(model: Path, max_batch_size: int) -> list[str]:
    # Metrics off: a Prometheus reader records every request.
    return procs.serve_arguments(str(model), max_batch_size, metrics_port=-1)


def measure(
    pool: ClientPool,
    tree: Tree,
    model: Path,
    stream: Stream,
    profile: Profile,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Starts tree's server, offers it the load, stops it; the figures of the span."""
    argv = [
        *server_env(tree),
        "-m",
        "laneserve.server.cli",
        *serve_args(model, args.max_batch_size),
    ]
    deployment = procs.start_group(f"laneserve {tree.key.upper()}", "laneserve", lambda _: argv)
    server = deployment.processes[0]
    readings: dict[int, Reading] = {}
    try:
        run = pool.run_point(
            deployment.target,
            [stream],
            model_inputs(deployment.target),
            profile=profile,
            # Never settled: every measurement is the same number of windows long.
            judge=lambda _windows: False,
            on_boundary=lambda boundary: readings.__setitem__(boundary, read_server(server.pid)),
        )
        if server.process.poll() is not None:
            raise procs.ServerError(
                f"{server.name} exited while measured; its log:\n{server.log_tail()}"
            )
    finally:
        exit_codes = deployment.stop()
    start, end = readings[run.used[0].window], readings[run.used[-1].window + 1]
    figures = run_figures(run, start, end, server.pid)
    figures["exit_code"] = exit_codes[0]
    return figures


def model_inputs(target: str) -> tuple[InputSpec, ...]:
    """The served model's inputs as the load generator fills them (`run.load_inputs`)."""
    with grpc.insecure_channel(target) as channel:
        model = pb_grpc.InferenceServiceStub(channel).GetModel(
            pb.GetModelRequest(), timeout=RPC_TIMEOUT_S
        )
    return load_inputs(model)


def run_figures(run: PointRun, start: Reading, end: Reading, pid: int) -> dict[str, Any]:
    """One tree's figures in one round, over the windows between two readings."""
    record = combine(window.streams[LABEL] for window in run.used)
    measured_s = sum(window.wall_s for window in run.used)
    ok = record.outcomes.get(OK, 0)
    latency = percentiles_ms(record.ok_latency_s)
    span_s = end.at_s - start.at_s
    by_thread = thread_cpu_s(start, end, pid)
    server_s = (
        end.process_s - start.process_s
        if end.process_s is not None and start.process_s is not None
        else None
    )
    client_cores = sum(client_cpu_fractions(run.used))
    machine_cores = (
        (end.machine_busy_s - start.machine_busy_s) / span_s
        if end.machine_busy_s is not None and start.machine_busy_s is not None
        else None
    )
    other_cores = (
        max(0.0, machine_cores - server_s / span_s - client_cores)
        if machine_cores is not None and server_s is not None
        else None
    )

    def per_request_us(cpu_s: float | None) -> float | None:
        return cpu_s / ok * 1e6 if cpu_s is not None and ok else None

    return {
        "server_pid": pid,
        "measured_s": measured_s,
        "sent": record.sent,
        "ok": ok,
        "not_ok": {reason: n for reason, n in sorted(record.outcomes.items()) if reason != OK},
        "answers_per_s": ok / measured_s,
        "latency_p50_ms": latency["p50_ms"],
        "latency_p99_ms": latency["p99_ms"],
        "latency": latency,
        "event_loop_us_per_request": per_request_us(by_thread.get(EVENT_LOOP)),
        "server_us_per_request": per_request_us(server_s),
        "threads_us_per_request": {name: per_request_us(s) for name, s in by_thread.items()},
        "server_cores": server_s / span_s if server_s is not None else None,
        "client_cores": client_cores,
        "machine_busy_cores": machine_cores,
        "other_cores": other_cores,
    }


def thread_cpu_s(start: Reading, end: Reading, pid: int) -> dict[str, float]:
    """CPU seconds between two readings: the main thread's as EVENT_LOOP, the others
    summed by name, busiest first. A thread that ended meanwhile is missing (the whole
    process's figure has it); one that began counts from 0."""
    used: dict[str, float] = {}
    for tid, (name, cpu_s) in end.threads.items():
        key = EVENT_LOOP if tid == pid else name
        used[key] = used.get(key, 0.0) + cpu_s - start.threads.get(tid, (name, 0.0))[1]
    return dict(sorted(used.items(), key=lambda item: -item[1]))


def ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    return {key: ratio(a[key], b[key]) for key in FIGURES}


def median(values: Sequence[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def medians(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each tree's median of each figure over the rounds, and the median of the rounds'
    B/A ratios (paired: each ratio is of two runs that saw the same stretch of time)."""
    result: dict[str, Any] = {}
    for key in ("a", "b"):
        runs = [entry[key] for entry in rounds]
        names = {name for run in runs for name in run["threads_us_per_request"]}
        result[key] = {
            figure: median([run[figure] for run in runs]) for figure in [*FIGURES, *LOAD_FIGURES]
        }
        result[key]["threads_us_per_request"] = {
            name: median([run["threads_us_per_request"].get(name) for run in runs])
            for name in sorted(names)
        }
    result["ratio"] = {key: median([entry["ratio"][key] for entry in rounds]) for key in FIGURES}
    return result


def print_tables(document: dict[str, Any]) -> None:
    settings, trees = document["settings"], document["trees"]
    print(f"A: {trees['a']['label']}")
    print(f"B: {trees['b']['label']}")
    print(
        f"{settings['callers']} callers of 1 row ({settings['client_procs']} client processes x "
        f"{settings['channels_per_client_proc']} channels), {settings['measured_s']:g} s "
        f"measured after {settings['warmup_s']:g} s of warm-up per tree and round; "
        f"laneserve {shlex.join(settings['serve_args'])}; {document['machine']['cpu_count']} "
        f"CPUs, load average {document['machine']['loadavg_start'][0]:.1f} at the start"
    )
    columns = {**FIGURES, **LOAD_FIGURES}
    print()
    print("| round | tree | " + " | ".join(columns.values()) + " |")
    print("|---|---|" + "---:|" * len(columns))
    for entry in document["rounds"]:
        first = entry["order"][0].upper()
        where = f"{entry['round']} ({first} first)"
        print(row([where, "A"], entry["a"]))
        print(row(["", "B"], entry["b"]))
        print(row(["", "B/A"], entry["ratio"], as_ratio=True))
    rounds = len(document["rounds"])
    print(row([f"median of {rounds}", "A"], document["median"]["a"]))
    print(row(["", "B"], document["median"]["b"]))
    print(row(["", "B/A (median of the ratios)"], document["median"]["ratio"], as_ratio=True))
    print_threads(document["median"])
    print_failures(document["rounds"])


def row(head: list[str], figures: dict[str, Any], *, as_ratio: bool = False) -> str:
    """A table row: `head`, then every column (a ratio row leaves the load's blank)."""
    cells = [*head]
    for key in [*FIGURES, *LOAD_FIGURES]:
        if as_ratio and key in LOAD_FIGURES:
            cells.append("")
        else:
            cells.append(cell(figures.get(key), key, as_ratio=as_ratio))
    return "| " + " | ".join(cells) + " |"


def cell(value: float | None, key: str, *, as_ratio: bool) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if as_ratio:
        return f"{value:.2f}x"
    if key in LOAD_FIGURES:
        return f"{value:.2f}"
    if key.startswith("latency"):
        return f"{value:.1f}"
    return f"{value:,.0f}".replace(",", " ")  # thousands as the README writes them


def print_threads(median_figures: dict[str, Any]) -> None:
    """The server's CPU a request by thread, median over the rounds."""
    a, b = (
        median_figures["a"]["threads_us_per_request"],
        median_figures["b"]["threads_us_per_request"],
    )
    # Threads idle in both (gRPC's timers, mostly) are left to the JSON.
    busiest = {name: max(a.get(name) or 0.0, b.get(name) or 0.0) for name in {*a, *b}}
    names = sorted((name for name, us in busiest.items() if us > 0), key=lambda n: -busiest[n])
    print()
    print("| server thread (comm) | A us/req | B us/req | B/A |")
    print("|---|---:|---:|---:|")
    for name in names:
        cells = [cell(a.get(name), "us", as_ratio=False), cell(b.get(name), "us", as_ratio=False)]
        cells.append(cell(ratio(a.get(name), b.get(name)), "us", as_ratio=True))
        print(f"| {name} | " + " | ".join(cells) + " |")


def print_failures(rounds: Sequence[dict[str, Any]]) -> None:
    for entry in rounds:
        for key in ("a", "b"):
            run = entry[key]
            if run["not_ok"]:
                print(f"round {entry['round']}, {key.upper()}: not OK {run['not_ok']}")
            if run["exit_code"] != 0:
                print(f"round {entry['round']}, {key.upper()}: server exited {run['exit_code']}")


# The guard matters: the load generator's client processes are spawned, and a spawned
# process imports this file again as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
