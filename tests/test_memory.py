"""Device memory as a hard limit, on the CPU with a capped ONNX Runtime arena.

The capped arena is process-wide in ONNX Runtime, so every test that needs one runs the
server (or the engine) in a child process with its own budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from laneserve.client.tensors import decode_tensor, encode_tensor
from laneserve.server import (
    ConfigError,
    LaneConfig,
    LaneServer,
    ServerConfig,
    load_engine,
    memory_start,
)
from laneserve.server import memory as memory_module
from laneserve.server.batch_caps import CAP_CEILING_BATCHES, CAP_RECOVERY_BATCHES, BatchCaps
from laneserve.server.clock import ManualClock
from laneserve.server.cost_model import MAX_SIGNATURES, RunTimeModel
from laneserve.server.demo_model import make_demo_model
from laneserve.server.engine import Engine, translate_runtime_error
from laneserve.server.errors import (
    DeviceMemoryError,
    DrainingError,
    EngineError,
    EngineStartError,
    ExpiredInQueueError,
    LaneserveError,
    MemoryPressureError,
    SessionBrokenError,
)
from laneserve.server.events import NullEvents
from laneserve.server.items import (
    Array,
    Batch,
    BatchResult,
    BatchSlice,
    DispatchReason,
    FailedRows,
    InferenceRequest,
    Outcome,
    OutOfMemoryRun,
    RowsWanted,
    Signature,
)
from laneserve.server.memory import (
    CgroupMemoryLimit,
    MemoryEstimate,
    MemoryLimit,
    ProcessRssGauge,
    Watermark,
    WatermarkState,
    cgroup_cpu_limit,
    cgroup_memory_limit,
    estimate_memory,
    fit_memory,
    format_bytes,
    host_available_bytes,
    parse_memory_limit,
)
from laneserve.server.probe import HOST_PROBE_SHARE, Probe
from laneserve.server.providers import (
    CPU,
    CUDA,
    choose_providers,
    cuda_provider_options,
    default_intra_op_threads,
)
from laneserve.server.scheduler import Dispatch, Scheduler
from laneserve.server.scheduler_thread import (
    CLOSED_LANES_LOG_S,
    MEMORY_RELEASE_PERIOD_S,
    MEMORY_SAMPLE_PERIOD_S,
    ClosedLanesLog,
    SchedulerThread,
)
from laneserve.server.split_runs import Split
from laneserve.server.static_estimate import static_estimate
from laneserve.server.stats import StatsRecorder
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import (
    RecordingEngine,
    ServerProcess,
    Serving,
    SettableGauge,
    estimate_once,
    output,
    request,
    rich_status,
    rows,
    run_text,
    save_model,
    serving,
    until,
)

MIB = 1024 * 1024
GIB = 1024 * MIB
# The demo MLP under this budget runs up to ~750 rows and fails at 768 (weights take
# 20 MiB); its probe settles on 736.
DEMO_BUDGET = "32MiB"
# A child process is killed past this: its test fails, never hangs.
CHILD_TIMEOUT_S = 120
# What the watermarks the tests make read, as a refusal names it.
WATERMARK_READING = "memory in use on GPU '0'"


def _run_python(*argv: str, exit_code: int = 0) -> subprocess.CompletedProcess[str]:
    """`python ARGV` in a child process (its own process-wide arena and budget), which
    must exit with `exit_code`; its stdout and stderr are text."""
    done = run_text(
        [sys.executable, *argv],
        timeout_s=CHILD_TIMEOUT_S,
    )
    assert done.returncode == exit_code, (
        f"the child exited {done.returncode}, expected {exit_code}; its stderr:\n{done.stderr}"
    )
    return done


def _run_script(script: str, *args: str) -> str:
    """The stdout of `python -c SCRIPT ARGS`, which must succeed."""
    return _run_python("-c", script, *args).stdout


def _script_report(script: str, *args: str) -> Any:
    """The JSON document a successful `python -c SCRIPT ARGS` printed last."""
    return json.loads(_run_script(script, *args).strip().splitlines()[-1])


# ---- the budget and the watermark --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6GiB", MemoryLimit(limit_bytes=6 * 1024**3)),
        ("512MiB", MemoryLimit(limit_bytes=512 * MIB)),
        ("2000000", MemoryLimit(limit_bytes=2_000_000)),
        ("1.5GB", MemoryLimit(limit_bytes=1_500_000_000)),
        ("0.9", MemoryLimit(fraction=0.9)),
    ],
)
def test_memory_limit_parses_bytes_and_fractions(text: str, expected: MemoryLimit) -> None:
    assert parse_memory_limit(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "12XB", "100KiB", "1.5"])
def test_bad_memory_limit_names_what_was_expected(text: str) -> None:
    with pytest.raises(ValueError, match="memory limit"):
        parse_memory_limit(text)


@pytest.mark.parametrize(
    ("text", "read_as"), [("1.5", "1 bytes"), ("0.0", "0 bytes"), ("2", "2 bytes")]
)
def test_a_limit_under_1mib_says_how_it_was_read(text: str, read_as: str) -> None:
    """A fraction over 1 is read as bytes: the refusal said "expected at least 1MiB" to
    a caller who meant a fraction, and never that fractions are in (0, 1]."""
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"memory limit {text!r} is {read_as}; expected at least 1MiB, or a fraction "
            "of device memory in (0, 1] such as 0.9"
        ),
    ):
        parse_memory_limit(text)


def test_fraction_needs_the_device_total() -> None:
    assert MemoryLimit(fraction=0.5).resolve(1000 * MIB) == 500 * MIB
    with pytest.raises(ValueError, match="give bytes instead"):
        MemoryLimit(fraction=0.5).resolve(None)


def test_watermark_closes_lanes_bottom_up_and_reopens_below_low() -> None:
    mark = Watermark(
        lanes=3, high_bytes=95, low_bytes=85, limit_bytes=100, reading=WATERMARK_READING
    )
    assert [mark.refuses(p) for p in range(3)] == [False, False, False]
    mark.update(95)  # at the high watermark: the lowest lane closes
    assert [mark.refuses(p) for p in range(3)] == [False, False, True]
    mark.update(98)  # nearer the limit: the middle lane too
    assert [mark.refuses(p) for p in range(3)] == [False, True, True]
    mark.update(100)  # at the limit: every lane
    assert [mark.refuses(p) for p in range(3)] == [True, True, True]
    mark.update(90)  # between the watermarks: nothing reopens (no flapping)
    assert mark.closed == 3
    mark.update(84)
    assert mark.closed == 0


def test_an_idle_reading_closes_only_the_lanes_of_its_own_level() -> None:
    """With nothing queued or running, refusing work cannot lower the reading: a server
    whose idle memory stayed between the marks after a burst kept every lane closed for
    good (a review: 140-145 MiB against a low mark of 127.5 under 150 MiB). Idle, the
    hysteresis holds nothing closed; the reading's own level still does."""
    mark = Watermark(
        lanes=3, high_bytes=95, low_bytes=85, limit_bytes=100, reading=WATERMARK_READING
    )
    mark.update(100)
    assert mark.closed == 3
    mark.update(90)  # work still queued or running: the hysteresis holds
    assert mark.closed == 3
    mark.update(98, idle=True)  # the level of 98 alone: standard and bulk
    assert [mark.refuses(p) for p in range(3)] == [False, True, True]
    mark.update(90, idle=True)
    assert mark.closed == 0
    mark.update(96)
    mark.update(90)
    assert mark.closed == 1  # closed by work again, held again while it runs


def test_process_gauge_reads_resident_memory() -> None:
    gauge = ProcessRssGauge()
    used, total = gauge.used_bytes(), gauge.total_bytes()
    assert used is not None
    assert total is not None
    assert 0 < used < total


def test_a_cpu_budgets_fraction_is_of_the_cgroup_limit_where_it_is_lower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--memory-limit 0.5 on the CPU was half the host's memory whatever the container's
    limit: a 4 GiB pod on a 256 GiB host capped its arena at 128 GiB."""
    physical = ProcessRssGauge().total_bytes()
    assert physical is not None
    pod = CgroupMemoryLimit(4 * GIB, "memory.max")
    monkeypatch.setattr(memory_module, "cgroup_memory_limit", lambda: pod)
    assert ProcessRssGauge().total_bytes() == min(physical, 4 * GIB)
    roomy = CgroupMemoryLimit(physical * 2, "memory.max")
    monkeypatch.setattr(memory_module, "cgroup_memory_limit", lambda: roomy)
    assert ProcessRssGauge().total_bytes() == physical


def test_static_estimate_counts_weights_and_row_activations(tmp_path: Path) -> None:
    path = tmp_path / "mlp.onnx"
    make_demo_model(path, input_dim=16, hidden_dim=32, hidden_layers=1, output_dim=4)
    estimate = estimate_memory(str(path))
    assert estimate is not None
    assert estimate == MemoryEstimate(*static_estimate(str(path))), "the child's, as in-process"
    weights = (16 * 32 + 32 + 32 * 4 + 4) * 4
    assert estimate.fixed_bytes == weights
    # Input, hidden activations and output of one row, at the very least.
    assert estimate.per_row_bytes >= (16 + 32 + 4) * 4
    assert estimate.rows_within(weights + 10 * estimate.per_row_bytes) == 10


def test_static_estimate_counts_weights_written_as_constant_nodes(tmp_path: Path) -> None:
    """Some exporters write weights as the values of Constant nodes: counted from the
    initializers alone, the demo model's were 0 bytes, and a 4 MiB CPU budget was taken,
    every batch then run outside the capped arena."""
    path = tmp_path / "mlp.onnx"
    make_demo_model(path, input_dim=16, hidden_dim=32, hidden_layers=1, output_dim=4)
    model = onnx.load(str(path))
    constants = [
        helper.make_node("Constant", [], [weight.name], value=weight)
        for weight in model.graph.initializer
    ]
    nodes = [*constants, *model.graph.node]
    del model.graph.initializer[:]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.checker.check_model(model)
    as_constants = tmp_path / "mlp_constants.onnx"
    onnx.save(model, str(as_constants))
    assert static_estimate(str(as_constants)) == static_estimate(str(path))


def test_static_estimate_that_fails_is_none_and_names_the_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model shape inference cannot read must not stop the server, and the log says
    which file and why. It said "GetModel reports 0" as well, before a garbage file the
    runtime cannot load either was refused: the server may not start at all."""
    path = tmp_path / "not-a-model.onnx"
    path.write_bytes(b"\x00not protobuf")
    assert estimate_memory(str(path)) is None
    (record,) = [r for r in caplog.records if "static memory estimate" in r.getMessage()]
    assert str(path) in record.getMessage()
    assert "failed (exit 1:" in record.getMessage()
    assert record.getMessage().endswith(")"), "the child's last line, and nothing after it"
    assert "GetModel" not in record.getMessage()
    # An event, as every operator-facing line is (with --log-format json, its members).
    assert getattr(record, "event", None) == "static_estimate_failed"
    assert getattr(record, "fields", {})["exit_code"] == 1


def test_static_estimate_stopped_by_a_signal_is_no_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during start-up reaches the estimate's child with the server (one process
    group): it warned "static memory estimate ... failed (exit -2: no output)" as the
    server stopped. A child ended by a signal is said to have stopped, at INFO."""
    child = tmp_path / "python"
    child.write_text("#!/bin/sh\nkill -TERM $$\n")
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    caplog.set_level(logging.INFO, "laneserve")
    assert estimate_memory("model.onnx") is None
    (record,) = [r for r in caplog.records if "static memory estimate" in r.getMessage()]
    assert record.getMessage() == "static memory estimate of model.onnx stopped by SIGTERM"
    assert record.levelno == logging.INFO
    assert getattr(record, "event", None) == "static_estimate_stopped"


# A serving process in miniature: it asks for an estimate, and waits for it.
_ESTIMATING_PARENT = """
import sys
from laneserve.server.memory import estimate_memory
estimate_memory(sys.argv[1], timeout_s=600)
"""


def _estimate_child_of(parent_pid: int) -> int | None:
    """The pid of `parent_pid`'s child running static_estimate.py, if one runs now."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if ppid == parent_pid and b"static_estimate.py" in command:
            return int(entry.name)
    return None


