"""Load generation in client processes, apart from the server under test.

A `ClientPool` keeps K client processes for a whole run (spawned once: starting Python,
grpc and numpy costs a second or more per process). For each load point every process
gets its share of every stream, connects, and all start together at one monotonic
instant (CLOCK_MONOTONIC is system-wide on Linux, so the processes share a time base).
Each process reports its records at every window boundary; the orchestrator merges a
window once all processes have reported it, and stops the point when the last windows
agree or the cap is reached.

Who owns what: the orchestrator owns the pool's queues and the stop event; a client
process owns its channels, its calls and its records (one asyncio loop, no threads of
its own besides grpc's).

Closed-loop latency runs from a request's send to its answer. Open-loop latency runs
from its *scheduled* arrival, so a client that falls behind cannot hide the server's
queueing (no coordinated omission); how far it fell behind is reported as client lag.
An answer is timed when the process's event loop gets to it, so each process also times
its own loop (a heartbeat): a starved or flooded loop holds answers back, which the
latency would otherwise count against the server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import math
import multiprocessing
import multiprocessing.context
import multiprocessing.queues
import multiprocessing.synchronize
import queue
import secrets
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Final

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2

from laneserve.client.tensors import decode_tensor, encode_tensor
from laneserve.server.bench.settings import HEARTBEAT_S, WORKER_METADATA_KEY, Profile, Stream
from laneserve.server.bench.summary import (
    OK,
    MergedWindow,
    StreamWindow,
    WindowReport,
    dispatched_late,
    merge_window,
    unanswered_reason,
)
from laneserve.v1 import inference_pb2 as pb

INFER_METHOD: Final = "/laneserve.v1.InferenceService/Infer"
INFER_STREAM_METHOD: Final = "/laneserve.v1.InferenceService/InferStream"
GET_MODEL_METHOD: Final = "/laneserve.v1.InferenceService/GetModel"
# Requests one client process may have in flight in open loop; arrivals beyond it are
# not sent, and counted apart as client backlog (the client, not the server, is then the
# limit).
MAX_OUTSTANDING: Final = 20_000
READY_TIMEOUT_S: Final = 60.0
# How often a waiting client process looks at the stop event.
POLL_S: Final = 0.02
# A window report later than its boundary by this much means a client process is stuck.
REPORT_GRACE_S: Final = 30.0
MESSAGE_LIMIT_BYTES: Final = 64 * 1024 * 1024
_ONE_BYTE_VARINT: Final = 128


@dataclasses.dataclass(frozen=True, slots=True)
class InputSpec:
    """One model input as the load generator fills it: random values of this type."""

    name: str
    dtype: str
    # Dimensions after the row axis (dynamic ones already fixed to 1).
    trailing_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One load point for one client process."""

    target: str
    # The server's priority port, for streams sent there (None: it has none).
    priority_target: str | None
    streams: tuple[Stream, ...]
    # Per stream, this process's share: closed-loop callers and open-loop arrivals/s.
    callers: tuple[int, ...]
    rates_per_s: tuple[float, ...]
    inputs: tuple[InputSpec, ...]
    warmup_s: float
    window_s: float
    max_windows: int
    channels: int
    seed: int


@dataclasses.dataclass(frozen=True, slots=True)
class PointRun:
    """What the pool measured for one point: merged windows, in order."""

    windows: list[MergedWindow]
    stable: bool
    # Windows whose figures the point reports: the last `stable_windows` measured.
    used: list[MergedWindow]


class ClientError(RuntimeError):
    """A client process failed or stopped answering; the message carries its traceback."""


