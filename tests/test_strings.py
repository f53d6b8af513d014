"""String (text) tensors: ONNX's tensor(string) on laneserve's own API, from the wire
encoding to a batched run of the real session."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import struct
import threading
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from laneserve.client import tensors
from laneserve.client.tensors import decode_tensor, encode_tensor
from laneserve.server import Engine, EngineStartError, ServerConfig, service, text_thread
from laneserve.server.bench.baselines import EchoServicer
from laneserve.server.bench.loadgen import request_body
from laneserve.server.bench.run import load_inputs
from laneserve.server.bench.settings import Stream
from laneserve.server.codec import MAX_EXTRA_BYTES, decode_inputs, extra_bytes, leading_rows
from laneserve.server.config import DEFAULT_LANES
from laneserve.server.engine import TensorSpec
from laneserve.server.idempotency import MAX_CALLERS_WAITING
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.probe import held_bytes
from laneserve.v1 import inference_pb2 as pb
from tests.support import (
    RecordingEngine,
    estimate_once,
    queued_rows,
    rich_status,
    save_model,
    serving,
    until,
    until_stats,
)
from tests.test_telemetry import only_value, scrape, values

pytestmark = pytest.mark.usefixtures("no_leaked_threads")


def _length_prefixed(*elements: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(element)) + element for element in elements)


def _text_request(
    texts: list[str], numbers: list[list[str]], request_id: str = ""
) -> pb.InferRequest:
    return pb.InferRequest(
        request_id=request_id,
        inputs=[
            encode_tensor("text", np.array(texts, dtype=object)),
            encode_tensor("numbers", np.array(numbers, dtype=object)),
        ],
    )


# ---- the wire encoding --------------------------------------------------------------------


@pytest.mark.parametrize(
    "array",
    [
        np.array(["cat", "", "Ünïcode ✓", "a\x00b"]),  # numpy str_
        np.array(["cat", "", "Ünïcode ✓", "a\x00b"], dtype=object),
        np.array(["cat", "", "Ünïcode ✓", "a\x00b"], dtype=np.dtypes.StringDType()),
        np.array([b"cat", b"", "Ünïcode ✓".encode(), b"a\x00b"], dtype=object),
        np.array([b"cat", b"", "Ünïcode ✓".encode(), b"a\x00b"]),  # numpy bytes_
    ],
    ids=["str_", "object-str", "StringDType", "object-bytes", "bytes_"],
)
def test_text_in_any_numpy_form_is_sent_length_prefixed_and_read_back_as_str(
    array: np.ndarray,
) -> None:
    """Each element a 4-byte little-endian length and its UTF-8 bytes (KServe's BYTES
    encoding), read back as an object array of str: what ONNX Runtime takes and gives."""
    tensor = encode_tensor("text", array.reshape(2, 2))
    assert tensor.dtype == pb.DATA_TYPE_STRING
    assert tensor.data == _length_prefixed(b"cat", b"", "Ünïcode ✓".encode(), b"a\x00b")
    decoded = decode_tensor(tensor)
    assert decoded.dtype == np.dtype(object)
    assert decoded.shape == (2, 2)
    assert decoded.tolist() == [["cat", ""], ["Ünïcode ✓", "a\x00b"]]
    assert all(type(value) is str for value in decoded.flat)


def test_a_non_contiguous_text_array_is_sent_in_row_major_order() -> None:
    array = np.array([["a", "b"], ["c", "d"]], dtype=object).T
    assert decode_tensor(encode_tensor("t", array)).tolist() == [["a", "c"], ["b", "d"]]


@pytest.mark.parametrize(
    ("array", "expected"),
    [
        (
            np.array(["ok", b"\xff\xfe"], dtype=object),
            "tensor 't': element 1 is not UTF-8 (invalid start byte at byte 0); expected text",
        ),
        (
            np.array(["ok", 3], dtype=object),
            "tensor 't': element 1 is int; expected str (or UTF-8 bytes)",
        ),
        (
            np.array(["ok", None], dtype=object),
            "tensor 't': element 1 is NoneType; expected str",
        ),
        (
            np.array(["\ud800"], dtype=object),
            "tensor 't': element 0 has no UTF-8 encoding (surrogates not allowed at character 0)",
        ),
    ],
    ids=["not-utf8", "int", "none", "lone-surrogate"],
)
def test_an_element_that_is_not_text_is_refused_naming_it(array: np.ndarray, expected: str) -> None:
    """ONNX Runtime turns a bytes element into the text "b'...'" and any other object into
    its str(): a client that sent them would get answers to other inputs, silently."""
    with pytest.raises(ValueError, match="^" + re.escape(expected)):
        encode_tensor("t", array)


@pytest.mark.parametrize(
    ("shape", "data", "expected"),
    [
        (
            [2],
            _length_prefixed(b"abcd") + b"\x00",
            "data ends before element 1's length (at byte 8 of 9)",
        ),
        ([1], struct.pack("<I", 9) + b"abc", "element 0 says 9 bytes, 3 are left"),
        ([1], _length_prefixed(b"a") + b"z", "data has 1 byte after its 1 string element"),
        ([1], _length_prefixed(b"\xc3"), "element 0 is not UTF-8 (unexpected end of data"),
        ([10**12], b"", "data is 0 bytes; expected at least 4000000000000"),
        ([3], b"\x00\x00\x00", "data is 3 bytes; expected at least 12 (3 string elements"),
    ],
    ids=["missing-element", "short-element", "trailing-bytes", "cut-utf8", "huge-shape", "short"],
)
def test_string_data_that_does_not_parse_is_refused_saying_where(
    shape: list[int], data: bytes, expected: str
) -> None:
    """A shape of 10**12 elements over no data is refused by the data's length before an
    array of that many is allocated."""
    tensor = pb.Tensor(name="t", dtype=pb.DATA_TYPE_STRING, shape=shape, data=data)
    with pytest.raises(ValueError, match="^" + re.escape(f"tensor 't': {expected}")):
        decode_tensor(tensor)


def test_string_data_sizes_itself_for_the_requests_bounds() -> None:
    """A request's bytes besides its tensors' data (MAX_EXTRA_BYTES) and its rows, read
    before it is decoded: a text's data is its own length, not its shape's. A 1 MiB text
    is data, not extra bytes."""
    text = encode_tensor("text", np.array(["x" * 2**20], dtype=object))
    numbers = encode_tensor("numbers", np.array([["1", "2"]], dtype=object))
    request = pb.InferRequest(inputs=[text, numbers])
    extra = extra_bytes(request, request.ByteSize())
    assert extra is not None
    assert 0 <= extra < MAX_EXTRA_BYTES
    short = pb.Tensor(name="text", dtype=pb.DATA_TYPE_STRING, shape=[2**40], data=b"ab")
    specs = _text_specs()
    assert leading_rows([text, numbers], specs, max_message_bytes=64 * 2**20) == 1
    assert leading_rows([short, numbers], specs, max_message_bytes=64 * 2**20) is None


def _text_specs() -> tuple[TensorSpec, ...]:
    """The text model's inputs' specs, as its engine reads them."""
    text = np.dtype(object)
    return (
        TensorSpec("text", text, (-1,), ("batch",)),
        TensorSpec("numbers", text, (-1, 2), ("batch", None)),
    )


def test_held_bytes_counts_each_texts_str_object() -> None:
    """A string tensor's nbytes is its pointers: memory accounting counts the text too."""
    short = np.array(["a"] * 4, dtype=object)
    long = np.array(["a" * 10_000] * 4, dtype=object)
    assert held_bytes(long) - held_bytes(short) == 4 * 9_999
    numbers = np.zeros((4, 3), np.float32)
    assert held_bytes(numbers) == numbers.nbytes


