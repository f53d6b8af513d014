"""Models whose signature laneserve must check beyond dtypes and fixed sizes (outputs that
are not one row per input row, dimensions shared by name across inputs), and inputs a
model fails on."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from laneserve.client.tensors import decode_tensor, encode_tensor
from laneserve.server import Engine, EngineStartError, LaneServer, ServerConfig
from laneserve.server.config import ConfigError
from laneserve.server.engine import RUNTIME_MESSAGE_BYTES, translate_runtime_error
from laneserve.server.errors import ModelRunError
from laneserve.server.lifecycle import Lifecycle
from laneserve.v1 import inference_pb2 as pb
from laneserve.v1 import inference_pb2_grpc as pb_grpc
from tests.support import (
    RecordingEngine,
    ServerProcess,
    estimate_once,
    no_input_model,
    output,
    rich_status,
    save_model,
    serving,
    until,
)

pytestmark = pytest.mark.usefixtures("no_leaked_threads")


def _refused_at_start(path: Path) -> str:
    """What a server for the model at `path` says when it refuses to start."""
    with pytest.raises(EngineStartError) as refused:
        LaneServer(
            Engine(str(path), device="cpu", estimate=estimate_once),
            ServerConfig(model_path=str(path)),
        )
    return str(refused.value)


def test_a_model_whose_output_rows_do_not_follow_its_input_rows_is_refused(
    tmp_path: Path,
) -> None:
    """y = x[1:] has a dynamic first axis but N - 1 rows: answers are cut from a batch's
    outputs by row position, so serving it would hand callers each other's rows."""
    constants = [
        helper.make_node(
            "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], [v])
        )
        for name, v in (("start", 1), ("end", 2**62), ("axis", 0))
    ]
    graph = helper.make_graph(
        [*constants, helper.make_node("Slice", ["x", "start", "end", "axis"], ["y"])],
        "drops_a_row",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 2])],
    )
    path = save_model(tmp_path / "drops_a_row.onnx", graph)
    message = _refused_at_start(path)
    assert "output 'y' has shape [0, 2] for 1 input row(s)" in message
    assert "expected one output row per input row" in message


@pytest.mark.parametrize(
    ("tensor_type", "in_shape", "out_type", "expected"),
    [
        (
            TensorProto.BFLOAT16,
            ["N", 1],
            TensorProto.FLOAT,
            (
                "model input 's': ONNX Runtime type 'tensor(bfloat16)' is not supported; "
                "expected one of tensor(float), tensor(float16)"
            ),
        ),
        (
            TensorProto.FLOAT,
            ["N", 1],
            TensorProto.BFLOAT16,
            (
                "model output 'o': ONNX Runtime type 'tensor(bfloat16)' is not supported; "
                "expected one of tensor(float), tensor(float16)"
            ),
        ),
    ],
    ids=["bfloat16-input", "bfloat16-output"],
)
def test_a_model_laneserve_cannot_serve_is_refused_naming_the_input_or_output(
    tmp_path: Path, tensor_type: int, in_shape: list[Any], out_type: int, expected: str
) -> None:
    """The refusal said "model tensor 's' has unsupported type tensor(bfloat16)" (and
    "model 's' has shape [1, 4]"): neither whether an input or an output, nor which types
    are served."""
    cast = helper.make_node("Cast", ["s"], ["o"], to=out_type)
    graph = helper.make_graph(
        [cast],
        "unservable",
        [helper.make_tensor_value_info("s", tensor_type, in_shape)],
        [helper.make_tensor_value_info("o", out_type, in_shape)],
    )
    message = _refused_at_start(save_model(tmp_path / "unservable.onnx", graph))
    assert message.startswith(expected), message


def _fixed_rows_model(path: Path, rows: int) -> Path:
    """y = relu(x @ w + 1), x [rows, 4] -> y [rows, 3]: a model exported without a dynamic
    batch axis, its rows independent."""
    weights = np.arange(12, dtype=np.float32).reshape(4, 3) / 10 - 0.5
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["product"]),
            helper.make_node("Add", ["product", "one"], ["shifted"]),
            helper.make_node("Relu", ["shifted"], ["y"]),
        ],
        "fixed_rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 3])],
        initializer=[
            onnx.numpy_helper.from_array(weights, "w"),
            onnx.numpy_helper.from_array(np.ones(3, np.float32), "one"),
        ],
    )
    return save_model(path, graph)


@pytest.mark.parametrize("fixed", [1, 4])
def test_a_model_whose_first_axis_is_fixed_is_served_in_runs_of_that_many_rows(
    tmp_path: Path, fixed: int
) -> None:
    """x [1, 4] (torch.onnx.export without dynamic_axes) was refused: "laneserve batches
    along the first axis, which must be dynamic". Served now: requests of any row count,
    run in runs of exactly `fixed` rows (the batch cap is `fixed`, fewer rows are padded
    with copies of the last one), each answer what the model gives its rows."""
    path = _fixed_rows_model(tmp_path / "fixed.onnx", fixed)
    x = np.linspace(-2, 2, 7 * 4, dtype=np.float32).reshape(7, 4)
    reference = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = np.concatenate(
        [
            reference.run(None, {"x": np.repeat(x[row : row + 1], fixed, axis=0)})[0][:1]
            for row in range(7)
        ]
    )

    async def scenario() -> tuple[list[np.ndarray], int]:
        engine = Engine(str(path), device="cpu", estimate=estimate_once)
        async with serving(engine, ServerConfig(model_path=str(path))) as s:
            calls = [
                s.stub.Infer(
                    pb.InferRequest(inputs=[encode_tensor("x", x[start:stop])]), timeout=30
                )
                for start, stop in ((0, 1), (1, 3), (3, 7))
            ]
            answers = await asyncio.gather(*calls)
            stats = await s.stub.GetStats(pb.GetStatsRequest(), timeout=30)
            return [decode_tensor(answer.outputs[0]) for answer in answers], stats.batch_cap

    outputs, batch_cap = asyncio.run(scenario())
    assert batch_cap == fixed
    assert [output.shape for output in outputs] == [(1, 3), (2, 3), (4, 3)]
    np.testing.assert_array_equal(np.concatenate(outputs), expected)


