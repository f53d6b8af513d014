"""`laneserve top`: a terminal dashboard of one server's GetStats, refreshed every second.

    laneserve top --target 127.0.0.1:50051               # live, until Ctrl-C
    laneserve top --target host:50051 --once             # one frame, then exit
    laneserve top --iterations 5 --interval-s 0.5        # five frames, then exit

It is a plain gRPC client: any reachable laneserve works, nothing else is needed; with
TLS it takes laneserve-client's --tls, --tls-ca, --tls-cert, --tls-key options. Each
frame answers the operator's first question, where the time goes: per lane, the queue
depth against its capacity, the wait p95 and the admission, shed and refusal rates
(entry), and the requests that ran and failed; batch size, dispatch reasons and run time
(batcher and session); device memory against its limit and watermark, utilisation and
out-of-memory events (device). Rates and dispatch shares are of the time between two
frames, on the server's clock (its uptime) while the same instance answers; the first
frame, and the first after a restart, shows them since the server started. Live (on a
terminal, without `--once` or `--iterations`) each frame replaces the last, its lines cut
to the terminal's width, the time (UTC) on its first line; otherwise (a pipe, a file,
`--once`, `--iterations`) frames follow one another, each opened by a line
`--- laneserve top 2026-12-06T18:40:01Z ---` (UTC, when it was polled). `--once` and
`--iterations` exit 1 when the last frame found the server unreachable.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
import time
from collections.abc import Mapping
from typing import Any

import grpc

from laneserve.client._channel import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from laneserve.client.cli import EXIT_BROKEN_PIPE, add_tls_arguments, tls_config
from laneserve.server import flag_values
from laneserve.server.log_events import refuse_usage
from laneserve.server.memory import format_bytes
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

BAR_WIDTH = 20
# Times at or above this many milliseconds are shown with one decimal, below with two.
_COARSE_MS = 10.0
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
# Every frame's first line starts with it (see `_show`).
_TITLE = "laneserve top"
# Two samples of one server give its start within their calls' latencies; one restart
# (a process exits, loads its model and probes it) takes longer than this.
RESTART_SLACK_S = 1.0

log = logging.getLogger("laneserve")


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One GetStats answer and when it was taken (monotonic seconds, this process)."""

    stats: pb.GetStatsResponse
    taken_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        type=flag_values.target,
        default="127.0.0.1:50051",
        help="server address (default 127.0.0.1:50051)",
    )
    parser.add_argument(
        "--interval-s", type=float, default=1.0, help="seconds between refreshes (default 1)"
    )
    frames = parser.add_mutually_exclusive_group()
    frames.add_argument("--once", action="store_true", help="print one frame and exit")
    frames.add_argument("--iterations", type=int, help="print this many frames and exit")
    parser.add_argument(
        "--timeout-s", type=float, default=5.0, help="deadline of each call (default 5)"
    )
    add_tls_arguments(parser.add_argument_group("TLS, as laneserve-client takes it"))


MAX_INTERVAL_S = 3600.0  # finite, and within what time.sleep takes
# Finite: gRPC takes a deadline of inf or nan as one already past (DEADLINE_EXCEEDED).
MAX_TIMEOUT_S = 3600.0


def _unreachable(
    target: str, error: grpc.RpcError, plaintext: bool, interval_s: float | None
) -> str:
    """The frame of a server that did not answer; `interval_s` None: the last frame, which
    promises no other poll."""
    frame = f"{_TITLE}  {target}  unreachable: {_failure(error, plaintext)}\n"
    if interval_s is not None:
        frame += f"(polling again every {interval_s:g} s)\n"
    return frame


def _failure(error: grpc.RpcError, plaintext: bool) -> str:
    call: Any = error  # grpc raises an RpcError that is also a Call; typeshed cannot say so
    details = call.details() or ""
    text = f"{call.code().name}: {details}"
    # A TLS-only server closes a plaintext connection at its first bytes, and gRPC says
    # no more than this, as it fails to connect. A plaintext server killed while polled
    # says "Stream removed (Socket closed)": connected, so no hint.
    if plaintext and "failed to connect to all addresses" in details and "Socket closed" in details:
        text += " (a TLS server? try --tls-ca PEM, or --tls for the system's roots)"
    return text


