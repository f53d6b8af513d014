"""`laneserve serve` as a real process: start-up, bad configuration, SIGTERM drain."""

from __future__ import annotations

import argparse
import asyncio
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from laneserve.client import cli as client_cli
from laneserve.server import ManualClock, ServerConfig
from laneserve.server import cli as server_cli
from laneserve.server.engine import Engine
from laneserve.server.errors import EngineStartError
from laneserve.server.lifecycle import REPEAT_WINDOW_S, Lifecycle, SignalMeaning, StopSignals
from laneserve.server.providers import CPU, CUDA, choose_providers, gpu_present
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import (
    REPO,
    SERVE,
    RecordingEngine,
    ServerProcess,
    health_status,
    no_input_model,
    one_running_and_queued,
    output,
    queued_never_ran_as_the_drain_ended,
    request,
    rich_status,
    rows,
    run_text,
    serving,
    stderr_lines_until,
    until,
    unused_port,
)


@pytest.fixture(autouse=True)
def sigint_reaches_the_servers() -> Iterator[None]:
    """The servers started here keep SIGINT ignored where their parent left it ignored
    (test_a_stop_signal_ignored_at_start_stays_ignored): under a test run that ignores it
    (a background job of a non-interactive shell, some CI runners) the tests' Ctrl-Cs
    would never arrive. Handled in this process meanwhile, it starts them at its default."""
    before = signal.getsignal(signal.SIGINT)
    if before != signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
def server_process(small_model: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(small_model), "--port", "0", "--metrics-port", "0"])
    try:
        yield server
    finally:
        server.close()


def checkout_set_up(root: Path, model: Path) -> Path:
    """The path of scripts/serve copied, with the _env.sh it sources, into `root`: a
    checkout already set up as the script leaves one, so that it neither builds a model
    nor installs anything (run in the repository, it built a 21 MB models/demo.onnx there
    on a fresh checkout). Its demo model is a link to `model`; its .venv has the install
    stamp of the copied pyproject.toml and runs this test's Python: `laneserve` as the
    server's CLI, `python` for _env.sh's `-c` checks alone (a pip install is refused)."""
    (root / "scripts").mkdir(parents=True)
    for name in ("serve", "_env.sh"):
        shutil.copy2(REPO / "scripts" / name, root / "scripts" / name)
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "models").mkdir()
    (root / "models" / "demo.onnx").symlink_to(model)
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    shims = {
        "python": '[ "$1" = -c ] || { echo "not a -c check: $*" >&2; exit 1; }\n'
        f'exec "{sys.executable}" "$@"',
        "laneserve": f'exec "{sys.executable}" -m laneserve.server.cli "$@"',
    }
    for name, body in shims.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    digest = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()
    (root / ".venv" / ".laneserve-installed-base").write_text(f"{digest}\n")
    return root / "scripts" / "serve"


def test_scripts_serve_takes_host_and_port_from_a_config_file(
    tmp_path: Path, small_model: Path
) -> None:
    """./scripts/serve passed --host and --port itself, and flags beat the file: the
    README's `./scripts/serve --config laneserve.toml` ignored the file's port. Run from
    another directory, a relative --config is the caller's: the script changes to the
    repository to set up, and looked for it there."""
    script = checkout_set_up(tmp_path / "checkout", small_model)
    caller_dir = tmp_path / "elsewhere"
    caller_dir.mkdir()
    port = unused_port()
    config = caller_dir / "laneserve.toml"
    config.write_text(f'[server]\nhost = "127.0.0.1"\nport = {port}\nmetrics_port = -1\n')
    server = ServerProcess(["--config", config.name], command=[str(script)], cwd=caller_dir)
    try:
        assert server.port() == port
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=30) == 0
    finally:
        server.close()


@pytest.mark.parametrize("flag", ["--model", "--model="])
def test_scripts_serve_serves_the_model_given_and_builds_no_demo_model(
    tmp_path: Path, small_model: Path, flag: str
) -> None:
    """`./scripts/serve --model X` built the 21 MB demo model first (where missing), then
    passed `--model demo.onnx --model X` (argparse took the last): X alone is named, and
    the demo model is neither built nor read. Relative to the caller's directory."""
    script = checkout_set_up(tmp_path / "checkout", small_model)
    demo = tmp_path / "checkout" / "models" / "demo.onnx"
    demo.unlink()  # a fresh checkout's: the script would build it
    caller_dir = tmp_path / "elsewhere"
    caller_dir.mkdir()
    shutil.copy2(small_model, caller_dir / "mine.onnx")
    arguments = [flag, "mine.onnx"] if flag == "--model" else [f"{flag}mine.onnx"]
    server = ServerProcess(
        [*arguments, "--port", "0", "--metrics-port", "-1"],
        command=[str(script)],
        cwd=caller_dir,
    )
    try:
        server.wait_for(r"serving .* on 127\.0\.0\.1:(\d+)")
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=30) == 0
        server.rest()
    finally:
        server.close()
    said = "".join(server.log)
    assert "loading mine.onnx" in said, said
    assert "demo" not in said
    assert not demo.exists()


@pytest.mark.parametrize("interpreter", ["/bin/true", "/bin/false"])
def test_scripts_serve_refuses_an_interpreter_that_is_not_python_keeping_the_venv(
    tmp_path: Path, small_model: Path, interpreter: str
) -> None:
    """LANESERVE_PYTHON=/bin/true passed the 3.11+ check (an exit status alone), read as
    "Python " of no version against the venv's: the working .venv was removed, `true -m
    venv` made nothing, and the script failed on a missing .venv/bin/python."""
    script = checkout_set_up(tmp_path / "checkout", small_model)
    done = run_text(
        [str(script), "--help"],
        timeout_s=60,
        env={**os.environ, "LANESERVE_PYTHON": interpreter},
    )
    assert done.returncode == 1
    assert done.stderr == (
        f"laneserve: '{interpreter}' is not a Python interpreter (it did not report a "
        "version); install Python 3.11+ or set LANESERVE_PYTHON\n"
    )
    assert (tmp_path / "checkout" / ".venv" / ".laneserve-installed-base").exists()


def test_sigterm_drains_and_exits_cleanly(server_process: ServerProcess) -> None:
    port = int(server_process.wait_for(r"serving .* on 127\.0\.0\.1:(\d+)").group(1))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        # The health stubs' types lack the RPC attributes; the call itself is plain.
        health: Any = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        response = pb_grpc.InferenceServiceStub(channel).Infer(request(rows(3)), timeout=10)
        assert output(response).shape == (3, 10)
    server_process.process.send_signal(signal.SIGTERM)
    server_process.wait_for(r"SIGTERM: draining")
    server_process.wait_for(r"stopped")
    assert server_process.process.wait(timeout=30) == 0


# A server's ports where a test does not care which: the defaults (50051, 9464) may be
# held by another test running at once, or by a server on this machine.
_ANY_PORTS = ("--port", "0", "--metrics-port", "-1")


