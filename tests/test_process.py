"""The interpreter settings `laneserve serve` applies once started, and a served process
whose stderr is not read."""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from laneserve.server.process import (
    GC_THRESHOLDS,
    GIL_SWITCH_INTERVAL_S,
    STOP_SIGNALS,
    catch_stop_signals_early,
    release_stop_signals,
    stop_signals_taken,
    tune_for_serving,
)
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import (
    REPO,
    SERVE,
    START_TIMEOUT_S,
    output,
    request,
    rows,
    stderr_lines_until,
)


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
        assert ": stopped event=shutdown drained=true" in events[1]
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


def _console_script_target() -> tuple[str, str]:
    """The module and function of the `laneserve` script, as pyproject.toml names them."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["laneserve"].split(":")
    return module, function


def _console_script() -> list[str]:
    """What the installed `laneserve` script runs (pip's script imports the function and
    exits with what it returns)."""
    module, function = _console_script_target()
    return [
        sys.executable,
        "-c",
        f"import sys; from {module} import {function}; sys.exit({function}())",
    ]


def test_the_console_scripts_module_imports_neither_the_runtime_nor_grpc() -> None:
    """The script's module was the CLI's, whose imports load ONNX Runtime and gRPC (about
    a second) before any handler of the stop signals could exist."""
    module, _ = _console_script_target()
    check = (
        f"import sys, {module}\n"
        "heavy = {'onnxruntime', 'grpc', 'numpy', 'laneserve.server.cli'} & set(sys.modules)\n"
        "assert not heavy, sorted(heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


# The two ways of running the command line: the installed `laneserve` script, and
# `python -m laneserve.server.cli` (the benchmark's servers, the tests' and scripts'
# shims, container images), as `python -m` runs it.
ENTRIES = {
    "console script": _console_script(),
    "python -m": [
        sys.executable,
        "-c",
        (
            "import runpy; runpy.run_module('laneserve.server.cli', run_name='__main__', "
            "alter_sys=True)"
        ),
    ],
}


def _entry(name: str, prelude: str = "") -> list[str]:
    """`ENTRIES[name]` with `prelude` run first, in the same process."""
    python, flag, code = ENTRIES[name]
    return [python, flag, f"{prelude}\n{code}"]


# Holds the process at its first import of a heavy module (ONNX Runtime, gRPC, numpy:
# the second or so before `serve` handles the stop signals) until a line arrives on
# stdin, first writing which stop signals have a handler then. SIGINT and SIGHUP start
# at their defaults, as a terminal's session leaves them (the test's own are whatever its
# runner's were: ignored ones are kept, see test_a_sigint_ignored_at_start_stays_ignored).
# The wait returns to Python every 50 ms: a Python handler runs between bytecodes, and a
# signal that came after the line was written but before a blocking read began met no
# read to interrupt (the read blocked on, its handler never ran: 2 of 300 runs under
# load, a red CI run). The imports it stands for run bytecode all along.
HELD_AT_FIRST_HEAVY_IMPORT = """
import select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
class HeldAtFirstHeavyImport:
    def find_spec(self, name, path=None, target=None):
        if name in ("grpc", "numpy", "onnxruntime"):
            sys.meta_path.remove(self)
            stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
            caught = [s.name for s in stops if callable(signal.getsignal(s))]
            print("importing", name, "caught", *caught, file=sys.stderr, flush=True)
            while not select.select([sys.stdin], [], [], 0.05)[0]:
                pass
            sys.stdin.readline()
        return None
