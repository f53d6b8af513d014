"""Idempotency by request_id: a retried request runs once (engine rows are counted)."""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from laneserve import client as lc
from laneserve.client.tensors import encode_tensor
from laneserve.server import LaneConfig, ManualClock, idempotency, service, text_thread
from laneserve.server.codec import decode_inputs
from laneserve.server.demo_model import make_demo_model
from laneserve.server.errors import JoinExpiredError
from laneserve.server.idempotency import (
    ANY_CALLER,
    ENTRY_OVERHEAD_BYTES,
    SWEEP_SLACK_S,
    Admitted,
    Caller,
    LedgerCounts,
    ReplayCache,
    RequestLedger,
    fingerprint,
)
from laneserve.server.items import Outcome, Timing
from laneserve.server.scheduler import caller_end_status
from laneserve.v1 import inference_pb2 as pb
from tests.support import (
    FakeTimers,
    RecordingEngine,
    Serving,
    SettableGauge,
    TcpProxy,
    config,
    cut_while_a_batch_runs,
    flight_waiters,
    output,
    request,
    rich_status,
    rows,
    until_stats,
)
from tests.support import serving as served

pytestmark = pytest.mark.usefixtures("no_backoff_sleeps")


# ---- the replay cache, on a manual clock -----------------------------------------------


def answer(request_id: str, values: int = 10) -> pb.InferResponse:
    data = np.zeros((1, values), np.float32)
    return pb.InferResponse(request_id=request_id, outputs=[lc.encode_tensor("output", data)])


def cache(**bounds: Any) -> tuple[ReplayCache, ManualClock]:
    clock = ManualClock()
    settings = {"max_entries": 100, "max_bytes": 1 << 20, "ttl_s": 60.0} | bounds
    return ReplayCache(clock=clock, **settings), clock


def test_cache_evicts_the_oldest_stored_beyond_its_count() -> None:
    replay, _ = cache(max_entries=2)
    replay.put("a", b"fa", answer("a"))
    replay.put("b", b"fb", answer("b"))
    assert replay.get("a") is not None  # a replay: it expires when it would have
    replay.put("c", b"fc", answer("c"))
    assert replay.get("a") is None
    assert replay.get("b") is not None
    assert replay.get("c") is not None
    assert len(replay) == 2


def test_expired_answers_go_before_any_live_one_and_are_not_counted() -> None:
    """An LRU moved a replayed answer to the back, where it expired, and a store then
    evicted the live answer ahead of it (whose retry, within its TTL, ran again); and an
    idle server held, and GetStats counted, expired answers for good."""
    replay, clock = cache(max_entries=2, ttl_s=10.0)
    replay.put("a", b"fa", answer("a"))
    clock.advance(5.0)
    replay.put("b", b"fb", answer("b"))
    clock.advance(1.0)
    assert replay.get("a") is not None  # replayed at 6 s
    clock.advance(4.5)  # a expired at 10 s; b is 5.5 s old
    replay.put("c", b"fc", answer("c"))
    assert replay.get("b") is not None, "a live answer was evicted in an expired one's stead"
    assert len(replay) == 2
    clock.advance(3600.0)
    assert len(replay) == 0
    assert replay.size_bytes == 0


def test_the_bytes_held_drop_the_expired_answers_read_before_the_count() -> None:
    """GetStats reads both: each drops the expired answers, so they agree in any order
    (the bytes read first still counted the expired answers)."""
    replay, clock = cache(ttl_s=10.0)
    replay.put("a", b"fa", answer("a"))
    assert replay.size_bytes > 0
    clock.advance(10.0)
    assert replay.size_bytes == 0
    assert len(replay) == 0


def test_cache_stays_within_its_byte_bound() -> None:
    one = answer("x", values=1000)
    # The record (time, fingerprint length, fingerprint b"f", answer), the id, overhead.
    size = 9 + 1 + one.ByteSize() + len("x") + ENTRY_OVERHEAD_BYTES
    replay, _ = cache(max_bytes=2 * size + 10)
    for request_id in ("1", "2", "3"):
        replay.put(request_id, b"f", answer(request_id, values=1000))
    assert len(replay) == 2
    assert replay.size_bytes <= 2 * size + 10
    assert replay.get("1") is None


@pytest.mark.parametrize("prefix", ["a1b2c3d4", "\U0001f600" * 60], ids=["ascii", "emoji"])
def test_the_byte_bound_counts_the_memory_the_cache_holds(prefix: str) -> None:
    """size_bytes, which the byte bound limits, is near what the stored answers really
    take (allocations traced by tracemalloc): single-row answers of the demo model's
    size, with ids like the benchmark's, as the README's per-answer figure says. Ids
    of characters Python holds in 4 bytes each were counted at one byte a character
    (600 counted for 803 held a answer)."""
    stored = 20_000
    replay, _ = cache(max_entries=stored, max_bytes=1 << 30)
    digest = bytes(32)  # a SHA-256 fingerprint's size
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for index in range(stored):
            request_id = f"{prefix}-1-{index}"  # held by the cache, as a request's id is
            replay.put(request_id, digest, answer(request_id))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(replay) == stored
    assert 0.8 * held <= replay.size_bytes <= 1.25 * held, (replay.size_bytes, held)
    if prefix.isascii():
        assert held / stored < 400, "a single-row answer takes ~330 bytes in all"


def test_cache_does_not_keep_an_answer_larger_than_the_bound() -> None:
    replay, _ = cache(max_bytes=1000)
    assert not replay.put("big", b"f", answer("big", values=1000))
    assert len(replay) == 0
    assert replay.size_bytes == 0


def test_cache_forgets_after_the_ttl_even_when_used() -> None:
    replay, clock = cache(ttl_s=10.0)
    replay.put("a", b"f", answer("a"))
    clock.advance(9.9)
    assert replay.get("a") is not None
    clock.advance(0.1)
    assert replay.get("a") is None
    assert replay.size_bytes == 0


def test_expired_answers_are_dropped_when_others_are_stored() -> None:
    replay, clock = cache(ttl_s=10.0)
    replay.put("old", b"f", answer("old"))
    clock.advance(11)
    replay.put("new", b"f", answer("new"))
    assert len(replay) == 1


def test_cache_with_no_entries_keeps_nothing() -> None:
    replay, _ = cache(max_entries=0)
    assert not replay.put("a", b"f", answer("a"))
    assert replay.get("a") is None


def test_fingerprint_covers_inputs_and_outputs_but_not_lane_or_timeout() -> None:
    base = request(rows(2, seed=1), request_id="r", lane="bulk", timeout_ms=5)
    same = request(rows(2, seed=1), request_id="other", lane="interactive")
    outputs = ["output"]
    assert fingerprint(base, outputs) == fingerprint(same, outputs)
    assert fingerprint(base, outputs) != fingerprint(request(rows(2, seed=2)), outputs)
    assert fingerprint(base, outputs) != fingerprint(request(rows(2, seed=1)[:, :256]), outputs)
    assert fingerprint(base, ["a", "b"]) != fingerprint(base, ["b", "a"]), "another answer"
    assert fingerprint(base, ["a"]) != fingerprint(base, ["a", "b"])


