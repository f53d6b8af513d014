"""Shared fixtures: generated models, and a check that no server thread is left running."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import onnxruntime as ort
import pytest

from laneserve import client as lc
from laneserve.server import memory_start
from laneserve.server.demo_model import make_demo_model, make_text_model


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "demo.onnx"
    make_demo_model(path)
    return path


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same signature as the demo model, tiny layers: for tests that start many servers."""
    path = tmp_path_factory.mktemp("models") / "small.onnx"
    make_demo_model(path, hidden_dim=32, hidden_layers=1)
    return path


@pytest.fixture(scope="session")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make_text_model`'s: text [N] -> tagged (text + "!") and label (its index in
    TEXT_LABELS, else -1); numbers [N, 2] of text -> value (float32; a row that is no
    number fails)."""
    path = tmp_path_factory.mktemp("models") / "text.onnx"
    make_text_model(path)
    return path


@pytest.fixture(scope="session")
def reference(demo_model: Path) -> ort.InferenceSession:
    """A plain session on the demo model: what the server's outputs must equal."""
    return ort.InferenceSession(str(demo_model), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="session")
def small_reference(small_model: Path) -> ort.InferenceSession:
    """A plain session on the small model."""
    return ort.InferenceSession(str(small_model), providers=["CPUExecutionProvider"])


@pytest.fixture(autouse=True)
def root_logging_restored() -> Iterator[None]:
    """A test that runs a CLI's main in the test process configures the root logger: its
    handler writes to the stderr pytest captured for that test, closed after it, and
    a later test's warning then failed to write ("--- Logging error ---" and a
    traceback on that test's stderr)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    _close_new_root_handlers(handlers)
    root.handlers[:] = handlers
    root.setLevel(level)


def _close_new_root_handlers(before: list[logging.Handler]) -> None:
    """Closes the root logger's handlers that are not in `before`: a CLI's main run in the
    test process installs one whose writer thread (`QueuedStreamHandler`) lives until
    the handler is closed."""
    for handler in logging.getLogger().handlers:
        if handler not in before:
            handler.close()


@pytest.fixture(autouse=True)
def no_cgroup_memory_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process servers take no host watermark from the cgroup the tests run in: a CI
    runner's container limit would otherwise close lanes at the whole test process's
    resident memory. Tests of that default patch it again (theirs comes later)."""
    monkeypatch.setattr(memory_start, "cgroup_memory_limit", lambda: None)


@pytest.fixture
def no_backoff_sleeps() -> Iterator[None]:
    """The client's retries happen, their sleeps do not (tests that need real sleeps
    turn it off)."""
    lc.set_testing(True)
    yield
    lc.set_testing(False)


# How long a thread the test told to end as it ended (a held stream let go in its
# `finally`) is given to end before it counts as left running.
THREAD_END_S = 10.0


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every test: no laneserve thread that it started is still running after it. The
    threads themselves are compared, not their names: a second server's engine thread
    left running is named as the first one left (which passed as already there)."""
    before = set(threading.enumerate())
    handlers = logging.getLogger().handlers[:]
    yield
    # Before the check, whichever of the two autouse fixtures ends first: the log writer
    # of a CLI's main run here is the test's to stop, not a leak of the code under test.
    _close_new_root_handlers(handlers)
    started = [
        thread
        for thread in threading.enumerate()
        if thread.name.startswith("laneserve-") and thread not in before
    ]
    for thread in started:  # one told to end as the test ended (a stream let go) ends
        thread.join(timeout=THREAD_END_S)
    leaked = sorted(thread.name for thread in started if thread.is_alive())
    assert not leaked, f"threads left running: {leaked}"