# ---- served -------------------------------------------------------------------------------


async def _batched_behind_a_held_run(
    text_model: Path, engine: RecordingEngine, requests: list[pb.InferRequest]
) -> list[pb.InferResponse | BaseException]:
    """`requests` queued while `engine` runs a first one held, so that they form one
    batch once it is let go: each call's answer, or its error."""
    async with serving(engine, ServerConfig(model_path=str(text_model))) as s:
        engine.hold()
        first = asyncio.ensure_future(
            s.stub.Infer(_text_request(["cat"], [["0", "0"]]), timeout=30)
        )
        await asyncio.to_thread(engine.entered.acquire)
        calls = [asyncio.ensure_future(s.stub.Infer(request, timeout=30)) for request in requests]
        rows = sum(request.inputs[0].shape[0] for request in requests)
        await until(lambda: queued_rows(s) == rows)
        engine.release()
        answers = await asyncio.gather(*calls, return_exceptions=True)
        await first
        return answers


def test_text_requests_batched_together_get_each_their_own_answers(text_model: Path) -> None:
    """Three requests of text held in one batch (the session busy with a fourth): each
    answer is what the model gives its own rows alone, string outputs and numeric ones,
    and the batch's signature let them join (one run of 6 rows)."""
    reference = ort.InferenceSession(str(text_model), providers=["CPUExecutionProvider"])
    requests = [
        (["cat"], [["1", "2"]]),
        (["dog", "Ünïcode ✓", ""], [["-1.5", "1e3"], ["0", "0"], ["3", "4"]]),
        (["bird", "a\x00b"], [["7", "8"], ["9", "10"]]),
    ]

    async def scenario() -> tuple[list[pb.InferResponse | BaseException], list[int]]:
        engine = RecordingEngine(str(text_model), device="cpu")
        sent = [_text_request(*request) for request in requests]
        return await _batched_behind_a_held_run(text_model, engine, sent), list(engine.batches)

    answers, batches = asyncio.run(scenario())
    assert batches == [1, 6]
    for (texts, numbers), answer in zip(requests, answers, strict=True):
        assert isinstance(answer, pb.InferResponse), answer
        expected = reference.run(
            None,
            {"text": np.array(texts, dtype=object), "numbers": np.array(numbers, dtype=object)},
        )
        got = {tensor.name: tensor for tensor in answer.outputs}
        assert got["tagged"].dtype == pb.DATA_TYPE_STRING
        tagged = decode_tensor(got["tagged"])
        assert tagged.dtype == np.dtype(object)
        assert tagged.tolist() == expected[0].tolist() == [f"{text}!" for text in texts]
        np.testing.assert_array_equal(decode_tensor(got["label"]), expected[1])
        np.testing.assert_array_equal(decode_tensor(got["value"]), expected[2])


def test_a_text_row_the_model_fails_on_fails_its_request_only(text_model: Path) -> None:
    """Cast of "x" to float fails in the runtime: the request whose row it is fails alone
    (ENGINE_FAILURE, its row named), the requests batched with it are answered."""

    async def scenario() -> list[pb.InferResponse | BaseException]:
        engine = RecordingEngine(str(text_model), device="cpu")
        sent = [
            _text_request(["dog"], [["1", "2"]]),
            _text_request(["cat", "bird"], [["3", "4"], ["x", "5"]]),
            _text_request(["bird"], [["6", "7"]]),
        ]
        return await _batched_behind_a_held_run(text_model, engine, sent)

    good, bad, good_too = asyncio.run(scenario())
    for answer, value in ((good, [[1.0, 2.0]]), (good_too, [[6.0, 7.0]])):
        assert isinstance(answer, pb.InferResponse)
        (got,) = [tensor for tensor in answer.outputs if tensor.name == "value"]
        np.testing.assert_array_equal(decode_tensor(got), value)
    assert isinstance(bad, grpc.aio.AioRpcError)
    assert bad.code() == grpc.StatusCode.INTERNAL
    reason, details = rich_status(bad)
    assert reason == "ENGINE_FAILURE"
    assert details["metadata"]["row"] == "1", details