def test_a_retry_listing_every_output_in_the_models_order_gets_the_stored_answer(
    small_model: Path,
) -> None:
    """No output_names means every output, in the model's order: a retry that lists them
    so asks for the same answer. It was refused REQUEST_ID_REUSED."""

    async def scenario() -> tuple[pb.InferResponse, pb.InferResponse, list[int]]:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            first = await s.stub.Infer(request(rows(2, start=7), request_id="all"))
            listed = request(rows(2, start=7), request_id="all", output_names=["output"])
            again = await s.stub.Infer(listed)
        return first, again, engine.ran_tags

    first, again, ran = asyncio.run(scenario())
    assert again == first
    assert ran == [7, 8], "ran once"


# ---- the server ------------------------------------------------------------------------


def test_retry_of_a_completed_request_gets_the_stored_answer(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            first = await s.stub.Infer(request(rows(3, start=100), request_id="once"))
            again = await s.stub.Infer(request(rows(3, start=100), request_id="once"))
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        assert again == first, "the same answer, timing included"
        assert engine.ran_tags == [100, 101, 102], "ran once"
        assert stats.idempotent_replays == 1
        assert stats.replay_cache_entries == 1
        assert stats.replay_cache_bytes >= first.ByteSize()

    asyncio.run(scenario())


def test_an_idle_server_drops_expired_answers_with_no_request_coming(small_model: Path) -> None:
    """No store and no GetStats after the answers expire: the loop's sweep drops them
    (the server's counts are read as the metrics read them, dropping nothing), and the
    server's stop cancels the sweep of the answers still live."""

    async def scenario() -> tuple[LedgerCounts | None, RequestLedger]:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model, idempotency_ttl_s=0.05)) as s:
            for index in range(3):
                await s.stub.Infer(request(rows(2), request_id=f"r{index}"))
            await until(lambda: held_answers(s) == 0, timeout_s=5.0)
            idle = s.server.ledger_counts()
        engine = RecordingEngine(str(small_model))  # a stopped server's engine runs no more
        async with served(engine, config(small_model)) as s:  # a TTL of 600 s
            await s.stub.Infer(request(rows(2), request_id="live"))
            assert s.server._servicer is not None
            ledger = s.server._servicer._ledger
            assert ledger._sweep is not None
        return idle, ledger

    idle, ledger = asyncio.run(scenario())
    assert idle == LedgerCounts(0, 0, 0, 0)
    assert ledger._sweep is None, "cancelled at stop"
    assert ledger.counts().replay_cache_entries == 1


def test_retry_while_queued_joins_it(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            busy = await hold_engine(s, engine)
            first = asyncio.ensure_future(s.stub.Infer(request(rows(2, start=10), request_id="j")))
            await until(lambda: queued_rows(s) == 2)
            second = asyncio.ensure_future(s.stub.Infer(request(rows(2, start=10), request_id="j")))
            await until_stats(s, lambda stats: stats.idempotent_joins == 1)
            assert queued_rows(s) == 2, "the retry queued nothing"
            engine.release()
            answers = await asyncio.gather(first, second, busy)
        assert answers[0] == answers[1]
        assert sorted(engine.ran_tags) == [0, 10, 11]

    asyncio.run(scenario())


def test_reused_id_with_other_inputs_is_refused_in_flight_and_after(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            busy = await hold_engine(s, engine)
            first = asyncio.ensure_future(s.stub.Infer(request(rows(2, seed=1), request_id="u")))
            await until(lambda: queued_rows(s) == 2)
            await refused_as_reused(s, request(rows(2, seed=2), request_id="u"), "still queued")
            engine.release()
            await asyncio.gather(first, busy)
            await refused_as_reused(s, request(rows(2, seed=2), request_id="u"), "completed")
            assert output(await s.stub.Infer(request(rows(2, seed=1), request_id="u"))).size

    asyncio.run(scenario())


def test_a_draining_server_still_gives_a_completed_requests_stored_answer(
    small_model: Path,
) -> None:
    """A retry of a completed request was refused DRAINING, and ran again on another
    instance; its stored answer costs no work. New work is still refused."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            first = await s.stub.Infer(request(rows(3, start=100), request_id="done"))
            engine.entered.acquire()  # its run's mark
            busy = await hold_engine(s, engine)  # the drain waits for it
            stopping = asyncio.ensure_future(s.server.stop(grace_s=30))
            await until(lambda: s.server.state.value == "DRAINING")
            again = await s.stub.Infer(request(rows(3, start=100), request_id="done"))
            assert again == first
            await refused_as_reused(s, request(rows(3, start=7), request_id="done"), "completed")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(1, start=9), request_id="new"))
            assert rich_status(caught.value)[0] == "DRAINING"
            engine.release()
            await busy
            await stopping
        assert sorted(engine.ran_tags) == [0, 100, 101, 102], "the retry ran nothing"

    asyncio.run(scenario())


def test_a_draining_server_joins_a_retry_to_its_request_in_flight(small_model: Path) -> None:
    """A retry of a request still queued here, sent while the server drained, was refused
    DRAINING ("retry on another instance") although the drain waits for that very request
    and answers it: the retry ran its rows again elsewhere. It joins it now."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            busy = await hold_engine(s, engine)  # the drain waits for it
            first = asyncio.ensure_future(
                s.stub.Infer(request(rows(2, start=10), request_id="queued"))
            )
            await until(lambda: queued_rows(s) == 2)
            stopping = asyncio.ensure_future(s.server.stop(grace_s=30))
            await until(lambda: s.server.state.value == "DRAINING")
            retry = asyncio.ensure_future(
                s.stub.Infer(request(rows(2, start=10), request_id="queued"))
            )
            await until_stats(s, lambda stats: stats.idempotent_joins == 1)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(1, start=9), request_id="new"))
            assert rich_status(caught.value)[0] == "DRAINING"
            engine.release()
            assert await retry == await first
            await busy
            await stopping
        assert sorted(engine.ran_tags) == [0, 10, 11], "the rows ran once"

    asyncio.run(scenario())


