"""The Open Inference Protocol (KServe v2) over gRPC: service
`inference.GRPCInferenceService`, served on every port beside laneserve.v1, so that a
Triton or KServe client (tritonclient.grpc, any stub generated from grpc_predict_v2.proto)
calls laneserve unchanged.

A front end only: ModelInfer converts its request to laneserve's own `InferRequest` and
runs it through Infer's path (`InferenceServicer.run_request`), so lanes, deadlines,
idempotency (where the request asks: `kserve_convert.IDEMPOTENT_PARAMETER`), shedding,
memory limits, tracing, stats and error statuses are Infer's; the answer is converted
back. ModelStreamInfer is InferStream's mechanism (`InferenceServicer.serve_stream`) with
ModelInfer's items and answers (`kserve_convert.ModelStreamWire`). The metadata,
configuration, statistics, liveness, repository, shared memory and settings calls are
operator calls, counted apart from the inference calls as GetModel is
(`add_kserve_to_server`); the settings calls, Triton's LogSettings and TraceSetting, read
and change laneserve's log threshold and trace sampling (server/settings.py).

The messages are converted both ways by `kserve_convert`, which gives the mapping.

Every refusal is a LaneserveError, and reaches the caller as Infer's refusals do
(`grpc_methods.abort_with`: status, ErrorInfo, pushback).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Final, NoReturn, TypeVar

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2

from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.server.config import ServerConfig
from laneserve.server.engine import TensorSpec
from laneserve.server.errors import (
    InvalidInputError,
    LaneserveError,
    ModelNotFoundError,
    RegionNotFoundError,
    SharedMemoryRefusedError,
    UnsupportedError,
)
from laneserve.server.grpc_accept import CallGate
from laneserve.server.grpc_methods import HANDLER_KINDS, abort_with, release_frames
from laneserve.server.kserve_config import PLATFORM, extensions, model_config, model_statistics
from laneserve.server.kserve_convert import (
    MODEL_VERSION,
    ModelInferCall,
    ModelStreamItem,
    ModelStreamWire,
    OversizedModelInfer,
    answer_extra_bytes,
    asks_idempotency,
    kserve_datatype,
    placed_outputs,
    read_model_infer,
    read_operator_call,
    request_parameters,
    stream_wrapper_bytes,
    to_infer_request,
    to_model_infer_response,
    unreadable,
)
from laneserve.server.model_identity import SERVER_VERSION
from laneserve.server.service import InferenceServicer
from laneserve.server.settings import TraceSettings, change_log_settings
from laneserve.server.shared_memory import CallerRegions, SharedMemoryRegions
from laneserve.server.stats import Cumulative
from laneserve.v1 import inference_pb2 as pb

SERVICE_NAME: Final = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
SERVER_NAME: Final = "laneserve"
# The inference methods, ModelInfer and the stream of ModelInfer requests; every other
# method of the service is an operator call.
INFER_METHOD: Final = "ModelInfer"
STREAM_METHOD: Final = "ModelStreamInfer"


# ---- the servicer ---------------------------------------------------------------------------

_Result = TypeVar("_Result")


async def _answered(
    context: grpc.aio.ServicerContext[Any, Any], act: Callable[[], _Result]
) -> _Result:
    """`act()`'s answer; its LaneserveError aborts the call with it."""
    try:
        return act()
    except LaneserveError as error:
        await abort_with(context, error)
        raise AssertionError("unreachable: abort raises") from None


# RepositoryIndex's reason for a model not READY: the server is not (health NOT_SERVING).
NOT_READY_REASON: Final = (
    "the server is not ready: starting, in a stop signal's drain delay, or draining"
)


