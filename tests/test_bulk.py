"""Bulk jobs over InferStream: the server's credit window and per-item answers, and the
client's ordered results, retries and resumption after a cut connection."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from laneserve import client as lc
from laneserve.client import _channel as lc_channel
from laneserve.client._request import MAX_REQUEST_ID_BYTES as CLIENT_MAX_REQUEST_ID_BYTES
from laneserve.client._sync import SOURCE_THREAD
from laneserve.client.tensors import encode_tensor
from laneserve.server import Engine, LaneConfig, LaneServer, ServerConfig, streams
from laneserve.server.clock import ManualClock
from laneserve.server.demo_model import make_demo_model
from laneserve.server.events import RequestTrace
from laneserve.server.grpc_methods import MAX_REQUEST_ID_BYTES
from laneserve.server.items import InferenceRequest
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.service import ROOM_POLL_MAX_S, InferenceServicer
from laneserve.server.stats import Duration
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import (
    RecordingEngine,
    Serving,
    TcpProxy,
    cut_while_a_batch_runs,
    estimate_once,
    item_reason,
    observed_stream_windows,
    output,
    queued_rows,
    refusing_port,
    request,
    rich_status,
    rows,
    save_model,
    serving,
    until,
    until_stats,
)

pytestmark = pytest.mark.usefixtures("no_backoff_sleeps")

F32 = npt.NDArray[np.float32]


def config(model: Path, **fields: Any) -> ServerConfig:
    if "lanes" in fields:
        fields.setdefault("default_lane", fields["lanes"][-1].name)
    return ServerConfig(model_path=str(model), **fields)


def bulk_lane(capacity_rows: int) -> tuple[LaneConfig, ...]:
    return (
        LaneConfig("interactive", capacity_rows=64, timeout_ms=60_000, max_wait_ms=0, min_share=0),
        LaneConfig("bulk", capacity_rows, timeout_ms=60_000, max_wait_ms=0, min_share=0),
    )


def small_reference(small_model: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(small_model), providers=["CPUExecutionProvider"])


def tagged(count: int) -> F32:
    """`count` rows whose first value is their index: the engine's record names each."""
    return rows(count, seed=11, start=0)


# ---- the client: whole jobs ------------------------------------------------------------


def test_bulk_job_of_100k_rows_equals_session_run(
    small_model: Path, small_reference: ort.InferenceSession
) -> None:
    """Through the blocking client: 100 000 rows in items of 100, results in order."""
    x = tagged(100_000)

    async def scenario() -> tuple[list[lc.StreamResult], RecordingEngine]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:

            def job() -> list[lc.StreamResult]:
                with lc.Client(s.target) as client:
                    return list(client.stream({"input": x}, rows_per_item=100, window=64))

            return await asyncio.to_thread(job), engine

    results, engine = asyncio.run(scenario())
    assert [result.index for result in results] == list(range(1000))
    assert all(result.ok and result.attempts == 1 for result in results)
    got = np.concatenate([result.unwrap()["output"] for result in results])
    np.testing.assert_allclose(
        got, small_reference.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6
    )
    assert sorted(engine.ran_tags) == list(range(100_000)), "every row ran exactly once"


def test_cut_connections_mid_job_resume_with_identical_output(
    small_model: Path, small_reference: ort.InferenceSession, caplog: pytest.LogCaptureFixture
) -> None:
    """The network is cut while batches run, several times; the job resumes each time
    on a new connection, resending only unanswered items. The output equals
    session.run, and no row runs twice: the server answers the resent items that had
    run from its replay cache. Each break is logged at WARNING (each call answered
    something first): at the default level a job's log said nothing of them."""
    x = tagged(100_000)
    caplog.set_level(logging.WARNING, logger="laneserve.client")

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with (
            proxied(engine, config(small_model)) as (proxy, target),
            lc.AsyncClient(target) as client,
        ):
            results: list[lc.StreamResult] = []
            cuts = 0
            async for result in client.stream({"input": x}, rows_per_item=50):
                results.append(result)
                if len(results) in (400, 800, 1200, 1600):
                    cuts += bool(await cut_while_a_batch_runs(engine, proxy))
            stats = await client.stats()
        assert cuts == 4
        assert proxy.connections >= 1 + cuts, "each cut was followed by a new call"
        assert [result.index for result in results] == list(range(2000))
        got = np.concatenate([result.unwrap()["output"] for result in results])
        np.testing.assert_allclose(
            got, small_reference.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6
        )
        assert sorted(engine.ran_tags) == list(range(100_000)), "no row ran twice"
        assert stats.idempotent_replays + stats.idempotent_joins > 0
        broke = [record for record in caplog.records if "call broke" in record.getMessage()]
        assert len(broke) >= cuts
        assert {record.levelno for record in broke} == {logging.WARNING}

    asyncio.run(scenario())


def test_a_job_whose_items_are_all_answered_ends_though_its_call_then_breaks(
    small_model: Path,
) -> None:
    """The connection went away after the last answer, before the call's own end: gRPC's
    half-close raised its internal ExecuteBatchError, which the job took for its source's
    failure and raised; with that caught, it reopened calls with nothing to send for
    STREAM_RESUME_S and raised UnavailableError, every result delivered."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with (
            proxied(engine, config(small_model)) as (proxy, target),
            lc.AsyncClient(target) as client,
        ):
            items = [{"input": rows(1, start=10 * index)} for index in range(3)]
            got: list[int] = []
            async for result in client.stream(items, window=1):
                got.append(result.index)
                if len(got) == len(items):
                    await proxy.close()  # the server's host goes away, for good
            connections = proxy.connections
        assert got == [0, 1, 2]
        assert connections == 1, "no call was reopened with nothing left to send"

    asyncio.run(scenario())


def test_a_job_whose_connection_goes_silent_does_not_wait_for_ever(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's host went silent after the first answer (no reset: a network black
    hole): the job waited for the rest for ever, its call open with no deadline. The
    client's HTTP/2 pings now find the connection dead (by default within ~5 min 20 s;
    here, their times shortened, ~2 s) and the job resumes on a new call, here in vain:
    it gives up naming what it left unanswered."""
    monkeypatch.setattr(
        lc_channel,
        "KEEPALIVE_OPTIONS",
        (
            ("grpc.keepalive_time_ms", 500),
            ("grpc.keepalive_timeout_ms", 1_000),
            ("grpc.http2.ping_timeout_ms", 1_000),
        ),
    )

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with proxied(engine, config(small_model)) as (proxy, target):
            got: list[int] = []
            # Connecting through the silent relay times out after 1 s, not 20.
            connect = [("grpc.min_reconnect_backoff_ms", 1_000)]
            async with lc.AsyncClient(target, options=connect) as client:

                async def job() -> None:
                    items = [{"input": rows(1, start=10 * index)} for index in range(3)]
                    async for result in client.stream(items, window=1):
                        got.append(result.index)
                        proxy.silent = True

                with pytest.raises(lc.UnavailableError) as caught:
                    await asyncio.wait_for(job(), timeout=60)
        assert got == [0]
        assert "1 item(s) read and unanswered" in " ".join(caught.value.__notes__)

    asyncio.run(scenario())


def test_an_item_whose_answer_is_over_what_the_client_reads_fails_alone(
    tmp_path: Path,
) -> None:
    """The client reads at most 1 MiB, the server sends up to 64 MiB: an 8-row item's
    answer (1.6 MB, 50 000 floats a row) ended the whole call in the client's gRPC
    ("Received message larger than max"), every later item unanswered and the job
    failed, a resumed job again. The client sends its limit with the call: the server
    answers that item ANSWER_TOO_LARGE alone, and the job goes on."""
    model = tmp_path / "wide.onnx"
    make_demo_model(model, hidden_dim=16, hidden_layers=1, output_dim=50_000)

    async def scenario() -> tuple[list[lc.StreamResult], pb.GetStatsResponse]:
        engine = RecordingEngine(str(model))
        async with (
            serving(engine, config(model)) as s,
            lc.AsyncClient(s.target, max_message_bytes=1 << 20) as client,
        ):
            items = [
                {"input": rows(count, start=10 * index)}
                for index, count in enumerate((1, 1, 8, 1, 1))
            ]
            results = await collect(client.stream(items, window=1))
            return results, await client.stats()

    results, stats = asyncio.run(scenario())
    assert [result.ok for result in results] == [True, True, False, True, True]
    error = results[2].error
    assert isinstance(error, lc.AnswerTooLargeError)
    assert "is 1600" in str(error)
    assert "over the largest message this caller reads (1048576 bytes" in str(error)
    assert results[2].attempts == 1, "not retried: a retry gets the same answer"
    bulk = next(lane for lane in stats.lanes if lane.name == "bulk")
    assert bulk.answered["ANSWER_TOO_LARGE"] == 1, "counted as what its caller got"
    assert bulk.answered["OK"] == 4
    assert bulk.rejected["ANSWER_TOO_LARGE"] == 0, "it was admitted"


def test_an_answer_too_large_for_its_submitter_but_read_by_a_joined_retry_counts_ok(
    tmp_path: Path,
) -> None:
    """A stream item that reads at most 1 KiB queues a request whose answer is 4 KiB; a
    unary retry with its id, which reads what the server sends, joins it. The answer goes
    to the retry, OK, and to the item, ANSWER_TOO_LARGE: the request is counted OK (what
    the best placed of its callers got) and the item's refusal as its lane's. Judged by the
    submitting item's limit alone, the request was counted ANSWER_TOO_LARGE, and no caller
    was counted as answered OK."""
    wide = tmp_path / "wide.onnx"
    make_demo_model(wide, input_dim=4, hidden_layers=0, output_dim=1024)  # 4 KiB per row
    x = np.ones((1, 4), dtype=np.float32)
    shared = pb.InferRequest(request_id="shared", lane="bulk", inputs=[encode_tensor("input", x)])

    async def scenario() -> tuple[pb.InferStreamResponse, pb.InferResponse, pb.GetStatsResponse]:
        engine = RecordingEngine(str(wide))
        async with serving(engine, config(wide)) as s:
            engine.hold()
            call = s.stub.InferStream(
                iter([shared]), metadata=(("laneserve-max-receive-bytes", "1024"),)
            )
            item = asyncio.ensure_future(anext(aiter(call)))
            assert await asyncio.to_thread(engine.entered.acquire, True, 10)
            retry = asyncio.ensure_future(s.stub.Infer(shared, timeout=30))

            await until_stats(s, lambda stats: stats.idempotent_joins >= 1)
            engine.release()
            answered = (await item, await retry)
            call.cancel()
            return *answered, await s.stub.GetStats(pb.GetStatsRequest())

    item, retry, stats = asyncio.run(scenario())
    assert item.error.message.startswith("the answer to request 'shared' is ")
    assert "over the largest message this caller reads (1024 bytes" in item.error.message
    assert len(retry.outputs) == 1
    bulk = next(lane for lane in stats.lanes if lane.name == "bulk")
    assert (bulk.admitted, dict(bulk.answered)) == (1, {"OK": 1})
    assert bulk.rejected["ANSWER_TOO_LARGE"] == 1, "the item's refusal, counted once"


def tiled_model(path: Path, times: int) -> None:
    """x [N, K] -> y = x tiled `times` times along K: [N, times * K]. An answer's size
    depends on the inputs' width, so no client can know it before it comes."""
    repeats = helper.make_tensor("repeats", TensorProto.INT64, [2], [1, times])
    graph = helper.make_graph(
        [helper.make_node("Tile", ["x", "repeats"], ["y"])],
        "tiled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "K"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", None])],
        [repeats],
    )
    save_model(path, graph, check=False)


def test_an_answer_of_dynamic_size_over_what_the_client_reads_fails_alone(
    tmp_path: Path,
) -> None:
    """An output whose size depends on the item (here 1 000 times its input's width):
    the wide item's answer (1.2 MB) is over the 1 MiB this client reads. It fails alone,
    and a retry of it from a client that reads more is answered from the replay cache,
    not run again."""
    model = tmp_path / "tiled.onnx"
    tiled_model(model, times=1_000)
    widths = (3, 3, 300, 3)

    async def scenario() -> tuple[list[lc.StreamResult], dict[str, npt.NDArray[Any]], int]:
        async with serving(Engine(str(model), estimate=estimate_once), config(model)) as s:
            items = [
                {"x": np.full((1, width), index, np.float32)} for index, width in enumerate(widths)
            ]
            async with lc.AsyncClient(s.target, max_message_bytes=1 << 20) as client:
                results = await collect(client.stream(items, window=1, job_id="tiled"))
            async with lc.AsyncClient(s.target, max_message_bytes=1 << 20) as client:
                retry = lc.StreamRequest(items[2], request_id="tiled-2")
                (again,) = await collect(client.stream([retry]))
                assert isinstance(again.error, lc.AnswerTooLargeError), "replayed: refused"
            async with lc.AsyncClient(s.target) as client:  # reads up to 64 MiB
                runs = (await client.stats()).batches
                retried = await client.infer(items[2], lane="bulk", request_id="tiled-2")
                stats = await client.stats()
                assert stats.batches == runs, "answered from the replay cache"
            bulk = next(lane for lane in stats.lanes if lane.name == "bulk")
            assert bulk.answered["ANSWER_TOO_LARGE"] == 1
            assert bulk.rejected["ANSWER_TOO_LARGE"] == 1, "the replay refused"
            return results, retried, runs

    results, retried, runs = asyncio.run(scenario())
    assert [result.ok for result in results] == [True, True, False, True]
    assert runs == len(widths)
    assert isinstance(results[2].error, lc.AnswerTooLargeError)
    assert "is 1200" in str(results[2].error)
    outputs = results[3].outputs
    assert outputs is not None
    assert outputs["y"].shape == (1, 3_000)
    assert np.all(outputs["y"] == 3)
    assert retried["y"].shape == (1, 300_000)
    assert np.all(retried["y"] == 2)


