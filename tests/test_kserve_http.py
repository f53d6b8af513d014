"""KServe v2's HTTP/REST protocol with Triton's extensions (server/kserve_http.py,
server/kserve_json.py): real HTTP/1.1 on loopback (aiohttp's client) to a real in-process
server with a real ONNX Runtime session, as curl, tritonclient.http or perf_analyzer -i
http call it. Its answers are held to those of the gRPC front ends (laneserve.v1's Infer,
KServe's ModelInfer) for the same rows."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import json
import logging
import math
import re
import socket
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import numpy.typing as npt
import pytest
from multidict import CIMultiDict
from onnx import TensorProto, helper
from opentelemetry.trace import SpanKind, StatusCode

from laneserve.client.tensors import encode_strings
from laneserve.server import Engine, LaneConfig, LaneServer, ServerConfig, kserve_http
from laneserve.server.addresses import check_ports_free, listening_sockets
from laneserve.server.cli import _parser, _serve_config
from laneserve.server.config import ConfigError
from laneserve.server.errors import (
    AnswerTooLargeError,
    DeviceMemoryError,
    LaneFullError,
    LaneserveError,
)
from laneserve.server.grpc_methods import status_trailers
from laneserve.server.kserve_convert import KSERVE_DTYPES
from laneserve.server.model_identity import SERVER_VERSION
from laneserve.server.shared_memory import BYTE_SIZE_PARAMETER, REGION_PARAMETER
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import (
    F32,
    RecordingEngine,
    Serving,
    config,
    output,
    queued_rows,
    request,
    rows,
    save_model,
    serving,
    until,
    until_stats,
)
from tests.test_kserve import (
    EVERY_DTYPE,
    LABELS,
    NUMBERS,
    TAGGED,
    TEXT,
    TEXT_OUTPUTS,
    VALUES,
    _engine,
    _identity_model,
)
from tests.test_kserve_shm import FILLER, PAGE_BYTES, SharedMemory
from tests.test_readme_claims import Pki, issue_pki
from tests.test_telemetry import (
    CALLER_SPAN_ID,
    CALLER_TRACE_ID,
    TRACEPARENT,
    attr,
    only,
    parent_id,
    scrape,
    serving_traced,
    span_id,
    spans_named,
    trace_id,
)

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

MODEL = "small"  # the small model's file stem: the name it is served under
INFER = f"/v2/models/{MODEL}/infer"
STATS = f"/v2/models/{MODEL}/stats"
HEADER_LENGTH = "Inference-Header-Content-Length"
INFER_ROUTE = "/v2/models/{model}/infer"  # the route an inference call counts under
INFER_SPAN = f"POST {INFER_ROUTE}"
TIMING = {"laneserve_lane", "laneserve_batch_size", "laneserve_queue_us", "laneserve_infer_us"}
STEP_TIMEOUT_S = 30.0


# ---- the HTTP client ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Answer:
    """One HTTP answer, read whole."""

    status: int
    headers: Mapping[str, str]  # case-insensitive (aiohttp's)
    body: bytes

    @property
    def json_length(self) -> int:
        """The length of the JSON part: the whole body unless binary data follows it."""
        length = self.headers.get(HEADER_LENGTH)
        return len(self.body) if length is None else int(length)

    @property
    def json(self) -> Any:
        return json.loads(self.body[: self.json_length])

    @property
    def binary(self) -> bytes:
        return self.body[self.json_length :]


async def call(
    http: aiohttp.ClientSession,
    method: str,
    path: str,
    *,
    body: Any = None,
    data: Any = None,
    headers: Mapping[str, str] | None = None,
) -> Answer:
    """`method` `path` with `body` as JSON (or `data` as it is); the answer, read whole."""
    async with http.request(
        method,
        path,
        json=body,
        data=data,
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=STEP_TIMEOUT_S),
    ) as response:
        return Answer(response.status, response.headers, await response.read())


async def get(http: aiohttp.ClientSession, path: str) -> Answer:
    return await call(http, "GET", path)


async def post(http: aiohttp.ClientSession, path: str, body: Any = None, **options: Any) -> Answer:
    return await call(http, "POST", path, body=body, **options)


def assert_refused(answer: Answer, status: int, reason: str | None, fragment: str) -> None:
    """`answer` is the error `status` with `reason` (None: no reason) and `fragment` in
    its message, as a JSON body."""
    assert answer.headers["Content-Type"].startswith("application/json"), answer
    found = answer.json
    assert (answer.status, found.get("reason")) == (status, reason), found
    assert fragment in found["error"], found


@contextlib.asynccontextmanager
async def http_serving(
    engine: Engine, server_config: ServerConfig, **options: Any
) -> AsyncIterator[tuple[Serving, aiohttp.ClientSession]]:
    """`serving` with the HTTP port on any free port, and a client session to it."""
    async with (
        serving(engine, dataclasses.replace(server_config, http_port=0), **options) as s,
        session_to(s) as http,
    ):
        yield s, http


def session_to(s: Serving) -> aiohttp.ClientSession:
    assert s.server.http_port is not None
    return aiohttp.ClientSession(f"http://127.0.0.1:{s.server.http_port}")


def answered(s: Serving) -> Mapping[tuple[str, int], int]:
    """The HTTP front end's answers so far, by route template and status."""
    front = s.server._http
    assert front is not None
    return front.answered()


# ---- HTTP/1.1 by hand: what a client library does not let a test hold back ----------------


def request_head(path: str, length: int, headers: Mapping[str, str] | None = None) -> bytes:
    """A POST's request line and headers, its body (`length` bytes) not included."""
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {length}",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, CIMultiDict[str]]:
    """An answer's status and headers (an interim "100 Continue" is one)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), STEP_TIMEOUT_S)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    version, status, *_ = status_line.split(" ")
    assert version == "HTTP/1.1", status_line
    headers: CIMultiDict[str] = CIMultiDict()
    for line in filter(None, lines):
        name, value = line.split(":", 1)
        headers[name.strip()] = value.strip()
    return int(status), headers


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """An answer: its head, and the body its Content-Length gives."""
    status, headers = await read_head(reader)
    assert status >= 200, f"an interim {status} answer, not the answer"
    length = int(headers["Content-Length"])
    body = await asyncio.wait_for(reader.readexactly(length), STEP_TIMEOUT_S)
    return Answer(status, headers, body)


async def refused_unread(reader: asyncio.StreamReader) -> Answer:
    """A refusal given before the request's body was read: an answer that ends its
    connection (Connection: close), which no further request may use."""
    answer = await read_answer(reader)
    assert answer.headers.get("Connection") == "close", answer.headers
    return answer


@contextlib.asynccontextmanager
async def connection(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def sent_alone(
    port: int,
    payloads: Sequence[bytes],
    read: Callable[[asyncio.StreamReader], Awaitable[bytes]],
) -> list[bytes]:
    """Each of `payloads` sent on a connection of its own, and what `read` reads back."""
    answers = []
    for payload in payloads:
        async with connection(port) as (reader, writer):
            writer.write(payload)
            answers.append(await asyncio.wait_for(read(reader), STEP_TIMEOUT_S))
    return answers


async def headers_alone(port: int, path: str, length: int, **headers: str) -> Answer:
    """A POST with `Expect: 100-continue` whose body is never sent: the refusal the
    server gives to its headers alone (else this waits, and fails after STEP_TIMEOUT_S)."""
    async with connection(port) as (reader, writer):
        writer.write(request_head(path, length, {"Expect": "100-continue", **headers}))
        return await refused_unread(reader)


# ---- requests ------------------------------------------------------------------------------


def json_input(name: str, array: npt.NDArray[Any], datatype: str = "FP32") -> dict[str, Any]:
    """An input with its values as JSON `data`, nested as the array is."""
    return {"name": name, "shape": list(array.shape), "datatype": datatype, "data": array.tolist()}


def binary_input(name: str, array: npt.NDArray[Any], datatype: str = "FP32") -> dict[str, Any]:
    """An input whose bytes come after the JSON header (Triton's binary data)."""
    return {
        "name": name,
        "shape": list(array.shape),
        "datatype": datatype,
        "parameters": {"binary_data_size": array.nbytes},
    }


def infer_body(x: F32, **fields: Any) -> dict[str, Any]:
    """An inference request for `x` (the small model's input) in JSON, with `fields`."""
    return {"inputs": [json_input("input", x)], **fields}


def with_binary(header: Mapping[str, Any], *arrays: npt.NDArray[Any]) -> dict[str, Any]:
    """post() options for a request of JSON `header` and the bytes of `arrays` after it."""
    encoded = json.dumps(header).encode()
    return {
        "data": encoded + b"".join(array.tobytes() for array in arrays),
        "headers": {HEADER_LENGTH: str(len(encoded))},
    }


def only_output(answer: Answer) -> dict[str, Any]:
    assert answer.status == 200, answer.body[:500]
    (found,) = answer.json["outputs"]
    assert isinstance(found, dict)
    return found


def fp32_data(found: Mapping[str, Any]) -> F32:
    """An answer output's JSON `data`, as float32 (each JSON number is a float32's value)."""
    return np.array(found["data"], dtype=np.float32)


def model_stats(answer: Answer) -> dict[str, Any]:
    assert answer.status == 200, answer.body
    (found,) = answer.json["model_stats"]
    assert isinstance(found, dict)
    return found


async def fail_count(http: aiohttp.ClientSession) -> int:
    """ModelStatistics' count of requests that ended otherwise than OK."""
    count = model_stats(await get(http, STATS))["inference_stats"]["fail"]["count"]
    assert isinstance(count, int)
    return count


async def until_true(condition: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Polls the async `condition`: a state the server reaches, not a timing."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while not await condition():
        if loop.time() > give_up:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


def lane_stats(stats: pb.GetStatsResponse, name: str) -> Any:
    (lane,) = [lane for lane in stats.lanes if lane.name == name]
    return lane


# ---- health and metadata ------------------------------------------------------------------


def test_health_server_metadata_and_model_metadata_answer_as_json(small_model: Path) -> None:
    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            http,
        ):
            live = await get(http, "/v2/health/live")
            assert (live.status, live.json) == (200, {"live": True})
            assert live.headers["Content-Type"].startswith("application/json")
            ready = await get(http, "/v2/health/ready")
            assert (ready.status, ready.json) == (200, {"ready": True})
            server = await get(http, "/v2")
            assert server.status == 200
            assert (server.json["name"], server.json["version"]) == ("laneserve", SERVER_VERSION)
            assert "binary_tensor_data" in server.json["extensions"]
            assert "statistics" in server.json["extensions"]
            expected = {
                "name": MODEL,
                "versions": ["1"],
                "platform": "onnxruntime_onnx",
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 512]}],
                "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}],
            }
            for path in (f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/versions/1"):
                metadata = await get(http, path)
                assert (metadata.status, metadata.json) == (200, expected), path
                model_ready = await get(http, f"{path}/ready")
                assert (model_ready.status, model_ready.json) == (
                    200,
                    {"name": MODEL, "ready": True},
                )
            for path in (
                "/v2/models/resnet",
                "/v2/models/resnet/ready",
                "/v2/models/resnet/config",
            ):
                assert_refused(
                    await get(http, path),
                    404,
                    "MODEL_NOT_FOUND",
                    "model 'resnet' is not served here; expected 'small'",
                )
            for path in (f"/v2/models/{MODEL}/versions/2", f"/v2/models/{MODEL}/versions/2/ready"):
                assert_refused(
                    await get(http, path),
                    404,
                    "MODEL_NOT_FOUND",
                    "model 'small' has no version '2' here; expected '1' or empty",
                )
            # From a stop signal's drain delay on: alive, not ready.
            await s.server.announce_not_serving()
            live = await get(http, "/v2/health/live")
            assert (live.status, live.json) == (200, {"live": True})
            ready = await get(http, "/v2/health/ready")
            assert (ready.status, ready.json) == (503, {"ready": False})
            model_ready = await get(http, f"/v2/models/{MODEL}/ready")
            assert (model_ready.status, model_ready.json) == (503, {"name": MODEL, "ready": False})

    asyncio.run(scenario())


def test_model_config_is_tritons_config_with_numbers_and_enum_names(small_model: Path) -> None:
    served = config(small_model)

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), served) as (
            _,
            http,
        ):
            for path in (f"/v2/models/{MODEL}/config", f"/v2/models/{MODEL}/versions/1/config"):
                answer = await get(http, path)
                assert answer.status == 200, answer.body
                found = answer.json
                assert "config" not in found, "Triton's HTTP answer is the config itself"
                assert (found["name"], found["platform"]) == (MODEL, "onnxruntime_onnx")
                max_batch_size = found["max_batch_size"]
                assert type(max_batch_size) is int, max_batch_size
                assert max_batch_size > 0
                assert [(t["name"], t["data_type"], t["dims"]) for t in found["input"]] == [
                    ("input", "TYPE_FP32", [512])
                ]
                assert [(t["name"], t["data_type"], t["dims"]) for t in found["output"]] == [
                    ("output", "TYPE_FP32", [10])
                ]
                (group,) = found["instance_group"]
                assert (group["kind"], type(group["count"])) == ("KIND_CPU", int)
                # Maps are JSON objects, keyed as Triton's are (a priority level's number
                # as a string), not lists of their values.
                policies = found["dynamic_batching"]["priority_queue_policy"]
                assert isinstance(policies, dict), policies
                assert {
                    level: policy["default_timeout_microseconds"]
                    for level, policy in policies.items()
                } == {
                    str(level): lane.timeout_ms * 1000
                    for level, lane in enumerate(served.lanes, start=1)
                }
                assert found["parameters"]["laneserve_lanes"] == {
                    "string_value": ",".join(lane.name for lane in served.lanes)
                }

    asyncio.run(scenario())


def test_statistics_are_numbers_and_count_an_infer(small_model: Path) -> None:
    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            _,
            http,
        ):
            every = model_stats(await get(http, "/v2/models/stats"))
            own = model_stats(await get(http, STATS))
            versioned = model_stats(await get(http, f"/v2/models/{MODEL}/versions/1/stats"))
            for found in (every, own, versioned):
                assert (found["name"], found["version"]) == (MODEL, "1")
                assert (found["inference_count"], found["execution_count"]) == (0, 0)
                assert found["last_inference"] == 0
                for key in ("success", "fail", "queue", "compute_input", "compute_infer"):
                    duration = found["inference_stats"][key]
                    assert duration == {"count": 0, "ns": 0}, (key, duration)
            assert_refused(
                await get(http, "/v2/models/resnet/stats"), 404, "MODEL_NOT_FOUND", "'resnet'"
            )
            assert only_output(await post(http, INFER, infer_body(rows(3))))["shape"] == [3, 10]

            async def counted() -> bool:
                found = model_stats(await get(http, STATS))
                return bool(found["inference_count"] == 3)

            await until_true(counted)
            found = model_stats(await get(http, STATS))
            assert found["execution_count"] == 1
            success = found["inference_stats"]["success"]
            assert success["count"] == 1
            assert type(success["ns"]) is int
            assert success["ns"] > 0
            assert type(found["last_inference"]) is int
            assert found["last_inference"] > 0
            (batch,) = found["batch_stats"]
            assert (batch["batch_size"], batch["compute_infer"]["count"]) == (3, 1)

    asyncio.run(scenario())


