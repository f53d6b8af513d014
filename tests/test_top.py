"""`laneserve top`: frames rendered from hand-made GetStats answers, and the command run
headless (--once / --iterations) against a real server."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import grpc
import pytest

from laneserve.server import LaneServer, ServerConfig, top
from laneserve.server.cli import main
from laneserve.server.demo_model import make_demo_model
from laneserve.server.top import Poller, Sample, render, restarted
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import (
    CLIENT_CLI_TIMEOUT_S,
    RecordingEngine,
    TcpProxy,
    request,
    rows,
    serving,
    until,
)

GIB = 1 << 30
# The line that opens each frame written to a pipe or a file: the time it was polled (UTC).
SEPARATOR = re.compile(r"^--- laneserve top \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ---\n", re.MULTILINE)
MODEL = pb.GetModelResponse(
    model_path="models/demo.onnx",
    providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
    max_batch_size=128,
)


def lane(name: str, **fields: object) -> pb.LaneStats:
    return pb.LaneStats(name=name, **fields)  # type: ignore[arg-type]


def stats(admitted: int, **fields: object) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(
        state="SERVING",
        uptime_s=3723.0,
        lanes=[
            lane(
                "interactive",
                depth_rows=128,
                capacity_rows=512,
                admitted=admitted,
                completed=admitted - 10,
                rejected={"LANE_FULL": admitted // 10},
                shed={"EXPIRED_IN_QUEUE": 4},
                queue_wait=pb.LatencySummary(count=50, p50_ms=0.4, p95_ms=1.25, p99_ms=3),
                request_duration=pb.LatencySummary(count=50, p95_ms=12.5),
            ),
            lane("bulk", depth_rows=0, capacity_rows=16384),
        ],
        batches=admitted // 2,
        rows_run=admitted * 4,
        batch_cap=64,
        max_batch_cap=128,
        batch_size=pb.SizeSummary(count=40, mean=48.5, p50=64, p95=64, p99=64),
        batch_reasons={"full": 30, "backlog": 10},
        run_time=pb.LatencySummary(count=40, p50_ms=2.0, p95_ms=3.5, p99_ms=4.25),
        **fields,  # type: ignore[arg-type]
    )


def test_frame_shows_lanes_batches_memory_and_device() -> None:
    before = Sample(
        stats(100, grpc_calls=pb.GrpcCalls(started=1000, succeeded=900, failed=50)), taken_s=10.0
    )
    now = Sample(
        stats(
            300,
            grpc_calls=pb.GrpcCalls(started=1400, succeeded=1100, failed=60),
            memory_limit_bytes=8 * GIB,
            memory_used_bytes=4 * GIB,
            memory_high_watermark_bytes=7 * GIB,
            memory_low_watermark_bytes=6 * GIB,
            lanes_closed_by_memory=["bulk"],
            device_utilization=0.73,
            out_of_memory_events=2,
            batch_splits=2,
            cap_changes={"out_of_memory": 1},
        ),
        taken_s=12.0,
    )
    now.stats.batch_reasons["backlog"] += 30  # 30 more batches: 30 full, 40 backlog
    now.stats.uptime_s += 2.0  # the same server, sampled 2 s later
    frame = render("gpu-host:50051", MODEL, now, before)
    lines = frame.splitlines()
    assert lines[0].startswith("laneserve top  gpu-host:50051  SERVING  up 1h02m05s")
    assert "rates: per second over the last 2.0s" in lines[1]
    interactive = next(line for line in lines if line.startswith("interactive"))
    # 128 of 512 rows: a quarter of the bar; wait p95; 200 admitted in 2 s; 20 refused.
    assert "[#####...............]" in interactive
    assert "128/512" in interactive
    assert interactive.split()[3:9] == ["1.25ms", "100.0", "100.0", "0.0", "0.0", "10.0"]
    assert interactive.endswith("12.5ms")
    assert "since start: refused/shed LANE_FULL=30 EXPIRED_IN_QUEUE=4\n" in frame
    bulk = next(line for line in lines if line.startswith("bulk"))
    assert "[....................]" in bulk
    assert bulk.split()[3] == "-"  # no wait measured yet
    assert "batches  50.0/s  rows 400.0/s  size mean 48.5 p50 64 p95 64  cap 64/128" in frame
    assert "dispatch backlog 100%  full 0%" in frame  # of the 2 s, not since the start
    assert "run time p50 2.00ms  p95 3.50ms  p99 4.25ms" in frame
    assert (
        "memory   [##########..........] 4.0GiB / 8.0GiB (50%)  watermark 7.0GiB (low 6.0GiB)"
        in frame
    )
    assert "lanes closed: bulk" in frame
    assert "device   util 73%  out of memory 2  splits 2  cap changes out_of_memory=1" in frame
    # gRPC's own count: 400 started, 200 OK, 10 failed in 2 s; 190 neither.
    assert (
        "grpc     calls 200.0/s  ok 100.0/s  failed 5.0/s  refused by gRPC or running 95.0/s"
    ) in frame


def test_a_lane_shows_the_requests_that_ran_and_failed() -> None:
    """Admitted requests that ended neither OK nor shed (DEADLINE_EXCEEDED while they ran,
    ENGINE_FAILURE) were nowhere in the frame: admit/s exceeded done/s + shed/s, unexplained."""
    ended = {"OK": 62, "EXPIRED_IN_QUEUE": 4, "DEADLINE_EXCEEDED": 2}  # each shed one too
    before = stats(100)
    now = stats(300)
    now.uptime_s += 2.0
    before.lanes[0].failed, now.lanes[0].failed = 2, 12
    now.lanes[0].answered.update(ended)
    frame = render("h:1", MODEL, Sample(now, taken_s=12.0), Sample(before, taken_s=10.0))
    lines = frame.splitlines()
    assert lines[3].split()[5:9] == ["admit/s", "done/s", "fail/s", "shed/s"]
    interactive = next(line for line in lines if line.startswith("interactive"))
    assert interactive.split()[4:7] == ["100.0", "100.0", "5.0"]  # 10 failed in 2 s
    assert (
        "since start: refused/shed LANE_FULL=30 EXPIRED_IN_QUEUE=4, "
        "ended not OK DEADLINE_EXCEEDED=2\n"
    ) in frame
    # A lane with failures alone has its line too.
    failing = lane("bulk", capacity_rows=16, failed=3, answered={"ENGINE_FAILURE": 3})
    only_failures = stats(100)
    del only_failures.lanes[:]
    only_failures.lanes.append(failing)
    alone = render("h:1", MODEL, Sample(only_failures, taken_s=1.0), None)
    assert "since start: ended not OK ENGINE_FAILURE=3\n" in alone


def test_dispatch_shares_are_of_the_interval_and_since_start_only_when_labelled() -> None:
    """The shares were counted since the server started, beside rates of the last
    interval: an hour after an overload they still said "full"."""
    overload, calm = stats(100), stats(100)
    calm.uptime_s += 2.0
    for sample, reasons in (
        (overload, {"full": 900, "idle": 100}),
        (calm, {"full": 900, "idle": 300}),
    ):
        sample.batch_reasons.clear()
        sample.batch_reasons.update(reasons)
    first = render("h:1", MODEL, Sample(overload, taken_s=10.0), None)
    assert "\ndispatch since start full 90%  idle 10%\n" in first
    frame = render("h:1", MODEL, Sample(calm, taken_s=12.0), Sample(overload, taken_s=10.0))
    assert "\ndispatch full 0%  idle 100%\n" in frame
    # After a restart the counters start again: since the new server's start.
    calm.instance_id, overload.instance_id = "b", "a"
    again = render("h:1", MODEL, Sample(calm, taken_s=12.0), Sample(overload, taken_s=10.0))
    assert "\ndispatch since start full 75%  idle 25%\n" in again


def test_rates_are_timed_on_the_servers_clock_when_the_same_instance_answers() -> None:
    """The interval was this process's, taken after each GetStats came back: a slow answer
    stretched it. The server's uptime times it exactly while one instance answers."""
    before, now = stats(100, instance_id="a"), stats(300, instance_id="a")
    now.uptime_s += 2.0
    # This process saw 2.5 s go by (the second answer took 0.5 s longer to come).
    frame = render("h:1", MODEL, Sample(now, taken_s=12.5), Sample(before, taken_s=10.0))
    assert "rates: per second over the last 2.0s" in frame
    interactive = next(line for line in frame.splitlines() if line.startswith("interactive"))
    assert interactive.split()[4] == "100.0"  # 200 admitted in the server's 2 s
    # A server without an instance_id is timed on this process's clock.
    before.instance_id = now.instance_id = ""
    frame = render("h:1", MODEL, Sample(now, taken_s=12.5), Sample(before, taken_s=10.0))
    assert "rates: per second over the last 2.5s" in frame