@pytest.mark.parametrize("value", ["100", "lots", "1e6", "-2048", "0x800", "0" * 5000 + "5"])
def test_a_stream_with_a_malformed_receive_limit_is_refused_with_what_was_expected(
    small_model: Path, value: str
) -> None:
    """The limit is read before any item. The call sends none: an item written while the
    server ends the call makes gRPC's client report INTERNAL ("Internal error from Core",
    its own race) in place of the server's status, which this test is about."""

    async def scenario() -> grpc.aio.AioRpcError:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            call = s.stub.InferStream(
                iter(()),
                metadata=(("laneserve-max-receive-bytes", value),),
            )
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await collect(call)
            return raised.value

    error = asyncio.run(scenario())
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"laneserve-max-receive-bytes is [{value!r}"[:60] in (error.details() or "")
    assert "expected one whole number of bytes, at least 1024" in (error.details() or "")


@pytest.mark.parametrize("value", ["9" * 5000, "0" * 30 + "4096"])
def test_a_receive_limit_of_many_digits_is_read(small_model: Path, value: str) -> None:
    """Over 4 300 digits Python refuses to convert a number: the stream failed UNKNOWN,
    with a traceback in the server's log. A limit past any message size is none."""

    async def scenario() -> pb.InferStreamResponse:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            call = s.stub.InferStream(
                iter([request(rows(1), request_id="a")]),
                metadata=(("laneserve-max-receive-bytes", value),),
            )
            (answer,) = await collect(call)
            assert isinstance(answer, pb.InferStreamResponse)
            return answer

    answer = asyncio.run(scenario())
    assert answer.WhichOneof("result") == "response"


def test_an_async_source_waiting_for_its_next_item_survives_a_cut_connection(
    small_model: Path,
) -> None:
    """The connection is cut while an async source is producing its next item (waiting
    for its data). The item is not cancelled with the broken call: the next call sends
    it and the rest, and no item is lost."""
    first, second = 4, 4
    gate = asyncio.Event()
    state = {"waiting": False, "cancelled": False}

    async def source() -> AsyncIterator[dict[str, F32]]:
        for index in range(first):
            yield {"input": rows(2, start=10 * index)}
        state["waiting"] = True
        try:
            await gate.wait()  # e.g. the producer waits for its next batch of data
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise
        for index in range(first, first + second):
            yield {"input": rows(2, start=10 * index)}

    async def scenario() -> list[lc.StreamResult]:
        engine = RecordingEngine(str(small_model))
        async with proxied(engine, config(small_model)) as (proxy, target):

            async def open_gate() -> None:
                # The job resumes on a new call meanwhile (results() runs on).
                await until(lambda: state["cancelled"] or proxy.connections >= 2)
                gate.set()

            opener: asyncio.Task[None] | None = None
            async with lc.AsyncClient(target) as client:
                results: list[lc.StreamResult] = []
                async for result in client.stream(source(), ordered=False, job_id="j"):
                    results.append(result)
                    if len(results) == first:
                        await until(lambda: state["waiting"])
                        assert proxy.sever() >= 1
                        opener = asyncio.create_task(open_gate())
                assert opener is not None
                await opener
                return results

    results = asyncio.run(scenario())
    assert not state["cancelled"], "the source was not cancelled with the broken call"
    assert sorted(result.index for result in results) == list(range(first + second))


def test_a_draining_server_ends_its_streams_and_the_job_goes_on_elsewhere(
    small_model: Path,
) -> None:
    """Instance A drains mid-job (a rolling restart; the address now leads to B). A's
    stream reads no more items and ends DRAINING once it has answered those it read, so
    the client resends the rest on a new call, which reaches B: every item is answered
    OK, every row ran once. (A stream left open refused each further item DRAINING; the
    client retried them on that call until their attempts ran out. And the item the
    source produced as the call ended was dropped: every later item took the index and
    request id of the one before it.)

    With real backoff: A reads what gRPC still holds before it stops, and sends gRPC's
    GOAWAY (the client's sign to reconnect) only then; a client that resent without
    pause spent its whole resume window on A's DRAINING answers in a few milliseconds."""
    first, second = 6, 6
    go = asyncio.Event()
    lc.set_testing(False)

    async def scenario() -> tuple[list[lc.StreamResult], list[int], list[int]]:
        async with behind_a_proxy(small_model) as (a, b, proxy, target):
            stopping: asyncio.Task[None] | None = None
            async with lc.AsyncClient(target) as client:
                results: list[lc.StreamResult] = []
                async for result in client.stream(
                    paused_at(first, first + second, go), job_id="rolling"
                ):
                    results.append(result)
                    if len(results) == first:
                        proxy.retarget(b.server.port)
                        stopping = asyncio.create_task(a.server.stop(grace_s=5.0))
                        await until(lambda: a.server.state is not Lifecycle.SERVING)
                        go.set()
            assert stopping is not None
            await stopping
        return results, ran_tags(a), ran_tags(b)

    results, ran_a, ran_b = asyncio.run(scenario())
    assert [result.index for result in results] == list(range(first + second))
    assert all(result.ok for result in results), [r.error for r in results if not r.ok]
    expected = sorted(10 * index + row for index in range(first + second) for row in (0, 1))
    assert sorted(ran_a + ran_b) == expected, "every row ran once, on A or on B"
    assert len(ran_b) == 2 * second, "the items after the drain ran on B"


