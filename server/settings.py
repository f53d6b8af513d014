"""Triton's log and trace settings (KServe v2 / Triton clients: LogSettings and
TraceSetting, tritonclient's get/update_log_settings and get/update_trace_settings;
HTTP's /v2/logging and /v2/trace/setting): laneserve's log threshold and the ratio of
traces it samples, read by any caller and changed, while the server runs, by a caller
on its host. An operator diagnoses a live server with them: a restart would drain it,
and lose the state being diagnosed.

Logs (`change_log_settings`), as Triton names them:

    log_file           ""  (laneserve writes stderr; a file is stderr redirected at start)
    log_info           whether INFO lines are written       (bool_param)
    log_warning        whether WARNING lines are written    (bool_param)
    log_error          whether ERROR lines are written      (bool_param)
    log_verbose_level  1 at debug, else 0                   (uint32_param)
    log_format         "text" or "json" (--log-format, at start)

Python's logging has one threshold, the root logger's (`--log-level` at start): a
level on turns every level above it on. A change maps onto it: log_verbose_level 1 or
more is debug (the three on); else the lowest of log_info, log_warning, log_error on
(info, warning, error), the others above it on. Another combination (info on and
warning off; everything off) is refused, as are log_file and log_format other than
they are.

Traces (`TraceSettings`), as Triton names them:

    trace_level    ["TIMESTAMPS"] while traces are sampled, else ["OFF"]
    trace_rate     N: one trace in N sampled (1 / the root sampler's ratio); none
                   reported while tracing is off
    trace_count    "-1", log_frequency "0", trace_file "", trace_mode "opentelemetry"

trace_level and trace_rate change the root sampler's sampling (`RatioSampler`:
OTEL_TRACES_SAMPLER's ratio at start), where no caller's sampled context decides (the
parent-based samplers still follow a caller's); a setting with no value comes back to
its value at start. Tracing off (no OTEL_TRACES_EXPORTER), nothing is exported and a
change is refused. The others are fixed: OpenTelemetry's exporter writes the spans.

Who may: a request with no settings is a read, open to any caller as ModelMetadata is;
one with settings, a change, only from a caller on this host (a loopback peer,
`shared_memory.is_local_peer`), else PERMISSION_DENIED. Each change is logged once, at
WARNING, with the caller's peer: the log says who changed what, and when. A change
refused for a caller off the host is logged too (settings_change_refused, WARNING: its
peer and the keys it asked to change), at most one line per REFUSAL_LOG_INTERVAL_S
(`RefusalLog`): the log says who tried, and a scanner cannot flood it.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Collection, Mapping
from typing import Final
from urllib.parse import unquote

from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.server.clock import Clock, SystemClock
from laneserve.server.config import UINT32_MAX
from laneserve.server.errors import InvalidInputError, SettingsRefusedError, TracingOffError
from laneserve.server.log_events import log_event
from laneserve.server.shared_memory import is_local_peer
from laneserve.server.telemetry.logs import REFUSAL_LOG_INTERVAL_S, log_format, set_log_level
from laneserve.server.telemetry.tracing import RatioSampler, Sampling

log = logging.getLogger(__name__)

# A refused change's line names at most so many of the keys its caller asked to change
# (the first, sorted), each cut to so many characters: the keys are the caller's, any
# number of them of any length. Triton's settings, six of each kind, are named whole.
REFUSED_KEYS_NAMED = 8
REFUSED_KEY_CHARS = 40


def check_caller(peer: str, method: str, keys: Collection[str]) -> None:
    """Raises SettingsRefusedError unless `peer` (gRPC's spelling, "ipv4:127.0.0.1:5000")
    may change settings: a caller on this host, as shared memory's rule has it. A refusal
    is logged (`refusal_log`), naming the `keys` the caller asked to change."""
    if not is_local_peer(peer):
        refusal_log.refused(peer, method, keys)
        raise SettingsRefusedError(
            f"{method} changes settings for callers on the server's host only, and this call "
            f"comes from {unquote(peer)!r}; expected a loopback connection (127.0.0.0/8, "
            "::1), or no settings: a read, open to any caller"
        )


class RefusalLog:
    """Logs the changes refused for a caller off this host (settings_change_refused,
    WARNING: the peer, the method, the keys asked), one line at once, then none for
    `interval_s`: the refusals in between are counted, and the next line says how many
    ("and 41 more refused in the 37.2s since the last such line"). A count is told only
    by the next refusal's line: a burst's tail, with no refusal after it, stays untold
    (the line says the next refusals are counted, so a reader knows to look).

    Not an `AggregatedLine` (telemetry/logs.py): that writes a burst's last line from a
    timer thread, which the server's stop must close, and no server owns this log (see
    `refusal_log`). Called on the event loop; the lock is for servers on several loops
    in one process (embedders, tests), which share it."""

    def __init__(self, clock: Clock, *, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self._clock = clock
        self._interval_s = interval_s
        self._lock = threading.Lock()
        # When the last line was written (monotonic seconds), and the refusals since,
        # counted and not logged. Under the lock.
        self._line_s = -math.inf
        self._unlogged = 0

    def refused(self, peer: str, method: str, keys: Collection[str]) -> None:
        with self._lock:
            now_s = self._clock.monotonic()
            since_s = now_s - self._line_s
            if since_s < self._interval_s:
                self._unlogged += 1
                return
            unlogged, self._unlogged, self._line_s = self._unlogged, 0, now_s
        # Sorted only for a line: a refusal counted and not logged costs no more than a read.
        first = sorted(keys)[:REFUSED_KEYS_NAMED]
        named = [key[:REFUSED_KEY_CHARS] for key in first]
        asked = ", ".join(
            repr(cut) + ("..." if len(cut) < len(key) else "")
            for cut, key in zip(named, first, strict=True)
        )
        if len(keys) > len(named):
            asked += f" and {len(keys) - len(named)} more"
        more = (
            f"; and {unlogged} more refused in the {since_s:.1f}s since the last such line"
            if unlogged
            else ""
        )
        log_event(
            log,
            logging.WARNING,
            "settings_change_refused",
            f"refused {method} from {unquote(peer)}, a caller off the server's host, asking "
            f"to change {asked}{more} (those in the next {self._interval_s:g}s are counted "
            "in the next such line, not logged each)",
            peer=unquote(peer),
            method=method,
            keys=named,
            keys_asked=len(keys),
            unlogged=unlogged,
        )


# The one refusal log of this process, every server's and front end's: the root logger
# it writes to is the process's, and a caller trying every port (each gRPC port, HTTP)
# is bounded once. A test sets its own, of a clock it moves.
refusal_log = RefusalLog(SystemClock())


# ---- logs ------------------------------------------------------------------------------

LOG_FILE: Final = "log_file"
LOG_INFO: Final = "log_info"
LOG_WARNING: Final = "log_warning"
LOG_ERROR: Final = "log_error"
LOG_VERBOSE_LEVEL: Final = "log_verbose_level"
LOG_FORMAT: Final = "log_format"
# Each log setting's kind of SettingValue, in the order a read answers them.
_LOG_KINDS: Final[Mapping[str, str]] = {
    LOG_FILE: "string_param",
    LOG_INFO: "bool_param",
    LOG_WARNING: "bool_param",
    LOG_ERROR: "bool_param",
    LOG_VERBOSE_LEVEL: "uint32_param",
    LOG_FORMAT: "string_param",
}
# Each kind in words both callers know: gRPC's (the SettingValue field) and JSON's (what
# HTTP reads into it): an HTTP caller sent a number, not a "uint32_param".
_KIND_NAMES: Final[Mapping[str, str]] = {
    "bool_param": "a boolean (bool_param)",
    "uint32_param": "a whole number (uint32_param)",
    "string_param": "a string (string_param)",
}
# Each kind as a refusal expects it: in those words, and the values it takes where it
# says more.
_KIND_WORDS: Final[Mapping[str, str]] = {
    **_KIND_NAMES,
    "bool_param": f"{_KIND_NAMES['bool_param']}: true or false",
    "uint32_param": f"{_KIND_NAMES['uint32_param']}: 0, or 1 and more for debug",
}
_LEVELS_ACCEPTED: Final = (
    "log_verbose_level 1 or more with log_info, log_warning and log_error on (debug); "
    "log_verbose_level 0 with the three on (info), with log_info off (warning), or with "
    "log_info and log_warning off (error)"
)

_LogValue = bool | int | str


def change_log_settings(request: kpb.LogSettingsRequest, peer: str) -> kpb.LogSettingsResponse:
    """The log settings after `request`'s changes (none: a read). Raises InvalidInputError
    for a setting laneserve does not know, a value of another kind, a threshold Python's
    logging cannot have, or log_file or log_format other than they are;
    SettingsRefusedError for a change from `peer` not on this host."""
    root = logging.getLogger()
    if not request.settings:
        return _log_response(_log_values(root.level))
    check_caller(peer, "LogSettings", request.settings)
    now = _log_values(root.level)
    asked = _asked_log_values(request)
    if asked.get(LOG_FILE, "") != "":
        raise InvalidInputError(
            f"log_file {asked[LOG_FILE]!r}: laneserve writes its log to stderr (log_file "
            "''), and does not change that while it runs; expected '' (to keep the log in a "
            "file, redirect stderr as the server starts: laneserve serve ... 2>>FILE)"
        )
    if asked.get(LOG_FORMAT, now[LOG_FORMAT]) != now[LOG_FORMAT]:
        raise InvalidInputError(
            f"log_format {asked[LOG_FORMAT]!r}: the log is written as {now[LOG_FORMAT]!r}, "
            "set as the server starts (--log-format text or json), and does not change "
            f"while it runs; expected {now[LOG_FORMAT]!r}"
        )
    merged = {**now, **asked}
    old_level = root.level
    new_level = _threshold(
        info=bool(merged[LOG_INFO]),
        warning=bool(merged[LOG_WARNING]),
        error=bool(merged[LOG_ERROR]),
        verbose=int(merged[LOG_VERBOSE_LEVEL]),
    )
    if new_level != old_level:
        _change_log_level(old_level, new_level, peer)
    return _log_response(_log_values(root.level))


def _log_values(threshold: int) -> dict[str, _LogValue]:
    """The log settings of a root logger at `threshold` (NOTSET: every line)."""
    return {
        LOG_FILE: "",
        LOG_INFO: threshold <= logging.INFO,
        LOG_WARNING: threshold <= logging.WARNING,
        LOG_ERROR: threshold <= logging.ERROR,
        LOG_VERBOSE_LEVEL: int(threshold <= logging.DEBUG),
        LOG_FORMAT: log_format(),
    }


def _log_response(values: Mapping[str, _LogValue]) -> kpb.LogSettingsResponse:
    response = kpb.LogSettingsResponse()
    for key, kind in _LOG_KINDS.items():
        setattr(response.settings[key], kind, values[key])
    return response


def _asked_log_values(request: kpb.LogSettingsRequest) -> dict[str, _LogValue]:
    """The values `request` asks for, each checked to be a setting of `_LOG_KINDS` and of
    its kind."""
    asked: dict[str, _LogValue] = {}
    for key in sorted(request.settings):
        kind = _LOG_KINDS.get(key)
        if kind is None:
            raise InvalidInputError(
                f"log setting {key!r} is not one of laneserve's; expected some of "
                f"{', '.join(_LOG_KINDS)}"
            )
        value = request.settings[key]
        given = value.WhichOneof("parameter_choice")
        if given is None or given != kind:
            what = "no value" if given is None else _KIND_NAMES[given]
            raise InvalidInputError(f"log setting {key!r} has {what}; expected {_KIND_WORDS[kind]}")
        asked[key] = getattr(value, given)
    return asked


def _threshold(*, info: bool, warning: bool, error: bool, verbose: int) -> int:
    """The root logger's threshold that writes what the settings ask, or InvalidInputError
    where one threshold cannot: a level on turns every level above it on."""
    if info and warning and error:
        return logging.DEBUG if verbose >= 1 else logging.INFO
    if verbose == 0 and not info and warning and error:
        return logging.WARNING
    if verbose == 0 and not info and not warning and error:
        return logging.ERROR
    raise InvalidInputError(
        f"log_info {_on(info)}, log_warning {_on(warning)}, log_error {_on(error)} and "
        f"log_verbose_level {verbose} (the settings not in the request as they are now) "
        "cannot be had at once: laneserve's log has one threshold, Python logging's, and a "
        "level on turns every level above it on (errors are always written); expected "
        f"one of: {_LEVELS_ACCEPTED}"
    )


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _change_log_level(old_level: int, new_level: int, peer: str) -> None:
    """Sets the threshold and logs the change once, at WARNING, under whichever of the two
    thresholds writes it: the new one where it writes WARNING lines, else the old one (a
    change to error is logged before it is made)."""
    old_name = logging.getLevelName(old_level).lower()
    new_name = logging.getLevelName(new_level).lower()

    def say() -> None:
        log_event(
            log,
            logging.WARNING,
            "log_settings_changed",
            f"log level changed {old_name} -> {new_name} by {unquote(peer)} (LogSettings)",
            old_level=old_name,
            new_level=new_name,
            peer=unquote(peer),
        )

    if new_level <= logging.WARNING:
        set_log_level(new_level)
        say()
    else:
        say()
        set_log_level(new_level)


# ---- traces ----------------------------------------------------------------------------

TRACE_LEVEL: Final = "trace_level"
TRACE_RATE: Final = "trace_rate"
LEVEL_OFF: Final = "OFF"
LEVEL_TIMESTAMPS: Final = "TIMESTAMPS"
LEVEL_TENSORS: Final = "TENSORS"
# Triton's settings that laneserve answers with one value it keeps: why, for a refusal.
_FIXED_TRACE: Final[Mapping[str, tuple[str, str]]] = {
    "trace_count": (
        "-1",
        "laneserve stops tracing after no count of traces: the sampler decides each one",
    ),
    "log_frequency": ("0", "spans leave through the OpenTelemetry exporter, not trace files"),
    "trace_file": ("", "spans leave through the OpenTelemetry exporter, not trace files"),
    "trace_mode": ("opentelemetry", "laneserve traces with OpenTelemetry alone"),
}
_TRACE_KEYS: Final = (TRACE_LEVEL, TRACE_RATE, *_FIXED_TRACE)
# A whole number up to UINT32_MAX's 10 digits, its leading zeros apart: only the digits
# after them reach int() (over 4 300 digits, leading zeros counted, it raises
# ValueError: a 500).
_RATE: Final = re.compile(r"0*([0-9]{1,10})")


class TraceSettings:
    """Triton's trace settings over one server's root sampler (`root`, the tracer
    provider's `BatchLinkSampler.root`), with `tracing` whether anything is traced (an
    exporter is set). Holds no state of its own: the sampling is the sampler's, one for
    every front end, changed from the event loop."""

    def __init__(self, *, tracing: bool, root: RatioSampler | None, model_name: str) -> None:
        self._tracing = tracing
        self._root = root
        self._model_name = model_name

    def answer(self, request: kpb.TraceSettingRequest, peer: str) -> kpb.TraceSettingResponse:
        """The trace settings after `request`'s changes (none: a read). Raises
        InvalidInputError for another model, a setting laneserve does not know or a value
        it does not take; SettingsRefusedError for a change from `peer` not on this host;
        TracingOffError for a change while nothing is traced."""
        if request.model_name not in ("", self._model_name):
            raise InvalidInputError(
                f"trace settings of model {request.model_name!r}: laneserve serves one "
                f"model, {self._model_name!r}, and its trace settings are the server's; "
                f"expected '' or {self._model_name!r}"
            )
        if not request.settings:
            return self._response()
        check_caller(peer, "TraceSetting", request.settings)
        root = self._settable_root()
        now = root.sampling
        new = _asked_sampling(request.settings, now, root.start)
        if new != now:
            root.set(new)
            log_event(
                log,
                logging.WARNING,
                "trace_settings_changed",
                f"trace sampling changed {_described(now)} -> {_described(new)} by "
                f"{unquote(peer)} (TraceSetting)",
                old_level=_level(now),
                new_level=_level(new),
                old_rate=_rate_text(now.ratio),
                new_rate=_rate_text(new.ratio),
                peer=unquote(peer),
            )
        return self._response()

    def _settable_root(self) -> RatioSampler:
        if not self._tracing:
            raise TracingOffError(
                "tracing is off on this server (OTEL_TRACES_EXPORTER names no exporter, or "
                "OTEL_SDK_DISABLED is true): no span is made, nor could one be exported; "
                "expected the server started with OTEL_TRACES_EXPORTER set (otlp, console) "
                "and OTEL_SDK_DISABLED unset, then its sampling changed"
            )
        if self._root is None:
            raise TracingOffError(
                "this server traces through a tracer provider it was given, whose sampler "
                "laneserve did not build and does not change; expected the sampler changed "
                "where the provider is made"
            )
        return self._root

    def _response(self) -> kpb.TraceSettingResponse:
        response = kpb.TraceSettingResponse()
        sampling = None if self._root is None else self._root.sampling
        traced = self._tracing and (sampling is None or sampling.on)
        response.settings[TRACE_LEVEL].value.append(LEVEL_TIMESTAMPS if traced else LEVEL_OFF)
        if self._tracing and sampling is not None:
            response.settings[TRACE_RATE].value.append(_rate_text(sampling.ratio))
        for key, (value, _) in _FIXED_TRACE.items():
            response.settings[key].value.append(value)
        return response


def _asked_sampling(
    settings: Mapping[str, kpb.TraceSettingRequest.SettingValue], now: Sampling, start: Sampling
) -> Sampling:
    """The sampling `settings` ask for, from `now`; a setting with no value comes back to
    `start`'s."""
    on, ratio = now.on, now.ratio
    for key in sorted(settings):
        values = list(settings[key].value)
        if key == TRACE_LEVEL:
            on = start.on if not values else _level_on(values)
        elif key == TRACE_RATE:
            ratio = start.ratio if not values else 1.0 / _rate(values)
        elif key in _FIXED_TRACE:
            fixed, why = _FIXED_TRACE[key]
            if values not in ([], [fixed]):
                raise InvalidInputError(f"{key} {values}: {why}; expected [{fixed!r}], or no value")
        else:
            raise InvalidInputError(
                f"trace setting {key!r} is not one of laneserve's; expected some of "
                f"{', '.join(_TRACE_KEYS)}"
            )
    return Sampling(on=on, ratio=ratio)


