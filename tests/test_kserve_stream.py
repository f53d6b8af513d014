"""KServe v2 / Triton's ModelStreamInfer: InferStream's one stream mechanism
(`InferenceServicer.serve_stream`) with ModelInfer's reading and a ModelStreamInferResponse
for each answer (`kserve_convert.ModelStreamWire`). Real gRPC on loopback to a real in-process
server with a real ONNX Runtime session, called through stubs generated from
grpc_predict_v2.proto, as tritonclient's streams call."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from onnx import TensorProto, helper

from laneserve.client.tensors import encode_strings, encode_tensor
from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from laneserve.server import Engine, LaneConfig, grpc_accept, kserve_convert, streams
from laneserve.server import service as service_module
from laneserve.server.codec import MAX_EXTRA_BYTES
from laneserve.server.engine import TensorSpec
from laneserve.server.errors import InvalidInputError, LaneFullError
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.shared_memory import SharedMemoryRegions
from laneserve.server.streams import RECEIVE_LIMIT_KEY
from laneserve.v1 import inference_pb2 as pb
from tests.support import (
    RecordingEngine,
    Serving,
    config,
    estimate_once,
    observed_stream_windows,
    queued_rows,
    request,
    rich_status,
    rows,
    save_model,
    serving,
    until,
    until_stats,
)
from tests.test_kserve import (
    LABELS,
    NUMBERS,
    TAGGED,
    TEXT,
    TEXT_OUTPUTS,
    VALUES,
    outputs_of,
    text_request,
    typed_request,
)

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

# A stream wire's regions where no output is placed in any.
NO_REGIONS = SharedMemoryRegions(enabled=False)

F32 = npt.NDArray[np.float32]
Request = kpb.ModelInferRequest
Answer = kpb.ModelStreamInferResponse
MODEL = "small"  # the small model's file stem: the name it is served under


def stream_stub(s: Serving) -> kpb_grpc.GRPCInferenceServiceAsyncStub:
    return kpb_grpc.GRPCInferenceServiceStub(s.channel)


def item(array: npt.NDArray[Any], item_id: str, *, model: str = MODEL, **params: Any) -> Request:
    """One item as tritonclient sends it: the input's bytes in raw_input_contents, and
    each of `params` (an InferParameter's fields) as a request parameter."""
    message = Request(model_name=model, id=item_id)
    name = "x" if array.dtype == np.uint8 else "input"
    datatype = kserve_convert.kserve_datatype(array.dtype)
    message.inputs.add(name=name, datatype=datatype, shape=array.shape)
    message.raw_input_contents.append(encode_tensor(name, array).data)
    for key, value in params.items():
        message.parameters[key].CopyFrom(kpb.InferParameter(**value))
    return message


def raw_output(answer: Answer) -> bytes:
    assert answer.error_message == "", answer.error_message
    (raw,) = answer.infer_response.raw_output_contents
    return raw


def parameters(answer: Answer) -> dict[str, Any]:
    return {
        key: getattr(value, value.WhichOneof("parameter_choice") or "string_param")
        for key, value in answer.infer_response.parameters.items()
    }


async def collect(answers: AsyncIterable[Answer]) -> list[Answer]:
    return [answer async for answer in answers]


async def read_rest(call: Any) -> list[Answer]:
    """The answers of a stream `call` already read with `read` (gRPC's iterator and its
    `read` do not mix on one call), until it ends."""
    answers = []
    while (answer := await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
        answers.append(answer)
    return answers


async def fed(sent: asyncio.Queue[Request | None]) -> AsyncIterator[Request]:
    """The items the test puts on `sent` as it goes, until None."""
    while (message := await sent.get()) is not None:
        yield message


def echo_model(path: Path) -> Path:
    """x [N, K] uint8 -> y = x: an answer's size is any number of bytes its caller picks."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        path.stem,
        [helper.make_tensor_value_info("x", TensorProto.UINT8, ["N", "K"])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, ["N", "K"])],
    )
    return save_model(path, graph)


def tag(item_id: str, *, final_response: bool = False) -> kserve_convert.ModelStreamTag:
    """An item's tag, as `ModelStreamWire.tag` reads it (without laneserve_idempotent)."""
    return kserve_convert.ModelStreamTag(item_id, idempotent=False, final_response=final_response)


def bulk_lane(capacity_rows: int) -> tuple[LaneConfig, ...]:
    return (
        LaneConfig("interactive", capacity_rows=64, timeout_ms=60_000, max_wait_ms=0, min_share=0),
        LaneConfig("bulk", capacity_rows, timeout_ms=60_000, max_wait_ms=0, min_share=0),
    )


def lane_of(stats: pb.GetStatsResponse, name: str) -> pb.LaneStats:
    return next(lane for lane in stats.lanes if lane.name == name)


def test_stream_items_are_answered_as_infer_answers_them_tagged_with_their_ids(
    small_model: Path,
) -> None:
    """Each item's answer carries Infer's output bytes for the same rows, its id, the
    served model's name and version, and laneserve's timing, in the streams' default lane
    (bulk)."""
    arrays = [rows(count, seed=count) for count in (1, 3, 2, 5)]

    async def scenario() -> tuple[list[Answer], list[pb.InferResponse]]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            sent: asyncio.Queue[Request | None] = asyncio.Queue()
            call = stream_stub(s).ModelStreamInfer(fed(sent))
            answers: list[Answer] = []
            for index, array in enumerate(arrays):  # one at a time: batched as Infer's are
                sent.put_nowait(item(array, f"i{index}"))
                answer = await asyncio.wait_for(call.read(), 10)
                assert isinstance(answer, Answer)
                answers.append(answer)
            sent.put_nowait(None)
            assert await call.read() is grpc.aio.EOF
            infer = [await s.stub.Infer(request(array)) for array in arrays]
        return answers, infer

    answers, infer = asyncio.run(scenario())
    for index, (answer, expected) in enumerate(zip(answers, infer, strict=True)):
        response = answer.infer_response
        assert (response.id, response.model_name, response.model_version) == (
            f"i{index}",
            MODEL,
            "1",
        )
        (tensor,) = response.outputs
        (infer_tensor,) = expected.outputs
        assert (tensor.name, tensor.datatype, list(tensor.shape)) == (
            "output",
            "FP32",
            list(infer_tensor.shape),
        )
        assert raw_output(answer) == infer_tensor.data, "bit for bit"
        timing = parameters(answer)
        assert timing["laneserve_lane"] == "bulk"
        assert timing["laneserve_batch_size"] == arrays[index].shape[0]


def test_a_bad_item_is_answered_with_its_error_and_the_stream_goes_on(small_model: Path) -> None:
    """Another model, a tensor of the wrong shape, a wrong datatype, an unknown parameter
    and one over the extra bytes' bound (refused unread, its id kept): each answered in
    error_message (gRPC's code, laneserve's reason, the item's id, the message) beside an
    infer_response of its id, the model's name and version and the error's parameters;
    the good items around them are answered. Counted as ModelInfer's refusals are
    (another model: nowhere)."""
    oversized = item(rows(1), "o")
    oversized.parameters["x" * (MAX_EXTRA_BYTES + 10)].string_param = "y"
    items = [
        item(rows(1), "a"),
        item(rows(1), "m", model="other"),
        item(rows(2)[:, :3], "t"),
        item(rows(1).astype(np.float64), "d"),
        item(rows(1), "p", sequence_id={"int64_param": 7}),
        oversized,
        item(rows(1), "b"),
    ]

    async def scenario() -> tuple[list[Answer], pb.GetStatsResponse]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            answers = await collect(stream_stub(s).ModelStreamInfer(iter(items), timeout=30))
            return answers, await s.stub.GetStats(pb.GetStatsRequest())

    answers, stats = asyncio.run(scenario())
    assert sorted(answer.infer_response.id for answer in answers) == [
        "a",
        "b",
        "d",
        "m",
        "o",
        "p",
        "t",
    ]
    by_id = {answer.infer_response.id: answer for answer in answers}
    for good in ("a", "b"):
        assert len(raw_output(by_id[good])) == 10 * 4
    expected = {
        "m": ("NOT_FOUND MODEL_NOT_FOUND: [request id: m] model 'other' is not served here", 5),
        "t": ("INVALID_ARGUMENT INVALID_INPUT: [request id: t] ", 3),
        "d": (
            (
                "INVALID_ARGUMENT INVALID_INPUT: [request id: d] input 'input' has datatype "
                "FP64; expected FP32"
            ),
            3,
        ),
        "p": ("INVALID_ARGUMENT INVALID_INPUT: [request id: p] unknown request parameter(s)", 3),
        "o": ("INVALID_ARGUMENT INVALID_INPUT: [request id: o] the ModelInfer request carries ", 3),
    }
    for item_id, (start, code) in expected.items():
        answer = by_id[item_id]
        assert answer.error_message.startswith(start), answer.error_message
        response = answer.infer_response
        assert (response.model_name, response.model_version) == (MODEL, "1")
        assert not response.outputs
        assert not response.raw_output_contents
        reason = start.split(":")[0].split()[1]
        assert parameters(answer) == {
            "laneserve_error_code": code,
            "laneserve_error_reason": reason,
        }
    assert "shape [2, 3]" in by_id["t"].error_message
    assert "bytes besides its tensors' data" in by_id["o"].error_message
    # The conversion's refusals in the default lane, as ModelInfer's; the rest in the lane
    # the item would have run in; another model's nowhere.
    assert dict(lane_of(stats, "standard").rejected) == {"INVALID_INPUT": 3}
    assert dict(lane_of(stats, "bulk").rejected) == {"INVALID_INPUT": 1}
    assert dict(lane_of(stats, "bulk").answered) == {"OK": 2}


def test_stream_items_take_their_lanes_from_lane_and_priority_and_are_answered_out_of_order(
    small_model: Path,
) -> None:
    """With a batch held in the session: an item in the default lane (bulk), one naming
    `lane` interactive, one of Triton's priority 1 (the first lane, interactive) and one
    of priority 2 (standard). The interactive items run before the bulk one read before
    them: answers come as they complete, each tagged with its id and its lane."""

    async def scenario() -> list[Answer]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=4)) as s:
            sent: asyncio.Queue[Request | None] = asyncio.Queue()
            engine.hold()
            call = stream_stub(s).ModelStreamInfer(fed(sent))
            answers = asyncio.ensure_future(collect(call))
            sent.put_nowait(item(rows(4, start=0), "held"))
            await asyncio.to_thread(engine.entered.acquire)
            sent.put_nowait(item(rows(4, start=10), "bulk"))
            sent.put_nowait(item(rows(4, start=20), "lane", lane={"string_param": "interactive"}))
            sent.put_nowait(item(rows(4, start=30), "first", priority={"uint64_param": 1}))
            sent.put_nowait(item(rows(4, start=40), "second", priority={"int64_param": 2}))
            await until(lambda: queued_rows(s) == 16)
            engine.release()
            sent.put_nowait(None)
            return await answers

    answers = asyncio.run(scenario())
    order = [answer.infer_response.id for answer in answers]
    assert order[0] == "held"
    assert order.index("lane") < order.index("bulk")
    assert order.index("first") < order.index("bulk")
    lanes = {answer.infer_response.id: parameters(answer)["laneserve_lane"] for answer in answers}
    assert lanes == {
        "held": "bulk",
        "bulk": "bulk",
        "lane": "interactive",
        "first": "interactive",
        "second": "standard",
    }


