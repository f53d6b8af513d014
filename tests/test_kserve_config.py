"""Triton's model configuration and statistics extensions on the KServe front end
(server/kserve_config.py, KServeServicer.ModelConfig and ModelStatistics): the messages
against tritonclient's own declarations, the recorder's totals on a fake clock, and real
gRPC calls to an in-process server with a real ONNX Runtime session."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor

from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.server import kserve_convert
from laneserve.server.clock import ManualClock
from laneserve.server.config import LaneConfig
from laneserve.server.engine import TensorSpec
from laneserve.server.errors import DeviceMemoryError, EngineError
from laneserve.server.items import Array, Batch, BatchSlice, DispatchReason
from laneserve.server.kserve_config import (
    LANES_PARAMETER,
    STREAM_LANE_PARAMETER,
    max_request_rows,
    model_config,
    model_statistics,
    triton_data_type,
)
from laneserve.server.stats import BatchSizeTotals, Cumulative, Duration, StatsRecorder
from tests.support import (
    RecordingEngine,
    Serving,
    config,
    flight_waiters,
    request,
    rich_status,
    rows,
    serving,
    until,
)
from tests.test_kserve import _engine, kserve_stub, outputs_of, raw_request

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

TRITON_FIELDS = Path(__file__).parent / "data" / "triton_fields.json"

# Several lanes, each with its own capacity, timeout and wait; the default not the first.
LANES = (
    LaneConfig("fast", capacity_rows=64, timeout_ms=500, max_wait_ms=2, min_share=0.0),
    LaneConfig("main", capacity_rows=256, timeout_ms=5_000, max_wait_ms=5, min_share=0.1),
    LaneConfig("slow", capacity_rows=1_024, timeout_ms=60_000, max_wait_ms=30, min_share=0.05),
)


# ---- the messages, as tritonclient declares them ----------------------------------------

_SCALARS = {
    descriptor.FieldDescriptor.TYPE_DOUBLE: "double",
    descriptor.FieldDescriptor.TYPE_FLOAT: "float",
    descriptor.FieldDescriptor.TYPE_INT64: "int64",
    descriptor.FieldDescriptor.TYPE_UINT64: "uint64",
    descriptor.FieldDescriptor.TYPE_INT32: "int32",
    descriptor.FieldDescriptor.TYPE_BOOL: "bool",
    descriptor.FieldDescriptor.TYPE_STRING: "string",
    descriptor.FieldDescriptor.TYPE_BYTES: "bytes",
    descriptor.FieldDescriptor.TYPE_UINT32: "uint32",
}


def _field_row(field: descriptor.FieldDescriptor) -> list[Any]:
    """A field as triton_fields.json lists one: [name, number, type, repeated]."""
    if field.message_type is not None:
        kind = field.message_type.full_name
    elif field.enum_type is not None:
        kind = field.enum_type.full_name
    else:
        kind = _SCALARS[field.type]
    return [field.name, field.number, kind, field.is_repeated]


def _our_messages() -> list[descriptor.Descriptor]:
    found: list[descriptor.Descriptor] = []

    def walk(message: descriptor.Descriptor) -> None:
        found.append(message)
        for nested in message.nested_types:
            walk(nested)

    for message in kpb.DESCRIPTOR.message_types_by_name.values():
        walk(message)
    return found


def test_every_message_and_enum_is_a_subset_of_tritonclients() -> None:
    """Each message (nested and map-entry ones too) and enum of grpc_predict_v2.proto is
    in tritonclient 2.73's declarations, and each of its fields has the number, type and
    repetition tritonclient's has: a renumbered or retyped field fails here, not in a
    client's decoder. A message added to the proto without regenerating the table (its
    "_source" says how) fails too."""
    table = json.loads(TRITON_FIELDS.read_text(encoding="utf-8"))
    for message in _our_messages():
        theirs = {row[0]: row for row in table["messages"][message.full_name]}
        for field in message.fields:
            assert _field_row(field) == theirs.get(field.name), (message.full_name, field.name)
    enums = [*kpb.DESCRIPTOR.enum_types_by_name.values()]
    enums += [enum for message in _our_messages() for enum in message.enum_types]
    assert {enum.full_name for enum in enums} == set(table["enums"])
    for enum in enums:
        theirs_values = dict(table["enums"][enum.full_name])
        for value in enum.values:
            assert theirs_values.get(value.name) == value.number, (enum.full_name, value.name)


def test_every_served_datatype_is_tritons_type_of_the_same_name() -> None:
    """But BYTES, whose type Triton's model configuration names TYPE_STRING."""
    for kind in kserve_convert.KSERVE_TYPES:
        name = "STRING" if kind.name == "BYTES" else kind.name
        assert kpb.DataType.Name(triton_data_type(kind.datatype)) == f"TYPE_{name}"