def test_a_fixed_first_axis_models_arena_shrinks(tmp_path: Path) -> None:
    """The arena shrinks in a run of zero rows, which a fixed first axis refuses before
    the runtime reads the shrink asked for: under a budget nothing ever shrank, and the
    start warned arena_shrink_failed, saying it had shrunk anyway (a review). It shrinks
    in a run of the axis's rows. In a process of its own: a CPU budget is one per
    process."""
    path = _fixed_rows_model(tmp_path / "fixed.onnx", 4)
    script = (
        "import logging\n"
        "from laneserve.server import Engine\n"
        "from laneserve.server.memory import MemoryLimit\n"
        "events = []\n"
        "class Events(logging.Handler):\n"
        "    def emit(self, record):\n"
        "        events.append(getattr(record, 'event', None))\n"
        "logging.getLogger('laneserve').addHandler(Events(logging.WARNING))\n"
        f"engine = Engine({str(path)!r}, device='cpu', "
        "memory_limit=MemoryLimit(limit_bytes=64 * 1024 * 1024))\n"
        "engine.probe(4, repeats=1)\n"
        "engine.release_idle_memory()\n"
        "print(events)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "['fixed_batch_axis']", done.stderr


def test_fixed_first_axes_that_are_not_rows_are_refused(tmp_path: Path) -> None:
    """A fixed first axis may be a sequence or a set, not rows: answers cut from it by row
    would depend on the rows run beside them (padding included). Refused at start, naming
    what does not fit: inputs fixed at different sizes, an output fixed at another size,
    an axis whose rows mix (softmax over it)."""
    apart = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "apart",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    message = _refused_at_start(save_model(tmp_path / "apart.onnx", apart))
    assert message.startswith(
        "model inputs' first axes are fixed at different sizes {'a': 1, 'b': 2}"
    ), message
    pooled = helper.make_graph(
        [helper.make_node("ReduceMean", ["x"], ["y"], axes=[0], keepdims=1)],
        "pooled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
    )
    message = _refused_at_start(save_model(tmp_path / "pooled.onnx", pooled))
    assert message.startswith(
        "model output 'y' has shape [1, 3], its first axis fixed at 1 where the inputs' is "
        "fixed at 4 (input 'x')"
    ), message
    mixing = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=0)],
        "mixing",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
    )
    message = _refused_at_start(save_model(tmp_path / "mixing.onnx", mixing))
    assert "model output 'y': row 0 of 3 along the inputs' fixed first axis changed" in message
    assert "so that axis (of input 'x') is not one of independent rows" in message
    assert "expected a batch axis whose rows do not affect each other's outputs" in message
    # A sequence whose later rows follow the earlier ones (an LSTM's time axis first, as
    # torch exports it): its first row is its own, and a check of it alone served it.
    axis = onnx.numpy_helper.from_array(np.array(0, np.int64), "axis")
    running = helper.make_graph(
        [helper.make_node("CumSum", ["x", "axis"], ["y"])],
        "running",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
        initializer=[axis],
    )
    path = save_model(tmp_path / "running.onnx", running)
    message = _refused_at_start(path)
    assert "model output 'y': row 1 of 4 along the inputs' fixed first axis changed" in message
    assert message.endswith("export the model with a dynamic first axis of rows")
    # Whatever the cap: a lone row runs beside the padding's copies of it, and a cap of
    # 1 served it, each answer that of its row as if the sequence were that row alone.
    with pytest.raises(EngineStartError, match=r"row 1 of 4 along the inputs' fixed first axis"):
        Engine(str(path), device="cpu", estimate=estimate_once).probe(1, repeats=1)


def test_an_input_fixed_at_one_row_beside_dynamic_ones_is_named_in_the_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cfg [1, 3] beside rows x [N, 3] lowers the batch cap to 1; the warning said the
    model "fixes its inputs' first axis at 1", naming neither, and told to "export it
    with a dynamic first axis", which x has (an evaluation). It names cfg, says x's is
    dynamic, and what to export."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "cfg"], ["y"])],
        "dyn_and_fixed",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("cfg", TensorProto.FLOAT, [1, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
    )
    path = save_model(tmp_path / "dyn_and_fixed.onnx", graph)
    caplog.set_level(logging.WARNING)
    probe = Engine(str(path), device="cpu", estimate=estimate_once).probe(128, repeats=1)
    assert probe.batch_cap == 1
    (warning,) = caplog.records
    assert getattr(warning, "event", None) == "fixed_batch_axis"
    assert getattr(warning, "fields", {})["fixed_inputs"] == ["cfg"]
    message = warning.getMessage()
    assert (
        "fixes the first axis of input 'cfg' at 1 row(s) (that of input 'x' is dynamic)" in message
    ), message
    assert "(the batch cap asked, 128, lowered to 1)" in message
    assert "export input 'cfg' with a dynamic first axis too" in message
    assert "export it with a dynamic first axis" not in message


def _fixed_model_of(path: Path, node: onnx.NodeProto, rows: int | str = 4) -> Path:
    """`node` from x [rows, 7] to y [rows, 7], as its own model."""
    graph = helper.make_graph(
        [node],
        "one_node",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 7])],
    )
    return save_model(path, graph)


