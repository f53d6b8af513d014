"""The server over real gRPC on loopback with a real ONNX Runtime session."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import importlib.metadata
import logging
import os
import random
import resource
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio._server as grpc_aio_server
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf import descriptor_pb2
from grpc_channelz.v1 import channelz_pb2, channelz_pb2_grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from onnx import external_data_helper, numpy_helper
from opentelemetry.sdk.trace import TracerProvider

from laneserve.client import CallCancelledError, error_from_rpc
from laneserve.client.tensors import encode_tensor
from laneserve.server import (
    Engine,
    LaneConfig,
    LaneServer,
    app,
    grpc_accept,
    grpc_methods,
    service,
)
from laneserve.server import app as app_module
from laneserve.server.addresses import check_ports_free
from laneserve.server.clock import ManualClock
from laneserve.server.codec import decode_inputs
from laneserve.server.config import DEFAULT_LANES, ConfigError
from laneserve.server.engine import no_static_estimate
from laneserve.server.errors import (
    EngineStartError,
    LaneFullError,
    LaneserveError,
    SessionBrokenError,
)
from laneserve.server.grpc_calls import GrpcCalls
from laneserve.server.idempotency import fingerprint
from laneserve.server.items import Batch, BatchResult, RowsWanted
from laneserve.server.lifecycle import Lifecycle
from laneserve.server.model_identity import (
    CUSTOM_METADATA_MAX_BYTES,
    DESCRIPTION_MAX_BYTES,
    model_files,
    write_varint,
)
from laneserve.server.stats import WINDOW_S
from laneserve.server.telemetry import Telemetry
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import (
    RecordingEngine,
    ServerProcess,
    Serving,
    config,
    health_status,
    item_reason,
    one_running_and_queued,
    output,
    queued_never_ran_as_the_drain_ended,
    queued_rows,
    request,
    rich_status,
    rows,
    save_model,
    serving,
    until,
    until_stats,
)


def test_outputs_equal_direct_session_run(
    demo_model: Path, reference: ort.InferenceSession
) -> None:
    """Single rows, multi-row requests and requests larger than the cap, from concurrent
    callers in every lane, come back equal to a direct session.run on the same rows."""

    async def scenario() -> None:
        engine = RecordingEngine(str(demo_model))
        async with serving(engine, config(demo_model, max_batch_size=32)) as s:
            sizes = [1, 1, 3, 7, 32, 33, 100, 1, 5, 64] * 4
            lanes = ["interactive", "standard", "bulk", ""]
            inputs = [rows(n, seed=i) for i, n in enumerate(sizes)]
            calls = [
                s.stub.Infer(request(x, request_id=f"r{i}", lane=lanes[i % 4]))
                for i, x in enumerate(inputs)
            ]
            responses = await asyncio.gather(*calls)
        for i, (x, response) in enumerate(zip(inputs, responses, strict=True)):
            assert response.request_id == f"r{i}"
            expected = reference.run(None, {"input": x})[0]
            np.testing.assert_allclose(output(response), expected, rtol=1e-4, atol=1e-5)
            assert response.timing.lane == (lanes[i % 4] or "standard")
        assert max(engine.batches) <= 32, "the batch cap bounds every batch"
        assert sum(engine.batches) == sum(sizes), "every row ran exactly once"

    asyncio.run(scenario())


def test_batches_form_across_callers(demo_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(demo_model))
        async with serving(engine, config(demo_model, max_batch_size=64)) as s:
            engine.hold()
            first = asyncio.ensure_future(s.stub.Infer(request(rows(1))))
            await asyncio.to_thread(engine.entered.acquire)  # the session is busy
            rest = [
                asyncio.ensure_future(s.stub.Infer(request(rows(1, seed=i)))) for i in range(40)
            ]
            await until(lambda: queued_rows(s) == 40)
            engine.release()
            await asyncio.gather(first, *rest)
            assert engine.batches == [1, 40], "work queued while busy goes out as one batch"
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert stats.batches == 2
            assert stats.mean_batch_size == pytest.approx(20.5)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda r: setattr(r.inputs[0], "name", "nope"), "unknown input 'nope'"),
        (
            lambda r: r.inputs[0].CopyFrom(encode_tensor("input", rows(2).astype(np.float64))),
            "dtype float64; expected float32",
        ),
        (
            lambda r: r.inputs[0].CopyFrom(encode_tensor("input", rows(2)[:, :100])),
            "shape [2, 100]",
        ),
        (lambda r: setattr(r.inputs[0], "data", r.inputs[0].data[:-4]), "input"),
        (lambda r: setattr(r, "lane", "vip"), "unknown lane 'vip'"),
        (lambda r: r.ClearField("inputs"), "missing input(s) 'input'"),
        (lambda r: r.output_names.append("logits"), "unknown output(s) ['logits']"),
    ],
    ids=["unknown-input", "dtype", "shape", "data-length", "lane", "missing", "output"],
)
def test_bad_input_is_invalid_argument_naming_what_was_expected(
    small_model: Path, mutate: object, fragment: str
) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            bad = request(rows(2))
            mutate(bad)  # type: ignore[operator]
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(bad)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert fragment in (caught.value.details() or "")
            assert rich_status(caught.value)[0] == "INVALID_INPUT"
            # The server keeps serving.
            assert output(await s.stub.Infer(request(rows(1)))).shape == (1, 10)

    asyncio.run(scenario())


@pytest.mark.parametrize("spans", [False, True], ids=["untraced", "traced"])
def test_a_refused_call_leaves_no_reference_cycle_holding_its_request(
    small_model: Path, spans: bool
) -> None:
    """gRPC keeps an abort's AbortError in a reference cycle with every frame it passed
    through, freed only by a full garbage collection, and those frames held the refused
    request (its bytes, its decoded inputs): ~80 MiB per burst of 24 large refusals,
    enough to close every lane at the host memory watermark. Refusals (a full lane, more
    rows than the lane, an unknown lane, an undecodable GetStats) still end trailers
    only, but no frame left to the garbage collector holds a request or its inputs, with
    the server's spans and without."""

    async def scenario() -> list[str]:
        lanes = (
            LaneConfig("standard", capacity_rows=4, timeout_ms=60_000, max_wait_ms=0, min_share=0),
        )
        engine = RecordingEngine(str(small_model))
        server_config = config(small_model, lanes=lanes)
        telemetry = (
            Telemetry(
                lanes=lanes,
                providers=engine.providers,
                max_batch_size=server_config.max_batch_size,
                tracer_provider=TracerProvider(shutdown_on_exit=False),
            )
            if spans
            else None
        )
        async with serving(engine, server_config, telemetry=telemetry) as s:
            gc.collect()
            engine.hold()
            held = asyncio.ensure_future(s.stub.Infer(request(rows(4))))
            await asyncio.to_thread(engine.entered.acquire)
            queued = asyncio.ensure_future(s.stub.Infer(request(rows(4))))
            await until(lambda: queued_rows(s, "standard") == 4)
            # Lane full, more rows than the lane holds, unknown lane; at once, as a burst.
            refusals = [request(rows(2)), request(rows(8)), request(rows(1), lane="vip")] * 8
            answers = await asyncio.gather(
                *(s.stub.Infer(refused) for refused in refusals), return_exceptions=True
            )
            assert all(isinstance(answer, grpc.aio.AioRpcError) for answer in answers)
            with pytest.raises(grpc.aio.AioRpcError):
                await s.channel.unary_unary(
                    "/laneserve.v1.InferenceService/GetStats",
                    request_serializer=lambda raw: raw,
                    response_deserializer=pb.GetStatsResponse.FromString,
                )(b"\xff\xff")
            found = _frames_holding_requests()
            engine.release()
            await asyncio.gather(held, queued)
        return found

    gc.disable()
    try:
        assert asyncio.run(scenario()) == []
    finally:
        gc.enable()


def test_refused_stream_items_leave_no_reference_cycle_holding_their_requests(
    small_model: Path,
) -> None:
    """A stream item answered with an error through the idempotency ledger (here
    EXPIRED_IN_QUEUE) kept its request and decoded inputs in a cycle with the ledger's
    waiter future that raised the error, freed only by a full garbage collection (15 MB
    for 16 items of 1 MB): the unary path had been fixed alone."""
    lanes = (
        LaneConfig(
            "standard", capacity_rows=100_000, timeout_ms=60_000, max_wait_ms=0, min_share=0
        ),
    )

    async def items() -> AsyncIterator[pb.InferRequest]:
        for index in range(8):
            yield request(rows(64, start=index), request_id=f"e{index}", timeout_ms=50)
            yield request(rows(1), request_id=f"u{index}", lane="vip")

    async def scenario() -> tuple[list[str], list[str]]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, lanes=lanes)) as s:
            gc.collect()
            engine.hold()
            held = asyncio.ensure_future(s.stub.Infer(request(rows(1))))
            await asyncio.to_thread(engine.entered.acquire)
            answers = [answer async for answer in s.stub.InferStream(items(), timeout=30)]
            found = _frames_holding_requests()
            engine.release()
            await held
        return sorted({item_reason(answer) for answer in answers}), found

    gc.disable()
    try:
        reasons, found = asyncio.run(scenario())
    finally:
        gc.enable()
    assert reasons == ["EXPIRED_IN_QUEUE", "INVALID_INPUT"]
    assert found == []


def _frames_holding_requests() -> list[str]:
    """The frames a full garbage collection finds that still hold a request or inputs: a
    local of those names, or of any name holding a request message (Infer's `read`, the
    request itself, held 55 MB per refused 54 MiB call, and escaped a search by names)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return [
            f"{thing.f_code.co_name}: {sorted(held)}"
            for thing in gc.garbage
            if type(thing).__name__ == "frame"
            and (
                held := {
                    name
                    for name, value in thing.f_locals.items()
                    if name in {"request", "inputs", "requests"}
                    or isinstance(value, pb.InferRequest)
                }
            )
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_a_refusal_is_trailers_only(small_model: Path) -> None:
    """A refused unary call carries no message before its status (a handler that set its
    status and returned sent an empty one, which a JSON transcoder answers as a body)."""

    async def scenario() -> tuple[list[bytes], grpc.StatusCode]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            # The unary method read as a stream: every message on the wire is seen.
            call = s.channel.unary_stream(
                "/laneserve.v1.InferenceService/Infer",
                request_serializer=pb.InferRequest.SerializeToString,
                response_deserializer=lambda raw: raw,
            )(request(rows(1), lane="vip"))
            messages = [message async for message in _read_until_status(call)]
            return messages, await call.code()

    messages, code = asyncio.run(scenario())
    assert messages == []
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def _read_until_status(call: Any) -> AsyncIterator[bytes]:
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for message in call:
            yield message


def test_message_over_the_limit_is_resource_exhausted(small_model: Path) -> None:
    async def scenario() -> None:
        async with serving(
            RecordingEngine(str(small_model)), config(small_model, max_message_bytes=64 * 1024)
        ) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(64)))  # 128 KiB of floats
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: setattr(r.inputs[0], "name", "é" * 8000),
        lambda r: setattr(r, "lane", "x" * 8000),
        # One name: more names than the model's outputs are refused on their count alone.
        lambda r: r.output_names.append("o" * 8000),
    ],
    ids=["input-name", "lane", "output-name"],
)
def test_an_error_quoting_a_long_client_string_is_still_that_error(
    small_model: Path, mutate: object
) -> None:
    """Messages quote what the client sent. Uncut, a status of several KiB (sent twice
    in the trailers) passed gRPC's metadata limit, and the client got RESOURCE_EXHAUSTED
    "received metadata size exceeds limit" instead of INVALID_ARGUMENT, some of the time."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            bad = request(rows(2))
            mutate(bad)  # type: ignore[operator]
            for _ in range(5):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await s.stub.Infer(bad, timeout=10)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert rich_status(caught.value)[0] == "INVALID_INPUT"
                details = caught.value.details() or ""
                assert "... (message cut: " in details
                assert len(details.encode()) <= 1024
                # Cut in the middle: what was expected, at the end, survives (cut at the
                # end, the long value quoted before it took its place).
                assert "expected" in details.split("(message cut: ")[1], details

    asyncio.run(scenario())


def raw_infer(s: Serving) -> grpc.aio.UnaryUnaryMultiCallable[bytes, pb.InferResponse]:
    """Infer on `s`, sent as the bytes given: a message no client library would encode."""
    return s.channel.unary_unary(
        "/laneserve.v1.InferenceService/Infer",
        request_serializer=bytes,
        response_deserializer=pb.InferResponse.FromString,
    )


def raw_call(s: Serving, method: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
    """The service's unary `method` on `s`, its request and answer as bytes."""
    return s.channel.unary_unary(
        f"/laneserve.v1.InferenceService/{method}",
        request_serializer=bytes,
        response_deserializer=bytes,
    )


def test_bytes_that_are_not_an_infer_request_are_invalid_argument(small_model: Path) -> None:
    """A message that does not parse (another schema, truncated, invalid UTF-8 in a string
    field) was gRPC's UNKNOWN "Unexpected DecodeError", and ended a whole InferStream; it
    is INVALID_ARGUMENT, and in a stream one item's error while the stream goes on."""
    garbage = b"\x0a\xff\x01"  # field 1, length-delimited, 255 bytes announced, 1 sent

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            infer = raw_infer(s)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await infer(garbage, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(refused.value)[0] == "INVALID_INPUT"
            assert "does not parse as a laneserve.v1.InferRequest" in (
                refused.value.details() or ""
            )
            # As large as a request carrying 64 KiB besides its data: the bytes that do
            # not parse are named, not as fields this server does not know.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await infer(b"\x0a\x80\x80\x08" + bytes(70_000), timeout=10)
            assert rich_status(refused.value)[0] == "INVALID_INPUT"
            assert "does not parse as a laneserve.v1.InferRequest" in (
                refused.value.details() or ""
            )
            stream = s.channel.stream_stream(
                "/laneserve.v1.InferenceService/InferStream",
                request_serializer=bytes,
                response_deserializer=pb.InferStreamResponse.FromString,
            )
            good = [request(rows(1), request_id=name).SerializeToString() for name in ("a", "b")]
            call = stream(iter([good[0], garbage, good[1]]), timeout=10)
            answers = {answer.request_id: answer async for answer in call}
            assert await call.code() == grpc.StatusCode.OK
        assert answers["a"].WhichOneof("result") == answers["b"].WhichOneof("result") == "response"
        assert answers[""].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]

    asyncio.run(scenario())


def _bytes_field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field, as any encoder writes it."""
    return write_varint(number << 3 | 2) + write_varint(len(value)) + value


def test_a_request_carrying_over_64_kib_besides_its_data_is_refused(small_model: Path) -> None:
    """A one-row request padded with 8 MiB in a field the server does not know (valid
    protobuf, kept by the parser) was admitted as one row, and its whole message stayed in
    memory while it queued: lanes count rows, so 60 of them held +1 GiB at depth 60/2048.
    Bytes besides the tensors' data and one copy of each known field (unknown fields, a
    field sent twice) are bounded; a newer client's few unknown bytes are still served."""
    one_row = request(rows(1), request_id="p").SerializeToString()
    tensor = encode_tensor("input", rows(1)).SerializeToString()
    padded = {
        "request": one_row + _bytes_field(1000, b"x" * (64 << 10)),
        "tensor": _bytes_field(1, b"t") + _bytes_field(4, tensor + _bytes_field(9, b"x" * 70_000)),
        # The last lane sent counts: the first stays in the message all the same.
        "lane twice": _bytes_field(2, b"L" * 70_000) + _bytes_field(2, b"standard") + one_row,
    }

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            infer = raw_infer(s)
            served = await infer(one_row + _bytes_field(1000, b"x" * 1024), timeout=10)
            assert output(served).shape == (1, 10), "a few unknown bytes are served"
            for what, message in padded.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await infer(message, timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
                assert rich_status(refused.value)[0] == "INVALID_INPUT"
                details = refused.value.details() or ""
                assert "more than 65536 bytes besides its tensors' data" in details, details
            stream = s.channel.stream_stream(
                "/laneserve.v1.InferenceService/InferStream",
                request_serializer=bytes,
                response_deserializer=pb.InferStreamResponse.FromString,
            )
            good = [request(rows(1), request_id=name).SerializeToString() for name in ("a", "b")]
            call = stream(iter([padded["request"], good[0], padded["tensor"], good[1]]), timeout=10)
            answers = {answer.request_id: answer async for answer in call}
            assert await call.code() == grpc.StatusCode.OK, "the stream goes on"
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        # Each refusal is tagged with its item's request_id ("p", "t"), as the stream's other
        # refusals are: it was answered with none, and its client could not tell which.
        assert sorted(answers) == ["a", "b", "p", "t"]
        assert answers["a"].WhichOneof("result") == answers["b"].WhichOneof("result") == "response"
        for refused_id in ("p", "t"):
            error = answers[refused_id].error
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], refused_id
            assert "more than 65536 bytes besides its tensors' data" in error.message
        refusals = {lane.name: dict(lane.rejected) for lane in stats.lanes}
        assert refusals["standard"] == {"INVALID_INPUT": 5}  # the default lane: unread

    asyncio.run(scenario())


def test_an_oversized_request_keeps_only_its_id_within_the_id_limit() -> None:
    """Refused unread, an oversized request is kept as its request_id alone (nothing of its
    message); one over MAX_REQUEST_ID_BYTES is not echoed, as no stream answer echoes it."""
    padding = _bytes_field(1000, b"x" * (64 << 10))
    for request_id, kept in (("p", "p"), ("i" * grpc_methods.MAX_REQUEST_ID_BYTES + "x", "")):
        data = request(rows(1), request_id=request_id).SerializeToString() + padding
        oversized = grpc_methods.read_infer_request(data, max_inputs=1, max_outputs=1)
        assert oversized == grpc_methods.OversizedRequest(kept)


