"""`laneserve-client` as a real process against a real server on loopback."""

from __future__ import annotations

import argparse
import asyncio
import errno
import hashlib
import importlib.metadata
import inspect
import io
import itertools
import json
import os
import pathlib
import queue
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from laneserve.client import Client, TlsConfig
from laneserve.client import _checkpoint as checkpoint_module
from laneserve.client import cli as client_cli_module
from laneserve.client._checkpoint import Checkpoint, CheckpointBusyError, CheckpointError, locked
from laneserve.client._request import encode_inputs, infer_request
from laneserve.server import Engine, LaneConfig, ServerConfig
from laneserve.server.demo_model import TEXT_LABELS, make_demo_model
from laneserve.server.engine import no_static_estimate
from laneserve.server.items import Batch
from laneserve.v1 import inference_pb2 as pb
from tests.support import (
    CLIENT_CLI_TIMEOUT_S,
    INTERRUPTIBLE_CLIENT_CLI,
    MeteredEngine,
    RecordingEngine,
    config,
    done_items,
    estimate_once,
    refusing_port,
    rows,
    save_model,
    serving,
    until,
)
from tests.support import client_cli as cli

pytestmark = pytest.mark.usefixtures("no_leaked_threads")


def small_reference(small_model: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(small_model), providers=["CPUExecutionProvider"])


def test_a_request_over_the_limit_by_its_ids_utf8_bytes_is_refused_before_sending(
    small_model: Path, tmp_path: Path
) -> None:
    """The size check counted the request_id in characters: an id of 64 four-byte
    characters (256 bytes, the most the server takes) was counted 64, and a request under
    the limit by that count, over it as sent, was sent and refused by gRPC (exit 3)."""
    request_id = "\N{GRINNING FACE}" * 64
    data = rows(47)
    sent = infer_request(request_id, encode_inputs({"input": data}, ""), lane=None)
    limit = sent.ByteSize() - 1  # over by one byte as sent; under by 191 counted in chars
    np.save(tmp_path / "rows47.npy", data)
    settings = config(small_model, max_message_bytes=limit)
    refused_before_sending(
        small_model,
        [
            (
                ["infer", "--input", str(tmp_path / "rows47.npy"), "--request-id", request_id],
                f"the request is {sent.ByteSize()} bytes encoded, over the {limit}-byte",
            )
        ],
        settings,
    )


async def refused(message: str, *arguments: str) -> str:
    """Runs `laneserve-client ARGUMENTS`, which must exit 2 (a usage error) with `message`
    on stderr and no traceback; returns that stderr, for the caller's own checks."""
    code, _, err = await cli(*arguments)
    assert (code, "Traceback" in err) == (2, False), (arguments, err)
    assert message in err, (arguments, err)
    return err


def refused_before_sending(
    model: Path, cases: Sequence[tuple[Sequence[str], str]], settings: ServerConfig | None = None
) -> list[str]:
    """Serves `model` (with `settings`, else the defaults) and runs each case's arguments,
    with `--target`, against it: each is `refused` with its message, before sending
    anything but GetModel (no call fails on the server, no batch runs). Returns each
    case's stderr."""
    engine = RecordingEngine(str(model))
    errors = []

    async def scenario() -> None:
        async with serving(engine, settings or config(model)) as s:
            for arguments, message in cases:
                errors.append(await refused(message, *arguments, "--target", s.target))
            calls = s.server.grpc_calls()
            assert calls is not None
            assert calls.failed == 0, "no call the server refused: only GetModel was sent"

    asyncio.run(scenario())
    assert engine.batches == [], "nothing was sent"
    return errors


def load_checkpoint(
    source: Path, directory: Path, model_outputs: tuple[str, ...] = ()
) -> Checkpoint:
    """`Checkpoint.load` of a job over 40 rows, 10 per item, as `checkpoint_of` makes."""
    return Checkpoint.load(
        directory, input_path=source, rows=40, rows_per_item=10, model_outputs=model_outputs
    )


def ca_and_crl(directory: Path) -> tuple[Path, Path, Path]:
    """A CA made with `openssl` in `directory`, PEM: its key, its certificate, and a CRL
    it signed (which Python's TLS loads as readily as a certificate)."""
    openssl = shutil.which("openssl")
    assert openssl is not None, "the TLS tests generate their certificates with `openssl`"
    (directory / "ca.cnf").write_text(
        "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\ndefault_md = sha256\n"
        "default_crl_days = 2\n",
        encoding="ascii",
    )
    (directory / "index.txt").touch()
    for command in (
        (
            "req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key "
            "-out ca.pem -subj /CN=ca -days 2"
        ),
        "ca -gencrl -config ca.cnf -keyfile ca.key -cert ca.pem -out crl.pem",
    ):
        subprocess.run(
            [openssl, *command.split()], cwd=directory, check=True, capture_output=True, timeout=60
        )
    return directory / "ca.key", directory / "ca.pem", directory / "crl.pem"


def test_model_and_stats_print_readable_tables(small_model: Path) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            code, out, err = await cli("model", "--target", s.target)
            assert code == 0, err
            assert "input   input   float32  [?, 512]" in out
            assert "output  output  float32  [?, 10]" in out
            assert (
                "standard     1         2048           10000       4            0.1        default"
                in out
            )
            code, out, err = await cli("stats", "--target", s.target)
            assert code == 0, err
            assert "state        SERVING" in out
            assert "bulk         0/16384" in out
            assert "idempotency  0 replayed" in out

    asyncio.run(scenario())


def test_the_connection_options_are_taken_before_the_command_too(small_model: Path) -> None:
    """`laneserve-client --target H:P model` was refused "invalid choice: 'H:P' (choose
    from 'model', ...)", which did not say that --target went after the command. Taken
    there too; given in both places, the one after the command is taken."""

    async def scenario() -> list[tuple[int, str, str]]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return [
                await cli("--target", s.target, "model"),
                await cli("model", "--target", s.target),
                await cli(
                    "--target", "127.0.0.1:1", "--timeout", "30", "model", "--target", s.target
                ),
            ]

    before, after, both = asyncio.run(scenario())
    assert before[0] == 0, before[2]
    assert before == after
    assert both == after


def test_connection_options_before_the_command_are_kept_unless_given_after_it() -> None:
    """An option not given after the command leaves what was given before it (or its
    default); --metadata adds: every pair from both places is sent."""
    parse = client_cli_module._parse_args
    args = parse(["--metadata", "a=1", "--attempts", "2", "--tls", "stats", "--metadata", "b=2"])
    assert (args.metadata, args.attempts, args.tls) == (["a=1", "b=2"], 2, True)
    args = parse(["--attempts", "2", "--log-level", "debug", "stats", "--attempts", "3"])
    assert (args.attempts, args.log_level) == (3, "debug")
    defaults = parse(["stats"])
    connection = ("target", "tls", "tls_ca", "metadata", "attempts", "timeout", "log_level")
    assert {name: getattr(defaults, name) for name in connection} == {
        "target": "127.0.0.1:50051",
        "tls": False,
        "tls_ca": None,
        "metadata": [],
        "attempts": 6,
        "timeout": None,
        "log_level": "warning",
    }


def test_model_prints_which_model_and_server_answer(small_model: Path, tmp_path: Path) -> None:
    """`model` names the served model's SHA-256 (to compare with `sha256sum` of the file
    rolled out), its own model_version and producer, and the server's release."""
    path = tmp_path / "versioned.onnx"
    model = onnx.load(str(small_model))
    model.model_version = 5
    onnx.save(model, str(path))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()

    async def scenario() -> None:
        engine = RecordingEngine(str(path), estimate=no_static_estimate)
        async with serving(engine, config(path)) as s:
            code, out, err = await cli("model", "--target", s.target)
        assert code == 0, err
        version = importlib.metadata.version("laneserve")
        assert out.startswith(
            f"model        {path}\n"
            f"sha256       {digest}\n"
            "version      5\n"
            "producer     laneserve.demo_model\n"
            f"server       laneserve {version}\n"
        ), out

    asyncio.run(scenario())


def test_model_prints_none_for_a_model_version_the_model_does_not_set(small_model: Path) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            code, out, err = await cli("model", "--target", s.target)
        assert code == 0, err
        assert "\nversion      none\n" in out

    asyncio.run(scenario())


def test_infer_prints_outputs_as_json_or_writes_them(
    small_model: Path, small_reference: ort.InferenceSession, tmp_path: Path
) -> None:
    x = rows(2, seed=5)
    expected = small_reference.run(None, {"input": x})[0]

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            code, out, err = await cli(
                "infer", "--target", s.target, "--json", json.dumps(x.tolist()), "--lane", "bulk"
            )
            assert code == 0, err
            got = np.asarray(json.loads(out)["output"], dtype=np.float32)
            np.testing.assert_allclose(got, expected, rtol=1e-6)
            np.save(tmp_path / "x.npy", x)
            code, _, err = await cli(
                "infer",
                "--target",
                s.target,
                "--input",
                str(tmp_path / "x.npy"),
                "--output",
                str(tmp_path / "y.npz"),
            )
            assert code == 0, err
        with np.load(tmp_path / "y.npz") as saved:
            np.testing.assert_array_equal(saved["output"], expected)

    asyncio.run(scenario())


def test_infer_refuses_what_getmodel_rules_out_with_exit_2_before_sending(
    small_model: Path, tmp_path: Path
) -> None:
    """bulk's checks: the server would refuse the call (exit 3), as if it had failed."""
    (tmp_path / "empty.json").write_text("{}", encoding="utf-8")
    one_row = ["--json", json.dumps({"input": rows(1).tolist()})]
    cases = [
        (
            [*one_row, "--lane", "nope"],
            "--lane 'nope': the server has no such lane; its lanes are",
        ),
        (
            [*one_row, "--output-name", "nope"],
            "--output-name nope: the model has no such output; its outputs are ['output']",
        ),
        (
            ["--json", "{}"],
            "--json lacks input(s) ['input']; it holds [], the model's inputs are ['input']",
        ),
        (
            # json kept the last of a key given twice: the first value was dropped unsaid.
            ["--json", '{"input": [[0.5]], "input": [[1.5]]}'],
            "--json: key(s) ['input'] given more than once; expected each once",
        ),
        (
            ["--input", str(tmp_path / "empty.json")],
            f"{tmp_path / 'empty.json'} lacks input(s) ['input']; it holds []",
        ),
        (
            ["--input", str(tmp_path / "rows9.npy"), "--lane", "interactive"],
            "the request has 9 rows; lane 'interactive' holds at most 8 rows",
        ),
        (
            # 64 rows of 512 float32: 131 072 bytes of data, over the server's limit.
            ["--input", str(tmp_path / "rows64.npy")],
            "the request is 131128 bytes encoded, over the 98330-byte message limit",
        ),
        (
            # 98 304 bytes of data fit; with the request's framing they do not (the server
            # refused it: exit 3).
            ["--input", str(tmp_path / "rows48.npy")],
            "the request is 98360 bytes encoded, over the 98330-byte message limit",
        ),
        (
            # The server refused it (exit 3), as bulk's check does not.
            ["--input", str(tmp_path / "rows0.npy")],
            f"{tmp_path / 'rows0.npy'} has 0 rows; expected at least one",
        ),
    ]
    np.save(tmp_path / "rows0.npy", rows(0))
    np.save(tmp_path / "rows9.npy", rows(9))
    np.save(tmp_path / "rows64.npy", rows(64))
    np.save(tmp_path / "rows48.npy", rows(48))
    lanes = (
        LaneConfig("interactive", capacity_rows=8, timeout_ms=2000, max_wait_ms=1, min_share=0),
        LaneConfig("standard", capacity_rows=2048, timeout_ms=10000, max_wait_ms=4, min_share=0.1),
    )
    settings = config(small_model, lanes=lanes, max_message_bytes=98_330)
    refused_before_sending(
        small_model, [(["infer", *arguments], message) for arguments, message in cases], settings
    )


def test_bulk_writes_outputs_equal_to_session_run(
    small_model: Path, small_reference: ort.InferenceSession, tmp_path: Path
) -> None:
    x = rows(5_000, seed=6)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            code, _, err = await cli(
                "bulk",
                "--target",
                s.target,
                "--input",
                str(tmp_path / "in.npy"),
                "--output",
                str(out),
            )
            assert code == 0, err
            assert "5000 rows done" in err
            assert "rows/s" in err, "the progress line"

    asyncio.run(scenario())
    np.testing.assert_allclose(
        np.load(out), small_reference.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6
    )
    assert not (tmp_path / "out.npy.partial").exists(), "the checkpoint is removed when done"