def test_abandoned_queued_request_frees_its_rows_and_never_runs(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            busy = await hold_engine(s, engine)
            call = s.stub.Infer(request(rows(3, start=50), request_id="gone"))
            task = asyncio.ensure_future(call)
            await until(lambda: queued_rows(s) == 3)
            call.cancel()
            await until(lambda: queued_rows(s) == 0)
            engine.release()
            await busy
            assert task.cancelled()
            assert 50 not in engine.ran_tags
            # The retry that follows runs it, once.
            retried = await s.stub.Infer(request(rows(3, start=50), request_id="gone"))
        assert output(retried).shape == (3, 10)
        assert engine.ran_tags.count(50) == 1

    asyncio.run(scenario())


def test_abandoned_running_request_finishes_and_is_replayed(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            engine.hold()
            call = s.stub.Infer(request(rows(2, start=70), request_id="running"))
            task = asyncio.ensure_future(call)
            await asyncio.to_thread(engine.entered.acquire)  # it is in the session
            assert flight_waiters(s, "running") == 1
            call.cancel()
            await until(lambda: flight_waiters(s, "running") == 0)  # the server saw it go
            engine.release()
            await until_stats(s, lambda stats: stats.replay_cache_entries == 1)
            retried = await s.stub.Infer(request(rows(2, start=70), request_id="running"))
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        assert task.cancelled()
        assert output(retried).shape == (2, 10)
        assert engine.ran_tags == [70, 71], "ran once, answered from the cache"
        assert stats.idempotent_replays == 1
        # Counted as its caller ended (it left), not OK: the answer reached nobody.
        (standard,) = [lane for lane in stats.lanes if lane.name == "standard"]
        assert dict(standard.answered) == {"CANCELLED": 1}
        assert standard.completed == 0

    asyncio.run(scenario())


def test_abandoned_request_split_across_batches_finishes_once_started(small_model: Path) -> None:
    """A request larger than the batch cap runs in chunks. Its caller leaves while the
    first chunk is in the session: the rest still runs and the answer is stored, so the
    retry with the same request_id is answered from the cache and no row runs twice."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model, max_batch_size=2)) as s:
            thread = s.server._thread
            assert thread is not None
            cancels: list[str | None] = []
            real_cancel = thread.cancel

            def watched_cancel(entry_id: int, *, unless_running: bool = False) -> str | None:
                cancels.append(real_cancel(entry_id, unless_running=unless_running))
                return cancels[-1]

            thread.cancel = watched_cancel  # type: ignore[method-assign]
            engine.hold()
            call = s.stub.Infer(request(rows(4, start=100), request_id="split"))
            task = asyncio.ensure_future(call)
            await asyncio.to_thread(engine.entered.acquire)  # rows 100-101 run
            assert queued_rows(s) == 2, "rows 102-103 wait for the next batch"
            call.cancel()
            await until(lambda: bool(cancels))  # the server saw the caller leave
            engine.release()
            await until_stats(s, lambda stats: stats.replay_cache_entries == 1)
            retried = await s.stub.Infer(request(rows(4, start=100), request_id="split"))
        assert cancels == [None], "started work with an id is not cancelled"
        assert task.cancelled()
        assert output(retried).shape == (4, 10)
        assert sorted(engine.ran_tags) == [100, 101, 102, 103], "every row ran once"

    asyncio.run(scenario())


def test_a_retry_joining_a_request_in_flight_keeps_its_own_deadline(small_model: Path) -> None:
    """The first call has no deadline; retries (same id) join it. One with 50 ms is
    answered EXPIRED_IN_QUEUE at its own deadline; one with none, naming a lane with a
    200 ms timeout, at that timeout (it waited as long as the first caller); one naming a
    lane the server lacks is INVALID_ARGUMENT, as a new request would be (it was answered
    from the flight or the replay cache). The request goes on to answer the first call:
    it runs once."""
    lanes = (
        LaneConfig("interactive", capacity_rows=64, timeout_ms=200, max_wait_ms=1, min_share=0),
        LaneConfig("standard", capacity_rows=64, timeout_ms=60_000, max_wait_ms=1, min_share=0),
    )

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model, lanes=lanes)) as s:
            engine.hold()
            busy = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=1))))
            await asyncio.to_thread(engine.entered.acquire)  # the session is busy
            x = rows(2, start=70)
            first = asyncio.ensure_future(s.stub.Infer(request(x, request_id="x")))
            await until(lambda: queued_rows(s) == 2)
            joins = (
                request(x, request_id="x", timeout_ms=50),
                request(x, request_id="x", lane="interactive"),
                request(x, request_id="x", lane="vip"),
            )
            refusals = []
            for join in joins:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await s.stub.Infer(join)
                refusals.append(refused.value)
            engine.release()
            answer = await first
            await busy
            with pytest.raises(grpc.aio.AioRpcError) as replayed:
                await s.stub.Infer(request(x, request_id="x", lane="vip"))
            refusals.append(replayed.value)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        deadline, lane_timeout, unknown, unknown_replayed = refusals
        for expired in (deadline, lane_timeout):
            assert expired.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert rich_status(expired)[0] == "EXPIRED_IN_QUEUE"
        assert "waited for the answer of request_id 'x'" in (deadline.details() or "")
        for refused_lane in (unknown, unknown_replayed):
            assert refused_lane.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown lane 'vip'" in (refused_lane.details() or "")
        assert output(answer).shape == (2, 10)
        assert engine.ran_tags.count(70) == 1, "ran once"
        assert stats.idempotent_joins == 2
        # Each expired join is counted, as its lane's refusal (it was counted nowhere).
        joins_expired = {lane.name: lane.rejected["EXPIRED_IN_QUEUE"] for lane in stats.lanes}
        assert joins_expired == {"interactive": 1, "standard": 1}

    asyncio.run(scenario())


def test_a_retry_with_a_later_deadline_keeps_the_request_for_itself(small_model: Path) -> None:
    """A hedge: the first call (timeout_ms 500) is queued behind a busy session; a retry
    with the same id and a 60 s timeout joins it. At 500 ms the first call is answered
    EXPIRED_IN_QUEUE alone, and the request stays queued for the retry, which gets its
    answer: it runs once. (The request kept the first call's deadline, and the retry was
    answered EXPIRED_IN_QUEUE with it.)"""

    async def scenario() -> tuple[grpc.aio.AioRpcError, pb.InferResponse, int]:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            busy = await hold_engine(s, engine)
            x = rows(2, start=70)
            first = asyncio.ensure_future(s.stub.Infer(request(x, request_id="x", timeout_ms=500)))
            await until(lambda: queued_rows(s) == 2)
            retry = asyncio.ensure_future(
                s.stub.Infer(request(x, request_id="x", timeout_ms=60_000))
            )
            await until_stats(s, lambda stats: stats.idempotent_joins == 1)
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await first
            still_queued = queued_rows(s)
            engine.release()
            answer = await retry
            await busy
        assert engine.ran_tags.count(70) == 1, "ran once"
        return expired.value, answer, still_queued

    expired, answer, still_queued = asyncio.run(scenario())
    assert expired.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert rich_status(expired)[0] == "EXPIRED_IN_QUEUE"
    assert "goes on, for a caller with a later deadline" in (expired.details() or "")
    assert still_queued == 2, "queued for the retry"
    assert output(answer).shape == (2, 10)


def test_when_the_later_caller_leaves_the_work_waits_for_the_earlier_one_only(
    small_model: Path,
) -> None:
    """The first call (timeout_ms 1000) is queued behind a busy session; a retry with a
    60 s timeout joins it (the work waits for it), then leaves. The work's deadline goes
    back to the first call's, where the queue sheds it: EXPIRED_IN_QUEUE, counted once,
    as a lone caller's is (the scheduler thread, asleep until the retry's deadline, is
    woken for it). It stayed queued for the retry that had left: the first call's timer
    answered it refused (`rejected`), and then cancelled the work, counted CANCELLED
    (its caller did not leave; its deadline passed in the queue)."""

    async def scenario() -> tuple[grpc.aio.AioRpcError, pb.LaneStats]:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            busy = await hold_engine(s, engine)
            x = rows(2, start=70)
            first = asyncio.ensure_future(
                s.stub.Infer(request(x, request_id="x", timeout_ms=1000), timeout=10)
            )
            await until(lambda: queued_rows(s) == 2)
            retry = s.stub.Infer(request(x, request_id="x", timeout_ms=60_000))
            await until_stats(s, lambda stats: stats.idempotent_joins == 1)
            # Another caller comes and goes: the scheduler thread re-plans, and sleeps
            # until the work's deadline, the retry's.
            other = s.stub.Infer(request(rows(1, start=90)))
            await until(lambda: queued_rows(s) == 3)
            other.cancel()
            await until(lambda: queued_rows(s) == 2)
            retry.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await first
            await until(lambda: queued_rows(s) == 0)
            engine.release()
            await busy
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        (standard,) = [lane for lane in stats.lanes if lane.name == "standard"]
        return expired.value, standard

    expired, standard = asyncio.run(scenario())
    assert rich_status(expired)[0] == "EXPIRED_IN_QUEUE", expired
    assert dict(standard.answered) == {"OK": 1, "EXPIRED_IN_QUEUE": 1, "CANCELLED": 1}
    assert dict(standard.shed) == {"EXPIRED_IN_QUEUE": 1, "CANCELLED": 1}
    assert dict(standard.rejected) == {}
    assert standard.admitted == 3


def test_work_that_ran_on_after_its_last_caller_left_is_counted_cancelled(
    small_model: Path,
) -> None:
    """The first call (timeout_ms 300) is in the session; a retry with a 60 s timeout
    joins it. The first call is answered alone at 300 ms; then the retry leaves, and the
    run ends with nobody waiting: counted as the last caller ended, CANCELLED (it left
    before its deadline). It was judged by the first call's deadline: DEADLINE_EXCEEDED,
    a failure."""

    async def scenario() -> pb.LaneStats:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            engine.hold()
            x = rows(2, start=70)
            first = asyncio.ensure_future(s.stub.Infer(request(x, request_id="x", timeout_ms=300)))
            await asyncio.to_thread(engine.entered.acquire)  # it is in the session
            retry = s.stub.Infer(request(x, request_id="x", timeout_ms=60_000))
            await until_stats(s, lambda stats: stats.idempotent_joins == 1)
            with pytest.raises(grpc.aio.AioRpcError):
                await first
            retry.cancel()
            await until(lambda: flight_waiters(s, "x") == 0)  # the server saw the retry go
            engine.release()
            await until_stats(s, lambda stats: stats.replay_cache_entries == 1)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        (standard,) = [lane for lane in stats.lanes if lane.name == "standard"]
        return standard

    standard = asyncio.run(scenario())
    assert dict(standard.answered) == {"CANCELLED": 1}
    assert standard.failed == 0


def test_a_retry_joining_in_the_turn_its_answer_arrives_gets_it() -> None:
    """The answer (a loop callback from the engine thread) came in the loop turn between
    a retry's join and its first step: `asyncio.wait_for` ran the wait in a task of its
    own, which registered the retry on the answered flight one turn late. It waited out
    its timeout (bulk: 120 s), and a stream that carried it could not end until then."""

    async def scenario() -> tuple[str, str]:
        clock = ManualClock()
        ledger = RequestLedger(
            ReplayCache(max_entries=8, max_bytes=1 << 20, ttl_s=60, clock=clock), clock
        )
        resolves: list[Callable[[Outcome], None]] = []

        def never_cancelled(unless_running: bool) -> bool:
            del unless_running
            return False

        def submit(resolve: Callable[[Outcome], None]) -> Admitted:
            resolves.append(resolve)
            return Admitted(never_cancelled, lambda _later_s: True)

        def answer(
            outcome: Outcome, _ended: str | None, _read_limit: int | None, _own: Caller
        ) -> pb.InferResponse:
            return pb.InferResponse(request_id=outcome.request_id)

        first = asyncio.create_task(ledger.run("x", b"same", submit, answer))
        await asyncio.sleep(0)  # the first call is in flight
        retry = asyncio.create_task(ledger.run("x", b"same", submit, answer, deadline_s=3600.0))
        outcome = Outcome("token", "x", {}, None, Timing("standard", 1, 0.0, 0.0))
        # Scheduled after the retry's first step: both run in the same loop turn.
        asyncio.get_running_loop().call_soon(resolves[0], outcome)
        async with asyncio.timeout(10):  # the retry waits no longer than this for nothing
            return (await first).request_id, (await retry).request_id

    assert asyncio.run(scenario()) == ("x", "x")


def test_work_every_caller_left_is_counted_by_the_last_callers_own_deadline() -> None:
    """The scheduler keeps a moved deadline within the lane's timeout from when the work
    queued; the ledger keeps the latest caller's own. Both callers leave, the running
    work finishes after the lane's bound but before that caller's deadline: `finish` is
    told how that caller ended by its own deadline (CANCELLED: it left), not by the
    scheduler's bound (which counted it DEADLINE_EXCEEDED; a review caught that change)."""

    async def scenario() -> list[str | None]:
        clock = ManualClock()
        ledger = RequestLedger(
            ReplayCache(max_entries=8, max_bytes=1 << 20, ttl_s=600, clock=clock), clock
        )
        resolves: list[Callable[[Outcome], None]] = []
        moved_to: list[float] = []
        given: list[str | None] = []
        t0 = clock.monotonic()

        def running(unless_running: bool) -> bool:
            del unless_running
            return False  # it runs: not cancelled, it finishes and is stored

        def move(later_s: float) -> bool:
            moved_to.append(min(later_s, t0 + 20.0))  # the scheduler's lane bound
            return True

        def submit(resolve: Callable[[Outcome], None]) -> Admitted:
            resolves.append(resolve)
            return Admitted(running, move)

        def answer(
            outcome: Outcome, ended: str | None, _read_limit: int | None, _own: Caller
        ) -> pb.InferResponse:
            given.append(ended)
            return pb.InferResponse(request_id=outcome.request_id)

        first = asyncio.create_task(ledger.run("x", b"same", submit, answer, deadline_s=t0 + 10))
        await asyncio.sleep(0)
        retry = asyncio.create_task(ledger.run("x", b"same", submit, answer, deadline_s=t0 + 100))
        await asyncio.sleep(0)
        assert moved_to == [t0 + 20]
        for call in (first, retry):
            call.cancel()
        await asyncio.gather(first, retry, return_exceptions=True)
        clock.advance(50.0)  # past the lane's bound, before the retry's own deadline
        resolves[0](Outcome("token", "x", {}, None, Timing("standard", 1, 0.0, 0.0)))
        return given

    assert asyncio.run(scenario()) == ["CANCELLED"]


class _OneFlight:
    """A ledger on a manual clock whose requests are admitted and never cancelled (they
    run): what `finish` was given (`ended`), and the Outcome's way back (`resolve`)."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.ledger = RequestLedger(
            ReplayCache(max_entries=8, max_bytes=1 << 20, ttl_s=600, clock=self.clock),
            self.clock,
        )
        self.resolves: list[Callable[[Outcome], None]] = []
        self.given: list[str | None] = []

    def run(self, deadline_s: float, caller: Caller = ANY_CALLER) -> asyncio.Task[pb.InferResponse]:
        def running(unless_running: bool) -> bool:
            del unless_running
            return False

        def submit(resolve: Callable[[Outcome], None]) -> Admitted:
            self.resolves.append(resolve)
            return Admitted(running, lambda _later_s: True)

        def answer(
            outcome: Outcome, ended: str | None, _read_limit: int | None, _own: Caller
        ) -> pb.InferResponse:
            self.given.append(ended)
            return pb.InferResponse(request_id=outcome.request_id)

        return asyncio.create_task(
            self.ledger.run("x", b"same", submit, answer, deadline_s=deadline_s, caller=caller)
        )

    def answer(self) -> None:
        self.resolves[0](Outcome("token", "x", {}, None, Timing("standard", 1, 0.0, 0.0)))


def test_a_joined_caller_cancelled_at_its_deadline_is_reported_expired() -> None:
    """gRPC cancels a call at its deadline in the same instant as the ledger's timer for a
    caller that joined work waiting on for a later one. When the cancel came first, the
    caller (answered DEADLINE_EXCEEDED by gRPC) was counted nowhere (a review saw 1 in 8
    of them). A caller cancelled before its deadline left: it is not reported."""

    async def scenario() -> list[list[str]]:
        reported: list[list[str]] = []
        for leaves_after_s in (10.0, 5.0):  # at its deadline; before it
            flight = _OneFlight()
            t0 = flight.clock.monotonic()
            expired: list[JoinExpiredError] = []
            first = flight.run(t0 + 100)
            await asyncio.sleep(0)
            joined = flight.run(t0 + 10, Caller(expired=expired.append))
            await asyncio.sleep(0)  # joined, with a timer (real time: it does not fire here)
            flight.clock.advance(leaves_after_s)
            joined.cancel()
            with pytest.raises(asyncio.CancelledError):
                await joined
            flight.answer()
            await first
            reported.append([error.reason for error in expired])
        return reported

    assert asyncio.run(scenario()) == [["EXPIRED_IN_QUEUE"], []]


def test_an_answer_no_caller_can_take_any_more_is_counted_by_their_deadline() -> None:
    """An answer that came once its caller's gRPC deadline had passed, before gRPC's cancel
    reached the call, was counted OK: gRPC answered the caller DEADLINE_EXCEEDED. `finish`
    is told they ended by their deadline (as for a caller that went) unless a caller can
    still take it."""

    async def scenario() -> list[str | None]:
        given: list[str | None] = []
        for reachable in (False, True):
            flight = _OneFlight()
            t0 = flight.clock.monotonic()
            call = flight.run(t0 + 10, Caller(reachable=functools.partial(bool, reachable)))
            await asyncio.sleep(0)
            flight.clock.advance(10.0)
            flight.answer()
            await call  # handed the answer all the same: gRPC decides what the caller gets
            given += flight.given
        return given

    assert asyncio.run(scenario()) == ["DEADLINE_EXCEEDED", None]


def swept_ledger(**bounds: Any) -> tuple[RequestLedger, ManualClock, FakeTimers]:
    """A ledger on a manual clock whose sweep timers `FakeTimers` holds."""
    clock = ManualClock()
    timers = FakeTimers()
    settings = {"max_entries": 8, "max_bytes": 1 << 20, "ttl_s": 10.0} | bounds
    ledger = RequestLedger(ReplayCache(clock=clock, **settings), clock, call_later=timers)
    return ledger, clock, timers


async def completed(ledger: RequestLedger, request_id: str) -> None:
    """Runs one request with `request_id` through `ledger` to its answer (then stored)."""
    resolves: list[Callable[[Outcome], None]] = []

    def running(unless_running: bool) -> bool:
        del unless_running
        return False

    def submit(resolve: Callable[[Outcome], None]) -> Admitted:
        resolves.append(resolve)
        return Admitted(running, lambda _later_s: True)

    def finish(
        outcome: Outcome, _ended: str | None, _read_limit: int | None, _own: Caller
    ) -> pb.InferResponse:
        return pb.InferResponse(request_id=outcome.request_id)

    call = asyncio.create_task(ledger.run(request_id, b"same", submit, finish))
    await asyncio.sleep(0)  # in flight
    resolves[0](Outcome("token", request_id, {}, None, Timing("standard", 1, 0.0, 0.0)))
    await call


def test_an_idle_ledger_drops_each_expired_answer_at_its_sweep() -> None:
    """README: expired answers are neither held nor counted once past their TTL. They were
    dropped only when an answer was stored or the cache counted (GetStats): an idle
    server, one watched by Prometheus alone, held every one (up to idempotency_max_bytes)
    until then. One timer, armed for the oldest answer's expiry plus the slack, sweeps."""

    async def scenario() -> None:
        ledger, clock, timers = swept_ledger(ttl_s=10.0)
        await completed(ledger, "a")  # expires at 10 s
        clock.advance(4.0)
        await completed(ledger, "b")  # expires at 14 s
        assert [timer.delay_s for timer in timers.started] == [10.0 + SWEEP_SLACK_S]
        clock.advance(10.0 + SWEEP_SLACK_S - 4.0)
        timers.started[-1].action()
        assert ledger.counts().replay_cache_entries == 1, "a is dropped, b is live"
        assert timers.started[-1].delay_s == 4.0, "due at b's expiry plus the slack, as a's was"
        clock.advance(timers.started[-1].delay_s)
        timers.started[-1].action()
        assert ledger.counts() == LedgerCounts(0, 0, 0, 0)
        assert len(timers.started) == 2, "nothing left to sweep: no timer armed"

    asyncio.run(scenario())


def test_closing_the_ledger_cancels_its_sweep_and_arms_no_other() -> None:
    """The server closes its ledger at stop: no timer may outlive the server or its loop."""

    async def scenario() -> None:
        ledger, _, timers = swept_ledger()
        await completed(ledger, "a")
        ledger.close()
        await completed(ledger, "b")  # an answer of a run that would not end, stored late
        assert [timer.cancelled for timer in timers.started] == [True]

    asyncio.run(scenario())


def test_a_ledger_that_stores_no_answer_arms_no_sweep() -> None:
    async def scenario() -> None:
        ledger, _, timers = swept_ledger(max_entries=0)
        await completed(ledger, "a")
        assert timers.started == []

    asyncio.run(scenario())


def test_callers_waiting_on_one_request_are_bounded_and_the_rest_refused(
    small_model: Path,
) -> None:
    """Retries that join a request in flight queue no rows, so the lane's capacity never
    bounded them, but gRPC holds each call's request message until it is answered: 80
    joins of a 4 MiB request held 1 GiB on a server whose host_memory_limit was 300 MiB.
    At most MAX_CALLERS_WAITING callers wait on one request; the others are refused at
    once, told to retry once it is answered (its answer is then stored: a replay)."""
    most = idempotency.MAX_CALLERS_WAITING
    retries = most + 3

    def refusals(stats: pb.GetStatsResponse) -> int:
        return sum(lane.rejected["JOIN_LIMIT"] for lane in stats.lanes)

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            busy = await hold_engine(s, engine)
            body = request(rows(2, start=10), request_id="j")
            first = asyncio.ensure_future(s.stub.Infer(body))
            await until(lambda: queued_rows(s) == 2)
            calls = [asyncio.ensure_future(s.stub.Infer(body)) for _ in range(retries)]
            await until_stats(s, lambda stats: stats.idempotent_joins + refusals(stats) == retries)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert stats.idempotent_joins == most - 1, "the first caller and the joins"
            assert refusals(stats) == retries - (most - 1)
            refused = [call for call in calls if call.done()]
            assert len(refused) == retries - (most - 1)
            for call in refused:
                error = call.exception()
                assert isinstance(error, grpc.aio.AioRpcError)
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert rich_status(error)[0] == "JOIN_LIMIT"
                details = error.details() or ""
                assert f"request_id 'j' is queued or running with {most} callers" in details
                assert "retry once it is answered" in details
            engine.release()
            answers = [await call for call in calls if call not in refused]
            assert answers == [await first] * (most - 1)
            assert await s.stub.Infer(body) == await first, "the retry after it: a replay"
            await busy
        assert sorted(engine.ran_tags) == [0, 10, 11]

    asyncio.run(scenario())


def test_a_join_or_a_replay_does_not_decode_its_inputs(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry that joins or replays was decoded as if it would run: a copy of its inputs
    held as long as it waited. Its fingerprint equals the first attempt's, which was
    decoded and validated: it is not decoded again."""
    decoded: list[str] = []

    def counted(*args: Any) -> Any:
        decoded.append("decoded")
        return decode_inputs(*args)

    monkeypatch.setattr(f"{service.__name__}.decode_inputs", counted)

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            busy = await hold_engine(s, engine)
            assert decoded == ["decoded"]
            body = request(rows(2, start=10), request_id="d")
            first = asyncio.ensure_future(s.stub.Infer(body))
            await until(lambda: queued_rows(s) == 2)
            joined = asyncio.ensure_future(s.stub.Infer(body, timeout=30))
            await until_stats(s, lambda stats: stats.idempotent_joins == 1)
            assert len(decoded) == 2, "the join decoded nothing"
            engine.release()
            assert await joined == await first
            assert await s.stub.Infer(body) == await first
            await refused_as_reused(s, request(rows(2, start=99), request_id="d"), "completed")
            assert len(decoded) == 3, "the replay decoded nothing; the reused id is decoded"
            await busy
        assert sorted(engine.ran_tags) == [0, 10, 11]

    asyncio.run(scenario())


def test_a_large_request_with_an_id_is_hashed_off_the_event_loop(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new request of more than EVENT_LOOP_HASH_BYTES of numbers with an id is hashed on
    the hasher thread, where hashlib lets go of the GIL: on the loop a 16 MiB one held every
    other call ~12 ms (a user's evaluation: interactive p99 58-361 ms beside them, 31-48
    without ids). A smaller one is hashed on the loop, as is a retry (it is held: its
    digest decides at once whether it replays); the retry replays the answer, other
    inputs with the id are refused REQUEST_ID_REUSED, and its rows ran once."""
    hashed_on: list[tuple[str, str]] = []

    def recording(request: pb.InferRequest, output_names: Any) -> bytes:
        hashed_on.append((request.request_id, threading.current_thread().name))
        return fingerprint(request, output_names)

    monkeypatch.setattr(service, "fingerprint", recording)
    big_rows = text_thread.EVENT_LOOP_HASH_BYTES // rows(1).nbytes + 1

    async def scenario() -> tuple[pb.InferResponse, pb.InferResponse, list[int]]:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            await s.stub.Infer(request(rows(1, start=10_000), request_id="small"))
            body = request(rows(big_rows, start=0), request_id="big")
            first = await s.stub.Infer(body)
            again = await s.stub.Infer(body)
            await refused_as_reused(
                s, request(rows(big_rows, start=1), request_id="big"), "completed"
            )
        return first, again, sorted(engine.ran_tags)

    first, again, ran = asyncio.run(scenario())
    assert again == first
    assert ran == [*range(big_rows), 10_000]
    loop = threading.main_thread().name  # asyncio.run's loop runs on this thread
    assert [(request_id, name == loop) for request_id, name in hashed_on] == [
        ("small", True),
        ("big", False),
        ("big", True),
        ("big", True),
    ]
    assert hashed_on[1][1].startswith("laneserve-hash")


class _HashGate:
    """Holds `fingerprint` off the event loop (the hasher's hashes) until released; the
    loop's hashes (a retry's) go through. The test's wrapping of the service's name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()

        def held(request: pb.InferRequest, output_names: Any) -> bytes:
            if threading.current_thread() is not threading.main_thread():
                self.entered.set()
                assert self.gate.wait(30), "the test never released the hash"
            return fingerprint(request, output_names)

        monkeypatch.setattr(service, "fingerprint", held)
        self.asked_after = 0  # calls that waited for a read of their id
        after = text_thread.TextThread.after

        async def counted(reads: text_thread.TextThread, *args: Any) -> bool:
            self.asked_after += 1
            return await after(reads, *args)

        monkeypatch.setattr(text_thread.TextThread, "after", counted)

    async def until_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 30), "no hash began off the loop"


def test_a_call_with_the_id_of_a_request_being_hashed_waits_and_joins_it(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a large request's hash is held on the hasher, a call with its id and inputs
    waits (it reaches the ledger after the first, as if the hash took no await) and then
    joins it; one with its id and other inputs is refused REQUEST_ID_REUSED; the rows run
    once. And a request whose deadline comes while its hash waits is refused
    EXPIRED_IN_QUEUE in words about its data, not text."""
    gate = _HashGate(monkeypatch)
    big_rows = text_thread.EVENT_LOOP_HASH_BYTES // rows(1).nbytes + 1

    async def scenario() -> tuple[pb.InferResponse, pb.InferResponse, str, list[int]]:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            body = request(rows(big_rows, start=0), request_id="big")
            first = asyncio.ensure_future(s.stub.Infer(body, timeout=30))
            await gate.until_entered()
            joined = asyncio.ensure_future(s.stub.Infer(body, timeout=30))
            late = request(rows(big_rows, start=5_000), request_id="late", timeout_ms=300)
            expired = asyncio.ensure_future(s.stub.Infer(late, timeout=30))
            await until(lambda: gate.asked_after == 1)  # the join waits for the read
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await expired
            gate.gate.set()
            answers = await asyncio.gather(first, joined)
            await refused_as_reused(s, request(rows(2, start=9_000), request_id="big"), "completed")
        return answers[0], answers[1], refused.value.details() or "", sorted(engine.ran_tags)

    first, joined, expired, ran = asyncio.run(scenario())
    assert joined == first
    assert ran == list(range(big_rows)), "the join ran nothing; the expired request never ran"
    assert expired.startswith("request 'late' was still waiting for its data to be hashed")


def test_a_join_in_a_lane_closed_by_memory_is_refused_as_new_work_is(small_model: Path) -> None:
    """A retry joining a request in flight holds its request message as a new request
    does; it was joined in a lane the memory watermark had closed. It is refused
    MEMORY_PRESSURE there, with the pushback new work gets; in an open lane it joins."""

    async def scenario() -> None:
        gauge = SettableGauge()
        engine = RecordingEngine(str(small_model))
        settings = config(small_model, host_memory_limit="100MiB")
        async with served(engine, settings, memory_gauge=gauge) as s:
            watermark = s.server.scheduler.watermark
            assert watermark is not None
            busy = await hold_engine(s, engine)
            body = request(rows(2, start=10), request_id="m", lane="standard")
            first = asyncio.ensure_future(s.stub.Infer(body))
            await until(lambda: queued_rows(s) == 2)
            gauge.value = 96 << 20  # over the high watermark: bulk closes
            await until(lambda: watermark.used_bytes == gauge.value)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(
                    request(rows(2, start=10), request_id="m", lane="bulk"), timeout=5
                )
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            reason, details = rich_status(caught.value)
            assert reason == "MEMORY_PRESSURE"
            assert details["pushback_ms"] > 0
            assert "request_id 'm'" in (caught.value.details() or "")
            # What was read, named as admission's refusal names it (a CPU server said
            # "memory in use" of its resident memory).
            assert (caught.value.details() or "").startswith("this process's resident memory")
            joined = asyncio.ensure_future(s.stub.Infer(body))
            await until_stats(s, lambda stats: stats.idempotent_joins == 1)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            refused = {lane.name: dict(lane.rejected) for lane in stats.lanes}
            assert refused["bulk"] == {"MEMORY_PRESSURE": 1}
            gauge.value = 0
            engine.release()
            assert await joined == await first
            await busy

    asyncio.run(scenario())


def test_joined_request_survives_the_first_caller_leaving(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            busy = await hold_engine(s, engine)
            first_call = s.stub.Infer(request(rows(1, start=5), request_id="k"))
            first = asyncio.ensure_future(first_call)
            await until(lambda: queued_rows(s) == 1)
            second = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=5), request_id="k")))
            await until_stats(s, lambda stats: stats.idempotent_joins == 1)
            first_call.cancel()
            await until(lambda: flight_waiters(s, "k") == 1)  # the server saw one waiter go
            assert queued_rows(s) == 1, "the other waiter keeps it queued"
            engine.release()
            answer = await second
            await busy
        assert first.cancelled()
        assert output(answer).shape == (1, 10)
        assert engine.ran_tags.count(5) == 1

    asyncio.run(scenario())


