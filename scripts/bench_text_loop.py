#!/usr/bin/env python3
"""What handling long text off the event loop buys interactive calls, measured in one run.

    .venv/bin/python scripts/bench_text_loop.py                  # 2 callers of 512 000 strings
    .venv/bin/python scripts/bench_text_loop.py --seconds 20 --rounds 3
    .venv/bin/python scripts/bench_text_loop.py --numbers 8192   # 16 MiB of numbers, hashed

With `--numbers ROWS` the bulk requests are ROWS rows of the demo model's 512 float32
(with their request_ids: their fingerprint, over EVENT_LOOP_HASH_BYTES, is taken on the
text thread's hasher as shipped, on the loop with the bound patched too).

laneserve decodes a request, and encodes a batch's answers, of more than
EVENT_LOOP_TEXT_ELEMENTS STRING elements on a thread kept for it (server/text_thread.py),
not on its event loop (~0.3 us an element).
The same server runs in two modes: `off loop`, as shipped, and `on loop`, with
EVENT_LOOP_TEXT_ELEMENTS patched, in the server's process, to
a count no request reaches (every request decoded and every answer encoded on the loop,
as before the thread), in each module that reads it.
Each mode's server is a process of its own (`python -c`: the patch, then `laneserve
serve`'s main) on the text model (demo_model.make_text_model: 3 strings a row), loopback,
port 0, metrics off, `--max-batch-size`, its bulk lane (DEFAULT_LANES otherwise) widened
to hold every bulk caller's request at once. One server at a time: started, loaded for
`--warmup-s`, measured for `--seconds`, stopped (SIGTERM); rounds alternate the order.

The load is the harness's own (laneserve.server.bench.loadgen), from two client
processes, so that neither shares the server's GIL or the other's event loop: in one,
`--bulk-callers` closed-loop callers send requests of `--bulk-strings` strings (rounded
down to whole rows) in lane bulk, encoded once, each call adding its own request_id;
in the other, 1-row requests in the server's default lane arrive at `--interactive-rate`
a second (Poisson; timed from their scheduled arrival, so a stalled server cannot hide
the calls it held back), and their latencies are the figures. A fixed rate offers both
modes the same interactive work: one caller back to back (`--interactive-rate 0`) sent
17 times as many calls in the off-loop mode, whose batches took turns from the bulk
ones, and the bulk throughputs then compared the interactive loads as much as the
decodes.

Prints a Markdown table: per mode, over its rounds, the interactive p50 / p99 / max and
count, the bulk requests answered and the bulk strings/s; then the ratios (on-loop /
off-loop interactive p99, off-loop / on-loop bulk strings/s). Client and server share
this machine's cores. Not a test: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import grpc
import numpy as np

from laneserve.server.bench import procs
from laneserve.server.bench.cli import interrupted, stop_signals_interrupt
from laneserve.server.bench.loadgen import (
    MESSAGE_LIMIT_BYTES,
    ClientError,
    ClientPool,
    InputSpec,
    request_body,
)
from laneserve.server.bench.run import load_inputs
from laneserve.server.bench.script_parts import describe_host, size_text
from laneserve.server.bench.settings import MAX_WINDOW_S, MIN_STABLE_WINDOWS, Profile, Stream
from laneserve.server.bench.summary import OK, StreamWindow, combine, percentiles_ms
from laneserve.server.config import DEFAULT_LANES, UINT32_MAX
from laneserve.server.demo_model import make_demo_model, make_text_model
from laneserve.server.flag_values import integer, seconds
from laneserve.server.text_thread import EVENT_LOOP_HASH_BYTES, EVENT_LOOP_TEXT_ELEMENTS
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

OFF_LOOP: Final = "off loop"
ON_LOOP: Final = "on loop"
MODE_TITLES: Final = {
    OFF_LOOP: "reads off the loop (as shipped)",
    ON_LOOP: "reads on the loop (patched)",
}
INTERACTIVE: Final = "interactive"
BULK: Final = "bulk"
BULK_LANE: Final = "bulk"
RPC_TIMEOUT_S: Final = 10.0
# The server: the stop signals caught before the heavy imports, as laneserve.server.entry
# does; in the on-loop mode the constant patched in the module that reads it
# (text_thread's `read_off_loop` for requests, `encoded_off_loop` for answers). A name
# that is gone would be set silently, measuring nothing: refused.
SERVER_PROGRAM: Final = """\
import sys
from laneserve.server.process import catch_stop_signals_early
catch_stop_signals_early()
from laneserve.server import cli, text_thread
limit = {limit!r}
if limit is not None:
    for name in ("EVENT_LOOP_TEXT_ELEMENTS", "EVENT_LOOP_HASH_BYTES"):
        if not hasattr(text_thread, name):
            sys.exit(f"text_thread has no {{name}} to patch")
        setattr(text_thread, name, limit)