async def stopped_bulk_job(
    target: str,
    engine: MeteredEngine,
    args: list[str],
    state: Path,
    *,
    items: int,
    signals: list[signal.Signals],
) -> tuple[int, str]:
    """`laneserve-client bulk ARGS` against `target`, checkpointing after each item, sent
    `signals` once `engine` has run `items` batches of one item each (and holds the next):
    its exit status and standard error. Killed, and waited for, should it outlive this."""
    process = await asyncio.create_subprocess_exec(
        *INTERRUPTIBLE_CLIENT_CLI,
        "bulk",
        "--target",
        target,
        *args,
        "--checkpoint-interval-s",
        "0",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        engine.permits.release(items)
        await until(lambda: done_items(state) >= items, timeout_s=30.0)
        for signum in signals:
            process.send_signal(signum)
        _, err_bytes = await asyncio.wait_for(process.communicate(), timeout=CLIENT_CLI_TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, err_bytes.decode()


@pytest.mark.parametrize(
    ("signum", "exit_code", "message", "times"),
    [
        (signal.SIGKILL, -signal.SIGKILL, None, 1),
        (signal.SIGINT, 130, "interrupted", 1),
        (signal.SIGTERM, 143, "terminated", 1),
        (signal.SIGINT, 130, "interrupted", 2),
        (signal.SIGTERM, 143, "terminated", 2),
    ],
    ids=["SIGKILL", "SIGINT", "SIGTERM", "SIGINT-twice", "SIGTERM-twice"],
)
def test_interrupted_bulk_job_resumes_where_it_stopped(
    small_model: Path,
    small_reference: ort.InferenceSession,
    tmp_path: Path,
    signum: signal.Signals,
    exit_code: int,
    message: str | None,
    times: int,
) -> None:
    """The job is stopped after some progress: killed (SIGKILL) while a batch runs, or
    interrupted (SIGINT / SIGTERM: exit 130 / 143, the checkpoint saved), once or twice in
    a row (a second Ctrl-C; `timeout` signals the process and then its group: one line,
    no traceback). `--resume` completes it; the output equals session.run and no row ran
    twice: the items answered after the last checkpoint, and the one that was running,
    come back from the server's replay cache."""
    x = rows(1_000, seed=4, start=0)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"
    state = tmp_path / "out.npy.partial" / "state.json"
    args = ["--input", str(tmp_path / "in.npy"), "--output", str(out), "--rows-per-item", "10"]

    async def scenario() -> MeteredEngine:
        engine = MeteredEngine(str(small_model))
        try:
            async with serving(engine, config(small_model, max_batch_size=10)) as s:
                # 20 batches of one item each, then it stalls
                returncode, err = await stopped_bulk_job(
                    s.target, engine, args, state, items=20, signals=[signum] * times
                )
                assert returncode == exit_code, err
                if message is not None:
                    assert err.count(f"laneserve-client: {message}") == 1, err
                    assert "Traceback" not in err, err
                    assert done_items(state) == 20, "the checkpoint was saved"
                    assert "200 of 1000 rows done: rerun with --resume" in err, err
                assert not out.exists()
                engine.unlimited()
                code, _, err = await cli("bulk", "--target", s.target, *args, "--resume")
                assert code == 0, err
                assert "resuming job" in err
                if message is not None:
                    assert "200 of 1000 rows already done" in err
        finally:
            engine.unlimited()
        return engine

    engine = asyncio.run(scenario())
    np.testing.assert_allclose(
        np.load(out), small_reference.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6
    )
    assert sorted(engine.ran_tags) == list(range(1_000)), "no row ran twice"
    assert not state.parent.exists(), "the checkpoint is removed when the job is done"


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_is_taken_once_and_the_next_ignored_while_it_unwinds(
    first: signal.Signals,
) -> None:
    """The first SIGINT or SIGTERM raises (KeyboardInterrupt, Terminated); any after it,
    while that unwinds to the exit (the stream closed, the checkpoint's last save), is
    ignored: raised again, a second Ctrl-C (or `timeout`'s SIGTERM to the process and
    then its group) abandoned the last save, or was raised in gRPC's callbacks. The
    handlers are given back after."""
    before = {each: signal.getsignal(each) for each in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored at start
    try:
        raised: type[BaseException] = (
            KeyboardInterrupt if first == signal.SIGINT else client_cli_module.Terminated
        )
        with client_cli_module._stopped_once():
            with pytest.raises(raised):
                signal.raise_signal(first)
            for again in (signal.SIGINT, signal.SIGTERM, first):
                try:
                    signal.raise_signal(again)  # ignored: nothing raised, the process lives
                except (KeyboardInterrupt, client_cli_module.Terminated):
                    pytest.fail(f"{again.name} after the first stop signal was raised")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        for each, handler in before.items():
            signal.signal(each, handler)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_whose_raise_a_finalizer_swallowed_is_raised_again() -> None:
    """The handler's raise lands wherever the main thread is: in a finalizer, Python prints
    it ("Exception ignored in ...") and drops it, and the job went on to its end, exit 0,
    every later signal ignored (a README audit, 1 SIGTERM in ~90). The stop is kept and
    raised at the bulk job's next answer (`_raise_if_stopped`)."""

    class RaisesInItsFinalizer:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGTERM)  # its handler raises here: dropped

    before = signal.getsignal(signal.SIGTERM)
    try:
        with client_cli_module._stopped_once():
            client_cli_module._raise_if_stopped()  # no stop yet: nothing
            finalized = RaisesInItsFinalizer()
            del finalized  # "Exception ignored in ...": the job would go on
            with pytest.raises(client_cli_module.Terminated):
                client_cli_module._raise_if_stopped()
        client_cli_module._raise_if_stopped()  # forgotten once the command ends
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_signal_ignored_at_start_stays_ignored_by_the_client() -> None:
    """SIGINT ignored at start (a shell's background job): not made to stop the command."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with client_cli_module._stopped_once():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)  # nothing raised
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_stop_signal_due_as_the_client_begins_a_wait_stops_it_at_once(
    small_model: Path,
) -> None:
    """A signal's handler runs on the main thread between bytecodes: a SIGTERM that came
    as the main thread entered the client's wait for its loop (a bulk job's next result,
    the server holding the batch) ran only once that wait ended, and the job hung past
    it (one checkpoint's signal in ~1 000 arrived so). Here the signal comes so for
    sure: blocked on the main thread, it is taken by another thread, whose handler in C
    only marks it due. The wait looks for it every SIGNAL_CHECK_S, and the stop is raised
    while the batch is still held (a watchdog ends it after 60 s, failing the test)."""
    engine = RecordingEngine(str(small_model))
    engine.hold()
    served: queue.Queue[str] = queue.Queue()
    done = threading.Event()

    async def serve() -> None:
        async with serving(engine, config(small_model)) as s:
            served.put(s.target)
            await asyncio.to_thread(done.wait)

    # Its own thread and loop: the main thread must be free to wait in the client.
    server = threading.Thread(target=asyncio.run, args=(serve(),))
    server.start()
    # The held batch ends after 60 s, the wait with it, whatever happens here.
    released_by_watchdog = threading.Event()

    def watchdog() -> None:
        released_by_watchdog.set()
        engine.release()

    ends = threading.Timer(60.0, watchdog)
    ends.start()
    try:
        with Client(served.get(timeout=60)) as client, client_cli_module._stopped_once():
            # Threads made before the mask (the client's, the server's, gRPC's) take the
            # signal; the main thread never does.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                sender = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
                sender.start()
                with pytest.raises(client_cli_module.Terminated):
                    client.infer({"input": rows(1)})
                held = not released_by_watchdog.is_set()
                sender.join()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        assert held, "the stop was taken only as the held batch ended"
    finally:
        ends.cancel()
        engine.release()
        done.set()
        server.join(timeout=60)


def test_failed_rows_exit_1_and_resume_retries_only_them(
    small_model: Path, small_reference: ort.InferenceSession, tmp_path: Path
) -> None:
    x = rows(400, seed=8, start=0)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npz"
    args = ["--input", str(tmp_path / "in.npy"), "--output", str(out), "--rows-per-item", "20"]

    async def scenario() -> RecordingEngine:
        engine = RecordingEngine(str(small_model))
        engine.fail_when = lambda batch: any(100 <= tag < 140 for tag in batch_tags(batch))
        async with serving(engine, config(small_model, max_batch_size=20)) as s:
            code, _, err = await cli("bulk", "--target", s.target, *args)
            assert code == 1, err
            assert "2 of 20 items failed (ENGINE_FAILURE 2)" in err
            assert "rerun with --resume" in err
            with np.load(out) as partial:
                assert np.isnan(partial["output"][100:140]).all()
            assert (tmp_path / "out.npz.failed.json").exists()
            engine.fail_when = lambda _batch: False
            code, _, err = await cli("bulk", "--target", s.target, *args, "--resume")
            assert code == 0, err
            assert "360 of 400 rows already done" in err
            assert not (tmp_path / "out.npz.failed.json").exists(), "no row is failed now"
        return engine

    engine = asyncio.run(scenario())
    with np.load(out) as saved:
        np.testing.assert_allclose(
            saved["output"], small_reference.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6
        )
    assert sorted(engine.ran_tags) == list(range(400)), "only the failed rows ran again"


def lookup_model(path: Path) -> Path:
    """y[N, 4] = table[int(input[:, 0])] + input: a row whose first value is 10 or more makes
    ONNX Runtime's Gather fail (index out of range), that row alone."""
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    constant = {
        name: helper.make_tensor(name, TensorProto.INT64, [1], [value])
        for name, value in (("start", 0), ("end", 1), ("axis", 1), ("flat", -1))
    }
    nodes = [
        *(
            helper.make_node("Constant", [], [name], value=value)
            for name, value in constant.items()
        ),
        helper.make_node("Slice", ["input", "start", "end", "axis"], ["column"]),
        helper.make_node("Reshape", ["column", "flat"], ["flat_column"]),
        helper.make_node("Cast", ["flat_column"], ["index"], to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "index"], ["looked_up"], axis=0),
        helper.make_node("Add", ["looked_up", "input"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "lookup",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[onnx.numpy_helper.from_array(table, "table")],
    )
    return save_model(path, graph)


def test_failed_rows_are_named_by_input_row_and_the_output_is_written(tmp_path: Path) -> None:
    """With rows the model fails on, the job exited 1 with no output (only in
    OUTPUT.partial, and a --resume failed the same way for good), named three of the
    failed items as "item K" and the row as "row R of this request", and said nothing of
    the others. Now the output is written with the failed rows as NaN, OUTPUT.failed.json
    lists them by input row, and stderr names input rows and how many more items failed."""
    model = lookup_model(tmp_path / "lookup.onnx")
    x = np.zeros((100, 4), np.float32)
    x[:, 0] = np.arange(100) % 10
    x[:, 1] = np.arange(100)
    bad_rows = [23, 57, 81, 95]
    x[bad_rows, 0] = 12
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"
    sidecar = tmp_path / "out.npy.failed.json"
    args = ["--input", str(tmp_path / "in.npy"), "--output", str(out), "--rows-per-item", "10"]

    async def scenario() -> list[str]:
        errs = []
        async with serving(RecordingEngine(str(model)), config(model)) as s:
            for resume in ((), ("--resume",)):  # a resume fails alike, and writes both again
                out.unlink(missing_ok=True)
                sidecar.unlink(missing_ok=True)
                code, _, err = await cli("bulk", "--target", s.target, *args, *resume)
                assert code == 1, err
                errs.append(err)
        return errs

    for err in asyncio.run(scenario()):
        assert "4 of 10 items failed (ENGINE_FAILURE 4)" in err
        assert "input rows 20-29 (item 2; its error names input row 23)" in err
        assert "input rows 50-59 (item 5; its error names input row 57)" in err
        assert "and 1 more failed item(s), in " in err
        assert f"Wrote {out}" in err
        assert "rerun with --resume" in err
    written = np.load(out)
    failed = np.zeros(100, bool)
    for item in (2, 5, 8, 9):
        failed[item * 10 : item * 10 + 10] = True
    assert np.isnan(written[failed]).all()
    good = x[~failed]
    expected = np.arange(40, dtype=np.float32).reshape(10, 4)[good[:, 0].astype(int)] + good
    np.testing.assert_array_equal(written[~failed], expected)
    listed = json.loads(sidecar.read_text())
    assert listed["failed_rows"] == 40
    assert [
        (entry["item"], entry["first_row"], entry["rows"], entry["server_row"], entry["reason"])
        for entry in listed["failed_items"]
    ] == [
        (2, 20, 10, 23, "ENGINE_FAILURE"),
        (5, 50, 10, 57, "ENGINE_FAILURE"),
        (8, 80, 10, 81, "ENGINE_FAILURE"),
        (9, 90, 10, 95, "ENGINE_FAILURE"),
    ]
    assert all(
        "Gather" in entry["message"] or "out of" in entry["message"]
        for entry in listed["failed_items"]
    )


def test_a_resume_naming_every_output_is_the_job_that_named_none(
    small_model: Path, tmp_path: Path
) -> None:
    """The demo model has one output: `--output-name output` asks for what no
    --output-name asks for, and a resume with it goes on (it was refused as another job,
    "different --output-name (all then, output now)")."""
    np.save(tmp_path / "in.npy", rows(40, seed=3, start=0))
    out = tmp_path / "out.npy"
    args = ["--input", str(tmp_path / "in.npy"), "--output", str(out), "--rows-per-item", "20"]

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        engine.fail_when = lambda batch: any(tag >= 20 for tag in batch_tags(batch))
        async with serving(engine, config(small_model, max_batch_size=20)) as s:
            code, _, err = await cli("bulk", "--target", s.target, *args)
            assert code == 1, err
            engine.fail_when = lambda _batch: False
            resume = ("--resume", "--output-name", "output")
            code, _, err = await cli("bulk", "--target", s.target, *args, *resume)
            assert code == 0, err
            assert "20 of 40 rows already done" in err

    asyncio.run(scenario())
    assert np.load(out).shape == (40, 10)


def test_a_resume_asking_for_other_outputs_is_refused(tmp_path: Path) -> None:
    """The checkpoint holds the outputs first asked for: a resume with other
    --output-name values would leave the rows done so far empty in the new ones."""
    source = tmp_path / "in.npy"
    np.save(source, rows(10))
    job = tmp_path / "job"
    Checkpoint.create(
        job, job_id="j", input_path=source, rows=10, rows_per_item=4, output_names=("output",)
    )
    with pytest.raises(CheckpointError, match=r"different --output-name \(output then, all now\)"):
        Checkpoint.load(job, input_path=source, rows=10, rows_per_item=4)
    resumed = Checkpoint.load(
        job, input_path=source, rows=10, rows_per_item=4, output_names=("output",)
    )
    assert resumed.output_names == ("output",)


def test_a_resume_on_a_changed_input_file_says_it_changed_not_that_it_is_another(
    tmp_path: Path,
) -> None:
    """It said "different input file (it was made for in.npy)", naming the very file the
    user passed."""
    source, directory = checkpoint_of(tmp_path)
    size = source.stat().st_size

    def refusal(input_path: Path, row_count: int = 40) -> str:
        with pytest.raises(CheckpointError) as raised:
            Checkpoint.load(directory, input_path=input_path, rows=row_count, rows_per_item=10)
        return str(raised.value)

    np.save(source, rows(40, seed=9))  # regenerated: the same size, other values
    message = refusal(source)
    assert (
        f"checkpoint {directory} belongs to another job: the input {source} changed since "
        f"the checkpoint was made (the same {size} bytes, but the digest of its first and "
        "last MiB differs): the rows done may be answers to other rows; expected the same "
        "input and options"
    ) in message
    assert "it was made for" not in message
    np.save(source, rows(48))  # rows added
    message = refusal(source, row_count=48)
    assert (
        f"the input {source} changed since the checkpoint was made ({size} bytes then, "
        f"{source.stat().st_size} now): the rows done may be answers to other rows; "
        "different rows (40 then, 48 now)"
    ) in message
    (tmp_path / "link.npy").symlink_to(source)  # another path to the same file
    message = refusal(tmp_path / "link.npy", row_count=48)
    assert f"the input {tmp_path / 'link.npy'} changed since the checkpoint was made" in message
    other = tmp_path / "other.npy"
    np.save(other, rows(40, seed=3))
    message = refusal(other)
    assert f"different input file (it was made for {source})" in message
    assert "changed since" not in message


def test_a_resume_on_an_input_edited_in_place_between_its_ends_is_refused(
    tmp_path: Path,
) -> None:
    """Rows 5000-5009 of a large input rewritten in place kept its size and its first and
    last MiB: the resume was taken, and the output mixed answers to the old rows with the
    new. The file's modification time, recorded too, tells it."""
    source = tmp_path / "in.npy"
    np.save(source, rows(10_000))  # 20 MiB: the rows edited are far from both ends
    directory = tmp_path / "out.npy.partial"
    Checkpoint.create(directory, job_id="j", input_path=source, rows=10_000, rows_per_item=100)
    then_ns = source.stat().st_mtime_ns
    edited = np.load(source, mmap_mode="r+")
    edited[5000:5010] = 7.0
    edited.flush()
    del edited
    os.utime(source, ns=(then_ns, then_ns + 1_000_000_000))  # whatever the clock's grain
    with pytest.raises(CheckpointError) as raised:
        Checkpoint.load(directory, input_path=source, rows=10_000, rows_per_item=100)
    message = str(raised.value)
    assert f"the input {source} changed since the checkpoint was made (the same " in message
    assert "bytes, but modified since: at " in message
    assert f"delete {directory} and run again without --resume to start over" in message
    os.utime(source, ns=(then_ns, then_ns))  # the time put back: not a deliberate-edit guard
    Checkpoint.load(directory, input_path=source, rows=10_000, rows_per_item=100)


def test_a_checkpoint_without_a_recorded_mtime_resumes_on_size_and_digest(
    tmp_path: Path,
) -> None:
    """An earlier client's state.json has no input_identity.mtime_ns: it still resumes,
    checked as before, and a save keeps it without one (not null, which reads back as
    damaged)."""
    source, directory = checkpoint_of(tmp_path)
    edit_state(directory, lambda state: state["input_identity"].pop("mtime_ns"))
    os.utime(source, ns=(0, 0))
    resumed = Checkpoint.load(directory, input_path=source, rows=40, rows_per_item=10)
    assert resumed.input_identity.mtime_ns is None
    resumed.save()
    state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
    assert "mtime_ns" not in state["input_identity"]
    Checkpoint.load(directory, input_path=source, rows=40, rows_per_item=10)


def test_a_locked_checkpoint_is_refused_to_a_second_run(tmp_path: Path) -> None:
    _source, directory = checkpoint_of(tmp_path)
    busy = pytest.raises(CheckpointBusyError, match="is in use by another run, still running")
    with locked(directory), busy, locked(directory):
        pass
    with locked(directory):  # released with the run
        pass


def test_a_resume_while_another_run_uses_the_checkpoint_exits_2_naming_it(
    small_model: Path, tmp_path: Path
) -> None:
    """Two runs on one --output at once (the second with --resume) stepped on each other:
    the first exited 2 naming a checkpoint that the second had finished and removed. The
    second is refused at once, the first's checkpoint untouched."""
    source, directory = checkpoint_of(tmp_path)
    state = (directory / "state.json").read_bytes()

    async def scenario() -> tuple[int, str]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            code, _, err = await cli(
                "bulk",
                "--target",
                s.target,
                "--input",
                str(source),
                "--output",
                str(tmp_path / "out.npy"),
                "--rows-per-item",
                "10",
                "--resume",
            )
        return code, err

    with locked(directory):  # the other run's
        code, err = asyncio.run(scenario())
    assert code == 2, err
    assert f"checkpoint {directory} is in use by another run, still running" in err
    assert (directory / "state.json").read_bytes() == state
    assert not (tmp_path / "out.npy").exists()


def test_outputs_whose_names_make_one_file_name_keep_their_own_rows(
    tmp_path: Path, colliding_model: Path
) -> None:
    """'logits:0' and 'logits_0' each get a file of their own, in the checkpoint and in
    the output. (Both were written to logits_0.npy: the job's output held one output's
    bytes under both names, read as the other's dtype.)"""
    x = np.arange(120, dtype=np.float32).reshape(40, 3)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npz"

    async def scenario() -> None:
        async with serving(
            Engine(str(colliding_model), estimate=estimate_once), config(colliding_model)
        ) as s:
            code, _, err = await cli(
                "bulk",
                "--target",
                s.target,
                "--input",
                str(tmp_path / "in.npy"),
                "--output",
                str(out),
                "--rows-per-item",
                "10",
            )
            assert code == 0, err

    asyncio.run(scenario())
    with np.load(out) as saved:
        assert sorted(saved.files) == ["logits:0", "logits_0"]
        np.testing.assert_array_equal(saved["logits:0"], x)
        np.testing.assert_array_equal(saved["logits_0"], x.astype(np.int64))


def test_a_resume_reads_each_output_from_the_file_its_first_run_wrote(tmp_path: Path) -> None:
    """state.json names each output's file; the outputs' names would make one."""
    source = tmp_path / "in.npy"
    np.save(source, rows(4))
    directory = tmp_path / "out.npz.partial"
    first = Checkpoint.create(directory, job_id="j", input_path=source, rows=4, rows_per_item=2)
    first.store(0, {"logits:0": np.full((2, 3), 1.5, np.float32), "logits_0": np.full((2, 3), 7)})
    first.save()
    files = sorted(path.name for path in directory.glob("*.npy"))
    assert len(files) == 2, files
    resumed = Checkpoint.load(
        directory,
        input_path=source,
        rows=4,
        rows_per_item=2,
        model_outputs=("logits:0", "logits_0"),
    )
    assert resumed.files == first.files
    resumed.store(1, {"logits:0": np.full((2, 3), 2.5, np.float32), "logits_0": np.full((2, 3), 8)})
    resumed.finish(tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as saved:
        np.testing.assert_array_equal(saved["logits:0"].ravel(), [1.5] * 6 + [2.5] * 6)
        np.testing.assert_array_equal(saved["logits_0"].ravel(), [7] * 6 + [8] * 6)


def test_outputs_named_like_savez_parameters_are_written_to_the_npz(tmp_path: Path) -> None:
    """numpy.savez takes the arrays as keyword arguments: an output named `file` failed the
    finish with a TypeError, and one named `allow_pickle` was left out of the file."""
    source = tmp_path / "in.npy"
    np.save(source, rows(4))
    directory = tmp_path / "out.npz.partial"
    checkpoint = Checkpoint.create(
        directory, job_id="j", input_path=source, rows=4, rows_per_item=2
    )
    for item, value in enumerate((1.5, 2.5)):
        checkpoint.store(
            item,
            {
                "file": np.full((2, 3), value, np.float32),
                "allow_pickle": np.full((2, 1), 10 * value),
            },
        )
    checkpoint.finish(tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as saved:
        assert sorted(saved.files) == ["allow_pickle", "file"]
        np.testing.assert_array_equal(saved["file"].ravel(), [1.5] * 6 + [2.5] * 6)
        np.testing.assert_array_equal(saved["allow_pickle"].ravel(), [15.0] * 2 + [25.0] * 2)


def test_a_version_1_checkpoint_resumes_unless_two_outputs_shared_its_file(tmp_path: Path) -> None:
    """Version 1 named no files: each output's was its name made safe. Such a checkpoint
    still resumes (saved again as version 2), unless two outputs shared one file: then
    its rows are lost, and it is refused naming both."""
    source = tmp_path / "in.npy"
    np.save(source, rows(4))
    directory = tmp_path / "out.npz.partial"
    checkpoint = Checkpoint.create(
        directory, job_id="j", input_path=source, rows=4, rows_per_item=2
    )
    checkpoint.store(0, {"a:b": np.full((2, 3), 1.5, np.float32), "c": np.full((2, 3), 7)})
    checkpoint.save()
    (directory / checkpoint.files["a:b"]).rename(directory / "a_b.npy")  # as version 1 named it

    def as_version_1(state: dict[str, Any]) -> None:
        state["version"] = 1
        for spec in state["outputs"].values():
            del spec["file"]

    edit_state(directory, as_version_1)
    resumed = Checkpoint.load(directory, input_path=source, rows=4, rows_per_item=2)
    assert resumed.files == {"a:b": "a_b.npy", "c": "c.npy"}
    np.testing.assert_array_equal(resumed.arrays["a:b"][:2], np.full((2, 3), 1.5, np.float32))
    resumed.save()
    state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
    assert state["version"] == 2
    assert state["outputs"]["a:b"]["file"] == "a_b.npy"

    def shared(state: dict[str, Any]) -> None:
        as_version_1(state)
        state["outputs"]["a_b"] = state["outputs"]["c"]

    edit_state(directory, shared)
    with pytest.raises(
        CheckpointError,
        match=r"damaged: outputs 'a:b' and 'a_b' share the file a_b\.npy \(version 1 named",
    ):
        Checkpoint.load(directory, input_path=source, rows=4, rows_per_item=2)


def test_existing_checkpoint_needs_resume(small_model: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "in.npy", rows(10))
    (tmp_path / "out.npy.partial").mkdir()

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            code, _, err = await cli(
                "bulk",
                "--target",
                s.target,
                "--input",
                str(tmp_path / "in.npy"),
                "--output",
                str(tmp_path / "out.npy"),
            )
        assert code == 2
        assert "pass --resume to continue it, or delete it to start over" in err

    asyncio.run(scenario())


@pytest.mark.parametrize("resume", [(), ("--resume",)], ids=["new", "resume"])
def test_a_file_where_the_checkpoint_goes_is_named_as_in_the_way(
    small_model: Path, tmp_path: Path, resume: tuple[str, ...]
) -> None:
    """A plain file at OUTPUT.partial was called "the checkpoint of an unfinished job"
    (or, with --resume, its state.json "unreadable (Not a directory)"): no job made it."""
    np.save(tmp_path / "in.npy", rows(10))
    (tmp_path / "out.npy.partial").write_text("not a checkpoint\n")
    args = ["--input", str(tmp_path / "in.npy"), "--output", str(tmp_path / "out.npy")]

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            code, _, err = await cli("bulk", "--target", s.target, *args, *resume)
        assert code == 2, err
        partial = tmp_path / "out.npy.partial"
        assert f"{partial} is in the way: a checkpoint directory goes there" in err

    asyncio.run(scenario())


def test_an_input_that_is_not_the_npy_or_npz_its_name_says_is_refused_saying_so(
    small_model: Path, tmp_path: Path
) -> None:
    """Not numpy's advice for a pickle, to pass allow_pickle=, which would run a file that
    is no array at all."""
    (tmp_path / "text.npy").write_text("hi\n", encoding="utf-8")
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "text.npz").write_text("hi\n", encoding="utf-8")
    np.savez(tmp_path / "archive.npz", input=rows(1))
    (tmp_path / "archive.npz").rename(tmp_path / "archive.npy")
    npy = "; expected an array written by numpy.save"
    cases = [
        ("infer", "text.npy", f"text.npy is not a .npy file: it starts with b'hi\\n'{npy}"),
        ("bulk", "text.npy", f"text.npy is not a .npy file: it starts with b'hi\\n'{npy}"),
        ("bulk", "empty.npy", f"empty.npy is not a .npy file: it is empty{npy}"),
        ("bulk", "archive.npy", "archive.npy is not a .npy file: it starts with b'PK"),
        (
            "bulk",
            "text.npz",
            "text.npz is not a .npz file: it starts with b'hi\\n'; expected arrays",
        ),
    ]
    output = ["--output", str(tmp_path / "out.npy")]
    errors = refused_before_sending(
        small_model,
        [
            (
                [command, "--input", str(tmp_path / name), *(output if command == "bulk" else [])],
                message,
            )
            for command, name, message in cases
        ],
    )
    for err in errors:
        assert "allow_pickle" not in err, err


def damage_first_member(path: Path) -> None:
    """Makes the compressed data of `path`'s first member an invalid deflate stream: its
    first block says it is of the reserved type."""
    with zipfile.ZipFile(path) as archive:
        offset = archive.infolist()[0].header_offset
    with path.open("r+b") as file:
        file.seek(offset + 26)  # the local header's name and extra field lengths
        name_bytes, extra_bytes = struct.unpack("<HH", file.read(4))
        file.seek(offset + 30 + name_bytes + extra_bytes)
        file.write(b"\xff")


def test_a_damaged_npz_or_json_nested_too_deep_is_unreadable_input_exit_2(
    small_model: Path, tmp_path: Path
) -> None:
    """zipfile's own errors (an archive cut short, a bad CRC, damaged compressed data) and
    the JSON parser's RecursionError ended infer and bulk with a traceback and exit 1,
    the code of a job some of whose items failed."""
    np.savez(tmp_path / "good.npz", input=rows(4))
    whole = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[: len(whole) // 2])
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0xFF  # in the array's data: the CRC no longer matches
    (tmp_path / "crc.npz").write_bytes(bytes(flipped))
    np.savez_compressed(tmp_path / "deflate.npz", input=rows(4))
    damage_first_member(tmp_path / "deflate.npz")
    cases = [
        ("cut.npz", "File is not a zip file"),
        ("crc.npz", "Bad CRC-32 for file 'input.npy'"),
        ("deflate.npz", "Error -3 while decompressing data: invalid block type"),
    ]
    output = ["--output", str(tmp_path / "out.npy")]
    unreadable = [
        ([*command, "--input", str(tmp_path / name)], f"{tmp_path / name}: {why}")
        for name, why in cases
        for command in (["infer"], ["bulk", *output])
    ]
    deep = "[" * 30_000 + "]" * 30_000  # one argument holds 128 KiB at most
    deep_file = tmp_path / "deep.json"
    deep_file.write_text(deep, encoding="utf-8")
    too_deep = "maximum recursion depth exceeded"
    unreadable += [
        (["infer", "--json", deep], f"--json: {too_deep}"),
        (["infer", "--input", str(deep_file)], f"{deep_file}: {too_deep}"),
    ]
    refused_before_sending(
        small_model,
        [(arguments, f"laneserve-client: cannot read {what}") for arguments, what in unreadable],
    )
    assert not (tmp_path / "out.npy.partial").exists()


def test_an_input_that_is_a_directory_is_refused_saying_so(
    small_model: Path, tmp_path: Path
) -> None:
    """It said "input file adir.npy does not exist"."""
    directory = tmp_path / "adir.npy"
    directory.mkdir()
    errors = refused_before_sending(
        small_model,
        [
            (
                [*command, "--input", str(directory)],
                f"input {directory} is a directory; expected a {kinds} file",
            )
            for command, kinds in (
                (["infer"], ".npy, .npz or .json"),
                (["bulk", "--output", str(tmp_path / "out.npy")], ".npy or .npz"),
            )
        ],
    )
    for err in errors:
        assert "does not exist" not in err, err


def test_upper_case_suffixes_are_read_and_written_as_lower_case_ones(
    small_model: Path, small_reference: ort.InferenceSession, tmp_path: Path
) -> None:
    """--input IN.NPY was read, --output OUT.NPY refused; and np.save, given the name,
    wrote OUT.NPY.npy."""
    x = rows(30, seed=2)
    expected = small_reference.run(None, {"input": x})[0]
    source = tmp_path / "IN.NPY"
    with source.open("wb") as file:
        np.save(file, x)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            for command, name in (
                (["bulk", "--rows-per-item", "8"], "BULK.NPY"),
                (["bulk", "--rows-per-item", "8"], "BULK.NPZ"),
                (["infer"], "INFER.NPY"),
                (["infer"], "INFER.Npz"),
            ):
                output = tmp_path / name
                code, _, err = await cli(
                    *command, "--target", s.target, "--input", str(source), "--output", str(output)
                )
                assert code == 0, (command, name, err)
                if name.lower().endswith(".npy"):
                    np.testing.assert_allclose(np.load(output), expected, rtol=1e-5, atol=1e-6)
                else:
                    with np.load(output) as saved:
                        np.testing.assert_allclose(saved["output"], expected, rtol=1e-5, atol=1e-6)

    asyncio.run(scenario())
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "BULK.NPY",
        "BULK.NPZ",
        "IN.NPY",
        "INFER.NPY",
        "INFER.Npz",
    ]


def test_json_values_the_input_dtype_cannot_hold_are_usage_errors(tmp_path: Path) -> None:
    """numpy casts JSON's numbers to the input's dtype as it can: 1.5 became 1 for an
    int64 input and 1e10 inf for a float16 one, sent without a word; a number past
    int64's range ended the client with an OverflowError traceback (exit 1)."""
    path = tmp_path / "ints_and_halves.onnx"
    graph = helper.make_graph(
        [helper.make_node("Identity", ["i"], ["io"]), helper.make_node("Identity", ["h"], ["ho"])],
        "ints_and_halves",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, ["N", 2]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT16, ["N", 2]),
        ],
        [
            helper.make_tensor_value_info("io", TensorProto.INT64, ["N", 2]),
            helper.make_tensor_value_info("ho", TensorProto.FLOAT16, ["N", 2]),
        ],
    )
    save_model(path, graph, check=False)
    half = [[1.0, 2.0]]
    cases = [
        (
            {"i": [[1.5, 2]], "h": half},
            (
                "--json: input 'i': 1.5 at [0, 0] would be sent as 1; expected values int64 "
                "holds exactly"
            ),
        ),
        (
            {"i": [[2**70, 2]], "h": half},
            "--json: input 'i' is not a int64 array of shape [?, 2]: Python int too large",
        ),
        (
            {"i": [[1, 2]], "h": [[1e10, 2.0]]},
            "--json: input 'h' is not a float16 array of shape [?, 2]: overflow encountered",
        ),
    ]

    async def scenario() -> None:
        async with serving(Engine(str(path), device="cpu"), config(path)) as s:
            for document, message in cases:
                await refused(
                    message, "infer", "--target", s.target, "--json", json.dumps(document)
                )
            code, out, err = await cli(
                "infer", "--target", s.target, "--json", json.dumps({"i": [[1.0, 2]], "h": half})
            )
            assert code == 0, err
            assert json.loads(out) == {"io": [[1, 2]], "ho": half}
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert stats.batches == 1, "only the call whose values fit was sent"

    asyncio.run(scenario())


def test_an_npz_holding_arrays_the_model_has_no_input_for_is_refused_naming_them(
    small_model: Path, tmp_path: Path
) -> None:
    """infer and bulk sent the arrays named like the model's inputs and dropped the rest
    without a word, while --json refuses an input name the model lacks."""
    path = tmp_path / "in.npz"
    np.savez(path, input=rows(2), mask=rows(2), extra=rows(2))
    message = (
        f"{path} holds array(s) ['extra', 'mask'] the model has no input for; the model's "
        "inputs are ['input']"
    )
    commands = [
        ["infer", "--input", str(path)],
        ["bulk", "--input", str(path), "--output", str(tmp_path / "out.npz")],
    ]
    refused_before_sending(small_model, [(command, message) for command in commands])


def identity_model(directory: Path, name: str, inputs: dict[str, tuple[int, list[Any]]]) -> Path:
    """A model answering each input (name -> ONNX type, shape) as output `NAME_out`."""
    path = directory / f"{name}.onnx"
    graph = helper.make_graph(
        [helper.make_node("Identity", [i], [f"{i}_out"]) for i in inputs],
        name,
        [helper.make_tensor_value_info(i, kind, shape) for i, (kind, shape) in inputs.items()],
        [
            helper.make_tensor_value_info(f"{i}_out", kind, shape)
            for i, (kind, shape) in inputs.items()
        ],
    )
    return save_model(path, graph)


def test_inputs_that_disagree_on_a_dimension_the_model_names_alike_are_refused_before_sending(
    tmp_path: Path,
) -> None:
    """a[N, K] and b[N, K] given K = 3 and K = 4: bulk sent every item, each refused
    INVALID_INPUT by the server, and exited 1 with a checkpoint and "rerun with --resume",
    which could only fail again. GetModel names each dimension now, and the client
    checks them as the server does: exit 2, nothing sent, no checkpoint."""
    model = identity_model(
        tmp_path,
        "shared_k",
        {"a": (TensorProto.INT64, ["N", "K"]), "b": (TensorProto.FLOAT, ["N", "K", 2])},
    )
    bad = tmp_path / "k_bad.npz"
    np.savez(bad, a=np.zeros((20, 3), np.int64), b=np.zeros((20, 4, 2), np.float32))
    bad_json = json.dumps({"a": [[0, 0, 0]], "b": [[[0.0, 0.0]] * 4]})
    output = tmp_path / "out.npz"
    disagree = "must agree on the model's dimension 'K': axis 1 of 'a' is 3, axis 1 of 'b' is 4"
    refused_before_sending(
        model,
        [
            (
                ["bulk", "--input", str(bad), "--output", str(output), "--rows-per-item", "2"],
                f"inputs 'a' and 'b' in {bad} {disagree}",
            ),
            (["infer", "--input", str(bad)], f"inputs 'a' and 'b' in {bad} {disagree}"),
            (["infer", "--json", bad_json], f"inputs 'a' and 'b' in --json {disagree}"),
        ],
    )
    assert not output.exists()
    assert not Path(f"{output}.partial").exists(), "a job that could only fail leaves none"
    good = tmp_path / "k_good.npz"
    a = np.arange(60, dtype=np.int64).reshape(20, 3)
    b = np.linspace(-1.0, 1.0, 120, dtype=np.float32).reshape(20, 3, 2)
    np.savez(good, a=a, b=b)

    async def scenario() -> None:
        async with serving(Engine(str(model), device="cpu"), config(model)) as s:
            code, _, err = await cli(
                "bulk", "--target", s.target, "--input", str(good), "--output", str(output)
            )
            assert code == 0, err

    asyncio.run(scenario())
    with np.load(output) as answer:
        np.testing.assert_array_equal(answer["a_out"], a)
        np.testing.assert_array_equal(answer["b_out"], b)


def test_infer_writes_strict_json_with_non_finite_floats_as_strings(tmp_path: Path) -> None:
    """infer wrote NaN and Infinity bare (Python's json default), which jq and
    JSON.parse refuse. Now the answer is strict JSON: those values are the strings
    "NaN", "Infinity" and "-Infinity", every other value exact, and --json reads the
    answer back as the same values."""
    model = identity_model(
        tmp_path,
        "floats",
        {"x": (TensorProto.FLOAT, ["N", 4]), "h": (TensorProto.FLOAT16, ["N", 4])},
    )
    x = np.array([[np.nan, np.inf, -np.inf, 0.1]], np.float32)
    h = np.array([[-np.inf, 0.1, np.nan, 65504.0]], np.float16)
    np.savez(tmp_path / "in.npz", x=x, h=h)

    def strict(text: str) -> Any:
        def refuse(constant: str) -> None:
            raise AssertionError(f"{constant} is not JSON")

        return json.loads(text, parse_constant=refuse)

    async def scenario() -> None:
        async with serving(Engine(str(model), device="cpu"), config(model)) as s:
            code, out, err = await cli(
                "infer", "--target", s.target, "--input", str(tmp_path / "in.npz")
            )
            assert code == 0, err
            answer = strict(out)
            assert answer == {
                "x_out": [["NaN", "Infinity", "-Infinity", float(np.float32(0.1))]],
                "h_out": [["-Infinity", float(np.float16(0.1)), "NaN", 65504.0]],
            }
            code, again, err = await cli(
                "infer",
                "--target",
                s.target,
                "--json",
                json.dumps({"x": answer["x_out"], "h": answer["h_out"]}),
            )
            assert code == 0, err
            assert strict(again) == answer

    asyncio.run(scenario())


def test_a_big_endian_input_of_the_models_dtype_is_answered_as_its_values(
    small_model: Path, small_reference: ort.InferenceSession, tmp_path: Path
) -> None:
    """A `>f4` file was refused ("is >f4 ...; the model expects float32"): the byte order
    alone differed, which the wire codec converts. Another dtype is still refused."""
    x = rows(3, seed=7)
    expected = small_reference.run(None, {"input": x})[0]
    np.save(tmp_path / "big.npy", x.astype(">f4"))
    np.savez(tmp_path / "big.npz", input=x.astype(">f4"))
    np.save(tmp_path / "double.npy", x.astype(">f8"))

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            for name in ("big.npy", "big.npz"):
                code, _, err = await cli(
                    "infer",
                    "--target",
                    s.target,
                    "--input",
                    str(tmp_path / name),
                    "--output",
                    str(tmp_path / f"y_{name}.npy"),
                )
                assert code == 0, (name, err)
                np.testing.assert_array_equal(np.load(tmp_path / f"y_{name}.npy"), expected)
            code, _, err = await cli(
                "bulk",
                "--target",
                s.target,
                "--input",
                str(tmp_path / "big.npy"),
                "--output",
                str(tmp_path / "bulk.npy"),
            )
            assert code == 0, err
            np.testing.assert_allclose(np.load(tmp_path / "bulk.npy"), expected, rtol=1e-6)
            code, _, err = await cli(
                "infer", "--target", s.target, "--input", str(tmp_path / "double.npy")
            )
            assert code == 2, err
            assert "is >f8 with shape [3, 512]; the model expects float32" in err

    asyncio.run(scenario())


def echo_text_model(path: Path) -> Path:
    """input string [N, 2] -> output, the same text: one input and one output, so a job
    reads and writes .npy; a row's first text is its index (RecordingEngine's tag)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["output"])],
        "echo_text",
        [helper.make_tensor_value_info("input", TensorProto.STRING, ["N", 2])],
        [helper.make_tensor_value_info("output", TensorProto.STRING, ["N", 2])],
    )
    return save_model(path, graph)


def test_infer_sends_text_from_json_or_str_arrays_and_writes_string_outputs_as_str_arrays(
    text_model: Path, tmp_path: Path
) -> None:
    """Text given as JSON strings (--json, a .json file) or as numpy str_ arrays (.npz),
    answered: printed as JSON strings, or written as str_ arrays (np.save wrote a string
    output as a pickle np.load refuses, and the .npz writer raised a traceback)."""
    document = {
        "text": ["cat", "café", "zebra"],
        "numbers": [["1", "2"], ["3.5", "-4"], ["0", "1e3"]],
    }
    (tmp_path / "in.json").write_text(json.dumps(document), encoding="utf-8")
    np.savez(
        tmp_path / "in.npz", text=np.array(document["text"]), numbers=np.array(document["numbers"])
    )

    async def scenario() -> None:
        engine = Engine(str(text_model), estimate=estimate_once)
        async with serving(engine, config(text_model)) as s:
            code, out, err = await cli(
                "infer", "--target", s.target, "--json", json.dumps(document)
            )
            assert code == 0, err
            assert '"café!"' in out, "text as it is, not \\u-escaped"
            assert json.loads(out) == {
                "tagged": ["cat!", "café!", "zebra!"],
                "label": [0, -1, -1],
                "value": [[1.0, 2.0], [3.5, -4.0], [0.0, 1000.0]],
            }
            for source, output, only in (
                ("in.npz", "out.npz", []),
                ("in.json", "out.npy", ["--output-name", "tagged"]),
            ):
                code, _, err = await cli(
                    "infer",
                    "--target",
                    s.target,
                    "--input",
                    str(tmp_path / source),
                    "--output",
                    str(tmp_path / output),
                    *only,
                )
                assert code == 0, err

    asyncio.run(scenario())
    with np.load(tmp_path / "out.npz") as saved:  # no allow_pickle: str_ arrays
        assert saved["tagged"].dtype == np.dtype("<U6")
        assert saved["tagged"].tolist() == ["cat!", "café!", "zebra!"]
        np.testing.assert_array_equal(saved["label"], [0, -1, -1])
    assert np.load(tmp_path / "out.npy").tolist() == ["cat!", "café!", "zebra!"]


def test_text_the_client_cannot_send_is_refused_before_sending(
    text_model: Path, tmp_path: Path
) -> None:
    """JSON that is not strings where text goes (numpy made 1 the text "1", and uneven
    lists an element that is a list), a file of Python objects (a pickle, which np.load
    refused advising allow_pickle=), or numbers for a string input: exit 2, naming them."""
    numbers = [["1", "2"], ["3", "4"]]
    np.savez(tmp_path / "objects.npz", text=np.array(["a", "b"], object), numbers=np.array(numbers))
    np.savez(tmp_path / "floats.npz", text=np.zeros(2, np.float32), numbers=np.array(numbers))
    objects = str(tmp_path / "objects.npz")
    pickled = (
        f"input 'text' in {objects} holds Python objects (dtype object: an object or a "
        "StringDType array, which numpy saves as a pickle), which this client does not load"
    )
    cases = [
        (
            ["infer", "--json", json.dumps({"text": [1, "b"], "numbers": numbers})],
            (
                "--json: input 'text': 1, not a string at [0]; expected JSON strings in nested "
                "lists of shape [?]"
            ),
        ),
        (
            ["infer", "--json", json.dumps({"text": ["a", "b"], "numbers": [["1", "2"], ["3"]]})],
            # The uneven row, not the first row (numpy's reading named [0]: a review).
            (
                "--json: input 'numbers': a list of 1 at [1], where the first row's shape puts "
                "a list of 2; expected JSON strings in nested lists of shape [?, 2]"
            ),
        ),
        (
            ["infer", "--json", json.dumps({"text": ["a", "b"], "numbers": [["1", "2"], "3"]})],
            "--json: input 'numbers': a string at [1], where the first row's shape puts a list",
        ),
        (
            [
                "infer",
                "--json",
                json.dumps({"text": ["a", "b"], "numbers": [["1", "2"], ["3", ["4"]]]}),
            ],
            (
                "--json: input 'numbers': a list (lists nested unevenly, or deeper than the "
                "shape) at [1, 1]"
            ),
        ),
        (["infer", "--input", objects], pickled),
        (["bulk", "--input", objects, "--output", str(tmp_path / "out.npz")], pickled),
        (
            ["infer", "--input", str(tmp_path / "floats.npz")],
            "is float32 with shape [2]; the model expects string with shape [?]",
        ),
    ]
    refused_before_sending(text_model, cases)
    assert not (tmp_path / "out.npz.partial").exists()


def test_a_bulk_job_of_text_is_refused_only_when_none_of_its_items_fits_the_limit(
    text_model: Path, tmp_path: Path
) -> None:
    """Text rows differ in size: the first item over the message limit said nothing of
    the others (and the rows that fit were counted by numpy's itemsize). A job none of
    whose items fits is refused before sending, saying what fits; one whose other items
    fit runs, and the items over the limit fail alone (never sent)."""
    numbers = np.array([["1", "2"]] * 4)
    np.savez(tmp_path / "long.npz", text=np.array(["x" * 2500] * 4), numbers=numbers)
    np.savez(tmp_path / "longer.npz", text=np.array(["x" * 5000] * 4), numbers=numbers)
    np.savez(tmp_path / "first.npz", text=np.array(["x" * 5000, "a", "b", "c"]), numbers=numbers)
    settings = config(text_model, max_message_bytes=4096)
    job = ["bulk", "--rows-per-item", "2", "--output", str(tmp_path / "out.npz")]
    refused_before_sending(
        text_model,
        [
            (
                [*job, "--input", str(tmp_path / "long.npz")],
                (
                    "--rows-per-item 2: every item is over the 4096-byte message limit encoded, "
                    "the smallest (input rows 0-1) "
                ),
            ),
            (
                [*job, "--input", str(tmp_path / "long.npz")],
                "expected at most 1 rows per item: that item's first 1 fit",
            ),
            (
                [*job, "--input", str(tmp_path / "longer.npz")],
                "expected shorter text: input row 0 alone is over it",
            ),
        ],
        settings,
    )

    async def scenario() -> tuple[int, str]:
        engine = Engine(str(text_model), estimate=estimate_once)
        async with serving(engine, settings) as s:
            code, _, err = await cli(
                *job, "--input", str(tmp_path / "first.npz"), "--target", s.target, "--no-progress"
            )
        return code, err

    code, err = asyncio.run(scenario())
    assert code == 1, err
    assert "1 of 2 items failed (RESOURCE_EXHAUSTED 1)" in err
    with np.load(tmp_path / "out.npz") as saved:
        assert saved["tagged"].tolist() == ["", "", "b!", "c!"]


def test_a_bulk_job_of_text_writes_str_arrays_and_a_non_number_fails_its_item_alone(
    text_model: Path, tmp_path: Path
) -> None:
    """String inputs from str_ and bytes_ arrays, string outputs stored in the checkpoint and
    written as str_ arrays as wide as their widest answer (a late, longer one widens
    the checkpoint's array); the item whose row holds a non-number fails alone: its
    rows are "" in a string output, NaN in a float one, 0 in an int one, named in
    OUTPUT.failed.json. A resume (of a job whose outputs are strings) retries it."""
    text = np.array([*(["cat", "dög", "bird", "zebra"] * 4), "x" * 70, "", "é" * 3, "dog"])
    numbers = np.array([[str(row), "0.5"] for row in range(20)])
    numbers[13, 0] = "thirteen"  # item 2 (rows 10-14)
    np.savez(tmp_path / "in.npz", text=text, numbers=np.char.encode(numbers, "utf-8"))
    out = tmp_path / "out.npz"
    args = ["--input", str(tmp_path / "in.npz"), "--output", str(out), "--rows-per-item", "5"]

    async def scenario() -> list[str]:
        errs = []
        engine = Engine(str(text_model), estimate=estimate_once)
        async with serving(engine, config(text_model)) as s:
            for resume in ((), ("--resume",)):
                code, _, err = await cli("bulk", "--target", s.target, *args, *resume)
                assert code == 1, err
                errs.append(err)
        return errs

    first, resumed = asyncio.run(scenario())
    assert "resuming job" in resumed, resumed
    assert "15 of 20 rows already done" in resumed, resumed
    for err in (first, resumed):
        assert "1 of 4 items failed (ENGINE_FAILURE 1)" in err, err
        assert "input rows 10-14 (item 2; its error names input row 13)" in err, err
        assert "empty strings in a string output" in err, err
    failed = np.zeros(20, bool)
    failed[10:15] = True
    with np.load(out) as saved:  # no allow_pickle: str_ arrays
        tagged, label, value = saved["tagged"], saved["label"], saved["value"]
    assert tagged.dtype == np.dtype("<U71"), "as wide as the widest answer"
    assert tagged[failed].tolist() == [""] * 5
    assert tagged[~failed].tolist() == [f"{word}!" for word in text[~failed]]
    assert (label[failed] == 0).all()
    labels = [TEXT_LABELS.index(word) if word in TEXT_LABELS else -1 for word in text[~failed]]
    np.testing.assert_array_equal(label[~failed], labels)
    assert np.isnan(value[failed]).all()
    np.testing.assert_array_equal(value[~failed, 0], np.flatnonzero(~failed))
    listed = json.loads((tmp_path / "out.npz.failed.json").read_text())
    assert [
        (entry["first_row"], entry["rows"], entry["server_row"], entry["reason"])
        for entry in listed["failed_items"]
    ] == [(10, 5, 13, "ENGINE_FAILURE")]


def test_a_bulk_rows_text_that_is_not_utf8_fails_its_item_naming_the_input_row(
    text_model: Path, tmp_path: Path
) -> None:
    """A bytes_ input whose row 7 (of item 1, rows 5-9) holds bytes that are not UTF-8: the
    item fails alone, INVALID_INPUT, and OUTPUT.failed.json names input row 7
    (`server_row`), as for a row the model failed on. It named none, and its message
    "element 5" of the item was no row of the input (a user's evaluation)."""
    text = np.array(["cat", "dog"] * 10)
    numbers = np.char.encode(np.array([[str(row), "0.5"] for row in range(20)]), "utf-8")
    numbers[7, 1] = b"\xff\xfe"  # element 5 of item 1: its row 2
    np.savez(tmp_path / "in.npz", text=text, numbers=numbers)
    out = tmp_path / "out.npz"
    args = ["--input", str(tmp_path / "in.npz"), "--output", str(out), "--rows-per-item", "5"]

    async def scenario() -> tuple[int, str]:
        engine = Engine(str(text_model), estimate=estimate_once)
        async with serving(engine, config(text_model)) as s:
            code, _, err = await cli("bulk", "--target", s.target, *args, "--no-progress")
        return code, err

    code, err = asyncio.run(scenario())
    assert code == 1, err
    assert "input rows 5-9 (item 1; its error names input row 7)" in err, err
    listed = json.loads((tmp_path / "out.npz.failed.json").read_text())
    ((first_row, rows, server_row, reason, message),) = [
        (entry["first_row"], entry["rows"], entry["server_row"], entry["reason"], entry["message"])
        for entry in listed["failed_items"]
    ]
    assert (first_row, rows, server_row, reason) == (5, 5, 7, "INVALID_INPUT")
    assert "element 5 is not UTF-8" in message
    assert message.endswith("element 5 is in row 2 of the request")


def test_a_stopped_bulk_job_of_text_resumes_with_every_row_in_place(tmp_path: Path) -> None:
    """.npy of str_ text in, .npy out. Each item's text is longer than the last, so the
    checkpoint's array of the string output is widened (moved to a wider file) again and
    again, across a SIGINT and the resume: the output equals the input (the model echoes
    it), as wide as its widest text, and no row ran twice."""
    model = echo_text_model(tmp_path / "echo.onnx")
    text = np.array([[str(row), "é" * row] for row in range(100)])
    np.save(tmp_path / "in.npy", text)
    out = tmp_path / "out.npy"
    state = tmp_path / "out.npy.partial" / "state.json"
    args = ["--input", str(tmp_path / "in.npy"), "--output", str(out), "--rows-per-item", "10"]

    async def scenario() -> MeteredEngine:
        engine = MeteredEngine(str(model))
        try:
            async with serving(engine, config(model, max_batch_size=10)) as s:
                # 4 batches of one item each, then it stalls
                returncode, err = await stopped_bulk_job(
                    s.target, engine, args, state, items=4, signals=[signal.SIGINT]
                )
                assert returncode == 130, err
                engine.unlimited()
                code, _, err = await cli("bulk", "--target", s.target, *args, "--resume")
                assert code == 0, err
                assert "40 of 100 rows already done" in err, err
        finally:
            engine.unlimited()
        return engine

    engine = asyncio.run(scenario())
    written = np.load(out)
    assert written.dtype == text.dtype == np.dtype("<U99")
    np.testing.assert_array_equal(written, text)
    assert sorted(engine.ran_tags) == list(range(100)), "no row ran twice"
    assert not state.parent.exists(), "the checkpoint is removed when the job is done"


def test_a_string_output_ending_in_nul_is_printed_whole_and_not_written_cut(
    tmp_path: Path,
) -> None:
    """A str_ array pads its elements with NULs, so it drops a string's own trailing ones:
    `infer --output` refuses such an answer (exit 2, naming the element) rather than
    write it cut; printed as JSON, it is whole."""
    model = echo_text_model(tmp_path / "echo.onnx")
    request = ["--json", json.dumps({"input": [["0", "a\0"]]})]

    async def scenario() -> list[tuple[int, str, str]]:
        async with serving(RecordingEngine(str(model)), config(model)) as s:
            return [
                await cli("infer", "--target", s.target, *request, *output)
                for output in ([], ["--output", str(tmp_path / "out.npy")])
            ]

    (printed, out, err), (refused, _, why) = asyncio.run(scenario())
    assert printed == 0, err
    assert json.loads(out) == {"output": [["0", "a\0"]]}
    assert refused == 2, why
    assert "output 'output': element 1 ends in a NUL character" in why, why
    assert not (tmp_path / "out.npy").exists()


def test_a_checkpoint_stopped_between_widening_a_string_output_and_its_save_resumes(
    tmp_path: Path,
) -> None:
    """A wider answer moves a string output to a new file, which state.json names only
    from the next save (that save removes the old file). Stopped before it, the
    checkpoint resumes from the old file, which holds every row its state marks done; a
    state naming another width than its file's (stopped as the files switched) is read
    as the file's."""
    source = tmp_path / "in.npy"
    np.save(source, rows(40))
    directory = tmp_path / "out.npy.partial"
    checkpoint = Checkpoint.create(
        directory, job_id="j", input_path=source, rows=40, rows_per_item=10
    )
    checkpoint.store(0, {"output": np.array(["a"] * 10, object)})
    checkpoint.save()
    checkpoint.store(1, {"output": np.array(["wider"] * 10, object)})  # no save: killed
    resumed = load_checkpoint(source, directory)
    assert resumed.done.tolist() == [True, False, False, False]
    assert resumed.output_specs["output"] == ("<U1", (40,))
    assert resumed.arrays["output"][:10].tolist() == ["a"] * 10
    for item, word in enumerate(["b", "wider", "widest of all"], start=1):
        resumed.store(item, {"output": np.array([word] * 10, object)})
    resumed.save()
    edit_state(directory, lambda state: state["outputs"]["output"].update(dtype="<U2"))
    again = load_checkpoint(source, directory)
    assert again.done.all()
    assert again.output_specs["output"] == (str(again.arrays["output"].dtype), (40,))
    assert again.arrays["output"].tolist() == [
        word for word in ["a", "b", "wider", "widest of all"] for _ in range(10)
    ]
    # One file per output: the ones widening replaced are gone once a save named the new.
    assert len(list(directory.glob("*.npy"))) == 1
    with pytest.raises(CheckpointError, match="element 3 ends in a NUL character"):
        again.store(0, {"output": np.array(["a"] * 3 + ["b\0"] + ["a"] * 6, object)})


def test_input_of_the_wrong_dtype_is_a_usage_error(small_model: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "in.npy", rows(10).astype(np.float64))

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            code, _, err = await cli(
                "bulk",
                "--target",
                s.target,
                "--input",
                str(tmp_path / "in.npy"),
                "--output",
                str(tmp_path / "out.npy"),
            )
        assert code == 2
        assert "is float64 with shape [10, 512]; the model expects float32" in err

    asyncio.run(scenario())


def test_a_timeout_out_of_range_is_a_usage_error_before_anything_starts(tmp_path: Path) -> None:
    np.save(tmp_path / "in.npy", rows(10))
    arguments = ["--input", str(tmp_path / "in.npy"), "--output", str(tmp_path / "out.npy")]
    message = "--timeout-ms: expected milliseconds from 0 (the lane's timeout) to 2**32 - 1"
    asyncio.run(refused(message, "bulk", *arguments, "--timeout-ms", "-1"))
    assert not (tmp_path / "out.npy.partial").exists(), "a corrected rerun needs no --resume"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["model", "--attempts", "x"], "argument --attempts: expected an integer >= 1, got 'x'"),
        (["bulk", "--window", "abc"], "argument --window: expected an integer >= 1, got 'abc'"),
        (
            ["bulk", "--rows-per-item", "1.5"],
            "argument --rows-per-item: expected an integer >= 1, got '1.5'",
        ),
        (
            ["bulk", "--timeout-ms", "abc"],
            (
                "argument --timeout-ms: expected milliseconds from 0 (the lane's timeout) to "
                "2**32 - 1, a whole number, got 'abc'"
            ),
        ),
    ],
)
def test_a_non_integer_for_an_integer_flag_says_an_integer_was_expected(
    arguments: list[str], message: str
) -> None:
    """Not argparse's "invalid _positive_int value", which names a private function."""
    files = ["--input", "in.npy", "--output", "out.npy"] if arguments[0] == "bulk" else []
    code, _, err = asyncio.run(cli(*arguments, *files))
    assert code == 2
    assert message in err
    assert "invalid" not in err, "argparse's message, which names the type function"


def test_a_target_port_grpc_would_wrap_or_an_empty_target_exits_2_naming_it(
    small_model: Path,
) -> None:
    """gRPC takes a port over 65535 modulo 65536: `--target 127.0.0.1:P+65536` talked to
    the server on P, exit 0; an empty --target failed UNKNOWN, exit 3, with gRPC's C-core
    lines on stderr."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            wrapped = s.server.port + 65536
            await refused(
                f"laneserve-client: --target '127.0.0.1:{wrapped}': port '{wrapped}' is out "
                "of range; expected HOST:PORT with a port from 1 to 65535 (gRPC would "
                f"connect to port {s.server.port} instead)",
                "model",
                "--target",
                f"127.0.0.1:{wrapped}",
            )
            err = await refused(
                "laneserve-client: --target '': expected HOST:PORT", "model", "--target", ""
            )
            assert err.count("\n") == 1, "one line: nothing from gRPC's core"

    asyncio.run(scenario())


def test_input_the_client_refuses_exits_2_before_sending(small_model: Path) -> None:
    """A --request-id the server would refuse (over its 256 bytes; `bulk` refuses its
    items' ids before sending too) or protobuf cannot send (bytes that are not UTF-8):
    refused before sending, the input's fault. They exited 3, "the server could not be
    reached or refused the call" (the second was never sent)."""
    one_row = ["infer", "--json", json.dumps({"input": rows(1).tolist()})]
    refused_before_sending(
        small_model,
        [
            (
                [*one_row, "--request-id", "z" * 300],
                (
                    "laneserve-client: INVALID_INPUT: request_id is 300 bytes, over the server's "
                    "limit of 256 bytes"
                ),
            ),
            (
                # os.fsdecode(b"ab\xff"): how Python passes bytes that are not UTF-8.
                [*one_row, "--request-id", "ab\udcff"],
                "laneserve-client: INVALID_INPUT: request_id 'ab\\udcff': expected UTF-8 text",
            ),
        ],
    )


def test_input_the_server_refuses_exits_2_as_the_clients_own_refusals_do(
    small_model: Path,
) -> None:
    """Exit 2 is the input's fault, whoever refused it: a request_id reused for other
    inputs is refused by the server alone (REQUEST_ID_REUSED, an INVALID_INPUT), and the
    same input fails again. It exited 3, as an unreachable server does."""
    first, second = (
        ["--json", json.dumps({"input": rows(1, seed=seed).tolist()})] for seed in (1, 2)
    )

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            target = ["--target", s.target]
            code, _, err = await cli("infer", *target, *first, "--request-id", "r1")
            assert code == 0, err
            code, _, err = await cli("infer", *target, *second, "--request-id", "r1")
            assert (code, "Traceback" in err) == (2, False), err
            assert "laneserve-client: REQUEST_ID_REUSED: " in err

    asyncio.run(scenario())


def test_a_row_the_model_fails_on_exits_2_as_the_inputs_fault(tmp_path: Path) -> None:
    """`infer` with a row ONNX Runtime's Gather fails on (an index out of range): the
    server answers ENGINE_FAILURE naming that row, run alone, and the same input fails
    again. It exited 3, which README gives the server's own refusals: a wrapper that
    retries on 3 retried it for good."""
    model = lookup_model(tmp_path / "lookup.onnx")
    x = np.zeros((2, 4), np.float32)
    x[1, 0] = 12  # past the 10-row table

    async def scenario() -> None:
        async with serving(RecordingEngine(str(model)), config(model)) as s:
            args = ["--target", s.target, "--json", json.dumps({"input": x.tolist()})]
            code, _, err = await cli("infer", *args)
            assert (code, "Traceback" in err) == (2, False), err
            assert "laneserve-client: ENGINE_FAILURE: " in err
            assert "row 1" in err

    asyncio.run(scenario())


def test_unreachable_server_exits_3_naming_the_error() -> None:
    # Held, never listening: a port picked free and closed again could be taken by a
    # server meanwhile (another test's, at once), and the client's call answered.
    port = refusing_port()

    async def scenario() -> None:
        code, _, err = await cli("stats", "--target", f"127.0.0.1:{port}", "--attempts", "1")
        assert code == 3
        assert "UNAVAILABLE" in err

    asyncio.run(scenario())


@pytest.fixture
def colliding_model(tmp_path: Path) -> Path:
    """input [batch, 3] float32 -> 'logits:0' (the input) and 'logits_0' (it as int64):
    names that differ only in a character a file name replaces."""
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["input"], ["logits:0"]),
            helper.make_node("Cast", ["input"], ["logits_0"], to=TensorProto.INT64),
        ],
        "colliding",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3])],
        [
            helper.make_tensor_value_info("logits:0", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("logits_0", TensorProto.INT64, ["batch", 3]),
        ],
    )
    return save_model(tmp_path / "colliding.onnx", graph)