# ---- inference with JSON data -------------------------------------------------------------


def test_json_data_nested_or_flat_answers_bit_for_bit_as_infer(small_model: Path) -> None:
    """40 rows as nested and as flat `data`, on the model's path and its version's: each
    answer's `data` is, as float32, Infer's output for the same rows bit for bit; its id
    is the request's, its parameters the laneserve_ timing ones."""
    x = rows(40, seed=4)

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            http,
        ):
            expected = output(await s.stub.Infer(request(x)))
            flat = {
                "name": "input",
                "shape": [40, 512],
                "datatype": "FP32",
                "data": x.ravel().tolist(),
            }
            cases = [
                (INFER, {"id": "nested-1", "inputs": [json_input("input", x)]}),
                (INFER, {"id": "flat-1", "inputs": [flat]}),
                (f"/v2/models/{MODEL}/versions/1/infer", {"id": "v-1", "inputs": [flat]}),
            ]
            for path, body in cases:
                answer = await post(http, path, body)
                assert answer.status == 200, answer.body[:500]
                assert answer.headers["Content-Type"].startswith("application/json")
                assert HEADER_LENGTH not in answer.headers
                found = answer.json
                assert (found["model_name"], found["model_version"], found["id"]) == (
                    MODEL,
                    "1",
                    body["id"],
                )
                (tensor,) = found["outputs"]
                assert (tensor["name"], tensor["datatype"], tensor["shape"]) == (
                    "output",
                    "FP32",
                    [40, 10],
                )
                assert len(tensor["data"]) == 400, "flat, row-major"
                assert fp32_data(tensor).tobytes() == expected.tobytes()
                assert set(found["parameters"]) == TIMING
                assert found["parameters"]["laneserve_lane"] == "standard"
                assert found["parameters"]["laneserve_batch_size"] >= 40
            no_id = await post(http, INFER, infer_body(rows(1)))
            assert "id" not in no_id.json

    asyncio.run(scenario())


# ---- binary data --------------------------------------------------------------------------


def test_binary_inputs_and_outputs_are_tritons_binary_tensor_data(small_model: Path) -> None:
    """An input's bytes after the JSON header (binary_data_size, and the header's length
    in Inference-Header-Content-Length); outputs as bytes after the answer's JSON where
    binary_data_output or the output's binary_data asks, JSON where its binary_data is
    false whatever binary_data_output says."""
    x = rows(5, seed=9)

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            http,
        ):
            expected = output(await s.stub.Infer(request(x)))
            asked_binary = [
                with_binary(
                    {
                        "inputs": [binary_input("input", x)],
                        "parameters": {"binary_data_output": True},
                    },
                    x,
                ),
                {
                    "body": infer_body(
                        x, outputs=[{"name": "output", "parameters": {"binary_data": True}}]
                    )
                },
                with_binary(
                    {
                        "inputs": [binary_input("input", x)],
                        "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
                    },
                    x,
                ),
            ]
            for options in asked_binary:
                answer = await post(http, INFER, **options)
                assert answer.status == 200, answer.body[:500]
                assert HEADER_LENGTH in answer.headers
                assert answer.headers["Content-Type"] == "application/octet-stream"
                (tensor,) = answer.json["outputs"]
                assert "data" not in tensor
                assert tensor["parameters"] == {"binary_data_size": expected.nbytes}
                assert (tensor["datatype"], tensor["shape"]) == ("FP32", [5, 10])
                assert answer.binary == expected.tobytes()
            # binary input, JSON output (binary_data false over binary_data_output true)
            overridden = await post(
                http,
                INFER,
                **with_binary(
                    {
                        "inputs": [binary_input("input", x)],
                        "outputs": [{"name": "output", "parameters": {"binary_data": False}}],
                        "parameters": {"binary_data_output": True},
                    },
                    x,
                ),
            )
            assert HEADER_LENGTH not in overridden.headers
            assert fp32_data(only_output(overridden)).tobytes() == expected.tobytes()

    asyncio.run(scenario())


def _two_input_model(path: Path) -> Path:
    """Inputs "f" (FP32) and "i" (INT8), [N, 3], each answered as itself ("o_f", "o_i")."""
    return _identity_model(path, {"f": TensorProto.FLOAT, "i": TensorProto.INT8})


def test_a_request_may_mix_json_and_binary_inputs_and_outputs(tmp_path: Path) -> None:
    path = _two_input_model(tmp_path / "two.onnx")
    f = np.arange(12, dtype=np.float32).reshape(4, 3) / 7
    i = np.array([[-128, 127, 0], [1, -1, 5], [9, 8, 7], [100, -100, 3]], dtype=np.int8)

    async def scenario() -> None:
        async with http_serving(_engine(path), config(path)) as (_, http):
            # f binary, i JSON; o_f binary, o_i JSON
            first = {
                "inputs": [binary_input("f", f), json_input("i", i, "INT8")],
                "outputs": [
                    {"name": "o_f", "parameters": {"binary_data": True}},
                    {"name": "o_i"},
                ],
            }
            # both binary, in the order of the inputs; both outputs binary
            second = {
                "inputs": [binary_input("f", f), binary_input("i", i, "INT8")],
                "parameters": {"binary_data_output": True},
            }
            answer = await post(http, "/v2/models/two/infer", **with_binary(first, f))
            assert answer.status == 200, answer.body[:500]
            outputs = {tensor["name"]: tensor for tensor in answer.json["outputs"]}
            assert outputs["o_f"]["parameters"] == {"binary_data_size": f.nbytes}
            assert answer.binary == f.tobytes()
            assert outputs["o_i"]["datatype"] == "INT8"
            assert np.array(outputs["o_i"]["data"], np.int8).tobytes() == i.tobytes()
            answer = await post(http, "/v2/models/two/infer", **with_binary(second, f, i))
            assert answer.status == 200, answer.body[:500]
            sizes = [tensor["parameters"]["binary_data_size"] for tensor in answer.json["outputs"]]
            names = [tensor["name"] for tensor in answer.json["outputs"]]
            chunks = dict(
                zip(
                    names, np.split(np.frombuffer(answer.binary, np.uint8), [sizes[0]]), strict=True
                )
            )
            assert chunks["o_f"].tobytes() == f.tobytes()
            assert chunks["o_i"].tobytes() == i.tobytes()

    asyncio.run(scenario())


def test_integer_data_outside_its_datatype_or_with_fractions_is_refused(tmp_path: Path) -> None:
    path = _two_input_model(tmp_path / "two.onnx")
    f = np.zeros((1, 3), np.float32)

    async def scenario() -> None:
        async with http_serving(_engine(path), config(path)) as (_, http):
            cases = [
                (
                    [[200, 0, 0]],
                    "input 'i' is INT8 and holds 200; expected values from -128 to 127",
                ),
                (
                    [[0, -129, 0]],
                    "input 'i' is INT8 and holds -129; expected values from -128 to 127",
                ),
                ([[0, 1.5, 0]], "input 'i' is INT8 and its 'data' holds numbers with fractions"),
                # Not "with fractions": written as floats, or not numbers at all.
                (
                    [[0, 1e3, 0]],
                    "input 'i' is INT8 and its 'data' holds numbers written as floats (1e3, 2.0)",
                ),
                ([[0, math.nan, 0]], "input 'i' is INT8 and its 'data' holds NaN or infinities"),
                (
                    [[0, 2**64, 0]],
                    "input 'i' is INT8 and holds 18446744073709551616; expected values from -128",
                ),
                (
                    [[0, "1", 0]],
                    (
                        "input 'i' is INT8 and its 'data' holds a string (element 1); expected a "
                        "flat or nested list of integers"
                    ),
                ),
            ]
            for data, fragment in cases:
                body = {
                    "inputs": [
                        json_input("f", f),
                        {"name": "i", "shape": [1, 3], "datatype": "INT8", "data": data},
                    ]
                }
                assert_refused(
                    await post(http, "/v2/models/two/infer", body), 400, "INVALID_INPUT", fragment
                )

    asyncio.run(scenario())


def test_a_boolean_among_numbers_is_refused_as_not_a_number(small_model: Path) -> None:
    """JSON true is no number: an FP32 input whose `data` holds numbers and a boolean is
    refused as one of booleans alone is, not read as 1.0 (numpy's array of the list
    widens the boolean to a number)."""

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            _,
            http,
        ):
            for data in ([True] * 512, [0.5] * 511 + [True], [True] + [1] * 511):
                body = {
                    "inputs": [
                        {"name": "input", "shape": [1, 512], "datatype": "FP32", "data": data}
                    ]
                }
                answer = await post(http, INFER, body)
                assert answer.status == 400, (data[-1], answer.body[:300])
                assert_refused(
                    answer, 400, "INVALID_INPUT", "input 'input' is FP32 and its 'data' holds "
                )

    asyncio.run(scenario())


# One row of each datatype laneserve serves, at its extremes (floats exact in it), by the
# input's name in EVERY_DTYPE: what the identity model answers as itself.
EVERY_DATATYPE_ROW: dict[str, tuple[str, list[Any]]] = {
    "b": ("BOOL", [True, False, True]),
    "u8": ("UINT8", [0, 255, 7]),
    "u16": ("UINT16", [0, 2**16 - 1, 7]),
    "u32": ("UINT32", [0, 2**32 - 1, 7]),
    "u64": ("UINT64", [2**64 - 1, 2**63, 0]),  # read by numpy as float64: kept exact
    "i8": ("INT8", [-128, 127, 0]),
    "i16": ("INT16", [-(2**15), 2**15 - 1, 0]),
    "i32": ("INT32", [-(2**31), 2**31 - 1, 0]),
    "i64": ("INT64", [-(2**63), 2**63 - 1, 0]),
    "f16": ("FP16", [0.5, -65504.0, 2.0**-24]),  # its smallest subnormal
    "f32": ("FP32", [0.25, -3.5, 2.0**100]),
    "f64": ("FP64", [0.1, -1e300, 5e-324]),
}
# The JSON type each datatype's values are answered as (JSON true is no number: a BOOL
# output of 1.0 is not one of true).
JSON_TYPE = {"b": bool, "u": int, "i": int, "f": float}


def _every_datatype_body(**over: list[Any]) -> dict[str, Any]:
    """A request of one row of each datatype (EVERY_DATATYPE_ROW), `over` its inputs'."""
    return {
        "inputs": [
            {"name": name, "shape": [1, 3], "datatype": datatype, "data": [over.get(name, row)]}
            for name, (datatype, row) in EVERY_DATATYPE_ROW.items()
        ]
    }


def test_json_data_of_every_datatype_is_answered_as_itself_in_json_of_its_kind(
    tmp_path: Path,
) -> None:
    """The identity of every datatype served: each output's `data` is its input's values
    exactly, as JSON booleans, integers (64-bit ones at both ends of their range, where
    a float64 is not exact) or numbers. BOOL given integers, and an integer outside its
    datatype's range, are refused naming what was expected."""
    assert set(EVERY_DATATYPE_ROW) == set(EVERY_DTYPE)
    path = _identity_model(tmp_path / "every.onnx", EVERY_DTYPE)
    every = "/v2/models/every/infer"

    async def scenario() -> None:
        async with http_serving(_engine(path), config(path)) as (_, http):
            answer = await post(http, every, _every_datatype_body())
            assert answer.status == 200, answer.body[:500]
            outputs = {tensor["name"]: tensor for tensor in answer.json["outputs"]}
            for name, (datatype, row) in EVERY_DATATYPE_ROW.items():
                found = outputs[f"o_{name}"]
                assert (found["datatype"], found["shape"]) == (datatype, [1, 3]), found
                assert found["data"] == row, (datatype, found["data"])
                kind = JSON_TYPE[np.dtype(KSERVE_DTYPES[datatype]).kind]
                assert [type(value) for value in found["data"]] == [kind] * 3, found["data"]
            cases = [
                (
                    {"b": [1, 0, 1]},
                    (
                        "input 'b' is BOOL and its 'data' holds integers; expected a flat or "
                        "nested list of booleans (true, false)"
                    ),
                ),
                (
                    {"i64": [2**63, 0, 0]},
                    (
                        f"input 'i64' is INT64 and holds {2**63}; expected values from "
                        f"{-(2**63)} to {2**63 - 1}"
                    ),
                ),
                (
                    {"u64": [2**64 - 1, -1, 0]},
                    f"input 'u64' is UINT64 and holds -1; expected values from 0 to {2**64 - 1}",
                ),
                (
                    {"u64": [2**64, 0, 0]},
                    f"input 'u64' is UINT64 and holds {2**64}; expected values from 0 to",
                ),
            ]
            for over, fragment in cases:
                refused = await post(http, every, _every_datatype_body(**over))
                assert_refused(refused, 400, "INVALID_INPUT", fragment)

    asyncio.run(scenario())


def _half_model(path: Path) -> Path:
    """FP16 inputs "h" and "k", [N, 3], each answered as itself ("o_h", "o_k")."""
    return _identity_model(path, {"h": TensorProto.FLOAT16, "k": TensorProto.FLOAT16})


def _half(name: str, data: Any) -> dict[str, Any]:
    return {"name": name, "shape": [1, 3], "datatype": "FP16", "data": data}


def test_fp16_values_past_its_range_are_refused_and_its_extremes_answered(tmp_path: Path) -> None:
    """FP16's largest finite values (+-65504) are answered as themselves; one past them
    (a number or an integer) is refused naming the range, not cast to inf (numpy's cast
    warned: a 500 where warnings are errors, an inf in the session where not)."""
    path = _half_model(tmp_path / "half.onnx")
    extremes = [[65504.0, -65504.0, 0.5]]

    async def scenario() -> None:
        async with http_serving(_engine(path), config(path)) as (_, http):
            body = {"inputs": [_half("h", extremes), _half("k", [[0, 1, 2]])]}
            answer = await post(http, "/v2/models/half/infer", body)
            assert answer.status == 200, answer.body[:300]
            outputs = {tensor["name"]: tensor for tensor in answer.json["outputs"]}
            assert (outputs["o_h"]["datatype"], outputs["o_h"]["data"]) == ("FP16", extremes[0])
            for data in ([[70000.0, 0, 0]], [[0, -65536, 0]], [[0, 0, 1e300]]):
                past = {"inputs": [_half("h", [[0, 0, 0]]), _half("k", data)]}
                assert_refused(
                    await post(http, "/v2/models/half/infer", past),
                    400,
                    "INVALID_INPUT",
                    "input 'k' is FP16 and holds values beyond its range (+-65504); expected "
                    "finite FP16 values",
                )

    asyncio.run(scenario())