def test_items_without_ids_are_answered_in_the_order_they_came_and_those_with_ids_pass_them(
    small_model: Path,
) -> None:
    """tritonclient's async_stream_infer sends no id by default, and Triton writes a model's
    answers in request order where it is not decoupled (laneserve's is not). With a batch
    held in the session, items without an id in the default lane (bulk), naming `lane`
    interactive, of Triton's priority 2 (standard) and of priority 1 (interactive), and
    one with an id (priority 1) among them: the interactive items run before the bulk one
    read before them, yet the answers without an id come in the order their items were
    read, and the one with an id as it completes, before the bulk one's."""
    lanes: dict[str, dict[str, Any]] = {
        "held": {},
        "bulk": {},
        "lane": {"lane": {"string_param": "interactive"}},
        "tagged": {"priority": {"uint64_param": 1}},
        "second": {"priority": {"int64_param": 2}},
        "first": {"priority": {"uint64_param": 1}},
    }
    starts = {name: 10 * index for index, name in enumerate(lanes)}
    arrays = {name: rows(4, start=start) for name, start in starts.items()}

    async def scenario() -> tuple[list[Answer], dict[bytes, str], list[int]]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=4)) as s:
            sent: asyncio.Queue[Request | None] = asyncio.Queue()
            engine.hold()
            answers = asyncio.ensure_future(collect(stream_stub(s).ModelStreamInfer(fed(sent))))
            for name, params in lanes.items():
                sent.put_nowait(item(arrays[name], "t" if name == "tagged" else "", **params))
                if name == "held":
                    await asyncio.to_thread(engine.entered.acquire)
            await until(lambda: queued_rows(s) == 20)
            engine.release()
            sent.put_nowait(None)
            streamed = await answers
            # Each item alone in a batch of its 4 rows, as on the stream: the same bytes.
            outputs = {
                (await s.stub.Infer(request(array))).outputs[0].data: name
                for name, array in arrays.items()
            }
        return streamed, outputs, engine.ran_tags

    streamed, outputs, ran = asyncio.run(scenario())
    assert len(outputs) == len(lanes), "each item told apart by its answer"
    names = [outputs[raw_output(answer)] for answer in streamed]
    ran_first = ran[::4]  # each batch's first row: its item's start
    assert ran_first.index(starts["lane"]) < ran_first.index(starts["bulk"])
    assert ran_first.index(starts["first"]) < ran_first.index(starts["bulk"])
    assert [name for name in names if name != "tagged"] == [
        "held",
        "bulk",
        "lane",
        "second",
        "first",
    ]
    assert names.index("tagged") < names.index("bulk"), "not held behind items without an id"
    ids = {name: answer.infer_response.id for name, answer in zip(names, streamed, strict=True)}
    assert ids == {name: "t" if name == "tagged" else "" for name in lanes}
    assert [parameters(answer)["laneserve_lane"] for answer in streamed] == [
        "bulk",
        "interactive",
        "bulk",
        "interactive",
        "standard",
        "interactive",
    ]


