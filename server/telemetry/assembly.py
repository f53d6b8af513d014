"""`Telemetry`: traces, metrics, the endpoint and event logs assembled for one server."""

from __future__ import annotations

import logging
import os
import ssl
import threading
import uuid
from collections.abc import Callable, Sequence

import grpc
import prometheus_client
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader

# The tracing SDK reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT as it is imported, into a constant
# it keeps for backward compatibility and never reads, and a value it cannot take (not a
# non-negative integer, nor blank) failed the import: every `laneserve` command,
# `--help` too, ended in its traceback. Such a value, and only such a one (the
# environment is the process's, read meanwhile by other threads: an embedding
# application's, gRPC's, the runtime's), is kept out of the environment while it is
# imported; the limit that applies is read where every span limit is, as a tracer
# provider is built, and refused there as a start-up error when tracing is on
# (`tracer_provider_from_env`). This must stay the process's first import of
# opentelemetry.sdk.trace (the package's __init__ imports this module first; the modules
# below import it too).
try:
    _SET_TO = os.environ.get("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "")
    _READ_AS = _SET_TO.strip().lower()
    try:  # the SDK's rule: blank (unset, or not set), or an integer not below 0
        _TAKEN_OUT = _READ_AS != "" and int(_READ_AS) < 0
    except ValueError:
        _TAKEN_OUT = True
    if _TAKEN_OUT:
        del os.environ["OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT"]
    from opentelemetry.sdk.trace import TracerProvider
finally:
    if _TAKEN_OUT:
        os.environ["OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT"] = _SET_TO

from laneserve.server.config import LaneConfig, ServerConfig
from laneserve.server.events import SchedulerEvents
from laneserve.server.telemetry.device import DeviceMonitor
from laneserve.server.telemetry.endpoint import MetricsEndpoint
from laneserve.server.telemetry.environment import resource_from_env, tracer_provider_from_env
from laneserve.server.telemetry.logs import GRPC_PER_CALL_LOGGER, EventLog, UnsentAnswers
from laneserve.server.telemetry.metrics import Metrics, MetricSources
from laneserve.server.telemetry.server_spans import HttpServerSpans, ServerSpans
from laneserve.server.telemetry.tracing import BatchLinkSampler, RatioSampler, Tracing

# How long stopping waits for the spans still to export: an exporter retries an
# unreachable collector for its own timeout (OTLP: 10 s, and backoff), which held every
# stop, a second signal's too. Spans not exported by then are dropped, and logged.
SPAN_FLUSH_S = 2.0

log = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "laneserve"


class Telemetry:
    """Everything in this package for one server: build it, hand its parts to the server, close it.

    telemetry = Telemetry.from_config(config, engine.providers)
    sinks = telemetry.events                 # SchedulerEvents sinks
    tracer = telemetry.tracing               # RequestTracer, or None: tracing off
    interceptors = telemetry.interceptors    # for grpc.aio.server
    telemetry.observe(MetricSources(thread.depths, ...))  # what the gauges read
    servicer = InferenceServicer(..., instance_id=telemetry.instance_id)
    port = telemetry.serve_metrics(host, config.metrics_port)
    ...
    telemetry.close()
    """

    def __init__(  # noqa: PLR0913 - keyword-only, one per part it assembles
        self,
        *,
        lanes: Sequence[LaneConfig],
        providers: Sequence[str],
        max_batch_size: int,
        tracer_provider: TracerProvider | None = None,
        metric_readers: Sequence[MetricReader] = (),
        prometheus: bool = False,
        owns_tracer_provider: bool = False,
        device: DeviceMonitor | None = None,
        instance_id: str | None = None,
    ) -> None:
        """`tracer_provider` None: tracing off. `metric_readers` and, with `prometheus`,
        a Prometheus reader collect the metrics; with neither, no metric is recorded.
        `instance_id`: this server's (a new one by default), see `instance_id`."""
        # Which server this is, made once per server: GetStats' instance_id and the
        # metrics' service.instance.id (Prometheus' target_info), unless
        # OTEL_RESOURCE_ATTRIBUTES names the instance (see `resource_from_env`).
        self.instance_id = instance_id or new_instance_id()
        self._tracer_provider = tracer_provider
        self._owns_tracer_provider = owns_tracer_provider
        self._device = device
        self._endpoint: MetricsEndpoint | None = None
        self.event_log = EventLog(max_batch_size=max_batch_size)
        self.events: list[SchedulerEvents] = [self.event_log]
        # gRPC's ERROR record of each answer it could not send becomes a count in the
        # event log's answers_unsent line, from `count_unsent_answers` (as the server
        # starts) until `close`.
        self.unsent_answers = UnsentAnswers(self.event_log)
        readers = list(metric_readers)
        self._registry: prometheus_client.CollectorRegistry | None = None
        if prometheus:
            # Imported here: its module registers nothing, but the exporter package is
            # only needed by processes that serve the endpoint.
            from opentelemetry.exporter.prometheus import PrometheusMetricReader  # noqa: PLC0415

            # A registry per server: several servers in one process (tests) must not
            # mix their figures in the default one.
            self._registry = prometheus_client.CollectorRegistry(auto_describe=True)
            readers.append(PrometheusMetricReader(registry=self._registry))
            # The process's own figures (open files against their limit, resident memory,
            # CPU): the open-file limit ran out under idle connections with nothing on
            # the endpoint to tell it (a review). prometheus_client's, standard names.
            prometheus_client.ProcessCollector(registry=self._registry)
        self._meter_provider: MeterProvider | None = None
        self.metrics: Metrics | None = None
        if readers:
            # Closed by `close`; no exit hook, so servers in tests leave nothing behind.
            self._meter_provider = MeterProvider(
                metric_readers=readers,
                resource=resource_from_env(self.instance_id),
                shutdown_on_exit=False,
                # Exemplars would look up the current span on every measurement.
                exemplar_filter=AlwaysOffExemplarFilter(),
            )
            self.metrics = Metrics(
                self._meter_provider.get_meter(INSTRUMENTATION_NAME), lanes, device, providers
            )
            self.events.append(self.metrics)
        self.tracing: Tracing | None = None
        self.interceptors: list[grpc.aio.ServerInterceptor] = []
        self.http_spans: HttpServerSpans | None = None  # KServe v2 HTTP's inference calls
        # The root sampler that Triton's TraceSetting reads and changes (settings.py):
        # the provider's where laneserve built it (`tracer_provider_from_env`); None with
        # tracing off, or a provider given with a sampler of its own.
        self.root_sampler: RatioSampler | None = None
        if tracer_provider is not None:
            sampler = tracer_provider.sampler
            if isinstance(sampler, BatchLinkSampler):
                self.root_sampler = sampler.root
            tracer = tracer_provider.get_tracer(INSTRUMENTATION_NAME)
            self.tracing = Tracing(tracer, providers)
            self.events.append(self.tracing)
            self.interceptors.append(ServerSpans(tracer))
            self.http_spans = HttpServerSpans(tracer)

    @classmethod
    def from_config(cls, config: ServerConfig, providers: Sequence[str]) -> Telemetry:
        """Tracing from the OTEL_* variables; Prometheus unless metrics_port is -1."""
        instance_id = new_instance_id()  # the spans' resource's too
        tracer_provider = tracer_provider_from_env(instance_id=instance_id)
        return cls(
            lanes=config.lanes,
            providers=providers,
            max_batch_size=config.max_batch_size,
            tracer_provider=tracer_provider,
            owns_tracer_provider=tracer_provider is not None,
            prometheus=config.metrics_port >= 0,
            device=DeviceMonitor.open(providers),
            instance_id=instance_id,
        )

    def observe(self, sources: MetricSources) -> None:
        """Where the gauges read lane depths, the batch cap, the watermark and the
        lifecycle state, and the counters their counts (the stats recorder's, which
        GetStats reports too), gRPC's own call counts (None until the gRPC server runs)
        and the idempotency ledger's joins, replays and replay cache (None until the
        servicer exists), and the shared memory registry's regions and bytes (None
        while shared memory is off)."""
        if self.metrics is not None:
            self.metrics.observe(sources)

    def count_unsent_answers(
        self, services: Sequence[str], inference_methods: Sequence[str]
    ) -> None:
        """Takes gRPC's records of answers of `services` it could not send
        (`UnsentAnswers`) from here until `close`: installed as the server starts, not as
        this object is made, so that one never closed (a server that never started) takes
        no later server's."""
        self.unsent_answers.watch(services, inference_methods)
        logging.getLogger(GRPC_PER_CALL_LOGGER).addFilter(self.unsent_answers)

    def serve_metrics(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int | None:
        """Starts the Prometheus endpoint (HTTPS with `tls`); returns its port (None: not
        configured)."""
        if self._registry is None or port < 0:
            return None
        self._endpoint = MetricsEndpoint(self._registry, host, port, tls)
        return self._endpoint.port

    def device_utilization(self) -> float | None:
        return None if self._device is None else self._device.utilization()

    def close(self) -> None:
        """Flushes spans and the refusal log, stops the endpoint. Call once, at stop."""
        logging.getLogger(GRPC_PER_CALL_LOGGER).removeFilter(self.unsent_answers)
        self.event_log.close()
        if self.tracing is not None:
            self.tracing.close()
        if self._tracer_provider is not None:
            provider = self._tracer_provider
            _within(
                SPAN_FLUSH_S,
                provider.shutdown if self._owns_tracer_provider else provider.force_flush,
                "exporting the last spans",
            )
        if self._endpoint is not None:
            self._endpoint.close()
        if self._meter_provider is not None:
            self._meter_provider.shutdown()
        if self._device is not None:
            self._device.close()


def new_instance_id() -> str:
    """A random id for one server's run (a UUID v4, as the SDK's own service.instance.id)."""
    return str(uuid.uuid4())


def _within(limit_s: float, work: Callable[[], object], what: str) -> None:
    """Runs `work`, waiting for it at most `limit_s`: past that it goes on, on a daemon
    thread the process does not wait for at exit, and the wait is logged."""
    done = threading.Thread(target=work, name="laneserve-telemetry-flush", daemon=True)
    done.start()
    done.join(limit_s)
    if done.is_alive():
        log.warning(
            "%s took over %.1f s (a collector unreachable?): stopping without waiting; "
            "spans not yet exported are dropped",
            what,
            limit_s,
        )