def test_float_inputs_take_integers_past_64_bits_and_infinities_written_so(
    small_model: Path,
) -> None:
    """JavaScript writes 2**64 as an integer of 20 digits (18446744073709552000):
    refused for FP32 as "not numbers (or not within 64 bits)", while 2**63 passed.
    Infinity and NaN, as write_answer writes them, are values (strict JSON has no such
    number)."""
    wide = np.zeros((1, 512), np.float32)
    wide[0, 1:4] = (1e21, -(2.0**70), 7.0)  # column 0 is the engine's tag

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            http,
        ):
            data = [0, 10**21, -(2**70), 7, *([0] * 508)]
            answer = await post(http, INFER, {"inputs": [_input(data=data)]})
            assert answer.status == 200, answer.body[:300]
            expected = output(await s.stub.Infer(request(wide)))
            assert only_output(answer)["data"] == expected.ravel().tolist()
            literal = (
                b'{"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", '
                b'"data": [0, Infinity, -Infinity, NaN' + b", 0" * 508 + b"]}]}"
            )
            answer = await post(http, INFER, data=literal)
            assert answer.status == 200, answer.body[:300]

    asyncio.run(scenario())


def test_inputs_are_refused_on_their_count_and_within_it_each_given_once(tmp_path: Path) -> None:
    """A model of two inputs: three are refused on their count, before any is read; two
    of the same name are within it, and refused by ModelInfer, naming the one given twice."""
    path = _half_model(tmp_path / "half.onnx")

    async def scenario() -> None:
        async with http_serving(_engine(path), config(path)) as (_, http):
            h, k = _half("h", [[0, 0, 0]]), _half("k", [[0, 0, 0]])
            assert_refused(
                await post(http, "/v2/models/half/infer", {"inputs": [h, k, h]}),
                400,
                "INVALID_INPUT",
                "request has 3 inputs; 'h' is given more than once; expected the model's inputs "
                "['h', 'k'], each once",
            )
            assert_refused(
                await post(http, "/v2/models/half/infer", {"inputs": [h, h]}),
                400,
                "INVALID_INPUT",
                "input 'h' is given more than once; expected each input once",
            )

    asyncio.run(scenario())


# ---- refusals -----------------------------------------------------------------------------


def _input(**fields: Any) -> dict[str, Any]:
    """The small model's input, one row of zeros in JSON, with `fields` over it."""
    return {"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.0] * 512, **fields}


ONE_ROW = np.zeros((1, 512), np.float32)


@dataclasses.dataclass(frozen=True)
class Refusal:
    options: dict[str, Any]  # post()'s: body=, or data= and headers=
    fragment: str
    status: int = 400
    reason: str = "INVALID_INPUT"


def _body(body: Any) -> dict[str, Any]:
    return {"body": body}


def _nested(data: list[Any], depth: int) -> list[Any]:
    """`data` inside `depth` - 1 lists of one item each."""
    for _ in range(depth - 1):
        data = [data]
    return data


# A JSON string that is valid JSON and no UTF-8: json.dumps writes it as the escape \ud800.
LONE_SURROGATE = "\ud800"


def _raw(body: Any) -> dict[str, Any]:
    """post() options for `body` written as JSON bytes: json.dumps escapes a lone
    surrogate ("\\ud800", as a caller's JSON may hold it), which .encode() would refuse."""
    encoded = json.dumps(body).encode()
    assert b"\\ud800" in encoded
    return {"data": encoded}


# The small model's input, one row of zeros, as JSON text (for requests json.dumps cannot
# write: a key given twice).
_INPUT_JSON = json.dumps(_input())


def _written(text: str) -> dict[str, Any]:
    """post() options for JSON `text` as it is written."""
    return {"data": text.encode()}


def _many_parameters(count: int) -> dict[str, int]:
    return {f"p{index}": index for index in range(count)}


REFUSALS: dict[str, Refusal] = {
    "JSON that does not parse": Refusal(
        {"data": b"{nope"}, "request's JSON does not parse (Expecting property name"
    ),
    "JSON that is not UTF-8": Refusal(
        {"data": b'{"inputs": "\xff"}'}, "request's JSON does not parse"
    ),
    "a request that is not an object": Refusal(
        _body([1, 2]), "the request is a list; expected an object with keys"
    ),
    "an unknown key": Refusal(
        _body({"inputs": [_input()], "model_name": "small"}),
        "the request has keys ['model_name'] laneserve does not read",
    ),
    "no inputs": Refusal(_body({"id": "x"}), "the request's 'inputs' is missing (or null)"),
    "an id that is not a string": Refusal(
        _body({"id": 7, "inputs": [_input()]}),
        "the request's 'id' is an integer; expected a string",
    ),
    "an id written Infinity": Refusal(  # not "_InfinityLiteral", the parser's own type
        {"data": b'{"id": Infinity, "inputs": []}'},
        "the request's 'id' is a number; expected a string",
    ),
    "an input's unknown key": Refusal(
        _body({"inputs": [_input(contents={})]}),
        "input 0 has keys ['contents'] laneserve does not read",
    ),
    "a shape that is not integers": Refusal(
        _body({"inputs": [_input(shape=[1, "512"])]}),
        "input 'input' has a string ('512') at index 1 of its 'shape'; expected an integer from "
        "-2**63 to 2**63 - 1 (a dimension, int64)",
    ),
    "a dimension past int64's range": Refusal(
        _body({"inputs": [_input(shape=[1, 2**64])]}),
        "input 'input' has 18446744073709551616 at index 1 of its 'shape'; expected an integer "
        "from -2**63 to 2**63 - 1",
    ),
    "a dimension written as a float": Refusal(
        _body({"inputs": [_input(shape=[1.0, 512])]}),
        "input 'input' has a number (1.0) at index 0 of its 'shape'; expected an integer",
    ),
    "a dimension that is a boolean": Refusal(
        _body({"inputs": [_input(shape=[True, 512])]}),
        "input 'input' has a boolean (true) at index 0 of its 'shape'; expected an integer",
    ),
    "a shape of 65 dimensions": Refusal(
        _body({"inputs": [_input(shape=[1] * 65)]}),
        "input 'input' has a shape of 65 dimensions; expected at most 64",
    ),
    "data and binary_data_size": Refusal(
        with_binary({"inputs": [_input(parameters={"binary_data_size": ONE_ROW.nbytes})]}, ONE_ROW),
        "input 'input' has its data in 'data' and parameter 'binary_data_size'; expected it in "
        "exactly one",
    ),
    "no data at all": Refusal(
        _body({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32"}]}),
        "input 'input' has its data in none of them; expected it in exactly one",
    ),
    "binary_data_size past the body's end": Refusal(
        with_binary({"inputs": [binary_input("input", np.zeros((2, 512), np.float32))]}, ONE_ROW),
        "input 'input' has binary_data_size 4096 from byte 0 of the binary data, which has 2048",
    ),
    "binary_data_size without binary data": Refusal(
        _body({"inputs": [binary_input("input", ONE_ROW)]}),
        "binary_data_size 2048 from byte 0 of the binary data, which has 0",
    ),
    "binary_data_size not an integer": Refusal(
        with_binary(
            {
                "inputs": [
                    binary_input("input", ONE_ROW) | {"parameters": {"binary_data_size": "2048"}}
                ]
            },
            ONE_ROW,
        ),
        "input 'input' has binary_data_size '2048'; expected its bytes, an integer >= 0",
    ),
    "binary bytes left unclaimed": Refusal(
        with_binary({"inputs": [binary_input("input", ONE_ROW)]}, ONE_ROW, ONE_ROW[:, :1]),
        "request has 2052 bytes of binary data after its JSON header and its inputs' "
        "binary_data_size claim 2048; expected them to claim every byte",
    ),
    "a header length that is not a number": Refusal(
        {"data": b"{}", "headers": {HEADER_LENGTH: "two"}},
        f"header {HEADER_LENGTH} is 'two'; expected the JSON header's length in bytes, from 0 "
        "to the body's 2",
    ),
    "a negative header length": Refusal(
        {"data": b"{}", "headers": {HEADER_LENGTH: "-1"}}, f"header {HEADER_LENGTH} is '-1'"
    ),
    "a header length with a fraction": Refusal(
        {"data": b"{}", "headers": {HEADER_LENGTH: "1.5"}}, f"header {HEADER_LENGTH} is '1.5'"
    ),
    "a header length in digits int() does not read": Refusal(
        {"data": b"{}", "headers": {HEADER_LENGTH: "\u00b2"}}, f"header {HEADER_LENGTH} is "
    ),
    "a header length over the body": Refusal(
        {"data": b"{}", "headers": {HEADER_LENGTH: "3"}},
        f"header {HEADER_LENGTH} is '3'; expected the JSON header's length in bytes, from 0 to "
        "the body's 2",
    ),
    "fewer values than the shape's": Refusal(
        _body({"inputs": [_input(data=[0.0] * 511)]}),
        "input 'input' has 511 values in 'data'; expected 512 (shape [1, 512])",
    ),
    "more values than the shape's, nested": Refusal(
        _body({"inputs": [_input(data=[[0.0] * 512, [0.0] * 512])]}),
        "input 'input' has 1024 values in 'data'; expected 512 (shape [1, 512])",
    ),
    "data that is not a list": Refusal(
        _body({"inputs": [_input(data=0.5)]}), "input 'input''s 'data' is a number; expected a list"
    ),
    "strings for FP32": Refusal(
        _body({"inputs": [_input(data=["0.5"] * 512)]}),
        "input 'input' is FP32 and its 'data' holds a string (element 0); expected a flat or "
        "nested list of numbers",
    ),
    "nulls for FP32": Refusal(
        _body({"inputs": [_input(data=[None] * 512)]}),
        "input 'input' is FP32 and its 'data' holds null (element 0); expected",
    ),
    "a null among FP32 numbers, nested": Refusal(
        _body({"inputs": [_input(shape=[2, 512], data=[[0.0] * 512, [0.0] * 7 + [None] * 505])]}),
        "input 'input' is FP32 and its 'data' holds null (element 519); expected",
    ),
    "a boolean among FP32 numbers": Refusal(
        _body({"inputs": [_input(data=[0.0] * 3 + [True] + [0.0] * 508)]}),
        "input 'input' is FP32 and its 'data' holds a boolean (element 3); expected",
    ),
    "booleans for FP32": Refusal(
        _body({"inputs": [_input(data=[False] * 512)]}),
        "input 'input' is FP32 and its 'data' holds booleans; expected a flat or nested list of "
        "numbers",
    ),
    "nested lists of unequal lengths": Refusal(
        _body({"inputs": [_input(shape=[2, 512], data=[[0.0] * 512, [0.0] * 511])]}),
        "input 'input' is FP32 and its 'data' holds lists of unequal lengths: data[1] has 511 "
        "values, data[0] has 512; expected",
    ),
    "a list where numbers are": Refusal(
        _body({"inputs": [_input(data=[0.0] * 511 + [[0.0]])]}),
        "its 'data' holds a list at data[511], where data[0] is a value",
    ),
    "another datatype than the model's": Refusal(
        _body({"inputs": [_input(datatype="FP64")]}),
        "input 'input' has datatype FP64; expected FP32",
    ),
    "a shape other than the model's": Refusal(
        _body({"inputs": [_input(shape=[1, 511], data=[0.0] * 511)]}),
        "input 'input' has shape [1, 511]; expected float32 with shape [-1, 512]",
    ),
    "an input given twice": Refusal(
        _body({"inputs": [_input(), _input()]}),
        "request has 2 inputs; 'input' is given more than once; expected the model's inputs "
        "['input'], each once",
    ),
    "an input given twice among many": Refusal(
        _body({"inputs": [_input()] * 5}),
        "request has 5 inputs; among its first 2, 'input' is given more than once; expected "
        "the model's inputs ['input'], each once",
    ),
    "too many inputs, none given twice": Refusal(
        _body({"inputs": [_input(), _input(name="other")]}),
        "request has 2 inputs; 'other' is not an input of the model; expected the model's "
        "inputs ['input'], each once",
    ),
    "too many inputs, one unnamed: refused on the count": Refusal(
        _body({"inputs": [_input(), 0]}),
        "request has 2 inputs; expected at most 1, each of the model's inputs at most once",
    ),
    "an output asked for twice": Refusal(
        _body({"inputs": [_input()], "outputs": [{"name": "output"}, {"name": "output"}]}),
        "request has 2 outputs; 'output' is given more than once; expected at most 1, each of "
        "the model's outputs at most once",
    ),
    # Refused on the count alone: none of them is walked (the first is no object).
    "100 000 inputs": Refusal(
        _body({"inputs": [0] * 100_000}),
        "request has 100000 inputs; expected at most 1, each of the model's inputs at most once",
    ),
    "100 000 outputs": Refusal(
        _body({"inputs": [_input()], "outputs": [0] * 100_000}),
        "request has 100000 outputs; expected at most 1",
    ),
    "an unknown output": Refusal(
        _body({"inputs": [_input()], "outputs": [{"name": "logits"}]}),
        "unknown output(s) ['logits']; expected some of the model's outputs ['output']",
    ),
    "binary_data not a boolean": Refusal(
        _body(
            {
                "inputs": [_input()],
                "outputs": [{"name": "output", "parameters": {"binary_data": 1}}],
            }
        ),
        "output 'output' has binary_data 1; expected true or false",
    ),
    "binary_data_output not a boolean": Refusal(
        _body({"inputs": [_input()], "parameters": {"binary_data_output": "yes"}}),
        "request parameter 'binary_data_output' is 'yes'; expected true or false",
    ),
    "a parameter that is an object": Refusal(
        _body({"inputs": [_input()], "parameters": {"lane": {"name": "bulk"}}}),
        "the request's parameter 'lane' is an object; expected a boolean, an integer, a number "
        "or a string",
    ),
    # Read into the output's parameters, and refused by ModelInfer's converter as over gRPC.
    "classification": Refusal(
        _body(
            {
                "inputs": [_input()],
                "outputs": [{"name": "output", "parameters": {"classification": 3}}],
            }
        ),
        "output 'output' has parameters ['classification']; expected none, or Triton's shared "
        "memory ones",
    ),
    "an unknown request parameter": Refusal(
        _body({"inputs": [_input()], "parameters": {"sequence_id": 7}}),
        "unknown request parameter(s) 'sequence_id'",
    ),
    "priority past the lanes": Refusal(
        _body({"inputs": [_input()], "parameters": {"priority": 9}}),
        "request parameter 'priority' is 9; expected 0 (the default lane) or 1 to 3",
    ),
    "a negative priority": Refusal(
        _body({"inputs": [_input()], "parameters": {"priority": -1}}),
        "request parameter 'priority' is -1",
    ),
    "an unknown lane": Refusal(
        _body({"inputs": [_input()], "parameters": {"lane": "gold"}}),
        "unknown lane 'gold'; expected one of ['interactive', 'standard', 'bulk']",
    ),
    "a timeout that is a string": Refusal(
        _body({"inputs": [_input()], "parameters": {"timeout": "1s"}}),
        "request parameter 'timeout' is a string_param; expected int64_param or uint64_param",
    ),
    "an input parameter": Refusal(
        _body({"inputs": [_input(parameters={"binary_data": True})]}),
        "input 'input' has parameters ['binary_data']; expected none",
    ),
    # JSON strings protobuf cannot carry: valid JSON, no UTF-8 (setting one raised
    # UnicodeEncodeError: a 500 in plain text, uncounted).
    "a lone surrogate in the id": Refusal(
        _raw({"id": LONE_SURROGATE, "inputs": [_input()]}),
        "the request's 'id' holds a lone surrogate (an unpaired \\ud800-\\udfff escape); "
        "expected text that is valid UTF-8",
    ),
    "a lone surrogate in an input's name": Refusal(
        _raw({"inputs": [_input(name=LONE_SURROGATE)]}), "input 0's 'name' holds a lone surrogate"
    ),
    "a lone surrogate in an input's datatype": Refusal(
        _raw({"inputs": [_input(datatype=LONE_SURROGATE)]}),
        "input 'input''s 'datatype' holds a lone surrogate",
    ),
    "a lone surrogate in a parameter's name": Refusal(
        _raw({"inputs": [_input()], "parameters": {LONE_SURROGATE: 1}}),
        "the request's parameter name holds a lone surrogate",
    ),
    "a lone surrogate in a parameter's value": Refusal(
        _raw({"inputs": [_input()], "parameters": {"lane": LONE_SURROGATE}}),
        "the request's parameter 'lane' holds a lone surrogate",
    ),
    "a lone surrogate in an input parameter's name": Refusal(
        _raw({"inputs": [_input(parameters={LONE_SURROGATE: True})]}),
        "input 'input''s parameter name holds a lone surrogate",
    ),
    "a lone surrogate in an output's name": Refusal(
        _raw({"inputs": [_input()], "outputs": [{"name": LONE_SURROGATE}]}),
        "output 0's 'name' holds a lone surrogate",
    ),
    # Python's parser recurses per list or object (a RecursionError was a 500).
    "JSON nested 100 000 deep": Refusal(
        {"data": b"[" * 100_000},
        "request's JSON nests lists or objects deeper than Python's parser goes; expected a "
        "KServe v2 inference request",
    ),
    "an input's data nested 100 000 deep": Refusal(
        {"data": b'{"inputs": [{"name": "input", "data": ' + b"[" * 100_000},
        "request's JSON nests lists or objects deeper than Python's parser goes",
    ),
    # numpy's cast made inf of it (a RuntimeWarning: a 500 where warnings are errors).
    "FP32 values past float32's range": Refusal(
        _body({"inputs": [_input(data=[1e300] * 512)]}),
        "input 'input' is FP32 and holds values beyond its range (+-3.40282e+38); expected "
        "finite FP32 values",
    ),
    # Python's parser read a number past float64's range as an infinity, taken as one.
    "a number written past float64's range": Refusal(
        {
            "data": b'{"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", '
            b'"data": [1e400' + b", 0" * 511 + b"]}]}"
        },
        "input 'input' is FP32 and holds values beyond its range (+-3.40282e+38); expected "
        "finite FP32 values, or Infinity written as such",
    ),
    "65 request parameters": Refusal(
        _body({"inputs": [_input()], "parameters": _many_parameters(65)}),
        "the request has 65 parameters; expected at most 64",
    ),
    "65 input parameters": Refusal(
        _body({"inputs": [_input(parameters=_many_parameters(65))]}),
        "input 'input' has 65 parameters; expected at most 64",
    ),
    "65 output parameters": Refusal(
        _body(
            {
                "inputs": [_input()],
                "outputs": [{"name": "output", "parameters": _many_parameters(65)}],
            }
        ),
        "output 'output' has 65 parameters; expected at most 64",
    ),
    # numpy's object array of it could not be walked (.flat): a RuntimeError, a 500.
    "INT64 data nested 40 deep": Refusal(
        _body({"inputs": [_input(datatype="INT64", shape=[1], data=_nested([1.5], 40))]}),
        "input 'input' is INT64 and its 'data' holds numbers with fractions",
    ),
    # Python refuses to read an integer past 4 300 digits: a ValueError, a 500.
    "an integer of 5 000 digits": Refusal(
        {"data": b'{"inputs": [{"name": "input", "data": [' + b"7" * 5000 + b"]}]}"},
        "request's JSON does not parse (Exceeds the limit (4300 digits)",
    ),
    "an Inference-Header-Content-Length of 5 000 digits": Refusal(
        {"data": b"{}", "headers": {"Inference-Header-Content-Length": "9" * 5000}},
        "header Inference-Header-Content-Length is '99999",
    ),
    # Its leading zeros were dropped to count its digits, not to read it: int() raised.
    "an Inference-Header-Content-Length of 4 301 zeros and a 3": Refusal(
        {"data": b"{}", "headers": {"Inference-Header-Content-Length": "0" * 4301 + "3"}},
        "header Inference-Header-Content-Length is '00000000",
    ),
    # A key given twice: json.loads keeps the last, a proxy's reader may keep the first.
    "the request's id given twice": Refusal(
        _written(f'{{"id": "first", "id": "second", "inputs": [{_INPUT_JSON}]}}'),
        "the request has key 'id' more than once; expected each key once (JSON readers differ "
        "on which value counts)",
    ),
    "the request's inputs given twice": Refusal(
        _written(f'{{"inputs": [{_INPUT_JSON}], "inputs": [{_INPUT_JSON}]}}'),
        "the request has key 'inputs' more than once",
    ),
    "an input's name given twice": Refusal(
        _written(f'{{"inputs": [{_INPUT_JSON[:-1]}, "name": "input"}}]}}'),
        "input 0 has key 'name' more than once",
    ),
    "an output's name given twice": Refusal(
        _written(
            f'{{"inputs": [{_INPUT_JSON}], "outputs": [{{"name": "output", "name": "output"}}]}}'
        ),
        "output 0 has key 'name' more than once",
    ),
    "a request parameter given twice": Refusal(
        _written(
            f'{{"inputs": [{_INPUT_JSON}], "parameters": {{"lane": "bulk", "lane": "standard"}}}}'
        ),
        "the request's 'parameters' has key 'lane' more than once",
    ),
    "an input parameter given twice": Refusal(
        _written(
            f'{{"inputs": [{_INPUT_JSON[:-1]}, "parameters": {{"binary_data_size": 0, '
            '"binary_data_size": 4}}]}'
        ),
        "input 'input''s 'parameters' has key 'binary_data_size' more than once",
    ),
    "64 request parameters, each unknown": Refusal(  # at the bound: read, and refused as unknown
        _body({"inputs": [_input()], "parameters": _many_parameters(64)}),
        "unknown request parameter(s) 'p0'",
    ),
}


def test_each_fault_is_refused_naming_it_and_counted(small_model: Path) -> None:
    """One server, every refusal of an inference request: its HTTP status, its reason
    and the words naming the fault, as JSON; each counted by ModelStatistics as a
    request that failed (it had been read or refused as ModelInfer's are)."""

    async def scenario() -> dict[str, str]:
        failures: dict[str, str] = {}
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            _,
            http,
        ):
            for name, refusal in REFUSALS.items():
                before = await fail_count(http)
                answer = await post(http, INFER, **refusal.options)
                try:
                    assert_refused(answer, refusal.status, refusal.reason, refusal.fragment)

                    async def counted(before: int = before) -> bool:
                        return await fail_count(http) == before + 1

                    await until_true(counted)
                except AssertionError as error:
                    failures[name] = f"{answer.status} {answer.body[:400]!r}: {error}"
        return failures

    assert asyncio.run(scenario()) == {}


def test_a_request_for_another_model_is_not_found_and_not_counted(small_model: Path) -> None:
    """A request for a model not served here (or a version) is no request to this one:
    404 MODEL_NOT_FOUND, counted in no lane nor ModelStatistics (in laneserve.http.requests
    alone), whether or not its body reads: the model is
    named in the path, before the body."""

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            _,
            http,
        ):
            cases: list[tuple[str, dict[str, Any], str]] = [
                ("/v2/models/resnet/infer", {"body": infer_body(rows(1))}, "model 'resnet'"),
                (
                    f"/v2/models/{MODEL}/versions/3/infer",
                    {"body": infer_body(rows(1))},
                    "no version '3'",
                ),
                ("/v2/models/resnet/infer", {"data": b"{nope"}, "model 'resnet'"),
                ("/v2/models/resnet/infer", {"body": {"inputs": 5}}, "model 'resnet'"),
                (f"/v2/models/{MODEL}/versions/3/infer", {"data": b"{nope"}, "no version '3'"),
            ]
            for path, options, fragment in cases:
                assert_refused(await post(http, path, **options), 404, "MODEL_NOT_FOUND", fragment)
            assert await fail_count(http) == 0
            # Then one counted refusal: the count moves (it is read, not stuck at 0).
            await post(http, INFER, {"inputs": 5})

            async def counted() -> bool:
                return await fail_count(http) == 1

            await until_true(counted)

    asyncio.run(scenario())


# ---- lanes and deadlines ------------------------------------------------------------------


def test_priority_and_lane_parameters_choose_the_lane(small_model: Path) -> None:
    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            http,
        ):
            cases = [
                ({"priority": 1}, "interactive"),
                ({"priority": 3}, "bulk"),
                ({"priority": 0}, "standard"),
                ({"lane": "bulk"}, "bulk"),
                ({"lane": "interactive", "priority": 1}, "interactive"),
                ({}, "standard"),
            ]
            for parameters, lane in cases:
                answer = await post(http, INFER, infer_body(rows(1), parameters=parameters))
                assert answer.status == 200, answer.body[:300]
                assert answer.json["parameters"]["laneserve_lane"] == lane, parameters
            await until_stats(
                s,
                lambda stats: (
                    {lane.name: lane.completed for lane in stats.lanes}
                    == {"interactive": 2, "standard": 2, "bulk": 2}
                ),
            )

    asyncio.run(scenario())