def test_rows_that_round_apart_by_position_or_vary_by_run_are_not_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A review: a sum along each row of x [4, 7] rounds an ulp apart at row 2 batched
    and alone (the kernel's position in the batch): compared exactly, the start was
    refused though the rows are independent. And a random op (RandomUniformLike) was
    refused at a fixed axis and warned rows_mix at a dynamic one, blaming the batch for
    its randomness: two runs of one row differ, so nothing is checked (rows_unchecked)."""
    axes = onnx.numpy_helper.from_array(np.array([1], np.int64), "axes")
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
        "summed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        initializer=[axes],
    )
    summed = save_model(tmp_path / "summed.onnx", graph)
    caplog.set_level(logging.WARNING)
    Engine(str(summed), device="cpu", estimate=estimate_once).probe(4, repeats=1)
    assert [getattr(record, "event", None) for record in caplog.records] == ["fixed_batch_axis"]
    for rows in (4, "N"):
        caplog.clear()
        noisy = _fixed_model_of(
            tmp_path / f"noisy_{rows}.onnx",
            helper.make_node("RandomUniformLike", ["x"], ["y"]),
            rows,
        )
        Engine(str(noisy), device="cpu", estimate=estimate_once).probe(4, repeats=1)
        events = [getattr(record, "event", None) for record in caplog.records]
        assert "rows_unchecked" in events, events
        assert "rows_mix" not in events, events


def _batch_quantized_model(path: Path) -> Path:
    """y = dequantize(quantize(x)) with one scale for the whole batch (DynamicQuantizeLinear,
    which onnxruntime's quantize_dynamic puts before every MatMul): x [N, 4] -> y [N, 4]."""
    graph = helper.make_graph(
        [
            helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "scale", "zero"]),
            helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"]),
        ],
        "batch_quantized",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    return save_model(path, graph)


def test_a_model_whose_rows_mix_in_a_batch_is_served_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A dynamically quantized model (one scale for the whole batch) gave a caller batched
    with larger values other answers than its own run, silently (a review). Its start now
    warns (rows_mix), unless every batch holds one row (max_batch_size 1)."""
    path = _batch_quantized_model(tmp_path / "quantized.onnx")

    def warnings(max_batch_size: int) -> list[str]:
        caplog.clear()
        engine = Engine(str(path), device="cpu", estimate=estimate_once)
        engine.probe(max_batch_size, repeats=1)
        return [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]

    (warning,) = warnings(8)
    assert warning.startswith(
        "model output 'y': row 0 of 4 random rows batched together differs from its run "
        "alone beyond rounding"
    ), warning
    assert "a statistic of the batch (DynamicQuantizeLinear" in warning
    assert "--max-batch-size 1 gives each row its own, as a run of that row alone does" in warning
    assert warnings(1) == []


def test_a_time_major_models_rows_mix_warning_says_batching_rows_cannot_serve_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """CumSum over time of x [T, N, 4] (time-major: its first axis is no batch axis) warned
    rows_mix blaming DynamicQuantizeLinear and advising --max-batch-size 1, which "runs
    every request's rows alone": it splits every request into runs of one row, each a
    sequence of one step, wrong for every request of more than one row (an evaluation).
    The warning names that cause too, and says to export the model batch-first."""
    axis = onnx.numpy_helper.from_array(np.array(0, np.int64), "axis")
    graph = helper.make_graph(
        [helper.make_node("CumSum", ["x", "axis"], ["y"])],
        "time_major",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", "N", 4])],
        initializer=[axis],
    )
    path = save_model(tmp_path / "time_major.onnx", graph)
    caplog.set_level(logging.WARNING)
    Engine(str(path), device="cpu", estimate=estimate_once).probe(8, repeats=1)
    (warning,) = [record for record in caplog.records if record.levelname == "WARNING"]
    assert getattr(warning, "event", None) == "rows_mix"
    message = warning.getMessage()
    assert "its first axis is not one of independent rows (a sequence: time-major" in message
    assert "such a model cannot be served by batching rows at all (export it batch-first)" in (
        message
    )
    assert "--max-batch-size 1 splits every request into runs of one row" in message
    assert "runs every request's rows alone" not in message


def test_a_model_input_that_declares_no_shape_is_refused_saying_so(tmp_path: Path) -> None:
    """It was refused as "has shape []", which reads as a scalar input: ONNX Runtime gives
    [] for a shape never declared too (exported models may lack one)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["s"], ["o"])],
        "shapeless",
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, ["N", 4])],
    )
    # Unchecked: onnx's checker refuses a graph input without a shape, ONNX Runtime loads it.
    save_model(tmp_path / "shapeless.onnx", graph, check=False)
    message = _refused_at_start(tmp_path / "shapeless.onnx")
    assert message.startswith(
        "model input 's' declares no shape (or a scalar one, which ONNX Runtime "
        "reads alike): laneserve batches along the first axis; expected a shape whose "
        "first axis is dynamic (a symbolic or -1 dimension), e.g. ['N', ...]"
    ), message