def checkpoint_of(tmp_path: Path, items_done: int = 2) -> tuple[Path, Path]:
    """A genuine checkpoint of a job over 40 rows, 10 per item, `items_done` items done:
    (input file, checkpoint directory, beside the output tmp_path/out.npy)."""
    source = tmp_path / "in.npy"
    np.save(source, rows(40))
    directory = tmp_path / "out.npy.partial"
    checkpoint = Checkpoint.create(
        directory, job_id="j", input_path=source, rows=40, rows_per_item=10
    )
    for item in range(items_done):
        checkpoint.store(item, {"output": np.ones((10, 10), np.float32)})
    checkpoint.save()
    return source, directory


def edit_state(directory: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    """Changes state.json in place with `edit`."""
    path = directory / "state.json"
    state = json.loads(path.read_text(encoding="utf-8"))
    edit(state)
    path.write_text(json.dumps(state), encoding="utf-8")


def truncate(path: Path, size: int) -> None:
    with path.open("r+b") as file:
        file.truncate(size)


CORRUPTIONS: dict[str, tuple[Callable[[Path], object], str]] = {
    "a JSON list": (
        lambda d: (d / "state.json").write_text("[1, 2]", encoding="utf-8"),
        "expected a JSON object, found list",
    ),
    "no input_identity": (
        lambda d: edit_state(d, lambda state: state.pop("input_identity")),
        "input_identity is missing; expected an object",
    ),
    "done not base64": (
        lambda d: edit_state(d, lambda state: state.update(done="!!notbase64")),
        "done is not base64",
    ),
    "done too short": (
        lambda d: edit_state(d, lambda state: state.update(done="")),
        "done holds 0 bytes; expected 1 for 4 items",
    ),
    "rows a string": (
        lambda d: edit_state(d, lambda state: state.update(rows="40")),
        "rows is '40'; expected a whole number >= 1",
    ),
    "array deleted": (
        lambda d: (d / "output.npy").unlink(),
        r"output\.npy is unreadable \(\[Errno 2\]",
    ),
    "array truncated": (
        lambda d: truncate(d / "output.npy", 100),
        r"output\.npy is unreadable",
    ),
    "array cut short": (  # past its header: opened to write, numpy would pad it with 0s
        lambda d: truncate(d / "output.npy", 1_000),
        r"output\.npy is unreadable",
    ),
    "an unknown output": (
        lambda d: edit_state(
            d,
            lambda state: state.update(
                outputs={"../x": {"dtype": "float32", "shape": [40, 10], "file": "output.npy"}}
            ),
        ),
        r"it holds output '\.\./x'; expected only \['output'\]",
    ),
    "a file outside the checkpoint": (
        lambda d: edit_state(d, lambda state: state["outputs"]["output"].update(file="../x.npy")),
        r"outputs\['output'\]\.file is '\.\./x\.npy'; expected a file name ending in \.npy",
    ),
    "done without its array": (
        lambda d: edit_state(d, lambda state: state.update(outputs={})),
        r"items are marked done with outputs \[\]; expected \['output'\]",
    ),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path, corruption: str) -> None:
    damage, message = CORRUPTIONS[corruption]
    source, directory = checkpoint_of(tmp_path)
    damage(directory)
    with pytest.raises(CheckpointError, match=message) as raised:
        load_checkpoint(source, directory, model_outputs=("output",))
    assert str(directory) in str(raised.value)
    assert "to start over" in str(raised.value) or "start the job over" in str(raised.value)


def test_bulk_resume_from_a_damaged_checkpoint_exits_2_without_a_traceback(
    small_model: Path, tmp_path: Path
) -> None:
    source, directory = checkpoint_of(tmp_path)
    args = ["--input", str(source), "--output", str(tmp_path / "out.npy"), "--rows-per-item", "10"]

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            for corruption in ("a JSON list", "array deleted", "an unknown output"):
                shutil.rmtree(directory)
                checkpoint_of(tmp_path)
                CORRUPTIONS[corruption][0](directory)
                err = await refused(
                    "laneserve-client: checkpoint ", "bulk", "--target", s.target, *args, "--resume"
                )
                assert err.startswith("laneserve-client: checkpoint "), err
                assert f"Delete {directory}" in err or f"delete {directory}" in err

    asyncio.run(scenario())


def interrupt_at_call(step: int, files: Collection[str]) -> Callable[[FrameType, str, Any], Any]:
    """A trace function that raises KeyboardInterrupt as the `step`th call of a function
    defined in `files` begins, as a Ctrl-C that arrives there does (the trace then
    stops, as after any error in it). With pathlib's and shutil's among them, that is
    before and after each step on the file system."""
    calls = 0

    def trace(frame: FrameType, event: str, _arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename in files:
            calls += 1
            if calls == step:
                raise KeyboardInterrupt

    return trace


@pytest.mark.parametrize("output_name", ["out.npy", "out.npz"])
def test_a_finish_interrupted_at_any_step_leaves_a_job_done_or_one_resume_completes(
    tmp_path: Path, output_name: str
) -> None:
    """state.json was removed before the output moved: a Ctrl-C between the two left the
    arrays without their state, and --resume refused the checkpoint as unreadable,
    throwing every row away. Interrupted before and after each step of finish in turn
    (those of its `save` and of the removal of its directory included), either the
    output is whole and no checkpoint is left, or the checkpoint resumes with every item
    done and finishes; no staged file is left either way."""
    output = tmp_path / output_name
    directory = tmp_path / "out.npy.partial"
    expected = np.ones((40, 10), np.float32)

    def finished() -> list[Path]:
        return sorted(tmp_path.glob("out.npy.partial.finished-*"))

    def written() -> object:
        if output_name.endswith(".npy"):
            return np.load(output)
        with np.load(output) as saved:
            assert saved.files == ["output"]
            return saved["output"]

    # The files Path's methods are defined in: pathlib.py up to Python 3.12; from 3.13
    # pathlib is a package whose __init__.py defines none of them (they are in _local.py
    # and _abc.py): tracing pathlib.__file__ there interrupted almost none of finish.
    path_files = {inspect.getfile(cls) for cls in pathlib.Path.__mro__ if cls is not object}
    traced = {checkpoint_module.__file__, shutil.__file__, *path_files}
    outcomes = set()
    for step in itertools.count(1):
        for path in (output, directory, *finished()):
            if path.is_dir():
                shutil.rmtree(path)
            path.unlink(missing_ok=True)
        source, _ = checkpoint_of(tmp_path, items_done=4)
        checkpoint = load_checkpoint(source, directory)
        sys.settrace(interrupt_at_call(step, traced))
        try:
            checkpoint.finish(output)
        except KeyboardInterrupt:
            pass
        else:
            break
        finally:
            sys.settrace(None)
        if directory.exists():
            assert not list(directory.glob("output.*.tmp")), step
            resumed = load_checkpoint(source, directory)
            assert resumed.done.all(), step
            resumed.finish(output)
            assert finished() == [], step
            outcomes.add("resumed")
        else:
            outcomes.add("done")
            if finished():  # interrupted removing it: the next finish beside it does
                outcomes.add("left over")
                np.testing.assert_array_equal(written(), expected, err_msg=f"step {step}")
                source, _ = checkpoint_of(tmp_path, items_done=4)
                load_checkpoint(source, directory).finish(output)
                assert finished() == [], step
        assert not directory.exists(), step
        np.testing.assert_array_equal(written(), expected, err_msg=f"step {step}")
    assert step > 20, "finish made too few calls for the test to mean anything"
    assert outcomes == {"resumed", "done", "left over"}
    np.testing.assert_array_equal(written(), expected)
    assert not directory.exists()
    assert finished() == []


def test_a_finish_leaves_a_users_files_beside_it_alone(tmp_path: Path) -> None:
    """The checkpoint was renamed to OUT.partial.finished, whatever was there: a user's
    directory of that name was removed with its contents, and a file of that name failed
    every finish (NotADirectoryError after OUT was written; --resume failed the same
    way). Only directories of the finish's own fresh names, holding nothing but a
    checkpoint's files, are removed."""
    mine = tmp_path / "out.npy.partial.finished"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine", encoding="utf-8")
    lookalike = tmp_path / "out.npy.partial.finished-mine"
    lookalike.mkdir()
    (lookalike / "notes.txt").write_text("mine", encoding="utf-8")
    # Holding only a checkpoint's files, but not marked by a finish: a kept copy, and
    # another job's live checkpoint whose output is named after this one's.
    kept = tmp_path / "out.npy.partial.finished-kept1234"
    other_job = tmp_path / "out.npy.partial.finished-2.npz.partial"
    for directory in (kept, other_job):
        directory.mkdir()
        (directory / "state.json").write_text("{}", encoding="utf-8")
        np.save(directory / "output.npy", np.zeros(3))
    source, directory = checkpoint_of(tmp_path, items_done=4)
    load_checkpoint(source, directory).finish(tmp_path / "out.npy")
    assert not directory.exists()
    assert (mine / "notes.txt").read_text(encoding="utf-8") == "mine"
    assert (lookalike / "notes.txt").read_text(encoding="utf-8") == "mine"
    assert (kept / "state.json").exists()
    assert (other_job / "state.json").exists()
    (tmp_path / "out.npy").unlink()
    mine.rename(tmp_path / "moved")
    mine.write_text("a file of the old name", encoding="utf-8")
    source, directory = checkpoint_of(tmp_path, items_done=4)
    load_checkpoint(source, directory).finish(tmp_path / "out.npy")
    assert not directory.exists()
    assert mine.read_text(encoding="utf-8") == "a file of the old name"
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), np.ones((40, 10), np.float32))


