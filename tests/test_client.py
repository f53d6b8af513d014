"""The typed client against a real server on loopback: dtypes, errors, retries."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import math
import random
import re
import subprocess
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from onnx import helper

from laneserve import client as lc
from laneserve.client import _channel as lc_channel
from laneserve.server import Engine, LaneConfig, ServerConfig, service
from laneserve.server.engine import no_static_estimate
from laneserve.server.lifecycle import Lifecycle
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import (
    RecordingEngine,
    Serving,
    TcpProxy,
    client_cli,
    config,
    estimate_once,
    queued_rows,
    refusing_port,
    rows,
    save_model,
    serving,
)

pytestmark = pytest.mark.usefixtures("no_leaked_threads", "no_backoff_sleeps")

DTYPES = [
    "float32",
    "float16",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
]


@pytest.fixture(scope="module")
def every_dtype_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Identity per supported dtype: in_<dtype> [batch, 3] -> out_<dtype>."""
    inputs, outputs, nodes = [], [], []
    for name in DTYPES:
        element = helper.np_dtype_to_tensor_dtype(np.dtype(name))
        inputs.append(helper.make_tensor_value_info(f"in_{name}", element, ["batch", 3]))
        outputs.append(helper.make_tensor_value_info(f"out_{name}", element, ["batch", 3]))
        nodes.append(helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]))
    graph = helper.make_graph(nodes, "every_dtype", inputs, outputs)
    return save_model(tmp_path_factory.mktemp("models") / "every_dtype.onnx", graph)


def sample(dtype: str, count: int, seed: int) -> npt.NDArray[Any]:
    """Values that exercise each type's range: extremes, negatives, fractions."""
    rng = np.random.default_rng(seed)
    kind = np.dtype(dtype)
    if kind == np.bool_:
        return rng.integers(0, 2, (count, 3)).astype(np.bool_)
    if kind.kind == "f":
        values = rng.standard_normal((count, 3)) * 1000
        values.flat[0] = np.finfo(kind).max
        return values.astype(kind)
    info = np.iinfo(kind)
    values = rng.integers(info.min, info.max, (count, 3), dtype=kind, endpoint=True)
    values.flat[0], values.flat[-1] = info.min, info.max
    return values


# ---- round trips -----------------------------------------------------------------------


def test_every_dtype_round_trips_through_the_sync_client(every_dtype_model: Path) -> None:
    async def scenario() -> None:
        async with serving(
            Engine(str(every_dtype_model), estimate=estimate_once), config(every_dtype_model)
        ) as s:
            inputs = {f"in_{name}": sample(name, 5, seed) for seed, name in enumerate(DTYPES)}

            def call() -> dict[str, npt.NDArray[Any]]:
                with lc.Client(s.target) as client:
                    return client.infer(inputs, timeout=10)

            outputs = await asyncio.to_thread(call)
        assert sorted(outputs) == sorted(f"out_{name}" for name in DTYPES)
        for name in DTYPES:
            got, sent = outputs[f"out_{name}"], inputs[f"in_{name}"]
            assert got.dtype == np.dtype(name), name
            np.testing.assert_array_equal(got, sent, err_msg=name)

    asyncio.run(scenario())


def test_every_dtype_round_trips_through_the_async_client(every_dtype_model: Path) -> None:
    """Concurrent callers with different row counts: batched together, split back."""

    async def scenario() -> None:
        engine = Engine(str(every_dtype_model), estimate=estimate_once)
        server_config = config(every_dtype_model)
        async with client_for(engine, server_config) as (_s, client):
            model = await client.model()
            assert [spec.dtype for spec in model.inputs] == [np.dtype(n) for n in DTYPES]
            requests = [
                {f"in_{name}": sample(name, count, seed) for name in DTYPES}
                for seed, count in enumerate([1, 2, 7, 3])
            ]
            answers = await asyncio.gather(*(client.infer(r) for r in requests))
        for sent, got in zip(requests, answers, strict=True):
            for name in DTYPES:
                np.testing.assert_array_equal(got[f"out_{name}"], sent[f"in_{name}"])
                assert got[f"out_{name}"].dtype == np.dtype(name)

    asyncio.run(scenario())


def test_outputs_equal_session_run_and_are_read_only_views(small_model: Path) -> None:
    reference = ort.InferenceSession(str(small_model), providers=["CPUExecutionProvider"])

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model)
        async with client_for(engine, server_config) as (_s, client):
            x = rows(9, seed=3)
            (name, got), *_ = (await client.infer({"input": x}, lane="interactive")).items()
            assert name == "output"
            np.testing.assert_array_equal(got, reference.run(None, {"input": x})[0])
            assert not got.flags.writeable, "zero-copy: a view of the received bytes"
            selected = await client.infer({"input": x}, outputs=["output"])
            assert list(selected) == ["output"]

    asyncio.run(scenario())


def test_big_endian_and_non_contiguous_inputs_are_accepted(small_model: Path) -> None:
    reference = ort.InferenceSession(str(small_model), providers=["CPUExecutionProvider"])

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model)
        async with client_for(engine, server_config) as (_s, client):
            x = rows(8, seed=4)
            strided = np.asfortranarray(x)[::2]
            swapped = x.astype(">f4")
            got_strided = (await client.infer({"input": strided}))["output"]
            got_swapped = (await client.infer({"input": swapped}))["output"]
        np.testing.assert_array_equal(got_strided, reference.run(None, {"input": x[::2]})[0])
        np.testing.assert_array_equal(got_swapped, reference.run(None, {"input": x})[0])

    asyncio.run(scenario())


# Text in each form numpy holds it, all sent as STRING: str_, object holding str, UTF-8
# bytes_, and StringDType.
TEXT_FORMS: dict[str, Callable[[list[Any]], npt.NDArray[Any]]] = {
    "str_": lambda values: np.array(values, dtype=np.str_),
    "object": lambda values: np.array(values, dtype=object),
    "bytes_": lambda values: np.char.encode(np.array(values, dtype=np.str_), "utf-8"),
    "StringDType": lambda values: np.array(values, dtype=np.dtypes.StringDType()),
}


def test_text_inputs_in_every_numpy_form_are_answered_as_object_arrays_of_str(
    text_model: Path,
) -> None:
    """Each form of text, through `Client.infer`, `AsyncClient.infer` and
    `infer_detailed`: a string output is an object array of Python `str` (non-ASCII
    text whole), beside the model's numeric outputs of their own dtypes."""
    text = ["cat", "zebra", "café", "dog"]
    numbers = [["1", "2.5"], ["-3", "4e2"], ["0", "7"], ["8", "9"]]

    async def scenario() -> list[Mapping[str, npt.NDArray[Any]]]:
        engine = Engine(str(text_model), estimate=estimate_once)
        async with client_for(engine, config(text_model)) as (s, client):
            model = await client.model()
            assert [(spec.name, spec.datatype) for spec in model.outputs] == [
                ("tagged", "string"),
                ("label", "int64"),
                ("value", "float32"),
            ]
            assert model.input("text").dtype == np.dtype(object)
            answers = []
            for form in TEXT_FORMS.values():
                inputs = {"text": form(text), "numbers": form(numbers)}
                answers.append(await client.infer(inputs))
                answers.append((await client.infer_detailed(inputs)).outputs)

            def sync_calls() -> list[Mapping[str, npt.NDArray[Any]]]:
                with lc.Client(s.target) as sync_client:
                    return [
                        sync_client.infer({"text": form(text), "numbers": form(numbers)})
                        for form in TEXT_FORMS.values()
                    ]

            return answers + await asyncio.to_thread(sync_calls)

    answers = asyncio.run(scenario())
    assert len(answers) == 3 * len(TEXT_FORMS)
    for outputs in answers:
        tagged = outputs["tagged"]
        assert tagged.dtype == np.dtype(object)
        assert tagged.tolist() == ["cat!", "zebra!", "café!", "dog!"]
        assert all(type(value) is str for value in tagged)
        np.testing.assert_array_equal(outputs["label"], np.array([0, -1, -1, 1], np.int64))
        np.testing.assert_array_equal(
            outputs["value"], np.array([[1, 2.5], [-3, 400], [0, 7], [8, 9]], np.float32)
        )


def test_text_the_model_cannot_read_fails_its_row_and_bytes_not_utf8_are_never_sent(
    text_model: Path,
) -> None:
    """A number input given text that is no number fails in the model, the row named;
    bytes that are not UTF-8 are refused by the client (attempts 0), naming the element."""

    async def scenario() -> tuple[lc.EngineError, lc.InvalidInputError, int]:
        engine = Engine(str(text_model), estimate=estimate_once)
        async with client_for(engine, config(text_model)) as (s, client):
            with pytest.raises(lc.EngineError) as failed:
                await client.infer(
                    {"text": np.array(["a", "b"]), "numbers": np.array([["1", "2"], ["3", "x"]])}
                )
            with pytest.raises(lc.InvalidInputError) as refused:
                await client.infer(
                    {"text": np.array([b"ok", b"\xff"]), "numbers": np.array([["1", "2"]] * 2)}
                )
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        return failed.value, refused.value, sum(lane.admitted for lane in stats.lanes)

    failed, refused, admitted = asyncio.run(scenario())
    assert failed.reason == "ENGINE_FAILURE"
    assert failed.metadata.get("row") == "1"
    assert refused.attempts == 0
    assert "tensor 'text': element 1 is not UTF-8" in str(refused)
    assert admitted == 1, "the bytes that are not UTF-8 were not sent"


def test_model_and_stats_describe_the_server(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model)
        async with client_for(engine, server_config) as (_s, client):
            model = await client.model()
            assert model.inputs == (lc.TensorInfo("input", np.dtype(np.float32), (None, 512)),)
            assert model.outputs == (lc.TensorInfo("output", np.dtype(np.float32), (None, 10)),)
            assert model.inputs[0].dim_names == ("batch", None)  # not compared: checked here
            assert model.default_lane == "standard"
            assert [lane.name for lane in model.lanes] == ["interactive", "standard", "bulk"]
            assert model.stream_window == 256
            assert model.providers == ("CPUExecutionProvider",)
            await client.infer({"input": rows(3)})
            stats = await client.stats()
            assert stats.rows_run == 3
            assert stats.state == "SERVING"

    asyncio.run(scenario())


def test_model_info_says_which_model_and_server_answer(small_model: Path, tmp_path: Path) -> None:
    """The sync and the async client's ModelInfo carry GetModel's identity of the model:
    the SHA-256 of its file, its own version and metadata, and the server's version."""
    path = tmp_path / "versioned.onnx"
    model = onnx.load(str(small_model))
    model.model_version = 7
    model.domain = "ai.example"
    model.doc_string = "scores rows"
    model.metadata_props.add(key="trained_on", value="2024-06")
    onnx.save(model, str(path))
    expected = {
        "model_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "model_version": 7,
        "producer_name": "laneserve.demo_model",
        "graph_name": "laneserve_demo_mlp",
        "domain": "ai.example",
        "description": "scores rows",
        "custom_metadata": {"trained_on": "2024-06"},
        "server_version": importlib.metadata.version("laneserve"),
    }

    def identity(info: lc.ModelInfo) -> dict[str, object]:
        return {key: getattr(info, key) for key in expected}

    async def scenario() -> None:
        engine = RecordingEngine(str(path), estimate=no_static_estimate)
        async with client_for(engine, config(path)) as (s, client):
            assert identity(await client.model()) == expected
            with lc.Client(s.target) as sync_client:
                sync_model = await asyncio.to_thread(sync_client.model)
            assert identity(sync_model) == expected

    asyncio.run(scenario())


def test_model_info_from_a_server_older_than_the_identity_fields_leaves_them_empty() -> None:
    info = lc.ModelInfo.from_proto(pb.GetModelResponse(model_path="m.onnx"))
    assert (info.model_sha256, info.model_version, info.server_version) == ("", None, "")
    assert info.custom_metadata == {}


