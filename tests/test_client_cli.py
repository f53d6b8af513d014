"""`laneserve-client` as a real process against a real server on loopback."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from laneserve.client._checkpoint import Checkpoint, CheckpointError
from laneserve.server import ServerConfig
from laneserve.server.items import Batch
from tests.support import (
    CLIENT_CLI_TIMEOUT_S,
    INTERRUPTIBLE_CLIENT_CLI,
    MeteredEngine,
    RecordingEngine,
    done_items,
    rows,
    serving,
    until,
)
from tests.support import client_cli as cli

pytestmark = pytest.mark.usefixtures("no_leaked_threads")


def config(model: Path, **fields: Any) -> ServerConfig:
    return ServerConfig(model_path=str(model), **fields)


def small_reference(small_model: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(small_model), providers=["CPUExecutionProvider"])


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


@pytest.mark.parametrize(
    ("signum", "exit_code", "message"),
    [
        (signal.SIGKILL, -signal.SIGKILL, None),
        (signal.SIGINT, 130, "interrupted"),
        (signal.SIGTERM, 143, "terminated"),
    ],
    ids=["SIGKILL", "SIGINT", "SIGTERM"],
)
def test_interrupted_bulk_job_resumes_where_it_stopped(
    small_model: Path,
    small_reference: ort.InferenceSession,
    tmp_path: Path,
    signum: signal.Signals,
    exit_code: int,
    message: str | None,
) -> None:
    """The job is stopped after some progress: killed (SIGKILL) while a batch runs, or
    interrupted (SIGINT / SIGTERM: exit 130 / 143, the checkpoint saved). `--resume`
    completes it; the output equals session.run and no row ran twice: the items answered
    after the last checkpoint, and the one that was running, come back from the server's
    replay cache."""
    x = rows(1_000, seed=4, start=0)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"
    state = tmp_path / "out.npy.partial" / "state.json"
    args = ["--input", str(tmp_path / "in.npy"), "--output", str(out), "--rows-per-item", "10"]

    async def scenario() -> MeteredEngine:
        engine = MeteredEngine(str(small_model))
        try:
            async with serving(engine, config(small_model, max_batch_size=10)) as s:
                process = await asyncio.create_subprocess_exec(
                    *INTERRUPTIBLE_CLIENT_CLI,
                    "bulk",
                    "--target",
                    s.target,
                    *args,
                    "--checkpoint-interval-s",
                    "0",
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                )
                try:
                    engine.permits.release(20)  # 20 batches of one item each, then it stalls
                    await until(lambda: done_items(state) >= 20, timeout_s=30.0)
                    process.send_signal(signum)
                    _, err_bytes = await asyncio.wait_for(
                        process.communicate(), timeout=CLIENT_CLI_TIMEOUT_S
                    )
                finally:
                    if process.returncode is None:
                        process.kill()
                        await process.wait()
                err = err_bytes.decode()
                assert process.returncode == exit_code, err
                if message is not None:
                    assert f"laneserve-client: {message}" in err
                    assert done_items(state) == 20, "the checkpoint was saved"
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
            assert not out.exists()
            engine.fail_when = lambda _batch: False
            code, _, err = await cli("bulk", "--target", s.target, *args, "--resume")
            assert code == 0, err
            assert "360 of 400 rows already done" in err
        return engine

    engine = asyncio.run(scenario())
    with np.load(out) as saved:
        np.testing.assert_allclose(
            saved["output"], small_reference.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6
        )
    assert sorted(engine.ran_tags) == list(range(400)), "only the failed rows ran again"


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
    code, _, err = asyncio.run(cli("bulk", *arguments, "--timeout-ms", "-1"))
    assert code == 2
    assert "--timeout-ms: expected milliseconds from 0 (the lane's timeout) to 2**32 - 1" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out.npy.partial").exists(), "a corrected rerun needs no --resume"


def test_unreachable_server_exits_3_naming_the_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def scenario() -> None:
        code, _, err = await cli("stats", "--target", f"127.0.0.1:{port}", "--attempts", "1")
        assert code == 3
        assert "UNAVAILABLE" in err

    asyncio.run(scenario())


def batch_tags(batch: Batch) -> list[int]:
    return [int(tag) for part in batch.parts["input"] for tag in part[:, 0]]