@pytest.mark.parametrize("name", ["float16", "int8", "uint8", "bool"])
def test_data_mislabelled_a_smaller_dtype_is_told_its_dtype_however_much_longer(
    small_model: Path, name: str
) -> None:
    """80 rows of 512 float32 labelled float16 are 80 KiB longer than their dtype and
    shape size: over MAX_EXTRA_BYTES, they were refused unread as "data longer than its
    shape", where a few rows are told their dtype. The dtype is named first either way,
    to a call and to a stream item (tagged with its id)."""
    datatype = pb.DataType.Value(f"DATA_TYPE_{name.upper()}")
    mislabelled = pb.Tensor(name="input", dtype=datatype, shape=[80, 512])
    mislabelled.data = rows(80).tobytes()
    refusal = (
        f"input 'input' has dtype {name}; expected float32 with shape [-1, 512], -1 = any size"
    )

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(pb.InferRequest(inputs=[mislabelled]), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(caught.value)[0] == "INVALID_INPUT"
            assert caught.value.details() == refusal
            items = [
                pb.InferRequest(request_id="m", inputs=[mislabelled]),
                request(rows(1), request_id="good"),
            ]
            answers = {a.request_id: a async for a in s.stub.InferStream(iter(items), timeout=10)}
        assert answers["m"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert answers["m"].error.message == refusal
        assert answers["good"].WhichOneof("result") == "response"

    asyncio.run(scenario())


def test_more_output_names_than_the_model_has_outputs_are_refused_on_their_count(
    small_model: Path,
) -> None:
    """The names were walked one by one and every unknown one quoted: a request of a
    million empty names cost the event loop that much before its refusal."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.Infer(request(rows(1), output_names=[""] * 1000))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                "output_names has 1000 names; expected at most 1, each of the model's outputs "
                "['output'] at most once"
            ) in (refused.value.details() or "")

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("method", "message"), [("GetModel", "GetModelRequest"), ("GetStats", "GetStatsRequest")]
)
def test_bytes_that_are_not_the_request_of_get_model_or_get_stats_are_invalid_argument(
    small_model: Path, method: str, message: str
) -> None:
    """Only Infer's requests were read this way: GetModel and GetStats answered gRPC's
    UNKNOWN "Unexpected <class 'DecodeError'>" to bytes that do not parse."""
    garbage = b"\x0a\xff\x01"  # field 1, length-delimited, 255 bytes announced, 1 sent

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            call = raw_call(s, method)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(garbage, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(refused.value)[0] == "INVALID_INPUT"
            assert f"does not parse as a laneserve.v1.{message} message" in (
                refused.value.details() or ""
            )
            assert await call(b"", timeout=10) is not None  # the empty message is served

    asyncio.run(scenario())


def unknown_field(size_bytes: int) -> bytes:
    """A message of `size_bytes` on the wire: one field (15, bytes) that no request has,
    which every request parses and keeps as an unknown field."""
    for length_bytes in range(1, 6):
        payload = size_bytes - 1 - length_bytes
        length = bytearray()
        rest = payload
        while rest > 0x7F:
            length.append(rest & 0x7F | 0x80)
            rest >>= 7
        length.append(rest)
        if payload >= 0 and len(length) == length_bytes:
            return b"\x7a" + bytes(length) + bytes(payload)
    raise AssertionError(f"no field of {size_bytes} bytes")


@pytest.mark.parametrize(
    ("method", "message"), [("GetModel", "GetModelRequest"), ("GetStats", "GetStatsRequest")]
)
def test_an_operator_request_over_its_bound_is_refused_unparsed(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, method: str, message: str
) -> None:
    """GetModel's and GetStats' requests are empty messages, yet one was parsed up to
    max_message_bytes (its unknown fields copied beside its bytes): concurrent callers
    sending large bodies took the server's RSS past 1 GiB. One over
    MAX_OPERATOR_REQUEST_BYTES is refused INVALID_ARGUMENT, never parsed; one of the
    bound is answered (unknown fields stay readable, as a newer client's would be)."""
    bound = grpc_methods.MAX_OPERATOR_REQUEST_BYTES
    parsed_bytes: list[int] = []
    read_request = grpc_methods.read_request

    def recording(request_type: Any, data: bytes) -> Any:
        parsed_bytes.append(len(data))
        return read_request(request_type, data)

    monkeypatch.setattr(grpc_methods, "read_request", recording)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            call = raw_call(s, method)
            assert await call(unknown_field(bound), timeout=10) is not None
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(unknown_field(bound + 1), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(refused.value)[0] == "INVALID_INPUT"
            assert refused.value.details() == (
                f"the {method} request is {bound + 1} bytes, over the limit of {bound} bytes "
                f"for GetModel and GetStats requests; expected a laneserve.v1.{message} "
                "message encoded from protos/laneserve/v1/inference.proto"
            )

    asyncio.run(scenario())
    assert parsed_bytes == [bound], "only the request within the bound was parsed"


# A method of each of gRPC's own services beside laneserve's: whether its requests
# stream, and whether its answers do.
GRPC_SERVICE_METHODS = [
    ("/grpc.health.v1.Health/Check", False, False),
    ("/grpc.health.v1.Health/Watch", False, True),
    ("/grpc.channelz.v1.Channelz/GetServers", False, False),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", True, True),
]


@pytest.mark.parametrize(
    ("method", "requests_streamed", "answers_streamed"),
    GRPC_SERVICE_METHODS,
    ids=[method.rpartition(".")[2] for method, _, _ in GRPC_SERVICE_METHODS],
)
def test_a_grpc_service_request_over_the_operator_bound_is_refused_naming_it(
    small_model: Path, method: str, requests_streamed: bool, answers_streamed: bool
) -> None:
    """Health, Channelz and reflection read their requests (names and ids) up to
    max_message_bytes, and reflection's answer repeats its request, unknown fields
    included: 16 reflection streams of 48 MiB took the server to a 3.7 GiB peak. One over
    MAX_OPERATOR_REQUEST_BYTES is refused INVALID_ARGUMENT naming the method and the
    bound, as GetStats' is; one of the bound is answered."""
    bound = grpc_methods.MAX_OPERATOR_REQUEST_BYTES

    async def first_answer(s: Serving, body: bytes) -> object:
        if not answers_streamed:
            unary: Any = s.channel.unary_unary(method, request_serializer=bytes)
            return await unary(body, timeout=10)
        call: Any = (
            s.channel.stream_stream(method, request_serializer=bytes)(iter([body]), timeout=10)
            if requests_streamed
            else s.channel.unary_stream(method, request_serializer=bytes)(body, timeout=10)
        )
        try:
            return await call.read()
        finally:
            call.cancel()  # a Watch stays open

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            assert await first_answer(s, unknown_field(bound)) is not grpc.aio.EOF
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await first_answer(s, unknown_field(bound + 1))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(refused.value)[0] == "INVALID_INPUT"
            assert refused.value.details() == (
                f"the {method} request is {bound + 1} bytes, over the limit of {bound} bytes "
                "for the requests of gRPC's health, Channelz and reflection services; "
                "expected that method's request message (names and ids, tens of bytes)"
            )
            # A body that does not parse: INVALID_ARGUMENT too (it was UNKNOWN, and a
            # traceback logged at ERROR for each such call).
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await first_answer(s, b"\xff\xff")
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(refused.value)[0] == "INVALID_INPUT"
            assert str(refused.value.details()).startswith(
                f"the {method} request does not parse as a "
            )
            assert await health_status(s.channel) == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(scenario())


def test_full_lane_refuses_with_pushback(small_model: Path) -> None:
    lanes = (
        LaneConfig("standard", capacity_rows=8, timeout_ms=60_000, max_wait_ms=0, min_share=0.0),
    )

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, lanes=lanes)) as s:
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            await asyncio.to_thread(engine.entered.acquire)
            queued = [
                asyncio.ensure_future(s.stub.Infer(request(rows(4, start=10 * i)))) for i in (1, 2)
            ]
            await until(lambda: queued_rows(s) == 8)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(1)))
            error = caught.value
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "lane 'standard' is full" in (error.details() or "")
            reason, details = rich_status(error)
            assert reason == "LANE_FULL"
            assert details["pushback_ms"] >= 1
            assert details["retry_delay_s"] > 0
            engine.release()
            await asyncio.gather(running, *queued)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert dict(stats.lanes[0].rejected) == {"LANE_FULL": 1}

    asyncio.run(scenario())


def test_request_larger_than_the_lane_is_invalid(small_model: Path) -> None:
    lanes = (
        LaneConfig("standard", capacity_rows=8, timeout_ms=60_000, max_wait_ms=0, min_share=0.0),
    )

    async def scenario() -> None:
        async with serving(
            RecordingEngine(str(small_model)), config(small_model, lanes=lanes)
        ) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(9)))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "holds at most 8 rows" in (caught.value.details() or "")

    asyncio.run(scenario())


def test_a_request_larger_than_its_lane_is_refused_before_it_is_decoded_or_hashed(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused on rows only by the scheduler, a request over its lane's capacity was
    decoded (its inputs copied) and, with a request_id, hashed on the event loop first:
    143-223 ms of the loop per 62 MiB request. Its rows are its first input's shape[0]."""
    lanes = (
        LaneConfig("standard", capacity_rows=8, timeout_ms=60_000, max_wait_ms=0, min_share=0.0),
    )
    work: list[str] = []

    def counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            work.append(name)
            return function(*args)

        return wrapper

    monkeypatch.setattr(f"{service.__name__}.decode_inputs", counted("decode", decode_inputs))
    monkeypatch.setattr(f"{service.__name__}.fingerprint", counted("hash", fingerprint))

    async def scenario() -> None:
        async with serving(
            RecordingEngine(str(small_model)), config(small_model, lanes=lanes)
        ) as s:
            refusal = (
                "request has 9 rows; lane 'standard' holds at most 8 rows (split it, or use a "
                "lane with more capacity)"
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(9), request_id="big"))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(caught.value)[0] == "INVALID_INPUT"
            assert refusal in (caught.value.details() or "")
            item = request(rows(9), request_id="big item", lane="standard")
            (answer,) = [answer async for answer in s.stub.InferStream(iter([item]), timeout=30)]
            assert answer.request_id == "big item"
            assert item_reason(answer) == "INVALID_INPUT"
            assert refusal in answer.error.message
            assert work == []
            # Rows of no input of the model's are not counted: the input is named.
            misnamed = pb.InferRequest(inputs=[encode_tensor("inptu", rows(9))])
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(misnamed)
            assert "unknown input 'inptu'" in (caught.value.details() or "")
            work.clear()
            assert output(await s.stub.Infer(request(rows(8), request_id="fits"))).shape == (8, 10)
            assert work == ["decode", "hash"]
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert dict(stats.lanes[0].rejected) == {"INVALID_INPUT": 3}

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("tensor", "refusal"),
    [
        (
            pb.Tensor(name="input", dtype=pb.DATA_TYPE_FLOAT32, shape=[1024], data=bytes(4096)),
            "input 'input' has shape [1024]; expected",
        ),
        (
            encode_tensor("input", np.zeros((9, 256), np.float32)),
            "input 'input' has shape [9, 256]; expected",
        ),
        (
            encode_tensor("input", np.zeros((9, 512), np.float64)),
            "input 'input' has dtype float64; expected",
        ),
        (
            encode_tensor("input", np.zeros((9, 512, 1), np.float32)),
            "input 'input' has shape [9, 512, 1]; expected",
        ),
    ],
    ids=["flattened", "wrong-width", "wrong-dtype", "wrong-rank"],
)
def test_a_malformed_request_over_its_lanes_rows_is_refused_for_its_fault(
    small_model: Path, tensor: pb.Tensor, refusal: str
) -> None:
    """Its shape[0] was counted as its rows, and refused as too many for the lane ("split
    it") where the lane was smaller, for its real fault where the lane had room: a
    flattened 2-row batch in 'interactive' (512 rows) was told "request has 1024 rows".
    Rows are counted unread only of a dtype and shape the input takes."""
    lanes = (
        LaneConfig("standard", capacity_rows=8, timeout_ms=60_000, max_wait_ms=0, min_share=0.0),
    )
    expected = f"{refusal} float32 with shape [-1, 512], -1 = any size"

    async def scenario() -> None:
        async with serving(
            RecordingEngine(str(small_model)), config(small_model, lanes=lanes)
        ) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(pb.InferRequest(inputs=[tensor]))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(caught.value)[0] == "INVALID_INPUT"
            assert caught.value.details() == expected
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(9)))
            assert caught.value.details() == (
                "request has 9 rows; lane 'standard' holds at most 8 rows (split it, or use a "
                "lane with more capacity)"
            )

    asyncio.run(scenario())


def test_unmeetable_deadline_is_refused_at_once(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=8)) as s:
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            await asyncio.to_thread(engine.entered.acquire)
            ahead = asyncio.ensure_future(s.stub.Infer(request(rows(2000, start=1))))
            await until(lambda: queued_rows(s) == 2000)
            # 5 rows: wider than the room the split request leaves beside its half of a
            # batch (4 of 8), so all of its 2 000 rows are ahead (a 1-row request would go
            # in the next batch beside it).
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(5, start=5000), timeout_ms=1))
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert rich_status(caught.value)[0] == "DEADLINE_UNMEETABLE"
            engine.release()
            await asyncio.gather(running, ahead)
            assert 5000 not in engine.ran_tags

    asyncio.run(scenario())