def test_metadata_is_sent_with_every_call(small_model: Path) -> None:
    seen: list[tuple[str, tuple[tuple[str, str], ...]]] = []

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            interceptor = Recorder(seen)
            async with lc.AsyncClient(
                s.target, metadata={"X-Team": "search"}, interceptors=[interceptor]
            ) as client:
                await client.infer({"input": rows(1)})
                await client.model()
        assert [method for method, _ in seen] == [
            "/laneserve.v1.InferenceService/Infer",
            "/laneserve.v1.InferenceService/GetModel",
        ]
        assert all(("x-team", "search") in metadata for _, metadata in seen)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"x-bin": "abc"}, "metadata key 'x-bin' ends in '-bin', gRPC's mark of a binary"),
        ({"a b": "1"}, "metadata key 'a b': expected one or more ASCII letters, digits"),
        ({"k": "\u00e9"}, "metadata key 'k': value '\u00e9' is not printable ASCII"),
    ],
    ids=["binary key", "key with a space", "non-ASCII value"],
)
def test_metadata_grpc_would_refuse_is_a_value_error_naming_the_key(
    small_model: Path, metadata: dict[str, str], message: str
) -> None:
    """gRPC itself fails every call with it, with a TypeError or an internal error that
    names neither the key nor the rule."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            with pytest.raises(ValueError, match=re.escape(message)):
                lc.AsyncClient(s.target, metadata=metadata)
            with pytest.raises(ValueError, match=re.escape(message)):
                await asyncio.to_thread(lc.Client, s.target, metadata=metadata)

    asyncio.run(scenario())


@pytest.mark.parametrize("limit", [0, -1, 1023, np.int64(1023)])
def test_a_message_limit_that_is_not_a_byte_count_of_1024_or_more_is_refused(limit: Any) -> None:
    """-1 (gRPC's "no limit") and 0 were taken: unary calls ran, and every stream item was
    refused as "over the largest message this client and server exchange (-1 bytes)".
    Under 1024 (the server's minimum), a bulk job's call was refused for metadata the
    caller never set."""
    message = (
        "max_message_bytes: expected a whole number of bytes from 1024 to 2147483647 "
        f"(2**31 - 1, the largest limit gRPC takes), got {limit}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        lc.AsyncClient("127.0.0.1:1", max_message_bytes=limit)
    with pytest.raises(ValueError, match=re.escape(message)):
        lc.Client("127.0.0.1:1", max_message_bytes=limit)


def test_an_answer_over_the_clients_own_limit_says_so_and_that_the_request_ran(
    small_model: Path,
) -> None:
    """An answer of 200 rows (8 000 bytes) to a client that receives at most 1 024: gRPC's
    bare "CLIENT: Received message larger than max (8035 vs. 1024)" came back as a
    ResourceExhaustedError with no reason, naming no limit of the caller's and saying
    nothing of the request, which had run. It is an AnswerTooLargeError saying both."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            options = [("grpc.max_send_message_length", 1_000_000)]  # the request goes
            async with lc.AsyncClient(s.target, max_message_bytes=1024, options=options) as c:
                with pytest.raises(lc.AnswerTooLargeError) as refused:
                    await c.infer({"input": rows(200)})
        error = refused.value
        assert (error.code, error.reason, error.retryable) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "",
            False,
        )
        assert "is over this client's receive limit (1024 bytes" in error.message
        assert "the request ran" in error.message

    asyncio.run(scenario())


@pytest.mark.parametrize("limit", [2**31, np.int64(2**40)])
def test_a_message_limit_over_grpcs_range_is_refused_naming_max_message_bytes(
    limit: Any,
) -> None:
    """gRPC's limits are C ints: max_message_bytes=2**31 was refused by the option check
    as "'grpc.max_receive_message_length': 2147483648 is out of gRPC's range", naming an
    option the caller never gave. The largest gRPC takes is taken."""
    message = (
        "max_message_bytes: expected a whole number of bytes from 1024 to 2147483647 "
        f"(2**31 - 1, the largest limit gRPC takes), got {limit}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        lc.AsyncClient("127.0.0.1:1", max_message_bytes=limit)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        lc.Client("127.0.0.1:1", max_message_bytes=limit)
    with lc.Client("127.0.0.1:1", max_message_bytes=2**31 - 1):
        pass


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_attempts": "3"}, "max_attempts: expected an integer, got '3'"),
        ({"max_attempts": True}, "max_attempts: expected an integer, got True"),
        ({"max_attempts": 3.0}, "max_attempts: expected an integer, got 3.0"),
        ({"jitter": "0.5"}, "jitter: expected a number, got '0.5'"),
        ({"multiplier": True}, "multiplier: expected a number, got True"),
        (
            {"max_message_bytes": "67108864"},
            "max_message_bytes: expected an integer, got '67108864'",
        ),
        ({"max_message_bytes": 1.5}, "max_message_bytes: expected an integer, got 1.5"),
        ({"max_message_bytes": True}, "max_message_bytes: expected an integer, got True"),
        ({"max_message_bytes": np.True_}, "max_message_bytes: expected an integer, got np.True_"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else "",
)
def test_a_number_argument_of_another_type_is_a_type_error_naming_it(
    arguments: dict[str, Any], message: str
) -> None:
    """One rule for the client's integer arguments: a bool or a non-integer is a
    TypeError naming the argument (max_message_bytes='67108864' was a ValueError, and a
    RetryPolicy float a TypeError from math.isfinite naming no field)."""
    make: Callable[..., object] = (
        functools.partial(lc.Client, "127.0.0.1:1")
        if "max_message_bytes" in arguments
        else lc.RetryPolicy
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        make(**arguments)


def test_integer_arguments_may_be_numpy_integers_and_bool_arguments_numpy_bools() -> None:
    """StreamOptions took np.int64; RetryPolicy(max_attempts=np.int64(3)) was a TypeError,
    max_message_bytes=np.int64(1 << 26) a ValueError saying it was no whole number of
    bytes, and tls=np.True_ a TypeError "expected True ...; got bool (np.True_)". Each is
    stored as Python's int, float or the TLS it says (nothing is sent)."""
    attempts: Any = np.int64(3)
    backoff: Any = np.float32(0.5)
    policy = lc.RetryPolicy(max_attempts=attempts, initial_backoff_s=backoff)
    assert (policy.max_attempts, policy.initial_backoff_s) == (3, 0.5)
    assert (type(policy.max_attempts), type(policy.initial_backoff_s)) == (int, float)
    limit: Any = np.int64(1 << 26)
    with lc.Client("127.0.0.1:1", max_message_bytes=limit, retry=policy):
        pass
    for tls in (np.True_, np.False_):
        with lc.Client("127.0.0.1:1", tls=tls):  # type: ignore[arg-type]
            pass

    async def scenario() -> None:
        async with lc.AsyncClient("127.0.0.1:1", max_message_bytes=limit) as client:
            assert type(client._max_message_bytes) is int  # sent as metadata by a bulk job

    asyncio.run(scenario())


# ---- errors from a real server ---------------------------------------------------------


def test_invalid_input_is_invalid_input_error_and_not_retried(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model)
        async with client_for(engine, server_config) as (_s, client):
            with pytest.raises(lc.InvalidInputError) as caught:
                await client.infer({"input": rows(2).astype(np.float64)})
        error = caught.value
        assert error.reason == "INVALID_INPUT"
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "dtype float64; expected float32" in error.message
        assert error.attempts == 1
        assert isinstance(error, ValueError)

    asyncio.run(scenario())


def test_unsupported_dtype_is_refused_before_sending() -> None:
    """Refused by the client, never sent: its attempts are 0 (they said 1, as if a
    server had answered it)."""

    async def scenario() -> None:
        async with lc.AsyncClient("127.0.0.1:1") as client:  # nothing listens there
            with pytest.raises(
                lc.InvalidInputError, match="'input': numpy dtype complex64"
            ) as refused:
                await client.infer({"input": np.zeros((1, 2), np.complex64)})
            assert refused.value.attempts == 0
            with pytest.raises(lc.InvalidInputError, match="request_id") as refused:
                await client.infer({"input": np.zeros((1, 2), np.float32)}, request_id="\ud800")
            assert refused.value.attempts == 0
            with pytest.raises(TypeError, match="'input': expected a numpy array, got list"):
                await client.infer({"input": [[1.0]]})  # type: ignore[dict-item]

    asyncio.run(scenario())


def test_a_masked_array_is_refused_before_sending() -> None:
    """A masked array is an ndarray whose buffer holds the masked values: sent, the model
    read them (-999 for a masked 2.0), the mask dropped without a word."""
    masked = np.ma.masked_array(np.array([[1.0, -999.0, 3.0]], np.float32), [[False, True, False]])

    async def scenario() -> None:
        async with lc.AsyncClient("127.0.0.1:1") as client:  # nothing listens there
            with pytest.raises(TypeError, match=r"'input': .*masked array.*array\.filled"):
                await client.infer({"input": masked})
            # A stream's item so is that item's refusal, never sent; the job goes on.
            (result,) = [result async for result in client.stream([{"input": masked}])]
            assert isinstance(result.error, lc.InvalidInputError)
            assert re.search(r"bulk stream item 0: .*'input': .*masked array", result.error.message)
            assert result.attempts == 0

    asyncio.run(scenario())


def test_full_lane_is_lane_full_error_with_the_server_retry_delay(small_model: Path) -> None:
    lanes = (
        LaneConfig("standard", capacity_rows=4, timeout_ms=60_000, max_wait_ms=0, min_share=0),
    )

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, lanes=lanes)
        async with client_for(engine, server_config, retry=lc.NO_RETRIES) as (s, client):
            async with one_running(engine, client):
                queued = asyncio.ensure_future(client.infer({"input": rows(4)}))
                await until(lambda: queued_rows(s) == 4)
                with pytest.raises(lc.LaneFullError) as caught:
                    await client.infer({"input": rows(1)}, request_id="full-1")
            await queued
        error = caught.value
        assert error.reason == "LANE_FULL"
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.retryable
        assert error.retry_after_s is not None
        assert error.retry_after_s > 0
        assert error.request_id == "full-1"
        assert "lane 'standard' is full" in error.message

    asyncio.run(scenario())


def test_unmeetable_deadline_is_deadline_unmeetable_error(demo_model: Path) -> None:
    """One row at a time of the demo model (milliseconds each): 2000 rows queued ahead
    cannot be served within half a second, so the server refuses at once."""

    async def scenario() -> None:
        engine = RecordingEngine(str(demo_model))
        async with (
            client_for(engine, config(demo_model, max_batch_size=1)) as (s, client),
            one_running(engine, client),
        ):
            ahead = asyncio.ensure_future(client.infer({"input": rows(2000)}))
            await until(lambda: queued_rows(s) == 2000)
            with pytest.raises(lc.DeadlineUnmeetableError) as caught:
                await client.infer({"input": rows(1)}, timeout=0.5)
            ahead.cancel()
            await until(lambda: queued_rows(s) == 0)
        assert caught.value.reason == "DEADLINE_UNMEETABLE"
        assert isinstance(caught.value, lc.DeadlineExceededError)
        assert not caught.value.retryable

    asyncio.run(scenario())


def test_expiry_in_the_queue_is_expired_in_queue_error(small_model: Path) -> None:
    lanes = one_lane(capacity_rows=64, timeout_ms=50)

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        # The running one is past its deadline too, but running: it finishes.
        async with (
            client_for(engine, config(small_model, lanes=lanes)) as (_s, client),
            one_running(engine, client),
        ):
            with pytest.raises(lc.ExpiredInQueueError) as caught:
                await client.infer({"input": rows(1)})
        assert caught.value.reason == "EXPIRED_IN_QUEUE"
        assert isinstance(caught.value, lc.DeadlineExceededError)

    asyncio.run(scenario())


def test_caller_deadline_is_deadline_exceeded_error(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with (
            client_for(engine, config(small_model)) as (_s, client),
            one_running(engine, client),
        ):
            with pytest.raises(lc.DeadlineExceededError) as caught:
                await client.infer({"input": rows(1)}, timeout=0.1)
        # The server answers EXPIRED_IN_QUEUE at the same deadline: either may come first.
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(scenario())


def test_the_callers_own_timeout_names_itself_and_the_attempts_made(small_model: Path) -> None:
    """The request is in the session when the call's timeout passes: gRPC's own bare
    "Deadline Exceeded" said neither which timeout nor after how many attempts."""

    async def scenario() -> lc.DeadlineExceededError:
        engine = RecordingEngine(str(small_model))
        async with client_for(engine, config(small_model)) as (_s, client):
            engine.hold()  # the server cannot answer before the caller's deadline
            call = asyncio.ensure_future(
                client.infer({"input": rows(1)}, timeout=0.5, request_id="held")
            )
            assert await asyncio.to_thread(engine.entered.acquire, timeout=10.0)
            with pytest.raises(lc.DeadlineExceededError) as caught:
                await call
            engine.release()
        return caught.value

    error = asyncio.run(scenario())
    assert type(error) is lc.DeadlineExceededError
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.attempts == 1
    assert error.message.startswith(
        "Infer 'held': the call's timeout of 0.5 s passed after 1 attempt(s); expected"
    ), error.message


def test_draining_server_is_server_draining_error(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with client_for(engine, config(small_model), retry=lc.NO_RETRIES) as (s, client):
            async with one_running(engine, client):
                stopping = asyncio.ensure_future(s.server.stop(grace_s=30))
                await until(lambda: s.server.state is Lifecycle.DRAINING)
                with pytest.raises(lc.ServerDrainingError) as caught:
                    await client.infer({"input": rows(1)})
            await stopping
        assert caught.value.reason == "DRAINING"
        assert caught.value.retryable
        assert isinstance(caught.value, lc.UnavailableError)

    asyncio.run(scenario())


def test_grpcs_own_call_limit_is_a_retryable_server_busy_error(small_model: Path) -> None:
    """gRPC refuses calls over the server's max_concurrent_rpcs with a bare
    RESOURCE_EXHAUSTED, like its message size limit: it was not retried, though the call
    never ran."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_concurrent_rpcs=1)
        async with (
            client_for(engine, server_config, retry=lc.NO_RETRIES) as (_s, client),
            one_running(engine, client),
        ):
            with pytest.raises(lc.ServerBusyError) as caught:
                await client.infer({"input": rows(1)})
        assert caught.value.retryable
        assert isinstance(caught.value, lc.ResourceExhaustedError)
        assert "max_concurrent_rpcs" in caught.value.message

    asyncio.run(scenario())


def test_a_stream_over_the_servers_stream_bound_is_a_retryable_server_busy_error(
    small_model: Path,
) -> None:
    """A port takes InferStream calls up to half of max_concurrent_rpcs; the one over it
    never ran, as a call over gRPC's own limit: retryable, not the end of the job."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_concurrent_rpcs=2)  # one stream
        async with client_for(engine, server_config, retry=lc.NO_RETRIES) as (s, client):
            stop = asyncio.Event()

            async def idle() -> AsyncIterator[pb.InferRequest]:
                await stop.wait()
                yield pb.InferRequest()  # never: the stream is cancelled first

            held = s.stub.InferStream(idle())
            await until(lambda: s.server._listeners[0].acceptors._gate.stream_calls == 1)
            with pytest.raises(lc.ServerBusyError) as caught:
                async for _result in client.stream([{"input": rows(1)}]):
                    pass
            held.cancel()
        assert caught.value.retryable
        assert caught.value.message == (
            "the server refused the call at once: as many calls were in progress as its "
            "bound admits (1 stream calls (InferStream and ModelStreamInfer) at once, half of "
            "server setting max_concurrent_rpcs 2; unary calls keep the rest); the call never "
            "ran; retryable"
        )

    asyncio.run(scenario())


def test_an_operator_call_over_its_bound_is_a_server_busy_error_naming_that_bound(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GetModel and GetStats have a bound of their own (64 at once per port), which the
    refusal's trailer names: the client said max_concurrent_rpcs was full, and "retryable
    with the same request_id", which a GetStats call does not have."""
    release = asyncio.Event()
    get_stats = service.InferenceServicer.GetStats

    async def held(self: service.InferenceServicer, request: Any, context: Any) -> Any:
        await release.wait()  # fault injection: an operator call that awaits
        return await get_stats(self, request, context)

    monkeypatch.setattr(service.InferenceServicer, "GetStats", held)

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with client_for(engine, config(small_model), retry=lc.NO_RETRIES) as (s, client):
            gate = s.server._listeners[0].acceptors._gate
            stub = pb_grpc.InferenceServiceStub(s.channel)
            calls = [
                asyncio.ensure_future(stub.GetStats(pb.GetStatsRequest(), timeout=30))
                for _ in range(gate.operator_limit)
            ]
            await until(lambda: gate.operator_calls == gate.operator_limit)
            try:
                with pytest.raises(lc.ServerBusyError) as caught:
                    await client.stats()
            finally:
                release.set()
                await asyncio.gather(*calls)
        assert caught.value.retryable
        assert caught.value.message == (
            "the server refused the call at once: as many calls were in progress as its "
            "bound admits (64 GetModel and GetStats calls at once, counted apart from the "
            "inference calls (server setting max_concurrent_rpcs 4096)); the call never ran; "
            "retryable"
        )

    asyncio.run(scenario())


def test_model_failure_is_engine_error(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        engine.fail_when = lambda _batch: True
        async with client_for(engine, config(small_model)) as (_s, client):
            with pytest.raises(lc.EngineError) as caught:
                await client.infer({"input": rows(1)})
        assert caught.value.reason == "ENGINE_FAILURE"
        assert caught.value.attempts == 1, "not retryable"

    asyncio.run(scenario())


def test_message_over_the_limit_is_resource_exhausted_and_not_retried(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, max_message_bytes=64 * 1024)
        async with client_for(engine, server_config) as (_s, client):
            with pytest.raises(lc.ResourceExhaustedError) as caught:
                await client.infer({"input": rows(64)})
        assert type(caught.value) is lc.ResourceExhaustedError
        assert caught.value.reason == ""
        assert caught.value.attempts == 1

    asyncio.run(scenario())


def test_reused_request_id_with_other_inputs_is_refused(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model)
        async with client_for(engine, server_config) as (_s, client):
            await client.infer({"input": rows(2, seed=1)}, request_id="same")
            with pytest.raises(lc.RequestIdReusedError) as caught:
                await client.infer({"input": rows(2, seed=2)}, request_id="same")
        assert caught.value.reason == "REQUEST_ID_REUSED"
        assert "request_id 'same' was already used" in caught.value.message
        assert isinstance(caught.value, lc.InvalidInputError)

    asyncio.run(scenario())


def test_no_server_is_unavailable_error_after_the_capped_attempts() -> None:
    async def scenario() -> None:
        policy = lc.RetryPolicy(max_attempts=3)
        async with lc.AsyncClient(f"127.0.0.1:{refusing_port()}", retry=policy) as client:
            with pytest.raises(lc.UnavailableError) as caught:
                await client.infer({"input": rows(1)})
            with pytest.raises(lc.UnavailableError):
                await client.model()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        assert caught.value.reason == ""
        assert caught.value.attempts == 3
        assert "gave up after 3 attempt(s)" in "".join(caught.value.__notes__)

    asyncio.run(scenario())


def test_an_infinite_timeout_is_none_and_a_longer_one_than_a_lane_can_have_is_refused(
    small_model: Path,
) -> None:
    """timeout=inf is no deadline, and the longest timeout is accepted. (gRPC failed the
    call at once with DEADLINE_EXCEEDED for inf, as for any timeout past ~7e9 s.) A
    finite timeout over the longest is a ValueError naming it; one that is not a number
    a TypeError naming `timeout`."""
    x = {"input": rows(1)}

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with client_for(engine, config(small_model)) as (_s, client):
            assert (await client.infer(x, timeout=math.inf))["output"].shape == (1, 10)
            assert (await client.infer(x, timeout=(2**32 - 1) / 1000))["output"].shape == (1, 10)
            await client.model(timeout=math.inf)
            await client.stats(timeout=math.inf)
            for timeout in (1e10, (2**32 - 1) / 1000 + 0.001, math.nan):
                with pytest.raises(
                    ValueError,
                    match=re.escape(
                        "timeout: expected seconds <= 4294967.295 (2**32 - 1 ms), or None or "
                        f"inf for none; got {timeout!r}"
                    ),
                ):
                    await client.infer(x, timeout=timeout)
            # 0 or less: a deadline passed already (what is left of a service's own): the
            # call's DeadlineExceededError, nothing sent (a ValueError mapped to a 500).
            for passed in (0.0, -0.003):
                with pytest.raises(lc.DeadlineExceededError, match="0 or less, had passed"):
                    await client.infer(x, timeout=passed)
                with pytest.raises(lc.DeadlineExceededError) as caught:
                    await client.stats(timeout=passed)
                assert caught.value.attempts == 0
            # A closed client says so whatever its timeout (ClientClosedError, as README).
            await client.close()
            with pytest.raises(lc.ClientClosedError):
                await client.stats(timeout=0)
            for wrong in ("1", True):
                expected = (
                    f"timeout: expected seconds (a number) or None, got {type(wrong).__name__}"
                )
                with pytest.raises(TypeError, match=re.escape(expected)):
                    await client.infer(x, timeout=wrong)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_a_clients_timeout_is_every_unary_calls_unless_the_call_gives_its_own() -> None:
    """`timeout=` on the client: the gRPC deadline of each infer, model and stats call
    made without one (the server sees it), on either client; a call's own wins
    (``math.inf``: none). Not a stream's: its items keep their own timeout_ms (0 here),
    and its call has no deadline."""
    seen: list[tuple[str, float | None]] = []

    async def infer(request: pb.InferRequest, context: AioContext) -> pb.InferResponse:
        seen.append(("Infer", context.time_remaining()))
        return pb.InferResponse(request_id=request.request_id)

    async def get_model(_request: pb.GetModelRequest, context: AioContext) -> pb.GetModelResponse:
        seen.append(("GetModel", context.time_remaining()))
        return pb.GetModelResponse()

    async def get_stats(_request: pb.GetStatsRequest, context: AioContext) -> pb.GetStatsResponse:
        seen.append(("GetStats", context.time_remaining()))
        return pb.GetStatsResponse()

    async def infer_stream(
        requests: AsyncIterator[pb.InferRequest], context: AioContext
    ) -> AsyncIterator[pb.InferStreamResponse]:
        seen.append(("InferStream", context.time_remaining()))
        async for request in requests:
            seen.append(("item timeout_ms", request.timeout_ms))
            answer = pb.InferResponse(request_id=request.request_id)
            yield pb.InferStreamResponse(request_id=request.request_id, response=answer)

    x = {"input": rows(1)}

    def sync_calls(target: str) -> None:
        with lc.Client(target, timeout=30) as client:
            assert client.timeout == 30
            client.infer(x)
            client.model()
            client.infer(x, timeout=5)

    async def scenario() -> None:
        handlers = {
            "Infer": unary(infer, pb.InferRequest),
            "GetModel": unary(get_model, pb.GetModelRequest),
            "GetStats": unary(get_stats, pb.GetStatsRequest),
            "InferStream": bidirectional(infer_stream),
        }
        async with fake_server(handlers) as target:
            async with lc.AsyncClient(target, timeout=30) as client:
                await client.infer(x)
                await client.infer_detailed(x)
                await client.model()
                await client.stats()
                await client.infer(x, timeout=5)
                await client.stats(timeout=math.inf)
                expected: list[tuple[str, float | None]] = [
                    *[("Infer", 30), ("Infer", 30), ("GetModel", 30), ("GetStats", 30)],
                    *[("Infer", 5), ("GetStats", None)],
                ]
                assert_deadlines(seen, expected)
                seen.clear()
                assert [result.ok for result in await all_of(client.stream([x]))] == [True]
                # The job's GetModel (its lane's limits) has a deadline of its own, 10 s.
                assert_deadlines(seen[:1], [("GetModel", 10)])
                assert seen[1:] == [("InferStream", None), ("item timeout_ms", 0)]
                seen.clear()
            await asyncio.to_thread(sync_calls, target)
            assert_deadlines(seen, [("Infer", 30), ("GetModel", 30), ("Infer", 5)])

    asyncio.run(scenario())


def assert_deadlines(
    seen: list[tuple[str, float | None]], expected: list[tuple[str, float | None]]
) -> None:
    """`seen` (method, the seconds its server had left) is `expected` (method, the
    timeout it was sent with; None for none): each within the time the call took."""
    assert [method for method, _ in seen] == [method for method, _ in expected]
    for (method, left_s), (_, timeout_s) in zip(seen, expected, strict=True):
        if timeout_s is None:
            assert left_s is None, method
        else:
            assert left_s is not None, method
            assert timeout_s - 5 < left_s <= timeout_s + 0.5, (method, left_s)


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        ("1", TypeError, "timeout: expected seconds (a number) or None, got str"),
        (True, TypeError, "timeout: expected seconds (a number) or None, got bool"),
        (0, ValueError, "timeout: expected the seconds of a call made without one, > 0"),
        (-1.5, ValueError, "timeout: expected the seconds of a call made without one, > 0"),
        (math.nan, ValueError, "timeout: expected seconds <= 4294967.295 (2**32 - 1 ms)"),
        (1e10, ValueError, "timeout: expected seconds <= 4294967.295 (2**32 - 1 ms)"),
    ],
)
def test_a_clients_timeout_that_no_call_could_keep_is_refused_naming_it(
    timeout: Any, error: type[Exception], message: str
) -> None:
    """Checked when the client is made: a client-wide 0 failed every call, each its own
    DeadlineExceededError, nothing sent."""
    target = f"127.0.0.1:{refusing_port()}"
    with pytest.raises(error, match=re.escape(message)):
        lc.AsyncClient(target, timeout=timeout)
    with pytest.raises(error, match=re.escape(message)):
        lc.Client(target, timeout=timeout)
    assert lc.AsyncClient(target, timeout=math.inf).timeout is None
    assert lc.AsyncClient(target, timeout=np.float64(2.5)).timeout == 2.5


def test_a_stream_that_gives_up_says_how_much_of_its_source_it_read() -> None:
    """Nothing listens: the job gives up having read a few of its 1000 items. Its note
    says they were read and that the source was not read further (it said "1 item(s)
    unanswered", of a job of 1000)."""

    async def scenario() -> lc.UnavailableError:
        policy = lc.RetryPolicy(max_attempts=2)
        items = ({"input": rows(1)} for _ in range(1000))
        async with lc.AsyncClient(f"127.0.0.1:{refusing_port()}", retry=policy) as client:
            with pytest.raises(lc.UnavailableError) as caught:
                async for _ in client.stream(items, window=4):
                    pass
        return caught.value

    error = asyncio.run(scenario())
    note = error.__notes__[0]
    read = re.search(
        r"gave up after 2 broken call\(s\) in a row with no answer; (\d+) item\(s\) read "
        r"and unanswered; the source was not read further$",
        note,
    )
    assert read, note
    assert 1 <= int(read.group(1)) <= 4, "at most the window"


def test_items_refused_before_sending_are_no_progress_of_a_broken_call() -> None:
    """Nothing listens; the first 49 items are refused by the client itself (an input no
    tensor encodes), then one it sends. Answered without the server, the refusals
    counted as the first broken call's progress and reset the count of broken calls in
    a row: the job opened 3 calls where its policy allows 2 in a row with no answer."""

    class CountCalls(grpc.aio.StreamStreamClientInterceptor):
        calls = 0

        async def intercept_stream_stream(
            self, continuation: Any, details: Any, request_iterator: Any
        ) -> Any:
            CountCalls.calls += 1
            return await continuation(details, request_iterator)

    def items() -> Iterator[dict[str, Any]]:
        for index in range(2_000):
            if index % 50 == 49:
                yield {"input": rows(1)}
            else:
                yield {"input": np.array([[object()]])}  # refused: answered, never sent

    async def scenario() -> None:
        policy = lc.RetryPolicy(max_attempts=2)
        target = f"127.0.0.1:{refusing_port()}"
        async with lc.AsyncClient(target, retry=policy, interceptors=[CountCalls()]) as client:
            with pytest.raises(lc.UnavailableError):
                async for _ in client.stream(items(), window=4):
                    pass

    asyncio.run(scenario())
    assert CountCalls.calls == 2


# ---- what the client refuses before sending, and the limits it asks for -------------------

# A message limit under 64 rows of the small model's input (~131 KB), over 8 rows.
SMALLER_LIMIT = 100_000


def test_a_job_takes_the_message_limit_of_the_server_it_starts_on(small_model: Path) -> None:
    """The server is restarted at the same address with a smaller message limit: the next
    job of a client that ran one on the old server answers its one item over the new
    limit alone. (The client kept the old server's GetModel answer for its lifetime: it
    sent that item, gRPC ended the whole call on it, and the job failed, every item
    unanswered.)"""
    items = [{"input": rows(count)} for count in (8, 64, 8)]

    async def scenario() -> list[lc.StreamResult]:
        async with (
            an_address_restarted_smaller(small_model) as (restart, target),
            lc.AsyncClient(target) as client,
        ):
            assert [result.ok async for result in client.stream(items)] == [True] * 3
            restart()
            return [result async for result in client.stream(items)]

    results = asyncio.run(scenario())
    assert [result.ok for result in results] == [True, False, True]
    assert isinstance(results[1].error, lc.ResourceExhaustedError)
    assert f"({SMALLER_LIMIT} bytes, max_message_bytes)" in results[1].error.message


def test_a_resumed_job_takes_the_message_limit_of_the_server_it_resumes_on(
    small_model: Path,
) -> None:
    """The connection drops after the first answer, and the address now leads to a
    server with a smaller message limit: the job's next call answers the one item over
    it alone. (The job asked for the limits once, at its start: its next call sent the
    item, gRPC ended that call on it, and the job failed.)"""
    go = asyncio.Event()

    async def items() -> AsyncIterator[dict[str, npt.NDArray[Any]]]:
        yield {"input": rows(8)}
        await go.wait()  # the rest once the address leads to the other server
        for count in (64, 8):
            yield {"input": rows(count)}

    async def scenario() -> list[lc.StreamResult]:
        async with (
            an_address_restarted_smaller(small_model) as (restart, target),
            lc.AsyncClient(target) as client,
        ):
            results = []
            async for result in client.stream(items()):
                results.append(result)
                if len(results) == 1:
                    restart()
                    go.set()
            return results

    results = asyncio.run(scenario())
    assert [result.ok for result in results] == [True, False, True]
    assert isinstance(results[1].error, lc.ResourceExhaustedError)
    assert f"({SMALLER_LIMIT} bytes, max_message_bytes)" in results[1].error.message


def test_a_job_learns_a_smaller_server_limit_from_the_call_it_ended(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limits asked before a call went unanswered (the connection to a server just
    restarted with a smaller max_message_bytes was not up yet), so an item over the new
    limit went out: gRPC's core on the server ended the whole call on it
    (RESOURCE_EXHAUSTED "Received message larger than max (131130 vs. 100000)"), and the
    job failed for good, its other items unanswered (seen once on Python 3.12 under load).
    The job takes the server's limit from those words: the next call answers that item
    alone and the others OK."""

    async def unanswered(_self: lc.AsyncClient, _lane: str, _policy: Any) -> None:
        return None  # the ask before each call goes unanswered

    monkeypatch.setattr(lc.AsyncClient, "_stream_limits", unanswered)

    async def scenario() -> list[lc.StreamResult]:
        engine = RecordingEngine(str(small_model))
        async with (
            serving(engine, config(small_model, max_message_bytes=SMALLER_LIMIT)) as s,
            lc.AsyncClient(s.target) as client,
        ):
            items = [{"input": rows(count)} for count in (8, 64, 8)]
            return await all_of(client.stream(items, window=1))

    results = asyncio.run(scenario())
    assert [result.ok for result in results] == [True, False, True]
    assert isinstance(results[1].error, lc.ResourceExhaustedError)
    assert f"({SMALLER_LIMIT} bytes, max_message_bytes)" in results[1].error.message


def test_a_stream_holds_items_to_the_callers_send_option_as_infer_does(
    small_model: Path,
) -> None:
    """A caller's grpc.max_send_message_length under max_message_bytes: infer() refuses
    a request over it before sending; a stream sent the item, gRPC's own check ended the
    whole call on it ("CLIENT: Sent message larger than max"), every other item
    unanswered. The item over it is answered alone, naming the option."""
    limit = 64 * 1024  # 8 rows of 512 float32 fit, 64 do not

    async def scenario() -> list[lc.StreamResult]:
        async with (
            serving(RecordingEngine(str(small_model)), config(small_model)) as s,
            lc.AsyncClient(s.target, options=[("grpc.max_send_message_length", limit)]) as client,
        ):
            items = [{"input": rows(count)} for count in (8, 64, 8)]
            return await all_of(client.stream(items, window=1))

    results = asyncio.run(scenario())
    assert [result.ok for result in results] == [True, False, True]
    assert isinstance(results[1].error, lc.ResourceExhaustedError)
    assert f"({limit} bytes, the option 'grpc.max_send_message_length')" in (
        results[1].error.message
    )


def test_an_answer_over_the_clients_own_receive_option_is_not_taken_for_a_server_limit(
    small_model: Path,
) -> None:
    """gRPC's words for an answer over this client's grpc.max_receive_message_length
    ("CLIENT: Received message larger than max (2671 vs. 1024)") were read as a server's
    smaller limit: the job resent the item as many calls as its policy allowed and blamed
    a server restart. They end the job at once, an AnswerTooLargeError naming this
    client's own limit (gRPC's words quoted)."""

    async def scenario() -> lc.LaneserveError:
        async with (
            serving(RecordingEngine(str(small_model)), config(small_model)) as s,
            lc.AsyncClient(
                s.target,
                options=[("grpc.max_receive_message_length", 1024)],
                retry=lc.RetryPolicy(max_attempts=3),
            ) as client,
        ):
            with pytest.raises(lc.LaneserveError) as failed:
                await all_of(client.stream([{"input": rows(64)}], window=1))
            return failed.value

    error = asyncio.run(scenario())
    assert type(error) is lc.AnswerTooLargeError, repr(error)
    assert "is over this client's receive limit (1024 bytes" in error.message
    assert "CLIENT: Received message larger than max" in error.message
    assert not error.should_retry
    assert "failed for good" in " ".join(getattr(error, "__notes__", []))


# A stream item's budget in the tests of it: long enough that an answer could come within
# it, short enough to wait out; the tests hold the engine, so none does.
ITEM_BUDGET_MS = 300


def test_a_stream_item_unanswered_past_its_timeout_ms_is_answered_deadline_exceeded(
    small_model: Path,
) -> None:
    """The server reads one item at a time (stream_window=1) and its engine is held: the
    items written after the first wait unread in gRPC's flow control, and the server
    would give each its timeout_ms afresh once it read it. Each is answered
    DeadlineExceededError once its timeout_ms from its first send has passed, and the job
    ends without waiting for the server. (Nothing answered an item in flight: every item
    came back OK long after its budget, once the engine was released.)"""
    engine = RecordingEngine(str(small_model))

    async def scenario() -> list[lc.StreamResult]:
        async with (
            serving(engine, config(small_model, stream_window=1)) as s,
            lc.AsyncClient(s.target) as client,
        ):
            engine.hold_next()
            items = [{"input": rows(1, start=index)} for index in range(4)]
            job = client.stream(items, timeout_ms=ITEM_BUDGET_MS, window=16)
            async with contextlib.aclosing(job):
                # The engine is never released: the job cannot wait for the server.
                results = await asyncio.wait_for(all_of(job), 30)
            assert engine.ran_tags == []  # every answer came from this side
            return results

    results = asyncio.run(scenario())
    assert [result.index for result in results] == [0, 1, 2, 3]
    for result in results:
        assert isinstance(result.error, lc.DeadlineExceededError), result.error
        assert result.error.attempts == 1
        assert (
            f"no answer within its timeout_ms ({ITEM_BUDGET_MS} ms from its first send;"
            in result.error.message
        )


def test_a_late_answer_to_an_item_past_its_timeout_ms_is_dropped_and_holds_its_place(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two items pass their timeout_ms unanswered (the engine held); the server answers
    them once released. Their late answers are dropped without a warning, neither item
    is yielded twice, and until the server answers one of them both keep their places in
    the window (the server holds them still): the third item is read from the source only
    then."""
    engine = RecordingEngine(str(small_model))
    pulled: list[int] = []

    def items() -> Iterator[dict[str, npt.NDArray[Any]]]:
        for index in range(3):
            pulled.append(index)
            yield {"input": rows(1, start=index)}

    async def scenario() -> list[lc.StreamResult]:
        async with (
            serving(engine, config(small_model, stream_window=1)) as s,
            lc.AsyncClient(s.target) as client,
        ):
            engine.hold_next()
            results: list[lc.StreamResult] = []
            job = client.stream(items(), timeout_ms=ITEM_BUDGET_MS, window=2)
            async with contextlib.aclosing(job):
                while len(results) < 2:
                    results.append(await asyncio.wait_for(anext(job), 30))
                await asyncio.sleep(0.05)  # room for a read the window would allow
                assert pulled == [0, 1]
                engine.release()
                results.append(await asyncio.wait_for(anext(job), 30))
                with pytest.raises(StopAsyncIteration):
                    await asyncio.wait_for(anext(job), 30)
            return results

    caplog.set_level(logging.DEBUG, logger="laneserve.client")
    results = asyncio.run(scenario())
    assert [result.index for result in results] == [0, 1, 2]
    assert all(isinstance(result.error, lc.DeadlineExceededError) for result in results[:2])
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert any("dropped" in record.getMessage() for record in caplog.records)


def test_a_bulk_job_counts_items_past_their_timeout_ms_failed_and_resumes_them(
    small_model: Path, small_reference: ort.InferenceSession, tmp_path: Path
) -> None:
    """`laneserve-client bulk --timeout-ms` on a server that reads one item at a time,
    its engine held: every item fails DEADLINE_EXCEEDED (reason EXPIRED_IN_QUEUE: the
    client's own budget, which the server has not yet seen pass) once its budget from its
    first send has passed (exit 1, the checkpoint kept), and `--resume` runs them once the
    engine is free. (The job waited for the engine: its items came back OK long after
    their budget.)"""
    x = rows(40, seed=3)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"
    args = ["--input", str(tmp_path / "in.npy"), "--output", str(out), "--rows-per-item", "10"]
    args.append("--no-progress")
    engine = RecordingEngine(str(small_model))

    async def scenario() -> None:
        async with serving(engine, config(small_model, stream_window=1)) as s:
            engine.hold_next()
            # The engine is released only once the job has ended. The rerun has no
            # --timeout-ms: a slow machine must not fail it.
            code, _, err = await asyncio.wait_for(
                client_cli("bulk", "--target", s.target, *args, "--timeout-ms", "300"), 60
            )
            assert code == 1, err
            assert "4 of 4 items failed (EXPIRED_IN_QUEUE 4)" in err, err
            assert (tmp_path / "out.npy.partial").is_dir()
            engine.release()
            code, _, err = await client_cli("bulk", "--target", s.target, *args, "--resume")
            assert code == 0, err

    asyncio.run(scenario())
    np.testing.assert_allclose(
        np.load(out), small_reference.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6
    )


async def all_of(results: AsyncIterator[lc.StreamResult]) -> list[lc.StreamResult]:
    return [result async for result in results]


def test_a_stream_reads_each_array_of_its_inputs_once(small_model: Path, tmp_path: Path) -> None:
    """An NpzFile (``np.load("x.npz")``) decompresses an array at each read of it: a
    stream of one read every array again for each item, the whole archive 10 times over
    here; and each item of a stream of items was read three times."""
    np.savez(tmp_path / "rows.npz", input=rows(40))

    async def scenario(
        whole: CountedReads, items: list[CountedReads]
    ) -> tuple[list[lc.StreamResult], list[lc.StreamResult]]:
        async with client_for(RecordingEngine(str(small_model)), config(small_model)) as (
            _s,
            client,
        ):
            split = [result async for result in client.stream(whole, rows_per_item=4)]
            return split, [result async for result in client.stream(items)]

    with np.load(tmp_path / "rows.npz") as archive:
        whole = CountedReads(archive)
        items = [CountedReads(archive) for _ in range(3)]
        split, one_each = asyncio.run(scenario(whole, items))
    assert [result.ok for result in split + one_each] == [True] * 13
    assert [inputs.reads for inputs in [whole, *items]] == [1, 1, 1, 1]


def test_a_stream_of_one_mapping_refuses_inputs_infer_refuses(small_model: Path) -> None:
    """A stream of one mapping of arrays refuses what `infer` refuses of its inputs, at
    once: a value that is not an array with the same TypeError (it was an AttributeError),
    a 0-d array and an empty mapping as InvalidInputError (the job ended with no item and
    no error)."""
    scalar = {"input": np.array(1.0, np.float32)}
    listed: dict[str, Any] = {"input": rows(1).tolist()}
    not_an_array = re.escape("input 'input': expected a numpy array, got list")

    async def scenario() -> None:
        async with client_for(RecordingEngine(str(small_model)), config(small_model)) as (
            _s,
            client,
        ):
            for inputs, infer_refusal in ((scalar, "has shape []"), ({}, "missing input(s)")):
                with pytest.raises(lc.InvalidInputError, match=re.escape(infer_refusal)):
                    await client.infer(inputs)
            with pytest.raises(
                lc.InvalidInputError,
                match=re.escape("input 'input': expected an array with a row (first) axis"),
            ):
                client.stream(scalar)
            with pytest.raises(
                lc.InvalidInputError, match=re.escape("inputs: expected at least one input")
            ):
                client.stream({})
            with pytest.raises(TypeError, match=not_an_array):
                await client.infer(listed)
            with pytest.raises(TypeError, match=not_an_array):
                client.stream(listed)

    asyncio.run(scenario())


def test_an_id_or_lane_that_is_not_utf8_is_invalid_input_naming_it(small_model: Path) -> None:
    """A lone surrogate (``os.fsdecode`` of bytes that are not UTF-8) has no UTF-8
    encoding, which protobuf sends text as: a bare UnicodeEncodeError escaped `infer`,
    and ended a stream on an item's own request_id, the answers of the items before it
    lost. It is InvalidInputError naming the field, that item's answer alone."""
    x = {"input": rows(1)}
    surrogate = "\ud800"

    def refusal(field: str) -> str:
        return re.escape(f"{field} '\\ud800': expected UTF-8 text")

    async def scenario() -> list[lc.StreamResult]:
        async with client_for(RecordingEngine(str(small_model)), config(small_model)) as (
            _s,
            client,
        ):
            with pytest.raises(lc.InvalidInputError, match=refusal("request_id")):
                await client.infer(x, request_id=surrogate)
            with pytest.raises(lc.InvalidInputError, match=refusal("lane")):
                await client.infer(x, lane=surrogate)
            with pytest.raises(lc.InvalidInputError, match=refusal("lane")):
                client.stream([x], lane=surrogate)
            items: list[dict[str, Any] | lc.StreamRequest] = [
                x,
                lc.StreamRequest(x, request_id=surrogate),
                x,
            ]
            return [result async for result in client.stream(items)]

    results = asyncio.run(scenario())
    assert [result.ok for result in results] == [True, False, True]
    error = results[1].error
    assert isinstance(error, lc.InvalidInputError)
    assert re.search(refusal("bulk stream item 1: request_id"), error.message), error.message


def test_outputs_given_as_one_name_is_a_type_error(small_model: Path) -> None:
    """``outputs="output"`` was taken for the outputs 'o', 'u', 't', ... (and a one-letter
    name worked by accident)."""
    x = {"input": rows(1)}
    expected = re.escape("outputs: expected a sequence of output names, got str")

    async def scenario() -> None:
        async with client_for(RecordingEngine(str(small_model)), config(small_model)) as (
            _s,
            client,
        ):
            with pytest.raises(TypeError, match=expected):
                await client.infer(x, outputs="output")
            with pytest.raises(TypeError, match=expected):
                client.stream([x], outputs="output")
            assert list(await client.infer(x, outputs=["output"])) == ["output"]

    asyncio.run(scenario())


def test_names_and_ids_of_another_type_are_a_type_error_naming_the_field(
    small_model: Path,
) -> None:
    """An input name, request_id, lane or output name that is not a str was protobuf's
    bare "TypeError: bad argument type for built-in operation", naming nothing (a stream
    item's request_id ended the job with AttributeError 'int' object has no attribute
    'encode'), and an input name with no UTF-8 encoding the codec's own message. Each
    names its field and what was expected; a stream item's, its index too (that item's
    InvalidInputError, the job going on)."""
    x = {"input": rows(1)}
    wrong: Any = 0

    def type_error(field: str) -> str:
        return re.escape(f"{field}: expected str, got int")

    async def scenario() -> None:
        async with client_for(RecordingEngine(str(small_model)), config(small_model)) as (
            _s,
            client,
        ):
            with pytest.raises(TypeError, match=type_error("input name 0")):
                await client.infer({wrong: rows(1)})
            with pytest.raises(TypeError, match=type_error("request_id 0")):
                await client.infer(x, request_id=wrong)
            with pytest.raises(TypeError, match=type_error("request_id 5")):
                await client.infer(x, request_id=5)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=type_error("lane 0")):
                await client.infer(x, lane=wrong)
            with pytest.raises(TypeError, match=type_error("output name 0")):
                await client.infer(x, outputs=[wrong])
            # protobuf takes bytes for a string field: they were sent, and answered.
            raw: Any = b"interactive"
            bytes_error = re.escape("b'interactive': expected str, got bytes")
            with pytest.raises(TypeError, match="lane " + bytes_error):
                await client.infer(x, lane=raw)
            with pytest.raises(TypeError, match="output name " + bytes_error):
                await client.infer(x, outputs=[raw])
            with pytest.raises(TypeError, match=re.escape("outputs: expected a sequence of")):
                await client.infer(x, outputs=raw)  # its byte values were the names
            with pytest.raises(
                lc.InvalidInputError,
                match=re.escape("input name 'input\\ud800': expected UTF-8 text"),
            ):
                await client.infer({"input\ud800": rows(1)})
            with pytest.raises(TypeError, match=type_error("lane 0")):
                client.stream([x], lane=wrong)
            with pytest.raises(TypeError, match=type_error("output name 0")):
                client.stream([x], outputs=[wrong])
            with pytest.raises(TypeError, match=type_error("input name 0")):
                client.stream({wrong: rows(2)}, rows_per_item=1)
            for item, field in (
                (lc.StreamRequest(x, request_id=wrong), "request_id 0"),
                (lc.StreamRequest(x, request_id=5), "request_id 5"),  # type: ignore[arg-type]
                ({wrong: rows(1)}, "input name 0"),
            ):
                # The item's own answer: the job goes on (see test_bulk.py).
                results = [result async for result in client.stream([x, item, x])]
                assert [result.ok for result in results] == [True, False, True]
                refusal = results[1].error
                assert isinstance(refusal, lc.InvalidInputError)
                assert re.search(type_error(f"bulk stream item 1: {field}"), refusal.message)
            results = [result async for result in client.stream([x, {"input\ud800": rows(1)}])]
            assert [result.ok for result in results] == [True, False]
            assert isinstance(results[1].error, lc.InvalidInputError)
            assert "input name 'input\\ud800': expected UTF-8 text" in results[1].error.message

    asyncio.run(scenario())


def test_a_target_port_grpc_would_wrap_or_an_empty_target_is_refused_naming_it(
    small_model: Path,
) -> None:
    """gRPC takes a port over 65535 modulo 65536: a client aimed at P + 65536 talked to
    the server on P. And an empty target failed each call with a bare UNKNOWN ("Failed to
    create channel to ''") and gRPC's C-core lines on stderr. Both are refused when the
    client is made, naming the target; the forms gRPC takes still work."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            port = s.server.port
            for target, message in (
                (
                    f"127.0.0.1:{port + 65536}",
                    (
                        f"target '127.0.0.1:{port + 65536}': port '{port + 65536}' is out of "
                        f"range; expected HOST:PORT with a port from 1 to 65535 (gRPC would "
                        f"connect to port {port} instead)"
                    ),
                ),
                (f"[::1]:{port + 65536}", f"port '{port + 65536}' is out of range"),
                (f"ipv4:127.0.0.1:{port + 65536}", f"port '{port + 65536}' is out of range"),
                ("127.0.0.1:0", "port '0' is out of range"),
                ("127.0.0.1:-1", "port '-1' is not a whole number"),  # gRPC: port 65535
                ("127.0.0.1:", "no port after the ':'"),  # gRPC: port 443
                ("", "target '': expected HOST:PORT"),
            ):
                with pytest.raises(ValueError, match=re.escape(message)):
                    lc.AsyncClient(target)
                with pytest.raises(ValueError, match=re.escape(message)):
                    await asyncio.to_thread(lc.Client, target)
            with pytest.raises(TypeError, match=re.escape("target 5: expected str")):
                lc.AsyncClient(5)  # type: ignore[arg-type]
            for target in (
                f"127.0.0.1:{port}",
                f"127.0.0.1:0{port}",
                f"dns:///127.0.0.1:{port}",
                f"ipv4:127.0.0.1:{port}",
            ):
                async with lc.AsyncClient(target) as client:
                    assert (await client.infer({"input": rows(1)}))["output"].shape == (1, 10)

    asyncio.run(scenario())


def test_an_upper_case_resolver_scheme_is_checked_as_grpc_reads_it(small_model: Path) -> None:
    """gRPC reads a scheme in any case: "DNS:///127.0.0.1:P+65536" and "Dns:..." were
    taken unchecked and reached the server on P. They are refused when the client is
    made, before any channel; in range they reach it."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            port = s.server.port
            wrapped = port + 65536
            for target in (f"DNS:///127.0.0.1:{wrapped}", f"Dns:127.0.0.1:{wrapped}"):
                message = (
                    f"target '{target}': port '{wrapped}' is out of range; expected HOST:PORT "
                    f"with a port from 1 to 65535 (gRPC would connect to port {port} instead)"
                )
                with pytest.raises(ValueError, match=re.escape(message)):
                    lc.AsyncClient(target)
                with pytest.raises(ValueError, match=re.escape(message)):
                    await asyncio.to_thread(lc.Client, target)
            with pytest.raises(ValueError, match=f"port '{wrapped}' is out of range"):
                lc.AsyncClient(f"IPV4:127.0.0.1:{wrapped}")
            for target in (f"DNS:///127.0.0.1:{port}", f"Ipv4:127.0.0.1:{port}"):
                async with lc.AsyncClient(target) as client:
                    assert (await client.infer({"input": rows(1)}))["output"].shape == (1, 10)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("target", "scheme"),
    [
        ("http://127.0.0.1:50051", "http:"),
        ("HTTPS://example.com:443", "https:"),
        ("grpc://example.com:50051", "grpc:"),
        ("passthrough:///127.0.0.1:50051", "passthrough:"),
        ("grpc:example.com:50051", "grpc:"),
    ],
)
def test_a_target_uri_of_a_scheme_grpc_has_no_resolver_for_is_refused_naming_it(
    target: str, scheme: str
) -> None:
    """gRPC looks such a target up whole as one DNS name: every call failed as if no
    server were there ("Misformatted domain name"), after its 6 attempts, exit 3 in
    laneserve-client. Refused when the client is made, naming the scheme."""
    message = (
        f"target '{target}': gRPC has no resolver for its scheme '{scheme}', and it is no "
        "HOST:PORT; expected HOST:PORT (no scheme), or a gRPC target URI of dns:, ipv4:"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        lc.Client(target)

    async def scenario() -> None:
        with pytest.raises(ValueError, match=re.escape(message)):
            lc.AsyncClient(target)

    asyncio.run(scenario())


@pytest.mark.parametrize("target", ["ipv4:127.0.0.1:115587", "ipv6:[::1]:115587"])
def test_an_ipv4_or_ipv6_port_over_65535_is_refused_claiming_no_wrap(target: str) -> None:
    """The refusal said "(gRPC would connect to port 50051 instead)"; for these schemes
    gRPC refuses the target itself ("the target uri is not valid"): only DNS wraps."""
    message = (
        f"target '{target}': port '115587' is out of range; expected HOST:PORT with a port "
        "from 1 to 65535"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        lc.Client(target)


@pytest.mark.parametrize(
    ("target", "fault"),
    [
        (" 127.0.0.1:50051", "whitespace in the address ' 127.0.0.1:50051'"),
        ("127.0.0.1:50051 ", "whitespace in the address '127.0.0.1:50051 '"),
        ("127.0.0.1:50051\n", "whitespace in the address '127.0.0.1:50051\\n'"),
        (" dns:///127.0.0.1:50051", "whitespace in the address ' dns:///127.0.0.1:50051'"),
        ("dns:///127.0.0.1 :50051", "whitespace in the address '127.0.0.1 :50051'"),
        ("127.0.0.1:50051:1", "the address '127.0.0.1:50051:1' has more than one ':' and is no"),
        ("dns:///10.0.0.1:80:1", "the address '10.0.0.1:80:1' has more than one ':' and is no"),
        ("ipv4:127.0.0.1:1,127.0.0.1:2:3", "the address '127.0.0.1:2:3' has more than one ':'"),
    ],
)
def test_a_malformed_host_and_port_is_refused_naming_the_forms_expected(
    target: str, fault: str
) -> None:
    """gRPC looked each up whole as one DNS name, and every call was retried as if no
    server were there, 6 times (~2 s), ending UNAVAILABLE "Misformatted domain name" (a
    trailing space was refused, as a port that is no whole number). Refused when the
    client is made, naming the target and the forms gRPC takes."""
    expected = "expected HOST:PORT, [IPv6]:PORT (an IPv6 address in brackets), or a gRPC target"
    for make in (lc.Client, lc.AsyncClient):
        with pytest.raises(ValueError, match=re.escape(f"target {target!r}: {fault}")) as refused:
            make(target)
        assert expected in str(refused.value)


@pytest.mark.parametrize(
    "target",
    [
        "127.0.0.1",  # gRPC's default port, 443
        "::1",
        "[::1]",
        "[::1]:50051",
        "dns://8.8.8.8/example.com:50051",
        "ipv6:[::1]:50051",
        "unix:/tmp/laneserve.sock",
        "unix:///tmp/laneserve.sock",
        "unix-abstract:laneserve",
        # In any case, as gRPC reads a scheme.
        "DNS:///127.0.0.1:50051",
        "Dns:localhost:50051",
        "IPV4:127.0.0.1:50051",
        "Ipv6:[::1]:50051",
        "UNIX:/tmp/laneserve.sock",
        "Unix-Abstract:laneserve",
        # A URI-looking host: gRPC, with no resolver "localhost", resolves it by DNS.
        "localhost:50051",
        "fe80::1%eth0",
        "[fe80::1%eth0]:50051",
        "ipv4:127.0.0.1:50051,127.0.0.2:50051",
        "xds:///laneserve",
        "google-c2p:///laneserve",
        "vsock:3:50051",
        # IPv6 addresses unbracketed (gRPC's default port), and a socket path with spaces.
        "ipv6:::1",
        "::ffff:127.0.0.1",
        "dns:///::1",
        "unix:/tmp/laneserve sockets/a.sock ",
    ],
)
def test_every_target_form_grpc_takes_is_taken(target: str) -> None:
    """Only what is certainly wrong is refused: these make a client (no call is made)."""

    async def scenario() -> None:
        async with lc.AsyncClient(target) as client:
            assert client.target == target

    asyncio.run(scenario())


def test_metadata_the_client_sets_itself_is_refused_naming_max_message_bytes(
    small_model: Path,
) -> None:
    """A caller's laneserve-max-receive-bytes made every stream() fail: a bulk job sends
    its own value (its max_message_bytes), and the server refuses a call with two. It is
    refused when the client is made, saying what to use instead."""
    message = re.escape(
        "metadata key 'Laneserve-Max-Receive-Bytes': the client sends its own value of it, "
        "its max_message_bytes"
    )
    metadata = [("Laneserve-Max-Receive-Bytes", "4096")]

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            with pytest.raises(ValueError, match=message):
                lc.AsyncClient(s.target, metadata=metadata)
            with pytest.raises(ValueError, match=message):
                await asyncio.to_thread(lc.Client, s.target, metadata=metadata)
            # What to use instead: the limit reaches the server, and the job runs.
            async with lc.AsyncClient(s.target, max_message_bytes=4096) as client:
                results = [result async for result in client.stream([{"input": rows(1)}])]
            assert [result.ok for result in results] == [True]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"window": "8"}, "window: expected an integer, got '8'"),
        ({"window": 1.5}, "window: expected an integer, got 1.5"),
        ({"window": True}, "window: expected an integer, got True"),
        ({"rows_per_item": "2"}, "rows_per_item: expected an integer, got '2'"),
        ({"rows_per_item": 1.5}, "rows_per_item: expected an integer, got 1.5"),
        ({"timeout_ms": "100"}, "timeout_ms: expected an integer, got '100'"),
        ({"timeout_ms": 2.5}, "timeout_ms: expected an integer, got 2.5"),
        ({"window_rows": "4"}, "window_rows: expected an integer, got '4'"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else "",
)
def test_stream_options_that_are_not_integers_are_a_type_error_naming_the_option(
    options: dict[str, Any], message: str
) -> None:
    """They were bare TypeErrors naming no option ("'<' not supported between instances
    of 'str' and 'int'"), a float timeout_ms one blaming "bulk stream item 0", and a
    float window was taken. As RetryPolicy decides, a bool is not an integer here."""

    async def scenario() -> None:
        async with lc.AsyncClient("127.0.0.1:1") as client:  # nothing is sent
            with pytest.raises(TypeError, match=re.escape(message)):
                client.stream({"input": rows(2)}, **options)

    asyncio.run(scenario())
    with (
        lc.Client("127.0.0.1:1") as client,
        pytest.raises(TypeError, match=re.escape(message)),
    ):
        client.stream({"input": rows(2)}, **options)


def test_stream_options_may_be_numpy_integers(small_model: Path) -> None:
    async def scenario() -> list[lc.StreamResult]:
        async with client_for(RecordingEngine(str(small_model)), config(small_model)) as (
            _s,
            client,
        ):
            return await all_of(
                client.stream(
                    {"input": rows(5)},
                    rows_per_item=np.int64(2),  # type: ignore[arg-type]
                    window=np.int32(2),  # type: ignore[arg-type]
                    timeout_ms=np.uint32(60_000),  # type: ignore[arg-type]
                    window_rows=np.int64(4),  # type: ignore[arg-type]
                )
            )

    assert [result.ok for result in asyncio.run(scenario())] == [True] * 3


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"retry": 3}, "retry: expected a RetryPolicy or None, got int (3)"),
        ({"tls": "yes"}, "tls: expected True (the system's roots), False or None"),
        ({"metadata": ["k=v"]}, "metadata: expected (key, value) pairs, got 'k=v' (str)"),
        ({"metadata": "k=v"}, "metadata: expected a mapping of key to value or an iterable"),
        ({"metadata": [("k", 1)]}, "metadata value 1: expected str, got int"),
        ({"metadata": {1: "v"}}, "metadata key 1: expected str, got int"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else "",
)
def test_client_arguments_of_another_type_are_a_type_error_naming_them(
    arguments: dict[str, Any], message: str
) -> None:
    """They were taken, and each call failed later: AttributeError "'int' object has no
    attribute 'max_attempts'", "'str' object has no attribute 'server_name'", "too many
    values to unpack"."""
    with pytest.raises(TypeError, match=re.escape(message)):
        lc.Client("127.0.0.1:1", **arguments)

    async def scenario() -> None:
        with pytest.raises(TypeError, match=re.escape(message)):
            lc.AsyncClient("127.0.0.1:1", **arguments)

    asyncio.run(scenario())