@pytest.mark.parametrize("inferable", [True, False], ids=["output-inferred", "output-unknown"])
def test_a_model_with_no_inputs_is_refused_at_start_saying_so(
    tmp_path: Path, inferable: bool
) -> None:
    """No input, no rows to batch along. With an output shape ONNX Runtime cannot infer
    the start-up probe counted the rows of no input: StopIteration, which hung `laneserve
    serve` for good (asyncio cannot put it into the load's future); with one it infers
    ([1]) the refusal blamed the output's fixed first axis."""
    message = _refused_at_start(no_input_model(tmp_path / "no_input.onnx", inferable=inferable))
    assert message == (
        f"model {str(tmp_path / 'no_input.onnx')!r} has no inputs: laneserve batches "
        "requests along the inputs' first axis; expected at least one input whose first "
        "axis is the batch (rows) axis, e.g. ['N', ...]"
    )


def test_inputs_sharing_a_named_dimension_must_agree_on_its_size(tmp_path: Path) -> None:
    """Add(a[N, K], b[N, K]): a request with K = 3 for a and 4 for b is the caller's error,
    answered INVALID_ARGUMENT naming K; it never reaches the session (where it failed the
    whole batch with INTERNAL). Agreeing sizes are served."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["sum"])],
        "add",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", "K"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", "K"]),
        ],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["N", "K"])],
    )
    path = save_model(tmp_path / "add.onnx", graph)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)

    async def scenario() -> None:
        async with serving(
            Engine(str(path), device="cpu", estimate=estimate_once),
            ServerConfig(model_path=str(path)),
        ) as s:
            mismatched = pb.InferRequest(
                inputs=[encode_tensor("a", a), encode_tensor("b", np.ones((2, 4), np.float32))]
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.Infer(mismatched, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rich_status(refused.value)[0] == "INVALID_INPUT"
            assert (refused.value.details() or "") == (
                "inputs 'a' and 'b' must agree on the model's dimension 'K': axis 1 of 'a' "
                "is 3, axis 1 of 'b' is 4"
            )
            matched = pb.InferRequest(inputs=[encode_tensor("a", a), encode_tensor("b", a)])
            answer = await s.stub.Infer(matched, timeout=10)
            np.testing.assert_array_equal(output(answer), a + a)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            assert stats.failed_batches == 0

    asyncio.run(scenario())


def _lookup_model(tmp_path: Path) -> Path:
    """value[N, 1] = table[input[N, 1]], a table of 10 (its values are their indices):
    Gather with an index past the table fails in the runtime."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [10], [float(i) for i in range(10)])
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input"], ["value"], axis=0)],
        "lookup",
        [helper.make_tensor_value_info("input", TensorProto.INT64, ["N", 1])],
        [helper.make_tensor_value_info("value", TensorProto.FLOAT, ["N", 1])],
        initializer=[table],
    )
    return save_model(tmp_path / "lookup.onnx", graph)


def _lookup(*indices: int) -> pb.InferRequest:
    """A request for the table's values at `indices`, one row each."""
    index = np.array(indices, dtype=np.int64).reshape(-1, 1)
    return pb.InferRequest(inputs=[encode_tensor("input", index)])


async def _answers_batched(
    path: Path, held: pb.InferRequest, *requests: pb.InferRequest
) -> list[Any]:
    """The answers (or errors) of `held`, run first alone, and of `requests`, queued
    while it runs and then batched together."""
    engine = RecordingEngine(str(path), device="cpu")
    async with serving(engine, ServerConfig(model_path=str(path))) as s:
        engine.hold()
        first = asyncio.ensure_future(s.stub.Infer(held, timeout=10))
        await asyncio.to_thread(engine.entered.acquire)
        calls = [asyncio.ensure_future(s.stub.Infer(request, timeout=10)) for request in requests]
        thread = s.server._thread
        assert thread is not None
        rows = sum(request.inputs[0].shape[0] for request in requests)
        await until(lambda: sum(depth.queued_rows for depth in thread.depths()) == rows)
        engine.release()
        return await asyncio.gather(first, *calls, return_exceptions=True)