# ---- ModelConfig ------------------------------------------------------------------------


def _queue_policy(timeout_ms: int) -> kpb.ModelQueuePolicy:
    return kpb.ModelQueuePolicy(
        timeout_action=kpb.ModelQueuePolicy.REJECT,
        default_timeout_microseconds=timeout_ms * 1000,
        allow_timeout_override=True,
        max_queue_size=0,
    )


def _expected_config(name: str, group: kpb.ModelInstanceGroup) -> kpb.ModelConfig:
    """The small model's configuration under LANES with "main" the default lane."""
    expected = kpb.ModelConfig(
        name=name,
        platform="onnxruntime_onnx",
        backend="onnxruntime",
        max_batch_size=64,  # the smallest lane's capacity_rows
        input=[kpb.ModelInput(name="input", data_type=kpb.TYPE_FP32, dims=[512])],
        output=[kpb.ModelOutput(name="output", data_type=kpb.TYPE_FP32, dims=[10])],
        instance_group=[group],
        dynamic_batching=kpb.ModelDynamicBatching(
            max_queue_delay_microseconds=30_000,
            priority_levels=3,
            default_priority_level=2,
            default_queue_policy=_queue_policy(5_000),
        ),
        parameters={
            LANES_PARAMETER: kpb.ModelParameter(string_value="fast,main,slow"),
            # No lane "bulk": a stream item goes to the default lane too.
            STREAM_LANE_PARAMETER: kpb.ModelParameter(string_value="main"),
        },
        model_transaction_policy=kpb.ModelTransactionPolicy(decoupled=False),
    )
    for level, timeout_ms in ((1, 500), (2, 5_000), (3, 60_000)):
        expected.dynamic_batching.priority_queue_policy[level].CopyFrom(_queue_policy(timeout_ms))
    return expected


def test_model_config_states_the_served_config_on_the_cpu(small_model: Path) -> None:
    """Several lanes with their own timeouts, waits and capacities, "main" the default,
    on the CPU alone: each value is the served config's, read over gRPC; ServerMetadata
    names the extensions."""
    cpu_group = kpb.ModelInstanceGroup(name="mlp_0", count=1, kind=kpb.ModelInstanceGroup.KIND_CPU)

    async def scenario() -> None:
        served = config(
            small_model, model_name="mlp", lanes=LANES, default_lane="main", device="cpu"
        )
        async with serving(RecordingEngine(str(small_model), device="cpu"), served) as s:
            stub = kserve_stub(s)
            for version in ("", "1"):
                answer = await stub.ModelConfig(kpb.ModelConfigRequest(name="mlp", version=version))
                assert answer.config == _expected_config("mlp", cpu_group)
            metadata = await stub.ServerMetadata(kpb.ServerMetadataRequest())
            assert list(metadata.extensions) == [
                "schedule_policy",
                "model_configuration",
                "statistics",
                "trace",
                "logging",
            ]

    asyncio.run(scenario())


def test_on_cuda_the_instance_group_is_the_gpu_the_session_runs_on(small_model: Path) -> None:
    served = config(small_model, model_name="mlp", lanes=LANES, default_lane="main")
    specs = (TensorSpec("input", np.dtype("<f4"), (-1, 512)),)
    outputs = (TensorSpec("output", np.dtype("<f4"), (-1, 10)),)
    built = model_config(served, specs, outputs, gpu_id=0)
    gpu_group = kpb.ModelInstanceGroup(
        name="mlp_0", count=1, kind=kpb.ModelInstanceGroup.KIND_GPU, gpus=[0]
    )
    assert built == _expected_config("mlp", gpu_group)