def test_metadata_may_be_any_iterable_of_pairs_as_grpc_takes_it() -> None:
    """`dict.items()`, a generator or a set of pairs worked before the client checked
    its arguments (gRPC takes any iterable), and were then refused as a TypeError."""
    from laneserve.client._channel import checked_metadata  # noqa: PLC0415

    expected = (("x-team", "a"),)
    assert checked_metadata({"x-team": "a"}.items()) == expected
    assert checked_metadata(pair for pair in [("x-team", "a")]) == expected
    assert checked_metadata({("x-team", "a")}) == expected
    lc.Client("127.0.0.1:1", metadata={"x-team": "a"}.items()).close()


def test_a_calls_retry_of_another_type_is_a_type_error_naming_it() -> None:
    wrong: Any = 3
    message = re.escape("retry: expected a RetryPolicy or None, got int (3)")

    async def scenario() -> None:
        async with lc.AsyncClient("127.0.0.1:1") as client:  # nothing is sent
            with pytest.raises(TypeError, match=message):
                await client.infer({"input": rows(1)}, retry=wrong)
            with pytest.raises(TypeError, match=message):
                client.stream({"input": rows(1)}, retry=wrong)

    asyncio.run(scenario())


def test_a_request_the_client_refuses_is_invalid_input_never_sent() -> None:
    """A request_id over the server's 256 bytes was sent (a bulk job's item's was refused
    before sending), to be refused there; and a request the client refused carried no
    reason, where the server's refusal of the same input says INVALID_INPUT. Nothing
    listens: a request that were sent would fail UNAVAILABLE."""

    async def scenario() -> None:
        async with lc.AsyncClient(f"127.0.0.1:{refusing_port()}") as client:
            x = {"input": rows(1)}
            for request_id, message in (
                ("y" * 300, "request_id is 300 bytes, over the server's limit of 256 bytes"),
                ("\u00e9" * 129, "request_id is 258 bytes, over the server's limit of 256"),
                ("a\udcff", "request_id 'a\\udcff': expected UTF-8 text"),
            ):
                with pytest.raises(lc.InvalidInputError, match=re.escape(message)) as refused:
                    await client.infer(x, request_id=request_id)
                assert (refused.value.reason, refused.value.attempts) == ("INVALID_INPUT", 0)
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(lc.InvalidInputError, match="numpy dtype complex64") as refused:
                await client.infer({"input": np.zeros((1, 2), np.complex64)})
            assert (refused.value.reason, refused.value.attempts) == ("INVALID_INPUT", 0)
            # The longest id the server takes is the client's too.
            with pytest.raises(lc.UnavailableError):
                await client.infer(x, request_id="y" * 256, retry=lc.NO_RETRIES)

    asyncio.run(scenario())


