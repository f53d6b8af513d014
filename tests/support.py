"""Helpers for the server tests: request building, a recording engine, a served server."""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import dataclasses
import functools
import json
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import onnx
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper

from laneserve.client.tensors import decode_tensor, encode_tensor
from laneserve.server import Engine, LaneServer, ServerConfig, service, streams
from laneserve.server.items import Batch, BatchResult, RowsWanted
from laneserve.server.memory import MemoryEstimate
from laneserve.server.static_estimate import static_estimate
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc

F32 = npt.NDArray[np.float32]


def rows(count: int, *, seed: int = 0, start: int | None = None) -> F32:
    """`count` input rows for the demo models; with `start`, row i's first value is start+i
    (a tag that identifies the row in the engine's record of what ran)."""
    array = np.random.default_rng(seed).standard_normal((count, 512)).astype(np.float32)
    if start is not None:
        array[:, 0] = np.arange(start, start + count, dtype=np.float32)
    return array


def request(array: F32, **fields: Any) -> pb.InferRequest:
    return pb.InferRequest(inputs=[encode_tensor("input", array)], **fields)


def output(response: pb.InferResponse) -> F32:
    (tensor,) = response.outputs
    result: F32 = decode_tensor(tensor)
    return result


class RecordingEngine(Engine):
    """The real engine, which records the tagged rows it ran and can be held or broken.

    Fault injection only: outputs always come from the real session. Its static memory
    estimate is `estimate_once`'s unless one is given (the child's ~1 s, for each of the
    many engines the tests build).
    """

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        kwargs.setdefault("estimate", estimate_once)
        super().__init__(model_path, **kwargs)
        self.ran_tags: list[int] = []
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)  # released once per batch that starts
        self.fail_when: Callable[[Batch], bool] = lambda _batch: False
        self._lock = threading.Lock()

    def run_batch(self, batch: Batch, rows_wanted: RowsWanted | None = None) -> BatchResult:
        self.entered.release()
        self.gate.wait()
        if self.fail_when(batch):
            raise RuntimeError("injected fault")
        result = super().run_batch(batch, rows_wanted)
        with self._lock:
            self.batches.append(batch.rows)
            # The demo model's rows are tagged by their first value; other models' are not.
            for part in batch.parts.get("input", ()):
                self.ran_tags.extend(int(tag) for tag in part[:, 0])
        return result

    def hold(self) -> None:
        """The next batch blocks inside the engine (the session is busy) until release."""
        self.gate.clear()

    def hold_next(self) -> None:
        """`hold`, after forgetting the batches that started so far: `entered` then waits
        for the batch that is held, not for one that ran before."""
        while self.entered.acquire(blocking=False):
            pass
        self.hold()

    def release(self) -> None:
        self.gate.set()


@dataclasses.dataclass
class Serving:
    server: LaneServer
    channel: grpc.aio.Channel
    stub: pb_grpc.InferenceServiceAsyncStub
    target: str


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    # The health stubs' types lack the RPC attributes; the call itself is plain.
    stub: Any = health_pb2_grpc.HealthStub(channel)
    response: health_pb2.HealthCheckResponse = await stub.Check(
        health_pb2.HealthCheckRequest(service=service)
    )
    return response.status


@functools.cache
def estimate_once(model_path: str) -> MemoryEstimate:
    """The static memory estimate, worked out once per model in this process: an engine
    given it (`RecordingEngine`'s by default) takes it instead of starting its child
    process (~1 s each; the child itself is tested in test_memory and by every engine
    built otherwise). Dynamic sizes count 1: no probe shapes."""
    return MemoryEstimate(*static_estimate(model_path))


@contextlib.asynccontextmanager
async def serving(engine: Engine, config: ServerConfig, **options: Any) -> AsyncIterator[Serving]:
    """A started server on 127.0.0.1:0 and a channel to it; always stopped afterwards.
    `options` go to LaneServer (e.g. telemetry=...)."""
    # Ephemeral ports for gRPC and for the metrics endpoint (unless it is off, -1):
    # tests never collide.
    metrics_port = min(config.metrics_port, 0)
    server = LaneServer(
        engine,
        dataclasses.replace(config, host="127.0.0.1", port=0, metrics_port=metrics_port),
        **options,
    )
    port = await server.start()
    target = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            yield Serving(server, channel, pb_grpc.InferenceServiceStub(channel), target)
    finally:
        engine_gate = getattr(engine, "gate", None)
        if engine_gate is not None:
            engine_gate.set()
        await server.stop(grace_s=5.0)