def test_the_timeout_parameter_expires_a_queued_request_504(small_model: Path) -> None:
    """Queued behind a held batch with a 1 us budget (1 ms, rounded up): 504 with its
    reason; one without a timeout waits and is answered."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model)) as (s, http):
            engine.hold_next()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            assert await asyncio.to_thread(engine.entered.acquire, timeout=30), "a batch ran"
            answer = await post(
                http, INFER, infer_body(rows(1, start=1), parameters={"timeout": 1})
            )
            assert answer.status == 504, answer.body
            assert answer.json["reason"] in ("DEADLINE_UNMEETABLE", "EXPIRED_IN_QUEUE")
            assert answer.json["error"]
            waiting = asyncio.ensure_future(post(http, INFER, infer_body(rows(2, start=2))))
            await until(lambda: queued_rows(s) == 2)
            engine.release()
            assert only_output(await waiting)["shape"] == [2, 10]
            await running
            assert 1 not in engine.ran_tags, "the expired request never ran"

    asyncio.run(scenario())


def test_a_full_lane_refuses_429_with_retry_after(small_model: Path) -> None:
    lanes = (
        LaneConfig("standard", capacity_rows=8, timeout_ms=60_000, max_wait_ms=0, min_share=0.0),
    )

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model, lanes=lanes)) as (s, http):
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            await asyncio.to_thread(engine.entered.acquire)
            queued = [
                asyncio.ensure_future(s.stub.Infer(request(rows(4, start=10 * i)))) for i in (1, 2)
            ]
            await until(lambda: queued_rows(s) == 8)
            answer = await post(http, INFER, infer_body(rows(1)))
            assert_refused(answer, 429, "LANE_FULL", "lane 'standard' is full")
            retry_after_ms = answer.json["retry_after_ms"]
            assert type(retry_after_ms) is int
            assert retry_after_ms >= 1
            assert int(answer.headers["Retry-After"]) == max(1, -(-retry_after_ms // 1000))
            engine.release()
            await asyncio.gather(running, *queued)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert dict(stats.lanes[0].rejected) == {"LANE_FULL": 1}

    asyncio.run(scenario())


def _http_answer(error: LaneserveError) -> Answer:
    """The HTTP answer to a method that aborted with `error`, its trailers as abort_with
    sends them (the rich status, and the pushback where a retry is advised)."""
    aborted = kserve_http.HttpAbort(error.code, error.message, status_trailers(error))
    answer = kserve_http._answer_error(aborted)
    assert isinstance(answer.body, bytes)
    return Answer(answer.status, answer.headers, answer.body)


def test_resource_exhausted_is_413_where_no_retry_gets_past_else_429_with_retry_after() -> None:
    """RESOURCE_EXHAUSTED of a request too large for the server (a row over the memory
    budget, an answer over max_message_bytes) is 413 with no retry advised; a full
    lane's is 429 with its pushback as retry_after_ms and Retry-After in whole seconds,
    rounded up (1500 ms: 2 s; 1 ms: 1 s)."""
    too_large = [
        (DeviceMemoryError("one row needs 3 GiB, over the memory budget"), "DEVICE_MEMORY"),
        (AnswerTooLargeError("the answer is over max_message_bytes"), "ANSWER_TOO_LARGE"),
    ]
    for error, reason in too_large:
        answer = _http_answer(error)
        assert_refused(answer, 413, reason, error.message)
        assert "Retry-After" not in answer.headers
        assert "retry_after_ms" not in answer.json
    for retry_after_s, retry_after_ms, header in ((1.5, 1500, "2"), (0.001, 1, "1")):
        full = LaneFullError("lane 'standard' is full", retry_after_s=retry_after_s)
        answer = _http_answer(full)
        assert_refused(answer, 429, "LANE_FULL", "lane 'standard' is full")
        assert answer.json["retry_after_ms"] == retry_after_ms
        assert answer.headers["Retry-After"] == header


# ---- limits -------------------------------------------------------------------------------


def test_inference_calls_over_max_concurrent_rpcs_are_refused_429_server_busy(
    small_model: Path,
) -> None:
    """One HTTP inference call in progress (held in the engine) of at most one: the next
    is refused 429 SERVER_BUSY, the metadata calls answered; once it ends, calls go on."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model, max_concurrent_rpcs=1)) as (_, http):
            engine.hold_next()
            running = asyncio.ensure_future(post(http, INFER, infer_body(rows(1, start=0))))
            assert await asyncio.to_thread(engine.entered.acquire, timeout=30), "a batch ran"
            busy = await post(http, INFER, infer_body(rows(1, start=1)))
            assert_refused(busy, 429, "SERVER_BUSY", "max_concurrent_rpcs")
            assert busy.headers["Retry-After"] == "1"  # HTTP's least: it had none
            assert (await get(http, f"/v2/models/{MODEL}")).status == 200
            engine.release()
            assert only_output(await running)["shape"] == [1, 10]
            assert only_output(await post(http, INFER, infer_body(rows(1))))["shape"] == [1, 10]
            assert 1 not in engine.ran_tags

    asyncio.run(scenario())