def test_an_answer_none_of_its_callers_read_counts_each_refusal_once(tmp_path: Path) -> None:
    """A stream item that reads at most 1 KiB queues a request whose answer is 4 KiB; two
    stream items with its id and the same limit join it, and so does a unary retry. The
    item that queued it and the unary retry leave before it is answered: no caller still
    waiting reads the answer. The request is counted once in `answered`, ANSWER_TOO_LARGE
    (what its callers got), standing for one joined item's refusal, and the other's
    refusal once in `rejected`. Judged for the item that queued it, the request's status
    stood for nobody's refusal: both joined items were counted in `rejected` as well."""
    wide = tmp_path / "wide.onnx"
    make_demo_model(wide, input_dim=4, hidden_layers=0, output_dim=1024)  # 4 KiB per row
    x = np.ones((1, 4), dtype=np.float32)
    shared = pb.InferRequest(request_id="shared", lane="bulk", inputs=[encode_tensor("input", x)])
    small = (("laneserve-max-receive-bytes", "1024"),)

    async def scenario() -> tuple[list[pb.InferStreamResponse], pb.GetStatsResponse]:
        engine = RecordingEngine(str(wide))
        async with served(engine, config(wide)) as s:
            assert s.server._servicer is not None
            ledger = s.server._servicer._ledger
            engine.hold()
            streams = [s.stub.InferStream(iter([shared]), metadata=small)]
            items = [asyncio.ensure_future(anext(aiter(streams[0])))]
            assert await asyncio.to_thread(engine.entered.acquire, True, 10)  # it runs
            streams += [s.stub.InferStream(iter([shared]), metadata=small) for _ in range(2)]
            items += [asyncio.ensure_future(anext(aiter(stream))) for stream in streams[1:]]
            retry_call = s.stub.Infer(shared, timeout=30)
            retry = asyncio.ensure_future(retry_call)
            await until_stats(s, lambda stats: stats.idempotent_joins == 3)
            streams[0].cancel()  # the item that queued it goes
            retry_call.cancel()
            await until(lambda: len(ledger._flights["shared"].waiters) == 2)
            engine.release()
            answers = list(await asyncio.gather(*items[1:]))
            for stream in streams[1:]:
                stream.cancel()
            for gone in (items[0], retry):
                with pytest.raises(asyncio.CancelledError):
                    await gone
            return answers, await s.stub.GetStats(pb.GetStatsRequest())

    answers, stats = asyncio.run(scenario())
    for item in answers:
        assert "over the largest message this caller reads (1024 bytes" in item.error.message
    bulk = next(lane for lane in stats.lanes if lane.name == "bulk")
    assert (bulk.admitted, dict(bulk.answered)) == (1, {"ANSWER_TOO_LARGE": 1})
    assert bulk.rejected["ANSWER_TOO_LARGE"] == 1, "two callers refused: each counted once"


