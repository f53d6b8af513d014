"""Triton's log and trace settings (server/settings.py): LogSettings and TraceSetting over
real gRPC stubs generated from grpc_predict_v2.proto, and HTTP's /v2/logging and
/v2/trace/setting, against real in-process servers. The log threshold is the process's
root logger's (restored after each test); the trace sampling a server's root sampler,
built from OTEL_TRACES_SAMPLER as a served process builds it, its spans recorded in
memory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import aiohttp
import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from laneserve.server import LaneServer, settings
from laneserve.server.addresses import host_port
from laneserve.server.clock import ManualClock
from laneserve.server.errors import InvalidInputError, SettingsRefusedError
from laneserve.server.settings import REFUSED_KEY_CHARS, RefusalLog, check_caller
from laneserve.server.telemetry import (
    BatchLinkSampler,
    RatioSampler,
    Sampling,
    set_log_level,
    tracer_provider_from_env,
)
from laneserve.server.telemetry.logs import GRPC_PER_CALL_LOGGER
from tests.support import RecordingEngine, Serving, config, request, rows, serving, until
from tests.test_kserve import kserve_stub
from tests.test_kserve_http import assert_refused, get, http_serving, post
from tests.test_kserve_shm import (
    SharedMemory,
    refused,
    register,
    routed_ipv4,
    shm_config,
)
from tests.test_telemetry import (
    CALLER_TRACE_ID,
    INFER_SPAN,
    TRACEPARENT,
    serving_traced,
    spans_named,
    trace_id,
    traced,
)

if TYPE_CHECKING:  # the async stub's type is in the generated .pyi alone
    from laneserve.kserve.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceAsyncStub as Stub

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

MODEL = "small"  # the small model's file stem: the name it is served under
INVALID = grpc.StatusCode.INVALID_ARGUMENT
LogValue = bool | int | str

# What LogSettings answers at each threshold of the root logger (text logs).
AT_INFO: Mapping[str, LogValue] = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "text",
}
AT_DEBUG = {**AT_INFO, "log_verbose_level": 1}
AT_WARNING = {**AT_INFO, "log_info": False}
AT_ERROR = {**AT_WARNING, "log_warning": False}
# TraceSetting's settings that never change.
FIXED_TRACE = {
    "trace_count": ["-1"],
    "log_frequency": ["0"],
    "trace_file": [""],
    "trace_mode": ["opentelemetry"],
}


@pytest.fixture(autouse=True)
def at_info(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts at --log-level info, with gRPC's debugging not asked for; the
    per-call logger's level comes back after it (the root logger's: conftest's
    `root_logging_restored`)."""
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    per_call = logging.getLogger(GRPC_PER_CALL_LOGGER)
    level = per_call.level
    set_log_level(logging.INFO)
    yield
    per_call.setLevel(level)


@pytest.fixture(autouse=True)
def refusal_clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    """Every test has a refusal log of its own (the process's is shared by every server
    in it), on a clock that moves when the test says."""
    clock = ManualClock()
    monkeypatch.setattr(settings, "refusal_log", RefusalLog(clock, interval_s=10.0))
    return clock


@pytest.fixture
def shm() -> Iterator[SharedMemory]:
    made = SharedMemory()
    try:
        yield made
    finally:
        made.close()


# ---- the messages --------------------------------------------------------------------------


def log_request(**settings: LogValue | None) -> kpb.LogSettingsRequest:
    """A LogSettingsRequest, each value set in its kind's field (None: no value)."""
    asked = kpb.LogSettingsRequest()
    for key, value in settings.items():
        setting = asked.settings[key]
        if isinstance(value, bool):
            setting.bool_param = value
        elif isinstance(value, int):
            setting.uint32_param = value
        elif isinstance(value, str):
            setting.string_param = value
    return asked


def log_values(answer: kpb.LogSettingsResponse) -> dict[str, LogValue]:
    values: dict[str, LogValue] = {}
    for key, setting in answer.settings.items():
        kind = setting.WhichOneof("parameter_choice")
        assert kind is not None, key
        values[key] = getattr(setting, kind)
    return values


def trace_request(
    settings: Mapping[str, list[str]], model_name: str = ""
) -> kpb.TraceSettingRequest:
    asked = kpb.TraceSettingRequest(model_name=model_name)
    for key, values in settings.items():
        asked.settings[key].value.extend(values)
    return asked


def trace_values(answer: kpb.TraceSettingResponse) -> dict[str, list[str]]:
    return {key: list(setting.value) for key, setting in answer.settings.items()}


async def log_settings(stub: Stub, **settings: LogValue | None) -> dict[str, LogValue]:
    return log_values(await stub.LogSettings(log_request(**settings)))


