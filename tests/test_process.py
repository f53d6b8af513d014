"""The interpreter settings `laneserve serve` applies once started, and a served process
whose stderr is not read."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from laneserve.server.process import GC_THRESHOLDS, GIL_SWITCH_INTERVAL_S, tune_for_serving
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import SERVE, START_TIMEOUT_S, output, request, rows


def test_tune_for_serving_sets_switch_interval_and_freezes_the_start_up_heap() -> None:
    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    try:
        tune_for_serving()
        assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0, "the start-up heap is out of collections"
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(interval)


# Seconds a call waits for its answer: a server whose event loop is stuck answers none.
STUCK_CALL_TIMEOUT_S = 10


@pytest.mark.skipif(sys.platform != "linux", reason="fills the pipe through /proc/self/fd")
def test_a_stderr_nobody_reads_does_not_stop_the_server(small_model: Path, tmp_path: Path) -> None:
    """stderr is a pipe whose reader stopped (a stuck supervisor). Its log lines were
    written by the thread that logged them: once the pipe was full, the first refusal's
    line blocked the event loop (and the scheduler lock), and no call was answered again,
    health checks included, until someone read the pipe. The lines wait in the log's
    queue instead, and are written once the pipe is read."""
    config = tmp_path / "lanes.toml"
    config.write_text(
        '[server]\ndefault_lane = "interactive"\n\n[[lanes]]\nname = "interactive"\n'
        "capacity_rows = 2\ntimeout_ms = 2000\nmax_wait_ms = 1\nmin_share = 0.0\n"
    )
    read_end, write_end = os.pipe()
    process = subprocess.Popen(
        [*SERVE, "--model", str(small_model), "--config", str(config), "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=write_end,
    )
    chunks: list[bytes] = []
    reader = threading.Thread(target=_read_to_the_end, args=(read_end, chunks), daemon=True)
    try:
        port = _serving_port(read_end, process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            # The health stubs' types lack the RPC attributes; the call itself is plain.
            health: Any = health_pb2_grpc.HealthStub(channel)
            assert _serving(health, timeout_s=STUCK_CALL_TIMEOUT_S), "logged as serving"
            _fill_pipe(write_end)
            os.close(write_end)  # the server's copy is the pipe's only writer now
            write_end = -1
            stub = pb_grpc.InferenceServiceStub(channel)
            # 3 rows in a lane of 2: refused, and the refusal logged at once.
            with pytest.raises(grpc.RpcError) as refused:
                stub.Infer(request(rows(3)), timeout=STUCK_CALL_TIMEOUT_S)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            answer = stub.Infer(request(rows(1)), timeout=STUCK_CALL_TIMEOUT_S)
            assert output(answer).shape[0] == 1
            assert _serving(health, timeout_s=STUCK_CALL_TIMEOUT_S)
        reader.start()  # the supervisor reads again
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=START_TIMEOUT_S) == 0
        reader.join(timeout=START_TIMEOUT_S)
        lines = [line for line in b"".join(chunks).decode().splitlines() if line]
        events = [line for line in lines if ": admission refused" in line or ": stopped" in line]
        assert len(events) == 2, lines
        assert ": admission refused 1 request(s)" in events[0]
        assert ": stopped drained=true" in events[1]
    finally:
        if write_end >= 0:
            os.close(write_end)
        if process.poll() is None:
            process.kill()
        if reader.ident is None:
            reader.start()  # reads to the end: a server killed while blocked on it ends
        process.wait(timeout=START_TIMEOUT_S)
        reader.join(timeout=START_TIMEOUT_S)
        os.close(read_end)


def _serving(health: Any, timeout_s: float = 1.0) -> bool:
    try:
        answer = health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def _fill_pipe(write_end: int) -> None:
    """Fills the pipe of `write_end` to the last byte, with empty lines. Through a file
    description of its own, non-blocking (O_NONBLOCK belongs to the description, so the
    server's stays blocking)."""
    filler = os.open(f"/proc/self/fd/{write_end}", os.O_WRONLY | os.O_NONBLOCK)
    try:
        for size in (4096, 1):
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(filler, b"\n" * size)
    finally:
        os.close(filler)


def _serving_port(read_end: int, process: subprocess.Popen[bytes]) -> int:
    """The port of the server's `serving ... on 127.0.0.1:PORT` line (logged once its
    health says SERVING), read from its stderr pipe: it binds port 0, so no other process
    can take its port between a pick and its bind. The test holds a write end of the
    pipe, so an exited server gives no end of file: each read waits a little, then
    checks that the server still runs."""
    written = b""
    until_s = time.monotonic() + START_TIMEOUT_S
    while (serving := re.search(rb"serving .* on 127\.0\.0\.1:(\d+)", written)) is None:
        assert process.poll() is None, f"the server exited:\n{written.decode()}"
        assert time.monotonic() < until_s, f"the server did not start serving:\n{written.decode()}"
        readable, _, _ = select.select([read_end], [], [], 0.1)
        if readable:
            written += os.read(read_end, 65536)
    return int(serving.group(1))


def _read_to_the_end(fd: int, chunks: list[bytes]) -> None:
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