def _runs_the_estimate(pid: int) -> bool:
    """Whether process `pid` runs static_estimate.py."""
    try:
        return b"static_estimate.py" in (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and not yet reaped by init, does not)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _within(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Whether `condition` held within `timeout_s` (polled; a bound, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_an_estimates_child_ends_when_its_server_is_killed(tmp_path: Path) -> None:
    """A server SIGKILLed (the OOM killer, a container runtime's kill) while its estimate's
    child parsed the model ran nothing to end the child, which parsed on, GBs resident for
    a large model. The child now exits once its parent is gone. The model here is a FIFO
    nobody writes: the child waits on it for ever, so only its parent's death ends it."""
    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)
    parent = subprocess.Popen([sys.executable, "-c", _ESTIMATING_PARENT, str(fifo)])
    child_pid: int | None = None
    try:
        assert _within(lambda: _estimate_child_of(parent.pid) is not None, 60)
        child_pid = _estimate_child_of(parent.pid)
        assert child_pid is not None
        parent.kill()
        parent.wait(timeout=30)
        assert _within(lambda: not _running(child_pid), 60), "the orphaned child ran on"
    finally:
        parent.kill()
        parent.wait(timeout=30)
        # Still that child (a pid reaped and reused is another process's now):
        if child_pid is not None and _running(child_pid) and _runs_the_estimate(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_static_estimate_killed_by_another_signal_is_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL (the kernel's OOM killer) is no stop of the server's: a warning, as any
    failure of the estimate."""
    child = tmp_path / "python"
    child.write_text("#!/bin/sh\nkill -KILL $$\n")
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    assert estimate_memory("model.onnx") is None
    (record,) = [r for r in caplog.records if "static memory estimate" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "static memory estimate of model.onnx failed (exit -9: no output)"


@pytest.mark.parametrize("memory_limit", [None, "64MiB"], ids=["no-budget", "cpu-budget"])
def test_serving_process_never_imports_onnx(tmp_path: Path, memory_limit: str | None) -> None:
    """The estimate's child takes onnx and the parsed weights with it when it exits; a
    CPU budget, checked against the weights, uses the same child (once)."""
    script = (
        "import sys\n"
        "from laneserve.server import LaneServer, ServerConfig, load_engine\n"
        f"config = ServerConfig(model_path={str(tmp_path / 'mlp.onnx')!r}, "
        f"memory_limit={memory_limit!r})\n"
        "server = LaneServer(load_engine(config), config)\n"
        "assert server.memory_estimate is not None\n"
        "print('onnx' in sys.modules)\n"
    )
    make_demo_model(tmp_path / "mlp.onnx", input_dim=16, hidden_dim=32, hidden_layers=1)
    assert _run_script(script).strip() == "False"


@pytest.mark.parametrize("memory_limit", [None, "64MiB"], ids=["no-budget", "cpu-budget"])
def test_a_failed_estimate_runs_once(tmp_path: Path, memory_limit: str | None) -> None:
    """The budget check's estimate failed (None), and the server took None for "not
    worked out": it ran the ~1 s child again and logged the failure twice. The engine
    works it out, with a budget or without, and the server takes the engine's."""
    script = (
        "import laneserve.server.engine as engine\n"
        "from laneserve.server import LaneServer, ServerConfig, load_engine\n"
        "calls = []\n"
        "def failing(path, **options):\n"
        "    calls.append(path)\n"
        "    return None\n"
        "engine.estimate_memory = failing\n"
        f"config = ServerConfig(model_path={str(tmp_path / 'mlp.onnx')!r}, "
        f"memory_limit={memory_limit!r})\n"
        "server = LaneServer(load_engine(config), config)\n"
        "print(len(calls), server.memory_estimate)\n"
    )
    make_demo_model(tmp_path / "mlp.onnx", input_dim=16, hidden_dim=32, hidden_layers=1)
    assert _run_script(script).split() == ["1", "None"]


def test_the_estimate_runs_before_the_session_is_made(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The estimate's child parses the whole model (584 MiB at its peak for 272 MiB of
    weights). Without a CPU budget it ran once the server's session held the weights:
    server and child peaked at 927 MiB together, 657 with the child first."""
    order: list[str] = []
    run_child, make_session = subprocess.Popen, ort.InferenceSession

    def recorded_child(argv: Sequence[str], *args: Any, **kwargs: Any) -> Any:
        if any(str(arg).endswith("static_estimate.py") for arg in argv):
            order.append("estimate")
        return run_child(argv, *args, **kwargs)

    def recorded_session(*args: Any, **kwargs: Any) -> ort.InferenceSession:
        order.append("session")
        return make_session(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", recorded_child)
    monkeypatch.setattr(ort, "InferenceSession", recorded_session)
    config = ServerConfig(model_path=str(small_model), device="cpu", metrics_port=-1)
    server = LaneServer(load_engine(config), config)
    server.telemetry.close()
    assert order == ["estimate", "session"], "the child first, and once"
    assert server.memory_estimate == estimate_once(str(small_model)), "the child's"


# Every unit a size may take, in a size of it that parses: decimal and binary alike.
UNIT_SIZES = [
    ("2097152B", 2 * MIB),
    ("2000KB", 2_000_000),
    ("2MB", 2_000_000),
    ("2GB", 2 * 1000**3),
    ("2TB", 2 * 1000**4),
    ("2048KiB", 2 * MIB),
    ("2MiB", 2 * MIB),
    ("2GiB", 2 * 1024**3),
    ("2TiB", 2 * 1024**4),
    ("2000k", 2_000_000),
    ("2m", 2_000_000),
    ("2g", 2 * 1000**3),
    ("2t", 2 * 1000**4),
]


@pytest.mark.parametrize(("text", "limit_bytes"), UNIT_SIZES)
def test_memory_limit_takes_every_unit_up_to_terabytes_in_any_case(
    text: str, limit_bytes: int
) -> None:
    """1TB was an unknown unit beside GB and TiB."""
    for spelled in (text, text.lower(), text.upper()):
        assert parse_memory_limit(spelled) == MemoryLimit(limit_bytes=limit_bytes)


def test_an_unknown_unit_is_refused_listing_every_unit_taken() -> None:
    """The refusal listed KiB, MiB, GiB: KB, MB, GB, TiB and k, m, g were taken too."""
    with pytest.raises(ValueError, match="unknown unit") as refused:
        parse_memory_limit("1XB")
    listed = re.search(
        r"expected no unit \(bytes\) or one of (.*) \(any case\)$", str(refused.value)
    )
    assert listed is not None, str(refused.value)
    assert listed.group(1).split(", ") == [text.lstrip("0123456789") for text, _ in UNIT_SIZES]


def test_a_limit_without_fractions_offers_none() -> None:
    """host_memory_limit takes bytes only: its refusals offered "or a fraction of device
    memory such as 0.9"."""
    for text, message in (
        ("100", "memory limit '100' is 100 bytes; expected at least 1MiB"),
        ("0.5", "memory limit '0.5': expected bytes like 6GiB, not a fraction"),
        ("lots", "memory limit 'lots': expected bytes like 6GiB"),
    ):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            parse_memory_limit(text, fraction_ok=False)
    assert parse_memory_limit("8GiB", fraction_ok=False) == MemoryLimit(limit_bytes=8 * 1024**3)


def test_a_single_lane_closes_only_at_the_limit() -> None:
    """It is the highest lane: at the high mark 1 + 0 * (lanes - 1) lanes closed it."""
    mark = Watermark(
        lanes=1, high_bytes=95, low_bytes=85, limit_bytes=100, reading=WATERMARK_READING
    )
    mark.update(95)
    assert not mark.refuses(0)
    mark.update(99)
    assert not mark.refuses(0)
    mark.update(100)
    assert mark.refuses(0)
    mark.update(90)  # between the watermarks: it stays closed
    assert mark.refuses(0)
    mark.update(84)
    assert not mark.refuses(0)


@pytest.mark.parametrize("low", ["1e-10", "1e-9"], ids=["zero-bytes", "one-byte"])
def test_a_tiny_low_watermark_is_refused_at_start_naming_it(
    small_model: Path, tmp_path: Path, low: str
) -> None:
    """A low mark of 0 bytes failed the watermark's own check (exit 1, a traceback); one
    of 1 byte was refused naming host_memory_limit, asking for a limit above 100 PiB."""
    config = tmp_path / "laneserve.toml"
    config.write_text(f"[server]\nmemory_low_watermark = {low}\n", encoding="utf-8")
    done = _run_python(
        *("-m", "laneserve.server.cli", "serve", "--model", str(small_model)),
        *("--device", "cpu", "--port", "0", "--metrics-port", "-1"),
        *("--host-memory-limit", "1GiB", "--config", str(config)),
        exit_code=2,
    )
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("laneserve: ")]
    assert line.startswith("laneserve: server.memory_low_watermark: "), line
    assert "expected" in line


class _Resident:
    """Memory in use as the test says, always: the idle server's reading at start."""

    def __init__(self, used_bytes: int) -> None:
        self.used = used_bytes

    def used_bytes(self) -> int | None:
        return self.used

    def total_bytes(self) -> int | None:
        return 64 * 1024 * MIB


class _ProbeReadsRows(Engine):
    """The real engine, whose start-up probe reads memory in use as `idle_bytes` plus
    `row_bytes` for each row of the run before the reading (fault injection of the
    readings, as _Resident's: the line the probe fits through them is known exactly)."""

    def __init__(self, model_path: Path, *, idle_bytes: int, row_bytes: int) -> None:
        super().__init__(str(model_path), device="cpu", estimate=estimate_once)
        self.reading = _Resident(idle_bytes)
        self.idle_bytes, self.reading_row_bytes = idle_bytes, row_bytes

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        self.reading.used = self.idle_bytes + self.reading_row_bytes * len(inputs["input"])
        return super().run(inputs)

    def probe(self, max_batch_size: int, **options: Any) -> Probe:
        return super().probe(max_batch_size, **{**options, "gauge": self.reading})


@pytest.mark.parametrize(
    ("low", "high", "limit", "message"),
    [
        pytest.param(
            1e-10,
            0.95,
            "1GiB",
            "server.memory_low_watermark: 1e-10 is 0 bytes of server.host_memory_limit "
            "(1.0GiB); expected a fraction of the limit above what the server holds idle "
            "(the default low watermark is 0.85)",
            id="low-mark-of-0-bytes",
        ),
        pytest.param(
            1e-10,
            1e-10,
            "1GiB",
            "server.memory_low_watermark, server.memory_high_watermark: 1e-10 and 1e-10 are 0 "
            "bytes of server.host_memory_limit (1.0GiB)",
            id="both-marks-of-0-bytes",
        ),
        pytest.param(
            1e-9,
            0.95,
            "1GiB",
            "server.memory_low_watermark: the server holds 100.0MiB idle after loading the "
            "model, at or above the low watermark 1B (memory_low_watermark 1e-09 of 1.0GiB), "
            "so lanes closed by memory pressure could never reopen; expected "
            "memory_low_watermark above 0.106 (the share of server.host_memory_limit the "
            "server holds idle plus a full batch of 128 rows at 64.0KiB a row as the probe "
            "measured, 8.0MiB; the default low watermark is 0.85), with room above it",
            id="low-mark-under-the-idle-server",
        ),
        pytest.param(
            0.01,
            0.05,
            "1GiB",
            "server.memory_low_watermark, server.memory_high_watermark: the server holds "
            "100.0MiB idle",
            id="both-marks-under-the-idle-server",
        ),
        pytest.param(
            0.85,
            0.95,
            "110MiB",
            "server.host_memory_limit: the server holds 100.0MiB idle after loading the model, "
            "at or above the low watermark 93.5MiB (memory_low_watermark 0.85 of 110.0MiB), so "
            "lanes closed by memory pressure could never reopen; expected a limit above "
            "127.1MiB (the idle reading plus a full batch of 128 rows at "
            "64.0KiB a row as the probe measured, 8.0MiB, over memory_low_watermark 0.85), "
            "with room above it",
            id="limit-under-the-idle-server",
        ),
    ],
)
def test_a_watermark_the_idle_server_cannot_get_below_names_the_setting_at_fault(
    demo_model: Path, low: float, high: float, limit: str, message: str
) -> None:
    """The limit was named whatever the marks were: a low mark of 1e-9 of 1 GiB asked for a
    limit above 100 PiB, and one of 0 bytes failed the watermark's own check (ValueError,
    a traceback at start). The limit is named where it holds the idle server above the
    default low mark; below it, the marks set lower are. The limit named counts a full
    batch, as the probe measured it, beside the idle server: named from the idle reading
    alone, a server for 272 MiB of weights started under it and kept every lane closed
    after one burst of full batches (431 MiB resident, idle, against a low mark of 374)."""
    config = ServerConfig(
        model_path=str(demo_model),
        device="cpu",
        metrics_port=-1,
        host_memory_limit=limit,
        memory_low_watermark=low,
        memory_high_watermark=high,
    )
    engine = _ProbeReadsRows(demo_model, idle_bytes=100 * MIB, row_bytes=64 * 1024)
    with pytest.raises(ConfigError) as refused:
        LaneServer(engine, config, memory_gauge=_Resident(100 * MIB))
    assert str(refused.value).startswith(message)


def test_a_limit_under_the_idle_server_is_named_from_it_where_the_probe_fitted_nothing(
    demo_model: Path,
) -> None:
    """One size probed (max_batch_size 1): no line through the readings, no batch's share
    known; the limit named is the idle reading's over the low mark, as before, rounded
    up (117.65 MiB was named 117.6MiB, a limit still refused)."""
    config = ServerConfig(
        model_path=str(demo_model),
        device="cpu",
        metrics_port=-1,
        host_memory_limit="110MiB",
        max_batch_size=1,
    )
    engine = _ProbeReadsRows(demo_model, idle_bytes=100 * MIB, row_bytes=64 * 1024)
    with pytest.raises(ConfigError) as refused:
        LaneServer(engine, config, memory_gauge=_Resident(100 * MIB))
    assert "; expected a limit above 117.7MiB, with room above it" in str(refused.value)
    assert refused.value.key == "server.host_memory_limit"  # `serve` names the flag by it


# ---- the scheduler's reaction: cap, failed rows, admission ------------------------------


def _request(index: int, lane: str, count: int, width: int = 2) -> InferenceRequest:
    return InferenceRequest(
        request_id=f"r{index}",
        lane=lane,
        inputs={"input": np.full((count, width), index, dtype=np.float32)},
        rows=count,
        signature=((width,),),
        deadline_s=None,
        token=index,
    )


def _scheduler(cap: int, watermark: Watermark | None = None) -> Scheduler:
    lanes = [
        LaneConfig(
            "interactive", capacity_rows=4096, timeout_ms=60_000, max_wait_ms=0, min_share=0
        ),
        LaneConfig("standard", capacity_rows=4096, timeout_ms=60_000, max_wait_ms=0, min_share=0),
        LaneConfig("bulk", capacity_rows=4096, timeout_ms=60_000, max_wait_ms=0, min_share=0),
    ]
    return Scheduler(lanes, batch_cap=cap, run_time=RunTimeModel({1: 0.001}), watermark=watermark)


def _dispatch(scheduler: Scheduler, clock: ManualClock) -> BatchResult:
    decision = scheduler.decide(clock.monotonic(), clock.monotonic())
    assert isinstance(decision, Dispatch)
    batch = decision.batch
    outputs = {"out": np.concatenate(batch.parts["input"]) * 2}
    return BatchResult(batch, outputs, None, 0.001)


def _ran_out_of_memory(ran: BatchResult) -> BatchResult:
    """`ran` as the engine reports a batch that ran out of memory whole, then ran in
    halves."""
    oom = OutOfMemoryRun(ran.batch.rows, held_unfit_row=False)
    return dataclasses.replace(ran, out_of_memory_runs=(oom,), split=True)


def test_out_of_memory_halves_the_cap_and_success_raises_it_back() -> None:
    clock = ManualClock()
    scheduler = _scheduler(64)
    scheduler.admit(_request(0, "standard", 64), clock.monotonic())
    ok = _dispatch(scheduler, clock)
    # The engine ran out of memory at 64 rows and succeeded in halves.
    (answer,) = scheduler.complete(_ran_out_of_memory(ok))
    assert answer.error is None
    assert scheduler.batch_cap == 32
    # A single row failing alone says nothing about the batch size.
    scheduler.admit(_request(1, "standard", 1), clock.monotonic())
    one = _dispatch(scheduler, clock)
    scheduler.complete(
        BatchResult(
            one.batch,
            one.outputs,
            None,
            0.001,
            failed_rows=(FailedRows(0, 1, DeviceMemoryError("too big")),),
            out_of_memory_runs=(OutOfMemoryRun(1, held_unfit_row=True),),
        )
    )
    assert scheduler.batch_cap == 32
    for index in range(CAP_RECOVERY_BATCHES):
        scheduler.admit(_request(index + 2, "standard", 32), clock.monotonic())
        assert scheduler.batch_cap == 32
        scheduler.complete(_dispatch(scheduler, clock))
    assert scheduler.batch_cap == 32 + 64 // 16
    assert scheduler.max_batch_cap == 64


def test_the_cap_recovers_when_request_sizes_do_not_divide_it() -> None:
    """After an out-of-memory at 240 rows the cap was 120: 48-row requests made batches
    of 96 rows, never the cap's 120, so none counted as full and the cap stayed at 120
    (of 256) for good. A batch no request of its size would fit beside counts now."""
    clock = ManualClock()
    scheduler = _scheduler(256)
    for index in range(5):
        scheduler.admit(_request(index, "standard", 48), clock.monotonic())
    scheduler.complete(_ran_out_of_memory(_dispatch(scheduler, clock)))
    assert scheduler.batch_cap == 120
    index = 100
    for _ in range(4 * CAP_RECOVERY_BATCHES):
        while scheduler.lane("standard").queued_rows < 4 * 48:
            scheduler.admit(_request(index, "standard", 48), clock.monotonic())
            index += 1
        scheduler.complete(_dispatch(scheduler, clock))
    assert scheduler.batch_cap > 120 + 2 * (256 // 16), scheduler.batch_cap


def test_a_batch_at_the_cap_whose_halves_failed_too_sets_the_ceiling() -> None:
    """The batch at the cap ran out of memory and so did a half of it. No ceiling was set
    (the smallest failing run was below the cap), so the cap climbed straight back to the
    failing size and failed again, every ~65 batches. Then one was, at the cap's size
    alone, and the cap climbed back to the half's size and failed there once more: the
    half's rows are of the batch's shape, so its failure holds the cap below it too."""
    clock = ManualClock()
    scheduler = _scheduler(64)
    scheduler.admit(_request(0, "standard", 64), clock.monotonic())
    ran = _dispatch(scheduler, clock)
    runs = (OutOfMemoryRun(64, held_unfit_row=False), OutOfMemoryRun(32, held_unfit_row=False))
    scheduler.complete(dataclasses.replace(ran, out_of_memory_runs=runs, split=True))
    assert scheduler.batch_cap == 16
    for index in range(1, 1000):
        scheduler.admit(_request(index, "standard", scheduler.batch_cap), clock.monotonic())
        scheduler.complete(_dispatch(scheduler, clock))
    assert scheduler.batch_cap == 28, "held below the smallest size that failed (32)"


def test_a_full_batch_of_requests_that_do_not_divide_the_cap_sets_the_ceiling() -> None:
    """Batches over 50 rows run out of memory; requests of 20 rows. The batch that failed
    held 60 rows under a cap of 64 (no third request fitted): full, as recovery counts
    one, but under the cap, so no ceiling was set, and the cap climbed back to 62 and
    failed again every ~65 batches, 86 times in 6 000 batches."""
    clock = ManualClock()
    scheduler = _scheduler(64)
    failures = []
    index = 0
    for batch in range(3 * CAP_CEILING_BATCHES // 2):
        while scheduler.lane("standard").queued_rows < 4 * 64:
            scheduler.admit(_request(index, "standard", 20), clock.monotonic())
            index += 1
        ran = _dispatch(scheduler, clock)
        if ran.batch.rows > 50:
            failures.append((batch, ran.batch.rows))
            ran = _ran_out_of_memory(ran)
        scheduler.complete(ran)
    # The first, then one probe of the failing size after CAP_CEILING_BATCHES held below.
    assert len(failures) == 2, failures
    assert failures[1][0] - failures[0][0] > CAP_CEILING_BATCHES


def test_the_probe_after_the_hold_tries_the_size_that_failed_not_a_step_past_it() -> None:
    """A batch of 100 rows (two 50-row requests, full under a cap of 128) ran out of
    memory; the cap climbed by 8 from 50 and held at 98. After the hold it probed 106, a
    step past the size that failed: the size itself was never tried again."""
    clock = ManualClock()
    scheduler = _scheduler(128)
    index = 0

    def run_full_batch(rows_per_request: int, fails_over: int) -> int:
        nonlocal index
        while scheduler.lane("standard").queued_rows < 4 * 128:
            scheduler.admit(_request(index, "standard", rows_per_request), clock.monotonic())
            index += 1
        ran = _dispatch(scheduler, clock)
        scheduler.complete(_ran_out_of_memory(ran) if ran.batch.rows > fails_over else ran)
        return ran.batch.rows

    assert run_full_batch(50, fails_over=99) == 100
    caps = [scheduler.batch_cap]
    for _ in range(CAP_CEILING_BATCHES + 8 * CAP_RECOVERY_BATCHES):
        run_full_batch(1, fails_over=1_000)
        if scheduler.batch_cap != caps[-1]:
            caps.append(scheduler.batch_cap)
    # Held at 98, the probe tries 100; it runs, and the cap climbs on from there.
    assert caps[:9] == [50, 58, 66, 74, 82, 90, 98, 100, 108], caps


def _row_two_does_not_fit(ran: BatchResult) -> BatchResult:
    """`ran` (a 6-row batch) as the engine reports it when row 2 does not fit even alone:
    the runs of 6 and 3 rows that held it ran out of memory, then the row itself."""
    return BatchResult(
        ran.batch,
        ran.outputs,
        None,
        0.001,
        failed_rows=(FailedRows(2, 1, DeviceMemoryError("one row too large")),),
        out_of_memory_runs=(
            OutOfMemoryRun(6, held_unfit_row=True),
            OutOfMemoryRun(3, held_unfit_row=True),
            OutOfMemoryRun(1, held_unfit_row=True),
        ),
    )


def test_only_the_request_whose_row_does_not_fit_fails() -> None:
    clock = ManualClock()
    scheduler = _scheduler(8)
    for index, count in enumerate([2, 1, 3]):
        scheduler.admit(_request(index, "standard", count), clock.monotonic())
    result = _dispatch(scheduler, clock)
    # Row 2 of the batch (request 1's only row) did not fit even alone.
    failed = _row_two_does_not_fit(result)
    answers = {answer.token: answer for answer in scheduler.complete(failed)}
    assert isinstance(answers[1].error, DeviceMemoryError)
    assert answers[0].error is None
    assert answers[2].error is None
    assert answers[2].outputs is not None
    np.testing.assert_array_equal(answers[2].outputs["out"], np.full((3, 2), 4.0))
    assert scheduler.live_entries == 0


def test_a_batch_split_more_than_once_counts_as_one_split_batch() -> None:
    """Runs of 6 and 3 rows ran out of memory, then a row alone: three out-of-memory runs,
    one batch split (the counter, "batches split", counted 2: every run split)."""
    clock = ManualClock()
    scheduler = _scheduler(8)
    stats = scheduler.events = StatsRecorder(["interactive", "standard", "bulk"])
    for index, count in enumerate([2, 1, 3]):
        scheduler.admit(_request(index, "standard", count), clock.monotonic())
    scheduler.complete(_row_two_does_not_fit(_dispatch(scheduler, clock)))
    counts = stats.counts()
    assert counts.out_of_memory == 3
    assert counts.batch_splits == 1


def test_the_cap_settles_below_a_size_that_ran_out_of_memory() -> None:
    """After running out of memory at 64 rows the cap climbs back step by step but holds
    at the last size that ran (60) instead of returning to 64 every few hundred batches;
    only after CAP_CEILING_BATCHES full batches in a row does it probe 64 once more. A
    probe that fails returns it to 60 (it halved to 32 and climbed for ~1 000 batches)."""
    clock = ManualClock()
    scheduler = _scheduler(64)
    scheduler.admit(_request(0, "standard", 64), clock.monotonic())
    ok = _dispatch(scheduler, clock)
    scheduler.complete(_ran_out_of_memory(ok))
    caps = [scheduler.batch_cap]
    changed_at = [0]
    for index in range(1, CAP_CEILING_BATCHES + 8 * CAP_RECOVERY_BATCHES):
        scheduler.admit(_request(index, "standard", scheduler.batch_cap), clock.monotonic())
        scheduler.complete(_dispatch(scheduler, clock))
        if scheduler.batch_cap != caps[-1]:
            caps.append(scheduler.batch_cap)
            changed_at.append(index)
    assert caps == [32, 36, 40, 44, 48, 52, 56, 60, 64], "held at 60, then one probe of 64"
    assert changed_at[-1] - changed_at[-2] == CAP_CEILING_BATCHES, "held that long at 60"
    # The probe fails: back to 60, which ran all that time, not to half of 64.
    scheduler.admit(_request(0, "standard", 64), clock.monotonic())
    scheduler.complete(_ran_out_of_memory(_dispatch(scheduler, clock)))
    assert scheduler.batch_cap == 60
    # 60 fails too (memory shrank since): it is no longer proven, the cap halves.
    scheduler.admit(_request(1, "standard", 60), clock.monotonic())
    scheduler.complete(_ran_out_of_memory(_dispatch(scheduler, clock)))
    assert scheduler.batch_cap == 30


def test_a_passing_shortage_below_the_cap_sets_no_ceiling() -> None:
    """Out of memory on a batch smaller than the cap (larger ones ran) halves the cap but
    does not hold it there: it climbs back at the usual pace."""
    clock = ManualClock()
    scheduler = _scheduler(64)
    scheduler.admit(_request(0, "standard", 8), clock.monotonic())
    small = _dispatch(scheduler, clock)
    scheduler.complete(_ran_out_of_memory(small))
    assert scheduler.batch_cap == 4
    for index in range(1, CAP_RECOVERY_BATCHES + 1):
        scheduler.admit(_request(index, "standard", scheduler.batch_cap), clock.monotonic())
        scheduler.complete(_dispatch(scheduler, clock))
    assert scheduler.batch_cap == 4 + 64 // 16, "not held below the size that failed"


def test_rows_too_large_alone_do_not_move_the_cap() -> None:
    """A run that failed because it held a row too large even alone says nothing about
    batch size; a run of ordinary rows that failed does. (A two-row request of such rows
    pulled the cap to one for everybody's traffic.)"""
    clock = ManualClock()
    scheduler = _scheduler(64)
    scheduler.admit(_request(0, "standard", 2), clock.monotonic())
    pair = _dispatch(scheduler, clock)
    too_large = DeviceMemoryError("one row of this request needs more device memory")
    (answer,) = scheduler.complete(
        BatchResult(
            pair.batch,
            None,
            None,
            0.001,
            failed_rows=(FailedRows(0, 1, too_large), FailedRows(1, 1, too_large)),
            out_of_memory_runs=(
                OutOfMemoryRun(2, held_unfit_row=True),
                OutOfMemoryRun(1, held_unfit_row=True),
                OutOfMemoryRun(1, held_unfit_row=True),
            ),
        )
    )
    assert isinstance(answer.error, DeviceMemoryError)
    assert scheduler.batch_cap == 64, "nothing ran: only rows too large alone"
    for index, count in enumerate([2, 1, 3], start=1):
        scheduler.admit(_request(index, "standard", count), clock.monotonic())
    mixed = _dispatch(scheduler, clock)
    scheduler.complete(_row_two_does_not_fit(mixed))
    assert scheduler.batch_cap == 64, "both failed runs held the row too large alone"
    scheduler.admit(_request(4, "standard", 8), clock.monotonic())
    ordinary = _dispatch(scheduler, clock)
    scheduler.complete(_ran_out_of_memory(ordinary))
    assert scheduler.batch_cap == 4, "a run of ordinary rows that failed halves the cap"


def test_out_of_memory_lowers_the_cap_of_its_shape_alone() -> None:
    """Rows batch only with rows of their shape, and memory follows the shape: 64 rows of
    width 512 that ran out of memory say nothing of rows of width 2. With one cap for
    all, narrow traffic was held to 32-row batches until ~1 000 full batches had run."""
    clock = ManualClock()
    scheduler = _scheduler(64)
    wide, narrow = ((512,),), ((2,),)
    scheduler.admit(_request(0, "standard", 64, width=512), clock.monotonic())
    scheduler.complete(_ran_out_of_memory(_dispatch(scheduler, clock)))
    assert (scheduler.caps.rows(wide), scheduler.caps.rows(narrow)) == (32, 64)
    assert (scheduler.batch_cap, scheduler.max_batch_cap) == (32, 64), "the lowest in force"
    for index in range(1, 65):
        scheduler.admit(_request(index, "standard", 1), clock.monotonic())
        scheduler.admit(_request(100 + index, "standard", 1, width=512), clock.monotonic())
    ran = [_dispatch(scheduler, clock), _dispatch(scheduler, clock)]
    assert [(each.batch.signature, each.batch.rows) for each in ran] == [(narrow, 64), (wide, 32)]
    # A request larger than its shape's cap is split at that cap, and no other's.
    scheduler.admit(_request(200, "interactive", 48, width=512), clock.monotonic())
    ran += [_dispatch(scheduler, clock), _dispatch(scheduler, clock)]
    assert [each.batch.rows for each in ran[2:]] == [32, 16]
    for each in ran:
        scheduler.complete(each)
    # A narrow batch that runs out of memory lowers the narrow cap, from its own.
    scheduler.admit(_request(201, "interactive", 64), clock.monotonic())
    narrow_ran = _dispatch(scheduler, clock)
    assert narrow_ran.batch.rows == 64
    scheduler.complete(_ran_out_of_memory(narrow_ran))
    assert (scheduler.caps.rows(wide), scheduler.caps.rows(narrow)) == (32, 32)
    # Recovery counts each shape's own full batches.
    for index in range(CAP_RECOVERY_BATCHES):
        scheduler.admit(_request(300 + index, "interactive", 32), clock.monotonic())
        scheduler.complete(_dispatch(scheduler, clock))
    assert (scheduler.caps.rows(wide), scheduler.caps.rows(narrow)) == (32, 32 + 64 // 16)


def test_the_caps_of_shapes_not_run_lately_are_forgotten() -> None:
    """Caps are kept for the MAX_SIGNATURES lowered shapes run most recently: bounded for
    a model whose widths have no end. A shape that keeps running keeps its cap; one
    forgotten is back at its guess from the caps kept (the probed cap while none is
    lowered), reported as recovered where that is higher (its return moved GetStats'
    lowest cap with no log line or count), and the lowest in force is that of the shapes
    kept."""
    changes: list[tuple[int, int, str, Signature]] = []

    class Changes(NullEvents):
        def cap_changed(
            self, old_rows: int, new_rows: int, reason: str, signature: Signature
        ) -> None:
            changes.append((old_rows, new_rows, reason, signature))

    caps = BatchCaps(64, Changes())

    def ran(width: int, rows: int, *, failed: bool) -> BatchResult:
        piece = BatchSlice(width, "standard", 0, rows, 0)
        batch = Batch(width, (piece,), rows, DispatchReason.FULL, 0.0, {}, ((width,),))
        outputs = {"out": np.zeros((rows, width), dtype=np.float32)}
        if not failed:
            return BatchResult(batch, outputs, None, 0.001)
        oom = OutOfMemoryRun(rows, held_unfit_row=False)
        return BatchResult(batch, outputs, None, 0.001, out_of_memory_runs=(oom,), split=True)

    # Wide enough that the guesses scaled down from its cap are the probed cap (2 rows
    # of 100 000 values: 64 of up to 3 125).
    wide = ((100_000,),)
    assert caps.adapt(ran(100_000, 4, failed=True)) == [wide]  # 2 rows
    assert caps.adapt(ran(2, 64, failed=True))  # 32 rows
    assert not caps.adapt(ran(100_000, 2, failed=False)), "ran, unchanged: kept the longest"
    assert caps.lowest == 2
    for width in range(3, MAX_SIGNATURES + 2):  # one more than MAX_SIGNATURES shapes
        assert caps.adapt(ran(width, 64, failed=True))
    assert caps.rows(wide) == 2, "run after width 2's change: kept"
    # Forgotten: back at a guess from the caps kept, 32 rows of width 3 (the nearest).
    assert caps.rows(((2,),)) == 32 * 3 // 2
    assert changes[-2] == (32, 48, "recovered", ((2,),))
    assert caps.lowest == 2
    last = ((MAX_SIGNATURES + 2,),)
    assert caps.adapt(ran(MAX_SIGNATURES + 2, 64, failed=True)) == [wide, last], "forgotten"
    # Its guess, scaled up from the widest kept, is a row: lower, not a recovery, and a
    # guess is reported by no event. The lowest is of the caps kept.
    assert caps.rows(wide) == 1
    assert [change[2:] for change in changes if change[3] == wide] == [("out_of_memory", wide)]
    assert caps.lowest == 32


def _three_lane_mark() -> Watermark:
    """A watermark for three lanes at 95 and 85 of 100 MiB."""
    return Watermark(
        lanes=3,
        high_bytes=95 * MIB,
        low_bytes=85 * MIB,
        limit_bytes=100 * MIB,
        reading=WATERMARK_READING,
    )


def test_memory_pressure_refuses_bulk_before_standard_before_interactive() -> None:
    clock = ManualClock()
    mark = _three_lane_mark()
    scheduler = _scheduler(8, mark)

    def admitted(lane: str) -> bool:
        refusal: MemoryPressureError | None = None
        try:
            scheduler.admit(_request(0, lane, 1), clock.monotonic())
        except MemoryPressureError as error:
            refusal = error
        if refusal is None:
            return True
        assert refusal.retry_after_s is not None
        assert "watermark" in refusal.message
        return False

    scheduler.update_memory(96 * MIB)
    assert [admitted(lane) for lane in ("interactive", "standard", "bulk")] == [True, True, False]
    scheduler.update_memory(99 * MIB)
    assert [admitted(lane) for lane in ("interactive", "standard", "bulk")] == [True, False, False]
    scheduler.update_memory(80 * MIB)
    assert [admitted(lane) for lane in ("interactive", "standard", "bulk")] == [True, True, True]


def test_memory_pressure_over_grpc_refuses_bulk_first_with_pushback(small_model: Path) -> None:
    async def scenario() -> None:
        gauge = SettableGauge()
        config = ServerConfig(model_path=str(small_model), host_memory_limit="100MiB")
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config, memory_gauge=gauge) as s:
            watermark = s.server.scheduler.watermark
            assert watermark is not None
            # Work in flight (a closed lane admits while nothing is queued or running).
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1), lane="interactive")))
            await asyncio.to_thread(engine.entered.acquire)

            async def refused_lanes(used_bytes: int) -> list[str]:
                gauge.value = used_bytes
                # The scheduler thread samples every 50 ms.
                await until(lambda: watermark.used_bytes == used_bytes)
                # A lane that admits queues the call behind the held batch until its
                # deadline; a closed one refuses it at once.
                outcomes = await asyncio.gather(
                    *(
                        s.stub.Infer(request(rows(1), lane=lane), timeout=1.0)
                        for lane in ("interactive", "standard", "bulk")
                    ),
                    return_exceptions=True,
                )
                refused = []
                for lane, error in zip(("interactive", "standard", "bulk"), outcomes, strict=True):
                    assert isinstance(error, grpc.aio.AioRpcError), error
                    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        continue
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    reason, details = rich_status(error)
                    assert reason == "MEMORY_PRESSURE"
                    assert details["pushback_ms"] > 0
                    refused.append(lane)
                return refused

            assert await refused_lanes(50 * MIB) == []
            assert await refused_lanes(96 * MIB) == ["bulk"]
            assert await refused_lanes(99 * MIB) == ["standard", "bulk"]
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert list(stats.lanes_closed_by_memory) == ["standard", "bulk"]
            assert stats.memory_used_bytes == 99 * MIB
            # Used memory is the process's here, against the host limit, not an arena's.
            assert stats.memory_watermark_limit_bytes == 100 * MIB
            assert stats.memory_limit_bytes == 0, "no arena limit was set"
            assert await refused_lanes(90 * MIB) == ["standard", "bulk"]  # hysteresis
            assert await refused_lanes(80 * MIB) == []
            engine.release()
            await running

    asyncio.run(scenario())