def test_a_row_the_model_fails_on_fails_its_request_only(tmp_path: Path) -> None:
    """Gather with an index past the table fails in the runtime. The batch that holds two
    such rows (one in each half) is run again in halves until each failing row is alone:
    their requests are answered ENGINE_FAILURE with the runtime's words, the requests
    batched with them are answered (they all failed with them before)."""
    path = _lookup_model(tmp_path)

    async def scenario() -> None:
        engine = RecordingEngine(str(path), device="cpu")
        async with serving(engine, ServerConfig(model_path=str(path))) as s:
            engine.hold()
            first = asyncio.ensure_future(s.stub.Infer(_lookup(0), timeout=10))
            await asyncio.to_thread(engine.entered.acquire)
            calls = [
                asyncio.ensure_future(s.stub.Infer(request, timeout=10))
                for request in (_lookup(1, 2), _lookup(99), _lookup(3), _lookup(4), _lookup(98))
            ]
            thread = s.server._thread
            assert thread is not None
            await until(lambda: sum(depth.queued_rows for depth in thread.depths()) == 6)
            engine.release()
            answers = await asyncio.gather(first, *calls, return_exceptions=True)
            stats = await s.stub.GetStats(pb.GetStatsRequest())
        ok_first, ok_pair, bad, ok_three, ok_four, bad_too = answers
        for ok, expected in ((ok_pair, [[1.0], [2.0]]), (ok_three, [[3.0]]), (ok_four, [[4.0]])):
            assert isinstance(ok, pb.InferResponse)
            np.testing.assert_array_equal(output(ok), expected)
        assert isinstance(ok_first, pb.InferResponse)
        for failed in (bad, bad_too):  # in both halves of the batch: each found alone
            assert isinstance(failed, grpc.aio.AioRpcError)
            assert failed.code() == grpc.StatusCode.INTERNAL
            assert rich_status(failed)[0] == "ENGINE_FAILURE"
            assert "the model failed on a row of this request" in (failed.details() or "")
        answered = {lane.name: dict(lane.answered) for lane in stats.lanes}
        assert answered["standard"] == {"OK": 4, "ENGINE_FAILURE": 2}
        assert stats.rows_run == 7 - 2, "the two failed rows did not run to an answer"

    asyncio.run(scenario())


def test_a_row_that_fails_alone_is_named_by_its_index_in_its_request(tmp_path: Path) -> None:
    """Rows 1 and 2 of two requests of several rows fail in the runtime, batched with
    good requests. The answer said "the model failed on a row of this request: the model
    failed on this batch: ..." (the DEVICE_MEMORY answer names its row): neither which
    row, nor that it ran alone. It names the row and gives the runtime's words."""
    answers = asyncio.run(
        _answers_batched(
            _lookup_model(tmp_path),
            _lookup(0),
            _lookup(1, 2),
            _lookup(3, 99, 4),
            _lookup(5),
            _lookup(6, 7, 98),
        )
    )
    ok_first, ok_pair, bad, ok_five, bad_too = answers
    for ok, expected in ((ok_first, [[0.0]]), (ok_pair, [[1.0], [2.0]]), (ok_five, [[5.0]])):
        assert isinstance(ok, pb.InferResponse), ok
        np.testing.assert_array_equal(output(ok), expected)
    for failed, row, index in ((bad, 1, 99), (bad_too, 2, 98)):
        assert isinstance(failed, grpc.aio.AioRpcError)
        # The row for programs too, in ErrorInfo.metadata (a client read the words).
        assert rich_status(failed) == ("ENGINE_FAILURE", {"metadata": {"row": str(row)}})
        details = failed.details() or ""
        assert details.startswith(
            f"the model failed on a row of this request (row {row}, run alone): "
        ), details
        assert f"idx={index}" in details, details  # the runtime's words, for that row
        assert "on this batch" not in details


def _padded_model(tmp_path: Path) -> Path:
    """ "looked" [N, 4] (a row of a table, by the first input column) and "mask"
    [N, longest length in the batch] (the second column's lengths, padded): a model whose
    output width depends on which rows are batched together."""
    nodes = [
        helper.make_node("Slice", ["input", "zero", "one", "one"], ["column0"]),
        helper.make_node("Squeeze", ["column0", "one"], ["index_f"]),
        helper.make_node("Cast", ["index_f"], ["index"], to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "index"], ["looked"], axis=0),
        helper.make_node("Slice", ["input", "one", "two", "one"], ["length"]),
        helper.make_node("ReduceMax", ["length"], ["longest"], keepdims=0),
        helper.make_node("Range", ["zero_f", "longest", "one_f"], ["steps"]),
        helper.make_node("Unsqueeze", ["steps", "zero"], ["steps_row"]),
        helper.make_node("Less", ["steps_row", "length"], ["mask_bool"]),
        helper.make_node("Cast", ["mask_bool"], ["mask"], to=TensorProto.FLOAT),
    ]
    constants: dict[str, np.ndarray[Any, Any]] = {
        "table": np.arange(40, dtype=np.float32).reshape(10, 4),
        "zero": np.array([0], np.int64),
        "one": np.array([1], np.int64),
        "two": np.array([2], np.int64),
        "zero_f": np.array(0.0, np.float32),
        "one_f": np.array(1.0, np.float32),
    }
    graph = helper.make_graph(
        nodes,
        "padded",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 2])],
        [
            helper.make_tensor_value_info("looked", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", "L"]),
        ],
        initializer=[
            onnx.numpy_helper.from_array(value, name) for name, value in constants.items()
        ],
    )
    return save_model(tmp_path / "padded.onnx", graph)