def test_text_over_the_stream_and_in_the_models_signature(text_model: Path) -> None:
    """InferStream answers text as Infer does; GetModel names the string inputs and
    outputs DATA_TYPE_STRING."""

    async def scenario() -> tuple[pb.GetModelResponse, list[pb.InferStreamResponse]]:
        engine = Engine(str(text_model), device="cpu", estimate=estimate_once)
        async with serving(engine, ServerConfig(model_path=str(text_model))) as s:
            model = await s.stub.GetModel(pb.GetModelRequest(), timeout=30)
            items = [
                _text_request([text], [["1", "2"]], request_id=f"item-{index}")
                for index, text in enumerate(["cat", "Ünï", ""])
            ]
            answers = [answer async for answer in s.stub.InferStream(iter(items), timeout=30)]
            return model, answers

    model, answers = asyncio.run(scenario())
    assert [(spec.name, spec.dtype) for spec in model.inputs] == [
        ("text", pb.DATA_TYPE_STRING),
        ("numbers", pb.DATA_TYPE_STRING),
    ]
    assert [(spec.name, spec.dtype) for spec in model.outputs] == [
        ("tagged", pb.DATA_TYPE_STRING),
        ("label", pb.DATA_TYPE_INT64),
        ("value", pb.DATA_TYPE_FLOAT32),
    ]
    tagged = {
        answer.response.request_id: decode_tensor(answer.response.outputs[0]).tolist()
        for answer in answers
    }
    assert tagged == {"item-0": ["cat!"], "item-1": ["Ünï!"], "item-2": ["!"]}


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [
        (
            pb.Tensor(
                name="text", dtype=pb.DATA_TYPE_STRING, shape=[1], data=_length_prefixed(b"\xff")
            ),
            (
                "tensor 'text': element 0 is not UTF-8 (invalid start byte at byte 0); "
                "expected text (ONNX Runtime reads string tensors as UTF-8)"
            ),
        ),
        (
            pb.Tensor(
                name="text", dtype=pb.DATA_TYPE_STRING, shape=[2], data=_length_prefixed(b"a")
            ),
            "tensor 'text': data is 5 bytes; expected at least 8 (2 string elements",
        ),
        (
            encode_tensor("text", np.zeros(1, np.float32)),
            "input 'text' has dtype float32; expected string with shape [-1], -1 = any size",
        ),
    ],
    ids=["not-utf8", "short", "float-for-text"],
)
def test_text_the_model_cannot_take_is_refused_invalid_argument(
    text_model: Path, tensor: pb.Tensor, expected: str
) -> None:
    request = pb.InferRequest(
        inputs=[tensor, encode_tensor("numbers", np.array([["1", "2"]], dtype=object))]
    )
    refused = _refused_by(text_model, request)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.details() or "").startswith(expected), refused.details()


def _refused_by(model: Path, request: pb.InferRequest) -> grpc.aio.AioRpcError:
    """How a server of `model` refuses `request` (an Infer call that must fail)."""

    async def scenario() -> grpc.aio.AioRpcError:
        engine = Engine(str(model), device="cpu", estimate=estimate_once)
        async with serving(engine, ServerConfig(model_path=str(model))) as s:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.Infer(request, timeout=30)
            return refused.value

    return asyncio.run(scenario())


def test_a_text_element_that_is_not_utf8_is_refused_naming_its_row(text_model: Path) -> None:
    """numbers [3, 2] whose element 3 is not UTF-8: refused INVALID_INPUT naming row 1, in
    its words and in ErrorInfo's metadata "row" (what laneserve-client's failed rows read:
    they named no input row for it)."""
    elements = [b"1", b"2", b"3", b"\xff", b"5", b"6"]
    numbers = pb.Tensor(
        name="numbers",
        dtype=pb.DATA_TYPE_STRING,
        shape=[3, 2],
        data=_length_prefixed(*elements),
    )
    request = pb.InferRequest(
        inputs=[encode_tensor("text", np.array(["a", "b", "c"], dtype=object)), numbers]
    )
    refused = _refused_by(text_model, request)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.details() or ""
    assert details.startswith("tensor 'numbers': element 3 is not UTF-8"), details
    assert details.endswith("; element 3 is in row 1 of the request"), details
    assert rich_status(refused) == ("INVALID_INPUT", {"metadata": {"row": "1"}})


def test_a_text_model_of_a_fixed_first_axis_is_padded_with_copies_and_not_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """text [4] -> text + "?" (an export without a dynamic axis): a request of 1 or 6
    rows runs in runs of 4, padded with copies of its last text; the start-up check of
    rows that mix compares text exactly and finds none."""
    suffix = onnx.numpy_helper.from_array(np.array("?", dtype=object), "suffix")
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["suffix"], value=suffix),
            helper.make_node("StringConcat", ["text", "suffix"], ["asked"]),
        ],
        "fixed_text",
        [helper.make_tensor_value_info("text", TensorProto.STRING, [4])],
        [helper.make_tensor_value_info("asked", TensorProto.STRING, [4])],
    )
    path = save_model(tmp_path / "fixed_text.onnx", graph, opset=20)
    caplog.set_level(logging.WARNING)
    engine = Engine(str(path), device="cpu", estimate=estimate_once)
    engine.probe(8, repeats=1)
    assert [getattr(record, "event", None) for record in caplog.records] == ["fixed_batch_axis"]
    for texts in (["one"], ["a", "b", "c", "d", "e", "Ünï"]):
        outputs = engine.run({"text": np.array(texts, dtype=object)})
        assert outputs["asked"].tolist() == [f"{text}?" for text in texts]