def test_a_failed_npz_write_leaves_no_partial_file_and_the_checkpoint_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, directory = checkpoint_of(tmp_path, items_done=4)
    checkpoint = load_checkpoint(source, directory)

    def full(file: IO[bytes], _arrays: object) -> None:
        file.write(b"PK\x03\x04 half an archive")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "write_npz", full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.finish(tmp_path / "out.npz")
    assert sorted(path.name for path in directory.iterdir()) == ["output.npy", "state.json"]
    assert not (tmp_path / "out.npz").exists()
    monkeypatch.undo()
    resumed = load_checkpoint(source, directory)
    resumed.finish(tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as saved:
        np.testing.assert_array_equal(saved["output"], np.ones((40, 10), np.float32))


def test_a_finish_that_cannot_move_the_output_keeps_the_checkpoint(tmp_path: Path) -> None:
    source, directory = checkpoint_of(tmp_path, items_done=4)
    checkpoint = load_checkpoint(source, directory)
    (tmp_path / "taken.npy").mkdir()  # a directory where the output should go
    with pytest.raises(OSError, match=r"taken\.npy"):
        checkpoint.finish(tmp_path / "taken.npy")
    resumed = load_checkpoint(source, directory)
    assert resumed.done.all()


def test_an_answer_of_another_shape_than_the_checkpoint_holds_is_refused(
    tmp_path: Path,
) -> None:
    """Written as it came, it broadcast: a model with a narrower output since the job
    began filled each resumed row with one value copied across it, and the job exited 0."""
    source, directory = checkpoint_of(tmp_path)
    checkpoint = load_checkpoint(source, directory)
    with pytest.raises(CheckpointError, match=r"output 'output' of item 2 is float32 \[10, 1\]"):
        checkpoint.store(2, {"output": np.full((10, 1), 7.0, np.float32)})
    assert not checkpoint.done[2]
    assert not (np.asarray(checkpoint.arrays["output"][20:30]) == 7.0).any()


def test_a_resume_on_a_model_whose_outputs_changed_is_refused_before_sending(
    tmp_path: Path,
) -> None:
    source, directory = checkpoint_of(tmp_path)  # made on outputs of 10 values a row
    narrower = tmp_path / "narrower.onnx"
    make_demo_model(narrower, hidden_dim=32, hidden_layers=1, output_dim=1)
    engine = RecordingEngine(str(narrower))

    async def scenario() -> None:
        async with serving(engine, config(narrower)) as s:
            code, _, err = await cli(
                "bulk",
                "--target",
                s.target,
                *("--input", str(source), "--output", str(tmp_path / "out.npy")),
                *("--rows-per-item", "10", "--resume"),
            )
            assert code == 2, err
            assert (
                f"checkpoint {directory} holds output 'output' as float32 with shape [40, 10]; "
                "the model now gives float32 with shape [?, 1]"
            ) in err

    asyncio.run(scenario())
    assert engine.batches == [], "nothing was sent"
    assert load_checkpoint(source, directory).done[:2].all()


def test_a_checkpoint_that_could_not_be_created_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk failed the first state.json and left the directory: every later run
    was told to --resume, and --resume that state.json was unreadable."""
    source = tmp_path / "in.npy"
    np.save(source, rows(40))

    def full(_checkpoint: Checkpoint) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Checkpoint, "save", full)
    directory = tmp_path / "out.npy.partial"
    with pytest.raises(OSError, match="No space left"):
        Checkpoint.create(directory, job_id="j", input_path=source, rows=40, rows_per_item=10)
    assert not directory.exists()


# laneserve-client on a disk that is full: posix_fallocate says so (ENOSPC).
_FULL_DISK_CLIENT = """
import errno, os, sys

def full(_fd, _offset, _length):
    raise OSError(errno.ENOSPC, "No space left on device")

os.posix_fallocate = full
from laneserve.client.cli import main
sys.exit(main())
"""


def test_a_full_disk_is_an_error_that_names_the_checkpoint_not_a_crash(
    small_model: Path, tmp_path: Path
) -> None:
    """The arrays were sparse files written through a memory map: on a full disk the
    client died of SIGBUS, no message. Their space is taken up front now, and a failure
    is an error naming the checkpoint, whose saved rows are kept."""
    source = tmp_path / "in.npy"
    np.save(source, rows(40))
    output = tmp_path / "out.npy"

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            process = await asyncio.create_subprocess_exec(
                *(sys.executable, "-c", _FULL_DISK_CLIENT, "bulk", "--target", s.target),
                *("--input", str(source), "--output", str(output), "--rows-per-item", "10"),
                stderr=asyncio.subprocess.PIPE,
            )
            _, err_bytes = await asyncio.wait_for(
                process.communicate(), timeout=CLIENT_CLI_TIMEOUT_S
            )
            err = err_bytes.decode()
            assert process.returncode == 2, err
            assert f"cannot write the checkpoint {output}.partial: [Errno 28] No space" in err
            assert "--resume once it can be written" in err
            assert "Traceback" not in err

    asyncio.run(scenario())
    directory = Path(f"{output}.partial")
    resumed = load_checkpoint(source, directory)
    assert not resumed.done.any()


def test_a_checkpoint_removed_while_its_job_ran_is_not_said_to_keep_its_rows(
    tmp_path: Path,
) -> None:
    """A checkpoint whose directory was removed mid-job failed its next save, and the
    error said the rows it saved were kept, to --resume: they were gone with it."""
    _source, directory = checkpoint_of(tmp_path)
    checkpoint = load_checkpoint(tmp_path / "in.npy", directory)
    shutil.rmtree(directory)
    with pytest.raises(FileNotFoundError) as failed:
        checkpoint.save()
    message = str(client_cli_module._unwritable(checkpoint, failed.value))
    assert f"cannot write the checkpoint {directory}: " in message
    assert "it is gone (removed while the job ran?), and the rows it saved with it" in message
    assert "run the job again, without --resume" in message
    assert "are kept" not in message


def test_a_checkpoint_that_can_be_read_but_not_written_is_not_called_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume by a user who may read the checkpoint but not write it was told the array
    was unreadable and to delete the checkpoint: the work done, thrown away."""
    source, directory = checkpoint_of(tmp_path)
    open_memmap = np.lib.format.open_memmap

    def read_only(path: Any, mode: str = "r+", **kwargs: Any) -> Any:
        if mode == "r+":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return open_memmap(path, mode=mode, **kwargs)

    monkeypatch.setattr(np.lib.format, "open_memmap", read_only)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(source, directory)
    message = str(caught.value)
    assert "cannot be written ([Errno 13] Permission denied" in message
    assert f"its rows are kept, so make {directory} writable and --resume again" in message
    assert "Delete" not in message


def test_paths_and_seconds_a_run_cannot_use_are_usage_errors(
    small_model: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.npy"
    np.save(source, rows(10))
    infer = ["infer", "--json", json.dumps(rows(1).tolist())]
    bulk = ["bulk", "--input", str(source)]
    timeout = "--timeout: expected seconds > 0 and <= 4294967.295 (2**32 - 1 ms), got"
    cases = [
        (
            [*infer, "--output", str(tmp_path / "no" / "dir" / "x.npy")],
            f"{tmp_path / 'no' / 'dir'} does not exist; expected an existing directory",
        ),
        (
            [*bulk, "--output", str(source / "out.npy")],
            f"{source} is not a directory; expected an existing directory",
        ),
        (["model", "--timeout", "nan"], f"{timeout} 'nan'"),
        (["model", "--timeout", "-1"], f"{timeout} '-1'"),
        (["model", "--timeout", "inf"], f"{timeout} 'inf'"),
        # gRPC's deadline would overflow and fail the call at once.
        (["model", "--timeout", "1e10"], f"{timeout} '1e10'"),
        (
            [*bulk, "--output", str(tmp_path / "out.npy"), "--checkpoint-interval-s", "nan"],
            "--checkpoint-interval-s: expected a finite number of seconds >= 0, got 'nan'",
        ),
    ]

    refused_before_sending(small_model, cases)
    assert not list(tmp_path.glob("*.partial")), "a corrected rerun needs no --resume"


# laneserve-client as a user who may not write the paths its first argument lists
# (os.pathsep between them): as root, os.access would allow them whatever their mode.
_NO_WRITE_CLIENT = """
import os, sys

denied = set(sys.argv.pop(1).split(os.pathsep))
access = os.access

def no_write(path, mode, **kwargs):
    if os.fspath(path) in denied and mode & os.W_OK:
        return False
    return access(path, mode, **kwargs)

os.access = no_write
from laneserve.client.cli import main
sys.exit(main())
"""


def test_infer_refuses_an_output_it_could_not_write_before_sending(
    tmp_path: Path, colliding_model: Path
) -> None:
    """infer sent the request and only then found that .npy holds one array of its
    answer's two, or that the output's directory or file could not be written; bulk
    refused the first before sending, and README says infer's checks send nothing."""
    np.save(tmp_path / "in.npy", np.ones((2, 3), np.float32))
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    kept = tmp_path / "kept.npz"
    kept.write_bytes(b"")
    kept.chmod(0o444)
    denied = os.pathsep.join([str(read_only), str(kept)])
    cases = [
        (
            tmp_path / "out.npy",
            (
                f"--output {tmp_path / 'out.npy'}: .npy holds one array and the model has "
                "outputs ['logits:0', 'logits_0']; choose one with --output-name, or write .npz"
            ),
        ),
        (
            read_only / "out.npz",
            (
                f"--output {read_only / 'out.npz'}: cannot write in {read_only} (permission "
                "denied); expected a directory this user can write"
            ),
        ),
        (
            kept,
            (
                f"--output {kept}: cannot write it (permission denied); expected a file this "
                "user can write"
            ),
        ),
    ]
    engine = RecordingEngine(str(colliding_model))

    async def scenario() -> None:
        async with serving(engine, config(colliding_model)) as s:
            for output, message in cases:
                process = await asyncio.create_subprocess_exec(
                    *(sys.executable, "-c", _NO_WRITE_CLIENT, denied, "infer"),
                    *("--target", s.target, "--input", str(tmp_path / "in.npy")),
                    *("--output", str(output)),
                    stderr=asyncio.subprocess.PIPE,
                )
                _, err_bytes = await asyncio.wait_for(
                    process.communicate(), timeout=CLIENT_CLI_TIMEOUT_S
                )
                err = err_bytes.decode()
                assert process.returncode == 2, (output, err)
                assert message in err, err
            # bulk says the same of .npy, and one output asked for fits it.
            await refused(
                cases[0][1],
                *("bulk", "--target", s.target, "--input", str(tmp_path / "in.npy")),
                *("--output", str(tmp_path / "out.npy")),
            )
            code, _, err = await cli(
                "infer",
                "--target",
                s.target,
                "--input",
                str(tmp_path / "in.npy"),
                "--output",
                str(tmp_path / "out.npy"),
                "--output-name",
                "logits_0",
            )
            assert code == 0, err

    asyncio.run(scenario())
    assert engine.batches == [2], "only the last call ran"
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), np.ones((2, 3), np.int64))