def test_requests_without_an_id_are_not_deduplicated(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            for _ in range(2):
                await s.stub.Infer(request(rows(1, start=9)))
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        assert engine.ran_tags == [9, 9]
        assert stats.replay_cache_entries == 0

    asyncio.run(scenario())


def test_aggressive_retries_through_a_failing_network_run_each_request_once(
    demo_model: Path, reference: ort.InferenceSession
) -> None:
    """Many concurrent callers retry at once (no backoff sleeps) while the network is cut
    again and again, each time while a batch is in the session. Every request's rows run
    exactly once (the engine's record counts them) and every caller gets its answer."""
    callers = 120

    async def scenario() -> None:
        engine = RecordingEngine(str(demo_model))
        async with served(engine, config(demo_model, max_batch_size=16)) as s:
            proxy = TcpProxy(s.server.port)
            target = await proxy.start()
            policy = lc.RetryPolicy(max_attempts=1000)
            inputs = [rows(1 + i % 4, seed=i, start=10 * i) for i in range(callers)]
            try:
                async with lc.AsyncClient(target, retry=policy) as client:
                    calls = [
                        asyncio.ensure_future(
                            client.infer({"input": x}, request_id=f"agg-{i}", timeout=60)
                        )
                        for i, x in enumerate(inputs)
                    ]
                    cuts = 0
                    for _ in range(8):
                        severed = await cut_while_a_batch_runs(engine, proxy)
                        if severed is None:
                            break
                        cuts += severed > 0
                    answers = await asyncio.gather(*calls)
                    stats = await client.stats()
            finally:
                await proxy.close()
        for x, got in zip(inputs, answers, strict=True):
            np.testing.assert_allclose(
                got["output"], reference.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6
            )
        expected = sorted(int(tag) for x in inputs for tag in x[:, 0])
        assert sorted(engine.ran_tags) == expected, "every row ran exactly once"
        assert cuts >= 3, "the network failed while batches ran"
        assert proxy.connections > cuts, "calls were retried on new connections"
        assert stats.idempotent_joins + stats.idempotent_replays > 0, (
            "retries of requests cut off while running were answered without running again"
        )

    asyncio.run(scenario())


# ---- helpers ---------------------------------------------------------------------------


async def refused_as_reused(s: Serving, bad: pb.InferRequest, state: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await s.stub.Infer(bad)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rich_status(caught.value)[0] == "REQUEST_ID_REUSED"
    details = caught.value.details() or ""
    assert f"request_id {bad.request_id!r} was already used" in details
    assert f"which is {state}" in details


async def hold_engine(s: Serving, engine: RecordingEngine) -> asyncio.Future[pb.InferResponse]:
    """Makes the session busy with one row tagged 0: later work queues behind it."""
    engine.hold()
    busy = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
    await asyncio.to_thread(engine.entered.acquire)
    return busy


def held_answers(s: Serving) -> int:
    """The answers the server's replay cache holds, read as the metrics read them: without
    dropping the expired (GetStats drops them first)."""
    counts = s.server.ledger_counts()
    assert counts is not None
    return counts.replay_cache_entries


def queued_rows(s: Serving) -> int:
    thread = s.server._thread
    assert thread is not None
    return sum(depth.queued_rows for depth in thread.depths())


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.002)


def test_stored_answers_are_not_walked_by_the_garbage_collector() -> None:
    """The cache may hold 100 000 answers: a full collection must not walk them (it holds
    the GIL while it walks, stalling every thread)."""
    replay, _ = cache()
    response = answer("a")
    replay.put("a", b"fa", response)
    gc.collect()
    assert not any(gc.is_tracked(stored) for stored in replay._entries.values())
    replayed = replay.get("a")
    assert replayed is not None
    assert replayed.response == response, "the stored bytes are the same answer"


def test_a_caller_that_left_is_counted_cancelled_when_its_work_ends_past_its_deadline(
    small_model: Path,
) -> None:
    """A call with a request_id leaves (cancelled) long before its 3 s deadline while
    its batch runs; the work runs on for a retry's replay and finishes after that
    deadline. It was judged when its answer came, against the deadline: counted
    DEADLINE_EXCEEDED, though its caller left. The last caller's end is judged as it
    goes."""

    async def scenario() -> pb.LaneStats:
        engine = RecordingEngine(str(small_model))
        async with served(engine, config(small_model)) as s:
            engine.hold_next()
            # 3 s: the server must see the cancel before the deadline, on a loaded machine.
            call = s.stub.Infer(request(rows(2, start=70), request_id="left"), timeout=3.0)
            task = asyncio.ensure_future(call)
            await asyncio.to_thread(engine.entered.acquire)  # it is in the session
            call.cancel()
            await asyncio.sleep(3.1)  # the server saw it go; its deadline has passed
            engine.release()
            await until_stats(s, lambda stats: stats.replay_cache_entries == 1)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        assert task.cancelled()
        (standard,) = [lane for lane in stats.lanes if lane.name == "standard"]
        return standard

    standard = asyncio.run(scenario())
    assert dict(standard.answered) == {"CANCELLED": 1}


def test_the_last_caller_to_go_is_judged_as_it_goes_not_when_the_answer_comes() -> None:
    """Work with a request_id runs on after its last caller goes; `finish` is told how
    that caller ended, judged as it went against its own deadline. Judged when the answer
    came: one that left at 0.1 s of 10 s, its work ending at 20 s, was DEADLINE_EXCEEDED;
    one whose deadline passed (its client's, a cancel 10 ms before the server's reading),
    its work ending 5 ms before that reading, was CANCELLED."""

    async def scenario() -> list[str | None]:
        given: list[str | None] = []
        for goes_at_s, answered_at_s in ((0.1, 20.0), (9.99, 9.995)):
            flight = _OneFlight()
            t0 = flight.clock.monotonic()
            call = flight.run(t0 + 10)
            await asyncio.sleep(0)
            flight.clock.advance(goes_at_s)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            flight.clock.advance(answered_at_s - goes_at_s)
            flight.answer()
            given += flight.given
        return given

    assert asyncio.run(scenario()) == ["CANCELLED", "DEADLINE_EXCEEDED"]


def test_a_retry_answered_alone_after_the_last_caller_left_is_not_counted_again() -> None:
    """The submitter leaves 99 s before its deadline while its work runs on; a retry joins
    with an earlier deadline, is answered alone at it (counted as its lane's refusal) and
    goes last. It set how the work ended, DEADLINE_EXCEEDED: the retry was counted twice
    and the submitter's CANCELLED nowhere. The work stays counted as the submitter
    ended."""

    async def scenario() -> tuple[list[str | None], list[str]]:
        flight = _OneFlight()
        expired: list[str] = []
        t0 = flight.clock.monotonic()
        first = flight.run(t0 + 100)
        await asyncio.sleep(0)
        flight.clock.advance(1.0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        retry = flight.run(
            flight.clock.monotonic() + 0.001,
            Caller(expired=lambda error: expired.append(error.reason)),
        )
        with pytest.raises(JoinExpiredError):
            await retry  # its timer, on the loop's clock, answers it alone
        flight.clock.advance(1.0)
        flight.answer()
        return flight.given, expired

    given, expired = asyncio.run(scenario())
    assert expired == ["EXPIRED_IN_QUEUE"]
    assert given == ["CANCELLED"]


def test_a_cancel_a_few_ms_before_the_deadline_is_the_deadline() -> None:
    """gRPC's deadline on the server is the client's plus the call's transit, and a
    client's deadline reaches the server as a plain cancel: up to that transit before the
    server's deadline. Within 1 ms only, such callers (a few ms, in-process on a busy
    loop) were counted CANCELLED."""
    deadline_s = ManualClock().monotonic() + 1.0
    ended = [
        caller_end_status(deadline_s - gone_before_s, deadline_s, queued=queued)
        for gone_before_s, queued in ((0.005, False), (0.005, True), (0.2, False), (0.2, True))
    ]
    assert ended == ["DEADLINE_EXCEEDED", "EXPIRED_IN_QUEUE", "CANCELLED", "CANCELLED"]


# Sizes of tensor data about the pieces `fingerprint` feeds small data in, its limit and
# hashlib's threshold for releasing the GIL (2048 bytes: exactly one 512-float row).
_DATA_SIZES = (0, 1, 2047, 2048, 2049, 4094, 4096, 65535, 65536, 65537, 200_000)


def _one_tensor(size: int) -> pb.InferRequest:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    return pb.InferRequest(
        inputs=[pb.Tensor(name="x", dtype=pb.DATA_TYPE_UINT8, shape=[1, size], data=data)]
    )


@pytest.mark.parametrize("size", _DATA_SIZES)
def test_a_fingerprint_is_the_digest_of_its_data_hashed_whole(size: int) -> None:
    """Small data is fed to the digest in pieces (see the next test): the digest is the
    one of the whole data hashed at once, behind its tensor's header and name."""
    request = _one_tensor(size)
    header = struct.pack("<QiQ2qQ", 1, pb.DATA_TYPE_UINT8, 2, 1, size, size)
    whole = header + b"x" + request.inputs[0].data + b"outputs" + struct.pack("<Q", 1) + b"y"
    assert fingerprint(request, ["y"]) == hashlib.sha256(whole).digest()


_SHA256 = hashlib.sha256  # the real one, before a test replaces it


class _RecordingDigest:
    """hashlib's SHA-256, recording the size of each update."""

    def __init__(self, updates: list[int]) -> None:
        self._digest = _SHA256()
        self._updates = updates

    def update(self, data: bytes | memoryview) -> None:
        self._updates.append(memoryview(data).nbytes)
        self._digest.update(data)

    def digest(self) -> bytes:
        return self._digest.digest()


@pytest.mark.parametrize("size", _DATA_SIZES)
def test_a_fingerprint_of_small_data_keeps_the_gil(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hashlib releases the GIL for an update of 2048 bytes or more, and the event loop
    then waits behind the engine's and the scheduler's threads to take it back: 42-252 us
    of wall time per fingerprint of one 512-float row, 22-59 us fed in smaller pieces.
    Up to 64 KiB, no update is that large; larger data goes in one update."""
    request = _one_tensor(size)
    expected = fingerprint(request, ["y"])
    updates: list[int] = []
    monkeypatch.setattr(hashlib, "sha256", lambda: _RecordingDigest(updates))
    assert fingerprint(request, ["y"]) == expected
    assert sum(updates) == size + 8 + 4 + 8 + 2 * 8 + 8 + 1 + len(b"outputs") + 8 + 1
    if size <= 64 * 1024:
        assert max(updates) < 2048, updates
    else:
        assert size in updates, "hashed in one update"