def test_memory_in_use_is_shown_against_the_limit_it_is_measured_for() -> None:
    """On the CPU memory in use is the process's, against the host limit: not against
    the arena's limit, which GetStats reports too."""
    cpu = stats(
        100,
        memory_limit_bytes=1 * GIB,
        memory_watermark_limit_bytes=16 * GIB,
        memory_used_bytes=4 * GIB,
        memory_high_watermark_bytes=15 * GIB,
    )
    frame = render("h:1", MODEL, Sample(cpu, taken_s=1.0), None)
    assert "memory   [#####...............] 4.0GiB / 16.0GiB (25%)" in frame


def test_memory_without_a_reading_is_shown_as_absent_with_its_limit() -> None:
    """A CPU server with an arena limit and no host limit has no watermark, so nothing
    reads memory in use: its 0 was drawn as a reading ("0B / 64.0MiB (0%)")."""
    arena_only = stats(100, memory_limit_bytes=64 << 20)
    frame = render("h:1", MODEL, Sample(arena_only, taken_s=1.0), None)
    memory = next(line for line in frame.splitlines() if line.startswith("memory "))
    assert memory == "memory   in use - (no reading: no watermark)  arena limit 64.0MiB"


def test_first_frame_averages_since_start_and_shows_absent_figures_as_absent() -> None:
    frame = render("h:1", MODEL, Sample(stats(3723), taken_s=1.0), None)
    assert "rates: per second, averaged since start" in frame
    interactive = next(line for line in frame.splitlines() if line.startswith("interactive"))
    assert interactive.split()[4] == "1.0"  # 3723 admitted in 3723 s
    assert "dispatch since start backlog 25%  full 75%" in frame
    assert "util - (no GPU)" in frame
    assert "memory   no limit set" in frame
    assert "grpc " not in frame, "no line where the server does not report gRPC's count"