sys.exit(cli.main())
"""
# The on-loop mode's limit: more STRING elements, or bytes, than any request can carry.
NO_REQUEST_REACHES: Final = sys.maxsize


@dataclasses.dataclass(frozen=True)
class Load:
    """The streams offered to every server, and the size of a bulk request."""

    inputs: tuple[InputSpec, ...]
    interactive: Stream
    bulk: Stream
    bulk_units: int  # STRING elements (or rows of numbers) of one bulk request
    unit: str  # "strings", "rows"
    bulk_bytes: int  # its serialized size


@dataclasses.dataclass
class ModeRecords:
    """What the client processes saw of one mode, over its rounds."""

    interactive: list[StreamWindow] = dataclasses.field(default_factory=list)
    bulk: list[StreamWindow] = dataclasses.field(default_factory=list)
    measured_s: float = 0.0
    exit_codes: list[int] = dataclasses.field(default_factory=list)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench_text_loop.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--bulk-strings",
        type=integer(EVENT_LOOP_TEXT_ELEMENTS + 1),
        default=512_000,
        help="STRING elements a bulk request (default: %(default)s)",
    )
    parser.add_argument(
        "--numbers",
        type=integer(0),
        default=0,
        help="bulk requests of this many rows of the demo model's numbers, not text "
        "(default: %(default)s, text)",
    )
    parser.add_argument("--bulk-callers", type=integer(1), default=2, help="default: %(default)s")
    parser.add_argument(
        "--interactive-rate",
        type=float,
        default=50.0,
        help="1-row requests/s, Poisson arrivals; 0: one caller back to back "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--seconds",
        type=seconds(zero_ok=False, maximum_s=MAX_WINDOW_S),
        default=10.0,
        help="measured per mode and round (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup-s",
        type=seconds(zero_ok=True, maximum_s=MAX_WINDOW_S),
        default=2.0,
        help="load before each measurement, not measured (default: %(default)s)",
    )
    parser.add_argument("--rounds", type=integer(1), default=1, help="default: %(default)s")
    parser.add_argument(
        "--max-batch-size",
        type=integer(1, UINT32_MAX),
        default=1024,
        help="serve's batch cap (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.interactive_rate < math.inf:
        parser.error(f"--interactive-rate {args.interactive_rate}: expected a rate >= 0")
    host = describe_host()  # the load average before this run adds its own
    try:
        with stop_signals_interrupt(), tempfile.TemporaryDirectory() as scratch:
            load, records = run_modes(Path(scratch), args)
    except (procs.StartError, procs.ServerError, ClientError, ValueError) as error:
        print(f"bench_text_loop: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:
        return interrupted("bench_text_loop", error)
    print_table(host, load, records, args)
    return 0


def run_modes(scratch: Path, args: argparse.Namespace) -> tuple[Load, dict[str, ModeRecords]]:
    """Every round, each mode's server in turn (the order alternates); the load offered
    and each mode's records."""
    model = scratch / "model.onnx"
    if args.numbers:
        make_demo_model(model)
    else:
        make_text_model(model)
    config = scratch / "lanes.toml"
    # A row holds one string at least: room for every bulk caller's request at once.
    bulk_rows = args.numbers or args.bulk_strings
    config.write_text(lanes_toml(bulk_rows * args.bulk_callers), encoding="utf-8")
    profile = Profile(
        name="text-loop",
        warmup_s=args.warmup_s,
        window_s=args.seconds / MIN_STABLE_WINDOWS,
        stable_windows=MIN_STABLE_WINDOWS,
        max_windows=MIN_STABLE_WINDOWS,
        tolerance=0.5,
        concurrencies=(1,),
        load_fractions=(1.0,),
        workers=(1,),
        baseline_scenarios=("a",),
        raw_seconds_per_size=0.0,
    )
    records = {OFF_LOOP: ModeRecords(), ON_LOOP: ModeRecords()}
    load: Load | None = None
    with ClientPool(processes=2, channels=1) as pool:
        for index in range(args.rounds):
            order = [OFF_LOOP, ON_LOOP] if index % 2 == 0 else [ON_LOOP, OFF_LOOP]
            for mode in order:
                print(f"round {index + 1}: {mode}", file=sys.stderr)
                deployment = start_server(mode, model, config, args.max_batch_size)
                try:
                    if load is None:
                        load = load_of(model_inputs(deployment.target), args)
                    measure(pool, deployment, load, profile, records[mode])
                finally:
                    records[mode].exit_codes += deployment.stop()
    assert load is not None
    return load, records