def item_reason(answer: pb.InferStreamResponse) -> str:
    """The ErrorInfo reason of a stream item's error answer ("" when it has none)."""
    for detail in answer.error.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def rich_status(error: grpc.aio.AioRpcError | grpc.Call) -> tuple[str, dict[str, Any]]:
    """The ErrorInfo reason and the other details of a failed call."""
    found: dict[str, Any] = {}
    reason = ""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            assert isinstance(value, bytes)
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                retry = error_details_pb2.RetryInfo()
                if detail.Unpack(info):
                    reason = info.reason
                    if info.metadata:
                        found["metadata"] = dict(info.metadata)
                elif detail.Unpack(retry):
                    found["retry_delay_s"] = retry.retry_delay.ToTimedelta().total_seconds()
        elif key == "grpc-retry-pushback-ms":
            found["pushback_ms"] = int(value)
    return reason, found


class TcpProxy:
    """A TCP relay on 127.0.0.1 in front of a server, whose connections the test can cut.

    `sever()` aborts every open connection at once, as a network failure would (the server
    sees its RPCs cancelled, the client UNAVAILABLE); new connections are relayed as before.
    While `silent` is set, bytes are read and dropped both ways with every connection left
    open: a host gone without a reset, a network black hole.
    """

    def __init__(self, upstream_port: int) -> None:
        self.silent = False
        self._upstream_port = upstream_port
        self._server: asyncio.Server | None = None
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections = 0

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    def retarget(self, upstream_port: int) -> None:
        """New connections go to `upstream_port` (another instance); open ones stay."""
        self._upstream_port = upstream_port

    def sever(self) -> int:
        links = list(self._links)
        for down, up in links:
            down.transport.abort()
            up.transport.abort()
        self._links.clear()
        return len(links)

    async def close(self) -> None:
        self.sever()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        link = (writer, up_writer)
        self._links.add(link)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink, link))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        link: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        try:
            while data := await source.read(1 << 16):
                if not self.silent:
                    sink.write(data)
                    await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._links.discard(link)
            for end in link:
                end.transport.abort()


# `laneserve serve` in a child process; the metrics endpoint on any free port, so
# concurrent servers never collide.
SERVE = [sys.executable, "-m", "laneserve.server.cli", "serve", "--metrics-port", "0"]
START_TIMEOUT_S = 60
REPO = Path(__file__).resolve().parent.parent


def run_text(
    command: Sequence[str], *, timeout_s: float, **options: Any
) -> subprocess.CompletedProcess[str]:
    """`command` run to its end (killed past `timeout_s`) with nothing on stdin, its
    stdout and stderr captured as text; its exit status is the caller's to check."""
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        stdin=subprocess.DEVNULL,
        **options,
    )


def unused_port() -> int:
    """A port free now, for a server a test starts on it (closed again: another process
    on the machine may take it meanwhile; for a port nothing may answer on, see
    `refusing_port`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# Sockets bound and never listening, held until the test process ends (see
# `refusing_port`).
_REFUSING: list[socket.socket] = []


@atexit.register
def _close_refusing() -> None:
    for sock in _REFUSING:
        sock.close()


def refusing_port() -> int:
    """A port where every connect is refused: bound and never listening, held for the
    test process's life, so that no server (this run's, or another's on the machine)
    takes it meanwhile, as one could a port picked and closed again."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _REFUSING.append(sock)
    port: int = sock.getsockname()[1]
    return port


class FakeTimers:
    """A `call_later(delay_s, action)` whose timers run by hand: each one started, in
    order, in `started` (call its `action` as the loop would at its time)."""

    class Timer:
        def __init__(self, delay_s: float, action: Callable[[], None]) -> None:
            self.delay_s = delay_s
            self.action = action
            self.cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self) -> None:
        self.started: list[FakeTimers.Timer] = []

    def __call__(self, delay_s: float, action: Callable[[], None]) -> FakeTimers.Timer:
        timer = FakeTimers.Timer(delay_s, action)
        self.started.append(timer)
        return timer