def test_model_config_names_the_lane_a_stream_item_without_lane_or_priority_goes_to(
    small_model: Path,
) -> None:
    """default_priority_level is ModelInfer's default lane (server.default_lane); a
    ModelStreamInfer item without `lane` or `priority` goes to the streams' default lane,
    "bulk" where there is one, named by parameter laneserve_stream_default_lane: each is
    where such a request was answered from."""

    async def items() -> AsyncIterator[kpb.ModelInferRequest]:
        item = raw_request("small", input=rows(1))
        item.id = "item"
        yield item

    async def scenario() -> None:
        for served, expected in (
            (config(small_model), ("standard", "bulk")),
            (config(small_model, lanes=LANES, default_lane="main"), ("main", "main")),
        ):
            async with serving(RecordingEngine(str(small_model)), served) as s:
                stub = kserve_stub(s)
                stated = (await stub.ModelConfig(kpb.ModelConfigRequest(name="small"))).config
                lanes = stated.parameters[LANES_PARAMETER].string_value.split(",")
                default = lanes[stated.dynamic_batching.default_priority_level - 1]
                stream_default = stated.parameters[STREAM_LANE_PARAMETER].string_value
                assert (default, stream_default) == expected
                unary = await stub.ModelInfer(raw_request("small", input=rows(1)))
                assert unary.parameters["laneserve_lane"].string_param == default
                (streamed,) = [answer async for answer in stub.ModelStreamInfer(items())]
                lane = streamed.infer_response.parameters["laneserve_lane"].string_param
                assert lane == stream_default

    asyncio.run(scenario())


def test_max_batch_size_is_the_smallest_lane_and_a_request_of_more_rows_is_refused(
    small_model: Path,
) -> None:
    """The bound a Triton client can rely on in any lane: a request of max_batch_size
    rows runs in the smallest lane (split across batches over the batch cap), one more
    row is refused there."""
    assert max_request_rows(LANES) == 64

    async def scenario() -> None:
        served = config(small_model, lanes=LANES, default_lane="main", max_batch_size=16)
        async with serving(RecordingEngine(str(small_model)), served) as s:
            stub = kserve_stub(s)
            bound = (await stub.ModelConfig(kpb.ModelConfigRequest(name="small"))).config
            fits = raw_request("small", input=rows(bound.max_batch_size))
            fits.parameters["priority"].uint64_param = 1  # "fast", the smallest lane
            assert outputs_of(await stub.ModelInfer(fits))["output"].shape == (64, 10)
            over = raw_request("small", input=rows(bound.max_batch_size + 1))
            over.parameters["priority"].uint64_param = 1
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfer(over)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "lane 'fast' holds at most 64 rows" in str(caught.value.details())

    asyncio.run(scenario())


# ---- NOT_FOUND ----------------------------------------------------------------------------


def test_another_model_or_version_is_not_found_and_empty_name_is_every_model(
    small_model: Path,
) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            refused: list[Any] = [
                stub.ModelConfig(kpb.ModelConfigRequest(name="other")),
                stub.ModelConfig(kpb.ModelConfigRequest(name="small", version="2")),
                stub.ModelConfig(kpb.ModelConfigRequest()),
                stub.ModelStatistics(kpb.ModelStatisticsRequest(name="other")),
                stub.ModelStatistics(kpb.ModelStatisticsRequest(name="small", version="2")),
                stub.ModelStatistics(kpb.ModelStatisticsRequest(version="2")),
            ]
            for call in refused:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.NOT_FOUND
                assert rich_status(caught.value)[0] == "MODEL_NOT_FOUND"
            for asked in (
                kpb.ModelStatisticsRequest(),
                kpb.ModelStatisticsRequest(name="small"),
                kpb.ModelStatisticsRequest(name="small", version="1"),
                kpb.ModelStatisticsRequest(version="1"),
            ):
                answer = await stub.ModelStatistics(asked)
                assert [(m.name, m.version) for m in answer.model_stats] == [("small", "1")]

    asyncio.run(scenario())