def test_a_request_over_the_clients_message_limit_is_refused_never_sent() -> None:
    """gRPC failed it itself, "ResourceExhaustedError: CLIENT: Sent message larger than max
    (67110972 vs. 67108864)", with attempts 1 and no word of what to do. It is refused
    before sending, as stream() refuses such an item: the same class, attempts 0, the
    request's size and the limit named. A request of exactly the limit is sent, and so is
    a larger one when the caller's own gRPC option lifts the limit. Nothing listens: a
    request that were sent fails UNAVAILABLE."""
    from laneserve.client._request import encode_inputs, infer_request  # noqa: PLC0415

    x = {"input": rows(4)}
    # What the client sends for a request_id of "r": gRPC compares this size.
    size = infer_request("r", encode_inputs(x, "r"), lane=None).ByteSize()
    target = f"127.0.0.1:{refusing_port()}"
    message = (
        f"the request is {size} bytes encoded, over the largest message this client sends "
        f"({size - 1} bytes, max_message_bytes); expected fewer rows per call, or a larger "
        "limit (max_message_bytes, and the server's max_message_bytes"
    )

    async def scenario() -> None:
        async with lc.AsyncClient(target, max_message_bytes=size - 1) as client:
            with pytest.raises(lc.ResourceExhaustedError, match=re.escape(message)) as refused:
                await client.infer(x, request_id="r")
            assert type(refused.value) is lc.ResourceExhaustedError
            assert (refused.value.attempts, refused.value.request_id) == (0, "r")
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for limits in (
            {"max_message_bytes": size},
            {"max_message_bytes": size - 1, "options": [("grpc.max_send_message_length", -1)]},
        ):
            async with lc.AsyncClient(target, **limits) as client:
                with pytest.raises(lc.UnavailableError):
                    await client.infer(x, request_id="r", retry=lc.NO_RETRIES)

    asyncio.run(scenario())
    with lc.Client(target, max_message_bytes=size - 1) as client:
        with pytest.raises(lc.ResourceExhaustedError, match=re.escape(message)) as refused:
            client.infer(x, request_id="r")
        assert refused.value.attempts == 0
    # A limit the caller's option sets is the one named.
    options = [("grpc.max_send_message_length", size - 1)]
    named = re.escape(
        f"({size - 1} bytes, the option 'grpc.max_send_message_length'); expected fewer rows "
        "per call, or a larger limit (the option 'grpc.max_send_message_length', and"
    )
    with (
        lc.Client(target, options=options) as client,
        pytest.raises(lc.ResourceExhaustedError, match=named),
    ):
        client.infer(x, request_id="r")


