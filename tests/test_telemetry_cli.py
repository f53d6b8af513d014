"""`laneserve serve` as a real process, configured the way an operator does it: tracing
through the standard OTEL_* variables, JSON logs, the Prometheus endpoint on a port."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import output, request, rows, run_text

# The metrics endpoint on any free port unless a test names one: its default (9464) may be
# held by another test running at once, or by a server on this machine.
SERVE = [
    *(sys.executable, "-m", "laneserve.server.cli", "--log-format", "json", "serve"),
    *("--metrics-port", "0"),
]
TIMEOUT_S = 60
CALLER_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-0af7651916cd43dd8448eb211c80319c-{CALLER_SPAN_ID}-01"


def otel_env(**variables: str) -> dict[str, str]:
    """This process's environment without its own OTEL_* settings, plus `variables`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(variables)
    return env


def json_objects(text: str) -> list[dict[str, Any]]:
    """The JSON objects printed one after another (the console exporter indents them)."""
    decoder = json.JSONDecoder()
    found = []
    index = 0
    while (start := text.find("{", index)) != -1:
        document, index = decoder.raw_decode(text, start)
        found.append(document)
    return found


def test_console_traces_json_logs_and_metrics_from_a_real_process(small_model: Path) -> None:
    process = subprocess.Popen(
        [*SERVE, "--model", str(small_model), "--port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=otel_env(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="laneserve-test"),
    )
    assert process.stdout is not None
    assert process.stderr is not None
    spans_out = process.stdout
    stdout: list[str] = []  # the console exporter writes spans to stdout

    def read_spans() -> None:
        stdout.extend(spans_out)

    reader = threading.Thread(target=read_spans, daemon=True)
    reader.start()
    try:
        log_lines = []
        for line in process.stderr:
            log_lines.append(json.loads(line))  # every log line is one JSON object
            if log_lines[-1].get("event") == "startup":
                break
        startup = log_lines[-1]
        assert startup["event"] == "startup", log_lines
        # The start-up lines carry their figures as members, not only in the message.
        events = {line.get("event"): line for line in log_lines}
        assert events["session_ready"]["providers"] == ["CPUExecutionProvider"]
        assert events["probe"]["batch_cap"] >= 1
        assert events["probe"]["run_ms"]["1"] > 0
        assert startup["tracing"] is True
        assert startup["providers"] == ["CPUExecutionProvider"]
        port, metrics_port = startup["port"], startup["metrics_port"]
        assert metrics_port > 0

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            response = pb_grpc.InferenceServiceStub(channel).Infer(
                request(rows(2), request_id="e2e"),
                timeout=10,
                metadata=(("traceparent", TRACEPARENT),),
            )
            assert output(response).shape == (2, 10)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as scrape:
            metrics = scrape.read().decode()
        assert 'laneserve_requests_completed_total{lane="standard"' in metrics

        process.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in process.stderr]
        assert process.wait(timeout=TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=TIMEOUT_S)
        reader.join(timeout=TIMEOUT_S)
        process.stdout.close()
        process.stderr.close()

    assert rest[-1]["event"] == "shutdown"
    assert rest[-1]["message"] == "stopped"
    spans = {span["name"]: span for span in json_objects("".join(stdout))}
    assert {"enqueue", "batch", "infer", "reply", "laneserve.v1.InferenceService/Infer"} <= set(
        spans
    )
    server = spans["laneserve.v1.InferenceService/Infer"]
    assert server["parent_id"] == f"0x{CALLER_SPAN_ID}"
    assert server["resource"]["attributes"]["service.name"] == "laneserve-test"
    assert spans["enqueue"]["parent_id"] == server["context"]["span_id"]


def test_an_exporter_that_is_not_installed_is_refused_by_name(small_model: Path) -> None:
    done = run_text(
        [*SERVE, "--model", str(small_model), "--port", "0", "--metrics-port", "-1"],
        timeout_s=TIMEOUT_S,
        env=otel_env(OTEL_TRACES_EXPORTER="zipkin_json"),
    )
    assert done.returncode == 2
    assert "OTEL_TRACES_EXPORTER=zipkin_json: no span exporter 'zipkin_json'" in done.stderr


def test_a_failed_start_is_one_json_line_too(tmp_path: Path) -> None:
    """With --log-format json the reason the process exited was a plain text line, which a
    log shipper that parses JSON loses."""
    missing = tmp_path / "absent.onnx"
    done = run_text(
        [*SERVE, "--model", str(missing), "--port", "0"],
        timeout_s=TIMEOUT_S,
        env=otel_env(),
    )
    assert done.returncode == 2, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    (failed,) = [line for line in lines if line.get("event") == "startup_failed"]
    assert str(missing) in failed["message"]
    assert failed["exit_code"] == 2