def test_expired_in_queue_is_answered_and_never_runs(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            await asyncio.to_thread(engine.entered.acquire)
            # Shed while the session is still busy: nothing needs the session to free up.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(3, start=100), timeout_ms=50))
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert rich_status(caught.value)[0] == "EXPIRED_IN_QUEUE"
            assert queued_rows(s) == 0, "its rows are freed at once"
            engine.release()
            await running
            await s.stub.Infer(request(rows(1, start=200)))
            assert sorted(engine.ran_tags) == [0, 200]
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            standard = next(lane for lane in stats.lanes if lane.name == "standard")
            assert dict(standard.shed) == {"EXPIRED_IN_QUEUE": 1}

    asyncio.run(scenario())


def test_a_grpc_deadline_that_passes_while_the_batch_runs_is_counted_deadline_exceeded(
    small_model: Path,
) -> None:
    """gRPC cancels the call at its deadline and the caller gets DEADLINE_EXCEEDED: the
    request was counted CANCELLED (the caller left). It ends DEADLINE_EXCEEDED, a failure
    that is not shed (it ran, too late), in GetStats and the metrics alike."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            engine.hold()
            late = asyncio.ensure_future(s.stub.Infer(request(rows(2), lane="bulk"), timeout=1))
            assert await asyncio.to_thread(engine.entered.acquire, True, 10), "it runs"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await late
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

            def answered() -> dict[str, int]:
                bulk = next(lane for lane in s.server.stats.snapshot().lanes if lane.name == "bulk")
                return bulk.answered

            await until(lambda: bool(answered()))
            engine.release()
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        bulk = next(lane for lane in stats.lanes if lane.name == "bulk")
        assert dict(bulk.answered) == {"DEADLINE_EXCEEDED": 1}
        assert (bulk.admitted, bulk.completed, bulk.failed) == (1, 0, 1)
        assert dict(bulk.shed) == {}

    asyncio.run(scenario())


def test_grpc_deadline_is_honoured_without_configuration(small_model: Path) -> None:
    """A call's gRPC deadline alone (no timeout_ms) is its deadline on the server: queued
    behind a held batch past it, the request is shed EXPIRED_IN_QUEUE and never runs. (A
    server that ignored it had only the lane's timeout: the cancel that gRPC sends at the
    deadline freed the rows all the same, but was counted CANCELLED, a caller that left.)"""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            await asyncio.to_thread(engine.entered.acquire)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(1, start=7)), timeout=0.2)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: queued_rows(s) == 0)

            def standard(stats: pb.GetStatsResponse) -> pb.LaneStats:
                return next(lane for lane in stats.lanes if lane.name == "standard")

            await until_stats(s, lambda stats: sum(standard(stats).shed.values()) == 1)
            shed = dict(standard(await s.stub.GetStats(pb.GetStatsRequest())).shed)
            engine.release()
            await running
            assert 7 not in engine.ran_tags
        assert shed == {"EXPIRED_IN_QUEUE": 1}, "shed at its deadline, not a caller that left"

    asyncio.run(scenario())


def _standard_capped_at(timeout_ms: int) -> tuple[LaneConfig, ...]:
    """The default lanes with a standard lane that caps every request at `timeout_ms` and
    claims no share (work queued above is all ahead of it), and room in interactive."""
    interactive, standard, bulk = DEFAULT_LANES
    return (
        dataclasses.replace(interactive, capacity_rows=4096),
        dataclasses.replace(standard, timeout_ms=timeout_ms, min_share=0.0),
        bulk,
    )


# How a caller bounds its call: its request's timeout_ms (0: none) and its gRPC timeout.
OWN_TIMEOUTS: dict[str, tuple[int, float | None]] = {
    "timeout_ms 5000": (5000, None),
    "grpc timeout 5 s": (0, 5.0),
    "no timeout": (0, None),
}


def assert_names_the_lane_cap(details: str, how: str, lane_timeout_ms: int) -> None:
    where = f"(lane 'standard' timeout_ms={lane_timeout_ms}"
    if how == "no timeout":
        assert details.endswith(f"{where}: the request set no timeout of its own)"), details
    elif how == "timeout_ms 5000":
        assert details.endswith(f"{where} caps this request's 5000 ms timeout)"), details
    else:  # gRPC's remaining time when the call was read: a little under 5 s
        assert f"{where} caps this request's " in details, details
        assert details.endswith(" ms timeout)"), details


@pytest.mark.parametrize("how", [*OWN_TIMEOUTS, "timeout_ms 100"])
def test_an_expiry_over_grpc_names_the_lane_timeout_that_capped_the_callers(
    small_model: Path, how: str
) -> None:
    """Lane standard caps at 200 ms; the request waits behind a held batch. Shed at the
    cap, its answer says the lane's timeout_ms cut the caller's 5 s (or stood in for a
    timeout it never set); one shed at its caller's own shorter 100 ms does not. The note
    never appeared over gRPC: the service hands the scheduler the capped deadline, and
    the scheduler told the cap by comparing deadlines (its unit tests built requests
    otherwise)."""
    timeout_ms, timeout_s = OWN_TIMEOUTS.get(how, (100, None))
    server_config = config(small_model, lanes=_standard_capped_at(200))

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, server_config) as s:
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            await asyncio.to_thread(engine.entered.acquire)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(
                    request(rows(3, start=100), timeout_ms=timeout_ms), timeout=timeout_s
                )
            engine.release()
            await running
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        details = caught.value.details() or ""
        if how == "timeout_ms 100":
            assert "timeout_ms" not in details, details
        else:
            assert rich_status(caught.value)[0] == "EXPIRED_IN_QUEUE"
            assert_names_the_lane_cap(details, how, 200)

    asyncio.run(scenario())


@pytest.mark.parametrize("how", OWN_TIMEOUTS)
def test_an_unmeetable_refusal_over_grpc_names_the_lane_timeout_that_capped_the_callers(
    small_model: Path, how: str
) -> None:
    """As an expiry (see above), for a request refused at once: lane standard caps at
    1 ms, and 4 000 interactive rows are queued ahead of it behind a held batch."""
    timeout_ms, timeout_s = OWN_TIMEOUTS[how]
    server_config = config(small_model, max_batch_size=8, lanes=_standard_capped_at(1))

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, server_config) as s:
            engine.hold()
            running = asyncio.ensure_future(
                s.stub.Infer(request(rows(1, start=0), lane="interactive"))
            )
            await asyncio.to_thread(engine.entered.acquire)
            ahead = asyncio.ensure_future(
                s.stub.Infer(request(rows(4000, start=1), lane="interactive"))
            )
            await until(lambda: queued_rows(s) == 4000)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(
                    request(rows(5, start=5000), timeout_ms=timeout_ms), timeout=timeout_s
                )
            engine.release()
            await asyncio.gather(running, ahead)
            assert 5000 not in engine.ran_tags
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert rich_status(caught.value)[0] == "DEADLINE_UNMEETABLE"
        assert_names_the_lane_cap(caught.value.details() or "", how, 1)

    asyncio.run(scenario())


def test_getstats_windows_keep_the_servers_clock(small_model: Path) -> None:
    """The server's stats time their samples and their window by the clock it was given:
    on the system's, a test's clock moved past WINDOW_S left every sample in GetStats."""
    clock = ManualClock()
    server = LaneServer(
        RecordingEngine(str(small_model)), config(small_model, metrics_port=-1), clock=clock
    )
    try:
        server.stats.request_finished("standard", "OK", 0.010)

        def answered_in_window() -> int:
            standard = next(
                lane for lane in server.stats.snapshot().lanes if lane.name == "standard"
            )
            return standard.request_duration.count

        assert answered_in_window() == 1
        clock.advance(WINDOW_S + 1)
        assert answered_in_window() == 0
    finally:
        asyncio.run(server.stop())


def test_cancelled_call_frees_its_rows_and_never_runs(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            await asyncio.to_thread(engine.entered.acquire)
            call = s.stub.Infer(request(rows(5, start=10)))
            await until(lambda: queued_rows(s) == 5)
            call.cancel()
            await until(lambda: queued_rows(s) == 0)
            engine.release()
            await running
            assert engine.ran_tags == [0]

    asyncio.run(scenario())


def test_runtime_failure_fails_that_batch_only(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        engine.fail_when = lambda batch: any(
            (part[:, 0] == 666).any() for part in batch.parts["input"]
        )
        async with serving(engine, config(small_model)) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(1, start=666)))
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert rich_status(caught.value)[0] == "ENGINE_FAILURE"
            assert output(await s.stub.Infer(request(rows(2, start=1)))).shape == (2, 10)

    asyncio.run(scenario())
    # The line says which batch, as an event (with --log-format json, a member).
    (failed,) = [r for r in caplog.records if getattr(r, "event", None) == "batch_failed"]
    assert failed.exc_info is not None
    assert getattr(failed, "fields", {})["batch_id"] >= 0


def test_draining_server_refuses_new_work_and_finishes_queued(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            assert await health_status(s.channel) == health_pb2.HealthCheckResponse.SERVING
            running, queued = await one_running_and_queued(s, engine)
            stopping = asyncio.ensure_future(s.server.stop(grace_s=30))
            await until(lambda: s.server.state.value == "DRAINING")
            assert await health_status(s.channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(1, start=9)))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert rich_status(caught.value)[0] == "DRAINING"
            engine.release()
            assert output(await running).shape == (1, 10)
            assert output(await queued).shape == (2, 10)
            await stopping
            assert sorted(engine.ran_tags) == [0, 1, 2]

    asyncio.run(scenario())


def test_work_left_after_the_grace_period_is_answered_unavailable(small_model: Path) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            running, queued = await one_running_and_queued(s, engine)
            stopping = asyncio.ensure_future(s.server.stop(grace_s=0.05))
            results = await asyncio.gather(running, queued, return_exceptions=True)
            for result in results:
                assert isinstance(result, grpc.aio.AioRpcError)
                assert result.code() == grpc.StatusCode.UNAVAILABLE
            engine.release()
            await stopping

    asyncio.run(scenario())


def test_a_scheduler_that_fails_while_the_server_starts_stops_it(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure before start() had set SERVING was recorded and logged "stopping", but
    nothing stopped the server: it served SERVING health with every call INTERNAL."""
    concrete = grpc_aio_server.Server  # grpc.aio.Server is only its abstract base
    grpc_start = concrete.start

    async def start_once_failed(self: grpc_aio_server.Server) -> None:
        await until(lambda: server.failure is not None)  # the failure comes mid-start
        await grpc_start(self)

    monkeypatch.setattr(concrete, "start", start_once_failed)

    server: LaneServer

    async def scenario() -> None:
        nonlocal server
        gauge = BreakableGauge()
        server = _watermarked_server(small_model, gauge)
        gauge.broken.set()  # the scheduler thread's first step fails
        await server.start()
        try:
            await asyncio.wait_for(server.wait_stopped(), timeout=30)
            assert server.failure is not None
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_a_drain_does_not_wait_for_a_batch_longer_than_its_grace(small_model: Path) -> None:
    """A batch running past the grace held the stop (and the process) until it ended: 20 s
    past a 1 s grace. The stop now waits for it at most RUNNING_BATCH_WAIT_S; its requests
    are told they may have run, queued ones that they never ran."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            running, queued = await one_running_and_queued(s, engine)
            # Returns while the batch is still held in the engine.
            await asyncio.wait_for(s.server.stop(grace_s=0.05), timeout=60)
            assert not engine.gate.is_set()
            messages = []
            for call in (running, queued):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert rich_status(caught.value)[0] == "DRAINING"
                messages.append(caught.value.details() or "")
            assert "while this request's batch was running" in messages[0]
            assert "it may have run" in messages[0]
            assert "before this request could run" in messages[1]
            engine.release()  # the held batch ends; its result is discarded
            thread = s.server._thread  # its engine thread must end before the test does
            assert thread is not None
            assert await asyncio.to_thread(thread.close, join_timeout_s=30)
            assert engine.ran_tags == [0]
            # The stop ended the batch, not the model: counted DRAINING (it was counted,
            # and traced, ENGINE_FAILURE, which alerts on model faults fired on).
            batches = s.server.stats.counts().batches
            assert {status for (_, status), count in batches.items() if count} == {"DRAINING"}

    asyncio.run(scenario())


def test_end_grace_answers_queued_work_at_once(small_model: Path) -> None:
    """A second SIGTERM or Ctrl-C during a drain (`end_grace`) did nothing: the drain
    waited out its whole grace."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            running, queued = await one_running_and_queued(s, engine)
            stopping = asyncio.ensure_future(s.server.stop(grace_s=3600))
            await until(lambda: s.server.state is Lifecycle.DRAINING)
            s.server.end_grace()
            await queued_never_ran_as_the_drain_ended(running, queued, engine, stopping)

    asyncio.run(scenario())


def test_an_embedded_server_under_a_low_open_file_limit_is_refused_at_start_naming_it(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every LaneServer's start holds the open-file limit to MIN_OPEN_FILES, not `serve`
    alone: an embedder's server under `ulimit -n 12` went on into gRPC's core, which
    aborts the process (Python 3.13) where it cannot open its wakeup fd."""
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (12, 12))

    async def scenario() -> None:
        server = LaneServer(RecordingEngine(str(small_model)), config(small_model))
        with pytest.raises(ConfigError, match=r"the open-file limit is 12, under the 64 "):
            await server.start()
        await asyncio.wait_for(server.stop(), timeout=60)
        assert server.state is Lifecycle.STOPPED

    asyncio.run(scenario())


def test_stop_before_start_and_after_a_failed_start(small_model: Path) -> None:
    """stop() after a failed start raised a bare AssertionError, left the state DRAINING,
    and a second stop() never returned."""

    async def scenario() -> None:
        fresh = LaneServer(RecordingEngine(str(small_model)), config(small_model))
        await asyncio.wait_for(fresh.stop(), timeout=60)
        assert fresh.state is Lifecycle.STOPPED
        with socket.socket() as held:  # a port another socket listens on: bind fails
            held.bind(("127.0.0.1", 0))
            held.listen()
            busy = held.getsockname()[1]
            failed = LaneServer(
                RecordingEngine(str(small_model)),
                config(small_model, host="127.0.0.1", port=busy, metrics_port=-1),
            )
            with pytest.raises(OSError, match="cannot listen on"):
                await failed.start()
        for _ in range(2):
            await asyncio.wait_for(failed.stop(), timeout=60)
            assert failed.state is Lifecycle.STOPPED

    asyncio.run(scenario())


def _server_threads() -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.name.startswith("laneserve-")}


async def _assert_nothing_runs(server: LaneServer, ports: list[int]) -> None:
    """A stopped server: its state STOPPED, health NOT_SERVING, none of its threads alive,
    nothing listening on any of `ports`."""
    assert not _server_threads()
    for port in ports:
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still listens"
    assert server.state is Lifecycle.STOPPED
    # Asked directly: nothing may listen any more. A found service needs no context.
    health: Any = server._health
    answer = await health.Check(health_pb2.HealthCheckRequest(service=""), None)
    assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING


def _hold_grpc_starts(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Every gRPC server's start waits for the second event; the first is set once one
    waits (start() has then started its threads and bound every port)."""
    concrete = grpc_aio_server.Server  # grpc.aio.Server is only its abstract base
    grpc_start = concrete.start
    entered, go = asyncio.Event(), asyncio.Event()

    async def held_start(self: grpc_aio_server.Server) -> None:
        entered.set()
        await go.wait()
        await grpc_start(self)

    monkeypatch.setattr(concrete, "start", held_start)
    return entered, go


async def _ports_once_held(server: LaneServer, entered: asyncio.Event) -> list[int]:
    """The main, priority and metrics ports of `server`, once its start is held in
    gRPC's start (`_hold_grpc_starts`): its threads run and every port is bound."""
    await entered.wait()
    assert _server_threads()
    assert server.priority_port is not None
    assert server.metrics_port is not None
    return [server.port, server.priority_port, server.metrics_port]


def _server_on_every_port(model: Path) -> LaneServer:
    return LaneServer(
        RecordingEngine(str(model)),
        config(model, host="127.0.0.1", port=0, priority_port=0, metrics_port=0),
    )


def test_a_stop_while_the_server_starts_waits_for_the_start_then_stops_it(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() called while start() awaited gRPC's start took the "never started" path: it
    returned STOPPED with the scheduler thread running and the ports bound, and the start
    then went on to listen and set SERVING (the state went back). Two stops at once."""
    entered, go = _hold_grpc_starts(monkeypatch)

    async def scenario() -> None:
        assert not _server_threads()
        server = _server_on_every_port(small_model)
        starting = asyncio.ensure_future(server.start())
        try:
            ports = await _ports_once_held(server, entered)
            stops = [asyncio.ensure_future(server.stop(grace_s=5.0)) for _ in range(2)]
            go.set()  # tasks run in the order they were woken: both stops begin first
            await asyncio.wait_for(asyncio.gather(*stops), timeout=60)
            await _assert_nothing_runs(server, ports)
            assert starting.done()
            assert await starting == ports[0]  # it completed, and was then stopped
            await _assert_nothing_runs(server, ports)
        finally:
            go.set()
            await asyncio.gather(starting, return_exceptions=True)
            await server.stop()  # what a failed check left running

    asyncio.run(scenario())


def test_a_start_cancelled_partway_stops_the_server_once_started(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start() cancelled in gRPC's start (wait_for's timeout, a task group's failure),
    after the threads started and every port was bound, left them running: a stop()
    then saw nothing started. The start runs to its end and the server then stops."""
    entered, go = _hold_grpc_starts(monkeypatch)

    async def scenario() -> None:
        server = _server_on_every_port(small_model)
        starting = asyncio.ensure_future(server.start())
        try:
            ports = await _ports_once_held(server, entered)
            starting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await starting
            go.set()
            await asyncio.wait_for(server.wait_stopped(), timeout=60)
            await server.stop()
            await _assert_nothing_runs(server, ports)
        finally:
            go.set()
            await server.stop()

    asyncio.run(scenario())


def test_a_stop_its_caller_cancels_ends_the_grace_and_goes_on_to_its_end(
    small_model: Path,
) -> None:
    """A stop() cancelled mid-drain (an embedder's wait_for timeout) said STOPPED at once
    with its ports open, its threads running and admitted calls unanswered, and every
    later stop() returned at once. It now goes on to its end, its grace ended: what is
    queued is answered DRAINING without waiting for the grace."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        server = LaneServer(
            engine, config(small_model, host="127.0.0.1", port=0, drain_grace_s=600.0)
        )
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.InferenceServiceStub(channel)
                engine.hold()
                running = asyncio.ensure_future(stub.Infer(request(rows(1)), timeout=60))
                assert await asyncio.to_thread(engine.entered.acquire, True, 10)
                queued = asyncio.ensure_future(stub.Infer(request(rows(1)), timeout=60))
                thread = server._thread
                assert thread is not None
                await until(lambda: sum(d.queued_rows for d in thread.depths()) == 1)
                stopping = asyncio.ensure_future(server.stop())
                await until(lambda: server.state is Lifecycle.DRAINING)
                stopping.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await stopping
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await queued  # answered while the session still holds the batch
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert rich_status(refused.value)[0] == "DRAINING"
                engine.release()
                await asyncio.gather(running, return_exceptions=True)  # answered, either way
            await asyncio.wait_for(server.wait_stopped(), timeout=60)
            await server.stop()
            await _assert_nothing_runs(server, [port])
        finally:
            engine.release()
            await server.stop()

    asyncio.run(scenario())


def test_a_grace_ended_before_the_start_made_its_thread_still_ends_the_next_drain(
    small_model: Path,
) -> None:
    """A second signal that came before start() had made the scheduler thread (the first
    asked for the stop as the server started) was dropped: the drain waited out its
    whole grace."""

    async def scenario() -> bool:
        server = LaneServer(
            RecordingEngine(str(small_model)),
            config(small_model, host="127.0.0.1", port=0, metrics_port=-1),
        )
        server.end_grace()
        await server.start()
        try:
            thread = server._thread
            assert thread is not None
            return thread.grace_ended
        finally:
            await server.stop()

    assert asyncio.run(scenario())


def test_two_servers_started_together_each_count_only_their_own_grpc_calls(
    small_model: Path,
) -> None:
    """A server's Channelz ids were "every id after its start minus every id before", so
    a server another task made during its start's awaits was counted as its own: its
    grpc_calls counted the other's calls, and read None once the other was gone."""

    async def scenario() -> None:
        servers = [
            LaneServer(
                RecordingEngine(str(small_model)),
                config(small_model, host="127.0.0.1", port=0, metrics_port=-1),
            )
            for _ in range(2)
        ]
        try:
            _, called_port = await asyncio.gather(*(each.start() for each in servers))
            idle, called = servers
            async with grpc.aio.insecure_channel(f"127.0.0.1:{called_port}") as channel:
                stub = pb_grpc.InferenceServiceStub(channel)
                for _ in range(3):
                    await stub.Infer(request(rows(1)))
            await until(lambda: _started(called) == 3)
            assert _started(idle) == 0
            await called.stop()
            assert idle.grpc_calls() is not None
        finally:
            await asyncio.gather(*(each.stop() for each in servers))

    asyncio.run(scenario())


def _started(server: LaneServer) -> int:
    calls = server.grpc_calls()
    assert calls is not None
    return calls.started


def test_a_grpc_start_that_fails_stops_what_the_start_began(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's own start failing for the priority port (after the scheduler and engine
    threads started and every port was bound) raised out of start() and left the threads
    running and the ports listening, with nothing to stop them."""
    concrete = grpc_aio_server.Server  # grpc.aio.Server is only its abstract base
    grpc_start = concrete.start
    starts = 0

    async def second_start_fails(self: grpc_aio_server.Server) -> None:
        nonlocal starts
        starts += 1
        if starts == 2:  # the priority port's: the main port's server has started
            raise RuntimeError("injected: gRPC could not start")
        await grpc_start(self)

    monkeypatch.setattr(concrete, "start", second_start_fails)

    async def scenario() -> None:
        server = _server_on_every_port(small_model)
        with pytest.raises(RuntimeError, match="injected"):
            await asyncio.wait_for(server.start(), timeout=60)
        assert server.priority_port is not None
        assert server.metrics_port is not None
        ports = [server.port, server.priority_port, server.metrics_port]
        assert not _server_threads()  # before any stop(): the failed start ended them
        await asyncio.wait_for(server.stop(), timeout=60)
        await _assert_nothing_runs(server, ports)

    asyncio.run(scenario())


def test_a_second_start_while_one_is_in_progress_is_refused(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start() while another was in progress passed its STARTING assert and started a
    second scheduler thread and metrics endpoint and bound ports again: only the last were
    stopped."""
    entered, go = _hold_grpc_starts(monkeypatch)

    async def scenario() -> None:
        server = _server_on_every_port(small_model)
        starting = asyncio.ensure_future(server.start())
        try:
            await entered.wait()
            threads = _server_threads()
            with pytest.raises(RuntimeError, match="its start is in progress"):
                # The timeout only ends the test where a second start waits on the hold.
                await asyncio.wait_for(server.start(), timeout=10)
            assert _server_threads() == threads
            go.set()
            assert await starting == server.port
        finally:
            go.set()
            await asyncio.gather(starting, return_exceptions=True)
            await server.stop()
        await _assert_nothing_runs(server, [])

    asyncio.run(scenario())


def test_a_start_after_stop_is_refused_naming_the_state(small_model: Path) -> None:
    """A start() that runs after stop() (an embedder's `create_task(server.start())` then
    `await server.stop()`: the task's first step comes after the stop) failed a bare
    assert, or with -O served after STOPPED."""

    async def scenario() -> None:
        server = _server_on_every_port(small_model)
        starting = asyncio.ensure_future(server.start())
        await server.stop()
        for start in (starting, server.start()):
            with pytest.raises(RuntimeError, match="the server is STOPPED"):
                await start
        assert server.port == 0  # nothing was bound
        assert server.metrics_port is None
        await _assert_nothing_runs(server, [])

    asyncio.run(scenario())


class BreakableGauge:
    """Device memory readings that raise once `broken` is set, as NVML does when the GPU
    is lost: the scheduler thread, which reads them, fails for good."""

    def __init__(self) -> None:
        self.broken = threading.Event()

    def used_bytes(self) -> int | None:
        if self.broken.is_set():
            raise RuntimeError("injected fault: the device is lost")
        return 10 * 2**20

    def total_bytes(self) -> int | None:
        return 2**34


def _watermarked_server(model: Path, gauge: BreakableGauge) -> LaneServer:
    """A server whose memory watermark reads `gauge` (on the scheduler thread)."""
    return LaneServer(
        RecordingEngine(str(model)),
        config(model, host="127.0.0.1", port=0, metrics_port=-1, host_memory_limit="64GiB"),
        memory_gauge=gauge,
    )


def test_a_failed_scheduler_stops_the_server(small_model: Path) -> None:
    """When the scheduler thread died, every call failed "the server must be restarted"
    while health and GetStats kept saying SERVING and the process never exited."""

    async def scenario() -> None:
        gauge = BreakableGauge()
        server = _watermarked_server(small_model, gauge)
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.InferenceServiceStub(channel)
                assert output(await stub.Infer(request(rows(1)))).shape == (1, 10)
                gauge.broken.set()
                await asyncio.wait_for(server.wait_stopped(), timeout=60)
            assert server.state is Lifecycle.STOPPED
            assert server.failure is not None
            assert "the scheduler failed" in str(server.failure)
        finally:
            await server.stop()

    asyncio.run(scenario())


class _BrokenSession:
    """An ONNX Runtime session whose every run fails as a sticky CUDA error leaves it (the
    start-up input too); everything else is the real session's (fault injection)."""

    def __init__(self, real: ort.InferenceSession) -> None:
        self.real = real

    def run(self, *_args: object) -> None:
        raise RuntimeError(
            "[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access "
            "was encountered"
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class _HeldFailure:
    """Holds `server`'s stop on a failure of its scheduler thread until `let_go` (every
    live request is answered by then): a call made meanwhile reaches the scheduler
    thread, as one that came in the moment after the failure does, not the drain."""

    def __init__(self, server: LaneServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self._stop_on_failure = server._scheduler_failed
        self._errors: list[LaneserveError] = []
        self._failed = asyncio.Event()
        monkeypatch.setattr(server, "_scheduler_failed", self._hold)

    def _hold(self, error: LaneserveError) -> None:  # on the event loop
        self._errors.append(error)
        self._failed.set()

    async def failure(self) -> LaneserveError:
        await asyncio.wait_for(self._failed.wait(), timeout=60)
        (error,) = self._errors
        return error

    def let_go(self) -> None:
        (error,) = self._errors
        self._stop_on_failure(error)


async def _answered_never_ran(
    call: Awaitable[pb.InferResponse], failure: SessionBrokenError
) -> None:
    """`call` is answered UNAVAILABLE (DRAINING), saying that it never ran on the broken
    session: its client retries it on another instance."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert rich_status(caught.value)[0] == "DRAINING"
    assert caught.value.details() == (
        f"the model's session is broken ({failure.cause}); this request never ran: retry "
        "on another instance (this server is stopping)"
    )


@pytest.mark.parametrize("running_rows", [2, 1], ids=["halves", "one-row"])
def test_a_broken_session_stops_the_server_after_answering_every_request(
    small_model: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    running_rows: int,
) -> None:
    """The engine saw the session broken (its start-up input failed too) and failed that
    batch only: the server answered every call INTERNAL for good (7 936 in 5 s) while
    health said SERVING, and never exited for its supervisor to restart it. Now the
    batch's request is answered with the session's failure, each call once, and the
    server stops as when its scheduler fails. A request queued behind it never runs: it
    is answered UNAVAILABLE (DRAINING), as is a call that comes after the failure, so
    that clients and retry policies retry it elsewhere (INTERNAL told them not to). A
    batch of one row has no halves: the start-up input tells there too, after a second
    one-row batch that failed (max_batch_size 1: the running row fails as its own, the
    queued request's first row tells, and, that row being in the batch that found the
    session broken, it keeps INTERNAL)."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        settings = {"max_batch_size": 1} if running_rows == 1 else {}
        async with serving(engine, config(small_model, **settings)) as s:
            held = _HeldFailure(s.server, monkeypatch)
            running, queued = await one_running_and_queued(
                s, engine, running_rows=running_rows, queued_start=100
            )
            engine._session = _BrokenSession(engine._session)  # the fault, after start
            engine.release()
            calls = [running, queued] if running_rows == 1 else [running]
            messages = []
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.INTERNAL
                assert rich_status(caught.value)[0] == "ENGINE_FAILURE"
                messages.append(caught.value.details() or "")
            broken = "and on an input it ran at start-up: the session is broken"
            if running_rows == 1:
                assert messages[0].startswith("the model failed on a row of this request")
                assert "CUDA failure 700" in messages[0]
                assert messages[1].startswith(f"the model failed on this request's row, {broken}")
            else:
                assert broken in messages[0]
            failure = await held.failure()
            assert isinstance(failure, SessionBrokenError)
            if running_rows == 2:
                await _answered_never_ran(queued, failure)
            # A call after the failure, before the server's stop: refused the same way.
            await _answered_never_ran(s.stub.Infer(request(rows(1, start=200))), failure)
            held.let_go()
            await asyncio.wait_for(s.server.wait_stopped(), timeout=60)
            assert s.server.state is Lifecycle.STOPPED
            assert s.server.failure is failure
            failures.append(failure)
            health: Any = s.server._health
            answer = await health.Check(health_pb2.HealthCheckRequest(service=""), None)
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # One row: the queued request's first row told, its second never ran.
            ran = [0, 100] if running_rows == 1 else [0, 1]
            assert engine.ran_tags == ran, "the queued request never ran (but to tell)"

    failures: list[SessionBrokenError] = []
    asyncio.run(scenario())
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "session_broken"]
    assert line.levelno == logging.ERROR
    assert "CUDA failure 700" in line.getMessage()
    # The server's own line names the session, not the scheduler, and carries the error.
    (failure,) = failures
    (stopping,) = [r for r in caplog.records if getattr(r, "event", None) == "scheduler_failed"]
    assert stopping.getMessage() == (
        f"the model's session is broken ({failure.cause}); stopping (the process must be restarted)"
    )
    assert "CUDA failure 700" in failure.cause
    assert getattr(stopping, "fields", {}) == {"error": failure.message}


class _TerminatedEngine(RecordingEngine):
    """RecordingEngine that says when the server's stop ended its runs (`terminated`)."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        self.terminated = threading.Event()

    def terminate_runs(self) -> None:
        super().terminate_runs()
        self.terminated.set()


class _BadRowsUntilStopped:
    """An ONNX Runtime session whose first two runs fail as a bad row makes them fail (a
    batch, then its first half), and whose third (the second half) runs once the server's
    stop has ended runs (`terminated`), so that it fails as a drain ends it; everything
    else is the real session's (fault injection)."""

    def __init__(self, real: ort.InferenceSession, terminated: threading.Event) -> None:
        self.real, self.terminated = real, terminated
        self.runs = 0
        self.second_half = threading.Event()

    def run(self, names: Any, feeds: Any, options: ort.RunOptions) -> Any:
        self.runs += 1
        if self.runs <= 2:  # the batch, then its first half
            raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : index out of range")
        if self.runs == 3:  # the second half: the stop comes meanwhile
            self.second_half.set()
            assert self.terminated.wait(30)
        return self.real.run(names, feeds, options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_drain_that_ends_a_split_batch_does_not_fail_the_server(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch retried in halves (its first half failed on a bad row) whose second half
    the drain ended (`terminate_runs`: every run fails after it, the start-up input's
    too) was taken for a broken session: session_broken at ERROR, the server's failure
    set, and `laneserve serve` stopped by SIGTERM exited 1. The call is answered as a
    drain answers a running batch (UNAVAILABLE), no start-up input runs, and the server
    stops without a failure."""

    async def scenario() -> None:
        engine = _TerminatedEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            session = _BadRowsUntilStopped(engine._session, engine.terminated)
            engine._session = session  # the fault, after start
            call = asyncio.ensure_future(s.stub.Infer(request(rows(2))))
            await asyncio.to_thread(session.second_half.wait, 30)
            await s.server.stop(grace_s=0.0)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert s.server.failure is None
            assert session.runs == 3, "no start-up input after the stop"

    asyncio.run(scenario())
    events = {getattr(r, "event", None) for r in caplog.records}
    assert not events & {"session_broken", "scheduler_failed"}


def test_a_watch_the_drain_ends_while_it_writes_sends_its_status_once() -> None:
    """gRPC takes one write at a time on a call, and a write whose awaiter is cancelled
    still goes out. A watch the drain ended while it wrote NOT_SERVING wrote it again,
    refused (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS) while gRPC still sent the first: the call
    never ended and held the stop for gRPC's whole grace. A context that holds the
    NOT_SERVING write in flight, as gRPC does, and refuses a second meanwhile."""
    serving_, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )

    class InFlightWrites:
        def __init__(self) -> None:
            self.sent: list[int] = []
            self.held = asyncio.Event()  # the NOT_SERVING write is in flight, never done

        async def write(self, answer: health_pb2.HealthCheckResponse) -> None:
            if self.held.is_set():
                raise RuntimeError("GRPC_CALL_ERROR_TOO_MANY_OPERATIONS")
            self.sent.append(answer.status)  # gRPC's from here: it goes out
            if answer.status == not_serving:
                self.held.set()
                await asyncio.Event().wait()  # until cancelled

    async def scenario() -> list[int]:
        streams = app_module._LongStreams()
        servicer = app_module._HealthServicer(streams)
        await servicer.set("", serving_)
        context = InFlightWrites()
        watch = asyncio.ensure_future(
            servicer.Watch(health_pb2.HealthCheckRequest(service=""), context)
        )
        await until(lambda: context.sent == [serving_])
        await servicer.set("", not_serving)
        await asyncio.wait_for(context.held.wait(), 10)
        streams.end()
        await asyncio.wait_for(watch, 10)  # ends, without writing again
        return context.sent

    assert asyncio.run(scenario()) == [serving_, not_serving]


def test_health_watches_end_when_the_server_stops(small_model: Path) -> None:
    """An open Watch (clients with client-side health checking keep one) held every
    stop for gRPC's whole grace, then ended CANCELLED; it now ends OK once NOT_SERVING
    is sent."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub: Any = health_pb2_grpc.HealthStub(s.channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            statuses = [(await watch.read()).status]
            await s.server.stop(grace_s=1.0)
            while (answer := await watch.read()) is not grpc.aio.EOF:  # ends, no error
                statuses.append(answer.status)
            assert await watch.code() == grpc.StatusCode.OK
            serving_, not_serving = (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            )
            assert statuses == [serving_, not_serving]

    asyncio.run(scenario())


def test_reflection_streams_end_when_the_server_stops(small_model: Path) -> None:
    """An open reflection stream (a tool that keeps its stream for its next question) held
    every stop for gRPC's whole grace, then ended UNAVAILABLE; it now ends OK at the
    drain, as health watches do, its answers given."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            # The reflection stubs' types know only sync channels.
            stub: Any = reflection_pb2_grpc.ServerReflectionStub(s.channel)  # type: ignore[arg-type]
            stream = stub.ServerReflectionInfo()
            await stream.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            answer = await stream.read()
            assert answer.list_services_response.service
            await s.server.stop(grace_s=5.0)
            assert await stream.read() is grpc.aio.EOF
            assert await stream.code() == grpc.StatusCode.OK

    asyncio.run(scenario())


def test_a_health_watch_opened_late_in_a_stop_ends_at_once(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Watch opened after the stop ended the open watches, while it waited for gRPC's
    core to hand over its last calls, waited on: gRPC's stop held for its whole grace,
    then ended it UNAVAILABLE. It gets NOT_SERVING and ends OK."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub: Any = health_pb2_grpc.HealthStub(s.channel)
            late: list[Any] = []
            reading = s.server._read_what_grpc_holds

            async def open_a_watch_then_read() -> None:
                late.append(stub.Watch(health_pb2.HealthCheckRequest(service="")))
                late.append((await late[0].read()).status)
                await reading()

            monkeypatch.setattr(s.server, "_read_what_grpc_holds", open_a_watch_then_read)
            await s.server.stop(grace_s=1.0)
            watch, first = late
            assert first == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await watch.read() is grpc.aio.EOF
            assert await watch.code() == grpc.StatusCode.OK

    asyncio.run(scenario())


def test_health_says_not_serving_until_the_server_serves(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's health servicer begins SERVING: while the priority port started, the main
    port answered health checks SERVING and refused Infer as draining."""
    entered, go = _hold_grpc_starts(monkeypatch)

    async def scenario() -> None:
        server = _server_on_every_port(small_model)
        starting = asyncio.ensure_future(server.start())
        try:
            await _ports_once_held(server, entered)
            health: Any = server._health
            for service in ("", "laneserve.v1.InferenceService"):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service), None)
                assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
            go.set()
            await starting
            answer = await health.Check(health_pb2.HealthCheckRequest(service=""), None)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            go.set()
            await asyncio.gather(starting, return_exceptions=True)
            await server.stop()

    asyncio.run(scenario())


def test_an_ipv6_host_is_served_written_bare_or_in_brackets(small_model: Path) -> None:
    """host "::1" made the address "::1:0", which gRPC could not bind: the server
    refused to start (after loading the model) with "cannot listen on ::1:0"."""

    async def scenario() -> None:
        for host in ("::1", "[::1]"):
            server = LaneServer(
                RecordingEngine(str(small_model)),
                config(small_model, host=host, port=0, metrics_port=0),
            )
            port = await server.start()
            try:
                async with grpc.aio.insecure_channel(f"[::1]:{port}") as channel:
                    stub = pb_grpc.InferenceServiceStub(channel)
                    assert output(await stub.Infer(request(rows(1)))).shape == (1, 10)
            finally:
                await server.stop()

    asyncio.run(scenario())


def test_reflection_and_health_work_out_of_the_box(small_model: Path) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            # The reflection stubs' types know only sync channels.
            stub: Any = reflection_pb2_grpc.ServerReflectionStub(s.channel)  # type: ignore[arg-type]

            async def ask() -> list[str]:
                call = stub.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
                names: list[str] = []
                async for answer in call:
                    names += [svc.name for svc in answer.list_services_response.service]
                return names

            assert set(await ask()) == {
                "laneserve.v1.InferenceService",
                "inference.GRPCInferenceService",  # KServe v2 / Triton clients
                "grpc.health.v1.Health",
                "grpc.channelz.v1.Channelz",
                "grpc.reflection.v1alpha.ServerReflection",
            }
            # The server, and each inference service every port serves (a probe naming
            # KServe's service was answered NOT_FOUND).
            for service in ("", "laneserve.v1.InferenceService", "inference.GRPCInferenceService"):
                status = await health_status(s.channel, service)
                assert status == health_pb2.HealthCheckResponse.SERVING, service
            model = await s.stub.GetModel(pb.GetModelRequest())
            assert [spec.name for spec in model.inputs] == ["input"]
            assert list(model.inputs[0].shape) == [-1, 512]
            assert model.providers == ["CPUExecutionProvider"]
            assert [lane.name for lane in model.lanes] == ["interactive", "standard", "bulk"]

    asyncio.run(scenario())


def test_reflection_is_v1alpha_and_serves_the_error_details_types_by_name(
    small_model: Path,
) -> None:
    """What a client in another language learns by reflection (README): the v1alpha
    service only, and error_details.proto (ErrorInfo, RetryInfo: the error details'
    types) when asked for by name, though inference.proto does not import it."""
    asks = [
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="google.rpc.ErrorInfo"),
        reflection_pb2.ServerReflectionRequest(file_by_filename="google/rpc/error_details.proto"),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=app.SERVICE_NAME),
    ]

    async def scenario() -> tuple[grpc.StatusCode, list[list[str]]]:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            v1 = s.channel.stream_stream(
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await v1(iter(asks[:1])).read()
            # The reflection stubs' types know only sync channels.
            stub: Any = reflection_pb2_grpc.ServerReflectionStub(s.channel)  # type: ignore[arg-type]
            files = [
                [
                    descriptor_pb2.FileDescriptorProto.FromString(serialized).name
                    for serialized in answer.file_descriptor_response.file_descriptor_proto
                ]
                async for answer in stub.ServerReflectionInfo(iter(asks))
            ]
        return caught.value.code(), files

    v1_code, (by_symbol, by_name, service) = asyncio.run(scenario())
    assert v1_code == grpc.StatusCode.UNIMPLEMENTED
    assert by_symbol[0] == by_name[0] == "google/rpc/error_details.proto"
    assert service[0] == "laneserve/v1/inference.proto"
    assert "google/rpc/error_details.proto" not in service


# Keepalive pings a quiet connection outlives: with gRPC's default minimum interval (5
# min) the server took the fifth ping 1 s apart on a quiet stream as its third strike and
# hung up (the stream's first window update reset the count). Counted, not timed: a
# loaded machine only spreads them.
QUIET_PINGS = 5
# A client that pings every second, with a call or without (grpc-js' and grpc-go's
# keepalive options do the same); the server's minimum is lowered below it.
PINGING = [
    ("grpc.keepalive_time_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Channelz counts every ping the channel sends: none for flow control here.
    ("grpc.http2.bdp_probe", 0),
]
LOWERED_MIN_CLIENT_PING_INTERVAL_MS = 500


async def channel_id(channelz: Any, target: str) -> int:
    """The Channelz id of this process's newest client channel to `target`, as given (the
    server's Channelz answers for the whole process)."""
    ids: list[int] = []
    start = 0
    while True:
        page = await channelz.GetTopChannels(
            channelz_pb2.GetTopChannelsRequest(start_channel_id=start)
        )
        ids += [c.ref.channel_id for c in page.channel if c.data.target == target]
        if page.end or not page.channel:
            return max(ids)
        start = page.channel[-1].ref.channel_id + 1


async def keepalives_sent(channelz: Any, channel_id: int) -> int:
    """Keepalive pings a client channel has sent over its connections now open."""
    sent = 0
    channel = await channelz.GetChannel(channelz_pb2.GetChannelRequest(channel_id=channel_id))
    for ref in channel.channel.subchannel_ref:
        subchannel = await channelz.GetSubchannel(
            channelz_pb2.GetSubchannelRequest(subchannel_id=ref.subchannel_id)
        )
        for socket_ref in subchannel.subchannel.socket_ref:
            socket = await channelz.GetSocket(
                channelz_pb2.GetSocketRequest(socket_id=socket_ref.socket_id)
            )
            sent += socket.socket.data.keep_alives_sent
    return sent


@contextlib.asynccontextmanager
async def pinging_channel(s: Serving) -> AsyncIterator[tuple[grpc.aio.Channel, str]]:
    """A channel to `s` that pings every second, and the target that names it in
    Channelz (one of its own: not s.channel's)."""
    target = f"ipv4:{s.target}"
    async with grpc.aio.insecure_channel(target, options=PINGING) as channel:
        yield channel, target


async def stay_quiet_through_pings(
    s: Serving, channel: grpc.aio.Channel, target: str, call: grpc.aio.Call | None = None
) -> None:
    """Sends nothing on `channel` until it has sent QUIET_PINGS keepalive pings; fails
    if the server hangs up first (`call` ends, or the channel leaves READY)."""
    # The channelz stubs' types know only sync channels.
    channelz: Any = channelz_pb2_grpc.ChannelzStub(s.channel)  # type: ignore[arg-type]
    pinger = await channel_id(channelz, target)
    give_up = time.monotonic() + 30
    while await keepalives_sent(channelz, pinger) < QUIET_PINGS:
        if call is not None and call.done():
            code, details = await call.code(), await call.details()
            raise AssertionError(f"the server hung up: {code} {details!r}")
        state = channel.get_state()
        assert state == grpc.ChannelConnectivity.READY, f"the server hung up: {state}"
        assert time.monotonic() < give_up, "the client stopped pinging"
        await asyncio.sleep(0.05)


def test_client_pings_no_oftener_than_the_minimum_keep_a_quiet_stream_open(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that pings to find a dead connection (grpc-js and grpc-go callers ping
    every 61 s to 5 min) was hung up on, GOAWAY too_many_pings, ending its open calls:
    the minimum the server takes was set under a name gRPC does not read. The minimum
    lowered to 0.5 s, a stream quiet through pings 1 s apart still answers."""
    monkeypatch.setattr(app, "MIN_CLIENT_PING_INTERVAL_MS", LOWERED_MIN_CLIENT_PING_INTERVAL_MS)

    async def scenario() -> pb.InferStreamResponse:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            gate = s.server._listeners[0].acceptors._gate
            async with pinging_channel(s) as (channel, target):
                stream = pb_grpc.InferenceServiceStub(channel).InferStream(timeout=60)
                await until(lambda: gate.stream_calls == 1)
                await stay_quiet_through_pings(s, channel, target, stream)
                await stream.write(request(rows(1), request_id="after-the-pings"))
                answer = await stream.read()
                await stream.done_writing()
                assert isinstance(answer, pb.InferStreamResponse), answer
                return answer

    answer = asyncio.run(scenario())
    assert answer.request_id == "after-the-pings"
    assert answer.WhichOneof("result") == "response"


def test_client_pings_keep_a_connection_without_calls_open(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc-js' keepalive_permit_without_calls and grpc-go's PermitWithoutStream ping a
    connection with no call open: gRPC's default takes one per 2 h there and hangs up on
    more. The minimum lowered to 0.5 s, pings 1 s apart keep it."""
    monkeypatch.setattr(app, "MIN_CLIENT_PING_INTERVAL_MS", LOWERED_MIN_CLIENT_PING_INTERVAL_MS)

    async def scenario() -> pb.InferResponse:
        async with (
            serving(RecordingEngine(str(small_model)), config(small_model)) as s,
            pinging_channel(s) as (channel, target),
        ):
            stub = pb_grpc.InferenceServiceStub(channel)
            await stub.GetModel(pb.GetModelRequest(), timeout=30)  # connected
            await stay_quiet_through_pings(s, channel, target)
            return await stub.Infer(request(rows(1)), timeout=30)

    assert output(asyncio.run(scenario())).shape == (1, 10)


def test_compressed_requests_turned_off_are_refused_before_they_run(small_model: Path) -> None:
    """gRPC inflates a compressed request up to max_message_bytes before laneserve reads
    it (78 KiB of gzip became 64 MiB); with compressed_requests off its core refuses one
    on its header, naming the algorithm, and plain requests are answered."""

    async def scenario() -> tuple[list[tuple[grpc.StatusCode, str]], list[int]]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, compressed_requests=False)) as s:
            refusals = []
            for algorithm in (grpc.Compression.Gzip, grpc.Compression.Deflate):
                async with grpc.aio.insecure_channel(s.target, compression=algorithm) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await pb_grpc.InferenceServiceStub(channel).Infer(
                            request(rows(1)), timeout=30
                        )
                refusals.append((caught.value.code(), caught.value.details() or ""))
            assert output(await s.stub.Infer(request(rows(1)), timeout=30)).shape == (1, 10)
        return refusals, engine.batches

    refusals, batches = asyncio.run(scenario())
    assert refusals == [
        (grpc.StatusCode.UNIMPLEMENTED, "Compression algorithm 'gzip' is disabled."),
        (grpc.StatusCode.UNIMPLEMENTED, "Compression algorithm 'deflate' is disabled."),
    ]
    assert batches == [1], "only the plain request ran"


def test_compressed_requests_are_answered_by_default(small_model: Path) -> None:
    async def scenario() -> pb.InferResponse:
        async with (
            serving(RecordingEngine(str(small_model)), config(small_model)) as s,
            grpc.aio.insecure_channel(s.target, compression=grpc.Compression.Gzip) as channel,
        ):
            return await pb_grpc.InferenceServiceStub(channel).Infer(request(rows(2)), timeout=30)

    assert output(asyncio.run(scenario())).shape == (2, 10)


def test_every_request_gets_exactly_one_answer(small_model: Path) -> None:
    """Random deadlines, cancellations and a shutdown in the middle: every call ends once,
    the server accounts every admitted request exactly once, and no request answered
    EXPIRED_IN_QUEUE ever ran."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        rng = random.Random(7)
        async with serving(engine, config(small_model, max_batch_size=16)) as s:
            # Plain traffic first: all of it must succeed.
            split: set[int] = set()  # the first tags of requests split across batches
            plain = [s.stub.Infer(request(rows(2, start=2 * i))) for i in range(50)]
            assert all(output(r).shape == (2, 10) for r in await asyncio.gather(*plain))
            calls: list[tuple[int, grpc.aio.UnaryUnaryCall[pb.InferRequest, pb.InferResponse]]] = []
            tag = 100
            stopping: asyncio.Future[None] | None = None
            for i in range(300):
                count = rng.choice([1, 1, 2, 5, 20])
                if count > 16:  # max_batch_size
                    split.add(tag)
                call = s.stub.Infer(
                    request(
                        rows(count, start=tag),
                        lane=rng.choice(["interactive", "standard", "bulk"]),
                        timeout_ms=rng.choice([0, 2, 20, 200]),
                    ),
                    timeout=rng.choice([None, 0.05, 1.0]),
                )
                calls.append((tag, call))
                tag += count
                if rng.random() < 0.1:
                    call.cancel()
                if i == 200:
                    stopping = asyncio.ensure_future(s.server.stop(grace_s=0.02))
                if i % 25 == 0:
                    await asyncio.sleep(0)
            outcomes: dict[int, str] = {}
            for first_tag, call in calls:
                try:
                    await call
                    outcomes[first_tag] = "OK"
                except asyncio.CancelledError:
                    outcomes[first_tag] = "CANCELLED"
                except grpc.aio.AioRpcError as error:
                    reason = rich_status(error)[0]
                    outcomes[first_tag] = reason or error.code().name
            assert stopping is not None
            await stopping
            assert s.server.scheduler.live_entries == 0, "no admitted request is left open"
            snapshot = s.server.stats.snapshot()
            for lane in snapshot.lanes:
                assert lane.admitted == sum(lane.answered.values()), lane
        ran = set(engine.ran_tags)
        # A request of 20 rows runs in parts (max_batch_size 16): it may expire after its
        # first part ran, and is answered EXPIRED_IN_QUEUE for the rest, which never runs.
        expired = [tag for tag, outcome in outcomes.items() if outcome == "EXPIRED_IN_QUEUE"]
        assert not ran.intersection(expired) - split, "an expired request was executed"
        ok = [tag for tag, outcome in outcomes.items() if outcome == "OK"]
        assert ran.issuperset(ok)
        assert len(engine.ran_tags) == len(ran), "no row ran twice"

    asyncio.run(scenario())


def test_calls_past_the_concurrency_limit_are_refused_as_grpc_refuses_them(
    small_model: Path,
) -> None:
    """max_concurrent_rpcs counts the inference calls on a port however gRPC's core
    handed them over (grpc.aio's loop or laneserve's acceptors): one over it is refused
    at once in gRPC's own words, which clients know, the bound in a trailer (it had none).
    Health checks are not counted: a flood of Infer calls does not fail the probes. Nor
    are an operator's calls: GetStats and GetModel were refused with the rest, just when
    an operator asks why."""
    bound = (
        "2 inference calls at once (Infer, InferStream, ModelInfer and ModelStreamInfer), "
        "server setting max_concurrent_rpcs 2"
    )

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_concurrent_rpcs=2)) as s:
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            await asyncio.to_thread(engine.entered.acquire)
            queued = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=1))))
            await until(lambda: queued_rows(s) == 1)
            for _ in range(3):  # whichever way each is taken
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await s.stub.Infer(request(rows(1, start=2)))
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert caught.value.details() == "Concurrent RPC limit exceeded!"
                # The bound in a trailer: a client in another language tells this refusal
                # from gRPC's final one of a message too large by it, not by the words.
                trailers = dict(caught.value.trailing_metadata() or ())
                assert trailers[grpc_accept.CALL_LIMIT_KEY] == bound
                assert bound in error_from_rpc(caught.value).message
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert sum(lane.depth_rows for lane in stats.lanes) == 1
            assert (await s.stub.GetModel(pb.GetModelRequest())).max_batch_size > 0
            assert await health_status(s.channel) == health_pb2.HealthCheckResponse.SERVING
            engine.release()
            await asyncio.gather(running, queued)
            assert sorted(engine.ran_tags) == [0, 1]

    asyncio.run(scenario())


def test_infer_calls_are_taken_by_the_acceptors_several_at_a_time(
    small_model: Path, small_reference: ort.InferenceSession
) -> None:
    """Each port keeps INFER_ACCEPTORS asks for Infer calls out beside grpc.aio's one: the
    calls the core hands them are answered like any other, each with its own rows'
    outputs."""
    inputs = [rows(1, start=index) for index in range(64)]

    async def scenario() -> tuple[list[pb.InferResponse], int]:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            calls = [s.stub.Infer(request(x), timeout=30) for x in inputs]
            answers = await asyncio.gather(*calls)
            return answers, sum(each.acceptors.taken for each in s.server._listeners)

    answers, taken = asyncio.run(scenario())
    for x, answer in zip(inputs, answers, strict=True):
        expected = small_reference.run(None, {"input": x})[0]
        np.testing.assert_allclose(output(answer), expected, rtol=1e-4, atol=1e-5)
    assert taken > 0, "no call came through the acceptors"


def test_without_the_grpc_internals_the_acceptors_stand_aside(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A grpc whose internals differ (a function gone, or other parameters): the acceptors
    start nothing and say so once; grpc.aio's own loop takes every call."""
    # As if a newer grpc had given the function another parameter. (Deleting it would
    # break grpc.aio's own loop, which looks it up in the same module.)
    expected = ("rpc_coro", "rpc_state", "loop", "method_name", "a_new_parameter")
    monkeypatch.setitem(grpc_accept._EXPECTED, "_schedule_rpc_coro", expected)

    async def scenario() -> int:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            answers = await asyncio.gather(
                *(s.stub.Infer(request(rows(1)), timeout=30) for _ in range(16))
            )
            assert len(answers) == 16
            return sum(each.acceptors.taken for each in s.server._listeners)

    assert asyncio.run(scenario()) == 0
    assert "lacks cygrpc._schedule_rpc_coro(" in caplog.text


def test_an_aio_server_without_is_running_leaves_the_acceptors_aside() -> None:
    """`is_running` is the acceptors' loop condition: a grpc whose AioServer lacked it
    failed the start with an AttributeError instead of falling back (see the test
    above); it is checked with the other internals now."""

    class Core:  # the ask is there, `is_running` is not
        def _make_request_call_future(self, method: bytes) -> None: ...

    assert grpc_accept._internals_missing(Core()) == ["AioServer.is_running"]


def test_idle_streams_take_at_most_half_the_calls_and_unary_calls_are_answered(
    small_model: Path,
) -> None:
    """A stream is a whole bulk job, open while its source is read, sending or not: 4 200
    that sent nothing took every slot of max_concurrent_rpcs 4 096, and every Infer and
    GetStats was refused, indefinitely, while the health check said SERVING. Streams take
    at most half the slots (here 4 of 8): the one over it is refused at once, in gRPC's
    words for a full port (which every client version retries; words of its own were
    final to older clients, whose bulk jobs then failed), the bound in a trailer, and
    unary calls are answered."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_concurrent_rpcs=8)) as s:
            gate = s.server._listeners[0].acceptors._gate
            stop = asyncio.Event()

            async def idle() -> AsyncIterator[pb.InferRequest]:
                await stop.wait()
                yield request(rows(1))  # never: the streams are cancelled first

            streams = []
            for _ in range(4):
                streams.append(s.stub.InferStream(idle()))
                await until(lambda: gate.stream_calls == len(streams))
            over = s.stub.InferStream(idle())
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(over.read(), 10)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.details() == grpc_accept.CALL_LIMIT_DETAILS
            trailers = dict(caught.value.trailing_metadata() or ())
            assert trailers[grpc_accept.STREAM_LIMIT_KEY] == (
                "4 stream calls (InferStream and ModelStreamInfer) at once, half of server "
                "setting max_concurrent_rpcs 8; unary calls keep the rest"
            )
            assert gate.stream_calls == 4
            answer = await s.stub.Infer(request(rows(1), lane="interactive"), timeout=10)
            assert len(answer.outputs) == 1
            stats = await s.stub.GetStats(pb.GetStatsRequest(), timeout=10)
            assert [lane.name for lane in stats.lanes]
            for stream in streams:
                stream.cancel()
            await until(lambda: gate.stream_calls == 0)

    asyncio.run(scenario())


def test_operator_calls_past_their_own_bound_are_refused_as_grpc_refuses_them(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GetModel and GetStats are counted apart from max_concurrent_rpcs (answered while
    every inference slot is taken), and were counted by nothing: each holding its
    request's bytes while it ran, they could pile up without bound. At most
    OPERATOR_LIMIT are in progress on a port: the one over is refused at once in gRPC's
    words for a full port, the bound in a trailer; inference calls go on meanwhile, and
    once the held calls end every one is answered and the port answers again."""
    limit = grpc_accept.OPERATOR_LIMIT
    release: list[asyncio.Event] = []
    get_stats = service.InferenceServicer.GetStats

    async def held(
        self: service.InferenceServicer, request: Any, context: Any
    ) -> pb.GetStatsResponse:
        await release[0].wait()  # fault injection: an operator call that awaits
        return await get_stats(self, request, context)

    monkeypatch.setattr(service.InferenceServicer, "GetStats", held)

    async def scenario() -> None:
        release.append(asyncio.Event())
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            gate = s.server._listeners[0].acceptors._gate
            calls = [
                asyncio.ensure_future(s.stub.GetStats(pb.GetStatsRequest(), timeout=30))
                for _ in range(limit)
            ]
            await until(lambda: gate.operator_calls == limit)
            for over in (
                s.stub.GetStats(pb.GetStatsRequest()),
                s.stub.GetModel(pb.GetModelRequest()),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await over
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert caught.value.details() == grpc_accept.CALL_LIMIT_DETAILS
                trailers = dict(caught.value.trailing_metadata() or ())
                assert trailers[grpc_accept.OPERATOR_LIMIT_KEY] == (
                    f"{limit} GetModel and GetStats calls at once, counted apart from the "
                    "inference calls (server setting max_concurrent_rpcs 4096)"
                )
            assert gate.calls == 0, "the operator calls take no inference slot"
            assert len((await s.stub.Infer(request(rows(1)), timeout=10)).outputs) == 1
            release[0].set()
            answers = await asyncio.gather(*calls)
            assert all(answer.instance_id == answers[0].instance_id for answer in answers)
            assert gate.operator_calls == 0
            assert (await s.stub.GetModel(pb.GetModelRequest(), timeout=10)).max_batch_size > 0

    asyncio.run(scenario())


def test_a_cancelled_stream_leaves_the_call_count(small_model: Path) -> None:
    """The count of calls in progress goes down when a stream ends early too (its
    responses are closed then, not when collected)."""

    async def scenario() -> int:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_concurrent_rpcs=1)) as s:
            engine.hold()
            stream = s.stub.InferStream(iter([request(rows(1), request_id="a")]))
            await asyncio.to_thread(engine.entered.acquire)
            stream.cancel()
            engine.release()
            codes = []
            until_s = time.monotonic() + 30  # the cancellation reaches the server
            while time.monotonic() < until_s:
                try:
                    return len((await s.stub.Infer(request(rows(1)), timeout=10)).outputs)
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code())
                await asyncio.sleep(0.01)
            raise AssertionError(f"the cancelled stream is still counted: {set(codes)}")

    assert asyncio.run(scenario()) == 1


def flood_until_refused(channel: grpc.Channel, sent: int) -> list[Any]:
    """Sends `sent` single-row Infer calls (tags 0 .. sent - 1) and blocks until gRPC's
    core refuses one (CANCELLED). Called from the event loop's thread, it keeps the loop
    from taking calls meanwhile, as an overload would keep it busy; the calls go out from
    `channel`, a sync channel, all the same. Their futures, each a grpc.Call as well as a
    grpc.Future (the stubs type neither)."""
    refused = threading.Event()

    def on_done(future: Any) -> None:
        if future.code() == grpc.StatusCode.CANCELLED:
            refused.set()

    infer = pb_grpc.InferenceServiceStub(channel).Infer
    futures: list[Any] = []
    for tag in range(sent):
        future = infer.future(request(rows(1, start=tag)), timeout=60)
        future.add_done_callback(on_done)
        futures.append(future)
    assert refused.wait(timeout=30), "gRPC's core refused a call past max_pending_calls"
    return futures


def held_by_the_core(server: LaneServer, calls: int) -> None:
    """Blocks (the event loop too, when called from it) until gRPC's core holds `calls`
    calls in all: it counts a call as started once it has it, before any Python runs."""
    give_up_s = time.monotonic() + 30
    while (counts := server.grpc_calls()) is None or counts.started < calls:
        assert time.monotonic() < give_up_s, f"calls not held: {counts}"
        time.sleep(0.005)


def test_calls_past_the_pending_limit_are_refused_unread_and_never_run(small_model: Path) -> None:
    """While the event loop takes no calls (blocked here on purpose, as an overload would
    keep it busy), gRPC's core holds the arriving ones; past max_pending_calls it refuses
    them CANCELLED before any Python runs. Every call still gets exactly one answer, and
    a refused call never ran."""
    sent = 32

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_pending_calls=4)) as s:
            # A sync channel: its calls go out from this thread while the loop is blocked.
            with grpc.insecure_channel(s.target) as channel:
                grpc.channel_ready_future(channel).result(timeout=10)
                futures = flood_until_refused(channel, sent)
                outcomes = await asyncio.to_thread(
                    lambda: [future.code() for future in futures]  # waits for every answer
                )
                refusal = next(f for f in futures if f.code() == grpc.StatusCode.CANCELLED)
                exception = refusal.exception()
                assert isinstance(exception, grpc.RpcError)
                error = error_from_rpc(exception)
            # gRPC's own counts (the Channelz service, as grpcurl reads it) show them. The
            # Channelz stubs' types know only sync channels.
            channelz: Any = channelz_pb2_grpc.ChannelzStub(s.channel)  # type: ignore[arg-type]
            servers = await channelz.GetServers(channelz_pb2.GetServersRequest())
            ours = max(servers.server, key=lambda server: server.ref.server_id).data
        ok = {tag for tag, code in enumerate(outcomes) if code == grpc.StatusCode.OK}
        cancelled = {tag for tag, code in enumerate(outcomes) if code == grpc.StatusCode.CANCELLED}
        assert len(ok) + len(cancelled) == sent, f"every call answered OK or refused: {outcomes}"
        assert cancelled, "the core refused calls past the limit"
        assert ok, "calls within the limit were served"
        assert set(engine.ran_tags) == ok, "exactly the calls answered OK ran"
        assert isinstance(error, CallCancelledError)
        assert error.retryable
        assert "max_pending_calls" in error.message, "the client names the likely cause"
        neither = ours.calls_started - ours.calls_succeeded - ours.calls_failed
        assert neither >= len(cancelled), "Channelz counts refused calls as started only"
        assert ours.calls_succeeded >= len(ok)

    asyncio.run(scenario())