def _level_on(values: list[str]) -> bool:
    """Whether trace_level `values` ask for traces (TIMESTAMPS) or none (OFF)."""
    if LEVEL_TENSORS in values:
        raise InvalidInputError(
            f"trace_level {values}: laneserve's spans hold the requests' timings, not their "
            f"tensors; expected [{LEVEL_TIMESTAMPS!r}] or [{LEVEL_OFF!r}]"
        )
    if set(values) == {LEVEL_TIMESTAMPS}:
        return True
    if set(values) == {LEVEL_OFF}:
        return False
    raise InvalidInputError(
        f"trace_level {values}: expected [{LEVEL_TIMESTAMPS!r}] (spans of the sampled "
        f"requests) or [{LEVEL_OFF!r}] (none)"
    )


def _rate(values: list[str]) -> int:
    """trace_rate `values`: one whole number N from 1 (one trace in N sampled)."""
    digits = _RATE.fullmatch(values[0]) if len(values) == 1 else None
    if digits is not None and 1 <= int(digits[1]) <= UINT32_MAX:
        return int(digits[1])
    raise InvalidInputError(
        f"trace_rate {values}: expected one whole number N from 1 to {UINT32_MAX}, one "
        f"trace in N sampled (trace_level [{LEVEL_OFF!r}] samples none)"
    )


def _rate_text(ratio: float) -> str:
    """A ratio as Triton's trace_rate: N, one trace in N (a fraction where a ratio from
    OTEL_TRACES_SAMPLER_ARG is not one in a whole number)."""
    rate = 1.0 / ratio
    if not math.isfinite(rate):  # a ratio under 1/1.8e308 (1e-310 starts a server): "inf"
        return f"{rate:.6g}"
    whole = round(rate)
    return str(whole) if math.isclose(rate, whole, rel_tol=1e-9) else f"{rate:.6g}"


def _level(sampling: Sampling) -> str:
    return LEVEL_TIMESTAMPS if sampling.on else LEVEL_OFF


def _described(sampling: Sampling) -> str:
    rate = _rate_text(sampling.ratio)
    return f"1 in {rate}" if sampling.on else f"off (1 in {rate} once on)"