def test_a_job_outlasts_a_restart_longer_than_its_retry_attempts(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server drains mid-job and its address answers nothing for 1.5 s (a restart),
    then leads to a new instance. The job's policy allows 3 attempts of at most 0.1 s
    backoff: it gave up after 3 broken calls, long before the server was back. A job
    that has had answers keeps reopening its call for STREAM_RESUME_S. The outage is
    logged once at WARNING (the drained call), its calls that broke again at INFO."""
    caplog.set_level(logging.INFO, logger="laneserve.client")
    first, second = 4, 4
    go = asyncio.Event()
    lc.set_testing(False)
    policy = lc.RetryPolicy(max_attempts=3, initial_backoff_s=0.02, max_backoff_s=0.1)

    async def scenario() -> tuple[list[lc.StreamResult], list[int]]:
        async with (
            behind_a_proxy(small_model) as (a, b, proxy, target),
            lc.AsyncClient(target, retry=policy) as client,
        ):
            results: list[lc.StreamResult] = []
            async for result in client.stream(
                paused_at(first, first + second, go), job_id="restart"
            ):
                results.append(result)
                if len(results) == first:
                    proxy.retarget(refusing_port())  # the address is down
                    await a.server.stop(grace_s=5.0)
                    asyncio.get_running_loop().call_later(1.5, proxy.retarget, b.server.port)
                    go.set()
            return results, ran_tags(b)

    results, ran_b = asyncio.run(scenario())
    assert [result.index for result in results] == list(range(first + second))
    assert all(result.ok for result in results), [r.error for r in results if not r.ok]
    assert sorted(ran_b) == sorted(
        10 * i + row for i in range(first, first + second) for row in (0, 1)
    )
    broke = [record.levelno for record in caplog.records if "call broke" in record.getMessage()]
    assert broke[0] == logging.WARNING
    assert len(broke) > 1, "the address answered nothing for a while: calls broke again"
    assert set(broke[1:]) == {logging.INFO}, broke


def test_in_test_mode_the_resume_window_counts_the_skipped_backoff(small_model: Path) -> None:
    """Test mode skips backoff sleeps, not the time they stand for: a job whose server
    went for good gives up once its backoffs add up to STREAM_RESUME_S, after a few
    calls. (It reopened its call without pause for 30 s of real time, ~1e4 calls.)"""
    first = 2
    go = asyncio.Event()
    policy = lc.RetryPolicy(max_attempts=2, initial_backoff_s=10.0, max_backoff_s=10.0)

    async def scenario() -> tuple[list[lc.StreamResult], lc.LaneserveError]:
        async with (
            behind_a_proxy(small_model) as (a, _b, proxy, target),
            lc.AsyncClient(target, retry=policy) as client,
        ):
            results: list[lc.StreamResult] = []

            async def consume() -> None:
                async for result in client.stream(paused_at(first, first + 2, go), job_id="gone"):
                    results.append(result)
                    if len(results) == first:
                        proxy.retarget(refusing_port())  # the address is down for good
                        await a.server.stop(grace_s=5.0)
                        go.set()

            with pytest.raises(lc.LaneserveError) as gave_up:
                await consume()
            return results, gave_up.value

    results, error = asyncio.run(scenario())
    assert [result.index for result in results] == list(range(first))
    # Backoffs of 5-10 s each: the 30 s window is spent after 3-6 broken calls, then the
    # policy's 2 in a row end the job.
    assert error.attempts is not None
    assert error.attempts <= 8, error.attempts
    assert "gave up" in "".join(getattr(error, "__notes__", []))


def test_a_stream_open_when_the_server_drains_answers_what_it_read_and_ends(
    small_model: Path,
) -> None:
    """At the raw protocol: an item running when the drain begins is answered; the
    stream then ends UNAVAILABLE (DRAINING) instead of reading more; a stream opened
    during the drain is refused at once."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            sent: asyncio.Queue[pb.InferRequest | None] = asyncio.Queue()
            engine.hold()
            call = s.stub.InferStream(fed(sent))
            sent.put_nowait(request(rows(2, start=0), request_id="running"))
            await asyncio.to_thread(engine.entered.acquire)
            # Grace far past what the steps before the release take (the drain ends as
            # soon as the held item is answered): past it, the held item was answered
            # UNAVAILABLE, its run's answer not kept, where a loaded machine took that long.
            stopping = asyncio.create_task(s.server.stop(grace_s=30.0))
            await until(lambda: s.server.state is not Lifecycle.SERVING)
            late = s.stub.InferStream(iter([request(rows(2, start=20), request_id="late")]))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(late)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert rich_status(refused.value)[0] == "DRAINING"
            sent.put_nowait(request(rows(2, start=10), request_id="after"))
            engine.release()
            answers: list[pb.InferStreamResponse] = []

            async def read_all() -> None:
                async for answer in call:  # kept as they come: the call ends in an error
                    answers.append(answer)  # noqa: PERF401

            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await read_all()
            await stopping
        assert [answer.request_id for answer in answers] == ["running"]
        assert answers[0].WhichOneof("result") == "response"
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert rich_status(ended.value)[0] == "DRAINING"
        assert "no more items" in (ended.value.details() or "")
        assert sorted(engine.ran_tags) == [0, 1], "the item sent after the drain never ran"

    asyncio.run(scenario())


def test_a_stream_opened_as_the_drain_begins_ends_draining_at_once(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain starts in the very loop turn the stream's handler does: its item reader
    is cancelled before its first step. The stream still ends DRAINING at once (it hung
    until the server's stop cancelled it, with no DRAINING)."""
    stopping: list[asyncio.Task[None]] = []
    servers: list[LaneServer] = []
    original = InferenceServicer.InferStream

    async def drain_as_it_opens(
        self: InferenceServicer, requests: AsyncIterator[pb.InferRequest], context: Any
    ) -> AsyncIterator[pb.InferStreamResponse]:
        stopping.append(asyncio.ensure_future(servers[0].stop(grace_s=5.0)))
        async for message in original(self, requests, context):
            yield message

    monkeypatch.setattr(InferenceServicer, "InferStream", drain_as_it_opens)

    async def scenario() -> grpc.aio.AioRpcError:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            servers.append(s.server)
            never = asyncio.Event()

            async def nothing_yet() -> AsyncIterator[pb.InferRequest]:
                await never.wait()
                yield request(rows(1), request_id="x")

            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(collect(s.stub.InferStream(nothing_yet())), 10)
            await stopping[0]
            return ended.value

    ended = asyncio.run(scenario())
    assert ended.code() == grpc.StatusCode.UNAVAILABLE
    assert rich_status(ended)[0] == "DRAINING"


def test_a_job_that_gives_up_on_a_draining_server_says_unavailable(small_model: Path) -> None:
    """A job started while the server drains, still writing items when the server ended
    its call DRAINING: gRPC's client put INTERNAL "Internal error from Core" in place of
    that status, and the job, out of attempts, raised it as a bare LaneserveError
    (INTERNAL, no reason, not retryable) that named no drain. It is UnavailableError."""
    items = [{"input": rows(4, start=index * 4)} for index in range(3000)]

    async def scenario() -> lc.LaneserveError:
        engine = RecordingEngine(str(small_model))
        async with (
            serving(engine, config(small_model)) as s,
            lc.AsyncClient(s.target) as client,
        ):
            engine.hold()  # the drain waits for this call
            busy = asyncio.ensure_future(client.infer({"input": rows(1)}))
            await asyncio.to_thread(engine.entered.acquire)
            # Grace far past the job's refusal (the drain ends once `busy` is answered):
            # past it, `busy` was answered UNAVAILABLE and the gather below raised.
            stopping = asyncio.ensure_future(s.server.stop(grace_s=30.0))
            await until(lambda: s.server.state is Lifecycle.DRAINING)
            with pytest.raises(lc.LaneserveError) as ended:
                async for _ in client.stream(items, window=256, retry=lc.NO_RETRIES):
                    pass
            engine.release()
            await asyncio.gather(stopping, busy)
        return ended.value

    error = asyncio.run(scenario())
    assert isinstance(error, lc.UnavailableError), repr(error)
    assert error.should_retry


def test_an_answer_over_the_message_limit_fails_its_item_not_the_stream(tmp_path: Path) -> None:
    """gRPC refuses to send a message over max_message_bytes and would end the stream
    with it, losing the other items' answers: that one item is answered with an error
    naming the sizes, and the stream goes on. The same request over Infer gets the same
    error (not gRPC's bare refusal to send), and both are counted as that error, not OK."""
    wide = tmp_path / "wide.onnx"
    make_demo_model(wide, input_dim=4, hidden_layers=0, output_dim=1024)  # 4 KiB per row

    def item(request_id: str, count: int) -> pb.InferRequest:
        x = np.ones((count, 4), dtype=np.float32)
        return pb.InferRequest(request_id=request_id, inputs=[encode_tensor("input", x)])

    async def scenario() -> tuple[dict[str, pb.InferStreamResponse], pb.GetStatsResponse]:
        engine = Engine(str(wide), estimate=estimate_once)
        async with serving(engine, ServerConfig(model_path=str(wide), max_message_bytes=8192)) as s:
            call = s.stub.InferStream(iter([item("ok1", 1), item("huge", 4), item("ok2", 1)]))
            answers = {answer.request_id: answer async for answer in call}
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.Infer(item("huge-unary", 4), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert rich_status(refused.value)[0] == "ANSWER_TOO_LARGE"
            assert "over the server's max_message_bytes (8192)" in (refused.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as again:
                await s.stub.Infer(item("huge-unary", 4), timeout=10)
            assert rich_status(again.value)[0] == "ANSWER_TOO_LARGE", "not replayed as OK"
            return answers, await s.stub.GetStats(pb.GetStatsRequest())

    answers, stats = asyncio.run(scenario())
    assert sorted(answers) == ["huge", "ok1", "ok2"]
    assert answers["ok1"].WhichOneof("result") == answers["ok2"].WhichOneof("result") == "response"
    error = answers["huge"].error
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "over the server's max_message_bytes (8192); expected fewer rows" in error.message
    answered = {lane.name: dict(lane.answered) for lane in stats.lanes}
    assert answered["bulk"] == {"OK": 2, "ANSWER_TOO_LARGE": 1}
    assert answered["standard"] == {"ANSWER_TOO_LARGE": 2}


def test_an_over_long_request_id_is_refused_alone_and_the_stream_goes_on(
    tmp_path: Path,
) -> None:
    """A request_id near max_message_bytes made its item's answer (the id echoed beside a
    status) larger than gRPC sends: the whole stream ended RESOURCE_EXHAUSTED "Sent
    message larger than max", with every other item's answer. An id over
    MAX_REQUEST_ID_BYTES is refused INVALID_ARGUMENT, naming the limit and its length,
    over Infer too; its stream answer carries an empty request_id (the id is what did not
    fit). An error message quoting a long field (a lane's name) is cut to fit its answer,
    and an id at the limit is served, at the smallest max_message_bytes."""
    tiny = tmp_path / "tiny.onnx"
    make_demo_model(tiny, input_dim=4, hidden_layers=0, output_dim=4)
    long_id = "x" * 960  # with its row, the request is within the 1024 bytes
    at_limit = "y" * MAX_REQUEST_ID_BYTES

    def item(request_id: str, **fields: Any) -> pb.InferRequest:
        x = np.ones((1, 4), dtype=np.float32)
        return pb.InferRequest(request_id=request_id, inputs=[encode_tensor("input", x)], **fields)

    async def scenario() -> tuple[list[pb.InferStreamResponse], pb.GetStatsResponse]:
        engine = Engine(str(tiny), estimate=estimate_once)
        async with serving(engine, ServerConfig(model_path=str(tiny), max_message_bytes=1024)) as s:
            items = [item("a"), item(long_id), item("lane", lane="l" * 900), item(at_limit)]
            answers = [answer async for answer in s.stub.InferStream(iter(items), timeout=30)]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.Infer(item(long_id), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request_id is 960 bytes, over the limit of 256 bytes" in (
                refused.value.details() or ""
            )
            return answers, await s.stub.GetStats(pb.GetStatsRequest())

    answers, stats = asyncio.run(scenario())
    assert all(answer.ByteSize() <= 1024 for answer in answers)
    by_id = {answer.request_id: answer for answer in answers}
    assert sorted(by_id) == ["", "a", "lane", at_limit]
    assert by_id["a"].WhichOneof("result") == by_id[at_limit].WhichOneof("result") == "response"
    refused = by_id[""].error
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "request_id is 960 bytes, over the limit of 256 bytes" in refused.message
    assert "xxxx" in refused.message, "its start is quoted"
    assert len(refused.message) < 200, "not the whole id"
    lane = by_id["lane"].error
    assert lane.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert lane.message.startswith("unknown lane 'lll")
    assert "(message cut: " in lane.message
    rejected = {lane.name: dict(lane.rejected) for lane in stats.lanes}
    assert rejected["bulk"] == {"INVALID_INPUT": 1}  # the long id's item
    assert rejected["standard"] == {"INVALID_INPUT": 2}  # the unknown lane, the unary call


def test_stream_items_without_a_request_id_are_answered_in_the_order_they_came(
    small_model: Path,
) -> None:
    """An item without a request_id runs, deduplicated by nothing, as a unary call
    without one; its caller has no id to match its answer by, so the answers of such
    items come in the order the items came (`AnswerOrder`), those with ids as they
    complete. A held batch, then a bulk item without an id, an interactive one with an
    id and an interactive one without: both interactive items run before the bulk one;
    the one with an id is answered at once, the other after the bulk one."""

    async def scenario() -> tuple[list[pb.InferStreamResponse], pb.GetStatsResponse]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=4)) as s:
            sent: asyncio.Queue[pb.InferRequest | None] = asyncio.Queue()
            engine.hold()
            answers = asyncio.ensure_future(collect(s.stub.InferStream(fed(sent))))
            sent.put_nowait(request(rows(4, start=0), request_id="held"))
            await asyncio.to_thread(engine.entered.acquire)
            sent.put_nowait(request(rows(4, start=10)))
            sent.put_nowait(request(rows(4, start=20), request_id="a", lane="interactive"))
            sent.put_nowait(request(rows(4, start=30), lane="interactive"))
            await until(lambda: queued_rows(s) == 12)
            engine.release()
            sent.put_nowait(None)
            return await answers, await s.stub.GetStats(pb.GetStatsRequest())

    answers, stats = asyncio.run(scenario())
    assert [(answer.request_id, answer.response.timing.lane) for answer in answers] == [
        ("held", "bulk"),
        ("a", "interactive"),
        ("", "bulk"),
        ("", "interactive"),
    ]
    assert all(answer.WhichOneof("result") == "response" for answer in answers)
    (bulk,) = [lane for lane in stats.lanes if lane.name == "bulk"]
    assert (bulk.admitted, dict(bulk.rejected)) == (2, {})


def test_an_item_over_the_message_limit_fails_alone_and_the_job_goes_on(
    small_model: Path,
) -> None:
    """gRPC refuses to send (client) or read (server) a message over its limit and fails
    the whole call: every item of the job was lost with it. The client answers such an
    item itself, with the limit named: the server's (reported by GetModel) or its own,
    whichever is smaller."""
    items = [{"input": rows(count, start=100 * index)} for index, count in enumerate([2, 40, 2])]

    async def scenario() -> tuple[list[lc.StreamResult], list[lc.StreamResult]]:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_message_bytes=64 * 1024)
        async with serving(engine, server_config) as s:
            async with lc.AsyncClient(s.target) as client:  # 40 rows: ~80 KiB
                by_server = [result async for result in client.stream(items)]
            async with lc.AsyncClient(s.target, max_message_bytes=16 * 1024) as client:
                small = [{"input": rows(count)} for count in (2, 10, 2)]  # 10 rows: ~20 KiB
                by_client = [result async for result in client.stream(small)]
        return by_server, by_client

    by_server, by_client = asyncio.run(scenario())
    for results, limit in ((by_server, 64 * 1024), (by_client, 16 * 1024)):
        assert [result.ok for result in results] == [True, False, True]
        error = results[1].error
        assert isinstance(error, lc.ResourceExhaustedError)
        assert "bulk stream item 1 is " in error.message
        assert f"({limit} bytes, max_message_bytes); expected fewer rows per item" in error.message


def test_a_job_of_text_rows_is_split_and_sized_by_its_encoded_text(text_model: Path) -> None:
    """A mapping of text arrays (str_, and UTF-8 bytes_) split into items of 3 rows, on
    both clients: answered in order with object arrays of str; the item whose text
    fails the model fails alone (its row named), and the item whose text alone is over
    the client's 2 KiB limit fails alone too, never sent: each item is sized by its
    encoded text, not by its rows."""
    text = np.array(["cat", "dög", "bird", "x" * 3000, "zebra", "dog", "", "cat", "été"])
    numbers = np.array([[str(row), "0.5"] for row in range(9)])
    numbers[7, 1] = "seven"  # item 2's second row
    expected = np.char.add(text.astype(object), "!")

    async def scenario() -> list[list[lc.StreamResult]]:
        engine = Engine(str(text_model), estimate=estimate_once)
        async with serving(engine, config(text_model)) as s:
            inputs = {"text": text, "numbers": np.char.encode(numbers, "utf-8")}
            async with lc.AsyncClient(s.target, max_message_bytes=2048) as client:
                by_async = [result async for result in client.stream(inputs, rows_per_item=3)]

            def job() -> list[lc.StreamResult]:
                with lc.Client(s.target, max_message_bytes=2048) as sync_client:
                    return list(sync_client.stream(inputs, rows_per_item=3))

            return [by_async, await asyncio.to_thread(job)]

    for results in asyncio.run(scenario()):
        assert [(result.index, result.ok) for result in results] == [
            (0, True),
            (1, False),
            (2, False),
        ]
        outputs = results[0].unwrap()
        assert outputs["tagged"].dtype == np.dtype(object)
        assert outputs["tagged"].tolist() == expected[:3].tolist()
        np.testing.assert_array_equal(outputs["label"], [0, -1, 2])
        np.testing.assert_array_equal(outputs["value"], [[0, 0.5], [1, 0.5], [2, 0.5]])
        over = results[1].error
        assert isinstance(over, lc.ResourceExhaustedError)
        assert results[1].attempts == 0, "never sent"
        assert "(2048 bytes, max_message_bytes); expected fewer rows per item" in over.message
        failed = results[2].error
        assert isinstance(failed, lc.EngineError)
        assert failed.metadata.get("row") == "1"


def test_results_are_ordered_unless_asked_otherwise(small_model: Path) -> None:
    """Item 1 is refused at once while item 0 runs: unordered, it comes first."""
    items = [{"input": rows(2, start=0)}, {"input": rows(9)}, {"input": rows(2, start=10)}]

    async def scenario(*, ordered: bool) -> list[int]:
        engine = RecordingEngine(str(small_model))
        server = serving(engine, config(small_model, lanes=bulk_lane(8)))
        async with server as s, lc.AsyncClient(s.target) as client:
            engine.hold()
            # No row window: the 9-row item is sent while item 0 is out.
            results = client.stream(items, ordered=ordered, window_rows=1000)
            first = asyncio.ensure_future(anext(results))
            await asyncio.to_thread(engine.entered.acquire)  # item 0 is in the session
            await until_stats(s, lambda stats: stats.lanes[1].rejected["INVALID_INPUT"] == 1)
            if ordered:
                # Item 1's answer has reached the client while item 0 is held: it comes
                # second only when the client holds it back for item 0.
                (job,) = client._jobs
                await until(lambda: job._server_answers == 1)
            else:
                await asyncio.wait_for(asyncio.shield(first), timeout=10)
            engine.release()
            return [(await first).index] + [result.index async for result in results]

    assert asyncio.run(scenario(ordered=True)) == [0, 1, 2]
    assert asyncio.run(scenario(ordered=False))[0] == 1


def test_failed_items_are_results_and_the_job_goes_on(small_model: Path) -> None:
    items: list[lc.StreamRequest | dict[str, F32]] = [
        {"input": rows(1)},
        {"input": rows(1)[:, :100]},  # wrong shape: refused by the server
        lc.StreamRequest({"input": rows(2)}, request_id="mine"),
        {"input": np.zeros((1, 512), np.complex64)},  # no wire type: refused by the client
        {"input": rows(3)},
    ]

    async def scenario() -> list[lc.StreamResult]:
        server = serving(RecordingEngine(str(small_model)), config(small_model))
        async with server as s, lc.AsyncClient(s.target) as client:
            return [result async for result in client.stream(items, job_id="job7")]

    results = asyncio.run(scenario())
    assert [result.ok for result in results] == [True, False, True, False, True]
    assert [result.request_id for result in results] == [
        "job7-0",
        "job7-1",
        "mine",
        "job7-3",
        "job7-4",
    ]
    assert isinstance(results[1].error, lc.InvalidInputError)
    assert "shape [1, 100]" in results[1].error.message
    assert isinstance(results[3].error, lc.InvalidInputError)
    assert results[3].attempts == 0, "never sent"
    # Named by its item, as every item's error is (it named only the tensor).
    assert results[3].error.message.startswith(
        "bulk stream item 3: tensor 'input': numpy dtype complex64 is not supported"
    ), results[3].error.message
    assert results[4].unwrap()["output"].shape == (3, 10)
    # An answered item has the server's timing (as infer_detailed's); a failed one none.
    timing = results[4].timing
    assert timing is not None
    assert (timing.lane, timing.infer_us > 0) == ("bulk", True)
    assert results[1].timing is None
    assert results[3].timing is None
    with pytest.raises(lc.InvalidInputError):
        results[1].unwrap()


def test_an_item_reusing_an_id_in_flight_fails_alone(small_model: Path) -> None:
    """An item whose own request_id is that of an item still unanswered ended the whole
    job with a ValueError (every other result lost): it is now answered with its error,
    never sent, and the job goes on."""
    items: list[lc.StreamRequest | dict[str, F32]] = [
        lc.StreamRequest({"input": rows(1, start=0)}, request_id="dup"),
        lc.StreamRequest({"input": rows(1, start=10)}, request_id="dup"),
        {"input": rows(1, start=20)},
    ]

    async def scenario() -> tuple[list[lc.StreamResult], list[int]]:
        engine = RecordingEngine(str(small_model))
        async with (
            serving(engine, config(small_model)) as s,
            lc.AsyncClient(s.target) as client,
        ):
            engine.hold()  # the first stays in flight while the others are taken
            collected = asyncio.ensure_future(collect(client.stream(items, job_id="j")))
            try:
                await asyncio.to_thread(engine.entered.acquire, True, 10.0)
            finally:
                engine.release()
            return await collected, engine.ran_tags

    results, ran = asyncio.run(scenario())
    assert [result.ok for result in results] == [True, False, True]
    error = results[1].error
    assert isinstance(error, lc.InvalidInputError)
    assert "'dup' is already in flight" in error.message
    assert results[1].attempts == 0, "never sent"
    assert sorted(ran) == [0, 20]


def test_an_item_with_its_own_request_id_is_named_by_it(small_model: Path) -> None:
    """A caller that streams some of its items only (a resumed `laneserve-client bulk`:
    items 7 and 9 of its job) numbers them its own way: a message naming the item by its
    index in the stream ("bulk stream item 1") named another item of the job. One with
    the job's own id for its index is named by its index."""
    items: list[Any] = [
        lc.StreamRequest({"input": rows(1)}, request_id="job-7"),
        lc.StreamRequest({"input": rows(1).tolist()}, request_id="job-9"),
        {"input": rows(1).tolist()},
    ]

    async def scenario() -> list[lc.StreamResult]:
        async with (
            serving(RecordingEngine(str(small_model)), config(small_model)) as s,
            lc.AsyncClient(s.target) as client,
        ):
            return await collect(client.stream(items, job_id="job"))

    results = asyncio.run(scenario())
    assert [result.ok for result in results] == [True, False, False]
    assert results[1].error is not None
    assert results[1].error.message.startswith("bulk stream request 'job-9': input 'input'")
    assert "item 1" not in results[1].error.message
    assert results[2].error is not None
    assert results[2].error.message.startswith("bulk stream item 2: input 'input'")


def test_an_item_of_a_wrong_type_fails_alone(small_model: Path) -> None:
    """An item the client cannot encode for its type (a list for the item or an input,
    None, an id that is no str) ended the job with a TypeError: the items sent before it
    lost their answers (a list at item 200 of 300: 13 results). Each is now answered with
    an InvalidInputError naming it, never sent, as an array of no wire type is, and the
    job goes on."""
    bad: dict[int, Any] = {
        200: [rows(1)],
        201: None,
        202: {"input": rows(1).tolist()},
        203: lc.StreamRequest({"input": rows(1)}, request_id=5),  # type: ignore[arg-type]
    }
    items: list[Any] = [bad.get(index, {"input": rows(1, start=index)}) for index in range(300)]

    async def scenario() -> list[lc.StreamResult]:
        async with (
            serving(RecordingEngine(str(small_model)), config(small_model)) as s,
            lc.AsyncClient(s.target) as client,
        ):
            return await collect(client.stream(items, job_id="typed", window=64))

    results = asyncio.run(scenario())
    assert [result.index for result in results] == list(range(300))
    assert [index for index, result in enumerate(results) if not result.ok] == sorted(bad)
    messages = {}
    for index in bad:
        error = results[index].error
        assert isinstance(error, lc.InvalidInputError)
        assert results[index].attempts == 0, "never sent"
        assert f"bulk stream item {index}" in error.message
        messages[index] = error.message
    assert "expected a mapping of input name to numpy array" in messages[200]
    assert "got list" in messages[200]
    assert "got NoneType" in messages[201]
    assert "input 'input': expected a numpy array, got list" in messages[202]
    assert "request_id 5: expected str, got int" in messages[203]
    assert results[299].unwrap()["output"].shape == (1, 10)


class SourceGoneError(Exception):
    """What a test's source raises."""


async def take_until_raised(results: AsyncIterable[lc.StreamResult], taken: list[Any]) -> None:
    """Appends `results` to `taken` as they come: those before an error are kept."""
    async for result in results:
        taken.append(result)  # noqa: PERF401 - not a comprehension: it would keep none


def test_a_source_that_raises_answers_what_it_gave_then_raises(small_model: Path) -> None:
    """A source that raised ended the job at once, the answers to the items already sent
    dropped, with no word of them. The items it gave are now answered (yielded), and then
    its own exception is raised, noting how many were."""

    def failing() -> Iterator[dict[str, F32]]:
        for index in range(50):
            yield {"input": rows(1, start=index)}
        raise SourceGoneError("the source's disk went away")

    async def failing_async() -> AsyncIterator[dict[str, F32]]:
        for item in failing():
            yield item

    async def scenario() -> tuple[list[lc.StreamResult], list[lc.StreamResult]]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:

            def job() -> list[lc.StreamResult]:
                taken: list[lc.StreamResult] = []
                with (
                    lc.Client(s.target) as client,
                    pytest.raises(SourceGoneError, match="disk went away") as raised,
                ):
                    taken.extend(client.stream(failing(), job_id="src", window=16))
                assert "the source raised after 50 item(s); all 50 were answered" in "\n".join(
                    raised.value.__notes__
                )
                return taken

            synced = await asyncio.to_thread(job)
            taken: list[lc.StreamResult] = []
            async with lc.AsyncClient(s.target) as client:
                results = client.stream(failing_async(), ordered=False)
                with pytest.raises(SourceGoneError, match="disk went away"):
                    await take_until_raised(results, taken)
            return synced, taken

    synced, unordered = asyncio.run(scenario())
    assert [result.index for result in synced] == list(range(50))
    assert all(result.ok for result in synced)
    assert sorted(result.index for result in unordered) == list(range(50))
    assert all(result.ok for result in unordered)


def test_an_item_with_an_over_long_request_id_fails_alone_and_is_never_sent(
    small_model: Path,
) -> None:
    """The server refuses a request_id over its limit with an answer that carries no id
    (the id is what would not fit): the client could not match it to its item. The
    client answers such an item itself, with the server's limit named, never sends it,
    and the job goes on."""
    items: list[lc.StreamRequest | dict[str, F32]] = [
        lc.StreamRequest({"input": rows(1, start=0)}, request_id="z" * (MAX_REQUEST_ID_BYTES + 1)),
        {"input": rows(1, start=10)},
    ]

    async def scenario() -> tuple[list[lc.StreamResult], list[int]]:
        engine = RecordingEngine(str(small_model))
        async with (
            serving(engine, config(small_model)) as s,
            lc.AsyncClient(s.target) as client,
        ):
            return await collect(client.stream(items, job_id="j")), engine.ran_tags

    results, ran = asyncio.run(scenario())
    assert [result.ok for result in results] == [False, True]
    error = results[0].error
    assert isinstance(error, lc.InvalidInputError)
    assert f"request_id is {MAX_REQUEST_ID_BYTES + 1} bytes, over the server's limit of " in (
        error.message
    )
    assert results[0].attempts == 0, "never sent"
    assert ran == [10]
    assert CLIENT_MAX_REQUEST_ID_BYTES == MAX_REQUEST_ID_BYTES


def test_a_stream_item_waits_for_room_in_its_full_lane(small_model: Path) -> None:
    """A raw InferStream of 4-row items into a 4-row lane, one batch held in the session:
    the second item fills the lane, the third waits for room instead of being refused
    LANE_FULL (a stream's window counts items: 256-row items, or two streams, had most
    of their items refused), and the stream reads no more items meanwhile, with a credit
    window larger than the job: the rest wait in gRPC's flow control, unread."""
    # Few enough items that the client's gRPC takes them all at once (~800 KiB): the
    # server's reading alone decides how many it holds.
    per_item, items = 4, 100

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(
            small_model,
            max_batch_size=per_item,
            lanes=bulk_lane(per_item),
            stream_window=100_000,
        )
        async with serving(engine, server_config) as s:
            producer = TaggedRequests(items, per_item, "w")
            engine.hold()
            answers = asyncio.ensure_future(collect(s.stub.InferStream(aiter(producer))))
            await asyncio.to_thread(engine.entered.acquire)
            await until(
                lambda: (
                    producer.produced == items
                    and queued_rows(s) == per_item
                    and _waiting_for_room(s, "bulk") > 0
                )
            )
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            # Read: the item in the session, the one in the lane, the one that found it
            # full, and at most the one whose read was under way then. A stream that read
            # on held every item of the job, each waiting for room.
            assert _waiting_for_room(s, "bulk") in (1, 2)
            assert dict(stats.lanes[1].rejected) == {}
            engine.release()
            responses = await answers
        assert sorted(r.request_id for r in responses) == sorted(f"w{i}" for i in range(items))
        assert all(r.WhichOneof("result") == "response" for r in responses)
        assert sorted(engine.ran_tags) == list(range(items * per_item))

    asyncio.run(scenario())


def _waiting_for_room(s: Serving, lane: str) -> int:
    servicer = s.server._servicer
    assert servicer is not None
    return len(servicer._room_lines.get(lane, ()))


def test_stream_items_waiting_for_room_in_a_lane_are_admitted_oldest_first(
    small_model: Path,
) -> None:
    """Two streams share a 64-row lane: one of 1-row items, one with a 48-row item that
    comes once the lane is full. Each waiting item polled for room on its own: the 1-row
    items took every row that freed, and the 48-row item waited until the other stream
    was done (until its deadline, answered LANE_FULL, under a longer job). Now the items
    waiting in a lane go in the order they began to wait."""
    small_items, large_rows, capacity = 200, 48, 64

    def small(index: int) -> pb.InferRequest:
        return request(rows(1, start=index), request_id=f"a{index}", lane="bulk")

    async def scenario() -> list[int]:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_batch_size=8, lanes=bulk_lane(capacity))
        async with serving(engine, server_config) as s:
            engine.hold()
            sent: asyncio.Queue[pb.InferRequest | None] = asyncio.Queue()
            smalls = asyncio.ensure_future(collect(s.stub.InferStream(fed(sent))))
            sent.put_nowait(small(0))
            await asyncio.to_thread(engine.entered.acquire)  # a batch held in the session
            for index in range(1, capacity + 2):  # the lane full, and one more waiting
                sent.put_nowait(small(index))
            await until(
                lambda: queued_rows(s, "bulk") == capacity and _waiting_for_room(s, "bulk") == 1
            )
            large_item = request(rows(large_rows, start=10_000), request_id="b", lane="bulk")
            large = asyncio.ensure_future(collect(s.stub.InferStream(iter([large_item]))))
            await until(lambda: _waiting_for_room(s, "bulk") == 2)  # behind the small one
            for index in range(capacity + 2, small_items):
                sent.put_nowait(small(index))
            sent.put_nowait(None)
            engine.release()
            answered = await smalls + await large
        assert len(answered) == small_items + 1
        assert all(r.WhichOneof("result") == "response" for r in answered)
        return engine.ran_tags

    ran = asyncio.run(scenario())
    assert ran.index(10_000) < ran.index(small_items - 1), "the large item went in its turn"


async def _fill_the_bulk_lane(
    s: Serving, engine: RecordingEngine
) -> tuple[asyncio.Future[pb.InferResponse], asyncio.Future[pb.InferResponse]]:
    """A 4-row bulk lane full: a 4-row call held in the session, another queued (their
    calls, to await once the engine is released)."""
    engine.hold()
    held = asyncio.ensure_future(s.stub.Infer(request(rows(4), lane="bulk")))
    await asyncio.to_thread(engine.entered.acquire)
    queued = asyncio.ensure_future(s.stub.Infer(request(rows(4), lane="bulk")))
    await until(lambda: queued_rows(s, "bulk") == 4)
    return held, queued


def test_a_stream_item_waiting_for_room_joins_a_call_with_its_id_that_began_meanwhile(
    small_model: Path,
) -> None:
    """A stream item waits for room in the full bulk lane; a call with its request_id and
    inputs comes in another lane and is queued. The item decided once, before its wait,
    that nothing held its id: it waited on for room it would not use (its answer then
    came from the ledger). It joins that call now, and the row runs once."""

    async def scenario() -> tuple[list[pb.InferStreamResponse], pb.InferResponse, list[int]]:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_batch_size=4, lanes=bulk_lane(4))
        async with serving(engine, server_config) as s:
            held, queued = await _fill_the_bulk_lane(s, engine)
            x = rows(1, start=77)
            item = request(x, request_id="x", lane="bulk")
            answers = asyncio.ensure_future(collect(s.stub.InferStream(iter([item]))))
            await until(lambda: _waiting_for_room(s, "bulk") == 1)
            call = asyncio.ensure_future(
                s.stub.Infer(request(x, request_id="x", lane="interactive"))
            )
            await until(lambda: _waiting_for_room(s, "bulk") == 0)  # joined, the lane full
            engine.release()
            await asyncio.gather(held, queued)
            return await answers, await call, engine.ran_tags

    (answer,), direct, ran = asyncio.run(scenario())
    assert answer.WhichOneof("result") == "response"
    assert output(answer.response).tolist() == output(direct).tolist()
    assert ran.count(77) == 1