def test_a_model_with_a_later_axis_named_as_the_batch_axis_is_refused(tmp_path: Path) -> None:
    """z = x xT is [N, N]: batched with another request, a 1-row request's answer was
    [1, 2], one value of it computed from the other caller's input."""
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["xt"]),
            helper.make_node("MatMul", ["x", "xt"], ["z"]),
        ],
        "gram",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", "N"])],
    )
    path = save_model(tmp_path / "gram.onnx", graph)
    with pytest.raises(EngineStartError) as caught:
        Engine(str(path), device="cpu", estimate=estimate_once)
    assert str(caught.value) == (
        "model output 'z' has shape ['N', 'N']: its axis 1 is 'N', a first axis, along which "
        "laneserve batches requests, so a request's answer would depend on the requests "
        "batched with it; expected sizes after the first axis that do not follow it"
    )


@pytest.mark.parametrize("k_rows", ["M", "N"])
def test_an_output_sized_by_the_rows_after_its_first_axis_is_refused(
    tmp_path: Path, k_rows: str
) -> None:
    """s = q kT is [N, rows of k], and k has the request's rows too: batched with another
    request, a 1-row request's answer was [1, 2], one value of it computed from the
    other caller's k. Its later axis has a name of its own ("P"), so only running the
    model shows it."""
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["k"], ["kt"]),
            helper.make_node("MatMul", ["q", "kt"], ["s"]),
        ],
        "attention_scores",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, [k_rows, 4]),
        ],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, ["N", "P"])],
    )
    message = _refused_at_start(save_model(tmp_path / "scores.onnx", graph))
    assert (
        "model output 's' has shape [1, 1] for 1 input row and [2, 2] for 2: its axes "
        "after the first follow the row count" in message
    )
    assert "expected sizes after the first axis that do not depend on the rows" in message


def test_inputs_with_first_axes_named_apart_and_outputs_of_their_own_rows_are_served(
    tmp_path: Path,
) -> None:
    """a [N, 4] and b [M, 4] (exporters name each input's dynamic axis apart), each with an
    output of its own rows: nothing mixes, and the check above must not refuse it."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["a", "a"], ["doubled"]),
            helper.make_node("Neg", ["b"], ["negated"]),
        ],
        "apart",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["M", 4]),
        ],
        [
            helper.make_tensor_value_info("doubled", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("negated", TensorProto.FLOAT, ["M", 4]),
        ],
    )
    path = save_model(tmp_path / "apart.onnx", graph)
    a = np.arange(8, dtype=np.float32).reshape(2, 4)

    async def scenario() -> pb.InferResponse:
        engine = Engine(str(path), device="cpu", estimate=estimate_once)
        async with serving(engine, ServerConfig(model_path=str(path))) as s:
            inputs = [encode_tensor("a", a), encode_tensor("b", a + 1)]
            return await s.stub.Infer(pb.InferRequest(inputs=inputs))

    answer = asyncio.run(scenario())
    outputs = {tensor.name: decode_tensor(tensor) for tensor in answer.outputs}
    np.testing.assert_array_equal(outputs["doubled"], 2 * a)
    np.testing.assert_array_equal(outputs["negated"], -(a + 1))


def test_a_request_over_the_cap_whose_chunks_do_not_join_fails_alone(tmp_path: Path) -> None:
    """300 rows under a batch cap of 128 run in three chunks, whose "mask" widths differ
    (5, 5 and 1): joining them raised a ValueError on the engine thread that stopped the
    scheduler, and the server with it (every later call refused DRAINING). The request
    fails alone, naming the outputs' shapes, and the server goes on."""
    path = _padded_model(tmp_path)
    x = np.array([[index % 10, 5 if index < 256 else 1] for index in range(300)], np.float32)

    async def scenario() -> None:
        async with serving(
            RecordingEngine(str(path), device="cpu"), ServerConfig(model_path=str(path))
        ) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.stub.Infer(pb.InferRequest(inputs=[encode_tensor("input", x)]), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            details = caught.value.details() or ""
            assert "the request's 300 rows ran in 3 batches (over the batch cap)" in details
            assert "'mask': [[128, 5], [128, 5], [44, 1]]" in details
            after = await s.stub.Infer(
                pb.InferRequest(inputs=[encode_tensor("input", x[:1])]), timeout=30
            )
            assert after.outputs[0].shape == [1, 4]
            assert s.server.state is Lifecycle.SERVING

    asyncio.run(scenario())


def test_outputs_whose_width_depends_on_the_batch_fail_clearly_when_split(
    tmp_path: Path,
) -> None:
    """ "mask" is [N, longest length in the batch]: a split batch's parts have different
    widths. Storing them together raised a ValueError outside the runtime, and every
    request of the batch got INTERNAL "batch failed: ValueError(...)", the rows that ran
    too. Now a part whose shape differs fails with a message naming the output."""
    path = _padded_model(tmp_path)

    def item(index: float, length: float) -> pb.InferRequest:
        x = np.array([[index, length]], dtype=np.float32)
        return pb.InferRequest(inputs=[encode_tensor("input", x)])

    async def scenario() -> None:
        engine = RecordingEngine(str(path), device="cpu")
        async with serving(engine, ServerConfig(model_path=str(path))) as s:
            engine.hold()
            first = asyncio.ensure_future(s.stub.Infer(item(0, 1), timeout=10))
            await asyncio.to_thread(engine.entered.acquire)
            calls = [
                asyncio.ensure_future(s.stub.Infer(request, timeout=10))
                for request in (item(1, 5), item(99, 3), item(2, 3), item(3, 3))
            ]
            thread = s.server._thread
            assert thread is not None
            await until(lambda: sum(depth.queued_rows for depth in thread.depths()) == 4)
            engine.release()
            answers = await asyncio.gather(first, *calls, return_exceptions=True)
        assert isinstance(answers[0], pb.InferResponse)
        bad = answers[2]
        assert isinstance(bad, grpc.aio.AioRpcError)
        assert "the model failed on a row of this request" in (bad.details() or "")
        for answer in (answers[1], answers[3], answers[4]):
            if isinstance(answer, grpc.aio.AioRpcError):
                assert answer.code() == grpc.StatusCode.INTERNAL
                details = answer.details() or ""
                assert "model output 'mask' has shape" in details, details
                assert "depends on which rows are batched together" in details
        assert any(isinstance(answer, pb.InferResponse) for answer in answers[1:])

    asyncio.run(scenario())


def _conv_model(path: Path) -> Path:
    """y = a 3x3 convolution (no padding) of x [N, 1, H, W]: H and W must be at least 3."""
    weight = onnx.numpy_helper.from_array(np.ones((1, 1, 3, 3), np.float32), "weight")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "weight"], ["y"])],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, "H2", "W2"])],
        initializer=[weight],
    )
    return save_model(path, graph)


