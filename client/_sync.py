"""`Client`: the blocking client. It runs an `AsyncClient` on an event loop of its own,
in one thread, so both clients share one implementation of retries and bulk streams."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import gc
import os
import queue
import threading
import types
import warnings
import weakref
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    Coroutine,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Final, TypeVar, cast

import grpc
import numpy.typing as npt

from laneserve.client._aio import (
    AsyncClient,
    MetadataLike,
    Outputs,
    TlsLike,
    answer_of,
)
from laneserve.client._channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TARGET,
    forked_message,
)
from laneserve.client._errors import ClientClosedError, closed_before_sending
from laneserve.client._retry import RetryBudget, RetryPolicy
from laneserve.client._stream import (
    DEFAULT_STREAM_LANE,
    StreamItem,
    StreamSource,
    check_source,
)
from laneserve.client._types import InferAnswer, ModelInfo, StreamResult
from laneserve.v1 import inference_pb2 as pb

__all__ = ["Client"]

T = TypeVar("T")
# How long close() waits for other threads' calls to end once the channel is closed
# (they end at once: cancelled on the wire, or woken from their retry backoff).
CLOSE_WAIT_S = 5.0
# The name of the thread of a stream's own that reads the items of a plain iterable.
SOURCE_THREAD: Final = "laneserve-client-source"
# How long the main thread waits on the loop at a time (`_result`) before it looks for a
# signal whose handler is due: one that arrives as the wait begins is not taken until
# the wait ends.
SIGNAL_CHECK_S: Final = 0.05


class Client:
    """A blocking laneserve client; safe to share between threads.

    Example::

        with Client("127.0.0.1:50051") as client:
            scores = client.infer({"input": rows}, timeout=0.5)["output"]
            for result in client.stream({"input": many_rows}, rows_per_item=64):
                ...

    The methods mirror `AsyncClient`'s (see there), its `timeout` (the default of the
    unary calls) too. One thread named
    ``laneserve-client`` runs the calls; `close()` (or leaving the ``with`` block) stops
    it. The items of a `stream()` from a plain iterable are read on a thread of that
    stream's own (``laneserve-client-source``), one at a time and in order, as the job's
    window allows: a slow source (a database, a file on a slow disk) holds up its own
    job, never the calls other threads make meanwhile.

    A client serves the process that made it: in a child forked from that process
    (gunicorn ``--preload``, multiprocessing's ``fork`` start method) its thread is gone,
    and every call is refused (RuntimeError) and `close()` returns at once; dropping it
    there is safe. Start workers with ``spawn`` or ``forkserver``, or fork them before
    the process makes any call and make their clients after the fork: once a process has
    made gRPC calls, a client made in a child forked from it may hang (its timeout
    ignored) or abort.
    """

    def __init__(  # noqa: PLR0913 - keyword-only settings of one client, each with a default
        self,
        target: str = DEFAULT_TARGET,
        *,
        tls: TlsLike = None,
        metadata: MetadataLike | None = None,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
        retry_budget: RetryBudget | None = None,
        timeout: float | None = None,
    ) -> None:
        # Checks every argument, and opens nothing: its channel opens at the first call,
        # on the client's loop, the one it serves from then on.
        self._client = AsyncClient(
            target,
            tls=tls,
            metadata=metadata,
            retry=retry,
            max_message_bytes=max_message_bytes,
            options=options,
            interceptors=interceptors,
            retry_budget=retry_budget,
            timeout=timeout,
        )
        # The process the client's thread runs in. A child forked from it has the
        # client, but neither its thread nor gRPC's state: there every call waited for
        # ever on the loop no thread runs, and so did close().
        self._pid = os.getpid()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=_serve, args=(self._loop,), name="laneserve-client", daemon=True
        )
        self._thread.start()
        # Set by close(), under the lock: from then on no other call reaches the loop.
        self._closed = False
        # Set once the close that set `_closed` has ended, however it ended: the other
        # close() calls wait for it, so that none returns with the channel still open.
        self._close_done = threading.Event()
        # Calls in progress, from any thread: close() waits for them to end. Each is
        # handed to the loop and recorded here in one step under the lock.
        self._running: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        # Closes of streams collected on the loop thread, running there. Only the loop
        # thread touches it; it keeps the tasks alive (the loop holds them weakly).
        self._closing: set[asyncio.Task[None]] = set()
        # A client collected unclosed closes its channel and stops its thread (they
        # leaked: a thread per client). What the finalizer holds (the loop, the thread,
        # the AsyncClient) refers to nothing that refers to this Client, so it does not
        # keep it alive. Not run at interpreter exit: the thread is a daemon.
        self._finalizer = weakref.finalize(
            self, _close_unclosed, self._loop, self._thread, self._client, self._pid
        )
        self._finalizer.atexit = False

    @property
    def target(self) -> str:
        return self._client.target

    @property
    def timeout(self) -> float | None:
        """Seconds: the timeout of a unary call made without one (None: no default)."""
        return self._client.timeout

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel and stops the client's thread; calls other threads have in
        progress end with ClientClosedError. Safe to call twice, and from several threads
        at once: each returns once the client is closed (but on the client's own thread,
        which that close waits for: there a first close() is refused, RuntimeError, and a
        later one returns at once). In a child forked from the client's process it returns
        at once: the channel and the thread are the parent's."""
        if not self._in_own_process():
            # Before the lock: another thread may have held it at the fork, for good here.
            return
        on_own_thread = threading.current_thread() is self._thread
        with self._lock:
            closed_before = self._closed
            if on_own_thread and not closed_before:
                # Closing waits for this very thread to stop: refused before anything
                # changes, so the client stays usable and closable from another thread.
                # (It stopped the loop, then failed to join itself: the channel was never
                # closed and the RuntimeError named the join, not the call.)
                raise RuntimeError(_OWN_THREAD.format(call="close()"))
            # Other threads' calls are refused from here (ClientClosedError): one handed
            # to the loop after the wait below read `_running` waited forever on the
            # stopped loop.
            self._closed = True
        if closed_before:
            # Another close() is under way, or done: wait for it, except on the client's
            # own thread, which that close waits for (waiting there would hang both).
            if not on_own_thread:
                # In turns on the main thread, as `_result` waits: a signal's handler runs.
                while not self._close_done.wait(SIGNAL_CHECK_S):
                    pass
            return
        self._finalizer.detach()
        try:
            self._run(self._client.close(), closing=True)
            # The calls still running end now (ClientClosedError); wait for them, so
            # that none is left on a stopped loop with its caller waiting forever.
            with self._lock:
                running = list(self._running)
            concurrent.futures.wait(running, timeout=CLOSE_WAIT_S)
            for future in running:
                future.cancel()  # still running after the wait: its caller gets that
            self._run(self._loop.shutdown_asyncgens(), closing=True)  # streams left open
        finally:
            try:
                self._stop_loop()
            finally:
                self._close_done.set()  # a close that failed must not hang the others

    def infer(
        self,
        inputs: Mapping[str, npt.NDArray[Any]],
        *,
        lane: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        outputs: Sequence[str] | None = None,
        retry: RetryPolicy | None = None,
    ) -> Outputs:
        """See `AsyncClient.infer`. The request is built on the calling thread (on the
        client's one thread, a large request held up every other thread's calls past
        their timeouts, a review), and the call's timeout counts from this call."""
        return self.infer_detailed(
            inputs, lane=lane, timeout=timeout, request_id=request_id, outputs=outputs, retry=retry
        ).outputs

    def infer_detailed(
        self,
        inputs: Mapping[str, npt.NDArray[Any]],
        *,
        lane: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        outputs: Sequence[str] | None = None,
        retry: RetryPolicy | None = None,
    ) -> InferAnswer:
        """See `AsyncClient.infer_detailed`; built and decoded on the calling thread."""
        # AsyncClient's call up to sending, on this thread: this class is its sync facade.
        sending = self._client._infer_call(  # noqa: SLF001
            inputs, lane, timeout, request_id, outputs, retry
        )
        return answer_of(self._run(sending))

    def model(self, *, timeout: float | None = None) -> ModelInfo:
        """See `AsyncClient.model`."""
        return self._run(self._client.model(timeout=timeout))

    def stats(self, *, timeout: float | None = None) -> pb.GetStatsResponse:
        """See `AsyncClient.stats`."""
        return self._run(self._client.stats(timeout=timeout))

    def stream(  # noqa: PLR0913 - keyword-only options of one call, each with a default
        self,
        requests: StreamSource,
        *,
        lane: str = DEFAULT_STREAM_LANE,
        window: int = 256,
        timeout_ms: int = 0,
        ordered: bool = True,
        outputs: Sequence[str] | None = None,
        job_id: str | None = None,
        rows_per_item: int = 64,
        window_rows: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> Generator[StreamResult, None, None]:
        """See `AsyncClient.stream`. Leaving the iteration early (``break``, an
        exception) cancels the job's call (the server frees its queued items) and stops
        reading `requests` only once the generator is closed:
        ``with contextlib.closing(client.stream(...)) as results:``, or
        ``results.close()``. One that nothing refers to any more is closed by garbage
        collection; one still referenced runs on until then."""
        check_source(requests)  # before a thread is made to read it
        source = requests
        reader: AsyncGenerator[StreamItem, None] | None = None
        if not isinstance(requests, Mapping | AsyncIterable | Sequence):
            # Not on the client's loop: it runs every thread's calls. A list or a tuple
            # never blocks, and is read there without a thread's hand-off per item.
            source = reader = _read_off_loop(iter(requests))

        async def start() -> AsyncGenerator[StreamResult, None]:
            return self._client.stream(
                source,
                lane=lane,
                window=window,
                timeout_ms=timeout_ms,
                ordered=ordered,
                outputs=outputs,
                job_id=job_id,
                rows_per_item=rows_per_item,
                window_rows=window_rows,
                retry=retry,
            )

        results = self._run(start())
        return self._iterate(results, reader)

    def _iterate(
        self,
        results: AsyncGenerator[StreamResult, None],
        reader: AsyncGenerator[StreamItem, None] | None = None,
    ) -> Generator[StreamResult, None, None]:
        """`results` on the caller's thread; closed with them, `reader` (the source's, this
        client's own) is closed too: left to the garbage collector, its thread and the
        caller's generator lived on after a `break` until a collection ran."""
        # The task running the latest step: closing must wait for it, as an async
        # generator cannot be closed while it runs.
        steps: list[asyncio.Task[Any]] = []

        async def step() -> StreamResult:
            task = asyncio.current_task()
            assert task is not None
            steps[:] = [task]
            return await anext(results)

        async def close() -> None:
            running = [task for task in steps if not task.done()]
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running)
            # The results first: their job's end ends a read of `reader` in progress.
            for generator in (results, reader):
                if isinstance(generator, types.AsyncGeneratorType) and _ours_to_close(generator):
                    await generator.aclose()

        try:
            while True:
                try:
                    yield self._run(step())
                except StopAsyncIteration:
                    return
        finally:
            # In a child forked from the client's process the stream is the parent's:
            # nothing of it runs here (see _run).
            if self._in_own_process():
                self._close_stream(close())

    def _close_stream(self, closing: Coroutine[Any, Any, None]) -> None:
        """Runs a stream's `closing` on the loop, from the stream's caller or the collector."""
        if threading.current_thread() is self._thread:
            # Collected on the loop's own thread (the collector runs on whichever thread
            # allocates): waiting there for the loop would wait for ever.
            self._close_later(closing)
        else:
            # A client closing meanwhile closes the stream itself (shutdown_asyncgens).
            with contextlib.suppress(ClientClosedError):
                self._run(closing)

    def _close_later(self, closing: Coroutine[Any, Any, None]) -> None:
        """Runs `closing` (a stream's close) next on the loop, from the loop's thread."""
        if not self._loop.is_running():  # stopped: its streams were closed as it stopped
            closing.close()
            return

        def start() -> None:
            task = self._loop.create_task(closing)
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

        # Not created here: this may run inside a garbage collection, in the middle of
        # another callback (asyncio's own finalizer of async generators defers so too).
        self._loop.call_soon(start)

    def _run(self, coroutine: Coroutine[Any, Any, T], *, closing: bool = False) -> T:
        """Runs `coroutine` on the client's loop and returns its result; ClientClosedError
        once the client is closed (or closing: `closing` marks close()'s own steps)."""
        if not self._in_own_process():
            coroutine.close()
            raise RuntimeError(forked_message("this laneserve Client", self._pid))
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError(_OWN_THREAD.format(call="call"))
        # The coroutine runs on the client's loop thread, but in the caller's context:
        # its trace (and any other context variable) goes with the call.
        context = contextvars.copy_context()

        async def in_callers_context() -> T:
            return await asyncio.create_task(coroutine, context=context)

        with self._lock:
            if self._closed and not closing:
                coroutine.close()
                raise closed_before_sending()  # never handed to the loop: nothing sent
            future = asyncio.run_coroutine_threadsafe(in_callers_context(), self._loop)
            self._running.add(future)
        try:
            return _result(future)
        except concurrent.futures.CancelledError:
            if self._closed:  # close() cancelled it after its wait
                raise ClientClosedError from None
            raise
        except BaseException:
            # Interrupted while waiting (Ctrl-C, a signal handler's exception): the call
            # must not go on unseen. A no-op when the coroutine itself raised.
            future.cancel()
            raise
        finally:
            with self._lock:
                self._running.discard(future)

    def _in_own_process(self) -> bool:
        """False in a child forked from the process that made the client."""
        return os.getpid() == self._pid

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()  # the thread closes the loop as it ends (see _serve)


def _result(future: concurrent.futures.Future[T]) -> T:
    """`future`'s result, waited for. Python runs a signal's handler on the main thread
    between bytecodes: one whose signal arrived after the last such point and before
    the wait blocked ran only once the wait ended, and an untimed wait for a stream's
    next result from a server with nothing more to answer never ended (a bulk job's
    SIGTERM or Ctrl-C taken only by the next one). So the main thread waits
    SIGNAL_CHECK_S at a time, and a handler due runs at the latest then (its exception,
    KeyboardInterrupt say, raised here). Other threads run no handler: they wait once."""
    if threading.current_thread() is not threading.main_thread():
        return future.result()
    while True:
        try:
            return future.result(timeout=SIGNAL_CHECK_S)
        except TimeoutError:
            # The coroutine's own TimeoutError (its future done) is raised by the read
            # below; a wait that ran out is a turn of this loop.
            if future.done():
                return future.result()


_OWN_THREAD = (
    "a laneserve Client {call} was made on the client's own thread "
    "(laneserve-client: from an async stream source, say), where it would wait "
    "for itself for ever; expected a call from any other thread"
)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The client's thread: runs `loop` until stopped, then closes it. Closed here, so
    that a finalizer running on this very thread can stop the loop without joining."""
    try:
        loop.run_forever()
    finally:
        loop.close()


def _close_unclosed(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: AsyncClient, pid: int
) -> None:
    """A Client collected unclosed: its channel is closed and its thread stopped, and a
    ResourceWarning says so, as for an unclosed file. The warning first: made an error
    (``-W error``), it must not keep the rest from being freed. Nothing in a child forked
    from process `pid`: the client is the parent's to close."""
    if os.getpid() != pid:
        return
    try:
        warnings.warn(
            f"unclosed laneserve Client to {client.target!r}; call close() or use it in a "
            "with block",
            ResourceWarning,
            stacklevel=1,  # a collector's callback: no caller of the client's
        )
    finally:
        if thread.is_alive():

            async def close() -> None:
                try:
                    await client.close()
                    await loop.shutdown_asyncgens()
                finally:
                    loop.stop()

            asyncio.run_coroutine_threadsafe(close(), loop)
            # Collected on its own thread (a cycle the collector broke there), the loop
            # stops once this returns; joining it here would wait for ever.
            if threading.current_thread() is not thread:
                thread.join(CLOSE_WAIT_S)


def _ours_to_close(generator: types.AsyncGeneratorType[Any, Any]) -> bool:
    """Whether the stream's close must close the async `generator`: not when it runs (a
    close is in progress), nor when the collector has finalized it (collected in a cycle
    with the stream's iterator: asyncio's finalizer hook closes it). Closed twice, one
    close failed with "aclose(): asynchronous generator is already running"."""
    return not generator.ag_running and not gc.is_finalized(generator)


_END: Final = object()


async def _read_off_loop(items: Iterator[StreamItem]) -> AsyncGenerator[StreamItem, None]:
    """`items`, each read on a thread of their own when the stream asks for it."""
    source = _SourceThread(items, asyncio.get_running_loop())
    try:
        while (item := await source.read()) is not _END:
            # Whatever the source gave: the stream checks each item (and names a bad one).
            yield cast(StreamItem, item)
    finally:
        source.stop()


class _SourceThread:
    """Reads a plain iterable's items on a daemon thread, one per `read()`, in the
    context of the stream that started it (its trace). A source that blocks holds up
    its own stream, not the client's loop; and, should it block for good, not the
    interpreter's exit either (a pool's worker would: they are joined at exit)."""

    def __init__(self, items: Iterator[StreamItem], loop: asyncio.AbstractEventLoop) -> None:
        self._items = items
        self._loop = loop
        self._context = contextvars.copy_context()
        # A future per item wanted, set on the loop; None: the stream is over.
        self._wanted: queue.SimpleQueue[asyncio.Future[object] | None] = queue.SimpleQueue()
        # Clear while the thread is inside the source.
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._serve, name=SOURCE_THREAD, daemon=True)
        self._thread.start()

    async def read(self) -> object:
        """The next item, or _END. One read at a time (the stream reads in order)."""
        assert self._idle.is_set(), "one read at a time"
        wanted = self._loop.create_future()
        self._idle.clear()
        self._wanted.put(wanted)
        return await wanted

    def stop(self) -> None:
        """The thread ends: at once when idle (joined), else once the source returns (a
        read cancelled with its stream; its item is dropped)."""
        self._wanted.put(None)
        if self._idle.is_set():
            self._thread.join()

    def _serve(self) -> None:
        while (wanted := self._wanted.get()) is not None:
            try:
                item = self._context.run(_next_or_end, self._items)
            except BaseException as error:  # noqa: BLE001 - the source's, handed to the stream
                settle = functools.partial(_settle, wanted, None, error)
            else:
                settle = functools.partial(_settle, wanted, item, None)
            self._idle.set()
            try:
                self._loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is closed: nobody waits for the item
                return


def _next_or_end(items: Iterator[StreamItem]) -> object:
    return next(items, _END)


def _settle(wanted: asyncio.Future[object], item: object, error: BaseException | None) -> None:
    if wanted.done():  # cancelled with its stream
        return
    if error is None:
        wanted.set_result(item)
    else:
        wanted.set_exception(error)
