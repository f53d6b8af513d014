"""Requests and answers of many strings, decoded and encoded on a thread kept for them
(`TextThread`).

A STRING element is decoded into a Python `str` one by one (~0.3 us each,
`decode_strings`), and encoded back the same way (`encode_strings`): a 64 MiB request of
2-byte strings held the event loop, every other call with it, for 3 s. On a thread, the
work takes turns of the GIL with the loop (its switch interval, 5 ms) instead. Measured
(one run each way, twice, a 256-token string model): 1-row interactive calls beside
512 000-string bulk requests, p99 165-298 ms decoded on the loop, 46-60 ms on a thread;
at 48 000 strings no difference beyond the noise; at 12 000 the hand-offs cost more than
they saved: hence EVENT_LOOP_TEXT_ELEMENTS, for answers too. Numbers are never decoded
away: their bytes are used in place, in microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from laneserve.client.tensors import encode_strings
from laneserve.server.codec import decode_inputs
from laneserve.server.engine import TensorSpec
from laneserve.server.items import Array, Outcome, Signature
from laneserve.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

# The most STRING elements a request's inputs are decoded of, or a batch's answers encoded
# of, on the event loop (about 6 ms); more are by `TextThread` (see the module's note).
EVENT_LOOP_TEXT_ELEMENTS: Final = 20_000

# A request's decoded inputs by name, its rows and its batching signature (`decode_inputs`).
Decoded = tuple[dict[str, Array], int, Signature]


class TextThread:
    """The decodes of requests, and the encodes of a batch's answers, of more than
    EVENT_LOOP_TEXT_ELEMENTS strings, on one thread kept for them: not the loop's default
    executor, where the drain's `wait_drained` runs and a queue of decodes would hold it
    back; one for both, since each holds the GIL but for its switches, and each more
    thread would take turns from the event loop too.

    Invariants, which keep a request decoded here answered as one decoded on the loop:
    - a call with the `ledger_id` of a request being decoded waits for that decode
      (`after`) before the ledger is asked about it: the request read first reaches the
      ledger first (a retry joins it instead of decoding again; another request with its
      id, sent second, is the one refused), as when decoding took no await;
    - `_ongoing` counts the decodes in progress, `_idle` is set exactly when it is 0, and
      a decode's caller is woken before anything that waits for `_idle` (`wait_idle`):
      the drain waits for it before the scheduler stops admitting, and a request read
      before the drain is admitted in the step its decode ends in.
    And one for answers: a batch encoded here is handed to the loop whole, in one
    callback, as the router hands any batch; the stop waits for the batches given to the
    thread (`flushed`) before gRPC's stop would cancel their calls."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="laneserve-text")
        # Per ledger_id, the decode of the request with it in progress (set once it ends).
        self._by_id: dict[str, asyncio.Event] = {}
        self._ongoing = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._cut = asyncio.Event()  # `cut`: `wait_idle` returns at once

    def reading(self, ledger_id: str) -> bool:
        """Whether a request with `ledger_id` ("": none) is being decoded."""
        return ledger_id in self._by_id

    async def decode(
        self, ledger_id: str, tensors: Sequence[pb.Tensor], specs: Sequence[TensorSpec]
    ) -> Decoded:
        """`decode_inputs(tensors, specs)` on the thread; raises its refusal. A caller
        cancelled meanwhile leaves the thread to finish (a thread is not interrupted): its
        answer is dropped."""
        ended = asyncio.Event()
        if ledger_id:
            self._by_id[ledger_id] = ended
        self._ongoing += 1
        self._idle.clear()
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, decode_inputs, tensors, specs)
        finally:
            if self._by_id.get(ledger_id) is ended:
                del self._by_id[ledger_id]
            ended.set()
            self._ongoing -= 1
            if self._ongoing == 0:
                # Its waiters wake in a later step than this one, in which the caller goes
                # on to the scheduler without another await (`_infer`).
                self._idle.set()

    async def after(self, ledger_id: str, timeout_s: float) -> None:
        """Returns once no request with `ledger_id` is being decoded, or after
        `timeout_s`: at once, without yielding, where none is."""
        loop = asyncio.get_running_loop()
        until_s = loop.time() + timeout_s
        while (ended := self._by_id.get(ledger_id)) is not None:
            left_s = until_s - loop.time()
            if left_s <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), left_s)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no decode is in progress (True), `timeout_s` passed or `cut` was
        called (False)."""
        idle = asyncio.ensure_future(self._idle.wait())
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            await asyncio.wait((idle, cut), timeout=timeout_s, return_when="FIRST_COMPLETED")
        finally:
            idle.cancel()
            cut.cancel()
        return self._idle.is_set()

    def cut(self) -> None:
        """A drain stops waiting for decodes (the operator asked twice)."""
        self._cut.set()

    def encode_then(
        self, outcomes: Sequence[Outcome], resolve: Callable[[Sequence[Outcome]], None]
    ) -> bool:
        """Has the thread encode `outcomes`' text outputs (`text_encoded`), then call
        `resolve` with them there; False where it has stopped (nothing done: the caller
        resolves them as they are, encoded on the loop). Called from the scheduler thread."""
        try:
            self._executor.submit(_encode_then, outcomes, resolve)
        except RuntimeError:  # shut down
            return False
        return True

    async def flushed(self, timeout_s: float) -> None:
        """Returns once the work given to the thread before this call has ended, and the
        answers it encoded are handed to the loop (their `resolve` called: the loop runs
        their callbacks before this returns), or after `timeout_s`. The thread runs its
        work in order, so a no-op given now runs after all of it."""
        with contextlib.suppress(TimeoutError, RuntimeError):  # RuntimeError: shut down
            await asyncio.wait_for(
                asyncio.wrap_future(self._executor.submit(lambda: None)), timeout_s
            )

    def close(self) -> None:
        """The server stopped: the thread goes once the work it was given ends (answers
        are resolved still; a decode's caller has gone)."""
        self._executor.shutdown(wait=False)


def text_elements_of(outcomes: Sequence[Outcome]) -> int:
    """How many strings `outcomes`' outputs hold: what encoding their answers costs."""
    return sum(
        array.size
        for outcome in outcomes
        if outcome.outputs is not None
        for array in outcome.outputs.values()
        if array.dtype.hasobject
    )


def text_encoded(outcome: Outcome) -> Outcome:
    """`outcome` with each text output's data encoded (`Outcome.text_data`), as
    `encode_tensor` encodes it. An output that does not encode is left to the loop's
    encode, which refuses it as the answer's failure, as it did every answer."""
    if outcome.outputs is None:
        return outcome
    text_data: dict[str, bytes] = {}
    for name, array in outcome.outputs.items():
        if array.dtype.hasobject:
            with contextlib.suppress(ValueError):
                text_data[name] = encode_strings(f"tensor {name!r}", array)
    return dataclasses.replace(outcome, text_data=text_data) if text_data else outcome


def _encode_then(outcomes: Sequence[Outcome], resolve: Callable[[Sequence[Outcome]], None]) -> None:
    try:
        encoded = [text_encoded(outcome) for outcome in outcomes]
    except Exception:  # every answer is resolved, encoded here or not
        log.exception("encoding a batch's text answers failed; they are encoded on the loop")
        encoded = list(outcomes)
    resolve(encoded)