class ClientPool:
    """K client processes that generate load for one point at a time.

    with ClientPool(processes=2, channels=4) as pool:
        run = pool.run_point(target, streams, inputs, profile, judge=...)
    """

    def __init__(self, *, processes: int, channels: int, seed: int = 0) -> None:
        if processes < 1 or channels < 1:
            raise ValueError(
                f"expected at least 1 client process and 1 channel each, got "
                f"{processes} and {channels}"
            )
        self.processes = processes
        self.channels = channels
        self._seed = seed
        self._points = 0
        # spawn, not fork: a forked child would inherit grpc's threads in an unknown state.
        context = multiprocessing.get_context("spawn")
        self._results: multiprocessing.queues.Queue[tuple[Any, ...]] = context.Queue()
        self._stop = context.Event()
        self._commands: list[multiprocessing.queues.Queue[Job | float | None]] = []
        self._workers: list[multiprocessing.context.SpawnProcess] = []
        try:
            for index in range(processes):
                commands: multiprocessing.queues.Queue[Job | float | None] = context.Queue()
                worker = context.Process(
                    target=worker_main,
                    args=(index, commands, self._results, self._stop),
                    name=f"laneserve-bench-client-{index}",
                    daemon=True,
                )
                worker.start()
                self._commands.append(commands)
                self._workers.append(worker)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_point(
        self,
        target: str,
        streams: Sequence[Stream],
        inputs: Sequence[InputSpec],
        *,
        profile: Profile,
        judge: Callable[[list[MergedWindow]], bool],
        on_boundary: Callable[[int], None] | None = None,
        priority_target: str | None = None,
    ) -> PointRun:
        """Offers `streams` to `target` after the profile's warm-up until
        `judge(windows so far)` says stable or the profile's cap of windows is reached;
        the figures come from the last `profile.stable_windows` windows.

        `on_boundary(k)` is called at the start of measured window k (k = 0 at the end of
        the warm-up) and once more at the end of the last window, before the load stops:
        readings taken there (GetStats, CPU, memory) cover exactly the windows between
        two boundaries, as the client records do."""
        warmup_s, window_s = profile.warmup_s, profile.window_s
        max_windows = profile.max_windows
        self._points += 1
        parts = self.processes
        shares = [[stream.share(index, parts) for stream in streams] for index in range(parts)]
        self._stop.clear()
        for index, commands in enumerate(self._commands):
            commands.put(
                Job(
                    target=target,
                    priority_target=priority_target,
                    streams=tuple(streams),
                    callers=tuple(callers for callers, _ in shares[index]),
                    rates_per_s=tuple(rate for _, rate in shares[index]),
                    inputs=tuple(inputs),
                    warmup_s=warmup_s,
                    window_s=window_s,
                    max_windows=max_windows,
                    channels=self.channels,
                    seed=self._seed * 1_000_003 + self._points * 101 + index,
                )
            )
        try:
            self._expect("ready", parts, READY_TIMEOUT_S)
            start_s = time.monotonic() + 0.05
            for commands in self._commands:
                commands.put(start_s)
            windows, stable = self._collect(
                start_s + warmup_s, window_s, max_windows, judge, on_boundary
            )
        finally:
            self._stop.set()
        self._expect("done", parts, READY_TIMEOUT_S)
        return PointRun(windows=windows, stable=stable, used=windows[-profile.stable_windows :])

    def _collect(
        self,
        first_s: float,
        window_s: float,
        max_windows: int,
        judge: Callable[[list[MergedWindow]], bool],
        on_boundary: Callable[[int], None] | None,
    ) -> tuple[list[MergedWindow], bool]:
        """Merges the windows that start at `first_s`, calling `on_boundary` at each
        boundary as its time comes (and at the latest before the window it opens or
        closes is judged: every client reports window k after boundary k + 1, on the
        same monotonic clock)."""
        pending: dict[int, list[WindowReport]] = {}
        windows: list[MergedWindow] = []
        marked = 0  # boundaries passed to on_boundary so far

        def next_mark_s() -> float:
            if on_boundary is None or marked > max_windows:
                return math.inf
            return first_s + marked * window_s

        def mark_due() -> None:
            nonlocal marked
            while on_boundary is not None and time.monotonic() >= next_mark_s():
                on_boundary(marked)
                marked += 1

        while len(windows) < max_windows:
            mark_due()
            due_s = first_s + (len(windows) + 1) * window_s + REPORT_GRACE_S
            message = self._poll(min(due_s, next_mark_s()) - time.monotonic())
            if message is None:
                if time.monotonic() >= due_s:
                    raise self._silent()
                continue
            if message[0] != "window":
                raise ClientError(f"expected a window report, got {message[0]!r}")
            report: WindowReport = message[1]
            pending.setdefault(report.window, []).append(report)
            ready = pending.get(len(windows))
            if ready is not None and len(ready) == self.processes:
                mark_due()
                windows.append(merge_window(pending.pop(len(windows))))
                if judge(windows):
                    return windows, True
        return windows, False

    def _expect(self, kind: str, count: int, timeout_s: float) -> None:
        """Waits for `count` messages of `kind`, dropping window reports past the end."""
        seen = 0
        due_s = time.monotonic() + timeout_s
        while seen < count:
            message = self._next(due_s - time.monotonic())
            if message[0] == kind:
                seen += 1
            elif message[0] != "window":
                raise ClientError(f"expected {kind!r} from the client processes, got {message}")

    def _next(self, timeout_s: float) -> tuple[Any, ...]:
        message = self._poll(timeout_s)
        if message is None:
            raise self._silent()
        return message

    def _poll(self, timeout_s: float) -> tuple[Any, ...] | None:
        """The next message, or None when none came within `timeout_s`."""
        try:
            message: tuple[Any, ...] = self._results.get(timeout=max(timeout_s, 0.01))
        except queue.Empty:
            return None
        if message[0] == "error":
            raise ClientError(f"client process {message[1]} failed:\n{message[2]}")
        return message

    def _silent(self) -> ClientError:
        dead = [w.name for w in self._workers if not w.is_alive()]
        return ClientError(f"no word from the client processes in time (dead: {dead or 'none'})")

    def close(self) -> None:
        """Stops every client process: asks, then terminates the ones that do not leave.
        A Ctrl-C meanwhile stops the asking, not the stopping: the rest are killed."""
        self._stop.set()
        for commands in self._commands:
            with contextlib.suppress(ValueError, OSError):  # already closed
                commands.put(None)
        interrupted: KeyboardInterrupt | None = None
        for worker in self._workers:
            try:
                if interrupted is None:
                    worker.join(timeout=10)
                    if worker.is_alive():
                        worker.terminate()
                        worker.join(timeout=10)
            except KeyboardInterrupt as error:
                interrupted = error
            if worker.is_alive():
                worker.kill()
                worker.join()
        for commands in self._commands:
            commands.close()
            commands.join_thread()
        self._results.close()
        self._results.join_thread()
        self._workers.clear()
        self._commands.clear()
        if interrupted is not None:
            raise interrupted