def test_a_stream_item_waiting_for_room_at_the_drain_is_answered_draining(
    small_model: Path,
) -> None:
    """The drain ends the wait for room while the scheduler still admits (it stops a step
    later): the item was retried against the full lane in a loop that never yielded,
    holding the event loop until its timeout (the drain could not start) and counting a
    LANE_FULL each turn. It is answered DRAINING, counted once."""

    async def scenario() -> tuple[pb.InferStreamResponse, dict[str, int]]:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_batch_size=4, lanes=bulk_lane(4))
        async with serving(engine, server_config) as s:
            held, queued = await _fill_the_bulk_lane(s, engine)
            item = request(rows(4), request_id="w", lane="bulk", timeout_ms=3_000)
            answers = s.stub.InferStream(iter([item]))
            await until(lambda: _waiting_for_room(s, "bulk") == 1)
            s.server.state = Lifecycle.DRAINING  # as stop() sets it, one step before the rest
            answer = await asyncio.wait_for(answers.read(), timeout=10)
            s.server.state = Lifecycle.SERVING  # the real stop() follows, below
            engine.release()
            await asyncio.gather(held, queued)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        assert isinstance(answer, pb.InferStreamResponse)
        return answer, dict(stats.lanes[1].rejected)

    answer, rejected = asyncio.run(scenario())
    assert answer.WhichOneof("result") == "error"
    assert answer.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "draining: this item waited for room in its lane" in answer.error.message
    assert rejected == {"DRAINING": 1}


