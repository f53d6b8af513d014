"""The client's lifecycle against a real server on loopback: closing it with calls and
streams in progress, sharing one between threads, and dropping it unclosed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import sys
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import numpy.typing as npt
import pytest

from laneserve import client as lc
from tests.support import (
    REPO,
    RecordingEngine,
    config,
    queued_rows,
    refusing_port,
    rows,
    run_text,
    serving,
    until,
)

pytestmark = pytest.mark.usefixtures("no_leaked_threads", "no_backoff_sleeps")

F32 = npt.NDArray[np.float32]

# How long a test waits for what must happen at once. Only a hang reaches it.
HANG_S = 30.0


# ---- closing a client with a stream in progress ------------------------------------------


def test_closing_the_async_client_ends_its_stream_at_once(small_model: Path) -> None:
    """An item is in the session when the client closes: the iteration ends with
    ClientClosedError. (gRPC ended the stream's read with CancelledError; no end of the
    call was reported, and the iteration waited for one forever.)"""

    async def scenario() -> BaseException | None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=1)) as s:
            engine.hold()
            client = lc.AsyncClient(s.target)
            taken: list[lc.StreamResult] = []

            async def job() -> None:
                async for result in client.stream({"input": rows(8)}, rows_per_item=1):
                    taken.append(result)  # noqa: PERF401 - the iteration is the subject

            running = asyncio.ensure_future(job())
            await asyncio.to_thread(engine.entered.acquire)  # the first item runs
            await until(lambda: queued_rows(s) == 7)  # and the others wait their turn
            await client.close()
            done, _ = await asyncio.wait([running], timeout=HANG_S)
            engine.release()
            assert done, "the iteration ended with the client"
            assert not taken
            assert not running.cancelled()
            return running.exception()

    error = asyncio.run(scenario())
    assert isinstance(error, lc.ClientClosedError)
    assert "the client was closed; 8 item(s)" in str(error)


def test_closing_the_sync_client_ends_another_threads_stream_at_once(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """close() from another thread ends the iteration with the stream's own
    ClientClosedError. (It waited CLOSE_WAIT_S for the hung iteration, then cancelled
    it, and asyncio logged that it could not close the stream's generator.)"""
    caplog.set_level(logging.WARNING)

    async def scenario() -> BaseException | None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            engine.hold()
            client = lc.Client(s.target)

            def job() -> BaseException | None:
                try:
                    for _ in client.stream({"input": rows(8)}, rows_per_item=1):
                        pass
                except BaseException as error:  # noqa: BLE001 - the outcome is the assertion
                    return error
                return None

            running = asyncio.ensure_future(asyncio.to_thread(job))
            await asyncio.to_thread(engine.entered.acquire)
            await asyncio.to_thread(client.close)
            done, _ = await asyncio.wait([running], timeout=HANG_S)
            engine.release()
            assert done, "the iteration ended with the client"
            return running.result()

    error = asyncio.run(scenario())
    assert isinstance(error, lc.ClientClosedError)
    assert "bulk stream" in str(error), "ended by the stream, not given up on by close()"
    assert not [record.getMessage() for record in caplog.records if record.name == "asyncio"]


def test_closing_the_async_client_ends_a_stream_waiting_to_resume(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server drains after the first item: the job waits half an hour or more before
    its next call (its policy's backoff, real sleeps). close() ends the iteration at once
    with ClientClosedError, the broken call's error its cause (the wait went on)."""
    lc.set_testing(False)
    caplog.set_level(logging.INFO, logger="laneserve.client")
    patient = lc.RetryPolicy(initial_backoff_s=3600.0, max_backoff_s=3600.0)

    async def paused(go: asyncio.Event) -> AsyncIterator[dict[str, F32]]:
        yield {"input": rows(2)}
        await go.wait()  # never set: the rest would come after the restart
        yield {"input": rows(2)}

    async def scenario() -> BaseException | None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            client = lc.AsyncClient(s.target)
            first = asyncio.Event()

            async def job() -> None:
                async for _ in client.stream(paused(asyncio.Event()), retry=patient):
                    first.set()

            running = asyncio.ensure_future(job())
            await first.wait()
            await s.server.stop(grace_s=5.0)
            await until(lambda: resuming(caplog))
            await client.close()
            done, _ = await asyncio.wait([running], timeout=HANG_S)
            assert done, "the iteration ended with the client"
            return running.exception()

    error = asyncio.run(scenario())
    assert isinstance(error, lc.ClientClosedError)
    assert isinstance(error.__cause__, lc.UnavailableError), "the broken call's error"


# ---- closing a client with unary calls in progress ---------------------------------------


def test_closing_the_async_client_ends_its_calls_on_the_wire_with_client_closed_error(
    small_model: Path,
) -> None:
    """A call waiting for its answer when the client closes raises ClientClosedError (it
    raised asyncio.CancelledError: the caller's task looked cancelled, and `except
    LaneserveError` missed it). A call whose own task is cancelled stays cancelled."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            engine.hold()
            client = lc.AsyncClient(s.target)
            running = asyncio.ensure_future(client.infer({"input": rows(1)}, request_id="r"))
            await asyncio.to_thread(engine.entered.acquire)
            queued = asyncio.ensure_future(client.infer({"input": rows(1)}))
            await until(lambda: queued_rows(s) == 1)
            queued.cancel()  # by its caller, as the client closes
            await client.close()
            done, _ = await asyncio.wait([running, queued], timeout=HANG_S)
            engine.release()
            assert len(done) == 2
        assert not running.cancelled()
        error = running.exception()
        assert isinstance(error, lc.ClientClosedError)
        assert error.request_id == "r"
        assert queued.cancelled()

    asyncio.run(scenario())


# ---- one client shared between threads ---------------------------------------------------


def test_calls_other_threads_make_while_the_client_closes_end_with_client_closed_error(
    small_model: Path,
) -> None:
    """Threads call in a loop while another closes the client: each call is answered or
    ends with ClientClosedError. A call handed to the loop after close() had read the calls
    in progress waited forever on the stopped loop (a review saw 6 of 6 threads hang in
    the first round)."""

    async def scenario() -> tuple[int, set[str]]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(close_while_called, s.target)

    def close_while_called(target: str) -> tuple[int, set[str]]:
        ended: set[str] = set()
        for _ in range(10):
            client = lc.Client(target)
            closed = threading.Event()

            def call_until_closed(
                client: lc.Client = client, closed: threading.Event = closed
            ) -> None:
                # Calls keep coming until close() has returned, and one more after.
                while True:
                    last = closed.is_set()
                    try:
                        client.stats(timeout=HANG_S)
                    except lc.ClientClosedError:
                        ended.add("ClientClosedError")
                    except BaseException as error:  # noqa: BLE001 - reported below
                        ended.add(repr(error))
                        return
                    else:
                        if last:
                            ended.add("answered after close")
                    if last:
                        return

            threads = [threading.Thread(target=call_until_closed, daemon=True) for _ in range(6)]
            for thread in threads:
                thread.start()
            client.stats(timeout=HANG_S)  # the threads' calls are under way
            client.close()
            closed.set()
            for thread in threads:
                thread.join(HANG_S)
            hung = sum(thread.is_alive() for thread in threads)
            if hung:
                return hung, ended
        return 0, ended

    hung, ended = asyncio.run(scenario())
    assert hung == 0, "calls waited forever on the closed client"
    assert ended == {"ClientClosedError"}, ended


def test_a_second_close_from_another_thread_returns_once_the_client_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two threads close one client: the second close() returns only once the first has
    closed the channel and stopped the client's thread. (It returned at once, seeing the
    client marked closed, with the channel open and the thread running.) The first close
    is held until the second has either returned or begun to wait for it."""
    held_closes: list[lc.AsyncClient] = []
    first_entered = threading.Event()
    first_released: concurrent.futures.Future[None] = concurrent.futures.Future()
    original = lc.AsyncClient.close

    async def held_close(self: lc.AsyncClient) -> None:
        first_entered.set()
        await asyncio.wrap_future(first_released)  # e.g. a source's read ending
        await original(self)
        held_closes.append(self)

    monkeypatch.setattr(lc.AsyncClient, "close", held_close)
    client = lc.Client(f"127.0.0.1:{refusing_port()}")
    decided = threading.Event()  # the second close() returned, or waits for the first
    client._close_done = WaitWatched(decided)
    seen_on_return: list[tuple[bool, int]] = []

    def second_close() -> None:
        client.close()
        seen_on_return.append((client._thread.is_alive(), len(held_closes)))
        decided.set()

    first = threading.Thread(target=client.close, daemon=True)
    second = threading.Thread(target=second_close, daemon=True)
    try:
        first.start()
        assert first_entered.wait(HANG_S)
        second.start()
        assert decided.wait(HANG_S)
        assert not seen_on_return, "the second close() returned while the first was held"
    finally:
        first_released.set_result(None)
        second.join(HANG_S)
        first.join(HANG_S)
    assert seen_on_return == [(False, 1)], "on return: the thread stopped, the channel closed"


def test_a_second_close_on_the_clients_own_thread_returns_without_waiting_for_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While another thread's close() is under way, one made on the client's own thread
    (from an async stream source, say) returns at once: waiting there for the first close,
    which waits for that very thread, would hang both for ever."""
    first_entered = threading.Event()
    first_released: concurrent.futures.Future[None] = concurrent.futures.Future()
    original = lc.AsyncClient.close

    async def held_close(self: lc.AsyncClient) -> None:
        first_entered.set()
        await asyncio.wrap_future(first_released)
        await original(self)

    monkeypatch.setattr(lc.AsyncClient, "close", held_close)
    client = lc.Client(f"127.0.0.1:{refusing_port()}")

    async def close_there() -> None:
        client.close()

    first = threading.Thread(target=client.close, daemon=True)
    try:
        first.start()
        assert first_entered.wait(HANG_S)
        asyncio.run_coroutine_threadsafe(close_there(), client._loop).result(HANG_S)
    finally:
        first_released.set_result(None)
        first.join(HANG_S)
    assert not client._thread.is_alive()


def test_a_slow_source_holds_up_its_own_stream_not_other_threads_calls(small_model: Path) -> None:
    """One Client, two threads: one streams from a plain generator that waits for its
    data after the first item; the other's infer is answered meanwhile. (The items were
    read on the client's one loop thread: every other call, and its deadline, waited for
    the source.) The job then gets every item, in order."""
    waiting, go = threading.Event(), threading.Event()

    def source() -> Iterator[dict[str, F32]]:
        yield {"input": rows(2, start=0)}
        waiting.set()
        go.wait()  # e.g. the next rows come from a slow database
        yield {"input": rows(2, start=10)}

    async def scenario() -> tuple[bool, list[lc.StreamResult]]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            client = await asyncio.to_thread(lc.Client, s.target)
            try:
                job = asyncio.ensure_future(
                    asyncio.to_thread(lambda: list(client.stream(source())))
                )
                assert await asyncio.to_thread(waiting.wait, HANG_S)
                call = asyncio.ensure_future(
                    asyncio.to_thread(client.infer, {"input": rows(1)}, timeout=HANG_S)
                )
                done, _ = await asyncio.wait([call], timeout=HANG_S)
                answered_while_the_source_waited = bool(done) and not go.is_set()
                go.set()
                await call
                return answered_while_the_source_waited, await job
            finally:
                go.set()
                await asyncio.to_thread(client.close)

    answered, results = asyncio.run(scenario())
    assert answered, "the other thread's call waited for the source"
    assert [result.index for result in results] == [0, 1]
    assert [int(result.unwrap()["output"].shape[0]) for result in results] == [2, 2]


def test_a_plain_source_that_fails_ends_the_sync_stream_with_its_error(small_model: Path) -> None:
    """Read on its own thread, the source's failure still ends the job, as it is."""

    def source() -> Iterator[dict[str, F32]]:
        yield {"input": rows(1)}
        raise OSError("the database went away")

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:

            def job() -> None:
                with lc.Client(s.target) as client:
                    list(client.stream(source()))

            with pytest.raises(OSError, match="the database went away"):
                await asyncio.to_thread(job)

    asyncio.run(scenario())


# ---- a stream left to the garbage collector -------------------------------------------------


def test_a_stream_collected_on_the_clients_own_thread_is_closed_without_waiting_for_itself(
    small_model: Path,
) -> None:
    """A partly read stream left in a reference cycle is freed by the collector on
    whichever thread allocates, the client's own included: its close waited there for
    that very thread, and the client hung for good. The close runs next on the loop
    instead: the job's call ends, and the client serves on."""

    def left_then_collected_on_the_loop(target: str) -> list[str]:
        calls = EndedCalls()
        client = lc.Client(target, interceptors=[calls])
        freed_on: list[str] = []
        gc.disable()  # the collection runs where the test says
        try:
            left_in_a_cycle(client.stream([{"input": rows(2)} for _ in range(10)]), freed_on)
            asyncio.run_coroutine_threadsafe(collect_garbage(), client._loop).result(HANG_S)
        finally:
            gc.enable()
        assert calls.ended.acquire(timeout=HANG_S), "the job's call ended"
        client.infer({"input": rows(1)}, timeout=HANG_S)
        client.close()
        return freed_on

    async def scenario() -> list[str]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(left_then_collected_on_the_loop, s.target)

    assert asyncio.run(scenario()) == ["laneserve-client"], "collected on the loop thread"


def test_a_stream_collected_in_a_cycle_is_closed_once(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Collected in a reference cycle, a partly read stream's iterator and its job are
    finalized together: asyncio's own finalizer closed the job, and so did the
    iterator's close; in one collection in four or so, one of the two closes failed with
    "aclose(): asynchronous generator is already running" (printed, ignored). Each job's
    call ends, and nothing is printed."""
    unraisable: list[str] = []
    monkeypatch.setattr(
        sys, "unraisablehook", lambda hooked: unraisable.append(repr(hooked.exc_value))
    )
    jobs = 20

    def left_then_collected(target: str) -> list[str]:
        calls = EndedCalls()
        freed_on: list[str] = []
        with lc.Client(target, interceptors=[calls]) as client:
            gc.disable()  # the collection runs where the test says
            try:
                for _ in range(jobs):
                    left_in_a_cycle(client.stream([{"input": rows(2)}] * 10), freed_on)
                    gc.collect()
            finally:
                gc.enable()
            for _ in range(jobs):
                assert calls.ended.acquire(timeout=HANG_S), "every job's call ended"
        return freed_on

    async def scenario() -> list[str]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(left_then_collected, s.target)

    assert len(asyncio.run(scenario())) == jobs, "each job was collected"
    assert unraisable == []


def test_a_call_made_on_the_clients_own_thread_is_refused_not_left_waiting_for_itself(
    small_model: Path,
) -> None:
    """A sync stream's async source is read on the client's loop thread; a call of the
    same client made there waited for that very thread, and the job with it, for ever.
    It is a RuntimeError saying so, which ends the job as a source's failure does."""
    failed: list[BaseException] = []

    def job(target: str) -> None:
        with lc.Client(target) as client:

            async def source() -> AsyncIterator[dict[str, F32]]:
                client.infer({"input": rows(1)}, timeout=HANG_S)
                yield {"input": rows(1)}

            try:
                list(client.stream(source()))
            except RuntimeError as error:
                failed.append(error)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            # Not a pool's thread: one waiting for ever would hold up the test's end.
            thread = threading.Thread(target=job, args=(s.target,), daemon=True)
            thread.start()
            await asyncio.to_thread(thread.join, HANG_S)
            assert not thread.is_alive(), "the job waited for ever"

    asyncio.run(scenario())
    assert len(failed) == 1
    assert "call was made on the client's own thread" in str(failed[0])


# ---- a client never closed ------------------------------------------------------------------


def test_a_client_collected_unclosed_warns_and_stops_its_thread(small_model: Path) -> None:
    """A Client dropped without close(): a ResourceWarning names it, as for an unclosed
    file, and its thread ends. (Its thread, loop and channel lived on: one thread per
    client ever made.) Nothing of the client's own keeps it alive."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:

            def used_and_dropped() -> tuple[weakref.ref[lc.Client], threading.Thread]:
                client = lc.Client(s.target)
                client.infer({"input": rows(1)}, timeout=HANG_S)
                collected, thread = weakref.ref(client), client._thread
                del client
                gc.collect()
                return collected, thread

            with pytest.warns(ResourceWarning, match=f"unclosed laneserve Client to '{s.target}'"):
                collected, thread = await asyncio.to_thread(used_and_dropped)
            assert collected() is None, "nothing kept the client alive"
            await asyncio.to_thread(thread.join, HANG_S)
            assert not thread.is_alive(), "its thread ended"

    asyncio.run(scenario())


def test_a_client_collected_on_its_own_thread_stops_it_without_waiting_for_itself() -> None:
    """The last reference goes on the client's own loop thread: the finalizer there
    stops the loop once it returns, rather than joining its own thread."""
    holder = [lc.Client(f"127.0.0.1:{refusing_port()}")]
    loop, thread = holder[0]._loop, holder[0]._thread

    async def drop() -> None:
        holder.clear()

    with pytest.warns(ResourceWarning, match="unclosed laneserve Client"):
        asyncio.run_coroutine_threadsafe(drop(), loop).result(HANG_S)
    thread.join(HANG_S)
    assert not thread.is_alive()
    assert loop.is_closed()


# ---- a client and the process it serves (fork) ---------------------------------------------

# Run with the server's target in a process of its own (the test process never forks: gRPC's
# threads are running in it). A Client is made; a child forked from the process
# (multiprocessing's fork start method, as gunicorn --preload or a Pool's workers) calls it,
# closes it, and exits; the parent uses it, and a second child does the same; the parent
# uses it again.
# The scripts' fork: `child(label)` in a child process (multiprocessing's fork start
# method), killed if it has not ended within HANG_S; prints how it ended.
FORK_CHILD = f"""
def fork(label):
    process = multiprocessing.get_context("fork").Process(target=child, args=(label,))
    process.start()
    process.join({HANG_S})
    if process.is_alive():
        process.kill()
        process.join()
        print(f"{{label}}: hung", flush=True)
    print(f"{{label}}: exit code {{process.exitcode}}", flush=True)
"""

FORKED_CLIENT = f"""
import multiprocessing, sys
import numpy as np
from laneserve.client import Client

ROWS = {{"input": np.zeros((1, 512), np.float32)}}
client = Client(sys.argv[1])

def child(label):
    try:
        client.infer(ROWS, timeout=2)
        print(f"{{label}}: answered", flush=True)
    except RuntimeError as error:
        print(f"{{label}}: RuntimeError: {{error}}", flush=True)
    client.close()
    print(f"{{label}}: closed", flush=True)

{FORK_CHILD}
fork("child of an unused client")
print("parent:", client.infer(ROWS, timeout=5)["output"].shape, flush=True)
fork("child of a used client")
print("parent again:", client.infer(ROWS, timeout=5)["output"].shape, flush=True)
client.close()
"""

# The same for an AsyncClient, made at import with no loop running (a module-level client):
# first used in a forked child (its channel opens there), then used in the parent, then by
# a second child.
FORKED_ASYNC_CLIENT = f"""
import asyncio, multiprocessing, sys
import numpy as np
from laneserve.client import AsyncClient

ROWS = {{"input": np.zeros((1, 512), np.float32)}}
client = AsyncClient(sys.argv[1])

def child(label):
    try:
        asyncio.run(client.infer(ROWS, timeout=5))
        print(f"{{label}}: answered", flush=True)
    except RuntimeError as error:
        print(f"{{label}}: RuntimeError: {{error}}", flush=True)
    asyncio.run(client.close())
    print(f"{{label}}: closed", flush=True)

{FORK_CHILD}
async def parent():
    print("parent:", (await client.infer(ROWS, timeout=5))["output"].shape, flush=True)
    fork("child of a used client")
    print("parent again:", (await client.infer(ROWS, timeout=5))["output"].shape, flush=True)
    await client.close()

fork("child of an unused client")
asyncio.run(parent())
"""


# Both clients made at import and used by the parent (a warm-up call before the workers
# fork); a forked child follows "create clients after the fork": it replaces the
# AsyncClient with one of its own and drops the Client, making no call, and exits.
FORKED_CLIENTS_REPLACED = f"""
import asyncio, gc, multiprocessing, sys
from laneserve.client import AsyncClient, Client

async_client = AsyncClient(sys.argv[1])
sync_client = Client(sys.argv[1])

def child():
    global async_client, sync_client
    async_client = AsyncClient(sys.argv[1])
    sync_client = None
    gc.collect()
    print("child: replaced", flush=True)

asyncio.run(async_client.model(timeout=5))
sync_client.model(timeout=5)
process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join({HANG_S})
if process.is_alive():
    process.kill()
    process.join()
    print("child: hung", flush=True)
print(f"child: exit code {{process.exitcode}}", flush=True)
sync_client.close()
asyncio.run(async_client.close())
"""


# A fork while another thread of the parent holds the client's lock (opening its first
# channel): the child, which runs no such thread, makes its own first call and closes.
FORKED_DURING_AN_OPEN = f"""
import asyncio, multiprocessing, sys, threading
from laneserve.client import AsyncClient

client = AsyncClient(sys.argv[1])

def child():
    lanes = asyncio.run(client.model(timeout=5)).lanes
    print("child:", [lane.name for lane in lanes][:1], flush=True)
    asyncio.run(client.close())
    print("child: closed", flush=True)

held, release = threading.Event(), threading.Event()

def opening():
    with client._lock:  # as `_open_here` holds it while it opens the channel
        held.set()
        release.wait()

thread = threading.Thread(target=opening)
thread.start()
held.wait()
process = multiprocessing.get_context("fork").Process(target=child)
process.start()
release.set()
thread.join()
process.join({HANG_S})
if process.is_alive():
    process.kill()
    process.join()
    print("child: hung", flush=True)
print(f"child: exit code {{process.exitcode}}", flush=True)
"""


def run_script(script: str, target: str) -> list[str]:
    """`script` run by this Python with `target` as its argument: its stdout's lines."""
    done = run_text([sys.executable, "-c", script, target], timeout_s=3 * HANG_S, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_client_used_in_a_child_forked_after_it_was_made_is_refused_at_once(
    small_model: Path,
) -> None:
    """gunicorn --preload, a fork Pool, Celery's prefork workers: the child's
    `infer(timeout=2)` waited for ever (its future on a loop no thread runs there), and
    so did its close(). The call is refused at once, saying why and what to do; close()
    returns at once; the child exits cleanly, and the parent's client goes on. Once the
    parent has made calls, a client made in the child may hang or abort too: the refusal
    leads with 'spawn' or 'forkserver' then, not with a client made after the fork."""

    async def scenario() -> list[str]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(run_script, FORKED_CLIENT, s.target)

    lines = asyncio.run(scenario())
    unused, used = (line for line in lines if ": RuntimeError: " in line)
    for refused in (unused, used):
        assert "this laneserve Client was made in process" in refused, lines
        assert "a child forked from it" in refused
        assert "'spawn' or 'forkserver'" in refused
    assert unused.startswith("child of an unused client: RuntimeError")
    assert "Expected a client created after the fork, in the process that uses it" in unused
    assert "had made gRPC calls" not in unused
    assert used.startswith("child of a used client: RuntimeError")
    assert (
        "had made gRPC calls before the fork, so a client created in this child may hang "
        "too (its timeout ignored) or abort. Expected worker processes started with "
        "multiprocessing's 'spawn' or 'forkserver' method" in used
    )
    assert [line for line in lines if ": RuntimeError: " not in line] == [
        "child of an unused client: closed",
        "child of an unused client: exit code 0",
        "parent: (1, 10)",
        "child of a used client: closed",
        "child of a used client: exit code 0",
        "parent again: (1, 10)",
    ]


def test_a_child_replacing_the_parents_used_clients_exits_cleanly(small_model: Path) -> None:
    """A child forked after the parent's warm-up call that replaces its AsyncClient with
    its own and drops its Client (what "create clients after the fork" asks) crashed
    (SIGSEGV) or hung: gRPC's channel, deallocated in the child. The parent's channels
    are kept in the child, never freed there; it exits cleanly."""

    async def scenario() -> list[str]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(run_script, FORKED_CLIENTS_REPLACED, s.target)

    assert asyncio.run(scenario()) == ["child: replaced", "child: exit code 0"]


def test_a_child_forked_while_the_parent_opened_the_channel_makes_its_own(
    small_model: Path,
) -> None:
    """Forked while another thread held the client's lock (opening its first channel),
    the child found it held for good: its first call and its close() blocked, their
    timeouts ignored. A child takes a lock of its own; it opens its own channel."""

    async def scenario() -> list[str]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(run_script, FORKED_DURING_AN_OPEN, s.target)

    lines = asyncio.run(scenario())
    assert lines[1:] == ["child: closed", "child: exit code 0"], lines
    assert lines[0].startswith("child: ["), lines


def test_an_async_client_first_used_after_a_fork_serves_that_process_alone(
    small_model: Path,
) -> None:
    """An AsyncClient made before a fork and not yet used opens its channel in the child
    that first uses it, and answers there (a module-level client under gunicorn
    --preload). One whose channel the parent opened is refused in a child at once, as a
    Client is, and its close() there leaves the parent's channel alone."""

    async def scenario() -> list[str]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(run_script, FORKED_ASYNC_CLIENT, s.target)

    lines = asyncio.run(scenario())
    assert lines[:4] == [
        "child of an unused client: answered",
        "child of an unused client: closed",
        "child of an unused client: exit code 0",
        "parent: (1, 10)",
    ], lines
    assert lines[4].startswith(
        "child of a used client: RuntimeError: the channel of this laneserve AsyncClient "
        "was made in process"
    ), lines
    assert "may hang too (its timeout ignored) or abort. Expected worker processes" in lines[4]
    assert "'spawn' or 'forkserver'" in lines[4]
    assert lines[5:] == [
        "child of a used client: closed",
        "child of a used client: exit code 0",
        "parent again: (1, 10)",
    ]


# ---- an AsyncClient and the event loop it serves -------------------------------------------


def test_an_async_client_made_with_no_loop_serves_the_loop_of_its_first_call(
    small_model: Path,
) -> None:
    """Made where no loop runs (at import: FastAPI's module-level client), the channel
    bound to a loop never run (or, with none set, the client was refused), and each call
    from the app's loop failed with gRPC's "attached to a different loop". It opens at
    the first call, on that call's loop. Closed from any loop once its own has ended; a
    closed client opens no channel on a later loop."""

    def at_import_then_closed_later(target: str) -> Any:
        # A pool's thread: no event loop in it, as at a module's import.
        client = lc.AsyncClient(target)
        answer = asyncio.run(client.infer({"input": rows(2)}, timeout=HANG_S))
        first = client._opened
        asyncio.run(client.close())
        with pytest.raises(lc.ClientClosedError):
            asyncio.run(client.model(timeout=HANG_S))
        with pytest.raises(lc.ClientClosedError):
            asyncio.run(anext(client.stream({"input": rows(2)})))
        assert client._opened is first
        return answer["output"].shape

    async def scenario() -> Any:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(at_import_then_closed_later, s.target)

    assert asyncio.run(scenario()) == (2, 10)


def test_an_async_client_serves_a_new_loop_once_its_own_is_closed(
    small_model: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """pytest-asyncio's loop per test, Starlette's TestClient, asyncio.run twice: a client
    first used on a loop since closed was refused on every later loop, for good. While
    its loop is open (idle, not closed) another loop's call is still refused; once it is
    closed, the next call opens a new channel on its own loop (calls and streams), and
    the old channel is dropped quietly: no warning, nothing printed (gRPC's "Event loop
    is closed" callback tracebacks), not kept."""

    def on_three_loops(target: str) -> list[int]:
        client = lc.AsyncClient(target)
        first = asyncio.new_event_loop()
        first.run_until_complete(client.infer({"input": rows(1)}, timeout=HANG_S))
        with pytest.raises(RuntimeError, match=r"first used on \(still open"):
            asyncio.run(client.model(timeout=HANG_S))
        first.close()
        old = weakref.ref(client._opened.channel) if client._opened else None

        async def answers() -> int:
            reply = await client.infer({"input": rows(2)}, timeout=HANG_S)
            results = [result async for result in client.stream({"input": rows(4)})]
            assert all(result.error is None for result in results)
            return int(reply["output"].shape[0]) + len(results)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            counts = [asyncio.run(answers()), asyncio.run(answers())]
            gc.collect()
        assert not [warning.message for warning in caught]
        assert old is not None
        assert old() is None
        asyncio.run(client.close())
        return counts

    async def scenario() -> list[int]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            return await asyncio.to_thread(on_three_loops, s.target)

    assert asyncio.run(scenario()) == [3, 3]
    assert "Event loop is closed" not in capfd.readouterr().err
    assert not [record for record in caplog.records if record.name == "asyncio"]


def test_an_async_client_retries_on_each_loop_it_serves_in_turn() -> None:
    """A retry's backoff waits on the client's closed event, which binds to the loop of
    its first wait: on the next loop the client served, a retried call failed with "is
    bound to a different event loop". Each loop's calls wait on one of their own."""
    lc.set_testing(False)  # a backoff of no wait at all binds nothing: a real one, 1 ms
    policy = lc.RetryPolicy(max_attempts=2, initial_backoff_s=0.001, max_backoff_s=0.001)
    client = lc.AsyncClient(f"127.0.0.1:{refusing_port()}", retry=policy)
    for _ in range(2):
        with pytest.raises(lc.UnavailableError) as failed:
            asyncio.run(client.model(timeout=HANG_S))
        assert failed.value.attempts == 2
    asyncio.run(client.close())


def test_loops_making_their_first_calls_at_once_open_one_channel(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module-level client first used by several threads' loops at once: each saw no
    channel and opened its own, all but the last leaked, and the later calls of all but
    one loop failed. One loop's first call opens the channel; the others' calls are
    refused (its loop still runs), the first and the later ones."""
    loops = 8
    # The first channel's opening is held until every loop's first call has come to the
    # client's lock (or, with none, to an opening of its own): the race, made certain.
    changed = threading.Condition()
    come: set[int] = set()
    opened: list[grpc.aio.Channel] = []
    real_open = lc._channel.open_channel

    def arrived() -> None:
        with changed:
            come.add(threading.get_ident())
            changed.notify_all()

    def held_open(spec: Any) -> grpc.aio.Channel:
        arrived()
        with changed:
            assert changed.wait_for(lambda: len(come) == loops, HANG_S)
        channel = real_open(spec)
        opened.append(channel)
        return channel

    monkeypatch.setattr(lc._aio, "open_channel", held_open)
    both = threading.Barrier(loops, timeout=HANG_S)

    def one_loop(client: lc.AsyncClient) -> tuple[str, ...]:
        async def twice() -> tuple[str, ...]:
            outcomes = []
            for _ in range(2):
                try:
                    await client.model(timeout=HANG_S)
                    outcomes.append("answered")
                except RuntimeError:
                    outcomes.append("refused")
                both.wait()  # every loop stays open until all have called
            return tuple(outcomes)

        return asyncio.run(twice())

    async def scenario() -> list[tuple[str, ...]]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            client = lc.AsyncClient(s.target)
            monkeypatch.setattr(client, "_lock", ArrivalsLock(arrived), raising=False)
            with concurrent.futures.ThreadPoolExecutor(loops) as pool:
                futures = [pool.submit(one_loop, client) for _ in range(loops)]
                outcomes = [await asyncio.wrap_future(future) for future in futures]
            await client.close()  # from any loop: the one it served is closed
            return outcomes

    outcomes = asyncio.run(scenario())
    assert len(opened) == 1
    assert sorted(outcomes) == [("answered", "answered")] + [("refused", "refused")] * 7


def test_an_async_client_refuses_calls_and_close_from_another_loop_while_its_own_runs(
    small_model: Path,
) -> None:
    """Used on one loop, called from another thread's loop meanwhile: gRPC's "attached to
    a different loop". Each call, a stream, and close() are refused there, naming the
    rule, and the client goes on answering on its own loop."""

    def from_another_loop(client: lc.AsyncClient) -> list[str]:
        async def infer() -> None:
            await client.infer({"input": rows(1)}, timeout=HANG_S)

        async def stream() -> None:
            client.stream({"input": rows(2)})

        refused = []
        for call in (infer, stream, client.close):
            with pytest.raises(RuntimeError) as error:
                asyncio.run(call())
            refused.append(str(error.value))
        # And outside any loop: stream() is called in a coroutine on the client's loop.
        with pytest.raises(RuntimeError, match=r"AsyncClient.stream\(\) was called with no"):
            client.stream({"input": rows(2)})
        return refused

    async def scenario() -> list[str]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            async with lc.AsyncClient(s.target) as client:
                await client.model(timeout=HANG_S)
                refused = await asyncio.to_thread(from_another_loop, client)
                answer = await client.infer({"input": rows(1)}, timeout=HANG_S)
                assert answer["output"].shape == (1, 10)
            return refused

    refused = asyncio.run(scenario())
    assert [message.split(", and ")[1].split(" was made")[0] for message in refused] == [
        "a call",
        "stream()",
        "close()",
    ]
    assert all("first used on (still open" in message for message in refused)


def test_an_async_client_closed_before_any_call_opens_no_channel() -> None:
    """close() before the first call: there is no channel to close, and no call opens one."""
    client = lc.AsyncClient(f"127.0.0.1:{refusing_port()}")
    asyncio.run(client.close())
    with pytest.raises(lc.ClientClosedError):
        asyncio.run(client.infer({"input": rows(1)}, timeout=HANG_S))
    assert client._opened is None


@pytest.mark.parametrize(
    ("arguments", "error", "words"),
    [
        ({"target": "127.0.0.1:0"}, ValueError, "port '0' is out of range"),
        ({"options": [("grpc.enable_retries", None)]}, TypeError, "'grpc.enable_retries'"),
        ({"options": [("grpc.enable_retries", 2**31)]}, ValueError, "out of gRPC's range"),
        ({"interceptors": [object()]}, TypeError, r"interceptors\[0\]"),
        # PEM text, not bytes: gRPC's credentials refuse it.
        ({"tls": lc.TlsConfig(root_certificates=cast(bytes, "PEM"))}, TypeError, "bytes"),
    ],
)
def test_an_async_client_made_with_no_loop_checks_its_arguments_at_once(
    arguments: dict[str, Any], error: type[Exception], words: str
) -> None:
    """The channel opens at the first call; what gRPC would refuse then is refused as the
    client is made, naming the argument (gRPC's interceptor check said ValueError)."""
    arguments = {"target": "127.0.0.1:50051", **arguments}
    with pytest.raises(error, match=words):
        lc.AsyncClient(**arguments)
    with pytest.raises(error, match=words):
        lc.Client(**arguments)


# ---- helpers ---------------------------------------------------------------------------


class ArrivalsLock:
    """A threading.Lock that calls `arrived` as a thread comes to take it (before it waits
    for it)."""

    def __init__(self, arrived: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._arrived = arrived

    def __enter__(self) -> bool:
        self._arrived()
        return self._lock.acquire()

    def __exit__(self, *_exc: object) -> None:
        self._lock.release()


def left_in_a_cycle(results: Iterator[lc.StreamResult], freed_on: list[str]) -> None:
    """Reads the first of `results`, then leaves them in a reference cycle, which only
    the garbage collector frees; `freed_on` gets the name of the thread it does it on."""
    next(results)
    cycle: list[object] = [results]
    cycle.append(cycle)
    weakref.finalize(results, lambda: freed_on.append(threading.current_thread().name))


class WaitWatched(threading.Event):
    """A threading.Event that sets `waiting` as a wait on it begins."""

    def __init__(self, waiting: threading.Event) -> None:
        super().__init__()
        self.waiting = waiting

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


async def collect_garbage() -> None:
    gc.collect()


class EndedCalls(grpc.aio.StreamStreamClientInterceptor):
    """Releases `ended` once for each stream call that ends, however it ends."""

    def __init__(self) -> None:
        self.ended = threading.Semaphore(0)

    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        call = await continuation(client_call_details, request_iterator)
        call.add_done_callback(lambda _call: self.ended.release())
        return call


def resuming(caplog: pytest.LogCaptureFixture) -> bool:
    """Whether a bulk stream has logged that it waits to open its next call."""
    return any("call broke" in record.getMessage() for record in caplog.records)


def test_a_first_close_on_the_clients_own_thread_is_refused_and_leaves_the_client_usable(
    small_model: Path,
) -> None:
    """close() made on the client's own thread (from an async stream source, say) stopped
    the loop and then failed to join its own thread: the channel was never closed and
    the RuntimeError named the join. It is refused before anything changes: a clear
    RuntimeError, and the client still answers and closes from another thread."""
    refused: list[BaseException] = []

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            client = await asyncio.to_thread(lc.Client, s.target)

            async def close_there() -> None:
                try:
                    client.close()
                except RuntimeError as error:
                    refused.append(error)

            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(close_there(), client._loop))
            answer = await asyncio.to_thread(client.infer, {"input": rows(1)}, timeout=HANG_S)
            assert answer["output"].shape[0] == 1
            await asyncio.to_thread(client.close)
            assert not client._thread.is_alive()

    asyncio.run(scenario())
    assert len(refused) == 1
    assert "Client close() was made on the client's own thread" in str(refused[0])