# ---- the recorder's totals, on a fake clock -------------------------------------------------


def _batch(batch_id: int, formed_s: float, *pieces: tuple[int, int, int]) -> Batch:
    """A batch of slices (entry_id, row_start, rows), placed one after another."""
    slices, offset = [], 0
    for entry_id, row_start, count in pieces:
        slices.append(BatchSlice(entry_id, "standard", row_start, count, offset))
        offset += count
    return Batch(batch_id, tuple(slices), offset, DispatchReason.FULL, formed_s, parts={})


def test_the_totals_count_each_request_once_and_its_batches_time_for_each_request() -> None:
    """Triton's meanings, exactly: queue once per request run (at its first batch), each
    batch's run counted for every request in it (a request in two batches gets both),
    compute_input the batch's time from formed to done outside its run, per batch size
    the batches' own times; a batch that fails whole runs no request."""
    clock = ManualClock(start_s=100.0)
    recorder = StatsRecorder(["standard"], clock=clock)
    # Batch 1: requests 1 (2 rows) and 2 (the first 3 rows of 5), waited 10 ms and 20 ms.
    first = _batch(1, 100.0, (1, 0, 2), (2, 0, 3))
    recorder.batch_formed(first, [0.010, 0.020])
    clock.advance(0.050)  # 40 ms run, 10 ms outside it
    recorder.batch_done(first, 0.040, None)
    recorder.request_finished("standard", "OK", 0.080)
    # Batch 2: request 2's last 2 rows (no wait of its own) and request 3 (1 row, 5 ms).
    second = _batch(2, clock.monotonic(), (2, 3, 2), (3, 0, 1))
    recorder.batch_formed(second, [None, 0.005])
    clock.advance(0.030)  # 30 ms run, nothing outside it
    recorder.batch_done(second, 0.030, None)
    recorder.request_finished("standard", "OK", 0.120)
    recorder.request_finished("standard", "OK", 0.040)
    # Batch 3 fails whole: its request is answered with the error, nothing ran.
    failed = _batch(3, clock.monotonic(), (4, 0, 3))
    recorder.batch_formed(failed, [0.001])
    clock.advance(0.010)
    recorder.batch_done(failed, 0.005, EngineError("injected"))
    recorder.request_finished("standard", EngineError.reason, 0.015)
    recorder.rejected("standard", "LANE_FULL", 0.0)
    clock.advance(2.0)

    totals = recorder.cumulative()
    assert totals.last_success_ago_s == pytest.approx(2.010)
    ms = 1_000_000
    assert dataclasses.replace(totals, last_success_ago_s=None) == Cumulative(
        success=Duration(3, 240 * ms),
        fail=Duration(2, 15 * ms),  # the refusal, as it arrived, with no time
        queue=Duration(3, 35 * ms),
        # 10 ms outside batch 1's run, for each of its two requests.
        compute_input=Duration(3, 20 * ms),
        # Batch 1's 40 ms twice, batch 2's 30 ms twice.
        compute_infer=Duration(3, 140 * ms),
        rows_run=8,
        executions=2,
        batch_sizes=(
            BatchSizeTotals(rows=3, count=1, input_ns=0, infer_ns=30 * ms),
            BatchSizeTotals(rows=5, count=1, input_ns=10 * ms, infer_ns=40 * ms),
        ),
        last_success_ago_s=None,
    )


