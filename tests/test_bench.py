"""The benchmark harness: a short run against live servers, the baselines' lifecycle,
and the pure pieces (stability, classification, request encoding, reports).

No timing assertions: the figures of these runs are meaningless on a shared machine;
what is checked is that every figure is there and every process is gone afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest

import laneserve.server.bench.cli as bench_cli
import laneserve.server.bench.run as bench_run
from laneserve.client.tensors import decode_tensor, encode_tensor
from laneserve.server.bench import (
    PROFILES,
    BenchSettings,
    loadgen,
    missing_keys,
    procs,
    run_bench,
)
from laneserve.server.bench.baselines import raw_ceiling
from laneserve.server.bench.cli import (
    _kinds,
    _scenarios,
    settings_from,
    stop_signals_interrupt,
    target_line,
)
from laneserve.server.bench.loadgen import (
    ClientPool,
    InputSpec,
    Job,
    PointRun,
    _Client,
    request_body,
    with_request_id,
)
from laneserve.server.bench.profiling import PySpy, summarize_collapsed
from laneserve.server.bench.report import (
    MEMORY_KEYS,
    evaluate_targets,
    render_markdown,
    verdict_text,
    write_outputs,
)
from laneserve.server.bench.run import get_stats
from laneserve.server.bench.settings import (
    BULK_SATURATION,
    BUSY_OTHER_CORES,
    MixStream,
    Point,
    Profile,
    Stream,
)
from laneserve.server.bench.summary import (
    CANCELLED_BEFORE_DEADLINE,
    OK,
    MergedWindow,
    StreamWindow,
    WindowReport,
    classify,
    client_cpu_fractions,
    dispatched_late,
    is_stable,
    merge_window,
    offer_problem,
    percentiles_ms,
    summarize_stream,
    unanswered_reason,
    worker_split,
)
from laneserve.server.cli import _parser
from laneserve.server.engine import Engine
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import REPO, estimate_once, refusing_port, run_text

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

# `laneserve bench` in a child process: exit status and stderr as a user sees them.
BENCH = [sys.executable, "-m", "laneserve.server.cli", "bench"]
BENCH_TIMEOUT_S = 120


def bench_refused(tmp_path: Path, *args: str) -> str:
    """Runs `laneserve bench ARGS` in `tmp_path`, which must refuse (exit 2) with one
    line and no traceback; its stderr."""
    done = run_text(
        [*BENCH, "--no-raw", "--no-plots", "--out", str(tmp_path / "out"), *args],
        timeout_s=BENCH_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def live_children() -> list[str]:
    """Processes this one started that are still running (zombies aside), except
    multiprocessing's resource tracker, which lives as long as its parent does."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Another process's arguments and name may be any bytes: a test's own are ASCII.
            stat = (entry / "stat").read_text(errors="replace")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if int(ppid) == os.getpid() and state != "Z" and "resource_tracker" not in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.mark.slow
def test_short_run_writes_well_formed_json_with_every_key(
    small_model: Path, tmp_path: Path
) -> None:
    settings = BenchSettings(
        profile=PROFILES["smoke"],
        out_dir=tmp_path / "results",
        model_path=str(small_model),
        configurations=("laneserve",),
        client_processes=2,  # (c) pins interactive and bulk to processes of their own
        channels_per_process=2,
        max_batch_size=16,
        command="test",
    )
    document = run_bench(settings)
    outputs = write_outputs(document, settings.out_dir, plots=True)

    written = json.loads(Path(outputs["json"]).read_text())
    assert missing_keys(written) == []
    assert written["primary"] == "laneserve"
    assert written["raw_ceiling"]["best_rows_per_s"] > 0
    assert set(written["raw_ceiling"]["rows_per_s_by_batch_rows"]) == {"1", "2", "4", "8", "16"}
    for scenario in ("a", "b", "c", "d"):
        assert written["scenarios"][scenario], f"scenario ({scenario}) has no point"
    names = [point["name"] for point in written["scenarios"]["c"]]
    assert names == [
        "interactive alone",
        "bulk alone, closed loop",
        "with bulk at 200% over InferStream",
        "with bulk at 200% over Infer",
        "with bulk at 200% over Infer, interactive on the priority port",
    ]
    bulk_over_stream = written["scenarios"]["c"][2]["lanes"]["bulk"]
    assert bulk_over_stream["ok"] > 0, "bulk items were answered over InferStream"
    on_priority_port = written["scenarios"]["c"][4]
    assert on_priority_port["streams"][0]["port"] == "priority"
    assert on_priority_port["lanes"]["interactive"]["ok"] > 0, "the priority port answered"
    deadlines = [point["streams"][0]["deadline_in"] for point in written["scenarios"]["d"]]
    assert deadlines == ["timeout_ms", "grpc", "timeout_ms"]
    assert written["scenarios"]["d"][2]["streams"][0]["port"] == "priority"
    saturation = written["scenarios"]["a"][0]
    assert saturation["lanes"]["single"]["ok"] > 0, "the server answered"
    assert saturation["server"]["batches"] > 0, "GetStats figures are there"
    assert saturation["workers"] is None, "laneserve does not name its process"
    assert written["capacity"]["throughput_per_s"] > 0
    threads = written["server_threads"]["threads"]
    assert threads, "the server's CPU by thread at the highest load of (a)"
    laneserve = written["configurations"]["laneserve"]
    assert laneserve["memory"]["measure"] == "PSS"
    assert laneserve["memory"]["peak_bytes"] > 0
    assert laneserve["memory_after_a"]["peak_bytes"] > 0, "sampled while (a) ran"
    assert laneserve["memory_after_a"]["unique_peak_bytes"] > 0, "smaps read while (a) ran"
    assert laneserve["memory_after_a"]["processes"] == laneserve["memory"]["processes"]
    assert {target["id"] for target in written["targets"]} >= {
        "echo_ratio",
        "vs_no_batching",
        "isolation_p99_stream",
        "isolation_p99_unary",
        "isolation_p99_unary_priority_port",
        "overload_expired_executed",
        "overload_goodput_timeout_ms_priority_port",
        "overload_expired_executed_priority_port",
    }
    report = Path(outputs["markdown"]).read_text()
    assert "## Targets (issue 6)" in report
    assert "## (d)" in report
    assert "| unique: peak during (a) |" in report
    assert "| peak during (a) |" in report
    assert live_children() == [], "no server or client process is left"


@pytest.mark.slow
def test_a_mix_runs_against_a_target_and_its_priority_port(
    small_model: Path, tmp_path: Path
) -> None:
    """`--target` with `--target-priority` and `--mix`: the streams run together as one
    point of scenario (x) after (a), whose capacity resolves a rate given in %."""
    deployment = procs.start_laneserve(
        str(small_model), max_batch_size=16, intra_op_threads=1, device="cpu"
    )
    try:
        assert deployment.priority_target is not None
        settings = BenchSettings(
            profile=PROFILES["smoke"],
            out_dir=tmp_path / "results",
            target=deployment.target,
            target_priority=deployment.priority_target,
            scenarios=("x",),
            mix=(
                MixStream.parse("lane=interactive,rate=5%,deadline_ms=500,port=priority"),
                MixStream.parse("lane=bulk,rows=4,callers=2,via=stream"),
            ),
            client_processes=1,
            channels_per_process=1,
            command="test",
        )
        unknown_lane = dataclasses.replace(settings, mix=(MixStream.parse("lane=gold,rate=5"),))
        with pytest.raises(ValueError, match=r"lane 'gold' is not served by target; expected"):
            run_bench(unknown_lane)
        no_priority = dataclasses.replace(settings, target_priority=None)
        with pytest.raises(ValueError, match=r"port=priority, but target has no priority port"):
            run_bench(no_priority)
        document = run_bench(settings)
    finally:
        deployment.stop()
    assert [point["name"] for point in document["scenarios"]["a"]] == ["c=2"], "(a) ran first"
    (mix,) = document["scenarios"]["x"]
    interactive, bulk = mix["lanes"]["interactive"], mix["lanes"]["bulk"]
    capacity = document["capacity"]["throughput_per_s"]
    assert interactive["offered_rate_per_s"] == pytest.approx(0.05 * capacity)
    assert mix["streams"][0]["port"] == "priority"
    assert interactive["ok"] > 0, "the priority port answered"
    assert bulk["ok"] > 0, "bulk items were answered over InferStream"
    assert document["settings"]["mix"][1] == "lane=bulk,rows=4,callers=2,via=stream"
    outputs = write_outputs(document, settings.out_dir, plots=False)
    assert missing_keys(json.loads(Path(outputs["json"]).read_text())) == []
    report = Path(outputs["markdown"]).read_text()
    assert "## (x) the given mix of streams (--mix)" in report
    assert "| target | bulk (4 rows, bulk) | 2 callers |" in report
    assert live_children() == []


@pytest.mark.slow
def test_a_laneserve_started_with_an_http_port_has_it_as_its_http_target(
    small_model: Path,
) -> None:
    """`--http-port 0`: the ready line names the port bound ("HTTP port N"), kept as
    the deployment's http_target, which answers KServe's readiness probe; started
    without the flag, it has none (its ready line read all the same: a priority port)."""

    def start(*extra_args: str) -> procs.Deployment:
        return procs.start_laneserve(
            str(small_model),
            max_batch_size=8,
            intra_op_threads=1,
            device="cpu",
            extra_args=extra_args,
        )

    with_http = start("--http-port", "0")
    try:
        assert with_http.http_target is not None
        host, _, port = with_http.http_target.rpartition(":")
        probe = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            probe.request("GET", "/v2/health/ready")
            answer = probe.getresponse()
            assert (answer.status, json.loads(answer.read())) == (200, {"ready": True})
        finally:
            probe.close()
    finally:
        with_http.stop()
    without_http = start()
    try:
        assert without_http.priority_target is not None
        assert without_http.http_target is None
    finally:
        without_http.stop()
    assert live_children() == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["echo", "no-batching", "workers"])