# ---- in the client process --------------------------------------------------------


def worker_main(
    index: int,
    commands: multiprocessing.queues.Queue[Job | float | None],
    results: multiprocessing.queues.Queue[tuple[Any, ...]],
    stop: multiprocessing.synchronize.Event,
) -> None:
    """A client process: runs jobs until told to stop (None)."""
    # Ctrl-C reaches the whole process group; the orchestrator decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One event loop for the process's life: grpc.aio binds its completion queue poller
    # to a loop, and a second asyncio.run would leave it posting to a closed one.
    with asyncio.Runner() as runner:
        while (job := commands.get()) is not None:
            assert isinstance(job, Job)
            try:
                runner.run(_Client(index, job, commands, results, stop).run())
            except Exception:  # noqa: BLE001 - reported to the orchestrator, which raises it
                results.put(("error", index, traceback.format_exc()))
                return


def request_body(stream: Stream, inputs: Sequence[InputSpec], rng: np.random.Generator) -> bytes:
    """The serialized InferRequest of `stream`, without its request_id (added per call)."""
    tensors = []
    for spec in inputs:
        shape = (stream.rows, *spec.trailing_shape)
        dtype = np.dtype(spec.dtype)
        values: np.ndarray[Any, Any]
        if dtype.kind == "f":
            values = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            values = rng.integers(0, 2, shape).astype(dtype)
        elif dtype.hasobject:  # text: numbers written out, which any string input takes
            values = rng.integers(0, 100, shape).astype(str).astype(object)
        else:
            values = rng.integers(0, 100, shape).astype(dtype)
        tensors.append(encode_tensor(spec.name, values))
    return pb.InferRequest(
        lane=stream.lane, timeout_ms=stream.timeout_ms, inputs=tensors
    ).SerializeToString()