def test_a_refusal_counts_in_fail_with_what_it_waited() -> None:
    """Triton's `fail` times a request from its arrival to its failure: a refusal is
    counted with what its request waited first (a retry answered alone at its deadline
    after waiting on the request it joined; a stream item after waiting for room), one
    refused as it arrived with none. Every refusal counted 0 ns."""
    recorder = StatsRecorder(["standard", "bulk"], clock=ManualClock(start_s=100.0))
    recorder.rejected("standard", "EXPIRED_IN_QUEUE", 2.5)
    recorder.rejected("bulk", "CANCELLED", 0.125)
    recorder.rejected("bulk", "LANE_FULL", 0.0)
    totals = recorder.cumulative()
    assert totals.fail == Duration(3, 2_625_000_000)
    assert totals.success == Duration(0, 0)
    rejected = recorder.counts().rejected
    assert rejected == {
        ("standard", "EXPIRED_IN_QUEUE"): 1,
        ("bulk", "CANCELLED"): 1,
        ("bulk", "LANE_FULL"): 1,
    }


def test_a_batch_retried_in_parts_is_no_execution_of_its_size() -> None:
    """A batch run again in parts after a failed run (`batch_done`'s `split`: out of
    memory, or rows that failed alone) ran as several executions of smaller sizes, its
    run_s the failed run's and every part's: it is left out of execution_count and
    batch_stats, while its rows that ran count and its requests count it as ever."""
    clock = ManualClock(start_s=100.0)
    recorder = StatsRecorder(["standard"], clock=clock)
    # Out of memory at 4 rows, run in halves: two requests of 2 rows, both answered.
    out_of_memory = _batch(1, 100.0, (1, 0, 2), (2, 0, 2))
    recorder.batch_formed(out_of_memory, [0.001, 0.002])
    clock.advance(0.050)
    recorder.batch_split(1, 4, 1)
    recorder.batch_done(out_of_memory, 0.040, None, split=True)
    # A bad row among 4: split down to it; its request (1 row) failed, the other ran.
    bad_row = _batch(2, clock.monotonic(), (3, 0, 3), (4, 0, 1))
    recorder.batch_formed(bad_row, [0.003, 0.004])
    clock.advance(0.030)
    recorder.batch_done(bad_row, 0.030, None, failed_rows=1, split=True)
    # A batch of 4 that ran whole, once.
    whole = _batch(3, clock.monotonic(), (5, 0, 4))
    recorder.batch_formed(whole, [0.005])
    clock.advance(0.020)
    recorder.batch_done(whole, 0.010, None)

    totals = recorder.cumulative()
    ms = 1_000_000
    assert (totals.rows_run, totals.executions) == (4 + 3 + 4, 1)
    assert totals.batch_sizes == (
        BatchSizeTotals(rows=4, count=1, input_ns=10 * ms, infer_ns=10 * ms),
    )
    assert totals.queue == Duration(5, 15 * ms)
    # Each request is counted with the time its batch took, every run of it included.
    assert totals.compute_infer == Duration(5, (2 * 40 + 2 * 30 + 10) * ms)


def test_a_batch_out_of_memory_is_left_out_of_batch_stats_over_grpc(small_model: Path) -> None:
    """A real session out of memory above 4 rows (fault injection, armed once the server
    has started): a request of 8 rows runs in two parts of 4 and is answered; its batch
    of 8 is no execution, and none of 8 rows is in batch_stats. The cap came down: the
    next request of 8 rows runs in batches that fit, each one execution."""

    async def scenario() -> None:
        engine = _OutOfMemoryAbove(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=16)) as s:
            engine.fit_rows = 4
            stub = kserve_stub(s)
            await stub.ModelInfer(raw_request("small", input=rows(8)))
            assert engine.runs == [8, 4, 4]
            counts = _counts(await _statistics(s))
            assert (counts["inference_count"], counts["execution_count"]) == (8, 0)
            assert not any(key.startswith("batch") for key in counts), counts
            assert (counts["success.count"], counts["compute_infer.count"]) == (1, 1)
            assert counts["compute_infer.ns"] > 0

            engine.runs.clear()
            await stub.ModelInfer(raw_request("small", input=rows(8)))
            assert max(engine.runs) <= 4, engine.runs
            stats = await _statistics(s)
            counts = _counts(stats)
            assert counts["inference_count"] == 16
            assert counts["execution_count"] == len(engine.runs)
            assert sum(batch.compute_infer.count for batch in stats.batch_stats) == len(engine.runs)
            assert {batch.batch_size for batch in stats.batch_stats} == set(engine.runs)

    asyncio.run(scenario())