def test_a_frame_after_the_server_restarted_counts_from_its_start() -> None:
    """A shorter uptime means another server answers: its counters are not deltas of the
    last sample's, even where they happen to be higher."""
    before = Sample(stats(100), taken_s=10.0)
    restarted = stats(200)
    restarted.uptime_s = 50.0
    frame = render("h:1", MODEL, Sample(restarted, taken_s=12.0), before)
    assert "rates: per second, averaged since the server restarted" in frame
    interactive = next(line for line in frame.splitlines() if line.startswith("interactive"))
    assert interactive.split()[4] == "4.0"  # 200 admitted in its 50 s, not 100 in 2 s


def test_a_restart_is_seen_though_the_new_server_has_run_longer_than_the_old_had() -> None:
    """Sampled 60 s apart, a server up 5 s, then one up 45 s: a shorter uptime was the only
    sign of a restart, so the rates were the second server's counters less the first's
    (45 000 - 30 000 admitted over 60 s: 250/s, where both ran at 1 000/s)."""
    before = stats(30_000)
    before.uptime_s = 5.0
    after = stats(45_000)
    after.uptime_s = 45.0
    frame = render("h:1", MODEL, Sample(after, 70.0), Sample(before, 10.0))
    assert "rates: per second, averaged since the server restarted" in frame
    interactive = next(line for line in frame.splitlines() if line.startswith("interactive"))
    assert interactive.split()[4] == "1000.0"
    # Behind one address, a replica that started with the first (within a second) but
    # has run fewer batches is another server too.
    replica = stats(20_000)
    replica.uptime_s = 65.0
    assert restarted(Sample(replica, 70.0), Sample(before, 10.0))
    same = stats(31_000)
    same.uptime_s = 65.0
    assert not restarted(Sample(same, 70.0), Sample(before, 10.0))
    # A server that names itself is told apart by its instance_id alone.
    before.instance_id, same.instance_id = "a", "b"
    assert restarted(Sample(same, 70.0), Sample(before, 10.0))
    same.instance_id = "a"
    replica.instance_id = "a"
    assert not restarted(Sample(replica, 70.0), Sample(before, 10.0))


