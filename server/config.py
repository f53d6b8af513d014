"""Server and lane configuration: frozen, validated once at the edge.

A config file is TOML; every key is optional and unknown keys are refused, so a typo
is an error at start, never a silently ignored setting::

    [server]
    max_batch_size = 128
    default_lane = "standard"

    [[lanes]]  # listed highest priority first
    name = "interactive"
    capacity_rows = 256
    timeout_ms = 1000
    max_wait_ms = 1
    min_share = 0.0
"""

from __future__ import annotations

import dataclasses
import math
import stat
import threading
import tomllib
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any, Literal

from laneserve.server.errors import InvalidInputError
from laneserve.server.memory import parse_memory_limit

Device = Literal["auto", "cuda", "cpu"]
DEVICES: tuple[Device, ...] = ("auto", "cuda", "cpu")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range.

    Where it refuses one setting's value, `key` names that setting and the message reads
    "KEY: PROBLEM": `serve` names the flag that gave the value instead (`naming_flags`), as its
    user wrote no key. None where a refusal names several settings, or none. `cites`: the
    settings the message names by key besides `key` (one whose value bounds it, those a
    refusal of several names), which `serve` names by their flags too (`naming_flags`).
    """

    def __init__(self, message: str, *, key: str | None = None, cites: Sequence[str] = ()) -> None:
        super().__init__(message if key is None else f"{key}: {message}")
        self.key = key
        self.cites = tuple(cites)
        self._problem = message

    def naming(self, name: str) -> ConfigError:
        """The same refusal of `key`'s value, naming `name` (its flag) instead."""
        assert self.key is not None, "only a refusal of one setting names it"
        return self.naming_flags({self.key: name})

    def naming_flags(self, flags: Mapping[str, str]) -> ConfigError:
        """The same refusal, each setting it names (`key`, `cites`) that `flags` maps (key
        -> the flag that gave its value) named by that flag instead."""
        problem = self._problem
        for cited in self.cites:
            if cited in flags:  # "server.NAME": no setting's key starts another's
                problem = problem.replace(cited, flags[cited])
        key = None if self.key is None else flags.get(self.key, self.key)
        return ConfigError(problem, key=key, cites=self.cites)