def test_a_call_on_a_closed_client_is_refused_never_sent_its_attempts_0(
    small_model: Path,
) -> None:
    """`attempts` is 0 for a request the client refused itself, never sent; a call on a
    closed client counted 1 (infer, model and stream, on both clients), as if a server
    had answered it."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            client = lc.AsyncClient(s.target)
            await client.model()  # its channel is open
            await client.close()
            calls: dict[str, Callable[[], Awaitable[object]]] = {
                "infer": lambda: client.infer({"input": rows(1)}, request_id="r"),
                "model": client.model,
                "stats": client.stats,
                "stream": lambda: all_of(client.stream({"input": rows(1)})),
            }
            for name, call in calls.items():
                with pytest.raises(lc.ClientClosedError, match="the client is closed") as closed:
                    await call()
                assert closed.value.attempts == 0, name
            await asyncio.to_thread(sync_calls, s.target)

    def sync_calls(target: str) -> None:
        with lc.Client(target) as client:
            client.model()
        calls: dict[str, Callable[[], object]] = {
            "infer": lambda: client.infer({"input": rows(1)}),
            "model": client.model,
            "stats": client.stats,
            "stream": lambda: list(client.stream({"input": rows(1)})),
        }
        for name, call in calls.items():
            with pytest.raises(lc.ClientClosedError, match="the client is closed") as closed:
                call()
            assert closed.value.attempts == 0, f"Client.{name}"

    asyncio.run(scenario())


def test_a_stream_to_a_lane_the_server_lacks_is_refused_once_before_its_call(
    small_model: Path,
) -> None:
    """Every item was sent, and each answered "unknown lane" (a job of 2000 items, 2000
    errors). The job asks the server's lanes before its call (GetModel): it is refused
    once, naming the lane and the server's lanes, and no InferStream call is made."""
    message = re.escape(
        "unknown lane 'fast'; expected one of the server's lanes ['interactive', 'standard', "
        "'bulk']"
    )

    async def scenario() -> None:
        async with client_for(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            client,
        ):
            with pytest.raises(lc.InvalidInputError, match=message) as refused:
                await all_of(client.stream({"input": rows(50)}, rows_per_item=1, lane="fast"))
            calls = s.server.grpc_calls()
            assert calls is not None
            assert (calls.started, calls.failed) == (1, 0), "GetModel alone"
            error = refused.value
            assert (error.reason, error.attempts) == ("INVALID_INPUT", 0)
            assert "refused before its call; 0 item(s) read" in "".join(error.__notes__)
            # A lane it has runs.
            results = await all_of(client.stream({"input": rows(2)}, lane="standard"))
            assert [result.ok for result in results] == [True]

    asyncio.run(scenario())


def test_a_stream_of_a_bare_array_is_a_type_error_at_the_call() -> None:
    """``stream(rows, rows_per_item=64)`` for ``stream({"input": rows}, ...)``
    type-checks (numpy's iteration is untyped), and each row was answered alone
    ("bulk stream item 0: expected a mapping ... got ndarray"), rows_per_item ignored. It
    is refused at the call, before anything is sent or a thread made to read it."""
    array = np.zeros((2000, 512), np.float32)
    message = re.escape(
        "requests: expected a mapping of input name to array ({name: rows}: one job of "
        "rows_per_item-row items) or an iterable of items (each such a mapping or a "
        "StreamRequest); got a numpy array of shape (2000, 512), which names no input: "
        "stream({name: rows}, ...)"
    )
    target = f"127.0.0.1:{refusing_port()}"
    with lc.Client(target) as client, pytest.raises(TypeError, match=message):
        client.stream(array, rows_per_item=64)

    async def scenario() -> None:
        async with lc.AsyncClient(target) as client:
            with pytest.raises(TypeError, match=message):
                client.stream(array, rows_per_item=64)

    asyncio.run(scenario())


def test_the_type_aliases_and_every_error_class_are_public() -> None:
    """What a typed caller annotates with is exported (it was in private modules), and
    every error class is in both lists of names (ServerBusyError was not in _errors')."""
    from laneserve.client import _errors  # noqa: PLC0415 - its list of names, under test

    classes = {
        name
        for name, value in vars(_errors).items()
        if isinstance(value, type) and issubclass(value, lc.LaneserveError)
    }
    assert classes <= set(_errors.__all__), classes - set(_errors.__all__)
    assert classes <= set(lc.__all__), classes - set(lc.__all__)
    aliases = {"MetadataLike", "TlsLike", "Outputs", "StreamSource", "StreamItem"}
    assert aliases <= set(lc.__all__)
    # Checked by mypy --strict, as a caller's code is.
    metadata: lc.MetadataLike = {"authorization": "Bearer x"}
    tls: lc.TlsLike = None
    item: lc.StreamItem = lc.StreamRequest({"input": rows(1)}, request_id="a")
    source: lc.StreamSource = [item, {"input": rows(1)}]
    outputs: lc.Outputs = {"output": rows(1)}
    client = lc.AsyncClient(f"127.0.0.1:{refusing_port()}", metadata=metadata, tls=tls)
    assert client.metadata == (("authorization", "Bearer x"),)
    assert isinstance(source, list)
    assert outputs["output"].shape == (1, 512)


# A caller that leaves a stream early, holding it, closes it: the job goes on until then.
CLOSING_A_STREAM = """
import contextlib

import numpy as np
import numpy.typing as npt

from laneserve.client import AsyncClient, Client


async def first_async(client: AsyncClient, rows: npt.NDArray[np.float32]) -> int:
    async with contextlib.aclosing(client.stream({"input": rows})) as results:
        async for result in results:
            return result.index
    results = client.stream({"input": rows})
    await results.aclose()
    return -1


def first_sync(client: Client, rows: npt.NDArray[np.float32]) -> int:
    with contextlib.closing(client.stream({"input": rows})) as results:
        for result in results:
            return result.index
    client.stream({"input": rows}).close()
    return -1
"""


def test_a_stream_types_as_a_generator_its_caller_may_close(tmp_path: Path) -> None:
    """A `break` out of a stream still referenced leaves its job running until the
    stream is closed (`aclose()`/`close()`, or garbage collection): declared an
    AsyncIterator/Iterator, it was refused by mypy --strict in contextlib.aclosing and
    contextlib.closing, and its aclose()/close() were unknown attributes."""
    sample = tmp_path / "closing_a_stream.py"
    sample.write_text(CLOSING_A_STREAM)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--config-file",
            str(Path(__file__).parents[1] / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "mypy_cache"),
            str(sample),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# ---- the translation table, for every status and reason ----------------------------------


@pytest.mark.parametrize(
    ("code", "reason", "expected", "retryable"),
    [
        (code_pb2.INVALID_ARGUMENT, "INVALID_INPUT", lc.InvalidInputError, False),
        (code_pb2.INVALID_ARGUMENT, "REQUEST_ID_REUSED", lc.RequestIdReusedError, False),
        (code_pb2.INVALID_ARGUMENT, "", lc.InvalidInputError, False),
        (code_pb2.RESOURCE_EXHAUSTED, "LANE_FULL", lc.LaneFullError, True),
        (code_pb2.RESOURCE_EXHAUSTED, "MEMORY_PRESSURE", lc.MemoryPressureError, True),
        (code_pb2.UNAVAILABLE, "MEMORY_PRESSURE", lc.MemoryPressureError, True),
        (code_pb2.RESOURCE_EXHAUSTED, "DEVICE_MEMORY", lc.DeviceMemoryError, False),
        (code_pb2.RESOURCE_EXHAUSTED, "", lc.ResourceExhaustedError, False),
        (code_pb2.DEADLINE_EXCEEDED, "DEADLINE_UNMEETABLE", lc.DeadlineUnmeetableError, False),
        (code_pb2.DEADLINE_EXCEEDED, "EXPIRED_IN_QUEUE", lc.ExpiredInQueueError, False),
        (code_pb2.DEADLINE_EXCEEDED, "", lc.DeadlineExceededError, False),
        (code_pb2.UNAVAILABLE, "DRAINING", lc.ServerDrainingError, True),
        (code_pb2.UNAVAILABLE, "", lc.UnavailableError, True),
        (code_pb2.INTERNAL, "ENGINE_FAILURE", lc.EngineError, False),
        (code_pb2.INTERNAL, "", lc.LaneserveError, False),
        (code_pb2.CANCELLED, "", lc.CallCancelledError, True),
        (code_pb2.UNIMPLEMENTED, "", lc.LaneserveError, False),
        (code_pb2.INTERNAL, "SOMETHING_NEW", lc.LaneserveError, False),
    ],
)
def test_each_status_and_reason_maps_to_its_error(
    code: int, reason: str, expected: type[lc.LaneserveError], retryable: bool
) -> None:
    details = []
    if reason:
        details.append(packed(error_details_pb2.ErrorInfo(reason=reason, domain="laneserve.dev")))
    status = status_pb2.Status(code=code, message="what went wrong", details=details)
    error = lc.error_from_status(status, request_id="r1")
    assert type(error) is expected
    assert error.retryable is retryable
    assert error.reason == reason
    assert error.message == "what went wrong"
    assert error.code.value[0] == code
    assert error.request_id == "r1"
    assert error.retry_after_s is None