def test_a_closed_lane_admits_while_nothing_is_queued_or_running() -> None:
    """Memory that stays in use while the server is idle (an allocator keeps what a large
    batch grew) kept every lane closed for good: the server refused everything with
    nothing live. A closed lane now admits while nothing is live, one request at a time."""
    clock = ManualClock()
    mark = _three_lane_mark()
    scheduler = _scheduler(8, mark)
    scheduler.update_memory(99 * MIB)  # standard and bulk closed
    scheduler.admit(_request(0, "bulk", 1), clock.monotonic())  # nothing live: admitted
    with pytest.raises(MemoryPressureError):
        scheduler.admit(_request(1, "bulk", 1), clock.monotonic())
    with pytest.raises(MemoryPressureError):
        scheduler.admit(_request(2, "standard", 1), clock.monotonic())
    (answer,) = scheduler.complete(_dispatch(scheduler, clock))
    assert answer.error is None
    entry_id = scheduler.admit(_request(3, "standard", 1), clock.monotonic())  # idle again
    running = _dispatch(scheduler, clock)
    scheduler.cancel(entry_id, clock.monotonic())  # its caller left: the batch still runs
    with pytest.raises(MemoryPressureError, match="while other work is queued or running"):
        scheduler.admit(_request(4, "bulk", 1), clock.monotonic())
    scheduler.complete(running)
    scheduler.admit(_request(5, "bulk", 1), clock.monotonic())


def test_lanes_reopen_at_an_idle_reading_above_the_low_mark_saying_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Lanes a burst closed, with its work done and the idle reading still between the
    marks, reopen (they were held closed for good, admitting one request at a time while
    idle), and the start of that is logged once, naming the settings that keep the idle
    server below the low mark."""
    clock = ManualClock()
    mark = _three_lane_mark()
    scheduler = _scheduler(8, mark)
    scheduler.admit(_request(0, "bulk", 1), clock.monotonic())
    scheduler.update_memory(99 * MIB)  # the burst: standard and bulk closed
    running = _dispatch(scheduler, clock)
    scheduler.update_memory(90 * MIB)  # its batch still runs: held closed
    with pytest.raises(MemoryPressureError):
        scheduler.admit(_request(1, "bulk", 1), clock.monotonic())
    scheduler.complete(running)
    scheduler.update_memory(90 * MIB)  # idle: its level alone, none
    scheduler.admit(_request(2, "bulk", 1), clock.monotonic())
    scheduler.admit(_request(3, "bulk", 1), clock.monotonic())
    (warning,) = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warning.startswith(
        "memory in use with nothing queued or running is 90.0MiB, above the low watermark "
        "85.0MiB that reopens lanes closed by memory (logged once)"
    ), warning
    assert warning.endswith(
        "a memory_low_watermark above 0.9 (or, on the CPU, a --host-memory-limit of about "
        "105.9MiB) keeps the idle server below the low mark"
    ), warning


def test_lanes_the_watermark_closes_and_reopens_are_logged_at_most_every_ten_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only the refusals' counts and a gauge told of lanes closed by memory (a review).
    Each change is logged, at most one line per CLOSED_LANES_LOG_S: one sooner waits for
    that time, saying how many changes it sums."""
    log = ClosedLanesLog()

    def observe(closed: tuple[str, ...], used_mib: int, now_s: float) -> list[str]:
        caplog.clear()
        state = WatermarkState(used_mib * MIB, 95 * MIB, 85 * MIB, closed, 100 * MIB)
        log.observe(state, now_s)
        return [record.getMessage() for record in caplog.records]

    caplog.set_level(logging.INFO)
    assert observe((), 50, 0.0) == []  # nothing closed yet: nothing to tell
    assert observe(("bulk",), 96, 1.0) == [
        (
            "memory in use 96.0MiB passed the high watermark 95.0MiB: lane(s) bulk admit no "
            "new work until it falls below 85.0MiB (with nothing queued or running, below "
            "the high watermark)"
        )
    ]
    assert observe((), 80, 2.0) == []  # within 10 s of the last line: held
    assert observe(("bulk",), 96, 3.0) == []  # back to what the last line said
    assert observe((), 80, 4.0) == []
    reopened = "memory in use 80.0MiB: every lane admits work again (3 changes since the last line)"
    assert observe((), 80, 1.0 + CLOSED_LANES_LOG_S) == [reopened]
    assert observe((), 80, 30.0) == []


def test_a_lane_kept_closed_between_the_watermarks_is_refused_saying_so() -> None:
    """Memory fell from above the high mark to between the marks: the lane stays closed
    until the low one (hysteresis), and its refusal said memory "is above the high
    watermark", printing a reading under it."""
    mark = _three_lane_mark()
    scheduler = _scheduler(64, mark)
    scheduler.admit(_request(0, "interactive", 4), 0.0)  # queued: not idle
    scheduler.update_memory(96 * MIB)
    with pytest.raises(MemoryPressureError) as above:
        scheduler.admit(_request(1, "bulk", 4), 0.0)
    assert "(96.0MiB) is above the high watermark (95.0MiB): lane 'bulk'" in above.value.message
    scheduler.update_memory(88 * MIB)
    with pytest.raises(MemoryPressureError) as between:
        scheduler.admit(_request(2, "bulk", 4), 0.0)
    assert between.value.message == (
        "memory in use on GPU '0' (88.0MiB) is still above the low watermark (85.0MiB) since it "
        "passed the high one (95.0MiB): lane 'bulk' admits no new work while other work is "
        "queued or running, until it falls below 85.0MiB"
    )


class _HeldUntilReleased:
    """A memory gauge reading `held_bytes` until `release()` (what the runtime's arena
    gives back), then `free_bytes`; counts the releases."""

    def __init__(self, held_bytes: int, free_bytes: int) -> None:
        self.held_bytes = held_bytes
        self.free_bytes = free_bytes
        self.releases = 0

    def release(self) -> None:
        self.releases += 1

    def used_bytes(self) -> int | None:
        return self.free_bytes if self.releases else self.held_bytes

    def total_bytes(self) -> int | None:
        return None


def _never_run(_batch: Batch, _rows_wanted: RowsWanted | None = None) -> BatchResult:
    raise AssertionError("nothing is dispatched here")


def test_lanes_closed_with_no_batch_running_have_the_engine_give_back_its_arena() -> None:
    """The runtime's arena kept the regions a burst of 1 024-row batches grew: read with
    them, memory stayed above the low mark with nothing running, and every lane stayed
    closed, interactive too (a review: 188 MiB against 170 after 20 s idle). With lanes
    closed and no batch running, the engine is asked once to give them back."""
    clock = ManualClock(0.0)
    mark = _three_lane_mark()
    scheduler = _scheduler(64, mark)
    gauge = _HeldUntilReleased(held_bytes=99 * MIB, free_bytes=60 * MIB)
    thread = SchedulerThread(
        scheduler,
        _never_run,
        list[Outcome]().extend,
        clock=clock,
        memory_gauge=gauge,
        release_memory=gauge.release,
    )
    thread._step([])  # the first reading: lanes close (nothing was closed to release)
    assert (mark.closed, gauge.releases, thread._release_due) == (2, 0, False)
    clock.advance(0.1)
    thread._step([])  # closed, idle: a release is due, outside the lock, as the thread does
    assert thread._release_due
    thread._give_back_memory()
    assert gauge.releases == 1
    thread._step([])  # read at once after it
    assert mark.closed == 0
    clock.advance(0.1)
    thread._step([])
    assert (gauge.releases, thread._release_due) == (1, False)

    # Memory that stays up (given back once, a burst's buffers still held): asked again,
    # at most every MEMORY_RELEASE_PERIOD_S. Asked once per idle spell, lanes stayed
    # closed in 2 of 3 runs of the review's burst.
    held = _HeldUntilReleased(held_bytes=99 * MIB, free_bytes=99 * MIB)
    thread = SchedulerThread(
        _scheduler(64, mark),
        _never_run,
        list[Outcome]().extend,
        clock=clock,
        memory_gauge=held,
        release_memory=held.release,
    )
    due = []
    for _ in range(30):  # 1.5 s of readings every 50 ms
        clock.advance(MEMORY_SAMPLE_PERIOD_S)
        thread._step([])
        due.append(thread._release_due)
        if thread._release_due:
            thread._give_back_memory()
    assert held.releases == 2
    assert due.index(True) + round(MEMORY_RELEASE_PERIOD_S / MEMORY_SAMPLE_PERIOD_S) == (
        len(due) - 1 - due[::-1].index(True)
    )


_FREED_HEAP_SCRIPT = """
import asyncio, json, sys, time
from laneserve.server import ServerConfig
from laneserve.server.app import LaneServer
from laneserve.server.engine import Engine
from laneserve.server.memory import ProcessRssGauge

async def until(condition):  # polls a state the scheduler thread reaches
    give_up = time.monotonic() + 10
    while not condition() and time.monotonic() < give_up:
        await asyncio.sleep(0.01)
    return condition()

async def main():
    config = ServerConfig(
        model_path=sys.argv[1], host="127.0.0.1", port=0, metrics_port=-1,
        host_memory_limit="400MiB",
    )
    engine = Engine(sys.argv[1], device="cpu", estimate=lambda path: None)
    server = LaneServer(engine, config)
    await server.start()
    try:
        mark = server.scheduler.watermark
        # Blocks on the heap (malloc, under its mmap threshold), each between two live
        # pins, so that freeing them leaves the heap's top end where it is: glibc keeps
        # them resident, as it keeps what a burst's requests freed.
        blocks, pins = [], []
        while ProcessRssGauge().used_bytes() < mark.limit_bytes + 32 * 2**20:
            blocks += [bytearray(b"x" * 65536) for _ in range(256)]
            pins += [bytearray(1024) for _ in range(256)]
        held = await until(lambda: mark.closed == 3)
        del blocks
        reopened = await until(lambda: mark.closed == 0)
        print(json.dumps({"closed": held, "reopened": reopened, "used": mark.used_bytes}))
    finally:
        await server.stop(grace_s=5.0)

asyncio.run(main())
"""


def test_lanes_closed_by_a_burst_reopen_when_its_memory_is_freed(small_model: Path) -> None:
    """glibc keeps the heap a burst freed resident: read with it, memory stayed above the
    low watermark with nothing in use, and every lane stayed closed, interactive too
    (each admitting one request at a time). The reading gives the free heap back first
    while lanes are closed."""
    report = _script_report(_FREED_HEAP_SCRIPT, str(small_model))
    assert report["closed"], "memory in use above the limit closed every lane"
    assert report["reopened"], report