async def _in_line_for_room(
    s: Serving, ids: list[str]
) -> list[grpc.aio.StreamStreamCall[pb.InferRequest, pb.InferStreamResponse]]:
    """One stream per id, whose one 4-row item (tagged 1000 + 10 * its index) waits for
    room in the full bulk lane; in the order of `ids`: the first is the oldest."""
    calls: list[grpc.aio.StreamStreamCall[pb.InferRequest, pb.InferStreamResponse]] = []
    for index, request_id in enumerate(ids):
        item = request(rows(4, start=1000 + 10 * index), request_id=request_id, lane="bulk")
        calls.append(s.stub.InferStream(iter([item])))
        await until(lambda: _waiting_for_room(s, "bulk") == len(calls))
    return calls


def test_stream_items_waiting_behind_the_oldest_for_room_sleep_while_nothing_changes(
    small_model: Path,
) -> None:
    """Items of many streams wait for room in the full bulk lane (how a bulk backlog over
    many streams looks). Only the oldest looks for room, but each of the others woke
    every ROOM_POLL_MAX_S for its whole wait to look at the drain and the ledger: 2 500
    of them kept an idle server at 63 % of a core. While nothing changes they sleep: the
    oldest looks at its lane again and again, and the others' loops do not turn (each
    turn asks the ledger whether the item's id is held)."""
    ids, looks = [f"w{index}" for index in range(6)], 10

    async def scenario() -> list[pb.InferStreamResponse]:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_batch_size=4, lanes=bulk_lane(4))
        async with serving(engine, server_config) as s:
            thread, servicer = s.server._thread, s.server._servicer
            assert thread is not None
            assert servicer is not None
            room_wait_s, holds = thread.room_wait_s, servicer._ledger.holds
            turns: collections.Counter[str] = collections.Counter()  # by request_id
            lane_looks = 0

            def counted_holds(request_id: str) -> bool:
                turns[request_id] += 1
                return holds(request_id)

            def slowest_room_wait_s(lane: str, rows: int) -> float | None:
                # The oldest looks again after ROOM_POLL_MAX_S, its longest: its looks
                # count a stretch of time at least that long each.
                nonlocal lane_looks
                wait_s = room_wait_s(lane, rows)
                if wait_s is None:
                    return None
                lane_looks += 1
                return max(wait_s, ROOM_POLL_MAX_S)

            servicer._ledger.holds = counted_holds  # type: ignore[method-assign]
            thread.room_wait_s = slowest_room_wait_s  # type: ignore[method-assign]
            held, queued = await _fill_the_bulk_lane(s, engine)
            calls = await _in_line_for_room(s, ids)
            behind = {request_id: turns[request_id] for request_id in ids[1:]}
            looked = lane_looks
            await until(lambda: lane_looks >= looked + looks)
            woken = {request_id: turns[request_id] for request_id in ids[1:]}
            assert woken == behind, "the items behind the oldest woke while nothing changed"
            assert _waiting_for_room(s, "bulk") == len(ids)
            engine.release()
            await asyncio.gather(held, queued)
            return [answer for call in calls for answer in await collect(call)]

    answers = asyncio.run(scenario())
    assert [answer.request_id for answer in answers] == ids
    assert all(answer.WhichOneof("result") == "response" for answer in answers)