def test_top_shows_the_model_of_the_server_that_answers_after_a_restart(
    small_model: Path, tmp_path: Path
) -> None:
    """GetModel was asked once: a server restarted on the same address with another
    model (or on the CPU where it ran CUDA) kept the first one's header."""
    other_model = tmp_path / "other.onnx"
    make_demo_model(other_model, hidden_dim=16, hidden_layers=1)

    def server(model: Path) -> LaneServer:
        settings = ServerConfig(model_path=str(model), host="127.0.0.1", port=0, metrics_port=-1)
        return LaneServer(RecordingEngine(str(model)), settings)

    async def scenario() -> list[str]:
        # One address, a relay's, in front of both servers (each on a port of its own,
        # bound as 0): a restart at the same address with no port picked, closed and
        # bound again later, which another process could take in between.
        first = server(small_model)
        proxy = TcpProxy(await first.start())
        target = await proxy.start()
        try:
            with grpc.insecure_channel(target) as channel:
                poller = Poller(pb_grpc.InferenceServiceStub(channel), target, 10.0)
                frames = [await asyncio.to_thread(poller.frame)]
                second = server(other_model)
                proxy.retarget(await second.start())
                try:
                    await first.stop(grace_s=0.0)
                    proxy.sever()  # the first server's connections end with it
                    frames.append(await asyncio.to_thread(poller.frame))
                finally:
                    await second.stop(grace_s=0.0)
        finally:
            await proxy.close()
        return frames

    before, after = asyncio.run(scenario())
    assert f"model {small_model} " in before
    assert f"model {other_model} " in after
    assert "averaged since the server restarted" in after


def test_top_runs_headless_against_a_real_server(
    small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def scenario() -> int:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, ServerConfig(model_path=str(small_model))) as s:
            for lane_name in ("interactive", "standard"):
                await s.stub.Infer(request(rows(3), lane=lane_name), timeout=10)
            argv = ["top", "--target", s.target, "--iterations", "2", "--interval-s", "0.05"]
            return await asyncio.to_thread(main, argv)

    assert asyncio.run(scenario()) == 0
    out = capsys.readouterr().out
    # Each frame opens with a line no frame holds, with the time (UTC): a file of frames
    # splits at it and lines up with logs.
    before, *frames = SEPARATOR.split(out)
    assert before == ""
    assert len(frames) == 2
    first, second = frames
    assert first.startswith("laneserve top  127.0.0.1:")
    assert "rates: per second, averaged since start" in first
    assert "rates: per second over the last" in second
    for frame in frames:
        for name in ("interactive", "standard", "bulk"):
            assert f"\n{name} " in frame
        assert "SERVING" in frame
        assert "providers CPUExecutionProvider" in frame
        assert "batches " in frame
        assert "util - (no GPU)" in frame
        assert "\ngrpc     calls " in frame  # a real server reports gRPC's own count
    assert "\x1b[" not in out  # not a terminal: no screen control codes