def test_a_string_normalizer_whose_locale_the_machine_lacks_is_refused_saying_what_to_do(
    tmp_path: Path,
) -> None:
    """Every TfidfVectorizer skl2onnx converts holds a StringNormalizer of locale
    en_US.UTF-8, which a slim container lacks: the runtime's refusal ("install necessary
    language-pack-XX") named neither the attribute nor the converter's option."""
    graph = helper.make_graph(
        [
            helper.make_node(
                "StringNormalizer",
                ["text"],
                ["lower"],
                case_change_action="LOWER",
                locale="xx_XX.UTF-8",
            )
        ],
        "normalizer",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["N"])],
        [helper.make_tensor_value_info("lower", TensorProto.STRING, ["N"])],
    )
    path = save_model(tmp_path / "normalizer.onnx", graph)
    with pytest.raises(EngineStartError) as refused:
        Engine(str(path), device="cpu", estimate=estimate_once)
    message = str(refused.value)
    assert "Failed to construct locale with name:xx_XX.UTF-8" in message
    assert message.endswith(
        "a StringNormalizer uses the locale its `locale` attribute names (en_US.UTF-8 unless "
        "set): install that locale on this machine (Debian: the locales package, "
        "locale-gen), or convert the model with one the machine has (`locale -a`; skl2onnx: "
        "options={id(vectorizer): {'locale': 'C.UTF-8'}})"
    ), message


def test_the_benchmark_sends_text_to_a_text_model_and_its_echo_answers_text(
    text_model: Path,
) -> None:
    """`laneserve bench` against the text model sent each element's PyObject pointer as
    its text (every request refused INVALID_INPUT, the report "valid"), and the echo
    baseline could not build its answer (a review)."""
    body = request_body(
        Stream("single", rows=3, concurrency=1),
        load_inputs(
            pb.GetModelResponse(
                inputs=[
                    pb.TensorSpec(name="text", dtype=pb.DATA_TYPE_STRING, shape=[-1]),
                    pb.TensorSpec(name="numbers", dtype=pb.DATA_TYPE_STRING, shape=[-1, 2]),
                ]
            )
        ),
        np.random.default_rng(0),
    )
    request = pb.InferRequest.FromString(body)
    engine = Engine(str(text_model), device="cpu", estimate=estimate_once)
    inputs = {tensor.name: decode_tensor(tensor) for tensor in request.inputs}
    assert inputs["numbers"].shape == (3, 2)
    assert all(value.isdigit() for value in inputs["numbers"].flat)
    engine.run(inputs)  # the model takes them: numbers Cast parses
    echo = EchoServicer(engine)._response(2)
    assert [decode_tensor(tensor).tolist() for tensor in echo.outputs] == [
        ["0", "0"],
        [0, 0],
        [[0.0, 0.0], [0.0, 0.0]],
    ]


def test_an_object_array_of_numbers_is_refused_saying_it_is_sent_as_text() -> None:
    """pandas' .values of mixed columns is an object array of floats: sent to a float
    model it was told "element 0 is float; expected str", which named no way out."""
    with pytest.raises(ValueError, match=re.escape("array.astype(np.float32), say")):
        encode_tensor("input", np.array([[1.0, 2.0]], dtype=object))


# ---- long text, decoded off the event loop ------------------------------------------------


def _long_text_request(
    rows: int, request_id: str = "", bad_row: int | None = None
) -> pb.InferRequest:
    """`rows` rows of the text model, 3 strings each, in the bulk lane (more rows than
    the default lane holds); `bad_row`'s text not UTF-8."""
    texts = [f"row {row}" for row in range(rows)]
    numbers = [[str(row), "1"] for row in range(rows)]
    request = _text_request(texts, numbers, request_id=request_id)
    request.lane = "bulk"
    if bad_row is not None:
        elements = [text.encode() for text in texts]
        elements[bad_row] = b"\xff"
        request.inputs[0].data = _length_prefixed(*elements)
    return request


# 3 strings a row: just over the most decoded on the event loop.
_LONG_ROWS = text_thread.EVENT_LOOP_TEXT_ELEMENTS // 3 + 1