def test_retry_delay_comes_from_retry_info_else_the_pushback_trailer() -> None:
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(40)
    info = packed(error_details_pb2.ErrorInfo(reason="LANE_FULL", domain="laneserve.dev"))
    with_info = status_pb2.Status(
        code=code_pb2.RESOURCE_EXHAUSTED,
        details=[info, packed(error_details_pb2.RetryInfo(retry_delay=delay))],
    )
    assert lc.error_from_status(with_info, pushback_ms="70").retry_after_s == pytest.approx(0.04)
    without = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, details=[info])
    assert lc.error_from_status(without, pushback_ms="70").retry_after_s == pytest.approx(0.07)
    refused = lc.error_from_status(without, pushback_ms="-1")
    assert refused.retryable
    assert not refused.should_retry, "a negative pushback means: do not retry"


# ---- statuses and answers from a peer that is not laneserve (a proxy, a broken server) ---


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.INTERNAL, lc.LaneserveError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, lc.ResourceExhaustedError),
        (grpc.StatusCode.UNAVAILABLE, lc.UnavailableError),
    ],
)
def test_a_status_whose_details_do_not_parse_is_mapped_by_its_code_saying_so(
    code: grpc.StatusCode, expected: type[lc.LaneserveError]
) -> None:
    """A grpc-status-details-bin trailer that is no google.rpc.Status (a proxy's, a peer
    not laneserve): the call raised protobuf's DecodeError, no LaneserveError. It is the
    class its status code gives, its message saying the details were not read; the
    pushback trailer still gives the retry hint."""

    async def abort(_request: pb.InferRequest, context: AioContext) -> pb.InferResponse:
        context.set_trailing_metadata(
            (("grpc-status-details-bin", b"\xff\xfe\x01garbage"), ("grpc-retry-pushback-ms", "250"))
        )
        await context.abort(code, "broken")
        raise AssertionError("unreachable: abort raises")

    async def scenario() -> None:
        async with (
            fake_server({"Infer": unary(abort, pb.InferRequest)}) as target,
            lc.AsyncClient(target, retry=lc.NO_RETRIES) as client,
        ):
            with pytest.raises(lc.LaneserveError) as caught:
                await client.infer({"input": rows(1)}, request_id="r1")
        error = caught.value
        assert type(error) is expected
        assert (error.code, error.reason, error.request_id) == (code, "", "r1")
        assert error.message.startswith(
            "broken (the status details were not read: grpc-status-details-bin did not parse ("
        )
        assert error.message.endswith("; the error is mapped by its status code alone)")
        assert error.retry_after_s == pytest.approx(0.25)

    asyncio.run(scenario())


def test_a_status_detail_that_does_not_parse_is_left_out_saying_so() -> None:
    """A detail whose bytes are not the type it names: the others still read, the
    message names the one left out (it raised protobuf's DecodeError)."""
    broken = any_pb2.Any(
        type_url="type.googleapis.com/google.rpc.ErrorInfo", value=b"\xff\xfe\x01garbage"
    )
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(40)
    status = status_pb2.Status(
        code=code_pb2.RESOURCE_EXHAUSTED,
        message="full",
        details=[broken, packed(error_details_pb2.RetryInfo(retry_delay=delay))],
    )
    error = lc.error_from_status(status)
    assert type(error) is lc.ResourceExhaustedError
    assert error.retry_after_s == pytest.approx(0.04)
    assert error.message.startswith(
        "full (its status detail type.googleapis.com/google.rpc.ErrorInfo did not parse: "
    )


# An answer this client cannot read, per lane the fake server is asked for: its tensor,
# and what the client says of it.
UNREADABLE = {
    "short": (
        pb.Tensor(name="output", dtype=pb.DATA_TYPE_FLOAT32, shape=[1, 10], data=b"\x00" * 7),
        "tensor 'output': data is 7 bytes; expected 40 (10 float32 of 4 bytes for shape [1, 10])",
    ),
    "not-utf8": (
        pb.Tensor(name="t", dtype=pb.DATA_TYPE_STRING, shape=[1], data=b"\x02\x00\x00\x00\xff\xfe"),
        "tensor 't': element 0 is not UTF-8",
    ),
}


def test_an_answer_the_client_cannot_read_is_unreadable_answer_error_not_a_value_error() -> None:
    """A malformed answer (data of another size than its shape and dtype, text that is
    not UTF-8) raised the codec's ValueError: InvalidInputError's base, so a service
    mapping ValueError to its caller's fault blamed the caller for a broken server, and
    `except LaneserveError` missed it. It is UnreadableAnswerError (code INTERNAL, not a
    ValueError) from `infer` on either client and as a stream item's error, saying the
    answer could not be read and why, with the attempts the call made."""
    refused: set[str] = set()  # request_ids refused once UNAVAILABLE

    async def infer(request: pb.InferRequest, context: AioContext) -> pb.InferResponse:
        if request.lane == "after-unavailable" and request.request_id not in refused:
            refused.add(request.request_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        lane = "short" if request.lane == "after-unavailable" else request.lane
        return pb.InferResponse(request_id=request.request_id, outputs=[UNREADABLE[lane][0]])

    async def infer_stream(
        requests: AsyncIterator[pb.InferRequest], _context: AioContext
    ) -> AsyncIterator[pb.InferStreamResponse]:
        async for request in requests:
            answer = pb.InferResponse(
                request_id=request.request_id, outputs=[UNREADABLE[request.lane][0]]
            )
            yield pb.InferStreamResponse(request_id=request.request_id, response=answer)

    def check(error: lc.LaneserveError, why: str, *, attempts: int = 1, name: str = "") -> None:
        assert type(error) is lc.UnreadableAnswerError
        assert not isinstance(error, ValueError)
        assert error.code is grpc.StatusCode.INTERNAL
        assert error.message.startswith(f"{name}the server's answer could not be read: {why}")
        assert "no fault of the request" in error.message
        assert (error.attempts, error.should_retry) == (attempts, False)
        assert isinstance(error.__cause__, ValueError)

    x = {"input": rows(1)}

    async def scenario() -> None:
        handlers = {
            "Infer": unary(infer, pb.InferRequest),
            "InferStream": bidirectional(infer_stream),
        }
        async with fake_server(handlers) as target, lc.AsyncClient(target) as client:
            for lane, (_tensor, why) in UNREADABLE.items():
                with pytest.raises(lc.LaneserveError) as caught:
                    await client.infer(x, lane=lane, request_id="r1")
                check(caught.value, why)
                assert caught.value.request_id == "r1"
                results = await all_of(client.stream([x], lane=lane, job_id="job"))
                assert [result.request_id for result in results] == ["job-0"]
                assert results[0].error is not None
                check(results[0].error, why, name="bulk stream item 0: ")
            with pytest.raises(lc.LaneserveError) as caught:
                await client.infer(x, lane="after-unavailable")
            check(caught.value, UNREADABLE["short"][1], attempts=2)
            # The sync client decodes on the calling thread (here, not on its loop's).
            check(await asyncio.to_thread(sync_infer_error, target, x), UNREADABLE["short"][1])

    asyncio.run(scenario())


def sync_infer_error(target: str, inputs: Mapping[str, npt.NDArray[Any]]) -> lc.LaneserveError:
    """The error a sync Client's `infer` of `inputs` in lane "short" raises."""
    with lc.Client(target) as client, pytest.raises(lc.LaneserveError) as caught:
        client.infer(inputs, lane="short")
    return caught.value


# ---- retries ---------------------------------------------------------------------------


def test_retries_stop_at_the_cap_reusing_one_request_id(small_model: Path) -> None:
    lanes = (
        LaneConfig("standard", capacity_rows=1, timeout_ms=60_000, max_wait_ms=0, min_share=0),
    )
    seen: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    ids: list[str] = []

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with (
            serving(engine, config(small_model, lanes=lanes)) as s,
            lc.AsyncClient(
                s.target, retry=lc.RetryPolicy(max_attempts=4), interceptors=[Recorder(seen, ids)]
            ) as client,
        ):
            engine.hold()
            running = asyncio.ensure_future(client.infer({"input": rows(1)}))
            await asyncio.to_thread(engine.entered.acquire)
            queued = asyncio.ensure_future(client.infer({"input": rows(1)}))
            await until(lambda: queued_rows(s) == 1)
            with pytest.raises(lc.LaneFullError) as caught:
                await client.infer({"input": rows(1)}, request_id="capped")
            stats = await client.stats()
            engine.release()
            await asyncio.gather(running, queued)
        assert caught.value.attempts == 4
        assert ids.count("capped") == 4, "every attempt carries the same request_id"
        assert stats.lanes[0].rejected["LANE_FULL"] == 4
        assert "gave up after 4 attempt(s) (max_attempts)" in caught.value.__notes__[0]

    asyncio.run(scenario())


def test_retries_stop_before_the_deadline(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane that stays full is retried only while the next attempt can still start
    before the caller's deadline; then its refusal is raised (not DEADLINE_EXCEEDED), and
    each attempt's gRPC deadline is what is left of the call's. On the retry loop's clock,
    which only its waits move (it slept for real against a 0.4 s deadline)."""
    lc.set_testing(False)  # the waits are faked; they must be asked for the real delays
    backoff = FakeBackoff(monkeypatch)
    deadlines: list[float | None] = []
    lanes = (
        LaneConfig("standard", capacity_rows=1, timeout_ms=60_000, max_wait_ms=0, min_share=0),
    )

    async def scenario() -> tuple[lc.LaneFullError, pb.GetStatsResponse]:
        engine = RecordingEngine(str(small_model))
        # Delays of 20, 40, 80, 100, 100 s without jitter: the next, 100 s after 340 s of
        # waits, would start after the deadline of 400 s. Seconds this long keep every
        # attempt's real gRPC deadline (60 s at least) far from a slow machine's.
        policy = lc.RetryPolicy(
            max_attempts=1000, initial_backoff_s=20.0, max_backoff_s=100.0, jitter=0.0
        )
        async with (
            serving(engine, config(small_model, lanes=lanes)) as s,
            lc.AsyncClient(
                s.target, retry=policy, interceptors=[Recorder([], timeouts=deadlines)]
            ) as client,
            one_running(engine, client),
        ):
            queued = asyncio.ensure_future(client.infer({"input": rows(1)}))
            await until(lambda: queued_rows(s) == 1)
            deadlines.clear()
            with pytest.raises(lc.LaneFullError) as caught:
                await client.infer({"input": rows(1)}, timeout=400.0)
            stats = await client.stats()
            engine.release()
            await queued
        return caught.value, stats

    error, stats = asyncio.run(scenario())
    assert backoff.waits_s == [20.0, 40.0, 80.0, 100.0, 100.0]
    assert error.attempts == 6
    assert stats.lanes[0].rejected["LANE_FULL"] == 6, "every attempt reached the server"
    # Less the real time the call took to build its request (it counts: a review).
    assert deadlines[:6] == [
        pytest.approx(left, abs=0.05) for left in (400, 380, 340, 260, 160, 60)
    ]
    (note,) = error.__notes__
    # Whose wait it is, too: "in 53 ms" alone read as the server's hint of 2 ms.
    assert note.startswith(
        f"Infer {error.request_id!r}: gave up after 6 attempt(s): the next would start "
        "after the deadline (in 100000 ms: the longer of this client's backoff "
        "(RetryPolicy's initial_backoff_s doubled) and the server's hint of "
    ), note


def test_retry_succeeds_once_the_lane_has_room(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused LANE_FULL twice; the lane has room when the second wait ends: the third
    attempt runs, once. (The waits are held by hand: it slept for real until the server
    had counted two refusals.)"""
    lc.set_testing(False)  # the waits are faked; they must be asked for the real delays
    backoff = FakeBackoff(monkeypatch, held_at=2)
    lanes = (
        LaneConfig("standard", capacity_rows=1, timeout_ms=60_000, max_wait_ms=0, min_share=0),
    )

    async def scenario() -> tuple[dict[str, npt.NDArray[Any]], int, list[int]]:
        engine = RecordingEngine(str(small_model))
        policy = lc.RetryPolicy(max_attempts=100, initial_backoff_s=0.005, max_backoff_s=0.02)
        async with (
            serving(engine, config(small_model, lanes=lanes)) as s,
            lc.AsyncClient(s.target, retry=policy) as client,
        ):
            engine.hold()
            running = asyncio.ensure_future(client.infer({"input": rows(1)}))
            await asyncio.to_thread(engine.entered.acquire)
            queued = asyncio.ensure_future(client.infer({"input": rows(1)}))
            await until(lambda: queued_rows(s) == 1)
            retrying = asyncio.ensure_future(client.infer({"input": rows(1, start=7)}))
            await until(lambda: len(backoff.waits_s) == 2)  # refused twice, waiting
            refused = await rejected(client)
            engine.release()
            await asyncio.gather(running, queued)  # the lane is empty again
            backoff.go.set()
            outputs = await retrying
        return outputs, refused, engine.ran_tags

    outputs, refused, ran_tags = asyncio.run(scenario())
    assert refused == 2
    assert len(backoff.waits_s) == 2, "the third attempt was answered"
    assert outputs["output"].shape == (1, 10)
    assert ran_tags.count(7) == 1


def test_backoff_grows_exponentially_within_its_jitter_and_cap() -> None:
    policy = lc.RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(7)
    for retry, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (50, 1.0)]:
        delays = [policy.backoff_s(retry, rng) for _ in range(200)]
        assert all(base * 0.5 <= delay <= base for delay in delays), retry
        assert max(delays) - min(delays) > base * 0.3, "jittered, not constant"


def test_server_hint_is_a_floor_for_the_delay() -> None:
    policy = lc.RetryPolicy(initial_backoff_s=0.01, jitter=0.0)
    assert policy.delay_s(1, 0.25) == 0.25
    assert policy.delay_s(1, 0.001) == pytest.approx(0.01)
    assert policy.delay_s(1, None) == pytest.approx(0.01)


def test_server_hint_is_honoured_up_to_the_policys_longest_backoff() -> None:
    """A hint of an hour (a bad server, a bad proxy) stalled every retrying caller for
    an hour: the policy's max_backoff_s bounds it, as it bounds the backoff."""
    policy = lc.RetryPolicy(initial_backoff_s=0.01, max_backoff_s=2.0, jitter=0.0)
    assert policy.delay_s(1, 3600.0) == 2.0
    assert policy.delay_s(1, 1.5) == 1.5


def test_a_steep_backoff_stops_at_its_cap_however_many_retries() -> None:
    """The delay grew as multiplier ** (retry - 1), the exponent capped at 64 to "stay
    finite": 1e6 ** 60 is past a float's range, and the power raised OverflowError."""
    policy = lc.RetryPolicy(max_attempts=100, multiplier=1e6, max_backoff_s=3.0, jitter=0.0)
    assert [policy.backoff_s(retry) for retry in (1, 2, 60, 99)] == [0.1, 3.0, 3.0, 3.0]
    assert lc.RetryPolicy(initial_backoff_s=0.0, multiplier=1e6, jitter=0.0).backoff_s(99) == 0.0


@pytest.mark.parametrize(
    "fields",
    [{"max_attempts": 0}, {"initial_backoff_s": -1.0}, {"multiplier": 0.5}, {"jitter": 1.5}],
)
def test_invalid_policy_is_refused_naming_the_field(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        lc.RetryPolicy(**fields)


def test_testing_switch_caps_attempts_without_sleeping() -> None:
    lc.set_testing(True, max_attempts=2)

    async def scenario() -> None:
        slow = lc.RetryPolicy(max_attempts=10, initial_backoff_s=60.0)
        async with lc.AsyncClient(f"127.0.0.1:{refusing_port()}", retry=slow) as client:
            with pytest.raises(lc.UnavailableError) as caught:
                await asyncio.wait_for(client.infer({"input": rows(1)}), timeout=30)
        assert caught.value.attempts == 2

    asyncio.run(scenario())
    assert lc.is_testing()


def test_a_server_hint_is_jittered_upward_never_sooner_than_asked() -> None:
    """Callers refused at once get the same hint (MEMORY_PRESSURE's is a constant 0.25 s):
    taken as is, 1000 of them all came back at exactly 250 ms. Jittered upward, within
    the policy's jitter and cap: never sooner than asked, spread apart."""
    policy = lc.RetryPolicy()  # jitter 0.5, max_backoff_s 5
    rng = random.Random(35)
    for hint_s in (0.25, 0.16):
        delays = [policy.delay_s(1, hint_s, rng) for _ in range(1000)]
        assert all(hint_s <= delay <= hint_s * 1.5 for delay in delays), hint_s
        assert len(set(delays)) > 500, "spread apart, not one instant"
        assert max(delays) - min(delays) > hint_s * 0.4
    near_cap = [policy.delay_s(1, 4.9, rng) for _ in range(1000)]
    assert all(4.9 <= delay <= 5.0 for delay in near_cap), "capped, never below the hint"
    assert len(set(near_cap)) > 1
    assert {policy.delay_s(1, 60.0, rng) for _ in range(100)} == {5.0}, "honoured up to the cap"


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"max_tokens": 0}, ValueError),
        ({"max_tokens": 1.5}, TypeError),
        ({"max_tokens": True}, TypeError),
        ({"token_ratio": 0.0}, ValueError),
        ({"token_ratio": math.nan}, ValueError),
        ({"token_ratio": "0.1"}, TypeError),
    ],
)
def test_invalid_retry_budget_is_refused_naming_the_field(
    fields: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error, match=next(iter(fields))):
        lc.RetryBudget(**fields)


