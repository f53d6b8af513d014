"""`laneserve bench` (also `scripts/bench.py`): runs the benchmark and writes its report.

laneserve bench --profile quick            # about two minutes on 2 cores
laneserve bench --profile full --py-spy    # the figures for bench/README.md
laneserve bench --target 127.0.0.1:50051 --configs laneserve --scenarios a,b
laneserve bench --target 127.0.0.1:50051 \
    --mix lane=interactive,rate=10%,deadline_ms=50 --mix lane=bulk,rows=64,callers=8,via=stream
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from laneserve.server.bench.loadgen import ClientError
from laneserve.server.bench.procs import ServerError, StartError
from laneserve.server.bench.report import verdict_text, write_outputs
from laneserve.server.bench.run import BenchSettings, command_line, run_bench
from laneserve.server.bench.settings import (
    CONFIGURATION_KINDS,
    DEFAULT_SCENARIOS,
    MAX_WINDOW_S,
    MIN_STABLE_WINDOWS,
    MIX_KEYS,
    PROFILES,
    SCENARIOS,
    ConfigurationKind,
    MixStream,
    ScenarioId,
)
from laneserve.server.config import DEVICES, MAX_INTRA_OP_THREADS, UINT32_MAX
from laneserve.server.flag_values import integer, seconds, target

RESULTS_DIR = Path("bench/results")
# Signals that end a run as Ctrl-C does: `timeout`, a CI job's cancel, a closed terminal.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# The exit status of a run stopped by a signal: 128 + its number, as a shell reports it.
SIGNAL_EXIT_BASE = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), default="quick", help="timing and grid of the run"
    )
    parser.add_argument("--model", help="ONNX model for every configuration (default: the demo)")
    parser.add_argument(
        "--target",
        type=target,
        help="HOST:PORT of a laneserve.v1 endpoint to measure instead of laneserve",
    )
    parser.add_argument(
        "--configs",
        type=_kinds,
        default=CONFIGURATION_KINDS,
        help=f"configurations, comma-separated (default: all of {','.join(CONFIGURATION_KINDS)})",
    )
    parser.add_argument(
        "--target-priority",
        type=target,
        help="HOST:PORT of the --target's priority port, if it has one",
    )
    parser.add_argument(
        "--scenarios",
        type=_scenarios,
        help="scenarios, e.g. a,b (default: a,b,c,d; x alone with --mix)",
    )
    parser.add_argument(
        "--mix",
        type=_mix_stream,
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help="a stream of scenario x, offered together with the other --mix streams; keys: "
        # argparse %-formats help texts: a "%" of the keys' texts must be doubled.
        + "; ".join(f"{key}: {meaning}" for key, meaning in MIX_KEYS.items()).replace("%", "%%"),
    )
    parser.add_argument("--workers", type=_counts, help="N-workers process counts, e.g. 2,4")
    parser.add_argument(
        "--concurrencies",
        type=_counts,
        help="callers of the (a) points, e.g. 1,32,64,128 (default: the profile's; the "
        "targets read 32 and 64)",
    )
    parser.add_argument("--no-raw", action="store_true", help="skip the raw session ceiling")
    parser.add_argument(
        "--client-procs", type=integer(1), default=2, help="load generator processes"
    )
    parser.add_argument(
        "--channels", type=integer(1), default=4, help="gRPC channels per client process"
    )
    parser.add_argument(
        "--max-batch-size",
        type=integer(1, UINT32_MAX),
        default=128,
        help="laneserve's batch cap",
    )
    parser.add_argument(
        "--intra-op-threads",
        type=integer(0, MAX_INTRA_OP_THREADS),
        default=0,
        help="ONNX Runtime threads (0 = auto)",
    )
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument(
        "--no-batching-threads", type=integer(1), help="thread pool of the no-batching server"
    )
    parser.add_argument("--laneserve-config", help="TOML config passed to laneserve serve")
    parser.add_argument("--out", type=Path, help="output folder (default: bench/results/<time>)")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    parser.add_argument(
        "--py-spy", action="store_true", help="profile laneserve at the highest (a) load"
    )
    parser.add_argument(
        "--warmup-s",
        type=seconds(zero_ok=True, maximum_s=MAX_WINDOW_S),
        help="override the profile's warm-up",
    )
    parser.add_argument(
        "--window-s",
        type=seconds(zero_ok=False, maximum_s=MAX_WINDOW_S),
        help="override the profile's window",
    )
    parser.add_argument(
        "--max-windows",
        type=integer(MIN_STABLE_WINDOWS),
        help="override the profile's window cap (at least its stable windows)",
    )
    parser.add_argument(
        "--seed", type=integer(0), default=0, help="seed of the load's arrivals and inputs"
    )


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _kinds(text: str) -> tuple[ConfigurationKind, ...]:
    kinds = _split(text)
    unknown = [kind for kind in kinds if kind not in CONFIGURATION_KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {unknown}; expected some of {list(CONFIGURATION_KINDS)}"
        )
    return tuple(kind for kind in CONFIGURATION_KINDS if kind in kinds)


def _scenarios(text: str) -> tuple[ScenarioId, ...]:
    wanted = _split(text) if "," in text else list(text.strip())
    unknown = [s for s in wanted if s not in SCENARIOS]
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(
            f"unknown scenario(s) {unknown}; expected some of {list(SCENARIOS)}"
        )
    return tuple(s for s in SCENARIOS if s in wanted)


def _mix_stream(text: str) -> MixStream:
    try:
        return MixStream.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in _split(text))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 2,4; got {text!r}")
    return counts


def _unique_labels(mix: Sequence[MixStream]) -> tuple[MixStream, ...]:
    """Streams of one point need distinct labels: a repeated one (two streams on the same
    lane, say) gets its position appended: bulk, bulk-2."""
    seen: set[str] = set()
    unique = []
    taken = {each.label for each in mix}
    for index, each in enumerate(mix, start=1):
        label, suffix = each.label, index
        while label in seen or (label != each.label and label in taken):
            label, suffix = f"{each.label}-{suffix}", suffix + 1
        seen.add(label)
        unique.append(
            dataclasses.replace(each, template=dataclasses.replace(each.template, label=label))
        )
    return tuple(unique)


def settings_from(args: argparse.Namespace, argv: Sequence[str]) -> BenchSettings:
    profile = PROFILES[args.profile]
    overrides = {
        key: value
        for key, value in (
            ("warmup_s", args.warmup_s),
            ("window_s", args.window_s),
            ("max_windows", args.max_windows),
            ("concurrencies", args.concurrencies),
        )
        if value is not None
    }
    if args.max_windows is not None and args.max_windows < profile.stable_windows:
        raise ValueError(
            f"--max-windows: expected at least {profile.stable_windows} (the windows that "
            f"must agree in profile {profile.name!r}), got {args.max_windows}"
        )
    if overrides:
        profile = dataclasses.replace(profile, **overrides)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    settings = BenchSettings(
        profile=profile,
        out_dir=args.out or RESULTS_DIR / f"{stamp}-{profile.name}",
        model_path=args.model,
        target=args.target,
        target_priority=args.target_priority,
        configurations=args.configs,
        scenarios=args.scenarios or (("x",) if args.mix else DEFAULT_SCENARIOS),
        mix=_unique_labels(args.mix),
        raw_ceiling=not args.no_raw,
        client_processes=args.client_procs,
        channels_per_process=args.channels,
        max_batch_size=args.max_batch_size,
        intra_op_threads=args.intra_op_threads,
        device=args.device,
        laneserve_config=args.laneserve_config,
        workers=args.workers,
        py_spy=args.py_spy,
        seed=args.seed,
        command=command_line(argv),
    )
    if args.no_batching_threads is not None:
        settings = dataclasses.replace(settings, no_batching_threads=args.no_batching_threads)
    return settings


class Stopped(KeyboardInterrupt):
    """A stop signal, raised where the main thread is, as Ctrl-C's KeyboardInterrupt is:
    every `finally` on the way out runs, so every process the run started is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP end the run as Ctrl-C does (by default they would end the
    process at once, leaving the servers it started running); the previous handlers
    come back afterwards. Only in the main thread, where Python runs signal handlers."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def interrupted(prog: str, error: KeyboardInterrupt) -> int:
    """The exit code of a run `prog` stopped on Ctrl-C, SIGTERM or SIGHUP (`Stopped`), said
    on stderr: every process it started has been stopped by then."""
    print(f"{prog}: stopped; every process it started was stopped", file=sys.stderr)
    signum = error.signum if isinstance(error, Stopped) else signal.SIGINT
    return SIGNAL_EXIT_BASE + signum


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Runs the benchmark of parsed `args` (`argv`: the whole command line, for the
    report); 0 when it completed, whatever the verdicts."""
    try:
        settings = settings_from(args, argv)
        with stop_signals_interrupt():
            document = run_bench(settings)
    except (StartError, ServerError, ClientError, FileNotFoundError, ValueError) as error:
        print(f"laneserve bench: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:
        return interrupted("laneserve bench", error)
    outputs = write_outputs(document, settings.out_dir, plots=not args.no_plots)
    print(f"wrote {outputs['markdown']} and {outputs['json']}")
    for path in outputs["plots"]:
        print(f"wrote {path}")
    for verdict in document["targets"]:
        print(target_line(verdict))
    return 0


def target_line(target: dict[str, Any]) -> str:
    """A target's verdict as the end of a run prints it, a miss in capitals (read from
    an unstable point or not: "MISSED (unstable point)")."""
    verdict = verdict_text(target)
    if verdict.startswith("missed"):
        verdict = "MISSED" + verdict.removeprefix("missed")
    return f"  {verdict:>12}  {target['description']}: {target['measured']}"


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="laneserve bench", description=__doc__)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    add_arguments(parser)
    args = parser.parse_args(arguments)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run(args, [sys.argv[0], *arguments])