def test_baselines_start_answer_and_stop_cleanly(small_model: Path, kind: str) -> None:
    model = str(small_model)
    if kind == "echo":
        deployment = procs.start_echo(model, device="cpu")
    elif kind == "no-batching":
        deployment = procs.start_no_batching(model, threads=2, intra_op_threads=1, device="cpu")
    else:
        deployment = procs.start_workers(model, workers=2, intra_op_threads=1, device="cpu")
    try:
        assert len(deployment.processes) == (2 if kind == "workers" else 1)
        with grpc.insecure_channel(deployment.target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            rows = np.ones((3, 512), dtype=np.float32)
            response = stub.Infer(
                pb.InferRequest(request_id="r", inputs=[encode_tensor("input", rows)]),
                timeout=30,
            )
            model_info = stub.GetModel(pb.GetModelRequest(), timeout=30)
            if kind != "echo":  # (c) sends its bulk over InferStream to them too
                items = [
                    pb.InferRequest(request_id="s1", inputs=[encode_tensor("input", rows)]),
                    pb.InferRequest(
                        request_id="s2",
                        inputs=[encode_tensor("input", np.ones((1, 7), dtype=np.float32))],
                    ),
                ]
                answers = {
                    answer.request_id: answer
                    for answer in stub.InferStream(iter(items), timeout=30)
                }
                assert decode_tensor(answers["s1"].response.outputs[0]).shape == (3, 10)
                invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert answers["s2"].error.code == invalid, "an item's error ends only it"
        assert decode_tensor(response.outputs[0]).shape == (3, 10)
        assert [spec.name for spec in model_info.inputs] == ["input"]
        assert get_stats(deployment.target) is None, "a baseline keeps no statistics"
        memory = deployment.memory()
        assert memory["processes"] == len(deployment.processes)
        assert memory["measure"] == "PSS"
        assert memory["bytes"] > 0
        assert memory["unique_bytes"] > 0
    finally:
        codes = deployment.stop()
    assert codes == [0] * len(deployment.processes), "each stopped on SIGTERM, exit 0"
    assert live_children() == []


@pytest.mark.slow
def test_the_calls_each_of_n_workers_answered_are_counted(small_model: Path) -> None:
    """SO_REUSEPORT hashes each client connection to one worker (3/5, 7/1, 6/2 seen over
    8 connections), and the report could not say how the load was split."""
    deployment = procs.start_workers(str(small_model), workers=2, intra_op_threads=1, device="cpu")
    try:
        with ClientPool(processes=1, channels=4) as pool:
            run = pool.run_point(
                deployment.target,
                [Stream("single", concurrency=4)],
                [InputSpec("input", "<f4", (512,))],
                profile=PROFILES["smoke"],
                judge=lambda _windows: False,
            )
        pids = [process.pid for process in deployment.processes]
    finally:
        deployment.stop()
    split = worker_split(run.used, pids)
    assert split is not None
    assert [(worker["worker"], worker["pid"]) for worker in split] == [(0, pids[0]), (1, pids[1])]
    assert sum(worker["connections"] for worker in split) == 4, "each connection on one worker"
    ok = sum(window.streams["single"].outcomes[OK] for window in run.used)
    assert ok > 0
    assert sum(worker["ok"] for worker in split) == ok, "every OK answer counted once"
    assert worker_split(run.used[:0], pids) is None, "no window, nothing to split"
    assert live_children() == []


def test_the_report_shows_how_the_workers_shared_the_load() -> None:
    document = empty_document()
    document["configurations"]["workers-2"] = {"kind": "workers", "memory": None}
    record = StreamWindow(sent=800, ok_latency_s=[0.01] * 800, ok_batch_rows=[1] * 800)
    record.outcomes.update({OK: 800})
    point = point_of("a", "c=64", Stream("single", concurrency=64), record)
    point["configuration"] = "workers-2"
    point["workers"] = [
        {"worker": 0, "pid": 11, "connections": 3, "ok": 300, "ok_share": 0.375},
        {"worker": 1, "pid": 12, "connections": 5, "ok": 500, "ok_share": 0.625},
    ]
    document["scenarios"]["a"].append(point)
    report = render_markdown(document)
    assert "## N workers: how SO_REUSEPORT shared the load out" in report
    assert "| workers-2 | (a) c=64 | w0: 3 conn, 300 OK (38%); w1: 5 conn, 500 OK (62%) |" in report


def test_raw_ceiling_measures_every_power_of_two_and_the_cap(small_model: Path) -> None:
    engine = Engine(str(small_model), device="cpu", intra_op_threads=1, estimate=estimate_once)
    result = raw_ceiling(engine, max_batch_size=12, seconds_per_size=0.001)
    by_size = result["rows_per_s_by_batch_rows"]
    assert isinstance(by_size, dict)
    assert list(by_size) == ["1", "2", "4", "8", "12"]
    assert result["best_rows_per_s"] == max(by_size.values())


def test_stability_needs_every_stream_to_agree_within_tolerance() -> None:
    def window(throughput: float, p50_ms: float | None) -> dict[str, dict[str, float | None]]:
        return {"s": {"throughput_per_s": throughput, "p50_ms": p50_ms}}

    assert is_stable([window(100, 5.0), window(105, 5.2)], count=2, tolerance=0.1)
    assert is_stable([window(100, 5.0), window(110, 5.5)], count=2, tolerance=0.1)
    assert not is_stable([window(100, 5.0), window(130, 5.0)], count=2, tolerance=0.1)
    assert not is_stable([window(100, 5.0), window(100, 8.0)], count=2, tolerance=0.1)
    assert not is_stable([window(100, 5.0)], count=2, tolerance=0.1), "too few windows"
    # Too few samples for a median: throughput alone decides.
    assert is_stable([window(100, None), window(101, 9.0)], count=2, tolerance=0.1)
    assert is_stable([window(500, 1.0), window(100, 5.0), window(104, 5.1)], count=2, tolerance=0.1)


def test_stability_bounds_the_spread_by_the_smallest_window_and_needs_answers() -> None:
    """Spread against the mean let two windows 22 % apart pass a 10 % rule; a point
    where every request failed (no OK answer in any window) passed as stable."""

    def window(throughput: float, p50_ms: float | None) -> dict[str, dict[str, float | None]]:
        return {"s": {"throughput_per_s": throughput, "p50_ms": p50_ms}}

    assert not is_stable([window(1000, 5.0), window(1220, 5.0)], count=2, tolerance=0.1)
    assert not is_stable([window(1000, 5.0), window(1000, 6.1)], count=2, tolerance=0.1)
    assert not is_stable([window(0.0, None), window(0.0, None)], count=2, tolerance=0.1)
    assert not is_stable([window(0.0, None), window(50.0, 5.0)], count=2, tolerance=0.1)


def test_client_cpu_is_summed_over_windows_before_dividing() -> None:
    """A late client catches up through windows of milliseconds, whose own ratio is
    noise; over the run its share of a core is what it used over how long it ran."""

    def window(index: int, **cpu_and_wall_s: tuple[float, float]) -> MergedWindow:
        reports = [
            WindowReport(worker=int(name[1:]), window=index, streams={}, wall_s=wall_s, cpu_s=cpu_s)
            for name, (cpu_s, wall_s) in cpu_and_wall_s.items()
        ]
        return merge_window(reports)

    windows = [window(0, w0=(0.5, 1.0), w1=(0.9, 1.0)), window(1, w0=(0.005, 0.001), w1=(0.9, 1.0))]
    assert client_cpu_fractions(windows) == pytest.approx([0.505 / 1.001, 0.9])


def test_outcomes_are_classified_by_reason() -> None:
    groups = classify(
        {
            OK: 10,
            "LANE_FULL": 3,
            "DEADLINE_UNMEETABLE": 2,
            "EXPIRED_IN_QUEUE": 4,
            "DEADLINE_EXCEEDED": 1,
            "CANCELLED": 1,
            "ENGINE_FAILURE": 5,
        }
    )
    assert groups == {
        "rejected": {"DEADLINE_UNMEETABLE": 2, "LANE_FULL": 3},
        "shed": {"EXPIRED_IN_QUEUE": 4},
        "timed_out": {"CANCELLED": 1, "DEADLINE_EXCEEDED": 1},
        "failed": {"ENGINE_FAILURE": 5},
    }


def test_a_refusal_under_memory_pressure_counts_as_rejected() -> None:
    """laneserve refuses new work at admission above its memory watermark (MEMORY_PRESSURE,
    retry after pushback) and counts it as rejected; the harness called it failed."""
    assert classify({"MEMORY_PRESSURE": 2})["rejected"] == {"MEMORY_PRESSURE": 2}


def test_stream_summary_counts_goodput_within_the_deadline() -> None:
    stream = Stream("d", rate_per_s=3.0, deadline_ms=100)
    record = StreamWindow(
        sent=6,
        ok_latency_s=[0.01, 0.02, 0.5],
        ok_batch_rows=[4, 4, 8],
        ok_queue_us=[100, 200, 150_000],
        late_ok=1,
        expired_executed=1,
    )
    record.outcomes.update({OK: 3, "LANE_FULL": 2, "EXPIRED_IN_QUEUE": 1})
    summary = summarize_stream(stream, record, duration_s=2.0, window_s=1.0)
    assert summary["throughput_per_s"] == 1.5
    assert summary["goodput_per_s"] == 1.0
    assert summary["rejected"] == {"LANE_FULL": 2}
    assert summary["shed"] == {"EXPIRED_IN_QUEUE": 1}
    assert summary["batch_rows"]["histogram"] == {"4": 2, "8": 1}
    assert summary["latency"]["count"] == 3
    assert summary["achieved_rate_per_s"] == 3.0
    assert summary["valid"] is True
    assert summary["expired_executed"] == 1
    assert percentiles_ms([])["p99_ms"] is None


def test_streams_are_shared_out_over_client_processes() -> None:
    closed = Stream("c", concurrency=5)
    assert [closed.share(index, 3) for index in range(3)] == [(2, 0.0), (2, 0.0), (1, 0.0)]
    assert Stream("c", concurrency=1).share(1, 2) == (0, 0.0), "a process may get no caller"
    assert Stream("o", rate_per_s=90.0).share(2, 3) == (0, 30.0)
    pinned = Stream("p", rate_per_s=90.0, client=1)
    assert [pinned.share(index, 3) for index in range(3)] == [(0, 0.0), (0, 90.0), (0, 0.0)]
    assert Stream("q", concurrency=4, client=3).share(1, 2) == (4, 0.0), "modulo the pool"
    with pytest.raises(ValueError, match="exactly one of concurrency"):
        Stream("bad")
    with pytest.raises(ValueError, match="exactly one of concurrency"):
        Stream("bad", concurrency=2, rate_per_s=1.0)


def test_prebuilt_request_gets_its_id_by_concatenation() -> None:
    stream = Stream("s", lane="bulk", rows=3, rate_per_s=1.0, deadline_ms=250)
    body = request_body(stream, [InputSpec("input", "<f4", (512,))], np.random.default_rng(1))
    request = pb.InferRequest.FromString(with_request_id(body, "abc-1-42"))
    assert request.request_id == "abc-1-42"
    assert request.lane == "bulk"
    assert request.timeout_ms == 250
    assert decode_tensor(request.inputs[0]).shape == (3, 512)
    grpc_deadline = Stream("s", rate_per_s=1.0, deadline_ms=250, deadline_in="grpc")
    assert grpc_deadline.timeout_ms == 0
    assert grpc_deadline.call_timeout_s == 0.25


def test_collapsed_stacks_are_summarized_by_thread_and_function() -> None:
    text = (
        "thread (1): MainThread;run (asyncio/runners.py:1);Infer (server/service.py:10) 6\n"
        "thread (1): MainThread;run (asyncio/runners.py:1);Infer (server/service.py:12) 2\n"
        "thread (2): laneserve-engine;run (server/engine.py:3);Session.run (ort.py:9) 2\n"
    )
    summary = summarize_collapsed(text)
    assert summary["samples"] == 10
    assert summary["by_thread"] == {
        "thread (1): MainThread": 0.8,
        "thread (2): laneserve-engine": 0.2,
    }
    assert summary["top_self"][0] == {
        "frame": "Infer (server/service.py)",
        "samples": 8,
        "fraction": 0.8,
    }
    inclusive = {entry["frame"] for entry in summary["top_inclusive"]}
    assert inclusive == {"Infer (server/service.py)", "run (server/engine.py)"}


def test_command_line_parses_bench_options() -> None:
    options = "--profile smoke --configs laneserve,echo --scenarios ad --concurrencies 1,128"
    args = _parser().parse_args(["bench", *options.split()])
    assert args.command == "bench"
    assert settings_from(args, []).profile.concurrencies == (1, 128)
    assert args.configs == ("laneserve", "echo")
    assert args.scenarios == ("a", "d")
    assert _kinds("workers,laneserve") == ("laneserve", "workers")
    assert _scenarios("b,c") == ("b", "c")
    with pytest.raises(Exception, match="unknown configuration"):
        _kinds("laneserve,triton")


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--seed", "-1", "expected an integer >= 0, got '-1'"),
        ("--seed", "1.5", "expected an integer >= 0, got '1.5'"),
        ("--no-batching-threads", "0", "expected an integer >= 1, got '0'"),
        ("--client-procs", "0", "expected an integer >= 1, got '0'"),
        ("--channels", "-2", "expected an integer >= 1, got '-2'"),
        ("--max-batch-size", "0", "expected an integer in [1, 4294967295], got '0'"),
        ("--max-batch-size", "4294967296", "expected an integer in [1, 4294967295]"),
        ("--intra-op-threads", "-1", "expected an integer in [0, 1024], got '-1'"),
        ("--max-windows", "1", "expected an integer >= 2, got '1'"),
        ("--window-s", "nan", "expected seconds > 0 and at most 3600, got 'nan'"),
        ("--window-s", "0", "expected seconds > 0 and at most 3600, got '0'"),
        ("--window-s", "inf", "expected seconds > 0 and at most 3600, got 'inf'"),
        ("--warmup-s", "-0.5", "expected seconds >= 0 and at most 3600, got '-0.5'"),
        ("--warmup-s", "x", "expected seconds >= 0 and at most 3600, got 'x'"),
        ("--concurrencies", "0", "expected positive integers like 2,4; got '0'"),
        ("--workers", "2,-4", "expected positive integers like 2,4; got '2,-4'"),
    ],
)
def test_a_bad_numeric_flag_is_refused_while_parsing_naming_it(
    flag: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--seed -1 and --no-batching-threads 0 died in the client or server processes the
    run had started, --window-s nan as "cannot convert float NaN to integer"."""
    with pytest.raises(SystemExit) as refused:
        _parser().parse_args(["bench", f"{flag}={value}"])
    assert refused.value.code == 2
    assert f"argument {flag}: {expected}" in capsys.readouterr().err


def test_max_windows_below_the_profiles_stable_windows_is_refused_naming_the_flag() -> None:
    args = _parser().parse_args(["bench", "--profile", "full", "--max-windows", "2"])
    with pytest.raises(ValueError, match=r"^--max-windows: expected at least 3 \(the windows"):
        settings_from(args, [])
    with pytest.raises(ValueError, match=r"expected warmup_s in \[0, 3600\], window_s"):
        dataclasses.replace(PROFILES["smoke"], window_s=float("nan"))


def test_a_bad_flag_value_is_refused_before_anything_starts(tmp_path: Path) -> None:
    stderr = bench_refused(tmp_path, "--configs", "laneserve", "--seed", "-1")
    assert "laneserve bench: error: argument --seed: expected an integer >= 0" in stderr
    assert not (tmp_path / "models").exists(), "the demo model was not even written"
    model_dir = tmp_path / "model.onnx"
    model_dir.mkdir()
    stderr = bench_refused(tmp_path, "--model", str(model_dir), "--configs", "laneserve")
    assert stderr == (
        f"laneserve bench: --model {model_dir}: is a directory; expected an ONNX model file\n"
    )


def test_mix_streams_become_the_streams_of_one_point() -> None:
    interactive = MixStream.parse("lane=interactive,rate=10%,deadline_ms=50,port=priority")
    assert interactive.capacity_share == pytest.approx(0.1)
    resolved = interactive.stream(capacity_per_s=3000.0)
    assert (resolved.label, resolved.lane, resolved.port) == (
        "interactive",
        "interactive",
        "priority",
    )
    assert resolved.rate_per_s == pytest.approx(300.0)
    assert (resolved.deadline_ms, resolved.timeout_ms) == (50, 50)
    # A share is of the capacity in rows: 8-row requests at 200 % of 3 000 rows/s.
    bulk = MixStream.parse("lane=bulk,rows=8,rate=200%,via=stream,client=0")
    assert bulk.stream(capacity_per_s=3000.0).rate_per_s == pytest.approx(750.0)
    closed = MixStream.parse("label=batch,rows=64,callers=4,deadline_ms=900,deadline_in=grpc")
    stream = closed.stream(capacity_per_s=None)
    assert (stream.label, stream.lane, stream.mode, stream.concurrency) == (
        "batch",
        "",
        "closed",
        4,
    )
    assert stream.call_timeout_s == pytest.approx(0.9), "a gRPC deadline alone"
    assert MixStream.parse("rate=250").stream(capacity_per_s=None).rate_per_s == 250.0
    with pytest.raises(ValueError, match="needs scenario"):
        bulk.stream(capacity_per_s=None)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lane=bulk", "expected exactly one of callers=N (closed loop) or rate=R"),
        ("rate=5,callers=3", "expected exactly one of callers=N"),
        ("rate=x", "rate='x'; expected a positive number (per s) or N%"),
        ("rate=-3", "rate='-3'; expected a positive number"),
        ("rate=0%", "rate_per_s > 0"),
        ("callers=2.5", "callers='2.5'; expected an integer"),
        ("rows=0,rate=3", "rows must be >= 1, got 0"),
        ("via=ws,rate=1", "via='ws'; expected one of ['unary', 'stream']"),
        ("port=side,rate=1", "port='side'; expected one of ['main', 'priority']"),
        ("rate=1,colour=red", "unknown key 'colour'; expected some of ['label', 'lane'"),
        ("rate=1,rate=2", "rate given twice"),
        ("rate", "expected key=value, got 'rate'"),
        ("rate=1,deadline_ms=0", "deadline_ms must be >= 1, got 0"),
    ],
)
def test_a_wrong_mix_stream_is_refused_naming_what_was_expected(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        MixStream.parse(spec)
    assert str(refused.value).startswith(f"--mix {spec!r}: ")


def test_command_line_mix_runs_scenario_x_with_distinct_labels() -> None:
    options = ["--mix", "lane=bulk,rate=10", "--mix", "lane=bulk,rows=8,callers=2"]
    args = _parser().parse_args(["bench", "--target", "127.0.0.1:1", *options])
    settings = settings_from(args, [])
    assert settings.scenarios == ("x",), "a mix alone runs only the mix"
    assert [mix.label for mix in settings.mix] == ["bulk", "bulk-2"]
    clash = [
        "--mix",
        "lane=bulk,rate=1",
        "--mix",
        "lane=bulk,rate=2",
        "--mix",
        "label=bulk-2,rate=3",
    ]
    labels = [mix.label for mix in settings_from(_parser().parse_args(["bench", *clash]), []).mix]
    assert labels == ["bulk", "bulk-3", "bulk-2"], "a generated label never takes a given one"
    both = _parser().parse_args(["bench", "--scenarios", "ax", *options])
    assert settings_from(both, []).scenarios == ("a", "x")
    assert settings_from(_parser().parse_args(["bench"]), []).scenarios == ("a", "b", "c", "d")
    with pytest.raises(SystemExit):  # argparse prints the parser's message
        _parser().parse_args(["bench", "--mix", "lane=bulk"])
    with pytest.raises(ValueError, match="scenario x offers the streams of --mix; none"):
        settings_from(_parser().parse_args(["bench", "--scenarios", "x"]), [])
    with pytest.raises(ValueError, match="--target-priority names the priority port of a"):
        settings_from(_parser().parse_args(["bench", "--target-priority", "h:1"]), [])


def empty_document() -> dict[str, Any]:
    """A document of a run that measured nothing, as run_bench builds it."""
    return {
        "schema": "laneserve.bench/1",
        "created_utc": "",
        "command": "laneserve bench",
        "profile": {
            "name": "smoke",
            "window_s": 0.3,
            "warmup_s": 0.1,
            "stable_windows": 2,
            "tolerance": 0.5,
            "max_windows": 2,
        },
        "settings": {"client_processes": 1, "channels_per_process": 1},
        "environment": {
            "cpu_count": 2,
            "platform": "linux",
            "python": "3.11",
            "versions": {},
            "loadavg_start": [0.0, 0.0, 0.0],
            "loadavg_end": None,
        },
        "model": {"path": "m.onnx"},
        "primary": "laneserve",
        "capacity": None,
        "raw_ceiling": None,
        "configurations": {
            "laneserve": {"kind": "laneserve", "memory_after_a": None, "memory": None}
        },
        "scenarios": {"a": [], "b": [], "c": [], "d": []},
        "server_profile": None,
        "server_threads": None,
        "targets": [],
        "warnings": [],
        "outputs": {},
        "duration_s": 0.0,
    }


def test_report_of_a_run_without_baselines_says_not_measured() -> None:
    document = empty_document()
    targets = evaluate_targets(document)
    assert all(target["met"] is None for target in targets)
    assert missing_keys(document) == []
    assert "not measured" in render_markdown(document)


def memory(
    processes: int, peak_mib: int, measure: str = "PSS", unique_mib: int | None = None
) -> dict[str, Any]:
    peak = peak_mib * 2**20
    unique = None if unique_mib is None else unique_mib * 2**20
    return {
        "unique_bytes": unique,
        "unique_peak_bytes": unique,
        "measure": measure,
        "note": None,
        "processes": processes,
        "bytes": peak,
        "peak_bytes": peak,
        "samples": 3,
        "by_process": [],
    }


def test_memory_target_compares_the_peaks_after_scenario_a() -> None:
    document = empty_document()
    # laneserve's peak at the end (after the overloads of (b)-(d)) would miss the target.
    document["configurations"] = {
        "laneserve": {
            "kind": "laneserve",
            "memory_after_a": memory(1, 100),
            "memory": memory(1, 400),
        },
        "workers-2": {
            "kind": "workers",
            "memory_after_a": memory(2, 250),
            "memory": memory(2, 260),
        },
        # A document written before the peak after (a) was recorded.
        "workers-4": {"kind": "workers", "memory": memory(4, 500)},
        # Resident sets are not comparable with laneserve's PSS.
        "workers-8": {"kind": "workers", "memory_after_a": memory(8, 900, "RSS")},
    }
    targets = {target["id"]: target for target in evaluate_targets(document)}
    assert targets["workers-2_memory"]["met"] is True
    assert (
        targets["workers-2_memory"]["measured"] == "2.50x (250 MiB vs 100 MiB, PSS peak during (a))"
    )
    assert targets["workers-4_memory"]["met"] is None
    assert targets["workers-4_memory"]["measured"] == "not measured"
    assert targets["workers-8_memory"]["met"] is None
    report = render_markdown(document)
    assert "| laneserve | 1 | - | - | - | PSS | 100 MiB | 400 MiB | 400 MiB |" in report
    assert "| workers-4 | 4 | - | - | - | PSS | - | 500 MiB | 500 MiB |" in report
    assert "compares the peak during (a)" in report
    assert missing_keys(document) == []
    del document["configurations"]["workers-2"]["memory"]["unique_peak_bytes"]
    assert missing_keys(document) == ["configurations.workers-2.memory.unique_peak_bytes"]


def test_memory_target_reads_the_unique_peaks_with_pss_beside() -> None:
    document = empty_document()
    document["configurations"] = {
        "laneserve": {
            "kind": "laneserve",
            "memory_after_a": memory(1, 100, unique_mib=120),
            "memory": memory(1, 400, unique_mib=420),
        },
        "workers-2": {
            "kind": "workers",
            "memory_after_a": memory(2, 230, unique_mib=228),
            "memory": memory(2, 260, unique_mib=250),
        },
        # smaps unreadable for one of its processes: PSS on both is compared instead.
        "workers-4": {"kind": "workers", "memory_after_a": memory(4, 300)},
    }
    targets = {target["id"]: target for target in evaluate_targets(document)}
    assert targets["workers-2_memory"]["met"] is False, "2.30x by PSS, 1.90x by unique"
    assert targets["workers-2_memory"]["measured"] == (
        "1.90x (228 MiB vs 120 MiB, unique peak during (a); by PSS 2.30x)"
    )
    assert "each resident page" in targets["workers-2_memory"]["description"]
    assert targets["workers-4_memory"]["met"] is True
    assert (
        targets["workers-4_memory"]["measured"] == "3.00x (300 MiB vs 100 MiB, PSS peak during (a))"
    )
    assert "(PSS, summed)" in targets["workers-4_memory"]["description"]
    report = render_markdown(document)
    assert (
        "| laneserve | 1 | 120 MiB | 420 MiB | 420 MiB | PSS | 100 MiB | 400 MiB | 400 MiB |"
        in report
    )
    assert missing_keys(document) == []


# ---- the measurement defects a review found, one test each -------------------------


def open_loop_client(stream: Stream) -> _Client:
    """A client process's state for one open-loop stream, without a process or channels:
    its calls are replaced by the test."""
    job = Job(
        target="unused",
        priority_target=None,
        streams=(stream,),
        callers=(0,),
        rates_per_s=(stream.rate_per_s,),
        inputs=(InputSpec("input", "<f4", (4,)),),
        warmup_s=0.0,
        window_s=1.0,
        max_windows=1,
        channels=1,
        seed=0,
    )
    # The queues and the stop event belong to the process loop, which these tests skip.
    client = _Client(0, job, cast("Any", None), cast("Any", None), cast("Any", None))
    client.calls = [cast("Any", None)]
    client.verified = [True]
    return client


def answer(reply: pb.InferResponse | str) -> Any:
    async def unary(_call: Any, _payload: bytes, _timeout_s: float) -> pb.InferResponse | str:
        return reply

    return unary


def test_an_answer_that_ran_after_its_deadline_counts_as_expired_executed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its queue time at the server (1 ms) is short, but 300 ms went by between the
    scheduled send and the run (gRPC's queue, decoding, client lag): it ran after its
    100 ms deadline, which only the client can see."""
    assert dispatched_late(0.300, 5_000, 0.100)
    assert not dispatched_late(0.104, 5_000, 0.100), "99 ms before the run: in time"
    late = pb.InferResponse(timing=pb.Timing(batch_size=4, queue_us=1_000, infer_us=5_000))
    for deadline_in in ("timeout_ms", "grpc"):
        stream = Stream("default", rate_per_s=1.0, deadline_ms=100, deadline_in=deadline_in)
        client = open_loop_client(stream)
        monkeypatch.setattr(client, "_unary", answer(late))
        asyncio.run(client._call(0, 0, time.monotonic() - 0.3))
        record = client.records[0]
        assert record.late_ok == 1
        summary = summarize_stream(stream, record, 1.0, window_s=1.0)
        if deadline_in == "timeout_ms":
            assert record.expired_executed == 1
            assert summary["expired_executed"] == 1
        else:  # the client cancels at a gRPC deadline: a late run is never seen
            assert summary["expired_executed"] is None


def test_expired_executed_cannot_be_measured_under_a_grpc_deadline() -> None:
    document = empty_document()
    document["capacity"] = {"throughput_per_s": 100.0}
    for deadline_in in ("timeout_ms", "grpc"):
        stream = Stream("default", rate_per_s=300.0, deadline_ms=100, deadline_in=deadline_in)
        record = StreamWindow(sent=600, ok_latency_s=[0.01] * 180, ok_batch_rows=[4] * 180)
        record.outcomes.update({OK: 180})
        document["scenarios"]["d"].append(point_of("d", f"300%, {deadline_in}", stream, record))
    targets = [t for t in evaluate_targets(document) if t["id"].startswith("overload_")]
    assert [t["id"] for t in targets] == [
        "overload_goodput_timeout_ms",
        "overload_expired_executed",
        "overload_goodput_grpc",
    ], "the expired-executed verdict comes from the timeout_ms point alone"
    report = render_markdown(document)
    assert "| 0 | 0 | - / - / - |" in report, "timeout_ms: none late, none expired, no lag"
    assert "| 0 | - (not seen) | - / - / - |" in report, "gRPC deadline: not measurable"


def test_client_lag_is_recorded_for_every_request_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Stream("default", rate_per_s=1.0, deadline_ms=100)
    client = open_loop_client(stream)
    monkeypatch.setattr(client, "_unary", answer("EXPIRED_IN_QUEUE"))
    asyncio.run(client._call(0, 0, time.monotonic() - 0.5))
    monkeypatch.setattr(client, "_unary", answer(pb.InferResponse(timing=pb.Timing())))
    asyncio.run(client._call(0, 0, time.monotonic() - 0.001))
    record = client.records[0]
    assert record.sent == 2
    assert len(record.lag_s) == 2, "the shed request's lag counts too"
    assert max(record.lag_s) >= 0.5


def test_a_bare_cancelled_long_before_the_deadline_counts_as_refused_not_timed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC's core refuses a call laneserve never saw (max_pending_calls) with a bare
    CANCELLED, at once: in a quick run 1 010 of one (b) point's calls, under a 60 s gRPC
    deadline, were reported as timed out (and left out of the (c) table altogether)."""
    stream = Stream("default", rate_per_s=1.0)  # no deadline: a 60 s gRPC deadline
    client = open_loop_client(stream)
    monkeypatch.setattr(client, "_unary", answer("CANCELLED"))
    asyncio.run(client._call(0, 0, time.monotonic()))
    summary = summarize_stream(stream, client.records[0], 1.0, window_s=1.0)
    assert summary["timed_out"] == {}
    assert summary["rejected"] == {CANCELLED_BEFORE_DEADLINE: 1}
    # At its deadline it is a timeout: the server's core timed the deadline out first.
    assert unanswered_reason("CANCELLED", 0.099, 0.1) == "CANCELLED"
    assert unanswered_reason("CANCELLED", 0.002, 0.1) == CANCELLED_BEFORE_DEADLINE
    assert unanswered_reason("DEADLINE_EXCEEDED", 0.002, 0.1) == "DEADLINE_EXCEEDED"
    assert unanswered_reason("LANE_FULL", 0.002, 0.1) == "LANE_FULL"


def test_arrivals_the_client_could_not_send_are_neither_sent_nor_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loadgen, "MAX_OUTSTANDING", 3)
    stream = Stream("default", rate_per_s=100.0, deadline_ms=100)
    client = open_loop_client(stream)

    async def never_answered(_call: Any, _payload: bytes, _timeout_s: float) -> str:
        await asyncio.Event().wait()
        return "UNREACHABLE"

    monkeypatch.setattr(client, "_unary", never_answered)

    async def offer_a_second_at_once() -> None:
        arrivals = asyncio.create_task(client._arrivals(0, time.monotonic() - 1.0, 100.0))
        for _ in range(5):
            await asyncio.sleep(0)
        client.stopping = True
        for task in (arrivals, *client.in_flight):
            task.cancel()
        await asyncio.gather(arrivals, *client.in_flight, return_exceptions=True)

    asyncio.run(offer_a_second_at_once())
    record = client.records[0]
    assert record.sent == 3, "only MAX_OUTSTANDING requests went out"
    assert record.client_backlog > 50
    assert sum(record.outcomes.values()) == 0
    summary = summarize_stream(stream, record, 1.0, window_s=1.0)
    assert (summary["sent"], summary["answered"], summary["failed"]) == (3, 0, {})
    assert summary["client_backlog"] == record.client_backlog
    assert summary["achieved_rate_per_s"] == 3.0
    assert summary["valid"] is False
    # Held back because the server held MAX_OUTSTANDING calls: not the generator's limit;
    # the sends it made late are.
    assert summary["invalid_reason"].startswith("client lag p95")
    # The reports say so: their "under 95 % of the offered rate" read as sent/s alone.
    document = empty_document()
    for scenario, label in (("b", "single"), ("d", "default")):
        labelled = dataclasses.replace(stream, label=label)
        document["scenarios"][scenario].append(point_of(scenario, "p", labelled, record))
    assert render_markdown(document).count("with the arrivals held back as client backlog") == 2


def test_a_point_the_load_generator_could_not_offer_is_not_valid() -> None:
    stream = Stream("default", rate_per_s=1000.0, deadline_ms=100)
    p50 = {"latency_p50_ms": 5.0}
    assert offer_problem(stream, 1950, 2.0, [0.001], **p50) == ""
    assert offer_problem(stream, 1800, 2.0, [0.001], **p50) == (
        "sent 900/s of the 1,000/s target (90%)"
    )
    assert offer_problem(stream, 2000, 2.0, [0.2, 0.3], **p50) == (
        "client lag p95 295 ms exceeds the 100 ms deadline"
    )
    few = Stream("interactive", rate_per_s=100.0)
    assert offer_problem(few, 180, 2.0, [], **p50) == "", "90 % of 200 arrivals: Poisson noise"
    assert offer_problem(few, 150, 2.0, [], **p50) != ""
    assert offer_problem(Stream("c", concurrency=4), 0, 2.0, [], **p50) == "", "closed loop"
    bulk = Stream("bulk", rate_per_s=3000.0, via="stream")
    assert offer_problem(bulk, 1200, 2.0, [], **p50) == "", "InferStream: the server's window holds"

    document = empty_document()
    document["capacity"] = {"throughput_per_s": 300.0}
    record = StreamWindow(sent=1500, ok_latency_s=[0.01] * 1000, ok_batch_rows=[4] * 1000)
    record.outcomes.update({OK: 1000})
    overload = Stream("default", rate_per_s=900.0, deadline_ms=100)
    point = point_of("d", "300%, 100 ms timeout_ms", overload, record)
    assert point["valid"] is False
    document["scenarios"]["d"].append(point)
    goodput = next(
        t for t in evaluate_targets(document) if t["id"] == "overload_goodput_timeout_ms"
    )
    assert (goodput["met"], goodput["valid"]) == (None, False), "not missed: not valid"
    assert verdict_text(goodput) == "not valid (load generator the limit)"
    assert "sent 750/s of the 900/s target" in goodput["detail"]
    report = render_markdown(document)
    assert "| 900 | 750 |" in report, "the achieved rate next to the target"
    assert "| not valid (load generator the limit) |" in report


def test_client_lag_is_judged_at_its_p95_and_without_a_deadline_too() -> None:
    """Validity looked at the median lag alone: a (d) point with lag p50 8.7 ms and p95
    162 ms (5 % of its requests late before they left, every one of their answers
    counted late against the server) passed; an open-loop stream without a deadline,
    as in (b), had no lag check at all."""
    lag_s = [0.0087] * 90 + [0.162] * 10
    overload = Stream("default", rate_per_s=50.0, deadline_ms=100)
    record = StreamWindow(sent=100, ok_latency_s=[0.02] * 100, lag_s=lag_s)
    record.outcomes.update({OK: 100})
    summary = summarize_stream(overload, record, 2.0, window_s=1.0)
    assert summary["valid"] is False
    assert summary["invalid_reason"] == "client lag p95 162 ms exceeds the 100 ms deadline"
    assert summary["client_lag"]["p50_ms"] == pytest.approx(8.7)
    assert summary["client_lag"]["p95_ms"] == pytest.approx(162.0)
    assert summary["client_lag_limit_ms"] == 100.0

    # No deadline: the lag is held against the stream's median latency (from the
    # scheduled arrival), 20 ms here.
    open_loop = Stream("single", rate_per_s=50.0)
    summary = summarize_stream(open_loop, record, 2.0, window_s=1.0)
    assert summary["valid"] is False
    assert summary["invalid_reason"] == (
        "client lag p95 162 ms exceeds the stream's p50 latency, 20.0 ms (no deadline)"
    )
    assert summary["client_lag_limit_ms"] == pytest.approx(20.0)
    on_time = StreamWindow(sent=100, ok_latency_s=[0.02] * 100, lag_s=[0.001] * 100)
    on_time.outcomes.update({OK: 100})
    assert summarize_stream(open_loop, on_time, 2.0, window_s=1.0)["valid"] is True
    # Over InferStream too: the lag is taken before an item is handed to the stream.
    bulk = dataclasses.replace(open_loop, via="stream")
    assert summarize_stream(bulk, record, 2.0, window_s=1.0)["valid"] is False
    closed = summarize_stream(Stream("single", concurrency=4), record, 2.0, window_s=1.0)
    assert (closed["valid"], closed["client_lag_limit_ms"]) == (True, None)

    document = empty_document()
    document["scenarios"]["b"].append(point_of("b", "50%", open_loop, record))
    document["scenarios"]["d"].append(point_of("d", "300%", overload, record))
    report = render_markdown(document)
    assert report.count("| 8.70 ms / 162.0 ms / 162.0 ms |") == 2, "lag p50 / p95 / p99"
    assert "its client lag p95 exceeds the stream's p50 latency" in report
    assert "its client lag p95 exceeds the deadline" in report


def test_answers_held_in_a_starved_client_make_the_point_not_valid() -> None:
    """A full run's (d) point with a 100 ms gRPC deadline read OK answers 9 s after their
    send, its send lag p95 36 ms: valid, as the rule looked only at when requests left.
    Calls seen ending past their gRPC deadline, and the loop's lateness, now count."""
    overload = Stream("default", rate_per_s=1000.0, deadline_ms=100, deadline_in="grpc")
    record = StreamWindow(sent=2000, ok_latency_s=[8.969] * 20, lag_s=[0.001] * 2000)
    record.outcomes.update({OK: 20, "DEADLINE_EXCEEDED": 1980})
    # 10 % of the calls were seen ending 8.9 s past their deadline, the rest on time.
    record.past_deadline_s = [0.0] * 1800 + [8.9] * 200
    summary = summarize_stream(overload, record, 2.0, window_s=3.0)
    assert summary["valid"] is False
    assert summary["invalid_reason"] == (
        "client late past the gRPC deadline p95 8,900 ms exceeds the 100 ms deadline"
    )
    assert summary["client_past_grpc_deadline"]["p95_ms"] == pytest.approx(8900.0)
    assert summary["client_late_limit_ms"] == 100.0
    assert summary["client_loop_late"]["count"] == 0, "no heartbeat here: not judged"

    # The loop's lateness alone: one heartbeat tick in ten 1.5 s late.
    record.past_deadline_s = []
    record.loop_late_s = [0.001] * 90 + [1.5] * 10
    summary = summarize_stream(overload, record, 2.0, window_s=3.0)
    assert summary["invalid_reason"] == (
        "client loop late p95 1,500 ms exceeds the 100 ms deadline"
    )
    # One in twenty-five: within the deadline at the p95.
    record.loop_late_s = [0.001] * 96 + [1.5] * 4
    summary = summarize_stream(overload, record, 2.0, window_s=3.0)
    assert (summary["valid"], summary["client_loop_late"]["p95_ms"]) == (True, 1.0)


def test_a_late_client_loop_is_held_to_the_deadline_the_median_or_a_tenth_of_a_window() -> None:
    """Full run: (b) points whose 3 s client windows lasted 0.68-7.33 s, the machine's 2
    cores busy and no client process saturated, were valid: their p50 latency (10-21 s)
    was above any lag. A loop later than a tenth of a window cuts the client's windows
    where the server's readings are not taken, so the window bounds every stream."""
    starved = [0.001] * 90 + [2.0] * 10
    record = StreamWindow(sent=1000, ok_latency_s=[21.0] * 500, loop_late_s=starved)
    record.outcomes.update({OK: 500})
    open_loop = Stream("single", rate_per_s=100.0)
    summary = summarize_stream(open_loop, record, 9.0, window_s=3.0)
    assert summary["client_late_limit_ms"] == pytest.approx(300.0)
    assert summary["invalid_reason"] == (
        "client loop late p95 2,000 ms exceeds 10% of the 3 s window (300 ms)"
    )
    # Closed loop: the window's tenth alone, whatever its median latency.
    closed = Stream("single", concurrency=4)
    assert summarize_stream(closed, record, 9.0, window_s=3.0)["valid"] is False
    late = [0.001] * 90 + [0.04] * 10  # p95 40 ms: 20 times the 2 ms median
    fast = StreamWindow(sent=1000, ok_latency_s=[0.002] * 1000, loop_late_s=late)
    fast.outcomes.update({OK: 1000})
    closed_summary = summarize_stream(closed, fast, 9.0, window_s=3.0)
    assert closed_summary["valid"] is True
    assert closed_summary["client_late_limit_ms"] == pytest.approx(300.0)
    # Open loop without a deadline: its median latency, as for the lag.
    open_summary = summarize_stream(open_loop, fast, 9.0, window_s=3.0)
    assert open_summary["client_late_limit_ms"] == pytest.approx(2.0)
    assert open_summary["invalid_reason"] == (
        "client loop late p95 40 ms exceeds the stream's p50 latency, 2.0 ms (no deadline)"
    )


def test_the_heartbeat_weighs_a_stall_by_its_length_for_the_streams_it_carries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sleep after each wake would leave one sample of a 1 s stall among the on-time
    ones; ticks on a fixed grid leave one per 10 ms it lasted."""
    carried = Stream("default", rate_per_s=100.0)
    other = Stream("bulk", lane="bulk", concurrency=1)
    job = dataclasses.replace(
        open_loop_client(carried).job,
        streams=(carried, other),
        callers=(0, 0),
        rates_per_s=(100.0, 0.0),
    )
    client = _Client(0, job, cast("Any", None), cast("Any", None), cast("Any", None))
    start_s = 1000.0
    # The process's clock, not asyncio's: 1 s after the start, the loop was stalled.
    monkeypatch.setattr(loadgen, "time", types.SimpleNamespace(monotonic=lambda: start_s + 1.0))

    async def one_wake() -> None:
        heartbeat = asyncio.create_task(client._heartbeat(start_s))
        await asyncio.sleep(0)  # it runs the ticks due, then sleeps until the next
        client.stopping = True
        heartbeat.cancel()
        await asyncio.gather(heartbeat, return_exceptions=True)

    asyncio.run(one_wake())
    late_s = client.records[0].loop_late_s
    assert len(late_s) == 101, "every tick from the start to the wake, both included"
    assert late_s[0] == pytest.approx(1.0)
    assert late_s[-1] == pytest.approx(0.0, abs=1e-6)
    assert client.records[1].loop_late_s == [], "a stream this process does not carry"


def test_a_call_seen_ending_past_its_grpc_deadline_counts_the_time_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC ends every call by its deadline: an answer seen 300 ms after its send under a
    100 ms gRPC deadline waited 200 ms in the client."""
    clock = iter([10.0, 10.3, 20.0, 20.05])  # (send, end) of two calls
    monkeypatch.setattr(loadgen, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    stream = Stream("default", rate_per_s=1.0, deadline_ms=100, deadline_in="grpc")
    client = open_loop_client(stream)
    monkeypatch.setattr(client, "_unary", answer(pb.InferResponse(timing=pb.Timing())))
    asyncio.run(client._call(0, 0, 10.0))
    monkeypatch.setattr(client, "_unary", answer("DEADLINE_EXCEEDED"))
    asyncio.run(client._call(0, 0, 20.0))
    assert client.records[0].past_deadline_s == pytest.approx([0.2, 0.0])
    # Over InferStream an item has no gRPC deadline of its own: nothing to hold it to.
    bidi = open_loop_client(dataclasses.replace(stream, via="stream"))
    clock = iter([30.0, 30.3])

    class Bidi:
        async def call(self, _request_id: str, _payload: bytes) -> str:
            return "EXPIRED_IN_QUEUE"

    bidi.bidis = {0: cast("Any", Bidi())}
    asyncio.run(bidi._call(0, 0, 30.0))
    assert bidi.records[0].past_deadline_s == []


def test_a_point_whose_client_loop_stalled_is_not_valid_in_verdicts_and_warnings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Closed loop too: in every window of this c=64 point, one heartbeat tick in ten
    was half a second late."""
    pool = Windows(loop_late_s=(*[0.001] * 90, *[0.5] * 10))
    monkeypatch.setattr(bench_run, "get_stats", pool.stats)
    settings = BenchSettings(profile=PROFILES["full"], out_dir=tmp_path)
    document = bench_run._new_document(settings, None)
    runner = bench_run._Runner(settings, cast("Any", pool), document)
    deployment = procs.Deployment(name="laneserve", kind="external", target="unused")
    runner._measure(deployment, Point("a", "c=64", (Stream("single", concurrency=64),)))
    document["primary"] = "laneserve"
    (point,) = document["scenarios"]["a"]
    reason = "single: client loop late p95 500 ms exceeds 10% of the 3 s window (300 ms)"
    assert (point["valid"], point["invalid_reason"]) == (False, reason)
    assert point["client"]["loop_late_p95_ms"] == 500.0
    assert point["client"]["saturated"] is False, "starved, not busy"
    assert document["warnings"] == [
        "laneserve (a) c=64: not stable within 8 windows",
        f"laneserve (a) c=64: not valid, the load generator was the limit ({reason})",
    ]
    targets = {t["id"]: t for t in evaluate_targets(document)}
    assert verdict_text(targets["reference_p99"]) == "not valid (load generator the limit)"
    report = render_markdown(document)
    assert "| no | no |" in report, "(a): neither stable nor valid"


def test_a_stream_not_valid_for_its_lag_is_not_reported_as_unsent() -> None:
    """(c)'s table read "(sent X/s: not valid)" for every stream not valid, though the
    rate was sent in full and the lag was why."""
    interactive = Stream("interactive", lane="interactive", rate_per_s=100.0)
    record = StreamWindow(sent=200, ok_latency_s=[0.01] * 200, lag_s=[0.05] * 200)
    record.outcomes.update({OK: 200})
    unsent = StreamWindow(sent=100, ok_latency_s=[0.01] * 100, lag_s=[0.0] * 100)
    unsent.outcomes.update({OK: 100})
    document = empty_document()
    document["scenarios"]["c"] += [
        point_of("c", "late", interactive, record),
        point_of("c", "unsent", interactive, unsent),
    ]
    report = render_markdown(document)
    assert (
        "| 100/s (not valid: client lag p95 50 ms exceeds the stream's p50 latency, "
        "10.0 ms (no deadline)) |"
    ) in report
    assert "| 100/s (not valid: sent 50/s of the 100/s target (50%)) |" in report
    assert "(sent 100/s: not valid)" not in report


def test_the_isolation_table_shows_every_outcome_that_is_not_ok() -> None:
    """(c)'s table showed rejected and shed only: interactive calls that timed out or
    failed under the bulk flood were in no column."""
    document = empty_document()
    interactive = Stream("interactive", lane="interactive", rate_per_s=100.0)
    record = StreamWindow(sent=200, ok_latency_s=[0.01] * 50, ok_batch_rows=[1] * 50)
    record.outcomes.update({OK: 50, "DEADLINE_EXCEEDED": 120, "ENGINE_FAILURE": 30})
    document["scenarios"]["c"].append(point_of("c", "with bulk", interactive, record))
    report = render_markdown(document)
    assert "| DEADLINE_EXCEEDED 120, ENGINE_FAILURE 30 |" in report


def test_isolation_with_no_interactive_answer_under_bulk_is_missed() -> None:
    """Every interactive call sent under the bulk flood failed: the target read "not
    measured" (there was no p99 to compare), where isolation had failed outright."""
    document = empty_document()
    interactive = Stream("interactive", lane="interactive", rate_per_s=100.0)
    alone = StreamWindow(sent=200, ok_latency_s=[0.01] * 200, ok_batch_rows=[1] * 200)
    alone.outcomes.update({OK: 200})
    flooded = StreamWindow(sent=200)
    flooded.outcomes.update({"DEADLINE_EXCEEDED": 200})
    bulk = Stream("bulk", lane="bulk", rows=8, rate_per_s=50.0)
    bulk_record = StreamWindow(sent=100, ok_latency_s=[0.1] * 100, ok_batch_rows=[8] * 100)
    bulk_record.outcomes.update({OK: 100})
    loaded = point_of("c", "with bulk at 200% over Infer", interactive, flooded)
    loaded["streams"].append(dataclasses.asdict(bulk))
    loaded["lanes"]["bulk"] = summarize_stream(bulk, bulk_record, 2.0, window_s=1.0)
    document["scenarios"]["c"] += [point_of("c", "interactive alone", interactive, alone), loaded]
    (target,) = [t for t in evaluate_targets(document) if t["id"].startswith("isolation_p99")]
    assert target["met"] is False
    assert verdict_text(target) == "missed"
    assert "inf with bulk (0.0% of 200 calls OK" in target["measured"]


def test_isolation_p99_counts_every_interactive_call_not_answered_ok_as_a_miss() -> None:
    """Under the unary bulk flood 150 of 257 interactive calls were refused, and the p99
    was taken over the 107 answered: the target could be met with most calls refused."""
    document = empty_document()
    interactive = Stream("interactive", lane="interactive", rate_per_s=100.0)
    alone = StreamWindow(sent=200, ok_latency_s=[0.010] * 200, ok_batch_rows=[1] * 200)
    alone.outcomes.update({OK: 200})
    flooded = StreamWindow(sent=257, ok_latency_s=[0.015] * 107, ok_batch_rows=[1] * 107)
    flooded.outcomes.update({OK: 107, "LANE_FULL": 150})
    document["scenarios"]["c"] += [
        point_of("c", "interactive alone", interactive, alone),
        point_of("c", "with bulk at 200% over Infer", interactive, flooded),
    ]
    document["scenarios"]["c"][1]["streams"].append(
        dataclasses.asdict(Stream("bulk", lane="bulk", rows=8, rate_per_s=50.0))
    )
    loaded = document["scenarios"]["c"][1]["lanes"]["interactive"]
    assert loaded["latency"]["p99_ms"] == pytest.approx(15.0), "over OK answers, as before"
    every = loaded["latency_all_calls"]
    assert (every["calls"], every["p99_ms"]) == (257, None), "a refused call is +inf"
    assert every["ok_share"] == pytest.approx(107 / 257)
    (target,) = [t for t in evaluate_targets(document) if t["id"].startswith("isolation_p99")]
    assert (target["met"], verdict_text(target)) == (False, "missed")
    assert target["measured"].startswith("inf with bulk (41.6% of 257 calls OK; p99 of the OK")
    assert target["detail"] == (
        "150 of 257 calls not answered OK (LANE_FULL 150): each counts as +inf"
    )
    report = render_markdown(document)
    assert "| 100.0% | 10.0 ms |" in report, "alone: every call OK"
    assert "| 41.6% | inf | LANE_FULL 150 |" in report

    # Fewer than 1 % not OK: the p99 stays finite, over every call.
    mostly = StreamWindow(sent=1000, ok_latency_s=[0.001 * i for i in range(995)])
    mostly.outcomes.update({OK: 995, "LANE_FULL": 5})
    assert summarize_stream(interactive, mostly, 2.0, window_s=1.0)["latency_all_calls"][
        "p99_ms"
    ] == (pytest.approx(percentiles_ms([0.001 * i for i in range(995)] + [9.0] * 5)["p99_ms"]))
    mostly.outcomes.update({"LANE_FULL": 15})
    assert (
        summarize_stream(interactive, mostly, 2.0, window_s=1.0)["latency_all_calls"]["p99_ms"]
        is None
    )


def _echo_and_overload_points() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A document with laneserve's and echo's (a) points at 32 callers (`ours` and
    `theirs`, returned to be marked), the capacity read from ours, and a (d) point at
    300 %: what the echo ratio and the (d) targets read."""
    document = empty_document()
    single = Stream("single", concurrency=32)
    fast = StreamWindow(sent=900, ok_latency_s=[0.01] * 900, ok_batch_rows=[4] * 900)
    fast.outcomes.update({OK: 900})
    echo = StreamWindow(sent=1000, ok_latency_s=[0.005] * 1000, ok_batch_rows=[1] * 1000)
    echo.outcomes.update({OK: 1000})
    ours = point_of("a", "c=32", single, fast)
    theirs = point_of("a", "c=32", single, echo)
    theirs["configuration"] = "echo"
    document["scenarios"]["a"] += [ours, theirs]
    document["capacity"] = {
        "configuration": "laneserve",
        "point": "c=32",
        "throughput_per_s": 450.0,
    }
    overload = Stream("default", rate_per_s=500.0, deadline_ms=100)
    late = StreamWindow(sent=1000, ok_latency_s=[0.01] * 100, ok_batch_rows=[4] * 100)
    late.outcomes.update({OK: 100, "LANE_FULL": 900})
    document["scenarios"]["d"].append(point_of("d", "300%, 100 ms timeout_ms", overload, late))
    return document, ours, theirs


def test_a_verdict_read_from_an_unstable_point_says_so() -> None:
    """The targets table gave "met" or "missed" alike from points marked "stable: no",
    as solid-looking as from points that settled; so did the (d) verdicts whose
    capacity came from an unstable (a) point."""
    document, ours, _theirs = _echo_and_overload_points()
    ours["stable"] = False
    targets = {t["id"]: t for t in evaluate_targets(document)}

    echo_ratio = targets["echo_ratio"]
    assert (echo_ratio["met"], echo_ratio["stable"]) == (True, False)
    assert echo_ratio["unstable_points"] == ["laneserve (a) c=32"]
    assert verdict_text(echo_ratio) == "met (unstable point)"
    assert "read from points not stable: laneserve (a) c=32" in echo_ratio["detail"]
    goodput = targets["overload_goodput_timeout_ms"]
    assert verdict_text(goodput) == "missed (unstable point)", "the capacity's point"
    expired = targets["overload_expired_executed"]
    assert (verdict_text(expired), expired["stable"]) == ("met (unstable point)", False)
    assert verdict_text(targets["reference_p99"]) == "not measured"
    report = render_markdown(document)
    assert "| **missed (unstable point)** |" in report
    assert "| met (unstable point) |" in report
    assert target_line(goodput).startswith("  MISSED (unstable point)  under (d) goodput")

    ours["stable"] = True
    targets = {t["id"]: t for t in evaluate_targets(document)}
    assert verdict_text(targets["echo_ratio"]) == "met"
    assert verdict_text(targets["overload_goodput_timeout_ms"]) == "missed"
    assert targets["echo_ratio"]["unstable_points"] == []

    # (c)'s bulk saturation point sets no rate of (d): unstable, it marked (d)'s verdicts.
    bulk = Stream("bulk", lane="bulk", rows=8, concurrency=32)
    saturated = StreamWindow(sent=900, ok_latency_s=[0.01] * 900, ok_batch_rows=[4] * 900)
    saturated.outcomes.update({OK: 900})
    saturation = point_of("c", BULK_SATURATION, bulk, saturated)
    saturation["stable"] = False
    document["scenarios"]["c"].append(saturation)
    targets = {t["id"]: t for t in evaluate_targets(document)}
    assert verdict_text(targets["overload_goodput_timeout_ms"]) == "missed"
    assert verdict_text(targets["overload_expired_executed"]) == "met"


def host_mark(
    at_s: float,
    server_cpu_s: float | None,
    machine_busy_s: float,
    harness_cpu_s: float | None = None,
) -> bench_run.Mark:
    """A reading at a window boundary with the given clocks (no GetStats, no threads)."""
    return bench_run.Mark(at_s, None, server_cpu_s, machine_busy_s, None, harness_cpu_s)


def test_a_point_measured_while_other_processes_held_the_machine_is_marked_busy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The harness measured the cores other processes used and judged nothing by them:
    verdicts came from points a neighbour shared (1.12 cores of 2) and flipped between
    identical runs."""
    # 2 s between the readings; the server used 1 core of them, the clients 0.5.
    quiet = bench_run._host_figures(host_mark(10.0, 5.0, 100.0), host_mark(12.0, 7.0, 103.2), 0.5)
    assert quiet["other_cores"] == pytest.approx(0.1)
    assert bench_run.machine_busy(quiet["other_cores"]) is False
    shared = bench_run._host_figures(host_mark(10.0, 5.0, 100.0), host_mark(12.0, 7.0, 104.0), 0.5)
    assert shared["other_cores"] == pytest.approx(0.5)
    assert bench_run.machine_busy(shared["other_cores"]) is True

    # A point whose boundary readings say the machine was 2 cores busy each second: the
    # server 1, the clients 0.1 (Windows), others 0.9.
    readings = iter(host_mark(float(index), float(index), 2.0 * index) for index in range(9))
    monkeypatch.setattr(bench_run, "take_mark", lambda _deployment, **_kwargs: next(readings))
    settings = BenchSettings(profile=PROFILES["full"], out_dir=tmp_path)
    document = bench_run._new_document(settings, None)
    runner = bench_run._Runner(settings, cast("Any", Windows()), document)
    deployment = procs.Deployment(name="laneserve", kind="laneserve", target="unused")
    runner._measure(deployment, Point("a", "c=32", (Stream("single", concurrency=32),)))
    (point,) = document["scenarios"]["a"]
    assert point["host"]["other_cores"] == pytest.approx(0.9)
    assert point["busy"] is True
    assert (
        "laneserve (a) c=32: machine busy: 0.90 cores used by other processes (more than 0.25)"
        in "\n".join(document["warnings"])
    )
    evaluate_targets(document)
    assert "| 0.90 (busy) |" in render_markdown(document)


def test_an_external_servers_cpu_is_reported_with_the_others_and_never_marks_busy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With --target the harness has no server process to read: the server's cores were
    reported as the others' ("- / 0.16 / 1.84"), which a busy rule would misread."""
    figures = bench_run._host_figures(
        host_mark(10.0, None, 100.0), host_mark(12.0, None, 104.0), 0.1
    )
    assert (figures["server_cores"], figures["other_cores"]) == (None, None)
    assert figures["server_and_other_cores"] == pytest.approx(1.9)
    assert bench_run.machine_busy(figures["other_cores"]) is None

    readings = iter(host_mark(float(index), None, 2.0 * index) for index in range(9))
    monkeypatch.setattr(bench_run, "take_mark", lambda _deployment, **_kwargs: next(readings))
    settings = BenchSettings(profile=PROFILES["full"], out_dir=tmp_path, target="unused")
    document = bench_run._new_document(settings, None)
    runner = bench_run._Runner(settings, cast("Any", Windows()), document)
    deployment = procs.Deployment(name="target", kind="external", target="unused")
    runner._measure(deployment, Point("b", "50%", (Stream("single", rate_per_s=400.0),)))
    (point,) = document["scenarios"]["b"]
    assert point["busy"] is None
    assert not [warning for warning in document["warnings"] if "machine busy" in warning]
    evaluate_targets(document)
    report = render_markdown(document)
    assert "| - / 0.10 / - / 1.90 (server + others) |" in report
    assert "its CPU cannot be told from other processes'" in report


def test_a_verdict_read_from_a_point_on_a_busy_machine_is_no_verdict() -> None:
    """quick1 read "met (unstable point)" from an echo point that shared the machine with
    1.12 cores of other work, quick2 "missed" from the same command: neither is a
    verdict on the server."""
    document, ours, theirs = _echo_and_overload_points()
    theirs["busy"] = True
    theirs["host"]["other_cores"] = 1.12
    targets = {t["id"]: t for t in evaluate_targets(document)}

    echo_ratio = targets["echo_ratio"]
    assert (echo_ratio["met"], echo_ratio["met_on_busy_machine"]) == (None, True)
    assert echo_ratio["busy_points"] == ["echo (a) c=32"]
    busy_text = (
        "no verdict: met (machine busy at echo (a) c=32: 1.12 cores used by other processes)"
    )
    assert verdict_text(echo_ratio) == busy_text
    assert "echo (a) c=32 (1.12 cores)" in echo_ratio["detail"]
    assert target_line(echo_ratio).startswith(f"  {busy_text}  single-row throughput")
    assert f"| {busy_text} |" in render_markdown(document)
    goodput = targets["overload_goodput_timeout_ms"]
    assert verdict_text(goodput) == "missed", "(d) does not read echo's point"

    # The capacity's point busy: (d)'s offered rate came from it.
    ours["busy"] = True
    ours["host"]["other_cores"] = 0.6
    targets = {t["id"]: t for t in evaluate_targets(document)}
    goodput = targets["overload_goodput_timeout_ms"]
    assert verdict_text(goodput) == (
        "no verdict: missed (machine busy at laneserve (a) c=32: 0.60 cores used by other "
        "processes)"
    )
    assert not target_line(goodput).startswith("  MISSED"), "no verdict, no miss"
    # Both points busy: the verdict names the busier.
    echo_ratio = targets["echo_ratio"]
    assert echo_ratio["busy_points"] == ["laneserve (a) c=32", "echo (a) c=32"]
    assert verdict_text(echo_ratio) == busy_text

    # A point not valid is the stronger finding.
    theirs["valid"], theirs["invalid_reason"] = False, "client lag"
    assert verdict_text({t["id"]: t for t in evaluate_targets(document)}["echo_ratio"]) == (
        "not valid (load generator the limit)"
    )
    theirs["valid"], theirs["busy"], ours["busy"] = True, False, None
    assert verdict_text({t["id"]: t for t in evaluate_targets(document)}["echo_ratio"]) == "met"


def test_the_raw_ceiling_sweep_records_the_cores_other_processes_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The raw sweep ran before any figure was checked against the machine's: a busy one
    gave a low ceiling with nothing to say so."""
    sweep = {"rows_per_s_by_batch_rows": {"1": 10.0}, "best_batch_rows": 1, "best_rows_per_s": 10.0}
    # The sweep's process is a child that prints a sweep and uses next to no CPU.
    monkeypatch.setattr(
        procs,
        "python_module",
        lambda *_args: [sys.executable, "-c", f"print({json.dumps(sweep)!r})"],
    )
    settings = BenchSettings(profile=PROFILES["smoke"], out_dir=tmp_path)
    # The machine 20 CPU seconds busier over a sweep of a fraction of a second.
    busy_readings = iter([100.0, 120.0])
    monkeypatch.setattr(procs, "machine_busy_s", lambda: next(busy_readings))
    raw = bench_run._raw_ceiling(settings, "m.onnx")
    assert raw["best_rows_per_s"] == 10.0
    assert raw["busy"] is True
    assert raw["host"]["other_cores"] > BUSY_OTHER_CORES
    document = empty_document()
    document["raw_ceiling"] = raw
    evaluate_targets(document)
    assert "Best: 10 rows/s at 1 rows per run (machine busy: " in render_markdown(document)

    quiet_readings = iter([100.0, 100.0])
    monkeypatch.setattr(procs, "machine_busy_s", lambda: next(quiet_readings))
    raw = bench_run._raw_ceiling(settings, "m.onnx")
    assert (raw["busy"], raw["host"]["other_cores"]) == (False, 0.0)
    document["raw_ceiling"] = raw
    assert "Best: 10 rows/s at 1 rows per run.\n" in render_markdown(document)


def test_the_harness_own_cpu_is_not_counted_as_other_processes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """py-spy, the harness's own child at laneserve's profiled point (0.20-0.25 cores at
    250 Hz), and the orchestrator were counted as other processes': `--py-spy` alone
    could mark the capacity point busy on a quiet machine and take (d)'s verdicts."""
    # 2 s between the readings: the server 1 core, the clients 0.5, the harness 0.25
    # (py-spy and the orchestrator), others 0.05.
    figures = bench_run._host_figures(
        host_mark(10.0, 5.0, 100.0, 1.0), host_mark(12.0, 7.0, 103.6, 1.5), 0.5
    )
    assert figures["harness_cores"] == pytest.approx(0.25)
    assert figures["other_cores"] == pytest.approx(0.05)
    assert bench_run.machine_busy(figures["other_cores"]) is False
    # The harness not known (py-spy gone): its cores stay among the others'.
    figures = bench_run._host_figures(
        host_mark(10.0, 5.0, 100.0, 1.0), host_mark(12.0, 7.0, 103.6, None), 0.5
    )
    assert (figures["harness_cores"], figures["other_cores"]) == (None, pytest.approx(0.3))
    # With --target, the server's and the others' cores together, the harness's apart.
    figures = bench_run._host_figures(
        host_mark(10.0, None, 100.0, 1.0), host_mark(12.0, None, 103.6, 1.5), 0.5
    )
    assert figures["server_and_other_cores"] == pytest.approx(1.05)

    # The point: the machine 2 cores busy each second, the server 1, the clients 0.1
    # (Windows), the harness 0.7, others 0.2: not busy.
    readings = iter(
        host_mark(float(index), float(index), 2.0 * index, 0.7 * index) for index in range(9)
    )
    monkeypatch.setattr(bench_run, "take_mark", lambda _deployment, **_kwargs: next(readings))
    settings = BenchSettings(profile=PROFILES["full"], out_dir=tmp_path)
    document = bench_run._new_document(settings, None)
    runner = bench_run._Runner(settings, cast("Any", Windows()), document)
    deployment = procs.Deployment(name="laneserve", kind="laneserve", target="unused")
    runner._measure(deployment, Point("a", "c=32", (Stream("single", concurrency=32),)))
    (point,) = document["scenarios"]["a"]
    assert point["host"]["harness_cores"] == pytest.approx(0.7)
    assert point["host"]["other_cores"] == pytest.approx(0.2)
    assert point["busy"] is False
    assert not [warning for warning in document["warnings"] if "machine busy" in warning]
    evaluate_targets(document)
    report = render_markdown(document)
    assert "| server CPU per request | harness | others |" in report
    assert "| 1.00 | 2.50 ms | 0.70 | 0.20 |" in report


def test_py_spys_cpu_is_read_at_every_boundary_of_the_point_it_samples(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The boundaries of the profiled point read py-spy's process with the orchestrator's
    (a stand-in py-spy here: a process that waits for its SIGINT)."""
    stand_in = tmp_path / "py-spy"
    stand_in.write_text(
        f"#!{sys.executable}\n"
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *_: sys.exit(0))\n"
        "while True:\n"
        "    time.sleep(0.01)\n"
    )
    stand_in.chmod(0o755)
    monkeypatch.setattr(bench_run, "py_spy_binary", lambda: str(stand_in))
    spies: list[PySpy] = []

    class RecordedSpy(PySpy):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            spies.append(self)

    monkeypatch.setattr(bench_run, "PySpy", RecordedSpy)
    helpers: list[tuple[int, ...]] = []
    take_mark = bench_run.take_mark

    def recorded_mark(
        deployment: procs.Deployment, *, by_thread: bool, helper_pids: Any
    ) -> bench_run.Mark:
        helpers.append(tuple(helper_pids))
        return take_mark(deployment, by_thread=by_thread, helper_pids=helper_pids)

    monkeypatch.setattr(bench_run, "take_mark", recorded_mark)
    pool = Windows()
    monkeypatch.setattr(bench_run, "get_stats", pool.stats)
    profile = PROFILES["full"]
    settings = BenchSettings(profile=profile, out_dir=tmp_path, py_spy=True)
    document = bench_run._new_document(settings, None)
    runner = bench_run._Runner(settings, cast("Any", pool), document)
    # A server process that only waits: the profiled point needs one to sample.
    server = procs.ServerProcess("laneserve", [sys.executable, "-c", "import time; time.sleep(60)"])
    deployment = procs.Deployment(
        name="laneserve", kind="laneserve", target="unused", processes=[server]
    )
    # A test run in the background has SIGINT ignored (the shell ignores it for
    # background jobs) and a child inherits that until it sets a handler: a SIGINT sent
    # before the stand-in set its own was lost, and PySpy.stop waited out its 60 s. A
    # handled signal starts at its default in a child.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        busiest = f"c={max(profile.concurrencies)}"
        runner._measure(deployment, Point("a", busiest, (Stream("single", concurrency=64),)))
        runner._measure(deployment, Point("a", "c=1", (Stream("single", concurrency=1),)))
    finally:
        signal.signal(signal.SIGINT, previous)
        deployment.stop()
    (spy,) = spies
    assert spy.process.returncode is not None, "stopped with its point"
    windows = profile.max_windows + 1
    assert helpers == [(spy.pid,)] * windows + [()] * windows
    profiled, other = document["scenarios"]["a"]
    assert profiled["host"]["harness_cores"] is not None
    assert other["host"]["harness_cores"] is not None


def test_the_harness_cpu_is_this_process_and_its_helpers() -> None:
    """The orchestrator's CPU with its helpers' (py-spy); None once a helper is gone, as
    a sum without it would drop its seconds so far."""
    assert bench_run.harness_cpu_s(()) is not None
    # A helper that has used at least 0.3 CPU seconds when it says so, then waits.
    burn = (
        "import time\n"
        "while time.process_time() < 0.3:\n"
        "    pass\n"
        "print('done', flush=True)\n"
        "time.sleep(60)\n"
    )
    helper = subprocess.Popen(
        [sys.executable, "-c", burn],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert helper.stdout is not None
        assert helper.stdout.readline() == "done\n"
        harness = bench_run.harness_cpu_s((helper.pid,))
        assert harness is not None
        # /proc counts in clock ticks (10 ms): a tick or two less than the helper's 0.3.
        assert harness - time.process_time() >= 0.25
    finally:
        helper.kill()
        helper.wait()
        assert helper.stdout is not None
        helper.stdout.close()
    assert bench_run.harness_cpu_s((helper.pid,)) is None


def test_a_document_written_before_the_busy_rule_is_not_judged_by_it() -> None:
    """A document from before the busy rule (no `busy` on its points) was reported as
    judged by it, and missing_keys flagged every point."""
    document = empty_document()
    stream = Stream("single", concurrency=32)
    record = StreamWindow(sent=900, ok_latency_s=[0.01] * 900, ok_batch_rows=[4] * 900)
    record.outcomes.update({OK: 900})
    document["scenarios"]["a"].append(point_of("a", "c=32", stream, record))
    evaluate_targets(document)
    rule = "A point where others used more than 0.25 cores is *busy*"
    assert rule in render_markdown(document)
    del document["scenarios"]["a"][0]["busy"]
    report = render_markdown(document)
    assert rule not in report
    assert "Measured before the busy rule (verdicts stand as they were)." in report
    assert not [key for key in missing_keys(document) if key.endswith(".busy")]
    # Since the rule, every point has it.
    document["scenarios"]["a"].append({**document["scenarios"]["a"][0], "busy": False})
    assert [key for key in missing_keys(document) if key.endswith(".busy")] == [
        "scenarios.a[0].busy"
    ]


def point_of(scenario: str, name: str, stream: Stream, record: StreamWindow) -> dict[str, Any]:
    """A point of the document as the orchestrator writes it, over 2 s of windows."""
    lane = summarize_stream(stream, record, 2.0, window_s=1.0)
    return {
        "configuration": "laneserve",
        "scenario": scenario,
        "name": name,
        "streams": [dataclasses.asdict(stream)],
        "stable": True,
        "valid": lane["valid"],
        "invalid_reason": lane["invalid_reason"],
        "lanes": {stream.label: lane},
        "client": {"cpu_fraction_max": 0.1, "saturated": False},
        "server": None,
        "host": {"server_cores": None, "client_cores": 0.1, "other_cores": None},
        "busy": None,
    }


class Windows:
    """A client pool that measures `max_windows` windows of a point that never settles,
    while the server (`batches`) runs 100 batches per window and 30 more at the stop."""

    processes = 1
    channels = 1

    def __init__(self, loop_late_s: tuple[float, ...] = ()) -> None:
        self.batches = 0
        # The heartbeat's samples of every window (the client's loop lateness).
        self.loop_late_s = loop_late_s

    def stats(self, _target: str) -> pb.GetStatsResponse:
        return pb.GetStatsResponse(batches=self.batches, rows_run=4 * self.batches)

    def run_point(
        self,
        _target: str,
        _streams: Any,
        _inputs: Any,
        *,
        profile: Profile,
        judge: Any,
        on_boundary: Any,
        priority_target: Any,
    ) -> PointRun:
        windows = []
        on_boundary(0)
        for index in range(profile.max_windows):
            self.batches += 100
            record = StreamWindow(sent=400, loop_late_s=list(self.loop_late_s))
            record.outcomes[OK] = 400
            windows.append(MergedWindow(index, {"single": record}, 1.0, {0: (0.1, 1.0)}))
            on_boundary(index + 1)
        self.batches += 30  # the stop: work in flight drains
        return PointRun(windows, False, windows[-profile.stable_windows :])


def test_server_figures_span_the_windows_the_client_figures_come_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pool = Windows()
    monkeypatch.setattr(bench_run, "get_stats", pool.stats)
    profile = PROFILES["full"]
    settings = BenchSettings(profile=profile, out_dir=tmp_path)
    document = bench_run._new_document(settings, None)
    runner = bench_run._Runner(settings, cast("Any", pool), document)
    deployment = procs.Deployment(name="laneserve", kind="external", target="unused")
    runner._measure(deployment, Point("a", "c=64", (Stream("single", concurrency=64),)))
    (point,) = document["scenarios"]["a"]
    assert (point["windows_measured"], point["windows_used"]) == (8, 3)
    assert point["lanes"]["single"]["ok"] == 3 * 400
    assert point["server"]["batches"] == 3 * 100, "the windows used, not all 8 and the stop"
    assert point["server"]["rows_run"] == point["lanes"]["single"]["ok"]
    # Percentiles are not differences: the report says what they span.
    report = render_markdown(document)
    assert "queue wait p99 over each lane's last 4096 waits" in report


def test_the_pool_reads_the_boundaries_of_the_windows_it_judges() -> None:
    """Windows 0 and 1 agree: the boundaries 0, 1 and 2 around them are read before the
    point stops, and none past them."""
    pool = ClientPool.__new__(ClientPool)
    pool.processes = 1
    pool._workers = []
    results: queue.Queue[tuple[Any, ...]] = queue.Queue()
    pool._results = cast("Any", results)
    for index in range(3):
        report = WindowReport(worker=0, window=index, streams={}, wall_s=1.0, cpu_s=0.1)
        results.put(("window", report))
    marks: list[int] = []
    windows, stable = pool._collect(
        time.monotonic() - 2.5, 1.0, 3, lambda windows: len(windows) == 2, marks.append
    )
    assert (len(windows), stable) == (2, True)
    assert marks == [0, 1, 2]


def test_workers_get_the_intra_op_threads_asked_for_or_their_share_of_usable_cores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    threads: dict[int, int] = {}

    def start_workers(
        _model: str, *, workers: int, intra_op_threads: int, device: str
    ) -> procs.Deployment:
        threads[workers] = intra_op_threads
        return procs.Deployment(name=f"workers-{workers}", kind="workers", target=device)

    monkeypatch.setattr(procs, "start_workers", start_workers)
    # A container limited to 2 of the machine's 64 cores.
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    for asked, expected in (
        (1, {1: 1, 2: 1, 4: 1}),
        (3, {1: 3, 2: 3, 4: 3}),
        (0, {1: 2, 2: 1, 4: 1}),
    ):
        settings = BenchSettings(
            profile=PROFILES["full"], out_dir=tmp_path, intra_op_threads=asked, workers=(1, 2, 4)
        )
        for start in bench_run._starters(settings, "workers", "m.onnx"):
            start()
        assert threads == expected, f"--intra-op-threads {asked}"
    assert BenchSettings(profile=PROFILES["full"], out_dir=tmp_path).no_batching_threads == 2


def test_memory_is_pss_summed_with_its_peak_sampled_under_load(tmp_path: Path) -> None:
    def proc_files(pid: int, rss_kb: int, hwm_kb: int, pss_kb: int | None) -> None:
        folder = tmp_path / str(pid)
        folder.mkdir()
        (folder / "status").write_text(f"Name:\tx\nVmHWM:\t{hwm_kb} kB\nVmRSS:\t{rss_kb} kB\n")
        if pss_kb is not None:
            (folder / "smaps_rollup").write_text(
                f"00400000-7fff [rollup]\nRss:\t{rss_kb} kB\nPss:\t{pss_kb} kB\n"
            )

    # Two workers sharing 80 of their 100 MiB resident: PSS counts the shared part once.
    proc_files(1, 102_400, 150_000, 61_440)
    proc_files(2, 102_400, 110_000, 61_440)
    proc_files(3, 102_400, 110_000, None)
    first, second, unreadable = (procs.read_process_memory(pid, tmp_path) for pid in (1, 2, 3))
    assert (first.pss_bytes, first.rss_bytes, first.peak_rss_bytes) == (
        61_440 * 1024,
        102_400 * 1024,
        150_000 * 1024,
    )
    assert procs.summed_memory([first, second]) == ("PSS", 120 * 2**20)
    assert procs.summed_memory([first, unreadable]) == ("RSS", 200 * 2**20)
    figures = procs.memory_figures([first, second], {"PSS": 130 * 2**20}, samples=4)
    assert (figures["measure"], figures["bytes"], figures["peak_bytes"]) == (
        "PSS",
        120 * 2**20,
        130 * 2**20,
    )
    assert figures["note"] is None
    assert figures["unique_bytes"] is None, "no smaps in this tree"
    fallback = procs.memory_figures([first, unreadable], {"PSS": 1}, samples=1)
    assert fallback["measure"] == "RSS"
    assert fallback["peak_bytes"] is None, "no RSS sample: a PSS peak is not comparable"
    assert "smaps_rollup could not be read" in fallback["note"]
    ours = procs.read_process_memory(os.getpid())
    assert ours.pss_bytes is not None
    assert ours.pss_bytes > 0
    assert (procs.unique_memory([ours]) or 0) > 0


def smaps_entry(header: str, *, shared_kb: int = 0, private_kb: int = 0) -> str:
    """One mapping of a /proc/PID/smaps file, its fields as a 6.x kernel writes them."""
    rss_kb = shared_kb + private_kb
    fields = {
        "Size": rss_kb + 64,
        "KernelPageSize": 4,
        "MMUPageSize": 4,
        "Rss": rss_kb,
        "Pss": private_kb + shared_kb // 2,
        "Pss_Dirty": 0,
        "Shared_Clean": shared_kb,
        "Shared_Dirty": 0,
        "Private_Clean": 0,
        "Private_Dirty": private_kb,
        "Referenced": rss_kb,
        "Anonymous": private_kb,
        "Swap": 0,
    }
    lines = [header, *(f"{name}:{value:>16} kB" for name, value in fields.items())]
    return "\n".join([*lines, "THPeligible:           0", "VmFlags: rd mr mw me", ""])


def fake_process(proc: Path, pid: int, pss_kb: int, mappings: list[str]) -> None:
    folder = proc / str(pid)
    folder.mkdir()
    (folder / "status").write_text("Name:\tx\nVmHWM:\t1 kB\nVmRSS:\t1 kB\n")
    (folder / "smaps_rollup").write_text(
        f"00400000-7fff ---p 00000000 00:00 0 [rollup]\nPss: {pss_kb} kB\n"
    )
    (folder / "smaps").write_text("".join(mappings))


def test_unique_memory_counts_a_library_two_workers_share_once(tmp_path: Path) -> None:
    """PSS divides a shared page among every process that maps it, the harness's load
    generators included, so summed over a configuration it falls short of what the
    configuration holds; the unique measure counts each shared file mapping once."""
    libfoo = "fe:00 4242"  # the same file in both, whatever the path says
    fake_process(
        tmp_path,
        1,
        33_807,
        [
            smaps_entry(f"7f00-7f10 r-xp 00000000 {libfoo} /usr/lib/libfoo.so", shared_kb=8000),
            smaps_entry(f"7f10-7f20 rw-p 00002000 {libfoo} /usr/lib/libfoo.so", private_kb=40),
            smaps_entry("7e00-7e10 r--s 00000000 fe:00 777 /tmp/m.onnx (deleted)", shared_kb=2000),
            smaps_entry("7d00-7d10 r--p 00000000 fe:00 5000 /usr/lib/libbar.so", shared_kb=100),
            # Anonymous: shared copy-on-write with a fork of its own, counted to it alone.
            smaps_entry("5500-5600 rw-p 00000000 00:00 0 [heap]", shared_kb=100, private_kb=30_000),
        ],
    )
    fake_process(
        tmp_path,
        2,
        52_890,
        [
            smaps_entry(
                f"7f00-7f10 r-xp 00000000 {libfoo} /opt/libfoo.so (deleted)", shared_kb=6000
            ),
            smaps_entry(
                f"7f10-7f20 rw-p 00002000 {libfoo} /opt/libfoo.so (deleted)", private_kb=40
            ),
            smaps_entry("7e00-7e10 r--s 00000000 fe:00 777 /tmp/m.onnx (deleted)", shared_kb=1500),
            # The same path, another file (replaced on disk since the first one loaded it).
            smaps_entry("7d00-7d10 r--p 00000000 fe:00 5001 /usr/lib/libbar.so", shared_kb=100),
            smaps_entry("5500-5600 rw-p 00000000 00:00 0 [heap]", shared_kb=100, private_kb=50_000),
        ],
    )
    first, second = (procs.read_process_memory(pid, tmp_path) for pid in (1, 2))
    assert first.pages is not None
    assert first.pages.own_bytes == (40 + 100 + 30_000) * 1024
    assert first.pages.shared_bytes == {
        ("fe:00", "4242", "00000000"): 8000 * 1024,
        ("fe:00", "777", "00000000"): 2000 * 1024,
        ("fe:00", "5000", "00000000"): 100 * 1024,
    }
    assert procs.unique_memory([first]) == (30_140 + 8000 + 2000 + 100) * 1024
    # Private pages of both, libfoo's text and the model once (at the larger share), both
    # libbar files, and each heap's shared pages.
    unique_kb = 30_140 + 50_140 + 8000 + 2000 + 100 + 100
    assert procs.unique_memory([first, second]) == unique_kb * 1024
    pss_kb = 33_807 + 52_890
    assert procs.summed_memory([first, second]) == ("PSS", pss_kb * 1024)
    assert unique_kb > pss_kb, "PSS gave part of the shared pages to others"

    figures = procs.memory_figures([first, second], {"unique": 2**30, "PSS": 2**29}, samples=1)
    assert set(figures) == MEMORY_KEYS
    assert (figures["unique_bytes"], figures["unique_peak_bytes"]) == (unique_kb * 1024, 2**30)
    assert figures["by_process"][0]["shared_file_bytes"] == (8000 + 2000 + 100) * 1024
    json.dumps(figures)  # no mapping keys in the document
    without_smaps = procs.read_process_memory(3, tmp_path)
    assert procs.unique_memory([first, without_smaps]) is None


class FakeProcess(procs.ServerProcess):
    """A server process stand-in whose memory is read from a fake /proc tree."""

    def __init__(self, proc: Path, pid: int) -> None:
        self.proc = proc
        self.fake_pid = pid

    def memory(self) -> procs.ProcessMemory:
        return procs.read_process_memory(self.fake_pid, self.proc)


def test_sampling_keeps_the_peak_of_each_measure(tmp_path: Path) -> None:
    heap = "5500-5600 rw-p 00000000 00:00 0 [heap]"
    fake_process(tmp_path, 1, 900, [smaps_entry(heap, private_kb=1000)])
    deployment = procs.Deployment(name="laneserve", kind="laneserve", target="unused")
    deployment.processes = [FakeProcess(tmp_path, 1)]
    deployment.sample_memory()
    (tmp_path / "1" / "smaps").write_text(smaps_entry(heap, private_kb=500))
    (tmp_path / "1" / "smaps_rollup").write_text("Pss: 2000 kB\n")
    deployment.sample_memory()
    assert deployment.memory_samples == 2
    assert deployment.memory_peaks == {"unique": 1000 * 1024, "PSS": 2000 * 1024}
    (tmp_path / "1" / "smaps").unlink()
    deployment.sample_memory()
    assert deployment.memory_samples == 3, "PSS alone is still a sample"
    figures = deployment.memory()
    assert (figures["unique_bytes"], figures["unique_peak_bytes"]) == (None, 1000 * 1024)


class StubbornProcess(procs.ServerProcess):
    """A server process stand-in whose first stop is cut short by a Ctrl-C."""

    def __init__(self, name: str, interrupted: bool, stops: list[tuple[str, float]]) -> None:
        self.name = name
        self.interrupted = interrupted
        self.stops = stops

    def stop(self, timeout_s: float = procs.STOP_TIMEOUT_S) -> int:
        self.stops.append((self.name, timeout_s))
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt
        return 0


def test_a_second_ctrl_c_while_stopping_still_stops_every_process() -> None:
    stops: list[tuple[str, float]] = []
    deployment = procs.Deployment(name="workers-3", kind="workers", target="unused")
    deployment.processes = [
        StubbornProcess("w0", True, stops),
        StubbornProcess("w1", False, stops),
        StubbornProcess("w2", False, stops),
    ]
    with pytest.raises(KeyboardInterrupt):
        deployment.stop()
    assert stops == [
        ("w0", procs.STOP_TIMEOUT_S),
        ("w0", 0.0),
        ("w1", 0.0),
        ("w2", 0.0),
    ], "the interrupted one and the rest are killed at once"


def test_sigterm_stops_the_servers_the_run_started() -> None:
    serve = "import sys, time; print('serving fake on 127.0.0.1:1', file=sys.stderr, flush=True)"
    argv = [sys.executable, "-c", f"{serve}; time.sleep(60)"]
    before = signal.getsignal(signal.SIGTERM)

    def run_until_terminated() -> None:
        with stop_signals_interrupt():
            deployment = procs.start_group("fake", "laneserve", lambda _port: argv)
            try:
                signal.raise_signal(signal.SIGTERM)  # `timeout`, a CI job's cancel
            finally:
                deployment.stop()

    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        run_until_terminated()
    assert signal.getsignal(signal.SIGTERM) is before
    assert live_children() == []


def test_scenario_c_refuses_a_single_client_process(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--client-procs 1 they would share one"):
        BenchSettings(profile=PROFILES["smoke"], out_dir=tmp_path, client_processes=1)
    alone = BenchSettings(
        profile=PROFILES["smoke"], out_dir=tmp_path, client_processes=1, scenarios=("a", "d")
    )
    assert alone.client_processes == 1


@pytest.mark.parametrize(
    ("script", "args", "figure"),
    [
        (
            "bench_memory.py",
            ["--workers", "2", "--requests", "4", "--rows", "64"],
            "memory ratio (peak unique: each page counted once), 2 workers / laneserve:",
        ),
        (
            "bench_bulk.py",
            [
                "--rows",
                "2000",
                "--rows-per-item",
                "64",
                "--batch-sizes",
                "32,64",
                "--seconds",
                "0.2",
                "--rounds",
                "1",
            ],
            "`InferStream` via `AsyncClient.stream`",
        ),
        (
            "bench_shared_memory.py",
            ["--rows", "1,8", "--callers", "1", "--seconds", "0.2", "--rounds", "1"],
            "| `ModelInfer`, system shared memory |",
        ),
        ("bench_tracing.py", ["--requests", "20", "--rounds", "1"], "spans exported per request"),
        ("bench_text.py", ["--elements", "1000", "--rounds", "1"], "| decode, us an element |"),
        (
            "bench_text_loop.py",
            ["--seconds", "1", "--warmup-s", "0.5", "--bulk-strings", "30000"],
            "| interactive p99, on loop / off loop |",
        ),
        (
            "bench_text_loop.py",
            ["--seconds", "1", "--warmup-s", "0.5", "--numbers", "600", "--max-batch-size", "128"],
            "| bulk rows/s, off loop / on loop |",
        ),
        ("bench_admit.py", ["--requests", "10", "--rounds", "1"], "us per admission"),
        (
            "bench_unread_streams.py",
            ["--streams", "2", "--seconds", "0.5", "--read-items", "5", "--rounds", "1"],
            "fixed / own: peak RSS",
        ),
        (
            "simulate_admission.py",
            ["--seeds", "1", "--loads", "1.5", "--shapes", "two", "--counterfactual"],
            "unmeetable",
        ),
        (
            "simulate_admission.py",
            ["--seeds", "1", "--loads", "2.5", "--retries", "2", "--lane-rows", "32,64,512"],
            "max/1ms",
        ),
    ],
)
def test_the_measurement_scripts_run_and_print_their_figures(
    script: str, args: list[str], figure: str
) -> None:
    """Each script of scripts/ the READMEs quote, on a tiny load: bench_memory.py died
    with a KeyError after the procs module renamed its memory figures, and nothing ran
    it."""
    done = run_text(
        [sys.executable, str(REPO / "scripts" / script), *args],
        timeout_s=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert figure in done.stdout, done.stdout


# Runs a script or module (argv[1]: a path, or -m and a module) as its __main__, printing
# a line to stderr for each static-estimate child this process starts (fault injection:
# the child still runs, recorded on its way).
_RECORDING_ESTIMATES = """
import runpy, subprocess, sys
run = subprocess.run
def recorded(argv, *args, **kwargs):
    if any(str(arg).endswith("static_estimate.py") for arg in argv):
        print("static estimate child started", file=sys.stderr, flush=True)
    return run(argv, *args, **kwargs)
subprocess.run = recorded
if sys.argv[1] == "-m":
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(
            ["-m", "laneserve.server.bench.baselines", "raw", "--max-batch-size", "2"],
            id="baselines",
        ),
        pytest.param(
            [
                *(str(REPO / "scripts" / "bench_bulk.py"), "--rows", "256"),
                *("--rows-per-item", "64", "--batch-sizes", "32", "--seconds", "0.1"),
                *("--rounds", "1"),
            ],
            id="bench_bulk",
        ),
        pytest.param(
            [str(REPO / "scripts" / "bench_tracing.py"), "--requests", "10", "--rounds", "1"],
            id="bench_tracing",
        ),
    ],
)
def test_engines_the_bench_makes_for_itself_run_no_static_estimate(
    small_model: Path, command: list[str]
) -> None:
    """Every Engine ran the static estimate's child (~1 s, a peak of twice the weights),
    the baselines' (single, echo, raw: one Engine in main), bench_bulk.py's raw sweep and
    bench_tracing.py's four servers too, though none of them reads it or sets a CPU
    budget. The laneserve server bench_bulk.py starts is a process of its own, and
    estimates as every server does."""
    if command[0] == "-m":
        command = [*command, "--model", str(small_model), "--seconds-per-size", "0.01"]
        command += ["--device", "cpu"]
    done = run_text([sys.executable, "-c", _RECORDING_ESTIMATES, *command], timeout_s=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "static estimate child started" not in done.stderr


# What bench_request_path.py's JSON holds: the document, each tree's run in a round, and
# the figures it compares (a ratio and a median of each).
AB_DOCUMENT_KEYS = {"schema", "settings", "machine", "trees", "rounds", "median", "command"}
AB_FIGURES = {
    "answers_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "event_loop_us_per_request",
    "server_us_per_request",
}
AB_RUN_KEYS = AB_FIGURES | {
    "server_pid",
    "measured_s",
    "sent",
    "ok",
    "not_ok",
    "latency",
    "threads_us_per_request",
    "server_cores",
    "client_cores",
    "machine_busy_cores",
    "other_cores",
    "exit_code",
}


@pytest.mark.slow
@pytest.mark.parametrize("tree_a", ["--a", "--a-rev"])
def test_the_request_path_ab_driver_writes_every_figure_and_leaves_nothing_behind(
    small_model: Path, tmp_path: Path, tree_a: str
) -> None:
    """scripts/bench_request_path.py, which bench/README.md's stop 31 quotes, on a tiny
    load with both trees this checkout (A as its src, or exported from HEAD): every
    figure is in its JSON and every count positive, and neither a server nor an
    exported tree is left. No figure is judged: the machine is shared."""
    if tree_a == "--a-rev" and not (REPO / ".git").exists():
        pytest.skip("--a-rev exports a revision with git: this is not a git checkout")
    scratch = tmp_path / "tmp"  # the script's temporary folders, the exported tree's
    scratch.mkdir()
    out = tmp_path / "ab.json"
    a = str(REPO / "src") if tree_a == "--a" else "HEAD"
    done = run_text(
        [
            sys.executable,
            str(REPO / "scripts" / "bench_request_path.py"),
            *(tree_a, a),
            *("--b", str(REPO / "src")),
            *("--rounds", "1", "--seconds", "0.4", "--warmup-s", "0.1", "--callers", "2"),
            *("--client-procs", "1", "--channels", "1"),
            *("--model", str(small_model), "--json", str(out)),
        ],
        timeout_s=180,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| median of 1 | A |" in done.stdout, done.stdout

    document = json.loads(out.read_text())
    assert set(document) == AB_DOCUMENT_KEYS
    assert document["trees"]["b"]["src"] == str(REPO / "src")
    if tree_a == "--a-rev":
        assert document["trees"]["a"]["rev"] == "HEAD"
        assert len(document["trees"]["a"]["commit"]) == 40
    (only,) = document["rounds"]
    assert only["order"] == ["a", "b"]
    for key in ("a", "b"):
        run = only[key]
        assert set(run) == AB_RUN_KEYS
        assert run["sent"] > 0
        assert run["ok"] > 0
        assert run["measured_s"] > 0
        assert run["exit_code"] == 0, "the server drained and stopped"
        assert all(run[figure] is not None for figure in AB_FIGURES), run
        assert "event loop (main thread)" in run["threads_us_per_request"]
        assert not Path(f"/proc/{run['server_pid']}").exists(), "the server is gone"
    assert set(only["ratio"]) == AB_FIGURES
    assert set(document["median"]["ratio"]) == AB_FIGURES
    assert set(document["median"]["a"]) >= AB_FIGURES
    left = [path.name for path in scratch.iterdir() if path.name.startswith("laneserve-")]
    assert left == [], "the exported tree is removed"


@pytest.mark.parametrize("load", ["0", "-1", "nan", "inf"])
def test_the_admission_simulator_refuses_a_load_it_could_not_draw_naming_the_flag(
    load: str,
) -> None:
    """Arrivals are drawn until one second has passed: a load below 0, NaN or infinity
    never got there, and the list grew by ~150 MB/s; 0 died of a ZeroDivisionError."""
    done = run_text(
        [sys.executable, str(REPO / "scripts" / "simulate_admission.py"), "--loads", load],
        timeout_s=60,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "argument --loads: expected comma-separated positive finite numbers" in done.stderr


def test_a_target_nothing_listens_on_is_refused_naming_it(tmp_path: Path) -> None:
    """GetModel's UNAVAILABLE left `laneserve bench` as a gRPC traceback, exit 1."""
    target = f"127.0.0.1:{refusing_port()}"
    stderr = bench_refused(tmp_path, "--target", target, "--scenarios", "a")
    assert f"laneserve bench: --target {target}: UNAVAILABLE: " in stderr
    assert "expected a reachable laneserve.v1 endpoint" in stderr
    assert not (tmp_path / "out").exists(), "no report of a run that did not happen"


def test_a_server_that_stops_answering_mid_run_ends_the_run_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server under test that exited mid-run (its GetStats at a window boundary got
    UNAVAILABLE) left `laneserve bench` as a gRPC traceback, exit 1, though every process
    it started was stopped."""
    target = f"127.0.0.1:{refusing_port()}"
    with pytest.raises(procs.ServerError, match=f"GetStats on {target}: UNAVAILABLE: "):
        get_stats(target)

    def server_gone(_settings: BenchSettings) -> dict[str, Any]:
        raise procs.ServerError(f"GetStats on {target}: UNAVAILABLE: gone")

    monkeypatch.setattr(bench_cli, "run_bench", server_gone)
    args = _parser().parse_args(["bench", "--no-raw", "--scenarios", "a"])
    assert bench_cli.run(args, ["laneserve", "bench"]) == 2


def test_the_load_generator_and_top_do_not_load_the_server() -> None:
    """`laneserve.server` imported the whole server, ONNX Runtime included, for any of
    its submodules: each load-generator process (and `laneserve top`) mapped the
    runtime's libraries, sharing their pages with the server under test and so
    lowering its measured PSS. Its names are imported when first used now."""
    probe = (
        "import sys\n"
        "import laneserve.server.bench.loadgen, laneserve.server.top\n"
        "print(sorted(m for m in ('onnxruntime', 'laneserve.server.engine') if m in sys.modules))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert loaded.stdout.strip() == "[]"