def test_top_shows_a_server_that_stopped_as_unreachable_polls_on_and_exits_1(
    small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`laneserve top` exited 1 as soon as the server it watched stopped, so it could not
    show a restart (its rates handle one). It now shows the server as unreachable and
    polls on; only a server unreachable from the start ends it. With --iterations it
    exits 1 when the last frame found the server unreachable (it exited 0, and the last
    frame promised another poll): `top --iterations 3 || alert` passed against a server
    gone away."""

    async def scenario() -> tuple[int, str]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, ServerConfig(model_path=str(small_model))) as s:
            argv = ["top", "--target", s.target, "--iterations", "10", "--interval-s", "0.1"]
            top = asyncio.ensure_future(asyncio.to_thread(main, argv))
            out = ""

            def first_frame() -> bool:
                nonlocal out
                out += capsys.readouterr().out
                if "laneserve top" in out:
                    return True
                if top.done():  # its error, if it raised, is the test's
                    raise AssertionError(f"top ended {top.result()} before a frame:\n{out}")
                return False

            await until(first_frame, timeout_s=CLIENT_CLI_TIMEOUT_S)
            await s.server.stop(grace_s=1.0)
            code = await top
        return code, out + capsys.readouterr().out

    code, out = asyncio.run(scenario())
    assert code == 1
    _, *frames = SEPARATOR.split(out)
    assert len(frames) == 10
    assert "SERVING" in frames[0]
    assert "unreachable: UNAVAILABLE" in frames[-2]
    assert frames[-2].endswith("(polling again every 0.1 s)\n")
    assert "unreachable: UNAVAILABLE" in frames[-1]
    assert "polling again" not in frames[-1], "the last frame promises no other poll"


def test_top_piped_into_a_reader_that_stops_exits_141_quietly(small_model: Path) -> None:
    """`laneserve top --iterations 3 | head -1` ended in a BrokenPipeError traceback and
    exit 1 once `head` had gone; it now stops quietly with 141, as laneserve-client does.
    Run as the console script runs it, its output into a pipe whose reader has gone."""
    entry_point = "import sys; from laneserve.server.cli import main; sys.exit(main())"

    async def scenario() -> tuple[int | None, str]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, ServerConfig(model_path=str(small_model))) as s:
            reader, writer = os.pipe()
            os.close(reader)
            try:
                process = await asyncio.create_subprocess_exec(
                    *(sys.executable, "-c", entry_point, "top", "--target", s.target),
                    *("--iterations", "3", "--interval-s", "0.05"),
                    stdout=writer,
                    stderr=asyncio.subprocess.PIPE,
                )
            finally:
                os.close(writer)
            _, err = await asyncio.wait_for(process.communicate(), timeout=CLIENT_CLI_TIMEOUT_S)
        return process.returncode, err.decode()

    code, err = asyncio.run(scenario())
    assert (code, err) == (141, "")


def test_top_reports_an_unreachable_target(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port nothing listens on (bound, never listening)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        code = main(["top", "--target", f"127.0.0.1:{port}", "--once", "--timeout-s", "2"])
    assert code == 1
    err = capsys.readouterr().err
    assert f"laneserve top: 127.0.0.1:{port}: UNAVAILABLE" in err


def test_top_in_plaintext_against_a_tls_server_says_to_try_tls(
    small_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TLS-only server closes a plaintext connection, and all gRPC said was "Socket
    closed": the hint names top's TLS options."""
    openssl = shutil.which("openssl")
    assert openssl is not None, "the test generates its certificate with `openssl`"
    key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    subprocess.run(
        [openssl, *f"req -x509 {key} -keyout s.key -out s.pem -days 2 -subj /CN=s".split()],
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
        check=True,
    )
    tls = ServerConfig(
        model_path=str(small_model),
        tls_cert=str(tmp_path / "s.pem"),
        tls_key=str(tmp_path / "s.key"),
        metrics_port=-1,
    )

    async def scenario() -> int:
        async with serving(RecordingEngine(str(small_model)), tls) as s:
            argv = ["top", "--target", s.target, "--once", "--timeout-s", "2"]
            return await asyncio.to_thread(main, argv)

    assert asyncio.run(scenario()) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE: " in err
    assert "Socket closed" in err
    assert "(a TLS server? try --tls-ca PEM, or --tls for the system's roots)" in err


def test_live_top_cuts_each_line_to_the_terminal_width(small_model: Path) -> None:
    """On a terminal a frame's lines (up to 104 characters) wrapped: at 40 columns a
    16-line frame took 35 rows, and each redraw scrolled its header away. Each line is
    now cut to the terminal's width, read at each frame (the terminal may be resized);
    the first line has the time (UTC)."""
    entry_point = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from laneserve.server.cli import main; sys.exit(main())"
    )
    clear = "\x1b[H\x1b[2J"
    env = {name: value for name, value in os.environ.items() if name not in ("COLUMNS", "LINES")}
    screen, terminal = pty.openpty()
    output = bytearray()

    def resize(columns: int) -> None:
        fcntl.ioctl(screen, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))

    def read_screen() -> None:
        while True:
            try:
                chunk = os.read(screen, 65536)
            except OSError:  # EIO: the terminal's last writer has gone
                return
            if not chunk:
                return
            output.extend(chunk)

    def frames() -> list[str]:
        return bytes(output).decode().replace("\r", "").split(clear)[1:]

    async def scenario() -> tuple[int | None, int]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, ServerConfig(model_path=str(small_model))) as s:
            resize(40)
            try:
                process = await asyncio.create_subprocess_exec(
                    *(sys.executable, "-c", entry_point, "top", "--target", s.target),
                    *("--interval-s", "0.05"),
                    stdin=subprocess.DEVNULL,
                    stdout=terminal,
                    stderr=terminal,
                    env=env,
                )
            finally:
                os.close(terminal)
            reader = threading.Thread(target=read_screen, daemon=True)
            reader.start()
            try:
                await until(lambda: len(frames()) >= 3, timeout_s=CLIENT_CLI_TIMEOUT_S)
                resize(60)
                # The frame being polled may have read the width before: the one after not.
                resized = len(frames()) + 1
                await until(lambda: len(frames()) > resized + 1, timeout_s=CLIENT_CLI_TIMEOUT_S)
                process.send_signal(signal.SIGINT)
                code = await asyncio.wait_for(process.wait(), timeout=CLIENT_CLI_TIMEOUT_S)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
                await asyncio.to_thread(reader.join, 10.0)
                os.close(screen)
        return code, resized

    code, resized = asyncio.run(scenario())
    assert code == 0
    shown = frames()
    narrow, wide = shown[0].splitlines(), shown[resized].splitlines()
    assert max(len(line) for line in narrow) == 40, narrow
    assert re.match(r"laneserve top \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ  127\.", narrow[0]), narrow
    assert any(line.startswith("interactive ") for line in narrow)
    assert max(len(line) for line in wide) == 60, wide
    assert "SERVING" in wide[0]