def test_a_batch_retried_in_parts_after_a_failure_no_part_repeats_is_no_execution(
    small_model: Path,
) -> None:
    """A run that fails once, for a reason no part repeats (fault injection: the first run
    of 8 rows armed fails ENGINE_FAILURE), is retried in halves that both run: the
    request is answered, and its batch of 8 is no execution of 8 rows (the recorder was
    told neither by an out-of-memory split nor by failed rows: it counted one)."""

    async def scenario() -> None:
        engine = _FailsOnce(str(small_model))
        async with serving(engine, config(small_model, max_batch_size=16)) as s:
            engine.armed = True
            await kserve_stub(s).ModelInfer(raw_request("small", input=rows(8)))
            assert engine.runs == [8, 4, 4]
            stats = await _statistics(s)
            counts = _counts(stats)
            assert (counts["inference_count"], counts["execution_count"]) == (8, 0)
            assert list(stats.batch_stats) == []
            assert (counts["success.count"], counts["compute_infer.count"]) == (1, 1)

    asyncio.run(scenario())


class _FailsOnce(RecordingEngine):
    """The real session, whose first run once `armed` fails ENGINE_FAILURE (fault
    injection); `runs`: the rows of every run from then on."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        self.armed = False
        self.runs: list[int] = []

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        if self.armed:
            self.runs.append(len(inputs["input"]))
            if len(self.runs) == 1:
                raise EngineError("injected: a failure no part repeats")
        return super().run(inputs)


class _OutOfMemoryAbove(RecordingEngine):
    """The real session, out of device memory for runs of more than `fit_rows` rows
    once that is set (fault injection); `runs`: the rows of every run tried."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        self.fit_rows: int | None = None
        self.runs: list[int] = []

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        rows = len(inputs["input"])
        if self.fit_rows is not None:
            self.runs.append(rows)
            if rows > self.fit_rows:
                raise DeviceMemoryError("injected: out of memory")
        return super().run(inputs)


def test_statistics_state_the_totals_with_the_wall_clock_time_of_the_last_success() -> None:
    totals = Cumulative(
        success=Duration(3, 300),
        fail=Duration(1, 7),
        queue=Duration(3, 30),
        compute_input=Duration(3, 12),
        compute_infer=Duration(3, 90),
        rows_run=9,
        executions=2,
        batch_sizes=(BatchSizeTotals(rows=4, count=2, input_ns=6, infer_ns=60),),
        last_success_ago_s=1.5,
    )
    stats = model_statistics("m", "1", totals, now_epoch_s=1_700_000_000.0)
    assert (stats.name, stats.version, stats.last_inference) == ("m", "1", 1_699_999_998_500)
    assert (stats.inference_count, stats.execution_count) == (9, 2)
    inference = stats.inference_stats
    assert [
        (getattr(inference, name).count, getattr(inference, name).ns)
        for name in ("success", "fail", "queue", "compute_input", "compute_infer")
    ] == [(3, 300), (1, 7), (3, 30), (3, 12), (3, 90)]
    # perf_analyzer refuses compute counts that differ: compute_output's is theirs.
    assert (inference.compute_output.count, inference.compute_output.ns) == (3, 0)
    (batch,) = stats.batch_stats
    assert (batch.batch_size, batch.compute_input.count, batch.compute_input.ns) == (4, 2, 6)
    assert (batch.compute_infer.count, batch.compute_infer.ns) == (2, 60)
    assert (batch.compute_output.count, batch.compute_output.ns) == (2, 0)
    assert not stats.memory_usage
    never = dataclasses.replace(totals, last_success_ago_s=None)
    assert model_statistics("m", "1", never, 1.0).last_inference == 0


# ---- ModelStatistics over gRPC ------------------------------------------------------------


async def _statistics(s: Serving) -> kpb.ModelStatistics:
    (stats,) = (await kserve_stub(s).ModelStatistics(kpb.ModelStatisticsRequest())).model_stats
    return stats