def test_a_body_over_max_message_bytes_is_refused_413_however_it_comes(small_model: Path) -> None:
    """By its Content-Length, unread; streamed in chunks with no length, as it is read;
    compressed small and inflating past the limit. Each 413 in JSON."""
    limit = 4096
    # Zeros: they compress well, so that the gzip-compressed body is well under the limit.
    over = json.dumps(infer_body(np.zeros((2, 512), np.float32))).encode()
    assert len(over) > limit

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(over), 1000):
            yield over[start : start + 1000]

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model, max_message_bytes=limit)) as (_, http):
            by_length = await post(http, INFER, data=over)
            assert_refused(
                by_length,
                413,
                None,
                f"request body is {len(over)} bytes, over the limit of {limit} "
                "(server.max_message_bytes)",
            )
            chunked = await post(http, INFER, data=chunks())
            assert_refused(chunked, 413, None, f"over the limit of {limit}")
            packed = gzip.compress(over)
            assert len(packed) < limit
            inflated = await post(http, INFER, data=packed, headers={"Content-Encoding": "gzip"})
            # Its size inflated, named so: the body as sent is under the limit.
            assert_refused(
                inflated, 413, None, f"request body inflates (gzip) to at least {limit + 1} bytes"
            )
            assert engine.ran_tags == []
            one = rows(1)
            fits = await post(
                http, INFER, **with_binary({"inputs": [binary_input("input", one)]}, one)
            )
            assert only_output(fits)["shape"] == [1, 10]

    asyncio.run(scenario())


def test_a_refused_body_the_client_keeps_sending_has_its_connection_closed(
    small_model: Path,
) -> None:
    """A body refused unread (413 by its Content-Length, 1 TiB) whose client sends on:
    after its answer, the server reads and drops what comes for at most LINGER_S, then
    closes the connection (the client's reads end, its writes fail), rather than read
    the body to its end (aiohttp's default read on for 10 s, GB of it)."""
    limit = 4096

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model, max_message_bytes=limit)) as (s, _):
            assert s.server.http_port is not None
            async with connection(s.server.http_port) as (reader, writer):
                writer.write(request_head(INFER, 2**40))

                async def send_on() -> None:
                    chunk = b" " * 65536
                    while True:
                        writer.write(chunk)
                        await writer.drain()

                sending = asyncio.ensure_future(send_on())
                try:
                    refused = await refused_unread(reader)
                    assert_refused(refused, 413, None, f"over the limit of {limit}")
                    # A bound, not a timing: the close comes, where it would not for minutes.
                    async with asyncio.timeout(15):
                        with contextlib.suppress(ConnectionError):
                            while await reader.read(65536):
                                pass
                        with pytest.raises(ConnectionError):
                            await sending
                finally:
                    sending.cancel()
                    with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                        await sending
            assert engine.ran_tags == []
            assert answered(s) == {(INFER_ROUTE, 413): 1}

    asyncio.run(scenario())


def test_compressed_requests_are_inflated_and_refused_415_when_turned_off(
    small_model: Path,
) -> None:
    x = rows(3, seed=2)
    plain = json.dumps(infer_body(x)).encode()

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model)) as (s, http):
            expected = output(await s.stub.Infer(request(x)))
            for encoding, packed in (
                ("gzip", gzip.compress(plain)),
                ("deflate", zlib.compress(plain)),
            ):
                answer = await post(
                    http, INFER, data=packed, headers={"Content-Encoding": encoding}
                )
                assert fp32_data(only_output(answer)).tobytes() == expected.tobytes(), encoding
        async with http_serving(
            RecordingEngine(str(small_model)), config(small_model, compressed_requests=False)
        ) as (_, http):
            refused = await post(
                http, INFER, data=gzip.compress(plain), headers={"Content-Encoding": "gzip"}
            )
            assert_refused(
                refused,
                415,
                None,
                "request body is gzip-compressed and this server takes no compressed requests "
                "(server.compressed_requests false)",
            )
            assert only_output(await post(http, INFER, data=plain))["shape"] == [3, 10]

    asyncio.run(scenario())