class SettableGauge:
    """Memory readings chosen by the test (the watermark's input, like a clock's time), of
    a device of 1 GiB."""

    def __init__(self) -> None:
        self.value = 0

    def used_bytes(self) -> int | None:
        return self.value

    def total_bytes(self) -> int | None:
        return 1 << 30


class ServerProcess:
    """A real `laneserve serve` process (or `command`, e.g. scripts/serve); `close()`
    always, even after a failure."""

    def __init__(self, args: list[str], command: list[str] = SERVE, cwd: Path = REPO) -> None:
        self.process = subprocess.Popen(
            [*command, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self._reader.join(timeout=30)
        assert self.process.stderr is not None
        self.process.stderr.close()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.put(line)
        self.lines.put("")

    def wait_for(self, pattern: str) -> re.Match[str]:
        while True:
            line = self.lines.get(timeout=START_TIMEOUT_S)
            self.log.append(line)
            if not line:
                raise AssertionError(f"server exited before {pattern!r}:\n{''.join(self.log)}")
            match = re.search(pattern, line)
            if match:
                return match

    def port(self) -> int:
        return int(self.wait_for(r"serving .* on 127\.0\.0\.1:(\d+)").group(1))

    def rest(self) -> list[str]:
        """The lines not yet waited for, to the end of stderr (the process has exited)."""
        lines = []
        while line := self.lines.get(timeout=START_TIMEOUT_S):
            lines.append(line)
        self.log += lines
        return lines


def queued_rows(s: Serving, lane: str | None = None) -> int:
    """Rows queued in `lane`, or in every lane."""
    thread = s.server._thread
    assert thread is not None
    return sum(depth.queued_rows for depth in thread.depths() if lane in (None, depth.name))


def flight_waiters(s: Serving, request_id: str) -> int:
    """Callers the server's ledger has waiting on the request `request_id` in flight (0:
    none still waits, or it is not in flight): a call's cancel has reached the server
    once its count goes down."""
    servicer = s.server._servicer
    assert servicer is not None
    flight = servicer._ledger._flights.get(request_id)
    return 0 if flight is None else len(flight.waiters)


async def one_running_and_queued(
    s: Serving, engine: RecordingEngine, *, running_rows: int = 1, queued_start: int = 1
) -> tuple[asyncio.Future[pb.InferResponse], asyncio.Future[pb.InferResponse]]:
    """A request of `running_rows` rows (tags from 0) held running in the engine, and one
    of two rows (tags `queued_start`, `queued_start` + 1) queued behind it."""
    engine.hold_next()
    running = asyncio.ensure_future(s.stub.Infer(request(rows(running_rows, start=0))))
    await asyncio.to_thread(engine.entered.acquire)
    queued = asyncio.ensure_future(s.stub.Infer(request(rows(2, start=queued_start))))
    await until(lambda: queued_rows(s) == 2)
    return running, queued


async def queued_never_ran_as_the_drain_ended(
    running: asyncio.Future[pb.InferResponse],
    queued: asyncio.Future[pb.InferResponse],
    engine: RecordingEngine,
    stopping: asyncio.Future[Any],
) -> None:
    """`one_running_and_queued`'s queued call is answered UNAVAILABLE, saying it never
    ran, as the drain's grace ended; then the held batch is let go and the stop ends."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await queued
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "before this request could run" in (caught.value.details() or "")
    engine.release()
    await asyncio.wait_for(stopping, timeout=60)
    await asyncio.gather(running, return_exceptions=True)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Polls `condition`: a state the server reaches, not an assumption about timing."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while not condition():
        if loop.time() > give_up:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.002)


async def until_stats(
    s: Serving, condition: Callable[[pb.GetStatsResponse], bool], timeout_s: float = 10.0
) -> None:
    """Polls GetStats until `condition` holds: a state the server reaches."""
    give_up = time.monotonic() + timeout_s
    while not condition(await s.stub.GetStats(pb.GetStatsRequest())):
        if time.monotonic() > give_up:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


async def cut_while_a_batch_runs(engine: RecordingEngine, proxy: TcpProxy) -> int | None:
    """Holds the next batch in the session, cuts every connection through `proxy`, then
    lets the batch go on: its requests lose their callers while they run. Returns the
    connections cut, or None when no batch started within seconds (the work is done)."""
    engine.hold_next()
    try:
        if not await asyncio.to_thread(engine.entered.acquire, timeout=5.0):
            return None
        return proxy.sever()
    finally:
        engine.release()


# `laneserve-client` as a child process.
CLIENT_CLI = [sys.executable, "-m", "laneserve.client.cli"]
# The same module run as `python -m` runs it, with Ctrl-C's default handler restored
# first: a Python whose parent ignores SIGINT (a background job of a non-interactive
# shell, some CI runners) starts with SIGINT ignored, and the signal would never arrive.
INTERRUPTIBLE_CLIENT_CLI = [
    sys.executable,
    "-c",
    (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_module('laneserve.client.cli', run_name='__main__', alter_sys=True)"
    ),
]
CLIENT_CLI_TIMEOUT_S = 120


async def client_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Runs `laneserve-client ARGS`: (exit code, stdout, stderr); killed past the timeout."""
    process = await asyncio.create_subprocess_exec(
        *CLIENT_CLI,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=CLIENT_CLI_TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


class MeteredEngine(RecordingEngine):
    """Runs a batch only with a permit: the test decides how far a job gets."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        self.permits = threading.Semaphore(0)

    def run_batch(self, batch: Batch, rows_wanted: RowsWanted | None = None) -> BatchResult:
        self.permits.acquire()
        return super().run_batch(batch, rows_wanted)

    def unlimited(self) -> None:
        self.permits.release(1_000_000)


def done_items(state: Path) -> int:
    """Items a bulk job's checkpoint (`state.json`) marks done; 0 while there is none."""
    try:
        document = json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    return int(np.unpackbits(np.frombuffer(base64.b64decode(document["done"]), np.uint8)).sum())


def config(model: Path, **fields: Any) -> ServerConfig:
    """A ServerConfig serving `model`, with `fields` over the defaults (the default lanes),
    its metrics endpoint on any free port unless `fields` name one: the default (9464)
    may be held by another test running at once, or by a server on this machine."""
    return ServerConfig(model_path=str(model), **({"metrics_port": 0} | fields))


def save_model(path: Path, graph: onnx.GraphProto, *, check: bool = True, opset: int = 17) -> Path:
    """`graph` saved at `path` as a model of `opset` and IR version 9 (what the
    onnxruntime in use reads); checked first by onnx's checker unless not `check`."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    if check:
        onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def no_input_model(path: Path, *, inferable: bool) -> Path:
    """A model with no inputs whose output "y" is declared ["N"]: a constant [1] (ONNX
    Runtime infers [1]) or, not `inferable`, an `If` whose branches give [1] and [2] (it
    infers nothing, and the start-up probe ran it with no rows to count)."""

    def constant(name: str, value: npt.NDArray[Any]) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [name], value=onnx.numpy_helper.from_array(value, name)
        )

    def branch(name: str, value: npt.NDArray[Any]) -> onnx.GraphProto:
        out = helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [None])
        return helper.make_graph([constant(f"{name}_y", value)], name, [], [out])

    one = np.array([1.0], np.float32)
    nodes = (
        [constant("y", one)]
        if inferable
        else [
            constant("cond", np.array(True)),
            helper.make_node(
                "If",
                ["cond"],
                ["y"],
                then_branch=branch("then", one),
                else_branch=branch("else", np.array([1.0, 2.0], np.float32)),
            ),
        ]
    )
    graph = helper.make_graph(
        nodes, "no_input", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])]
    )
    return save_model(path, graph)


def stderr_lines_until(process: subprocess.Popen[str], text: str) -> list[str]:
    """stderr's lines up to and with the first holding `text`; a process that writes none
    within the start timeout is killed (its stderr ends: the test fails, not hangs)."""
    assert process.stderr is not None
    watchdog = threading.Timer(START_TIMEOUT_S, process.kill)
    watchdog.start()
    lines: list[str] = []
    try:
        for line in process.stderr:
            lines.append(line)
            if text in line:
                return lines
    finally:
        watchdog.cancel()
    raise AssertionError(f"no line with {text!r}:\n{''.join(lines)}")


def observed_stream_windows(monkeypatch: pytest.MonkeyPatch) -> list[streams.StreamWindow]:
    """Every stream's credit window the servicer makes from now on, as it makes it."""
    windows: list[streams.StreamWindow] = []

    class Observed(streams.StreamWindow):
        def __init__(self, *args: int) -> None:
            super().__init__(*args)
            windows.append(self)

    monkeypatch.setattr(service, "StreamWindow", Observed)
    return windows