def with_request_id(body: bytes, request_id: str) -> bytes:
    """`body` with field 1 (request_id) prepended: protobuf reads fields in any order,
    so each call costs a few bytes of concatenation instead of a serialization."""
    encoded = request_id.encode()
    assert len(encoded) < _ONE_BYTE_VARINT, "the length must fit a one-byte varint"
    return b"\x0a" + bytes([len(encoded)]) + encoded + body


def failure_reason(error: grpc.aio.AioRpcError) -> str:
    """The server's ErrorInfo.reason when it sent one, else the status code's name."""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            reason = _error_info_reason(status_pb2.Status.FromString(value))
            if reason:
                return reason
    return error.code().name


def status_reason(status: status_pb2.Status) -> str:
    """The reason of an InferStream item's error: its ErrorInfo.reason, else its code."""
    return _error_info_reason(status) or code_pb2.Code.Name(status.code)


def _error_info_reason(status: status_pb2.Status) -> str:
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.reason:
            return info.reason
    return ""


class _Bidi:
    """One InferStream call carrying one stream's requests from one client process:
    requests are written in order, answers matched to them by request_id. A stream that
    ends fails what is still pending with its reason; the next request opens a new one.

    Only the client process's event loop touches it.
    """

    def __init__(self, open_call: Callable[[], Any]) -> None:
        self._open_call = open_call
        self._call: Any = None
        self._pending: dict[str, asyncio.Future[pb.InferResponse | str]] = {}
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def call(self, request_id: str, payload: bytes) -> pb.InferResponse | str:
        """The answer, or the reason of the failure."""
        if self._call is None:
            self._call = self._open_call()
            self._tasks = [
                asyncio.create_task(self._write(self._call)),
                asyncio.create_task(self._read(self._call)),
            ]
        future: asyncio.Future[pb.InferResponse | str] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._outbox.put_nowait(payload)
        try:
            return await future
        finally:
            self._pending.pop(request_id, None)

    async def _write(self, call: Any) -> None:
        while True:
            await call.write(await self._outbox.get())

    async def _read(self, call: Any) -> None:
        reason = "STREAM_ENDED"
        try:
            while (raw := await call.read()) is not grpc.aio.EOF:
                message = pb.InferStreamResponse.FromString(raw)
                future = self._pending.pop(message.request_id, None)
                if future is None or future.done():
                    continue
                if message.HasField("response"):
                    future.set_result(message.response)
                else:
                    future.set_result(status_reason(message.error))
        except grpc.aio.AioRpcError as error:
            reason = failure_reason(error)
        self._end(reason)

    def _end(self, reason: str) -> None:
        for task in self._tasks:
            task.cancel()
        if self._call is not None:
            self._call.cancel()
        self._call = None
        self._outbox = asyncio.Queue()
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_result(reason)

    async def close(self) -> None:
        tasks = self._tasks
        self._end("CLIENT_STOPPED")
        await asyncio.gather(*tasks, return_exceptions=True)


