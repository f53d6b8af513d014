#!/usr/bin/env python3
"""What `server.receive_window_bytes` bounds, and what it costs, measured in one run.

    .venv/bin/python scripts/bench_unread_streams.py                     # 16 streams, 1 MiB
    .venv/bin/python scripts/bench_unread_streams.py --window-mib 8 --streams 32 --rounds 4

Two servers of the text model (demo_model.make_text_model), one after the other, each
once a round (`--rounds`, the order alternating): gRPC's own receive window
(`receive_window_bytes = 0`, bandwidth-delay probes) and a fixed one (`--window-mib`).
Against each, from this process:
- **unread**: `--streams` InferStream calls, each on a connection of its own, send items
  of one `--item-mib` string for `--seconds` and never read an answer. laneserve stops
  reading a stream once its answers come to `stream_answer_buffer_bytes`; what its
  caller sends after that waits in gRPC's core, as far as the window lets it. The server's
  peak resident memory (the kernel's high-water mark, VmHWM, `procs.read_process_memory`)
  is read as they end, and the items the callers got to send counted;
- **read**: `--read-streams` calls send `--read-items` such items each and read every
  answer: the bulk throughput a fixed window costs (items answered a second).
Prints a Markdown table and the ratios (fixed / gRPC's own). Loopback: a fixed window
costs more on a link with a longer round trip (a stream moves at most a window a trip),
not measured here. Not a test: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import grpc

from laneserve.server.bench import procs
from laneserve.server.bench.cli import interrupted, stop_signals_interrupt
from laneserve.server.bench.script_parts import describe_host
from laneserve.server.demo_model import make_text_model
from laneserve.server.flag_values import integer, seconds
from laneserve.v1 import inference_pb2 as pb

MIB: Final = 1024 * 1024
# The stream method, called with bytes already serialized: items encoded once.
INFER_STREAM: Final = "/laneserve.v1.InferenceService/InferStream"
# The channel option that lets an item of several MiB through (gRPC's default is 4 MiB).
UNLIMITED: Final = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


@dataclasses.dataclass
class Figures:
    """One server's: peak resident bytes while its streams went unread, the items their
    callers got to send, and the items a second its reading streams had answered (over
    the rounds: the largest peak, the items summed, the mean rate)."""

    peak_rss_bytes: int = 0
    unread_items_sent: int = 0
    read_items_per_s: float = 0.0

    def add(self, other: Figures, rounds: int) -> None:
        """One round's figures in: the largest peak, the items sent summed, the mean rate."""
        self.peak_rss_bytes = max(self.peak_rss_bytes, other.peak_rss_bytes)
        self.unread_items_sent += other.unread_items_sent
        self.read_items_per_s += other.read_items_per_s / rounds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--streams", type=integer(1), default=16, help="default: %(default)s")
    parser.add_argument("--item-mib", type=integer(1, 32), default=1, help="default: %(default)s")
    parser.add_argument(
        "--window-mib", type=integer(1, 2047), default=4, help="the fixed window (default: 4)"
    )
    parser.add_argument(
        "--seconds",
        type=seconds(zero_ok=False, maximum_s=120.0),
        default=15.0,
        help="unread streams' sending, per server (default: %(default)s)",
    )
    parser.add_argument("--read-streams", type=integer(1), default=2, help="default: %(default)s")
    parser.add_argument("--read-items", type=integer(1), default=300, help="default: %(default)s")
    parser.add_argument(
        "--rounds",
        type=integer(1),
        default=2,
        help="each server once a round, the order alternating (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    host = describe_host()
    figures = {0: Figures(), args.window_mib: Figures()}
    try:
        with stop_signals_interrupt(), tempfile.TemporaryDirectory() as scratch:
            model = Path(scratch) / "text.onnx"
            make_text_model(model)
            item = _item(args.item_mib * MIB)
            for round_index in range(args.rounds):
                order = list(figures) if round_index % 2 == 0 else list(reversed(figures))
                for window_mib in order:
                    figures[window_mib].add(
                        _measure(Path(scratch), model, window_mib, item, args), args.rounds
                    )
    except (procs.StartError, procs.ServerError, grpc.RpcError) as error:
        print(f"bench_unread_streams: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:
        return interrupted("bench_unread_streams", error)
    _print(host, figures, args)
    return 0


def _item(size: int) -> bytes:
    """An InferStream item of the text model: one string of `size` bytes, answered with
    every output (`tagged`, the string with "!": answers as large as the items, so that
    unread ones fill the stream's answer budget)."""

    def strings(*values: bytes) -> bytes:
        return b"".join(struct.pack("<I", len(value)) + value for value in values)

    request = pb.InferRequest(
        inputs=[
            pb.Tensor(name="text", dtype=pb.DATA_TYPE_STRING, shape=[1], data=strings(b"a" * size)),
            pb.Tensor(
                name="numbers", dtype=pb.DATA_TYPE_STRING, shape=[1, 2], data=strings(b"1", b"2")
            ),
        ]
    )
    return request.SerializeToString()


def _measure(
    scratch: Path, model: Path, window_mib: int, item: bytes, args: argparse.Namespace
) -> Figures:
    config = scratch / f"window-{window_mib}.toml"
    config.write_text(f"[server]\nreceive_window_bytes = {window_mib * MIB}\n")
    argv = [
        sys.executable,
        "-m",
        "laneserve.server.cli",
        *procs.serve_arguments(str(model), 128, metrics_port=-1),
        *("--config", str(config)),
    ]
    deployment = procs.start_group(f"window {window_mib} MiB", "laneserve", lambda _port: argv)
    try:
        figures = Figures()
        (process,) = deployment.processes
        figures.peak_rss_bytes, figures.unread_items_sent = _unread(
            deployment.target, process.pid, item, args
        )
        figures.read_items_per_s = _read(deployment.target, item, args)
        return figures
    finally:
        deployment.stop()


def _unread(target: str, pid: int, item: bytes, args: argparse.Namespace) -> tuple[int, int]:
    """Peak resident bytes of process `pid` while `--streams` callers send and never read,
    and how many items they sent."""
    stop = threading.Event()
    sent = [0] * args.streams

    def items(stream: int) -> Iterator[bytes]:
        while not stop.is_set():
            sent[stream] += 1
            yield item

    channels = [grpc.insecure_channel(target, options=UNLIMITED) for _ in range(args.streams)]
    calls = [
        channel.stream_stream(INFER_STREAM, request_serializer=bytes, response_deserializer=bytes)(
            items(stream)
        )
        for stream, channel in enumerate(channels)
    ]
    try:
        time.sleep(args.seconds)
        # The kernel's high-water mark (VmHWM), read before the streams end: the start's
        # own peak (the text model's load and probe) is far below what they hold.
        peak = procs.read_process_memory(pid).peak_rss_bytes or 0
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
    return peak, sum(sent)


def _read(target: str, item: bytes, args: argparse.Namespace) -> float:
    """Items a second answered to `--read-streams` callers reading every answer."""
    answered = [0] * args.read_streams

    def one(stream: int) -> None:
        with grpc.insecure_channel(target, options=UNLIMITED) as channel:
            call = channel.stream_stream(
                INFER_STREAM, request_serializer=bytes, response_deserializer=bytes
            )
            answered[stream] = sum(1 for _ in call(iter([item] * args.read_items)))

    threads = [threading.Thread(target=one, args=(stream,)) for stream in range(args.read_streams)]
    started_s = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(answered) / (time.perf_counter() - started_s)


def _print(host: str, figures: dict[int, Figures], args: argparse.Namespace) -> None:
    print(
        f"{host}; {args.streams} unread streams of {args.item_mib} MiB items for {args.seconds:g} s"
    )
    print()
    print("| receive window | peak RSS, unread (MiB) | items sent, unread | items/s, read |")
    print("|---|---|---|---|")
    for window_mib, figure in figures.items():
        name = "gRPC's own (0)" if window_mib == 0 else f"{window_mib} MiB"
        print(
            f"| {name} | {figure.peak_rss_bytes / MIB:.0f} | {figure.unread_items_sent} "
            f"| {figure.read_items_per_s:.0f} |"
        )
    own, fixed = figures[0], figures[args.window_mib]
    print()
    print(
        f"fixed / own: peak RSS {fixed.peak_rss_bytes / own.peak_rss_bytes:.2f}x, items sent "
        f"{fixed.unread_items_sent / own.unread_items_sent:.2f}x, read throughput "
        f"{fixed.read_items_per_s / own.read_items_per_s:.2f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