def test_a_model_whose_dynamic_sizes_cannot_be_1_is_served_with_probe_shapes(
    tmp_path: Path,
) -> None:
    """The start-up probe ran zero-filled inputs with every dynamic size at 1, which a
    3x3 convolution refuses: the model could not be served at all, and the error did not
    say why. It now names the shapes it ran and the setting; with probe_shapes it serves
    images of any size the model takes."""
    path = _conv_model(tmp_path / "conv.onnx")
    message = _refused_at_start(path)
    assert "zero-filled inputs of shapes {'x': [1, 1, 1, 1]}" in message
    assert "server.probe_shapes (--probe-shape NAME=D1,D2,...)" in message
    with pytest.raises(ConfigError, match="expected one that fits the model's") as refused:
        Engine(str(path), device="cpu", probe_shapes={"x": (3, 8, 8)}, estimate=estimate_once)
    assert refused.value.key == "server.probe_shapes"  # `serve` names --probe-shape by it

    async def scenario() -> None:
        config = ServerConfig(model_path=str(path), probe_shapes={"x": (1, 8, 8)})
        async with serving(
            Engine(
                str(path), device="cpu", probe_shapes=config.probe_shapes, estimate=estimate_once
            ),
            config,
        ) as s:
            for size in (5, 16):
                x = np.arange(2 * size * size, dtype=np.float32).reshape(2, 1, size, size)
                answer = await s.stub.Infer(pb.InferRequest(inputs=[encode_tensor("x", x)]))
                # Each output pixel sums the 3x3 window below-right of it.
                windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))
                np.testing.assert_allclose(output(answer), windows.sum(axis=(-1, -2)), rtol=1e-6)

    asyncio.run(scenario())