class _DecodeGate:
    """Wraps the off-loop decode: records which thread decoded what, and holds each
    decode while `hold` is on, until `release`. Also tells when a call began waiting for
    another's decode of its request_id (`waited`), and how many decodes were asked of the
    text thread (`asked`: one queued behind a held one has not entered)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decoded_on: list[tuple[int, bool]] = []
        self.entered = threading.Semaphore(0)
        self._open = threading.Event()
        self._open.set()
        self.waited = 0
        self.asked = 0
        gate = self

        def recording(tensors: Any, specs: Any) -> Any:
            on_loop = threading.current_thread() is threading.main_thread()
            gate.decoded_on.append((tensors[0].shape[0], on_loop))
            if not on_loop:
                gate.entered.release()
                gate._open.wait(timeout=30)
            return decode_inputs(tensors, specs)

        after = text_thread.TextThread.after

        async def counted_after(reads: text_thread.TextThread, *args: Any) -> bool:
            gate.waited += 1
            return await after(reads, *args)

        decode = text_thread.TextThread.decode

        async def counted_decode(reads: text_thread.TextThread, *args: Any) -> Any:
            gate.asked += 1
            return await decode(reads, *args)

        monkeypatch.setattr(text_thread.TextThread, "decode", counted_decode)
        monkeypatch.setattr(service, "decode_inputs", recording)
        monkeypatch.setattr(text_thread, "decode_inputs", recording)
        monkeypatch.setattr(text_thread.TextThread, "after", counted_after)

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def until_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.acquire, True, 30)


def _text_config(text_model: Path) -> ServerConfig:
    return ServerConfig(model_path=str(text_model), max_batch_size=8192)


def _lane(stats: pb.GetStatsResponse, name: str) -> pb.LaneStats:
    return next(lane for lane in stats.lanes if lane.name == name)


def test_a_request_of_many_strings_is_decoded_off_the_event_loop(
    text_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text is decoded element by element (~0.3 us each): a 64 MiB request of 2-byte
    strings held the event loop, every other call with it, for 3 s. A request of more
    than EVENT_LOOP_TEXT_ELEMENTS strings is decoded on a thread; a smaller one, and a
    bad one's refusal, as before. Two calls of one request_id sent at once are one run,
    decoded once: the second waits for the first's decode, then joins it. Over a stream
    too."""
    gate = _DecodeGate(monkeypatch)

    async def scenario() -> tuple[list[pb.InferResponse], grpc.aio.AioRpcError, list[Any], int]:
        engine = Engine(str(text_model), device="cpu", estimate=estimate_once)
        async with serving(engine, _text_config(text_model)) as s:
            small = await s.stub.Infer(_text_request(["cat"], [["1", "2"]]), timeout=60)
            twice = await asyncio.gather(
                *(s.stub.Infer(_long_text_request(_LONG_ROWS, "same"), timeout=60) for _ in "ab")
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.Infer(_long_text_request(_LONG_ROWS, bad_row=7), timeout=60)
            items = [_long_text_request(_LONG_ROWS, f"item-{index}") for index in range(2)]
            streamed = [answer async for answer in s.stub.InferStream(iter(items), timeout=60)]
            stats = await s.stub.GetStats(pb.GetStatsRequest(), timeout=30)
            return [small, *twice], refused.value, streamed, stats.rows_run

    answers, refused, streamed, rows_run = asyncio.run(scenario())
    assert gate.decoded_on == [(1, True)] + [(_LONG_ROWS, False)] * 4
    small, first, second = answers
    assert decode_tensor(small.outputs[0]).tolist() == ["cat!"]
    assert first.outputs == second.outputs
    expected = [f"row {row}!" for row in range(_LONG_ROWS)]
    assert decode_tensor(first.outputs[0]).tolist() == expected
    assert rows_run == 1 + 3 * _LONG_ROWS, "the two calls of one request_id ran once"
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.details() or "").startswith("tensor 'text': element 7 is not UTF-8")
    assert sorted(answer.request_id for answer in streamed) == ["item-0", "item-1"]
    for answer in streamed:
        assert decode_tensor(answer.response.outputs[0]).tolist() == expected