def _is_number(value: object) -> bool:
    """A finite int or float. TOML and CLI values arrive untyped: the annotations are
    not yet true where this is called."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_size(key: str, flag: str, text: object, *, fraction_ok: bool) -> None:
    if text is None:
        return
    if not isinstance(text, str):
        like = "'6GiB', or a fraction of device memory such as '0.9'" if fraction_ok else "'6GiB'"
        raise ConfigError(f"{key}: expected a string like {like}, got {text!r}")
    try:
        parse_memory_limit(text, fraction_ok=fraction_ok)
    except ValueError as error:
        raise ConfigError(f"{key} ({flag}): {error}") from error


GRPC_INT_MAX = 2**31 - 1
# Counts and milliseconds GetModel and GetStats report travel as uint32.
UINT32_MAX = 2**32 - 1
# The longest drain: threads wait with timeouts, and an hour is longer than any rollout
# waits for one instance.
MAX_DRAIN_GRACE_S = 3_600.0
# The same bound for the delay before a drain (load balancers' checks take seconds).
MAX_DRAIN_DELAY_S = MAX_DRAIN_GRACE_S
# More session threads than this is a typo, and ONNX Runtime takes a C int.
MAX_INTRA_OP_THREADS = 1_024


def _check_int(key: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"expected an integer, got {value!r}", key=key)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"expected an integer {bound}, got {value}", key=key)


def _check_seconds(key: str, value: object, *, maximum: float) -> None:
    if not _is_number(value) or not 0 <= value <= maximum:  # type: ignore[operator]
        raise ConfigError(f"expected seconds in [0, {maximum:g}], got {value!r}", key=key)


def _check_bool(key: str, value: object) -> None:
    # A switch is TOML's true or false: "false", a string, would be true to Python.
    if not isinstance(value, bool):
        raise ConfigError(f"expected true or false, got {value!r}", key=key)


# HTTP/2's default and largest flow-control windows (RFC 9113, 6.9.1-2): the bounds of a
# set server.receive_window_bytes (a smaller one than every peer starts with is a mistake).
MIN_HTTP2_WINDOW_BYTES = 65_535
MAX_HTTP2_WINDOW_BYTES = 2**31 - 1
# What server.model_name may be: KServe and Triton clients send it in every call, to be
# matched exactly (a space at an end is invisible in a log or a config), every ModelInfer
# answer carries it (in the size held to max_message_bytes), and refusals quote it.
MAX_MODEL_NAME_BYTES = 256
MODEL_NAME_RULE = (
    f"1 to {MAX_MODEL_NAME_BYTES} bytes of UTF-8 text, without control characters or "
    "whitespace at either end"
)


def _check_model_name(value: object, served: str) -> None:
    """server.model_name (--model-name) `value`, where set; where not, the name `served`
    (`ServerConfig.served_model_name`: the model file's stem), held to the same rule (a
    file " lead.onnx" was served as " lead"). The words fit the flag as well as the key
    (`ConfigError.naming`)."""
    problem = name_problem(served if value is None else value)
    if problem is None:
        return
    if value is None:
        raise ConfigError(
            f"not set, and the model file's name without its suffix is not a name to "
            f"serve: expected {MODEL_NAME_RULE}, got {problem}; set a name for KServe "
            f"and Triton clients to call the model by",
            key="server.model_name",
        )
    raise ConfigError(f"expected {MODEL_NAME_RULE}, got {problem}", key="server.model_name")


def name_problem(value: object) -> str | None:
    """What is wrong with `value` as a name callers match exactly, MODEL_NAME_RULE's: a
    model's, a shared memory region's (what the refusal says it got)."""
    if not isinstance(value, str):  # a TOML file's value may be of any type
        return repr(value)
    try:
        size = len(value.encode())
    except UnicodeEncodeError:  # a lone surrogate: an argument's bytes were not UTF-8
        return f"{value[:32]!r}, which is not UTF-8"
    if size > MAX_MODEL_NAME_BYTES:
        return f"{size} bytes (starting {value[:32]!r})"
    controls = [char for char in value if unicodedata.category(char) == "Cc"]
    if controls:
        return f"{value!r}, which holds the control character {controls[0]!r}"
    if not value or value != value.strip():
        return repr(value)
    return None


# What a lane's name may be: it is a label of every lane metric, and clients send it.
LANE_NAME_RULE = "letters, digits, '-' and '_', at least one a letter or digit"


@dataclasses.dataclass(frozen=True, slots=True)
class LaneConfig:
    name: str
    # Bound on queued rows (not requests); a request that would exceed it is refused.
    capacity_rows: int
    # The longest an item may take in this lane, from its admission: a cap, not a default.
    # Its deadline is the earliest of this, the gRPC deadline and the request's own
    # timeout_ms, so a caller's longer timeout is cut to this (a refusal or expiry says
    # so, naming this key); a shorter one applies.
    timeout_ms: int
    # Longest a batch waits for more rows once this lane's oldest item is queued.
    max_wait_ms: int
    # Fraction of every batch's rows this lane may claim ahead of higher lanes when it
    # has work queued: the guarantee that it never starves.
    min_share: float

    def __post_init__(self) -> None:
        where = f"lanes[{self.name!r}]"
        name: object = self.name
        if (
            not isinstance(name, str)
            or not name
            or not name.replace("_", "").replace("-", "").isalnum()
        ):
            raise ConfigError(f"{where}.name: expected {LANE_NAME_RULE}, got {self.name!r}")
        _check_int(f"{where}.capacity_rows", self.capacity_rows, minimum=1, maximum=UINT32_MAX)
        _check_int(f"{where}.timeout_ms", self.timeout_ms, minimum=1, maximum=UINT32_MAX)
        _check_int(f"{where}.max_wait_ms", self.max_wait_ms, minimum=0, maximum=UINT32_MAX)
        if not _is_number(self.min_share) or not 0.0 <= self.min_share < 1.0:
            raise ConfigError(
                f"{where}.min_share: expected a number in [0, 1), got {self.min_share!r}"
            )

    def check_rows(self, rows: int) -> None:
        """Refuses a request of more rows than this lane holds: it could never be queued.
        Asked by admission, and by the servicer before it decodes a request."""
        if rows > self.capacity_rows:
            raise InvalidInputError(
                f"request has {rows} rows; lane {self.name!r} holds at most "
                f"{self.capacity_rows} rows (split it, or use a lane with more capacity)"
            )

    def deadline_s(self, now_s: float, own_deadline_s: float | None) -> float:
        """An item's effective deadline: its own (gRPC deadline or timeout_ms, already
        the earlier of the two) or the lane's timeout from `now_s`, whichever is earlier.
        The one place this rule lives; with `now_s` = 0 it gives the budget in seconds."""
        lane_deadline_s = now_s + self.timeout_ms / 1000
        return lane_deadline_s if own_deadline_s is None else min(lane_deadline_s, own_deadline_s)


DEFAULT_LANES: tuple[LaneConfig, ...] = (
    LaneConfig("interactive", capacity_rows=512, timeout_ms=2_000, max_wait_ms=1, min_share=0.0),
    LaneConfig("standard", capacity_rows=2_048, timeout_ms=10_000, max_wait_ms=4, min_share=0.1),
    LaneConfig("bulk", capacity_rows=16_384, timeout_ms=120_000, max_wait_ms=20, min_share=0.05),
)
# The lane of a request that names none, unless server.default_lane says otherwise: one
# of DEFAULT_LANES, so a config with lanes of its own must name one of them.
DEFAULT_LANE = "standard"
# Where lanes closed by memory pressure reopen, as a fraction of the limit; a limit that
# holds the idle server below it leaves the usual room (memory_start._check_idle_memory).
DEFAULT_MEMORY_LOW_WATERMARK = 0.85


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    model_path: str
    # The model's name to KServe v2 / Triton clients (ModelInfer's model_name, the
    # metadata RPCs); None: the model file's name without its suffix (`served_model_name`).
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    # A second port for latency-critical callers, in front of the same lanes: gRPC's
    # core queues the calls the event loop has not yet taken per port (this one bounded
    # by priority_max_pending_calls), so a call here never waits behind a flood queued on
    # `port`. Lanes order calls only once the event loop has taken them. 0 = any free
    # port (logged at start), -1 = none.
    priority_port: int = -1
    # KServe v2's HTTP/REST protocol with Triton's extensions (server/kserve_http.py), on
    # `host`, in front of the same lanes as `port` (and of its default lane), with TLS
    # as the gRPC port has it. 0 = any free port (logged at start), -1 = none (the
    # default: Triton serves it on 8000).
    http_port: int = -1
    # Upper bound of the batch cap (rows per session run).
    max_batch_size: int = 128
    # Lanes, highest priority first.
    lanes: tuple[LaneConfig, ...] = DEFAULT_LANES
    default_lane: str = DEFAULT_LANE
    device: Device = "auto"
    # On SIGTERM/SIGINT queued work may finish within this time; the rest is refused.
    drain_grace_s: float = 10.0
    # Seconds a stop signal leaves the server admitting and serving with its health
    # NOT_SERVING before it drains (drain_grace_s counts after it): a load balancer's
    # health checks (a readiness probe every second or more) see it leaving before it
    # refuses any call. 0: the drain begins at the signal.
    drain_delay_s: float = 0.0
    # Inference calls (Infer, InferStream and KServe's ModelInfer, ModelStreamInfer) in
    # progress on a port at once (streams count one each, at most half of it; GetModel,
    # GetStats and health checks none); past it a call is refused RESOURCE_EXHAUSTED
    # before the servicer runs (grpc_accept.CallGate). It is blind to lanes, so it sits
    # above what the lanes hold in ordinary use (the bulk lane's 16 384 rows are 2 048
    # calls of 8 rows): a full lane refuses by priority first. At 1 024 a unary bulk flood
    # took every slot and interactive calls were refused (bench/README.md, (c)).
    # The calls still waiting in gRPC's core are bounded by max_pending_calls.
    max_concurrent_rpcs: int = 4096
    # Calls gRPC's core may hold that the event loop has not yet taken (the backlog in
    # front of the lanes, priority- and deadline-blind). Above three quarters of it the
    # core refuses new calls at random, with a probability rising to 1 at the limit
    # (random early detection), before any Python runs: an overload the event loop cannot
    # read is shed where shedding is cheap, and what gets through is fresher. Refused
    # calls end CANCELLED and never ran (safe to retry). gRPC's own default is 3 000
    # (1 000 soft): over a second of calls on 2 cores. 256 refuses nothing below ~190
    # calls in flight (its queue held ~0.2 s under 300 % overload here); deadline-bound
    # deployments size it near deadline x throughput / 2 (README, Lanes).
    max_pending_calls: int = 256
    # The same bound for the priority port's own queue. Its callers are latency-bound,
    # so it is sized in time, not for bursts: a call held longer than its deadline in a
    # queue the lanes cannot see is worse than one refused at once (CANCELLED, retried).
    # With the event loop taking ~500-1 000 calls/s under overload here, 24 holds
    # ~20-50 ms: at 300 % with 100 ms deadlines its p99 stayed near or under 100 ms in
    # three runs, 32's went over in two of three, and at 256 every call was late
    # (bench/README.md, the pending-limit sweep). Refusals start at 18 calls unread.
    priority_max_pending_calls: int = 24
    # gRPC's own message size limit, both directions.
    max_message_bytes: int = 64 * 1024 * 1024
    # Whether gRPC takes compressed (gzip, deflate) requests. It inflates each up to
    # max_message_bytes before the server reads it, however small the compressed body (a
    # 78 KiB body took 0.4 s to inflate to the 64 MiB limit and be refused; 32 at once
    # raised other callers' p99 to 0.8 s): false refuses them UNIMPLEMENTED on their
    # header, before any inflating, where clients may be hostile. Answers are never
    # compressed.
    compressed_requests: bool = True
    # Whether KServe v2 / Triton callers on this host (loopback peers) may
    # register POSIX shared memory regions and have ModelInfer read inputs from and write
    # outputs to them (Triton's system shared memory, server/shared_memory.py). Callers
    # elsewhere never may: a region is a file of this host's /dev/shm. Off by default:
    # a caller that may reads and writes any object of /dev/shm the server's user can,
    # and a proxy on the host (a service mesh's sidecar) makes remote callers look local.
    # Off, it is all refused PERMISSION_DENIED.
    shared_memory: bool = False
    # ONNX Runtime intra-op threads; 0: auto (on the CPU one core fewer than the
    # process may use, its cgroup's CPU quota included, left to the event loop; see
    # providers.default_intra_op_threads).
    intra_op_threads: int = 0
    # Prometheus scrape endpoint (GET /metrics) on `host`: 0 = any free port (logged at
    # start), -1 = no endpoint (and no metric is recorded).
    metrics_port: int = 9464
    # Fixes the batch cap instead of probing the memory limit for it (max_batch_size
    # still bounds it); an out-of-memory at run time lowers it as usual.
    batch_cap: int | None = None
    # Hard limit on the session's device memory: bytes ("6GiB") or a fraction of the
    # device ("0.9"). None: 0.9 on a GPU, the runtime's own default on the CPU.
    memory_limit: str | None = None
    # Admission watermarks, as fractions of the GPU's total memory (or of
    # host_memory_limit on the CPU): at `high` the lowest lane stops admitting,
    # more lanes as memory nears the limit; all reopen below `low`.
    memory_high_watermark: float = 0.95
    memory_low_watermark: float = DEFAULT_MEMORY_LOW_WATERMARK
    # CPU only: the process's resident memory the watermarks refer to ("8GiB").
    # None: the least memory limit of the process's cgroups (a container's), as logged
    # (host_memory_limit_from_cgroup); no watermark on the CPU without one (the arena
    # cap still holds).
    host_memory_limit: str | None = None
    # Requests one stream (InferStream, ModelStreamInfer) may have read and not yet
    # answered; the stream is not read further until one of them is answered, so a fast
    # producer cannot flood the lanes.
    stream_window: int = 256
    # Bytes of tensor data in one stream's answers not yet written, those not yet
    # finished counted at the stream's largest answer (streams.StreamWindow): while they
    # come to it or more the stream reads no more items, so a caller that reads slowly
    # holds about this much, not stream_window answers (256 MiB of 1 MiB ones). A reader
    # that keeps up has this much of answers in flight: at 16 MiB ~40 ms of writing (a
    # Python client reads ~400 MiB/s on loopback). An answer larger than it goes alone.
    stream_answer_buffer_bytes: int = 16 * 1024 * 1024
    # The HTTP/2 flow-control window of each call's request stream, in bytes: what gRPC's
    # core takes off a connection ahead of laneserve reading it (app.receive_window_options).
    # 0: gRPC's own sizing by bandwidth-delay probes, which let 16 streams of 1 MiB items
    # whose server read no more take it to 1.1-2.6 GiB, 0.57-0.61 GiB at 4 MiB, read
    # throughput on loopback the same (scripts/bench_unread_streams.py, two runs). A fixed
    # window caps a stream at a window a round trip: 80 MiB/s at 50 ms.
    receive_window_bytes: int = 4 * 1024 * 1024
    # Idempotency by request_id: answers of completed requests are kept for replay to a
    # retry, bounded by count, bytes and age. 0 entries turns the replay off (a retry that
    # arrives while its request is still queued or running joins it regardless).
    idempotency_max_entries: int = 100_000
    idempotency_max_bytes: int = 256 * 1024 * 1024
    idempotency_ttl_s: float = 600.0
    # TLS on the gRPC port (PEM file paths). With tls_cert and tls_key the port speaks
    # TLS only; with tls_client_ca as well, a client must present a certificate signed by
    # that CA (mutual TLS). None: plaintext. The metrics endpoint follows: HTTPS with the
    # same certificate, requiring client certificates where the gRPC port does.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # Input name -> its shape after the row axis, for the start-up probe's zero-filled
    # inputs (e.g. {"image": (3, 224, 224)}). Dynamic dimensions it does not name are 1,
    # which some models refuse (a 3x3 convolution over a 1x1 image).
    probe_shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("host", "default_lane"):
            value: object = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ConfigError(
                    f"expected a non-empty string, got {value!r}", key=f"server.{key}"
                )
        _check_model_name(self.model_name, self.served_model_name)
        _check_int("server.port", self.port, minimum=0, maximum=65_535)
        _check_int("server.priority_port", self.priority_port, minimum=-1, maximum=65_535)
        _check_int("server.http_port", self.http_port, minimum=-1, maximum=65_535)
        _check_int("server.max_batch_size", self.max_batch_size, minimum=1, maximum=UINT32_MAX)
        if self.batch_cap is not None:
            _check_int("server.batch_cap", self.batch_cap, minimum=1)
            if self.batch_cap > self.max_batch_size:  # a bound the caller may not have set
                raise ConfigError(
                    f"expected at most server.max_batch_size ({self.max_batch_size}), got "
                    f"{self.batch_cap}; raise max_batch_size (--max-batch-size) for a larger cap",
                    key="server.batch_cap",
                    cites=("server.max_batch_size",),
                )
        # gRPC takes these as C ints.
        _check_int(
            "server.max_message_bytes", self.max_message_bytes, minimum=1024, maximum=GRPC_INT_MAX
        )
        _check_int(
            "server.max_concurrent_rpcs", self.max_concurrent_rpcs, minimum=1, maximum=GRPC_INT_MAX
        )
        _check_bool("server.compressed_requests", self.compressed_requests)
        _check_bool("server.shared_memory", self.shared_memory)
        _check_int(
            "server.max_pending_calls", self.max_pending_calls, minimum=1, maximum=GRPC_INT_MAX
        )
        _check_int(
            "server.priority_max_pending_calls",
            self.priority_max_pending_calls,
            minimum=1,
            maximum=GRPC_INT_MAX,
        )
        _check_int(
            "server.intra_op_threads",
            self.intra_op_threads,
            minimum=0,
            maximum=MAX_INTRA_OP_THREADS,
        )
        _check_int("server.metrics_port", self.metrics_port, minimum=-1, maximum=65_535)
        self._check_ports_distinct()
        self._check_stream_bounds()
        _check_int("server.idempotency_max_entries", self.idempotency_max_entries, minimum=0)
        _check_int("server.idempotency_max_bytes", self.idempotency_max_bytes, minimum=0)
        if not _is_number(self.idempotency_ttl_s) or not 0 <= self.idempotency_ttl_s < math.inf:
            raise ConfigError(
                "server.idempotency_ttl_s: expected finite seconds >= 0, "
                f"got {self.idempotency_ttl_s!r}"
            )
        _check_size("server.memory_limit", "--memory-limit", self.memory_limit, fraction_ok=True)
        _check_size(
            "server.host_memory_limit",
            "--host-memory-limit",
            self.host_memory_limit,
            fraction_ok=False,
        )
        low: object = self.memory_low_watermark
        high: object = self.memory_high_watermark
        if not (_is_number(low) and _is_number(high) and 0 < low <= high <= 1):  # type: ignore[operator]
            raise ConfigError(
                "server.memory_low_watermark, server.memory_high_watermark: expected "
                f"0 < low <= high <= 1, got low={low!r} high={high!r}"
            )
        self._check_tls()
        object.__setattr__(self, "probe_shapes", _parse_probe_shapes(self.probe_shapes))
        if self.device not in DEVICES:
            raise ConfigError(f"server.device: expected one of {DEVICES}, got {self.device!r}")
        _check_seconds("server.drain_grace_s", self.drain_grace_s, maximum=MAX_DRAIN_GRACE_S)
        _check_seconds("server.drain_delay_s", self.drain_delay_s, maximum=MAX_DRAIN_DELAY_S)
        if not self.lanes:
            raise ConfigError("lanes: expected at least one lane")
        names = [lane.name for lane in self.lanes]
        if len(set(names)) != len(names):
            raise ConfigError(f"lanes: names must be unique, got {names}")
        if self.default_lane not in names:
            unset = (
                f" ({DEFAULT_LANE!r} is the default of server.default_lane; with [[lanes]] "
                "that have no lane of that name, set default_lane in [server] to one of them)"
                if self.default_lane == DEFAULT_LANE
                else ""
            )
            raise ConfigError(
                f"server.default_lane: expected one of {names}, got {self.default_lane!r}{unset}"
            )
        total_share = sum(lane.min_share for lane in self.lanes)
        if total_share >= 1.0:
            raise ConfigError(f"lanes: min_share must sum to less than 1, got {total_share:g}")

    @property
    def served_model_name(self) -> str:
        """The model's name to KServe v2 clients: `model_name`, else the model file's stem
        ("demo" for models/demo.onnx)."""
        return self.model_name or PurePath(self.model_path).stem

    def lane(self, name: str) -> LaneConfig:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)

    def _check_stream_bounds(self) -> None:
        _check_int("server.stream_window", self.stream_window, minimum=1, maximum=UINT32_MAX)
        _check_int("server.stream_answer_buffer_bytes", self.stream_answer_buffer_bytes, minimum=1)
        window = self.receive_window_bytes
        _check_int("server.receive_window_bytes", window, minimum=0, maximum=MAX_HTTP2_WINDOW_BYTES)
        if 0 < window < MIN_HTTP2_WINDOW_BYTES:  # 4096 meant as KiB capped streams at 4 KiB
            raise ConfigError(
                f"expected 0 (gRPC's own sizing) or {MIN_HTTP2_WINDOW_BYTES} to "
                f"{MAX_HTTP2_WINDOW_BYTES} bytes, got {window}",
                key="server.receive_window_bytes",
            )

    def _check_ports_distinct(self) -> None:
        """Two listeners on one fixed port: refused here, before the model loads, not by
        the second bind after it (0, any free port, and -1, none, never collide)."""
        fixed: dict[int, str] = {}
        for key in ("port", "priority_port", "http_port", "metrics_port"):
            port: int = getattr(self, key)
            if port <= 0:
                continue
            if port in fixed:
                raise ConfigError(
                    f"expected a port other than server.{fixed[port]}, got {port} for both",
                    key=f"server.{key}",
                    cites=(f"server.{fixed[port]}",),
                )
            fixed[port] = key

    def _check_tls(self) -> None:
        for key in ("tls_cert", "tls_key", "tls_client_ca"):
            path: object = getattr(self, key)
            if path is not None and (not isinstance(path, str) or not path):
                raise ConfigError(f"expected a PEM file path, got {path!r}", key=f"server.{key}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(
                "server.tls_cert, server.tls_key: expected both (TLS) or neither (plaintext), "
                f"got tls_cert={self.tls_cert!r} tls_key={self.tls_key!r}",
                cites=("server.tls_cert", "server.tls_key"),
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError(
                "mutual TLS needs the server's own tls_cert and tls_key too; expected all three",
                key="server.tls_client_ca",
            )


def _parse_probe_shapes(raw: object) -> dict[str, tuple[int, ...]]:
    expected = "expected a table of input name = [dimension, ...] (sizes after the row axis)"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"server.probe_shapes: {expected}, got {raw!r}")
    shapes = {}
    for name, dims in raw.items():
        if (
            not isinstance(name, str)
            or isinstance(dims, str)
            or not isinstance(dims, Sequence)
            or not all(isinstance(dim, int) and not isinstance(dim, bool) for dim in dims)
            or not all(1 <= dim <= UINT32_MAX for dim in dims)
        ):
            raise ConfigError(
                f"server.probe_shapes: {expected} of positive integers, got {name!r} = {dims!r}"
            )
        shapes[name] = tuple(dims)
    return shapes


_SERVER_KEYS = frozenset(
    f.name for f in dataclasses.fields(ServerConfig) if f.name not in ("lanes", "model_path")
)
_LANE_KEYS = frozenset(f.name for f in dataclasses.fields(LaneConfig))


def load_config(
    path: str | Path | None, *, model_path: str, overrides: Mapping[str, Any] | None = None
) -> ServerConfig:
    """Reads `path` (TOML) if given, applies `overrides` (CLI flags, None = unset)."""
    document: dict[str, Any] = {}
    if path is not None:
        try:
            # utf-8-sig: a byte-order mark, which editors on Windows write, is no error.
            document = tomllib.loads(_config_bytes(path).decode("utf-8-sig"))
        except OSError as error:
            raise ConfigError(
                f"config file {path}: {error.strerror}; expected a readable TOML file"
            ) from error
        except UnicodeDecodeError as error:
            raise ConfigError(
                f"config file {path}: not UTF-8 text ({error.reason}); expected TOML in UTF-8"
            ) from error
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {path}: {error}; expected valid TOML") from error
    return config_from_mapping(document, model_path=model_path, overrides=overrides)


# A config file's bound: a few KiB in practice; /dev/zero was read until memory ran out.
MAX_CONFIG_BYTES = 1024 * 1024


def _config_bytes(path: str | Path) -> bytes:
    """The file's bytes, at most MAX_CONFIG_BYTES, refused (ConfigError) where it is a
    device (/dev/zero was read until memory ran out) or over the bound. A pipe is read
    as a file is (`--config <(envsubst < template.toml)` names one), waiting for its
    writer as any reader of a pipe does (`_read_waiting`)."""
    file_path = Path(path)
    kind = file_path.stat().st_mode
    # A directory: open() refuses it in its words ("Is a directory").
    if not (stat.S_ISREG(kind) or stat.S_ISFIFO(kind) or stat.S_ISDIR(kind)):
        raise ConfigError(f"config file {path}: a device; expected a readable TOML file")
    data = _read_waiting(file_path) if stat.S_ISFIFO(kind) else _read(file_path)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {path}: over {MAX_CONFIG_BYTES} bytes; expected a TOML file of "
            "server settings and lanes"
        )
    return data


def _read(path: Path) -> bytes:
    with path.open("rb") as file:
        return file.read(MAX_CONFIG_BYTES + 1)


def _read_waiting(path: Path) -> bytes:
    """A pipe's bytes, read on a thread of its own while this one waits in short turns:
    blocked in the read itself, the main thread never ran the stop signals' handlers
    when the kernel gave a signal to another thread (the process has a few by then), and
    a SIGTERM while a pipe's writer was slow left the process running (`serve` has not
    taken signals over yet)."""
    read: list[bytes] = []
    failed: list[OSError] = []

    def run() -> None:
        try:
            read.append(_read(path))
        except OSError as error:
            failed.append(error)

    reader = threading.Thread(target=run, name="laneserve-config", daemon=True)
    reader.start()
    while reader.is_alive():
        reader.join(0.1)
    if failed:
        raise failed[0]
    return read[0]


def config_from_mapping(
    document: Mapping[str, Any],
    *,
    model_path: str,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    unknown = set(document) - {"server", "lanes"}
    if unknown:
        raise ConfigError(
            f"unknown top-level key(s) {sorted(unknown)}; expected [server], [[lanes]]"
        )
    server = document.get("server", {})
    if not isinstance(server, Mapping):
        raise ConfigError("server: expected a table")
    _refuse_unknown("server", server, _SERVER_KEYS)
    settings: dict[str, Any] = dict(server)
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    _refuse_unknown("overrides", given, _SERVER_KEYS)
    if "probe_shapes" in settings and "probe_shapes" in given:
        # Per input: a flag for one input keeps the file's shapes of the others. The file's
        # are checked first: merged, a mistyped one was replaced by the flag's unseen.
        files = _parse_probe_shapes(settings["probe_shapes"])
        given["probe_shapes"] = {**files, **given["probe_shapes"]}
    settings.update(given)
    if "lanes" in document:
        settings["lanes"] = _parse_lanes(document["lanes"])
    return ServerConfig(model_path=model_path, **settings)


def _parse_lanes(raw: object) -> tuple[LaneConfig, ...]:
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise ConfigError("lanes: expected an array of tables ([[lanes]])")
    lanes = []
    for index, entry in enumerate(raw):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"lanes[{index}]: expected a table")
        _refuse_unknown(f"lanes[{index}]", entry, _LANE_KEYS)
        missing = _LANE_KEYS - set(entry)
        if missing:
            raise ConfigError(f"lanes[{index}]: missing key(s) {sorted(missing)}")
        if not isinstance(entry["name"], str):  # named by its index: lanes[5] misled
            raise ConfigError(
                f"lanes[{index}].name: expected a string of {LANE_NAME_RULE}, got {entry['name']!r}"
            )
        lanes.append(LaneConfig(**entry))
    return tuple(lanes)


def _refuse_unknown(where: str, table: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = set(table) - known
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {sorted(unknown)}; expected some of {sorted(known)}"
        )
