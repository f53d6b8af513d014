"""GetModel's and GetStats' answers: the server's facts as laneserve.v1's messages."""

from __future__ import annotations

from typing import Any

from laneserve.client.tensors import datatype_of
from laneserve.server.engine import TensorSpec
from laneserve.server.grpc_calls import GrpcCalls
from laneserve.server.memory import MemoryFacts, WatermarkState
from laneserve.server.model_identity import ModelIdentity
from laneserve.server.stats import Distribution, Percentiles
from laneserve.v1 import inference_pb2 as pb


def tensor_spec(spec: TensorSpec) -> pb.TensorSpec:
    # A name per dimension, "" for a fixed or unnamed one: a client checks the dimensions
    # inputs share before sending (dim_names is empty only from servers older than it).
    return pb.TensorSpec(
        name=spec.name,
        dtype=datatype_of(spec.dtype),
        shape=list(spec.shape),
        dim_names=[name or "" for name in spec.dim_names],
    )


def grpc_calls_message(calls: GrpcCalls | None) -> pb.GrpcCalls | None:
    if calls is None:
        return None
    return pb.GrpcCalls(started=calls.started, succeeded=calls.succeeded, failed=calls.failed)


def identity_fields(identity: ModelIdentity) -> dict[str, Any]:
    return {
        "model_sha256": identity.sha256,
        "model_version": identity.version,  # None: the field absent
        "producer_name": identity.producer_name,
        "graph_name": identity.graph_name,
        "domain": identity.domain,
        "description": identity.description,
        "custom_metadata": identity.custom_metadata,
    }


def memory_fields(memory: MemoryFacts | None) -> dict[str, Any]:
    if memory is None:
        return {}
    return {
        "memory_limit_bytes": memory.limit_bytes or 0,
        "probed_batch_cap": memory.probed_batch_cap,
        "estimated_fixed_bytes": memory.estimate.fixed_bytes if memory.estimate else 0,
        "estimated_row_bytes": memory.estimate.per_row_bytes if memory.estimate else 0,
        "measured_fixed_bytes": memory.measured.fixed_bytes if memory.measured else 0,
        "measured_row_bytes": memory.measured.per_row_bytes if memory.measured else 0,
    }


def watermark_fields(state: WatermarkState | None) -> dict[str, Any]:
    if state is None:
        return {}
    return {
        "memory_used_bytes": state.used_bytes or 0,
        "memory_high_watermark_bytes": state.high_bytes,
        "memory_low_watermark_bytes": state.low_bytes,
        "lanes_closed_by_memory": list(state.closed_lanes),
        "memory_watermark_limit_bytes": state.limit_bytes,
    }


def size_summary(sizes: Distribution) -> pb.SizeSummary:
    return pb.SizeSummary(
        count=sizes.count, mean=sizes.mean, p50=sizes.p50, p95=sizes.p95, p99=sizes.p99
    )


def latency_summary(percentiles: Percentiles) -> pb.LatencySummary:
    return pb.LatencySummary(
        count=percentiles.count,
        p50_ms=percentiles.p50_ms,
        p95_ms=percentiles.p95_ms,
        p99_ms=percentiles.p99_ms,
    )
