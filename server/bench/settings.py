"""What a benchmark run measures: traffic streams, load points and the run profiles.

A *stream* is one kind of traffic (a lane, a request size, an arrival process); a *point*
is a set of streams offered together to one configuration and measured until stable; a
*profile* fixes the timing and the grid of points.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final, Literal, cast

# (a)-(d): issue 6's scenarios; (x): the caller's own mix of streams (`--mix`).
ScenarioId = Literal["a", "b", "c", "d", "x"]
DeadlineIn = Literal["timeout_ms", "grpc"]
# How a stream's requests travel: one unary Infer each, or as items of one InferStream
# per client process (the bulk API: the server reads a stream only as fast as its
# window of unanswered items allows).
Via = Literal["unary", "stream"]
# Which of the server's ports a stream's calls go to: its main port, or its priority port
# (`laneserve serve --priority-port`: calls there are queued apart in gRPC's core).
Port = Literal["main", "priority"]
SCENARIOS: Final[tuple[ScenarioId, ...]] = ("a", "b", "c", "d", "x")
# What a run measures unless told otherwise: the scenarios.
DEFAULT_SCENARIOS: Final[tuple[ScenarioId, ...]] = ("a", "b", "c", "d")
SCENARIO_TITLES: Final[dict[ScenarioId, str]] = {
    "a": "saturation throughput by concurrency (closed loop, single row)",
    "b": "latency at a fraction of capacity (open loop, Poisson arrivals, single row)",
    "c": "priority isolation: interactive at 10 % of capacity, bulk offered at 200 %",
    "d": "overload at 300 % of capacity with 100 ms deadlines",
    "x": "the given mix of streams (--mix)",
}

# The point of (c) that measures the bulk lane's capacity (closed loop, bulk alone), whose
# rows/s set the bulk rate of the points after it.
BULK_SATURATION: Final = "bulk alone, closed loop"

# The initial metadata key under which a baseline server names itself (its pid) in its
# GetModel answers: each load generator connection asks once, when it opens, so the
# calls it carries can be counted by the worker that answered them (the N-workers
# baseline behind one SO_REUSEPORT port), at no cost on the Infer path being measured.
WORKER_METADATA_KEY: Final = "laneserve-bench-worker"
# The load generator's heartbeat: ticks due on a fixed grid this far apart, each
# recording how late the event loop ran it (summary.StreamWindow.loop_late_s).
HEARTBEAT_S: Final = 0.01
# Cores that processes other than the ones measured (the server's, the clients', the
# harness's own: its orchestrator and py-spy, `host.harness_cores`) may keep busy while a
# point runs before it is marked busy: its figures describe a machine shared with a
# neighbour, and no target verdict is read from it. Quiet runs on the 2-core development
# machine left 0.00-0.09 cores to others while the orchestrator (0.01-0.08 cores: reading
# /proc, GetStats) was still counted there; the rest is the kernel's loopback work, which
# no process is charged for. py-spy (250 Hz, all threads) takes 0.20-0.25 cores at the
# point it samples: counted as others, it could make that point busy alone. Contended
# runs left 0.4-1.2, where echo at 32 callers gave a quarter to a half of its quiet
# throughput and verdicts flipped between identical runs. A quarter of a core is well
# above the first, and an eighth of such a machine.
BUSY_OTHER_CORES: Final = 0.25

# Configurations the harness can start, in the order it runs them. The first is the
# system under test; the others are the baselines of the issue.
ConfigurationKind = Literal["laneserve", "echo", "no-batching", "workers"]
CONFIGURATION_KINDS: Final[tuple[ConfigurationKind, ...]] = (
    "laneserve",
    "echo",
    "no-batching",
    "workers",
)

# A request with a deadline is also given a gRPC deadline this much later, so that the
# server's own answer (EXPIRED_IN_QUEUE, DEADLINE_UNMEETABLE or a late result, with its
# timing) reaches the client instead of the client's cancellation.
DEADLINE_SLACK_S: Final = 1.0
# Stability is agreement between windows: at least two of them.
MIN_STABLE_WINDOWS: Final = 2
# The longest warm-up or window: finite (a sleep takes no nan or inf), and an hour
# measures any steady state.
MAX_WINDOW_S: Final = 3600.0
# The gRPC deadline of a request without a deadline of its own.
CALL_TIMEOUT_S: Final = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class Stream:
    """One kind of traffic in a load point.

    Exactly one of `concurrency` (closed loop: that many callers, each sending its next
    request when the previous one is answered) and `rate_per_s` (open loop: Poisson
    arrivals, requests per second) is positive.
    """

    label: str
    # Sent as InferRequest.lane; "" asks for the server's default lane.
    lane: str = ""
    rows: int = 1
    concurrency: int = 0
    rate_per_s: float = 0.0
    # The bound of goodput; None: no deadline, and goodput equals throughput.
    deadline_ms: int | None = None
    # How the server is told the deadline. "timeout_ms": as InferRequest.timeout_ms, with
    # a gRPC deadline DEADLINE_SLACK_S later, so every answer (and its Timing) reaches the
    # client, late ones included; "grpc": as the gRPC deadline alone, as a plain client
    # would, so an answer later than the deadline is never seen.
    deadline_in: DeadlineIn = "timeout_ms"
    via: Via = "unary"
    port: Port = "main"
    # Pins the stream to one client process (index modulo the pool's size), with its own
    # connections and event loop, as a separate service would be; None: every process
    # sends a share of it.
    client: int | None = None

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"stream {self.label!r}: rows must be >= 1, got {self.rows}")
        if (self.concurrency > 0) == (self.rate_per_s > 0):
            raise ValueError(
                f"stream {self.label!r}: expected exactly one of concurrency > 0 (closed loop)"
                f" or rate_per_s > 0 (open loop), got concurrency={self.concurrency}, "
                f"rate_per_s={self.rate_per_s}"
            )
        if self.concurrency < 0 or self.rate_per_s < 0:
            raise ValueError(f"stream {self.label!r}: concurrency and rate must be >= 0")
        if self.deadline_ms is not None and self.deadline_ms < 1:
            raise ValueError(
                f"stream {self.label!r}: deadline_ms must be >= 1, got {self.deadline_ms}"
            )

    @property
    def mode(self) -> Literal["closed", "open"]:
        return "closed" if self.concurrency > 0 else "open"

    @property
    def call_timeout_s(self) -> float:
        if self.deadline_ms is None:
            return CALL_TIMEOUT_S
        if self.deadline_in == "grpc":
            return self.deadline_ms / 1000
        return self.deadline_ms / 1000 + DEADLINE_SLACK_S

    @property
    def timeout_ms(self) -> int:
        """InferRequest.timeout_ms (0: none)."""
        if self.deadline_ms is None or self.deadline_in == "grpc":
            return 0
        return self.deadline_ms

    def share(self, index: int, parts: int) -> tuple[int, float]:
        """(callers, arrivals per second) of client process `index` of `parts`: callers
        are dealt out one by one (a process may get none), the rate is split evenly. A
        pinned stream (`client`) goes whole to its one process."""
        if self.client is not None:
            if index != self.client % parts:
                return 0, 0.0
            return self.concurrency, self.rate_per_s
        if self.concurrency > 0:
            return self.concurrency // parts + (1 if index < self.concurrency % parts else 0), 0.0
        return 0, self.rate_per_s / parts


# The keys of a `--mix` stream and what each expects, for the parser and its errors.
MIX_KEYS: Final[dict[str, str]] = {
    "label": "a name for the report (default: the lane)",
    "lane": "the lane to ask for (default: the server's default lane)",
    "rows": "rows per request (default 1)",
    "callers": "closed loop: that many callers",
    "rate": "open loop: requests/s, or N% of the capacity (a) measured, in rows",
    "deadline_ms": "the deadline goodput counts against",
    "deadline_in": "timeout_ms (default) or grpc",
    "via": "unary (default) or stream (InferStream)",
    "port": "main (default) or priority",
    "client": "pin to one client process (index)",
}


@dataclasses.dataclass(frozen=True, slots=True)
class MixStream:
    """A stream given on the command line (`--mix`). Its open-loop rate may be a share of
    the capacity scenario (a) measures, known only once (a) has run."""

    # The stream as given; with a share, its rate_per_s is the share until `stream()`.
    template: Stream
    # A share of the capacity in rows/s: requests/s = share x capacity / rows.
    capacity_share: float | None = None
    spec: str = ""  # as given, for the report

    @classmethod
    def parse(cls, text: str) -> MixStream:
        """`lane=interactive,rate=10%,deadline_ms=50`: comma-separated key=value pairs
        (MIX_KEYS); raises ValueError naming what was wrong and what was expected."""
        values: dict[str, str] = {}
        for part in (part.strip() for part in text.split(",")):
            key, equals, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not equals or not value:
                raise ValueError(f"--mix {text!r}: expected key=value, got {part!r}")
            if key not in MIX_KEYS:
                raise ValueError(
                    f"--mix {text!r}: unknown key {key!r}; expected some of {list(MIX_KEYS)}"
                )
            if key in values:
                raise ValueError(f"--mix {text!r}: {key} given twice")
            values[key] = value

        def choice(key: str, choices: tuple[str, ...]) -> str:
            value = values.get(key, choices[0])
            if value not in choices:
                raise ValueError(
                    f"--mix {text!r}: {key}={value!r}; expected one of {list(choices)}"
                )
            return value

        if ("callers" in values) == ("rate" in values):
            raise ValueError(
                f"--mix {text!r}: expected exactly one of callers=N (closed loop) or "
                "rate=R (open loop: requests/s, or N% of the capacity)"
            )
        rate, share = values.get("rate", "0"), None
        if rate.endswith("%"):
            share = _mix_number(text, "rate", rate.removesuffix("%")) / 100
        try:
            template = Stream(
                label=values.get("label", values.get("lane") or "default"),
                lane=values.get("lane", ""),
                rows=_mix_int(text, "rows", values.get("rows", "1")),
                concurrency=_mix_int(text, "callers", values.get("callers", "0")),
                rate_per_s=share if share is not None else _mix_number(text, "rate", rate),
                deadline_ms=(
                    _mix_int(text, "deadline_ms", values["deadline_ms"])
                    if "deadline_ms" in values
                    else None
                ),
                deadline_in=cast(DeadlineIn, choice("deadline_in", ("timeout_ms", "grpc"))),
                via=cast(Via, choice("via", ("unary", "stream"))),
                port=cast(Port, choice("port", ("main", "priority"))),
                client=_mix_int(text, "client", values["client"]) if "client" in values else None,
            )
        except ValueError as error:
            if str(error).startswith("--mix"):
                raise
            raise ValueError(f"--mix {text!r}: {error}") from None
        return cls(template, share, text)

    @property
    def label(self) -> str:
        return self.template.label

    def stream(self, *, capacity_per_s: float | None) -> Stream:
        """The Stream to offer; `capacity_per_s` (single rows/s) resolves a share."""
        if self.capacity_share is None:
            return self.template
        if capacity_per_s is None:
            raise ValueError(f"--mix {self.label}: a rate in % needs scenario (a) first")
        rate = self.capacity_share * capacity_per_s / self.template.rows
        return dataclasses.replace(self.template, rate_per_s=rate)


def _mix_int(text: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--mix {text!r}: {key}={value!r}; expected an integer") from None


def _mix_number(text: str, key: str, value: str) -> float:
    """A rate: 0 (absent) or a positive, finite number."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise ValueError(
            f"--mix {text!r}: {key}={value!r}; expected a positive number (per s) or N%"
        )
    return number


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    """Streams offered together to one configuration and measured until stable."""

    scenario: ScenarioId
    # Short name within its scenario, e.g. "c=32", "80%", "with bulk".
    name: str
    streams: tuple[Stream, ...]

    def __post_init__(self) -> None:
        labels = [stream.label for stream in self.streams]
        if not labels or len(set(labels)) != len(labels):
            raise ValueError(f"point {self.name!r}: expected unique stream labels, got {labels}")


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    """Timing and the grid of a run. Every figure is measured over windows after a warm-up;
    windows repeat until the last `stable_windows` agree within `tolerance` of their smallest
    value (throughput and median latency of every stream; see summary.is_stable) or
    `max_windows` have run."""

    name: str
    warmup_s: float
    window_s: float
    stable_windows: int
    max_windows: int
    tolerance: float
    # Scenario (a): closed-loop callers per point.
    concurrencies: tuple[int, ...]
    # Scenario (b): offered load as a fraction of laneserve's saturation throughput.
    load_fractions: tuple[float, ...]
    # Process counts of the N-workers baseline.
    workers: tuple[int, ...]
    # Scenarios run on the no-batching and N-workers baselines ("a" always runs).
    baseline_scenarios: tuple[ScenarioId, ...]
    # Raw ceiling: seconds of back-to-back runs per batch size.
    raw_seconds_per_size: float
    # Scenario (c): rows per bulk request and the offered fractions.
    bulk_rows: int = 8
    interactive_fraction: float = 0.10
    bulk_fraction: float = 2.0
    # Scenario (d).
    overload_fraction: float = 3.0
    overload_deadline_ms: int = 100

    def __post_init__(self) -> None:
        if self.stable_windows < MIN_STABLE_WINDOWS or self.max_windows < self.stable_windows:
            raise ValueError(
                f"profile {self.name!r}: expected 2 <= stable_windows <= max_windows, got "
                f"{self.stable_windows} and {self.max_windows}"
            )
        # Written so that nan fails every comparison, and so is refused.
        if not (
            0 <= self.warmup_s <= MAX_WINDOW_S
            and 0 < self.window_s <= MAX_WINDOW_S
            and 0 < self.tolerance < 1
        ):
            raise ValueError(
                f"profile {self.name!r}: expected warmup_s in [0, {MAX_WINDOW_S:g}], window_s "
                f"in (0, {MAX_WINDOW_S:g}] and tolerance in (0, 1), got {self.warmup_s}, "
                f"{self.window_s}, {self.tolerance}"
            )
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"profile {self.name!r}: concurrencies must be >= 1")
        if not self.workers or min(self.workers) < 1:
            raise ValueError(f"profile {self.name!r}: worker counts must be >= 1")