def test_a_stream_item_in_the_middle_of_the_line_for_room_joins_and_leaves_when_woken(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Items wait for room in the full bulk lane, none of them looking again for an hour
    (ROOM_POLL_MAX_S and the lane's predicted wait): only the event itself ends a wait.
    A call with the id of the item in the middle begins, in another lane: that item
    joins it while the others still wait and the lane is still full. The drain begins:
    every item leaves the line, answered DRAINING, before the batch held in the session
    ends (it waited on, woken only every ROOM_POLL_MAX_S to look)."""
    monkeypatch.setattr("laneserve.server.service.ROOM_POLL_MAX_S", 3600.0)
    ids = ["w0", "w1", "w2"]

    async def scenario() -> tuple[list[pb.InferStreamResponse], pb.InferResponse, list[int]]:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_batch_size=4, lanes=bulk_lane(4))
        async with serving(engine, server_config) as s:
            thread = s.server._thread
            assert thread is not None
            room_wait_s = thread.room_wait_s

            def an_hour_while_full(lane: str, rows: int) -> float | None:
                return None if room_wait_s(lane, rows) is None else 3600.0

            thread.room_wait_s = an_hour_while_full  # type: ignore[method-assign]
            held, queued = await _fill_the_bulk_lane(s, engine)
            calls = await _in_line_for_room(s, ids)
            same = request(rows(4, start=1010), request_id="w1", lane="interactive")
            direct = asyncio.ensure_future(s.stub.Infer(same))
            await until(lambda: _waiting_for_room(s, "bulk") == 2)
            assert queued_rows(s, "bulk") == 4
            stopping = asyncio.ensure_future(s.server.stop())
            await until(lambda: _waiting_for_room(s, "bulk") == 0)
            first, last = await calls[0].read(), await calls[2].read()
            assert not held.done()
            engine.release()
            await asyncio.gather(held, queued, stopping)
            joined = await calls[1].read()
            assert isinstance(first, pb.InferStreamResponse)
            assert isinstance(joined, pb.InferStreamResponse)
            assert isinstance(last, pb.InferStreamResponse)
            return [first, joined, last], await direct, engine.ran_tags

    (first, joined, last), direct, ran = asyncio.run(scenario())
    for left in (first, last):
        assert left.WhichOneof("result") == "error"
        assert "draining: this item waited for room in its lane" in left.error.message
    assert joined.WhichOneof("result") == "response"
    assert output(joined.response).tolist() == output(direct).tolist()
    assert ran.count(1010) == 1, "the item that joined ran no row again"


def test_a_stream_item_whose_stream_ends_while_it_waits_for_room_counts_cancelled(
    small_model: Path,
) -> None:
    """A stream item waits for room in the full bulk lane and its client cancels the
    stream: the item was read and never admitted, and was counted nowhere (GetStats'
    refusals and answers missed a request the server had read). It counts as its lane's
    refusal CANCELLED: its caller left."""

    async def scenario() -> dict[str, int]:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_batch_size=4, lanes=bulk_lane(4))
        async with serving(engine, server_config) as s:
            held, queued = await _fill_the_bulk_lane(s, engine)
            item = request(rows(4), request_id="w", lane="bulk")
            answers = s.stub.InferStream(iter([item]))
            await until(lambda: _waiting_for_room(s, "bulk") == 1)
            answers.cancel()
            await until(lambda: _waiting_for_room(s, "bulk") == 0)
            engine.release()
            await asyncio.gather(held, queued)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        (bulk,) = [lane for lane in stats.lanes if lane.name == "bulk"]
        assert dict(bulk.answered) == {"OK": 2}
        return dict(bulk.rejected)

    assert asyncio.run(scenario()) == {"CANCELLED": 1}


@contextlib.asynccontextmanager
async def _an_item_waiting_for_room(
    model: Path, waited_s: float, timeout_ms: int = 0
) -> AsyncIterator[tuple[Serving, Any]]:
    """On a manual clock, a served bulk lane of 4 rows full (one batch held in the
    session), and one stream item of 4 rows that has waited `waited_s` for room in it:
    the server and the item's stream. The lane's work is let go of at the end."""
    clock = ManualClock()
    engine = RecordingEngine(str(model))
    server_config = config(model, max_batch_size=4, lanes=bulk_lane(4))
    async with serving(engine, server_config, clock=clock) as s:
        held, queued = await _fill_the_bulk_lane(s, engine)
        item = request(rows(4), request_id="w", lane="bulk", timeout_ms=timeout_ms)
        answers = s.stub.InferStream(iter([item]))
        await until(lambda: _waiting_for_room(s, "bulk") == 1)
        clock.advance(waited_s)
        yield s, answers
        engine.release()
        await asyncio.gather(held, queued)


async def _reason_and_fail(s: Serving, answers: Any) -> tuple[str, Duration]:
    """The item's one answer's reason, and the server's `fail` total then."""
    answer = await asyncio.wait_for(answers.read(), timeout=10)
    assert isinstance(answer, pb.InferStreamResponse)
    return item_reason(answer), s.server.stats.cumulative().fail


def test_a_stream_item_refused_after_its_wait_for_room_counts_that_wait_in_fail(
    small_model: Path,
) -> None:
    """On a manual clock: a stream item waits 1.5 s for room in the full bulk lane, then
    its stream ends. Its refusal (CANCELLED) is counted in ModelStatistics' `fail` with
    those 1.5 s from its arrival (Triton's `fail` times a request from arrival to its
    failure), where every refusal counted 0 ns."""

    async def scenario() -> Duration:
        async with _an_item_waiting_for_room(small_model, 1.5) as (s, answers):
            answers.cancel()
            await until(lambda: _waiting_for_room(s, "bulk") == 0)
        return s.server.stats.cumulative().fail

    assert asyncio.run(scenario()) == Duration(1, 1_500_000_000)


def test_a_stream_item_refused_at_its_deadline_counts_its_wait_through_the_scheduler(
    small_model: Path,
) -> None:
    """An item waits for room in the full bulk lane until its own deadline (1 s; the
    clock moved 1.5 s): the scheduler refuses it LANE_FULL at admission, and its wait
    reaches the scheduler's refusal through the request it was handed (`arrived_s`)."""

    async def scenario() -> tuple[str, Duration]:
        async with _an_item_waiting_for_room(small_model, 1.5, timeout_ms=1_000) as (s, answers):
            return await _reason_and_fail(s, answers)

    assert asyncio.run(scenario()) == ("LANE_FULL", Duration(1, 1_500_000_000))


def test_a_stream_item_refused_draining_after_its_wait_counts_it(small_model: Path) -> None:
    """An item waits 2 s for room, then the server drains: refused DRAINING, counted in
    `fail` with its 2 s."""

    async def scenario() -> tuple[str, Duration]:
        async with _an_item_waiting_for_room(small_model, 2.0, timeout_ms=30_000) as (s, answers):
            s.server.state = Lifecycle.DRAINING
            got = await _reason_and_fail(s, answers)
            s.server.state = Lifecycle.SERVING
            return got

    assert asyncio.run(scenario()) == ("DRAINING", Duration(1, 2_000_000_000))


def test_a_stream_item_that_waited_for_room_counts_no_refusal(small_model: Path) -> None:
    """Items of two streams wait for room in the same full lane (one batch held in the
    session), and then all run: GetStats counts no refusal, every item is answered OK
    once, and each request's trace starts and ends exactly once, OK. Refusals by reason
    count only answers given as refusals, not an item's wait for room."""
    per_item, items = 4, 6
    waits: list[str] = []  # lanes an item found full
    traces: dict[str, list[str]] = {}  # request_id -> "start", then its end status

    async def scenario() -> tuple[list[pb.InferStreamResponse], pb.GetStatsResponse]:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_batch_size=per_item, lanes=bulk_lane(per_item))
        async with serving(engine, server_config) as s:
            thread, servicer = s.server._thread, s.server._servicer
            assert thread is not None
            assert servicer is not None
            room_wait_s, tracer = thread.room_wait_s, servicer._tracer

            def recording_room_wait_s(lane: str, rows: int) -> float | None:
                wait_s = room_wait_s(lane, rows)
                if wait_s is not None:
                    waits.append(lane)
                return wait_s

            class RecordingTracer:
                def start(
                    self, request_id: str, lane: str, rows: int, budget_s: float
                ) -> RequestTrace:
                    trace = tracer.start(request_id, lane, rows, budget_s)
                    marks = traces.setdefault(request_id, [])
                    marks.append("start")

                    class Recorded:
                        def replying(self) -> None:
                            trace.replying()

                        def end(self, status: str, *, late: bool = False) -> None:
                            marks.append(status)
                            trace.end(status, late=late)

                    return Recorded()

                def retried(self, request_id: str, lane: str, how: str) -> None:
                    tracer.retried(request_id, lane, how)

                def joined(self, request_id: str, lane: str) -> RequestTrace:
                    return tracer.joined(request_id, lane)

            thread.room_wait_s = recording_room_wait_s  # type: ignore[method-assign]
            servicer._tracer = RecordingTracer()
            engine.hold()
            calls = [
                asyncio.ensure_future(
                    collect(s.stub.InferStream(aiter(TaggedRequests(items, per_item, prefix))))
                )
                for prefix in ("a", "b")
            ]
            await asyncio.to_thread(engine.entered.acquire)
            await until(lambda: queued_rows(s, "bulk") == per_item and len(waits) >= 2)
            engine.release()
            answers = [answer for call in calls for answer in await call]
            return answers, await s.stub.GetStats(pb.GetStatsRequest())

    answers, stats = asyncio.run(scenario())
    ids = sorted(f"{prefix}{i}" for prefix in "ab" for i in range(items))
    assert sorted(answer.request_id for answer in answers) == ids
    assert all(answer.WhichOneof("result") == "response" for answer in answers)
    assert set(waits) == {"bulk"}
    (bulk,) = [lane for lane in stats.lanes if lane.name == "bulk"]
    assert dict(bulk.rejected) == {}
    assert dict(bulk.answered) == {"OK": len(ids)}
    assert bulk.admitted == len(ids)
    assert traces == {request_id: ["start", "OK"] for request_id in ids}


def test_a_stream_item_that_joins_or_replays_needs_no_room_in_its_full_lane(
    small_model: Path,
) -> None:
    """A resent item whose answer is stored, or whose request is in flight, is answered
    from the ledger while its lane stays full: it adds no rows there. It waited for room
    first, holding its stream's reading up to its deadline (the lane's timeout: 60 s
    here), though a unary retry of it got the stored answer at once."""

    async def scenario() -> tuple[list[pb.InferStreamResponse], list[int]]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=4, lanes=bulk_lane(4))) as s:
            await s.stub.Infer(request(rows(4, start=0), request_id="done", lane="bulk"))
            engine.hold_next()
            held = [asyncio.ensure_future(s.stub.Infer(request(rows(4, start=10), lane="bulk")))]
            await asyncio.to_thread(engine.entered.acquire)
            queued = request(rows(4, start=20), request_id="queued", lane="bulk")
            held.append(asyncio.ensure_future(s.stub.Infer(queued)))
            await until(lambda: queued_rows(s, "bulk") == 4)  # the lane is full
            sent: asyncio.Queue[pb.InferRequest | None] = asyncio.Queue()
            call = s.stub.InferStream(fed(sent))
            sent.put_nowait(request(rows(4, start=0), request_id="done"))
            replayed = await asyncio.wait_for(anext(aiter(call)), timeout=10)
            sent.put_nowait(request(rows(4, start=20), request_id="queued"))
            for name in ("i1", "i2"):
                sent.put_nowait(request(rows(4, start=30), request_id=name, lane="interactive"))
            # The stream read on past the item that joined "queued".
            await until(lambda: queued_rows(s, "interactive") == 8)
            engine.release()
            sent.put_nowait(None)
            rest = await collect(call)
            await asyncio.gather(*held)
        return [replayed, *rest], engine.ran_tags

    answers, ran = asyncio.run(scenario())
    assert answers[0].request_id == "done"
    assert answers[0].WhichOneof("result") == "response"
    assert sorted(answer.request_id for answer in answers) == ["done", "i1", "i2", "queued"]
    assert all(answer.WhichOneof("result") == "response" for answer in answers)
    assert sorted(ran).count(20) == 1, "the item that joined ran no row again"


def test_a_stream_items_lane_timeout_counts_from_its_arrival_not_its_admission(
    small_model: Path,
) -> None:
    """An item with no deadline of its own that waited for room in its full lane was
    given its lane's whole timeout again when admitted: up to twice the timeout in the
    server (240 s on the default bulk lane). The timeout counts from its arrival.

    The first item runs (held), one more fills the lane, the last waits for room until
    the release: its deadline counts from before the release. (Which of the two waits
    depends on the loop's order under load: the test judges the one admitted last.)"""
    per_item, timeout_ms = 4, 60_000
    admitted: dict[str, tuple[float | None, float]] = {}  # id -> (deadline, when)
    waits_s: list[float] = []  # when an item was seen waiting for room

    async def scenario() -> float:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_batch_size=per_item, lanes=bulk_lane(per_item))
        async with serving(engine, server_config) as s:
            thread = s.server._thread
            assert thread is not None
            submit, room_wait_s = thread.submit, thread.room_wait_s

            def recording_submit(request: InferenceRequest) -> int:
                when_s = time.monotonic()
                entry_id = submit(request)  # LANE_FULL raises: not admitted
                admitted[request.request_id] = (request.deadline_s, when_s)
                return entry_id

            def recording_room_wait_s(lane: str, rows: int) -> float | None:
                wait_s = room_wait_s(lane, rows)
                if wait_s is not None:
                    waits_s.append(time.monotonic())
                return wait_s

            def last_one_waits() -> bool:
                # Two admitted (one running, one filling the lane), and a wait seen since.
                return len(admitted) == 2 and any(
                    wait_s > max(when_s for _, when_s in admitted.values()) for wait_s in waits_s
                )

            thread.submit = recording_submit  # type: ignore[method-assign]
            thread.room_wait_s = recording_room_wait_s  # type: ignore[method-assign]
            engine.hold()
            answers = asyncio.ensure_future(
                collect(s.stub.InferStream(aiter(TaggedRequests(3, per_item, "w"))))
            )
            await asyncio.to_thread(engine.entered.acquire)
            await until(last_one_waits)
            released_s = time.monotonic()
            engine.release()
            responses = await answers
        assert all(r.WhichOneof("result") == "response" for r in responses)
        return released_s

    released_s = asyncio.run(scenario())
    (waited,) = [when for when in admitted.values() if when[1] > released_s]
    deadline_s, _ = waited
    assert deadline_s is not None
    # Counted from its admission, after the release, it would be later than this.
    assert deadline_s < released_s + timeout_ms / 1000


def test_job_keeps_its_rows_within_the_lane_capacity(small_model: Path) -> None:
    """The client learns the lane's capacity (GetModel) and keeps no more rows than that
    outstanding: with no retries allowed, not one item is refused LANE_FULL."""
    items = [{"input": rows(4, start=10 * i)} for i in range(50)]

    async def scenario() -> tuple[list[lc.StreamResult], pb.GetStatsResponse]:
        engine = RecordingEngine(str(small_model))
        server = serving(engine, config(small_model, lanes=bulk_lane(8)))
        async with server as s, lc.AsyncClient(s.target, retry=lc.NO_RETRIES) as client:
            engine.hold()
            collected = asyncio.ensure_future(collect(client.stream(items, window=256)))
            await asyncio.to_thread(engine.entered.acquire)
            for _ in range(20):
                assert queued_rows(s) <= 8
                await asyncio.sleep(0.002)
            engine.release()
            return await collected, await client.stats()

    results, stats = asyncio.run(scenario())
    assert all(result.ok for result in results)
    assert dict(stats.lanes[1].rejected) == {}


def test_a_job_naming_no_lane_goes_where_the_server_queues_it(small_model: Path) -> None:
    """Without a lane the server queues a stream's items in its bulk lane, or its default
    lane when it has none; the client sizes its row window from that same lane (here 8
    rows of bulk, not the default lane's 4 096), so no item is refused LANE_FULL."""
    items = [{"input": rows(4, start=10 * i)} for i in range(20)]
    standard = LaneConfig("standard", 4096, timeout_ms=60_000, max_wait_ms=0, min_share=0)
    bulk = LaneConfig("bulk", 8, timeout_ms=60_000, max_wait_ms=0, min_share=0)

    async def job(
        lanes: tuple[LaneConfig, ...],
    ) -> tuple[list[lc.StreamResult], pb.GetStatsResponse]:
        engine = RecordingEngine(str(small_model))
        server = serving(engine, config(small_model, lanes=lanes, default_lane="standard"))
        async with server as s, lc.AsyncClient(s.target, retry=lc.NO_RETRIES) as client:
            return await collect(client.stream(items)), await client.stats()

    results, stats = asyncio.run(job((standard, bulk)))
    assert all(result.ok for result in results)
    assert {lane.name: lane.admitted for lane in stats.lanes} == {"standard": 0, "bulk": 20}
    assert dict(stats.lanes[1].rejected) == {}
    results, stats = asyncio.run(job((standard,)))
    assert all(result.ok for result in results), "no bulk lane: the default lane takes them"
    assert stats.lanes[0].admitted == 20