def _check_numbers(args: argparse.Namespace, frames: int | None) -> None:
    """Raises ValueError naming the flag whose value is out of range (nan included)."""
    if frames is not None and frames < 1:
        raise ValueError(f"--iterations: expected >= 1, got {frames}")
    if not 0 < args.interval_s <= MAX_INTERVAL_S:
        raise ValueError(
            f"--interval-s: expected seconds in (0, {MAX_INTERVAL_S:g}], got {args.interval_s}"
        )
    if not 0 < args.timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(
            f"--timeout-s: expected seconds > 0 and at most {MAX_TIMEOUT_S:g}, got {args.timeout_s}"
        )


def run(args: argparse.Namespace) -> int:
    """Polls and renders until the frames asked for are shown, or Ctrl-C; 1 when the
    server cannot be reached at the first frame or the last one asked for, 141 when the
    output's reader has gone (`| head`)."""
    frames: int | None = 1 if args.once else args.iterations
    try:
        _check_numbers(args, frames)
        tls = tls_config(args)
    except ValueError as error:
        refuse_usage(log, f"laneserve top: {error}", json_lines=args.log_format == "json")
        return 2
    live = frames is None and sys.stdout.isatty()
    options = channel_options(tls, DEFAULT_MAX_MESSAGE_BYTES, ())
    try:
        with (
            grpc.insecure_channel(args.target, options)
            if tls is None
            else grpc.secure_channel(args.target, tls.credentials(), options)
        ) as channel:
            poller = Poller(pb_grpc.InferenceServiceStub(channel), args.target, args.timeout_s)
            shown = 0
            while True:
                last = frames is not None and shown + 1 >= frames
                reached = True
                try:
                    frame = poller.frame()
                except grpc.RpcError as error:
                    if not shown:
                        raise
                    # Stopped or restarting: shown as such, and polled on; the frames
                    # after count from the new start (see `_Rates`).
                    reached = False
                    frame = _unreachable(
                        args.target, error, tls is None, None if last else args.interval_s
                    )
                _show(frame, live)
                shown += 1
                if last:
                    # Exit 1 when the last frame found none: `top --iterations 3 || alert`
                    # passed against a server gone away.
                    return 0 if reached else 1
                time.sleep(args.interval_s)
    except grpc.RpcError as error:
        print(f"laneserve top: {args.target}: {_failure(error, tls is None)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        return _stdout_closed()


def _show(frame: str, live: bool) -> None:
    """Writes a frame with the time (UTC) it was polled on its first line. Live, in place
    of the last, cut to the terminal's size, read each frame (it may have been resized):
    each line to its width (a wrapped line took several rows), and the frame to its
    height less the cursor's row, its last row then saying how many lines were left out
    (a frame taller than the screen scrolled its header away at each redraw). Otherwise
    after the last, opened by a line that no frame holds, so that a file of frames
    splits at it."""
    polled = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if live:
        assert frame.startswith(_TITLE)  # render's and _unreachable's first line
        columns, rows = shutil.get_terminal_size()
        lines = f"{_TITLE} {polled}{frame.removeprefix(_TITLE)}".splitlines()
        shown = max(rows - 1, 1)  # the cursor rests on the row below the frame
        if len(lines) > shown:
            left_out = len(lines) - shown + 1
            lines = [*lines[: shown - 1], f"... {left_out} more lines: enlarge the terminal"]
        sys.stdout.write(_CLEAR + "".join(line[:columns] + "\n" for line in lines))
    else:
        sys.stdout.write(f"--- {_TITLE} {polled} ---\n{frame}")
    sys.stdout.flush()


class Poller:
    """The frames of one address: GetStats each time, GetModel at first and again whenever
    another server may answer (after a spell unreachable, or a restart seen in the
    counters): a server restarted with another model kept the first one's header."""

    def __init__(self, stub: pb_grpc.InferenceServiceStub, target: str, timeout_s: float) -> None:
        self._stub = stub
        self._target = target
        self._timeout_s = timeout_s
        self._model: pb.GetModelResponse | None = None
        self._previous: Sample | None = None

    def frame(self) -> str:
        """The next frame; grpc.RpcError when the server cannot be reached."""
        try:
            stats = self._stub.GetStats(pb.GetStatsRequest(), timeout=self._timeout_s)
            sample = Sample(stats, time.monotonic())
            if self._model is None or (
                self._previous is not None and restarted(sample, self._previous)
            ):
                self._model = self._stub.GetModel(pb.GetModelRequest(), timeout=self._timeout_s)
        except grpc.RpcError:
            self._model = None  # the server that answers next may serve another model
            raise
        frame = render(self._target, self._model, sample, self._previous)
        self._previous = sample
        return frame


def _stdout_closed() -> int:
    """The reader of our output went away (`| head`): stop quietly, as laneserve-client
    does. Python flushes stdout once more at exit; pointed at devnull, that flush cannot
    fail again (it printed a second BrokenPipeError)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


# ---- rendering (pure: tested on hand-made answers) ------------------------------------------


def render(target: str, model: pb.GetModelResponse, sample: Sample, previous: Sample | None) -> str:
    stats = sample.stats
    old = previous.stats if previous is not None else None
    rate = _Rates(sample, previous)
    lines = [
        (
            f"{_TITLE}  {target}  {stats.state or '?'}  up {_duration(stats.uptime_s)}  "
            f"providers {','.join(model.providers) or '?'}"
        ),
        f"model {model.model_path}   rates: {rate.label}",
        "",
        (
            f"{'lane':<12} {'depth':<{BAR_WIDTH + 2}} {'rows':^13} {'wait p95':>9} "
            f"{'admit/s':>8} {'done/s':>8} {'fail/s':>7} {'shed/s':>7} {'refuse/s':>8} "
            f"{'req p95':>9}"
        ),
    ]
    old_lanes = {lane.name: lane for lane in old.lanes} if old is not None else {}
    for lane in stats.lanes:
        lines += _lane_lines(lane, old_lanes.get(lane.name), rate)
    size = stats.batch_size
    batches = rate.of(stats.batches, old.batches if old else None)
    rows = rate.of(stats.rows_run, old.rows_run if old else None)
    run = stats.run_time
    lines += [
        "",
        (
            f"batches  {batches}/s  rows {rows}/s  "
            f"size mean {size.mean:.1f} p50 {size.p50:.0f} p95 {size.p95:.0f}  "
            f"cap {stats.batch_cap}/{stats.max_batch_cap or model.max_batch_size}  "
            f"failed {stats.failed_batches}"
        ),
        _dispatch_line(stats, old if rate.between else None),
        (
            f"run time p50 {_ms(run.p50_ms, run.count)}  p95 {_ms(run.p95_ms, run.count)}  "
            f"p99 {_ms(run.p99_ms, run.count)}"
        ),
        _memory_line(stats),
        (
            f"device   util {_utilization(stats)}  out of memory {stats.out_of_memory_events}  "
            f"splits {stats.batch_splits}  cap changes {_reasons(stats.cap_changes) or '-'}"
        ),
    ]
    if stats.HasField("grpc_calls"):
        lines.append(_grpc_line(stats.grpc_calls, old.grpc_calls if old else None, rate))
    return "\n".join(lines) + "\n"


def _dispatch_line(stats: pb.GetStatsResponse, old: pb.GetStatsResponse | None) -> str:
    """Why the batches of the interval were dispatched: counted since the start they
    said "full" an hour after the overload had gone. `old` None: no earlier sample of this
    server, so since its start, and labelled so."""
    if old is None:
        return f"dispatch since start {_shares(stats.batch_reasons)}"
    before = old.batch_reasons
    return "dispatch " + _shares(
        {
            reason: max(count - before.get(reason, 0), 0)
            for reason, count in stats.batch_reasons.items()
        }
    )


def _grpc_line(calls: pb.GrpcCalls, old: pb.GrpcCalls | None, rate: _Rates) -> str:
    """gRPC's own count: what it neither answered OK nor failed was refused by its core
    (max_pending_calls) or is still running; `failed` holds every call ended with a
    status other than OK, those cancelled or expired before laneserve saw them too."""
    other = calls.started - calls.succeeded - calls.failed
    old_other = None if old is None else old.started - old.succeeded - old.failed
    return (
        f"grpc     calls {rate.of(calls.started, old.started if old else None)}/s  "
        f"ok {rate.of(calls.succeeded, old.succeeded if old else None)}/s  "
        f"failed {rate.of(calls.failed, old.failed if old else None)}/s  "
        f"refused by gRPC or running {rate.of(other, old_other)}/s"
    )


def _lane_lines(lane: pb.LaneStats, old: pb.LaneStats | None, rate: _Rates) -> list[str]:
    shed = sum(lane.shed.values())
    refused = sum(lane.rejected.values())
    line = (
        f"{lane.name:<12} {_bar(lane.depth_rows, lane.capacity_rows)} "
        f"{lane.depth_rows:>6}/{lane.capacity_rows:<6} "
        f"{_ms(lane.queue_wait.p95_ms, lane.queue_wait.count):>9} "
        f"{rate.of(lane.admitted, old.admitted if old else None):>8} "
        f"{rate.of(lane.completed, old.completed if old else None):>8} "
        f"{rate.of(lane.failed, old.failed if old else None):>7} "
        f"{rate.of(shed, sum(old.shed.values()) if old else None):>7} "
        f"{rate.of(refused, sum(old.rejected.values()) if old else None):>8} "
        f"{_ms(lane.request_duration.p95_ms, lane.request_duration.count):>9}"
    )
    refused_shed = " ".join(part for part in (_reasons(lane.rejected), _reasons(lane.shed)) if part)
    # Every end of an admitted request but OK and the shed ones (`answered` counts each
    # shed request too, which the refused/shed part shows already): those that ran and
    # failed (`failed`, by status).
    not_ok = _reasons(
        {
            status: count - lane.shed.get(status, 0)
            for status, count in lane.answered.items()
            if status != "OK"
        }
    )
    problems = [
        f"{label} {counts}"
        for label, counts in (("refused/shed", refused_shed), ("ended not OK", not_ok))
        if counts
    ]
    if not problems:
        return [line]
    return [line, f"{'':<12}   since start: {', '.join(problems)}"]


class _Rates:
    """Per-second rates of counters: between two samples, or since the server started."""

    def __init__(self, sample: Sample, previous: Sample | None) -> None:
        # Another server answers now: its counters start from zero, not from ours.
        another = previous is not None and restarted(sample, previous)
        elapsed_s = 0.0 if previous is None or another else _elapsed_s(sample, previous)
        # Whether the rates are of the time since `previous` (of the same server).
        self.between = elapsed_s > 0
        if self.between:
            self._seconds = elapsed_s
            self.label = f"per second over the last {self._seconds:.1f}s"
        else:
            self._seconds = max(sample.stats.uptime_s, 1e-9)
            self.label = "per second, averaged since " + (
                "the server restarted" if another else "start"
            )

    def of(self, now: int, before: int | None) -> str:
        delta = now - before if self.between and before is not None else now
        return f"{max(delta, 0) / self._seconds:.1f}"


def _elapsed_s(sample: Sample, previous: Sample) -> float:
    """Seconds between two samples of one server: on its clock (its uptime) when its
    `instance_id` says the same instance answered both; else on this process's, taken
    after each answer came, which adds the difference of the two calls' latencies."""
    if sample.stats.instance_id and sample.stats.instance_id == previous.stats.instance_id:
        return sample.stats.uptime_s - previous.stats.uptime_s
    return sample.taken_s - previous.taken_s


def restarted(sample: Sample, previous: Sample) -> bool:
    """Whether another server answered `sample` than `previous` (restarted, or another
    behind the address): its `instance_id` differs; from a server without one, its start
    on this process's clock (when sampled, less its uptime) moved by more than two
    calls' latencies explain, or a counter went down. A shorter uptime alone missed a
    restart sampled later in the new server's life than the last sample was in the old
    one's (`--interval-s 3`, a restart in 2 s)."""
    if sample.stats.instance_id and previous.stats.instance_id:
        return sample.stats.instance_id != previous.stats.instance_id
    started_s = sample.taken_s - sample.stats.uptime_s
    started_before_s = previous.taken_s - previous.stats.uptime_s
    if abs(started_s - started_before_s) > RESTART_SLACK_S:
        return True
    now, before = sample.stats, previous.stats
    return now.batches < before.batches or now.rows_run < before.rows_run


def _bar(used: int, capacity: int) -> str:
    fraction = min(used / capacity, 1.0) if capacity > 0 else 0.0
    filled = round(fraction * BAR_WIDTH)
    if used > 0 and filled == 0:
        filled = 1  # a non-empty queue never looks empty
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


def _memory_line(stats: pb.GetStatsResponse) -> str:
    if stats.memory_watermark_limit_bytes == 0 and stats.memory_used_bytes == 0:
        # No watermark, so nothing reads memory in use: its 0 is no reading, and a bar of
        # 0 against the arena's limit looked like one (an idle device).
        if stats.memory_limit_bytes == 0:
            return "memory   no limit set (the runtime's default arena)"
        return (
            f"memory   in use - (no reading: no watermark)  "
            f"arena limit {format_bytes(stats.memory_limit_bytes)}"
        )
    # Used memory against the limit it is measured for (the host's on the CPU); a server
    # older than memory_watermark_limit_bytes measured it against memory_limit_bytes.
    limit = stats.memory_watermark_limit_bytes or stats.memory_limit_bytes
    used = stats.memory_used_bytes
    limit_text = format_bytes(limit) if limit else "?"
    line = f"memory   {_bar(used, limit)} {format_bytes(used)} / {limit_text}"
    if limit:
        line += f" ({used / limit:.0%})"
    if stats.memory_high_watermark_bytes:
        line += f"  watermark {format_bytes(stats.memory_high_watermark_bytes)}"
        # Lanes closed by memory stay closed down to the low mark while work runs: with
        # the high mark alone shown, memory below it and every lane closed read as a
        # fault (a review).
        if stats.memory_low_watermark_bytes:
            line += f" (low {format_bytes(stats.memory_low_watermark_bytes)})"
    closed = list(stats.lanes_closed_by_memory)
    line += f"  lanes closed: {','.join(closed) if closed else '-'}"
    return line


def _utilization(stats: pb.GetStatsResponse) -> str:
    if not stats.HasField("device_utilization"):
        return "- (no GPU)"
    return f"{stats.device_utilization:.0%}"


def _reasons(counts: Mapping[str, int]) -> str:
    return " ".join(f"{reason}={count}" for reason, count in sorted(counts.items()) if count)


def _shares(counts: Mapping[str, int]) -> str:
    total = sum(counts.values())
    if total == 0:
        return "-"
    return "  ".join(f"{reason} {count / total:.0%}" for reason, count in sorted(counts.items()))


def _ms(value_ms: float, count: int) -> str:
    if count == 0:
        return "-"
    return f"{value_ms:.1f}ms" if value_ms >= _COARSE_MS else f"{value_ms:.2f}ms"


def _duration(seconds: float) -> str:
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


__all__ = ["Poller", "Sample", "add_arguments", "render", "restarted", "run"]