class KServeServicer:
    """inference.GRPCInferenceService in front of one InferenceServicer (one per port,
    all in front of the same lanes). Stateless: readiness is read from the gRPC health
    service (`health`), inference is `inference`'s."""

    def __init__(  # noqa: PLR0913 - one per part of the server it fronts
        self,
        inference: InferenceServicer,
        config: ServerConfig,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        health_servicer: health.aio.HealthServicer,
        *,
        totals: Callable[[], Cumulative],
        gpu_id: int | None,
        regions: SharedMemoryRegions,
        trace_settings: TraceSettings,
    ) -> None:
        """`totals`: the stats recorder's (`StatsRecorder.cumulative`), which
        ModelStatistics reports. `gpu_id`: the CUDA device the session runs on, None on
        the CPU (ModelConfig's instance_group). `regions`: the server's shared memory
        regions (every port's). `trace_settings`: the server's sampling, which
        TraceSetting reads and changes (every port's)."""
        self._inference = inference
        self._model_name = config.served_model_name
        self._lanes = [lane.name for lane in config.lanes]  # highest priority first
        self._inputs = tuple(inputs)
        self._outputs = tuple(outputs)
        self._health = health_servicer
        self._totals = totals
        self._regions = regions
        self._trace_settings = trace_settings
        self._max_message_bytes = config.max_message_bytes
        # The configuration does not change while the server runs: built once.
        self._config_response = kpb.ModelConfigResponse(
            config=model_config(config, inputs, outputs, gpu_id=gpu_id)
        )
        # The largest of its envelopes, ModelStreamInfer's: a ModelInferResponse wrapped.
        self._answer_extra_bytes = answer_extra_bytes(self._model_name, outputs, self._lanes)
        inference.widen_answer_envelope(
            self._answer_extra_bytes + stream_wrapper_bytes(config.max_message_bytes)
        )

    @property
    def max_inputs(self) -> int:
        return len(self._inputs)

    @property
    def input_specs(self) -> tuple[TensorSpec, ...]:
        """The model's inputs, for a refusal that names a request's (HTTP's, read apart)."""
        return self._inputs

    @property
    def max_outputs(self) -> int:
        return len(self._outputs)

    async def ServerLive(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.ServerLiveResponse:
        await _refuse_unreadable(request, "ServerLive", context)
        return kpb.ServerLiveResponse(live=True)  # it answers: it lives

    async def ServerReady(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.ServerReadyResponse:
        await _refuse_unreadable(request, "ServerReady", context)
        return kpb.ServerReadyResponse(ready=await self._ready(context))

    async def ModelReady(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.ModelReadyResponse:
        """Whether the model and version asked for are ready: the served one's readiness
        is the server's (`_ready`); any other name or version is not ready.

        ModelReady answers readiness, never an error, for a request that parses: a model
        or version not served is ready=false with status OK, as a Triton server answers
        over gRPC (its core's TRITONSERVER_ServerModelIsReady reports a model or version
        it cannot find as not ready), so a Triton client that polls several names
        (tritonclient's is_model_ready) reads False rather than raising. Nothing is
        refused, so nothing is counted. The other Model* calls name a model to act on,
        and refuse one not served NOT_FOUND (`check_served`)."""
        await _refuse_unreadable(request, "ModelReady", context)
        assert isinstance(request, kpb.ModelReadyRequest)
        if not self.serves(request.name, request.version):
            return kpb.ModelReadyResponse(ready=False)
        return kpb.ModelReadyResponse(ready=await self._ready(context))

    async def ServerMetadata(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.ServerMetadataResponse:
        await _refuse_unreadable(request, "ServerMetadata", context)
        return kpb.ServerMetadataResponse(
            name=SERVER_NAME, version=SERVER_VERSION, extensions=extensions(self._regions.enabled)
        )

    async def ModelMetadata(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.ModelMetadataResponse:
        await _refuse_unreadable(request, "ModelMetadata", context)
        assert isinstance(request, kpb.ModelMetadataRequest)
        await self.abort_unless_served(request.name, request.version, context)
        return kpb.ModelMetadataResponse(
            name=self._model_name,
            versions=[MODEL_VERSION],
            platform=PLATFORM,
            inputs=[_tensor_metadata(spec) for spec in self._inputs],
            outputs=[_tensor_metadata(spec) for spec in self._outputs],
        )

    async def ModelConfig(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.ModelConfigResponse:
        """Triton's model configuration extension (`kserve_config.model_config`)."""
        await _refuse_unreadable(request, "ModelConfig", context)
        assert isinstance(request, kpb.ModelConfigRequest)
        await self.abort_unless_served(request.name, request.version, context)
        return self._config_response

    async def ModelStatistics(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.ModelStatisticsResponse:
        """Triton's statistics extension (`kserve_config.model_statistics`): name ""
        asks for every model's, the one served."""
        await _refuse_unreadable(request, "ModelStatistics", context)
        assert isinstance(request, kpb.ModelStatisticsRequest)
        await self.abort_unless_served(request.name or self._model_name, request.version, context)
        statistics = model_statistics(self._model_name, MODEL_VERSION, self._totals(), time.time())
        return kpb.ModelStatisticsResponse(model_stats=[statistics])

    async def ModelInfer(
        self,
        request: ModelInferCall | OversizedModelInfer,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> kpb.ModelInferResponse:
        try:
            return await self._model_infer(request, context)
        except LaneserveError as error:
            refusal = error
        # Nothing of the request stays reachable from the abort (see `abort_with`).
        del request
        await abort_with(context, release_frames(refusal))
        raise AssertionError("unreachable: abort raises")

    async def refuse_unconverted(
        self,
        refusal: LaneserveError,
        context: grpc.aio.ServicerContext[Any, Any],
        parameters: Mapping[str, kpb.InferParameter],
    ) -> NoReturn:
        """Refuses a request another wire could not read into a ModelInferRequest (KServe
        v2's HTTP JSON, `kserve_http`), counted as ModelInfer counts a refusal
        (`InferenceServicer.run_request`) in the lane its `parameters` (as far as they
        were read) name, where they name one, else in the default lane, and aborted
        with it."""
        try:
            lane, _ = request_parameters(parameters, self._lanes)
        except InvalidInputError:
            lane = ""  # its parameters' own fault is not the one refused: none named
        try:
            await self._inference.run_request(refusal, context, idempotent=False, lane=lane)
        except LaneserveError as error:
            refusal = error
        await abort_with(context, release_frames(refusal))
        raise AssertionError("unreachable: abort raises")

    def ModelStreamInfer(
        self,
        requests: AsyncIterator[ModelStreamItem],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[kpb.ModelStreamInferResponse]:
        """Triton's stream (tritonclient's start_stream and async_stream_infer, its asyncio
        stream_infer, perf_analyzer --streaming): InferStream's own mechanism
        (`InferenceServicer.serve_stream`: credit window, waiting for room in a full lane,
        answers out of order by id and those of items without an id in their order, one
        per item, errors per item, cancel, drain, receive limit, the bulk lane by default),
        each item converted as ModelInfer's request and answered as a
        ModelStreamInferResponse (`ModelStreamWire`)."""
        wire = ModelStreamWire(
            functools.partial(self._converted, shared=self._shared(context)),
            self._model_name,
            self._answer_extra_bytes,
            self._regions,
            self.max_outputs,
        )
        return self._inference.serve_stream(requests, context, wire)

    async def _model_infer(
        self,
        request: ModelInferCall | OversizedModelInfer,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> kpb.ModelInferResponse:
        # Read before the conversion lets go of the message (an unreadable one asks nothing).
        idempotent = isinstance(request, ModelInferCall) and asks_idempotency(request.message)
        placed = placed_outputs(request, self._regions, self.max_outputs)
        converted = self._converted(request, shared=self._shared(context))
        del request  # the converted request holds what runs
        answer = await self._inference.run_request(converted, context, idempotent=idempotent)
        # Its id is the request's: its request_id whether or not it keys the ledger.
        return to_model_infer_response(answer, self._model_name, placed)

    def _shared(self, context: grpc.aio.ServicerContext[Any, Any]) -> CallerRegions:
        return CallerRegions(self._regions, context.peer(), self._max_message_bytes)

    def _converted(
        self, request: ModelInferCall | OversizedModelInfer, *, shared: CallerRegions
    ) -> pb.InferRequest | LaneserveError:
        """`request` as laneserve's InferRequest, or its refusal (counted by the caller, as
        Infer's refusals are: `InferenceServicer.run_request`). Raises ModelNotFoundError,
        counted nowhere: a call for another model is no request to this one."""
        refusal = unreadable(request, INFER_METHOD)
        if refusal is not None:
            return refusal
        assert isinstance(request, ModelInferCall)
        try:
            self.check_served(request.message.model_name, request.message.model_version)
            return to_infer_request(request, self._lanes, self._inputs, self._outputs, shared)
        except (InvalidInputError, RegionNotFoundError, SharedMemoryRefusedError) as error:
            return error
        finally:
            request.release()  # gRPC holds it until the call ends

    async def RepositoryIndex(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.RepositoryIndexResponse:
        """Triton's model repository index: the one model served, READY while the server
        is ready (`ready` true asks for ready models only)."""
        await _refuse_unreadable(request, "RepositoryIndex", context)
        assert isinstance(request, kpb.RepositoryIndexRequest)
        if request.repository_name:
            await abort_with(
                context,
                InvalidInputError(
                    f"repository {request.repository_name!r} is not here; expected '' "
                    f"(laneserve serves one model, {self._model_name!r}, from no named "
                    "repository)"
                ),
            )
        ready = await self._ready(context)
        if request.ready and not ready:
            return kpb.RepositoryIndexResponse()
        model = kpb.RepositoryIndexResponse.ModelIndex(
            name=self._model_name,
            version=MODEL_VERSION,
            state="READY" if ready else "UNAVAILABLE",
            reason="" if ready else NOT_READY_REASON,
        )
        return kpb.RepositoryIndexResponse(models=[model])

    async def RepositoryModelLoad(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.RepositoryModelLoadResponse:
        await _refuse_unreadable(request, "RepositoryModelLoad", context)
        await abort_with(context, self._fixed_model("loads"))
        raise AssertionError("unreachable: abort raises")

    async def RepositoryModelUnload(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.RepositoryModelUnloadResponse:
        await _refuse_unreadable(request, "RepositoryModelUnload", context)
        await abort_with(context, self._fixed_model("unloads"))
        raise AssertionError("unreachable: abort raises")

    def _fixed_model(self, verb: str) -> UnsupportedError:
        return UnsupportedError(
            f"laneserve {verb} no model while it serves: its one model ({self._model_name!r}) "
            "is loaded at start and served until the process stops; expected another "
            "server process for another model (model control mode NONE, in Triton's terms)"
        )

    async def SystemSharedMemoryStatus(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.SystemSharedMemoryStatusResponse:
        await _refuse_unreadable(request, "SystemSharedMemoryStatus", context)
        assert isinstance(request, kpb.SystemSharedMemoryStatusRequest)
        regions = await self._on_regions(context, lambda held: held.status(request.name))
        response = kpb.SystemSharedMemoryStatusResponse()
        for region in regions:
            status = response.regions[region.name]
            status.name, status.key = region.name, region.key
            status.offset, status.byte_size = region.offset, region.byte_size
        return response

    async def SystemSharedMemoryRegister(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.SystemSharedMemoryRegisterResponse:
        await _refuse_unreadable(request, "SystemSharedMemoryRegister", context)
        assert isinstance(request, kpb.SystemSharedMemoryRegisterRequest)
        await self._on_regions(
            context,
            lambda held: held.register(
                request.name, request.key, request.offset, request.byte_size
            ),
        )
        return kpb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.SystemSharedMemoryUnregisterResponse:
        await _refuse_unreadable(request, "SystemSharedMemoryUnregister", context)
        assert isinstance(request, kpb.SystemSharedMemoryUnregisterRequest)
        await self._on_regions(context, lambda held: held.unregister(request.name))
        return kpb.SystemSharedMemoryUnregisterResponse()

    async def _on_regions(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        act: Callable[[SharedMemoryRegions], _Result],
    ) -> _Result:
        """`act` on the server's regions, for a caller that may use them; the caller's
        refusal (`check_peer`) or `act`'s aborts the call."""

        def checked() -> _Result:
            self._regions.check_peer(context.peer())
            return act(self._regions)

        return await _answered(context, checked)

    async def CudaSharedMemoryStatus(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.CudaSharedMemoryStatusResponse:
        """No CUDA region is ever registered: none to list, and a name is none of them."""
        await _refuse_unreadable(request, "CudaSharedMemoryStatus", context)
        assert isinstance(request, kpb.CudaSharedMemoryStatusRequest)
        if request.name:
            await abort_with(
                context,
                RegionNotFoundError(
                    f"no CUDA shared memory region {request.name!r} is registered; expected "
                    "none (laneserve registers no CUDA region: CudaSharedMemoryRegister is "
                    "refused)"
                ),
            )
        return kpb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.CudaSharedMemoryRegisterResponse:
        await _refuse_unreadable(request, "CudaSharedMemoryRegister", context)
        await abort_with(
            context,
            UnsupportedError(
                "laneserve maps no CUDA memory of another process (CUDA IPC); expected "
                "system shared memory (SystemSharedMemoryRegister) from a caller on this "
                "host, or the tensors' bytes in the request"
            ),
        )
        raise AssertionError("unreachable: abort raises")

    async def CudaSharedMemoryUnregister(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.CudaSharedMemoryUnregisterResponse:
        """Nothing to let go of: no CUDA region is ever registered (as Triton's server,
        a name not registered is no error)."""
        await _refuse_unreadable(request, "CudaSharedMemoryUnregister", context)
        return kpb.CudaSharedMemoryUnregisterResponse()

    async def LogSettings(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.LogSettingsResponse:
        """Triton's logging extension: the log threshold, read by anyone, changed by a
        caller on this host (`settings.change_log_settings`)."""
        await _refuse_unreadable(request, "LogSettings", context)
        assert isinstance(request, kpb.LogSettingsRequest)
        return await _answered(context, lambda: change_log_settings(request, context.peer()))

    async def TraceSetting(
        self, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kpb.TraceSettingResponse:
        """Triton's trace extension: the trace sampling, read by anyone, changed by a
        caller on this host while tracing is on (`settings.TraceSettings`)."""
        await _refuse_unreadable(request, "TraceSetting", context)
        assert isinstance(request, kpb.TraceSettingRequest)
        return await _answered(
            context, lambda: self._trace_settings.answer(request, context.peer())
        )

    def serves(self, name: str, version: str) -> bool:
        """Whether `name` and `version` are the served model's: its name, version "" (the
        server's choice) or MODEL_VERSION."""
        return name == self._model_name and version in ("", MODEL_VERSION)

    def check_served(self, name: str, version: str) -> None:
        """Raises ModelNotFoundError unless `name` and `version` are the served model's
        (`serves`), saying which of the two is not."""
        if self.serves(name, version):
            return
        if name != self._model_name:
            raise ModelNotFoundError(
                f"model {name!r} is not served here; expected {self._model_name!r}, the one "
                f"model this server serves (server.model_name, --model-name)"
            )
        raise ModelNotFoundError(
            f"model {name!r} has no version {version!r} here; expected "
            f"{MODEL_VERSION!r} or empty (this server serves one version)"
        )

    async def abort_unless_served(
        self, name: str, version: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Aborts `context` with `check_served`'s refusal where `name` and `version` are
        not the served model's."""
        try:
            self.check_served(name, version)
        except ModelNotFoundError as error:
            await abort_with(context, error)

    async def _ready(self, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        """Whether the gRPC health service says the whole server ("") is SERVING: the one
        place laneserve sets readiness (NOT_SERVING while starting, from a stop signal's
        drain delay on, and while draining). Asked through its own Check, which aborts
        `context` only for a service it does not know (never "": set at start)."""
        answer = await self._health.Check(health_pb2.HealthCheckRequest(service=""), context)
        return answer.status == health_pb2.HealthCheckResponse.SERVING


async def _refuse_unreadable(
    request: object, method: str, context: grpc.aio.ServicerContext[Any, Any]
) -> None:
    refusal = unreadable(request, method)
    if refusal is not None:
        await abort_with(context, refusal)


def _tensor_metadata(spec: TensorSpec) -> kpb.ModelMetadataResponse.TensorMetadata:
    return kpb.ModelMetadataResponse.TensorMetadata(
        name=spec.name, datatype=kserve_datatype(spec.dtype), shape=spec.shape
    )


def add_kserve_to_server(
    servicer: KServeServicer, server: grpc.aio.Server, gate: CallGate
) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """Registers inference.GRPCInferenceService on `server`, as `grpc_methods.add_to_server`
    registers laneserve.v1: ModelInfer counted by the port's `gate` as an inference call
    (refused over max_concurrent_rpcs before its message is parsed), its request read as
    Infer's is (undecodable: INVALID_ARGUMENT; more than MAX_EXTRA_BYTES besides the
    tensors' data: refused); ModelStreamInfer counted as InferStream is (a stream, within
    the streams' half of the calls), each item read as ModelInfer's request is, within its
    call; every other method an operator call, counted apart as
    GetModel is and read only up to MAX_OPERATOR_REQUEST_BYTES. Returns the handlers by
    full method name ("/inference.GRPCInferenceService/ModelInfer"), for the port's
    acceptors."""
    service = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        # Unary, but for the stream, which streams both ways.
        streams = method.client_streaming
        assert streams == method.server_streaming == (method.name == STREAM_METHOD), method.name
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        read: Callable[[bytes], Any]
        if method.name in (INFER_METHOD, STREAM_METHOD):
            read = functools.partial(
                read_model_infer, max_inputs=servicer.max_inputs, max_outputs=servicer.max_outputs
            )
            if not streams:  # a stream's items are read within its call
                read = gate.deserializer(read)
            behavior = gate.gate(behavior, response_streaming=streams)
        else:
            read = gate.operator_deserializer(
                functools.partial(read_operator_call, request_type, method.name)
            )
            behavior = gate.gate_operator(behavior)
        handlers[method.name] = HANDLER_KINDS[method.client_streaming, method.server_streaming](
            behavior,
            request_deserializer=read,
            response_serializer=response_type.SerializeToString,
        )
    # As a generated add_*Servicer_to_server adds them: registered, and generic for the rest.
    generic = grpc.method_handlers_generic_handler(service.full_name, handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(service.full_name, handlers)
    return {f"/{service.full_name}/{name}": handler for name, handler in handlers.items()}