class _OutOfMemoryAbove(Engine):
    """The real session, out of memory for runs above `fit_rows` rows (fault injection).
    Each failed attempt calls `on_failure` first (it takes time: the test moves its clock
    or cancels a caller meanwhile); `ran` keeps the inputs of every run that succeeded."""

    def __init__(
        self,
        model_path: Path,
        fit_rows: int,
        on_failure: Callable[[], None],
        on_success: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(str(model_path), device="cpu", estimate=estimate_once)
        self.fit_rows = fit_rows
        self.on_failure = on_failure
        self.on_success = on_success
        self.ran: list[Array] = []
        self.failed_rows: list[int] = []  # the size of each run that ran out of memory

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        if len(inputs["input"]) > self.fit_rows:
            self.failed_rows.append(len(inputs["input"]))
            self.on_failure()
            raise DeviceMemoryError("injected: out of memory")
        self.ran.append(inputs["input"].copy())
        outputs = super().run(inputs)
        self.on_success()
        return outputs


class _BrokenSession(Engine):
    """The real session, failing every run as a broken device would (fault injection)."""

    def __init__(self, model_path: Path) -> None:
        super().__init__(str(model_path), device="cpu", estimate=estimate_once)
        self.runs = 0

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        self.runs += 1
        raise EngineError("injected: CUDA failure 700: an illegal memory access")


def test_rows_nobody_waits_for_are_not_run_again_after_out_of_memory(
    small_model: Path, small_reference: ort.InferenceSession
) -> None:
    """A batch that ran out of memory is run again in parts: a new execution. Rows whose
    deadline passed during the failed attempt, or whose caller left, are not part of it
    (an expired request is never executed): their request is answered EXPIRED_IN_QUEUE
    (or not at all: cancelled), and the rest get exact outputs."""
    clock = ManualClock(1_000.0)
    scheduler = _scheduler(8)
    thread: SchedulerThread | None = None
    cancel_ids: list[int] = []
    attempts: list[int] = []

    def on_failure() -> None:  # the 8-row attempt takes 1 s and the caller of C leaves
        attempts.append(1)
        if len(attempts) == 1:
            clock.advance(1.0)
            assert thread is not None
            assert thread.cancel(cancel_ids[0])

    engine = _OutOfMemoryAbove(small_model, 2, on_failure)
    width = engine.inputs[0].shape[1]
    inputs = {
        name: np.random.default_rng(index).standard_normal((count, width)).astype(np.float32)
        for index, (name, count) in enumerate({"A": 3, "B": 3, "C": 2}.items())
    }
    answers: list[Outcome] = []
    answered = threading.Event()

    def deliver(outcomes: Sequence[Outcome]) -> None:
        answers.extend(outcomes)
        if len(answers) == 2:
            answered.set()

    thread = SchedulerThread(scheduler, engine.run_batch, deliver, clock=clock)
    deadlines = {"A": 1_010.0, "B": 1_000.5, "C": 1_010.0}  # B's passes in the failed run
    requests = [
        InferenceRequest(
            request_id=name,
            lane="standard",
            inputs={"input": array},
            rows=len(array),
            signature=((width,),),
            deadline_s=deadlines[name],
            token=name,
        )
        for name, array in inputs.items()
    ]
    for queued in requests:  # admitted before the thread starts: one batch of 8 rows
        entry_id = scheduler.admit(queued, clock.monotonic())
        if queued.request_id == "C":
            cancel_ids.append(entry_id)
    thread.start()
    try:
        assert answered.wait(30), f"answers: {answers}"
    finally:
        thread.close()
    by_name = {answer.token: answer for answer in answers}
    assert set(by_name) == {"A", "B"}, "C's caller left: no answer is due"
    assert isinstance(by_name["B"].error, ExpiredInQueueError)
    assert "not run again" in by_name["B"].error.message
    outputs = by_name["A"].outputs
    assert outputs is not None
    (expected,) = small_reference.run(None, {"input": inputs["A"]})
    np.testing.assert_array_equal(outputs["output"], expected)
    # After the 8-row attempt only A's rows ran: the first half less B's row (3 rows: out
    # of memory again), then 1 + 2; the second half (B and C) not at all.
    assert [len(rows) for rows in engine.ran] == [1, 2]
    np.testing.assert_array_equal(np.concatenate(engine.ran), inputs["A"])
    assert len(attempts) == 2
    assert scheduler.live_entries == 0


def _answers_of(
    scheduler: Scheduler,
    engine: Engine,
    clock: ManualClock,
    count: int,
    answers: list[Outcome] | None = None,
) -> list[Outcome]:
    """Runs the scheduler's queued work through `engine` until `count` answers came (in
    `answers` as they come, when given: the engine may look at them meanwhile)."""
    answers = [] if answers is None else answers
    answered = threading.Event()

    def deliver(outcomes: Sequence[Outcome]) -> None:
        answers.extend(outcomes)
        if len(answers) >= count:
            answered.set()

    thread = SchedulerThread(scheduler, engine.run_batch, deliver, clock=clock)
    thread.start()
    try:
        assert answered.wait(30), f"answers: {answers}"
    finally:
        thread.close()
    return answers


def _standard(name: str, x: Array, deadline_s: float | None = None) -> InferenceRequest:
    return InferenceRequest(
        request_id=name,
        lane="standard",
        inputs={"input": x},
        rows=len(x),
        signature=(x.shape[1:],),
        deadline_s=deadline_s,
        token=name,
    )


def test_each_half_of_a_split_is_asked_for_just_before_it_runs(small_model: Path) -> None:
    """The second half of a split runs after the first: its rows whose deadline passed
    meanwhile are not run (they were asked for once, before both halves, and ran late
    and were answered OK)."""
    clock = ManualClock(1_000.0)
    engine = _OutOfMemoryAbove(small_model, 2, lambda: None, lambda: clock.advance(1.0))
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(4)
    scheduler.admit(_standard("A", np.zeros((2, width), np.float32)), clock.monotonic())
    late = _standard("B", np.ones((2, width), np.float32), deadline_s=1_000.5)
    scheduler.admit(late, clock.monotonic())
    answers = {answer.token: answer for answer in _answers_of(scheduler, engine, clock, 2)}
    assert answers["A"].error is None
    assert isinstance(answers["B"].error, ExpiredInQueueError)
    assert len(engine.ran) == 1, "A's half ran; B's expired while it did, and did not run"


def test_rows_not_run_again_are_answered_before_the_split_goes_on(small_model: Path) -> None:
    """A caller whose deadline passed during a failed run is answered when its rows are
    left out, not after the parts still to run (as long again, and more after a second
    out-of-memory): A's runs see B's answer given."""
    clock = ManualClock(1_000.0)
    answered_when_a_ran: list[list[object]] = []
    answers: list[Outcome] = []
    engine = _OutOfMemoryAbove(
        small_model,
        1,
        lambda: clock.advance(1.0),
        lambda: answered_when_a_ran.append([answer.token for answer in answers]),
    )
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(4)
    scheduler.admit(_standard("A", np.zeros((2, width), np.float32)), clock.monotonic())
    late = _standard("B", np.ones((2, width), np.float32), deadline_s=1_000.5)
    scheduler.admit(late, clock.monotonic())
    _answers_of(scheduler, engine, clock, 2, answers)
    assert [answer.token for answer in answers] == ["B", "A"]
    assert isinstance(answers[0].error, ExpiredInQueueError)
    assert "not run again" in answers[0].error.message
    assert answered_when_a_ran == [["B"], ["B"]], "B was answered before A's rows ran"


def test_a_broken_session_costs_four_runs_and_blames_no_request(small_model: Path) -> None:
    """A failure that is no row's (both halves fail, and so does an input the session ran
    at start-up) stops the split: four runs per batch, not two per row, and the answer
    blames the batch."""
    clock = ManualClock(1_000.0)
    engine = _BrokenSession(small_model)
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(8)
    for index in range(4):
        request = _standard(f"r{index}", np.full((2, width), index, np.float32))
        scheduler.admit(request, clock.monotonic())
    answers = _answers_of(scheduler, engine, clock, 4)
    assert engine.runs == 4
    scheduler.admit(_standard("pair", np.zeros((2, width), np.float32)), clock.monotonic())
    (pair,) = _answers_of(scheduler, engine, clock, 1)
    assert engine.runs == 4 + 4
    assert isinstance(pair.error, EngineError)
    for answer in answers:
        assert isinstance(answer.error, EngineError)
        assert "on both halves of it, and on an input it ran at start-up" in answer.error.message


def _serve_until_failed(
    scheduler: Scheduler,
    engine: Engine,
    clock: ManualClock,
    before_start: Callable[[SchedulerThread], object] = lambda _thread: None,
) -> tuple[list[Outcome], list[LaneserveError], SchedulerThread]:
    """Runs the scheduler's queued work through `engine` until the thread fails for good
    (`on_failure`), then closes it: the answers, each failure, the closed thread.
    `before_start` is given the thread before it starts (to submit through it later)."""
    answers: list[Outcome] = []
    failures: list[LaneserveError] = []
    failed = threading.Event()

    def on_failure(error: LaneserveError) -> None:
        failures.append(error)
        failed.set()

    thread = SchedulerThread(
        scheduler, engine.run_batch, answers.extend, clock=clock, on_failure=on_failure
    )
    before_start(thread)
    thread.start()
    try:
        assert failed.wait(30), f"the thread did not fail; answers: {answers}"
    finally:
        thread.close()
    return answers, failures, thread


def test_a_broken_session_fails_the_thread_once_its_batch_is_answered(small_model: Path) -> None:
    """The engine saw the session broken and failed that batch only: every later batch
    failed the same way, four runs each, behind health that said SERVING. The batch's
    requests are answered with its error, the one queued behind it UNAVAILABLE (DRAINING)
    without running (no fifth run), each once, and the thread fails for good with the
    session's failure (`on_failure` stops the server): later work is refused as the
    queued request was (INTERNAL told clients not to retry work that never ran)."""
    clock = ManualClock(1_000.0)
    engine = _BrokenSession(small_model)
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(8)
    for index in range(5):  # a batch of 8 rows, and 2 rows queued behind it
        request = _standard(f"r{index}", np.full((2, width), index, np.float32))
        scheduler.admit(request, clock.monotonic())
    answers, failures, thread = _serve_until_failed(scheduler, engine, clock)
    assert engine.runs == 4
    assert sorted(str(answer.token) for answer in answers) == [f"r{i}" for i in range(5)]
    by_token = {answer.token: answer.error for answer in answers}
    for index in range(4):
        error = by_token[f"r{index}"]
        assert isinstance(error, SessionBrokenError)
        assert "on both halves of it, and on an input it ran at start-up" in error.message
    (failure,) = failures
    assert isinstance(failure, SessionBrokenError)
    assert failure.message == (
        "the model's session is broken (injected: CUDA failure 700: an illegal memory "
        "access); the server is stopping and must be restarted"
    )
    never_ran = (
        "the model's session is broken (injected: CUDA failure 700: an illegal memory "
        "access); this request never ran: retry on another instance (this server is stopping)"
    )
    queued = by_token["r4"]
    assert isinstance(queued, DrainingError)
    assert queued.message == never_ran
    with pytest.raises(DrainingError, match=re.escape(never_ran)):
        thread.submit(_standard("later", np.zeros((1, width), np.float32)))


class _BreaksWhileRunning(_BrokenSession):
    """The real session for its first run, during which `arrive` is called (a request
    comes while it runs); then failing every run as a broken device would."""

    def __init__(self, model_path: Path) -> None:
        super().__init__(model_path)
        self.arrive: Callable[[], object] = lambda: None

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        if self.runs == 0:
            self.runs += 1
            self.arrive()
            return Engine.run(self, inputs)
        return super().run(inputs)


def test_a_request_split_over_batches_is_retried_elsewhere_when_a_later_batch_breaks(
    small_model: Path,
) -> None:
    """A 4-row request at cap 2 ran its first two rows; an interactive request came
    meanwhile and its batch, the next, found the session broken. The split request had
    no row in that batch (it could not have broken the session), and its answer cannot be
    completed: UNAVAILABLE (DRAINING), saying part of it ran; it had been INTERNAL, which
    clients do not retry. The interactive request keeps the session's error."""
    clock = ManualClock(1_000.0)
    engine = _BreaksWhileRunning(small_model)
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(2)
    scheduler.admit(_standard("split", np.zeros((4, width), np.float32)), clock.monotonic())
    interactive = dataclasses.replace(
        _standard("interactive", np.ones((2, width), np.float32)), lane="interactive"
    )

    def arrives_while_the_first_batch_runs(thread: SchedulerThread) -> None:
        engine.arrive = lambda: thread.submit(interactive)

    answers, failures, _ = _serve_until_failed(
        scheduler, engine, clock, arrives_while_the_first_batch_runs
    )
    by_token = {answer.token: answer.error for answer in answers}
    assert sorted(map(str, by_token)) == ["interactive", "split"]
    assert isinstance(by_token["interactive"], SessionBrokenError)
    split = by_token["split"]
    assert isinstance(split, DrainingError)
    assert split.message == (
        "the model's session is broken (injected: CUDA failure 700: an illegal memory "
        "access); part of this request ran, but its answer was not kept: retry on another "
        "instance (this server is stopping)"
    )
    (failure,) = failures
    assert isinstance(failure, SessionBrokenError)


def test_a_batch_of_one_row_tells_a_broken_session_from_a_bad_row(small_model: Path) -> None:
    """A batch of one row that failed was the row's fault, always: a server serving a row
    at a time on a broken session answered every call ENGINE_FAILURE behind SERVING. The
    start-up input tells, run after a one-row batch that fails when the batch before it
    failed too: failing too, the session is broken (the second row's request is answered
    so, and the thread fails); running, the row failed alone, as before, and serving goes
    on. Run after every failed row, it doubled the work of a model that fails many rows
    alone: now once per two failed batches in a row."""
    clock = ManualClock(1_000.0)
    broken = _BrokenSession(small_model)
    width = broken.inputs[0].shape[1]
    scheduler = _scheduler(1)  # a batch per request
    for name in ("first", "second"):
        scheduler.admit(_standard(name, np.ones((1, width), np.float32)), clock.monotonic())
    answers, (failure,), _ = _serve_until_failed(scheduler, broken, clock)
    assert broken.runs == 3, "the first row, the second, then the start-up input"
    by_token = {answer.token: answer.error for answer in answers}
    first, second = by_token["first"], by_token["second"]
    assert type(first) is EngineError, "the first failure tells nothing yet"
    assert first.message == (
        "the model failed on a row of this request (row 0, run alone): injected: CUDA "
        "failure 700: an illegal memory access"
    )
    assert isinstance(second, SessionBrokenError)
    assert second.message.startswith(
        "the model failed on this request's row, and on an input it ran at start-up: the "
        "session is broken (injected: CUDA failure 700"
    )
    assert isinstance(failure, SessionBrokenError)

    engine = _FailsOnValue(small_model, 99.0, lambda: None)
    failures: list[LaneserveError] = []
    answered: queue.SimpleQueue[Outcome] = queue.SimpleQueue()

    def deliver(outcomes: Sequence[Outcome]) -> None:
        for outcome in outcomes:
            answered.put(outcome)

    thread = SchedulerThread(
        _scheduler(8), engine.run_batch, deliver, clock=clock, on_failure=failures.append
    )
    bad = np.ones((1, width), np.float32)
    bad[0, 0] = 99.0
    thread.start()
    errors: dict[object, LaneserveError | None] = {}
    try:
        for name, x in (
            ("bad1", bad),
            ("bad2", bad),
            ("bad3", bad),
            ("ok", np.ones((1, width), np.float32)),
        ):
            thread.submit(_standard(name, x))  # each a batch of its own: one at a time
            answer = answered.get(timeout=30)
            errors[answer.token] = answer.error
    finally:
        thread.close()
    assert errors["ok"] is None
    for name in ("bad1", "bad2", "bad3"):
        bad_error = errors[name]
        assert type(bad_error) is EngineError
        assert bad_error.message == (
            "the model failed on a row of this request (row 0, run alone): injected: index "
            "out of range"
        )
    assert failures == []
    # The start-up input after the second bad row only: the third followed a failed
    # batch, but one whose start-up input showed the session sound.
    assert engine.ran == [[99.0], [99.0], [0.0], [99.0], [1.0]]


class _StoppedWhileSplit(Engine):
    """The real engine, whose first run fails (a bad row, fault injection) and whose
    second (the split's first half) has the server's stop end runs (`terminate_runs`)
    before it runs, as a drain may while a batch is retried in halves."""

    def __init__(self, model_path: Path) -> None:
        super().__init__(str(model_path), device="cpu", estimate=estimate_once)
        self.runs = 0

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        self.runs += 1
        if self.runs == 1:
            raise EngineError("injected: index out of range")
        if self.runs == 2:  # the first half
            self.terminate_runs()
        return super().run(inputs)


def test_a_drain_that_ends_a_split_batch_is_no_broken_session(small_model: Path) -> None:
    """After `terminate_runs` (a drain's) every run fails with DrainingError, the
    start-up input's too: a batch being retried in halves then looked like a broken
    session, its rows were answered SessionBrokenError and the scheduler failed, and a
    healthy server draining on SIGTERM exited 1. The rows are answered as a drain answers
    a batch it ends (DrainingError), no start-up input runs, and nothing fails."""
    clock = ManualClock(1_000.0)
    engine = _StoppedWhileSplit(small_model)
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(8)
    for name in ("A", "B"):
        scheduler.admit(_standard(name, np.ones((2, width), np.float32)), clock.monotonic())
    failures: list[LaneserveError] = []
    answers: list[Outcome] = []
    answered = threading.Event()

    def deliver(outcomes: Sequence[Outcome]) -> None:
        answers.extend(outcomes)
        if len(answers) >= 2:  # A and B
            answered.set()

    thread = SchedulerThread(
        scheduler, engine.run_batch, deliver, clock=clock, on_failure=failures.append
    )
    thread.start()
    try:
        assert answered.wait(30), f"answers: {answers}"
    finally:
        thread.close()
    assert failures == []
    for answer in answers:
        assert type(answer.error) is DrainingError, (answer.token, answer.error)
        assert answer.error.message == (
            "the server stopped while this batch ran; it was ended unfinished"
        )
    assert engine.runs == 3, "the batch, then its halves: no start-up input"


def test_bad_rows_where_a_probe_looks_do_not_fail_their_neighbours(small_model: Path) -> None:
    """Both halves failed, and one row of each (the first) ran alone to tell bad rows
    from a broken session; when those rows were the bad ones every request of the batch
    failed, good ones too. An input the session ran at start-up tells now. And once a
    row of a request failed, its other rows are not run (a bad 4-row request cost a run
    per row)."""
    clock = ManualClock(1_000.0)
    engine = _FailsOnValue(small_model, 99.0, lambda: None)
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(16)
    firsts = {"bad0": [99.0], "ok1": [1.0], "bad2": [99.0], "ok3": [3.0]}
    firsts |= {"ok4": [4.0] * 4, "bad5": [99.0] * 4, "ok6": [6.0] * 4}
    for name, values in firsts.items():
        x = np.ones((len(values), width), np.float32)
        x[:, 0] = values
        scheduler.admit(_standard(name, x), clock.monotonic())
    answers = {answer.token: answer for answer in _answers_of(scheduler, engine, clock, 7)}
    assert engine.ran[0] == [value for values in firsts.values() for value in values]
    for token, answer in answers.items():
        if str(token).startswith("ok"):
            assert answer.error is None, (token, answer.error)
        else:
            assert isinstance(answer.error, EngineError)
            assert "the model failed on a row of this request" in answer.error.message
    # bad0, bad2, and two rows of bad5: its other two rows never ran alone (six before).
    assert [ran for ran in engine.ran if len(ran) == 1 and ran != [0.0]].count([99.0]) == 4


def test_a_probe_out_of_memory_is_counted_and_moves_no_cap(small_model: Path) -> None:
    """Both halves failed (a bad row in each) and the probe run that tells bad rows from
    a broken session ran out of memory: it tells nothing, so the halves are tried again
    (good rows answered OK), and it is counted as an out-of-memory run (it was not),
    without moving the cap (one row says nothing about batch size)."""
    clock = ManualClock(1_000.0)
    engine = _ProbeOutOfMemory(small_model, 99.0, lambda: None)
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(4)
    stats = scheduler.events = StatsRecorder(["interactive", "standard", "bulk"])
    for name, first_value in (("bad0", 99.0), ("ok1", 1.0), ("bad2", 99.0), ("ok3", 3.0)):
        x = np.ones((1, width), np.float32)
        x[0, 0] = first_value
        scheduler.admit(_standard(name, x), clock.monotonic())
    answers = {answer.token: answer for answer in _answers_of(scheduler, engine, clock, 4)}
    assert engine.probes == 1
    for token, answer in answers.items():
        if str(token).startswith("ok"):
            assert answer.error is None, (token, answer.error)
        else:
            assert isinstance(answer.error, EngineError), (token, answer.error)
    assert stats.counts().out_of_memory == 1
    assert scheduler.batch_cap == 4


class _FailsOnValue(Engine):
    """The real session, failing (as the runtime would) any run holding a row whose first
    value is `bad` (fault injection); `after_run` is called after every run."""

    def __init__(self, model_path: Path, bad: float, after_run: Callable[[], None]) -> None:
        super().__init__(str(model_path), device="cpu", estimate=estimate_once)
        self.bad, self.after_run = bad, after_run
        self.ran: list[list[float]] = []

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        firsts = [float(value) for value in inputs["input"][:, 0]]
        self.ran.append(firsts)
        try:
            if self.bad in firsts:
                raise EngineError("injected: index out of range")
            return super().run(inputs)
        finally:
            self.after_run()


class _ProbeOutOfMemory(_FailsOnValue):
    """`_FailsOnValue`, whose one-row run of zeros (the input the session ran at start-up,
    which tells bad rows from a broken session) runs out of device memory (fault
    injection)."""

    probes = 0

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        rows = inputs["input"]
        if len(rows) == 1 and not rows.any():
            self.probes += 1
            raise DeviceMemoryError("injected: out of memory")
        return super().run(inputs)


def test_the_probe_rows_are_asked_for_before_they_run(small_model: Path) -> None:
    """Both halves fail (a bad row in each), and one row of each is run alone to tell
    bad rows from a broken session: a half whose caller stopped waiting meanwhile is not
    probed (its row ran, and was answered OK after its deadline)."""
    clock = ManualClock(1_000.0)
    runs: list[int] = []

    def after_run() -> None:
        runs.append(1)
        if len(runs) == 3:  # the second half's run: B's deadline passes
            clock.advance(1.0)

    engine = _FailsOnValue(small_model, 99.0, after_run)
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(4)
    for name, first_value, deadline_s in (("A", 1.0, None), ("B", 2.0, 1_000.5)):
        x = np.zeros((2, width), np.float32)
        x[:, 0] = (first_value, 99.0)
        scheduler.admit(_standard(name, x, deadline_s), clock.monotonic())
    answers = {answer.token: answer for answer in _answers_of(scheduler, engine, clock, 2)}
    assert isinstance(answers["B"].error, ExpiredInQueueError)
    assert isinstance(answers["A"].error, EngineError), "A's own bad row"
    assert all(2.0 not in firsts for firsts in engine.ran[3:]), engine.ran


def test_split_batches_do_not_raise_the_cap_back() -> None:
    """After an out-of-memory lowered the cap, only full batches that ran whole count
    towards raising it again: full batches whose every row failed (a broken session)
    counted, and put the cap back up while nothing ran."""
    clock = ManualClock()
    scheduler = _scheduler(64)
    scheduler.admit(_request(0, "standard", 64), clock.monotonic())
    ok = _dispatch(scheduler, clock)
    scheduler.complete(_ran_out_of_memory(ok))
    assert scheduler.batch_cap == 32
    broken = EngineError("the model failed on the batch holding this request")
    for index in range(1, CAP_RECOVERY_BATCHES + 2):
        scheduler.admit(_request(index, "standard", 32), clock.monotonic())
        batch = _dispatch(scheduler, clock).batch
        failed = (FailedRows(0, 32, broken),)
        scheduler.complete(BatchResult(batch, None, None, 0.001, failed_rows=failed, split=True))
    assert scheduler.batch_cap == 32


def test_a_batch_nobody_waits_for_any_more_is_not_run_again(small_model: Path) -> None:
    """When every row's deadline passed during the failed attempt, nothing runs again and
    each request is answered EXPIRED_IN_QUEUE. The cap still comes down: the 4-row run
    did run out of memory."""
    clock = ManualClock(1_000.0)
    engine = _OutOfMemoryAbove(small_model, 2, lambda: clock.advance(1.0))
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(4)
    stats = scheduler.events = StatsRecorder(["interactive", "standard", "bulk"])
    for name in ("A", "B"):
        request = _standard(name, np.ones((2, width), np.float32), deadline_s=1_000.5)
        scheduler.admit(request, clock.monotonic())
    answers = _answers_of(scheduler, engine, clock, 2)
    assert engine.ran == [], "nothing ran again"
    assert all(isinstance(answer.error, ExpiredInQueueError) for answer in answers)
    assert scheduler.batch_cap == 2
    assert stats.counts().shed == {("standard", "EXPIRED_IN_QUEUE"): 2}, "counted as shed"


def test_halves_that_ran_out_of_memory_hold_the_cap_below_their_size(small_model: Path) -> None:
    """A batch at the cap (16 rows) ran out of memory, and so did both its halves of 8:
    rows of one shape, so a batch of 8 does not fit either. The ceiling was the cap's 16
    alone, and the cap climbed back 4 -> 8 and ran out of memory again (an operator's
    server: 1 536 rows, both halves of 768, then 384 -> 768 in steps and out of memory
    at 768). It holds at 7: one out-of-memory batch for the whole climb."""
    clock = ManualClock(1_000.0)
    engine = _OutOfMemoryAbove(small_model, 7, lambda: None)  # 8 rows do not fit
    width = engine.inputs[0].shape[1]
    scheduler = _scheduler(16)  # steps of 1 row (16 // CAP_RECOVERY_STEPS)
    # Admitted before the thread starts: the first batch is 16 rows, and every later one
    # is full at the cap (one-row requests), past the CAP_RECOVERY_BATCHES at each of 4,
    # 5, 6 and 7 rows after which the cap tried 8.
    requests = 16 + CAP_RECOVERY_BATCHES * (4 + 5 + 6 + 7 + 8)
    for index in range(requests):
        row = np.full((1, width), index % 5, np.float32)
        scheduler.admit(_standard(f"r{index}", row), clock.monotonic())
    answers = _answers_of(scheduler, engine, clock, requests)
    assert all(answer.error is None for answer in answers)
    assert engine.failed_rows == [16, 8, 8], "8 rows were tried again"
    assert scheduler.batch_cap == 7, "held below the halves' size that failed"
    assert max(len(rows) for rows in engine.ran) == 7


# ---- the real thing: a capped arena in a child process ----------------------------------

_WIDTHS_IN_TURN_SCRIPT = """
import sys
import numpy as np
from laneserve.server.engine import Engine
from laneserve.server.errors import DeviceMemoryError
from laneserve.server.memory import parse_memory_limit

engine = Engine(sys.argv[1], device="cpu", memory_limit=parse_memory_limit(sys.argv[2]))
held, ran = None, []
for spec in sys.argv[3:]:
    rows, width = map(int, spec.split("x"))
    try:
        held = engine.run({"input": np.ones((rows, width), np.float32)})  # outputs held
        ran.append(spec + ":ok")
    except DeviceMemoryError:
        ran.append(spec + ":out of memory")
print(" ".join(ran))
"""


def test_a_batch_of_more_narrower_rows_runs_in_a_shrunk_arena(tmp_path: Path) -> None:
    """The input's width is dynamic and the activations' is not (4 096 per row): memory
    grows with rows, not input bytes. The arena shrank only before a run of more input
    bytes, so 400 rows of width 16 ran among the regions 300 rows of width 256 left, and
    ran out of memory, though they fit a shrunk arena."""
    hidden = 4_096
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["input", "axes"], ["sum"], keepdims=1),
            helper.make_node("Mul", ["sum", "row"], ["wide"]),
            helper.make_node("Relu", ["wide"], ["relu"]),
            helper.make_node("MatMul", ["relu", "weight"], ["output"]),
        ],
        "narrow",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "width"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 10])],
        [
            helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
            helper.make_tensor(
                "row", TensorProto.FLOAT, [1, hidden], np.linspace(-1, 1, hidden).tolist()
            ),
            helper.make_tensor(
                "weight", TensorProto.FLOAT, [hidden, 10], np.full(hidden * 10, 0.01).tolist()
            ),
        ],
    )
    path = save_model(tmp_path / "narrow.onnx", graph, check=False)
    out = _run_script(_WIDTHS_IN_TURN_SCRIPT, str(path), "8MiB", "400x16", "300x256", "400x16")
    assert out.split() == ["400x16:ok", "300x256:ok", "400x16:ok"], out


def _outer_model(path: Path) -> Path:
    """input [batch, width] -> the sum of each row's outer product with itself: a row's
    memory grows with its width squared, its input bytes with its width."""
    graph = helper.make_graph(
        [
            helper.make_node("Unsqueeze", ["input", "last"], ["column"]),
            helper.make_node("Unsqueeze", ["input", "middle"], ["row"]),
            helper.make_node("Mul", ["column", "row"], ["outer"]),
            helper.make_node("ReduceSum", ["outer", "axes"], ["output"], keepdims=0),
        ],
        "outer",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "width"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch"])],
        [
            helper.make_tensor("last", TensorProto.INT64, [1], [2]),
            helper.make_tensor("middle", TensorProto.INT64, [1], [1]),
            helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2]),
        ],
    )
    return save_model(path, graph, check=False)


_BATCHES_IN_TURN_SCRIPT = """
import json, sys
import numpy as np
from laneserve.server.engine import Engine
from laneserve.server.items import Batch, BatchSlice, DispatchReason
from laneserve.server.memory import parse_memory_limit

engine = Engine(sys.argv[1], device="cpu", memory_limit=parse_memory_limit(sys.argv[2]))
report = []
for batch_id, spec in enumerate(sys.argv[3:]):
    rows, width = map(int, spec.split("x"))
    x = np.ones((rows, width), np.float32)
    batch = Batch(batch_id, (BatchSlice(batch_id, "standard", 0, rows, 0),), rows,
                  DispatchReason.FULL, 0.0, {"input": (x,)})
    result = engine.run_batch(batch)
    report.append({
        "split": result.split,
        "out_of_memory_rows": list(result.out_of_memory_rows),
        "failed": [failed.error.message for failed in result.failed_rows],
        "outputs": None if result.outputs is None else result.outputs["output"].tolist(),
    })
print(json.dumps(report))
"""


@pytest.mark.parametrize(
    "specs",
    [
        # Equal input bytes, fewer rows: no shrink before the last run, and its single
        # row was answered DEVICE_MEMORY, though it had just run alone.
        ("1x2048", "4x512", "1x2048"),
        # Fewer input bytes, fewer rows: split into rows that all ran, and the failure
        # of two rows took the batch cap from 8 to 1.
        ("2x1400", "8x512", "2x1400"),
    ],
)
def test_a_batch_that_fits_alone_runs_whole_after_other_shapes(
    tmp_path: Path, specs: tuple[str, ...]
) -> None:
    """With a dynamic width, memory does not follow input bytes or rows: a batch ran out
    of memory among the regions a batch of another shape left, though it fits a shrunk
    arena (it ran first). It is run again once the arena shrank, and only that run
    counts: no row fails, nothing is split, and no out-of-memory run reaches the
    scheduler's cap learning."""
    model = _outer_model(tmp_path / "outer.onnx")
    report = _script_report(_BATCHES_IN_TURN_SCRIPT, str(model), "18MiB", *specs)
    for spec, ran in zip(specs, report, strict=True):
        rows, width = map(int, spec.split("x"))
        assert ran == {
            "split": False,
            "out_of_memory_rows": [],
            "failed": [],
            "outputs": [float(width * width)] * rows,
        }, spec


def test_rows_of_another_width_keep_their_cap_after_wide_rows_run_out(tmp_path: Path) -> None:
    """Served end to end under a memory limit: 8 rows of width 1 400 run out of memory
    (a row's memory grows with its width squared) and lower that width's cap to 2; 8
    rows of width 16 after them still run in one batch of 8, not in four of 2."""
    model = _outer_model(tmp_path / "outer.onnx")
    server = ServerProcess(
        [
            *("--model", str(model), "--port", "0", "--memory-limit", "18MiB"),
            *("--max-batch-size", "8", "--batch-cap", "8"),
        ]
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port()}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            widths: dict[int, list[int]] = {}
            for width in (1400, 16, 1400):
                x = np.ones((8, width), np.float32)
                answer = stub.Infer(request(x, lane="bulk"), timeout=120)
                assert output(answer).tolist() == [float(width * width)] * 8
                widths.setdefault(width, []).append(answer.timing.batch_size)
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    finally:
        server.close()
    assert widths == {1400: [8, 2], 16: [8]}, "the wide rows split at first, then ran at 2"
    assert (stats.batch_cap, stats.max_batch_cap) == (2, 8)
    assert stats.cap_changes["out_of_memory"] == 1