@contextlib.contextmanager
def main_and_priority_channels(s: Serving) -> Iterator[tuple[grpc.Channel, grpc.Channel]]:
    """Sync channels to the main and the priority port, both connected: their calls go
    out from this thread while a test blocks the event loop."""
    with (
        grpc.insecure_channel(s.target) as main,
        grpc.insecure_channel(f"127.0.0.1:{s.server.priority_port}") as priority,
    ):
        for channel in (main, priority):
            grpc.channel_ready_future(channel).result(timeout=10)
        yield main, priority


def test_a_call_on_the_priority_port_does_not_queue_behind_the_main_ports_calls(
    small_model: Path,
) -> None:
    """gRPC's core queues the calls the event loop has not taken per port. With the loop
    blocked (as a flood would keep it busy) and the main port's queue full, so that the
    core refuses every further call there, a call on the priority port is still held,
    then served by the same lanes."""
    sent = 32

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        settings = config(small_model, max_pending_calls=4, priority_port=0)
        async with serving(engine, settings) as s:
            assert s.server.priority_port not in (None, s.server.port)
            with main_and_priority_channels(s) as (main, priority):
                futures = flood_until_refused(main, sent)
                first = pb_grpc.InferenceServiceStub(priority).Infer.future(
                    request(rows(1, start=1000)), timeout=60
                )
                held_by_the_core(s.server, sent + 1)  # the loop is still blocked
                answer = await asyncio.to_thread(first.result)
                outcomes = await asyncio.to_thread(lambda: [f.code() for f in futures])
        assert answer.timing.lane == "standard", "served by the same lanes"
        assert grpc.StatusCode.CANCELLED in outcomes, "the main port refused calls meanwhile"
        assert 1000 in engine.ran_tags

    asyncio.run(scenario())