PROFILES: Final[dict[str, Profile]] = {
    # About two minutes on a 2-core machine: enough to see each ratio, not to trust its
    # second digit.
    "quick": Profile(
        name="quick",
        warmup_s=0.5,
        window_s=1.0,
        stable_windows=2,
        max_windows=3,
        tolerance=0.10,
        concurrencies=(1, 32, 64),
        load_fractions=(0.5, 0.8, 0.95),
        workers=(2,),
        baseline_scenarios=("a",),
        raw_seconds_per_size=0.4,
    ),
    # The figures for the report: longer windows, the whole grid, every baseline scenario.
    "full": Profile(
        name="full",
        warmup_s=2.0,
        window_s=3.0,
        stable_windows=3,
        max_windows=8,
        tolerance=0.10,
        concurrencies=(1, 4, 16, 32, 64, 128),
        load_fractions=(0.5, 0.8, 0.95),
        workers=(2, 4),
        baseline_scenarios=("a", "b", "c", "d", "x"),
        raw_seconds_per_size=2.0,
    ),
    # For the harness's own tests: every code path, no meaningful figure.
    "smoke": Profile(
        name="smoke",
        warmup_s=0.1,
        window_s=0.3,
        stable_windows=2,
        max_windows=2,
        tolerance=0.5,
        concurrencies=(2,),
        load_fractions=(0.5,),
        workers=(2,),
        baseline_scenarios=("a",),
        raw_seconds_per_size=0.05,
        bulk_rows=4,
    ),
}