async def trace_settings(stub: Stub, **settings: list[str]) -> dict[str, list[str]]:
    return trace_values(await stub.TraceSetting(trace_request(settings)))


def changes(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    """The records of laneserve's event `event` (`log_event`), as the root logger's
    handlers received them: what its threshold let through."""
    return [record for record in caplog.records if record.__dict__.get("event") == event]


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """An event's fields (`log_event`)."""
    found: dict[str, Any] = record.__dict__["fields"]
    return found


# ---- log settings ---------------------------------------------------------------------------


def test_log_settings_read_the_threshold_in_tritons_names(small_model: Path) -> None:
    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            assert await log_settings(stub) == AT_INFO
            answer = await stub.LogSettings(kpb.LogSettingsRequest())
            kinds = {
                key: value.WhichOneof("parameter_choice") for key, value in answer.settings.items()
            }
            assert kinds == {
                "log_file": "string_param",
                "log_info": "bool_param",
                "log_warning": "bool_param",
                "log_error": "bool_param",
                "log_verbose_level": "uint32_param",
                "log_format": "string_param",
            }
            for level, expected in (
                (logging.DEBUG, AT_DEBUG),
                (logging.WARNING, AT_WARNING),
                (logging.ERROR, AT_ERROR),
            ):
                set_log_level(level)  # as --log-level sets it at start
                assert await log_settings(stub) == expected, level

    asyncio.run(scenario())


def test_a_change_of_level_turns_the_servers_debug_lines_on_and_off(
    small_model: Path, shm: SharedMemory, caplog: pytest.LogCaptureFixture
) -> None:
    """log_verbose_level 1: the server's own DEBUG line (a shared memory region
    registered) is written; 0 again: it is not. Each change is one WARNING line naming
    the levels and the caller; gRPC's per-call logger stays at INFO through debug."""
    made = shm.create(4096)

    def registered() -> list[logging.LogRecord]:
        return changes(caplog, "shared_memory_registered")

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), shm_config(small_model)) as s:
            stub = kserve_stub(s)
            await register(stub, "before", made)
            assert registered() == []
            assert await log_settings(stub, log_verbose_level=1) == AT_DEBUG
            assert logging.getLogger().level == logging.DEBUG
            assert logging.getLogger(GRPC_PER_CALL_LOGGER).level == logging.INFO
            await register(stub, "while", made)
            assert [fields(record)["region"] for record in registered()] == ["while"]
            assert await log_settings(stub, log_verbose_level=0) == AT_INFO
            await register(stub, "after", made)
            assert len(registered()) == 1

    asyncio.run(scenario())
    lines = changes(caplog, "log_settings_changed")
    levels = [
        (line.levelno, fields(line)["old_level"], fields(line)["new_level"]) for line in lines
    ]
    assert levels == [(logging.WARNING, "info", "debug"), (logging.WARNING, "debug", "info")]
    peer = fields(lines[0])["peer"]
    assert peer.startswith("ipv4:127.0.0.1:"), peer
    assert lines[0].getMessage() == f"log level changed info -> debug by {peer} (LogSettings)"