@pytest.mark.parametrize("rows", [3, 8])
def test_a_request_of_rows_too_large_alone_moves_no_cap(tmp_path: Path, rows: int) -> None:
    """Rows of width 2 400 need more than 18 MiB even alone: the request is answered
    DEVICE_MEMORY, and its shape's cap stays. Once one of its rows failed alone, its
    other rows never run again, and the runs that held only them were counted as want
    of room: the cap fell from 8 to 1 for good (no full batch of the shape could run
    to raise it), and GetStats' batch_cap with it."""
    model = _outer_model(tmp_path / "outer.onnx")
    server = ServerProcess(
        [
            *("--model", str(model), "--port", "0", "--memory-limit", "18MiB"),
            *("--max-batch-size", "8", "--batch-cap", "8"),
        ]
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port()}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            x = np.ones((rows, 2400), np.float32)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Infer(request(x, lane="bulk"), timeout=120)
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    finally:
        server.close()
    error: Any = refused.value  # the sync stub's RpcError is also a grpc.Call
    assert rich_status(error)[0] == "DEVICE_MEMORY"
    assert "even run alone" in (error.details() or "")
    assert stats.out_of_memory_events >= 2
    assert (stats.batch_cap, dict(stats.cap_changes)) == (8, {})


_ENGINE_SCRIPT = """
import json, sys
import numpy as np
from laneserve.server.engine import Engine
from laneserve.server.errors import DeviceMemoryError
from laneserve.server.items import Batch, BatchSlice, DispatchReason
from laneserve.server.memory import parse_memory_limit

engine = Engine(sys.argv[1], device="cpu", memory_limit=parse_memory_limit(sys.argv[2]))
def fits(rows):
    try:
        engine.run(engine.example_inputs(rows))
        return True
    except DeviceMemoryError:
        return False
report = {"before": fits(256), "too_big": fits(1024), "after": fits(256)}
x = np.random.default_rng(3).standard_normal((1024, 512)).astype(np.float32)
batch = Batch(1, (BatchSlice(1, "bulk", 0, 1024, 0),), 1024, DispatchReason.FULL, 0.0,
              {"input": (x,)})
result = engine.run_batch(batch)
np.save(sys.argv[3], result.outputs["output"])
report["out_of_memory_rows"] = list(result.out_of_memory_rows)
report["again_after_split"] = fits(256)
print(json.dumps(report))
"""


# Out of memory in cuDNN, as ONNX Runtime reports it: cuDNN 9's status for a device
# allocation that failed. cudnnCreate's bare internal error comes on a full GPU
# (hacksider/Deep-Live-Cam#1318) and on a CUDA/cuDNN/driver version mismatch alike
# (tensorflow/tensorflow#14111): no sure want of memory.
_CUDNN9_DEVICE_ALLOCATION = (
    "[ONNXRuntimeError] : 1 : FAIL : CUDNN failure 4004: "
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED ; GPU=0 ; hostname=h ; "
    "file=conv.cc ; line=1 ; expr=cudnnBackendExecute(...);"
)
# Where a convolution fails to run.
_CUDNN_CONV = "hostname=h ; file=conv.cc ; line=1 ; expr=cudnnConvolutionForward(...);"
_CUDNN_CREATE_ON_A_FULL_GPU = (
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while "
    "running Gemm node. Name:'Gemm_128' Status Message: CUDNN failure 4: "
    "CUDNN_STATUS_INTERNAL_ERROR ; GPU=0 ; hostname=h ; "
    "file=/onnxruntime_src/onnxruntime/core/providers/cuda/cuda_execution_provider.cc ; "
    "line=172 ; expr=cudnnCreate(&cudnn_handle_);"
)


@pytest.mark.parametrize(
    ("message", "out_of_memory"),
    [
        ("CUDA failure 2: out of memory ; GPU=0", True),
        ("CUBLAS failure 3: CUBLAS_STATUS_ALLOC_FAILED ; GPU=0 ; expr=cublasCreate", True),
        ("CUDNN failure 4: CUDNN_STATUS_ALLOC_FAILED ; GPU=0", True),
        ("CUDA failure 2: cudaErrorMemoryAllocation", True),
        ("Failed to allocate memory for requested buffer of size 1048576", True),
        (_CUDNN9_DEVICE_ALLOCATION, True),
        (_CUDNN9_DEVICE_ALLOCATION.replace("4004", "4003").replace("DEVICE", "HOST"), True),
        (_CUDNN_CREATE_ON_A_FULL_GPU, False),
        ("CUBLAS failure 13: CUBLAS_STATUS_EXECUTION_FAILED ; GPU=0", False),
        ("Non-zero status code returned while running Gemm node", False),
        (f"CUDNN failure 5000: CUDNN_STATUS_EXECUTION_FAILED ; GPU=0 ; {_CUDNN_CONV}", False),
        (f"CUDNN failure 4000: CUDNN_STATUS_INTERNAL_ERROR ; GPU=0 ; {_CUDNN_CONV}", False),
    ],
)
def test_allocation_failures_of_the_cuda_libraries_count_as_out_of_memory(
    message: str, out_of_memory: bool
) -> None:
    """cuBLAS's and cuDNN's workspaces failing to allocate were taken for a model
    failure: no cap was lowered, and a row that failed alone got ENGINE_FAILURE. cuDNN
    9's names (..._ALLOCATION_FAILED) were still taken so. A kernel that failed to run,
    or a cuDNN handle that could not be made (a version mismatch too: split, a broken
    session's batches went down to rows answered DEVICE_MEMORY), is no sure want of
    memory."""
    error = translate_runtime_error(RuntimeError(message))
    assert isinstance(error, DeviceMemoryError) is out_of_memory, error


class _RuntimeFailsAbove(Engine):
    """The real session, whose runs of more than `fit_rows` rows fail with the runtime's
    `message` (fault injection where the runtime raises, below the engine's translation)."""

    def __init__(self, model_path: Path, fit_rows: int, message: str) -> None:
        super().__init__(str(model_path), device="cpu", estimate=estimate_once)
        self.fit_rows, self.message = fit_rows, message

    def _run_session(self, inputs: Mapping[str, Array], options: ort.RunOptions) -> list[Array]:
        if len(inputs["input"]) > self.fit_rows:
            raise RuntimeError(self.message)
        return super()._run_session(inputs, options)


def test_cudnn_out_of_memory_splits_the_batch_and_counts_against_the_cap(
    small_model: Path, small_reference: ort.InferenceSession
) -> None:
    """A full GPU's cuDNN failures failed a row that did not fit alone with
    ENGINE_FAILURE and lowered no cap: they are out-of-memory runs now."""
    engine = _RuntimeFailsAbove(small_model, 2, _CUDNN9_DEVICE_ALLOCATION)
    x = rows(4)
    batch = Batch(
        1, (BatchSlice(1, "standard", 0, 4, 0),), 4, DispatchReason.FULL, 0.0, {"input": (x,)}
    )
    result = engine.run_batch(batch)
    assert result.failed_rows == ()
    assert result.out_of_memory_runs == (OutOfMemoryRun(4, held_unfit_row=False),)
    assert result.outputs is not None
    expected = small_reference.run(None, {"input": x})[0]
    np.testing.assert_allclose(np.asarray(result.outputs["output"], np.float32), expected)
    one = Batch(
        2, (BatchSlice(2, "standard", 0, 1, 0),), 1, DispatchReason.FULL, 0.0, {"input": (x[:1],)}
    )
    (failed,) = (
        _RuntimeFailsAbove(small_model, 0, _CUDNN9_DEVICE_ALLOCATION).run_batch(one).failed_rows
    )
    assert failed.error.reason == "DEVICE_MEMORY", failed.error


def test_a_cpu_budget_that_does_not_hold_the_weights_is_refused(demo_model: Path) -> None:
    """The arena cannot hold the demo model's 20.1 MiB of weights under 20 MiB, and ONNX
    Runtime then ran every batch outside it: a "4MiB" budget ran 4 096-row batches. The
    check comes before the process-wide arena is registered, so nothing is left behind."""
    with pytest.raises(EngineStartError, match=r"does not hold the model's weights \(20\.1MiB\)"):
        Engine(
            str(demo_model),
            device="cpu",
            memory_limit=parse_memory_limit("20MiB"),
            estimate=estimate_once,
        )


def test_engine_splits_a_batch_that_does_not_fit_and_recovers(
    demo_model: Path, reference: ort.InferenceSession, tmp_path: Path
) -> None:
    out = tmp_path / "out.npy"
    report = _script_report(_ENGINE_SCRIPT, str(demo_model), DEMO_BUDGET, str(out))
    # A batch that fitted before an out-of-memory still fits after it.
    assert report["before"] is True
    assert report["too_big"] is False
    assert report["after"] is True
    assert report["again_after_split"] is True
    assert report["out_of_memory_rows"][0] == 1024
    x = np.random.default_rng(3).standard_normal((1024, 512)).astype(np.float32)
    expected = reference.run(None, {"input": x})[0]
    np.testing.assert_allclose(np.load(out), expected, rtol=1e-4, atol=1e-5)


_IN_TURN_SCRIPT = """
import json, sys
from laneserve.server.engine import Engine
from laneserve.server.errors import DeviceMemoryError
from laneserve.server.memory import parse_memory_limit

engine = Engine(sys.argv[1], device="cpu", memory_limit=parse_memory_limit(sys.argv[2]))
held, fitted = None, []
for rows in map(int, sys.argv[3:]):
    try:
        # The last outputs are held while the next run runs, as the scheduler holds a
        # batch's until its answers are written.
        held = engine.run(engine.example_inputs(rows))
        fitted.append(True)
    except DeviceMemoryError:
        fitted.append(False)
print(json.dumps(fitted))
"""


def _fits_in_turn(model: Path, budget: str, sizes: Sequence[int]) -> list[bool]:
    """Whether each run of `sizes` rows fitted, run in turn by one engine under `budget`."""
    fitted: list[bool] = _script_report(_IN_TURN_SCRIPT, str(model), budget, *map(str, sizes))
    return fitted


def test_a_batch_that_fits_runs_right_after_an_out_of_memory(demo_model: Path) -> None:
    """The run after an out-of-memory asked the arena to shrink, which it does at the end
    of a run: that run met the failed run's regions, and 640 rows (750 fit a fresh arena)
    ran out of memory right after 1 024 had. The arena shrinks before it now."""
    assert _fits_in_turn(demo_model, DEMO_BUDGET, [1024, 640]) == [False, True]


def test_outputs_held_while_the_next_batch_runs_leave_it_room(demo_model: Path) -> None:
    """The outputs of a run were the runtime's buffers in the capped arena, held (as the
    scheduler holds a batch's until its answers are written) while the next batch ran:
    every 512-row batch after the first ran out of memory."""
    assert _fits_in_turn(demo_model, DEMO_BUDGET, [512, 512, 512, 512]) == [True] * 4


def test_a_batch_larger_than_any_before_it_fits_the_arena(demo_model: Path) -> None:
    """The arena kept the regions earlier, smaller batches grew, which a larger one cannot
    use: 256 rows ran, then 512 ran out of memory (750 fit a fresh arena), and so did the
    first full batch of a cap raised after an out-of-memory. It shrinks before such a
    batch now."""
    assert _fits_in_turn(demo_model, DEMO_BUDGET, [256, 512, 576, 704]) == [True] * 4


_PROBE_SCRIPT = """
import sys
from laneserve.server.engine import Engine
from laneserve.server.memory import parse_memory_limit

engine = Engine(sys.argv[1], device="cpu", memory_limit=parse_memory_limit(sys.argv[2]))
print(engine.probe(int(sys.argv[3])).batch_cap)
"""