def test_the_priority_port_refuses_past_its_own_shorter_pending_limit(small_model: Path) -> None:
    """The priority port's queue in gRPC's core has a bound of its own
    (priority_max_pending_calls), kept short because its callers wait on deadlines: with
    the event loop blocked, a flood on the priority port is refused past it, while as many
    calls on the main port, whose bound is higher, are all held and served."""
    sent = 32

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        settings = config(
            small_model, max_pending_calls=4 * sent, priority_max_pending_calls=4, priority_port=0
        )
        async with serving(engine, settings) as s:
            with main_and_priority_channels(s) as (main, priority):
                refused_there = flood_until_refused(priority, sent)
                infer = pb_grpc.InferenceServiceStub(main).Infer
                held = [
                    infer.future(request(rows(1, start=1000 + tag)), timeout=60)
                    for tag in range(sent)
                ]
                held_by_the_core(s.server, 2 * sent)  # the loop is still blocked
                priority_codes = await asyncio.to_thread(lambda: [f.code() for f in refused_there])
                main_codes = await asyncio.to_thread(lambda: [f.code() for f in held])
        assert grpc.StatusCode.CANCELLED in priority_codes, "the priority port refused"
        assert set(priority_codes) <= {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED}
        assert main_codes == [grpc.StatusCode.OK] * sent, "the main port held every call"
        assert {1000 + tag for tag in range(sent)} <= set(engine.ran_tags)

    asyncio.run(scenario())