def refused_at_start(*args: str, env: dict[str, str] | None = None) -> str:
    """Runs `laneserve serve ARGS`, which must refuse to start (exit 2); its stderr. Any
    free port unless ARGS name one: the defaults are checked at start, and another test
    or a server on this machine may hold them."""
    return refused(*SERVE[3:], "--port", "0", *args, env=env)


def refused(*args: str, env: dict[str, str] | None = None) -> str:
    """Runs `laneserve ARGS` (in `env`: this one's by default), which must refuse (exit 2)
    with no traceback; its stderr."""
    done = run_text(
        [sys.executable, "-m", "laneserve.server.cli", *args],
        timeout_s=60,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def test_make_model_refuses_a_path_it_cannot_write_naming_what_is_in_the_way(
    tmp_path: Path,
) -> None:
    """A directory was an IsADirectoryError traceback, a file in the way of a parent a
    FileExistsError one."""
    in_the_way = tmp_path / "afile"
    in_the_way.write_text("")
    expected = {
        tmp_path: "is a directory; expected the path of the file to write",
        in_the_way / "x.onnx": f"{in_the_way} is not a directory; expected a path whose",
        in_the_way / "sub" / "x.onnx": f"{in_the_way} is not a directory; expected a path whose",
    }
    for path, message in expected.items():
        stderr = refused("make-model", str(path))
        assert stderr.startswith(f"laneserve: make-model {path}: {message}"), stderr
        assert stderr.count("\n") == 1, stderr
    assert in_the_way.read_text() == ""


def test_make_model_refuses_a_negative_seed_before_building(tmp_path: Path) -> None:
    """numpy refused it deep inside the build, with a traceback."""
    target = tmp_path / "x.onnx"
    stderr = refused("make-model", str(target), "--seed", "-1")
    assert "argument --seed: expected an integer >= 0, got '-1'" in stderr
    assert not target.exists()


def test_bad_config_is_refused_naming_the_key(tmp_path: Path, small_model: Path) -> None:
    config = tmp_path / "laneserve.toml"
    config.write_text(
        "[[lanes]]\n"
        'name = "fast"\n'
        "capacity_rows = -4\n"
        "timeout_ms = 10\n"
        "max_wait_ms = 1\n"
        "min_share = 0.0\n"
    )
    stderr = refused_at_start("--model", str(small_model), "--config", str(config))
    assert "lanes['fast'].capacity_rows" in stderr


def test_missing_model_is_refused(tmp_path: Path) -> None:
    stderr = refused_at_start("--model", str(tmp_path / "absent.onnx"))
    assert "cannot load model" in stderr


def test_a_model_file_that_is_not_onnx_is_refused_saying_what_was_expected(
    tmp_path: Path,
) -> None:
    """ONNX Runtime's own message ("INVALID_PROTOBUF ... Protobuf parsing failed") named
    what went wrong inside the runtime, not what the file should have been."""
    model = tmp_path / "model.json"
    model.write_text('{"not": "a model"}\n', encoding="utf-8")
    stderr = refused_at_start("--model", str(model), "--port", "0")
    assert f"cannot load model {str(model)!r}: " in stderr
    assert stderr.rstrip().endswith("expected an ONNX model file that this onnxruntime can run")


def test_log_flags_are_taken_after_serve_too(tmp_path: Path) -> None:
    """`./scripts/serve --log-format json` (the script puts its arguments after `serve`)
    was refused "unrecognized arguments": JSON logs needed `laneserve --log-format json
    serve`, which the script cannot pass."""
    absent = str(tmp_path / "absent.onnx")
    stderr = refused_at_start("--model", absent, "--log-format", "json", "--log-level", "info")
    line = json.loads(stderr.strip().splitlines()[-1])
    assert line["event"] == "startup_failed"
    assert "cannot load model" in line["message"]


@pytest.mark.parametrize(
    "args",
    [
        ("--log-format", "json", "serve", "--model", "m.onnx", "--port", "abc"),
        ("serve", "--log-format=json", "--model", "m.onnx", "--bogus"),
        ("--log-format", "json"),
        ("--log-format", "json", "top", "--iterations", "0"),  # top's own check
    ],
)
def test_a_command_line_refused_under_json_logs_is_one_json_line(args: tuple[str, ...]) -> None:
    """argparse wrote its usage and error as text, before logging was set up: a log
    shipper reading JSON lines got ~20 lines it could not parse. The refusal is one JSON
    line naming what was wrong."""
    stderr = refused(*args)
    (line,) = [json.loads(text) for text in stderr.splitlines()]
    assert line["event"] == "usage_error"
    assert line["exit_code"] == 2
    assert line["message"].startswith("laneserve")


def test_a_model_file_that_cannot_be_read_is_refused_before_the_load(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model file the server may not read (root reads any, so its open is made to
    fail here) came out as ONNX Runtime's "system error number 13", after the static
    estimate's child had started and warned twice: refused first, in the system's words."""
    opened = Path.open

    def refusing_open(path: Path, *args: Any, **kwargs: Any) -> Any:
        if path == small_model:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refusing_open)
    with pytest.raises(EngineStartError) as caught:
        Engine(str(small_model), device="cpu")
    assert str(caught.value) == (
        f"cannot load model {str(small_model)!r}: Permission denied; expected an ONNX model file"
    )


def test_log_settings_are_taken_after_every_command_as_after_serve() -> None:
    """`laneserve top --log-format json` was refused as an unrecognized argument (the
    log settings were the top-level parser's, and serve's alone again after it)."""
    stderr = refused("top", "--log-format", "json", "--iterations", "0")
    (line,) = [json.loads(text) for text in stderr.splitlines()]
    assert line["event"] == "usage_error"
    assert "--iterations" in line["message"]
    assert "unrecognized" not in line["message"]


def test_a_model_path_that_is_a_directory_is_refused_saying_so(tmp_path: Path) -> None:
    """ONNX Runtime's own message was INVALID_PROTOBUF, "Protobuf parsing failed"."""
    stderr = refused_at_start("--model", str(tmp_path), "--port", "0")
    assert stderr == (
        f"laneserve: cannot load model {str(tmp_path)!r}: is a directory; expected an ONNX "
        "model file\n"
    )


def test_cuda_without_a_usable_gpu_is_a_start_up_error(small_model: Path) -> None:
    """`--device cuda` never falls back silently to the CPU."""
    if CUDA in ort.get_available_providers() and gpu_present():
        # On a machine with a GPU the same request must get CUDA first.
        assert choose_providers("cuda") == [CUDA, CPU]
        return
    stderr = refused_at_start("--model", str(small_model), "--device", "cuda", "--port", "0")
    assert "--device cuda:" in stderr
    assert "or --device auto / cpu to run on the CPU" in stderr


def test_unreadable_tls_file_is_refused_naming_the_setting_before_the_model_loads(
    tmp_path: Path,
) -> None:
    """The model named is absent too: the TLS file is reported first (it was found only
    once the model had loaded and been probed, minutes for a large one)."""
    (tmp_path / "server.key").write_text("not used: the certificate is missing\n")
    stderr = refused_at_start(
        "--model",
        str(tmp_path / "absent.onnx"),
        "--tls-cert",
        str(tmp_path / "absent.pem"),
        "--tls-key",
        str(tmp_path / "server.key"),
    )
    assert "--tls-cert: cannot read" in stderr
    assert "absent.pem" in stderr


def test_tls_files_that_are_not_pem_are_refused_naming_the_settings(
    tmp_path: Path, small_model: Path
) -> None:
    """gRPC itself takes any bytes and fails later with "Failed to bind"."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    stderr = refused_at_start(
        "--model", str(small_model), "--tls-cert", str(garbage), "--tls-key", str(garbage)
    )
    assert "--tls-cert, --tls-key:" in stderr
    assert "are not a PEM certificate (chain) and its private key" in stderr
    assert "Traceback" not in stderr


# `serve` flags, a value of which the config or the start refuses, and the refusal's
# message. Stand-ins for values made by the test: BUSY, a port another socket listens
# on; NOT_PEM, a file that is not PEM; ABSENT, a file that does not exist.
REFUSED_FLAGS = [
    (("--port", "70000"), "--port: expected an integer in [0, 65535], got 70000"),
    (("--priority-port", "-2"), "--priority-port: expected an integer in [-1, 65535], got -2"),
    (
        ("--max-batch-size", "0"),
        "--max-batch-size: expected an integer in [1, 4294967295], got 0",
    ),
    (("--batch-cap", "0"), "--batch-cap: expected an integer >= 1, got 0"),
    (
        ("--batch-cap", "999"),
        (
            "--batch-cap: expected at most server.max_batch_size (128), got 999; raise "
            "max_batch_size (--max-batch-size) for a larger cap"
        ),
    ),
    (("--drain-grace-s", "nan"), "--drain-grace-s: expected seconds in [0, 3600], got nan"),
    (("--drain-delay-s", "-1"), "--drain-delay-s: expected seconds in [0, 3600], got -1.0"),
    (
        ("--max-message-bytes", "10"),
        "--max-message-bytes: expected an integer in [1024, 2147483647], got 10",
    ),
    (
        ("--max-concurrent-rpcs", "0"),
        "--max-concurrent-rpcs: expected an integer in [1, 2147483647], got 0",
    ),
    (
        ("--max-pending-calls", "0"),
        "--max-pending-calls: expected an integer in [1, 2147483647], got 0",
    ),
    (
        ("--priority-max-pending-calls", "0"),
        "--priority-max-pending-calls: expected an integer in [1, 2147483647], got 0",
    ),
    (
        ("--intra-op-threads", "2000"),
        "--intra-op-threads: expected an integer in [0, 1024], got 2000",
    ),
    (("--metrics-port", "-5"), "--metrics-port: expected an integer in [-1, 65535], got -5"),
    (("--http-port", "65536"), "--http-port: expected an integer in [-1, 65535], got 65536"),
    (
        ("--probe-shape", "input=0"),
        (
            "--probe-shape: expected NAME=D1,D2,... (an input and its sizes after the row "
            "axis, each in [1, 4294967295], e.g. image=3,224,224), got 'input=0'"
        ),
    ),
    # The memory sizes named their flag beside the key already.
    (
        ("--memory-limit", "100"),
        (
            "server.memory_limit (--memory-limit): memory limit '100' is 100 bytes; "
            "expected at least 1MiB, or a fraction of device memory in (0, 1] such as 0.9"
        ),
    ),
    (
        ("--host-memory-limit", "0.5"),
        (
            "server.host_memory_limit (--host-memory-limit): memory limit '0.5': expected "
            "bytes like 6GiB, not a fraction"
        ),
    ),
    (("--host", ""), "--host: expected a non-empty string, got ''"),
    # A bound another flag set is named by that flag.
    (
        ("--max-batch-size", "2", "--batch-cap", "5"),
        (
            "--batch-cap: expected at most --max-batch-size (2), got 5; raise "
            "max_batch_size (--max-batch-size) for a larger cap"
        ),
    ),
    (
        ("--port", "40123", "--metrics-port", "40123"),
        "--metrics-port: expected a port other than --port, got 40123 for both",
    ),
    # Refused as the server starts: the ports, the TLS files, the model's inputs.
    (
        ("--host", "192.0.2.1"),
        (
            "--host: cannot listen on 192.0.2.1:0: Cannot assign requested address; "
            "expected an address of this host, or a name that resolves to one"
        ),
    ),
    # The system resolves it (the check above passes); gRPC's resolver does not, and its
    # bind failed after the model had loaded, named as the port's fault.
    *[
        (
            ("--host", host),
            (
                f"--host: gRPC cannot listen on '{host}' as the system reads it (an address "
                "gRPC reads otherwise, or not at all); expected an IP address or a host "
                f"name ({how})"
            ),
        )
        for host, how in (
            ("127.1", "an IPv4 address is written in full, without leading zeros: 127.0.0.1"),
            ("0", "an IPv4 address is written in full, without leading zeros: 127.0.0.1"),
            ("127.0.0.010", "an IPv4 address is written in full, without leading zeros: 127.0.0.1"),
            ("[::1", "brackets hold an IPv6 address, [::1]"),
        )
    ],
    *[
        (
            (flag, "BUSY"),
            (
                f"{flag}: cannot listen on 127.0.0.1:BUSY: Address already in use; expected "
                "a free port (0: any free port)"
            ),
        )
        for flag in ("--port", "--priority-port", "--metrics-port")
    ],
    (
        ("--tls-cert", "NOT_PEM"),
        (
            "--tls-cert, server.tls_key: expected both (TLS) or neither (plaintext), got "
            "tls_cert='NOT_PEM' tls_key=None"
        ),
    ),
    (
        ("--tls-client-ca", "NOT_PEM"),
        (
            "--tls-client-ca: mutual TLS needs the server's own tls_cert and tls_key too; "
            "expected all three"
        ),
    ),
    (
        ("--tls-cert", "ABSENT", "--tls-key", "NOT_PEM"),
        "--tls-cert: cannot read 'ABSENT' (No such file or directory); expected a PEM file",
    ),
    (
        ("--probe-shape", "nosuch=3"),
        "--probe-shape: unknown input(s) ['nosuch']; the model's inputs are ['input']",
    ),
    (
        ("--probe-shape", "input=3"),
        (
            "--probe-shape: input 'input' given shape [3] after the row axis; expected one "
            "that fits the model's [512]"
        ),
    ),
]


@pytest.mark.parametrize(
    ("flags", "message"), REFUSED_FLAGS, ids=[" ".join(flags) for flags, _ in REFUSED_FLAGS]
)
def test_a_flags_refused_value_is_named_by_the_flag(
    tmp_path: Path, small_model: Path, flags: tuple[str, ...], message: str
) -> None:
    """`--max-batch-size 0` was refused as "server.max_batch_size: ...", a config key its
    user never wrote; so was every numeric flag's refused value, and the values refused
    as the server started (a port in use, a TLS file, an input the model lacks), a bound
    another flag set, and an address not this host's as its port."""
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    with socket.socket() as held:  # listening without SO_REUSEPORT: gRPC cannot share it
        held.bind(("127.0.0.1", 0))
        held.listen()
        made = {
            "BUSY": str(held.getsockname()[1]),
            "NOT_PEM": str(not_pem),
            "ABSENT": str(tmp_path / "absent.pem"),
        }
        args = [made.get(flag, flag) for flag in flags]
        # The metrics port off: its default (9464) is checked before the TLS files.
        base = ("--model", str(small_model), "--port", "0", "--metrics-port", "-1")
        stderr = refused_at_start(*base, *args)
    for stand_in, value in made.items():
        message = message.replace(stand_in, value)
    # A --probe-shape is checked in the load, which the `loading` line announces first.
    lines = [line for line in stderr.splitlines() if " INFO laneserve: loading " not in line]
    assert lines == [f"laneserve: {message}"]


def test_a_config_files_refused_value_is_named_by_its_key_beside_flags(
    tmp_path: Path, small_model: Path
) -> None:
    """Only the value a flag gave is named by the flag: the file's, by its key, and a
    bound on it a flag set, by that flag."""
    config = tmp_path / "laneserve.toml"
    config.write_text("[server]\nmax_batch_size = 0\n")
    stderr = refused_at_start(
        "--model", str(small_model), "--config", str(config), "--port", "0", "--batch-cap", "4"
    )
    assert stderr.splitlines() == [
        "laneserve: server.max_batch_size: expected an integer in [1, 4294967295], got 0"
    ]
    config.write_text("[server]\nbatch_cap = 5\n")
    stderr = refused_at_start(
        "--model", str(small_model), "--config", str(config), "--port", "0", "--max-batch-size", "2"
    )
    assert stderr.splitlines() == [
        (
            "laneserve: server.batch_cap: expected at most --max-batch-size (2), got 5; "
            "raise max_batch_size (--max-batch-size) for a larger cap"
        )
    ]


def test_a_probe_shape_flag_that_is_not_name_equals_sizes_is_refused(small_model: Path) -> None:
    for flag in ("input", "input=", "input=3,x", "=3"):
        stderr = refused_at_start("--model", str(small_model), "--probe-shape", flag)
        assert "--probe-shape: expected NAME=D1,D2,..." in stderr
    stderr = refused_at_start("--model", str(small_model), "--probe-shape", "image=3,8")
    assert "--probe-shape: unknown input(s) ['image']" in stderr


def test_a_probe_shape_repeated_for_one_input_is_refused(small_model: Path) -> None:
    """The probe runs one shape per input: `--probe-shape x=128 --probe-shape x=256`
    started, probing 256 alone, with nothing said of 128 (here the later flag's shape,
    which the model refuses, was all it checked)."""
    stderr = refused_at_start(
        "--model", str(small_model), "--probe-shape", "input=512", "--probe-shape", "input=8"
    )
    assert stderr.splitlines() == [
        (
            "laneserve: --probe-shape: input 'input' is given twice ('input=512' and "
            "'input=8'); expected one shape per input"
        )
    ]


def test_an_encrypted_tls_key_is_refused_naming_the_setting(
    tmp_path: Path, small_model: Path
) -> None:
    """OpenSSL asked for the passphrase on the terminal (start-up blocked there) and then
    gRPC failed to bind; without a terminal the error was "[Errno 22] Invalid argument"."""
    make_key = (
        "req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -keyout enc.key "
        "-out enc.pem -days 1 -subj /CN=127.0.0.1 -passout pass:secret"
    )
    openssl = shutil.which("openssl")
    assert openssl is not None, "this test makes its key with `openssl`"
    subprocess.run(
        [openssl, *make_key.split()],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=60,
    )
    tls = ["--tls-cert", str(tmp_path / "enc.pem"), "--tls-key", str(tmp_path / "enc.key")]
    done = subprocess.run(
        [*SERVE, "--model", str(small_model), "--port", "0", *tls],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # no controlling terminal: a prompt could not block the test
    )
    assert done.returncode == 2, done.stderr
    assert "--tls-key:" in done.stderr
    assert "is an encrypted private key" in done.stderr
    assert "pass phrase" not in done.stderr + done.stdout


def test_a_priority_port_that_cannot_be_bound_is_refused_naming_the_setting(
    small_model: Path,
) -> None:
    with socket.socket() as held:  # listening without SO_REUSEPORT: gRPC cannot share it
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        stderr = refused_at_start(
            "--model", str(small_model), "--port", "0", "--priority-port", str(port)
        )
    assert f"--priority-port: cannot listen on 127.0.0.1:{port}: " in stderr
    assert "Traceback" not in stderr


def test_an_http_port_in_use_is_refused_before_the_model_loads_naming_the_flag(
    small_model: Path,
) -> None:
    with socket.socket() as held:  # listening without SO_REUSEPORT: nothing can share it
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        stderr = refused_at_start(
            "--model", str(small_model), "--port", "0", "--http-port", str(port)
        )
    assert f"--http-port: cannot listen on 127.0.0.1:{port}: Address already in use" in stderr
    assert f"loading {small_model}" not in stderr, "refused before the model loads"


def test_json_logs_of_a_port_in_use_are_json_lines_alone_naming_the_address(
    small_model: Path,
) -> None:
    """gRPC's C core wrote its own line before laneserve's JSON one ("E1203 ...
    add_port.cc:83] Failed to add port to server: ..."), which no JSON parser reads."""
    environ = {name: value for name, value in os.environ.items() if name != "GRPC_VERBOSITY"}
    with socket.socket() as held:  # listening without SO_REUSEPORT: gRPC cannot share it
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        args = ("--model", str(small_model), "--port", str(port), "--log-format", "json")
        stderr = refused_at_start(*args, env=environ)
    lines = [json.loads(line) for line in stderr.splitlines()]
    assert lines[-1]["event"] == "startup_failed"
    assert lines[-1]["message"].startswith(
        f"--port: cannot listen on 127.0.0.1:{port}: Address already in use; expected a free port"
    )


def test_a_grpc_verbosity_the_operator_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON logs start the process again with GRPC_VERBOSITY=NONE, unless the operator
    set one (debugging gRPC's core, whose lines are not JSON): then nothing restarts."""
    started_again: list[list[str]] = []
    monkeypatch.setattr(os, "execv", lambda _path, argv: started_again.append(argv))
    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
    server_cli._start_again_without_grpc_core_lines()
    assert started_again == []
    assert os.environ["GRPC_VERBOSITY"] == "ERROR"
    monkeypatch.delenv("GRPC_VERBOSITY")
    server_cli._start_again_without_grpc_core_lines()
    assert started_again == [sys.orig_argv]
    assert os.environ["GRPC_VERBOSITY"] == "NONE"


def test_a_port_in_use_is_refused_before_the_model_loads(small_model: Path) -> None:
    """It was found once the model had loaded and been probed (minutes, for a large
    model on a GPU): now the load never starts."""
    with socket.socket() as held:  # listening without SO_REUSEPORT: gRPC cannot share it
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with _held_in_load(small_model, "--metrics-port", str(port)) as process:
            try:
                _, stderr = process.communicate(timeout=60)
            finally:
                if process.poll() is None:
                    process.kill()
    assert process.returncode == 2
    assert "loading" not in stderr
    assert f"--metrics-port: cannot listen on 127.0.0.1:{port}: Address already in use" in stderr


def test_a_model_with_no_inputs_is_refused_at_start_not_hung(tmp_path: Path) -> None:
    """Its output's shape not inferable, the start-up probe counted the rows of no input
    on the load's thread: StopIteration, which asyncio cannot put into the load's future
    ("cannot be raised into a Future"); `serve` waited for it for good, and a SIGTERM
    only said "stopping once the model has loaded". It exits 2 saying why."""
    model = no_input_model(tmp_path / "no_input.onnx", inferable=False)
    stderr = refused_at_start("--model", str(model), "--port", "0", "--metrics-port", "-1")
    assert f"laneserve: model {str(model)!r} has no inputs: " in stderr
    assert "expected at least one input whose first axis is the batch (rows) axis" in stderr


# `laneserve serve` whose model load raises StopIteration (a bug in the load).
STOPS_IN_LOAD = """
import sys
import laneserve.server.cli as cli
def stops(config):
    raise StopIteration
cli.load_engine = stops
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_stop_iteration_out_of_the_model_load_ends_the_start(small_model: Path) -> None:
    """asyncio cannot put a StopIteration into the future the load runs under: that
    future never finished and `serve` hung for good. Whatever the load raises, the start
    ends: here as the bug it is (status 1, with its traceback)."""
    args = ["serve", "--model", str(small_model), "--port", "0", "--metrics-port", "-1"]
    done = run_text(
        [sys.executable, "-c", STOPS_IN_LOAD, *args],
        timeout_s=60,
    )
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: loading the model raised StopIteration" in done.stderr
    assert "cannot be raised into a Future" not in done.stderr


def test_a_memory_limit_the_idle_server_exceeds_is_refused(small_model: Path) -> None:
    """Lanes the watermark closes reopen only below its low mark: under a limit the
    server exceeds idle they would stay closed with nothing running."""
    stderr = refused_at_start(
        "--model", str(small_model), "--port", "0", "--host-memory-limit", "16MiB"
    )
    assert "--host-memory-limit: the server holds" in stderr  # the flag gave it
    assert "idle after loading the model, at or above the low watermark" in stderr
    assert "expected a limit above" in stderr
    assert "Traceback" not in stderr


def test_an_address_that_cannot_be_bound_is_refused_naming_it(small_model: Path) -> None:
    stderr = refused_at_start("--model", str(small_model), "--host", "192.0.2.1", "--port", "0")
    assert "--host: cannot listen on 192.0.2.1:0" in stderr
    assert "Traceback" not in stderr


# `laneserve serve` with its last start-up step (tune_for_serving) held until a line
# arrives on stdin: "serving" is logged and health is SERVING, the window is held open.
HELD_AFTER_START = """
import sys
import laneserve.server.cli as cli
tune = cli.tune_for_serving
def held():
    sys.stdin.readline()
    tune()
cli.tune_for_serving = held
sys.exit(cli.main(sys.argv[1:]))
"""


# `laneserve serve` whose session never finishes a batch holding a row tagged 777 (fault
# injection: a batch that runs far longer than the drain's grace).
STUCK_ON_777 = """
import sys, threading
import laneserve.server.cli as cli
import laneserve.server.engine as engine
run_batch = engine.Engine.run_batch
def stuck(self, batch, rows_wanted=None):
    if any((part[:, 0] == 777).any() for part in batch.parts["input"]):
        print("stuck batch started", file=sys.stderr, flush=True)
        threading.Event().wait()
    return run_batch(self, batch, rows_wanted)
engine.Engine.run_batch = stuck
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_second_signal_ends_the_drain_now(small_model: Path) -> None:
    """With a long grace, a second SIGTERM ended nothing: the drain waited for queued work
    (and for a batch still running) however long that took. (SIGINT second: the same
    signal again at once is taken as the first one delivered twice, see
    test_a_repeat_of_the_first_signal_at_once_is_the_same_request.)"""
    server = ServerProcess(
        ["serve", "--model", str(small_model), *_ANY_PORTS, "--drain-grace-s", "3600"],
        command=[sys.executable, "-c", STUCK_ON_777],
    )
    try:
        port = int(server.wait_for(r"serving .* on 127\.0\.0\.1:(\d+)").group(1))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            running = stub.Infer.future(request(rows(1, start=777)), timeout=120)
            server.wait_for("stuck batch started")
            queued = stub.Infer.future(request(rows(2, start=1)), timeout=120)
            server.process.send_signal(signal.SIGTERM)
            server.wait_for(r"SIGTERM: draining")
            server.process.send_signal(signal.SIGINT)
            server.wait_for(r"SIGINT again: ending the drain now")
            for call in (running, queued):
                with pytest.raises(grpc.RpcError) as caught:
                    call.result()
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            server.wait_for(r"a batch still runs .* after the drain")
            assert server.process.wait(timeout=60) == 0
    finally:
        server.close()


def test_every_log_line_of_a_drain_is_a_json_event(small_model: Path) -> None:
    """With --log-format json the signal lines ("SIGTERM: draining", "SIGTERM again")
    and the drain's warnings had no "event" member, which the README promises on every
    line (log shippers key on it)."""
    server = ServerProcess(
        [
            *("--log-format", "json", "serve", "--model", str(small_model)),
            *("--port", "0", "--metrics-port", "-1", "--drain-grace-s", "3600"),
        ],
        command=[sys.executable, "-c", STUCK_ON_777],
    )
    try:
        port = server.port()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            running = stub.Infer.future(request(rows(1, start=777)), timeout=120)
            server.wait_for("stuck batch started")
            server.process.send_signal(signal.SIGTERM)
            server.wait_for(r"SIGTERM: draining")
            server.process.send_signal(signal.SIGINT)  # not SIGTERM: see the test above
            with pytest.raises(grpc.RpcError):
                running.result()
        assert server.process.wait(timeout=60) == 0
        server.rest()
    finally:
        server.close()
    # The fault injection's own marker is the one line not written by the server.
    lines = [json.loads(line) for line in server.log if line != "stuck batch started\n"]
    without_event = [line for line in lines if "event" not in line]
    assert not without_event, without_event
    events = {line["event"]: line for line in lines}
    assert events["drain_started"]["signal"] == "SIGTERM"
    assert events["drain_started"]["grace_s"] == 3600.0
    assert events["drain_started"]["message"] == "SIGTERM: draining (grace 3600s)"
    assert events["drain_cut_short"]["signal"] == "SIGINT"
    assert events["drain_incomplete"]["grace_s"] == 3600.0
    # Cut short by the second signal, not at the end of its grace: the line said "drain
    # ended after at most 3600.0s" after a drain of a fraction of a second.
    assert events["drain_incomplete"]["cut_short"] is True
    assert events["drain_incomplete"]["message"].startswith("drain cut short by a second signal")
    assert events["batch_still_running"]["waited_s"] > 0
    assert lines[-1]["event"] == "shutdown"


# `laneserve serve` whose memory readings raise once the file named by LANESERVE_TEST_BREAK
# exists (fault injection: a lost device), failing its scheduler thread for good.
BREAKS_ON_FLAG = """
import os, sys
import laneserve.server.cli as cli
import laneserve.server.memory as memory
read = memory.ProcessRssGauge.used_bytes
def used_bytes(self):
    if os.path.exists(os.environ["LANESERVE_TEST_BREAK"]):
        raise RuntimeError("injected fault: the device is lost")
    return read(self)
memory.ProcessRssGauge.used_bytes = used_bytes
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_failed_scheduler_ends_the_process_with_status_1(
    tmp_path: Path, small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = tmp_path / "break"
    monkeypatch.setenv("LANESERVE_TEST_BREAK", str(flag))
    server = ServerProcess(
        ["serve", "--model", str(small_model), *_ANY_PORTS, "--host-memory-limit", "64GiB"],
        command=[sys.executable, "-c", BREAKS_ON_FLAG],
    )
    try:
        server.wait_for(r"serving .* on 127\.0\.0\.1:(\d+)")
        flag.touch()
        server.wait_for(r"the scheduler failed; stopping")
        assert server.process.wait(timeout=60) == 1
    finally:
        server.close()


def test_a_server_failing_in_its_drain_delay_exits_1_without_draining(
    tmp_path: Path, small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delay ends when the server stops itself (its scheduler failed): the process
    exits 1 for its supervisor to restart it, neither after the rest of the delay nor
    with a drain of its own (`drain_started`)."""
    flag = tmp_path / "break"
    monkeypatch.setenv("LANESERVE_TEST_BREAK", str(flag))
    server = ServerProcess(
        [
            *("serve", "--model", str(small_model), "--port", "0", "--metrics-port", "-1"),
            *("--host-memory-limit", "64GiB", "--drain-delay-s", "3600"),
        ],
        command=[sys.executable, "-c", BREAKS_ON_FLAG],
    )
    try:
        server.port()
        server.process.send_signal(signal.SIGTERM)
        server.wait_for(r"SIGTERM: health NOT_SERVING; serving 3600s more")
        flag.touch()
        server.wait_for(r"the scheduler failed; stopping")
        assert server.process.wait(timeout=60) == 1
        server.rest()
    finally:
        server.close()
    assert not any("SIGTERM: draining" in line for line in server.log), server.log


def test_a_sigterm_as_soon_as_it_serves_is_a_drain(small_model: Path) -> None:
    """The signal handlers are in place before the server starts: a SIGTERM right after
    the "serving" line drains and exits 0 (it was the default action: killed, -15)."""
    model = str(small_model)
    with subprocess.Popen(
        [sys.executable, "-c", HELD_AFTER_START, "serve", "--model", model, *_ANY_PORTS],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stderr is not None
        assert process.stdin is not None
        try:
            for line in process.stderr:
                if "serving " in line:
                    break
            process.send_signal(signal.SIGTERM)
            stderr = _released(process)
        finally:
            if process.poll() is None:
                process.kill()
    assert "SIGTERM: draining" in stderr
    assert "stopped" in stderr


# `laneserve serve` whose model load waits for a line on stdin (a large model loading).
HELD_IN_LOAD = """
import sys
import laneserve.server.cli as cli
load = cli.load_engine
def held(config):
    print("loading", file=sys.stderr, flush=True)
    sys.stdin.readline()
    return load(config)
cli.load_engine = held
sys.exit(cli.main(sys.argv[1:]))
"""


def _held_in_load(model: Path, *flags: str, prelude: str = "") -> subprocess.Popen[str]:
    script = prelude + HELD_IN_LOAD
    return subprocess.Popen(
        [sys.executable, "-c", script, "serve", "--model", str(model), *_ANY_PORTS, *flags],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _released(process: subprocess.Popen[str]) -> str:
    """Lets a process held on stdin go on; the rest of its stderr once it exited 0."""
    assert process.stdin is not None
    assert process.stderr is not None
    process.stdin.write("\n")
    process.stdin.flush()
    stderr = process.stderr.read()
    assert process.wait(timeout=60) == 0
    return stderr


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_sigterm_while_the_model_loads_stops_it_without_serving(
    small_model: Path, stop: signal.Signals
) -> None:
    """The model loaded on the event loop: a SIGTERM meanwhile waited for the load, then
    the server bound its port, said SERVING and drained. Now it never serves. SIGHUP
    alike (its default first: a test run under `nohup` passes it on ignored, and ignored
    it stays so, see test_a_stop_signal_ignored_at_start_stays_ignored)."""
    prelude = "import signal; signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
    with _held_in_load(small_model, prelude=prelude) as process:
        assert process.stderr is not None
        assert process.stdin is not None
        try:
            stderr_lines_until(process, "loading")
            process.send_signal(stop)
            stderr_lines_until(process, f"{stop.name} while starting")
            stderr = _released(process)
        finally:
            if process.poll() is None:
                process.kill()
    assert "stopped before serving" in stderr
    assert f"serving {small_model}" not in stderr


def test_a_second_signal_while_the_model_loads_exits_at_once(small_model: Path) -> None:
    """The load is still going (it never ends here): the second signal ends the process,
    by that signal (it exited 128 + its number, which systemd and bash read as a failure
    where the death by it is a stop). It waited for the load. (SIGINT second: SIGTERM
    again at once is taken as the first one delivered twice.)"""
    with _held_in_load(small_model) as process:
        try:
            stderr_lines_until(process, "loading")
            process.send_signal(signal.SIGTERM)
            stderr_lines_until(process, "SIGTERM while starting")
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=60) == -signal.SIGINT
        finally:
            if process.poll() is None:
                process.kill()


# `laneserve serve` run as `python -m` runs it, with a signal's disposition set first (as
# a terminal's session, `nohup` or a script's background job leaves it): the test's own
# is whatever its runner's was.
def _serve_with(signum: signal.Signals, disposition: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        (
            f"import runpy, signal; signal.signal(signal.{signum.name}, signal.{disposition}); "
            "runpy.run_module('laneserve.server.cli', run_name='__main__', alter_sys=True)"
        ),
        *SERVE[3:],
    ]


def test_a_sighup_drains_like_sigterm(small_model: Path) -> None:
    """A closed terminal or ssh session sends SIGHUP: its default action killed the server
    at once, queued work unanswered, with no drain."""
    server = ServerProcess(
        ["--model", str(small_model), "--port", "0"], command=_serve_with(signal.SIGHUP, "SIG_DFL")
    )
    try:
        server.port()
        server.process.send_signal(signal.SIGHUP)
        server.wait_for(r"SIGHUP: draining")
        server.wait_for(r"stopped")
        assert server.process.wait(timeout=30) == 0
    finally:
        server.close()


@pytest.mark.parametrize("ignored", [signal.SIGHUP, signal.SIGINT], ids=["SIGHUP", "SIGINT"])
def test_a_stop_signal_ignored_at_start_stays_ignored(
    small_model: Path, ignored: signal.Signals
) -> None:
    """Under `nohup` (SIGHUP ignored) the operator asked for the server to outlive its
    terminal: a hangup neither kills nor drains it. A background job of a non-interactive
    shell (`laneserve serve &` in a script) starts with SIGINT ignored, so that the
    script's Ctrl-C is not the server's: it drained and stopped the server."""
    server = ServerProcess(
        ["--model", str(small_model), "--port", "0"], command=_serve_with(ignored, "SIG_IGN")
    )
    try:
        port = server.port()
        server.process.send_signal(ignored)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            answer = pb_grpc.InferenceServiceStub(channel).Infer(request(rows(2)), timeout=30)
            assert output(answer).shape == (2, 10)
        server.process.send_signal(signal.SIGTERM)
        server.wait_for(r"SIGTERM: draining")
        assert server.process.wait(timeout=30) == 0
    finally:
        server.close()
    assert not any(ignored.name in line for line in server.log)


def _parsers_within(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every subcommand's parser below it."""
    yield parser
    for action in parser._actions:  # argparse keeps no public list of subparsers
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers_within(child)


@pytest.mark.parametrize(
    "parser", [server_cli._parser(), client_cli._parser()], ids=["laneserve", "laneserve-client"]
)
def test_every_commands_help_renders(parser: argparse.ArgumentParser) -> None:
    """`laneserve bench --help` died with a TypeError: a help text held "N% of", which
    argparse read as a %-format."""
    commands = list(_parsers_within(parser))
    assert len(commands) > 2
    for command in commands:
        assert command.format_help()


def test_a_start_up_error_with_stderr_broken_still_exits_2(tmp_path: Path) -> None:
    """stderr's reader gone (EPIPE): printing the reason raised BrokenPipeError, and the
    process exited 1, which README gives to a server that failed while serving."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [*SERVE, "--model", str(tmp_path / "absent.onnx"), "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=write_end,
            stdin=subprocess.DEVNULL,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 2


def test_too_low_an_open_file_limit_is_a_start_up_error_that_names_the_limit(
    small_model: Path,
) -> None:
    """Under `ulimit -n 12` the start failed with "laneserve: [Errno 24] Too many open
    files" alone: neither what ran out nor what to raise (on Python 3.13 gRPC's core
    aborted instead, SIGABRT). It is refused before anything opens, naming the limit."""
    done = run_text(
        [
            *("/bin/sh", "-c", 'ulimit -n 12; exec "$@"', "sh", *SERVE),
            *("--model", str(small_model), "--port", "0", "--metrics-port", "-1"),
        ],
        timeout_s=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.endswith(
        "laneserve: the open-file limit is 12, under the 64 a server needs at the least; "
        "expected a higher open-file limit (`ulimit -n`: the server holds a few dozen files "
        "of its own and one per client connection)\n"
    ), done.stderr[-2000:]


def test_an_open_file_limit_the_server_outlasts_in_its_start_is_still_named() -> None:
    """Out of files past the check (a limit of MIN_OPEN_FILES, then a burst of its own
    files): EMFILE's words, and what to raise."""
    error = OSError(errno.EMFILE, "Too many open files")
    assert server_cli._start_failure(error) == (
        "[Errno 24] Too many open files; expected a higher open-file limit (`ulimit -n`: "
        "the server holds a few dozen files of its own and one per client connection)"
    )


def test_json_logs_with_stderr_closed_still_serve(small_model: Path) -> None:
    """Started with fd 2 closed (as some daemonisers do), sys.stderr is None: the restart
    that JSON logs make flushed it (AttributeError), and the server never served."""
    port = unused_port()
    serve = [*SERVE, "--model", str(small_model), "--port", str(port), "--log-format", "json"]
    environ = {name: value for name, value in os.environ.items() if name != "GRPC_VERBOSITY"}
    process = subprocess.Popen(
        ["/bin/sh", "-c", 'exec "$@" 2>&-', "sh", *serve],  # 2>&-: fd 2 closed
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=environ,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            # The health stubs' types lack the RPC attributes; the call itself is plain.
            health: Any = health_pb2_grpc.HealthStub(channel)
            asked = health_pb2.HealthCheckRequest(service="")
            status = health.Check(asked, timeout=60, wait_for_ready=True).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)


# ---- What each stop signal asks of a serving server: `serve`'s handler, called here as
# its event loop calls it, on a real server in this process. ----


def test_a_repeat_of_the_first_signal_at_once_is_the_same_request() -> None:
    """GNU `timeout` (and `tini -g`, a shell's `kill 0`) forwards one SIGTERM both to its
    child and to the child's process group: laneserve got it twice, and the second cut
    the drain short (2 runs of 5: queued work answered UNAVAILABLE)."""
    clock = ManualClock()
    signals = StopSignals(clock)
    assert signals.meaning(signal.SIGTERM) is SignalMeaning.STOP
    assert signals.meaning(signal.SIGTERM) is SignalMeaning.REPEAT  # the forwarded copy
    clock.advance(REPEAT_WINDOW_S / 2)
    assert signals.meaning(signal.SIGTERM) is SignalMeaning.REPEAT
    assert signals.meaning(signal.SIGINT) is SignalMeaning.STOP_NOW  # another one is no copy
    clock.advance(REPEAT_WINDOW_S / 2)
    assert signals.meaning(signal.SIGTERM) is SignalMeaning.STOP_NOW


def test_a_second_ctrl_c_a_moment_after_the_first_stops_at_once() -> None:
    """A person's second Ctrl-C 0.3 s after the first was taken as the first one
    delivered twice (the window was 1 s), and the drain went on. A wrapper's forwarded
    copy comes microseconds behind: the window holds it, not a person's second press."""
    clock = ManualClock()
    signals = StopSignals(clock)
    assert signals.meaning(signal.SIGINT) is SignalMeaning.STOP
    clock.advance(0.3)
    assert signals.meaning(signal.SIGINT) is SignalMeaning.STOP_NOW


def _config(model: Path, **fields: Any) -> ServerConfig:
    return ServerConfig(model_path=str(model), metrics_port=-1, **fields)


# The events a stop logs, in order.
STOP_EVENTS = {
    "drain_delayed",
    "drain_started",
    "signal_repeated",
    "drain_cut_short",
    "drain_incomplete",
    "shutdown",
}


def _events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [event for r in caplog.records if (event := getattr(r, "event", None)) in STOP_EVENTS]


def test_one_sigterm_delivered_twice_does_not_cut_the_drain_short(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, _config(small_model, drain_grace_s=600.0)) as s:
            stopper = server_cli._Stopper(clock=ManualClock())  # the copy comes at once
            stopper.attach(s.server)
            stopping = asyncio.ensure_future(stopper.stop_when_asked())
            running, queued = await one_running_and_queued(s, engine)
            stopper.on_signal(signal.SIGTERM)
            stopper.on_signal(signal.SIGTERM)
            await until(lambda: s.server.state is Lifecycle.DRAINING)
            engine.release()
            assert output(await queued).shape == (2, 10)  # run, not refused by a cut drain
            assert output(await running).shape == (1, 10)
            await asyncio.wait_for(stopping, timeout=60)

    asyncio.run(scenario())
    assert _events(caplog) == ["drain_started", "signal_repeated", "shutdown"]
    (repeated,) = [r for r in caplog.records if getattr(r, "event", None) == "signal_repeated"]
    assert repeated.getMessage() == (
        f"SIGTERM again within {REPEAT_WINDOW_S:g}s: taken as the same request (a wrapper's "
        "forwarded copy, or pressed twice quickly); SIGTERM again later stops at once"
    )


@pytest.mark.parametrize(
    ("second", "after_s"),
    [(signal.SIGTERM, REPEAT_WINDOW_S), (signal.SIGINT, 0.0)],
    ids=["the-same-after-the-window", "another-at-once"],
)
def test_a_later_or_another_signal_ends_the_drain_now(
    small_model: Path, second: signal.Signals, after_s: float
) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, _config(small_model, drain_grace_s=600.0)) as s:
            clock = ManualClock()
            stopper = server_cli._Stopper(clock=clock)
            stopper.attach(s.server)
            stopping = asyncio.ensure_future(stopper.stop_when_asked())
            running, queued = await one_running_and_queued(s, engine)
            stopper.on_signal(signal.SIGTERM)
            await until(lambda: s.server.state is Lifecycle.DRAINING)
            clock.advance(after_s)
            stopper.on_signal(second)
            await queued_never_ran_as_the_drain_ended(running, queued, engine, stopping)

    asyncio.run(scenario())


class _HandTimer:
    """A drain delay's wait that ends when the test says (`over`), recording each asked."""

    def __init__(self) -> None:
        self.asked_s: list[float] = []
        self.over = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.asked_s.append(seconds)
        await self.over.wait()


def test_a_drain_delay_serves_on_with_health_not_serving_then_drains(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Health went NOT_SERVING and calls were refused DRAINING within milliseconds of the
    SIGTERM: health checks (a readiness probe every second or more) could not send
    callers elsewhere first, and plain stubs got UNAVAILABLE (38 in 60 ms). With
    drain_delay_s the server says NOT_SERVING at once but admits and serves on for that
    long, then drains."""
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        settings = _config(small_model, drain_delay_s=30.0, drain_grace_s=600.0)
        async with serving(engine, settings) as s:
            delay = _HandTimer()
            stopper = server_cli._Stopper(wait_s=delay)
            stopper.attach(s.server)
            stopping = asyncio.ensure_future(stopper.stop_when_asked())
            stopper.on_signal(signal.SIGTERM)
            await until(lambda: delay.asked_s == [30.0])  # health is set before it begins
            assert await health_status(s.channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert output(await s.stub.Infer(request(rows(3)))).shape == (3, 10)
            engine.hold_next()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=5))))
            await asyncio.to_thread(engine.entered.acquire)  # admitted in the delay, held
            assert s.server.state is Lifecycle.SERVING
            delay.over.set()
            await until(lambda: s.server.state is Lifecycle.DRAINING)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.Infer(request(rows(1)))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert rich_status(refused.value)[0] == "DRAINING"
            engine.release()
            assert output(await running).shape == (1, 10)  # the drain waited for it
            await asyncio.wait_for(stopping, timeout=60)

    asyncio.run(scenario())
    assert _events(caplog) == ["drain_delayed", "drain_started", "shutdown"]


def test_a_second_signal_in_the_drain_delay_stops_at_once(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The second signal means what it does in the drain: stop now, what is queued
    answered UNAVAILABLE at once (its grace ended), not a drain after the rest of the
    delay, nor one that waits for the queue within its grace."""
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        settings = _config(small_model, drain_delay_s=3600.0, drain_grace_s=600.0)
        async with serving(engine, settings) as s:
            delay = _HandTimer()  # never over
            stopper = server_cli._Stopper(wait_s=delay)
            stopper.attach(s.server)
            stopping = asyncio.ensure_future(stopper.stop_when_asked())
            running, queued = await one_running_and_queued(s, engine)
            stopper.on_signal(signal.SIGTERM)
            await until(lambda: delay.asked_s == [3600.0])
            stopper.on_signal(signal.SIGINT)
            # In a drain that waited the queued call was DEADLINE_EXCEEDED, its lane's timeout.
            await queued_never_ran_as_the_drain_ended(running, queued, engine, stopping)
            assert s.server.state is Lifecycle.STOPPED

    asyncio.run(scenario())
    assert _events(caplog) == [
        "drain_delayed",
        "drain_cut_short",
        "drain_incomplete",
        "shutdown",
    ]


def test_without_a_drain_delay_the_drain_begins_at_the_signal(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, _config(small_model)) as s:
            delay = _HandTimer()
            stopper = server_cli._Stopper(wait_s=delay)
            stopper.attach(s.server)
            stopping = asyncio.ensure_future(stopper.stop_when_asked())
            stopper.on_signal(signal.SIGTERM)
            await asyncio.wait_for(stopping, timeout=60)
            assert delay.asked_s == []

    asyncio.run(scenario())


def test_drain_delay_flag_serves_on_not_serving_until_a_second_signal(small_model: Path) -> None:
    """`--drain-delay-s` reaches the stop: after a SIGTERM, health NOT_SERVING and calls
    still answered; a second signal (another one: no copy) ends the delay and the process."""
    server = ServerProcess(
        [
            *("--model", str(small_model), "--port", "0", "--metrics-port", "-1"),
            *("--drain-delay-s", "3600"),
        ]
    )
    try:
        port = server.port()
        server.process.send_signal(signal.SIGTERM)
        server.wait_for(r"SIGTERM: health NOT_SERVING; serving 3600s more")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            # The health stubs' types lack the RPC attributes; the call itself is plain.
            health: Any = health_pb2_grpc.HealthStub(channel)
            asked = health_pb2.HealthCheckRequest(service="")
            # Set by the stop's task, just after the line: polled, not assumed.
            status = health.Check(asked, timeout=10).status
            for _ in range(1000):
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                status = health.Check(asked, timeout=10).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            answer = pb_grpc.InferenceServiceStub(channel).Infer(request(rows(2)), timeout=30)
            assert output(answer).shape == (2, 10)
        server.process.send_signal(signal.SIGINT)
        server.wait_for(r"SIGINT again: ending the drain now")
        assert server.process.wait(timeout=60) == 0
    finally:
        server.close()