def test_the_probe_finds_the_largest_batch_that_fits(demo_model: Path) -> None:
    """The probe's sizes grew by powers of two, each in the regions the smaller ones left,
    and settled on 352 rows under 32 MiB, where 750 fit. Its cap is now within an eighth
    of the largest batch that fits a fresh arena."""
    out = _run_script(_PROBE_SCRIPT, str(demo_model), DEMO_BUDGET, "1024")
    cap = int(out.strip().splitlines()[-1])
    assert _fits_in_turn(demo_model, DEMO_BUDGET, [cap * 9 // 8]) == [False], cap


_PROBE_RUNS_SCRIPT = """
import collections, json, sys
from laneserve.server.engine import Engine
from laneserve.server.memory import parse_memory_limit

class CountsRuns(Engine):
    # The session's runs by their rows, failed ones too (fault injection's wrapper).
    runs = collections.Counter()

    def _run_session(self, inputs, options):
        self.runs[len(inputs["input"])] += 1
        return super()._run_session(inputs, options)

engine = CountsRuns(sys.argv[1], device="cpu", memory_limit=parse_memory_limit(sys.argv[2]))
probe = engine.probe(1024, repeats=3)
cap = probe.batch_cap
print(json.dumps({"cap": cap, "runs": engine.runs[cap], "timed": cap in probe.run_s}))
"""


def test_the_probe_times_its_cap_in_the_runs_that_verify_it(demo_model: Path) -> None:
    """After the bisection the cap is verified with a warm-up and up to `repeats` runs,
    whose timing was thrown away and the cap timed again: runs more of the largest batch
    (of 1.8 s each for 272 MiB of weights). Under 32 MiB the demo model's cap comes from
    the bisection: a warm-up and one run there, then the verification's warm-up and 3
    (its runs are short: PROBE_REPEATS_WITHIN_S stops none)."""
    report = _script_report(_PROBE_RUNS_SCRIPT, str(demo_model), DEMO_BUDGET)
    assert report["timed"], report
    assert report["runs"] <= 2 + 1 + 3, report


_PROBE_REPEATS_SCRIPT = """
import collections, json, sys
from laneserve.server import probe as probe_module
from laneserve.server.engine import Engine
from laneserve.server.memory import parse_memory_limit

# Each run the probe times reads as `step` seconds: the probe's clock, moved by hand.
now = [0.0]

def slow_clock():
    now[0] += float(sys.argv[3])  # read before and after each timed run
    return now[0]

probe_module._timer = slow_clock

class CountsRuns(Engine):
    runs = collections.Counter()

    def _run_session(self, inputs, options):
        self.runs[len(inputs["input"])] += 1
        return super()._run_session(inputs, options)

engine = CountsRuns(sys.argv[1], device="cpu", memory_limit=parse_memory_limit(sys.argv[2]))
probe = engine.probe(8, repeats=3)
print(json.dumps({"runs": engine.runs[8], "run_s": probe.run_s[8]}))
"""


@pytest.mark.parametrize(("step_s", "timed_runs"), [(0.001, 3), (0.1, 3), (0.2, 2), (1.5, 1)])
def test_the_probe_repeats_a_size_only_while_its_runs_are_short(
    demo_model: Path, step_s: float, timed_runs: int
) -> None:
    """The probe's repeats are for noise: a size whose timed runs took
    PROBE_REPEATS_WITHIN_S (0.25 s) together is timed no more (a 1.5 GiB model spent
    half its start in three more runs of a second and more at each size). A warm-up and
    up to `repeats` timed runs, the best kept."""
    report = _script_report(_PROBE_REPEATS_SCRIPT, str(demo_model), DEMO_BUDGET, str(step_s))
    assert report == {"runs": 1 + timed_runs, "run_s": pytest.approx(step_s)}, report


_HOST_LIMITED_PROBE = """
import resource, sys
from laneserve.server.engine import Engine
engine = Engine(sys.argv[1], device="cpu", estimate=lambda path: None)
mapped = int(open("/proc/self/statm").read().split()[0]) * 4096
limit = mapped + 300 * (1 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
# The host's available memory unread, as off Linux: the growth ends where allocation fails.
probe = engine.probe(1_000_000, repeats=1, host_available=lambda: None)
print(probe.batch_cap, probe.first_failing_rows)
"""


def test_a_probe_without_a_memory_limit_stops_where_the_hosts_memory_ends(
    small_model: Path,
) -> None:
    """On the CPU without --memory-limit the probe grows until an allocation fails, and
    with a large max_batch_size that is the host's: numpy's MemoryError building the
    inputs ended the start with a traceback. The probe stops at the last size that fit
    (here the host is an address-space limit 300 MiB above the loaded model)."""
    cap, first_failing = _run_script(_HOST_LIMITED_PROBE, str(small_model)).split()
    assert first_failing != "None"
    assert 1 <= int(cap) < int(first_failing) <= 1_000_000


def test_a_probe_runs_no_size_larger_than_the_lanes_queue_together(small_model: Path) -> None:
    """max_batch_size 4294967295 (the config's largest) on the CPU with no memory limit:
    the probe doubled sizes until the host ran out of memory (still probing after
    114 s). No batch holds more rows than the lanes queue together: no larger size runs,
    and the cap is that."""
    engine = Engine(str(small_model), device="cpu", estimate=estimate_once)
    probe = engine.probe(2**32 - 1, repeats=1, queue_rows=24)
    assert sorted(probe.run_s) == [1, 2, 4, 8, 16, 24]
    assert (probe.batch_cap, probe.stop_reason, probe.first_failing_rows) == (
        24,
        "queue_rows",
        None,
    )


def test_a_server_probes_no_batch_larger_than_its_lanes_hold(small_model: Path) -> None:
    lanes = (
        LaneConfig("interactive", capacity_rows=16, timeout_ms=1_000, max_wait_ms=1, min_share=0),
        LaneConfig("standard", capacity_rows=8, timeout_ms=1_000, max_wait_ms=1, min_share=0),
    )
    config = ServerConfig(
        model_path=str(small_model), device="cpu", metrics_port=-1, max_batch_size=4096, lanes=lanes
    )
    server = LaneServer(Engine(str(small_model), device="cpu", estimate=estimate_once), config)
    server.telemetry.close()
    assert max(server.probe.run_s) == server.probe.batch_cap == 24


def _row_bytes(engine: Engine) -> int:
    """One probe row's inputs and outputs: what a row takes where memory in use does not
    grow with the rows."""
    inputs = engine.example_inputs(1)
    arrays = [*inputs.values(), *engine.run(inputs).values()]
    return sum(array.nbytes for array in arrays)


def test_a_probe_without_a_memory_limit_stops_before_the_host_runs_out(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On the CPU without --memory-limit only the host's memory ended the probe's growth,
    by a MemoryError or, where memory is overcommitted, the OOM killer. It stops before a
    size predicted (rows x the bytes a row took so far) to need more than
    HOST_PROBE_SHARE of the host's available memory: here that has room for 12 rows of a
    model whose memory in use (the gauge) does not grow, so 8 rows run and 16 do not."""
    engine = Engine(str(small_model), device="cpu", estimate=estimate_once)
    available_bytes = int(12 * _row_bytes(engine) / HOST_PROBE_SHARE)
    caplog.set_level(logging.INFO, "laneserve")
    probe = engine.probe(
        2**32 - 1, repeats=1, gauge=SettableGauge(), host_available=lambda: available_bytes
    )
    assert sorted(probe.run_s) == [1, 2, 4, 8]
    assert (probe.batch_cap, probe.stop_reason, probe.first_failing_rows) == (
        8,
        "host_memory",
        None,
    )
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "probe_host_memory"]
    assert "stopped at 8 rows: 16 rows are predicted to need" in record.getMessage()


def test_a_probe_with_room_on_the_host_runs_every_size_as_before(small_model: Path) -> None:
    engine = Engine(str(small_model), device="cpu", estimate=estimate_once)
    probe = engine.probe(128, repeats=1, host_available=lambda: 1 << 40)
    assert sorted(probe.run_s) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert (probe.batch_cap, probe.stop_reason) == (128, "max_batch_size")


@pytest.mark.parametrize(
    ("cgroup", "files", "expected_mib"),
    [
        pytest.param("0::/pod\n", {"pod/memory.max": 512, "pod/memory.current": 128}, 384, id="v2"),
        pytest.param("0::/\n", {"memory.max": 512, "memory.current": 500}, 12, id="v2-namespace"),
        pytest.param(
            "4:memory:/job\n0::/\n",
            {"memory/job/memory.limit_in_bytes": 256, "memory/job/memory.usage_in_bytes": 56},
            200,
            id="v1",
        ),
        pytest.param("0::/pod\n", {"pod/memory.current": 128}, 1000, id="no-limit"),
    ],
)
def test_the_hosts_available_memory_is_the_cgroups_room_where_that_is_less(
    tmp_path: Path, cgroup: str, files: dict[str, int], expected_mib: int
) -> None:
    """In a container MemAvailable is the whole machine's; past the cgroup's limit the OOM
    killer ends the server."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 4096000 kB\nMemAvailable: {1000 * 1024} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, mib in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(f"{mib * MIB}\n")
    if "pod/memory.current" in files and "pod/memory.max" not in files:
        (cgroups / "pod" / "memory.max").write_text("max\n")
    assert host_available_bytes(proc, cgroups) == expected_mib * MIB


def _host_available_in(tmp_path: Path, cgroup: str, files: Mapping[str, str]) -> int | None:
    """`host_available_bytes` of fake /proc and /sys/fs/cgroup trees: MemAvailable
    20 GiB, the process in `cgroup` (/proc/self/cgroup's text), `files` under the cgroup
    mount (their texts)."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 33554432 kB\nMemAvailable: {20 * 1024 * 1024} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(f"{text}\n")
    return host_available_bytes(proc, cgroups)


@pytest.mark.parametrize(
    ("cgroup", "files", "expected_mib"),
    [
        pytest.param(
            "0::/\n",
            {
                "memory.max": f"{2048 * MIB}",
                "memory.current": f"{2044 * MIB}",
                "memory.stat": f"anon {100 * MIB}\nfile {1900 * MIB}\ninactive_file {1850 * MIB}",
            },
            2048 - (2044 - 1850),
            id="v2",
        ),
        pytest.param(
            "4:memory:/docker/abc\n",
            {
                "memory/docker/abc/memory.limit_in_bytes": f"{2048 * MIB}",
                "memory/docker/abc/memory.usage_in_bytes": f"{2048 * MIB}",
                "memory/docker/abc/memory.stat": (
                    f"cache {1900 * MIB}\nrss {100 * MIB}\ntotal_inactive_file {1850 * MIB}"
                ),
            },
            2048 - (2048 - 1850),
            id="v1",
        ),
        pytest.param(
            "0::/\n",
            {
                "memory.max": f"{512 * MIB}",
                "memory.current": f"{100 * MIB}",
                "memory.stat": f"inactive_file {101 * MIB}",  # read a moment later
            },
            512,
            id="cache-read-above-usage",
        ),
    ],
)
def test_the_cgroups_room_leaves_out_the_page_cache_the_kernel_reclaims(
    tmp_path: Path, cgroup: str, files: dict[str, str], expected_mib: int
) -> None:
    """A cgroup's usage counts the page cache its files left (a model copied into the
    container, 1.9 GiB of a 2 GiB limit): the room read ~0 and the probe capped the batch
    at 1 row, ~9x less throughput, at default settings. The inactive cache is reclaimed
    before the OOM killer runs, and is room (kubelet's working set leaves it out too)."""
    assert _host_available_in(tmp_path, cgroup, files) == expected_mib * MIB


@pytest.mark.parametrize(
    ("cgroup", "files", "expected_mib"),
    [
        pytest.param(
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            {
                "user.slice/user-1000.slice/memory.max": f"{1024 * MIB}",
                "user.slice/user-1000.slice/memory.current": f"{200 * MIB}",
                "user.slice/user-1000.slice/memory.stat": f"inactive_file {10 * MIB}",
                "user.slice/user-1000.slice/session-3.scope/memory.max": "max",
                "user.slice/user-1000.slice/session-3.scope/memory.current": f"{150 * MIB}",
            },
            1024 - (200 - 10),
            id="v2-slice",
        ),
        pytest.param(
            "0::/pod/container\n",
            {
                "pod/memory.max": f"{1024 * MIB}",
                "pod/memory.current": f"{900 * MIB}",
                "pod/container/memory.max": f"{768 * MIB}",
                "pod/container/memory.current": f"{300 * MIB}",
            },
            1024 - 900,
            id="v2-parent-tighter",
        ),
        pytest.param(
            "4:memory:/parent/leaf\n",
            {
                "memory/parent/memory.limit_in_bytes": f"{1024 * MIB}",
                "memory/parent/memory.usage_in_bytes": f"{200 * MIB}",
                "memory/parent/leaf/memory.limit_in_bytes": "9223372036854771712",
                "memory/parent/leaf/memory.usage_in_bytes": f"{150 * MIB}",
                "memory/parent/leaf/memory.stat": f"hierarchical_memory_limit {1024 * MIB}",
            },
            1024 - 200,
            id="v1-parent",
        ),
        pytest.param(
            # The container's own cgroup mounted, its parent's limit seen only in its
            # memory.stat.
            "4:memory:/kubepods/pod1/abc\n",
            {
                "memory/memory.limit_in_bytes": "9223372036854771712",
                "memory/memory.usage_in_bytes": f"{150 * MIB}",
                "memory/memory.stat": (
                    f"hierarchical_memory_limit {1024 * MIB}\ntotal_inactive_file {50 * MIB}"
                ),
            },
            1024 - (150 - 50),
            id="v1-hierarchical-limit",
        ),
        pytest.param(
            # A path out of the cgroup namespace: only the mount (the namespace's root).
            "0::/../../elsewhere\n",
            {"memory.max": f"{1024 * MIB}", "memory.current": f"{24 * MIB}"},
            1000,
            id="v2-outside-namespace",
        ),
    ],
)
def test_a_memory_limit_on_a_parent_cgroup_bounds_the_hosts_available_memory(
    tmp_path: Path, cgroup: str, files: dict[str, str], expected_mib: int
) -> None:
    """A parent's limit holds its children's usage together (a systemd slice's MemoryMax
    over a session's scope; a pod's over its containers): only the process's own cgroup
    was read, "max" there, and the room was the whole machine's MemAvailable."""
    assert _host_available_in(tmp_path, cgroup, files) == expected_mib * MIB


def _kernel_files(tmp_path: Path, cgroup: str, files: Mapping[str, str]) -> tuple[Path, Path]:
    """Fake /proc and /sys/fs/cgroup trees (in that order): the process in `cgroup`
    (/proc/self/cgroup's text), `files` under the cgroup mount (their texts)."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(f"{text}\n")
    return proc, cgroups


@pytest.mark.parametrize(
    ("cgroup", "files", "expected"),
    [
        pytest.param("0::/\n", {"memory.max": f"{512 * MIB}"}, (512, "memory.max"), id="v2"),
        pytest.param(
            "0::/pod/container\n",
            {"pod/memory.max": f"{768 * MIB}", "pod/container/memory.max": f"{1024 * MIB}"},
            (768, "pod/memory.max"),
            id="v2-parent-tighter",
        ),
        pytest.param(
            "0::/pod\n", {"pod/memory.max": "max", "memory.max": "max"}, None, id="v2-max"
        ),
        pytest.param(
            "4:memory:/job\n",
            {"memory/job/memory.limit_in_bytes": f"{256 * MIB}"},
            (256, "memory/job/memory.limit_in_bytes"),
            id="v1",
        ),
        pytest.param(
            "4:memory:/kubepods/pod1/abc\n",
            {
                "memory/memory.limit_in_bytes": "9223372036854771712",
                "memory/memory.stat": f"hierarchical_memory_limit {1024 * MIB}",
            },
            (1024, "memory/memory.stat hierarchical_memory_limit"),
            id="v1-hierarchical-limit",
        ),
        pytest.param(
            # This machine's shape (cgroup v1, no limit): the test suite's servers get none.
            "4:memory:/process_api/c48\n0::/\n",
            {
                "memory/process_api/c48/memory.limit_in_bytes": "9223372036854771712",
                "memory/process_api/c48/memory.stat": "hierarchical_memory_limit "
                "9223372036854771712",
                "memory/memory.limit_in_bytes": "9223372036854771712",
            },
            None,
            id="v1-none",
        ),
    ],
)
def test_the_cgroup_memory_limit_is_the_least_of_the_process_and_its_parents(
    tmp_path: Path, cgroup: str, files: dict[str, str], expected: tuple[int, str] | None
) -> None:
    """What the host watermark defaults to without --host-memory-limit (see below), and
    the file that said so, for the log line."""
    proc, cgroups = _kernel_files(tmp_path, cgroup, files)
    limit = cgroup_memory_limit(proc, cgroups)
    if expected is None:
        assert limit is None
        return
    assert limit is not None
    assert (limit.limit_bytes, limit.source) == (expected[0] * MIB, str(cgroups / expected[1]))


@pytest.mark.parametrize(
    ("cgroup_mib", "settings", "limit_mib", "events"),
    [
        pytest.param(1024, {}, 1024, ["host_memory_limit_from_cgroup"], id="taken"),
        pytest.param(
            110,
            {},
            None,
            ["host_memory_limit_from_cgroup", "host_watermark_off"],
            id="idle-above-the-low-mark",
        ),
        pytest.param(1024, {"host_memory_limit": "2GiB"}, 2048, [], id="the-flag-overrides"),
        pytest.param(None, {}, None, [], id="no-cgroup-limit"),
    ],
)
def test_without_a_host_memory_limit_the_watermark_takes_the_cgroups(
    demo_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cgroup_mib: int | None,
    settings: dict[str, Any],
    limit_mib: int | None,
    events: list[str],
) -> None:
    """On the CPU without --host-memory-limit there was no watermark at all, though the
    container's limit was read (for the probe): queued request bodies took a 512 MiB
    pod's server from 95 to 761 MiB resident, none refused, until the OOM killer came.
    The cgroup's limit stands in for the flag, and the marks are its fractions; logged
    with where it came from. Where the idle server is at or above its low mark (100 MiB
    idle, 93.5 the low mark of 110 MiB) that is no refusal, as the flag's is: a start
    that served without a watermark serves as before, without one, and is warned."""
    files = {"memory.max": "max" if cgroup_mib is None else f"{cgroup_mib * MIB}"}
    proc, cgroups = _kernel_files(tmp_path, "0::/\n", files)
    monkeypatch.setattr(
        memory_start, "cgroup_memory_limit", lambda: cgroup_memory_limit(proc, cgroups)
    )
    caplog.set_level(logging.INFO, "laneserve")
    server = _cpu_server(demo_model, **settings)
    watermark = server.scheduler.watermark
    assert (None if watermark is None else watermark.limit_bytes) == (
        None if limit_mib is None else limit_mib * MIB
    )
    logged = [r for r in caplog.records if getattr(r, "event", None) in _CGROUP_EVENTS]
    assert [getattr(r, "event", None) for r in logged] == events
    if events:
        assert cgroup_mib is not None
        taken = logged[0].getMessage()
        limit = f"{format_bytes(cgroup_mib * MIB)} ({cgroups / 'memory.max'})"
        assert f"fractions of the cgroup memory limit, {limit}" in taken
        assert taken.endswith("--host-memory-limit overrides it")
    if len(events) == 2:
        warning = logged[1]
        assert warning.levelno == logging.WARNING
        assert warning.getMessage().startswith(
            "the server holds 100.0MiB idle after loading the model, at or above the low "
            "watermark 93.5MiB (memory_low_watermark 0.85 of the cgroup memory limit "
            "110.0MiB), so lanes closed by memory pressure could never reopen: serving "
            "without a host memory watermark"
        )


_CGROUP_EVENTS = ("host_memory_limit_from_cgroup", "host_watermark_off")


@pytest.mark.parametrize(
    ("cgroup", "files", "cpus", "threads"),
    [
        pytest.param("0::/\n", {"cpu.max": "200000 100000"}, 2.0, 1, id="v2"),
        pytest.param("0::/\n", {"cpu.max": "max 100000"}, None, 31, id="v2-max"),
        pytest.param("0::/\n", {"cpu.max": "450000 100000"}, 4.5, 4, id="v2-rounded-up"),
        pytest.param(
            "0::/pod/c\n",
            {"pod/cpu.max": "150000 100000", "pod/c/cpu.max": "max 100000"},
            1.5,
            1,
            id="v2-parent",
        ),
        pytest.param(
            "2:cpu,cpuacct:/job\n",
            {"cpu/job/cpu.cfs_quota_us": "400000", "cpu/job/cpu.cfs_period_us": "100000"},
            4.0,
            3,
            id="v1",
        ),
        pytest.param(
            "2:cpu,cpuacct:/\n0::/\n",
            {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
            None,
            31,
            id="v1-none",
        ),
        pytest.param("0::/\n", {"cpu.max": "6400000 100000"}, 64.0, 31, id="above-the-cores"),
    ],
)
def test_the_default_intra_op_threads_leave_a_core_of_the_cgroups_cpu_quota(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cgroup: str,
    files: dict[str, str],
    cpus: float | None,
    threads: int,
) -> None:
    """A pod limited to 2 CPUs on a 32-core node sees all 32 CPUs (sched_getaffinity),
    and took 31 intra-op threads, which only wait for the quota's share (2 cores, 16-row
    calls: p99 118.6 ms with 15 threads, 83.3 ms with 1). The quota rounded up is the
    cores there are: one is left to the event loop, at least one thread runs."""
    proc, cgroups = _kernel_files(tmp_path, cgroup, files)
    assert cgroup_cpu_limit(proc, cgroups) == cpus
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(32)), raising=False)
    cpu_limit = functools.partial(cgroup_cpu_limit, proc, cgroups)
    assert default_intra_op_threads(on_gpu=False, cpu_limit=cpu_limit) == threads
    assert default_intra_op_threads(on_gpu=True, cpu_limit=cpu_limit) == 0


def test_a_fixed_cap_stays_where_the_host_bounds_the_sizes_timed(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With --batch-cap the operator chose the cap: the host's room bounds only the sizes
    the probe times (a start-up must not take the host's memory before serving), and the
    cap stays. The warning said "stopped at 8 rows", batch_cap=8, for a cap of 64."""
    engine = Engine(str(small_model), device="cpu", estimate=estimate_once)
    available_bytes = int(12 * _row_bytes(engine) / HOST_PROBE_SHARE)
    caplog.set_level(logging.INFO, "laneserve")
    probe = engine.probe(
        64,
        repeats=1,
        fixed_cap=True,
        gauge=SettableGauge(),
        host_available=lambda: available_bytes,
    )
    assert sorted(probe.run_s) == [1, 2, 4, 8]
    assert (probe.batch_cap, probe.stop_reason) == (64, "host_memory")
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "probe_host_memory"]
    message = record.getMessage()
    assert message.startswith("probe: timed sizes up to 8 rows: 16 rows are predicted"), message
    assert message.endswith("the batch cap stays --batch-cap 64, its larger batches untimed")
    fields = getattr(record, "fields", {})
    assert (fields["batch_cap"], fields["timed_rows"]) == (64, 8)


def test_burst_larger_than_memory_completes_and_the_cap_converges(
    demo_model: Path, reference: ort.InferenceSession
) -> None:
    """The cap is forced to 1024 rows, which do not fit: the server must split, converge
    below the failing size, and answer every row correctly, once."""
    server = ServerProcess(
        [
            *("--model", str(demo_model), "--port", "0", "--memory-limit", DEMO_BUDGET),
            *("--max-batch-size", "1024", "--batch-cap", "1024"),
        ]
    )
    try:
        stats = _burst(server.port(), reference)
    finally:
        server.close()
    assert stats.out_of_memory_events >= 1
    assert stats.batch_splits >= 1
    assert stats.max_batch_cap == 1024
    assert stats.batch_cap < 1024, "the cap converged below the failing size"
    assert stats.cap_changes["out_of_memory"] >= 1
    bulk = next(lane for lane in stats.lanes if lane.name == "bulk")
    assert (bulk.admitted, bulk.completed, bulk.failed) == (6, 6, 0)


def test_a_fixed_cap_above_the_fit_is_warned_of_and_its_out_of_memory_named(
    demo_model: Path, reference: ort.InferenceSession
) -> None:
    """--batch-cap 1024 where the probe saw 1024 rows run out of memory: the probe line
    said so at INFO only, and the first full batch's out-of-memory read "out of device
    memory" on the CPU, naming no batch. The start warns now (batch_cap_exceeds_fit),
    and each out-of-memory names the host arena and its batch."""
    server = ServerProcess(
        [
            *("--model", str(demo_model), "--port", "0", "--memory-limit", DEMO_BUDGET),
            *("--max-batch-size", "1024", "--batch-cap", "1024", "--log-format", "json"),
        ]
    )
    try:
        _burst(server.port(), reference)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=CHILD_TIMEOUT_S) == 0
        lines = [json.loads(line) for line in server.log + server.rest()]
    finally:
        server.close()
    (warning,) = [line for line in lines if line["event"] == "batch_cap_exceeds_fit"]
    fails, fitted = warning["first_failing_rows"], warning["largest_fitting_rows"]
    assert (warning["level"], warning["batch_cap"]) == ("WARNING", 1024)
    assert fitted < fails <= 1024, warning
    assert warning["message"].startswith(
        f"--batch-cap 1024 is above what fits: the probe ran out of memory at {fails} rows "
        f"({fitted} ran)."
    ), warning
    assert f"set --batch-cap below {fails}" in warning["message"]
    out_of_memory = [line for line in lines if line["event"] == "out_of_memory"]
    assert out_of_memory, "the first full batch ran out of memory"
    for line in out_of_memory:
        assert (line["level"], line["memory"]) == ("WARNING", "host arena"), line
        assert line["message"].startswith(
            f"out of memory (host arena) running {line['rows']} rows of batch {line['batch_id']}"
        ), line


def _burst(port: int, reference: ort.InferenceSession) -> pb.GetStatsResponse:
    inputs = [rows(1024, seed=seed) for seed in range(6)]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        calls = [
            stub.Infer.future(request(x, request_id=f"burst-{i}", lane="bulk"), timeout=120)
            for i, x in enumerate(inputs)
        ]
        for x, call in zip(inputs, calls, strict=True):
            response = call.result()
            expected = reference.run(None, {"input": x})[0]
            np.testing.assert_allclose(
                decode_tensor(response.outputs[0]), expected, rtol=1e-4, atol=1e-5
            )
        return stub.GetStats(pb.GetStatsRequest(), timeout=10)


def _wide_model(path: Path) -> Path:
    make_demo_model(path, hidden_dim=8192, hidden_layers=1)
    return path


@pytest.mark.parametrize(("model_kind", "budget"), [("demo", DEMO_BUDGET), ("wide", "48MiB")])
def test_probe_picks_a_cap_that_never_fails_under_the_budget(
    model_kind: str, budget: str, demo_model: Path, tmp_path: Path
) -> None:
    model = demo_model if model_kind == "demo" else _wide_model(tmp_path / "wide.onnx")
    server = ServerProcess(
        ["--model", str(model), "--port", "0", "--memory-limit", budget, "--max-batch-size", "4096"]
    )
    try:
        port = server.port()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            model_info = stub.GetModel(pb.GetModelRequest(), timeout=10)
            cap = model_info.batch_cap
            assert 1 < cap < 4096, "the budget, not max_batch_size, set the cap"
            assert model_info.probed_batch_cap == cap
            # Resident memory grew with the probe's batch sizes: the arena's activations.
            assert model_info.measured_row_bytes > 0
            assert model_info.memory_limit_bytes == parse_memory_limit(budget).limit_bytes
            # Full batches at the cap, alone and mixed with smaller ones, again and again.
            sizes = [cap, cap, cap // 2, cap, 1, cap - 1, cap, cap // 3, cap]
            calls = [
                stub.Infer.future(request(rows(size, seed=i), lane="bulk"), timeout=120)
                for i, size in enumerate(sizes * 2)
            ]
            for call in calls:
                call.result()
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.out_of_memory_events == 0
        assert stats.batch_cap == cap
    finally:
        server.close()


def _ragged_model(path: Path) -> Path:
    """input [batch, width] with a dynamic width: a row's memory grows with its width."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["input", "two"], ["doubled"]),
            helper.make_node("Relu", ["doubled"], ["positive"]),
            helper.make_node("ReduceSum", ["positive", "axes"], ["output"], keepdims=1),
        ],
        "ragged",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "width"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1])],
        [
            helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
            helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
        ],
    )
    return save_model(path, graph, check=False)


def test_single_row_larger_than_the_budget_fails_alone(tmp_path: Path) -> None:
    model = _ragged_model(tmp_path / "ragged.onnx")
    server = ServerProcess(
        [
            "--model",
            str(model),
            "--port",
            "0",
            "--memory-limit",
            "16MiB",
            "--max-message-bytes",
            str(128 * MIB),
        ]
    )
    try:
        port = server.port()
        with grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 128 * MIB)]
        ) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            huge = np.ones((1, 8 * MIB // 4 * 3), dtype=np.float32)  # 24 MiB in one row
            with pytest.raises(grpc.RpcError) as caught:
                stub.Infer(pb.InferRequest(inputs=[encode_tensor("input", huge)]), timeout=60)
            # The sync stub raises an RpcError that is also a grpc.Call.
            error: Any = caught.value
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert rich_status(error)[0] == "DEVICE_MEMORY"
            # The server keeps serving everyone else.
            small = np.ones((4, 1000), dtype=np.float32)
            answer = stub.Infer(pb.InferRequest(inputs=[encode_tensor("input", small)]), timeout=60)
            np.testing.assert_allclose(decode_tensor(answer.outputs[0]), np.full((4, 1), 2000.0))
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.out_of_memory_events >= 1
    finally:
        server.close()


_UNFIT_ROWS_SCRIPT = """
import json, sys
import numpy as np
from laneserve.server.engine import Engine
from laneserve.server.items import Batch, BatchSlice, DispatchReason
from laneserve.server.memory import parse_memory_limit

engine = Engine(sys.argv[1], device="cpu", memory_limit=parse_memory_limit(sys.argv[2]))
x = np.ones((3, 5 * 1024 * 1024), np.float32)  # 20 MiB a row
# Request 1's rows 0-1, and request 2's row 3 (its rows 0-2 ran in an earlier batch).
slices = (BatchSlice(1, "standard", 0, 2, 0), BatchSlice(2, "standard", 3, 1, 2))
result = engine.run_batch(Batch(1, slices, 3, DispatchReason.FULL, 0.0, {"input": (x,)}))
print(json.dumps([
    [failed.offset, failed.rows, failed.error.reason, failed.error.message]
    for failed in result.failed_rows
]))
"""


def test_a_row_too_large_alone_is_named_with_the_limit_and_the_remedy(tmp_path: Path) -> None:
    """The caller of a row that did not fit alone read the runtime's words ("Available
    memory of 16776960 is smaller than requested bytes of 20971520"): neither its row nor
    the budget, nor what to change. The row's index is within its request."""
    model = _ragged_model(tmp_path / "ragged.onnx")
    failed = _script_report(_UNFIT_ROWS_SCRIPT, str(model), "16MiB")
    assert [(offset, count, reason) for offset, count, reason, _ in failed] == [
        (0, 2, "DEVICE_MEMORY"),
        (2, 1, "DEVICE_MEMORY"),
    ]
    for (_, _, _, message), row in zip(failed, (0, 3), strict=True):
        assert message.startswith(
            f"row {row} of this request needs more device memory than the memory limit "
            "of 16.0MiB allows, even run alone; expected a larger --memory-limit, or "
            "narrower rows: "
        ), message
        assert re.search(r"Available memory of \d+ is smaller than requested bytes", message)


def test_a_row_too_large_alone_without_a_limit_names_the_device() -> None:
    split = Split(
        Batch(1, (BatchSlice(1, "standard", 5, 2, 0),), 2, DispatchReason.FULL, 0.0, {}),
        None,
        None,
    )
    split.fail_alone(np.array([1]), DeviceMemoryError("CUDA failure 2: out of memory"))
    (failed,) = split.failed_rows()
    assert failed.error.message == (
        "row 6 of this request needs more device memory than the device's memory allows, "
        "even run alone; expected narrower rows: CUDA failure 2: out of memory"
    )


def test_memory_fit_is_a_line_through_the_readings() -> None:
    fit = fit_memory({1: 1_000 + 10, 2: 1_000 + 20, 4: 1_000 + 40, 8: 1_000 + 80})
    assert fit == MemoryEstimate(fixed_bytes=1_000, per_row_bytes=10)
    assert fit_memory({4: 123}) is None


# ---- the start's memory checks: what they read, what they leave --------------------------

_IDLE_AFTER_RELEASE_SCRIPT = """
import dataclasses, sys
from laneserve.server import LaneServer, ServerConfig
from laneserve.server.engine import Engine
from laneserve.server.memory import ProcessRssGauge, release_free_heap
from laneserve.server.telemetry import Telemetry

MIB = 2**20
engine = Engine(sys.argv[1], device="cpu", estimate=lambda path: None)
config = ServerConfig(model_path=sys.argv[1], metrics_port=-1, max_batch_size=2048)
Telemetry.from_config(config, engine.providers).close()  # its libraries are idle memory too
release_free_heap()
idle = ProcessRssGauge().used_bytes()
# The probe's 2 048-row batches leave ~65 MiB in the arena and the free heap; given back,
# the server holds a few MiB more than before the probe. The low mark lies between.
limit = int((idle + 32 * MIB) / config.memory_low_watermark)
LaneServer(engine, dataclasses.replace(config, host_memory_limit=f"{limit}B"))
print("accepted")
"""


def test_the_idle_check_reads_memory_with_the_probes_arena_and_heap_given_back(
    demo_model: Path,
) -> None:
    """The start read memory right after the probe, its largest batch's arena regions and
    the heap it freed still held, where a running server reads after giving both back:
    max_batch_size 2048 under a 200 MiB host limit was refused at 187 MiB, though the idle
    server held 123 MiB."""
    assert _run_script(_IDLE_AFTER_RELEASE_SCRIPT, str(demo_model)).split() == ["accepted"]


def test_a_server_refused_at_start_leaves_no_telemetry_thread(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused by the idle-memory check, a server never stops, and the telemetry it had
    built kept its span exporter's thread running (one per refused server)."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    config = ServerConfig(
        model_path=str(small_model), device="cpu", metrics_port=-1, host_memory_limit="110MiB"
    )
    engine = Engine(str(small_model), device="cpu", estimate=estimate_once)
    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match=r"server\.host_memory_limit: the server holds"):
        LaneServer(engine, config, memory_gauge=_Resident(100 * MIB))
    assert [thread.name for thread in set(threading.enumerate()) - before] == []