class _Client:
    def __init__(
        self,
        index: int,
        job: Job,
        commands: multiprocessing.queues.Queue[Job | float | None],
        results: multiprocessing.queues.Queue[tuple[Any, ...]],
        stop: multiprocessing.synchronize.Event,
    ) -> None:
        self.index = index
        self.job = job
        self.commands = commands
        self.results = results
        self.stop = stop
        rng = np.random.default_rng(job.seed)
        self.rng = rng
        self.bodies = [request_body(stream, job.inputs, rng) for stream in job.streams]
        self.records = [StreamWindow() for _ in job.streams]
        self.verified = [False] * len(job.streams)
        self.sequence = 0
        # Request ids are unique across points, processes and runs: servers may
        # deduplicate them (a repeated id is answered as a retry, not run again).
        self.id_prefix = f"{secrets.token_hex(4)}-{index}-"
        self.stopping = False
        self.in_flight: set[asyncio.Task[None]] = set()
        self.calls: list[grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = []
        # The same, on the server's priority port (streams with port "priority").
        self.priority_calls: list[grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = []
        # Per stream sent over InferStream, its call (opened on first use).
        self.bidis: dict[int, _Bidi] = {}
        # Per main-port channel, the server process its connection reached (its pid, as
        # the server named itself), or "" where it does not say.
        self.channel_workers: list[str] = []
        # The first wrong answer seen; the job fails with it once the load has stopped.
        self.problem = ""

    async def run(self) -> None:
        job = self.job
        # Channels to the priority port only where this process sends there.
        priority = any(
            stream.port == "priority" and (callers > 0 or rate_per_s > 0)
            for stream, callers, rate_per_s in zip(
                job.streams, job.callers, job.rates_per_s, strict=True
            )
        )
        targets = [job.target]
        if priority:
            if job.priority_target is None:
                raise ClientError("a stream goes to the priority port, but the server has none")
            targets.append(job.priority_target)
        channels = [
            grpc.aio.insecure_channel(
                target,
                options=[
                    # A channel of its own per subchannel pool: each is its own TCP
                    # connection, which SO_REUSEPORT spreads over the N workers.
                    ("grpc.use_local_subchannel_pool", 1),
                    ("grpc.max_receive_message_length", MESSAGE_LIMIT_BYTES),
                    ("grpc.max_send_message_length", MESSAGE_LIMIT_BYTES),
                ],
            )
            for target in targets
            for _ in range(job.channels)
        ]
        try:
            await asyncio.wait_for(
                asyncio.gather(*(channel.channel_ready() for channel in channels)),
                READY_TIMEOUT_S,
            )
            calls: list[grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = [
                channel.unary_unary(INFER_METHOD) for channel in channels
            ]
            self.calls, self.priority_calls = calls[: job.channels], calls[job.channels :]
            self.channel_workers = list(
                await asyncio.gather(*(_worker_of(channel) for channel in channels[: job.channels]))
            )
            first = channels[0]
            open_stream: grpc.aio.StreamStreamMultiCallable[bytes, bytes]
            open_stream = first.stream_stream(INFER_STREAM_METHOD)
            self.bidis = {
                si: _Bidi(open_stream) for si, s in enumerate(job.streams) if s.via == "stream"
            }
            self.results.put(("ready", self.index))
            start_s = await asyncio.to_thread(self.commands.get, True, READY_TIMEOUT_S)
            assert isinstance(start_s, float)
            generators = [
                asyncio.create_task(self._caller(si, start_s, caller))
                for si, callers in enumerate(job.callers)
                for caller in range(callers)
            ] + [
                asyncio.create_task(self._arrivals(si, start_s, rate))
                for si, rate in enumerate(job.rates_per_s)
                if rate > 0
            ]
            generators.append(asyncio.create_task(self._heartbeat(start_s)))
            try:
                await self._windows(start_s)
            finally:
                self.stopping = True
                for task in (*generators, *self.in_flight):
                    task.cancel()
                await asyncio.gather(*generators, *self.in_flight, return_exceptions=True)
                for bidi in self.bidis.values():
                    await bidi.close()
        finally:
            for channel in channels:
                await channel.close(grace=None)
        if self.problem:
            raise ClientError(self.problem)
        self.results.put(("done", self.index))

    async def _windows(self, start_s: float) -> None:
        """Ships the records at every window boundary until stopped or at the cap."""
        job = self.job
        boundary_s = start_s + job.warmup_s
        if not await self._sleep_until(boundary_s):
            return
        self.records = [StreamWindow() for _ in job.streams]  # warm-up is not measured
        cpu_s, wall_s = time.process_time(), time.monotonic()
        for window in range(job.max_windows):
            boundary_s += job.window_s
            if not await self._sleep_until(boundary_s):
                return
            records, self.records = self.records, [StreamWindow() for _ in job.streams]
            now_cpu_s, now_wall_s = time.process_time(), time.monotonic()
            report = WindowReport(
                worker=self.index,
                window=window,
                streams={s.label: r for s, r in zip(job.streams, records, strict=True)},
                wall_s=now_wall_s - wall_s,
                cpu_s=now_cpu_s - cpu_s,
                connections=dict(collections.Counter(w for w in self.channel_workers if w)),
            )
            cpu_s, wall_s = now_cpu_s, now_wall_s
            self.results.put(("window", report))
        # At the cap: wait for the orchestrator's stop, keeping the load on meanwhile.
        await asyncio.to_thread(self.stop.wait)

    async def _sleep_until(self, at_s: float) -> bool:
        """False when told to stop first."""
        while (remaining_s := at_s - time.monotonic()) > 0:
            if self.stop.is_set():
                return False
            await asyncio.sleep(min(remaining_s, POLL_S))
        return not self.stop.is_set()

    async def _heartbeat(self, start_s: float) -> None:
        """Times this process's event loop: ticks are due every HEARTBEAT_S from
        `start_s`, and each records, in the records of every stream this process carries,
        how late the loop ran it. On a fixed grid, not a sleep after each wake: a stall of
        one second leaves 100 ticks late by 1 s down to 0, so the samples weigh a stall by
        its length, as the answers it holds back do (a sleep after each wake would leave
        one sample, lost among the on-time ones)."""
        job = self.job
        carried = [
            si
            for si, (callers, rate_per_s) in enumerate(
                zip(job.callers, job.rates_per_s, strict=True)
            )
            if callers > 0 or rate_per_s > 0
        ]
        due_s = start_s
        while not self.stopping:
            now_s = time.monotonic()
            while due_s <= now_s:
                for si in carried:
                    self.records[si].loop_late_s.append(now_s - due_s)
                due_s += HEARTBEAT_S
            await asyncio.sleep(due_s - now_s)

    async def _caller(self, si: int, start_s: float, caller: int) -> None:
        await asyncio.sleep(max(0.0, start_s - time.monotonic()))
        channel = caller % len(self.calls)
        while not self.stopping:
            await self._call(si, channel, None)

    async def _arrivals(self, si: int, start_s: float, rate_per_s: float) -> None:
        """Poisson arrivals: exponential gaps, sent at their scheduled time or, when the
        loop was late, at once (the latency still counts from the schedule)."""
        mean_gap_s = 1.0 / rate_per_s
        next_s = start_s + float(self.rng.exponential(mean_gap_s))
        arrivals = 0
        while not self.stopping:
            now_s = time.monotonic()
            if next_s > now_s:
                await asyncio.sleep(next_s - now_s)
                continue
            while next_s <= now_s:
                if len(self.in_flight) >= MAX_OUTSTANDING:
                    self.records[si].client_backlog += 1  # never sent, never answered
                else:
                    channel = arrivals % len(self.calls)
                    task = asyncio.create_task(self._call(si, channel, next_s))
                    self.in_flight.add(task)
                    task.add_done_callback(self.in_flight.discard)
                arrivals += 1
                next_s += float(self.rng.exponential(mean_gap_s))

    async def _call(self, si: int, channel: int, scheduled_s: float | None) -> None:
        stream = self.job.streams[si]
        self.sequence += 1
        payload = with_request_id(self.bodies[si], f"{self.id_prefix}{self.sequence}")
        sent_s = time.monotonic()
        sent_record = self.records[si]  # the window the request is sent in
        sent_record.sent += 1
        if scheduled_s is not None:
            sent_record.lag_s.append(sent_s - scheduled_s)
        if stream.via == "stream":
            answer = await self.bidis[si].call(f"{self.id_prefix}{self.sequence}", payload)
        else:
            calls = self.priority_calls if stream.port == "priority" else self.calls
            answer = await self._unary(calls[channel], payload, stream.call_timeout_s)
        done_s = time.monotonic()
        record = self.records[si]  # the window the answer completed in
        # An InferStream item has no gRPC deadline of its own.
        timeout_s = stream.call_timeout_s if stream.via == "unary" else math.inf
        if timeout_s < math.inf:
            # gRPC ends every call by its deadline: time past it before this loop saw the
            # end was spent in the client (its gRPC core or this loop), answer or not.
            record.past_deadline_s.append(max(0.0, done_s - sent_s - timeout_s))
        if isinstance(answer, str):
            record.outcomes[unanswered_reason(answer, done_s - sent_s, timeout_s)] += 1
            if answer == "BAD_RESPONSE":
                self.problem = self.problem or f"stream {stream.label!r}: an answer did not parse"
            return
        response = answer
        started_s = sent_s if scheduled_s is None else scheduled_s
        latency_s = done_s - started_s
        if not self.verified[si]:
            problem = _check_rows(response, stream.rows)
            if problem:
                record.outcomes["BAD_RESPONSE"] += 1
                self.problem = self.problem or f"stream {stream.label!r}: {problem}"
                return
            self.verified[si] = True
        record.outcomes[OK] += 1
        record.ok_latency_s.append(latency_s)
        worker = self._worker_for(stream, channel)
        if worker:
            record.ok_by_worker[worker] += 1
        timing = response.timing
        record.ok_batch_rows.append(timing.batch_size)
        record.ok_queue_us.append(timing.queue_us)
        if stream.deadline_ms is not None:
            deadline_s = stream.deadline_ms / 1000
            if latency_s > deadline_s:
                record.late_ok += 1
            # Under a gRPC deadline every OK answer came within it: a request run after
            # it is cancelled at the client and never seen, so none is counted.
            if stream.deadline_in == "timeout_ms" and dispatched_late(
                latency_s, timing.infer_us, deadline_s
            ):
                record.expired_executed += 1

    def _worker_for(self, stream: Stream, channel: int) -> str:
        """The server process that answered a call of `stream` sent on `channel`: the
        one its connection reached (an InferStream runs on the first channel; the
        priority port's channels are not probed). "" where unknown."""
        if stream.port == "priority" or not self.channel_workers:
            return ""
        return self.channel_workers[0 if stream.via == "stream" else channel]

    async def _unary(
        self,
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes],
        payload: bytes,
        timeout_s: float,
    ) -> pb.InferResponse | str:
        """The answer, or the reason of the failure."""
        try:
            raw = await call(payload, timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            return failure_reason(error)
        try:
            return pb.InferResponse.FromString(raw)
        except DecodeError:
            return "BAD_RESPONSE"


async def _worker_of(channel: grpc.aio.Channel) -> str:
    """The server process `channel`'s connection reached, as the server names itself in
    GetModel's initial metadata (WORKER_METADATA_KEY); "" where it does not. Asked once
    per point, when the connection opens: a connection stays on the process it reached
    (SO_REUSEPORT picks one per connection), and the Infer path stays untouched."""
    get_model: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]
    get_model = channel.unary_unary(GET_MODEL_METHOD)
    call = get_model(b"", timeout=READY_TIMEOUT_S)
    try:
        metadata = await call.initial_metadata()
        await call
    except grpc.aio.AioRpcError:
        return ""  # no GetModel: nothing to name the process by
    for key, value in metadata or ():
        if key == WORKER_METADATA_KEY and isinstance(value, str):
            return value
    return ""


def _check_rows(response: pb.InferResponse, rows: int) -> str:
    """Empty when every output of the first answer has the request's row count."""
    if not response.outputs:
        return "the answer has no outputs"
    for tensor in response.outputs:
        try:
            array = decode_tensor(tensor)
        except ValueError as error:
            return f"the answer does not decode: {error}"
        if array.shape[:1] != (rows,):
            return f"output {tensor.name!r} has shape {list(array.shape)}; expected {rows} rows"
    return ""