def test_a_clients_retry_budget_of_another_type_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="retry_budget: expected a RetryBudget or None"):
        lc.AsyncClient(retry_budget=10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="retry_budget: expected a RetryBudget or None"):
        lc.Client(retry_budget=lc.RetryPolicy())  # type: ignore[arg-type]


def test_a_clients_calls_share_one_retry_budget_that_bounds_a_storm(small_model: Path) -> None:
    """Against a lane that stays full, a fresh client's calls draw on one budget (100
    tokens by default; each refusal takes one, retries stop at half): a lone call keeps
    its 6 attempts, and so do eight in all (48 tokens); the ninth retries once (its
    second refusal is the 50th) and the tenth not at all, each saying why. Without it
    every call made its 6 attempts: callers at twice a server's capacity sent it 3.5
    attempts per request. In test mode, as here: it keeps the budget (it left it out)."""

    async def scenario() -> tuple[list[lc.LaneFullError], int]:
        engine = RecordingEngine(str(small_model))
        errors: list[lc.LaneFullError] = []
        async with (
            serving(engine, config(small_model, lanes=one_lane(capacity_rows=1))) as s,
            lc.AsyncClient(s.target) as filler,
            lc.AsyncClient(s.target) as client,
        ):
            async with one_running(engine, filler):
                queued = asyncio.ensure_future(filler.infer({"input": rows(1)}))
                await until(lambda: queued_rows(s) == 1)
                for _ in range(10):
                    with pytest.raises(lc.LaneFullError) as caught:
                        await client.infer({"input": rows(1)})
                    errors.append(caught.value)
                refused = await rejected(filler)
            await queued
        return errors, refused

    assert lc.is_testing()
    errors, refused = asyncio.run(scenario())
    assert [error.attempts for error in errors] == [6] * 8 + [2, 1]
    assert refused == 8 * 6 + 2 + 1, "every attempt reached the server"
    assert "gave up after 6 attempt(s) (max_attempts)" in errors[0].__notes__[0]
    assert "gave up after 6 attempt(s) (max_attempts)" in errors[7].__notes__[0]
    for error, attempts, tokens in [(errors[8], 2, 50), (errors[9], 1, 49)]:
        (note,) = error.__notes__
        assert f"gave up after {attempts} attempt(s): retry budget spent: " in note
        assert f"({tokens} of 100 tokens left; retries resume above 50" in note


def test_a_burst_of_calls_refused_draining_each_retries(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server restarting under 60 calls of a fresh client refuses them all DRAINING:
    each makes its 6 attempts (a retry goes to another instance, or a restarted one).
    Charged to the retry budget, the 50th refusal stopped the retries, and the calls
    still in flight failed though one retry would have reached a healthy instance.
    Test mode off, the waits faked: the burst meets the budget as a deployed client's
    calls do."""
    lc.set_testing(False)
    FakeBackoff(monkeypatch)

    async def scenario() -> Sequence[object]:
        engine = RecordingEngine(str(small_model))
        async with (
            serving(engine, config(small_model)) as s,
            lc.AsyncClient(s.target) as filler,
            lc.AsyncClient(s.target) as client,
        ):
            async with one_running(engine, filler):  # holds the drain open
                stopping = asyncio.ensure_future(s.server.stop(grace_s=60))
                await until(lambda: s.server.state is Lifecycle.DRAINING)
                calls = [client.infer({"input": rows(1)}) for _ in range(60)]
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
            await stopping
        return outcomes

    outcomes = asyncio.run(scenario())
    assert all(isinstance(outcome, lc.ServerDrainingError) for outcome in outcomes), outcomes
    errors = [outcome for outcome in outcomes if isinstance(outcome, lc.ServerDrainingError)]
    assert [error.attempts for error in errors] == [6] * 60
    assert all("(max_attempts)" in error.__notes__[0] for error in errors)


def test_successes_refill_the_retry_budget(small_model: Path) -> None:
    """12 tokens, 0.5 back per success, retries stop at 6 left. Refused throughout, one
    call makes its 6 attempts (6 left) and the next no retry (5 left); five successes
    later (7.5 left) a refused call retries once again (6.5 left), and no more (5.5)."""
    budget = lc.RetryBudget(max_tokens=12, token_ratio=0.5)

    async def refused_once_full(
        s: Serving, engine: RecordingEngine, filler: lc.AsyncClient, client: lc.AsyncClient
    ) -> lc.LaneFullError:
        async with one_running(engine, filler):
            queued = asyncio.ensure_future(filler.infer({"input": rows(1)}))
            await until(lambda: queued_rows(s) == 1)
            with pytest.raises(lc.LaneFullError) as caught:
                await client.infer({"input": rows(1)})
        await queued
        return caught.value

    async def scenario() -> list[lc.LaneFullError]:
        engine = RecordingEngine(str(small_model))
        async with (
            serving(engine, config(small_model, lanes=one_lane(capacity_rows=1))) as s,
            lc.AsyncClient(s.target) as filler,
            lc.AsyncClient(s.target, retry_budget=budget) as client,
        ):
            errors = [await refused_once_full(s, engine, filler, client)]
            errors.append(await refused_once_full(s, engine, filler, client))
            for _ in range(5):
                await client.infer({"input": rows(1)})
            errors.append(await refused_once_full(s, engine, filler, client))
        return errors

    errors = asyncio.run(scenario())
    assert [error.attempts for error in errors] == [6, 1, 2]
    assert "(max_attempts)" in errors[0].__notes__[0]
    assert "retry budget spent: " in errors[1].__notes__[0]
    assert "gave up after 2 attempt(s): retry budget spent: " in errors[2].__notes__[0]
    assert (
        "(5.5 of 12 tokens left; retries resume above 6, each success puts back 0.5"
        in (errors[2].__notes__[0])
    )


def test_a_sync_clients_threads_share_its_retry_budget() -> None:
    """A budget of 3 tokens (retries stop at 1.5 left), calls from two threads: the
    first call retries once (2 left), then stops (1 left); the second, on another
    thread, draws on the same tokens: no retry (0 left)."""
    outcomes: list[lc.LaneFullError] = []
    with (
        lane_full_server(retry_s=0.01) as target,
        lc.Client(target, retry_budget=lc.RetryBudget(max_tokens=3)) as client,
    ):

        def call() -> None:
            try:
                client.infer({"input": rows(1)})
            except lc.LaneFullError as error:
                outcomes.append(error)

        for _ in range(2):
            worker = threading.Thread(target=call)
            worker.start()
            worker.join(30)
    assert [error.attempts for error in outcomes] == [2, 1]
    assert all("retry budget spent" in error.__notes__[0] for error in outcomes)


def every_client_error() -> list[lc.LaneserveError]:
    """One of each of the client's error classes (its public tree)."""
    classes = [getattr(lc, name) for name in lc.__all__]
    return [
        cls("refused", code=grpc.StatusCode.UNKNOWN)
        for cls in classes
        if isinstance(cls, type) and issubclass(cls, lc.LaneserveError)
    ]


def test_the_overload_refusals_are_the_retryable_resource_refusals_exactly() -> None:
    """The refusals that say the server is overloaded, which the retry budget counts:
    LANE_FULL, MEMORY_PRESSURE, JOIN_LIMIT and a server busy at its call limits; not
    the other retryable ones (DRAINING, UNAVAILABLE, a network's CANCELLED)."""
    from laneserve.client._retry import is_overload  # noqa: PLC0415 - the private rule

    errors = every_client_error()
    overload = {type(error) for error in errors if is_overload(error)}
    assert overload == {
        lc.LaneFullError,
        lc.MemoryPressureError,
        lc.JoinLimitError,
        lc.ServerBusyError,
    }
    retryable = {type(error) for error in errors if error.retryable}
    assert retryable - overload == {
        lc.UnavailableError,
        lc.ServerDrainingError,
        lc.CallCancelledError,
    }


def test_only_overload_refusals_take_retry_tokens() -> None:
    """At the retry loop (its `attempt` raising the client's real errors): an invalid
    input takes no token, nor does a DRAINING, UNAVAILABLE or CANCELLED refusal; an
    overload refusal takes one, a negative pushback's (do not retry) too, as gRPC's
    retry throttling counts them, and a success puts one back."""
    from laneserve.client._retry import RetryTokens, call_with_retries  # noqa: PLC0415

    tokens = RetryTokens(lc.RetryBudget(max_tokens=10, token_ratio=1.0))
    raised: list[lc.LaneserveError] = []

    async def attempt(_timeout_s: float | None) -> str:
        if raised:
            raise raised.pop(0)
        return "ok"

    def run(policy: lc.RetryPolicy, *errors: lc.LaneserveError) -> str:
        raised.extend(errors)
        return asyncio.run(
            call_with_retries(attempt, policy=policy, timeout_s=None, what="Infer", budget=tokens)
        )

    with pytest.raises(lc.InvalidInputError):
        run(lc.RetryPolicy(), lc.InvalidInputError("bad shape"))
    assert tokens.tokens == 10, "not the server's health: no token"
    not_load = [
        lc.ServerDrainingError("draining", code=grpc.StatusCode.UNAVAILABLE, reason="DRAINING"),
        lc.UnavailableError("connection refused", code=grpc.StatusCode.UNAVAILABLE),
        lc.CallCancelledError("cut", code=grpc.StatusCode.CANCELLED),
    ]
    for error in not_load:
        with pytest.raises(type(error)):
            run(lc.NO_RETRIES, error)
    assert tokens.tokens == 10, "a server going, or a network cut: no token"
    assert run(lc.RetryPolicy(), lc.LaneFullError("lane full")) == "ok"
    assert tokens.tokens == 10, "the refusal took one, the success put it back"
    told_not_to = lc.MemoryPressureError("short of memory")
    told_not_to.no_retry = True
    with pytest.raises(lc.MemoryPressureError):
        run(lc.RetryPolicy(), told_not_to)
    assert tokens.tokens == 9
    with pytest.raises(lc.ServerBusyError):
        run(lc.NO_RETRIES, lc.ServerBusyError("busy"))
    assert tokens.tokens == 8, "a call that never retries still gauges the server"


def test_overload_refusals_across_calls_stop_at_the_budget_and_no_others() -> None:
    """10 tokens, retries stop at 5 left. Refused throughout: LANE_FULL retries 4 times
    (the 5th refusal leaves 5), then MEMORY_PRESSURE, a busy server and JOIN_LIMIT are not
    retried, each taking its token; DRAINING, UNAVAILABLE and CANCELLED then make all 6
    attempts on the spent budget, and leave it as it was. In test mode, as here."""
    from laneserve.client._retry import RetryTokens, call_with_retries  # noqa: PLC0415

    tokens = RetryTokens(lc.RetryBudget(max_tokens=10))

    def refused_throughout(error: lc.LaneserveError) -> lc.LaneserveError:
        async def attempt(_timeout_s: float | None) -> str:
            raise type(error)(error.message, code=error.code, reason=error.reason)

        with pytest.raises(type(error)) as caught:
            asyncio.run(
                call_with_retries(
                    attempt, policy=lc.RetryPolicy(), timeout_s=None, what="Infer", budget=tokens
                )
            )
        return caught.value

    assert lc.is_testing()
    overload = [
        lc.LaneFullError("full", code=grpc.StatusCode.RESOURCE_EXHAUSTED, reason="LANE_FULL"),
        lc.MemoryPressureError("short", reason="MEMORY_PRESSURE"),
        lc.ServerBusyError("busy", code=grpc.StatusCode.RESOURCE_EXHAUSTED),
        lc.JoinLimitError("joined", code=grpc.StatusCode.RESOURCE_EXHAUSTED, reason="JOIN_LIMIT"),
    ]
    stopped = [refused_throughout(error) for error in overload]
    assert [error.attempts for error in stopped] == [5, 1, 1, 1]
    assert all("retry budget spent" in error.__notes__[0] for error in stopped)
    assert tokens.tokens == 2
    not_load = [
        lc.ServerDrainingError("draining", code=grpc.StatusCode.UNAVAILABLE, reason="DRAINING"),
        lc.UnavailableError("connection refused", code=grpc.StatusCode.UNAVAILABLE),
        lc.CallCancelledError("cut", code=grpc.StatusCode.CANCELLED),
    ]
    retried = [refused_throughout(error) for error in not_load]
    assert [error.attempts for error in retried] == [6, 6, 6]
    assert all("(max_attempts)" in error.__notes__[0] for error in retried)
    assert tokens.tokens == 2, "not drawn on"


# ---- closing a client with calls in progress ----------------------------------------------


@contextlib.contextmanager
def lane_full_server(retry_s: float) -> Iterator[str]:
    """A server whose Infer answers every call LANE_FULL with a retry hint of `retry_s`
    (RetryInfo), as laneserve does."""

    def refuse(_request: pb.InferRequest, context: grpc.ServicerContext) -> pb.InferResponse:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(round(retry_s * 1e9))
        info = error_details_pb2.ErrorInfo(reason="LANE_FULL", domain="laneserve.dev")
        status = status_pb2.Status(
            code=code_pb2.RESOURCE_EXHAUSTED,
            message="lane full",
            details=[packed(info), packed(error_details_pb2.RetryInfo(retry_delay=delay))],
        )
        context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "lane full")

    infer = grpc.unary_unary_rpc_method_handler(
        refuse,
        request_deserializer=pb.InferRequest.FromString,
        response_serializer=pb.InferResponse.SerializeToString,
    )
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                pb.DESCRIPTOR.services_by_name["InferenceService"].full_name, {"Infer": infer}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait()


def retrying(caplog: pytest.LogCaptureFixture) -> bool:
    """Whether the client has logged that it waits to retry (it is in its backoff)."""
    return any("retry 1 in" in record.getMessage() for record in caplog.records)


def test_closing_the_sync_client_ends_another_threads_call_waiting_to_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server asks for an hour's pause; close() from another thread ends the call
    at once with ClientClosedError (it hung for good on the stopped loop)."""
    lc.set_testing(False)
    caplog.set_level(logging.DEBUG, logger="laneserve.client")
    outcome: list[object] = []
    with lane_full_server(retry_s=3600.0) as target:
        client = lc.Client(target)

        def call() -> None:
            try:
                outcome.append(client.infer({"input": rows(1)}))
            except BaseException as error:  # noqa: BLE001 - the outcome is the assertion
                outcome.append(error)

        worker = threading.Thread(target=call)
        worker.start()
        asyncio.run(until(lambda: retrying(caplog)))
        client.close()
        worker.join(10)
    assert not worker.is_alive(), "the call ended"
    (error,) = outcome
    assert isinstance(error, lc.ClientClosedError)
    assert isinstance(error.__cause__, lc.LaneFullError), "the last error is its cause"
    with pytest.raises(lc.ClientClosedError, match="the client is closed; open a new one"):
        client.infer({"input": rows(1)})


def test_closing_the_async_client_ends_a_call_waiting_to_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lc.set_testing(False)
    caplog.set_level(logging.DEBUG, logger="laneserve.client")

    async def scenario(target: str) -> BaseException | None:
        client = lc.AsyncClient(target)
        task = asyncio.ensure_future(client.infer({"input": rows(1)}))
        await until(lambda: retrying(caplog))
        await client.close()
        done, _ = await asyncio.wait([task], timeout=10)  # detects a hang (the pause is 1 h)
        assert done, "the call ended with the client"
        with pytest.raises(lc.ClientClosedError, match="the client is closed; open a new one"):
            await client.infer({"input": rows(1)})
        return task.exception()

    with lane_full_server(retry_s=3600.0) as target:
        error = asyncio.run(scenario(target))
    assert isinstance(error, lc.ClientClosedError)
    assert "closed while the call waited to retry (after 1 attempt(s))" in str(error)


def test_a_backoff_that_overruns_the_deadline_raises_the_last_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a busy machine the wait before a retry can end after the deadline: no attempt
    with no time left (it would fail DEADLINE_EXCEEDED and hide the real error)."""
    from laneserve.client._retry import call_with_retries  # noqa: PLC0415 - its clock is faked

    now = [100.0]

    async def overrunning_sleep(_delay_s: float) -> None:
        now[0] += 0.5  # the loop was busy: the wait ends far later than asked

    clock = types.SimpleNamespace(monotonic=lambda: now[0])
    monkeypatch.setattr("laneserve.client._retry.time", clock)
    monkeypatch.setattr(
        "laneserve.client._retry.asyncio", types.SimpleNamespace(sleep=overrunning_sleep)
    )
    attempts: list[float | None] = []

    async def attempt(timeout_s: float | None) -> None:
        attempts.append(timeout_s)
        now[0] += 0.1
        raise lc.LaneFullError("lane full", code=grpc.StatusCode.RESOURCE_EXHAUSTED)

    policy = lc.RetryPolicy(initial_backoff_s=0.01, jitter=0.0)
    with pytest.raises(lc.LaneFullError) as caught:
        asyncio.run(call_with_retries(attempt, policy=policy, timeout_s=1.0, what="Infer"))
    assert attempts == [pytest.approx(1.0), pytest.approx(0.4)], "no attempt with no time left"
    assert "the next would start after the deadline (the wait overran it)" in "".join(
        caught.value.__notes__
    )