def test_the_static_estimate_counts_a_row_of_the_probes_shape(tmp_path: Path) -> None:
    """Each dynamic size was counted 1 wide: a model of dynamic width was estimated at 20
    bytes a row where the probe's 256-wide rows took ~264 KiB (a [batch, width, width]
    outer product). Sizes not given are 1, as the probe runs them."""
    model = str(_outer_model(tmp_path / "outer.onnx"))
    float_bytes = 4
    _, narrow = static_estimate(model)
    _, wide = static_estimate(model, {"input": (256,)})
    assert narrow < 64
    assert wide >= 256 * 256 * float_bytes
    as_child = estimate_memory(model, probe_shapes={"input": (256,)})
    assert as_child == MemoryEstimate(*static_estimate(model, {"input": (256,)}))


def test_the_server_estimates_memory_for_its_probe_shapes(tmp_path: Path) -> None:
    model = str(_outer_model(tmp_path / "outer.onnx"))
    engine = Engine(model, device="cpu", probe_shapes={"input": (256,)})
    config = ServerConfig(model_path=model, device="cpu", metrics_port=-1, max_batch_size=4)
    server = LaneServer(engine, config)  # the estimate by default: the child's
    server.telemetry.close()
    assert server.memory_estimate is not None
    assert server.memory_estimate.per_row_bytes >= 256 * 256 * 4


class _NvmlError(Exception):
    """pynvml's NVMLError."""


class _NvmlNotFoundError(_NvmlError):
    """NVMLError_NotFound, as pynvml raises it for a UUID no GPU has."""


class _GpuMemory:
    """What the fake NVML reads of its one GPU: every process's use, as the test sets it
    (the watermark's input, like a clock's time)."""

    def __init__(self, used_bytes: int = 1 << 30, total_bytes: int = 80 << 30) -> None:
        self.used_bytes = used_bytes
        self.total_bytes = total_bytes


def _fake_nvml(
    monkeypatch: pytest.MonkeyPatch,
    *,
    missing: bool = False,
    handle_error: Exception | None = None,
    memory_error: Exception | None = None,
    memory: _GpuMemory | None = None,
) -> None:
    """A pynvml whose look-ups or readings fail as the test says (one GPU, 80 GiB, 1 GiB
    in use unless `memory` reads otherwise)."""
    gpu = memory or _GpuMemory()
    if missing:
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml: ImportError
        return
    fake: Any = type(sys)("pynvml")
    fake.NVMLError = _NvmlError

    def handle(gpu: object) -> object:
        if handle_error is not None:
            raise handle_error
        return gpu

    def memory_info(_handle: object) -> object:
        if memory_error is not None:
            raise memory_error
        return type("Memory", (), {"used": gpu.used_bytes, "total": gpu.total_bytes})()

    fake.nvmlInit = fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: 1
    fake.nvmlDeviceGetHandleByIndex = handle
    fake.nvmlDeviceGetHandleByUUID = handle
    fake.nvmlDeviceGetMemoryInfo = memory_info
    fake.nvmlDeviceGetUtilizationRates = lambda _handle: type("Rates", (), {"gpu": 10})()
    monkeypatch.setitem(sys.modules, "pynvml", fake)


def _as_if_on_a_gpu(engine: Engine) -> Engine:
    """The real CPU session, taken for a CUDA one with an 8 GiB memory limit: the server
    then reads memory with NVML (the fake's) for the probe and the watermark."""
    engine.providers = [CUDA, "CPUExecutionProvider"]
    engine.memory_limit_bytes = 8 << 30
    return engine


@pytest.mark.parametrize(
    ("fault", "visible", "why"),
    [
        ({"missing": True}, None, "cannot import pynvml"),
        (
            {"handle_error": _NvmlNotFoundError("Not Found")},
            "GPU-8932f937",
            "NVML has no GPU 'GPU-8932f937' (_NvmlNotFoundError: Not Found)",
        ),
    ],
    ids=["no-pynvml", "shortened-uuid"],
)
def test_a_gpu_nvml_cannot_open_refuses_the_start_naming_it(
    small_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    fault: dict[str, Any],
    visible: str | None,
    why: str,
) -> None:
    """NVML's failures escaped as tracebacks (exit 1): CUDA takes a UUID's prefix in
    CUDA_VISIBLE_DEVICES, NVML's look-up by UUID only the whole UUID."""
    _fake_nvml(monkeypatch, **fault)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    engine = _as_if_on_a_gpu(Engine(str(small_model), device="cpu", estimate=estimate_once))
    config = ServerConfig(model_path=str(small_model), metrics_port=-1, max_batch_size=8)
    with pytest.raises(EngineStartError) as refused:
        LaneServer(engine, config)
    message = str(refused.value)
    gpu = visible or "0"
    set_as = "unset" if visible is None else repr(visible)
    assert message.startswith(
        f"cannot read the memory of the session's GPU {gpu!r} (CUDA_VISIBLE_DEVICES={set_as}): "
    ), message
    assert why in message
    assert "expected nvidia-ml-py installed and CUDA_VISIBLE_DEVICES naming the GPU" in message