def start_server(mode: str, model: Path, config: Path, max_batch_size: int) -> procs.Deployment:
    """`laneserve serve` in `mode`, once it serves (StartError, with its log, if not)."""
    limit = NO_REQUEST_REACHES if mode == ON_LOOP else None
    argv = [
        sys.executable,
        "-c",
        SERVER_PROGRAM.format(limit=limit),
        *procs.serve_arguments(str(model), max_batch_size, metrics_port=-1),
        *("--config", str(config)),
    ]
    return procs.start_group(f"laneserve {mode}", "laneserve", lambda _port: argv)


def model_inputs(target: str) -> tuple[InputSpec, ...]:
    """The served model's inputs as the load generator fills them (`run.load_inputs`)."""
    with grpc.insecure_channel(target) as channel:
        model = pb_grpc.InferenceServiceStub(channel).GetModel(
            pb.GetModelRequest(), timeout=RPC_TIMEOUT_S
        )
    return load_inputs(model)


def load_of(inputs: Sequence[InputSpec], args: argparse.Namespace) -> Load:
    """The streams: the bulk requests of as many whole rows as `--bulk-strings` holds.
    Raises ValueError for a model without text, or a request the channel cannot carry."""
    if args.numbers:
        rows, units, unit = args.numbers, args.numbers, "rows"
    else:
        strings_per_row = sum(
            math.prod(spec.trailing_shape) for spec in inputs if np.dtype(spec.dtype).hasobject
        )
        if strings_per_row == 0:
            raise ValueError("the model has no STRING input; expected the text model")
        rows = args.bulk_strings // strings_per_row
        units, unit = rows * strings_per_row, "strings"
        if units <= EVENT_LOOP_TEXT_ELEMENTS:
            raise ValueError(
                f"--bulk-strings {args.bulk_strings}: {rows} rows of {strings_per_row} strings "
                f"are at most {EVENT_LOOP_TEXT_ELEMENTS}, decoded on the loop in both modes; "
                "expected more"
            )
    # Pinned to client processes of their own: the bulk answers (megabytes each) are read
    # on another event loop than the one that times the interactive calls.
    if args.interactive_rate > 0:
        interactive = Stream(INTERACTIVE, rate_per_s=args.interactive_rate, client=0)
    else:
        interactive = Stream(INTERACTIVE, concurrency=1, client=0)
    rng = np.random.default_rng(0)
    bulk = Stream(label=BULK, lane=BULK_LANE, rows=rows, concurrency=args.bulk_callers, client=1)
    # Each string takes its 4-byte length at least: tens of millions are refused before
    # they are encoded. The others as the client processes encode them (once each).
    least_bytes = units * 4
    body = b"" if least_bytes > MESSAGE_LIMIT_BYTES else request_body(bulk, inputs, rng)
    if not body or len(body) > MESSAGE_LIMIT_BYTES - 1024:  # room for the request_id
        size = size_text(len(body)) if body else f"at least {size_text(least_bytes)}"
        raise ValueError(
            f"a bulk request of {size}; expected one within the "
            f"{size_text(MESSAGE_LIMIT_BYTES)} message limit (fewer {unit})"
        )
    if args.numbers and len(body) <= EVENT_LOOP_HASH_BYTES:
        raise ValueError(
            f"--numbers {args.numbers}: a request of {size_text(len(body))} is hashed on the "
            f"loop in both modes (at most {size_text(EVENT_LOOP_HASH_BYTES)}); expected more"
        )
    return Load(tuple(inputs), interactive, bulk, units, unit, len(body))