def _counts(stats: kpb.ModelStatistics) -> dict[str, int]:
    """Every count and duration of `stats`, flattened."""
    counts = {
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
    }
    for name in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        duration = getattr(stats.inference_stats, name)
        counts[f"{name}.count"], counts[f"{name}.ns"] = duration.count, duration.ns
    for batch in stats.batch_stats:
        counts[f"batch{batch.batch_size}.count"] = batch.compute_infer.count
        counts[f"batch{batch.batch_size}.ns"] = batch.compute_infer.ns
    return counts


async def _refused(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code()


def test_statistics_count_model_infer_and_infer_calls_and_grow_between_readings(
    small_model: Path,
) -> None:
    """Known calls, one at a time (each its own batch): successes from ModelInfer and
    Infer, a request that failed in the engine, two refused before admission (a bad
    datatype on ModelInfer, an unknown lane on Infer); a call for another model is no
    request to this one. A second reading after one more call has every count at least
    the first's, and the new call's in it."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        engine.fail_when = lambda batch: batch.rows == 5
        async with serving(engine, config(small_model)) as s:
            stub = kserve_stub(s)
            before = await _statistics(s)
            assert _counts(before) == dict.fromkeys(_counts(before), 0)
            assert before.last_inference == 0
            started_ms = time.time() * 1000
            await stub.ModelInfer(raw_request("small", input=rows(2)))
            await stub.ModelInfer(raw_request("small", input=rows(1)))
            await s.stub.Infer(request(rows(4)))
            await s.stub.Infer(request(rows(1)))
            answered_ms = time.time() * 1000
            assert await _refused(s.stub.Infer(request(rows(5)))) == grpc.StatusCode.INTERNAL
            wrong = raw_request("small", input=rows(1).astype(np.float64))
            assert await _refused(stub.ModelInfer(wrong)) == grpc.StatusCode.INVALID_ARGUMENT
            unknown_lane = request(rows(1), lane="nope")
            assert await _refused(s.stub.Infer(unknown_lane)) == grpc.StatusCode.INVALID_ARGUMENT
            other = raw_request("other", input=rows(1))
            assert await _refused(stub.ModelInfer(other)) == grpc.StatusCode.NOT_FOUND

            first = await _statistics(s)
            counts = _counts(first)
            assert {key: value for key, value in counts.items() if not key.endswith(".ns")} == {
                "inference_count": 8,
                "execution_count": 4,
                "success.count": 4,
                "fail.count": 3,
                "queue.count": 4,
                "compute_input.count": 4,
                "compute_infer.count": 4,
                "compute_output.count": 4,
                "batch1.count": 2,
                "batch2.count": 1,
                "batch4.count": 1,
            }
            assert counts["success.ns"] > counts["compute_infer.ns"] > 0
            assert counts["fail.ns"] > 0, "the engine's failure took time"
            # One request per batch: the requests' compute times are their batches'.
            for name in ("compute_input", "compute_infer"):
                assert counts[f"{name}.ns"] == sum(
                    getattr(batch, name).ns for batch in first.batch_stats
                ), name
            assert started_ms <= first.last_inference <= answered_ms + 1

            await s.stub.Infer(request(rows(2)))
            second = _counts(await _statistics(s))
            assert all(second[key] >= value for key, value in counts.items())
            assert (second["success.count"], second["inference_count"]) == (5, 10)
            assert second["batch2.count"] == 2

    asyncio.run(scenario())


def test_a_retry_answered_alone_at_its_deadline_counts_its_wait_in_fail(
    small_model: Path,
) -> None:
    """On a manual clock: a retry joins its request running in the session, with a
    deadline 8 s from its arrival; 8 s later its caller goes (gRPC cancels a call at its
    deadline) and it is answered alone, EXPIRED_IN_QUEUE. `fail` counts it with those
    8 s (it was 0 ns, whatever a refusal waited); a request refused as it arrived (an
    unknown lane) counts with none. The request runs on for its first caller: OK."""

    async def scenario() -> None:
        clock = ManualClock()
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model), clock=clock) as s:
            x = rows(2, start=70)
            engine.hold_next()
            first = asyncio.ensure_future(s.stub.Infer(request(x, request_id="x")))
            await asyncio.to_thread(engine.entered.acquire)
            # Its timer is the event loop's, 8 s of real time away: the cancel comes first.
            retry = s.stub.Infer(request(x, request_id="x", timeout_ms=8_000))
            await until(lambda: flight_waiters(s, "x") == 2)
            clock.advance(8.0)
            retry.cancel()
            await until(lambda: flight_waiters(s, "x") == 1)
            unknown_lane = request(rows(1), lane="nope")
            assert await _refused(s.stub.Infer(unknown_lane)) == grpc.StatusCode.INVALID_ARGUMENT
            engine.release()
            await first
            counts = _counts(await _statistics(s))
            assert (counts["fail.count"], counts["fail.ns"]) == (2, 8_000_000_000)
            assert counts["success.count"] == 1
            rejected = s.server.stats.counts().rejected
            assert rejected[s.server.config.default_lane, "EXPIRED_IN_QUEUE"] == 1
            assert rejected[s.server.config.default_lane, "INVALID_INPUT"] == 1

    asyncio.run(scenario())


def test_a_joined_or_replayed_retry_is_not_a_second_run(small_model: Path) -> None:
    """A retry that joins its request in flight, and one answered from the stored
    answer, get the answer without running: one success, its rows and batch once."""

    async def scenario() -> None:
        engine = RecordingEngine(str(small_model))
        async with serving(engine, config(small_model)) as s:
            stub = kserve_stub(s)
            message = raw_request("small", input=rows(3, start=30))
            message.id = "once"
            message.parameters["laneserve_idempotent"].bool_param = True  # the id keys it
            engine.hold_next()
            submitted = asyncio.ensure_future(stub.ModelInfer(message))
            await asyncio.to_thread(engine.entered.acquire)
            joined = asyncio.ensure_future(
                s.stub.Infer(request(rows(3, start=30), request_id="once"))
            )
            await until(lambda: flight_waiters(s, "once") == 2)
            engine.release()
            await asyncio.gather(submitted, joined)
            await stub.ModelInfer(message)  # replayed
            assert sorted(engine.ran_tags) == [30, 31, 32], "ran once"
            counts = _counts(await _statistics(s))
            assert (counts["success.count"], counts["fail.count"]) == (1, 0)
            assert (counts["inference_count"], counts["execution_count"]) == (3, 1)
            assert (counts["queue.count"], counts["compute_infer.count"]) == (1, 1)

    asyncio.run(scenario())


def test_a_text_models_metadata_says_bytes_and_its_config_type_string(text_model: Path) -> None:
    """String inputs and outputs are BYTES in ModelMetadata and TYPE_STRING in ModelConfig
    (Triton's names for them), beside the numeric outputs' own."""

    async def scenario() -> tuple[kpb.ModelMetadataResponse, kpb.ModelConfigResponse]:
        async with serving(_engine(text_model), config(text_model)) as s:
            stub = kserve_stub(s)
            metadata = await stub.ModelMetadata(kpb.ModelMetadataRequest(name="text"))
            return metadata, await stub.ModelConfig(kpb.ModelConfigRequest(name="text"))

    metadata, answer = asyncio.run(scenario())
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("text", "BYTES", [-1]),
        ("numbers", "BYTES", [-1, 2]),
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("tagged", "BYTES", [-1]),
        ("label", "INT64", [-1]),
        ("value", "FP32", [-1, 2]),
    ]
    assert [(t.name, t.data_type, list(t.dims)) for t in answer.config.input] == [
        ("text", kpb.TYPE_STRING, []),
        ("numbers", kpb.TYPE_STRING, [2]),
    ]
    assert [(t.name, t.data_type, list(t.dims)) for t in answer.config.output] == [
        ("tagged", kpb.TYPE_STRING, []),
        ("label", kpb.TYPE_INT64, []),
        ("value", kpb.TYPE_FP32, [2]),
    ]