def test_warning_and_error_thresholds_and_their_lines(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """log_info off: warning; log_warning off too: error, its change logged before it is
    made (at error a WARNING line is not written); on again: info; log_verbose_level 3:
    debug, read back as 1. Unnamed settings stay."""
    probe = logging.getLogger("laneserve.server.probe")

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            assert await log_settings(stub, log_info=False) == AT_WARNING
            probe.info("info at warning")
            assert await log_settings(stub, log_warning=False) == AT_ERROR
            probe.warning("warning at error")
            assert await log_settings(stub, log_info=True, log_warning=True) == AT_INFO
            probe.info("info at info")
            # Triton's verbose levels above 1: Python's logging has one, debug.
            assert await log_settings(stub, log_verbose_level=3) == AT_DEBUG

    asyncio.run(scenario())
    said = [record.getMessage() for record in caplog.records if record.name == probe.name]
    assert said == ["info at info"]
    lines = changes(caplog, "log_settings_changed")
    assert [(fields(line)["old_level"], fields(line)["new_level"]) for line in lines] == [
        ("info", "warning"),
        ("warning", "error"),
        ("error", "info"),
        ("info", "debug"),
    ]


# Each refused LogSettings request, with a fragment of its refusal.
LOG_REFUSALS: list[tuple[dict[str, LogValue | None], str]] = [
    (
        {"log_info": True, "log_warning": False},
        (
            "log_info on, log_warning off, log_error on and log_verbose_level 0 (the settings "
            "not in the request as they are now) cannot be had at once: laneserve's log has one "
            "threshold"
        ),
    ),
    ({"log_error": False}, "expected one of: log_verbose_level 1 or more with log_info"),
    ({"log_verbose_level": 1, "log_info": False}, "cannot be had at once"),
    (
        {"log_info": False, "log_warning": False, "log_error": False},
        "(errors are always written)",
    ),
    (
        {"log_file": "/var/log/laneserve.log"},
        (
            "log_file '/var/log/laneserve.log': laneserve writes its log to stderr (log_file "
            "''), and does not change that while it runs; expected '' (to keep the log in a "
            "file, redirect stderr as the server starts"
        ),
    ),
    (
        {"log_format": "json"},
        (
            "log_format 'json': the log is written as 'text', set as the server starts "
            "(--log-format text or json), and does not change while it runs; expected 'text'"
        ),
    ),
    (
        {"log_colour": True},
        (
            "log setting 'log_colour' is not one of laneserve's; expected some of log_file, "
            "log_info, log_warning, log_error, log_verbose_level, log_format"
        ),
    ),
    (
        {"log_info": 1},
        (
            "log setting 'log_info' has a whole number (uint32_param); expected a boolean "
            "(bool_param): true or false"
        ),
    ),
    (
        {"log_verbose_level": "1"},
        (
            "log setting 'log_verbose_level' has a string (string_param); expected a whole "
            "number (uint32_param)"
        ),
    ),
    ({"log_info": None}, "log setting 'log_info' has no value; expected a boolean (bool_param)"),
]


def test_log_settings_refusals_name_the_setting_and_what_is_accepted(
    small_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each refused INVALID_ARGUMENT, the threshold unchanged and nothing logged; the
    settings as read, sent back, change nothing and are answered."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            for settings, fragment in LOG_REFUSALS:
                await refused(
                    stub.LogSettings(log_request(**settings)), INVALID, "INVALID_INPUT", fragment
                )
                assert logging.getLogger().level == logging.INFO, settings
            assert await log_settings(stub, **AT_INFO) == AT_INFO
            # Names a value as it is: no change, no line.
            assert await log_settings(stub, log_file="", log_format="text") == AT_INFO

    asyncio.run(scenario())
    assert changes(caplog, "log_settings_changed") == []


# ---- who may --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "may"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.9.9.9:5000", True),  # all of 127/8
        ("ipv6:%5B::1%5D:5000", True),  # gRPC's spelling: the brackets percent-encoded
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("ipv4:10.0.0.7:5000", False),
        ("ipv6:[2001:db8::1]:5000", False),
        ("unknown", False),
    ],
)
def test_settings_change_only_from_this_host(
    peer: str, may: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Shared memory's rule (`is_local_peer`): a loopback peer, or none; a refusal is
    logged, an allowed caller is not."""
    if may:
        check_caller(peer, "LogSettings", ["log_info"])
        assert changes(caplog, "settings_change_refused") == []
        return
    with pytest.raises(
        SettingsRefusedError, match="LogSettings changes settings for callers on the server"
    ):
        check_caller(peer, "LogSettings", ["log_info"])
    [line] = changes(caplog, "settings_change_refused")
    assert fields(line)["peer"] == unquote(peer)


def test_refused_changes_are_logged_at_most_once_per_interval_and_counted_between(
    refusal_clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The first refusal at once; those within the interval counted, not logged; the
    next line after it says how many, and over how long. A key is the caller's: a line
    names at most eight, each cut, escaped (no line of a caller's making)."""
    elsewhere = "ipv4:192.0.2.9:4000"
    refusal_log = settings.refusal_log
    refusal_log.refused(elsewhere, "LogSettings", ["log_verbose_level"])
    for _ in range(41):
        refusal_clock.advance(0.125)  # 5.125 s in all (binary fractions: exact sums)
        refusal_log.refused(elsewhere, "TraceSetting", ["trace_rate"])
    refusal_clock.advance(4.875)  # the interval since the first line, to the tick
    refusal_log.refused("ipv6:%5B2001:db8::1%5D:7", "LogSettings", ["log_info", "log_error"])
    refusal_clock.advance(10.0)
    many = [f"k{index:02}" for index in range(12)]
    long_key = "x" * 5000
    refusal_log.refused(elsewhere, "LogSettings", [*many, long_key])

    lines = changes(caplog, "settings_change_refused")
    assert [line.levelno for line in lines] == [logging.WARNING] * 3
    assert [fields(line)["unlogged"] for line in lines] == [0, 41, 0]
    assert lines[0].getMessage() == (
        "refused LogSettings from ipv4:192.0.2.9:4000, a caller off the server's host, asking "
        "to change 'log_verbose_level' (those in the next 10s are counted in the next such "
        "line, not logged each)"
    )
    assert lines[1].getMessage() == (
        "refused LogSettings from ipv6:[2001:db8::1]:7, a caller off the server's host, "
        "asking to change 'log_error', 'log_info'; and 41 more refused in the 10.0s since the "
        "last such line (those in the next 10s are counted in the next such line, not logged "
        "each)"
    )
    assert fields(lines[1])["peer"] == "ipv6:[2001:db8::1]:7"
    bounded = fields(lines[2])
    assert bounded["keys"] == many[:8]
    assert bounded["keys_asked"] == 13
    assert "'k07' and 5 more (those in the next 10s" in lines[2].getMessage()
    refusal_log.refused(elsewhere, "LogSettings", ["a" * REFUSED_KEY_CHARS, long_key])
    refusal_clock.advance(10.0)
    refusal_log.refused(elsewhere, "LogSettings", ["a" * REFUSED_KEY_CHARS, long_key, "b\nc"])
    last = changes(caplog, "settings_change_refused")[-1]
    assert fields(last)["keys"] == ["a" * REFUSED_KEY_CHARS, "b\nc", "x" * REFUSED_KEY_CHARS]
    assert last.getMessage().startswith(
        "refused LogSettings from ipv4:192.0.2.9:4000, a caller off the server's host, "
        f"asking to change {'a' * REFUSED_KEY_CHARS!r}, 'b\\nc', {'x' * REFUSED_KEY_CHARS!r}"
        "...; and 1 more refused in the 10.0s"
    )
    assert "\n" not in last.getMessage()
    assert fields(last)["unlogged"] == 1


@contextlib.asynccontextmanager
async def served_elsewhere(
    model: Path, **fields: Any
) -> AsyncIterator[tuple[Stub, aiohttp.ClientSession]]:
    """A server bound to every address, called through this host's routed one (a peer
    that is not loopback, as a caller on another host is): a KServe stub and an HTTP
    session; always stopped afterwards."""
    address = routed_ipv4()
    served = config(model, host="0.0.0.0", port=0, http_port=0, metrics_port=-1, **fields)  # noqa: S104
    server = LaneServer(RecordingEngine(str(model)), served)
    port = await server.start()
    try:
        async with (
            grpc.aio.insecure_channel(host_port(address, port)) as channel,
            aiohttp.ClientSession(f"http://{address}:{server.http_port}") as http,
        ):
            yield kpb_grpc.GRPCInferenceServiceStub(channel), http
    finally:
        await server.stop(grace_s=5.0)


def test_a_caller_on_another_host_reads_the_settings_and_changes_none(small_model: Path) -> None:
    """Reading is open (gRPC and HTTP); a change is refused PERMISSION_DENIED (403 over
    HTTP) naming the peer, and the threshold stays."""
    elsewhere = "changes settings for callers on the server's host only, and this call comes from"

    async def scenario() -> None:
        async with served_elsewhere(small_model) as (stub, http):
            assert await log_settings(stub) == AT_INFO
            assert (await trace_settings(stub))["trace_level"] == ["OFF"]
            await refused(
                stub.LogSettings(log_request(log_verbose_level=1)),
                grpc.StatusCode.PERMISSION_DENIED,
                "SETTINGS_REFUSED",
                f"LogSettings {elsewhere} 'ipv4:{routed_ipv4()}:",
            )
            await refused(
                stub.TraceSetting(trace_request({"trace_rate": ["1"]})),
                grpc.StatusCode.PERMISSION_DENIED,
                "SETTINGS_REFUSED",
                f"TraceSetting {elsewhere}",
            )
            assert (await get(http, "/v2/logging")).json == AT_INFO
            assert_refused(
                await post(http, "/v2/logging", {"log_verbose_level": 1}),
                403,
                "SETTINGS_REFUSED",
                f"LogSettings {elsewhere}",
            )
            assert logging.getLogger().level == logging.INFO

    asyncio.run(scenario())


def test_a_refused_remote_change_is_logged_over_grpc_and_http_once_per_interval(
    small_model: Path, refusal_clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller off the host that tries to change a setting is named in the server's log
    (its peer, the method, the keys it asked to change), gRPC's and HTTP's alike: the
    first refusal at once, those within the interval after it counted in the next line,
    whichever front end refused them. Reads are not logged."""
    routed = routed_ipv4()

    def refusals() -> list[logging.LogRecord]:
        return changes(caplog, "settings_change_refused")

    async def scenario() -> None:
        async with served_elsewhere(small_model) as (stub, http):
            assert await log_settings(stub) == AT_INFO
            assert (await get(http, "/v2/logging")).json == AT_INFO
            assert refusals() == []
            await refused(
                stub.LogSettings(log_request(log_verbose_level=1)),
                grpc.StatusCode.PERMISSION_DENIED,
                "SETTINGS_REFUSED",
                "LogSettings changes settings",
            )
            [grpc_line] = refusals()
            assert fields(grpc_line)["peer"].startswith(f"ipv4:{routed}:")
            assert (fields(grpc_line)["method"], fields(grpc_line)["keys"]) == (
                "LogSettings",
                ["log_verbose_level"],
            )
            # Within the interval: refused as before, counted, not logged.
            await refused(
                stub.TraceSetting(trace_request({"trace_rate": ["1"]})),
                grpc.StatusCode.PERMISSION_DENIED,
                "SETTINGS_REFUSED",
                "TraceSetting changes settings",
            )
            assert_refused(
                await post(http, "/v2/logging", {"log_info": False}),
                403,
                "SETTINGS_REFUSED",
                "LogSettings changes settings",
            )
            assert len(refusals()) == 1
            refusal_clock.advance(10.0)
            assert_refused(
                await post(http, "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
                403,
                "SETTINGS_REFUSED",
                "TraceSetting changes settings",
            )
            http_line = refusals()[1]
            assert fields(http_line)["peer"].startswith(f"ipv4:{routed}:")
            assert fields(http_line)["peer"] != fields(grpc_line)["peer"]  # another connection
            assert (fields(http_line)["method"], fields(http_line)["keys"]) == (
                "TraceSetting",
                ["trace_level"],
            )
            assert fields(http_line)["unlogged"] == 2
            assert "; and 2 more refused in the 10.0s since the last such line" in (
                http_line.getMessage()
            )

    asyncio.run(scenario())
    assert len(refusals()) == 2
    assert logging.getLogger().level == logging.INFO


# ---- trace settings -------------------------------------------------------------------------


def env_sampler(monkeypatch: pytest.MonkeyPatch, sampler: str, argument: str = "") -> Sampler:
    """The sampler a served process builds from OTEL_TRACES_SAMPLER[_ARG] (its provider
    shut down: spans go to the test's exporter)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", argument)
    provider = tracer_provider_from_env({"OTEL_TRACES_EXPORTER": "console"})
    assert provider is not None
    built = provider.sampler
    provider.shutdown()
    return built


def root_of(sampler: Sampler) -> RatioSampler:
    assert isinstance(sampler, BatchLinkSampler)
    assert sampler.root is not None
    return sampler.root


@pytest.mark.parametrize(
    ("name", "argument", "sampling", "parent_based"),
    [
        ("parentbased_always_on", "", Sampling(on=True, ratio=1.0), True),
        ("parentbased_always_off", "", Sampling(on=False, ratio=1.0), True),
        ("parentbased_traceidratio", "0.25", Sampling(on=True, ratio=0.25), True),
        ("parentbased_traceidratio", "", Sampling(on=True, ratio=1.0), True),  # the SDK's 1.0
        ("always_on", "", Sampling(on=True, ratio=1.0), False),
        ("always_off", "", Sampling(on=False, ratio=1.0), False),
        ("TraceIdRatio", "0", Sampling(on=False, ratio=1.0), False),  # the SDK lowercases it
        ("traceidratio", "0.5", Sampling(on=True, ratio=0.5), False),
    ],
)
def test_the_root_sampler_is_the_one_the_variables_name(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    argument: str,
    sampling: Sampling,
    parent_based: bool,
) -> None:
    """Its sampling, and decisions the SDK's own sampler of those variables makes: for
    root spans by trace id, and (parent-based) a caller's sampled context followed."""
    sampler = env_sampler(monkeypatch, name, argument)
    root = root_of(sampler)
    assert root.sampling == root.start == sampling
    ratio = sampling.ratio if sampling.on else 0.0
    theirs: Sampler = {1.0: ALWAYS_ON, 0.0: ALWAYS_OFF}.get(ratio) or TraceIdRatioBased(ratio)
    if parent_based:
        theirs = ParentBased(theirs)
    for low_bits in (0, 1 << 62, 1 << 63, (1 << 64) - 1):
        trace = CALLER_TRACE_ID >> 64 << 64 | low_bits
        ours = sampler.should_sample(None, trace, "enqueue").decision
        assert ours is theirs.should_sample(None, trace, "enqueue").decision, low_bits
    caller = SpanContext(CALLER_TRACE_ID, 1, True, TraceFlags(TraceFlags.SAMPLED))
    context = set_span_in_context(NonRecordingSpan(caller))
    followed = sampler.should_sample(context, CALLER_TRACE_ID, "enqueue").decision
    assert followed is theirs.should_sample(context, CALLER_TRACE_ID, "enqueue").decision
    if parent_based:
        assert followed is Decision.RECORD_AND_SAMPLE


def test_a_ratio_sampler_set_while_sampling_decides_by_the_new_sampling() -> None:
    root = RatioSampler(Sampling(on=True, ratio=0.5))
    assert root.get_description() == "RatioSampler{0.5}"
    assert root.set(Sampling(on=False, ratio=0.5)) == Sampling(on=True, ratio=0.5)
    assert root.should_sample(None, 0, "enqueue").decision is Decision.DROP
    assert root.get_description() == "RatioSampler{0.0}"
    root.set(Sampling(on=True, ratio=1.0))
    assert root.should_sample(None, (1 << 64) - 1, "enqueue").decision is Decision.RECORD_AND_SAMPLE
    assert root.start == Sampling(on=True, ratio=0.5)


async def infer_spans_after(
    s: Serving, exporter: InMemorySpanExporter, calls: int, *, traceparent: bool = False
) -> list[int]:
    """Sends `calls` Infer requests one after another; the trace ids of the Infer server
    spans recorded since (each ended before its answer left)."""
    before = len(spans_named(exporter, INFER_SPAN))
    metadata = (("traceparent", TRACEPARENT),) if traceparent else ()
    for _ in range(calls):
        await s.stub.Infer(request(rows(1)), timeout=10, metadata=metadata)
    return [trace_id(span) for span in spans_named(exporter, INFER_SPAN)[before:]]


def test_trace_rate_and_level_decide_which_requests_are_traced(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """OTEL_TRACES_SAMPLER=parentbased_traceidratio at 0.5: trace_rate "2". Rate 1:
    every request traced, with its batch; level OFF: none, but a caller's sampled
    context is still followed (parent-based), its batch kept (the batch rule); each
    setting cleared comes back to its value at start."""
    sampler = env_sampler(monkeypatch, "parentbased_traceidratio", "0.5")
    engine = RecordingEngine(str(small_model))

    async def scenario() -> None:
        async with serving_traced(engine, config(small_model), sampler=sampler) as (s, spans):
            stub = kserve_stub(s)
            assert await trace_settings(stub) == {
                "trace_level": ["TIMESTAMPS"],
                "trace_rate": ["2"],
                **FIXED_TRACE,
            }
            at_one = await trace_settings(stub, trace_rate=["1"])
            assert (at_one["trace_level"], at_one["trace_rate"]) == (["TIMESTAMPS"], ["1"])
            assert len(await infer_spans_after(s, spans, 3)) == 3
            await until(lambda: len(spans_named(spans, "batch")) == 3)
            off = await trace_settings(stub, trace_level=["OFF"])
            assert (off["trace_level"], off["trace_rate"]) == (["OFF"], ["1"])  # rate kept
            assert await infer_spans_after(s, spans, 3) == []
            assert await infer_spans_after(s, spans, 1, traceparent=True) == [CALLER_TRACE_ID]
            await until(lambda: len(spans_named(spans, "batch")) == 4)
            cleared = await trace_settings(stub, trace_level=[])
            assert (cleared["trace_level"], cleared["trace_rate"]) == (["TIMESTAMPS"], ["1"])
            assert len(await infer_spans_after(s, spans, 2)) == 2
            cleared = await trace_settings(stub, trace_rate=[])
            assert (cleared["trace_level"], cleared["trace_rate"]) == (["TIMESTAMPS"], ["2"])
            # The served model's name, or none: the server's one setting.
            model = trace_values(
                await stub.TraceSetting(trace_request({"trace_rate": ["1000"]}, MODEL))
            )
            assert model["trace_rate"] == ["1000"]
            assert root_of(sampler).sampling == Sampling(on=True, ratio=0.001)

    asyncio.run(scenario())
    lines = changes(caplog, "trace_settings_changed")
    assert [
        tuple(fields(line)[key] for key in ("old_level", "old_rate", "new_level", "new_rate"))
        for line in lines
    ] == [
        ("TIMESTAMPS", "2", "TIMESTAMPS", "1"),
        ("TIMESTAMPS", "1", "OFF", "1"),
        ("OFF", "1", "TIMESTAMPS", "1"),
        ("TIMESTAMPS", "1", "TIMESTAMPS", "2"),
        ("TIMESTAMPS", "2", "TIMESTAMPS", "1000"),
    ]
    assert (
        lines[1]
        .getMessage()
        .startswith("trace sampling changed 1 in 1 -> off (1 in 1 once on) by ipv4:127.0.0.1:")
    )


# Each refused TraceSetting request (model name, settings), with a fragment of its refusal.
TRACE_REFUSALS: list[tuple[str, dict[str, list[str]], str]] = [
    (
        "",
        {"trace_level": ["TIMESTAMPS", "TENSORS"]},
        (
            "trace_level ['TIMESTAMPS', 'TENSORS']: laneserve's spans hold the requests' timings, "
            "not their tensors; expected ['TIMESTAMPS'] or ['OFF']"
        ),
    ),
    ("", {"trace_level": ["OFF", "TIMESTAMPS"]}, "expected ['TIMESTAMPS'] (spans of the sampled"),
    ("", {"trace_level": ["timestamps"]}, "trace_level ['timestamps']: expected ['TIMESTAMPS']"),
    (
        "",
        {"trace_rate": ["0"]},
        "trace_rate ['0']: expected one whole number N from 1 to 4294967295",
    ),
    ("", {"trace_rate": ["1.5"]}, "trace_rate ['1.5']: expected one whole number"),
    ("", {"trace_rate": ["4294967296"]}, "trace_rate ['4294967296']"),
    # int() of over 4 300 digits raised ValueError: UNKNOWN, and a 500 over HTTP.
    ("", {"trace_rate": ["9" * 4301]}, "expected one whole number N from 1 to 4294967295"),
    ("", {"trace_rate": ["0" * 20]}, "expected one whole number N from 1 to 4294967295"),
    ("", {"trace_rate": ["1", "2"]}, "trace_rate ['1', '2']"),
    ("", {"trace_count": ["5"]}, "trace_count ['5']: laneserve stops tracing after no count"),
    ("", {"log_frequency": ["10"]}, "log_frequency ['10']: spans leave through the OpenTelemetry"),
    ("", {"trace_file": ["/tmp/t.json"]}, "expected [''], or no value"),  # noqa: S108
    ("", {"trace_mode": ["triton"]}, "trace_mode ['triton']: laneserve traces with OpenTelemetry"),
    (
        "",
        {"trace_colour": ["x"]},
        (
            "trace setting 'trace_colour' is not one of laneserve's; expected some of trace_level, "
            "trace_rate, trace_count, log_frequency, trace_file, trace_mode"
        ),
    ),
    (
        "resnet",
        {},
        (
            "trace settings of model 'resnet': laneserve serves one model, 'small', and its trace "
            "settings are the server's; expected '' or 'small'"
        ),
    ),
]


def test_trace_setting_refusals_name_what_is_supported(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each refused INVALID_ARGUMENT, the sampling unchanged; the fixed settings at their
    values are answered."""
    sampler = env_sampler(monkeypatch, "parentbased_always_on")
    engine = RecordingEngine(str(small_model))

    async def scenario() -> None:
        async with serving_traced(engine, config(small_model), sampler=sampler) as (s, _):
            stub = kserve_stub(s)
            for model, settings, fragment in TRACE_REFUSALS:
                await refused(
                    stub.TraceSetting(trace_request(settings, model)),
                    INVALID,
                    "INVALID_INPUT",
                    fragment,
                )
                assert root_of(sampler).sampling == Sampling(on=True, ratio=1.0), settings
            assert await trace_settings(stub, **FIXED_TRACE) == {
                "trace_level": ["TIMESTAMPS"],
                "trace_rate": ["1"],
                **FIXED_TRACE,
            }

    asyncio.run(scenario())


def test_with_tracing_off_the_level_reads_off_and_a_change_is_refused(small_model: Path) -> None:
    """No OTEL_TRACES_EXPORTER: nothing traced, no rate, a change FAILED_PRECONDITION."""

    async def scenario() -> None:
        async with serving(RecordingEngine(str(small_model)), config(small_model)) as s:
            stub = kserve_stub(s)
            assert await trace_settings(stub) == {"trace_level": ["OFF"], **FIXED_TRACE}
            for settings in ({"trace_rate": ["1"]}, {"trace_level": ["TIMESTAMPS"]}):
                await refused(
                    stub.TraceSetting(trace_request(settings)),
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "TRACING_OFF",
                    "tracing is off on this server (OTEL_TRACES_EXPORTER names no exporter, or",
                )

    asyncio.run(scenario())


def test_a_tracer_provider_given_with_its_own_sampler_is_not_changed(small_model: Path) -> None:
    """An embedder's provider (a sampler laneserve did not build): tracing reads on, with
    no rate, and a change is refused FAILED_PRECONDITION."""
    engine = RecordingEngine(str(small_model))

    async def scenario() -> None:
        async with serving_traced(engine, config(small_model), sampler=ALWAYS_ON) as (s, _):
            stub = kserve_stub(s)
            assert await trace_settings(stub) == {"trace_level": ["TIMESTAMPS"], **FIXED_TRACE}
            await refused(
                stub.TraceSetting(trace_request({"trace_rate": ["1"]})),
                grpc.StatusCode.FAILED_PRECONDITION,
                "TRACING_OFF",
                "whose sampler laneserve did not build",
            )

    asyncio.run(scenario())


# ---- HTTP ------------------------------------------------------------------------------------


def test_settings_over_http_are_tritons_json(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET and POST /v2/logging, /v2/trace/setting and /v2/models/{model}/trace/setting:
    Triton's JSON both ways (log values of their JSON kinds; trace values strings, and
    trace_level a list), refusals as the gRPC method's, with their HTTP status."""
    sampler = env_sampler(monkeypatch, "parentbased_traceidratio", "0.01")
    engine = RecordingEngine(str(small_model))
    telemetry, _ = traced(engine, config(small_model), sampler=sampler)

    async def scenario() -> None:
        async with http_serving(engine, config(small_model), telemetry=telemetry) as (_, http):
            logs = await get(http, "/v2/logging")
            assert (logs.status, logs.json) == (200, AT_INFO)
            changed = await post(http, "/v2/logging", {"log_verbose_level": 1})
            assert (changed.status, changed.json) == (200, AT_DEBUG)
            assert (await post(http, "/v2/logging", {})).json == AT_DEBUG  # a read
            log_refusals: list[tuple[Any, str]] = [
                ({"log_info": True, "log_warning": False}, "cannot be had at once"),
                ({"log_info": "yes"}, "log setting 'log_info' has a string (string_param)"),
                ({"log_verbose_level": -1}, "'log_verbose_level' is -1; expected a whole number"),
                ({"log_verbose_level": 1.5}, "'log_verbose_level' is a number; expected true or"),
                ({"log_file": "x.log"}, "laneserve writes its log to stderr"),
                ([1], "the request is a list; expected an object of log settings"),
            ]
            for body, fragment in log_refusals:
                assert_refused(
                    await post(http, "/v2/logging", body), 400, "INVALID_INPUT", fragment
                )
            assert (await post(http, "/v2/logging", {"log_verbose_level": 0})).json == AT_INFO

            expected = {"trace_level": ["TIMESTAMPS"], "trace_rate": "100"}
            expected |= {key: value for key, [value] in FIXED_TRACE.items()}
            for path in ("/v2/trace/setting", f"/v2/models/{MODEL}/trace/setting"):
                read = await get(http, path)
                assert (read.status, read.json) == (200, expected), path
            rate = await post(http, "/v2/trace/setting", {"trace_rate": "1"})
            assert (rate.status, rate.json["trace_rate"]) == (200, "1")
            level = await post(http, f"/v2/models/{MODEL}/trace/setting", {"trace_level": ["OFF"]})
            assert level.json["trace_level"] == ["OFF"]
            cleared = await post(
                http, "/v2/trace/setting", {"trace_level": None, "trace_rate": None}
            )
            assert (cleared.json["trace_level"], cleared.json["trace_rate"]) == (
                ["TIMESTAMPS"],
                "100",
            )
            refusals: list[tuple[str, Any, str]] = [
                (
                    "/v2/trace/setting",
                    {"trace_rate": 1},
                    "'trace_rate' is an integer; expected a string",
                ),
                (
                    "/v2/trace/setting",
                    {"trace_level": [1]},
                    "an item of 'trace_level' is an integer",
                ),
                ("/v2/trace/setting", {"trace_level": ["TENSORS"]}, "not their tensors"),
                ("/v2/models/resnet/trace/setting", {}, "trace settings of model 'resnet'"),
            ]
            for path, body, fragment in refusals:
                assert_refused(await post(http, path, body), 400, "INVALID_INPUT", fragment)
            assert_refused(
                await get(http, "/v2/models/resnet/trace/setting"),
                400,
                "INVALID_INPUT",
                "laneserve serves one model, 'small'",
            )

    asyncio.run(scenario())


def test_over_http_with_tracing_off_a_trace_change_is_refused_400(small_model: Path) -> None:
    async def scenario() -> None:
        async with http_serving(RecordingEngine(str(small_model)), config(small_model)) as (
            _,
            http,
        ):
            read = await get(http, "/v2/trace/setting")
            assert read.json == {"trace_level": ["OFF"]} | {
                key: value for key, [value] in FIXED_TRACE.items()
            }
            assert_refused(
                await post(http, "/v2/trace/setting", {"trace_rate": "1"}),
                400,
                "TRACING_OFF",
                "tracing is off on this server (OTEL_TRACES_EXPORTER names no exporter, or",
            )

    asyncio.run(scenario())


def test_a_trace_rate_of_any_length_is_read_without_reaching_ints_digit_limit() -> None:
    """int() of over 4 300 digits raises ValueError (gRPC UNKNOWN, HTTP 500): a rate's
    leading zeros count toward that limit too (a review found 5 000 zeros and a 1 a 500
    after the first fix); only the digits after them are read. A start ratio of 1e-310
    (OTEL_TRACES_SAMPLER_ARG, accepted) read as a rate overflowed round(): a 500 on
    every read."""
    assert settings._rate(["0" * 5000 + "1"]) == 1
    with pytest.raises(InvalidInputError, match="expected one whole number N from 1"):
        settings._rate(["0" * 5000 + "9" * 11])
    assert settings._rate_text(1e-310) == "inf"
    assert settings._rate_text(0.3) == "3.33333"