def test_a_live_frame_taller_than_the_terminal_is_cut_to_its_height(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A frame taller than the screen scrolled its header away at each redraw: it is cut
    to the terminal's rows less the cursor's, its last row saying how many lines were
    left out; a frame that fits is shown whole."""
    frame = "laneserve top  h:1\n" + "".join(f"lane {n}\n" for n in range(30))
    shown: list[str] = []
    for height, expected in ((10, 9), (40, 31)):
        monkeypatch.setattr(shutil, "get_terminal_size", lambda height=height: (80, height))
        top._show(frame, live=True)
        shown = capsys.readouterr().out.removeprefix("\x1b[H\x1b[2J").splitlines()
        assert len(shown) == expected
        assert re.match(r"laneserve top \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ  h:1$", shown[0])
    assert shown[-1] == "lane 29"
    monkeypatch.setattr(shutil, "get_terminal_size", lambda: (80, 10))
    top._show(frame, live=True)
    cut = capsys.readouterr().out.splitlines()
    assert cut[-2:] == ["lane 6", "... 23 more lines: enlarge the terminal"]


def test_top_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--iterations", "0"]) == 2
    assert "--iterations: expected >= 1, got 0" in capsys.readouterr().err
    for interval in ("nan", "inf", "1e300"):
        assert main(["top", "--interval-s", interval]) == 2
        assert "--interval-s: expected seconds in (0, 3600]" in capsys.readouterr().err
    # gRPC would wrap the port round (105405: 39869) and connect there; bench alike.
    for command in (["top", "--target"], ["bench", "--target"], ["bench", "--target-priority"]):
        with pytest.raises(SystemExit) as exited:  # argparse's own refusal
            main([*command, "127.0.0.1:105405"])
        assert exited.value.code == 2
    for err in capsys.readouterr().err.split("usage:")[1:]:
        assert "'127.0.0.1:105405'" in err
        assert "expected HOST:PORT with a port from 1 to 65535" in err
    # laneserve-client's TLS options, named as they are given.
    assert main(["top", "--tls-cert", "client.pem"]) == 2
    assert (
        "laneserve top: --tls-cert and --tls-key go together (mutual TLS); got only --tls-cert"
        in capsys.readouterr().err
    )


def test_top_refuses_a_timeout_that_is_not_positive_finite_seconds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--timeout-s 0, -1, nan or inf went to gRPC as the deadline of every call: each
    ended DEADLINE_EXCEEDED at once (or never), reported as an unreachable server."""
    with socket.socket() as probe:  # a port nothing listens on: only a refusal exits 2
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
        for timeout in ("0", "-1", "nan", "inf", "1e300"):
            assert main(["top", "--target", target, "--once", "--timeout-s", timeout]) == 2
            err = capsys.readouterr().err
            assert "laneserve top: --timeout-s: expected seconds > 0 and at most 3600, got " in err
            assert err.count("\n") == 1, err
