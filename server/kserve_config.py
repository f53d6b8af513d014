"""Triton's model configuration and statistics extensions, as laneserve states them: the
ModelConfig and ModelStatistics messages its KServe front end (`kserve.KServeServicer`)
answers, built from the served config and the stats recorder's totals.

perf_analyzer reads ModelConfig before it runs (max_batch_size, the tensors) and
ModelStatistics before and after every measurement window (its server-side figures are
the differences); tritonclient users read both. Each value means what Triton's does, and
where laneserve's own notion differs the comment beside it says which value is given and
why. The messages are the subset of Triton's grpc_service.proto and model_config.proto
that grpc_predict_v2.proto declares (field by field as tritonclient 2.73's:
tests/data/triton_fields.json).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from laneserve.client.tensors import datatype_of
from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.server.config import GRPC_INT_MAX, LaneConfig, ServerConfig
from laneserve.server.engine import TensorSpec
from laneserve.server.stats import Cumulative, Duration
from laneserve.server.streams import stream_default_lane
from laneserve.v1 import inference_pb2 as pb

# ServerMetadata's `extensions`: Triton's names of the extensions served here (its
# docs/protocol/extension_schedule_policy.md: the request parameters `priority` and
# `timeout`, read by `kserve_convert.request_parameters`; extension_model_configuration.md;
# extension_shared_memory.md, its system part: server/shared_memory.py;
# extension_statistics.md; extension_trace.md and extension_logging.md: TraceSetting
# and LogSettings, server/settings.py), in the order Triton lists them.
EXTENSIONS: Final = (
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "statistics",
    "trace",
    "logging",
)
SHARED_MEMORY_EXTENSION: Final = "system_shared_memory"


def extensions(shared_memory: bool) -> tuple[str, ...]:
    """ServerMetadata's extensions: EXTENSIONS, less system_shared_memory while
    server.shared_memory is false (`shared_memory`)."""
    return tuple(name for name in EXTENSIONS if shared_memory or name != SHARED_MEMORY_EXTENSION)


# Triton's platform name for an ONNX model run by ONNX Runtime (ModelMetadata's and
# ModelConfig's), and its backend name for ONNX Runtime (ModelConfig's).
PLATFORM: Final = "onnxruntime_onnx"
BACKEND: Final = "onnxruntime"
# ModelConfig.parameters' key naming the lanes in priority order, comma-separated (a
# lane's name has no comma: config.LANE_NAME_RULE): priority k is the k-th.
LANES_PARAMETER: Final = "laneserve_lanes"
# ModelConfig.parameters' key naming the lane of a ModelStreamInfer item that names no
# lane nor priority (`streams.stream_default_lane`: "bulk" where configured): not
# default_priority_level's, which is ModelInfer's (server.default_lane). Triton has one
# default per model; laneserve's streams have their own.
STREAM_LANE_PARAMETER: Final = "laneserve_stream_default_lane"

# Triton's DataType of each wire type laneserve serves (`kserve_convert.KSERVE_TYPES`): TYPE_
# and the protocol's name ("FP32": TYPE_FP32), but BYTES's, TYPE_STRING in Triton's
# model configuration.
_DATA_TYPES: Final[dict[pb.DataType.ValueType, kpb.DataType.ValueType]] = {
    pb.DATA_TYPE_BOOL: kpb.TYPE_BOOL,
    pb.DATA_TYPE_UINT8: kpb.TYPE_UINT8,
    pb.DATA_TYPE_UINT16: kpb.TYPE_UINT16,
    pb.DATA_TYPE_UINT32: kpb.TYPE_UINT32,
    pb.DATA_TYPE_UINT64: kpb.TYPE_UINT64,
    pb.DATA_TYPE_INT8: kpb.TYPE_INT8,
    pb.DATA_TYPE_INT16: kpb.TYPE_INT16,
    pb.DATA_TYPE_INT32: kpb.TYPE_INT32,
    pb.DATA_TYPE_INT64: kpb.TYPE_INT64,
    pb.DATA_TYPE_FLOAT16: kpb.TYPE_FP16,
    pb.DATA_TYPE_FLOAT32: kpb.TYPE_FP32,
    pb.DATA_TYPE_FLOAT64: kpb.TYPE_FP64,
    pb.DATA_TYPE_STRING: kpb.TYPE_STRING,
}


def triton_data_type(datatype: pb.DataType.ValueType) -> kpb.DataType.ValueType:
    """Triton's DataType of a wire type the engine serves."""
    return _DATA_TYPES[datatype]


def max_request_rows(lanes: Sequence[LaneConfig]) -> int:
    """Triton's max_batch_size: the most rows a request may have without being refused
    for them. laneserve splits a request larger than the batch cap across batches (so
    server.max_batch_size bounds batches, not requests) and refuses one larger than its
    lane holds (`LaneConfig.check_rows`). A Triton client picks the lane with `priority`,
    so the bound it can rely on in any lane is the smallest lane's capacity_rows (a field
    of int32). A request is held to max_message_bytes too, a bound in bytes, as Triton's
    own gRPC limit is."""
    return min(GRPC_INT_MAX, *(lane.capacity_rows for lane in lanes))