def test_an_output_that_is_the_input_file_is_refused_before_sending(
    small_model: Path, tmp_path: Path
) -> None:
    """Bulk would replace the input rows by the scores; infer too, once answered."""
    x = rows(100)
    source = tmp_path / "in.npy"
    np.save(source, x)
    (tmp_path / "link.npy").symlink_to(source)
    os.link(source, tmp_path / "hard.npy")
    commands = [
        ["bulk", "--input", str(source), "--output", str(source)],
        ["bulk", "--input", str(source), "--output", str(tmp_path / "link.npy")],
        ["bulk", "--input", str(source), "--output", str(tmp_path / "hard.npy")],
        ["bulk", "--input", str(source), "--output", str(tmp_path / "sub" / ".." / "in.npy")],
        ["infer", "--input", str(source), "--output", str(source)],
    ]
    (tmp_path / "sub").mkdir()
    message = f"is the input file {source}: writing it would destroy the input"
    refused_before_sending(small_model, [(command, message) for command in commands])
    np.testing.assert_array_equal(np.load(source), x)
    assert not list(tmp_path.glob("*.partial")), "a corrected rerun needs no --resume"


def test_a_bulk_job_no_item_of_which_could_succeed_exits_2_before_sending(
    small_model: Path, tmp_path: Path
) -> None:
    np.save(tmp_path / "in.npy", rows(100))
    np.save(tmp_path / "narrow.npy", rows(100)[:, :511])
    lanes = (
        LaneConfig("standard", capacity_rows=2_048, timeout_ms=10_000, max_wait_ms=1, min_share=0),
        LaneConfig("small", capacity_rows=32, timeout_ms=10_000, max_wait_ms=1, min_share=0),
    )
    engine = RecordingEngine(str(small_model))
    served = config(small_model, lanes=lanes, default_lane="small", max_message_bytes=98_330)

    cases = [
        (
            ["--input", str(tmp_path / "narrow.npy")],
            "is float32 with shape [100, 511]; the model expects float32 with shape [?, 512]",
        ),
        (
            ["--lane", "nosuchlane"],
            "--lane 'nosuchlane': the server has no such lane; its lanes are ['standard', 'small']",
        ),
        (
            ["--output-name", "nosuch"],
            "--output-name nosuch: the model has no such output; its outputs are ['output']",
        ),
        # No bulk lane: the server queues a stream's items in its default lane.
        (["--rows-per-item", "33"], "--rows-per-item 33: lane 'small' holds at most 32 rows"),
        (
            ["--rows-per-item", "64", "--lane", "standard"],
            (
                "an item is 131148 bytes encoded, over the 98330-byte message limit; "
                "expected at most 47 rows per item"
            ),
        ),
        (
            # 98 304 bytes of data fit; with each item's framing they do not (every item
            # failed, and the job left its checkpoint).
            ["--rows-per-item", "48", "--lane", "standard"],
            (
                "an item is 98380 bytes encoded, over the 98330-byte message limit; "
                "expected at most 47 rows per item"
            ),
        ),
    ]
    job = ["--input", str(tmp_path / "in.npy"), "--output", str(tmp_path / "out.npy")]

    async def scenario() -> None:
        async with serving(engine, served) as s:
            for arguments, message in cases:
                err = await refused(message, "bulk", "--target", s.target, *job, *arguments)
                assert "--resume" not in err
                assert not (tmp_path / "out.npy.partial").exists(), arguments
            code, _, err = await cli("bulk", "--target", s.target, *job, "--rows-per-item", "32")
            assert code == 0, err

    asyncio.run(scenario())
    assert sum(engine.batches) == 100, "only the last, valid job ran"