def test_health_checks_are_not_refused_while_infer_calls_are(small_model: Path) -> None:
    """gRPC's core queues calls per method: with Infer's queue full and the event loop
    blocked, health checks on the same port are held, not refused with the flood, and
    answered SERVING once the loop goes on (a probe under overload is slow, not failed)."""
    sent = 32

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_pending_calls=4)) as s:
            with grpc.insecure_channel(s.target) as channel:
                grpc.channel_ready_future(channel).result(timeout=10)
                futures = flood_until_refused(channel, sent)
                # The health stubs' types lack the RPC attributes; the call itself is plain.
                health: Any = health_pb2_grpc.HealthStub(channel)
                check = health.Check
                checks = [
                    check.future(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(3)
                ]
                held_by_the_core(s.server, sent + len(checks))  # the loop is still blocked
                statuses = await asyncio.to_thread(lambda: [c.result().status for c in checks])
                outcomes = await asyncio.to_thread(lambda: [f.code() for f in futures])
        assert statuses == [health_pb2.HealthCheckResponse.SERVING] * len(checks)
        assert grpc.StatusCode.CANCELLED in outcomes, "Infer calls were refused meanwhile"

    asyncio.run(scenario())


def test_a_bug_while_answering_still_answers_the_call(small_model: Path) -> None:
    """An output the codec cannot encode (fault injection) must not leave the call hanging."""

    class ComplexOutputs(RecordingEngine):
        def run_batch(self, batch: Batch, rows_wanted: RowsWanted | None = None) -> BatchResult:
            result = super().run_batch(batch, rows_wanted)
            assert result.outputs is not None
            outputs = {name: array.astype(np.complex64) for name, array in result.outputs.items()}
            return dataclasses.replace(result, outputs=outputs)

    async def scenario() -> None:
        async with serving(ComplexOutputs(str(small_model)), config(small_model)) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(request(rows(1), request_id="encode-bug"), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert rich_status(caught.value)[0] == "ENGINE_FAILURE"

    asyncio.run(scenario())


def test_a_start_that_fails_to_bind_the_priority_port_releases_the_main_port(
    small_model: Path,
) -> None:
    """An embedder whose start fails (here: the priority port is taken) gets its main
    port back at once, not when the server object is collected: it can retry."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        with socket.socket() as held, socket.socket() as probe:
            held.bind(("127.0.0.1", 0))  # no SO_REUSEPORT: gRPC cannot share it
            held.listen()
            probe.bind(("127.0.0.1", 0))
            main_port = probe.getsockname()[1]
            probe.close()  # free, for the server to take
            settings = config(
                small_model,
                host="127.0.0.1",
                port=main_port,
                priority_port=held.getsockname()[1],
                metrics_port=-1,
            )
            server = LaneServer(engine, settings)
            with pytest.raises(OSError, match=r"server\.priority_port"):
                await server.start()
            with socket.socket() as again:
                again.bind(("127.0.0.1", main_port))  # EADDRINUSE while gRPC holds it

    asyncio.run(scenario())


def test_a_port_another_server_serves_is_refused_not_shared(small_model: Path) -> None:
    """With gRPC's default (SO_REUSEPORT) a second server bound the same port and the
    kernel split the connections between them."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            second = LaneServer(
                RecordingEngine(str(small_model)),
                config(small_model, host="127.0.0.1", port=s.server.port, metrics_port=-1),
            )
            with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{s.server.port}"):
                await second.start()

    asyncio.run(scenario())


def test_refusals_before_the_lanes_are_counted_in_the_lanes(small_model: Path) -> None:
    """Calls refused DRAINING at the servicer's state check, INVALID_INPUT when their
    inputs are decoded (before the scheduler sees them) or REQUEST_ID_REUSED (an id used
    for other inputs) count in their lane's `rejected`, as the scheduler's own refusals (a
    request over the lane's capacity: INVALID_INPUT too) do. Three kinds were counted
    nowhere: reused ids, and calls refused before they have a lane of the server's (bytes
    that do not parse, a lane it lacks), which count in the default lane: a label the
    server chose, whatever names clients send."""
    garbage = b"\x0a\xff\x01"  # field 1, length-delimited, 255 bytes announced, 1 sent

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            bad = request(rows(1), lane="interactive")
            bad.inputs[0].name = "nope"
            with pytest.raises(grpc.aio.AioRpcError) as invalid:
                await s.stub.Infer(bad)
            for name in ("vip", "x" * 100):
                with pytest.raises(grpc.aio.AioRpcError):
                    await s.stub.Infer(request(rows(1), lane=name))
            infer = raw_infer(s)
            with pytest.raises(grpc.aio.AioRpcError):
                await infer(garbage, timeout=10)
            await s.stub.Infer(request(rows(1, seed=1), lane="bulk", request_id="r1"))
            with pytest.raises(grpc.aio.AioRpcError) as reused:
                await s.stub.Infer(request(rows(1, seed=2), lane="bulk", request_id="r1"))
            s.server.state = Lifecycle.DRAINING
            try:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await s.stub.Infer(request(rows(1), lane="bulk"))
            finally:
                s.server.state = Lifecycle.SERVING
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rich_status(reused.value)[0] == "REQUEST_ID_REUSED"
        rejected = {lane.name: dict(lane.rejected) for lane in stats.lanes}
        assert rejected == {
            "interactive": {"INVALID_INPUT": 1},
            "standard": {"INVALID_INPUT": 3},  # the default lane: two lanes it lacks, garbage
            "bulk": {"REQUEST_ID_REUSED": 1, "DRAINING": 1},
        }

    asyncio.run(scenario())


def test_an_ipv6_host_in_brackets_passes_the_port_check() -> None:
    """`laneserve serve --host [::1] --port N` was refused before the model loaded with
    "cannot listen on [::1]:N (server.port): Name or service not known": the check ran
    getaddrinfo on the bracketed address, which gRPC binds but getaddrinfo cannot resolve.
    A port in use there is still refused, with the OS's reason."""
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::1", 0))
        taken = held.getsockname()[1]
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            free = probe.getsockname()[1]
        for host in ("::1", "[::1]"):
            check_ports_free(config(Path("m.onnx"), host=host, port=free, metrics_port=-1))
        held.listen()
        with pytest.raises(
            ConfigError, match=r"^server\.port: .*: Address already in use"
        ) as refused:
            check_ports_free(config(Path("m.onnx"), host="[::1]", port=taken, metrics_port=-1))
        assert refused.value.key == "server.port"


def test_calls_still_queued_in_grpc_when_the_drain_ends_are_answered_draining(
    small_model: Path,
) -> None:
    """Calls gRPC's core held, not yet read by the event loop, when the drain ended got a
    bare CANCELLED from gRPC's own stop: a client could not tell them from a call it
    cancelled itself, nor know it may retry elsewhere. Each gets UNAVAILABLE DRAINING."""
    count = 100  # under the core's soft limit (192 of max_pending_calls 256): none refused
    outcomes: list[BaseException | pb.InferResponse] = []

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, max_pending_calls=256)) as s:
            grpc_calls = s.server.grpc_calls
            baseline = grpc_calls()
            assert baseline is not None

            async def send() -> None:
                async with grpc.aio.insecure_channel(s.target) as channel:
                    stub = pb_grpc.InferenceServiceStub(channel)
                    calls = [stub.Infer(request(rows(1, start=i))) for i in range(count)]
                    outcomes.extend(await asyncio.gather(*calls, return_exceptions=True))

            client = threading.Thread(target=asyncio.run, args=(send(),))
            client.start()
            # The event loop is held, so every call waits in gRPC's core, until all have
            # arrived; the drain begins at the next turn.
            _hold_the_loop_until(lambda: _started_since(grpc_calls(), baseline) >= count)
            await s.server.stop(grace_s=5.0)
            await asyncio.to_thread(client.join)

    asyncio.run(scenario())
    assert len(outcomes) == count
    answers = []
    for outcome in outcomes:
        assert isinstance(outcome, grpc.aio.AioRpcError), outcome
        answers.append((outcome.code(), rich_status(outcome)[0]))
    assert set(answers) == {(grpc.StatusCode.UNAVAILABLE, "DRAINING")}, set(answers)


def _started_since(calls: GrpcCalls | None, baseline: GrpcCalls) -> int:
    assert calls is not None
    return calls.started - baseline.started


def _hold_the_loop_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Blocks the calling thread (the event loop, when called from a coroutine) until
    `condition` holds: gRPC's core then queues every call that arrives."""
    until_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < until_s, "condition not met while the loop was held"
        time.sleep(0.001)


def test_the_extra_asks_are_out_only_below_two_batches_of_calls_in_progress() -> None:
    """The gate's `below_accept`, which the acceptors wait on, is set while fewer unary
    calls are in progress than `accept_below` (here 2); a stream's call (open for a
    whole job) does not hold the asks back."""

    async def scenario() -> list[bool]:
        gate = grpc_accept.CallGate(limit=10, accept_below=2)
        release = asyncio.Event()
        seen: list[bool] = []

        async def unary(request: object, _context: object) -> object:
            await release.wait()
            return request

        async def stream(request: object, _context: object) -> Any:
            await release.wait()
            yield request

        calls = [
            asyncio.ensure_future(anext(gate.gate(stream, response_streaming=True)(0, None))),
            asyncio.ensure_future(gate.gate(unary, response_streaming=False)(1, None)),
        ]
        await asyncio.sleep(0)
        seen.append(gate.below_accept.is_set())  # a stream and one unary call
        calls.append(asyncio.ensure_future(gate.gate(unary, response_streaming=False)(2, None)))
        await asyncio.sleep(0)
        seen.append(gate.below_accept.is_set())  # two unary calls
        assert gate.calls == 3
        release.set()
        await asyncio.gather(*calls)
        seen.append(gate.below_accept.is_set())  # they ended
        return seen

    assert asyncio.run(scenario()) == [True, False, True]