def test_an_item_without_an_id_refused_as_it_is_read_is_answered_in_its_place(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind an item without an id held in the session, items without an id each
    refused as they are read: a tensor of the wrong shape, laneserve_idempotent without
    an id, another model, over the extra bytes' bound (refused unread), bytes that do not
    parse; then one with an id, refused too. The one with an id is answered at once; the
    others, finished, wait for the held item's answer and follow it in the order they
    came."""
    windows = observed_stream_windows(monkeypatch)
    oversized = item(rows(1), "")
    oversized.parameters["x" * (MAX_EXTRA_BYTES + 10)].string_param = "y"
    refused = [
        item(rows(2)[:, :3], "").SerializeToString(),
        item(rows(1), "", **IDEMPOTENT).SerializeToString(),
        item(rows(1), "", model="other").SerializeToString(),
        oversized.SerializeToString(),
        b"\x0a\x02\xff\xfe",
        item(rows(1), "e", model="other").SerializeToString(),
    ]

    async def scenario() -> tuple[Answer, list[Answer]]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            stream: Any = s.channel.stream_stream(
                "/inference.GRPCInferenceService/ModelStreamInfer",
                request_serializer=lambda data: data,
                response_deserializer=Answer.FromString,
            )
            sent: asyncio.Queue[bytes | None] = asyncio.Queue()

            async def fed_bytes() -> AsyncIterator[bytes]:
                while (data := await sent.get()) is not None:
                    yield data

            engine.hold()
            call = stream(fed_bytes(), timeout=30)
            sent.put_nowait(item(rows(2, start=0), "").SerializeToString())
            await asyncio.to_thread(engine.entered.acquire)
            for data in refused:
                sent.put_nowait(data)
            first = await asyncio.wait_for(call.read(), 10)
            # Every item read; of them, only the held one unfinished.
            await until(lambda: windows[0].unanswered == 6 and windows[0].unfinished == 1)
            engine.release()
            sent.put_nowait(None)
            return first, await read_rest(call)

    first, rest = asyncio.run(scenario())
    assert first.error_message.startswith("NOT_FOUND MODEL_NOT_FOUND: [request id: e] ")
    assert [answer.infer_response.id for answer in rest] == [""] * 6
    assert len(raw_output(rest[0])) == 2 * 10 * 4
    starts = [
        "INVALID_ARGUMENT INVALID_INPUT: input 'input' has shape [2, 3]",
        "INVALID_ARGUMENT INVALID_INPUT: request parameter 'laneserve_idempotent' is true",
        "NOT_FOUND MODEL_NOT_FOUND: model 'other' is not served here",
        "INVALID_ARGUMENT INVALID_INPUT: the ModelInfer request carries ",
        "INVALID_ARGUMENT INVALID_INPUT: the ModelInfer request does not parse",
    ]
    for answer, start in zip(rest[1:], starts, strict=True):
        assert answer.error_message.startswith(start), answer.error_message


def test_answers_held_for_their_order_count_against_the_streams_answer_buffer(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stream_answer_buffer_bytes of 5 answers (4 rows of 10 float32: 160 bytes each).
    Behind an item without an id in the bulk lane come 30 without an id in the
    interactive lane, which runs first: their answers are held for their order, finished
    and not yet written, and the credit window counts them. So the stream never has more
    than 5 items read and unwritten, however many wait to be read; the head runs once the
    interactive lane is empty, and every answer comes, in the order its item came."""
    answer_bytes, budget_answers, count = 160, 5, 30
    seen: list[tuple[int, int]] = []  # (unanswered, held bytes) at each finished answer
    windows: list[streams.StreamWindow] = []

    class Observed(streams.StreamWindow):
        def __init__(self, *args: int) -> None:
            super().__init__(*args)
            windows.append(self)

        def finished(self, held_bytes: int) -> int:
            size = super().finished(held_bytes)
            seen.append((self.unanswered, self.held_bytes))
            return size

    monkeypatch.setattr(service_module, "StreamWindow", Observed)
    head = rows(4, start=1000)
    behind = [rows(4, start=10 * index) for index in range(count)]
    interactive: dict[str, Any] = {"lane": {"string_param": "interactive"}}

    async def scenario() -> tuple[list[Answer], list[bytes], list[int]]:
        engine = RecordingEngine(str(small_model))
        server_config = config(
            small_model,
            max_batch_size=4,
            lanes=bulk_lane(64),
            default_lane="bulk",
            stream_answer_buffer_bytes=budget_answers * answer_bytes,
        )
        async with serving(engine, server_config) as s:
            sent: asyncio.Queue[Request | None] = asyncio.Queue()
            call = stream_stub(s).ModelStreamInfer(fed(sent))
            sent.put_nowait(item(rows(4, start=5000), "w"))  # the stream's largest answer
            answers = [await asyncio.wait_for(call.read(), 10)]
            engine.hold_next()
            sent.put_nowait(item(rows(4, start=6000), "x", **interactive))
            await asyncio.to_thread(engine.entered.acquire)
            sent.put_nowait(item(head, ""))
            for array in behind:
                sent.put_nowait(item(array, "", **interactive))
            sent.put_nowait(None)
            (window,) = windows
            # x in the session, the head and 3 behind it queued: 5 answers' worth.
            await until(lambda: queued_rows(s) == 16 and not window.open.is_set())
            engine.release()
            answers += await read_rest(call)
            outputs = [(await s.stub.Infer(request(array))).outputs[0].data for array in behind]
            outputs.insert(0, (await s.stub.Infer(request(head))).outputs[0].data)
        return (
            [answer for answer in answers if isinstance(answer, Answer)],
            outputs,
            engine.ran_tags,
        )

    answers, outputs, ran = asyncio.run(scenario())
    assert [answer.infer_response.id for answer in answers] == ["w", "x"] + [""] * (count + 1)
    assert [raw_output(answer) for answer in answers[2:]] == outputs, "in the order they came"
    ran_first = ran[::4]
    assert ran_first.index(1000) > ran_first.index(0), "the head ran after items behind it"
    assert max(unanswered for unanswered, _ in seen) <= budget_answers
    held = max(held_bytes for _, held_bytes in seen)
    # At least the head's and the 3 read behind it before it ran, held at once.
    assert 4 * answer_bytes <= held <= budget_answers * answer_bytes


def test_a_stream_item_waits_for_room_in_its_full_lane_and_the_stream_reads_no_more(
    small_model: Path,
) -> None:
    """4-row items into a 4-row lane, a batch held in the session, a credit window larger
    than the job: an item that finds the lane full waits for room instead of being
    refused LANE_FULL, and the stream reads no more meanwhile, as InferStream's do."""
    per_item, count = 4, 100

    def waiting_for_room(s: Serving) -> int:
        servicer = s.server._servicer
        assert servicer is not None
        return len(servicer._room_lines.get("bulk", ()))

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(
            small_model,
            max_batch_size=per_item,
            lanes=bulk_lane(per_item),
            default_lane="bulk",
            stream_window=100_000,
        )
        async with serving(engine, server_config) as s:
            produced = 0

            async def items() -> AsyncIterator[Request]:
                nonlocal produced
                for index in range(count):
                    produced += 1
                    yield item(rows(per_item, start=per_item * index), f"w{index}")

            engine.hold()
            answers = asyncio.ensure_future(collect(stream_stub(s).ModelStreamInfer(items())))
            await asyncio.to_thread(engine.entered.acquire)
            await until(
                lambda: produced == count and queued_rows(s) == per_item and waiting_for_room(s) > 0
            )
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            # The item in the session, the one in the lane, the one that found it full,
            # and at most one whose read was under way then: not the whole job.
            assert waiting_for_room(s) in (1, 2)
            assert dict(lane_of(stats, "bulk").rejected) == {}
            engine.release()
            responses = await answers
        assert sorted(r.infer_response.id for r in responses) == sorted(
            f"w{index}" for index in range(count)
        )
        assert all(r.error_message == "" for r in responses)
        assert sorted(engine.ran_tags) == list(range(count * per_item))

    asyncio.run(scenario())


def test_a_request_whose_id_keys_nothing_wakes_no_item_waiting_for_room(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Items whose ids key nothing (no laneserve_idempotent) wait for room in their lane's
    line alone, where no call wakes them: a request keyed by none starts no flight for
    them to join. Woken, each would look and sleep again: every such request woke every
    such waiter. Two streams with items waiting in the full bulk lane, then a ModelInfer in
    the interactive lane: no waiter is woken, and none is kept under a key."""
    per_item = 4
    wakes = 0
    wake = streams.RoomWaiter.wake

    def counted(waiter: streams.RoomWaiter) -> None:
        nonlocal wakes
        wakes += 1
        wake(waiter)

    monkeypatch.setattr(streams.RoomWaiter, "wake", counted)

    async def scenario() -> list[list[Answer]]:
        engine = RecordingEngine(str(small_model))
        server_config = config(
            small_model, max_batch_size=per_item, lanes=bulk_lane(per_item), default_lane="bulk"
        )
        async with serving(engine, server_config) as s:
            servicer = s.server._servicer
            assert servicer is not None
            engine.hold()
            streams = [
                asyncio.ensure_future(
                    collect(
                        stream_stub(s).ModelStreamInfer(
                            iter([item(rows(per_item), f"{name}{k}") for k in range(3)])
                        )
                    )
                )
                for name in ("a", "b")
            ]
            # Settled: a batch held in the session, the lane full, an item of each stream
            # waiting (until then a waiter may find room and pass its turn on).
            await asyncio.to_thread(engine.entered.acquire)
            await until(
                lambda: (
                    queued_rows(s, "bulk") == per_item
                    and len(servicer._room_lines.get("bulk", ())) >= 2
                )
            )
            assert servicer._room_waiters == {}
            before = wakes
            unary = asyncio.ensure_future(
                stream_stub(s).ModelInfer(item(rows(1), "u", lane={"string_param": "interactive"}))
            )
            await until(lambda: queued_rows(s, "interactive") == 1)
            assert wakes == before, "no waiter woken"
            engine.release()
            assert (await unary).id == "u"
            return list(await asyncio.gather(*streams))

    for answers in asyncio.run(scenario()):
        assert len(answers) == 3
        assert all(answer.error_message == "" for answer in answers)


def test_an_oversized_item_is_answered_with_its_id_within_bound_and_its_final_mark(
    small_model: Path,
) -> None:
    """An item over the extra-bytes bound is refused unread, its id and its final-mark
    flag kept: an id of 256 characters and 1 024 bytes is over MAX_REQUEST_ID_BYTES, so
    its answer carries none (kept by characters, it was echoed, and under a 1 024-byte
    receive limit the error could not fit: its task died and the stream hung), and the
    answer is marked final, as it asked. The stream goes on."""
    oversized = item(
        rows(1),
        "\U0001f600" * 256,
        triton_enable_empty_final_response={"bool_param": True},
    )
    oversized.parameters["x" * (MAX_EXTRA_BYTES + 10)].string_param = "y"

    async def scenario() -> list[Answer]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            call = stream_stub(s).ModelStreamInfer(
                iter([oversized, item(rows(1), "next")]),
                metadata=((RECEIVE_LIMIT_KEY, "1024"),),
                timeout=30,
            )
            return await collect(call)

    refused, answered = sorted(asyncio.run(scenario()), key=lambda a: a.infer_response.id)
    assert refused.infer_response.id == ""
    assert refused.error_message.startswith("INVALID_ARGUMENT INVALID_INPUT: ")
    assert refused.infer_response.parameters["triton_final_response"].bool_param
    assert refused.ByteSize() <= 1024
    assert (answered.infer_response.id, answered.error_message) == ("next", "")


def test_a_stream_open_when_the_server_drains_answers_what_it_read_and_ends_unavailable(
    small_model: Path,
) -> None:
    """An item running when the drain begins is answered; the stream then reads no more
    and ends UNAVAILABLE (DRAINING); a stream opened during the drain is refused at once."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            sent: asyncio.Queue[Request | None] = asyncio.Queue()
            engine.hold()
            call = stream_stub(s).ModelStreamInfer(fed(sent))
            sent.put_nowait(item(rows(2, start=0), "running"))
            await asyncio.to_thread(engine.entered.acquire)
            # Grace far past what the steps before the release take (the drain ends as
            # soon as the held item is answered): past it, the held item was answered
            # UNAVAILABLE, its run's answer not kept, where a loaded machine took that long.
            stopping = asyncio.create_task(s.server.stop(grace_s=30.0))
            await until(lambda: s.server.state is not Lifecycle.SERVING)
            late = stream_stub(s).ModelStreamInfer(iter([item(rows(2, start=20), "late")]))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(late)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert rich_status(refused.value)[0] == "DRAINING"
            sent.put_nowait(item(rows(2, start=10), "after"))
            engine.release()
            answers: list[Answer] = []

            async def read_all() -> None:
                async for answer in call:  # kept as they come: the call ends in an error
                    answers.append(answer)  # noqa: PERF401

            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await read_all()
            await stopping
        assert [answer.infer_response.id for answer in answers] == ["running"]
        assert len(raw_output(answers[0])) == 2 * 10 * 4
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert rich_status(ended.value)[0] == "DRAINING"
        assert "no more items" in (ended.value.details() or "")
        assert sorted(engine.ran_tags) == [0, 1], "the item sent after the drain never ran"

    asyncio.run(scenario())


def test_a_cancelled_stream_cancels_its_queued_items_and_leaves_nothing_behind(
    small_model: Path,
) -> None:
    """The client cancels a stream with one item running and seven queued: the queued
    ones are cancelled (counted CANCELLED) and never run; the lanes, the stream's reader,
    the port's count of streams and the ledger's requests in flight all end empty."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=4)) as s:
            servicer = s.server._servicer
            assert servicer is not None
            gate = s.server._listeners[0].acceptors._gate

            async def items() -> AsyncIterator[Request]:
                for index in range(8):
                    yield item(rows(4, start=10 * index), f"c{index}")
                await asyncio.Event().wait()  # the stream stays open

            engine.hold()
            call = stream_stub(s).ModelStreamInfer(items())
            answers = asyncio.ensure_future(collect(call))
            await asyncio.to_thread(engine.entered.acquire)
            await until(lambda: queued_rows(s) == 28)
            call.cancel()
            await until(lambda: queued_rows(s) == 0)
            await until(lambda: not servicer._stream_readers and gate.stream_calls == 0)
            engine.release()
            with pytest.raises(asyncio.CancelledError):
                await answers
            await until_stats(s, lambda stats: lane_of(stats, "bulk").shed["CANCELLED"] == 7)
            # The item that ran finishes (its answer stored for a retry): none stays.
            await until(lambda: not servicer._ledger._flights)
        assert sorted(engine.ran_tags) == [0, 1, 2, 3], "only the item already running ran"

    asyncio.run(scenario())


def test_an_answer_over_the_callers_receive_limit_is_that_items_error_in_its_envelope(
    tmp_path: Path,
) -> None:
    """A caller that reads at most 1 024 bytes (its channel's limit, told the server in
    laneserve-max-receive-bytes) streams answers of 820 to 1 000 bytes of data, a byte
    apart, in the lane of the longest name and marked final (the largest envelope). The
    answers that fit it as a ModelStreamInferResponse come; the others are each that
    item's ANSWER_TOO_LARGE, and the stream goes on. Sized as InferStream items alone,
    the answers of about 880 to 975 bytes fit there and not here: gRPC's client ended
    the whole stream at the first; an envelope under-counted by 10 bytes ends it too. An
    error that quotes a long lane name is cut to fit."""
    path = echo_model(tmp_path / "echo.onnx")
    sizes = range(820, 1001)
    limit = 1024
    largest: dict[str, Any] = {
        "lane": {"string_param": "interactive"},  # the longest of the default lanes
        kserve_convert.FINAL_RESPONSE_FLAG: {"bool_param": True},
    }

    async def scenario() -> list[Answer]:
        engine = Engine(str(path), device="cpu", estimate=estimate_once)
        async with (
            serving(engine, config(path)) as s,
            grpc.aio.insecure_channel(
                s.target, options=[("grpc.max_receive_message_length", limit)]
            ) as channel,
        ):
            items = [
                item(np.full((1, size), size % 251, np.uint8), f"k{size}", model="echo", **largest)
                for size in sizes
            ]
            items.append(
                item(
                    np.ones((1, 4), np.uint8),
                    "y" * 256,
                    model="echo",
                    lane={"string_param": "l" * 900},
                )
            )
            call = kpb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter(items), metadata=((RECEIVE_LIMIT_KEY, str(limit)),), timeout=30
            )
            return await collect(call)

    answers = asyncio.run(scenario())
    assert all(answer.ByteSize() <= limit for answer in answers)
    by_id = {answer.infer_response.id: answer for answer in answers}
    assert sorted(by_id) == sorted([f"k{size}" for size in sizes] + ["y" * 256])
    fits = [size for size in sizes if not by_id[f"k{size}"].error_message]
    assert fits == list(sizes)[: len(fits)], "the smaller answers fit"
    assert 0 < len(fits) < len(sizes)
    for size in fits:
        assert raw_output(by_id[f"k{size}"]) == bytes([size % 251]) * size
    for size in sizes[len(fits) :]:
        message = by_id[f"k{size}"].error_message
        assert message.startswith(
            f"RESOURCE_EXHAUSTED ANSWER_TOO_LARGE: [request id: k{size}] the answer to request "
            f"'k{size}' is up to "
        ), message
        assert "over the largest message this caller reads (1024 bytes" in message
    lane = by_id["y" * 256].error_message
    assert lane.startswith("INVALID_ARGUMENT INVALID_INPUT: [request id: yyy")
    assert "(message cut: " in lane


def test_an_answer_over_max_message_bytes_is_that_items_error_and_the_stream_goes_on(
    tmp_path: Path,
) -> None:
    """At max_message_bytes 1 024, answers of 800 to 870 bytes of data, a byte apart: gRPC
    sends no message over the limit and would end the whole stream with one. Each item is
    answered within the limit, the larger ones ANSWER_TOO_LARGE, and the stream goes on."""
    path = echo_model(tmp_path / "echo.onnx")
    sizes = range(800, 871)

    async def scenario() -> list[Answer]:
        engine = Engine(str(path), device="cpu", estimate=estimate_once)
        async with serving(engine, config(path, max_message_bytes=1024)) as s:
            items = [
                item(np.full((1, size), 7, np.uint8), f"s{size}", model="echo") for size in sizes
            ]
            return await collect(stream_stub(s).ModelStreamInfer(iter(items), timeout=30))

    answers = asyncio.run(scenario())
    assert all(answer.ByteSize() <= 1024 for answer in answers)
    by_size = {int(answer.infer_response.id[1:]): answer for answer in answers}
    assert sorted(by_size) == list(sizes), "each item answered, once"
    fits = [size for size in sizes if not by_size[size].error_message]
    assert fits == list(sizes)[: len(fits)], "the smaller answers fit"
    assert 0 < len(fits) < len(sizes)
    for size in sizes[len(fits) :]:
        message = by_size[size].error_message
        assert message.startswith(f"RESOURCE_EXHAUSTED ANSWER_TOO_LARGE: [request id: s{size}]")
        assert "over the server's max_message_bytes (1024)" in message


IDEMPOTENT: dict[str, Any] = {"laneserve_idempotent": {"bool_param": True}}


def test_stream_ids_are_tags_and_a_run_again_with_the_same_ids_runs_again(
    small_model: Path,
) -> None:
    """perf_analyzer --streaming restarts its ids each run, with the same data: the
    second run within idempotency_ttl_s was answered from the replay cache. An id is a
    tag by default: every item runs, the same id on two items in flight at once too,
    each answer tagged with it. An item without one runs too; laneserve_idempotent
    without an id is refused naming both, as it is read, and answered after the item
    without an id read before it (answers without an id come in their items' order)."""

    def run_items() -> list[Request]:
        return [item(rows(2, start=0), "0"), item(rows(2, start=10), "1")]

    async def scenario() -> tuple[list[Answer], list[Answer], list[Answer], list[int]]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            first = await collect(stream_stub(s).ModelStreamInfer(iter(run_items())))
            again = await collect(stream_stub(s).ModelStreamInfer(iter(run_items())))
            engine.hold_next()
            sent: asyncio.Queue[Request | None] = asyncio.Queue()
            call = asyncio.ensure_future(collect(stream_stub(s).ModelStreamInfer(fed(sent))))
            sent.put_nowait(item(rows(1, start=20), "same"))
            await asyncio.to_thread(engine.entered.acquire)
            sent.put_nowait(item(rows(1, start=30), "same"))
            sent.put_nowait(item(rows(1, start=40), ""))
            sent.put_nowait(item(rows(1), "", **IDEMPOTENT))
            await until(lambda: queued_rows(s) == 2)
            # Refused as read (counted in the default lane), held behind the queued item.
            await until_stats(
                s, lambda stats: lane_of(stats, "standard").rejected["INVALID_INPUT"] == 1
            )
            engine.release()
            sent.put_nowait(None)
            mixed = await call
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert (stats.idempotent_joins, stats.idempotent_replays) == (0, 0)
            assert stats.replay_cache_entries == 0
        return first, again, mixed, engine.ran_tags

    first, again, mixed, ran = asyncio.run(scenario())
    assert sorted(ran) == [0, 0, 1, 1, 10, 10, 11, 11, 20, 30, 40], "every item ran"
    for answers in (first, again):
        assert sorted(answer.infer_response.id for answer in answers) == ["0", "1"]
        assert all(answer.error_message == "" for answer in answers)
    same = [answer for answer in mixed if answer.infer_response.id == "same"]
    assert sorted(len(raw_output(answer)) for answer in same) == [40, 40]
    assert raw_output(same[0]) != raw_output(same[1]), "each its own item's"
    ran_first, refused = [answer for answer in mixed if answer.infer_response.id == ""]
    assert len(raw_output(ran_first)) == 10 * 4
    idempotent_without_id = (
        "INVALID_ARGUMENT INVALID_INPUT: request parameter 'laneserve_idempotent' is true and "
        "the request has no id; expected an id with it (laneserve's request_id, the same on "
        "each retry), or no laneserve_idempotent"
    )
    assert refused.error_message == idempotent_without_id


def test_an_idempotent_item_already_answered_is_replayed_and_reused_with_other_inputs_refused(
    small_model: Path,
) -> None:
    """laneserve_idempotent true: one id space with ModelInfer's and Infer's idempotent
    requests. A stream item whose id was answered (on a stream, or over ModelInfer) gets
    the stored answer without running again; one with other inputs is refused
    REQUEST_ID_REUSED, alone; one without the parameter runs, its id keying nothing."""

    async def scenario() -> tuple[list[Answer], list[Answer], kpb.ModelInferResponse, list[int]]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            unary = await stream_stub(s).ModelInfer(item(rows(1, start=5), "u", **IDEMPOTENT))
            first = await collect(
                stream_stub(s).ModelStreamInfer(iter([item(rows(2, start=0), "x", **IDEMPOTENT)]))
            )
            again = await collect(
                stream_stub(s).ModelStreamInfer(
                    iter(
                        [
                            item(rows(2, start=0), "x", **IDEMPOTENT),
                            item(rows(1, start=5), "u", **IDEMPOTENT),
                            item(rows(2, start=50), "x-other", **IDEMPOTENT),
                            item(rows(3, start=60), "x", **IDEMPOTENT),
                            item(rows(1, start=70), "x"),
                        ]
                    )
                )
            )
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert stats.idempotent_replays == 2
        return first, again, unary, engine.ran_tags

    first, again, unary, ran = asyncio.run(scenario())
    by_id: dict[str, list[Answer]] = {}
    for answer in again:
        by_id.setdefault(answer.infer_response.id, []).append(answer)
    (reused,) = [answer for answer in by_id["x"] if answer.error_message]
    tagged, replayed = sorted(  # 1 row, then 2
        (answer for answer in by_id["x"] if not answer.error_message),
        key=lambda answer: len(raw_output(answer)),
    )
    assert raw_output(replayed) == raw_output(first[0])
    assert len(raw_output(tagged)) == 10 * 4
    assert raw_output(by_id["u"][0]) == unary.raw_output_contents[0]
    assert reused.error_message.startswith("INVALID_ARGUMENT REQUEST_ID_REUSED: [request id: x] ")
    assert sorted(ran) == [0, 1, 5, 50, 51, 70], "the replayed items ran nothing again"


def test_a_model_stream_counts_as_a_stream_against_the_ports_bounds(small_model: Path) -> None:
    """ModelStreamInfer is an inference call and a stream (`CallGate`): with
    max_concurrent_rpcs 2, one stream is the streams' half, and another, of either
    protocol, is refused in gRPC's words for a full port, the bound in its trailer."""

    async def scenario() -> None:
        async with serving(
            RecordingEngine(str(small_model)), config(small_model, max_concurrent_rpcs=2)
        ) as s:
            gate = s.server._listeners[0].acceptors._gate
            stop = asyncio.Event()

            async def idle() -> AsyncIterator[Request]:
                await stop.wait()
                yield item(rows(1), "never")  # the stream is cancelled first

            held = stream_stub(s).ModelStreamInfer(idle())
            await until(lambda: gate.stream_calls == 1)
            for over in (
                stream_stub(s).ModelStreamInfer(idle()),
                s.stub.InferStream(iter([request(rows(1), request_id="i")])),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await asyncio.wait_for(over.read(), 10)
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert caught.value.details() == grpc_accept.CALL_LIMIT_DETAILS
                assert grpc_accept.STREAM_LIMIT_KEY in dict(caught.value.trailing_metadata() or ())
            answer = await stream_stub(s).ModelInfer(item(rows(1), "unary"), timeout=10)
            assert answer.id == "unary"
            held.cancel()
            await until(lambda: gate.stream_calls == 0)

    asyncio.run(scenario())


def test_an_error_answer_carries_its_code_reason_and_retry_and_fits_its_limit() -> None:
    """`ModelStreamWire.error`: a retryable error's wait in whole ms, rounded up, as
    grpc-retry-pushback-ms gives it; at the smallest receive limit, with a 256-byte id
    and model name, the message is cut to fit, its code and reason kept first."""
    wire = kserve_convert.ModelStreamWire(
        lambda _item: InvalidInputError("unused"), "m" * 256, 0, NO_REGIONS, 1
    )
    full = wire.error(tag("a1"), LaneFullError("lane 'bulk' is full", retry_after_s=0.0121), 4096)
    assert (
        full.error_message == "RESOURCE_EXHAUSTED LANE_FULL: [request id: a1] lane 'bulk' is full"
    )
    assert parameters(full) == {
        "laneserve_error_code": grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        "laneserve_error_reason": "LANE_FULL",
        "laneserve_retry_after_ms": 13,
    }
    long_id = "i" * 256
    cut = wire.error(tag(long_id), LaneFullError("q" * 5000, retry_after_s=1.0), 1024)
    assert cut.ByteSize() <= 1024
    assert cut.infer_response.id == long_id
    assert cut.error_message.startswith("RESOURCE_EXHAUSTED LANE_FULL: [request id: iii")
    assert "(message cut: " in cut.error_message


def test_a_model_stream_answers_held_bytes_are_its_outputs_data() -> None:
    """The credit window counts an answer's tensor data (`StreamWindow`), read from its
    outputs' shapes and datatypes, not from the bytes (a copy)."""
    wire = kserve_convert.ModelStreamWire(
        lambda _item: InvalidInputError("unused"), "m", 0, NO_REGIONS, 1
    )
    response = pb.InferResponse(
        request_id="r",
        outputs=[
            encode_tensor("a", np.zeros((2, 3), np.uint16)),
            encode_tensor("b", np.zeros((4, 1), np.float64)),
            encode_tensor("c", np.zeros((0, 5), np.bool_)),
        ],
        timing=pb.Timing(lane="bulk", batch_size=1),
    )
    answer = wire.answer(tag("r"), response)
    assert wire.held_bytes(answer) == sum(map(len, answer.infer_response.raw_output_contents))
    assert wire.held_bytes(answer) == 2 * 3 * 2 + 4 * 8
    assert wire.held_bytes(wire.error(tag("r"), InvalidInputError("no"), 4096)) == 0


# Two outputs of narrow types and lanes of every length a name's size is counted in: the
# envelope tests' answers at the edges of every length (`_edge_answers`).
_EDGE_SPECS = (
    TensorSpec("a", np.dtype("<u2"), (-1, 3)),
    TensorSpec("b", np.dtype("bool"), (-1, 3)),
)
_EDGE_LANES = ["interactive", "standard", "l" * 120]


def _edge_answers(
    request_ids: Sequence[str], name_bytes: Sequence[int]
) -> Iterator[tuple[tuple[object, ...], pb.InferResponse]]:
    """Answers at the edges of every length an envelope counts (lane, timing, id, output
    names, data), each with what made it, for the assertion's message."""
    for lane, timing_value, request_id, names, data_rows in itertools.product(
        _EDGE_LANES, (0, 2**32 - 1), request_ids, name_bytes, (0, 1, 50)
    ):
        answer = pb.InferResponse(
            request_id=request_id,
            outputs=[
                encode_tensor(spec.name * names, np.zeros((data_rows, 3), spec.dtype))
                for spec in _EDGE_SPECS
            ],
            timing=pb.Timing(
                lane=lane,
                batch_size=timing_value,
                queue_us=timing_value and 2**63 - 1,
                infer_us=timing_value and 2**63 - 1,
            ),
        )
        yield (lane, timing_value, names, data_rows), answer


def test_the_stream_envelope_bounds_every_model_stream_answer_and_is_reached() -> None:
    """What a ModelStreamInferResponse adds to an answer's InferResponse, where its
    ModelInferResponse is within the limit: at most `answer_extra_bytes` and
    `stream_wrapper_bytes` (the envelope every answer is held to), over answers at the
    edges of every length counted (as `answer_extra_bytes`' own test). Exact: some answer
    takes all of it. Without the wrapper's bytes an answer that fit ModelInfer could fail
    a whole stream."""
    reached = False
    for limit, model_name, final in itertools.product(
        (1024, 64 * 1024 * 1024), ("m", "\u00e9" * 128), (False, True)
    ):
        bound = kserve_convert.answer_extra_bytes(model_name, _EDGE_SPECS, _EDGE_LANES)
        bound += kserve_convert.stream_wrapper_bytes(limit)
        wire = kserve_convert.ModelStreamWire(
            lambda _item: InvalidInputError("-"), model_name, 0, NO_REGIONS, 1
        )
        for made, answer in _edge_answers(("", "r" * 200), (100, 117)):
            # Marked final where its item asked for the mark.
            sent = wire.answer(tag(answer.request_id, final_response=final), answer)
            if sent.infer_response.ByteSize() > limit:
                continue  # refused at any envelope
            added = sent.ByteSize() - answer.ByteSize()
            assert added <= bound, (limit, *made)
            reached = reached or added == bound
    assert reached, "the bound is some answer's"


def test_envelope_bytes_bound_a_model_stream_answer_over_its_infer_stream_item() -> None:
    """`ModelStreamWire.envelope_bytes`, by which the receive limit is checked
    (`ReceiveLimit`: answers are sized as InferStream items): what a
    ModelStreamInferResponse within the caller's limit takes over the same answer as an
    InferStream item, over answers at the edges of every length counted, marked final.
    Under-counted, an answer the caller cannot read is sent and ends its whole stream;
    within a byte of some answer's (the integration test's answers, near the limit and
    with real timings, leave it 10 to 20 bytes, too few to tell)."""
    for limit, model_name in itertools.product((1024, 4096), ("m", "\u00e9" * 128)):
        extra = kserve_convert.answer_extra_bytes(model_name, _EDGE_SPECS, _EDGE_LANES)
        wire = kserve_convert.ModelStreamWire(
            lambda _item: InvalidInputError("-"), model_name, extra, NO_REGIONS, 1
        )
        envelope = wire.envelope_bytes(limit)
        largest = 0
        for made, answer in _edge_answers(("", "r", "r" * 200), (1, 57, 100, 114, 117)):
            sent = wire.answer(tag(answer.request_id, final_response=True), answer)
            if sent.ByteSize() > limit:
                continue
            as_item = pb.InferStreamResponse(request_id=answer.request_id, response=answer)
            added = sent.ByteSize() - as_item.ByteSize()
            assert added <= envelope, (limit, *made)
            largest = max(largest, added)
        assert largest >= envelope - 1, (limit, model_name[:1], largest, envelope)


def test_the_answers_of_items_asking_for_tritons_final_response_mark_alone_are_marked(
    small_model: Path,
) -> None:
    """perf_analyzer --streaming sends triton_enable_empty_final_response on every item
    (laneserve refused it as an unknown parameter). Taken: every answer is its item's one
    and last, and, as Triton marks per request, the answers of the items that asked (an
    error's too) and of no other, before or after them on the stream, carry
    triton_final_response true; a flag that is not a bool_param is that item's refusal."""
    flag: dict[str, Any] = {"triton_enable_empty_final_response": {"bool_param": True}}
    items = [
        item(rows(1), "plain"),
        item(rows(2), "asks", **flag),
        item(rows(1), "after"),
        item(rows(1), "m", model="other", **flag),
        item(rows(1), "m-plain", model="other"),
        item(rows(1), "false", triton_enable_empty_final_response={"bool_param": False}),
        item(rows(1), "bad", triton_enable_empty_final_response={"int64_param": 1}),
    ]

    async def scenario() -> list[Answer]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            sent: asyncio.Queue[Request | None] = asyncio.Queue()
            call = stream_stub(s).ModelStreamInfer(fed(sent))
            answers = []
            for message in items:  # in order: each answered before the next is sent
                sent.put_nowait(message)
                answer = await asyncio.wait_for(call.read(), 10)
                assert isinstance(answer, Answer)
                answers.append(answer)
            sent.put_nowait(None)
            return answers

    answers = asyncio.run(scenario())
    marked = {
        answer.infer_response.id: parameters(answer).get("triton_final_response")
        for answer in answers
    }
    assert marked == {
        "plain": None,
        "asks": True,
        "after": None,
        "m": True,
        "m-plain": None,
        "false": None,
        "bad": None,
    }
    by_id = {answer.infer_response.id: answer for answer in answers}
    assert len(raw_output(by_id["asks"])) == 2 * 10 * 4
    assert len(raw_output(by_id["after"])) == 10 * 4
    assert by_id["m"].error_message.startswith("NOT_FOUND MODEL_NOT_FOUND: [request id: m] ")
    assert by_id["bad"].error_message.startswith(
        "INVALID_ARGUMENT INVALID_INPUT: [request id: bad] request parameter "
        "'triton_enable_empty_final_response' is an int64_param; expected bool_param"
    )


def test_stream_items_with_bytes_inputs_are_answered_and_a_bad_one_is_its_own_error(
    text_model: Path,
) -> None:
    """Items of the text model in raw contents and in bytes_contents, answered with the
    same BYTES, INT64 and FP32 outputs as ModelInfer's; an item with an element that is
    not UTF-8 is answered with its error, naming the element, and the stream goes on."""
    not_utf8 = encode_strings("text", np.array(["a", "b", "c", "d"], dtype=object))
    not_utf8 = not_utf8.replace(b"b", b"\xff")
    typed = typed_request("text", text=TEXT, numbers=NUMBERS)
    items = [text_request(), typed, text_request(), text_request()]
    items[2].raw_input_contents[0] = not_utf8
    for index, message in enumerate(items):
        message.id = f"t{index}"

    async def scenario() -> list[Answer]:
        async with serving(
            Engine(str(text_model), estimate=estimate_once), config(text_model)
        ) as s:
            return await collect(stream_stub(s).ModelStreamInfer(iter(items), timeout=30))

    by_id = {answer.infer_response.id: answer for answer in asyncio.run(scenario())}
    assert sorted(by_id) == ["t0", "t1", "t2", "t3"]
    for good in ("t0", "t1", "t3"):
        response = by_id[good].infer_response
        assert by_id[good].error_message == ""
        assert [(t.name, t.datatype, list(t.shape)) for t in response.outputs] == TEXT_OUTPUTS
        found = outputs_of(response)
        assert found["tagged"].tolist() == TAGGED
        assert found["label"].tolist() == LABELS
        assert found["value"].tobytes() == VALUES.tobytes()
    assert by_id["t2"].error_message.startswith(
        "INVALID_ARGUMENT INVALID_INPUT: [request id: t2] tensor 'text': element 1 is not UTF-8"
    ), by_id["t2"].error_message


def test_a_model_stream_answers_held_bytes_count_a_bytes_outputs_text() -> None:
    """A BYTES output's held bytes are its raw_output_contents entry's (each element's
    length and text, as InferStream counts a STRING output's data); one written to shared
    memory (an empty entry) is counted at the least it took, a length per element."""
    wire = kserve_convert.ModelStreamWire(
        lambda _item: InvalidInputError("unused"), "m", 0, NO_REGIONS, 1
    )
    response = pb.InferResponse(
        request_id="r",
        outputs=[
            encode_tensor("t", np.array(["ab", "", "\u00e9"], dtype=object)),
            encode_tensor("n", np.zeros(3, np.int64)),
        ],
        timing=pb.Timing(lane="bulk", batch_size=3),
    )
    answer = wire.answer(tag("r"), response)
    assert wire.held_bytes(answer) == sum(map(len, answer.infer_response.raw_output_contents))
    assert wire.held_bytes(answer) == (4 + 2) + 4 + (4 + 2) + 3 * 8
    placed = Answer()
    placed.infer_response.outputs.add(name="t", datatype="BYTES", shape=[3])
    placed.infer_response.raw_output_contents.append(b"")
    assert wire.held_bytes(placed) == 3 * 4