def model_config(
    config: ServerConfig,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    *,
    gpu_id: int | None,
) -> kpb.ModelConfig:
    """The served model's configuration as Triton states one. `gpu_id`: the CUDA device
    the session runs on; None on the CPU."""
    name = config.served_model_name
    lanes = config.lanes
    default_level = [lane.name for lane in lanes].index(config.default_lane) + 1
    batching = kpb.ModelDynamicBatching(
        # The longest any lane holds a batch open for more rows (each lane waits its own
        # max_wait_ms; Triton has one wait per model): a bound for every request.
        max_queue_delay_microseconds=max(lane.max_wait_ms for lane in lanes) * 1000,
        # The lanes, highest priority first: Triton's priority k is the k-th lane and 0
        # the default lane (`kserve_convert._lane_of_priority`): for ModelInfer,
        # server.default_lane; a ModelStreamInfer item's is STREAM_LANE_PARAMETER's.
        priority_levels=len(lanes),
        default_priority_level=default_level,
        default_queue_policy=_queue_policy(config.lane(config.default_lane)),
    )
    for level, lane in enumerate(lanes, start=1):
        batching.priority_queue_policy[level].CopyFrom(_queue_policy(lane))
    group = kpb.ModelInstanceGroup(
        # Triton's name for a group left unnamed: the model's, then its index.
        name=f"{name}_0",
        count=1,  # one session, on one device
        kind=kpb.ModelInstanceGroup.KIND_CPU if gpu_id is None else kpb.ModelInstanceGroup.KIND_GPU,
        gpus=[] if gpu_id is None else [gpu_id],
    )
    return kpb.ModelConfig(
        name=name,
        platform=PLATFORM,
        backend=BACKEND,
        max_batch_size=max_request_rows(lanes),
        input=[
            kpb.ModelInput(name=spec.name, data_type=_data_type(spec), dims=spec.shape[1:])
            for spec in inputs
        ],
        output=[
            kpb.ModelOutput(name=spec.name, data_type=_data_type(spec), dims=spec.shape[1:])
            for spec in outputs
        ],
        instance_group=[group],
        dynamic_batching=batching,
        parameters={
            LANES_PARAMETER: kpb.ModelParameter(string_value=",".join(lane.name for lane in lanes)),
            STREAM_LANE_PARAMETER: kpb.ModelParameter(string_value=stream_default_lane(config)),
        },
        # One answer per request.
        model_transaction_policy=kpb.ModelTransactionPolicy(decoupled=False),
    )


def _data_type(spec: TensorSpec) -> kpb.DataType.ValueType:
    return triton_data_type(datatype_of(spec.dtype))


def _queue_policy(lane: LaneConfig) -> kpb.ModelQueuePolicy:
    """A lane as Triton's queue policy of its priority level."""
    return kpb.ModelQueuePolicy(
        # A request whose deadline passes while queued is answered DEADLINE_EXCEEDED
        # (EXPIRED_IN_QUEUE), never run late.
        timeout_action=kpb.ModelQueuePolicy.REJECT,
        # The lane's timeout_ms. It bounds queue and run together, from arrival, where
        # Triton's bounds the time in the queue alone.
        default_timeout_microseconds=lane.timeout_ms * 1000,
        # A request's `timeout` applies where shorter, and never extends the lane's: as
        # Triton's override, which "may not increase the timeout".
        allow_timeout_override=True,
        # 0, Triton's "no bound": a lane's bound is capacity_rows, in rows, where
        # Triton's max_queue_size counts requests, and a lane of N rows holds N requests
        # of one row or one of N; no count of requests is the bound.
        max_queue_size=0,
    )


def model_statistics(
    name: str, version: str, totals: Cumulative, now_epoch_s: float
) -> kpb.ModelStatistics:
    """The served model's statistics since start (`StatsRecorder.cumulative`), at
    wall-clock time `now_epoch_s`."""
    ago_s = totals.last_success_ago_s
    return kpb.ModelStatistics(
        name=name,
        version=version,
        # Milliseconds since the epoch of the last request answered OK; 0: none yet.
        last_inference=0 if ago_s is None else max(round((now_epoch_s - ago_s) * 1000), 0),
        inference_count=totals.rows_run,
        execution_count=totals.executions,
        inference_stats=kpb.InferStatistics(
            success=_duration(totals.success),
            fail=_duration(totals.fail),
            queue=_duration(totals.queue),
            compute_input=_duration(totals.compute_input),
            compute_infer=_duration(totals.compute_infer),
            compute_output=_no_time(totals.compute_infer.count),
            # cache_hit and cache_miss: 0, no response cache.
        ),
        batch_stats=[
            kpb.InferBatchStatistics(
                batch_size=size.rows,
                compute_input=kpb.StatisticDuration(count=size.count, ns=size.input_ns),
                compute_infer=kpb.StatisticDuration(count=size.count, ns=size.infer_ns),
                compute_output=_no_time(size.count),
            )
            for size in totals.batch_sizes
        ],
        # memory_usage: none. laneserve reads the GPU's memory in use (NVML: every
        # process's) or the process's resident memory, never the session's alone.
    )


def _duration(duration: Duration) -> kpb.StatisticDuration:
    return kpb.StatisticDuration(count=duration.count, ns=duration.ns)


def _no_time(count: int) -> kpb.StatisticDuration:
    """compute_output: counted as compute_infer is (perf_analyzer refuses compute counts
    that differ), with no time of its own. The outputs come back from the session's run
    as host arrays (copies included in compute_infer), and a request's rows are views of
    them sliced as the batch completes (in compute_input); encoding the answer comes
    after, in success's time, as Triton's front end's does."""
    return kpb.StatisticDuration(count=count, ns=0)