def _recording_reader() -> tuple[list[bytes], Callable[[bytes], bytes]]:
    """A deserializer that records the bodies it parsed, and its record."""
    parsed: list[bytes] = []

    def read(data: bytes) -> bytes:
        parsed.append(data)
        return data

    return parsed, read


def test_a_unary_call_over_the_limit_is_refused_before_its_message_is_parsed() -> None:
    """gRPC's own limit refused before reading a message; the gate's deserializer does not
    parse one over the limit either (up to max_message_bytes each, under a flood), and
    the handler refuses what it hands over."""
    parsed, read = _recording_reader()
    gate = grpc_accept.CallGate(limit=1, accept_below=2)
    deserialize = gate.deserializer(read)
    assert deserialize(b"first") == b"first"
    gate.unary_calls = 1  # one in progress: at the limit
    assert deserialize(b"second") is grpc_accept.OVER_LIMIT
    assert parsed == [b"first"]


def test_an_operator_call_over_its_bound_is_refused_before_its_message_is_parsed() -> None:
    """The operator calls' bound is their own: the inference calls at their limit do not
    refuse one, and one over the operator bound is not parsed (the handler refuses it)."""
    parsed, read = _recording_reader()
    gate = grpc_accept.CallGate(limit=1, accept_below=2)
    deserialize = gate.operator_deserializer(read)
    gate.unary_calls = 1  # the inference calls at their limit
    assert deserialize(b"first") == b"first"
    gate.operator_calls = gate.operator_limit
    assert deserialize(b"second") is grpc_accept.OVER_LIMIT
    assert parsed == [b"first"]


def test_an_address_not_this_hosts_is_refused_before_the_model_loads_with_port_0() -> None:
    """`--host 10.255.255.1 --port 0` passed the check (port 0 was not checked) and was
    refused only by gRPC's bind, after the model had loaded and been probed (minutes on a
    GPU). Port 0 is checked for its address; -1 (none) is not checked. The setting at
    fault is the host, not the port it was refused as (`serve` names its flag by it)."""
    foreign = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never a local address
    with pytest.raises(ConfigError) as refused:
        check_ports_free(config(Path("m.onnx"), host=foreign, port=0, metrics_port=-1))
    assert refused.value.key == "server.host"
    assert str(refused.value) == (
        "server.host: cannot listen on 192.0.2.1:0: Cannot assign requested address; "
        "expected an address of this host, or a name that resolves to one"
    )
    check_ports_free(config(Path("m.onnx"), host="127.0.0.1", port=0, metrics_port=-1))


def test_an_error_answer_whose_call_ended_meanwhile_ends_as_a_cancel() -> None:
    """The call ended in gRPC's core between `abort_with`'s check and its abort (a caller
    whose deadline is the request's own timeout): sending the status failed with gRPC's
    ExecuteBatchError, which gRPC logged at ERROR with a traceback, 40 times in 20 s of
    such load. It ends as the cancel it is. (The call's end in the core between the two
    steps cannot be timed in a test; its failure is raised as gRPC raises it.)"""

    class EndedCall:
        def cancelled(self) -> bool:
            return False  # not yet seen as cancelled when checked

        async def abort(self, *_args: Any, **_kwargs: Any) -> None:
            raise grpc.aio.InternalError('Failed "execute_batch"')

    call: Any = EndedCall()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(grpc_methods.abort_with(call, LaneFullError("lane 'bulk' is full")))
    with pytest.raises(asyncio.CancelledError):  # the call gate's refusal, the same way
        asyncio.run(grpc_accept.refuse_over_limit(call))


def test_grpc_failing_to_send_an_answer_to_an_ended_call_is_not_an_error(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer returned just as its call ended in gRPC's core (its caller's deadline
    passed, or it left) cannot be sent: gRPC logged a traceback at ERROR per such call (a
    soak of deadline-bound calls: 21 in 25 s), the caller's end and not a fault. A served
    server takes that record, and only that one, for its own methods, from gRPC's core
    logger into its answers_unsent line (INFO), which counts them; another service in the
    process keeps its own. gRPC formats the method into the message (an earlier filter
    read it from the record's arguments, and let every real one through: 1-12 a drill)."""
    from grpc._cython import cygrpc  # noqa: PLC0415 - the exception gRPC raises

    core = logging.getLogger("grpc._cython.cygrpc")
    unsent = cygrpc.ExecuteBatchError('Failed "execute_batch"')
    method = "/laneserve.v1.InferenceService/Infer"
    failed = (type(unsent), unsent, None)

    async def scenario() -> None:
        with caplog.at_level(logging.INFO):  # to the end: the last line comes at the stop
            async with serving(RecordingEngine(str(small_model)), config(small_model)):
                # As gRPC logs it (the method formatted in), and with it as an argument.
                core.error(
                    "ExecuteBatchError raised in core by servicer method [%s]" % method,  # noqa: UP031 - gRPC's own form
                    exc_info=failed,
                )
                core.error(
                    "ExecuteBatchError raised in core by servicer method [%s]",
                    method,
                    exc_info=failed,
                )
                core.error("Unexpected [%s] raised by servicer method [%s]", "Boom", method)
                core.error(
                    "ExecuteBatchError raised in core by servicer method [/other.Service/Call]",
                    exc_info=failed,
                )

    asyncio.run(scenario())
    assert [record.getMessage() for record in caplog.records if record.name == core.name] == [
        f"Unexpected [Boom] raised by servicer method [{method}]",
        "ExecuteBatchError raised in core by servicer method [/other.Service/Call]",
    ]
    counted = [
        getattr(record, "fields", {})["unsent"]
        for record in caplog.records
        if getattr(record, "event", None) == "answers_unsent"
    ]
    # The first at once, the second in the line its interval ends with (at the stop).
    assert counted == [{method: 1}, {method: 1}]


def test_servers_started_on_two_threads_at_once_each_count_their_own_grpc_calls(
    small_model: Path,
) -> None:
    """Each server finds its own Channelz id as the ids that appeared while it was made;
    two servers made at once on two threads' event loops (two models in one embedding
    process) took each other's, and counted each other's calls (GetStats' grpc_calls,
    laneserve_grpc_calls_total, and the calls a drain waits for)."""
    per_thread = 3
    barrier = threading.Barrier(2)
    ids: list[frozenset[int]] = []
    lock = threading.Lock()

    def serve_several() -> None:
        async def scenario() -> None:
            for _ in range(per_thread):
                engine = RecordingEngine(str(small_model))
                settings = dataclasses.replace(
                    config(small_model), host="127.0.0.1", port=0, metrics_port=-1
                )
                server = LaneServer(engine, settings)
                barrier.wait(timeout=60)
                await server.start()
                try:
                    assert server._grpc_calls is not None
                    with lock:
                        ids.append(server._grpc_calls._ids)
                finally:
                    await server.stop(grace_s=1.0)

        asyncio.run(scenario())

    threads = [threading.Thread(target=serve_several) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(ids) == 2 * per_thread
    assert [len(own) for own in ids] == [1] * len(ids), ids
    assert len(frozenset().union(*ids)) == len(ids), "no id is two servers'"


def test_an_engine_serves_one_server(small_model: Path) -> None:
    """A server's stop ends its engine's runs for good: a second server on the same
    engine stayed SERVING and answered every request DRAINING (retryable) once the first
    stopped, and one made after it failed with "the server stopped while this batch
    ran". An engine serving, or spent, is refused by name when the server is made; one
    whose server failed to start (its port in use) serves the next."""
    engine = RecordingEngine(str(small_model))

    async def scenario() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            in_use = dataclasses.replace(
                config(small_model), host="127.0.0.1", port=taken.getsockname()[1]
            )
            failed = LaneServer(engine, in_use)
            with pytest.raises(OSError, match="port"):
                await failed.start()
        async with serving(engine, config(small_model)) as s:
            assert output(await s.stub.Infer(request(rows(1)))).shape == (1, 10)
            with pytest.raises(RuntimeError, match="this Engine serves another LaneServer"):
                LaneServer(engine, config(small_model))
        with pytest.raises(RuntimeError, match="this Engine served a LaneServer that stopped"):
            LaneServer(engine, config(small_model))

    asyncio.run(scenario())


def test_an_engine_for_a_device_that_is_not_one_is_refused_by_name(small_model: Path) -> None:
    """The configuration refuses `device = "tpu"` by name; an Engine made in code ran it
    as "auto"."""
    with pytest.raises(EngineStartError) as refused:
        Engine(str(small_model), device="tpu")  # type: ignore[arg-type]
    assert str(refused.value) == "device: expected one of ('auto', 'cuda', 'cpu'), got 'tpu'"


# ---- which model answers ------------------------------------------------------------------


def _variant(
    source: Path, path: Path, version: int, metadata: dict[str, str] | None = None
) -> None:
    """`source` with its first weights scaled by `version`, its model_version `version`
    and `metadata` as its metadata_props, written to `path` (weights kept inline)."""
    model = onnx.load(str(source))
    model.model_version = version
    del model.metadata_props[:]
    for key, value in (metadata or {}).items():
        model.metadata_props.add(key=key, value=value)
    weights = model.graph.initializer[0]
    weights.CopyFrom(
        numpy_helper.from_array(numpy_helper.to_array(weights) * version, weights.name)
    )
    onnx.save(model, str(path))


async def _get_model(path: Path) -> pb.GetModelResponse:
    engine = RecordingEngine(str(path), estimate=no_static_estimate)
    async with serving(engine, config(path)) as s:
        return await s.stub.GetModel(pb.GetModelRequest())


def test_get_model_tells_two_models_at_one_path_apart(small_model: Path, tmp_path: Path) -> None:
    """Two models that differ only in their weights and model_version, served one after
    the other from the same path, gave identical GetModel answers: nothing said which
    model answered. GetModel names the file's SHA-256 (`sha256sum`'s), the model's own
    metadata and the server's version."""
    path = tmp_path / "current.onnx"
    answers, digests = [], []
    for version in (1, 2):
        _variant(small_model, path, version, {"version": f"v{version}"})
        digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
        answers.append(asyncio.run(_get_model(path)))
    assert digests[0] != digests[1]
    assert [answer.model_sha256 for answer in answers] == digests
    assert [answer.model_version for answer in answers] == [1, 2]
    assert [dict(answer.custom_metadata) for answer in answers] == [
        {"version": "v1"},
        {"version": "v2"},
    ]
    assert answers[0].producer_name == "laneserve.demo_model"
    assert answers[0].graph_name == "laneserve_demo_mlp"
    assert answers[0].server_version == importlib.metadata.version("laneserve")


def test_get_model_leaves_out_a_model_version_the_model_does_not_set(small_model: Path) -> None:
    """ONNX Runtime reads an unset model_version as INT64_MAX: GetModel leaves the field
    out instead of reporting that number (a version of 0 set is reported as 0)."""
    answer = asyncio.run(_get_model(small_model))
    assert not answer.HasField("model_version")
    assert answer.model_sha256 == hashlib.sha256(small_model.read_bytes()).hexdigest()


def test_the_model_hash_covers_its_external_data_files(small_model: Path, tmp_path: Path) -> None:
    """With its weights in external data files the model file alone is the graph: weights
    rewritten in place leave it as it was. The hash is of the model file and then of each
    external data file, in the order the model names them (`cat model data | sha256sum`)."""
    path, data = tmp_path / "external.onnx", tmp_path / "external.data"
    onnx.save(
        onnx.load(str(small_model)),
        str(path),
        save_as_external_data=True,
        location=data.name,
        size_threshold=0,
    )
    model_bytes = path.read_bytes()
    first = Engine(str(path), device="cpu", estimate=no_static_estimate).identity.sha256
    assert first == hashlib.sha256(model_bytes + data.read_bytes()).hexdigest()
    weights = bytearray(data.read_bytes())
    weights[:4] = np.float32(7.0).tobytes()  # the first weight, same file size
    data.write_bytes(bytes(weights))
    second = Engine(str(path), device="cpu", estimate=no_static_estimate).identity.sha256
    assert path.read_bytes() == model_bytes
    assert second == hashlib.sha256(model_bytes + bytes(weights)).hexdigest() != first


def _nested_model() -> onnx.ModelProto:
    """A model with tensors everywhere one can be: graph initializers, a Constant node's
    attribute, an If's branches (each with an initializer and a Constant) and a model
    function's Constant. Never run: only where its tensors are counts."""
    counter = iter(range(100))

    def tensor(name: str) -> onnx.TensorProto:
        return numpy_helper.from_array(np.full(4, next(counter), np.float32), name)

    def constant(output: str) -> onnx.NodeProto:
        return onnx.helper.make_node("Constant", [], [output], value=tensor(""))

    def branch(name: str) -> onnx.GraphProto:
        out = onnx.helper.make_tensor_value_info(f"{name}_out", onnx.TensorProto.FLOAT, [4])
        add = onnx.helper.make_node("Add", [f"{name}_c", f"{name}_w"], [f"{name}_out"])
        return onnx.helper.make_graph(
            [constant(f"{name}_c"), add], name, [], [out], [tensor(f"{name}_w")]
        )

    function = onnx.helper.make_function(
        "local",
        "plus_one",
        ["x"],
        ["y"],
        [constant("one"), onnx.helper.make_node("Add", ["x", "one"], ["y"])],
        [onnx.helper.make_opsetid("", 17)],
    )
    cond = onnx.helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])
    out = onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [4])
    graph = onnx.helper.make_graph(
        [
            constant("k"),
            onnx.helper.make_node(
                "If", ["cond"], ["chosen"], then_branch=branch("then"), else_branch=branch("else")
            ),
            onnx.helper.make_node("plus_one", ["chosen"], ["out"], domain="local"),
        ],
        "nested",
        [cond],
        [out],
        [tensor("w1"), tensor("w2")],
    )
    return onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("local", 1)],
        functions=[function],
    )


@pytest.mark.parametrize(
    ("layout", "to_one_file"),
    [("inline", False), ("one_file", True), ("file_per_tensor", False)],
)
@pytest.mark.parametrize("source", ["small_model", "nested"])
def test_the_external_data_files_hashed_are_those_onnx_names(
    small_model: Path, tmp_path: Path, layout: str, to_one_file: bool, source: str
) -> None:
    """The hash's files are found by walking the model's protobuf by hand (model_identity:
    onnx.load would parse inline weights into the server's memory): the files it finds
    are those onnx's own external_data_helper names, each once, for weights inline, in
    one file, and one file per tensor, in subgraphs, node attributes and functions."""
    model = onnx.load(str(small_model)) if source == "small_model" else _nested_model()
    path = tmp_path / "model.onnx"
    if layout == "inline":
        onnx.save(model, str(path))
    else:
        onnx.save(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=to_one_file,
            location="weights.data",
            size_threshold=0,
            convert_attribute=True,
        )
    saved = onnx.load(str(path), load_external_data=False)
    named = [
        external_data_helper.ExternalDataInfo(each).location
        # The helper's own walk (private: onnx has no public list of the locations).
        for each in external_data_helper._get_all_tensors(saved)
        if external_data_helper.uses_external_data(each)
    ]
    found = [each.relative_to(tmp_path).as_posix() for each, _ in model_files(str(path))]
    assert found[0] == path.name
    assert sorted(found[1:]) == sorted(set(named))
    if layout == "inline":
        assert named == []
    elif layout == "one_file":
        assert found[1:] == ["weights.data"]
    else:
        assert len(found[1:]) == len(named) > 1


def _save_with_external_data(source: Path, path: Path) -> Path:
    """`source` saved to `path` with every weight in one external data file beside it,
    whose path is returned."""
    data = path.with_suffix(".data")
    onnx.save(
        onnx.load(str(source)),
        str(path),
        save_as_external_data=True,
        location=data.name,
        size_threshold=0,
    )
    return data


def _hash_unavailable(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if getattr(r, "event", None) == "model_hash_unavailable"
    ]


@pytest.mark.parametrize("change", ["replaced", "touched", "data_removed"])
def test_a_model_file_changed_while_the_session_loads_it_is_served_with_no_hash(
    small_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, change: str
) -> None:
    """The hash is read after the session loaded the model: a file changed in between
    would be hashed as a model the server may not serve, so the hash is left empty and
    the warning names the file and why. The start is never refused for it: the session
    loaded fine (a touch, or NFS's and overlayfs's stat, refused starts that served)."""
    path = tmp_path / "model.onnx"
    _variant(small_model, path, 1)
    data = _save_with_external_data(path, path) if change == "data_removed" else None

    class ChangedWhileLoading(Engine):
        def _open_session(self, *args: Any, **kwargs: Any) -> Any:
            opened = super()._open_session(*args, **kwargs)
            if change == "replaced":
                _variant(small_model, tmp_path / "next.onnx", 2)
                (tmp_path / "next.onnx").replace(path)  # a rollout's rename over the file
            elif change == "touched":
                status = path.stat()
                os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))
            else:
                assert data is not None
                data.unlink()
            return opened

    with caplog.at_level(logging.WARNING):
        engine = ChangedWhileLoading(str(path), device="cpu", estimate=no_static_estimate)
    assert engine.identity.sha256 == ""
    (warning,) = _hash_unavailable(caplog)
    if change == "data_removed":
        assert f"No such file or directory: '{data}'" in warning
    else:
        assert f"{path} changed while loading" in warning


@pytest.mark.parametrize(
    ("content", "why"),
    [(bytes(4096), "field number 0 at byte 0"), (b"\xff" * 4096, "varint at byte 0 runs past")],
    ids=["zeros", "bytes_0xff"],
)
def test_a_model_file_of_zeros_or_garbage_is_refused_by_the_runtime_not_walked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, why: str
) -> None:
    """A file of zeros was walked a byte at a time as field 0 (100 MB: 13 s before ONNX
    Runtime refused it in 0.01 s), a run of bytes >= 0x80 read as one varint in time
    quadratic in its length. The walk stops at the first such byte and the runtime's
    own refusal follows."""
    path = tmp_path / "garbage.onnx"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=why):
        model_files(str(path))
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(EngineStartError, match="INVALID_PROTOBUF"),
    ):
        Engine(str(path), device="cpu", estimate=no_static_estimate)