def _loop_model(path: Path) -> Path:
    """y[N, 4] = x[N, 4], after max(n) products of 256x256 matrices (n[N, 1]): the run
    takes as long as the input says."""
    w = onnx.numpy_helper.from_array((np.eye(256) * 0.5).astype(np.float32), "w")
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["s_in", "w"], ["m"]),
            helper.make_node("Add", ["m", "w"], ["s_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [256, 256]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [256, 256]),
        ],
    )
    true = helper.make_tensor("t", TensorProto.BOOL, [], [True])
    nodes = [
        helper.make_node("ReduceMax", ["n"], ["n_max"], keepdims=0),
        helper.make_node("Constant", [], ["true"], value=true),
        helper.make_node("Loop", ["n_max", "true", "w"], ["s_final"], body=body),
        helper.make_node("ReduceSum", ["s_final"], ["total"], keepdims=0),
        helper.make_node("Mul", ["total", "zero"], ["nothing"]),
        helper.make_node("Add", ["x", "nothing"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "loop",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("n", TensorProto.INT64, ["N", 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[w, onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero")],
    )
    return save_model(path, graph)


def test_a_drain_ends_a_run_still_in_the_runtime_and_exits_0(tmp_path: Path) -> None:
    """A batch running in ONNX Runtime when the drain's grace ran out kept running, and
    the process aborted on exit (SIGABRT, status -6): the runtime was torn down under
    it. The run is now ended (RunOptions.terminate) and the process exits 0."""
    path = _loop_model(tmp_path / "loop.onnx")
    server = ServerProcess(
        ["--model", str(path), "--port", "0", "--drain-grace-s", "0.1", "--intra-op-threads", "1"]
    )
    try:
        port = server.port()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            endless = pb.InferRequest(
                inputs=[
                    encode_tensor("x", np.ones((1, 4), np.float32)),
                    encode_tensor("n", np.full((1, 1), 10**8, np.int64)),
                ]
            )
            call = stub.Infer.future(endless, timeout=120)

            def running() -> bool:  # admitted, and no longer queued: in the session
                stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
                return any(lane.admitted == 1 and lane.depth_rows == 0 for lane in stats.lanes)

            polls = 0
            while not running():  # a state the server reaches; bounded, not timed
                polls += 1
                assert polls < 10_000, "the request never reached the session"
            server.process.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as caught:
                call.result()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "it may have run" in (caught.value.details() or "")
        assert server.process.wait(timeout=60) == 0
    finally:
        server.close()


def _optional_input_model(path: Path, first: int | str) -> Path:
    """y = x * scale, x [N, 4], scale [`first`, 4] a graph input with an initializer as its
    default: ONNX Runtime lists scale among the overridable initializers, not the
    inputs, and a run may pass another value for it."""
    scale = onnx.numpy_helper.from_array(np.array([[1, 2, 3, 4]], np.float32), "scale")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "scale"], ["y"])],
        "optional_input",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, [first, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[scale],
    )
    return save_model(path, graph)


@pytest.mark.parametrize("first", [1, "M"])
def test_an_overridable_initializer_is_named_at_start_and_in_the_refusal_of_a_request_sending_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, first: int | str
) -> None:
    """A model's optional input (an initializer also listed as a graph input) was served
    silently dropped: GetModel listed x alone, nothing was logged, and a request sending
    scale was told "'scale' is not an input of the model" (an evaluation). The start says
    which initializers callers could override and that laneserve runs them at their
    defaults; a request that sends one is told so, with or without the model's inputs."""
    path = _optional_input_model(tmp_path / "optional.onnx", first)
    x = np.ones((2, 4), np.float32)
    scale = np.full((1, 4), 10, np.float32)
    said = (
        "'scale' is an initializer the model lets callers override; laneserve runs it at its "
        "default and takes no input of that name"
    )

    async def scenario() -> None:
        caplog.set_level(logging.INFO)
        engine = Engine(str(path), device="cpu", estimate=estimate_once)
        (logged,) = [
            record
            for record in caplog.records
            if getattr(record, "event", None) == "overridable_initializers"
        ]
        assert logged.levelname == "INFO"
        assert getattr(logged, "fields", {})["initializers"] == ["scale"]
        assert "laneserve always runs them at their defaults" in logged.getMessage()
        async with serving(engine, ServerConfig(model_path=str(path))) as s:
            model = await s.stub.GetModel(pb.GetModelRequest(), timeout=30)
            assert [spec.name for spec in model.inputs] == ["x"]
            answer = await s.stub.Infer(pb.InferRequest(inputs=[encode_tensor("x", x)]), timeout=30)
            np.testing.assert_array_equal(output(answer), x * [1, 2, 3, 4])
            for sent in ({"x": x, "scale": scale}, {"scale": scale}):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await s.stub.Infer(
                        pb.InferRequest(inputs=[encode_tensor(n, a) for n, a in sent.items()]),
                        timeout=30,
                    )
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = refused.value.details() or ""
                assert said in details, details
                # Two inputs are one too many (`codec.too_many_inputs`); scale alone is an
                # unknown one (`codec.decode_inputs`): both say what scale is.
                expected = "expected the model's inputs ['x']"
                assert details.endswith(f"{expected}, each once" if "x" in sent else expected)

    asyncio.run(scenario())


def test_the_runtimes_message_keeps_its_start_and_loses_its_trailing_newline(
    tmp_path: Path,
) -> None:
    """x [N, S, 2] + pos[:S] of a table of 64 positions fails at S = 70 in the runtime. The
    answer quoted its last 300 characters, "...while running Add node ... 64 by 70\\n":
    without ONNX Runtime's code and category, with its newline (an evaluation). It
    quotes the message whole from its start, its trailing whitespace stripped."""
    constants = [
        onnx.numpy_helper.from_array(np.zeros((64, 2), np.float32), "pos"),
        onnx.numpy_helper.from_array(np.array([1], np.int64), "one"),
        onnx.numpy_helper.from_array(np.array([0], np.int64), "zero"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Gather", ["shape", "one"], ["length"]),
            helper.make_node("Slice", ["pos", "zero", "length", "zero"], ["positions"]),
            helper.make_node("Add", ["x", "positions"], ["y"]),
        ],
        "positions",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "S", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "S", 2])],
        initializer=constants,
    )
    path = save_model(tmp_path / "positions.onnx", graph)

    async def scenario() -> str:
        engine = Engine(str(path), device="cpu", estimate=estimate_once)
        async with serving(engine, ServerConfig(model_path=str(path))) as s:
            x = np.zeros((1, 70, 2), np.float32)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await s.stub.Infer(pb.InferRequest(inputs=[encode_tensor("x", x)]), timeout=30)
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            return failed.value.details() or ""

    details = asyncio.run(scenario())
    assert details.startswith(
        "the model failed on a row of this request (row 0, run alone): [ONNXRuntimeError] : "
    ), details
    assert "Non-zero status code returned while running Add node" in details
    assert details.endswith("64 by 70"), details
    assert "message cut" not in details


def test_a_long_runtime_message_is_cut_in_its_middle_saying_so() -> None:
    """Past RUNTIME_MESSAGE_BYTES the runtime's words keep their start (its code, its
    category, the node) and their end (what failed), and say that they were cut."""
    start = "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned "
    message = f"{start}{'/onnxruntime_src/frame ' * 100}index 99 out of bounds\n"
    error = translate_runtime_error(RuntimeError(message))
    assert isinstance(error, ModelRunError)
    words = error.runtime_message
    assert words.startswith(start), words
    assert words.endswith("index 99 out of bounds"), words
    assert f"(message cut: {len(message.rstrip())} bytes in all)" in words, words
    assert len(words.encode()) <= RUNTIME_MESSAGE_BYTES