def test_a_gpu_reading_nvml_fails_refuses_the_start_naming_it(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML's "Unknown Error" on the probe's first reading failed the start with a
    traceback (exit 1, which asks a supervisor to restart it): refused naming the GPU.
    While serving, a reading that fails stops the server (README: a lost device's memory
    readings), as before."""
    _fake_nvml(monkeypatch, memory_error=_NvmlError("Unknown Error"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    engine = _as_if_on_a_gpu(Engine(str(small_model), device="cpu", estimate=estimate_once))
    config = ServerConfig(model_path=str(small_model), metrics_port=-1, max_batch_size=8)
    with pytest.raises(EngineStartError) as refused:
        LaneServer(engine, config)
    message = str(refused.value)
    assert message.startswith("cannot read the memory of the session's GPU '0'"), message
    assert "NVML cannot read the memory of GPU '0' (_NvmlError: Unknown Error)" in message


def test_an_engine_on_a_gpu_nvml_cannot_read_refuses_the_start_naming_it(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the engine's first reading is the device's total (its memory limit is a
    share of it): NVML's "Unknown Error" there escaped as a traceback, exit 1, where a
    supervisor restarts the server in a loop. The session is never made: the limit comes
    first."""
    _fake_nvml(monkeypatch, memory_error=_NvmlError("Unknown Error"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, "CPUExecutionProvider"])
    with pytest.raises(EngineStartError) as refused:
        Engine(str(small_model), device="auto", estimate=estimate_once)
    message = str(refused.value)
    assert message.startswith("cannot read the memory of the session's GPU '0'"), message
    assert "(_NvmlError: Unknown Error)" in message


def test_a_memory_pressure_refusal_names_the_memory_it_read(
    demo_model: Path, small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU server's watermark reads this process's resident memory, and its refusal said
    "device memory in use (230.2MiB) is above the high watermark (209.0MiB)" of it (an
    operator, --host-memory-limit 220MiB). It names what it read: resident memory on the
    CPU, the GPU's memory in use (every process's, NVML's) on a GPU."""
    cpu = _cpu_server(demo_model, host_memory_limit="220MiB").scheduler
    engine = _on_a_fake_gpu(monkeypatch, small_model, _GpuMemory(), ARENA_ON_80_GIB)
    gpu_config = ServerConfig(model_path=str(small_model), metrics_port=-1, max_batch_size=8)
    gpu_server = LaneServer(engine, gpu_config)
    gpu_server.telemetry.close()
    for scheduler, used_bytes, reading in (
        (cpu, round(230.2 * MIB), "this process's resident memory (230.2MiB)"),
        (gpu_server.scheduler, 80 * GIB, "memory in use on GPU '0' (80.0GiB)"),
    ):
        mark = scheduler.watermark
        assert mark is not None
        scheduler.admit(_request(0, "interactive", 1), 0.0)  # queued: not idle
        scheduler.update_memory(used_bytes)  # at the limit: every lane closes
        with pytest.raises(MemoryPressureError) as refused:
            scheduler.admit(_request(1, "interactive", 1), 0.0)
        assert refused.value.message == (
            f"{reading} is above the high watermark ({format_bytes(mark.high_bytes)}): lane "
            "'interactive' admits no new work while other work is queued or running, until "
            f"it falls below {format_bytes(mark.low_bytes)}"
        )
        assert refused.value.reason == "MEMORY_PRESSURE"


# The default arena budget on the fake's 80 GiB GPU: memory_limit 0.9.
ARENA_ON_80_GIB = int(0.9 * 80 * GIB)


def _on_a_fake_gpu(
    monkeypatch: pytest.MonkeyPatch, model: Path, gpu: _GpuMemory, arena_bytes: int
) -> Engine:
    """The real CPU session taken for a CUDA one whose arena is capped at `arena_bytes`,
    on the fake NVML's GPU '0' reading as `gpu` says."""
    _fake_nvml(monkeypatch, memory=gpu)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    engine = _as_if_on_a_gpu(Engine(str(model), device="cpu", estimate=estimate_once))
    engine.memory_limit_bytes = arena_bytes
    return engine


async def _lanes_closed_at(s: Serving, gpu: _GpuMemory, used_bytes: int) -> pb.GetStatsResponse:
    """GetStats once the watermark has read `used_bytes` from the GPU."""
    gpu.used_bytes = used_bytes
    watermark = s.server.scheduler.watermark
    assert watermark is not None
    await until(lambda: watermark.used_bytes == used_bytes)  # sampled every 50 ms
    return await s.stub.GetStats(pb.GetStatsRequest())


def test_a_gpu_arena_at_its_cap_closes_no_lane(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watermark's marks were fractions of the arena's budget, while NVML reads the
    whole device: after one full batch the arena keeps its regions at its cap (72 GiB of
    80), and with the CUDA context NVML read 72.6 GiB, above the high mark of 68.4: the
    server's own full batch closed every lane. The marks are fractions of the GPU's
    total memory now; the budget stays the arena's."""
    gpu = _GpuMemory()
    engine = _on_a_fake_gpu(monkeypatch, small_model, gpu, ARENA_ON_80_GIB)
    config = ServerConfig(model_path=str(small_model), metrics_port=-1, max_batch_size=8)

    async def scenario() -> None:
        async with serving(engine, config) as s:
            stats = await _lanes_closed_at(s, gpu, ARENA_ON_80_GIB + 600 * MIB)
            assert list(stats.lanes_closed_by_memory) == []
            assert stats.memory_watermark_limit_bytes == 80 * GIB
            assert stats.memory_high_watermark_bytes == int(80 * GIB * 0.95)
            assert stats.memory_low_watermark_bytes == int(80 * GIB * 0.85)
            assert stats.memory_limit_bytes == ARENA_ON_80_GIB, "the budget is the arena's"
            answer = await s.stub.Infer(request(rows(1), lane="bulk"))
            assert output(answer).shape[0] == 1

    asyncio.run(scenario())


def test_a_neighbour_filling_the_gpu_closes_lanes_bottom_up(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What presses the device is the device filling up as a whole: another process
    taking it to 0.96 of its memory closes bulk, nearer the whole device standard too.
    With the server idle a reading closes the lanes of its own level (no hysteresis:
    refusing work cannot lower it): all reopen below the high mark (0.95 of the GPU's
    memory); the hysteresis while work runs is tested with the scheduler's own."""
    gpu = _GpuMemory()
    engine = _on_a_fake_gpu(monkeypatch, small_model, gpu, ARENA_ON_80_GIB)
    config = ServerConfig(model_path=str(small_model), metrics_port=-1, max_batch_size=8)

    async def scenario() -> None:
        async with serving(engine, config) as s:
            stats = await _lanes_closed_at(s, gpu, int(80 * GIB * 0.96))
            assert list(stats.lanes_closed_by_memory) == ["bulk"]
            stats = await _lanes_closed_at(s, gpu, int(80 * GIB * 0.99))
            assert list(stats.lanes_closed_by_memory) == ["standard", "bulk"]
            stats = await _lanes_closed_at(s, gpu, int(80 * GIB * 0.96))  # idle: its level
            assert list(stats.lanes_closed_by_memory) == ["bulk"]
            stats = await _lanes_closed_at(s, gpu, int(80 * GIB * 0.9))
            assert list(stats.lanes_closed_by_memory) == []

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("used_gib", "expected"),
    [
        pytest.param(
            70,
            "server.memory_low_watermark: GPU '0' has 70.0GiB of its 80.0GiB in use with the "
            "server idle after loading the model (every process's use, this server's among "
            "it), at or above the low watermark 68.0GiB (memory_low_watermark 0.85 of the "
            "GPU's memory), so lanes closed by memory pressure could never reopen; expected a "
            "GPU with more free memory, or memory_low_watermark above 0.876 (the share of the "
            "GPU's memory in use idle; the default low watermark is 0.85), with room above it",
            id="above-the-low-mark",
        ),
        pytest.param(
            77,
            "server.memory_low_watermark, server.memory_high_watermark: GPU '0' has 77.0GiB of "
            "its 80.0GiB in use",
            id="above-the-high-mark",
        ),
    ],
)
def test_a_gpu_full_while_the_server_is_idle_is_refused_naming_its_use(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, used_gib: int, expected: str
) -> None:
    """The idle check asked for "a limit above 82.4GiB (--memory-limit)" of an 80 GiB
    GPU: no memory_limit holds the device lower, other processes' use counting in it.
    The GPU's use and total are named, and what would do: a GPU with more free memory,
    or the marks above the share in use, rounded up past it (0.875 of 80 GiB is the 70
    GiB in use, a low mark still refused)."""
    gpu = _GpuMemory(used_bytes=used_gib * GIB)
    engine = _on_a_fake_gpu(monkeypatch, small_model, gpu, ARENA_ON_80_GIB)
    config = ServerConfig(model_path=str(small_model), metrics_port=-1, max_batch_size=8)
    with pytest.raises(ConfigError) as refused:
        LaneServer(engine, config)
    message = str(refused.value)
    assert message.startswith(expected), message
    assert "memory-limit" not in message
    assert "memory_limit" not in message


@pytest.mark.parametrize(
    ("idle_gib", "remedy"),
    [
        pytest.param(
            5,
            "expected --memory-limit below 71.0GiB or server.memory_high_watermark above 0.963",
            id="over-the-high-mark",
        ),
        pytest.param(10, "expected --memory-limit below 66.0GiB", id="over-the-whole-gpu"),
        pytest.param(1, None, id="fits"),
    ],
)
def test_a_full_arena_that_reaches_the_high_mark_is_warned_at_start(
    small_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    idle_gib: int,
    remedy: str | None,
) -> None:
    """An arena that fills to its cap takes the device to the idle reading plus the cap,
    less the weights the idle reading holds already: at or above the high mark the
    server's own work would close lanes. Warned, naming the figures and what to set; not
    refused (a small model never fills its arena)."""
    gpu = _GpuMemory(used_bytes=idle_gib * GIB)
    engine = _on_a_fake_gpu(monkeypatch, small_model, gpu, ARENA_ON_80_GIB)
    config = ServerConfig(model_path=str(small_model), metrics_port=-1, max_batch_size=8)
    caplog.set_level(logging.INFO, "laneserve")
    server = LaneServer(engine, config)
    server.telemetry.close()
    records = [
        r for r in caplog.records if getattr(r, "event", None) == "watermark_below_full_arena"
    ]
    if remedy is None:
        assert records == []
        return
    (record,) = records
    assert record.levelno == logging.WARNING
    assert server.memory_estimate is not None
    weights = server.memory_estimate.fixed_bytes
    assert weights > 0
    full = idle_gib * GIB + ARENA_ON_80_GIB - weights
    high = int(80 * GIB * 0.95)
    message = record.getMessage()
    assert message.startswith(
        f"GPU '0': {idle_gib:.1f}GiB of 80.0GiB is in use with the server idle (every "
        "process's use), and the session's arena may grow to its memory_limit of 72.0GiB: "
        f"together (its weights counted once) {format_bytes(full)}, at or above the high "
        "watermark 76.0GiB (memory_high_watermark 0.95 of the GPU's memory), so a batch "
        "that fills the arena would close lanes by itself"
    ), message
    assert message.endswith(remedy), message
    assert getattr(record, "fields", {}) == {
        "gpu": "0",
        "used_bytes": idle_gib * GIB,
        "memory_limit_bytes": ARENA_ON_80_GIB,
        "full_arena_bytes": full,
        "high_watermark_bytes": high,
        "total_bytes": 80 * GIB,
        "memory_limit_below_bytes": high - idle_gib * GIB + weights,
    }


def _warned(caplog: pytest.LogCaptureFixture, event: str) -> list[str]:
    """The messages of the `event` records logged so far."""
    return [r.getMessage() for r in caplog.records if getattr(r, "event", None) == event]


def _start_on_a_fake_gpu(
    monkeypatch: pytest.MonkeyPatch,
    model: Path,
    gpu: _GpuMemory,
    arena_bytes: int,
    **settings: Any,
) -> None:
    """A server made (not started) on `_on_a_fake_gpu`'s engine, with `settings`."""
    engine = _on_a_fake_gpu(monkeypatch, model, gpu, arena_bytes)
    config = ServerConfig(model_path=str(model), metrics_port=-1, max_batch_size=8, **settings)
    LaneServer(engine, config).telemetry.close()


@pytest.mark.parametrize(
    ("idle_bytes", "mark_named"),
    [
        pytest.param(int(4.512 * GIB), True, id="both-fell-short-rounded-to-nearest"),
        pytest.param(int(7.968 * GIB), False, id="the-mark-rounded-up-reaches-1"),
    ],
)
def test_the_full_arena_warnings_remedies_set_as_printed_silence_it(
    small_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    idle_bytes: int,
    mark_named: bool,
) -> None:
    """The remedies were rounded to nearest: "--memory-limit below 71.5GiB" for a bound
    of 71.49 GiB and "memory_high_watermark above 0.956" for a share of 0.9564, and set
    as printed, each brought the warning back; 0.9996 of the GPU was "above 1", a mark
    the config refuses. The limit is rounded down, the mark up, and a mark that rounds
    up to 1 is not offered."""
    gpu = _GpuMemory(used_bytes=idle_bytes)
    caplog.set_level(logging.WARNING, "laneserve")
    _start_on_a_fake_gpu(monkeypatch, small_model, gpu, ARENA_ON_80_GIB)
    (message,) = _warned(caplog, "watermark_below_full_arena")
    found = re.search(
        r"expected --memory-limit below (\S+?)(?: or server\.memory_high_watermark above (\S+))?$",
        message,
    )
    assert found is not None, message
    limit, mark = found.groups()
    assert (mark is not None) == mark_named, message
    caplog.clear()
    arena_bytes = parse_memory_limit(limit).resolve(gpu.total_bytes)
    _start_on_a_fake_gpu(monkeypatch, small_model, gpu, arena_bytes)
    assert _warned(caplog, "watermark_below_full_arena") == [], f"--memory-limit {limit}"
    if mark is not None:
        settings = {"memory_high_watermark": float(mark)}
        _start_on_a_fake_gpu(monkeypatch, small_model, gpu, ARENA_ON_80_GIB, **settings)
        assert _warned(caplog, "watermark_below_full_arena") == [], f"high mark {mark}"


def _cpu_server(demo_model: Path, **settings: Any) -> LaneServer:
    """A CPU server (made, not started) whose idle reading is 100 MiB and whose probe
    reads 64 KiB more for each row (`_ProbeReadsRows`), with `settings`."""
    config = ServerConfig(model_path=str(demo_model), device="cpu", metrics_port=-1, **settings)
    engine = _ProbeReadsRows(demo_model, idle_bytes=100 * MIB, row_bytes=64 * 1024)
    server = LaneServer(engine, config, memory_gauge=_Resident(100 * MIB))
    server.telemetry.close()
    return server


@pytest.mark.parametrize(
    ("limit", "warned", "mark"),
    [
        pytest.param("135MiB", True, "0.978", id="over-the-high-mark"),
        pytest.param("120MiB", True, None, id="over-the-whole-limit"),
        pytest.param("160MiB", False, None, id="fits"),
    ],
)
def test_a_full_batch_that_reaches_the_high_mark_on_the_cpu_is_warned_at_start(
    demo_model: Path,
    caplog: pytest.LogCaptureFixture,
    limit: str,
    warned: bool,
    mark: str | None,
) -> None:
    """The GPU's full-arena warning had no CPU counterpart: the demo model with 4 096-row
    batches under a 140 MiB limit started without a word, below its low mark idle, and
    after one burst held 137 MiB with every lane closed for good (low mark 119 MiB). The
    idle reading plus a full batch as the probe measured it (100 + 512 x 64 KiB = 132
    MiB here) at or above the high mark is warned, naming the limit a refused start
    names ((100 + 32) / 0.85 = 155.3 MiB) and the high mark; not refused (limits like
    150 MiB serve the demo model's default batches). Either remedy, set as printed,
    starts the server without it."""
    caplog.set_level(logging.WARNING, "laneserve")
    server = _cpu_server(demo_model, host_memory_limit=limit, max_batch_size=512)
    assert server.probe.batch_cap == 512
    records = [
        r for r in caplog.records if getattr(r, "event", None) == "watermark_below_full_batch"
    ]
    if not warned:
        assert records == []
        return
    (record,) = records
    assert record.levelno == logging.WARNING
    limit_bytes = parse_memory_limit(limit).resolve(None)
    high, low = int(limit_bytes * 0.95), int(limit_bytes * 0.85)
    message = record.getMessage()
    assert message.startswith(
        f"the server holds 100.0MiB idle of server.host_memory_limit {format_bytes(limit_bytes)}; "
        "with a full batch of 512 rows at 64.0KiB a row as the probe measured, 32.0MiB, it "
        f"holds 132.0MiB, at or above the high watermark {format_bytes(high)} "
        f"(memory_high_watermark 0.95 of {format_bytes(limit_bytes)}), so a full batch would "
        "close lanes by itself, and they reopen only below the low watermark "
        f"{format_bytes(low)}; expected --host-memory-limit above 155.3MiB (the idle reading "
        "plus the batch, over memory_low_watermark 0.85), with room above it"
    ), message
    or_mark = "" if mark is None else f" or server.memory_high_watermark above {mark}"
    assert message.endswith(f"(buffers and caches a burst leaves){or_mark}"), message
    assert getattr(record, "fields", {}) == {
        "used_bytes": 100 * MIB,
        "batch_cap": 512,
        "batch_bytes": 32 * MIB,
        "full_batch_bytes": 132 * MIB,
        "high_watermark_bytes": high,
        "low_watermark_bytes": low,
        "host_memory_limit_bytes": limit_bytes,
        "host_memory_limit_above_bytes": int(132 * MIB / 0.85),
    }
    remedies: list[dict[str, Any]] = [{"host_memory_limit": "155.3MiB"}]
    if mark is not None:
        remedies.append({"host_memory_limit": limit, "memory_high_watermark": float(mark)})
    for settings in remedies:
        caplog.clear()
        _cpu_server(demo_model, max_batch_size=512, **settings)
        assert _warned(caplog, "watermark_below_full_batch") == [], settings


def test_a_full_batch_warning_under_the_cgroups_limit_names_the_container_limit(
    demo_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With the limit taken from the cgroup (no --host-memory-limit), the warning said
    "of server.host_memory_limit 135.0MiB" and "expected --host-memory-limit above
    155.3MiB": a flag never set, and one above the container's limit would let the OOM
    killer come before the watermark acts. It names the cgroup's limit and its file, and
    a container limit as the remedy; either remedy, set as printed, starts without it."""
    proc, cgroups = _kernel_files(tmp_path, "0::/\n", {"memory.max": f"{135 * MIB}"})
    monkeypatch.setattr(
        memory_start, "cgroup_memory_limit", lambda: cgroup_memory_limit(proc, cgroups)
    )
    caplog.set_level(logging.WARNING, "laneserve")
    _cpu_server(demo_model, max_batch_size=512)
    (record,) = [
        r for r in caplog.records if getattr(r, "event", None) == "watermark_below_full_batch"
    ]
    message = record.getMessage()
    source = str(cgroups / "memory.max")
    assert message.startswith(
        f"the server holds 100.0MiB idle of the cgroup memory limit 135.0MiB ({source}; "
        "server.host_memory_limit unset); with a full batch of 512 rows"
    ), message
    assert (
        "; expected a container memory limit above 155.3MiB (the idle reading plus the "
        "batch, over memory_low_watermark 0.85), with room above it"
    ) in message, message
    assert message.endswith(" or server.memory_high_watermark above 0.978"), message
    assert "--host-memory-limit" not in message
    fields = getattr(record, "fields", {})
    assert (fields["host_memory_limit_bytes"], fields["source"]) == (135 * MIB, source)
    for container_bytes, settings in (
        (parse_memory_limit("155.3MiB").resolve(None), {}),
        (135 * MIB, {"memory_high_watermark": 0.978}),
    ):
        (cgroups / "memory.max").write_text(f"{container_bytes}\n")
        caplog.clear()
        _cpu_server(demo_model, max_batch_size=512, **settings)
        assert _warned(caplog, "watermark_below_full_batch") == [], (container_bytes, settings)


@pytest.mark.parametrize(
    ("max_batch_size", "message"),
    [
        pytest.param(
            128,
            "server.memory_low_watermark, server.memory_high_watermark: the server holds "
            "100.0MiB idle after loading the model, at or above the low watermark 90.0MiB "
            "(memory_low_watermark 0.5 of 180.0MiB), so lanes closed by memory pressure could "
            "never reopen; expected memory_low_watermark above 0.601 and memory_high_watermark "
            "at least as high (the share of server.host_memory_limit the server holds idle "
            "plus a full batch of 128 rows at 64.0KiB a row as the probe measured, 8.0MiB; "
            "the default low watermark is 0.85), with room above it",
            id="a-mark-that-holds-it",
        ),
        pytest.param(
            2048,
            "server.host_memory_limit: the server holds 100.0MiB idle after loading the model, "
            "at or above the low watermark 90.0MiB (memory_low_watermark 0.5 of 180.0MiB), so "
            "lanes closed by memory pressure could never reopen; expected a limit above "
            "456.1MiB (the idle reading plus a full batch of 2048 rows at "
            "64.0KiB a row as the probe measured, 128.0MiB, over memory_low_watermark 0.5), "
            "with room above it",
            id="no-mark-holds-it",
        ),
    ],
)
def test_a_low_mark_named_at_start_leaves_a_full_batch_below_it(
    demo_model: Path, max_batch_size: int, message: str
) -> None:
    """The low mark a refused start named counted the idle reading alone: following it
    (0.581 of 200 MiB, the demo model with 4 096-row batches), one burst closed standard
    and bulk for good. It counts a full batch beside the idle reading, as the limit
    named does, so that memory a full batch took falls below it again; where that sum
    is the whole limit or more no mark holds it, and the limit is named."""
    settings: dict[str, Any] = {
        "host_memory_limit": "180MiB",
        "memory_low_watermark": 0.5,
        "memory_high_watermark": 0.6,
        "max_batch_size": max_batch_size,
    }
    with pytest.raises(ConfigError) as refused:
        _cpu_server(demo_model, **settings)
    assert str(refused.value).startswith(message), str(refused.value)
    found = re.search(r"expected memory_low_watermark above (\S+)", str(refused.value))
    if found is None:
        return
    mark = float(found[1])
    settings |= {"memory_low_watermark": mark, "memory_high_watermark": max(mark, 0.6)}
    watermark = _cpu_server(demo_model, **settings).scheduler.watermark
    assert watermark is not None
    assert watermark.low_bytes > (100 + 8) * MIB, "the idle reading and a full batch below it"


def test_a_gpu_count_nvml_fails_means_no_usable_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML that starts but cannot count its GPUs escaped as a traceback from the choice
    of providers: with --device auto the server runs on the CPU."""
    _fake_nvml(monkeypatch)
    fake: Any = sys.modules["pynvml"]

    def count() -> int:
        raise _NvmlError("Unknown Error")

    fake.nvmlDeviceGetCount = count
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, "CPUExecutionProvider"])
    assert choose_providers("auto") == ["CPUExecutionProvider"]


@pytest.mark.parametrize("visible", ["", "-1", " -1 ", "-1,0", "-2", "NoDevFiles"])
def test_cuda_visible_devices_hiding_every_gpu_means_no_gpu(
    monkeypatch: pytest.MonkeyPatch, visible: str
) -> None:
    """NVML counts GPUs whatever CUDA_VISIBLE_DEVICES says: with -1 (CUDA reads the list
    up to its first invalid id) --device auto refused the start (NVML has no GPU '-1'),
    and with "" it took its memory limit from a GPU CUDA could not see. auto runs on the
    CPU; --device cuda is refused naming the variable."""
    _fake_nvml(monkeypatch)
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert choose_providers("auto") == [CPU]
    with pytest.raises(EngineStartError) as refused:
        choose_providers("cuda")
    assert str(refused.value).startswith(
        f"--device cuda: CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from CUDA"
    ), refused.value


@pytest.mark.parametrize(
    "visible", [None, "0", " 0", "1,-1", "GPU-8932f937", "MIG-4f3e2b1a-9c8d-5e6f-a7b8-c9d0e1f2a3b4"]
)
def test_cuda_visible_devices_naming_a_gpu_first_leaves_it_visible(
    monkeypatch: pytest.MonkeyPatch, visible: str | None
) -> None:
    _fake_nvml(monkeypatch)
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert choose_providers("auto") == [CUDA, CPU]
    assert choose_providers("cuda") == [CUDA, CPU]


def test_cuda_sessions_pick_convolution_algorithms_by_heuristics() -> None:
    """EXHAUSTIVE (the runtime's default) benchmarks cuDNN's convolution algorithms for
    each new input shape, 0.3-1.3 s each, and batches come in every size up to the cap."""
    assert cuda_provider_options(8 << 30) == {
        "gpu_mem_limit": str(8 << 30),
        "arena_extend_strategy": "kSameAsRequested",
        "cudnn_conv_algo_search": "HEURISTIC",
    }


def _cuda_provider_does_not_load(
    monkeypatch: pytest.MonkeyPatch, printed: str = ""
) -> list[list[str]]:
    """ONNX Runtime as on a GPU host whose CUDA provider cannot load (libcublasLt.so.13
    missing; cuDNN is loaded only when a run needs it): a real session, built without
    CUDA as the runtime builds it then (it says why on stderr and carries on; its Python
    constructor, where the provider raised, prints `printed` on stdout first), whatever
    this machine has (fault injection). Returns the providers each session asked for;
    a session is asked for only once the one before it is gone."""
    asked: list[list[str]] = []
    made: list[weakref.ref[Any]] = []
    real = ort.InferenceSession

    def session(path: str, options: ort.SessionOptions, *, providers: list[Any]) -> Any:
        gc.collect()
        assert all(ref() is None for ref in made), "the session before it is still held"
        names = [provider if isinstance(provider, str) else provider[0] for provider in providers]
        asked.append(names)
        kept = [provider for provider, name in zip(providers, names, strict=True) if name != CUDA]
        if printed and CUDA in names:
            print(printed)
        built = real(path, options, providers=kept)
        made.append(weakref.ref(built))
        return built

    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(ort, "InferenceSession", session)
    return asked


def test_a_gpu_whose_cuda_provider_does_not_load_serves_as_a_cpu_engine(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NVML saw an 80 GiB GPU, the runtime could not load CUDA and ran the session on the
    CPU, quietly: the engine kept a 72 GiB limit (0.9 of the GPU) that capped nothing,
    and so its probe skipped the host-memory guard of the CPU without a limit. It is a
    CPU engine now, and says why."""
    _fake_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    asked = _cuda_provider_does_not_load(monkeypatch)
    caplog.set_level(logging.INFO, "laneserve")
    engine = Engine(str(small_model), device="auto", estimate=estimate_once)
    assert asked[0] == [CUDA, CPU]
    assert engine.providers == [CPU]
    assert engine.memory_limit_bytes is None
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "cuda_unavailable"]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert f"asked onnxruntime for {[CUDA, CPU]} (NVML sees a GPU), got {[CPU]}: " in message
    assert "it needs the CUDA " in message
    probe = engine.probe(4096, repeats=1, host_available=lambda: 8 * MIB)
    assert probe.stop_reason == "host_memory", probe


def test_a_cuda_provider_that_raised_is_reported_in_the_runtimes_words(
    small_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Where CUDA's provider raised (a busy or full GPU, a driver error), the runtime's
    Python constructor prints "EP Error ..." on stdout and builds the session on the
    CPU: the warning said the libraries were missing, and the reason went unread."""
    _fake_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    said = "EP Error CUDA failure 46: all CUDA-capable devices are busy or unavailable"
    _cuda_provider_does_not_load(monkeypatch, printed=said)
    caplog.set_level(logging.INFO, "laneserve")
    engine = Engine(str(small_model), device="auto", estimate=estimate_once)
    assert engine.providers == [CPU]
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "cuda_unavailable"]
    assert f"onnxruntime fell back itself, saying {said!r}" in record.getMessage()
    # Caught to be read, not kept from stdout: whatever else was printed meanwhile (an
    # embedding application's own lines) still reaches it.
    assert said in capsys.readouterr().out


def test_cuda_demanded_where_its_provider_does_not_load_is_refused_saying_why(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _cuda_provider_does_not_load(monkeypatch)
    with pytest.raises(EngineStartError) as refused:
        Engine(str(small_model), device="cuda", estimate=estimate_once)
    message = str(refused.value)
    assert message.startswith(f"--device cuda: the session fell back to {[CPU]}: "), message
    assert "it needs the CUDA " in message


_CUDA_FALLBACK_BUDGET_SCRIPT = """
import json, os, sys, types
import onnxruntime as ort
from laneserve.server.engine import Engine
from laneserve.server.errors import DeviceMemoryError
from laneserve.server.memory import parse_memory_limit

os.environ.pop("CUDA_VISIBLE_DEVICES", None)
nvml = types.ModuleType("pynvml")  # NVML seeing one 80 GiB GPU
nvml.NVMLError = RuntimeError
nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
nvml.nvmlDeviceGetCount = lambda: 1
nvml.nvmlDeviceGetHandleByIndex = lambda index: index
nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=1 << 30, total=80 << 30)
sys.modules["pynvml"] = nvml
real = ort.InferenceSession

def without_cuda(path, options, *, providers):  # the CUDA provider does not load
    named = [(p if isinstance(p, str) else p[0], p) for p in providers]
    kept = [p for name, p in named if name != "CUDAExecutionProvider"]
    return real(path, options, providers=kept)

ort.get_available_providers = lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
ort.InferenceSession = without_cuda
engine = Engine(sys.argv[1], device="auto", memory_limit=parse_memory_limit(sys.argv[2]))
try:
    engine.run(engine.example_inputs(1024))
    fitted = True
except DeviceMemoryError:
    fitted = False
limit = engine.memory_limit_bytes
print(json.dumps({"providers": engine.providers, "limit": limit, "fitted": fitted}))
"""


def test_a_limit_given_caps_the_cpu_arena_when_cuda_does_not_load(demo_model: Path) -> None:
    """--memory-limit 32MiB on a GPU host whose CUDA provider did not load became the
    GPU arena's limit, of a session that ran on the CPU, uncapped: 1 024 rows of the
    demo model ran. It caps the CPU arena, as on the CPU (750 rows fit)."""
    report = _script_report(_CUDA_FALLBACK_BUDGET_SCRIPT, str(demo_model), DEMO_BUDGET)
    assert report == {"providers": [CPU], "limit": 32 * MIB, "fitted": False}


def test_an_arena_that_cannot_shrink_is_logged_once(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every failure of the run that shrinks the arena was swallowed: one before the run
    (a name the runtime has no arena for) shrinks nothing, and a GPU's arena then never
    gave back what a burst took, unseen."""
    caplog.set_level(logging.INFO, "laneserve")
    engine = Engine(str(small_model), device="cpu", estimate=estimate_once)
    engine.release_idle_memory()
    engine._arena = "gpu:0"  # as if the session's arena had another name
    engine.release_idle_memory()
    engine.release_idle_memory()
    records = [r for r in caplog.records if getattr(r, "event", None) == "arena_shrink_failed"]
    assert len(records) == 1, records
    assert records[0].levelno == logging.WARNING
    assert "Did not find an arena based allocator" in records[0].getMessage()


# ---- first caps of new shapes, guessed from those learned ------------------------------


class _CapChanges(NullEvents):
    def __init__(self) -> None:
        self.changes: list[tuple[int, int, str, Signature]] = []

    def cap_changed(self, old_rows: int, new_rows: int, reason: str, signature: Signature) -> None:
        self.changes.append((old_rows, new_rows, reason, signature))


def _ran(
    width: int, rows: int, *, failed: bool = False, piece_rows: int | None = None
) -> BatchResult:
    """A batch of `rows` rows of width `width` (in requests of `piece_rows`, all of it by
    default) as the engine reports it: run, or run out of memory whole and then in
    halves."""
    each = rows if piece_rows is None else piece_rows
    pieces = tuple(BatchSlice(k, "standard", 0, each, k * each) for k in range(rows // each))
    batch = Batch(width, pieces, rows, DispatchReason.FULL, 0.0, {}, ((width,),))
    outputs = {"out": np.zeros((rows, 1), dtype=np.float32)}
    if not failed:
        return BatchResult(batch, outputs, None, 0.001)
    oom = OutOfMemoryRun(rows, held_unfit_row=False)
    return BatchResult(batch, outputs, None, 0.001, out_of_memory_runs=(oom,), split=True)


def test_a_new_shape_gets_a_cap_scaled_from_the_nearest_learned_ones() -> None:
    """Every new sequence length ran out of memory once before it batched safely (96 of
    100 lengths under 40 MiB): a shape with no cap of its own had the probed cap. Its
    first cap is scaled now from the caps out of memory taught, by elements per row:
    down from a larger shape in proportion, up from a smaller one by the square (memory
    may grow so, as attention's), the larger of the two. No event tells of a guess; the
    shape's first batch to complete keeps it as the shape's own cap."""
    events = _CapChanges()
    caps = BatchCaps(128, events)
    assert caps.adapt(_ran(800, 128)) == [], "ran whole at the probed cap: kept there"
    assert caps.adapt(_ran(400, 100, failed=True)) == [((400,),)]
    assert caps.rows(((400,),)) == 50
    assert caps.rows(((500,),)) == 50 * 400 * 400 // (500 * 500) == 32, "up: by the square"
    assert caps.rows(((300,),)) == 50 * 400 // 300 == 66, "down: in proportion"
    assert caps.rows(((100,),)) == 128, "at most the probed cap"
    assert caps.rows(((700,),)) == 50 * 400 * 400 // (700 * 700) == 16
    assert caps.lowest == 50, "asked, a guess is not kept"
    assert caps.adapt(_ran(500, 32)) == [], "kept as it was: nothing moved"
    assert caps.lowest == 32, "kept, a guess is a cap in force"
    assert caps.adapt(_ran(800, 40, failed=True)) == [((800,),)]  # 20 rows
    assert caps.rows(((600,),)) == max(20 * 800 // 600, 50 * 400 * 400 // (600 * 600)) == 26
    assert caps.rows(((700,),)) == 20 * 800 // 700 == 22, "not kept: worked out again"
    assert caps.rows(((500,),)) == 32, "kept"
    assert [change[:3] for change in events.changes] == [
        (128, 50, "out_of_memory"),
        (128, 20, "out_of_memory"),
    ]


def test_a_shape_whose_rows_never_ran_keeps_no_cap_of_its_own() -> None:
    """A row too large even alone, of a new shape, failed DEVICE_MEMORY; its shape kept
    the guess its batch was priced at (1 row, scaled from a far narrower shape) as its
    own cap, though nothing of it ran: GetStats' batch_cap and the gauge read 1 for good
    (after ordinary traffic too), and told an operator to lower max_batch_size."""
    caps = BatchCaps(128, _CapChanges())
    caps.adapt(_ran(64, 128, failed=True))  # 64 rows of width 64
    huge = ((6 * 1024 * 1024,),)
    assert caps.rows(huge) == 1
    batch = Batch(1, (BatchSlice(0, "standard", 0, 1, 0),), 1, DispatchReason.FULL, 0.0, {}, huge)
    unfit = BatchResult(
        batch,
        None,
        None,
        0.001,
        failed_rows=(FailedRows(0, 1, DeviceMemoryError("row 0 does not fit")),),
        out_of_memory_runs=(OutOfMemoryRun(1, held_unfit_row=True),),
    )
    assert caps.adapt(unfit) == []
    assert caps.lowest == 64
    for _ in range(3):
        caps.adapt(_ran(64, 64))
    assert caps.lowest == 64
    assert caps.rows(huge) == 1, "still its guess when asked"


def test_shapes_keep_the_probed_cap_while_no_cap_says_what_fits() -> None:
    """Without an out-of-memory every shape has the probed cap, and so it has again once
    the only cap lowered recovered there: a cap at the probed cap says nothing of memory."""
    caps = BatchCaps(128, _CapChanges())
    for width in (2, 400, 100_000):
        assert caps.adapt(_ran(width, 128)) == []
        assert caps.rows(((width + 1,),)) == 128
    # A passing shortage (a batch of 40 rows, in 8-row requests, below the cap) halves the
    # cap and sets no ceiling: it recovers a step (8 rows) per CAP_RECOVERY_BATCHES.
    assert caps.adapt(_ran(400, 40, failed=True, piece_rows=8)) == [((400,),)]
    assert caps.rows(((400,),)) == 20
    while caps.rows(((400,),)) < 128:
        caps.adapt(_ran(400, caps.rows(((400,),))))
    assert caps.rows(((500,),)) == 128
    assert caps.lowest == 128


def test_a_guessed_cap_recovers_and_is_lowered_as_a_learned_one() -> None:
    """A guess moves as any cap: lowered by out of memory at its size, raised a step by
    CAP_RECOVERY_BATCHES full batches (each move reported), and once lowered it says
    what fits: new shapes are scaled from it."""
    events = _CapChanges()
    caps = BatchCaps(128, events)
    caps.adapt(_ran(400, 100, failed=True))  # 50 rows
    wide, wider = ((500,),), ((1000,),)
    assert caps.rows(wide) == 32
    assert caps.adapt(_ran(500, 32, failed=True)) == [wide]
    assert (caps.rows(wide), caps.lowest) == (16, 16)
    for _ in range(CAP_RECOVERY_BATCHES - 1):
        assert caps.adapt(_ran(500, 16)) == []
    assert caps.adapt(_ran(500, 16)) == [wide]
    assert (caps.rows(wide), caps.lowest) == (16 + 128 // 16, 24)
    assert [change[:3] for change in events.changes[1:]] == [
        (32, 16, "out_of_memory"),
        (16, 24, "recovered"),
    ]
    # Scaled up from the nearest learned below: 24 rows of width 500 (not 50 of 400).
    assert caps.rows(wider) == 24 * 500 * 500 // (1000 * 1000) == 6


def test_new_shapes_forget_no_learned_cap_and_move_few_caps_a_batch() -> None:
    """Asking the caps of new shapes (as their requests are admitted) keeps nothing:
    kept then, 1 023 new shapes pushed a learned cap out (logged as recovered, and back
    at the probed cap it failed again), and with more shapes queued than are kept every
    batch priced again ~1 000 of them. Kept as their batches complete, guesses count
    among the MAX_SIGNATURES caps kept, and one forgotten is told of by no event (none
    told of it): each batch moves at most the cap it forgets, here none (its guess again,
    from the same learned cap)."""
    events = _CapChanges()
    caps = BatchCaps(64, events)
    source = ((100,),)
    caps.adapt(_ran(100, 64, failed=True))  # 32 rows
    widths = range(201, 201 + 2 * MAX_SIGNATURES)
    for width in widths:  # all queued
        assert caps.rows(((width,),)) == max(1, 32 * 100 * 100 // (width * width))
    assert caps.rows(source) == 32
    assert caps.lowest == 32
    moved: list[Signature] = []
    for k, width in enumerate(widths):
        if k % 500 == 0:
            assert caps.adapt(_ran(100, 1)) == [], "run: kept"
        moved += caps.adapt(_ran(width, 1))
    assert moved == [], "forgotten guesses have the same guess again: their prices hold"
    assert caps.rows(source) == 32
    assert caps.lowest == 1, "kept guesses count"
    assert len(events.changes) == 1, "only the out-of-memory"


def test_a_shape_proven_at_the_probed_cap_keeps_it_after_another_runs_out() -> None:
    """Width 300 ran full batches at the probed cap; after width 400 ran out of memory
    at 100 rows (50 now), a guess cut it to 66 (~500 full batches to recover). A full
    batch that ran whole at the probed cap proves it: kept, not guessed. A batch not full
    proves nothing: its shape is guessed as a new one."""
    caps = BatchCaps(128, _CapChanges())
    proven, unproven = ((300,),), ((301,),)
    assert caps.adapt(_ran(300, 128)) == []
    assert caps.adapt(_ran(301, 64)) == []
    assert caps.adapt(_ran(400, 100, failed=True)) == [((400,),)]
    assert caps.rows(proven) == 128
    assert caps.rows(unproven) == 50 * 400 // 301 == 66
    assert caps.lowest == 50
    assert caps.adapt(_ran(300, 128, failed=True)) == [proven], "lowered as any cap"
    assert caps.rows(proven) == 64


def test_new_widths_after_one_runs_out_of_memory_batch_without_running_out(
    tmp_path: Path,
) -> None:
    """Served end to end under a memory limit, 8-row requests of ten widths, one after
    another (a row's memory grows with its width squared: 4 rows of width 1 000 fit
    18 MiB): each width ran out of memory once, split, before it batched at its own cap.
    Only the first does now; the others start at a cap scaled from its."""
    model = _outer_model(tmp_path / "outer.onnx")
    server = ServerProcess(
        [
            *("--model", str(model), "--port", "0", "--memory-limit", "18MiB"),
            *("--max-batch-size", "8", "--batch-cap", "8"),
        ]
    )
    widths = range(1000, 1100, 10)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port()}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            for width in widths:
                x = np.ones((8, width), np.float32)
                answer = stub.Infer(request(x, lane="bulk"), timeout=120)
                assert output(answer).tolist() == [float(width * width)] * 8
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    finally:
        server.close()
    assert stats.out_of_memory_events == 1, "width 1 000's batch of 8 alone"
    assert dict(stats.cap_changes) == {"out_of_memory": 1}
    assert stats.batch_cap < 4