@pytest.mark.parametrize("location", [".", "gone.bin", "weights.bin"])
def test_external_data_entries_beside_inline_data_are_left_out_of_the_model_hash(
    small_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, location: str
) -> None:
    """A tensor's external_data entries name its file only when its data_location is
    EXTERNAL (ONNX Runtime's test, and onnx's uses_external_data): entries left beside
    inline data are not read, whether they name a directory, no file, or a file."""
    path = tmp_path / "model.onnx"
    (tmp_path / "weights.bin").write_bytes(b"not the weights")
    model = onnx.load(str(small_model))
    for tensor in model.graph.initializer:
        assert tensor.HasField("raw_data")
        tensor.external_data.add(key="location", value=location)
    onnx.save(model, str(path))
    with caplog.at_level(logging.WARNING):
        engine = Engine(str(path), device="cpu", estimate=no_static_estimate)
    assert engine.identity.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert _hash_unavailable(caplog) == []


def _length_delimited(field: int, payload: bytes) -> bytes:
    """A protobuf length-delimited field: its tag, its length, `payload`."""

    def varint(value: int) -> bytes:
        out = bytearray()
        while value >= 0x80:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        return bytes([*out, value])

    return varint(field << 3 | 2) + varint(len(payload)) + payload


def test_a_model_tensors_data_location_may_come_before_its_external_data(
    small_model: Path, tmp_path: Path
) -> None:
    """onnx writes a tensor's external_data (field 13) before its data_location (14);
    protobuf allows either order, and the runtime reads either: the walk too."""
    path = tmp_path / "model.onnx"
    data = _save_with_external_data(small_model, path)
    model = onnx.load(str(path), load_external_data=False)
    tensors = list(model.graph.initializer)
    model.graph.ClearField("initializer")
    reordered = b""
    for tensor in tensors:
        rest = onnx.TensorProto()
        rest.CopyFrom(tensor)
        rest.ClearField("data_location")
        location_first = onnx.TensorProto(data_location=onnx.TensorProto.EXTERNAL)
        # Two serialized messages one after the other are read as one, merged.
        tensor_bytes = location_first.SerializeToString() + rest.SerializeToString()
        reordered += _length_delimited(5, tensor_bytes)  # GraphProto.initializer
    model_bytes = model.SerializeToString() + _length_delimited(7, reordered)  # .graph
    path.write_bytes(model_bytes)
    read = onnx.load_model_from_string(model_bytes)
    assert [t.name for t in read.graph.initializer] == [t.name for t in tensors]
    assert all(external_data_helper.uses_external_data(t) for t in read.graph.initializer)
    engine = Engine(str(path), device="cpu", estimate=no_static_estimate)
    assert engine.identity.sha256 == hashlib.sha256(model_bytes + data.read_bytes()).hexdigest()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_model_data_location_that_is_not_a_regular_file_is_not_opened(
    small_model: Path, tmp_path: Path, kind: str
) -> None:
    """Opening a FIFO waits for a writer: the hash's open would hang the start. A
    location that is not a regular file is refused by its path, unopened (the hash is
    then empty, warned about; the runtime's load says the rest)."""
    path = tmp_path / "model.onnx"
    data = _save_with_external_data(small_model, path)
    data.unlink()
    if kind == "fifo":
        os.mkfifo(data)
    else:
        data.mkdir()
    with pytest.raises(ValueError, match=f"{data} is not a regular file"):
        model_files(str(path))


def test_the_model_authors_metadata_is_bounded_and_what_is_left_out_logged(
    small_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """metadata_props and the doc string are the model author's: a tokenizer or a config
    kept there would be repeated in every GetModel answer. Entries are kept in key order
    within CUSTOM_METADATA_MAX_BYTES, the description is cut to DESCRIPTION_MAX_BYTES."""
    path = tmp_path / "annotated.onnx"
    big = "x" * CUSTOM_METADATA_MAX_BYTES
    _variant(small_model, path, 3, {"a_small": "1", "b_config": big, "c_small": "2"})
    model = onnx.load(str(path))
    model.doc_string = "é" * DESCRIPTION_MAX_BYTES
    onnx.save(model, str(path))
    with caplog.at_level(logging.WARNING):
        answer = asyncio.run(_get_model(path))
    assert dict(answer.custom_metadata) == {"a_small": "1", "c_small": "2"}
    description = answer.description.encode()
    assert len(description) <= DESCRIPTION_MAX_BYTES
    assert answer.description.endswith("…")
    (left_out,) = [
        r for r in caplog.records if getattr(r, "event", None) == "model_metadata_left_out"
    ]
    assert left_out.fields["left_out"] == ["b_config"]  # type: ignore[attr-defined]


def test_the_startup_line_names_the_models_hash_and_version(
    small_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Logs show which model each instance served: the `startup` line names the model's
    SHA-256 (short in the message, whole in its field) and its model_version."""
    path = tmp_path / "model.onnx"
    _variant(small_model, path, 4)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with caplog.at_level(logging.INFO):
        asyncio.run(_get_model(path))
    (startup,) = [r for r in caplog.records if getattr(r, "event", None) == "startup"]
    assert f"(sha256 {digest[:12]}, model_version 4) on 127.0.0.1:" in startup.getMessage()
    fields = startup.fields  # type: ignore[attr-defined]
    assert (fields["model_sha256"], fields["model_version"]) == (digest, 4)


def _sequence_model(path: Path) -> Path:
    """A text model's signature: ids[N, S] and mask[N, S] (S dynamic, as a tokenizer's
    sequence length) beside features[N, 4]; each answered as itself (`NAME_out`)."""
    inputs: dict[str, tuple[int, list[str | int | None]]] = {
        "ids": (onnx.TensorProto.INT64, ["N", "S"]),
        "mask": (onnx.TensorProto.INT64, ["N", "S"]),
        "features": (onnx.TensorProto.FLOAT, ["N", 4]),
    }
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", [name], [f"{name}_out"]) for name in inputs],
        "sequence",
        [onnx.helper.make_tensor_value_info(n, kind, dims) for n, (kind, dims) in inputs.items()],
        [
            onnx.helper.make_tensor_value_info(f"{n}_out", kind, dims)
            for n, (kind, dims) in inputs.items()
        ],
    )
    return save_model(path, graph, check=False)


def _probe_shapes(answer: pb.GetModelResponse) -> dict[str, list[int]]:
    return {name: list(shape.dims) for name, shape in answer.probe_shapes.items()}


@pytest.mark.parametrize(
    ("given", "probed", "note"),
    [
        ({}, {"ids": [1], "mask": [1], "features": [4]}, True),
        ({"ids": (512,), "mask": (512,)}, {"ids": [512], "mask": [512], "features": [4]}, False),
    ],
    ids=["dynamic_sizes_at_1", "probe_shapes_given"],
)
def test_get_model_and_the_probe_line_name_the_row_shapes_the_probe_ran(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    given: dict[str, tuple[int, ...]],
    probed: dict[str, list[int]],
    note: bool,
) -> None:
    """GetModel's bytes per row and probed_batch_cap, and the `probe` line's, said
    nothing of the rows they were measured on: a text model probed at S = 1 read 214 B
    a row where its rows at S = 512 took 535 KiB. Both name each input's row shape as the
    probe ran it (dynamic sizes at 1 unless probe_shapes gives them), and the line says
    where sizes were left at 1."""
    path = _sequence_model(tmp_path / "sequence.onnx")

    async def scenario() -> pb.GetModelResponse:
        engine = Engine(str(path), device="cpu", probe_shapes=given, estimate=no_static_estimate)
        async with serving(engine, config(path, probe_shapes=given)) as s:
            return await s.stub.GetModel(pb.GetModelRequest())

    with caplog.at_level(logging.INFO):
        answer = asyncio.run(scenario())
    assert _probe_shapes(answer) == probed
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "probe"]
    assert line.fields["probe_shapes"] == probed  # type: ignore[attr-defined]
    at_1 = (
        " (dynamic sizes not configured are 1, longer rows take more: set server.probe_shapes, "
        "--probe-shape NAME=D1,D2,...)"
    )
    assert f" probe_shapes={probed}{at_1 if note else ''} estimate=" in line.getMessage()


def test_a_probe_shape_flag_is_the_row_shape_get_model_and_the_probe_line_report(
    tmp_path: Path,
) -> None:
    """`laneserve serve --probe-shape`: GetModel and the `probe` line report the sizes
    given, and the per-row estimate is a row of that shape (the ids and mask alone are
    2 x 512 int64s in and out)."""
    path = _sequence_model(tmp_path / "sequence.onnx")
    flags = ("--probe-shape", "ids=512", "--probe-shape", "mask=512")
    server = ServerProcess(["--model", str(path), "--port", "0", "--device", "cpu", *flags])
    try:
        line = server.wait_for(r"probe: .* probe_shapes=(\{[^}]*\}) estimate=")
        with grpc.insecure_channel(f"127.0.0.1:{server.port()}") as channel:
            answer = pb_grpc.InferenceServiceStub(channel).GetModel(
                pb.GetModelRequest(), timeout=30
            )
    finally:
        server.close()
    probed = {"ids": [512], "mask": [512], "features": [4]}
    assert line.group(1) == str(probed)
    assert _probe_shapes(answer) == probed
    assert answer.estimated_row_bytes >= 2 * 2 * 512 * 8


def _watch_gates(s: Serving) -> list[grpc_accept.CallGate]:
    """Each port's gate: the main port's first, then the priority port's."""
    return [listener.acceptors._gate for listener in s.server._listeners]


async def _open_watches(channel: grpc.aio.Channel, count: int) -> list[Any]:
    """`count` health Watch calls on `channel`, each open on the server (its first answer,
    SERVING, read). Opened 64 at a time: gRPC's core refuses calls not yet taken past
    max_pending_calls (CANCELLED)."""
    stub: Any = health_pb2_grpc.HealthStub(channel)
    watches: list[Any] = []
    while len(watches) < count:
        opening = [
            stub.Watch(health_pb2.HealthCheckRequest(service=""))
            for _ in range(min(64, count - len(watches)))
        ]
        answers = await asyncio.gather(*(watch.read() for watch in opening))
        assert {answer.status for answer in answers} == {health_pb2.HealthCheckResponse.SERVING}
        watches += opening
    return watches


async def _watch_refused(channel: grpc.aio.Channel) -> grpc.aio.AioRpcError:
    """The refusal of one more health Watch on `channel` (the test fails if it opens)."""
    stub: Any = health_pb2_grpc.HealthStub(channel)
    over = stub.Watch(health_pb2.HealthCheckRequest(service=""))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await over.read()
    finally:
        over.cancel()
    return caught.value


def _watch_bound(limit: int = grpc_accept.WATCH_LIMIT) -> str:
    return (
        f"{limit} health Watch and reflection streams (grpc.health.v1.Health/Watch, "
        "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo) at once on this "
        "port, counted apart from every other call; Check is not counted"
    )


def test_reflection_streams_are_counted_with_the_health_watches(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reflection stream stays open as long as its caller keeps it, and nothing
    counted them (20 000, never read, held 640 MiB): they share the port's Watch bound
    (3 here), the one over refused in the same words, a health Watch too; one that ends
    frees its slot."""
    monkeypatch.setattr(grpc_accept, "WATCH_LIMIT", 3)
    asked = reflection_pb2.ServerReflectionRequest(list_services="")

    async def opened(stub: Any) -> Any:
        stream = stub.ServerReflectionInfo()
        await stream.write(asked)
        await stream.read()
        return stream

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub: Any = reflection_pb2_grpc.ServerReflectionStub(s.channel)  # type: ignore[arg-type]
            streams = [await opened(stub) for _ in range(3)]
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await opened(stub)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            trailers = dict(caught.value.trailing_metadata() or ())
            assert trailers[grpc_accept.WATCH_LIMIT_KEY] == _watch_bound(3)
            refused = await _watch_refused(s.channel)
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            (main_gate,) = _watch_gates(s)
            streams[0].cancel()
            await until(lambda: main_gate.watch_calls == 2)
            streams[0] = await opened(stub)
            for stream in streams:
                stream.cancel()
            await until(lambda: main_gate.watch_calls == 0)

    asyncio.run(scenario())


def test_health_watches_past_their_own_bound_are_refused_as_grpc_refuses_them(
    small_model: Path,
) -> None:
    """A health Watch stays open as long as its caller keeps it, each holding a task and
    gRPC's call (~23 KiB), and nothing counted them: a misconfigured prober or a hostile
    client held memory without bound. At most WATCH_LIMIT are open per port: the one over
    is refused at once in gRPC's words for a full port, the bound in a trailer. Check,
    the operator calls and the priority port's own watches are answered meanwhile, and a
    watch that ends frees its slot for the next."""
    limit = grpc_accept.WATCH_LIMIT

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, priority_port=0)) as s:
            watches = await _open_watches(s.channel, limit)
            refused = await _watch_refused(s.channel)
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.details() == grpc_accept.CALL_LIMIT_DETAILS
            trailers = dict(refused.trailing_metadata() or ())
            assert trailers[grpc_accept.WATCH_LIMIT_KEY] == _watch_bound()
            assert await health_status(s.channel) == health_pb2.HealthCheckResponse.SERVING
            assert (await s.stub.GetStats(pb.GetStatsRequest(), timeout=10)).lanes
            async with grpc.aio.insecure_channel(f"127.0.0.1:{s.server.priority_port}") as priority:
                (priority_watch,) = await _open_watches(priority, 1)
                priority_watch.cancel()
            main_gate, priority_gate = _watch_gates(s)
            assert main_gate.watch_calls == limit
            watches[0].cancel()
            await until(lambda: main_gate.watch_calls == limit - 1)
            watches[0:1] = await _open_watches(s.channel, 1)
            assert (await _watch_refused(s.channel)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await until(lambda: priority_gate.watch_calls == 0)
            for watch in watches:
                watch.cancel()
            await until(lambda: main_gate.watch_calls == 0)

    asyncio.run(scenario())


def test_a_health_watch_frees_its_slot_once_however_it_ends(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch's slot is freed exactly once whether its caller cancels it, it fails, or
    the drain ends it: afterwards the port takes WATCH_LIMIT watches again and refuses
    the one over; and the drain still ends every open watch OK after NOT_SERVING, on
    both ports, the bound reached or not."""
    watch = grpc_health.aio.HealthServicer.Watch

    async def failing(self: Any, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        if request.service != "fault":
            return await watch(self, request, context)
        # Fault injection: a watch whose handler fails after its first answer.
        await context.write(
            health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        )
        raise RuntimeError("fault injection: a failing watch")

    monkeypatch.setattr(grpc_health.aio.HealthServicer, "Watch", failing)
    limit = grpc_accept.WATCH_LIMIT
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model, priority_port=0)) as s:
            main_gate, priority_gate = _watch_gates(s)
            stub: Any = health_pb2_grpc.HealthStub(s.channel)
            (cancelled,) = await _open_watches(s.channel, 1)
            cancelled.cancel()
            fault = stub.Watch(health_pb2.HealthCheckRequest(service="fault"))
            assert (await fault.read()).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await fault.read()
            assert caught.value.code() == grpc.StatusCode.UNKNOWN
            await until(lambda: main_gate.watch_calls == 0)
            watches = await _open_watches(s.channel, limit)
            assert (await _watch_refused(s.channel)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            async with grpc.aio.insecure_channel(f"127.0.0.1:{s.server.priority_port}") as priority:
                watches += await _open_watches(priority, 1)
                await s.server.stop(grace_s=5.0)
                for each in watches:
                    statuses = []
                    while (answer := await each.read()) is not grpc.aio.EOF:
                        statuses.append(answer.status)
                    # NOT_SERVING, once, whether or not the drain ended it while it wrote.
                    assert statuses == [not_serving]
                    assert await each.code() == grpc.StatusCode.OK
            assert main_gate.watch_calls == priority_gate.watch_calls == 0

    asyncio.run(scenario())


def test_a_grpc_connection_left_idle_is_closed_and_connects_again(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC kept a connection with no call in progress for ever: 400 that sent their
    preface and nothing more took every file of the process (both ports and the metrics
    endpoint stopped answering). Closed after IDLE_CONNECTION_MS (0.3 s here); the
    client's channel connects again on its next call."""
    monkeypatch.setattr(app_module, "IDLE_CONNECTION_MS", 300)

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            await s.stub.GetModel(pb.GetModelRequest(), timeout=10)
            assert s.channel.get_state() is grpc.ChannelConnectivity.READY
            await asyncio.wait_for(
                s.channel.wait_for_state_change(grpc.ChannelConnectivity.READY), timeout=30
            )
            assert s.channel.get_state() is not grpc.ChannelConnectivity.READY
            await s.stub.GetModel(pb.GetModelRequest(), timeout=10)

    asyncio.run(scenario())


def test_a_grpc_port_takes_at_most_its_share_of_the_open_file_limit_in_connections(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quarter of the open-file limit per port (here 1 connection): past it gRPC closes
    a new connection at once, and the process keeps its files for the rest (else idle
    connections took every one). A connection freed, the next is taken."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        assert app_module.connection_limit() == [
            ("grpc.max_allowed_incoming_connections", max(1, soft // 4))
        ]
    monkeypatch.setattr(
        app_module, "connection_limit", lambda: [("grpc.max_allowed_incoming_connections", 1)]
    )

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            await s.stub.GetModel(pb.GetModelRequest(), timeout=10)  # the one connection
            # A connection of its own (gRPC shares one among a process's channels).
            own = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(s.target, options=own) as second:
                stub = pb_grpc.InferenceServiceStub(second)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.GetModel(pb.GetModelRequest(), timeout=10)
                assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
                await s.channel.close()
                answer = await stub.GetModel(pb.GetModelRequest(), timeout=30, wait_for_ready=True)
                assert answer.model_path == str(small_model)

    asyncio.run(scenario())