def test_a_compressed_body_that_does_not_inflate_is_refused_400_another_coding_415(
    small_model: Path,
) -> None:
    """compressed_requests on: a body that is no gzip (zlib) stream, or one cut short
    (its end, or its trailer, missing), or one with bytes after its end (another gzip
    member, which a reader of one would drop unread), is refused 400 naming why; a coding
    this server does not inflate (br, compress) 415 naming those it does; none of them
    counted as a request (the wire's refusals, as gRPC's core makes its own). gzip,
    deflate and identity in any case are read."""
    x = rows(2, seed=3)
    plain = json.dumps(infer_body(x)).encode()
    packed, zipped = gzip.compress(plain), zlib.compress(plain)
    cut_short = "ends before its {} stream does; expected a whole compressed body"
    past_the_end = "request body goes on {} bytes past the end of its {} stream; expected one"
    cases = [
        ("gzip", b"this is no gzip stream", 400, "request body does not inflate ("),
        ("deflate", b"this is no zlib stream", 400, "request body does not inflate ("),
        ("gzip", packed[: len(packed) // 2], 400, cut_short.format("gzip")),
        ("gzip", packed[:-4], 400, cut_short.format("gzip")),  # its length, in the trailer
        ("deflate", zipped[: len(zipped) // 2], 400, cut_short.format("deflate")),
        ("gzip", packed + b"trailing", 400, past_the_end.format(8, "gzip")),
        ("gzip", packed + packed, 400, past_the_end.format(len(packed), "gzip")),  # 2 members
        ("deflate", zipped + b"\0", 400, past_the_end.format(1, "deflate")),
        ("br", packed, 415, "request body is br-compressed; expected gzip, deflate or none"),
        ("compress", packed, 415, "body is compress-compressed; expected gzip, deflate or none"),
    ]

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model)) as (s, http):
            assert s.server.config.compressed_requests, "the default"
            for coding, data, status, fragment in cases:
                answer = await post(http, INFER, data=data, headers={"Content-Encoding": coding})
                assert_refused(answer, status, None, fragment)
            assert engine.ran_tags == []
            assert await fail_count(http) == 0
            expected = output(await s.stub.Infer(request(x)))
            for coding, data in (
                ("GZip", packed),
                ("x-gzip", packed),  # RFC 9110: gzip by its old name
                ("deflate", zipped),
                ("identity", plain),
                ("", plain),
            ):
                answer = await post(http, INFER, data=data, headers={"Content-Encoding": coding})
                assert fp32_data(only_output(answer)).tobytes() == expected.tobytes(), coding

    asyncio.run(scenario())


def test_a_body_that_stalls_is_refused_408_and_frees_its_call(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body of 100 bytes by its Content-Length of which 1 comes, then nothing for
    BODY_IDLE_S (0.3 s here): 408 in JSON naming the stall, ending its connection, not
    counted as a request; the call it held (of max_concurrent_rpcs 1) is free: the next
    is answered (a stalled body held it until the caller left)."""
    monkeypatch.setattr(kserve_http, "BODY_IDLE_S", 0.3)

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model, max_concurrent_rpcs=1)) as (s, http):
            assert s.server.http_port is not None
            async with connection(s.server.http_port) as (reader, writer):
                writer.write(request_head(INFER, 100) + b"{")
                stalled = await refused_unread(reader)
            assert_refused(stalled, 408, None, "request body stalled: 1 bytes in ")
            assert "and it paused 0.3 s; expected the whole body at once" in stalled.json["error"]
            assert only_output(await post(http, INFER, infer_body(rows(1))))["shape"] == [1, 10]
            assert answered(s) == {(INFER_ROUTE, 408): 1, (INFER_ROUTE, 200): 1}
            assert await fail_count(http) == 0

    asyncio.run(scenario())


def test_expect_100_continue_is_refused_on_the_headers_or_answered_continue(
    small_model: Path,
) -> None:
    """`Expect: 100-continue` (curl's, for a body over 1 KiB): a request its headers
    refuse (over max_message_bytes by its Content-Length, for another model, compressed
    with compression off, over max_concurrent_rpcs) is answered that refusal before its
    body is sent, ending its connection, each counted by route and status; a good one
    gets "100 Continue", then its answer to the body it sends after it (aiohttp's own
    handler sent "100 Continue" to every one). An Expect of anything else: 417."""
    limit = 64 * 1024
    good = json.dumps(infer_body(rows(1, start=1))).encode()
    served = config(
        small_model, max_message_bytes=limit, max_concurrent_rpcs=1, compressed_requests=False
    )

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, served) as (s, http):
            port = s.server.http_port
            assert port is not None
            over = await headers_alone(port, INFER, limit + 1)
            assert_refused(
                over, 413, None, f"request body is {limit + 1} bytes, over the limit of {limit}"
            )
            elsewhere = await headers_alone(port, "/v2/models/resnet/infer", len(good))
            assert_refused(elsewhere, 404, "MODEL_NOT_FOUND", "model 'resnet' is not served here")
            packed = await headers_alone(port, INFER, len(good), **{"Content-Encoding": "gzip"})
            assert_refused(packed, 415, None, "this server takes no compressed requests")
            engine.hold_next()
            running = asyncio.ensure_future(post(http, INFER, infer_body(rows(1, start=0))))
            assert await asyncio.to_thread(engine.entered.acquire, timeout=30), "a batch ran"
            busy = await headers_alone(port, INFER, len(good))
            assert_refused(busy, 429, "SERVER_BUSY", "max_concurrent_rpcs")
            engine.release()
            assert only_output(await running)["shape"] == [1, 10]
            async with connection(port) as (reader, writer):
                writer.write(
                    request_head(
                        INFER, len(good), {"Expect": "100-continue", "Connection": "close"}
                    )
                )
                status, _ = await read_head(reader)
                assert status == 100, "Continue, before the body is sent"
                writer.write(good)
                answer = await read_answer(reader)
            assert only_output(answer)["shape"] == [1, 10]
            assert answered(s) == {
                (INFER_ROUTE, 413): 1,
                (INFER_ROUTE, 404): 1,
                (INFER_ROUTE, 415): 1,
                (INFER_ROUTE, 429): 1,
                (INFER_ROUTE, 200): 2,
            }
            assert engine.ran_tags == [0, 1], "the held call's, then the good one's"
            unknown = await headers_alone(port, INFER, len(good), Expect="something")
            assert_refused(
                unknown, 417, None, "unknown Expect header 'something'; expected 100-continue"
            )
            assert answered(s)[INFER_ROUTE, 417] == 1

    asyncio.run(scenario())


def _concat_model(path: Path) -> Path:
    """ "x" [N, 3] FP32 answered as "y", x four times side by side: [N, 12]."""
    graph = helper.make_graph(
        [helper.make_node("Concat", ["x", "x", "x", "x"], ["y"], axis=1)],
        path.stem,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 12])],
    )
    return save_model(path, graph)


def test_an_answer_over_max_message_bytes_is_refused_413(tmp_path: Path) -> None:
    """A request that fits the limit whose answer does not: no retry gets past it, so not
    429 (RESOURCE_EXHAUSTED's status otherwise) but 413, ANSWER_TOO_LARGE."""
    path = _concat_model(tmp_path / "wide.onnx")
    x = np.ones((30, 3), np.float32)  # 1 440 bytes of answer

    async def scenario() -> None:
        async with http_serving(_engine(path), config(path, max_message_bytes=1024)) as (_, http):
            body = {
                "inputs": [{"name": "x", "shape": [30, 3], "datatype": "FP32", "data": [1] * 90}]
            }
            assert len(json.dumps(body)) < 1024
            answer = await post(http, "/v2/models/wide/infer", body)
            assert_refused(answer, 413, "ANSWER_TOO_LARGE", "max_message_bytes (1024)")
            small = {"inputs": [json_input("x", x[:2])]}
            assert only_output(await post(http, "/v2/models/wide/infer", small))["shape"] == [2, 12]

    asyncio.run(scenario())


# ---- the caller leaving, and the drain ---------------------------------------------------


def test_a_caller_that_closes_its_connection_cancels_its_queued_request(
    small_model: Path,
) -> None:
    """Queued behind a held batch, an HTTP request whose caller goes (its connection
    closed) leaves its lane at once, is counted CANCELLED (and 499 by the HTTP front
    end), and never runs."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model)) as (s, _):
            engine.hold()
            running = asyncio.ensure_future(s.stub.Infer(request(rows(1, start=0))))
            await asyncio.to_thread(engine.entered.acquire)
            async with session_to(s) as leaving:
                queued = asyncio.ensure_future(post(leaving, INFER, infer_body(rows(5, start=10))))
                await until(lambda: queued_rows(s) == 5)
                queued.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await queued
            await until(lambda: queued_rows(s) == 0)
            # Counted as the caller that left first (499), not as an answer sent.
            await until(lambda: answered(s) == {(INFER_ROUTE, 499): 1})
            engine.release()
            await running
            await until_stats(
                s, lambda stats: lane_stats(stats, "standard").shed.get("CANCELLED", 0) == 1
            )
            assert engine.ran_tags == [0]

    asyncio.run(scenario())


def test_the_drain_answers_calls_in_flight_and_refuses_new_ones_then_closes_the_port(
    small_model: Path,
) -> None:
    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model)) as (s, http):
            port = s.server.http_port
            assert port is not None
            engine.hold_next()
            running = asyncio.ensure_future(post(http, INFER, infer_body(rows(1, start=0))))
            assert await asyncio.to_thread(engine.entered.acquire, timeout=30), "a batch ran"
            stopping = asyncio.ensure_future(s.server.stop(grace_s=30))
            await until(lambda: s.server.state.value == "DRAINING")
            # The port listens until every admitted request has its answer.
            late = await post(http, INFER, infer_body(rows(1, start=1)))
            assert_refused(late, 503, "DRAINING", "")
            ready = await get(http, "/v2/health/ready")
            assert (ready.status, ready.json) == (503, {"ready": False})
            engine.release()
            assert only_output(await running)["shape"] == [1, 10]
            await asyncio.wait_for(stopping, timeout=60)
            assert engine.ran_tags == [0]
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection("127.0.0.1", port)
            with pytest.raises(aiohttp.ClientConnectionError):
                await get(http, "/v2/health/live")

    asyncio.run(scenario())


def test_a_connection_with_no_request_under_way_is_closed_when_idle(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp kept a connection that sent nothing, or a request line or headers cut
    short, for its default hour: 290 of them under `ulimit -n 300` took every file of
    the process, gRPC's port's too. Closed after IDLE_CONNECTION_S (0.3 s here)."""
    monkeypatch.setattr(kserve_http, "IDLE_CONNECTION_S", 0.3)
    starts = (b"", b"GET /v2/health/li", b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            http,
        ):
            assert s.server.http_port is not None
            closed = await sent_alone(s.server.http_port, starts, asyncio.StreamReader.read)
            assert closed == [b""] * len(starts)  # read to the end: closed by the server
            assert (await get(http, "/v2/health/live")).status == 200

    asyncio.run(scenario())


def test_a_request_the_http_parser_refuses_is_counted_not_logged_as_an_error(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp logged each request its parser refused (two Content-Lengths, a space in a
    header's name) at ERROR with a traceback repeating the client's bytes: any client
    wrote ERROR lines at will. Counted instead, under the route `malformed`, and told of
    in an aggregated INFO line; the port serves on."""
    bad = (
        b"GET /v2 HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET /v2 HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n",
    )

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            http,
        ):
            assert s.server.http_port is not None
            heads = await sent_alone(s.server.http_port, bad, asyncio.StreamReader.readline)
            assert all(b" 400 " in head for head in heads), heads
            assert (await get(http, "/v2/health/live")).status == 200
            assert answered(s)[kserve_http.MALFORMED_ROUTE, 400] == 2
            s.server.telemetry.event_log.flush()

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    lines = [r for r in caplog.records if getattr(r, "event", None) == "http_requests_malformed"]
    assert {line.levelno for line in lines} == {logging.INFO}
    told = [
        re.search(r"refused (\d+) request\(s\) it could not parse", r.getMessage()) for r in lines
    ]
    assert sum(int(match.group(1)) for match in told if match) == 2


def test_a_body_still_arriving_when_the_drain_ends_is_answered_draining(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request half sent when its server stopped (the drain had nothing to wait for):
    aiohttp's stop waited out its timeout, cancelled the handler and closed the
    connection with no answer, counted 499 as if the caller had left. It is answered 503
    DRAINING, its connection ended, counted as such."""
    body = json.dumps(infer_body(rows(2))).encode()

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model)) as (s, _http):
            front = s.server._http
            assert front is not None
            assert s.server.http_port is not None
            async with connection(s.server.http_port) as (reader, writer):
                writer.write(request_head(INFER, len(body)) + body[: len(body) // 2])
                await until(lambda: len(front._bodies_reading) == 1)
                await asyncio.wait_for(s.server.stop(grace_s=30), timeout=60)
                stopped = await refused_unread(reader)
            assert_refused(stopped, 503, "DRAINING", "server is stopping and this request's body")
            assert answered(s) == {(INFER_ROUTE, 503): 1}
            assert engine.ran_tags == []
        # Not aiohttp's "Unhandled exception" of a body read after the answer.
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []

    asyncio.run(scenario())


# ---- shared memory ------------------------------------------------------------------------


@pytest.fixture
def shm() -> Iterator[SharedMemory]:
    made = SharedMemory()
    try:
        yield made
    finally:
        made.close()


def test_shared_memory_regions_are_registered_and_tensors_placed_in_them_over_http(
    small_model: Path, shm: SharedMemory
) -> None:
    """Two regions of one object registered over HTTP and listed as Triton's list; an
    inference whose input is read from one and whose output is written to the other
    (its answer's output has neither data nor binary data, whatever
    binary_data_output asks); the region holds the plain answer bit for bit; unregister
    one, then all."""
    x = rows(4, seed=7)
    made = shm.create(3 * PAGE_BYTES)
    made.write(0, x.tobytes())
    assert x.nbytes == 2 * PAGE_BYTES
    out_offset, out_bytes = 2 * PAGE_BYTES, 4 * 10 * 4

    async def scenario() -> None:
        async with http_serving(
            RecordingEngine(str(small_model)), config(small_model, shared_memory=True)
        ) as (s, http):
            expected = output(await s.stub.Infer(request(x))).tobytes()
            for name, offset, size in (("in", 0, x.nbytes), ("out", out_offset, PAGE_BYTES)):
                registered = await post(
                    http,
                    f"/v2/systemsharedmemory/region/{name}/register",
                    {"key": made.key, "offset": offset, "byte_size": size},
                )
                assert (registered.status, registered.json) == (200, {}), registered.body
            listed = await get(http, "/v2/systemsharedmemory/status")
            assert listed.status == 200
            assert isinstance(listed.json, list)
            assert sorted(listed.json, key=lambda region: str(region["name"])) == [
                {"name": "in", "key": made.key, "offset": 0, "byte_size": x.nbytes},
                {"name": "out", "key": made.key, "offset": out_offset, "byte_size": PAGE_BYTES},
            ]
            one = await get(http, "/v2/systemsharedmemory/region/out/status")
            assert [region["name"] for region in one.json] == ["out"]
            body = {
                "id": "shm-1",
                "inputs": [
                    {
                        "name": "input",
                        "shape": [4, 512],
                        "datatype": "FP32",
                        "parameters": {REGION_PARAMETER: "in", BYTE_SIZE_PARAMETER: x.nbytes},
                    }
                ],
                "outputs": [
                    {
                        "name": "output",
                        "parameters": {REGION_PARAMETER: "out", BYTE_SIZE_PARAMETER: out_bytes},
                    }
                ],
                "parameters": {"binary_data_output": True},
            }
            answer = await post(http, INFER, body)
            assert answer.status == 200, answer.body
            assert HEADER_LENGTH not in answer.headers
            assert answer.json["id"] == "shm-1"
            assert answer.json["outputs"] == [
                {"name": "output", "datatype": "FP32", "shape": [4, 10]}
            ]
            assert made.read(out_offset, out_bytes) == expected, "bit for bit"
            assert made.read(out_offset + out_bytes, 1) == FILLER, "nothing past it"
            # The input from shared memory, the output in the answer.
            placed_in = {"inputs": body["inputs"]}
            assert fp32_data(only_output(await post(http, INFER, placed_in))).tobytes() == expected
            gone = await post(http, "/v2/systemsharedmemory/region/in/unregister")
            assert (gone.status, gone.json) == (200, {})
            names = [
                region["name"] for region in (await get(http, "/v2/systemsharedmemory/status")).json
            ]
            assert names == ["out"]
            assert_refused(
                await get(http, "/v2/systemsharedmemory/region/in/status"),
                404,
                "REGION_NOT_FOUND",
                "'in'",
            )
            everything = await post(http, "/v2/systemsharedmemory/unregister")
            assert (everything.status, everything.json) == (200, {})
            assert (await get(http, "/v2/systemsharedmemory/status")).json == []
            assert_refused(
                await post(http, "/v2/systemsharedmemory/region/r/register", {"key": made.key}),
                400,
                "INVALID_INPUT",
                "'byte_size' is missing (or null); expected bytes, an integer >= 0",
            )

    asyncio.run(scenario())


def test_shared_memory_calls_refuse_a_body_they_do_not_read_and_let_go_of_nothing(
    small_model: Path, shm: SharedMemory
) -> None:
    """Status and unregister take no body (the region's name is in the path, or none for
    every region): one that is not empty or `{}` is refused 400 naming what they take,
    and nothing is let go of (`garbage` to /v2/systemsharedmemory/unregister let go of
    every region). A register's body giving a key twice is refused, as an inference's."""
    made = shm.create(PAGE_BYTES)
    every = (
        "expected no body, or {}: POST /v2/systemsharedmemory/unregister reads none (it means "
        "every region; one is /v2/systemsharedmemory/region/<name>/unregister)"
    )
    one = (
        "expected no body, or {}: POST /v2/systemsharedmemory/region/{name}/unregister reads "
        "none (the region's name is in the path)"
    )
    status = "expected no body, or {}: GET /v2/systemsharedmemory/status reads none"
    refusals = [
        ("POST", "/v2/systemsharedmemory/unregister", b"garbage", "does not parse"),
        ("POST", "/v2/systemsharedmemory/unregister", b"garbage", every),
        ("POST", "/v2/systemsharedmemory/unregister", b'{"name": "a"}', "has keys ['name']; "),
        ("POST", "/v2/systemsharedmemory/unregister", b'["a"]', "the request is a list; "),
        ("POST", "/v2/systemsharedmemory/region/a/unregister", b"garbage", one),
        ("GET", "/v2/systemsharedmemory/status", b'{"name": "a"}', status),
        ("GET", "/v2/systemsharedmemory/region/a/status", b"a", "region/{name}/status reads none"),
        ("POST", "/v2/cudasharedmemory/unregister", b"garbage", "/v2/cudasharedmemory/region/"),
    ]

    async def scenario() -> None:
        async with http_serving(
            RecordingEngine(str(small_model)), config(small_model, shared_memory=True)
        ) as (_, http):
            for name in ("a", "b"):
                registered = await post(
                    http,
                    f"/v2/systemsharedmemory/region/{name}/register",
                    {"key": made.key, "byte_size": PAGE_BYTES},
                )
                assert registered.status == 200, registered.body
            for method, path, body, fragment in refusals:
                answer = await call(http, method, path, data=body)
                assert_refused(answer, 400, "INVALID_INPUT", fragment)
            listed = await get(http, "/v2/systemsharedmemory/status")
            assert sorted(region["name"] for region in listed.json) == ["a", "b"], "all kept"
            assert_refused(
                await post(
                    http,
                    "/v2/systemsharedmemory/region/c/register",
                    data=f'{{"key": "/elsewhere", "key": "{made.key}", "byte_size": 64}}'.encode(),
                ),
                400,
                "INVALID_INPUT",
                "the request has key 'key' more than once; expected each key once",
            )
            for empty in (b"", b"{}", b" \r\n"):  # what Triton's clients send, and {}
                let_go = await post(http, "/v2/systemsharedmemory/region/a/unregister", data=empty)
                assert (let_go.status, let_go.json) == (200, {}), let_go.body
                listed = await call(http, "GET", "/v2/systemsharedmemory/status", data=empty)
                assert [region["name"] for region in listed.json] == ["b"]
            everything = await post(http, "/v2/systemsharedmemory/unregister", data=b"{}")
            assert (everything.status, everything.json) == (200, {})
            assert (await get(http, "/v2/systemsharedmemory/status")).json == []

    asyncio.run(scenario())


def test_a_region_name_with_a_control_character_is_refused_over_http(
    small_model: Path, shm: SharedMemory
) -> None:
    """A region's name follows a model name's rule (server.model_name's): a NUL or a
    newline in the path's name is refused 400, and no region is listed."""
    made = shm.create(PAGE_BYTES)

    async def scenario() -> None:
        async with http_serving(
            RecordingEngine(str(small_model)), config(small_model, shared_memory=True)
        ) as (_, http):
            for encoded, shown in (("%00", "'\\x00'"), ("r%0A", "'r\\n'"), ("%20r", "' r'")):
                assert_refused(
                    await post(
                        http,
                        f"/v2/systemsharedmemory/region/{encoded}/register",
                        {"key": made.key, "byte_size": PAGE_BYTES},
                    ),
                    400,
                    "INVALID_INPUT",
                    f"region name is {shown}",
                )
            assert (await get(http, "/v2/systemsharedmemory/status")).json == []

    asyncio.run(scenario())


def test_shared_memory_off_is_refused_403_and_cuda_shared_memory_is_none(
    small_model: Path, shm: SharedMemory
) -> None:
    made = shm.create(PAGE_BYTES)
    off = "shared memory is off on this server (server.shared_memory = false"

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            _,
            http,
        ):
            placed = {
                "inputs": [
                    {
                        "name": "input",
                        "shape": [1, 512],
                        "datatype": "FP32",
                        "parameters": {REGION_PARAMETER: "r", BYTE_SIZE_PARAMETER: 2048},
                    }
                ]
            }
            answers = [
                await get(http, "/v2/systemsharedmemory/status"),
                await get(http, "/v2/systemsharedmemory/region/r/status"),
                await post(
                    http,
                    "/v2/systemsharedmemory/region/r/register",
                    {"key": made.key, "offset": 0, "byte_size": PAGE_BYTES},
                ),
                await post(http, "/v2/systemsharedmemory/unregister"),
                await post(http, "/v2/systemsharedmemory/region/r/unregister"),
                await post(http, INFER, placed),
            ]
            for answer in answers:
                assert_refused(answer, 403, "SHARED_MEMORY_REFUSED", off)
            extensions = (await get(http, "/v2")).json["extensions"]
            assert "system_shared_memory" not in extensions
            cuda = await post(
                http, "/v2/cudasharedmemory/region/g/register", {"raw_handle": {"b64": ""}}
            )
            assert_refused(cuda, 501, "UNSUPPORTED", "laneserve maps no CUDA memory")
            listed = await get(http, "/v2/cudasharedmemory/status")
            assert (listed.status, listed.json) == (200, [])
            unregistered = await post(http, "/v2/cudasharedmemory/unregister")
            assert (unregistered.status, unregistered.json) == (200, {})

    asyncio.run(scenario())


# ---- the repository, settings and paths ---------------------------------------------------


def test_repository_index_settings_and_unknown_paths_answer_in_json(small_model: Path) -> None:
    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            _,
            http,
        ):
            ready_model = [{"name": MODEL, "version": "1", "state": "READY", "reason": ""}]
            indexes: list[dict[str, Any]] = [{}, {"body": {}}, {"body": {"ready": True}}]
            for options in indexes:
                index = await post(http, "/v2/repository/index", **options)
                assert (index.status, index.json) == (200, ready_model), options
            assert_refused(
                await post(http, "/v2/repository/index", {"repository_name": "x"}),
                400,
                "INVALID_INPUT",
                "repository 'x' is not here",
            )
            assert_refused(
                await post(http, "/v2/repository/index", {"ready": "yes"}),
                400,
                "INVALID_INPUT",
                "'ready' is a string; expected true or false",
            )
            for verb in ("load", "unload"):
                assert_refused(
                    await post(http, f"/v2/repository/models/{MODEL}/{verb}"),
                    501,
                    "UNSUPPORTED",
                    f"laneserve {verb}s no model while it serves",
                )
            for method, path in (
                ("GET", "/v2/trace/setting"),
                ("POST", "/v2/trace/setting"),
                ("GET", f"/v2/models/{MODEL}/trace/setting"),
                ("GET", "/v2/logging"),
                ("POST", "/v2/logging"),
            ):
                # Read (no settings): tests/test_settings.py has the rest.
                settings = await call(http, method, path, body={})
                assert settings.status == 200, (method, path, settings.json)
                assert isinstance(settings.json, dict), (method, path)
            for method, path in (("GET", "/nope"), ("GET", "/v2/models"), ("POST", "/v3/infer")):
                assert_refused(
                    await call(http, method, path),
                    404,
                    None,
                    f"no such path: {method} {path}; expected KServe v2's",
                )
            for method, path, allowed in (
                ("GET", INFER, "POST"),
                ("POST", "/v2/health/live", "GET, HEAD"),
                ("DELETE", f"/v2/models/{MODEL}", "GET, HEAD"),
            ):
                refused = await call(http, method, path)
                assert_refused(refused, 405, None, f"{path} takes no {method}; expected {allowed}")
                assert refused.headers["Allow"] == allowed, "as HTTP asks of a 405"

    asyncio.run(scenario())


def test_operator_bodies_with_a_lone_surrogate_or_nested_too_deep_are_refused_400(
    small_model: Path,
) -> None:
    """A register's `key` or an index's `repository_name` holding a lone surrogate (valid
    JSON, no UTF-8), or a body nested past Python's parser (under the 64 KiB an operator
    body may hold): 400 naming it (a UnicodeEncodeError or RecursionError was a 500)."""
    register = "/v2/systemsharedmemory/region/r/register"
    nested = {"data": b"[" * 60_000}
    too_deep = "request's JSON nests lists or objects deeper than Python's parser goes; expected "
    cases = [
        (
            register,
            _raw({"key": LONE_SURROGATE, "byte_size": 4096}),
            "'key' holds a lone surrogate",
        ),
        (
            "/v2/repository/index",
            _raw({"repository_name": LONE_SURROGATE}),
            "'repository_name' holds a lone surrogate",
        ),
        (register, nested, f"{too_deep}a JSON object of a few fields"),
        ("/v2/repository/index", nested, f"{too_deep}a JSON object of a few fields"),
    ]

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            _,
            http,
        ):
            for path, options, fragment in cases:
                assert_refused(await post(http, path, **options), 400, "INVALID_INPUT", fragment)
            index = await post(http, "/v2/repository/index", {})
            assert index.status == 200, "and the port serves on"

    asyncio.run(scenario())


# ---- configuration ------------------------------------------------------------------------


def test_http_port_is_a_setting_and_a_flag_and_is_checked() -> None:
    assert ServerConfig(model_path="m.onnx").http_port == -1, "none by default"
    for bad in (70_000, -2):
        with pytest.raises(ConfigError, match=r"^server\.http_port: ") as refused:
            ServerConfig(model_path="m.onnx", http_port=bad)
        assert refused.value.key == "server.http_port"
    with pytest.raises(ConfigError, match=r"expected a port other than server\.port") as refused:
        ServerConfig(model_path="m.onnx", port=8001, http_port=8001)
    assert refused.value.key == "server.http_port"
    with pytest.raises(ConfigError, match=r"server\.priority_port"):
        ServerConfig(model_path="m.onnx", port=8001, priority_port=8002, http_port=8002)
    assert ServerConfig(model_path="m.onnx", port=0, http_port=0).http_port == 0, "0s never collide"
    for argv, expected in (([], -1), (["--http-port", "0"], 0), (["--http-port", "8000"], 8000)):
        args = _parser().parse_args(["serve", "--model", "m.onnx", *argv])
        assert _serve_config(args)[0].http_port == expected, argv


def test_an_http_port_already_taken_fails_the_start_and_leaves_no_port_open(
    small_model: Path,
) -> None:
    """Another socket listens on http_port: the start fails with a ConfigError keyed
    server.http_port (as check_ports_free refuses it before the model loads), and what
    the start had bound (the gRPC port) is let go: it binds again. The gRPC port is any
    free one (0), the one the start bound read back: a number picked free and closed
    before the start (`unused_port`) could be taken meanwhile by any process on the
    machine, and the start then failed on it, keyed server.port."""

    async def scenario() -> int | None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            http_port = taken.getsockname()[1]
            served = config(
                small_model, host="127.0.0.1", port=0, metrics_port=-1, http_port=http_port
            )
            with pytest.raises(ConfigError, match=r"^server\.http_port: ") as early:
                check_ports_free(served)
            assert early.value.key == "server.http_port"
            server = LaneServer(RecordingEngine(str(small_model)), served)
            try:
                with pytest.raises(ConfigError, match=r"^server\.http_port: ") as refused:
                    await server.start()
                assert refused.value.key == "server.http_port"
                assert str(http_port) in str(refused.value)
            finally:
                await server.stop()
        return server.port

    grpc_port = asyncio.run(scenario())
    assert grpc_port, "the gRPC port was bound before the HTTP port failed"
    with socket.socket() as again:
        again.bind(("127.0.0.1", grpc_port))  # the gRPC port was let go


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) here")


@pytest.fixture
def localhost_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """The resolver answers "localhost" with ::1 and 127.0.0.1, as most hosts' /etc/hosts
    has it (this one's may name only one): a name of two addresses, each family's."""
    resolve = socket.getaddrinfo

    def both(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if host != "localhost":
            return resolve(host, port, *args, **kwargs)
        found: list[Any] = []
        for address in ("::1", "127.0.0.1"):
            with contextlib.suppress(socket.gaierror):  # another family than the one asked
                found += resolve(address, port, *args, **kwargs)
        return found

    monkeypatch.setattr(socket, "getaddrinfo", both)


@needs_ipv6
@pytest.mark.usefixtures("localhost_both_ways")
def test_listening_sockets_are_dual_stack_on_any_and_one_port_for_each_address() -> None:
    """Host "::" binds one socket that takes IPv4 too (IPV6_V6ONLY 0); a name of two
    addresses binds one socket for each, both on the port the first one got."""
    (anywhere,) = listening_sockets("::", 0)
    with anywhere:
        assert anywhere.family == socket.AF_INET6
        assert anywhere.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    named = listening_sockets("localhost", 0)
    try:
        by_family = {listener.family: listener for listener in named}
        assert len(named) == 2
        assert set(by_family) == {socket.AF_INET, socket.AF_INET6}
        assert len({listener.getsockname()[1] for listener in named}) == 1, "one port"
        v6 = by_family[socket.AF_INET6]
        assert v6.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1, "IPv4 has its own"
    finally:
        for listener in named:
            listener.close()


@needs_ipv6
@pytest.mark.usefixtures("localhost_both_ways")
@pytest.mark.parametrize("host", ["[::]", "localhost"])
def test_the_http_port_answers_on_ipv4_and_ipv6_as_the_grpc_port_does(
    small_model: Path, host: str
) -> None:
    """host "[::]" (every address, the usual in a pod) and "localhost" (two addresses):
    the HTTP port answers on 127.0.0.1 and on ::1 alike (asyncio's own binding made "::"
    IPv6 only, refusing an IPv4 probe, and gave each address of a name its own port)."""

    async def scenario() -> None:
        served = config(small_model, host=host, port=0, metrics_port=-1, http_port=0)
        server = LaneServer(RecordingEngine(str(small_model)), served)
        await server.start()
        try:
            async with aiohttp.ClientSession() as http:
                for address in ("127.0.0.1", "[::1]"):
                    live = await get(http, f"http://{address}:{server.http_port}/v2/health/live")
                    assert (live.status, live.json) == (200, {"live": True}), address
        finally:
            await server.stop()

    asyncio.run(scenario())


# ---- TLS ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A throwaway CA, a server certificate (DNS laneserve.test, IP 127.0.0.1) and a client
    certificate signed by it (as test_readme_claims' fixture makes them)."""
    return issue_pki(tmp_path_factory.mktemp("http-pki"))


@pytest.fixture(scope="module")
def weak_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """`pki`'s, with a 1024-bit RSA key for the server's certificate."""
    return issue_pki(tmp_path_factory.mktemp("http-weak-pki"), "-newkey rsa:1024 -nodes")


def test_the_http_port_follows_the_ports_tls_and_mutual_tls(small_model: Path, pki: Pki) -> None:
    """With tls_cert and tls_key the HTTP port speaks HTTPS only (the CA's clients are
    answered, plain HTTP is not); with tls_client_ca it requires a client certificate."""
    ca_only = ssl.create_default_context(cafile=str(pki.ca))
    with_cert = ssl.create_default_context(cafile=str(pki.ca))
    with_cert.load_cert_chain(str(pki.client_cert), str(pki.client_key))

    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            for require_client_auth in (False, True):
                tls = pki.server_tls(require_client_auth=require_client_auth)
                async with serving(
                    RecordingEngine(str(small_model)), config(small_model, http_port=0, **tls)
                ) as s:
                    base = f"127.0.0.1:{s.server.http_port}"
                    good = with_cert if require_client_auth else ca_only
                    async with http.post(
                        f"https://{base}{INFER}", json=infer_body(rows(2)), ssl=good
                    ) as response:
                        assert response.status == 200
                        assert (await response.json())["outputs"][0]["shape"] == [2, 10]
                    with pytest.raises(aiohttp.ClientError):
                        await call(http, "GET", f"http://{base}/v2/health/live")
                    if require_client_auth:
                        with pytest.raises(aiohttp.ClientError):
                            async with http.get(
                                f"https://{base}/v2/health/live", ssl=ca_only
                            ) as response:
                                await response.read()
                    else:
                        with pytest.raises(aiohttp.ClientError):  # a CA that did not sign it
                            async with http.get(f"https://{base}/v2/health/live") as response:
                                await response.read()

    asyncio.run(scenario())


def test_the_http_and_metrics_ports_serve_https_with_a_1024_bit_rsa_key_as_grpc_does(
    small_model: Path, weak_pki: Pki
) -> None:
    """A certificate whose key is 1024-bit RSA: gRPC's BoringSSL serves with it, and so
    do the HTTP port and the metrics endpoint (Python's OpenSSL, at its default security
    level, refused it as the server started: "EE_KEY_TOO_SMALL"; the metrics endpoint,
    prometheus_client's own TLS, refused it and left its port bound)."""
    client = ssl.create_default_context(cafile=str(weak_pki.ca))
    client.set_ciphers("DEFAULT:@SECLEVEL=0")  # this client's OpenSSL refuses the key too
    tls = weak_pki.server_tls(require_client_auth=False)

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        served = config(small_model, http_port=0, metrics_port=0, **tls)
        async with serving(engine, served) as s, aiohttp.ClientSession() as http:
            url = f"https://127.0.0.1:{s.server.http_port}{INFER}"
            async with http.post(url, json=infer_body(rows(2)), ssl=client) as response:
                assert response.status == 200
                assert (await response.json())["outputs"][0]["shape"] == [2, 10]
            metrics = f"https://127.0.0.1:{s.server.metrics_port}/metrics"
            async with http.get(metrics, ssl=client) as response:
                assert response.status == 200
                assert "laneserve_" in await response.text()
            credentials = grpc.ssl_channel_credentials(weak_pki.ca.read_bytes())
            async with grpc.aio.secure_channel(s.target, credentials) as channel:
                stub = pb_grpc.InferenceServiceStub(channel)
                assert output(await stub.Infer(request(rows(1)), timeout=30)).shape == (1, 10)

    asyncio.run(scenario())


# ---- tracing ------------------------------------------------------------------------------


def test_an_http_infer_with_a_traceparent_is_a_server_span_in_the_callers_trace(
    small_model: Path,
) -> None:
    """A SERVER span "POST /v2/models/{model}/infer", a child of the caller's span, with
    the status the caller got (200; 400 for a refusal; 413 for a body over the limit),
    and the request's own spans its children."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        served = config(small_model, http_port=0, max_message_bytes=16384)
        async with serving_traced(engine, served) as (s, exporter):
            async with session_to(s) as http:
                traced = {"traceparent": TRACEPARENT}
                answer = await post(http, INFER, infer_body(rows(1), id="t-ok"), headers=traced)
                assert answer.status == 200
                refused = await post(http, INFER, {"inputs": 5}, headers=traced)
                assert refused.status == 400
                too_large = await post(http, INFER, data=b" " * 20_000, headers=traced)
                assert too_large.status == 413
                untraced = await post(http, INFER, infer_body(rows(1)))
                assert untraced.status == 200
                await until(lambda: len(spans_named(exporter, INFER_SPAN)) == 4)
            spans = spans_named(exporter, INFER_SPAN)
            in_caller = [span for span in spans if trace_id(span) == CALLER_TRACE_ID]
            assert len(in_caller) == 3
            statuses = sorted(attr(span, "http.response.status_code") for span in in_caller)
            assert statuses == [200, 400, 413]
            for span in in_caller:
                assert span.kind is SpanKind.SERVER
                assert parent_id(span) == CALLER_SPAN_ID
                assert attr(span, "http.request.method") == "POST"
                assert attr(span, "http.route") == "/v2/models/{model}/infer"
                assert span.status.status_code is not StatusCode.ERROR, "4xx is the caller's"
            ok = only(
                [span for span in in_caller if attr(span, "http.response.status_code") == 200]
            )
            enqueue = only(
                [
                    span
                    for span in spans_named(exporter, "enqueue")
                    if trace_id(span) == CALLER_TRACE_ID
                ]
            )
            assert parent_id(enqueue) == span_id(ok), "the request's spans are its children"
            (other,) = [span for span in spans if trace_id(span) != CALLER_TRACE_ID]
            assert other.parent is None, "no traceparent: a trace of its own"

    asyncio.run(scenario())


def test_a_refusal_on_the_expect_headers_is_a_server_span_as_without_expect(
    small_model: Path,
) -> None:
    """A refusal given to `Expect: 100-continue` headers (413 by Content-Length) is
    answered by the front end's expect handler, past the middleware that traces: it has
    its SERVER span in the caller's trace all the same (it had none)."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        served = config(small_model, http_port=0, max_message_bytes=16384)
        async with serving_traced(engine, served) as (s, exporter):
            assert s.server.http_port is not None
            over = await headers_alone(s.server.http_port, INFER, 20_000, traceparent=TRACEPARENT)
            assert over.status == 413
            await until(lambda: len(spans_named(exporter, INFER_SPAN)) == 1)
            (span,) = spans_named(exporter, INFER_SPAN)
            assert trace_id(span) == CALLER_TRACE_ID
            assert parent_id(span) == CALLER_SPAN_ID
            assert attr(span, "http.response.status_code") == 413

    asyncio.run(scenario())


# ---- counting -----------------------------------------------------------------------------


def test_answers_are_counted_by_route_and_status_and_scraped_as_http_requests(
    small_model: Path,
) -> None:
    """Each answer counted under its route's template ("unmatched" for a path of none) and
    its status, the HTTP wire's own refusals too (429 over max_concurrent_rpcs, which no
    lane sees); Prometheus scrapes them as laneserve_http_requests_total{route,code}, a
    series absent from a server without an HTTP port."""
    expected = {
        (INFER_ROUTE, 200): 2,
        (INFER_ROUTE, 400): 1,
        (INFER_ROUTE, 429): 1,
        ("unmatched", 404): 1,
        ("/v2/health/live", 200): 1,
    }

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model, max_concurrent_rpcs=1)) as (s, http):
            assert answered(s) == {}
            assert only_output(await post(http, INFER, infer_body(rows(1))))["shape"] == [1, 10]
            assert (await get(http, "/nope")).status == 404
            assert (await post(http, INFER, {"inputs": 5})).status == 400
            engine.hold_next()
            running = asyncio.ensure_future(post(http, INFER, infer_body(rows(1, start=0))))
            assert await asyncio.to_thread(engine.entered.acquire, timeout=30), "a batch ran"
            assert (await post(http, INFER, infer_body(rows(1)))).status == 429
            engine.release()
            assert only_output(await running)["shape"] == [1, 10]
            assert (await get(http, "/v2/health/live")).status == 200
            assert answered(s) == expected
            with_http = await asyncio.to_thread(scrape, s.server.metrics_port)
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as plain:
            assert plain.server.http_port is None
            assert output(await plain.stub.Infer(request(rows(1)))).shape == (1, 10)
            without_http = await asyncio.to_thread(scrape, plain.server.metrics_port)
        return with_http, without_http

    with_http, without_http = asyncio.run(scenario())
    scraped = {
        (sample.labels["route"], sample.labels["code"]): sample.value
        for sample in with_http["laneserve_http_requests"].samples
        if sample.name == "laneserve_http_requests_total"
    }
    assert scraped == {
        (route, str(code)): float(count) for (route, code), count in expected.items()
    }
    assert "laneserve_http_requests" not in without_http


def test_a_data_fault_is_counted_in_the_lane_the_request_names(small_model: Path) -> None:
    """A fault of its JSON data (the values against the shape) is found by the HTTP
    wire, before ModelInfer's path: counted in the lane the request's parameters name, as
    ModelInfer counts the same fault of its raw contents (in that lane's path), not in
    the default lane (it was)."""

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            http,
        ):
            short = _input(data=[0.0] * 511)
            for parameters in ({"lane": "bulk"}, {"priority": 3}):
                answer = await post(http, INFER, {"inputs": [short], "parameters": parameters})
                assert_refused(answer, 400, "INVALID_INPUT", "has 511 values in 'data'")
            unnamed = await post(http, INFER, {"inputs": [short]})
            assert_refused(unnamed, 400, "INVALID_INPUT", "has 511 values in 'data'")
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert dict(lane_stats(stats, "bulk").rejected)["INVALID_INPUT"] == 2
            assert dict(lane_stats(stats, "standard").rejected)["INVALID_INPUT"] == 1

    asyncio.run(scenario())


def test_a_body_under_its_minimum_rate_is_refused_408(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body that never pauses BODY_IDLE_S but comes slower than BODY_MIN_BYTES_PER_S past its
    first BODY_IDLE_S: 408 (a byte at a time, each within the pause allowed, held its
    call for good). Here a byte every 0.2 s (5 bytes/s) against a pause of 1 s and a
    rate of 10 bytes/s: due after about 2 s; the drip gives up after 10 s. The pause is
    far past the drip's step: a refusal is named a pause where one wait took 0.9 of it,
    and against a pause of 0.5 s an event loop (the test's and the server's) stalled
    0.3 s as the drip began (a loaded machine) had it named so; now it takes 0.7 s."""
    monkeypatch.setattr(kserve_http, "BODY_IDLE_S", 1.0)
    monkeypatch.setattr(kserve_http, "BODY_MIN_BYTES_PER_S", 10)  # bytes per second

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with http_serving(engine, config(small_model)) as (s, _):
            assert s.server.http_port is not None
            async with connection(s.server.http_port) as (reader, writer):
                writer.write(request_head(INFER, 10_000))
                answer = asyncio.ensure_future(read_answer(reader))
                with contextlib.suppress(ConnectionError):
                    for _ in range(50):
                        writer.write(b" ")
                        await writer.drain()
                        done, _pending = await asyncio.wait({answer}, timeout=0.2)
                        if done:
                            break
                # While it still dripped: after the drip, the pause alone refuses it too.
                assert answer.done(), "refused while the body still came"
                refused = answer.result()
            assert_refused(refused, 408, None, "request body stalled: ")
            assert "under 10 bytes/s on average past its first 1 s" in refused.json["error"]
            assert engine.ran_tags == []

    asyncio.run(scenario())


def test_an_answer_after_100_continue_is_sent_whatever_it_is(small_model: Path) -> None:
    """After "100 Continue" (this front end writes it itself), a failure's answer is
    sent: without resetting the writer's count as aiohttp's own handler does, aiohttp
    raised on the 500 and closed the connection with no answer."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        engine.fail_when = lambda _batch: True
        body = json.dumps(infer_body(rows(1))).encode()
        async with http_serving(engine, config(small_model)) as (s, _):
            assert s.server.http_port is not None
            async with connection(s.server.http_port) as (reader, writer):
                writer.write(request_head(INFER, len(body), {"Expect": "100-continue"}))
                status, _ = await read_head(reader)
                assert status == 100
                writer.write(body)
                failed = await read_answer(reader)
            assert_refused(failed, 500, "ENGINE_FAILURE", "")

    asyncio.run(scenario())


def test_nan_and_infinities_in_a_json_answer_are_written_as_python_and_tritonclient_read_them(
    tmp_path: Path,
) -> None:
    """An output holding NaN and infinities, asked for as JSON: `NaN`, `Infinity` and
    `-Infinity` (JSON has no such number; Python's json and tritonclient's rapidjson
    read them), the same values as binary data bit for bit (as the README says)."""
    path = _identity_model(tmp_path / "f32.onnx", {"x": TensorProto.FLOAT})
    x = np.array([[np.nan, np.inf, -np.inf]], np.float32)

    async def scenario() -> None:
        async with http_serving(_engine(path), config(path)) as (_, http):
            header = {"inputs": [binary_input("x", x)], "outputs": [{"name": "o_x"}]}
            answer = await post(http, "/v2/models/f32/infer", **with_binary(header, x))
            assert answer.status == 200, answer.body
            assert b'"data": [NaN, Infinity, -Infinity]' in answer.body
            values = np.asarray(only_output(answer)["data"], np.float32)
            assert values.tobytes() == x.ravel().tobytes()

    asyncio.run(scenario())


def test_a_fault_found_once_the_body_is_read_keeps_the_connection(small_model: Path) -> None:
    """A body read whole and then refused (a gzip stream cut short: 400) leaves nothing
    unread: its connection stays open for the next request, as after a JSON fault; a
    refusal before the body is all read closes it (`Connection: close`)."""
    packed = gzip.compress(json.dumps(infer_body(rows(1))).encode())

    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            s,
            _,
        ):
            assert s.server.http_port is not None
            async with connection(s.server.http_port) as (reader, writer):
                cut = packed[: len(packed) // 2]
                writer.write(request_head(INFER, len(cut), {"Content-Encoding": "gzip"}) + cut)
                refused = await read_answer(reader)
                assert_refused(refused, 400, None, "request body ends before its gzip stream")
                assert refused.headers.get("Connection") != "close", refused.headers
                whole = json.dumps(infer_body(rows(1))).encode()
                writer.write(request_head(INFER, len(whole)) + whole)
                assert only_output(await read_answer(reader))["shape"] == [1, 10]

    asyncio.run(scenario())


# ---- BYTES: text tensors ----------------------------------------------------------------------


TEXT_INFER = "/v2/models/text/infer"


def serialized(values: Any) -> bytes:
    """BYTES's binary data: each element a 4-byte little-endian length and its UTF-8 (as
    tritonclient's serialize_byte_tensor writes it)."""
    return encode_strings("values", np.array(values, dtype=object))


def text_binary_input(name: str, array: npt.NDArray[Any]) -> dict[str, Any]:
    return {
        "name": name,
        "shape": list(array.shape),
        "datatype": "BYTES",
        "parameters": {"binary_data_size": len(serialized(array))},
    }


def with_text_binary(header: Mapping[str, Any], *data: bytes) -> dict[str, Any]:
    """post() options for a request of JSON `header` and `data` after it."""
    encoded = json.dumps(header).encode()
    return {"data": encoded + b"".join(data), "headers": {HEADER_LENGTH: str(len(encoded))}}


def _text_binary_header(size: int) -> dict[str, Any]:
    """The text model's request header with `size` bytes of the text input's binary data."""
    text_input = {**text_binary_input("text", TEXT), "parameters": {"binary_data_size": size}}
    return {"inputs": [text_input, json_input("numbers", NUMBERS, "BYTES")]}


def test_bytes_json_data_nested_or_flat_is_answered_as_json_strings(text_model: Path) -> None:
    """BYTES inputs as JSON strings, a 2-D one nested and flat (non-ASCII and empty
    strings among them): the BYTES output is answered as JSON strings, flat, beside the
    INT64 and FP32 outputs' numbers, the same as ModelInfer's."""
    flat_numbers = {
        "name": "numbers",
        "shape": [4, 2],
        "datatype": "BYTES",
        "data": NUMBERS.ravel().tolist(),
    }
    bodies = [
        {"inputs": [json_input("text", TEXT, "BYTES"), json_input("numbers", NUMBERS, "BYTES")]},
        {"inputs": [json_input("text", TEXT, "BYTES"), flat_numbers]},
    ]

    async def scenario() -> list[Answer]:
        async with http_serving(_engine(text_model), config(text_model)) as (_, http):
            return [await post(http, TEXT_INFER, body) for body in bodies]

    for answer in asyncio.run(scenario()):
        assert answer.status == 200, answer.body[:500]
        assert HEADER_LENGTH not in answer.headers
        outputs = {found["name"]: found for found in answer.json["outputs"]}
        assert [
            (found["name"], found["datatype"], found["shape"]) for found in outputs.values()
        ] == [tuple(output) for output in TEXT_OUTPUTS]
        assert outputs["tagged"]["data"] == TAGGED
        assert outputs["label"]["data"] == LABELS
        assert fp32_data(outputs["value"]).tobytes() == VALUES.ravel().tobytes()


def test_bytes_binary_data_in_and_out_is_length_prefixed(text_model: Path) -> None:
    """Triton's binary data for BYTES: an input's bytes each element's 4-byte length and
    its UTF-8 (binary_data_size their size), beside a JSON input; an output asked for as
    binary data answered so, its binary_data_size the serialized size, the others JSON
    (binary_data) or all binary, in order (binary_data_output)."""
    tagged = serialized(TAGGED)
    header = _text_binary_header(len(serialized(TEXT)))
    one_binary = header | {
        "outputs": [
            {"name": "tagged", "parameters": {"binary_data": True}},
            {"name": "label"},
        ]
    }
    all_binary = header | {"parameters": {"binary_data_output": True}}

    async def scenario() -> tuple[Answer, Answer]:
        async with http_serving(_engine(text_model), config(text_model)) as (_, http):
            one = await post(http, TEXT_INFER, **with_text_binary(one_binary, serialized(TEXT)))
            every = await post(http, TEXT_INFER, **with_text_binary(all_binary, serialized(TEXT)))
            return one, every

    one, every = asyncio.run(scenario())
    assert one.status == 200, one.body[:500]
    assert one.headers["Content-Type"] == "application/octet-stream"
    found_tagged, found_label = one.json["outputs"]
    assert (found_tagged["name"], found_tagged["datatype"], found_tagged["shape"]) == (
        "tagged",
        "BYTES",
        [4],
    )
    assert found_tagged["parameters"] == {"binary_data_size": len(tagged)}
    assert "data" not in found_tagged
    assert one.binary == tagged
    assert found_label["data"] == LABELS
    assert every.status == 200, every.body[:500]
    sizes = [found["parameters"]["binary_data_size"] for found in every.json["outputs"]]
    assert sizes == [len(tagged), 4 * 8, 4 * 2 * 4]
    assert every.binary == tagged + np.array(LABELS, "<i8").tobytes() + VALUES.tobytes()


def _text_body(text: Any, datatype: str = "BYTES") -> dict[str, Any]:
    """The text model's JSON request with `text` as the text input's `data`."""
    text_input = {"name": "text", "shape": [4], "datatype": datatype, "data": text}
    return {"inputs": [text_input, json_input("numbers", NUMBERS, "BYTES")]}


BYTES_REFUSALS: dict[str, Refusal] = {
    "a number among the strings": Refusal(
        _body(_text_body(["cat", 1, "a", "b"])),
        "input 'text' is BYTES and its 'data' holds an integer (element 1); expected a flat "
        "or nested list of strings",
    ),
    "a null among the strings, nested": Refusal(
        _body(_text_body([["cat", "a"], [None, "b"]])),
        "input 'text' is BYTES and its 'data' holds null (element 2)",
    ),
    "an object among the strings": Refusal(
        _body(_text_body(["cat", "a", "b", {}])),
        "input 'text' is BYTES and its 'data' holds an object (element 3)",
    ),
    "more strings than the shape's": Refusal(
        _body(_text_body(["a"] * 5)),
        "input 'text' has more than 4 values in 'data'; expected 4 (shape [4])",
    ),
    "fewer strings than the shape's": Refusal(
        _body(_text_body(["a"] * 3)),
        "input 'text' has 3 values in 'data'; expected 4 (shape [4])",
    ),
    "a string that is not a list": Refusal(
        _body(_text_body("cat")), "input 'text''s 'data' is a string; expected a list"
    ),
    "a lone surrogate among the strings": Refusal(
        _raw(_text_body(["cat", "a", LONE_SURROGATE, "b"])),
        "input 'text', element 2 of 'data', holds a lone surrogate",
    ),
    "numbers for a BYTES input": Refusal(
        _body(_text_body([1.0, 2.0, 3.0, 4.0], datatype="FP32")),
        "input 'text' has datatype FP32; expected BYTES, the model's input's",
    ),
    "binary data cut short in an element": Refusal(
        with_text_binary(_text_binary_header(20), serialized(TEXT)[:20]),
        "tensor 'text': element 1 says 18 bytes, 9 are left",
    ),
    "binary data not UTF-8": Refusal(
        with_text_binary(
            _text_binary_header(len(serialized(TEXT))),
            serialized(TEXT).replace(b"cat", b"c\xfft"),
        ),
        "tensor 'text': element 0 is not UTF-8 (invalid start byte at byte 1)",
    ),
}


def test_bytes_faults_are_refused_400_naming_them(text_model: Path) -> None:
    """One server, every fault of a BYTES input over HTTP: 400 INVALID_INPUT, in JSON,
    naming the input and the element, count or datatype at fault."""

    async def scenario() -> dict[str, str]:
        failures: dict[str, str] = {}
        async with http_serving(_engine(text_model), config(text_model)) as (_, http):
            for name, refusal in BYTES_REFUSALS.items():
                answer = await post(http, TEXT_INFER, **refusal.options)
                try:
                    assert_refused(answer, refusal.status, refusal.reason, refusal.fragment)
                except AssertionError as error:
                    failures[name] = f"{answer.status} {answer.body[:400]!r}: {error}"
        return failures

    assert asyncio.run(scenario()) == {}