def test_a_request_id_reused_while_its_first_request_is_decoded_refuses_the_second(
    text_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first request sent with an id is the one answered: a small request reusing
    the id of a long one being decoded (on its thread) waits for that decode, then is
    refused REQUEST_ID_REUSED. Decoded on the loop at once, the small one ran and the
    first was refused."""
    gate = _DecodeGate(monkeypatch)

    async def scenario() -> tuple[pb.InferResponse, grpc.aio.AioRpcError]:
        engine = Engine(str(text_model), device="cpu", estimate=estimate_once)
        async with serving(engine, _text_config(text_model)) as s:
            gate.hold()
            try:
                first = asyncio.ensure_future(
                    s.stub.Infer(_long_text_request(_LONG_ROWS, "shared"), timeout=60)
                )
                await gate.until_entered()
                reuse = _text_request(["cat"], [["1", "2"]], request_id="shared")
                second = asyncio.ensure_future(s.stub.Infer(reuse, timeout=60))
                await until(lambda: gate.waited == 1)
            finally:
                gate.release()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await second
            return await first, refused.value

    first, refused = asyncio.run(scenario())
    assert decode_tensor(first.outputs[0]).tolist()[:2] == ["row 0!", "row 1!"]
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rich_status(refused)[0] == "REQUEST_ID_REUSED"


def test_a_drain_admits_the_long_text_it_found_being_decoded_and_a_retry_joins_it(
    text_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request read before the drain is run, as one decoded on the loop at once was:
    the scheduler stops admitting only once its decode ends (it was refused DRAINING
    after its decode). A retry of it sent during the drain joins it, as a retry of a
    request the drain waits for does."""
    gate = _DecodeGate(monkeypatch)

    async def scenario() -> tuple[list[pb.InferResponse], int]:
        engine = RecordingEngine(str(text_model), device="cpu")
        async with serving(engine, _text_config(text_model)) as s:
            gate.hold()
            try:
                first = asyncio.ensure_future(
                    s.stub.Infer(_long_text_request(_LONG_ROWS, "kept"), timeout=60)
                )
                await gate.until_entered()
                stopping = asyncio.ensure_future(s.server.stop(grace_s=30.0))
                await until(lambda: s.server.state is Lifecycle.DRAINING)
                retry = asyncio.ensure_future(
                    s.stub.Infer(_long_text_request(_LONG_ROWS, "kept"), timeout=60)
                )
                await until(lambda: gate.waited == 1)
            finally:
                gate.release()
            answers = list(await asyncio.gather(first, retry))
            await stopping
            return answers, sum(engine.batches)

    (first, retry), rows_run = asyncio.run(scenario())
    assert first.outputs == retry.outputs
    assert decode_tensor(first.outputs[0]).tolist()[-1] == f"row {_LONG_ROWS - 1}!"
    assert rows_run == _LONG_ROWS, "run once"
    assert gate.decoded_on == [(_LONG_ROWS, False)]


def test_a_call_cancelled_while_its_long_text_is_decoded_is_counted_as_its_lanes(
    text_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller gone during the decode is counted as a refusal of its lane (CANCELLED),
    as one gone while it waited for room is; it was counted nowhere. Its decode's end
    admits nothing."""
    gate = _DecodeGate(monkeypatch)

    async def scenario() -> pb.GetStatsResponse:
        engine = RecordingEngine(str(text_model), device="cpu")
        async with serving(engine, _text_config(text_model)) as s:
            gate.hold()
            try:
                call = s.stub.Infer(_long_text_request(_LONG_ROWS, "gone"), timeout=60)
                await gate.until_entered()
                call.cancel()
                await until_stats(s, lambda stats: _lane(stats, "bulk").rejected["CANCELLED"] == 1)
            finally:
                gate.release()
            await s.stub.Infer(_text_request(["cat"], [["1", "2"]]), timeout=60)
            return await s.stub.GetStats(pb.GetStatsRequest(), timeout=30)

    stats = asyncio.run(scenario())
    bulk = _lane(stats, "bulk")
    assert bulk.admitted == 0
    assert dict(bulk.rejected) == {"CANCELLED": 1}
    assert stats.rows_run == 1


def test_a_batch_answering_many_strings_is_encoded_off_the_event_loop(
    text_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch whose answers hold more than EVENT_LOOP_TEXT_ELEMENTS strings has them
    encoded on the text thread before its answers reach the loop, byte for byte as the
    loop encodes them; a smaller answer is encoded on the loop, as before."""
    encoded_on: list[tuple[str, int, bool]] = []

    def recording(what: str, array: Any) -> bytes:
        on_loop = threading.current_thread() is threading.main_thread()
        encoded_on.append((what, array.size, on_loop))
        return tensors.encode_strings(what, array)

    monkeypatch.setattr(text_thread, "encode_strings", recording)
    rows = text_thread.EVENT_LOOP_TEXT_ELEMENTS + 1  # `tagged`: a string a row

    lanes = tuple(
        dataclasses.replace(lane, capacity_rows=2 * rows) if lane.name == "bulk" else lane
        for lane in DEFAULT_LANES
    )
    config = dataclasses.replace(_text_config(text_model), lanes=lanes)

    async def scenario() -> tuple[pb.InferResponse, pb.InferResponse]:
        engine = Engine(str(text_model), device="cpu", estimate=estimate_once)
        async with serving(engine, config) as s:
            small = await s.stub.Infer(_text_request(["cat"], [["1", "2"]]), timeout=60)
            large = await s.stub.Infer(_long_text_request(rows), timeout=60)
            return small, large

    small, large = asyncio.run(scenario())
    assert encoded_on == [("tensor 'tagged'", rows, False)]
    expected = np.array([f"row {row}!" for row in range(rows)], dtype=object)
    assert large.outputs[0] == encode_tensor("tagged", expected)
    assert [output.name for output in large.outputs] == ["tagged", "label", "value"]
    np.testing.assert_array_equal(decode_tensor(large.outputs[2])[:, 0], np.arange(rows))
    assert decode_tensor(small.outputs[0]).tolist() == ["cat!"]


def test_a_decode_the_drain_stops_waiting_for_is_refused_draining(
    text_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its grace over (here a second signal) with a request still being decoded and
    another waiting its turn, the drain refuses both DRAINING, counted, as requests still
    queued are, says so in its drain_incomplete line (its shutdown line: not drained),
    and stops: it had waited out another 10 s for the thread, and gRPC's stop cut the
    call (UNAVAILABLE "Cancelling all calls", no reason)."""
    gate = _DecodeGate(monkeypatch)
    caplog.set_level(logging.INFO)

    async def scenario() -> tuple[list[grpc.aio.AioRpcError], dict[str, int]]:
        engine = RecordingEngine(str(text_model), device="cpu")
        async with serving(engine, _text_config(text_model)) as s:
            gate.hold()
            try:
                calls = [s.stub.Infer(_long_text_request(_LONG_ROWS, "held"), timeout=60)]
                await gate.until_entered()
                calls.append(s.stub.Infer(_long_text_request(_LONG_ROWS, "next"), timeout=60))
                await until(lambda: gate.asked == 2)
                stopping = asyncio.ensure_future(s.server.stop(grace_s=30.0))
                await until(lambda: s.server.state is Lifecycle.DRAINING)
                s.server.end_grace()
                refusals = []
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call
                    refusals.append(refused.value)
                await stopping
            finally:
                gate.release()
            bulk = next(lane for lane in s.server.stats.snapshot().lanes if lane.name == "bulk")
            return refusals, dict(bulk.rejected)

    refusals, rejected = asyncio.run(scenario())
    for refused in refusals:
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert rich_status(refused)[0] == "DRAINING"
        assert "still being decoded" in (refused.details() or "")
    assert rejected == {"DRAINING": 2}
    events = {getattr(record, "event", None): record for record in caplog.records}
    incomplete = events["drain_incomplete"]
    assert getattr(incomplete, "fields", {})["decoding_requests"] == 2
    assert "2 request(s) whose text was still being decoded" in incomplete.getMessage()
    assert getattr(events["shutdown"], "fields", {})["drained"] is False


def test_the_text_of_a_request_reusing_an_id_is_not_decoded(
    text_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long request reusing the id of one the server holds is refused REQUEST_ID_REUSED
    without its text being decoded, on the loop or off it (decoded on the loop, 1 M
    strings held every other call for 0.3 s): it was never going to run."""
    gate = _DecodeGate(monkeypatch)

    async def scenario() -> grpc.aio.AioRpcError:
        engine = RecordingEngine(str(text_model), device="cpu")
        async with serving(engine, _text_config(text_model)) as s:
            await s.stub.Infer(_text_request(["cat"], [["1", "2"]], request_id="r"), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.Infer(_long_text_request(_LONG_ROWS, "r"), timeout=60)
            return refused.value

    refused = asyncio.run(scenario())
    assert rich_status(refused)[0] == "REQUEST_ID_REUSED"
    assert gate.decoded_on == [(1, True)], "only the first request was decoded"


def test_during_a_drain_a_call_let_in_for_a_decode_that_failed_is_new_work_refused(
    text_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call with the id of a request being decoded is let in during the drain, as the
    retry it may be; that request refused (not UTF-8), nothing is left to join, and the
    call is new work: refused DRAINING (it ran)."""
    gate = _DecodeGate(monkeypatch)

    async def scenario() -> tuple[grpc.aio.AioRpcError, grpc.aio.AioRpcError, int]:
        engine = RecordingEngine(str(text_model), device="cpu")
        async with serving(engine, _text_config(text_model)) as s:
            gate.hold()
            try:
                bad = s.stub.Infer(_long_text_request(_LONG_ROWS, "z", bad_row=7), timeout=60)
                await gate.until_entered()
                stopping = asyncio.ensure_future(s.server.stop(grace_s=30.0))
                await until(lambda: s.server.state is Lifecycle.DRAINING)
                other = s.stub.Infer(_text_request(["cat"], [["1", "2"]], "z"), timeout=60)
                await until(lambda: gate.waited == 1)
            finally:
                gate.release()
            refusals = []
            for call in (bad, other):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                refusals.append(refused.value)
            await stopping
            return refusals[0], refusals[1], sum(engine.batches)

    bad, other, rows_run = asyncio.run(scenario())
    assert rich_status(bad)[0] == "INVALID_INPUT"
    assert rich_status(other)[0] == "DRAINING"
    assert rows_run == 0


def test_a_retry_read_before_the_drain_is_run_when_the_call_it_waited_for_left(
    text_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry waiting for its request's decode counts as a read in progress: the drain
    does not stop admitting while it waits, nor while it decodes the request itself once
    the first caller left (cancelled) taking its decode with it. It is run."""
    gate = _DecodeGate(monkeypatch)

    async def scenario() -> tuple[pb.InferResponse, int]:
        engine = RecordingEngine(str(text_model), device="cpu")
        async with serving(engine, _text_config(text_model)) as s:
            gate.hold()
            try:
                first = s.stub.Infer(_long_text_request(_LONG_ROWS, "k"), timeout=60)
                await gate.until_entered()
                retry = asyncio.ensure_future(
                    s.stub.Infer(_long_text_request(_LONG_ROWS, "k"), timeout=60)
                )
                await until(lambda: gate.waited == 1)
                stopping = asyncio.ensure_future(s.server.stop(grace_s=30.0))
                await until(lambda: s.server.state is Lifecycle.DRAINING)
                first.cancel()
                # The retry's own decode, queued behind the first's (held, running on).
                await until(lambda: gate.asked == 2)
            finally:
                gate.release()
            answer = await retry
            await stopping
            return answer, sum(engine.batches)

    answer, rows_run = asyncio.run(scenario())
    assert decode_tensor(answer.outputs[0]).tolist()[-1] == f"row {_LONG_ROWS - 1}!"
    assert rows_run == _LONG_ROWS
    assert gate.decoded_on == [(_LONG_ROWS, False)] * 2


def test_the_text_threads_work_is_scraped_by_kind_from_the_start(text_model: Path) -> None:
    """laneserve_text_thread_work_total{kind} and _busy_seconds_total{kind} (decode and
    encode, each at 0 from the first scrape) and _pending: what an operator reads to tell a
    saturated text thread. A long request counts one decode; a short one none."""

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        engine = Engine(str(text_model), device="cpu", estimate=estimate_once)
        async with serving(engine, _text_config(text_model)) as s:
            before = await asyncio.to_thread(scrape, s.server.metrics_port)
            await s.stub.Infer(_text_request(["cat"], [["1", "2"]]), timeout=60)
            await s.stub.Infer(_long_text_request(_LONG_ROWS), timeout=60)
            after = await asyncio.to_thread(scrape, s.server.metrics_port)
            return before, after

    before, after = asyncio.run(scenario())
    zero = {"decode": 0.0, "encode": 0.0, "hash": 0.0}
    assert values(before, "laneserve_text_thread_work", "kind") == zero
    assert values(before, "laneserve_text_thread_busy_seconds", "kind") == zero
    assert values(after, "laneserve_text_thread_work", "kind") == {**zero, "decode": 1.0}
    busy = values(after, "laneserve_text_thread_busy_seconds", "kind")
    assert busy["decode"] > 0
    assert busy["encode"] == 0.0
    assert only_value(after, "laneserve_text_thread_pending") == 0


@pytest.mark.parametrize(
    ("late_id", "words"),
    [
        (
            "x",
            (
                "sent before this one was still being read (its text decoded, or its data "
                "hashed) at this one's deadline"
            ),
        ),
        ("late", "was still waiting for its text to be decoded"),
    ],
    ids=["waiting-for-its-ids-decode", "queued-behind-another"],
)
def test_a_request_whose_deadline_passes_before_its_text_is_decoded_is_refused_undecoded(
    text_model: Path, monkeypatch: pytest.MonkeyPatch, late_id: str, words: str
) -> None:
    """Long text is decoded on one thread, in turn. A request whose deadline (here its
    timeout_ms, no gRPC deadline) passes while it waits, for the decode of the request
    sent before it with its id or behind another request's decode, is refused
    EXPIRED_IN_QUEUE at it, counted, and never decoded (queued behind another, it was
    decoded in full, then refused DEADLINE_UNMEETABLE: the thread spent its time on
    requests nobody could take)."""
    gate = _DecodeGate(monkeypatch)

    async def scenario() -> tuple[pb.InferResponse, grpc.aio.AioRpcError, pb.GetStatsResponse]:
        engine = RecordingEngine(str(text_model), device="cpu")
        async with serving(engine, _text_config(text_model)) as s:
            gate.hold()
            try:
                first = asyncio.ensure_future(
                    s.stub.Infer(_long_text_request(_LONG_ROWS, "x"), timeout=60)
                )
                await gate.until_entered()
                late = _long_text_request(_LONG_ROWS, late_id)
                late.timeout_ms = 200
                with pytest.raises(grpc.aio.AioRpcError) as expired:
                    await s.stub.Infer(late)
            finally:
                gate.release()
            answer = await first
            stats = await s.stub.GetStats(pb.GetStatsRequest(), timeout=30)
            return answer, expired.value, stats

    first, expired, stats = asyncio.run(scenario())
    assert decode_tensor(first.outputs[0]).tolist()[0] == "row 0!"
    assert rich_status(expired)[0] == "EXPIRED_IN_QUEUE"
    assert words in (expired.details() or "")
    assert gate.decoded_on == [(_LONG_ROWS, False)], "the late request was never decoded"
    bulk = _lane(stats, "bulk")
    assert (bulk.admitted, dict(bulk.rejected)) == (1, {"EXPIRED_IN_QUEUE": 1})


def test_retries_waiting_for_a_decode_are_bounded_as_joins_are(
    text_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At most MAX_CALLERS_WAITING callers wait on one request while its text is decoded,
    as once it runs: a retry past them is refused JOIN_LIMIT at once (any number waited,
    each holding its message, and were refused only once the decode ended). Those that
    waited join it: one run."""
    gate = _DecodeGate(monkeypatch)
    waiting = MAX_CALLERS_WAITING - 1  # beside the request's own caller

    async def scenario() -> tuple[list[pb.InferResponse], grpc.aio.AioRpcError, int]:
        engine = RecordingEngine(str(text_model), device="cpu")
        async with serving(engine, _text_config(text_model)) as s:
            gate.hold()
            try:
                calls = [s.stub.Infer(_long_text_request(_LONG_ROWS, "r"), timeout=60)]
                await gate.until_entered()
                calls += [
                    s.stub.Infer(_long_text_request(_LONG_ROWS, "r"), timeout=60)
                    for _ in range(waiting)
                ]
                await until(lambda: gate.waited == waiting)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await s.stub.Infer(_long_text_request(_LONG_ROWS, "r"), timeout=60)
            finally:
                gate.release()
            answers = list(await asyncio.gather(*calls))
            return answers, refused.value, sum(engine.batches)

    answers, refused, rows_run = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rich_status(refused)[0] == "JOIN_LIMIT"
    assert "is being decoded with 5 callers waiting" in (refused.details() or "")
    assert all(answer.outputs == answers[0].outputs for answer in answers)
    assert rows_run == _LONG_ROWS, "one run"
    assert gate.decoded_on == [(_LONG_ROWS, False)]


def test_a_stream_item_decoded_as_the_drain_begins_is_run(
    text_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream item whose text was being decoded when the drain began is run, as a
    unary call is (the drain waits for it): with room in its lane at once it was refused
    DRAINING, "waited for room in its lane", which it never had."""
    gate = _DecodeGate(monkeypatch)

    async def scenario() -> tuple[list[pb.InferStreamResponse], grpc.StatusCode, int]:
        engine = RecordingEngine(str(text_model), device="cpu")
        async with serving(engine, _text_config(text_model)) as s:
            received: list[pb.InferStreamResponse] = []
            call = s.stub.InferStream(iter([_long_text_request(_LONG_ROWS, "item")]))

            async def read() -> grpc.StatusCode:
                # Each answer kept as it comes: a stream that then ends in error keeps what
                # it answered (a list built in one expression lost it, a CI run).
                with contextlib.suppress(grpc.aio.AioRpcError):
                    async for answer in call:
                        received.append(answer)  # noqa: PERF401 - see above
                return await call.code()

            gate.hold()
            try:
                reading = asyncio.ensure_future(read())
                await gate.until_entered()
                stopping = asyncio.ensure_future(s.server.stop(grace_s=30.0))
                await until(lambda: s.server.state is Lifecycle.DRAINING)
            finally:
                gate.release()
            code = await reading
            await stopping
            return received, code, sum(engine.batches)

    received, code, rows_run = asyncio.run(scenario())
    (answer,) = received
    assert answer.WhichOneof("result") == "response", answer.error.message
    assert decode_tensor(answer.response.outputs[0]).tolist()[0] == "row 0!"
    # OK where the server had read the caller's end of the stream before the drain stopped
    # its reading (it had sent all); else UNAVAILABLE (DRAINING), nothing left to resend:
    # 2 runs in 25, once a CI run.
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
    assert rows_run == _LONG_ROWS