def lanes_toml(bulk_rows: int) -> str:
    """DEFAULT_LANES as a config file, the bulk lane holding at least `bulk_rows`."""
    lanes = [
        dataclasses.replace(lane, capacity_rows=max(lane.capacity_rows, bulk_rows))
        if lane.name == BULK_LANE
        else lane
        for lane in DEFAULT_LANES
    ]
    lines = []
    for lane in lanes:
        lines.append("[[lanes]]")
        # json writes a name, a count and a share as TOML reads them.
        lines += [f"{key} = {json.dumps(value)}" for key, value in dataclasses.asdict(lane).items()]
    return "\n".join(lines) + "\n"


def measure(
    pool: ClientPool,
    deployment: procs.Deployment,
    load: Load,
    profile: Profile,
    records: ModeRecords,
) -> None:
    """Offers `load` to the server after the warm-up; adds what was measured to
    `records`."""
    server = deployment.processes[0]
    run = pool.run_point(
        deployment.target,
        [load.interactive, load.bulk],
        load.inputs,
        profile=profile,
        judge=lambda _windows: False,  # never settled: every mode is measured as long
    )
    if server.process.poll() is not None:
        raise procs.ServerError(
            f"{server.name} exited while measured; its log:\n{server.log_tail()}"
        )
    records.interactive += [window.streams[INTERACTIVE] for window in run.used]
    records.bulk += [window.streams[BULK] for window in run.used]
    records.measured_s += sum(window.wall_s for window in run.used)


def print_table(
    host: str, load: Load, records: dict[str, ModeRecords], args: argparse.Namespace
) -> None:
    print(f"# bench_text_loop: {host}")
    print(
        f"{load.bulk.concurrency} bulk callers of {load.bulk_units:,} {load.unit} "
        f"({load.bulk.rows:,} rows, {size_text(load.bulk_bytes)}) in lane {BULK_LANE}, "
        f"{interactive_text(load.interactive)} in the default lane; {args.seconds:g} s measured "
        f"after {args.warmup_s:g} s of warm-up per mode and round, {args.rounds} round(s); "
        f"--max-batch-size {args.max_batch_size}; text decoded and encoded off the loop above "
        f"{EVENT_LOOP_TEXT_ELEMENTS:,} strings, requests with ids hashed off it above "
        f"{size_text(EVENT_LOOP_HASH_BYTES)}, as shipped"
    )
    print()
    print(
        "| mode | interactive p50 ms | interactive p99 ms | interactive max ms | interactive "
        f"calls | bulk requests answered | bulk {load.unit}/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    p99_ms: dict[str, float | None] = {}
    strings_per_s: dict[str, float] = {}
    for mode, record in records.items():
        interactive, bulk = combine(record.interactive), combine(record.bulk)
        latency = percentiles_ms(interactive.ok_latency_s)
        answered = bulk.outcomes.get(OK, 0)
        p99_ms[mode] = _float(latency["p99_ms"])
        strings_per_s[mode] = answered * load.bulk_units / record.measured_s
        print(
            f"| {MODE_TITLES[mode]} | {_ms(latency['p50_ms'])} | {_ms(latency['p99_ms'])} "
            f"| {_ms(latency['max_ms'])} | {latency['count']} | {answered} "
            f"| {strings_per_s[mode]:,.0f} |"
        )
    print()
    print("| ratio | figure |")
    print("|---|---:|")
    on_p99, off_p99 = p99_ms[ON_LOOP], p99_ms[OFF_LOOP]
    print(f"| interactive p99, on loop / off loop | {_ratio(on_p99, off_p99)} |")
    off_rate, on_rate = strings_per_s[OFF_LOOP], strings_per_s[ON_LOOP]
    print(f"| bulk {load.unit}/s, off loop / on loop | {_ratio(off_rate, on_rate)} |")
    for mode, record in records.items():
        for label, windows in ((INTERACTIVE, record.interactive), (BULK, record.bulk)):
            failed = {k: n for k, n in sorted(combine(windows).outcomes.items()) if k != OK}
            if failed:
                print(f"{mode}, {label}: not OK {failed}")
        if any(code != 0 for code in record.exit_codes):
            print(f"{mode}: server exit codes {record.exit_codes}")


def interactive_text(stream: Stream) -> str:
    if stream.mode == "open":
        return f"1-row requests at {stream.rate_per_s:g}/s (Poisson, timed from their arrival)"
    return "1 caller of 1-row requests back to back"


def _float(value: float | int | None) -> float | None:
    return None if value is None else float(value)


def _ms(value: float | int | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    if numerator is None or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}x"


# The guard matters: the load generator's client processes are spawned, and a spawned
# process imports this file again as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