def test_an_item_is_not_retried_past_its_timeout_ms(small_model: Path) -> None:
    """Unary calls hold the 4-row bulk lane full (one in the session, one queued); the
    job's item waits for room. The server counts timeout_ms from each arrival, and the
    client sent the item again with the whole 50 ms each time, until its 3 attempts were
    spent (3x the timeout). Counted from the first send, the item is answered at its
    timeout_ms by the client itself, once, and the server's refusal (at its own reading
    of the deadline, later) is counted there and dropped by the client."""

    async def scenario() -> tuple[list[lc.StreamResult], pb.GetStatsResponse]:
        engine = RecordingEngine(str(small_model))
        server = serving(engine, config(small_model, lanes=bulk_lane(4), max_batch_size=4))
        async with (
            server as s,
            lc.AsyncClient(s.target, retry=lc.RetryPolicy(max_attempts=3)) as client,
        ):
            engine.hold()
            held = [asyncio.ensure_future(s.stub.Infer(request(rows(4), lane="bulk")))]
            await asyncio.to_thread(engine.entered.acquire)
            held.append(
                asyncio.ensure_future(s.stub.Infer(request(rows(4, start=10), lane="bulk")))
            )
            await until(lambda: queued_rows(s) == 4)
            results = await collect(client.stream([{"input": rows(4, start=20)}], timeout_ms=50))
            # The server's end of it, whichever came first: its reading of the deadline
            # (LANE_FULL or EXPIRED_IN_QUEUE) or the client's cancel of the call, nothing
            # else being due on it (CANCELLED: its stream ended while it waited for room).
            await until_stats(s, lambda stats: sum(stats.lanes[1].rejected.values()) == 1)
            stats = await client.stats()
            engine.release()
            await asyncio.gather(*held)
            assert 20 not in engine.ran_tags
            return results, stats

    results, stats = asyncio.run(scenario())
    assert [result.ok for result in results] == [False]
    error = results[0].error
    assert isinstance(error, lc.DeadlineExceededError)
    assert error.reason == "EXPIRED_IN_QUEUE", "the server's reason, where this client decided"
    assert results[0].attempts == 1
    assert "(50 ms from its first send" in str(error)
    assert sum(stats.lanes[1].rejected.values()) == 1, "one attempt, refused once"


def test_unreachable_server_ends_the_job_with_the_connection_error() -> None:
    async def scenario() -> None:
        port = refusing_port()
        async with lc.AsyncClient(f"127.0.0.1:{port}", retry=lc.RetryPolicy(max_attempts=2)) as c:
            with pytest.raises(lc.UnavailableError) as caught:
                await collect(c.stream([{"input": rows(1)}]))
        assert "gave up after 2 broken call(s)" in caught.value.__notes__[0]

    asyncio.run(scenario())


def test_leaving_a_sync_stream_early_cancels_its_queued_items(small_model: Path) -> None:
    """One item per batch. The caller takes the first result and leaves; the items still
    queued are cancelled and never run."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=2)) as s:
            engine.hold()

            def take_one() -> None:
                with lc.Client(s.target) as client:
                    stream = client.stream({"input": rows(2, start=10 * i)} for i in range(20))
                    for _ in stream:
                        break  # closes the stream: its call is cancelled

            leaving = asyncio.ensure_future(asyncio.to_thread(take_one))
            await asyncio.to_thread(engine.entered.acquire)
            await until(lambda: queued_rows(s) >= 2)
            engine.release()  # the first batch finishes ...
            engine.hold()  # ... and the second stays in the session
            await leaving
            await until(lambda: queued_rows(s) == 0)
            engine.release()
        assert sorted(engine.ran_tags) == [0, 1, 10, 11], "two batches ran, the rest never"

    asyncio.run(scenario())


def test_a_job_of_a_closed_client_starts_no_read_of_its_source(small_model: Path) -> None:
    """Closing a client cancels its jobs' source reads in progress; a job whose writer
    asked for its next item after that (its window freed as the channel closed) started a
    new read, which the sync client's loop shutdown then found running: the source's
    reader could not be closed, and its thread lived on (a rare CI failure of
    test_leaving_a_sync_stream_early_cancels_its_queued_items)."""
    reads = 0

    async def source() -> AsyncIterator[dict[str, F32]]:
        nonlocal reads
        for index in range(100):
            reads += 1
            yield {"input": rows(1, start=10 * index)}

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            client = lc.AsyncClient(s.target)
            results = client.stream(source(), window=2)
            await anext(results)
            (job,) = list(client._jobs)
            await client.close()
            before = reads
            with pytest.raises(lc.ClientClosedError):
                await job._pull()
            assert reads == before
            await results.aclose()

    asyncio.run(scenario())


def test_a_client_closed_with_a_stream_left_open_stops_its_source_thread(
    small_model: Path,
) -> None:
    """A sync stream still referenced when its client closes (`for ...: break` inside the
    `with`): the loop's shutdown closed the stream's async generators in no set order,
    and when the source's reader came first its read was still running ("aclose():
    asynchronous generator is already running", logged by asyncio): its `finally` never
    ran, and the source's thread lived on. The order is forced here (readers first); the
    client cancels a job's source read as it closes."""
    unclosed: list[BaseException] = []
    later = threading.Event()  # the source's third read waits for it: a read in progress

    def source() -> Iterator[dict[str, F32]]:
        for index in range(1_000):
            if index == 2:
                later.wait(timeout=30)
            yield {"input": rows(1, start=10 * index)}

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:

            def take_one() -> None:
                with lc.Client(s.target) as client:
                    loop = client._loop
                    shutdown_asyncgens = loop.shutdown_asyncgens

                    async def readers_first() -> None:
                        generators = sorted(
                            loop._asyncgens,  # type: ignore[attr-defined]
                            key=lambda generator: generator.ag_code.co_name != "_read_off_loop",
                        )
                        for generator in generators:
                            try:
                                await generator.aclose()
                            except RuntimeError as error:
                                unclosed.append(error)
                        await shutdown_asyncgens()

                    loop.shutdown_asyncgens = readers_first  # type: ignore[method-assign]
                    stream = client.stream(source(), window=4)
                    for _ in stream:
                        break
                later.set()
                for thread in threading.enumerate():
                    if thread.name == SOURCE_THREAD:
                        thread.join(timeout=30)
                        assert not thread.is_alive(), "the job's source thread runs on"

            await asyncio.to_thread(take_one)

    asyncio.run(scenario())
    assert unclosed == []


def test_leaving_a_sync_stream_early_closes_its_source_and_its_thread(small_model: Path) -> None:
    """The job's reader of a plain generator (a thread of its own) was left to the garbage
    collector on a `break`: the thread and the caller's generator lived on until a
    collection ran. Both end with the stream now."""
    closed = threading.Event()

    def source() -> Iterator[dict[str, F32]]:
        try:
            for index in range(1_000):
                yield {"input": rows(1, start=10 * index)}
        finally:
            closed.set()

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:

            def take_one() -> None:
                with lc.Client(s.target) as client:
                    for _ in client.stream(source(), window=4):
                        break
                    # Before the client closes, with no collection run: at once, or as
                    # soon as a read the source thread was in returns.
                    assert closed.wait(timeout=30), "the caller's generator is not closed"
                    for thread in threading.enumerate():
                        if thread.name == SOURCE_THREAD:
                            thread.join(timeout=30)
                            assert not thread.is_alive(), "the job's source thread runs on"

            gc.disable()
            try:
                await asyncio.to_thread(take_one)
            finally:
                gc.enable()

    asyncio.run(scenario())


# ---- the server: credit window, per-item answers, cancellation --------------------------


