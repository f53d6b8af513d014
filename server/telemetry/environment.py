"""The tracer provider and the resource that the standard `OTEL_*` variables ask for.

Tracing is off unless `OTEL_TRACES_EXPORTER` names an exporter (see
`tracer_provider_from_env`); the resource names the service in traces and metrics alike.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import os
import threading
from collections.abc import Iterator, Mapping

from opentelemetry.sdk.environment_variables import OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler

from laneserve.server.config import ConfigError
from laneserve.server.telemetry.tracing import BatchLinkSampler, RatioSampler, Sampling


def _exporter_entry_point(name: str, environ: Mapping[str, str]) -> tuple[str, str]:
    """The entry point in `opentelemetry_traces_exporter` for an OTEL_TRACES_EXPORTER name,
    and the package that provides it."""
    if name != "otlp":
        package = {
            "otlp_proto_grpc": "opentelemetry-exporter-otlp-proto-grpc",
            "otlp_proto_http": "opentelemetry-exporter-otlp-proto-http",
        }.get(name, f"the package that provides the {name!r} exporter")
        return name, package
    key = (
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
        if environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        else "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    protocol = (environ.get(key) or "grpc").strip()
    if protocol == "grpc":
        return "otlp_proto_grpc", "opentelemetry-exporter-otlp-proto-grpc"
    if protocol == "http/protobuf":
        return "otlp_proto_http", "opentelemetry-exporter-otlp-proto-http"
    raise ConfigError(f"{key}: expected grpc or http/protobuf, got {protocol!r}")


# The OTLP exporters' deadline for each export, in seconds (read with float(), the
# signal's own variable first; an unset or 0 one falls through to the next).
_OTLP_TIMEOUTS = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")


def _check_otlp_timeouts(environ: Mapping[str, str]) -> None:
    """The exporters take any float as their timeout: a negative number or nan made every
    export's deadline one already passed (each batch of spans dropped), and so did 0 in
    OTEL_EXPORTER_OTLP_TIMEOUT (in the traces variable 0 silently meant the other's);
    inf, a deadline never reached. What float() cannot read the exporter refuses itself."""
    for key in _OTLP_TIMEOUTS:
        text = environ.get(key, "").strip()
        try:
            seconds = float(text)
        except ValueError:
            continue
        if not 0 < seconds < math.inf:
            raise ConfigError(
                f"{key} is {text!r}; expected a positive number of seconds (the OTLP "
                "exporter's deadline for each export)"
            )
        return  # the one the exporter reads: the other, if set, it never reads


def _load_exporter(name: str, environ: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    entry_name, package = _exporter_entry_point(name, environ)
    if entry_name.startswith("otlp"):
        _check_otlp_timeouts(environ)
    found = importlib.metadata.entry_points(group="opentelemetry_traces_exporter", name=entry_name)
    if not found:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={name}: no span exporter {entry_name!r} is installed; "
            f"install {package}, or set OTEL_TRACES_EXPORTER to console or none"
        )
    exporter_class = next(iter(found)).load()
    try:
        exporter = exporter_class()
    except Exception as error:  # e.g. OTEL_EXPORTER_OTLP_TIMEOUT=x (a ValueError that does
        # not name it), OTEL_EXPORTER_OTLP_COMPRESSION=bogus (an exception of the exporter's
        # own): whatever the exporter refuses in its settings ends the start as a ConfigError
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={name}: the exporter refused its OTEL_EXPORTER_* "
            f"settings: {error}; expected values it can read"
        ) from error
    if not isinstance(exporter, SpanExporter):
        raise ConfigError(f"OTEL_TRACES_EXPORTER={name}: {exporter_class!r} is not a span exporter")
    return exporter


def tracer_provider_from_env(
    environ: Mapping[str, str] | None = None, instance_id: str | None = None
) -> TracerProvider | None:
    """The tracer provider the standard variables ask for, or None: tracing off.

    `OTEL_TRACES_EXPORTER`: comma-separated exporters, `none` (the default here, unlike
    the SDK's own), `console`, `otlp` (protocol from `OTEL_EXPORTER_OTLP_PROTOCOL`, grpc
    by default; endpoint, headers and the rest from `OTEL_EXPORTER_OTLP_*`, read by the
    exporter itself) or any installed exporter's entry point name. `OTEL_SDK_DISABLED=true`
    turns tracing off. Sampling: `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`, its
    root ratio a `RatioSampler` that Triton's TraceSetting changes while the server runs
    (the provider's `BatchLinkSampler.root`); batch spans are sampled whenever a request
    they serve is, with their `infer` child (see `BatchLinkSampler`). `instance_id`: the
    resource's service.instance.id (see `resource_from_env`).
    """
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [
        name.strip().lower()
        for name in environ.get("OTEL_TRACES_EXPORTER", "none").split(",")
        if name.strip()
    ]
    names = [name for name in names if name != "none"]
    if not names:
        return None
    # The exporters read their settings (OTEL_EXPORTER_*) as they are built; span limits
    # (OTEL_SPAN_*_LIMIT, ...), the sampler (OTEL_TRACES_SAMPLER[_ARG]) and batch settings
    # (OTEL_BSP_*) are read by the provider and processors. A ValueError names the
    # variable, or the setting; what is only warned of comes in `complaints`. (The SDK
    # reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT as it is imported too: see assembly.py.)
    with _sdk_complaints() as complaints:
        exporters = _load_exporters(names, environ)
        try:
            provider = TracerProvider(resource=resource_from_env(instance_id))
            processors = [BatchSpanProcessor(exporter) for exporter in exporters]
        except ValueError as error:
            for exporter in exporters:
                exporter.shutdown()
            raise _refused(str(error)) from error
    if complaints:
        for processor in processors:
            processor.shutdown()  # type: ignore[no-untyped-call]  # its exporter too
        raise _refused(" ".join(complaints))
    # The sampler the variables chose, with a root whose ratio TraceSetting changes,
    # wrapped before any tracer exists (tracers copy it).
    inner, root = _settable_sampler(provider.sampler)
    provider.sampler = BatchLinkSampler(inner, root=root)
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


def _settable_sampler(built: Sampler) -> tuple[Sampler, RatioSampler]:
    """The sampler OTEL_TRACES_SAMPLER[_ARG] chose (`built`, the SDK's), rebuilt with a
    `RatioSampler` at its root: the same decisions, and a ratio TraceSetting changes.
    Read from the variables as the SDK reads them, from the process's environment (a
    parent-based sampler's root, whose ratio this needs, is the SDK's private `_root`),
    once the SDK took them: a sampler name it does not
    know, or an argument it cannot read as a ratio from 0 to 1, was a warning
    (`_Complaints`), and the start refused. An empty argument is the SDK's 1.0."""
    name = os.environ.get(OTEL_TRACES_SAMPLER, "parentbased_always_on").lower()
    if name.endswith("always_on"):
        ratio = 1.0
    elif name.endswith("always_off"):
        ratio = 0.0
    else:  # traceidratio, parentbased_traceidratio
        argument = os.environ.get(OTEL_TRACES_SAMPLER_ARG, "").strip()
        ratio = float(argument) if argument else 1.0
    root = RatioSampler(Sampling.of_ratio(ratio))
    parent_based = name.startswith("parentbased_")
    # The SDK's reading and this one agree (a sampler it built of another kind: a rule
    # of the SDK's changed, and these decisions would not be the variables').
    assert isinstance(built, ParentBased) == parent_based, (name, built.get_description())
    return (ParentBased(root) if parent_based else root), root


def _load_exporters(names: list[str], environ: Mapping[str, str]) -> list[SpanExporter]:
    """The exporters `names` ask for, in order; when one cannot be built, those built
    before it are shut down (an OTLP exporter holds a gRPC channel) and its error raised."""
    exporters: list[SpanExporter] = []
    try:
        for name in names:  # one at a time, so that a failure leaves those built
            exporters.append(_load_exporter(name, environ))  # noqa: PERF401
    except BaseException:
        for exporter in exporters:
            exporter.shutdown()
        raise
    return exporters


def _refused(what: str) -> ConfigError:
    return ConfigError(
        "tracing's OTEL_* variables (sampler OTEL_TRACES_SAMPLER[_ARG]; span limits "
        "OTEL_SPAN_*, OTEL_ATTRIBUTE_*; batch settings OTEL_BSP_*; resource "
        "OTEL_RESOURCE_ATTRIBUTES; exporter OTEL_EXPORTER_*): the OpenTelemetry SDK "
        f"refused them: {what}; expected values it can read"
    )


class _Complaints(logging.Handler):
    """What the tracing SDK warns of: a value it cannot take is, for some variables, a
    warning and a default (`OTEL_TRACES_SAMPLER_ARG=O.01` traced every request, a sampler
    name misspelt too; `OTEL_BSP_SCHEDULE_DELAY=x` took 5 s), not an error. Not the one
    warning the specification makes a default of: a ratio sampler with no argument is
    sampled at 1.0, and the SDK warns that it could not read the empty argument."""

    def __init__(self, sampler_arg: str) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._sampler_arg = sampler_arg  # stripped; "" when not given

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_NO_SAMPLER_ARG):
            if not self._sampler_arg:
                return
            # The SDK's words ("... Using default rate 1.0.") named neither the value nor
            # what it must be, and told of a default the start refuses to take. It says
            # so of a number outside 0..1 too (its sampler refused it).
            try:
                float(self._sampler_arg)
                what = "outside 0 to 1"
            except ValueError:
                what = "not a number"
            message = (
                f"OTEL_TRACES_SAMPLER_ARG is {self._sampler_arg!r}, {what} (the ratio of "
                "traces sampled, from 0 to 1; the SDK would have traced every request)"
            )
        self.messages.append(message)


# The start of the SDK's warning for an OTEL_TRACES_SAMPLER_ARG it cannot read as a float.
_NO_SAMPLER_ARG = "Could not convert TRACES_SAMPLER_ARG to float"
# One window at a time: each saves and restores the logger's state.
_COMPLAINTS_LOCK = threading.Lock()


# The loggers that warn of a setting taken as a default: the tracing SDK's (sampler, batch
# settings) and the exporters' (OTLP headers, through opentelemetry.util.re). Not the
# metrics SDK's, whose warnings from other threads are none of these.
# And the resource detector's (an OTEL_RESOURCE_ATTRIBUTES item it cannot read, dropped).
_COMPLAINING_LOGGERS = (
    "opentelemetry.sdk.trace",
    "opentelemetry.sdk.resources",
    "opentelemetry.exporter",
    "opentelemetry.util",
)


@contextlib.contextmanager
def _sdk_complaints() -> Iterator[list[str]]:
    """The warnings those loggers log meanwhile, kept from the log (they become the
    start-up error), whatever the log level (at `--log-level error` a warning was never
    made, and the setting taken)."""
    # The SDK reads the sampler's argument from the process's environment.
    handler = _Complaints(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip())
    loggers = [logging.getLogger(name) for name in _COMPLAINING_LOGGERS]
    with _COMPLAINTS_LOCK:
        saved = [(logger.propagate, logger.level) for logger in loggers]
        for logger in loggers:
            logger.addHandler(handler)
            logger.propagate = False
            logger.setLevel(logging.WARNING)
        try:
            yield handler.messages
        finally:
            for logger, (propagate, level) in zip(loggers, saved, strict=True):
                logger.removeHandler(handler)
                logger.propagate = propagate
                logger.setLevel(level)


def check_tracing_env() -> None:
    """Raises the ConfigError that `tracer_provider_from_env` would (an exporter not
    installed, a setting the SDK or an exporter refuses), by building what it builds and
    shutting it down: `laneserve serve` runs it before the model loads (minutes, for a
    large one), not after, when the server is built."""
    provider = tracer_provider_from_env()
    if provider is not None:
        provider.shutdown()


def resource_from_env(instance_id: str | None = None) -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME, with service.name laneserve by default,
    and service.instance.id `instance_id` (None: the SDK's, one random id per process).

    A service.instance.id in OTEL_RESOURCE_ATTRIBUTES wins over `instance_id`: the
    operator named the instance (a pod, a host) to join the metrics and traces to it, as
    the specification has that variable override detected values. `instance_id` then
    stays GetStats' alone, where it tells one run of the server from the next
    (`laneserve top`), which a name kept across restarts would not."""
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "laneserve"}))
    if instance_id is not None and not _names_the_instance(os.environ):
        resource = resource.merge(Resource({SERVICE_INSTANCE_ID: instance_id}))
    return resource


def _names_the_instance(environ: Mapping[str, str]) -> bool:
    """Whether OTEL_RESOURCE_ATTRIBUTES sets service.instance.id, its keys read as the SDK
    reads them (before the first "=", stripped; an item without one is skipped). Read
    here, not by the SDK's detector again: that warned twice of an item it cannot read."""
    items = environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return any(
        item.split("=", 1)[0].strip() == SERVICE_INSTANCE_ID for item in items if "=" in item
    )