def test_test_mode_keeps_the_deadline_decision() -> None:
    """The server asks for 10 s; the call has 5 s: no retry, in test mode too (it only
    skips the waiting)."""
    with lane_full_server(retry_s=10.0) as target, lc.Client(target) as client:
        with pytest.raises(lc.LaneFullError) as testing:
            client.infer({"input": rows(1)}, timeout=5.0)
        lc.set_testing(False)
        with pytest.raises(lc.LaneFullError) as real:
            client.infer({"input": rows(1)}, timeout=5.0)
    assert real.value.attempts == testing.value.attempts == 1


# ---- helpers ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def one_running(engine: RecordingEngine, client: lc.AsyncClient) -> AsyncIterator[None]:
    """A 1-row request held in the session while the body runs, released and answered
    after it: the server is busy, so what the body sends queues or is refused. The
    batches that started before are forgotten (`hold_next`): counted, a second use went on
    before its request was held, and what the body sent ran beside it or waited on it."""
    engine.hold_next()
    running = asyncio.ensure_future(client.infer({"input": rows(1)}))
    try:
        await asyncio.to_thread(engine.entered.acquire)
        yield
    finally:
        engine.release()
        await running


@contextlib.asynccontextmanager
async def client_for(
    engine: Engine, server_config: ServerConfig, **options: Any
) -> AsyncIterator[tuple[Serving, lc.AsyncClient]]:
    """A served server and an AsyncClient to it (`options` go to the client)."""
    async with serving(engine, server_config) as s, lc.AsyncClient(s.target, **options) as client:
        yield s, client


@contextlib.asynccontextmanager
async def an_address_restarted_smaller(
    model: Path,
) -> AsyncIterator[tuple[Callable[[], None], str]]:
    """An address (a relay's) that leads to a server of the default message limit, and
    `restart`: from then on the address leads to one whose limit is SMALLER_LIMIT, the
    open connections cut."""
    async with (
        serving(RecordingEngine(str(model)), config(model)) as old,
        serving(RecordingEngine(str(model)), config(model, max_message_bytes=SMALLER_LIMIT)) as new,
    ):
        proxy = TcpProxy(old.server.port)
        target = await proxy.start()

        def restart() -> None:
            proxy.retarget(new.server.port)
            proxy.sever()

        try:
            yield restart, target
        finally:
            await proxy.close()


# A fake server's servicer context (grpc.aio's, any messages).
AioContext = grpc.aio.ServicerContext[Any, Any]
# laneserve.v1's service, as a fake server registers its methods.
INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name


@contextlib.asynccontextmanager
async def fake_server(
    handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]],
) -> AsyncIterator[str]:
    """A real grpc.aio server on 127.0.0.1:0 whose laneserve.v1 methods are `handlers`
    (the others UNIMPLEMENTED): a peer that is not laneserve. Yields its target."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(INFERENCE_SERVICE, dict(handlers)),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def unary(
    method: Callable[[Any, AioContext], Awaitable[Message]], request_type: type[Message]
) -> grpc.RpcMethodHandler[Any, Any]:
    """A fake server's unary method, taking a `request_type`."""
    return grpc.unary_unary_rpc_method_handler(
        method, request_deserializer=request_type.FromString, response_serializer=serialized
    )


def serialized(message: Message) -> bytes:
    return message.SerializeToString()


def bidirectional(
    method: Callable[[AsyncIterator[pb.InferRequest], AioContext], AsyncIterator[Any]],
) -> grpc.RpcMethodHandler[Any, Any]:
    """A fake server's InferStream."""
    return grpc.stream_stream_rpc_method_handler(
        method,
        request_deserializer=pb.InferRequest.FromString,
        response_serializer=serialized,
    )


class CountedReads(Mapping[str, npt.NDArray[Any]]):
    """A mapping of arrays that counts reads of them (an NpzFile decompresses at each)."""

    def __init__(self, arrays: Mapping[str, npt.NDArray[Any]]) -> None:
        self._arrays = arrays
        self.reads = 0

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        self.reads += 1
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def one_lane(*, capacity_rows: int, timeout_ms: int = 60_000) -> tuple[LaneConfig, ...]:
    return (LaneConfig("standard", capacity_rows, timeout_ms, max_wait_ms=0, min_share=0.0),)


class Recorder(grpc.aio.UnaryUnaryClientInterceptor):
    """Records each attempt's method and metadata (and request_id, when given a list; its
    gRPC timeout in seconds, None for none, when given `timeouts`)."""

    def __init__(
        self,
        seen: list[tuple[str, tuple[tuple[str, str], ...]]],
        ids: list[str] | None = None,
        timeouts: list[float | None] | None = None,
    ) -> None:
        self.seen = seen
        self.ids = ids
        self.timeouts = timeouts

    async def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        method: Any = client_call_details.method  # bytes at run time, str in the stubs
        name = method.decode() if isinstance(method, bytes) else str(method)
        metadata = tuple((str(k), str(v)) for k, v in client_call_details.metadata or ())
        self.seen.append((name, metadata))
        if self.ids is not None and isinstance(request, pb.InferRequest):
            self.ids.append(request.request_id)
        if self.timeouts is not None:
            self.timeouts.append(client_call_details.timeout)
        return await continuation(client_call_details, request)


class FakeBackoff:
    """The unary retry loop's clock and its waits before a retry, by hand: its time moves
    only by those waits, each exactly as long as asked, and wait number `held_at`
    (1-based) lasts until `go` is set. The client offers no clock to inject, so its retry
    module's `time` and `closed_within` are replaced; test mode must be off (it asks for
    waits of 0)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, held_at: int | None = None) -> None:
        self.now_s = 1000.0
        self.waits_s: list[float] = []
        self.held_at = held_at
        self.go = asyncio.Event()
        clock = types.SimpleNamespace(monotonic=lambda: self.now_s)
        monkeypatch.setattr("laneserve.client._retry.time", clock)
        monkeypatch.setattr("laneserve.client._retry.closed_within", self.wait)

    async def wait(self, _closed: asyncio.Event | None, delay_s: float) -> bool:
        """`closed_within`: False, the client still open."""
        self.waits_s.append(delay_s)
        if len(self.waits_s) == self.held_at:
            await self.go.wait()
        self.now_s += delay_s
        return False


def packed(message: error_details_pb2.ErrorInfo | error_details_pb2.RetryInfo) -> any_pb2.Any:
    result = any_pb2.Any()
    result.Pack(message)
    return result


async def rejected(client: lc.AsyncClient) -> int:
    stats = await client.stats()
    return sum(sum(lane.rejected.values()) for lane in stats.lanes)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Polls for a state the server reaches (not a timing assumption)."""
    give_up = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.002)


def test_every_server_reason_has_a_client_error_class() -> None:
    """A reason the server can send this client must map to its own typed client error.
    MODEL_NOT_FOUND is KServe v2's alone (inference.GRPCInferenceService names a model;
    laneserve.v1, the one service this client calls, does not), and so are the refusals
    of its repository, shared memory and settings methods."""
    from laneserve.client import _errors  # noqa: PLC0415 - the private table under test
    from laneserve.server import errors as server_errors  # noqa: PLC0415

    kserve_only = {
        server_errors.ModelNotFoundError,
        server_errors.RegionNotFoundError,
        server_errors.RegionExistsError,
        server_errors.RegionLimitError,
        server_errors.SharedMemoryRefusedError,
        server_errors.SettingsRefusedError,
        server_errors.TracingOffError,
        server_errors.UnsupportedError,
    }
    reasons = {
        cls.reason
        for cls in vars(server_errors).values()
        if isinstance(cls, type)
        and issubclass(cls, server_errors.LaneserveError)
        and cls is not server_errors.LaneserveError
        and cls not in kserve_only
    }
    assert reasons <= set(_errors._BY_REASON), reasons - set(_errors._BY_REASON)
    assert {cls.reason for cls in kserve_only}.isdisjoint(_errors._BY_REASON)


def test_a_tensor_of_a_data_type_this_client_does_not_know_leaves_the_rest_of_the_model() -> None:
    """A newer server may describe a tensor of a data type added after this client: the
    whole description failed (ValueError), and with it a bulk job, which asks for the
    lanes' capacity. Now only that tensor's dtype is unknown, and named."""
    newer = pb.GetModelResponse(
        inputs=[pb.TensorSpec(name="x", dtype=pb.DATA_TYPE_FLOAT32, shape=[-1, 3])],
        outputs=[pb.TensorSpec(name="y", dtype=pb.DataType.ValueType(99), shape=[-1, 3])],
        lanes=[pb.LaneSpec(name="bulk", capacity_rows=64, is_default=True)],
    )
    # As it arrives: proto3 enums keep a value the schema does not name.
    model = lc.ModelInfo.from_proto(pb.GetModelResponse.FromString(newer.SerializeToString()))
    assert model.inputs == (lc.TensorInfo("x", np.dtype(np.float32), (None, 3), "float32"),)
    assert model.outputs == (lc.TensorInfo("y", None, (None, 3), "unknown data type 99"),)
    assert model.default_lane == "bulk"


def test_the_model_names_each_dimension_and_a_server_older_than_that_names_none(
    tmp_path: Path,
) -> None:
    """GetModel said each dimension's size alone, so a client could not tell that
    a[N, K] and b[N, K] must agree on K (the server refuses them otherwise): it names
    each now, None for a fixed or unnamed one (-1 reads as unnamed, as in the engine)."""
    path = tmp_path / "shared_k.onnx"
    graph = helper.make_graph(
        [helper.make_node("Identity", ["a"], ["y"]), helper.make_node("Identity", ["b"], ["z"])],
        "shared_k",
        [
            helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["N", "K", 2]),
            helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, ["N", "K", None]),
        ],
        [
            helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", "K", 2]),
            helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["N", "K", -1]),
        ],
    )
    save_model(path, graph, check=False)

    async def scenario() -> None:
        async with client_for(Engine(str(path), device="cpu"), config(path)) as (_s, client):
            info = await client.model()
        assert [(spec.name, spec.shape, spec.dim_names) for spec in info.inputs] == [
            ("a", (None, None, 2), ("N", "K", None)),
            ("b", (None, None, None), ("N", "K", None)),
        ]
        assert [spec.dim_names for spec in info.outputs] == [("N", "K", None)] * 2

    asyncio.run(scenario())
    older = pb.GetModelResponse(
        inputs=[pb.TensorSpec(name="a", dtype=pb.DATA_TYPE_FLOAT32, shape=[-1, -1, 2])]
    )
    assert lc.ModelInfo.from_proto(older).inputs[0].dim_names == (), "unknown, not unnamed"


def test_model_info_is_hashable_and_still_compares_its_custom_metadata() -> None:
    """ModelInfo, frozen and all tuples, was hashable until custom_metadata (a dict)
    joined it; the hash leaves that field out, equality does not."""

    def info(metadata: dict[str, str]) -> lc.ModelInfo:
        message = pb.GetModelResponse(model_path="m.onnx", custom_metadata=metadata)
        return lc.ModelInfo.from_proto(message)

    first, same, other = info({"k": "1"}), info({"k": "1"}), info({"k": "2"})
    assert hash(first) == hash(same)
    assert first == same != other
    assert len({first, same, other}) == 2


def test_model_info_names_each_inputs_probed_row_shape_in_the_models_order(
    tmp_path: Path,
) -> None:
    """The server's bytes per row hold for rows of the probe's shapes, which no client
    could see (a text model's rows probed at S = 1 read 214 B where 512 took 535 KiB):
    ModelInfo carries them as (name, sizes after the row axis) pairs, in the model's
    input order, and stays hashable. A server older than the field gives none."""
    path = tmp_path / "tokens.onnx"
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["tokens"], ["tokens_out"]),
            helper.make_node("Identity", ["scores"], ["scores_out"]),
        ],
        "tokens",
        [
            helper.make_tensor_value_info("tokens", onnx.TensorProto.INT64, ["N", "S"]),
            helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 3]),
        ],
        [
            helper.make_tensor_value_info("tokens_out", onnx.TensorProto.INT64, ["N", "S"]),
            helper.make_tensor_value_info("scores_out", onnx.TensorProto.FLOAT, ["N", 3]),
        ],
    )
    save_model(path, graph, check=False)

    async def model_info(probe_shapes: dict[str, tuple[int, ...]]) -> lc.ModelInfo:
        engine = Engine(
            str(path), device="cpu", probe_shapes=probe_shapes, estimate=no_static_estimate
        )
        async with client_for(engine, config(path, probe_shapes=probe_shapes)) as (_s, client):
            return await client.model()

    at_1 = asyncio.run(model_info({}))
    assert at_1.probe_shapes == (("tokens", (1,)), ("scores", (3,)))
    given = asyncio.run(model_info({"tokens": (128,)}))
    assert given.probe_shapes == (("tokens", (128,)), ("scores", (3,)))
    assert len({at_1, given}) == 2  # hashable; the two differ in their shapes
    older = pb.GetModelResponse(
        inputs=[pb.TensorSpec(name="tokens", dtype=pb.DATA_TYPE_INT64, shape=[-1, -1])]
    )
    assert lc.ModelInfo.from_proto(older).probe_shapes == ()


def test_channels_cap_grpcs_reconnect_backoff_at_two_seconds() -> None:
    """gRPC's reconnect backoff grows to 2 minutes: a server back 25 s after a crash was
    not tried again before a bulk job's 30 s resume window ran out, and the job gave up
    with the server up (a review). The client's channels cap it at 2 s; a caller's
    `options` replace the cap."""
    options = dict(lc_channel.channel_options(None, 1 << 20, []))
    assert options["grpc.max_reconnect_backoff_ms"] == 2_000
    mine = dict(lc_channel.channel_options(None, 1 << 20, [("grpc.max_reconnect_backoff_ms", 500)]))
    assert mine["grpc.max_reconnect_backoff_ms"] == 500


def test_a_calls_request_is_built_on_its_own_thread_within_its_timeout(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: 61 MB of input took 221 ms to encode, and `timeout=0.005` was raised
    after 361 ms, the building outside the deadline; and the sync Client built every
    thread's request on its one thread: small calls of other threads waited up to 441 ms
    behind large ones. The request is built on the calling thread, inside the timeout: a
    build that outlasts it is the call's DeadlineExceededError, nothing sent."""
    from laneserve.client import _request  # noqa: PLC0415 - the encoder watched

    encode = _request.encode_inputs
    built_on: list[str] = []
    slow = threading.Event()

    def watched(inputs: Any, request_id: str) -> Any:
        built_on.append(threading.current_thread().name)
        if slow.is_set():
            time.sleep(0.05)  # a build longer than the call's timeout, whatever the machine
        return encode(inputs, request_id)

    monkeypatch.setattr("laneserve.client._aio.encode_inputs", watched)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:

            def calls() -> None:
                threading.current_thread().name = "caller"
                with lc.Client(s.target) as client:
                    assert client.infer({"input": rows(1)}, timeout=10)["output"].shape == (1, 10)
                    slow.set()
                    with pytest.raises(lc.DeadlineExceededError) as caught:
                        client.infer({"input": rows(1)}, timeout=0.02)
                    assert "before its first attempt" in caught.value.message
                    assert caught.value.attempts == 0

            await asyncio.to_thread(calls)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            admitted = sum(lane.admitted for lane in stats.lanes)
            assert admitted == 1, "the late one was not sent"

    asyncio.run(scenario())
    assert built_on == ["caller", "caller"]


def test_a_detailed_answer_has_the_request_id_and_the_servers_timing(small_model: Path) -> None:
    """`infer` gives the outputs alone: a service could not log the server's queue and run
    times, its batch or lane, or the id the client chose, beside its own latency without
    the raw stub (a review). `infer_detailed` gives them, on both clients."""
    x = rows(2)

    async def scenario() -> tuple[lc.InferAnswer, lc.InferAnswer]:
        async with client_for(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            client,
        ):
            mine = await client.infer_detailed({"input": x}, lane="interactive", request_id="q1")

            def sync_call() -> lc.InferAnswer:
                with lc.Client(s.target) as sync_client:
                    return sync_client.infer_detailed({"input": x})

            return mine, await asyncio.to_thread(sync_call)

    mine, chosen = asyncio.run(scenario())
    assert mine.request_id == "q1"
    assert mine.timing.lane == "interactive"
    assert chosen.timing.lane == "standard"  # the server's default lane
    assert len(chosen.request_id) == 32, "the random id the client chose"
    for answer in (mine, chosen):
        assert answer.outputs["output"].shape == (2, 10)
        assert answer.timing.batch_size >= 2
        assert answer.timing.infer_us > 0
    assert "outputs" not in repr(mine)