# Settings of the OTEL_* variables a start refuses by name, with what its one line says.
_UNREADABLE_TRACING = [
    ({"OTEL_SPAN_LINK_COUNT_LIMIT": "x"}, "OTEL_SPAN_LINK_COUNT_LIMIT must be a non-neg"),
    # The SDK reads this one as it is imported too: a ValueError out of the import.
    (
        {"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "x"},
        "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT must be a non-negative integer but got x",
    ),
    ({"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "-1"}, "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT must be"),
    ({"OTEL_BSP_SCHEDULE_DELAY": "0"}, "schedule_delay_millis must be positive"),
    ({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096"}, "max_export_batch_size must be less"),
    (
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": "x"},
        "OTEL_TRACES_EXPORTER=otlp: the exporter refused its OTEL_EXPORTER_* settings: ",
    ),
    # The SDK warns and takes a default: every request traced, a 5 s delay.
    (
        {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "O.01"},
        "OTEL_TRACES_SAMPLER_ARG is 'O.01', not a number (the ratio of traces sampled, from 0 to 1",
    ),
    # A number, but not a ratio: the SDK said "could not convert" of it too.
    (
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
        "OTEL_TRACES_SAMPLER_ARG is '2', outside 0 to 1 (the ratio of traces sampled",
    ),
    ({"OTEL_TRACES_SAMPLER": "traceidratio_typo"}, "recognize sampler traceidratio_typo"),
    # The resource detector warned of an item it cannot read, and dropped it.
    ({"OTEL_RESOURCE_ATTRIBUTES": "team=a,garbage"}, "Invalid key value resource attribute"),
    # Read as floats: every export's deadline already passed (0 in the generic variable).
    *[
        (
            {"OTEL_TRACES_EXPORTER": "otlp", key: value},
            f"{key} is '{value}'; expected a positive number of seconds",
        )
        for key, value in (
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "0"),
            ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "-5"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "nan"),
        )
    ],
    ({"OTEL_BSP_SCHEDULE_DELAY": "x"}, "Unable to parse value for OTEL_BSP_SCHEDULE_DELAY"),
    (  # an exception of the exporter's own, not a ValueError
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_COMPRESSION": "bogus"},
        "OTEL_TRACES_EXPORTER=otlp: the exporter refused its OTEL_EXPORTER_* settings: ",
    ),
    # At --log-level error the SDK's warnings were never made, and the sampler taken; a
    # ratio sampler with no argument is the specification's 1.0, not a refusal.
    ({"OTEL_TRACES_SAMPLER": "traceidratio_typo", "--log-level": "error"}, "recognize"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio"}, "cannot load model '{missing}'"),
    # Set to nothing is unset (templates write ${X:-}): the SDK warned, and took its default.
    ({"OTEL_TRACES_SAMPLER": "", "OTEL_BSP_SCHEDULE_DELAY": " "}, "cannot load model"),
    # The exporter warns of a header it cannot read, and sends every span without it.
    (
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_HEADERS": "api-key"},
        "Header format invalid",
    ),
]


@pytest.mark.parametrize(("variables", "expected"), _UNREADABLE_TRACING)
def test_a_tracing_number_that_cannot_be_read_is_refused_by_name_before_the_model_loads(
    tmp_path: Path, variables: dict[str, str], expected: str
) -> None:
    """The SDK raised a bare ValueError out of the server's construction, once the model
    had loaded and been probed (minutes, for a large model): a 40-line traceback, none of
    it JSON, and exit 1; the OTLP exporter's did not name its variable ("could not convert
    string to float"). The model named is absent: the refusal comes first, before the
    model is read."""
    missing = tmp_path / "absent.onnx"
    variables = dict(variables)  # the case's own dict is shared by every run of it
    level = variables.pop("--log-level", "info")
    done = run_text(
        [
            *(*SERVE, "--model", str(missing), "--port", "0"),
            *("--metrics-port", "-1", "--log-level", level),
        ],
        timeout_s=TIMEOUT_S,
        env=otel_env(**{"OTEL_TRACES_EXPORTER": "console", **variables}),
    )
    assert done.returncode == 2, done.stderr
    (failed,) = [json.loads(line) for line in done.stderr.splitlines()]  # one, JSON
    assert failed["event"] == "startup_failed"
    assert expected.format(missing=missing) in failed["message"]


def test_a_span_limit_that_cannot_be_read_leaves_commands_without_tracing_alone() -> None:
    """The SDK reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT as it is imported, and laneserve's
    modules import it: a value that was not an integer failed every command, `--help`
    and `top` too, with the SDK's traceback. Like every span limit, it matters to traces
    alone (refused when they are on, see above)."""
    done = run_text(
        [sys.executable, "-m", "laneserve.server.cli", "--help"],
        timeout_s=TIMEOUT_S,
        env=otel_env(OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT="x"),
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


# Imports laneserve's telemetry with an audit hook on the environment: prints each change
# made to OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT while it imports, then its value after.
WATCHED_IMPORT = """
import os, sys
def watch(event, args):
    if event in ("os.putenv", "os.unsetenv") and b"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT" in (
        args[0] if isinstance(args[0], bytes) else str(args[0]).encode()
    ):
        print(event)
sys.addaudithook(watch)
import laneserve.server.telemetry
print("after", os.environ.get("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT"))
"""


@pytest.mark.parametrize(
    ("value", "changes"),
    [
        ("64", []),
        (" ", []),
        ("unset", ["os.unsetenv", "os.putenv"]),
        ("x", ["os.unsetenv", "os.putenv"]),
        ("-1", ["os.unsetenv", "os.putenv"]),
    ],
)
def test_a_span_limit_the_sdk_can_read_is_left_in_the_environment(
    value: str, changes: list[str]
) -> None:
    """The environment is the process's, read meanwhile by other threads (an embedding
    application's, gRPC's, the runtime's): the variable was taken out of it for the
    import whatever its value. Only one the import would fail on is, and it is put back."""
    done = run_text(
        [sys.executable, "-c", WATCHED_IMPORT],
        timeout_s=TIMEOUT_S,
        env=otel_env(OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT=value),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [*changes, f"after {value}"]