def test_output_piped_into_a_reader_that_stops_exits_141_quietly(small_model: Path) -> None:
    """Run as the console script runs it (main() called directly), its output into a pipe
    whose reader has gone, as in `laneserve-client model | head -1`."""
    entry_point = "import sys; from laneserve.client.cli import main; sys.exit(main())"

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            reader, writer = os.pipe()
            os.close(reader)
            try:
                process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-c",
                    entry_point,
                    "model",
                    "--target",
                    s.target,
                    stdout=writer,
                    stderr=asyncio.subprocess.PIPE,
                )
            finally:
                os.close(writer)
            _, err_bytes = await asyncio.wait_for(
                process.communicate(), timeout=CLIENT_CLI_TIMEOUT_S
            )
            err = err_bytes.decode()
            assert process.returncode == 141, err
            assert err == ""

    asyncio.run(scenario())


@pytest.mark.parametrize("command", ["_model", "_stats"])
def test_model_and_stats_write_their_answer_at_once(
    small_model: Path, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Line by line, unbuffered (PYTHONUNBUFFERED=1), `model | head -1` met EPIPE on its
    second line and exited 141 about half the time: the answer goes in one write."""
    writes: list[str] = []

    class Unbuffered(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stdout", Unbuffered())
    answer = getattr(client_cli_module, command)

    def answered(target: str) -> int:
        with Client(target) as client:
            code: int = answer(client, argparse.Namespace(timeout=CLIENT_CLI_TIMEOUT_S))
            return code

    async def scenario() -> int:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(answered, s.target)

    assert asyncio.run(scenario()) == 0
    assert len(writes) == 1
    assert writes[0].count("\n") > 5


def test_metadata_grpc_would_refuse_exits_2_naming_the_pair(small_model: Path) -> None:
    cases = [
        ("x-bin=abc", "--metadata 'x-bin=abc': metadata key 'x-bin' ends in '-bin'"),
        ("a b=1", "--metadata 'a b=1': metadata key 'a b': expected one or more ASCII letters"),
        ("k=\u00e9", "--metadata 'k=\u00e9': metadata key 'k': value '\u00e9' is not printable"),
        # The client sends its own (a bulk job's call with two was refused: exit 3).
        (
            "laneserve-max-receive-bytes=4096",
            (
                "--metadata 'laneserve-max-receive-bytes=4096': metadata key "
                "'laneserve-max-receive-bytes': the client sends its own value of it"
            ),
        ),
    ]

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            for pair, message in cases:
                await refused(message, "model", "--target", s.target, "--metadata", pair)
            # Keys are sent in lower case: an upper-case one is fine.
            code, _, err = await cli("model", "--target", s.target, "--metadata", "X-Team=a b")
            assert code == 0, err

    asyncio.run(scenario())


def test_a_client_certificate_without_its_key_names_the_flags(
    small_model: Path, tmp_path: Path
) -> None:
    """Not TlsConfig's field names (private_key, certificate_chain), which are no flags."""
    for name in ("ca.pem", "client.pem", "client.key"):
        (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\n", encoding="utf-8")
    ca = ["--tls-ca", str(tmp_path / "ca.pem")]
    cases = [
        ([*ca, "--tls-cert", str(tmp_path / "client.pem")], "got only --tls-cert"),
        ([*ca, "--tls-key", str(tmp_path / "client.key")], "got only --tls-key"),
    ]

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            for arguments, given in cases:
                message = (
                    f"laneserve-client: --tls-cert and --tls-key go together (mutual TLS); "
                    f"{given}: expected both or neither"
                )
                err = await refused(message, "model", "--target", s.target, *arguments)
                assert "private_key" not in err

    asyncio.run(scenario())


def test_a_tls_file_that_cannot_be_read_is_named_by_its_flag(tmp_path: Path) -> None:
    """It said "TLS options: [Errno 2] No such file or directory: ..." naming no flag."""
    missing = str(tmp_path / "nope.pem")
    present = tmp_path / "present.pem"
    present.write_text("-----BEGIN CERTIFICATE-----\n", encoding="utf-8")
    cases = {
        "--tls-ca": ["--tls-ca", missing],
        "--tls-cert": ["--tls-cert", missing, "--tls-key", str(present)],
        "--tls-key": ["--tls-key", missing, "--tls-cert", str(present)],
    }
    for flag, arguments in cases.items():
        message = f"{flag} {missing}: cannot read it (No such file or directory)"
        err = asyncio.run(refused(message, "model", *arguments))
        assert "expected a PEM file" in err


def test_a_tls_ca_file_holding_no_certificate_is_refused_naming_it(tmp_path: Path) -> None:
    """A CA file of a CRL (with or without a key) loads as Python's TLS reads it, and
    went to gRPC unchecked: every call failed, retried as if the server were down (exit
    3). Refused before any call, as the server refuses such a tls_client_ca: exit 2 on
    the command line, ValueError in the library. A key alone was refused already."""
    key, certificate, crl = ca_and_crl(tmp_path)
    key_and_crl = tmp_path / "key_and_crl.pem"
    key_and_crl.write_bytes(key.read_bytes() + crl.read_bytes())
    nobody = "127.0.0.1:1"  # never dialled: refused before any call
    for ca in (crl, key_and_crl, key):
        message = f"laneserve-client: --tls-ca {ca}: holds no PEM CA certificate"
        err = asyncio.run(refused(message, "model", "--target", nobody, "--tls-ca", str(ca)))
        assert "expected the PEM certificate(s) of the CA that signed the server's" in err
        with pytest.raises(ValueError, match=re.escape(f"ca {ca}: holds no PEM CA certificate")):
            TlsConfig.from_files(ca=ca)
    TlsConfig.from_files(ca=certificate)


def test_infer_refuses_both_json_and_input() -> None:
    code, _, err = asyncio.run(cli("infer", "--json", "[[0.5]]", "--input", "/no/such/file.npy"))
    assert code == 2
    assert "argument --input: not allowed with argument --json" in err


def batch_tags(batch: Batch) -> list[int]:
    return [int(tag) for part in batch.parts["input"] for tag in part[:, 0]]


def test_model_prints_each_inputs_shape_as_the_probe_ran_it(tmp_path: Path) -> None:
    """The server's memory figures per row hold for rows of the probe's shapes, and a
    model with a dynamic sequence length was probed at S = 1 unless --probe-shape said
    otherwise: `model` shows each input's shape as the probe ran it beside its own."""
    path = identity_model(
        tmp_path,
        "sequence",
        {"ids": (TensorProto.INT64, ["N", "S"]), "features": (TensorProto.FLOAT, ["N", 4])},
    )

    async def printed(probe_shapes: dict[str, tuple[int, ...]]) -> str:
        engine = Engine(
            str(path), device="cpu", probe_shapes=probe_shapes, estimate=no_static_estimate
        )
        async with serving(engine, config(path, probe_shapes=probe_shapes)) as s:
            code, out, err = await cli("model", "--target", s.target)
        assert code == 0, err
        return out

    table = (
        "tensor  name          dtype    shape   probe shape\n"
        "input   ids           int64    [?, ?]  [?, {}]\n"
        "input   features      float32  [?, 4]  [?, 4]\n"
        "output  ids_out       int64    [?, ?]\n"
        "output  features_out  float32  [?, 4]\n"
    )
    assert table.format(1) in asyncio.run(printed({}))
    assert table.format(512) in asyncio.run(printed({"ids": (512,)}))


def test_infer_escapes_text_only_where_standard_output_cannot_encode_it() -> None:
    """JSON text is printed as it is where the output encodes any text, \\u-escaped where
    it cannot (an ASCII terminal, PYTHONIOENCODING=ascii): never a UnicodeEncodeError."""
    from laneserve.client.cli import _writes_unicode  # noqa: PLC0415 - the one helper

    for encoding, takes in (
        ("utf-8", True),
        ("utf-16", True),
        ("ascii", False),
        ("latin-1", False),
    ):
        assert _writes_unicode(io.TextIOWrapper(io.BytesIO(), encoding=encoding)) is takes
    assert _writes_unicode(io.StringIO())