sys.meta_path.insert(0, HeldAtFirstHeavyImport())
"""

# `serve`'s arguments for a process stopped before it reads them.
NEVER_READ = ("serve", "--model", "absent.onnx", "--port", "0", "--metrics-port", "-1")


def _held_at_first_heavy_import(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*command, *NEVER_READ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _first_line(process: subprocess.Popen[str]) -> str:
    """The first line of `process`'s stderr; a process that writes none within the start
    timeout is killed (its stderr ends: the test fails instead of hanging)."""
    assert process.stderr is not None
    watchdog = threading.Timer(START_TIMEOUT_S, process.kill)
    watchdog.start()
    try:
        return process.stderr.readline()
    finally:
        watchdog.cancel()


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_each_entry_catches_the_stop_signals_before_its_heavy_imports(entry: str) -> None:
    """`python -m laneserve.server.cli` caught them only once the CLI's imports were
    done (a second, twice with JSON logs' restart): as PID 1 a SIGTERM meanwhile was
    ignored (test_a_sigterm_in_the_heavy_imports_of_pid_1_exits_143). Caught at the first
    heavy import, a SIGTERM ends the process by that signal."""
    with _held_at_first_heavy_import(_entry(entry, HELD_AT_FIRST_HEAVY_IMPORT)) as process:
        try:
            line = _first_line(process)
            assert line.split()[2:] == ["caught", "SIGTERM", "SIGINT", "SIGHUP"], line
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=START_TIMEOUT_S) == -signal.SIGTERM
        finally:
            if process.poll() is None:
                process.kill()


@functools.cache
def _as_pid_1() -> tuple[str, ...]:
    """What runs a command as PID 1 of a new PID namespace (`unshare`, in a user
    namespace of its own); () where this user cannot (no unshare, or user namespaces
    off, as in many containers), or where /proc lists no process's children (`_child`)."""
    unshare = shutil.which("unshare")
    if unshare is None or not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        return ()
    prefix = (unshare, "--user", "--map-root-user", "--pid", "--fork")
    done = subprocess.run(
        [*prefix, sys.executable, "-c", ""], capture_output=True, timeout=60, check=False
    )
    return prefix if done.returncode == 0 else ()


def _child(pid: int) -> int:
    """The one child of process `pid`, once it has one."""
    until_s = time.monotonic() + START_TIMEOUT_S
    children = Path(f"/proc/{pid}/task/{pid}/children")
    while not (found := children.read_text().split()):
        assert time.monotonic() < until_s, "no child"
        time.sleep(0.01)
    (child,) = found
    return int(child)


@pytest.mark.slow
@pytest.mark.skipif(not _as_pid_1(), reason="needs unshare and user namespaces")
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_sigterm_in_the_heavy_imports_of_pid_1_exits_143(entry: str) -> None:
    """A container's entrypoint: as PID 1 a signal with no handler is ignored, and
    `python -m laneserve.server.cli` (the benchmark's and many images' command) lost a
    SIGTERM in its imports, the pod waiting out its whole termination grace period. The
    kernel drops the process's own signal too (`die_by_signal`): it exits 128 + 15."""
    command = [*_as_pid_1(), *_entry(entry, HELD_AT_FIRST_HEAVY_IMPORT)]
    with _held_at_first_heavy_import(command) as process:
        try:
            pid_1 = _child(process.pid)  # unshare's: PID 1 in its namespace
            assert "importing" in _first_line(process)
            os.kill(pid_1, signal.SIGTERM)
            assert process.wait(timeout=START_TIMEOUT_S) == 128 + signal.SIGTERM
        finally:
            if process.poll() is None:
                process.kill()  # unshare: its namespace's processes go with it


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_sigterm_before_serve_handles_signals_ends_the_process_at_once(
    tmp_path: Path, log_format: str, entry: str
) -> None:
    """After the imports (and JSON logs' restart), before `serve`'s own handlers: a
    SIGTERM ends the process at once, by that signal. Outside PID 1 that was the default
    action (killed, -15); the early handler exited 128 + 15 instead, which systemd counts
    as a failed stop where the death by SIGTERM is a clean one. Held where it provably
    is: reading its config file, a FIFO nobody has written to yet."""
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    # No GRPC_VERBOSITY: with JSON logs the process starts itself again (exec) first.
    environ = {name: value for name, value in os.environ.items() if name != "GRPC_VERBOSITY"}
    process = subprocess.Popen(
        [
            *ENTRIES[entry],
            *("--log-format", log_format, "serve", "--model", str(tmp_path / "m.onnx")),
            *("--config", str(fifo), "--port", "0", "--metrics-port", "-1"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=environ,
    )
    writer = -1
    try:
        writer = _open_once_read(fifo, process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=START_TIMEOUT_S) == -signal.SIGTERM
    finally:
        if writer >= 0:
            os.close(writer)
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate(timeout=START_TIMEOUT_S)
    assert b"Traceback" not in stderr, stderr.decode()


def _open_once_read(fifo: Path, process: subprocess.Popen[bytes]) -> int:
    """The FIFO's write end, opened once `process` is opening it to read (it then waits
    in its read for data that never comes)."""
    until_s = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as error:
            if error.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
        assert process.poll() is None, f"exited {process.returncode} before reading its config"
        assert time.monotonic() < until_s, "never read its config"
        time.sleep(0.01)


def test_early_stop_handlers_are_released_as_they_were() -> None:
    """`laneserve top` and the other commands take signals their own way: Ctrl-C raises
    KeyboardInterrupt again once released. A SIGHUP ignored at start (nohup) stays so.
    (SIGINT as Python sets it, whatever the test runner's: an ignored one stays so too,
    see test_a_sigint_ignored_at_start_stays_ignored.)"""
    before = {
        signum: signal.getsignal(signum)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        catch_stop_signals_early()
        assert signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        release_stop_signals()
        assert signal.getsignal(signal.SIGINT) == signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        release_stop_signals()
        for signum, handler in before.items():
            if handler is not None:
                signal.signal(signum, handler)


def test_a_sigint_ignored_at_start_stays_ignored() -> None:
    """A background job of a non-interactive shell (`laneserve serve &` in a script)
    starts with SIGINT ignored, so that the script's Ctrl-C is not the job's: the early
    handler took it, and so did `serve`, and the script's Ctrl-C stopped the server. Left
    ignored by both, as SIGHUP under `nohup` (`serve`: see test_cli's
    test_a_stop_signal_ignored_at_start_stays_ignored)."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        catch_stop_signals_early()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert callable(signal.getsignal(signal.SIGTERM))
        assert signal.SIGINT not in stop_signals_taken()  # what `serve` handles
        release_stop_signals()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        release_stop_signals()
        for signum, handler in before.items():
            if handler is not None:
                signal.signal(signum, handler)


# The variables by which ONNX Runtime takes a process for a CI job and sends nothing
# (the strings in its library): removed, so the child below runs as a server on a plain
# machine would.
_ORT_CI_VARIABLES = (
    "TF_BUILD",
    "GITHUB_ACTIONS",
    "GITLAB_CI",
    "CIRCLECI",
    "TRAVIS",
    "JENKINS_URL",
    "CODEBUILD_BUILD_ID",
    "BUILDKITE",
    "TEAMCITY_VERSION",
    "APPVEYOR",
    "BITBUCKET_BUILD_NUMBER",
    "ORT_RUNNING_UNIT_TESTS",
)

# Run in a child: records ORT_DISABLE_TELEMETRY as it stands when `onnxruntime` is first
# imported (ONNX Runtime reads it then), and prints it once the server's engine is imported.
_TELEMETRY_AT_ORT_IMPORT = """
import os, sys

class _Recorder:
    seen = "not imported"

    def find_spec(self, name, path=None, target=None):
        if name == "onnxruntime" and _Recorder.seen == "not imported":
            _Recorder.seen = os.environ.get("ORT_DISABLE_TELEMETRY", "unset")
        return None

sys.meta_path.insert(0, _Recorder())
import laneserve.server.engine
print(_Recorder.seen)
"""


@pytest.mark.parametrize(("setting", "seen"), [(None, "1"), ("0", "0"), ("1", "1")])
def test_the_server_keeps_onnx_runtime_telemetry_off_unless_told(
    tmp_path: Path, setting: str | None, seen: str
) -> None:
    """ONNX Runtime 1.29+ writes a device id under ~/.cache/Microsoft and uploads usage
    events when it is imported, unless ORT_DISABLE_TELEMETRY is set by then: importing
    the server sets it to 1 before the runtime is imported, and an operator's own value
    (0: send) is kept. What the runtime saw is recorded at its import; with telemetry
    off, no device id file may appear either. (Whether the runtime writes one when
    telemetry is on depends on the machine: a CI machine's runtime wrote none, so that
    side is not asserted.)"""
    env = {k: v for k, v in os.environ.items() if k not in _ORT_CI_VARIABLES}
    env.pop("ORT_DISABLE_TELEMETRY", None)  # the test package sets it for its own runs
    if setting is not None:
        env["ORT_DISABLE_TELEMETRY"] = setting
    env["HOME"] = str(tmp_path)
    env["XDG_CACHE_HOME"] = str(tmp_path / ".cache")  # where ONNX Runtime looks first
    done = subprocess.run(
        [sys.executable, "-c", _TELEMETRY_AT_ORT_IMPORT],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == seen, done.stdout
    if seen == "1":
        assert not list(tmp_path.rglob("deviceid"))


# `laneserve serve` whose start-up probe holds at its first batch size until a line
# arrives on stdin, and says on stderr which sizes it times (a large model's probe: tens
# of seconds). The engine's own timing runs once released: nothing is faked.
# SIGINT starts at its default, as a terminal's session leaves it (a test run in the
# background of a non-interactive shell ignores it, and a server keeps it ignored).
# The stop signal's handler is held where it has ended the estimates, just after its
# "while starting" line, until the released probe has checked for a stop before its next
# size (10 s at most), as a loaded machine's slow turn of the main thread would hold it.
# The log's own thread writes the line meanwhile and the test releases the probe on it:
# a stop the handler set only after the line was missed (the next size was timed).
HELD_IN_PROBE = """
import signal, sys, threading
signal.signal(signal.SIGINT, signal.SIG_DFL)
from laneserve.server import cli, probe
time_rows, check_not_stopping, stop_estimates = (
    probe._time_rows, probe._check_not_stopping, cli.stop_estimates
)
released, checked = threading.Event(), threading.Event()
def held(engine, rows, repeats):
    sys.stderr.write(f"probe timing {rows} rows\\n")  # one write: log lines go between
    sys.stderr.flush()
    if rows == 1:
        sys.stdin.readline()
        released.set()
    return time_rows(engine, rows, repeats)
def check_then_tell(stopping):
    try:
        check_not_stopping(stopping)
    finally:
        if released.is_set():
            checked.set()
def stop_estimates_then_hold():
    stop_estimates()
    checked.wait(10)
probe._time_rows = held
probe._check_not_stopping = check_then_tell
cli.stop_estimates = stop_estimates_then_hold
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_during_the_probe_skips_its_remaining_sizes(
    small_model: Path, stop: signal.Signals
) -> None:
    """A SIGTERM while starting waited for the whole load and probe (a 1.5 GiB model:
    18.8 s from the signal), though nothing would be served. The probe stops before its
    next batch size: no `probe` line, and the start ends as stopped before serving (exit
    0). The load itself is announced first (`loading`, with the model's size): a log
    that said nothing for tens of seconds."""
    command = [sys.executable, "-c", HELD_IN_PROBE, "serve", "--model", str(small_model)]
    with subprocess.Popen(
        [*command, "--port", "0", "--metrics-port", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdin is not None
        assert process.stderr is not None
        try:
            before = stderr_lines_until(process, "probe timing 1 rows")
            process.send_signal(stop)
            before += stderr_lines_until(process, f"{stop.name} while starting")
            process.stdin.write("\n")
            process.stdin.flush()
            watchdog = threading.Timer(START_TIMEOUT_S, process.kill)  # fails, not hangs
            watchdog.start()
            try:
                after = process.stderr.read()
            finally:
                watchdog.cancel()
            assert process.wait(timeout=START_TIMEOUT_S) == 0
        finally:
            if process.poll() is None:
                process.kill()
    assert "stopped before serving" in after
    assert "probe timing" not in after, "a batch size after the signal was timed"
    assert " probe: " not in after
    assert "serving " not in after.replace("stopped before serving", "")
    loading = [line for line in [*before, *after.splitlines()] if " loading " in line]
    assert len(loading) == 1, before
    assert f"file_bytes={small_model.stat().st_size}" in loading[0]


# Holds the static memory estimate's child (`python static_estimate.py MODEL SHAPES`)
# before it reads the model, writing its pid to the file named by
# LANESERVE_TEST_ESTIMATE_PID: a large model's estimate (up to 120 s, GBs resident).
# Every other process on that PYTHONPATH goes on untouched.
HELD_ESTIMATE_SITECUSTOMIZE = """
import os, sys, time
if any(arg.endswith("static_estimate.py") for arg in sys.orig_argv):
    with open(os.environ["LANESERVE_TEST_ESTIMATE_PID"], "w") as pid_file:
        pid_file.write(str(os.getpid()))
    time.sleep(600)
"""


def _children(pid: int) -> set[int]:
    """The children of process `pid`, each thread's (/proc lists them by the thread
    that started them: the estimate's is the loading thread's)."""
    children: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        # A thread that ended meanwhile: before the open, or the read (ESRCH).
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            children.update(int(child) for child in (task / "children").read_text().split())
    return children


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not: it has ended, unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or the read
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="reads processes from /proc")
def test_a_stop_signal_while_starting_ends_the_static_estimate_child(
    small_model: Path, tmp_path: Path
) -> None:
    """A stop signal while starting ends the static estimate's child (its answer would go
    unused: the start waited up to 120 s for it), and the second signal ends the process
    at once (`die_by_signal`): the child, still parsing the model, had run on (PPID 1,
    GBs resident)."""
    customize = tmp_path / "customize"
    customize.mkdir()
    (customize / "sitecustomize.py").write_text(HELD_ESTIMATE_SITECUSTOMIZE)
    pid_file = tmp_path / "estimate.pid"
    environ = dict(os.environ, LANESERVE_TEST_ESTIMATE_PID=str(pid_file))
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(customize), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    process = subprocess.Popen(
        [*SERVE, "--model", str(small_model), "--port", "0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=environ,
    )
    estimate_pid = None
    try:
        until_s = time.monotonic() + START_TIMEOUT_S
        while not pid_file.exists() or not pid_file.read_text():  # held, before the model
            assert process.poll() is None, "the server ended before its estimate started"
            assert time.monotonic() < until_s, "the estimate child never started"
            time.sleep(0.01)
        estimate_pid = int(pid_file.read_text())
        assert estimate_pid in _children(process.pid)
        process.send_signal(signal.SIGTERM)
        stderr_lines_until(process, "SIGTERM while starting")
        until_s = time.monotonic() + START_TIMEOUT_S
        while _alive(estimate_pid):  # the first signal ends it
            assert time.monotonic() < until_s, "the estimate child outlived the first signal"
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)  # not SIGTERM again: that may count as one
        assert process.wait(timeout=START_TIMEOUT_S) in (0, -signal.SIGINT)
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=START_TIMEOUT_S)
        if estimate_pid is not None and _alive(estimate_pid):
            os.kill(estimate_pid, signal.SIGKILL)