def test_fast_producer_keeps_the_server_queue_bounded_by_the_window(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer that never waits: the server reads at most `stream_window` requests
    ahead of its answers, so its queued rows stay within window x rows per request.
    Counted at the servicer itself, at every item it takes from gRPC: the stream's items
    read and not yet answered (it asserted the producer was held back after a 0.1 s
    look, a timing assertion that held whatever the server read)."""
    window, per_item, items = 8, 4, 1000
    # At each read of the stream, its items read (that one included) and not answered.
    ahead: list[int] = []
    original = InferenceServicer.InferStream

    async def counted(
        self: InferenceServicer, requests: AsyncIterator[pb.InferRequest], context: Any
    ) -> AsyncIterator[pb.InferStreamResponse]:
        read = written = 0

        async def reads() -> AsyncIterator[pb.InferRequest]:
            nonlocal read
            async for item in requests:
                read += 1
                ahead.append(read - written)
                yield item

        async for message in original(self, reads(), context):
            yield message
            # Written: its credit comes back only after this, as the servicer resumes,
            # so `read - written` is never below the credits it has out.
            written += 1

    monkeypatch.setattr(InferenceServicer, "InferStream", counted)

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(
            small_model, max_batch_size=per_item, stream_window=window, lanes=bulk_lane(100_000)
        )
        async with serving(engine, server_config) as s:
            producer = TaggedRequests(items, per_item, "p")
            engine.hold()
            call = s.stub.InferStream(aiter(producer))
            answers = asyncio.ensure_future(collect(call))
            await asyncio.to_thread(engine.entered.acquire)
            # A full window: one item runs, held, and the rest of it queues; nothing is
            # answered, so no credit has come back and nothing more can be read.
            await until(lambda: queued_rows(s) >= (window - 1) * per_item)
            assert ahead == list(range(1, window + 1)), "read up to the window, no further"
            assert queued_rows(s) == (window - 1) * per_item
            engine.release()
            responses = await answers
        assert producer.produced == items
        assert max(ahead) == window, "never more than the window read ahead of its answers"
        assert len(ahead) == items, "each item read once"
        assert sorted(r.request_id for r in responses) == sorted(f"p{i}" for i in range(items))
        assert all(r.WhichOneof("result") == "response" for r in responses)
        assert sorted(engine.ran_tags) == list(range(items * per_item))

    asyncio.run(scenario())


def test_a_streams_window_counts_items_not_yet_finished_at_its_largest_answer() -> None:
    """Counted only once finished, the answers of batches that took 100 ms were none
    while a reader that read nothing had the whole window read (256 answers of 1 MiB,
    held once they finished). Items read and not yet finished count at the largest
    answer the stream has had."""
    mib = 1024 * 1024
    answer = pb.InferStreamResponse(request_id="a")
    answer.response.outputs.append(encode_tensor("y", np.zeros((1, mib // 4), np.float32)))
    window = streams.StreamWindow(256, 4 * mib)
    window.read()
    size = window.finished(streams.held_answer_bytes(answer))  # 1 MiB held
    window.read()
    window.read()  # + 2 unfinished at 1 MiB: 3 MiB
    assert window.open.is_set()
    window.read()  # 4 MiB forecast: at the budget
    assert not window.open.is_set()
    window.written(size)  # 3 MiB forecast
    assert window.open.is_set()


def test_before_its_first_answer_a_streams_window_counts_items_at_the_largest_read() -> None:
    """No answer's size is known before the first: items read then counted at nothing,
    and a stream whose first answers were slow read its whole window. Until an answer
    holds bytes they count at the largest item read; a refusal (no bytes) leaves them
    so; the first answer with bytes sizes them from then on."""
    mib = 1024 * 1024
    window = streams.StreamWindow(256, 4 * mib)
    assert window.sizing_by_items
    window.read(mib // 2)
    window.read(mib)  # the largest so far: both count at 1 MiB
    window.read(mib // 4)
    assert window.open.is_set()  # 3 MiB forecast
    window.read(mib // 4)  # 4 MiB: at the budget
    assert not window.open.is_set()
    window.written(window.finished(0))  # a refusal: 3 unfinished at 1 MiB
    assert window.sizing_by_items
    assert window.open.is_set()
    window.read(0)
    assert not window.open.is_set()
    answer = pb.InferStreamResponse(request_id="a")
    answer.response.outputs.append(encode_tensor("y", np.zeros((1, 1024), np.float32)))
    size = window.finished(streams.held_answer_bytes(answer))  # 4 KiB, held
    assert window.largest_answer_bytes == 4096  # no longer sized by items
    assert window.open.is_set()  # 4 KiB + 3 unfinished at 4 KiB
    window.written(size)
    assert window.open.is_set()


# A demo row's bytes of data (512 float32).
ROW_BYTES = 512 * 4


@contextlib.asynccontextmanager
async def _each_item_its_batch_held(
    small_model: Path, item_rows: int, **fields: Any
) -> AsyncIterator[tuple[Serving, RecordingEngine]]:
    """A server whose batches hold one item of `item_rows` rows each, in a bulk lane that
    holds every item, its engine held from the start (the first batch waits for
    `engine.release()`); `fields` over that config."""
    engine = RecordingEngine(str(small_model))
    server_config = config(
        small_model, max_batch_size=item_rows, lanes=bulk_lane(100_000), **fields
    )
    async with serving(engine, server_config) as s:
        engine.hold()
        yield s, engine


def test_a_stream_whose_first_answer_is_held_reads_its_answer_bytes_of_items_not_its_window(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine holds the stream's first batch: no answer has come, and the caller has
    sent 100 items of 16 KiB with a credit window of 1 000. The server reads items until
    they come to its answer budget (64 KiB: 4 items), counted at their own size, not its
    whole window; released, every item is answered, once."""
    item_rows, items, budget_bytes = 8, 100, 64 * 1024
    item_bytes = item_rows * ROW_BYTES
    windows = observed_stream_windows(monkeypatch)

    async def scenario() -> None:
        async with _each_item_its_batch_held(
            small_model, item_rows, stream_window=1_000, stream_answer_buffer_bytes=budget_bytes
        ) as (s, engine):
            sent = [
                request(rows(item_rows, start=item_rows * i), request_id=f"s{i}")
                for i in range(items)
            ]
            call = s.stub.InferStream(iter(sent))
            await asyncio.to_thread(engine.entered.acquire)
            # Closed by its forecast, or (counted at nothing) every item read.
            await until(
                lambda: (
                    len(windows) == 1
                    and (not windows[0].open.is_set() or windows[0].unanswered == items)
                )
            )
            (window,) = windows
            assert window.unanswered == budget_bytes // item_bytes, "read to its budget"
            assert window.largest_item_bytes == item_bytes
            engine.release()
            answers = await collect(call)
        assert sorted(answer.request_id for answer in answers) == sorted(
            f"s{i}" for i in range(items)
        ), "every item answered, once"
        assert all(answer.WhichOneof("result") == "response" for answer in answers)

    asyncio.run(scenario())


@pytest.mark.parametrize("window_kib", [256, 1024])
def test_a_receive_window_bounds_what_the_core_takes_of_a_stream_the_server_no_longer_reads(
    small_model: Path, window_kib: int
) -> None:
    """The server stops reading a stream (its one credit out, the batch held): with
    gRPC's own window sizing the core went on taking the caller's items off the
    connection (scripts/bench_unread_streams.py: 16 streams of 1 MiB items took the
    server to 1.1-2.6 GiB). With server.receive_window_bytes the caller can send at most
    a few windows beyond what the server read, however long it tries.
    No wait decides it: whatever the timing, more would be a defect."""
    item_rows = 32  # 64 KiB of float32 data an item
    item_bytes = item_rows * ROW_BYTES
    window_bytes = window_kib * 1024
    sent = 0

    def items() -> Iterator[pb.InferRequest]:
        nonlocal sent
        for index in range(1_000):
            sent += 1
            yield request(rows(item_rows, start=item_rows * index), request_id=f"w{index}")

    async def scenario() -> None:
        async with _each_item_its_batch_held(
            small_model, item_rows, stream_window=1, receive_window_bytes=window_bytes
        ) as (s, engine):
            with grpc.insecure_channel(s.target) as channel:
                call = pb_grpc.InferenceServiceStub(channel).InferStream(items())
                await asyncio.to_thread(engine.entered.acquire)  # its one item runs, held
                # The one item read, the window, and twice as much again at most: the
                # core grants a read's message beyond it, and the caller's gRPC holds
                # its writes (1.5-1.9 windows seen at 64 KiB to 4 MiB; unset, 65 items,
                # 4 MiB, at once here, and growing under a faster sender).
                bound = 1 + 3 * window_bytes // item_bytes + 4
                for _ in range(100):  # 2 s for the core to take more, if it would
                    assert sent <= bound, f"{sent} items taken, over about {bound}"
                    await asyncio.sleep(0.02)
                call.cancel()
            engine.release()

    asyncio.run(scenario())


def test_a_stream_whose_caller_reads_nothing_holds_its_answer_bytes_not_its_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raw InferStream sends 128 items whose answers are 256 KiB each, with a credit
    window larger than the job, and reads nothing: the server read every item and held
    each answer (a stream held stream_window answers: lanes bound rows waiting to run,
    not answers waiting to be written). It reads an item only while under 2 MiB of its
    answers wait to be written, and the items read by then still finish: in a 1-row lane
    a handful (one running, one queued, two waiting for room). Once the caller reads,
    every item is answered, once."""
    model = tmp_path / "tiled.onnx"
    tiled_model(model, times=65_536)  # 1 row of 1 value -> 65 536 float32: 256 KiB
    answer_bytes, budget_bytes, items = 256 * 1024, 2 * 1024 * 1024, 128
    windows = observed_stream_windows(monkeypatch)

    def item(index: int) -> pb.InferRequest:
        x = np.full((1, 1), index, np.float32)
        return pb.InferRequest(inputs=[encode_tensor("x", x)], request_id=f"s{index}")

    def bulk(stats: pb.GetStatsResponse) -> pb.LaneStats:
        return next(lane for lane in stats.lanes if lane.name == "bulk")

    async def scenario() -> None:
        server_config = config(
            model,
            max_batch_size=1,
            lanes=bulk_lane(1),
            stream_window=1_000,
            stream_answer_buffer_bytes=budget_bytes,
        )
        async with (
            serving(Engine(str(model), estimate=estimate_once), server_config) as s,
            # Without BDP probes the client's stream window stays at 64 KiB, under one
            # answer: gRPC takes none of them, and every answer read stays in the server.
            grpc.aio.insecure_channel(s.target, options=[("grpc.http2.bdp_probe", 0)]) as channel,
        ):
            # ~40 bytes each: gRPC takes them all at once, the server's reading decides.
            requests = [item(index) for index in range(items)]
            call = pb_grpc.InferenceServiceStub(channel).InferStream(iter(requests))
            await until(lambda: len(windows) == 1 and not windows[0].open.is_set())
            # The items read by then finish; nothing more is read.
            await until_stats(
                s,
                lambda stats: (
                    queued_rows(s) == 0
                    and _waiting_for_room(s, "bulk") == 0
                    and bulk(stats).admitted == bulk(stats).answered["OK"]
                ),
            )
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            (window,) = windows
            assert not window.open.is_set(), "shut by its answers' bytes, not its credits"
            assert window.held_bytes == window.unanswered * answer_bytes >= budget_bytes
            # Under the budget at its last read (7 answers), and the few in flight then.
            assert bulk(stats).admitted == window.unanswered < 2 * budget_bytes // answer_bytes
            answers = await collect(call)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        assert sorted(answer.request_id for answer in answers) == sorted(
            f"s{index}" for index in range(items)
        ), "every item answered, once"
        for answer in answers:
            (tensor,) = answer.response.outputs
            assert tensor.data == np.full(65_536, answer.request_id[1:], np.float32).tobytes()
        assert (bulk(stats).admitted, dict(bulk(stats).answered)) == (items, {"OK": items})

    asyncio.run(scenario())


def test_stream_answers_each_item_out_of_order_with_its_request_id(small_model: Path) -> None:
    """A held batch, then a bulk item and an interactive one: the interactive item runs
    first, so it is answered before the bulk item read before it. A bad item is answered
    with its error and the stream goes on."""

    async def scenario() -> list[pb.InferStreamResponse]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=4)) as s:
            sent: asyncio.Queue[pb.InferRequest | None] = asyncio.Queue()
            engine.hold()
            call = s.stub.InferStream(fed(sent))
            answers = asyncio.ensure_future(collect(call))
            sent.put_nowait(request(rows(4, start=0), request_id="held"))
            await asyncio.to_thread(engine.entered.acquire)
            sent.put_nowait(request(rows(4, start=10), request_id="bulk"))
            sent.put_nowait(request(rows(4, start=20), request_id="urgent", lane="interactive"))
            sent.put_nowait(request(rows(4)[:, :3], request_id="bad"))
            await until(lambda: queued_rows(s) == 8)
            # The bad item's refusal is counted as its answer is queued (same step).
            await until_stats(s, lambda stats: stats.lanes[2].rejected["INVALID_INPUT"] == 1)
            engine.release()
            sent.put_nowait(None)
            return await answers

    responses = asyncio.run(scenario())
    assert [r.request_id for r in responses] == ["bad", "held", "urgent", "bulk"]
    bad = responses[0]
    assert bad.WhichOneof("result") == "error"
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "shape [4, 3]" in bad.error.message
    for answer in responses[1:]:
        assert output(answer.response).shape == (4, 10)
        assert answer.response.request_id == answer.request_id
    assert responses[3].response.timing.lane == "bulk", "a stream's default lane"


def test_cancelled_stream_frees_its_queued_items(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=4)) as s:

            async def requests() -> AsyncIterator[pb.InferRequest]:
                for i in range(8):
                    yield request(rows(4, start=10 * i), request_id=f"c{i}")
                await asyncio.Event().wait()  # the stream stays open

            engine.hold()
            call = s.stub.InferStream(requests())
            answers = asyncio.ensure_future(collect(call))
            await asyncio.to_thread(engine.entered.acquire)
            await until(lambda: queued_rows(s) == 28)
            call.cancel()
            await until(lambda: queued_rows(s) == 0)
            engine.release()
            with pytest.raises(asyncio.CancelledError):
                await answers
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        assert sorted(engine.ran_tags) == [0, 1, 2, 3], "only the item already running ran"
        assert stats.lanes[2].shed["CANCELLED"] == 7

    asyncio.run(scenario())


# ---- helpers ---------------------------------------------------------------------------


async def collect(results: AsyncIterable[Any]) -> list[Any]:
    return [result async for result in results]


async def fed(sent: asyncio.Queue[pb.InferRequest | None]) -> AsyncIterator[pb.InferRequest]:
    """The requests the test puts on `sent` as it goes, until None."""
    while (item := await sent.get()) is not None:
        yield item


@contextlib.asynccontextmanager
async def behind_a_proxy(model: Path) -> AsyncIterator[tuple[Serving, Serving, TcpProxy, str]]:
    """Instances A and B of `model` (recording engines) and the address of a proxy that
    leads to A until retargeted."""
    async with (
        serving(RecordingEngine(str(model)), config(model)) as a,
        serving(RecordingEngine(str(model)), config(model)) as b,
    ):
        proxy = TcpProxy(a.server.port)
        target = await proxy.start()
        try:
            yield a, b, proxy, target
        finally:
            await proxy.close()


@contextlib.asynccontextmanager
async def proxied(
    engine: RecordingEngine, settings: ServerConfig
) -> AsyncIterator[tuple[TcpProxy, str]]:
    """A relay whose connections the test can cut or silence (`TcpProxy`) in front of a
    server it runs, and the relay's address."""
    async with serving(engine, settings) as s:
        proxy = TcpProxy(s.server.port)
        target = await proxy.start()
        try:
            yield proxy, target
        finally:
            await proxy.close()


def ran_tags(s: Serving) -> list[int]:
    engine = s.server.engine
    assert isinstance(engine, RecordingEngine)
    return engine.ran_tags


async def paused_at(pause: int, items: int, go: asyncio.Event) -> AsyncIterator[dict[str, F32]]:
    """`items` items of 2 rows tagged 10 * index; those from `pause` on once `go` is set."""
    for index in range(items):
        if index == pause:
            await go.wait()
        yield {"input": rows(2, start=10 * index)}


async def gated(
    items: list[dict[str, F32]], running: asyncio.Event
) -> AsyncIterator[dict[str, F32]]:
    """The first item, then the rest once `running` is set (the first is in the session):
    so the first runs alone, whatever the timing."""
    yield items[0]
    await running.wait()
    for item in items[1:]:
        yield item


class TaggedRequests:
    """A raw InferStream's requests: `items` of `per_item` tagged rows each, with ids
    `prefix` + index; `produced` counts those gRPC has taken from it."""

    def __init__(self, items: int, per_item: int, prefix: str) -> None:
        self.items, self.per_item, self.prefix = items, per_item, prefix
        self.produced = 0

    async def __aiter__(self) -> AsyncIterator[pb.InferRequest]:
        for i in range(self.items):
            self.produced += 1
            start = self.per_item * i
            yield request(rows(self.per_item, start=start), request_id=f"{self.prefix}{i}")


def test_the_client_and_the_server_agree_on_the_receive_limit_and_the_call_limit() -> None:
    """Words of the protocol each side spells for itself: the stream's receive-limit
    metadata and its least value, and the refusal a busy port gives."""
    from laneserve.client import _channel, _errors  # noqa: PLC0415
    from laneserve.server import grpc_accept, streams  # noqa: PLC0415

    assert _channel.RECEIVE_LIMIT_KEY == streams.RECEIVE_LIMIT_KEY
    assert _channel.MIN_MESSAGE_BYTES == streams.MIN_RECEIVE_LIMIT_BYTES
    assert _errors._GRPC_CALL_LIMIT == grpc_accept.CALL_LIMIT_DETAILS
